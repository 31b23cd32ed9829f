"""Argument checks of the ckpt_ext kernel ops in Python: the same rules, exception types and
messages as ``csrc/checks.h``, used by the fakes (``ckpt_ext.ops``, what ``torch.compile`` and
meta tensors run) and by the Triton launchers (``ckpt_ext.kernels``), so that an op rejects
bad input in the same words whichever implementation serves it.

Exception types, as the C++ checks raise them: ValueError for a wrong shape, size or value;
TypeError for a wrong dtype; RuntimeError for tensors on different devices (TORCH_CHECK).
"""
import math
import numbers

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t):
    return str(tuple(t.shape))


def _dtype(dt):
    return str(dt).replace("torch.", "")


def _check_floating(op, name, t):
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, got "
                        f"{_dtype(t.dtype)}")


def _check_dim(op, name, t, dim, layout):
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dims {layout}, got shape {_shape(t)}")


def _check_shape(op, name, t, shape, why):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)} {why}, got {_shape(t)}")


def _check_dtype_as(op, name, t, ref_name, ref):
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of {ref_name} ({_dtype(ref.dtype)}), "
                        f"got {_dtype(t.dtype)}")


def _check_device_as(op, name, t, ref_name, ref):
    if t.device != ref.device:
        raise RuntimeError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                           f"all tensors must be on one device")


def _check_like(op, name, t, ref_name, ref, shape, why):
    _check_shape(op, name, t, shape, why)
    _check_dtype_as(op, name, t, ref_name, ref)
    _check_device_as(op, name, t, ref_name, ref)


def _absent(t):
    """None or the (0,) placeholder of an output that does not apply."""
    return t is None or (t.dim() == 1 and t.numel() == 0)


def _check_bool(op, name, x, allow_none=False):
    """``x`` is True or False (or None where ``allow_none``): a flag is never read by
    truthiness, so None, 0 or "no" cannot pass for a setting they do not name."""
    if not (isinstance(x, bool) or (allow_none and x is None)):
        allowed = "None, True or False" if allow_none else "a bool (True or False)"
        raise TypeError(f"{op}: {name} must be {allowed}, got {type(x).__name__} {x!r}")


def _check_number(op, name, x):
    """``x`` is a real number (not a bool, not None): a number argument is never read by
    coercion, so True cannot pass for 1.0."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{op}: {name} must be a number, got {type(x).__name__} {x!r}")


def _check_eps(op, name, eps):
    """An RMSNorm's eps: a finite number >= 0."""
    _check_number(op, name, eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: {name} must be a finite number >= 0, got {eps}")


def _check_positive_finite(op, name, x):
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{op}: {name} must be a finite number > 0, got {x}")


def _check_softcap(op, softcap):
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{op}: softcap must be a finite number >= 0 (0: no cap), got {softcap}")


def _check_qkv(op, q, k, v, key_padding_mask, segment_ids=None, window=None, scale=1.0,
               q_offset=0, softcap=0.0):
    """q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), 0 <= q_offset, q_offset + Sq <= Sk, mask (B, Sk)
    bool, segment_ids (B, Sk) int32/int64, window > 0, scale finite > 0, softcap finite >= 0.
    Returns (B, Hq, Hkv, Sq, Sk, D)."""
    _check_dim(op, "q", q, 4, "(B, Hq, Sq, D)")
    _check_dim(op, "k", k, 4, "(B, Hkv, Sk, D)")
    _check_dim(op, "v", v, 4, "(B, Hkv, Sk, D)")
    _check_floating(op, "q", q)
    _check_dtype_as(op, "k", k, "q", q)
    _check_dtype_as(op, "v", v, "q", q)
    _check_device_as(op, "k", k, "q", q)
    _check_device_as(op, "v", v, "q", q)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if B == 0:
        raise ValueError(f"{op}: q has an empty batch (B=0); attention needs B >= 1")
    if D == 0:
        raise ValueError(f"{op}: q must have head dim D >= 1, got D=0")
    if Hq == 0:
        raise ValueError(f"{op}: q must have at least one head, got Hq=0")
    for i, what, sym, size in ((0, "batch size", "B", B), (3, "head dim", "D", D)):
        if k.shape[i] != size:
            raise ValueError(f"{op}: k must have the {what} of q ({sym}={size}), got "
                             f"{k.shape[i]} in shape {_shape(k)}")
    if Sk < Sq:
        raise ValueError(f"{op}: k must have at least the sequence length of q (Sq={Sq}), got "
                         f"{Sk} in shape {_shape(k)}")
    if not 0 <= q_offset <= Sk - Sq:
        raise ValueError(f"{op}: q_offset must satisfy 0 <= q_offset and q_offset + Sq <= Sk "
                         f"(q holds the queries at positions q_offset..q_offset+Sq-1 of the Sk "
                         f"keys), got q_offset={q_offset} with Sq={Sq}, Sk={Sk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: k must have Hkv dividing Hq={Hq}, got Hkv={Hkv}")
    _check_shape(op, "v", v, k.shape, "(the shape of k)")
    if key_padding_mask is not None:
        m = key_padding_mask
        if m.dtype != torch.bool:
            raise TypeError(f"{op}: key_padding_mask must be bool (True = may be attended), got "
                            f"{_dtype(m.dtype)}")
        _check_shape(op, "key_padding_mask", m, (B, Sk), "(B, Sk)")
        _check_device_as(op, "key_padding_mask", m, "q", q)
    if segment_ids is not None:
        if segment_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: segment_ids must be int32 or int64, got "
                            f"{_dtype(segment_ids.dtype)}")
        _check_shape(op, "segment_ids", segment_ids, (B, Sk), "(B, Sk)")
        _check_device_as(op, "segment_ids", segment_ids, "q", q)
    if window is not None and window <= 0:
        raise ValueError(f"{op}: window must be > 0 (key j is visible from query i iff "
                         f"i - window < j <= i), got {window}")
    _check_positive_finite(op, "scale", scale)
    _check_softcap(op, softcap)
    return B, Hq, Hkv, Sq, Sk, D


