"""The model's final RMSNorm and the LM-head loss as one op, walked in token chunks.

An HF ``*ForCausalLM`` norms the last hidden state (``model.norm``) before its head. Written
out, that norm keeps an fp32 copy of the hidden state and its normalised rows for backward,
and the head keeps the normed rows as its input: three sequence-sized tensors, the largest
things a step holds besides the decoder layers' own. This op keeps only the pre-norm hidden
state and the per-token log-sum-exp:

    forward, per chunk of rows:   y = rms_norm(x) (in the head's dtype); loss, lse of y
    backward, per chunk of rows:  y again; dy (and the head's weight gradient) from the head's
                                  backward; dx and the norm weight's gradient from the norm's

The chunk is sized from the byte cap that bounds every token chunk of the CPU kernels
(``ckpt_ext.config``'s ``chunk_bytes``, 64 MiB by default): a chunk's rows in
fp32 fit it, so y, dy and the norm's fp32 work exist one chunk at a time, and each chunk's dx
rows are written into the result in place. The head's own logits chunks come from the same
cap inside ``linear_cross_entropy_fwd`` / ``_bwd``. Recompute: the norm once more in backward
(a row-wise op); the head's recompute is what ``linear_cross_entropy`` does anyway.

Weight gradients sum over the chunks: the norm weight's in fp32, the head weight's in place
for an fp32 (or fp64) head and in an fp32 ``(V, H)`` accumulator for a half-precision one
(one rounding at the end, as a single GEMM rounds). With one chunk (short sequences) nothing
is accumulated and the op computes exactly what the norm and the head compute written out.

Training the head's weight over several chunks, the token walk costs ``4 V H`` bytes beyond
the gradient itself (that fp32 accumulator, or each chunk's gradient beside the fp32 sum),
2 GiB at LLaMA-3's vocabulary. When fewer tokens than that are cheaper
(``walks_vocabulary``), the backward instead normalises all rows at once (y and dy, ``2 e T
H``) and hands them to the head in one call, which on a GPU walks vocabulary chunks and
writes each chunk of the weight gradient once (with an fp32 ``(T, H)`` dhidden accumulator).

The norm rounds as the model's family does (``norm_offset``: Gemma multiplies by 1 + w;
``norm_cast_last``: Gemma and OLMo-2 apply the weight in float32 and cast the product, LLaMA
casts the normalised rows first), as the decoder layer op's norms do (``norm_rows``).

Both halves are ``torch.library`` custom ops built from the kernel ops (``rms_norm_fwd`` /
``_bwd``, ``linear_cross_entropy_fwd`` / ``_bwd``), so they run wherever those do (CPU, the
Triton launchers) and stay opaque to ``torch.compile``.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import config
from ._checks import (_check_device_as, _check_dim, _check_floating, _check_lce_transform,
                      _check_norm_rounding, _check_rms, _check_shape, _dtype, _shape,
                      _stat_dtype)

_ops = torch.ops.ckpt_ext
_FWD = "rms_norm_linear_cross_entropy_fwd"
_BWD = "rms_norm_linear_cross_entropy_bwd"


def _offset(weight: Tensor, offset: float) -> Tensor:
    """offset + weight; the weight itself for 0 (no copy for autograd to keep)."""
    return weight if offset == 0.0 else weight + offset


def norm_rows(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
              cast_last: bool = False) -> Tensor:
    """RMSNorm of x's rows with a family's rounding: ``rms_norm_fwd`` on ``offset + weight``;
    with ``cast_last`` in float32 (float64 stays), cast to x's dtype at the end. Built from
    the kernel op, so autograd and the fakes come with it."""
    if not cast_last:
        return _ops.rms_norm_fwd(x, _offset(weight, offset), eps)
    wide = torch.promote_types(x.dtype, torch.float32)
    return _ops.rms_norm_fwd(x.to(wide), _offset(weight.to(wide), offset), eps).to(x.dtype)


def norm_rows_bwd(dy: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float,
                  cast_last: bool) -> Tuple[Tensor, Tensor]:
    """(dx, dweight) of ``norm_rows``; dx in x's dtype, dweight in the norm's compute dtype
    (the caller sums it in float32)."""
    if not cast_last:
        return _ops.rms_norm_bwd(dy.to(torch.promote_types(x.dtype, weight.dtype)), x,
                                 _offset(weight, offset), eps)
    wide = torch.promote_types(x.dtype, torch.float32)
    dx, dw = _ops.rms_norm_bwd(dy.to(wide), x.to(wide), _offset(weight.to(wide), offset), eps)
    return dx.to(x.dtype), dw


def chunk_rows(hidden: Tensor) -> int:
    """Rows per chunk: the chunk's rows in fp32 (fp64 for fp64) within the byte cap."""
    return rows_within_cap(hidden.shape[1], hidden.element_size(),
                           config.current().chunk_bytes)


