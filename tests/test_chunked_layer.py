"""The decoder layer and its attention sublayer over token chunks of the byte cap
(CKPT_EXT_CHUNK_BYTES): every preset, with LoRA dropout, per-head q/k norms, packed
sequences, a sliding window, padding (with and without HF eager's uniform empty rows),
autocast and torch.compile, chunks of 1, 17 and 129 tokens (two sequences of 70) give the
one-chunk results; the chunked Triton path meets the accuracy rule against float64; and a
chunked layer holds no whole-sequence q, out or dq."""
import contextlib

import pytest
import torch

import ckpt_ext
from ckpt_ext import blocks, config

from reference import (rope_args, FACTOR_GRAD, FACTOR_OUT, check_vs_baseline, layer_weights_with_adapters,
                       make_layer, packed_segment_ids, rope_tables)

from test_lora_dropout import needs_interpreter, seed_tensor

H, NH, NKV, IM, R, B, S = 32, 4, 2, 48, 3, 2, 70
DROPOUT = [0.1, 0.2, 0.3, 0.15, 0.25, 0.35, 0.4]
CHUNKS = (1, 17, 129)


def triton_backend():
    from ckpt_ext._backend import use_triton
    return use_triton("cpu")


def chunk_cap(rows, dtype, weights, part="layer"):
    """CKPT_EXT_CHUNK_BYTES for chunks of `rows` tokens: the layer sizes its chunks by a
    chunk's per-token working set, the attention's 4 Hq*D (q, out, dout, dq) plus, with the
    MLP, its 3 I, at the compute width (float32 at least)."""
    width = 4 * weights["self_attn.q_proj.weight"].shape[0]
    if part == "layer":
        width += 3 * weights["mlp.gate_proj.weight"].shape[0]
    return str(rows * width * max(4, dtype.itemsize))


def left_padding(generator):
    """(B, S) bool, True = real token: the first sequence left-padded by 23, the second by
    53, so that the chunks of 17 start, end and sit inside the padding."""
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :23] = False
    mask[1, :53] = False
    return mask


CASES = {
    "lora_dropout": {},
    "qk_norm": {"qk_norm": True},
    "packed": {"segment_ids": True},
    "window": {"window": 9},
    "padded": {"key_padding_mask": True},
    "padded_eager": {"key_padding_mask": True, "uniform_empty_rows": True},
    "residual_scale": {"residual_scale": 0.7},
}


def case(name, dtype, seed=0, hidden=H):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    spec = CASES[name]
    weights = layer_weights_with_adapters(hidden, NH, NKV, IM, R, dtype, g)
    d = hidden // NH
    if spec.get("qk_norm"):
        weights["self_attn.q_norm.weight"] = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
        weights["self_attn.k_norm.weight"] = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    kw = dict(num_heads=NH, num_kv_heads=NKV, lora_scaling=[0.5 + 0.1 * i for i in range(7)],
              lora_dropout=DROPOUT, dropout_seed=seed_tensor(4242))
    if spec.get("segment_ids"):
        kw["segment_ids"] = packed_segment_ids(B, S, [13, 30, 5, 41])
    if "window" in spec:
        kw["window"] = spec["window"]
    if "residual_scale" in spec:
        kw["residual_scale"] = spec["residual_scale"]
    if spec.get("key_padding_mask"):
        kw["key_padding_mask"] = left_padding(g)
        kw["uniform_empty_rows"] = spec.get("uniform_empty_rows", False)
    x = torch.randn(B, S, hidden, generator=g, dtype=dtype)
    dy = torch.randn(B, S, hidden, generator=g, dtype=dtype)
    return x, weights, rope_tables(S, d, dtype=dtype), dy, kw


