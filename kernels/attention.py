"""Flash attention in Triton: forward with a logsumexp row, backward that recomputes P.

Shapes (every launcher checks them):
    q:                (B, Hq, S, D)      fp16 / bf16 / fp32, any strides
    k, v:             (B, Hkv, S, D)     same dtype as q, ``Hq % Hkv == 0`` (GQA)
    key_padding_mask: None or bool (B, S), True = the key may be attended
    segment_ids:      None or int32 / int64 (B, S): a query sees only keys with its id
    window:           None or int > 0: key j is visible from query i iff i - window < j
                      (and j < i + window when not causal); None or >= S: no window
    out:              (B, Hq, S, D)      dtype of q, contiguous
    lse:              (B, Hq, S)         float32, natural log; -inf where a row attends nothing

Forward: one program per (query block, batch, query head). It streams key blocks through an
online softmax (running max ``m``, running sum ``l``, fp32 accumulator), in base 2 so that the
exponentials are ``exp2``. Causal attention and the window form a band
``i - win_before <= j <= i + win_after``; a query block visits only the key blocks that meet
the band and (with segment ids) the span of its segments, and only the blocks that cross an edge
of the band pay for the element-wise band test. Packed or windowed attention therefore costs
about what it computes. Segment ids are compared element-wise in every visited block, so any
ids are handled exactly; contiguous segments are what makes the skipping effective.

Backward: ``D = rowsum(dO * O)`` first; then one kernel owns a key block of one KV head and walks
over every query block of every query head in its GQA group (fixed order, so dK/dV are summed
deterministically and without atomics), and one kernel owns a query block and walks over the
key blocks to form dQ, each visiting only the blocks the band and the segments allow (a key
block meets the query blocks that can see it). Both rebuild ``P = exp(scale * Q K^T - lse)``
tile by tile; the S x S matrix never exists in memory. A row whose lse is -inf gets ``P = 0``,
hence zero gradients.

The head dimension is padded to a power of two (>= 16) inside the kernels with masked loads, so
any head_dim in 16..256 works (80 and 96 included). fp32 inputs use IEEE fp32 dot products
under torch's default float32 matmul precision and TF32 when the user allowed it (see
``_launch.dot_precision``); half-precision inputs use fp16/bf16 tensor-core dots with fp32
accumulation.

Launch policy (``kernels/_launch.py``, shared by all kernels): on a GPU the block sizes are
autotuned per architecture family (Hopper, Ampere) with the key (HEAD_DIM, CAUSAL, S_BUCKET);
with ``CKPT_EXT_AUTOTUNE=0`` the first candidate that fits is launched untimed. Under
``TRITON_INTERPRET=1`` a single fixed configuration from ``INTERPRETER_BLOCKS`` is used so that
CPU tests stay fast. Launchers are cached per (kernel, device, dtype, head_dim, causal, mask
kind, window, fp32 dot precision).
"""
import math

import torch
import triton
import triton.language as tl

from . import _launch

__all__ = ["attention_fwd", "attention_bwd"]

_LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2 inside the kernels

# Block sizes used when the kernels run in the Triton interpreter (no autotuning there).
# Tests may override entries (e.g. BLOCK_M != BLOCK_N) with ``monkeypatch.setitem``.
INTERPRETER_BLOCKS = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 32},
}
_PRE_BLOCK_M = 64  # rows per program of the D = rowsum(dO * O) pre-pass


