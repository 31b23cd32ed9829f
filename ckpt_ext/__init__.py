"""ckpt_ext: activation recompute for training LLaMA-style transformers.

Public API:
    checkpoint(fn, *args, preserve_rng_state=True, **kwargs)
    saved_activation_bytes(fn, *args, **kwargs)
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the ckpt_ext operators)
from .checkpoint import checkpoint
from .memory import saved_activation_bytes

__all__ = ["checkpoint", "saved_activation_bytes"]
__version__ = "0.1.0"
