"""The decoder's module layout, by Hugging Face name: the one table the rest of opdjax reads.

Llama / Qwen2 / Qwen3 decoders name their tensors `model.layers.{i}.<module>.weight`. This module says which
modules are linear layers (what a quantization recipe may quantize), which stay in high precision, which vLLM
fuses into one layer, and every tensor's shape (opdjax layout: linear kernels [in, out], HF's weight transposed).
Pure data and integer arithmetic; `models.hf` maps these names to the decoder's parameter paths.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LAYER", "MODULES", "FUSED_GROUPS", "DECODER_LINEAR_PATTERNS", "HIGH_PRECISION_PATTERNS",
           "weight_shapes", "linear_modules", "num_params"]

LAYER = "model.layers.{i}"
"""HF prefix of decoder layer i."""

MODULES: dict[str, str] = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
"""Short name -> the linear module's name inside a layer."""

FUSED_GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"),
                                            "down": ("down",)}
"""The layers vLLM serves: it fuses q/k/v and gate/up, and every shard of a fused layer must share one scheme."""

DECODER_LINEAR_PATTERNS: tuple[str, ...] = tuple(f"model.layers.*.{m}" for m in MODULES.values())
"""fnmatch patterns of every decoder linear layer (embeddings, lm_head, norms and MoE routers do not match)."""

HIGH_PRECISION_PATTERNS: tuple[str, ...] = ("model.embed_tokens", "lm_head")
"""Modules every preset recipe keeps in the model dtype."""


def weight_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (opdjax layout: linear kernels [in, out]) of a Llama/Qwen2/Qwen3 decoder.

    cfg needs vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
    tie_word_embeddings; optional attention_bias (q/k/v biases, as Qwen2) and qk_norm (q_norm/k_norm, as Qwen3).
    lm_head.weight is absent when embeddings are tied. Layer order, as a checkpoint lists them.
    """
    E, F, H, K, D, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    linear = {"q": (E, H * D), "k": (E, K * D), "v": (E, K * D), "o": (H * D, E),
              "gate": (E, F), "up": (E, F), "down": (F, E)}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E)}
    for i in range(cfg.num_layers):
        p = LAYER.format(i=i)
        shapes.update({f"{p}.{MODULES[m]}.weight": s for m, s in linear.items()})
        shapes.update({f"{p}.input_layernorm.weight": (E,), f"{p}.post_attention_layernorm.weight": (E,)})
        if getattr(cfg, "attention_bias", False):
            shapes.update({f"{p}.{MODULES[m]}.bias": (linear[m][1],) for m in ("q", "k", "v")})
        if getattr(cfg, "qk_norm", False):
            shapes.update({f"{p}.self_attn.q_norm.weight": (D,), f"{p}.self_attn.k_norm.weight": (D,)})
    shapes["model.norm.weight"] = (E,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (E, V)
    return shapes


def linear_modules(cfg: Any) -> list[str]:
    """HF names of every decoder linear module (no `.weight`), layer order."""
    return [f"{LAYER.format(i=i)}.{m}" for i in range(cfg.num_layers) for m in MODULES.values()]


def num_params(cfg: Any) -> int:
    """Parameter count: Σ over `weight_shapes` (embeddings included, a tied lm_head counted once)."""
    total = 0
    for shape in weight_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
