"""One MCP·RL episode: the policy works on a task with an MCP server's tools until it says it is done.

The server's tools are offered as OpenAI tools, plus `complete_task` (ART's MCP·RL convention:
the agent calls it with a summary when it has finished). Each turn is a chat completion through
`model.openai_client()`, recorded by automatic capture (`art.AutoTrajectoryContext`), so the
trajectory holds each turn's `Choice` as the server sent it, token ids included, and trains on
the sampler's exact ids. Each tool call runs on the server with `session.call_tool`; its result
(or the error) goes back as a `tool` message. The episode ends at `complete_task`, at a reply
without tool calls (a final answer, or a reply cut at `max_tokens`), or after `max_turns`
completions. The reward is left at 0:
RULER scores the group afterwards (`art.mcp.ruler_score_mcp_group`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from art.capture import AutoTrajectoryContext
from art.mcp.server_info import list_tools
from art.mcp.types import GeneratedScenario, MCPTool, field_of
from art.trajectories import Trajectory

log = logging.getLogger(__name__)

COMPLETE_TASK = "complete_task"
SUMMARY_MAX_CHARS = 1000
"""The summary's `maxLength`: unbounded, a small model's string can run on until its token
budget ends, and a call cut there is no call at all."""
COMPLETE_TASK_TOOL = {
    "type": "function",
    "function": {
        "name": COMPLETE_TASK,
        "description": "Finish the task: call this once, alone, with a summary of what you did and found.",
        "parameters": {
            "type": "object",
            "properties": {
                "summary": {"type": "string", "description": "What was done and found.", "maxLength": SUMMARY_MAX_CHARS}
            },
            "required": ["summary"],
            "additionalProperties": False,
        },
    },
}
DEFAULT_MAX_TURNS = 10
MAX_TOOL_RESULT_CHARS = 4000
"""A longer tool result is cut (and says so): one huge result would crowd out the context."""


def system_prompt(max_turns: int) -> str:
    """What the agent is told (ART's MCP·RL agent prompt, in our words)."""
    return (
        "You are an agent that works through the tools of an MCP (Model Context Protocol) server. "
        "Use them to complete the user's task. "
        f"You have at most {max_turns} turns. When the task is done, call '{COMPLETE_TASK}' by itself "
        "with a summary of what you did and found."
    )


@dataclass
class McpScenario:
    """A task for `mcp_rollout` (ART's notebook name); a `GeneratedScenario` or a string works too."""

    task_description: str
    max_turns: int = DEFAULT_MAX_TURNS
    metadata: dict[str, Any] = field(default_factory=dict)


async def mcp_rollout(
    model: Any,
    session: Any,
    scenario: McpScenario | GeneratedScenario | str,
    *,
    tools: list[MCPTool] | None = None,
    max_turns: int | None = None,
    system: str | None = None,
    first_tool_choice: str | dict[str, Any] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    max_tokens: int | None = 512,
    completion_params: dict[str, Any] | None = None,
    max_tool_result_chars: int = MAX_TOOL_RESULT_CHARS,
) -> Trajectory:
    """Run `model` (a registered `art.Model`) on `scenario` with the tools of `session` (an
    initialized `mcp.ClientSession`, shared by concurrent rollouts).

    - `tools`: the server's tools, listed once by the caller (`list_tools(session)`); listed
      here when None.
    - `max_turns`: completions at most (default: the scenario's, else 10).
    - `first_tool_choice`, `tool_choice`: the first turn's and later turns' `tool_choice`
      ("auto", "required", or `{"type": "function", "function": {"name": ...}}`); None sends
      none. A small model that never calls tools learns nothing until one turn is forced.
    - `completion_params`: more request fields (temperature, seed, ...).

    The trajectory's metrics: `task_completed`, `final_answer` (a reply without tool calls),
    `cut_off` (a reply cut at `max_tokens`, which ends the episode too), `ran_out_of_turns`,
    `turns`, `tool_calls`, `tool_errors`; its metadata has the task (and a generated one's
    difficulty).
    """
    task, turns_allowed, metadata = _task(scenario, max_turns)
    if tools is None:
        tools = await list_tools(session)
    offered = [tool.to_openai() for tool in tools if tool.name != COMPLETE_TASK] + [COMPLETE_TASK_TOOL]
    server_tools = {tool.name for tool in tools}
    client = model.openai_client()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system or system_prompt(turns_allowed)},
        {"role": "user", "content": f"Please complete this task: {task}"},
    ]
    counts = {"turns": 0, "tool_calls": 0, "tool_errors": 0}
    completed = answered = cut_off = False
    with AutoTrajectoryContext() as trajectory:
        for turn in range(turns_allowed):
            request: dict[str, Any] = {
                "model": model.get_inference_name(),
                "messages": messages,
                "tools": offered,
                **(completion_params or {}),
            }
            choice_of_tool = first_tool_choice if turn == 0 and first_tool_choice is not None else tool_choice
            if choice_of_tool is not None:
                request["tool_choice"] = choice_of_tool
            if max_tokens is not None:
                request["max_tokens"] = max_tokens
            completion = await client.chat.completions.create(**request)
            counts["turns"] += 1
            message = completion.choices[0].message
            messages = [*messages, _assistant_message(message)]
            if not message.tool_calls:
                cut_off = completion.choices[0].finish_reason == "length"
                answered = not cut_off
                break
            for call in message.tool_calls:
                counts["tool_calls"] += 1
                if call.function.name == COMPLETE_TASK:
                    completed = True
                    result, failed = "Task marked complete.", False
                else:
                    result, failed = await _run_tool(
                        session, call.function.name, call.function.arguments, server_tools, max_tool_result_chars
                    )
                counts["tool_errors"] += failed
                messages = [*messages, {"role": "tool", "tool_call_id": call.id, "content": result}]
            if completed:
                break
    trajectory.metadata = {**trajectory.metadata, **metadata, "task": task}
    trajectory.metrics = {
        **trajectory.metrics,
        "task_completed": float(completed),
        "final_answer": float(answered),
        "cut_off": float(cut_off),
        "ran_out_of_turns": float(not (completed or answered or cut_off)),
        **{key: float(value) for key, value in counts.items()},
    }
    if trajectory.additional_histories:  # never expected: each request extends the last
        log.warning("mcp_rollout: a turn did not extend the conversation; RULER cannot judge this trajectory")
    return trajectory


