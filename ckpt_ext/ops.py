"""Differentiable wrappers and fake (meta) implementations of the ckpt_ext kernel ops.

The op schemas live in ``csrc/ckpt_ext.cpp``; the CPU implementations in ``csrc/*_cpu.cpp``;
CUDA implementations are registered elsewhere. This module adds, for every kernel op:

* a ``torch.library.register_fake`` giving exactly the shapes / dtypes the real op returns
  (contiguous outputs; ``(0,)`` empty tensors for outputs that do not apply), after the same
  argument checks as the C++ ops, so that ``torch.compile`` and meta tensors fail as clearly;
* autograd through ``torch.library.register_autograd`` on each forward op, whose backward
  calls the matching backward op. The backward ops themselves have no derivative: reaching
  one with ``create_graph=True`` raises (double backward is not supported).

Public wrappers:
    attention(q, k, v, *, causal=True, scale=None, key_padding_mask=None, segment_ids=None,
              window=None, deterministic=None, q_offset=0, softcap=0.0) -> out
    swiglu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, save="input",
               activation="silu")
    rms_norm(x, weight, eps) -> y
    add_rms_norm(x, residual, weight, eps) -> (y, s)
    rope(q, k, cos, sin) -> (q_out, k_out)
    linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100,
                         reduction="mean", num_items_in_batch=None, norm_weight=None,
                         norm_eps=None, logit_scale=1.0, softcap=0.0) -> loss
"""
import math
import numbers
import threading

import torch

from . import _C  # noqa: F401  (registers the ckpt_ext operators)
from . import config
from ._checks import (_dtype, _check_floating, _check_shape, _check_device_as, _check_like,
                      _check_positive_finite, _check_softcap, _check_qkv, _check_probability,
                      _check_seed, _check_row_offset, _check_activation, _check_dropout_streams,
                      _check_rms, _check_rope, _rope_out_like, _stat_dtype, _check_lce,
                      _check_attention_bwd, _check_swiglu_fwd, _check_swiglu_bwd,
                      _check_lce_bwd, _check_lce_transform, _check_norm_rounding,
                      _check_bool, _check_eps, _check_number)
from ._normed_head import norm_rows, normed_loss_per_token

__all__ = ["attention", "swiglu_mlp", "rms_norm", "add_rms_norm", "rope", "linear_cross_entropy"]

_ops = torch.ops.ckpt_ext


# --------------------------------------------------------------------------------------------
# Fake implementations: shapes and dtypes exactly as the real ops return them
# --------------------------------------------------------------------------------------------
def _empty_bshd(like, B, H, S, D):
    return like.new_empty((B, S, H, D)).transpose(1, 2)


@torch.library.register_fake("ckpt_ext::attention_fwd")
def _attention_fwd_fake(q, k, v, key_padding_mask, segment_ids, window, causal, scale,
                        q_offset=0, softcap=0.0):
    B, Hq, _, Sq, _, D = _check_qkv("attention_fwd", q, k, v, key_padding_mask, segment_ids,
                                    window, scale, q_offset, softcap)
    # out, dq, dk, dv: (B, H, S, D) views of (B, S, H, D) memory, as the kernels return them.
    return _empty_bshd(q, B, Hq, Sq, D), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.register_fake("ckpt_ext::attention_bwd")
def _attention_bwd_fake(dout, q, k, v, out, lse, key_padding_mask, segment_ids, window, causal,
                        scale, q_offset=0, dk_acc=None, dv_acc=None, softcap=0.0):
    B, Hq, Hkv, Sq, Sk, D = _check_attention_bwd("attention_bwd", dout, q, k, v, out, lse,
                                                 key_padding_mask, segment_ids, window, scale,
                                                 q_offset, dk_acc, dv_acc, softcap)
    if dk_acc is not None:  # the shares went into the accumulators: (0,) placeholders
        return _empty_bshd(q, B, Hq, Sq, D), k.new_empty((0,)), v.new_empty((0,))
    return (_empty_bshd(q, B, Hq, Sq, D), _empty_bshd(q, B, Hkv, Sk, D),
            _empty_bshd(q, B, Hkv, Sk, D))


@torch.library.register_fake("ckpt_ext::swiglu_fwd")
def _swiglu_fwd_fake(x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling,
                     return_gate_up, lora_dropout=(), dropout_seed=None, dropout_row_offset=0,
                     dropout_streams=(), activation="silu"):
    _check_row_offset("swiglu_fwd", "dropout_row_offset", dropout_row_offset)
    _check_dropout_streams("swiglu_fwd", dropout_streams)
    T, H, I, _ = _check_swiglu_fwd("swiglu_fwd", x, w_gate, w_up, w_down, b_gate, b_up, b_down,
                                   lora, lora_scaling, lora_dropout, dropout_seed, activation)
    gate_up_shape = (T, I) if return_gate_up else (0,)
    return x.new_empty((T, H)), x.new_empty(gate_up_shape), x.new_empty(gate_up_shape)


