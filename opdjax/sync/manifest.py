"""Weight manifests: what one publish carries, and the engine-side spec it is validated against.

A publish of version v is a manifest plus one payload: the tensors' bytes, back to back, in manifest order
(layer order, HF names and HF layout: Linear weights [out, in]). Each entry names its tensor, shape, dtype
(safetensors dtype names: "F32", "BF16", "F8_E4M3", ...), byte offset and size in the payload and a CRC-32 of its
bytes (None when the transport cannot corrupt or truncate, i.e. in-process). CRC-32 is zlib's; the bridge computes
it with the system's libdeflate where there is one (PCLMULQDQ, several times faster, the same values) and spreads
big lists over a few threads (`checksum_many`); `set_checksum_options(backend="zlib", threads=...)` forces zlib or
fixes the thread count for the whole process.

Pre-quantized FP8 weights (made by `opdjax.quant.quantize_named`, the same quantizer the simulation uses) travel
as two entries: the weight `<module>.weight` in the FP8 storage dtype with `quant = {fmt, granularity, block}`
(block in HF layout, i.e. (bn, bm) of the simulation's (bm, bn)), and its float32 scale `<module>.weight_scale`
(`scale_of` = the weight's name; HF layout: a channel scale is [out, 1], a block scale [ceil(out/bn),
ceil(in/bm)]).

`ModelSpec` is what the receiving engine serves: every HF tensor name of its model with its shape and the dtype it
accepts. `validate` compares a manifest with a spec and raises one `BridgeError` listing every problem, before any
byte of the payload is looked at.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import json
import math
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import numpy as np
from flax import nnx

from opdjax.core.errors import InputError
from opdjax.models import decoder, hf
from opdjax.models.safetensors_io import DTYPES

FORMAT = "opdjax-bridge/1"
FP8_DTYPES = {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2", "int8": "I8"}
_NAMES = {v: k for k, v in DTYPES.items()}


class BridgeError(InputError):
    """A weight update that was refused (bad manifest, corrupt or truncated payload, bad token, ...)."""


def dtype_name(dtype: Any) -> str:
    """numpy/JAX/ml_dtypes dtype or "bfloat16"-style string -> safetensors dtype name ("BF16")."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = np.dtype(getattr(dtype, "dtype", dtype))
    if d not in _NAMES:
        raise BridgeError(f"dtype {dtype!r} cannot travel over the bridge; supported: {sorted(DTYPES)}")
    return _NAMES[d]


