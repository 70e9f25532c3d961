"""Training sequences per tool-agent episode: re-rendered prompts today, extended sampled ids instead.

`art.training.sequences` trains an episode as one sequence only while each turn's prompt ids
extend the ids so far (the previous prompt plus its sampled completion). The server renders
every prompt from the messages with the chat template, so the previous assistant turn comes
back re-rendered from its parsed text (a tool call as `call_block`'s JSON) rather than as the
ids the model sampled; where the two differ, the episode breaks into two sequences.

This runs examples/tool_agent.py's own rollout (a forced `calculate` call, the tool's result,
a free answer; up to three turns) on the default model through the real server, then reports
per episode:
- how many sequences `sequences_of_trajectory` makes from the trajectory as sampled, and why
  each break happened (one decoded example: sampled ids vs re-rendered ids);
- how many it would make if each next prompt extended the sampled ids (`extend_sampled`: the
  previous prompt and completion verbatim, the turn's stop token when sampling did not reach
  it, then the template's own ids from after the re-rendered turn's stop on), and whether that
  prompt decodes to the same text as the template's. It is computed offline from the ids each
  turn was sampled from: a server that sent the extended prompt would sample later turns from
  the same text in other tokens, so their samples would differ, not their structure;
- with `renderers` importable (Prime Intellect's package; e.g. `pip install --no-deps --target
  /tmp/renderers_pkg renderers==0.1.12 prime-pydantic-config openai-harmony` and
  `PYTHONPATH=/tmp/renderers_pkg`), which renderer it picks for the default model, what its
  `bridge_to_next_turn` returns on these episodes, whether its prompt shows the tool and the
  earlier call, and whether it parses the sampled call.

Run:  python benchmarks/episode_sequences.py [--episodes 24] [--seed 0]
About a minute on the 2-core CPU (24 episodes: 25 s of rollouts). The last line of stdout is
the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import art
from art.base_models import resolve
from art.training.sequences import sequences_of_history, sequences_of_trajectory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, installed_version, table  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_agent.py"


def load_example():
    spec = importlib.util.spec_from_file_location("tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run_episodes(episodes: int, seed: int, path: str) -> list[art.Trajectory]:
    """The example's rollouts on the untrained default model (step 0), all concurrent."""
    example = load_example()
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name="episode-sequences", project="bench", base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    rng = random.Random(seed)
    try:
        return await art.gather_trajectories(
            (example.rollout(model, rng.randint(11, 99), rng.randint(11, 99), seed=rng.randrange(2**31))
             for _ in range(episodes)), pbar_desc=None)
    finally:
        await backend.close()


def choices_of(trajectory) -> list:
    return [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]


def extend_sampled(previous_prompt: list[int], previous_rendered: list[int], completion: list[int],
                   rendered: list[int], stop_ids: set[int]) -> list[int] | None:
    """The next prompt as an extension of the previous turn's sampled ids, or None.

    `rendered` is the next prompt as the template renders it, `previous_rendered` the previous
    one (the template's too) and `previous_prompt` the ids the previous turn was sampled from.
    `rendered` must start with `previous_rendered` (earlier turns render alike); the re-rendered
    previous assistant turn is then what follows, up to its first stop token, and all after
    that stop (the template's tail after a close, the tool result, the next generation prompt)
    is kept. The sampled completion takes the re-rendered turn's place, with the stop token
    appended when sampling ended without one (max_tokens, a stop string): context, not trained.
    """
    if rendered[:len(previous_rendered)] != previous_rendered:
        return None
    close = next((i for i in range(len(previous_rendered), len(rendered)) if rendered[i] in stop_ids), None)
    if close is None:
        return None
    sampled = list(completion)
    if not sampled or sampled[-1] not in stop_ids:
        sampled.append(rendered[close])
    return previous_prompt + sampled + rendered[close + 1:]


def extended_trajectory(trajectory, stop_ids: set[int]):
    """The trajectory as it would be had every prompt after the first been `extend_sampled`'s
    (chained: each extends the previous extended prompt). None when one cannot be built."""
    items, previous, previous_prompt = [], None, None
    for item in trajectory.messages_and_choices:
        if isinstance(item, dict):
            items.append(item)
            continue
        prompt = list(item.prompt_token_ids)
        if previous is not None:
            prompt = extend_sampled(previous_prompt, list(previous.prompt_token_ids), list(previous.token_ids),
                                    prompt, stop_ids)
            if prompt is None:
                return None
        items.append(SimpleNamespace(message=item.message, prompt_token_ids=prompt, token_ids=item.token_ids,
                                     logprobs=item.logprobs))
        previous, previous_prompt = item, prompt
    return SimpleNamespace(messages_and_choices=items, additional_histories=[])


