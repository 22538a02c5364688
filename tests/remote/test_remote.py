"""Engine servers over loopback: the wire format is lossless, a run against servers trains as in-process, tokens
are enforced, a dead or restarted server is survived and resynchronised, a server of another model is refused."""

import dataclasses
import json

import numpy as np
import pytest

from opdjax.config import ConfigError
from opdjax.core.errors import InputError
from opdjax.models import ModelConfig, hf
from opdjax.models.tiny import load_tokenizer, make_tiny
from opdjax.pipeline import loop as pipeline
from opdjax.remote import protocol
from opdjax.remote.client import CallSettings, RemoteEngine, ServerRefused
from opdjax.remote.server import EngineServer
from opdjax.rollout import SamplingParams
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.sync import BridgeError, Publisher, TcpTransport, prepare
from opdjax.teacher import JaxTeacher
from tests.pipeline.test_loop import _cfg, _lines

TOKEN = "loopback-secret"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tok") / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


def _engine(path):
    return JaxEngine.from_pretrained(path, pad_id=load_tokenizer(path).pad_token_id)


def _steps(tmp_path):
    return [x for x in _lines(tmp_path) if "loss" in x]


def test_the_wire_format_rebuilds_the_engines_batch_exactly(pair):
    engine = _engine(pair[0])
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(3,))
    direct = engine.generate(prompts, sp, seed=3)
    wire = json.loads(json.dumps(protocol.completion_response(direct)))
    back = protocol.rollout_batch(prompts, wire, sp, engine.pad_id)
    for f in ("tokens_BT", "valid_BT", "completion_mask_BT", "rollout_logp_BT", "version_B"):
        np.testing.assert_array_equal(getattr(back, f), getattr(direct, f), err_msg=f)
    with pytest.raises(protocol.ProtocolError, match="no weight_version"):
        del wire["choices"][0]["weight_version"], wire["weight_version"]
        protocol.rollout_batch(prompts, wire, sp, engine.pad_id)


@pytest.mark.slow  # two 4-step runs, one against servers
def test_a_run_against_servers_trains_as_the_same_run_in_process(pair, tmp_path, token_file):
    local = pipeline.train(_cfg(pair, tmp_path / "local"), log=lambda s: None)
    teacher = JaxTeacher.from_pretrained(pair[1])
    with EngineServer(engine=_engine(pair[0]), token=TOKEN) as rs, EngineServer(teacher=teacher, token=TOKEN) as ts:
        remote = pipeline.train(_cfg(pair, tmp_path / "remote", f"rollout.endpoints=[127.0.0.1:{rs.port}]",
                                     f"teacher.endpoints=[127.0.0.1:{ts.port}]", f"sync.token_file={token_file}"),
                                log=lambda s: None)
        assert rs.engine.version == 4  # every step's weights reached the server
    a, b = _steps(tmp_path / "local"), _steps(tmp_path / "remote")
    assert [x["staleness"] for x in b] == [0, 0, 0, 0]
    # Same rollouts bit for bit; the teacher scores the same sequences in another padding layout (float rounding).
    np.testing.assert_allclose([x["loss"] for x in b], [x["loss"] for x in a], rtol=1e-4, atol=1e-5)
    assert max(abs(x["mismatch/k3"]) for x in b) < 1e-6  # the server samples with exactly the published weights
    assert remote["final"]["eval/accuracy"] == local["final"]["eval/accuracy"]
    np.testing.assert_allclose(remote["final"]["eval/reverse_kl"], local["final"]["eval/reverse_kl"], rtol=1e-3)


