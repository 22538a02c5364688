"""The OPD loop: generate -> score -> train -> publish, synchronous or asynchronous.

Synchronous: each step samples with the weights the learner just published. Asynchronous: a background worker
keeps sampling into a bounded queue with whatever weights the engine serves; every rollout carries its weight
version and the learner drops (and counts) rollouts more than `max_staleness` versions old.

Metrics go to `<out_dir>/metrics.jsonl` (and TensorBoard when tensorboardX is installed); a progress bar shows
step, loss, teacher KL and mismatch. Only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import queue
import shutil
import threading
import time
from typing import Any, Callable

import jax
from tqdm import tqdm

from opdjax.config import TrainConfig, to_dict
from opdjax.data.prompts import PromptStream
from opdjax.learner import latest_step, restore_checkpoint, save_checkpoint
from opdjax.learner.distributed import agree, barrier, gathered, row_share
from opdjax.models import hf
from opdjax.pipeline import rundir
from opdjax.pipeline.build import Run, build, check_inputs, make_evaluator
from opdjax.pipeline.logger import MetricsLogger
from opdjax.pipeline.opd import generate, publish, rollout_seed, train_on
from opdjax.rollout import RolloutBatch
from opdjax.rollout.base import pad_left

__all__ = ["format_summary", "train"]

KL_METRICS = ("teacher_kl", "forward_kl", "jsd")  # the progress bar shows the first one the loss reports


@dataclasses.dataclass
class _Rollout:
    batch: RolloutBatch
    examples: list
    stream_end: int   # stream position after this rollout's prompts (what a checkpoint records)
    gen_seconds: float


class _Worker(threading.Thread):
    """Async mode: samples ahead into a bounded queue with whatever weights the engine serves."""

    def __init__(self, run: Run, stream: PromptStream, q: queue.Queue, first_seed: int):
        super().__init__(daemon=True, name="opdjax-rollout")
        self.ctx, self.stream, self.q, self.seed = run, stream, q, first_seed
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self):  # noqa: D102 (threading API)
        try:
            while not self.stop.is_set():
                item = _sample(self.ctx, self.stream, self.seed)
                self.seed += 1
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced to the learner thread
            self.error = e


def _sample(run: Run, stream: PromptStream, seed: int) -> _Rollout:
    """The next batch of prompts (the same stream on every learner process), this process's share sampled."""
    examples = stream.next(run.cfg.rollout.batch_size)
    a, b = row_share(len(examples))
    t0 = time.time()
    p = run.parts
    batch = generate(p.engine, p.tokenizer, examples[a:b], p.sampling, seed=seed + 1_000_003 * jax.process_index(),
                     samples_per_prompt=p.samples_per_prompt)
    return _Rollout(batch, examples[a:b], stream.position, time.time() - t0)


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
    check_inputs(cfg)
    held = _claim(out, cfg)
    try:
        done = _finished(out, cfg) if cfg.pipeline.resume else None
        if done is not None:
            log(f"{out} holds a finished run of {done['steps']} steps: nothing to resume, its results are kept")
            return done
        with build(cfg, log) as run:
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


def _train(run: Run, log: Callable[[str], None]) -> dict[str, Any]:
    """Fresh or resumed run directory -> initial evaluation -> the step loop -> final checkpoint, export, summary."""
    state = run.learner.init(run.params)
    stream = PromptStream(run.task, seed=run.cfg.seed)
    log(f"prompts: {stream.size} distinct training prompts per epoch ({run.cfg.task.name}), "
        f"{run.cfg.pipeline.eval_prompts} held-out prompts per evaluation")
    _prepare_dir(run)
    state, prog = _resume(run, state, stream, log)
    evaluate = make_evaluator(run)
    zero_grad = ZeroGradWatch(log)
    with MetricsLogger(run.out_dir, run.cfg.pipeline.tensorboard, resume=run.cfg.pipeline.resume and prog.step > 0
                       ) as logger:
        _evaluate_start(run, evaluate, state, prog, logger, log)
        t_start = time.time()
        state = _steps(run, state, stream, prog, evaluate, logger, zero_grad)
    if prog.saved != prog.step:
        _checkpoint(run, state, prog)
    final_dir = _export(run, state)
    return _summary(run, prog, final_dir, time.time() - t_start, zero_grad)


