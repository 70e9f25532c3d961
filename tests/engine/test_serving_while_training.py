"""The engine serves the last published weights while a training step writes the live ones.

A training step beside the engine (`LLMEngine.serving_while_training`) changes the live LoRA
tensors in place; the engine must go on answering from its published copies, a request that
is decoding when a step is published must finish on the weights it started with, and a request
for a checkpoint that would change peft's module tree waits for the step to end.
"""

import asyncio

import pytest
import torch

from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.llm_engine import LLMEngine
from art.weights import write_adapter
from tests.support.fakes import randomize_lora

PROMPT = [5, 9, 13, 200]
LIVE = AdapterRef("tiny", None, None)


def lora_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def peft_logprobs(model, state: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprobs of `tokens` after `prompt` under the LoRA weights `state`, straight through peft."""
    current = lora_state(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                param.copy_(state[name])
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        for name, param in model.named_parameters():
            if name in current:
                param.copy_(current[name])
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


async def first_tokens(stream, count: int) -> list[int]:
    seen: list[int] = []
    async for item in stream:
        seen += item.token_ids
        if len(seen) >= count:
            return seen
    raise AssertionError("the request ended before it had sampled enough tokens")


@pytest.mark.parametrize("merge_lora", [True, False], ids=["merged", "lora-path"])  # the CPU's default, CUDA's
async def test_requests_end_on_the_weights_they_started_with_while_a_step_trains(lora, merge_lora):
    model, tokenizer = lora
    engine = LLMEngine(model, tokenizer, adapters=AdapterSet(model, live_step=1), max_num_seqs=4, merge_lora=merge_lora)
    try:
        step1 = lora_state(model)
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        with engine.serving_while_training():
            stream = engine.stream(PROMPT, long, LIVE)
            await first_tokens(stream, 3)
            randomize_lora(model, seed=6)  # the trainer writes the live adapter meanwhile
            step2 = lora_state(model)
            during = (await engine.generate(PROMPT, short, LIVE))[0]
            with engine.lock:  # between two engine steps: the long request is decoding
                assert engine.running == 1
                engine.weights_updated(2)
                assert engine.runner.retired() == {"default@1"}
            after = (await engine.generate(PROMPT, short, LIVE))[0]
            spanning = [item async for item in stream][-1][0]
        assert engine.runner.retired() == set()  # dropped once its last row finished
    finally:
        engine.stop()

    assert during.step == 1 and spanning.step == 1 and after.step == 2
    tokens = spanning.token_ids
    assert len(tokens) == 100
    assert spanning.logprobs == pytest.approx(peft_logprobs(model, step1, PROMPT, tokens), abs=1e-4)
    assert during.logprobs == pytest.approx(peft_logprobs(model, step1, PROMPT, during.token_ids), abs=1e-4)
    assert after.logprobs == pytest.approx(peft_logprobs(model, step2, PROMPT, after.token_ids), abs=1e-4)
    # The two weights differ enough that a row decoded on the wrong ones would show.
    assert max(abs(a - b) for a, b in zip(peft_logprobs(model, step2, PROMPT, tokens), spanning.logprobs)) > 1e-2


async def test_a_checkpoint_that_is_not_loaded_waits_for_the_step_to_end(lora, tmp_path):
    model, tokenizer = lora
    write_adapter(model, tmp_path / "0000")
    engine = LLMEngine(model, tokenizer, adapters=AdapterSet(model, live_step=1), max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        with engine.serving_while_training():
            waiting = asyncio.ensure_future(engine.generate(PROMPT, params, AdapterRef("tiny@0", tmp_path / "0000", 0)))
            live = (await engine.generate(PROMPT, params, LIVE))[0]
            await asyncio.sleep(0.2)
            assert not waiting.done() and engine.queue_depth == 1
            assert not any(name.startswith("ckpt_") for name in model.peft_config)  # the tree did not change
            assert engine.stalled_s() == 0.0  # a request held for the step is not a stalled engine
        checkpoint = (await asyncio.wait_for(waiting, timeout=30))[0]
    finally:
        engine.stop()
    assert live.step == 1 and checkpoint.step == 0
    assert checkpoint.logprobs == pytest.approx(live.logprobs, abs=1e-5)  # the checkpoint holds these weights


def test_an_engine_that_reads_the_modules_refuses_to_serve_beside_a_step(lora):
    model, tokenizer = lora
    engine = LLMEngine(model.merge_and_unload(), tokenizer, max_num_seqs=2)  # no adapter: full fine-tuning
    try:
        assert not engine.serves_while_training
        with pytest.raises(RuntimeError, match="pause"):
            with engine.serving_while_training():
                pass
    finally:
        engine.stop()