@torch.library.register_fake("ckpt_ext::swiglu_bwd")
def _swiglu_bwd_fake(dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling,
                     gate, up, needs_grad, lora_dropout=(), dropout_seed=None,
                     dropout_row_offset=0, dropout_streams=(), activation="silu",
                     dw_gate_sum=None, dw_up_sum=None, dw_down_sum=None, sum_beta=0.0,
                     lora_a_gate_sum=None, lora_b_gate_sum=None, lora_a_up_sum=None,
                     lora_b_up_sum=None, lora_a_down_sum=None, lora_b_down_sum=None):
    totals = [lora_a_gate_sum, lora_b_gate_sum, lora_a_up_sum, lora_b_up_sum, lora_a_down_sum,
              lora_b_down_sum]
    _check_row_offset("swiglu_bwd", "dropout_row_offset", dropout_row_offset)
    _check_dropout_streams("swiglu_bwd", dropout_streams)
    T, H, I, lora = _check_swiglu_bwd("swiglu_bwd", dy, x, w_gate, w_up, w_down, b_gate, b_up,
                                      b_down, lora, lora_scaling, gate, up, needs_grad,
                                      lora_dropout, dropout_seed, activation,
                                      (dw_gate_sum, dw_up_sum, dw_down_sum), totals)

    def grad(wanted, t, shape=None, total=None):
        """A gradient of t's shape (or `shape`) and x's dtype where computed, else (0,); with
        its sum over chunks given, a tensor like the sum."""
        if not wanted or t is None:
            return x.new_empty((0,))
        if total is not None:
            return total.new_empty(total.shape)
        return x.new_empty(t.shape if shape is None else shape)

    dlora = [x.new_empty((0,)) if t is None or not needs_grad[6 + i]
             else (t if totals[i] is None else totals[i]).new_empty(t.shape)
             for i, t in enumerate(lora)]
    return (x.new_empty((T, H)), grad(needs_grad[0], w_gate, total=dw_gate_sum),
            grad(needs_grad[1], w_up, total=dw_up_sum),
            grad(needs_grad[2], w_down, total=dw_down_sum), grad(needs_grad[3], b_gate),
            grad(needs_grad[4], b_up), grad(needs_grad[5], b_down), dlora)


@torch.library.register_fake("ckpt_ext::lora_dropout")
def _lora_dropout_fake(x, seed, stream, p, row_offset=0):
    op = "lora_dropout"
    _check_floating(op, "x", x)
    _check_probability(op, "p", p)
    _check_row_offset(op, "row_offset", row_offset)
    _check_seed(op, "seed", seed)
    return x.new_empty(x.shape)


@torch.library.register_fake("ckpt_ext::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, eps):
    _check_rms("rms_norm_fwd", x, weight)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.register_fake("ckpt_ext::rms_norm_bwd")
def _rms_norm_bwd_fake(dy, x, weight, eps):
    op = "rms_norm_bwd"
    _check_rms(op, x, weight)
    _check_shape(op, "dy", dy, x.shape, "(the shape of x)")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if dy.dtype != out_dtype:
        raise TypeError(f"{op}: dy must be {_dtype(out_dtype)} (the output dtype, "
                        f"promote_types(x, weight)), got {_dtype(dy.dtype)}")
    _check_device_as(op, "dy", dy, "x", x)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("ckpt_ext::add_rms_norm_fwd")
def _add_rms_norm_fwd_fake(x, residual, weight, eps):
    op = "add_rms_norm_fwd"
    _check_rms(op, x, weight)
    _check_like(op, "residual", residual, "x", x, x.shape, "(the shape of x)")
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape)


@torch.library.register_fake("ckpt_ext::rope_fwd")
def _rope_fwd_fake(q, k, cos, sin):
    _check_rope("rope_fwd", "q", q, "k", k, cos, sin)
    return _rope_out_like(q), _rope_out_like(k)


@torch.library.register_fake("ckpt_ext::rope_bwd")
def _rope_bwd_fake(dq_out, dk_out, cos, sin):
    _check_rope("rope_bwd", "dq_out", dq_out, "dk_out", dk_out, cos, sin)
    return _rope_out_like(dq_out), _rope_out_like(dk_out)


# --------------------------------------------------------------------------------------------
# Autograd of the forward ops
# --------------------------------------------------------------------------------------------
# What ops.attention(..., deterministic=) asks of the backward of the forward running in this
# thread, (attention_dq value, config.determinism() answer or None), for _attention_setup to
# hand to the backward (the ops' schemas do not carry it).
_dq_request = threading.local()


