"""Sampling tokens/s of our engine on a hybrid model (Gated DeltaNet + attention) against `generate`.

    python benchmarks/hybrid_engine.py [--layers 8] [--hidden 512] [--rounds 2] [--long 2048]

The model: a random Qwen3.5 (transformers' own modeling code): `--layers` layers, three Gated
DeltaNet layers to one full-attention layer as in Qwen3.5, hidden `--hidden`, SmolLM2's tokenizer,
float32 on the CPU; and, as the control, the same model with every layer full attention (a dense
Qwen3.5-shaped model, its weights drawn alike). Two loads, end of sequence disabled, temperature 1:
  grpo  4 chat prompts x n=8 x 64 tokens (the RL rollout shape)
  long  one prompt of `--long` tokens x n=4 x 32 tokens (where the linear layers should pay off:
        their decode step costs the same at any length; an attention layer's grows with it)
Systems, in this one process on the same weights: `ours` (`LLMEngine`, engine level, all requests
at once) and `hf` (`model.generate` on one left-padded batch, num_return_sequences=n).
Rounds alternate the systems; the best round counts. Memory per sequence: the cache one row holds
after a prompt of `--long` tokens (recurrent states, keys and values), read from the runner's cache.
Decode step: ms of one step of 8 rows through the runner after 64 and after `--long` tokens of
context (median of 16 steps): a Gated DeltaNet layer's step costs the same at both.
Prints a table, then one JSON line. Dated runs: benchmarks/results/*-hybrid_engine.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import environment, generate_tok_s, ratio, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support: SmolLM2's tokenizer

from art.engine.base import SamplingParams  # noqa: E402
from art.engine.llm_engine import LLMEngine  # noqa: E402
from tests.support import families  # noqa: E402

TOPICS = ["the water cycle", "how a bicycle stays upright", "photosynthesis", "the rules of chess"]


def build(folder: Path, args, hybrid: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = families.tokenizer()
    pattern = ["linear_attention"] * 3 + ["full_attention"] if hybrid else ["full_attention"]
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, layer_types=[pattern[i % len(pattern)] for i in range(args.layers)],
        num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model, tok


def loads(tok, args) -> dict[str, tuple[list[list[int]], int, int]]:
    """shape -> (prompts, n, max_tokens)."""
    chats = [tok.apply_chat_template([{"role": "user", "content": f"Explain {t}."}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False) for t in TOPICS]
    long = (list(range(1000, 1000 + args.long)),)
    return {"grpo": (chats, 8, 64), "long": (list(long), 4, 32)}


def ours(engine: LLMEngine, prompts, n: int, max_tokens: int) -> float:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=1)

    async def run():
        return await asyncio.gather(*[engine.generate(p, params, None) for p in prompts])

    start = time.perf_counter()
    results = asyncio.run(run())
    return sum(len(c.token_ids) for got in results for c in got) / (time.perf_counter() - start)


def row_bytes(engine: LLMEngine, length: int) -> int:
    """What one row's cache holds after a prompt of `length` tokens (every layer: states, keys, values)."""
    with engine.lock, torch.inference_mode():
        _, staged = engine.runner.prefill([list(range(1000, 1000 + length))], [(0, None)], ["__base__"])
    total = 0
    for part in staged.parts:
        tensors = [t for t in (part.keys, part.values, *part.conv.values(), *part.recurrent.values()) if t is not None]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def decode_ms(engine: LLMEngine, context: int, rows: int = 8, steps: int = 16) -> float:
    """Median ms of one decode step of `rows` rows after `context` tokens, through the engine's runner."""
    runner = engine.runner
    names = ["__base__"] * rows
    times = []
    with engine.lock, torch.inference_mode():
        _, staged = runner.prefill([list(range(1000, 1000 + context))], [(0, None)], names[:1])
        runner.add(staged, [0] * rows)
        runner.decode([5] * rows, [context] * rows, names)  # warm-up
        for k in range(steps):
            start = time.perf_counter()
            runner.decode([5] * rows, [context + 1 + k] * rows, names)
            times.append((time.perf_counter() - start) * 1000)
        runner.clear()
    return sorted(times)[steps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--long", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    best: dict[str, float] = {}
    memory: dict[str, int] = {}
    steps: dict[str, float] = {}
    params: dict[str, float] = {}
    for kind in ("hybrid", "dense"):
        model, tok = build(Path(tempfile.mkdtemp()), args, hybrid=kind == "hybrid")
        params[kind] = sum(p.numel() for p in model.parameters()) / 1e6
        engine = LLMEngine(model, tok, max_num_seqs=32, prefix_cache_tokens=0)
        ours(engine, [[1, 2, 3]], 1, 2)  # warm-up
        memory[kind] = row_bytes(engine, args.long)
        for context in (64, args.long):
            steps[f"{kind}/{context}"] = decode_ms(engine, context)
        for _ in range(args.rounds):
            for shape, (prompts, n, max_tokens) in loads(tok, args).items():
                for system in ("ours", "hf"):
                    if system == "ours":
                        tok_s = ours(engine, prompts, n, max_tokens)
                    else:
                        tok_s = generate_tok_s(model, tok.pad_token_id, prompts, n, max_tokens)
                    key = f"{kind}/{shape}/{system}"
                    best[key] = max(best.get(key, 0.0), tok_s)
        engine.stop()

    rows = [[kind, shape, best[f"{kind}/{shape}/ours"], best[f"{kind}/{shape}/hf"],
             ratio(best[f"{kind}/{shape}/ours"], best[f"{kind}/{shape}/hf"])]
            for kind in ("hybrid", "dense") for shape in ("grpo", "long")]
    print(f"Qwen3.5-shaped, {args.layers} layers, hidden {args.hidden}: hybrid (3 Gated DeltaNet : 1 attention) "
          f"{params['hybrid']:.0f}M parameters, dense control {params['dense']:.0f}M")
    print(table(["model", "shape", "ours tok/s", "hf tok/s", "x hf"], rows))
    print(f"cache per sequence after {args.long} tokens: hybrid {memory['hybrid'] / 2**20:.1f} MiB, "
          f"dense {memory['dense'] / 2**20:.1f} MiB ({ratio(memory['hybrid'], memory['dense'])}x)")
    growth = {kind: ratio(steps[f"{kind}/{args.long}"], steps[f"{kind}/64"]) for kind in ("hybrid", "dense")}
    for kind in ("hybrid", "dense"):
        print(f"decode step, 8 rows, {kind}: {steps[f'{kind}/64']:.1f} ms after 64 tokens, "
              f"{steps[f'{kind}/{args.long}']:.1f} ms after {args.long} ({growth[kind]}x)")
    print(json.dumps({
        "benchmark": "hybrid_engine",
        "settings": vars(args),
        "tok_s": {k: round(v, 1) for k, v in best.items()},
        "ratio_vs_hf": {k.removesuffix("/ours"): ratio(v, best[k.replace("/ours", "/hf")])
                        for k, v in best.items() if k.endswith("/ours")},
        "long_vs_grpo_tok_s": {kind: ratio(best[f"{kind}/long/ours"], best[f"{kind}/grpo/ours"])
                               for kind in ("hybrid", "dense")},
        "cache_bytes_per_sequence": memory,
        "decode_step_ms": {k: round(v, 2) for k, v in steps.items()},
        **environment(),
    }))


if __name__ == "__main__":
    main()
