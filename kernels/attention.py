"""Flash attention in Triton: forward with a logsumexp row, backward that recomputes P.

Shapes (every launcher checks them):
    q:                (B, Hq, Sq, D)     fp16 / bf16 / fp32, any strides
    k, v:             (B, Hkv, Sk, D)    same dtype as q, ``Hq % Hkv == 0`` (GQA)
    q_offset:         int, 0 <= q_offset <= Sk - Sq: q's rows are the queries at positions
                      q_offset..q_offset+Sq-1 (a query chunk; Sq == Sk, 0: all of them)
    key_padding_mask: None or bool (B, Sk), True = the key may be attended
    segment_ids:      None or int32 / int64 (B, Sk): a query sees only keys with its id
    window:           None or int > 0: key j is visible from query i iff i - window < j
                      (and j < i + window when not causal); None or >= Sk: no window
    out:              (B, Hq, Sq, D)     dtype of q, laid out (B, Sq, Hq, D) in memory
    lse:              (B, Hq, Sq)        float32, natural log; -inf where a row attends nothing
    dk_acc, dv_acc:   None or fp32 (B, Hkv, Sk, D), any strides (backward): dK / dV added
                      into them, dk / dv returned as (0,) placeholders
    softcap:          float >= 0: > 0 caps each scaled score s to softcap * tanh(s / softcap)
                      before the masks and the softmax (Gemma 2); 0: no cap
Every rule and every skipped tile reads global positions (query row r is at q_offset + r).

Layout: the decoder layer holds q/k/v as (B, S, H, D) projections viewed (B, H, S, D). The
kernels take any strides, and out, dq, dk and dv are allocated (B, S, H, D) in memory and
returned as (B, H, S, D) views of it, so ``t.transpose(1, 2).reshape(B, S, H * D)`` on a result
is a view: no layout copy on either side of the kernels.

Forward: one program per (query block, batch, query head). It streams key blocks through an
online softmax (running max ``m``, running sum ``l``, fp32 accumulator), in base 2 so that the
exponentials are ``exp2``. Causal attention and the window form a band
``i - win_before <= j <= i + win_after``; a query block visits only the key blocks that meet
the band and (with segment ids) the span of its segments, and only the blocks that cross an edge
of the band pay for the element-wise band test. Packed or windowed attention therefore costs
about what it computes. Segment ids are compared element-wise in every visited block, so any
ids are handled exactly; contiguous segments are what makes the skipping effective.

Backward: a pre-pass forms ``D = rowsum(dO * O)`` and the base-2 lse (+inf on rows that attend
nothing); then one kernel owns a key block of one KV head and walks over every query block of
every query head in its GQA group (fixed order, so dK/dV are summed deterministically and
without atomics). dQ is formed one of three ways (``CKPT_EXT_ATTN_DQ``, see :func:`dq_mode`;
by default the choice table's under torch's determinism flag): ``separate``, a second kernel
that owns a query block and walks over the key blocks, recomputing Q K^T and dO V^T (7 tile
matmuls per tile pair in all); or ``atomic``, the dK/dV
kernel also forms dS^T K and adds it into fp32 dQ rows with atomics, then one pass converts
them to q's dtype (5 matmuls, as FlashAttention-2; not bit-reproducible); or ``ordered``, as
``atomic`` with each dQ tile taking the key blocks' shares in a fixed order, the highest key
block first (FlashAttention-3's; counters and waits in place of atomics: bit-reproducible; no
segment ids). Each kernel visits
only the blocks the band and the segments allow. All rebuild ``P = exp2(s * qk_scale - lse2)``
tile by tile; the S x S matrix never exists in memory. A row whose lse is -inf gets ``P = 0``,
hence zero gradients.

Inner loops: each walk is split into stages (the window's lower edge, the interior blocks, the
block crossing S, the causal diagonal / window's upper edge); interior blocks do no masking at
all (no bound, band or padding test unless a padding mask is given). The exception is the
backward's causal kernels without a window: there one loop walks every block and takes the
causal test on all of them (exact: it is true on the interior blocks; in dQ it also rules out
the keys past S). Compiled for sm_90 with Triton 3.6, a masked and an unmasked loop one after
the other spill registers at the tiles worth launching (dK/dV 64x128, dQ 128x64 with 3 stages),
one loop does not (``tools/attention_bwd_aot.py``); what the compare and select per interior
score cost against the larger tiles is for a GPU measurement. The dK/dV kernel also walks the
(query head, query block) pairs of its GQA group as one flat loop, reads delta and the base-2
lse from buffers padded per head to a multiple of ``_ROW_PITCH`` rows (no mask), forms the
causal test from the column index (a constant per register) against one offset per key row, and
forms dP^T - delta before P^T. Everywhere the scale is applied in the single fused multiply-add
``s * qk_scale - m`` (forward, with the running max scaled once per row) or ``s * qk_scale -
lse2`` (backward) instead of a multiply and a bias add per score. The scale is folded into that
FMA rather than into K or Q beforehand: pre-scaling a bf16/fp16 tile would round it once more,
for no fewer instructions.

Soft-capping: with softcap > 0 the kernels are compiled with SOFTCAP (a constexpr, so the
uncapped kernels are unchanged) and cap each score tile right after its dot, before any mask:
``s = tanh(s * scale / softcap) * softcap * log2(e)``, already scaled and in base 2, so the
FMA's factor (qk_scale) is 1. The backward recomputes the capped tile and multiplies dS by the
cap's derivative ``1 - tanh^2`` (fp32) before forming dQ and dK. tanh is :func:`_tanh` (the
interpreter has no libdevice): a Pade approximant near 0, exp2 beyond, a few fp32 ulps.

The head dimension is padded to a power of two (>= 16) inside the kernels with masked loads, so
any head_dim in 16..256 works (80 and 96 included). fp32 inputs use IEEE fp32 dot products
under torch's default float32 matmul precision and TF32 when the user allowed it (see
``_launch.dot_precision``); half-precision inputs use fp16/bf16 tensor-core dots with fp32
accumulation.

Launch policy (``kernels/_launch.py``, shared by all kernels): on a GPU the block sizes are
autotuned per architecture family (Hopper, Ampere) with the key (HEAD_DIM, CAUSAL, S_BUCKET,
SQ_BUCKET: the keys' and the query rows' lengths bucketed; dK/dV also DQ_ATOMIC, ACCUMULATE);
with ``CKPT_EXT_AUTOTUNE=0`` the first candidate that fits is launched untimed. The backward's
kernels put first the configuration a GPU sweep measured for the launch's shape bucket, when
the winners file names one (``kernels/attention_tuning.py``). Under
``TRITON_INTERPRET=1`` a single fixed configuration from ``INTERPRETER_BLOCKS`` is used so that
CPU tests stay fast. Launchers are cached per (kernel, device, dtype, head_dim, causal, mask
kind, window, fp32 dot precision, and for dK/dV the dQ mode and accumulation).
"""
import torch
import triton
import triton.language as tl

from .. import _checks
from .. import config as _config
from . import _launch
from . import attention_tuning as _tuning

__all__ = ["attention_fwd", "attention_bwd", "dq_mode", "attention_configs", "pre_config"]

_LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2 inside the kernels
# The ordered dQ sums' turn-taking (_attn_bwd_dkdv_inner, DQ_ORDERED). On a GPU two blocks of
# inline PTX, which Triton sees as single scalar operations that every thread runs once, so
# they leave the main loop's software pipelining alone (a Triton while loop or
# tl.debug_barrier there stops it: no asynchronous copies in the sm_90 compile):
#   _WAIT_PTX  every thread spins on ld.acquire until the counter reads the turn ($2) and
#              returns it (an acquire of its own: its later reads see what was released);
#   _DONE_PTX  bar.sync (every thread's stores of the tile are done), then thread 0 adds 1 to
#              the counter with release semantics (cumulative over those stores).
# The labels and registers are local to the braces. The interpreter runs no PTX and no
# spin: it runs the programs one at a time in grid order, so a key block's turn has come when
# it first reads the counter or never will; a wrong turn puts NaN into the tile (a failure
# that the tests see, where a spin would hang).
_PTX_SYNC = tl.constexpr(not _launch.INTERPRET)
_WAIT_PTX = tl.constexpr("""{
    .reg .pred %p_w;
    .reg .b32 %v_w;
    wait_turn:
    ld.global.acquire.gpu.b32 %v_w, [$1];
    setp.ne.s32 %p_w, %v_w, $2;
    @%p_w bra wait_turn;
    mov.b32 $0, %v_w;
}""")
_DONE_PTX = tl.constexpr("""{
    .reg .pred %p_l;
    .reg .b32 %t_l;
    mov.u32 %t_l, %tid.x;
    setp.eq.u32 %p_l, %t_l, 0;
    bar.sync 0;
    @%p_l red.release.gpu.global.add.s32 [$1], 1;
    mov.b32 $0, 0;
}""")

