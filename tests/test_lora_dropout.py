"""LoRA dropout with exact replay: the lora_dropout op's mask against an independent hash, the
SwiGLU ops and the decoder layer against plain PyTorch with the same masks, finite
differences under a fixed seed, and PEFT models with lora_dropout > 0 through patch_llama."""
import contextlib
import copy
import os

import numpy as np
import pytest
import torch

import ckpt_ext
from ckpt_ext import blocks, config

from reference import rope_args, layer_weights_with_adapters, rope_tables

OPS = torch.ops.ckpt_ext
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 "
    "(the conftest sets it on machines without a GPU)")


# ---- the mask, from its definition ---------------------------------------------------------

def _mix32(x):
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    x ^= x >> 15
    return x


def reference_keep(seed, stream, rows, cols, p):
    """The documented mask, computed with numpy's uint64 arithmetic (independent of the C++
    and Triton code); every bit of the 64-bit seed (two's complement) enters the key."""
    bits = seed % 2**64
    lo, hi = bits & 0xFFFFFFFF, bits >> 32
    key = _mix32(np.array([lo ^ int(_mix32(np.array([hi]))[0])
                           ^ int(_mix32(np.array([stream + 0x9E3779B9]))[0])], dtype=np.uint64))
    r = np.arange(rows, dtype=np.uint64)[:, None]
    c = np.arange(cols, dtype=np.uint64)[None, :]
    h = _mix32(_mix32(r ^ key) ^ c)
    return torch.from_numpy(h >= np.uint64(int(p * 2**32)))


def seed_tensor(value):
    return torch.tensor(value, dtype=torch.int64)


