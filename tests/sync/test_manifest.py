"""Manifests, the learner-side stream and receiver validation, with an in-memory receiver double (no vLLM)."""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from opdjax import quant
from opdjax.models import decoder, hf
from opdjax.models.tiny import tiny_config
from opdjax.sync import (
    ArrayTarget,
    BridgeError,
    InProcessTransport,
    Manifest,
    ModelSpec,
    Publisher,
    WeightReceiver,
    hf_stream,
    prepare,
    validate,
)


@pytest.fixture(scope="module")
def cfg():
    return tiny_config("qwen3", "tiny", vocab_size=320)


@pytest.fixture(scope="module")
def params(cfg):
    return nnx.state(decoder.create(cfg, seed=3))


def _receiver(cfg, dtype="float32", version=0):
    target = ArrayTarget(version)
    return target, WeightReceiver(target, ModelSpec.from_config(cfg, dtype))


def test_stream_is_layer_ordered_hf_layout_and_matches_named_params(cfg, params):
    names = [n for n, _, _ in hf_stream(cfg, params, dtype="float32")]
    assert names == list(hf.name_map(cfg))  # the HF interop table, in layer order
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)
    ref = hf.named_params(cfg, params)
    for n, a, extra in hf_stream(cfg, params, dtype="float32"):
        assert extra == {}
        np.testing.assert_array_equal(np.asarray(a), np.asarray(ref[n]))


def test_bf16_stream_rounds_like_the_learner_cast(cfg, params):
    ref = hf.named_params(cfg, params)
    for n, a, _ in hf_stream(cfg, ref, dtype="bfloat16"):  # HF-named input works too
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                      np.asarray(ref[n]).astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("recipe", ["fp8_w8a8", "fp8_w8a8_channel", "fp8_block128"])
def test_prequantized_fp8_dequantizes_to_the_simulated_weights_bit_for_bit(cfg, params, recipe):
    target, rx = _receiver(cfg, "float32")
    Publisher(cfg, InProcessTransport(rx), dtype="float32", recipe=recipe).publish(params, 1)
    sim = quant.apply_to_named(quant.get_recipe(recipe), hf.named_params(cfg, params, hf_layout=False))
    nm = hf.name_map(cfg)
    for n, w in sim.items():
        want = np.asarray(w).T if nm[n][1] == "T" else np.asarray(w)
        np.testing.assert_array_equal(target.weights[n], want, err_msg=n)
    m, _ = prepare(cfg, params, 1, dtype="float32", recipe=recipe)
    q = [e for e in m.entries if e.quant]
    assert q and all(e.dtype == "F8_E4M3" for e in q)
    assert all(m.entries[i + 1].scale_of == e.name for i, e in enumerate(m.entries) if e.quant)


def test_manifest_json_round_trip_and_checksums(cfg, params):
    m, arrays = prepare(cfg, params, 7, dtype="bfloat16")
    m2 = Manifest.from_json(m.to_json())
    assert m2 == m and m2.version == 7 and m2.dtype == "BF16"
    assert all(e.crc32 is not None for e in m.entries)
    assert m.total_bytes == sum(np.asarray(a).nbytes for a in arrays)
    with pytest.raises(BridgeError, match="format"):
        Manifest.from_json('{"format": "other", "version": 1}')
    with pytest.raises(BridgeError, match="JSON"):
        Manifest.from_json(b"\xff{not json")


def _edit(m: Manifest, which: str, **changes) -> Manifest:
    import dataclasses

    entries = tuple(dataclasses.replace(e, **changes) if e.name == which else e for e in m.entries)
    return dataclasses.replace(m, entries=entries)


