"""opdjax.quant.capacity: weight and KV-cache bytes against closed-form counts."""

from __future__ import annotations

import types

import numpy as np

from opdjax import quant as Q
from opdjax.core import layout

LLAMA_8B = types.SimpleNamespace(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                 num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False)


def test_weight_shapes_count_matches_closed_form_parameter_count():
    n = sum(int(np.prod(s)) for s in layout.weight_shapes(LLAMA_8B).values())
    E, F, L, V = 4096, 14336, 32, 128256
    assert n == 2 * V * E + L * (2 * E * E + 2 * E * 1024 + 3 * E * F + 2 * E) + E == 8_030_261_248
    assert Q.weight_bytes(LLAMA_8B) == 2 * n


def test_fp8_kv_halves_bytes_per_token_and_more_than_doubles_capacity():
    bf16 = Q.kv_cache_bytes_per_token(LLAMA_8B)
    assert bf16 == 2 * 32 * 8 * 128 * 2 == 131072
    fixed = Q.kv_cache_bytes_per_token(LLAMA_8B, Q.get_recipe("fp8_w8a8_kv"))
    assert fixed / bf16 == 0.5
    dyn = Q.kv_cache_bytes_per_token(LLAMA_8B, Q.get_recipe("fp8_w8a8_kv").replace(kv_scale=None))
    assert dyn == 2 * 32 * 8 * (128 + 4)
    assert Q.kv_cache_bytes_per_token(LLAMA_8B, Q.FP8_DEFAULT) == bf16
    mem = 80e9
    w_bf16, w_fp8 = Q.weight_bytes(LLAMA_8B), Q.weight_bytes(LLAMA_8B, Q.FP8_DEFAULT)
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert w_bf16 - w_fp8 == linear - 4 * 32 * 7  # 1 byte saved per linear weight, 7 f32 per-tensor scales/layer
    cap_bf16 = Q.kv_capacity_tokens(LLAMA_8B, mem)
    cap_fp8 = Q.kv_capacity_tokens(LLAMA_8B, mem, Q.get_recipe("fp8_w8a8_kv"))
    ratio = cap_fp8 / cap_bf16
    print(f"8B on 80 GB: weights {w_bf16 / 1e9:.2f} GB -> {w_fp8 / 1e9:.2f} GB; KV capacity {cap_bf16} -> {cap_fp8} "
          f"tokens (x{ratio:.3f})")
    assert ratio >= 1.9 and ratio > 2.0
    assert Q.kv_capacity_tokens(LLAMA_8B, 1e9) == 0
    tied = types.SimpleNamespace(**{**vars(LLAMA_8B), "tie_word_embeddings": True})
    assert "lm_head.weight" not in layout.weight_shapes(tied)


def test_block_and_channel_scale_overheads_counted():
    cfg = types.SimpleNamespace(vocab_size=100, hidden_size=256, intermediate_size=300, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=128, tie_word_embeddings=True)
    base = Q.weight_bytes(cfg, Q.get_recipe("none"))
    assert base == Q.weight_bytes(cfg)
    numel = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 300
    blocks = 2 * 2 + 2 * (2 * 1) + 2 * 2 + 2 * (2 * 3) + (3 * 2)  # q, k+v, o, gate+up, down
    assert Q.weight_bytes(cfg, Q.get_recipe("fp8_block128")) == base - numel + 4 * blocks
    chans = 256 + 2 * 128 + 256 + 2 * 300 + 256
    assert Q.weight_bytes(cfg, Q.get_recipe("int8_w8a8")) == base - numel + 4 * chans

