"""Group-relative advantages (GRPO), their scaling and their positive/negative balance."""

from __future__ import annotations

import math


def rewards_differ(rewards: list[float]) -> bool:
    """Whether a group carries signal: GRPO learns nothing from a group whose rewards are all equal."""
    return len(set(rewards)) > 1


def reward_std(rewards: list[float]) -> float:
    """Population standard deviation (ART's np.std); 0.0 for no rewards."""
    if not rewards:
        return 0.0
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    return math.sqrt(sum(c * c for c in centred) / len(rewards))


def group_advantages(
    rewards: list[float], *, scale_rewards: bool | str = True, batch_std: float | None = None
) -> list[float]:
    """A_i = r_i - mean(r), divided by (std + 1e-6) unless scaling is off.

    Shao et al. 2024, "DeepSeekMath" (GRPO), eq. for outcome supervision; the population std as
    in ART. (TRL and verl divide by the sample std, torch.std: their |A| is larger by
    sqrt(n / (n - 1)), 1.07 for groups of 8; tests/training/test_peer_losses.py pins the gap.)
    A group whose rewards are all equal yields all-zero advantages (no signal).
    scale_rewards: True/"group" — std of this group's rewards (GRPO);
    "batch" — `batch_std`, the std of every reward in the batch (Hu et al. 2025, REINFORCE++;
    TRL's scale_rewards="batch"); False/"none" — no division (Dr. GRPO, Liu et al. 2025).
    """
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if scale_rewards is False or scale_rewards == "none":
        return centred
    if scale_rewards == "batch":
        if batch_std is None:
            raise ValueError('scale_rewards="batch" needs batch_std')
        std = batch_std
    else:
        std = reward_std(rewards)
    return [c / (std + 1e-6) for c in centred]


def balance_advantage(advantage: float, balance: float) -> float:
    """ART's `advantage_balance` b in [-1, 1]: shift weight between good and bad samples.

    b > 0 scales negative advantages by (1 - b); b < 0 scales positive ones by (1 + b):
    b = 1 trains only on better-than-average samples, b = -1 only on worse ones, b = 0 is
    plain GRPO. (ART then also rescales every advantage so that mean |A| = 1; this library
    does not, so that b = 0 leaves the loss unchanged.)
    """
    if balance > 0 and advantage < 0:
        return advantage * (1 - balance)
    if balance < 0 and advantage > 0:
        return advantage * (1 + balance)
    return advantage
