"""References the quant tests share, which the code under test did not produce: ml_dtypes casts in numpy, bit views."""

import ml_dtypes
import numpy as np

from opdjax import quant as Q

FMT_NP = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
          "int8": (np.int8, 127.0)}


def np_qdq(x, fmt, reduce_axes):
    """numpy/ml_dtypes reference: scale = max(amax, eps) * f32(1/max); cast(clip(x * f32(1/scale))) * scale."""
    dt, mx = FMT_NP[fmt]
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=reduce_axes, keepdims=True) if reduce_axes is not None else np.max(np.abs(x))
    scale = (np.maximum(amax, np.float32(Q.AMAX_EPS)) * np.float32(1.0 / mx)).astype(np.float32)
    y = np.clip(x * (np.float32(1.0) / scale), -mx, mx)
    if fmt == "int8":
        y = np.round(y)
    return (y.astype(dt).astype(np.float32) * scale).astype(np.float32)


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])

