"""Tests of the Triton flash-attention launchers in kernels/attention.py.

Without a GPU they run through the Triton interpreter on CPU, in fp32 and fp16 only (bf16
``tl.dot`` is wrong in the interpreter; bf16 is covered by the GPU-only tests).

Accuracy rule (README, "Tests"; reference.check_vs_baseline). The reference is
reference.attention_reference in fp64 (K/V repeated for GQA, explicit masks, rows with nothing
to attend set to 0) fed with exactly the values the kernel sees. The baseline is the same code
at the test dtype on the test device (on CPU: torch's own fp16 / fp32 CPU kernels). For each of
out, lse, dq, dk, dv the kernel's max abs error against the reference must be at most 2x (out,
lse) or 3x (grads) the baseline's error (a baseline that is exact, e.g. out = v at S = 1, is
floored at reference.FLOOR_ULPS units in the last place of the largest reference value).

The gradient baseline error is the larger of two plain-PyTorch backward passes at the test
dtype: eager autograd through softmax, and the same S x S math written with the flash-attention
identity dS = P * (dP - rowsum(dO * O)). Both are exact formulas; they round differently. In a
row that attends one or two keys autograd's softmax backward cancels almost exactly, while any
flash-attention backward (this one, FlashAttention-2) forms dP and rowsum(dO * O) by different
dot products and keeps a rounding residue of a few eps * sqrt(D). Measured in fp32: the kernel
is within ~1.3x of the identity-based baseline but up to ~10x the autograd one on such rows.
lse is float32 for every input dtype, so its baseline is eager attention in float32 (from the
same fp16/bf16 inputs) and its floor uses float32's eps. It is compared on rows that attend
something; on the other rows it must be exactly -inf in both.
"""
import contextlib
import threading
import time

import pytest
import torch
import triton
import triton.language as tl

from ckpt_ext import config
from ckpt_ext.kernels import attention

from reference import (FACTOR_GRAD, FACTOR_OUT, allowed_matrix, attention_abs_sums,
                       attention_in_chunks, attention_reference, check_close_ulps, check_vs_baseline,
                       eager_flash_identity_grads, magnitude, packed_segment_ids)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "lse", "dq", "dk", "dv")
FACTOR = {"out": FACTOR_OUT, "lse": FACTOR_OUT, "dq": FACTOR_GRAD, "dk": FACTOR_GRAD,
          "dv": FACTOR_GRAD}


# ------------------------------------------------------------------------------------------
# Reference, baseline and inputs
# ------------------------------------------------------------------------------------------
def run_eager(q, k, v, mask, causal, scale, dout, dtype, segment_ids=None, window=None):
    """Eager attention (reference.attention_reference) + autograd with inputs cast to `dtype`;
    returns dict of the 5 results."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, mask, causal, scale, segment_ids, window)
    out.backward(dout.to(dtype))
    return dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


def run_kernel(q, k, v, mask, causal, scale, dout, segment_ids=None, window=None):
    out, lse = attention.attention_fwd(q, k, v, mask, segment_ids, window, causal, scale)
    dq, dk, dv = attention.attention_bwd(dout, q, k, v, out, lse, mask, segment_ids, window,
                                         causal, scale)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def make_mask(kind, B, S, gen, device):
    """None, or bool (B, S): 'right'/'left' random padding (>= 1 kept key), 'full': batch 0
    entirely padded and the rest right-padded."""
    if kind == "none":
        return None
    keep = torch.randint(1, S + 1, (B,), generator=gen)
    pos = torch.arange(S)
    if kind == "left":
        mask = pos[None, :] >= (S - keep)[:, None]
    else:
        mask = pos[None, :] < keep[:, None]
    if kind == "full":
        mask[0] = False
    return mask.to(device)


def make_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed=0, device=DEVICE):
    """q (B, Hq, S, D), k/v (B, Hkv, S, D), dout like q, all drawn in `dtype`; and the mask."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

    q, k, v = rnd(B, Hq, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    dout = rnd(B, Hq, S, D)
    return q, k, v, dout, make_mask(mask_kind, B, S, gen, device)


def check_accuracy(got, base, ref, dtype, base_alt=None):
    """Assert the accuracy rule (reference.check_vs_baseline) for each result; return
    {name: kernel_err / bound}. lse is compared on rows that attend something (at float32's
    eps); on the others it must be exactly -inf in both.

    base_alt: optional second plain-PyTorch result set (gradients); the baseline error of a
    tensor is the larger of the two.
    """
    ratios = {}
    # The gradients share one floor scale: at S = 1, dq and dk are exactly 0 while their
    # rounding error scales with dout, the magnitude of dv.
    grad_scale = magnitude(*(ref[n] for n in ("dq", "dk", "dv") if n in ref))
    for name in NAMES:
        g, r = got[name], ref[name]
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        assert g.dtype == (torch.float32 if name == "lse" else dtype), f"{name}: {g.dtype}"
        bases = [base[name]] + ([base_alt[name]] if base_alt is not None and name in base_alt
                                else [])
        ratios[name] = check_vs_baseline(name, g, bases, r, FACTOR[name],
                                         scale=grad_scale if name in ("dq", "dk", "dv") else None)
    return ratios


def check_case(B, Hq, Hkv, S, D, dtype, causal, mask_kind, scale=None, seed=0, lengths=None,
               window=None):
    """lengths: None, or the document lengths of packed segment ids (cycled to fill S)."""
    q, k, v, dout, mask = make_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed)
    scale = D ** -0.5 if scale is None else scale
    seg = packed_segment_ids(B, S, lengths, device=DEVICE) if lengths else None
    got = run_kernel(q, k, v, mask, causal, scale, dout, seg, window)
    for name, t in (("out", q), ("dq", q), ("dk", k), ("dv", v)):
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
    assert got["lse"].dtype == torch.float32 and got["lse"].shape == (B, Hq, S)
    base = run_eager(q, k, v, mask, causal, scale, dout, dtype, seg, window)
    base_alt = eager_flash_identity_grads(q, k, v, mask, causal, scale, dout, base["out"], seg,
                                          window)
    if dtype != torch.float32:  # lse is float32 whatever the input dtype: fp32 baseline
        base["lse"] = run_eager(q, k, v, mask, causal, scale, dout, torch.float32, seg,
                                window)["lse"]
    ref = run_eager(q, k, v, mask, causal, scale, dout, torch.float64, seg, window)
    return check_accuracy(got, base, ref, dtype, base_alt)


# ------------------------------------------------------------------------------------------
# Accuracy on a covering set (every value of every axis appears)
# ------------------------------------------------------------------------------------------
#            dtype          B  Hq Hkv  S   D   causal mask
CASES = [
    (torch.float32, 1, 4, 4, 1, 16, False, "none"),
    (torch.float16, 2, 8, 2, 1, 64, True, "right"),
    (torch.float32, 3, 4, 4, 17, 64, True, "full"),
    (torch.float16, 2, 4, 4, 17, 128, False, "left"),
    (torch.float32, 2, 8, 2, 17, 16, False, "right"),
    (torch.float16, 1, 8, 2, 17, 16, True, "none"),
    (torch.float32, 2, 8, 2, 64, 128, True, "left"),
    (torch.float16, 3, 4, 4, 64, 16, True, "full"),
    (torch.float32, 1, 4, 4, 64, 64, False, "none"),
    (torch.float16, 2, 8, 2, 64, 64, False, "right"),
    (torch.float32, 2, 4, 4, 129, 64, True, "right"),
    (torch.float16, 2, 8, 2, 129, 128, True, "left"),
    (torch.float32, 3, 8, 2, 129, 16, False, "full"),
    (torch.float16, 1, 4, 4, 129, 64, False, "none"),
    (torch.float16, 2, 8, 2, 129, 16, True, "full"),
    (torch.float32, 2, 8, 2, 129, 128, False, "right"),
    (torch.float32, 2, 4, 4, 1, 128, True, "full"),
    (torch.float16, 3, 4, 4, 1, 16, False, "left"),
]


