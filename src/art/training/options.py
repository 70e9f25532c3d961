"""The resolved options of one training step, with every default in one place."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from art.checks import boolean, int_in, number_in, one_of
from art.errors import ArtValueError
from art.numeric import is_int
from art.types import as_dict

LORA_DEFAULTS = {
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": [
        *("q_proj", "k_proj", "v_proj", "o_proj"),  # attention
        *("gate_proj", "up_proj", "down_proj"),  # MLPs and shared experts
        *("in_proj_qkv", "in_proj_z", "in_proj_qkvz"),  # Gated DeltaNet's (Qwen3.5, Qwen3-Next) input projections
        *("in_proj", "out_proj"),  # Mamba2's and short convolutions' (Granite 4.0-H, Falcon-H1, Nemotron-H, LFM2)
        *("w1", "w2", "w3", "input_linear", "output_linear"),  # LFM2's MLP, Granite 4.0-H's shared expert
    ],
}
"""A name a model lacks matches nothing; the routed experts of a mixture-of-experts model are added
as peft `target_parameters` when the model is loaded (`art.runtime.architectures.lora_targets`)."""
ADAMW_BETAS = (0.9, 0.99)
ADAMW_WEIGHT_DECAY = 0.1
PACKING_MODES = ("shared_prefix", "packed", "padded")  # see art.training.packing
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
LOSS_NORMALIZATIONS = ("token", "sequence", "constant")
# Upper bounds: far above any sensible run, low enough that a typo cannot run for days or
# blow the weights up (each bound is in the error message that names the field).
BOUNDS = {
    "learning_rate": 1.0,
    "max_grad_norm": 1e6,
    "beta": 1e3,
    "entropy_bonus": 10.0,
    "epsilon": 1e3,
    "epsilon_high": 1e3,
    "truncated_importance_sampling": 1e6,
    "micro_batch_tokens": 1 << 24,
    "packed_row_tokens": 1 << 20,
    "max_tokens_normalizer": 1 << 24,
    "mini_batches": 4096,
    "epochs": 100,
}


@dataclass(frozen=True)
class TrainOptions:
    learning_rate: float = 5e-6
    """AdamW learning rate (constant)."""
    beta: float = 0.0
    """KL coefficient (k3 estimator) against the base model; 0 skips the reference pass."""
    entropy_bonus: float = 0.0
    """Coefficient of the trained tokens' entropy, subtracted from the loss (PPO's c2, verl's
    entropy_coeff): keeps sampling diverse. The mean entropy is reported as `entropy` either way."""
    ppo: bool = False
    """False (ART's default since 2026): CISPO, the clipped, detached importance weight times
    A * logp_new, so every token keeps a gradient. True: the PPO clipped surrogate."""
    epsilon: float | None = None
    """Importance ratios below 1 - epsilon are clipped; None means 0.2 (ppo) or 1.0 (CISPO)."""
    epsilon_high: float | None = None
    """Ratios above 1 + epsilon_high are clipped; None means epsilon (ppo) or 4.0 (CISPO)."""
    importance_sampling_level: str = "token"
    """"token": one ratio per token. "sequence": GSPO, the per-sequence geometric-mean ratio
    on every token of the sequence."""
    loss_normalization: str = "token"
    """"token": sum over trained tokens / trained tokens in the batch (DAPO). "sequence": mean
    over each sequence's tokens, then over sequences (GRPO). "constant": sum / (sequences x
    max_tokens_normalizer) (Dr. GRPO)."""
    max_tokens_normalizer: int | None = None
    """The constant length (tokens) of "constant" normalisation, e.g. the max completion
    tokens; required by it, unused otherwise."""
    scale_rewards: bool | str = True
    """True/"group": divide advantages by the group's reward std (+1e-6). "batch": by the std of
    all rewards in the batch. False/"none": no division."""
    advantage_balance: float = 0.0
    """In [-1, 1]: b > 0 scales negative advantages by 1 - b, b < 0 positive ones by 1 + b;
    1 trains only on positive advantages, -1 only on negative ones, 0 leaves them as they are."""
    precalculate_logprobs: bool = False
    """Compute the pre-update policy's logprobs for the whole batch first (no grad) and take
    the ratio against them instead of the sampler's; the sampler enters only through TIS."""
    truncated_importance_sampling: float | None = None
    """TIS cap C: each token's loss is multiplied by min(exp(logp_trainer - logp_sampler), C);
    None turns it off."""
    max_grad_norm: float = 0.1
    """Gradient-norm clip before the optimizer step."""
    micro_batch_tokens: int = 4096
    """Tokens per forward pass (rows x widest row); bounds memory, not the update."""
    packing: str = "shared_prefix"
    """How sequences are laid out for the forward pass (the update is the same):
    "shared_prefix": a group's common prompt is computed once, its samples attend to it
    (group/parent attention mask) and rows are packed without padding; "packed": whole
    sequences packed into rows; "padded": one right-padded row per sequence."""
    packed_row_tokens: int = 512
    """Longest packed row. Attention within a row costs row length per token, and a micro-batch
    of rows holding several sequences carries a [rows, W, W] mask (W its widest row), so very
    long rows trade padding for attention work and mask memory."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory for
    long sequences, about a third more compute."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the batch is split into this many parts (whole groups
    where possible), each one AdamW step (PPO-style mini-batches)."""
    epochs: int = 1
    """Passes over the batch (PPO epochs; TRL's num_iterations). With more than one optimizer
    step the importance ratio and clipping act against the sampler's logprobs (or the
    precalculated ones)."""

    @classmethod
    def build(cls, config=None, dev: dict | None = None) -> TrainOptions:
        """Merge `art.TrainConfig` and an `art.dev.TrainConfig` dict; report every bad field."""
        values: dict = {}
        if config is not None:
            values.update(as_dict(config))
        known = {f.name for f in fields(cls)}
        unknown = [key for key in (dev or {}) if key not in known]
        problems = [f"unknown option {key!r}" for key in unknown]
        values.update({k: v for k, v in (dev or {}).items() if k in known})
        options = cls(**values)
        problems += options._problems()
        if problems:  # every message but the unknown-option ones starts with its field's name
            field = unknown[0] if unknown else problems[0].split(" ", 1)[0]
            raise ArtValueError("invalid training config: " + "; ".join(problems), field=field)
        return options

    def clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with the defaults of the chosen objective resolved."""
        epsilon = self.epsilon if self.epsilon is not None else (0.2 if self.ppo else 1.0)
        if self.epsilon_high is not None:
            return epsilon, self.epsilon_high
        return epsilon, epsilon if self.ppo else 4.0

    @property
    def reward_scaling(self) -> str:
        """scale_rewards as one of "group", "batch", "none"."""
        if self.scale_rewards is True:
            return "group"
        return "none" if self.scale_rewards is False else str(self.scale_rewards)

    def _problems(self) -> list[str]:
        """Every bad field; the error's `field` names the first, so this order is kept as it was."""
        checks = [
            number_in("learning_rate", self.learning_rate, 0, BOUNDS["learning_rate"], low_open=True),
            number_in("max_grad_norm", self.max_grad_norm, 0, BOUNDS["max_grad_norm"], low_open=True),
            number_in("beta", self.beta, 0, BOUNDS["beta"]),
            number_in("entropy_bonus", self.entropy_bonus, 0, BOUNDS["entropy_bonus"]),
            number_in("epsilon", self.epsilon, 0, BOUNDS["epsilon"], low_open=True, none_ok=True),
            number_in("epsilon_high", self.epsilon_high, 0, BOUNDS["epsilon_high"], low_open=True, none_ok=True),
            number_in(
                "truncated_importance_sampling",
                self.truncated_importance_sampling,
                0,
                BOUNDS["truncated_importance_sampling"],
                low_open=True,
                none_ok=True,
            ),
            boolean("ppo", self.ppo),
            boolean("precalculate_logprobs", self.precalculate_logprobs),
            boolean("gradient_checkpointing", self.gradient_checkpointing),
            one_of("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS),
            one_of("loss_normalization", self.loss_normalization, LOSS_NORMALIZATIONS),
            one_of("packing", self.packing, PACKING_MODES),
            one_of("scale_rewards", self.scale_rewards, (True, False, "group", "batch", "none")),
            number_in("advantage_balance", self.advantage_balance, -1, 1),
            int_in(
                "max_tokens_normalizer", self.max_tokens_normalizer, 1, BOUNDS["max_tokens_normalizer"], none_ok=True
            ),
            int_in("micro_batch_tokens", self.micro_batch_tokens, 1, BOUNDS["micro_batch_tokens"]),
            int_in("packed_row_tokens", self.packed_row_tokens, 1, BOUNDS["packed_row_tokens"]),
            int_in("mini_batches", self.mini_batches, 1, BOUNDS["mini_batches"]),
            int_in("epochs", self.epochs, 1, BOUNDS["epochs"]),
        ]
        problems = [problem for problem in checks if problem]
        if self.max_tokens_normalizer is None and self.loss_normalization == "constant":
            problems.append('max_tokens_normalizer is required by loss_normalization="constant"')
        several_steps = is_int(self.mini_batches) and is_int(self.epochs) and self.mini_batches * self.epochs > 1
        if several_steps and self.truncated_importance_sampling is not None and self.precalculate_logprobs is False:
            problems.append(
                "truncated_importance_sampling with several optimizer steps (mini_batches x epochs > 1) "
                "needs precalculate_logprobs=True: the weight compares the pre-update policy with the sampler"
            )
        return problems

    @property
    def optimizer_steps(self) -> int:
        return self.mini_batches * self.epochs

    def as_dict(self) -> dict:
        return asdict(self)

    def described(self) -> dict:
        """The config as printed and kept in model.json: every option, `epsilon` and
        `epsilon_high` as the chosen objective resolves them (None means its default)."""
        epsilon, epsilon_high = self.clip_range()
        return {**self.as_dict(), "epsilon": epsilon, "epsilon_high": epsilon_high}


OPTION_SOURCES = ("config", "dev_config", "options")
"""Where options come from, later ones winning: the user's config object (`art.TrainConfig`,
`art.TrainSFTConfig`), the `art.dev` dict (`_config=`), and keyword options."""


def merge_option_sources(
    build: Callable[[dict], Any],
    config=None,
    dev_config: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
):
    """`build` the merged options. A bad option's ArtValueError names the source it came from
    in its `field` (`options.beta`, `dev_config.epsilon`, `config.learning_rate`)."""
    given = {
        "config": as_dict(config, exclude_unset=True),
        "dev_config": dict(dev_config or {}),
        "options": dict(options or {}),
    }
    base = as_dict(config)
    try:
        return build({**base, **given["dev_config"], **given["options"]})
    except ArtValueError as exc:
        name = exc.field
        source = next((where for where in reversed(OPTION_SOURCES) if name in given[where]), None)
        raise ArtValueError(str(exc), field=f"{source}.{name}" if source else name) from None
