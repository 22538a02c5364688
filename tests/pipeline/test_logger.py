"""Run metrics: JSONL, and Weights & Biases written offline (no network) and read back from W&B's own run file."""

import json
import math
import pathlib
import struct
import time

import pytest

from opdjax.cli.main import main
from opdjax.config import TrainConfig, WandbConfig, load
from opdjax.pipeline import logger as logger_mod
from opdjax.pipeline import wandb_sink
from opdjax.pipeline.logger import MetricsLogger


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B kept off the network and quiet, its global files under tmp_path; skips where wandb is not installed."""
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
           "WANDB_DIR": str(tmp_path / "wandb_home"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _records(path: pathlib.Path) -> list:
    """The protobuf records of a W&B run file (`run-<id>.wandb`): a ':W&B' header, then LevelDB-log chunks in 32 KiB
    blocks (4-byte CRC, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, out, buf = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(buf))
    return out


def _put(d: dict, item) -> None:
    """One config/summary/history item into `d` (a nested key as nested dicts); W&B's own keys (_...) left out."""
    path = list(item.nested_key) or [item.key]
    if path[0].startswith("_"):
        return
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = json.loads(item.value_json)


def read_run_when(run_dir: pathlib.Path, ready, seconds: float = 30) -> dict:
    """`read_run` once `ready(got)` holds, or after `seconds`: wandb-core may still be writing the run file after
    finish() returns on a loaded machine (seen in full runs)."""
    deadline = time.time() + seconds
    got = read_run(run_dir)
    while not ready(got) and time.time() < deadline:
        time.sleep(0.5)
        got = read_run(run_dir)
    return got