def _attention_setup(ctx, inputs, output):
    q, k, v, key_padding_mask, segment_ids, window, causal, scale = inputs[:8]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, segment_ids)
    ctx.window, ctx.causal, ctx.scale = window, causal, scale
    # None: the setting (and torch's determinism flag) at backward time
    ctx.dq_mode, ctx.determinism = getattr(_dq_request, "mode", None) or (None, None)
    ctx.q_offset = inputs[8] if len(inputs) > 8 else 0
    ctx.softcap = inputs[9] if len(inputs) > 9 else 0.0
    ctx.num_inputs = len(inputs)


def _attention_backward(ctx, dout, dlse):
    q, k, v, out, lse, key_padding_mask, segment_ids = ctx.saved_tensors
    args = (dout, q, k, v, out, lse, key_padding_mask, segment_ids, ctx.window, ctx.causal,
            ctx.scale, ctx.q_offset, None, None, ctx.softcap)
    if ctx.dq_mode is None:
        dq, dk, dv = _ops.attention_bwd(*args)
    else:
        with config.patch(attention_dq=ctx.dq_mode), config.asking_determinism(ctx.determinism):
            dq, dk, dv = _ops.attention_bwd(*args)
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


def _swiglu_setup(ctx, inputs, output):
    (x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling, return_gate_up,
     lora_dropout, dropout_seed) = inputs[:12]
    ctx.dropout_row_offset = inputs[12] if len(inputs) > 12 else 0
    ctx.dropout_streams = inputs[13] if len(inputs) > 13 else []
    ctx.activation = inputs[14] if len(inputs) > 14 else "silu"
    _, gate, up = output
    ctx.mark_non_differentiable(gate, up)
    if any(t is None for t in lora) and any(t is not None and t.requires_grad for t in lora):
        # torch.library's autograd tracks a Tensor?[] input only when no entry is None.
        raise NotImplementedError(
            "swiglu_fwd: autograd through adapters on only some projections is not supported "
            "(a lora list with None entries is not tracked); call "
            "torch.ops.ckpt_ext.swiglu_bwd directly, or detach the adapters")
    ctx.n_lora = len(lora)
    ctx.lora_scaling = list(lora_scaling)
    ctx.lora_dropout = list(lora_dropout)
    # The gradient structure mirrors the inputs': [] for an empty list, None for a default.
    ctx.dropout_grad = [] if isinstance(lora_dropout, list) and not lora_dropout else None
    ctx.dropout_seed = dropout_seed  # a CPU scalar tensor
    # save="input": x (the weights, biases and adapters are parameters); save="gate_up": also
    # gate, up.
    saved = (x, w_gate, w_up, w_down, b_gate, b_up, b_down, *lora)
    ctx.save_for_backward(*saved, *((gate, up) if return_gate_up else (None, None)))


def _swiglu_backward(ctx, dy, dgate, dup):
    saved = ctx.saved_tensors
    n = ctx.n_lora
    lora = list(saved[7:7 + n])
    gate, up = saved[7 + n:]
    need = ctx.needs_input_grad
    # needs_input_grad holds one flag per adapter when lora is a list of tensors ([] for []),
    # a single False when it holds None entries (not tracked, see _swiglu_setup); the
    # gradients returned must have the same structure (an empty list for an empty list).
    lora_need = [bool(f) for f in need[7]] if isinstance(need[7], (list, tuple)) else [False] * n
    needs = [bool(f) for f in need[1:7]] + (lora_need or [False] * 6)
    grads = _ops.swiglu_bwd(dy, *saved[:7], lora, ctx.lora_scaling, gate, up, needs,
                            ctx.lora_dropout, ctx.dropout_seed, ctx.dropout_row_offset,
                            ctx.dropout_streams, ctx.activation)
    dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, dlora = grads

    def keep(flag, g):
        return g if flag else None

    dlora_out = ([keep(f, g) for f, g in zip(lora_need, dlora)]
                 if isinstance(need[7], (list, tuple)) else None)
    grads = (dx, keep(need[1], dw_gate), keep(need[2], dw_up), keep(need[3], dw_down),
             keep(need[4], db_gate), keep(need[5], db_up), keep(need[6], db_down),
             dlora_out, [] if not ctx.lora_scaling else None, None, ctx.dropout_grad, None,
             None, [] if not ctx.dropout_streams else None, None)
    # One gradient per argument the caller passed: the trailing lora_dropout / dropout_seed /
    # dropout_row_offset / dropout_streams / activation may have been left to their defaults
    # (needs_input_grad has one entry per passed one).
    return grads[:len(need)]