def _task(scenario: Any, max_turns: int | None) -> tuple[str, int, dict[str, Any]]:
    if isinstance(scenario, McpScenario):
        return scenario.task_description, max_turns or scenario.max_turns, dict(scenario.metadata)
    if isinstance(scenario, GeneratedScenario):
        return scenario.task, max_turns or DEFAULT_MAX_TURNS, {"difficulty": scenario.difficulty}
    if isinstance(scenario, str) and scenario.strip():
        return scenario, max_turns or DEFAULT_MAX_TURNS, {}
    raise TypeError(f"scenario must be an McpScenario, a GeneratedScenario or a task string, got {scenario!r}")


def _assistant_message(message: Any) -> dict[str, Any]:
    """The reply as the next request's history: what the capture recognises as that turn's Choice."""
    written: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        written["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    return written


async def _run_tool(session: Any, name: str, arguments: str, known: set[str], limit: int) -> tuple[str, bool]:
    """(the text the agent sees, whether it is an error). Never raises: a bad call is the
    agent's mistake to learn from, not the rollout's failure."""
    if name not in known:
        return f"Error: there is no tool named {name!r}; the tools are {sorted(known | {COMPLETE_TASK})}.", True
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError as exc:
        return f"Error: the arguments are not valid JSON ({exc}).", True
    if not isinstance(parsed, dict):
        return "Error: the arguments must be a JSON object.", True
    try:
        result = await session.call_tool(name, parsed)
    except Exception as exc:  # the server refused or failed: the agent sees why
        return f"Error: {type(exc).__name__}: {exc}", True
    failed = bool(field_of(result, "is_error", "isError"))
    text = _content_text(result)
    if len(text) > limit:
        text = text[:limit] + f"\n[... {len(text) - limit} more characters cut]"
    return (f"Error: {text}" if failed else text), failed


def _content_text(result: Any) -> str:
    """A tool result's content as text: text parts as they are, other parts described."""
    parts = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", None)
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource":
            resource = getattr(item, "resource", None)
            parts.append(getattr(resource, "text", None) or f"[resource {getattr(resource, 'uri', '')}]")
        else:
            mime = field_of(item, "mime_type", "mimeType", default="")
            parts.append(f"[{kind or type(item).__name__} {mime}]".replace(" ]", "]"))
    if not parts:
        structured = field_of(result, "structured_content", "structuredContent")
        if structured is not None:
            return json.dumps(structured)
    return "\n".join(parts)
