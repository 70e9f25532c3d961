"""How one `model.train_sft` call appears in history.jsonl, as ART writes it.

One row per optimizer step, that step's metrics under `sft/` (`sft/loss/train`, ...) with
`sft/gradient_step` counting 1, 2, ...; then one summary row: the call's metrics in their own
sections (`loss/train`, the mean over its steps; `data/...`; `sft/...`) and `time/step_trainer_s`.
Every row is logged at the step the call wrote. A call that trained nothing has no rows.
Torch-free: the client builds the rows (`art.Model.train_sft`) from the gradient-step events and
the result the backend returns (`art.training.sft.fit`'s metrics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

GRADIENT_STEP_KEY = "sft/gradient_step"
GRADIENT_STEPS_KEY = "data/step_num_gradient_steps"
TRAINER_TIME_KEY = "time/step_trainer_s"


def history_rows(
    step_metrics: Sequence[Mapping[str, float]], summary: Mapping[str, float], trainer_s: float
) -> list[dict[str, float]]:
    """The rows of one SFT call: `step_metrics` (one dict per optimizer step, in order), then
    `summary` with the call's wall time `trainer_s`. None when no optimizer step ran."""
    if not summary.get(GRADIENT_STEPS_KEY, len(step_metrics)):
        return []
    rows = [
        {**{f"sft/{key}": float(value) for key, value in metrics.items()}, GRADIENT_STEP_KEY: float(number)}
        for number, metrics in enumerate(step_metrics, start=1)
    ]
    rows.append({**{key: float(value) for key, value in summary.items()}, TRAINER_TIME_KEY: float(trainer_s)})
    return rows