def _lora_dropout_setup(ctx, inputs, output):
    _, seed, stream, p = inputs[:4]
    ctx.seed, ctx.stream, ctx.p = seed, stream, p
    ctx.row_offset = inputs[4] if len(inputs) > 4 else 0


def _lora_dropout_backward(ctx, dy):
    # The mask is a function of (seed, stream, element): the adjoint applies the same one.
    dx = _ops.lora_dropout(dy, ctx.seed, ctx.stream, ctx.p, ctx.row_offset)
    return (dx,) + (None,) * (len(ctx.needs_input_grad) - 1)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dweight = _ops.rms_norm_bwd(dy, x, weight, ctx.eps)
    return dx, dweight, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps = inputs
    _, s = output
    ctx.save_for_backward(s, weight)  # y = rms_norm(s): s is all the norm needs
    ctx.eps = eps


def _add_rms_norm_backward(ctx, dy, ds):
    s, weight = ctx.saved_tensors
    dsum, dweight = _ops.rms_norm_bwd(dy, s, weight, ctx.eps)
    if ds is not None:
        dsum = dsum + ds
    return dsum, dsum.clone(), dweight, None  # d/dx = d/dresidual; two tensors, no aliasing


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rope_backward(ctx, dq_out, dk_out):
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError("ckpt_ext.ops.rope: cos and sin are treated as constants (as HF "
                           "computes them under no_grad); gradients w.r.t. cos/sin are not "
                           "supported, detach them")
    cos, sin = ctx.saved_tensors
    dq, dk = _ops.rope_bwd(dq_out, dk_out, cos, sin)
    return dq, dk, None, None