# --------------------------------------------------------------------------------------------
# Which tiles a block meets: the band (causal, window) and the segments
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_ranges(first, last, lo, hi, below, above, BLOCK: tl.constexpr):
    """The tiles (BLOCK wide, aligned) of the other axis that a block of positions
    [first, last] meets, as (start, full_start, full_end, end).

    A partner p of position x is in the band iff ``x - below <= p <= x + above``; [lo, hi) is
    the partner range already cut to the band, the segments and [0, S). Tiles in [start, end)
    cover it; those in [full_start, full_end) lie inside the band for every position of the
    block and skip the element-wise band test, the others take it. All values are >= 0.
    """
    start = (lo // BLOCK) * BLOCK
    end = tl.cdiv(hi, BLOCK) * BLOCK
    full_start = tl.cdiv(tl.maximum(last - below, 0), BLOCK) * BLOCK
    full_start = tl.minimum(tl.maximum(full_start, start), end)
    full_end = ((first + above + 1) // BLOCK) * BLOCK
    full_end = tl.minimum(tl.maximum(full_end, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def _partner_range(offs, ok, first, last, S, below, above, SegLo_b, SegHi_b, HAS_SEG: tl.constexpr):
    """[lo, hi): the partners that positions offs (valid where ok, spanning [first, last]) may
    see: the band [first - below, last + above], cut to [0, S) and, with segments, to the span
    [min first occurrence, max last occurrence] of their segment ids."""
    lo = tl.maximum(first - below, 0)
    hi = tl.minimum(last + above + 1, S)
    if HAS_SEG:
        lo = tl.maximum(lo, tl.min(tl.load(SegLo_b + offs, mask=ok, other=S), 0))
        hi = tl.minimum(hi, tl.max(tl.load(SegHi_b + offs, mask=ok, other=0), 0))
    return lo, hi


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                    stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                    offs_m, offs_d, lo, hi, S, qk_scale, win_before, win_after,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr,
                    WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) over key blocks [lo, hi) of one query block.

    q: (BLOCK_M, D_PAD); acc: (BLOCK_M, D_PAD) fp32; l_i, m_i: (BLOCK_M,) fp32, m_i in base 2.
    BAND: the blocks cross an edge of the band (causal diagonal, window) and take the
    element-wise test ``-win_before <= j - i <= win_after``.
    """
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        # K^T tile (D_PAD, BLOCK_N) and V tile (BLOCK_N, D_PAD); padded entries read as 0.
        kT = tl.load(K_bh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if HAS_MASK:
            keep = tl.load(Mask_b + offs_n * stride_ms, mask=col_ok, other=0)
            col_ok = col_ok & (keep != 0)
        bias = tl.where(col_ok, 0.0, float("-inf"))
        s = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale + bias[None, :]
        if BAND and WINDOW:
            dist = offs_n[None, :] - offs_m[:, None]
            s = tl.where((dist <= win_after) & (dist >= -win_before), s, float("-inf"))
        elif BAND:  # the causal diagonal only
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if HAS_SEG:
            seg_k = tl.load(SegId_b + offs_n, mask=offs_n < S, other=-2)
            s = tl.where(seg_q[:, None] == seg_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps m = -inf; shift by 0 there so that
        # exp2(-inf - m) is 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_bh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, Mask, SegId, SegLo, SegHi, Out, Lse,
                     stride_qb, stride_qh, stride_qs, stride_qd,
                     stride_kb, stride_kh, stride_ks, stride_kd,
                     stride_vb, stride_vh, stride_vs, stride_vd,
                     stride_mb, stride_ms,
                     stride_ob, stride_oh, stride_os, stride_od,
                     Hq, S, GROUP, qk_scale, win_before, win_after, S_BUCKET,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(S, BLOCK_M), B, Hq). Writes Out (B, Hq, S, D) and Lse (B, Hq, S) contiguous.

    qk_scale = scale * log2(e). Key j is visible from query i iff
    ``i - win_before <= j <= i + win_after`` (causal: win_after = 0), the key is not padded and,
    with HAS_SEG, SegId[b, j] == SegId[b, i]. SegId/SegLo/SegHi: contiguous int32 (B, S).
    S_BUCKET is only an autotuning key.
    """
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks carry the most work: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < S
    d_ok = offs_d < HEAD_DIM

    Q_bh = Q + b * stride_qb + h * stride_qh
    K_bh = K + b * stride_kb + hk * stride_kh
    V_bh = V + b * stride_vb + hk * stride_vh
    Mask_b = Mask + b * stride_mb
    SegId_b = SegId + b * S
    q = tl.load(Q_bh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    seg_q = tl.zeros([BLOCK_M], tl.int32)
    if HAS_SEG:
        seg_q = tl.load(SegId_b + offs_m, mask=row_ok, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Key blocks outside the band or the segments of these rows are never visited; of the
    # others only those crossing an edge of the band pay for the element-wise band test.
    last_m = tl.minimum(start_m + BLOCK_M, S) - 1
    lo, hi = _partner_range(offs_m, row_ok, start_m, last_m, S, win_before, win_after,
                            SegLo + b * S, SegHi + b * S, HAS_SEG)
    lo, full_lo, full_hi, hi = _tile_ranges(start_m, last_m, lo, hi, win_before, win_after,
                                            BLOCK_N)
    # Phases: the window's lower edge (only with a window: else empty), the blocks inside the
    # band, the causal diagonal / window's upper edge (only with one: else empty). Leaving the
    # empty phases out at compile time keeps the plain paths' code as lean as without masks.
    if WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                        stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                        offs_m, offs_d, lo, full_lo, S, qk_scale, win_before,
                                        win_after, HEAD_DIM, BLOCK_N, True, WINDOW, HAS_MASK,
                                        HAS_SEG, DOT_PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                    stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                    offs_m, offs_d, full_lo, full_hi, S, qk_scale, win_before,
                                    win_after, HEAD_DIM, BLOCK_N, False, WINDOW, HAS_MASK,
                                    HAS_SEG, DOT_PRECISION)
    if CAUSAL or WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                        stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                        offs_m, offs_d, full_hi, hi, S, qk_scale, win_before,
                                        win_after, HEAD_DIM, BLOCK_N, True, WINDOW, HAS_MASK,
                                        HAS_SEG, DOT_PRECISION)

    # Rows with nothing to attend have l = 0: out = 0 and lse = -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i * 0.6931471805599453 + tl.log(l_safe))
    O_bh = Out + b * stride_ob + h * stride_oh
    tl.store(O_bh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + (b * Hq + h) * S + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_preprocess_kernel(Out, DOut, Delta,
                                stride_ob, stride_oh, stride_os, stride_od,
                                stride_gb, stride_gh, stride_gs, stride_gd,
                                Hq, S,
                                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr):
    """Grid (cdiv(S, BLOCK_M), B, Hq). Delta (B, Hq, S) fp32 = rowsum(dOut * Out)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < S
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + b * stride_ob + h * stride_oh
                + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od, mask=ok, other=0.0)
    do = tl.load(DOut + b * stride_gb + h * stride_gh
                 + offs_m[:, None] * stride_gs + offs_d[None, :] * stride_gd, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (b * Hq + h) * S + offs_m, delta, mask=row_ok)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, bias_n, seg_k, offs_n, Q_bh, DO_bh, Lse_bh, Delta_bh,
                         SegId_b, stride_qs, stride_qd, stride_gs, stride_gd,
                         offs_d, lo, hi, S, qk_scale, win_before, win_after,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BAND: tl.constexpr,
                         WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Accumulate dK (unscaled) and dV of one key block over query blocks [lo, hi) of one head.

    k, v: (BLOCK_N, D_PAD); dk, dv: (BLOCK_N, D_PAD) fp32; bias_n: (BLOCK_N,) 0 or -inf;
    seg_k: (BLOCK_N,) segment ids of the keys (HAS_SEG). Works on transposed tiles:
    sT = K Q^T is (BLOCK_N, BLOCK_M). BAND: the element-wise band test, as in the forward.
    """
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < S
        ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q_bh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                    mask=ok, other=0.0)
        # lse = -inf (row attends nothing) or a row past S becomes +inf: P = exp2(s - inf) = 0.
        lse = tl.load(Lse_bh + offs_m, mask=row_ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale + bias_n[:, None]
        if BAND and WINDOW:
            dist = offs_n[:, None] - offs_m[None, :]
            sT = tl.where((dist <= win_after) & (dist >= -win_before), sT, float("-inf"))
        elif BAND:  # the causal diagonal only
            sT = tl.where(offs_m[None, :] >= offs_n[:, None], sT, float("-inf"))
        if HAS_SEG:
            seg_q = tl.load(SegId_b + offs_m, mask=row_ok, other=-1)
            sT = tl.where(seg_k[:, None] == seg_q[None, :], sT, float("-inf"))
        pT = tl.exp2(sT - lse2[None, :])
        do = tl.load(DO_bh + offs_m[:, None] * stride_gs + offs_d[None, :] * stride_gd,
                     mask=ok, other=0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        delta = tl.load(Delta_bh + offs_m, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, Mask, SegId, SegLo, SegHi, DOut, Lse, Delta, DK, DV,
                          stride_qb, stride_qh, stride_qs, stride_qd,
                          stride_kb, stride_kh, stride_ks, stride_kd,
                          stride_vb, stride_vh, stride_vs, stride_vd,
                          stride_mb, stride_ms,
                          stride_gb, stride_gh, stride_gs, stride_gd,
                          stride_db, stride_dh, stride_ds, stride_dd,
                          Hq, Hkv, S, GROUP, qk_scale, sm_scale, win_before, win_after,
                          S_BUCKET,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                          WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                          DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(S, BLOCK_N), B, Hkv). Writes DK, DV (B, Hkv, S, D), both with strides stride_d*.

    Each program loops over the GROUP query heads of its KV head in a fixed order, so the GQA
    sum is deterministic. Lse, Delta: (B, Hq, S) contiguous fp32. Visibility as in the forward;
    the query blocks that cannot see any key of this block are never visited.
    """
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    hk = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    col_ok = offs_n < S
    ok = col_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh
                + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=ok, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh
                + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=ok, other=0.0)
    SegId_b = SegId + b * S
    seg_k = tl.zeros([BLOCK_N], tl.int32)
    if HAS_SEG:
        seg_k = tl.load(SegId_b + offs_n, mask=col_ok, other=-2)
    # Query i sees key j iff j - win_after <= i <= j + win_before (and the same segment, a
    # symmetric relation): the band seen from the keys has its two reaches swapped.
    last_n = tl.minimum(start_n + BLOCK_N, S) - 1
    lo, hi = _partner_range(offs_n, col_ok, start_n, last_n, S, win_after, win_before,
                            SegLo + b * S, SegHi + b * S, HAS_SEG)
    lo, full_lo, full_hi, hi = _tile_ranges(start_n, last_n, lo, hi, win_after, win_before,
                                            BLOCK_M)
    if HAS_MASK:
        keep = tl.load(Mask + b * stride_mb + offs_n * stride_ms, mask=col_ok, other=0)
        col_ok = col_ok & (keep != 0)
    bias_n = tl.where(col_ok, 0.0, float("-inf"))

    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        Q_bh = Q + b * stride_qb + h * stride_qh
        DO_bh = DOut + b * stride_gb + h * stride_gh
        row_base = (b * Hq + h) * S
        # Seen from a key block the causal diagonal is the lower edge (query blocks
        # [lo, full_lo)) and the window's lower edge the upper one ([full_hi, hi)).
        if CAUSAL or WINDOW:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, bias_n, seg_k, offs_n, Q_bh, DO_bh,
                                          Lse + row_base, Delta + row_base, SegId_b,
                                          stride_qs, stride_qd, stride_gs, stride_gd,
                                          offs_d, lo, full_lo, S, qk_scale, win_before,
                                          win_after, HEAD_DIM, BLOCK_M, True, WINDOW, HAS_SEG,
                                          DOT_PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, bias_n, seg_k, offs_n, Q_bh, DO_bh,
                                      Lse + row_base, Delta + row_base, SegId_b,
                                      stride_qs, stride_qd, stride_gs, stride_gd,
                                      offs_d, full_lo, full_hi, S, qk_scale, win_before,
                                      win_after, HEAD_DIM, BLOCK_M, False, WINDOW, HAS_SEG,
                                      DOT_PRECISION)
        if WINDOW:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, bias_n, seg_k, offs_n, Q_bh, DO_bh,
                                          Lse + row_base, Delta + row_base, SegId_b,
                                          stride_qs, stride_qd, stride_gs, stride_gd,
                                          offs_d, full_hi, hi, S, qk_scale, win_before,
                                          win_after, HEAD_DIM, BLOCK_M, True, WINDOW, HAS_SEG,
                                          DOT_PRECISION)

    out_off = b * stride_db + hk * stride_dh + offs_n[:, None] * stride_ds + offs_d[None, :] * stride_dd
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, offs_m, K_bh, V_bh, Mask_b, SegId_b,
                       stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                       offs_d, lo, hi, S, qk_scale, win_before, win_after,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr,
                       WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Accumulate dQ (unscaled) of one query block over key blocks [lo, hi).

    q, do: (BLOCK_M, D_PAD); lse2: (BLOCK_M,) base-2 lse with +inf for empty rows;
    delta: (BLOCK_M,); dq: (BLOCK_M, D_PAD) fp32. BAND: the element-wise band test.
    """
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K_bh + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=ok, other=0.0)
        v = tl.load(V_bh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=ok, other=0.0)
        if HAS_MASK:
            keep = tl.load(Mask_b + offs_n * stride_ms, mask=col_ok, other=0)
            col_ok = col_ok & (keep != 0)
        bias = tl.where(col_ok, 0.0, float("-inf"))
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale + bias[None, :]
        if BAND and WINDOW:
            dist = offs_n[None, :] - offs_m[:, None]
            s = tl.where((dist <= win_after) & (dist >= -win_before), s, float("-inf"))
        elif BAND:  # the causal diagonal only
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if HAS_SEG:
            seg_k = tl.load(SegId_b + offs_n, mask=offs_n < S, other=-2)
            s = tl.where(seg_q[:, None] == seg_k[None, :], s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, Mask, SegId, SegLo, SegHi, DOut, Lse, Delta, DQ,
                        stride_qb, stride_qh, stride_qs, stride_qd,
                        stride_kb, stride_kh, stride_ks, stride_kd,
                        stride_vb, stride_vh, stride_vs, stride_vd,
                        stride_mb, stride_ms,
                        stride_gb, stride_gh, stride_gs, stride_gd,
                        stride_db, stride_dh, stride_ds, stride_dd,
                        Hq, S, GROUP, qk_scale, sm_scale, win_before, win_after, S_BUCKET,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                        WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                        DOT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(S, BLOCK_M), B, Hq). Writes DQ (B, Hq, S, D) with strides stride_d*.
    Visits the key blocks the forward visits."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks carry the most work: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < S
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh
                + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=ok, other=0.0)
    do = tl.load(DOut + b * stride_gb + h * stride_gh
                 + offs_m[:, None] * stride_gs + offs_d[None, :] * stride_gd, mask=ok, other=0.0)
    row_base = (b * Hq + h) * S
    lse = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    K_bh = K + b * stride_kb + hk * stride_kh
    V_bh = V + b * stride_vb + hk * stride_vh
    Mask_b = Mask + b * stride_mb
    SegId_b = SegId + b * S
    seg_q = tl.zeros([BLOCK_M], tl.int32)
    if HAS_SEG:
        seg_q = tl.load(SegId_b + offs_m, mask=row_ok, other=-1)

    last_m = tl.minimum(start_m + BLOCK_M, S) - 1
    lo, hi = _partner_range(offs_m, row_ok, start_m, last_m, S, win_before, win_after,
                            SegLo + b * S, SegHi + b * S, HAS_SEG)
    lo, full_lo, full_hi, hi = _tile_ranges(start_m, last_m, lo, hi, win_before, win_after,
                                            BLOCK_N)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if WINDOW:  # phases as in the forward
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, offs_m, K_bh, V_bh, Mask_b,
                                SegId_b, stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                offs_d, lo, full_lo, S, qk_scale, win_before, win_after,
                                HEAD_DIM, BLOCK_N, True, WINDOW, HAS_MASK, HAS_SEG,
                                DOT_PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, offs_m, K_bh, V_bh, Mask_b, SegId_b,
                            stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                            offs_d, full_lo, full_hi, S, qk_scale, win_before, win_after,
                            HEAD_DIM, BLOCK_N, False, WINDOW, HAS_MASK, HAS_SEG, DOT_PRECISION)
    if CAUSAL or WINDOW:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, offs_m, K_bh, V_bh, Mask_b,
                                SegId_b, stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                offs_d, full_hi, hi, S, qk_scale, win_before, win_after,
                                HEAD_DIM, BLOCK_N, True, WINDOW, HAS_MASK, HAS_SEG,
                                DOT_PRECISION)
    tl.store(DQ + b * stride_db + h * stride_dh
             + offs_m[:, None] * stride_ds + offs_d[None, :] * stride_dd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Autotuning (GPU only)
# --------------------------------------------------------------------------------------------
def _cfg(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n},
                         num_warps=warps, num_stages=stages)


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and architecture family.
# Forward and dQ hold a query tile and stream keys (large BLOCK_M); dK/dV hold a key tile and
# stream queries (large BLOCK_N). Configs that cannot fit are pruned per head_dim below.
_CONFIGS = {
    ("fwd", "hopper"): [_cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3),
                        _cfg(128, 128, 8, 2), _cfg(128, 32, 4, 3), _cfg(64, 64, 4, 3),
                        _cfg(64, 32, 4, 2)],
    ("fwd", "ampere"): [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 2), _cfg(128, 32, 4, 3),
                        _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 2)],
    ("dkdv", "hopper"): [_cfg(64, 128, 8, 3), _cfg(32, 128, 8, 3), _cfg(64, 64, 4, 3),
                         _cfg(32, 64, 4, 3), _cfg(16, 64, 4, 2), _cfg(32, 64, 8, 2),
                         _cfg(16, 32, 4, 2)],
    ("dkdv", "ampere"): [_cfg(32, 128, 8, 2), _cfg(64, 64, 4, 2), _cfg(32, 64, 4, 2),
                         _cfg(16, 64, 4, 2), _cfg(32, 64, 8, 2), _cfg(16, 32, 4, 2)],
    ("dq", "hopper"): [_cfg(128, 64, 8, 3), _cfg(128, 32, 4, 3), _cfg(64, 64, 4, 3),
                       _cfg(64, 32, 4, 2)],
    ("dq", "ampere"): [_cfg(128, 32, 8, 2), _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 2)],
}
_KEY = ["HEAD_DIM", "CAUSAL", "S_BUCKET"]


