"""GRPO on the yes/no/maybe task: TRL's `GRPOTrainer` against our training loop, in one process.

    python benchmarks/vs_trl.py [--steps 10] [--prompts-per-step 4] [--group-size 8] [--max-tokens 48]
                                [--skip-trl] [--budget-s S] [--plot] [--device cpu|cuda] [--model ID_OR_PATH]
                                [--reward yes_no_maybe|letter_e]

The workload is examples/yes_no_maybe.py (its prompts and its `score` as the reward) on the
default model, on the CPU (`--device cuda`: both systems on the GPU in bf16, TRL with `bf16=True`).
`--reward letter_e` (the share of "e" in the text) gives a random-weight model (`--model` a
folder built from a real config) rewards that differ, so both systems really train: for step
times where the real weights are not at hand. Three runs, one after another:
  trl       TRL `GRPOTrainer` (use_cpu), LoRA r=8 alpha=16 on the 7 projections, learning rate
            1e-5 (constant), beta 0, temperature 1.0, 4 prompts x 8 generations per optimizer
            step, max 48 new tokens. Its model is the plain float32 model `art.base_models.load`
            rebuilds (TRL refuses the GGUF-loaded one as quantized).
  ours      `art.LocalBackend` + `TrainableModel` with the same settings: rollouts through the
            openai client, `model.train(groups, TrainConfig(learning_rate, beta=0))`.
  defaults  our loop with the example's documented defaults (learning rate 1e-3, max_tokens 12),
            for as many steps as fit in TRL's wall-clock for its steps (its median step x steps).
Both the trl and ours runs see the same prompts in the same seeded order (the example's
sampling). A step is rollout + update; the median step time skips the first (warm-up) step.
Prints a table and the reward curves, then one JSON line. Goals (the issue): ours' step time
<= 1/3 of TRL's; ours' final reward >= TRL's; the defaults run's final reward > 0.5.
"Final reward" is the mean reward of the last min(3, steps) steps' rollouts (32 samples a step
are noisy).

What the comparison controls for: TRL's learning-rate schedule is set to constant (ours is
constant; TRL's default decays linearly) and its activation (gradient) checkpointing is off (TRL
1.16 turns it on by default; on a 135M model it only costs time, so off is the stricter baseline);
every other GRPOConfig field keeps TRL's default (loss dapo, AdamW betas 0.9/0.999, no weight
decay, clip 1.0), and ours keeps its own defaults likewise. Step k of both systems trains on the
example's sample for step k (`random.Random(seed * 10000 + k)`), which TRL reads in that order
(`shuffle_dataset=False`). A step is, for TRL, `on_step_begin` -> `on_step_end` of a
TrainerCallback (generation happens inside `training_step`); for ours, `gather_trajectory_groups`
+ `model.train`. A step's mean reward is its 32 rollouts' (TRL: recorded inside the reward
function). The defaults run starts another step only while its time so far plus its last step's
fits in TRL's median step x steps (not TRL's total: its warm-up step once took 235 s on a busy
machine); with --skip-trl it runs --steps steps, or fits --budget-s. --plot writes
benchmarks/vs_trl_rewards.png (reward against step and against wall-clock seconds). JSON keys:
trl, ours_same_settings, ours_defaults_same_wallclock (each steps, median_step_s, total_s,
final_reward, rewards, step_seconds; ours also median_update_s, the `model.train` part),
ratio_step_time (ours / TRL), speedup (TRL / ours), goals, settings, trl_status, trl_version and
the environment. Dated runs: benchmarks/results/*-vs_trl.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from _common import environment, installed_version, ratio, table

import art

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "yes_no_maybe.py"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULTS = {"learning_rate": 1e-3, "max_tokens": 12}  # examples/yes_no_maybe.py
FINAL_WINDOW = 3


def letter_e(text: str) -> float:
    """The share of "e" among the characters: varies between completions of any model."""
    return text.count("e") / max(1, len(text))


def load_example():
    spec = importlib.util.spec_from_file_location("yes_no_maybe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()
REWARDS = {"yes_no_maybe": example.score, "letter_e": letter_e}


def step_prompts(step: int, prompts_per_step: int, seed: int) -> tuple[list[str], random.Random]:
    """The example's prompt sampling for one step; the rng then seeds that step's rollouts."""
    rng = random.Random(seed * 10_000 + step)
    return rng.sample(example.make_prompts(), prompts_per_step), rng


def final(rewards: list[float]) -> float | None:
    tail = rewards[-FINAL_WINDOW:]
    return round(sum(tail) / len(tail), 4) if tail else None


def median_step(seconds: list[float]) -> float | None:
    timed = seconds[1:] or seconds  # the first step warms up (allocations, kernels, adapters)
    return round(statistics.median(timed), 2) if timed else None


def run_trl(args: argparse.Namespace, root: str) -> dict:
    """TRL's GRPOTrainer on the same prompts, one optimizer step per 4 x 8 completions."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    cuda = args.device.startswith("cuda")
    # A plain LlamaForCausalLM (float32 on the CPU; bf16 on CUDA, like our base weights).
    model, tokenizer = art.base_models.load(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    # One dataset row per prompt in the order our loop uses; TRL's sampler (shuffle off) repeats
    # each row num_generations times, so step k trains on exactly our step k's prompts.
    rows = [{"prompt": [{"role": "user", "content": p}]}
            for step in range(args.steps) for p in step_prompts(step, args.prompts_per_step, args.seed)[0]]
    rewards: list[float] = []

    def yes_no_maybe_reward(prompts, completions, **_) -> list[float]:
        scores = [REWARDS[args.reward](c[-1]["content"] if isinstance(c, list) else c) for c in completions]
        rewards.append(sum(scores) / len(scores))
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)
            print(f"trl step {len(self.seconds) - 1}: {self.seconds[-1]:.1f} s, "
                  f"mean reward {rewards[-1]:.3f}", flush=True)

    batch = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(Path(root) / "trl"), use_cpu=not cuda, bf16=cuda, fp16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed,
        max_steps=args.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.max_tokens,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,  # ours is constant
        beta=0.0, temperature=args.temperature, top_p=1.0, top_k=0, shuffle_dataset=False,
        # Recomputation to save memory; a 135M model does not need it and it only slows TRL down.
        activation_checkpointing=False,  # transformers 5.24's name for gradient_checkpointing
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[yes_no_maybe_reward], args=config,
        train_dataset=Dataset.from_list(rows), callbacks=[timer],
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                               task_type="CAUSAL_LM"),
    )
    trainer.train()
    del trainer, model
    gc.collect()
    return {"step_seconds": timer.seconds, "rewards": rewards[:len(timer.seconds)]}


