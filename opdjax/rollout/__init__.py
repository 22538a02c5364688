"""Rollout engines: the protocol, the batch they return, and the embedded JAX engine."""

from opdjax.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams"]
