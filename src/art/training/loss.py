"""The GRPO objective on per-token logprobs, and how its token terms are averaged.

It knows tensors only: which tokens are trained (`mask`), one advantage per row, and the
batch-level counts a `Normalizer` needs. Options are resolved in `art.training.options`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Normalizer:
    """How token terms are averaged into the step's loss, with the whole batch's counts.

    Every micro-batch's `reduce` is its share of the batch-level value, so summing the shares
    (and their gradients) over micro-batches equals one call on the whole batch.
        token    (DAPO, Yu et al. 2025):      sum_{i,t} x_it / sum_i |y_i|
        sequence (GRPO, Shao et al. 2024):    (1/G) sum_i (1/|y_i|) sum_t x_it
        constant (Dr. GRPO, Liu et al. 2025): sum_{i,t} x_it / (G * max_tokens)
    |y_i| is the number of trained tokens of sequence i, G the number of sequences in the batch.
    """

    mode: str = "token"
    trained_tokens: int = 1  # trained tokens in the whole batch ("token")
    sequences: int = 1  # sequences in the whole batch ("sequence", "constant")
    max_tokens: int | None = None  # the constant length ("constant")

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """per_token, mask: [rows, tokens] -> scalar share of the batch loss."""
        if self.mode == "token":
            return (per_token * mask).sum() / self.trained_tokens
        if self.mode == "sequence":
            per_row = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [rows]
            return per_row.sum() / self.sequences
        if self.mode == "constant":
            if self.max_tokens is None:
                raise ValueError('"constant" loss normalization needs max_tokens (max_tokens_normalizer)')
            return (per_token * mask).sum() / (self.sequences * self.max_tokens)
        raise ValueError(f"unknown loss normalization {self.mode!r}")


def sequence_ratio(
    new_logprobs: torch.Tensor,  # [rows, tokens] with grad
    old_logprobs: torch.Tensor,  # [rows, tokens]
    mask: torch.Tensor,  # [rows, tokens]
) -> torch.Tensor:
    """GSPO's sequence ratio spread over tokens, with GSPO's per-token gradient.

    Zheng et al. 2025, "Group Sequence Policy Optimization":
        s_i = exp((1/|y_i|) sum_t (logp_new_it - logp_old_it))
    returned as the GSPO-token form s_it = sg(s_i) * exp(logp_new_it - sg(logp_new_it)):
    every trained token of row i has the value s_i, and d s_it / d logp_new_it = s_i. Averaged
    over a sequence's tokens this gives exactly the gradient of s_i itself.
    """
    diff = ((new_logprobs - old_logprobs) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [rows]
    s = torch.exp(diff.detach())[:, None]  # [rows, 1]
    return s * torch.exp(new_logprobs - new_logprobs.detach())  # [rows, tokens]


def policy_loss_terms(
    new_logprobs: torch.Tensor,  # [rows, tokens] trainer logprobs (with grad)
    old_logprobs: torch.Tensor,  # [rows, tokens] logprobs the ratio is taken against
    advantages: torch.Tensor,  # [rows] one per sequence
    mask: torch.Tensor,  # [rows, tokens] 1.0 where the token is trained
    *,
    epsilon: float,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,  # [rows, tokens] base-model logprobs when beta > 0
    ppo: bool = True,
    importance_sampling_level: str = "token",
    sampler_logprobs: torch.Tensor | None = None,  # [rows, tokens] when old != sampler (TIS)
    truncated_importance_sampling: float | None = None,
    normalizer: Normalizer | None = None,
    entropy: torch.Tensor | None = None,  # [rows, tokens] the trainer's token entropies (with grad)
    entropy_bonus: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Per-token policy loss plus optional KL, reduced by `normalizer`.

    ratio_t = exp(logp_new_t - logp_old_t), or GSPO's sequence ratio s_i on every token of
    sequence i when `importance_sampling_level="sequence"` (see `sequence_ratio`).
    ppo=True — PPO clip (Schulman et al. 2017) per token as in GRPO (Shao et al. 2024), with
    DAPO's clip-higher upper bound (Yu et al. 2025):
        L_t = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps_high) * A)
    ppo=False — clipped importance-weight REINFORCE (CISPO, MiniMax-M1, 2025): the weight is
    clipped and detached, so every token keeps a gradient, through logp_new only:
        L_t = -sg(clip(ratio_t, 1 - eps, 1 + eps_high)) * A * logp_new_t
    Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"), when `truncated_importance_sampling` = C is set:
        L_t *= sg(min(exp(logp_old_t - logp_sampler_t), C))
    with logp_old the trainer's pre-update logprobs (`sampler_logprobs` given) or, when they
    were not precalculated, sg(logp_new) (the same policy: one optimizer step per batch).
    KL penalty with the k3 estimator (Schulman 2020, "Approximating KL divergence"):
        KL_t = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1,  added as beta * KL_t.
    Entropy bonus (PPO's c2 term; verl's entropy_coeff), when `entropy` is given:
        L_t -= entropy_bonus * H_t,  H_t the entropy of the distribution token t was drawn from,
    which keeps the policy from collapsing onto one answer before it has found the best one.
    "loss" is `normalizer.reduce` of the token terms (this micro-batch's share of the step's
    loss; a plain sum over trained tokens when `normalizer` is None). The other entries are
    sums over trained tokens, for metrics.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old = torch.where(mask > 0, old_logprobs, new_logprobs.detach())  # NaN-free outside the mask
    if importance_sampling_level == "sequence":
        ratio = sequence_ratio(new_logprobs, old, mask)
    else:
        ratio = torch.exp(new_logprobs - old)
    adv = advantages[:, None]
    if ppo:
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        was_clipped = clipped < unclipped
    else:
        weight = torch.clamp(ratio.detach(), 1 - epsilon, 1 + eps_high)
        per_token = -weight * adv * new_logprobs
        was_clipped = weight != ratio.detach()
    terms = {
        "clipped_tokens": (was_clipped.float() * mask).sum().detach(),
        "ratio": (ratio.detach() * mask).sum(),
    }
    if truncated_importance_sampling is not None:
        behaviour = new_logprobs.detach() if sampler_logprobs is None else old
        sampler = old if sampler_logprobs is None else torch.where(mask > 0, sampler_logprobs, old)
        raw = torch.exp(behaviour - sampler)
        tis = torch.clamp(raw, max=truncated_importance_sampling)
        per_token = per_token * tis
        terms["tis_weight"] = (tis * mask).sum()
        terms["tis_truncated"] = ((raw > truncated_importance_sampling).float() * mask).sum()
    terms["policy_loss"] = (per_token * mask).sum()
    loss = per_token
    if beta > 0 and ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = torch.exp(delta) - delta - 1
        terms["kl"] = (kl * mask).sum()
        loss = loss + beta * kl
    if entropy is not None:
        terms["entropy"] = (entropy.detach() * mask).sum()
        if entropy_bonus:
            loss = loss - entropy_bonus * entropy
    terms["loss"] = (loss * mask).sum() if normalizer is None else normalizer.reduce(loss, mask)
    return terms


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position without keeping a [rows, tokens, vocab] log-softmax.

    logits: [rows, tokens, vocab]; targets: [rows, tokens] -> [rows, tokens]
    """
    rows, tokens, vocab = logits.shape
    return -torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="none"
    ).view(rows, tokens)