def _case_id(c):
    dtype, B, Hq, Hkv, S, D, causal, mask = c
    return f"{str(dtype)[6:]}-B{B}-H{Hq}/{Hkv}-S{S}-D{D}-{'causal' if causal else 'full'}-mask_{mask}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_accuracy(case):
    dtype, B, Hq, Hkv, S, D, causal, mask = case
    check_case(B, Hq, Hkv, S, D, dtype, causal, mask)


@pytest.mark.parametrize("D", [80, 96, 256])
def test_head_dim_not_power_of_two_or_large(D):
    """head_dim padded to the next power of two inside the kernel (80, 96) and the maximum 256."""
    check_case(2, 4, 2, 33, D, torch.float32, True, "right", seed=D)


def test_custom_scale():
    check_case(1, 4, 2, 40, 32, torch.float32, True, "left", scale=0.3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], ids=["M16-N32", "M32-N16"])
def test_unequal_blocks(monkeypatch, blocks):
    """BLOCK_M != BLOCK_N (as in the GPU configs) exercises the causal block-skipping bounds."""
    bm, bn = blocks
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(attention.INTERPRETER_BLOCKS, kind, {"BLOCK_M": bm, "BLOCK_N": bn})
    check_case(2, 4, 2, 71, 16, torch.float32, True, "left", seed=7)


# ------------------------------------------------------------------------------------------
# Packed sequences (segment ids) and sliding windows
# ------------------------------------------------------------------------------------------
# Document lengths cycle to fill S: one-token documents, documents shorter than a tile (32 in
# the interpreter), odd lengths; windows of 1, inside S and larger than S; GQA; padding.
#                dtype          B  Hq Hkv  S   D   causal mask     documents         window
SEG_WIN_CASES = [(torch.float32, 2, 4, 2, 37, 16, True, "none", [5, 1, 20], None),
                 (torch.float16, 2, 4, 2, 70, 16, True, "right", None, 7),
                 (torch.float32, 1, 4, 4, 70, 32, False, "left", None, 1),
                 (torch.float16, 2, 8, 2, 45, 16, True, "none", [1], 1),
                 (torch.float32, 2, 4, 2, 33, 16, False, "right", [1, 2, 40], 100),
                 (torch.float32, 2, 4, 1, 129, 16, True, "full", [50, 1, 7, 33], 20),
                 (torch.float16, 1, 4, 2, 100, 64, False, "none", [17, 3, 80], 9),
                 (torch.float32, 1, 2, 2, 1, 16, True, "none", [1], 1)]


def _seg_win_id(c):
    return _case_id(c[:8]) + f"-docs{c[8]}-w{c[9]}"


@pytest.mark.parametrize("case", SEG_WIN_CASES, ids=[_seg_win_id(c) for c in SEG_WIN_CASES])
def test_segments_and_window(case):
    dtype, B, Hq, Hkv, S, D, causal, mask, lengths, window = case
    check_case(B, Hq, Hkv, S, D, dtype, causal, mask, seed=S, lengths=lengths, window=window)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], ids=["M16-N32", "M32-N16"])
@pytest.mark.parametrize("causal", [True, False])
def test_segments_and_window_unequal_blocks(monkeypatch, blocks, causal):
    """BLOCK_M != BLOCK_N: the tile ranges of both axes and of the transposed dK/dV walk."""
    bm, bn = blocks
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(attention.INTERPRETER_BLOCKS, kind, {"BLOCK_M": bm, "BLOCK_N": bn})
    check_case(2, 4, 2, 83, 16, torch.float32, causal, "left", seed=3, lengths=[9, 1, 40, 21],
               window=13)


def test_segment_ids_any_values_and_layout():
    """Interleaved, unsorted, negative ids (one id in several runs), int32, a strided view."""
    B, Hq, Hkv, S, D = 2, 4, 2, 50, 16
    q, k, v, dout, _ = make_inputs(B, Hq, Hkv, S, D, torch.float32, "none", seed=4)
    wide = torch.randint(-3, 3, (B, 2 * S), dtype=torch.int32).to(DEVICE) * 1000003
    seg = wide[:, ::2]
    assert not seg.is_contiguous()
    got = run_kernel(q, k, v, None, False, 0.25, dout, seg, 30)
    base = run_eager(q, k, v, None, False, 0.25, dout, torch.float32, seg, 30)
    base_alt = eager_flash_identity_grads(q, k, v, None, False, 0.25, dout, base["out"], seg, 30)
    ref = run_eager(q, k, v, None, False, 0.25, dout, torch.float64, seg, 30)
    check_accuracy(got, base, ref, torch.float32, base_alt)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the poisoned rows
@pytest.mark.parametrize("rule", ["window", "segments"])
def test_ruled_out_tiles_are_never_read(rule):
    """Tiles that the window or the segments rule out are skipped, not masked: q, k, v and dout
    of positions 0..T-1 hold NaN, T the widest tile the kernels use here (32 under the
    interpreter, 128 on a GPU). Any visit of that tile by a block that cannot see it would put
    NaN into the block's results (0 * NaN = NaN, even under a mask)."""
    T = 128 if torch.cuda.is_available() else 32
    B, Hq, Hkv, S, D = 1, 2, 1, 4 * T, 16
    q, k, v, dout, _ = make_inputs(B, Hq, Hkv, S, D, torch.float32, "none", seed=8)
    seg, window = (None, 8) if rule == "window" else (
        packed_segment_ids(B, S, [T, T, 2 * T], device=DEVICE), None)
    clean = run_kernel(q, k, v, None, True, 0.25, dout, seg, window)
    for t in (q, k, v, dout):
        t[:, :, :T] = float("nan")
    got = run_kernel(q, k, v, None, True, 0.25, dout, seg, window)
    # Window: query blocks from 2T see keys >= 2T - 7 only, key blocks from 2T are seen by
    # queries >= 2T only (causal). Segments: positions T.. never meet positions < T. (With the
    # window the block of rows T..2T-1 meets the poisoned keys T-7..T-1, legitimately: its out
    # and lse become NaN, and so do dK/dV of every key those rows see.)
    start = 2 * T if rule == "window" else T
    for name in NAMES:
        assert torch.equal(got[name][:, :, start:], clean[name][:, :, start:]), name


# ------------------------------------------------------------------------------------------
# dQ formed by its own kernel ("separate"), or inside the dK/dV kernel with atomics or in
# key-block order
# ------------------------------------------------------------------------------------------
#            dtype          B  Hq Hkv  S   D  causal mask     documents   window
DQ_CASES = [(torch.float32, 2, 4, 2, 1, 16, True, "right", None, None),
            (torch.float16, 2, 8, 2, 17, 64, True, "left", None, None),
            (torch.float32, 3, 4, 4, 17, 16, False, "full", None, None),
            (torch.float16, 1, 4, 1, 129, 16, False, "none", None, None),
            (torch.float32, 2, 8, 2, 129, 32, True, "none", [50, 1, 7, 33], None),
            (torch.float32, 2, 4, 2, 70, 16, False, "right", [1, 2, 40], 9),
            (torch.float16, 2, 4, 2, 129, 16, True, "full", None, 20)]


