"""`art.RemoteBackend` against the real `art serve` app: in process (ASGITransport) and over a
real loopback socket (an `art serve` subprocess); auth, limits and name validation."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from pathlib import Path

import httpx
import pytest

import art
from art.serve import create_serve_app
from art.server.management_schemas import TrajectoryGroupPayload
from art.service import ModelSpec
from art.service.local import LocalService
from art.storage.history import row_split
from tests.support.servers import gather, start_server, stop_server

KEY = "test-key-123"


# -- the loop both transports must pass ------------------------------------------------------


async def training_loop(backend: art.RemoteBackend, base_model: str, server_root: Path) -> None:
    model = art.TrainableModel(name="tiny", project="remote", base_model=base_model)
    await model.register(backend)
    assert model.inference_base_url == f"{backend.base_url}/v1"
    assert await model.get_step() == 0
    run = server_root / "remote" / "models" / "tiny"
    assert (run / "checkpoints" / "0000").is_dir()

    groups = await gather(model, 0)
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))  # logs train/ at step 0
    assert await model.get_step() == 1

    events: list[dict] = []
    result = await backend.train(model, await gather(model, 1), learning_rate=1e-2, progress=events.append)
    assert result.step == 2 and await model.get_step() == 2
    assert math.isfinite(result.metrics["loss"])
    kinds = [e["type"] for e in events]
    assert kinds[0] == "accepted" and kinds[-1] == "result" and "gradient_step" in kinds
    step_event = next(e for e in events if e["type"] == "gradient_step")
    assert step_event["step"] == 2 and step_event["done"] == 1 and "loss" in step_event["metrics"]

    # The newest weights are served by name, older ones as name@step.
    completion = await model.openai_client().chat.completions.create(
        model="tiny@1", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert completion.model_extra["step"] == 1

    await model.log(groups, split="val", metrics={"custom": 3.0})
    history = await backend.get_history(model)
    assert [(row_split(row), row["step"]) for row in history] == [("train", 0), ("val", 2)]
    assert history[1]["val/custom"] == 3.0 and "val/reward" in history[1]
    logged = (run / "trajectories" / "train" / "0000.jsonl").read_text().splitlines()
    assert len(logged) == 8 and json.loads(logged[0])["messages_and_choices"][1]["token_ids"]

    assert await backend.list_checkpoints(model) == [0, 1, 2]
    deleted = await model.delete_checkpoints(best_checkpoint_metric="train/reward")
    assert deleted == [1] and await backend.list_checkpoints(model) == [0, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000", "0002"]
    assert await backend.restart_replicas(model) == []  # one engine, no replicas to restart


def serve_app(root: Path, **kwargs):
    local = LocalService(str(root))
    return local, create_serve_app(local, **kwargs)


async def test_in_process_through_asgi_transport(tiny_model_path, tmp_path):
    local, app = serve_app(tmp_path / "server", api_key=KEY)
    async with art.RemoteBackend("http://testserver", api_key=KEY, transport=httpx.ASGITransport(app)) as backend:
        await training_loop(backend, str(tiny_model_path), tmp_path / "server")
    await local.close()


async def test_choices_round_trip_exactly(tiny_model_path, tmp_path):
    """What the server rebuilds from the JSON equals what the client sent, Choice class included."""
    local, app = serve_app(tmp_path / "server")
    async with art.RemoteBackend("http://testserver", transport=httpx.ASGITransport(app)) as backend:
        model = art.TrainableModel(name="rt", project="remote", base_model=str(tiny_model_path))
        await model.register(backend)
        completion = await model.openai_client().chat.completions.create(
            model="rt", messages=[{"role": "user", "content": "Say a word."}], max_tokens=5, n=2,
            logprobs=True, top_logprobs=2)
        group = art.TrajectoryGroup(
            [art.Trajectory(messages_and_choices=[{"role": "user", "content": "Say a word."}, c], reward=0.25,
                            metrics={"turns": 1, "ok": True}, metadata={"id": "s1", "n": 3}).finish()
             for c in completion.choices],
            metadata={"scenario": 7}, exceptions=[ValueError("a failed rollout")])
    await local.close()
    wire = json.loads(json.dumps(group.for_logging()))
    rebuilt = TrajectoryGroupPayload.model_validate(wire).to_group("trajectory_groups[0]")
    assert rebuilt.model_dump() == group.model_dump()
    sent, got = group.trajectories[0].messages_and_choices[1], rebuilt.trajectories[0].messages_and_choices[1]
    assert type(got) is type(sent)
    assert got.token_ids == sent.token_ids and got.prompt_token_ids == sent.prompt_token_ids
    assert [t.logprob for t in got.logprobs.content] == [t.logprob for t in sent.logprobs.content]
    assert got.logprobs.content[0].top_logprobs == sent.logprobs.content[0].top_logprobs


async def test_errors_arrive_as_art_errors_naming_the_field(tiny_model_path, tmp_path):
    local, app = serve_app(tmp_path / "server")
    async with art.RemoteBackend("http://testserver", transport=httpx.ASGITransport(app)) as backend:
        model = art.TrainableModel(name="errs", project="remote", base_model=str(tiny_model_path))
        await model.register(backend)
        groups = await gather(model, 0)
        with pytest.raises(art.ArtValueError, match="learning_rate") as info:
            await backend.train(model, groups, config=art.TrainConfig(), learning_rate=-1.0)
        with pytest.raises(art.ArtValueError, match="epsilon"):
            await model.train(groups, _config={"epsilon": -3})
        assert await model.get_step() == 0
        stranger = art.TrainableModel(name="never-registered", project="remote", base_model="x")
        with pytest.raises(art.ModelNotFoundError, match="not registered"):
            await backend.train(stranger, groups)
        missing = art.TrainableModel(name="missing", project="remote", base_model=str(tmp_path / "no-such-model"))
        with pytest.raises(art.ArtValueError, match="no-such-model") as info:
            await missing.register(backend)
        assert info.value.field == "base_model"
        # Raw bodies: the server names the bad field itself.
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver")
        bad = json.loads(json.dumps(groups[0].for_logging()))
        bad["trajectories"][1]["reward"] = "lots"
        response = await client.post("/art/models/remote/errs/train", json={"trajectory_groups": [bad]})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "trajectory_groups[0].trajectories[1].reward"
        bad = json.loads(json.dumps(groups[0].for_logging()))
        bad["trajectories"][0]["messages_and_choices"][1]["finish_reason"] = "bored"
        response = await client.post("/art/models/remote/errs/train", json={"trajectory_groups": [bad]})
        where = "trajectory_groups[0].trajectories[0].messages_and_choices[1].finish_reason"
        assert response.status_code == 400 and where in response.json()["error"]["message"]
        response = await client.post("/art/models/remote/errs/train", json={"trajectory_groups": [], "confg": {}})
        assert response.status_code == 400 and response.json()["error"]["param"] == "confg"
        await client.aclose()
    await local.close()



async def test_prompted_baseline_logs_on_the_server(tmp_path):
    _, app = serve_app(tmp_path / "server")
    async with art.RemoteBackend("http://testserver", transport=httpx.ASGITransport(app)) as backend:
        baseline = art.Model(name="gpt-baseline", project="remote", inference_base_url="http://127.0.0.1:9/v1",
                             inference_model_name="gpt-4o-mini")
        await baseline.register(backend)
        assert baseline.inference_base_url == "http://127.0.0.1:9/v1"  # its own endpoint is kept
        await baseline.log([art.TrajectoryGroup([art.Trajectory(reward=r) for r in (0.0, 1.0)])], split="val")
        (row,) = await backend.get_history(baseline)
    assert row["step"] == 0 and row["val/reward"] == 0.5
    assert (tmp_path / "server" / "remote" / "models" / "gpt-baseline" / "trajectories" / "val" / "0000.jsonl").exists()


async def test_the_remote_service_lists_the_servers_models(tmp_path):
    _, app = serve_app(tmp_path / "server")
    async with art.RemoteBackend("http://testserver", transport=httpx.ASGITransport(app)) as backend:
        await art.Model(name="listed", project="remote", inference_base_url="http://127.0.0.1:9/v1").register(backend)
        assert await backend.service.specs() == [ModelSpec(project="remote", name="listed")]


# -- auth, limits, names ------------------------------------------------------------------


async def test_auth_required_everywhere_but_health(tmp_path):
    _, app = serve_app(tmp_path / "server", api_key=KEY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver") as client:
        assert (await client.get("/health")).status_code == 200
        for path in ("/v1/models", "/openapi.json", "/art/models", "/art/models/p/m/step", "/nowhere"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = await client.get(path, headers=headers)
                assert response.status_code == 401, (path, headers)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and KEY not in response.text
        response = await client.post("/v1/chat/completions", json={"model": "x", "messages": []})
        assert response.status_code == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        assert (await client.get("/art/models", headers=good)).json() == []
        schema = (await client.get("/openapi.json", headers=good)).json()
    paths = schema["paths"]
    assert {"post", "get"} <= set(paths["/art/models"])
    assert {"get", "delete"} <= set(paths["/art/models/{project}/{name}/checkpoints"])
    body = paths["/art/models/{project}/{name}/train"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/TrainRequest")
    assert "TrajectoryPayload" in schema["components"]["schemas"]
    async with art.RemoteBackend("http://testserver", api_key="wrong", transport=httpx.ASGITransport(app)) as backend:
        with pytest.raises(art.BackendError, match="ART_API_KEY"):
            await backend.get_step(art.Model(name="m", project="p"))


async def test_names_are_validated_and_nothing_is_created(tmp_path):
    root = tmp_path / "server"
    root.mkdir()
    _, app = serve_app(root)
    bad_names = ["../x", "a/b", "..", "x" * 129, "", ".hidden", "a\\b", "a..b"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver") as client:
        for bad in bad_names:
            for field in ("name", "project"):
                body = {"name": "ok", "project": "ok", "trainable": True, "base_model": "none", field: bad}
                response = await client.post("/art/models", json=body)
                assert response.status_code == 400, (field, bad)
                assert response.json()["error"]["param"] == field
        # In the path: percent-encoded dots reach the route as '..'; a separator never matches one.
        for path in ("/art/models/%2e%2e/x/step", "/art/models/ok/%2e%2e/metrics", "/art/models/ok/..%2fx/step"):
            assert (await client.get(path)).status_code in (400, 404), path
        response = await client.post("/art/models/%2e%2e/x/log", json={"split": "val", "step": 0})
        assert response.status_code == 400 and response.json()["error"]["param"] == "project"
        response = await client.post("/art/models/ok/ok/log", json={"split": "../escape", "step": 0})
        assert response.status_code == 400 and response.json()["error"]["param"] == "split"
    assert list(root.iterdir()) == [] and not (tmp_path / "x").exists() and not (tmp_path / "escape").exists()


async def test_large_bodies_get_413(tmp_path):
    _, app = serve_app(tmp_path / "server", max_body_bytes=10_000)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver") as client:
        big = {"split": "val", "step": 0, "metrics": {"pad": "x" * 20_000}}
        response = await client.post("/art/models/p/m/log", json=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: counted as it arrives
            for _ in range(30):
                yield b"x" * 1000

        response = await client.post("/art/models/p/m/log", content=chunks())
        assert response.status_code == 413
        small = await client.post("/art/models/p/m/log", json={"split": "val", "step": 0, "metrics": {"a": 1.0}})
        assert small.status_code == 200
    assert (tmp_path / "server" / "p" / "models" / "m" / "history.jsonl").exists()


# -- over a real socket ---------------------------------------------------------------------


async def client_leaves_mid_step(backend: art.RemoteBackend, url: str, base_model: str) -> None:
    """A client that hangs up after `accepted` does not cancel the step: it completes and is saved."""
    model = art.TrainableModel(name="tiny", project="remote", base_model=base_model)
    await model.register(backend)
    step = await model.get_step()
    body = {"trajectory_groups": [g.for_logging() for g in await gather(model, 7)], "options": {"learning_rate": 1e-2}}
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as client:
        async with client.stream("POST", "/art/models/remote/tiny/train", json=body) as response:
            async for line in response.aiter_lines():
                assert json.loads(line)["type"] == "accepted"
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 30
    while await model.get_step() != step + 1:
        assert time.monotonic() < deadline, "the step did not complete after the client left"
        await asyncio.sleep(0.1)
    assert step + 1 in await backend.list_checkpoints(model)


@pytest.mark.integration
async def test_art_serve_subprocess(tiny_model_path, tmp_path, monkeypatch):
    root = tmp_path / "server"
    log = tmp_path / "serve.log"
    process, url = start_server(root, log, env={"ART_API_KEY": KEY}, models_dir=tiny_model_path.parent)
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        monkeypatch.setenv("ART_API_KEY", KEY)  # the client reads the same variable
        async with art.Backend(base_url=url) as backend:
            await training_loop(backend, str(tiny_model_path), root)
            await client_leaves_mid_step(backend, url, str(tiny_model_path))
    finally:
        output = stop_server(process, log)
    assert KEY not in output
    # uvicorn re-raises SIGTERM after a graceful shutdown, in which the engines were stopped.
    assert process.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in output, output


async def test_remote_example_at_tiny_scale(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    import remote_training

    local, app = serve_app(tmp_path / "server")
    async with art.RemoteBackend("http://testserver", transport=httpx.ASGITransport(app)) as backend:
        rewards = await remote_training.main(backend, steps=2, seed=0, group_size=2, prompts_per_step=2,
                                             learning_rate=1e-3, base_model=str(tiny_model_path),
                                             curve=tmp_path / "curve.png")
    await local.close()
    assert len(rewards) == 2
    assert (tmp_path / "curve.png").stat().st_size > 1000  # drawn as it went, on the client
    assert (tmp_path / "server" / "yes-no-maybe" / "models" / "maybe-seed0" / "checkpoints" / "0002").is_dir()


def test_the_clients_bar_names_the_step_as_history_and_the_server_do():
    """Events carry the step a call writes; an RL step's rows are filed under the one before."""
    import io

    from tqdm import tqdm

    from art.backends.remote import _on_event

    bar = tqdm(file=io.StringIO())
    _on_event({"type": "accepted", "step": 3, "groups": 2, "trajectories": 8}, bar, "train")
    assert bar.desc.startswith("train step 2:")
    _on_event({"type": "gradient_step", "step": 3, "done": 1, "total": 2, "metrics": {"loss": 0.5}}, bar, "train")
    assert bar.desc.startswith("train step 2:")
    _on_event({"type": "gradient_step", "step": 3, "done": 1, "total": 2, "metrics": {}}, bar, "train_sft")
    assert bar.desc.startswith("sft step 3:")
    bar.close()
