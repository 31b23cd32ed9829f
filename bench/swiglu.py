"""SwiGLU MLP benchmark: eager HF-style LlamaMLP vs the Triton launchers (save="gate_up" and
save="input").

For every (model, tokens) case, in one run and on the same weights:

* (a) ``eager``   - ``down(silu(gate(x)) * up(x))`` with three bias-free ``nn.Linear``s, the way
  HF ``LlamaMLP`` writes it;
* (b) ``gate_up`` - ``swiglu_fwd(..., return_gate_up=True)`` / ``swiglu_bwd`` from the saved
  gate and up;
* (c) ``input``   - ``swiglu_fwd(..., return_gate_up=False)`` / ``swiglu_bwd`` recomputing
  gate and up tile by tile from x; only x is kept for the backward.

(b) and (c) are wrapped in a small ``torch.autograd.Function`` defined here, so the three are
timed the same way: forward, backward and total per step (CUDA events, warmup, median), the
peak memory of the step above what was allocated before it (``torch.cuda.max_memory_allocated``
delta), and the bytes saved for backward (unique storages packed through
``torch.autograd.graph.saved_tensors_hooks``, weights excluded). Ratios are to eager in the
same run. Goal: ``input`` total at most 1.25x eager (the FLOP floor is 11/9 = 1.22x).

GPU (default cases: LLaMA-7B H 4096 / I 11008 and LLaMA-3-8B H 4096 / I 14336, 4k/8k/16k
tokens, bf16)::

    python bench/swiglu.py [--models llama7b llama3_8b] [--tokens 4096 8192 16384] [--reps 20]

Without a GPU it runs the Triton interpreter on CPU at a tiny size (T 64, H 64, I 96, fp32),
which checks the plumbing only: NOT a performance figure. Writes
``bench/results/swiglu_<device>.csv`` (``swiglu_cpu_smoke.csv`` on CPU).
"""
from __future__ import annotations

import argparse
import os
import pathlib

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch.nn as nn  # noqa: E402
import triton  # noqa: E402

