"""``ckpt_ext.checkpoint``: activation checkpointing of any callable, backed by a C++ Function.

The C++ side (``csrc/checkpoint.cpp``) snapshots RNG and autocast state, runs the segment once,
finds every tensor from outside the arguments that the segment differentiates through
(module parameters, closure tensors, earlier non-leaf tensors), saves only the argument
tensors, and re-runs the segment in backward. It behaves like
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: backward under ``create_graph=True``
gives gradients that are themselves differentiable (double backward, ``gradgradcheck``, nested
segments); tensor hooks and post-accumulate-grad hooks of the inputs and parameters fire once
per backward, as without checkpointing; and a recomputation that differs from the forward
raises ``torch.utils.checkpoint.CheckpointError``.

This module only maps arbitrary Python arguments and results (pytrees with non-tensor leaves)
to flat tensor lists and back, and installs the forward's saved-tensor hooks, which drop every
tensor an op saves.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from torch.utils.checkpoint import CheckpointError

from . import _C

__all__ = ["checkpoint"]

_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks

def _drop_saved(_tensor: torch.Tensor) -> None:
    return None


def _refuse_unpack(_packed: Any) -> torch.Tensor:
    raise RuntimeError(
        "ckpt_ext.checkpoint: the segment tried to use a tensor saved during its forward pass "
        "before the pass ended (for example torch.autograd.grad inside the segment); this is "
        "not supported inside ckpt_ext.checkpoint")


class _Segment:
    """The segment's callable with its arguments flattened; called by C++ with new tensors."""

    __slots__ = ("fn", "flat", "spec", "tensor_pos", "inputs", "out_spec", "out_flat",
                 "out_tensor_pos")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn = fn
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            self.flat, self.spec = list(args), None  # fast path: positional tensors only
            self.tensor_pos = range(len(args))
        else:
            self.flat, self.spec = tree_flatten((args, kwargs))
            self.tensor_pos = [i for i, a in enumerate(self.flat) if isinstance(a, torch.Tensor)]
        # The argument tensors travel through C++ (saved for backward there); the flat list
        # keeps only the non-tensor leaves so nothing here holds them a second time.
        self.inputs = [self.flat[i] for i in self.tensor_pos]
        for i in self.tensor_pos:
            self.flat[i] = None
        self.out_spec = None

    def __call__(self, tensors: list, recompute: bool) -> list:
        flat = list(self.flat)
        for pos, t in zip(self.tensor_pos, tensors):
            flat[pos] = t
        if self.spec is None:
            args, kwargs = flat, {}
        else:
            args, kwargs = tree_unflatten(flat, self.spec)
        if recompute:
            out = self.fn(*args, **kwargs)
        else:
            versions = [_version(t) for t in tensors]
            # torch.autograd.graph.saved_tensors_hooks without the context-manager object:
            # this runs once per checkpointed call, so its cost is the per-call overhead.
            _push_hooks(_drop_saved, _refuse_unpack)
            try:
                out = self.fn(*args, **kwargs)
            finally:
                _pop_hooks()
        flat_out = self._flatten_output(out, recompute)
        if not recompute:
            self._check_unchanged(tensors, versions, flat_out)
        return flat_out

    def _check_unchanged(self, tensors: list, versions: list, outputs: list) -> None:
        """Refuse a forward that changed an argument tensor in place: backward would re-run
        the segment on the changed value (wrong gradients). A changed argument that needs no
        gradient is harmless when no output requires grad (nothing is recomputed)."""
        outputs_need_grad = any(o.requires_grad for o in outputs)
        for k, (t, before) in enumerate(zip(tensors, versions)):
            if before is None or _version(t) == before:
                continue
            if not (outputs_need_grad or t.requires_grad):
                continue
            raise RuntimeError(
                f"ckpt_ext.checkpoint: the segment changed its {self._describe(k)} "
                f"({str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                f"{', which requires grad' if t.requires_grad else ''}) in place. A segment "
                "must not modify its inputs in place: backward re-runs it on its inputs as they "
                "are then, so the change would be applied twice and the gradients would be "
                "wrong. Clone the tensor inside the segment (t = t.clone()) or make the change "
                "before calling ckpt_ext.checkpoint")

    def _describe(self, k: int) -> str:
        """Where the k-th argument tensor sits in the call: 'argument 0', "keyword argument
        'mask'", 'argument 1[0]' ..."""
        if self.spec is None:
            return f"argument {self.tensor_pos[k]}"
        flat = list(self.flat)
        paths = [path for path, _ in tree_flatten_with_path(
            tree_unflatten([None] * len(flat), self.spec), is_leaf=lambda x: x is None)[0]]
        path = paths[self.tensor_pos[k]]
        rest = keystr(path[2:])
        if path[0].idx == 0:
            return f"argument {path[1].idx}{rest}"
        return f"keyword argument {path[1].key!r}{rest}"

    def _flatten_output(self, out: Any, recompute: bool) -> list:
        if isinstance(out, torch.Tensor):
            flat, spec = [out], None
        else:
            flat, spec = tree_flatten(out)
        tensor_pos = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)]
        if not recompute:
            self.out_spec, self.out_flat, self.out_tensor_pos = spec, flat, tensor_pos
        elif spec != self.out_spec or tensor_pos != self.out_tensor_pos:
            raise CheckpointError(_not_deterministic(
                f"returned a different output structure than forward ({spec} vs "
                f"{self.out_spec})"))
        return [flat[i] for i in tensor_pos]

    def rebuild(self, tensors: list) -> Any:
        flat = list(self.out_flat)
        for pos, t in zip(self.out_tensor_pos, tensors):
            flat[pos] = t
        self.out_flat = None  # the forward's outputs belong to the caller from here on
        if self.out_spec is None:
            return flat[0]
        return tree_unflatten(flat, self.out_spec)


