"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping): the ``softcap`` argument of
attention_fwd / attention_bwd (CPU ATen tiles and the Triton kernels through the interpreter),
of ``ckpt_ext.ops.attention`` and of the decoder layer op.

HF's eager attention caps the scaled scores, s = tanh(s / softcap) * softcap, before the mask
and the softmax. The reference is that computation in plain PyTorch (``ckpt_ext.plain``'s
dense attention, reference.reference_layer for the layer) in float64 on the same input values;
float64 results must match it tightly (reference.check_f64), fp32 / bf16 / fp16 ones within the
2x / 3x rule against plain PyTorch at the test dtype (reference.check_vs_baseline, through
test_triton_attention.check_accuracy). The queries are drawn larger than unit scale so that
the scores reach the cap's curved part, and one test checks that the cap changes the result.
"""
import math

import pytest
import torch

from ckpt_ext import blocks, config, ops
from ckpt_ext.presets import FUSED_PRESETS

from reference import (rope_args, allowed_matrix, attention_in_chunks, attention_reference, check_f64,
                       eager_flash_identity_grads, make_layer, reference_layer, rope_tables,
                       packed_segment_ids)

from test_lora_dropout import needs_interpreter
from test_triton_attention import check_accuracy

_ops = torch.ops.ckpt_ext
NAMES = ("out", "lse", "dq", "dk", "dv")
Q_SCALE = 3.0  # q drawn at this scale: scaled scores of a few units, where tanh bends


# ---- inputs, reference, the ops -------------------------------------------------------------

def make_mask(kind, B, S, gen):
    """None, or bool (B, S), True = key may be attended: 'right' / 'left' random padding
    (>= 1 real key per row), 'full': row 0 entirely padded, the others left-padded."""
    if kind == "none":
        return None
    keep = torch.randint(1, S + 1, (B,), generator=gen)
    pos = torch.arange(S)
    mask = pos[None, :] >= (S - keep)[:, None] if kind in ("left", "full") else \
        pos[None, :] < keep[:, None]
    if kind == "full":
        mask[0] = False
    return mask


def make_inputs(B, Hq, Hkv, S, D, dtype, mask_kind="none", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    q = rnd(B, Hq, S, D, scale=Q_SCALE)
    k, v, dout = rnd(B, Hkv, S, D), rnd(B, Hkv, S, D), rnd(B, Hq, S, D)
    return q, k, v, dout, make_mask(mask_kind, B, S, gen)


def run_eager(q, k, v, dout, mask, causal, scale, seg, window, softcap, dtype):
    """Plain PyTorch (HF eager's cap, explicit S x S softmax) with autograd at `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, mask, causal, scale, seg, window, softcap)
    out.backward(dout.to(dtype))
    return dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad,
                dv=leaves[2].grad)


def run_op(fwd, bwd, q, k, v, dout, mask, causal, scale, seg, window, softcap):
    out, lse = fwd(q, k, v, mask, seg, window, causal, scale, 0, softcap)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, mask, seg, window, causal, scale, 0, None, None,
                     softcap)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def triton_ops():
    from ckpt_ext.kernels import attention
    return attention.attention_fwd, attention.attention_bwd


def cpu_ops():
    return _ops.attention_fwd, _ops.attention_bwd


def check_rule(got, q, k, v, dout, mask, causal, scale, seg, window, softcap, dtype):
    """The 2x / 3x rule against float64, baselines: plain PyTorch at `dtype` (autograd and the
    flash identity, the lse in float32)."""
    base = run_eager(q, k, v, dout, mask, causal, scale, seg, window, softcap, dtype)
    base_alt = eager_flash_identity_grads(q, k, v, mask, causal, scale, dout, base["out"], seg,
                                          window, softcap)
    if dtype != torch.float32:
        base["lse"] = run_eager(q, k, v, dout, mask, causal, scale, seg, window, softcap,
                                torch.float32)["lse"]
    ref = run_eager(q, k, v, dout, mask, causal, scale, seg, window, softcap, torch.float64)
    return check_accuracy(got, base, ref, dtype, base_alt)


def check_tight(got, q, k, v, dout, mask, causal, scale, seg, window, softcap):
    """A float64 result against the float64 reference (lse: float32, 4 ulps)."""
    ref = run_eager(q, k, v, dout, mask, causal, scale, seg, window, softcap, torch.float64)
    for name in NAMES:
        assert got[name].shape == ref[name].shape, name
        check_f64(name, got[name], ref[name], torch.float32 if name == "lse" else torch.float64)
    return ref


