"""The OPD loop: rollout -> score -> train -> publish, synchronous or asynchronous, with checkpoints and resume.

Rollouts come from one source (`rollouts`): sampled on demand with the weights the learner just published (sync), or
sampled ahead by a background worker with whatever weights the engine serves (async; every rollout carries its
weight version and the learner drops, and counts, rollouts more than `max_staleness` versions old). `_Loop` holds
a run's state while it steps.

Metrics go to `<out_dir>/metrics.jsonl` (and TensorBoard when tensorboardX is installed, Weights & Biases with
`pipeline.wandb`); a progress bar shows step, loss, teacher KL and mismatch. Only process 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import shutil
import time
from typing import Any, Callable

import jax
from tqdm import tqdm

from opdjax.config import TrainConfig, to_dict
from opdjax.core.errors import NonFiniteError
from opdjax.data.prompts import PromptStream
from opdjax.learner import latest_step, restore_newest_good, save_checkpoint
from opdjax.learner.distributed import agree, barrier, gathered
from opdjax.models import hf
from opdjax.pipeline import rundir
from opdjax.pipeline.build import Run, build, identity, make_evaluator
from opdjax.pipeline.evaluate import Evaluator
from opdjax.pipeline.inputs import check_inputs
from opdjax.pipeline.logger import MetricsLogger
from opdjax.pipeline.opd import publish, train_on
from opdjax.pipeline.phases import Phases, RunClock
from opdjax.pipeline.quality import quality_figures
from opdjax.pipeline.rollouts import AheadSource, Rollout, RolloutSource
from opdjax.rollout.base import pad_left

__all__ = ["format_summary", "train"]

KL_METRICS = ("teacher_kl", "forward_kl", "jsd")  # the progress bar shows the first one the loss reports


class ZeroGradWatch:
    """Says so when training is a no-op: `after` consecutive steps with an exactly zero gradient (a degenerate
    sampling setting, a loss masked to nothing) log a warning once; `total` counts every such step."""

    def __init__(self, log: Callable[[str], None], after: int = 5):
        self.log, self.after, self.run, self.total = log, int(after), 0, 0

    def update(self, step: int, grad_norm: float) -> None:
        if grad_norm != 0.0:
            self.run = 0
            return
        self.run += 1
        self.total += 1
        if self.run == self.after:
            self.log(f"WARNING: the gradient has been exactly zero for {self.after} steps (through step {step}): "
                     "training changes nothing; check the sampling settings, the loss and its mask")


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run OPD as configured; returns the summary (also written to <out_dir>/summary.json).

    The run directory is claimed first (`rundir`): a busy one, or a previous run that a fresh run would destroy,
    is refused before anything is built; resuming a finished run returns its summary and changes nothing. Bad input
    (a model directory that does not exist, a mesh this machine cannot hold) is named before the run directory."""
    out = pathlib.Path(cfg.pipeline.out_dir)
    checked = check_inputs(cfg)
    held = _claim(out, cfg)
    try:
        done = _finished(out, cfg) if cfg.pipeline.resume else None
        if done is not None:
            log(f"{out} holds a finished run of {done['steps']} steps: nothing to resume, its results are kept")
            return done
        run_id = identity(cfg, rundir.run_id(out, fresh=not cfg.pipeline.resume) if jax.process_index() == 0
                          else None)
        with build(cfg, log, checked=checked, run_id=run_id, publish_start=False) as run:
            return _train(run, log)
    finally:
        if held is not None:
            held.release()