def rows_within_cap(H: int, element_size: int, cap: int) -> int:
    """Rows per chunk of the normed head at width H: rows at the compute width (fp32, fp64
    for fp64) within ``cap``, at least one (the planner reads it too)."""
    return max(1, cap // max(1, H * max(4, element_size)))


def walks_vocabulary(T: int, V: int, head_element_size: int) -> bool:
    """Whether the backward of a trained head normalises all T rows in one piece: when its
    extra bytes, y and dy in the head's dtype and an fp32 dhidden accumulator ((2e + 4) T H),
    are fewer than the token walk's 4 V H (see the module docstring)."""
    return (2 * head_element_size + 4) * T < 4 * V


def _check(op, hidden, norm_weight, weight, bias, labels, logit_scale, softcap,
           norm_offset=0.0, norm_cast_last=False):
    """Shapes, dtypes and devices of the op's tensors, the norm's rounding, the logits' scale
    and cap; returns (T, H, V)."""
    _check_dim(op, "hidden", hidden, 2, "(T, H) (tokens flattened)")
    _check_rms(op, hidden, norm_weight, ("hidden", "norm_weight"))
    T, H = hidden.shape
    _check_dim(op, "weight", weight, 2, "(V, H)")
    _check_floating(op, "weight", weight)
    V = weight.shape[0]
    _check_shape(op, "weight", weight, (V, H), f"(V, H) with H={H} from hidden")
    _check_device_as(op, "weight", weight, "hidden", hidden)
    if V == 0:
        raise ValueError(f"{op}: weight must have at least one vocabulary row, got shape "
                         f"{_shape(weight)}")
    if bias is not None:
        _check_shape(op, "bias", bias, (V,), "(V,)")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{op}: bias must have weight's dtype {_dtype(weight.dtype)}, got "
                            f"{_dtype(bias.dtype)}")
        _check_device_as(op, "bias", bias, "hidden", hidden)
    if labels.dtype != torch.int64:
        raise TypeError(f"{op}: labels must be int64, got {_dtype(labels.dtype)}")
    _check_shape(op, "labels", labels, (T,), "(T,) with T from hidden")
    _check_device_as(op, "labels", labels, "hidden", hidden)
    _check_lce_transform(op, logit_scale, softcap)
    _check_norm_rounding(op, norm_offset, norm_cast_last)
    return T, H, V


@torch.library.custom_op(f"ckpt_ext::{_FWD}", mutates_args=())
def _fwd(hidden: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
         bias: Optional[Tensor], labels: Tensor, ignore_index: int, logit_scale: float = 1.0,
         softcap: float = 0.0, norm_offset: float = 0.0,
         norm_cast_last: bool = False) -> Tuple[Tensor, Tensor]:
    T, _, _ = _check(_FWD, hidden, norm_weight, weight, bias, labels, logit_scale, softcap,
                     norm_offset, norm_cast_last)
    loss = hidden.new_empty((T,), dtype=_stat_dtype(weight))
    lse = torch.empty_like(loss)
    step = chunk_rows(hidden)
    for t0 in range(0, T, step):
        rows = slice(t0, min(T, t0 + step))
        y = norm_rows(hidden[rows], norm_weight, eps, norm_offset,
                      norm_cast_last).to(weight.dtype)
        loss_c, lse_c = _ops.linear_cross_entropy_fwd(y, weight, bias, labels[rows],
                                                      ignore_index, logit_scale, softcap)
        loss[rows] = loss_c
        lse[rows] = lse_c
        del y, loss_c, lse_c   # not alive beside the next chunk's
    return loss, lse


