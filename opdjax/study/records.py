"""Typed records of the study.

    Point         one study configuration (a sweep point or a phenomena run)
    RunResult     one (point, seed) of a study: probe, training summary, per-step mismatch, time-to-quality
                  against the study's baseline — the resume record `results/<point>/seed<k>.json`

Both derive from `opdjax.admission.records.Record` (to_dict / from_dict) and are written by its `write_json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from opdjax.admission.records import Record
from opdjax.config import deep_update

__all__ = ["Point", "RunResult", "noise_point"]


@dataclasses.dataclass(frozen=True)
class Point(Record):
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
class RunResult(Record):
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
    eval_curve: list | None = None               # [[step, held-out reverse KL, accuracy, training seconds], ...]
    to_quality: dict | None = None               # time-/steps-to-quality and AUC against the study's baseline
    reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("reused")  # a property of this invocation, not of the run
        if d["reward_last"] is None:
            d.pop("reward_last")
        return d
