"""Group-relative advantages (GRPO)."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], *, scale_rewards: bool = True) -> list[float]:
    """A_i = r_i - mean(r), divided by (std(r) + 1e-6) when `scale_rewards`.

    Shao et al. 2024, "DeepSeekMath" (GRPO), eq. for outcome supervision; population std as in
    ART and TRL. A group whose rewards are all equal yields all-zero advantages (no signal).
    """
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale_rewards:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + 1e-6) for c in centred]
