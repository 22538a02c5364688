"""Where the learner's rollouts come from: one source for both modes, `next(step)` -> the rollout step `step` trains on.

Synchronous (`RolloutSource`): sampled on demand, with the weights the learner just published. Asynchronous
(`AheadSource`): the same sampler on a background thread fills a bounded queue ahead with whatever weights the engine
serves. Either way `next` says how stale the rollout is (learner step minus the oldest weight version that sampled
it, one figure on every learner process) and whether it is dropped: only an ahead source drops, a rollout more than
`max_staleness` versions old.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import jax

from opdjax.data.prompts import PromptStream
from opdjax.learner.distributed import agree, row_share
from opdjax.pipeline.opd import OPDParts, generate, rollout_seed
from opdjax.pipeline.phases import Phases
from opdjax.rollout import RolloutBatch

__all__ = ["AheadSource", "Rollout", "RolloutSource", "sample"]


@dataclasses.dataclass
class Rollout:
    """One rollout batch, as the learner receives it."""

    batch: RolloutBatch
    examples: list              # this process's share of the batch's prompts
    stream_end: int             # prompt-stream position after its prompts (what a checkpoint records)
    seconds: dict[str, float]   # time/generate
    staleness: int = 0          # learner step - oldest weight version that sampled it (set by `next`)
    dropped: bool = False       # too stale to train on (set by `next`)


def sample(parts: OPDParts, stream: PromptStream, batch_size: int, seed: int) -> Rollout:
    """The next `batch_size` prompts of the stream (the same stream on every learner process), this process's share
    sampled with `seed` (offset per process)."""
    examples = stream.next(batch_size)
    a, b = row_share(len(examples))
    phases = Phases()
    with phases.time("generate"):
        batch = generate(parts.engine, parts.tokenizer, examples[a:b], parts.sampling,
                         seed=seed + 1_000_003 * jax.process_index(), samples_per_prompt=parts.samples_per_prompt)
    return Rollout(batch, examples[a:b], stream.position, phases.seconds)


class RolloutSource:
    """Rollouts sampled on demand: `next(step)` samples now, seeded `rollout_seed(run_seed, step)`, and never drops
    (the weights just published sampled it; an engine that serves older ones on purpose is what is measured)."""

    max_staleness: int | None = None

    def __init__(self, parts: OPDParts, stream: PromptStream, *, batch_size: int, run_seed: int):
        self.parts, self.stream, self.batch_size, self.run_seed = parts, stream, batch_size, run_seed

    def next(self, step: int) -> Rollout:
        """The rollout learner step `step` trains on, its staleness agreed by every process (a collective: every
        process calls it once per step) and `dropped` set when it exceeds `max_staleness`."""
        item = self._take(step)
        item.staleness = agree(step - int(item.batch.version_B.min()))
        item.dropped = self.max_staleness is not None and item.staleness > self.max_staleness
        return item

    def _take(self, step: int) -> Rollout:
        return sample(self.parts, self.stream, self.batch_size, rollout_seed(self.run_seed, step))

    def close(self) -> None:
        """Nothing to release when sampling on demand."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AheadSource(RolloutSource):
    """Rollouts sampled ahead: a worker thread samples with whatever weights the engine serves (seeds
    `rollout_seed(run_seed, first_step)`, +1, +2, ...) and `next` takes the oldest. At most `queue_size` rollouts are
    ahead of the learner, the one being sampled included: the worker takes a slot before it starts a sample and
    `next` frees it. A learner that publishes every step therefore trains on rollouts at most `queue_size` versions
    old (queue_size = max_staleness drops none; sampling first and waiting for room after would add one more
    version). A worker that fails raises its error on the learner's thread at the next `next`; `close` stops and
    joins the worker."""

    def __init__(self, parts: OPDParts, stream: PromptStream, *, batch_size: int, run_seed: int, first_step: int,
                 queue_size: int, max_staleness: int):
        super().__init__(parts, stream, batch_size=batch_size, run_seed=run_seed)
        self.max_staleness = max_staleness
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(queue_size)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._fill, args=(rollout_seed(run_seed, first_step),), daemon=True,
                                        name="opdjax-rollout")
        self._worker.start()

    def _fill(self, seed: int) -> None:
        """The worker: take a slot (wait while `queue_size` rollouts are ahead), sample, queue it, repeat until
        stopped; an error is kept for `next`."""
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=0.1):
                    continue
                self._queue.put(sample(self.parts, self.stream, self.batch_size, seed))
                seed += 1
        except BaseException as e:  # surfaced to the learner thread
            self._error = e

    def _take(self, step: int) -> Rollout:
        while True:
            if self._error is not None:
                raise RuntimeError("rollout worker failed") from self._error
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._worker.is_alive() and self._error is None:
                    raise RuntimeError("rollout worker stopped unexpectedly")
                continue
            self._slots.release()  # the learner has it: the worker may start the next sample
            return item

    def close(self) -> None:
        """Stop the worker and wait for it (up to 30 s: a sample in flight finishes first)."""
        self._stop.set()
        self._worker.join(timeout=30)
