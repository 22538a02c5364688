"""What a run's config names, checked and resolved before anything is built: the mesh against this machine, the
task and its options, the model directories (the built-in pair prepared once, then cached), the lengths.

`check_inputs` needs no model loaded: `opdjax train` runs it before it claims its run directory, so bad input is
named before the consequences of running with it.
"""

from __future__ import annotations

import dataclasses
import pathlib

from jax.sharding import Mesh

from opdjax.config import ConfigError, TrainConfig
from opdjax.data import tasks
from opdjax.data.chat import chat_template_of
from opdjax.data.prompts import encode_prompts
from opdjax.models import ModelConfig
from opdjax.models.sharding import make_mesh
from opdjax.models.tiny import tiny_config
from opdjax.pipeline.prepare import prepare_builtin
from opdjax.pipeline.wandb_sink import check_available as check_wandb

__all__ = ["BYTES_PER_TOKEN", "Inputs", "check_chat_templates", "check_distinct_prompts", "check_inputs",
           "check_lengths", "prompt_byte_bound", "resolve_models"]

# The most bytes one token covers on average, generously (byte-level BPE on text: about 4; runs of spaces or
# repeated symbols: a few dozen at worst): bounds a prompt's bytes by its positions before it is tokenized.
BYTES_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What `check_inputs` found valid before anything is built: the learner's mesh and the task."""

    mesh: Mesh
    task: tasks.Task


