"""The fused decoder layer op: its weight slots, fakes, and functional entry points.

``torch.ops.ckpt_ext.decoder_layer`` is one C++ autograd Function (``csrc/layer_autograd.cpp``) over
two opaque ops, ``decoder_layer_fwd`` (returns the output and the preset's residuals) and
``decoder_layer_bwd`` (recomputes the rest and returns the gradients). Their fakes below let
``torch.compile`` trace a model without tracing into them, so a compiled model keeps exactly
the residuals the preset names.

A layer's tensors travel as one list in the order of ``WEIGHT_SLOTS``: HF parameter names
relative to the decoder layer (``"input_layernorm.weight"``, ``"self_attn.q_proj.weight"``,
``"self_attn.q_proj.bias"``, ``"self_attn.q_proj.lora_A"``, ...), ``None`` where absent.
The op's arguments after ``x`` are spelled once, with their defaults, in ``csrc/layer_spec.h``;
``LayerOptions`` is the record built from the registered schema at import (one field per
argument, the schema's default, ``weights`` required), and ``decoder_layer(x, options)`` calls
the op with one record (``ckpt_ext.modules`` and ``ckpt_ext.patch_llama`` call it so). The
wrappers at the end are for users who hold the weights themselves.
"""
from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Mapping, Optional, Tuple

import torch
from torch import Tensor

from . import _C
from .presets import FUSED_PRESETS

__all__ = ["WEIGHT_SLOTS", "PROJECTIONS", "LAYER_ARGS", "LayerOptions", "RESIDUALS",
           "MOE_RESIDUALS", "residual_names",
           "pack_weights", "decoder_layer", "attention_block", "mlp_block"]

_ops = torch.ops.ckpt_ext

WEIGHT_SLOTS: Tuple[str, ...] = tuple(_C.layer_weight_slots())
# The projections in the order of the op's lora_scaling list.
PROJECTIONS: Tuple[str, ...] = tuple(s[:-len(".weight")] for s in WEIGHT_SLOTS
                                     if s.endswith("_proj.weight"))
_SLOT_INDEX = {name: i for i, name in enumerate(WEIGHT_SLOTS)}
PARTS = ("layer", "attention", "mlp")
# The names of what decoder_layer_fwd keeps per (part, preset), in the order of its `saved`.
RESIDUALS = {(part, preset): tuple(_C.layer_residuals(part, preset))
             for part in PARTS for preset in FUSED_PRESETS}
# The same for a mixture-of-experts MLP (num_experts_per_tok > 0): the routing decision
# (topk_idx, topk_w) in every preset, no gate/up.
MOE_RESIDUALS = {(part, preset): tuple(_C.layer_residuals(part, preset, True))
                 for part in PARTS for preset in FUSED_PRESETS}


def residual_names(a) -> tuple[str, ...]:
    """The residuals decoder_layer_fwd keeps for the arguments ``a`` (a LayerOptions or any
    record with ``part``, ``preset`` and ``num_experts_per_tok``)."""
    table = MOE_RESIDUALS if getattr(a, "num_experts_per_tok", 0) > 0 else RESIDUALS
    return table[a.part, a.preset]


def _field(arg) -> Tuple[str, str, dataclasses.Field]:
    """One schema argument as a record field: its default from the schema (a list default
    becomes a tuple, so that the record holds no shared mutable value), or required."""
    if not arg.has_default_value():
        return arg.name, str(arg.type), dataclasses.field()
    value = arg.default_value
    return arg.name, str(arg.type), dataclasses.field(
        default=tuple(value) if isinstance(value, list) else value)


def _post_init(self) -> None:
    if isinstance(self.weights, Mapping):  # slot name -> tensor: the op's slot list
        object.__setattr__(self, "weights", pack_weights(self.weights))


def _op_args(self) -> list:
    """The op's arguments after x, in its order."""
    return [getattr(self, name) for name in LAYER_ARGS]


# The op's arguments after x as one record, built from the registered schema (generated from
# csrc/layer_spec.h, whose rows carry the defaults): one field per argument, in the op's order.
LayerOptions = dataclasses.make_dataclass(
    "LayerOptions", [_field(a) for a in _ops.decoder_layer.default._schema.arguments[1:]],
    kw_only=True, frozen=True,
    namespace={"__post_init__": _post_init, "op_args": _op_args, "replace": dataclasses.replace})
