"""Rollout engines: the protocol, the batch they return, and the embedded JAX engine."""

from opdjax.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.rollout.perturb import EngineMismatch

__all__ = ["EngineMismatch", "JaxEngine", "RolloutBatch", "RolloutEngine", "SamplingParams"]
