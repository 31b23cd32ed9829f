"""RoPE variants of the fused decoder layer, against the plain-PyTorch fp64 reference written
as HF writes them, with full and partial rotary tables, GQA, q/k norms, padding and token
chunks, for every preset: interleaved pairs (``rope_interleaved``: GLM, GLM-4, Helium and
ERNIE 4.5 rotate the pairs (2i, 2i + 1) of a head's first R dims, LLaMA the pairs
(i, i + R/2)), and q/k norms after RoPE (``qk_norm_after_rope``: Hunyuan norms the rotated
projections, Qwen3 rotates the normed ones)."""
import contextlib

import pytest
import torch

from ckpt_ext import blocks, config
from ckpt_ext.presets import FUSED_PRESETS
from reference import rope_args, make_mask, reference_layer, rope_interleaved_reference, rope_tables

H, NH, NKV, IM, B, S = 48, 4, 2, 40, 2, 11     # head_dim 12: R = 12 or 6 (R/2 odd)
D = H // NH
EPS = 1e-6


def layer_case(seed, qk_norm, dtype=torch.float64, h=H):
    """Random weights (biases on q/k/v, non-trivial norms), x, dy; hidden size h, NH heads."""
    g = torch.Generator().manual_seed(seed)
    d = h // NH

    def rand(*shape, scale=0.3):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    w = {"input_layernorm.weight": 1 + rand(h), "post_attention_layernorm.weight": 1 + rand(h),
         "self_attn.q_proj.weight": rand(NH * d, h), "self_attn.q_proj.bias": rand(NH * d),
         "self_attn.k_proj.weight": rand(NKV * d, h), "self_attn.k_proj.bias": rand(NKV * d),
         "self_attn.v_proj.weight": rand(NKV * d, h), "self_attn.v_proj.bias": rand(NKV * d),
         "self_attn.o_proj.weight": rand(h, NH * d), "mlp.gate_proj.weight": rand(IM, h),
         "mlp.up_proj.weight": rand(IM, h), "mlp.down_proj.weight": rand(h, IM)}
    if qk_norm:
        w["self_attn.q_norm.weight"] = 1 + rand(d)
        w["self_attn.k_norm.weight"] = 1 + rand(d)
    return w, rand(B, S, h, scale=1.0), rand(B, S, h, scale=1.0)


def tables(rotary, dtype=torch.float64):
    """HF's half-split cos/sin of width `rotary`, per batch row (positions shifted by row)."""
    return rope_tables(S, rotary, dtype, batch=B, offset=torch.tensor([0.0, 3.0]))


def grads(fn, x, w, dy):
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in w.items()}
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, {n: t.grad for n, t in w.items() if t.grad is not None}


def fused(pe, mask, preset, part, interleaved=True, after=False):
    return lambda x, w: blocks.decoder_layer(x, blocks.LayerOptions(
        weights=w, **rope_args(pe), num_heads=NH, num_kv_heads=NKV, eps=EPS,
        key_padding_mask=mask, rope_interleaved=interleaved, qk_norm_after_rope=after,
        preset=preset, part=part))


def assert_same(got, want, tol, what):
    (y, dx, g), (y1, dx1, g1) = got, want
    torch.testing.assert_close(y, y1, rtol=tol, atol=tol, msg=f"y {what}")
    torch.testing.assert_close(dx, dx1, rtol=tol, atol=tol, msg=f"dx {what}")
    assert g.keys() == g1.keys(), what
    for n in g1:
        torch.testing.assert_close(g[n], g1[n], rtol=tol, atol=tol, msg=f"{n} {what}")


def test_the_reference_is_hf_rotation_of_pairs():
    """The reference rotates (t_2i, t_2i+1) by the angle of column i, and passes dims >= R."""
    q = torch.randn(1, 1, S, 8, dtype=torch.float64)
    cos, sin = tables(6)
    cos, sin = cos[:1], sin[:1]
    got, _ = rope_interleaved_reference(q, q, cos, sin)
    for i in range(3):
        c, s = cos[0, :, i], sin[0, :, i]
        a, b = q[0, 0, :, 2 * i], q[0, 0, :, 2 * i + 1]
        torch.testing.assert_close(got[0, 0, :, 2 * i], a * c - b * s)
        torch.testing.assert_close(got[0, 0, :, 2 * i + 1], b * c + a * s)
    torch.testing.assert_close(got[..., 6:], q[..., 6:], rtol=0, atol=0)