LayerOptions.__module__ = __name__
LayerOptions.__doc__ = """The arguments of ``torch.ops.ckpt_ext.decoder_layer`` after x, by
name, with the op's own defaults (each argument is described in ``csrc/layer_spec.h``).
``weights`` (required) is the ``WEIGHT_SLOTS`` list or a mapping of slot names to tensors (HF's
names, e.g. ``dict(hf_layer.named_parameters())``), packed on construction;
``o.replace(**changes)``: a copy with some fields changed; ``o.op_args()``: the values in the
op's order."""
# The op's arguments after x, in its order.
LAYER_ARGS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LayerOptions))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LayerOptions)
             if f.default is not dataclasses.MISSING}


def pack_weights(named: Mapping[str, Optional[Tensor]]) -> list:
    """The op's ``weights`` list from a mapping of slot names (``WEIGHT_SLOTS``) to tensors;
    missing names are ``None``. Unknown names raise a ValueError naming them."""
    unknown = set(named) - set(_SLOT_INDEX)
    if unknown:
        raise ValueError(f"decoder_layer: unknown weight names {sorted(unknown)}; the slots are "
                         f"ckpt_ext.blocks.WEIGHT_SLOTS")
    return [named.get(name) for name in WEIGHT_SLOTS]


# ---- fakes (what torch.compile and meta tensors see) -----------------------------------------

def _bind(names, args, kwargs) -> SimpleNamespace:
    """A fake's arguments by name, whether the dispatcher passed them by position or name (the
    schema's defaults for those left out)."""
    return SimpleNamespace(**{**_DEFAULTS, **dict(zip(names, args)), **kwargs})


def _residual(name: str, x, a) -> Tensor:
    """An empty tensor shaped, typed and strided as decoder_layer_fwd's residual ``name``."""
    b, s, _ = x.shape
    act = a.compute_dtype if a.compute_dtype is not None else x.dtype
    if name == "h":
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if name == "lse":
        return x.new_empty(b, a.num_heads, s, dtype=torch.float32)
    if name in ("topk_idx", "topk_w"):
        k = a.num_experts_per_tok
        wide = torch.float64 if act == torch.float64 else torch.float32
        return x.new_empty(b * s, k, dtype=torch.int32 if name == "topk_idx" else wide)
    if name in ("gate", "up"):
        i = a.weights[_SLOT_INDEX["mlp.gate_proj.weight"]].shape[0]
        return x.new_empty(b * s, i, dtype=act)
    d = a.weights[_SLOT_INDEX["self_attn.q_proj.weight"]].shape[0] // a.num_heads
    kv_heads = a.num_heads if a.num_kv_heads is None else a.num_kv_heads
    heads = a.num_heads if name in ("q", "out") else kv_heads
    return x.new_empty(b, s, heads, d, dtype=act).transpose(1, 2)  # (B, H*, S, D)


def _router_logits(x, a) -> Tensor:
    """The op's second output: an MoE layer's router logits (B*S, E) in the compute dtype with
    ``router_logits``, its (3, E) load-balancing statistics (float32, float64 for float64) with
    ``router_stats``, else an empty (0,) tensor."""
    if not (a.router_logits or a.router_stats):
        return x.new_empty(0)
    act = a.compute_dtype if a.compute_dtype is not None else x.dtype
    experts = a.weights[_SLOT_INDEX["mlp.gate.weight"]].shape[0]
    if a.router_stats:
        return x.new_zeros(3, experts, dtype=torch.promote_types(act, torch.float32))
    return x.new_empty(x.shape[0] * x.shape[1], experts, dtype=act)


@torch.library.register_fake("ckpt_ext::decoder_layer")
def _decoder_layer_fake(x, *args, **kwargs):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            _router_logits(x, _bind(LAYER_ARGS, args, kwargs)))


@torch.library.register_fake("ckpt_ext::decoder_layer_fwd")
def _decoder_layer_fwd_fake(x, *args, **kwargs):
    a = _bind(LAYER_ARGS, args, kwargs)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            [_residual(name, x, a) for name in residual_names(a)], _router_logits(x, a))


@torch.library.register_fake("ckpt_ext::decoder_layer_bwd")
def _decoder_layer_bwd_fake(dy, x, *args, **kwargs):
    a = _bind(LAYER_ARGS + ("saved", "needs_grad", "drouter_logits"), args, kwargs)
    dweights = [torch.empty_like(w, memory_format=torch.contiguous_format)
                if w is not None and need else x.new_empty(0)
                for w, need in zip(a.weights, a.needs_grad)]
    return torch.empty_like(x, memory_format=torch.contiguous_format), dweights


# ---- functional entry points -----------------------------------------------------------------

