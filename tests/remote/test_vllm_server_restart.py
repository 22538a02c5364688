"""A weight reload that fails part-way inside vLLM's server is never reported as "still serving the previous
version": the worker extension reloads every layer from the checkpoint and says it serves v0; when even that fails
it asks `opdjax serve` for a restart and exits, and `opdjax serve` starts the server again and says so."""

import argparse
import json
import sys
import textwrap
import threading

import pytest

from opdjax import config
from opdjax.cli import serve
from opdjax.remote import vllm_server


class _FakeWorker(vllm_server.OpdjaxWorker):
    """The extension's methods on a worker whose reload fails part-way (vLLM's layerwise reload raising)."""

    def __init__(self):
        target = vllm_server._Staging()
        target.pending = (3, [("model.layers.0.mlp.up_proj.weight", None)])
        self._opdjax_state = argparse.Namespace(target=target)

    def reload_weights(self, **kw):
        raise RuntimeError("out of memory materializing model.layers.1.mlp")


def test_a_failed_reload_is_recovered_from_the_checkpoint_and_reported_as_v0(monkeypatch):
    recovered = []
    monkeypatch.setattr(vllm_server, "recover_from_failed_reload", recovered.append)
    w = _FakeWorker()
    with pytest.raises(RuntimeError, match="v3: vLLM's reload failed part-way.*reloaded from the checkpoint: this "
                                           "server serves v0"):
        w.opdjax_apply("3")
    assert recovered == [w] and w._opdjax_state.target.version == 0


def test_a_failed_reload_that_cannot_recover_asks_for_a_restart(tmp_path, monkeypatch):
    restart, exits = tmp_path / "restart", []
    done = threading.Event()
    monkeypatch.setenv("OPDJAX_RESTART_FILE", str(restart))
    monkeypatch.setattr(vllm_server, "_EXIT", lambda code: (exits.append(code), done.set()))
    w = _FakeWorker()
    with pytest.raises(RuntimeError, match="v3: vLLM's reload failed part-way.*out of memory.*reloading the "
                                           "checkpoint failed too.*restarts it"):
        w.opdjax_apply("3")
    assert done.wait(10) and exits == [vllm_server.RESTART_EXIT_CODE]
    assert "failed part-way" in restart.read_text()
    assert w._opdjax_state.target.version == 0 and w._opdjax_state.target.pending is None


CHILD = textwrap.dedent('''
    import http.server, json, os, pathlib, sys, threading
    port, first = int(sys.argv[1]), pathlib.Path(sys.argv[2])
    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.dumps({"results": [{"received_version": 0, "bridge": {"port": 9}}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
            if not first.exists():  # the first server: its reload fails part-way
                first.write_text("x")
                pathlib.Path(os.environ["OPDJAX_RESTART_FILE"]).write_text("v3: vLLM's reload failed part-way")
                threading.Timer(0.2, os._exit, args=(75,)).start()
            else:
                threading.Timer(0.2, os._exit, args=(0,)).start()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.mark.slow  # `opdjax serve` starting (and restarting) a server process
def test_opdjax_serve_restarts_a_server_that_asks_for_it_and_says_so(pair, tmp_path, monkeypatch, capfd):
    script, first = tmp_path / "child.py", tmp_path / "first"
    script.write_text(CHILD)

    def fake_command(model, **kw):
        return [sys.executable, str(script), str(kw["port"]), str(first)], {}
    monkeypatch.setattr(serve, "vllm_command", fake_command)
    args = argparse.Namespace(role="rollout", token_file=str(tmp_path / "t"), host="127.0.0.1", port=0,
                              bridge_port=0, shm_root=None, print_command=False, start_timeout=60)
    (tmp_path / "t").write_text("secret")
    cfg = config.load(config.TrainConfig, None, [f"student={pair[0]}", "rollout.engine=vllm"])
    assert serve._serve_vllm(args, cfg, pair[0], "secret") == 0
    lines = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["event"] for x in lines] == ["ready", "restarted"]
    assert "failed part-way" in lines[1]["reason"] and lines[1]["version"] == 0
