"""Triton kernels for the SwiGLU feed-forward block of LLaMA-style models, with optional
LoRA adapters on its three projections.

    gate = x Wg^T + bg + s_g (x Ag^T) Bg^T,   up = x Wu^T + bu + s_u (x Au^T) Bu^T
    y = h Wd^T + bd + s_d (h Ad^T) Bd^T,      h = silu(gate) * up
    (activation="gelu_tanh": h = gelu(gate, approximate="tanh") * up, Gemma's GeGLU)

Shapes (tokens flattened): x ``(T, H)``; w_gate, w_up ``(I, H)`` and w_down ``(H, I)`` in
``nn.Linear`` layout; b_gate, b_up ``(I,)``; b_down ``(H,)``; y ``(T, H)``; adapters
A ``(r, in)``, B ``(out, r)`` (PEFT's lora_A / lora_B weights), any of fp16 / bf16 / fp32.

Kernels (Triton only; the autograd wiring lives in ``ckpt_ext``):

* ``_swiglu_fwd_kernel`` computes ``h = silu(gate) * up`` for one ``(BLOCK_M, BLOCK_N)`` tile
  of ``(T, I)`` with two fp32 accumulators sharing the loads of x, so the pre-activations
  gate and up are never written, unless ``STORE_GATE_UP`` asks for them (``save="gate_up"``).
  The gate/up adapters enter the tile as a rank-r dot from the precomputed fp32 ``x A^T``
  ``(T, r)``; the down adapter's ``h Ad^T`` ``(T, r)`` is accumulated tile by tile (fp32
  atomic adds), so no extra ``(T, I)`` tensor exists for the adapters.
* ``_swiglu_bwd_recompute_kernel`` either recomputes gate and up tile by tile from x exactly
  as the forward did (``RECOMPUTE``, ``save="input"``) or reads the saved ones
  (``save="gate_up"``) and, given ``dh = dy Wd``, writes ``dgate`` (over dh), ``dup`` and,
  when the down weight's gradient is wanted, ``h``. The down adapter's term of dh is added
  in the tile, and its rank-r gradient pieces (``(dy Bd)^T h``, ``h Ad^T``) are accumulated
  in fp32 from the unrounded tiles (h is not written for a frozen down weight). The gate/up
  adapters' pieces (``dgate Bg``, ``dgate^T (x Ag^T)``, likewise for up) are rank-r products
  of the written dgate / dup, outside the kernel: in the tile they took the registers that
  larger tiles need.

The launchers ``swiglu_fwd`` and ``swiglu_bwd`` own validation, shapes, strides, grids and
autotuning; the dense products with w_down, the weight gradients and the remaining rank-r
products are torch matmuls, and a weight gradient that is not wanted is not computed.
All pointwise math is fp32:  s = sigmoid(g),  silu(g) = g s,
silu'(g) = s (1 + g (1 - s)),  dgate = dh * up * silu'(gate),  dup = dh * silu(gate); the
activation is the constexpr ACTIVATION, and gelu_tanh takes the same form:
s = sigmoid(2c (g + 0.044715 g^3)) with c = sqrt(2/pi), gelu(g) = g s,
gelu'(g) = s + gelu(g) (1 - s) 2c (1 + 3 * 0.044715 g^2).

Launch policy (``kernels/_launch.py``, shared by all kernels): under Triton's interpreter
(``TRITON_INTERPRET=1``) the kernels run on CPU tensors with one fixed block configuration; on
a GPU they autotune over the candidates (``candidate_configs``) whose compiled kernel fits
the device (no register spills, shared memory within the budget: ``_launch.Pruned``), or with
``CKPT_EXT_AUTOTUNE=0`` launch the first of them untimed. Launchers are cached per (device, dtype, fp32 dot precision, flags, adapter ranks).
"""
import torch
import triton
import triton.language as tl

from .. import config as _config
from . import _launch
from .._checks import (LORA_SUM_NAMES, _check_dropout_streams, _check_row_offset,
                       _check_swiglu_bwd, _check_swiglu_fwd)