def _no_double_backward(name):
    def setup(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise RuntimeError(f"ckpt_ext: {name} has no derivative; double backward through "
                           f"ckpt_ext ops is not supported")

    torch.library.register_autograd(f"ckpt_ext::{name}", backward, setup_context=setup)


torch.library.register_autograd("ckpt_ext::attention_fwd", _attention_backward,
                                setup_context=_attention_setup)
torch.library.register_autograd("ckpt_ext::swiglu_fwd", _swiglu_backward,
                                setup_context=_swiglu_setup)
torch.library.register_autograd("ckpt_ext::lora_dropout", _lora_dropout_backward,
                                setup_context=_lora_dropout_setup)
torch.library.register_autograd("ckpt_ext::rms_norm_fwd", _rms_norm_backward,
                                setup_context=_rms_norm_setup)
torch.library.register_autograd("ckpt_ext::add_rms_norm_fwd", _add_rms_norm_backward,
                                setup_context=_add_rms_norm_setup)
torch.library.register_autograd("ckpt_ext::rope_fwd", _rope_backward, setup_context=_rope_setup)
for _name in ("swiglu_bwd", "rms_norm_bwd", "rope_bwd"):
    _no_double_backward(_name)


# attention_bwd mutates its optional dk_acc / dv_acc, and torch.library.register_autograd takes
# only functional ops: its Autograd kernel is registered directly, an autograd.Function that runs
# the op below autograd and refuses to be differentiated, as _no_double_backward does.
class _AttentionBwdNoDerivative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return _ops.attention_bwd.default(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("ckpt_ext: attention_bwd has no derivative; double backward through "
                           "ckpt_ext ops is not supported")


def _attention_bwd_autograd(*args):
    return _AttentionBwdNoDerivative.apply(*args)


_AUTOGRAD_LIB = torch.library.Library("ckpt_ext", "IMPL")
_AUTOGRAD_LIB.impl("attention_bwd", _attention_bwd_autograd, "Autograd")


# --------------------------------------------------------------------------------------------
# Public wrappers
# --------------------------------------------------------------------------------------------
def attention(q, k, v, *, causal=True, scale=None, key_padding_mask=None, segment_ids=None,
              window=None, deterministic=None, q_offset=0, softcap=0.0):
    """Scaled dot-product attention with GQA, causal, key-padding, packed-sequence and
    sliding-window masks.

    Args:
        q: (B, Hq, S, D); k, v: (B, Hkv, S, D) with Hq % Hkv == 0 (query head h reads kv head
            h // (Hq // Hkv)); one floating dtype; any strides.
        causal: query i attends keys j <= i.
        scale: multiplies q k^T, a finite number > 0; default 1 / sqrt(D).
        key_padding_mask: None or bool (B, S), True = the key may be attended.
        segment_ids: None or int32 / int64 (B, S): packed sequences; query i attends key j only
            if segment_ids[b, i] == segment_ids[b, j] (any ids; contiguous runs of equal ids
            let the kernels skip whole tiles).
        window: None or int > 0, HF's sliding window (transformers' sliding_window_overlay):
            key j is visible from query i iff ``i - window < j``, so with causal
            ``i - window < j <= i`` (window=1: each token sees itself). Not causal: also
            ``j < i + window``, i.e. ``|i - j| < window`` (HF's bidirectional window w, which
            keeps ``|i - j| <= w``, is window=w + 1). None, or window >= S: no window.
        The rules combine: a key is attended only if every rule given allows it.
        deterministic: whether the backward must be bit-reproducible (as flash-attention's
            ``deterministic=``), whatever torch's determinism flag says. None (default): the
            ``attention_dq`` setting of ``ckpt_ext.config`` when the backward runs (``"auto"``
            unless changed: torch's flag decides, ``torch.use_deterministic_algorithms(True)``
            deterministic backwards only). True: under ``"auto"`` the fastest deterministic
            backward, as with torch's flag on; under ``"separate"`` or ``"ordered"`` that
            mode; under ``"atomic"`` ``"separate"``. False: under ``"auto"`` the fastest
            backward, as with the flag off; otherwise dQ added by the dK/dV kernel with fp32
            atomics (``"atomic"``: fewer matmuls; the sums' order, hence their last bits, vary
            between runs). The CPU ATen kernels are deterministic either way. Not supported
            under ``torch.compile`` (the backward op does not take it there); use
            ``ckpt_ext.config.patch(attention_dq=...)``.
        q_offset: int >= 0; q may hold fewer rows than k (Sq <= Sk): the queries at positions
            q_offset..q_offset+Sq-1 (q_offset + Sq <= Sk), one chunk of a longer sequence. The
            rules above read those positions; masks and ids are then (B, Sk). Gradients reach
            k and v through this chunk's rows only.
        softcap: float >= 0; > 0 caps each scaled score s to ``softcap * tanh(s / softcap)``
            before the masks and the softmax (Gemma 2's attn_logit_softcapping, as HF's eager
            attention computes it); 0 (default): no cap.

    Returns:
        out (B, Hq, Sq, D) in q's dtype, laid out (B, Sq, Hq, D) in memory (so
        ``out.transpose(1, 2).reshape(B, Sq, Hq * D)`` is a view). A query row with nothing to
        attend gives 0 (and zero gradients). Saves q, k, v, out and lse for backward, which
        recomputes the softmax tile by tile.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise TypeError(f"attention: window must be None or an int, got {type(window).__name__}")
    if window is not None and window <= 0:
        raise ValueError(f"attention: window must be > 0 (key j is visible from query i iff "
                         f"i - window < j <= i), got {window}")
    _check_bool("attention", "causal", causal)
    _check_bool("attention", "deterministic", deterministic, allow_none=True)
    if deterministic is not None and torch.compiler.is_compiling():
        raise NotImplementedError(
            "attention: deterministic= is not supported under torch.compile (the compiled "
            "backward would not see it); set ckpt_ext.config.patch(attention_dq='separate' / "
            "'ordered' / 'atomic') or CKPT_EXT_ATTN_DQ instead")
    if scale is None:
        D = q.shape[-1] if q.dim() == 4 else 0
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0  # D = 0 / wrong rank: the op says why
    _check_number("attention", "scale", scale)
    _check_positive_finite("attention", "scale", float(scale))
    _check_number("attention", "softcap", softcap)
    if isinstance(q_offset, bool) or not isinstance(q_offset, int):
        raise TypeError(f"attention: q_offset must be an int, got {type(q_offset).__name__}")
    _check_softcap("attention", float(softcap))
    args = (q, k, v, key_padding_mask, segment_ids, window, causal, float(scale), q_offset,
            float(softcap))
    if deterministic is None:
        out, _ = _ops.attention_fwd(*args)
        return out
    setting = config.current().attention_dq
    if setting == "auto":   # torch's flag answered for this backward: on, or off
        _dq_request.mode = ("auto", "strict" if deterministic else "off")
    elif deterministic:     # the setting when it is a deterministic one, else "separate"
        _dq_request.mode = (setting if setting in config.DETERMINISTIC_DQ else "separate", None)
    else:
        _dq_request.mode = ("atomic", None)
    try:
        out, _ = _ops.attention_fwd(*args)
    finally:
        _dq_request.mode = None
    return out


def swiglu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, save="input",
               activation="silu"):
    """LLaMA feed-forward: ``down(silu(gate(x)) * up(x))``, weights in nn.Linear layout.

    Args:
        x: (..., H); w_gate, w_up: (I, H); w_down: (H, I); b_gate, b_up: None or (I,);
            b_down: None or (H,); all of x's dtype and device.
        save: "input" keeps only x for backward (gate and up are recomputed from x);
            "gate_up" also keeps the (T, I) pre-activations gate and up.
        activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma's MLP:
            ``gelu(gate(x), approximate="tanh")`` in place of silu).

    Returns:
        y (..., H) in x's dtype.
    """
    if save not in ("input", "gate_up"):
        raise ValueError(f"swiglu_mlp: save must be 'input' or 'gate_up', got {save!r}")
    _check_activation("swiglu_mlp", activation)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"swiglu_mlp: x must have shape (..., H), got {got}")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])  # (T, H)
    y, _, _ = _ops.swiglu_fwd(x2, w_gate, w_up, w_down, b_gate, b_up, b_down, [], [],
                              save == "gate_up", activation=activation)
    return y.reshape(*lead, y.shape[-1])


def rms_norm(x, weight, eps, *, offset=0.0, cast_last=False):
    """HF LlamaRMSNorm: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.

    x: (..., N); weight: (N,). Returns (..., N) of dtype promote_types(x, weight). Saves x.

    ``offset`` and ``cast_last`` give the other families' RMSNorms: the weight is
    ``offset + weight`` (Gemma: 1.0), and with ``cast_last`` the weight multiplies the float32
    normalised rows and the product is cast to x's dtype (Gemma, OLMo-2: the result has x's
    dtype; backward then also keeps a float32 copy of x).
    """
    _check_norm_rounding("rms_norm", offset, cast_last, ("offset", "cast_last"))
    _check_eps("rms_norm", "eps", eps)
    if offset == 0.0 and not cast_last:
        return _ops.rms_norm_fwd(x, weight, float(eps))
    return norm_rows(x, weight, float(eps), float(offset), cast_last)


def add_rms_norm(x, residual, weight, eps):
    """s = x + residual; returns (rms_norm(s, weight, eps), s). x, residual: (..., N)."""
    _check_eps("add_rms_norm", "eps", eps)
    return _ops.add_rms_norm_fwd(x, residual, weight, float(eps))


def rope(q, k, cos, sin):
    """HF apply_rotary_pos_emb: ``t * cos + rotate_half(t) * sin`` for t in (q, k).

    q: (B, Hq, S, D); k: (B, Hkv, S, D); cos, sin: (B or 1, S, R) as HF's rotary embedding
    returns them (broadcast over heads; constants for autograd), R = D or, for partial rotary
    embeddings, an even R < D: then the first R dims of each head rotate (rotate_half within
    them) and the other D - R pass through, as HF's Phi-3 / Phi-4. Returns (q_out, k_out),
    each with its input's strides when that is dense with a unit last stride (a (B, H, S, D)
    view of (B, S, H, D) memory stays one), contiguous otherwise; the gradients likewise.
    """
    return _ops.rope_fwd(q, k, cos, sin)


# --------------------------------------------------------------------------------------------
# LM head + cross-entropy loss without (T, V) logits: checks, fakes, autograd, wrapper
# --------------------------------------------------------------------------------------------
@torch.library.register_fake("ckpt_ext::linear_cross_entropy_fwd")
def _linear_cross_entropy_fwd_fake(hidden, weight, bias, labels, ignore_index, logit_scale=1.0,
                                   softcap=0.0):
    T, _, _ = _check_lce("linear_cross_entropy_fwd", hidden, weight, bias, labels, logit_scale,
                         softcap)
    return (hidden.new_empty((T,), dtype=_stat_dtype(hidden)),
            hidden.new_empty((T,), dtype=_stat_dtype(hidden)))


@torch.library.register_fake("ckpt_ext::linear_cross_entropy_bwd")
def _linear_cross_entropy_bwd_fake(dloss, hidden, weight, bias, labels, lse, ignore_index,
                                   output_mask, logit_scale=1.0, softcap=0.0):
    op = "linear_cross_entropy_bwd"
    T, H, V = _check_lce_bwd(op, dloss, hidden, weight, bias, labels, lse, logit_scale, softcap)
    want_dh, want_dw, want_db = _check_lce_output_mask(op, output_mask)
    return (hidden.new_empty((T, H) if want_dh else (0,)),
            hidden.new_empty((V, H) if want_dw else (0,)),
            hidden.new_empty((V,) if bias is not None and want_db else (0,)))


def _check_lce_output_mask(op, output_mask):
    """output_mask of linear_cross_entropy_bwd: three bools [dhidden, dweight, dbias]."""
    if len(output_mask) != 3:
        raise ValueError(f"{op}: output_mask must have 3 entries [dhidden, dweight, dbias], "
                         f"got {len(output_mask)}")
    return tuple(bool(m) for m in output_mask)


def _linear_cross_entropy_setup(ctx, inputs, output):
    hidden, weight, bias, labels, ignore_index, logit_scale, softcap = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    # hidden, labels and the per-token lse: nothing of size (T, V).
    ctx.save_for_backward(hidden, weight, bias, labels, lse)
    ctx.ignore_index, ctx.logit_scale, ctx.softcap = ignore_index, logit_scale, softcap
    ctx.has_bias = bias is not None


def _linear_cross_entropy_backward(ctx, dloss, dlse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    # Only the gradients autograd asks for are formed: a frozen LM head (LoRA) gets no (V, H)
    # dweight and no dweight GEMM, a frozen hidden no dhidden.
    want_dh, want_dw, want_db = ctx.needs_input_grad[:3]
    want_db = want_db and ctx.has_bias
    if not (want_dh or want_dw or want_db):
        return (None,) * 7
    if dloss is None:
        dloss = torch.zeros_like(lse)
    dhidden, dweight, dbias = _ops.linear_cross_entropy_bwd(
        dloss, hidden, weight, bias, labels, lse, ctx.ignore_index, [want_dh, want_dw, want_db],
        ctx.logit_scale, ctx.softcap)
    return (dhidden if want_dh else None, dweight if want_dw else None,
            dbias if want_db else None, None, None, None, None)


torch.library.register_autograd("ckpt_ext::linear_cross_entropy_fwd",
                                _linear_cross_entropy_backward,
                                setup_context=_linear_cross_entropy_setup)
_no_double_backward("linear_cross_entropy_bwd")

_REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100,
                         reduction="mean", num_items_in_batch=None, norm_weight=None,
                         norm_eps=None, norm_offset=0.0, norm_cast_last=False,
                         logit_scale=1.0, softcap=0.0):
    """Cross-entropy of the LM head ``hidden @ weight.T + bias`` against ``labels``, without
    the (T, V) logits: forward keeps per-token float32 statistics, backward recomputes the
    logits chunk by chunk. With ``norm_weight``, the head reads ``rms_norm(hidden)`` (a
    model's final RMSNorm, as ``rms_norm`` computes it) and the norm runs inside the op.
    With ``logit_scale`` / ``softcap`` the loss reads transformed logits (below).

    Args:
        hidden: (..., H) float16 / bfloat16 / float32 (float64 on CPU), T tokens in all.
        weight: (V, H) in nn.Linear layout; bias: None or (V,); dtype and device of hidden.
        labels: (...) int64 with hidden's leading shape, each in [0, V) or ignore_index.
            Already aligned with hidden: for causal LM training shift them first, as HF's
            ``ForCausalLMLoss`` does (``labels[..., 1:]`` padded with ignore_index).
        reduction: "mean" (over the tokens whose label is not ignore_index, or divided by
            ``num_items_in_batch`` when given), "sum", or "none" (per-token losses, shape of
            labels, 0 on ignored tokens).
        ignore_index: an int (a numpy or one-element integer tensor counts as the int it
            holds); a float or string is refused, never truncated.
        num_items_in_batch: None, a number >= 0, or a tensor with one element (kept a tensor:
            no host sync) to divide the summed loss by instead of the count of non-ignored
            tokens, as transformers' ``fixed_cross_entropy`` does under gradient accumulation.
            Only with "mean". Other forms raise, naming it.
        norm_weight, norm_eps: None, or the weight (H,) and eps of an RMSNorm applied to
            hidden before the head (both or neither). The normed rows are cast to weight's
            dtype, as a Linear under autocast casts its input. The op then keeps only the
            pre-norm hidden: forward and backward walk the tokens in chunks of the byte cap
            ``CKPT_EXT_CHUNK_BYTES`` and recompute each chunk's normed rows, so no normed
            copy and no fp32 copy of the hidden state is kept (``ckpt_ext._normed_head``).
        norm_offset, norm_cast_last: the final norm's rounding, as ``rms_norm``'s ``offset``
            and ``cast_last`` (Gemma: 1.0 and True; OLMo-2: 0.0 and True). Only with
            norm_weight.
        logit_scale: a finite number > 0 the logits are multiplied by (Granite's
            ``1 / config.logits_scaling``); 1 leaves them as they are.
        softcap: a finite number >= 0; when > 0 the loss reads ``softcap * tanh(logit_scale *
            logits / softcap)`` (Gemma 2's ``config.final_logit_softcapping``); 0: no cap.
            Both apply in float32 to the logits rounded to the input dtype, in the forward
            and in the backward's recomputed tiles. Zero, negative or non-finite values (a
            zero softcap excepted) raise a ValueError naming the argument.

    Returns:
        The loss in float32 (float64 for float64 inputs), as HF computes it on upcast logits.
        A mean with nothing to average (every label ignored, or num_items_in_batch == 0) is 0
        with zero gradients, where ``F.cross_entropy`` gives NaN.

    Saves for backward: hidden, labels and the fp32 log-sum-exp per token (plus the weight,
    bias and norm weight, which are parameters); no tensor of T x V elements. Backward
    computes only the gradients of the inputs that require grad: a frozen weight (a LoRA
    model's LM head) gets no (V, H) gradient and no GEMM for it.
    """
    name = "linear_cross_entropy"
    ignore_index, num_items_in_batch = _check_lce_options(name, ignore_index, reduction,
                                                          num_items_in_batch)
    _check_lce_transform(name, logit_scale, softcap)
    logit_scale, softcap = float(logit_scale), float(softcap)
    if (norm_weight is None) != (norm_eps is None):
        raise ValueError(f"{name}: norm_weight and norm_eps go together (the final RMSNorm's "
                         f"weight and eps), got only "
                         f"{'norm_weight' if norm_eps is None else 'norm_eps'}")
    if norm_weight is not None:
        if not isinstance(norm_weight, torch.Tensor):
            raise TypeError(f"{name}: norm_weight must be a tensor (H,), got "
                            f"{type(norm_weight).__name__}")
        _check_number(name, "norm_eps", norm_eps)
        _check_positive_finite(name, "norm_eps", norm_eps)
    _check_norm_rounding(name, norm_offset, norm_cast_last)
    if norm_weight is None and (norm_offset != 0.0 or norm_cast_last):
        raise ValueError(f"{name}: norm_offset and norm_cast_last describe the final norm; "
                         f"pass them with norm_weight and norm_eps")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"{name}: hidden must have shape (..., H), got {got}")
    if not isinstance(labels, torch.Tensor) or labels.shape != hidden.shape[:-1]:
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"{name}: labels must have shape hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}, got {got}")
    lead = hidden.shape[:-1]
    T = math.prod(lead)
    flat_labels = labels.reshape(T)
    flat = hidden.reshape(T, hidden.shape[-1])
    if norm_weight is None:
        loss, _ = _ops.linear_cross_entropy_fwd(flat, weight, bias, flat_labels,
                                                int(ignore_index), logit_scale, softcap)
    else:
        loss = normed_loss_per_token(flat, norm_weight, norm_eps, weight, bias, flat_labels,
                                     ignore_index, logit_scale, softcap, float(norm_offset),
                                     norm_cast_last)
    if reduction == "none":
        return loss.reshape(lead)
    total = loss.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is None:
        count = (flat_labels != ignore_index).sum()
    elif isinstance(num_items_in_batch, torch.Tensor):
        count = num_items_in_batch.to(total.device)
    elif num_items_in_batch == 0:
        return total * 0.0  # nothing to average: 0, with zero gradients
    else:
        return total / num_items_in_batch
    # A zero count gives 0 with zero gradients, without a host sync; the divisor is never 0.
    nonzero = count != 0
    return total * nonzero / torch.where(nonzero, count, torch.ones_like(count))


def _check_lce_options(name, ignore_index, reduction, num_items_in_batch):
    """The non-tensor options of linear_cross_entropy, checked: (ignore_index as an int,
    num_items_in_batch as None, a number >= 0 or a 0-d tensor)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, torch.Tensor) and ignore_index.numel() == 1 and \
            not ignore_index.dtype.is_floating_point and not ignore_index.dtype.is_complex:
        ignore_index = ignore_index.item()
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{name}: ignore_index must be an int, got {ignore_index!r}")
    ignore_index = int(ignore_index)
    if num_items_in_batch is None:
        return ignore_index, None
    if reduction != "mean":
        raise ValueError(f"{name}: num_items_in_batch replaces the divisor of reduction='mean'; "
                         f"got it with reduction={reduction!r}")
    if isinstance(num_items_in_batch, torch.Tensor):
        t = num_items_in_batch
        if t.numel() != 1 or t.dtype == torch.bool or t.dtype.is_complex:
            raise ValueError(f"{name}: num_items_in_batch must be a number or a tensor with one "
                             f"real element, got a {str(t.dtype).replace('torch.', '')} tensor "
                             f"of shape {tuple(t.shape)}")
        return ignore_index, t.reshape(())
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, numbers.Real):
        raise TypeError(f"{name}: num_items_in_batch must be None, a number or a tensor, got "
                        f"{type(num_items_in_batch).__name__} {num_items_in_batch!r}")
    if not (math.isfinite(num_items_in_batch) and num_items_in_batch >= 0):
        raise ValueError(f"{name}: num_items_in_batch must be finite and >= 0, got "
                         f"{num_items_in_batch!r}")
    return ignore_index, num_items_in_batch
