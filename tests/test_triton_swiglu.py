"""Tests of the Triton SwiGLU launchers in kernels/swiglu_mlp.py.

Without a GPU they run through the Triton interpreter on CPU (fp32 and fp16 only: bf16
``tl.dot`` is wrong in the interpreter). Accuracy rule (README, "Tests";
reference.check_vs_baseline): against an fp64 reference, the kernel's max abs error is at most
2x (outputs) / 3x (gradients) the error of plain PyTorch at the same dtype. The plain-PyTorch
baseline is the eager composition ``linear(silu(linear(x)) * linear(x))``
(reference.swiglu_reference) run with autograd at the test dtype on the test device; on CPU
that is torch's own fp16 / fp32 CPU matmul, the honest "what you would get without these
kernels" on this machine. When the baseline error is 0 (e.g. db_down at T=1, an exact copy of
dy) the baseline is floored at reference.FLOOR_ULPS units in the last place of max|reference|.
"""
import contextlib
import gc
import weakref

import pytest
import torch

from ckpt_ext import config
from ckpt_ext.kernels import _launch, swiglu_mlp

from reference import (FACTOR_GRAD, FACTOR_OUT, check_vs_baseline, make_swiglu_lora,
                       swiglu_lora_grads, swiglu_reference)

from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I = 96, 172
GRAD_NAMES = ("dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down")
ALL_GRADS = [True] * 12  # needs_grad: every gradient


