"""How well a RULER judge ranks yes/no/maybe groups: Spearman against the task's true reward.

    python benchmarks/ruler_agreement.py [--groups 100] [--group-size 4]
        [--judge-base-url URL --judge-model NAME [--judge-api-key KEY]]

The default model answers `groups` yes/no/maybe prompts `group-size` times (temperature 1);
each reply gets the task's score (examples/yes_no_maybe.py). Each group is then judged by
  local    the same base model served by LocalBackend, constrained to RULER's JSON schema
  local-free  the same judge without response_format (how often does it fail to answer?)
  external  any OpenAI-compatible judge given with --judge-base-url (skipped otherwise)
  random    the baseline: uniformly random scores (seeded)
with the example's rubric (examples/ruler_yes_no_maybe.py), which states the task's order. For
each judge: the mean within-group Spearman correlation (groups whose true rewards all tie are
left out), the pooled Spearman over all replies, pairwise agreement (of the pairs whose true
rewards differ, the share the judge orders the same way; ties count half), and judge errors.
Prints a table and one JSON line.

Every judge call runs at temperature 0 with one retry. Dated runs: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from _common import environment, table

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

from ruler_yes_no_maybe import RUBRIC  # noqa: E402
from yes_no_maybe import make_prompts, score  # noqa: E402

import art  # noqa: E402
from art.rewards import RulerStats, ruler  # noqa: E402

MAX_TOKENS = 1024
"""Judge answer tokens at most: room for four explanations of 200 characters (the schema's
bound); a free-text judge that loops stops here (and fails to parse)."""


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Pearson correlation of the ranks; None when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / (va * vb) ** 0.5


def pairwise(true: list[float], judged: list[float]) -> tuple[float, int]:
    agree, pairs = 0.0, 0
    for i in range(len(true)):
        for j in range(i + 1, len(true)):
            if true[i] == true[j]:
                continue
            pairs += 1
            same = (true[i] - true[j]) * (judged[i] - judged[j])
            agree += 1.0 if same > 0 else 0.5 if same == 0 else 0.0
    return agree, pairs


def summary(name: str, groups: list[list[float]], scored: list[list[float] | None], stats: RulerStats) -> dict:
    within = [spearman(t, s) for t, s in zip(groups, scored) if s is not None]
    within = [r for r in within if r is not None]
    pooled_true = [x for t, s in zip(groups, scored) if s is not None for x in t]
    pooled_judge = [x for s in scored if s is not None for x in s]
    agree = pairs = 0.0
    for t, s in zip(groups, scored):
        if s is not None:
            a, p = pairwise(t, s)
            agree, pairs = agree + a, pairs + p
    return {"judge": name, "groups_scored": sum(s is not None for s in scored),
            "spearman_within": round(sum(within) / len(within), 3) if within else None,
            "spearman_pooled": round(spearman(pooled_true, pooled_judge) or 0.0, 3) if pooled_true else None,
            "pairwise_agreement": round(agree / pairs, 3) if pairs else None,
            "judge_calls": stats.judge_calls, "judge_errors": stats.judge_errors}


async def judge_all(lists, judge, judge_model, *, structured, api_key=None) -> tuple[list, RulerStats]:
    stats = RulerStats()
    started = time.monotonic()

    async def one(messages):
        try:
            found = await ruler(messages, judge_model, rubric=RUBRIC, judge=judge, judge_api_key=api_key,
                                cache=False, structured=structured, stats=stats, max_retries=1,
                                extra_params={"temperature": 0.0, "max_tokens": MAX_TOKENS})
            return [s.score for s in found]
        except art.ArtError:
            return None

    scored = await asyncio.gather(*(one(m) for m in lists))
    print(f"judged {len(lists)} groups in {time.monotonic() - started:.0f} s: {stats.judge_calls} calls, "
          f"{stats.judge_errors} errors", flush=True)
    return scored, stats


async def main(args) -> dict:
    root = tempfile.mkdtemp(prefix="ruler-agreement-")
    backend = art.LocalBackend(path=root)
    model = art.TrainableModel(name="policy", project="agreement", base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    client = model.openai_client()
    rng = random.Random(args.seed)
    prompts = [rng.choice(make_prompts()) for _ in range(args.groups)]

    async def replies(prompt: str, seed: int) -> list[list[dict]]:
        ask = [{"role": "user", "content": prompt}]
        done = await client.chat.completions.create(model=model.base_model, messages=ask, n=args.group_size,
                                                    max_tokens=12, temperature=1.0, seed=seed)
        return [[*ask, {"role": "assistant", "content": c.message.content or ""}] for c in done.choices]

    lists = await asyncio.gather(*(replies(p, 1000 + i) for i, p in enumerate(prompts)))
    true = [[score(m[-1]["content"]) for m in group] for group in lists]
    results = []
    local, stats = await judge_all(lists, model, model.base_model, structured=True)
    results.append(summary("local (schema)", true, local, stats))
    free, stats = await judge_all(lists, model, model.base_model, structured=False)
    results.append(summary("local (free text)", true, free, stats))
    if args.judge_base_url:
        external, stats = await judge_all(lists, args.judge_base_url, args.judge_model, structured=None,
                                          api_key=args.judge_api_key)
        results.append(summary(f"external {args.judge_model}", true, external, stats))
    coin = random.Random(args.seed + 1)
    results.append(summary("random", true, [[coin.random() for _ in g] for g in true], RulerStats()))
    await backend.close()
    columns = ["judge_errors", "groups_scored", "spearman_within", "spearman_pooled", "pairwise_agreement"]
    print(table(["judge", *columns], [[r["judge"], *[r[c] for c in columns]] for r in results]))
    ties = sum(len(set(t)) == 1 for t in true)
    out = {"benchmark": "ruler_agreement", "groups": args.groups, "group_size": args.group_size,
           "groups_all_tied": ties, "mean_true_reward": round(sum(map(sum, true)) / sum(map(len, true)), 3),
           "judges": results, **environment()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge-base-url", default=None)
    parser.add_argument("--judge-model", default="openai/o4-mini")
    parser.add_argument("--judge-api-key", default=None)
    asyncio.run(main(parser.parse_args()))
