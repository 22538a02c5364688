"""Which run an engine server serves: one at a time, bound on the run's first contact.

A run names itself with a `RunId`: `run`, an id kept in its run directory (the same across resumes; a fresh run in
the same directory gets a new one), `session`, new for each launch of the learner job and shared by its processes,
and `label` (host and run directory) for messages. The learner binds every server before it uses it
(`POST /v1/opdjax/bind`, or the `opdjax_bind` RPC of vLLM's server) and sends its session with every request
(`X-Opdjax-Session`) and every publish (the manifest's `session`).

`Lease` is the server's side. Binding succeeds when the server is free, already bound to this session, bound to an
earlier launch of the same run (a resume: that launch is gone, its run directory lock says so), idle for longer
than `idle_timeout` seconds, or when the caller takes it over on purpose (`sync.takeover=true`). Anything else is
refused in one line naming the run that holds the server. A new session starts the server's version order afresh:
its first publish may carry any version (the resumed run's checkpoint), later ones only go forward, and a rollout
server samples nothing for it until that first publish has been applied. A request or publish from another
session is refused: after a take-over, the displaced run's next call fails loudly.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import secrets
import threading
import time
from typing import Any, Callable

from opdjax.core.errors import InputError

log = logging.getLogger("opdjax.serve")

__all__ = ["DEFAULT_IDLE_TIMEOUT", "SESSION_HEADER", "Lease", "LeaseError", "RunId"]

SESSION_HEADER = "X-Opdjax-Session"
DEFAULT_IDLE_TIMEOUT = 900.0  # seconds without a call after which another run may bind the server
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class RunId:
    """A run as servers know it (see the module docstring); `takeover`: bind even a server another run holds."""

    run: str
    session: str
    label: str
    takeover: bool = False

    def __post_init__(self):
        for name in ("run", "session"):
            if not isinstance(getattr(self, name), str) or not _ID.match(getattr(self, name)):
                raise InputError(f"RunId.{name} must be 1-64 letters, digits, '-' or '_', got "
                                 f"{getattr(self, name)!r:.80}")

    @classmethod
    def fresh(cls, label: str, run: str | None = None, takeover: bool = False) -> "RunId":
        """A new session of `run` (a new run when None)."""
        return cls(run=run or secrets.token_hex(8), session=secrets.token_hex(8), label=str(label)[:200],
                   takeover=bool(takeover))

    def bind_body(self) -> dict[str, Any]:
        return {"run": self.run, "session": self.session, "label": self.label, "takeover": self.takeover}


class LeaseError(ValueError):
    """A call the lease refuses. kind: "held" (another run holds the server), "lost" (this session no longer does),
    "unbound" (nobody does: the server restarted or was released; bind again), "unpublished" (bound, but nothing
    published in this session yet)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass
class _Holder:
    run: str
    session: str
    label: str
    since: float   # wall clock, for messages
    seen: float    # monotonic clock of the last call


class Lease:
    """The server side (see the module docstring). `on_new_session()` runs whenever a new session binds (a
    rollout server restarts its version order there). Thread-safe."""

    def __init__(self, idle_timeout: float = DEFAULT_IDLE_TIMEOUT, on_new_session: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not float(idle_timeout) > 0:
            raise InputError(f"lease idle timeout must be > 0 seconds, got {idle_timeout!r}")
        self.idle_timeout, self.on_new_session, self.clock = float(idle_timeout), on_new_session, clock
        self.holder: _Holder | None = None
        self._lock = threading.Lock()

    def bind(self, body: dict[str, Any]) -> dict[str, Any]:
        """Bind the caller's run (a `RunId.bind_body`); LeaseError("held") naming the holder when refused.
        Returns {"run", "label", "new_session"}."""
        who = _run_id(body)
        with self._lock:
            h, now = self.holder, self.clock()
            if h is not None and h.session == who.session:
                h.seen = now
                return {"run": h.run, "label": h.label, "new_session": False}
            if h is not None and h.run != who.run and not who.takeover and now - h.seen < self.idle_timeout:
                raise LeaseError("held", f"this server serves run {self.describe()}; it is freed when that run ends, "
                                         f"after {self.idle_timeout:.0f} s without its calls, or by "
                                         f"sync.takeover=true")
            if h is not None:
                why = ("resumed" if h.run == who.run else "taken over" if now - h.seen < self.idle_timeout
                       else f"expired after {now - h.seen:.0f} s idle")
                log.warning("lease of run %s (%s) %s: now serving run %s (%s)", h.run, h.label, why, who.run, who.label)
            self.holder = _Holder(who.run, who.session, who.label, time.time(), now)
            if self.on_new_session is not None:
                self.on_new_session()
            log.info("bound to run %s (%s)", who.run, who.label)
            return {"run": who.run, "label": who.label, "new_session": True}

    def release(self, session: Any) -> bool:
        """Free the server if `session` holds it; whether it did."""
        with self._lock:
            if self.holder is None or self.holder.session != session:
                return False
            log.info("run %s (%s) released this server", self.holder.run, self.holder.label)
            self.holder = None
            return True

    def admit(self, session: str | None) -> None:
        """A request of `session` (None: a client that never bound): allowed while it holds the server, or while
        nobody does and it never bound; LeaseError otherwise."""
        with self._lock:
            h = self.holder
            if h is not None and h.session == session:
                h.seen = self.clock()
                return
            if h is not None:
                kind = "held" if session is None else "lost"
                raise LeaseError(kind, f"this server serves run {self.describe()}"
                                       + ("" if session is None else "; the calling run no longer holds it (taken "
                                                                     "over, or its lease expired)"))
            if session is not None:
                raise LeaseError("unbound", "this server is bound to no run (restarted or released): bind again")

    def describe(self) -> str:
        """The holder in words (for refusals), or "nobody"."""
        h = self.holder
        if h is None:
            return "nobody"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.since))
        return f"{h.run} ({h.label}, bound {since}, last call {self.clock() - h.seen:.0f} s ago)"

    def info(self) -> dict[str, Any] | None:
        """What /v1/opdjax/info shows of the holder (never its session)."""
        h = self.holder
        return None if h is None else {"run": h.run, "label": h.label, "since": h.since,
                                       "idle_s": round(self.clock() - h.seen, 1)}


def _run_id(body: Any) -> RunId:
    """The RunId of a bind request body; LeaseError("invalid") naming a bad field."""
    if not isinstance(body, dict):
        raise LeaseError("invalid", "a bind request is a JSON object with run, session, label and takeover")
    try:
        return RunId(run=body.get("run"), session=body.get("session"), label=str(body.get("label", ""))[:200],
                     takeover=body.get("takeover") is True)
    except InputError as e:
        raise LeaseError("invalid", str(e)) from None
