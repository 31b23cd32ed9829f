"""Triton kernels for the LM head and its cross-entropy loss, without the (T, V) logits.

    logits = hidden weight^T + bias           (T, V): only ever a (BLOCK_M, BLOCK_N) tile
    z       = s logits, or c tanh(s logits / c) under a cap  (s = logit_scale, c = softcap > 0)
    lse[t]  = logsumexp_v z[t, v]
    loss[t] = lse[t] - z[t, labels[t]]        (0 where labels[t] == ignore_index)

Shapes (tokens flattened): hidden ``(T, H)``; weight ``(V, H)`` (``nn.Linear`` layout); bias
``(V,)``; labels ``(T,)`` int64; loss, lse, dloss ``(T,)`` float32.

Kernels (Triton only; the autograd wiring lives in ``ckpt_ext``):

* ``_fwd_kernel``: one program per (token tile, vocabulary split). It walks the split's
  vocabulary tiles, computes each logits tile with an fp32 accumulator, and folds it into a
  running max / rescaled sum (online log-sum-exp) and the target logit of each row. It writes
  only three (T,) fp32 partials per split; the launcher merges the splits' partials into lse
  and the per-token loss. Splitting the vocabulary keeps the GPU busy when T is small.
* ``_bwd_kernel``: for one vocabulary chunk ``[v0, v0 + VC)`` it recomputes the logits tile by
  tile and writes ``dlogits = dloss (exp(z - lse) - onehot(labels)) dz/dlogits`` (0 on
  ignored rows; dz/dlogits = s, or s (1 - tanh^2) under a cap) in the input dtype, as HF's
  autograd rounds them. The launcher turns the chunk into
  ``dweight[v0:v0+VC] = dlogits^T hidden`` and ``dbias[v0:v0+VC]`` (complete: each vocabulary
  row lives in one chunk) and adds ``dlogits weight[v0:v0+VC]`` to an fp32 dhidden. Only a
  (T, VC) chunk of dlogits exists at a time; VC is chosen so that it is about the size of
  hidden (at least 32 Mi elements), see ``_vocab_chunk``.

Only the gradients asked for are formed (``output_mask``). Under a frozen head (LoRA: only
dhidden) the launcher walks token chunks instead, each over the whole vocabulary: the chunk's
dlogits give its dhidden rows in one GEMM, and neither dweight nor an accumulator exists.

Extra memory of the backward beyond its outputs: the (T, VC) dlogits chunk and, when there
is more than one chunk, an fp32 (T, H) accumulator of dhidden; under a frozen head only the
(rows, V) dlogits chunk. Extra FLOPs: the forward's
logits GEMM once more (4 GEMMs of 2 T V H instead of HF's 3).

Launch policy (``kernels/_launch.py``, shared by all kernels): under Triton's interpreter
(``TRITON_INTERPRET=1``) one fixed small configuration on CPU tensors; on a GPU autotuning
over ``_GPU_CONFIGS`` keyed by (T bucket, H, V), or with ``CKPT_EXT_AUTOTUNE=0`` the first
candidate that the device accepts, untimed. Launchers are cached per (device, dtype, fp32 dot
precision, bias, cap).
"""
import torch
import triton
import triton.language as tl

