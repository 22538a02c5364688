"""A server serves one run: the lease's rules (bind, resume, take-over, expiry, release), and what an in-process
`EngineServer` does with them (a second run refused in one line, a taken-over run failing loudly, no rollout before
the run's first publish, every rollout tagged with its run and session)."""

import json
import urllib.error
import urllib.request

import pytest

from opdjax.models import ModelConfig, hf
from opdjax.models.tiny import load_tokenizer
from opdjax.remote.client import CallSettings, RemoteEngine, RemoteTeacher, ServerBusy
from opdjax.remote.lease import SESSION_HEADER, Lease, LeaseError, RunId
from opdjax.remote.server import EngineServer
from opdjax.rollout import SamplingParams
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.sync import Publisher
from opdjax.teacher import JaxTeacher

TOKEN = "lease-secret"
FAST = CallSettings(wait_s=2, backoff=0.05, timeout=30)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _body(run, session, takeover=False):
    return RunId(run=run, session=session, label=f"host:/runs/{run}", takeover=takeover).bind_body()


def test_the_lease_binds_one_run_and_names_it_to_any_other():
    clock, new = Clock(), []
    lease = Lease(idle_timeout=100, on_new_session=lambda: new.append(1), clock=clock)
    assert lease.bind(_body("a", "a1"))["new_session"] and len(new) == 1
    assert not lease.bind(_body("a", "a1"))["new_session"]  # another process of the same launch
    with pytest.raises(LeaseError, match=r"serves run a \(host:/runs/a, bound .*sync.takeover=true") as e:
        lease.bind(_body("b", "b1"))
    assert e.value.kind == "held" and lease.holder.run == "a"
    lease.admit("a1")
    with pytest.raises(LeaseError) as e:
        lease.admit(None)  # a client that never bound
    assert e.value.kind == "held"
    assert lease.bind(_body("a", "a2"))["new_session"] and len(new) == 2  # a resumed launch of run a
    with pytest.raises(LeaseError) as e:
        lease.admit("a1")  # the earlier launch lost it
    assert e.value.kind == "lost"
    clock.t = 150.0  # a's lease expired: another run may bind
    assert lease.bind(_body("b", "b1"))["new_session"] and lease.holder.run == "b"
    assert lease.bind(_body("c", "c1", takeover=True))["new_session"] and lease.holder.run == "c"
    assert not lease.release("b1") and lease.release("c1") and lease.holder is None
    with pytest.raises(LeaseError) as e:
        lease.admit("c1")
    assert e.value.kind == "unbound"
    lease.admit(None)  # nobody holds it: plain clients are served
    with pytest.raises(LeaseError, match="RunId.session"):
        lease.bind({"run": "x", "session": "bad id!", "label": ""})


def _engine(path):
    return JaxEngine.from_pretrained(path, pad_id=load_tokenizer(path).pad_token_id)


def _run(name, takeover=False):
    return RunId.fresh(f"host:/runs/{name}", run=name, takeover=takeover)


def _post(port, path, body, session=None):
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    if session:
        headers[SESSION_HEADER] = session
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_second_run_is_refused_and_a_taken_over_run_fails_loudly(pair):
    mcfg = ModelConfig.from_dir(pair[0])
    params = hf.read_tensors(pair[0])
    sp = SamplingParams(max_new_tokens=3)
    with EngineServer(engine=_engine(pair[0]), token=TOKEN) as rs:
        a = RemoteEngine([f"127.0.0.1:{rs.port}"], TOKEN, mcfg, pad_id=0, calls=FAST, run=_run("a"))
        with pytest.raises(Exception, match="before this run published"):
            a.generate([[5, 6]], sp, seed=0)
        code, out = _post(rs.port, "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 2}, a.run.session)
        assert code == 409 and out["error"]["type"] == "lease_unpublished"  # the server refuses it too
        Publisher(mcfg, a.link, dtype="float32").publish(params, 0)
        batch = a.generate([[5, 6], [7]], sp, seed=0)
        assert (batch.version_B == 0).all()
        code, out = _post(rs.port, "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 2}, a.run.session)
        assert code == 200 and {(c["run"], c["session"]) for c in out["choices"]} == {("a", a.run.session)}

        with pytest.raises(ServerBusy, match=r"rollout server 127.0.0.1:\d+ serves another run: .*serves run a "
                                             r"\(host:/runs/a"):
            RemoteEngine([f"127.0.0.1:{rs.port}"], TOKEN, mcfg, pad_id=0, calls=FAST, run=_run("b"))
        code, out = _post(rs.port, "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 2})
        assert code == 409 and out["error"]["type"] == "lease_held"  # a client that never bound
        assert rs.info()["lease"]["run"] == "a"

        b = RemoteEngine([f"127.0.0.1:{rs.port}"], TOKEN, mcfg, pad_id=0, calls=FAST, run=_run("b", takeover=True))
        with pytest.raises(ServerBusy, match="no longer holds it"):
            a.generate([[5, 6]], sp, seed=1)  # the displaced run's next call fails, it never samples b's weights
        with pytest.raises(ServerBusy):
            Publisher(mcfg, a.link, dtype="float32").publish(params, 1)  # nor does its publish land
        Publisher(mcfg, b.link, dtype="float32").publish(params, 0)  # b starts its own order at v0
        assert rs.engine.receiver.received_version == 0
        b.close()
        assert rs.info()["lease"] is None
        c = RemoteEngine([f"127.0.0.1:{rs.port}"], TOKEN, mcfg, pad_id=0, calls=FAST, run=_run("c"))
        c.close()


def test_a_teacher_server_serves_one_run_too(pair):
    with EngineServer(teacher=JaxTeacher.from_pretrained(pair[1]), token=TOKEN) as ts:
        tcfg = hf.load_config(pair[1])  # the usable vocabulary: the tokenizer's
        a = RemoteTeacher([f"127.0.0.1:{ts.port}"], TOKEN, tcfg, temperature=1.0, calls=FAST, run=_run("a"))
        with pytest.raises(ServerBusy, match="teacher server .* serves run a"):
            RemoteTeacher([f"127.0.0.1:{ts.port}"], TOKEN, tcfg, temperature=1.0, calls=FAST, run=_run("b"))
        a.close()
        RemoteTeacher([f"127.0.0.1:{ts.port}"], TOKEN, tcfg, temperature=1.0, calls=FAST, run=_run("b")).close()