def _check_swiglu(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """x (T, H), w_gate/w_up (I, H), w_down (H, I), biases (I,), (I,), (H,). Returns (T, H, I)."""
    _check_dim(op, "x", x, 2, "(T, H) (tokens flattened)")
    _check_floating(op, "x", x)
    _check_dim(op, "w_gate", w_gate, 2, "(I, H)")
    T, H = x.shape
    I = w_gate.shape[0]
    _check_like(op, "w_gate", w_gate, "x", x, (I, H), f"(I, H) with H={H} from x")
    _check_like(op, "w_up", w_up, "x", x, (I, H), "(I, H), the shape of w_gate")
    _check_like(op, "w_down", w_down, "x", x, (H, I), "(H, I) for w_gate of shape (I, H)")
    for name, b, shape, text in (("b_gate", b_gate, (I,), "(I,)"), ("b_up", b_up, (I,), "(I,)"),
                                 ("b_down", b_down, (H,), "(H,)")):
        if b is not None:
            _check_like(op, name, b, "x", x, shape, text)
    return T, H, I


_SWIGLU_LORA = ("A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down")
# The gated MLP's activations (csrc/activation.h): SwiGLU's silu, GeGLU's gelu(approximate="tanh").
ACTIVATIONS = ("silu", "gelu_tanh")


def _check_activation(op, activation):
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of "
                         f"{', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def _check_probability(op, name, p):
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"{op}: {name} must be a probability in [0, 1), got {p}")


def _check_row_offset(op, name, row_offset):
    """A global row offset (of a token chunk within a larger input): an int >= 0."""
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or row_offset < 0:
        raise ValueError(f"{op}: {name} must be an int >= 0, got {row_offset!r}")


def _check_dropout_streams(op, streams):
    """The SwiGLU ops' dropout_streams: [] or 3 ints >= 0 (gate, up, down)."""
    if len(streams) not in (0, 3) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                         for t in streams):
        raise ValueError(f"{op}: dropout_streams must be [] or have 3 entries (gate, up, down), "
                         f"ints >= 0, got {list(streams)!r}")


