"""The resolved options of one training step, with every default in one place."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from art.errors import ArtValueError

LORA_DEFAULTS = {
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
ADAMW_BETAS = (0.9, 0.99)
ADAMW_WEIGHT_DECAY = 0.1


@dataclass(frozen=True)
class TrainOptions:
    learning_rate: float = 5e-6
    """AdamW learning rate (constant)."""
    beta: float = 0.0
    """KL coefficient (k3 estimator) against the base model; 0 skips the reference pass."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (+1e-6)."""
    epsilon: float = 0.2
    """Importance ratios below 1 - epsilon are clipped (PPO)."""
    epsilon_high: float | None = None
    """Ratios above 1 + epsilon_high are clipped; None means epsilon."""
    max_grad_norm: float = 0.1
    """Gradient-norm clip before the optimizer step."""
    micro_batch_tokens: int = 4096
    """Padded tokens per forward pass; bounds memory, not the update."""

    @classmethod
    def build(cls, config=None, dev: dict | None = None) -> "TrainOptions":
        """Merge `art.TrainConfig` and an `art.dev.TrainConfig` dict; report every bad field."""
        values: dict = {}
        if config is not None:
            values.update(config.model_dump() if hasattr(config, "model_dump") else dict(config))
        known = {f.name for f in fields(cls)}
        problems = [f"unknown option {key!r}" for key in (dev or {}) if key not in known]
        values.update({k: v for k, v in (dev or {}).items() if k in known})
        options = cls(**values)
        problems += options._problems()
        if problems:
            raise ArtValueError("invalid training config: " + "; ".join(problems), field=problems[0])
        return options

    def _problems(self) -> list[str]:
        out = []
        for name in ("learning_rate", "epsilon", "max_grad_norm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                out.append(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.beta, (int, float)) or not math.isfinite(self.beta) or self.beta < 0:
            out.append(f"beta must be >= 0, got {self.beta!r}")
        if self.epsilon_high is not None and not (isinstance(self.epsilon_high, (int, float)) and self.epsilon_high > 0):
            out.append(f"epsilon_high must be a positive number or None, got {self.epsilon_high!r}")
        if not isinstance(self.micro_batch_tokens, int) or self.micro_batch_tokens < 1:
            out.append(f"micro_batch_tokens must be a positive int, got {self.micro_batch_tokens!r}")
        return out

    def as_dict(self) -> dict:
        return asdict(self)