def read_run(run_dir: pathlib.Path) -> dict:
    """What a W&B run file holds: the run record (id, name, group, tags), its config, each step's history, the final
    summary."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run, config, history, summary = None, {}, {}, {}
    for r in _records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            for item in r.run.config.update:
                _put(config, item)
        elif kind == "config":
            for item in r.config.update:
                _put(config, item)
        elif kind == "history":
            for item in r.history.item:
                _put(history.setdefault(r.history.step.num, {}), item)
        elif kind == "summary":
            for item in r.summary.update:
                _put(summary, item)
    return {"run": run, "config": config, "history": history, "summary": summary}


CONFIG = {"seed": 3, "optim": {"lr": 3e-4}, "rollout": {"recipe": "fp8_w8a8"}, "mesh": {"shape": [1, -1, 1]}}
SUMMARY = {"steps": 2, "mode": "sync", "initial": {"eval/accuracy": 0.25}, "final": {"eval/accuracy": 0.5},
           "reverse_kl_ratio": 0.5, "server_outages": [{"seconds": 1.5}]}


def test_an_offline_wandb_run_is_written_and_read_back(offline, tmp_path):
    out = tmp_path / "runs" / "demo"
    settings = WandbConfig(mode="offline", group="fp8", tags=("fp8", "sync"))
    with MetricsLogger(out, tensorboard=False, resume=False, wandb=settings, config=CONFIG) as m:
        m.log(0, {"eval/accuracy": 0.25})
        m.log(1, {"loss": 1.5, "grad_norm": 2, "mismatch/k3": float("nan"), "note": "text"})
        m.log(2, {"loss": 0.75, "eval/accuracy": 0.5})
        m.finish(SUMMARY)
    got = read_run_when(out, lambda g: g["run"] is not None and g["summary"])
    run_id = (out / wandb_sink.ID_FILE).read_text().strip()
    assert (got["run"].run_id, got["run"].display_name, got["run"].run_group) == (run_id, "demo", "fp8")
    assert got["run"].project == "opdjax" and list(got["run"].tags) == ["fp8", "sync"]
    assert got["config"] == CONFIG
    h = got["history"]
    assert h[0] == {"eval/accuracy": 0.25} and h[2] == {"loss": 0.75, "eval/accuracy": 0.5}
    assert h[1]["loss"] == 1.5 and h[1]["grad_norm"] == 2.0 and math.isnan(h[1]["mismatch/k3"])
    assert "note" not in h[1]  # text stays in metrics.jsonl
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[1])["note"] == "text"
    assert {k: got["summary"][k] for k in SUMMARY} == SUMMARY  # summary.json, next to the last value of each metric
    assert got["summary"]["loss"] == 0.75


def test_a_resumed_run_keeps_its_wandb_id_and_a_fresh_run_gets_a_new_one(tmp_path):
    first = wandb_sink.run_id(tmp_path, resume=False)
    assert wandb_sink.run_id(tmp_path, resume=True) == first
    assert wandb_sink.run_id(tmp_path, resume=False) != first
    (tmp_path / "older").mkdir()  # resuming a run that logged no W&B: a new id, kept for the next resume
    fresh = wandb_sink.run_id(tmp_path / "older", resume=True)
    assert (tmp_path / "older" / wandb_sink.ID_FILE).read_text().strip() == fresh


def test_a_resumed_logger_continues_the_same_wandb_run(offline, tmp_path):
    for resume in (False, True):
        with MetricsLogger(tmp_path, tensorboard=False, resume=resume, wandb=WandbConfig(mode="offline")) as m:
            m.log(1 + resume, {"loss": 1.0})
    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    kept = (tmp_path / wandb_sink.ID_FILE).read_text().strip()
    assert [f.name for f in files] == [f"run-{kept}.wandb"] * 2


def test_init_arguments_default_to_the_run_directory(tmp_path):
    kw = wandb_sink.init_kwargs(WandbConfig(mode="online"), tmp_path / "seed3", {"seed": 3}, "abc")
    assert kw == {"mode": "online", "project": "opdjax", "entity": None, "name": "seed3", "group": None, "tags": None,
                  "dir": str(tmp_path / "seed3"), "config": {"seed": 3}, "id": "abc", "resume": "allow"}
    kw = wandb_sink.init_kwargs(WandbConfig(mode="offline", name="n", entity="e", dir="/w"), tmp_path, {}, "abc")
    assert (kw["name"], kw["entity"], kw["dir"]) == ("n", "e", "/w")


def test_only_process_0_logs_and_every_process_stops_when_its_wandb_cannot_start(tmp_path, monkeypatch):
    monkeypatch.setattr(logger_mod.jax, "process_index", lambda: 1)
    with MetricsLogger(tmp_path / "run", tensorboard=False, resume=False, wandb=WandbConfig(mode="offline")) as m:
        m.log(1, {"loss": 1.0})
        m.finish({"steps": 1})
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(logger_mod, "agree", lambda problem: 1)  # process 0 could not start its W&B run
    with pytest.raises(wandb_sink.WandbError, match="learner process 0 could not start its W&B run"):
        MetricsLogger(tmp_path / "run", tensorboard=False, resume=False, wandb=WandbConfig(mode="offline"))


def test_wandb_not_installed_is_one_line_before_the_run_starts(tmp_path, monkeypatch, capsys):
    real = wandb_sink.importlib.util.find_spec
    monkeypatch.setattr(wandb_sink.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(
        name, *a))
    assert main(["train", "pipeline.wandb=offline", f"pipeline.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.wandb.mode=offline needs the wandb package" in err and "pip install 'opdjax[wandb]'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_wandb_run_that_cannot_start_stops_the_run_in_one_line(offline, tmp_path, monkeypatch):
    import wandb

    def refuse(**kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(wandb_sink.WandbError, match=r"W&B could not start the run \(pipeline.wandb.mode=online\): "
                                                    r"UsageError: api_key not configured .*wandb login") as e:
        MetricsLogger(tmp_path / "run", tensorboard=False, resume=False, wandb=WandbConfig(mode="online"))
    assert "\n" not in str(e.value) and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_wandb_failure_mid_run_is_said_once_and_training_goes_on(tmp_path):
    said = []

    class Broken:
        summary = {}

        def log(self, *a, **kw):
            raise ConnectionError("the service is gone")

        def finish(self, **kw):
            raise AssertionError("not called after a failure")

    sink = object.__new__(wandb_sink.WandbSink)
    sink.run, sink.say = Broken(), said.append
    sink.log(1, {"loss": 1.0})
    sink.log(2, {"loss": 1.0})
    sink.finish({"steps": 2})
    assert said == ["WARNING: W&B failed to log a step (ConnectionError: the service is gone); W&B logging stops "
                    "here, metrics.jsonl goes on"]


@pytest.mark.slow  # a 2-step run
def test_a_training_run_logs_its_config_steps_and_summary_to_wandb(offline, pair, tmp_path):
    from opdjax.pipeline import loop

    cfg = load(TrainConfig, None, [
        f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
        "rollout.max_new_tokens=4", "pipeline.steps=2", "pipeline.eval_every=2", "pipeline.eval_prompts=8",
        "pipeline.progress=false", "pipeline.tensorboard=false", f"pipeline.out_dir={tmp_path / 'run'}",
        "pipeline.wandb=offline"])
    summary = loop.train(cfg, log=lambda s: None)
    out = tmp_path / "run"
    got = read_run_when(out, lambda g: g["config"])
    assert got["config"] == json.loads((out / "config.json").read_text())
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert got["history"][row.pop("step")] == pytest.approx(row, nan_ok=True)
    assert {k: got["summary"][k] for k in summary} == json.loads((out / "summary.json").read_text())
