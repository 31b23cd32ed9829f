"""Triton kernels of ckpt_ext, installed as the subpackage ``ckpt_ext.kernels``.

Kernels and their launchers only: no autograd and no tests live here. The launchers have
the signatures of the ``torch.ops.ckpt_ext`` kernel ops and are registered as their CUDA
implementation (and CPU one under ``CKPT_EXT_BACKEND=triton``) by ``ckpt_ext._backend``.
Importing this package does not import triton; the kernel modules do.
"""
