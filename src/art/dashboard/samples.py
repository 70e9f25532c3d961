"""One logged step's samples for the dashboard: its groups, their trajectories, and one
trajectory's tokens.

A step's trajectories (`art.storage.step_files`: our run log's JSONL, ART's older JSONL with a
group per line, or ART's Parquet) are read as plain dicts for the samples view: messages, tool
calls, reward, metrics. The advantage shown is the one training used: `group_advantages` over the
group's rewards, scaled as the run's stored `train_options.scale_rewards` says (GRPO's
per-group std when the run has none). The token view rebuilds the trained sequences with the
trainer's own code (`art.training.audit.audit`); the trainer's logprob of each trained token is
the one the training step recorded (`trajectories/train/{step:04d}.trainer_logprobs.jsonl`), so
the view shows where sampler and trainer disagree without loading the model.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from art.dashboard.runs import loads
from art.errors import ArtValueError, ModelNotFoundError
from art.naming import MAX_STEP, echo
from art.numeric import is_number
from art.storage.layout import ModelDir
from art.storage.run_log import trainer_logprobs_file
from art.storage.step_files import read_step_rows
from art.training.advantages import group_advantages, reward_std

log = logging.getLogger(__name__)

TRAINER_LOGPROB_NOTE = (
    "no trainer logprobs recorded for this trajectory: not a train step, its group "
    "had equal rewards, or the run predates them (python -m art.training.audit FILE "
    "--model ID computes them)"
)


def parse_index(value: str, field: str, upper: int = MAX_STEP) -> int:
    """A path segment that must be an int in [0, upper]; ArtValueError naming `field` otherwise."""
    if not (value.isascii() and value.isdigit()) or len(value) > 18 or int(value) > upper:
        raise ArtValueError(f"{field} must be an integer in [0, {upper}], got {echo(value)}", field=field)
    return int(value)


def read_step(directory: ModelDir, split: str, step: int) -> dict:
    """The step's groups, each with its trajectories (rendered messages, reward, advantage,
    metrics) and the exceptions its rollouts raised; 404 when the step logged nothing."""
    logged = _step_rows(directory, split, step)
    groups: dict[int, dict] = {}
    for index, row in enumerate(logged.rows):
        group = _group_index(row)
        groups.setdefault(group, _empty_group(group))["trajectories"].append(_trajectory(index, row))
    for entry in logged.failed:
        group = _group_index(entry)
        groups.setdefault(group, _empty_group(group))["exceptions"] += [
            {
                "type": str(e.get("type", "")),
                "message": str(e.get("message", "")),
                "traceback": str(e.get("traceback", "")),
            }
            for e in entry.get("exceptions") or []
            if isinstance(e, dict)
        ]
    scale = _scale_rewards(directory)
    all_rewards = [t["reward"] for g in groups.values() for t in g["trajectories"]]
    batch_std = reward_std(all_rewards)
    for shown in groups.values():
        rewards = [t["reward"] for t in shown["trajectories"]]
        for trajectory, advantage in zip(shown["trajectories"], _advantages(rewards, scale, batch_std)):
            trajectory["advantage"] = advantage
        shown["reward_mean"] = sum(rewards) / len(rewards) if rewards else None
        shown["reward_std"] = reward_std(rewards) if rewards else None
        shown["zero_variance"] = len(rewards) > 1 and max(rewards) == min(rewards)
    return {"split": split, "step": step, "scale_rewards": scale, "groups": [groups[k] for k in sorted(groups)]}


def trajectory_tokens(directory: ModelDir, split: str, step: int, index: int) -> dict:
    """Every token of trajectory `index` (its line in the step's file) as training sees it:
    text, trained flag, advantage, sampler logprob; trainer logprob null."""
    from art.training.audit import audit
    from art.trajectories import Trajectory

    rows = _step_rows(directory, split, step).rows
    if not rows:
        raise ModelNotFoundError(f"no trajectories logged for {split} step {step}")
    if index >= len(rows):
        raise ModelNotFoundError(f"{split} step {step} has {len(rows)} trajectories; there is no index {index}")
    row, group = rows[index], _group_index(rows[index])
    if not row:
        raise ModelNotFoundError(f"trajectory {index} of {split} step {step} is not readable JSON")
    peers = [i for i, r in enumerate(rows) if _group_index(r) == group]
    rewards = [_reward(rows[i]) for i in peers]
    batch_std = reward_std([_reward(r) for r in rows])
    advantage = _advantages(rewards, _scale_rewards(directory), batch_std)[peers.index(index)]
    try:
        report = audit(Trajectory.from_logging({k: v for k, v in row.items() if k != "group"}))
    except (ValueError, TypeError, KeyError) as exc:
        raise ArtValueError(
            f"trajectory {index} of {split} step {step} cannot be audited: "
            f"{(str(exc) or type(exc).__name__).splitlines()[0]}",
            field="index",
        ) from exc
    trainer = _trainer_logprobs(directory, split, step, group, peers.index(index))
    tokenizer = _tokenizer((directory.read_model_json() or {}).get("base_model"))
    ids = [r.token_id for r in report.rows]
    texts = _decode(tokenizer, ids) if tokenizer is not None else [None] * len(ids)
    return {
        "split": split,
        "step": step,
        "index": index,
        "group": group,
        "reward": _reward(row),
        "advantage": advantage,
        "trained_tokens": report.trained_tokens,
        "has_text": tokenizer is not None,
        "trainer_logprob_note": None if trainer else TRAINER_LOGPROB_NOTE,
        "tokens": [
            {
                "sequence": r.sequence,
                "position": r.position,
                "id": r.token_id,
                "text": text,
                "trained": r.trained,
                "advantage": advantage if r.trained else 0.0,
                "sampler_logprob": r.sampler_logprob,
                "trainer_logprob": _at(trainer.get(r.sequence), r.position) if r.trained else None,
            }
            for r, text in zip(report.rows, texts)
        ],
        "breaks": [
            {"choice": b.choice, "position": b.position, "expected": b.expected, "got": b.got} for b in report.breaks
        ],
        "issues": dict(report.issues),
    }


def _trainer_logprobs(directory: ModelDir, split: str, step: int, group: int, member: int) -> dict[int, list]:
    """{sequence: logprobs} the training step recorded for this trajectory; {} when none."""
    if split != "train":
        return {}
    out = {}
    for line in _lines(trainer_logprobs_file(directory, step)) or []:
        row = _load(line)
        if (
            row is not None
            and row.get("group") == group
            and row.get("trajectory") == member
            and type(row.get("sequence")) is int
            and isinstance(row.get("logprobs"), list)
        ):
            out[row["sequence"]] = row["logprobs"]
    return out


def _at(values: list | None, position: int) -> float | None:
    value = values[position] if values is not None and position < len(values) else None
    return float(value) if is_number(value) else None


# -- reading ------------------------------------------------------------------------------


def _step_rows(directory: ModelDir, split: str, step: int):
    """The step's rows and failures (any layout); 404 when it logged nothing; 400 when its Parquet
    file cannot be read."""
    try:
        logged = read_step_rows(directory, split, step)
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a Parquet step without pyarrow
        raise ArtValueError(f"{split} step {step}'s trajectories cannot be read: {exc}", field="step") from exc
    if logged is None:
        raise ModelNotFoundError(f"no trajectories logged for {split} step {step}")
    return logged


def _lines(path: Path) -> list[str] | None:
    """The file's complete, non-empty lines; None when it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    complete = text[: text.rfind("\n") + 1]  # a line being appended is not read half
    return [line for line in complete.splitlines() if line.strip()]


def _load(line: str) -> dict | None:
    try:
        row = loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _group_index(row) -> int:
    group = row.get("group") if isinstance(row, dict) else None
    return group if type(group) is int and group >= 0 else 0


def _empty_group(index: int) -> dict:
    return {"index": index, "trajectories": [], "exceptions": []}


def _reward(row) -> float:
    reward = row.get("reward") if isinstance(row, dict) else None
    return float(reward) if is_number(reward) else 0.0


def _trajectory(index: int, row) -> dict:
    if not isinstance(row, dict):
        row = {}
    items = row.get("messages_and_choices") or []
    return {
        "index": index,
        "reward": _reward(row),
        "metrics": _scalars(row.get("metrics")),
        "metadata": _metadata(row.get("metadata")),
        "logs": [str(line) for line in row.get("logs") or []],
        "messages": [_message(item) for item in items if isinstance(item, dict)],
        "start_time": row.get("start_time"),
        "end_time": row.get("end_time"),
    }


def _message(item: dict) -> dict:
    """A message dict or a dumped `Choice`, as {role, content, tool_calls, tool_call_id, name,
    choice, trained}: `trained` when the choice carries token ids and logprobs (what training needs)."""
    if "role" not in item and "message" in item:
        message = item.get("message") or {}
        logprobs = item.get("logprobs") or {}
        trained = bool(item.get("token_ids")) and bool(logprobs.get("content"))
        return {
            "role": message.get("role") or "assistant",
            "content": _text(message.get("content")),
            "tool_calls": _tool_calls(message.get("tool_calls")),
            "choice": True,
            "trained": trained,
            "finish_reason": item.get("finish_reason"),
            "tokens": len(item.get("token_ids") or []),
        }
    return {
        "role": str(item.get("role", "")),
        "content": _text(item.get("content")),
        "tool_calls": _tool_calls(item.get("tool_calls")),
        "tool_call_id": item.get("tool_call_id"),
        "name": item.get("name"),
        "choice": False,
        "trained": False,
    }


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", f"[{part.get('type', 'part')}]") if isinstance(part, dict) else str(part)
            for part in content
        )
    return str(content)


