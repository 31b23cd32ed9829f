"""The fused layer's sums over token chunks (csrc/chunking.h chunk_sum, csrc/layer_math.cpp
Grads::addmm): a chunk's weight or LoRA-factor gradient lands in its sum inside the GEMM
(addmm; half-precision operands into a float32 sum through addmm's out_dtype, on CUDA only),
with no weight-sized add per chunk; the CPU keeps a product and an add for half-precision
operands, since ATen has no CPU kernel for addmm.dtype_out.

The path's choice is tested on the CPU with a stand-in capability flag; the op counts of a
chunked step on the CPU (float32: in the GEMM; bfloat16: a separate add); and on CUDA (skipped
on the CPU, with the reason) that the installed torch takes a float32 out with bfloat16
operands, that a chunked bf16 step has no weight-sized add and meets the accuracy rule
against float64."""
import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ckpt_ext import _C, blocks, config

from reference import FACTOR_GRAD, check_vs_baseline, layer_weights_with_adapters, rope_args, \
    rope_tables
from test_chunked_layer import chunk_cap
from test_lora_dropout import needs_interpreter

CUDA = torch.cuda.is_available()
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("chunked,half,cuda,ok,want", [
    (False, True, True, True, "product"),      # one chunk: the product is the gradient
    (False, False, False, False, "product"),
    (True, False, False, False, "in_gemm"),    # fp32 / fp64: addmm_ into a sum of its dtype
    (True, False, True, False, "in_gemm"),
    (True, True, True, True, "in_gemm"),       # CUDA, ATen takes a float32 out of bf16 / fp16
    (True, True, True, False, "add_after"),    # an ATen that refuses: the fallback
    (True, True, False, True, "add_after"),    # the CPU has no addmm.dtype_out kernel
    (True, True, False, False, "add_after"),
])
def test_chunk_sum_path(chunked, half, cuda, ok, want):
    assert _C.chunk_sum(chunked=chunked, half_operands=half, cuda=cuda, fp32_out_ok=ok) == want


def test_cpu_has_no_float32_out_addmm_for_bf16():
    """Why the CPU keeps its path: ATen's addmm with a float32 out of bfloat16 operands has
    no CPU kernel (torch 2.13). If a release adds one, chunk_sum may take it on the CPU too."""
    a = torch.randn(3, 5, dtype=torch.bfloat16)
    b = torch.randn(5, 4, dtype=torch.bfloat16)
    acc = torch.zeros(3, 4)
    with pytest.raises(NotImplementedError):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


H, NH, NKV, IM, R = 32, 4, 2, 48, 3


def layer_case(dtype, device, b, s, seed=0, hidden=H, heads=NH, kv_heads=NKV, inter=IM):
    g = torch.Generator().manual_seed(seed)
    weights = layer_weights_with_adapters(hidden, heads, kv_heads, inter, R, dtype, g)
    x = torch.randn(b, s, hidden, generator=g, dtype=dtype)
    dy = torch.randn(b, s, hidden, generator=g, dtype=dtype)
    pe = rope_tables(s, hidden // heads, dtype=dtype)
    mv = lambda t: t.to(device)  # noqa: E731
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, lora_scaling=[0.5 + 0.1 * i for i in
                                                                   range(7)])
    return (mv(x), {n: mv(t) for n, t in weights.items()}, tuple(map(mv, pe)), mv(dy), kw)


