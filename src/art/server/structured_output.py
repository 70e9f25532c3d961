"""OpenAI's `response_format` and forced tool calls, as grammars for the engine.

- `{"type": "json_object"}`: any JSON object.
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: JSON that the schema
  accepts (every schema is enforced, `strict` or not).
- `tool_choice="required"` (or a named function) with tools: a Hermes `<tool_call>` block, a
  JSON object `{"name", "arguments"}` whose arguments follow that function's `parameters`,
  which `art.server.openai_format` then parses into `message.tool_calls`. One call, unless the
  request sets `parallel_tool_calls: true` (then one or more): left free, a small model keeps
  calling.

- vLLM's extensions (`extra_body`): `guided_json` / `guided_regex` / `guided_choice` /
  `guided_grammar`, or the newer `structured_outputs: {"json" | "regex" | "choice" | "grammar":
  ...}`: JSON that a schema accepts, text a regular expression matches, exactly one of the
  strings, or a grammar in llguidance's Lark syntax.

JSON is generated compact (no optional whitespace): a free choice of whitespace lets a small
model pad forever. Grammars are llguidance's (`art.engine.grammar` applies them).
"""

from __future__ import annotations

import json
from typing import Any

from art.chat_template import CLOSE, OPEN

COMPACT = {"whitespace_flexible": False}
"""llguidance's JSON options: no optional whitespace between tokens of the JSON."""
AS_WRITTEN_BACK = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""A forced tool call's JSON spaced exactly as `art.chat_template.call_block` writes it back into
the next turn's prompt (json.dumps' separators), so that prompt extends the sampled ids and a
multi-turn trajectory trains as one sequence."""


def grammar_for(
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None = None,
    vllm_constraint: tuple[str, Any] | None = None,
) -> str | None:
    """The grammar a request's completions must follow, or None for free text.
    `vllm_constraint`: (kind, value) of a vLLM extension, kind json, regex, choice or grammar
    (the request allows it only alone)."""
    if vllm_constraint is not None:
        return _vllm_grammar(*vllm_constraint)
    forced = _forced_tools(tools, tool_choice)
    requested = response_format or {}
    kind = requested.get("type", "text")
    if forced:  # the completion is the call; a response_format shapes text answers, as OpenAI reads it
        return _tool_call_grammar(forced, several=parallel_tool_calls is True)  # (the Agents SDK sends both)
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        return _json_grammar(requested["json_schema"].get("schema") or {"type": "object"})
    return None


def _vllm_grammar(kind: str, value: Any) -> str:
    if kind == "json":
        return _json_grammar(value)
    if kind == "regex":
        from llguidance import LLMatcher  # its own escaping of the expression into Lark

        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
    else:
        lark = value
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


def _json_grammar(schema: dict[str, Any]) -> str:
    return json.dumps({"grammars": [{"json_schema": {**schema, "x-guidance": COMPACT}}]})


def _forced_tools(tools, tool_choice) -> list[dict[str, Any]]:
    """The functions a forced tool choice may call (empty when the model may answer in text)."""
    if not tools:
        return []
    functions = [t["function"] for t in tools]
    if tool_choice == "required":
        return functions
    if isinstance(tool_choice, dict):
        return [f for f in functions if f["name"] == tool_choice["function"]["name"]]
    return []


def _tool_call_grammar(functions: list[dict[str, Any]], several: bool) -> str:
    """Lark: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once or `several`."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    start = 'start: block ("\\n" block)*' if several else "start: block"
    lark = (
        f"{start}\n"
        f"block: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
        f"call: %json {json.dumps({**schema, 'x-guidance': AS_WRITTEN_BACK})}\n"
    )
    return json.dumps({"grammars": [{"lark_grammar": lark}]})
