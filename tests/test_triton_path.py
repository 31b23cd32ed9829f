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
from ckpt_ext._backend import use_triton

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
            "out, lse = torch.ops.ckpt_ext.attention_fwd(q, q, q, None, True, 0.25); "
            "from ckpt_ext.kernels.attention import attention_fwd; "
            "ref, _ = attention_fwd(q, q, q, None, True, 0.25); "
            "assert torch.equal(out, ref); print('triton-served')")
    env = dict(os.environ, CKPT_EXT_BACKEND="triton", TRITON_INTERPRET="1")
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
