"""`opdjax serve --engine vllm rollout.recipe=fp8_w8a8 rollout.fp8_emulation=true` on this CPU: vLLM's own server
serves FP8 weights (its online fp8_per_tensor, emulated kernels), and publishes over the TCP bridge land in FP8 with
the scale vLLM's formula gives from the new weights; the command for a GPU host prints on any host."""

import json
import subprocess
import sys
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx

from opdjax import quant
from opdjax.models import decoder, hf
from opdjax.remote.client import CallSettings, RemoteEngine
from opdjax.rollout import SamplingParams
from opdjax.rollout import EngineMismatch, JaxEngine
from opdjax.sync import Publisher
from tests.remote.test_serve_processes import _start
from tests.rollout.test_vllm_fp8_cpu import closest, rivals

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SECRET = "vllm-fp8-secret"
VLLM_KW = "rollout.vllm={kv_cache_memory_bytes: 33554432, max_model_len: 256, max_num_seqs: 16}"


def _print_command(pair, tmp_path, *overrides):
    token = tmp_path / "token"
    token.write_text("x")
    return subprocess.run([sys.executable, "-m", "opdjax.cli", "serve", "--role", "rollout", "--engine", "vllm",
                           "--token-file", str(token), "--print-command", f"student={pair[0]}", f"teacher={pair[1]}",
                           *overrides], capture_output=True, text=True, timeout=120)


def test_print_command_for_a_gpu_host_is_bf16_on_any_host_and_float32_is_refused_in_one_line(pair, tmp_path):
    out = _print_command(pair, tmp_path, "rollout.recipe=fp8_w8a8")
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    assert "--dtype bfloat16" in line and "--quantization fp8_per_tensor" in line
    assert "OPDJAX_VLLM_CPU_FP8" not in line  # no emulation unless asked for
    bad = _print_command(pair, tmp_path, "rollout.recipe=fp8_w8a8", "rollout.dtype=float32")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    msg = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(msg) == 1 and "rollout.dtype=float32" in msg[0] and "rollout.dtype=bfloat16" in msg[0], bad.stderr


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory, vllm_module):
    d = tmp_path_factory.mktemp("vllm_fp8_serve")
    token = d / "token"
    token.write_text(SECRET)
    proc, ready = _start("rollout", pair, str(token), "--engine", "vllm", "rollout.recipe=fp8_w8a8",
                         "rollout.fp8_emulation=true", VLLM_KW)
    try:
        yield ready
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def _weights(url) -> dict:
    req = urllib.request.Request(url + "/collective_rpc", data=json.dumps({"method": "opdjax_weights"}).encode(),
                                 headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["results"][0]


def test_publishes_over_the_bridge_land_in_fp8_in_vllms_own_server(server, pair):
    cfg = hf.load_config(pair[0])  # the server samples the tokenizer's 259 ids, not the 320 rows
    with RemoteEngine([f"127.0.0.1:{server['port']}"], SECRET, cfg, pad_id=0, calls=CallSettings(wait_s=10)) as remote:
        w0 = _weights(server["url"])
        assert w0["fp8_emulation"] == "token"  # fp8_w8a8: per-token activations, as on Hopper
        engines = {k: JaxEngine(cfg, dtype="bfloat16", mismatch=EngineMismatch(recipe=r))
                   for k, r in rivals(quant.get_recipe("fp8_w8a8")).items()}
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.usable_size, size=rng.integers(3, 10)).tolist() for _ in range(16)]
        sp = SamplingParams(max_new_tokens=8)
        prev = None
        for version, seed in ((1, 41), (2, 42)):
            # weights 6x the init scale: sharper log-probs, so FP8 rounding moves them well beyond bf16 numerics
            params = jax.tree.map(lambda a: a * 6.0 if a.ndim == 2 else a, nnx.state(decoder.create(cfg, seed=seed)))
            Publisher(cfg, remote.link, dtype="bfloat16").publish(params, version)
            served = _weights(server["url"])
            assert served["version"] == version
            named = hf.named_params(cfg, params)
            for i in range(cfg.num_layers):
                layer = served["layers"][f"model.layers.{i}.self_attn.qkv_proj"]
                qkv = [np.asarray(named[f"model.layers.{i}.self_attn.{m}_proj.weight"]).astype("bfloat16") for m in "qkv"]
                want = np.float32(max(np.abs(a.astype(np.float32)).max() for a in qkv)) / np.float32(448)
                assert layer["dtype"] == "float8_e4m3fn" and layer["scale"] == [pytest.approx(float(want), rel=1e-6)]
            batch = remote.generate(prompts, sp, seed=3)
            assert (batch.version_B == version).all()
            m = batch.completion_mask_BT
            for e in engines.values():
                e.update_weights(named, version)
            gaps = closest(engines, batch)
            assert min(gaps, key=gaps.get) == "sim", gaps  # closer to the simulation than to its near misses
            if prev is not None:
                assert np.abs(prev - batch.rollout_logp_BT)[m].mean() > 0.05  # a new version, new log-probs
            prev = batch.rollout_logp_BT
        remote.link.close()
        assert quant.get_recipe("fp8_w8a8").fused_scales