@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 129), (1, 1)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_is_the_documented_hash(shape, p):
    x = torch.randn(shape, dtype=torch.float64)
    seed, stream = 123456789, 5
    y = OPS.lora_dropout(x, seed_tensor(seed), stream, p)
    keep = reference_keep(seed, stream, x.numel() // shape[-1], shape[-1], p).view(shape)
    torch.testing.assert_close(y, torch.where(keep, x / (1 - p), torch.zeros_like(x)),
                               rtol=1e-15, atol=0)


def test_mask_rate_and_independence():
    x = torch.ones(400, 500)
    p = 0.3
    masks = [OPS.lora_dropout(x, seed_tensor(s), t, p) != 0 for s, t in ((1, 0), (1, 1), (2, 0))]
    for m in masks:  # 200k Bernoulli(0.7) draws: the standard deviation of the rate is 0.001
        assert abs(m.float().mean().item() - 0.7) < 0.006
    for a, b in ((0, 1), (0, 2), (1, 2)):  # another stream or seed: an independent mask
        agree = (masks[a] == masks[b]).float().mean().item()
        assert abs(agree - (0.7**2 + 0.3**2)) < 0.006
    rows = masks[0].float().mean(1)  # no row or column is special
    cols = masks[0].float().mean(0)
    assert rows.min() > 0.55 and rows.max() < 0.85 and cols.min() > 0.55 and cols.max() < 0.85
    again = OPS.lora_dropout(x, seed_tensor(1), 0, p) != 0
    assert torch.equal(again, masks[0])


def test_op_autograd_and_errors():
    x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    seed = seed_tensor(77)
    torch.autograd.gradcheck(lambda t: OPS.lora_dropout(t, seed, 3, 0.4), (x,))
    assert torch.equal(OPS.lora_dropout(x.detach(), seed, 3, 0.0), x.detach())
    with pytest.raises(ValueError, match=r"lora_dropout: p must be a probability in \[0, 1\)"):
        OPS.lora_dropout(x, seed, 0, 1.0)
    with pytest.raises(ValueError, match="seed must be a CPU integer tensor with one element"):
        OPS.lora_dropout(x, torch.tensor([1, 2]), 0, 0.1)
    with pytest.raises(ValueError, match="seed must be a CPU integer tensor"):
        OPS.lora_dropout(x, torch.tensor(1.0), 0, 0.1)
    fake = OPS.lora_dropout(torch.empty(3, 4, device="meta"), seed, 0, 0.1)
    assert fake.shape == (3, 4) and fake.device.type == "meta"


@pytest.mark.parametrize("shape,p", [((6, 11), 0.4), ((2, 3, 5), 0.0), ((), 0.5)],
                         ids=["2d", "3d-p0", "0d"])
def test_opcheck(shape, p):
    x = torch.randn(shape, requires_grad=True)
    torch.library.opcheck(OPS.lora_dropout.default, (x, seed_tensor(2**40 + 3), 2, p))


def test_zero_dim_tensor_is_one_element():
    """A 0-d x gives a 0-d result of its dtype: the (1, 1) view's one element, kept (scaled)
    or dropped as the hash says."""
    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    seen = set()
    for _ in range(40):
        x = torch.randn((), dtype=torch.float64, generator=g)
        seed = int(torch.randint(-2**62, 2**62, (), generator=g))
        stream, p = int(torch.randint(8, (), generator=g)), 0.5
        y = OPS.lora_dropout(x, seed_tensor(seed), stream, p)
        assert y.shape == () and y.dtype == x.dtype
        keep = bool(reference_keep(seed, stream, 1, 1, p)[0, 0])
        seen.add(keep)
        assert y.item() == (x.item() / (1 - p) if keep else 0.0)
    assert seen == {True, False}
    # the same element as in a (1, 1) tensor, and on the autograd and fake paths
    x = torch.tensor(1.5, dtype=torch.float32, requires_grad=True)
    y = OPS.lora_dropout(x, seed_tensor(4), 1, 0.3)
    assert y.shape == () and torch.equal(y, OPS.lora_dropout(x.detach().view(1, 1),
                                                            seed_tensor(4), 1, 0.3).view(()))
    y.backward()
    assert x.grad.shape == () and x.grad.item() in (0.0, pytest.approx(1 / 0.7))
    assert OPS.lora_dropout(torch.empty((), device="meta"), seed_tensor(4), 1, 0.3).shape == ()


SEEDS_64 = (0, 1, 2**31 - 1, 2**32, 2**32 + 1, 2**40, 2**40 + 3, 2**62, 2**63 - 1, -1, -2**32,
            -2**63)


def test_every_bit_of_the_seed_counts():
    """Seeds that differ only above bit 31 give different masks (2**40 is not seed 0), each the
    documented hash of the whole 64-bit seed."""
    x = torch.ones(64, 96)
    p, stream = 0.5, 2
    masks = {}
    for seed in SEEDS_64:
        masks[seed] = OPS.lora_dropout(x, seed_tensor(seed), stream, p) != 0
        assert torch.equal(masks[seed], reference_keep(seed, stream, 64, 96, p)), seed
    for a, b in ((0, 2**32), (0, 2**40), (3, 2**40 + 3), (1, 2**32 + 1), (2**62, 0),
                 (-1, 2**32 - 1), (-2**32, 0), (-2**63, 0)):
        if a in masks and b in masks:
            agree = (masks[a] == masks[b]).float().mean().item()
            assert 0.4 < agree < 0.6, (a, b, agree)  # independent Bernoulli(1/2) masks
    for bit in range(32, 64):  # flipping any one high bit changes the mask
        seed = torch.tensor(1 << bit, dtype=torch.uint64).view(torch.int64).item()
        other = OPS.lora_dropout(x, seed_tensor(seed), stream, p) != 0
        assert not torch.equal(other, masks[0]), bit


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_zero_dim_and_64_bit_seeds_equal_the_cpu_op(dtype):
    from ckpt_ext.kernels.dropout import lora_dropout as triton_dropout
    x = torch.randn(9, 70).to(dtype)
    for seed in SEEDS_64:
        got = triton_dropout(x, seed_tensor(seed), 3, 0.5)
        assert torch.equal(got != 0, reference_keep(seed, 3, 9, 70, 0.5)), seed
        assert torch.equal(got, OPS.lora_dropout(x, seed_tensor(seed), 3, 0.5))
    for seed in SEEDS_64:
        x0 = torch.randn(()).to(dtype)
        got = triton_dropout(x0, seed_tensor(seed), 1, 0.5)
        assert got.shape == () and got.dtype == dtype
        assert torch.equal(got, OPS.lora_dropout(x0, seed_tensor(seed), 1, 0.5))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_mask_equals_the_cpu_op_bit_for_bit(dtype):
    from ckpt_ext.kernels.dropout import lora_dropout as triton_dropout
    x = torch.randn(37, 300).to(dtype)
    for seed, stream, p in ((5, 0, 0.1), (2**31 - 2, 6, 0.5), (2**40 + 3, 4, 0.9)):
        got = triton_dropout(x, seed_tensor(seed), stream, p)
        assert torch.equal(got, OPS.lora_dropout(x, seed_tensor(seed), stream, p))
        # the launchers' float32 result of a narrower x: the op on x.float(), bit for bit
        wide = triton_dropout(x, seed_tensor(seed), stream, p, 0, torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, OPS.lora_dropout(x.float(), seed_tensor(seed), stream, p))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dropout_pair_is_the_two_dropouts_bit_for_bit(dtype):
    """The SwiGLU launchers' two-mask launch (kernels/dropout.py lora_dropout_pair): one input
    under two streams, and the sum of two inputs' dropouts, are the CPU op's masks (and their
    float32 sum) bit for bit, on an odd shape at a row offset; mismatched shapes refused."""
    from ckpt_ext.kernels.dropout import lora_dropout_pair
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randn(37, 19, generator=g).to(dtype) for _ in range(2))
    seed = seed_tensor(2**33 + 9)

    def one(t, stream, p):
        return OPS.lora_dropout(t.float(), seed, stream, p, 5)

    for streams, ps in (((4, 5), (0.25, 0.4)), ((6, 2), (0.5, 0.05))):
        got_a, got_b = lora_dropout_pair(a, None, seed, streams, ps, 5, torch.float32)
        assert got_a.dtype == got_b.dtype == torch.float32
        assert torch.equal(got_a, one(a, streams[0], ps[0]))
        assert torch.equal(got_b, one(a, streams[1], ps[1]))
        assert not torch.equal(got_a, got_b)
        got = lora_dropout_pair(a.float(), b.float(), seed, streams, ps, 5)
        assert torch.equal(got, one(a, streams[0], ps[0]) + one(b, streams[1], ps[1]))
    with pytest.raises(ValueError, match="b must have the shape of a"):
        lora_dropout_pair(a, b[:3], seed, (4, 5), (0.1, 0.1))