def _prepare_dir(run: Run) -> None:
    """config.json written; a fresh run (pipeline.overwrite=true) removes the old run's results as a whole."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        rundir.write_json(run.out_dir / "config.json", to_dict(run.cfg))
        if not run.cfg.pipeline.resume:
            shutil.rmtree(run.out_dir / "checkpoints", ignore_errors=True)
            shutil.rmtree(run.out_dir / "student_final", ignore_errors=True)
            (run.out_dir / "summary.json").unlink(missing_ok=True)
    barrier("opdjax-fresh-run-dir")


def _resume(run: Run, state, stream: PromptStream, log) -> tuple[Any, _Progress]:
    """The state and progress of the newest checkpoint (pipeline.resume=true), its weights republished; metrics
    after it truncated (those steps are run again and logged once). A fresh start otherwise."""
    ckpt_dir = run.out_dir / "checkpoints"
    prog = _Progress(position=stream.position)
    if not (run.cfg.pipeline.resume and agree(latest_step(ckpt_dir) is not None)):
        return state, prog
    state, extra = restore_checkpoint(ckpt_dir, state)
    prog = _Progress(step=int(extra["step"]), dropped=int(extra["dropped"]), position=int(extra["stream_position"]),
                     saved=int(extra["step"]), initial_eval=extra.get("initial_eval"))
    stream.position = prog.position
    publish(run.parts, state.params, prog.step, rewind=True)  # the engine may hold later versions of the lost run
    if jax.process_index() == 0:
        rundir.truncate_metrics(run.out_dir / "metrics.jsonl", prog.step)
    log(f"resumed from {ckpt_dir} at step {prog.step} (stream position {stream.position})")
    return state, prog


def _evaluate_start(run: Run, evaluate, state, prog: _Progress, logger: MetricsLogger, log) -> None:
    """The initial evaluation (kept from the checkpoint when resuming); a run resumed at its last step (killed while
    writing its results) evaluates the final weights again."""
    if prog.initial_eval is None:
        prog.initial_eval = evaluate(state.params, prog.step)
        logger.log(prog.step, prog.initial_eval)
        what = f"step {prog.step}"
    else:
        what = "initial (step 0)"
    log(f"{what}: held-out reverse KL {prog.initial_eval['eval/reverse_kl']:.3f}, "
        f"accuracy {prog.initial_eval['eval/accuracy']:.3f}")
    steps = run.cfg.pipeline.steps
    prog.last_eval = evaluate(state.params, prog.step) if prog.step >= steps > 0 else prog.initial_eval


def _checkpoint(run: Run, state, prog: _Progress) -> None:
    prog.saved = prog.step
    save_checkpoint(run.out_dir / "checkpoints", state, {
        "step": prog.step, "stream_position": prog.position, "dropped": prog.dropped,
        "initial_eval": prog.initial_eval})


def _next_rollout(run: Run, stream, worker, q, prog: _Progress) -> _Rollout | None:
    """The next rollout to train on: sampled now (sync) or taken from the worker's queue (async; None when it was
    more than `max_staleness` versions old, counted as dropped). Its staleness is in `meta["staleness"]`."""
    if worker is None:
        item = _sample(run, stream, rollout_seed(run.cfg.seed, prog.step))
    else:
        item = _get(q, worker)
    staleness = agree(prog.step - int(item.batch.version_B.min()))  # one decision on every process
    if worker is not None and staleness > run.cfg.pipeline.max_staleness:
        prog.dropped += 1
        prog.position = item.stream_end
        return None
    item.batch.meta["staleness"] = staleness
    return item


def _steps(run: Run, state, stream: PromptStream, prog: _Progress, evaluate, logger: MetricsLogger, zero_grad
           ) -> Any:
    """The step loop: rollout -> `train_on` -> `publish`, evaluations, checkpoints, metrics, the progress bar."""
    pc = run.cfg.pipeline
    bar = tqdm(total=pc.steps, initial=prog.step, desc="opd", dynamic_ncols=True) \
        if pc.progress and jax.process_index() == 0 else None
    q: queue.Queue = queue.Queue(maxsize=pc.queue_size)
    worker = _Worker(run, stream, q, first_seed=rollout_seed(run.cfg.seed, prog.step)) \
        if pc.mode == "async" else None
    if worker is not None:
        worker.start()
    try:
        while prog.step < pc.steps:
            state = _one_step(run, state, stream, worker, q, prog, evaluate, logger, bar, zero_grad)
    finally:
        if worker is not None:
            worker.stop.set()
            worker.join(timeout=30)
        if bar is not None:
            bar.close()
    return state


def _one_step(run: Run, state, stream, worker, q, prog: _Progress, evaluate, logger, bar, zero_grad):
    pc = run.cfg.pipeline
    t0 = time.time()
    item = _next_rollout(run, stream, worker, q, prog)
    if item is None:
        return state
    t1 = time.time()
    batch = pad_left(item.batch, agree(item.batch.tokens_BT.shape[1]), run.tokenizer.pad_token_id)
    state, m = train_on(run.parts, state, batch, item.examples)
    prog.step += 1
    prog.position = item.stream_end
    t2 = time.time()
    publish(run.parts, state.params, prog.step)
    m.update({"staleness": item.batch.meta["staleness"], "dropped": prog.dropped, "time/generate": item.gen_seconds,
              "time/wait": t1 - t0, "time/publish": time.time() - t2})
    if pc.eval_every and prog.step % pc.eval_every == 0 or prog.step == pc.steps:
        prog.last_eval = evaluate(state.params, prog.step)
        m.update(prog.last_eval)
    logger.log(prog.step, m)
    zero_grad.update(prog.step, float(m.get("grad_norm", 1.0)))
    if bar is not None:
        bar.update(1)
        kl = next((k for k in KL_METRICS if k in m), None)  # the loss's own divergence to the teacher
        bar.set_postfix(loss=f"{m['loss']:.3f}", **({kl: f"{m[kl]:.3f}"} if kl else {}),
                        k3=f"{m.get('mismatch/k3', float('nan')):.2e}", acc=f"{prog.last_eval['eval/accuracy']:.2f}")
    if pc.checkpoint_every and prog.step % pc.checkpoint_every == 0 and prog.step < pc.steps:
        _checkpoint(run, state, prog)
    return state


def _export(run: Run, state) -> pathlib.Path:
    """The final student as a Hugging Face directory (written next to it, then renamed: a kill leaves the old export
    or the new one)."""
    final_dir = run.out_dir / "student_final"
    final_params = gathered(state.params)  # every process takes part in the gather
    if jax.process_index() == 0:
        tmp = run.out_dir / ".student_final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_model(tmp, run.student_cfg, final_params)
        run.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final_dir, ignore_errors=True)
        tmp.rename(final_dir)
    return final_dir


def _summary(run: Run, prog: _Progress, final_dir: pathlib.Path, seconds: float, zero_grad) -> dict[str, Any]:
    """summary.json: steps, initial and final evaluation, their reverse-KL ratio, server outages."""
    i, f = prog.initial_eval, prog.last_eval
    summary = {
        "steps": prog.step, "mode": run.cfg.pipeline.mode, "dropped_rollouts": prog.dropped, "seconds": seconds,
        "initial": i, "final": f, "student_final": str(final_dir),
        "reverse_kl_ratio": f["eval/reverse_kl"] / max(i["eval/reverse_kl"], 1e-9),
        "zero_grad_steps": zero_grad.total,
    }
    outages = [*run.engine.outages, *getattr(run.teacher, "outages", ())]
    if outages:  # remote servers that went down (and came back) during the run
        summary["server_outages"] = outages
    if jax.process_index() == 0:
        rundir.write_json(run.out_dir / "summary.json", summary)
    return summary


def _get(q: queue.Queue, worker: _Worker) -> _Rollout:
    while True:
        if worker.error is not None:
            raise RuntimeError("rollout worker failed") from worker.error
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not worker.is_alive() and worker.error is None:
                raise RuntimeError("rollout worker stopped unexpectedly")


def _ratio_text(r: float) -> str:
    """final / initial held-out reverse KL: "x0.12", "x3.4e-04"; a final estimate below 0 (it is sampled, and a
    converged run reads about 0) is said as such, not as "x-0.00"."""
    if r < 0:
        return "final estimate below 0: converged within the estimate's noise"
    return f"x{r:.2f}" if r >= 0.01 else f"x{r:.1e}"


def format_summary(s: dict[str, Any]) -> str:
    i, f = s["initial"], s["final"]
    return "\n".join([
        f"OPD summary ({s['steps']} steps, {s['mode']}, {s['seconds']:.0f}s, dropped rollouts: {s['dropped_rollouts']})",
        f"  held-out reverse KL(student||teacher): {i['eval/reverse_kl']:.3f} -> {f['eval/reverse_kl']:.3f} "
        f"({_ratio_text(s['reverse_kl_ratio'])})",
        f"  held-out accuracy:                     {i['eval/accuracy']:.3f} -> {f['eval/accuracy']:.3f}",
        f"  final student: {s['student_final']}",
    ])