@pytest.mark.slow  # two short runs against servers
def test_a_resumed_run_republishes_its_checkpoint_to_a_server_that_holds_later_versions(pair, tmp_path, token_file):
    """Versions only go forward within a session; a resumed launch is a new session of the same run. The run dies
    after its step-4 results but its newest checkpoint is step 2: the server holds v4, the resumed launch binds it
    again (same run id), publishes v2 as its session's first version and trains on from there, every rollout of the
    version it expects."""
    import shutil

    with EngineServer(engine=_engine(pair[0]), token=TOKEN) as rs:
        ends = [f"rollout.endpoints=[127.0.0.1:{rs.port}]", f"sync.token_file={token_file}",
                "pipeline.checkpoint_every=2", "pipeline.eval_every=0"]
        pipeline.train(_cfg(pair, tmp_path, *ends), log=lambda s: None)
        assert rs.engine.version == 4
        shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # lost with the run
        out = pipeline.train(_cfg(pair, tmp_path, *ends, "pipeline.steps=5", "pipeline.resume=true"),
                             log=lambda s: None)
        assert out["steps"] == 5 and rs.engine.version == 5
    steps = _steps(tmp_path)
    assert [x["step"] for x in steps] == [1, 2, 3, 4, 5] and all(x["staleness"] == 0 for x in steps)


def test_wrong_tokens_are_refused_on_generate_and_on_publish(pair):
    engine = _engine(pair[0])
    mcfg = ModelConfig.from_dir(pair[0])
    with EngineServer(engine=engine, token=TOKEN) as rs:
        with pytest.raises(ServerRefused, match="HTTP 401"):
            RemoteEngine([f"127.0.0.1:{rs.port}"], "not-the-token", mcfg, pad_id=0, calls=CallSettings(wait_s=1))
        assert rs.refusals and "wrong token" in rs.refusals[-1]
        manifest, arrays = prepare(mcfg, engine.receiver.spec and _params(pair[0]), 1, dtype="float32")
        with pytest.raises(BridgeError):
            TcpTransport("127.0.0.1", rs.bridge_port, "not-the-token", timeout=10).send(manifest, arrays)
        assert engine.version == 0


def _params(path):
    from opdjax.models import hf
    return hf.read_tensors(path)


def test_a_server_of_another_model_is_refused(pair, tmp_path):
    other = make_tiny(tmp_path / "other", "qwen3", "tiny", seed=3, tokenizer=load_tokenizer(pair[0]), num_layers=1)
    with EngineServer(engine=_engine(other), token=TOKEN) as rs:
        with pytest.raises(ServerRefused, match="serves another model"):
            RemoteEngine([f"127.0.0.1:{rs.port}"], TOKEN, ModelConfig.from_dir(pair[0]), pad_id=0,
                         calls=CallSettings(wait_s=1))


def test_losing_one_of_two_servers_loses_no_rows_and_a_restarted_one_is_resynchronised(pair):
    mcfg = ModelConfig.from_dir(pair[0])
    a, b = EngineServer(engine=_engine(pair[0]), token=TOKEN).start(), EngineServer(engine=_engine(pair[0]),
                                                                                   token=TOKEN).start()
    port_b = b.port
    logs = []
    remote = RemoteEngine([f"127.0.0.1:{a.port}", f"127.0.0.1:{port_b}"], TOKEN, mcfg, pad_id=0, log_fn=logs.append,
                          calls=CallSettings(wait_s=20, backoff=0.05, timeout=30))
    pub = Publisher(mcfg, remote.link, dtype="float32")
    sp = SamplingParams(max_new_tokens=3)
    try:
        pub.publish(_params(pair[0]), 1)
        assert a.engine.version == b.engine.version == 1
        b.stop()  # one server dies
        batch = remote.generate([[5, 6]] * 6, sp, seed=1)
        assert batch.batch_size == 6 and set(batch.version_B) == {1}
        assert [o["event"] for o in remote.outages] == ["down"]
        pub.publish(_params(pair[0]), 2)  # only a takes it
        b2 = EngineServer(engine=_engine(pair[0]), token=TOKEN, port=port_b).start()  # back, serving v0
        try:
            remote.generate([[5, 6]] * 6, sp, seed=2)  # b2 is probed, resynchronised to v2, then used
            assert b2.engine.version == 2
            assert [o["event"] for o in remote.outages] == ["down", "up"]
        finally:
            b2.stop()
    finally:
        a.stop()