@pytest.mark.parametrize("case, pattern", [
    ("shape", r"tensor 'model.norm.weight' has shape \(65,\), expected \(64,\)"),
    ("unknown", r"unknown tensor 'lm_head.bias'"),
    ("dtype", r"tensor 'model.layers.0.mlp.up_proj.weight' has dtype F16, expected F32"),
    ("missing", r"missing tensor\(s\) \['model.layers.1.mlp.down_proj.weight'\]"),
    ("family", r"model_type 'llama' but the engine serves 'qwen3'"),
])
def test_bad_manifest_is_refused_before_anything_is_touched(cfg, params, case, pattern):
    import dataclasses

    target, rx = _receiver(cfg, "float32", version=1)
    m, arrays = prepare(cfg, params, 2, dtype="float32")
    if case == "shape":
        m = _edit(m, "model.norm.weight", shape=(65,), nbytes=65 * 4)
    elif case == "unknown":
        m = _edit(m, "lm_head.weight", name="lm_head.bias")
    elif case == "dtype":
        m = _edit(m, "model.layers.0.mlp.up_proj.weight", dtype="F16",
                  nbytes=m.entries[[e.name for e in m.entries].index("model.layers.0.mlp.up_proj.weight")].nbytes // 2)
    elif case == "missing":
        m = dataclasses.replace(m, entries=tuple(e for e in m.entries
                                                 if e.name != "model.layers.1.mlp.down_proj.weight"))
    elif case == "family":
        m = dataclasses.replace(m, model_type="llama")
    with pytest.raises(BridgeError, match=pattern) as info:
        rx.receive(m, arrays)
    assert str(info.value).startswith("manifest v2 rejected: ") and "keeps serving v1" in str(info.value)
    assert target.applied == [] and target.version == 1
    assert rx.refusals and "rejected" in rx.refusals[-1]


def test_payload_that_disagrees_with_its_checksum_is_refused(cfg, params):
    target, rx = _receiver(cfg, "float32", version=4)
    m, arrays = prepare(cfg, params, 5, dtype="float32")
    arrays = [np.array(a) for a in arrays]
    arrays[3].reshape(-1)[0] += 1.0  # one flipped value
    with pytest.raises(BridgeError, match=f"checksum mismatch on tensor '{m.entries[3].name}'.*keeps serving v4"):
        rx.receive(m, arrays)
    assert target.applied == []


def test_failing_target_is_reported_and_version_kept(cfg, params):
    class Exploding(ArrayTarget):
        def apply_weights(self, named, version):
            raise RuntimeError("device lost")

    target = Exploding(3)
    rx = WeightReceiver(target, ModelSpec.from_config(cfg, "float32"))
    m, arrays = prepare(cfg, params, 4, dtype="float32")
    with pytest.raises(BridgeError, match="applying the update failed.*device lost.*keeps serving v3"):
        rx.receive(m, arrays)


def test_validate_accepts_a_good_manifest_and_spec_lists_every_tensor(cfg, params):
    spec = ModelSpec.from_config(cfg, "bfloat16")
    m, _ = prepare(cfg, params, 1, dtype="bfloat16")
    validate(m, spec)
    assert list(spec.shapes) == list(hf.name_map(cfg))
    assert spec.shapes["model.layers.0.mlp.up_proj.weight"] == (cfg.intermediate_size, cfg.hidden_size)
    with pytest.raises(BridgeError, match="dtype BF16, expected F32"):
        validate(m, ModelSpec.from_config(cfg, "float32"))


def test_crc32_helpers_equal_zlib_for_any_split_and_thread_count(monkeypatch):
    import zlib

    from opdjax.sync import manifest as M

    rng = np.random.default_rng(0)
    for n in (0, 1, 100, (16 << 10) - 1, 16 << 10, (1 << 20) + 3):
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert M.crc32(b) == M.crc32(memoryview(b)) == M.crc32(b.tobytes()) == zlib.crc32(b)
        assert M.crc32(b, 0xDEADBEEF) == zlib.crc32(b, 0xDEADBEEF)
    for _ in range(50):
        a, b = (rng.integers(0, 256, rng.integers(0, 3000), dtype=np.uint8).tobytes() for _ in range(2))
        assert M.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 7, 3 << 20, 5 << 20, 1 << 20, 12345)]
    bufs.append(rng.standard_normal((64, 48)).astype(np.float32).T)  # not contiguous
    want = [zlib.crc32(np.ascontiguousarray(b).tobytes()) for b in bufs]
    monkeypatch.setattr(M, "PIECE", 1 << 20)  # big buffers are cut into pieces and recombined
    old = M.checksum_options()
    try:
        for backend in ("auto", "zlib"):
            for threads in (1, 2, 3):
                M.set_checksum_options(backend=backend, threads=threads)
                assert M.checksum_threads() == threads
                assert M.checksum_many(bufs) == want
        assert M.crc32_impl() == "zlib"  # the last options force zlib
    finally:
        M.set_checksum_options(**dataclasses.asdict(old))
    assert M.checksum_options() == old


def test_checksum_options_refuse_unknown_backends_and_bad_thread_counts():
    from opdjax.sync import manifest as M

    old = M.checksum_options()
    try:
        with pytest.raises(ValueError, match="unknown CRC-32 backend 'crc32c'; valid: "):
            M.set_checksum_options(backend="crc32c")
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="positive int or None"):
                M.set_checksum_options(threads=bad)
        assert M.checksum_options() == old  # a refused call changes nothing
        if M._libdeflate_crc32() is None:
            with pytest.raises(ValueError, match="no usable libdeflate"):
                M.set_checksum_options(backend="libdeflate")
        else:
            M.set_checksum_options(backend="libdeflate")
            assert M.crc32_impl() == "libdeflate"
    finally:
        M.set_checksum_options(**dataclasses.asdict(old))


