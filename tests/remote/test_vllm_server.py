"""vLLM's own OpenAI-compatible server with opdjax's extension (`opdjax serve --engine vllm`), as OS processes:
the shared secret guards every endpoint, a publish over the bridge is validated in vLLM's worker and applied all or
nothing, rollouts carry the version that sampled them and match the learner's log-probs, and the teacher's prompt
log-probs match the JAX teacher's."""

import dataclasses
import json
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from flax import nnx

from opdjax.learner.learner import Learner
from opdjax.models import decoder, hf
from opdjax.remote.client import CallSettings, RemoteEngine, RemoteTeacher
from opdjax.rollout import SamplingParams
from opdjax.sync import BridgeError, Publisher
from opdjax.teacher.jax_teacher import JaxTeacher
from tests.remote.test_serve_processes import _start

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the real vLLM engine
SECRET = "vllm-serve-secret"
VLLM_KW = "rollout.vllm={kv_cache_memory_bytes: 33554432, max_model_len: 256, max_num_seqs: 16}"


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory, vllm_module):
    d = tmp_path_factory.mktemp("vllm_serve")
    token, shm = d / "token", d / "shm"
    token.write_text(SECRET)
    procs = []
    try:
        rollout, r = _start("rollout", pair, str(token), "--engine", "vllm", "--shm-root", str(shm), VLLM_KW)
        procs.append(rollout)
        teacher, t = _start("teacher", pair, str(token), "--engine", "vllm")
        procs.append(teacher)
        yield {"rollout": r, "teacher": t, "token": str(token), "shm": str(shm)}
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=120)


def _status(url, method, path, token=None, body=None) -> int:
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_print_command_shows_the_vllm_serve_command_without_the_secret(pair, tmp_path):
    token = tmp_path / "token"
    token.write_text("never-printed")
    out = subprocess.run([sys.executable, "-m", "opdjax.cli", "serve", "--role", "rollout", "--engine", "vllm",
                          "--token-file", str(token), "--port", "8000", "--print-command", f"student={pair[0]}",
                          f"teacher={pair[1]}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    for part in ("VLLM_SERVER_DEV_MODE=1", f"OPDJAX_TOKEN_FILE={token}", "vllm.entrypoints.launchers.api_server.entry",
                 "--worker-extension-cls opdjax.remote.vllm_server.OpdjaxWorker",
                 "--middleware opdjax.remote.vllm_server.RequireToken", "--enable-scale-out",
                 "--logprobs-mode processed_logprobs", "--port 8000", f"--model {pair[0]}"):
        assert part in line, part
    assert "never-printed" not in line


def test_every_endpoint_but_health_needs_the_token(servers):
    url = servers["rollout"]["url"]
    assert _status(url, "GET", "/health") == 200
    guarded = [("POST", "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1}}),
               ("POST", "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 1}),
               ("POST", "/collective_rpc", {"method": "opdjax_info"}),
               ("POST", "/update_weight_version", {"new_version": "99"}), ("POST", "/pause", None),
               ("POST", "/reset_prefix_cache", None), ("GET", "/weight_info", None), ("GET", "/v1/models", None)]
    for method, path, body in guarded:
        for token in (None, "wrong"):
            assert _status(url, method, path, token, body) == 401, (method, path, token)
    assert _status(url, "GET", "/weight_info", SECRET) == 200


def test_a_publish_is_validated_applied_and_tags_every_rollout(servers, pair):
    cfg = hf.load_config(pair[0])  # the server samples the tokenizer's 259 ids, not the 320 rows
    with RemoteEngine([f"127.0.0.1:{servers['rollout']['port']}"], SECRET, cfg, pad_id=0,
                      calls=CallSettings(wait_s=10)) as remote:
        assert remote.pool.servers[0].dialect == "vllm"
        params = nnx.state(decoder.create(cfg, seed=31))
        Publisher(cfg, remote.link, dtype="float32").publish(params, 1)
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
        batch = remote.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=3)
        assert (batch.version_B == 1).all()
        graphdef, _ = nnx.split(decoder.abstract(cfg))
        lp = Learner(graphdef).logp(params, batch.tokens_BT, batch.valid_BT, temperature=1.0)
        m = batch.completion_mask_BT
        assert m.any() and float(np.abs(lp - batch.rollout_logp_BT)[m].mean()) <= 1e-4

        manifest, arrays = remote.link.last  # v2 whose bytes do not match the manifest's checksums
        bad = [np.array(a, copy=True) for a in arrays]
        bad[0] += 1.0
        with pytest.raises(BridgeError, match="crc32 mismatch"):  # refused in vLLM's worker, before anything is touched
            remote.link.push(remote.pool.servers[0], dataclasses.replace(manifest, version=2), bad)
        again = remote.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=3)
        assert (again.version_B == 1).all()  # still serving v1, and the same weights
        np.testing.assert_array_equal(again.tokens_BT, batch.tokens_BT)


def test_a_vllm_server_on_this_host_takes_weights_from_shared_memory(servers, pair):
    cfg = hf.load_config(pair[0])  # the server samples the tokenizer's 259 ids, not the 320 rows
    with RemoteEngine([f"127.0.0.1:{servers['rollout']['port']}"], SECRET, cfg, pad_id=0, transport="shm",
                      shm_root=servers["shm"], calls=CallSettings(wait_s=10)) as remote:
        params = nnx.state(decoder.create(cfg, seed=32))
        Publisher(cfg, remote.link, dtype="float32").publish(params, 5)
        batch = remote.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, temperature=1.0), seed=4)
        remote.link.close()
        assert (batch.version_B == 5).all()
        graphdef, _ = nnx.split(decoder.abstract(cfg))
        lp = Learner(graphdef).logp(params, batch.tokens_BT, batch.valid_BT, temperature=1.0)
        assert float(np.abs(lp - batch.rollout_logp_BT)[batch.completion_mask_BT].mean()) <= 1e-4


