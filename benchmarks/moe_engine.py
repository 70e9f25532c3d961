"""Sampling tokens/s of our engine on a mixture-of-experts model against transformers' `generate`.

    python benchmarks/moe_engine.py [--layers 8] [--hidden 512] [--experts 16] [--top-k 2]
                                    [--prompts 4] [--n 8] [--max-tokens 64] [--rounds 2]

The model: a random Qwen3-MoE (transformers' own modeling code) of the given size, SmolLM2's
tokenizer, float32 on the CPU. The load: the GRPO shape, `--prompts` chat prompts x n samples,
`--max-tokens` tokens each (end of sequence disabled), temperature 1.
Systems, in this one process, on the same weights:
  ours        `LLMEngine` (engine level, no HTTP) with a random LoRA on attention and on the
              routed experts (the default targets: peft `target_parameters`), served merged,
              as RL rollouts are; all requests submitted at once
  ours_base   the same engine, the base model (no adapter)
  hf          `model.generate` on one left-padded batch of prompts x n rows (the base model)
and each of them twice: with transformers' grouped experts (`experts_implementation="grouped_mm"`,
its default: the rows routed to each expert go through it in one matmul) and with its `eager`
experts (a Python loop over the experts hit). tokens/s = completion tokens / wall seconds.
Rounds alternate the systems so drift on a shared machine hits each alike; the best round
counts. Prints a table, then one JSON line (benchmark, settings, per system and experts
implementation tok_s, ratio_vs_hf, environment). Dated runs: benchmarks/results/*-moe_engine.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support: the tokenizer, the random LoRA

from art.base_models import load_policy  # noqa: E402
from art.engine.adapters import AdapterSet  # noqa: E402
from art.engine.base import AdapterRef, SamplingParams  # noqa: E402
from art.engine.llm_engine import LLMEngine  # noqa: E402
from art.training.options import LORA_DEFAULTS  # noqa: E402
from tests.support import families  # noqa: E402
from tests.support.fakes import randomize_lora  # noqa: E402

TOPICS = ["the water cycle", "how a bicycle stays upright", "photosynthesis", "the rules of chess",
          "why the sky is blue", "how vaccines work", "black holes", "how compilers work"]


def build(folder: Path, args) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = families.tokenizer()
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), head_dim=64, num_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]}."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(count)]


def ours(engine: LLMEngine, work: list[list[int]], args, adapter: AdapterRef | None) -> tuple[int, float]:
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1)

    async def run():
        return await asyncio.gather(*[engine.generate(p, params, adapter) for p in work])

    start = time.perf_counter()
    results = asyncio.run(run())
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for got in results for c in got), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    folder = build(Path(tempfile.mkdtemp(prefix="moe-bench-")), args)
    model, tokenizer = load_policy(str(folder), dict(LORA_DEFAULTS), dtype=torch.float32, device="cpu")
    randomize_lora(model, seed=3)
    assert any("experts" in n and "lora_A" in n for n, _ in model.named_parameters()), "no LoRA on the experts"
    engine = LLMEngine(model, tokenizer, adapters=AdapterSet(model), max_num_seqs=args.prompts * args.n)
    base = model.get_base_model()
    work = prompts(tokenizer, args.prompts)
    live = AdapterRef("bench", None, None)
    best: dict[tuple[str, str], float] = {}
    for implementation in ("grouped_mm", "eager"):
        base.set_experts_implementation(implementation)
        ours(engine, work[:1], argparse.Namespace(n=1, max_tokens=4), live)  # warm-up, merges the adapter
        for _ in range(args.rounds):
            for system in ("ours", "ours_base", "hf"):
                if system == "hf":
                    with engine.paused():  # the engine's merged copy is put back; generate runs on the base
                        tok_s = generate_tok_s(base, tokenizer.pad_token_id, work, args.n, args.max_tokens)
                else:
                    tokens, seconds = ours(engine, work, args, live if system == "ours" else None)
                    tok_s = tokens / seconds
                key = (system, implementation)
                best[key] = max(best.get(key, 0.0), tok_s)
    engine.stop()

    rows = [[system, implementation, best[(system, implementation)],
             ratio(best[(system, implementation)], best[("hf", implementation)])]
            for implementation in ("grouped_mm", "eager") for system in ("ours", "ours_base", "hf")]
    print(f"MoE: Qwen3-MoE, {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k}, "
          f"{sum(p.numel() for p in base.parameters()) / 1e6:.0f}M parameters; "
          f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens")
    print(table(["system", "experts", "tok/s", "x hf"], rows))
    print(json.dumps({
        "benchmark": "moe_engine",
        "settings": vars(args),
        "tok_s": {f"{system}/{impl}": round(best[(system, impl)], 1) for system, impl in best},
        "ratio_vs_hf": {f"{system}/{impl}": ratio(best[(system, impl)], best[("hf", impl)])
                        for system, impl in best if system != "hf"},
        **environment(),
    }))


if __name__ == "__main__":
    main()