def _smem_bytes(kind: str, c, d_pad: int, elt: int) -> int:
    """Shared memory a config needs: two streamed tiles (K and V, or Q and dO) per pipeline
    stage, plus the resident tiles (q for fwd; q and dO for dq; k and v for dK/dV), plus 2 KiB
    of lse/delta rows in the backward. Checked against Triton's own allocation by AOT compiles
    for sm_90 and sm_80 (tools/check_triton_compile.py): exact for fwd and dq, 1 KiB over for
    the large dK/dV tiles and more for the smallest, never under."""
    bm, bn, stages = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], max(c.num_stages, 1)
    resident, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    resident_tiles, rows = (1, 0) if kind == "fwd" else (2, 2048)
    return (stages * 2 * streamed + resident_tiles * resident) * d_pad * elt + rows


def _prune(kind: str, configs, d_pad: int, elt: int, budget: int) -> list:
    """The configs whose tiles fit in shared memory and registers (at least the smallest one,
    so that something runs)."""
    kept = []
    for c in configs:
        resident = c.kwargs["BLOCK_N"] if kind == "dkdv" else c.kwargs["BLOCK_M"]
        smem = _smem_bytes(kind, c, d_pad, elt)
        # fp32 accumulators per thread (one for fwd/dq, two for dk/dv) must not spill badly.
        accs = 2 if kind == "dkdv" else 1
        regs = accs * resident * d_pad / (32 * c.num_warps)
        if smem <= budget and regs <= 128:
            kept.append(c)
    return kept or [_smallest(configs)]


