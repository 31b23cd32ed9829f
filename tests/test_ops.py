"""Tests of the ckpt_ext kernel ops: CPU implementations, fakes, autograd wrappers, checks.

Accuracy rule (README, "Tests"; implemented once in tests/reference.py). Each op is compared
with an independent plain-PyTorch reference from tests/reference.py, run in float64 on the same
input values; the baseline is the same plain-PyTorch code run with autograd at the test dtype
(check_vs_baseline: at most 2x outputs / 3x gradients the baseline's error). In float64 the ops
must match the reference to ~1e-12 relative (check_f64; lse, float32 by the schema, to float32
rounding).

Every op also gets torch.library.opcheck (schema, fake, autograd registration, AOT dispatch),
float64 gradcheck of the Python wrappers, and error-message tests naming the argument.
"""
import copy
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ckpt_ext  # noqa: F401
import ckpt_ext.ops as ops
from ckpt_ext import config
import reference

from reference import (F64, FACTOR_GRAD, FACTOR_OUT, SWIGLU_OUT_NAMES, allowed_matrix,
                       attention_reference, check_f64, check_swiglu_lora, check_vs_baseline,
                       magnitude, packed_segment_ids, rms_norm_reference, rope_reference,
                       swiglu_reference)

OPS = torch.ops.ckpt_ext
ALL_GRADS = [True] * 12  # swiglu_bwd needs_grad: every gradient


def leaves(*ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout, allow_unused=True)


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------
def attn_inputs(B, Hq, Hkv, S, D, dtype=torch.float32, masked=False):
    """q transposed from (B, S, Hq, D) as HF passes it (non-contiguous); k, v contiguous.
    masked: batch 0 left-padded by S // 3 (causal rows before the padding end attend nothing),
    the last batch entry fully padded."""
    q = torch.randn(B, S, Hq, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, dtype=dtype)
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[0, : S // 3] = False
        mask[-1] = False
    return q, k, v, mask


def swiglu_inputs(T, H, I, dtype=torch.float32, bias=False):
    x = torch.randn(T, H, dtype=dtype)
    ws = [torch.randn(I, H, dtype=dtype) / math.sqrt(H), torch.randn(I, H, dtype=dtype) / math.sqrt(H),
          torch.randn(H, I, dtype=dtype) / math.sqrt(I)]
    bs = [torch.randn(n, dtype=dtype) if bias else None for n in (I, I, H)]
    return x, ws, bs


def rope_inputs(B, Hq, Hkv, S, D, cos_batch, dtype=torch.float32):
    """Random cos/sin (not a real rotation): their two halves differ, as the backward must not
    assume they are equal."""
    q = torch.randn(B, S, Hq, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, dtype=dtype)
    cos = torch.randn(cos_batch, S, D, dtype=dtype)
    sin = torch.randn(cos_batch, S, D, dtype=dtype)
    return q, k, cos, sin


# ------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------
def check_attention(q, k, v, mask, causal, scale, segment_ids=None, window=None):
    """The op (forward through OPS, gradients through ops.attention) against the fp64 reference
    with the 2x/3x rule; rows with nothing to attend must give out 0, lse -inf, zero
    gradients. Returns (out, lse, (dq, dk, dv))."""
    dout = torch.randn(q.shape, dtype=q.dtype)
    out, lse = OPS.attention_fwd(q, k, v, mask, segment_ids, window, causal, scale)
    assert out.transpose(1, 2).is_contiguous() and out.dtype == q.dtype
    assert lse.is_contiguous() and lse.dtype == torch.float32
    ql, kl, vl = leaves(q, k, v)
    g = grads(ops.attention(ql, kl, vl, causal=causal, scale=scale, key_padding_mask=mask,
                            segment_ids=segment_ids, window=window), (ql, kl, vl), dout)
    r = leaves(q, k, v, dtype=F64)
    ref_out, ref_lse = attention_reference(*r, mask, causal, scale, segment_ids, window)
    ref_g = grads(ref_out, r, dout.double())
    b = leaves(q, k, v)
    base_out, base_lse = attention_reference(*b, mask, causal, scale, segment_ids, window)
    base_g = grads(base_out, b, dout)
    check_vs_baseline("out", out, base_out, ref_out, FACTOR_OUT, q.dtype)
    check_vs_baseline("lse", lse, base_lse, ref_lse, FACTOR_OUT)  # float32: its own eps
    for name, got, base, ref in zip(("dq", "dk", "dv"), g, base_g, ref_g):
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, q.dtype, magnitude(*ref_g))
    B, _, S, _ = q.shape
    empty = ~allowed_matrix(B, S, mask, causal, "cpu", segment_ids, window).any(-1)  # (B, 1, S)
    empty = empty.expand_as(lse)
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all() and (g[0][empty] == 0).all()
    assert not any(torch.isnan(t).any() for t in (out, lse, *g))
    return out, lse, g


@pytest.mark.parametrize("S", [1, 17, 129])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_attention_fp32_vs_reference(S, causal, heads, masked):
    Hq, Hkv = heads
    q, k, v, mask = attn_inputs(2, Hq, Hkv, S, 16, masked=masked)
    out, lse, g = check_attention(q, k, v, mask, causal, 0.3)
    if masked:  # fully padded sequence: out 0, lse -inf, zero gradients, no NaN
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        assert torch.isneginf(lse[-1]).all()
        assert all(torch.equal(t[-1], torch.zeros_like(t[-1])) for t in g)


# Packed documents and sliding windows. Document lengths cycle to fill S (1 = one-token
# documents; shorter than a CPU tile of 128 keys and than one of the Triton tiles); windows of 1,
# inside S, and larger than S.
#             S   document lengths     window causal heads   masked
MASK_CASES = [(1, [1], 1, True, (2, 2), False),
              (17, [5, 1, 11], None, True, (4, 2), True),
              (17, [1], None, False, (2, 2), False),
              (17, None, 1, False, (4, 2), True),
              (129, [1, 40, 3, 85], None, False, (2, 2), False),
              (129, None, 1, True, (4, 2), False),
              (127, None, 16, False, (2, 2), True),
              (129, [64, 65], 200, True, (4, 2), False),
              (129, [30, 1, 98], 12, True, (4, 1), True),
              (300, [100, 7, 150, 43], 50, True, (4, 2), True),
              (300, [130, 170], None, False, (2, 1), False)]


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: f"S{c[0]}-docs{c[1]}-w{c[2]}-"
                         f"{'causal' if c[3] else 'full'}-H{c[4][0]}/{c[4][1]}-"
                         f"{'mask' if c[5] else 'nomask'}")
def test_attention_segments_and_window_fp32(case):
    S, lengths, window, causal, (Hq, Hkv), masked = case
    q, k, v, mask = attn_inputs(2, Hq, Hkv, S, 16, masked=masked)
    ids = packed_segment_ids(2, S, lengths) if lengths else None
    check_attention(q, k, v, mask, causal, 0.3, ids, window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_segments_and_window_half(dtype):
    q, k, v, mask = attn_inputs(2, 4, 2, 129, 16, dtype=dtype, masked=True)
    ids = packed_segment_ids(2, 129, [50, 1, 7, 33], dtype=torch.int32)
    check_attention(q, k, v, mask, True, 0.25, ids, 20)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_segments_and_window_fp64_tight(causal):
    q, k, v, mask = attn_inputs(2, 4, 2, 140, 8, dtype=F64, masked=True)
    ids = packed_segment_ids(2, 140, [60, 1, 9, 70], shuffle_ids=False)
    dout = torch.randn(2, 4, 140, 8, dtype=F64)
    out, lse = OPS.attention_fwd(q, k, v, mask, ids, 33, causal, 0.4)
    grads_op = OPS.attention_bwd(dout, q, k, v, out, lse, mask, ids, 33, causal, 0.4)
    r = leaves(q, k, v)
    ref_out, ref_lse = attention_reference(*r, mask, causal, 0.4, ids, 33)
    check_f64("out", out, ref_out)
    check_f64("lse", lse, ref_lse, dtype=torch.float32)
    ref_g = grads(ref_out, r, dout)
    for name, got, ref in zip(("dq", "dk", "dv"), grads_op, ref_g):
        check_f64(name, got, ref, scale=magnitude(*ref_g))


def test_attention_segment_ids_need_not_be_contiguous_or_sorted():
    """Interleaved ids (one id in several runs) attend across runs, exactly as the dense rule."""
    q, k, v, _ = attn_inputs(2, 2, 2, 150, 16)
    ids = torch.randint(-2, 3, (2, 150))
    check_attention(q, k, v, None, True, 0.3, ids, None)
    check_attention(q, k, v, None, False, 0.3, ids.int(), 40)


def test_attention_window_at_least_s_is_no_window():
    q, k, v, mask = attn_inputs(2, 4, 2, 33, 16, masked=True)
    for m in (None, mask):
        plain = OPS.attention_fwd(q, k, v, m, None, None, True, 0.3)
        for w in (33, 34, 10**9):
            got = OPS.attention_fwd(q, k, v, m, None, w, True, 0.3)
            assert all(torch.equal(a, b) for a, b in zip(got, plain))


def test_attention_fully_masked_document():
    """A document whose keys are all padded: its rows give 0 / -inf / zero gradients."""
    q, k, v, _ = attn_inputs(2, 4, 2, 40, 16)
    ids = packed_segment_ids(2, 40, [10, 1, 29], shuffle_ids=False)
    padded = ids == 2  # the third document of each row, entirely padded
    out, lse, g = check_attention(q, k, v, ~padded, True, 0.3, ids, 7)
    rows = padded[:, None, :].expand_as(lse)
    assert rows.any() and (out[rows] == 0).all() and torch.isneginf(lse[rows]).all()
    key_rows = padded[:, None, :].expand(g[1].shape[:3])  # padded keys: no query sees them
    assert (g[0][rows] == 0).all() and (g[1][key_rows] == 0).all() and (g[2][key_rows] == 0).all()
    assert (out[~rows] != 0).any(dim=-1).all()


@pytest.mark.parametrize("causal", [True, False])
def test_attention_segments_and_window_gradcheck(causal):
    q, k, v, mask = attn_inputs(2, 4, 2, 13, 8, dtype=F64, masked=True)
    ids = packed_segment_ids(2, 13, [4, 1, 8])

    def fn(q, k, v):
        return ops.attention(q, k, v, causal=causal, key_padding_mask=mask, segment_ids=ids,
                             window=3)

    assert torch.autograd.gradcheck(fn, tuple(leaves(q, k, v)), fast_mode=True)


@pytest.mark.parametrize("S", [17, 129])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_fp64_tight(S, causal):
    q, k, v, mask = attn_inputs(2, 4, 2, S, 8, dtype=F64, masked=True)
    dout = torch.randn(2, 4, S, 8, dtype=F64)
    out, lse = OPS.attention_fwd(q, k, v, mask, None, None, causal, 0.4)
    dq, dk, dv = OPS.attention_bwd(dout, q, k, v, out, lse, mask, None, None, causal, 0.4)
    r = leaves(q, k, v)
    ref_out, ref_lse = attention_reference(*r, mask, causal, 0.4)
    check_f64("out", out, ref_out)
    check_f64("lse", lse, ref_lse, dtype=torch.float32)
    ref_g = grads(ref_out, r, dout)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g):
        check_f64(name, got, ref, scale=magnitude(*ref_g))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_vs_reference(dtype):
    S, causal = 129, True
    q, k, v, mask = attn_inputs(2, 4, 2, S, 16, dtype=dtype, masked=True)
    dout = torch.randn(2, 4, S, 16, dtype=dtype)
    out, lse = OPS.attention_fwd(q, k, v, mask, None, None, causal, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    got_g = OPS.attention_bwd(dout, q, k, v, out, lse, mask, None, None, causal, 0.25)
    r = leaves(q, k, v, dtype=F64)
    ref_out, ref_lse = attention_reference(*r, mask, causal, 0.25)
    ref_g = grads(ref_out, r, dout.double())
    b = leaves(q, k, v)
    base_out, base_lse = attention_reference(*b, mask, causal, 0.25)
    base_g = grads(base_out, b, dout)
    check_vs_baseline("out", out, base_out, ref_out, FACTOR_OUT, dtype)
    check_vs_baseline("lse", lse, base_lse, ref_lse, FACTOR_OUT)  # float32: its own eps
    for name, got, base, ref in zip(("dq", "dk", "dv"), got_g, base_g, ref_g):
        assert got.dtype == dtype
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, dtype, magnitude(*ref_g))


