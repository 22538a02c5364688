"""Tests for opdjax.quant: simulated quantization, recipes, forward hooks, weight noise and memory accounting.

References the code under test did not produce: ml_dtypes casts in numpy (qdq), hand-written block loops,
closed-form byte counts.
"""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from opdjax import quant as Q
from opdjax.core import layout
from opdjax.quant import formats as QF
from opdjax.quant import hooks as QH
from opdjax.rollout.perturb import add_weight_noise

FMT_NP = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
          "int8": (np.int8, 127.0)}
ALL_GRANS = [("tensor", {}), ("channel", {}), ("token", {}), ("block", {"block": (128, 128)}),
             ("block", {"block": (1, 128)})]


def rel_err(y, x):
    y, x = np.asarray(y, np.float64), np.asarray(x, np.float64)
    return float(np.linalg.norm(y - x) / np.linalg.norm(x))


def mean_col_rel_err(y, x):
    """Mean over columns of ||y_j - x_j|| / ||x_j||: every channel counts, whatever its magnitude."""
    y, x = np.asarray(y, np.float64), np.asarray(x, np.float64)
    return float(np.mean(np.linalg.norm(y - x, axis=0) / np.linalg.norm(x, axis=0)))


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


@pytest.fixture(scope="module")
def normal_256():
    return jax.random.normal(jax.random.key(0), (256, 256), jnp.float32)


@pytest.fixture(scope="module")
def grouped_cols():
    """[256, 512] normal data whose 4 groups of 128 columns have scales 1, 1e-2, 1e-4, 1e-6 (channel/block)."""
    x = np.asarray(jax.random.normal(jax.random.key(1), (256, 512), jnp.float32))
    col_scale = np.repeat(10.0 ** (-2.0 * np.arange(4)), 128).astype(np.float32)
    return jnp.asarray(x * col_scale)


# ---------------------------------------------------------------------------------------------------------------------
# qdq accuracy and edge cases
# ---------------------------------------------------------------------------------------------------------------------

