"""The public OPD step, with explicit components and no config file: generate → score → batch → train → publish.

A loop of your own, given an engine, a teacher, a learner and a publisher (see `examples/own_opd_loop.py`)::

    parts = OPDParts(engine=engine, teacher=teacher, learner=learner, publisher=publisher, tokenizer=tokenizer,
                     sampling=SamplingParams(max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,)))
    state = learner.init(params)
    for step in range(steps):
        state, metrics = opd_step(parts, state, stream.next(batch_size), seed=step)

`opdjax train` runs exactly these functions (`pipeline.loop`): `build` turns a `TrainConfig` into the parts, and the
asynchronous mode calls `generate` on a worker thread and `train_on` + `publish` on the learner's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from opdjax.core.types import Batch
from opdjax.data.prompts import encode_prompts
from opdjax.data.tasks import Example, Task
from opdjax.learner import Learner, TrainState
from opdjax.learner.distributed import barrier, is_multiprocess
from opdjax.pipeline.phases import Phases
from opdjax.rollout import RolloutBatch, RolloutEngine, SamplingParams
from opdjax.sync import Publisher
from opdjax.teacher import Teacher

__all__ = ["OPDParts", "completion_texts", "generate", "learner_batch", "learner_temperature", "opd_step", "publish",
           "rewards", "rollout_seed", "train_on"]

TEACHER_NEEDS = frozenset({"teacher_logp", "teacher_topk", "teacher_logits"})


@dataclasses.dataclass
class OPDParts:
    """The components of one OPD run, each built by the user or by `pipeline.build`.

    engine              samples rollouts and receives published weights (`rollout.RolloutEngine`)
    teacher             scores the rollouts (`teacher.Teacher`; None for losses that need no teacher data)
    learner             the student's train step (`learner.Learner`); its loss says what the teacher must supply
    publisher           sends the learner's weights to the engine (`sync.Publisher`; `sync.engine_publisher`)
    tokenizer           encodes prompts, decodes completions for grading (a transformers tokenizer)
    sampling            how the engine samples (`rollout.SamplingParams`); the learner trains at its temperature
    samples_per_prompt  completions sampled per prompt (rows of one prompt are adjacent)
    teacher_top_k       k of the teacher's top-k for losses that need it (`teacher.top_k`)
    task                grades completions for losses that need a reward (`data.tasks.Task`)
    """

    engine: RolloutEngine
    teacher: Teacher | None
    learner: Learner
    publisher: Publisher
    tokenizer: Any
    sampling: SamplingParams
    samples_per_prompt: int = 1
    teacher_top_k: int = 16
    task: Task | None = None


def rollout_seed(run_seed: int, step: int) -> int:
    """The sampling seed of step `step` of a run seeded `run_seed` (`opdjax train`'s schedule: reuse it to reproduce
    a run's rollouts)."""
    return run_seed * 100_003 + step * 7919


def learner_temperature(sampling: SamplingParams) -> float:
    """The temperature the learner scores rollouts at: the sampling temperature, or 1 for greedy rollouts (whose
    reported log-probs are at T = 1, `SamplingParams`)."""
    return float(sampling.temperature) if sampling.temperature > 0 else 1.0


def generate(engine: RolloutEngine, tokenizer, examples: Sequence[Example], sampling: SamplingParams, *, seed: int,
             samples_per_prompt: int = 1) -> RolloutBatch:
    """`samples_per_prompt` completions of each example's prompt; `prompt_index_B` maps each row to its example."""
    prompts = encode_prompts(tokenizer, examples)
    rep = [p for p in prompts for _ in range(samples_per_prompt)]
    batch = engine.generate(rep, sampling, seed=seed)
    batch.prompt_index_B = np.repeat(np.arange(len(prompts)), samples_per_prompt)[batch.prompt_index_B]
    return batch


def completion_texts(tokenizer, batch: RolloutBatch, stop_token_ids: Sequence[int] = ()) -> list[str]:
    """Completion text of each row, cut at its first stop token (the tokenizer's EOS or any of `stop_token_ids`;
    the stop token is not part of the answer)."""
    stops = {tokenizer.eos_token_id, *stop_token_ids}
    out = []
    for ids in batch.completions():
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        out.append(tokenizer.decode(ids[:end], skip_special_tokens=True))
    return out


def rewards(task: Task, tokenizer, examples: Sequence[Example], batch: RolloutBatch,
            stop_token_ids: Sequence[int] = ()) -> np.ndarray:
    """Task reward of each row, reward_B (0 for ungraded examples); completions cut at their first stop token."""
    texts = completion_texts(tokenizer, batch, stop_token_ids)
    r = [task.grade(examples[i], t) for i, t in zip(batch.prompt_index_B, texts)]
    return np.asarray([0.0 if x is None else x for x in r], np.float32)


def learner_batch(batch: RolloutBatch, *, needs: frozenset[str], teacher: Teacher | None = None,
                  teacher_top_k: int = 16, reward_B: np.ndarray | None = None) -> Batch:
    """The learner's `Batch`: the rollout (completion mask → mask_BT, the engine's log-probs) plus the teacher data a
    loss `needs` (`Learner.needs`), and the rewards when it needs them."""
    teacher_needs = needs & TEACHER_NEEDS
    scores = {}
    if teacher_needs:
        if teacher is None:
            raise ValueError(f"learner_batch: the loss needs {sorted(teacher_needs)} but no teacher was given")
        scores = teacher.score(batch.tokens_BT, batch.valid_BT, teacher_needs, top_k=teacher_top_k).present()
    if "reward" in needs and reward_B is None:
        raise ValueError("learner_batch: the loss needs rewards (reward_B); grade the rollouts with `rewards`")
    return Batch(tokens_BT=batch.tokens_BT, valid_BT=batch.valid_BT, mask_BT=batch.completion_mask_BT,
                 rollout_logp_BT=batch.rollout_logp_BT.astype(np.float32), **scores,
                 reward_B=reward_B if "reward" in needs else None)


def train_on(parts: OPDParts, state: TrainState, batch: RolloutBatch, examples: Sequence[Example]
             ) -> tuple[TrainState, dict[str, float]]:
    """Score `batch` with the teacher (and the task, for rewards), then one learner step at the sampling
    temperature. Returns the new state and the learner's metrics plus `time/score`, `time/train`, `completion_len`."""
    phases = Phases()
    with phases.time("score"):
        needs = parts.learner.needs
        reward_B = None
        if "reward" in needs:
            if parts.task is None:
                raise ValueError(f"train_on: the loss {parts.learner.loss_name!r} needs rewards: give OPDParts a task")
            reward_B = rewards(parts.task, parts.tokenizer, examples, batch, parts.sampling.stop_token_ids)
        lb = learner_batch(batch, needs=needs, teacher=parts.teacher, teacher_top_k=parts.teacher_top_k,
                           reward_B=reward_B)
    with phases.time("train"):
        state, m = parts.learner.train_step(state, lb, temperature=learner_temperature(parts.sampling))
    m.update({**phases.seconds, "completion_len": float(batch.completion_mask_BT.sum(1).mean())})
    return state, m


def publish(parts: OPDParts, params, version: int) -> None:
    """Send the learner's weights to the engine as `version` (HF names and layout, the engine's dtype; sharded
    params gathered); returns once the engine has applied it. Versions only go forward (a server bound to the run
    restarts its order for each new session: a resumed run's first publish may be older than what the server held).
    Several learner processes with one remote engine: process 0 sends, and the others wait for it before they
    sample again."""
    parts.publisher.publish(params, version)
    if is_multiprocess() and not parts.publisher.every_process:
        barrier(f"opdjax-publish-v{version}")
        parts.engine.mark_published(version)


def opd_step(parts: OPDParts, state: TrainState, examples: Sequence[Example], *, seed: int
             ) -> tuple[TrainState, dict[str, float]]:
    """One synchronous OPD step: generate with the served weights, score, train, publish the new weights as version
    `state.step` (= optimizer steps taken). Returns the new state and its metrics (`time/*` included)."""
    phases = Phases()
    with phases.time("generate"):
        batch = generate(parts.engine, parts.tokenizer, examples, parts.sampling, seed=seed,
                         samples_per_prompt=parts.samples_per_prompt)
    state, m = train_on(parts, state, batch, examples)
    with phases.time("publish"):
        publish(parts, state.params, int(state.step))
    m.update(phases.seconds)
    return state, m