def _version(t: torch.Tensor):
    """The version counter of t (None for an inference tensor, which has none)."""
    return None if t.is_inference() else t._version


def _not_deterministic(what: str) -> str:
    # The same wording as the C++ side's errors.
    return (f"ckpt_ext.checkpoint: recomputing the segment in backward {what}, so the segment "
            "is not deterministic (it depends on something other than its inputs, the RNG "
            "state and the autocast state: data-dependent control flow, a closure changed "
            "after forward, ...); its gradients cannot be computed by recomputation")


def _check_torch_kwargs(kwargs: dict) -> bool:
    """Take the keywords torch.utils.checkpoint.checkpoint consumes itself out of ``kwargs``,
    accepting the values that mean what this implementation does, so calls switch over
    unchanged. Returns whether to compare the recomputation with the forward."""
    use_reentrant = kwargs.pop("use_reentrant", None)
    if use_reentrant:
        raise NotImplementedError(
            "ckpt_ext.checkpoint: use_reentrant=True is not offered; ckpt_ext.checkpoint "
            "already behaves like use_reentrant=False (gradients reach every input and "
            "parameter). Drop the argument, or call torch.utils.checkpoint.checkpoint directly.")
    context_fn = kwargs.pop("context_fn", None)
    if context_fn is not None and context_fn is not torch.utils.checkpoint.noop_context_fn:
        raise NotImplementedError(
            "ckpt_ext.checkpoint: context_fn is not supported (selective activation "
            "checkpointing); use torch.utils.checkpoint.checkpoint for it")
    determinism_check = kwargs.pop("determinism_check", "default")
    if determinism_check not in ("default", "none"):
        raise ValueError(
            f"ckpt_ext.checkpoint: determinism_check must be 'default' or 'none', got "
            f"{determinism_check!r}")
    if kwargs.pop("debug", False):
        raise NotImplementedError(
            "ckpt_ext.checkpoint: debug=True is not supported; use "
            "torch.utils.checkpoint.checkpoint(..., debug=True) to trace a recomputation")
    return determinism_check == "default"


def checkpoint(fn: Callable, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its input tensors for backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
    **kwargs)``: backward re-runs ``fn`` (with the forward's RNG and autocast state) and
    differentiates it. Gradients reach every tensor argument and every tensor ``fn`` reads
    from elsewhere (module parameters, closures), as in an uncheckpointed run; arguments and
    results may be any pytree with non-tensor leaves. Under ``torch.no_grad()`` it simply
    calls ``fn``. Double backward works: with ``create_graph=True`` the recomputation and its
    gradient are recorded, and their graph reaches the original inputs and parameters. Hooks
    on inputs and parameters fire once per backward, as without checkpointing.

    The recomputation must do what the forward did: the same tensor outputs (number, shapes,
    dtypes, devices), the same autograd operations in the same order producing tensors of the
    same shapes, dtypes and devices, and the same tensors read from outside the segment.
    Otherwise backward raises ``torch.utils.checkpoint.CheckpointError`` saying what differed.

    Args:
        fn: the segment; must compute the same outputs when re-run on the same inputs.
        *args, **kwargs: passed to ``fn``. The keywords ``use_reentrant`` (False/None),
            ``context_fn`` (default only), ``determinism_check`` (``"default"``, or ``"none"``
            to skip comparing the autograd operations and which outside tensors are read;
            outputs are still compared) and ``debug`` (False) are taken as torch's checkpoint
            takes them, so calls can switch over unchanged.
        preserve_rng_state: replay the forward's CPU/CUDA RNG state during recomputation.
    """
    if not callable(fn):
        raise TypeError(f"ckpt_ext.checkpoint: fn must be callable, got {type(fn).__name__}")
    check = _check_torch_kwargs(kwargs) if kwargs else True
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    segment = _Segment(fn, args, kwargs)
    inputs, segment.inputs = segment.inputs, None
    outs = _C.checkpoint_apply(segment, bool(preserve_rng_state), check, inputs)
    return segment.rebuild(outs)
