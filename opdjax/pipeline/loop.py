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
from opdjax.pipeline.build import Run, build
from opdjax.pipeline.evaluate import Evaluator
from opdjax.pipeline.logger import MetricsLogger
from opdjax.pipeline.steps import generate, learner_batch, publish
from opdjax.rollout import RolloutBatch
from opdjax.rollout.base import pad_left

__all__ = ["format_summary", "train"]


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
    batch = generate(run, examples[a:b], seed + 1_000_003 * jax.process_index())
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
    is refused before anything is built; resuming a finished run returns its summary and changes nothing."""
    out = pathlib.Path(cfg.pipeline.out_dir)
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


def _train(run: Run, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = run.cfg
    pc = cfg.pipeline
    run.out_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        rundir.write_json(run.out_dir / "config.json", to_dict(cfg))
    ckpt_dir = run.out_dir / "checkpoints"
    state = run.learner.init(run.params)
    stream = PromptStream(run.task, seed=cfg.seed)
    log(f"prompts: {stream.size} distinct training prompts per epoch ({cfg.task.name}), "
        f"{cfg.pipeline.eval_prompts} held-out prompts per evaluation")
    start, dropped, initial_eval = 0, 0, None
    if not pc.resume and jax.process_index() == 0:  # pipeline.overwrite=true: the old run goes as a whole
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        shutil.rmtree(run.out_dir / "student_final", ignore_errors=True)
        (run.out_dir / "summary.json").unlink(missing_ok=True)
    barrier("opdjax-fresh-run-dir")
    saved = None  # the step of the newest checkpoint (tracked here, not re-read: processes must agree on it)
    if pc.resume and agree(latest_step(ckpt_dir) is not None):
        state, extra = restore_checkpoint(ckpt_dir, state)
        start, dropped = int(extra["step"]), int(extra["dropped"])
        saved = start
        stream.position = int(extra["stream_position"])
        initial_eval = extra.get("initial_eval")
        publish(run, state.params, start)
        if jax.process_index() == 0:  # steps after the checkpoint were lost with the run: log each step once
            rundir.truncate_metrics(run.out_dir / "metrics.jsonl", start)
        log(f"resumed from {ckpt_dir} at step {start} (stream position {stream.position})")
    logger = MetricsLogger(run.out_dir, pc.tensorboard, resume=pc.resume and start > 0)
    evaluate = Evaluator(run)
    if initial_eval is None:
        initial_eval = evaluate(state.params, start)
        logger.log(start, initial_eval)
        log(f"step {start}: held-out reverse KL {initial_eval['eval/reverse_kl']:.3f}, "
            f"accuracy {initial_eval['eval/accuracy']:.3f}")
    else:
        log(f"initial (step 0): held-out reverse KL {initial_eval['eval/reverse_kl']:.3f}, "
            f"accuracy {initial_eval['eval/accuracy']:.3f}")

    def checkpoint(step):
        nonlocal saved
        saved = step
        save_checkpoint(ckpt_dir, state, {"step": step, "stream_position": consumed_position, "dropped": dropped,
                                          "initial_eval": initial_eval})

    bar = None
    if pc.progress and jax.process_index() == 0:
        bar = tqdm(total=pc.steps, initial=start, desc="opd", dynamic_ncols=True)
    q: queue.Queue = queue.Queue(maxsize=pc.queue_size)
    worker = None
    if pc.mode == "async":
        worker = _Worker(run, stream, q, first_seed=cfg.seed * 100_003 + start * 7919)
        worker.start()
    consumed_position = stream.position
    # Resumed at the last step (killed while writing the final results): evaluate the final weights again.
    last_eval = evaluate(state.params, start) if start >= pc.steps > 0 else initial_eval
    t_start = time.time()
    step, zero_grad = start, ZeroGradWatch(log)
    try:
        while step < pc.steps:
            t0 = time.time()
            if worker is None:
                item = _sample(run, stream, cfg.seed * 100_003 + step * 7919)
            else:
                item = _get(q, worker)
            staleness = agree(step - int(item.batch.version_B.min()))  # one decision on every process
            if worker is not None and staleness > pc.max_staleness:
                dropped += 1
                consumed_position = item.stream_end
                continue
            t1 = time.time()
            batch = pad_left(item.batch, agree(item.batch.tokens_BT.shape[1]), run.tokenizer.pad_token_id)
            lb = learner_batch(run, batch, item.examples)
            t2 = time.time()
            state, m = run.learner.train_step(state, lb)
            jax.block_until_ready(state.params)
            t3 = time.time()
            step += 1
            consumed_position = item.stream_end
            publish(run, state.params, step)
            t4 = time.time()
            m.update({"staleness": staleness, "dropped": dropped, "time/generate": item.gen_seconds,
                      "time/wait": t1 - t0, "time/score": t2 - t1, "time/train": t3 - t2, "time/publish": t4 - t3,
                      "completion_len": float(item.batch.completion_mask_BT.sum(1).mean())})
            if pc.eval_every and step % pc.eval_every == 0 or step == pc.steps:
                last_eval = evaluate(state.params, step)
                m.update(last_eval)
            logger.log(step, m)
            zero_grad.update(step, float(m.get("grad_norm", 1.0)))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", teacher_kl=f"{m.get('teacher_kl', float('nan')):.3f}",
                                k3=f"{m['mismatch/k3']:.2e}", acc=f"{last_eval['eval/accuracy']:.2f}")
            if pc.checkpoint_every and step % pc.checkpoint_every == 0 and step < pc.steps:
                checkpoint(step)
    finally:
        if worker is not None:
            worker.stop.set()
            worker.join(timeout=30)
        if bar is not None:
            bar.close()
        logger.close()
    if saved != step:
        checkpoint(step)
    final_dir = run.out_dir / "student_final"
    final_params = gathered(state.params)  # every process takes part in the gather
    if jax.process_index() == 0:  # written next to it, then renamed: a kill leaves the old export or the new one
        tmp = run.out_dir / ".student_final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_model(tmp, run.student_cfg, final_params)
        run.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final_dir, ignore_errors=True)
        tmp.rename(final_dir)
    summary = {
        "steps": step, "mode": pc.mode, "dropped_rollouts": dropped, "seconds": time.time() - t_start,
        "initial": initial_eval, "final": last_eval, "student_final": str(final_dir),
        "reverse_kl_ratio": last_eval["eval/reverse_kl"] / max(initial_eval["eval/reverse_kl"], 1e-9),
        "zero_grad_steps": zero_grad.total,
    }
    outages = [*getattr(run.engine, "outages", ()), *getattr(run.teacher, "outages", ())]
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


def format_summary(s: dict[str, Any]) -> str:
    i, f = s["initial"], s["final"]
    return "\n".join([
        f"OPD summary ({s['steps']} steps, {s['mode']}, {s['seconds']:.0f}s, dropped rollouts: {s['dropped_rollouts']})",
        f"  held-out reverse KL(student||teacher): {i['eval/reverse_kl']:.3f} -> {f['eval/reverse_kl']:.3f} "
        f"(x{s['reverse_kl_ratio']:.2f})",
        f"  held-out accuracy:                     {i['eval/accuracy']:.3f} -> {f['eval/accuracy']:.3f}",
        f"  final student: {s['student_final']}",
    ])
