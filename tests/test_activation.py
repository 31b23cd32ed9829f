"""The gated MLP's activation: ``activation="gelu_tanh"`` (Gemma's GeGLU,
``down(gelu(gate(x), approximate="tanh") * up(x))``) in place of SwiGLU's silu.

Everywhere the SwiGLU runs: the CPU kernel ops (float64 tight; float32 / bfloat16 under the
accuracy rule of tests/reference.py, 2x / 3x plain PyTorch's error at the same dtype), the
Triton kernels (through the interpreter on CPU, float32 / float16; the persistent and per-tile
grids, the backward's epilogue pieces, save="input" and "gate_up", the rank products in row
chunks), and the decoder-layer op (every preset, parts "layer" and "mlp", in one token chunk
and in several). References are plain PyTorch in float64 (``reference.gate_activation``:
``F.gelu(approximate="tanh")``), with biases, LoRA adapters and LoRA dropout whose masks are
replayed with the op's dropout (``reference.replayed_dropout``). Shapes are odd on purpose
(T = 37, H = 48, I = 80: masked tails in every kernel tile).
"""
import contextlib
import os

import pytest
import torch

import ckpt_ext
from ckpt_ext import blocks, config, ops
from ckpt_ext.modules import DecoderLayer, SwiGLUMLP

import reference
from reference import (rope_args, FACTOR_GRAD, FACTOR_OUT, check_f64, check_swiglu_lora, check_vs_baseline,
                       magnitude, make_layer, make_swiglu_lora, rms_norm_reference, rope_tables,
                       swiglu_lora_grads)

OPS = torch.ops.ckpt_ext
F64 = torch.float64
GELU = "gelu_tanh"
T, H, I = 37, 48, 80
ALL_GRADS = [True] * 12
NAMES = reference.SWIGLU_OUT_NAMES
DROPOUT = [0.3, 0.2, 0.4]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()),
    reason="runs the Triton kernels: needs a CUDA GPU or TRITON_INTERPRET=1 (the conftest sets "
    "it on machines without a GPU)")


def seed_tensor(value):
    return torch.tensor(value, dtype=torch.int64)


# ---- one case: inputs, the ops' 14 results, the reference's ---------------------------------

def case(dtype, lora_dtype, ranks, bias=True, dropout=None, seed=0, device="cpu"):
    """make_swiglu_lora's inputs (T, H, I) and the dropout arguments: (args, lora, scaling, dy,
    dropout kwargs for the reference, the ops' (lora_dropout, dropout_seed))."""
    args, lora, scaling, dy = make_swiglu_lora(T, H, I, dtype, lora_dtype, ranks, bias,
                                               device=device, seed=seed)
    if dropout is None:
        return args, lora, scaling, dy, {}, ([], None)
    s = seed_tensor(2024 + seed)
    return args, lora, scaling, dy, dict(dropout=dropout, seed=s), (dropout, s)


def run_ops(fwd, bwd, args, lora, scaling, dy, drop, save, activation=GELU, row0=0,
            needs=ALL_GRADS):
    """The 14 results (y, dx, dW, db, dA_gate ... dB_down) of a forward / backward pair (the
    dispatcher's ops or the Triton launchers)."""
    y, gate, up = fwd(*args, lora, scaling, save == "gate_up", *drop, row0,
                      activation=activation)
    saved = (gate, up) if save == "gate_up" else (None, None)
    *g, dlora = bwd(dy, *args, lora, scaling, *saved, needs, *drop, row0,
                     activation=activation)
    assert len(dlora) == 6
    return (y, *g, *dlora)


def ref_results(args, lora, scaling, dy, kw, dtype=None, activation=GELU):
    y, *g, dlora = swiglu_lora_grads(args, lora, scaling, dy, dtype, activation=activation,
                                     **kw)
    return (y, *g, *dlora)


# ---- the CPU kernel ops --------------------------------------------------------------------

