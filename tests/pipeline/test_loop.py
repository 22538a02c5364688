"""The OPD loop end to end on tiny random models: sync, async, resume, losses that need different teacher data."""

import json

import numpy as np
import pytest

from opdjax.config import TrainConfig, load
from opdjax.learner import latest_step
from opdjax.models import load_state
from opdjax.models.tiny import make_tiny
from opdjax.pipeline import loop as pipeline
from opdjax.pipeline import rollouts
from opdjax.teacher import VocabMismatchError


def _cfg(pair, tmp_path, *extra):
    return load(TrainConfig, None, [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}",
                                    "rollout.batch_size=8", "rollout.max_new_tokens=4", "pipeline.steps=4",
                                    "pipeline.eval_every=2", "pipeline.eval_prompts=8", "pipeline.progress=false",
                                    "pipeline.tensorboard=false", f"pipeline.out_dir={tmp_path / 'run'}", *extra])


def _lines(tmp_path):
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a 4-step run with evaluations
def test_sync_run_logs_mismatch_and_the_teacher_divergence_every_step(pair, tmp_path):
    summary = pipeline.train(_cfg(pair, tmp_path), log=lambda s: None)
    assert summary["steps"] == 4
    lines = _lines(tmp_path)
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    for x in steps:
        assert {"forward_kl", "grad_norm", "mismatch/k3", "mismatch/k1", "mismatch/abs_log_ratio_p95"} <= set(x)
        assert x["staleness"] == 0
        # Same f32 weights, same forward: the embedded engine and the learner agree to float rounding.
        assert abs(x["mismatch/k3"]) < 1e-6
    assert {"eval/reverse_kl", "eval/accuracy"} <= set(lines[0])
    assert (tmp_path / "run" / "student_final" / "model.safetensors").is_file()
    assert latest_step(tmp_path / "run" / "checkpoints") == 4


@pytest.mark.slow  # a run with the simulated FP8 engine (its own compilations)
def test_simulated_fp8_engine_shows_mismatch(pair, tmp_path):
    pipeline.train(_cfg(pair, tmp_path, "rollout.recipe=fp8_w8a8_kv", "pipeline.steps=2", "loss.correction=token_tis"),
                   log=lambda s: None)
    steps = [x for x in _lines(tmp_path) if "loss" in x]
    assert all(x["mismatch/k3"] > 0 for x in steps)
    assert all("corr/is_frac_capped" in x for x in steps)


@pytest.mark.slow  # three 2-step runs
def test_a_finished_run_is_never_destroyed(pair, tmp_path):
    """Issue 16 rows 1 and 3: a fresh run into a run's directory is refused unless pipeline.overwrite=true (which
    replaces it); resuming a finished run is a no-op that keeps its summary and its metrics."""
    from opdjax.pipeline.rundir import RunDirError

    first = pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2"), log=lambda s: None)
    out = tmp_path / "run"
    summary, metrics = (out / "summary.json").read_text(), (out / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="holds a previous run .*pipeline.overwrite=true"):
        pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2"), log=lambda s: None)
    again = pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2", "pipeline.resume=true"), log=lambda s: None)
    assert again == first and (out / "summary.json").read_text() == summary
    assert (out / "metrics.jsonl").read_text() == metrics
    pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2", "pipeline.overwrite=true"), log=lambda s: None)
    assert latest_step(out / "checkpoints") == 2 and len(_lines(tmp_path)) == len(metrics.splitlines())