from .._checks import _check_lce, _check_lce_bwd
from . import _launch
from .swiglu_mlp import _tile_coords
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Shared device helper
# --------------------------------------------------------------------------------------------
@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, offs_m, offs_n, T, H, V,
                 stride_ht, stride_hh, stride_wv, stride_wh,
                 HAS_BIAS: tl.constexpr, DOT_IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``(BLOCK_M, BLOCK_N)`` tile of hidden weight^T + bias for token rows ``offs_m`` and
    vocabulary columns ``offs_n`` (loads masked past T and V; the reduction over H masked past
    H). Entries outside the matrix are finite garbage: callers mask them."""
    mask_m = offs_m < T
    mask_n = offs_n < V
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row offsets: T * H and V * H pass 2**31 elements at LLaMA-3 sizes.
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + offs_k[None, :] * stride_hh
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wv + offs_k[:, None] * stride_wh
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k < H - k * BLOCK_K
        ht = tl.load(h_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_IEEE:
            acc = tl.dot(ht, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(ht, wt, acc)
        h_ptrs += BLOCK_K * stride_hh
        w_ptrs += BLOCK_K * stride_wh
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _tanh(x):
    """tanh in fp32 from the sigmoid (no tanh in tl; saturates to +-1 without overflow)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(h_ptr, w_ptr, b_ptr, labels_ptr, max_ptr, sum_ptr, tgt_ptr,
                T, H, V, V_PER_SPLIT, T_BUCKET, ignore_index, logit_scale, softcap,
                stride_ht, stride_hh, stride_wv, stride_wh, stride_lt,
                HAS_BIAS: tl.constexpr, DOT_IEEE: tl.constexpr, CAPPED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), n_split). Program (i, s) covers token rows
    [i BLOCK_M, (i+1) BLOCK_M) and vocabulary columns [s V_PER_SPLIT, (s+1) V_PER_SPLIT) ∩ [0, V)
    (V_PER_SPLIT a multiple of BLOCK_N; every split non-empty) and writes, at [s, t] of the
    contiguous (n_split, T) fp32 partials: max_ptr the row max of its z (base 2, i.e.
    times log2 e), sum_ptr sum 2^(z log2 e - max), tgt_ptr the z of the row's label if
    the label falls in the split (else 0). z = logit_scale logits, soft-capped when CAPPED
    (softcap > 0). T_BUCKET only keys the autotuner."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    label = tl.load(labels_ptr + offs_m.to(tl.int64) * stride_lt, mask=row_ok,
                    other=ignore_index)
    v_lo = split * V_PER_SPLIT
    v_hi = tl.minimum(V, v_lo + V_PER_SPLIT)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    tgt = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_N):
        offs_n = v0 + tl.arange(0, BLOCK_N)
        z = _logits_tile(h_ptr, w_ptr, b_ptr, offs_m, offs_n, T, H, V,
                         stride_ht, stride_hh, stride_wv, stride_wh,
                         HAS_BIAS, DOT_IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        if CAPPED:
            z = softcap * _tanh(z * (logit_scale / softcap))
        else:
            z = z * logit_scale
        tgt += tl.sum(tl.where(offs_n[None, :] == label[:, None], z, 0.0), 1)
        z2 = tl.where((offs_n < v_hi)[None, :], z * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z2, 1))  # finite: the tile has a column below v_hi
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(z2 - m_new[:, None]), 1)
        m_i = m_new
    out = split.to(tl.int64) * T + offs_m
    tl.store(max_ptr + out, m_i, mask=row_ok)
    tl.store(sum_ptr + out, l_i, mask=row_ok)
    tl.store(tgt_ptr + out, tgt, mask=row_ok)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, b_ptr, labels_ptr, lse_ptr, dloss_ptr, dl_ptr,
                T, H, V, v_start, VC, T_BUCKET, ignore_index, logit_scale, softcap,
                stride_ht, stride_hh, stride_wv, stride_wh, stride_lt, stride_st, stride_dt,
                HAS_BIAS: tl.constexpr, DOT_IEEE: tl.constexpr, CAPPED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    """dlogits of the vocabulary chunk [v_start, v_start + VC) (v_start + VC <= V), one
    (BLOCK_M, BLOCK_N) tile per program: dl (T, VC) contiguous, dtype of hidden,
    dl[t, j] = dloss[t] (exp(z[t, v] - lse[t]) - [labels[t] == v]) dz/dlogits[t, v] with
    v = v_start + j (z and dz/dlogits as the module docstring says), 0 on rows whose label is
    ignore_index. lse (stride_st) and dloss (stride_dt, 0 for an expanded scalar) are fp32
    (T,). T_BUCKET only keys the autotuner."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), T, VC, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)      # column within the chunk
    offs_n = v_start + offs_j                             # vocabulary row of the weight
    row_ok = offs_m < T
    rows = offs_m.to(tl.int64)
    z = _logits_tile(h_ptr, w_ptr, b_ptr, offs_m, offs_n, T, H, V,
                     stride_ht, stride_hh, stride_wv, stride_wh,
                     HAS_BIAS, DOT_IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    label = tl.load(labels_ptr + rows * stride_lt, mask=row_ok, other=ignore_index)
    lse = tl.load(lse_ptr + rows * stride_st, mask=row_ok, other=0.0)
    dloss = tl.load(dloss_ptr + rows * stride_dt, mask=row_ok, other=0.0)
    scale = tl.where(label == ignore_index, 0.0, dloss * logit_scale)
    if CAPPED:
        th = _tanh(z * (logit_scale / softcap))
        z = softcap * th
    else:
        z = z * logit_scale
    p = tl.exp2((z - lse[:, None]) * 1.4426950408889634)
    g = (p - tl.where(offs_n[None, :] == label[:, None], 1.0, 0.0)) * scale[:, None]
    if CAPPED:
        g = g * (1.0 - th * th)
    mask = row_ok[:, None] & (offs_j < VC)[None, :]
    tl.store(dl_ptr + rows[:, None] * VC + offs_j[None, :], g.to(dl_ptr.dtype.element_ty),
             mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
# One fp32 accumulator per tile, as in a plain GEMM (the forward adds three (BLOCK_M,) rows).
# Shared memory per stage: (BLOCK_M + BLOCK_N) * BLOCK_K * 2 bytes in bf16; 128x256x64 with 3
# stages takes 144 KiB (Hopper, A100), the 64- and 128-wide tiles fit consumer Ampere's ~100 KiB.
# A config that does not fit a device fails to compile there and the autotuner skips it. The
# first, which fits every device above, is what CKPT_EXT_AUTOTUNE=0 launches.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
]
# Interpreter: small blocks that do not divide the test shapes, so every masked tail runs.
_INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
_TUNE_KEY = ["T_BUCKET", "H", "V"]


def _without_group(config):
    """The forward kernel takes no GROUP_M: each of its programs owns a token tile."""
    return triton.Config({k: v for k, v in config.kwargs.items() if k != "GROUP_M"},
                         num_warps=config.num_warps, num_stages=config.num_stages)


_FWD_CONFIGS = [_without_group(c) for c in _GPU_CONFIGS]
# Every vocabulary split is a multiple of the widest BLOCK_N in use.
_N_ALIGN = (_INTERPRET_META["BLOCK_N"] if _launch.INTERPRET
            else max(c.kwargs["BLOCK_N"] for c in _GPU_CONFIGS))


@_launch.cached
def _launcher(kind, device, dtype, precision, has_bias, capped):
    """(kernel, constexpr arguments) of the forward or backward for one specialization."""
    meta = dict(HAS_BIAS=has_bias, DOT_IEEE=precision == "ieee", CAPPED=capped)
    if kind == "fwd":
        interp = {k: v for k, v in _INTERPRET_META.items() if k != "GROUP_M"}
        return _launch.select(_fwd_kernel, _FWD_CONFIGS, interpret_meta=interp,
                              key=_TUNE_KEY), meta
    return _launch.select(_bwd_kernel, _GPU_CONFIGS, interpret_meta=_INTERPRET_META,
                          key=_TUNE_KEY), meta


# Columns of one backward chunk: interpreter runs use a small fixed width so that tests cover
# several chunks (tests may change it); on a GPU see _vocab_chunk.
INTERPRETER_VOCAB_CHUNK = 64
INTERPRETER_TOKEN_CHUNK = 16
_CHUNK_MIN_ELEMS = 1 << 25


def _grid(T, cols, per_tile_cols=True):
    """Launch grid over T tokens and `cols` vocabulary columns: (token tiles * column tiles,)
    for the backward; (token tiles, cols) for the forward (cols = its number of splits)."""
    def grid(m):
        tiles_m = _launch.cdiv(T, m["BLOCK_M"])
        return (tiles_m * _launch.cdiv(cols, m["BLOCK_N"]),) if per_tile_cols else (tiles_m, cols)
    return grid


def _n_split(T, V, device):
    """Vocabulary splits of the forward: enough programs for about four waves of the GPU's
    SMs (with 128-token tiles), at most one per _N_ALIGN columns; two in the interpreter, so
    that the merge of partials is tested."""
    max_split = _launch.cdiv(V, _N_ALIGN)
    if device.type != "cuda":
        return min(2, max_split)
    sms = _launch.device_info(device).sm_count
    return max(1, min(max_split, _launch.cdiv(4 * sms, _launch.cdiv(T, 128))))


def _token_chunk(T, V, H, device):
    """Token rows per backward chunk when only dhidden is formed: the (rows, V) dlogits chunk
    about the size of hidden (T, H) and at least _CHUNK_MIN_ELEMS elements, at least 1 row;
    INTERPRETER_TOKEN_CHUNK rows under the interpreter, so that tests cover several chunks."""
    if device.type != "cuda":
        return max(1, min(T, INTERPRETER_TOKEN_CHUNK))
    return max(1, min(T, max(T * H, _CHUNK_MIN_ELEMS) // V))


def _vocab_chunk(T, V, H, device):
    """Columns per backward chunk: the (T, VC) dlogits chunk about the size of hidden (T, H)
    and at least _CHUNK_MIN_ELEMS elements, a multiple of _N_ALIGN, at most V."""
    if device.type != "cuda":
        return min(V, INTERPRETER_VOCAB_CHUNK)
    want = max(T * H, _CHUNK_MIN_ELEMS) // max(T, 1)
    return min(V, max(_N_ALIGN, want // _N_ALIGN * _N_ALIGN))


# --------------------------------------------------------------------------------------------
# Validation: the op's own checks (ckpt_ext._checks, shared with the fakes), then the Triton
# kernels' (_launch.check_operands)
# --------------------------------------------------------------------------------------------
def _check_inputs(op, hidden, weight, bias, labels, logit_scale, softcap):
    """Validate the arguments shared by both launchers; returns (T, H, V)."""
    T, H, V = _check_lce(op, hidden, weight, bias, labels, logit_scale, softcap)
    _launch.check_operands(op, ("hidden", hidden))
    return T, H, V


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index: int,
                             logit_scale: float = 1.0, softcap: float = 0.0):
    """Per-token cross-entropy of the LM head.

    Args:
        hidden: (T, H) float16 / bfloat16 / float32, any strides.
        weight: (V, H) (nn.Linear layout); bias: None or (V,); dtype and device of hidden.
        labels: (T,) int64, each in [0, V) or equal to ignore_index.
        logit_scale, softcap: z = logit_scale logits, or softcap tanh(logit_scale logits /
            softcap) when softcap > 0 (finite > 0 and finite >= 0).

    Returns:
        (loss, lse), both (T,) float32: lse[t] = logsumexp of row t of z,
        loss[t] = lse[t] - z[t, labels[t]], 0 on ignored tokens. A label outside [0, V)
        (and not ignore_index) raises on CPU tensors; on a GPU, where checking would cost a
        host sync, its loss is NaN.
    """
    op = "linear_cross_entropy_fwd"
    T, H, V = _check_inputs(op, hidden, weight, bias, labels, logit_scale, softcap)
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= V))
    if not hidden.is_cuda and bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"{op}: labels must be in [0, V={V}) or equal ignore_index="
                         f"{ignore_index}, got {int(labels[t])} at token {t}")
    f32 = dict(dtype=torch.float32, device=hidden.device)
    if T == 0:
        return torch.empty(0, **f32), torch.empty(0, **f32)
    n_split = _n_split(T, V, hidden.device)
    v_per_split = _launch.cdiv(_launch.cdiv(V, n_split), _N_ALIGN) * _N_ALIGN
    n_split = _launch.cdiv(V, v_per_split)                 # every split non-empty
    part = torch.empty((3, n_split, T), **f32)
    row_max, row_sum, tgt = part.unbind(0)
    kernel, meta = _launcher("fwd", hidden.device, hidden.dtype,
                             _launch.dot_precision(hidden.dtype), bias is not None, softcap > 0)
    with _launch.on_device(hidden.device):
        kernel[_grid(T, n_split, per_tile_cols=False)](
            hidden, weight, bias if bias is not None else hidden, labels, row_max, row_sum, tgt,
            T, H, V, v_per_split, _launch.pow2_bucket(T, 16), ignore_index, float(logit_scale),
            float(softcap), hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            labels.stride(0), **meta)
    # Merge the splits (base-2 partials): lse = ln 2 (M + log2 sum_s l_s 2^(m_s - M)).
    if n_split == 1:
        lse = (row_max[0] + torch.log2(row_sum[0])) / _LOG2E
    else:
        top = row_max.amax(0)
        lse = (top + torch.log2((row_sum * torch.exp2(row_max - top)).sum(0))) / _LOG2E
    loss = torch.where(valid, lse - tgt.sum(0), 0.0)
    if hidden.is_cuda:
        loss = torch.where(bad, float("nan"), loss)
    return loss, lse


def linear_cross_entropy_bwd(dloss, hidden, weight, bias, labels, lse, ignore_index: int,
                             output_mask=(True, True, True), logit_scale: float = 1.0,
                             softcap: float = 0.0):
    """Gradients of ``sum_t dloss[t] loss[t]`` with the logits recomputed chunk by chunk.

    Args:
        dloss: (T,) float32, any strides (stride 0 for an expanded scalar).
        hidden, weight, bias, labels, ignore_index, logit_scale, softcap: as for
            ``linear_cross_entropy_fwd``.
        lse: (T,) float32 from ``linear_cross_entropy_fwd``.
        output_mask: [dhidden, dweight, dbias]: which gradients to form; the others are not
            computed and come back as ``hidden.new_empty((0,))``.

    Returns:
        (dhidden (T, H), dweight (V, H), dbias (V,) or ``hidden.new_empty((0,))`` without
        bias or when not asked for), in the dtype of hidden.

    With dweight or dbias asked for, the vocabulary is walked in chunks: dweight and dbias
    are one GEMM / sum per chunk (rounded once); dhidden sums the chunks in fp32 and is
    rounded once. With only dhidden asked for (a frozen LM head), the tokens are walked in
    chunks instead, each over the whole vocabulary: each chunk's dhidden rows are one GEMM
    written in place (no fp32 (T, H) accumulator), and no dweight GEMM runs.
    """
    op = "linear_cross_entropy_bwd"
    _check_lce_bwd(op, dloss, hidden, weight, bias, labels, lse, logit_scale, softcap)
    T, H, V = _check_inputs(op, hidden, weight, bias, labels, logit_scale, softcap)
    if len(output_mask) != 3:
        raise ValueError(f"{op}: output_mask must have 3 entries [dhidden, dweight, dbias], "
                         f"got {len(output_mask)}")
    want_dh, want_dw, want_db = (bool(m) for m in output_mask)
    want_db = want_db and bias is not None
    def none():  # a gradient not asked for: an empty tensor of its own (outputs never alias)
        return hidden.new_empty((0,))
    dweight = hidden.new_empty((V, H)) if want_dw else none()
    dbias = hidden.new_empty((V,)) if want_db else none()
    if T == 0 or not (want_dh or want_dw or want_db):
        return (hidden.new_empty((0, H)) if want_dh else none(), dweight.zero_(), dbias.zero_())
    kernel, meta = _launcher("bwd", hidden.device, hidden.dtype,
                             _launch.dot_precision(hidden.dtype), bias is not None, softcap > 0)
    t_bucket = _launch.pow2_bucket(T, 16)

    def dlogits(t0, tc, v0, vc, out):
        """dlogits of tokens [t0, t0 + tc) and vocabulary columns [v0, v0 + vc) into out."""
        with _launch.on_device(hidden.device):
            kernel[_grid(tc, vc)](
                hidden[t0:t0 + tc], weight, bias if bias is not None else hidden,
                labels[t0:t0 + tc], lse[t0:t0 + tc], dloss[t0:t0 + tc], out,
                tc, H, V, v0, vc, t_bucket, ignore_index, float(logit_scale), float(softcap),
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
                labels.stride(0), lse.stride(0), dloss.stride(0), **meta)

    if not (want_dw or want_db):  # frozen head: token chunks over the whole vocabulary
        tc_max = _token_chunk(T, V, H, hidden.device)
        buf = hidden.new_empty((min(T, tc_max) * V,))
        dhidden = hidden.new_empty((T, H))
        for t0 in range(0, T, tc_max):
            tc = min(tc_max, T - t0)
            dl = buf[:tc * V].view(tc, V)
            dlogits(t0, tc, 0, V, dl)
            torch.mm(dl, weight, out=dhidden[t0:t0 + tc])
        return dhidden, dweight, dbias

    vc_max = _vocab_chunk(T, V, H, hidden.device)
    buf = hidden.new_empty((T * vc_max,))
    dhidden = None
    for v0 in range(0, V, vc_max):
        vc = min(vc_max, V - v0)
        dl = buf[:T * vc].view(T, vc)
        dlogits(0, T, v0, vc, dl)
        w_c = weight[v0:v0 + vc]
        if want_dw:
            torch.mm(dl.t(), hidden, out=dweight[v0:v0 + vc])
        if want_db:
            dbias[v0:v0 + vc] = dl.sum(0, dtype=torch.float32)
        if not want_dh:
            continue
        if vc == V:                                   # one chunk: one GEMM, one rounding
            dhidden = torch.mm(dl, w_c)
        else:
            if dhidden is None:
                dhidden = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)
            _addmm_fp32(dhidden, dl, w_c)
    return (dhidden.to(hidden.dtype) if want_dh else none()), dweight, dbias


def _addmm_fp32(acc, a, b):
    """acc += a @ b for a float32 acc, the product not rounded to a's dtype first (on a GPU
    cuBLAS writes the fp32 sum directly; torch >= 2.8). Rounding each chunk's product to
    bf16 would add one rounding per vocabulary chunk to dhidden."""
    if acc.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())