def np_dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise BridgeError(f"unknown dtype {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def _u8(buf: Any) -> Any:
    """A flat uint8 view of a numpy array (copied only if not contiguous); other buffers as they are."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return buf


CRC_BACKENDS = ("auto", "zlib", "libdeflate")


@dataclasses.dataclass(frozen=True)
class ChecksumOptions:
    """How the bridge computes CRC-32s, process-wide (`set_checksum_options`).

    backend: "auto" (libdeflate where the system has it, else zlib), "zlib", or "libdeflate" (required).
    threads: threads `checksum_many` uses; None = the CPUs this process may run on, at most 8.
    """

    backend: str = "auto"
    threads: int | None = None


_options = ChecksumOptions()


def checksum_options() -> ChecksumOptions:
    """The CRC-32 options in effect."""
    return _options


def set_checksum_options(backend: str = "auto", threads: int | None = None) -> ChecksumOptions:
    """Set how this process computes bridge CRC-32s (`ChecksumOptions`; an argument left out takes its default);
    returns the previous options, so `set_checksum_options(**dataclasses.asdict(old))` restores them.

    ValueError for an unknown backend, threads < 1, or backend="libdeflate" where the system has none.
    """
    global _options
    if backend not in CRC_BACKENDS:
        raise ValueError(f"unknown CRC-32 backend {backend!r}; valid: {list(CRC_BACKENDS)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, (int, np.integer))
                                or threads < 1):
        raise ValueError(f"checksum threads must be a positive int or None, got {threads!r}")
    if backend == "libdeflate" and _libdeflate_crc32() is None:
        raise ValueError("CRC-32 backend 'libdeflate' requested, but this system has no usable libdeflate")
    old, _options = _options, ChecksumOptions(backend=backend, threads=None if threads is None else int(threads))
    return old


@functools.cache
def _libdeflate_crc32():
    """libdeflate's CRC-32 (PCLMULQDQ-accelerated; the same function as zlib.crc32), or None where the system has
    no libdeflate. Checked against zlib before use; ctypes releases the GIL."""
    for name in ("libdeflate.so.0", ctypes.util.find_library("deflate")):
        try:
            fn = ctypes.CDLL(name).libdeflate_crc32 if name else None
        except (OSError, AttributeError):
            fn = None
        if fn is not None:
            break
    else:
        return None
    fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    probe = np.frombuffer(bytes(range(256)) * 1031, np.uint8)
    if fn(12345, probe.ctypes.data, probe.nbytes) != zlib.crc32(probe, 12345):
        return None
    return fn


def _fast_crc32():
    """The libdeflate CRC-32 to use under the current options, or None for zlib."""
    return None if _options.backend == "zlib" else _libdeflate_crc32()


def crc32_impl() -> str:
    """Which CRC-32 implementation the bridge uses: "libdeflate" or "zlib"."""
    return "zlib" if _fast_crc32() is None else "libdeflate"


_FAST_MIN = 16 << 10  # below this, zlib's call overhead is the smaller one


def crc32(buf: Any, value: int = 0) -> int:
    """zlib.crc32(buf, value) of a contiguous buffer, through libdeflate when the system has it and the options allow
    it (same values)."""
    fn = _fast_crc32()
    if fn is not None:
        a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        if a.nbytes >= _FAST_MIN and a.flags.c_contiguous:
            return fn(value, a.ctypes.data, a.nbytes)
    return zlib.crc32(buf, value) & 0xFFFFFFFF


def checksum(buf: Any) -> int:
    """CRC-32 of a contiguous buffer (numpy array, bytes, memoryview)."""
    return crc32(_u8(buf))


# CRC-32 of a concatenation from the CRC-32s of its parts (zlib's crc32_combine, which Python does not expose):
# crc(A || B) = (x^(8 |B|) * crc(A)) mod P  xor  crc(B), in the reflected bit order of zlib's CRC-32.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b mod P (reflected CRC-32 polynomials; a != 0)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) mod P for k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=256)
def _x8nmodp(n: int) -> int:
    """x^(8 n) mod P: the operator that shifts a CRC past n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A || B from crc1 = CRC-32(A), crc2 = CRC-32(B) and len2 = len(B) (zlib.crc32_combine)."""
    if len2 <= 0:
        return crc1
    return (_multmodp(_x8nmodp(int(len2)), crc1) if crc1 else 0) ^ crc2


PIECE = 16 << 20  # checksum_many() splits buffers into pieces of this size so that threads share big tensors
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def checksum_threads() -> int:
    """Threads `checksum_many` uses: `checksum_options().threads`, else the CPUs this process may run on (at most
    8)."""
    if _options.threads is not None:
        return _options.threads
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def checksum_many(bufs: Iterable[Any]) -> list[int]:
    """CRC-32 of each buffer, spread over `checksum_threads()` threads (zlib releases the GIL on large buffers).

    Buffers are cut into pieces of at most PIECE bytes, the pieces shared out in byte-balanced contiguous runs (the
    calling thread takes one run), and each buffer's CRC is combined from its pieces' (`crc32_combine`); the result
    equals `[checksum(b) for b in bufs]`.
    """
    views = [memoryview(_u8(b)).cast("B") for b in bufs]
    pieces = [(i, v[o:o + PIECE]) for i, v in enumerate(views) for o in range(0, max(len(v), 1), PIECE)]
    total = sum(len(p) for _, p in pieces)
    threads = min(checksum_threads(), len(pieces))
    if threads <= 1 or total < (4 << 20):
        crcs = [crc32(p) for _, p in pieces]
    else:
        runs, run, acc = [], [], 0
        for j, (_, p) in enumerate(pieces):
            run.append(j)
            acc += len(p)
            if acc >= total * (len(runs) + 1) / threads and len(runs) < threads - 1:
                runs.append(run)
                run = []
        runs.append(run)

        def crc_run(run: list[int]) -> list[int]:
            return [crc32(pieces[j][1]) for j in run]

        global _pool
        with _pool_lock:
            if _pool is None or _pool._max_workers < threads - 1:  # noqa: SLF001
                if _pool is not None:
                    _pool.shutdown(wait=False)
                _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="opdjax-crc")
            pool = _pool
        futures = [pool.submit(crc_run, r) for r in runs[1:]]
        crcs = crc_run(runs[0]) + [c for f in futures for c in f.result()]
    out = [0] * len(views)
    for (i, p), c in zip(pieces, crcs):
        out[i] = crc32_combine(out[i], c, len(p))
    return [c & 0xFFFFFFFF for c in out]


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a publish (see the module docstring)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    crc32: int | None = None
    quant: dict | None = None        # on a pre-quantized weight: {"fmt", "granularity", "block"}
    scale_of: str | None = None      # on a scale: the weight it scales

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "offset": self.offset,
             "nbytes": self.nbytes, "crc32": self.crc32, "quant": self.quant, "scale_of": self.scale_of}
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TensorEntry":
        try:
            return cls(name=str(d["name"]), shape=tuple(int(s) for s in d["shape"]), dtype=str(d["dtype"]),
                       offset=int(d["offset"]), nbytes=int(d["nbytes"]),
                       crc32=None if d.get("crc32") is None else int(d["crc32"]), quant=d.get("quant"),
                       scale_of=d.get("scale_of"))
        except (KeyError, TypeError, ValueError) as e:
            raise BridgeError(f"malformed manifest entry {dict(d)!r}: {e!r}") from None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A versioned publish: entries in payload order; `dtype` is the high-precision dtype of unquantized tensors."""

    version: int
    model_type: str
    dtype: str
    entries: tuple[TensorEntry, ...]
    recipe: str | None = None
    format: str = FORMAT
    rewind: bool = False  # a direct replacement in-process (never sent to a server: a bound server refuses it)
    session: str | None = None  # the publishing run's session (`remote.lease`); a bound server takes only its own

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "version": self.version, "model_type": self.model_type,
                           "dtype": self.dtype, "recipe": self.recipe, "rewind": self.rewind,
                           "session": self.session,
                           "entries": [e.to_dict() for e in self.entries]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BridgeError(f"manifest is not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise BridgeError(f"manifest format {got!r} is not {FORMAT!r}")
        if not isinstance(d.get("rewind", False), bool):
            raise BridgeError(f"malformed manifest: 'rewind' must be true or false, got {d.get('rewind')!r:.40}")
        session = d.get("session")
        if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 64):
            raise BridgeError(f"malformed manifest: 'session' must be a string of 1-64 characters or null, got "
                              f"{session!r:.40}")
        try:
            return cls(version=int(d["version"]), model_type=str(d["model_type"]), dtype=str(d["dtype"]),
                       entries=tuple(TensorEntry.from_dict(e) for e in d["entries"]), recipe=d.get("recipe"),
                       rewind=d.get("rewind", False), session=session)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, BridgeError):
                raise
            raise BridgeError(f"malformed manifest: missing or bad field ({e!r})") from None


