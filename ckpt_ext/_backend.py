"""Which implementation serves each kernel op on each device.

* CPU: the ATen reference kernels of ``csrc/*_cpu.cpp`` (always built).
* CUDA: the Triton launchers of ``ckpt_ext.kernels`` for attention and SwiGLU, registered here
  through ``torch.library`` when torch has CUDA (attention through ``ckpt_ext.attention_route``,
  which may hand a call to one of torch's SDPA aten ops instead); the CUDA C++ row-wise
  kernels (RMSNorm, RoPE) of ``csrc/cuda`` in a CUDA build, or the plain-PyTorch ones of
  ``ckpt_ext.plain`` registered here when the extension was built without CUDA.
* The ``backend`` setting ``"triton"`` (``CKPT_EXT_BACKEND=triton`` or
  ``ckpt_ext.config.patch(backend="triton")``, with ``TRITON_INTERPRET=1``) also puts the Triton
  launchers on CPU tensors, so the whole fused path runs through Triton in CPU tests;
  ``use_triton("cpu")`` (public as ``ckpt_ext.use_triton``) does the same for a ``with`` block.

Triton is imported on the first call of a launcher, not at ``import ckpt_ext``.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, Iterator

import torch

from . import _C, config, plain
from ._checks import _rope_out_like

__all__ = ["register_from_environment", "use_triton", "register_triton"]

TRITON_OPS = ("attention_fwd", "attention_bwd", "swiglu_fwd", "swiglu_bwd", "lora_dropout",
              "linear_cross_entropy_fwd", "linear_cross_entropy_bwd")

_persistent: list = []  # libraries that live as long as the process


def _triton_launchers() -> dict:
    """op name -> its Triton launcher. Imports triton (the kernel modules do), so it runs on the
    first launch, not at ``import ckpt_ext``."""
    from .kernels import attention, dropout, linear_cross_entropy, swiglu_mlp
    return {"attention_fwd": attention.attention_fwd, "attention_bwd": attention.attention_bwd,
            "swiglu_fwd": swiglu_mlp.swiglu_fwd, "swiglu_bwd": swiglu_mlp.swiglu_bwd,
            "lora_dropout": dropout.lora_dropout,
            "linear_cross_entropy_fwd": linear_cross_entropy.linear_cross_entropy_fwd,
            "linear_cross_entropy_bwd": linear_cross_entropy.linear_cross_entropy_bwd}


def _lazy(op: str, interpreter: bool = False) -> Callable:
    """The Triton launcher of ``op``, looked up on its first call; for CPU tensors
    (``interpreter``) that first call also checks that Triton's interpreter works."""
    fn = None

    def launcher(*args):
        nonlocal fn
        if fn is None:
            if interpreter:
                from .kernels._interpreter import check_interpreter
                check_interpreter()
            fn = _triton_launchers()[op]
        return fn(*args)

    launcher.__name__ = op
    return launcher


def _cuda_impl(op: str) -> Callable:
    """The CUDA implementation of ``op``: its Triton launcher, except attention, whose calls
    go through ``ckpt_ext.attention_route`` (the Triton launcher, or an SDPA aten op where the
    ``attention_backend`` setting and its choice table say so)."""
    if op in ("attention_fwd", "attention_bwd"):
        from . import attention_route
        return getattr(attention_route, op)
    return _lazy(op)


def register_triton(device_type: str) -> torch.library.Library:
    """Register the Triton launchers for ``device_type`` ("cuda", or "cpu" under the Triton
    interpreter). Returns the ``torch.library.Library`` holding the registrations; they last
    as long as it does."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"register_triton: device_type must be 'cuda' or 'cpu', got "
                         f"{device_type!r}")
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is imported (CKPT_EXT_BACKEND=triton requires it)")
    lib = torch.library.Library("ckpt_ext", "IMPL")
    with warnings.catch_warnings():
        # On CPU the launchers replace the ATen kernels on purpose; torch warns about that.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for op in TRITON_OPS:
            lib.impl(op, _cuda_impl(op) if device_type == "cuda" else _lazy(op, True),
                     device_type.upper())
    return lib


@contextlib.contextmanager
def use_triton(device_type: str = "cpu") -> Iterator[None]:
    """Within the block, the Triton launchers implement the kernel ops on ``device_type``;
    afterwards the previous implementations are back."""
    lib = register_triton(device_type)
    try:
        yield
    finally:
        lib._destroy()


# ---- plain-PyTorch row-wise ops for CUDA tensors in a build without CUDA kernels -----------

def _add_rms_norm_fwd(x, residual, weight, eps):
    s = x + residual
    return plain.rms_norm(s, weight, eps), s


def _rope(q, k, cos, sin, sign):
    """rope_fwd (sign 1) or rope_bwd (sign -1) in fp32 (fp64 stays), into the layout every
    rope implementation returns."""
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()

    def one(t):
        tf = t.float() if t.dtype != torch.float64 else t
        if sign > 0:
            r = tf * c + plain.rotate_half(tf) * s
        else:
            r = tf * c - plain.rotate_half(tf * s)   # rotate_half^T(y) = -rotate_half(y)
        return _rope_out_like(t).copy_(r)
    return one(q), one(k)


def _register_rowwise_fallback() -> None:
    lib = torch.library.Library("ckpt_ext", "IMPL")
    lib.impl("rms_norm_fwd", plain.rms_norm, "CUDA")
    lib.impl("rms_norm_bwd", plain.rms_norm_bwd, "CUDA")
    lib.impl("add_rms_norm_fwd", _add_rms_norm_fwd, "CUDA")
    lib.impl("rope_fwd", lambda q, k, cos, sin: _rope(q, k, cos, sin, 1), "CUDA")
    lib.impl("rope_bwd", lambda dq, dk, cos, sin: _rope(dq, dk, cos, sin, -1), "CUDA")
    _persistent.append(lib)


_cpu_triton: list = []  # the registration of the backend setting "triton", while it holds


def _follow_backend(old: config.KernelConfig, new: config.KernelConfig) -> None:
    """Register the Triton launchers for CPU tensors when the ``backend`` setting becomes
    "triton", remove that registration when it goes back to "auto"."""
    if new.backend == old.backend:
        return
    if new.backend == "triton":
        _cpu_triton.append(register_triton("cpu"))
    else:
        while _cpu_triton:
            _cpu_triton.pop()._destroy()


def _follow_chunk_bytes(old: config.KernelConfig, new: config.KernelConfig) -> None:
    """Hand the ``chunk_bytes`` setting to the C++ kernels (csrc/chunking.h)."""
    if new.chunk_bytes != old.chunk_bytes:
        _C.set_chunk_bytes(new.chunk_bytes)


def register_from_environment() -> None:
    """Called once by ``import ckpt_ext``: the CUDA registrations, the Triton launchers
    for CPU tensors while the ``backend`` setting (read from the environment here, with the
    other kernel settings) is "triton", and the chunk cap handed to the C++ kernels."""
    settings = config.current()
    _C.set_chunk_bytes(settings.chunk_bytes)
    config.on_change(_follow_chunk_bytes)
    backend = settings.backend
    if torch.version.cuda is not None:  # torch built with CUDA; no device is queried
        _persistent.append(register_triton("cuda"))
        if not _C.with_cuda:
            _register_rowwise_fallback()
    if backend == "triton":
        _cpu_triton.append(register_triton("cpu"))
    config.on_change(_follow_backend)
