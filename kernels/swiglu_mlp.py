"""Triton kernels for the SwiGLU feed-forward block of LLaMA-style models.

    y = (silu(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd

Shapes (tokens flattened): x ``(T, H)``; w_gate, w_up ``(I, H)`` and w_down ``(H, I)`` in
``nn.Linear`` layout; b_gate, b_up ``(I,)``; b_down ``(H,)``; y ``(T, H)``.

Kernels (Triton only; the autograd wiring lives in ``ckpt_ext``):

* ``_swiglu_fwd_kernel`` computes ``h = silu(gate) * up`` for one ``(BLOCK_M, BLOCK_N)`` tile
  of ``(T, I)`` with two fp32 accumulators sharing the loads of x, so the pre-activations
  gate and up are never written, unless ``STORE_GATE_UP`` asks for them (``save="gate_up"``).
* ``_swiglu_bwd_recompute_kernel`` (``save="input"``) recomputes gate and up tile by tile from
  x exactly as the forward did and, given ``dh = dy Wd``, writes ``dgate``, ``dup`` and ``h``.
  No ``(T, I)`` tensor has to survive from the forward to the backward.
* ``_swiglu_bwd_elementwise_kernel`` (``save="gate_up"``) gives the same three tensors from the
  saved gate and up.

The launchers ``swiglu_fwd`` and ``swiglu_bwd`` own validation, shapes, strides, grids and
autotuning; the dense products with w_down and the weight gradients are torch matmuls.
All pointwise math is fp32:  s = sigmoid(g),  silu(g) = g s,
silu'(g) = s (1 + g (1 - s)),  dgate = dh * up * silu'(gate),  dup = dh * silu(gate).

With ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run on CPU
tensors through the Triton interpreter, with one fixed block configuration. On a GPU
``CKPT_EXT_AUTOTUNE=0`` (also read at import) launches one fixed configuration untimed instead
of autotuning.
"""
import contextlib
import os

import torch
import triton
import triton.language as tl