def test_e4m3_per_tensor_rel_error_within_7pct_and_matches_ml_dtypes(normal_256):
    y = Q.qdq(normal_256, "e4m3", "tensor")
    err = rel_err(y, normal_256)
    print(f"e4m3 per-tensor rel err {err:.4f}")
    assert 0 < err <= 0.07
    np.testing.assert_array_equal(bits(y), bits(np_qdq(normal_256, "e4m3", None)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_per_channel_reduces_over_input_axis_and_matches_reference(fmt, normal_256):
    q, s = Q.quantize(normal_256, fmt, "channel")
    assert s.shape == (1, 256) and s.dtype == jnp.float32 and q.dtype == Q.FORMATS[fmt].dtype
    y = Q.qdq(normal_256, fmt, "channel")
    np.testing.assert_array_equal(bits(y), bits(np_qdq(normal_256, fmt, 0)))


def test_channel_and_block_beat_tensor_on_channel_scaled_data(grouped_cols):
    x = grouped_cols
    e_t = mean_col_rel_err(Q.qdq(x, "e4m3", "tensor"), x)
    e_c = mean_col_rel_err(Q.qdq(x, "e4m3", "channel"), x)
    e_b = mean_col_rel_err(Q.qdq(x, "e4m3", "block", block=(128, 128)), x)
    print(f"mean per-column rel err: tensor {e_t:.4f} channel {e_c:.4f} block {e_b:.4f}")
    assert e_c < 0.07 and e_b < 0.07
    assert e_c < 0.5 * e_t and e_b < 0.5 * e_t


def test_int8_per_channel_rel_error_below_1pct(grouped_cols):
    err = mean_col_rel_err(Q.qdq(grouped_cols, "int8", "channel"), grouped_cols)
    print(f"int8 per-channel rel err {err:.4f}")
    assert err <= 0.01


def test_token_scale_is_per_row_over_last_axis():
    x = jax.random.normal(jax.random.key(2), (2, 5, 64)) * jnp.arange(1, 11, dtype=jnp.float32).reshape(2, 5, 1)
    q, s = Q.quantize(x, "e4m3", "token")
    assert s.shape == (2, 5, 1)
    np.testing.assert_allclose(s, np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True) / 448.0, rtol=1e-6)
    np.testing.assert_array_equal(bits(Q.qdq(x, "e4m3", "token")), bits(np_qdq(x, "e4m3", -1)))


def test_block_pads_and_crops_and_matches_blockwise_loop():
    x = np.asarray(jax.random.normal(jax.random.key(3), (200, 300)), np.float32) * np.float32(3.0)
    q, s = Q.quantize(x, "e4m3", "block", block=(128, 128))
    assert q.shape == (200, 300) and s.shape == (2, 3)
    ref = np.empty_like(x)
    for i in range(0, 200, 128):
        for j in range(0, 300, 128):
            ref[i:i + 128, j:j + 128] = np_qdq(x[i:i + 128, j:j + 128], "e4m3", None)
            np.testing.assert_allclose(s[i // 128, j // 128], np.abs(x[i:i + 128, j:j + 128]).max() / 448, rtol=1e-6)
    y = Q.qdq(x, "e4m3", "block", block=(128, 128))
    np.testing.assert_array_equal(bits(y), bits(ref))
    # activation-style (1, 128) blocks on [B, T, D]
    a = jax.random.normal(jax.random.key(4), (2, 3, 200))
    _, sa = Q.quantize(a, "e4m3", "block", block=(1, 128))
    assert sa.shape == (2, 3, 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_nan_or_inf_for_large_inputs_and_zeros_any_format_and_granularity(dtype):
    x = jax.random.normal(jax.random.key(5), (130, 260)) * 1e6
    x = x.at[0].set(0.0).at[:, 3].set(0.0).at[5, 5].set(1e6).astype(dtype)
    combos = [(fmt, gran, kw) for fmt in Q.FORMATS for gran, kw in ALL_GRANS]

    @jax.jit  # one compile for all 15 combinations
    def run(x):
        return ([Q.qdq(x, f, g, **kw) for f, g, kw in combos],
                [Q.qdq(jnp.zeros((4, 8), dtype), f, g, **kw) for f, g, kw in combos])

    ys, zs = run(x)
    for (fmt, gran, kw), y, z in zip(combos, ys, zs):
        assert y.dtype == dtype and y.shape == x.shape
        assert bool(jnp.all(jnp.isfinite(y))), (fmt, gran, kw)
        assert bool(jnp.all(y[0] == 0)) and bool(jnp.all(z == 0)), (fmt, gran, kw)
        assert rel_err(y.astype(jnp.float32), x.astype(jnp.float32)) < 0.15, (fmt, gran, kw)


def test_fixed_scale_saturates_instead_of_nan():
    x = jnp.array([1e6, -1e6, 1000.0, 300.0, 0.1, 0.0])
    y = Q.qdq(x, "e4m3", scale=1.0)
    np.testing.assert_array_equal(y[:4], [448.0, -448.0, 448.0, 288.0])  # 300 rounds to 288 in e4m3
    assert bool(jnp.all(jnp.isfinite(y)))
    q, s = Q.quantize(x, "e4m3", scale=1.0)
    assert q.dtype == jnp.float8_e4m3fn and float(s) == 1.0


def test_ste_gradient_is_identity(normal_256):
    c = jax.random.normal(jax.random.key(6), normal_256.shape)
    for fmt in Q.FORMATS:
        g = jax.grad(lambda x: jnp.sum(Q.qdq(x, fmt, "channel", ste=True) * c))(normal_256)
        np.testing.assert_array_equal(g, c)
    # the STE value is exactly the qdq value
    np.testing.assert_array_equal(bits(Q.qdq(normal_256, "e4m3", ste=True)), bits(Q.qdq(normal_256, "e4m3")))


def test_bf16_input_returns_bf16_close_to_input(normal_256):
    x = normal_256.astype(jnp.bfloat16)
    for fmt in Q.FORMATS:
        y = Q.qdq(x, fmt, "token")
        assert y.dtype == jnp.bfloat16
        assert rel_err(y.astype(jnp.float32), x.astype(jnp.float32)) < (0.15 if fmt == "e5m2" else 0.07)


def test_e5m2_coarser_than_e4m3_but_works(normal_256):
    e5 = rel_err(Q.qdq(normal_256, "e5m2"), normal_256)
    e4 = rel_err(Q.qdq(normal_256, "e4m3"), normal_256)
    q, _ = Q.quantize(normal_256, "e5m2")
    assert q.dtype == jnp.float8_e5m2
    assert e4 < e5 < 0.15
    np.testing.assert_array_equal(bits(Q.qdq(normal_256, "e5m2")), bits(np_qdq(normal_256, "e5m2", None)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_quantize_then_dequantize_equals_qdq_bit_for_bit_eager_and_jit(fmt):
    x = (jax.random.normal(jax.random.key(7), (3, 130, 200)) * 5).astype(jnp.bfloat16)
    for gran, kw in ALL_GRANS:
        q, s = Q.quantize(x, fmt, gran, **kw)
        y = Q.dequantize(q, s, x.dtype, block=kw.get("block"))
        np.testing.assert_array_equal(bits(y), bits(Q.qdq(x, fmt, gran, **kw)), err_msg=f"{gran} {kw}")
    # inside a user's jit (everything inlined into one program) the values are the same bits
    y_jit = jax.jit(lambda v: [Q.dequantize(*Q.quantize(v, fmt, g, **kw), v.dtype, block=kw.get("block"))
                               for g, kw in ALL_GRANS])(x)
    for (gran, kw), y in zip(ALL_GRANS, y_jit):
        np.testing.assert_array_equal(bits(y), bits(Q.qdq(x, fmt, gran, **kw)), err_msg=f"jit {gran} {kw}")


@pytest.mark.parametrize("dt", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_f8_bit_decoder_equals_ml_dtypes_cast_for_every_finite_code(dt):
    codes = np.arange(256, dtype=np.uint8).view(dt)
    ref = codes.astype(np.float32)
    got = np.asarray(jax.jit(QF._decode_f8)(jnp.asarray(codes)))
    finite = np.isfinite(ref)
    assert finite.sum() >= 248
    np.testing.assert_array_equal(bits(got[finite]), bits(ref[finite]))


def _f8_values_converted_back(hlo: str) -> list[str]:
    """Lines of an HLO module that `convert` an f8-typed value to another type (the pair XLA GPU may cancel)."""
    f8_names = set(re.findall(r"(%[\w.\-]+) = f8\w+\[", hlo))
    return [line for line in hlo.splitlines()
            if re.search(r"= \w+\[[^\]]*\]\{?[^ ]* convert\((%[\w.\-]+)\)", line)
            and re.search(r"convert\((%[\w.\-]+)\)", line).group(1) in f8_names]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_compiled_qdq_rounds_through_f8_and_never_converts_f8_back(fmt):
    """The optimised program must hold the f8 rounding and read it back only through bitcast-convert to u8.

    XLA's GPU compiler cancels convert(convert(x, f8), f32) under default flags; a bitcast whose bits feed integer
    arithmetic cannot be cancelled. If someone goes back to `q.astype(float32)`, the f8 -> float convert shows up
    here (it does on every backend's HLO) and this fails.
    """
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    hooks = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv" if fmt == "e4m3" else "e5m2_w8a8"))
    prog = jax.jit(lambda a: jnp.dot(hooks.act("model.layers.0.mlp.up_proj", a), a.T) + Q.qdq(a, fmt).sum())
    hlo = prog.lower(x).compile().as_text()
    assert re.search(r"= f8e\w+\[64,128\]\S* convert\(", hlo), "no rounding to f8 in the compiled program"
    assert re.search(r"= u8\[64,128\]\S* bitcast-convert\(", hlo), "f8 codes are not read back as bits"
    assert _f8_values_converted_back(hlo) == []
    # and the values did change
    assert float(jnp.mean((Q.qdq(x, fmt) != x).astype(jnp.float32))) > 0.5


def test_check_effective_reports_fractions_and_raises_when_rounding_is_removed(monkeypatch):
    fr = Q.check_effective("fp8_w8a8_kv", jnp.bfloat16)
    assert set(fr) == {"weights model.layers.*.self_attn.q_proj", "activations", "kv_cache"}
    assert all(0.5 < v <= 1.0 for v in fr.values())
    assert Q.check_effective("none") == {}
    # A compiler that drops the rounding is simulated by a cast that does nothing: every part must be refused,
    # and so must an engine built with the recipe.
    monkeypatch.setattr(QF, "_cast", lambda y, f: y)
    monkeypatch.setattr(QF, "_to_f32", lambda q: q.astype(jnp.float32))
    QH._changed_fraction.cache_clear()
    QF._qdq_jit.clear_cache()
    try:
        with pytest.raises(Q.IneffectiveQuantError, match=r"fp8_weights_only.*unchanged on backend 'cpu'"):
            Q.check_effective("fp8_weights_only", jnp.bfloat16)
        with pytest.raises(Q.IneffectiveQuantError, match="kv_cache"):
            Q.check_effective("fp8_kv_only")
        from opdjax.models.config import ModelConfig
        from opdjax.rollout.jax_engine import JaxEngine
        with pytest.raises(Q.IneffectiveQuantError, match="measure nothing"):
            JaxEngine(ModelConfig(), recipe="fp8_w8a8")
    finally:
        QH._changed_fraction.cache_clear()
        QF._qdq_jit.clear_cache()


def test_bad_format_and_granularity_raise_with_valid_names():
    with pytest.raises(ValueError, match="e4m3"):
        Q.qdq(jnp.ones(3), "fp4")
    with pytest.raises(ValueError, match="channel"):
        Q.qdq(jnp.ones(3), "e4m3", "row")
    with pytest.raises(ValueError, match="rank"):
        Q.quantize(jnp.ones(3), "e4m3", "block")


# ---------------------------------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------------------------------

def _tiny_named(dtype=jnp.float32, layers=2, E=32, F=32, V=64):
    """HF-named tensors of a tiny decoder; every linear kernel is [32, 32] so few shapes get compiled."""
    key = jax.random.key(8)
    named = {}
    cfg = types.SimpleNamespace(vocab_size=V, hidden_size=E, intermediate_size=F, num_layers=layers, num_heads=2,
                                num_kv_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True,
                                qk_norm=True)
    for i, (name, shape) in enumerate(layout.weight_shapes(cfg).items()):
        named[name] = (jax.random.normal(jax.random.fold_in(key, i), shape) * 0.1).astype(dtype)
    return named


LINEAR_SUFFIXES = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_recipe_quantizes_linear_weights_only(dtype):
    named = _tiny_named(dtype)
    out = Q.apply_to_named(Q.FP8_DEFAULT, named)
    assert Q.get_recipe("fp8_w8a8") is Q.FP8_DEFAULT
    assert set(out) == set(named)
    for name, arr in named.items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        if name.endswith(LINEAR_SUFFIXES):
            assert not np.array_equal(bits(out[name]), bits(arr)), name
            shards = Q.fused_shards(name) or (name,)  # vLLM's fused qkv / gate_up: one scale over the shards
            amax = max(np.abs(np.asarray(named[n], np.float32)).max() for n in shards)
            scale = np.float32(amax) * np.float32(1 / 448)
            np.testing.assert_array_equal(bits(out[name]), bits(Q.qdq(arr, "e4m3", "tensor", scale=scale)))
        else:  # embed, lm_head, norms, q/k norms, biases
            assert out[name] is arr, name


def test_fused_scales_match_what_vllm_serves_and_can_be_turned_off():
    """q/k/v and gate/up share one scale (amax over the concatenation / 448, as vLLM's online FP8 re-quantizes a
    fused layer); o/down keep their own; fused_scales=false gives one scale per HF tensor; a recipe file says so."""
    assert Q.fused_shards("model.layers.3.self_attn.k_proj.weight") == tuple(
        f"model.layers.3.self_attn.{m}_proj.weight" for m in "qkv")
    assert Q.fused_shards("model.layers.3.mlp.up_proj.weight") == ("model.layers.3.mlp.gate_proj.weight",
                                                                   "model.layers.3.mlp.up_proj.weight")
    assert Q.fused_shards("model.layers.3.mlp.down_proj.weight") == () == Q.fused_shards("lm_head.weight")
    named = _tiny_named()
    named["model.layers.0.self_attn.v_proj.weight"] = named["model.layers.0.self_attn.v_proj.weight"] * 50.0
    fused = Q.quantize_named(Q.FP8_DEFAULT, named)
    own = Q.quantize_named(Q.FP8_DEFAULT.replace(fused_scales=False), named)
    sq, sk, sv = (float(fused[f"model.layers.0.self_attn.{m}_proj.weight"][1]) for m in "qkv")
    assert sq == sk == sv == pytest.approx(np.abs(np.asarray(named["model.layers.0.self_attn.v_proj.weight"])).max()
                                           / 448, rel=1e-6)
    assert float(own["model.layers.0.self_attn.q_proj.weight"][1]) < sq / 10  # its own, much smaller amax
    assert Q.Recipe.from_dict({"base": "fp8_w8a8", "fused_scales": False}).fused_scales is False
    with pytest.raises(Q.RecipeError, match="fused_scales"):
        Q.Recipe.from_dict({"base": "fp8_w8a8", "fused_scales": "yes"})


@pytest.mark.parametrize("name", sorted(Q.RECIPES))
def test_quantize_named_dequantizes_to_apply_to_named_bit_for_bit(name):
    recipe = Q.get_recipe(name)
    named = _tiny_named(jnp.bfloat16)
    sim = Q.apply_to_named(recipe, named)
    qn = Q.quantize_named(recipe, named)
    deq = Q.dequantize_named(recipe, qn, {k: v.dtype for k, v in named.items()})
    for k in named:
        np.testing.assert_array_equal(bits(deq[k]), bits(sim[k]), err_msg=k)
        if isinstance(qn[k], tuple):
            assert qn[k][0].dtype == Q.FORMATS[Q.module_spec(recipe, k[:-7]).fmt].dtype


def test_first_match_wins_and_none_keeps_high_precision():
    spec = Q.QSpec("int8", "channel")
    r = Q.Recipe(name="t", weights=(("model.layers.0.*", None), ("model.layers.*.mlp.*_proj", spec),
                                    ("model.layers.*", Q.QSpec("e5m2"))))
    assert Q.module_spec(r, "model.layers.0.mlp.up_proj") is None
    assert Q.module_spec(r, "model.layers.1.mlp.up_proj") == spec
    assert Q.module_spec(r, "model.layers.1.self_attn.q_proj") == Q.QSpec("e5m2")
    assert Q.module_spec(r, "lm_head") is None
    named = _tiny_named()
    out = Q.apply_to_named(r, named)
    assert out["model.layers.0.mlp.up_proj.weight"] is named["model.layers.0.mlp.up_proj.weight"]
    assert out["model.layers.1.input_layernorm.weight"] is named["model.layers.1.input_layernorm.weight"]  # 1-D
    assert out["model.layers.1.self_attn.q_proj.bias"] is named["model.layers.1.self_attn.q_proj.bias"]
    np.testing.assert_array_equal(out["model.layers.1.mlp.up_proj.weight"],
                                  Q.qdq(named["model.layers.1.mlp.up_proj.weight"], "int8", "channel"))


def test_presets_registry_and_unknown_names():
    expected = {"none", "fp8_weights_only", "fp8_w8a8", "fp8_w8a8_tensor", "fp8_block128", "fp8_w8a8_kv",
                "fp8_kv_only", "e5m2_w8a8", "int8_w8a8"}
    assert expected <= set(Q.RECIPES)
    for name, r in Q.RECIPES.items():
        assert r.name == name and hash(r) == hash(dataclasses.replace(r))
    assert Q.get_recipe("none").is_noop
    # the default mirrors vLLM quantization="fp8": per-tensor e4m3 weights, dynamic per-token e4m3 activations
    assert Q.module_spec(Q.FP8_DEFAULT, "model.layers.3.mlp.down_proj") == Q.QSpec("e4m3", "tensor")
    assert Q.FP8_DEFAULT.activations == Q.QSpec("e4m3", "token") and Q.FP8_DEFAULT.kv_cache is None
    for hp in ("lm_head", "model.embed_tokens", "model.norm", "model.layers.0.input_layernorm",
               "model.layers.0.mlp.gate", "model.layers.0.self_attn.q_norm"):
        assert Q.module_spec(Q.FP8_DEFAULT, hp) is None, hp
    assert Q.get_recipe("fp8_w8a8_kv").kv_scale == 1.0 and Q.get_recipe("fp8_kv_only").activations is None
    assert Q.module_spec(Q.get_recipe("fp8_kv_only"), "model.layers.0.mlp.up_proj") is None
    with pytest.raises(ValueError, match="fp8_w8a8_kv"):
        Q.get_recipe("fp9")


def test_recipe_from_dict_round_trip_and_errors():
    d = {"name": "mine", "weights": [["model.layers.0.*", None], ["model.layers.*.mlp.*_proj",
                                                                  {"fmt": "e4m3", "granularity": "block",
                                                                   "block": [64, 64]}]],
         "activations": "e4m3", "kv_cache": {"fmt": "e5m2", "granularity": "token"}, "kv_scales": [[0.1, 0.2], 0.3]}
    r = Q.Recipe.from_dict(d)
    assert r.weights[1][1] == Q.QSpec("e4m3", "block", (64, 64)) and r.kv_scales == ((0.1, 0.2), 0.3)
    assert Q.Recipe.from_dict(r.to_dict()) == r
    hash(r)
    assert Q.Recipe.from_dict({"base": "fp8_w8a8_kv"}) == Q.get_recipe("fp8_w8a8_kv")
    assert Q.Recipe.from_dict({"base": "fp8_w8a8", "kv_cache": "e4m3", "kv_scale": 1.0}).kv_scale == 1.0
    for bad, match in [({"wieghts": []}, "valid keys"), ({"activations": {"fmt": "fp4"}}, "valid formats"),
                       ({"activations": {"fmt": "e4m3", "gran": "token"}}, "valid keys"),
                       ({"kv_cache": {"granularity": "channel"}}, "kv_cache granularity"),
                       ({"kv_scale": 1.0}, "kv_cache is None"), ({"base": "nope"}, "valid recipes")]:
        with pytest.raises(ValueError, match=match):
            Q.Recipe.from_dict(bad)


# ---------------------------------------------------------------------------------------------------------------------
# Forward hooks
# ---------------------------------------------------------------------------------------------------------------------

def test_forward_quant_hashable_and_usable_inside_jit():
    fq = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv"))
    assert hash(fq) == hash(Q.forward_quant("fp8_w8a8_kv")) and fq == Q.forward_quant("fp8_w8a8_kv")
    x = jax.random.normal(jax.random.key(9), (2, 5, 32)) * 3

    @jax.jit
    def f(x):
        return fq.act("model.layers.0.mlp.down_proj", x), fq.act("lm_head", x), fq.act("model.embed_tokens", x)

    a, b, c = f(x)
    np.testing.assert_array_equal(a, Q.qdq(x, "e4m3", "token"))
    assert not np.array_equal(a, x)
    np.testing.assert_array_equal(b, x)
    np.testing.assert_array_equal(c, x)
    # static argument use
    g = jax.jit(lambda fq, x: fq.act("model.layers.1.self_attn.q_proj", x), static_argnums=0)
    np.testing.assert_array_equal(g(fq, x), a)
    # no-op recipes and weight-only recipes leave activations alone
    for name in ("none", "fp8_weights_only", "fp8_kv_only"):
        np.testing.assert_array_equal(Q.forward_quant(name).act("model.layers.0.mlp.up_proj", x), x)


def test_calibrated_kv_scales_keep_small_values_out_of_the_subnormals():
    """K/V with amax 0.005 sit among e4m3's subnormals (below 2**-6) under vLLM's fixed scale 1.0; the calibrated
    scale amax / 448 maps them onto the normal range, so the round trip loses far less."""
    v = np.asarray(jax.random.normal(jax.random.key(11), (2, 8, 2, 16))) * 0.0015
    (scale, _), = Q.calibrate_kv_scales([[np.abs(v).max(), 1.0]])
    mse = lambda s: float(np.mean((np.asarray(Q.qdq(jnp.asarray(v), "e4m3", scale=s)) - v) ** 2))  # noqa: E731
    assert mse(scale) < 0.01 * mse(1.0)


def test_kv_hook_fixed_dynamic_and_calibrated_scales():
    k = jax.random.normal(jax.random.key(10), (2, 3, 2, 16)) * 4  # [B, T, K, H]
    fixed = Q.forward_quant("fp8_w8a8_kv")
    np.testing.assert_array_equal(jax.jit(lambda k: fixed.kv(0, "k", k))(k), Q.qdq(k, "e4m3", scale=1.0))
    dyn = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv").replace(kv_scale=None))
    np.testing.assert_array_equal(dyn.kv(0, "v", k), np_qdq(k, "e4m3", -1))  # per (b, t, head) over head_dim
    assert Q.forward_quant("fp8_w8a8").kv(0, "k", k) is k
    scales = Q.calibrate_kv_scales([[8.0, 16.0], [4.48, 44.8]])
    np.testing.assert_allclose(scales, [[8 / 448, 16 / 448], [0.01, 0.1]], rtol=1e-12)
    assert all(isinstance(s, tuple) and len(s) == 2 for s in scales)
    cal = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv").replace(kv_scale=None, kv_scales=scales))
    np.testing.assert_array_equal(cal.kv(1, "v", k), Q.qdq(k, "e4m3", scale=0.1))
    # traced layer index (scan over layers) gives the same as the static lookup
    traced = jax.jit(lambda i, k: cal.kv(i, "k", k))(jnp.int32(1), k)
    np.testing.assert_array_equal(traced, cal.kv(1, "k", k))
    assert Q.calibrate_kv_scales(np.array([448.0, 0.0])) == (1.0, Q.AMAX_EPS / 448)
    with pytest.raises(ValueError, match="kind"):
        fixed.kv(0, "q", k)


# ---------------------------------------------------------------------------------------------------------------------
# Weight noise
# ---------------------------------------------------------------------------------------------------------------------

def _params():
    ks = jax.random.split(jax.random.key(11), 3)
    return {"a": {"kernel": jax.random.normal(ks[0], (128, 256)) * 3.0,
                  "bias": (jax.random.normal(ks[1], (256,)) * 0.01).astype(jnp.bfloat16)},
            "emb": jax.random.normal(ks[2], (512, 64)).astype(jnp.bfloat16) * 0.5,
            "step": jnp.array(7, jnp.int32)}


def _rms(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean(x ** 2)))


def test_relative_noise_std_matches_sigma_times_rms_and_preserves_dtypes():
    p = _params()
    sigma = 0.05
    noisy = add_weight_noise(p, sigma, jax.random.key(0))
    assert jax.tree.structure(noisy) == jax.tree.structure(p)
    for path in (("a", "kernel"), ("emb",)):
        w, n = p, noisy
        for k in path:
            w, n = w[k], n[k]
        assert n.dtype == w.dtype
        d = np.asarray(n, np.float64) - np.asarray(w, np.float64)
        assert np.std(d) == pytest.approx(sigma * _rms(w), rel=0.06), path
    assert noisy["step"] is p["step"]
    # absolute mode
    ab = add_weight_noise(p, 0.01, jax.random.key(0), mode="absolute")
    assert np.std(np.asarray(ab["a"]["kernel"]) - np.asarray(p["a"]["kernel"])) == pytest.approx(0.01, rel=0.05)


def test_noise_sigma_zero_identity_deterministic_and_filter():
    p = _params()
    assert add_weight_noise(p, 0.0, jax.random.key(0)) is p
    n1 = add_weight_noise(p, 0.1, jax.random.key(3))
    n2 = add_weight_noise(p, 0.1, jax.random.key(3))
    n3 = add_weight_noise(p, 0.1, jax.random.key(4))
    np.testing.assert_array_equal(n1["a"]["kernel"], n2["a"]["kernel"])
    assert not np.array_equal(n1["a"]["kernel"], n3["a"]["kernel"])
    # independent keys per leaf: leaves of identical shape and content get different noise
    same = {"x": jnp.ones((64, 64)), "y": jnp.ones((64, 64))}
    ns = add_weight_noise(same, 0.1, jax.random.key(0))
    assert not np.array_equal(ns["x"], ns["y"])
    only_kernels = add_weight_noise(p, 0.1, jax.random.key(3), filter=lambda path: path.endswith("kernel"))
    assert only_kernels["emb"] is p["emb"] and only_kernels["a"]["bias"] is p["a"]["bias"]
    np.testing.assert_array_equal(only_kernels["a"]["kernel"], n1["a"]["kernel"])
    with pytest.raises(ValueError, match="relative"):
        add_weight_noise(p, 0.1, jax.random.key(0), mode="gauss")


# ---------------------------------------------------------------------------------------------------------------------
# Memory accounting
# ---------------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.mesh
def test_sharded_per_channel_qdq_equals_unsharded(cpu_devices):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    w = (jax.random.normal(jax.random.key(12), (64, 256)) * jnp.linspace(0.01, 2.0, 256)).astype(jnp.bfloat16)
    ref = Q.qdq(w, "e4m3", "channel")
    f = jax.jit(lambda w: Q.qdq(w, "e4m3", "channel"))
    for spec in (P(None, "x"), P("x", None)):  # shard the kept axis, then the reduced axis
        ws = jax.device_put(w, NamedSharding(mesh, spec))
        y = f(ws)
        assert len(y.sharding.device_set) == 8
        np.testing.assert_array_equal(bits(jax.device_get(y)), bits(ref))
    q, s = jax.jit(lambda w: Q.quantize(w, "int8", "channel"))(jax.device_put(w, NamedSharding(mesh, P(None, "x"))))
    q0, s0 = Q.quantize(w, "int8", "channel")
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(s, s0)
