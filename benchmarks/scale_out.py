"""Scaling out on one machine: 1 against 2 data-parallel trainer ranks on the vs_trl update.

    python benchmarks/scale_out.py [--repeats 3] [--threads 1]

The update is vs_trl.py's: 4 prompts of the yes/no/maybe example x 8 samples, completions of up
to 48 tokens, LoRA r=8 on the 7 projections of the default model, one AdamW step (the
`Trainer.step` the backend runs, packing, loss, all-reduce and optimizer included). The
baseline is the same trainer on one rank; ours splits each mini-batch between two gloo ranks
(`_internal_config={"trainer_ranks": 2}`), every rank limited to `--threads` torch threads, so
the comparison is one core against two. Both trainers stay alive and their updates alternate,
so a change in machine load hits both alike. Also reports the bytes each optimizer step
all-reduces (the trained parameters' gradients, float32). Prints the table, the ratio, and one
JSON line. (Engine replicas, the other half of the issue's benchmark, are not built yet.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import environment, ratio, table  # noqa: E402


def workload(tokenizer, seed: int = 0, prompts: int = 4, samples: int = 8, max_tokens: int = 48):
    """TrajectoryGroups of the vs_trl update's shape, with sampler token ids and logprobs."""
    import art
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_message import ChatCompletionMessage
    from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from yes_no_maybe import make_prompts

    rng = random.Random(seed)
    groups = []
    for text in rng.sample(make_prompts(), prompts):
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        trajectories = []
        for i in range(samples):
            n = max_tokens if i % 2 == 0 else rng.randrange(2, max_tokens)
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            content = [ChatCompletionTokenLogprob(token=str(t), logprob=rng.uniform(-3.0, -0.1), bytes=None,
                                                  top_logprobs=[]) for t in ids]
            choice = Choice(index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content="x"),
                            logprobs=ChoiceLogprobs(content=content), prompt_token_ids=prompt, token_ids=ids)
            trajectories.append(art.Trajectory(messages_and_choices=[*messages, choice], reward=rng.random()))
        groups.append(art.TrajectoryGroup(trajectories))
    return groups


def build(base_model: str, peers=None):
    import torch
    from peft import LoraConfig, get_peft_model

    from art import base_models
    from art.training.options import LORA_DEFAULTS
    from art.training.trainer import Trainer

    base, tokenizer = base_models.load(base_model, dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA_DEFAULTS))
    model.eval()
    return Trainer(model, tokenizer, peers=peers), tokenizer


def main(args: argparse.Namespace) -> None:
    import torch

    import art
    from art.training.data_parallel import RankPeers, RankSpec
    from art.training.options import LORA_DEFAULTS, TrainOptions

    torch.set_num_threads(args.threads)
    os.environ["ART_RANK_THREADS"] = str(args.threads)  # the peer process reads it
    base_model = art.DEFAULT_MODEL
    single, tokenizer = build(base_model)
    peers = RankPeers(2, RankSpec(base_model, dict(LORA_DEFAULTS), "cpu", "float32"))
    parallel, _ = build(base_model, peers=peers)
    groups = workload(tokenizer)
    options = TrainOptions(learning_rate=1e-5)
    seconds: dict[str, list[float]] = {"1 rank": [], "2 ranks": []}
    try:
        with tempfile.TemporaryDirectory() as folder:
            parallel.save(Path(folder))
            parallel.restore(Path(folder))  # starts rank 1 on the same weights
        for trainer in (single, parallel):  # warm-up: allocations, the first all-reduce
            trainer.step(groups, options, quiet=True)
        for _ in range(args.repeats):
            for name, trainer in (("1 rank", single), ("2 ranks", parallel)):
                start = time.perf_counter()
                metrics = trainer.step(groups, options, quiet=True)
                seconds[name].append(time.perf_counter() - start)
                print(f"{name}: {seconds[name][-1]:.2f} s (loss {metrics['loss']:.4f})", flush=True)
    finally:
        peers.close()
    reduce_bytes = sum(p.numel() * 4 for p in parallel.params)
    median = {name: round(statistics.median(values), 2) for name, values in seconds.items()}
    speedup = ratio(median["1 rank"], median["2 ranks"])
    print(table(["trainer", "median s / update", "updates"], [[k, v, len(seconds[k])] for k, v in median.items()]))
    print(f"2 ranks are {speedup}x as fast as 1 ({args.threads} thread(s) per rank); all-reduce "
          f"{reduce_bytes / 2**20:.1f} MiB per optimizer step")
    print(json.dumps({"benchmark": "scale_out", "trainer_seconds": median, "trainer_speedup_2_ranks": speedup,
                      "all_reduce_bytes": reduce_bytes, "threads_per_rank": args.threads,
                      "sequences": sum(len(g.trajectories) for g in groups), "environment": environment()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    main(parser.parse_args())
