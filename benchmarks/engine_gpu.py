"""Decode throughput of our engine against Hugging Face `generate`, on models built from real configs.

    python benchmarks/engine_gpu.py [--device cuda] [--models smollm2,qwen1.5b] [--shapes grpo,wide]
                                    [--bandwidth-gbs 4800] [--tiny]

The issue's shapes, every completion exactly `max_tokens` long (end-of-sequence ignored), temperature 1:
  grpo   4 distinct prompts of 48 tokens x 8 samples = 32 rows, 64 new tokens
  wide   32 distinct prompts of 48 tokens x 8 samples = 256 rows, 256 new tokens
Models (random weights: throughput does not depend on the values once EOS is ignored), bf16 on
CUDA, float32 on the CPU:
  smollm2    SmolLM2-135M's config;   qwen1.5b   Qwen2.5-1.5B's shape
Systems, one process, engine-level (no HTTP):
  ours_lora         LLMEngine, a LoRA adapter (r 8, the 7 projections) as RL rollouts use it, defaults
                    (on CUDA: LoRA inside CUDA graphs, one copy of the weights)
  ours_lora_merged  the same with merge_lora=True (a merged copy of the adapted weights)
  ours_lora_eager   the same with enforce_eager=True (no CUDA graphs)
  ours_mixed        half the requests on the adapter, half on the base model (eager, per-group LoRA)
  hf_generate       `model.generate(do_sample=True, min_new_tokens=max_new_tokens)`, the base model
Each system runs each shape twice; the second run is timed (the first captures graphs, warms
kernels) and the first's extra time is reported as warm-up. Also reported: the physical limit,
rows x memory bandwidth / weight bytes (every decode step reads the weights once), and our share
of it. Prints a table, then one JSON line. Goal (the issue): ours >= 10x hf on grpo and >= 5x on
wide, for both models.
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


async def run_ours(engine, shape: str, vocab: int, mixed: bool) -> tuple[int, float]:
    from art.engine.base import AdapterRef, SamplingParams

    distinct, samples, new = SHAPES[shape]
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=new, ignore_eos=True)
    live = AdapterRef("bench", None, None)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, params, None if mixed and i % 2 else live)
                                     for i, p in enumerate(prompts_for(shape, vocab))))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sum(len(c.token_ids) for r in results for c in r), time.perf_counter() - start


def run_hf(model, shape: str, vocab: int) -> tuple[int, float]:
    distinct, samples, new = SHAPES[shape]
    ids = torch.tensor(prompts_for(shape, vocab), device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             temperature=1.0, max_new_tokens=new, min_new_tokens=new, num_return_sequences=samples,
                             pad_token_id=0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) * out.shape[0], time.perf_counter() - start


def timed_twice(run) -> dict:
    first_tokens, first = run()
    tokens, seconds = run()
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
            "warmup_extra_s": round(max(0.0, first - seconds * first_tokens / tokens), 2)}


def bench_model(name: str, args) -> dict:
    from art.engine.adapters import AdapterSet
    from art.engine.llm_engine import LLMEngine

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build(name, args.device, dtype)
    vocab = model.config.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = [s for s in args.shapes.split(",") if s]
    out: dict = {"weight_bytes": weight_bytes}
    for shape in shapes:
        out[shape] = {"hf_generate": timed_twice(lambda: run_hf(model, shape, vocab))}
        print(f"{name} {shape} hf_generate: {out[shape]['hf_generate']['tok_s']} tok/s", flush=True)
    lora = with_lora(model)
    variants = {"ours_lora": {}, "ours_lora_merged": {"merge_lora": True}, "ours_lora_eager": {"enforce_eager": True},
                "ours_mixed": {}}
    if not args.device.startswith("cuda"):
        variants.pop("ours_lora_eager")  # the CPU has no graphs: the same as ours_lora
    for label, engine_args in variants.items():
        rows = max(SHAPES[s][0] * SHAPES[s][1] for s in shapes)
        engine = LLMEngine(lora, NumberTokenizer(), adapters=AdapterSet(lora), max_num_seqs=rows,
                           max_model_len=PROMPT_TOKENS + max(SHAPES[s][2] for s in shapes) + 8,
                           gpu_memory_utilization=0.85, **engine_args)
        try:
            for shape in shapes:
                result = timed_twice(lambda: asyncio.run(run_ours(engine, shape, vocab, label == "ours_mixed")))
                result.update(engine.runner.stats())
                out[shape][label] = result
                print(f"{name} {shape} {label}: {result['tok_s']} tok/s", flush=True)
        finally:
            engine.stop()
            del engine
            gc.collect()
    for shape in shapes:
        rows = SHAPES[shape][0] * SHAPES[shape][1]
        limit = rows * args.bandwidth_gbs * 1e9 / weight_bytes
        r = out[shape]
        r["physical_limit_tok_s"] = round(limit)
        r["ours_share_of_limit"] = round(r["ours_lora"]["tok_s"] / limit, 3)
        r["ratio_vs_hf"] = {k: ratio(v["tok_s"], r["hf_generate"]["tok_s"]) for k, v in r.items()
                            if isinstance(v, dict) and k.startswith("ours")}
    del model, lora
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="smollm2,qwen1.5b", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--shapes", default="grpo,wide")
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
                                 r[shape]["ratio_vs_hf"].get(system), v["warmup_extra_s"]])
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