@pytest.mark.parametrize("mode", ["separate", "atomic", "ordered"])
@pytest.mark.parametrize("case", DQ_CASES, ids=[_seg_win_id(c) for c in DQ_CASES])
def test_dq_modes(mode, case):
    """The attention_dq setting: every dQ path meets the accuracy rule (GQA, padding, segments,
    window, S = 1, 17, 129); the atomic and ordered ones add dQ from every key block of every
    group head (ordered with segments: the separate kernel)."""
    dtype, B, Hq, Hkv, S, D, causal, mask, lengths, window = case
    with config.patch(attention_dq=mode):
        assert attention.dq_mode() == mode
        check_case(B, Hq, Hkv, S, D, dtype, causal, mask, seed=S + 1, lengths=lengths,
                   window=window)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
def test_dq_atomic_unequal_blocks(monkeypatch):
    """The atomic dQ rows with BLOCK_M != BLOCK_N (query blocks cut differently from the
    forward's) and a key block crossing S."""
    monkeypatch.setitem(attention.INTERPRETER_BLOCKS, "dkdv", {"BLOCK_M": 16, "BLOCK_N": 32})
    with config.patch(attention_dq="atomic"):
        check_case(2, 4, 2, 71, 16, torch.float32, True, "left", seed=12, lengths=[9, 1, 40],
                   window=13)


def _spy_launchers(monkeypatch):
    """The (kind, ordered) of every launcher the attention backward asks for, in order."""
    calls = []
    real = attention._launcher

    def spy(kind, *args, **kw):
        calls.append((kind, kw.get("ordered", False)))
        return real(kind, *args, **kw)
    monkeypatch.setattr(attention, "_launcher", spy)
    return calls


def _record_fp32_dq(monkeypatch):
    """The fp32 tensors of the attention backward's (B, H, S, D) allocations, in order: with
    fp16 inputs the dQ sums that the dK/dV kernel adds into (before their rounding to fp16),
    with fp32 ones dq itself (its own accumulator)."""
    allocs = []
    real = attention._empty_bshd

    def spy(B, H, S, D, dtype, device):
        t = real(B, H, S, D, dtype, device)
        if dtype == torch.float32:
            allocs.append(t)
        return t
    monkeypatch.setattr(attention, "_empty_bshd", spy)
    return allocs


def _dq_sums(monkeypatch, mode, q, k, v, out, lse, dout, mask, window, causal, r0):
    """(dq, its fp32 sums) of one backward under attention_dq=mode."""
    allocs = _record_fp32_dq(monkeypatch)
    with config.patch(attention_dq=mode):
        dq = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, causal, 0.25,
                                     r0)[0]
    if q.dtype == torch.float32:
        return dq, dq
    sums = [t for t in allocs if t.shape == q.shape]
    assert len(sums) == 1, [t.shape for t in allocs]
    return dq, sums[0]


# dtype, B, Hq, Hkv, S, causal, mask, q rows (from, count: None to the end), window, BLOCK_M,
# BLOCK_N of dK/dV. GQA 4/2 and MQA, padding (a batch with nothing to attend), a key block
# crossing S, query blocks finer and coarser than the key blocks, query chunks at the end and
# in the middle (causal key blocks past the chunk's last row: empty ranges, one rounded to a
# block of real rows with BLOCK_M 64 > BLOCK_N 32, one to a block past Sq), windows (causal
# and not: key blocks below a block of rows see none of it) in whole calls and in chunks.
ORDERED_CASES = [
    (torch.float32, 2, 4, 2, 71, True, "left", (0, None), None, 16, 32),
    (torch.float32, 1, 4, 1, 70, False, "right", (0, None), None, 32, 16),
    (torch.float16, 2, 2, 2, 67, True, "full", (23, None), None, 32, 32),
    (torch.float32, 1, 4, 2, 150, True, "left", (40, 40), None, 64, 32),
    (torch.float16, 1, 4, 2, 150, True, "none", (40, 40), None, 16, 16),
    (torch.float32, 1, 4, 2, 83, True, "none", (0, None), 13, 16, 16),
    (torch.float16, 2, 4, 2, 90, False, "right", (0, None), 21, 32, 16),
    (torch.float32, 1, 2, 1, 97, False, "left", (30, 45), 11, 16, 32),
    (torch.float32, 1, 4, 2, 131, True, "right", (60, 71), 40, 32, 16),
]


def _ordered_id(c):
    dtype, B, Hq, Hkv, S, causal, mask, (r0, rows), window, bm, bn = c
    return (f"{str(dtype)[6:]}-B{B}-H{Hq}/{Hkv}-S{S}-{'causal' if causal else 'full'}-{mask}"
            f"-rows{r0}+{rows or S - r0}-w{window}-{bm}x{bn}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
@pytest.mark.parametrize("case", ORDERED_CASES, ids=[_ordered_id(c) for c in ORDERED_CASES])
def test_dq_ordered_sums_from_the_highest_key_block(monkeypatch, case):
    """attention_dq="ordered": the dK/dV kernel forms dQ (no dQ kernel runs) and each dQ tile
    takes the key blocks' shares from the highest key block down. Each key block's share is
    the dQ of a backward whose padding mask keeps that block's keys only (the other keys add
    exact zeros, so the share is bitwise the kernel's); summed in fp32 from the highest block
    down they give the ordered dQ sums bitwise, and the same shares summed from the lowest
    block up do not (cases whose tiles take three or more shares). Two runs are bitwise
    equal; dK / dV equal the separate mode's (the same kernel's sums); dQ is within a few
    ulps of the separate kernel's and within the accuracy rule against float64."""
    dtype, B, Hq, Hkv, S, causal, mask_kind, (r0, rows), window, bm, bn = case
    monkeypatch.setitem(attention.INTERPRETER_BLOCKS, "dkdv", {"BLOCK_M": bm, "BLOCK_N": bn})
    q, k, v, dout, mask = make_inputs(B, Hq, Hkv, S, 16, dtype, mask_kind, seed=S + r0)
    end = S if rows is None else r0 + rows
    # the scale of dQ's rounding (any order of its sums), from every row
    dq_scale = attention_abs_sums(q, k, v, dout, mask, causal, 0.25, None, window)["dq"]
    q, dout = q[:, :, r0:end], dout[:, :, r0:end]
    out, lse = attention.attention_fwd(q, k, v, mask, None, window, causal, 0.25, r0)
    calls = _spy_launchers(monkeypatch)
    args = (q, k, v, out, lse, dout, mask, window, causal, r0)
    dq, sums = _dq_sums(monkeypatch, "ordered", *args)
    assert calls == [("dkdv", True)], calls
    dq2, sums2 = _dq_sums(monkeypatch, "ordered", *args)
    assert torch.equal(dq, dq2) and torch.equal(sums, sums2), "two ordered runs differ"
    assert not torch.isnan(sums).any()

    keep = torch.ones(B, S, dtype=torch.bool, device=DEVICE) if mask is None else mask
    n_kb = -(-S // bn)
    shares = []
    for n in range(n_kb):
        only = torch.zeros_like(keep)
        only[:, n * bn:(n + 1) * bn] = True
        shares.append(_dq_sums(monkeypatch, "atomic", q, k, v, out, lse, dout, keep & only,
                               window, causal, r0)[1])
    down, up = torch.zeros_like(sums), torch.zeros_like(sums)
    for n in range(n_kb):
        down = down + shares[n_kb - 1 - n]
        up = up + shares[n]
    assert torch.equal(sums, down), (sums - down).abs().max()
    if dtype == torch.float32:
        assert torch.equal(dq, down)
    else:
        assert torch.equal(dq, down.to(dtype))
    several = sum((s != 0).any(-1) for s in shares) >= 3   # rows taking three shares or more
    if several.any():
        assert not torch.equal(sums, up), "the shares' order leaves no trace: a weak case"

    with config.patch(attention_dq="separate"):
        sep = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, causal, 0.25,
                                      r0)
    with config.patch(attention_dq="ordered"):
        got = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, causal, 0.25,
                                      r0)
    for i in (1, 2):
        assert torch.equal(got[i], sep[i])
    check_close_ulps("dq", dq, sep[0], 4 if dtype == torch.float32 else 1, dtype, dq_scale)
    if r0 == 0:
        with config.patch(attention_dq="ordered"):
            check_case(B, Hq, Hkv, S, 16, dtype, causal, mask_kind, seed=S + 1, window=window)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