def build_manifest(version: int, model_type: str, dtype: str, tensors: Iterable[tuple[str, Any, dict]], *,
                   recipe: str | None = None, checksums: bool = True, rewind: bool = False) -> Manifest:
    """A manifest for (name, array, extra) triples in payload order (`extra` holds quant / scale_of)."""
    tensors = list(tensors)
    crcs = checksum_many(np.asarray(a) for _, a, _ in tensors) if checksums else [None] * len(tensors)
    entries, offset = [], 0
    for (name, a, extra), crc in zip(tensors, crcs):
        shape = tuple(int(s) for s in np.shape(a))
        dt = dtype_name(a.dtype)
        nbytes = math.prod(shape) * np_dtype(dt).itemsize
        entries.append(TensorEntry(name=name, shape=shape, dtype=dt, offset=offset, nbytes=nbytes, crc32=crc,
                                   **extra))
        offset += nbytes
    return Manifest(version=int(version), model_type=model_type, dtype=dtype_name(dtype), entries=tuple(entries),
                    recipe=recipe, rewind=bool(rewind))


# ----------------------------------------------------------------------------------------------------------------------
# The engine side: what it serves, and validation
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The tensors an engine serves: HF name -> HF-layout shape (layer order), the accepted dtype, the family."""

    model_type: str
    dtype: str
    shapes: Mapping[str, tuple[int, ...]]

    @classmethod
    def from_config(cls, cfg, dtype: Any) -> "ModelSpec":
        """The spec of a decoder config (`opdjax.models.ModelConfig`) served in `dtype`, from the HF name table."""
        state = nnx.state(decoder.abstract(cfg))
        flat = dict(nnx.to_flat_state(state))
        shapes = {}
        for name, (path, t) in hf.name_map(cfg, state).items():
            shape = tuple(flat[path].get_value().shape)
            shapes[name] = shape[::-1] if t == "T" else shape
        return cls(model_type=cfg.model_type, dtype=dtype_name(dtype), shapes=shapes)


def _scale_shape(shape: tuple[int, ...], quant: Mapping[str, Any]) -> tuple[int, ...]:
    """Shape of the float32 scale of an HF-layout weight [out, in] quantized with `quant` (HF-layout block)."""
    g = quant.get("granularity")
    if g == "tensor":
        return ()
    if g == "channel":
        return (shape[0], 1)
    if g == "block":
        block = quant.get("block")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise BridgeError(f"quant block {block!r}: expected two positive integers [bn, bm]")
        bo, bi = block
        return (-(-shape[0] // bo), -(-shape[1] // bi))
    raise BridgeError(f"unsupported granularity {g!r} for a bridged weight; valid: tensor, channel, block")


def validate(manifest: Manifest, spec: ModelSpec, *, served_version: int | None = None) -> None:
    """Raise one BridgeError listing every way `manifest` does not fit `spec`; return None when it fits.

    Checks: family; every spec tensor present exactly once; no unknown tensor; shapes; dtypes (unquantized
    tensors in the spec's dtype; a quantized weight in its format's storage dtype with a float32 scale of the right
    shape); entries tile the payload contiguously with nbytes = numel * itemsize.
    """
    problems: list[str] = []
    if manifest.model_type != spec.model_type:
        problems.append(f"model_type {manifest.model_type!r} but the engine serves {spec.model_type!r}")
    seen = _layout_problems(manifest, problems)
    scales = {e.scale_of: e for e in manifest.entries if e.scale_of is not None}
    for e in manifest.entries:
        if e.scale_of is not None:
            problems += _scale_entry_problems(e, seen)
        elif e.name not in spec.shapes:
            problems.append(f"unknown tensor {e.name!r}")
        else:
            problems += _tensor_problems(e, spec, scales.get(e.name))
    missing = [n for n in spec.shapes if n not in seen]
    if missing:
        problems.append(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if problems:
        keeps = "" if served_version is None else f"; engine keeps serving v{served_version}"
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
        raise BridgeError(f"manifest v{manifest.version} rejected: {shown}{keeps}")


def _layout_problems(manifest: Manifest, problems: list[str]) -> dict[str, TensorEntry]:
    """Append to `problems` every duplicate name, unknown dtype, nbytes != numel * itemsize, and entry that does
    not start where the previous one ended (entries tile the payload in order); returns name -> entry."""
    seen: dict[str, TensorEntry] = {}
    offset = 0
    for e in manifest.entries:
        if e.name in seen:
            problems.append(f"tensor {e.name!r} appears twice")
        seen[e.name] = e
        if e.dtype not in DTYPES:
            problems.append(f"tensor {e.name!r} has unknown dtype {e.dtype!r}")
        elif e.nbytes != math.prod(e.shape) * DTYPES[e.dtype].itemsize:
            problems.append(f"tensor {e.name!r} declares {e.nbytes} bytes, expected "
                            f"{math.prod(e.shape) * DTYPES[e.dtype].itemsize} for {e.dtype}{list(e.shape)}")
        if e.offset != offset:
            problems.append(f"tensor {e.name!r} starts at byte {e.offset}, expected {offset} (entries must tile "
                            f"the payload in order)")
        offset = e.offset + e.nbytes
    return seen


def _scale_entry_problems(e: TensorEntry, seen: Mapping[str, TensorEntry]) -> list[str]:
    """A scale entry must belong to a quantized weight of the manifest and be named `<weight>_scale`."""
    w = seen.get(e.scale_of)
    if w is None or w.quant is None:
        return [f"scale {e.name!r} belongs to {e.scale_of!r}, which is not a quantized weight of this manifest"]
    if e.name != e.scale_of + "_scale":
        return [f"scale {e.name!r} of {e.scale_of!r} must be named {e.scale_of + '_scale'!r}"]
    return []


def _tensor_problems(e: TensorEntry, spec: ModelSpec, scale: TensorEntry | None) -> list[str]:
    """A served tensor: the spec's shape, and the spec's dtype unless quantized (then `_quantized_problems`)."""
    out = []
    want = spec.shapes[e.name]
    if tuple(e.shape) != tuple(want):
        out.append(f"tensor {e.name!r} has shape {tuple(e.shape)}, expected {tuple(want)}")
    if e.quant is None:
        if e.dtype != spec.dtype:
            out.append(f"tensor {e.name!r} has dtype {e.dtype}, expected {spec.dtype}")
        return out
    return out + _quantized_problems(e, scale)


def _quantized_problems(e: TensorEntry, scale: TensorEntry | None) -> list[str]:
    """A quantized weight: a known format, its storage dtype, 2-D, and a `<name>_scale` entry in F32 with the
    shape `_scale_shape` gives for its quant spec."""
    fmt = e.quant.get("fmt")
    if fmt not in FP8_DTYPES:
        return [f"tensor {e.name!r}: unknown quantization format {fmt!r}; valid: {sorted(FP8_DTYPES)}"]
    out = []
    if e.dtype != FP8_DTYPES[fmt]:
        out.append(f"tensor {e.name!r} is quantized as {fmt} but has dtype {e.dtype}, expected {FP8_DTYPES[fmt]}")
    if len(e.shape) != 2:
        return out + [f"tensor {e.name!r}: only 2-D weights can be quantized, got shape {tuple(e.shape)}"]
    if scale is None:
        return out + [f"quantized tensor {e.name!r} has no scale entry {e.name + '_scale'!r}"]
    try:
        want_s = _scale_shape(tuple(e.shape), e.quant)
    except (BridgeError, KeyError, TypeError, ValueError) as err:
        return out + [f"tensor {e.name!r}: bad quant spec {e.quant!r} ({err})"]
    if scale.dtype != "F32" or tuple(scale.shape) != want_s:
        out.append(f"scale {scale.name!r} is {scale.dtype}{list(scale.shape)}, expected F32{list(want_s)}")
    return out
