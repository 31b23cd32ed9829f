"""Step time of the sequence-tiled layer against the same layer in one token chunk.

One HF Llama from a config (the peak bench's defaults: H 512, I 1792, 8/2 heads, vocab 16384,
4 layers, B 1, S 4096, fp32; the same flags as ``bench/peak.py``), patched with a fused preset
and the fused head (``--lora``: PEFT LoRA r16 first), trained on one batch, on the CPU or a
GPU (``--device``). The byte cap of the token chunks (``ckpt_ext.config``'s ``chunk_bytes``)
is switched between steps: ``1024GiB`` runs every layer in one chunk (the layer as it was before
the tiling), the others in chunks. Steps of the caps alternate (round robin), so a slow
moment of the machine falls on all of them alike; the medians and each cap's ratio to the
one-chunk median are printed with the load average before and after. The peak of each cap
(the allocator's, above the step's start) is printed beside it.

    python bench/chunk_overhead.py [--preset min_memory] [--caps 1024GiB 64MiB 16MiB] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import ckpt_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peak as peak_bench  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="min_memory", choices=["fast", "balanced", "min_memory"])
    p.add_argument("--caps", nargs="+", default=["1024GiB", "64MiB", "16MiB"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--lora", action="store_true", help="PEFT LoRA r16 on a frozen base")
    peak_bench.add_model_args(p)
    args = p.parse_args(argv)
    setup = f"{'lora:' if args.lora else ''}{args.preset}+fused"
    model = peak_bench.build(args, setup)
    ids = torch.randint(args.vocab, (1, args.seq), device=args.device)
    cuda = args.device.startswith("cuda")
    print(f"{setup}, H {args.hidden}, I {args.intermediate}, {args.heads}/{args.kv_heads} "
          f"heads, vocab {args.vocab}, {args.layers} layers, B 1, S {args.seq}, {args.dtype}, "
          f"{args.device}, {torch.get_num_threads()} threads; load average before "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    times = {c: [] for c in args.caps}
    peaks = {}

    def step():
        peak_bench.step(model, ids)
        if cuda:
            torch.cuda.synchronize()

    for cap in args.caps:                           # warm-up, and each cap's peak
        with ckpt_ext.config.patch(chunk_bytes=cap):
            step()
            peaks[cap] = ckpt_ext.peak_memory_bytes(peak_bench.step, model, ids)
    for _ in range(args.reps):
        for cap in args.caps:
            with ckpt_ext.config.patch(chunk_bytes=cap):
                t0 = time.perf_counter()
                step()
                times[cap].append(time.perf_counter() - t0)
    base = statistics.median(times[args.caps[0]])
    for cap in args.caps:
        med = statistics.median(times[cap])
        print(f"cap {cap:>6}: step {med:7.3f} s median of {args.reps} ({med / base:.3f}x "
              f"{args.caps[0]})  peak {peaks[cap] / 2**20:8.1f} MiB "
              f"{peaks[cap] / args.seq / 1024:6.1f} KiB/token")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