def test_servers_need_a_token_file_and_host_port_endpoints(pair, tmp_path):
    with pytest.raises(ConfigError, match="need sync.token_file"):
        _cfg(pair, tmp_path, "rollout.endpoints=[127.0.0.1:8300]")
    with pytest.raises(ConfigError, match="is not host:port"):
        _cfg(pair, tmp_path, "rollout.endpoints=[localhost]")
    with pytest.raises(ConfigError, match="the servers own the engine"):
        _cfg(pair, tmp_path, "rollout.endpoints=[127.0.0.1:8300]", "sync.token_file=t", "rollout.recipe=fp8_w8a8")
    with pytest.raises(ConfigError, match="needs sync.root"):
        _cfg(pair, tmp_path, "rollout.endpoints=[127.0.0.1:8300]", "sync.token_file=t", "sync.transport=shm")
    with pytest.raises(ConfigError, match="own processes"):
        _cfg(pair, tmp_path, "rollout.endpoints=[127.0.0.1:8300]", "sync.token_file=t", "sync.transport=inproc")


def test_a_server_on_this_host_takes_weights_from_shared_memory(pair, tmp_path):
    """sync.transport=shm: one snapshot in the servers' --shm-root, read and validated by each; a server that reads
    another directory is refused with the fix; a corrupt snapshot is refused and the server keeps its version."""
    cfg = ModelConfig.from_dir(pair[0])
    root = tmp_path / "shm"
    with EngineServer(engine=_engine(pair[0]), token=TOKEN, shm_root=str(root)) as a, \
            EngineServer(engine=_engine(pair[0]), token=TOKEN, shm_root=str(root)) as b:
        remote = RemoteEngine([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], TOKEN, cfg, pad_id=0, transport="shm",
                              shm_root=str(root), calls=CallSettings(wait_s=5))
        params = hf.load_state(pair[0], cfg)[1]
        Publisher(cfg, remote.link, dtype="float32").publish(params, 1)
        assert a.engine.version == b.engine.version == 1 and (root / f"v{1:010d}").is_dir()
        batch = remote.generate([[5, 6], [7, 8, 9]], SamplingParams(max_new_tokens=3), seed=0)
        assert (batch.version_B == 1).all()

        manifest, arrays = prepare(cfg, params, 2, dtype="float32")
        foreign = [np.array(x, copy=True) for x in arrays]
        remote.link.snapshots.send(manifest, foreign)  # no session: not this run's, whatever its bytes
        with pytest.raises(BridgeError, match="serves run"):
            remote.link.push(remote.pool.servers[0], manifest, foreign)
        manifest = dataclasses.replace(manifest, version=3, session=remote.run.session)
        bad = [np.array(x, copy=True) for x in arrays]
        bad[0] += 1.0  # bytes that no longer match the manifest's CRC-32
        remote.link.snapshots.send(manifest, bad)
        with pytest.raises(BridgeError, match="checksum"):
            remote.link.push(remote.pool.servers[0], manifest, bad)
        assert a.engine.version == 1
        remote.link.close()
    with EngineServer(engine=_engine(pair[0]), token=TOKEN, shm_root=str(tmp_path / "elsewhere")) as c:
        other = RemoteEngine([f"127.0.0.1:{c.port}"], TOKEN, cfg, pad_id=0, transport="shm",
                             shm_root=str(root), calls=CallSettings(wait_s=5))
        with pytest.raises(ServerRefused, match="--shm-root"):
            Publisher(cfg, other.link, dtype="float32").publish(params, 4)