def step(x, weights, pe, dy, kw, preset, record=False, frozen=()):
    """(dx, {name: gradient}, the profiler or None) of one step, every weight trained but
    those whose names start with one of `frozen`."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_(not n.startswith(tuple(frozen)))
         for n, t in weights.items()}
    y = blocks.decoder_layer(x, blocks.LayerOptions(weights=w, **rope_args(pe), preset=preset,
                                                    **kw))
    prof = None
    if record:
        acts = [ProfilerActivity.CPU]
        with profile(activities=acts, record_shapes=True) as prof:
            y.backward(dy)
    else:
        y.backward(dy)
    return x.grad, {n: t.grad for n, t in w.items() if t.grad is not None}, prof


def weight_sized_adds(prof, weights, projs=ATTN_PROJ, factors=True):
    """{slot name: number of add / add_ ops writing a tensor of that slot's (out, in) shape}
    for the weights (and with `factors` the LoRA factors) of the projections `projs` (slots of
    one shape share a name)."""
    shapes = {tuple(t.shape): n for n, t in weights.items()
              if t.dim() == 2 and any(p in n for p in projs) and (factors or "lora" not in n)}
    out = {}
    for ev in prof.events():
        if ev.name not in ("aten::add_", "aten::add") or not ev.input_shapes:
            continue
        shape = tuple(ev.input_shapes[0]) if isinstance(ev.input_shapes[0], list) else ()
        if shape in shapes:
            out[shapes[shape]] = out.get(shapes[shape], 0) + 1
    return out


@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_cpu_float32_chunks_sum_inside_the_gemm(preset):
    """float32 on the CPU, 5 chunks of 13 tokens (a shape no weight has): the attention
    projections' weight and factor gradients sum inside their GEMMs, no add of a weight-sized
    tensor; bfloat16 on the CPU keeps one add per chunk after the first (so the count can
    fail). The MLP is frozen: its weights' gradients come from the SwiGLU op."""
    x, weights, pe, dy, kw = layer_case(torch.float32, "cpu", 1, 64)
    frozen = ("mlp.",)
    try:
        config.update(chunk_bytes=chunk_cap(13, torch.float32, weights))
        got = step(x, weights, pe, dy, kw, preset, record=True, frozen=frozen)
        assert any("q_proj.lora_A" in n for n in got[1])
        adds = weight_sized_adds(got[2], weights)
        assert adds == {}, adds
        xb, wb, peb, dyb = (x.bfloat16(), {n: t.bfloat16() for n, t in weights.items()},
                            tuple(t.bfloat16() for t in pe), dy.bfloat16())
        adds = weight_sized_adds(step(xb, wb, peb, dyb, kw, preset, record=True,
                                      frozen=frozen)[2], wb)
        assert sum(adds.values()) >= 4 * 4, adds   # q, k, v, o weights: 4 chunks past the first
    finally:
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)


@needs_interpreter
def test_triton_float32_chunks_sum_inside_the_gemms():
    """The Triton launchers (interpreter, float32), 4 chunks: no add of a weight-sized tensor
    for the attention projections' weights and factors, nor for the MLP's weights and factors
    (summed inside the SwiGLU launcher's GEMMs: dw_*_sum, lora_sums); the MLP adapters get
    their own rank, so that shapes name slots. The gradients match the one-chunk step's to
    float32 rounding."""
    from ckpt_ext._backend import use_triton
    x, weights, pe, dy, kw = layer_case(torch.float32, "cpu", 1, 52, seed=4, hidden=64)
    g = torch.Generator().manual_seed(9)
    for n in [n for n in weights if n.startswith("mlp.") and "lora" in n]:
        shape = (R + 2, weights[n].shape[1]) if "lora_A" in n else (weights[n].shape[0], R + 2)
        weights[n] = 0.1 * torch.randn(shape, generator=g)
    try:
        with use_triton("cpu"):
            whole = step(x, weights, pe, dy, kw, "fast")
            config.update(chunk_bytes=chunk_cap(13, torch.float32, weights))
            got = step(x, weights, pe, dy, kw, "fast", record=True)
    finally:
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    adds = weight_sized_adds(got[2], weights)
    adds.update(weight_sized_adds(got[2], weights, ("gate_proj", "up_proj", "down_proj")))
    assert adds == {}, adds
    scale = lambda t: max(1.0, t.abs().max().item())  # noqa: E731
    for n in whole[1]:
        torch.testing.assert_close(got[1][n], whole[1][n], rtol=1e-4,
                                   atol=1e-5 * scale(whole[1][n]), msg=n)


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_cpu_float32_chunk_sums_equal_one_chunk(preset):
    """The in-GEMM sums in float32 (4 chunks) give the one-chunk gradients to float32
    rounding; the weights' gradients have the weights' dtype."""
    x, weights, pe, dy, kw = layer_case(torch.float32, "cpu", 2, 40, seed=3)
    try:
        whole = step(x, weights, pe, dy, kw, preset)
        config.update(chunk_bytes=chunk_cap(20, torch.float32, weights))
        got = step(x, weights, pe, dy, kw, preset)
    finally:
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    scale = lambda t: max(1.0, t.abs().max().item())  # noqa: E731
    torch.testing.assert_close(got[0], whole[0], rtol=1e-4, atol=1e-5 * scale(whole[0]))
    assert got[1].keys() == whole[1].keys()
    for n in whole[1]:
        assert got[1][n].dtype == weights[n].dtype
        torch.testing.assert_close(got[1][n], whole[1][n], rtol=1e-4,
                                   atol=1e-5 * scale(whole[1][n]), msg=n)


