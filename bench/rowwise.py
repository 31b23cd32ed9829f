"""Row-wise CUDA kernels benchmark: GB/s of ckpt_ext's CUDA C++ RMSNorm / residual-add RMSNorm /
RoPE kernels against a device-to-device copy of the same bytes, HF-style eager PyTorch and
torch.compile, all measured in the same run.

For every case and op, each implementation is timed per call with CUDA events (warmup, then
the median of --reps calls). Bandwidth is the op's compulsory traffic (every input read once,
every output written once; the dweight workspace is not counted) over that time, so the GB/s
of two implementations of one op compare like inverse times. ``copy`` is ``dst.copy_(src)``
of a buffer half that size (its reads plus writes are the same bytes), timed the same way just
before; ``frac_of_copy`` is an implementation's GB/s over it (goal for the CUDA kernels: at
least 0.8).

Ops and implementations:

* ``rms_norm_fwd``      - ckpt_ext ``rms_norm_fwd``; eager HF ``LlamaRMSNorm.forward``; that
  function under ``torch.compile``;
* ``add_rms_norm_fwd``  - ckpt_ext ``add_rms_norm_fwd``; eager ``s = x + r`` then the HF norm;
  compiled;
* ``rms_norm_bwd``      - ckpt_ext ``rms_norm_bwd`` (dx and dweight); the autograd backward of
  the eager and of the compiled HF norm (graph kept, backward timed alone);
* ``rope_fwd`` / ``rope_bwd`` - ckpt_ext ``rope_fwd`` / ``rope_bwd`` on q (B, Hq, S, D) and
  k (B, Hkv, S, D) given as HF gives them (transposed (B, S, H, D) projections); eager HF
  ``apply_rotary_pos_emb`` and its autograd backward; compiled.

Default cases: 16384 tokens x hidden {4096, 5120, 8192}, bf16; RoPE with B=4, S=4096,
Hq=32, Hkv=8, D=128. Writes ``bench/results/rowwise_<device>.csv``::

    python bench/rowwise.py [--tokens 16384] [--hidden 4096 5120 8192] [--dtype bf16]
                            [--reps 50] [--no-compile]

Without a CUDA GPU it only says so and exits 0: the CUDA kernels are compile-checked there
(tools/check_cuda_compile.sh) and the CPU reference ops are timed elsewhere.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from _harness import device_tag, print_table, provenance, time_ms, write_csv
from ckpt_ext import plain  # the HF semantics the kernels are measured against

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NO_GPU = "no CUDA GPU: the CUDA row-wise kernels are compile-checked only"
EPS = 1e-6


def hf_rms_norm(x, weight, eps=EPS):
    """HF LlamaRMSNorm.forward: x (..., N), weight (N,)."""
    return plain.rms_norm(x, weight, eps)


def hf_add_rms_norm(x, residual, weight, eps=EPS):
    s = x + residual
    return hf_rms_norm(s, weight, eps), s


def hf_rope(q, k, cos, sin):
    """HF apply_rotary_pos_emb: q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (B, S, D)."""
    return plain.rope(q, k, cos, sin)


def time_us(fn, warmup, reps):
    """Median time of fn() in microseconds (CUDA events around each call)."""
    return time_ms(fn, warmup, reps, "cuda") * 1e3


def copy_us(nbytes, warmup, reps):
    """Median time of a device-to-device copy whose reads plus writes total nbytes."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_us(lambda: dst.copy_(src), warmup, reps)


