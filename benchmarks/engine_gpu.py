"""Decode throughput of our engine against Hugging Face `generate`, on models built from real configs.

    python benchmarks/engine_gpu.py [--device cuda] [--models smollm2[,qwen1.5b]] [--shapes grpo,wide]
                                    [--all-variants] [--bandwidth-gbs 4800] [--tiny]

The issue's shapes, every completion exactly `max_tokens` long (end-of-sequence ignored), temperature 1:
  grpo   4 distinct prompts of 48 tokens x 8 samples = 32 rows, 64 new tokens
  wide   32 distinct prompts of 48 tokens x 8 samples = 256 rows, 256 new tokens
Models (random weights: throughput does not depend on the values once EOS is ignored), bf16 on
CUDA, float32 on the CPU:
  smollm2    SmolLM2-135M's config (the default);   qwen1.5b   Qwen2.5-1.5B's shape
Systems, one process, engine-level (no HTTP):
  ours_lora         LLMEngine, a LoRA adapter (r 8, the 7 projections) as RL rollouts use it, defaults
                    (on CUDA: LoRA inside CUDA graphs, one copy of the weights)
  ours_lora_merged  the same with merge_lora=True (a merged copy of the adapted weights)
  ours_lora_eager   (--all-variants, CUDA) the same with enforce_eager=True (no CUDA graphs)
  ours_mixed        (--all-variants) half the requests on the adapter, half on the base model (eager,
                    per-group LoRA)
  hf_generate       `model.generate(do_sample=True, min_new_tokens=max_new_tokens)`, the base model
                    (its own copy of the same random weights, without LoRA layers)
HF generate is slow (it sets the run's length): one short warm-up generate per model, then one
timed run per shape. Each of our systems gets a fresh engine per shape and runs the shape twice;
the second run is timed (the first captures the wider graphs, warms kernels) and the first's
extra time is reported as warm-up; with it, runner.stats() (engine/cuda_graphs,
engine/graph_failures, ...) and, on CUDA, memory after the timed run (memory_reserved,
max_memory_allocated since the engine started, the KV buffer). Also the physical limit, rows x
memory bandwidth / weight bytes (every decode step reads the weights once), and our share of it.
Prints one JSON line per (model, shape) as soon as that shape is measured, a table, then the
summary JSON line. Goal (the issue): ours >= 10x hf on grpo and >= 5x on wide, for both models.

--tiny is a smoke run at toy sizes that works on the CPU. --bandwidth-gbs is 4800 for the H200.
The bar, from the issue (H200): `generate` at 463 / 3,923 tok/s for SmolLM2 on grpo / wide and
358 / 3,620 for the 1.5B shape; a compiled static-cache loop reached 5.7-27x that.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time

import torch
from _common import environment, ratio, table

MODELS = {
    "smollm2": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "qwen1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                     rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True,
                 max_position_embeddings=1024),
}
SHAPES = {"grpo": (4, 8, 64), "wide": (32, 8, 256)}  # distinct prompts, samples each, new tokens
PROMPT_TOKENS = 48
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Graphs asked for explicitly: eager is the engine's CUDA default until a GPU run proves them.
VARIANTS = {"ours_lora": {"enforce_eager": False}, "ours_lora_merged": {"merge_lora": True, "enforce_eager": False}}
MORE_VARIANTS = {"ours_lora_eager": {"enforce_eager": True}, "ours_mixed": {"enforce_eager": False}}
GIB = 2**30


class NumberTokenizer:
    """What the engine asks of a tokenizer, for a model without one: an EOS id and decoding."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def build(name: str, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.eos_token_id = 0
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)  # a trained-looking adapter, not peft's zeros
    return peft.eval()


def prompts_for(shape: str, vocab: int) -> list[list[int]]:
    distinct = SHAPES[shape][0]
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, vocab, (distinct, PROMPT_TOKENS), generator=generator).tolist()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def run_ours(engine, shape: str, vocab: int, mixed: bool) -> tuple[int, float]:
    from art.engine.base import AdapterRef, SamplingParams

    distinct, samples, new = SHAPES[shape]
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=new, ignore_eos=True)
    live = AdapterRef("bench", None, None)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, params, None if mixed and i % 2 else live)
                                     for i, p in enumerate(prompts_for(shape, vocab))))
    synchronize()
    return sum(len(c.token_ids) for r in results for c in r), time.perf_counter() - start


def run_hf(model, shape: str, vocab: int, new: int | None = None) -> tuple[int, float]:
    distinct, samples, max_new = SHAPES[shape]
    new = new or max_new
    ids = torch.tensor(prompts_for(shape, vocab), device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             temperature=1.0, max_new_tokens=new, min_new_tokens=new, num_return_sequences=samples,
                             pad_token_id=0)
    synchronize()
    return (out.shape[1] - ids.shape[1]) * out.shape[0], time.perf_counter() - start


def timed(run, twice: bool) -> dict:
    first_tokens, first = run() if twice else (None, None)
    tokens, seconds = run()
    result = {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1)}
    if twice:
        result["warmup_extra_s"] = round(max(0.0, first - seconds * first_tokens / tokens), 2)
    return result