@pytest.mark.parametrize("S", [1, 17])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_attention_gradcheck(S, causal, masked):
    q, k, v, mask = attn_inputs(2, 4, 2, S, 8, dtype=F64, masked=masked)

    def fn(q, k, v):
        return ops.attention(q, k, v, causal=causal, key_padding_mask=mask)

    # Full Jacobians at S = 1; at S = 17 the fast mode (random projections of the Jacobian)
    # keeps the test quick; test_attention_fp64_tight compares all gradients entry by entry.
    assert torch.autograd.gradcheck(fn, tuple(leaves(q, k, v)), fast_mode=S > 1)


def test_attention_default_scale():
    q, k, v, _ = attn_inputs(1, 2, 1, 9, 8)
    out, _ = OPS.attention_fwd(q, k, v, None, None, None, True, 1.0 / math.sqrt(8))
    assert torch.equal(ops.attention(q, k, v), out)


def test_attention_never_allocates_s_by_s():
    """S = 2048: the profiler records every CPU allocation of the op; none may come near the
    size of one S x S float32 score matrix (16 MiB). One thread, so that every allocation
    happens on the profiled thread."""
    S = 2048
    q, k, v, _ = attn_inputs(1, 2, 1, S, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes = []
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out, lse = OPS.attention_fwd(q, k, v, None, None, None, True, 0.25)
        sizes.append(max(e.cpu_memory_usage for e in prof.events()))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            OPS.attention_bwd(out, q, k, v, out, lse, None, None, None, True, 0.25)
        sizes.append(max(e.cpu_memory_usage for e in prof.events()))
    finally:
        torch.set_num_threads(threads)
    print(f"  largest allocation fwd {sizes[0]} B, bwd {sizes[1]} B; S x S fp32 = {S * S * 4} B")
    assert 0 < max(sizes) < S * S * 4 // 8


# ------------------------------------------------------------------------------------------
# SwiGLU MLP
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_swiglu_fp32_vs_reference(save, bias):
    x, ws, bs = swiglu_inputs(39, 96, 172, bias=bias)
    x = x.reshape(3, 13, 96)
    dy = torch.randn(3, 13, 96)
    params = [w for w in (*ws, *bs) if w is not None]

    def run(dtype, fn):
        xl, *pl = leaves(x, *params, dtype=dtype)
        it = iter(pl)
        args = [next(it) if w is not None else None for w in (*ws, *bs)]
        y = fn(xl, *args)
        return y, grads(y, [xl, *pl], dy.to(dtype))

    y, g = run(torch.float32, lambda *a: ops.swiglu_mlp(*a, save=save))
    ref_y, ref_g = run(F64, lambda *a: swiglu_reference(*a)[0])
    base_y, base_g = run(torch.float32, lambda *a: swiglu_reference(*a)[0])
    assert y.shape == x.shape
    check_vs_baseline("y", y, base_y, ref_y, FACTOR_OUT, torch.float32)
    names = ["dx", "dw_gate", "dw_up", "dw_down"] + ["db_gate", "db_up", "db_down"] * bias
    for name, got, base, ref in zip(names, g, base_g, ref_g):
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_half_vs_reference(dtype):
    x, ws, bs = swiglu_inputs(37, 96, 172, dtype=dtype, bias=True)
    dy = torch.randn(37, 96, dtype=dtype)
    y, gate, up = OPS.swiglu_fwd(x, *ws, *bs, [], [], True)
    got_g = OPS.swiglu_bwd(dy, x, *ws, *bs, [], [], None, None, ALL_GRADS)[:7]
    r = leaves(x, *ws, *bs, dtype=F64)
    ref_y, ref_gate, ref_up = swiglu_reference(*r)
    b = leaves(x, *ws, *bs)
    base_y, base_gate, base_up = swiglu_reference(*b)
    check_vs_baseline("y", y, base_y, ref_y, FACTOR_OUT, dtype)
    check_vs_baseline("gate", gate, base_gate, ref_gate, FACTOR_OUT, dtype)
    check_vs_baseline("up", up, base_up, ref_up, FACTOR_OUT, dtype)
    names = ("dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down")
    for name, got, base, ref in zip(names, got_g, grads(base_y, b, dy),
                                    grads(ref_y, r, dy.double())):
        assert got.dtype == dtype
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, dtype)


def test_swiglu_fwd_gate_up_outputs():
    x, ws, bs = swiglu_inputs(11, 96, 172, dtype=F64, bias=True)
    y, gate, up = OPS.swiglu_fwd(x, *ws, *bs, [], [], True)
    ref_y, ref_gate, ref_up = swiglu_reference(x, *ws, *bs)
    for name, got, ref in (("y", y, ref_y), ("gate", gate, ref_gate), ("up", up, ref_up)):
        check_f64(name, got, ref)
    y2, gate2, up2 = OPS.swiglu_fwd(x, *ws, *bs, [], [], False)
    assert torch.equal(y2, y) and gate2.shape == (0,) and up2.shape == (0,)


