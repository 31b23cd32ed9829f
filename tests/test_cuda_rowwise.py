"""GPU tests of the CUDA C++ row-wise kernels (csrc/cuda/): RMSNorm forward and backward, the
fused residual-add RMSNorm forward, RoPE forward and backward, called through
torch.ops.ckpt_ext on CUDA tensors of a CUDA build.

Every result is compared with a float64 reference from tests/reference.py (HF semantics) by
the suite's accuracy rule (reference.check_vs_baseline): its max abs error must be at most 2x
(outputs) / 3x (gradients) the error that plain PyTorch (the HF code, eager, at the same dtypes,
on the same GPU) makes against that reference.
"""
import pytest
import torch

from reference import (FACTOR_GRAD, FACTOR_OUT, check_vs_baseline, rms_norm_reference,
                       rope_reference)

pytestmark = pytest.mark.gpu(reason="CUDA kernels need a CUDA GPU; compile-checked by .ci/run")

DEVICE = "cuda"
EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [64, 127, 4095, 4096, 5120, 8200]
ROWWISE_OPS = ("rms_norm_fwd", "rms_norm_bwd", "add_rms_norm_fwd", "rope_fwd", "rope_bwd")


@pytest.fixture(scope="module")
def ops():
    import ckpt_ext  # noqa: F401  (loads ckpt_ext._C, which registers the ops)
    return torch.ops.ckpt_ext


# ---- helpers -------------------------------------------------------------------------------
def misaligned(t):
    """A copy of t whose storage starts one element past an allocation (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def rms_ref64(x, w, eps):
    """HF LlamaRMSNorm in float64 (x (..., N), w (N,))."""
    return rms_norm_reference(x.double(), w.double(), eps)


def rms_hf(x, w, eps):
    """HF LlamaRMSNorm.forward as written, at the inputs' dtypes (the plain-PyTorch baseline)."""
    return rms_norm_reference(x, w, eps)