# ---- SwiGLU ops ------------------------------------------------------------------------------

T, H, I, R = 37, 24, 40, 3


def swiglu_args(dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    x = rnd(T, H, scale=1.0)
    w = [rnd(I, H), rnd(I, H), rnd(H, I)]
    b = [rnd(I), rnd(I), rnd(H)] if bias else [None] * 3
    lora = [rnd(R, H), rnd(I, R), rnd(R, H), rnd(I, R), rnd(R, I), rnd(H, R)]
    return x, w, b, lora


def swiglu_reference(x, w, b, lora, scaling, dropout, seed, streams=(4, 5, 6)):
    """Plain PyTorch: the adapters' inputs dropped with the op's masks (streams 4, 5, 6, or
    ``streams``)."""
    def drop(t, stream, p):
        return OPS.lora_dropout(t, seed, stream, p) if p > 0 else t

    def lin(t, wt, bt):
        return torch.nn.functional.linear(t, wt, bt)

    sg, su, sd = streams
    gate = lin(x, w[0], b[0]) + scaling[0] * lin(lin(drop(x, sg, dropout[0]), lora[0], None),
                                                 lora[1], None)
    up = lin(x, w[1], b[1]) + scaling[1] * lin(lin(drop(x, su, dropout[1]), lora[2], None),
                                               lora[3], None)
    h = torch.nn.functional.silu(gate) * up
    return lin(h, w[2], b[2]) + scaling[2] * lin(lin(drop(h, sd, dropout[2]), lora[4], None),
                                                 lora[5], None)


def _check_swiglu(dtype, backend, rtol, streams=None, dropout=(0.3, 0.2, 0.4)):
    """The ops against swiglu_reference; streams: the ops' dropout_streams (None: left out,
    4, 5, 6); dropout: the three probabilities."""
    x, w, b, lora = swiglu_args(dtype)
    scaling, dropout, seed = [0.7, 1.3, 0.9], list(dropout), seed_tensor(2024)
    extra = () if streams is None else (0, list(streams))  # dropout_row_offset, dropout_streams
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    leaves = [t.double().requires_grad_() for t in (x, *w, *b, *lora)]
    x64, w64, b64, l64 = leaves[0], leaves[1:4], leaves[4:7], leaves[7:]
    y64 = swiglu_reference(x64, w64, b64, l64, scaling, dropout, seed, streams or (4, 5, 6))
    ref = torch.autograd.grad(y64, leaves, dy.double())
    with backend():
        for save in (False, True):
            y, gate, up = OPS.swiglu_fwd(x, *w, *b, lora, scaling, save, dropout, seed, *extra)
            grads = OPS.swiglu_bwd(dy, x, *w, *b, lora, scaling, gate if save else None,
                                   up if save else None, [True] * 12, dropout, seed, *extra)
            torch.testing.assert_close(y.double(), y64.detach(), rtol=rtol, atol=rtol)
            got = [grads[0], *grads[1:7], *grads[7]]
            for name, g, r in zip(["x", "wg", "wu", "wd", "bg", "bu", "bd", "Ag", "Bg", "Au",
                                   "Bu", "Ad", "Bd"], got, ref):
                torch.testing.assert_close(g.double(), r, rtol=rtol, atol=rtol, msg=name)
    # another seed, also one that differs only above bit 31: another result
    with backend():
        for other in (2025, 2024 + 2**40):
            y2 = OPS.swiglu_fwd(x, *w, *b, lora, scaling, False, dropout, seed_tensor(other),
                                *extra)[0]
            assert (y2.double() - y64.detach()).abs().max() > 100 * rtol, other
        if streams is not None:  # the default streams are other masks
            y3 = OPS.swiglu_fwd(x, *w, *b, lora, scaling, False, dropout, seed)[0]
            assert (y3.double() - y64.detach()).abs().max() > 100 * rtol


@pytest.mark.parametrize("streams", [None, (4, 4, 9)], ids=["default", "gate-up-one-stream"])
def test_swiglu_cpu_ops_with_dropout_match_plain_pytorch(streams):
    _check_swiglu(torch.float64, contextlib.nullcontext, 1e-10, streams)


@needs_interpreter
@pytest.mark.parametrize("streams", [None, (4, 4, 9)], ids=["default", "gate-up-one-stream"])
def test_swiglu_triton_kernels_with_dropout_match_plain_pytorch(streams):
    from ckpt_ext import use_triton
    _check_swiglu(torch.float32, lambda: use_triton("cpu"), 2e-4, streams)


@needs_interpreter
def test_swiglu_triton_kernels_with_one_gate_up_mask_match_plain_pytorch():
    """gate and up on one stream with one probability: one mask, so the launchers drop x once
    for both adapters and stack their rank-r products (kernels/swiglu_mlp._shared_input)."""
    from ckpt_ext import use_triton
    _check_swiglu(torch.float32, lambda: use_triton("cpu"), 2e-4, (4, 4, 9), (0.3, 0.3, 0.4))


def test_swiglu_dropout_errors():
    x, w, b, lora = swiglu_args(torch.float32)
    with pytest.raises(ValueError, match="dropout_seed is required"):
        OPS.swiglu_fwd(x, *w, *b, lora, [1.0] * 3, False, [0.1, 0.0, 0.0], None)
    with pytest.raises(ValueError, match=r"lora_dropout\[2\] must be a probability"):
        OPS.swiglu_fwd(x, *w, *b, lora, [1.0] * 3, False, [0.0, 0.0, 1.5], seed_tensor(1))
    with pytest.raises(ValueError, match="lora_dropout must be"):
        OPS.swiglu_fwd(x, *w, *b, lora, [1.0] * 3, False, [0.1], seed_tensor(1))
    with pytest.raises(ValueError, match="dropout_streams must be"):
        OPS.swiglu_fwd(x, *w, *b, lora, [1.0] * 3, False, [0.1] * 3, seed_tensor(1), 0, [4, 4])


# ---- the decoder layer -----------------------------------------------------------------------

HS, NH, NKV, D, IM, BS, SL = 32, 4, 2, 8, 48, 2, 9


def layer_inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    weights = layer_weights_with_adapters(HS, NH, NKV, IM, R, dtype, g)
    x = torch.randn(BS, SL, HS, generator=g, dtype=dtype)
    cos, sin = rope_tables(SL, D, dtype=dtype)
    return x, weights, (cos, sin)


def layer_loss(x, weights, pe, dropout, seed, preset, streams=None, **kw):
    y = blocks.decoder_layer(x, blocks.LayerOptions(
        weights=weights, **rope_args(pe), num_heads=NH, num_kv_heads=NKV,
        lora_scaling=[0.5 + 0.1 * i for i in range(7)], lora_dropout=dropout or (), dropout_seed=seed,
        lora_streams=streams or (), preset=preset, **kw))
    return (y * torch.linspace(-1, 1, HS, dtype=x.dtype)).square().sum()


DROPOUT = [0.1, 0.2, 0.3, 0.15, 0.25, 0.35, 0.4]


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_layer_gradient_matches_central_differences_under_one_seed(preset):
    x, weights, pe = layer_inputs()
    seed = seed_tensor(31337)
    trainable = {n: t.requires_grad_() for n, t in weights.items() if "lora_" in n}
    x.requires_grad_()
    loss = layer_loss(x, weights, pe, DROPOUT, seed, preset)
    grads = torch.autograd.grad(loss, [x, *trainable.values()])
    g = torch.Generator().manual_seed(5)
    dirs = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in [x, *trainable.values()]]
    eps = 1e-6
    with torch.no_grad():
        def at(sign):
            xs = x + sign * eps * dirs[0]
            ws = dict(weights)
            for (n, t), d in zip(trainable.items(), dirs[1:]):
                ws[n] = t + sign * eps * d
            return layer_loss(xs, ws, pe, DROPOUT, seed, preset)
        numeric = (at(1) - at(-1)) / (2 * eps)
    analytic = sum((gr * d).sum() for gr, d in zip(grads, dirs))
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)
    # the dropout really acts: other seeds and p = 0 give other losses
    other = layer_loss(x, weights, pe, DROPOUT, seed_tensor(1), preset)
    plain = layer_loss(x, weights, pe, None, None, preset)
    assert abs(other - loss) > 1e-3 * abs(loss) and abs(plain - loss) > 1e-3 * abs(loss)


