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
import numpy as np

from opdjax.core import mismatch
from opdjax.data import tasks
from opdjax.config import ConfigError, TrainConfig, to_dict
from opdjax.data.prompts import PromptStream, encode_prompts
from opdjax.learner.learner import Learner, latest_step, restore_checkpoint, save_checkpoint
from opdjax.models import ModelConfig, hf
from opdjax.models.tiny import load_tokenizer
from opdjax.rollout import RolloutBatch, SamplingParams
from opdjax.models.sharding import make_mesh
from opdjax.teacher.jax_teacher import JaxTeacher, check_same_vocab


# ----------------------------------------------------------------------------------------------------- building


@dataclasses.dataclass
class Run:
    """Everything one training run holds."""

    cfg: TrainConfig
    tokenizer: Any
    task: Any
    student_cfg: ModelConfig
    graphdef: Any
    params: Any
    teacher: Any
    engine: Any
    learner: Learner
    mesh: Any
    out_dir: pathlib.Path


def resolve_models(cfg: TrainConfig, log=print) -> tuple[str, str]:
    """Student and teacher directories; "builtin" ones are prepared on the task (once, then cached)."""
    student, teacher = cfg.student.path, cfg.teacher.path
    if "builtin" in (student, teacher):
        if cfg.task.name == "jsonl":
            raise ValueError("student/teacher 'builtin' are trained on a built-in task; with prompts=FILE.jsonl "
                             "pass student=DIR and teacher=DIR")
        from opdjax.data.prepare import prepare_builtin

        meta = prepare_builtin(cfg.task, cfg.prepare, log=log)
        student = meta["student"] if student == "builtin" else student
        teacher = meta["teacher"] if teacher == "builtin" else teacher
    for role, path in (("student", student), ("teacher", teacher)):
        if not pathlib.Path(path).is_dir():
            raise ConfigError(f"{role}={path!r}: no such directory (expected a Hugging Face model directory with "
                              f"config.json and *.safetensors, or 'builtin'); nothing is downloaded")
    return student, teacher


def make_engine(cfg: TrainConfig, student_path: str, student_cfg: ModelConfig, params, tokenizer):
    """The rollout engine named by `rollout.engine`, serving the student's initial weights as version 0."""
    r = cfg.rollout
    if r.engine == "vllm":
        from opdjax.rollout.vllm_engine import VllmEngine

        return VllmEngine(student_path, dtype=r.dtype, seed=r.seed,
                          recipe=None if r.recipe == "none" else r.recipe, **r.vllm)
    from opdjax.rollout.jax_engine import JaxEngine

    return JaxEngine(student_cfg, params, recipe=r.recipe, weight_noise=r.weight_noise, noise_seed=r.seed,
                     noise_mode=r.noise_mode,
                     stale_versions=r.stale_versions, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                     dtype=np.dtype(r.dtype) if r.dtype == "float32" else "bfloat16")


def make_teacher(cfg: TrainConfig, teacher_path: str, mesh):
    if cfg.teacher.engine == "vllm":
        from opdjax.rollout.vllm_engine import VllmTeacher

        return VllmTeacher(teacher_path, dtype=cfg.teacher.dtype)
    return JaxTeacher.from_pretrained(teacher_path, dtype=cfg.teacher.dtype, mesh=mesh,
                                      temperature=cfg.teacher.temperature)


def build(cfg: TrainConfig, log=print, *, with_teacher: bool = True) -> Run:
    """Everything a run needs; `with_teacher=False` skips loading the teacher (probes only rescore the student)."""
    student_path, teacher_path = resolve_models(cfg, log)
    tokenizer = load_tokenizer(student_path)
    try:
        teacher_tok = load_tokenizer(teacher_path)
    except (OSError, ValueError):
        teacher_tok = None
    student_cfg = ModelConfig.from_dir(student_path)
    check_same_vocab(student_cfg, ModelConfig.from_dir(teacher_path), tokenizer, teacher_tok)
    mesh = make_mesh(cfg.mesh.shape)
    st = cfg.student
    graphdef, params = hf.load_state(student_path, student_cfg, param_dtype=st.dtype, dtype=st.compute_dtype,
                                     attention=st.attention, remat=st.remat)
    task = tasks.get_task(cfg.task.name, **cfg.task.options)
    loss_options = cfg.loss.resolved_options()
    if cfg.loss.name == "reinforce" and cfg.rollout.samples_per_prompt > 1:
        loss_options.setdefault("group_size", cfg.rollout.samples_per_prompt)
    correction = (None if cfg.loss.correction == "none"
                  else mismatch.Correction(name=cfg.loss.correction, **cfg.loss.correction_options))
    learner = Learner(graphdef, loss=cfg.loss.name, loss_options=loss_options, correction=correction,
                      optim=cfg.optim, total_steps=cfg.pipeline.steps, temperature=max(cfg.rollout.temperature, 1e-6),
                      mesh=mesh, logprob_chunk=st.logprob_chunk)
    return Run(cfg=cfg, tokenizer=tokenizer, task=task, student_cfg=student_cfg, graphdef=graphdef, params=params,
               teacher=make_teacher(cfg, teacher_path, mesh) if with_teacher else None,
               engine=make_engine(cfg, student_path, student_cfg, params, tokenizer),
               learner=learner, mesh=mesh, out_dir=pathlib.Path(cfg.pipeline.out_dir))