def backward_fn(fwd, inputs, grads):
    """A callable running only the backward of fwd(*inputs) (graph kept between calls)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = fwd(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)

    def run():
        for t in leaves:
            t.grad = None
        torch.autograd.backward(outs, grads, retain_graph=True)
    return run


def kernel_source(name):
    """Where the CUDA key of ckpt_ext::<name> is registered (from the dispatcher's dump)."""
    for line in torch._C._dispatch_dump(f"ckpt_ext::{name}").splitlines():
        if line.startswith("CUDA:"):
            return line
    return "CUDA: (none)"


def rms_norm_cases(tokens, hidden, dtype, compile_):
    """[(op, shape label, bytes, {impl: callable})] of the RMSNorm ops on (tokens, hidden)."""
    ops = torch.ops.ckpt_ext
    el = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    dy = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    label = f"{tokens}x{hidden}"
    row = tokens * hidden * el
    fwd = {"ckpt_ext": lambda: ops.rms_norm_fwd(x, w, EPS), "eager": lambda: hf_rms_norm(x, w)}
    add = {"ckpt_ext": lambda: ops.add_rms_norm_fwd(x, r, w, EPS),
           "eager": lambda: hf_add_rms_norm(x, r, w)}
    bwd = {"ckpt_ext": lambda: ops.rms_norm_bwd(dy, x, w, EPS),
           "eager": backward_fn(hf_rms_norm, (x, w), (dy,))}
    if compile_:
        c_norm, c_add = compile_(hf_rms_norm), compile_(hf_add_rms_norm)
        fwd["compiled"] = lambda: c_norm(x, w)
        add["compiled"] = lambda: c_add(x, r, w)
        bwd["compiled"] = backward_fn(compile_(hf_rms_norm), (x, w), (dy,))
    return [("rms_norm_fwd", label, 2 * row + hidden * el, fwd),              # x, w -> y
            ("add_rms_norm_fwd", label, 4 * row + hidden * el, add),          # x, r, w -> y, s
            ("rms_norm_bwd", label, 3 * row + 2 * hidden * el, bwd)]          # dy, x, w -> dx, dw


def rope_cases(B, S, Hq, Hkv, D, dtype, compile_):
    """[(op, shape label, bytes, {impl: callable})] of RoPE forward and backward."""
    ops = torch.ops.ckpt_ext
    el = torch.empty((), dtype=dtype).element_size()
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
    cos = torch.randn(B, S, D, device="cuda", dtype=dtype)
    sin = torch.randn_like(cos)
    dq_out = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype)
    dk_out = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype)
    label = f"B{B} S{S} Hq{Hq} Hkv{Hkv} D{D}"
    nbytes = 2 * (q.numel() + k.numel()) * el + 2 * cos.numel() * el  # q, k, cos, sin -> 2 outs

    def rope_qk(a, b):
        return hf_rope(a, b, cos, sin)

    fwd = {"ckpt_ext": lambda: ops.rope_fwd(q, k, cos, sin),
           "eager": lambda: hf_rope(q, k, cos, sin)}
    bwd = {"ckpt_ext": lambda: ops.rope_bwd(dq_out, dk_out, cos, sin),
           "eager": backward_fn(rope_qk, (q, k), (dq_out, dk_out))}
    if compile_:
        c_rope = compile_(hf_rope)
        fwd["compiled"] = lambda: c_rope(q, k, cos, sin)
        bwd["compiled"] = backward_fn(compile_(rope_qk), (q, k), (dq_out, dk_out))
    return [("rope_fwd", label, nbytes, fwd), ("rope_bwd", label, nbytes, bwd)]


def cases(args, dtype):
    """Yield (op, shape label, bytes, {impl: callable}); one shape's tensors live at a time."""
    compile_ = (lambda f: torch.compile(f, dynamic=False)) if args.compile else None
    for hidden in args.hidden:
        yield from rms_norm_cases(args.tokens, hidden, dtype, compile_)
    yield from rope_cases(*args.rope, dtype, compile_)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the RMSNorm cases")
    ap.add_argument("--hidden", nargs="+", type=int, default=[4096, 5120, 8192])
    ap.add_argument("--rope", nargs=5, type=int, default=[4, 4096, 32, 8, 128],
                    metavar=("B", "S", "HQ", "HKV", "D"), help="RoPE case")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile baselines")
    ap.add_argument("--out", default=None,
                    help="CSV path (default bench/results/rowwise_<device>.csv)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0

    import ckpt_ext  # noqa: F401  (registers torch.ops.ckpt_ext)

    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    name = (f"{torch.cuda.get_device_name()} "
            f"(sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    print(f"device: {name}; torch {torch.__version__}")
    for op in ("rms_norm_fwd", "add_rms_norm_fwd", "rms_norm_bwd", "rope_fwd", "rope_bwd"):
        src = kernel_source(op)
        note = "" if "rowwise_launch.cpp" in src else "   <-- NOT the CUDA C++ kernel"
        print(f"  {op}: {src}{note}")

    rows = []
    for op, label, nbytes, impls in cases(args, dtype):
        t_copy = copy_us(nbytes, args.warmup, args.reps)
        copy_gbps = nbytes / t_copy / 1e3
        rows.append({"op": op, "shape": label, "dtype": args.dtype, "impl": "copy",
                     "mbytes": nbytes / 1e6, "median_us": t_copy, "gbps": copy_gbps,
                     "frac_of_copy": 1.0, "speedup_vs_eager": float("nan")})
        times = {impl: time_us(fn, args.warmup, args.reps) for impl, fn in impls.items()}
        for impl, t in times.items():
            rows.append({"op": op, "shape": label, "dtype": args.dtype, "impl": impl,
                         "mbytes": nbytes / 1e6, "median_us": t, "gbps": nbytes / t / 1e3,
                         "frac_of_copy": nbytes / t / 1e3 / copy_gbps,
                         "speedup_vs_eager": times["eager"] / t})
        torch.cuda.empty_cache()

    cols = ["op", "shape", "dtype", "impl", "mbytes", "median_us", "gbps", "frac_of_copy",
            "speedup_vs_eager"]
    print_table(cols, rows)
    print("goal: ckpt_ext frac_of_copy >= 0.8")
    for r in rows:
        if r["impl"] == "ckpt_ext":
            verdict = "meets" if r["frac_of_copy"] >= 0.8 else "MISSES"
            print(f"  {r['op']:>16} {r['shape']}: {r['frac_of_copy']:.2f} of copy ({verdict}), "
                  f"{r['speedup_vs_eager']:.2f}x eager")

    out = pathlib.Path(args.out) if args.out else RESULTS / f"rowwise_{device_tag()}.csv"
    header = provenance("cuda") + [f"config: warmup {args.warmup}, reps {args.reps}"]
    write_csv(out, header, cols, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
