"""Triton kernels of ckpt_ext, installed as the subpackage ``ckpt_ext.kernels``.

Kernels and their launchers only: no autograd and no tests live here. The launchers have
the signatures of the ``torch.ops.ckpt_ext`` kernel ops and are registered as their CUDA
implementation (and CPU one under the backend setting "triton") by ``ckpt_ext._backend``.
Their settings (autotuning, kernel variants) come from ``ckpt_ext.config``.
Importing this package does not import triton; the kernel modules do.
"""


def autotune_enabled() -> bool:
    """Whether the GPU launchers autotune (the default) or launch one fixed configuration:
    the ``autotune`` setting of ``ckpt_ext.config`` (``CKPT_EXT_AUTOTUNE``).

    Off, the launchers launch the first candidate that fits the device, with no timing runs.
    The test suite turns it off on a GPU, where correctness does not depend on tile sizes and
    tuning every shape it tries would cost minutes of compilation.
    """
    # Imported here: the folder is also found as a top-level ``kernels`` from the repository
    # root (transformers probes for PyPI's ``kernels`` package), where a module-level relative
    # import would fail the probe's import.
    from ..config import current
    return current().autotune
