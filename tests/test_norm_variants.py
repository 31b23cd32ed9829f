"""The decoder layer's norm variants: norms after a sublayer's output (Gemma 2/3's sandwich
norms, OLMo-2's post-norms), absent pre-norms (OLMo-2), q/k norms over the whole projection
(OLMo-2) and the (offset + w) weight (Gemma), for every preset and part, against a float64
plain-PyTorch layer; over token chunks; through the Triton kernels; their bf16 rounding order;
and the errors for malformed norm weights."""
import pytest
import torch

from ckpt_ext import blocks, config

from reference import (rope_args, FACTOR_GRAD, FACTOR_OUT, check_vs_baseline, make_mask, packed_segment_ids,
                       reference_layer, rope_tables)

from test_chunked_layer import chunk_cap, triton_backend

H, NH, NKV, IM = 64, 4, 2, 56  # head_dim 16: the Triton kernels' smallest
D = H // NH

# name -> (norm slots present, q/k norms: None | "head" | "whole", norm_offset)
VARIANTS = {
    "gemma": ({"input_layernorm", "attention_output_norm", "post_attention_layernorm",
               "mlp_output_norm"}, "head", 1.0),
    "olmo": ({"attention_output_norm", "mlp_output_norm"}, "whole", 0.0),
    "mixed": ({"input_layernorm", "mlp_output_norm"}, None, 0.5),
}
PARTS = ("layer", "attention", "mlp")


def weights_for(variant, dtype, g, part="layer"):
    norms, qk, _ = VARIANTS[variant]

    def rnd(*shape, scale=0.3):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    w = {}
    for name in norms:
        w[f"{name}.weight"] = (0.8 + rnd(H, scale=0.2)).to(dtype)
    for name, (out, inp) in {"self_attn.q_proj": (NH * D, H), "self_attn.k_proj": (NKV * D, H),
                             "self_attn.v_proj": (NKV * D, H), "self_attn.o_proj": (H, NH * D),
                             "mlp.gate_proj": (IM, H), "mlp.up_proj": (IM, H),
                             "mlp.down_proj": (H, IM)}.items():
        w[f"{name}.weight"] = rnd(out, inp)
        w[f"{name}.bias"] = rnd(out, scale=0.1)
    if qk is not None:
        wq, wk = (NH * D, NKV * D) if qk == "whole" else (D, D)
        w["self_attn.q_norm.weight"] = (0.8 + rnd(wq, scale=0.2)).to(dtype)
        w["self_attn.k_norm.weight"] = (0.8 + rnd(wk, scale=0.2)).to(dtype)
    keep = {"layer": lambda n: True,
            "attention": lambda n: not n.startswith(("mlp", "post_attention_", "mlp_output")),
            "mlp": lambda n: n.startswith(("mlp", "post_attention_", "mlp_output"))}[part]
    return {n: t for n, t in w.items() if keep(n)}


def run(x, w, pe, dy, **kw):
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in w.items()}
    y = blocks.decoder_layer(x, blocks.LayerOptions(weights=w, **rope_args(pe),
                                                    num_heads=NH, num_kv_heads=NKV, **kw))
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: t.grad for n, t in w.items()}}


def reference(x, w, pe, dy, mask, offset, part):
    x64 = x.detach().double().requires_grad_()
    w64 = {n: t.detach().double().requires_grad_() for n, t in w.items()}
    y = reference_layer(w64, x64, *(t.double() for t in pe), mask, NH, NKV,
                        norm_offset=offset, part=part)
    y.backward(dy.double())
    return y.detach(), {"x": x64.grad, **{n: t.grad for n, t in w64.items()}}


