"""Plain-PyTorch math of the row-wise ops, with HF's semantics: the presets ``none`` and
``torch`` of ``ckpt_ext.modules`` compute with it, and ``ckpt_ext._backend`` registers it for
CUDA tensors when the extension was built without its CUDA kernels.

Shapes: x (..., N), weight (N,); q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (1 or B, S, D).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = ["rotate_half", "rope", "rms_norm", "rms_norm_bwd"]


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
