"""DeepSpeed ZeRO-3: which parameters are gathered when, for the fused layers and the fused head.

ZeRO-3 keeps each rank's shard of every parameter and gathers a module's parameters in hooks
that it puts on every submodule: before the module's forward, again before its backward
(through an autograd node on the module's outputs), and releases them after each (an autograd
node on its inputs marks the end of its backward). A fused decoder layer never calls its
submodules, so those per-submodule hooks would not gather anything for it.

* **Decoder layers.** Each fused layer is made a ZeRO-3 *leaf module* (DeepSpeed's
  ``set_z3_leaf_module``): the hooks on the layer itself then gather all of its parameters,
  LoRA adapters and frozen base weights included, for its forward, release them after, gather
  them again before its backward (where the fused op recomputes) and release them once its
  backward is done. This is done when patching a model whose parameters are already ZeRO-3
  parameters (``zero.Init``, or after ``deepspeed.initialize``) and, for a model patched before
  ``deepspeed.initialize``, at its first forward (the bare model's pre-hook runs before the
  layers' hooks). Hooks that ZeRO-3 put on the submodules of a leaf layer before it became
  one never run on the fused path and do not make it delegate.
* **Leaf blocks inside a layer (MoE).** DeepSpeed makes the MoE blocks of Mixtral, Qwen2-MoE
  and Qwen3-MoE leaf modules itself when ``deepspeed.initialize`` registers a model whose
  layers are not leaves yet: the gradients of such a block's parameters (router, experts,
  shared expert) are then reduced, and taken off ``.grad``, only by a backward hook on the
  block, which a fused layer never calls. ``reduce_inner_leaves`` runs those hooks once the
  fused layer's backward has formed its parameters' gradients.
* **LM head.** The fused loss reads ``lm_head.weight`` rather than calling ``lm_head``, so its
  hooks would not run and ZeRO-3 would gather the weight on first access and keep it for the
  rest of the step. Instead, ``gathered_for_head`` gathers it (``deepspeed.zero
  .GatheredParameters``) for the loss's forward only, releases it, gathers it again just
  before the loss's backward and releases it when that backward is done.

Nothing here imports deepspeed unless a parameter is a ZeRO-3 parameter (then it is imported).
"""
from __future__ import annotations

import threading
from typing import Callable, ClassVar, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor


def is_zero3_param(p: Optional[Tensor]) -> bool:
    """A parameter partitioned by DeepSpeed ZeRO-3 (``deepspeed.zero.Init`` or
    ``deepspeed.initialize`` with stage 3)."""
    return p is not None and hasattr(p, "ds_id") and hasattr(p, "ds_status")


def _first_param(module: nn.Module) -> Optional[Tensor]:
    return next(module.parameters(), None)


def is_leaf(module: nn.Module) -> bool:
    """Whether ZeRO-3 gathers all of ``module``'s parameters in the module's own hooks."""
    return bool(getattr(module, "_z3_leaf", False))


def make_leaves(layers: Iterable[nn.Module]) -> None:
    """Make every layer whose parameters are ZeRO-3 parameters a ZeRO-3 leaf module (through
    DeepSpeed's own ``set_z3_leaf_module``); layers of other models are left alone."""
    for layer in layers:
        if not is_leaf(layer) and is_zero3_param(_first_param(layer)):
            from deepspeed.utils import set_z3_leaf_module
            set_z3_leaf_module(layer, True)


def is_deepspeed_hook(hook: Callable) -> bool:
    """A forward (pre-)hook that DeepSpeed installed (ZeRO-3's gathering hooks)."""
    return getattr(hook, "__module__", "").startswith("deepspeed.")


def raw_parameter(module: nn.Module, name: str) -> Optional[Tensor]:
    """``module.<name>`` without going through ZeRO-3's parameter getter, which, inside a
    forward, gathers a partitioned parameter and keeps it gathered to the end of the step."""
    return module._parameters.get(name)


class _OnBackward(torch.autograd.Function):
    """Identity on ``t``; its backward calls ``action()`` first. On the loss (the output of the
    head's computation) that runs before the head's backward: ``_Gather.enter``. On the
    hidden states going in, once the nodes that consumed them are done: ``_Gather.exit``."""

    @staticmethod
    def forward(ctx, t: Tensor, action: Callable[[], None]) -> Tensor:
        ctx.action = action
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


