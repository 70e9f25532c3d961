"""The CUDA graph test the first H200 run failed, under each attention kernel, with the controls that
say where a difference comes from.

    python benchmarks/graph_diagnosis.py [--kernels math,default,efficient,cudnn,flash] [--steps 8]

The case is `tests/engine/test_cuda.py::test_graph_replay_equals_eager_decoding` (tiny Qwen3 with
its live LoRA unmerged, bf16, three prompts, `--steps` decode steps; `tests/support/decoding.py`).
For each SDPA kernel choice (`ART_ENGINE_SDPA`) it runs three runners on the same model:
  eager, eager_again   two eager runners: if they differ, the test compares unwritten memory or a
                       nondeterministic kernel (the test is at fault)
  graphs               enforce_eager=False: the start-up check may refuse a bucket (then it decodes
                       eagerly and `failures` says why); otherwise graph vs eager is the test
and, per kernel, eager against the math kernel's eager run (what the kernel alone changes).
One JSON line per kernel, with the sizes (rows, padded bucket, width, positions, heads, vocab),
the graphs' (padded rows, width) shapes, the per-step max difference and the share of logits that differ, and a verdict:
  test     two eager runs differ
  refused  the start-up check refused the graph (its message)
  capture  graphs differ from eager under every kernel that ran
  kernel   graphs differ under some kernels only
  ok       graphs equal eager (within the test's 1e-3)
Without CUDA (the smoke run) there are no graphs: CUDA's KV layout runs on the CPU in float32 and
only the eager controls are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from art.engine.adapters import AdapterSet  # noqa: E402  (after the path: tests.support below)
from art.engine.config import EngineConfig  # noqa: E402
from art.engine.decoder import SDPA_ENV  # noqa: E402
from art.engine.static_runner import StaticRunner  # noqa: E402
from tests.support.decoding import PROMPTS, decode_steps  # noqa: E402
from tests.support.models import tiny_model  # noqa: E402

TEST_TOLERANCE = 1e-3
"""The test's atol."""


def run(model, kernel: str, steps: int, **config) -> tuple[torch.Tensor | None, StaticRunner | None, str | None]:
    """(logits [steps, 3, vocab], runner, None), or (None, None, the error) when this kernel cannot run."""
    os.environ[SDPA_ENV] = "" if kernel == "default" else kernel
    try:
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(**config).resolve(model), max_model_len=128)
        return decode_steps(runner, steps=steps).float().cpu(), runner, None
    except Exception as exc:  # e.g. flash attention refuses a mask
        return None, None, f"{type(exc).__name__}: {exc}"[:300]


def difference(a: torch.Tensor | None, b: torch.Tensor | None) -> dict | None:
    if a is None or b is None:
        return None
    diff = (a - b).abs()
    per_step = [round(float(d), 5) for d in diff.amax(dim=(1, 2))]
    differing = [i for i, d in enumerate(per_step) if d > TEST_TOLERANCE]
    return {"max": round(float(diff.max()), 5), "share_over_tolerance": round(float((diff > TEST_TOLERANCE).float().mean()), 4),
            "per_step": per_step, "first_step_over": differing[0] if differing else None}


def sizes(runner: StaticRunner, steps: int) -> dict:
    decoder = runner.decoder
    last = [len(p) + steps - 1 for p in PROMPTS]
    return {"rows": len(PROMPTS), "width": runner.row_width(max(last) + 1),
            "prompt_lengths": [len(p) for p in PROMPTS], "last_positions": last, "q_heads": decoder.q_heads,
            "kv_heads": decoder.kv_heads, "head_dim": decoder.head_dim, "vocab": decoder.config.vocab_size,
            "dtype": str(decoder.dtype).removeprefix("torch."), "device": str(runner.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="math,default,efficient,cudnn,flash")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    model = tiny_model("qwen3").to(device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    common = {} if cuda else {"kv_layout": "fixed", "pad_batches": True, "merge_lora": False}
    math_eager = None
    lines = []
    for kernel in [k.strip() for k in args.kernels.split(",") if k.strip()]:
        eager, runner, error = run(model, kernel, args.steps, enforce_eager=True, **common)
        line: dict = {"part": "graph_test", "sdpa": kernel}
        if error:
            lines.append({**line, "verdict": "unavailable", "error": error})
            print(json.dumps(lines[-1]), flush=True)
            continue
        if kernel == "math":
            math_eager = eager
        again, _, _ = run(model, kernel, args.steps, enforce_eager=True, **common)
        line.update(sizes=sizes(runner, args.steps), eager_vs_eager=difference(eager, again))
        if cuda:
            graphs, graph_runner, error = run(model, kernel, args.steps, enforce_eager=False, **common)
            stats = graph_runner.graphs if graph_runner is not None else None
            line.update(graph_vs_eager=difference(graphs, eager), graph_error=error,
                        graph_shapes=sorted([rows, width] for rows, width, _ in stats.graphs) if stats else None,
                        replays=stats.replays if stats else None,
                        failures=stats.failures if stats else None, last_failure=stats.last_failure if stats else None)
        else:
            line["graph_vs_eager"] = "no CUDA: no graphs"
        line["eager_vs_math_eager"] = difference(eager, math_eager)
        lines.append(line)
        print(json.dumps(line), flush=True)
    ran = [line for line in lines if line.get("verdict") != "unavailable"]
    for line in ran:
        graph = line.get("graph_vs_eager")
        if line["eager_vs_eager"]["max"] > TEST_TOLERANCE:
            line["verdict"] = "test"
        elif line.get("failures"):
            line["verdict"] = "refused"
        elif isinstance(graph, dict):
            line["verdict"] = "ok" if graph["max"] <= TEST_TOLERANCE else "graph differs"
        else:
            line["verdict"] = "no graphs"
    differs = [line["sdpa"] for line in ran if line["verdict"] == "graph differs"]
    overall = ("capture" if differs and len(differs) == len(ran) else "kernel: " + ",".join(differs) if differs
               else "test" if any(line["verdict"] == "test" for line in ran)
               else "refused" if any(line["verdict"] == "refused" for line in ran) else "ok" if cuda else "no graphs")
    print(json.dumps({"part": "graph_verdict", "verdict": overall,
                      "per_kernel": {line["sdpa"]: line["verdict"] for line in lines}, "cuda": cuda}), flush=True)


if __name__ == "__main__":
    main()
