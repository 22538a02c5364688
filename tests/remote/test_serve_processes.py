"""`opdjax serve` as separate OS processes: a run against a rollout server and a teacher server survives kill -9 of
the rollout server mid-run (it is restarted on the same port, resynchronised, and the outage is reported)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from opdjax.pipeline import loop as pipeline
from tests.pipeline.test_loop import _cfg, _lines

pytestmark = pytest.mark.slow  # real `opdjax serve` processes


START_TIMEOUT = 420.0  # seconds for a server to print its ready line (a vLLM server loads in ~60 s here)


def _readline(p, deadline: float) -> str:
    """The next stdout line of `p`, or a test failure (the process killed) once `deadline` passes: a stuck server
    must fail its test, not hang the suite."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(max(deadline - time.time(), 0.0))
    if not box:
        p.kill()
        pytest.fail(f"no line from {p.args[3:6]} within {START_TIMEOUT:.0f}s")
    return box[0]


def _start(role, pair, token_file, *extra):
    """`opdjax serve --role ROLE` with `extra` flags (and overrides after them) on the pair; (process, ready line)."""
    cmd = [sys.executable, "-m", "opdjax.cli", "serve", "--role", role, "--token-file", token_file, *extra,
           f"student={pair[0]}", f"teacher={pair[1]}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + START_TIMEOUT
    line = _readline(p, deadline)  # the ready line (or EOF when it died)
    while line and not line.startswith('{"event"'):
        line = _readline(p, deadline)
    if not line:
        p.wait(timeout=30)
        pytest.fail(f"opdjax serve --role {role} exited with {p.returncode} before it was ready")
    ready = json.loads(line)
    assert ready["event"] == "ready" and ready["role"] == role and ready["url"].startswith("http://127.0.0.1:")
    return p, ready


def test_a_run_survives_kill_9_of_its_rollout_server(pair, tmp_path):
    token = tmp_path / "token"
    token.write_text("process-secret")
    rollout, r = _start("rollout", pair, str(token))
    teacher, t = _start("teacher", pair, str(token))
    procs = [rollout, teacher]
    try:
        cfg = _cfg(pair, tmp_path, "pipeline.steps=10", "pipeline.eval_every=5",
                   f"rollout.endpoints=[127.0.0.1:{r['port']}]", f"teacher.endpoints=[127.0.0.1:{t['port']}]",
                   f"sync.token_file={token}", "sync.wait_s=120", "sync.request_timeout=30")
        out: dict = {}
        th = threading.Thread(target=lambda: out.update(pipeline.train(cfg, log=lambda s: None)))
        th.start()
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and th.is_alive():
            if metrics.exists() and any(x.get("step", 0) >= 3 and "loss" in x for x in _lines(tmp_path)):
                break
            time.sleep(0.2)
        os.kill(rollout.pid, signal.SIGKILL)  # mid-run
        rollout.wait(timeout=30)
        time.sleep(1.0)
        rollout, _ = _start("rollout", pair, str(token), "--port", str(r["port"]))  # back, serving v0
        procs.append(rollout)
        th.join(timeout=400)
        assert not th.is_alive()
        assert out["steps"] == 10
        events = [o["event"] for o in out["server_outages"]]
        assert events[:2] == ["down", "up"], out["server_outages"]
        steps = [x for x in _lines(tmp_path) if "loss" in x]
        assert [x["step"] for x in steps] == list(range(1, 11))
        assert all(x["staleness"] == 0 for x in steps)  # every trained rollout came from the newest weights
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_a_server_serves_one_run_a_second_is_refused_and_the_next_starts_clean(pair, tmp_path):
    """Two runs against one pair of `opdjax serve` processes: while run a holds them (paused after its first step),
    run b is refused in one line naming run a (exit 2) and a trains on undisturbed; after a has finished (and freed
    the servers) a fresh run c binds them and trains on its own weights from step 1: staleness 0, k3 at the clean
    level (the servers held a's last weights, which c never samples)."""
    token = tmp_path / "token"
    token.write_text("one-run-secret")
    rollout, r = _start("rollout", pair, str(token))
    teacher, t = _start("teacher", pair, str(token))
    ends = [f"rollout.endpoints=[127.0.0.1:{r['port']}]", f"teacher.endpoints=[127.0.0.1:{t['port']}]",
            f"sync.token_file={token}", "pipeline.eval_every=0"]
    run_a = tmp_path / "a"
    a = subprocess.Popen([sys.executable, "-m", "opdjax.cli", "train", f"student={pair[0]}", f"teacher={pair[1]}",
                          "task.options={digits: 1}", "rollout.batch_size=8", "rollout.max_new_tokens=4",
                          "pipeline.progress=false", "pipeline.tensorboard=false", "pipeline.eval_prompts=8",
                          "pipeline.steps=6", "optim.lr=0.01", "seed=1", f"pipeline.out_dir={run_a / 'run'}", *ends],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    procs = [rollout, teacher, a]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and a.poll() is None:
            if (run_a / "run" / "metrics.jsonl").exists() and any("loss" in x for x in _lines(run_a)):
                break
            time.sleep(0.1)
        a.send_signal(signal.SIGSTOP)  # a holds the servers, idle
        b = subprocess.run([sys.executable, "-m", "opdjax.cli", "train", f"student={pair[0]}", f"teacher={pair[1]}",
                            "task.options={digits: 1}", "rollout.batch_size=8", "rollout.max_new_tokens=4",
                            "pipeline.progress=false", f"pipeline.out_dir={tmp_path / 'b' / 'run'}", *ends],
                           capture_output=True, text=True, timeout=300)
        a.send_signal(signal.SIGCONT)
        err = b.stderr.strip().splitlines()
        assert b.returncode == 2 and len(err) == 1, b.stderr[-2000:]
        assert "ServerBusy" in err[0] and "serves another run" in err[0] and str(run_a / "run") in err[0], err[0]
        assert a.wait(timeout=300) == 0, a.stderr.read()[-2000:]
        steps_a = [x for x in _lines(run_a) if "loss" in x]
        assert [x["step"] for x in steps_a] == list(range(1, 7))
        assert all(x["staleness"] == 0 and abs(x["mismatch/k3"]) < 1e-6 for x in steps_a)

        c = pipeline.train(_cfg(pair, tmp_path / "c", "pipeline.steps=2", "seed=2", *ends), log=lambda s: None)
        steps_c = [x for x in _lines(tmp_path / "c") if "loss" in x]
        assert c["steps"] == 2 and [x["staleness"] for x in steps_c] == [0, 0]
        assert all(abs(x["mismatch/k3"]) < 1e-6 for x in steps_c)  # c's own weights from step 1, not a's
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