def _claim(out: pathlib.Path, cfg: TrainConfig):
    """Process 0 locks out_dir and checks it may write there; every process gets the same verdict."""
    held, problem = None, None
    if jax.process_index() == 0:
        try:
            if out.exists() and not out.is_dir():
                raise rundir.RunDirError(f"pipeline.out_dir={str(out)!r} is a file; expected a directory")
            out.mkdir(parents=True, exist_ok=True)
            held = rundir.lock(out)
            prev = rundir.previous_run(out)
            if prev and not cfg.pipeline.resume and not cfg.pipeline.overwrite:
                raise rundir.RunDirError(
                    f"pipeline.out_dir={str(out)!r} holds a previous run ({', '.join(prev)}); continue it with "
                    f"pipeline.resume=true, replace it with pipeline.overwrite=true, or choose another out_dir")
            if prev and cfg.pipeline.resume:
                rundir.check_resume_config(out, to_dict(cfg), allow=cfg.pipeline.allow_config_change)
                rundir.check_metrics(out / "metrics.jsonl")
        except rundir.RunDirError as e:
            problem = e
            if held is not None:
                held.release()
                held = None
    if agree(problem is not None):
        raise problem or rundir.RunDirError("learner process 0 refused the run directory (see its message)")
    return held


def _finished(out: pathlib.Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a run in `out` that already reached `pipeline.steps` (None if there is none)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    last = latest_step(out / "checkpoints")
    if int(summary.get("steps", -1)) >= cfg.pipeline.steps and last is not None and last >= cfg.pipeline.steps:
        return summary
    return None


@dataclasses.dataclass
class _Progress:
    """Where a run stands: what a checkpoint records and what the summary reports."""

    step: int = 0
    dropped: int = 0            # async rollouts dropped as too stale
    position: int = 0           # prompt-stream position after the last rollout consumed (trained on or dropped)
    saved: int | None = None    # the newest checkpoint's step (tracked here: processes must agree on it)
    initial_eval: dict | None = None
    last_eval: dict | None = None
    clock: dict = dataclasses.field(default_factory=lambda: {"train": 0.0, "eval": 0.0})  # `RunClock.state` at start
    evals: list = dataclasses.field(default_factory=list)  # `quality.EVAL_ROW` rows, the initial evaluation first


def _train(run: Run, log: Callable[[str], None]) -> dict[str, Any]:
    """Fresh or resumed run directory -> initial evaluation -> the step loop -> final checkpoint, export, summary."""
    state = run.parts.learner.init(run.params)
    stream = PromptStream(run.parts.task, seed=run.cfg.seed)
    log(f"prompts: {stream.size} distinct training prompts per epoch ({run.cfg.task.name}), "
        f"{run.cfg.pipeline.eval_prompts} held-out prompts per evaluation")
    _prepare_dir(run)
    state, prog = _resume(run, state, stream, log)
    return _Loop(run, log, state, prog, stream, make_evaluator(run), ZeroGradWatch(log)).train()


def _prepare_dir(run: Run) -> None:
    """config.json written; a fresh run (pipeline.overwrite=true) removes the old run's results as a whole."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        rundir.write_json(run.out_dir / "config.json", to_dict(run.cfg))
        if not run.cfg.pipeline.resume:
            shutil.rmtree(run.out_dir / "checkpoints", ignore_errors=True)
            shutil.rmtree(run.out_dir / "student_final", ignore_errors=True)
            (run.out_dir / "summary.json").unlink(missing_ok=True)
            shutil.rmtree(run.out_dir / "wandb", ignore_errors=True)  # the old run's W&B files (default dir)
    barrier("opdjax-fresh-run-dir")


def _resume(run: Run, state, stream: PromptStream, log) -> tuple[Any, _Progress]:
    """The state and progress of the newest checkpoint that passes its check (pipeline.resume=true; damaged newer
    ones are set aside, saying so), its weights republished; metrics after it truncated (those steps are run again
    and logged once). A fresh start otherwise (its starting weights published to engine servers, which may hold
    another run's)."""
    ckpt_dir = run.out_dir / "checkpoints"
    prog = _Progress(position=stream.position)
    if not (run.cfg.pipeline.resume and agree(latest_step(ckpt_dir) is not None)):
        if getattr(run.parts.engine, "shared", False):  # servers may hold another run's weights: send the start
            publish(run.parts, state.params, 0)
        return state, prog
    state, extra = restore_newest_good(ckpt_dir, state, log)
    prog = _Progress(step=int(extra["step"]), dropped=int(extra["dropped"]), position=int(extra["stream_position"]),
                     saved=int(extra["step"]), initial_eval=extra.get("initial_eval"),
                     clock=dict(extra.get("clock") or {"train": 0.0, "eval": 0.0}),
                     evals=list(extra.get("eval_curve") or _initial_row(extra.get("initial_eval"))))
    stream.position = prog.position
    publish(run.parts, state.params, prog.step)  # a new session: servers take it even if they held later versions
    if jax.process_index() == 0:
        rundir.truncate_metrics(run.out_dir / "metrics.jsonl", prog.step, log)
    log(f"resumed from {ckpt_dir} at step {prog.step} (stream position {stream.position})")
    return state, prog


def _initial_row(initial_eval: dict | None) -> list[list[float]]:
    """The curve of a checkpoint that kept no curve: its initial evaluation at step 0, training second 0."""
    if initial_eval is None:
        return []
    return [[0, initial_eval["eval/reverse_kl"], initial_eval["eval/accuracy"], 0.0]]


def _check_finite(m: dict[str, Any], step: int, saved: int | None) -> None:
    """NonFiniteError when the step's loss or gradient norm is NaN or infinite (naming them and the checkpoint the
    run can resume from)."""
    bad = {k: m[k] for k in ("loss", "grad_norm") if k in m and not math.isfinite(float(m[k]))}
    if bad:
        shown = ", ".join(f"{k} {v}" for k, v in bad.items())
        last = f"the newest checkpoint is step {saved}" if saved is not None else "no checkpoint was saved"
        raise NonFiniteError(f"step {step}: {shown}: the run is stopped before these weights are published or saved "
                             f"({last}); lower optim.lr or check the loss's inputs, then resume")


def _open_source(run: Run, stream: PromptStream, first_step: int) -> RolloutSource:
    """The run's rollouts: sampled on demand (pipeline.mode=sync) or ahead by a worker (async: pipeline.queue_size
    rollouts ahead, those more than pipeline.max_staleness versions old dropped)."""
    pipeline, each = run.cfg.pipeline, dict(batch_size=run.cfg.rollout.batch_size, run_seed=run.cfg.seed)
    if pipeline.mode == "async":
        return AheadSource(run.parts, stream, first_step=first_step, queue_size=pipeline.queue_size,
                           max_staleness=pipeline.max_staleness, **each)
    return RolloutSource(run.parts, stream, **each)


def _progress_bar(run: Run, initial: int) -> contextlib.AbstractContextManager:
    """The step bar (pipeline.progress, process 0 only; otherwise a context holding None)."""
    pipeline = run.cfg.pipeline
    if pipeline.progress and jax.process_index() == 0:
        return tqdm(total=pipeline.steps, initial=initial, desc="opd", dynamic_ncols=True)
    return contextlib.nullcontext()


@dataclasses.dataclass
class _Loop:
    """One run's step loop: what it trains (`run`, `state`), where it stands (`prog`), where rollouts come from
    (`stream`, and `source` while the steps run) and where results go (`evaluate`, `zero_grad`, and `logger`, `bar`
    while the steps run)."""

    run: Run
    log: Callable[[str], None]
    state: Any                  # the learner's TrainState
    prog: _Progress
    stream: PromptStream
    evaluate: Evaluator
    zero_grad: ZeroGradWatch
    logger: MetricsLogger | None = None
    source: RolloutSource | None = None
    bar: tqdm | None = None
    clock: RunClock | None = None

    def train(self) -> dict[str, Any]:
        """Initial evaluation, the steps, the final checkpoint and export; returns the summary."""
        pipeline = self.run.cfg.pipeline
        resumed = pipeline.resume and self.prog.step > 0
        with MetricsLogger(self.run.out_dir, pipeline.tensorboard, resume=resumed, wandb=pipeline.wandb,
                           config=to_dict(self.run.cfg), say=self.log) as self.logger:
            self.clock = RunClock(**self.prog.clock)
            self.evaluate_start()
            t_start = time.time()
            with _open_source(self.run, self.stream, self.prog.step) as self.source, \
                    _progress_bar(self.run, self.prog.step) as self.bar:
                while self.prog.step < pipeline.steps:
                    self.step()
            clocks = self.clock.state()  # the training that reached the final weights (not its saving)
            if self.prog.saved != self.prog.step:
                self.checkpoint()
            summary = self.summary(self.export(), time.time() - t_start, clocks)
            self.logger.finish(summary)
        return summary

    def evaluate_start(self) -> None:
        """The initial evaluation (kept from the checkpoint when resuming); a run resumed at its last step (killed
        while writing its results) evaluates the final weights again."""
        prog = self.prog
        if prog.initial_eval is None:
            prog.initial_eval = self.evaluate_now()
            self.logger.log(prog.step, {**prog.initial_eval, **self.clock.seconds()})
            what = f"step {prog.step}"
        else:
            what = "initial (step 0)"
        self.log(f"{what}: held-out reverse KL {prog.initial_eval['eval/reverse_kl']:.3f}, "
                 f"accuracy {prog.initial_eval['eval/accuracy']:.3f}")
        steps = self.run.cfg.pipeline.steps
        prog.last_eval = self.evaluate_now() if prog.step >= steps > 0 else prog.initial_eval

    def evaluate_now(self) -> dict[str, float]:
        """The held-out evaluation of the current weights, on the clock's evaluation time; its `EVAL_ROW` row
        [step, reverse KL, accuracy, elapsed training seconds] recorded (replacing rows of this step or later)."""
        prog = self.prog
        with self.clock.evaluating():
            ev = self.evaluate(self.state.params, prog.step)
        row = [prog.step, ev["eval/reverse_kl"], ev["eval/accuracy"], self.clock.state()["train"]]
        prog.evals = [r for r in prog.evals if r[0] < prog.step] + [row]
        return ev

    def step(self) -> None:
        """One step: the next rollout (one too stale is counted and skipped) -> `train_on` -> `publish`; then the
        due evaluation, the metrics, the zero-gradient watch, the bar and the due checkpoint."""
        pipeline, prog, phases = self.run.cfg.pipeline, self.prog, Phases()
        with phases.time("wait"):
            item = self.source.next(prog.step)
        if item.dropped:
            prog.dropped += 1
            prog.position = item.stream_end
            return
        m = self._train_on(item, phases)
        if pipeline.eval_every and prog.step % pipeline.eval_every == 0 or prog.step == pipeline.steps:
            prog.last_eval = self.evaluate_now()
            m.update(prog.last_eval)
        m.update(self.clock.seconds())
        self.logger.log(prog.step, m)
        self.zero_grad.update(prog.step, float(m.get("grad_norm", 1.0)))
        self._show(m)
        if pipeline.checkpoint_every and prog.step % pipeline.checkpoint_every == 0 and prog.step < pipeline.steps:
            self.checkpoint()

    def _train_on(self, item: Rollout, phases: Phases) -> dict[str, Any]:
        """Train on `item` (padded to the longest row of any process), publish the new weights; the step's metrics.
        A loss or gradient norm that is not finite stops the run (NonFiniteError) before those weights are published
        or saved."""
        parts, prog = self.run.parts, self.prog
        batch = pad_left(item.batch, agree(item.batch.tokens_BT.shape[1]), parts.tokenizer.pad_token_id)
        self.state, m = train_on(parts, self.state, batch, item.examples)
        prog.step += 1
        _check_finite(m, prog.step, prog.saved)
        prog.position = item.stream_end
        with phases.time("publish"):
            publish(parts, self.state.params, prog.step)
        m.update({"staleness": item.staleness, "dropped": prog.dropped, **item.seconds, **phases.seconds})
        return m

    def _show(self, m: dict[str, Any]) -> None:
        """The bar: step, loss, the loss's own divergence to the teacher, mismatch k3, held-out accuracy."""
        if self.bar is None:
            return
        self.bar.update(1)
        kl = next((k for k in KL_METRICS if k in m), None)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", **({kl: f"{m[kl]:.3f}"} if kl else {}),
                             k3=f"{m.get('mismatch/k3', float('nan')):.2e}",
                             acc=f"{self.prog.last_eval['eval/accuracy']:.2f}")

    def checkpoint(self) -> None:
        """The state and what resuming needs: step, stream position, dropped rollouts, the initial evaluation, the
        clocks and the evaluation curve so far."""
        prog = self.prog
        prog.saved = prog.step
        save_checkpoint(self.run.out_dir / "checkpoints", self.state, {
            "step": prog.step, "stream_position": prog.position, "dropped": prog.dropped,
            "initial_eval": prog.initial_eval, "clock": self.clock.state(), "eval_curve": prog.evals})

    def export(self) -> pathlib.Path:
        """The final student as a Hugging Face directory (written next to it, then renamed: a kill leaves the old
        export or the new one)."""
        out = self.run.out_dir
        final_dir = out / "student_final"
        final_params = gathered(self.state.params)  # every process takes part in the gather
        if jax.process_index() == 0:
            tmp = out / ".student_final.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            hf.save_model(tmp, self.run.student_cfg, final_params)
            self.run.parts.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final_dir, ignore_errors=True)
            tmp.rename(final_dir)
        return final_dir

    def summary(self, final_dir: pathlib.Path, seconds: float, clocks: dict[str, float]) -> dict[str, Any]:
        """summary.json: steps, initial and final evaluation, their reverse-KL ratio, the clocks at the end of the
        last step (`time`: `RunClock.state`), the evaluation curve and its time- and steps-to-quality against the
        run's own final quality (`to_quality`), server outages."""
        run, prog = self.run, self.prog
        i, f = prog.initial_eval, prog.last_eval
        summary = {
            "steps": prog.step, "mode": run.cfg.pipeline.mode, "dropped_rollouts": prog.dropped, "seconds": seconds,
            "initial": i, "final": f, "student_final": str(final_dir),
            "reverse_kl_ratio": f["eval/reverse_kl"] / max(i["eval/reverse_kl"], 1e-9),
            "zero_grad_steps": self.zero_grad.total,
            "time": {f"elapsed_{k}": v for k, v in clocks.items()},
            "eval_curve": prog.evals, "to_quality": quality_figures(prog.evals),
        }
        outages = [*run.parts.engine.outages, *getattr(run.parts.teacher, "outages", ())]
        if outages:  # remote servers that went down (and came back) during the run
            summary["server_outages"] = outages
        if jax.process_index() == 0:
            rundir.write_json(run.out_dir / "summary.json", summary)
        return summary


