"""Tests of ckpt_ext.ops.linear_cross_entropy: the LM-head loss without (T, V) logits.

Every case runs the op twice on the same inputs: through the ATen CPU kernels and through the
Triton launchers (the interpreter on CPU: fp32 / fp16 only; bf16 on a GPU). The reference is
HF's computation (``lm_head`` then transformers' ``ForCausalLMLoss`` on upcast logits) in
float64; the baseline the same at the test dtype. Accuracy rule of the suite: the op's error is
at most 2x (loss) / 3x (gradients) the baseline's (``reference.check_vs_baseline``).
"""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import ckpt_ext
import ckpt_ext.ops as ops
from ckpt_ext import config, use_triton
from ckpt_ext.kernels import linear_cross_entropy as lce_kernels
from reference import (FACTOR_GRAD, FACTOR_OUT, check_f64, check_vs_baseline,
                       family_rms_norm_reference, magnitude)

OPS = torch.ops.ckpt_ext
F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
IGNORE = -100


def make_inputs(lead, H, V, dtype, bias=False, ignored=0.25, seed=0, device="cpu"):
    """hidden (*lead, H), weight (V, H) with logits spread over a few units, bias (V,) or None,
    labels (*lead) with about `ignored` of them IGNORE. Drawn in float64, rounded to dtype."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).to(device)

    hidden = rnd(*lead, H)
    weight = rnd(V, H, scale=2.0 * H ** -0.5)
    b = rnd(V, scale=0.5) if bias else None
    labels = torch.randint(0, V, lead, generator=g)
    labels[torch.rand(lead, generator=g) < ignored] = IGNORE
    return hidden, weight, b, labels.to(device)


def hf_loss(hidden, weight, bias, labels, reduction="mean", num_items_in_batch=None,
            logit_scale=1.0, softcap=0.0):
    """HF: logits = lm_head(hidden), upcast to float32 (float64 stays), then cross-entropy as
    transformers' fixed_cross_entropy (sum / num_items_in_batch when it is given). With
    logit_scale / softcap, on softcap tanh(logit_scale logits / softcap) of the upcast logits
    (logit_scale logits without a cap)."""
    logits = F.linear(hidden, weight, bias)
    logits = logits if logits.dtype == F64 else logits.float()
    logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    flat, target = logits.reshape(-1, weight.shape[0]), labels.reshape(-1)
    if num_items_in_batch is not None:
        return F.cross_entropy(flat, target, ignore_index=IGNORE, reduction="sum") / \
            num_items_in_batch
    out = F.cross_entropy(flat, target, ignore_index=IGNORE, reduction=reduction)
    return out.reshape(labels.shape) if reduction == "none" else out


def fused_loss(hidden, weight, bias, labels, reduction="mean", num_items_in_batch=None,
               logit_scale=1.0, softcap=0.0):
    return ops.linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=IGNORE,
                                    reduction=reduction, num_items_in_batch=num_items_in_batch,
                                    logit_scale=logit_scale, softcap=softcap)


def run(fn, hidden, weight, bias, labels, dout, **kw):
    """(loss, dhidden, dweight, dbias) of fn at the inputs' dtype, grads of (loss * dout).sum()."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (hidden, weight, bias)]
    loss = fn(leaves[0], leaves[1], leaves[2], labels, **kw)
    grads = torch.autograd.grad((loss * dout.to(loss.dtype)).sum(),
                                [t for t in leaves if t is not None])
    return (loss.detach(),) + tuple(grads) + ((None,) if bias is None else ())


def backend_context(backend):
    """"triton" on CPU: the Triton launchers through the interpreter. On a GPU the Triton
    launchers serve CUDA tensors anyway."""
    if backend == "triton" and not CUDA:
        return use_triton("cpu")
    return contextlib.nullcontext()


def check_case(backend, lead, H, V, dtype, bias=False, reduction="mean", num_items=None,
               ignored=0.25, seed=0, logit_scale=1.0, softcap=0.0, logits_spread=1.0):
    hidden, weight, b, labels = make_inputs(lead, H, V, dtype, bias, ignored, seed, DEVICE)
    if logits_spread != 1.0:   # logits of tens of units, so that a soft-cap bends them
        weight = (weight.double() * logits_spread).to(dtype)
    shape = () if reduction != "none" else labels.shape
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    dout = dout.to(DEVICE)
    kw = dict(reduction=reduction, num_items_in_batch=num_items, logit_scale=logit_scale,
              softcap=softcap)
    ref = run(hf_loss, *(t.double() if t is not None else None for t in (hidden, weight, b)),
              labels, dout, **kw)
    base = run(hf_loss, hidden, weight, b, labels, dout, **kw)
    with backend_context(backend):
        got = run(fused_loss, hidden, weight, b, labels, dout, **kw)
    assert got[0].dtype == (F64 if dtype == F64 else torch.float32)
    assert got[0].shape == ref[0].shape
    grad_scale = magnitude(*(r for r in ref[1:] if r is not None))
    for name, g, bs, r, factor in zip(("loss", "dhidden", "dweight", "dbias"), got, base, ref,
                                      (FACTOR_OUT,) + (FACTOR_GRAD,) * 3):
        if r is None:
            continue
        assert name == "loss" or g.dtype == dtype
        assert torch.isfinite(g).all(), name
        scale = None if name == "loss" else grad_scale
        if dtype == F64:
            check_f64(name, g, r, scale=scale)
        else:
            check_vs_baseline(name, g, bs, r, factor, dtype, scale=scale)


# --------------------------------------------------------------------------------------------
# Accuracy: ATen CPU kernels
# --------------------------------------------------------------------------------------------
CPU_CASES = [
    # (lead, H, V, dtype, bias, reduction)
    ((1,), 16, 7, torch.float32, False, "mean"),
    ((17,), 24, 131, torch.float32, True, "mean"),
    ((2, 17), 24, 131, torch.bfloat16, False, "sum"),
    ((3, 43), 40, 257, torch.float16, True, "none"),
    ((129,), 32, 97, torch.float64, True, "mean"),
    ((127,), 48, 300, torch.bfloat16, True, "mean"),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-V{c[2]}-"
                         f"{str(c[3])[6:]}-{'bias' if c[4] else 'nobias'}-{c[5]}")
def test_cpu_matches_hf(case):
    if CUDA:
        pytest.skip("the ATen kernels serve CPU tensors; the GPU runs the Triton cases")
    lead, H, V, dtype, bias, reduction = case
    check_case("aten", lead, H, V, dtype, bias, reduction)


def test_cpu_several_token_chunks():
    """T * V above the CPU kernels' byte cap (CKPT_EXT_CHUNK_BYTES, 64 MiB by default): two
    token chunks, dweight accumulated across them."""
    if CUDA:
        pytest.skip("CPU kernels")
    check_case("aten", (900,), 8, 20000, torch.float32, bias=True)


def test_cpu_float64_gradcheck():
    hidden, weight, b, labels = make_inputs((5,), 6, 11, F64, bias=True)
    leaves = [t.requires_grad_() for t in (hidden, weight, b)]
    assert torch.autograd.gradcheck(
        lambda h, w, bb: ops.linear_cross_entropy(h, w, labels, bias=bb, reduction="none"),
        leaves)


