"""Config -> a typed `Run`: models resolved (built-in pair prepared once), engine, teacher, learner, mesh, and the
publisher that sends the learner's weights to the engine over the `sync.transport` link.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
from flax import nnx
from jax.sharding import Mesh

from opdjax.config import ConfigError, TrainConfig
from opdjax.core.corrections import Correction
from opdjax.data import tasks
from opdjax.pipeline.prepare import prepare_builtin
from opdjax.learner import Learner, make_optimizer
from opdjax.models import ModelConfig, hf
from opdjax.models.sharding import make_mesh
from opdjax.models.tiny import load_tokenizer, tiny_config
from opdjax.remote.client import RemoteEngine, RemoteTeacher, read_token
from opdjax.rollout import RolloutEngine, SamplingParams
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.rollout.vllm_engine import VllmEngine  # vLLM itself is imported on first use
from opdjax.pipeline.evaluate import Evaluator
from opdjax.pipeline.opd import OPDParts, learner_temperature
from opdjax.sync import Link, Publisher, engine_publisher
from opdjax.teacher import JaxTeacher, Teacher, check_same_vocab
from opdjax.teacher.vllm_teacher import VllmTeacher

__all__ = ["Inputs", "Run", "build", "check_inputs", "make_engine", "make_evaluator", "make_learner", "make_publisher",
           "make_teacher", "resolve_models", "sampling_params"]


@dataclasses.dataclass
class Run:
    """Everything one training run holds: the OPD components, what `pipeline.opd` steps on, read as
    `run.parts.engine`, `run.parts.teacher` (None when built with_teacher=False) and so on; and what the loop needs
    besides (the config, the model, the mesh, the run directory, the links to close)."""

    cfg: TrainConfig
    parts: OPDParts
    student_cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State                # the student's initial weights
    mesh: Mesh
    out_dir: pathlib.Path
    links: list[Link] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Release what the run opened for publishing (sockets, snapshot directories)."""
        for link in self.links:
            link.close()
        self.links.clear()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def make_engine(cfg: TrainConfig, student_path: str, student_cfg: ModelConfig, params, tokenizer) -> RolloutEngine:
    """The rollout engine named by `rollout.engine`, serving the student's initial weights as version 0."""
    rollout, sync = cfg.rollout, cfg.sync
    if rollout.endpoints:
        return RemoteEngine(rollout.endpoints, read_token(sync.token_file), student_cfg, pad_id=tokenizer.pad_token_id,
                            calls=sync.calls, sync=cfg.pipeline.mode == "sync", publish_timeout=sync.timeout,
                            transport="shm" if sync.transport == "shm" else "tcp", shm_root=sync.root or None)
    if rollout.engine == "vllm":
        return VllmEngine(student_path, dtype=rollout.dtype, seed=rollout.seed, fp8_emulation=rollout.fp8_emulation,
                          recipe=None if rollout.recipe == "none" else rollout.recipe, **rollout.vllm)
    return JaxEngine(student_cfg, params, mismatch=rollout.mismatch, seed=rollout.seed,
                     decode_attention=rollout.decode_attention, pad_id=tokenizer.pad_token_id,
                     eos_id=tokenizer.eos_token_id, dtype=rollout.dtype)


def make_publisher(cfg: TrainConfig, student_cfg: ModelConfig, engine: RolloutEngine) -> tuple[Publisher, Link]:
    """The run's publisher: the learner's params -> HF-named tensors in the engine's dtype -> the engine, through
    the link `sync.transport` names (the engine's own receiver validates and applies each version)."""
    sync = cfg.sync
    transport = "inproc" if sync.transport == "auto" else sync.transport
    return engine_publisher(engine, student_cfg, transport=transport, root=sync.root or None, timeout=sync.timeout)