class _Gather:
    """The gathering for the backward of one call, entered and left by two ``_OnBackward``
    nodes (each at most once). Backwards of several calls may overlap (one backward through
    two forwards of the model): they share one ``GatheredParameters`` context per parameter
    set, entered by the first and left by the last."""

    _active: Dict[Tuple[int, ...], list] = {}  # ds ids -> [context, users]
    _lock = threading.Lock()

    def __init__(self, params: List[Tensor]):
        self.params, self.entered = params, False
        self.key = tuple(sorted(p.ds_id for p in params))

    def enter(self) -> None:
        with self._lock:
            if self.entered:
                return
            self.entered = True
            entry = self._active.get(self.key)
            if entry is None:
                import deepspeed
                context = deepspeed.zero.GatheredParameters(self.params)
                context.__enter__()
                self._active[self.key] = entry = [context, 0]
            entry[1] += 1

    def exit(self) -> None:
        with self._lock:
            if not self.entered:
                return
            self.entered = False
            entry = self._active[self.key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._active[self.key]
                entry[0].__exit__(None, None, None)


def _inner_leaf_hooks(layer: nn.Module) -> list:
    """(block, hook) for DeepSpeed's gradient-reducing backward hooks on the ZeRO-3 leaf
    blocks strictly inside ``layer`` whose parameters DeepSpeed assigned to that block."""
    found = []
    for _, mod in layer.named_modules():
        if mod is layer or not is_leaf(mod):
            continue
        if not any(getattr(p, "ds_z3_leaf_module", None) is mod for p in mod.parameters()):
            continue
        found += [(mod, h) for h in mod._backward_hooks.values() if is_deepspeed_hook(h)]
    return found


class _InnerLeaves:
    """The backwards pending for the leaf blocks of one layer: each fused forward that needs a
    gradient adds one, each backward of those forwards (its node on the layer's input) takes
    one off, and the last runs DeepSpeed's hooks, so that one backward through several forwards
    of the layer (whose gradients accumulate into one ``.grad`` per parameter) reduces each
    block's gradients once, after all of them."""

    _pending: ClassVar[dict] = {}  # id(layer) -> forwards whose backward has not run
    _lock = threading.Lock()

    def __init__(self, layer: nn.Module, hooks: list):
        self.key, self.hooks, self.done = id(layer), hooks, False
        with self._lock:
            self._pending[self.key] = self._pending.get(self.key, 0) + 1

    def backward_done(self) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
            self._pending[self.key] -= 1
            last = self._pending[self.key] == 0
            if last:
                del self._pending[self.key]
        if last:
            for mod, hook in self.hooks:
                hook(mod, None, None)


def reduce_inner_leaves(layer: nn.Module, x: Tensor) -> Tensor:
    """``x``, the fused layer's input, through an identity whose backward (after the layer's
    backward has accumulated its parameters' gradients) runs DeepSpeed's gradient-reducing
    hooks of the leaf blocks inside ``layer``, which the fused op does not call. ``x`` as it is
    for other models and without autograd."""
    if not torch.is_grad_enabled() or not is_zero3_param(_first_param(layer)):
        return x
    hooks = _inner_leaf_hooks(layer)
    if not hooks or not any(p.requires_grad for mod, _ in hooks for p in mod.parameters()):
        return x
    if not x.requires_grad:
        # the layer's first input may not need a gradient (frozen embeddings): one is formed
        # (and dropped) so that the node below runs after the layer's backward
        x = x.detach().requires_grad_()
    return _OnBackward.apply(x, _InnerLeaves(layer, hooks).backward_done)


def gathered_for_head(params: List[Optional[Tensor]], hidden: Tensor,
                      compute: Callable[[Tensor], Tensor]) -> Tensor:
    """``compute(hidden)`` (the fused loss, which reads ``params``) with the ZeRO-3 parameters
    among ``params`` gathered for its forward and, separately, for its backward, and released
    in between and after. Parameters that ZeRO-3 keeps gathered anyway (``ds_persist``) and
    other tensors are left as they are."""
    zero = [p for p in params if is_zero3_param(p) and not getattr(p, "ds_persist", False)]
    if not zero:
        return compute(hidden)
    import deepspeed
    backward = _Gather(zero)
    if not hidden.requires_grad and any(p.requires_grad for p in zero):
        # Only the head trains: the release node needs an input whose gradient is computed
        # after the loss's backward, so the hidden states become one (their gradient is
        # formed and dropped).
        hidden = hidden.detach().requires_grad_()
    if hidden.requires_grad:
        hidden = _OnBackward.apply(hidden, backward.exit)
    with deepspeed.zero.GatheredParameters(zero):
        out = compute(hidden)
    return _OnBackward.apply(out, backward.enter) if out.requires_grad else out