def _ratio_text(r: float) -> str:
    """final / initial held-out reverse KL: "x0.12", "x3.4e-04"; a final estimate below 0 (it is sampled, and a
    converged run reads about 0) is said as such, not as "x-0.00"."""
    if r < 0:
        return "final estimate below 0: converged within the estimate's noise"
    return f"x{r:.2f}" if r >= 0.01 else f"x{r:.1e}"


def _clock_text(s: dict[str, Any]) -> list[str]:
    """The clocks line: training and evaluation seconds, and when the run came 90% of the way to its final reverse
    KL (none for a summary without clocks)."""
    t, q = s.get("time"), (s.get("to_quality") or {}).get("eval/reverse_kl")
    if not t:
        return []
    at = (q or {}).get("thresholds", {}).get("0.9", {})
    when = (f", 90% of the way to the final reverse KL at step {at['step']} ({at['seconds']:.0f}s of training)"
            if at.get("step") is not None else "")
    return [f"  clocks: training {t['elapsed_train']:.0f}s, evaluation {t['elapsed_eval']:.0f}s{when}"]


def format_summary(s: dict[str, Any]) -> str:
    i, f = s["initial"], s["final"]
    return "\n".join([
        f"OPD summary ({s['steps']} steps, {s['mode']}, {s['seconds']:.0f}s, dropped rollouts: {s['dropped_rollouts']})",
        f"  held-out reverse KL(student||teacher): {i['eval/reverse_kl']:.3f} -> {f['eval/reverse_kl']:.3f} "
        f"({_ratio_text(s['reverse_kl_ratio'])})",
        f"  held-out accuracy:                     {i['eval/accuracy']:.3f} -> {f['eval/accuracy']:.3f}",
        *_clock_text(s),
        f"  final student: {s['student_final']}",
    ])
