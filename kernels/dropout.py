"""LoRA dropout with a replayable mask, in Triton: the ``lora_dropout`` op's CUDA launcher and
the mask function the fused SwiGLU kernels call inside their tiles.

The mask of element (row, col) of a tensor viewed as ``(numel / size(-1), size(-1))`` is a
hash of (seed, stream, row, col), so the backward regenerates the forward's mask from the
seed alone, whatever the tiling (uint32 arithmetic; the C++ reference in
``csrc/lora_dropout.h`` computes the same bits):

    key(seed, stream) = mix32(lo ^ mix32(hi) ^ mix32(stream + 0x9E3779B9))
    hash(row, col)    = mix32(mix32(row ^ key) ^ col)
    keep              = hash >= floor(p * 2^32)
    out               = keep ? x * (1 / (1 - p)) : 0     (product in float32)

where lo and hi are the low and high 32 bits of the 64-bit seed (two's complement): every bit
of the seed counts, and seeds in [0, 2^32) keep the key mix32(seed ^ mix32(stream + ...)) since
mix32(0) = 0. A 0-d tensor is viewed as (1, 1).
"""
import torch
import triton
import triton.language as tl

from .._checks import _check_floating, _check_probability, _check_row_offset, _check_seed
from . import _launch

_M32 = 0xFFFFFFFF


