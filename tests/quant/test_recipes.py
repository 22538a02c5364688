"""opdjax.quant.recipes: which tensors a recipe quantizes, vLLM's fused scales, quantize_named round trips, the
presets and recipe files."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax import quant as Q
from opdjax.core import layout
from tests.quant.reference import bits

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

