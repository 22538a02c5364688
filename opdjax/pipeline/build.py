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
from opdjax.data.prepare import prepare_builtin
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

__all__ = ["Run", "build", "make_engine", "make_evaluator", "make_publisher", "make_teacher", "resolve_models",
           "sampling_params"]


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
    student, teacher = cfg.student.path, cfg.teacher.path
    _check_dirs(student, teacher)  # a mistyped directory is reported before a built-in pair is trained
    if "builtin" in (student, teacher):
        if cfg.task.name == "jsonl":
            raise ConfigError("student/teacher 'builtin' are trained on a built-in task; with prompts=FILE.jsonl "
                              "pass student=DIR and teacher=DIR")
        meta = prepare_builtin(cfg.task, cfg.prepare, log=log)
        student = meta["student"] if student == "builtin" else student
        teacher = meta["teacher"] if teacher == "builtin" else teacher
    _check_dirs(student, teacher)
    return student, teacher


def _check_dirs(student: str, teacher: str) -> None:
    for role, path in (("student", student), ("teacher", teacher)):
        if path != "builtin" and not pathlib.Path(path).is_dir():
            raise ConfigError(f"{role}={path!r}: no such directory (expected a Hugging Face model directory with "
                              f"config.json and *.safetensors, or 'builtin'); nothing is downloaded")


def make_engine(cfg: TrainConfig, student_path: str, student_cfg: ModelConfig, params, tokenizer) -> RolloutEngine:
    """The rollout engine named by `rollout.engine`, serving the student's initial weights as version 0."""
    r = cfg.rollout
    if r.endpoints:
        s = cfg.sync
        return RemoteEngine(r.endpoints, read_token(s.token_file), student_cfg, pad_id=tokenizer.pad_token_id,
                            sync=cfg.pipeline.mode == "sync", timeout=s.request_timeout, publish_timeout=s.timeout,
                            retries=s.retries, wait_s=s.wait_s, transport="shm" if s.transport == "shm" else "tcp",
                            shm_root=s.root or None)
    if r.engine == "vllm":
        return VllmEngine(student_path, dtype=r.dtype, seed=r.seed, fp8_emulation=r.fp8_emulation,
                          recipe=None if r.recipe == "none" else r.recipe, **r.vllm)
    return JaxEngine(student_cfg, params, recipe=r.recipe, weight_noise=r.weight_noise, seed=r.seed,
                     noise_mode=r.noise_mode, decode_attention=r.decode_attention,
                     stale_versions=r.stale_versions, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                     dtype=r.dtype)


def make_publisher(cfg: TrainConfig, student_cfg: ModelConfig, engine: RolloutEngine) -> tuple[Publisher, Link]:
    """The run's publisher: the learner's params -> HF-named tensors in the engine's dtype -> the engine, through
    the link `sync.transport` names (the engine's own receiver validates and applies each version)."""
    kind = "inproc" if cfg.sync.transport == "auto" else cfg.sync.transport
    return engine_publisher(engine, student_cfg, transport=kind, root=cfg.sync.root or None, timeout=cfg.sync.timeout)


def make_teacher(cfg: TrainConfig, teacher_path: str, mesh: Mesh) -> Teacher:
    """The teacher named by `teacher.engine` (JAX in-process on the learner's mesh, or vLLM)."""
    t = cfg.teacher
    if t.endpoints:
        s = cfg.sync
        return RemoteTeacher(t.endpoints, read_token(s.token_file), ModelConfig.from_dir(teacher_path),
                             temperature=t.temperature, timeout=s.request_timeout, retries=s.retries, wait_s=s.wait_s)
    if cfg.teacher.engine == "vllm":
        return VllmTeacher(teacher_path, dtype=cfg.teacher.dtype)
    return JaxTeacher.from_pretrained(teacher_path, dtype=cfg.teacher.dtype, mesh=mesh,
                                      temperature=cfg.teacher.temperature)


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


def build(cfg: TrainConfig, log=print, *, with_teacher: bool = True) -> Run:
    """Everything a run needs; `with_teacher=False` skips loading the teacher (probes only rescore the student).

    What can be checked without the models is checked first (mesh against the devices, the task's options)."""
    mesh = make_mesh(cfg.mesh.shape)
    try:
        task = tasks.get_task(cfg.task.name, **cfg.task.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task {cfg.task.name!r} with task.options={dict(cfg.task.options)}: {e}") from None
    if cfg.student.path == "builtin":  # preparing the built-in pair takes minutes: fail on lengths first
        check_lengths(cfg, None, None, tiny_config(cfg.prepare.family, cfg.prepare.student_size).max_position_embeddings)
    student_path, teacher_path = resolve_models(cfg, log)
    tokenizer = load_tokenizer(student_path)
    try:
        teacher_tok = load_tokenizer(teacher_path)
    except (OSError, ValueError):
        teacher_tok = None
    student_cfg = ModelConfig.from_dir(student_path)
    check_same_vocab(student_cfg, ModelConfig.from_dir(teacher_path), tokenizer, teacher_tok)
    check_lengths(cfg, task, tokenizer, student_cfg.max_position_embeddings)
    st = cfg.student
    graphdef, params = hf.load_state(student_path, student_cfg, param_dtype=st.dtype, dtype=st.compute_dtype,
                                     attention=st.attention, remat=st.remat)
    loss_options = dict(cfg.loss.options)
    if cfg.loss.name == "reinforce" and cfg.rollout.samples_per_prompt > 1:
        loss_options.setdefault("group_size", cfg.rollout.samples_per_prompt)
    correction = (None if cfg.loss.correction == "none"
                  else Correction(name=cfg.loss.correction, **cfg.loss.correction_options))
    o = cfg.optim
    tx, schedule = make_optimizer(lr=o.lr, total_steps=cfg.pipeline.steps, schedule=o.schedule,
                                  warmup_steps=o.warmup_steps, grad_clip=o.grad_clip, weight_decay=o.weight_decay,
                                  b1=o.b1, b2=o.b2)
    sampling = sampling_params(cfg, tokenizer)
    learner = Learner(graphdef, loss=cfg.loss.name, loss_options=loss_options, correction=correction, tx=tx,
                      schedule=schedule, temperature=learner_temperature(sampling), mesh=mesh,
                      logprob_chunk=st.logprob_chunk, micro_batches=cfg.optim.micro_batches,
                      track_movement=cfg.pipeline.policy_movement)
    engine = make_engine(cfg, student_path, student_cfg, params, tokenizer)
    # Several learner processes: each scores its own rows, so an in-process teacher lives on its local devices.
    teacher_mesh = mesh if jax.process_count() == 1 else make_mesh((1, -1, 1), jax.local_devices())
    publisher, link = make_publisher(cfg, student_cfg, engine)
    parts = OPDParts(engine=engine, teacher=make_teacher(cfg, teacher_path, teacher_mesh) if with_teacher else None,
                     learner=learner, publisher=publisher, tokenizer=tokenizer, sampling=sampling,
                     samples_per_prompt=cfg.rollout.samples_per_prompt, teacher_top_k=cfg.teacher.top_k, task=task)
    return Run(cfg=cfg, parts=parts, student_cfg=student_cfg, graphdef=graphdef, params=params, mesh=mesh,
               out_dir=pathlib.Path(cfg.pipeline.out_dir), links=[link])


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
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature if temperature is None
                          else temperature, top_k=r.top_k, top_p=r.top_p, stop_token_ids=(tokenizer.eos_token_id,))
