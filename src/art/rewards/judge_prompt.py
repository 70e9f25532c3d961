"""The judge's prompt: a group's trajectories side by side, compact and readable.

The messages every trajectory starts with (system prompt, task) are shown once, in
`<context>`; each trajectory then shows only what follows. Messages are rendered as text,
`[role] content`, tool calls as `name({...})` and tool results under the tool's name; token ids
and logprobs are never sent. A trajectory longer than the budget keeps its head and its end
(where the outcome usually is) with the cut marked. A retry shows the judge its unusable answer
and what was wrong with it (`correction`).
"""

from __future__ import annotations

import json
from textwrap import dedent
from typing import Any

from art.rewards.judge_answer import JudgeAnswerError, listed

DEFAULT_RUBRIC = dedent(
    """
    - A trajectory that achieves its goal should always get a significantly higher score than a trajectory that does not achieve its goal.
    - A trajectory that achieves its goal more efficiently (eg. by avoiding unproductive detours) should get a higher score than a trajectory that achieves its goal less efficiently.
    - If one trajectory is only slightly better than another, the difference in scores should be small. If it is significantly better, the difference in scores should be large.
    - You may give some partial credit for a trajectory that makes progress towards its goal but does not complete it.
    """
)
"""ART's default rubric: the judge infers the task from the trajectories' own prompts."""

CHARS_PER_TOKEN = 4
"""Trajectory budgets are in tokens of a typical BPE tokenizer, estimated as 4 characters each
(the judge's tokenizer is not known here)."""


def common_prefix_length(message_lists: list[list[dict[str, Any]]]) -> int:
    """How many leading messages all the lists share."""
    shortest = min(len(m) for m in message_lists)
    for i in range(shortest):
        if any(m[i] != message_lists[0][i] for m in message_lists[1:]):
            return i
    return shortest


def render_message(message: dict[str, Any]) -> str:
    """One message as readable text: `[user] ...`, `[assistant] ...` with its tool calls,
    `[tool get_weather] ...`."""
    role = message.get("role", "?")
    content = _text(message.get("content"))
    if role == "tool":
        name = message.get("name") or message.get("tool_call_id") or ""
        return f"[tool {name}]".replace(" ]", "]") + f" {content}"
    lines = [f"[{role}] {content}".rstrip()]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        lines.append(f"[{role} calls] {function.get('name')}({function.get('arguments', '')})")
    return "\n".join(lines)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(p.get("text", f"<{p.get('type', 'part')}>") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content, ensure_ascii=False, default=str)


def truncate(text: str, max_tokens: int) -> str:
    """`text` cut to about `max_tokens`, keeping the first third and the last two thirds of
    the budget, with the cut marked."""
    budget = max_tokens * CHARS_PER_TOKEN
    if len(text) <= budget:
        return text
    head, tail = budget // 3, budget - budget // 3
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut to fit the judge's budget ...]\n{text[-tail:]}"


def judge_messages(
    message_lists: list[list[dict[str, Any]]], rubric: str, max_trajectory_tokens: int, tools: list[Any] | None = None
) -> list[dict[str, str]]:
    """The judge's system and user messages for one group (ids "1".."n" in order). `tools`, the
    tool definitions the agent was given, are shown once in `<available_tools>` (as ART shows
    them), so the judge can tell a valid call from an invented one."""
    shared = common_prefix_length(message_lists)
    identical = all(len(m) == shared for m in message_lists)
    if identical:  # nothing differs: show each whole (the judge still scores every id)
        shared = 0
    parts = []
    if shared:
        context = "\n".join(render_message(m) for m in message_lists[0][:shared])
        parts.append(f"<context>\n{truncate(context, max_trajectory_tokens)}\n</context>")
    if tools:
        tool_text = json.dumps(tools, ensure_ascii=False, default=str)
        parts.append(f"<available_tools>\n{truncate(tool_text, max_trajectory_tokens)}\n</available_tools>")
    for i, messages in enumerate(message_lists, start=1):
        body = "\n".join(render_message(m) for m in messages[shared:])
        parts.append(f'<trajectory id="{i}">\n{truncate(body, max_trajectory_tokens)}\n</trajectory>')
    system = (
        dedent(
            """
        All of the trajectories below have been given the same goal. Your job is to consider each of them and give them a score between 0 and 1. Take into consideration your best judgement of the agent's goal.

        Grading standards:
        {rubric}
        Answer with a JSON object {{"scores": [{{"trajectory_id": "1", "explanation": "...", "score": 0.5}}, ...]}} holding exactly {n} score objects, one for each trajectory ID ({ids}), in order.
        """
        )
        .strip()
        .format(rubric=rubric.strip(), n=len(message_lists), ids=_ids(len(message_lists)))
    )
    intro = "The messages shared by every trajectory are in <context>.\n\n" if shared else ""
    if tools:
        intro += "The tools the agent could call are in <available_tools>.\n\n"
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": intro + "Trajectories:\n\n" + "\n\n".join(parts)},
    ]


def correction(bad_answer: str, problem: JudgeAnswerError, n: int) -> list[dict[str, str]]:
    """What a retry adds to the judge's conversation: its unusable answer, then what was wrong
    with it (for a wrong set of ids: which are missing, repeated or unexpected) and what to send."""
    got = getattr(problem, "got", None)
    if got is not None:
        what = (
            f"Your previous answer had {got} score object{'' if got == 1 else 's'}, but there "
            f"{'is 1 trajectory' if n == 1 else f'are {n} trajectories'}.\n"
            f"Missing trajectory IDs: {listed(problem.missing or [])}\n"
            f"Duplicate trajectory IDs: {listed(problem.duplicate or [])}\n"
            f"Unexpected trajectory IDs: {listed(problem.unexpected or [])}"
        )
    else:
        what = f"Your previous answer could not be used: {problem}"
    return [
        {"role": "assistant", "content": bad_answer},
        {
            "role": "user",
            "content": f"{what}\n\nAnswer again with exactly {n} score object"
            f"{'' if n == 1 else 's'}, using each trajectory ID exactly once: {_ids(n)}.",
        },
    ]


def _ids(n: int) -> str:
    return ", ".join(str(i) for i in range(1, n + 1))
