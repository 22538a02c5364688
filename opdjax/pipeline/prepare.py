"""The embedded default's models: a teacher trained on the task until accurate, and a weaker student.

Both share one locally trained tokenizer. They are written as HF directories under
`<cache_dir>/<key>/{teacher,student}`, where the key hashes everything that determines them, and reused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import shutil
import time

import jax.numpy as jnp
import numpy as np

from opdjax.config import TrainConfig
from opdjax.core.types import Batch
from opdjax.data import tasks
from opdjax.data.prompts import PromptStream, sft_batch
from opdjax.learner import Learner, make_optimizer
from opdjax.models import decoder, hf
from opdjax.models.tiny import load_tokenizer, make_tiny, train_tokenizer

_FORMAT = 1  # bump when the preparation procedure changes
SFT_OPTIM = dict(schedule="cosine", warmup_steps=20, grad_clip=1.0, weight_decay=0.0, b1=0.9, b2=0.99)
"""The supervised recipe that makes the built-in pair (AdamW; the learning rate comes from `prepare.lr`)."""


def teacher_forced_accuracy(graphdef, params, batch: Batch) -> float:
    """Fraction of rows whose every completion token (answer + EOS) is the argmax given the true prefix.

    This equals greedy-decoding exact match: greedy decoding reproduces the answer iff each step's argmax does.
    """
    logits, _ = decoder.forward(graphdef, params, jnp.asarray(batch.tokens_BT), valid_BT=jnp.asarray(batch.valid_BT))
    pred = np.asarray(jnp.argmax(logits[:, :-1], -1))
    ok = (pred == batch.tokens_BT[:, 1:]) | ~batch.mask_BT[:, 1:]
    return float(ok.all(axis=1).mean())


def sft_train(path: pathlib.Path, tokenizer, task, steps: int, *, batch_size: int, lr: float, seed: int,
              log=print) -> float:
    """Supervised training of the checkpoint at `path` on the task's train split; returns held-out accuracy."""
    cfg = hf.ModelConfig.from_dir(path)
    graphdef, params = hf.load_state(path)
    heldout = sft_batch(tokenizer, task.examples(256, seed, "heldout"))
    if steps == 0:
        return teacher_forced_accuracy(graphdef, params, heldout)
    tx, schedule = make_optimizer(lr=lr, total_steps=steps, **SFT_OPTIM)
    learner = Learner(graphdef, loss="sft", tx=tx, schedule=schedule)
    state = learner.init(params)
    stream = PromptStream(task, seed=seed)
    t0 = time.time()
    for i in range(steps):
        state, m = learner.train_step(state, sft_batch(tokenizer, stream.next(batch_size)))
        if (i + 1) % max(steps // 5, 1) == 0:
            acc = teacher_forced_accuracy(graphdef, state.params, heldout)
            log(f"  sft on {task.name!r}: step {i + 1}/{steps} loss {m['loss']:.3f} held-out accuracy {acc:.2f} "
                f"({time.time() - t0:.0f}s)")
    hf.save_model(path, cfg, state.params)
    return teacher_forced_accuracy(graphdef, state.params, heldout)


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps({"format": _FORMAT, **parts}, sort_keys=True).encode()).hexdigest()[:12]


def prepare_builtin(cfg: TrainConfig, log=print) -> dict:
    """Teacher and student directories for the task (each built once, then reused); returns paths and accuracy.

    The teacher is keyed by `cfg.task` and the teacher fields of `cfg.prepare`; the student additionally by its own
    fields,
    so changing only the student reuses the teacher (and its tokenizer, which the student shares).
    """
    teacher_dir, student_dir = _model_dirs(cfg)
    task = tasks.get_task(cfg.task.name, **cfg.task.options)
    heldout = task.examples(256, cfg.prepare.seed, "heldout")
    builds = (("teacher", teacher_dir, functools.partial(_build_teacher, cfg, task, log=log)),
              ("student", student_dir, functools.partial(_build_student, cfg, teacher_dir, task, log=log)))
    accs = {role: _prepared(cfg, role, path, build, heldout, log) for role, path, build in builds}
    return {"teacher": str(teacher_dir), "student": str(student_dir), "teacher_acc": accs["teacher"],
            "student_acc": accs["student"]}


