"""Property-based fuzzing of the whole `art serve` app from its own /openapi.json (schemathesis):
no input, valid or not, may get a 5xx. Runs in process (schemathesis' ASGI client), with the
key and a tiny trainable model registered so the generated requests also reach a real model."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

import art  # noqa: E402
from art.serve import create_serve_app  # noqa: E402
from art.service import ModelSpec  # noqa: E402
from art.service.local import LocalService  # noqa: E402

pytestmark = pytest.mark.integration  # the whole served app, a model loaded and trained

KEY = "fuzz-key-987"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("ART_FUZZ_EXAMPLES", 12))
"""Per operation, generation mode and target (random names, or the registered model). The
examples are derandomized (the same every run); ART_FUZZ_EXAMPLES=200 fuzzes longer and
ART_FUZZ_RANDOM=1 draws new ones."""
SLOW_EXAMPLES = max(1, EXAMPLES // 2)
"""Train and log bodies (nested trajectories) are slow to generate, and train really trains."""


def _aim_chat(body: dict) -> None:
    """Steer a generated chat body past the checks the schema cannot express (message content,
    penalties), so the engine sees the other generated fields (n, stop, seed, tools, logprobs...)."""
    body["model"] = "tiny"
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("content") is None:
            message["content"] = "Hi"
    for penalty in ("frequency_penalty", "presence_penalty"):
        body.pop(penalty, None)


def _stream_not_a_server_error(response) -> None:
    """The train route answers 200 and streams; a failure then arrives as its last line."""
    if "ndjson" not in response.headers.get("content-type", [""])[0]:
        return
    last = json.loads(response.text.strip().splitlines()[-1])
    status = (last.get("error") or {}).get("status", 200)
    assert last["type"] == "result" or status < 500, f"the stream ended with a server error: {last}"


async def test_no_input_gets_a_5xx(tiny_model_path, tmp_path):
    local = LocalService(str(tmp_path / "server"))
    # A short context bounds the slowest generated request (ignore_eos up to the context's end).
    model = art.TrainableModel(name="tiny", project="fuzz", base_model=str(tiny_model_path),
                               _internal_config={"engine_args": {"max_model_len": 64, "max_num_seqs": 4}})
    await local.register(ModelSpec.of(model))  # the app's routes know it
    app = create_serve_app(local, api_key=KEY, watchdog_s=None, watchdog_train_s=None)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)

    failures: list[str] = []
    answered: Counter = Counter()  # (operation, aimed at the model, status)

    def fuzz(operation, strategy, examples: int, aim=None) -> None:
        @given(case=strategy)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=not os.environ.get("ART_FUZZ_RANDOM"))
        def run(case) -> None:
            if aim is not None and isinstance(case.body, dict):
                aim(case.body)
            response = case.call(headers=AUTH, timeout=60)
            aimed = aim is not None or "/fuzz/tiny/" in case.formatted_path
            answered[operation.label, aimed, response.status_code] += 1
            try:
                case.validate_response(response, checks=[not_a_server_error], headers=AUTH)
                _stream_not_a_server_error(response)
            except Exception as exc:  # collect them all, each with its request and answer
                failures.append(f"{case.method} {case.formatted_path} body={case.body!r:.600} -> "
                                f"{response.status_code} {response.text[-600:]!r}: {type(exc).__name__}")

        try:
            run()
        except Unsatisfiable:  # negative data for an operation that takes no input
            pass

    for result in schema.get_all_operations():
        operation = result.ok()
        slow = operation.path.endswith(("/train", "/train_sft", "/log", "/fork")) or operation.label == "POST /art/models"
        examples = SLOW_EXAMPLES if slow else EXAMPLES
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, operation.as_strategy(generation_mode=mode), examples)
            # Again, aimed at a real model: its path, its name, a base model that loads.
            if operation.path_parameters:
                fixed = {"project": "fuzz", "name": "tiny"}
                fuzz(operation, operation.as_strategy(generation_mode=mode, path_parameters=fixed), examples)
            elif operation.label == "POST /v1/chat/completions":
                fuzz(operation, operation.as_strategy(generation_mode=mode), examples, _aim_chat)
            elif operation.label == "POST /art/models":
                fuzz(operation, operation.as_strategy(generation_mode=mode), examples,
                     lambda body: body.update(trainable=True, base_model=str(tiny_model_path)))
    await local.close()
    calls = sum(answered.values())
    assert not failures, f"{len(failures)} of {calls} requests got a 5xx:\n" + "\n".join(failures[:20])
    assert calls > 200, answered
    # The aimed passes got through validation to the engine and the trainer.
    assert answered["POST /v1/chat/completions", True, 200]
    assert answered["POST /art/models/{project}/{name}/train", True, 200]
