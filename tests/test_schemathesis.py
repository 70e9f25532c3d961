"""Property-based fuzzing of the whole `art serve` app from its own /openapi.json (schemathesis):
no input, valid or not, may get a 5xx. Runs in process (schemathesis' ASGI client), with the
key and a tiny trainable model registered so the generated requests also reach a real model."""

from __future__ import annotations

import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

import art  # noqa: E402
from art.backends.local import LocalBackend  # noqa: E402
from art.server.serve import create_serve_app  # noqa: E402

KEY = "fuzz-key-987"
AUTH = {"Authorization": f"Bearer {KEY}"}
STATS = {}
EXAMPLES = 15
"""Per operation, generation mode and target (random names, or the registered model)."""
TRAIN_EXAMPLES = 10
"""The train route may really train (each step a checkpoint and a weight-sync probe)."""


def _aim_at(body: dict, model: str) -> None:
    """Steer a generated chat body past the checks the schema cannot express (message content,
    penalties), so the engine sees the other generated fields (n, stop, seed, tools, logprobs...)."""
    body["model"] = model
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("content") is None:
            message["content"] = "Hi"
    for penalty in ("frequency_penalty", "presence_penalty"):
        body.pop(penalty, None)


async def test_no_input_gets_a_5xx(tiny_model_path, tmp_path):
    backend = LocalBackend(path=str(tmp_path / "server"), served_at="http://testserver")
    # A short context bounds the slowest generated request (ignore_eos up to the context's end).
    model = art.TrainableModel(name="tiny", project="fuzz", base_model=str(tiny_model_path),
                               _internal_config={"engine_args": {"max_model_len": 64, "max_num_seqs": 4}})
    await backend.register(model)  # stored: the app's routes pick it up as a known run
    app = create_serve_app(backend, api_key=KEY, watchdog_s=None, watchdog_train_s=None)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)

    failures: list[str] = []
    calls = 0

    def fuzz(operation, strategy, examples: int, model: str | None) -> None:
        @given(case=strategy)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            nonlocal calls
            if model is not None and isinstance(case.body, dict):
                _aim_at(case.body, model)
            response = case.call(headers=AUTH, timeout=60)
            calls += 1; (print("DBG", response.text[:200]) if model else None); STATS.setdefault((case.method, operation.path, model is not None or "fuzz" in case.formatted_path), []).append((response.status_code, response.elapsed))
            try:
                case.validate_response(response, checks=[not_a_server_error], headers=AUTH)
            except Exception as exc:  # collect them all, each with its request and answer
                failures.append(f"{case.method} {case.formatted_path} body={case.body!r:.600} -> "
                                f"{response.status_code} {response.text[:600]!r}: {type(exc).__name__}")

        try:
            run()
        except Unsatisfiable:  # negative data for an operation that takes no input
            pass

    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        chat = operation.path == "/v1/chat/completions"
        examples = TRAIN_EXAMPLES if operation.path.endswith("/train") else EXAMPLES
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, operation.as_strategy(generation_mode=mode), examples, None)
            if operation.path_parameters:  # again, on the registered model
                fixed = {"project": "fuzz", "name": "tiny"}
                fuzz(operation, operation.as_strategy(generation_mode=mode, path_parameters=fixed), examples, None)
            elif chat:
                fuzz(operation, operation.as_strategy(generation_mode=mode), examples, "tiny")
    elapsed = time.monotonic() - started
    import collections
    for k, v in STATS.items(): print(k, collections.Counter(s for s, _ in v), round(sum(e for _, e in v), 2))
    await backend.close()
    assert calls > 200, calls
    assert not failures, f"{len(failures)} of {calls} requests got a 5xx:\n" + "\n".join(failures[:20])
    assert elapsed < 120, f"fuzzing took {elapsed:.0f} s"
