"""Train on environments written for `verifiers` (Prime Intellect's library), unchanged, and move
rollouts between its `RolloutOutput` and our `Trajectory` (OpenPipe ART's `art.verifiers` names).

    group = await trajectory_group_with_verifiers_environment(env, model, [row] * 8,
                                                             sampling_args={"max_tokens": 64})
    await model.train([group])

The environment (its dataset rows, `env_response`, tools and rubric) runs as written; its
rubric's reward becomes the trajectory's reward and the rubric's metrics its metrics.

Why not just convert messages: a verifiers rollout keeps each assistant turn as parsed text, and
our trainer trains only `Choice`s that carry the sampler's token ids (`art.training.sequences`);
re-tokenised text is not what was sampled. So the environment runs inside one automatic capture
(`art.AutoTrajectoryContext`), which records every chat completion its client sends, whole, with
the server's Choice. Each verifiers trajectory step keeps the `Response` its call returned, and
that response's `id` is the completion's id: the step's assistant turn becomes the captured
Choice with that id. Matching on the completion id, rather than on which task sent a call or in
what order calls finished, is what keeps `run_group`'s rollouts apart: they run concurrently,
often send identical prompts and may get identical replies, yet every call has its own id and
each capture is handed out once. A server that repeats ids (or sends none) falls back to the
first unused capture whose request messages and reply equal the step's. Calls that answer no
step (an LLM judge in the rubric) are never trained. The captured Choice wins over the ids that
verifiers itself records per step (`tokens`): it also carries each token's text, the finish
reason and our server's `step`, the weights that sampled it (what `PipelineTrainer` dates by).

Where no capture answers a turn (outputs converted after the fact, an environment served in
another process), a step's `extras["art_choice"]` (written by `rollout_output_from_trajectory`)
or its `tokens` (vLLM's `return_token_ids`, as prime-rl records them) still give exact ids; else
the turn stays a message dict, context only as in ART, and `trajectory.logs` says so. A step whose
prompt does not extend the conversation so far starts an additional history instead of being
glued on. The runners need verifiers' classic `Environment` API (`SingleTurnEnv`, `MultiTurnEnv`,
`ToolEnv`, `Rubric`), which verifiers 0.4 removed (tested with 0.3.1, where it lives under
`verifiers.legacy` and answers at the old paths). The conversions import nothing from verifiers.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from openai.types.chat.chat_completion import Choice

from art.numeric import is_finite

from .capture import AutoTrajectoryContext, message_key, message_text
from .trajectories import (
    ChatCompletionsExchange,
    History,
    MetadataValue,
    MetricValue,
    Trajectory,
    TrajectoryGroup,
    get_messages,
    is_choice,
)

if TYPE_CHECKING:
    from .model import Model

METADATA_FIELDS = ("example_id", "is_completed", "is_truncated", "stop_condition", "answer")
"""Rollout fields kept in `trajectory.metadata`, as `verifiers_<field>` (ART's keys)."""


# -- verifiers -> ART ---------------------------------------------------------------------


def trajectory_from_verifiers_rollout(
    output: Mapping[str, Any], *, exchanges: Iterable[ChatCompletionsExchange] = ()
) -> Trajectory:
    """A verifiers `RolloutOutput` (or serialized State) as a finished Trajectory.

    The conversation is rebuilt from `output["trajectory"]` steps when present (run with
    `state_columns=["trajectory"]`), else from prompt + completion. `exchanges`: captured calls
    (`trajectory.exchanges.chat_completions` of a capture the rollout ran in) that give its
    assistant turns their Choices; each is used at most once.
    """
    return _trajectory(output, _Calls(exchanges))


def trajectory_group_from_verifiers_outputs(
    outputs: Iterable[Mapping[str, Any]], *, exchanges: Iterable[ChatCompletionsExchange] = ()
) -> TrajectoryGroup:
    """A group of verifiers rollout outputs as a TrajectoryGroup; `exchanges` are shared by the
    whole group, each handed to at most one assistant turn."""
    calls = _Calls(exchanges)
    return TrajectoryGroup([_trajectory(output, calls) for output in outputs])


def _trajectory(output: Mapping[str, Any], calls: _Calls) -> Trajectory:
    notes: list[str] = []
    histories, tools = _histories(output, calls, notes)
    if tools is None:
        tools = _openai_tools(output.get("tool_defs"))
    reward = output.get("reward")
    if not is_finite(reward):
        if reward is not None:
            notes.append(f"verifiers reward {reward!r} is not a finite number; the reward is 0")
        reward = 0.0
    error = output.get("error")
    if error:
        notes.append(f"verifiers error: {_error_text(error)}")
    trajectory = Trajectory(
        messages_and_choices=histories[0] if histories else [],
        additional_histories=[History(messages_and_choices=h, tools=tools) for h in histories[1:]],
        tools=tools,
        reward=float(reward),
        metrics=_numbers(output.get("metrics")),
        metadata={**_art_metadata(output), **_verifiers_metadata(output)},
        logs=[*_strings(output.get("logs")), *notes],
    )
    _set_times(trajectory, output.get("timing"))
    return trajectory


def _histories(
    output: Mapping[str, Any], calls: _Calls, notes: list[str]
) -> tuple[list[list[Any]], list[dict[str, Any]] | None]:
    """The rollout's conversations (the first is the trajectory's own) and the tools the calls
    sent, with every assistant turn that can be matched to its sampled tokens as a Choice."""
    histories: list[list[Any]] = []
    tools: list[dict[str, Any]] | None = None
    turns = exact = 0
    steps = output.get("trajectory")
    final = [*_messages(output.get("prompt"), "user"), *_messages(output.get("completion"), "assistant")]
    if isinstance(steps, Sequence) and not isinstance(steps, (str, bytes)) and steps:
        for step in steps:
            if not isinstance(step, Mapping):
                continue
            prompt = _messages(step.get("prompt"), "user")
            history = _extended(histories, prompt)
            response_id = _get(step.get("response"), "id")
            for message in _messages(step.get("completion"), "assistant"):
                if message.get("role") != "assistant":
                    history.append(message)
                    continue
                turns += 1
                call = calls.take(response_id, [_key(m) for m in history], _key(message))
                response_id = None  # a step's response is its first assistant message
                choice = call.choice if call is not None else _recorded_choice(step, message)
                if call is not None and tools is None:
                    tools = call.tools
                exact += choice is not None
                history.append(choice if choice is not None else message)
        if histories:  # what the rollout ended with past its last step (a final env response)
            keys = [_key(m) for m in final]
            for history in sorted(histories, key=len, reverse=True):
                if [_key(m) for m in history] == keys[: len(history)]:
                    history.extend(final[len(history) :])
                    break
    if not histories and final:
        conversation: list[Any] = []
        for message in final:
            if message.get("role") == "assistant":
                turns += 1
                call = calls.take(None, [_key(m) for m in conversation], _key(message))
                if call is not None and tools is None:
                    tools = call.tools
                exact += call is not None
                conversation.append(call.choice if call is not None else message)
            else:
                conversation.append(message)
        histories.append(conversation)
    if turns > exact:
        notes.append(
            f"{turns - exact} of {turns} assistant turns have no sampled token ids (no captured "
            "call, step tokens or art_choice matched them): kept as message dicts, context only"
        )
    return histories, tools


def _extended(histories: list[list[Any]], prompt: list[dict[str, Any]]) -> list[Any]:
    """The longest history that `prompt` extends, with the prompt's new messages appended; a
    new history when it extends none (the environment rewrote the conversation)."""
    keys = [_key(m) for m in prompt]
    best = None
    for history in histories:
        if len(history) <= len(keys) and [_key(m) for m in history] == keys[: len(history)]:
            if best is None or len(history) > len(best):
                best = history
    if best is None:
        best = []
        histories.append(best)
    best.extend(prompt[len(best) :])
    return best


@dataclass(eq=False)
class _Call:
    id: str
    prompt: list[tuple]
    answer: tuple
    choice: Choice
    tools: list[dict[str, Any]] | None


class _Calls:
    """Captured chat completions waiting for the assistant turn each produced."""

    def __init__(self, exchanges: Iterable[ChatCompletionsExchange]) -> None:
        self.free: list[_Call] = []
        for exchange in exchanges:
            choice = next((c for c in exchange.response.choices if c.index == 0), None)
            if choice is None:
                continue
            sent = [m for m in exchange.request.get("messages") or [] if isinstance(m, Mapping)]
            self.free.append(
                _Call(
                    id=exchange.response.id or "",
                    prompt=[_key(_openai_message(m)) for m in sent],
                    answer=_key(get_messages([choice])[0]),
                    choice=choice,
                    tools=deepcopy(exchange.request.get("tools")) or None,
                )
            )
        counts = Counter(call.id for call in self.free)
        self.by_id = {call.id: call for call in self.free if call.id and counts[call.id] == 1}

    def take(self, response_id: Any, prompt: list[tuple], answer: tuple) -> _Call | None:
        """The call that answered this turn: the one with its completion id, else the first
        whose request messages and reply are the turn's."""
        call = self.by_id.get(response_id) if isinstance(response_id, str) else None
        if call is None or call not in self.free:
            call = next((c for c in self.free if c.prompt == prompt and c.answer == answer), None)
        if call is not None:
            self.free.remove(call)
        return call


def _recorded_choice(step: Mapping[str, Any], message: dict[str, Any]) -> Choice | None:
    """A Choice from what the step itself recorded: our own dumped Choice, else verifiers'
    token ids and logprobs (present when the server returned them, as vLLM does)."""
    extras = step.get("extras")
    dumped = extras.get("art_choice") if isinstance(extras, Mapping) else None
    if isinstance(dumped, Mapping):
        try:
            return Choice.model_validate(dumped)
        except ValueError:
            pass
    tokens = step.get("tokens")
    prompt_ids, ids = _get(tokens, "prompt_ids"), _get(tokens, "completion_ids")
    logprobs, mask = _get(tokens, "completion_logprobs"), _get(tokens, "completion_mask")
    if not prompt_ids or not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
        return None
    if isinstance(mask, list) and (len(mask) != len(ids) or not all(mask)):
        return None  # verifiers masked part of it out (past max_seq_len): not all of it trains
    if message.get("tool_calls"):
        reason = "tool_calls"
    elif _get(tokens, "is_truncated") or _get(_get(step.get("response"), "message"), "is_truncated"):
        reason = "length"
    else:
        reason = "stop"
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": reason,
            "message": {
                "role": "assistant",
                "content": message_text(message.get("content")) or None,
                "tool_calls": message.get("tool_calls") or None,
            },
            "logprobs": {
                "content": [
                    {"token": f"token_id:{i}", "logprob": float(lp), "bytes": None, "top_logprobs": []}
                    for i, lp in zip(ids, logprobs)
                ]
            },
            "token_ids": list(ids),
            "prompt_token_ids": list(prompt_ids),
        }
    )