def decoder_layer(x: Tensor, options: Optional[LayerOptions] = None, /, **changes):
    """A LLaMA decoder layer (or one sublayer, ``part``) as one C++ autograd Function.

    x: (B, S, H); options: the op's other arguments as one ``LayerOptions`` record (weights by
    slot name, e.g. ``LayerOptions(weights=dict(hf_layer.named_parameters()), cos=cos,
    sin=sin, num_heads=32, num_kv_heads=8)``); changes: fields to set on it (or the fields of a
    new record when ``options`` is None). A sublayer's part ignores the other part's weights
    (they get no gradient), so a whole layer's weights serve every ``part``.

    Returns the layer's output (B, S, H); with ``router_logits=True`` (an MoE MLP) the pair
    ``(output, router_logits)``, the router's logits (B*S, E) as HF's router returns them,
    differentiable; with ``router_stats=True`` the pair ``(output, stats)``, the (3, E)
    statistics of HF's load-balancing loss over the layer's tokens (weighted by
    ``key_padding_mask``): the top-k counts, the softmax probability sums (differentiable) and
    the token count in every column (csrc/moe_math.h ``router_stats``;
    ``ckpt_ext.hf.moe.load_balancing_loss`` makes the loss of them).
    """
    if options is None or changes:
        unknown = set(changes) - set(LAYER_ARGS)
        if unknown:
            raise TypeError(f"decoder_layer: unknown arguments {sorted(unknown)}; the op takes "
                            f"ckpt_ext.blocks.LAYER_ARGS")
        options = LayerOptions(**changes) if options is None else options.replace(**changes)
    if x.is_cuda and not torch.compiler.is_compiling():
        _note_cuda_sms(x.device.index)
    y, logits = _ops.decoder_layer(x, *options.op_args())
    return (y, logits) if options.router_logits or options.router_stats else y


@functools.lru_cache(maxsize=None)
def _note_cuda_sms(index: Optional[int]) -> None:
    """Hand the C++ layer the multiprocessors of the CUDA device it runs on, once per device:
    its chunks hold at least the query rows that fill them (csrc/chunking.h
    ``occupancy_min_rows``). One setting per process: the last device seen."""
    index = torch.cuda.current_device() if index is None else index
    _C.set_cuda_sms(torch.cuda.get_device_properties(index).multi_processor_count)



def attention_block(x: Tensor, norm_weight: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor,
                    w_o: Tensor, position_embeddings: Tuple[Tensor, Tensor], *,
                    num_heads: int, num_kv_heads: int, eps: float = 1e-6,
                    b_q: Optional[Tensor] = None, b_k: Optional[Tensor] = None,
                    b_v: Optional[Tensor] = None, b_o: Optional[Tensor] = None,
                    q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                    key_padding_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                    preset: str = "balanced") -> Tensor:
    """``x + o_proj(attention(rope(q, k), v))`` with q/k/v projected from ``rms_norm(x)``.

    x: (B, S, H); w_q: (Hq*D, H); w_k, w_v: (Hkv*D, H); w_o: (H, Hq*D);
    position_embeddings: (cos, sin), each (1 or B, S, D); key_padding_mask: bool (B, S).
    """
    a = "self_attn."
    weights = {"input_layernorm.weight": norm_weight, a + "q_proj.weight": w_q,
               a + "k_proj.weight": w_k, a + "v_proj.weight": w_v, a + "o_proj.weight": w_o,
               a + "q_proj.bias": b_q, a + "k_proj.bias": b_k, a + "v_proj.bias": b_v,
               a + "o_proj.bias": b_o, a + "q_norm.weight": q_norm_weight,
               a + "k_norm.weight": k_norm_weight}
    cos, sin = position_embeddings
    return decoder_layer(x, LayerOptions(
        weights=weights, cos=cos, sin=sin, num_heads=num_heads, num_kv_heads=num_kv_heads,
        eps=eps, scale=scale, key_padding_mask=key_padding_mask, part="attention",
        preset=preset))


def mlp_block(h: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *,
              eps: float = 1e-6, b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
              b_down: Optional[Tensor] = None, activation: str = "silu",
              preset: str = "balanced") -> Tensor:
    """``h + down(act(gate(m)) * up(m))`` with ``m = rms_norm(h)``; h: (B, S, H); act: silu,
    or ``gelu(approximate="tanh")`` with ``activation="gelu_tanh"``."""
    weights = {"post_attention_layernorm.weight": norm_weight, "mlp.gate_proj.weight": w_gate,
               "mlp.up_proj.weight": w_up, "mlp.down_proj.weight": w_down,
               "mlp.gate_proj.bias": b_gate, "mlp.up_proj.bias": b_up,
               "mlp.down_proj.bias": b_down}
    return decoder_layer(h, LayerOptions(weights=weights, eps=eps, activation=activation,
                                         part="mlp", preset=preset))