def test_a_negative_version_or_a_zero_quant_block_is_refused_with_a_status(cfg, params):
    """Issue 29: a manifest with quant block [0, 0] closed the TCP connection with no status (division by zero in
    the log); versions below 0 were accepted. Both are refused, named, with nothing touched."""
    import dataclasses

    from opdjax.sync import TcpReceiverServer
    from tests.sync.test_transports import TOKEN, _client

    target, rx = _receiver(cfg, "float32", version=1)
    m, arrays = prepare(cfg, params, 2, dtype="float32", recipe="fp8_block128")
    with pytest.raises(BridgeError, match="v-5 rejected: a weight version is a non-negative integer"):
        rx.receive(dataclasses.replace(m, version=-5), arrays)
    name = next(e.name for e in m.entries if e.quant)
    bad = _edit(m, name, quant={**next(e.quant for e in m.entries if e.name == name), "block": [0, 0]})
    with pytest.raises(BridgeError, match=r"quant block \[0, 0\]: expected two positive integers"):
        rx.receive(bad, arrays)
    with TcpReceiverServer(rx, TOKEN) as srv:
        s, status = _client(srv.port, TOKEN, bad.to_json().encode())
        s.close()
    assert not status["ok"] and "quant block [0, 0]" in status["error"]
    assert target.applied == [] and target.version == 1


def test_versions_only_go_forward_except_a_resumed_learners_rewind(cfg, params):
    """Issue 29: publish versions going backwards (3 -> 0) were accepted. Now refused, named, nothing touched; the
    one legitimate way back — a resumed learner republishing its checkpoint — says so with rewind, also over TCP."""
    from opdjax.sync import TcpReceiverServer, TcpTransport
    from tests.sync.test_transports import TOKEN

    target, rx = _receiver(cfg, "float32", version=0)
    rx.receive(*prepare(cfg, params, 3, dtype="float32"))
    rx.receive(*prepare(cfg, params, 3, dtype="float32"))  # the same version again (a resync) is fine
    with pytest.raises(BridgeError, match="v1 rejected: versions only go forward .*received v3"):
        rx.receive(*prepare(cfg, params, 1, dtype="float32"))
    assert target.applied == [3, 3] and target.version == 3
    with TcpReceiverServer(rx, TOKEN) as srv:
        tx = TcpTransport("127.0.0.1", srv.port, TOKEN)
        with pytest.raises(BridgeError, match="versions only go forward"):
            tx.send(*prepare(cfg, params, 2, dtype="float32"))
        m, arrays = prepare(cfg, params, 2, dtype="float32", rewind=True)
        assert Manifest.from_json(m.to_json()).rewind
        tx.send(m, arrays)
    assert target.applied == [3, 3, 2] and target.version == 2
    with pytest.raises(BridgeError, match="'rewind' must be true or false"):
        Manifest.from_json(m.to_json().replace('"rewind":true', '"rewind":"yes"'))


def test_a_gated_receiver_restarts_its_version_order_only_for_a_new_session(cfg, params):
    """A server bound to a run (a gate on its receiver) takes no rewind; only a new session (`restart_order`) may
    start below what it received, and the session's order then goes forward again."""
    import dataclasses

    target, rx = _receiver(cfg, "float32", version=0)
    seen = []
    rx.gate = lambda m: seen.append(m.session)
    rx.receive(*prepare(cfg, params, 4, dtype="float32"))
    m, arrays = prepare(cfg, params, 2, dtype="float32", rewind=True)
    with pytest.raises(BridgeError, match="takes no rewind"):
        rx.receive(m, arrays)
    rx.restart_order()
    assert rx.received_version == -1
    m, arrays = prepare(cfg, params, 2, dtype="float32")
    rx.receive(dataclasses.replace(m, session="s2"), arrays)
    assert target.applied == [4, 2] and rx.received_version == 2 and seen[-1] == "s2"
    with pytest.raises(BridgeError, match="versions only go forward"):
        rx.receive(*prepare(cfg, params, 1, dtype="float32"))
    assert Manifest.from_json(dataclasses.replace(m, session="s2").to_json()).session == "s2"
    with pytest.raises(BridgeError, match="'session' must be"):
        Manifest.from_json(m.to_json().replace('"session":null', '"session":7'))
