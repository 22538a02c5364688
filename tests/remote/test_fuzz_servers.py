"""Fuzzing what an untrusted client sends (issue 29): request bodies to the rollout and teacher servers, and weight
manifests to the bridge. Every input is answered with a 200, a 4xx or a refusal status — never a 5xx, a dropped
connection or a crash — and the server answers a good request after each."""

import copy
import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from opdjax.models import ModelConfig
from opdjax.remote import protocol
from opdjax.sync import ArrayTarget, ModelSpec, TcpReceiverServer, WeightReceiver, prepare
from tests.remote.test_server_limits import serving
from tests.sync.test_transports import _client

TOKEN = "fuzz-secret"
LIMITS = protocol.ServerLimits(max_batch=4, max_tokens=3, max_top_k=4, idle_timeout=5.0)
FUZZ = settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def servers(pair):
    with serving(pair, TOKEN, LIMITS) as both:
        yield both


def _post(server, data: bytes) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


IDS = st.one_of(st.integers(-5, 400), st.sampled_from([2**31, 2**70, -2**63, 1.5, "7", True, None, [1]]))
ROWS = st.one_of(st.lists(st.lists(IDS, max_size=6), max_size=5), st.sampled_from([[], [[]], "x", None, 3, [[5] * 3000]]))
NUMS = st.sampled_from([0, 1, 2, 3, 4, 10**6, -3, 2.7, 1e-30, 1e400, "2", None, True, [], {}, float("nan")])
TEMPS = st.sampled_from([0, 1.0, 1, -1, 1e-30, 1e400, float("nan"), "hot", None, True])  # few distinct valid ones
BODIES = st.fixed_dictionaries({}, optional={
    "prompt": ROWS, "max_tokens": NUMS, "temperature": TEMPS, "top_p": st.sampled_from([1.0, 0.5, 0, 2, "x", None]),
    "top_k": NUMS, "seed": NUMS, "stop_token_ids": st.one_of(st.lists(IDS, max_size=3), NUMS),
    "prompt_logprobs": NUMS, "logprobs": NUMS})
RAW = st.one_of(BODIES.map(lambda b: json.dumps(b).encode()),
                st.sampled_from([b"", b"{", b"[]", b"null", b"1e400", b'{"prompt": [[5' + b"]" * 10,
                                 b"[" * 50_000 + b"]" * 50_000, "{\"prompt\": [[\u00e9]]}".encode()]),
                st.binary(max_size=40))


@FUZZ
@given(RAW)
@example(json.dumps({"prompt": [[5, 2**70]], "max_tokens": 2}).encode())
def test_the_rollout_server_answers_every_body_with_200_or_4xx(servers, data):
    rs, _ = servers
    assert _post(rs, data) in (200, 400, 404)
    assert _post(rs, json.dumps({"prompt": [[5, 6]], "max_tokens": 2, "temperature": 1.0}).encode()) == 200


@FUZZ
@given(RAW)
@example(json.dumps({"prompt": [[-321, 5]], "prompt_logprobs": 2}).encode())
def test_the_teacher_server_answers_every_body_with_200_or_4xx(servers, data):
    _, ts = servers
    assert _post(ts, data) in (200, 400, 404)
    assert _post(ts, json.dumps({"prompt": [[5, 6, 7]], "prompt_logprobs": 2}).encode()) == 200


# ------------------------------------------------------------------------------------------------ bridge manifests

@pytest.fixture(scope="module")
def bridge(pair):
    from flax import nnx

    from opdjax.models import decoder

    cfg = ModelConfig.from_dir(pair[0])
    target = ArrayTarget(0)
    rx = WeightReceiver(target, ModelSpec.from_config(cfg, "float32"))
    m, _ = prepare(cfg, nnx.state(decoder.create(cfg, seed=3)), 1, dtype="float32", recipe="fp8_block128")
    with TcpReceiverServer(rx, TOKEN, handshake_timeout=2.0) as srv:
        yield srv, json.loads(m.to_json()), target


LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.floats(allow_nan=True),
                   st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3))
FIELDS = ["version", "model_type", "dtype", "format", "entries"]
ENTRY_FIELDS = ["name", "shape", "dtype", "offset", "nbytes", "crc32", "quant", "scale_of"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FIELDS + ENTRY_FIELDS), st.integers(0, 200), LEAVES), min_size=1,
                max_size=3))
def test_the_bridge_answers_every_mutated_manifest_with_a_status(bridge, edits):
    srv, good, target = bridge
    m = copy.deepcopy(good)
    for field, index, value in edits:
        if field in FIELDS:
            m[field] = value
        elif isinstance(m.get("entries"), list) and m["entries"]:
            e = m["entries"][index % len(m["entries"])]
            if isinstance(e, dict):
                e[field] = value
    s, status = _client(srv.port, TOKEN, json.dumps(m).encode())
    s.close()
    assert isinstance(status, dict) and "ok" in status
    assert target.applied == []  # nothing arrived in full, so nothing was applied
    s, status = _client(srv.port, TOKEN, json.dumps(good).encode())  # and the bridge still takes a good manifest
    s.close()
    assert status["ok"] is True
