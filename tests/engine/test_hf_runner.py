"""The transformers runner (`art.engine.hf_runner`) on what only it serves: sliding windows shorter
than the prompts, multi-head latent attention, recurrent layers. A prefill that mixes rows with a
cached prefix and rows without one, rows joining a running batch, and `n > 1`, against a plain
forward pass over the sampled ids. On a recurrent model the cached prefix is the state the whole
earlier prompt left (`StateAtEnd`), reused by a prompt that continues it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.hf_runner import HFRunner
from art.engine.llm_engine import LLMEngine
from tests.support import families
from tests.support.fakes import randomize_lora

LIVE = AdapterRef("m", None, None)
PROMPT = list(range(200, 230))


def served(model_type: str, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = families.save_tiny(model_type, tmp_path / model_type, families.tokenizer())
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"])).eval()
    randomize_lora(model, seed=2)
    engine = LLMEngine(model, AutoTokenizer.from_pretrained(path), adapters=AdapterSet(model), max_num_seqs=16,
                       prefix_cache_tokens=4096)
    assert isinstance(engine.runner, HFRunner)
    return model, engine


def plain_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("model_type", ["gemma3_text", "deepseek_v3", "qwen3_5_moe_text", "falcon_h1", "nemotron_h"])
async def test_prefixes_joins_and_samples_match_a_plain_forward(model_type, tmp_path):
    model, engine = served(model_type, tmp_path)
    try:
        params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=5)
        first = await engine.generate(PROMPT, params, LIVE)  # its prompt is cached (where prefixes are reused)
        computed = engine.runner.prefill_computed_tokens
        longer, other, short = PROMPT + [7, 8, 9, 10], list(range(300, 322)), [5, 6, 7]
        running = asyncio.ensure_future(engine.generate(list(range(400, 425)), params, LIVE))
        batch = await asyncio.gather(*[engine.generate(p, params, LIVE) for p in (longer, other, short)])
        rows = [(PROMPT, first), (longer, batch[0]), (other, batch[1]), (short, batch[2]),
                (list(range(400, 425)), await running)]
        with engine.lock:
            engine.adapters.unmerge()
            worst = max(max(abs(a - b) for a, b in zip(c.logprobs, plain_logprobs(model, p, c.token_ids)))
                        for p, completions in rows for c in completions)
        assert worst < 1e-4, worst
        # The longer prompt continues the first, so its 30 tokens are cached: keys and values,
        # some recomputed where its row is padding beside longer ones; or the state they left,
        # used whole (the rows after a state go in a pass of their own length).
        new = engine.runner.prefill_computed_tokens - computed
        every = len(longer) + len(other) + len(short) + 25
        if model_type in families.HYBRID_FAMILIES:
            assert new == every - len(PROMPT)
        else:
            assert new < every
    finally:
        engine.stop()
