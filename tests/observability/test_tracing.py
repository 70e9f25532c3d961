"""OpenTelemetry tracing: two real training steps traced, in-process and across HTTP, and into a
real trace server (Arize Phoenix) when its environment is installed (.ci/run installs it).

Each traced run is a subprocess (tests/support/traced_training.py): OpenTelemetry's global tracer
provider is set once per process, and the rest of the suite runs with tracing off.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from art.server.thread import ServerThread

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parents[1] / "support" / "traced_training.py"
PHOENIX = Path(os.environ.get("ART_PHOENIX_VENV", Path(__file__).parents[2] / ".venv-phoenix")) / "bin" / "phoenix"
PHASES = {"art.train.pack", "art.train.forward_backward", "art.train.optimizer", "art.train.checkpoint",
          "art.train.weight_sync_probe"}


def run_traced(model: Path, root: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    result = subprocess.run([sys.executable, str(SCRIPT), str(model), str(root), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def ancestors(span: dict, by_id: dict) -> list[str]:
    names = []
    parent = by_id.get(span["parent_id"])
    while parent is not None:
        names.append(parent["name"])
        parent = by_id.get(parent["parent_id"])
    return names


def check_trace_shape(spans: list[dict]) -> None:
    """What the issue asks to see: rollouts with rewards, completions under their rollouts,
    training phases under the step."""
    by_id = {s["span_id"]: s for s in spans}
    rollouts = [s for s in spans if s["name"] == "art.rollout"]
    assert len(rollouts) == 8  # 2 steps x 2 groups x 2 rollouts
    for rollout in rollouts:
        assert rollout["attributes"]["art.reward"] in (0.0, 1.0)
        assert "Pick a token." in rollout["attributes"]["input.value"]
        assert "art.metrics.first_token" in rollout["attributes"]
        assert ancestors(rollout, by_id)[:2] == ["art.group", "art.gather"]
    chats = [s for s in spans if s["name"] == "chat traced"]
    assert len(chats) == 8
    for chat in chats:
        assert "art.rollout" in ancestors(chat, by_id), "a completion does not hang under its rollout"
        attributes = chat["attributes"]
        assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.usage.output_tokens"] == 4
        assert attributes["gen_ai.usage.input_tokens"] > 0 and attributes["art.step"] in (0, 1)
        assert 0 <= attributes["art.queue_time_s"] <= attributes["art.time_to_first_token_s"]
    rollout_of_chat = {next(by_id[p]["span_id"] for p in _ancestor_ids(c, by_id) if by_id[p]["name"] == "art.rollout")
                       for c in chats}
    assert len(rollout_of_chat) == 8  # one completion per rollout, each under its own
    steps = [s for s in spans if s["name"] == "art.train_step"]
    assert len(steps) == 2
    for step in steps:
        assert "art.train" in ancestors(step, by_id)
        phases = {s["name"] for s in spans if s["parent_id"] == step["span_id"]}
        assert phases == PHASES, phases
    assert {s["attributes"].get("art.step") for s in steps} == {1, 2}


def _ancestor_ids(span: dict, by_id: dict) -> list[str]:
    out, parent = [], span["parent_id"]
    while parent in by_id:
        out.append(parent)
        parent = by_id[parent]["parent_id"]
    return out


def check_train_request_under_train(spans: list[dict]) -> None:
    """The train call crossed HTTP: the server's step hangs under the client's art.train."""
    by_id = {s["span_id"]: s for s in spans}
    request = next(s for s in spans if s["name"] == "art.train_request")
    assert "art.train" in ancestors(request, by_id)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_two_training_steps_are_traced(tiny_model_path, tmp_path, remote):
    if remote and PHOENIX.exists():
        pytest.skip("test_traces_reach_phoenix checks the same remote run's trace, exported to a real server")
    spans_file = tmp_path / "spans.json"
    run_traced(tiny_model_path, tmp_path / "runs", "--memory", str(spans_file), *(["--remote"] if remote else []))
    spans = json.loads(spans_file.read_text())
    check_trace_shape(spans)
    if remote:
        check_train_request_under_train(spans)


def test_tracing_is_off_and_not_imported_unless_configured():
    code = ("import sys, asyncio, art\n"
            "from art.observability import tracing\n"
            "async def one():\n"
            "    return art.Trajectory(messages_and_choices=[], reward=1.0)\n"
            "asyncio.run(art.gather_trajectory_groups([art.TrajectoryGroup([one()])], pbar_desc=None))\n"
            "print(tracing.enabled(), 'opentelemetry.sdk' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"  # configured by the standard variable
    env["OTEL_SDK_DISABLED"] = "true"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr


# -- a real trace server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def phoenix(tmp_path):
    if not PHOENIX.exists():
        pytest.skip(f"Arize Phoenix is not installed at {PHOENIX} (.ci/run installs it)")
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(tmp_path / "phoenix"), "PHOENIX_PORT": str(port),
           "PHOENIX_GRPC_PORT": str(grpc_port), "PHOENIX_HOST": "127.0.0.1"}
    log = open(tmp_path / "phoenix.log", "w")
    process = subprocess.Popen([str(PHOENIX), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, (tmp_path / "phoenix.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("Phoenix did not start in 120 s")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_traces_reach_phoenix(tiny_model_path, tmp_path, phoenix):
    """Two steps through `art serve` and RemoteBackend, exported over OTLP/HTTP to Phoenix and read
    back through its REST API: the whole trace shape, across HTTP (this is also the remote case of
    test_two_training_steps_are_traced, which skips it when Phoenix is installed)."""
    run_traced(tiny_model_path, tmp_path / "runs", "--otlp", f"{phoenix}/v1/traces", "--remote")
    # Phoenix accepts an export before it has stored it: read until the whole trace is there (a
    # busy machine saw 2 of 8 rollouts right after the run), then check it.
    deadline = time.monotonic() + 60
    while True:
        spans = phoenix_spans(phoenix)
        try:
            check_trace_shape(spans)
            check_train_request_under_train(spans)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def phoenix_spans(phoenix: str) -> list[dict]:
    """Every span of the default project, through Phoenix's own REST API, in our test's shape."""
    spans, cursor = [], None
    for _ in range(20):  # pages
        params = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{phoenix}/v1/projects/default/spans", params=params, timeout=30).json()
        spans += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    return [{"name": s["name"], "span_id": s["context"]["span_id"], "parent_id": s.get("parent_id"),
             "attributes": s.get("attributes") or {}} for s in spans]


# -- Langfuse ---------------------------------------------------------------------------------


class LangfuseStandIn:
    """A loopback stand-in for Langfuse's ingestion (its server needs Postgres and ClickHouse and
    cannot run here): it records the OTLP spans and the score batches that arrive, with their
    basic-auth header. The check against a real Langfuse is manual (docs/observability.md)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, dict]] = []
        self.scores: list[tuple[str, dict]] = []
        self.app = FastAPI()

        @self.app.post("/api/public/otel/v1/traces")
        async def traces(request: Request) -> Response:
            body = await request.body()
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            payload = ExportTraceServiceRequest.FromString(body)
            for resource in payload.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        attributes = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}
                        self.spans.append((request.headers.get("authorization", ""), {
                            "name": span.name, "span_id": span.span_id.hex(), "trace_id": span.trace_id.hex(),
                            **attributes}))
            return Response(status_code=200)

        @self.app.post("/api/public/scores")
        async def scores(request: Request) -> dict:
            body = await request.json()
            for score in body if isinstance(body, list) else [body]:
                self.scores.append((request.headers.get("authorization", ""), score))
            return {"id": "ok"}

    def run(self, model: Path, root: Path, *args: str) -> None:
        with ServerThread(self.app) as langfuse:
            env = {"LANGFUSE_PUBLIC_KEY": "pk-lf-test", "LANGFUSE_SECRET_KEY": "sk-lf-test"}
            os.environ.update(env)
            try:
                run_traced(model, root, "--langfuse", langfuse.base_url, *args)
            finally:
                for name in env:
                    os.environ.pop(name)