def make_teacher(cfg: TrainConfig, teacher_path: str, mesh: Mesh) -> Teacher:
    """The teacher named by `teacher.engine` (JAX in-process on the learner's mesh, or vLLM)."""
    teacher, sync = cfg.teacher, cfg.sync
    if teacher.endpoints:
        return RemoteTeacher(teacher.endpoints, read_token(sync.token_file), ModelConfig.from_dir(teacher_path),
                             temperature=teacher.temperature, calls=sync.calls)
    if teacher.engine == "vllm":
        return VllmTeacher(teacher_path, dtype=teacher.dtype)
    return JaxTeacher.from_pretrained(teacher_path, dtype=teacher.dtype, mesh=mesh, temperature=teacher.temperature)


def check_lengths(cfg: TrainConfig, task, tokenizer, positions: int) -> None:
    """Prompt + rollout.max_new_tokens must fit the student's positions: checked for max_new_tokens alone, and for
    every row of a task read from a file (ConfigError naming the file and line of the first row that does not)."""
    n = cfg.rollout.max_new_tokens
    if n >= positions:
        raise ConfigError(f"rollout.max_new_tokens={n} leaves no room for a prompt: the student has {positions} "
                          f"positions (prompt + completion must fit)")
    rows = getattr(task, "rows", None)
    if rows:
        lens = [len(ids) for ids in tokenizer([ex.prompt for ex in rows], add_special_tokens=False).input_ids]
        too_long = [(ln, ex) for ln, ex in zip(lens, rows) if ln + n > positions]
        if too_long:
            ln, ex = too_long[0]
            raise ConfigError(f"{getattr(task, 'path', 'prompts')}:{ex.meta.get('line', '?')}: a prompt of {ln} "
                              f"tokens + rollout.max_new_tokens={n} exceeds the student's {positions} positions "
                              f"({len(too_long)} row(s) do); shorten them or lower rollout.max_new_tokens")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What `check_inputs` found valid before anything is built: the learner's mesh and the task."""

    mesh: Mesh
    task: tasks.Task


