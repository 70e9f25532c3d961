"""RULER: a judge model scores a group's trajectories relative to each other, in [0, 1].

GRPO only needs rewards that order a group's trajectories, and relative judging is easier than
absolute: the judge sees all of them at once, with the rubric, and scores each. The API and its
behaviour are ART's (`art.rewards.ruler_score_group`, `ruler`); the judge is any
OpenAI-compatible endpoint, reached with the official `openai` client (no LiteLLM):

- `judge=None`: OpenAI itself (`OPENAI_API_KEY`, `OPENAI_BASE_URL`); `judge_model="openai/o3"`
  (LiteLLM's `openai/` prefix is dropped). `judge_model="ollama/qwen3:32b"` (or `ollama_chat/`)
  is a local Ollama's OpenAI-compatible endpoint at `OLLAMA_API_BASE` (LiteLLM's variable;
  default http://localhost:11434), sent the plain answer schema as ART sends it
  (`_get_response_format_for_ollama`).
- `judge_model="openrouter/openai/gpt-4.1-mini"`: OpenRouter (`OPENROUTER_API_KEY`, and
  `OPENROUTER_API_BASE` as LiteLLM reads it), asked for `openai/gpt-4.1-mini`.
- `judge=AsyncOpenAI(...)`, `judge="http://host:8000/v1"` (+ `judge_api_key`), or an `art.Model`
  registered with a backend (our own server, e.g. the base model served next to the one being
  trained: `judge=model, judge_model=model.base_model`).

The judge is asked for a JSON schema through `response_format` (constrained decoding on our
server, vLLM and OpenAI); a judge that refuses it is asked for a JSON object, then for plain
text, and the level that worked is remembered per endpoint. Every answer is parsed strictly
(`judge_answer`; "8/10", "40%" and a 0-10 or 0-100 scale are read as [0, 1]). An unusable answer
is retried `max_retries` times (default 1: two calls, as ART's), the judge shown its answer and
which trajectory ids were missing, repeated or unexpected; then `RulerAnswerError` (a
`JudgeError` and, as ART's, a ValueError). Every call made while a metrics builder is active is
charged to it as `costs/<context>/judge/ruler`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openai import APIConnectionError, APIStatusError, AsyncOpenAI, BadRequestError, OpenAIError
from pydantic import BaseModel

from art.errors import ArtValueError, JudgeError
from art.metrics import active_builder
from art.rewards.judge_answer import JudgeAnswerError, Response, TrajectoryScore, answer_schema, parse_answer
from art.rewards.judge_cache import JudgeCache
from art.rewards.judge_prompt import DEFAULT_RUBRIC, correction, judge_messages
from art.training.advantages import rewards_differ
from art.trajectories import Trajectory, TrajectoryGroup, get_messages, is_choice

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(".art") / "ruler_cache"
"""Where answers are cached by default (beside ART's default run folder `.art`)."""
FORMATS = ("json_schema", "json_object", None)
"""What the judge is asked for, most structured first."""
_format_of: dict[str, int] = {}
"""Per endpoint + model: the index in FORMATS that it accepted last."""
RETRY_TEMPERATURE = 1.0
"""Retries of a request sent at temperature 0 are sampled at this temperature instead."""
OLLAMA_PREFIXES = ("ollama/", "ollama_chat/")
"""LiteLLM's prefixes for a model served by Ollama (ART's judge names)."""
DEFAULT_OLLAMA_BASE = "http://localhost:11434"
"""Where Ollama listens unless `OLLAMA_API_BASE` says otherwise (LiteLLM's default)."""
OPENROUTER_PREFIX = "openrouter/"
"""LiteLLM's prefix for a model served by OpenRouter (`openrouter/openai/gpt-4.1-mini`), which
reports each call's cost in `usage.cost`."""
DEFAULT_OPENROUTER_BASE = "https://openrouter.ai/api/v1"
"""Where OpenRouter is reached unless `OPENROUTER_API_BASE` says otherwise (LiteLLM's variable)."""
_warned_uniform: set[str] = set()
"""Judges (endpoint + model) already warned about for scoring a group's candidates all alike."""


@dataclass
class RulerStats:
    """What judging a group cost and how it went; `ruler_score_group` puts it in the group's
    metrics (`ruler/...`, logged per step as `train/group_ruler/...`)."""

    judge_calls: int = 0
    judge_errors: int = 0
    """Answers that could not be used (malformed, ids missing or repeated) and failed calls."""
    clamped_scores: int = 0
    cache_hits: int = 0
    judge_latency_s: float = 0.0
    judge_prompt_tokens: int = 0
    judge_completion_tokens: int = 0
    uniform_groups: int = 0
    """Groups whose scores were all equal: GRPO learns nothing from them (per step, the mean
    `train/group_ruler/uniform_groups` is their share)."""

    def as_metrics(self) -> dict[str, float]:
        return {f"ruler/{k}": float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class _Judge:
    client: AsyncOpenAI
    model: str
    endpoint: str
    """Where it is served (part of the cache key and of the remembered response format)."""
    owned: bool = False
    """Made here (from None or a URL), so closed here after the call."""
    ollama: bool = False
    """An Ollama model (`ollama/...`): asked for the plain answer schema."""
    priced_as: str = ""
    """`judge_model` as given (`openai/gpt-4.1`): its provider prefix and name price each call."""


def _is_ollama_model(judge_model: str) -> bool:
    """Whether `judge_model` names an Ollama model by LiteLLM's prefixes (`ollama/qwen2.5:7b`)."""
    return judge_model.startswith(OLLAMA_PREFIXES)


def _get_response_format_for_ollama(answer_model: type[BaseModel]) -> dict[str, Any]:
    """A `response_format` asking for `answer_model`'s JSON schema, named after the class, as
    ART asks an Ollama judge (`Response` for RULER's answer). Ollama's grammar takes this plain
    schema; the per-group one (`answer_schema`) uses keywords such as `prefixItems` that a
    converter may not implement, and `parse_answer` checks ids and scores either way."""
    return {
        "type": "json_schema",
        "json_schema": {"name": answer_model.__name__, "schema": answer_model.model_json_schema()},
    }


def _ollama_base_url() -> str:
    base = os.environ.get("OLLAMA_API_BASE", DEFAULT_OLLAMA_BASE).rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _judge(judge: Any, judge_model: str, api_key: str | None) -> _Judge:
    ollama = _is_ollama_model(judge_model)
    model = judge_model.removeprefix("openai/")
    for prefix in (*OLLAMA_PREFIXES, OPENROUTER_PREFIX):
        model = model.removeprefix(prefix)
    if judge is None and ollama:
        judge, api_key = _ollama_base_url(), api_key or "ollama"  # Ollama ignores the key
    elif judge is None and judge_model.startswith(OPENROUTER_PREFIX):
        judge = os.environ.get("OPENROUTER_API_BASE", DEFAULT_OPENROUTER_BASE)
        api_key = api_key or os.environ.get("OPENROUTER_API_KEY")
        if not api_key:
            raise ArtValueError(
                f"no key for the OpenRouter judge {judge_model!r}: set OPENROUTER_API_KEY or pass judge_api_key",
                "judge_api_key",
            )
    if judge is None or isinstance(judge, str):
        try:
            client = AsyncOpenAI(
                base_url=judge,
                api_key=api_key or os.environ.get("OPENAI_API_KEY") or (None if judge is None else "none"),
            )
        except OpenAIError as exc:
            raise ArtValueError(
                "no judge: set OPENAI_API_KEY for OpenAI, or pass judge= (an AsyncOpenAI "
                "client, a base URL or a registered art.Model)",
                "judge",
            ) from exc
    elif isinstance(judge, AsyncOpenAI):
        client = judge
    elif hasattr(judge, "openai_client"):  # an art.Model registered with a backend
        client = judge.openai_client()
    else:
        raise ArtValueError(
            f"judge must be an AsyncOpenAI client, a base URL or an art.Model, got {type(judge).__name__}", "judge"
        )
    return _Judge(
        client,
        model,
        str(client.base_url),
        owned=judge is None or isinstance(judge, str),
        ollama=ollama,
        priced_as=judge_model,
    )


def _message_list(item: Any) -> list[Any]:
    if isinstance(item, Trajectory):
        if item.additional_histories:
            raise ArtValueError("RULER does not judge additional_histories yet", "additional_histories")
        return item.messages()
    items = list(item)
    return get_messages(items) if any(is_choice(m) for m in items) else items


async def ruler(
    message_lists: list[Any],
    judge_model: str = "openai/o3",
    extra_litellm_params: dict | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[Any] | None = None,
    *,
    judge: Any = None,
    judge_api_key: str | None = None,
    extra_params: dict | None = None,
    max_retries: int = 1,
    max_trajectory_tokens: int = 2048,
    cache: bool | str | os.PathLike | Any = True,
    structured: bool | None = None,
    debug: bool = False,
    stats: RulerStats | None = None,
) -> list[TrajectoryScore]:
    """Score trajectories (Trajectory objects or message lists) relative to each other.

    Returns one `TrajectoryScore` per input, in order, each in [0, 1].
    - `max_retries`: tries after an unusable answer or a failed call (1: two calls, as ART's);
      then `RulerAnswerError` (a ValueError, as ART's) or, after a failed call, `JudgeError`.
    - `tools`: the tool definitions the agent had (ART's argument), shown to the judge once.
    - `extra_params` (or ART's `extra_litellm_params`): request settings for the judge, e.g.
      `{"temperature": 0, "max_tokens": 2000}`; they are part of the cache key.
    - `max_trajectory_tokens`: each trajectory (and the shared context) is cut to about this
      many tokens (4 characters each), keeping its start and end, the cut marked.
    - `cache`: True for `.art/ruler_cache`, a folder, a registered `art.Model` (its run
      folder's `ruler_cache`), or False. An identical request is answered from disk.
    - `structured`: None asks for the JSON schema and steps down if the judge refuses it;
      True insists on it; False never asks.
    - `stats`: a `RulerStats` to add this call's counts to.
    """
    if max_retries < 0:
        raise ArtValueError(f"max_retries must be >= 0, got {max_retries}", "max_retries")
    lists = [_message_list(item) for item in message_lists]
    if not lists:
        return []
    stats = stats if stats is not None else RulerStats()
    target = _judge(judge, judge_model, judge_api_key)
    try:
        scores = await _score(
            lists,
            target,
            rubric=rubric,
            tools=tools,
            params={**(extra_litellm_params or {}), **(extra_params or {})},
            max_retries=max_retries,
            max_trajectory_tokens=max_trajectory_tokens,
            store=_cache(cache),
            structured=structured,
            debug=debug,
            stats=stats,
        )
    finally:
        if target.owned:
            await target.client.close()
    _check_uniform(scores, lists, target, stats)
    return scores


def _check_uniform(scores: list[TrajectoryScore], lists: list[list[dict]], target: _Judge, stats: RulerStats) -> None:
    """Count a group scored all alike, and warn once per judge when its candidates differed:
    such a judge (the bundled 135M model gives every candidate 0.5) otherwise goes unnoticed
    until training reports equal rewards. Alike candidates deserve alike scores: no warning."""
    if len(scores) < 2 or rewards_differ([s.score for s in scores]):
        return
    stats.uniform_groups += 1
    where = f"{target.endpoint}|{target.model}"
    if where in _warned_uniform or all(messages == lists[0] for messages in lists):
        return
    _warned_uniform.add(where)
    log.warning(
        "RULER: the judge %s (%s) gave all %d different trajectories of a group the same score (%.3f), so "
        "that group trains nothing. If it keeps doing so, use a stronger judge model or a rubric that "
        "separates better answers from worse ones; ruler/uniform_groups counts such groups (this warning "
        "is shown once per judge).",
        target.model,
        target.endpoint,
        len(scores),
        scores[0].score,
    )


async def _score(
    lists: list[list[dict]],
    target: _Judge,
    *,
    rubric: str,
    tools: list[Any] | None,
    params: dict,
    max_retries: int,
    max_trajectory_tokens: int,
    store: JudgeCache | None,
    structured: bool | None,
    debug: bool,
    stats: RulerStats,
) -> list[TrajectoryScore]:
    """Ask the judge until an answer parses (at most 1 + max_retries tries), using the cache.
    A retry after an unusable answer shows the judge that answer and what was wrong with it."""
    base = judge_messages(lists, rubric, max_trajectory_tokens, tools)
    messages = base
    where = f"{target.endpoint}|{target.model}"
    level = 0 if structured else 2 if structured is False else _format_of.get(where, 0)
    last_error: Exception | None = None
    key = ""
    for attempt in range(max_retries + 1):
        content = None
        while content is None:  # a refused response_format is the same try, asked differently
            request = _request(target, messages, params, FORMATS[level], len(lists))
            if attempt and params.get("temperature") == 0:
                request["temperature"] = RETRY_TEMPERATURE  # greedy would repeat the same bad answer
            if attempt == 0 and store:  # the answer is cached under the first try's request
                key = JudgeCache.key(request, target.endpoint)
                cached = store.get(key)
                if cached is not None and (found := _usable(cached, len(lists))) is not None:
                    stats.cache_hits += 1
                    return _report(found, stats, debug)
            try:
                content = await _ask(target, request, stats)
            except BadRequestError as exc:
                if structured is None and level < 2 and _about_format(exc):
                    log.info(
                        "judge %s refused response_format %s; asking for %s",
                        where,
                        FORMATS[level],
                        FORMATS[level + 1] or "plain text",
                    )
                    level += 1
                    _format_of[where] = level
                    continue
                raise JudgeError(f"the judge {target.model} at {target.endpoint} refused the request: {exc}") from exc
            except (APIConnectionError, APIStatusError) as exc:
                stats.judge_errors += 1
                last_error = exc
                log.warning("judge call failed (try %d of %d): %s", attempt + 1, max_retries + 1, exc)
                break
        if content is None:
            continue
        try:
            scores, clamped = parse_answer(content, len(lists))
        except JudgeAnswerError as exc:
            stats.judge_errors += 1
            last_error = exc
            messages = [*base, *correction(content, exc, len(lists))]
            log.warning("unusable judge answer (try %d of %d): %s", attempt + 1, max_retries + 1, exc)
            continue
        stats.clamped_scores += clamped
        if store:
            store.put(key, content)
        return _report(scores, stats, debug)
    tries = f"the judge {target.model} at {target.endpoint} gave no usable answer in {max_retries + 1} tries"
    if isinstance(last_error, JudgeAnswerError):
        raise RulerAnswerError(f"{last_error}; {tries}") from last_error
    raise JudgeError(f"{tries}; last: {last_error}") from last_error


class RulerAnswerError(JudgeError, ValueError):
    """The judge's answers stayed unusable through every try. A `JudgeError`, and a ValueError
    as ART's `ruler` raises, its message opening as ART's ("Expected 2 scores, but got 1")."""


def _request(target: _Judge, messages: list[dict], params: dict, response_format: str | None, n: int) -> dict:
    request = {"model": target.model, "messages": messages, **params}
    if response_format == "json_schema" and target.ollama:
        request["response_format"] = _get_response_format_for_ollama(Response)
    elif response_format == "json_schema":
        request["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "ruler_scores", "schema": answer_schema(n), "strict": True},
        }
    elif response_format == "json_object":
        request["response_format"] = {"type": "json_object"}
    return request


def _usable(content: str, n: int) -> list[TrajectoryScore] | None:
    """A cached answer's scores (a cache only holds answers that parsed), or None if it no longer does."""
    try:
        return parse_answer(content, n)[0]
    except JudgeAnswerError:
        return None


def _report(scores: list[TrajectoryScore], stats: RulerStats, debug: bool) -> list[TrajectoryScore]:
    if debug:
        for score in scores:
            print(f"[RULER] trajectory {score.trajectory_id}: {score.score:.3f} - {score.explanation}")
    return scores


async def _ask(target: _Judge, request: dict[str, Any], stats: RulerStats) -> str:
    started = time.monotonic()
    stats.judge_calls += 1
    try:
        response = await target.client.chat.completions.create(**request)
    finally:
        stats.judge_latency_s += time.monotonic() - started
    _charge(target, response)
    if response.usage is not None:
        stats.judge_prompt_tokens += response.usage.prompt_tokens or 0
        stats.judge_completion_tokens += response.usage.completion_tokens or 0
    if not response.choices:
        return ""
    return response.choices[0].message.content or ""


def _charge(target: _Judge, response: Any) -> None:
    """Charge one judge call to the active metrics builder as `costs/<context>/judge/ruler`
    (ART's), priced by `judge_model`'s provider prefix; a judge with no prefix, or whose price
    is unknown (a local model), costs nothing."""
    builder = active_builder()
    provider, slash, _ = target.priced_as.partition("/")
    if builder is None or not slash or not provider.strip():
        return
    try:
        builder.add_response_cost("judge/ruler", response, provider=provider, model_name=target.priced_as)
    except ValueError as exc:
        log.debug("judge call not priced: %s", exc)


def _about_format(exc: BadRequestError) -> bool:
    """Whether a 400 is about response_format (the judge does not support it)."""
    text = f"{getattr(exc, 'param', '') or ''} {exc.message}".lower()
    return any(word in text for word in ("response_format", "json_schema", "json_object", "schema"))


def _cache(cache: Any) -> JudgeCache | None:
    if cache is False or cache is None:
        return None
    if cache is True:
        return JudgeCache(DEFAULT_CACHE)
    if hasattr(cache, "project") and hasattr(cache, "base_path"):  # an art.Model: its run folder
        return JudgeCache(Path(cache.base_path) / cache.project / "models" / cache.name / "ruler_cache")
    return JudgeCache(cache)


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str = "openai/o3",
    extra_litellm_params: dict | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    **options: Any,
) -> TrajectoryGroup | None:
    """Score a group with RULER; for `gather_trajectory_groups(after_each=...)`.

    Returns a new group whose trajectories carry the judge's score as `reward`, the previous
    reward in `metrics["independent_reward"]`, the score in `metrics["ruler_score"]` and the
    explanation in their logs; the group's metrics get `ruler/...` counts (`RulerStats`). The
    input group is left as it was. With `swallow_exceptions`, a failure returns None (the group
    is dropped) instead of raising. `options` are `ruler`'s (judge=, cache=, max_retries=, ...).
    """
    for trajectory in group.trajectories:
        if trajectory.additional_histories:
            raise ArtValueError("RULER does not judge additional_histories yet", "additional_histories")
    if not group.trajectories:
        return group
    stats = RulerStats()
    try:
        scores = await ruler(
            list(group.trajectories),
            judge_model,
            extra_litellm_params,
            rubric,
            options.pop("tools", group.trajectories[0].tools),
            debug=debug,
            stats=stats,
            **options,
        )
    except Exception as exc:
        if not swallow_exceptions:
            raise
        log.warning("RULER dropped a group of %d: %s (%s)", len(group.trajectories), exc, stats.as_metrics())
        return None
    trajectories = []
    for trajectory, score in zip(group.trajectories, scores):
        judged = trajectory.model_copy()
        judged.metrics = {**trajectory.metrics, "independent_reward": trajectory.reward, "ruler_score": score.score}
        judged.logs = [*trajectory.logs, f"RULER explanation: {score.explanation}"]
        judged.reward = score.score
        trajectories.append(judged)
    return TrajectoryGroup(
        trajectories,
        exceptions=group.exceptions,
        metadata=group.metadata,
        metrics={**group.metrics, **stats.as_metrics()},
        logs=group.logs,
    )
