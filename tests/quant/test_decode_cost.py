"""opdjax.quant.decode_cost: the bytes-moved decode model against closed-form counts."""

from __future__ import annotations

import pytest

from opdjax import quant as Q
from opdjax.core.errors import ConfigError
from opdjax.models.presets import model_config
from opdjax.quant import decode_cost as D

FP8 = Q.get_recipe("fp8_w8a8_kv")
GIB = 1 << 30


def test_qwen3_1p7b_shape_counts_in_closed_form():
    cfg = model_config("qwen3-1.7b")
    E, F, L, H, K, Dh, V = 2048, 6144, 28, 16, 8, 128, 151936
    linear = L * (E * H * Dh + 2 * E * K * Dh + H * Dh * E + 3 * E * F)
    norms = L * (2 * E + 2 * Dh) + E
    assert Q.weight_bytes(cfg) == 2 * (V * E + linear + norms)  # tied: the table is also the LM head
    assert D.decode_weight_bytes(cfg) == Q.weight_bytes(cfg)
    # FP8: 1 byte per linear weight + one f32 scale per linear (7 per layer); table and norms stay BF16
    assert Q.weight_bytes(cfg, FP8) == 2 * (V * E + norms) + linear + 4 * 7 * L
    assert Q.kv_cache_bytes_per_token(cfg) == 2 * L * K * Dh * 2 == 114688
    assert Q.kv_cache_bytes_per_token(cfg, FP8) == 57344


def test_max_batch_is_capacity_over_context():
    cfg = model_config("qwen3-1.7b")
    mem, ctx = 40 * GIB, 2048
    for recipe in (None, FP8):
        free = mem - Q.weight_bytes(cfg, recipe)
        assert D.max_batch(cfg, mem, ctx, recipe) == free // Q.kv_cache_bytes_per_token(cfg, recipe) // ctx
    assert D.max_batch(cfg, mem, ctx) == 168 and D.max_batch(cfg, mem, ctx, FP8) == 348
    assert D.max_batch(cfg, 1 * GIB, ctx) == 0  # the weights alone do not fit
    with pytest.raises(ConfigError, match="context_len"):
        D.max_batch(cfg, mem, 0)


def test_untied_embeddings_are_gathered_not_read():
    cfg = model_config("qwen3-8b")
    table = 151936 * 4096 * 2
    assert D.decode_weight_bytes(cfg) == Q.weight_bytes(cfg) - table
    assert D.decode_weight_bytes(cfg, FP8) == Q.weight_bytes(cfg, FP8) - table


def test_step_bytes_and_the_model_in_closed_form():
    cfg = model_config("qwen3-1.7b")
    w, kv = D.decode_weight_bytes(cfg), Q.kv_cache_bytes_per_token(cfg)
    assert D.decode_step_bytes(cfg, 8, 100) == w + 800 * kv
    wf, kvf = D.decode_weight_bytes(cfg, FP8), kv // 2
    assert D.decode_step_bytes(cfg, 8, 100, FP8) == wf + 800 * kvf
    # dequantize-then-read: + a BF16 copy written and read again
    assert D.decode_step_bytes(cfg, 8, 100, FP8, kv_dequant_copy=True) == wf + 800 * (kvf + 2 * kv)
    assert D.decode_step_bytes(cfg, 8, 100, None, kv_dequant_copy=True) == w + 800 * kv  # nothing to dequantize
    m = D.decode_model(cfg, 40 * GIB, 2048, 3.35e12)
    assert m["kind"] == "model" and m["batch"] == 168
    assert m["bytes"] == w + 168 * 2048 * kv
    assert m["step_s"] == pytest.approx(m["bytes"] / 3.35e12)
    assert m["per_token_s"] == pytest.approx(m["step_s"] / 168) and m["tok_s"] == pytest.approx(168 / m["step_s"])
    f = D.decode_model(cfg, 40 * GIB, 2048, 3.35e12, FP8)
    # the memory is full either way (weights + KV ~ 40 GiB), so the step time barely moves and tokens/s follow the
    # batch: ratio ~ 348 / 168 ~ 2.07
    assert f["tok_s"] / m["tok_s"] == pytest.approx(2.07, abs=0.01)
    same = D.decode_model(cfg, 40 * GIB, 2048, 3.35e12, FP8, batch=168)
    assert same["batch"] == 168 and same["step_s"] < m["step_s"]


def test_bandwidth_names_numbers_and_errors():
    assert D.bandwidth_of("h100-sxm") == 3.35e12 and D.bandwidth_of("H200") == 4.8e12
    assert D.bandwidth_of(3.35) == 3.35e12 and D.bandwidth_of("2e12") == 2e12
    with pytest.raises(ConfigError, match="h100-sxm"):
        D.bandwidth_of("a100")
    with pytest.raises(ConfigError, match="positive"):
        D.bandwidth_of(0)
    with pytest.raises(ConfigError, match="bandwidth"):
        D.decode_model(model_config("qwen3-1.7b"), 40 * GIB, 2048, 0.0)