def _smallest(configs):
    """The config with the smallest tile: kept when nothing else fits."""
    return min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])


def launch_configs(kind: str, arch: str, head_dim: int, dtype: torch.dtype,
                   smem_budget: int | None = None) -> list:
    """Every candidate of an attention kernel with the pruner's verdict, in order.

    kind: "fwd", "dkdv", "dq" or "pre" (the rowsum pre-pass, one fixed config); arch: "hopper"
    or "ampere"; smem_budget: the device's per-block shared memory (default: the family's).
    Returns ``(config, {"smem": est, "acc_regs": est, "kept": bool, "fallback": bool})``
    entries; "kept": on its merits, "fallback": only as the last resort when nothing fits.
    """
    if kind == "pre":
        return [(triton.Config({"BLOCK_M": _PRE_BLOCK_M}, num_warps=4, num_stages=3),
                 {"smem": 0, "acc_regs": 0, "kept": True, "fallback": False})]
    if smem_budget is None:
        smem_budget = _launch.smem_budget_for((9, 0) if arch == "hopper" else (8, 0))
    d_pad, elt = max(16, triton.next_power_of_2(head_dim)), dtype.itemsize
    configs = _CONFIGS[(kind, arch)]
    kept = _prune(kind, configs, d_pad, elt, smem_budget)
    alone = {id(c) for c in configs if _prune(kind, [c, _PROBE], d_pad, elt, smem_budget)[0] is c}
    rows = []
    for c in configs:
        resident = c.kwargs["BLOCK_N"] if kind == "dkdv" else c.kwargs["BLOCK_M"]
        acc = (2 if kind == "dkdv" else 1) * resident * d_pad / (32 * c.num_warps)
        launched = any(k is c for k in kept)
        rows.append((c, {"smem": _smem_bytes(kind, c, d_pad, elt), "acc_regs": acc,
                         "kept": launched and id(c) in alone,
                         "fallback": launched and id(c) not in alone}))
    return rows