# Block sizes used when the kernels run in the Triton interpreter (no autotuning there).
# Tests may override entries (e.g. BLOCK_M != BLOCK_N) with ``monkeypatch.setitem``.
INTERPRETER_BLOCKS = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 32},
}
_PRE_BLOCK_M = 64  # rows per program of the D = rowsum(dO * O) pre-pass
# The backward's per-row buffers (delta, base-2 lse) hold each head's rows padded to a multiple
# of this (delta 0, lse2 +inf past Sq), so that the dK/dV kernel reads whole query blocks of
# them with no mask; every backward BLOCK_M and _PRE_BLOCK_M divide it.
_ROW_PITCH = tl.constexpr(256)


def dq_mode() -> str:
    """How the backward forms dQ: the ``attention_dq`` setting of ``ckpt_ext.config``
    (``CKPT_EXT_ATTN_DQ``; ``ckpt_ext.ops.attention(..., deterministic=)`` sets it for its own
    backward), read at every backward launch; the launcher cache is keyed on the mode it
    gives. ``auto`` (the default): the mode the choice table names first for the call among
    those torch's determinism flag allows (``ckpt_ext.attention_route.triton_dq_mode``:
    with the flag off any, with it on ``separate`` or ``ordered``; ``separate`` where the
    table names no mode, as on every device it has no rules for).

    ``separate``: a dQ kernel of its own walks the key blocks of each query
    block; deterministic, but it recomputes Q K^T and dO V^T (7 tile matmuls per tile pair in
    all). ``atomic``: the dK/dV kernel also forms dS^T K and adds it into an fp32 dQ buffer
    with atomics, then one pass converts it to q's dtype (5 matmuls per tile pair, as
    FlashAttention-2; the fp32 sums' order, hence their last bits, vary between runs).
    ``ordered``: as ``atomic``, but each dQ tile takes the key blocks' shares in a fixed
    order, from the highest key block that meets it down (FlashAttention-3's: the key blocks
    are launched right to left; a counter per tile, a wait for its turn, a plain
    read-add-write): 5 matmuls and bit-reproducible, at the price of the waits; calls with
    segment ids run the separate kernel instead. All are exact formulas tested against the
    same reference; which is faster is for a GPU measurement to decide
    (``bench/attention.py --backend-rows`` times each), and ``auto`` follows that
    measurement.
    """
    return _config.current().attention_dq


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
    block and skip the element-wise band test, the others take it. Positions are in the
    partner axis' coordinates (a query chunk's rows: global position - q_off), so first and
    last may be negative; 0 <= lo <= hi. All returned values are >= 0.
    """
    start = (lo // BLOCK) * BLOCK
    end = tl.cdiv(hi, BLOCK) * BLOCK
    full_start = tl.cdiv(tl.maximum(last - below, 0), BLOCK) * BLOCK
    full_start = tl.minimum(tl.maximum(full_start, start), end)
    full_end = (tl.maximum(first + above + 1, 0) // BLOCK) * BLOCK
    full_end = tl.minimum(tl.maximum(full_end, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def _partner_range(offs, ok, first, last, P, below, above, SegLo_b, SegHi_b, shift,
                   HAS_SEG: tl.constexpr):
    """[lo, hi), 0 <= lo <= hi <= P: the partners that positions offs (global, valid where ok,
    spanning [first, last] in partner coordinates) may see: the band [first - below,
    last + above], cut to the P partners and, with segments, to the span [min first
    occurrence, max last occurrence] of their segment ids (global positions, minus shift: the
    partners' global position of coordinate 0)."""
    lo = tl.maximum(first - below, 0)
    hi = tl.minimum(last + above + 1, P)
    if HAS_SEG:
        seg_lo = tl.min(tl.load(SegLo_b + offs, mask=ok, other=1 << 30), 0) - shift
        seg_hi = tl.max(tl.load(SegHi_b + offs, mask=ok, other=0), 0) - shift
        lo = tl.maximum(lo, seg_lo)
        hi = tl.minimum(hi, seg_hi)
    return lo, tl.maximum(hi, lo)


# --------------------------------------------------------------------------------------------
# Soft-capping
# --------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh of fp32 x within a few ulps, from arithmetic and exp2 only (also what the
    interpreter runs): the [7/6] Pade approximant of tanh (Lambert's continued fraction) for
    |x| < 1, where it is exact to 2e-12, and (1 - e) / (1 + e) with e = exp(-2|x|) beyond,
    where that difference no longer cancels; the sign restored last."""
    a = tl.abs(x)
    a2 = a * a
    near = (a * (135135.0 + a2 * (17325.0 + a2 * (378.0 + a2)))
            / (135135.0 + a2 * (62370.0 + a2 * (3150.0 + 28.0 * a2))))
    e = tl.exp2(-2.8853900817779268 * a)  # exp(-2|x|), -2 log2(e) |x|
    t = tl.where(a < 1.0, near, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _softcap_tile(s, cap_in, cap_out):
    """(capped scores, tanh) of a raw score tile s = q k^T: t = tanh(s * cap_in) with
    cap_in = scale / softcap, and t * cap_out with cap_out = softcap * log2(e): the capped
    scaled score in base 2."""
    t = _tanh(s * cap_in)
    return t * cap_out, t


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                    stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                    offs_m, offs_d, lo, hi, S, qk_scale, win_before, win_after, cap_in, cap_out,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr,
                    EDGE: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) over key blocks [lo, hi) of one query block.

    q: (BLOCK_M, D_PAD); acc: (BLOCK_M, D_PAD) fp32; l_i, m_i: (BLOCK_M,) fp32, m_i in base 2
    (already scaled); offs_m: the rows' global positions; S: the number of keys. BAND: the
    blocks cross an edge of the band (causal diagonal, window) and take the element-wise test
    ``-win_before <= j - i <= win_after``. EDGE: a block may reach past S and takes the bound
    test; interior blocks (not BAND, not EDGE, no padding mask) do
    no per-element masking at all. Scores stay unscaled: the max is scaled once per row and
    ``exp2(s * qk_scale - m)`` is one fused multiply-add per element. SOFTCAP: each tile is
    capped right after its dot (:func:`_softcap_tile`; the launcher passes qk_scale = 1).
    """
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if BAND or EDGE or HAS_MASK:
            col_ok = offs_n < S
            # K^T tile (D_PAD, BLOCK_N) and V tile (BLOCK_N, D_PAD); padded entries read as 0.
            kT = tl.load(K_bh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                         mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(V_bh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if HAS_MASK:
                keep = tl.load(Mask_b + offs_n * stride_ms, mask=col_ok, other=0)
                col_ok = col_ok & (keep != 0)
            s = tl.dot(q, kT, input_precision=DOT_PRECISION)
            if SOFTCAP:
                s, _ = _softcap_tile(s, cap_in, cap_out)
            s = tl.where(col_ok[None, :], s, float("-inf"))
        else:  # interior block: every key exists and is visible through the band
            kT = tl.load(K_bh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None], other=0.0)
            v = tl.load(V_bh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, kT, input_precision=DOT_PRECISION)
            if SOFTCAP:
                s, _ = _softcap_tile(s, cap_in, cap_out)
        if BAND and WINDOW:
            dist = offs_n[None, :] - offs_m[:, None]
            s = tl.where((dist <= win_after) & (dist >= -win_before), s, float("-inf"))
        elif BAND:  # the causal diagonal only
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if HAS_SEG:
            seg_k = tl.load(SegId_b + offs_n, mask=offs_n < S, other=-2)
            s = tl.where(seg_q[:, None] == seg_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row that has seen only masked keys keeps m = -inf; shift by 0 there so that
        # exp2(-inf - m) is 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
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
                     Hq, Sq, Sk, q_off, GROUP, qk_scale, win_before, win_after, cap_in, cap_out,
                     S_BUCKET, SQ_BUCKET,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                     SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(Sq, BLOCK_M), B, Hq). Writes Out (B, Hq, Sq, D) with strides stride_o* and Lse
    (B, Hq, Sq) contiguous.

    Query row r of Q (Sq rows) sits at the global position i = q_off + r among the Sk keys.
    qk_scale = scale * log2(e). Key j is visible from query i iff
    ``i - win_before <= j <= i + win_after`` (causal: win_after = 0), the key is not padded and,
    with HAS_SEG, SegId[b, j] == SegId[b, i]. SegId/SegLo/SegHi: contiguous int32 (B, Sk).
    SOFTCAP: scores capped with cap_in, cap_out (:func:`_softcap_tile`), qk_scale = 1.
    S_BUCKET, SQ_BUCKET are only autotuning keys.
    """
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks carry the most work: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    pos_m = q_off + offs_m  # global positions of the rows
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < Sq
    d_ok = offs_d < HEAD_DIM

    Q_bh = Q + b * stride_qb + h * stride_qh
    K_bh = K + b * stride_kb + hk * stride_kh
    V_bh = V + b * stride_vb + hk * stride_vh
    Mask_b = Mask + b * stride_mb
    SegId_b = SegId + b * Sk
    q = tl.load(Q_bh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    seg_q = tl.zeros([BLOCK_M], tl.int32)
    if HAS_SEG:
        seg_q = tl.load(SegId_b + pos_m, mask=row_ok, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Key blocks outside the band or the segments of these rows are never visited; of the
    # others only those crossing an edge of the band pay for the element-wise band test, and
    # only the block crossing S for the bound test.
    first_m = q_off + start_m
    last_m = q_off + tl.minimum(start_m + BLOCK_M, Sq) - 1
    lo, hi = _partner_range(pos_m, row_ok, first_m, last_m, Sk, win_before, win_after,
                            SegLo + b * Sk, SegHi + b * Sk, 0, HAS_SEG)
    lo, full_lo, full_hi, hi = _tile_ranges(first_m, last_m, lo, hi, win_before, win_after,
                                            BLOCK_N)
    inner_hi = tl.maximum(tl.minimum(full_hi, (Sk // BLOCK_N) * BLOCK_N), full_lo)
    # Stages: the window's lower edge (only with a window: else empty), the interior blocks,
    # the block crossing S when it lies inside the band, the causal diagonal / window's upper
    # edge (only with one: else empty). Leaving the empty stages out at compile time keeps the
    # plain paths' code as lean as without masks.
    if WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                        stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                        pos_m, offs_d, lo, full_lo, Sk, qk_scale, win_before,
                                        win_after, cap_in, cap_out, HEAD_DIM, BLOCK_N, True,
                                        True, WINDOW, HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                    stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                    pos_m, offs_d, full_lo, inner_hi, Sk, qk_scale, win_before,
                                    win_after, cap_in, cap_out, HEAD_DIM, BLOCK_N, False, False,
                                    WINDOW, HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                    stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                    pos_m, offs_d, inner_hi, full_hi, Sk, qk_scale, win_before,
                                    win_after, cap_in, cap_out, HEAD_DIM, BLOCK_N, False, True,
                                    WINDOW, HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
    if CAUSAL or WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, seg_q, K_bh, V_bh, Mask_b, SegId_b,
                                        stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                        pos_m, offs_d, full_hi, hi, Sk, qk_scale, win_before,
                                        win_after, cap_in, cap_out, HEAD_DIM, BLOCK_N, True,
                                        True, WINDOW, HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)

    # Rows with nothing to attend have l = 0: out = 0 and lse = -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i * 0.6931471805599453 + tl.log(l_safe))
    O_bh = Out + b * stride_ob + h * stride_oh
    tl.store(O_bh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + (b * Hq + h) * Sq + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_preprocess_kernel(Out, DOut, Lse, Delta, Lse2,
                                stride_ob, stride_oh, stride_os, stride_od,
                                stride_gb, stride_gh, stride_gs, stride_gd,
                                Hq, S, row_pitch,
                                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr):
    """Grid (row_pitch // BLOCK_M, B, Hq), S = Sq, the query rows, row_pitch: S rounded up to
    a multiple of ``_ROW_PITCH``. Delta (B, Hq, row_pitch) fp32 = rowsum(dOut * Out); Lse2
    (B, Hq, row_pitch) fp32 = lse (B, Hq, S) in base 2, +inf on rows that attend nothing
    (lse = -inf), so that the backward's ``P = exp2(s * qk_scale - lse2)`` is 0 there with no
    test per tile. The rows past S are written too (delta 0, lse2 +inf): the dK/dV kernel
    reads whole BLOCK_M blocks of them with no mask."""
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
    rows = (b * Hq + h) * row_pitch + offs_m
    tl.store(Delta + rows, delta)
    lse = tl.load(Lse + (b * Hq + h) * S + offs_m, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Lse2 + rows, lse2)


@triton.jit
def _dq_turn(start_m, turn_cap, turn_shift, BLOCK_N: tl.constexpr):
    """The ordered dQ sums' turn of key block kb (of n_kb) on the block of query rows from
    start_m: last - kb, last the highest key block that meets those rows.

    Key block n meets them iff its first key is within reach of their last query (global
    position q_off + start_m + BLOCK_M - 1; a key may lie win_after to the right of its
    query), i.e. n * BLOCK_N < start_m + BLOCK_M + reach with reach = q_off + min(win_after,
    Sk) (Sk: no limit). So last = min(n_kb, cdiv(start_m + BLOCK_M + reach, BLOCK_N)) - 1,
    and last - kb = min(turn_cap, (start_m + turn_shift) // BLOCK_N) with the key block's
    constants turn_cap = n_kb - 1 - kb (the key blocks above it) and turn_shift = BLOCK_M +
    reach + BLOCK_N - 1 - (kb + 1) * BLOCK_N: two scalars live in the loop, not three. The
    quotient is >= 0 on every block of rows the key block visits (it is the number of key
    blocks above kb that meet it before the cap), so truncating and flooring agree."""
    return tl.minimum(turn_cap, (start_m + turn_shift) // BLOCK_N)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, col_ok, seg_k, offs_n, Q_b, DO_b, Lse2_b, Delta_b,
                         DQA_b, Sem_b, turn_cap, turn_shift, SegId_b,
                         stride_qh, stride_qs, stride_qd,
                         stride_gh, stride_gs, stride_gd, stride_ah, stride_as, stride_ad,
                         row_pitch, n_heads, offs_d, lo, hi, Sq, q_off, qk_scale, sm_scale,
                         win_before, win_after, key_edge, cap_in, cap_out,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BAND: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                         HAS_SEG: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                         DQ_ORDERED: tl.constexpr, SOFTCAP: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Accumulate dK (unscaled) and dV of one key block over query blocks [lo, hi) of each of
    n_heads query heads (one flat loop over (head, block) pairs, heads outer, in a fixed
    order); with DQ_ATOMIC also add this key block's share of dQ (scaled) to the fp32 rows of
    DQA_b: with fp32 atomics, or with DQ_ORDERED in key-block order (below).

    k, v: (BLOCK_N, D_PAD); dk, dv: (BLOCK_N, D_PAD) fp32; col_ok: (BLOCK_N,) the key exists
    and is not padded; seg_k: (BLOCK_N,) segment ids of the keys (HAS_SEG); [lo, hi): rows of
    the Sq query rows (multiples of BLOCK_M), row r at the global position q_off + r. Q_b,
    DO_b, DQA_b: the group's first head (head g at + g * stride_*h); Lse2_b, Delta_b: its
    rows, row_pitch apart per head and padded (lse2 +inf, delta 0) up to a multiple of
    BLOCK_M, so their loads take no mask. One loop rather than a loop per head: the software
    pipeline has a single prologue, and nothing lives across two loops.

    Works on transposed tiles: sT = K Q^T is (BLOCK_N, BLOCK_M), unscaled;
    ``exp2(sT * qk_scale - lse2)`` is one fused multiply-add. Keys past S need no test for
    dK/dV (their rows are never stored, and a row of dK/dV depends only on its own row of P);
    only the dQ sum over keys does, on the block crossing S (key_edge). BAND: the element-wise
    band test, as in the forward (the causal test, true on every interior block, is also what
    the causal kernel applies on all its blocks: one loop holds fewer registers than a masked
    and an unmasked one). SOFTCAP: sT is capped as in the forward and dS^T takes the cap's
    derivative 1 - tanh^2. dP^T - delta is formed before P^T, so that only P^T and that
    difference are live when dS^T is.

    DQ_ORDERED: the dQ tile of (head g, query block) takes the key blocks' shares in a fixed
    order, FlashAttention-3's: from the highest key block that meets the tile down to the
    lowest, so the sums are the same at every run. Sem_b holds one int32 counter per query
    row (the block's first row counts for it; the group's heads row_pitch apart, as Lse2_b):
    the key blocks that added to the tile so far. This key block takes its turn on the tile
    (:func:`_dq_turn` of turn_cap, turn_shift): the number of key blocks above it that meet
    the tile. It waits until the counter reads that turn, adds its share with a plain
    read-add-write (it alone holds the tile then), and counts itself.

    Exact because the key blocks that meet a block of rows are consecutive and end at the
    turn's "last": the first and the past-the-end block of rows a key block visits
    (floor(lo / BLOCK_M), cdiv(max(hi, lo), BLOCK_M), from :func:`_partner_range` and
    :func:`_tile_ranges`) never decrease from one key block to the next, for any causal
    diagonal, window, padding mask and q_off (without segment ids, whose spans need not grow
    with the key position: those calls take the separate kernel). A key block whose range is
    empty may still meet one block of rows, rounded from the empty range: the blocks above it
    meet that one too, and one past Sq is skipped. The waits cannot deadlock: a key block
    waits only for higher key blocks, which the launcher's grid puts at lower program ids
    (:func:`_attn_bwd_dkdv_kernel`), scheduled earlier. Causal key blocks from the right are
    also the shortest walks first, so a tile's adds tend to come in the order its counter
    wants (FlashAttention-3's reason for that order). On a GPU the wait and the count are
    inline PTX (``_WAIT_PTX``, ``_DONE_PTX``), so the loop stays pipelined
    (tools/check_triton_compile.py's sm_90 compile has the atomic kernel's asynchronous
    copies); the interpreter reads the counter once and puts NaN into the tile if the turn
    has not come (see ``_PTX_SYNC``). What the waits cost against the 2 matmuls saved is for
    a GPU to measure (tools/gpu_validate.sh quick --parts q).
    """
    d_ok = offs_d < HEAD_DIM
    n_blocks = (hi - lo) // BLOCK_M
    for it in range(n_heads * n_blocks):
        g = it // n_blocks
        start_m = lo + (it - g * n_blocks) * BLOCK_M
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Sq
        ok = row_ok[:, None] & d_ok[None, :]
        rows = g * row_pitch + offs_m
        do = tl.load(DO_b + g * stride_gh + offs_m[:, None] * stride_gs
                     + offs_d[None, :] * stride_gd, mask=ok, other=0.0)
        delta = tl.load(Delta_b + rows)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - delta[None, :]
        q = tl.load(Q_b + g * stride_qh + offs_m[:, None] * stride_qs
                    + offs_d[None, :] * stride_qd, mask=ok, other=0.0)
        # Rows past Sq read lse2 = +inf: P = exp2(s - inf) = 0 there.
        lse2 = tl.load(Lse2_b + rows)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if SOFTCAP:
            sT, tT = _softcap_tile(sT, cap_in, cap_out)
        if HAS_MASK:
            sT = tl.where(col_ok[:, None], sT, float("-inf"))
        elif DQ_ATOMIC:
            if key_edge:
                sT = tl.where(col_ok[:, None], sT, float("-inf"))
        if BAND and WINDOW:
            dist = offs_n[:, None] - (q_off + offs_m)[None, :]
            sT = tl.where((dist <= win_after) & (dist >= -win_before), sT, float("-inf"))
        elif BAND:  # the causal test i >= j, i = q_off + start_m + c for the column c: the
            # column index is a constant per register, the right side one value per key row
            sT = tl.where(tl.arange(0, BLOCK_M)[None, :] >= (offs_n - q_off - start_m)[:, None],
                          sT, float("-inf"))
        if HAS_SEG:
            seg_q = tl.load(SegId_b + q_off + offs_m, mask=row_ok, other=-1)
            sT = tl.where(seg_k[:, None] == seg_q[None, :], sT, float("-inf"))
        pT = tl.exp2(sT * qk_scale - lse2[None, :])
        if SOFTCAP:  # dS^T = P^T (1 - tanh^2) (dP^T - delta): tanh's tile dies here
            dsT = (pT * (1.0 - tT * tT) * dpT).to(q.dtype)
        else:
            dsT = (pT * dpT).to(q.dtype)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * sm_scale
            dq_ptrs = DQA_b + g * stride_ah + offs_m[:, None] * stride_as \
                + offs_d[None, :] * stride_ad
            if DQ_ORDERED:
                # a block of rows past Sq (an empty range rounded to a tile) holds nothing
                if start_m < Sq:
                    count = Sem_b + g * row_pitch + start_m
                    turn = _dq_turn(start_m, turn_cap, turn_shift, BLOCK_N)
                    if _PTX_SYNC:
                        seen = tl.inline_asm_elementwise(_WAIT_PTX, "=r,l,r", [count, turn],
                                                         dtype=tl.int32, is_pure=False, pack=1)
                        # + (seen - turn) = + 0: the read depends on the wait, so no pass
                        # moves it before
                        dq += tl.load(dq_ptrs + (seen - turn), mask=ok, other=0.0,
                                      cache_modifier=".cg")
                        tl.store(dq_ptrs, dq, mask=ok)
                        tl.inline_asm_elementwise(_DONE_PTX, "=r,l", [count], dtype=tl.int32,
                                                  is_pure=False, pack=1)
                    else:   # the interpreter: one program at a time (see _PTX_SYNC)
                        seen = tl.atomic_add(count, 0, sem="acquire")
                        dq += tl.load(dq_ptrs, mask=ok, other=0.0)
                        dq = tl.where(seen == turn, dq, float("nan"))
                        tl.store(dq_ptrs, dq, mask=ok)
                        tl.atomic_add(count, 1, sem="release")
            else:
                tl.atomic_add(dq_ptrs, dq, mask=ok, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, Mask, SegId, SegLo, SegHi, DOut, Lse2, Delta, DK, DV, DQA,
                          Sem, stride_qb, stride_qh, stride_qs, stride_qd,
                          stride_kb, stride_kh, stride_ks, stride_kd,
                          stride_vb, stride_vh, stride_vs, stride_vd,
                          stride_mb, stride_ms,
                          stride_gb, stride_gh, stride_gs, stride_gd,
                          stride_db, stride_dh, stride_ds, stride_dd,
                          stride_ab, stride_ah, stride_as, stride_ad,
                          Hq, Hkv, NBH, Sq, Sk, row_pitch, q_off, GROUP, qk_scale, sm_scale,
                          win_before, win_after, cap_in, cap_out, S_BUCKET, SQ_BUCKET,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                          WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                          DQ_ATOMIC: tl.constexpr, DQ_ORDERED: tl.constexpr,
                          ACCUMULATE: tl.constexpr,
                          SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(Sk, BLOCK_N), B, Hkv). Writes DK, DV (B, Hkv, Sk, D), both with strides
    stride_d*, or with ACCUMULATE adds into them (fp32 accumulators; this program owns its key
    rows, so a plain read-add-write); with DQ_ATOMIC also adds dQ into DQA (B, Hq, Sq, D) fp32
    (strides stride_a*, zeroed first). The Sq query rows sit at global positions q_off + r.

    Each program loops over the GROUP query heads of its KV head in a fixed order, so the GQA
    sum of dK/dV is deterministic (the atomic dQ sum is not). Lse2, Delta: (B, Hq, row_pitch)
    contiguous fp32 from the preprocess kernel, rows past Sq padded (+inf, 0); BLOCK_M divides
    row_pitch (a multiple of ``_ROW_PITCH``). Visibility as in the forward; the query blocks
    that cannot see any key of this block are never visited.

    DQ_ORDERED (with DQ_ATOMIC): dQ added from the highest key block down
    (``_attn_bwd_dkdv_inner``), Sem (B, Hq, row_pitch) int32 counters, zeroed; the grid is
    then one-dimensional, cdiv(Sk, BLOCK_N) * NBH programs with NBH = B * Hkv, the key blocks
    walked right to left (program id p holds key block cdiv(Sk, BLOCK_N) - 1 - p // NBH) and
    the (batch, KV head) pairs fastest: a program waits only on programs of lower index, and
    the programs in flight at once are spread over the heads (consecutive programs are other
    heads, whose counters they never share) rather than all on one head's key blocks.
    """
    tl.static_assert(_ROW_PITCH % BLOCK_M == 0, "BLOCK_M must divide _ROW_PITCH")
    n_kb = tl.cdiv(Sk, BLOCK_N)
    if DQ_ORDERED:
        pid = tl.program_id(0)
        step = pid // NBH
        pid_n = n_kb - 1 - step
        bh = pid - step * NBH
        b = (bh // Hkv).to(tl.int64)
        hk = (bh % Hkv).to(tl.int64)
    else:
        pid_n = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        hk = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    col_ok = offs_n < Sk
    ok = col_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh
                + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=ok, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh
                + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=ok, other=0.0)
    SegId_b = SegId + b * Sk
    seg_k = tl.zeros([BLOCK_N], tl.int32)
    if HAS_SEG:
        seg_k = tl.load(SegId_b + offs_n, mask=col_ok, other=-2)
    # Query i sees key j iff j - win_after <= i <= j + win_before (and the same segment, a
    # symmetric relation): the band seen from the keys has its two reaches swapped. In query
    # rows (r = i - q_off) the keys sit at j - q_off.
    last_n = tl.minimum(start_n + BLOCK_N, Sk) - 1
    lo, hi = _partner_range(offs_n, col_ok, start_n - q_off, last_n - q_off, Sq, win_after,
                            win_before, SegLo + b * Sk, SegHi + b * Sk, q_off, HAS_SEG)
    lo, full_lo, full_hi, hi = _tile_ranges(start_n - q_off, last_n - q_off, lo, hi, win_after,
                                            win_before, BLOCK_M)
    key_edge = start_n + BLOCK_N > Sk
    # the ordered dQ sums' turns (_dq_turn): the key blocks above this one, and the shift
    turn_cap = n_kb - 1 - pid_n
    turn_shift = BLOCK_M + BLOCK_N - 1 + q_off + tl.minimum(win_after, Sk) - (pid_n + 1) * BLOCK_N
    if HAS_MASK:
        keep = tl.load(Mask + b * stride_mb + offs_n * stride_ms, mask=col_ok, other=0)
        col_ok = col_ok & (keep != 0)

    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    h0 = hk * GROUP  # the group's first query head
    Q_b = Q + b * stride_qb + h0 * stride_qh
    DO_b = DOut + b * stride_gb + h0 * stride_gh
    DQA_b = DQA + b * stride_ab + h0 * stride_ah
    row_base = (b * Hq + h0) * row_pitch
    # Seen from a key block the causal diagonal is the lower edge (query blocks [lo, full_lo))
    # and the window's lower edge the upper one ([full_hi, hi)). Causal without a window: one
    # loop over [lo, full_hi) taking the causal test on every block (exact: the test is true
    # on the interior blocks), which compiles to fewer live registers than two loops.
    if WINDOW:
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, col_ok, seg_k, offs_n, Q_b, DO_b,
                                      Lse2 + row_base, Delta + row_base, DQA_b,
                                      Sem + row_base, turn_cap, turn_shift, SegId_b,
                                      stride_qh, stride_qs, stride_qd, stride_gh, stride_gs,
                                      stride_gd, stride_ah, stride_as, stride_ad, row_pitch,
                                      GROUP, offs_d, lo, full_lo, Sq, q_off, qk_scale, sm_scale,
                                      win_before, win_after, key_edge, cap_in, cap_out,
                                      HEAD_DIM, BLOCK_M, BLOCK_N, True, WINDOW, HAS_MASK,
                                      HAS_SEG, DQ_ATOMIC, DQ_ORDERED, SOFTCAP, DOT_PRECISION)
        interior_lo = full_lo
    else:
        interior_lo = lo
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, col_ok, seg_k, offs_n, Q_b, DO_b,
                                  Lse2 + row_base, Delta + row_base, DQA_b,
                                  Sem + row_base, turn_cap, turn_shift, SegId_b,
                                  stride_qh, stride_qs, stride_qd, stride_gh, stride_gs,
                                  stride_gd, stride_ah, stride_as, stride_ad, row_pitch,
                                  GROUP, offs_d, interior_lo, full_hi, Sq, q_off, qk_scale,
                                  sm_scale, win_before, win_after, key_edge, cap_in, cap_out,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL and not WINDOW, WINDOW,
                                  HAS_MASK, HAS_SEG, DQ_ATOMIC, DQ_ORDERED, SOFTCAP,
                                  DOT_PRECISION)
    if WINDOW:
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, col_ok, seg_k, offs_n, Q_b, DO_b,
                                      Lse2 + row_base, Delta + row_base, DQA_b,
                                      Sem + row_base, turn_cap, turn_shift, SegId_b,
                                      stride_qh, stride_qs, stride_qd, stride_gh, stride_gs,
                                      stride_gd, stride_ah, stride_as, stride_ad, row_pitch,
                                      GROUP, offs_d, full_hi, hi, Sq, q_off, qk_scale, sm_scale,
                                      win_before, win_after, key_edge, cap_in, cap_out,
                                      HEAD_DIM, BLOCK_M, BLOCK_N, True, WINDOW, HAS_MASK,
                                      HAS_SEG, DQ_ATOMIC, DQ_ORDERED, SOFTCAP, DOT_PRECISION)

    out_off = b * stride_db + hk * stride_dh + offs_n[:, None] * stride_ds + offs_d[None, :] * stride_dd
    if ACCUMULATE:  # one tile at a time: the read adds no more live registers than the loop had
        dk = dk * sm_scale + tl.load(DK + out_off, mask=ok, other=0.0)
        tl.store(DK + out_off, dk, mask=ok)
        dv = dv + tl.load(DV + out_off, mask=ok, other=0.0)
        tl.store(DV + out_off, dv, mask=ok)
    else:
        tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=ok)
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, offs_m, K_bh, V_bh, Mask_b, SegId_b,
                       stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                       offs_d, lo, hi, S, qk_scale, win_before, win_after, cap_in, cap_out,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr,
                       EDGE: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Accumulate dQ (unscaled) of one query block over key blocks [lo, hi); offs_m: the rows'
    global positions; S: the number of keys.

    q, do: (BLOCK_M, D_PAD); lse2: (BLOCK_M,) base-2 lse with +inf for empty rows;
    delta: (BLOCK_M,); dq: (BLOCK_M, D_PAD) fp32. BAND, EDGE: the band and bound tests, as in
    the forward; interior blocks do no per-element masking. SOFTCAP: capped scores and the
    cap's derivative on dS, as in the dK/dV kernel.
    """
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if BAND or EDGE or HAS_MASK:
            col_ok = offs_n < S
            ok = col_ok[:, None] & d_ok[None, :]
            k = tl.load(K_bh + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=ok, other=0.0)
            v = tl.load(V_bh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=ok, other=0.0)
            if HAS_MASK:
                keep = tl.load(Mask_b + offs_n * stride_ms, mask=col_ok, other=0)
                col_ok = col_ok & (keep != 0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SOFTCAP:
                s, t = _softcap_tile(s, cap_in, cap_out)
            if HAS_MASK or WINDOW or not BAND:  # else the causal test below covers j >= S
                s = tl.where(col_ok[None, :], s, float("-inf"))
        else:
            k = tl.load(K_bh + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=d_ok[None, :], other=0.0)
            v = tl.load(V_bh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SOFTCAP:
                s, t = _softcap_tile(s, cap_in, cap_out)
        if BAND and WINDOW:
            dist = offs_n[None, :] - offs_m[:, None]
            s = tl.where((dist <= win_after) & (dist >= -win_before), s, float("-inf"))
        elif BAND:  # the causal diagonal only
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if HAS_SEG:
            seg_k = tl.load(SegId_b + offs_n, mask=offs_n < S, other=-2)
            s = tl.where(seg_q[:, None] == seg_k[None, :], s, float("-inf"))
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if SOFTCAP:  # only dS reads P: it carries the cap's derivative from here on
            p = p * (1.0 - t * t)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, Mask, SegId, SegLo, SegHi, DOut, Lse2, Delta, DQ,
                        stride_qb, stride_qh, stride_qs, stride_qd,
                        stride_kb, stride_kh, stride_ks, stride_kd,
                        stride_vb, stride_vh, stride_vs, stride_vd,
                        stride_mb, stride_ms,
                        stride_gb, stride_gh, stride_gs, stride_gd,
                        stride_db, stride_dh, stride_ds, stride_dd,
                        Hq, Sq, Sk, row_pitch, q_off, GROUP, qk_scale, sm_scale, win_before,
                        win_after, cap_in, cap_out, S_BUCKET, SQ_BUCKET,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                        WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                        SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(Sq, BLOCK_M), B, Hq). Writes DQ (B, Hq, Sq, D) with strides stride_d*; row r
    at the global position q_off + r. Visits the key blocks the forward visits, in the same
    stages."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks carry the most work: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    pos_m = q_off + offs_m
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < Sq
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh
                + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=ok, other=0.0)
    do = tl.load(DOut + b * stride_gb + h * stride_gh
                 + offs_m[:, None] * stride_gs + offs_d[None, :] * stride_gd, mask=ok, other=0.0)
    row_base = (b * Hq + h) * row_pitch
    lse2 = tl.load(Lse2 + row_base + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    K_bh = K + b * stride_kb + hk * stride_kh
    V_bh = V + b * stride_vb + hk * stride_vh
    Mask_b = Mask + b * stride_mb
    SegId_b = SegId + b * Sk
    seg_q = tl.zeros([BLOCK_M], tl.int32)
    if HAS_SEG:
        seg_q = tl.load(SegId_b + pos_m, mask=row_ok, other=-1)

    first_m = q_off + start_m
    last_m = q_off + tl.minimum(start_m + BLOCK_M, Sq) - 1
    lo, hi = _partner_range(pos_m, row_ok, first_m, last_m, Sk, win_before, win_after,
                            SegLo + b * Sk, SegHi + b * Sk, 0, HAS_SEG)
    lo, full_lo, full_hi, hi = _tile_ranges(first_m, last_m, lo, hi, win_before, win_after,
                                            BLOCK_N)
    inner_hi = tl.maximum(tl.minimum(full_hi, (Sk // BLOCK_N) * BLOCK_N), full_lo)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if WINDOW:  # stages as in the forward
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, pos_m, K_bh, V_bh, Mask_b,
                                SegId_b, stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                offs_d, lo, full_lo, Sk, qk_scale, win_before, win_after,
                                cap_in, cap_out, HEAD_DIM, BLOCK_N, True, True, WINDOW,
                                HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
    if CAUSAL and not WINDOW:
        # One loop over every key block: the causal test, true on the interior blocks, also
        # rules out the keys past Sk for every row < Sq (q_off + Sq <= Sk); the keys' loads
        # are masked. One loop holds fewer registers than three (interior, edge, diagonal).
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, pos_m, K_bh, V_bh, Mask_b,
                                SegId_b, stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                offs_d, full_lo, hi, Sk, qk_scale, win_before, win_after,
                                cap_in, cap_out, HEAD_DIM, BLOCK_N, True, True, WINDOW,
                                HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
    else:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, pos_m, K_bh, V_bh, Mask_b,
                                SegId_b, stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                offs_d, full_lo, inner_hi, Sk, qk_scale, win_before, win_after,
                                cap_in, cap_out, HEAD_DIM, BLOCK_N, False, False, WINDOW,
                                HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, pos_m, K_bh, V_bh, Mask_b,
                                SegId_b, stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                offs_d, inner_hi, full_hi, Sk, qk_scale, win_before, win_after,
                                cap_in, cap_out, HEAD_DIM, BLOCK_N, False, True, WINDOW,
                                HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
        if WINDOW:
            dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, seg_q, pos_m, K_bh, V_bh, Mask_b,
                                    SegId_b, stride_ks, stride_kd, stride_vs, stride_vd,
                                    stride_ms, offs_d, full_hi, hi, Sk, qk_scale, win_before,
                                    win_after, cap_in, cap_out, HEAD_DIM, BLOCK_N, True, True,
                                    WINDOW, HAS_MASK, HAS_SEG, SOFTCAP, DOT_PRECISION)
    tl.store(DQ + b * stride_db + h * stride_dh
             + offs_m[:, None] * stride_ds + offs_d[None, :] * stride_dd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Autotuning (GPU only)
# --------------------------------------------------------------------------------------------
def _cfg(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n},
                         num_warps=warps, num_stages=stages)


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and architecture family, in
# order of preference (larger tiles first). Forward and dQ hold a query tile and stream keys
# (large BLOCK_M); dK/dV hold a key tile and stream queries (large BLOCK_N). On a GPU the
# launcher compiles them for the specialization at hand and keeps those whose compiled kernel
# neither spills registers nor exceeds the device's shared memory (kernels/_launch.py,
# "Pruning by what the compiler reports"), so the first one kept is the largest tile that
# fits. The smallest tile of each list is the last resort: 32x32 (fwd, dq) and 16x16 (dK/dV)
# compile spill-free at head_dim 256 (tools/check_triton_compile.py).
_CONFIGS = {
    ("fwd", "hopper"): [_cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2),
                        _cfg(128, 32, 8, 3), _cfg(128, 32, 4, 3), _cfg(64, 64, 4, 3),
                        _cfg(64, 32, 8, 2), _cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)],
    ("fwd", "ampere"): [_cfg(128, 64, 8, 2), _cfg(128, 64, 4, 3), _cfg(128, 32, 8, 3),
                        _cfg(128, 32, 4, 3), _cfg(64, 64, 4, 3), _cfg(64, 32, 8, 2),
                        _cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)],
    ("dkdv", "hopper"): [_cfg(64, 128, 8, 3), _cfg(64, 128, 8, 2), _cfg(32, 128, 8, 3),
                         _cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2), _cfg(64, 64, 4, 3),
                         _cfg(32, 64, 8, 2), _cfg(32, 64, 4, 3), _cfg(16, 64, 4, 2),
                         _cfg(16, 32, 4, 2), _cfg(16, 16, 4, 2)],
    ("dkdv", "ampere"): [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2), _cfg(64, 64, 4, 2),
                         _cfg(32, 64, 8, 2), _cfg(32, 64, 4, 2), _cfg(16, 64, 4, 2),
                         _cfg(16, 32, 4, 2), _cfg(16, 16, 4, 2)],
    ("dq", "hopper"): [_cfg(128, 64, 8, 3), _cfg(128, 128, 8, 2), _cfg(128, 64, 8, 2),
                       _cfg(128, 32, 8, 2), _cfg(64, 64, 8, 2), _cfg(64, 64, 4, 3),
                       _cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)],
    ("dq", "ampere"): [_cfg(128, 32, 8, 2), _cfg(64, 64, 8, 2), _cfg(64, 32, 8, 2),
                       _cfg(32, 32, 4, 2)],
}
# S_BUCKET buckets the keys' length, SQ_BUCKET the query rows' (a query chunk has fewer).
_KEYS = {"fwd": ["HEAD_DIM", "CAUSAL", "S_BUCKET", "SQ_BUCKET"],
         "dkdv": ["HEAD_DIM", "CAUSAL", "S_BUCKET", "SQ_BUCKET", "DQ_ATOMIC", "DQ_ORDERED",
                  "ACCUMULATE"],
         "dq": ["HEAD_DIM", "CAUSAL", "S_BUCKET", "SQ_BUCKET"]}


def attention_configs(kind: str, family: str) -> list:
    """Every launch candidate (``triton.Config`` with BLOCK_M, BLOCK_N) of kernel ``kind``
    ("fwd", "dkdv", "dq") for the architecture ``family`` ("hopper": sm_90 and newer,
    "ampere": sm_80 / sm_86 / sm_89), in the order they are tried."""
    if (kind, family) not in _CONFIGS:
        raise ValueError(f"attention_configs: kind must be 'fwd', 'dkdv' or 'dq' and family "
                         f"'hopper' or 'ampere', got {kind!r}, {family!r}")
    return list(_CONFIGS[(kind, family)])


def pre_config():
    """The rowsum pre-pass's one config (not pruned: a row-wise kernel)."""
    return triton.Config({"BLOCK_M": _PRE_BLOCK_M}, num_warps=4, num_stages=3)


_KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}


@_launch.cached
def _launcher(kind: str, device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
              has_mask: bool, has_seg: bool, window: bool, precision: str,
              dq_atomic: bool = False, accumulate: bool = False, softcap: bool = False,
              first=None, only: bool = False, max_spills: int = 0, ordered: bool = False):
    """(kernel, constexpr arguments) of one kernel for one specialization: a fixed config in
    the interpreter; on a GPU the candidates pruned by their compiled resources
    (``_launch.Pruned``): with ``CKPT_EXT_AUTOTUNE=0`` the first that fits (no timing), else
    the autotuned kernel over those that fit.
    dq_atomic, accumulate: the dK/dV kernel's DQ_ATOMIC and ACCUMULATE; softcap: SOFTCAP (the
    capped scores). The autotuner restores the tensors these add into (DQA; DK and DV) after
    each timed run, so that the launch that follows adds into the caller's values once.
    first: an ``attention_tuning.Candidate`` put before the built-in candidates (the winners
    file's), or with ``only`` launched alone (``attention_tuning.force``; in the interpreter
    its block sizes); max_spills: the spill words per thread a kept config may have (a
    measured winner's own); ordered: the dK/dV kernel's DQ_ORDERED (with dq_atomic), whose
    counters (Sem) the autotuner restores too."""
    meta = dict(_common_meta(head_dim, causal, dtype, precision), HAS_MASK=has_mask,
                HAS_SEG=has_seg, WINDOW=window, SOFTCAP=softcap)
    restore = []
    if kind == "dkdv":
        meta["DQ_ATOMIC"] = dq_atomic
        meta["DQ_ORDERED"] = ordered
        meta["ACCUMULATE"] = accumulate
        restore = (["DQA"] if dq_atomic else []) + (["Sem"] if ordered else []) \
            + (["DK", "DV"] if accumulate else [])
    configs, budget = [], None
    if not _launch.INTERPRET:
        info = _launch.device_info(device)
        configs, budget = _CONFIGS[(kind, info.arch)], info.smem_budget
        if first is not None:
            configs = [first.to_config()] + ([] if only else [
                c for c in configs if _tuning.Candidate.of_config(c) != first])
    interpret_meta = ((lambda: INTERPRETER_BLOCKS[kind]) if first is None or not only
                      else first.blocks())
    extra = {"restore_value": restore} if restore else {}
    return _launch.select(_KERNELS[kind], configs, key=_KEYS[kind], smem_budget=budget,
                          interpret_meta=interpret_meta, max_spills=max_spills, **extra), meta


def _bwd_choice(kind, device, dtype, head_dim, causal, sq_bucket, sk_bucket, dq_atomic,
                accumulate, softcap):
    """(first, only, max_spills) for :func:`_launcher` of a backward kernel: a forced
    configuration (``attention_tuning.force``), else on a GPU the winners file's for this
    bucket with the spills it was measured with (not for soft-capped kernels), else none."""
    pinned = _tuning.forced(kind)
    if pinned is not None:
        return pinned, True, 0
    if _launch.INTERPRET or softcap:
        return None, False, 0
    cap = _launch.device_info(device).capability
    found = _tuning.winner(kind, cap, dtype, head_dim, causal, sq_bucket, sk_bucket,
                           dq_atomic if kind == "dkdv" else None,
                           accumulate if kind == "dkdv" else None)
    return (None, False, 0) if found is None else (found[0], False, found[1])


def _s_bucket(S: int) -> int:
    """Autotuning bucket of the sequence length: next power of two, clamped to [128, 32768]."""
    return _launch.pow2_bucket(S, 128, 32768)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
_NO_LIMIT = 1 << 30  # a band reach that no sequence reaches: "no limit on this side"


def _kernel_rules(name, q, D):
    """What the Triton kernels add to the op's checks (``ckpt_ext._checks``, shared with the
    fakes): head_dim 16..256, fp16/bf16/fp32, a CUDA device (or the interpreter)."""
    if not 16 <= D <= 256:
        raise ValueError(f"{name}: q must have head_dim D in 16..256 for the Triton kernels, "
                         f"got D={D}")
    _launch.check_operands(name, ("q", q))


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


def _cap_args(scale, softcap):
    """(qk_scale, cap_in, cap_out, SOFTCAP) for the kernels: without a cap qk_scale folds the
    scale and log2(e) into the FMA; with one the capped tiles come out scaled and in base 2
    (:func:`_softcap_tile`) and qk_scale is 1."""
    if softcap == 0.0:
        return float(scale) * _LOG2E, 1.0, 1.0, False
    return 1.0, float(scale) / float(softcap), float(softcap) * _LOG2E, True


def _empty_bshd(B, H, S, D, dtype, device):
    """An uninitialised (B, H, S, D) tensor laid out as (B, S, H, D) in memory (see the module
    docstring, "Layout")."""
    return torch.empty((B, S, H, D), dtype=dtype, device=device).transpose(1, 2)


def _common_meta(D, causal, dtype, precision=None):
    # fp32 inputs follow torch's float32 matmul precision (_launch.dot_precision); fp16/bf16
    # inputs: tensor-core dots (the precision argument only affects fp32 operands).
    return dict(HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)), CAUSAL=bool(causal),
                DOT_PRECISION=precision or _launch.dot_precision(dtype))


