"""Wall time of a step's phases, under the metric names the runs log (`time/generate`, `time/wait`, ...), and the
run's cumulative clocks (`time/elapsed_train`, `time/elapsed_eval`)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

__all__ = ["Phases", "RunClock"]


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


class RunClock:
    """A run's cumulative wall clock, training and evaluation apart, continued from a checkpoint's figures:

        elapsed_eval  = eval0 + Σ seconds inside `evaluating()` blocks since construction
        elapsed_train = train0 + (now - constructed) - (evaluation seconds since construction)

    Everything after construction that is not an evaluation counts as training (waiting for rollouts, scoring, the
    update, publishing, checkpoints)."""

    def __init__(self, train: float = 0.0, eval: float = 0.0) -> None:
        self.train0, self.eval0, self.eval_here = float(train), float(eval), 0.0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Count the block as evaluation (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.eval_here += time.perf_counter() - t0

    def state(self) -> dict[str, float]:
        """{"train": elapsed_train, "eval": elapsed_eval} in seconds: what a checkpoint keeps."""
        here = time.perf_counter() - self.started
        return {"train": self.train0 + here - self.eval_here, "eval": self.eval0 + self.eval_here}

    def seconds(self) -> dict[str, float]:
        """The metrics `time/elapsed_train` and `time/elapsed_eval`."""
        s = self.state()
        return {"time/elapsed_train": s["train"], "time/elapsed_eval": s["eval"]}
