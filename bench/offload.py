"""Step time and step peak with and without ``offload="cpu"``, on the peak bench's model.

The model is ``bench/peak.py``'s ``build()`` (an HF Llama from a config: H 512, I 1792, 8/2
heads, vocab 16384, 4 layers by default), patched with ``policy=<preset>`` and the fused head,
then once more with ``offload="cpu"``. For each, after an untimed warm-up step (the gradients
and, with offload, the host and device pools exist afterwards):

* the step time: the median of ``--repeats`` steps, the two setups interleaved so that both
  see the same machine load;
* then the step's peak, ``ckpt_ext.peak_memory_bytes`` (on the CPU the allocator's reports
  through the profiler). The pools are allocated in the warm-up step and reused, so they are
  not in the peak: the host pool is printed beside it, and the ratio is given with and
  without the device pool added (on a GPU that pool is device memory the step relies on).

Ratios are taken within this one run. The load average is printed at the start and the end.

    python bench/offload.py [--seq 2048] [--presets min_memory balanced] [--repeats 5]
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["min_memory", "balanced"],
                   choices=["fast", "balanced", "min_memory"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    add_model_args(p)
    args = p.parse_args(argv)
    if args.seq < 2 or args.batch < 1 or args.repeats < 1:
        p.error("--seq must be >= 2, --batch and --repeats >= 1")
    print(f"H {args.hidden}, I {args.intermediate}, {args.heads}/{args.kv_heads} heads, vocab "
          f"{args.vocab}, {args.layers} layers, B {args.batch}, S {args.seq}, {args.dtype}, "
          f"{args.device}, torch threads {torch.get_num_threads()}")
    print(f"load average at start: {os.getloadavg()}")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for preset in args.presets:
        models = {}
        for offload in (None, "cpu"):
            model = build(args, f"{preset}+fused")
            ckpt_ext.patch_llama(model, policy=preset, offload=offload)
            models[offload] = model
        ids = torch.randint(args.vocab, (args.batch, args.seq), device=args.device)
        peaks, times, pools = {}, {None: [], "cpu": []}, {}
        for model in models.values():
            step(model, ids)   # warm-up: gradients, pools
        sync()
        for _ in range(args.repeats):
            for offload, model in models.items():
                sync()
                t0 = time.perf_counter()
                step(model, ids)
                sync()
                times[offload].append(time.perf_counter() - t0)
        for offload, model in models.items():  # the profiler after the timing: it slows
            peaks[offload] = ckpt_ext.peak_memory_bytes(step, model, ids)  # what follows it
            off = model.model.layers[0].forward.shared.offloader
            pools[offload] = off.stats() if off is not None else None
        t_off, t_on = statistics.median(times[None]), statistics.median(times["cpu"])
        st = pools["cpu"]
        print(f"{preset}: offload=None  step {t_off * 1e3:8.1f} ms  peak "
              f"{peaks[None] / 2**20:8.2f} MiB")
        print(f"{preset}: offload='cpu' step {t_on * 1e3:8.1f} ms  peak "
              f"{peaks['cpu'] / 2**20:8.2f} MiB  host pool {st['host_bytes'] / 2**20:.2f} MiB, "
              f"device pool {st['device_pool_bytes'] / 2**20:.2f} MiB in "
              f"{st['device_slots']} slots")
        dev = peaks["cpu"] + st["device_pool_bytes"]
        print(f"{preset}: ratio offload/none: step time {t_on / t_off:.3f}x, peak "
              f"{peaks['cpu'] / peaks[None]:.3f}x, peak + device pool {dev / peaks[None]:.3f}x "
              f"(peak saved {(peaks[None] - peaks['cpu']) / 2**20:.2f} MiB); step times (ms) none "
              f"{[round(t * 1e3) for t in times[None]]}, cpu "
              f"{[round(t * 1e3) for t in times['cpu']]}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
