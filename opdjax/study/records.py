"""Typed records of the budget workflow, and their one JSON serialisation.

    ProbeResult   one probe of an engine configuration: M with its bootstrap CI (`probe.probe`, behind `admit`,
                  `measure`, the study and the recipe search)
    AdmitRow      one candidate's admission verdict (`admit.admit`; `admit --out` writes them)
    Point         one study configuration (a sweep point or a phenomena run)
    RunResult     one (point, seed) of a study: probe, training summary, per-step mismatch — the resume record
                  `results/<point>/seed<k>.json`

Every record is a frozen dataclass with `to_dict()` (the on-disk form, JSON-ready) and `from_dict()` (which reads
what this and earlier versions wrote: unknown keys are kept aside, missing optional keys take their defaults).
`write_json` is the one writer (atomic replace).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping

import numpy as np

from opdjax.config import deep_update
from opdjax.pipeline.rundir import write_text

__all__ = ["AdmitRow", "Point", "noise_point", "ProbeResult", "RunResult", "json_default", "write_json"]


def json_default(x: Any) -> Any:
    """JSON encoding of NumPy scalars and tuples."""
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def write_json(path: str | pathlib.Path, obj: Any) -> None:
    """Write `obj` (a record's `to_dict()` or plain data) as indented JSON, atomically (tmp file + replace)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(obj, indent=2, default=json_default) + "\n")


class _Record:
    """to_dict / from_dict for the frozen dataclasses below."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class ProbeResult(_Record):
    """M = the `metric` over all probe tokens, [ci_low, ci_high] its 95% bootstrap CI over sequences (the fixed
    probe) or its last look's bounds (the sequential probe), every `mismatch.metrics` key in `metrics`;
    staleness = learner version - the version the engine sampled with."""

    metric: str
    m: float
    ci_low: float
    ci_high: float
    metrics: dict[str, float]
    seconds: float
    tokens: int
    staleness: int = 0
    batches: int = 0      # batches sampled (the sequential probe stops early)
    reason: str = ""      # the sequential probe: why it stopped (M, bounds, B, batches)


@dataclasses.dataclass(frozen=True)
class AdmitRow(_Record):
    """One candidate (a comma-separated override string) judged against the budget: [ci_low, ci_high] are the
    sequential probe's bounds when it stopped."""

    candidate: str
    overrides: list[str]
    metric: str
    m: float
    ci_low: float
    ci_high: float
    budget: float
    verdict: str
    seconds: float
    tokens: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    batches: int = 0      # probe batches this candidate needed
    risk: float = 0.05    # the sequential probe's risk: P(false ADMIT), P(false REJECT) each below it
    reason: str = ""      # one line: why this verdict


@dataclasses.dataclass(frozen=True)
class Point(_Record):
    """One configuration to train: `group` sweep (enters the budget fit) | rl | correction."""

    group: str
    knob: str            # baseline | weight_noise | staleness | recipe
    value: Any
    overrides: Mapping[str, Any]
    probe: bool = True   # measure m_probe (sweep points)
    label: str = ""

    @property
    def id(self) -> str:
        v = str(self.value).replace("/", "_").replace(os.sep, "_")
        head = "" if self.group == "sweep" else f"{self.label}__"
        return head + ("baseline" if self.knob == "baseline" else f"{self.knob}={v}")


def noise_point(sigma: float, group: str = "sweep", extra: Mapping | None = None, probe: bool = True,
                 label: str = "") -> Point:
    """The point of relative weight noise `sigma` (sigma 0: the group's baseline) on top of `extra` overrides."""
    over = {"rollout": {"weight_noise": float(sigma)}}
    if extra:
        over = deep_update(json.loads(json.dumps(dict(extra))), over)
    if sigma == 0:
        return Point(group, "baseline", 0, over, probe, label)
    return Point(group, "weight_noise", float(sigma), over, probe, label)


@dataclasses.dataclass(frozen=True)
class RunResult(_Record):
    """One (point, seed) of a study. m_train_* are means of the per-step `mismatch/<key>`; nonfinite_steps counts
    steps with a NaN/inf loss or grad norm; reward_last (RL runs) is the mean reward over the last 10% of steps."""

    point: str
    group: str
    knob: str
    value: Any
    label: str
    seed: int
    metric: str
    probe_batches: int
    m_probe: float | None
    m_probe_ci: list[float] | None
    probe_metrics: dict[str, float] | None
    probe_tokens: int | None
    reverse_kl: float
    accuracy: float
    initial_reverse_kl: float
    initial_accuracy: float
    probe_seconds: float
    train_seconds: float
    steps: int
    m_train_k3: float
    m_train_k1: float
    m_train_abs_log_ratio_p95: float
    nonfinite_steps: int
    teacher_kl_last: float
    run_dir: str
    train_config: dict[str, Any]
    finished: str
    reward_last: float | None = None
    policy_step_k3_median: float | None = None   # the student's median movement per step (k3, consecutive versions)
    eval_curve: list | None = None               # [[step, held-out reverse KL, accuracy], ...]
    reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("reused")  # a property of this invocation, not of the run
        if d["reward_last"] is None:
            d.pop("reward_last")
        return d