def swiglu_chunk_cap(monkeypatch, I, width, rows=64):
    """A byte cap (CKPT_EXT_CHUNK_BYTES) under which the CPU SwiGLU backward's six (rows, I)
    buffers of `width` bytes an element make chunks of `rows` rows (the forward's four: 1.5x
    that)."""
    config.update(chunk_bytes=str(6 * I * width * rows))


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_swiglu_token_chunks(save, monkeypatch):
    """A byte cap that splits T = 130 tokens into chunks (64, 64 and 2 rows in backward):
    results must match the unchunked float64 reference."""
    swiglu_chunk_cap(monkeypatch, 300, 8)
    x, ws, bs = swiglu_inputs(130, 8, 300, dtype=F64, bias=True)
    dy = torch.randn(130, 8, dtype=F64)
    y, gate, up = OPS.swiglu_fwd(x, *ws, *bs, [], [], save == "gate_up")
    saved = (gate, up) if save == "gate_up" else (None, None)
    got_g = OPS.swiglu_bwd(dy, x, *ws, *bs, [], [], *saved, ALL_GRADS)[:7]
    r = leaves(x, *ws, *bs)
    ref_y = swiglu_reference(*r)[0]
    check_f64("y", y, ref_y)
    for i, (got, ref) in enumerate(zip(got_g, grads(ref_y, r, dy))):
        check_f64(f"grad {i}", got, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_token_chunks_half(dtype, monkeypatch):
    """Chunked in half precision (chunks of 64, 64 and 2 rows): the weight gradients summed over
    chunks in float32 stay within the error bound of eager PyTorch in the same dtype."""
    swiglu_chunk_cap(monkeypatch, 3000, 4)
    x, ws, bs = swiglu_inputs(130, 8, 3000, dtype=dtype, bias=True)
    dy = torch.randn(130, 8, dtype=dtype)
    got_g = OPS.swiglu_bwd(dy, x, *ws, *bs, [], [], None, None, ALL_GRADS)[:7]
    r = leaves(x, *ws, *bs, dtype=F64)
    b = leaves(x, *ws, *bs)
    names = ("dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down")
    for name, got, base, ref in zip(names, got_g, grads(swiglu_reference(*b)[0], b, dy),
                                    grads(swiglu_reference(*r)[0], r, dy.double())):
        assert got.dtype == dtype
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_swiglu_gradcheck(save, bias, activation):
    x, ws, bs = swiglu_inputs(6, 10, 7, dtype=F64, bias=bias)
    x = x.reshape(2, 3, 10)
    args = leaves(x, *ws, *[b for b in bs if b is not None])

    def fn(x, wg, wu, wd, *b):
        return ops.swiglu_mlp(x, wg, wu, wd, *b, save=save, activation=activation)

    assert torch.autograd.gradcheck(fn, tuple(args))


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_swiglu_empty_tokens(save):
    x, ws, bs = swiglu_inputs(0, 96, 172, bias=True)
    args = leaves(x, *ws, *bs)
    y = ops.swiglu_mlp(*args, save=save)
    assert y.shape == (0, 96)
    g = grads(y, args, torch.zeros(0, 96))
    for got, ref in zip(g, args):
        assert got.shape == ref.shape and not got.any()


def test_swiglu_bad_save():
    x, ws, _ = swiglu_inputs(4, 8, 6)
    with pytest.raises(ValueError, match="save"):
        ops.swiglu_mlp(x, *ws, save="gate")


# ---- SwiGLU with LoRA adapters and needs_grad (reference: tests/reference.py) -------------


def run_swiglu_lora(args, lora, scaling, dy, save, needs=ALL_GRADS):
    """The 14 results of the CPU ops (y, dx, dW, db, dA_gate ... dB_down)."""
    y, gate, up = OPS.swiglu_fwd(*args, lora, scaling, save == "gate_up")
    saved = (gate, up) if save == "gate_up" else (None, None)
    *g, dlora = OPS.swiglu_bwd(dy, *args, lora, scaling, *saved, needs)
    assert len(dlora) == 6
    return (y, *g, *dlora)


def swiglu_lora_ref(args, lora, scaling, dy, dtype=None):
    y, *g, dlora = reference.swiglu_lora_grads(args, lora, scaling, dy, dtype)
    return (y, *g, *dlora)


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("ranks", [(4, 4, 4), (1, None, None), (None, 8, None), (None, None, 1),
                                   (8, None, 4)], ids=str)
def test_swiglu_lora_f64(ranks, save):
    args, lora, scaling, dy = reference.make_swiglu_lora(17, 24, 43, F64, F64, ranks, True)
    out = run_swiglu_lora(args, lora, scaling, dy, save)
    check_swiglu_lora(out, out, swiglu_lora_ref(args, lora, scaling, dy), exact=True)


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("dtype, lora_dtype", [(torch.bfloat16, torch.float32),
                                               (torch.float16, torch.float32),
                                               (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)],
                         ids=["bf16-a32", "f16-a32", "f32", "bf16"])
def test_swiglu_lora_vs_reference(dtype, lora_dtype, save):
    """fp32 adapters on a half-precision base (PEFT's default) and same-dtype adapters."""
    args, lora, scaling, dy = reference.make_swiglu_lora(37, 96, 172, dtype, lora_dtype,
                                                         (8, 4, 1), True)
    check_swiglu_lora(run_swiglu_lora(args, lora, scaling, dy, save),
                      swiglu_lora_ref(args, lora, scaling, dy),
                      swiglu_lora_ref(args, lora, scaling, dy, F64))


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_swiglu_lora_token_chunks(save, monkeypatch):
    """Chunks of 64, 64 and 2 rows (a byte cap): the adapter gradients summed over chunks."""
    swiglu_chunk_cap(monkeypatch, 300, 8)
    args, lora, scaling, dy = reference.make_swiglu_lora(130, 8, 300, F64, F64, (4, 1, 8), True)
    out = run_swiglu_lora(args, lora, scaling, dy, save)
    check_swiglu_lora(out, out, swiglu_lora_ref(args, lora, scaling, dy), exact=True)


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("needs", [[False] * 6 + [True] * 6, [False] * 6 + [False, True] * 3,
                                   [False] * 12, [True, False, True, False, True, False]
                                   + [True, False] * 3],
                         ids=["frozen_base", "only_B", "dx_only", "mixed"])
def test_swiglu_needs_grad(needs, save):
    """Gradients not wanted come back empty; the wanted ones equal those of a full run."""
    args, lora, scaling, dy = reference.make_swiglu_lora(33, 24, 43, torch.float32,
                                                         torch.float32, (4, 8, 2), True)
    out = run_swiglu_lora(args, lora, scaling, dy, save, needs)
    check_swiglu_lora(out, swiglu_lora_ref(args, lora, scaling, dy),
                      swiglu_lora_ref(args, lora, scaling, dy, F64), needs)
    full = run_swiglu_lora(args, lora, scaling, dy, save)
    for name, want, o, f in zip(SWIGLU_OUT_NAMES, [True, True, *needs], out, full):
        if want:
            torch.testing.assert_close(o, f, rtol=1e-6, atol=1e-6, msg=name)


def test_swiglu_frozen_base_runs_no_weight_gemm():
    """With frozen base weights no (I, H) / (H, I) weight gradient is formed: the profiler sees
    fewer matmuls than a run that wants them, and none with the dW shapes."""
    args, lora, scaling, dy = reference.make_swiglu_lora(33, 24, 43, torch.float32,
                                                         torch.float32, (4, 4, 4), False)

    def mm_count(needs):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            OPS.swiglu_bwd(dy, *args, lora, scaling, None, None, needs)
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))

    frozen, full = mm_count([False] * 6 + [True] * 6), mm_count(ALL_GRADS)
    assert full - frozen == 3, (full, frozen)


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_swiglu_mlp_frozen_weights(save):
    """swiglu_mlp with frozen weights: the backward gets needs_grad from autograd, so only dx
    is computed (no weight-gradient matmul runs) and it matches the reference."""
    x, ws, bs = swiglu_inputs(9, 12, 10, dtype=F64, bias=True)
    (xl,) = leaves(x)
    dy = torch.randn(9, 12, dtype=F64)
    y = ops.swiglu_mlp(xl, *ws, *bs, save=save)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y.backward(dy)
    n_mm = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))
    assert n_mm == (2 if save == "gate_up" else 4), n_mm   # dh, dx (+ recomputed gate, up)
    assert all(t.grad is None for t in (*ws, *bs))
    (rx,) = leaves(x)
    check_f64("dx", xl.grad, grads(swiglu_reference(rx, *ws, *bs)[0], [rx], dy)[0])


def test_swiglu_lora_gradcheck():
    """Autograd of swiglu_fwd with adapters on every projection, float64."""
    args, lora, scaling, _ = reference.make_swiglu_lora(5, 6, 7, F64, F64, (2, 1, 3), True)
    inputs = leaves(*args[:4], *[b for b in args[4:]], *lora)

    def fn(x, wg, wu, wd, bg, bu, bd, *lo):
        return OPS.swiglu_fwd(x, wg, wu, wd, bg, bu, bd, list(lo), scaling, False)[0]

    assert torch.autograd.gradcheck(fn, tuple(inputs))


def test_swiglu_lora_partial_autograd_is_a_clear_error():
    args, lora, scaling, _ = reference.make_swiglu_lora(5, 6, 7, F64, F64, (2, None, 3), False)
    lora = [t.requires_grad_() if t is not None else None for t in lora]
    args[0].requires_grad_()  # autograd records the op (the None-holding list it cannot see)
    with pytest.raises(NotImplementedError, match="adapters on only some projections"):
        OPS.swiglu_fwd(*args, lora, scaling, False)


# ------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32), (torch.float16, torch.float32)],
                         ids=["f32", "bf16", "bf16-w32", "f16-w32"])
def test_rms_norm_forward_matches_hf_exactly(dtypes):
    x_dtype, w_dtype = dtypes
    x = torch.randn(3, 5, 96, dtype=x_dtype)
    w = torch.randn(96, dtype=w_dtype)
    y = ops.rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert y.dtype == ref.dtype == torch.promote_types(x_dtype, w_dtype)
    assert torch.equal(y, ref)
    y_sum, s = ops.add_rms_norm(x, x.flip(0), w, 1e-6)
    assert torch.equal(s, x + x.flip(0)) and torch.equal(y_sum, rms_norm_reference(x + x.flip(0), w, 1e-6))


def test_rms_norm_backward_fp32_vs_reference():
    x = torch.randn(4, 7, 96) * 3
    w = torch.randn(96)
    dy = torch.randn(4, 7, 96)
    xl, wl = leaves(x, w)
    g = grads(ops.rms_norm(xl, wl, 1e-5), (xl, wl), dy)
    r = leaves(x, w, dtype=F64)
    ref_g = grads(rms_norm_reference(*r, 1e-5), r, dy.double())
    b = leaves(x, w)
    base_g = grads(rms_norm_reference(*b, 1e-5), b, dy)
    for name, got, base, ref in zip(("dx", "dweight"), g, base_g, ref_g):
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, torch.float32)


def test_rms_norm_gradcheck():
    x, w = leaves(torch.randn(2, 3, 10, dtype=F64), torch.randn(10, dtype=F64))
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w))
    x1 = leaves(torch.randn(10, dtype=F64))[0]  # rank 1
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x1, w))


ROUNDINGS = [(1.0, True), (0.0, True), (1.0, False)]   # Gemma, OLMo-2, offset alone


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=["gemma", "olmo2", "offset"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)],
                         ids=["f32", "bf16", "bf16-w32"])
def test_rms_norm_family_rounding_matches_hf_exactly(rounding, dtypes):
    """offset / cast_last: bit for bit the families' own formulas, and bf16 rounding that the
    other rounding misses (so neither option is a no-op)."""
    offset, cast_last = rounding
    x_dtype, w_dtype = dtypes
    x = torch.randn(3, 5, 96, dtype=x_dtype) * 2
    w = (0.3 * torch.randn(96)).to(w_dtype)
    y = ops.rms_norm(x, w, 1e-6, offset=offset, cast_last=cast_last)
    ref = reference.family_rms_norm_reference(x, w, 1e-6, offset, cast_last)
    assert y.dtype == ref.dtype
    assert torch.equal(y, ref)
    if x_dtype == torch.bfloat16:
        other = reference.family_rms_norm_reference(x, w, 1e-6, offset, not cast_last)
        assert not torch.equal(y.to(other.dtype), other)
        assert not torch.equal(y, reference.family_rms_norm_reference(x, w, 1e-6, 1 - offset,
                                                                       cast_last))


