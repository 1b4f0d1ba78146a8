"""``skyformer bench``: speed and memory against exact SDPA over sequence lengths."""

from .report import format_table, format_wide, plot_results, write_results
from .run import BenchConfig, BenchResult, run_bench
from .summary import crossover, summarise

__all__ = [
    "BenchConfig",
    "BenchResult",
    "crossover",
    "format_table",
    "format_wide",
    "plot_results",
    "run_bench",
    "summarise",
    "write_results",
]
