"""The decoder layer's MLP over token chunks of the byte cap (CKPT_EXT_CHUNK_BYTES): LoRA
dropout masks hashed on global rows (the ops' row offsets) and no (tokens, I) tensor in the
Triton backward."""
import contextlib

import pytest
import torch

import ckpt_ext
from ckpt_ext import blocks, config

from reference import rope_args, make_layer, rope_tables

from test_lora_dropout import needs_interpreter, seed_tensor

OPS = torch.ops.ckpt_ext


def triton_backend():
    from ckpt_ext._backend import use_triton
    return use_triton("cpu")


BACKENDS = [pytest.param(contextlib.nullcontext, id="cpu"),
            pytest.param(triton_backend, id="triton", marks=needs_interpreter)]


# ---- the ops' row offsets --------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_dropout_of_a_row_chunk_is_that_chunk_of_the_whole(backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 25, 33, generator=g)          # rows of the (50, 33) view
    seed = seed_tensor(2**33 + 17)
    with backend():
        whole = OPS.lora_dropout(x, seed, 5, 0.4).reshape(50, 33)
        flat = x.reshape(50, 33)
        for t0, n in ((0, 50), (0, 1), (17, 17), (49, 1), (33, 17)):
            got = OPS.lora_dropout(flat[t0:t0 + n], seed, 5, 0.4, t0)
            assert torch.equal(got, whole[t0:t0 + n]), (t0, n)
        # another offset is another mask
        assert not torch.equal(OPS.lora_dropout(flat[17:34], seed, 5, 0.4, 16), whole[17:34])
        with pytest.raises(ValueError, match="row_offset must be"):
            OPS.lora_dropout(flat, seed, 5, 0.4, -1)


T, H, I, R = 37, 24, 40, 3


def swiglu_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    x = rnd(T, H, scale=1.0)
    w = [rnd(I, H), rnd(I, H), rnd(H, I), rnd(I), rnd(I), rnd(H)]
    lora = [rnd(R, H), rnd(I, R), rnd(R, H), rnd(I, R), rnd(R, I), rnd(H, R)]
    return x, w, lora, rnd(T, H, scale=1.0)


@pytest.mark.parametrize("backend,dtype,tol", [
    pytest.param(contextlib.nullcontext, torch.float64, 1e-12, id="cpu-fp64"),
    pytest.param(triton_backend, torch.float32, 2e-6, id="triton-fp32", marks=needs_interpreter)])
def test_swiglu_row_chunks_with_offsets_equal_the_whole(backend, dtype, tol):
    """Every adapter with dropout: the chunks' y and dx rows are the whole op's rows, and the
    weight / adapter gradients sum to the whole op's (chunks of 1 and 17 rows of 37)."""
    x, w, lora, dy = swiglu_case(dtype)
    scaling, dropout, seed = [0.7, 1.3, 0.9], [0.3, 0.2, 0.4], seed_tensor(77)
    with backend():
        y = OPS.swiglu_fwd(x, *w, lora, scaling, False, dropout, seed)[0]
        whole = OPS.swiglu_bwd(dy, x, *w, lora, scaling, None, None, [True] * 12, dropout, seed)
        whole = [whole[0], *whole[1:7], *whole[7]]
        for rows in (1, 17):
            ys, dxs, sums = [], [], None
            for t0 in range(0, T, rows):
                sl = slice(t0, min(T, t0 + rows))
                ys.append(OPS.swiglu_fwd(x[sl], *w, lora, scaling, False, dropout, seed, t0)[0])
                g = OPS.swiglu_bwd(dy[sl], x[sl], *w, lora, scaling, None, None, [True] * 12,
                                   dropout, seed, t0)
                g = [g[0], *g[1:7], *g[7]]
                dxs.append(g[0])
                sums = g[1:] if sums is None else [s + d for s, d in zip(sums, g[1:])]
            scale = y.abs().max().item()
            torch.testing.assert_close(torch.cat(ys), y, rtol=tol, atol=tol * scale)
            torch.testing.assert_close(torch.cat(dxs), whole[0], rtol=tol,
                                       atol=tol * whole[0].abs().max().item())
            for i, (s, r) in enumerate(zip(sums, whole[1:])):
                torch.testing.assert_close(s, r, rtol=tol, atol=tol * r.abs().max().item(),
                                           msg=f"gradient {i + 1} at {rows} rows")
        # the offset matters: without it the chunks' masks repeat the first rows'
        y_wrong = torch.cat([OPS.swiglu_fwd(x[t0:t0 + 17], *w, lora, scaling, False, dropout,
                                            seed)[0] for t0 in range(0, T, 17)])
        assert (y_wrong - y).abs().max() > 100 * tol * y.abs().max()
        with pytest.raises(ValueError, match="dropout_row_offset must be"):
            OPS.swiglu_fwd(x, *w, lora, scaling, False, dropout, seed, -3)


# ---- the decoder layer's MLP sublayer -------------------------------------------------------
# (The whole layer in chunks, every preset and feature: tests/test_chunked_layer.py.)


def mlp_rows_cap(rows, dtype, intermediate):
    """CKPT_EXT_CHUNK_BYTES for MLP chunks of `rows` tokens: three (rows, I) tensors at the
    compute width."""
    return str(rows * 3 * intermediate * max(4, dtype.itemsize))


@needs_interpreter
def test_triton_layer_backward_holds_no_token_by_intermediate_tensor(monkeypatch):
    """The Triton SwiGLU backward forms three (rows, I) tensors: over the whole sequence they
    are the MLP part's peak; in chunks of 32 tokens the peak falls by about 3 (T - 32) I
    elements (the check can fail: the one-chunk peak is measured too)."""
    Tn, Hn, In = 128, 32, 1024
    torch.manual_seed(0)
    layer = make_layer(Hn, 4, 2, In, dtype=torch.float32)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    x = torch.randn(1, Tn, Hn)
    pe = rope_tables(Tn, Hn // 4, dtype=torch.float32)

    def step(xx):
        blocks.decoder_layer(xx, blocks.LayerOptions(
            weights=weights, **rope_args(pe), num_heads=4, num_kv_heads=2, part="mlp",
            preset="balanced")).sum().backward()

    peaks = {}
    with triton_backend():
        for rows in (Tn, 32):
            config.update(chunk_bytes=mlp_rows_cap(rows, torch.float32, In))
            peaks[rows] = ckpt_ext.peak_memory_bytes(step, x.clone().requires_grad_())
    assert peaks[Tn] - peaks[32] >= 0.8 * 3 * (Tn - 32) * In * 4, peaks