# A tiny config that always fits: _prune([c, _PROBE]) keeps c iff c fits on its own merits.
_PROBE = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=8, num_stages=1)


_KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}


@_launch.cached
def _launcher(kind: str, device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
              has_mask: bool, has_seg: bool, window: bool, precision: str):
    """(kernel, constexpr arguments) of one kernel for one specialization: a fixed config in
    the interpreter; with ``CKPT_EXT_AUTOTUNE=0`` the fitting candidates in order, the first
    that launches used (no timing); else the autotuned kernel over the fitting candidates."""
    meta = dict(_common_meta(head_dim, causal, dtype, precision), HAS_MASK=has_mask,
                HAS_SEG=has_seg, WINDOW=window)
    configs = []
    if not _launch.INTERPRET:
        info = _launch.device_info(device)
        candidates = _CONFIGS[(kind, info.arch)]
        configs = _prune(kind, candidates, meta["D_PAD"], dtype.itemsize, info.smem_budget)
        smallest = _smallest(candidates)
        if not _launch.AUTOTUNE and all(c is not smallest for c in configs):
            configs.append(smallest)  # the last resort
    return _launch.select(_KERNELS[kind], configs, key=_KEY,
                          interpret_meta=lambda: INTERPRETER_BLOCKS[kind]), meta