def check_empty_rows(got, B, S, mask, causal, seg, window, q_rows=None):
    """Rows with nothing to attend: out 0, lse -inf, dq 0; no NaN anywhere."""
    empty = ~allowed_matrix(B, S, mask, causal, "cpu", seg, window).any(-1)   # (B, 1, S)
    if q_rows is not None:
        empty = empty[..., q_rows]
    empty = empty.expand_as(got["lse"])
    assert not any(torch.isnan(t).any() for t in got.values())
    assert torch.isneginf(got["lse"][empty]).all() and (got["out"][empty] == 0).all()
    assert (got["dq"][empty] == 0).all()
    return empty


# ---- CPU ops: float64 (tight), float32 and bfloat16 (the rule) ---------------------------

#         B  Hq Hkv  S   D  causal  mask    documents      window softcap
CASES = [(2, 6, 2, 37, 64, True, "none", None, None, 5.0),
         (2, 6, 2, 37, 48, False, "right", None, None, 2.0),
         (2, 6, 2, 37, 64, True, "left", None, 9, 5.0),
         (1, 6, 2, 37, 48, True, "none", [5, 11, 21], None, 3.0),
         (2, 4, 4, 37, 48, False, "full", [13, 24], 7, 4.0),
         (1, 6, 2, 150, 64, True, "right", None, None, 5.0)]   # several CPU tiles


def _case_id(c):
    B, Hq, Hkv, S, D, causal, mask, docs, window, cap = c
    return (f"B{B}-H{Hq}/{Hkv}-S{S}-D{D}-{'causal' if causal else 'full'}-mask_{mask}"
            f"{'-docs' if docs else ''}{f'-win{window}' if window else ''}-cap{cap:g}")


def _case(c, dtype, seed=0):
    B, Hq, Hkv, S, D, causal, mask_kind, docs, window, cap = c
    q, k, v, dout, mask = make_inputs(B, Hq, Hkv, S, D, dtype, mask_kind, seed)
    seg = packed_segment_ids(B, S, docs) if docs else None
    return (q, k, v, dout, mask, causal, D ** -0.5, seg, window, cap)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_cpu_fp64_matches_reference(case):
    args = _case(case, torch.float64)
    got = run_op(*cpu_ops(), *args)
    check_tight(got, *args)
    q, k, v, dout, mask, causal, scale, seg, window, cap = args
    check_empty_rows(got, q.shape[0], q.shape[2], mask, causal, seg, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_cpu_low_precision_meets_the_rule(case, dtype):
    args = _case(case, dtype, seed=1)
    got = run_op(*cpu_ops(), *args)
    check_rule(got, *args, dtype)


#               case index, rows per chunk, dtype
CHUNK_RUNS = [(0, 11, torch.float64), (2, 16, torch.float64), (3, 9, torch.float64),
              (5, 64, torch.float64), (0, 11, torch.float32), (5, 64, torch.float32),
              (2, 13, torch.float32), (4, 20, torch.bfloat16)]


@pytest.mark.parametrize("idx,rows,dtype", CHUNK_RUNS,
                         ids=[f"{_case_id(CASES[i])}-rows{r}-{str(d)[6:]}"
                              for i, r, d in CHUNK_RUNS])
def test_cpu_query_chunks(idx, rows, dtype):
    """Query chunks (q_offset) against all keys with dk / dv summed into the accumulators: the
    whole-sequence reference (fp32 causal chunks at the end of their keys would take ATen's
    flash kernel without a cap: with one they must take the tiles)."""
    q, k, v, dout, mask, causal, scale, seg, window, cap = _case(CASES[idx], dtype, seed=2)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got = attention_in_chunks(*cpu_ops(), q, k, v, dout, mask, causal, scale, seg, window, rows,
                              acc_dtype=acc, softcap=cap)
    args = (q, k, v, dout, mask, causal, scale, seg, window, cap)
    check_empty_rows(got, q.shape[0], q.shape[2], mask, causal, seg, window)
    if dtype == torch.float64:
        check_tight(got, *args)
    else:
        check_rule(dict(got, dk=got["dk"].to(dtype), dv=got["dv"].to(dtype)), *args, dtype)


def test_cpu_fully_masked_rows_have_no_nan():
    """Every key padded in one sequence and left padding in the other, causal, a cap: the
    empty rows are 0 / -inf with zero gradients, no NaN, the other rows exact."""
    q, k, v, dout, _ = make_inputs(2, 6, 2, 37, 64, torch.float64)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0] = False
    mask[1, :10] = False
    args = (q, k, v, dout, mask, True, 0.125, None, None, 5.0)
    got = run_op(*cpu_ops(), *args)
    empty = check_empty_rows(got, 2, 37, mask, True, None, None)
    assert empty[0].all() and empty[1, :, :10].all() and not empty[1, :, 10:].any()
    check_tight(got, *args)


