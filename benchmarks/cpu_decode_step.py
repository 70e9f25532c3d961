"""One decode step of the default model on the CPU: the ways to run it that the engine chose between.

    python benchmarks/cpu_decode_step.py [--rows 4 32] [--context 100] [--repeats 20] [--compile]

All in one process on the same float32 weights (the live LoRA adapter merged in, as the engine
serves RL rollouts), `rows` sequences each `context` tokens into their KV cache:
  hf           transformers' forward with its DynamicCache (what the engine ran before, and what
               `generate` runs)
  ours_plain   the engine's decoder (art/engine/decoder.py) with `F.linear` on the merged weights
  ours_packed  the same with the weights packed for oneDNN (the CPU default)
  ours_compiled  (--compile) torch.compile(dynamic=False) of the plain decoder's step, inductor's
               C++ backend with freezing (weight prepacking); its first-call time is reported
Prints median milliseconds per step and the ratios to hf, then one JSON line.

Packing is `torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what inductor's CPU
freezing uses, without its compile time. Each figure is the median of --repeats steps (hf's cache
grows by one token a call: negligible over the repeats). Dated runs: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import environment, ratio, table

import art
from art.engine.adapters import LIVE, AdapterSet
from art.engine.config import EngineConfig
from art.engine.static_runner import StaticRunner


def median_ms(step, repeats: int) -> float:
    step()
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (minutes of compiling)")
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    from art.training.options import LORA_DEFAULTS

    base, _ = art.base_models.load(art.DEFAULT_MODEL)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA_DEFAULTS)).eval()
    results, rows_out = {}, []
    with torch.inference_mode():
        for rows in args.rows:
            prompts = [list(range(100 + r, 100 + r + args.context)) for r in range(rows)]
            tokens, positions, names = [1] * rows, [args.context] * rows, [LIVE] * rows
            runners = {}
            for label, pack in (("ours_plain", False), ("ours_packed", True)):
                runner = StaticRunner(model, AdapterSet(model), EngineConfig(merge_lora=True).resolve(model),
                                      max_model_len=2048)
                runner.weights.pack = pack
                _, staged = runner.prefill(prompts, [(0, None)] * rows, names)
                runner.add(staged, list(range(rows)))
                runners[label] = runner
            result = {label: median_ms(lambda r=r: r.decode(tokens, positions, names), args.repeats)
                      for label, r in runners.items()}

            # transformers: the same rows through its own forward and cache, merged weights too.
            adapters = AdapterSet(model)
            ids = torch.tensor(prompts)
            with adapters.activate([LIVE]):
                cache = model(input_ids=ids, use_cache=True).past_key_values
                next_ids = torch.ones(rows, 1, dtype=torch.long)
                where = torch.full((rows, 1), args.context)

                def hf_step():  # the cache grows by one token a call: negligible over the repeats
                    model(input_ids=next_ids, position_ids=where, past_key_values=cache, use_cache=True, logits_to_keep=1)

                result["hf"] = median_ms(hf_step, args.repeats)
            adapters.unmerge()

            if args.compile:
                import torch._inductor.config as inductor

                inductor.freezing = True
                runner = runners["ours_plain"]
                ids_t = torch.tensor(tokens)[:, None]
                where_t = torch.tensor(positions)[:, None]
                route = runner.weights.route(names, runner.device)
                width = runner._width(args.context + 1)
                step = torch.compile(lambda i, p: runner.decoder.forward(i, p, runner.cache, width, route),
                                     dynamic=False)
                start = time.perf_counter()
                step(ids_t, where_t)
                result["ours_compiled_first_call_s"] = round(time.perf_counter() - start, 1)
                result["ours_compiled"] = median_ms(lambda: step(ids_t, where_t), args.repeats)
            results[f"rows_{rows}"] = result
            for label in ("hf", "ours_plain", "ours_packed", "ours_compiled"):
                if label in result:
                    rows_out.append([f"{rows} rows  {label}", result[label], ratio(result["hf"], result[label])])
    print(table(["rows  system", "ms / step", "x hf"], rows_out))
    print(json.dumps({"benchmark": "cpu_decode_step", "context": args.context, "results": results,
                      "settings": {"model": art.DEFAULT_MODEL, "weights": "float32, LoRA merged"},
                      **environment()}))


if __name__ == "__main__":
    main()