def make_inputs(T, H, I, dtype, bias, device=DEVICE, seed=0):
    """Inputs drawn in `dtype` (so the fp64 reference sees exactly the same values).

    Returns (x, w_gate, w_up, w_down, b_gate, b_up, b_down, dy); weights scaled as nn.Linear.
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    x = rnd(T, H)
    w_gate, w_up = rnd(I, H, scale=H ** -0.5), rnd(I, H, scale=H ** -0.5)
    w_down = rnd(H, I, scale=I ** -0.5)
    b_gate, b_up, b_down = (rnd(I, scale=0.5), rnd(I, scale=0.5), rnd(H, scale=0.5)) if bias else (None,) * 3
    dy = rnd(T, H)
    return x, w_gate, w_up, w_down, b_gate, b_up, b_down, dy


def eager(x, w_gate, w_up, w_down, b_gate, b_up, b_down, dy):
    """Plain PyTorch forward + autograd backward at the dtype of the inputs.

    Returns (y, dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down); absent bias grads None.
    """
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (x, w_gate, w_up, w_down, b_gate, b_up, b_down)]
    y = swiglu_reference(*leaves)[0]
    y.backward(dy)
    return (y.detach(),) + tuple(t.grad if t is not None else None for t in leaves)


def reference(*args):
    """eager() in fp64: the ground truth."""
    return eager(*[t.double() if t is not None else None for t in args])


def run_kernels(x, w_gate, w_up, w_down, b_gate, b_up, b_down, dy, save):
    """(y, dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down) from the launchers."""
    y, gate, up = swiglu_mlp.swiglu_fwd(x, w_gate, w_up, w_down, b_gate, b_up, b_down, [], [],
                                        save == "gate_up")
    if save == "input":
        gate = up = None
    grads = swiglu_mlp.swiglu_bwd(dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down, [], [],
                                  gate, up, ALL_GRADS)
    assert len(grads[7]) == 6 and all(t.numel() == 0 for t in grads[7])
    return (y,) + grads[:7]


def check_accuracy(out, base, ref, dtype):
    """The accuracy rule (reference.check_vs_baseline) for y and the 7 gradients; returns
    {name: kernel_err / bound}."""
    names = ("y",) + GRAD_NAMES
    ratios = {}
    for name, o, b, r in zip(names, out, base, ref):
        if r is None:
            assert o.numel() == 0 and o.dtype == dtype, f"{name}: expected an empty placeholder"
            continue
        assert o.shape == r.shape and o.dtype == dtype, f"{name}: {o.shape} {o.dtype}"
        ratios[name] = check_vs_baseline(name, o, b, r, FACTOR_OUT if name == "y" else FACTOR_GRAD)
    return ratios


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("T", [1, 7, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_fp64_reference(dtype, T, bias, save):
    args = make_inputs(T, H, I, dtype, bias)
    check_accuracy(run_kernels(*args, save), eager(*args), reference(*args), dtype)


@pytest.fixture(params=["persistent", "tiles"])
def grid(request):
    """The swiglu_grid setting for one test: ``persistent`` (the default; in the interpreter
    three programs, each looping over several tiles) or ``tiles`` (one program per tile)."""
    with config.patch(swiglu_grid=request.param):
        yield request.param


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_grids_match_fp64_reference(grid, save):
    dev = torch.device(DEVICE)
    meta = swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", True, True, False, None)[1]
    assert meta["PERSISTENT"] == (grid == "persistent")
    # a persistent launch sizes its grid from the device; 0 means one program per tile
    assert (swiglu_mlp._programs(dev, meta) > 0) == (grid == "persistent")
    args = make_inputs(129, H, I, torch.float32, True)   # 5 x 3 tiles of 32 x 64 in the interpreter
    check_accuracy(run_kernels(*args, save), eager(*args), reference(*args), torch.float32)


def check_lora_case(T, bias):
    """fp16 inputs with fp32 adapters of ranks (4, 8, 4), save="input": the 14 results of the
    launchers against the plain-PyTorch baseline and the fp64 reference."""
    args, lora, scaling, dy = make_swiglu_lora(T, H, I, torch.float16, torch.float32,
                                               (4, 8, 4), bias, device=DEVICE)
    check_lora_accuracy(run_lora_kernels(args, lora, scaling, dy, "input"),
                        flat_reference(args, lora, scaling, dy),
                        flat_reference(args, lora, scaling, dy, torch.float64))


def test_grids_with_lora(grid):
    check_lora_case(129, bias=False)


@pytest.fixture(params=["whole", "halves"])
def epilogue_pieces(request, monkeypatch):
    """The backward's epilogue on the whole 64-column tile (swiglu_epilogue="whole") or on
    halves; the other tests run it on quarters (the interpreter's subtiled default)."""
    with contextlib.ExitStack() as stack:
        if request.param == "whole":
            stack.enter_context(config.patch(swiglu_epilogue="whole"))
        else:
            monkeypatch.setitem(swiglu_mlp._INTERPRET_EPI_N, "subtiled", 32)
        assert swiglu_mlp._interpret_meta("bwd")["EPI_N"] == (64 if request.param == "whole"
                                                              else 32)
        yield request.param
    monkeypatch.undo()
    assert swiglu_mlp._interpret_meta("bwd")["EPI_N"] == 16


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_epilogue_pieces_match_fp64_reference(epilogue_pieces, save):
    args = make_inputs(129, H, I, torch.float32, True)   # I 172: the last tile's pieces masked
    check_accuracy(run_kernels(*args, save), eager(*args), reference(*args), torch.float32)


def test_epilogue_pieces_with_lora(epilogue_pieces):
    check_lora_case(70, bias=True)


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_noncontiguous_inputs(save):
    """x a strided view, w_gate / w_down transposed views: strides are honoured."""
    x, wg, wu, wd, bg, bu, bd, dy = make_inputs(33, H, I, torch.float32, True)
    x_view = torch.zeros(33, 2 * H, dtype=x.dtype, device=x.device)[:, ::2]
    x_view.copy_(x)
    wg_view = wg.t().contiguous().t()
    wd_view = wd.t().contiguous().t()
    assert not x_view.is_contiguous() and not wg_view.is_contiguous()
    out = run_kernels(x_view, wg_view, wu, wd_view, bg, bu, bd, dy, save)
    expected = run_kernels(x, wg, wu, wd, bg, bu, bd, dy, save)
    for name, a, b in zip(("y",) + GRAD_NAMES, out, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def _strided_last_dim(t):
    """A copy of t whose last dim has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_every_input_with_a_strided_last_dim(save):
    """x, the weights, the biases, dy and the saved gate/up, each with last-dim stride 2:
    the 2x/3x rule against the fp64 reference holds as for contiguous inputs."""
    args = make_inputs(19, H, I, torch.float32, True)
    strided = [_strided_last_dim(t) for t in args]
    assert all(t.stride(-1) == 2 for t in strided)
    x, wg, wu, wd, bg, bu, bd, dy = strided
    y, gate, up = swiglu_mlp.swiglu_fwd(x, wg, wu, wd, bg, bu, bd, [], [], save == "gate_up")
    if save == "gate_up":
        gate, up = _strided_last_dim(gate), _strided_last_dim(up)
    else:
        gate = up = None
    grads = swiglu_mlp.swiglu_bwd(dy, x, wg, wu, wd, bg, bu, bd, [], [], gate, up,
                                  [True] * 12)[:7]
    check_accuracy((y,) + grads, eager(*args), reference(*args), torch.float32)


def test_independent_biases():
    """Only b_up given: the other two bias gradients are empty placeholders."""
    x, wg, wu, wd, _, bu, _, dy = make_inputs(7, H, I, torch.float32, True)
    args = (x, wg, wu, wd, None, bu, None, dy)
    check_accuracy(run_kernels(*args, "input"), eager(*args), reference(*args), torch.float32)


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_deterministic(save):
    args = make_inputs(129, H, I, torch.float16, True)
    first = run_kernels(*args, save)
    second = run_kernels(*args, save)
    for name, a, b in zip(("y",) + GRAD_NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_save_modes_agree():
    """The two save modes give the same gradients in fp32 (one rounds gate/up, one does not)."""
    args = make_inputs(65, H, I, torch.float32, True)
    for name, a, b in zip(("y",) + GRAD_NAMES, run_kernels(*args, "input"),
                          run_kernels(*args, "gate_up")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


class _AllocationLog(TorchDispatchMode):
    """Keeps a weak reference to every tensor an aten op returns, by shape."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.refs.append((tuple(t.shape), weakref.ref(t)))
        return out


def test_save_input_keeps_no_tokens_by_I_tensor():
    """save="input": gate/up come back empty and no (T, I) tensor outlives swiglu_fwd."""
    T = 40
    x, wg, wu, wd, bg, bu, bd, _ = make_inputs(T, H, I, torch.float32, True)
    log = _AllocationLog()
    with log:
        y, gate, up = swiglu_mlp.swiglu_fwd(x, wg, wu, wd, bg, bu, bd, [], [], False)
    gc.collect()
    assert gate.shape == (0,) and up.shape == (0,)
    assert gate.dtype == x.dtype and up.dtype == x.dtype
    assert gate is not up, "op outputs must not alias each other"
    assert y.shape == (T, H)
    seen = [ref for shape, ref in log.refs if shape == (T, I)]
    assert seen, "the forward should have allocated its transient h (T, I)"
    assert all(ref() is None for ref in seen), "a (T, I) tensor survived swiglu_fwd"


def test_save_gate_up_returns_preactivations():
    x, wg, wu, wd, bg, bu, bd, _ = make_inputs(7, H, I, torch.float32, True)
    _, gate, up = swiglu_mlp.swiglu_fwd(x, wg, wu, wd, bg, bu, bd, [], [], True)
    torch.testing.assert_close(gate, torch.nn.functional.linear(x, wg, bg), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up, torch.nn.functional.linear(x, wu, bu), rtol=1e-5, atol=1e-5)


def test_backward_accepts_forward_placeholders():
    """The empty gate/up that save="input" returns can be handed straight to swiglu_bwd."""
    x, wg, wu, wd, bg, bu, bd, dy = make_inputs(7, H, I, torch.float32, False)
    _, gate, up = swiglu_mlp.swiglu_fwd(x, wg, wu, wd, bg, bu, bd, [], [], False)
    from_empty = swiglu_mlp.swiglu_bwd(dy, x, wg, wu, wd, bg, bu, bd, [], [], gate, up, ALL_GRADS)
    from_none = swiglu_mlp.swiglu_bwd(dy, x, wg, wu, wd, bg, bu, bd, [], [], None, None,
                                      ALL_GRADS)
    for a, b in zip(from_empty[:7], from_none[:7]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_zero_tokens(save):
    x, wg, wu, wd, bg, bu, bd, dy = make_inputs(0, H, I, torch.float32, True)
    y, gate, up = swiglu_mlp.swiglu_fwd(x, wg, wu, wd, bg, bu, bd, [], [], save == "gate_up")
    assert y.shape == (0, H)
    assert gate.numel() == 0 and up.numel() == 0
    dx, dwg, dwu, dwd, dbg, dbu, dbd, _ = swiglu_mlp.swiglu_bwd(
        dy, x, wg, wu, wd, bg, bu, bd, [], [],
        *((gate, up) if save == "gate_up" else (None, None)), ALL_GRADS)
    assert dx.shape == (0, H)
    for g, p in ((dwg, wg), (dwu, wu), (dwd, wd), (dbg, bg), (dbu, bu), (dbd, bd)):
        assert g.shape == p.shape and not g.any()


def _bad(**changes):
    """Valid fwd arguments (T 5, H 96, I 172) with some replaced."""
    x, wg, wu, wd, bg, bu, bd, _ = make_inputs(5, H, I, torch.float32, True)
    args = dict(x=x, w_gate=wg, w_up=wu, w_down=wd, b_gate=bg, b_up=bu, b_down=bd)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, exc, match", [
    (dict(w_up=torch.zeros(I, H - 1)), ValueError,
     r"swiglu_fwd: w_up must have shape \(172, 96\) \(I, H\), the shape of w_gate, got "
     r"\(172, 95\)"),
    (dict(w_down=torch.zeros(I, H)), ValueError,
     r"swiglu_fwd: w_down must have shape \(96, 172\) \(H, I\) for w_gate of shape \(I, H\), "
     r"got \(172, 96\)"),
    (dict(w_gate=torch.zeros(I, H + 1)), ValueError,
     r"swiglu_fwd: w_gate must have shape \(172, 96\) \(I, H\) with H=96 from x, got "
     r"\(172, 97\)"),
    (dict(x=torch.zeros(2, 5, H)), ValueError, r"swiglu_fwd: x must have 2 dims \(T, H\)"),
    (dict(x=torch.zeros(5, H, dtype=torch.int32)), TypeError,
     r"swiglu_fwd: x must be float16, bfloat16, float32 or float64, got int32"),
    (dict(w_up=torch.zeros(I, H, dtype=torch.float16)), TypeError,
     r"swiglu_fwd: w_up must have the dtype of x \(float32\), got float16"),
    (dict(b_gate=torch.zeros(I + 1)), ValueError,
     r"swiglu_fwd: b_gate must have shape \(172,\) \(I,\), got \(173,\)"),
    (dict(b_down=torch.zeros(I)), ValueError,
     r"swiglu_fwd: b_down must have shape \(96,\) \(H,\), got \(172,\)"),
    (dict(w_down=torch.zeros(H, I, device="meta")), RuntimeError,
     r"swiglu_fwd: w_down is on meta but x is on"),
])
def test_fwd_errors(changes, exc, match):
    args = _bad(**{k: v.to(DEVICE) if v.device.type != "meta" else v for k, v in changes.items()})
    with pytest.raises(exc, match=match):
        swiglu_mlp.swiglu_fwd(**args, lora=[], lora_scaling=[], return_gate_up=False)


def test_bwd_errors():
    x, wg, wu, wd, bg, bu, bd, dy = make_inputs(5, H, I, torch.float32, True)
    with pytest.raises(ValueError, match=r"swiglu_bwd: dy must have shape \(5, 96\) \(T, H\), "
                                         r"the shape of x, got \(4, 96\)"):
        swiglu_mlp.swiglu_bwd(dy[:4], x, wg, wu, wd, bg, bu, bd, [], [], None, None, ALL_GRADS)
    gate = torch.zeros(5, I, device=DEVICE)
    with pytest.raises(ValueError, match=r"swiglu_bwd: gate and up must be given together"):
        swiglu_mlp.swiglu_bwd(dy, x, wg, wu, wd, bg, bu, bd, [], [], gate, None, ALL_GRADS)
    with pytest.raises(ValueError, match=r"swiglu_bwd: up must have shape \(5, 172\) \(T, I\), "
                                         r"got \(5, 171\)"):
        swiglu_mlp.swiglu_bwd(dy, x, wg, wu, wd, bg, bu, bd, [], [], gate, gate[:, :-1],
                              ALL_GRADS)


# ------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("T", [1, 7, 129])
def test_bf16_cuda(T, bias, save):
    args = make_inputs(T, H, I, torch.bfloat16, bias, device="cuda")
    check_accuracy(run_kernels(*args, save), eager(*args), reference(*args), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("I_", [11008, 14336], ids=["llama7b", "llama3_8b"])
def test_llama_sizes_cuda(I_, dtype, save):
    """LLaMA MLP sizes (H 4096); reference in fp32 (fp64 GEMMs of this size are too slow)."""
    args = make_inputs(1024, 4096, I_, dtype, False, device="cuda")
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ref = eager(*[t.float() if t is not None else None for t in args])
    finally:
        torch.set_float32_matmul_precision(prec)
    check_accuracy(run_kernels(*args, save), eager(*args), ref, dtype)


# ------------------------------------------------------------------------------------------
# LoRA adapters and needs_grad
# ------------------------------------------------------------------------------------------
LORA_NAMES = ("dA_gate", "dB_gate", "dA_up", "dB_up", "dA_down", "dB_down")
ALL_NAMES = ("y",) + GRAD_NAMES + LORA_NAMES
# needs_grad presets: LoRA training (frozen base), only the B matrices, nothing but dx.
NEEDS = {
    "all": ALL_GRADS,
    "frozen_base": [False] * 6 + [True] * 6,
    "only_B": [False] * 6 + [False, True] * 3,
    "dx_only": [False] * 12,
    "down_weight_and_A": [False, False, True, False, False, True] + [True, False] * 3,
}


def run_lora_kernels(args, lora, scaling, dy, save, needs=ALL_GRADS):
    """The 14 results (y, dx, dW..., db..., dA_gate ... dB_down) of the launchers."""
    y, gate, up = swiglu_mlp.swiglu_fwd(*args, lora, scaling, save == "gate_up")
    if save == "input":
        assert gate.numel() == 0 and up.numel() == 0
        gate = up = None
    grads = swiglu_mlp.swiglu_bwd(dy, *args, lora, scaling, gate, up, needs)
    assert len(grads) == 8 and len(grads[7]) == 6
    return (y, *grads[:7], *grads[7])


def flat_reference(args, lora, scaling, dy, dtype=None):
    y, *rest, dlora = swiglu_lora_grads(args, lora, scaling, dy, dtype)
    return (y, *rest, *dlora)


def check_lora_accuracy(out, base, ref, needs=ALL_GRADS):
    """The accuracy rule (reference.check_vs_baseline) for the 14 results; a gradient not
    wanted or not applicable must be the empty placeholder."""
    wanted = [True, True] + list(needs)
    for name, want, o, b, r in zip(ALL_NAMES, wanted, out, base, ref):
        if r is None or not want:
            assert o.numel() == 0 and o.dim() == 1, f"{name}: expected an empty placeholder"
            continue
        assert o.shape == r.shape and o.dtype == b.dtype, f"{name}: {o.shape} {o.dtype}"
        check_vs_baseline(name, o, b, r, FACTOR_OUT if name == "y" else FACTOR_GRAD)


# (T, dtype, adapter dtype, ranks (gate, up, down; None = no adapter), bias)
LORA_CASES = [
    (17, torch.float32, torch.float32, (4, 4, 4), True),
    (17, torch.float16, torch.float32, (8, 1, 4), False),   # fp32 adapters on an fp16 base
    (65, torch.float32, torch.float32, (1, None, None), True),
    (9, torch.float32, torch.float32, (None, 8, None), False),
    (9, torch.float16, torch.float32, (None, None, 8), True),
    (1, torch.float16, torch.float16, (4, None, 1), False),
]


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("case", range(len(LORA_CASES)))
def test_lora_matches_fp64_reference(case, save):
    T, dtype, lora_dtype, ranks, bias = LORA_CASES[case]
    args, lora, scaling, dy = make_swiglu_lora(T, H, I, dtype, lora_dtype, ranks, bias,
                                                         device=DEVICE)
    check_lora_accuracy(run_lora_kernels(args, lora, scaling, dy, save),
                        flat_reference(args, lora, scaling, dy),
                        flat_reference(args, lora, scaling, dy, torch.float64))


@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("needs", sorted(NEEDS))
def test_lora_needs_grad(needs, save):
    """A subset of gradients: the others come back empty, the wanted ones as with all."""
    args, lora, scaling, dy = make_swiglu_lora(33, H, I, torch.float32, torch.float32,
                                                         (4, 8, 2), True, device=DEVICE)
    flags = NEEDS[needs]
    out = run_lora_kernels(args, lora, scaling, dy, save, flags)
    check_lora_accuracy(out, flat_reference(args, lora, scaling, dy),
                        flat_reference(args, lora, scaling, dy, torch.float64), flags)
    full = run_lora_kernels(args, lora, scaling, dy, save)
    for name, want, o, f in zip(ALL_NAMES, [True, True] + flags, out, full):
        if want:
            torch.testing.assert_close(o, f, rtol=1e-6, atol=1e-6, msg=name)


class _MatmulLog(TorchDispatchMode):
    """The output shapes of every aten matmul."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.shapes.append(tuple(out.shape))
        return out


def test_frozen_base_skips_weight_gemms():
    """needs_grad of a LoRA run with frozen base weights: no weight-gradient GEMM runs (no
    matmul with an (I, H) / (H, I) output), against three in a run that wants them."""
    T = 21
    args, lora, scaling, dy = make_swiglu_lora(T, H, I, torch.float32, torch.float32,
                                               (4, 4, 4), True, device=DEVICE)
    logs = {}
    for name in ("frozen_base", "all"):
        logs[name] = _MatmulLog()
        with logs[name]:
            swiglu_mlp.swiglu_bwd(dy, *args, lora, scaling, None, None, NEEDS[name])

    def weight_shaped(log):
        return sum(shape in ((I, H), (H, I)) for shape in log.shapes)

    assert weight_shaped(logs["frozen_base"]) == 0, logs["frozen_base"].shapes
    assert weight_shaped(logs["all"]) == 3, logs["all"].shapes


def test_lora_save_input_keeps_no_tokens_by_I_tensor():
    """With adapters on all three projections no (T, I) tensor outlives the forward."""
    T = 40
    args, lora, scaling, _ = make_swiglu_lora(T, H, I, torch.float32, torch.float32,
                                                        (4, 4, 4), True, device=DEVICE)
    log = _AllocationLog()
    with log:
        swiglu_mlp.swiglu_fwd(*args, lora, scaling, False)
    gc.collect()
    seen = [ref for shape, ref in log.refs if shape == (T, I)]
    assert seen and all(ref() is None for ref in seen)


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_lora_zero_tokens(save):
    args, lora, scaling, dy = make_swiglu_lora(0, H, I, torch.float32, torch.float32,
                                                         (4, 4, 4), True, device=DEVICE)
    out = run_lora_kernels(args, lora, scaling, dy, save)
    assert out[0].shape == (0, H) and out[1].shape == (0, H)
    for o, p in zip(out[2:], [*args[1:], *lora]):
        assert o.shape == p.shape and not o.any()


def _lora_fwd_error(lora, scaling):
    args, _, _, _ = make_swiglu_lora(5, H, I, torch.float32, torch.float32,
                                               (None,) * 3, False, device=DEVICE)
    swiglu_mlp.swiglu_fwd(*args, lora, scaling, False)


@pytest.mark.parametrize("lora, scaling, exc, match", [
    ([None] * 5, [1.0] * 3, ValueError, r"swiglu_fwd: lora must be \[\] or the 6 entries"),
    ([None] * 6, [], ValueError, r"swiglu_fwd: lora_scaling must have 3 entries"),
    ([torch.zeros(4, H)] + [None] * 5, [1.0] * 3, ValueError,
     r"swiglu_fwd: lora A_gate and B_gate come together"),
    ([torch.zeros(4, H + 1), torch.zeros(I, 4)] + [None] * 4, [1.0] * 3, ValueError,
     r"swiglu_fwd: A_gate must have shape \(4, 96\) \(r, in\) with in = 96, got \(4, 97\)"),
    ([None] * 4 + [torch.zeros(4, I), torch.zeros(H, 3)], [1.0] * 3, ValueError,
     r"swiglu_fwd: B_down must have shape \(96, 4\) \(out, r\) with out = 96 and r from "
     r"A_down, got \(96, 3\)"),
    ([None, None, torch.zeros(4, H), torch.zeros(I, 4, dtype=torch.float16)] + [None] * 2,
     [1.0] * 3, TypeError, r"swiglu_fwd: B_up must have the dtype of A_up"),
    ([torch.zeros(4, H, dtype=torch.float64), torch.zeros(I, 4, dtype=torch.float64)]
     + [None] * 4, [1.0] * 3, TypeError,
     r"swiglu_fwd: A_gate must be float16, bfloat16 or float32 for the Triton kernels"),
])
def test_lora_errors(lora, scaling, exc, match):
    lora = [t.to(DEVICE) if t is not None else None for t in lora]
    with pytest.raises(exc, match=match):
        _lora_fwd_error(lora, scaling)


def test_needs_grad_length_error():
    x, wg, wu, wd, bg, bu, bd, dy = make_inputs(5, H, I, torch.float32, True)
    with pytest.raises(ValueError, match=r"swiglu_bwd: needs_grad must have 12 entries"):
        swiglu_mlp.swiglu_bwd(dy, x, wg, wu, wd, bg, bu, bd, [], [], None, None, [True] * 7)


@pytest.mark.gpu
@pytest.mark.parametrize("save", ["input", "gate_up"])
@pytest.mark.parametrize("ranks", [(16, 16, 16), (8, None, 64)], ids=["r16", "mixed"])
def test_lora_bf16_cuda(ranks, save):
    """fp32 adapters on a bf16 base, the PEFT default."""
    args, lora, scaling, dy = make_swiglu_lora(300, 256, 688, torch.bfloat16,
                                                         torch.float32, ranks, True, "cuda")
    check_lora_accuracy(run_lora_kernels(args, lora, scaling, dy, save),
                        flat_reference(args, lora, scaling, dy),
                        flat_reference(args, lora, scaling, dy, torch.float64))
