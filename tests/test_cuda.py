"""The backend on a CUDA GPU: bf16 serving against the reference, CUDA graph replay against eager
decoding, memory errors. (Learning in bf16 with trainer/engine agreement is
tests/test_mixed_precision.py; serving during a step is tests/test_concurrency.py; both run
on CUDA too when there is one.)

Skipped without CUDA (`benchmarks/gpu_check.sh` runs them on the H200). The same code runs on
the CPU in the rest of the suite; these check what only a GPU exercises.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import art
from art import weight_sync
from art.engine.adapters import LIVE, AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.config import EngineConfig
from art.engine.llm_engine import LLMEngine
from art.engine.static_runner import StaticRunner
from art.errors import ArtValueError
from tests.test_decoder import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16_TOLERANCE = weight_sync.HALF_TOLERANCE


def cuda_lora_model(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).to("cuda")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model_path)


async def test_bf16_engine_with_graphs_matches_the_reference(tiny_model_path):
    """32 greedy steps per prompt: each engine token is the reference's argmax up to a bf16 tie,
    and its logprob (teacher-forced through transformers) is within the bf16 tolerance."""
    model, tokenizer = cuda_lora_model(tiny_model_path)
    adapters = AdapterSet(model)
    engine = LLMEngine(model, tokenizer, adapters=adapters, max_num_seqs=16)
    try:
        assert engine.config.on_cuda and engine.config.dtype == "bfloat16" and engine.runner.graphs is not None
        prompts = [[1, 5, 9], list(range(100, 120)), list(range(200, 207)), [7] * 30]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        live = AdapterRef("tiny", None, None)
        results = await asyncio.gather(*[engine.generate(p, params, live) for p in prompts])
        assert engine.runner.graphs.replays > 0
        for prompt, (got,) in zip(prompts, results):
            ids = torch.tensor([prompt + got.token_ids], device="cuda")
            with torch.no_grad():
                reference = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            chosen = reference.gather(1, torch.tensor(got.token_ids, device="cuda")[:, None])[:, 0]
            assert (reference.max(-1).values - chosen).max() <= BF16_TOLERANCE  # greedy, up to ties
            assert (chosen - torch.tensor(got.logprobs, device="cuda")).abs().max() <= BF16_TOLERANCE
    finally:
        engine.stop()


def test_graph_replay_equals_eager_decoding():
    model = tiny_model("qwen3").to(device="cuda", dtype=torch.bfloat16)
    runs = {}
    for eager in (False, True):
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(enforce_eager=eager).resolve(model),
                              max_model_len=128)
        prompts = [[5, 9, 13, 200, 7], list(range(20, 41)), [3, 1, 4, 1, 5, 9, 2, 6]]
        out = []
        with torch.inference_mode():
            _, staged = runner.prefill(prompts, [(0, None)] * 3, [LIVE] * 3)
            runner.add(staged, [0, 1, 2])
            lengths = [len(p) for p in prompts]
            for step in range(8):
                tokens = [(17 * step + 5 * r) % 250 for r in range(3)]
                out.append(runner.decode(tokens, [n + step for n in lengths], [LIVE] * 3).clone())
        runs[eager] = (torch.stack(out), runner)
    graphs = runs[False][1].graphs
    assert graphs.replays == 8 and len(graphs.graphs) >= 1 and runs[True][1].graphs is None
    torch.testing.assert_close(runs[False][0], runs[True][0], atol=1e-3, rtol=0)


async def test_kv_cache_that_does_not_fit_names_the_knob(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="big", project="p", base_model=str(tiny_model_path),
                               _internal_config={"engine_args": {"gpu_memory_utilization": 0.001}})
    with pytest.raises(ArtValueError) as info:
        await model.register(backend)
    assert info.value.field == "engine_args.gpu_memory_utilization" and "max_model_len" in str(info.value)
    await backend.close()