@pytest.mark.parametrize("streams", [None, [0, 0, 0, 3, 4, 4, 6]], ids=["own", "fused"])
@pytest.mark.parametrize("layout", ["llama", "sandwich"])
@pytest.mark.parametrize("preset", ["balanced", "fast"])
def test_layer_matches_plain_pytorch_with_the_same_masks(monkeypatch, streams, layout, preset):
    """Every projection's adapter input dropped with stream = its index (or lora_streams: q/k/v
    one stream, gate/up one, as Phi-3's fused modules: one mask on their shared input), in
    plain PyTorch. "sandwich": Gemma 2's output norms (times 1 + w) after both sublayers,
    whose backward recomputes the sublayer's output with the forward's masks (fast: the down
    projection from its saved gate/up), in MLP chunks of 5 tokens."""
    x, weights, (cos, sin) = layer_inputs()
    kw, offset = {}, 0.0
    if layout == "sandwich":
        g = torch.Generator().manual_seed(4)
        for slot in ("attention_output_norm", "mlp_output_norm"):
            weights[f"{slot}.weight"] = 0.3 * torch.randn(HS, generator=g, dtype=x.dtype)
        kw, offset = dict(norm_offset=1.0), 1.0
        config.update(chunk_bytes=str(5 * 3 * IM * 8))
    seed = seed_tensor(99)
    scaling = [0.5 + 0.1 * i for i in range(7)]
    leaves = {n: t.clone().requires_grad_() for n, t in weights.items()}
    xr = x.clone().requires_grad_()

    def proj(i, t):
        path = blocks.PROJECTIONS[i]
        w = leaves
        stream = i if streams is None else streams[i]
        lora = OPS.lora_dropout(t, seed, stream, DROPOUT[i]) @ w[f"{path}.lora_A"].t() \
            @ w[f"{path}.lora_B"].t()
        return t @ w[f"{path}.weight"].t() + scaling[i] * lora

    def norm(t, wt):
        return (offset + wt) * t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6)

    def out_norm(t, slot):
        return norm(t, leaves[f"{slot}.weight"]) if layout == "sandwich" else t

    def rot(t):
        return torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)

    n = norm(xr, leaves["input_layernorm.weight"])
    q = proj(0, n).view(BS, SL, NH, D).transpose(1, 2)
    k = proj(1, n).view(BS, SL, NKV, D).transpose(1, 2)
    v = proj(2, n).view(BS, SL, NKV, D).transpose(1, 2)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         enable_gqa=True)
    h = xr + out_norm(proj(3, a.transpose(1, 2).reshape(BS, SL, NH * D)),
                      "attention_output_norm")
    m = norm(h, leaves["post_attention_layernorm.weight"])
    y_ref = h + out_norm(proj(6, torch.nn.functional.silu(proj(4, m)) * proj(5, m)),
                         "mlp_output_norm")
    loss_ref = (y_ref * torch.linspace(-1, 1, HS, dtype=x.dtype)).square().sum()
    ref = torch.autograd.grad(loss_ref, [xr, *leaves.values()])

    leaves2 = {n: t.clone().requires_grad_() for n, t in weights.items()}
    x2 = x.clone().requires_grad_()
    loss = layer_loss(x2, leaves2, (cos, sin), DROPOUT, seed, preset, streams, **kw)
    got = torch.autograd.grad(loss, [x2, *leaves2.values()])
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=0)
    for name, g, r in zip(["x", *leaves], got, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12, msg=name)
    other = [0, 0, 0, 3, 4, 4, 6] if streams is None else None  # other streams, other masks
    assert abs(layer_loss(x, weights, (cos, sin), DROPOUT, seed, preset, other, **kw)
               - loss_ref) > 1e-6 * abs(loss_ref)


