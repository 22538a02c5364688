"""Weights & Biases logging of a run (`pipeline.wandb`): the run's resolved config when it starts, each step's
numeric metrics at that step, summary.json as the W&B run's summary when it ends. Optional: `pip install
'opdjax[wandb]'`.

The run directory keeps the W&B run id in `wandb_id`: a resumed run (`pipeline.resume=true`) continues the same W&B
run, a fresh run starts a new one. W&B writes under `<pipeline.wandb.dir>/wandb` (default: the run directory, so an
offline run lies next to metrics.jsonl, as `wandb/offline-run-*`, for `wandb sync`).

Failing to start (wandb not installed, not logged in, a project the key cannot write) stops the run before its first
step, in one line. A failure while the run goes on (the W&B service gone) is said once, then W&B logging stops and
training continues: metrics.jsonl stays the run's record.
"""

from __future__ import annotations

import importlib.util
import pathlib
import secrets
from typing import Any, Callable, Mapping

import numpy as np

from opdjax.config import WandbConfig
from opdjax.core.errors import InputError
from opdjax.pipeline import rundir

__all__ = ["ID_FILE", "INSTALL_HINT", "WandbError", "WandbSink", "check_available", "init_kwargs", "numeric",
           "run_id", "wandb_dir"]

ID_FILE = "wandb_id"
INSTALL_HINT = "pip install 'opdjax[wandb]'"


class WandbError(InputError):
    """W&B logging was asked for and cannot start: wandb is not installed, or its run did not start."""


def check_available(settings: WandbConfig) -> None:
    """WandbError when W&B logging is on and the wandb package is not installed (checked without importing it)."""
    if settings.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise WandbError(f"pipeline.wandb.mode={settings.mode} needs the wandb package, which is not installed: "
                         f"{INSTALL_HINT} (or pipeline.wandb.mode=disabled)")


def wandb_dir(settings: WandbConfig, out_dir: str | pathlib.Path) -> pathlib.Path:
    """The directory W&B is given (it writes under `<it>/wandb`): `settings.dir`, or the run directory."""
    return pathlib.Path(settings.dir or out_dir)


def run_id(out_dir: str | pathlib.Path, resume: bool) -> str:
    """The W&B run id of the run in `out_dir`: the one kept in `<out_dir>/wandb_id` when resuming (and there is one),
    else a new one, kept there."""
    path = pathlib.Path(out_dir) / ID_FILE
    if resume:
        try:
            kept = path.read_text().strip()
        except OSError:
            kept = ""
        if kept:
            return kept
    new = secrets.token_hex(6)  # lower-case letters and digits: a valid W&B run id
    rundir.write_text(path, new + "\n")
    return new


def init_kwargs(settings: WandbConfig, out_dir: str | pathlib.Path, config: Mapping[str, Any],
                wandb_id: str) -> dict[str, Any]:
    """The keyword arguments of `wandb.init` for a run in `out_dir` (empty settings left to W&B's defaults; the name
    defaults to the run directory's)."""
    return {"mode": settings.mode, "project": settings.project or None, "entity": settings.entity or None,
            "name": settings.name or pathlib.Path(out_dir).resolve().name, "group": settings.group or None,
            "tags": list(settings.tags) or None, "dir": str(wandb_dir(settings, out_dir)), "config": dict(config),
            "id": wandb_id, "resume": "allow"}


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics W&B charts: numbers (numpy scalars and bools included) as floats. NaN and infinities are kept
    (W&B records them; a chart leaves a gap), as metrics.jsonl keeps them; anything else stays in metrics.jsonl."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.integer, np.floating, np.bool_))}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class WandbSink:
    """One W&B run for one training run: started here, fed by `log`, ended by `finish` (with the summary)."""

    def __init__(self, settings: WandbConfig, out_dir: str | pathlib.Path, config: Mapping[str, Any], resume: bool,
                 say: Callable[[str], None] = print):
        check_available(settings)
        import wandb  # optional (pipeline.wandb); checked above

        self.say = say
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
        kwargs = init_kwargs(settings, out_dir, config, run_id(out_dir, resume))
        pathlib.Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:  # wandb's own errors (not logged in, no such entity, no network) and its service's
            raise WandbError(f"W&B could not start the run (pipeline.wandb.mode={settings.mode}): {_first_line(e)}; "
                             "check `wandb login` and pipeline.wandb.project/entity, or log without a network with "
                             "pipeline.wandb.mode=offline") from None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The step's numeric metrics at `step`."""
        self._guarded("log a step", lambda: self.run.log(numeric(metrics), step=step))

    def finish(self, summary: Mapping[str, Any] | None = None, failed: bool = False) -> None:
        """End the W&B run: `summary` (summary.json's content) as its summary; marked failed when the run failed."""
        if summary:
            self._guarded("set the summary", lambda: self.run.summary.update(dict(summary)))
        self._guarded("finish", lambda: self.run.finish(exit_code=1 if failed else 0))
        self.run = None

    def _guarded(self, what: str, call: Callable[[], Any]) -> None:
        """Run `call`; a failure is said once and ends W&B logging for this run (training goes on)."""
        if self.run is None:
            return
        try:
            call()
        except Exception as e:  # W&B must never stop a training run once it started
            self.say(f"WARNING: W&B failed to {what} ({_first_line(e)}); W&B logging stops here, metrics.jsonl "
                     "goes on")
            self.run = None