def _check_seed(op, name, seed):
    if (seed.device.type != "cpu" or seed.numel() != 1 or seed.dtype.is_floating_point
            or seed.dtype.is_complex or seed.dtype == torch.bool):
        raise ValueError(f"{op}: {name} must be a CPU integer tensor with one element (read "
                         f"without a device sync), got a {_dtype(seed.dtype)} tensor of shape "
                         f"{_shape(seed)} on {seed.device}")


def _check_swiglu_lora(op, lora, lora_scaling, lora_dropout, dropout_seed, x, H, I):
    """lora [] or 6 entries (A (r, in), B (out, r) per projection, both or neither),
    lora_scaling [] or 3 finite floats, lora_dropout [] or 3 probabilities (a seed when one is
    > 0). Returns the 6 entries (None where absent)."""
    lora = list(lora)
    if len(lora) not in (0, 6):
        raise ValueError(f"{op}: lora must be [] or the 6 entries [A_gate, B_gate, A_up, B_up, "
                         f"A_down, B_down], got {len(lora)} entries")
    if len(lora_scaling) != (3 if lora else 0):
        raise ValueError(f"{op}: lora_scaling must have 3 entries (gate, up, down) with adapters "
                         f"and none without, got {len(lora_scaling)} for {len(lora)} lora entries")
    if len(lora_dropout) not in (0, len(lora_scaling)):
        raise ValueError(f"{op}: lora_dropout must be [] or have 3 entries (gate, up, down) with "
                         f"adapters, got {len(lora_dropout)} for {len(lora)} lora entries")
    if not lora:
        return [None] * 6
    for p, (n_in, n_out) in enumerate(((H, I), (H, I), (I, H))):
        a, b = lora[2 * p], lora[2 * p + 1]
        an, bn = _SWIGLU_LORA[2 * p], _SWIGLU_LORA[2 * p + 1]
        if (a is None) != (b is None):
            state = {True: "None", False: "given"}
            raise ValueError(f"{op}: lora {an} and {bn} come together, got {an} "
                             f"{state[a is None]} and {bn} {state[b is None]}")
        if a is None:
            continue
        _check_dim(op, an, a, 2, "(r, in)")
        _check_floating(op, an, a)
        _check_device_as(op, an, a, "x", x)
        r = a.shape[0]
        if r < 1:
            raise ValueError(f"{op}: {an} must have rank r >= 1, got shape {_shape(a)}")
        _check_shape(op, an, a, (r, n_in), f"(r, in) with in = {n_in}")
        _check_shape(op, bn, b, (n_out, r), f"(out, r) with out = {n_out} and r from {an}")
        _check_dtype_as(op, bn, b, an, a)
        _check_device_as(op, bn, b, "x", x)
        if not math.isfinite(lora_scaling[p]):
            raise ValueError(f"{op}: lora_scaling[{p}] must be finite, got {lora_scaling[p]}")
        if lora_dropout and lora_dropout[p] != 0.0:
            _check_probability(op, f"lora_dropout[{p}]", lora_dropout[p])
            if _absent(dropout_seed):
                raise ValueError(f"{op}: dropout_seed is required when lora_dropout has a "
                                 f"probability > 0")
            _check_seed(op, "dropout_seed", dropout_seed)
    return lora


def _check_rms(op, x, weight, names=("x", "weight")):
    """An RMSNorm's input (..., N) and weight (N,); ``names``: what the caller calls them."""
    xn, wn = names
    if x.dim() < 1:
        raise ValueError(f"{op}: {xn} must have at least 1 dim (..., N), got a 0-dim tensor")
    _check_floating(op, xn, x)
    _check_floating(op, wn, weight)
    _check_device_as(op, wn, weight, xn, x)
    _check_shape(op, wn, weight, (x.shape[-1],), f"to match {xn}'s last dim")
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: {xn} must have a non-empty last dim, got shape {_shape(x)}")


