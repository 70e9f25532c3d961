"""The charts ART's examples draw from `load_trajectories`' table (ART's `charts` helpers).

Both take the table as a polars DataFrame (`load_trajectories`) or as rows (`trajectory_rows`),
and return a matplotlib Figure to save or show. A model logged at several steps is *trained*
(a line over the steps, a stacked bar of first step + gain); a model logged at one step is a
*comparison* (a flat dashed line, a plain bar). matplotlib is imported only when a chart is
drawn (the `examples` extra). ART draws with seaborn's theme; these use matplotlib's own.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from art.errors import ArtValueError
from art.utils.benchmarking.types import BenchmarkModelKey

TRAINED_COLOR = "#e67a30"
"""The bar colour of a trained model (ART's orange); comparison bars are grey."""
COMPARISON_COLOR = "#e0dcd5"


def training_progress_chart(
    df: Any,
    metric_name: str,
    models: list[str | BenchmarkModelKey] | None = None,
    title: str | None = None,
    x_label: str | None = None,
    y_label: str | None = None,
    perfect_score: float | None = None,
    legend_loc: str | None = "lower right",
):
    """`metric_name` (a column, or `metric_{name}`) averaged per step, one line per model.
    `models` picks and orders the models (names or `BenchmarkModelKey`s, which also pick the
    split and the label); by default every model, trained ones first, alphabetically."""
    import matplotlib.pyplot as plt

    _, means, order = _prepare(df, metric_name, models)
    steps = sorted({step for series in means.values() for step in series})
    if not steps:
        raise ArtValueError("no data to draw: no step has a value", field="df")
    trained = [m for m in order if len(means.get(m, {})) > 1]
    comparison = [m for m in order if len(means.get(m, {})) == 1]
    colors = _colors(trained + comparison)
    fig, ax = plt.subplots(figsize=(6, 4))
    if perfect_score is not None:
        ax.plot(
            [steps[0], steps[-1]],
            [perfect_score, perfect_score],
            linestyle="-",
            linewidth=1,
            color="dimgray",
            label="_nolegend_",
        )
        low, high = ax.get_ylim()
        ax.text(steps[0], perfect_score - (high - low) * 0.1, "Perfect score", va="top", ha="left", color="dimgray")
    drawn_scores: set[float] = set()
    for model in comparison:  # under the trained lines, so a baseline never hides a curve's end
        (score,) = means[model].values()
        style = ":" if score in drawn_scores else "--"  # two baselines on one value stay apart
        drawn_scores.add(score)
        ax.plot([steps[0], steps[-1]], [score, score], linestyle=style, linewidth=2, color=colors[model], label=model)
    for model in trained:
        xs = sorted(means[model])
        ax.plot(xs, [means[model][x] for x in xs], marker="o", linewidth=2, color=colors[model], label=model)
    ax.set_title(metric_name if title is None else title)
    ax.set_xlabel("Step" if x_label is None else x_label)
    if y_label is not None:
        ax.set_ylabel(y_label)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
    labels = [m for m in trained + comparison if m in handles]
    placement: dict[str, Any] = {"loc": legend_loc} if legend_loc else {}  # None: matplotlib's choice
    ax.legend([handles[m] for m in labels], labels, frameon=True, facecolor="white", **placement)
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    fig.tight_layout(pad=1.0)
    return fig


def percentage_comparison_bar_chart(
    df: Any,
    metric_name: str,
    models: list[str | BenchmarkModelKey] | None = None,
    title: str | None = None,
    y_label: str | None = None,
    perfect_score: float | None = None,
):
    """One bar per model: its mean `metric_name` at its first step, with a hatched segment for
    the gain by its last step (labelled "RL +N"). Values in [0, 1] are shown as percentages."""
    import matplotlib.pyplot as plt

    _, means, order = _prepare(df, metric_name, models)
    stats = []  # (model, first-step value, gain by the last step)
    for model in order:
        series = means.get(model)
        if series:
            first, last = series[min(series)], series[max(series)]
            stats.append((model, first, last - first if len(series) > 1 else 0.0))
    if not stats:
        raise ArtValueError("no data to draw for the requested models", field="models")
    top = max(base + gain for _, base, gain in stats)
    scale, unit = (100.0, "%") if top <= 1.01 else (1.0, "")
    fig, ax = plt.subplots(figsize=(6, 4))
    for x, (_, base, gain) in enumerate(stats):
        base, gain = base * scale, gain * scale
        ax.bar(x, base, width=0.7, color=TRAINED_COLOR if gain else COMPARISON_COLOR, edgecolor="white")
        if gain:
            ax.bar(x, gain, width=0.7, bottom=base, color=TRAINED_COLOR, hatch="///", edgecolor="white", alpha=0.95)
            ax.text(
                x,
                base + gain / 2,
                f"RL {gain:+.0f}{unit}",
                ha="center",
                va="center",
                color="#c05a20",
                fontweight="bold",
                bbox={"facecolor": "white", "boxstyle": "round,pad=0.3", "edgecolor": TRAINED_COLOR},
            )
        ax.text(
            x, base + gain + top * scale * 0.02, f"{base + gain:.0f}{unit}", ha="center", va="bottom", fontweight="bold"
        )
    if perfect_score is not None:
        ax.plot(
            [-0.5, len(stats) - 0.5],
            [perfect_score * scale] * 2,
            linestyle="-",
            linewidth=1,
            color="dimgray",
            label="_nolegend_",
        )
        ax.text(-0.4, perfect_score * scale - top * scale * 0.05, "Perfect score", va="top", ha="left", color="dimgray")
    ax.set_xticks(range(len(stats)))
    ax.set_xticklabels([model for model, _, _ in stats])
    ax.set_yticks([])
    if y_label is not None:
        ax.set_ylabel(y_label)
    for side in ("left", "top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(metric_name if title is None else title, pad=15)
    return fig


def _prepare(
    df: Any, metric_name: str, models: list[str | BenchmarkModelKey] | None
) -> tuple[str, dict[str, dict[int, float]], list[str]]:
    """(the metric's column, {model label: {step: mean}}, the models in drawing order)."""
    rows = df.to_dicts() if hasattr(df, "to_dicts") else list(df)
    columns = set().union(*(row.keys() for row in rows)) if rows else set()
    column = metric_name if metric_name in columns else f"metric_{metric_name}"
    if column not in columns:
        raise ArtValueError(f"no column {column!r}; the table has {sorted(columns)}", field="metric_name")
    if models is not None:
        keys = [m if isinstance(m, BenchmarkModelKey) else BenchmarkModelKey(m) for m in models]
        label = {(k.name, k.split): k.display_name for k in keys}
        rows = [
            {**row, "model": label[(row["model"], row["split"])]}
            for row in rows
            if (row["model"], row["split"]) in label
        ]
        if not rows:
            raise ArtValueError(f"no rows for {keys}: check the names and splits", field="models")
    values: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.get(column) is not None:
            values[row["model"]][row["step"]].append(float(row[column]))
    means = {model: {step: sum(v) / len(v) for step, v in by_step.items()} for model, by_step in values.items()}
    if models is not None:
        order = list(dict.fromkeys(k.display_name for k in keys))
    else:
        order = sorted(m for m in means if len(means[m]) > 1) + sorted(m for m in means if len(means[m]) == 1)
    return column, means, order


def _colors(models: list[str]) -> dict[str, Any]:
    """Matplotlib's colour cycle, trained models first (they get the most distinct colours)."""
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {model: cycle[i % len(cycle)] for i, model in enumerate(models)}
