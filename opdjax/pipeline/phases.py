"""Wall time of a step's phases, under the metric names the runs log (`time/generate`, `time/wait`, ...)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

__all__ = ["Phases"]


class Phases:
    """`with phases.time("wait"): ...` records the block's wall seconds as `phases.seconds["time/wait"]` (a phase timed
    again replaces its earlier figure; a block that raises records nothing)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block as `time/<name>`."""
        t0 = time.perf_counter()
        yield
        self.seconds[f"time/{name}"] = time.perf_counter() - t0