def test_dq_ordered_takes_the_separate_kernel_with_segment_ids(monkeypatch):
    """Segment ids (whose spans need not grow with the key position, so the key blocks that
    meet a block of rows need not be consecutive) take the separate dQ kernel under
    attention_dq="ordered"; a window alone does not."""
    B, Hq, Hkv, S = 2, 4, 2, 67
    q, k, v, dout, mask = make_inputs(B, Hq, Hkv, S, 16, torch.float32, "right", seed=4)
    seg = packed_segment_ids(B, S, [20, S - 20], device=DEVICE)
    calls = _spy_launchers(monkeypatch)
    for segment_ids, window, want in ((seg, None, [("dkdv", False), ("dq", False)]),
                                      (seg, 9, [("dkdv", False), ("dq", False)]),
                                      (None, 9, [("dkdv", True)])):
        out, lse = attention.attention_fwd(q, k, v, mask, segment_ids, window, True, 0.25)
        calls.clear()
        with config.patch(attention_dq="ordered"):
            attention.attention_bwd(dout, q, k, v, out, lse, mask, segment_ids, window, True,
                                    0.25)
        assert calls == want, (segment_ids is not None, window, calls)


@triton.jit
def _turn_ascending(start_m, turn_cap, turn_shift, BLOCK_N: tl.constexpr):
    # the lowest key block first (the order before FlashAttention-3's): key block kb's turn is
    # kb, which the test's call (causal, whole, BLOCK_M == BLOCK_N) gives as turn_shift =
    # BLOCK_N - 1 - kb * BLOCK_N
    return (BLOCK_N - 1 - turn_shift) // BLOCK_N


@triton.jit
def _turn_one_late(start_m, turn_cap, turn_shift, BLOCK_N: tl.constexpr):
    return (start_m + turn_shift) // BLOCK_N + 1   # the turn after the right one, uncapped


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the Triton interpreter's wait")
@pytest.mark.parametrize("turn", [_turn_ascending, _turn_one_late], ids=["ascending", "late"])
def test_dq_ordered_wrong_turn_fails_instead_of_hanging(monkeypatch, turn):
    """A key block whose turn never comes puts NaN into its dQ tile in the interpreter (which
    runs the programs one at a time, so a wait would never end): a wrong turn formula shows
    as a failure, the call returns. The tile of rows that key block 0 alone meets stays exact
    under the ascending turns; every later tile fails."""
    monkeypatch.setattr(attention, "_dq_turn", turn)
    monkeypatch.setitem(attention.INTERPRETER_BLOCKS, "dkdv", {"BLOCK_M": 32, "BLOCK_N": 32})
    B, Hq, Hkv, S = 1, 4, 2, 70
    q, k, v, dout, _ = make_inputs(B, Hq, Hkv, S, 16, torch.float32, "none", seed=2)
    out, lse = attention.attention_fwd(q, k, v, None, None, None, True, 0.25)
    with config.patch(attention_dq="ordered"):
        dq = attention.attention_bwd(dout, q, k, v, out, lse, None, None, None, True, 0.25)[0]
    bad = torch.isnan(dq).any(-1)
    assert bad[:, :, 32:].all(), bad
    if turn is _turn_ascending:
        assert not bad[:, :, :32].any()


# The ordered dK/dV kernel compiled for sm_90 (no GPU: triton's bundled ptxas), beside the
# atomic one of the same config: the inline PTX turn-taking (a turn per block of rows, key
# blocks right to left) assembles and keeps the loop pipelined (TTGIR's asynchronous copies,
# as many as the atomic kernel's); with a sliding window too (three loops, each waiting).
_ORDERED_AOT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
import check_triton_compile as t
t._prepare_environment()
attention, _, _ = t.load_kernel_modules(False)
out = {}
for name, ordered, window in (("atomic", False, False), ("ordered", True, False),
                              ("ordered_window", True, True)):
    sig, consts, attrs = t.attention_signature(attention, "dkdv", "bf16", 128, True, False,
                                               {"BLOCK_M": 16, "BLOCK_N": 128}, dq_atomic=True,
                                               dq_ordered=ordered)
    consts["WINDOW"] = window
    src = triton.compiler.ASTSource(fn=attention._attn_bwd_dkdv_kernel, signature=sig,
                                    constexprs=consts, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8, "num_stages": 2})
    out[name] = {"async_copies": c.asm["ttgir"].count("async_copy_global_to_local"),
                 "acquire_spin": c.asm["ptx"].count("ld.global.acquire.gpu.b32"),
                 "release": c.asm["ptx"].count("red.release.gpu.global.add.s32"),
                 "while": c.asm["ttgir"].count("scf.while")}
