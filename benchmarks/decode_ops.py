"""Ops per decode step of the default model with a LoRA adapter, counted on the CPU profiler.

    python benchmarks/decode_ops.py [--rows 8] [--context 40] [--rank 16]

A proxy for the kernels a GPU decode step launches (each leaf aten op below is one kernel or
none): on CUDA the engine serves the live adapter unmerged, base weights plus the LoRA term in
each projection, so that term's ops are multiplied by every projection of every layer. Counted
for each serving path, in float32 and in bfloat16 (CUDA's compute dtype, where a LoRA held in
float32 costs casts around its matmuls):
  merged      the live adapter merged into a copy of the weights (the CPU default): no LoRA ops,
              the floor the unmerged path is compared with
  unmerged    base weights + the live LoRA term (CUDA's default)
  checkpoint  base weights + a checkpoint adapter's LoRA (`name@step`, peft's own float32 tensors)
Leaf aten ops only (`tests/support/ops.py`: an op with no computing op inside it), views, casts
to the same dtype and allocations left out. Prints the
table, the unmerged/merged ratio and one JSON line. Dated runs: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _common import environment, ratio, table

sys.path.insert(0, str(Path(__file__).parents[1]))

import art
from art.engine.adapters import LIVE, AdapterSet
from art.engine.config import EngineConfig
from art.engine.static_runner import StaticRunner
from tests.support.ops import leaf_ops, matmuls

def count_path(model, dtype: torch.dtype, merge: bool, adapter: str, rows: int, context: int) -> dict:
    runner = StaticRunner(model, AdapterSet(model), EngineConfig(dtype=str(dtype).split(".")[1], merge_lora=merge,
                                                                 prefix_cache_tokens=0).resolve(model),
                          max_model_len=context + 16)
    prompts = [[(7 * r + i) % 5000 + 10 for i in range(context)] for r in range(rows)]
    names = [adapter] * rows
    with torch.inference_mode():
        _, staged = runner.prefill(prompts, [(0, None)] * rows, names)
        runner.add(staged, list(range(rows)))
        runner.decode([11] * rows, [context] * rows, names)  # prepares what is built lazily

        def step():
            runner.decode([12] * rows, [context + 1] * rows, names)

        counts = leaf_ops(step)
    projections = len(runner.decoder.projections())
    return {"ops": sum(counts.values()), "matmuls": matmuls(counts), "projections": projections,
            "matmuls_per_projection": round(matmuls(counts) / projections, 2),
            "top_ops": [[name, n] for name, n in counts.most_common(8)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base, _ = art.base_models.load(art.DEFAULT_MODEL)
    lora = LoraConfig(task_type="CAUSAL_LM", r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
    model = get_peft_model(base, lora).eval()
    model.add_adapter("checkpoint", lora)
    with torch.no_grad():  # non-zero B: a LoRA term that changes the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for name, params in model.named_parameters():  # peft keeps adapters in float32 on a bf16 base
            if "lora_" in name:
                params.data = params.data.float()
        for path, merge, adapter in (("merged", True, LIVE), ("unmerged", False, LIVE),
                                     ("checkpoint", False, "checkpoint")):
            key = f"{path}/{str(dtype).split('.')[1]}"
            results[key] = count_path(model, dtype, merge, adapter, args.rows, args.context)
            print(f"{key}: {results[key]['ops']} ops, {results[key]['matmuls_per_projection']} matmuls per projection",
                  flush=True)
    print(table(["path", "ops per step", "matmuls", "matmuls / projection", "most frequent ops"],
                [[k, r["ops"], r["matmuls"], r["matmuls_per_projection"],
                  ", ".join(f"{n.split('::')[1]} {c}" for n, c in r["top_ops"][:4])] for k, r in results.items()]))
    ratios = {dtype: ratio(results[f"unmerged/{dtype}"]["ops"], results[f"merged/{dtype}"]["ops"])
              for dtype in ("float32", "bfloat16")}
    lora_ops = {dtype: round((results[f"unmerged/{dtype}"]["ops"] - results[f"merged/{dtype}"]["ops"])
                             / results[f"merged/{dtype}"]["projections"], 2) for dtype in ("float32", "bfloat16")}
    print(f"unmerged / merged ops per step: {ratios}; LoRA ops per projection: {lora_ops}")
    print(json.dumps({"benchmark": "decode_ops", "rows": args.rows, "context": args.context, "rank": args.rank,
                      "results": results, "unmerged_vs_merged_ops": ratios, "lora_ops_per_projection": lora_ops,
                      "env": environment()}))


if __name__ == "__main__":
    main()