@_fwd.register_fake
def _fwd_fake(hidden, norm_weight, eps, weight, bias, labels, ignore_index, logit_scale=1.0,
              softcap=0.0, norm_offset=0.0, norm_cast_last=False):
    T, _, _ = _check(_FWD, hidden, norm_weight, weight, bias, labels, logit_scale, softcap,
                     norm_offset, norm_cast_last)
    stat = hidden.new_empty((T,), dtype=_stat_dtype(weight))
    return stat, torch.empty_like(stat)


@torch.library.custom_op(f"ckpt_ext::{_BWD}", mutates_args=())
def _bwd(dloss: Tensor, hidden: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
         bias: Optional[Tensor], labels: Tensor, lse: Tensor, ignore_index: int,
         output_mask: List[bool], logit_scale: float = 1.0, softcap: float = 0.0,
         norm_offset: float = 0.0,
         norm_cast_last: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients [dhidden, dnorm_weight, dweight, dbias] of ``sum_t dloss[t] loss[t]``; those
    output_mask leaves out are empty (0,) tensors."""
    T, H, V = _check(_BWD, hidden, norm_weight, weight, bias, labels, logit_scale, softcap,
                     norm_offset, norm_cast_last)
    norm = (eps, norm_offset, norm_cast_last)
    want_dx, want_dnw, want_dw, want_db = (bool(m) for m in output_mask)
    want_db = want_db and bias is not None
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    dnw = norm_weight.new_zeros((H,), dtype=acc) if want_dnw else None
    dw: Optional[Tensor] = None
    db = weight.new_zeros((V,), dtype=acc) if want_db else None
    norm_step = step = chunk_rows(hidden)
    if want_dw and walks_vocabulary(T, V, weight.element_size()):
        step = max(T, 1)   # one piece: the head writes each weight-gradient row once
    want_dy = want_dx or want_dnw
    # dx: written chunk by chunk; in one piece, the norm's backward result itself
    norm_in_chunks = norm_step < T
    dx = torch.empty_like(hidden) if want_dx and norm_in_chunks else None
    for t0 in range(0, T, step):
        rows = slice(t0, min(T, t0 + step))
        y = norm_rows(hidden[rows], norm_weight, *norm)
        dy, dw_c, db_c = _ops.linear_cross_entropy_bwd(
            dloss[rows], y.to(weight.dtype), weight, bias, labels[rows], lse[rows],
            ignore_index, [want_dy, want_dw, want_db], logit_scale, softcap)
        del y
        if want_dy and not norm_in_chunks:   # one chunk: the norm's backward result itself
            dx_c, dnw_c = norm_rows_bwd(dy, hidden, norm_weight, *norm)
            dx = dx_c if want_dx else None
            if want_dnw:
                dnw += dnw_c
        elif want_dy:      # the norm's backward in chunks of the cap (its fp32 work too)
            for n0 in range(rows.start, rows.stop, norm_step):
                n = slice(n0, min(rows.stop, n0 + norm_step))
                dx_c, dnw_c = norm_rows_bwd(dy[n0 - t0:n.stop - t0], hidden[n], norm_weight,
                                            *norm)
                if want_dx:
                    dx[n] = dx_c
                if want_dnw:
                    dnw += dnw_c
                del dx_c, dnw_c
        if want_dw:
            if dw is None:
                one_chunk = t0 + step >= T
                dw = dw_c if one_chunk or dw_c.dtype == acc else dw_c.to(acc)
            else:
                dw += dw_c
        if want_db:
            db += db_c
        # nothing of this chunk lives into the next one's head backward: a trained head's
        # chunk gradient is a whole (V, H) tensor (1 GiB at LLaMA-3's vocabulary in bf16)
        del dy, dw_c, db_c
    empty = hidden.new_empty((0,))
    if want_dw and dw is None:  # T == 0
        dw = torch.zeros_like(weight)
    if dx is None:
        dx = torch.empty_like(hidden) if want_dx else empty.clone()
    return (dx,
            dnw.to(norm_weight.dtype) if want_dnw else empty.clone(),
            dw.to(weight.dtype) if want_dw else empty.clone(),
            db.to(weight.dtype) if want_db else empty.clone())


@_bwd.register_fake
def _bwd_fake(dloss, hidden, norm_weight, eps, weight, bias, labels, lse, ignore_index,
              output_mask, logit_scale=1.0, softcap=0.0, norm_offset=0.0, norm_cast_last=False):
    T, H, V = _check(_BWD, hidden, norm_weight, weight, bias, labels, logit_scale, softcap,
                     norm_offset, norm_cast_last)
    if len(output_mask) != 4:
        raise ValueError(f"{_BWD}: output_mask must have 4 entries [dhidden, dnorm_weight, "
                         f"dweight, dbias], got {len(output_mask)}")
    want_dx, want_dnw, want_dw, want_db = (bool(m) for m in output_mask)
    want_db = want_db and bias is not None
    return (hidden.new_empty((T, H) if want_dx else (0,)),
            norm_weight.new_empty((H,)) if want_dnw else hidden.new_empty((0,)),
            weight.new_empty((V, H)) if want_dw else hidden.new_empty((0,)),
            weight.new_empty((V,)) if want_db else hidden.new_empty((0,)))


def _setup(ctx, inputs, output):
    (hidden, norm_weight, eps, weight, bias, labels, ignore_index, logit_scale, softcap,
     norm_offset, norm_cast_last) = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    # The pre-norm hidden state, the labels and the per-token lse: no normed copy, nothing of
    # size (T, V).
    ctx.save_for_backward(hidden, norm_weight, weight, bias, labels, lse)
    ctx.eps, ctx.ignore_index = eps, ignore_index
    ctx.logit_scale, ctx.softcap = logit_scale, softcap
    ctx.norm_offset, ctx.norm_cast_last = norm_offset, norm_cast_last


def _backward(ctx, dloss, dlse):
    hidden, norm_weight, weight, bias, labels, lse = ctx.saved_tensors
    want_dx, want_dnw, _, want_dw, want_db = ctx.needs_input_grad[:5]
    want_db = want_db and bias is not None
    if not (want_dx or want_dnw or want_dw or want_db):
        return (None,) * 11
    if dloss is None:
        dloss = torch.zeros_like(lse)
    dx, dnw, dw, db = _bwd(dloss, hidden, norm_weight, ctx.eps, weight, bias, labels, lse,
                           ctx.ignore_index, [want_dx, want_dnw, want_dw, want_db],
                           ctx.logit_scale, ctx.softcap, ctx.norm_offset, ctx.norm_cast_last)
    return (dx if want_dx else None, dnw if want_dnw else None, None,
            dw if want_dw else None, db if want_db else None) + (None,) * 6


_fwd.register_autograd(_backward, setup_context=_setup)


def normed_loss_per_token(hidden: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                          bias: Optional[Tensor], labels: Tensor, ignore_index: int,
                          logit_scale: float = 1.0, softcap: float = 0.0,
                          norm_offset: float = 0.0, norm_cast_last: bool = False) -> Tensor:
    """Per-token losses (T,) of the head on ``norm_rows(hidden)``; hidden (T, H); the loss
    reads the logits scaled and capped as ``linear_cross_entropy`` does."""
    loss, _ = _fwd(hidden, norm_weight, float(eps), weight, bias, labels, int(ignore_index),
                   float(logit_scale), float(softcap), norm_offset, norm_cast_last)
    return loss