from . import autotune_enabled

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_coords(T, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map the 1-D program id to a (token tile, intermediate tile) pair, GROUP_M token tiles
    at a time, so neighbouring programs reuse the same weight tiles from L2."""
    pid = tl.program_id(0)
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


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd_kernel(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, gate_ptr, up_ptr,
                       T, H, I, T_BUCKET,
                       stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                       stride_ot, stride_oi,
                       HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, STORE_GATE_UP: tl.constexpr,
                       DOT_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """h (T, I) = silu(x Wg^T + bg) * (x Wu^T + bu), one (BLOCK_M, BLOCK_N) tile per program.

    x (T, H), w_gate / w_up (I, H), biases (I,); h, gate, up share the strides
    (stride_ot, stride_oi). gate and up (pre-activations, biases included) are written only
    when STORE_GATE_UP; h is then computed from their rounded values so that the backward,
    which reads them, sees the same h. T_BUCKET only keys the autotuner.
    """
    pid_m, pid_n = _tile_coords(T, I, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g, u = _gate_up_tile(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, offs_m, offs_n, T, H, I,
                         stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                         HAS_BG, HAS_BU, DOT_IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
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
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + out_offs, h.to(out_dtype), mask=mask)


@triton.jit
def _swiglu_bwd_recompute_kernel(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, dh_ptr,
                                 dgate_ptr, dup_ptr, h_ptr,
                                 T, H, I, T_BUCKET,
                                 stride_xt, stride_xh, stride_wgi, stride_wgh,
                                 stride_wui, stride_wuh, stride_dht, stride_dhi,
                                 stride_ot, stride_oi,
                                 HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
                                 DOT_IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr):
    """Backward of save="input": recompute gate/up for one (BLOCK_M, BLOCK_N) tile from x.

    x (T, H), w_gate / w_up (I, H), biases (I,), dh = dy Wd (T, I) -> dgate, dup, h (T, I)
    with the strides (stride_ot, stride_oi). dgate may alias dh: each program reads its dh
    tile before it writes the same tile.
    """
    pid_m, pid_n = _tile_coords(T, I, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g, u = _gate_up_tile(x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, offs_m, offs_n, T, H, I,
                         stride_xt, stride_xh, stride_wgi, stride_wgh, stride_wui, stride_wuh,
                         HAS_BG, HAS_BU, DOT_IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (offs_m < T)[:, None] & (offs_n < I)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    out_dtype = h_ptr.dtype.element_ty
    out_offs = rows * stride_ot + offs_n[None, :] * stride_oi
    # Epilogue ordered to keep few (BLOCK_M, BLOCK_N) fp32 values live at once: h first, then
    # dh is read and dup, dgate follow. silu'(g) = s (1 + g (1 - s)) = s + silu (1 - s).
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(h_ptr + out_offs, (silu * u).to(out_dtype), mask=mask)
    u_dsilu = u * (s + silu * (1.0 - s))       # d h / d gate
    dh = tl.load(dh_ptr + rows * stride_dht + offs_n[None, :] * stride_dhi,
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(dup_ptr + out_offs, (dh * silu).to(out_dtype), mask=mask)
    tl.store(dgate_ptr + out_offs, (dh * u_dsilu).to(out_dtype), mask=mask)


@triton.jit
def _swiglu_bwd_elementwise_kernel(gate_ptr, up_ptr, dh_ptr, dgate_ptr, dup_ptr, h_ptr, N,
                                   BLOCK: tl.constexpr):
    """Backward of save="gate_up": all tensors contiguous with N = T * I elements.

    gate, up, dh -> dgate, dup, h; dgate may alias dh (same element read, then written).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    out_dtype = h_ptr.dtype.element_ty
    tl.store(dgate_ptr + offs, (dh * u * (s * (1.0 + g * (1.0 - s)))).to(out_dtype), mask=mask)
    tl.store(dup_ptr + offs, (dh * silu).to(out_dtype), mask=mask)
    tl.store(h_ptr + offs, (silu * u).to(out_dtype), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
# The fused tiles keep two fp32 accumulators: a 128x64 tile loads as many bytes per FLOP as a
# 128x128 plain GEMM tile, a 128x128 tile holds the registers of a 128x256 one. AOT compiles
# (tools/check_triton_compile.py, bf16; bench/results/triton_compile_*.txt) with triton 3.6 and
# 3.9: all compile for sm_90 and sm_80. On sm_90 the 4-warp and 128x128/256x64 tiles spill
# 16-64 bytes in the recompute backward only; the 8-warp 128x64, 64x128, 128x64x32 and 64x64
# tiles do not spill. On sm_80 the large tiles spill more (forward too: up to 340 bytes; with
# triton 3.6 the 128x128x64 backward up to 9 KB), which the autotuner's timings then weigh.
# Shared memory: 64-196 KB (Hopper has 227 KB per block); a config that does not fit a device
# (A100 164 KB, consumer Ampere ~100 KB) fails to compile there and the autotuner skips it.
_GPU_CONFIGS = [
    # Hopper (wgmma, large shared memory)
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    # Hopper and Ampere: no spills, except 128x128x32 (24 B in the backward on sm_90)
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    # few tokens
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
]
# Interpreter: one config whose blocks do not divide the test shapes (T 129, H 96, I 172), so
# every masked tail is exercised.
_INTERPRET_META = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4}
_ELEMENTWISE_BLOCK = 1024
_TUNE_KEY = ["T_BUCKET", "H", "I"]

# CKPT_EXT_AUTOTUNE=0 (read at import): one configuration that fits every device above, untimed.
_UNTUNED_META = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
                 "num_stages": 3}

if _INTERPRET:
    _fwd_launch = _swiglu_fwd_kernel
    _bwd_recompute_launch = _swiglu_bwd_recompute_kernel
    _FIXED_META = _INTERPRET_META
elif not autotune_enabled():
    _fwd_launch = _swiglu_fwd_kernel
    _bwd_recompute_launch = _swiglu_bwd_recompute_kernel
    _FIXED_META = _UNTUNED_META
else:
    _fwd_launch = triton.autotune(configs=_GPU_CONFIGS,
                                  key=_TUNE_KEY + ["STORE_GATE_UP"])(_swiglu_fwd_kernel)
    # dgate is written over dh in place, so tuning runs must restore dh between trials.
    _bwd_recompute_launch = triton.autotune(configs=_GPU_CONFIGS, key=_TUNE_KEY,
                                            restore_value=["dh_ptr"])(_swiglu_bwd_recompute_kernel)
    _FIXED_META = {}