from ckpt_ext.kernels import swiglu_mlp  # noqa: E402
from _harness import (device_name, device_tag, peak_mib, print_table, provenance,  # noqa: E402
                      time_steps, write_csv)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODELS = {"llama7b": (4096, 11008), "llama3_8b": (4096, 14336), "tiny": (64, 96)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_LABEL = "CPU interpreter run: NOT a performance figure"


class LlamaMLP(nn.Module):
    """HF-style eager SwiGLU MLP: x (T, H) -> (T, H)."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TritonSwiGLU(torch.autograd.Function):
    """Bench-only autograd wrapper of the launchers (bias-free): x (T, H) -> y (T, H)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, save):
        y, gate, up = swiglu_mlp.swiglu_fwd(x, w_gate, w_up, w_down, None, None, None, [], [],
                                            save == "gate_up")
        if save == "gate_up":
            ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        else:
            ctx.save_for_backward(x, w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, *gate_up = ctx.saved_tensors
        gate, up = gate_up if gate_up else (None, None)
        dx, dwg, dwu, dwd, _, _, _, _ = swiglu_mlp.swiglu_bwd(
            dy.contiguous(), x, w_gate, w_up, w_down, None, None, None, [], [], gate, up,
            [True] * 12)
        return dx, dwg, dwu, dwd, None


def make_step(variant, mlp):
    """Returns forward(x) -> y for one variant, sharing the weights of `mlp`."""
    if variant == "eager":
        return mlp
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    return lambda x: TritonSwiGLU.apply(x, *w, variant)


def saved_bytes(forward, x, params):
    """Bytes of the unique storages saved for backward by forward(x), parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(x)
    del y
    return sum(seen.values())


def measure(variant, mlp, x, dy, warmup, reps):
    """Median forward / backward / total ms; peak memory of one step above what was allocated
    before it (MiB, GPU only; includes the weight and input gradients, the same for all
    variants); MiB saved for backward."""
    forward = make_step(variant, mlp)
    params = list(mlp.parameters())

    def step(clock=None):
        for p in params:
            p.grad = None
        x.grad = None
        if clock:
            clock.mark()
        y = forward(x)
        if clock:
            clock.mark()
        y.backward(dy)
        if clock:
            clock.mark()

    times = time_steps(step, warmup, reps)
    for p in params:
        p.grad = None
    x.grad = None
    peak = peak_mib(step)
    saved = saved_bytes(forward, x, params) / 2**20
    for p in params:
        p.grad = None
    x.grad = None
    return {**times, "peak_mib": peak, "saved_mib": saved}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS),
                    default=["llama7b", "llama3_8b"] if CUDA else ["tiny"])
    ap.add_argument("--tokens", nargs="+", type=int,
                    default=[4096, 8192, 16384] if CUDA else [64])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if CUDA else "fp32",
                    help="bf16 is wrong in the Triton interpreter: use fp32/fp16 on CPU")
    ap.add_argument("--warmup", type=int, default=5 if CUDA else 1)
    ap.add_argument("--reps", type=int, default=20 if CUDA else 3)
    ap.add_argument("--out", default=None, help="CSV path (default bench/results/swiglu_<device>.csv)")
    args = ap.parse_args(argv)
    if not CUDA and args.dtype == "bf16":
        ap.error("--dtype bf16 needs a GPU (bf16 tl.dot is wrong in the Triton interpreter)")

    device = torch.device("cuda" if CUDA else "cpu")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    if not CUDA:
        # Tiny CPU GEMMs on a shared 2-core machine spend their time waking OpenMP threads.
        torch.set_num_threads(1)
        print(CPU_LABEL)

    rows = []
    for model in args.models:
        hidden, inter = MODELS[model]
        mlp = LlamaMLP(hidden, inter).to(device=device, dtype=dtype)
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
            res = {v: measure(v, mlp, x, dy, args.warmup, args.reps)
                   for v in ("eager", "gate_up", "input")}
            for variant, r in res.items():
                rows.append({"model": model, "H": hidden, "I": inter, "tokens": tokens,
                             "dtype": args.dtype, "variant": variant, **r,
                             "fwd_x_eager": r["fwd_ms"] / res["eager"]["fwd_ms"],
                             "bwd_x_eager": r["bwd_ms"] / res["eager"]["bwd_ms"],
                             "total_x_eager": r["total_ms"] / res["eager"]["total_ms"],
                             "eager_tflops": 18 * tokens * hidden * inter / r["total_ms"] / 1e9})
            del x, dy
        del mlp

    cols = ["model", "H", "I", "tokens", "dtype", "variant", "fwd_ms", "bwd_ms", "total_ms",
            "fwd_x_eager", "bwd_x_eager", "total_x_eager", "peak_mib", "saved_mib", "eager_tflops"]
    print(f"device: {device_name(device)}; torch {torch.__version__}; triton {triton.__version__}")
    print_table(cols, rows)
    print("eager_tflops: the eager FLOP count (18 T H I) over the step time; "
          "goal: input total_x_eager <= 1.25")
    for r in rows:
        if CUDA and r["variant"] == "input":
            verdict = "meets" if r["total_x_eager"] <= 1.25 else "misses"
            eager = next(q for q in rows if q["variant"] == "eager" and q["model"] == r["model"]
                         and q["tokens"] == r["tokens"])
            print(f"  {r['model']} T={r['tokens']}: input total {r['total_x_eager']:.3f}x eager "
                  f"({verdict} the 1.25x goal), saved {r['saved_mib']:.1f} MiB vs eager {eager['saved_mib']:.1f} MiB")
    if not CUDA:
        print(CPU_LABEL)

    out = pathlib.Path(args.out) if args.out else RESULTS / f"swiglu_{device_tag('cpu_smoke')}.csv"
    write_csv(out, provenance(device, "" if CUDA else CPU_LABEL), cols, rows)


if __name__ == "__main__":
    main()
