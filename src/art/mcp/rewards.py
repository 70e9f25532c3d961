"""RULER as MCP·RL's reward: the group's episodes judged against each other, no labels needed.

Which judge, when none is named: with the policy `model` given, the base model it trains from,
served by the same backend (`judge=model, judge_model=model.base_model`): it needs no key or
network, and it stays fixed while the policy learns. That judge is as strong as the base model,
so a small one (the 135M default) may score every episode alike, which trains nothing
(`ruler/uniform_groups` counts such groups); name a stronger judge for real work, e.g.
`judge_model="openai/o4-mini"` (ART's MCP·RL judge; `OPENAI_API_KEY`) or
`judge="http://host:8000/v1"`. Without `model` and without a judge, RULER's own default applies
(ART's: `openai/o3`).
"""

from __future__ import annotations

from typing import Any

from art.rewards import ruler_score_group
from art.trajectories import TrajectoryGroup


async def ruler_score_mcp_group(
    group: TrajectoryGroup,
    model: Any = None,
    *,
    judge: Any = None,
    judge_model: str | None = None,
    swallow_exceptions: bool = True,
    **options: Any,
) -> TrajectoryGroup | None:
    """`ruler_score_group` with MCP·RL's default judge (see the module's doc); for
    `gather_trajectory_groups(after_each=...)`.

    A group RULER cannot score (the judge failed every try) is dropped (None) unless
    `swallow_exceptions=False`. `options` are RULER's (rubric=, cache=, max_retries=,
    extra_params=, ...); the judge's cache defaults to the model's run folder.
    """
    if judge is None and judge_model is None and model is not None:
        judge, judge_model = model, getattr(model, "base_model", None) or model.get_inference_name()
    if model is not None and "cache" not in options:
        options["cache"] = model
    if judge_model is not None:
        options["judge_model"] = judge_model
    return await ruler_score_group(group, judge=judge, swallow_exceptions=swallow_exceptions, **options)