def attention_fwd(q, k, v, key_padding_mask, segment_ids, window, causal: bool, scale: float,
                  q_offset: int = 0, softcap: float = 0.0):
    """Flash attention forward.

    q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D) with Hq % Hkv == 0; q_offset: q's rows are the
    queries at positions q_offset..q_offset+Sq-1 of the Sk keys (0 <= q_offset,
    q_offset + Sq <= Sk; Sq == Sk, q_offset 0 is plain self-attention), and every rule below
    reads those global positions; key_padding_mask: None or bool (B, Sk), True = key may be
    attended; segment_ids: None or int32/int64 (B, Sk), a query sees only keys with its id;
    window: None or int > 0, HF's sliding window: key j is visible from query i iff
    ``i - window < j`` (and ``j < i + window`` when not causal); causal: ``j <= i``;
    softcap > 0: each scaled score s becomes ``softcap * tanh(s / softcap)`` first (0: none).
    Returns ``(out, lse)``: out (B, Hq, Sq, D) in q's dtype, laid out (B, Sq, Hq, D) in memory
    (``out.transpose(1, 2)`` is contiguous); lse (B, Hq, Sq) float32 contiguous,
    natural-log logsumexp of the scaled masked scores, -inf for rows with nothing to attend
    (their out is 0). Key tiles that the band or the segments rule out are not visited.
    """
    B, Hq, Hkv, Sq, Sk, D = _checks._check_qkv("attention_fwd", q, k, v,
                                                         key_padding_mask, segment_ids, window,
                                                         scale, q_offset, softcap)
    _kernel_rules("attention_fwd", q, D)
    out = _empty_bshd(B, Hq, Sq, D, q.dtype, q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if B * Hq * Sq == 0:
        return out, lse
    mask, stride_mb, stride_ms, has_mask = _mask_args(key_padding_mask, q)
    seg_id, seg_lo, seg_hi, has_seg = _segment_args(segment_ids, q)
    before, after = _band(Sk, causal, window)
    qk_scale, cap_in, cap_out, capped = _cap_args(scale, softcap)
    kernel, meta = _launcher("fwd", q.device, q.dtype, D, bool(causal), has_mask, has_seg,
                             before != _NO_LIMIT, _launch.dot_precision(q.dtype), False, False,
                             capped)

    def grid(m):
        return (_launch.cdiv(Sq, m["BLOCK_M"]), B, Hq)

    with _launch.on_device(q.device):
        kernel[grid](q, k, v, mask, seg_id, seg_lo, seg_hi, out, lse,
                     *q.stride(), *k.stride(), *v.stride(), stride_mb, stride_ms, *out.stride(),
                     Hq, Sq, Sk, int(q_offset), Hq // Hkv, qk_scale, before, after, cap_in,
                     cap_out, _s_bucket(Sk), _s_bucket(Sq), **meta)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, segment_ids, window, causal: bool,
                  scale: float, q_offset: int = 0, dk_acc=None, dv_acc=None,
                  softcap: float = 0.0):
    """Flash attention backward, recomputing P = exp(scale * q k^T - lse) tile by tile.

    dout, out: (B, Hq, Sq, D) in q's dtype; q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D);
    lse: (B, Hq, Sq) float32 from :func:`attention_fwd`; masks, window, causal, scale,
    q_offset and softcap as in the forward. Returns ``(dq, dk, dv)`` with the shapes and dtype
    of q, k, v, each laid out (B, S, H, D) in memory like out.

    dk_acc, dv_acc: None, or both float32 (B, Hkv, Sk, D) tensors of any strides (no
    overlapping elements): this call's dK / dV (the share of q's Sq query rows) is added into
    them in fp32, never rounded to k's dtype, and dk, dv are returned as empty (0,) tensors of
    k's dtype. Summing the shares of query chunks that cover all the rows gives the whole
    sequence's dK / dV.
    dk/dv of a KV head sum its query group in a fixed order (deterministic, no atomics).
    """
    name = "attention_bwd"
    B, Hq, Hkv, Sq, Sk, D = _checks._check_attention_bwd(name, dout, q, k, v, out, lse,
                                                         key_padding_mask, segment_ids, window,
                                                         scale, q_offset, dk_acc, dv_acc, softcap)
    _kernel_rules(name, q, D)
    accumulate = dk_acc is not None

    dq = _empty_bshd(B, Hq, Sq, D, q.dtype, q.device)
    if accumulate:
        dk, dv = dk_acc, dv_acc  # the kernel adds into them; the op returns placeholders
        ret_dk = torch.empty((0,), dtype=k.dtype, device=q.device)
        ret_dv = torch.empty((0,), dtype=v.dtype, device=q.device)
    else:
        dk = ret_dk = _empty_bshd(B, Hkv, Sk, D, k.dtype, q.device)
        dv = ret_dv = _empty_bshd(B, Hkv, Sk, D, v.dtype, q.device)
    if B * Hq * Sq == 0:  # no query rows: no share of dK / dV
        if not accumulate:
            dk.zero_(), dv.zero_()
        return dq, ret_dk, ret_dv
    row_pitch = _launch.cdiv(Sq, _ROW_PITCH.value) * _ROW_PITCH.value
    delta = torch.empty((B, Hq, row_pitch), dtype=torch.float32, device=q.device)
    lse2 = torch.empty((B, Hq, row_pitch), dtype=torch.float32, device=q.device)
    mask, stride_mb, stride_ms, has_mask = _mask_args(key_padding_mask, q)
    seg_id, seg_lo, seg_hi, has_seg = _segment_args(segment_ids, q)
    before, after = _band(Sk, causal, window)
    spec = (q.device, q.dtype, D, bool(causal), has_mask, has_seg, before != _NO_LIMIT,
            _launch.dot_precision(q.dtype))
    qk_scale, cap_in, cap_out, capped = _cap_args(scale, softcap)
    group = Hq // Hkv
    q_off = int(q_offset)
    buckets = (_s_bucket(Sk), _s_bucket(Sq))
    mode = dq_mode()
    if mode == "auto":   # the choice table's mode for the call under torch's determinism flag
        from .. import attention_route as _route
        arch = (_route.cuda_capabilities(q.device).arch if q.device.type == "cuda"
                else q.device.type)
        mode = _route.triton_dq_mode(
            _route.Call.of("bwd", q, k, key_padding_mask, segment_ids, window, causal,
                           q_offset, softcap), arch)
    # "ordered" needs the key blocks that meet a block of rows to be consecutive (see
    # _attn_bwd_dkdv_inner): segment ids take the separate dQ kernel
    ordered = mode == "ordered" and not has_seg
    atomic = mode == "atomic" or ordered
    if atomic:  # fp32 sums, zeroed; for fp32 inputs dq is its own accumulator
        dq_acc = dq if q.dtype == torch.float32 else _empty_bshd(B, Hq, Sq, D, torch.float32,
                                                                 q.device)
        dq_acc.zero_()
    else:
        dq_acc = dq  # not written by the dK/dV kernel
    # the ordered sums' counters, one per query row of each head (delta's layout); else a
    # placeholder the kernel never reads
    sem = torch.zeros((B, Hq, row_pitch), dtype=torch.int32, device=q.device) if ordered \
        else delta
    if ordered:   # a forced configuration, else the built-in ones (no winner measured yet)
        pinned = _tuning.forced("dkdv")
        choice = (pinned, True, 0) if pinned is not None else (None, False, 0)
    else:
        choice = _bwd_choice("dkdv", q.device, q.dtype, D, causal, *buckets[::-1], atomic,
                             accumulate, capped)
    dkdv, dkdv_meta = _launcher("dkdv", *spec, atomic, accumulate, capped, *choice,
                                ordered=ordered)
    with _launch.on_device(q.device):
        _attn_bwd_preprocess_kernel[(row_pitch // _PRE_BLOCK_M, B, Hq)](
            out, dout, lse.contiguous(), delta, lse2, *out.stride(), *dout.stride(), Hq, Sq,
            row_pitch,
            HEAD_DIM=D, D_PAD=dkdv_meta["D_PAD"], BLOCK_M=_PRE_BLOCK_M)

        # The kernel writes dk and dv with one set of strides: accumulators laid out
        # differently from each other go through a copy of dv_acc in dk_acc's layout.
        dv_run = dv
        if dv.stride() != dk.stride():
            dv_run = torch.empty_strided(dk.shape, dk.stride(), dtype=dv.dtype, device=dv.device)
            dv_run.copy_(dv)
        if ordered:   # one axis: key blocks right to left, the (batch, KV head) pairs fastest
            def grid(m):
                return (_launch.cdiv(Sk, m["BLOCK_N"]) * B * Hkv, 1, 1)
        else:
            def grid(m):
                return (_launch.cdiv(Sk, m["BLOCK_N"]), B, Hkv)
        dkdv[grid](
            q, k, v, mask, seg_id, seg_lo, seg_hi, dout, lse2, delta, dk, dv_run, dq_acc, sem,
            *q.stride(), *k.stride(), *v.stride(), stride_mb, stride_ms, *dout.stride(),
            *dk.stride(), *dq_acc.stride(), Hq, Hkv, B * Hkv, Sq, Sk, row_pitch, q_off, group,
            qk_scale,
            float(scale), before, after, cap_in, cap_out, *buckets, **dkdv_meta)
        _tuning.note_launch("dkdv", dkdv)
        if dv_run is not dv:
            dv.copy_(dv_run)

        if atomic:
            if dq_acc is not dq:
                dq.copy_(dq_acc)  # the convert pass: fp32 sums to q's dtype, same layout
        else:
            kernel, meta = _launcher("dq", *spec, False, False, capped,
                                     *_bwd_choice("dq", q.device, q.dtype, D, causal,
                                                  *buckets[::-1], False, False, capped))
            kernel[lambda m: (_launch.cdiv(Sq, m["BLOCK_M"]), B, Hq)](
                q, k, v, mask, seg_id, seg_lo, seg_hi, dout, lse2, delta, dq,
                *q.stride(), *k.stride(), *v.stride(), stride_mb, stride_ms, *dout.stride(),
                *dq.stride(), Hq, Sq, Sk, row_pitch, q_off, group, qk_scale, float(scale), before, after,
                cap_in, cap_out, *buckets, **meta)
            _tuning.note_launch("dq", kernel)
    return dq, ret_dk, ret_dv