print("AOT" + json.dumps(out))
"""


def test_dq_ordered_compiles_for_sm90_and_stays_pipelined():
    import pathlib

    from aot import aot_run

    tools = pathlib.Path(__file__).resolve().parents[1] / "tools"
    got, _ = aot_run(_ORDERED_AOT_SCRIPT, str(tools), timeout=600)
    print("sm_90 dK/dV 16x128 w8 s2:", got)
    assert got["atomic"]["async_copies"] > 0
    assert got["ordered"]["async_copies"] == got["atomic"]["async_copies"], got
    assert got["ordered"]["while"] == 0 and got["atomic"]["acquire_spin"] == 0
    assert got["ordered"]["acquire_spin"] >= 1 and got["ordered"]["release"] >= 1, got
    windowed = got["ordered_window"]
    assert windowed["while"] == 0 and windowed["async_copies"] > 0, got
    assert windowed["acquire_spin"] >= 3 and windowed["release"] >= 3, got


# ------------------------------------------------------------------------------------------
# Query chunks: q_offset and the fp32 dk / dv accumulators, every dQ mode
# ------------------------------------------------------------------------------------------
#              dtype          B  Hq Hkv  S   D  causal mask     documents     window
CHUNK_CASES = [(torch.float32, 2, 4, 2, 150, 16, True, "left", None, None),
               (torch.float16, 2, 2, 2, 150, 16, False, "full", None, None),
               (torch.float32, 1, 4, 2, 163, 16, True, "none", [40, 1, 70], None),
               (torch.float16, 1, 4, 1, 150, 16, True, "right", None, 33),
               (torch.float32, 1, 2, 2, 140, 16, False, "right", [30, 90], 20)]
# (case, rows per chunk, dQ mode): every case with chunks of 17 and 129 rows, the modes
# alternating so that each meets causal / not, GQA, padding, documents and a window. The
# interpreter runs one program at a time, hence not the whole product.
CHUNK_RUNS = [(c, rows, ("separate", "atomic")[(i + j) % 2]) for i, c in enumerate(CHUNK_CASES)
              for j, rows in enumerate((17, 129))]


def check_chunks(case, rows, seed):
    """Queries in chunks of `rows` (q_offset = the chunk's first row) against all keys, dk / dv
    summed in fp32 accumulators: equal to the one-call result (out / lse / dq within a few ulps
    of q's dtype, the accumulators within a few fp32 ulps of one chunk holding every row) and
    within the accuracy rule; rows with nothing to attend give 0 / -inf / 0."""
    dtype, B, Hq, Hkv, S, D, causal, mask_kind, lengths, window = case
    q, k, v, dout, mask = make_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed)
    seg = packed_segment_ids(B, S, lengths, device=DEVICE) if lengths else None
    scale = D ** -0.5
    args = (q, k, v, dout, mask, causal, scale, seg, window)
    fwd, bwd = attention.attention_fwd, attention.attention_bwd
    got = attention_in_chunks(fwd, bwd, *args, rows)
    whole_acc = attention_in_chunks(fwd, bwd, *args, S)  # one chunk, into the accumulators
    whole = run_kernel(q, k, v, mask, causal, scale, dout, seg, window)
    # The same sums in another order: within a few ulps of the sums of their terms' absolute
    # values (fp32 ulps; out, dq then rounded once to q's dtype).
    sums = attention_abs_sums(q, k, v, dout, mask, causal, scale, seg, window)
    check_close_ulps("lse", got["lse"], whole["lse"], 4)
    for name in ("out", "dq"):
        ulps = 4 if dtype == torch.float32 else 1
        check_close_ulps(name, got[name], whole[name], ulps, dtype, sums[name])
    for name in ("dk", "dv"):  # half inputs: P and dS are rounded to q's dtype for the dots
        if dtype == torch.float32:
            check_close_ulps(name, got[name], whole_acc[name], 8, torch.float32, sums[name])
        else:
            check_close_ulps(name, got[name], whole_acc[name], 1, dtype, sums[name])
        check_close_ulps(name + " rounded", whole_acc[name].to(dtype), whole[name], 1)
    empty = ~allowed_matrix(B, S, mask, causal, DEVICE, seg, window).any(-1).expand_as(got["lse"])
    if mask_kind in ("left", "full"):
        assert empty.any()
    assert torch.isneginf(got["lse"][empty]).all() and (got["out"][empty] == 0).all()
    assert (got["dq"][empty] == 0).all()
    assert not any(torch.isnan(t).any() for t in got.values())
    base = run_eager(q, k, v, mask, causal, scale, dout, dtype, seg, window)
    base_alt = eager_flash_identity_grads(q, k, v, mask, causal, scale, dout, base["out"], seg,
                                          window)
    if dtype != torch.float32:
        base["lse"] = run_eager(q, k, v, mask, causal, scale, dout, torch.float32, seg,
                                window)["lse"]
    ref = run_eager(q, k, v, mask, causal, scale, dout, torch.float64, seg, window)
    got = dict(got, dk=got["dk"].to(dtype), dv=got["dv"].to(dtype))
    return check_accuracy(got, base, ref, dtype, base_alt)


@pytest.mark.parametrize("case,rows,mode", CHUNK_RUNS,
                         ids=[f"{_seg_win_id(c)}-rows{r}-{m}" for c, r, m in CHUNK_RUNS])
def test_query_chunks(case, rows, mode):
    with config.patch(attention_dq=mode):
        check_chunks(case, rows, seed=rows)


ORDERED_CHUNK_CASES = CHUNK_CASES[:2] + CHUNK_CASES[3:4]


@pytest.mark.parametrize("case", ORDERED_CHUNK_CASES,
                         ids=[_seg_win_id(c) for c in ORDERED_CHUNK_CASES])
def test_query_chunks_ordered(case):
    """The ordered dQ sums in query chunks (the cases without segments, which would take the
    separate kernel): causal with padding and GQA, not causal, causal with a window. Causal
    chunks have key blocks past their last row, whose empty range rounds to a block of rows
    past Sq (skipped: the key blocks above them do not visit it, so a wait there would never
    end)."""
    with config.patch(attention_dq="ordered"):
        check_chunks(case, 17, seed=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
@pytest.mark.parametrize("bm,bn", [(64, 32), (16, 32)])
def test_query_chunks_ordered_unequal_blocks(monkeypatch, bm, bn):
    """Ordered dQ in causal query chunks with query blocks coarser than the key blocks (an
    empty range then rounds to a block of real rows, which every key block before met too)
    and finer."""
    monkeypatch.setitem(attention.INTERPRETER_BLOCKS, "dkdv", {"BLOCK_M": bm, "BLOCK_N": bn})
    with config.patch(attention_dq="ordered"):
        check_chunks((torch.float32, 1, 4, 2, 150, 16, True, "left", None, None), 40, seed=6)


# One-row chunks launch every kernel once per query: two heads and 70 tokens keep them quick
# in the interpreter. Causal with left padding (rows that attend nothing), documents and a window.
ONE_ROW_CASE = (torch.float32, 1, 2, 1, 70, 16, True, "left", [30, 1, 39], 20)


@pytest.mark.parametrize("mode", ["separate", "atomic"])
def test_query_chunks_of_one_row(mode):
    with config.patch(attention_dq=mode):
        check_chunks(ONE_ROW_CASE, 1, seed=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter block sizes only apply on CPU")
def test_query_chunks_unequal_blocks(monkeypatch):
    """BLOCK_M != BLOCK_N with chunks that start inside a key tile (skipping bounds in global
    positions), both dQ modes."""
    for kind, bm, bn in (("fwd", 16, 32), ("dkdv", 16, 32), ("dq", 32, 16)):
        monkeypatch.setitem(attention.INTERPRETER_BLOCKS, kind, {"BLOCK_M": bm, "BLOCK_N": bn})
    for mode in ("separate", "atomic"):
        with config.patch(attention_dq=mode):
            check_chunks((torch.float32, 2, 4, 2, 71, 16, True, "left", [9, 1, 40], 13), 23,
                         seed=5)


def test_query_chunk_accumulators_any_layout():
    """dk_acc / dv_acc of different strides from each other: the same sums."""
    q, k, v, dout, mask = make_inputs(1, 4, 2, 40, 16, torch.float32, "right", seed=2)
    qc, dc = q[:, :, 8:30], dout[:, :, 8:30]
    out, lse = attention.attention_fwd(qc, k, v, mask, None, 9, True, 0.25, 8)
    plain = [torch.full((1, 2, 40, 16), 0.5, device=DEVICE) for _ in range(2)]
    odd = [torch.full((16, 40, 2, 1), 0.5, device=DEVICE).permute(3, 2, 1, 0),
           torch.full((1, 40, 2, 16), 0.5, device=DEVICE).transpose(1, 2)]
    for accs in (plain, odd):
        dq, dk, dv = attention.attention_bwd(dc, qc, k, v, out, lse, mask, None, 9, True, 0.25, 8,
                                             *accs)
        assert dk.shape == dv.shape == (0,)
    for a, b in zip(plain, odd):
        assert torch.equal(a, b)
    _, dk, dv = attention.attention_bwd(dc, qc, k, v, out, lse, mask, None, 9, True, 0.25, 8)
    assert torch.allclose(plain[0], dk + 0.5, rtol=0, atol=1e-6)
    assert torch.allclose(plain[1], dv + 0.5, rtol=0, atol=1e-6)


BAD_CHUNKS = [  # (id, q rows, q_offset, accumulators (dk, dv) builder, exception, match)
    ("offset_neg", 8, -1, None, ValueError, "q_offset must satisfy 0 <= q_offset and "
     r"q_offset \+ Sq <= Sk .* got q_offset=-1 with Sq=8, Sk=8"),
    ("offset_past", 3, 6, None, ValueError, "q_offset must satisfy .* got q_offset=6 with "
     "Sq=3, Sk=8"),
    ("acc_alone", 3, 2, lambda z: (z(2, 2, 8, 16), None), ValueError,
     "dk_acc and dv_acc must be given together or both left out"),
    ("acc_shape", 3, 2, lambda z: (z(2, 2, 3, 16), z(2, 2, 8, 16)), ValueError,
     r"dk_acc must have shape \(2, 2, 8, 16\) \(B, Hkv, Sk, D\)"),
    ("acc_dtype", 3, 2, lambda z: (z(2, 2, 8, 16), z(2, 2, 8, 16).half()), TypeError,
     r"dv_acc must be float32 \(or float64 when q is float64\), got float16"),
]


@pytest.mark.parametrize("rows,q_offset,accs,exc,match", [b[1:] for b in BAD_CHUNKS],
                         ids=[b[0] for b in BAD_CHUNKS])
def test_query_chunks_reject_bad_arguments(rows, q_offset, accs, exc, match):
    q, k, v, _ = _good()
    qc = q[:, :, :rows]
    accs = accs(lambda *shape: torch.zeros(*shape, device=DEVICE)) if accs else (None, None)
    lse = torch.zeros(2, 4, rows, device=DEVICE)
    if accs == (None, None):
        with pytest.raises(exc, match="attention_fwd: " + match):
            attention.attention_fwd(qc, k, v, None, None, None, True, 0.25, q_offset)
    with pytest.raises(exc, match="attention_bwd: " + match):
        attention.attention_bwd(qc, qc, k, v, qc, lse, None, None, None, True, 0.25, q_offset,
                                *accs)


def test_dq_mode_rejects_unknown_values():
    with pytest.raises(ValueError, match="CKPT_EXT_ATTN_DQ must be one of 'auto', 'separate', "
                                         "'atomic', 'ordered', got 'fast'"):
        config.from_environment({"CKPT_EXT_ATTN_DQ": "fast"})
    with pytest.raises(ValueError, match=r"attention_dq \(CKPT_EXT_ATTN_DQ\) must be one of "
                                         r"'auto', 'separate', 'atomic', 'ordered', got 'fast'"):
        with config.patch(attention_dq="fast"):
            pass
    assert attention.dq_mode() == "auto"


# ------------------------------------------------------------------------------------------
# Layouts, determinism, empty rows
# ------------------------------------------------------------------------------------------
def test_non_contiguous_inputs():
    """HF passes (B, S, H, D).transpose(1, 2) views; the mask and dout may be strided too."""
    B, Hq, Hkv, S, D = 2, 4, 2, 37, 32
    dtype = torch.float32
    gen = torch.Generator().manual_seed(3)

    def rnd_bshd(H):
        return torch.randn(B, S, H, D, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)

    q, k, v, dout = rnd_bshd(Hq), rnd_bshd(Hkv), rnd_bshd(Hkv), rnd_bshd(Hq)
    wide = torch.ones(B, 2 * S, dtype=torch.bool, device=DEVICE)
    wide[0, 2 * 30:] = False
    mask = wide[:, ::2]
    assert not q.is_contiguous() and not k.is_contiguous() and not mask.is_contiguous()
    scale = D ** -0.5
    got = run_kernel(q, k, v, mask, True, scale, dout)
    for name in ("out", "dq", "dk", "dv"):  # (B, H, S, D) views of (B, S, H, D) memory
        assert got[name].transpose(1, 2).is_contiguous(), name
    assert got["lse"].is_contiguous()
    base = run_eager(q, k, v, mask, True, scale, dout, dtype)
    base_alt = eager_flash_identity_grads(q, k, v, mask, True, scale, dout, base["out"])
    ref = run_eager(q, k, v, mask, True, scale, dout, torch.float64)
    check_accuracy(got, base, ref, dtype, base_alt)
    contiguous = run_kernel(*(t.contiguous() for t in (q, k, v, mask)), True, scale, dout.contiguous())
    for name in NAMES:
        torch.testing.assert_close(got[name], contiguous[name], rtol=1e-6, atol=1e-6)


def _layer_copies(step):
    """The aten::copy_ calls that one decoder-layer step makes outside the kernel ops (every
    ``ckpt_ext::`` op but the decoder_layer ops themselves), by phase: {"fwd": [...], "bwd":
    [...]}, each entry the chain of enclosing ops. In fp32 no dtype conversion copies, so
    these are the layout copies (``.contiguous()``, a ``reshape`` that cannot view)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    copies = {"fwd": [], "bwd": []}
    for event in prof.events():
        if event.name != "aten::copy_":
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if any(n.startswith("ckpt_ext::") and not n.startswith("ckpt_ext::decoder_layer")
               for n in chain):
            continue  # inside a kernel op: its own work (the interpreter's copies included)
        phase = "bwd" if "ckpt_ext::decoder_layer_bwd" in chain else "fwd"
        copies[phase].append(" < ".join(chain))
    return copies


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the layer's ops on CPU")
@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("policy", ["fast", "balanced", "min_memory"])
def test_decoder_layer_has_no_attention_layout_copies(backend, policy):
    """out, dq, dk, dv come back as (B, H, S, D) views of (B, S, H, D) memory, and rope keeps
    its input's layout, so the layer splits and merges heads with views: no layout copy in
    forward or backward. Before this layout: 1 in forward (2 recomputed with min_memory) and
    4 in backward (out twice, dq, dk, dv), then 2 while rope_bwd returned contiguous tensors."""
    from ckpt_ext import use_triton
    from reference import make_layer, rope_tables

    b, s, hq, hkv, d = 2, 17, 4, 2, 16
    layer = make_layer(hq * d, hq, hkv, 96, torch.float32, policy=policy)
    x = torch.randn(b, s, hq * d, requires_grad=True)
    pe = rope_tables(s, d, torch.float32)

    def step():
        layer(x, pe, None).sum().backward()

    with use_triton("cpu") if backend == "triton" else contextlib.nullcontext():
        step()  # warm-up (the interpreter's first launch)
        copies = _layer_copies(step)
    assert copies == {"fwd": [], "bwd": []}, copies


@pytest.mark.parametrize("mode,dtype,window", [("separate", torch.float16, None),
                                               ("ordered", torch.float16, None),
                                               ("ordered", torch.float32, 20)])
def test_deterministic_backward(mode, dtype, window):
    """GQA dk/dv are summed over the query group without atomics: two runs are bitwise equal
    (dq too with attention_dq="separate" or "ordered")."""
    q, k, v, dout, mask = make_inputs(2, 8, 2, 50, 32, dtype, "right", seed=11)
    out, lse = attention.attention_fwd(q, k, v, mask, None, window, True, 0.2)
    with config.patch(attention_dq=mode):
        first = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, True, 0.2)
        second = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, True, 0.2)
    for a, b, name in zip(first, second, ("dq", "dk", "dv")):
        assert torch.equal(a, b), f"{name} differs between two backward runs"