# ----------------------------------------------------------------------------------------------------- pieces


def sampling_params(cfg: TrainConfig, tokenizer, *, temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature if temperature is None
                          else temperature, top_k=r.top_k, top_p=r.top_p, stop_token_ids=(tokenizer.eos_token_id,))


def completion_texts(tokenizer, batch: RolloutBatch) -> list[str]:
    """Completion text of each row, cut at EOS (the stop token is not part of the answer)."""
    eos = tokenizer.eos_token_id
    out = []
    for ids in batch.completions():
        if eos in ids:
            ids = ids[: ids.index(eos)]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def rewards(task, tokenizer, examples, batch: RolloutBatch) -> np.ndarray:
    """Task reward of each row (0 for ungraded examples)."""
    texts = completion_texts(tokenizer, batch)
    r = [task.grade(examples[i], t) for i, t in zip(batch.prompt_index_B, texts)]
    return np.asarray([0.0 if x is None else x for x in r], np.float32)


def learner_batch(run: Run, batch: RolloutBatch, examples) -> dict[str, np.ndarray]:
    """RolloutBatch + the teacher data (and rewards) the loss needs."""
    needs = run.learner.needs
    out = dict(tokens_BL=batch.tokens_BL, valid_BL=batch.valid_BL, completion_mask_BL=batch.completion_mask_BL,
               rollout_logp_BL=batch.rollout_logp_BL.astype(np.float32))
    teacher_needs = needs & {"teacher_logp", "teacher_topk", "teacher_logits"}
    if teacher_needs:
        out.update(run.teacher.score(batch.tokens_BL, batch.valid_BL, teacher_needs, top_k=run.cfg.teacher.top_k))
    if "reward" in needs:
        out["reward_B"] = rewards(run.task, run.tokenizer, examples, batch)
    return out


def generate(run: Run, examples, seed: int, *, engine=None, temperature=None) -> RolloutBatch:
    n = run.cfg.rollout.samples_per_prompt
    prompts = encode_prompts(run.tokenizer, examples)
    rep = [p for p in prompts for _ in range(n)]
    batch = (engine or run.engine).generate(rep, sampling_params(run.cfg, run.tokenizer, temperature=temperature),
                                            seed=seed)
    batch.prompt_index_B = np.repeat(np.arange(len(prompts)), n)[batch.prompt_index_B]
    return batch


def publish(run: Run, params, version: int) -> None:
    """Send the learner's weights to the engine as `version` (HF names, HF layout; gathered to the host)."""
    run.engine.update_weights(hf.named_params(run.student_cfg, params), version)


class Evaluator:
    """Held-out quality of the learner's current weights, measured with a clean (unquantized) JAX engine.

    reverse_kl: mean over held-out prompts of Σ_t (log S - log T) on the student's own samples (T = 1), an
    unbiased estimate of the sequence-level KL(S‖T). accuracy: greedy-decoding exact match.
    """

    def __init__(self, run: Run):
        from opdjax.rollout.jax_engine import JaxEngine

        self.run = run
        self.examples = run.task.examples(run.cfg.pipeline.eval_prompts, run.cfg.seed + 7, "heldout")
        self.engine = JaxEngine(run.student_cfg, None, pad_id=run.tokenizer.pad_token_id,
                                eos_id=run.tokenizer.eos_token_id)

    def __call__(self, params, version: int) -> dict[str, float]:
        run = self.run
        self.engine.update_weights(hf.named_params(run.student_cfg, params), version)
        prompts = encode_prompts(run.tokenizer, self.examples)
        sp = sampling_params(run.cfg, run.tokenizer, temperature=1.0)
        sp = dataclasses.replace(sp, top_k=0, top_p=1.0)
        sampled = self.engine.generate(prompts, sp, seed=12345)
        t = run.teacher.score(sampled.tokens_BL, sampled.valid_BL, frozenset({"teacher_logp"}))["teacher_logp_BL"]
        m = sampled.completion_mask_BL
        per_seq = ((sampled.rollout_logp_BL - t) * m).sum(1)
        greedy = self.engine.generate(prompts, dataclasses.replace(sp, temperature=0.0), seed=0)
        texts = completion_texts(run.tokenizer, greedy)
        grades = [run.task.grade(ex, txt) for ex, txt in zip(self.examples, texts)]
        graded = [g for g in grades if g is not None]
        return {"eval/reverse_kl": float(per_seq.mean()),
                "eval/accuracy": float(np.mean(graded)) if graded else float("nan"),
                "eval/completion_len": float(m.sum(1).mean())}


