"""Functional entry points and fake implementations of the fused block ops.

The block ops (``torch.ops.ckpt_ext.attention_block / mlp_block / decoder_layer``) are C++
autograd Functions (``csrc/blocks.cpp``) whose forward saves what the preset says and whose
backward recomputes the rest through the kernel ops. The modules in ``ckpt_ext.modules`` call
them; these wrappers exist for users who hold the weights themselves.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the operators)
from .presets import FUSED_PRESETS

__all__ = ["attention_block", "mlp_block", "decoder_layer"]

_ops = torch.ops.ckpt_ext


def _check_preset(op: str, preset: str) -> None:
    if preset not in FUSED_PRESETS:
        raise ValueError(f"{op}: preset must be one of {', '.join(map(repr, FUSED_PRESETS))}, "
                         f"got {preset!r}")


@torch.library.register_fake("ckpt_ext::attention_block")
def _attention_block_fake(x, norm_weight, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, q_norm_weight,
                          k_norm_weight, cos, sin, key_padding_mask, num_heads, num_kv_heads,
                          eps, scale, preset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("ckpt_ext::mlp_block")
def _mlp_block_fake(h, norm_weight, w_gate, w_up, w_down, b_gate, b_up, b_down, eps, preset):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.register_fake("ckpt_ext::decoder_layer")
def _decoder_layer_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


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
    _check_preset("attention_block", preset)
    cos, sin = position_embeddings
    head_dim = w_q.shape[0] // num_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return _ops.attention_block(x, norm_weight, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o,
                                q_norm_weight, k_norm_weight, cos, sin, key_padding_mask,
                                num_heads, num_kv_heads, eps, scale, preset)


def mlp_block(h: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *,
              eps: float = 1e-6, b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
              b_down: Optional[Tensor] = None, preset: str = "balanced") -> Tensor:
    """``h + down(silu(gate(m)) * up(m))`` with ``m = rms_norm(h)``; h: (B, S, H)."""
    _check_preset("mlp_block", preset)
    return _ops.mlp_block(h, norm_weight, w_gate, w_up, w_down, b_gate, b_up, b_down, eps, preset)


def decoder_layer(x: Tensor, attn: dict, mlp: dict, position_embeddings: Tuple[Tensor, Tensor],
                  *, num_heads: int, num_kv_heads: int, eps: float = 1e-6,
                  key_padding_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                  preset: str = "balanced") -> Tensor:
    """A whole LLaMA decoder layer as one C++ Function.

    attn: ``norm_weight, w_q, w_k, w_v, w_o`` and optionally ``b_q, b_k, b_v, b_o,
    q_norm_weight, k_norm_weight``; mlp: ``norm_weight, w_gate, w_up, w_down`` and optionally
    ``b_gate, b_up, b_down``. Shapes as in ``attention_block``.
    """
    _check_preset("decoder_layer", preset)
    cos, sin = position_embeddings
    head_dim = attn["w_q"].shape[0] // num_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    g = attn.get
    m = mlp.get
    return _ops.decoder_layer(
        x, attn["norm_weight"], attn["w_q"], attn["w_k"], attn["w_v"], attn["w_o"],
        g("b_q"), g("b_k"), g("b_v"), g("b_o"), g("q_norm_weight"), g("k_norm_weight"),
        cos, sin, key_padding_mask,
        mlp["norm_weight"], mlp["w_gate"], mlp["w_up"], mlp["w_down"],
        m("b_gate"), m("b_up"), m("b_down"), num_heads, num_kv_heads, eps, scale, preset)