# --------------------------------------------------------------------------------------------
# Accuracy: Triton launchers (interpreter on CPU)
# --------------------------------------------------------------------------------------------
TRITON_CASES = [
    # (lead, H, V, dtype, bias, reduction): V not a multiple of the interpreter's 32-wide tiles
    # or of its 64-column backward chunk; T not a multiple of 16; H not of 32.
    ((1,), 40, 7, torch.float32, False, "mean"),        # one split, one chunk
    ((37,), 40, 150, torch.float32, True, "mean"),      # two splits, three chunks
    ((2, 17), 48, 131, torch.float16, False, "none"),
    ((3, 11), 24, 97, torch.float16, True, "sum"),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-V{c[2]}-"
                         f"{str(c[3])[6:]}-{'bias' if c[4] else 'nobias'}-{c[5]}")
def test_triton_matches_hf(case):
    lead, H, V, dtype, bias, reduction = case
    check_case("triton", lead, H, V, dtype, bias, reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [32000, 32003])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_hf_gpu(V, dtype):
    check_case("triton", (2, 129), 256, V, dtype, bias=False)
    check_case("triton", (1, 1), 256, V, dtype, bias=True, reduction="none")


def test_triton_single_vocab_chunk(monkeypatch):
    """One backward chunk: dhidden is one GEMM (no fp32 accumulation path)."""
    monkeypatch.setattr(lce_kernels, "INTERPRETER_VOCAB_CHUNK", 1024)
    check_case("triton", (19,), 40, 150, torch.float32, bias=True)


# --------------------------------------------------------------------------------------------
# Reductions, num_items_in_batch, ignored tokens
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_num_items_in_batch(backend, kind):
    """transformers divides the summed loss by num_items_in_batch (gradient accumulation)."""
    n = 53 if kind == "int" else torch.tensor(53)
    check_case(backend, (2, 21), 24, 131, torch.float32, bias=False, num_items=n)


