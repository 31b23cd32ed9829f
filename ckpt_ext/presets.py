"""The recompute presets of a decoder layer, and the bytes each one saves.

Terms (used the same way in the package, the tests and bench/): a *preset* is one of the named
recompute strategies in the table below; *policy* is the ``policy=`` argument of
``ckpt_ext.modules`` and ``ckpt_ext.patch_llama`` that selects a preset by name (for
``patch_llama`` also one preset per layer, as a list or a callable, or ``"auto"``: presets
chosen per forward to fit an activation budget).

=============  ==============================================  ==================================
preset         saved for backward (per layer)                  recomputed in backward
=============  ==============================================  ==================================
``none``       everything autograd saves (plain layer)          nothing
``torch``      x (``torch.utils.checkpoint`` of the plain layer) the whole layer
``fast``       x, q, k, v (post-RoPE), out, lse, h, gate, up    norms, SwiGLU product, softmax tiles
``balanced``   x, out, lse, h                                   + q/k/v and RoPE, gate/up tile-wise
``min_memory`` x                                                + attention forward and o_proj
=============  ==============================================  ==================================

``saved_bytes`` gives the exact count ``saved_activation_bytes`` measures for one fused or
``torch`` layer; ``README.md`` and ``docs/presets.md`` carry the same formulas.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from . import _C

__all__ = ["PRESETS", "FUSED_PRESETS", "check_policy", "saved_bytes", "per_token_bytes"]

PRESETS = ("none", "torch", "fast", "balanced", "min_memory")
FUSED_PRESETS = ("fast", "balanced", "min_memory")


def check_policy(policy: str, what: str = "policy", valid: Sequence[str] = PRESETS) -> str:
    """``policy`` if it is one of ``valid`` (the presets), else a ValueError naming ``what``
    and listing ``valid``."""
    if policy not in valid:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, valid))}; got {policy!r}")
    return policy


# What one token of each residual decoder_layer_fwd keeps (the names and which preset keeps
# which: ckpt_ext._C.layer_residuals, from the engine) takes, as (dtype, width): "x" the
# residual stream's dtype, "c" the compute dtype, "f32" float32; widths in H, Hq, Hkv, D, I.
# The one definition of a residual slot's bytes: per_token_bytes (the plan, the docs' tables)
# and the offloader's per-call count (ckpt_ext.offload) read it.
RESIDUAL_WIDTHS = {
    "q": ("c", lambda H, Hq, Hkv, D, I, k: Hq * D),
    "k": ("c", lambda H, Hq, Hkv, D, I, k: Hkv * D),
    "v": ("c", lambda H, Hq, Hkv, D, I, k: Hkv * D),
    "out": ("c", lambda H, Hq, Hkv, D, I, k: Hq * D),
    "lse": ("f32", lambda H, Hq, Hkv, D, I, k: Hq),
    "h": ("x", lambda H, Hq, Hkv, D, I, k: H),
    "gate": ("c", lambda H, Hq, Hkv, D, I, k: I),
    "up": ("c", lambda H, Hq, Hkv, D, I, k: I),
    # an MoE layer's routing: the k chosen experts (int32) and their weights (fp32, or fp64
    # in an fp64 layer)
    "topk_idx": ("i32", lambda H, Hq, Hkv, D, I, k: k),
    "topk_w": ("w", lambda H, Hq, Hkv, D, I, k: k),
}


@functools.cache
def _residuals(part: str, preset: str, moe: bool = False) -> tuple:
    """The engine's residual names of (part, preset) (``moe``: of an MoE FFN)."""
    return tuple(_C.layer_residuals(part, preset, moe))


def per_token_bytes(preset: str, *, H: int, Hq: int, Hkv: int, D: int, I: int,
                    dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                    part: str = "layer", top_k: int = 0) -> int:
    """Bytes one token leaves saved in one layer (or sublayer ``part``): its input x and the
    preset's residuals (``RESIDUAL_WIDTHS`` of the engine's ``layer_residuals``). ``dtype``:
    the residual stream's (the layer input x and h); ``compute_dtype``: the projections' and
    attention's (q, k, v, out, gate, up), which is the autocast dtype under ``torch.autocast``
    and ``dtype`` otherwise; lse is fp32. ``top_k`` > 0: an MoE FFN routing each token to
    ``top_k`` experts (its routing is kept). ``torch`` keeps x alone."""
    e = torch.empty((), dtype=dtype).element_size()
    if preset == "torch":
        return e * H
    if preset not in FUSED_PRESETS:
        raise ValueError(f"per_token_bytes: no closed form for preset {preset!r} (measure it "
                         "with ckpt_ext.saved_activation_bytes)")
    c = torch.empty((), dtype=compute_dtype or dtype).element_size()
    size = {"x": e, "c": c, "f32": 4, "i32": 4, "w": max(4, c)}
    total = e * H
    for name in _residuals(part, preset, top_k > 0):
        kind, width = RESIDUAL_WIDTHS[name]
        total += size[kind] * width(H, Hq, Hkv, D, I, top_k)
    return total


def saved_bytes(preset: str, *, B: int, S: int, H: int, Hq: int, Hkv: int, D: int, I: int,
                dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                rope_batch: int = 1, rope_dtype: torch.dtype | None = None,
                mask: bool = False, lora_dropout: bool = False, top_k: int = 0) -> int:
    """Exact saved bytes of one layer: ``B*S*per_token_bytes`` plus the layer's shared inputs,
    cos and sin ``(rope_batch, S, D)`` and the bool ``key_padding_mask`` ``(B, S)`` if given,
    and with ``lora_dropout`` the 8-byte seed of the layer call's dropout masks. In a model the
    shared inputs are the same tensors for every layer and count once. LoRA adapters add
    nothing else: their rank-r products are recomputed. ``top_k``: an MoE layer's (see
    ``per_token_bytes``)."""
    rope_e = torch.empty((), dtype=rope_dtype or dtype).element_size()
    shared = 2 * rope_batch * S * D * rope_e + (B * S if mask else 0) + (8 if lora_dropout else 0)
    return B * S * per_token_bytes(preset, H=H, Hq=Hq, Hkv=Hkv, D=D, I=I, dtype=dtype,
                                   compute_dtype=compute_dtype, top_k=top_k) + shared