def run(x, weights, pe, dy, kw, preset, part, autocast=None, fn=blocks.decoder_layer):
    """(y, dx, {name: gradient}), every weight and adapter trained."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in weights.items()
         if part == "layer" or n.startswith(("self_attn.", "input_layernorm."))}
    ctx = (torch.autocast("cpu", dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    with ctx:
        y = fn(x, blocks.LayerOptions(weights=w, **rope_args(pe), preset=preset,
                                      part=part, **kw))
    y.backward(dy)
    return y.detach(), x.grad, {n: t.grad for n, t in w.items() if t.grad is not None}


def assert_same(got, want, rtol, atol, what):
    (y, dx, g), (y1, dx1, g1) = got, want
    scale = lambda t: max(1.0, t.abs().max().item())  # noqa: E731
    torch.testing.assert_close(y, y1, rtol=rtol, atol=atol * scale(y1), msg=f"y {what}")
    torch.testing.assert_close(dx, dx1, rtol=rtol, atol=atol * scale(dx1), msg=f"dx {what}")
    assert g.keys() == g1.keys(), what
    for n in g1:
        torch.testing.assert_close(g[n], g1[n], rtol=rtol, atol=atol * scale(g1[n]),
                                   msg=f"{n} {what}")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_chunks_equal_one_chunk_fp64(monkeypatch, preset, name):
    """fp64 CPU path: the whole layer and the attention sublayer in chunks of 1, 17 and 129
    tokens (two sequences of 70: pieces of one sequence and whole sequences) give the one-chunk
    output and every gradient to 1e-12."""
    x, weights, pe, dy, kw = case(name, torch.float64)
    for part in ("layer", "attention"):
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
        whole = run(x, weights, pe, dy, kw, preset, part)
        for rows in CHUNKS:
            config.update(chunk_bytes=chunk_cap(rows, torch.float64, weights,
                                                                 part))
            got = run(x, weights, pe, dy, kw, preset, part)
            assert_same(got, whole, 1e-11, 1e-12, f"{part} {rows} rows")
        # the check can fail: a wrong dropout row offset changes the result
        assert not torch.allclose(whole[0], run(x, weights, pe, dy, dict(kw, dropout_seed=
                                                seed_tensor(4243)), preset, part)[0])


@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_chunks_under_autocast(monkeypatch, preset):
    """fp32 weights under bf16 autocast: chunked results stay within bf16 rounding of the
    one-chunk ones (the chunks sum dk, dv and the weight gradients in fp32), and the padded
    eager rows are handled alike."""
    x, weights, pe, dy, kw = case("padded_eager", torch.float32, seed=2)
    whole = run(x, weights, pe, dy, kw, preset, "layer", autocast=torch.bfloat16)
    config.update(chunk_bytes=chunk_cap(17, torch.float32, weights))
    got = run(x, weights, pe, dy, kw, preset, "layer", autocast=torch.bfloat16)
    assert got[0].dtype == whole[0].dtype == torch.float32
    assert_same(got, whole, 0, 3 * torch.finfo(torch.bfloat16).eps, "autocast")


def test_chunked_layer_compiles_without_graph_breaks(monkeypatch):
    """torch.compile keeps the layer op opaque: chunked, the compiled layer has no graph break
    and gives the eager chunked results."""
    torch._dynamo.reset()
    x, weights, pe, dy, kw = case("packed", torch.float32, seed=3)
    config.update(chunk_bytes=chunk_cap(17, torch.float32, weights))
    eager = run(x, weights, pe, dy, kw, "min_memory", "layer")
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(blocks.decoder_layer, backend="aot_eager", fullgraph=True)
    got = run(x, weights, pe, dy, kw, "min_memory", "layer", fn=compiled)
    assert sum(counts["graph_break"].values()) == 0, dict(counts["graph_break"])
    assert_same(got, eager, 1e-6, 1e-6, "compiled")


@needs_interpreter
@pytest.mark.parametrize("name,preset", [("lora_dropout", "min_memory"),
                                         ("packed", "balanced"), ("padded_eager", "fast"),
                                         ("qk_norm", "min_memory")])
def test_triton_chunks_meet_the_accuracy_rule(monkeypatch, name, preset):
    """The Triton kernels (interpreter, fp32) in chunks of 17 tokens: every result within 2x
    (outputs) / 3x (gradients) of the fp32 CPU one-chunk path's error against float64."""
    x, weights, pe, dy, kw = case(name, torch.float32, seed=1, hidden=64)
    f64 = lambda t: t.double() if torch.is_tensor(t) and t.is_floating_point() else t  # noqa
    kw64 = {k: f64(v) for k, v in kw.items()}
    ref = run(f64(x), {n: f64(t) for n, t in weights.items()}, tuple(map(f64, pe)), f64(dy),
              kw64, preset, "layer")
    base = run(x, weights, pe, dy, kw, preset, "layer")
    config.update(chunk_bytes=chunk_cap(17, torch.float32, weights))
    with triton_backend():
        got = run(x, weights, pe, dy, kw, preset, "layer")
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
    check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


@pytest.mark.parametrize("backend", [
    pytest.param(contextlib.nullcontext, id="cpu"),
    pytest.param(triton_backend, id="triton", marks=needs_interpreter)])
