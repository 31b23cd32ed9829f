"""Counting what a step does, not timing it: the aten ops one call runs, with the FLOPs of
its matrix products and the bytes its other ops read and write, from ``torch.profiler``'s
recorded input shapes and dtypes (``record_shapes=True``). For a CPU with no GPU to time on.

* **Which ops count.** The innermost ops that do work: a matrix product (``mm``, ``addmm``,
  ``bmm``, ``baddbmm``) counts whole (its children are not looked at); any other op counts
  when none of its descendants does work, so ``aten::to`` is counted through its
  ``aten::copy_``, ``aten::linear`` through its ``aten::addmm``; views, allocations and
  no-ops (``view``, ``t``, ``empty``, ``resolve_conj``, ...) count nothing.
* **Triton kernels** launched under the interpreter (``TRITON_INTERPRET=1``) are recorded by
  ``triton_launches()``, each as ``triton::<kernel>`` with the bytes of its distinct tensor
  arguments (each read or written once: a lower bound for tiled GEMMs); the FLOPs of the
  ``tl.dot`` inside them are not counted.
* **FLOPs** of a product: ``2 M N K`` (batched: times the batch). **Bytes**: an op's tensor
  inputs read, plus its output written: for an in-place op (name ending in ``_``) its first
  input; for ``copy_`` the destination (its read is the source alone); ``fill_`` / ``zero_``
  only write; a reduction's output is not counted (small); any other op writes the broadcast
  shape of its tensor inputs in the first input's dtype. Products also get their operand and
  result bytes (a rank-r product is bound by them, not by its FLOPs).
"""
from __future__ import annotations

import collections
import contextlib
import math

import torch

# ops that move no data (views, allocations, bookkeeping)
_FREE = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::reshape",
    "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::permute", "aten::expand",
    "aten::as_strided", "aten::narrow", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::alias", "aten::detach", "detach", "aten::resolve_conj",
    "aten::resolve_neg", "aten::lift_fresh", "aten::unflatten", "aten::flatten",
    "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::view_as",
    "aten::expand_as", "aten::result_type", "aten::item", "aten::_local_scalar_dense",
    "aten::is_nonzero", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::set_",
    "aten::_unsafe_view", "aten::dropout", "aten::movedim", "aten::swapaxes", "aten::diagonal",
    "aten::new_empty", "aten::new_empty_strided", "aten::_has_compatible_shallow_copy_type",
    "aten::lift", "aten::zeros", "aten::zeros_like", "aten::ones_like", "aten::full",
    "aten::new_zeros", "aten::new_full", "aten::clone", "aten::matmul", "aten::linear",
    "aten::numpy_T", "aten::align_to", "aten::_unsafe_split",
}
_MATMUL = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
           "aten::baddbmm_", "aten::_addmm_activation"}
_REDUCE = {"aten::sum", "aten::mean", "aten::amax", "aten::max", "aten::min", "aten::amin",
           "aten::norm", "aten::linalg_vector_norm", "aten::var", "aten::std", "aten::argmax",
           "aten::logsumexp", "aten::any", "aten::all", "aten::prod"}
_WRITE_ONLY = {"aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_",
               "aten::random_", "aten::bernoulli_"}
_SIZES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
          "long": 8, "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short": 2,
          "c10::complex<float>": 8}

Counted = collections.namedtuple("Counted", "count flops bytes")


def _tensors(ev):
    """(shape, element bytes) of an event's tensor inputs; 0-d tensors (wrapped scalars) are
    left out, so that an op is counted even where it copies a scalar into a tensor first."""
    out = []
    for shape, dt in zip(ev.input_shapes or [], ev.input_dtypes or []):
        if (dt in _SIZES and isinstance(shape, list) and shape
                and all(isinstance(d, int) for d in shape)):
            out.append((shape, _SIZES[dt]))
    return out


def _nbytes(shape, size):
    return math.prod(shape) * size


def _broadcast(shapes):
    try:
        return list(torch.broadcast_shapes(*[tuple(s) for s in shapes]))
    except RuntimeError:
        return max(shapes, key=math.prod)