def _check_rope(op, qn, q, kn, k, cos, sin):
    _check_dim(op, qn, q, 4, "(B, Hq, S, D)")
    _check_dim(op, kn, k, 4, "(B, Hkv, S, D)")
    _check_floating(op, qn, q)
    _check_dtype_as(op, kn, k, qn, q)
    _check_device_as(op, kn, k, qn, q)
    B, _, S, D = q.shape
    _check_shape(op, kn, k, (B, k.shape[1], S, D), f"(B, Hkv, S, D) with B, S, D from {qn}")
    if D % 2 != 0:
        raise ValueError(f"{op}: {qn} must have an even head dim D, got D={D}")
    _check_dim(op, "cos", cos, 3, "(B or 1, S, R)")
    _check_floating(op, "cos", cos)
    _check_device_as(op, "cos", cos, qn, q)
    if cos.shape[0] not in (1, B):
        raise ValueError(f"{op}: cos must have batch size 1 or B={B}, got shape {_shape(cos)}")
    R = cos.shape[2]
    if not (R <= D and R % 2 == 0):
        raise ValueError(f"{op}: cos must be (B or 1, S, R) with an even rotary width "
                         f"R <= D={D}, got shape {_shape(cos)}")
    _check_shape(op, "cos", cos, (cos.shape[0], S, R), f"(B or 1, S, R) with S from {qn}")
    _check_like(op, "sin", sin, "cos", cos, cos.shape, "(the shape of cos)")


def _dense(t):
    """Whether t's elements fill the span of its strides exactly once (non-overlapping and
    dense, any dim order), as ATen's ``is_non_overlapping_and_dense`` for a non-empty t."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _rope_out_like(t):
    """The output of rope_fwd / rope_bwd for input t (csrc/checks.h ``rope_out_like``): t's
    strides when t is non-empty, non-overlapping and dense with a unit last stride (e.g. the
    (B, H, S, D) view of (B, S, H, D) memory that attention reads and returns), contiguous
    otherwise."""
    if t.numel() > 0 and t.stride(-1) == 1 and _dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return t.new_empty(t.shape)


def _stat_dtype(hidden):
    """dtype of lse / per-token loss / dloss: float64 for float64 hidden, else float32."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _check_lce(op, hidden, weight, bias, labels, logit_scale=1.0, softcap=0.0):
    """hidden (T, H), weight (V, H), bias (V,), labels (T,) int64, logit_scale finite > 0,
    softcap finite >= 0. Returns (T, H, V)."""
    _check_dim(op, "hidden", hidden, 2, "(T, H) (tokens flattened)")
    _check_floating(op, "hidden", hidden)
    _check_dim(op, "weight", weight, 2, "(V, H)")
    T, H = hidden.shape
    V = weight.shape[0]
    _check_like(op, "weight", weight, "hidden", hidden, (V, H), f"(V, H) with H={H} from hidden")
    if V == 0:
        raise ValueError(f"{op}: weight must have at least one vocabulary row, got shape "
                         f"{_shape(weight)}")
    if bias is not None:
        _check_like(op, "bias", bias, "hidden", hidden, (V,), "(V,)")
    if labels.dtype != torch.int64:
        raise TypeError(f"{op}: labels must be int64, got {_dtype(labels.dtype)}")
    _check_dim(op, "labels", labels, 1, "(T,)")
    _check_shape(op, "labels", labels, (T,), "(T,) with T from hidden")
    _check_device_as(op, "labels", labels, "hidden", hidden)
    _check_lce_transform(op, logit_scale, softcap)
    return T, H, V


def _check_lce_transform(op, logit_scale, softcap):
    """logit_scale a finite number > 0; softcap a finite number >= 0 (0: no cap)."""
    for name, x in (("logit_scale", logit_scale), ("softcap", softcap)):
        _check_number(op, name, x)
    _check_positive_finite(op, "logit_scale", logit_scale)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"{op}: softcap must be a finite number > 0 (or 0: no cap), got "
                         f"{softcap}")