@pytest.mark.parametrize("part", ["layer", "attention"])
@pytest.mark.parametrize("preset", FUSED_PRESETS)
@pytest.mark.parametrize("rotary,qk_norm", [(D, False), (D // 2, True)],
                         ids=["full-rotary", "partial-rotary-qk-norm"])
def test_layer_matches_the_fp64_reference(preset, part, rotary, qk_norm):
    w, x, dy = layer_case(1, qk_norm)
    if part == "attention":
        w = {n: t for n, t in w.items() if n.startswith(("self_attn.", "input_layernorm."))}
    pe, mask = tables(rotary), make_mask("left_pad", B, S)
    want = grads(lambda xx, ww: reference_layer(ww, xx, *pe, mask, NH, NKV, eps=EPS,
                                                part=part, rope_interleaved=True), x, w, dy)
    real = mask[:, :, None].double()   # rows with nothing to attend are 0 in both
    got = grads(fused(pe, mask, preset, part), x, w, dy)
    assert_same(got, want, 1e-10, f"{preset} {part}")
    # the check can fail: LLaMA's pairs give another output at the real rows
    other = grads(fused(pe, mask, preset, part, interleaved=False), x, w, dy)[0]
    assert ((other - want[0]) * real).abs().max() > 1e-3


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_chunks_equal_one_chunk(monkeypatch, preset):
    """Token chunks (each rotates its own rows of the tables) give the one-chunk result."""
    w, x, dy = layer_case(2, qk_norm=True)
    pe = tables(D // 2)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    whole = grads(fused(pe, None, preset, "layer"), x, w, dy)
    # 4 rows a chunk: the layer sizes chunks by (4 Hq D + 3 I) fp64 values per token
    config.update(chunk_bytes=str(4 * (4 * NH * D + 3 * IM) * 8))
    assert_same(grads(fused(pe, None, preset, "layer"), x, w, dy), whole, 1e-12, "chunks of 4")


def test_bf16_under_autocast_is_close_to_fp64():
    """fp32 weights under bf16 autocast: within a few bf16 roundings of the fp64 reference,
    as the half-split layer is (same bound)."""
    w, x, dy = layer_case(3, qk_norm=False)
    pe64 = tables(D)
    want = reference_layer(w, x, *pe64, None, NH, NKV, eps=EPS, rope_interleaved=True)
    errs = []
    for interleaved in (True, False):
        w32 = {n: t.float() for n, t in w.items()}
        pe = tuple(t.float() for t in pe64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fused(pe, None, "balanced", "layer", interleaved)(x.float(), w32)
        errs.append((y.double() - want).abs().max().item())
    scale = want.abs().max().item()
    assert errs[0] < 0.05 * scale < errs[1], errs


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_through_triton_meets_the_fp64_reference(preset):
    """The fused path through the Triton launchers (the interpreter on CPU, fp32; a GPU's
    kernels and its CUDA rope when there is one): partial interleaved RoPE, q/k norms, GQA,
    padding."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    from ckpt_ext import use_triton
    w, x, dy = layer_case(4, qk_norm=True, h=80)      # head_dim 20 (Triton: 16..256), R 10
    pe, mask = tables(10), make_mask("left_pad", B, S)
    want = grads(lambda xx, ww: reference_layer(ww, xx, *pe, mask, NH, NKV, eps=EPS,
                                                rope_interleaved=True), x, w, dy)
    on = dict(device=DEVICE, dtype=torch.float32)
    w32 = {n: t.to(**on) for n, t in w.items()}
    pe32 = tuple(t.to(**on) for t in pe)
    with use_triton(DEVICE) if DEVICE == "cpu" else contextlib.nullcontext():
        got = grads(fused(pe32, mask.to(DEVICE), preset, "layer"), x.to(**on), w32, dy.to(**on))
    got = (got[0].double().cpu(), got[1].double().cpu(),
           {n: t.double().cpu() for n, t in got[2].items()})
    assert_same(got, want, 2e-4, f"triton {preset}")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: bf16 through the Triton interpreter is wrong "
                           "(tl.dot), and the CPU path is covered by the autocast test above")
def test_bf16_with_float32_tables_on_the_gpu():
    """bf16 weights and input without autocast, float32 cos/sin (ERNIE 4.5's), on the GPU's
    kernels (the CUDA rope with float32 tables beside bf16 q/k): as the same call with bf16
    tables, within bf16 rounding, and closer to the fp64 reference."""
    w, x, dy = layer_case(5, qk_norm=False, h=128)    # head_dim 32
    pe = tables(32)
    want = reference_layer(w, x, *pe, None, NH, NKV, eps=EPS, rope_interleaved=True)
    on = dict(device="cuda", dtype=torch.bfloat16)
    wb = {n: t.to(**on) for n, t in w.items()}
    with torch.no_grad():
        y32 = fused(tuple(t.to("cuda", torch.float32) for t in pe), None, "balanced",
                    "layer")(x.to(**on), wb)
        y16 = fused(tuple(t.to(**on) for t in pe), None, "balanced", "layer")(x.to(**on), wb)
    scale = want.abs().max().item()
    err32 = (y32.double().cpu() - want).abs().max().item()
    err16 = (y16.double().cpu() - want).abs().max().item()
    assert err32 < 0.05 * scale and err16 < 0.05 * scale, (err32, err16, scale)


@pytest.mark.parametrize("part", ["layer", "attention"])
@pytest.mark.parametrize("preset", FUSED_PRESETS)
@pytest.mark.parametrize("interleaved,rotary", [(False, D), (True, D // 2)],
                         ids=["half-split", "interleaved-partial"])
def test_qk_norm_after_rope_matches_the_fp64_reference(preset, part, interleaved, rotary):
    """q/k norms of the rotated projections (Hunyuan's order), in every preset's forward and
    backward; the other order gives another output (so the check can fail)."""
    w, x, dy = layer_case(6, qk_norm=True)
    if part == "attention":
        w = {n: t for n, t in w.items() if n.startswith(("self_attn.", "input_layernorm."))}
    pe, mask = tables(rotary), make_mask("left_pad", B, S)
    want = grads(lambda xx, ww: reference_layer(
        ww, xx, *pe, mask, NH, NKV, eps=EPS, part=part, rope_interleaved=interleaved,
        qk_norm_after_rope=True), x, w, dy)
    got = grads(fused(pe, mask, preset, part, interleaved, after=True), x, w, dy)
    assert_same(got, want, 1e-10, f"{preset} {part}")
    real = mask[:, :, None].double()
    other = grads(fused(pe, mask, preset, part, interleaved, after=False), x, w, dy)[0]
    assert ((other - want[0]) * real).abs().max() > 1e-3


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_qk_norm_after_rope_in_chunks_and_without_norms(monkeypatch, preset):
    """Token chunks give the one-chunk result; without q/k norms the option changes nothing."""
    w, x, dy = layer_case(7, qk_norm=True)
    pe = tables(D)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    whole = grads(fused(pe, None, preset, "layer", False, after=True), x, w, dy)
    config.update(chunk_bytes=str(4 * (4 * NH * D + 3 * IM) * 8))
    assert_same(grads(fused(pe, None, preset, "layer", False, after=True), x, w, dy), whole,
                1e-12, "chunks of 4")
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    plain = {n: t for n, t in w.items() if "_norm." not in n}
    assert_same(grads(fused(pe, None, preset, "layer", False, after=True), x, plain, dy),
                grads(fused(pe, None, preset, "layer", False, after=False), x, plain, dy),
                0.0, "no q/k norms")
