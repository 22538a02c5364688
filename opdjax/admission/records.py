"""Typed records of the admission check, and the one JSON serialisation of every opdjax record.

    ProbeResult   one probe of an engine configuration: M with its bootstrap CI (`probe.probe`, behind `admit`,
                  `measure`, the study and the recipe search)
    AdmitRow      one candidate's admission verdict (`admit.admit`; `admit --out` writes them)

Every record is a frozen dataclass derived from `Record`: `to_dict()` (the on-disk form, JSON-ready) and
`from_dict()` (which reads what this and earlier versions wrote: unknown keys are kept aside, missing optional keys
take their defaults). `write_json` is the one writer (atomic replace); the study's records (`opdjax.study.records`)
use both.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping

import numpy as np

from opdjax.admission.budget import AdmissionError
from opdjax.pipeline.rundir import write_text

__all__ = ["AdmitRow", "ProbeResult", "Record", "json_default", "read_list", "write_json"]


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


def read_list(path: str | pathlib.Path, what: str, key: str, *, required: bool = True) -> list:
    """The list under `key` of the JSON report at `path` (a study's budget.json `points`, `admit --out`'s
    `candidates`, `bench --out`'s `rows`). AdmissionError naming `what` and the file when it cannot be read as
    JSON, or (`required`) when `key` is missing or not a list; not `required`: [] then."""
    p = pathlib.Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise AdmissionError(f"{what} {p}: cannot read it as JSON ({type(e).__name__}: {e})") from None
    rows = d.get(key) if isinstance(d, dict) else None
    if isinstance(rows, list):
        return rows
    if not required:
        return []
    found = f"got {type(rows).__name__}" if rows is not None else "found none"
    raise AdmissionError(f"{what} {p}: expected a list under {key!r}, {found}")


class Record:
    """to_dict / from_dict for a frozen dataclass record (the ones below, and the study's `opdjax.study.records`)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class ProbeResult(Record):
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
class AdmitRow(Record):
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
    budget_interval: list | None = None  # B's interval [B_lo, B_hi] the verdict was decided against (None: point B)
    training: str = ""    # the M training would see, where the study trained this kind (`admit.training_view`)
    budget_kind: str = "weight_noise"  # whose B judged it: its own kind's, or the envelope's (`Budget.for_kind`)