class MetricsLogger:
    """JSONL (always), TensorBoard (when tensorboardX is importable), process 0 only."""

    def __init__(self, out_dir: pathlib.Path, tensorboard: bool, resume: bool):
        self.active = jax.process_index() == 0
        self.tb = None
        if not self.active:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.f = open(out_dir / "metrics.jsonl", "a" if resume else "w")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:
                self.tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        clean = {k: (float(v) if isinstance(v, (float, int, np.floating, np.integer)) else v)
                 for k, v in metrics.items()}
        self.f.write(json.dumps({"step": step, **clean}) + "\n")
        self.f.flush()
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and np.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.active:
            self.f.close()
            if self.tb is not None:
                self.tb.close()


# ----------------------------------------------------------------------------------------------------- the loop


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
    examples = stream.next(run.cfg.rollout.batch_size)
    t0 = time.time()
    batch = generate(run, examples, seed)
    return _Rollout(batch, examples, stream.position, time.time() - t0)


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run OPD as configured; returns the summary (also written to <out_dir>/summary.json)."""
    run = build(cfg, log)
    pc = cfg.pipeline
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    ckpt_dir = run.out_dir / "checkpoints"
    state = run.learner.init(run.params)
    stream = PromptStream(run.task, seed=cfg.seed)
    start, dropped, initial_eval = 0, 0, None
    if not pc.resume and ckpt_dir.exists() and jax.process_index() == 0:
        shutil.rmtree(ckpt_dir)  # a fresh run replaces the old run's checkpoints (resume=true continues them)
    if pc.resume and latest_step(ckpt_dir) is not None:
        state, extra = restore_checkpoint(ckpt_dir, state)
        start, dropped = int(extra["step"]), int(extra["dropped"])
        stream.position = int(extra["stream_position"])
        initial_eval = extra.get("initial_eval")
        publish(run, state.params, start)
        log(f"resumed from {ckpt_dir} at step {start} (stream position {stream.position})")
    logger = MetricsLogger(run.out_dir, pc.tensorboard, resume=pc.resume and start > 0)
    evaluate = Evaluator(run)
    if initial_eval is None:
        initial_eval = evaluate(state.params, start)
        logger.log(start, initial_eval)
    log(f"step {start}: held-out reverse KL {initial_eval['eval/reverse_kl']:.3f}, "
        f"accuracy {initial_eval['eval/accuracy']:.3f}")

    def checkpoint(step):
        save_checkpoint(ckpt_dir, state, {"step": step, "stream_position": consumed_position, "dropped": dropped,
                                          "initial_eval": initial_eval})

    bar = None
    if pc.progress and jax.process_index() == 0:
        from tqdm import tqdm

        bar = tqdm(total=pc.steps, initial=start, desc="opd", dynamic_ncols=True)
    q: queue.Queue = queue.Queue(maxsize=pc.queue_size)
    worker = None
    if pc.mode == "async":
        worker = _Worker(run, stream, q, first_seed=cfg.seed * 100_003 + start * 7919)
        worker.start()
    consumed_position = stream.position
    last_eval = initial_eval
    t_start = time.time()
    step = start
    try:
        while step < pc.steps:
            t0 = time.time()
            if worker is None:
                item = _sample(run, stream, cfg.seed * 100_003 + step * 7919)
            else:
                item = _get(q, worker)
            staleness = step - int(item.batch.version_B.min())
            if worker is not None and staleness > pc.max_staleness:
                dropped += 1
                consumed_position = item.stream_end
                continue
            t1 = time.time()
            lb = learner_batch(run, item.batch, item.examples)
            t2 = time.time()
            state, m = run.learner.train_step(state, lb)
            step += 1
            consumed_position = item.stream_end
            publish(run, state.params, step)
            t3 = time.time()
            m.update({"staleness": staleness, "dropped": dropped, "time/generate": item.gen_seconds,
                      "time/wait": t1 - t0, "time/score": t2 - t1, "time/train_publish": t3 - t2,
                      "completion_len": float(item.batch.completion_mask_BL.sum(1).mean())})
            if pc.eval_every and step % pc.eval_every == 0 or step == pc.steps:
                last_eval = evaluate(state.params, step)
                m.update(last_eval)
            logger.log(step, m)
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
    if latest_step(ckpt_dir) != step:
        checkpoint(step)
    final_dir = run.out_dir / "student_final"
    if jax.process_index() == 0:
        hf.save_model(final_dir, run.student_cfg, state.params)
        run.tokenizer.save_pretrained(final_dir)
    summary = {
        "steps": step, "mode": pc.mode, "dropped_rollouts": dropped, "seconds": time.time() - t_start,
        "initial": initial_eval, "final": last_eval, "student_final": str(final_dir),
        "reverse_kl_ratio": last_eval["eval/reverse_kl"] / max(initial_eval["eval/reverse_kl"], 1e-9),
    }
    if jax.process_index() == 0:
        (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
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


__all__ = ["Run", "build", "format_summary", "train"]