def _mix32_host(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _M32
    x ^= x >> 15
    return x


def dropout_key(seed: int, stream: int) -> int:
    """The uint32 key of (seed, stream) (seed: any int64), as a Python int in [0, 2^32)."""
    return _mix32_host((seed & _M32) ^ _mix32_host((seed >> 32) & _M32)
                       ^ _mix32_host(stream + 0x9E3779B9))


def dropout_threshold(p: float) -> int:
    """floor(p * 2^32) for p in [0, 1): an element is kept when its hash is at least this."""
    return int(p * 4294967296.0)


def read_seed(op: str, name: str, seed) -> int:
    """The value of a dropout seed tensor (a CPU integer tensor with one element: reading it
    never waits for a device)."""
    _check_seed(op, name, seed)
    return int(seed.item())


@triton.jit
def _mix32(x):
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def keep_mask(key, threshold, rows, cols):
    """bool mask of the elements (rows, cols) (broadcastable int tensors, e.g. (M, 1) and
    (1, N)) under ``key`` / ``threshold`` (Python ints in [0, 2^32))."""
    k = key.to(tl.uint32)
    hr = _mix32(rows.to(tl.uint32) ^ k)
    return _mix32(hr ^ cols.to(tl.uint32)) >= threshold.to(tl.uint32)


@triton.jit(do_not_specialize=["key", "threshold", "row0"])
def _lora_dropout_kernel(x_ptr, out_ptr, rows, cols, key, threshold, inv, row0,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    inside = (offs_r < rows) & (offs_c < cols)
    offs = offs_r.to(tl.int64) * cols + offs_c
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    keep = keep_mask(key, threshold, offs_r + row0, offs_c)   # the mask of the global rows
    y = tl.where(keep, x.to(tl.float32) * inv, 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["key_a", "threshold_a", "key_b", "threshold_b", "row0"])
def _lora_dropout_pair_kernel(a_ptr, b_ptr, out_a_ptr, out_b_ptr, rows, cols, key_a,
                              threshold_a, inv_a, key_b, threshold_b, inv_b, row0,
                              SUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    inside = (offs_r < rows) & (offs_c < cols)
    offs = offs_r.to(tl.int64) * cols + offs_c
    a = tl.load(a_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    ya = tl.where(keep_mask(key_a, threshold_a, offs_r + row0, offs_c), a * inv_a, 0.0)
    if SUM:
        b = tl.load(b_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        yb = tl.where(keep_mask(key_b, threshold_b, offs_r + row0, offs_c), b * inv_b, 0.0)
        tl.store(out_a_ptr + offs, (ya + yb).to(out_a_ptr.dtype.element_ty), mask=inside)
    else:
        yb = tl.where(keep_mask(key_b, threshold_b, offs_r + row0, offs_c), a * inv_b, 0.0)
        tl.store(out_a_ptr + offs, ya.to(out_a_ptr.dtype.element_ty), mask=inside)
        tl.store(out_b_ptr + offs, yb.to(out_b_ptr.dtype.element_ty), mask=inside)


def lora_dropout_pair(a, b, seed, streams, ps, row_offset=0, out_dtype=None):
    """Two adapters' dropouts (stream ``streams[i]``, probability ``ps[i]`` > 0, one seed and
    row offset) in one launch, for the SwiGLU launchers (a launcher helper, not an op):
    with ``b`` None, ``(lora_dropout(a, .., streams[0], ps[0]), lora_dropout(a, .., streams[1],
    ps[1]))``, a read once; else ``lora_dropout(a, .., streams[0], ps[0]) + lora_dropout(b, ..,
    streams[1], ps[1])`` for a and b of one shape, the two float32 products added in float32,
    as adding the two dropouts' float32 results (the same bits). ``out_dtype``: as
    ``lora_dropout``'s (a's dtype by default)."""
    op = "lora_dropout_pair"
    for name, t in (("a", a), ("b", b)):
        if t is not None:
            _check_floating(op, name, t)
            _launch.check_operands(op, (name, t), uses_dot=False)
    if b is not None and b.shape != a.shape:
        raise ValueError(f"{op}: b must have the shape of a {tuple(a.shape)}, got "
                         f"{tuple(b.shape)}")
    for p in ps:
        _check_probability(op, "p", p)
    _check_row_offset(op, "row_offset", row_offset)
    value = read_seed(op, "seed", seed)
    keys = [dropout_key(value, s) for s in streams]
    src_a = a.contiguous()
    src_b = b.contiguous() if b is not None else src_a
    out_a = torch.empty_like(src_a, dtype=out_dtype)
    out_b = torch.empty_like(src_a, dtype=out_dtype) if b is None else out_a
    if src_a.numel() > 0:
        cols = src_a.shape[-1] if src_a.dim() else 1
        rows = src_a.numel() // cols
        block_r, block_c = 16, min(triton.next_power_of_2(cols), 256)
        grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
        with _launch.on_device(a.device):
            _lora_dropout_pair_kernel[grid](
                src_a, src_b, out_a, out_b, rows, cols, keys[0], dropout_threshold(ps[0]),
                1.0 / (1.0 - ps[0]), keys[1], dropout_threshold(ps[1]), 1.0 / (1.0 - ps[1]),
                row_offset, SUM=b is not None, BLOCK_R=block_r, BLOCK_C=block_c)
    return out_a if b is not None else (out_a, out_b)


def lora_dropout(x, seed, stream, p, row_offset=0, out_dtype=None):
    """The ``lora_dropout`` op on a CUDA tensor (or a CPU one under the interpreter); x's
    rows are rows ``row_offset``.. of a larger tensor. ``out_dtype`` (the launchers' own
    argument, not the op's): the result's dtype, x's by default; float32 gives exactly
    ``lora_dropout(x.float(), ...)`` (the product is float32 either way) in one pass, without
    the float32 copy of x."""
    op = "lora_dropout"
    _check_floating(op, "x", x)
    _launch.check_operands(op, ("x", x), uses_dot=False)
    _check_probability(op, "p", p)
    _check_row_offset(op, "row_offset", row_offset)
    key = dropout_key(read_seed(op, "seed", seed), stream)
    src = x.contiguous()
    out = torch.empty_like(src, dtype=out_dtype)
    if src.numel() == 0:
        return out
    cols = src.shape[-1] if src.dim() else 1
    rows = src.numel() // cols
    block_r, block_c = 16, min(triton.next_power_of_2(cols), 256)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    with _launch.on_device(x.device):
        _lora_dropout_kernel[grid](src, out, rows, cols, key, dropout_threshold(p),
                                   1.0 / (1.0 - p), row_offset, BLOCK_R=block_r,
                                   BLOCK_C=block_c)
    return out