@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("ranks, dropout", [
    ((None, None, None), None), ((4, 8, 4), None), ((4, 8, 4), DROPOUT), ((None, 3, 1), DROPOUT)],
    ids=["nolora", "lora", "lora-dropout", "mixed-dropout"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cpu_ops_fp64(bias, ranks, dropout, save):
    args, lora, scaling, dy, kw, drop = case(F64, F64, ranks, bias, dropout)
    out = run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, args, lora, scaling, dy, drop, save)
    check_swiglu_lora(out, out, ref_results(args, lora, scaling, dy, kw), exact=True)


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("dtype, lora_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)],
                         ids=["f32", "bf16-a32", "bf16"])
def test_cpu_ops_low_precision(dtype, lora_dtype, save):
    args, lora, scaling, dy, kw, drop = case(dtype, lora_dtype, (8, 4, 2), True, DROPOUT)
    check_swiglu_lora(
        run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, args, lora, scaling, dy, drop, save),
        ref_results(args, lora, scaling, dy, kw), ref_results(args, lora, scaling, dy, kw, F64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cpu_ops_low_precision_without_adapters(dtype):
    args, lora, scaling, dy, kw, drop = case(dtype, dtype, (None, None, None), True)
    check_swiglu_lora(
        run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, [*args], [], [], dy, drop, "input"),
        ref_results(args, lora, scaling, dy, kw), ref_results(args, lora, scaling, dy, kw, F64))


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_cpu_ops_in_token_chunks(save, monkeypatch):
    """A byte cap that cuts the CPU kernels' T = 37 rows into chunks of 8 (backward) and 12
    (forward): adapter gradients and weight gradients summed over chunks, masks of the chunks'
    global rows."""
    config.update(chunk_bytes=str(6 * I * 8 * 8))
    args, lora, scaling, dy, kw, drop = case(F64, F64, (4, 2, 3), True, DROPOUT)
    out = run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, args, lora, scaling, dy, drop, save)
    check_swiglu_lora(out, out, ref_results(args, lora, scaling, dy, kw), exact=True)


BACKENDS = [pytest.param("cpu", id="cpu"),
            pytest.param("triton", id="triton", marks=needs_triton)]


def backend_context(name):
    if name == "cpu" or DEVICE == "cuda":
        return contextlib.nullcontext()
    return ckpt_ext.use_triton("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_on_row_chunks_with_offsets_equal_the_whole(backend):
    """The ops on row chunks (dropout_row_offset = the chunk's first row), as the decoder layer
    calls them: the rows of y and dx are the whole call's and the gradients sum to its."""
    dtype, tol = (F64, 1e-12) if backend == "cpu" else (torch.float32, 2e-5)
    args, lora, scaling, dy, _, drop = case(dtype, dtype, (2, 3, 4), True, DROPOUT,
                                            device=DEVICE)
    with backend_context(backend):
        whole = run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, args, lora, scaling, dy, drop, "input")
        parts = []
        for t0, n in ((0, 17), (17, 1), (18, 19)):
            rows = [args[0][t0:t0 + n], *args[1:]]
            parts.append(run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, rows, lora, scaling,
                                 dy[t0:t0 + n], drop, "input", row0=t0))
    for k, name in enumerate(NAMES):
        got = (torch.cat([p[k] for p in parts]) if name in ("y", "dx")
               else sum(p[k] for p in parts))
        torch.testing.assert_close(got, whole[k], rtol=tol, atol=tol, msg=name)


# ---- the Triton kernels ----------------------------------------------------------------------

def triton_launchers():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    from ckpt_ext.kernels import swiglu_mlp
    return swiglu_mlp


def run_triton(args, lora, scaling, dy, drop, save, activation=GELU):
    k = triton_launchers()
    return run_ops(k.swiglu_fwd, k.swiglu_bwd, args, lora, scaling, dy, drop, save, activation)


def check_triton_case(dtype, lora_dtype, ranks, bias, dropout, save):
    args, lora, scaling, dy, kw, drop = case(dtype, lora_dtype, ranks, bias, dropout,
                                             device=DEVICE)
    check_swiglu_lora(
        run_triton(args, lora, scaling, dy, drop, save),
        ref_results(args, lora, scaling, dy, kw), ref_results(args, lora, scaling, dy, kw, F64))