# -- ART -> verifiers ---------------------------------------------------------------------


def rollout_output_from_trajectory(
    trajectory: Trajectory,
    *,
    example_id: int = 0,
    prompt_length: int | None = None,
    include_trajectory: bool = True,
) -> dict[str, Any]:
    """A Trajectory as a verifiers `RolloutOutput` dict.

    `prompt_length`: how many of its messages are the prompt; by default those before the first
    assistant message. With `include_trajectory`, `trajectory` holds one step per Choice (its
    prompt, its reply, its token ids as verifiers' `tokens`, the Choice itself in
    `extras["art_choice"]`), or one step of prompt and completion when it has no Choice.
    """
    messages = [_openai_message(m) for m in trajectory.messages()]
    split = _prompt_length(messages, prompt_length)
    metadata = trajectory.metadata
    output: dict[str, Any] = {
        "example_id": example_id,
        "prompt": messages[:split],
        "completion": messages[split:],
        "reward": trajectory.reward,
        "timing": _timing(trajectory),
        "is_completed": bool(metadata.get("verifiers_is_completed", True)),
        "is_truncated": bool(metadata.get("verifiers_is_truncated", metadata.get("is_truncated", False))),
        "metrics": dict(trajectory.metrics),
        "tool_defs": _verifiers_tools(trajectory.tools),
    }
    for field in ("answer", "stop_condition"):
        if metadata.get(f"verifiers_{field}") is not None:
            output[field] = metadata[f"verifiers_{field}"]
    if trajectory.logs:
        output["logs"] = list(trajectory.logs)
    if include_trajectory:
        steps = _steps(trajectory, output)
        steps[0]["extras"]["art_metadata"] = dict(metadata)
        output["trajectory"] = steps
    return output