def test_client_error_paths_are_clear(pair, tmp_path):
    """Issue 29 audit: no server within wait_s, a server of the wrong role or temperature, a missing or empty token
    file: each a named error, quickly."""
    import socket
    import time

    from opdjax.core.errors import InputError
    from opdjax.remote.client import RemoteTeacher, ServersUnavailable, read_token

    mcfg = hf.load_config(pair[0])  # as a run's: the usable vocabulary is the tokenizer's (the servers' too)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(ServersUnavailable, match=f"no rollout server answered within 1s.*127.0.0.1:{dead}"):
        RemoteEngine([f"127.0.0.1:{dead}"], TOKEN, mcfg, pad_id=0, calls=CallSettings(wait_s=1))
    assert time.perf_counter() - t0 < 20
    teacher = JaxTeacher.from_pretrained(pair[1])
    with EngineServer(teacher=teacher, token=TOKEN) as ts, EngineServer(engine=_engine(pair[0]), token=TOKEN) as rs:
        with pytest.raises(ServerRefused, match="is a 'teacher' server, expected a rollout server"):
            RemoteEngine([f"127.0.0.1:{ts.port}"], TOKEN, mcfg, pad_id=0, calls=CallSettings(wait_s=1))
        with pytest.raises(ServerRefused, match="is a 'rollout' server, expected a teacher server"):
            RemoteTeacher([f"127.0.0.1:{rs.port}"], TOKEN, mcfg, temperature=1.0, calls=CallSettings(wait_s=1))
        with pytest.raises(ServerRefused, match=r"scores at temperature 1.0, the run asks for teacher.temperature=0.5"):
            RemoteTeacher([f"127.0.0.1:{ts.port}"], TOKEN, mcfg, temperature=0.5, calls=CallSettings(wait_s=1))
    with pytest.raises(InputError, match="token file .* No such file"):
        read_token(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InputError, match="is empty; put the shared secret in it"):
        read_token(str(tmp_path / "empty"))


def test_a_row_of_the_wrong_version_is_never_trained_on(pair):
    """A server answering with a version other than the newest published is marked down; one whose weights were
    changed behind the run's back to a newer version is refused loudly (the run never rewinds a server), one that
    fell behind is resynchronised forward; the rows the loop gets carry the published version."""
    mcfg = ModelConfig.from_dir(pair[0])
    server = EngineServer(engine=_engine(pair[0]), token=TOKEN).start()
    logs = []
    remote = RemoteEngine([f"127.0.0.1:{server.port}"], TOKEN, mcfg, pad_id=0, log_fn=logs.append,
                          calls=CallSettings(wait_s=20, backoff=0.05, timeout=30))
    try:
        Publisher(mcfg, remote.link, dtype="float32").publish(_params(pair[0]), 3)
        server.engine.update_weights(hf.read_tensors(pair[0]), 2)  # behind what the run published
        batch = remote.generate([[5, 6]] * 4, SamplingParams(max_new_tokens=3), seed=1)
        assert set(batch.version_B) == {3} and server.engine.version == 3  # resynchronised before it served again
        down = [o for o in remote.outages if o["event"] == "down"]
        assert down and "answered with weight version(s) ['2'], expected v3" in down[0]["why"]
        server.engine.update_weights(hf.read_tensors(pair[0]), 7)  # not what the run published
        with pytest.raises(ServerRefused, match="serves v7, newer than this run's newest v3"):
            remote.generate([[5, 6]] * 4, SamplingParams(max_new_tokens=3), seed=2)
    finally:
        server.stop()


def test_call_settings_are_one_value_for_both_clients_and_the_sync_section():
    """Timeout, retries, backoff and wait: one frozen value that RemoteEngine and RemoteTeacher share, read from
    `sync.request_timeout / retries / wait_s`; a bad one is refused naming the field."""
    from opdjax.config import TrainConfig, load

    calls = load(TrainConfig, None, ["sync.request_timeout=7", "sync.retries=0", "sync.wait_s=2"]).sync.calls
    assert calls == CallSettings(timeout=7.0, retries=0, wait_s=2.0)
    for kw, words in (({"timeout": 0}, "CallSettings.timeout must be > 0"),
                      ({"retries": -1}, "CallSettings.retries must be an integer >= 0"),
                      ({"wait_s": -1.0}, "CallSettings.wait_s must be > 0")):
        with pytest.raises(InputError, match=words):
            CallSettings(**kw)
