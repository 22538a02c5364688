"""4-bit weight formats (W4A16): the e2m1 grid against ml_dtypes, MXFP4 (e8m0) and NVFP4 (e4m3) block scales, INT4
per-group-128, their per-block error bounds, the presets on a tiny model, their capacity, the refusal to serve them
on vLLM, and their engine-vs-learner mismatch.

References the code under test did not produce: ml_dtypes float4_e2m1fn / float8_e4m3fn casts in numpy, error
bounds derived by hand, closed-form byte counts.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml

from opdjax import quant as Q
from opdjax.admission.budget import AdmissionError
from opdjax.admission.search import vllm_settings as search_vllm_settings
from opdjax.config import ConfigError, TrainConfig, load
from opdjax.core import mismatch
from opdjax.core.logprobs import token_logprobs
from opdjax.models import decoder, hf
from opdjax.models.tiny import tiny_config
from opdjax.quant import decode_cost
from opdjax.rollout import EngineMismatch, JaxEngine, SamplingParams
from opdjax.rollout.vllm_settings import VllmSettingsError, engine_dtype, vllm_settings
from opdjax.sync.manifest import BridgeError
from opdjax.sync.publisher import hf_stream
from tests.quant.reference import bits

FOUR_BIT = ("mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16_g128")
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _blocks(a, bm):
    """[in, out] -> [ceil(in/bm), bm, out] (zero padded): the (bm, 1) blocks of a kernel, one per row of axis 0."""
    a = np.asarray(a, np.float32)
    pad = (-a.shape[0]) % bm
    return np.pad(a, ((0, pad), (0, 0))).reshape(-1, bm, a.shape[1])


@pytest.fixture(scope="module")
def kernel():
    """[200, 24] normal weights (200 is a multiple of none of 16, 32, 128: the padded last block counts too)."""
    return jax.random.normal(jax.random.key(3), (200, 24), jnp.float32)


# ---------------------------------------------------------------------------------------------------------------------
# e2m1 values
# ---------------------------------------------------------------------------------------------------------------------

def test_e2m1_rounding_matches_ml_dtypes_float4_cast_bit_for_bit():
    """Every multiple of 1/64 in [-8, 8], every tie between two grid values and its float32 neighbours, -0.0 and
    far out-of-range values: quantize(x, "e2m1", scale=1) == ml_dtypes' float4_e2m1fn cast (round to nearest even,
    saturating at ±6 — asserted, so the comparison covers the clip)."""
    grid = np.concatenate([-E2M1_VALUES[::-1], E2M1_VALUES])
    ties = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([np.arange(-8, 8.001, 1 / 64), ties, [7.0, -7.0, 100.0, -1e30, 3e38, -0.0, 1e-30]])
    x = x.astype(np.float32)
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))])
    ref = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ref[np.abs(x) > 6], 6 * np.sign(x[np.abs(x) > 6]))  # ml_dtypes saturates
    q, s = Q.quantize(jnp.asarray(x), "e2m1", scale=1.0)
    assert q.dtype == jnp.float32 and float(s) == 1.0
    np.testing.assert_array_equal(bits(np.asarray(q)), bits(ref))
    assert set(np.abs(np.asarray(q)).tolist()) == set(E2M1_VALUES.tolist())
    assert [float(Q.round_e2m1(jnp.float32(v))) for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)] == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ties go to the even mantissa


# ---------------------------------------------------------------------------------------------------------------------
# Scale rules
# ---------------------------------------------------------------------------------------------------------------------

def test_mxfp4_scales_are_powers_of_two_from_the_exponent_and_values_clamp_to_6(kernel):
    q, s = Q.quantize(kernel, "e2m1", "block", block=(32, 1), scale_fmt="e8m0")
    assert s.shape == (7, 24) and q.shape == kernel.shape
    s = np.asarray(s)
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)  # powers of two
    amax = np.abs(_blocks(kernel, 32)).max(axis=1)
    np.testing.assert_array_equal(s, np.exp2(np.floor(np.log2(amax.astype(np.float64))) - 2))
    assert np.all((amax / s >= 4) & (amax / s < 8))  # x / scale may exceed 6 before the clamp
    assert set(np.abs(np.asarray(q)).ravel().tolist()) <= set(E2M1_VALUES.tolist())
    # exact at powers of two (a float log2 could round either way), and the clamp: 7.9 * scale -> 6 * scale
    x = jnp.asarray(np.array([[4.0], [-1.0]] + [[0.0]] * 30, np.float32))
    assert float(Q.quantize(x, "e2m1", "block", block=(32, 1), scale_fmt="e8m0")[1][0, 0]) == 1.0
    x = jnp.asarray(np.array([[7.9], [1.0]] + [[0.0]] * 30, np.float32))
    q, s = Q.quantize(x, "e2m1", "block", block=(32, 1), scale_fmt="e8m0")
    assert float(s[0, 0]) == 1.0 and float(q[0, 0]) == 6.0 and float(q[1, 0]) == 1.0
    assert float(Q.e8m0_scale(jnp.float32(0.0))) == 2.0 ** (math.floor(math.log2(Q.AMAX_EPS)) - 2)  # zero block


def test_nvfp4_block_scales_are_e4m3_values_and_reconstruct_the_effective_scale(kernel):
    x = kernel.at[:, 5].multiply(1e-3)  # blocks far below the tensor's amax still get normal e4m3 scales
    q, s = Q.quantize(x, "e2m1", "block", block=(16, 1), scale_fmt="e4m3")
    amax_b = np.abs(_blocks(x, 16)).max(axis=1)
    s_b, s_t = (np.asarray(a) for a in Q.nvfp4_scales(jnp.asarray(amax_b), jnp.max(jnp.abs(x))))
    assert s.shape == s_b.shape == (13, 24) and s_t.shape == ()
    np.testing.assert_array_equal(s_b, s_b.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))  # e4m3 values
    np.testing.assert_allclose(s_t, np.abs(np.asarray(x)).max() / (6 * 448), rtol=1e-6)
    np.testing.assert_allclose(s_b, amax_b / 6 / s_t, rtol=2.0 ** -4)  # e4m3 rounds to within half an ulp
    np.testing.assert_array_equal(bits(np.asarray(s)), bits(s_b * s_t))  # the effective scale
    # an all-zero block is floored at e4m3's smallest subnormal (positive scale, q = 0, no NaN)
    z = x.at[:16, 0].set(0.0)
    s_b0, _ = Q.nvfp4_scales(jnp.zeros(()), jnp.max(jnp.abs(z)))
    assert float(s_b0) == 2.0 ** -9 == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).smallest_subnormal)
    assert np.all(np.asarray(Q.qdq(z, "e2m1", "block", block=(16, 1), scale_fmt="e4m3"))[:16, 0] == 0)


def test_int4_codes_are_integers_in_pm7_with_one_f32_scale_per_group_of_128_inputs(kernel):
    q, s = Q.quantize(kernel, "int4", "block", block=(128, 1))
    q = np.asarray(q)
    assert q.dtype == np.float32 and s.shape == (2, 24)
    assert np.all(q == np.round(q)) and q.min() >= -7 and q.max() <= 7 and {-7.0, 7.0} <= set(q.ravel().tolist())
    amax = np.abs(_blocks(kernel, 128)).max(axis=1)
    np.testing.assert_array_equal(np.asarray(s), amax * np.float32(1 / 7))


# Max |x - x'| over a block, as a fraction of the block's amax (x / scale = y, amax / scale = m):
#   e2m1, f32 scale amax/6 (m = 6): half the largest step, 2/2 = 1, over 6 -> 1/6.
#   MXFP4 (m in [4, 8)): m <= 6: at most max(1/2, min(1, m - 4)) / m <= 1/5; m in (6, 8): the clamp costs m - 6,
#     (m - 6)/m < 1/4 — the true bound is 1/4, approached as amax -> 2^(E+1) (tested above: 7.9 -> 6, 0.24).
#   NVFP4: m = 6 * (amax/6/s_t) / s_b with s_b e4m3-rounded (relative error <= 2^-4): m in [6/(1+2^-4), 6/(1-2^-4)],
#     so max(1, m - 6)/m <= (1 + 2^-4)/6 = 17/96 — for blocks whose s_b is a normal e4m3 value (>= 2^-6), i.e.
#     amax_block >= amax_tensor * 2^-6 / 448; blocks further below the tensor's amax get subnormal or floored
#     scales and coarser values (NVFP4's limited range of block scales, shown by the 6-decade columns here).
#   int4, scale amax/7: half a step, 1/2 of 7 -> 1/14.
BOUNDS = [("e2m1", (32, 1), "f32", 1 / 6), ("e2m1", (32, 1), "e8m0", 1 / 4), ("e2m1", (16, 1), "e4m3", 17 / 96),
          ("int4", (128, 1), "f32", 1 / 14)]


@pytest.mark.parametrize("fmt, block, scale_fmt, bound", BOUNDS)
def test_per_block_error_within_the_derived_fraction_of_block_amax(fmt, block, scale_fmt, bound, kernel):
    x = kernel * jnp.asarray(np.logspace(-3, 3, kernel.shape[1]), jnp.float32)  # columns over 6 decades
    y = Q.qdq(x, fmt, "block", block=block, scale_fmt=scale_fmt)
    err = np.abs(_blocks(y, block[0]) - _blocks(x, block[0])).max(axis=1)
    amax = np.abs(_blocks(x, block[0])).max(axis=1)
    ratio = err / amax
    normal = amax * 448 / amax.max() >= 2.0 ** -6 if scale_fmt == "e4m3" else np.ones(amax.shape, bool)
    print(f"{fmt}/{scale_fmt}: max per-block error / amax {ratio[normal].max():.4f} (bound {bound:.4f}) over "
          f"{normal.mean():.0%} of blocks, mean {ratio[normal].mean():.4f}; all blocks max {ratio.max():.4f}")
    assert normal.mean() >= 0.5
    assert ratio[normal].max() <= bound * (1 + 1e-6) and ratio[normal].mean() < bound


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt, block, scale_fmt", [(f, b, s) for f, b, s, _ in BOUNDS])
def test_qdq_equals_dequantize_of_quantize_bit_for_bit(fmt, block, scale_fmt, dtype, kernel):
    x = kernel.astype(dtype)
    q, s = Q.quantize(x, fmt, "block", block=block, scale_fmt=scale_fmt)
    y = Q.qdq(x, fmt, "block", block=block, scale_fmt=scale_fmt)
    assert y.dtype == dtype and q.dtype == jnp.float32 and s.dtype == jnp.float32
    np.testing.assert_array_equal(bits(np.asarray(Q.dequantize(q, s, dtype, block=block))), bits(np.asarray(y)))
    assert float(jnp.mean((y != x).astype(jnp.float32))) > 0.5


def test_scale_fmt_and_four_bit_combinations_are_validated():
    for kw, match in [(dict(fmt="e4m3", granularity="block", scale_fmt="e8m0"), "needs fmt 'e2m1' with granularity"),
                      (dict(fmt="e2m1", granularity="channel", scale_fmt="e4m3"), "NVFP4 block scales"),
                      (dict(fmt="int4", granularity="block", scale_fmt="e8m0"), "got fmt 'int4'"),
                      (dict(fmt="e2m1", granularity="block", scale_fmt="ue8m0"), "valid scale formats")]:
        with pytest.raises(Q.RecipeError, match=match):
            Q.QSpec(**kw)
    with pytest.raises(Q.RecipeError, match="needs fmt 'e2m1'"):
        Q.qdq(jnp.ones((4, 4)), "e5m2", "block", scale_fmt="e4m3")
    for field in ("activations", "kv_cache"):
        with pytest.raises(Q.RecipeError, match=f"{field} format 'e2m1' is a 4-bit weight format.*W4A16"):
            Q.Recipe.from_dict({"base": "fp8_w8a8", field: {"fmt": "e2m1", "granularity": "token"}})
    assert Q.QSpec("e2m1", "channel") and Q.QSpec("int4", "channel")  # f32 scales fit any granularity


# ---------------------------------------------------------------------------------------------------------------------
# Presets, recipe files, a tiny model
# ---------------------------------------------------------------------------------------------------------------------

def test_presets_and_recipe_files_round_trip_scale_fmt(tmp_path):
    specs = {"mxfp4_w4a16": Q.QSpec("e2m1", "block", (32, 1), "e8m0"),
             "nvfp4_w4a16": Q.QSpec("e2m1", "block", (16, 1), "e4m3"),
             "int4_w4a16_g128": Q.QSpec("int4", "block", (128, 1), "f32")}
    for name, spec in specs.items():
        r = Q.get_recipe(name)
        assert Q.module_spec(r, "model.layers.0.mlp.down_proj") == spec
        assert r.activations is None and r.kv_cache is None  # weight-only: W4A16
        assert Q.Recipe.from_dict(r.to_dict()) == r
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(r.to_dict()))
        assert Q.as_recipe(str(path)) == r
    assert Q.get_recipe("mxfp4_w4a16").to_dict()["weights"][-1][1] == {
        "fmt": "e2m1", "granularity": "block", "block": [32, 1], "scale_fmt": "e8m0"}
    assert "scale_fmt" not in Q.QSpec("e4m3", "block").to_dict()  # f32 specs write the files they always wrote
    custom = Q.Recipe.from_dict({"weights": [["model.layers.*", {"fmt": "e2m1", "granularity": "block",
                                                                 "block": [64, 1], "scale_fmt": "e8m0"}]]})
    assert custom.weights[0][1].scale_fmt == "e8m0" and custom.weights[0][1].block == (64, 1)


@pytest.mark.parametrize("name", FOUR_BIT)
def test_four_bit_presets_change_every_decoder_linear_and_nothing_else(name, peaked_model):
    cfg, _, state = peaked_model
    named = hf.named_params(cfg, state, hf_layout=False)
    r = Q.get_recipe(name)
    out = Q.apply_to_named(r, named)
    linear = [n for n in named if n.startswith("model.layers.") and n.endswith("_proj.weight")]
    assert len(linear) == 7 * cfg.num_layers
    for n, a in named.items():
        if n in linear:
            changed = float(jnp.mean((out[n] != a).astype(jnp.float32)))
            assert changed > 0.5 and out[n].dtype == a.dtype, (n, changed)
            assert Q.shared_scale(r, n, named.__getitem__) is None  # block specs: each tensor its own scales
        else:  # embeddings, norms, lm_head
            assert out[n] is a, n
    moved = Q.check_effective(r)  # the rounding survives the compiler: one weight spec, most values moved
    assert len(moved) == 1 and min(moved.values()) > 0.5, moved


# ---------------------------------------------------------------------------------------------------------------------
# Capacity
# ---------------------------------------------------------------------------------------------------------------------

def test_four_bit_weight_bytes_closed_form():
    """One layer: q, o [256, 256]; k, v [256, 128]; gate, up [256, 300]; down [300, 256] (kernels [in, out])."""
    cfg = types.SimpleNamespace(vocab_size=100, hidden_size=256, intermediate_size=300, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=128, tie_word_embeddings=True)
    base = Q.weight_bytes(cfg)
    numel = 2 * 256 * 256 + 2 * 256 * 128 + 2 * 256 * 300 + 300 * 256
    packed = numel // 2  # two 4-bit values per byte
    mx_scales = 8 * 256 * 2 + 8 * 128 * 2 + 8 * 300 * 2 + 10 * 256  # ceil(in / 32) * out per kernel
    assert Q.weight_bytes(cfg, Q.get_recipe("mxfp4_w4a16")) == base - 2 * numel + packed + 1 * mx_scales
    nv_scales = 16 * 256 * 2 + 16 * 128 * 2 + 16 * 300 * 2 + 19 * 256  # ceil(in / 16) * out, e4m3 bytes
    assert Q.weight_bytes(cfg, Q.get_recipe("nvfp4_w4a16")) == base - 2 * numel + packed + nv_scales + 4 * 7
    g_scales = 2 * 256 * 2 + 2 * 128 * 2 + 2 * 300 * 2 + 3 * 256  # ceil(in / 128) * out, fp16/bf16 group scales
    assert Q.weight_bytes(cfg, Q.get_recipe("int4_w4a16_g128")) == base - 2 * numel + packed + 2 * g_scales
    assert Q.quantized_tensor_bytes((3, 1), Q.QSpec("int4", "tensor")) == 2 + 2  # ceil(3 * 4 / 8) + one scale
    for name in FOUR_BIT:
        assert Q.kv_cache_bytes_per_token(cfg, Q.get_recipe(name)) == Q.kv_cache_bytes_per_token(cfg)


def test_decode_cost_model_reads_fewer_weight_bytes_with_four_bit_weights():
    cfg = types.SimpleNamespace(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
    fp8 = decode_cost.decode_weight_bytes(cfg, Q.FP8_DEFAULT)
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    for name in FOUR_BIT:  # half a byte less per linear weight, less at most 1/16 byte of block scales (NVFP4)
        r = Q.get_recipe(name)
        assert fp8 - decode_cost.decode_weight_bytes(cfg, r) >= (0.5 - 1 / 16) * linear
        m = decode_cost.decode_model(cfg, 80 * 2**30, 4096, decode_cost.BANDWIDTHS["h100-sxm"], r)
        assert m["batch"] >= decode_cost.max_batch(cfg, 80 * 2**30, 4096, Q.FP8_DEFAULT) and m["tok_s"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# vLLM and the bridge refuse them in one line; the JAX engine simulates them
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, checkpoint", [("mxfp4_w4a16", "MXFP4 checkpoint"),
                                              ("nvfp4_w4a16", "NVFP4 checkpoint"),
                                              ("int4_w4a16_g128", "compressed-tensors / GPTQ / AWQ")])
def test_vllm_refuses_four_bit_recipes_in_one_line_before_any_vllm_starts(name, checkpoint):
    expected = (f"recipe '{name}' quantizes weights to 4 bits .*vLLM serves that only from .*{checkpoint}.*never by "
                "online quantization of a BF16 model.*bridge would have to ship packed 4-bit weights with their "
                "block scales in that layout.*rollout.engine=jax")
    with pytest.raises(ConfigError, match=expected) as e:
        load(TrainConfig, None, ["rollout.engine=vllm", f"rollout.recipe={name}"])
    assert "\n" not in str(e.value)
    assert load(TrainConfig, None, [f"rollout.recipe={name}"]).rollout.engine == "jax"
    r = Q.get_recipe(name)
    for call in (lambda: vllm_settings(tiny_config(), r), lambda: engine_dtype("bfloat16", r)):
        with pytest.raises(VllmSettingsError, match=expected):
            call()
    with pytest.raises(AdmissionError, match=expected):
        search_vllm_settings(tiny_config(), r)


def test_the_weight_bridge_never_ships_four_bit_weights(peaked_model):
    cfg, _, state = peaked_model
    with pytest.raises(BridgeError, match=r"'nvfp4_w4a16' quantizes model\.layers\.0\..* to 4 bits \(e2m1\)"):
        list(hf_stream(cfg, state, recipe="nvfp4_w4a16"))


def test_four_bit_mismatch_k3_is_finite_and_above_fp8_w8a8_on_the_tiny_model(peaked_model):
    """The JaxEngine's own samples scored by the unquantized learner (as test_quant_mismatch.py): each W4A16
    recipe's k3 is finite and larger than fp8_w8a8's (on this setup about 10x: ~1e-1 vs ~1e-2)."""
    cfg, graphdef, state = peaked_model
    prompts = [list(np.random.RandomState(i).randint(0, cfg.vocab_size, 6)) for i in range(64)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    logp_fn = jax.jit(lambda p, t, v: token_logprobs(decoder.forward(graphdef, p, t, valid_BT=v)[0], t)[0])
    k3 = {}
    for name in ("fp8_w8a8",) + FOUR_BIT:
        batch = JaxEngine(cfg, state, mismatch=EngineMismatch(recipe=name)).generate(prompts, sampling, seed=0)
        learner = logp_fn(state, jnp.asarray(batch.tokens_BT), jnp.asarray(batch.valid_BT))
        k3[name] = float(mismatch.metrics(learner, jnp.asarray(batch.rollout_logp_BT),
                                          jnp.asarray(batch.completion_mask_BT))["k3"])
    print(k3)
    assert all(math.isfinite(v) for v in k3.values())
    assert min(k3[n] for n in FOUR_BIT) > 2 * k3["fp8_w8a8"] > 0