def _s_bucket(S: int) -> int:
    """Autotuning bucket of the sequence length: next power of two, clamped to [128, 32768]."""
    return _launch.pow2_bucket(S, 128, 32768)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NO_LIMIT = 1 << 30  # a band reach that no sequence reaches: "no limit on this side"


def _check_qkv(name, q, k, v, key_padding_mask, segment_ids=None, window=None, scale=1.0):
    """Validate q (B, Hq, S, D), k/v (B, Hkv, S, D), the masks and scale; return
    (B, Hq, Hkv, S, D)."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must have 4 dims (B, H, S, D), got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"{name}: q must be float16, bfloat16 or float32, got {q.dtype}")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but q is on {q.device}")
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"{name}: k must have shape (B={B}, Hkv, S={S}, D={D}), got {tuple(k.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{name}: k must have Hkv dividing Hq={Hq}, got Hkv={Hkv}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{name}: v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if not 16 <= D <= 256:
        raise ValueError(f"{name}: q must have head_dim D in 16..256, got D={D}")
    for arg, m, dtypes, what in (("key_padding_mask", key_padding_mask, (torch.bool,), "a bool"),
                                 ("segment_ids", segment_ids, (torch.int32, torch.int64),
                                  "an int32 or int64")):
        if m is None:
            continue
        if not isinstance(m, torch.Tensor) or m.dtype not in dtypes:
            got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
            raise TypeError(f"{name}: {arg} must be {what} tensor, got {got}")
        if tuple(m.shape) != (B, S):
            raise ValueError(f"{name}: {arg} must have shape (B={B}, S={S}), got {tuple(m.shape)}")
        if m.device != q.device:
            raise ValueError(f"{name}: {arg} is on {m.device} but q is on {q.device}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise ValueError(f"{name}: window must be an int > 0 (key j is visible from query i "
                         f"iff i - window < j <= i), got {window!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: scale must be a finite number > 0, got {scale}")
    if q.device.type != "cuda" and not _launch.INTERPRET:
        raise RuntimeError(f"{name}: q is on {q.device}; the Triton kernels need a CUDA device "
                           f"or TRITON_INTERPRET=1 (set before triton is imported)")
    if q.dtype == torch.bfloat16 and _launch.INTERPRET:
        raise NotImplementedError(
            f"{name}: bfloat16 is not supported under the Triton interpreter "
            f"(TRITON_INTERPRET=1), whose bf16 tl.dot gives wrong results (triton#11584); use "
            f"float16 or float32 there, or the ATen CPU kernels (leave CKPT_EXT_BACKEND unset)")
    return B, Hq, Hkv, S, D


def _mask_args(key_padding_mask, fallback):
    """(pointer tensor, stride_b, stride_s, HAS_MASK) for the kernels; bool is read as uint8."""
    if key_padding_mask is None:
        return fallback, 0, 0, False
    m = key_padding_mask.view(torch.uint8)
    return m, m.stride(0), m.stride(1), True


def _segment_args(segment_ids, fallback):
    """(SegId, SegLo, SegHi, HAS_SEG) for the kernels: contiguous int32 (B, S) tensors.

    SegId[b, i] names the segment id of position i (equal ids, equal names; the index of the
    id's first entry in the row's stably sorted ids, so any int64 ids fit); SegLo[b, i] and
    SegHi[b, i] - 1 are the first and last positions of row b holding that id. A query at i can
    only see keys in [SegLo, SegHi) and a key only queries there, contiguous runs or not; the
    kernels skip the tiles outside and still compare ids element by element inside. Computed
    with sorts and scans on q's device, without a host synchronisation.
    """
    if segment_ids is None:
        return fallback, fallback, fallback, False
    B, S = segment_ids.shape
    ids, order = torch.sort(segment_ids, dim=1, stable=True)           # (B, S) each
    pos = torch.arange(S, device=ids.device).expand(B, S)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]                              # a run of one id starts
    ends = torch.ones_like(new)
    ends[:, :-1] = new[:, 1:]                                           # ... and ends
    run_start = torch.where(new, pos, 0).cummax(dim=1).values           # sorted index of its start
    run_end = torch.where(ends, pos, S).flip(1).cummin(dim=1).values.flip(1)
    # Stable sort: positions rise within a run, so its first / last entries are the id's first
    # and last positions in the row.
    first, last = order.gather(1, run_start), order.gather(1, run_end)
    seg_id, seg_lo, seg_hi = (torch.empty((B, S), dtype=torch.int32, device=ids.device)
                              for _ in range(3))
    seg_id.scatter_(1, order, run_start.to(torch.int32))
    seg_lo.scatter_(1, order, first.to(torch.int32))
    seg_hi.scatter_(1, order, (last + 1).to(torch.int32))
    return seg_id, seg_lo, seg_hi, True


def _band(S, causal, window):
    """(win_before, win_after): key j is visible from query i iff
    i - win_before <= j <= i + win_after (before the padding and segment rules)."""
    if window is None or window >= S:
        before = _NO_LIMIT
    else:
        before = window - 1
    after = 0 if causal else before
    return before, after


def _common_meta(D, causal, dtype, precision=None):
    # fp32 inputs follow torch's float32 matmul precision (_launch.dot_precision); fp16/bf16
    # inputs: tensor-core dots (the precision argument only affects fp32 operands).
    return dict(HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)), CAUSAL=bool(causal),
                DOT_PRECISION=precision or _launch.dot_precision(dtype))


def attention_fwd(q, k, v, key_padding_mask, segment_ids, window, causal: bool, scale: float):
    """Flash attention forward.

    q: (B, Hq, S, D); k, v: (B, Hkv, S, D) with Hq % Hkv == 0; key_padding_mask: None or bool
    (B, S), True = key may be attended; segment_ids: None or int32/int64 (B, S), a query sees
    only keys with its id; window: None or int > 0, HF's sliding window: key j is visible from
    query i iff ``i - window < j`` (and ``j < i + window`` when not causal); causal: ``j <= i``.
    Returns ``(out, lse)``: out (B, Hq, S, D) in q's dtype, contiguous; lse (B, Hq, S) float32,
    natural-log logsumexp of the scaled masked scores, -inf for rows with nothing to attend
    (their out is 0). Key tiles that the window or the segments rule out are not visited.
    """
    B, Hq, Hkv, S, D = _check_qkv("attention_fwd", q, k, v, key_padding_mask, segment_ids,
                                  window, scale)
    out = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    if B * Hq * S == 0:
        return out, lse
    mask, stride_mb, stride_ms, has_mask = _mask_args(key_padding_mask, q)
    seg_id, seg_lo, seg_hi, has_seg = _segment_args(segment_ids, q)
    before, after = _band(S, causal, window)
    kernel, meta = _launcher("fwd", q.device, q.dtype, D, bool(causal), has_mask, has_seg,
                             before != _NO_LIMIT, _launch.dot_precision(q.dtype))

    def grid(m):
        return (_launch.cdiv(S, m["BLOCK_M"]), B, Hq)

    with _launch.on_device(q.device):
        kernel[grid](q, k, v, mask, seg_id, seg_lo, seg_hi, out, lse,
                     *q.stride(), *k.stride(), *v.stride(), stride_mb, stride_ms, *out.stride(),
                     Hq, S, Hq // Hkv, float(scale) * _LOG2E, before, after, _s_bucket(S),
                     **meta)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, segment_ids, window, causal: bool,
                  scale: float):
    """Flash attention backward, recomputing P = exp(scale * q k^T - lse) tile by tile.

    dout, out: (B, Hq, S, D) in q's dtype; q: (B, Hq, S, D); k, v: (B, Hkv, S, D);
    lse: (B, Hq, S) float32 from :func:`attention_fwd`; masks, window, causal and scale as in
    the forward. Returns ``(dq, dk, dv)`` with the shapes and dtype of q, k, v (contiguous).
    dk/dv of a KV head sum its query group in a fixed order (deterministic, no atomics).
    """
    name = "attention_bwd"
    B, Hq, Hkv, S, D = _check_qkv(name, q, k, v, key_padding_mask, segment_ids, window, scale)
    for arg, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{name}: {arg} must have the shape of q {tuple(q.shape)}, "
                             f"got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but q is on {q.device}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, Hq, S):
        got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"{name}: lse must have shape (B={B}, Hq={Hq}, S={S}), got {got}")
    if lse.dtype != torch.float32:
        raise TypeError(f"{name}: lse must be float32, got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"{name}: lse is on {lse.device} but q is on {q.device}")

    dq = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, S, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, S, D), dtype=v.dtype, device=q.device)
    if B * Hq * S == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    mask, stride_mb, stride_ms, has_mask = _mask_args(key_padding_mask, q)
    seg_id, seg_lo, seg_hi, has_seg = _segment_args(segment_ids, q)
    before, after = _band(S, causal, window)
    spec = (q.device, q.dtype, D, bool(causal), has_mask, has_seg, before != _NO_LIMIT,
            _launch.dot_precision(q.dtype))
    qk_scale = float(scale) * _LOG2E
    group = Hq // Hkv

    dkdv, dkdv_meta = _launcher("dkdv", *spec)
    with _launch.on_device(q.device):
        _attn_bwd_preprocess_kernel[(_launch.cdiv(S, _PRE_BLOCK_M), B, Hq)](
            out, dout, delta, *out.stride(), *dout.stride(), Hq, S,
            HEAD_DIM=D, D_PAD=dkdv_meta["D_PAD"], BLOCK_M=_PRE_BLOCK_M)

        dkdv[lambda m: (_launch.cdiv(S, m["BLOCK_N"]), B, Hkv)](
            q, k, v, mask, seg_id, seg_lo, seg_hi, dout, lse, delta, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), stride_mb, stride_ms, *dout.stride(),
            *dk.stride(), Hq, Hkv, S, group, qk_scale, float(scale), before, after,
            _s_bucket(S), **dkdv_meta)

        kernel, meta = _launcher("dq", *spec)
        kernel[lambda m: (_launch.cdiv(S, m["BLOCK_M"]), B, Hq)](
            q, k, v, mask, seg_id, seg_lo, seg_hi, dout, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), stride_mb, stride_ms, *dout.stride(),
            *dq.stride(), Hq, S, group, qk_scale, float(scale), before, after, _s_bucket(S),
            **meta)
    return dq, dk, dv
