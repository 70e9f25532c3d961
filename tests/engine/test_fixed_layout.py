"""CUDA's KV layout, run on the CPU (`kv_layout="fixed"`): one buffer of positions laid out with
each step's width as its stride, widths doubling from 256, decode batches padded to buckets,
the live LoRA unmerged, keys repeated per query head in masked prefills. The GPU runs this code
with graphs on top; here it is checked against transformers where every CI run sees it."""

import asyncio

import pytest
import torch

from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.llm_engine import LLMEngine
from art.service import probe

LIVE = AdapterRef("tiny", None, None)


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_the_tool_agents_shape_in_cudas_layout_matches_transformers(lora, dtype):
    """8 prompts of about 250 tokens sharing a 240-token prefix (prefilled once, then masked blocks
    behind it at widths that are not multiples of 16), decoded greedily for different lengths
    across the narrowest width (256 -> 512, a re-layout), rows finishing at different steps (the
    last rows move into their slots). Every token is transformers' argmax up to a tie and its
    logprob is transformers'."""
    model, tokenizer = lora
    model = model.to(dtype)
    engine = LLMEngine(model, tokenizer, adapters=AdapterSet(model), max_num_seqs=16, kv_layout="fixed",
                       pad_batches=True, merge_lora=False, dtype=str(dtype).removeprefix("torch."))
    tolerance = 1e-3 if dtype == torch.float32 else probe.HALF_TOLERANCE
    common = [(37 * i) % 900 + 50 for i in range(240)]
    prompts = [common + [1000 + i, 1100 + 3 * i, 1200 + i] + [7] * i for i in range(8)]
    try:
        assert engine.runner.fixed and engine.runner.row_width is not None
        results = await asyncio.gather(*[
            engine.generate(p, SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True), LIVE)
            for i, p in enumerate(prompts)])
        assert engine.runner.cache.relayouts > 0 and engine.runner.cache.rows_moved > 0
    finally:
        engine.stop()
    for prompt, (got,) in zip(prompts, results):
        reference = reference_logprobs(model, prompt, got.token_ids)
        chosen = reference.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
        assert float((reference.max(-1).values - chosen).max()) <= tolerance  # greedy, up to ties
        assert float((chosen - torch.tensor(got.logprobs)).abs().max()) <= tolerance


def test_a_bad_kv_layout_is_named():
    from art.engine.config import EngineConfig
    from art.errors import ArtValueError

    with pytest.raises(ArtValueError) as info:
        EngineConfig.from_engine_args({"kv_layout": "paged"})
    assert info.value.field == "engine_args.kv_layout"