async def run_ours(args: argparse.Namespace, root: str, name: str, *, learning_rate: float, max_tokens: int,
                   temperature: float | None, steps: int, budget_s: float | None = None) -> dict:
    """The example's loop with the given settings; with budget_s, stop before a step would overrun it."""
    backend = art.LocalBackend(path=str(Path(root) / name))
    model = art.TrainableModel(name=name, project="vs-trl", base_model=args.model,
                               _internal_config={"peft_args": {"r": 8, "lora_alpha": 16},
                                                 "engine_args": {"device": args.device}})
    await model.register(backend)
    client = model.openai_client()
    sampling = {"max_tokens": max_tokens} | ({"temperature": temperature} if temperature is not None else {})

    async def rollout(prompt: str, seed: int) -> art.Trajectory:
        messages: art.Messages = [{"role": "user", "content": prompt}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, seed=seed, **sampling)
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice],
                              reward=REWARDS[args.reward](choice.message.content or ""))

    seconds: list[float] = []
    update_seconds: list[float] = []
    rewards: list[float] = []
    try:
        for step in range(steps):
            if budget_s is not None and seconds and sum(seconds) + seconds[-1] > budget_s:
                break
            start = time.perf_counter()
            batch, rng = step_prompts(step, args.prompts_per_step, args.seed)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(p, seed=rng.randrange(2**31)) for _ in range(args.group_size))
                 for p in batch),
                pbar_desc=None)
            update_start = time.perf_counter()
            await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate, beta=0.0))
            seconds.append(time.perf_counter() - start)
            update_seconds.append(time.perf_counter() - update_start)
            rewards.append(sum(t.reward for g in groups for t in g.trajectories)
                           / sum(len(g.trajectories) for g in groups))
            print(f"{name} step {step}: {seconds[-1]:.1f} s (update {update_seconds[-1]:.1f} s), "
                  f"mean reward {rewards[-1]:.3f}", flush=True)
    finally:
        await backend.close()
    return {"step_seconds": seconds, "update_seconds": update_seconds, "rewards": rewards}


def summary(run: dict | None) -> dict | None:
    if run is None:
        return None
    return {"steps": len(run["rewards"]), "median_step_s": median_step(run["step_seconds"]),
            "total_s": round(sum(run["step_seconds"]), 1), "final_reward": final(run["rewards"]),
            "rewards": [round(r, 4) for r in run["rewards"]],
            "step_seconds": [round(s, 2) for s in run["step_seconds"]],
            # ours only: the model.train part of each step (the rest is rollouts)
            **({"median_update_s": median_step(run["update_seconds"])} if "update_seconds" in run else {})}


