"""Triton kernels of ckpt_ext, installed as the subpackage ``ckpt_ext.kernels``.

Kernels and their launchers only: no autograd and no tests live here. The launchers have
the signatures of the ``torch.ops.ckpt_ext`` kernel ops and are registered as their CUDA
implementation (and CPU one under ``CKPT_EXT_BACKEND=triton``) by ``ckpt_ext._backend``.
Importing this package does not import triton; the kernel modules do.
"""
import os as _os


def autotune_enabled() -> bool:
    """Whether the GPU launchers autotune (the default) or launch one fixed configuration.

    ``CKPT_EXT_AUTOTUNE=0`` picks the fixed configuration: the first candidate that fits the
    device, with no timing runs. The test suite sets it on a GPU, where correctness does not
    depend on tile sizes and tuning every shape it tries would cost minutes of compilation.
    Read once by the launch policy (``kernels/_launch.py``) when the kernel modules are
    imported, that is at the first Triton launch; ``_launch.reload_policy()`` reads it again.
    """
    value = _os.environ.get("CKPT_EXT_AUTOTUNE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"CKPT_EXT_AUTOTUNE must be '0' or '1', got {value!r}")
    return value == "1"