@pytest.mark.skipif(not CUDA, reason="addmm with a float32 out of bf16 operands: CUDA only "
                    "(the CPU keeps a product and an add; test_chunk_sum_path covers the choice)")
def test_cuda_bf16_chunk_sums_in_the_gemm_meet_the_accuracy_rule():
    """On CUDA, bf16, a sequence of 3 chunks and a bit: the installed torch takes
    addmm(out_dtype=float32) with bf16 operands (else the layer warns once and falls back);
    the chunked step has no add of an attention projection's weight or factor gradient, nor of
    an MLP weight's (summed inside the SwiGLU op's GEMMs; its adapters' rank-r gradients come
    back per chunk, and the MLP factors get their own rank, so that shapes name slots); each
    gradient is within 3x of the one-chunk bf16 step's error against float64 (CPU). (The
    fallback's warning comes once per process, so it is not asserted here.)"""
    a = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(8, 8, device="cuda")
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        torch.testing.assert_close(acc, (a.double() @ b.double()).float(), rtol=1e-5,
                                   atol=1e-5)
        accepted = True
    except RuntimeError as exc:
        print(f"this torch refuses a float32 out of bf16 operands (the layer falls back): "
              f"{exc}")
        accepted = False
    hidden, heads, inter = 256, 16, 384
    rows = _C.cuda_min_rows(torch.cuda.get_device_properties(0).multi_processor_count, heads)
    s = 3 * rows + 37
    x, weights, pe, dy, kw = layer_case(torch.bfloat16, "cuda", 1, s, seed=7, hidden=hidden,
                                        heads=heads, kv_heads=heads // 2, inter=inter)
    g = torch.Generator().manual_seed(8)
    for n in [n for n in weights if n.startswith("mlp.") and "lora" in n]:
        shape = (R + 2, weights[n].shape[1]) if "lora_A" in n else (weights[n].shape[0], R + 2)
        weights[n] = (0.1 * torch.randn(shape, generator=g)).to("cuda", torch.bfloat16)
    try:
        config.update(chunk_bytes=1 << 40)                   # one chunk: the product path
        whole = step(x, weights, pe, dy, kw, "fast")
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)   # rows: the CUDA minimum
        got = step(x, weights, pe, dy, kw, "fast", record=True)
    finally:
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    if accepted:
        adds = weight_sized_adds(got[2], weights)
        adds.update(weight_sized_adds(got[2], weights, ("gate_proj", "up_proj", "down_proj"),
                                      factors=False))
        assert adds == {}, adds
    f64 = lambda t: t.detach().cpu().double()  # noqa: E731
    ref = step(f64(x), {n: f64(t) for n, t in weights.items()}, tuple(map(f64, pe)), f64(dy),
               kw, "fast")
    check_vs_baseline("dx", got[0].float().cpu(), whole[0].float().cpu(), ref[0], FACTOR_GRAD,
                      dtype=torch.bfloat16)
    for n in ref[1]:
        check_vs_baseline(n, got[1][n].float().cpu(), whole[1][n].float().cpu(), ref[1][n],
                          FACTOR_GRAD, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_bwd_adds_to_the_given_sums(dtype):
    """swiglu_bwd's dw_*_sum: a weight gradient with a sum comes back as sum_beta * sum + dw
    (sum_beta 0 ignores the sum's contents, NaN included), the others as without sums, the
    sums themselves untouched (the CPU kernel)."""
    g = torch.Generator().manual_seed(0)
    T, Hd, I = 11, 8, 12
    x, dy = (torch.randn(T, Hd, generator=g, dtype=dtype) for _ in range(2))
    wg, wu = (torch.randn(I, Hd, generator=g, dtype=dtype) for _ in range(2))
    wd = torch.randn(Hd, I, generator=g, dtype=dtype)
    args = (dy, x, wg, wu, wd, None, None, None, [], [], None, None, [True] * 3 + [False] * 9)
    want = torch.ops.ckpt_ext.swiglu_bwd(*args)
    nan = [torch.full_like(wg, float("nan")), torch.full_like(wd, float("nan"))]
    got = torch.ops.ckpt_ext.swiglu_bwd(*args, dw_gate_sum=nan[0], dw_down_sum=nan[1],
                                        sum_beta=0.0)
    for i in (1, 2, 3):
        torch.testing.assert_close(got[i], want[i])
    assert nan[0].isnan().all() and nan[1].isnan().all()
    sums = [torch.randn(I, Hd, generator=g, dtype=dtype), torch.randn(Hd, I, generator=g,
                                                                       dtype=dtype)]
    got = torch.ops.ckpt_ext.swiglu_bwd(*args, dw_gate_sum=sums[0], dw_down_sum=sums[1],
                                        sum_beta=1.0)
    torch.testing.assert_close(got[1], sums[0] + want[1])
    torch.testing.assert_close(got[2], want[2])
    torch.testing.assert_close(got[3], sums[1] + want[3])


@pytest.mark.parametrize("change,exc,match", [
    (dict(dw_gate_sum=torch.zeros(3, 3)), ValueError, "dw_gate_sum must have shape"),
    (dict(dw_down_sum=torch.zeros(8, 12, dtype=torch.float16)), TypeError,
     "dw_down_sum must be float32 or the dtype of x"),
])
def test_swiglu_bwd_refuses_bad_sums(change, exc, match):
    x = torch.randn(5, 8, dtype=torch.float64)
    wg, wu, wd = torch.randn(12, 8).double(), torch.randn(12, 8).double(), torch.randn(8, 12)
    args = (x, x, wg, wu, wd.double(), None, None, None, [], [], None, None, [True] * 12)
    with pytest.raises(exc, match=match):
        torch.ops.ckpt_ext.swiglu_bwd(*args, **change)


def swiglu_lora_case(dtype, T=11, Hd=8, I=12, r=3, seed=0):
    """(args of swiglu_bwd with adapters on gate, up and down and dropout on gate and down,
    every adapter gradient wanted), the 6 factors."""
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(T, Hd, generator=g, dtype=dtype) for _ in range(2))
    wg, wu = (torch.randn(I, Hd, generator=g, dtype=dtype) for _ in range(2))
    wd = torch.randn(Hd, I, generator=g, dtype=dtype)
    shapes = [(r, Hd), (I, r), (r + 1, Hd), (I, r + 1), (r, I), (Hd, r)]
    lora = [0.5 * torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    seed_t = torch.tensor(1234, dtype=torch.int64)
    args = (dy, x, wg, wu, wd, None, None, None, lora, [0.7, 1.3, 2.0], None, None,
            [False] * 6 + [True] * 6, [0.25, 0.0, 0.4], seed_t, 5)
    return args, lora


LORA_SUMS = ("lora_a_gate_sum", "lora_b_gate_sum", "lora_a_up_sum", "lora_b_up_sum",
             "lora_a_down_sum", "lora_b_down_sum")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_interpreter)])
