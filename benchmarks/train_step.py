"""One GRPO update on the default model: shared-prefix packing against one padded row per sequence.

The workload is vs_trl.py's update: 4 prompts of the yes/no/maybe example (chat template
applied) x 8 samples, completions of up to 48 tokens (half of them the full 48, the rest
shorter), LoRA r=8 on all linear projections. The baseline is our own trainer with
`packing="padded"` (what every peer does: each sample its own padded row, prompt included);
ours is the default `packing="shared_prefix"`. Both apply the same update (tests/test_packing.py
checks loss and gradients match), so only the time differs. Prints the table, the ratio and
one JSON line.

    python benchmarks/train_step.py [--repeats 3]
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


def time_update(trainer, sequences, options, repeats: int) -> tuple[float, dict]:
    """Median seconds of forward + backward over the whole batch (no optimizer step)."""
    from art.training.loss import Normalizer
    from art.training.trainer import plan_micro_batches

    seconds = []
    micro = plan_micro_batches(sequences, options)
    normalizer = Normalizer(options.loss_normalization, sum(s.num_trained for s in sequences), len(sequences))
    for _ in range(repeats):
        trainer.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for batch in micro:
            trainer._forward(batch, options, normalizer)["loss"].backward()
        seconds.append(time.perf_counter() - start)
    stats = {"tokens_computed": sum(m.tokens_computed for m in micro), "micro_batches": len(micro)}
    return statistics.median(seconds), stats


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
    results = {}
    for layout in ("padded", "shared_prefix"):
        options = TrainOptions(packing=layout, gradient_checkpointing=args.gradient_checkpointing)
        trainer._set_gradient_checkpointing(options.gradient_checkpointing)
        seconds, stats = time_update(trainer, sequences, options, args.repeats)
        results[layout] = {"seconds": round(seconds, 2), **stats}
        print(f"{layout}: {seconds:.2f} s, {stats}", flush=True)
    rows = [[name, r["seconds"], r["tokens_computed"], r["micro_batches"]] for name, r in results.items()]
    print(table(["layout", "s / update", "tokens computed", "micro-batches"], rows))
    speedup = ratio(results["padded"]["seconds"], results["shared_prefix"]["seconds"])
    print(f"tokens in batch {in_batch}; shared_prefix is {speedup}x faster than padded")
    print(json.dumps({"benchmark": "train_step", "tokens_in_batch": in_batch, "results": results,
                      "speedup_vs_padded": speedup, "env": environment()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    main(parser.parse_args())
