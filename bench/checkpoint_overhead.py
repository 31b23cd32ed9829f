"""Per-call overhead of ckpt_ext.checkpoint vs torch.utils.checkpoint, and an 8-layer MLP stack.

Everything is measured in one run, on the device found (CUDA if present, else CPU):

1. Per-call overhead on a tiny function (forward + backward of ``x.sin() * w``, 16 elements):
   the median time of a checkpointed call minus the median time of the plain call.
2. An MLP stack (8 x [Linear(d, 4d), GELU, Linear(4d, d)] with residuals): saved activation
   bytes, the peak of a training step (its gradients present) and the forward+backward step
   time for none / torch / ckpt_ext (one checkpoint per layer).

Prints a table and writes ``bench/results/checkpoint_overhead_<device>.csv``.
Target: ckpt_ext's per-call overhead at most one third of torch's.

    python bench/checkpoint_overhead.py [--reps 3000] [--tokens 512] [--dim 256]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import device_name, provenance, time_ms, write_csv  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def timed(step, device, reps, chunk):
    """Median seconds per call of `step`, over samples of `chunk` calls (about reps calls)."""
    return time_ms(step, max(reps // 10, 5), max(reps // chunk, 5), device, chunk) / 1e3


def wrappers():
    return {
        "none": lambda fn, *a: fn(*a),
        "torch": lambda fn, *a: torch_checkpoint(fn, *a, use_reentrant=False),
        "ckpt_ext": ckpt_ext.checkpoint,
    }


def tiny_overhead(device, reps):
    x = torch.randn(16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    fn = lambda t: t.sin() * w  # noqa: E731
    times = {}
    for name, wrap in wrappers().items():
        def step(wrap=wrap):
            wrap(fn, x).sum().backward()
        times[name] = timed(step, device, reps, chunk=50)
    return times


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def mlp_stack(device, tokens, dim, reps):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(dim) for _ in range(8)).to(device)
    x = torch.randn(tokens, dim, device=device, requires_grad=True)
    rows = {}
    grads = {}
    for name, wrap in wrappers().items():
        def forward(inp, wrap=wrap):
            for b in blocks:
                inp = wrap(b, inp)
            return inp

        def step():
            forward(x).square().mean().backward()

        saved = ckpt_ext.saved_activation_bytes(forward, x)
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        step()
        grads[name] = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
        peak = ckpt_ext.peak_memory_bytes(step)   # gradients present: added to in place
        rows[name] = (saved, peak, timed(step, device, reps, chunk=2))
    err = {n: max((a - b).abs().max().item() for a, b in zip(grads[n], grads["none"]))
           for n in grads}
    return rows, err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3000, help="calls timed for the tiny function")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--stack-reps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    tiny = tiny_overhead(device, args.reps)
    over = {n: tiny[n] - tiny["none"] for n in ("torch", "ckpt_ext")}
    ratio = over["ckpt_ext"] / over["torch"] if over["torch"] > 0 else float("nan")
    stack, err = mlp_stack(device, args.tokens, args.dim, args.stack_reps)

    header = provenance(device) + [f"config: reps={args.reps} tokens={args.tokens} "
                                   f"dim={args.dim} stack_reps={args.stack_reps}"]
    print(f"device: {device_name(device)}; torch {torch.__version__}")
    print("\nPer-call overhead on a tiny function (forward+backward, median):")
    print(f"{'mode':<10}{'time/call (us)':>16}{'overhead (us)':>16}")
    for n in ("none", "torch", "ckpt_ext"):
        o = "" if n == "none" else f"{over[n] * 1e6:16.1f}"
        print(f"{n:<10}{tiny[n] * 1e6:16.1f}{o}")
    print(f"ckpt_ext overhead / torch overhead = {ratio:.3f} (target <= 0.333)")

    print(f"\n8-layer MLP stack (tokens={args.tokens}, dim={args.dim}, fp32):")
    print(f"{'mode':<10}{'saved MiB':>12}{'peak MiB':>12}{'step (ms)':>12}{'x none':>9}"
          f"{'max |dgrad|':>14}")
    for n, (saved, peak, t) in stack.items():
        print(f"{n:<10}{saved / 2**20:12.3f}{peak / 2**20:12.3f}{t * 1e3:12.2f}"
              f"{t / stack['none'][2]:9.3f}{err[n]:14.2e}")

    path = os.path.join(RESULTS, f"checkpoint_overhead_{device.type}.csv")
    rows = [["tiny", n, f"{tiny[n]:.9f}", "" if n == "none" else f"{over[n]:.9f}", "", "",
             f"{tiny[n] / tiny['none']:.4f}", ""] for n in ("none", "torch", "ckpt_ext")]
    rows += [["mlp_stack", n, f"{t:.6f}", "", saved, peak, f"{t / stack['none'][2]:.4f}",
              f"{err[n]:.3e}"] for n, (saved, peak, t) in stack.items()]
    rows.append(["tiny", "overhead_ratio_ckpt_ext_over_torch", "", f"{ratio:.4f}", "", "", "",
                 ""])
    print()
    write_csv(path, header, ["benchmark", "mode", "time_s", "overhead_s", "saved_bytes",
                             "peak_bytes", "ratio_to_none", "max_grad_err"], rows)
    return ratio


if __name__ == "__main__":
    main()
