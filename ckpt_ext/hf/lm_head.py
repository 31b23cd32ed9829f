"""The LM head and loss of a patched ``*ForCausalLM``, without logits.

In a training forward (grad enabled, ``labels`` given, no KV cache, all positions kept), the
patched forward runs the bare model, then ``ckpt_ext.ops.linear_cross_entropy`` on its last
hidden state with HF's label shift (or the ``shift_labels`` given), ``ignore_index`` and
``num_items_in_batch`` (a tensor stays a tensor: no host sync). It returns HF's
``CausalLMOutputWithPast`` with ``logits=None``: the ``(B, S, V)`` logits are never formed.
Every other call (eval, generate, no labels, ``logits_to_keep``, a head or loss the op does
not compute) runs HF's forward and returns logits as before. TRL's own fused head calls the
bare model and its own head, so it keeps working, with the decoder layers fused underneath.

The bare model's final RMSNorm (``model.norm``) gets an instance-level forward too
(``FinalNorm``): ``ckpt_ext.ops.rms_norm``, which keeps the pre-norm rows for backward where
HF's norm keeps an fp32 copy of them and its normalised rows. Its output carries its input,
and a fused training forward hands that pre-norm hidden state to ``linear_cross_entropy`` with
the norm's weight: the norm then runs inside the head op, chunk by chunk, and the step keeps
only the pre-norm hidden state (``ckpt_ext._normed_head``); the norm's own output and its graph
are dropped. ``torch.compile`` traces the attribute like any other (no graph break).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from .zero import gathered_for_head, raw_parameter


@functools.lru_cache(maxsize=None)
def _hf_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss
    return ForCausalLMLoss


def head_problem(model: nn.Module) -> Optional[str]:
    """Why the fused head cannot stand in for this model's head and loss, or None."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        return f"lm_head is a {type(head).__name__}, not a plain nn.Linear"
    if not isinstance(getattr(model, "model", None), nn.Module):
        return "the model has no bare .model to run before the head"
    if getattr(model, "loss_function", None) is not _hf_causal_lm_loss():
        return "the model's loss_function is not transformers' ForCausalLMLoss"
    scaling = getattr(getattr(model, "config", None), "logits_scaling", 1.0)
    if scaling != 1.0:
        return (f"the model divides its logits by logits_scaling={scaling} (Granite), which the "
                "fused loss does not apply")
    return None


# The attribute of a FinalNorm output that holds the norm's input (set only for outputs that
# may reach the fused head: grad enabled).
_PRENORM = "_ckpt_ext_prenorm"


def final_norm_problem(norm: Optional[nn.Module]) -> Optional[str]:
    """Why ``norm`` cannot run as ``ckpt_ext.ops.rms_norm``, or None."""
    if norm is None:
        return "the bare model has no .norm"
    if (not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon")
            or set(dict(norm.named_parameters())) != {"weight"}):
        return f"model.norm is a {type(norm).__name__}, not the family's RMSNorm"
    if "forward" in norm.__dict__:
        return "model.norm already has an instance-level forward"
    return None


class FinalNorm:
    """The instance-level ``forward`` of a patched model's final RMSNorm (module docstring).
    A norm with forward hooks of its own runs HF's forward."""

    def __init__(self, norm: nn.Module):
        self.norm = norm
        self.__signature__ = inspect.signature(self.original)

    @property
    def original(self) -> Callable:
        return type(self.norm).forward.__get__(self.norm, type(self.norm))

    def __repr__(self) -> str:
        return "<ckpt_ext patched final RMSNorm>"

    def __call__(self, hidden_states):
        norm = self.norm
        if norm._forward_hooks or norm._forward_pre_hooks or not isinstance(hidden_states,
                                                                             torch.Tensor):
            return self.original(hidden_states)
        out = ops.rms_norm(hidden_states, norm.weight, norm.variance_epsilon)
        if torch.is_grad_enabled():
            setattr(out, _PRENORM, hidden_states)
        return out


def take_prenorm(hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """The input of the FinalNorm call that produced ``hidden``, unlinked from it (so that
    ``hidden`` no longer holds it), or None when ``hidden`` did not come from one. (Set to
    None rather than deleted: torch.compile traces attribute stores, not deletions.)"""
    pre = getattr(hidden, _PRENORM, None)
    if pre is not None:
        setattr(hidden, _PRENORM, None)
    return pre


class FusedHeadForward:
    """The instance-level ``forward`` of a patched ``*ForCausalLM``. ``calls`` counts
    ``fused`` and ``hf`` calls (outside compilation)."""

    def __init__(self, model: nn.Module):
        self.model = model
        params = inspect.signature(type(model).forward).parameters.values()
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        self.calls = {"fused": 0, "hf": 0}
        # What inspect.signature(model.forward) reports: Trainer keeps the dataset columns
        # that the model's forward names.
        self.__signature__ = inspect.signature(self.original)

    @property
    def original(self) -> Callable:
        return type(self.model).forward.__get__(self.model, type(self.model))

    def __repr__(self) -> str:
        return "<ckpt_ext patched forward: LM head and loss without logits>"

    def _count(self, key: str) -> None:
        if not torch.compiler.is_compiling():
            self.calls[key] += 1

    def __call__(self, *args, **kwargs):
        kwargs.update(zip(self.positional, args))
        labels = kwargs.get("labels")
        fusable = (labels is not None and torch.is_grad_enabled()
                   and not kwargs.get("use_cache") and kwargs.get("past_key_values") is None
                   and isinstance(kwargs.get("logits_to_keep", 0), int)
                   and kwargs.get("logits_to_keep", 0) == 0
                   and head_problem(self.model) is None)
        if not fusable:
            self._count("hf")
            return self.original(**kwargs)
        self._count("fused")
        return self._fused(**kwargs)

    def _fused(self, labels, logits_to_keep=0, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.get("num_items_in_batch")
        ignore_index = kwargs.get("ignore_index", -100)
        shift_labels = kwargs.get("shift_labels")
        bare = self.model.model
        outputs = bare(**kwargs)
        hidden = outputs.last_hidden_state
        norm = bare._modules.get("norm")
        prenorm = take_prenorm(hidden)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = self.model.lm_head
        # Read past ZeRO-3's getter: under ZeRO-3 the weight is gathered only around the
        # loss's forward and its backward (ckpt_ext.hf.zero).
        weight, bias = raw_parameter(head, "weight"), raw_parameter(head, "bias")
        labels = shift_labels.to(hidden.device)
        norm_args = {}
        if prenorm is not None:  # the final norm inside the head op, on the pre-norm rows
            hidden = prenorm     # (a ZeRO-3 norm has DeepSpeed's hooks: it ran as HF's)
            norm_args = dict(norm_weight=norm.weight, norm_eps=norm.variance_epsilon)

        def loss_of(hidden):
            w, b = weight, bias
            device = hidden.device.type
            if torch.is_autocast_enabled(device):  # the head's matmul in the autocast dtype
                dtype = torch.get_autocast_dtype(device)
                w = w.to(dtype)
                b = None if b is None else b.to(dtype)
                if not norm_args:  # the op casts the normed rows itself
                    hidden = hidden.to(dtype)
            elif not norm_args and hidden.dtype != w.dtype:
                hidden = hidden.to(w.dtype)
            return ops.linear_cross_entropy(hidden, w, labels, bias=b, ignore_index=ignore_index,
                                            num_items_in_batch=num_items, **norm_args)

        loss = gathered_for_head([weight, bias], hidden, loss_of)
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)
