"""Recipes: which HF modules of a decoder are quantized, and how (`QSpec`, `Recipe`, presets in `RECIPES`,
recipe files), and applying a recipe to named weights."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from opdjax.core.layout import DECODER_LINEAR_PATTERNS, FUSED_GROUPS, HIGH_PRECISION_PATTERNS, LAYER, MODULES
from opdjax.quant.formats import (
    AMAX_EPS,
    FORMATS,
    KV_GRANULARITIES,
    RecipeError,
    check_block,
    check_granularity,
    check_scale_fmt,
    get_format,
    dequantize,
    qdq,
    quantize,
)

Array = jax.Array

# ----------------------------------------------------------------------------------------------------------------------
# Recipes
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QSpec:
    """How one kind of tensor is quantized: format, granularity, (for "block") the block shape, and the scale rule
    (`scale_fmt`: "f32", or for e2m1 blocks "e8m0" = MXFP4 / "e4m3" = NVFP4; see `opdjax.quant.formats`)."""

    fmt: str = "e4m3"
    granularity: str = "tensor"
    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "f32"

    def __post_init__(self):
        get_format(self.fmt)
        check_granularity(self.granularity)
        check_scale_fmt(self.fmt, self.granularity, self.scale_fmt)
        object.__setattr__(self, "block", check_block(self.block))

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "spec") -> "QSpec | None":
        """A spec from YAML: None / "none" -> None (high precision), "e4m3" -> QSpec("e4m3"), or a mapping with keys
        fmt, granularity, block, scale_fmt."""
        if d is None or (isinstance(d, str) and d.lower() in ("none", "null", "bf16", "fp32", "high")):
            return None
        if isinstance(d, QSpec):
            return d
        if isinstance(d, str):
            try:
                return cls(fmt=d)
            except RecipeError as e:
                raise RecipeError(f"{where}: {e}") from None
        if not isinstance(d, Mapping):
            raise RecipeError(f"{where}: expected a mapping with keys {_QSPEC_KEYS}, a format name or null, "
                              f"got {d!r}")
        unknown = sorted(set(d) - set(_QSPEC_KEYS))
        if unknown:
            raise RecipeError(f"{where}: unknown key(s) {unknown}; valid keys: {list(_QSPEC_KEYS)}")
        kw = dict(d)
        if "block" in kw:
            kw["block"] = tuple(kw["block"])
        try:
            return cls(**kw)
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"fmt": self.fmt, "granularity": self.granularity}
        if self.granularity == "block":
            d["block"] = list(self.block)
        if self.scale_fmt != "f32":
            d["scale_fmt"] = self.scale_fmt
        return d


_QSPEC_KEYS = ("fmt", "granularity", "block", "scale_fmt")
_RECIPE_KEYS = ("name", "base", "weights", "activations", "kv_cache", "kv_scale", "kv_scales", "fused_scales")



def _normalise_kv_scales(kv_scales: Any) -> tuple | None:
    if kv_scales is None:
        return None
    out = []
    for i, s in enumerate(kv_scales):
        if isinstance(s, (tuple, list, np.ndarray)):
            if len(s) != 2:
                raise RecipeError(f"kv_scales[{i}] must be a float or a (k_scale, v_scale) pair, got {s!r}")
            out.append((float(s[0]), float(s[1])))
        else:
            out.append(float(s))
    for i, s in enumerate(out):
        if not all(v > 0 and math.isfinite(v) for v in (s if isinstance(s, tuple) else (s,))):
            raise RecipeError(f"kv_scales[{i}] must be positive and finite, got {s!r}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which tensors the rollout engine quantizes, and how. Frozen and hashable (tuples only).

    weights       ordered (fnmatch pattern over HF module names, QSpec | None); the first matching pattern wins;
                  None keeps the module in high precision. The quantized tensor is `<module>.weight` (2-D only).
    activations   dynamic quantization of the INPUT of every linear layer whose weight is quantized (W8A8);
                  None = weight-only (W8A16).
    kv_cache      QSpec of the KV cache (granularity "token" = one scale per (token, kv head) over head_dim, or
                  "tensor"); None = high-precision cache.
    kv_scale      fixed scale for keys and values (1.0 = vLLM's uncalibrated FP8 default); None = dynamic.
    kv_scales     calibrated per-layer scales: one float (K and V) or a (k_scale, v_scale) pair per layer.
    fused_scales  True (default, as vLLM serves it): where every shard of one of vLLM's fused layers (q/k/v ->
                  qkv_proj, gate/up -> gate_up_proj) has the same per-tensor spec, the shards share ONE scale,
                  amax over their concatenation / fmt_max — what vLLM's online fp8_per_tensor computes when it
                  re-quantizes the fused weight. False: one scale per HF tensor.
    """

    name: str = "custom"
    weights: tuple[tuple[str, QSpec | None], ...] = ()
    activations: QSpec | None = None
    kv_cache: QSpec | None = None
    kv_scale: float | None = None
    kv_scales: tuple | None = None
    fused_scales: bool = True

    def __post_init__(self):
        weights = []
        for i, entry in enumerate(self.weights):
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                    and (entry[1] is None or isinstance(entry[1], QSpec))):
                raise RecipeError(f"recipe {self.name!r}: weights[{i}] must be (pattern: str, QSpec | None), "
                                  f"got {entry!r}")
            weights.append((entry[0], entry[1]))
        object.__setattr__(self, "weights", tuple(weights))
        for field in ("activations", "kv_cache"):
            v = getattr(self, field)
            if v is not None and not isinstance(v, QSpec):
                raise RecipeError(f"recipe {self.name!r}: {field} must be a QSpec or None, got {v!r}")
            if v is not None and FORMATS[v.fmt].bits < 8:
                raise RecipeError(f"recipe {self.name!r}: {field} format {v.fmt!r} is a 4-bit weight format; opdjax "
                                  f"simulates 4-bit weights only (W4A16): use e4m3, e5m2, int8 or null for {field}")
        if self.kv_cache is not None and self.kv_cache.granularity not in KV_GRANULARITIES:
            raise RecipeError(f"recipe {self.name!r}: kv_cache granularity {self.kv_cache.granularity!r} not "
                              f"supported; valid: {list(KV_GRANULARITIES)}")
        object.__setattr__(self, "kv_scales", _normalise_kv_scales(self.kv_scales))
        if self.kv_scale is not None:
            object.__setattr__(self, "kv_scale", float(self.kv_scale))
            if not (self.kv_scale > 0 and math.isfinite(self.kv_scale)):
                raise RecipeError(f"recipe {self.name!r}: kv_scale must be positive and finite, got {self.kv_scale}")
        if (self.kv_scale is not None or self.kv_scales is not None) and self.kv_cache is None:
            raise RecipeError(f"recipe {self.name!r}: kv_scale/kv_scales given but kv_cache is None")
        if self.kv_scale is not None and self.kv_scales is not None:
            raise RecipeError(f"recipe {self.name!r}: give kv_scale (one fixed scale) or kv_scales (per layer), "
                              f"not both")

    # -- queries ---------------------------------------------------------------------------------------------------
    @property
    def kv_dynamic(self) -> bool:
        """True when the KV cache is quantized with scales computed on the fly (per token or per tensor)."""
        return self.kv_cache is not None and self.kv_scale is None and self.kv_scales is None

    @property
    def is_noop(self) -> bool:
        return self.kv_cache is None and all(spec is None for _, spec in self.weights)

    def module_spec(self, module_name: str) -> QSpec | None:
        return module_spec(self, module_name)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    # -- YAML ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """A recipe from a YAML mapping. Keys: name, base (a preset name to start from), weights, activations,
        kv_cache, kv_scale, kv_scales.

        weights is a list of [pattern, spec] pairs or a mapping pattern -> spec (order kept); a spec is null
        (high precision), a format name ("e4m3") or a mapping {fmt, granularity, block, scale_fmt}. Unknown keys,
        formats, granularities and scale formats raise RecipeError naming the valid ones.
        """
        if not isinstance(d, Mapping):
            raise RecipeError(f"a recipe must be a mapping with keys {list(_RECIPE_KEYS)}, got {d!r}")
        unknown = sorted(set(d) - set(_RECIPE_KEYS))
        if unknown:
            raise RecipeError(f"recipe: unknown key(s) {unknown}; valid keys: {list(_RECIPE_KEYS)}")
        base = get_recipe(d["base"]) if "base" in d else Recipe()
        default_name = d["base"] if set(d) == {"base"} else "custom"
        kw: dict[str, Any] = {"name": str(d.get("name", default_name))}
        if "weights" in d:
            w = d["weights"]
            items = list(w.items()) if isinstance(w, Mapping) else list(w or [])
            weights = []
            for i, item in enumerate(items):
                if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
                    raise RecipeError(f"recipe: weights[{i}] must be a [pattern, spec] pair, got {item!r}")
                weights.append((item[0], QSpec.from_dict(item[1], where=f"recipe weights[{item[0]!r}]")))
            kw["weights"] = tuple(weights)
        for field in ("activations", "kv_cache"):
            if field in d:
                kw[field] = QSpec.from_dict(d[field], where=f"recipe {field}")
        for field in ("kv_scale", "kv_scales"):
            if field in d:
                kw[field] = d[field]
        if "fused_scales" in d:
            if not isinstance(d["fused_scales"], bool):
                raise RecipeError(f"recipe fused_scales must be true or false, got {d['fused_scales']!r}")
            kw["fused_scales"] = d["fused_scales"]
        return dataclasses.replace(base, **kw)

    def to_dict(self) -> dict[str, Any]:
        spec = lambda s: None if s is None else s.to_dict()  # noqa: E731
        return {"name": self.name, "weights": [[p, spec(s)] for p, s in self.weights],
                "activations": spec(self.activations), "kv_cache": spec(self.kv_cache), "kv_scale": self.kv_scale,
                "kv_scales": None if self.kv_scales is None else [list(s) if isinstance(s, tuple) else s
                                                                   for s in self.kv_scales],
                "fused_scales": self.fused_scales}


@functools.lru_cache(maxsize=8192)
def module_spec(recipe: Recipe, module_name: str) -> QSpec | None:
    """The QSpec of an HF module's weight under `recipe`: the first pattern (fnmatchcase, `*` crosses dots) that
    matches wins; no match, or a None spec, means high precision."""
    for pattern, spec in recipe.weights:
        if fnmatch.fnmatchcase(module_name, pattern):
            return spec
    return None


def weight_spec(recipe: Recipe, name: str, ndim: int) -> QSpec | None:
    """Spec for tensor `name` if it is the 2-D `.weight` of a matched module, else None."""
    if ndim != 2 or not name.endswith(".weight"):
        return None
    return module_spec(recipe, name[: -len(".weight")])


def _linear_recipe(name: str, w: QSpec | None, a: QSpec | None = None, kv: QSpec | None = None,
                   kv_scale: float | None = None) -> Recipe:
    weights = tuple((p, None) for p in HIGH_PRECISION_PATTERNS)
    if w is not None:
        weights += tuple((p, w) for p in DECODER_LINEAR_PATTERNS)
    return Recipe(name=name, weights=weights, activations=a, kv_cache=kv, kv_scale=kv_scale)


_E4M3_T = QSpec("e4m3", "tensor")
_E4M3_CH = QSpec("e4m3", "channel")
_E4M3_TOK = QSpec("e4m3", "token")

# 4-bit weight-only (W4A16) presets; kernels are [in, out], so a block (n, 1) is n consecutive INPUT features of one
# output channel — the K-axis groups of the checkpoints: MXFP4 (OCP Microscaling: e2m1 values, one power-of-two
# e8m0 scale per 32), NVFP4 (e2m1, one e4m3 scale per 16 times a float32 tensor scale), and INT4 per-group-128 as
# GPTQ / AWQ / compressed-tensors W4A16 checkpoints store it. Real INT4 checkpoints are often asymmetric (a zero
# point per group); this simulates the symmetric variant (q in [-7, 7], scale = amax / 7, float32).
_MXFP4 = QSpec("e2m1", "block", (32, 1), "e8m0")
_NVFP4 = QSpec("e2m1", "block", (16, 1), "e4m3")
_INT4_G128 = QSpec("int4", "block", (128, 1))

# vLLM `quantization="fp8"` (online dynamic FP8): every decoder Linear's weight to e4m3 with one per-tensor scale;
# activations dynamically quantized to e4m3 per token (what vLLM's FP8 GEMM does on Hopper/Ada, the GPUs that run
# W8A8; the docs' generic description is a dynamic per-tensor activation scale — see "fp8_w8a8_tensor").
# lm_head, embeddings, norms and routers stay in the model dtype.
FP8_DEFAULT = _linear_recipe("fp8_w8a8", _E4M3_T, _E4M3_TOK)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="none"),
    _linear_recipe("fp8_weights_only", _E4M3_T),                           # W8A16 (vLLM FP8 on Ampere, Marlin)
    FP8_DEFAULT,                                                           # W8A8, per-tensor W, per-token A
    _linear_recipe("fp8_w8a8_tensor", _E4M3_T, _E4M3_T),                   # per-tensor W, dynamic per-tensor A
    _linear_recipe("fp8_w8a8_channel", _E4M3_CH, _E4M3_TOK),               # llm-compressor FP8_DYNAMIC
    _linear_recipe("fp8_block128", QSpec("e4m3", "block", (128, 128)),     # vLLM fp8_per_block / DeepSeek-V3
                   QSpec("e4m3", "block", (1, 128))),
    _linear_recipe("fp8_w8a8_kv", _E4M3_T, _E4M3_TOK, _E4M3_TOK, 1.0),     # + FP8 KV cache, scale 1.0
    _linear_recipe("fp8_kv_only", None, None, _E4M3_TOK, 1.0),             # kv_cache_dtype="fp8" alone
    _linear_recipe("e5m2_w8a8", QSpec("e5m2", "tensor"), QSpec("e5m2", "token")),
    _linear_recipe("int8_w8a8", QSpec("int8", "channel"), QSpec("int8", "token")),  # vLLM INT8 W8A8 (dynamic)
    _linear_recipe("mxfp4_w4a16", _MXFP4),                                 # checkpoint-only in vLLM (mxfp4)
    _linear_recipe("nvfp4_w4a16", _NVFP4),                                 # checkpoint-only (ModelOpt NVFP4)
    _linear_recipe("int4_w4a16_g128", _INT4_G128),                         # checkpoint-only (GPTQ/AWQ/c-t)
)}


def get_recipe(name: str) -> Recipe:
    """The preset named `name`; an unknown name raises RecipeError (a ValueError) listing the valid names."""
    if name not in RECIPES:
        raise RecipeError(f"unknown quantization recipe {name!r}; valid recipes: {sorted(RECIPES)}")
    return RECIPES[name]


RECIPE_SUFFIXES = (".json", ".yaml", ".yml")


def is_recipe_file(spec: Any) -> bool:
    """True when `spec` names a recipe file (a path ending in .json/.yaml/.yml) rather than a preset."""
    return isinstance(spec, (str, pathlib.Path)) and str(spec).endswith(RECIPE_SUFFIXES)


def load_recipe_file(path: str | pathlib.Path) -> Recipe:
    """A Recipe from a JSON/YAML file (as `recipe-search` writes); a missing or malformed file raises RecipeError."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file {p} does not exist")
    try:
        d = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"recipe file {p}: not valid JSON/YAML ({e})") from None
    return Recipe.from_dict(d)