def test_fully_masked_rows_are_zero():
    """Rows with nothing to attend: out 0, lse -inf, dq 0; unattended keys get dk = dv = 0."""
    B, Hq, Hkv, S, D = 2, 4, 2, 20, 16
    q, k, v, dout, _ = make_inputs(B, Hq, Hkv, S, D, torch.float32, "none", seed=5)
    mask = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    mask[0] = False          # fully padded sequence
    mask[1, :6] = False      # left padding: causal rows 0..5 see nothing
    out, lse = attention.attention_fwd(q, k, v, mask, None, None, True, D ** -0.5)
    dq, dk, dv = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, True, D ** -0.5)
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has NaN"
    assert torch.all(out[0] == 0) and torch.all(out[1, :, :6] == 0)
    assert torch.all(torch.isneginf(lse[0])) and torch.all(torch.isneginf(lse[1, :, :6]))
    assert torch.isfinite(lse[1, :, 6:]).all()
    assert torch.all(dq[0] == 0) and torch.all(dq[1, :, :6] == 0)
    assert torch.all(dk[0] == 0) and torch.all(dv[0] == 0)
    assert torch.all(dk[1, :, :6] == 0) and torch.all(dv[1, :, :6] == 0)
    assert (dq[1, :, 6:] != 0).any() and (dv[1, :, 6:] != 0).any()