def test_chunked_attention_holds_no_whole_sequence_query_tensors(monkeypatch, backend):
    """min_memory's attention sublayer over 256 tokens with Hq*D = 512: in one chunk its
    backward holds q, out, dout and dq of the whole sequence (4 x 512 floats a token at
    least); in chunks of 32 tokens they exist one chunk at a time, so the step's peak falls by
    at least 3 of those four per token beyond the chunk (the one-chunk peak is measured too,
    so the check can fail)."""
    Sn, Hn, heads = 256, 128, 16
    torch.manual_seed(0)
    layer = make_layer(Hn, heads, 4, 64, dtype=torch.float32)
    layer.self_attn.q_proj.weight.data = torch.randn(heads * 32, Hn) * 0.05
    layer.self_attn.o_proj.weight.data = torch.randn(Hn, heads * 32) * 0.05
    layer.self_attn.k_proj.weight.data = torch.randn(4 * 32, Hn) * 0.05
    layer.self_attn.v_proj.weight.data = torch.randn(4 * 32, Hn) * 0.05
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    pe = rope_tables(Sn, 32, dtype=torch.float32)

    def step(xx):
        blocks.decoder_layer(xx, blocks.LayerOptions(
            weights=weights, **rope_args(pe), num_heads=heads, num_kv_heads=4,
            part="attention", preset="min_memory")).sum().backward()

    peaks = {}
    with backend():
        for rows in (Sn, 32):
            config.update(chunk_bytes=chunk_cap(rows, torch.float32, weights, "attention"))
            x = torch.randn(1, Sn, Hn, requires_grad=True)
            peaks[rows] = ckpt_ext.peak_memory_bytes(step, x)
    per_token = heads * 32 * 4
    assert peaks[Sn] - peaks[32] >= 3 * (Sn - 32) * per_token, peaks


def plain_causal_chunk(q, k, v, s0, scale):
    """Plain PyTorch attention of the queries at positions s0.. against keys 0..s0+Sq-1, at
    q's dtype: (out, lse)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    Sq, Sk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    allowed = torch.arange(Sk)[None, :] <= s0 + torch.arange(Sq)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("s0,sq", [(0, 33), (1, 1), (40, 17), (97, 64)])
def test_fp32_causal_chunk_forward_meets_the_accuracy_rule(s0, sq):
    """A float32 causal query chunk at the end of its keys (how the layer calls it; on the CPU
    ATen's flash kernel in two calls, the keys before the chunk and the chunk's own, merged by
    their lse): out and lse within 2x plain PyTorch's error against float64, GQA 8/2."""
    g = torch.Generator().manual_seed(s0 + sq)
    q = torch.randn(2, 8, sq, 32, generator=g)
    k = torch.randn(2, 2, s0 + sq, 32, generator=g)
    v = torch.randn(2, 2, s0 + sq, 32, generator=g)
    scale = 32 ** -0.5
    out, lse = torch.ops.ckpt_ext.attention_fwd(q, k, v, None, None, None, True, scale, s0)
    ref = plain_causal_chunk(q.double(), k.double(), v.double(), s0, scale)
    base = plain_causal_chunk(q, k, v, s0, scale)
    check_vs_baseline("out", out, base[0], ref[0], FACTOR_OUT)
    check_vs_baseline("lse", lse, base[1], ref[1], FACTOR_OUT)


@pytest.mark.parametrize("preset", ["balanced", "min_memory"])
def test_fp32_chunks_meet_the_accuracy_rule(monkeypatch, preset):
    """The CPU path in float32 without masks (the attention forward on ATen's flash kernel for
    every chunk) in chunks of 17 tokens: within 2x / 3x of the one-chunk float32 error against
    float64."""
    x, weights, pe, dy, kw = case("lora_dropout", torch.float32, seed=5)
    f64 = lambda t: t.double() if torch.is_tensor(t) and t.is_floating_point() else t  # noqa
    ref = run(f64(x), {n: f64(t) for n, t in weights.items()}, tuple(map(f64, pe)), f64(dy),
              {k: f64(v) for k, v in kw.items()}, preset, "layer")
    base = run(x, weights, pe, dy, kw, preset, "layer")
    config.update(chunk_bytes=chunk_cap(17, torch.float32, weights))
    got = run(x, weights, pe, dy, kw, preset, "layer")
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
    check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


def test_cpu_chunks_ignore_the_cuda_minimum_rows():
    """The CUDA minimum rows (csrc/chunking.h cuda_min_rows: the occupancy minimum, set from
    the CUDA device's multiprocessors, and the GEMMs' gemm_min_rows) apply on CUDA only: with
    the device's multiprocessors set, the CPU layer keeps the chunks of its byte cap and its
    results bit for bit (the check can fail: one chunk gives other bits)."""
    from ckpt_ext import _C
    x, weights, pe, dy, kw = case("lora_dropout", torch.float32, seed=5)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    whole = run(x, weights, pe, dy, kw, "balanced", "layer")
    config.update(chunk_bytes=chunk_cap(17, torch.float32, weights))
    before = _C.cuda_sms()
    try:
        _C.set_cuda_sms(0)
        base = run(x, weights, pe, dy, kw, "balanced", "layer")
        _C.set_cuda_sms(132)
        assert _C.cuda_min_rows(132, NH) > B * S   # on CUDA: one chunk
        got = run(x, weights, pe, dy, kw, "balanced", "layer")
    finally:
        _C.set_cuda_sms(before)
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    flat = lambda r: [r[0], r[1], *(r[2][n] for n in sorted(r[2]))]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(base)))
    assert not all(torch.equal(a, b) for a, b in zip(flat(whole), flat(base)))
