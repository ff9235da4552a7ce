"""The benchmarks' own modules (experiments/benchmarks/, no part of the package), loaded from their files."""

import importlib.util
import os

BENCHMARKS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments", "benchmarks"
)


def load_benchmark_module(name: str):
    """experiments/benchmarks/<name>.py as a module named benchmark_<name>."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