def test_layer_dropout_errors():
    x, weights, pe = layer_inputs(torch.float32)
    with pytest.raises(ValueError, match="dropout_seed is required"):
        layer_loss(x, weights, pe, DROPOUT, None, "balanced")
    with pytest.raises(ValueError, match=r"lora_dropout\[3\] \(self_attn.o_proj\) must be"):
        layer_loss(x, weights, pe, [0.1, 0.1, 0.1, 1.0, 0.1, 0.1, 0.1], seed_tensor(1),
                   "balanced")
    with pytest.raises(ValueError, match="lora_dropout must be"):
        layer_loss(x, weights, pe, [0.1], seed_tensor(1), "balanced")
    with pytest.raises(ValueError, match="dropout_seed must be a CPU integer tensor"):
        layer_loss(x, weights, pe, DROPOUT, torch.tensor(0.5), "balanced")
    with pytest.raises(ValueError, match=r"lora_streams must be \[\] or have one entry per "
                       r"projection \(7\), got 3"):
        layer_loss(x, weights, pe, DROPOUT, seed_tensor(1), "balanced", [0, 0, 0])


# ---- PEFT models with lora_dropout > 0 -------------------------------------------------------

class HashDropout(torch.nn.Module):
    """Stands in for PEFT's nn.Dropout in the unpatched reference: the fused op's mask."""

    def __init__(self, seeds, layer, stream, p):
        super().__init__()
        self.seeds, self.layer, self.stream, self.p = seeds, layer, stream, p

    def forward(self, x):
        return OPS.lora_dropout(x, self.seeds[self.layer], self.stream, self.p)


