"""The trainer's throughput on a GPU: tokens per second of a whole RL step (forward, backward, AdamW),
LoRA r16, on random-weight models built from real configs, against prime-rl's published figures.

    python benchmarks/trainer_gpu.py [--models smollm2,qwen3-0.6b,qwen2.5-1.5b,qwen3-4b]
                                     [--row-tokens 16384 2048] [--rows 2] [--steps 1] [--tiny]

Each step trains `--rows` packed rows of `--row-tokens` tokens (`packing="packed"`: whole
sequences of 2,048 tokens, a 512-token prompt and a 1,536-token completion, packed into rows,
one row per forward pass) through `Trainer.step`, the code `model.train` runs. Two layouts:
  packed/ROW   rows of --row-tokens tokens: several sequences per row under a [W, W] mask
  packed/2048  one sequence per row: no mask, SDPA's causal (flash) kernel
`trainer_tok_s` is tokens computed per second of the timed steps (after one warm-up step), the
measure prime-rl reports; peak memory is `torch.cuda.max_memory_allocated` over the model's steps.
Models above 1B train with gradient checkpointing. Each (model, layout) prints its JSON line as it
ends, smallest model first, so a run cut short keeps what it measured; an out-of-memory error is
a line of its own (that size does not fit) and the next goes on.

Anchor (prime-rl's trainer, one H100, LoRA r16, 16k packing): Qwen3-0.6B 13.3k tok/s, Qwen3-4B
6.0k tok/s at 23.9 GiB. `--tiny` (the smoke run, CPU): a 2-layer model, rows of 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import art  # noqa: E402  (after the path: tests.support below)
from art.training.options import TrainOptions  # noqa: E402
from art.training.trainer import Trainer  # noqa: E402
from tests.support.fakes import make_choice  # noqa: E402

QWEN_COMMON = {"vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6}
CONFIGS = {
    "qwen3-0.6b": ("qwen3", {**QWEN_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                             "max_position_embeddings": 40960}),
    "qwen2.5-1.5b": ("qwen2", {**QWEN_COMMON, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                               "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768}),
    "qwen3-4b": ("qwen3", {**QWEN_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                           "max_position_embeddings": 40960}),
    "tiny": ("llama", {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}),
}
"""The shapes of the published configs (the weights are random: throughput does not depend on them)."""
ANCHOR_TOK_S = {"qwen3-0.6b": 13_300, "qwen3-4b": 6_000}
"""prime-rl's trainer on one H100, LoRA r16, 16k packing."""
SEQUENCE_TOKENS = (512, 1536)
"""Prompt and completion of every sequence."""


def smollm2_config():
    """SmolLM2-135M's config: the GPU check's copy (.gpu_assets), else the bundled model's."""
    from transformers import AutoConfig

    assets = Path(__file__).parents[1] / ".gpu_assets" / "smollm2"
    return AutoConfig.from_pretrained(assets if assets.exists() else art.base_models.resolve(art.DEFAULT_MODEL))


def build(name: str, device: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "smollm2":
        config = smollm2_config()
    else:
        arch, values = CONFIGS[name]
        config = AutoConfig.for_model(arch, **values)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(base, lora)
    model.train()
    return model, config, sum(p.numel() for p in base.parameters())


def groups(vocab: int, total_tokens: int, prompt: int, completion: int, seed: int) -> list[art.TrajectoryGroup]:
    """Groups of 8 samples sharing a prompt, `total_tokens` in all, rewards that differ."""
    rng = random.Random(seed)
    out, tokens = [], 0
    while tokens < total_tokens:
        shared = [rng.randrange(10, vocab) for _ in range(prompt)]
        trajectories = []
        for member in range(8):
            ids = [rng.randrange(10, vocab) for _ in range(completion)]
            choice = make_choice(shared, ids, [-1.0] * completion)
            trajectories.append(art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, choice],
                                               reward=float(member % 3)))
            tokens += prompt + completion
        out.append(art.TrajectoryGroup(trajectories))
    return out


def measure(name: str, device: str, row_tokens: list[int], rows: int, steps: int, tiny: bool) -> list[dict]:
    model, config, parameters = build(name, device)
    trainer = Trainer(model, SimpleNamespace(pad_token_id=0))
    prompt, completion = (64, 64) if tiny else SEQUENCE_TOKENS
    checkpointing = parameters > 1e9
    lines = []
    for row in row_tokens:
        layout = f"packed/{row}"
        options = TrainOptions(learning_rate=1e-5, packing="packed", packed_row_tokens=row, micro_batch_tokens=row,
                               gradient_checkpointing=checkpointing)
        line = {"part": "trainer", "model": name, "parameters_m": round(parameters / 1e6), "layout": layout,
                "lora_rank": 16, "gradient_checkpointing": checkpointing, "device": device}
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            batch = groups(config.vocab_size, rows * max(row, prompt + completion), prompt, completion, seed=0)
            trainer.step(batch, options, quiet=True)  # warm-up: allocations, kernels chosen
            seconds, computed = 0.0, 0.0
            for step in range(steps):
                batch = groups(config.vocab_size, rows * max(row, prompt + completion), prompt, completion, seed=step + 1)
                if device == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                metrics = trainer.step(batch, options, quiet=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds += time.perf_counter() - began
                computed += metrics["tokens_computed"]
            line.update(trainer_tok_s=round(computed / seconds), step_seconds=round(seconds / steps, 2),
                        tokens_per_step=round(computed / steps))
            if device == "cuda":
                line["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if name in ANCHOR_TOK_S and row >= 16384:
                line["anchor_tok_s"] = ANCHOR_TOK_S[name]
                line["vs_anchor"] = round(line["trainer_tok_s"] / ANCHOR_TOK_S[name], 2)
        except torch.cuda.OutOfMemoryError as exc:
            line.update(fits=False, error=f"out of memory: {str(exc)[:200]}")
        lines.append(line)
        print(json.dumps(line), flush=True)
    del trainer, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen3-0.6b,qwen2.5-1.5b,qwen3-4b")
    parser.add_argument("--row-tokens", type=int, nargs="+", default=[16384, 2048])
    parser.add_argument("--rows", type=int, default=2, help="packed rows per step")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    parser.add_argument("--tiny", action="store_true", help="the smoke run: a 2-layer model, rows of 256 tokens")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = ["tiny"] if args.tiny else [m.strip() for m in args.models.split(",") if m.strip()]
    row_tokens = [256, 128] if args.tiny else args.row_tokens
    for name in models:
        measure(name, device, row_tokens, args.rows, args.steps, args.tiny)


if __name__ == "__main__":
    main()