def check_inputs(cfg: TrainConfig) -> Inputs:
    """Everything about the input that can be checked without loading a model, so that bad input is named before
    the consequences of running with it (a run directory claimed, a built-in pair prepared for minutes): wandb
    installed when pipeline.wandb asks for it, the mesh against this machine's devices, the task and its options,
    each model directory (config.json present and of a supported family), the completion length against the
    student's positions, and a prompt file's rows: each prompt's bytes against the student's context, enough
    distinct prompts in each split."""
    check_wandb(cfg.pipeline.wandb)
    mesh = make_mesh(cfg.mesh.shape)
    try:
        task = tasks.get_task(cfg.task.name, **cfg.task.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task {cfg.task.name!r} with task.options={dict(cfg.task.options)}: {e}") from None
    _check_dirs(cfg.student.path, cfg.teacher.path)
    # A missing config.json or an unsupported model_type, named now.
    models = {path: ModelConfig.from_dir(path) for path in {cfg.student.path, cfg.teacher.path} - {"builtin"}}
    student_path = cfg.student.path
    positions = (tiny_config(cfg.prepare.family, cfg.prepare.student_size) if student_path == "builtin"
                 else models[student_path]).max_position_embeddings
    check_lengths(cfg, task, None, positions)
    check_distinct_prompts(cfg, task)
    return Inputs(mesh=mesh, task=task)


def check_lengths(cfg: TrainConfig, task, tokenizer, positions: int) -> None:
    """Prompt + rollout.max_new_tokens must fit the student's positions: checked for max_new_tokens alone, and for
    every row of a task read from a file (ConfigError naming the file and line of the first row that does not):
    first by its UTF-8 bytes against `prompt_byte_bound` (no tokenizer, so this runs before any model loads and
    before a long line is tokenized; a conversation's bytes are its turns' as JSON, `Example.key`), then, given a
    tokenizer, by its tokens as `encode_prompts` makes them (a chat prompt rendered by the template)."""
    n = cfg.rollout.max_new_tokens
    if n >= positions:
        raise ConfigError(f"rollout.max_new_tokens={n} leaves no room for a prompt: the student has {positions} "
                          f"positions (prompt + completion must fit)")
    rows = getattr(task, "rows", None)
    if not rows:
        return
    where = getattr(task, "path", "prompts")
    bound = prompt_byte_bound(positions, n)
    for ex in rows:
        size = len(ex.key.encode("utf-8"))
        if size > bound:
            raise ConfigError(f"{where}:{ex.meta.get('line', '?')}: a prompt of {size:,} bytes cannot fit the "
                              f"student's {positions} positions with rollout.max_new_tokens={n}: refused before "
                              f"tokenizing, over the bound of {bound:,} bytes ({positions - n} prompt positions x "
                              f"{BYTES_PER_TOKEN} bytes a token at most); shorten it")
    if tokenizer is None:
        return
    lens = [len(ids) for ids in encode_prompts(tokenizer, rows)]  # as rendered: a chat template's turns counted
    too_long = [(ln, ex) for ln, ex in zip(lens, rows) if ln + n > positions]
    if too_long:
        ln, ex = too_long[0]
        raise ConfigError(f"{where}:{ex.meta.get('line', '?')}: a prompt of {ln} tokens + rollout.max_new_tokens={n} "
                          f"exceeds the student's {positions} positions ({len(too_long)} row(s) do); shorten them or "
                          f"lower rollout.max_new_tokens")


def check_chat_templates(cfg: TrainConfig, task, student_tok, teacher_tok) -> None:
    """The teacher scores the very token ids the student's chat template rendered. When a task's prompts are rendered
    (the student's tokenizer has a template and some row has ``chat``) and the teacher's tokenizer holds a different
    template string (or none), the teacher would score prompts in a format it was not tuned on: ConfigError naming
    both directories, unless `teacher.allow_template_mismatch`. Nothing is checked for a teacher directory without a
    tokenizer (a student without a template and required chat prompts is `encode_prompts`' error)."""
    if teacher_tok is None or cfg.teacher.allow_template_mismatch:
        return
    ours, theirs = chat_template_of(student_tok), chat_template_of(teacher_tok)
    rendered = ours is not None and any(ex.chat is not None for ex in getattr(task, "rows", None) or ())
    if rendered and ours != theirs:
        raise ConfigError(f"the student's chat template ({student_tok.name_or_path}) and the teacher's "
                          f"({teacher_tok.name_or_path}) differ{' (the teacher has none)' if theirs is None else ''}; "
                          f"the teacher scores prompts as the student's template renders them: give both tokenizers "
                          f"one template, or set teacher.allow_template_mismatch=true")


def prompt_byte_bound(positions: int, max_new_tokens: int) -> int:
    """The most UTF-8 bytes a prompt may hold before it is tokenized: its positions (the student's, less the
    completion's) times `BYTES_PER_TOKEN`. A prompt over it cannot fit unless its tokens average more than that many
    bytes, which no tokenizer's do on text; one under it is short enough to tokenize whole."""
    return max(positions - max_new_tokens, 0) * BYTES_PER_TOKEN


def check_distinct_prompts(cfg: TrainConfig, task) -> None:
    """A task read from a file needs at least `rollout.batch_size` distinct prompts in its training split (one step
    samples that many prompts: fewer, and every step trains on repeats of the same few) and at least one row in its
    held-out split (the evaluation draws `pipeline.eval_prompts` from it). ConfigError naming the file otherwise.
    Generated tasks draw their own pools and are not checked."""
    split_rows = getattr(task, "split_rows", None)
    if split_rows is None:
        return
    where, need = getattr(task, "path", "prompts"), cfg.rollout.batch_size
    train = split_rows("train")
    distinct = len({ex.key for ex in train})
    if distinct < need:
        raise ConfigError(f"{where}: {distinct} distinct training prompt{'s' * (distinct != 1)} ({len(train)} "
                          f"row(s) in the training split); a step samples rollout.batch_size={need} prompts, so it "
                          f"needs at least {need} distinct ones: add rows, mark more with \"split\": \"train\" (rows "
                          f"without one are held out by a hash of the prompt, ~10%), or lower rollout.batch_size")
    if not split_rows("heldout"):
        raise ConfigError(f"{where}: the 'heldout' split has no rows (of {len(task.rows)}); the evaluation draws "
                          f"pipeline.eval_prompts from it: mark some rows with \"split\": \"heldout\" (rows without "
                          f"one are held out by a hash of the prompt, ~10%)")


def resolve_models(cfg: TrainConfig, log=print) -> tuple[str, str]:
    """Student and teacher directories; "builtin" ones are prepared on the task (once, then cached)."""
    student_path, teacher_path = cfg.student.path, cfg.teacher.path
    _check_dirs(student_path, teacher_path)  # a mistyped directory is reported before a built-in pair is trained
    if "builtin" in (student_path, teacher_path):
        if cfg.task.name == "jsonl":
            raise ConfigError("student/teacher 'builtin' are trained on a built-in task; with prompts=FILE.jsonl "
                              "pass student=DIR and teacher=DIR")
        meta = prepare_builtin(cfg, log=log)
        student_path = meta["student"] if student_path == "builtin" else student_path
        teacher_path = meta["teacher"] if teacher_path == "builtin" else teacher_path
    _check_dirs(student_path, teacher_path)
    return student_path, teacher_path


def _check_dirs(student_path: str, teacher_path: str) -> None:
    for role, path in (("student", student_path), ("teacher", teacher_path)):
        if path != "builtin" and not pathlib.Path(path).is_dir():
            raise ConfigError(f"{role}={path!r}: no such directory (expected a Hugging Face model directory with "
                              f"config.json and *.safetensors, or 'builtin'); nothing is downloaded")