KEY_PAIR = "Basic cGstbGYtdGVzdDpzay1sZi10ZXN0"  # base64 of pk-lf-test:sk-lf-test


def check_langfuse_spans(spans: list[tuple[str, dict]]) -> list[dict]:
    """The key pair on every export, and the attributes Langfuse maps to observations: each
    rollout an agent observation with its messages as input and reward as output, each
    completion a generation with its usage. Returns the rollouts."""
    assert spans and {auth for auth, _ in spans} == {KEY_PAIR}
    rollouts = [a for _, a in spans if a["name"] == "art.rollout"]
    assert len(rollouts) == 8
    for rollout in rollouts:
        assert rollout["langfuse.observation.type"] == "agent"
        assert json.loads(rollout["langfuse.observation.input"])[0] == {"role": "user", "content": "Pick a token."}
        assert json.loads(rollout["langfuse.observation.output"])["reward"] == rollout["art.reward"]
    chats = [a for _, a in spans if a["name"] == "chat traced"]
    assert len(chats) == 8 and all(c["langfuse.observation.type"] == "generation"
                                   and c["gen_ai.usage.input_tokens"] > 0 for c in chats)
    return rollouts


def test_langfuse_sdk_gets_spans_and_the_reward_as_a_score(tiny_model_path, tmp_path):
    """Through the real langfuse SDK: our spans pass its export filter, and every rollout's reward
    and metric arrive on Langfuse's score API, on that rollout's trace and observation."""
    langfuse = LangfuseStandIn()
    langfuse.run(tiny_model_path, tmp_path / "runs")
    rollouts = check_langfuse_spans(langfuse.spans)
    assert {s["name"] for _, s in langfuse.spans} >= {"art.gather", "art.group", "art.train_step"} | PHASES
    assert langfuse.scores and {auth for auth, _ in langfuse.scores} == {KEY_PAIR}
    by_observation: dict[str, dict] = {}
    for _, score in langfuse.scores:
        by_observation.setdefault(score["observationId"], {})[score["name"]] = (score["traceId"], score["value"])
    assert len(by_observation) == 8
    for rollout in rollouts:
        scores = by_observation[rollout["span_id"]]
        assert scores["reward"] == (rollout["trace_id"], rollout["art.reward"])
        assert scores["first_token"] == (rollout["trace_id"], float(rollout["art.metrics.first_token"]))


def test_langfuse_without_the_sdk_exports_over_otlp(tiny_model_path, tmp_path):
    """Without the SDK, the spans go straight to Langfuse's OTLP endpoint with the key pair; the
    reward is then an attribute and the rollout's output, not a score."""
    langfuse = LangfuseStandIn()
    langfuse.run(tiny_model_path, tmp_path / "runs", "--without-langfuse-sdk")
    check_langfuse_spans(langfuse.spans)
    assert langfuse.scores == []
