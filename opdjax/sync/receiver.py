"""The engine side of the bridge: validate a publish completely, then apply it, all or nothing.

`WeightReceiver(target, spec)` guards one engine. `receive(manifest, arrays)` (or `receive_payload(manifest,
buffer)` for byte transports) runs, in order and before the engine is touched:

  1. `manifest.validate` against the engine's `ModelSpec` (names, shapes, dtypes, scales, payload tiling);
  2. every array against its entry (shape, dtype, byte length) and its CRC-32 when the manifest carries one
     (spread over a few threads, `manifest.checksum_many`; skipped only when the transport says it has already
     compared every tensor's CRC-32 with the manifest as the bytes arrived: `receive_payload(..., verified=True)`);
  3. FP8 weights dequantized (`opdjax.quant.dequantize`, the simulation's dequantizer) to the engine's dtype
     unless the target takes FP8 weights itself (`target.accepts_fp8`, a GPU engine with quantization="fp8").

Only then does it call `target.apply_weights(named_iterable, version)` (vLLM: `reload_weights` + reset of the
prefix cache). Any refusal raises `BridgeError` naming the problem and the version still served, and is logged
(logger "opdjax.bridge") and kept in `receiver.refusals`. Receives are serialised by a lock.

A target is anything with `version` (int) and `apply_weights(named, version)`; `ArrayTarget` is a plain in-memory
one (tests, and a receiver double where no engine is needed). The arrays handed to `apply_weights` may be views of
a transport's buffer (a shared-memory region the learner reuses for a later version): a target copies what it
keeps (vLLM's reload_weights copies into its parameters) and holds no reference once `apply_weights` returns.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from opdjax import quant
from opdjax.sync.manifest import BridgeError, Manifest, ModelSpec, checksum_many, np_dtype, validate

log = logging.getLogger("opdjax.bridge")

__all__ = ["ArrayTarget", "WeightReceiver", "payload_views"]


def payload_views(manifest: Manifest, payload: Any) -> list[np.ndarray]:
    """Zero-copy numpy views of each entry in a payload buffer (bytes, memoryview, memmap, uint8 array)."""
    buf = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload.reshape(-1)
    if buf.dtype != np.uint8:
        buf = buf.view(np.uint8)
    total = manifest.total_bytes
    if buf.size < total:
        raise BridgeError(f"manifest v{manifest.version}: truncated payload, {buf.size} of {total} bytes")
    if buf.size > total:
        raise BridgeError(f"manifest v{manifest.version}: payload has {buf.size} bytes, manifest declares {total}")
    return [buf[e.offset:e.offset + e.nbytes].view(np_dtype(e.dtype)).reshape(e.shape) for e in manifest.entries]


class ArrayTarget:
    """A minimal target: keeps the last applied weights as host numpy arrays (the receiver double of tests)."""

    accepts_fp8 = False

    def __init__(self, version: int = 0, weights: dict[str, np.ndarray] | None = None):
        self.version = int(version)
        self.weights = dict(weights or {})
        self.applied: list[int] = []

    def apply_weights(self, named: Iterable[tuple[str, Any]], version: int) -> None:
        self.weights = {n: np.array(a) for n, a in named}
        self.version = int(version)
        self.applied.append(int(version))


class WeightReceiver:
    """Validates and applies publishes to one target (see the module docstring)."""

    def __init__(self, target, spec: ModelSpec, *, verify_checksums: bool = True, name: str = "engine"):
        self.target = target
        self.spec = spec
        self.verify_checksums = bool(verify_checksums)
        self.name = name
        self.refusals: list[str] = []
        self.gate: Callable[[Manifest], None] | None = None  # a server's run lease: raises BridgeError to refuse
        self._received: int | None = None
        self._fresh = False  # a new run session began: its first publish may carry any version
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The version the target serves (an engine serving stale weights serves an older one than it holds)."""
        return int(self.target.version)

    @property
    def received_version(self) -> int:
        """The newest version this receiver has applied (or the served one, before any); -1 after `restart_order`
        until the next publish is applied."""
        if self._fresh:
            return -1
        return self.version if self._received is None else max(self._received, self.version)

    def restart_order(self) -> None:
        """A new run session binds the server: its first publish may carry any version, later ones go forward."""
        with self._lock:
            self._fresh = True

    def refuse(self, message: str, cause: BaseException | None = None) -> BridgeError:
        """Log and record a refusal; returns the BridgeError to raise."""
        if "keeps serving" not in message:
            message = f"{message}; {self.name} keeps serving v{self.version}"
        self.refusals.append(message)
        log.warning("weight update refused: %s", message)
        err = BridgeError(message)
        err.__cause__ = cause
        return err

    def check(self, manifest: Manifest) -> None:
        """Validate a manifest against the spec only (transports call this before moving any payload)."""
        if manifest.version < 0:
            raise self.refuse(f"manifest v{manifest.version} rejected: a weight version is a non-negative integer")
        if self.gate is not None:
            if manifest.rewind:
                raise self.refuse(f"manifest v{manifest.version} rejected: a server bound to a run takes no rewind; "
                                  f"a resumed run binds a new session, whose first publish may carry any version")
            try:
                self.gate(manifest)
            except BridgeError as e:
                raise self.refuse(f"manifest v{manifest.version} rejected: {e}") from None
        if manifest.version < self.received_version and not manifest.rewind:
            raise self.refuse(f"manifest v{manifest.version} rejected: versions only go forward (this engine has "
                              f"received v{self.received_version})")
        try:
            validate(manifest, self.spec, served_version=self.version)
        except BridgeError as e:
            raise self.refuse(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a field of a type no check anticipated: still a refusal, named
            raise self.refuse(f"manifest v{manifest.version} rejected: malformed ({type(e).__name__}: {e})") from None

    def receive_payload(self, manifest: Manifest, payload: Any, *, verified: bool = False) -> None:
        """Apply a publish whose tensors lie back to back in one buffer (file snapshot, TCP).

        verified: the transport has already compared every entry's CRC-32 with the bytes in `payload` (the TCP
        receiver does, as they arrive), so they are not computed a second time.
        """
        with self._lock:
            self.check(manifest)
            try:
                arrays = payload_views(manifest, payload)
            except BridgeError as e:
                raise self.refuse(str(e)) from None
            self._apply(manifest, arrays, verified=verified)

    def receive(self, manifest: Manifest, arrays: Sequence[Any]) -> None:
        """Apply a publish given as one array per manifest entry (in-process)."""
        with self._lock:
            self.check(manifest)
            self._apply(manifest, arrays)

    def _apply(self, manifest: Manifest, arrays: Sequence[Any], *, verified: bool = False) -> None:
        v = manifest.version
        if len(arrays) != len(manifest.entries):
            raise self.refuse(f"v{v}: {len(arrays)} arrays for {len(manifest.entries)} manifest entries")
        for e, a in zip(manifest.entries, arrays):
            if tuple(np.shape(a)) != tuple(e.shape) or np.dtype(a.dtype) != np_dtype(e.dtype):
                raise self.refuse(f"v{v}: tensor {e.name!r} arrived as {np.dtype(a.dtype)}{list(np.shape(a))}, "
                                  f"manifest says {e.dtype}{list(e.shape)}")
        if self.verify_checksums and not verified:
            checked = [(e, a) for e, a in zip(manifest.entries, arrays) if e.crc32 is not None]
            for (e, _), got in zip(checked, checksum_many(np.asarray(a) for _, a in checked)):
                if got != e.crc32:
                    raise self.refuse(f"v{v}: checksum mismatch on tensor {e.name!r} (crc32 {got:08x}, manifest "
                                      f"{e.crc32:08x}): corrupt transfer")
        named = self._named(manifest, arrays)
        try:
            self.target.apply_weights(named, v)
        except BridgeError as e:
            raise self.refuse(str(e)) from None
        except Exception as e:  # the target promises all-or-nothing; report what failed
            raise self.refuse(f"v{v}: applying the update failed ({type(e).__name__}: {e})", e) from e
        self._received, self._fresh = v, False
        log.info("%s now serves weight version %d (%d tensors, %.1f MB)", self.name, v, len(arrays),
                 manifest.total_bytes / 1e6)

    def _named(self, manifest: Manifest, arrays: Sequence[Any]) -> list[tuple[str, Any]]:
        by_name = {e.name: (e, a) for e, a in zip(manifest.entries, arrays)}
        fp8_ok = bool(getattr(self.target, "accepts_fp8", False))
        out = []
        for e, a in zip(manifest.entries, arrays):
            if e.scale_of is not None:
                if fp8_ok:
                    out.append((e.name, a))
                continue
            if e.quant is None or fp8_ok:
                out.append((e.name, a))
                continue

            _, s = by_name[e.name + "_scale"]
            block = tuple(e.quant["block"]) if e.quant.get("granularity") == "block" else None
            out.append((e.name, quant.dequantize(np.asarray(a), np.asarray(s), np_dtype(self.spec.dtype),
                                                 block=block)))
        return out