def rollout_outputs_from_trajectory_group(
    group: TrajectoryGroup,
    *,
    first_example_id: int = 0,
    prompt_length: int | None = None,
    include_trajectory: bool = True,
) -> list[dict[str, Any]]:
    """The group's trajectories as RolloutOutput dicts, numbered from `first_example_id`."""
    return [
        rollout_output_from_trajectory(
            t, example_id=first_example_id + i, prompt_length=prompt_length, include_trajectory=include_trajectory
        )
        for i, t in enumerate(group.trajectories)
    ]


def normalize_verifiers_rollout_output(
    output: Mapping[str, Any], *, prompt_length: int | None = None, include_trajectory: bool = True
) -> dict[str, Any]:
    """A verifiers output round-tripped through a Trajectory: the shape ART would hand back
    (OpenAI-style messages and tool calls), keeping the output's id, timing, logs, answer,
    stop condition and completion flags."""
    trajectory = trajectory_from_verifiers_rollout(output)
    example_id = output.get("example_id")
    normalized = rollout_output_from_trajectory(
        trajectory,
        example_id=example_id if isinstance(example_id, int) else 0,
        prompt_length=prompt_length,
        include_trajectory=include_trajectory,
    )
    for field in ("timing", "answer", "stop_condition"):
        if field in output:
            normalized[field] = deepcopy(output[field])
    if "logs" in output:
        normalized["logs"] = _strings(output.get("logs"))
    normalized["is_completed"] = bool(output.get("is_completed", True))
    normalized["is_truncated"] = bool(output.get("is_truncated", normalized["is_truncated"]))
    return normalized