def test_the_vllm_teacher_scores_like_the_jax_teacher(servers, pair):
    cfg = hf.load_config(pair[1])  # the pair pads 259 tokens to 320 rows: both teachers score the 259
    with RemoteTeacher([f"127.0.0.1:{servers['teacher']['port']}"], SECRET, cfg, temperature=1.0,
                       calls=CallSettings(wait_s=10)) as remote:
        tokens = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], np.int32)
        valid = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
        needs = frozenset({"teacher_logp", "teacher_topk"})
        got = remote.score(tokens, valid, needs, top_k=4)
        want = JaxTeacher.from_pretrained(pair[1], dtype="float32").score(tokens, valid, needs, top_k=4)
        scored = valid & np.roll(valid, 1, axis=1)
        scored[:, 0] = False
        assert np.abs(got.teacher_logp_BT - want.teacher_logp_BT)[scored].max() <= 1e-4
        np.testing.assert_array_equal(got.teacher_topk_ids_BTK[scored], want.teacher_topk_ids_BTK[scored])


def test_vllms_server_serves_one_run_and_tags_every_token_with_it(servers, pair):
    """vLLM's own server is bound like opdjax's: a second run refused in one line naming the first; after a
    take-over the first run's rollouts carry the other session's tag and are refused, never trained on."""
    from opdjax.remote.client import ServerBusy
    from opdjax.remote.lease import RunId

    cfg = hf.load_config(pair[0])  # the server samples the tokenizer's 259 ids, not the 320 rows
    end, params = [f"127.0.0.1:{servers['rollout']['port']}"], nnx.state(decoder.create(cfg, seed=33))
    a = RemoteEngine(end, SECRET, cfg, pad_id=0, calls=CallSettings(wait_s=10), run=RunId.fresh("host:/runs/a"))
    try:
        Publisher(cfg, a.link, dtype="float32").publish(params, 3)
        with pytest.raises(ServerBusy, match="rollout server .* serves another run: .*host:/runs/a"):
            RemoteEngine(end, SECRET, cfg, pad_id=0, calls=CallSettings(wait_s=10), run=RunId.fresh("host:/runs/b"))
        with RemoteEngine(end, SECRET, cfg, pad_id=0, calls=CallSettings(wait_s=10),
                          run=RunId.fresh("host:/runs/c", takeover=True)) as c:
            Publisher(cfg, c.link, dtype="float32").publish(params, 0)  # a new session starts its own order
            assert (c.generate([[5, 6]], SamplingParams(max_new_tokens=3), seed=0).version_B == 0).all()
            with pytest.raises(ServerBusy, match="not this run's"):
                a.generate([[5, 6]], SamplingParams(max_new_tokens=3), seed=0)
    finally:
        a.close()
