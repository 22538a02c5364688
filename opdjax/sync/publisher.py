"""The learner side: (possibly sharded) JAX params -> a layer-ordered stream of HF-named tensors -> a publish.

`hf_stream` walks the HF name table (`opdjax.models.hf.name_map`, the same table checkpoints use) in layer order
and yields (HF name, HF-layout array, extra) for every tensor: unquantized tensors cast to the wire dtype (bf16 or
f32; the cast runs in JAX, so it rounds exactly as the learner's own cast), and, for the modules a quantization
recipe quantizes, the FP8 weight and its float32 scale made by `opdjax.quant.quantize` from the cast weight (the
shards of a vLLM fused layer with one shared scale, `quant.shared_scale`)
(the same quantizer the JaxEngine simulation uses, so the engine's dequantized weight equals the simulated one
bit-for-bit). Sharded arrays that are not fully addressable are all-gathered first (every process must call;
only process 0 publishes).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from opdjax import quant
from opdjax.models import hf
from opdjax.models.config import ModelConfig
from opdjax.sync.manifest import BridgeError, Manifest, build_manifest

__all__ = ["hf_stream", "prepare", "Publisher"]


def _gathered(x: Any) -> Any:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return x


def _cast(x: Any, dtype: np.dtype) -> Any:
    if isinstance(x, jax.Array):
        return x if x.dtype == dtype else x.astype(dtype)
    x = np.asarray(x)
    return x if x.dtype == dtype else jnp.asarray(x).astype(dtype)  # JAX rounding (RNE), as the learner's cast


def hf_stream(cfg: ModelConfig, params: nnx.State | Mapping[str, Any], *, dtype: Any = "bfloat16",
              recipe: quant.Recipe | str | None = None) -> Iterator[tuple[str, Any, dict]]:
    """(HF name, HF-layout array, extra) in layer order; see the module docstring.

    params: an nnx.State of the decoder, or HF-named arrays in HF layout (as `hf.named_params` gives).
    extra: {} for a plain tensor, {"quant": {...}} on an FP8 weight, {"scale_of": name} on its scale.
    """
    dt = np.dtype(jnp.dtype(dtype))
    rec = quant.as_recipe(recipe)
    if isinstance(params, nnx.State):
        flat = dict(nnx.to_flat_state(params))
        nm = hf.name_map(cfg, params)
        get = lambda name: flat[nm[name][0]].get_value()  # noqa: E731  opdjax layout
        in_hf_layout = False
    else:
        nm = hf.name_map(cfg)
        missing = [n for n in nm if n not in params]
        if missing:
            raise BridgeError(f"publish: missing tensor(s) {missing[:5]} for a {cfg.model_type} model with "
                              f"{cfg.num_layers} layers")
        get = lambda name: params[name]  # noqa: E731  HF layout
        in_hf_layout = True
    memo: dict = {}  # each fused layer's shared scale, computed (its shards gathered) once
    for name, (_, t) in nm.items():
        x = _cast(_gathered(get(name)), dt)
        spec = quant.weight_spec(rec, name, np.ndim(x))
        if spec is None:
            yield name, (x.T if (t == "T" and not in_hf_layout) else x), {}
            continue
        if quant.FORMATS[spec.fmt].bits < 8:
            raise BridgeError(f"publish: recipe {rec.name!r} quantizes {name} to 4 bits ({spec.fmt}); the bridge "
                              "ships BF16/FP8 tensors only, never packed 4-bit weights (the JAX engine simulates them)")
        x_io = x.T if (t == "T" and in_hf_layout) else x  # quantizers work on opdjax's [in, out]
        shared = quant.shared_scale(rec, name, lambda n: _cast(_gathered(get(n)), dt), memo)  # a fused layer's one
        q, s = quant.quantize(x_io, spec.fmt, spec.granularity, block=spec.block, scale=shared)
        meta = spec.to_dict()
        if spec.granularity == "block":
            meta["block"] = [spec.block[1], spec.block[0]]
        yield name, q.T, {"quant": meta}
        yield name + "_scale", (s.T if s.ndim == 2 else s), {"scale_of": name}


def prepare(cfg: ModelConfig, params: nnx.State | Mapping[str, Any], version: int, *, dtype: Any = "bfloat16",
            recipe: quant.Recipe | str | None = None, checksums: bool = True,
            rewind: bool = False) -> tuple[Manifest, list[Any]]:
    """(manifest, arrays in payload order) of one publish. checksums=False skips the CRC-32s (in-process); rewind
    marks an in-process direct replacement (`update_weights`), which may carry any version (a server bound to a run
    refuses it: there a new run session restarts the version order)."""
    triples = list(hf_stream(cfg, params, dtype=dtype, recipe=recipe))
    rec = quant.as_recipe(recipe)
    if checksums:
        triples = [(n, np.asarray(a), e) for n, a, e in triples]
    manifest = build_manifest(version, cfg.model_type, jnp.dtype(dtype), triples,
                              recipe=None if rec.is_noop else rec.name, checksums=checksums, rewind=rewind)
    return manifest, [a for _, a, _ in triples]


class Publisher:
    """Publishes learner weights through one transport: `publish(params, version)` -> the manifest sent.

    Every JAX process must call `publish` (sharded params are gathered); only process 0 sends, unless
    `every_process` (each process feeds its own engine in-process).
    """

    def __init__(self, cfg: ModelConfig, transport, *, dtype: Any = "bfloat16",
                 recipe: quant.Recipe | str | None = None, every_process: bool = False):
        self.cfg = cfg
        self.every_process = bool(every_process)
        self.transport = transport
        self.dtype = jnp.dtype(dtype)
        self.recipe = quant.as_recipe(recipe)
        self.last_stats: dict[str, Any] = {}

    def publish(self, params: nnx.State | Mapping[str, Any], version: int, *, rewind: bool = False
                ) -> Manifest | None:
        """Send params as `version` (engines refuse a version older than they received, unless `rewind`: an
        in-process direct replacement)."""
        t0 = time.perf_counter()
        manifest, arrays = prepare(self.cfg, params, version, dtype=self.dtype, recipe=self.recipe,
                                   checksums=getattr(self.transport, "needs_checksums", True), rewind=rewind)
        if jax.process_index() != 0 and not self.every_process:
            return None
        t1 = time.perf_counter()
        self.transport.send(manifest, arrays)
        t2 = time.perf_counter()
        self.last_stats = {"prepare_s": t1 - t0, "send_s": t2 - t1, "bytes": manifest.total_bytes}
        return manifest