def test_rms_norm_family_rounding_matches_transformers_modules():
    """Against the transformers modules themselves (Gemma: 1 + w cast last; OLMo-2: w cast
    last): forward bit for bit in bf16 and fp32, gradients within the rule against the module
    in fp64."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    for cls, offset in ((GemmaRMSNorm, 1.0), (Olmo2RMSNorm, 0.0)):
        norm = cls(80, eps=1e-6)
        with torch.no_grad():   # Gemma stores w - 1 (zeros at init), OLMo-2 w
            norm.weight.copy_(0.2 * torch.randn(80) + (1.0 - offset))
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(4, 9, 80) * 3).to(dtype)
            assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6, offset=offset,
                                            cast_last=True), norm(x)), (cls.__name__, dtype)
        x, dy = torch.randn(4, 9, 80) * 3, torch.randn(4, 9, 80, dtype=F64)
        xl, wl = leaves(x, norm.weight.detach())
        g = grads(ops.rms_norm(xl, wl, 1e-6, offset=offset, cast_last=True), (xl, wl),
                  dy.float())
        results = {}
        for dt in (torch.float32, F64):
            module = copy.deepcopy(norm).to(dt)
            xm = x.to(dt).requires_grad_()
            results[dt] = grads(module(xm), (xm, module.weight), dy.to(dt))
        for name, got, base, ref in zip(("dx", "dweight"), g, results[torch.float32],
                                        results[F64]):
            check_vs_baseline(name, got, base, ref, FACTOR_GRAD, torch.float32)


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=["gemma", "olmo2", "offset"])
def test_rms_norm_family_rounding_gradcheck(rounding):
    offset, cast_last = rounding
    x, w = leaves(torch.randn(2, 3, 10, dtype=F64), torch.randn(10, dtype=F64))
    assert torch.autograd.gradcheck(
        lambda x, w: ops.rms_norm(x, w, 1e-6, offset=offset, cast_last=cast_last), (x, w))


def test_rms_norm_rounding_arguments_are_checked():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(TypeError, match="rms_norm: offset must be a finite number"):
        ops.rms_norm(x, w, 1e-6, offset=float("nan"))
    with pytest.raises(TypeError, match="rms_norm: offset must be a finite number"):
        ops.rms_norm(x, w, 1e-6, offset=True)
    with pytest.raises(TypeError, match="rms_norm: cast_last must be a bool"):
        ops.rms_norm(x, w, 1e-6, cast_last=1)


def test_add_rms_norm_gradcheck():
    x, r, w = leaves(torch.randn(2, 3, 10, dtype=F64), torch.randn(2, 3, 10, dtype=F64),
                     torch.randn(10, dtype=F64))
    assert torch.autograd.gradcheck(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6), (x, r, w))


# ------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cos_batch", [1, 3])
def test_rope_fp32_vs_reference(cos_batch):
    q, k, cos, sin = rope_inputs(3, 4, 2, 17, 16, cos_batch)
    dq_out, dk_out = torch.randn(3, 4, 17, 16), torch.randn(3, 2, 17, 16)
    ql, kl = leaves(q, k)
    q_out, k_out = ops.rope(ql, kl, cos, sin)
    assert q_out.stride() == q.stride() and k_out.is_contiguous()   # the inputs' layouts
    g = torch.autograd.grad((q_out, k_out), (ql, kl), (dq_out, dk_out))
    r = leaves(q, k, dtype=F64)
    ref = rope_reference(*r, cos.double(), sin.double())
    ref_g = torch.autograd.grad(ref, r, (dq_out.double(), dk_out.double()))
    b = leaves(q, k)
    base = rope_reference(*b, cos, sin)
    base_g = torch.autograd.grad(base, b, (dq_out, dk_out))
    for name, got, bs, rf, f in (("q_out", q_out, base[0], ref[0], FACTOR_OUT),
                                 ("k_out", k_out, base[1], ref[1], FACTOR_OUT),
                                 ("dq", g[0], base_g[0], ref_g[0], FACTOR_GRAD),
                                 ("dk", g[1], base_g[1], ref_g[1], FACTOR_GRAD)):
        check_vs_baseline(name, got, bs, rf, f, torch.float32)


@pytest.mark.parametrize("layout", ["bshd_view", "last_dim_strided"])
def test_rope_keeps_its_input_layout(layout):
    """A (B, H, S, D) view of (B, S, H, D) memory comes back as one (outputs and gradients), so
    the decoder layer merges heads with views; a last dim that is not unit-strided comes back
    contiguous. The values do not depend on the layout, and the fakes (torch.compile) give
    the strides the op returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, Hq, Hkv, S, D = 2, 4, 2, 7, 8
    q, k, cos, sin = rope_inputs(B, Hq, Hkv, S, D, 1)
    q, k = q.contiguous(), k.contiguous()
    if layout == "bshd_view":
        qv, kv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
        want = [qv.stride(), kv.stride()]
        assert want[0] == (S * Hq * D, D, Hq * D, 1)
    else:
        qv, kv = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q, k))
        want = [q.stride(), k.stride()]   # contiguous
        assert qv.stride(-1) != 1
    for op in ("rope_fwd", "rope_bwd"):
        fn = getattr(torch.ops.ckpt_ext, op)
        outs, ref = fn(qv, kv, cos, sin), fn(q, k, cos, sin)
        assert [t.stride() for t in outs] == want, op
        for got, r in zip(outs, ref):
            assert torch.equal(got, r), op
        with FakeTensorMode() as mode:
            fake = fn(*(mode.from_tensor(t) for t in (qv, kv, cos, sin)))
        assert [t.stride() for t in fake] == want, op


@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_gradcheck(cos_batch):
    q, k, cos, sin = rope_inputs(2, 4, 2, 5, 6, cos_batch, dtype=F64)
    assert torch.autograd.gradcheck(lambda q, k: ops.rope(q, k, cos, sin), tuple(leaves(q, k)))


def test_rope_half_rounds_once():
    """bf16: computed in float32 and rounded once, so exactly the float32 result rounded."""
    q, k, cos, sin = rope_inputs(2, 4, 2, 9, 8, 1, dtype=torch.bfloat16)
    q_out, k_out = ops.rope(q, k, cos, sin)
    ref_q, ref_k = rope_reference(q.float(), k.float(), cos.float(), sin.float())
    assert torch.equal(q_out, ref_q.bfloat16()) and torch.equal(k_out, ref_k.bfloat16())


def partial_rope_reference(q, k, cos, sin):
    """HF Phi-3's apply_rotary_pos_emb, written out: the first R = cos.shape[-1] dims of a head
    rotate (rotate_half within them, pairing i with i + R/2), the other D - R pass through."""
    r = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def one(t):
        rot, rest = t[..., :r], t[..., r:]
        half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], -1)
        return torch.cat([rot * c + half * s, rest], -1)
    return one(q), one(k)


@pytest.mark.parametrize("D,R", [(48, 24), (48, 48), (40, 12), (6, 2), (8, 0)])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_partial_rope_vs_reference(D, R, dtype):
    """cos/sin of width R < D (partial_rotary_factor): forward and backward against the fp64
    plain-PyTorch reference (float64 to 1e-12, float32 by the 2x/3x rule); the last D - R dims
    are copied exactly, gradients included."""
    B, Hq, Hkv, S = 2, 3, 1, 11
    q, k, cos, sin = rope_inputs(B, Hq, Hkv, S, D, 1, dtype=dtype)
    cos, sin = cos[..., :R].contiguous(), sin[..., :R].contiguous()
    dq_out, dk_out = torch.randn(B, Hq, S, D, dtype=dtype), torch.randn(B, Hkv, S, D, dtype=dtype)
    ql, kl = leaves(q, k)
    out = ops.rope(ql, kl, cos, sin)
    g = torch.autograd.grad(out, (ql, kl), (dq_out, dk_out))
    r = leaves(q, k, dtype=F64)
    ref = partial_rope_reference(*r, cos.double(), sin.double())
    ref_g = torch.autograd.grad(ref, r, (dq_out.double(), dk_out.double()))
    for t, d in ((out[0], q), (out[1], k), (g[0], dq_out), (g[1], dk_out)):
        assert torch.equal(t[..., R:], d[..., R:])  # passed through untouched
    if dtype == F64:
        for name, got, want in zip(("q_out", "k_out", "dq", "dk"), (*out, *g), (*ref, *ref_g)):
            check_f64(name, got, want)
        return
    b = leaves(q, k)
    base = partial_rope_reference(*b, cos, sin)
    base_g = torch.autograd.grad(base, b, (dq_out, dk_out))
    for name, got, bs, rf, f in (("q_out", out[0], base[0], ref[0], FACTOR_OUT),
                                 ("k_out", out[1], base[1], ref[1], FACTOR_OUT),
                                 ("dq", g[0], base_g[0], ref_g[0], FACTOR_GRAD),
                                 ("dk", g[1], base_g[1], ref_g[1], FACTOR_GRAD)):
        check_vs_baseline(name, got, bs, rf, f, torch.float32)


def test_partial_rope_fake_and_errors():
    q, k, cos, sin = rope_inputs(2, 4, 2, 5, 8, 1)
    torch.library.opcheck(OPS.rope_fwd.default, (q, k, cos[..., :4], sin[..., :4]))
    torch.library.opcheck(OPS.rope_bwd.default, (q, k, cos[..., :6], sin[..., :6]))
    with pytest.raises(ValueError, match=r"rope_fwd: cos must be \(B or 1, S, R\) with an even "
                       r"rotary width R <= D=8, got shape \(1, 5, 3\)"):
        OPS.rope_fwd(q, k, cos[..., :3], sin[..., :3])
    wide = torch.randn(1, 5, 10)
    with pytest.raises(ValueError, match=r"rope_bwd: cos must be .*R <= D=8"):
        OPS.rope_bwd(q, k, wide, wide)
    from torch._subclasses.fake_tensor import FakeTensorMode
    odd = [t.contiguous() for t in (q, k, cos[..., :5], sin[..., :5])]
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="even rotary width"):
        OPS.rope_fwd(*(mode.from_tensor(t) for t in odd))