def as_recipe(spec: "str | pathlib.Path | Mapping[str, Any] | Recipe | None") -> Recipe:
    """Accept a preset name, a path to a recipe file (.json/.yaml), a YAML mapping, a Recipe, or None (-> "none").

    Nothing is registered: a file or an in-memory Recipe is resolved here, every time, without touching RECIPES.
    """
    if spec is None:
        return RECIPES["none"]
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, (str, pathlib.Path)):
        if str(spec) not in RECIPES and is_recipe_file(spec):
            return load_recipe_file(spec)
        return get_recipe(str(spec))
    return Recipe.from_dict(spec)


# ----------------------------------------------------------------------------------------------------------------------
# Applying a recipe to named weights (opdjax layout: linear kernels [in, out])
# ----------------------------------------------------------------------------------------------------------------------

def qdq_kwargs(spec: QSpec) -> dict[str, Any]:
    """The keyword arguments `qdq(x, spec.fmt, spec.granularity, **qdq_kwargs(spec))` takes for a weight of the
    opdjax layout (kernel [in, out]: channels on the last axis, a block (32, 1) runs along the input axis)."""
    return {"block": spec.block, "channel_axis": -1, "scale_fmt": spec.scale_fmt}


def fused_shards(name: str) -> tuple[str, ...]:
    """The HF weight names served as one fused vLLM layer with `name` (itself included, layer order), or () when
    `name` is not a shard of a multi-shard fused layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or parts[-1] != "weight":
        return ()
    module = ".".join(parts[3:-1])
    for shorts in FUSED_GROUPS.values():
        mods = [MODULES[m] for m in shorts]
        if len(mods) > 1 and module in mods:
            return tuple(f"{LAYER.format(i=int(parts[2]))}.{m}.weight" for m in mods)
    return ()


def shared_scale(recipe: Recipe, name: str, get: Any, memo: dict | None = None) -> Array | None:
    """The one scale vLLM uses for `name` when it serves `name` inside a fused layer, else None (own scale).

    Applies when recipe.fused_scales and every shard of the fused layer has the same per-tensor spec:
    scale = max(amax over all shards, AMAX_EPS) * (1/fmt_max), float32 (the per-tensor formula over the
    concatenation). `get(shard_name)` returns a shard's array (any layout: a per-tensor amax ignores it). `memo`
    (a dict the caller keeps for one pass over a model) computes each fused layer's scale once, not once per shard.
    """
    shards = fused_shards(name) if recipe.fused_scales else ()
    if not shards:
        return None
    if memo is not None and shards in memo:
        return memo[shards]
    specs = {weight_spec(recipe, n, 2) for n in shards}
    if len(specs) != 1 or None in specs or next(iter(specs)).granularity != "tensor":
        return None
    fmt = get_format(next(iter(specs)).fmt)
    amax = max(jnp.max(jnp.abs(jnp.asarray(get(n), jnp.float32))) for n in shards)
    scale = jnp.maximum(amax, AMAX_EPS) * np.float32(1.0 / fmt.max_value)
    if memo is not None:
        memo[shards] = scale
    return scale


def _weight_quant_kwargs(recipe: Recipe, name: str, named: Mapping[str, Array], spec: QSpec,
                         memo: dict) -> dict[str, Any]:
    return {**qdq_kwargs(spec), "scale": shared_scale(recipe, name, named.__getitem__, memo)}


def apply_to_named(recipe: Recipe, named: Mapping[str, Array]) -> dict[str, Array]:
    """Simulated-quantized copy of `named` (HF tensor name -> array in opdjax layout, kernels [in, out]).

    Only 2-D `<module>.weight` tensors whose module matches a non-None pattern are replaced by their qdq
    (per-channel = per output column; per-tensor shards of a vLLM fused layer share one scale, `shared_scale`);
    biases, norms, embeddings and unmatched tensors are returned untouched. Dtypes are preserved.
    """
    out, memo = {}, {}
    for name, arr in named.items():
        spec = weight_spec(recipe, name, np.ndim(arr))
        out[name] = arr if spec is None else qdq(arr, spec.fmt, spec.granularity,
                                                 **_weight_quant_kwargs(recipe, name, named, spec, memo))
    return out


def quantize_named(recipe: Recipe, named: Mapping[str, Array]) -> dict[str, tuple[Array, Array] | Array]:
    """Like `apply_to_named`, but quantized tensors come back as (q, scale) for a weight bridge.

    q is [in, out] in the storage dtype (a bridge transposes to HF's [out, in] and the scale with it);
    `dequantize_named` (or `dequantize(q, scale, dtype, block=spec.block)`) equals `apply_to_named` bit-for-bit.
    A fused layer's shared scale needs its sibling shards in `named`.
    """
    out: dict[str, Any] = {}
    memo: dict = {}
    for name, arr in named.items():
        spec = weight_spec(recipe, name, np.ndim(arr))
        out[name] = arr if spec is None else quantize(arr, spec.fmt, spec.granularity,
                                                      **_weight_quant_kwargs(recipe, name, named, spec, memo))
    return out


def dequantize_named(recipe: Recipe, qnamed: Mapping[str, Any], dtypes: Mapping[str, Any] | Any) -> dict[str, Array]:
    """Inverse of `quantize_named`: (q, scale) entries -> dequantized arrays in `dtypes[name]` (or one dtype)."""
    out = {}
    for name, v in qnamed.items():
        if isinstance(v, tuple):
            q, s = v
            spec = weight_spec(recipe, name, q.ndim)
            dt = dtypes[name] if isinstance(dtypes, Mapping) else dtypes
            out[name] = dequantize(q, s, dt, block=spec.block if spec and spec.granularity == "block" else None)
        else:
            out[name] = v
    return out
