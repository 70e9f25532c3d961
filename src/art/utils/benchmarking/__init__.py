"""ART's benchmarking helpers: every logged trajectory of a project as one table
(`load_trajectories`), and the charts ART's examples draw from it (`charts`)."""

from art.utils.benchmarking.charts import percentage_comparison_bar_chart, training_progress_chart
from art.utils.benchmarking.load_trajectories import load_trajectories, trajectory_rows
from art.utils.benchmarking.types import BenchmarkModelKey

__all__ = [
    "BenchmarkModelKey",
    "load_trajectories",
    "percentage_comparison_bar_chart",
    "training_progress_chart",
    "trajectory_rows",
]