@needs_triton
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_fp64_reference(dtype, bias, save):
    check_triton_case(dtype, dtype, (None, None, None), bias, None, save)


@needs_triton
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("dtype, lora_dtype, ranks", [
    (torch.float32, torch.float32, (4, 8, 4)),
    (torch.float16, torch.float32, (8, None, 4)),      # fp32 adapters on an fp16 base
    (torch.float16, torch.float16, (None, 2, 1))], ids=["fp32", "fp16-a32", "fp16"])
def test_triton_lora_dropout_matches_fp64_reference(dtype, lora_dtype, ranks, save):
    check_triton_case(dtype, lora_dtype, ranks, True, DROPOUT, save)


@pytest.fixture(params=["persistent", "tiles"])
def grid(request):
    """swiglu_grid for one test: persistent (three programs in the interpreter, looping over the
    2 x 2 tiles of 32 x 64) or one program per tile."""
    from ckpt_ext import config
    with config.patch(swiglu_grid=request.param):
        yield request.param


@needs_triton
@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_triton_grids(grid, save):
    check_triton_case(torch.float32, torch.float32, (None, None, None), True, None, save)
    check_triton_case(torch.float16, torch.float32, (4, 8, 4), False, DROPOUT, save)


@pytest.fixture(params=["whole", "halves"])
def epilogue_pieces(request, monkeypatch):
    """The backward's epilogue on the whole 64-column tile or on halves (the interpreter's
    default is quarters, which the other tests run)."""
    from ckpt_ext import config
    swiglu_mlp = triton_launchers()
    with contextlib.ExitStack() as stack:
        if request.param == "whole":
            stack.enter_context(config.patch(swiglu_epilogue="whole"))
        else:
            monkeypatch.setitem(swiglu_mlp._INTERPRET_EPI_N, "subtiled", 32)
        yield request.param


@needs_triton
@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_triton_epilogue_pieces(epilogue_pieces, save):
    check_triton_case(torch.float32, torch.float32, (None, None, None), True, None, save)
    check_triton_case(torch.float16, torch.float32, (4, 8, 4), True, DROPOUT, save)


@needs_triton
def test_triton_rank_products_in_row_chunks(monkeypatch):
    """The gate/up adapters' rank products of the backward over row chunks (a byte cap of 5
    rows of dgate / dup, so T = 37 makes 8 chunks, the last one short)."""
    swiglu_mlp = triton_launchers()
    monkeypatch.setattr(swiglu_mlp, "_RANK_CHUNK_BYTES", 5 * 4 * I)
    check_triton_case(torch.float32, torch.float32, (4, 8, 4), True, DROPOUT, "input")


@needs_triton
@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_triton_equals_the_cpu_op_in_fp32(save):
    """The two backends compute the same function (the Triton kernel's gelu as g sigmoid(2z),
    the CPU op's ATen gelu): fp32 results agree to rounding."""
    args, lora, scaling, dy, _, drop = case(torch.float32, torch.float32, (4, 8, 4), True,
                                            DROPOUT)
    cpu = run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, args, lora, scaling, dy, drop, save)
    dev = [t.to(DEVICE) if t is not None else None for t in args]
    tri = run_triton(dev, [t.to(DEVICE) for t in lora], scaling, dy.to(DEVICE), drop, save)
    for name, a, b in zip(NAMES, cpu, tri):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=name)