def _model_dirs(cfg: TrainConfig) -> tuple[pathlib.Path, pathlib.Path]:
    """(teacher_dir, student_dir) under `<prepare.cache_dir>/<task>/`, each named by a hash of what determines it."""
    p = dataclasses.asdict(cfg.prepare)
    task = dataclasses.asdict(cfg.task)
    t_fields = {k: p[k] for k in ("family", "teacher_size", "teacher_steps", "batch_size", "lr", "seed",
                                  "student_task")}  # the shared tokenizer is trained on both tasks' text
    s_fields = {k: p[k] for k in ("student_init", "student_task", "student_size", "student_steps", "student_lr")}
    root = pathlib.Path(cfg.prepare.cache_dir) / cfg.task.name
    return (root / f"teacher-{_key(task=task, teacher=t_fields)}",
            root / f"student-{_key(task=task, teacher=t_fields, student=s_fields)}")


def _build_teacher(cfg: TrainConfig, task, tmp: pathlib.Path, *, log=print) -> None:
    """A fresh teacher in `tmp`: a tokenizer trained on both tasks' text, then `teacher_steps` of SFT on the task."""
    prepare = cfg.prepare
    tok = train_tokenizer(tasks.corpus(task, 2000, prepare.seed) +
                          tasks.corpus(prepare.student_task, 500, prepare.seed), vocab_size=300)
    make_tiny(tmp, prepare.family, prepare.teacher_size, seed=prepare.seed, tokenizer=tok)
    sft_train(tmp, tok, task, prepare.teacher_steps, batch_size=prepare.batch_size, lr=prepare.lr, seed=prepare.seed,
              log=log)


def _build_student(cfg: TrainConfig, teacher_dir: pathlib.Path, task, tmp: pathlib.Path, *, log=print) -> None:
    """A student in `tmp` with the teacher's tokenizer: the teacher fine-tuned on `student_task`
    (student_init="teacher"), else a fresh model of `student_size` trained on the task."""
    prepare = cfg.prepare
    tok = load_tokenizer(teacher_dir)
    if prepare.student_init == "teacher":
        shutil.copytree(teacher_dir, tmp)
        (tmp / _DONE).unlink()
        other = tasks.get_task(prepare.student_task)
        sft_train(tmp, tok, other, prepare.student_steps, batch_size=prepare.batch_size, lr=prepare.student_lr,
                  seed=prepare.seed + 1, log=log)
    else:
        make_tiny(tmp, prepare.family, prepare.student_size, seed=prepare.seed + 1, tokenizer=tok)
        sft_train(tmp, tok, task, prepare.student_steps, batch_size=prepare.batch_size, lr=prepare.student_lr,
                  seed=prepare.seed + 1, log=log)


def _prepared(cfg: TrainConfig, role: str, path: pathlib.Path, build, heldout, log) -> float:
    """The held-out accuracy of the model at `path`, from its marker file when prepared earlier; otherwise
    `build(tmp)` into `<path>.partial`, measure it, write the marker and rename it to `path` (so a model is either
    complete or absent: an interrupted preparation is redone, never half-used)."""
    prepare = cfg.prepare
    if (path / _DONE).is_file():
        acc = json.loads((path / _DONE).read_text())["heldout_accuracy"]
        log(f"reusing the prepared {role} {path} (held-out accuracy on {cfg.task.name!r}: {acc:.2f})")
        return acc
    how = (f"{prepare.teacher_steps} supervised steps on {cfg.task.name!r}" if role == "teacher" else
           f"the teacher fine-tuned {prepare.student_steps} steps on {prepare.student_task!r}"
           if prepare.student_init == "teacher" else f"{prepare.student_steps} supervised steps on {cfg.task.name!r}")
    log(f"preparing the {role} ({how}) in {path}")
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    build(tmp)
    graphdef, params = hf.load_state(tmp)
    acc = teacher_forced_accuracy(graphdef, params, sft_batch(load_tokenizer(tmp), heldout))
    (tmp / _DONE).write_text(json.dumps({"heldout_accuracy": acc, "role": role, "task": dataclasses.asdict(cfg.task),
                                         "prepare": dataclasses.asdict(cfg.prepare)}, indent=2))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    log(f"prepared the {role}: held-out greedy accuracy on {cfg.task.name!r} {acc:.2f}")
    return acc


_DONE = "opdjax_prepared.json"

__all__ = ["prepare_builtin", "sft_train", "teacher_forced_accuracy"]