def test_backward_accepts_external_minus_inf_lse():
    """A caller-provided lse with -inf rows (as the CPU reference op would give) is handled."""
    q, k, v, dout, _ = make_inputs(1, 2, 2, 8, 16, torch.float32, "none", seed=9)
    mask = torch.zeros(1, 8, dtype=torch.bool, device=DEVICE)
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, 8), float("-inf"), device=DEVICE)
    dq, dk, dv = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, False, 0.25)
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)


# ------------------------------------------------------------------------------------------
# Input validation
# ------------------------------------------------------------------------------------------
def _good(dtype=torch.float32):
    q = torch.zeros(2, 4, 8, 16, dtype=dtype, device=DEVICE)
    k = torch.zeros(2, 2, 8, 16, dtype=dtype, device=DEVICE)
    return q, k, k.clone(), None


BAD_FWD = [
    ("rank", lambda q, k, v, m: (q[0], k, v, m), ValueError, "q must have 4 dims"),
    ("hkv", lambda q, k, v, m: (q, k[:, :1].expand(2, 3, 8, 16), v[:, :1].expand(2, 3, 8, 16), m),
     ValueError, r"k must have Hkv dividing Hq=4, got Hkv=3"),
    ("dtype", lambda q, k, v, m: (q, k.half(), v, m), TypeError, "k must have the dtype of q"),
    ("int", lambda q, k, v, m: (q.long(), k.long(), v.long(), m), TypeError, "q must be float16"),
    ("vshape", lambda q, k, v, m: (q, k, v[:, :, :4], m), ValueError,
     r"v must have shape \(2, 2, 8, 16\) \(the shape of k\)"),
    ("kseq", lambda q, k, v, m: (q, k[:, :, :4], v[:, :, :4], m), ValueError,
     r"k must have at least the sequence length of q \(Sq=8\), got 4"),
    ("small_d", lambda q, k, v, m: (q[..., :8], k[..., :8], v[..., :8], m), ValueError,
     "q must have head_dim D in 16..256 for the Triton kernels, got D=8"),
    ("big_d", lambda q, k, v, m: (*(torch.zeros(*t.shape[:3], 320, device=DEVICE) for t in (q, k, v)), m),
     ValueError, "got D=320"),
    ("mask_dtype", lambda q, k, v, m: (q, k, v, torch.ones(2, 8, device=DEVICE)), TypeError,
     "key_padding_mask must be bool"),
    ("mask_shape", lambda q, k, v, m: (q, k, v, torch.ones(2, 9, dtype=torch.bool, device=DEVICE)),
     ValueError, r"key_padding_mask must have shape \(2, 8\) \(B, Sk\)"),
    ("device", lambda q, k, v, m: (q, k.to("meta"), v, m), RuntimeError,
     "k is on meta but q is on"),
]
BAD_FWD_MASKS = [  # (id, segment_ids, window, scale, exception, match)
    ("seg_dtype", torch.ones(2, 8), None, 0.25, TypeError, "segment_ids must be int32 or int64"),
    ("seg_shape", torch.ones(2, 7, dtype=torch.int64), None, 0.25, ValueError,
     r"segment_ids must have shape \(2, 8\) \(B, Sk\)"),
    ("window_0", None, 0, 0.25, ValueError, "window must be > 0"),
    ("scale_0", None, None, 0.0, ValueError, "scale must be a finite number > 0"),
    ("scale_nan", None, None, float("nan"), ValueError, "scale must be a finite number > 0"),
]


@pytest.mark.parametrize("seg,window,scale,exc,match", [b[1:] for b in BAD_FWD_MASKS],
                         ids=[b[0] for b in BAD_FWD_MASKS])
def test_forward_rejects_bad_masks(seg, window, scale, exc, match):
    q, k, v, _ = _good()
    seg = seg.to(DEVICE) if seg is not None else None
    with pytest.raises(exc, match="attention_fwd: " + match):
        attention.attention_fwd(q, k, v, None, seg, window, True, scale)
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 8, device=DEVICE)
    with pytest.raises(exc, match="attention_bwd: " + match):
        attention.attention_bwd(out, q, k, v, out, lse, None, seg, window, True, scale)


@pytest.mark.parametrize("make_bad,exc,match", [b[1:] for b in BAD_FWD], ids=[b[0] for b in BAD_FWD])
def test_forward_rejects_bad_input(make_bad, exc, match):
    with pytest.raises(exc, match=match):
        attention.attention_fwd(*make_bad(*_good()), None, None, True, 0.25)


def test_backward_rejects_bad_input():
    q, k, v, _ = _good()
    out, lse, dout = torch.zeros_like(q), torch.zeros(2, 4, 8, device=DEVICE), torch.zeros_like(q)
    bwd = attention.attention_bwd
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 4, 8, 16\) \(the shape of q\)"):
        bwd(dout[:, :2], q, k, v, out, lse, None, None, None, True, 0.25)
    with pytest.raises(TypeError, match="out must have the dtype of q"):
        bwd(dout, q, k, v, out.double(), lse, None, None, None, True, 0.25)
    with pytest.raises(TypeError, match="lse must be float32"):
        bwd(dout, q, k, v, out, lse.double(), None, None, None, True, 0.25)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 4, 8\) \(B, Hq, Sq\)"):
        bwd(dout, q, k, v, out, lse[..., :3], None, None, None, True, 0.25)
    with pytest.raises(ValueError, match="k must have Hkv dividing Hq=4, got Hkv=3"):
        kk = torch.zeros(2, 3, 8, 16, device=DEVICE)
        bwd(dout, q, kk, kk, out, lse, None, None, None, True, 0.25)


# ------------------------------------------------------------------------------------------
# GPU only: bf16 / fp16 / fp32 on CUDA, bigger shapes, autotuned configs
# ------------------------------------------------------------------------------------------
GPU_CASES = [
    (torch.bfloat16, 2, 8, 2, 1024, 128, True, "right"),
    (torch.bfloat16, 2, 16, 16, 1000, 64, True, "left"),
    (torch.bfloat16, 3, 8, 8, 257, 80, False, "full"),
    (torch.float16, 2, 8, 2, 1024, 64, True, "full"),
    (torch.float16, 1, 4, 4, 2048, 256, True, "none"),
    (torch.float16, 2, 4, 2, 127, 96, False, "right"),
    (torch.float32, 2, 4, 2, 513, 64, True, "left"),
    (torch.bfloat16, 1, 32, 8, 4096, 128, True, "none"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c) for c in GPU_CASES])
