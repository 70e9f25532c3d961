"""Token audit: which tokens of a trajectory are trained, with what advantage and logprobs.

    python -m art.training.audit RUN/trajectories/train/0003.jsonl [--index 5] [--model ID]

`audit(trajectory)` rebuilds the exact training sequences (the same code the trainer uses),
lists every token with its trained flag, advantage and sampler logprob (and the trainer's
logprob when a model is given), and flags each turn whose prompt ids do not extend the ids
before it: there training starts a new sequence and the earlier context is not shared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field

from art.training.advantages import group_advantages
from art.training.sequences import (
    UNUSED_ASSISTANT_DICT,
    Break,
    Sequence,
    assistant_dict_turns,
    sequences_of_history,
)


@dataclass
class AuditRow:
    sequence: int
    position: int
    token_id: int
    text: str
    trained: bool
    advantage: float
    sampler_logprob: float | None
    trainer_logprob: float | None = None


@dataclass
class AuditReport:
    rows: list[AuditRow]
    breaks: list[Break]
    issues: Counter = field(default_factory=Counter)

    @property
    def trained_tokens(self) -> int:
        return sum(row.trained for row in self.rows)

    def format(self, *, trained_only: bool = False) -> str:
        lines = [f"{'seq':>3} {'pos':>5} {'id':>6}  {'train':5} {'adv':>7} {'sampler':>8} {'trainer':>8}  text"]
        for row in self.rows:
            if trained_only and not row.trained:
                continue
            lines.append(
                f"{row.sequence:>3} {row.position:>5} {row.token_id:>6}  {'yes' if row.trained else '':5} "
                f"{row.advantage:>7.3f} {_num(row.sampler_logprob):>8} {_num(row.trainer_logprob):>8}  {row.text!r}"
            )
        lines.append(f"{self.trained_tokens} trained tokens in {len({r.sequence for r in self.rows})} sequence(s)")
        for b in self.breaks:
            lines.append(
                f"BREAK at choice {b.choice}: its prompt differs from the ids so far at position {b.position} "
                f"(had {b.expected}, got {b.got}); training starts a new sequence there"
            )
        for reason, count in sorted(self.issues.items()):
            lines.append(f"note: {count} x {reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def audit(trajectory, *, group=None, tokenizer=None, model=None) -> AuditReport:
    """Audit one trajectory. `group` (its TrajectoryGroup) gives the advantage; `tokenizer`
    the token texts; `model` (e.g. a PeftModel) the trainer's logprob of every trained token."""
    advantage = _advantage(trajectory, group)
    issues: Counter = Counter()
    breaks: list[Break] = []
    sequences = sequences_of_history(trajectory.messages_and_choices, issues, breaks)
    histories = [trajectory.messages_and_choices]
    for history in getattr(trajectory, "additional_histories", None) or []:
        sequences += sequences_of_history(history.messages_and_choices, issues)
        histories.append(history.messages_and_choices)
    for context, unused in map(assistant_dict_turns, histories):
        issues["context_assistant_turns"] += context  # the names the step's metrics use
        issues[UNUSED_ASSISTANT_DICT] += unused
    issues = +issues  # drop the zero counts
    trainer = [_trainer_logprobs(model, s) for s in sequences] if model is not None else None
    rows = []
    for k, seq in enumerate(sequences):
        for pos, (token, trained, lp) in enumerate(zip(seq.token_ids, seq.trained, seq.sampler_logprobs)):
            rows.append(
                AuditRow(
                    sequence=k,
                    position=pos,
                    token_id=token,
                    text=tokenizer.decode([token]) if tokenizer is not None else "",
                    trained=trained,
                    advantage=advantage if trained else 0.0,
                    sampler_logprob=None if math.isnan(lp) else lp,
                    trainer_logprob=trainer[k][pos] if trainer is not None and trained else None,
                )
            )
    return AuditReport(rows, breaks, issues)


def _advantage(trajectory, group) -> float:
    if group is None:
        return math.nan
    rewards = [float(t.reward) for t in group.trajectories]
    index = next(i for i, t in enumerate(group.trajectories) if t is trajectory)
    return group_advantages(rewards)[index]


def _trainer_logprobs(model, sequence: Sequence) -> list[float | None]:
    import torch

    from art.training.loss import token_logprobs

    ids = torch.tensor([sequence.token_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    values = token_logprobs(logits[:, :-1], ids[:, 1:])[0].tolist()
    return [None] + values  # the first token has no prediction


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show which tokens of a logged trajectory are trained.")
    parser.add_argument("file", help="a trajectories/{split}/{step}.jsonl file of a run")
    parser.add_argument("--index", type=int, default=0, help="which trajectory (line) of the file")
    parser.add_argument("--model", help="base model id or path, for token texts and trainer logprobs")
    parser.add_argument("--trained-only", action="store_true")
    args = parser.parse_args(argv)
    from art.trajectories import Trajectory

    lines = open(args.file).read().splitlines()
    if not 0 <= args.index < len(lines):
        parser.error(f"--index {args.index} is out of range: the file has {len(lines)} trajectories")
    trajectory = Trajectory.from_logging(json.loads(lines[args.index]))
    tokenizer = model = None
    if args.model:
        from art.base_models import load

        model, tokenizer = load(args.model)
    print(audit(trajectory, tokenizer=tokenizer, model=model).format(trained_only=args.trained_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
