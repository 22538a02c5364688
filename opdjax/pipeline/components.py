"""One OPD component from the config, each named by its section: the rollout engine (`rollout.*`, `sync.*` for
servers), the publisher (`sync.*`), the teacher (`teacher.*`), the learner (`loss.*`, `optim.*`) and the sampling
settings (`rollout.*`). `pipeline.build` assembles them into a `Run`; `opdjax serve` builds one engine or teacher.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
from jax.sharding import Mesh

from opdjax.config import ConfigError, TrainConfig
from opdjax.core.corrections import Correction
from opdjax.learner import Learner, make_optimizer
from opdjax.models import ModelConfig
from opdjax.pipeline.opd import learner_temperature
from opdjax.remote.client import RemoteEngine, RemoteTeacher, read_token
from opdjax.remote.lease import RunId
from opdjax.rollout import RolloutEngine, SamplingParams
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.rollout.vllm_engine import VllmEngine  # vLLM itself is imported on first use
from opdjax.sync import Link, Publisher, engine_publisher
from opdjax.teacher import JaxTeacher, Teacher
from opdjax.teacher.vllm_teacher import VllmTeacher

__all__ = ["make_engine", "make_learner", "make_publisher", "make_teacher", "sampling_params"]


def make_engine(cfg: TrainConfig, student_path: str, student_cfg: ModelConfig, params, tokenizer, *,
                run_id: RunId | None = None) -> RolloutEngine:
    """The rollout engine named by `rollout.endpoints` (servers, bound to `run_id`) or `rollout.engine`
    (in-process, serving the student's initial weights as version 0)."""
    rollout, sync = cfg.rollout, cfg.sync
    if rollout.endpoints:
        return RemoteEngine(rollout.endpoints, read_token(sync.token_file), student_cfg, pad_id=tokenizer.pad_token_id,
                            calls=sync.calls, sync=cfg.pipeline.mode == "sync", publish_timeout=sync.timeout,
                            transport="shm" if sync.transport == "shm" else "tcp", shm_root=sync.root or None,
                            run=run_id)
    if rollout.engine == "vllm":
        return VllmEngine(student_path, dtype=rollout.dtype, seed=rollout.seed, fp8_emulation=rollout.fp8_emulation,
                          recipe=None if rollout.recipe == "none" else rollout.recipe,
                          usable_vocab=student_cfg.usable_vocab, **rollout.vllm)
    return JaxEngine(student_cfg, params, mismatch=rollout.mismatch, seed=rollout.seed,
                     decode_attention=rollout.decode_attention, pad_id=tokenizer.pad_token_id,
                     eos_id=tokenizer.eos_token_id, dtype=rollout.dtype)


def make_publisher(cfg: TrainConfig, student_cfg: ModelConfig, engine: RolloutEngine) -> tuple[Publisher, Link]:
    """The run's publisher: the learner's params -> HF-named tensors in the engine's dtype -> the engine, through
    the link `sync.transport` names (the engine's own receiver validates and applies each version)."""
    sync = cfg.sync
    transport = "inproc" if sync.transport == "auto" else sync.transport
    return engine_publisher(engine, student_cfg, transport=transport, root=sync.root or None, timeout=sync.timeout)


def make_teacher(cfg: TrainConfig, teacher_path: str, mesh: Mesh, usable_vocab: int | None = None, *,
                 run_id: RunId | None = None) -> Teacher:
    """The teacher named by `teacher.endpoints` (servers, bound to `run_id`) or `teacher.engine` (JAX in-process on
    the learner's mesh, or vLLM), scoring over the first `usable_vocab` ids (the shared tokenizer's length; None:
    every row of its vocabulary)."""
    teacher, sync = cfg.teacher, cfg.sync
    if teacher.endpoints:
        mcfg = dataclasses.replace(ModelConfig.from_dir(teacher_path), usable_vocab=usable_vocab)
        return RemoteTeacher(teacher.endpoints, read_token(sync.token_file), mcfg,
                             temperature=teacher.temperature, calls=sync.calls, run=run_id)
    if teacher.engine == "vllm":
        return VllmTeacher(teacher_path, dtype=teacher.dtype, usable_vocab=usable_vocab)
    return JaxTeacher.from_pretrained(teacher_path, dtype=teacher.dtype, mesh=mesh, temperature=teacher.temperature,
                                      usable_vocab=usable_vocab)


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


def sampling_params(cfg: TrainConfig, student_cfg: ModelConfig, *, temperature: float | None = None
                    ) -> SamplingParams:
    """`rollout.*` sampling settings; `temperature` overrides rollout.temperature. A completion stops at any of the
    student's stop ids (`student_cfg.eos_token_ids`: config.json, generation_config.json and, after
    `ModelConfig.with_tokenizer`, the tokenizer's EOS) and of `rollout.stop_token_ids`."""
    rollout = cfg.rollout
    stops = tuple(dict.fromkeys((*student_cfg.eos_token_ids, *map(int, rollout.stop_token_ids))))
    bad = [t for t in stops if not 0 <= t < student_cfg.usable_size]
    if bad:
        raise ConfigError(f"stop token id {bad[0]} (rollout.stop_token_ids or the student's eos_token_id) is outside "
                          f"the student's vocabulary [0, {student_cfg.usable_size})")
    return SamplingParams(max_new_tokens=rollout.max_new_tokens,
                          temperature=rollout.temperature if temperature is None else temperature,
                          top_k=rollout.top_k, top_p=rollout.top_p, stop_token_ids=stops)
