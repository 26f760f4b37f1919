"""`hf-treespec bench`: tree speculation against plain and assisted ``generate`` on MT-bench-style questions."""

from .methods import METHODS, BenchMethod, RunOutput, available_methods, build_method
from .report import markdown_report, write_report
from .results import BenchmarkResult, MethodSummary, QuestionResult
from .runner import BenchmarkConfig, run_benchmark

__all__ = [
    "METHODS",
    "BenchMethod",
    "BenchmarkConfig",
    "BenchmarkResult",
    "MethodSummary",
    "QuestionResult",
    "RunOutput",
    "available_methods",
    "build_method",
    "markdown_report",
    "run_benchmark",
    "write_report",
]
