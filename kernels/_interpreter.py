"""A check that Triton's CPU interpreter works with the numpy installed beside it.

Triton 3.6's interpreter turns a scalar kernel argument used as a ``range`` bound into a Python
int with ``int(array_of_shape_1)``, which numpy 2.4 and later refuse ("only 0-dimensional arrays
can be converted to Python scalars"); triton 3.9 does not. Every kernel here loops over such a
bound, so on that pairing every CPU Triton launch would fail deep inside the interpreter. The
CPU launchers run :func:`check_interpreter` once and raise a message that says what to change.

The check is thread-safe: the probe runs under a lock (the interpreter patches ``triton.language``
while a kernel runs, so two probes at once can break each other), and only a verdict about the
interpreter itself is remembered: success, a wrong probe result, or the numpy incompatibility
above. Any other failure (an error raised by something else while the probe ran) is reported
for that call only, and the next call probes again.
"""
from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

_LOCK = threading.Lock()
_UNSET = object()
_verdict = _UNSET  # the remembered answer of interpreter_problem(), or _UNSET


@triton.jit
def _probe_kernel(X, n):
    for i in range(0, n, 1):  # a runtime scalar as the loop bound, as in every kernel here
        tl.store(X + i, i)


def _numpy_incompatibility(exc: BaseException) -> bool:
    """Whether exc is the interpreter/numpy scalar-conversion failure described above."""
    text = str(exc)
    return isinstance(exc, (TypeError, ValueError)) and (
        "0-dimensional" in text or "converted to Python scalars" in text)


def _probe() -> tuple[str | None, bool]:
    """(problem or None, whether the answer is about the interpreter and may be remembered)."""
    x = torch.zeros(3, dtype=torch.int32)
    try:
        _probe_kernel[(1,)](x, 3)
    except Exception as exc:  # noqa: BLE001 - classified below
        if _numpy_incompatibility(exc):
            import numpy

            return (f"Triton {triton.__version__}'s CPU interpreter cannot run ckpt_ext's "
                    f"kernels with numpy {numpy.__version__} ({type(exc).__name__}: {exc}). "
                    f"Install numpy<2.4, or a Triton whose interpreter supports this numpy "
                    f"(3.9 does), or leave CKPT_EXT_BACKEND unset to use the ATen CPU "
                    f"kernels."), True
        return (f"Triton {triton.__version__}'s CPU interpreter failed its self-check "
                f"({type(exc).__name__}: {exc}); not remembered, the next Triton call on CPU "
                f"tensors checks again"), False
    if x.tolist() != [0, 1, 2]:
        return (f"Triton {triton.__version__}'s CPU interpreter ran a probe kernel wrongly: "
                f"{x.tolist()} instead of [0, 1, 2]"), True
    return None, True


def interpreter_problem() -> str | None:
    """None when the interpreter runs a kernel looping over a scalar argument, else why not."""
    global _verdict
    verdict = _verdict
    if verdict is not _UNSET:
        return verdict
    with _LOCK:
        if _verdict is _UNSET:
            problem, definitive = _probe()
            if not definitive:
                return problem
            _verdict = problem
        return _verdict


def _cache_clear() -> None:
    """Forget the remembered verdict (tests)."""
    global _verdict
    with _LOCK:
        _verdict = _UNSET


interpreter_problem.cache_clear = _cache_clear


def check_interpreter() -> None:
    """Raise RuntimeError when :func:`interpreter_problem` finds one."""
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(problem)
