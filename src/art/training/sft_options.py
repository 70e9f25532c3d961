"""The resolved options of one SFT call (`model.train_sft`), every default in one place.

Torch-free: the client resolves them (`resolve_sft_options`) before any service sees them,
exactly as it does for GRPO's `TrainOptions`. The SFT step itself is `art.training.sft`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from art.checks import boolean, int_in, number_in, one_of
from art.errors import ArtValueError
from art.numeric import is_finite, is_int
from art.training.options import BOUNDS, PACKING_MODES, merge_option_sources

AUTO_BATCH_SIZE = 2
"""What `batch_size="auto"` means: ART's LocalBackend uses 2 trajectories per batch."""
ASSISTANT_TURNS = ("all", "last")


@dataclass(frozen=True)
class SFTOptions:
    learning_rate: float | tuple[float, ...] = field(default=5e-5, compare=False)
    """AdamW learning rate: one value for every batch, or one per batch (a schedule, as
    `art.utils.sft` builds). Left out of equality: it is reported per step, not as config."""
    batch_size: int = AUTO_BATCH_SIZE
    """Trajectories per optimizer step; the last batch may be smaller."""
    assistant_turns: str = "all"
    """"all": every assistant message is trained; "last": only the last one (earlier ones are context)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip before each optimizer step (ART's SFT uses 1.0)."""
    weight_decay: float = 0.01
    """AdamW weight decay during SFT (ART's SFT uses 0.01; GRPO steps use 0.1)."""
    micro_batch_tokens: int = 4096
    """Tokens per forward pass (rows x widest row); bounds memory, not the update."""
    packing: str = "shared_prefix"
    """Forward-pass layout (`art.training.packing`): a batch's common prefix (a shared system
    prompt) is computed once under "shared_prefix"."""
    packed_row_tokens: int = 512
    """Longest packed row."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward: less memory, ~1/3 more compute."""

    @classmethod
    def build(cls, values: Mapping[str, Any]) -> SFTOptions:
        """Check every field at once; the error names the first bad one."""
        known = {f.name for f in fields(cls)}
        unknown = [key for key in values if key not in known]
        merged = {k: v for k, v in values.items() if k in known}
        if merged.get("batch_size") == "auto":
            merged["batch_size"] = AUTO_BATCH_SIZE
        if isinstance(merged.get("learning_rate"), (list, tuple)):
            merged["learning_rate"] = tuple(merged["learning_rate"])
        options = cls(**merged)
        problems = [(key, f"unknown option {key!r}") for key in unknown] + options._problems()
        if problems:
            raise ArtValueError("invalid SFT config: " + "; ".join(text for _, text in problems), field=problems[0][0])
        return options

    def _problems(self) -> list[tuple[str, str]]:
        out = []
        rates = self.learning_rate if isinstance(self.learning_rate, tuple) else (self.learning_rate,)
        if not rates:
            out.append(("learning_rate", "learning_rate must not be an empty list"))
        # A schedule may reach 0 (ART's decays to min_lr=0 at its last batch); a single rate may not.
        low = 0 if isinstance(self.learning_rate, tuple) else math.ulp(0)
        bad = [r for r in rates if not is_finite(r) or not low <= r <= BOUNDS["learning_rate"]]
        if bad:
            out.append(
                (
                    "learning_rate",
                    f"learning_rate must be in (0, {BOUNDS['learning_rate']:g}] (a per-batch "
                    f"list may also hold 0), got {bad[0]!r}",
                )
            )
        if not is_int(self.batch_size) or self.batch_size < 1:
            out.append(("batch_size", f"batch_size must be a positive int or 'auto', got {self.batch_size!r}"))
        checks = {
            "assistant_turns": one_of("assistant_turns", self.assistant_turns, ASSISTANT_TURNS),
            "max_grad_norm": number_in("max_grad_norm", self.max_grad_norm, 0, BOUNDS["max_grad_norm"], low_open=True),
            "weight_decay": number_in("weight_decay", self.weight_decay, 0, 1),
            "micro_batch_tokens": int_in(
                "micro_batch_tokens", self.micro_batch_tokens, 1, BOUNDS["micro_batch_tokens"]
            ),
            "packed_row_tokens": int_in("packed_row_tokens", self.packed_row_tokens, 1, BOUNDS["packed_row_tokens"]),
            "packing": one_of("packing", self.packing, PACKING_MODES),
            "gradient_checkpointing": boolean("gradient_checkpointing", self.gradient_checkpointing),
        }
        out += [(name, problem) for name, problem in checks.items() if problem]
        return out

    def rate(self, batch: int) -> float:
        """The learning rate of batch `batch` (0-based)."""
        return self.learning_rate[batch] if isinstance(self.learning_rate, tuple) else self.learning_rate

    def as_dict(self) -> dict:
        out = asdict(self)
        if isinstance(self.learning_rate, tuple):
            out["learning_rate"] = list(self.learning_rate)
        return out

    def described(self) -> dict:
        """The config as printed and kept in model.json: everything but the per-call learning rate."""
        return {k: v for k, v in self.as_dict().items() if k != "learning_rate"}


def resolve_sft_options(
    config=None, dev_config: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None
) -> SFTOptions:
    """The one place SFT options are merged and checked (`merge_option_sources`)."""
    return merge_option_sources(SFTOptions.build, config, dev_config, options)