def assert_close(got, want, rtol, atol, what):
    (y, g), (y1, g1) = got, want
    torch.testing.assert_close(y.double(), y1, rtol=rtol, atol=atol, msg=f"y {what}")
    assert g.keys() == g1.keys(), what
    for n in g1:
        torch.testing.assert_close(g[n].double(), g1[n], rtol=rtol, atol=atol,
                                   msg=f"{n} {what}")


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_float64_reference(variant, preset, part):
    g = torch.Generator().manual_seed(hash((variant, preset, part)) % 2**31)
    b, s = 3, 23
    w = weights_for(variant, torch.float64, g, part)
    x = torch.randn(b, s, H, generator=g, dtype=torch.float64)
    dy = torch.randn(b, s, H, generator=g, dtype=torch.float64)
    pe = rope_tables(s, D, torch.float64)
    mask = make_mask("left_pad", b, s) if part != "mlp" else None
    offset = VARIANTS[variant][2]
    got = run(x, w, pe if part != "mlp" else None, dy, key_padding_mask=mask,
              norm_offset=offset, preset=preset, part=part)
    assert_close(got, reference(x, w, pe, dy, mask, offset, part), 1e-10, 1e-10,
                 f"{variant} {preset} {part}")


def test_each_norm_changes_the_result():
    """Every norm slot, the offset and the whole-projection q/k norm take part: dropping one
    or reading it another way gives a different output (so a variant that ignores it fails
    the reference test above)."""
    g = torch.Generator().manual_seed(3)
    w = weights_for("gemma", torch.float64, g)
    x = torch.randn(2, 9, H, generator=g, dtype=torch.float64)
    pe = rope_tables(9, D, torch.float64)

    def y(weights, **kw):
        return blocks.decoder_layer(x, blocks.LayerOptions(
            weights=weights, **rope_args(pe), num_heads=NH, num_kv_heads=NKV,
            norm_offset=kw.pop("norm_offset", 1.0), **kw))

    base = y(w)
    for name in ("input_layernorm", "attention_output_norm", "post_attention_layernorm",
                 "mlp_output_norm"):
        dropped = {n: t for n, t in w.items() if n != f"{name}.weight"}
        assert (y(dropped) - base).abs().max() > 1e-3, name
    swapped = dict(w)  # Gemma's post_attention_layernorm read as LLaMA's (the MLP pre-norm)
    swapped["attention_output_norm.weight"] = w["post_attention_layernorm.weight"]
    swapped["post_attention_layernorm.weight"] = w["attention_output_norm.weight"]
    assert (y(swapped) - base).abs().max() > 1e-3
    assert (y(w, norm_offset=0.0) - base).abs().max() > 1e-3
    olmo = weights_for("olmo", torch.float64, g)
    per_head = dict(olmo)  # the same numbers per head instead of over the projection
    per_head["self_attn.q_norm.weight"] = olmo["self_attn.q_norm.weight"][:D]
    per_head["self_attn.k_norm.weight"] = olmo["self_attn.k_norm.weight"][:D]
    per_head_whole = dict(olmo)
    per_head_whole["self_attn.q_norm.weight"] = per_head["self_attn.q_norm.weight"].repeat(NH)
    per_head_whole["self_attn.k_norm.weight"] = per_head["self_attn.k_norm.weight"].repeat(NKV)
    assert (y(per_head, norm_offset=0.0) - y(per_head_whole, norm_offset=0.0)).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
@pytest.mark.parametrize("variant", ["gemma", "olmo"])
def test_chunks_equal_one_chunk_fp64(monkeypatch, variant, preset):
    """Over token chunks of 5 and 17 tokens (pieces of one sequence of 41 and whole ones),
    with packed sequences and with eager's empty rows, the layer and the attention sublayer
    give the one-chunk output and gradients to 1e-12."""
    g = torch.Generator().manual_seed(5)
    b, s = 2, 41
    offset = VARIANTS[variant][2]
    x = torch.randn(b, s, H, generator=g, dtype=torch.float64)
    dy = torch.randn(b, s, H, generator=g, dtype=torch.float64)
    pe = rope_tables(s, D, torch.float64)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, :19] = False
    masks = [dict(segment_ids=packed_segment_ids(b, s, [7, 20, 14])),
             dict(key_padding_mask=mask, uniform_empty_rows=True)]
    for part in ("layer", "attention"):
        w = weights_for(variant, torch.float64, g, part)
        for kw in masks:
            config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
            whole = run(x, w, pe, dy, norm_offset=offset, preset=preset, part=part, **kw)
            for rows in (5, 17):
                config.update(chunk_bytes=chunk_cap(rows, torch.float64, w, part))
                got = run(x, w, pe, dy, norm_offset=offset, preset=preset, part=part, **kw)
                assert_close(got, (whole[0].double(), {n: t.double() for n, t in whole[1].items()}),
                             1e-12, 1e-12, f"{part} rows={rows} {sorted(kw)}")


