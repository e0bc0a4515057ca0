"""Answer checking and the R³ reward: `grade_batch(responses, answers, num_tokens=...)`."""

from r3jax.rewards.grade import REASONS, GradeResult, grade_batch, shared_pool
from r3jax.rewards.pool import GradingPool
from r3jax.rewards.reward import r3_reward

__all__ = ["REASONS", "GradeResult", "GradingPool", "grade_batch", "r3_reward", "shared_pool"]
