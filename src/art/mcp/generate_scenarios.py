"""Tasks for an MCP agent to practise on, written by a model from the server's tools and resources
(ART's `generate_scenarios`, with its signature).

The generator is any OpenAI-compatible chat endpoint, reached with the official `openai` client
(no LiteLLM): OpenAI itself (`OPENAI_API_KEY`), any `generator_base_url`, OpenRouter for an
`openrouter/...` model (`OPENROUTER_API_KEY`), or a registered `art.Model` given as `generator=`
(our own server: the policy can write its own tasks). The answer is asked for as a JSON schema
(`response_format`) of exactly `num_scenarios` items, so a server with constrained decoding (ours,
vLLM, OpenAI) always returns parseable scenarios, even from a tiny random model; an endpoint that
refuses the schema is asked for a JSON object instead. Each item is validated; invalid or repeated
ones are dropped and the missing number asked for again, up to `max_attempts` calls, then
`ScenarioGenerationError` says what came back.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from openai import AsyncOpenAI, BadRequestError, OpenAIError

from art.capture import no_capture
from art.errors import ArtValueError
from art.mcp.types import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPResource,
    MCPTool,
)
from art.utils.json_in_text import json_in_text

log = logging.getLogger(__name__)

DEFAULT_GENERATOR_MODEL = "openai/gpt-4.1-mini"
"""ART's default generator (LiteLLM's name; the `openai/` prefix is dropped here)."""
OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
MAX_TASK_CHARS = 600
"""A task longer than this is cut by the schema (`maxLength`): without a bound, a weak model's
string can run on until its token budget ends and the JSON never closes."""


class ScenarioGenerationError(ArtValueError):
    """The generator did not produce the scenarios asked for."""


async def generate_scenarios(
    tools: list[MCPTool] | list[dict[str, Any]],
    resources: list[MCPResource] | list[dict[str, Any]] | None = None,
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str = "",
    *,
    generator: Any = None,
    max_attempts: int = 3,
    max_task_chars: int | None = MAX_TASK_CHARS,
    max_tokens: int | None = None,
    extra_params: dict[str, Any] | None = None,
) -> GeneratedScenarioCollection:
    """Ask `generator_model` for `num_scenarios` tasks that the given tools can accomplish.

    - `tools`, `resources`: `MCPTool`/`MCPResource`, their dicts, or the MCP SDK's own objects
      (`list_tools_and_resources(session)` reads them from a server).
    - `generator`: an `AsyncOpenAI` client or a registered `art.Model` to ask instead of a URL
      (with an `art.Model`, `generator_model` defaults to its inference name).
    - `max_attempts`: calls in all; each asks for the scenarios still missing.
    - `max_task_chars`: the schema's `maxLength` for a task (None: unbounded).
    - `max_tokens`: the completion budget per call (None: the server's default).
    - `extra_params`: more request fields, e.g. `{"temperature": 1.0, "seed": 0}`.
    """
    if num_scenarios < 1:
        raise ArtValueError(f"num_scenarios must be at least 1, got {num_scenarios}", "num_scenarios")
    if max_attempts < 1:
        raise ArtValueError(f"max_attempts must be at least 1, got {max_attempts}", "max_attempts")
    tools_info = [_as_tool(t).to_dict() for t in tools or []]
    resources_info = [_as_resource(r).to_dict() for r in resources or []]
    if not tools_info and not resources_info:
        raise ArtValueError("generate_scenarios needs at least one tool or resource", "tools")
    client, model, owned = _generator(generator, generator_model, generator_api_key, generator_base_url)
    started = time.perf_counter()
    scenarios: list[GeneratedScenario] = []
    problems: list[str] = []
    formats = ["json_schema", "json_object"]
    try:
        with no_capture():  # writing tasks is not part of any trajectory being recorded
            for attempt in range(max_attempts):
                wanted = num_scenarios - len(scenarios)
                request = {
                    "model": model,
                    **(extra_params or {}),
                    "messages": [
                        {
                            "role": "user",
                            "content": _prompt(tools_info, resources_info, wanted, custom_instructions, scenarios),
                        }
                    ],
                }
                if max_tokens is not None:
                    request["max_tokens"] = max_tokens
                content = await _ask(client, request, formats, _schema(wanted, max_task_chars))
                found, dropped = _parse(content, {s.task.strip().lower() for s in scenarios})
                problems += [f"call {attempt + 1}: {p}" for p in dropped]
                scenarios += found[:wanted]
                log.info(
                    "generate_scenarios: call %d gave %d usable scenario(s) of %d asked",
                    attempt + 1,
                    len(found),
                    wanted,
                )
                if len(scenarios) == num_scenarios:
                    break
    finally:
        if owned:
            await client.close()
    if len(scenarios) < num_scenarios:
        shown = "; ".join(problems[-5:]) or "no reason recorded"
        raise ScenarioGenerationError(
            f"{model} gave {len(scenarios)} usable scenario(s) of {num_scenarios} in {max_attempts} call(s); "
            f"last problems: {shown}",
            "num_scenarios",
        )
    collection = GeneratedScenarioCollection(scenarios)
    if show_preview:
        print(f"Generated {len(collection)} scenarios with {model} in {time.perf_counter() - started:.1f} s")
        collection.print_difficulty_distribution()
        collection.preview(n=min(5, num_scenarios))
    return collection


def _as_tool(tool: Any) -> MCPTool:
    if isinstance(tool, MCPTool):
        return tool
    if isinstance(tool, dict) and "function" in tool:  # an OpenAI tools entry
        return MCPTool.from_dict(tool["function"])
    if isinstance(tool, dict) and "parameters" in tool:
        return MCPTool.from_dict(tool)
    return MCPTool.from_mcp(tool)


def _as_resource(resource: Any) -> MCPResource:
    if isinstance(resource, MCPResource):
        return resource
    return MCPResource.from_dict(resource) if isinstance(resource, dict) else MCPResource.from_mcp(resource)


def _generator(generator: Any, model: str, api_key: str | None, base_url: str) -> tuple[AsyncOpenAI, str, bool]:
    """(client, model name as sent, whether the client was made here and must be closed)."""
    if generator is not None:
        if isinstance(generator, AsyncOpenAI):
            return generator, model.removeprefix("openai/"), False
        if hasattr(generator, "openai_client"):  # a registered art.Model
            name = generator.get_inference_name() if model == DEFAULT_GENERATOR_MODEL else model
            return generator.openai_client(), name, False
        raise ArtValueError(
            f"generator must be an AsyncOpenAI client or a registered art.Model, got {type(generator).__name__}",
            "generator",
        )
    if model.startswith("openrouter/") and not base_url:
        base_url, model = OPENROUTER_BASE_URL, model.removeprefix("openrouter/")
        api_key = api_key or os.environ.get("OPENROUTER_API_KEY")
    model = model.removeprefix("openai/")
    key = api_key or os.environ.get("OPENAI_API_KEY") or (None if not base_url else "none")
    try:
        return AsyncOpenAI(base_url=base_url or None, api_key=key), model, True
    except OpenAIError as exc:
        raise ArtValueError(
            "no scenario generator: set OPENAI_API_KEY (or OPENROUTER_API_KEY for an openrouter/ "
            "model), or pass generator_api_key, generator_base_url or generator= (an AsyncOpenAI "
            "client or a registered art.Model)",
            "generator_api_key",
        ) from exc


def _schema(n: int, max_task_chars: int | None) -> dict[str, Any]:
    task: dict[str, Any] = {"type": "string", "minLength": 1}
    if max_task_chars is not None:
        task["maxLength"] = max_task_chars
    item = {
        "type": "object",
        "additionalProperties": False,
        "required": ["task", "difficulty"],
        "properties": {
            "task": task,
            "difficulty": {"type": "integer", "minimum": MIN_DIFFICULTY, "maximum": MAX_DIFFICULTY},
        },
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["scenarios"],
        "properties": {"scenarios": {"type": "array", "items": item, "minItems": n, "maxItems": n}},
    }


def _prompt(
    tools: list[dict], resources: list[dict], n: int, custom_instructions: str | None, already: list[GeneratedScenario]
) -> str:
    lines = [
        "You write practice tasks for an AI agent that works through an MCP (Model Context Protocol) server.",
        f"Write {n} different, realistic tasks that a user could ask the agent to do with the tools and "
        "resources below.",
        "",
        "TOOLS:",
        json.dumps(tools, indent=2),
        "",
        "RESOURCES:",
        json.dumps(resources, indent=2) if resources else "none",
        "",
        "Rules:",
        "- Each task can be done with these tools; do not name the tools to use, describe what the user wants.",
        "- Mix simple tasks (one or two tool calls) with harder ones that chain several calls.",
        "- Each task asks the agent to finish with a short summary of what it did and found.",
        f"- Rate each task's difficulty from {MIN_DIFFICULTY} (one tool call) to {MAX_DIFFICULTY} "
        "(many steps and analysis).",
        "",
        f'Answer with a JSON object {{"scenarios": [...]}} holding exactly {n} objects, each with "task" '
        '(a string) and "difficulty" (an integer).',
    ]
    if already:
        lines += ["", "These tasks exist already; write different ones:"] + [f"- {s.task}" for s in already]
    if custom_instructions:
        lines += ["", "Follow these instructions as well:", custom_instructions]
    return "\n".join(lines)


async def _ask(client: AsyncOpenAI, request: dict[str, Any], formats: list[str], schema: dict[str, Any]) -> str:
    """The answer's text, asking for the most structured format the endpoint accepts (a refused
    format is dropped from `formats` for the calls after this one)."""
    while True:
        fmt = formats[0] if formats else None
        if fmt == "json_schema":
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "scenario_list", "schema": schema},
            }
        elif fmt == "json_object":
            request["response_format"] = {"type": "json_object"}
        else:
            request.pop("response_format", None)
        try:
            response = await client.chat.completions.create(**request)
        except BadRequestError as exc:
            if fmt is not None and _about_format(exc):
                log.info(
                    "generate_scenarios: the endpoint refused response_format %s; asking for %s",
                    fmt,
                    formats[1] if len(formats) > 1 else "plain text",
                )
                formats.pop(0)
                continue
            raise
        if not response.choices:
            return ""
        choice = response.choices[0]
        if choice.finish_reason == "length":
            log.warning(
                "generate_scenarios: the answer was cut at the token limit; raise max_tokens if no scenarios parse"
            )
        return choice.message.content or ""


def _about_format(exc: BadRequestError) -> bool:
    text = f"{getattr(exc, 'param', '') or ''} {exc.message}".lower()
    return any(word in text for word in ("response_format", "json_schema", "json_object", "schema"))


def _parse(content: str, seen: set[str]) -> tuple[list[GeneratedScenario], list[str]]:
    """(valid new scenarios, why others were dropped) from an answer's text."""
    data = json_in_text(content)
    if data is None:
        shown = content[:200] + ("..." if len(content) > 200 else "")
        return [], [f"the answer is not JSON: {shown!r}"]
    items = data.get("scenarios") if isinstance(data, dict) else data
    if not isinstance(items, list):
        return [], [f"the answer has no 'scenarios' list: {str(data)[:200]!r}"]
    found, dropped = [], []
    for i, item in enumerate(items):
        try:
            task: Any = (item or {}).get("task")  # GeneratedScenario checks it and names what is wrong
            scenario = GeneratedScenario(task=task, difficulty=_difficulty((item or {}).get("difficulty")))
        except (ArtValueError, AttributeError) as exc:
            dropped.append(f"item {i}: {exc}")
            continue
        key = scenario.task.strip().lower()
        if key in seen:
            dropped.append(f"item {i}: repeats an earlier task")
            continue
        seen.add(key)
        found.append(GeneratedScenario(task=scenario.task.strip(), difficulty=scenario.difficulty))
    return found, dropped


def _difficulty(value: Any) -> Any:
    """An integer as a model may write it ("3", 3.0); anything else as it came, for the error."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value