def test_swiglu_bwd_adds_the_adapter_gradients_to_their_sums(backend):
    """swiglu_bwd's lora_*_sum: an adapter gradient with a sum comes back as sum + d in the
    sum's dtype (float32), the others as without sums (in the factor's dtype), the sums
    themselves untouched; the ATen kernel (float64 and float32) and the Triton launcher
    (interpreter, float32)."""
    from ckpt_ext._backend import use_triton
    dtypes = [torch.float64, torch.float32] if backend == "cpu" else [torch.float32]
    for dtype in dtypes:
        args, lora = swiglu_lora_case(dtype)
        g = torch.Generator().manual_seed(1)
        sums = {LORA_SUMS[i]: torch.randn(lora[i].shape, generator=g) for i in (0, 3, 4, 5)}
        kept = {n: t.clone() for n, t in sums.items()}
        with use_triton("cpu") if backend == "triton" else contextlib.nullcontext():
            want = torch.ops.ckpt_ext.swiglu_bwd(*args)
            got = torch.ops.ckpt_ext.swiglu_bwd(*args, **sums)
        torch.testing.assert_close(got[0], want[0])
        for i, (d, w) in enumerate(zip(got[7], want[7])):
            name = LORA_SUMS[i]
            if name not in sums:
                assert d.dtype == lora[i].dtype
                torch.testing.assert_close(d, w, msg=name)
            else:
                assert d.dtype == torch.float32
                torch.testing.assert_close(d, kept[name] + w.float(), msg=name)
                torch.testing.assert_close(sums[name], kept[name])  # the sum itself untouched


