"""Run metrics: JSONL always, TensorBoard when tensorboardX is installed, Weights & Biases when `pipeline.wandb` asks
(`pipeline.wandb_sink`); only process 0 writes.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Mapping

import jax
import numpy as np

from opdjax.config import WandbConfig
from opdjax.learner.distributed import agree
from opdjax.pipeline.wandb_sink import WandbError, WandbSink

__all__ = ["MetricsLogger"]


def _start_wandb(active: bool, settings: WandbConfig, out_dir: pathlib.Path, config: Mapping[str, Any],
                 resume: bool, say: Callable[[str], None]) -> WandbSink | None:
    """Process 0's W&B run (None elsewhere); every process raises when it could not start, so none waits for it."""
    sink, problem = None, None
    if active:
        try:
            sink = WandbSink(settings, out_dir, config, resume, say)
        except WandbError as e:
            problem = e
    if agree(problem is not None):
        raise problem or WandbError("learner process 0 could not start its W&B run (see its message)")
    return sink


class MetricsLogger:
    """JSONL (always), TensorBoard (when tensorboardX is importable), W&B (`wandb` settings with a mode other than
    disabled: the run's `config` when it starts, the summary given to `finish`), process 0 only."""

    def __init__(self, out_dir: pathlib.Path, tensorboard: bool, resume: bool, wandb: WandbConfig | None = None,
                 config: Mapping[str, Any] | None = None, say: Callable[[str], None] = print):
        self.active = jax.process_index() == 0
        self.tb = self.wandb = None
        if wandb is not None and wandb.mode != "disabled":  # first: a W&B run that cannot start stops before any write
            self.wandb = _start_wandb(self.active, wandb, out_dir, config or {}, resume, say)
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
        try:
            self.f.write(json.dumps({"step": step, **clean}) + "\n")
            self.f.flush()
        except OSError as e:  # a full disk: the one-line report names the file (steps before it are intact)
            e.filename = e.filename or self.f.name
            raise
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and np.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(step, clean)

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The run ended well: its summary (summary.json's content) goes to W&B, which ends its run."""
        if self.wandb is not None:
            self.wandb.finish(summary)
            self.wandb = None

    def close(self, failed: bool = False):
        """Close every writer; a W&B run still open (no `finish`: the run stopped early) is marked `failed` or not."""
        if self.active:
            self.f.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish(failed=failed)
                self.wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)