def test_a_run_directory_in_use_is_refused(pair, tmp_path):
    """Issue 16 row 2: while one run holds out_dir, a second one is refused and names the first."""
    from opdjax.pipeline import rundir

    out = tmp_path / "run"
    out.mkdir()
    held = rundir.lock(out)
    try:
        with pytest.raises(rundir.RunDirError, match=r"is in use by pid \d+"):
            pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2"), log=lambda s: None)
    finally:
        held.release()
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow  # three runs, 8 steps in all
def test_resume_continues_exactly_where_the_run_stopped(pair, tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    pipeline.train(_cfg(pair, straight), log=lambda s: None)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    pipeline.train(_cfg(pair, resumed, "pipeline.steps=2"), log=lambda s: None)
    pipeline.train(_cfg(pair, resumed, "pipeline.resume=true"), log=lambda s: None)
    a = load_state(straight / "run" / "student_final")[1]
    b = load_state(resumed / "run" / "student_final")[1]
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    la = [x["loss"] for x in _lines(straight) if "loss" in x]
    lb = [x["loss"] for x in _lines(resumed) if "loss" in x]
    assert la == lb


def _slow_evaluations(monkeypatch, seconds):
    """Every evaluation takes `seconds` longer (a sleep inside it): what the training clock must not count."""
    import time

    real = pipeline.make_evaluator

    def make(run):
        evaluate = real(run)

        def slow(params, version):
            time.sleep(seconds)
            return evaluate(params, version)
        return slow
    monkeypatch.setattr(pipeline, "make_evaluator", make)


@pytest.mark.slow  # a 2-step run and its resume to 4 steps, evaluations slowed down
def test_the_training_clock_excludes_evaluation_and_continues_across_a_resume(pair, tmp_path, monkeypatch):
    """time/elapsed_train grows every step, leaves out evaluation (time/elapsed_eval holds it) and carries on from
    the checkpoint; summary.json carries the clocks, the evaluation curve and time-/steps-to-quality."""
    import time

    _slow_evaluations(monkeypatch, 0.5)
    t0 = time.perf_counter()
    first = pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2"), log=lambda s: None)
    wall_first = time.perf_counter() - t0
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == first
    assert first["time"]["elapsed_eval"] >= 2 * 0.5  # the initial evaluation and step 2's
    assert first["time"]["elapsed_train"] + first["time"]["elapsed_eval"] <= wall_first
    assert [r[0] for r in first["eval_curve"]] == [0, 2] and first["eval_curve"][0][3] < 0.05
    rkl = first["to_quality"]["eval/reverse_kl"]
    assert rkl["reference_from"] == "own final" and set(rkl["thresholds"]) == {"0.5", "0.8", "0.9", "0.95"}
    t1 = time.perf_counter()
    summary = pipeline.train(_cfg(pair, tmp_path, "pipeline.resume=true"), log=lambda s: None)
    wall_second = time.perf_counter() - t1
    steps = [x for x in _lines(tmp_path) if "loss" in x]
    clock = [x["time/elapsed_train"] for x in steps]
    assert [x["step"] for x in steps] == [1, 2, 3, 4] and clock == sorted(clock)
    assert clock[2] > first["time"]["elapsed_train"]  # continued from the checkpoint, not from 0
    assert summary["time"]["elapsed_eval"] >= 3 * 0.5  # steps 0 and 2 (first session), 4 (second)
    assert clock[-1] <= summary["time"]["elapsed_train"] < wall_first + wall_second - summary["time"]["elapsed_eval"]
    assert [r[0] for r in summary["eval_curve"]] == [0, 2, 4] and summary["eval_curve"][:2] == first["eval_curve"]
    assert summary["eval_curve"][2][3] == pytest.approx(steps[-1]["time/elapsed_train"], abs=0.05)
    assert "clocks: training" in pipeline.format_summary(summary)


@pytest.mark.slow  # a 3-step async run
def test_async_drops_stale_rollouts_and_counts_them(pair, tmp_path):
    cfg = _cfg(pair, tmp_path, "pipeline.mode=async", "pipeline.max_staleness=0", "pipeline.queue_size=2",
               "pipeline.steps=3")
    summary = pipeline.train(cfg, log=lambda s: None)
    steps = [x for x in _lines(tmp_path) if "loss" in x]
    assert len(steps) == 3 and all(x["staleness"] == 0 for x in steps)
    assert summary["dropped_rollouts"] == steps[-1]["dropped"] >= 1


@pytest.mark.slow  # a 6-step async run and its resume
def test_a_failing_async_rollout_worker_stops_the_run_with_its_error_and_the_run_resumes(pair, tmp_path, monkeypatch):
    """Issue 29 audit: async beyond the drop cut-off — a rollout worker that fails surfaces its error on the learner
    thread (not a hang), and the async run resumes from its checkpoint, logging each step once."""
    real, calls = rollouts.generate, []

    def flaky(engine, tokenizer, examples, sampling, *, seed, samples_per_prompt=1):
        calls.append(seed)
        if len(calls) == 5:
            raise OSError("rollout engine lost its device")
        return real(engine, tokenizer, examples, sampling, seed=seed, samples_per_prompt=samples_per_prompt)
    monkeypatch.setattr(rollouts, "generate", flaky)
    cfg = _cfg(pair, tmp_path, "pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.queue_size=1",
               "pipeline.steps=6", "pipeline.checkpoint_every=1", "pipeline.eval_every=0")
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        pipeline.train(cfg, log=lambda s: None)
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.setattr(rollouts, "generate", real)
    done = [x["step"] for x in _lines(tmp_path) if "loss" in x]
    assert 1 <= len(done) < 6
    summary = pipeline.train(_cfg(pair, tmp_path, "pipeline.mode=async", "pipeline.max_staleness=1",
                                  "pipeline.queue_size=1", "pipeline.steps=6", "pipeline.checkpoint_every=1",
                                  "pipeline.eval_every=0", "pipeline.resume=true"), log=lambda s: None)
    steps = [x for x in _lines(tmp_path) if "loss" in x]
    assert summary["steps"] == 6 and [x["step"] for x in steps] == list(range(1, 7))
    assert all(x["staleness"] <= 1 for x in steps)


@pytest.mark.parametrize("loss", ["forward_kl_topk", "jsd", "reinforce"])
def test_losses_get_the_teacher_data_they_declare(pair, tmp_path, loss):
    extra = ["rollout.samples_per_prompt=2"] if loss == "reinforce" else []
    pipeline.train(_cfg(pair, tmp_path, f"loss.name={loss}", "pipeline.steps=1", *extra), log=lambda s: None)
    (step,) = [x for x in _lines(tmp_path) if "loss" in x]
    assert np.isfinite(step["loss"])
    # Each loss saw the teacher data it declares: top-k masses, full-vocab KL, or task rewards.
    want = {"forward_kl_topk": "teacher_topk_mass", "jsd": "teacher_kl", "reinforce": "reward_mean"}[loss]
    assert want in step


def test_student_and_teacher_vocabularies_must_agree(pair, tmp_path):
    other = make_tiny(tmp_path / "other", "qwen3", "tiny", corpus=["completely different text " * 50],
                      tokenizer_vocab=400)
    with pytest.raises(VocabMismatchError, match="tokenizers differ first at id"):
        pipeline.train(_cfg(pair, tmp_path, f"teacher={other}"), log=lambda s: None)


def test_a_pair_with_padded_vocabularies_trains_end_to_end(padded_pair, tmp_path):
    """Student vocab_size 384, teacher 512, one tokenizer of 259 tokens: the run trains (top-k forward KL, whose
    teacher support must be tokens the student can score), and the teacher's top-k never holds a padded id."""
    from opdjax.pipeline import build as build_mod

    cfg = _cfg(padded_pair, tmp_path, "loss.name=forward_kl_topk", "pipeline.steps=2", "pipeline.eval_every=0")
    summary = pipeline.train(cfg, log=lambda s: None)
    assert summary["steps"] == 2
    assert all(np.isfinite(x["loss"]) for x in _lines(tmp_path) if "loss" in x)
    with build_mod.build(cfg) as run:
        assert run.student_cfg.usable_size == run.parts.teacher.cfg.usable_size == 259
        batch = run.parts.engine.generate([[5, 6, 7]] * 4, run.parts.sampling, seed=0)
        top = run.parts.teacher.score(batch.tokens_BT, batch.valid_BT, frozenset({"teacher_topk"}), top_k=64)
        assert top.teacher_topk_ids_BTK.max() < 259


def test_real_checkpoints_with_jsonl_prompts(pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(40)))
    cfg = _cfg(pair, tmp_path, f"prompts={prompts}", "pipeline.steps=2")
    assert cfg.task.name == "jsonl"
    summary = pipeline.train(cfg, log=lambda s: None)
    assert summary["steps"] == 2 and 0.0 <= summary["final"]["eval/accuracy"] <= 1.0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_publishing_over_a_wire_transport_trains_exactly_as_in_process(pair, tmp_path, transport):
    """sync.transport only changes how the bytes travel: same f32 weights served, same run, same figures."""
    a = pipeline.train(_cfg(pair, tmp_path / "a", "pipeline.steps=2"), log=lambda s: None)
    b = pipeline.train(_cfg(pair, tmp_path / "b", "pipeline.steps=2", f"sync.transport={transport}"),
                       log=lambda s: None)
    assert a["final"] == b["final"]
    la = [x for x in _lines(tmp_path / "a") if "loss" in x]
    lb = [x for x in _lines(tmp_path / "b") if "loss" in x]
    assert [x["loss"] for x in la] == [x["loss"] for x in lb]


