"""The LoRA term of the engine's unmerged path (CUDA's default): in the serving dtype, two matmuls
per adapted projection, the second adding into the base output. Counted on the CPU profiler, the
proxy for kernels per decode step (`benchmarks/decode_ops.py` gives the whole-model figures)."""

from __future__ import annotations

import torch

from art.engine.adapters import LIVE, AdapterSet
from art.engine.config import EngineConfig
from art.engine.static_runner import StaticRunner
from tests.support.models import tiny_model
from tests.support.ops import leaf_ops, matmuls


def bf16_model_with_float32_adapters():
    """As peft leaves a bf16 base: the LoRA factors the trainer updates stay float32."""
    model = tiny_model("llama").to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    return model


def decode_step(model, *, merge: bool, adapter: str = LIVE):
    """Two rows prefilled and decoded once (what is built lazily now exists), then the ops and
    logits of the next decode step."""
    config = EngineConfig(dtype="bfloat16", merge_lora=merge, prefix_cache_tokens=0).resolve(model)
    runner = StaticRunner(model, AdapterSet(model), config, max_model_len=64)
    prompts, names, logits = [[5, 9, 13, 200, 7], [3, 1, 4, 1, 5, 9]], [adapter] * 2, []
    with torch.inference_mode():
        _, staged = runner.prefill(prompts, [(0, None)] * 2, names)
        runner.add(staged, [0, 1])
        runner.decode([11, 12], [5, 6], names)
        counts = leaf_ops(lambda: logits.append(runner.decode([13, 14], [6, 7], names).float().clone()))
    return counts, logits[0], runner


def test_the_unmerged_live_lora_adds_two_matmuls_per_projection_and_no_casts():
    model = bf16_model_with_float32_adapters()
    merged_ops, merged_logits, _ = decode_step(model, merge=True)
    ops, logits, runner = decode_step(model, merge=False)
    adapted = [m for m in runner.decoder.projections() if hasattr(m, "lora_A") and LIVE in m.lora_A]
    assert len(adapted) == 6  # q, v and down projections of two layers
    assert matmuls(ops) == matmuls(merged_ops) + 2 * len(adapted)
    assert sum(ops.values()) == sum(merged_ops.values()) + 2 * len(adapted), (ops - merged_ops, merged_ops - ops)
    assert ops["aten::copy_"] == merged_ops["aten::copy_"]  # the factors are bf16 copies: nothing cast per step
    # Merged weights round W + BA*s once, the unmerged path rounds its two products: bf16 noise apart.
    torch.testing.assert_close(logits.log_softmax(-1), merged_logits.log_softmax(-1), atol=0.1, rtol=0)
    assert not torch.equal(logits, decode_step(model, merge=False, adapter="__base__")[1])  # the LoRA term counts


def test_the_published_copies_are_in_the_serving_dtype_unless_they_only_build_merged_weights():
    model = bf16_model_with_float32_adapters()
    for merge, dtype in ((False, torch.bfloat16), (True, torch.float32)):
        _, _, runner = decode_step(model, merge=merge)
        copies = [t for pair in runner.weights._live.values() for t in pair]
        assert copies and {t.dtype for t in copies} == {dtype}
