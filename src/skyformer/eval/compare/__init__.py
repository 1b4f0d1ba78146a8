"""``skyformer compare``: every method against its exact target on real Q/K/V."""

from .report import format_table
from .run import CompareConfig, CompareResult, compare, compare_on

__all__ = ["CompareConfig", "CompareResult", "compare", "compare_on", "format_table"]