# ---- the activation is not silu -------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_gelu_tanh_is_not_silu(backend, save):
    """Each activation matches its own reference and differs from the other by far more than
    rounding, in y and in every gradient (a switch that did nothing would fail here)."""
    dtype = F64 if backend == "cpu" else torch.float32
    args, lora, scaling, dy, kw, drop = case(dtype, dtype, (4, 8, 4), True, DROPOUT,
                                             device=DEVICE if backend == "triton" else "cpu")
    with backend_context(backend):
        runs = {a: run_ops(OPS.swiglu_fwd, OPS.swiglu_bwd, args, lora, scaling, dy, drop, save,
                           activation=a) for a in ("silu", GELU)}
    tol = 1e-10 if dtype == F64 else 1e-4
    for a, out in runs.items():
        ref = ref_results(args, lora, scaling, dy, kw, F64, activation=a)
        for name, o, r in zip(NAMES, out, ref):
            if name == "db_down":   # dy summed: the same for both activations
                torch.testing.assert_close(o.double(), r, rtol=tol, atol=tol)
                continue
            torch.testing.assert_close(o.double(), r, rtol=tol, atol=tol, msg=f"{a} {name}")
            other = runs["silu" if a == GELU else GELU][NAMES.index(name)]
            assert (o - other).abs().max() > 1e-2 * r.abs().max(), f"{name}: {a} == the other"


# ---- the Python wrapper and the modules ------------------------------------------------------

@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_swiglu_mlp_gradcheck(save):
    x = torch.randn(2, 3, 10, dtype=F64, requires_grad=True)
    ws = [(0.5 * torch.randn(*s, dtype=F64)).requires_grad_() for s in ((7, 10), (7, 10), (10, 7),
                                                                        (7,), (7,), (10,))]

    def fn(x, *w):
        return ops.swiglu_mlp(x, *w, save=save, activation=GELU)

    assert torch.autograd.gradcheck(fn, (x, *ws))
    y = fn(x, *ws)
    ref = reference.swiglu_reference(x, *ws, activation=GELU)[0]
    check_f64("y", y, ref)


@pytest.mark.parametrize("policy", ["none", "torch", "fast", "balanced", "min_memory"])
def test_modules_take_the_activation(policy):
    """SwiGLUMLP and DecoderLayer with activation="gelu_tanh" (HF parameter names): every policy,
    against the float64 references."""
    torch.manual_seed(3)
    mlp = SwiGLUMLP(H, I, bias=True, policy=policy, activation=GELU).double()
    x = torch.randn(2, 5, H, dtype=F64, requires_grad=True)
    y = mlp(x)
    p = dict(mlp.named_parameters())
    ref = reference.swiglu_reference(x, *(p[f"{n}_proj.{k}"] for k in ("weight", "bias")
                                          for n in ("gate", "up", "down")), activation=GELU)[0]
    check_f64("SwiGLUMLP", y, ref)
    layer = make_layer(H, 4, 2, I, F64, policy=policy, activation=GELU)
    assert layer.mlp.activation == GELU
    pe = rope_tables(5, H // 4, F64)
    ref = reference.reference_layer(layer.state_dict(), x, *pe, None, 4, 2, activation=GELU)
    check_f64("DecoderLayer", layer(x, pe), ref)


# ---- the decoder-layer op --------------------------------------------------------------------

HQ, HKV, B, S = 2, 1, 2, 19   # head_dim 24 (Triton attention needs >= 16); B * S = 38 tokens


def layer_case(dtype=F64, adapters=False, seed=0):
    """x (B, S, H), weights (HF names; biases on every projection; adapters of rank 3 on every
    projection when asked) and (cos, sin)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if adapters:
        weights = reference.layer_weights_with_adapters(H, HQ, HKV, I, 3, dtype, g)
        with torch.no_grad():
            for n in list(weights):
                if n.endswith("_proj.weight"):
                    weights[n[:-len("weight")] + "bias"] = 0.1 * torch.randn(
                        weights[n].shape[0], generator=g, dtype=dtype)
    else:
        layer = make_layer(H, HQ, HKV, I, dtype, attention_bias=True, mlp_bias=True)
        weights = {n: t.detach().clone() for n, t in layer.named_parameters()}
    x = torch.randn(B, S, H, generator=g, dtype=dtype)
    return x, weights, rope_tables(S, H // HQ, dtype)


SCALING = [0.5 + 0.1 * i for i in range(7)]
LAYER_DROPOUT = [0.1, 0.2, 0.3, 0.15, 0.25, 0.35, 0.4]


def layer_reference(x, w, pe, part, activation=GELU, dropout=None, seed=None):
    """Plain PyTorch float64: the whole layer (reference.reference_layer; no adapters) or the
    MLP sublayer h + down(act(gate(m)) * up(m)), m = rms_norm(h), its adapters' inputs dropped
    with the op's masks on the (B * S) token rows."""
    if part == "layer":
        return reference.reference_layer(w, x, *pe, None, HQ, HKV, activation=activation)
    m = rms_norm_reference(x, w["post_attention_layernorm.weight"], 1e-6)
    proj = [w.get(f"mlp.{n}_proj.{k}") for k in ("weight", "bias") for n in ("gate", "up", "down")]
    lora = [w.get(f"mlp.{n}_proj.lora_{k}") for n in ("gate", "up", "down") for k in "AB"]
    kw = {}
    if lora[0] is not None:
        kw = dict(lora=lora, scaling=SCALING[4:], dropout=dropout or (), seed=seed)
    y = reference.swiglu_lora_reference(m.reshape(B * S, H), *proj, activation=activation, **kw)
    return x + y.view(B, S, H)


def layer_grads(fn, x, weights):
    """fn(x, weights)'s output and the gradients of sum(out * probe) for x and every weight."""
    xs = x.clone().requires_grad_()
    ws = {n: t.clone().requires_grad_() for n, t in weights.items()}
    y = fn(xs, ws)
    probe = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)
    (y * probe).sum().backward()
    return y.detach(), {"x": xs.grad, **{n: t.grad for n, t in ws.items()}}


