"""One GRPO update on the default model: shared-prefix packing against one padded row per sequence.

The workload is vs_trl.py's update: 4 prompts of the yes/no/maybe example (chat template
applied) x 8 samples, completions of up to 48 tokens (half of them the full 48, the rest
shorter), LoRA r=8 on all linear projections. The baseline is our own trainer with
`packing="padded"` (what every peer does: each sample its own padded row, prompt included);
ours is `packing="shared_prefix"` at a few row lengths (the default is 512). Both apply the
same update (tests/training/test_packing.py checks loss and gradients match), so only the time differs.
Padded rows hold one sequence each and go to the model without a mask (SDPA's causal path);
packed rows carry a [rows, 1, W, W] mask, whose size is reported. Also times the host side:
building each layout's inputs, and the finiteness check of the trained weights after an
optimizer step (per parameter, as it was, against the trainer's one stacked check). Prints
the table, the ratio and one JSON line.

    python benchmarks/train_step.py [--repeats 3] [--row-tokens 256 512 1024]

The layouts are timed interleaved (each repeat runs every layout once), so a change in machine
load hits them alike; the figures are medians over --repeats. Dated runs: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

from _common import environment, ratio, table  # noqa: E402


def workload(tokenizer, seed: int = 0, prompts: int = 4, samples: int = 8, max_tokens: int = 48):
    from art.training.sequences import Sequence

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from yes_no_maybe import make_prompts

    rng = random.Random(seed)
    groups = []
    for g, text in enumerate(rng.sample(make_prompts(), prompts)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        for i in range(samples):
            n = max_tokens if i % 2 == 0 else rng.randrange(2, max_tokens)
            completion = [rng.randrange(100, 40000) for _ in range(n)]
            s = Sequence(group=g, advantage=rng.uniform(-1.0, 1.0))
            s.extend(prompt, None)
            s.extend(completion, [rng.uniform(-3.0, -0.1) for _ in completion])
            groups.append(s)
    return groups


def time_updates(trainer, sequences, layouts: dict, repeats: int) -> dict[str, dict]:
    """Median and best seconds of forward + backward over the whole batch (no optimizer step) for
    each layout, the layouts interleaved so that a change in machine load hits them alike; and
    of building its inputs on the host (`MicroBatch.to_tensors`), with the mask's size."""
    from art.training.loss import Normalizer
    from art.training.batch import plan_micro_batches

    plans = {name: plan_micro_batches(sequences, options) for name, options in layouts.items()}
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    host: dict[str, list[float]] = {name: [] for name in layouts}
    normalizer = Normalizer("token", sum(s.num_trained for s in sequences), len(sequences))
    for _ in range(repeats):
        for name, options in layouts.items():
            trainer.model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            for batch in plans[name]:
                trainer._forward(batch, options, normalizer)["loss"].backward()
            seconds[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            for batch in plans[name]:
                batch.to_tensors(trainer.pad_id, trainer.device, trainer.dtype)
            host[name].append(time.perf_counter() - start)
            print(f"{name}: {seconds[name][-1]:.2f} s, inputs {host[name][-1] * 1e3:.1f} ms", flush=True)
    return {name: {"seconds": round(statistics.median(seconds[name]), 2), "best_seconds": round(min(seconds[name]), 2),
                   "inputs_ms": round(statistics.median(host[name]) * 1e3, 1),
                   "best_inputs_ms": round(min(host[name]) * 1e3, 1),
                   "mask_mb": round(sum(mask_bytes(m.to_tensors(trainer.pad_id, trainer.device, trainer.dtype)) for m in plans[name]) / 2**20, 2),
                   "tokens_computed": sum(m.tokens_computed for m in plans[name]),
                   "rows": sum(len(m.rows) for m in plans[name]), "micro_batches": len(plans[name])}
            for name in layouts}


def mask_bytes(inputs) -> int:
    """Bytes of the attention mask given to the model (0 on the plain causal path)."""
    mask = inputs.attention
    return 0 if mask is None else mask.numel() * mask.element_size()


def time_checks(trainer, repeats: int) -> dict[str, float]:
    """Milliseconds of the finiteness check of the trained weights after an optimizer step: one
    check per parameter (one device sync each on a GPU) against the trainer's."""
    import torch

    def per_parameter() -> bool:
        return all(bool(torch.isfinite(p).all()) for p in trainer.params)

    out = {}
    for name, check in (("per_parameter", per_parameter), ("trainer", trainer.weights_finite)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            assert check()
            times.append(time.perf_counter() - start)
        out[name] = round(statistics.median(times) * 1e3, 2)
    return out


def main(args: argparse.Namespace) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from art import base_models
    from art.training.options import LORA_DEFAULTS, TrainOptions
    from art.training.trainer import Trainer

    base, tokenizer = base_models.load(base_models.DEFAULT_MODEL)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA_DEFAULTS))
    model.train()
    trainer = Trainer(model, SimpleNamespace(pad_token_id=tokenizer.pad_token_id or 0))
    sequences = workload(tokenizer, max_tokens=args.max_tokens)
    in_batch = sum(len(s.token_ids) for s in sequences)
    layouts = {"padded": TrainOptions(packing="padded")}
    for row_tokens in args.row_tokens:
        layouts[f"shared_prefix/{row_tokens}"] = TrainOptions(packing="shared_prefix", packed_row_tokens=row_tokens)
    trainer.set_gradient_checkpointing(args.gradient_checkpointing)
    results = time_updates(trainer, sequences, layouts, args.repeats)
    checks = time_checks(trainer, max(args.repeats, 5))
    rows = [[name, r["seconds"], r["best_seconds"], r["inputs_ms"], r["best_inputs_ms"], r["mask_mb"],
             r["tokens_computed"], r["rows"]] for name, r in results.items()]
    print(table(["layout", "s / update", "best s", "inputs ms", "best inputs ms", "mask MB", "tokens computed",
                 "rows"], rows))
    print(f"finiteness check of {len(trainer.params)} trained tensors (ms): {checks}")
    default = f"shared_prefix/{TrainOptions().packed_row_tokens}"
    speedup = ratio(results["padded"]["seconds"], results[default]["seconds"]) if default in results else None
    print(f"tokens in batch {in_batch}; the default layout ({default}) is {speedup}x as fast as padded")
    print(json.dumps({"benchmark": "train_step", "tokens_in_batch": in_batch, "results": results,
                      "finite_check_ms": checks, "speedup_vs_padded": speedup, "env": environment()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--row-tokens", type=int, nargs="+", default=[256, 512, 1024],
                        help="packed_row_tokens values to time (the default is 512)")
    main(parser.parse_args())