def memory(device: str, before: int, engine) -> dict:
    """GPU memory after a timed run: what the allocator holds, its peak since the engine started,
    and the part of it that is the KV buffer (the rest: prepared weights, graph pool, workspace)."""
    if not device.startswith("cuda"):
        return {}
    cache = engine.runner.cache
    reserved, kv = torch.cuda.memory_reserved(), cache.capacity * cache.bytes_per_token
    return {"memory_reserved_gb": round(reserved / GIB, 3), "max_memory_allocated_gb":
            round(torch.cuda.max_memory_allocated() / GIB, 3), "reserved_before_engine_gb": round(before / GIB, 3),
            "kv_cache_gb": round(kv / GIB, 3), "engine_other_gb": round((reserved - before - kv) / GIB, 3)}


def bench_variant(lora, label: str, engine_args: dict, shape: str, args) -> dict:
    from art.engine.adapters import AdapterSet
    from art.engine.llm_engine import LLMEngine

    distinct, samples, new = SHAPES[shape]
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved() if args.device.startswith("cuda") else 0
    start = time.perf_counter()
    engine = LLMEngine(lora, NumberTokenizer(), adapters=AdapterSet(lora), max_num_seqs=distinct * samples,
                       max_model_len=PROMPT_TOKENS + new + 8, gpu_memory_utilization=0.85, **engine_args)
    try:
        started = time.perf_counter() - start
        result = timed(lambda: asyncio.run(run_ours(engine, shape, lora.config.vocab_size, label == "ours_mixed")),
                       twice=True)
        result["engine_start_s"] = round(started, 2)
        result.update(engine.runner.stats())
        graphs = engine.runner.graphs
        if graphs is not None and graphs.last_failure:
            result["last_graph_failure"] = graphs.last_failure[:500]
        result.update(memory(args.device, before, engine))
    finally:
        engine.stop()
        del engine
        gc.collect()
    return result


def bench_model(name: str, args) -> dict:
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(name, args.device, dtype)  # the baseline's own copy: generate without LoRA layers
    lora = with_lora(build(name, args.device, dtype))
    vocab = model.config.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    variants = dict(VARIANTS, **(MORE_VARIANTS if args.all_variants else {}))
    if not cuda:
        variants.pop("ours_lora_eager", None)  # the CPU has no graphs: the same as ours_lora
    run_hf(model, "grpo", vocab, new=4)  # warm-up: kernels, generation config
    out: dict = {"weight_bytes": weight_bytes}
    for shape in [s for s in args.shapes.split(",") if s]:
        r = out[shape] = {"hf_generate": timed(lambda: run_hf(model, shape, vocab), twice=False)}
        print(f"{name} {shape} hf_generate: {r['hf_generate']['tok_s']} tok/s", flush=True)
        for label, engine_args in variants.items():
            r[label] = bench_variant(lora, label, engine_args, shape, args)
            print(f"{name} {shape} {label}: {r[label]['tok_s']} tok/s", flush=True)
        rows = SHAPES[shape][0] * SHAPES[shape][1]
        limit = rows * args.bandwidth_gbs * 1e9 / weight_bytes
        r["physical_limit_tok_s"] = round(limit)
        r["ours_share_of_limit"] = round(r["ours_lora"]["tok_s"] / limit, 3)
        r["ours_merged_share_of_limit"] = round(r["ours_lora_merged"]["tok_s"] / limit, 3)
        r["ratio_vs_hf"] = {k: ratio(v["tok_s"], r["hf_generate"]["tok_s"]) for k, v in r.items()
                            if isinstance(v, dict) and k.startswith("ours")}
        print(json.dumps({"benchmark": "engine_gpu", "model": name, "shape": shape, "device": args.device,
                          "weight_bytes": weight_bytes, **r}), flush=True)
    del model, lora
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="smollm2", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--shapes", default="grpo,wide")
    parser.add_argument("--all-variants", action="store_true",
                        help="also ours_lora_eager (CUDA) and ours_mixed (slow: eager decoding)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth for the limit (H200)")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: the tiny model, small shapes")
    args = parser.parse_args()
    if args.tiny:
        args.models = "tiny"
        SHAPES.update(grpo=(2, 4, 8), wide=(4, 4, 16))
    results = {name: bench_model(name, args) for name in args.models.split(",") if name}
    rows = []
    for name, r in results.items():
        for shape in (s for s in SHAPES if s in r):
            for system, v in r[shape].items():
                if isinstance(v, dict) and "tok_s" in v:
                    rows.append([f"{name} {shape} {system}", v["tokens"], v["seconds"], v["tok_s"],
                                 r[shape]["ratio_vs_hf"].get(system), v.get("warmup_extra_s")])
            rows.append([f"{name} {shape} physical limit", None, None, float(r[shape]["physical_limit_tok_s"]),
                         None, None])
    print()
    print(table(["model shape system", "tokens", "seconds", "tok/s", "x hf", "warm-up s"], rows))
    goals = {f"{name}_{shape}": (r[shape]["ratio_vs_hf"]["ours_lora"] or 0) >= (10 if shape == "grpo" else 5)
             for name, r in results.items() for shape in SHAPES if shape in r}
    print(json.dumps({"benchmark": "engine_gpu", "device": args.device, "results": results, "goals_met": goals,
                      "settings": {"shapes": {k: f"{d} prompts x {n} samples x {t} new tokens"
                                              for k, (d, n, t) in SHAPES.items()},
                                   "prompt_tokens": PROMPT_TOKENS, "lora": "r 8, alpha 16, 7 projections",
                                   "bandwidth_gbs": args.bandwidth_gbs},
                      **environment()}))


if __name__ == "__main__":
    main()