def test_rope_cos_requiring_grad_is_an_error():
    q, k, cos, sin = rope_inputs(1, 2, 1, 3, 4, 1)
    q.requires_grad_()
    cos.requires_grad_()
    q_out, _ = ops.rope(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="cos"):
        q_out.sum().backward()


# ------------------------------------------------------------------------------------------
# Double backward
# ------------------------------------------------------------------------------------------
def test_double_backward_is_a_clear_error():
    q, k, v = leaves(*attn_inputs(1, 2, 1, 5, 4, dtype=F64)[:3])
    (dq,) = torch.autograd.grad(ops.attention(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


# ------------------------------------------------------------------------------------------
# opcheck: schema, fake tensors, autograd registration, AOT dispatch
# ------------------------------------------------------------------------------------------
def _opcheck_samples():
    """(op name, args) covering optional arguments present and absent, small fp32 shapes."""
    samples = []
    ids = torch.tensor([[3, 3, 1, 1, 1], [0, 5, 5, 5, 5]])
    for masked, seg, window in ((False, None, None), (True, None, None), (False, ids, None),
                                (True, None, 2), (True, ids.int(), 2)):
        q, k, v, mask = attn_inputs(2, 4, 2, 5, 8, masked=masked)
        for causal in (True, False):
            samples.append(("attention_fwd", (*leaves(q, k, v), mask, seg, window, causal, 0.3)))
            out, lse = OPS.attention_fwd(q, k, v, mask, seg, window, causal, 0.3)
            samples.append(("attention_bwd", (torch.randn_like(out), q, k, v, out, lse, mask,
                                              seg, window, causal, 0.3)))
            qc = q[:, :, 2:4]  # a query chunk at positions 2, 3; dk / dv accumulated
            samples.append(("attention_fwd", (*leaves(qc, k, v), mask, seg, window, causal, 0.3,
                                              2)))
            out, lse = OPS.attention_fwd(qc, k, v, mask, seg, window, causal, 0.3, 2)
            samples.append(("attention_bwd", (torch.randn_like(out), qc, k, v, out, lse, mask,
                                              seg, window, causal, 0.3, 2,
                                              torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))))
    for bias in (False, True):
        x, ws, bs = swiglu_inputs(7, 12, 10, bias=bias)
        for gate_up in (False, True):
            samples.append(("swiglu_fwd", (*leaves(x, *ws), *(leaves(b)[0] if bias else None
                                                               for b in bs), [], [], gate_up)))
        _, gate, up = OPS.swiglu_fwd(x, *ws, *bs, [], [], True)
        for saved in ((None, None), (gate, up)):
            samples.append(("swiglu_bwd", (torch.randn(7, 12), x, *ws, *bs, [], [], *saved,
                                            ALL_GRADS)))
    for ranks, needs in (((2, 3, 1), ALL_GRADS), ((None, 4, None), [False] * 6 + [True] * 6),
                         ((2, None, 5), [True, False] * 6)):
        args, lora, scaling, dy = reference.make_swiglu_lora(7, 12, 10, torch.float32,
                                                             torch.float32, ranks, True)
        grad_lora = leaves(*lora) if None not in lora else lora  # partial lists: not tracked
        samples.append(("swiglu_fwd", (*leaves(*args), grad_lora, scaling, False)))
        _, gate, up = OPS.swiglu_fwd(*args, lora, scaling, True)
        for saved in ((None, None), (gate, up)):
            samples.append(("swiglu_bwd", (dy, *args, lora, scaling, *saved, needs)))
    # activation="gelu_tanh" (GeGLU), with every trailing argument given (gate and up share a
    # dropout stream, as a fused gate_up_proj)
    args, lora, scaling, dy = reference.make_swiglu_lora(7, 12, 10, torch.float32,
                                                         torch.float32, (2, 3, 1), True)
    drop = ([0.2, 0.0, 0.3], torch.tensor(5), 3, [4, 4, 6], "gelu_tanh")
    for gate_up in (False, True):
        samples.append(("swiglu_fwd", (*leaves(*args), leaves(*lora), scaling, gate_up, *drop)))
    _, gate, up = OPS.swiglu_fwd(*args, lora, scaling, True, *drop)
    for saved in ((None, None), (gate, up)):
        samples.append(("swiglu_bwd", (dy, *args, lora, scaling, *saved, ALL_GRADS, *drop)))
    # the weight gradients added to sums over token chunks (the fused layer's chunks)
    sums = (torch.randn(10, 12), torch.randn(10, 12), torch.randn(12, 10))
    samples.append(("swiglu_bwd", (dy, *args, lora, scaling, None, None, ALL_GRADS, *drop,
                                   *sums, 1.0)))
    x, w = torch.randn(2, 3, 12), torch.randn(12)
    samples.append(("rms_norm_fwd", (*leaves(x, w), 1e-6)))
    samples.append(("rms_norm_bwd", (torch.randn(2, 3, 12), x, w, 1e-6)))
    samples.append(("add_rms_norm_fwd", (*leaves(x, torch.randn(2, 3, 12), w), 1e-6)))
    for cos_batch in (1, 2):
        q, k, cos, sin = rope_inputs(2, 4, 2, 5, 8, cos_batch)
        samples.append(("rope_fwd", (*leaves(q, k), cos, sin)))
        samples.append(("rope_bwd", (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), cos, sin)))
    return samples


def test_opcheck_covers_every_kernel_op():
    names = {name for name, _ in _opcheck_samples()}
    assert names == {"attention_fwd", "attention_bwd", "swiglu_fwd", "swiglu_bwd", "rms_norm_fwd",
                     "rms_norm_bwd", "add_rms_norm_fwd", "rope_fwd", "rope_bwd"}


@pytest.mark.parametrize("sample", range(len(_opcheck_samples())))
def test_opcheck(sample):
    name, args = _opcheck_samples()[sample]
    torch.library.opcheck(getattr(OPS, name).default, args)


# ------------------------------------------------------------------------------------------
# Input checks: the error names the argument, from the C++ op (cpu) and from the fake (meta)
# ------------------------------------------------------------------------------------------
def _attn_args(device, **change):
    q, k, v, mask = attn_inputs(2, 4, 2, 5, 8, masked=True)
    args = dict(q=q, k=k, v=v, mask=mask)
    args.update(change)
    return [t.to(device) if t is not None else None for t in
            (args["q"], args["k"], args["v"], args["mask"])] + [None, None, True, 0.3]


def _attn_bwd_args(device, q_offset=2, **change):
    """attention_bwd arguments of a 3-row query chunk at q_offset 2 of S = 5 keys, with
    accumulators; `change` replaces lse, dk_acc or dv_acc."""
    q, k, v, mask = attn_inputs(2, 4, 2, 5, 8, masked=True)
    q = q[:, :, 2:]
    args = dict(lse=torch.zeros(2, 4, 3), dk_acc=torch.zeros(2, 2, 5, 8),
                dv_acc=torch.zeros(2, 2, 5, 8))
    args.update(change)
    to = [t.to(device) if t is not None else None for t in (q, k, v, mask, args["lse"],
                                                             args["dk_acc"], args["dv_acc"])]
    q, k, v, mask, lse, dk_acc, dv_acc = to
    return [q, q, k, v, q, lse, mask, None, None, True, 0.3, q_offset, dk_acc, dv_acc]


def _swiglu_lora_args(device, change, scaling=(1.0, 0.5, 2.0), lora_len=6):
    """swiglu_fwd arguments (T 5, H 8, I 6, rank 2 on every projection), some adapters
    replaced (index into the lora list -> tensor or None)."""
    x, ws, _ = swiglu_inputs(5, 8, 6)
    lora = [torch.randn(2, 8), torch.randn(6, 2), torch.randn(2, 8), torch.randn(6, 2),
            torch.randn(2, 6), torch.randn(8, 2)]
    for i, t in change.items():
        lora[i] = t
    lora = [t.to(device) if t is not None else None for t in lora[:lora_len]]
    return [x.to(device), *[w.to(device) for w in ws], None, None, None, lora, list(scaling),
            False]


