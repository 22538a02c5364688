"""Benchmarks are scripts, not a package: tests import one by name from benchmarks/."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    """The module benchmarks/<name>.py, executed once per call."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a dataclass resolves its string annotations through its module
    spec.loader.exec_module(mod)
    return mod