def plot(runs: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.5))
    for label, run in runs.items():
        if run and run["rewards"]:
            elapsed = [sum(run["step_seconds"][:i + 1]) for i in range(len(run["rewards"]))]
            by_step.plot(range(len(run["rewards"])), run["rewards"], marker="o", label=label)
            by_time.plot(elapsed, run["rewards"], marker="o", label=label)
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall-clock seconds (end of step)")
    for ax in (by_step, by_time):
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle("yes/no/maybe: TRL GRPOTrainer vs ours")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"reward curves: {out}")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="art-vs-trl-") as root:
        trl, trl_status = None, "skipped (--skip-trl)"
        if not args.skip_trl:
            try:
                import datasets as _  # noqa: F401  (only the imports are checked here)
                import trl as _  # noqa: F401,F811
            except ImportError as exc:
                trl_status = f"unavailable: {exc} (pip install -e '.[bench]')"
                print(trl_status, flush=True)
            else:
                trl, trl_status = run_trl(args, root), "ok"
        ours = await run_ours(args, root, "ours-same-settings", learning_rate=args.learning_rate,
                              max_tokens=args.max_tokens, temperature=args.temperature, steps=args.steps)
        # TRL's wall-clock for its steps at its steady pace (median x steps): its warm-up step can
        # take minutes on a busy machine, and counting that would hand the defaults run extra time.
        budget = median_step(trl["step_seconds"]) * len(trl["step_seconds"]) if trl else args.budget_s
        defaults = await run_ours(args, root, "ours-defaults", **DEFAULTS, temperature=None,
                                  steps=args.max_default_steps if budget else args.steps, budget_s=budget)

    s_trl, s_ours, s_def = summary(trl), summary(ours), summary(defaults)
    print()
    rows = [[label, s["steps"], s["median_step_s"], s["total_s"], s["final_reward"]]
            for label, s in [("trl (same settings)", s_trl), ("ours (same settings)", s_ours),
                             ("ours (defaults, TRL's wall-clock)", s_def)] if s]
    print(table(["run", "steps", "median s/step", "total s", "final reward"], rows))
    print()
    for label, s in [("trl", s_trl), ("ours", s_ours), ("ours defaults", s_def)]:
        if s:
            print(f"rewards {label}: " + " ".join(f"{r:.3f}" for r in s["rewards"]))
    if args.plot:
        plot({"trl": trl, "ours (same settings)": ours, "ours (defaults)": defaults},
             Path(__file__).resolve().parent / "vs_trl_rewards.png")

    step_ratio = ratio(s_ours["median_step_s"], s_trl["median_step_s"]) if s_trl else None
    report = {
        "benchmark": "vs_trl",
        "trl": s_trl, "ours_same_settings": s_ours, "ours_defaults_same_wallclock": s_def,
        "ratio_step_time": step_ratio,  # ours / trl: <= 0.33 is the goal
        "speedup": ratio(s_trl["median_step_s"], s_ours["median_step_s"]) if s_trl else None,
        "goals": {  # None where TRL was skipped
            "step_time_le_third_of_trl": step_ratio <= 1 / 3 if step_ratio is not None else None,
            "reward_not_below_trl": s_ours["final_reward"] >= s_trl["final_reward"] if s_trl else None,
            "defaults_reward_above_0_5_in_trl_wallclock": (s_def["final_reward"] or 0) > 0.5 if s_trl else None,
        },
        "settings": {
            "model": args.model, "device": args.device, "reward": args.reward, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size, "max_tokens": args.max_tokens, "learning_rate": args.learning_rate,
            "beta": 0.0, "temperature": args.temperature, "seed": args.seed,
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": LORA_TARGETS},
            "defaults_run": {**DEFAULTS, "budget_s": budget},
            "trl_config": f"{'bf16' if args.device.startswith('cuda') else 'use_cpu'}, lr_scheduler constant, activation (gradient) checkpointing off, shuffle_dataset off; "
                          "other GRPOConfig fields at TRL's defaults",
            "final_reward": f"mean of the last {FINAL_WINDOW} steps' rollout rewards",
            "step": "rollout + update; median skips the first step",
        },
    }
    report["trl_status"] = trl_status
    report["trl_version"] = installed_version("trl")
    report.update(environment())
    print(json.dumps(report))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps for trl and ours (first is warm-up)")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--max-tokens", type=int, default=48, help="max new tokens per completion")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-trl", action="store_true", help="run only our two loops")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock for the defaults run when TRL is skipped (else --steps steps)")
    parser.add_argument("--max-default-steps", type=int, default=200, help="cap on the defaults run's steps")
    parser.add_argument("--plot", action="store_true", help="write benchmarks/vs_trl_rewards.png")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where both systems run")
    parser.add_argument("--model", default=art.DEFAULT_MODEL, help="base model id or folder for both systems")
    parser.add_argument("--reward", default="yes_no_maybe", choices=sorted(REWARDS),
                        help="letter_e: for random-weight models (step times only)")
    asyncio.run(main(parser.parse_args()))
