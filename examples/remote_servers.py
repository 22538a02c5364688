"""Drive remote engine servers from your own loop: a rollout server and a teacher server (`opdjax serve`), the
learner here, weights published over the servers' TCP bridges.

    python examples/remote_servers.py STUDENT_DIR TEACHER_DIR

In a mixed TPU–GPU deployment the servers run on GPU hosts (`opdjax serve --role rollout --engine vllm --host
0.0.0.0 ...`) and the learner on TPU hosts; here both servers run the JAX engine on this machine.
"""
import json
import os
import secrets
import subprocess
import sys
import tempfile

import opdjax
from opdjax.data.prompts import PromptStream
from opdjax.models import hf
from opdjax.models.tiny import load_tokenizer
from opdjax.remote.client import RemoteEngine, RemoteTeacher, read_token


def serve(role: str, student: str, teacher: str, token_file: str) -> tuple[subprocess.Popen, int]:
    """Start `opdjax serve --role ROLE` and wait for its ready line ({"event": "ready", "port": ...})."""
    p = subprocess.Popen([sys.executable, "-m", "opdjax.cli", "serve", "--role", role, "--token-file", token_file,
                          f"student={student}", f"teacher={teacher}"], stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith('{"event"'):
            return p, json.loads(line)["port"]
    raise RuntimeError(f"opdjax serve --role {role} exited with {p.wait()} before it was ready")


def main(student: str, teacher: str, steps: int = 2) -> list[dict]:
    token_file = os.path.join(tempfile.mkdtemp(), "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(16))  # the shared secret: a file, never a command-line argument
    procs = []
    try:
        ports = []
        for role in ("rollout", "teacher"):
            p, port = serve(role, student, teacher, token_file)
            procs.append(p)
            ports.append(port)
        r_port, t_port = ports
        tok, cfg, token = load_tokenizer(student), opdjax.load_config(student), read_token(token_file)
        graphdef, params = hf.load_state(student, cfg)
        engine = RemoteEngine([f"127.0.0.1:{r_port}"], token, cfg, pad_id=tok.pad_token_id)
        teacher_client = RemoteTeacher([f"127.0.0.1:{t_port}"], token, cfg, temperature=1.0)
        publisher, link = opdjax.engine_publisher(engine, cfg)  # the rollout server's bridge
        tx, schedule = opdjax.make_optimizer(lr=3e-4, total_steps=steps)
        parts = opdjax.OPDParts(engine=engine, teacher=teacher_client, publisher=publisher, tokenizer=tok,
                                learner=opdjax.Learner(graphdef, tx=tx, schedule=schedule, temperature=1.0),
                                sampling=opdjax.SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_token_id,)))
        stream, state, history = PromptStream(opdjax.get_task("addition", digits=1), seed=0), parts.learner.init(params), []
        opdjax.publish(parts, state.params, 0)  # the servers start from their own copy of the student: sync them
        for step in range(steps):
            state, m = opdjax.opd_step(parts, state, stream.next(8), seed=step)
            history.append({**m, "served_version": engine.version})
            print(f"step {step + 1}: loss {m['loss']:.4f}, mismatch k3 {m['mismatch/k3']:.1e}, served v{engine.version}")
        link.close()
        engine.close()  # free the servers for the next run
        teacher_client.close()
        return history
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/remote_servers.py STUDENT_DIR TEACHER_DIR   (HF dirs sharing one tokenizer)")
    main(sys.argv[1], sys.argv[2])
