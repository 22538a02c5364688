"""Issue 29, hostile clients against opdjax's engine server (`opdjax serve --engine jax`), on 127.0.0.1: every bad
request is a 400 naming the field, a flood of unauthenticated requests is counted but logged and kept bounded, a
silent socket is closed, and the server keeps serving a good request after each."""

import contextlib
import json
import logging
import socket
import time
import urllib.error
import urllib.request

import pytest

from opdjax.models.tiny import load_tokenizer
from opdjax.remote import protocol
from opdjax.remote.server import EngineServer
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.teacher import JaxTeacher

TOKEN = "limits-secret"
LIMITS = protocol.ServerLimits(max_batch=16, max_tokens=64, max_top_k=16, idle_timeout=1.0, request_timeout=3.0,
                               refusal_log_per_min=5)


@contextlib.contextmanager
def serving(pair, token: str, limits: protocol.ServerLimits):
    """A rollout server (JaxEngine on the student) and a teacher server, both under `limits`: (rollout, teacher)."""
    engine = JaxEngine.from_pretrained(pair[0], pad_id=load_tokenizer(pair[0]).pad_token_id)
    with EngineServer(engine=engine, token=token, limits=limits) as rs, \
            EngineServer(teacher=JaxTeacher.from_pretrained(pair[1]), token=token, limits=limits) as ts:
        yield rs, ts


@pytest.fixture(scope="module")
def servers(pair):
    with serving(pair, TOKEN, LIMITS) as both:
        yield both


def _post(server, body, token=TOKEN, path="/v1/completions", raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


GOOD_SCORE = {"prompt": [[5, 6, 7, 8]], "max_tokens": 1, "prompt_logprobs": 2}
GOOD_GEN = {"prompt": [[5, 6, 7]], "max_tokens": 3, "temperature": 1.0, "seed": 1}


@pytest.mark.parametrize("field, value, message", [
    ("prompt", [[-1, 5]], "token id -1 is not an integer in"),
    ("prompt", [[5, -321]], "token id -321"),
    ("prompt", [[5, 1.5]], "token id 1.5"),
    ("prompt", [[5, "7"]], "token id '7'"),
    ("prompt", [[5, True]], "token id True"),
    ("prompt", [[5, 2**70]], "token id 1180591620717411303424"),
    ("prompt", [[5] * 3000], "has 3000 tokens; the model takes at most"),
    ("prompt_logprobs", 2.7, "'prompt_logprobs' must be an integer in"),
    ("prompt_logprobs", -3, "'prompt_logprobs' must be an integer in"),
])
def test_the_teacher_refuses_bad_requests_with_400_naming_the_field(servers, field, value, message):
    _, ts = servers
    status, body = _post(ts, {**GOOD_SCORE, field: value})
    assert status == 400 and message in body["error"]["message"], body
    assert _post(ts, GOOD_SCORE)[0] == 200  # still serving


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 1e400, "'max_tokens' must be an integer"),
    ("max_tokens", 10**6, "'max_tokens' must be an integer in [1, 64]"),
    ("top_k", -3, "'top_k' must be an integer in [0,"),
    ("temperature", 1e-30, "below 1e-05"),
    ("seed", 2**70, "'seed' must be an integer"),
    ("prompt", [[5, 2**70]], "token id"),
    ("prompt", [[5]] * 17, "has 17 rows; this server takes at most 16"),
])
def test_the_rollout_server_refuses_bad_requests_with_400_naming_the_field(servers, field, value, message):
    rs, _ = servers
    status, body = _post(rs, {**GOOD_GEN, field: value})
    assert status == 400 and message in body["error"]["message"], body
    assert _post(rs, GOOD_GEN)[0] == 200


def test_deep_json_and_bad_content_length_are_400_not_500(servers):
    rs, _ = servers
    status, body = _post(rs, None, raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "RecursionError" in body["error"]["message"]
    assert _post(rs, GOOD_GEN)[0] == 200


def test_a_flood_of_unauthenticated_requests_is_counted_but_logged_and_kept_bounded(servers, caplog):
    """Row 1: 4,000 GET /AAAA... (65 KB paths): all 401; the log holds 5 truncated lines, memory a bounded list."""
    rs, _ = servers
    before = rs.refusal_log.count
    path = "/" + "A" * 65_000
    with caplog.at_level(logging.WARNING, logger="opdjax.serve"):
        for _ in range(4000):
            with socket.create_connection(("127.0.0.1", rs.port), timeout=10) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                assert s.recv(12).startswith(b"HTTP/1.1 4")  # 401 (or 414 from http.server for the longest)
    assert rs.refusal_log.count - before >= 3900
    logged = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) <= LIMITS.refusal_log_per_min and all(len(r.getMessage()) < 400 for r in logged)
    assert len(rs.refusals) <= 100 and all(len(m) < 400 for m in rs.refusals)


def test_a_silent_socket_is_closed_after_the_idle_timeout(servers):
    rs, _ = servers
    s = socket.create_connection(("127.0.0.1", rs.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
    t0 = time.perf_counter()
    assert s.recv(100) == b""  # closed by the server
    assert time.perf_counter() - t0 < LIMITS.idle_timeout + 3
    s.close()
    assert _post(rs, GOOD_GEN)[0] == 200


def test_a_byte_trickling_socket_is_cut_at_the_request_timeout(servers):
    """Issue 29: a slow-loris that sends a byte every half idle timeout is never silent, but its request must
    arrive whole within `request_timeout`."""
    rs, _ = servers
    s = socket.create_connection(("127.0.0.1", rs.port), timeout=10)
    t0 = time.perf_counter()
    closed = False
    for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40:
        try:
            s.sendall(bytes([b]))
        except OSError:  # reset by the server
            closed = True
            break
        s.settimeout(LIMITS.idle_timeout / 2)
        try:
            if s.recv(100) == b"":
                closed = True
                break
        except TimeoutError:
            pass
    assert closed and time.perf_counter() - t0 < LIMITS.request_timeout + 3
    s.close()
    assert _post(rs, GOOD_GEN)[0] == 200


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(pair, tmp_path, capsys):
    from opdjax.cli.main import main

    token = tmp_path / "token"
    token.write_text(TOKEN)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        rc = main(["serve", "--role", "rollout", "--token-file", str(token), "--port", str(port),
                   f"student={pair[0]}", f"teacher={pair[1]}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in err[0], err
    assert time.perf_counter() - t0 < 10
