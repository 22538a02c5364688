"""A strict safetensors reader/writer on numpy (bf16 and fp8 through ml_dtypes).

Strict means every structural problem is a `CheckpointError` naming the file and tensor: a header that is
not JSON or runs past the file, a tensor whose byte range lies outside the data section or disagrees with its
shape and dtype, an unknown dtype. Reads are memory-mapped: a tensor is copied only when it is converted.
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

from opdjax.core.errors import InputError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(InputError):
    """A checkpoint file or directory that is corrupt, truncated or does not match the model."""


def read_header(path: str | pathlib.Path) -> tuple[dict, int]:
    """(tensor entries, data section offset); validates the header against the file size."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path.name}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path.name}: header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path.name}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, e in header.items():
        try:
            dtype, shape, (start, end) = e["dtype"], e["shape"], e["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path.name}: tensor {name!r} has a malformed header entry {e!r}") from err
        if dtype not in DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported dtype {dtype!r}; "
                                  f"supported: {sorted(DTYPES)}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - start != want or start < 0:
            raise CheckpointError(f"{path.name}: tensor {name!r} spans {end - start} bytes, "
                                  f"expected {want} for {dtype}{list(shape)}")
        if end > data_len:
            raise CheckpointError(f"{path.name}: tensor {name!r} ends at byte {end} but the data section has "
                                  f"{data_len} bytes (truncated file?)")
    return header, 8 + n


def load(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only memory-mapped numpy arrays."""
    path = pathlib.Path(path)
    header, offset = read_header(path)
    if not header:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, e in header.items():
        start, end = e["data_offsets"]
        buf = mm[offset + start: offset + end]
        out[name] = buf.view(DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def save(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None):
    """Write tensors (any order; stored sorted by name) to one safetensors file, atomically via a temp file."""
    path = pathlib.Path(path)
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _NAMES:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    tmp.replace(path)
