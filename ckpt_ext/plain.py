"""Plain-PyTorch math of the row-wise ops, with HF's semantics: the presets ``none`` and
``torch`` of ``ckpt_ext.modules`` compute with it, and ``ckpt_ext._backend`` registers it for
CUDA tensors when the extension was built without its CUDA kernels. Also the dense attention
of ``ckpt_ext.ops.attention``'s rules (:func:`attention`, :func:`attention_allowed`): an
explicit S x S softmax, the reference that tests/ and bench/ compare the kernels with.

Shapes: x (..., N), weight (N,); q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (1 or B, S, D).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["rotate_half", "rope", "rms_norm", "rms_norm_bwd", "attention", "attention_allowed"]


def rotate_half(x: Tensor) -> Tensor:
    """HF's rotate_half: the halves (x1, x2) of the last dim become (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """HF apply_rotary_pos_emb, cos/sin broadcast over heads, in the inputs' promoted dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _statistics_dtype(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (fp64
    stays fp64)."""
    xf = _statistics_dtype(x)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """(dx, dweight) of :func:`rms_norm`, dx in x's dtype and dweight in weight's."""
    xf = _statistics_dtype(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    dweight = (dy * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    g = dy.to(n.dtype) * weight.to(n.dtype)
    dx = rstd * (g - n * (g * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dweight


def attention_allowed(B: int, S: int, mask: Optional[Tensor], causal: bool, device,
                      segment_ids: Optional[Tensor] = None,
                      window: Optional[int] = None) -> Tensor:
    """Bool (B, 1, S, S): query i may attend key j. The dense form of every attention mask rule:
    causal j <= i; key_padding_mask[b, j]; segment_ids[b, i] == segment_ids[b, j]; window (HF's
    sliding_window_overlay, key j visible iff i - window < j; not causal: also j < i + window).
    """
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    allowed = torch.ones(S, S, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window) & (causal | (j < i + window))
    allowed = allowed.expand(B, 1, S, S)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return allowed


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool,
              scale: float, segment_ids: Optional[Tensor] = None,
              window: Optional[int] = None, softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    """Plain PyTorch attention at q's dtype, differentiable: q (B, Hq, S, D), k/v (B, Hkv, S,
    D) -> out (B, Hq, S, D), lse (B, Hq, S) (float32, float64 for float64 inputs).

    Explicit S x S softmax over the dense mask (:func:`attention_allowed`), K/V repeated for
    GQA. Masked scores get the dtype's most negative finite value, so rows with nothing to
    attend stay finite under autograd; those rows are then set to out = 0, lse = -inf (and get
    zero gradients through torch.where). softcap > 0: the scaled scores are capped first,
    ``tanh(s / softcap) * softcap``, as HF's eager attention caps Gemma 2's logits.
    """
    B, Hq, S, _ = q.shape
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # head h -> h // group
    allowed = attention_allowed(B, S, mask, causal, q.device, segment_ids, window)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    any_allowed = allowed.any(-1)                                  # (B, 1, S)
    out = torch.where(any_allowed[..., None], torch.softmax(s, -1) @ v, 0.0)
    lse = torch.where(any_allowed,
                      torch.logsumexp(s.float() if s.dtype != torch.float64 else s, -1),
                      -math.inf)
    return out, lse