def test_matches_transformers_fixed_cross_entropy():
    """The same number as transformers' own loss function on the same logits."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    hidden, weight, _, labels = make_inputs((2, 13), 16, 50, torch.float32)
    logits = F.linear(hidden, weight)
    for n in (None, 17, torch.tensor(17)):
        want = loss_utils.fixed_cross_entropy(logits.view(-1, 50), labels.view(-1), n)
        got = ops.linear_cross_entropy(hidden, weight, labels, num_items_in_batch=n)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("sum", None), ("none", None),
                                                 ("mean", 0), ("mean", 5)])
def test_all_tokens_ignored(backend, reduction, num_items):
    """Nothing to average: 0 and zero gradients, never NaN. (F.cross_entropy, and so
    transformers, gives NaN for the mean of nothing, 0/0; with num_items_in_batch > 0 it
    gives 0, as here.)"""
    hidden, weight, b, labels = make_inputs((2, 9), 16, 37, torch.float32, bias=True)
    labels = torch.full_like(labels, IGNORE)
    with backend_context(backend):
        got = run(fused_loss, hidden, weight, b, labels,
                  torch.ones(labels.shape if reduction == "none" else ()),
                  reduction=reduction, num_items_in_batch=num_items)
    for t in got:
        assert torch.isfinite(t).all() and (t == 0).all()
    if reduction == "mean" and num_items is None:
        assert torch.isnan(hf_loss(hidden, weight, b, labels))  # what HF returns instead
    if num_items == 5:
        assert hf_loss(hidden, weight, b, labels, num_items_in_batch=5) == 0


def test_num_items_tensor_needs_no_host_sync():
    """With a tensor num_items_in_batch (and the default count) the wrapper never reads a
    value on the host: it runs under FakeTensorMode, where .item() would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    hidden, weight, _, labels = make_inputs((2, 5), 8, 11, torch.float32)
    with FakeTensorMode() as mode:
        h, w, lab = (mode.from_tensor(t) for t in (hidden, weight, labels))
        for n in (None, mode.from_tensor(torch.tensor(7))):
            loss = ops.linear_cross_entropy(h, w, lab, num_items_in_batch=n)
            assert loss.shape == () and loss.dtype == torch.float32


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_per_token_stats_of_the_kernel_op(backend):
    """loss[t] = lse[t] - logit[t, label], 0 for ignored tokens; lse = logsumexp of the row."""
    hidden, weight, b, labels = make_inputs((23,), 16, 45, F64, bias=True)
    logits = F.linear(hidden, weight, b)
    want_lse = torch.logsumexp(logits, -1)
    want_loss = torch.where(labels != IGNORE, want_lse - logits.gather(
        1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    cases = [((hidden, weight, b), 1e-12)] if backend == "aten" else []  # no fp64 in Triton
    cases.append(([t.float() for t in (hidden, weight, b)], 2e-5))
    with backend_context(backend):
        for (h, w, bb), tol in cases:
            loss, lse = OPS.linear_cross_entropy_fwd(h, w, bb, labels, IGNORE)
            torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
            torch.testing.assert_close(loss.double(), want_loss, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# Memory: nothing of size T x V is saved
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_saved_bytes_have_no_logits(backend, reduction):
    T, H, V = 64, 16, 500
    hidden, weight, _, labels = make_inputs((T,), H, V, torch.float32)
    hidden.requires_grad_()
    weight = torch.nn.Parameter(weight)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with backend_context(backend):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fused_loss(hidden, weight, None, labels, reduction=reduction)
        saved = ckpt_ext.saved_activation_bytes(fused_loss, hidden, weight, None, labels,
                                                reduction=reduction)
        hf = ckpt_ext.saved_activation_bytes(hf_loss, hidden, weight, None, labels)
    assert all(math.prod(s) < T * V for s in shapes), shapes
    # hidden (fp32), labels (int64), lse (fp32); the mean also keeps its 0-dim int64 divisor
    # and the 0-dim bool that zeroes a mean over nothing without a host sync.
    assert saved == T * (4 * H + 8 + 4) + (8 + 1 if reduction == "mean" else 0)
    # HF keeps hidden, the fp32 log-softmax (T, V), the labels and a 4-byte total weight.
    assert hf == T * (4 * H + 4 * V + 8) + 4


# --------------------------------------------------------------------------------------------
# opcheck and input errors
# --------------------------------------------------------------------------------------------
def _opcheck_samples():
    samples = []
    for bias in (False, True):
        hidden, weight, b, labels = make_inputs((7,), 12, 10, torch.float32, bias=bias)
        lv = [t.requires_grad_() if t is not None else None for t in (hidden, weight, b)]
        samples.append(("linear_cross_entropy_fwd", (*lv, labels, IGNORE)))
        _, lse = OPS.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE)
        dloss = torch.randn(7)
        for mask in ([True, True, True], [True, False, False], [False, True, bias]):
            samples.append(("linear_cross_entropy_bwd",
                            (dloss, *(t.detach() if t is not None else None for t in lv),
                             labels, lse, IGNORE, mask)))
    return samples


@pytest.mark.parametrize("sample", range(len(_opcheck_samples())))
def test_opcheck(sample):
    name, args = _opcheck_samples()[sample]
    torch.library.opcheck(getattr(OPS, name).default, args)


def _bad(change):
    hidden, weight, b, labels = make_inputs((6,), 8, 10, torch.float32, bias=True)
    args = dict(hidden=hidden, weight=weight, bias=b, labels=labels)
    args.update(change(args))
    return args


ERRORS = [
    (lambda a: dict(labels=a["labels"].int()), TypeError, "labels must be int64"),
    (lambda a: dict(weight=a["weight"][:, :5]), ValueError, "weight must have shape"),
    (lambda a: dict(bias=a["bias"][:4]), ValueError, "bias must have shape"),
    (lambda a: dict(weight=a["weight"].double()), TypeError, "weight must have the dtype"),
    (lambda a: dict(labels=a["labels"][:5]), ValueError, "labels must have shape"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", range(len(ERRORS)))
def test_kernel_op_errors_name_the_argument(device, case):
    change, exc, match = ERRORS[case]
    a = {k: v.to(device) for k, v in _bad(change).items()}
    with pytest.raises(exc, match=match):
        OPS.linear_cross_entropy_fwd(a["hidden"], a["weight"], a["bias"], a["labels"], IGNORE)


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_label_out_of_range(backend):
    hidden, weight, _, labels = make_inputs((6,), 8, 10, torch.float32)
    labels[3] = 10
    want = r"labels must be in \[0, V=10\).* got 10 at token 3"
    with backend_context(backend), pytest.raises(ValueError, match=want):
        ops.linear_cross_entropy(hidden, weight, labels)


@pytest.mark.gpu
def test_label_out_of_range_gpu_gives_nan():
    """On a GPU a label check would cost a host sync: the token's loss is NaN instead."""
    hidden, weight, _, labels = make_inputs((6,), 64, 100, torch.bfloat16, device="cuda")
    labels[3] = 100
    loss = ops.linear_cross_entropy(hidden, weight, labels, reduction="none")
    loss = loss.cpu()
    assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(6) != 3]).all()


def test_wrapper_errors():
    hidden, weight, _, labels = make_inputs((2, 3), 8, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction must be"):
        ops.linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="num_items_in_batch replaces"):
        ops.linear_cross_entropy(hidden, weight, labels, reduction="sum", num_items_in_batch=4)
    with pytest.raises(ValueError, match=r"labels must have shape hidden.shape\[:-1\]"):
        ops.linear_cross_entropy(hidden, weight, labels.view(-1))


# --------------------------------------------------------------------------------------------
# Frozen inputs: only the gradients autograd asks for are computed
# --------------------------------------------------------------------------------------------
FROZEN = {  # which of (hidden, weight, bias) require grad
    "lora_head": (True, False, False),      # a frozen LM head under LoRA
    "frozen_weight_trained_bias": (True, False, True),
    "frozen_hidden": (False, True, True),
}


def _grads_frozen(fn, hidden, weight, bias, labels, dout, wants):
    leaves = [t.detach().clone().requires_grad_(w) if t is not None else None
              for t, w in zip((hidden, weight, bias), wants)]
    loss = fn(leaves[0], leaves[1], leaves[2], labels)
    trained = [t for t in leaves if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad((loss * dout).sum(), trained))
    return [next(grads) if t is not None and t.requires_grad else None for t in leaves]


@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_frozen_inputs_gradients_match_hf(backend, frozen):
    """The gradients that are asked for equal HF's (fp64 reference, fp32 baseline), in both
    kernels' paths (the Triton launcher walks token chunks when only dhidden is wanted)."""
    if backend == "aten" and CUDA:
        pytest.skip("the ATen kernels serve CPU tensors")
    wants = FROZEN[frozen]
    seed = int(torch.randint(1 << 30, ()))  # fresh inputs each run
    hidden, weight, b, labels = make_inputs((2, 19), 40, 150, torch.float32, bias=True,
                                            seed=seed, device=DEVICE)
    dout = torch.tensor(1.7, device=DEVICE)
    ref = _grads_frozen(hf_loss, hidden.double(), weight.double(), b.double(), labels, dout,
                        wants)
    base = _grads_frozen(hf_loss, hidden, weight, b, labels, dout, wants)
    with backend_context(backend):
        got = _grads_frozen(fused_loss, hidden, weight, b, labels, dout, wants)
    scale = magnitude(*(r for r in ref if r is not None))
    for name, g, bs, r, want in zip(("dhidden", "dweight", "dbias"), got, base, ref, wants):
        assert (g is None) == (not want), name
        if want:
            check_vs_baseline(name, g, bs, r, FACTOR_GRAD, torch.float32, scale=scale)


def _dweight_gemms(fn, H, V):
    """The matmuls of fn's backward that form a weight gradient: inputs (a, k) x (k, H) with a
    reduction over k tokens (k != V; the dhidden GEMM reduces over V, the logits GEMM gives
    (k, V))."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    found = []
    for e in prof.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::matmul"):
            # the operands are two neighbouring 2-D shapes (an out= or a bias operand may
            # come before or after them)
            shapes = [s for s in e.input_shapes if len(s) == 2]
            if any(a[1] == b2[0] and b2[1] == H and a[1] != V
                   for a, b2 in zip(shapes, shapes[1:])):
                found.append((e.name, shapes))
    return found


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_frozen_head_forms_no_weight_gradient(backend):
    """Under LoRA the head's weight is frozen: backward must not run the (V, T) x (T, H)
    GEMM of dweight. Checked on the recorded operators; with a trained weight the same check
    finds that GEMM (so it can fail)."""
    if backend == "aten" and CUDA:
        pytest.skip("the ATen kernels serve CPU tensors")
    H, V = 40, 150
    hidden, weight, _, labels = make_inputs((37,), H, V, torch.float32, device=DEVICE)
    for train_weight in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(train_weight)
        with backend_context(backend):
            loss = fused_loss(h, w, None, labels)
            gemms = _dweight_gemms(lambda: loss.backward(), H, V)
        assert h.grad is not None
        assert bool(gemms) == train_weight, gemms
        assert (w.grad is not None) == train_weight


def test_frozen_head_backward_peak_has_no_weight_sized_buffer():
    """The CPU backward under a frozen head holds a logits chunk and dhidden, never a (V, H)
    buffer: its peak is far under V*H*4 bytes, which a trained head's backward reaches."""
    if CUDA:
        pytest.skip("CPU kernels")
    T, H, V = 40, 256, 8192                                   # dweight: 8 MiB in fp32
    hidden, weight, _, labels = make_inputs((T,), H, V, torch.float32)
    peaks = {}
    for train_weight in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(train_weight)
        loss = fused_loss(h, w, None, labels)
        peaks[train_weight] = ckpt_ext.peak_memory_bytes(lambda t: t.backward(), loss)
    assert peaks[True] >= 4 * V * H, peaks
    # the (T, V) logits chunk (1.25 MiB), dhidden (40 KiB) and small per-token tensors
    assert peaks[False] <= 4 * T * V + 4 * T * H + 256 * 1024, peaks


# --------------------------------------------------------------------------------------------
# The byte cap of the CPU kernel's logits chunks (CKPT_EXT_CHUNK_BYTES)
# --------------------------------------------------------------------------------------------
def test_cpu_chunk_byte_cap(monkeypatch):
    """A small cap: many one- and few-row chunks, the same results; the backward's peak
    follows the cap; a bad value is refused naming the variable (set in the environment or
    by ckpt_ext.config.update)."""
    if CUDA:
        pytest.skip("CPU kernels")
    V = 131
    config.update(chunk_bytes=str(3 * 4 * V + 5))   # 3 rows per chunk
    check_case("aten", (2, 17), 24, V, torch.float32, bias=True)
    config.update(chunk_bytes="1")                   # one row at a time
    check_case("aten", (2, 17), 24, V, torch.bfloat16, bias=True, reduction="sum")

    T, H, V = 512, 64, 4096
    hidden, weight, _, labels = make_inputs((T,), H, V, torch.float32)
    peaks = {}
    for cap in ("64KiB", "4MiB"):
        config.update(chunk_bytes=cap)
        h = hidden.clone().requires_grad_()
        loss = fused_loss(h, weight, None, labels)
        peaks[cap] = ckpt_ext.peak_memory_bytes(lambda t: t.backward(), loss)
    # 4 MiB: a (256, V) fp32 chunk; 64 KiB: (4, V). dhidden (128 KiB) in both.
    assert peaks["4MiB"] >= 4 * 2**20, peaks
    assert peaks["64KiB"] <= 4 * T * H + 2 * 64 * 1024 + 128 * 1024, peaks

    for bad in ("0", "-5", "lots", "12 PiB", "2TiB", 0, True):
        with pytest.raises(ValueError, match=r"CKPT_EXT_CHUNK_BYTES\)? must be a positive"):
            config.update(chunk_bytes=bad)
        if isinstance(bad, str):
            with pytest.raises(ValueError, match="CKPT_EXT_CHUNK_BYTES must be a positive"):
                config.from_environment({"CKPT_EXT_CHUNK_BYTES": bad})


@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("n", [0, 0.0, "tensor", "tensor1", "float_tensor"])
def test_num_items_in_batch_zero_is_zero_with_zero_gradients(backend, n):
    """num_items_in_batch == 0 with labels to count: the documented 0 and zero gradients (not
    the summed loss), int, float and tensor forms alike."""
    seed = int(torch.randint(2**31, ()))
    hidden, weight, b, labels = make_inputs((2, 11), 16, 37, torch.float32, bias=True, seed=seed)
    assert (labels != IGNORE).any()
    n = {"tensor": torch.tensor(0), "tensor1": torch.tensor([0]),
         "float_tensor": torch.tensor(0.0)}.get(n, n)
    with backend_context(backend):
        got = run(fused_loss, hidden, weight, b, labels, torch.ones(()), num_items_in_batch=n)
        summed = run(fused_loss, hidden, weight, b, labels, torch.ones(()), reduction="sum")
    assert summed[0] > 0 and (summed[1] != 0).any()
    assert got[0].shape == () and got[0].dtype == torch.float32
    for t in got:
        assert torch.isfinite(t).all() and (t == 0).all()


@pytest.mark.parametrize("n", [torch.tensor([23]), torch.tensor([[23.0]]), 23.0])
def test_num_items_in_batch_forms_divide_like_transformers(n):
    """A one-element tensor (any shape) or a float divides as transformers does; the loss stays
    a 0-d tensor."""
    seed = int(torch.randint(2**31, ()))
    hidden, weight, b, labels = make_inputs((3, 7), 16, 29, torch.float64, seed=seed)
    got = run(fused_loss, hidden, weight, b, labels, torch.ones(()), num_items_in_batch=n)
    want = run(hf_loss, hidden, weight, b, labels, torch.ones(()),
               num_items_in_batch=float(n.reshape(()).item()) if torch.is_tensor(n) else n)
    assert got[0].shape == ()
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_bad_options_name_the_argument():
    hidden, weight, _, labels = make_inputs((2, 3), 8, 10, torch.float32)
    cases = [
        (dict(num_items_in_batch=torch.tensor([2, 3])), ValueError,
         r"num_items_in_batch must be a number or a tensor with one real element.*\(2,\)"),
        (dict(num_items_in_batch=torch.tensor(True)), ValueError, "num_items_in_batch must be"),
        (dict(num_items_in_batch="4"), TypeError, "num_items_in_batch must be None, a number"),
        (dict(num_items_in_batch=True), TypeError, "num_items_in_batch must be None, a number"),
        (dict(num_items_in_batch=-2), ValueError, "num_items_in_batch must be finite and >= 0"),
        (dict(num_items_in_batch=math.nan), ValueError, "num_items_in_batch must be finite"),
        (dict(ignore_index=-100.5), TypeError, r"ignore_index must be an int, got -100.5"),
        (dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
        (dict(ignore_index="-100"), TypeError, "ignore_index must be an int"),
        (dict(ignore_index=torch.tensor(-100.5)), TypeError, "ignore_index must be an int"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            ops.linear_cross_entropy(hidden, weight, labels, **kw)


def test_integer_like_ignore_index():
    """numpy and 0-d tensor integers are the int they hold."""
    np = pytest.importorskip("numpy")
    hidden, weight, b, labels = make_inputs((2, 9), 8, 10, torch.float64, seed=3)
    labels[labels == IGNORE] = 7
    labels[0, :4] = 7
    want = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 10), labels.reshape(-1),
                           ignore_index=7)
    for ii in (7, np.int64(7), torch.tensor(7)):
        got = ops.linear_cross_entropy(hidden, weight, labels, ignore_index=ii)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# The final RMSNorm inside the op (norm_weight / norm_eps)
# --------------------------------------------------------------------------------------------
EPS = 1e-5


def hf_norm(x, w, eps=EPS):
    """HF LlamaRMSNorm: the rows normalised in fp32 (fp64 stays), cast back, times weight."""
    xf = x if x.dtype == F64 else x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_normed_loss(hidden, norm_weight, weight, bias, labels, **kw):
    return hf_loss(hf_norm(hidden, norm_weight).to(weight.dtype), weight, bias, labels, **kw)


def fused_normed_loss(hidden, norm_weight, weight, bias, labels, **kw):
    return ops.linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=IGNORE,
                                    norm_weight=norm_weight, norm_eps=EPS, **kw)


def run_normed(fn, tensors, labels, dout, frozen=(), **kw):
    """(loss, *grads) of fn over tensors (hidden, norm_weight, weight, bias); the names in
    frozen get no gradient."""
    names = ("hidden", "norm_weight", "weight", "bias")
    leaves = [None if t is None else t.detach().clone().requires_grad_(n not in frozen)
              for n, t in zip(names, tensors)]
    loss = fn(*leaves, labels, **kw)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad((loss * dout.to(loss.dtype)).sum(), wanted)
    out, it = {"loss": loss.detach()}, iter(grads)
    for n, t in zip(names, leaves):
        if t is not None and t.requires_grad:
            out[n] = next(it)
    return out


def normed_inputs(T, H, V, dtype, head_dtype, bias, seed):
    hidden, weight, b, labels = make_inputs((T,), H, V, head_dtype, bias, seed=seed,
                                            device=DEVICE)
    g = torch.Generator().manual_seed(seed + 7)
    hidden = (torch.randn(T, H, generator=g, dtype=F64) * 3.0).to(dtype).to(DEVICE)
    norm_weight = (1.0 + 0.3 * torch.randn(H, generator=g, dtype=F64)).to(dtype).to(DEVICE)
    return (hidden, norm_weight, weight, b), labels


NORMED_CASES = [
    # (backend, T, H, V, dtype of hidden and norm, dtype of the head, bias)
    ("aten", 37, 24, 131, torch.float32, torch.float32, True),
    ("aten", 50, 32, 97, torch.bfloat16, torch.bfloat16, False),
    ("aten", 29, 40, 61, torch.float32, torch.bfloat16, True),    # autocast: fp32 rows, bf16 head
    ("aten", 19, 16, 33, torch.float64, torch.float64, True),
    ("triton", 37, 24, 131, torch.float32, torch.float32, True),
    ("triton", 45, 32, 70, torch.float16, torch.float16, False),
]


@pytest.mark.parametrize("case", NORMED_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-"
                         f"{str(c[4])[6:]}-{str(c[5])[6:]}-{'bias' if c[6] else 'nobias'}")
@pytest.mark.parametrize("rows", [None, 1, 17], ids=["one-chunk", "rows1", "rows17"])
def test_final_norm_inside_the_head_matches_hf(monkeypatch, case, rows):
    """norm_weight: HF's norm then head within the accuracy rule against float64, whatever
    the chunk (one chunk, one row, 17 rows: not a divisor of T), every gradient."""
    backend, T, H, V, dtype, head_dtype, bias = case
    if CUDA and backend == "aten":
        pytest.skip("the ATen kernels serve CPU tensors; the GPU runs the Triton cases")
    if rows is not None:  # the op's chunk: `rows` fp32 rows of H (fp64: 8 bytes an element)
        config.update(chunk_bytes=str(rows * H * max(4, dtype.itemsize)))
    tensors, labels = normed_inputs(T, H, V, dtype, head_dtype, bias, seed=T)
    dout = torch.randn((), dtype=F64).to(DEVICE)
    ref = run_normed(hf_normed_loss, [None if t is None else t.double() for t in tensors],
                     labels, dout)
    base = run_normed(hf_normed_loss, tensors, labels, dout)
    with backend_context(backend):
        got = run_normed(fused_normed_loss, tensors, labels, dout)
    assert set(got) == set(ref)
    for name in ("hidden", "norm_weight", "weight", "bias"):
        if name in got:
            want = dict(zip(("hidden", "norm_weight", "weight", "bias"), tensors))[name].dtype
            assert got[name].dtype == want, name
    scale = magnitude(*(v for k, v in ref.items() if k != "loss"))
    for name, r in ref.items():
        g = got[name]
        assert torch.isfinite(g).all(), name
        if dtype == F64:
            check_f64(name, g, r, scale=None if name == "loss" else scale)
        else:
            factor = FACTOR_OUT if name == "loss" else FACTOR_GRAD
            check_vs_baseline(name, g, base[name], r, factor,
                              torch.promote_types(dtype, head_dtype) if name == "loss"
                              else head_dtype if name in ("weight", "bias") else dtype,
                              scale=None if name == "loss" else scale)


def test_final_norm_chunks_change_nothing_in_fp32(monkeypatch):
    """fp32: the chunked op equals its one-chunk result to fp32 rounding of the sums."""
    tensors, labels = normed_inputs(61, 24, 53, torch.float32, torch.float32, True, seed=3)
    dout = torch.tensor(0.7)
    one = run_normed(fused_normed_loss, tensors, labels, dout)
    for rows in (1, 7, 60):
        config.update(chunk_bytes=str(rows * 24 * 4))
        got = run_normed(fused_normed_loss, tensors, labels, dout)
        for name, g in one.items():
            torch.testing.assert_close(got[name], g, rtol=2e-6, atol=1e-7, msg=name)


def test_final_norm_frozen_weights_get_no_gradient_work():
    """LoRA: the head and the norm frozen; only dhidden is formed, and it is the same."""
    if CUDA:
        pytest.skip("CPU kernels (the profiler names the CPU GEMMs)")
    tensors, labels = normed_inputs(33, 16, 41, torch.float32, torch.float32, False, seed=4)
    dout = torch.tensor(1.3)
    full = run_normed(fused_normed_loss, tensors, labels, dout)
    with torch.profiler.profile() as prof:
        frozen = run_normed(fused_normed_loss, tensors, labels, dout,
                            frozen=("norm_weight", "weight"))
    assert set(frozen) == {"loss", "hidden"}
    torch.testing.assert_close(frozen["hidden"], full["hidden"], rtol=0, atol=0)
    # forward logits + backward logits and dhidden: 3 GEMMs, no dweight GEMM
    mms = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::mm_out")]
    assert len(mms) <= 3, [e.name for e in mms]


def test_final_norm_keeps_only_the_prenorm_rows(monkeypatch):
    """Saved: hidden (T, H), labels and the lse; no normed copy. Backward's peak follows the
    byte cap, not T."""
    if CUDA:
        pytest.skip("CPU allocator")
    T, H, V = 2048, 64, 96
    tensors, labels = normed_inputs(T, H, V, torch.float32, torch.float32, False, seed=5)
    hidden, norm_weight, weight, _ = tensors
    norm_weight, weight = torch.nn.Parameter(norm_weight), torch.nn.Parameter(weight)
    h = hidden.clone().requires_grad_()
    saved = ckpt_ext.saved_activation_bytes(
        lambda: fused_normed_loss(h, norm_weight, weight, None, labels))
    # hidden, labels, lse; the mean's 0-dim count (int64) and its nonzero flag (bool)
    assert saved == 4 * T * H + 8 * T + 4 * T + 8 + 1, saved
    peaks = {}
    for cap in ("1MiB", "32KiB"):
        config.update(chunk_bytes=cap)
        h = hidden.clone().requires_grad_()
        loss = fused_normed_loss(h, norm_weight, weight, None, labels)
        peaks[cap] = ckpt_ext.peak_memory_bytes(lambda t: t.backward(), loss)
    # dhidden (512 KiB) in both; 1 MiB: one chunk's rows, normed rows, dy and logits
    # (2048 rows of 256 B and of 384 B); 32 KiB: 128-row chunks
    assert peaks["1MiB"] >= 4 * T * H + 3 * 4 * T * H, peaks
    assert peaks["32KiB"] <= 4 * T * H + 8 * 32 * 1024 + 64 * 1024, peaks


def test_final_norm_trained_head_sums_no_weight_gradient_over_token_chunks(monkeypatch):
    """Training the head with fewer tokens than walks_vocabulary's bound, over many token
    chunks of the byte cap: the backward normalises the rows in one piece, so its peak holds
    the weight gradient once, not an fp32 sum of it beside each chunk's (4 V H more); with
    more tokens than the bound the token walk's peak has that sum (so the check can fail),
    beside one chunk's gradient only (a chunk's gradient kept while the next one is formed
    was 4 V H more: 11% of an H200 step's peak at S 128K). Both give the same gradients."""
    if CUDA:
        pytest.skip("CPU allocator")
    from ckpt_ext._normed_head import walks_vocabulary
    H, V = 64, 4096
    head_dtype = torch.float32   # (CPU bf16 GEMMs are too slow for the token walk's size)
    e = head_dtype.itemsize
    peaks, grads = {}, {}
    for T, rows in ((96, 16), (2048, 256)):   # 96 tokens: one piece; 2048: token walk
        assert walks_vocabulary(T, V, e) == (T == 96)
        tensors, labels = normed_inputs(T, H, V, torch.float32, head_dtype, False, seed=T)
        hidden, norm_weight, weight, _ = tensors
        weight = torch.nn.Parameter(weight)
        config.update(chunk_bytes=str(rows * H * 4))   # chunks of `rows`
        h = hidden.clone().requires_grad_()
        loss = fused_normed_loss(h, norm_weight, weight, None, labels)
        peaks[T] = ckpt_ext.peak_memory_bytes(lambda t: t.backward(), loss)
        grads[T] = (h.grad, weight.grad)
        if T == 96:   # against the same op with one chunk (the cap above all rows)
            config.update(chunk_bytes=str(T * H * 8))
            h1, w1 = hidden.clone().requires_grad_(), weight.detach().clone().requires_grad_()
            fused_normed_loss(h1, norm_weight, w1, None, labels).backward()
            # the same sums in another order (the CPU kernel's row chunks follow the cap)
            torch.testing.assert_close(h.grad, h1.grad)
            torch.testing.assert_close(weight.grad, w1.grad)
    dw = e * V * H
    # one piece: dweight once, rows and their gradients of 96 tokens, a logits chunk of the cap
    assert peaks[96] <= dw + 8 * 4 * 96 * H + 4 * V * 4 + 64 * 1024, peaks
    assert peaks[2048] >= dw + 4 * V * H, peaks
    # and no more: the sum beside one chunk's gradient (never the last chunk's too, while
    # the next one's is formed), dhidden, a (256, V) fp32 logits chunk and a few (256, H) rows
    # and no more: the sum beside one chunk's gradient (never the previous chunk's too,
    # while the next one's is formed), dhidden, and the chunk's work within the cap (the CPU
    # kernel's logits rows, the normed rows, dy and the norm's backward: 9 caps at most)
    cap = 256 * H * 4
    assert peaks[2048] <= dw + 4 * V * H + 4 * 2048 * H + 9 * cap, peaks


# (norm_offset, norm_cast_last): Gemma, OLMo-2, an offset with LLaMA's rounding
FAMILY_ROUNDINGS = [(1.0, True), (0.0, True), (1.0, False)]


def hf_family_normed_loss(hidden, norm_weight, weight, bias, labels, norm_offset=0.0,
                          norm_cast_last=False, **kw):
    y = family_rms_norm_reference(hidden, norm_weight, EPS, norm_offset, norm_cast_last)
    return hf_loss(y.to(weight.dtype), weight, bias, labels, **kw)


@pytest.mark.parametrize("rounding", FAMILY_ROUNDINGS, ids=["gemma", "olmo2", "offset"])
@pytest.mark.parametrize("case", [NORMED_CASES[i] for i in (0, 1, 2, 4)],
                         ids=lambda c: f"{c[0]}-{str(c[4])[6:]}-{str(c[5])[6:]}")
@pytest.mark.parametrize("rows", [None, 7], ids=["one-chunk", "rows7"])
def test_final_norm_family_rounding_inside_the_head(monkeypatch, rounding, case, rows):
    """norm_offset / norm_cast_last: the family's norm then the head, within the accuracy rule
    against float64, every gradient, in one chunk and in 7-row chunks; in bf16 the loss
    with the other rounding differs (the option reaches the loss)."""
    backend, T, H, V, dtype, head_dtype, bias = case
    if CUDA and backend == "aten":
        pytest.skip("the ATen kernels serve CPU tensors; the GPU runs the Triton cases")
    offset, cast_last = rounding
    if rows is not None:
        config.update(chunk_bytes=str(rows * H * 4))
    tensors, labels = normed_inputs(T, H, V, dtype, head_dtype, bias,
                                    seed=int(torch.randint(1 << 30, ())))
    tensors = [tensors[0], (tensors[1].double() - offset).to(dtype), *tensors[2:]]
    kw = dict(norm_offset=offset, norm_cast_last=cast_last)
    dout = torch.randn((), dtype=F64).to(DEVICE)
    ref = run_normed(hf_family_normed_loss, [None if t is None else t.double()
                                             for t in tensors], labels, dout, **kw)
    base = run_normed(hf_family_normed_loss, tensors, labels, dout, **kw)
    with backend_context(backend):
        got = run_normed(fused_normed_loss, tensors, labels, dout, **kw)
        if dtype == torch.bfloat16 and cast_last:   # the rounding reaches the loss
            other = run_normed(fused_normed_loss, tensors, labels, dout,
                               norm_offset=offset, norm_cast_last=False)
            assert not torch.equal(other["loss"], got["loss"])
    assert set(got) == set(ref)
    scale = magnitude(*(v for k, v in ref.items() if k != "loss"))
    for name, r in ref.items():
        check_vs_baseline(name, got[name], base[name], r,
                          FACTOR_OUT if name == "loss" else FACTOR_GRAD,
                          torch.promote_types(dtype, head_dtype) if name == "loss"
                          else head_dtype if name in ("weight", "bias") else dtype,
                          scale=None if name == "loss" else scale)


@pytest.mark.parametrize("rounding", [(0.0, False)] + FAMILY_ROUNDINGS,
                         ids=["llama", "gemma", "olmo2", "offset"])
def test_opcheck_normed_head(rounding):
    """The normed head's two custom ops (schema, fakes, autograd registration), with each
    rounding."""
    tensors, labels = normed_inputs(9, 16, 23, torch.float32, torch.float32, True, seed=8)
    hidden, norm_weight, weight, bias = (t.detach().clone().requires_grad_() for t in tensors)
    args = (hidden, norm_weight, EPS, weight, bias, labels, IGNORE, 1.0, 0.0, *rounding)
    torch.library.opcheck(torch.ops.ckpt_ext.rms_norm_linear_cross_entropy_fwd.default, args)
    _, lse = torch.ops.ckpt_ext.rms_norm_linear_cross_entropy_fwd(*args)
    # the backward op has no backward of its own: plain tensors
    hidden, norm_weight, weight, bias = (t.detach() for t in (hidden, norm_weight, weight, bias))
    torch.library.opcheck(torch.ops.ckpt_ext.rms_norm_linear_cross_entropy_bwd.default,
                          (torch.randn(9).to(DEVICE), hidden, norm_weight, EPS, weight, bias,
                           labels, lse, IGNORE, [True] * 4, 1.0, 0.0, *rounding))


def test_final_norm_arguments_are_checked():
    tensors, labels = normed_inputs(5, 8, 11, torch.float32, torch.float32, False, seed=6)
    hidden, norm_weight, weight, _ = tensors
    with pytest.raises(ValueError, match="norm_weight and norm_eps go together"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_weight=norm_weight)
    with pytest.raises(ValueError, match="norm_eps must be a finite number > 0"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_weight=norm_weight, norm_eps=0.0)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(8,\)"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_weight=norm_weight[:4],
                                 norm_eps=EPS)
    with pytest.raises(TypeError, match="norm_weight must be a tensor"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_weight=[1.0] * 8, norm_eps=EPS)
    with pytest.raises(ValueError, match="norm_offset and norm_cast_last describe the final"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_offset=1.0)
    with pytest.raises(ValueError, match="norm_offset and norm_cast_last describe the final"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_cast_last=True)
    with pytest.raises(TypeError, match="norm_offset must be a finite number"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_weight=norm_weight, norm_eps=EPS,
                                 norm_offset=float("inf"))
    with pytest.raises(TypeError, match="norm_cast_last must be a bool"):
        ops.linear_cross_entropy(hidden, weight, labels, norm_weight=norm_weight, norm_eps=EPS,
                                 norm_cast_last="yes")


# --------------------------------------------------------------------------------------------
# Logit scale (Granite's 1 / logits_scaling) and final soft-cap (Gemma 2)
# --------------------------------------------------------------------------------------------
# (logit_scale, softcap, spread of the logits): a cap of 5 on logits spread over tens of units
# saturates many of them (tanh' near 0), the scale alone divides them as Granite does.
TRANSFORMS = [(0.25, 0.0, 4.0), (1.0, 5.0, 4.0), (0.25, 3.0, 8.0), (2.0, 30.0, 1.0)]
T_ODD, H_ODD, V_ODD = 37, 48, 101


def _transform_id(t):
    return f"scale{t[0]:g}-cap{t[1]:g}"


@pytest.mark.parametrize("transform", TRANSFORMS, ids=_transform_id)
@pytest.mark.parametrize("dtype,bias,reduction", [
    (F64, True, "mean"), (F64, False, "none"), (torch.float32, True, "sum"),
    (torch.float32, False, "none"), (torch.bfloat16, True, "mean"),
    (torch.bfloat16, False, "sum")], ids=lambda x: str(x).replace("torch.", ""))
def test_cpu_logit_transform_matches_reference(transform, dtype, bias, reduction):
    """ATen kernels: loss, dhidden, dweight, dbias against F.cross_entropy on
    softcap tanh(logit_scale logits / softcap) in float64 (tight in float64, the 2x/3x rule in
    float32 / bfloat16), T = 37, H = 48, V = 101, a quarter of the labels ignored."""
    if CUDA:
        pytest.skip("the ATen kernels serve CPU tensors; the GPU runs the Triton cases")
    scale, cap, spread = transform
    check_case("aten", (T_ODD,), H_ODD, V_ODD, dtype, bias, reduction, logit_scale=scale,
               softcap=cap, logits_spread=spread, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.parametrize("transform", TRANSFORMS, ids=_transform_id)
@pytest.mark.parametrize("dtype,bias,reduction", [
    (torch.float32, True, "mean"), (torch.float32, False, "none"),
    (torch.float16, True, "sum"), (torch.float16, False, "mean")],
    ids=lambda x: str(x).replace("torch.", ""))
def test_triton_logit_transform_matches_reference(transform, dtype, bias, reduction):
    """Triton launchers (the interpreter on CPU): two vocabulary splits in the forward, two
    vocabulary chunks in the backward (V = 101 over the interpreter's 64), masked tails."""
    scale, cap, spread = transform
    check_case("triton", (T_ODD,), H_ODD, V_ODD, dtype, bias, reduction, logit_scale=scale,
               softcap=cap, logits_spread=spread, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_logit_transform_matches_reference_gpu(dtype):
    """A LLaMA-2-sized vocabulary on the GPU: the autotuned tiles, bf16 included, under a
    scale (Granite) and under a cap (Gemma 2's 30, logits spread over tens of units)."""
    check_case("triton", (2, 129), 256, 32003, dtype, logit_scale=0.25, logits_spread=4.0)
    check_case("triton", (1, 37), 256, 32003, dtype, bias=True, reduction="none",
               softcap=30.0, logits_spread=8.0)


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_logit_transform_with_num_items_and_chunks(backend, monkeypatch):
    """num_items_in_batch, several CPU token chunks (the capped backward's chunks hold half
    the rows), and one Triton vocabulary chunk, each under a scale and a cap."""
    if backend == "aten" and CUDA:
        pytest.skip("the ATen kernels serve CPU tensors")
    check_case(backend, (2, 19), H_ODD, V_ODD, torch.float32, True, num_items=31,
               logit_scale=0.5, softcap=4.0, logits_spread=4.0)
    if backend == "aten":
        config.update(chunk_bytes=str(5 * 4 * V_ODD + 3))  # 5 / 2 rows
    else:
        monkeypatch.setattr(lce_kernels, "INTERPRETER_VOCAB_CHUNK", 1024)
    check_case(backend, (T_ODD,), H_ODD, V_ODD, torch.float32, True, logit_scale=0.5,
               softcap=4.0, logits_spread=4.0)


@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_logit_transform_frozen_inputs(backend, frozen):
    """Only dhidden (the Triton launcher's token walk), or dweight / dbias alone, under a
    scale and a cap: the gradients asked for match the reference."""
    if backend == "aten" and CUDA:
        pytest.skip("the ATen kernels serve CPU tensors")
    wants = FROZEN[frozen]
    hidden, weight, b, labels = make_inputs((T_ODD,), H_ODD, V_ODD, torch.float32, bias=True,
                                            seed=int(torch.randint(1 << 30, ())), device=DEVICE)
    weight = weight * 4.0
    dout = torch.tensor(0.9, device=DEVICE)
    kw = dict(logit_scale=0.5, softcap=3.0)
    hf = lambda *a: hf_loss(*a, **kw)        # noqa: E731
    fused = lambda *a: fused_loss(*a, **kw)  # noqa: E731
    ref = _grads_frozen(hf, hidden.double(), weight.double(), b.double(), labels, dout, wants)
    base = _grads_frozen(hf, hidden, weight, b, labels, dout, wants)
    with backend_context(backend):
        got = _grads_frozen(fused, hidden, weight, b, labels, dout, wants)
    scale = magnitude(*(r for r in ref if r is not None))
    for name, g, bs, r, want in zip(("dhidden", "dweight", "dbias"), got, base, ref, wants):
        assert (g is None) == (not want), name
        if want:
            check_vs_baseline(name, g, bs, r, FACTOR_GRAD, torch.float32, scale=scale)


def test_cpu_logit_transform_gradcheck():
    hidden, weight, b, labels = make_inputs((7,), 6, 13, F64, bias=True)
    weight = weight * 4.0
    leaves = [t.requires_grad_() for t in (hidden, weight, b)]
    for scale, cap in ((0.3, 0.0), (1.0, 2.5), (0.7, 1.5)):
        assert torch.autograd.gradcheck(
            lambda h, w, bb: ops.linear_cross_entropy(h, w, labels, bias=bb, reduction="none",
                                                      logit_scale=scale, softcap=cap), leaves)


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_per_token_stats_under_a_transform(backend):
    """The kernel op's lse is the logsumexp of the transformed logits, its loss that minus
    the transformed target logit."""
    hidden, weight, b, labels = make_inputs((23,), 16, 45, F64, bias=True)
    weight = weight * 4.0
    z = 3.0 * torch.tanh(0.5 * F.linear(hidden, weight, b) / 3.0)
    want_lse = torch.logsumexp(z, -1)
    want_loss = torch.where(labels != IGNORE, want_lse - z.gather(
        1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    cases = [((hidden, weight, b), 1e-12)] if backend == "aten" else []
    cases.append(([t.float() for t in (hidden, weight, b)], 2e-5))
    with backend_context(backend):
        for (h, w, bb), tol in cases:
            loss, lse = OPS.linear_cross_entropy_fwd(h, w, bb, labels, IGNORE, 0.5, 3.0)
            torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
            torch.testing.assert_close(loss.double(), want_loss, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_each_logit_transform_argument_changes_the_result(backend):
    """A scale or a cap that the op ignored would give the untransformed loss: each changes
    the loss and every gradient well beyond the tolerance, and together they differ from
    either alone."""
    if backend == "aten" and CUDA:
        pytest.skip("the ATen kernels serve CPU tensors")
    hidden, weight, b, labels = make_inputs((T_ODD,), H_ODD, V_ODD, torch.float32, bias=True,
                                            device=DEVICE)
    weight = weight * 4.0
    dout = torch.tensor(1.0, device=DEVICE)
    results = {}
    with backend_context(backend):
        for kw in ((1.0, 0.0), (0.25, 0.0), (1.0, 5.0), (0.25, 5.0)):
            results[kw] = run(fused_loss, hidden, weight, b, labels, dout,
                              logit_scale=kw[0], softcap=kw[1])
    keys = list(results)
    for i, a in enumerate(keys):
        for c in keys[i + 1:]:
            for name, x, y in zip(("loss", "dhidden", "dweight", "dbias"), results[a],
                                  results[c]):
                assert (x - y).abs().max() > 1e-2 * y.abs().max(), (a, c, name)


BAD_TRANSFORMS = [("logit_scale", 0.0), ("logit_scale", -0.5), ("logit_scale", math.inf),
                  ("logit_scale", math.nan), ("softcap", -1.0), ("softcap", math.inf),
                  ("softcap", math.nan), ("softcap", -math.inf)]


@pytest.mark.parametrize("name,value", BAD_TRANSFORMS, ids=lambda x: str(x))
@pytest.mark.parametrize("where", ["wrapper", "aten", "meta", "triton", "normed"])
def test_bad_logit_transform_raises_naming_it(name, value, where):
    """Zero, negative or non-finite scale, negative or non-finite cap: a ValueError naming the
    argument, from the wrapper, the kernel ops (ATen, fake, Triton) and the normed head."""
    hidden, weight, b, labels = make_inputs((6,), 8, 10, torch.float32, bias=True)
    kw = {"logit_scale": 1.0, "softcap": 0.0, name: value}
    match = f"{name} must be a finite number > 0"
    with pytest.raises(ValueError, match=match):
        if where == "wrapper":
            ops.linear_cross_entropy(hidden, weight, labels, bias=b, **kw)
        elif where == "normed":
            ops.linear_cross_entropy(hidden, weight, labels, bias=b, norm_weight=torch.ones(8),
                                     norm_eps=1e-5, **kw)
        else:
            dev = "meta" if where == "meta" else "cpu"
            h, w, bb, lab = (t.to(dev) for t in (hidden, weight, b, labels))
            with backend_context("triton" if where == "triton" else "aten"):
                OPS.linear_cross_entropy_fwd(h, w, bb, lab, IGNORE, kw["logit_scale"],
                                             kw["softcap"])
    if where in ("aten", "triton"):  # the backward op checks them too
        _, lse = OPS.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE)
        with pytest.raises(ValueError, match=match), backend_context(where):
            OPS.linear_cross_entropy_bwd(torch.ones(6), hidden, weight, b, labels, lse, IGNORE,
                                         [True, True, True], kw["logit_scale"], kw["softcap"])


def test_logit_transform_types_are_checked():
    hidden, weight, _, labels = make_inputs((6,), 8, 10, torch.float32)
    for kw in (dict(logit_scale="0.5"), dict(softcap=True), dict(logit_scale=torch.tensor(2.))):
        with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a number"):
            ops.linear_cross_entropy(hidden, weight, labels, **kw)


def _opcheck_transform_samples():
    samples = []
    hidden, weight, b, labels = make_inputs((7,), 12, 10, torch.float32, bias=True)
    for scale, cap in ((0.5, 0.0), (1.0, 2.0), (0.25, 3.0)):
        lv = [t.detach().clone().requires_grad_() for t in (hidden, weight, b)]
        samples.append(("linear_cross_entropy_fwd", (*lv, labels, IGNORE, scale, cap)))
        _, lse = OPS.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE, scale, cap)
        samples.append(("linear_cross_entropy_bwd", (torch.randn(7), hidden, weight, b, labels,
                                                     lse, IGNORE, [True, True, True], scale,
                                                     cap)))
    return samples


@pytest.mark.parametrize("sample", range(len(_opcheck_transform_samples())))
def test_opcheck_logit_transform(sample):
    name, args = _opcheck_transform_samples()[sample]
    torch.library.opcheck(getattr(OPS, name).default, args)


@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("rows", [None, 7], ids=["one-chunk", "rows7"])
def test_final_norm_inside_the_head_with_logit_transform(monkeypatch, backend, rows):
    """norm_weight with a scale and a cap: HF's norm, head, scale and cap within the accuracy
    rule against float64, every gradient, in one chunk and in 7-row chunks."""
    if CUDA and backend == "aten":
        pytest.skip("the ATen kernels serve CPU tensors; the GPU runs the Triton cases")
    T, H, V = T_ODD, H_ODD, V_ODD
    if rows is not None:
        config.update(chunk_bytes=str(rows * H * 4))
    tensors, labels = normed_inputs(T, H, V, torch.float32, torch.float32, True,
                                    seed=int(torch.randint(1 << 30, ())))
    tensors = [*tensors[:2], tensors[2] * 4.0, tensors[3]]   # logits of tens of units
    kw = dict(logit_scale=0.5, softcap=3.0)
    dout = torch.tensor(1.1, dtype=F64).to(DEVICE)
    ref = run_normed(hf_normed_loss, [t.double() for t in tensors], labels, dout, **kw)
    base = run_normed(hf_normed_loss, tensors, labels, dout, **kw)
    with backend_context(backend):
        got = run_normed(fused_normed_loss, tensors, labels, dout, **kw)
    assert set(got) == set(ref)
    scale = magnitude(*(v for k, v in ref.items() if k != "loss"))
    for name, r in ref.items():
        check_vs_baseline(name, got[name], base[name], r,
                          FACTOR_OUT if name == "loss" else FACTOR_GRAD, torch.float32,
                          scale=None if name == "loss" else scale)
