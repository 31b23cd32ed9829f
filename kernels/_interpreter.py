"""A check that Triton's CPU interpreter works with the numpy installed beside it.

Triton 3.6's interpreter turns a scalar kernel argument used as a ``range`` bound into a Python
int with ``int(array_of_shape_1)``, which numpy 2.4 and later refuse ("only 0-dimensional arrays
can be converted to Python scalars"); triton 3.9 does not. Every kernel here loops over such a
bound, so on that pairing every CPU Triton launch would fail deep inside the interpreter. The
CPU launchers run :func:`check_interpreter` once and raise a message that says what to change.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(X, n):
    for i in range(0, n, 1):  # a runtime scalar as the loop bound, as in every kernel here
        tl.store(X + i, i)


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """None when the interpreter runs a kernel looping over a scalar argument, else why not."""
    x = torch.zeros(3, dtype=torch.int32)
    try:
        _probe_kernel[(1,)](x, 3)
    except Exception as exc:  # noqa: BLE001 - any failure here is the answer
        import numpy

        return (f"Triton {triton.__version__}'s CPU interpreter cannot run ckpt_ext's kernels "
                f"with numpy {numpy.__version__} ({type(exc).__name__}: {exc}). Install "
                f"numpy<2.4, or a Triton whose interpreter supports this numpy (3.9 does), or "
                f"leave CKPT_EXT_BACKEND unset to use the ATen CPU kernels.")
    if x.tolist() != [0, 1, 2]:
        return f"Triton {triton.__version__}'s CPU interpreter ran a probe kernel wrongly: {x}"
    return None


def check_interpreter() -> None:
    """Raise RuntimeError when :func:`interpreter_problem` finds one."""
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(problem)