def test_accuracy_gpu(case):
    dtype, B, Hq, Hkv, S, D, causal, mask = case
    check_case(B, Hq, Hkv, S, D, dtype, causal, mask, seed=S)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:4] + GPU_CASES[6:7],
                         ids=[_case_id(c) for c in GPU_CASES[:4] + GPU_CASES[6:7]])
@config.patch(attention_dq="atomic")
def test_dq_atomic_gpu(case):
    """The atomic dQ path with the GPU's configs, bf16 / fp16 / fp32 (the one the interpreter
    cannot check for bf16)."""
    dtype, B, Hq, Hkv, S, D, causal, mask = case
    check_case(B, Hq, Hkv, S, D, dtype, causal, mask, seed=S + 2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:4] + GPU_CASES[6:7],
                         ids=[_case_id(c) for c in GPU_CASES[:4] + GPU_CASES[6:7]])
@config.patch(attention_dq="ordered")
def test_dq_ordered_gpu(case):
    """The ordered dQ sums with the GPU's configs (their waits on real concurrent programs)."""
    dtype, B, Hq, Hkv, S, D, causal, mask = case
    check_case(B, Hq, Hkv, S, D, dtype, causal, mask, seed=S + 3)


# Windows and query chunks under the ordered dQ sums on a GPU: turns that differ per block of
# rows (the window's two edges, a chunk's offset) among concurrent programs, GQA 32/8.
#                      dtype          B  Hq Hkv  S     D   causal mask     docs  window
ORDERED_GPU_CASES = [(torch.bfloat16, 1, 32, 8, 2048, 128, True, "none", None, 256),
                     (torch.float16, 2, 8, 2, 1500, 64, False, "right", None, 100)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ORDERED_GPU_CASES, ids=[_seg_win_id(c) for c in ORDERED_GPU_CASES])
@config.patch(attention_dq="ordered")
def test_dq_ordered_windows_and_chunks_gpu(case):
    """The ordered dQ sums with a sliding window, whole and in query chunks of 300 rows, with
    the GPU's configs: within the accuracy rule, and two backwards bitwise equal."""
    dtype, B, Hq, Hkv, S, D, causal, mask_kind, _, window = case
    check_case(B, Hq, Hkv, S, D, dtype, causal, mask_kind, seed=S + 4, window=window)
    check_chunks(case, 300, seed=S + 5)
    q, k, v, dout, mask = make_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed=S + 6)
    out, lse = attention.attention_fwd(q, k, v, mask, None, window, causal, D ** -0.5)
    first = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, causal,
                                    D ** -0.5)
    second = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, window, causal,
                                     D ** -0.5)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,autotune", [("separate", False), ("ordered", False),
                                           ("ordered", True)])
def test_deterministic_backward_gpu(mode, autotune):
    """Two backwards bitwise equal; ordered also under autotuning (whose timed runs must
    restore the counters, or the launch after them would wait forever)."""
    with config.patch(attention_dq=mode, autotune=autotune):
        _deterministic_backward_gpu()


def _deterministic_backward_gpu():
    q, k, v, dout, mask = make_inputs(2, 32, 8, 2048, 128, torch.bfloat16, "right", seed=1)
    out, lse = attention.attention_fwd(q, k, v, mask, None, None, True, 128 ** -0.5)
    first = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, True, 128 ** -0.5)
    second = attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, True, 128 ** -0.5)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# Regressions found by a probe (issue 16)
# ------------------------------------------------------------------------------------------
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="checks the Triton interpreter (CPU tensors)")


@interpreter_only
def test_bf16_is_refused_under_the_interpreter():
    """The interpreter's bf16 tl.dot is wrong (errors of 1e8 and more): refuse, say what to use."""
    q, k, v, _ = _good(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"bfloat16.*interpreter.*float16 or float32"):
        attention.attention_fwd(q, k, v, None, None, None, True, 0.25)
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 8)
    with pytest.raises(NotImplementedError, match=r"bfloat16.*interpreter.*ATen"):
        attention.attention_bwd(out, q, k, v, out, lse, None, None, None, True, 0.25)
    from ckpt_ext.kernels import swiglu_mlp

    x, w = torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"swiglu_fwd: bfloat16.*interpreter"):
        swiglu_mlp.swiglu_fwd(x, w, w, w.t().contiguous(), None, None, None, [], [], False)
    with pytest.raises(NotImplementedError, match=r"swiglu_bwd: bfloat16.*interpreter"):
        swiglu_mlp.swiglu_bwd(x, x, w, w, w.t().contiguous(), None, None, None, [], [], None, None,
                              [True] * 12)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_empty_sequence(masked):
    """S = 0 through the launchers and through ops.attention's autograd on the Triton path."""
    import ckpt_ext
    from ckpt_ext import use_triton

    q = torch.randn(2, 4, 0, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 0, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 2, 0, 16, device=DEVICE, requires_grad=True)
    mask = torch.ones(2, 0, dtype=torch.bool, device=DEVICE) if masked else None
    out, lse = attention.attention_fwd(q, k, v, mask, None, None, True, 0.25)
    assert out.shape == (2, 4, 0, 16) and lse.shape == (2, 4, 0)
    grads = attention.attention_bwd(out, q, k, v, out, lse, mask, None, None, True, 0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with use_triton("cpu") if DEVICE == "cpu" else contextlib.nullcontext():
        out = ckpt_ext.ops.attention(q, k, v, key_padding_mask=mask)
        out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape


@interpreter_only
def test_interpreter_check_is_thread_safe(monkeypatch):
    """Two threads making the first Triton call at once: the self-check runs once at a time
    (the interpreter is not re-entrant), and every thread sees the working interpreter."""
    from ckpt_ext.kernels import _interpreter

    run = _interpreter._probe_kernel.run
    inside, overlaps = [], []

    def probe(*args, **kwargs):
        inside.append(1)
        if len(inside) > 1:
            overlaps.append(1)
            raise RuntimeError("interpreter entered by two threads")
        time.sleep(0.05)
        try:
            return run(*args, **kwargs)
        finally:
            inside.pop()

    _interpreter.interpreter_problem.cache_clear()
    monkeypatch.setattr(_interpreter._probe_kernel, "run", probe)
    barrier = threading.Barrier(4)
    results = []

    def first_call():
        barrier.wait()
        results.append(_interpreter.interpreter_problem())

    try:
        threads = [threading.Thread(target=first_call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not overlaps and results == [None] * 4, results
    finally:
        _interpreter.interpreter_problem.cache_clear()


@interpreter_only
def test_interpreter_check_does_not_cache_other_failures(monkeypatch):
    """A failure that is not the interpreter's (here a transient error) is reported without
    blaming numpy and is not remembered: the next check runs the probe again."""
    from ckpt_ext.kernels import _interpreter

    def transient(*args, **kwargs):
        raise MemoryError("transient")

    _interpreter.interpreter_problem.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(_interpreter._probe_kernel, "run", transient)
            problem = _interpreter.interpreter_problem()
            assert problem is not None and "transient" in problem and "numpy" not in problem
        assert _interpreter.interpreter_problem() is None
    finally:
        _interpreter.interpreter_problem.cache_clear()