def check_inputs(cfg: TrainConfig) -> Inputs:
    """Everything about the input that can be checked without loading a model, so that bad input is named before
    the consequences of running with it (a run directory claimed, a built-in pair prepared for minutes): the mesh
    against this machine's devices, the task and its options, each model directory (config.json present and of a
    supported family), and the completion length against the student's positions."""
    mesh = make_mesh(cfg.mesh.shape)
    try:
        task = tasks.get_task(cfg.task.name, **cfg.task.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task {cfg.task.name!r} with task.options={dict(cfg.task.options)}: {e}") from None
    _check_dirs(cfg.student.path, cfg.teacher.path)
    for path in {cfg.student.path, cfg.teacher.path} - {"builtin"}:
        ModelConfig.from_dir(path)  # a missing config.json or an unsupported model_type, named now
    student_path = cfg.student.path
    positions = (tiny_config(cfg.prepare.family, cfg.prepare.student_size) if student_path == "builtin"
                 else ModelConfig.from_dir(student_path)).max_position_embeddings
    check_lengths(cfg, None, None, positions)
    return Inputs(mesh=mesh, task=task)


def build(cfg: TrainConfig, log=print, *, with_teacher: bool = True) -> Run:
    """Everything a run needs; `with_teacher=False` skips loading the teacher (probes only rescore the student).

    What can be checked without the models is checked first (`check_inputs`)."""
    inputs = check_inputs(cfg)
    mesh, task = inputs.mesh, inputs.task
    student_path, teacher_path = resolve_models(cfg, log)
    tokenizer = load_tokenizer(student_path)
    try:
        teacher_tok = load_tokenizer(teacher_path)
    except (OSError, ValueError):
        teacher_tok = None
    student_cfg = ModelConfig.from_dir(student_path)
    check_same_vocab(student_cfg, ModelConfig.from_dir(teacher_path), tokenizer, teacher_tok)
    check_lengths(cfg, task, tokenizer, student_cfg.max_position_embeddings)
    student = cfg.student
    graphdef, params = hf.load_state(student_path, student_cfg, param_dtype=student.dtype,
                                     dtype=student.compute_dtype, attention=student.attention, remat=student.remat)
    sampling = sampling_params(cfg, tokenizer)
    learner = make_learner(cfg, graphdef, mesh, sampling)
    engine = make_engine(cfg, student_path, student_cfg, params, tokenizer)
    # Several learner processes: each scores its own rows, so an in-process teacher lives on its local devices.
    teacher_mesh = mesh if jax.process_count() == 1 else make_mesh((1, -1, 1), jax.local_devices())
    publisher, link = make_publisher(cfg, student_cfg, engine)
    parts = OPDParts(engine=engine, teacher=make_teacher(cfg, teacher_path, teacher_mesh) if with_teacher else None,
                     learner=learner, publisher=publisher, tokenizer=tokenizer, sampling=sampling,
                     samples_per_prompt=cfg.rollout.samples_per_prompt, teacher_top_k=cfg.teacher.top_k, task=task)
    return Run(cfg=cfg, parts=parts, student_cfg=student_cfg, graphdef=graphdef, params=params, mesh=mesh,
               out_dir=pathlib.Path(cfg.pipeline.out_dir), links=[link])


def make_learner(cfg: TrainConfig, graphdef: nnx.GraphDef, mesh: Mesh, sampling: SamplingParams) -> Learner:
    """The student's learner: `loss.*` (a grouped REINFORCE learns its group size from rollout.samples_per_prompt),
    `optim.*`, on `mesh`, scoring at the sampling temperature."""
    loss, optim = cfg.loss, cfg.optim
    loss_options = dict(loss.options)
    if loss.name == "reinforce" and cfg.rollout.samples_per_prompt > 1:
        loss_options.setdefault("group_size", cfg.rollout.samples_per_prompt)
    correction = None if loss.correction == "none" else Correction(name=loss.correction, **loss.correction_options)
    tx, schedule = make_optimizer(lr=optim.lr, total_steps=cfg.pipeline.steps, schedule=optim.schedule,
                                  warmup_steps=optim.warmup_steps, grad_clip=optim.grad_clip,
                                  weight_decay=optim.weight_decay, b1=optim.b1, b2=optim.b2)
    return Learner(graphdef, loss=loss.name, loss_options=loss_options, correction=correction, tx=tx,
                   schedule=schedule, temperature=learner_temperature(sampling), mesh=mesh,
                   logprob_chunk=cfg.student.logprob_chunk, micro_batches=optim.micro_batches,
                   track_movement=cfg.pipeline.policy_movement)


def make_evaluator(run: Run) -> Evaluator:
    """The held-out evaluator of a run: `pipeline.eval_prompts` held-out examples drawn with `pipeline.eval_seed` (the
    same set for every run seed, so seeds are compared on the same prompts), sampled by a
    clean JAX engine (no quantization, noise or staleness), scored by the run's teacher."""
    cfg, p = run.cfg, run.parts
    tok = p.tokenizer
    engine = JaxEngine(run.student_cfg, None, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    return Evaluator(engine, p.teacher, tok, Evaluator.held_out(p.task, cfg.pipeline.eval_prompts,
                                                                cfg.pipeline.eval_seed),
                     model_cfg=run.student_cfg, max_new_tokens=cfg.rollout.max_new_tokens, task=p.task)


def sampling_params(cfg: TrainConfig, tokenizer, *, temperature: float | None = None) -> SamplingParams:
    """`rollout.*` sampling settings (EOS stops a completion); `temperature` overrides rollout.temperature."""
    rollout = cfg.rollout
    return SamplingParams(max_new_tokens=rollout.max_new_tokens,
                          temperature=rollout.temperature if temperature is None else temperature,
                          top_k=rollout.top_k, top_p=rollout.top_p, stop_token_ids=(tokenizer.eos_token_id,))