def check_layer(got, ref):
    y, grads = got
    y_ref, ref_grads = ref
    check_f64("y", y, y_ref)
    scale = magnitude(*[g for g in ref_grads.values() if g is not None])
    for name, g in grads.items():
        if ref_grads[name] is None:   # outside the part
            assert g is None or not g.any(), name
            continue
        check_f64(name, g, ref_grads[name], scale=scale)


def part_weights(weights, part):
    """The weights a part uses (the op is given those; a sublayer computes no gradient for the
    others)."""
    if part == "layer":
        return weights
    return {n: t for n, t in weights.items() if n.startswith(("mlp.", "post_attention"))}


def run_layer(part, preset, activation=GELU, dropout=None, seed=None):
    return lambda x, w: blocks.decoder_layer(x, blocks.LayerOptions(
        weights=w, cos=pe_of(x)[0], sin=pe_of(x)[1], num_heads=HQ, num_kv_heads=HKV,
        activation=activation, part=part, preset=preset,
        lora_scaling=SCALING if "mlp.gate_proj.lora_A" in w else (),
        lora_dropout=dropout or (), dropout_seed=seed))


def pe_of(x):
    return rope_tables(S, H // HQ, x.dtype)


@pytest.mark.parametrize("part", ["layer", "mlp"])
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_layer_op_matches_fp64_reference(preset, part):
    x, weights, pe = layer_case()
    weights = part_weights(weights, part)
    got = layer_grads(run_layer(part, preset), x, weights)
    check_layer(got, layer_grads(lambda x, w: layer_reference(x, w, pe, part), x, weights))
    silu = layer_grads(run_layer(part, preset, "silu"), x, weights)
    assert (got[0] - silu[0]).abs().max() > 1e-2 * got[0].abs().max()


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_layer_op_mlp_with_lora_dropout(preset, chunked, monkeypatch):
    """The MLP sublayer with adapters on its three projections and dropout on their inputs, in
    one token chunk or (a byte cap of 8 rows of the MLP's three (rows, I) fp64 tensors) five:
    the layer passes the activation and the global row offsets to every chunk's ops."""
    if chunked:
        config.update(chunk_bytes=str(3 * I * 8 * 8))
    x, weights, pe = layer_case(adapters=True)
    weights = part_weights(weights, "mlp")
    seed = seed_tensor(77)
    got = layer_grads(run_layer("mlp", preset, dropout=LAYER_DROPOUT, seed=seed), x, weights)
    ref = layer_grads(lambda x, w: layer_reference(x, w, pe, "mlp", dropout=LAYER_DROPOUT[4:],
                                                   seed=seed), x, weights)
    check_layer(got, ref)


@needs_triton
@pytest.mark.parametrize("part", ["layer", "mlp"])
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_layer_op_through_triton(preset, part):
    """float32 through the Triton launchers (the interpreter on CPU): within the accuracy rule
    of the float32 plain-PyTorch layer against the float64 one."""
    x, weights, pe = layer_case(torch.float32)
    weights = part_weights(weights, part)
    dev = {n: t.to(DEVICE) for n, t in weights.items()}
    with backend_context("triton"):
        got = layer_grads(lambda x, w: blocks.decoder_layer(x, blocks.LayerOptions(
            weights=w, cos=pe[0].to(DEVICE), sin=pe[1].to(DEVICE), num_heads=HQ,
            num_kv_heads=HKV, activation=GELU, part=part, preset=preset)), x.to(DEVICE), dev)
    base = layer_grads(lambda x, w: layer_reference(x, w, pe, part), x, weights)
    ref = layer_grads(lambda x, w: layer_reference(x, w, tuple(t.double() for t in pe), part),
                      x.double(), {n: t.double() for n, t in weights.items()})
    check_vs_baseline("y", got[0].cpu(), base[0], ref[0], FACTOR_OUT)
    scale = magnitude(*[g for g in ref[1].values() if g is not None])
    for name, g in got[1].items():
        if ref[1][name] is None:
            continue
        check_vs_baseline(name, g.cpu(), base[1][name], ref[1][name], FACTOR_GRAD, scale=scale)


# ---- bad activations -----------------------------------------------------------------------

BAD = "activation must be one of 'silu', 'gelu_tanh', got 'gelu'"


def test_bad_activation_raises_everywhere():
    args, lora, scaling, dy, _, _ = case(torch.float32, torch.float32, (None, None, None))
    with pytest.raises(ValueError, match=f"swiglu_fwd: {BAD}"):
        OPS.swiglu_fwd(*args, [], [], False, [], None, 0, activation="gelu")
    with pytest.raises(ValueError, match=f"swiglu_bwd: {BAD}"):
        OPS.swiglu_bwd(dy, *args, [], [], None, None, ALL_GRADS, [], None, 0,
                       activation="gelu")
    meta = [t.to("meta") if t is not None else None for t in args]
    with pytest.raises(ValueError, match=f"swiglu_fwd: {BAD}"):   # the fake
        OPS.swiglu_fwd(*meta, [], [], False, [], None, 0, activation="gelu")
    with pytest.raises(ValueError, match=f"swiglu_mlp: {BAD}"):
        ops.swiglu_mlp(*args, activation="gelu")
    with pytest.raises(ValueError, match="SwiGLUMLP: activation must be one of"):
        SwiGLUMLP(H, I, activation="relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        DecoderLayer(H, 4, 2, I, activation="gelu")
    x, weights, pe = layer_case(torch.float32)
    for part in ("layer", "mlp", "attention"):
        with pytest.raises(ValueError, match=f"decoder_layer.*{BAD}"):
            blocks.decoder_layer(x, blocks.LayerOptions(
                weights=weights, **rope_args(pe), num_heads=HQ, num_kv_heads=HKV,
                activation="gelu", part=part))


@needs_triton
def test_bad_activation_raises_in_the_triton_launchers():
    k = triton_launchers()
    args, lora, scaling, dy, _, _ = case(torch.float32, torch.float32, (None, None, None),
                                         device=DEVICE)
    with pytest.raises(ValueError, match=f"swiglu_fwd: {BAD}"):
        k.swiglu_fwd(*args, [], [], False, activation="gelu")
    with pytest.raises(ValueError, match=f"swiglu_bwd: {BAD}"):
        k.swiglu_bwd(dy, *args, [], [], None, None, ALL_GRADS, activation="gelu")
