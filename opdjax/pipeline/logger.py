"""Run metrics: JSONL always, TensorBoard when tensorboardX is installed; only process 0 writes.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """JSONL (always), TensorBoard (when tensorboardX is importable), process 0 only."""

    def __init__(self, out_dir: pathlib.Path, tensorboard: bool, resume: bool):
        self.active = jax.process_index() == 0
        self.tb = None
        if not self.active:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.f = open(out_dir / "metrics.jsonl", "a" if resume else "w")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:
                self.tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        clean = {k: (float(v) if isinstance(v, (float, int, np.floating, np.integer)) else v)
                 for k, v in metrics.items()}
        self.f.write(json.dumps({"step": step, **clean}) + "\n")
        self.f.flush()
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and np.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.active:
            self.f.close()
            if self.tb is not None:
                self.tb.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
