"""Which objective AdamW's moments belong to: GRPO (`art.training.trainer`) or SFT (`art.training.sft`).

The two share one optimizer but not its moments: switching between them resets AdamW's state
(as ART does), since NLL gradients clipped at 1.0 and policy gradients clipped at 0.1 live on
different scales. The mode rides in the optimizer's param groups, so it is saved with the
checkpoint and a resumed run switches exactly as an uninterrupted one.
"""

from __future__ import annotations

import torch

from art.training.options import ADAMW_WEIGHT_DECAY

MODE_KEY = "art_mode"
"""The param-group key that holds the mode ("rl" or "sft")."""


def switch_optimizer_mode(optimizer: torch.optim.Optimizer, mode: str, weight_decay: float) -> None:
    """Enter "sft" or "rl": moments reset when the mode changes (a fresh optimizer counts as "rl")."""
    if optimizer.param_groups[0].get(MODE_KEY, "rl") != mode:
        optimizer.state.clear()
    for group in optimizer.param_groups:
        group[MODE_KEY] = mode
        group["weight_decay"] = weight_decay


def enter_rl_mode(optimizer: torch.optim.Optimizer) -> None:
    """Before a GRPO step: "rl" mode, with GRPO's weight decay."""
    switch_optimizer_mode(optimizer, "rl", ADAMW_WEIGHT_DECAY)
