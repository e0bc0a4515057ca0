"""Sampling: `generate` returns tokens, log-probs, per-token entropies and truncation flags."""

from r3jax.sampling.rollout import Rollout
from r3jax.sampling.sampler import SamplingConfig, SamplingState, generate

__all__ = ["Rollout", "SamplingConfig", "SamplingState", "generate"]