def normalize_verifiers_rollout_outputs(
    outputs: Iterable[Mapping[str, Any]], *, prompt_length: int | None = None, include_trajectory: bool = True
) -> list[dict[str, Any]]:
    """`normalize_verifiers_rollout_output` of each."""
    return [
        normalize_verifiers_rollout_output(o, prompt_length=prompt_length, include_trajectory=include_trajectory)
        for o in outputs
    ]


def _steps(trajectory: Trajectory, output: Mapping[str, Any]) -> list[dict[str, Any]]:
    def step(prompt: list, completion: list, choice: Choice | None) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "completion": completion,
            "response": None,
            "tokens": _tokens(choice),
            "reward": trajectory.reward,
            "advantage": None,
            "is_truncated": output["is_truncated"],
            "trajectory_id": str(trajectory.metadata.get("trajectory_id", "")),
            "extras": {} if choice is None else {"art_choice": choice.model_dump(mode="json")},
        }

    steps = []
    histories = [trajectory.messages_and_choices, *(h.messages_and_choices for h in trajectory.additional_histories)]
    for history in histories:
        for i, item in enumerate(history):
            if is_choice(item):
                context = [_openai_message(m) for m in get_messages(history[:i])]
                steps.append(step(context, [_openai_message(get_messages([item])[0])], item))
    return steps or [step(output["prompt"], output["completion"], None)]


def _tokens(choice: Choice | None) -> dict[str, Any] | None:
    """verifiers' `tokens` of a step: the Choice's prompt and completion ids and logprobs."""
    prompt, ids = getattr(choice, "prompt_token_ids", None), getattr(choice, "token_ids", None)
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if not prompt or ids is None or not content or len(content) != len(ids):
        return None
    return {
        "prompt_ids": list(prompt),
        "prompt_mask": [0] * len(prompt),
        "completion_ids": list(ids),
        "completion_mask": [1] * len(ids),
        "completion_logprobs": [e.logprob for e in content],
        "overlong_prompt": False,
        "is_truncated": getattr(choice, "finish_reason", None) == "length",
        "routed_experts": None,
    }


def _timing(trajectory: Trajectory) -> dict[str, Any]:
    start = trajectory.start_time.timestamp()
    total = (trajectory.end_time.timestamp() - start) if trajectory.end_time else 0.0
    span = {"start": start, "end": start + total, "duration": total}
    empty = {"start": start, "end": start, "duration": 0.0}
    return {
        "start_time": start,
        "setup": dict(empty),
        "generation": span,
        "scoring": dict(empty),
        "model": {"spans": [], "duration": 0.0},
        "env": {"spans": [], "duration": 0.0},
        "total": total,
        "overhead": 0.0,
    }