def _check_norm_rounding(op, offset, cast_last, names=("norm_offset", "norm_cast_last")):
    """An RMSNorm's rounding: the offset a finite number, cast_last a bool; ``names`` are the
    caller's argument names."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real) \
            or not math.isfinite(offset):
        raise TypeError(f"{op}: {names[0]} must be a finite number (Gemma: 1.0), got "
                        f"{offset!r}")
    _check_bool(op, names[1], cast_last)


def _check_lce_stat(op, name, t, hidden, T):
    _check_dim(op, name, t, 1, "(T,)")
    _check_shape(op, name, t, (T,), "(T,) with T from hidden")
    if t.dtype != _stat_dtype(hidden):
        raise TypeError(f"{op}: {name} must be {_dtype(_stat_dtype(hidden))} (float64 for "
                        f"float64 hidden, else float32), got {_dtype(t.dtype)}")
    _check_device_as(op, name, t, "hidden", hidden)


# ---- whole-op checks (a fake and a launcher call the same one) ------------------------------

def _check_accumulator(op, name, t, ref_name, ref, shape, why):
    """An in-place accumulator: the shape, float32 (or float64 when ref is float64), ref's
    device; any strides."""
    _check_shape(op, name, t, shape, why)
    if not (t.dtype == torch.float32 or (t.dtype == torch.float64 and ref.dtype == torch.float64)):
        raise TypeError(f"{op}: {name} must be float32 (or float64 when {ref_name} is float64), "
                        f"got {_dtype(t.dtype)}")
    _check_device_as(op, name, t, ref_name, ref)


def _check_attention_bwd(op, dout, q, k, v, out, lse, key_padding_mask, segment_ids, window,
                         scale, q_offset=0, dk_acc=None, dv_acc=None, softcap=0.0):
    """attention_bwd's arguments; returns (B, Hq, Hkv, Sq, Sk, D)."""
    B, Hq, Hkv, Sq, Sk, D = _check_qkv(op, q, k, v, key_padding_mask, segment_ids, window,
                                       scale, q_offset, softcap)
    _check_like(op, "dout", dout, "q", q, q.shape, "(the shape of q)")
    _check_like(op, "out", out, "q", q, q.shape, "(the shape of q)")
    _check_shape(op, "lse", lse, (B, Hq, Sq), "(B, Hq, Sq)")
    if lse.dtype != torch.float32:
        raise TypeError(f"{op}: lse must be float32, got {_dtype(lse.dtype)}")
    _check_device_as(op, "lse", lse, "q", q)
    if (dk_acc is None) != (dv_acc is None):
        state = {True: "absent", False: "given"}
        raise ValueError(f"{op}: dk_acc and dv_acc must be given together or both left out, got "
                         f"dk_acc {state[dk_acc is None]} and dv_acc {state[dv_acc is None]}")
    if dk_acc is not None:
        for name, t in (("dk_acc", dk_acc), ("dv_acc", dv_acc)):
            _check_accumulator(op, name, t, "q", q, (B, Hkv, Sk, D), "(B, Hkv, Sk, D)")
    return B, Hq, Hkv, Sq, Sk, D


def _check_swiglu_fwd(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling,
                      lora_dropout, dropout_seed, activation="silu"):
    """swiglu_fwd's arguments; returns (T, H, I, the 6 lora entries)."""
    _check_activation(op, activation)
    T, H, I = _check_swiglu(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    lora = _check_swiglu_lora(op, lora, lora_scaling, lora_dropout, dropout_seed, x, H, I)
    return T, H, I, lora


def _check_swiglu_bwd(op, dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora,
                      lora_scaling, gate, up, needs_grad, lora_dropout, dropout_seed,
                      activation="silu", sums=(None, None, None),
                      lora_sums=(None,) * 6):
    """swiglu_bwd's arguments (sums: its dw_gate_sum, dw_up_sum, dw_down_sum; lora_sums: its
    lora_a_gate_sum .. lora_b_down_sum); returns (T, H, I, the 6 lora entries)."""
    T, H, I, lora = _check_swiglu_fwd(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora,
                                      lora_scaling, lora_dropout, dropout_seed, activation)
    _check_like(op, "dy", dy, "x", x, (T, H), "(T, H), the shape of x")
    for name, t, shape, layout in zip(("dw_gate_sum", "dw_up_sum", "dw_down_sum"), sums,
                                      ((I, H), (I, H), (H, I)), ("(I, H)", "(I, H)", "(H, I)")):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape} {layout}, got "
                             f"{tuple(t.shape)}")
        if t.device != x.device:
            raise RuntimeError(f"{op}: {name} is on {t.device} but x is on {x.device}")
        if t.dtype not in (torch.float32, x.dtype):
            raise TypeError(f"{op}: {name} must be float32 or the dtype of x ({x.dtype}), "
                            f"got {t.dtype}")
    if _absent(gate) != _absent(up):
        state = {True: "absent", False: "given"}
        raise ValueError(f"{op}: gate and up must be given together (save=\"gate_up\") or both "
                         f"left out (save=\"input\"), got gate {state[_absent(gate)]} and up "
                         f"{state[_absent(up)]}")
    if not _absent(gate):
        _check_like(op, "gate", gate, "x", x, (T, I), "(T, I)")
        _check_like(op, "up", up, "x", x, (T, I), "(T, I)")
    if len(needs_grad) != 12:
        raise ValueError(f"{op}: needs_grad must have 12 entries [w_gate, w_up, w_down, b_gate, "
                         f"b_up, b_down, A_gate, B_gate, A_up, B_up, A_down, B_down], got "
                         f"{len(needs_grad)}")
    _check_lora_sums(op, lora_sums, lora, needs_grad, x)
    return T, H, I, lora