# ---- Triton kernels (interpreter: fp32 and fp16) -------------------------------------------

#               case index, dtype, dQ mode
TRITON_RUNS = [(0, torch.float32, "separate"), (1, torch.float16, "atomic"),
               (2, torch.float32, "atomic"), (3, torch.float16, "separate"),
               (4, torch.float32, "separate"), (0, torch.float16, "atomic")]


@needs_interpreter
@pytest.mark.parametrize("idx,dtype,mode", TRITON_RUNS,
                         ids=[f"{_case_id(CASES[i])}-{str(d)[6:]}-{m}"
                              for i, d, m in TRITON_RUNS])
def test_triton_meets_the_rule(idx, dtype, mode):
    args = _case(CASES[idx], dtype, seed=3)
    with config.patch(attention_dq=mode):
        got = run_op(*triton_ops(), *args)
    q, k, v, dout, mask, causal, scale, seg, window, cap = args
    check_empty_rows(got, q.shape[0], q.shape[2], mask, causal, seg, window)
    check_rule(got, *args, dtype)


@needs_interpreter
@pytest.mark.parametrize("idx,rows,dtype,mode", [(2, 13, torch.float32, "separate"),
                                                 (3, 16, torch.float16, "atomic"),
                                                 (1, 20, torch.float32, "atomic")])
def test_triton_query_chunks_accumulate(idx, rows, dtype, mode):
    """q_offset chunks with the fp32 dk_acc / dv_acc accumulators (the kernel's ACCUMULATE)."""
    q, k, v, dout, mask, causal, scale, seg, window, cap = _case(CASES[idx], dtype, seed=4)
    with config.patch(attention_dq=mode):
        got = attention_in_chunks(*triton_ops(), q, k, v, dout, mask, causal, scale, seg, window,
                                  rows, softcap=cap)
    args = (q, k, v, dout, mask, causal, scale, seg, window, cap)
    check_empty_rows(got, q.shape[0], q.shape[2], mask, causal, seg, window)
    check_rule(dict(got, dk=got["dk"].to(dtype), dv=got["dv"].to(dtype)), *args, dtype)


@needs_interpreter
def test_triton_unequal_blocks(monkeypatch):
    """BLOCK_M != BLOCK_N: the capped tiles of every stage (window edges, interior, the block
    crossing S, the diagonal) in both backward kernels."""
    from ckpt_ext.kernels import attention
    for kind, bm, bn in (("fwd", 16, 32), ("dkdv", 16, 32), ("dq", 32, 16)):
        monkeypatch.setitem(attention.INTERPRETER_BLOCKS, kind, {"BLOCK_M": bm, "BLOCK_N": bn})
    args = (*make_inputs(1, 4, 2, 71, 16, torch.float32, "left", seed=5)[:5], True, 0.25,
            packed_segment_ids(1, 71, [9, 1, 40]), 13, 3.0)
    check_rule(run_op(*triton_ops(), *args), *args, torch.float32)


# ---- the cap is applied, bad values raise ----------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_interpreter)])
def test_cap_changes_the_result(backend):
    """softcap 5 against 0 on the same inputs: out and every gradient differ well beyond
    rounding (a softcap that is ignored fails), and softcap 0 is the uncapped attention."""
    fwd, bwd = cpu_ops() if backend == "cpu" else triton_ops()
    args = make_inputs(1, 6, 2, 37, 64, torch.float32, "right", seed=6)[:5]
    capped = run_op(fwd, bwd, *args, True, 0.125, None, None, 5.0)
    plain = run_op(fwd, bwd, *args, True, 0.125, None, None, 0.0)
    for name in ("out", "dq", "dk", "dv"):
        diff = (capped[name] - plain[name]).abs().max().item()
        assert diff > 0.05 * plain[name].abs().max().item(), (name, diff)
    ref0 = run_eager(*args, True, 0.125, None, None, 0.0, torch.float64)
    assert (plain["out"].double() - ref0["out"]).abs().max() < 1e-4


