"""The GRPO objective on per-token logprobs."""

from __future__ import annotations

import torch


def policy_loss_terms(
    new_logprobs: torch.Tensor,  # [rows, tokens] trainer logprobs (with grad)
    old_logprobs: torch.Tensor,  # [rows, tokens] sampler logprobs
    advantages: torch.Tensor,  # [rows] one per sequence
    mask: torch.Tensor,  # [rows, tokens] 1.0 where the token is trained
    *,
    epsilon: float,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,  # [rows, tokens] base-model logprobs when beta > 0
) -> dict[str, torch.Tensor]:
    """Per-token clipped surrogate plus optional KL; returns sums over trained tokens.

    PPO clip (Schulman et al. 2017) applied per token as in GRPO (Shao et al. 2024):
        ratio = exp(logp_new - logp_old)
        L = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
    KL penalty with the k3 estimator (Schulman 2020, "Approximating KL divergence"):
        KL = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1,  added as beta * KL.
    The caller divides the sums by the number of trained tokens in the whole batch
    (token-mean over the batch, as DAPO recommends), so micro-batching does not change the step.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old = torch.where(mask > 0, old_logprobs, new_logprobs.detach())  # NaN-free outside the mask
    ratio = torch.exp(new_logprobs - old)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    terms = {
        "policy_loss": (per_token * mask).sum(),
        "clipped_tokens": ((clipped < unclipped).float() * mask).sum().detach(),
        "ratio": (ratio.detach() * mask).sum(),
    }
    loss = per_token
    if beta > 0 and ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = torch.exp(delta) - delta - 1
        terms["kl"] = (kl * mask).sum()
        loss = loss + beta * kl
    terms["loss"] = (loss * mask).sum()
    return terms


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position without keeping a [rows, tokens, vocab] log-softmax.

    logits: [rows, tokens, vocab]; targets: [rows, tokens] -> [rows, tokens]
    """
    rows, tokens, vocab = logits.shape
    return -torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="none"
    ).view(rows, tokens)