def break_reason(tokenizer, previous, prompt: list[int], stop_ids: set[int]) -> tuple[str, str, str]:
    """(reason, sampled text, re-rendered text) of the previous assistant turn at a break."""
    before = list(previous.prompt_token_ids)
    if prompt[:len(before)] != before:
        return "earlier turns rendered differently", "", ""
    close = next((i for i in range(len(before), len(prompt)) if prompt[i] in stop_ids), len(prompt))
    rendered = prompt[len(before):close + 1]
    sampled = list(previous.token_ids)
    sampled_text, rendered_text = tokenizer.decode(sampled), tokenizer.decode(rendered)
    stopped = bool(sampled) and sampled[-1] in stop_ids
    if sampled_text == rendered_text:
        reason = "same text, other tokens"
    elif not stopped and tokenizer.decode(sampled + rendered[-1:]) == rendered_text:
        reason = "no stop sampled (cut at max_tokens), same text otherwise"
    elif not stopped:
        reason = "no stop sampled, and the text re-rendered differently"
    else:
        reason = "the text re-rendered differently"
    return reason, sampled_text, rendered_text


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each id decoded on its own: where two tokenisations of one text part ways."""
    return [tokenizer.decode([i]) for i in ids]


def renderers_verdict(tokenizer, trajectories) -> dict:
    """Which `renderers` renderer the default model gets, and its bridge on our episodes."""
    try:
        from renderers import create_renderer
    except ImportError as exc:
        return {"status": f"unavailable: {exc}"}
    renderer = create_renderer(tokenizer)
    bridged = Counter()
    for trajectory in trajectories:
        items = trajectory.messages_and_choices
        for k, item in enumerate(items):
            if isinstance(item, dict):
                continue
            new = list(itertools.takewhile(lambda later: isinstance(later, dict), items[k + 1:]))
            if new:
                out = renderer.bridge_to_next_turn(list(item.prompt_token_ids), list(item.token_ids), new)
                bridged["none" if out is None else "bridged"] += 1
    # the first episode's second prompt as `renderers` renders it, and its parse of the sampled call
    first = trajectories[0]
    call = choices_of(first)[0]
    prompt = tokenizer.decode(renderer.render_ids(first.messages(), tools=first.tools, add_generation_prompt=True))
    expression = json.loads(call.message.tool_calls[0].function.arguments)["expression"]
    return {"status": "ok", "version": installed_version("renderers"), "renderer": type(renderer).__name__,
            "is_prefix_stable": getattr(renderer, "is_prefix_stable", None), "bridge_to_next_turn": dict(bridged),
            "prompt_offers_the_tool": first.tools[0]["function"]["description"] in prompt,
            "prompt_keeps_the_call": expression in prompt,
            "parses_the_sampled_call": bool(renderer.parse_response(list(call.token_ids)).tool_calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve(art.DEFAULT_MODEL))
    stop_ids = {tokenizer.eos_token_id}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as path:
        trajectories = asyncio.run(run_episodes(args.episodes, args.seed, path))
    seconds = time.monotonic() - start

    rows, reasons, example, extended_counts = [], Counter(), None, []
    finish, same_text, tokens = Counter(), Counter(), Counter()
    for number, trajectory in enumerate(trajectories):
        choices = choices_of(trajectory)
        finish.update(c.finish_reason for c in choices)
        sequences = sequences_of_trajectory(trajectory, Counter())
        breaks = []
        sequences_of_history(trajectory.messages_and_choices, Counter(), breaks)
        why = []
        for brk in breaks:
            items = trajectory.messages_and_choices
            previous = next(item for item in reversed(items[:brk.choice]) if not isinstance(item, dict))
            reason, sampled, rendered = break_reason(tokenizer, previous, list(items[brk.choice].prompt_token_ids),
                                                     stop_ids)
            reasons[reason] += 1
            why.append(reason)
            if example is None:
                at = brk.position  # the ids so far end with the previous turn's prompt and completion
                sampled_ids = (list(previous.prompt_token_ids) + list(previous.token_ids))[at:at + 12]
                rendered_ids = list(items[brk.choice].prompt_token_ids)[at:at + 12]
                example = (number, brk, sampled, rendered, sampled_ids, rendered_ids)
        extended = extended_trajectory(trajectory, stop_ids)
        extended_sequences = None if extended is None else sequences_of_trajectory(extended, Counter())
        extended_count = None if extended_sequences is None else len(extended_sequences)
        tokens["as sampled"] += sum(len(s.token_ids) for s in sequences)
        tokens["extended"] += sum(len(s.token_ids) for s in extended_sequences or [])
        if extended is not None:  # does the model see the same text as from the template's prompt?
            for ours, theirs in zip(choices_of(extended)[1:], choices[1:]):
                same_text[tokenizer.decode(ours.prompt_token_ids) == tokenizer.decode(theirs.prompt_token_ids)] += 1
        extended_counts.append(extended_count)
        rows.append([number, len(choices), len(sequences), extended_count, "; ".join(why) or "-"])

    print(table(["episode", "turns", "sequences", "extended", "why it broke"], rows))
    if example is not None:
        number, brk, sampled, rendered, sampled_ids, rendered_ids = example
        print(f"\nepisode {number}, choice {brk.choice}: first difference at token {brk.position} "
              f"(the ids so far have {brk.expected}, the re-rendered prompt {brk.got})")
        print(f"  sampled     {sampled!r}\n  re-rendered {rendered!r}")
        print(f"  as tokens from the first difference on:\n  sampled     {pieces(tokenizer, sampled_ids)}\n"
              f"  re-rendered {pieces(tokenizer, rendered_ids)}")
    counts = [row[2] for row in rows]
    verdict = renderers_verdict(tokenizer, trajectories)
    print(f"\nrenderers: {verdict}")
    summary = {
        "benchmark": "episode_sequences", "model": art.DEFAULT_MODEL, "episodes": len(rows),
        "turns": sum(row[1] for row in rows), "finish_reasons": dict(finish),
        "sequences": sum(counts), "episodes_split": sum(c > 1 for c in counts),
        "share_split": round(sum(c > 1 for c in counts) / max(len(counts), 1), 3),
        "break_reasons": dict(reasons), "sequence_tokens": tokens["as sampled"],
        "extended_sequences": None if None in extended_counts else sum(extended_counts),
        "extended_sequence_tokens": tokens["extended"],
        "extended_episodes_split": sum(c is not None and c > 1 for c in extended_counts),
        "extension_failed": sum(c is None for c in extended_counts),
        "extended_prompts_same_text": same_text[True], "extended_prompts_other_text": same_text[False],
        "rollout_seconds": round(seconds, 1), "renderers": verdict, "environment": environment(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