def replay_fused_dropout(peft_model, streams, p):
    """Give the unpatched PEFT model's adapters the masks a patched model's fused layers draw
    after torch.manual_seed(1234): one seed per layer call from torch's CPU generator, the
    stream of each adapted module (``streams``: module path in the layer -> stream)."""
    layers = peft_model.get_base_model().model.layers
    torch.manual_seed(1234)
    seeds = [torch.randint(2**31 - 1, (), dtype=torch.int64) for _ in range(len(layers))]
    for li, layer in enumerate(layers):
        for path, stream in streams.items():
            parent, name = path.split(".")
            lora = getattr(layer, parent)._modules[name]
            lora.lora_dropout["default"] = HashDropout(seeds, li, stream, p)


@pytest.mark.parametrize("preset", ["balanced", "min_memory"])
def test_peft_lora_dropout_is_fused_with_the_reference_masks(preset):
    """patch_llama(peft model with lora_dropout=0.2): every layer fused, and the loss and the
    adapter gradients equal the unpatched PEFT model whose dropout modules apply the same
    masks (the fused forward draws one seed per layer call from torch's CPU generator)."""
    peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need it "
                               "(pip install -e '.[test]')")
    from test_training_setups import ALL, loss_and_grads, make_batch, make_model
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=ALL,
                          init_lora_weights=False)
    torch.manual_seed(0)
    ref = peft.get_peft_model(make_model("llama"), cfg)
    model = copy.deepcopy(ref)
    ckpt_ext.patch_llama(model, preset)
    ids, mask, labels = make_batch()
    replay_fused_dropout(ref, {path: i for i, path in enumerate(blocks.PROJECTIONS)}, 0.2)
    loss_r, grads_r = loss_and_grads(ref, ids, mask, labels)
    torch.manual_seed(1234)
    loss, grads = loss_and_grads(model, ids, mask, labels)
    assert sum(layer.forward.calls["fused"] for layer in model.get_base_model().model.layers) == 2
    torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(grads_r)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch.manual_seed(4321)  # another seed, other masks
    assert abs(loss_and_grads(model, ids, mask, labels)[0] - loss) > 1e-6
    model.eval()  # no dropout outside training (fused, since grad is on)
    fused = sum(layer.forward.calls["fused"] for layer in model.get_base_model().model.layers)
    ev = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert sum(layer.forward.calls["fused"]
               for layer in model.get_base_model().model.layers) == fused + 2
    plain = copy.deepcopy(model)
    ckpt_ext.unpatch_llama(plain)
    torch.testing.assert_close(ev, plain(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               rtol=1e-5, atol=1e-6)


def test_compiled_peft_lora_dropout_has_no_graph_breaks_and_replays_eager():
    """torch.compile of a patched PEFT model with lora_dropout: no graph break, and under
    aot_eager (which draws the seeds with eager's generator) the same loss and gradients as
    eager for the same torch.manual_seed."""
    peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need it "
                               "(pip install -e '.[test]')")
    from hf_fixtures import assert_compiled_replays_eager
    from test_training_setups import ALL, loss_and_grads, make_batch, make_model
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=ALL, init_lora_weights=False))
    ckpt_ext.patch_llama(model, "balanced")
    assert_compiled_replays_eager(model, loss_and_grads, make_batch(), dict(rtol=1e-5, atol=1e-6),
                                  dict(rtol=1e-4, atol=1e-6))


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_layer_with_adapters_and_dropout_saves_the_formula(preset):
    """Adapters on every projection with dropout add only the 8-byte seed to what the preset
    keeps (the rank-r products and the masks are recomputed)."""
    from ckpt_ext.presets import saved_bytes
    x, weights, pe = layer_inputs(torch.float32)
    params = {n: torch.nn.Parameter(t) for n, t in weights.items()}
    x.requires_grad_()
    got = ckpt_ext.saved_activation_bytes(layer_loss, x, params, pe, DROPOUT, seed_tensor(3),
                                          preset)
    # layer_loss's own ops keep the scale row (H,) (for y * row) and y * row (for square)
    loss_extra = 4 * HS + 4 * BS * SL * HS
    expected = saved_bytes(preset, B=BS, S=SL, H=HS, Hq=NH, Hkv=NKV, D=D, I=IM,
                           dtype=torch.float32, lora_dropout=True)
    assert got - loss_extra == expected


def test_hf_gradient_checkpointing_replays_the_seed():
    """Under HF gradient checkpointing the layer's forward runs twice; the checkpoint restores
    the CPU generator, so the recompute draws the same seed: the gradients equal a run without
    checkpointing under the same torch.manual_seed."""
    peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need it "
                               "(pip install -e '.[test]')")
    from test_training_setups import ALL, loss_and_grads, make_batch, make_model
    torch.manual_seed(0)
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=ALL, init_lora_weights=False))
    ckpt_ext.patch_llama(model, "min_memory")
    ids, mask, labels = make_batch()
    torch.manual_seed(11)
    loss, grads = loss_and_grads(model, ids, mask, labels)
    model.get_base_model().gradient_checkpointing_enable()
    model.enable_input_require_grads()
    torch.manual_seed(11)
    loss_gc, grads_gc = loss_and_grads(model, ids, mask, labels)
    inner = model.get_base_model()
    assert sum(layer.forward.calls["fused"] for layer in inner.model.layers) >= 4
    torch.testing.assert_close(loss_gc, loss, rtol=1e-6, atol=1e-7)
    for name, g in grads.items():
        torch.testing.assert_close(grads_gc[name], g, rtol=1e-5, atol=1e-7, msg=name)