def _grid(T, I):
    if _FIXED_META:
        n = triton.cdiv(T, _FIXED_META["BLOCK_M"]) * triton.cdiv(I, _FIXED_META["BLOCK_N"])
        return lambda meta: (n,)
    return lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * triton.cdiv(I, meta["BLOCK_N"]),)


def _t_bucket(T):
    """Autotuning key for the token count: the next power of two (at least 16), so a run with
    varying sequence lengths tunes a handful of times, not once per length."""
    return max(16, triton.next_power_of_2(T))


def _dot_ieee(dtype):
    """fp32 inputs follow torch's matmul precision setting: exact fp32 products unless the user
    allowed TF32 (torch.set_float32_matmul_precision("high"/"medium"))."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensor(op, name, t, shape, shape_text, x):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape_text} = {shape}, got {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of x ({x.dtype}), got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} must be on the device of x ({x.device}), got {t.device}")


def _check_inputs(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """Validate the common arguments of both launchers; returns (T, H, I)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (T, H) with the tokens flattened, got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"{op}: x is on {x.device}; the Triton kernels need CUDA tensors "
                         f"(CPU tensors only with TRITON_INTERPRET=1 set before triton is imported)")
    if x.dtype == torch.bfloat16 and _INTERPRET:
        raise NotImplementedError(
            f"{op}: bfloat16 is not supported under the Triton interpreter (TRITON_INTERPRET=1), "
            f"whose bf16 tl.dot gives wrong results (triton#11584); use float16 or float32 "
            f"there, or the ATen CPU kernels (leave CKPT_EXT_BACKEND unset)")
    T, H = x.shape
    if not isinstance(w_gate, torch.Tensor):
        raise TypeError(f"{op}: w_gate must be a torch.Tensor, got {type(w_gate).__name__}")
    if w_gate.dim() != 2 or w_gate.shape[1] != H:
        raise ValueError(f"{op}: w_gate must have shape (I, H) with H = x.shape[1] = {H}, got "
                         f"{tuple(w_gate.shape)}")
    I = w_gate.shape[0]
    _check_tensor(op, "w_gate", w_gate, (I, H), "(I, H)", x)
    _check_tensor(op, "w_up", w_up, (I, H), "(I, H)", x)
    _check_tensor(op, "w_down", w_down, (H, I), "(H, I)", x)
    for name, b, shape in (("b_gate", b_gate, (I,)), ("b_up", b_up, (I,)), ("b_down", b_down, (H,))):
        if b is not None:
            _check_tensor(op, name, b, shape, "(I,)" if name != "b_down" else "(H,)", x)
    return T, H, I


