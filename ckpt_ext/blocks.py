"""The fused decoder layer op: its weight slots, fakes, and functional entry points.

``torch.ops.ckpt_ext.decoder_layer`` is one C++ autograd Function (``csrc/layer_autograd.cpp``) over
two opaque ops, ``decoder_layer_fwd`` (returns the output and the preset's residuals) and
``decoder_layer_bwd`` (recomputes the rest and returns the gradients). Their fakes below let
``torch.compile`` trace a model without tracing into them, so a compiled model keeps exactly
the residuals the preset names.

A layer's tensors travel as one list in the order of ``WEIGHT_SLOTS``: HF parameter names
relative to the decoder layer (``"input_layernorm.weight"``, ``"self_attn.q_proj.weight"``,
``"self_attn.q_proj.bias"``, ``"self_attn.q_proj.lora_A"``, ...), ``None`` where absent.
The op's arguments after ``x`` are spelled once, in ``csrc/layer_spec.h``; ``LAYER_ARGS`` reads
their names from its schema, and ``call_decoder_layer`` passes them by name (``ckpt_ext.modules``
and ``ckpt_ext.patch_llama`` call the op so). The wrappers at the end are for users who hold
the weights themselves.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C
from .presets import FUSED_PRESETS

__all__ = ["WEIGHT_SLOTS", "PROJECTIONS", "LAYER_ARGS", "RESIDUALS", "pack_weights",
           "call_decoder_layer", "decoder_layer", "attention_block", "mlp_block"]

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

# The op's arguments after x, in its order (its schema, generated from csrc/layer_spec.h).
LAYER_ARGS: Tuple[str, ...] = tuple(a.name for a in _ops.decoder_layer.default._schema.arguments[1:])
# The value of an argument that a call_decoder_layer leaves out. The others (weights, num_heads,
# num_kv_heads, eps, scale) every call gives.
LAYER_DEFAULTS = dict(cos=None, sin=None, key_padding_mask=None, segment_ids=None, window=None,
                      uniform_empty_rows=False, lora_scaling=[], lora_dropout=[],
                      dropout_seed=None, lora_streams=[], softcap=0.0,
                      rope_interleaved=False, qk_norm_after_rope=False, residual_scale=1.0,
                      norm_offset=0.0, norm_cast_last=False, compute_dtype=None,
                      activation="silu", part="layer", preset="balanced")


def call_decoder_layer(x: Tensor, **args) -> Tensor:
    """``torch.ops.ckpt_ext.decoder_layer(x, ...)`` with its arguments by name (``LAYER_ARGS``),
    ``LAYER_DEFAULTS`` for those left out; x: (B, S, H), weights: the ``WEIGHT_SLOTS`` list."""
    unknown = set(args) - set(LAYER_ARGS)
    if unknown:
        raise TypeError(f"decoder_layer: unknown arguments {sorted(unknown)}; the op takes "
                        f"ckpt_ext.blocks.LAYER_ARGS")
    return _ops.decoder_layer(x, **{**LAYER_DEFAULTS, **args})


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
    """A fake's arguments by name, whether the dispatcher passed them by position or name."""
    return SimpleNamespace(**dict(zip(names, args)), **kwargs)


def _residual(name: str, x, a) -> Tensor:
    """An empty tensor shaped, typed and strided as decoder_layer_fwd's residual ``name``."""
    b, s, _ = x.shape
    act = a.compute_dtype if a.compute_dtype is not None else x.dtype
    if name == "h":
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if name == "lse":
        return x.new_empty(b, a.num_heads, s, dtype=torch.float32)
    if name in ("gate", "up"):
        i = a.weights[_SLOT_INDEX["mlp.gate_proj.weight"]].shape[0]
        return x.new_empty(b * s, i, dtype=act)
    d = a.weights[_SLOT_INDEX["self_attn.q_proj.weight"]].shape[0] // a.num_heads
    heads = a.num_heads if name in ("q", "out") else a.num_kv_heads
    return x.new_empty(b, s, heads, d, dtype=act).transpose(1, 2)  # (B, H*, S, D)


@torch.library.register_fake("ckpt_ext::decoder_layer")
def _decoder_layer_fake(x, *args, **kwargs):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("ckpt_ext::decoder_layer_fwd")
def _decoder_layer_fwd_fake(x, *args, **kwargs):
    a = _bind(LAYER_ARGS, args, kwargs)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            [_residual(name, x, a) for name in RESIDUALS[a.part, a.preset]])


@torch.library.register_fake("ckpt_ext::decoder_layer_bwd")
def _decoder_layer_bwd_fake(dy, x, *args, **kwargs):
    a = _bind(LAYER_ARGS + ("saved", "needs_grad"), args, kwargs)
    dweights = [torch.empty_like(w, memory_format=torch.contiguous_format)
                if w is not None and need else x.new_empty(0)
                for w, need in zip(a.weights, a.needs_grad)]
    return torch.empty_like(x, memory_format=torch.contiguous_format), dweights


# ---- functional entry points -----------------------------------------------------------------

def _check(op: str, preset: str, part: str) -> None:
    if preset not in FUSED_PRESETS:
        raise ValueError(f"{op}: preset must be one of {', '.join(map(repr, FUSED_PRESETS))}, "
                         f"got {preset!r}")
    if part not in PARTS:
        raise ValueError(f"{op}: part must be one of {', '.join(map(repr, PARTS))}, got {part!r}")