_LORA_FACTORS = ("A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down")
LORA_SUM_NAMES = ("lora_a_gate_sum", "lora_b_gate_sum", "lora_a_up_sum", "lora_b_up_sum",
                  "lora_a_down_sum", "lora_b_down_sum")


def _check_lora_sums(op, lora_sums, lora, needs_grad, x):
    """swiglu_bwd's lora_a_gate_sum .. lora_b_down_sum (lora_sums, 6): each None or the
    running sum of a gradient the op computes (an adapter given, its needs_grad flag set), of
    its factor's shape, on x's device, float32 or float64."""
    for i, t in enumerate(lora_sums):
        if t is None:
            continue
        name = LORA_SUM_NAMES[i]
        factor = lora[i] if i < len(lora) else None
        if factor is None or not needs_grad[6 + i]:
            raise ValueError(f"{op}: {name} is given but the op computes no gradient of "
                             f"{_LORA_FACTORS[i]} (no adapter there, or its needs_grad flag "
                             f"is false)")
        if tuple(t.shape) != tuple(factor.shape):
            raise ValueError(f"{op}: {name} must have shape {tuple(factor.shape)} the shape of "
                             f"its factor, got {tuple(t.shape)}")
        if t.device != x.device:
            raise RuntimeError(f"{op}: {name} is on {t.device} but x is on {x.device}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{op}: {name} must be float32 or float64, got "
                            f"{str(t.dtype).replace('torch.', '')}")


def _check_lce_bwd(op, dloss, hidden, weight, bias, labels, lse, logit_scale=1.0, softcap=0.0):
    """linear_cross_entropy_bwd's arguments; returns (T, H, V)."""
    T, H, V = _check_lce(op, hidden, weight, bias, labels, logit_scale, softcap)
    _check_lce_stat(op, "dloss", dloss, hidden, T)
    _check_lce_stat(op, "lse", lse, hidden, T)
    return T, H, V


def _open_results_file(data, source: str, what: str, fmt: str, keys) -> tuple:
    """(bad, headers) of a results file read as JSON: ``bad(why)`` makes the ValueError naming
    the file (``source``, else ``what``); ``data`` must be a dict whose ``format`` is ``fmt``
    (else bad, saying it is not ``what``) with its provenance headers (``_file_headers``)."""
    where = source or what

    def bad(why):
        return ValueError(f"{where}: {why}")

    if not isinstance(data, dict) or data.get("format") != fmt:
        raise bad(f"not a{'n' if what[0] in 'aeiou' else ''} {what} file (format must be "
                  f"{fmt!r})")
    return bad, _file_headers(data, keys, bad)


def _file_headers(data: dict, keys, bad) -> dict:
    """The provenance headers of a results file read as JSON (``keys``, each a non-empty
    string, and an optional free-text ``note``); ``bad(why)`` makes the error naming the
    file."""
    headers = {}
    for key in keys:
        if not isinstance(data.get(key), str) or not data[key]:
            raise bad(f"header {key!r} must be a non-empty string, got {data.get(key)!r}")
        headers[key] = data[key]
    if "note" in data:
        headers["note"] = data["note"]
    return headers