@pytest.mark.parametrize("change,exc,match", [
    (dict(lora_a_gate_sum=torch.zeros(2, 8)), ValueError,
     "lora_a_gate_sum must have shape \\(3, 8\\)"),
    (dict(lora_b_gate_sum=torch.zeros(12, 3, dtype=torch.float16)), TypeError,
     "lora_b_gate_sum must be float32 or float64"),
])
def test_swiglu_bwd_refuses_bad_lora_sums(change, exc, match):
    args, _ = swiglu_lora_case(torch.float64)
    with pytest.raises(exc, match=match):
        torch.ops.ckpt_ext.swiglu_bwd(*args, **change)


def test_swiglu_bwd_refuses_a_lora_sum_of_a_gradient_it_does_not_compute():
    args, lora = swiglu_lora_case(torch.float64)
    args = args[:12] + ([False] * 6 + [True] * 5 + [False],) + args[13:]
    with pytest.raises(ValueError, match="lora_b_down_sum is given but the op computes no "
                                         "gradient of B_down"):
        torch.ops.ckpt_ext.swiglu_bwd(*args, lora_b_down_sum=torch.zeros(lora[5].shape))


@pytest.mark.parametrize("preset", ["fast", "balanced"])
def test_mlp_adapter_factors_are_widened_once_per_call(preset):
    """bfloat16 on the CPU, 4 chunks, only the adapters trained: the backward widens each MLP
    adapter factor to float32 (the SwiGLU ops' LoRA dtype) once, not once per token chunk (the
    MLP adapters get their own rank, so that shapes name factors), and the adapters'
    gradients match the one-chunk step's to bfloat16 rounding (float32 sums, rounded once)."""
    x, weights, pe, dy, kw = layer_case(torch.bfloat16, "cpu", 1, 52, seed=5, hidden=64)
    g = torch.Generator().manual_seed(11)
    mlp = [n for n in weights if n.startswith("mlp.") and "lora" in n]
    for n in mlp:
        shape = (R + 2, weights[n].shape[1]) if "lora_A" in n else (weights[n].shape[0], R + 2)
        weights[n] = (0.1 * torch.randn(shape, generator=g)).bfloat16()
    frozen = tuple(n for n in weights if "lora" not in n)
    try:
        whole = step(x, weights, pe, dy, kw, preset, frozen=frozen)
        config.update(chunk_bytes=chunk_cap(13, torch.bfloat16, weights))
        got = step(x, weights, pe, dy, kw, preset, record=True, frozen=frozen)
    finally:
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    widened = {}
    for ev in got[2].events():
        if (ev.name == "aten::copy_" and len(ev.input_shapes) > 1
                and ev.input_dtypes[:2] == ["float", "c10::BFloat16"]):
            shape = tuple(ev.input_shapes[0])
            widened[shape] = widened.get(shape, 0) + 1
    for n in mlp:
        want = sum(tuple(weights[m].shape) == tuple(weights[n].shape) for m in mlp)
        assert widened.get(tuple(weights[n].shape)) == want, (n, widened)
    assert got[1].keys() == whole[1].keys()
    for n in whole[1]:
        assert got[1][n].dtype == torch.bfloat16
        torch.testing.assert_close(got[1][n].float(), whole[1][n].float(), rtol=2e-2,
                                   atol=2e-2 * whole[1][n].float().abs().max().item(), msg=n)
