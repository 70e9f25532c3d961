"""Scaling out on one machine: 1 against 2 engine replicas, and 1 against 2 trainer ranks.

    python benchmarks/scale_out.py [--repeats 3] [--threads 1] [--part replicas|trainer|both]

Replicas: the GRPO rollout shape of vs_trl.py (4 prompts of the yes/no/maybe example x 8
samples, up to 48 new tokens, all 32 requests at once through the openai client) against a
`LocalBackend` model with `engine_replicas` 1 and 2 (`ART_REPLICA_THREADS` = `--threads`, and
the same torch threads in this process, so the comparison is one core against two). Both
backends stay up and their rollouts alternate.

Trainer: the update is vs_trl.py's: 4 prompts of the yes/no/maybe example x 8 samples, completions of up
to 48 tokens, LoRA r=8 on the 7 projections of the default model, one AdamW step (the
`Trainer.step` the backend runs, packing, loss, all-reduce and optimizer included). The
baseline is the same trainer on one rank; ours splits each mini-batch between two gloo ranks
(`_internal_config={"trainer_ranks": 2}`), every rank limited to `--threads` torch threads, so
the comparison is one core against two. Both trainers stay alive and their updates alternate,
so a change in machine load hits both alike. Also reports the bytes each optimizer step
all-reduces (the trained parameters' gradients, float32). Prints the tables, the ratios, and
one JSON line.
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
    from art.training.rank_trainers import LeadTrainer
    from art.training.trainer import Trainer

    base, tokenizer = base_models.load(base_model, dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA_DEFAULTS))
    model.eval()
    trainer = Trainer(model, tokenizer)
    return (trainer if peers is None else LeadTrainer(trainer, peers)), tokenizer


async def rollouts(model, prompts: list[str], samples: int, max_tokens: int) -> tuple[float, list[int]]:
    """Seconds for every prompt's `samples` completions, all requested at once; and the replica of each."""
    import asyncio

    client = model.openai_client()
    start = time.perf_counter()
    completions = await asyncio.gather(*(
        client.chat.completions.create(model=model.get_inference_name(), messages=[{"role": "user", "content": p}],
                                       max_tokens=max_tokens, seed=i, extra_body={"ignore_eos": True})
        for p in prompts for i in range(samples)))
    return time.perf_counter() - start, [c.model_extra.get("replica", 0) for c in completions]


async def bench_replicas(args: argparse.Namespace) -> dict:
    import art

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from yes_no_maybe import make_prompts

    os.environ["ART_REPLICA_THREADS"] = str(args.threads)  # the replica process reads it
    prompts = random.Random(0).sample(make_prompts(), 4)
    seconds: dict[str, list[float]] = {"1 replica": [], "2 replicas": []}
    spread: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as root:
        backends, models = {}, {}
        for name, count in (("1 replica", 1), ("2 replicas", 2)):
            backends[name] = art.LocalBackend(path=root)
            models[name] = art.TrainableModel(name=f"r{count}", project="scale", base_model=art.DEFAULT_MODEL,
                                              _internal_config={"engine_replicas": count})
            await models[name].register(backends[name])
            await rollouts(models[name], prompts, 2, 8)  # warm-up
        for _ in range(args.repeats):
            for name, model in models.items():
                elapsed, replicas = await rollouts(model, prompts, 8, 48)
                seconds[name].append(elapsed)
                spread[name] = [replicas.count(i) for i in range(max(replicas) + 1)]
                print(f"{name}: {elapsed:.2f} s (requests per replica {spread[name]})", flush=True)
        for backend in backends.values():
            await backend.close()
    median = {name: round(statistics.median(values), 2) for name, values in seconds.items()}
    print(table(["engine", "median s / rollout batch", "batches"],
                [[k, v, len(seconds[k])] for k, v in median.items()]))
    speedup = ratio(median["1 replica"], median["2 replicas"])
    print(f"2 replicas are {speedup}x as fast as 1 on 32 rollouts of 48 tokens ({args.threads} thread(s) each)")
    return {"replica_seconds": median, "replica_speedup_2": speedup, "requests_per_replica": spread["2 replicas"]}


def main(args: argparse.Namespace) -> None:
    import asyncio

    import torch

    torch.set_num_threads(args.threads)
    out: dict = {"benchmark": "scale_out", "threads_per_process": args.threads}
    if args.part in ("replicas", "both"):
        out.update(asyncio.run(bench_replicas(args)))
    if args.part in ("trainer", "both"):
        out.update(bench_trainer(args))
    print(json.dumps({**out, "environment": environment()}))


def bench_trainer(args: argparse.Namespace) -> dict:
    import art
    from art.training.rank_group import RankPeers
    from art.training.ranks import RankSpec
    from art.training.options import LORA_DEFAULTS, TrainOptions

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
    return {"trainer_seconds": median, "trainer_speedup_2_ranks": speedup, "all_reduce_bytes": reduce_bytes,
            "sequences": sum(len(g.trajectories) for g in groups)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (replica or rank)")
    parser.add_argument("--part", choices=["replicas", "trainer", "both"], default="both")
    main(parser.parse_args())