ERROR_CASES = [
    # (op, args builder (device -> args), exception, match)
    ("attention_fwd", lambda d: _attn_args(d, k=torch.randn(2, 2, 5, 8, dtype=F64)), TypeError,
     "attention_fwd: k must have the dtype of q"),
    ("attention_fwd", lambda d: _attn_args(d, q=torch.randn(4, 5, 8)), ValueError,
     r"attention_fwd: q must have 4 dims \(B, Hq, Sq, D\), got shape \(4, 5, 8\)"),
    ("attention_fwd", lambda d: _attn_args(d, k=torch.randn(2, 3, 5, 8), v=torch.randn(2, 3, 5, 8)),
     ValueError, "attention_fwd: k must have Hkv dividing Hq=4, got Hkv=3"),
    ("attention_fwd", lambda d: _attn_args(d, k=torch.randn(2, 2, 4, 8)), ValueError,
     r"attention_fwd: k must have at least the sequence length of q \(Sq=5\), got 4"),
    ("attention_fwd", lambda d: _attn_args(d, k=torch.randn(2, 2, 6, 8)), ValueError,
     r"attention_fwd: v must have shape \(2, 2, 6, 8\)"),
    ("attention_fwd", lambda d: _attn_args(d) + [1], ValueError,
     r"attention_fwd: q_offset must satisfy 0 <= q_offset and q_offset \+ Sq <= Sk .* got "
     r"q_offset=1 with Sq=5, Sk=5"),
    ("attention_fwd", lambda d: _attn_args(d) + [-1], ValueError,
     "attention_fwd: q_offset must satisfy 0 <= q_offset .* got q_offset=-1"),
    ("attention_fwd", lambda d: _attn_args(d, q=torch.randn(2, 4, 3, 8)) + [3], ValueError,
     "attention_fwd: q_offset must satisfy .* got q_offset=3 with Sq=3, Sk=5"),
    ("attention_bwd", lambda d: _attn_bwd_args(d, q_offset=3), ValueError,
     "attention_bwd: q_offset must satisfy .* got q_offset=3 with Sq=3, Sk=5"),
    ("attention_bwd", lambda d: _attn_bwd_args(d, lse=torch.zeros(2, 4, 5, device=d)), ValueError,
     r"attention_bwd: lse must have shape \(2, 4, 3\) \(B, Hq, Sq\)"),
    ("attention_bwd", lambda d: _attn_bwd_args(d, dv_acc=None), ValueError,
     "attention_bwd: dk_acc and dv_acc must be given together or both left out, got dk_acc "
     "given and dv_acc absent"),
    ("attention_bwd", lambda d: _attn_bwd_args(d, dk_acc=torch.zeros(2, 2, 3, 8, device=d)),
     ValueError, r"attention_bwd: dk_acc must have shape \(2, 2, 5, 8\) \(B, Hkv, Sk, D\), got "
     r"\(2, 2, 3, 8\)"),
    ("attention_bwd", lambda d: _attn_bwd_args(d, dv_acc=torch.zeros(2, 2, 5, 8, device=d,
                                                                     dtype=torch.float16)),
     TypeError, r"attention_bwd: dv_acc must be float32 \(or float64 when q is float64\), got "
     "float16"),
    ("attention_fwd", lambda d: _attn_args(d, v=torch.randn(2, 2, 5, 7)), ValueError,
     r"attention_fwd: v must have shape \(2, 2, 5, 8\)"),
    ("attention_fwd", lambda d: _attn_args(d, mask=torch.ones(2, 5)), TypeError,
     "attention_fwd: key_padding_mask must be bool"),
    ("attention_fwd", lambda d: _attn_args(d, mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
     r"attention_fwd: key_padding_mask must have shape \(2, 5\)"),
    ("attention_fwd", lambda d: _attn_args(d)[:4] + [torch.ones(2, 5), None, True, 0.3],
     TypeError, "attention_fwd: segment_ids must be int32 or int64, got float32"),
    ("attention_fwd", lambda d: _attn_args(d)[:4] + [torch.ones(2, 4, dtype=torch.int64,
                                                                 device=d), None, True, 0.3],
     ValueError, r"attention_fwd: segment_ids must have shape \(2, 5\) \(B, Sk\), got \(2, 4\)"),
    ("attention_fwd", lambda d: _attn_args(d)[:4] + [None, 0, True, 0.3],
     ValueError, "attention_fwd: window must be > 0"),
    ("attention_bwd", lambda d: [torch.randn(2, 4, 5, 8, device=d), *_attn_args(d)[:3],
                                 torch.randn(2, 4, 5, 8, device=d),
                                 torch.randn(2, 4, 5, device=d), None, None, -3, True, 0.3],
     ValueError, "attention_bwd: window must be > 0"),
    ("attention_fwd", lambda d: _attn_args(d, q=torch.randn(0, 4, 5, 8), k=torch.randn(0, 2, 5, 8),
                                           v=torch.randn(0, 2, 5, 8), mask=None),
     ValueError, "attention_fwd: q has an empty batch"),
    ("attention_bwd", lambda d: [torch.randn(2, 4, 5, 8, device=d), *_attn_args(d)[:3],
                                 torch.randn(2, 4, 5, 8, device=d),
                                 torch.randn(2, 4, 5, device=d, dtype=F64), None, None, None,
                                 True, 0.3],
     TypeError, "attention_bwd: lse must be float32"),
    ("swiglu_fwd", lambda d: [torch.randn(5, 8, device=d), torch.randn(6, 8, device=d),
                              torch.randn(6, 8, device=d, dtype=F64), torch.randn(8, 6, device=d),
                              None, None, None, [], [], False],
     TypeError, "swiglu_fwd: w_up must have the dtype of x"),
    ("swiglu_fwd", lambda d: [torch.randn(5, 8, device=d), torch.randn(6, 8, device=d),
                              torch.randn(6, 8, device=d), torch.randn(8, 7, device=d),
                              None, None, None, [], [], False],
     ValueError, r"swiglu_fwd: w_down must have shape \(8, 6\)"),
    ("swiglu_fwd", lambda d: [torch.randn(2, 5, 8, device=d), torch.randn(6, 8, device=d),
                              torch.randn(6, 8, device=d), torch.randn(8, 6, device=d),
                              None, None, None, [], [], False],
     ValueError, "swiglu_fwd: x must have 2 dims"),
    ("swiglu_fwd", lambda d: [torch.randn(5, 8, device=d), torch.randn(6, 8, device=d),
                              torch.randn(6, 8, device=d), torch.randn(8, 6, device=d),
                              torch.randn(5, device=d), None, None, [], [], False],
     ValueError, r"swiglu_fwd: b_gate must have shape \(6,\)"),
    ("swiglu_bwd", lambda d: [torch.randn(5, 8, device=d), torch.randn(5, 8, device=d),
                              torch.randn(6, 8, device=d), torch.randn(6, 8, device=d),
                              torch.randn(8, 6, device=d), None, None, None, [], [],
                              torch.randn(5, 6, device=d), None, ALL_GRADS],
     ValueError, "swiglu_bwd: gate and up must be given together"),
    ("swiglu_bwd", lambda d: [torch.randn(4, 8, device=d), torch.randn(5, 8, device=d),
                              torch.randn(6, 8, device=d), torch.randn(6, 8, device=d),
                              torch.randn(8, 6, device=d), None, None, None, [], [], None, None,
                              ALL_GRADS],
     ValueError, r"swiglu_bwd: dy must have shape \(5, 8\)"),
    ("swiglu_fwd", lambda d: _swiglu_lora_args(d, {1: None}), ValueError,
     "swiglu_fwd: lora A_gate and B_gate come together, got A_gate given and B_gate None"),
    ("swiglu_fwd", lambda d: _swiglu_lora_args(d, {4: torch.randn(2, 5)}), ValueError,
     r"swiglu_fwd: A_down must have shape \(2, 6\) \(r, in\) with in = 6, got \(2, 5\)"),
    ("swiglu_fwd", lambda d: _swiglu_lora_args(d, {3: torch.randn(6, 3)}), ValueError,
     r"swiglu_fwd: B_up must have shape \(6, 2\) \(out, r\) with out = 6 and r from A_up"),
    ("swiglu_fwd", lambda d: _swiglu_lora_args(d, {1: torch.randn(6, 2, dtype=F64)}), TypeError,
     "swiglu_fwd: B_gate must have the dtype of A_gate"),
    ("swiglu_fwd", lambda d: _swiglu_lora_args(d, {}, scaling=[1.0]), ValueError,
     "swiglu_fwd: lora_scaling must have 3 entries"),
    ("swiglu_fwd", lambda d: _swiglu_lora_args(d, {}, lora_len=4), ValueError,
     r"swiglu_fwd: lora must be \[\] or the 6 entries"),
    ("swiglu_bwd", lambda d: [torch.randn(5, 8, device=d), *_swiglu_lora_args(d, {})[:-1],
                              None, None, [True] * 11],
     ValueError, "swiglu_bwd: needs_grad must have 12 entries"),
    ("rms_norm_fwd", lambda d: [torch.randn(3, 4096, device=d), torch.randn(4095, device=d), 1e-6],
     ValueError, r"rms_norm_fwd: weight must have shape \(4096,\) to match x's last dim, got "
                 r"\(4095,\)"),
    ("rms_norm_fwd", lambda d: [torch.randn(3, 8, device=d), torch.ones(8, device=d,
                                                                       dtype=torch.int64), 1e-6],
     TypeError, "rms_norm_fwd: weight must be float16, bfloat16, float32 or float64, got int64"),
    ("rms_norm_bwd", lambda d: [torch.randn(3, 8, device=d, dtype=F64), torch.randn(3, 8, device=d),
                                torch.randn(8, device=d), 1e-6],
     TypeError, "rms_norm_bwd: dy must be float32"),
    ("add_rms_norm_fwd", lambda d: [torch.randn(3, 8, device=d), torch.randn(2, 8, device=d),
                                    torch.randn(8, device=d), 1e-6],
     ValueError, r"add_rms_norm_fwd: residual must have shape \(3, 8\)"),
    ("rope_fwd", lambda d: [torch.randn(2, 4, 5, 8, device=d), torch.randn(2, 2, 5, 8, device=d),
                            torch.randn(3, 5, 8, device=d), torch.randn(3, 5, 8, device=d)],
     ValueError, "rope_fwd: cos must have batch size 1 or B=2"),
    ("rope_fwd", lambda d: [torch.randn(2, 4, 5, 7, device=d), torch.randn(2, 2, 5, 7, device=d),
                            torch.randn(1, 5, 7, device=d), torch.randn(1, 5, 7, device=d)],
     ValueError, "rope_fwd: q must have an even head dim D, got D=7"),
    ("rope_fwd", lambda d: [torch.randn(2, 4, 5, 8, device=d), torch.randn(2, 2, 5, 8, device=d),
                            torch.randn(1, 5, 8, device=d), torch.randn(1, 6, 8, device=d)],
     ValueError, r"rope_fwd: sin must have shape \(1, 5, 8\)"),
    ("rope_bwd", lambda d: [torch.randn(2, 4, 5, 8, device=d),
                            torch.randn(2, 2, 5, 8, device=d, dtype=torch.float16),
                            torch.randn(1, 5, 8, device=d), torch.randn(1, 5, 8, device=d)],
     TypeError, "rope_bwd: dk_out must have the dtype of dq_out"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", range(len(ERROR_CASES)))
def test_error_names_argument(case, device):
    name, build, exc, match = ERROR_CASES[case]
    with pytest.raises(exc, match=match):
        getattr(OPS, name)(*build(device))


DEVICE_CASES = [
    ("attention_fwd", lambda: _attn_args("cpu")[:4] + [torch.ones(2, 5, dtype=torch.int64,
                                                                   device="meta"), None,
                                                       True, 0.3],
     "attention_fwd: segment_ids is on meta but q is on cpu"),
    ("attention_fwd", lambda: _attn_args("cpu")[:1] + _attn_args("meta")[1:2] + _attn_args("cpu")[2:],
     "attention_fwd: k is on meta but q is on cpu"),
    ("attention_fwd", lambda: _attn_args("cpu")[:3] + [torch.ones(2, 5, dtype=torch.bool,
                                                                   device="meta"), None, None,
                                                       True, 0.3],
     "attention_fwd: key_padding_mask is on meta but q is on cpu"),
    ("swiglu_fwd", lambda: [torch.randn(5, 8), torch.randn(6, 8), torch.randn(6, 8),
                            torch.randn(8, 6, device="meta"), None, None, None, [], [], False],
     "swiglu_fwd: w_down is on meta but x is on cpu"),
    ("rms_norm_fwd", lambda: [torch.randn(3, 8), torch.randn(8, device="meta"), 1e-6],
     "rms_norm_fwd: weight is on meta but x is on cpu"),
    ("rope_fwd", lambda: [torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8),
                          torch.randn(1, 5, 8, device="meta"), torch.randn(1, 5, 8)],
     "rope_fwd: cos is on meta but q is on cpu"),
]


@pytest.mark.parametrize("path", ["dispatcher", "cpu_kernel"])
@pytest.mark.parametrize("case", range(len(DEVICE_CASES)))
def test_device_mismatch_names_argument(case, path):
    """Only a CPU is guaranteed here, so the second device is `meta`. Through the dispatcher a
    CPU/meta mix may reach either kernel; `cpu_kernel` calls the C++ CPU kernel directly."""
    name, build, match = DEVICE_CASES[case]
    op = getattr(OPS, name).default
    with pytest.raises(RuntimeError, match=match):
        if path == "dispatcher":
            op(*build())
        else:
            op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *build())


# ------------------------------------------------------------------------------------------
# Regressions found by a probe (issue 16): layouts, empty sequences, bad arguments
# ------------------------------------------------------------------------------------------
def strided_last_dim(t):
    """A copy of t whose last dim has stride 2 (every other element of a wider tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    out = wide[..., ::2]
    assert out.stride(-1) == 2 and torch.equal(out, t)
    return out


@pytest.mark.parametrize("layout", ["strided_d", "transposed_k"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_non_unit_last_stride(layout, masked, causal):
    """q/k/v whose last dim is not contiguous (a column slice, or k = (B, H, D, S).mT) give the
    results and gradients of contiguous inputs, within the 2x/3x rule of the fp64 reference."""
    q, k, v, mask = attn_inputs(1, 2, 2, 19, 16, masked=masked)
    if layout == "strided_d":
        q, k, v = (strided_last_dim(t) for t in (q, k, v))
    else:
        k = k.mT.contiguous().mT
        assert k.stride(-1) != 1
    dout = torch.randn(1, 2, 19, 16)
    ql, kl, vl = leaves(q, k, v)
    out = ops.attention(ql, kl, vl, causal=causal, scale=0.3, key_padding_mask=mask)
    g = grads(out, (ql, kl, vl), dout)
    r = leaves(q, k, v, dtype=F64)
    ref_out, _ = attention_reference(*r, mask, causal, 0.3)
    ref_g = grads(ref_out, r, dout.double())
    b = leaves(q, k, v)
    base_out, _ = attention_reference(*b, mask, causal, 0.3)
    base_g = grads(base_out, b, dout)
    check_vs_baseline("out", out, base_out, ref_out, FACTOR_OUT, torch.float32)
    for name, got, base, ref in zip(("dq", "dk", "dv"), g, base_g, ref_g):
        check_vs_baseline(name, got, base, ref, FACTOR_GRAD, torch.float32, magnitude(*ref_g))


def test_swiglu_non_unit_last_stride():
    """Every input with a strided last dim: the 2x/3x rule against the fp64 reference."""
    x, ws, bs = swiglu_inputs(7, 12, 10, bias=True)
    dy = torch.randn(7, 12)
    strided = leaves(*(strided_last_dim(t) for t in (x, *ws, *bs)))
    y = ops.swiglu_mlp(*strided)
    g = grads(y, strided, dy)
    r = leaves(x, *ws, *bs, dtype=F64)
    ref = swiglu_reference(*r)[0]
    ref_g = grads(ref, r, dy.double())
    b = leaves(x, *ws, *bs)
    base = swiglu_reference(*b)[0]
    base_g = grads(base, b, dy)
    check_vs_baseline("y", y, base, ref, FACTOR_OUT, torch.float32)
    for got, bg, rg in zip(g, base_g, ref_g):
        check_vs_baseline("grad", got, bg, rg, FACTOR_GRAD, torch.float32)


def test_rms_norm_and_rope_non_unit_last_stride():
    x, w, res = torch.randn(3, 5, 24), torch.randn(24), torch.randn(3, 5, 24)
    dy = torch.randn(3, 5, 24)
    for fn in (lambda x, w, r: ops.rms_norm(x, w, 1e-6),
               lambda x, w, r: ops.add_rms_norm(x, r, w, 1e-6)[0]):
        plain = leaves(x, w, res)
        strided = leaves(*(strided_last_dim(t) for t in (x, w, res)))
        want, got = fn(*plain), fn(*strided)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(grads(got, strided, dy), grads(want, plain, dy)):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    q, k, cos, sin = rope_inputs(2, 4, 2, 9, 16, 1)
    dq, dk = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    plain = leaves(q, k)
    strided = leaves(strided_last_dim(q), strided_last_dim(k))
    want = ops.rope(*plain, cos, sin)
    got = ops.rope(*strided, strided_last_dim(cos), strided_last_dim(sin))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, strided, (dq, dk)),
                    torch.autograd.grad(want, plain, (dq, dk))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Query chunks: q_offset and the dk / dv accumulators
# ------------------------------------------------------------------------------------------
def chunk_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed):
    """Fresh random q (a (B, S, Hq, D) view), k, v, dout and a key padding mask: 'left' (batch
    0 left-padded by S // 3: its first causal rows attend nothing) or 'right' (batch 0 keeps
    2 S // 3 keys, the last batch entry keeps none: rows with nothing to attend)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)

    q, k, v = rnd(B, S, Hq, D).transpose(1, 2), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    mask = None
    if mask_kind != "none":
        mask = torch.ones(B, S, dtype=torch.bool)
        if mask_kind == "left":
            mask[0, : S // 3] = False
        else:
            mask[0, 2 * S // 3:] = False
            mask[-1] = False
    return q, k, v, rnd(B, Hq, S, D), mask


#                S   Hq Hkv causal mask     documents    window
CHUNK_CASES = [(150, 4, 2, True, "left", None, None),
               (150, 2, 2, False, "right", None, None),
               (163, 4, 2, True, "none", [40, 1, 70], None),
               (150, 4, 1, True, "right", None, 33),
               (140, 2, 2, False, "none", [30, 90], 20),
               (150, 2, 2, False, "none", None, None)]


def _chunk_id(c):
    S, Hq, Hkv, causal, mask, docs, window = c
    return (f"S{S}-H{Hq}/{Hkv}-{'causal' if causal else 'full'}-{mask}"
            f"{'-docs' if docs else ''}{f'-w{window}' if window else ''}")


@pytest.mark.parametrize("rows", [1, 17, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, F64], ids=str)
@pytest.mark.parametrize("case", CHUNK_CASES, ids=[_chunk_id(c) for c in CHUNK_CASES])
def test_attention_query_chunks(case, dtype, rows):
    """Queries split into chunks of `rows` (q_offset = the chunk's first row) against all the
    keys: out / lse / dq concatenated and dk / dv summed in the accumulators equal the one-call
    result (the accumulators in fp32 within a few ulps of one chunk holding every row), pass the
    accuracy rule against float64, and rows with nothing to attend give 0 / -inf / 0."""
    S, Hq, Hkv, causal, mask_kind, docs, window = case
    B, D, scale = 2, 16, 0.3
    q, k, v, dout, mask = chunk_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed=S + rows)
    ids = packed_segment_ids(B, S, docs) if docs else None
    acc = F64 if dtype == F64 else torch.float32
    args = (q, k, v, dout, mask, causal, scale, ids, window)
    fwd, bwd = OPS.attention_fwd, OPS.attention_bwd
    got = reference.attention_in_chunks(fwd, bwd, *args, rows, acc)
    # The one-call results on the tiles that the chunks run on: an all-True padding mask keeps
    # the unmasked forward off ATen's flash kernel (which serves whole sequences only).
    tiles = torch.ones(B, S, dtype=torch.bool) if mask is None else mask
    whole_acc = reference.attention_in_chunks(fwd, bwd, q, k, v, dout, tiles, causal, scale, ids,
                                              window, S, acc)  # one chunk, accumulated
    out, lse = fwd(q, k, v, tiles, ids, window, causal, scale)
    whole = dict(out=out, lse=lse)
    whole["dq"], whole["dk"], whole["dv"] = bwd(dout, q, k, v, out, lse, tiles, ids, window,
                                                causal, scale)
    # Chunked vs whole: the same sums in another order (key tiles start where a chunk's keys
    # start), within a few ulps of the sums of their terms' absolute values. float16: out is
    # rounded to float16 (1 ulp), and the backward's rowsum(dO * O) reads that rounded out, so
    # dk / dv differ at float16's eps too.
    sums = reference.attention_abs_sums(q, k, v, dout, mask, causal, scale, ids, window)
    reference.check_close_ulps("lse", got["lse"], whole["lse"], 4)
    ulps = 1 if dtype == torch.float16 else 8
    for name in ("out", "dq"):
        reference.check_close_ulps(name, got[name], whole[name], ulps, dtype, sums[name])
    for name in ("dk", "dv"):
        reference.check_close_ulps(name, got[name], whole_acc[name], ulps,
                                   torch.float16 if dtype == torch.float16 else acc, sums[name])
        assert torch.equal(whole_acc[name].to(dtype), whole[name]), name  # one chunk: same sums
    # Against the float64 reference.
    r = leaves(q, k, v, dtype=F64)
    ref_out, ref_lse = attention_reference(*r, mask, causal, scale, ids, window)
    ref_g = dict(zip(("dq", "dk", "dv"), grads(ref_out, r, dout.double())))
    if dtype == F64:
        check_f64("out", got["out"], ref_out)
        check_f64("lse", got["lse"], ref_lse, dtype=torch.float32)
        for name in ("dq", "dk", "dv"):
            check_f64(name, got[name], ref_g[name], scale=magnitude(*ref_g.values()))
    else:
        b = leaves(q, k, v)
        base_out, base_lse = attention_reference(*b, mask, causal, scale, ids, window)
        base_g = dict(zip(("dq", "dk", "dv"), grads(base_out, b, dout)))
        base_lse = attention_reference(*leaves(q, k, v, dtype=torch.float32), mask, causal,
                                       scale, ids, window)[1]
        check_vs_baseline("out", got["out"], base_out, ref_out, FACTOR_OUT, dtype)
        check_vs_baseline("lse", got["lse"], base_lse, ref_lse, FACTOR_OUT)
        for name in ("dq", "dk", "dv"):
            check_vs_baseline(name, got[name], base_g[name], ref_g[name], FACTOR_GRAD, dtype,
                              magnitude(*ref_g.values()))
    empty = ~allowed_matrix(B, S, mask, causal, "cpu", ids, window).any(-1)  # (B, 1, S)
    empty = empty.expand_as(got["lse"])
    if mask_kind != "none":
        assert empty.any()
    assert torch.isneginf(got["lse"][empty]).all() and (got["out"][empty] == 0).all()
    assert (got["dq"][empty] == 0).all()
    assert not any(torch.isnan(t).any() for t in got.values())


def test_attention_q_offset_through_ops_attention():
    """ops.attention(q_offset=...) on a chunk: its gradients are the chunk's share."""
    q, k, v, dout, mask = chunk_inputs(2, 4, 2, 40, 8, F64, "left", seed=3)
    ql, kl, vl = leaves(q[:, :, 25:], k, v)
    out = ops.attention(ql, kl, vl, key_padding_mask=mask, q_offset=25)
    g = grads(out, (ql, kl, vl), dout[:, :, 25:])
    ref_out = attention_reference(*leaves(q, k, v), mask, True, 8 ** -0.5)[0][:, :, 25:]
    check_f64("out", out, ref_out)
    r = leaves(q, k, v)
    ref_out = attention_reference(*r, mask, True, 8 ** -0.5)[0]
    ref_g = grads(ref_out[:, :, 25:], r, dout[:, :, 25:])
    for name, got, ref in zip(("dq", "dk", "dv"), g, (ref_g[0][:, :, 25:], *ref_g[1:])):
        check_f64(name, got, ref, scale=magnitude(*ref_g))


def test_attention_query_chunks_fakes():
    """The fakes give the chunk's shapes and the (0,) placeholders, under FakeTensorMode and
    through torch.compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, dout, mask = chunk_inputs(2, 4, 2, 30, 8, torch.float32, "right", seed=1)
    qc, dc = q[:, :, 10:21], dout[:, :, 10:21]
    dk_acc, dv_acc = (torch.zeros(2, 2, 30, 8) for _ in range(2))
    real_out, real_lse = OPS.attention_fwd(qc, k, v, mask, None, 5, True, 0.3, 10)
    real = OPS.attention_bwd(dc, qc, k, v, real_out, real_lse, mask, None, 5, True, 0.3, 10,
                             dk_acc.clone(), dv_acc.clone())
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in (qc, k, v, dc, mask, dk_acc, dv_acc)]
        out, lse = OPS.attention_fwd(f[0], f[1], f[2], f[4], None, 5, True, 0.3, 10)
        dq, dk, dv = OPS.attention_bwd(f[3], f[0], f[1], f[2], out, lse, f[4], None, 5, True,
                                       0.3, 10, f[5], f[6])
        plain = OPS.attention_bwd(f[3], f[0], f[1], f[2], out, lse, f[4], None, 5, True, 0.3, 10)
    assert (out.shape, out.stride(), lse.shape) == (real_out.shape, real_out.stride(),
                                                    real_lse.shape)
    assert [t.shape for t in (dq, dk, dv)] == [t.shape for t in real] == [qc.shape, (0,), (0,)]
    assert [t.shape for t in plain] == [qc.shape, k.shape, v.shape]

    def chunk(qc, k, v, dc, dk_acc, dv_acc):
        out, lse = OPS.attention_fwd(qc, k, v, mask, None, 5, True, 0.3, 10)
        dq, _, _ = OPS.attention_bwd(dc, qc, k, v, out, lse, mask, None, 5, True, 0.3, 10,
                                     dk_acc, dv_acc)
        return out, dq

    eager_acc = (dk_acc.clone(), dv_acc.clone())
    compiled_acc = (dk_acc.clone(), dv_acc.clone())
    want = chunk(qc, k, v, dc, *eager_acc)
    got = torch.compile(chunk, backend="aot_eager", fullgraph=True)(qc, k, v, dc, *compiled_acc)
    for a, b in zip((*got, *compiled_acc), (*want, *eager_acc)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_attention_empty_sequence(masked, dtype):
    """S = 0: empty outputs and empty gradients, as torch's own attention gives."""
    q, k, v = leaves(torch.randn(2, 4, 0, 16, dtype=dtype), torch.randn(2, 2, 0, 16, dtype=dtype),
                     torch.randn(2, 2, 0, 16, dtype=dtype))
    mask = torch.ones(2, 0, dtype=torch.bool) if masked else None
    out = ops.attention(q, k, v, key_padding_mask=mask)
    assert out.shape == (2, 4, 0, 16) and out.dtype == dtype
    _, lse = OPS.attention_fwd(q, k, v, mask, None, None, True, 0.25)
    assert lse.shape == (2, 4, 0) and lse.dtype == torch.float32
    g = grads(out, (q, k, v), torch.zeros_like(out))
    assert [t.shape for t in g] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("scale", [0.0, -0.5, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_attention_rejects_bad_scale(scale, masked):
    q, k, v, mask = attn_inputs(1, 2, 2, 5, 8, masked=masked)
    with pytest.raises(ValueError, match="attention: scale must be a finite number > 0"):
        ops.attention(q, k, v, scale=scale, key_padding_mask=mask)
    for device in ("cpu", "meta"):
        args = [t.to(device) if t is not None else None for t in (q, k, v, mask)]
        with pytest.raises(ValueError, match="attention_fwd: scale must be a finite number > 0"):
            OPS.attention_fwd(*args, None, None, True, scale)
        out = torch.zeros_like(args[0])
        lse = torch.zeros(1, 2, 5, device=device)
        with pytest.raises(ValueError, match="attention_bwd: scale must be a finite number > 0"):
            OPS.attention_bwd(out, *args[:3], out, lse, args[3], None, None, True, scale)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_attention_non_tensor_is_a_type_error(arg):
    """ops.attention(None, ...) names the argument (it was an AttributeError)."""
    q, k, v, _ = attn_inputs(1, 2, 2, 5, 8)
    args = dict(q=q, k=k, v=v)
    args[arg] = None
    with pytest.raises(TypeError, match=f"attention: {arg} must be a torch.Tensor, got NoneType"):
        ops.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("window, exc, match", [
    (0, ValueError, "attention: window must be > 0"), (-2, ValueError, "window must be > 0"),
    (2.5, TypeError, "attention: window must be None or an int, got float"),
    (True, TypeError, "window must be None or an int, got bool")])
def test_attention_bad_window(window, exc, match):
    q, k, v, _ = attn_inputs(1, 2, 2, 5, 8)
    with pytest.raises(exc, match=match):
        ops.attention(q, k, v, window=window)


@pytest.mark.parametrize("causal", [None, 0, 1, "yes", torch.tensor(True)])
def test_attention_causal_must_be_a_bool(causal):
    """Only True and False name a masking rule: None (which SDPA refuses) ran non-causal."""
    q, k, v, _ = attn_inputs(1, 2, 2, 5, 8)
    with pytest.raises(TypeError, match="attention: causal must be a bool \\(True or False\\), "
                                        "got"):
        ops.attention(q, k, v, causal=causal)


@pytest.mark.parametrize("arg, value, exc, match", [
    ("scale", True, TypeError, "attention: scale must be a number, got bool"),
    ("scale", "0.5", TypeError, "attention: scale must be a number, got str"),
    ("softcap", None, TypeError, "attention: softcap must be a number, got NoneType"),
    ("softcap", True, TypeError, "attention: softcap must be a number, got bool")])
def test_attention_numbers_are_not_coerced(arg, value, exc, match):
    q, k, v, _ = attn_inputs(1, 2, 2, 5, 8)
    with pytest.raises(exc, match=match):
        ops.attention(q, k, v, **{arg: value})


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("eps, exc, match", [
    (-1e-6, ValueError, "eps must be a finite number >= 0, got -1e-06"),
    (math.nan, ValueError, "eps must be a finite number >= 0, got nan"),
    (math.inf, ValueError, "eps must be a finite number >= 0"),
    (None, TypeError, "eps must be a number, got NoneType"),
    (True, TypeError, "eps must be a number, got bool")])
def test_rms_norm_eps_is_validated(op, eps, exc, match):
    """A negative or NaN eps made NaN rows silently; None failed inside float()."""
    x, w = torch.randn(3, 8), torch.rand(8)
    call = (lambda: ops.rms_norm(x, w, eps)) if op == "rms_norm" else \
        (lambda: ops.add_rms_norm(x, x.clone(), w, eps))
    with pytest.raises(exc, match=f"{op}: {match}"):
        call()
