"""r3jax: R³ reinforcement learning for reasoning LLMs in pure JAX."""

__version__ = "0.1.0"