from .dropout import dropout_key, dropout_threshold, keep_mask
from .dropout import lora_dropout as _lora_dropout
from .dropout import lora_dropout_pair as _lora_dropout_pair


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_coords(pid, T, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Map the 1-D tile id pid to a (token tile, intermediate tile) pair, GROUP_M token tiles
    at a time, so neighbouring tiles (run at the same time) reuse the same weight tiles from
    L2."""
    num_m = tl.cdiv(T, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gate_up_tile(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, offs_m, offs_n, T, H, I,
                  stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                  HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, DOT_IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """gate, up: fp32 ``(BLOCK_M, BLOCK_N)`` tiles of x Wg^T + bg and x Wu^T + bu for the
    token rows ``offs_m`` and intermediate columns ``offs_n`` (masked past T and I; the
    reduction over H is masked past H)."""
    mask_m = offs_m < T
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row offsets: T * H and I * H may pass 2**31 elements at LLaMA sizes.
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xh
    wg_ptrs = wg_ptr + offs_n.to(tl.int64)[None, :] * stride_wgi + offs_k[:, None] * stride_wgh
    wu_ptrs = wu_ptr + offs_n.to(tl.int64)[None, :] * stride_wui + offs_k[:, None] * stride_wuh
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k < H - k * BLOCK_K
        xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wgt = tl.load(wg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        wut = tl.load(wu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_IEEE:
            acc_g = tl.dot(xt, wgt, acc_g, input_precision="ieee")
            acc_u = tl.dot(xt, wut, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(xt, wgt, acc_g)
            acc_u = tl.dot(xt, wut, acc_u)
        x_ptrs += BLOCK_K * stride_xh
        wg_ptrs += BLOCK_K * stride_wgh
        wu_ptrs += BLOCK_K * stride_wuh
    if HAS_BG:
        acc_g += tl.load(bg_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BU:
        acc_u += tl.load(bu_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return acc_g, acc_u


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _lora_tile(acc, xa_ptr, lb_ptr, scale, offs_m, offs_n, T, I, r,
               R: tl.constexpr, PREC: tl.constexpr):
    """acc + scale * xa[offs_m, :r] B[offs_n, :r]^T: the low-rank term of gate or up for one
    tile, from the precomputed fp32 xa = x A^T (T, r) and B (I, r) (any float dtype, widened
    to fp32 as it is loaded), both contiguous.
    R (a power of two >= 16) pads the rank; the padding is masked to zero."""
    offs_r = tl.arange(0, R)
    mask_r = offs_r < r
    xa = tl.load(xa_ptr + offs_m.to(tl.int64)[:, None] * r + offs_r[None, :],
                 mask=(offs_m < T)[:, None] & mask_r[None, :], other=0.0)
    bt = tl.load(lb_ptr + offs_n.to(tl.int64)[None, :] * r + offs_r[:, None],
                 mask=mask_r[:, None] & (offs_n < I)[None, :], other=0.0).to(tl.float32)
    return acc + scale * tl.dot(xa, bt, input_precision=PREC)


@triton.jit
def _lora_down_accumulate(h, la_ptr, ha_ptr, offs_m, offs_n, T, I, r,
                          R: tl.constexpr, PREC: tl.constexpr):
    """ha[offs_m, :r] += h A[:r, offs_n]^T: this tile's share of act A_down^T (T, r), added
    atomically into the fp32 ha (each row sums the tiles of all intermediate columns).
    h: fp32 (BLOCK_M, BLOCK_N), zero in the columns past I; A_down (r, I) contiguous, any
    float dtype (widened to fp32 as it is loaded)."""
    offs_r = tl.arange(0, R)
    mask_r = offs_r < r
    at = tl.load(la_ptr + offs_r.to(tl.int64)[None, :] * I + offs_n[:, None],
                 mask=(offs_n < I)[:, None] & mask_r[None, :],
                 other=0.0).to(tl.float32)                                      # (BLOCK_N, R)
    part = tl.dot(h, at, input_precision=PREC)                                 # (BLOCK_M, R)
    tl.atomic_add(ha_ptr + offs_m.to(tl.int64)[:, None] * r + offs_r[None, :], part,
                  mask=(offs_m < T)[:, None] & mask_r[None, :])


@triton.jit
def _dropped(t, key, thr, inv, row0, offs_m, offs_n, DROP: tl.constexpr):
    """t (fp32 (BLOCK_M, BLOCK_N), rows offs_m, columns offs_n) with LoRA dropout applied:
    the mask of kernels/dropout.py for (key, thr) on the global rows row0 + offs_m, kept
    entries scaled by inv. Identity without DROP."""
    if DROP:
        keep = keep_mask(key, thr, (offs_m + row0)[:, None], offs_n[None, :])
        t = tl.where(keep, t * inv, 0.0)
    return t


@triton.jit
def _pre_activations(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, xag_ptr, lbg_ptr, xau_ptr, lbu_ptr,
                     s_g, s_u, r_g, r_u, offs_m, offs_n, T, H, I,
                     stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                     HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, DOT_IEEE: tl.constexpr,
                     LORA_G: tl.constexpr, LORA_U: tl.constexpr, R_G: tl.constexpr,
                     R_U: tl.constexpr, LORA_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """gate, up fp32 tiles with their biases and low-rank terms (forward and recompute)."""
    g, u = _gate_up_tile(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, offs_m, offs_n, T, H, I,
                         stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                         HAS_BG, HAS_BU, DOT_IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    if LORA_G:
        g = _lora_tile(g, xag_ptr, lbg_ptr, s_g, offs_m, offs_n, T, I, r_g, R_G, LORA_PREC)
    if LORA_U:
        u = _lora_tile(u, xau_ptr, lbu_ptr, s_u, offs_m, offs_n, T, I, r_u, R_U, LORA_PREC)
    return g, u


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd_tile(tile, x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, gate_ptr, up_ptr,
                     xag_ptr, lbg_ptr, xau_ptr, lbu_ptr, lad_ptr, ha_ptr, s_g, s_u, r_g, r_u, r_d,
                     key_d, thr_d, inv_d, row0_d, T, H, I, T_BUCKET, stride_xt, stride_xh,
                     stride_wgi, stride_wgh, stride_wui, stride_wuh, stride_ot, stride_oi,
                     HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, STORE_GATE_UP: tl.constexpr,
                     DOT_IEEE: tl.constexpr, LORA_G: tl.constexpr, LORA_U: tl.constexpr,
                     LORA_D: tl.constexpr, R_G: tl.constexpr, R_U: tl.constexpr,
                     R_D: tl.constexpr, LORA_PREC: tl.constexpr, DROP_D: tl.constexpr,
                     ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Forward of tile ``tile`` (grouped order, see _tile_coords); the arguments are
    the kernel's."""
    pid_m, pid_n = _tile_coords(tile, T, I, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g, u = _pre_activations(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, xag_ptr, lbg_ptr,
                            xau_ptr, lbu_ptr, s_g, s_u, r_g, r_u, offs_m, offs_n, T, H, I,
                            stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui,
                            stride_wuh, HAS_BG, HAS_BU, DOT_IEEE, LORA_G, LORA_U, R_G, R_U,
                            LORA_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    out_dtype = h_ptr.dtype.element_ty
    mask = (offs_m < T)[:, None] & (offs_n < I)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :] * stride_oi
    if STORE_GATE_UP:
        g_lo = g.to(out_dtype)
        u_lo = u.to(out_dtype)
        tl.store(gate_ptr + out_offs, g_lo, mask=mask)
        tl.store(up_ptr + out_offs, u_lo, mask=mask)
        g = g_lo.to(tl.float32)
        u = u_lo.to(tl.float32)
    h = (g * _act_sigmoid(g, ACTIVATION) * u).to(out_dtype)
    tl.store(h_ptr + out_offs, h, mask=mask)
    if LORA_D:  # from the rounded h, the act the down projection reads
        hd = _dropped(h.to(tl.float32), key_d, thr_d, inv_d, row0_d, offs_m, offs_n, DROP_D)
        _lora_down_accumulate(hd, lad_ptr, ha_ptr, offs_m, offs_n, T, I, r_d, R_D, LORA_PREC)


@triton.jit(do_not_specialize=["key_d", "thr_d", "row0_d"])
def _swiglu_fwd_kernel(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, gate_ptr, up_ptr, xag_ptr,
                       lbg_ptr, xau_ptr, lbu_ptr, lad_ptr, ha_ptr, s_g, s_u, r_g, r_u, r_d, key_d,
                       thr_d, inv_d, row0_d, T, H, I, T_BUCKET, stride_xt, stride_xh, stride_wgi,
                       stride_wgh, stride_wui, stride_wuh, stride_ot, stride_oi,
                       HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, STORE_GATE_UP: tl.constexpr,
                       DOT_IEEE: tl.constexpr, LORA_G: tl.constexpr, LORA_U: tl.constexpr,
                       LORA_D: tl.constexpr, R_G: tl.constexpr, R_U: tl.constexpr,
                       R_D: tl.constexpr, LORA_PREC: tl.constexpr, DROP_D: tl.constexpr,
                       ACTIVATION: tl.constexpr, PERSISTENT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    """h (T, I) = act(gate) * up in (BLOCK_M, BLOCK_N) tiles, one per program or, with
    PERSISTENT, looping over tiles (_swiglu_fwd_tile does one). act: ACTIVATION ("silu" or
    "gelu_tanh", see _act_sigmoid).

    x (T, H), w_gate / w_up (I, H), biases (I,); h, gate, up share the strides
    (stride_ot, stride_oi). LORA_G / LORA_U add s (x A^T) B^T to gate / up inside the tile
    from the fp32 xa (T, r) and B (I, r); LORA_D accumulates h' A_down^T into the fp32 ha
    (T, r_d), zero on entry, where h' is h with the adapter's dropout (DROP_D: the mask of
    (key_d, thr_d), scale inv_d) or h itself. gate and up (pre-activations, biases and
    low-rank terms included) are written only when STORE_GATE_UP; h is then computed from
    their rounded values so that the backward, which reads them, sees the same h. T_BUCKET only keys the autotuner.
    """
    if PERSISTENT:
        # Fewer programs than tiles (CKPT_EXT_SWIGLU_GRID=persistent): each program loops
        # over every num_programs-th tile, so the tiles running at once stay neighbours in
        # the grouped order.
        num_tiles = tl.cdiv(T, BLOCK_M) * tl.cdiv(I, BLOCK_N)
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _swiglu_fwd_tile(tile, x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, gate_ptr, up_ptr,
                             xag_ptr, lbg_ptr, xau_ptr, lbu_ptr, lad_ptr, ha_ptr, s_g, s_u, r_g,
                             r_u, r_d, key_d, thr_d, inv_d, row0_d, T, H, I, T_BUCKET, stride_xt,
                             stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh, stride_ot,
                             stride_oi, HAS_BG, HAS_BU, STORE_GATE_UP, DOT_IEEE, LORA_G, LORA_U,
                             LORA_D, R_G, R_U, R_D, LORA_PREC, DROP_D, ACTIVATION, BLOCK_M,
                             BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _swiglu_fwd_tile(tl.program_id(0), x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, gate_ptr,
                         up_ptr, xag_ptr, lbg_ptr, xau_ptr, lbu_ptr, lad_ptr, ha_ptr, s_g, s_u,
                         r_g, r_u, r_d, key_d, thr_d, inv_d, row0_d, T, H, I, T_BUCKET, stride_xt,
                         stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh, stride_ot,
                         stride_oi, HAS_BG, HAS_BU, STORE_GATE_UP, DOT_IEEE, LORA_G, LORA_U,
                         LORA_D, R_G, R_U, R_D, LORA_PREC, DROP_D, ACTIVATION, BLOCK_M,
                         BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _act_sigmoid(g, ACTIVATION: tl.constexpr):
    """s with act(g) = g s (fp32): sigmoid(g) for "silu"; for "gelu_tanh"
    sigmoid(2c (g + 0.044715 g^3)), c = sqrt(2/pi), which is (1 + tanh(c (g + 0.044715 g^3))) / 2,
    so g s = gelu(g, approximate="tanh") (without the cancellation of 1 + tanh for g < 0)."""
    if ACTIVATION == "gelu_tanh":
        return tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        return tl.sigmoid(g)


@triton.jit
def _halves(t, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """(left, right): the column halves of the (ROWS, WIDTH) tile t."""
    return tl.split(tl.permute(tl.reshape(t, (ROWS, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _bwd_epilogue(g, u, offs_m, offs_n, dh_ptr, dgate_ptr, dup_ptr, h_ptr, lad_ptr, dyb_ptr,
                  dlad_ptr, ha_ptr, s_d, r_d, key_d, thr_d, inv_d, row0_d, T, I, stride_dht,
                  stride_dhi, stride_ot, stride_oi, STORE_H: tl.constexpr,
                  LORA_D: tl.constexpr, NEED_DAD: tl.constexpr, NEED_HA: tl.constexpr,
                  R_D: tl.constexpr, LORA_PREC: tl.constexpr, DROP_D: tl.constexpr,
                  ACTIVATION: tl.constexpr):
    """The backward's pointwise epilogue on one (rows offs_m, columns offs_n) piece of a tile,
    given its fp32 gate and up: h (when wanted), dup, dgate and the down adapter's pieces.
    Ordered to keep few fp32 values of the piece live at once: h first, then dh is read and
    dup, dgate follow. With act(g) = g s (_act_sigmoid): silu'(g) = s (1 + g (1 - s)) =
    s + silu (1 - s); gelu_tanh'(g) = s + gelu (1 - s) 2c (1 + 3 * 0.044715 g^2)."""
    mask = (offs_m < T)[:, None] & (offs_n < I)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    out_dtype = dup_ptr.dtype.element_ty
    out_offs = rows * stride_ot + offs_n[None, :] * stride_oi
    s = _act_sigmoid(g, ACTIVATION)
    act = g * s
    # u_dact = u act'(g) = d h / d gate. gelu_tanh's needs g: formed here, so that g is not
    # live across the h block (the LoRA backward's registers), silu's after it.
    if ACTIVATION == "gelu_tanh":
        # 2c (1 + 3 * 0.044715 g^2) = 1.5957691216057308 + 0.21406444881780076 g^2
        u_dact = u * (s + act * (1.0 - s) * (1.5957691216057308 + 0.21406444881780076 * g * g))
    if STORE_H or NEED_DAD or NEED_HA:
        h = (act * u).to(out_dtype)
        if STORE_H:
            tl.store(h_ptr + out_offs, h, mask=mask)
        hd = _dropped(h.to(tl.float32), key_d, thr_d, inv_d, row0_d, offs_m, offs_n, DROP_D)
        if NEED_HA:
            _lora_down_accumulate(hd, lad_ptr, ha_ptr, offs_m, offs_n, T, I, r_d, R_D,
                                  LORA_PREC)
    if ACTIVATION != "gelu_tanh":
        u_dact = u * (s + act * (1.0 - s))
    dh = tl.load(dh_ptr + rows * stride_dht + offs_n[None, :] * stride_dhi,
                 mask=mask, other=0.0).to(tl.float32)
    if LORA_D:
        offs_r = tl.arange(0, R_D)
        mask_r = offs_r < r_d
        dyb = tl.load(dyb_ptr + rows * r_d + offs_r[None, :],
                      mask=(offs_m < T)[:, None] & mask_r[None, :], other=0.0)  # (rows, R_D)
        if NEED_DAD:
            # dAd_acc[:, piece] += dyb^T h'; rows past T have dyb = 0.
            part = tl.dot(tl.trans(dyb), hd, input_precision=LORA_PREC)      # (R_D, columns)
            tl.atomic_add(dlad_ptr + offs_r.to(tl.int64)[:, None] * I + offs_n[None, :], part,
                          mask=mask_r[:, None] & (offs_n < I)[None, :])
        ad = tl.load(lad_ptr + offs_r.to(tl.int64)[:, None] * I + offs_n[None, :],
                     mask=mask_r[:, None] & (offs_n < I)[None, :],
                     other=0.0).to(tl.float32)                                  # (R_D, columns)
        dh += _dropped(s_d * tl.dot(dyb, ad, input_precision=LORA_PREC), key_d, thr_d, inv_d,
                       row0_d, offs_m, offs_n, DROP_D)
    dup = dh * act
    tl.store(dup_ptr + out_offs, dup.to(out_dtype), mask=mask)
    dgate = dh * u_dact
    tl.store(dgate_ptr + out_offs, dgate.to(out_dtype), mask=mask)


@triton.jit
def _swiglu_bwd_recompute_tile(tile, x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, dh_ptr, dgate_ptr,
                               dup_ptr, h_ptr, gate_ptr, up_ptr, xag_ptr, lbg_ptr, xau_ptr,
                               lbu_ptr, lad_ptr, dyb_ptr, dlad_ptr, ha_ptr, s_g, s_u, s_d, r_g,
                               r_u, r_d, key_d, thr_d, inv_d, row0_d, T, H, I, T_BUCKET, stride_xt,
                               stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                               stride_dht, stride_dhi, stride_ot, stride_oi,
                               HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
                               DOT_IEEE: tl.constexpr, RECOMPUTE: tl.constexpr,
                               STORE_H: tl.constexpr, LORA_G: tl.constexpr, LORA_U: tl.constexpr,
                               LORA_D: tl.constexpr, NEED_DAD: tl.constexpr,
                               NEED_HA: tl.constexpr, R_G: tl.constexpr, R_U: tl.constexpr,
                               R_D: tl.constexpr, LORA_PREC: tl.constexpr, DROP_D: tl.constexpr,
                               ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr, EPI_N: tl.constexpr):
    """Backward of tile ``tile`` (grouped order, see _tile_coords); the arguments are
    the kernel's. The epilogue runs on EPI_N-column pieces of the tile (BLOCK_N, BLOCK_N / 2
    or BLOCK_N / 4)."""
    pid_m, pid_n = _tile_coords(tile, T, I, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    if RECOMPUTE:
        g, u = _pre_activations(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, xag_ptr, lbg_ptr,
                                xau_ptr, lbu_ptr, s_g, s_u, r_g, r_u, offs_m,
                                n0 + tl.arange(0, BLOCK_N), T, H, I, stride_xt, stride_xh,
                                stride_wgi, stride_wgh, stride_wui, stride_wuh, HAS_BG, HAS_BU,
                                DOT_IEEE, LORA_G, LORA_U, R_G, R_U, LORA_PREC, BLOCK_M,
                                BLOCK_N, BLOCK_K)
        # Subtiled epilogue: the accumulators are split into column pieces (halves, or
        # quarters) and the epilogue's fp32 temporaries exist for one piece at a time.
        if EPI_N == BLOCK_N:
            g_pieces = (g,)
            u_pieces = (u,)
        elif EPI_N * 2 == BLOCK_N:
            g_pieces = _halves(g, BLOCK_M, BLOCK_N)
            u_pieces = _halves(u, BLOCK_M, BLOCK_N)
        else:
            g_l, g_r = _halves(g, BLOCK_M, BLOCK_N)
            u_l, u_r = _halves(u, BLOCK_M, BLOCK_N)
            g_a, g_b = _halves(g_l, BLOCK_M, BLOCK_N // 2)
            g_c, g_d = _halves(g_r, BLOCK_M, BLOCK_N // 2)
            u_a, u_b = _halves(u_l, BLOCK_M, BLOCK_N // 2)
            u_c, u_d = _halves(u_r, BLOCK_M, BLOCK_N // 2)
            g_pieces = (g_a, g_b, g_c, g_d)
            u_pieces = (u_a, u_b, u_c, u_d)
    for j in tl.static_range(BLOCK_N // EPI_N):
        offs_n = n0 + j * EPI_N + tl.arange(0, EPI_N)
        if RECOMPUTE:
            g_j = g_pieces[j]
            u_j = u_pieces[j]
        else:
            # save="gate_up": each piece reads its own columns of the saved gate and up.
            mask = (offs_m < T)[:, None] & (offs_n < I)[None, :]
            offs = offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :] * stride_oi
            g_j = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            u_j = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _bwd_epilogue(g_j, u_j, offs_m, offs_n, dh_ptr, dgate_ptr, dup_ptr, h_ptr, lad_ptr,
                      dyb_ptr, dlad_ptr, ha_ptr, s_d, r_d, key_d, thr_d, inv_d, row0_d, T, I,
                      stride_dht, stride_dhi, stride_ot, stride_oi, STORE_H, LORA_D, NEED_DAD,
                      NEED_HA, R_D, LORA_PREC, DROP_D, ACTIVATION)


@triton.jit(do_not_specialize=["key_d", "thr_d", "row0_d"])
def _swiglu_bwd_recompute_kernel(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, dh_ptr, dgate_ptr,
                                 dup_ptr, h_ptr, gate_ptr, up_ptr, xag_ptr, lbg_ptr, xau_ptr,
                                 lbu_ptr, lad_ptr, dyb_ptr, dlad_ptr, ha_ptr, s_g, s_u, s_d,
                                 r_g, r_u, r_d, key_d, thr_d, inv_d, row0_d, T, H, I, T_BUCKET,
                                 stride_xt, stride_xh,
                                 stride_wgi, stride_wgh, stride_wui, stride_wuh, stride_dht,
                                 stride_dhi, stride_ot, stride_oi, HAS_BG: tl.constexpr,
                                 HAS_BU: tl.constexpr, DOT_IEEE: tl.constexpr,
                                 RECOMPUTE: tl.constexpr, STORE_H: tl.constexpr,
                                 LORA_G: tl.constexpr, LORA_U: tl.constexpr, LORA_D: tl.constexpr,
                                 NEED_DAD: tl.constexpr, NEED_HA: tl.constexpr, R_G: tl.constexpr,
                                 R_U: tl.constexpr, R_D: tl.constexpr, LORA_PREC: tl.constexpr,
                                 DROP_D: tl.constexpr, ACTIVATION: tl.constexpr,
                                 PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, EPI_N: tl.constexpr):
    """Backward in (BLOCK_M, BLOCK_N) tiles (one per program or, with PERSISTENT, looping over
    tiles; _swiglu_bwd_recompute_tile does one): dh = dy Wd (T, I) -> dgate, dup (and h when
    STORE_H), with the strides (stride_ot, stride_oi).

    act (ACTIVATION) and its derivative are recomputed in the epilogue (_bwd_epilogue).
    RECOMPUTE (save="input"): gate/up are recomputed from x exactly as the forward did;
    otherwise (save="gate_up") they are read from gate/up (contiguous, the output strides).
    dgate may alias dh: each program reads its dh tile before it writes the same tile.
    LoRA: LORA_G / LORA_U add the low-rank terms to the recomputed gate / up (as the forward);
    their gradient pieces are rank-r products of the written dgate / dup, left to the launcher
    (accumulating them here cost the tile its registers: AOT, 64x32 tiles at most). LORA_D
    (fp32 buffers, accumulated atomically, zero on entry; the scale is applied by the
    launcher except inside dh): dh += s_d (dy Bd)[tile] Ad[:, tile] from dyb = dy Bd (T, r_d);
    NEED_DAD: dAd_acc (r_d, I) += dyb^T h'; NEED_HA: ha (T, r_d) += h' Ad^T (for dBd); with
    DROP_D, h' and the dh term carry the forward's dropout mask (as in the forward).
    """
    if PERSISTENT:
        # Fewer programs than tiles (CKPT_EXT_SWIGLU_GRID=persistent): each program loops
        # over every num_programs-th tile, so the tiles running at once stay neighbours in
        # the grouped order.
        num_tiles = tl.cdiv(T, BLOCK_M) * tl.cdiv(I, BLOCK_N)
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _swiglu_bwd_recompute_tile(tile, x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, dh_ptr,
                                       dgate_ptr, dup_ptr, h_ptr, gate_ptr, up_ptr, xag_ptr,
                                       lbg_ptr, xau_ptr, lbu_ptr, lad_ptr, dyb_ptr, dlad_ptr,
                                       ha_ptr, s_g, s_u, s_d, r_g, r_u, r_d, key_d, thr_d, inv_d, row0_d,
                                       T, H, I, T_BUCKET,
                                       stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui,
                                       stride_wuh, stride_dht, stride_dhi, stride_ot, stride_oi,
                                       HAS_BG, HAS_BU, DOT_IEEE, RECOMPUTE, STORE_H, LORA_G,
                                       LORA_U, LORA_D, NEED_DAD, NEED_HA, R_G,
                                       R_U, R_D, LORA_PREC, DROP_D, ACTIVATION, BLOCK_M, BLOCK_N,
                                       BLOCK_K, GROUP_M, EPI_N)
    else:
        _swiglu_bwd_recompute_tile(tl.program_id(0), x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr,
                                   dh_ptr, dgate_ptr, dup_ptr, h_ptr, gate_ptr, up_ptr, xag_ptr,
                                   lbg_ptr, xau_ptr, lbu_ptr, lad_ptr, dyb_ptr, dlad_ptr, ha_ptr,
                                   s_g, s_u, s_d, r_g, r_u, r_d, key_d, thr_d, inv_d, row0_d, T, H, I,
                                   T_BUCKET,
                                   stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui,
                                   stride_wuh, stride_dht, stride_dhi, stride_ot, stride_oi,
                                   HAS_BG, HAS_BU, DOT_IEEE, RECOMPUTE, STORE_H, LORA_G, LORA_U,
                                   LORA_D, NEED_DAD, NEED_HA, R_G, R_U, R_D,
                                   LORA_PREC, DROP_D, ACTIVATION, BLOCK_M, BLOCK_N, BLOCK_K,
                                   GROUP_M, EPI_N)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, warps, stages, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_warps=warps, num_stages=stages)


# Candidates, in order of preference; on a GPU the launcher compiles them for the kernel
# variant at hand and keeps those that neither spill registers nor exceed the device's shared
# memory (_launch.Pruned), and the first kept one is what CKPT_EXT_AUTOTUNE=0 launches. The
# fused tiles keep two fp32 accumulators: a 128x64 tile loads as many bytes per FLOP as a
# 128x128 plain GEMM tile, a 128x128 tile holds the registers of a 128x256 one. The last two
# serve the LoRA backward, whose epilogue is the heaviest. A backward candidate is tried with
# each epilogue piece width, widest first (candidate_configs).
_CANDIDATES = [
    _cfg(128, 128, 64, 8, 3), _cfg(128, 128, 64, 8, 4), _cfg(256, 64, 64, 8, 3),
    _cfg(128, 64, 64, 4, 4), _cfg(128, 64, 64, 8, 4), _cfg(64, 128, 64, 8, 4),
    _cfg(128, 128, 32, 8, 4), _cfg(128, 64, 32, 8, 4), _cfg(64, 64, 64, 4, 4),
    _cfg(32, 64, 128, 4, 3), _cfg(64, 32, 64, 8, 3), _cfg(32, 32, 64, 4, 3),
]
# Interpreter: one config whose blocks do not divide the test shapes (T 129, H 96, I 172), so
# every masked tail is exercised; the backward's epilogue runs on quarter tiles (both levels of
# the split) unless CKPT_EXT_SWIGLU_EPILOGUE=whole. Tests may change these.
_INTERPRET_META = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4}
_INTERPRET_EPI_N = {"subtiled": 16, "whole": 64}
_TUNE_KEY = ["T_BUCKET", "H", "I"]
_KINDS = ("fwd", "bwd")
_EPI_MIN = 16        # narrowest epilogue piece (tl.dot needs 16 columns for the LoRA products)


def _interpret_meta(kind):
    """The interpreter's fixed meta-parameters of a kernel ("fwd" or "bwd")."""
    if kind == "fwd":
        return dict(_INTERPRET_META)
    return dict(_INTERPRET_META, EPI_N=_INTERPRET_EPI_N[_config.current().swiglu_epilogue])


def _epilogue_widths(kind, config, epilogue):
    """The backward's epilogue piece widths to try for a config, widest first: the whole
    tile, then (subtiled) its halves and quarters down to _EPI_MIN columns; (None,) for the
    forward."""
    if kind == "fwd":
        return (None,)
    bn = config.kwargs["BLOCK_N"]
    if epilogue == "whole":
        return (bn,)
    return tuple(w for w in (bn, bn // 2, bn // 4) if w >= min(_EPI_MIN, bn))


def candidate_configs(kind, epilogue=None):
    """Every launch candidate of a SwiGLU kernel, in the order they are tried: kind "fwd"
    (``_swiglu_fwd_kernel``) or "bwd" (``_swiglu_bwd_recompute_kernel``, the recompute and
    the save="gate_up" variants); a backward candidate once per epilogue piece width
    (``EPI_N``), widest first: the whole tile, then (epilogue "subtiled", the default of the
    ``swiglu_epilogue`` setting) its halves and quarters."""
    if kind not in _KINDS:
        raise ValueError(f"candidate_configs: kind must be one of {_KINDS}, got {kind!r}")
    epilogue = _config.current().swiglu_epilogue if epilogue is None else epilogue
    if epilogue not in ("subtiled", "whole"):
        raise ValueError(f"candidate_configs: epilogue must be 'subtiled' or 'whole', got "
                         f"{epilogue!r}")
    if kind == "fwd":
        return list(_CANDIDATES)
    return [triton.Config({**c.kwargs, "EPI_N": w}, num_warps=c.num_warps,
                          num_stages=c.num_stages)
            for c in _CANDIDATES for w in _epilogue_widths(kind, c, epilogue)]


def tile_of(config):
    """A candidate's tile and pipeline, without its epilogue piece width: the launcher keeps
    the widest piece that fits of each (``_launch.prune``'s group)."""
    return (tuple(sorted((k, v) for k, v in config.kwargs.items() if k != "EPI_N")),
            config.num_warps, config.num_stages)


def _kernel_for(kind, device, dtype, precision, lora_pads):
    """The launcher of one kernel for a device, dtype and adapters (rank pads or None)."""
    configs, budget = [], None
    if not _launch.INTERPRET:
        configs = candidate_configs(kind)
        budget = _launch.device_info(device).smem_budget
    if kind == "fwd":
        # ha is accumulated atomically: tuning runs must start it from zero.
        return _launch.select(_swiglu_fwd_kernel, configs, smem_budget=budget,
                              interpret_meta=lambda: _interpret_meta("fwd"),
                              key=_TUNE_KEY, reset_to_zero=["ha_ptr"])
    # dgate is written over dh in place, so tuning runs must restore dh between trials; the
    # LoRA accumulators start from zero.
    return _launch.select(_swiglu_bwd_recompute_kernel, configs, smem_budget=budget,
                          group=tile_of, interpret_meta=lambda: _interpret_meta("bwd"),
                          key=_TUNE_KEY,
                          restore_value=["dh_ptr"],
                          reset_to_zero=["dlad_ptr", "ha_ptr"])


@_launch.cached
def _fwd_launcher(device, dtype, precision, has_bg, has_bu, store_gate_up, lora_pads,
                  drop_d=False, lora_precision="tf32", activation="silu"):
    """(kernel, constexpr arguments) of the forward for one specialization; lora_pads: None
    or the rank pads (R_G, R_U, R_D), 0 for a projection without adapter; drop_d: the down
    adapter's input dropout; lora_precision: the adapters' dots (``_lora_precision``);
    activation: "silu" or "gelu_tanh"."""
    ieee = precision == "ieee"
    meta = dict(HAS_BG=has_bg, HAS_BU=has_bu, STORE_GATE_UP=store_gate_up, DOT_IEEE=ieee,
                DROP_D=drop_d, ACTIVATION=activation,
                PERSISTENT=_config.current().swiglu_grid == "persistent",
                **_lora_meta(lora_pads, lora_precision))
    return _kernel_for("fwd", device, dtype, precision, lora_pads), meta


@_launch.cached
def _bwd_launcher(device, dtype, precision, has_bg, has_bu, recompute, store_h, needs,
                  lora_pads, drop_d=False, lora_precision="tf32", activation="silu"):
    """(kernel, constexpr arguments) of the backward for one specialization; needs: the
    (NEED_DAD, NEED_HA) flags."""
    ieee = precision == "ieee"
    meta = dict(HAS_BG=has_bg, HAS_BU=has_bu, DOT_IEEE=ieee, RECOMPUTE=recompute,
                STORE_H=store_h, NEED_DAD=needs[0], NEED_HA=needs[1], DROP_D=drop_d,
                ACTIVATION=activation,
                # The LoRA backward keeps one program per tile: its tile loop spills on sm_90
                # even at the smallest candidate tiles (AOT report).
                PERSISTENT=_config.current().swiglu_grid == "persistent" and lora_pads is None,
                **_lora_meta(lora_pads, lora_precision))
    return _kernel_for("bwd", device, dtype, precision, lora_pads), meta


def _programs(device, meta):
    """Programs of the persistent grid (a launcher whose meta has PERSISTENT) on a device: one
    per SM; three in the interpreter (so that tests run programs that loop over several
    tiles); 0 for the grid of one program per tile."""
    if not meta["PERSISTENT"]:
        return 0
    return 3 if _launch.INTERPRET else _launch.device_info(device).sm_count


def _grid(T, I, programs):
    """(tiles,) or, persistent, (min(tiles, programs),): see the kernels' tile loop."""
    def grid(meta):
        tiles = _launch.cdiv(T, meta["BLOCK_M"]) * _launch.cdiv(I, meta["BLOCK_N"])
        return (min(tiles, programs) if programs else tiles,)
    return grid


# --------------------------------------------------------------------------------------------
# Validation: the op's own checks (ckpt_ext._checks, shared with the fakes), then the Triton
# kernels' (_launch.check_operands)
# --------------------------------------------------------------------------------------------
def _absent(t):
    """A saved gate/up counts as absent when it is None or the 1-D empty placeholder that
    swiglu_fwd(..., return_gate_up=False) returns."""
    return t is None or (t.dim() == 1 and t.numel() == 0)


_LORA_NAMES = ("A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down")


def _adapters(op, x, lora, lora_scaling):
    """The three adapters (gate, up, down) of a checked ``lora`` list, each None or
    (A, B, scale), after the Triton kernels' dtype rule."""
    _launch.check_operands(op, ("x", x), *zip(_LORA_NAMES, lora))
    return [None if lora[2 * p] is None else (lora[2 * p], lora[2 * p + 1],
                                              float(lora_scaling[p])) for p in range(3)]


class _Dropout:
    """One adapter's input dropout: probability p > 0, its mask key (stream 4 | 5 | 6 or the
    op's dropout_streams) and the
    global row of the op's first row (the masks are those of the global rows)."""

    def __init__(self, p, seed, stream, row0):
        self.p, self.seed, self.stream, self.row0 = p, seed, stream, row0
        self.key = dropout_key(int(seed.item()), stream)


def _dropouts(lora_dropout, dropout_seed, ad, row0, streams=()):
    """The three adapters' dropouts (gate, up, down), each None or a _Dropout (the arguments
    were checked with the op's); streams: [] (4, 5, 6) or the op's dropout_streams."""
    streams = list(streams) or [4, 5, 6]
    return [_Dropout(float(prob), dropout_seed, streams[p], row0)
            if ad[p] is not None and prob != 0.0 else None
            for p, prob in enumerate(list(lora_dropout) or [0.0] * 3)]


def _adapter_input(t, drop):
    """An fp32 tensor t with an adapter's dropout applied (t itself without one)."""
    return t if drop is None else _lora_dropout(t, drop.seed, drop.stream, drop.p, drop.row0)


def _two_masks(drops):
    """Whether gate and up both have dropout, with masks of their own (one launch does both,
    _lora_dropout_pair)."""
    return (drops[0] is not None and drops[1] is not None and not _same_mask(drops[1], drops[0])
            and drops[0].row0 == drops[1].row0)


def _pair_args(drops):
    return (drops[0].seed, (drops[0].stream, drops[1].stream), (drops[0].p, drops[1].p),
            drops[0].row0)


def _adapter_inputs(x, adapters, drops):
    """The gate/up adapters' fp32 inputs x' (None for an absent adapter): an adapter with
    dropout reads x and writes its x' in one pass (no fp32 copy of x first: the same bits as
    dropout of x.float()), two with masks of their own both in one launch; those without
    share one fp32 copy of x, and two with the same mask one x' (the same tensor)."""
    if all(a is not None for a in adapters) and _two_masks(drops):
        return list(_lora_dropout_pair(x, None, *_pair_args(drops), out_dtype=torch.float32))
    xf, out = None, []
    for a, drop in zip(adapters, drops):
        if a is None:
            out.append(None)
        elif drop is not None and out and out[0] is not None and _same_mask(drop, drops[0]):
            out.append(out[0])   # one stream for both (a fused gate_up_proj's adapter)
        elif drop is not None:
            out.append(_lora_dropout(x, drop.seed, drop.stream, drop.p, drop.row0,
                                     out_dtype=torch.float32))
        else:
            xf = x.float() if xf is None else xf
            out.append(xf)
    return out


def _same_mask(a, b):
    """Whether two dropouts apply the same mask and scale."""
    return (b is not None and a.p == b.p and a.key == b.key and a.row0 == b.row0)


class _Factors32:
    """The adapters' factors as contiguous fp32 tensors for the torch matmuls, each converted
    once per call and only where it is read (a factor already fp32 and contiguous is itself):
    ``a32[p]`` / ``b32[p]`` for adapter p (gate, up, down), None where it is absent. The
    kernels load the factors they read in any float dtype."""

    def __init__(self, ad, a=(True, True, True), b=(True, True, True)):
        self.a32 = [_f32(t[0]) if t is not None and w else None for t, w in zip(ad, a)]
        self.b32 = [_f32(t[1]) if t is not None and w else None for t, w in zip(ad, b)]


def _scaled_mm(a, b, alpha):
    """alpha a b as one GEMM (addmm, beta 0: its output's initial contents are ignored)."""
    if alpha == 1.0:
        return torch.mm(a, b)
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.addmm(out, a, b, beta=0.0, alpha=alpha, out=out)


def _shared_input(xd):
    """Whether both gate/up adapters read the same x' (no dropout, or the same mask): then
    their rank-r products with x' are one GEMM over the two factors stacked, and so are the
    low-rank paths of dx."""
    return xd[0] is not None and xd[0] is xd[1]


def _input_products(xd, a32, wanted):
    """[x'_g A_g^T, x'_u A_u^T] (fp32 (T, r), contiguous; None where absent or not wanted),
    a32: the fp32 A_g, A_u (_Factors32): one GEMM over [A_g; A_u] when the two read the same
    x'."""
    if _shared_input(xd) and all(wanted):
        both = torch.mm(xd[0], torch.cat(a32[:2]).t())                      # (T, r_g + r_u)
        r = a32[0].shape[0]
        return [both[:, :r].contiguous(), both[:, r:].contiguous()]
    return [torch.mm(t, a.t()) if a is not None and w else None
            for t, a, w in zip(xd, a32[:2], wanted)]


def _down_dropout_args(drop):
    """(key_d, thr_d, inv_d, row0_d) and the DROP_D flag of the kernels."""
    if drop is None:
        return (0, 0, 1.0, 0), False
    return (drop.key, dropout_threshold(drop.p), 1.0 / (1.0 - drop.p), drop.row0), True


# Rows of dgate / dup widened to fp32 at a time for the adapters' rank-r products: the
# transient fp32 copy stays within 64 MiB whatever T is.
_RANK_CHUNK_BYTES = 64 << 20


def _sum_mm(total, a, b, alpha):
    """alpha a b, or total + alpha a b (a gradient's sum over the caller's token chunks,
    swiglu_bwd's lora_sums) inside the GEMM (addmm, beta 1), a new tensor either way."""
    if total is None:
        return _scaled_mm(a, b, alpha)
    return torch.addmm(total, a, b, alpha=alpha)


def _row_sum(acc, total, a, b, alpha):
    """A rank-r gradient summed over row chunks: the first chunk's alpha a b (plus total, the
    caller's sum, where given), later chunks added in place, inside the GEMMs."""
    return _sum_mm(total, a, b, alpha) if acc is None else acc.addmm_(a, b, alpha=alpha)


def _rank_products(dz, bf, xa, need_db, scale, total=None):
    """One gate/up adapter's gradient pieces from dz = dgate or dup (T, I) as written, in x's
    dtype: (dz B (T, r), scale dz^T xa (I, r) when need_db else None), both fp32 from fp32 row
    chunks of dz (bf the adapter's (I, r) lora_B weight in fp32; xa = x' A^T (T, r) fp32); the
    row chunks' sum, the scaling and the caller's sum ``total`` (None or fp32 (I, r), added)
    inside the GEMMs."""
    T, I = dz.shape
    dxa = dz.new_empty((T, bf.shape[1]), dtype=torch.float32)
    db = None
    if need_db and T == 0:
        db = total.clone() if total is not None else dz.new_zeros((I, bf.shape[1]),
                                                                   dtype=torch.float32)
    rows = max(1, _RANK_CHUNK_BYTES // (4 * max(I, 1)))
    for t0 in range(0, T, rows):
        z = dz[t0:t0 + rows].float()
        torch.mm(z, bf, out=dxa[t0:t0 + rows])
        if need_db:
            db = _row_sum(db, total, z.t(), xa[t0:t0 + rows], scale)
    return dxa, db


def _down_pieces(h, drop, af, dyb, need_da, need_ha, scale, total=None):
    """The down adapter's gradient pieces from h (T, I), the product the kernel rounded (and
    stored) in x's dtype: (scale dyb^T h' (r, I) when need_da, h' A_down^T (T, r) when
    need_ha), fp32 (else None), h' = h with the adapter's dropout (drop, None without), widened
    in fp32 row chunks of at most 64 MiB (the dropout's rows are the global ones); af: A_down
    (r, I) in fp32; the row chunks' sum, the scaling and the caller's sum ``total`` (None or
    fp32 (r, I), added to the first) inside the GEMMs."""
    T, I = h.shape
    dlad = None
    if need_da and T == 0:
        dlad = total.clone() if total is not None else h.new_zeros(af.shape,
                                                                    dtype=torch.float32)
    ha = h.new_empty((T, af.shape[0]), dtype=torch.float32) if need_ha else None
    rows = max(1, _RANK_CHUNK_BYTES // (4 * max(I, 1)))
    for t0 in range(0, T, rows):
        hc = h[t0:t0 + rows]
        z = hc.float() if drop is None else _lora_dropout(hc, drop.seed, drop.stream, drop.p,
                                                          drop.row0 + t0,
                                                          out_dtype=torch.float32)
        if need_ha:
            torch.mm(z, af.t(), out=ha[t0:t0 + rows])
        if need_da:
            dlad = _row_sum(dlad, total, dyb[t0:t0 + rows].t(), z, scale)
    return dlad, ha


def _rank_pad(r):
    """The rank padded for tl.dot: a power of two, at least 16."""
    return _launch.pow2_bucket(r, 16)


def _f32(t):
    return t.to(torch.float32).contiguous()


def _lora_pads(ad):
    """(R_G, R_U, R_D): each adapter's rank padded for tl.dot, 0 for a projection without
    one; None without adapters (a launcher-cache key)."""
    if all(a is None for a in ad):
        return None
    return tuple(_rank_pad(a[0].shape[0]) if a is not None else 0 for a in ad)


def _lora_meta(pads, lora_precision):
    """Constexpr flags and pads of the three adapters, and their dots' input precision."""
    meta = {}
    for key, pad in zip("GUD", pads or (0, 0, 0)):
        meta[f"LORA_{key}"] = pad > 0
        meta[f"R_{key}"] = pad or 16
    meta["LORA_PREC"] = lora_precision
    return meta


def _lora_precision(dtype):
    """``input_precision`` of the adapters' rank-r dots, whose operands are fp32 whatever the
    base dtype: as torch would multiply the fp32 adapters (PEFT runs them in their own dtype).
    Under torch's "highest" float32 matmul precision (its default): "ieee" for an fp32 base;
    "tf32x3" for a half-precision base (three TF32 products on the tensor cores, about fp32's
    accuracy: a single TF32 product rounds its operands to 10 bits, as fp16 does, and where
    the low-rank term is as large as the base term that doubled the output's rounding error,
    1.29x over the accuracy bound on an H100). "tf32" when the user allowed TF32."""
    if torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee" if dtype == torch.float32 else "tf32x3"


def _rank(a):
    return a[0].shape[0] if a is not None else 1


def _scale(a):
    return a[2] if a is not None else 0.0


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def swiglu_fwd(x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling,
               return_gate_up: bool, lora_dropout=(), dropout_seed=None, dropout_row_offset=0,
               dropout_streams=(), activation="silu"):
    """SwiGLU MLP forward with optional LoRA adapters.

    Args:
        x: (T, H) float16 / bfloat16 / float32, any strides.
        w_gate, w_up: (I, H); w_down: (H, I) (nn.Linear layout), dtype and device of x.
        b_gate, b_up: None or (I,); b_down: None or (H,).
        lora: [] or [A_gate, B_gate, A_up, B_up, A_down, B_down], each None or a tensor
            (A (r, in), B (out, r), float16 / bfloat16 / float32, both or neither per
            projection); lora_scaling: [] or the 3 scales (gate, up, down).
        return_gate_up: False for save="input" (gate and up are never written; returns empty
            placeholders), True for save="gate_up" (returns the pre-activations).
        lora_dropout: [] or the 3 dropout probabilities of the adapters' inputs; dropout_seed:
            a CPU integer tensor with one element, required when one is > 0. The gate/up
            adapters read ``lora_dropout(x, seed, 4 | 5, p)`` (fp32), the down adapter h with
            the same mask function applied inside the tile (stream 6).
        dropout_row_offset: x's rows are rows dropout_row_offset.. of a larger input (a token
            chunk): the masks are those of these global rows.
        dropout_streams: [] (4, 5, 6) or the 3 streams of gate, up and down (equal streams
            give one mask: a fused gate_up_proj's adapter).
        activation: "silu" (h = silu(gate) * up) or "gelu_tanh" (h = gelu(gate,
            approximate="tanh") * up, GeGLU), in fp32 inside the tile.

    Returns:
        (y, gate, up): y (T, H) in the dtype of x; gate, up (T, I) pre-activations with the
        biases and low-rank terms included when return_gate_up, else ``x.new_empty((0,))``.
        The intermediate h (T, I) is transient: freed before this returns.

    LoRA precision: xa = x A^T (T, r) is computed in fp32 outside the kernel; the kernel adds
    s xa B^T (fp32 B; the rank-r dots as ``_lora_precision`` chooses) to the fp32 gate/up
    accumulators before the activation and rounding.
    h A_down^T (T, r_d) is accumulated in fp32 inside the kernel (atomic adds over the
    intermediate tiles, so its summation order, and the last bits, may vary between runs on a
    GPU); y = (h Wd^T + bd, rounded by the dense GEMM) + s_d (h A_down^T) B_down^T in fp32,
    rounded once more (PEFT's order for an fp32 adapter on a half-precision base).
    """
    op = "swiglu_fwd"
    _check_row_offset(op, "dropout_row_offset", dropout_row_offset)
    _check_dropout_streams(op, dropout_streams)
    T, H, I, lora = _check_swiglu_fwd(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora,
                                      lora_scaling, lora_dropout, dropout_seed, activation)
    ad = _adapters(op, x, lora, lora_scaling)
    drop = _dropouts(lora_dropout, dropout_seed, ad, dropout_row_offset, dropout_streams)
    h = x.new_empty((T, I))
    # Distinct placeholders: an op's outputs must not alias each other.
    gu_shape = (T, I) if return_gate_up else (0,)
    gate, up = x.new_empty(gu_shape), x.new_empty(gu_shape)
    lg, lu, ld = ad
    fac = _Factors32(ad, a=(True, True, False), b=(False, False, True))
    dummy = _launch.placeholder(x.device)   # pointer arguments this launch never reads
    xd = _adapter_inputs(x, (lg, lu), drop[:2])                       # x' per adapter
    xag, xau = (t if t is not None else dummy                          # (T, r_g), (T, r_u)
                for t in _input_products(xd, fac.a32, (True, True)))
    del xd
    ha = x.new_zeros((T, _rank(ld)), dtype=torch.float32) if ld else dummy
    drop_d, has_drop_d = _down_dropout_args(drop[2])
    if T > 0 and I > 0:
        b_gate_c = b_gate.contiguous() if b_gate is not None else h
        b_up_c = b_up.contiguous() if b_up is not None else h
        kernel, meta = _fwd_launcher(x.device, x.dtype, _launch.dot_precision(x.dtype),
                                     b_gate is not None, b_up is not None,
                                     bool(return_gate_up), _lora_pads(ad), has_drop_d,
                                     _lora_precision(x.dtype), activation)
        with _launch.on_device(x.device):
            kernel[_grid(T, I, _programs(x.device, meta))](
                x, w_gate, w_up, b_gate_c, b_up_c, h,
                gate if return_gate_up else h, up if return_gate_up else h,
                xag, lg[1].contiguous() if lg else dummy, xau,
                lu[1].contiguous() if lu else dummy, ld[0].contiguous() if ld else dummy, ha,
                _scale(lg), _scale(lu), _rank(lg), _rank(lu), _rank(ld), *drop_d,
                T, H, I, _launch.pow2_bucket(T, 16),
                x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1),
                w_up.stride(0), w_up.stride(1), h.stride(0), h.stride(1), **meta)
    y = torch.nn.functional.linear(h, w_down, b_down)
    del h
    if ld is not None:   # fp32 term (s the GEMM's alpha), one rounding
        y.add_(_scaled_mm(ha, fac.b32[2].t(), ld[2]))
    return y, gate, up


def _weight_grad(a, b, total, beta):
    """a b (a weight's gradient, in the operands' dtype), or, given its sum over token chunks
    ``total`` (float32 or the operands' dtype), ``beta total + a b`` in total's dtype inside
    the GEMM (addmm; a float32 sum of half-precision operands through its out_dtype, which
    ATen has on CUDA only)."""
    if total is None:
        return torch.mm(a, b)
    if total.dtype == a.dtype:
        return torch.addmm(total, a, b, beta=beta)
    return torch.addmm(total, a, b, beta=beta, out_dtype=total.dtype)


def swiglu_bwd(dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling,
               gate, up, needs_grad, lora_dropout=(), dropout_seed=None, dropout_row_offset=0,
               dropout_streams=(), activation="silu", dw_gate_sum=None, dw_up_sum=None,
               dw_down_sum=None, sum_beta=0.0, lora_a_gate_sum=None, lora_b_gate_sum=None,
               lora_a_up_sum=None, lora_b_up_sum=None, lora_a_down_sum=None,
               lora_b_down_sum=None):
    """SwiGLU MLP backward with optional LoRA adapters.

    Args:
        dy: (T, H) gradient of y, dtype and device of x.
        x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling: as for
            ``swiglu_fwd``.
        gate, up: the (T, I) pre-activations saved by ``swiglu_fwd(..., return_gate_up=True)``,
            or both None / both the empty placeholders (save="input": gate and up are
            recomputed tile by tile from x inside the fused kernel).
        needs_grad: 12 bools [w_gate, w_up, w_down, b_gate, b_up, b_down, A_gate, B_gate,
            A_up, B_up, A_down, B_down]; a gradient not wanted is never computed.
        lora_dropout, dropout_seed, dropout_row_offset, dropout_streams: as for
            ``swiglu_fwd`` (the masks are regenerated).
        lora_dropout, dropout_seed, dropout_row_offset: as for ``swiglu_fwd`` (the masks are
            regenerated).
        activation: the forward's, as for ``swiglu_fwd``; its derivative is computed in fp32
            in the tile.
        dw_gate_sum, dw_up_sum, dw_down_sum: None, or a weight gradient's sum over token
            chunks (float32 or x's dtype, the weight's shape): the wanted gradient comes back
            as ``sum_beta * sum + dw`` in the sum's dtype, computed inside its GEMM (sum_beta
            0: the sum's contents are ignored). A float32 sum of half-precision operands needs
            addmm's out_dtype, which ATen implements on CUDA only.
        lora_a_gate_sum .. lora_b_down_sum (the order of lora): None, or a wanted adapter
            gradient's sum over token chunks (float32, the factor's shape): that gradient
            comes back as ``sum + d`` in float32, the sum added inside d's GEMM.

    Returns:
        (dx (T, H), dw_gate (I, H), dw_up (I, H), dw_down (H, I), db_gate (I,), db_up (I,),
        db_down (H,), dlora): in the dtype of x, dlora 6 tensors in the order of lora, each in
        its adapter's dtype. A gradient not wanted, or of an absent bias / adapter, is
        ``x.new_empty((0,))``.

    The adapter gradients are fp32 rank-r products: for gate/up of the written dgate / dup
    (rounded to x's dtype, as the gradient PEFT's lora_B receives), in fp32 row chunks of at
    most 64 MiB; for down partly inside the kernel, from the unrounded h tiles (atomic adds,
    see ``swiglu_fwd``): dA = s (dz B)^T x', dB = s dz^T (x' A^T) for gate/up (dz = dgate, dup),
    dA_down = s dyb^T h', dB_down = s dy^T (h' A_down^T) with dyb = dy B_down, where x', h'
    carry the adapter's dropout; the low-rank part of dx (and of dh) gets the same mask.
    """
    op = "swiglu_bwd"
    totals = [lora_a_gate_sum, lora_b_gate_sum, lora_a_up_sum, lora_b_up_sum, lora_a_down_sum,
              lora_b_down_sum]
    _check_row_offset(op, "dropout_row_offset", dropout_row_offset)
    _check_dropout_streams(op, dropout_streams)
    T, H, I, lora = _check_swiglu_bwd(op, dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down,
                                      lora, lora_scaling, gate, up, needs_grad, lora_dropout,
                                      dropout_seed, activation,
                                      (dw_gate_sum, dw_up_sum, dw_down_sum), totals)
    ad = _adapters(op, x, lora, lora_scaling)
    _launch.check_operands(op, ("x", x), *zip(LORA_SUM_NAMES, totals), uses_dot=False)
    drop = _dropouts(lora_dropout, dropout_seed, ad, dropout_row_offset, dropout_streams)
    recompute = _absent(gate)
    needs = [bool(n) for n in needs_grad]
    n_wg, n_wu, n_wd = needs[0:3]
    n_bg, n_bu, n_bd = (needs[3] and b_gate is not None, needs[4] and b_up is not None,
                        needs[5] and b_down is not None)
    n_la = [ad[p] is not None and needs[6 + 2 * p] for p in range(3)]
    n_lb = [ad[p] is not None and needs[7 + 2 * p] for p in range(3)]
    lg, lu, ld = ad

    dummy = _launch.placeholder(x.device)   # pointer arguments this launch never reads
    f32 = torch.float32
    fac = _Factors32(ad)

    xd = _adapter_inputs(x, (lg, lu), drop[:2])                       # x' per adapter
    xag, xau = (t if t is not None else dummy
                for t in _input_products(xd, fac.a32, (recompute or n_lb[0],
                                                       recompute or n_lb[1])))
    drop_d, has_drop_d = _down_dropout_args(drop[2])
    dyf = dy.float() if ld else None
    dyb = torch.mm(dyf, fac.b32[2]) if ld else dummy                  # (T, r_d)
    # The down adapter's gradient pieces (dyb^T h', h' A_down^T) come from the stored h after
    # the kernel (_down_pieces), not from atomic sums in its tiles: those cost the tile its
    # registers (sm_90: spills at every tile above 32x64; without them 128x64 fits).
    down_pieces = n_la[2] or n_lb[2]

    dh = torch.mm(dy, w_down)              # (T, I), contiguous; becomes dgate in place
    dup = x.new_empty((T, I))
    h = x.new_empty((T, I)) if n_wd or down_pieces else dup   # dup: a placeholder never written
    if T > 0 and I > 0:
        gate_c = gate.contiguous() if not recompute else dup
        up_c = up.contiguous() if not recompute else dup
        b_gate_c = b_gate.contiguous() if b_gate is not None else dup
        b_up_c = b_up.contiguous() if b_up is not None else dup
        kernel, meta = _bwd_launcher(x.device, x.dtype, _launch.dot_precision(x.dtype),
                                     b_gate is not None, b_up is not None, recompute,
                                     n_wd or down_pieces, (False, False), _lora_pads(ad),
                                     has_drop_d, _lora_precision(x.dtype), activation)
        with _launch.on_device(x.device):
            kernel[_grid(T, I, _programs(x.device, meta))](
                x, w_gate, w_up, b_gate_c, b_up_c, dh, dh, dup, h, gate_c, up_c,
                xag, fac.b32[0] if lg else dummy, xau, fac.b32[1] if lu else dummy,
                fac.a32[2] if ld else dummy, dyb, dummy, dummy,
                _scale(lg), _scale(lu), _scale(ld), _rank(lg), _rank(lu), _rank(ld), *drop_d,
                T, H, I, _launch.pow2_bucket(T, 16),
                x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1),
                w_up.stride(0), w_up.stride(1), dh.stride(0), dh.stride(1),
                dup.stride(0), dup.stride(1), **meta)
    dgate = dh

    def none():
        return x.new_empty((0,))   # distinct placeholders: outputs must not alias

    dw_down = _weight_grad(dy.t(), h, dw_down_sum, sum_beta) if n_wd else none()   # (H, I)
    if down_pieces:
        dlad, ha = _down_pieces(h, drop[2], fac.a32[2], dyb, n_la[2], n_lb[2], ld[2],
                                totals[4])
    del h
    dx = torch.mm(dgate, w_gate)           # (T, H)
    if dx.is_cuda:
        dx.addmm_(dup, w_up)               # cuBLAS adds C in fp32: one rounding, no temporary
    else:
        # CPU (interpreter runs): the BLAS beta=1 path rounds worse than eager for few rows.
        dx += torch.mm(dup, w_up)
    dw_gate = _weight_grad(dgate.t(), x, dw_gate_sum, sum_beta) if n_wg else none()  # (I, H)
    dw_up = _weight_grad(dup.t(), x, dw_up_sum, sum_beta) if n_wu else none()        # (I, H)
    db_gate = dgate.sum(0, dtype=f32).to(x.dtype) if n_bg else none()
    db_up = dup.sum(0, dtype=f32).to(x.dtype) if n_bu else none()
    db_down = dy.sum(0, dtype=f32).to(x.dtype) if n_bd else none()
    # The gate/up adapters' pieces: dz B (T, r) and dz^T (x' A^T) (I, r), dz = dgate, dup.
    # (the second scaled by s: dB's GEMM takes it as alpha)
    pieces = [_rank_products(dz, fac.b32[p], xa, n_lb[p], a[2], totals[2 * p + 1])
              if a is not None else None
              for p, (a, dz, xa) in enumerate(((lg, dgate, xag), (lu, dup, xau)))]
    del dgate, dup, dh

    # Rank-r products of the adapter gradients, and the low-rank paths of dx (fp32): per
    # adapter s (dz B) A (s scales the (T, r) factor) with its dropout's mask; one GEMM over
    # the stacked factors when the two adapters share x' (no dropout), as for dA.
    dlora = [none() for _ in range(6)]
    gu = (lg, lu)
    dxa = [pieces[p][0] if a is not None else None for p, a in enumerate(gu)]
    shared = _shared_input(xd)
    if shared:
        dx_lora = _adapter_input(torch.mm(torch.cat([dxa[0] * lg[2], dxa[1] * lu[2]], 1),
                                          torch.cat(fac.a32[:2])), drop[0])
    elif lg is not None and lu is not None and _two_masks(drop):
        # both masks and their sum in one launch (the same bits as the loop below)
        dx_lora = _lora_dropout_pair(_scaled_mm(dxa[0], fac.a32[0], lg[2]),
                                     _scaled_mm(dxa[1], fac.a32[1], lu[2]), *_pair_args(drop))
    else:
        dx_lora = None
        for p, a in enumerate(gu):
            if a is not None:
                t = _adapter_input(_scaled_mm(dxa[p], fac.a32[p], a[2]), drop[p])
                dx_lora = t if dx_lora is None else dx_lora.add_(t)
    def out(i, t, a):
        """Adapter gradient i: added to its given sum (fp32) as it is, else in the factor's
        dtype."""
        return t if totals[i] is not None else t.to(a.dtype)

    if shared and n_la[0] and n_la[1] and totals[0] is None and totals[2] is None:
        both = torch.mm(torch.cat(dxa, 1).t(), xd[0])                 # (r_g + r_u, H)
        r = lg[0].shape[0]
        dlora[0] = both[:r].mul_(lg[2]).to(lg[0].dtype)
        dlora[2] = both[r:].mul_(lu[2]).to(lu[0].dtype)
    else:
        for p, a in enumerate(gu):
            if n_la[p]:
                da = _sum_mm(totals[2 * p], dxa[p].t(), xd[p], a[2])
                dlora[2 * p] = out(2 * p, da, a[0])
    for p, a in enumerate(gu):
        if n_lb[p]:
            dlora[2 * p + 1] = out(2 * p + 1, pieces[p][1], a[1])    # scaled in its GEMM
    if dx_lora is not None:
        dx.add_(dx_lora)                                     # one rounding to x's dtype
    if n_la[2]:
        dlora[4] = out(4, dlad, ld[0])                       # scaled in its GEMM
    if n_lb[2]:
        dlora[5] = out(5, _sum_mm(totals[5], dyf.t(), ha, ld[2]), ld[1])
    return dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, dlora
