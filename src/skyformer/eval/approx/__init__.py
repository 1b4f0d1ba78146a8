"""``skyformer approx``: the approximation study (Skyformer Fig. 1 and App. B, KDEformer
Figs. 2 and 4)."""

from .report import format_table, write_outputs
from .run import ApproxConfig, ApproxResult, quick_config, resolve_methods, run_approx

__all__ = [
    "ApproxConfig",
    "ApproxResult",
    "format_table",
    "quick_config",
    "resolve_methods",
    "run_approx",
    "write_outputs",
]
