"""The whole fused path through Triton: DecoderLayer -> C++ Function -> op -> Triton launcher.

On a machine without a GPU the launchers run in Triton's interpreter on CPU tensors
(conftest sets TRITON_INTERPRET=1); fp32 only there (bf16 tl.dot is wrong in the interpreter).
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

import ckpt_ext
from ckpt_ext import use_triton

from reference import make_layer, make_mask, reference_layer, rope_tables

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("preset", ["balanced", "fast", "min_memory"])
def test_decoder_layer_through_triton(preset):
    b, s, h, hq, hkv, i = 2, 19, 64, 4, 2, 96
    layer = make_layer(h, hq, hkv, i, torch.float32, policy=preset).to(DEVICE)
    x = torch.randn(b, s, h, device=DEVICE, requires_grad=True)
    pe = tuple(t.to(DEVICE) for t in rope_tables(s, h // hq, torch.float32))
    mask = make_mask("fully_padded", b, s).to(DEVICE)
    grad_out = torch.randn(b, s, h, device=DEVICE)

    with use_triton(DEVICE) if DEVICE == "cpu" else contextlib.nullcontext():
        y = layer(x, pe, mask)
        y.backward(grad_out)
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}

    p64 = {k: v.detach().double().requires_grad_() for k, v in layer.state_dict().items()}
    x64 = x.detach().double().requires_grad_()
    y_ref = reference_layer(p64, x64, *(t.double() for t in pe), mask, hq, hkv)
    y_ref.backward(grad_out.double())
    ref = {"x": x64.grad, **{k: v.grad for k, v in p64.items()}}

    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=2e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g.double(), ref[name], rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_triton_really_serves_the_op_inside_the_block():
    # The Triton and ATen attention kernels round differently: inside use_triton the layer's
    # output must equal a run whose attention op is the Triton launcher, not the ATen one.
    if DEVICE != "cpu":
        pytest.skip("CPU-only check: on CUDA the Triton kernels are the only attention kernels")
    layer = make_layer(64, 4, 2, 40, torch.float32)  # head_dim 16: Triton's smallest
    x = torch.randn(1, 33, 64)
    pe = rope_tables(33, 16, torch.float32)
    calls = []
    from ckpt_ext.kernels import attention as tri_attention
    original = tri_attention.attention_fwd

    def spy(*args):
        calls.append(1)
        return original(*args)

    tri_attention.attention_fwd = spy
    try:
        with torch.no_grad(), use_triton("cpu"):
            layer(x, pe)
        assert calls, "the Triton attention launcher was not called"
        calls.clear()
        with torch.no_grad():
            layer(x, pe)
        assert not calls, "the Triton launcher stayed registered after use_triton"
    finally:
        tri_attention.attention_fwd = original


def test_backend_environment_variable():
    code = ("import torch, ckpt_ext; q = torch.randn(1, 2, 5, 16); "
            "out, lse = torch.ops.ckpt_ext.attention_fwd(q, q, q, None, None, None, True, 0.25); "
            "from ckpt_ext.kernels.attention import attention_fwd; "
            "ref, _ = attention_fwd(q, q, q, None, None, None, True, 0.25); "
            "assert torch.equal(out, ref); print('triton-served')")
    env = dict(os.environ, CKPT_EXT_BACKEND="triton", TRITON_INTERPRET="1")
    # On a CUDA machine this process runs Triton compiled, so the interpreter is probed here.
    probe = ("from ckpt_ext.kernels._interpreter import interpreter_problem; "
             "print(interpreter_problem() or 'interpreter-ok')")
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if "interpreter-ok" not in res.stdout:
        assert res.returncode == 0 and "CPU interpreter" in res.stdout, res.stderr[-2000:]
        pytest.skip(res.stdout.strip())
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "triton-served" in res.stdout, res.stderr[-2000:]

    env.pop("TRITON_INTERPRET")
    res = subprocess.run([sys.executable, "-c", "import ckpt_ext"], env=env,
                         capture_output=True, text=True)
    assert res.returncode != 0 and "TRITON_INTERPRET=1" in res.stderr

    env["CKPT_EXT_BACKEND"] = "cudnn"
    res = subprocess.run([sys.executable, "-c", "import ckpt_ext"], env=env,
                         capture_output=True, text=True)
    assert res.returncode != 0 and "CKPT_EXT_BACKEND must be" in res.stderr


def test_saved_bytes_unchanged_by_backend():
    layer = make_layer(64, 4, 2, 40, torch.float32, policy="balanced")
    x = torch.randn(2, 9, 64, requires_grad=True)
    pe = rope_tables(9, 16, torch.float32)
    plain = ckpt_ext.saved_activation_bytes(layer, x, pe)
    if DEVICE == "cpu":
        with use_triton("cpu"):
            assert ckpt_ext.saved_activation_bytes(layer, x, pe) == plain


@pytest.mark.parametrize("save", ["input", "gate_up"])
def test_swiglu_saved_bytes_through_triton(save):
    t, h, i = 37, 96, 172
    lin = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) * 0.1)
           for s in ((i, h), (i, h), (h, i))]
    x = torch.randn(t, h, device=DEVICE, requires_grad=True)
    with use_triton(DEVICE) if DEVICE == "cpu" else contextlib.nullcontext():
        got = ckpt_ext.saved_activation_bytes(ckpt_ext.ops.swiglu_mlp, x, *lin, save=save)
    expected = 4 * (t * h + (0 if save == "input" else 2 * t * i))
    assert got == expected  # save="input": x alone, no [tokens, I] tensor


def test_mlp_sublayer_balanced_through_triton():
    b, s, h, i = 2, 13, 96, 172
    torch.manual_seed(3)
    h_in = torch.randn(b, s, h, device=DEVICE, dtype=torch.float64)
    nw = 1 + 0.2 * torch.randn(h, device=DEVICE, dtype=torch.float64)
    ws = [torch.randn(*sh, device=DEVICE, dtype=torch.float64) * 0.1
          for sh in ((i, h), (i, h), (h, i))]
    bs = [0.1 * torch.randn(n, device=DEVICE, dtype=torch.float64) for n in (i, i, h)]
    leaves32 = [t.float().requires_grad_() for t in (h_in, nw, *ws, *bs)]
    with use_triton(DEVICE) if DEVICE == "cpu" else contextlib.nullcontext():
        y = ckpt_ext.blocks.mlp_block(leaves32[0], leaves32[1], *leaves32[2:5],
                                      b_gate=leaves32[5], b_up=leaves32[6], b_down=leaves32[7],
                                      preset="balanced")
        y.square().sum().backward()

    leaves64 = [t.detach().double().requires_grad_() for t in leaves32]
    x64, nw64, wg, wu, wd, bg, bu, bd = leaves64
    m = nw64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    y_ref = x64 + torch.nn.functional.linear(
        torch.nn.functional.silu(m @ wg.T + bg) * (m @ wu.T + bu), wd, bd)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=2e-5)
    for a, r in zip(leaves32, leaves64):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-4)


def test_broken_interpreter_gets_a_clear_error(monkeypatch):
    # Triton 3.6's interpreter with numpy >= 2.4 fails inside every kernel; the CPU launchers
    # must say so (and what to change) instead of an interpreter traceback.
    if DEVICE != "cpu":
        pytest.skip("CPU-only check: the interpreter is not loaded on a CUDA machine")
    from ckpt_ext.kernels import _interpreter

    assert _interpreter.interpreter_problem() is None  # this machine's pairing works

    def broken(*args, **kwargs):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    _interpreter.interpreter_problem.cache_clear()
    monkeypatch.setattr(_interpreter._probe_kernel, "run", broken)
    try:
        problem = _interpreter.interpreter_problem()
        assert "numpy<2.4" in problem and "0-dimensional" in problem, problem
        with pytest.raises(RuntimeError, match="numpy<2.4"):
            _interpreter.check_interpreter()
    finally:
        _interpreter.interpreter_problem.cache_clear()
