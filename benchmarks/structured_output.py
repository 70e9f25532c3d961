"""The cost of a JSON schema: engine tokens/s with and without one, batch 32, on the CPU.

    python benchmarks/structured_output.py [--rows 32] [--trajectories 3] [--repeats 4]

The default model judges a yes/no/maybe group (RULER's real prompt, `art.rewards`), `rows`
samples at temperature 1 in one batch:
  schema   under RULER's answer schema (`response_format` json_schema), so every completion is a
           valid answer and ends when the JSON does;
  free     the same prompt without a schema, each row forced (ignore_eos) to the length its
           constrained twin had, so both runs decode the same tokens in the same batch shapes.
Both go through `LLMEngine.generate` in the same process, `repeats` times with the same seeds
(identical work), in alternating order; the best of each and the median of the per-run ratios.
Prints tokens/s, the ratio schema / free (the goal is >= 0.9: the grammar costs at most 10%)
and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _common import environment, ratio, table

import art
from art.base_models import load
from art.engine.base import SamplingParams
from art.engine.llm_engine import LLMEngine
from art.rewards.judge_answer import answer_schema
from art.rewards.judge_prompt import DEFAULT_RUBRIC, judge_messages
from art.server.structured_output import grammar_for

REPLIES = ["maybe", "Yes.", "No, I don't think so.", "maybe?", "yes"]


def judge_prompt(tokenizer, trajectories: int) -> list[int]:
    ask = [{"role": "user", "content": "Respond with yes, no or maybe."}]
    lists = [[*ask, {"role": "assistant", "content": REPLIES[i % len(REPLIES)]}] for i in range(trajectories)]
    messages = judge_messages(lists, DEFAULT_RUBRIC, 2048)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


async def timed(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]):
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(prompt, p, None) for p in params))
    seconds = time.perf_counter() - start
    completions = [c for r in results for c in r]
    return completions, sum(len(c.token_ids) for c in completions) / seconds


async def main(rows: int, trajectories: int, repeats: int) -> dict:
    model, tokenizer = load(art.DEFAULT_MODEL)
    engine = LLMEngine(model, tokenizer, max_num_seqs=rows)
    prompt = judge_prompt(tokenizer, trajectories)
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": answer_schema(trajectories)}}, None, None)
    engine.grammars.check(grammar)
    schema_rates, free_rates = [], []
    valid = lengths = None
    for repeat in range(repeats):
        # The same seeds every repeat: identical work, so the runs differ only by machine noise;
        # the order alternates so neither side always runs on a warmer machine.
        async def schema_run():
            return await timed(engine, prompt, [
                SamplingParams(n=1, temperature=1.0, seed=i, max_tokens=1024, grammar=grammar) for i in range(rows)])

        async def free_run(lengths):
            return await timed(engine, prompt, [
                SamplingParams(n=1, temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                for i, n in enumerate(lengths)])

        if lengths is None:
            constrained, _ = await schema_run()  # warm-up; fixes the lengths the free run copies
            lengths = [len(c.token_ids) for c in constrained]
            valid = sum(_parses(c.text, trajectories) for c in constrained)
        if repeat % 2:
            _, free_rate = await free_run(lengths)
            _, schema_rate = await schema_run()
        else:
            _, schema_rate = await schema_run()
            _, free_rate = await free_run(lengths)
        schema_rates.append(schema_rate)
        free_rates.append(free_rate)
        print(f"run {repeat}: schema {schema_rate:.1f} tok/s, free {free_rate:.1f} tok/s "
              f"(ratio {schema_rate / free_rate:.2f}); {valid}/{rows} answers valid, mean length "
              f"{sum(lengths) / rows:.0f}", flush=True)
    best_schema, best_free = max(schema_rates), max(free_rates)
    ratios = sorted(s / f for s, f in zip(schema_rates, free_rates))
    engine.stop()
    print(table(["run", "tokens/s"], [["schema", best_schema], ["free", best_free]]))
    result = {"benchmark": "structured_output", "rows": rows, "trajectories": trajectories,
              "prompt_tokens": len(prompt), "mean_completion_tokens": round(sum(lengths) / rows, 1),
              "valid_answers": valid, "schema_tokens_per_s": round(best_schema, 1),
              "free_tokens_per_s": round(best_free, 1), "ratio_schema_vs_free": ratio(best_schema, best_free),
              "median_ratio_per_run": round(statistics.median(ratios), 2),
              **environment()}
    print(f"schema / free: {result['ratio_schema_vs_free']} (best of each), "
          f"{result['median_ratio_per_run']} (median of the runs' ratios)")
    print(json.dumps(result))
    return result


def _parses(text: str, n: int) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return [s["trajectory_id"] for s in data["scores"]] == [str(i) for i in range(1, n + 1)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--trajectories", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.rows, args.trajectories, args.repeats))