@pytest.mark.slow  # a run and two resumes
def test_a_resume_that_changes_what_is_trained_is_refused_naming_the_keys(pair, tmp_path):
    """Issue 29 row 2: resuming with another lr / loss / temperature trained a mixed run silently. It is refused,
    nothing is touched; `pipeline.allow_config_change=true` continues and records the change; steps may grow."""
    from opdjax.pipeline.rundir import RunDirError

    pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=2", "pipeline.eval_every=0"), log=lambda s: None)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    changed = ("optim.lr=0.05", "loss.name=reverse_kl_sampled", "rollout.temperature=0.5")
    with pytest.raises(RunDirError, match=r"loss.name: 'forward_kl_topk' -> 'reverse_kl_sampled'.*optim.lr: "
                                          r"0.0003 -> 0.05.*rollout.temperature: 1.0 -> 0.5.*allow_config_change"):
        pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=3", "pipeline.eval_every=0", "pipeline.resume=true",
                            *changed), log=lambda s: None)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert not (tmp_path / "run" / "config_changes.jsonl").exists()
    out = pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=3", "pipeline.eval_every=0", "pipeline.resume=true",
                              "optim.lr=0.05", "pipeline.allow_config_change=true"), log=lambda s: None)
    assert out["steps"] == 3
    rec = json.loads((tmp_path / "run" / "config_changes.jsonl").read_text())
    assert rec["changes"] == [["optim.lr", 0.0003, 0.05]]
    assert oct((tmp_path / "run" / "config.json").stat().st_mode & 0o777) != oct(0o600)  # atomic writes keep modes