def decoder_layer(x: Tensor, weights: Mapping[str, Optional[Tensor]],
                  position_embeddings: Optional[Tuple[Tensor, Tensor]] = None, *,
                  num_heads: int = 1, num_kv_heads: Optional[int] = None, eps: float = 1e-6,
                  scale: Optional[float] = None, key_padding_mask: Optional[Tensor] = None,
                  segment_ids: Optional[Tensor] = None, window: Optional[int] = None,
                  uniform_empty_rows: bool = False,
                  lora_scaling: Optional[Sequence[float]] = None,
                  lora_dropout: Optional[Sequence[float]] = None,
                  dropout_seed: Optional[Tensor] = None,
                  lora_streams: Optional[Sequence[int]] = None, softcap: float = 0.0,
                  rope_interleaved: bool = False, qk_norm_after_rope: bool = False,
                  residual_scale: float = 1.0,
                  norm_offset: float = 0.0, norm_cast_last: bool = False,
                  compute_dtype: Optional[torch.dtype] = None, activation: str = "silu",
                  part: str = "layer", preset: str = "balanced") -> Tensor:
    """A LLaMA decoder layer (or one sublayer, ``part``) as one C++ autograd Function.

    x: (B, S, H); weights: slot name -> tensor (``WEIGHT_SLOTS``; HF's names, e.g.
    ``dict(hf_layer.named_parameters())``); position_embeddings: (cos, sin), each
    (1 or B, S, head_dim), required unless ``part="mlp"``; key_padding_mask: bool (B, S), True
    = real token; segment_ids (B, S) int and window: as in ``ckpt_ext.ops.attention``;
    uniform_empty_rows: a query row with no key to attend averages all values (HF eager
    attention's result) instead of being 0. ``scale`` defaults to ``head_dim ** -0.5``.
    lora_scaling: one factor per projection (``PROJECTIONS``) when ``weights`` has adapters
    (``"<projection>.lora_A"`` / ``".lora_B"``); lora_dropout: one probability per projection,
    applied to the adapter's input with masks hashed from ``dropout_seed`` (a CPU int64 tensor
    with one element, e.g. ``torch.randint(2**31, ())``): the backward replays them exactly.
    lora_streams: None (each projection hashes its masks with stream = its index) or one
    stream per projection; projections given one stream share one mask (Phi-3's fused
    qkv_proj / gate_up_proj, whose one adapter reads one dropped input).
    residual_scale: each sublayer's output is multiplied by it before the residual add
    (Granite's ``residual_multiplier``). Norms: every norm slot is optional (absent = none);
    ``"attention_output_norm.weight"`` / ``"mlp_output_norm.weight"`` norm a sublayer's output
    before the residual add (Gemma 2/3's post-attention and post-feedforward norms, OLMo-2's);
    q/k norm weights of width ``heads * head_dim`` norm the whole projection (OLMo-2), of width
    ``head_dim`` each head (Qwen3, Gemma 3). Every norm multiplies by ``norm_offset + weight``
    (Gemma: 1); ``norm_cast_last`` applies the weight in float32 and casts the result to the
    input's dtype (Gemma, OLMo-2) instead of casting the normalized input first (LLaMA).
    activation: the MLP's ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU,
    ``gelu(approximate="tanh")``: Gemma's ``gelu_pytorch_tanh``).
    softcap: > 0, Gemma 2's attention logit soft-capping (``ckpt_ext.ops.attention``'s
    ``softcap``); 0, none. rope_interleaved: RoPE rotates the pairs (2i, 2i + 1) of the first
    R dims (GLM, Helium, ERNIE 4.5) instead of (i, i + R/2) (LLaMA), each by the angle of
    column i of cos/sin, which keep HF's half-split layout (width R). qk_norm_after_rope: the
    q/k norms norm the rotated projections (Hunyuan) instead of being rotated (Qwen3).
    """
    _check("decoder_layer", preset, part)
    w = pack_weights(weights)
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if scale is None:
        wq = w[_SLOT_INDEX["self_attn.q_proj.weight"]]
        scale = 1.0 / math.sqrt(wq.shape[0] // num_heads) if wq is not None else 1.0
    return call_decoder_layer(
        x, weights=w, cos=cos, sin=sin, key_padding_mask=key_padding_mask,
        segment_ids=segment_ids, window=window, uniform_empty_rows=uniform_empty_rows,
        lora_scaling=list(lora_scaling or ()), lora_dropout=list(lora_dropout or ()),
        dropout_seed=dropout_seed, lora_streams=list(lora_streams or ()), num_heads=num_heads,
        num_kv_heads=num_kv_heads or num_heads,
        eps=eps, scale=float(scale), softcap=float(softcap),
        rope_interleaved=bool(rope_interleaved), qk_norm_after_rope=bool(qk_norm_after_rope),
        residual_scale=float(residual_scale),
        norm_offset=float(norm_offset), norm_cast_last=bool(norm_cast_last),
        compute_dtype=compute_dtype, activation=activation, part=part, preset=preset)


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
    return decoder_layer(x, weights, position_embeddings, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, eps=eps, scale=scale,
                         key_padding_mask=key_padding_mask, part="attention", preset=preset)


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
    return decoder_layer(h, weights, eps=eps, activation=activation, part="mlp", preset=preset)