def _matmul(ev):
    """(FLOPs, operand + result bytes) of a product event."""
    ts = _tensors(ev)
    if ev.name in ("aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_",
                   "aten::_addmm_activation"):
        c, a, b = ts[:3]
    else:
        (a, b), c = ts[:2], None
    (sa, ea), (sb, _) = a, b
    batch = math.prod(sa[:-2])
    m, k, n = sa[-2], sa[-1], sb[-1]
    out = batch * m * n * ea
    moved = _nbytes(*a) + _nbytes(*b) + out + (_nbytes(*c) if c is not None else 0)
    return 2 * batch * m * n * k, moved


def _bytes(ev):
    ts = _tensors(ev)
    if not ts:
        return 0
    name = ev.name
    if name in _WRITE_ONLY:
        return _nbytes(*ts[0])
    if name == "aten::copy_":
        return _nbytes(*ts[0]) + (_nbytes(*ts[1]) if len(ts) > 1 else 0)
    read = sum(_nbytes(*t) for t in ts)
    if name in _REDUCE:
        return read
    if name.endswith("_"):
        return read + _nbytes(*ts[0])
    return read + _nbytes(_broadcast([s for s, _ in ts]), ts[0][1])


class _Launches:
    """The Triton kernels launched under the interpreter while recording: name and bytes."""

    def __init__(self):
        self.recording = False
        self.bytes = []


_launches = _Launches()


@contextlib.contextmanager
def triton_launches():
    """Within this block, each Triton kernel launched under the interpreter runs inside a
    ``record_function("triton::<kernel>")`` and its distinct tensor arguments' bytes are
    noted (in launch order), for ``count_ops``. A no-op without Triton's interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        yield
        return
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        seen, moved = set(), 0
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.data_ptr() not in seen and a.numel() > 1:
                seen.add(a.data_ptr())
                moved += a.numel() * a.element_size()
        name = getattr(getattr(self, "fn", None), "__name__", "kernel")
        _launches.bytes.append(moved)
        with torch.profiler.record_function(f"triton::{name}"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield
    finally:
        InterpretedFunction.run = run


def count_ops(prof) -> dict:
    """op name -> Counted(count, FLOPs, bytes) of a profile's counted ops (module doc);
    products also under ``<name> (operands)`` for their bytes, Triton kernels as
    ``triton::<kernel>`` with their tensor arguments' bytes."""
    events = prof.events()
    triton_bytes = iter(_launches.bytes)
    _launches.bytes = []
    out = collections.defaultdict(lambda: [0, 0, 0])

    def add(name, flops, moved):
        r = out[name]
        r[0] += 1
        r[1] += flops
        r[2] += moved

    def works(ev):
        """Whether ev or a descendant is counted (memoised)."""
        if ev.id in memo:
            return memo[ev.id]
        kids = [works(c) for c in ev.cpu_children]   # every child memoised
        if ev.name in _MATMUL or ev.name.startswith("triton::") or any(kids):
            v = True
        else:
            v = (ev.name.startswith("aten::") or ev.name.startswith("ckpt_ext::")) and (
                ev.name not in _FREE) and _bytes(ev) > 0
        memo[ev.id] = v
        return v

    memo = {}
    triton_events = sorted((e for e in events if e.name.startswith("triton::")),
                           key=lambda e: e.time_range.start)
    triton_of = {e.id: next(triton_bytes, 0) for e in triton_events}

    def walk(ev):
        if ev.name.startswith("triton::"):
            add(ev.name, 0, triton_of.get(ev.id, 0))
            return
        if ev.name in _MATMUL:
            flops, moved = _matmul(ev)
            add(ev.name, flops, moved)
            return
        kids = [c for c in ev.cpu_children if works(c)]
        if kids:
            for c in kids:
                walk(c)
        elif works(ev):
            add(ev.name, 0, _bytes(ev))

    for ev in events:
        if ev.cpu_parent is None:
            walk(ev)
    return {k: Counted(*v) for k, v in out.items()}


def totals(counts: dict) -> Counted:
    return Counted(sum(c.count for c in counts.values()), sum(c.flops for c in counts.values()),
                   sum(c.bytes for c in counts.values()))


def difference(a: dict, b: dict) -> dict:
    """op name -> Counted(a - b), ops whose count, FLOPs or bytes differ."""
    out = {}
    for k in sorted(set(a) | set(b)):
        ca, cb = a.get(k, Counted(0, 0, 0)), b.get(k, Counted(0, 0, 0))
        d = Counted(ca.count - cb.count, ca.flops - cb.flops, ca.bytes - cb.bytes)
        if any(d):
            out[k] = d
    return out