BAD_CAPS = [-1.0, -1e-6, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("cap", BAD_CAPS)
def test_bad_softcap_raises(cap):
    q, k, v, dout, _ = make_inputs(1, 2, 2, 5, 16, torch.float32)
    out, lse = _ops.attention_fwd(q, k, v, None, None, None, True, 0.25)
    calls = [lambda: _ops.attention_fwd(q, k, v, None, None, None, True, 0.25, 0, cap),
             lambda: _ops.attention_bwd(dout, q, k, v, out, lse, None, None, None, True, 0.25,
                                        0, None, None, cap),
             lambda: ops.attention(q, k, v, softcap=cap)]
    meta = [t.to("meta") for t in (q, k, v)]
    calls.append(lambda: _ops.attention_fwd(*meta, None, None, None, True, 0.25, 0, cap))
    for call in calls:
        with pytest.raises(ValueError, match="softcap"):
            call()


@needs_interpreter
@pytest.mark.parametrize("cap", [-2.0, math.nan])
def test_bad_softcap_raises_triton(cap):
    fwd, bwd = triton_ops()
    q, k, v, dout, _ = make_inputs(1, 2, 2, 5, 16, torch.float32)
    out, lse = fwd(q, k, v, None, None, None, True, 0.25)
    with pytest.raises(ValueError, match="softcap"):
        fwd(q, k, v, None, None, None, True, 0.25, 0, cap)
    with pytest.raises(ValueError, match="softcap"):
        bwd(dout, q, k, v, out, lse, None, None, None, True, 0.25, 0, None, None, cap)


def test_ops_attention_autograd_passes_softcap():
    """ckpt_ext.ops.attention(softcap=) differentiates through the capped backward."""
    q, k, v, dout, mask = make_inputs(2, 6, 2, 37, 48, torch.float64, "left", seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, causal=True, key_padding_mask=mask, window=11, softcap=4.0)
    out.backward(dout)
    ref = run_eager(q, k, v, dout, mask, True, 48 ** -0.5, None, 11, 4.0, torch.float64)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves))):
        check_f64(name, got, ref[name])


# ---- the decoder layer op -------------------------------------------------------------------

HL, NH, NKV, IL = 96, 6, 2, 40  # hidden 96, head_dim 16 (the Triton kernels take >= 16)


def layer_case(B, S, dtype, mask_kind, seed=0):
    torch.manual_seed(seed)
    layer = make_layer(HL, NH, NKV, IL, dtype)
    with torch.no_grad():  # larger q: the cap bends the scores
        layer.self_attn.q_proj.weight.mul_(4.0)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, HL, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(B, S, HL, generator=g, dtype=torch.float64).to(dtype)
    mask = make_mask(mask_kind, B, S, g)
    return weights, x, dy, rope_tables(S, HL // NH, dtype), mask


def run_layer(weights, x, dy, pe, mask, preset, part, **kw):
    x = x.detach().clone().requires_grad_()
    w = {n: t.detach().clone().requires_grad_() for n, t in weights.items()
         if part == "layer" or n.startswith(("self_attn.", "input_layernorm."))}
    y = blocks.decoder_layer(x, blocks.LayerOptions(
        weights=w, **rope_args(pe), num_heads=NH, num_kv_heads=NKV, key_padding_mask=mask,
        preset=preset, part=part, **kw))
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: t.grad for n, t in w.items()}}


def run_reference_layer(weights, x, dy, pe, mask, part, softcap):
    x64 = x.detach().double().clone().requires_grad_()
    p64 = {n: t.detach().double().requires_grad_() for n, t in weights.items()
           if part == "layer" or n.startswith(("self_attn.", "input_layernorm."))}
    y = reference_layer(p64, x64, *(t.double() for t in pe), mask, NH, NKV, softcap=softcap,
                        part=part)
    y.backward(dy.double())
    return y.detach(), {"x": x64.grad, **{n: t.grad for n, t in p64.items()}}