@pytest.mark.parametrize("preset", ["balanced", "min_memory"])
@pytest.mark.parametrize("variant", ["gemma", "olmo"])
def test_triton_path_matches_float64(variant, preset):
    """fp32 through the Triton kernels (the interpreter on CPU) against float64, within the
    accuracy rule (tests/reference.py: 2x / 3x plain PyTorch's fp32 error)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)  # make_mask's lengths
    b, s = 2, 19
    w = weights_for(variant, torch.float32, g)
    x = torch.randn(b, s, H, generator=g)
    dy = torch.randn(b, s, H, generator=g)
    pe = rope_tables(s, D, torch.float32)
    mask = make_mask("fully_padded", b, s)
    offset = VARIANTS[variant][2]
    with triton_backend():
        y, grads = run(x, w, pe, dy, key_padding_mask=mask, norm_offset=offset, preset=preset)
    y64, ref = reference(x, w, pe, dy, mask, offset, "layer")
    # plain PyTorch at fp32: the baseline of the rule
    x32 = x.clone().requires_grad_()
    w32 = {n: t.clone().requires_grad_() for n, t in w.items()}
    y32 = reference_layer(w32, x32, *pe, mask, NH, NKV, norm_offset=offset)
    y32.backward(dy)
    base = {"x": x32.grad, **{n: t.grad for n, t in w32.items()}}
    check_vs_baseline("y", y, y32.detach(), y64, FACTOR_OUT)
    for n in ref:
        check_vs_baseline(n, grads[n], base[n], ref[n], FACTOR_GRAD)


def test_cast_last_rounds_as_gemma_and_olmo_under_bf16():
    """bf16 weights and input: norm_cast_last=True applies the weight in float32 and rounds
    once (Gemma's and OLMo-2's RMSNorm); False rounds the normalized input first (LLaMA's).
    The MLP sublayer with only an output norm and a zero MLP path isolates the norm: its output
    equals each rounding written out in plain PyTorch, bit for bit, and the two differ."""
    g = torch.Generator().manual_seed(11)
    h = torch.randn(3, 7, H, generator=g).to(torch.bfloat16)
    wn = (1 + 0.3 * torch.randn(H, generator=g)).to(torch.bfloat16)
    zero = torch.zeros(IM, H, dtype=torch.bfloat16)
    w = {"mlp.gate_proj.weight": zero, "mlp.up_proj.weight": zero,
         "mlp.down_proj.weight": torch.zeros(H, IM, dtype=torch.bfloat16),
         "mlp.down_proj.bias": torch.randn(H, generator=g).to(torch.bfloat16),
         "mlp_output_norm.weight": wn}
    y2 = w["mlp.down_proj.bias"].expand(3, 7, H)  # the MLP's output before its norm
    f = y2.float()
    xhat = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
    for offset in (0.0, 1.0):
        llama = (wn + offset) * xhat.to(torch.bfloat16)
        gemma = (xhat * (wn.float() + offset)).to(torch.bfloat16)
        assert not torch.equal(llama, gemma)
        for cast_last, want in ((False, llama), (True, gemma)):
            y = blocks.decoder_layer(h, blocks.LayerOptions(
                weights=w, part="mlp", norm_offset=offset, norm_cast_last=cast_last))
            torch.testing.assert_close(y, h + want, rtol=0, atol=0,
                                       msg=f"offset {offset} cast_last {cast_last}")


def test_bad_norm_weights_raise():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(1, 5, H, dtype=torch.float64)
    pe = rope_tables(5, D, torch.float64)
    w = weights_for("olmo", torch.float64, g)

    def call(weights, **kw):
        return blocks.decoder_layer(x, blocks.LayerOptions(
            weights=weights, **rope_args(pe), num_heads=NH, num_kv_heads=NKV, **kw))

    bad = dict(w, **{"self_attn.k_norm.weight": w["self_attn.k_norm.weight"][:D]})
    with pytest.raises(ValueError, match="self_attn.k_norm.weight"):
        call(bad)  # q over the projection, k per head
    bad = dict(w, **{"self_attn.q_norm.weight": torch.ones(NH * D + 1, dtype=torch.float64)})
    with pytest.raises(ValueError, match="self_attn.q_norm.weight"):
        call(bad)
    bad = dict(w, **{"attention_output_norm.weight": torch.ones(H - 1, dtype=torch.float64)})
    with pytest.raises(ValueError, match="attention_output_norm.weight"):
        call(bad)
    bad = dict(w, **{"mlp_output_norm.weight": torch.ones(H + 1, dtype=torch.float64)})
    with pytest.raises(ValueError, match="mlp_output_norm.weight"):
        call(bad)
    with pytest.raises(ValueError, match="norm_offset"):
        call(w, norm_offset=float("nan"))


@pytest.mark.parametrize("variant", ["gemma", "olmo"])
def test_gradcheck_fp64(variant):
    g = torch.Generator().manual_seed(17)
    w = weights_for(variant, torch.float64, g)
    names = list(w)
    x = torch.randn(2, 4, H, generator=g, dtype=torch.float64, requires_grad=True)
    pe = rope_tables(4, D, torch.float64)
    offset = VARIANTS[variant][2]
    picked = ["x", "self_attn.q_norm.weight", "attention_output_norm.weight",
              "mlp_output_norm.weight"] + [n for n in names if n.startswith("input_")]
    inputs = [x] + [w[n].clone().requires_grad_() for n in picked[1:] if n in w]

    def fn(x, *ts):
        ws = dict(w, **dict(zip([n for n in picked[1:] if n in w], ts)))
        return blocks.decoder_layer(x, blocks.LayerOptions(
            weights=ws, **rope_args(pe), num_heads=NH, num_kv_heads=NKV,
            norm_offset=offset, preset="min_memory"))
    assert torch.autograd.gradcheck(fn, tuple(inputs), atol=1e-7)


def _backward_ops(w, preset, **kw):
    """Names and GEMM count (aten::mm / addmm) of the ops a layer's backward runs on CPU."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 13, H, generator=g, dtype=torch.float64).requires_grad_()
    pe = rope_tables(13, D, torch.float64)
    w = {n: t.detach().requires_grad_() for n, t in w.items()}
    y = blocks.decoder_layer(x, blocks.LayerOptions(weights=w, **rope_args(pe),
                                                    num_heads=NH, num_kv_heads=NKV,
                                                    preset=preset, **kw))
    with torch.profiler.profile() as prof:
        y.backward(torch.ones_like(y))
    names = [e.name for e in prof.events()]
    return set(names), sum(n in ("aten::mm", "aten::addmm") for n in names)


def test_fast_recomputes_only_the_down_projection_for_the_mlp_output_norm():
    """fast keeps gate/up: the MLP output norm's backward recomputes the down projection from
    them (one GEMM), not the SwiGLU forward (three); the attention output norm's reruns o_proj
    (one more). The other presets keep no gate/up and rerun the SwiGLU forward."""
    g = torch.Generator().manual_seed(2)
    sandwich = weights_for("gemma", torch.float64, g)
    plain = {n: t for n, t in sandwich.items()
             if not n.startswith(("attention_output_norm", "mlp_output_norm"))}
    names, gemms = _backward_ops(sandwich, "fast", norm_offset=1.0)
    _, gemms_plain = _backward_ops(plain, "fast", norm_offset=1.0)
    assert "ckpt_ext::swiglu_fwd" not in names
    assert gemms - gemms_plain == 2, (gemms, gemms_plain)
    names, _ = _backward_ops(sandwich, "balanced", norm_offset=1.0)
    assert "ckpt_ext::swiglu_fwd" in names