def _on_device(x):
    """Triton launches on the current CUDA device: make it the device of x."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _absent(t):
    """A saved gate/up counts as absent when it is None or the 1-D empty placeholder that
    swiglu_fwd(..., return_gate_up=False) returns."""
    return t is None or (t.dim() == 1 and t.numel() == 0)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def swiglu_fwd(x, w_gate, w_up, w_down, b_gate, b_up, b_down, return_gate_up: bool):
    """SwiGLU MLP forward.

    Args:
        x: (T, H) float16 / bfloat16 / float32, any strides.
        w_gate, w_up: (I, H); w_down: (H, I) (nn.Linear layout), dtype and device of x.
        b_gate, b_up: None or (I,); b_down: None or (H,).
        return_gate_up: False for save="input" (gate and up are never written; returns empty
            placeholders), True for save="gate_up" (returns the pre-activations).

    Returns:
        (y, gate, up): y (T, H) in the dtype of x; gate, up (T, I) pre-activations with the
        biases included when return_gate_up, else ``x.new_empty((0,))`` each.
        The intermediate h (T, I) is transient: freed before this returns.
    """
    T, H, I = _check_inputs("swiglu_fwd", x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    h = x.new_empty((T, I))
    # Distinct placeholders: an op's outputs must not alias each other.
    gu_shape = (T, I) if return_gate_up else (0,)
    gate, up = x.new_empty(gu_shape), x.new_empty(gu_shape)
    if T > 0 and I > 0:
        b_gate_c = b_gate.contiguous() if b_gate is not None else h
        b_up_c = b_up.contiguous() if b_up is not None else h
        with _on_device(x):
            _fwd_launch[_grid(T, I)](
                x, w_gate, w_up, b_gate_c, b_up_c, h,
                gate if return_gate_up else h, up if return_gate_up else h,
                T, H, I, _t_bucket(T),
                x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1),
                w_up.stride(0), w_up.stride(1), h.stride(0), h.stride(1),
                HAS_BG=b_gate is not None, HAS_BU=b_up is not None,
                STORE_GATE_UP=bool(return_gate_up), DOT_IEEE=_dot_ieee(x.dtype), **_FIXED_META)
    y = torch.nn.functional.linear(h, w_down, b_down)
    del h
    return y, gate, up


def _launch_bwd(x, w_gate, w_up, b_gate, b_up, gate, up, dh, dup, h, recompute):
    """Fill dgate (written over dh in place), dup and h, all (T, I) and contiguous, from
    dh = dy Wd and either x (recompute) or the saved gate and up."""
    T, H = x.shape
    I = w_gate.shape[0]
    if recompute:
        b_gate_c = b_gate.contiguous() if b_gate is not None else h
        b_up_c = b_up.contiguous() if b_up is not None else h
        _bwd_recompute_launch[_grid(T, I)](
            x, w_gate, w_up, b_gate_c, b_up_c, dh, dh, dup, h,
            T, H, I, _t_bucket(T),
            x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1),
            w_up.stride(0), w_up.stride(1), dh.stride(0), dh.stride(1),
            h.stride(0), h.stride(1),
            HAS_BG=b_gate is not None, HAS_BU=b_up is not None,
            DOT_IEEE=_dot_ieee(x.dtype), **_FIXED_META)
    else:
        n = T * I
        _swiglu_bwd_elementwise_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
            gate.contiguous(), up.contiguous(), dh, dh, dup, h, n,
            BLOCK=_ELEMENTWISE_BLOCK, num_warps=4)


def swiglu_bwd(dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down, gate, up):
    """SwiGLU MLP backward.

    Args:
        dy: (T, H) gradient of y, dtype and device of x.
        x, w_gate, w_up, w_down, b_gate, b_up, b_down: as for ``swiglu_fwd``.
        gate, up: the (T, I) pre-activations saved by ``swiglu_fwd(..., return_gate_up=True)``,
            or both None / both the empty placeholders (save="input": gate and up are
            recomputed tile by tile from x inside the fused kernel).

    Returns:
        (dx (T, H), dw_gate (I, H), dw_up (I, H), dw_down (H, I), db_gate (I,), db_up (I,),
        db_down (H,)), all in the dtype of x; a bias gradient is ``x.new_empty((0,))`` when that
        bias is None.
    """
    op = "swiglu_bwd"
    T, H, I = _check_inputs(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    _check_tensor(op, "dy", dy, (T, H), "(T, H)", x)
    if _absent(gate) != _absent(up):
        raise ValueError(f"{op}: gate and up must be given together (save='gate_up') or both "
                         f"left out (save='input'), got gate={'absent' if _absent(gate) else 'given'}"
                         f" and up={'absent' if _absent(up) else 'given'}")
    recompute = _absent(gate)
    if not recompute:
        _check_tensor(op, "gate", gate, (T, I), "(T, I)", x)
        _check_tensor(op, "up", up, (T, I), "(T, I)", x)

    dh = torch.mm(dy, w_down)              # (T, I), contiguous; becomes dgate in place
    dup = x.new_empty((T, I))
    h = x.new_empty((T, I))
    if T > 0 and I > 0:
        with _on_device(x):
            _launch_bwd(x, w_gate, w_up, b_gate, b_up, gate, up, dh, dup, h, recompute)
    dgate = dh
    dw_down = torch.mm(dy.t(), h)          # (H, I)
    del h
    dx = torch.mm(dgate, w_gate)           # (T, H)
    if dx.is_cuda:
        dx.addmm_(dup, w_up)               # cuBLAS adds C in fp32: one rounding, no temporary
    else:
        # CPU (interpreter runs): the BLAS beta=1 path rounds worse than eager for few rows.
        dx += torch.mm(dup, w_up)
    dw_gate = torch.mm(dgate.t(), x)       # (I, H)
    dw_up = torch.mm(dup.t(), x)           # (I, H)

    def bias_grad(g, b):
        if b is None:
            return x.new_empty((0,))
        return g.sum(0, dtype=torch.float32).to(x.dtype)

    return (dx, dw_gate, dw_up, dw_down, bias_grad(dgate, b_gate), bias_grad(dup, b_up),
            bias_grad(dy, b_down))