def assert_layer_close(got, ref, rtol, atol, what):
    (y, g), (y_ref, g_ref) = got, ref
    torch.testing.assert_close(y.double(), y_ref, rtol=rtol, atol=atol, msg=f"y {what}")
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g[n].double(), g_ref[n], rtol=rtol, atol=atol,
                                   msg=f"{n} {what}")


@pytest.mark.parametrize("part", ["layer", "attention"])
@pytest.mark.parametrize("preset", FUSED_PRESETS)
@pytest.mark.parametrize("mask_kind", ["none", "left"])
def test_layer_fp64_matches_reference(monkeypatch, preset, part, mask_kind):
    """Every preset, the whole layer and the attention sublayer, softcap 2.5: the fp64
    reference layer's output and every gradient to 1e-10, in one chunk and in chunks of 7
    tokens (q_offset and the dk / dv accumulators); and the result differs from softcap 0."""
    weights, x, dy, pe, mask = layer_case(2, 23, torch.float64, mask_kind)
    ref = run_reference_layer(weights, x, dy, pe, mask, part, 2.5)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    got = run_layer(weights, x, dy, pe, mask, preset, part, softcap=2.5)
    assert_layer_close(got, ref, 1e-10, 1e-10, f"{preset} {part}")
    width = 4 * NH * (HL // NH) + (3 * IL if part == "layer" else 0)
    config.update(chunk_bytes=str(7 * width * 8))
    assert_layer_close(run_layer(weights, x, dy, pe, mask, preset, part, softcap=2.5), ref,
                       1e-10, 1e-10, f"{preset} {part} chunks of 7")
    uncapped = run_reference_layer(weights, x, dy, pe, mask, part, 0.0)
    assert (uncapped[0] - ref[0]).abs().max() > 1e-2


@needs_interpreter
@pytest.mark.parametrize("preset,part", [("balanced", "layer"), ("min_memory", "attention")])
def test_layer_triton_meets_the_rule(monkeypatch, preset, part):
    """The layer on the Triton kernels (interpreter, fp32), in chunks of 7 tokens: within 2x /
    3x of the fp32 CPU layer's error against the fp64 reference."""
    from ckpt_ext._backend import use_triton
    from reference import FACTOR_GRAD, FACTOR_OUT, check_vs_baseline
    weights, x, dy, pe, mask = layer_case(2, 23, torch.float32, "left", seed=1)
    ref = run_reference_layer(weights, x, dy, pe, mask, part, 2.5)
    base = run_layer(weights, x, dy, pe, mask, preset, part, softcap=2.5)
    width = 4 * NH * (HL // NH) + (3 * IL if part == "layer" else 0)
    config.update(chunk_bytes=str(7 * width * 4))
    with use_triton("cpu"):
        got = run_layer(weights, x, dy, pe, mask, preset, part, softcap=2.5)
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
    for n in ref[1]:
        check_vs_baseline(n, got[1][n], base[1][n], ref[1][n], FACTOR_GRAD)


def test_layer_rejects_bad_softcap():
    weights, x, dy, pe, mask = layer_case(1, 5, torch.float32, "none")
    for cap in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="softcap"):
            blocks.decoder_layer(x, blocks.LayerOptions(
                weights=weights, **rope_args(pe), num_heads=NH, num_kv_heads=NKV,
                softcap=cap))


def test_layer_softcap_with_uniform_empty_rows():
    """HF eager's rows with no key (uniform_empty_rows with a padding mask) have no capped
    correction: NotImplementedError naming what to use. Without a padding mask no row is
    empty, so the flag changes nothing and the capped layer runs."""
    weights, x, dy, pe, mask = layer_case(2, 9, torch.float64, "left")
    mask[0, :3] = False  # left padding: rows with nothing to attend
    with pytest.raises(NotImplementedError, match="softcap.*(right|policy 'torch')"):
        blocks.decoder_layer(x, blocks.LayerOptions(
            weights=weights, **rope_args(pe), num_heads=NH, num_kv_heads=NKV,
            key_padding_mask=mask, uniform_empty_rows=True, softcap=5.0))
    got = run_layer(weights, x, dy, pe, None, "balanced", "layer", softcap=5.0,
                    uniform_empty_rows=True)
    ref = run_reference_layer(weights, x, dy, pe, None, "layer", 5.0)
    assert_layer_close(got, ref, 1e-10, 1e-10, "uniform_empty_rows without a mask")
