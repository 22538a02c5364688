"""Links: the transport a run publishes through, chosen by name (`sync.transport`), with its engine-side end.

    inproc  the engine's `WeightReceiver` in this process: arrays handed over, no copy, no checksums
    shm     `SnapshotTransport` into a shared-memory directory + a `SnapshotWatcher` applying each snapshot
    tcp     `TcpTransport` to a `TcpReceiverServer` (127.0.0.1, a fresh random token)

`open_link(kind, receiver)` builds the engine-side end for an engine in this process (a run whose engine is
local but which exercises the same bytes-on-the-wire path a remote engine would). Every link's `send` returns
only once the engine has applied the version (the watcher is polled synchronously; the TCP server answers after
applying), so the synchronous loop's rule — no rollout before the engine serves the new version — holds for all.
A link owns what it opened (sockets, the snapshot directory); `close()` releases it.
"""

from __future__ import annotations

import pathlib
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from opdjax.sync.manifest import BridgeError, Manifest, np_dtype
from opdjax.sync.publisher import Publisher
from opdjax.sync.receiver import WeightReceiver
from opdjax.sync.tcp import TcpReceiverServer, TcpTransport
from opdjax.sync.transports import (
    InProcessTransport,
    SnapshotTransport,
    SnapshotWatcher,
    default_snapshot_root,
)

__all__ = ["TRANSPORTS", "Link", "open_link"]

TRANSPORTS = ("inproc", "shm", "tcp")


class Link:
    """A learner-side transport plus the local engine-side endpoint it talks to (see the module docstring)."""

    def __init__(self, kind: str, transport: Any, *, watcher: SnapshotWatcher | None = None,
                 server: TcpReceiverServer | None = None, owned_dir: pathlib.Path | None = None):
        self.kind = kind
        self.transport = transport
        self.needs_checksums = getattr(transport, "needs_checksums", True)
        self._watcher, self._server, self._owned_dir = watcher, server, owned_dir

    def send(self, manifest: Manifest, arrays: Sequence[Any]) -> None:
        self.transport.send(manifest, arrays)
        if self._watcher is not None:
            applied = self._watcher.poll()
            if applied != manifest.version:
                raise BridgeError(f"shm link: snapshot v{manifest.version} was written but the engine applied "
                                  f"{applied!r} (it serves v{self._watcher.receiver.version})")

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if isinstance(self.transport, SnapshotTransport):
            self.transport.close()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None


def open_link(kind: str, receiver: WeightReceiver, *, root: str | pathlib.Path | None = None,
              timeout: float = 60.0) -> Link:
    """A `Link` of `kind` (one of TRANSPORTS) to `receiver` in this process.

    root: the shm snapshot directory (None: a fresh directory under /dev/shm, removed on close).
    timeout: seconds a TCP publish may take before it fails (the engine then keeps its version).
    """
    if kind == "inproc":
        return Link(kind, InProcessTransport(receiver))
    if kind == "shm":
        owned = None
        if root is None or str(root) == "":
            owned = root = pathlib.Path(tempfile.mkdtemp(prefix="opdjax-sync-", dir=default_snapshot_root().parent))
        transport = SnapshotTransport(root)
        return Link(kind, transport, watcher=SnapshotWatcher(root, receiver), owned_dir=owned)
    if kind == "tcp":
        token = secrets.token_hex(32)
        server = TcpReceiverServer(receiver, token, timeout=timeout).start()
        return Link(kind, TcpTransport(server.host, server.port, token, timeout=timeout), server=server)
    raise ValueError(f"sync.transport={kind!r}: valid transports are {', '.join(TRANSPORTS)}")


def engine_publisher(engine, cfg, *, transport: str = "inproc", root: str | pathlib.Path | None = None,
                     timeout: float = 60.0):
    """(Publisher, Link) feeding `engine` the learner's params as HF-named tensors in the engine's dtype. An engine in
    this process (one with a `receiver`) is fed through a new link of kind `transport`; a remote engine (one with its
    own `link` to its servers' bridges, `remote.RemoteEngine`) through that link, by process 0 only. Close the link
    when done."""
    if getattr(engine, "link", None) is not None:
        return Publisher(cfg, engine.link, dtype=np_dtype(engine.spec.dtype)), engine.link
    receiver = engine.receiver
    link = open_link(transport, receiver, root=root, timeout=timeout)
    return Publisher(cfg, link, dtype=np_dtype(receiver.spec.dtype), every_process=True), link