def _prompt_length(messages: list[dict[str, Any]], prompt_length: int | None) -> int:
    if prompt_length is None:
        return next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    if not 0 <= prompt_length <= len(messages):
        raise ValueError(
            f"prompt_length must be between 0 and {len(messages)} (the number of messages), got {prompt_length}"
        )
    return prompt_length


# -- running an environment ---------------------------------------------------------------


async def rollout_with_verifiers_environment(
    env: Any,
    model: Model,
    input: Mapping[str, Any],
    *,
    sampling_args: Mapping[str, Any] | None = None,
    max_retries: int = 0,
    state_columns: Sequence[str] = ("trajectory",),
) -> Trajectory:
    """One rollout of a verifiers Environment (`env.run_rollout`) with an ART model, scored by
    its rubric, as a Trajectory whose assistant turns are the sampled Choices."""
    client = _chat_client(model)
    with AutoTrajectoryContext() as captured:
        output = await env.run_rollout(
            input=dict(input),
            client=client,
            model=model.get_inference_name(),
            sampling_args=dict(sampling_args or {"n": 1}),
            max_retries=max_retries,
            state_columns=_columns(state_columns),
        )
    return trajectory_from_verifiers_rollout(output, exchanges=captured.exchanges.chat_completions)


async def trajectory_group_with_verifiers_environment(
    env: Any,
    model: Model,
    group_inputs: Sequence[Mapping[str, Any]],
    *,
    sampling_args: Mapping[str, Any] | None = None,
    max_retries: int = 0,
    state_columns: Sequence[str] = ("trajectory",),
) -> TrajectoryGroup:
    """A group of rollouts run together (`env.run_group`: concurrent, scored by the rubric as a
    group, so group reward functions apply), one Trajectory each with its own Choices."""
    client = _chat_client(model)
    with AutoTrajectoryContext() as captured:
        outputs = await env.run_group(
            group_inputs=[dict(i) for i in group_inputs],
            client=client,
            model=model.get_inference_name(),
            sampling_args=dict(sampling_args or {"n": 1}),
            max_retries=max_retries,
            state_columns=_columns(state_columns),
        )
    return trajectory_group_from_verifiers_outputs(outputs, exchanges=captured.exchanges.chat_completions)


def _columns(state_columns: Sequence[str]) -> list[str]:
    """The columns asked for, "trajectory" always among them: its steps name their calls."""
    return list(dict.fromkeys([*state_columns, "trajectory"]))


def _chat_client(model: Model) -> Any:
    try:
        from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient
    except ImportError as exc:
        raise ImportError(
            "art.verifiers runs verifiers' classic Environment API (vf.SingleTurnEnv, MultiTurnEnv, ToolEnv), "
            "which verifiers 0.4 removed: pip install 'verifiers<0.4' datasets (0.3.1 is tested)"
        ) from exc
    return OpenAIChatCompletionsClient(model.openai_client())


# -- messages, tools, fields --------------------------------------------------------------


