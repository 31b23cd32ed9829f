"""Host bytes and step peak of segments of k layers (``segment_layers=k``) with offload.

The model is ``bench/peak.py``'s ``build()`` (an HF Llama from a config), patched with
``policy="min_memory"``, the fused head, ``offload="cpu"`` and ``segment_layers=k`` for each k
asked. For each k, after an untimed warm-up step (the gradients and the offloader's host and
device pools exist afterwards; the pools are reused, so they are not in the peak):

* the offloader's host pool (``Offloader.stats()``: ``host_bytes``, the buffers allocated,
  each one segment's first input) and device pool (the prefetch slots);
* the step's peak, ``ckpt_ext.peak_memory_bytes`` (on the CPU the allocator's reports through
  the profiler);
* the step time, the median of ``--repeats`` steps, the setups' steps interleaved so that all
  see the same machine load (still noisy on a shared machine: the load average is printed at
  the start and the end).

With k layers per segment the host keeps one layer input per segment, ceil(L / k) of them
instead of L; the device holds, while a segment's backward runs, up to k - 1 rebuilt inputs
beside the layer's backward, and the backward runs k - 1 more layer forwards per segment.

With ``--stream`` (``offload_stream=True``) the layer inputs stay in host memory through the
backward, read a token chunk at a time: the device pool holds no slot for them, and the
rebuilt inputs of a segment go to the host pool too (its buffers count them).

    python bench/segments.py                       # a small model (about a minute on 2 cores)
    python bench/segments.py --stream              # the same with streamed inputs
    python bench/segments.py --seq 4096 --hidden 512 --intermediate 1792 --heads 8 --vocab 16384
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_ext  # noqa: E402
from peak import add_model_args, build, step  # noqa: E402

# The defaults: a small model, so that the bench runs in about a minute on the CPU.
SMALL = dict(seq=512, layers=4, hidden=128, intermediate=448, heads=4, kv_heads=2, vocab=1024)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--segments", type=int, nargs="+", default=[1, 2, 4],
                   help="the segment_layers values (k) to measure")
    p.add_argument("--seq", type=int, default=SMALL["seq"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--stream", action="store_true",
                   help="offload_stream=True: streamed inputs, rebuilt inputs in host memory")
    add_model_args(p)
    p.set_defaults(**{k: v for k, v in SMALL.items() if k != "seq"})
    args = p.parse_args(argv)
    if args.seq < 2 or args.batch < 1 or args.repeats < 1 or \
            any(k < 1 for k in args.segments):
        p.error("--seq must be >= 2, --batch, --repeats and every --segments value >= 1")
    return args


def measure(args: argparse.Namespace) -> dict:
    """For each k of ``args.segments``: ``host_bytes`` and ``host_allocations`` (the host
    pool after a step), ``device_pool_bytes``, ``peak`` (the step's allocator peak, pools
    allocated), ``seconds`` (the median step time) and ``layer_input_bytes`` (one layer
    input, B*S*H elements of the model's dtype)."""
    ids = torch.randint(args.vocab, (args.batch, args.seq), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    models, offloaders = {}, {}
    for k in args.segments:
        model = build(args, "min_memory+fused")
        ckpt_ext.patch_llama(model, "min_memory", offload="cpu", segment_layers=k,
                             offload_stream=args.stream)
        offloaders[k] = ckpt_ext.hf.patch._decoder_layers(model)[1][0].forward.shared.offloader
        step(model, ids)                  # warm-up: gradients, pools
        models[k] = model
    times = {k: [] for k in models}
    for _ in range(args.repeats):         # interleaved: every k sees the same machine load
        for k, model in models.items():
            sync()
            t0 = time.perf_counter()
            step(model, ids)
            sync()
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k, model in models.items():
        peak = ckpt_ext.peak_memory_bytes(step, model, ids)
        stats = offloaders[k].stats()
        x = model.get_input_embeddings().weight
        out[k] = dict(host_bytes=stats["host_bytes"], host_allocations=stats["host_allocations"],
                      device_pool_bytes=stats["device_pool_bytes"], peak=peak,
                      seconds=statistics.median(times[k]),
                      layer_input_bytes=args.batch * args.seq * args.hidden * x.element_size())
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    print(f"H {args.hidden}, I {args.intermediate}, {args.heads}/{args.kv_heads} heads, vocab "
          f"{args.vocab}, {args.layers} layers, B {args.batch}, S {args.seq}, {args.dtype}, "
          f"{args.device}, torch threads {torch.get_num_threads()}, min_memory + fused head + "
          "offload='cpu'" + (", offload_stream=True" if args.stream else ""))
    print(f"load average at start: {os.getloadavg()}")
    out = measure(args)
    base = out.get(1)
    mib = 2.0 ** 20
    print(f"{'k':>3} {'host MiB':>10} {'buffers':>8} {'x 1/k=1':>8} {'dev pool MiB':>13} "
          f"{'peak MiB':>10} {'peak - k=1 (layer inputs)':>26} {'step s':>8}")
    for k, r in out.items():
        ratio = f"{r['host_bytes'] / base['host_bytes']:.3f}" if base else "-"
        extra = f"{(r['peak'] - base['peak']) / r['layer_input_bytes']:+.2f}" if base else "-"
        print(f"{k:>3} {r['host_bytes'] / mib:>10.3f} {r['host_allocations']:>8} {ratio:>8} "
              f"{r['device_pool_bytes'] / mib:>13.3f} {r['peak'] / mib:>10.3f} {extra:>26} "
              f"{r['seconds']:>8.3f}")
    print(f"load average at end: {os.getloadavg()}")
    return out


if __name__ == "__main__":
    main()