def rms_grads(fn, x, w, dy, eps):
    """(dx, dweight) of fn(x, w, eps) for the upstream gradient dy, through autograd."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    fn(x, w, eps).backward(dy)
    return x.grad, w.grad


def check_rms_norm(ops, x, w, dy, eps=EPS):
    """Forward and backward of the CUDA RMSNorm against the float64 reference and HF eager."""
    y = ops.rms_norm_fwd(x, w, eps)
    assert y.shape == x.shape and y.is_contiguous()
    assert y.dtype == torch.promote_types(x.dtype, w.dtype)
    check_vs_baseline("rms_norm_fwd y", y, rms_hf(x, w, eps), rms_ref64(x, w, eps), FACTOR_OUT)

    dx, dw = ops.rms_norm_bwd(dy, x, w, eps)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dx.is_contiguous()
    assert dw.shape == w.shape and dw.dtype == w.dtype
    dx_ref, dw_ref = rms_grads(rms_ref64, x.double(), w.double(), dy.double(), eps)
    dx_base, dw_base = rms_grads(rms_hf, x, w, dy, eps)
    check_vs_baseline("rms_norm_bwd dx", dx, dx_base, dx_ref, FACTOR_GRAD)
    check_vs_baseline("rms_norm_bwd dweight", dw, dw_base, dw_ref, FACTOR_GRAD)


def rms_inputs(shape, dtype, w_dtype=None):
    n = shape[-1]
    w_dtype = w_dtype or dtype
    x = randn(*shape, dtype=dtype, scale=2.0)
    w = (1.0 + 0.1 * torch.randn(n, device=DEVICE)).to(w_dtype)
    dy = randn(*shape, dtype=torch.promote_types(dtype, w_dtype))
    return x, w, dy


# ---- registration --------------------------------------------------------------------------
def test_cuda_key_runs_the_cpp_kernels(ops):
    for name in ROWWISE_OPS:
        dump = torch._C._dispatch_dump(f"ckpt_ext::{name}")
        cuda = [line for line in dump.splitlines() if line.startswith("CUDA:")]
        assert cuda, f"{name}: no CUDA kernel registered; is ckpt_ext._C a CUDA build?\n{dump}"
        assert "rowwise_launch.cpp" in cuda[0], (
            f"{name}: the CUDA key runs {cuda[0]!r}, not csrc/cuda/rowwise_launch.cpp")


# ---- RMSNorm -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(ops, dtype, n):
    check_rms_norm(ops, *rms_inputs((2, 19, n), dtype))


@pytest.mark.parametrize("n", [127, 4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_weight_fp32(ops, dtype, n):
    check_rms_norm(ops, *rms_inputs((37, n), dtype, w_dtype=torch.float32))


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.float16, torch.bfloat16)], ids=str)
def test_rms_norm_mixed_dtypes(ops, x_dtype, w_dtype):
    check_rms_norm(ops, *rms_inputs((37, 4096), x_dtype, w_dtype=w_dtype))


@pytest.mark.parametrize("n", [64, 4095, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_misaligned(ops, dtype, n):
    x, w, dy = rms_inputs((29, n), dtype)
    check_rms_norm(ops, misaligned(x), misaligned(w), misaligned(dy))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_rows(ops, dtype):
    # Rows of a wider buffer (row stride 4096 + 8), and a non-contiguous rank-3 view.
    x, w, dy = rms_inputs((23, 4096 + 8), dtype)
    check_rms_norm(ops, x[:, :4096], w[:4096], dy[:, :4096])
    x, w, dy = rms_inputs((5, 7, 1024), dtype)
    check_rms_norm(ops, x.transpose(0, 1), w, dy.transpose(0, 1))


@pytest.mark.parametrize("n", [12288, 16384, 60000])
def test_rms_norm_wide_rows(ops, n):
    # fp32 dweight accumulators of n floats: 12288 (48 KiB, plus static scratch: just over the
    # default limit) and 16384 (64 KiB) need opted-in shared memory; 60000 (234 KiB) exceeds
    # the device maximum, so they live in the global workspace.
    check_rms_norm(ops, *rms_inputs((6, n), torch.float32))


def test_rms_norm_no_rows(ops):
    x, w, dy = rms_inputs((0, 64), torch.bfloat16)
    assert ops.rms_norm_fwd(x, w, EPS).shape == (0, 64)
    dx, dw = ops.rms_norm_bwd(dy, x, w, EPS)
    assert dx.shape == (0, 64)
    assert torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("n", [64, 4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rms_norm_bwd_deterministic(ops, dtype, n):
    x, w, dy = rms_inputs((4096, n), dtype)
    dx1, dw1 = ops.rms_norm_bwd(dy, x, w, EPS)
    dx2, dw2 = ops.rms_norm_bwd(dy, x, w, EPS)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(dw1.view(bits), dw2.view(bits)), "dweight differs between two runs"
    assert torch.equal(dx1.view(bits), dx2.view(bits)), "dx differs between two runs"


@pytest.mark.parametrize("n", [127, 4096, 8200])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm(ops, dtype, n):
    x, w, _ = rms_inputs((3, 13, n), dtype)
    r = randn(3, 13, n, dtype=dtype, scale=2.0)
    y, s = ops.add_rms_norm_fwd(x, r, w, EPS)
    assert torch.equal(s, x + r), "sum must be x + residual exactly as torch rounds it"
    assert y.dtype == dtype and y.shape == x.shape
    check_vs_baseline("add_rms_norm_fwd y", y, rms_hf(x + r, w, EPS), rms_ref64(x + r, w, EPS),
                      FACTOR_OUT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_add_rms_norm_misaligned_fp32_weight(ops, dtype):
    x, w, _ = rms_inputs((31, 4096), dtype, w_dtype=torch.float32)
    r = randn(31, 4096, dtype=dtype)
    x, r, w = misaligned(x), misaligned(r), misaligned(w)
    y, s = ops.add_rms_norm_fwd(x, r, w, EPS)
    assert torch.equal(s, x + r)
    assert y.dtype == torch.float32
    check_vs_baseline("add_rms_norm_fwd y", y, rms_hf(x + r, w, EPS), rms_ref64(x + r, w, EPS),
                      FACTOR_OUT)


def test_rms_norm_input_errors(ops):
    x, w, _ = rms_inputs((4, 64), torch.float32)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: weight must be"):
        ops.rms_norm_fwd(x, w[:32], EPS)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: x must be float32, float16 or bfloat16"):
        ops.rms_norm_fwd(x.double(), w, EPS)
    with pytest.raises(RuntimeError, match="rms_norm_bwd: dy must have"):
        ops.rms_norm_bwd(x.half(), x, w, EPS)


# ---- RoPE ----------------------------------------------------------------------------------
def rope_ref64(q, k, cos, sin):
    """HF apply_rotary_pos_emb in float64; cos/sin (1 or B, S, D) broadcast over heads."""
    return rope_reference(q.double(), k.double(), cos.double(), sin.double())


def rope_hf(q, k, cos, sin):
    """HF apply_rotary_pos_emb as written, at the inputs' dtypes, cast back to q's dtype."""
    q_out, k_out = rope_reference(q, k, cos, sin)
    return q_out.to(q.dtype), k_out.to(k.dtype)


def rope_grads(fn, q, k, cos, sin, dq_out, dk_out):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    torch.autograd.backward(fn(q, k, cos, sin), (dq_out, dk_out))
    return q.grad, k.grad


def make_qk(B, H, S, D, dtype, layout):
    """(B, H, S, D) tensor: contiguous, a (B, S, H, D) transposed view as HF passes it,
    misaligned, or with a non-unit last-dim stride."""
    if layout == "transposed":
        return randn(B, S, H, D, dtype=dtype).transpose(1, 2)
    if layout == "misaligned":
        return misaligned(randn(B, H, S, D, dtype=dtype))
    if layout == "lastdim_strided":
        return randn(B, H, D, S, dtype=dtype).transpose(2, 3)
    return randn(B, H, S, D, dtype=dtype)


def rope_layout(t):
    """The strides rope returns for input t: t's own when its last dim is unit-strided (every
    such layout here is dense: contiguous, a transposed (B, S, H, D) view, misaligned), else
    contiguous."""
    return t.stride() if t.stride(-1) == 1 else torch.empty(t.shape).stride()


def check_rope(ops, q, k, cos, sin):
    q_out, k_out = ops.rope_fwd(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.stride() == rope_layout(q) and k_out.stride() == rope_layout(k)
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    (q_ref, k_ref), (q_base, k_base) = rope_ref64(q, k, cos, sin), rope_hf(q, k, cos, sin)
    check_vs_baseline("rope_fwd q_out", q_out, q_base, q_ref, FACTOR_OUT)
    check_vs_baseline("rope_fwd k_out", k_out, k_base, k_ref, FACTOR_OUT)

    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = ops.rope_bwd(dq_out, dk_out, cos, sin)
    assert dq.stride() == rope_layout(dq_out) and dk.stride() == rope_layout(dk_out)
    dq_ref, dk_ref = rope_grads(rope_ref64, q.double(), k.double(), cos, sin, dq_out.double(),
                                dk_out.double())
    dq_base, dk_base = rope_grads(rope_hf, q, k, cos, sin, dq_out, dk_out)
    check_vs_baseline("rope_bwd dq", dq, dq_base, dq_ref, FACTOR_GRAD)
    check_vs_baseline("rope_bwd dk", dk, dk_base, dk_ref, FACTOR_GRAD)
    # Non-contiguous gradients, as autograd may hand them over.
    dq2, dk2 = ops.rope_bwd(dq_out.transpose(1, 2).contiguous().transpose(1, 2),
                            dk_out.transpose(1, 2).contiguous().transpose(1, 2), cos, sin)
    assert torch.equal(dq2, dq) and torch.equal(dk2, dk)


def tables(Bc, S, D, dtype):
    # Random tables, not true cos/sin: the two halves of sin (and of cos) differ, so a kernel
    # that assumed sin[:D/2] == sin[D/2:] would fail.
    return randn(Bc, S, D, dtype=dtype), randn(Bc, S, D, dtype=dtype)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("cos_batch", ["1", "B"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope(ops, dtype, D, cos_batch, layout):
    B, Hq, Hkv, S = 2, 8, 2, 33
    q, k = make_qk(B, Hq, S, D, dtype, layout), make_qk(B, Hkv, S, D, dtype, layout)
    check_rope(ops, q, k, *tables(1 if cos_batch == "1" else B, S, D, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rope_fp32_tables(ops, dtype):
    B, Hq, Hkv, S, D = 2, 40, 8, 17, 128
    q, k = make_qk(B, Hq, S, D, dtype, "transposed"), make_qk(B, Hkv, S, D, dtype, "transposed")
    check_rope(ops, q, k, *tables(B, S, D, torch.float32))


@pytest.mark.parametrize("layout", ["misaligned", "lastdim_strided"])
@pytest.mark.parametrize("D", [6, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_odd_layouts(ops, dtype, D, layout):
    B, Hq, Hkv, S = 2, 4, 1, 9
    q, k = make_qk(B, Hq, S, D, dtype, layout), make_qk(B, Hkv, S, D, dtype, layout)
    check_rope(ops, q, k, *tables(1, S, D, dtype))


def test_rope_input_errors(ops):
    q, k = randn(1, 2, 3, 8, dtype=torch.float32), randn(1, 1, 3, 8, dtype=torch.float32)
    cos, sin = tables(1, 3, 8, torch.float32)
    with pytest.raises(RuntimeError, match="rope_fwd: k must be"):
        ops.rope_fwd(q, k[..., :6], cos, sin)
    with pytest.raises(RuntimeError, match="rope_bwd: sin must have cos's shape"):
        ops.rope_bwd(q, k, cos, sin[:, :2])
    with pytest.raises(RuntimeError, match="rope_fwd: cos must be a CUDA tensor"):
        ops.rope_fwd(q, k, cos.cpu(), sin)