def _tool_calls(calls) -> list[dict]:
    out = []
    for call in calls or []:
        if isinstance(call, dict):
            function = call.get("function") or {}
            out.append({"id": call.get("id"), "name": function.get("name"), "arguments": function.get("arguments")})
    return out


def _metadata(values) -> dict:
    """Metadata as shown: scalars as they are, nested values (any JSON) as compact JSON text."""
    if not isinstance(values, dict):
        return {}
    return {
        str(k): v
        if v is None or isinstance(v, (int, float, str, bool))
        else json.dumps(v, ensure_ascii=False, separators=(",", ":"), default=str)
        for k, v in values.items()
    }


def _scalars(values) -> dict:
    if not isinstance(values, dict):
        return {}
    return {str(k): v for k, v in values.items() if v is None or isinstance(v, (int, float, str, bool))}


# -- advantages and tokens ----------------------------------------------------------------


def _scale_rewards(directory: ModelDir) -> bool | str:
    options = (directory.read_model_json() or {}).get("train_options") or {}
    scale = options.get("scale_rewards", True)
    return scale if scale in (True, False, "group", "batch", "none") else True


def _advantages(rewards: list[float], scale: bool | str, batch_std: float) -> list[float]:
    return group_advantages(rewards, scale_rewards=scale, batch_std=batch_std if scale == "batch" else None)


@functools.lru_cache(maxsize=4)
def _tokenizer(base_model: str | None):
    """The run's tokenizer from local files only (a folder, the converted bundled model, or the
    Hugging Face cache); None when it is not on this machine or transformers is not installed."""
    if not base_model:
        return None
    try:
        from transformers import AutoTokenizer

        from art import base_models

        path = base_model
        if base_models.is_bundled(base_model):
            path = str(base_models.converted_path(base_model))
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # no tokenizer only means no token texts
        log.info("dashboard: no tokenizer for %s (%s): token ids are shown instead of text", base_model, exc)
        return None


def _decode(tokenizer, ids: list[int]) -> list[str | None]:
    try:
        return tokenizer.batch_decode([[i] for i in ids])
    except Exception:  # ids outside the vocabulary
        return [None] * len(ids)