def _messages(value: Any, role_of_text: str) -> list[dict[str, Any]]:
    """OpenAI-style message dicts from verifiers messages (pydantic or dicts); a bare string
    (a completion-format environment) is one message of `role_of_text`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": role_of_text, "content": value}]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise TypeError(f"expected a list of messages or a string, got {type(value).__name__}")
    return [_openai_message(m) for m in value]


def _openai_message(message: Any) -> dict[str, Any]:
    """A message as an OpenAI dict: verifiers' flat tool calls ({id, name, arguments}, or their
    JSON strings in saved outputs) become {id, type, function: {name, arguments}}."""
    if is_choice(message):
        message = get_messages([message])[0]
    if hasattr(message, "model_dump"):
        data = message.model_dump(mode="json", exclude_none=True)
    elif isinstance(message, Mapping):
        data = deepcopy(dict(message))
    else:
        raise TypeError(f"expected a message, got {type(message).__name__}")
    calls = [_openai_call(c) for c in data.get("tool_calls") or []]
    if calls:
        data["tool_calls"] = calls
    else:
        data.pop("tool_calls", None)
    return data


def _openai_call(call: Any) -> dict[str, Any]:
    if isinstance(call, str):
        call = json.loads(call)
    elif hasattr(call, "model_dump"):
        call = call.model_dump(mode="json", exclude_none=True)
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    arguments = function.get("arguments", "")
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {
            "name": function.get("name", ""),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def _key(message: Any) -> tuple:
    """What must agree for two renderings of a message to be the same turn (capture's rule,
    after verifiers' tool-call shapes are made OpenAI's)."""
    if is_choice(message):
        message = get_messages([message])[0]
    return message_key({**message, "tool_calls": [_openai_call(c) for c in message.get("tool_calls") or []]})


def _openai_tools(value: Any) -> list[dict[str, Any]] | None:
    """verifiers tool defs ({name, description, parameters[, strict]}) as OpenAI tools."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return None
    tools = []
    for tool in value:
        data = tool.model_dump(mode="json", exclude_none=True) if hasattr(tool, "model_dump") else tool
        if not isinstance(data, Mapping):
            continue
        if data.get("type") == "function" and isinstance(data.get("function"), Mapping):
            tools.append(deepcopy(dict(data)))
        elif isinstance(data.get("name"), str) and isinstance(data.get("parameters"), Mapping):
            function = {
                "name": data["name"],
                "description": str(data.get("description") or ""),
                "parameters": deepcopy(dict(data["parameters"])),
            }
            if isinstance(data.get("strict"), bool):
                function["strict"] = data["strict"]
            tools.append({"type": "function", "function": function})
    return tools or None


def _verifiers_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI tools as verifiers tool defs."""
    out = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            out.append(
                {
                    "name": function.get("name", ""),
                    "description": function.get("description", ""),
                    "parameters": deepcopy(function.get("parameters", {})),
                    **({"strict": function["strict"]} if isinstance(function.get("strict"), bool) else {}),
                }
            )
        elif isinstance(tool, Mapping) and {"name", "parameters"} <= set(tool):
            out.append(deepcopy(dict(tool)))
    return out


def _numbers(metrics: Any) -> dict[str, MetricValue]:
    if not isinstance(metrics, Mapping):
        return {}
    return {str(k): v for k, v in metrics.items() if isinstance(v, (int, float, bool))}


def _verifiers_metadata(output: Mapping[str, Any]) -> dict[str, MetadataValue]:
    return {
        f"verifiers_{f}": output.get(f)
        for f in METADATA_FIELDS
        if output.get(f) is None or isinstance(output.get(f), (int, float, str, bool))
    }


def _art_metadata(output: Mapping[str, Any]) -> dict[str, MetadataValue]:
    """The metadata `rollout_output_from_trajectory` stored, so a round trip keeps it."""
    steps = output.get("trajectory")
    first = steps[0] if isinstance(steps, Sequence) and not isinstance(steps, (str, bytes)) and steps else None
    extras = first.get("extras") if isinstance(first, Mapping) else None
    stored = extras.get("art_metadata") if isinstance(extras, Mapping) else None
    if not isinstance(stored, Mapping):
        return {}
    return {str(k): v for k, v in stored.items() if v is None or isinstance(v, (int, float, str, bool))}


def _set_times(trajectory: Trajectory, timing: Any) -> None:
    """Start and end from verifiers' timing (epoch seconds) when it has them, else now."""
    start, total = _get(timing, "start_time"), _get(timing, "total")
    if isinstance(start, (int, float)) and start > 0:
        trajectory.start_time = datetime.fromtimestamp(start)
        if isinstance(total, (int, float)) and total >= 0:
            trajectory.end_time = datetime.fromtimestamp(start + total)
            return
    trajectory.finish()


def _error_text(error: Any) -> str:
    for key in ("error_chain_repr", "error_chain_str", "message", "type"):
        if isinstance(_get(error, key), str):
            return _get(error, key)
    return repr(error)


def _strings(value: Any) -> list[str]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return []
    return [item for item in value if isinstance(item, str)]


def _get(obj: Any, name: str) -> Any:
    """`obj[name]` or `obj.name` (verifiers keeps live pydantic objects, saved outputs dicts)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)