def test_a_run_whose_gradient_stays_zero_says_so():
    """Issue 29 row 3: a run whose gradient was exactly 0 for every step (temperature 1e-30: loss -0.0) ended with
    rc 0 and no word. The loop's watch warns once after 5 zero steps in a row and counts them for the summary."""
    said = []
    watch = pipeline.ZeroGradWatch(said.append, after=5)
    for step, g in enumerate([0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], start=1):
        watch.update(step, g)
    assert watch.total == 9 and len(said) == 1 and "exactly zero for 5 steps (through step 8)" in said[0]


def test_bad_out_dirs_are_one_line_errors(pair, tmp_path):
    from opdjax.config import ConfigError
    from opdjax.pipeline.rundir import RunDirError

    with pytest.raises(ConfigError, match="pipeline.out_dir is empty"):
        load(TrainConfig, None, ["pipeline.out_dir="])
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(RunDirError, match="is a file; expected a directory"):
        pipeline.train(load(TrainConfig, None, [f"student={pair[0]}", f"teacher={pair[1]}", f"pipeline.out_dir={f}"]),
                       log=lambda s: None)


@pytest.mark.slow  # a real `opdjax train` process, 10 steps
def test_kill_9_mid_run_then_resume_logs_every_step_once(pair, tmp_path):
    """Issue 16 row 4, with a real process: killed after the step-4 checkpoint and a few more steps, the resumed run's
    metrics.jsonl holds each step once and the initial evaluation under step 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "rollout.max_new_tokens=4", "pipeline.eval_every=0", "pipeline.eval_prompts=16", "pipeline.steps=10",
            "pipeline.checkpoint_every=4", "pipeline.progress=false", "pipeline.tensorboard=false",
            f"pipeline.out_dir={tmp_path / 'run'}"]
    p = subprocess.Popen([sys.executable, "-m", "opdjax.cli", "train", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        steps = [x.get("step") for x in _lines(tmp_path)] if (tmp_path / "run" / "metrics.jsonl").exists() else []
        if steps and max(steps) >= 6:
            break
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # the kill landed mid-run: past the step-4 checkpoint, before the end (no summary, steps left to run)
    assert p.returncode == -signal.SIGKILL and not (tmp_path / "run" / "summary.json").exists()
    killed_at = max(x.get("step", 0) for x in _lines(tmp_path))
    assert 4 <= killed_at < 10, killed_at
    summary = pipeline.train(_cfg(pair, tmp_path, "pipeline.steps=10", "pipeline.checkpoint_every=4",
                                  "pipeline.eval_every=0", "pipeline.resume=true"), log=lambda s: None)
    lines = _lines(tmp_path)
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 11))
    assert [x["step"] for x in lines if "loss" not in x] == [0]  # the initial evaluation, once, as step 0
    assert summary["steps"] == 10


def test_summary_ratio_reads_well_for_converged_and_negative_estimates():
    from opdjax.pipeline.loop import format_summary

    s = {"steps": 3, "mode": "sync", "seconds": 1.0, "dropped_rollouts": 0, "student_final": "x",
         "initial": {"eval/reverse_kl": 80.0, "eval/accuracy": 0.0}}
    text = lambda rkl: format_summary({**s, "final": {"eval/reverse_kl": rkl, "eval/accuracy": 0.99},  # noqa: E731
                                       "reverse_kl_ratio": rkl / 80.0})
    assert "(x0.50)" in text(40.0) and "(x1.2e-03)" in text(0.096)
    assert "x-0.00" not in text(-0.01) and "below 0" in text(-0.01)
