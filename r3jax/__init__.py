"""r3jax: R³ reinforcement learning for reasoning LLMs in pure JAX."""

import logging as _logging

__version__ = "0.1.0"


class _TorchAbsentNotice(_logging.Filter):
    """transformers announces on import that PyTorch is absent. r3jax uses transformers for tokenizers only and
    never needs torch, so that line tells a user nothing they can act on; every other transformers message
    stays."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


# on the logger transformers' own __init__ writes to, before any r3jax module imports transformers
_logging.getLogger("transformers").addFilter(_TorchAbsentNotice())
