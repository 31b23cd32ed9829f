"""One long training step per setup: its peak and time beside the plan's model of them.

For the GPU run's long-sequence questions: does ``ckpt_ext.plan``'s peak hold at long
sequences, with and without ``offload="cpu"``, and what does a step cost there. The model is
``bench/peak.py``'s ``build()`` (an HF Llama from a config, ``patch_llama`` with the preset and
the fused head; ``+offload`` patches it again with ``offload="cpu"``, as ``bench/offload.py``
does). Each setup is built, stepped and freed before the next, so that only one model is on
the device at a time. Per setup:

* a first step (the gradients, the offload pools and Triton's compiles happen here), at
  ``--warmup-seq`` tokens if given (a long first step would cost the run a second long step),
  timed by the host clock as ``first``;
* one measured step: ``ckpt_ext.peak_memory_bytes`` around it (on CUDA the allocator's
  statistics, which cost nothing, so the same step is timed, CUDA synchronised around it;
  on the CPU the profiler, which slows it: the time is then no figure);
* the plan beside it, measured / modelled: ``plan.step_peak`` of the preset (without offload,
  with the phase where the plan puts the peak) or ``plan.offload_step_peak`` (with: the
  model counts the device pool at every phase, so the measured figure compared is the peak plus the pool the first step allocated, or the peak
  alone when the pool grew inside the measured step, after a shorter first step); the
  host pool beside the plan's host bytes; the step's FLOPs (``plan.step_flops`` where the
  plan has it, else the dense matmuls 6 N T, the attention's forward and backward 3.5 x 4 Hq D
  pairs per layer, and ``plan.recompute_flops``), the achieved TFLOP/s and, by S^2, the time
  of 32 such layers at S 1M (the step time over the layers, head included, so an upper
  bound); where the plan has ``step_time_estimate``, the step time / the plan's estimate
  (which leaves the host link out) and the plan's 32-layer step at S 1M.

A setup is ``<preset>[+offload[+stream]][+segK]``: ``+stream`` patches with
``offload_stream=True`` (min_memory inputs streamed from host memory in the backward),
``+segK`` with ``segment_layers=K``; the plan's model then gets the same ``stream`` and
``segment_layers``.

Ends with the offload/none step-time ratio for each preset measured both ways.

    python bench/long_step.py --dtype bfloat16 --hidden 4096 --intermediate 14336 \\
        --heads 32 --kv-heads 8 --vocab 128256 --layers 4 --seq 131072 \\
        --setups min_memory min_memory+offload
    python bench/long_step.py ... --layers 2 --seq 262144 --setups min_memory+offload+stream+seg2
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_ext  # noqa: E402
from ckpt_ext import config, plan  # noqa: E402
from _harness import provenance, sync  # noqa: E402
from peak import DTYPES, add_model_args, build, step  # noqa: E402

FUSED = ("fast", "balanced", "min_memory")


def gib(n):
    return f"{n / 2**30:.4g}"


def parse_setup(text):
    """(preset, offload, stream, segment layers) of ``<preset>[+offload[+stream]][+segK]``."""
    preset, *extras = text.split("+")
    seg = 1
    if extras and extras[-1].startswith("seg") and extras[-1][3:].isdigit():
        seg = int(extras.pop()[3:])
    offload, stream = extras[:1] == ["offload"], extras[1:2] == ["stream"]
    if preset not in FUSED or extras not in ([], ["offload"], ["offload", "stream"]) or \
            seg < 1 or (stream and preset != "min_memory") or (seg > 1 and preset != "min_memory"):
        raise ValueError(f"setup {text!r}: expected <preset>[+offload[+stream]][+segK] with a "
                         f"preset of {FUSED} (stream and segK > 1: min_memory only)")
    return preset, offload, stream, seg


def step_flops(args, preset):
    """(total, recompute) forward+backward FLOPs of one step (module docstring)."""
    H, Hq, Hkv, I = args.hidden, args.heads, args.kv_heads, args.intermediate
    D = H // Hq
    T = args.batch * args.seq
    S = args.seq
    per_layer_params = H * (2 * Hq * D + 2 * Hkv * D) + 3 * H * I
    dense = 6 * T * (args.layers * per_layer_params + args.vocab * H)
    pairs = args.batch * S * (S + 1) // 2
    attention = args.layers * 3.5 * 4 * Hq * D * pairs
    dims = plan.LayerDims(H, Hq, Hkv, D, I)
    recompute = args.layers * plan.recompute_flops(preset, dims, args.batch, S)
    return dense + attention + recompute, recompute


def offloader_stats(model):
    try:
        off = model.model.layers[0].forward.shared.offloader
    except AttributeError:
        return None
    return off.stats() if off is not None else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", default=["min_memory", "min_memory+offload"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup-seq", type=int, default=0,
                   help="S of the first (untimed for the figures) step: compiles, gradients "
                        "and pools at a short sequence (default: --seq)")
    add_model_args(p)
    args = p.parse_args(argv)
    try:
        setups = [parse_setup(s) for s in args.setups]
    except ValueError as exc:
        p.error(f"--setups: {exc}")
    cuda = args.device.startswith("cuda")
    dtype = DTYPES[args.dtype]
    D = args.hidden // args.heads
    dims = [plan.LayerDims(args.hidden, args.heads, args.kv_heads, D, args.intermediate)]
    dims = dims * args.layers
    path = "cuda" if cuda else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 0
    T = args.batch * args.seq
    for line in provenance(args.device, "" if cuda else "CPU run: NOT a performance figure"):
        print(f"# {line}")
    print(f"H {args.hidden}, I {args.intermediate}, {args.heads}/{args.kv_heads} heads, vocab "
          f"{args.vocab}, {args.layers} layers, B {args.batch}, S {args.seq}, {args.dtype}, "
          f"{args.device}; layer chunk rows (plan.layer_chunk_rows at the kernels' cap and "
          f"the GPU's SMs) "
          f"{plan.layer_chunk_rows(dims[0], dtype.itemsize, config.current().chunk_bytes, sms)}",
          flush=True)
    times = {}
    for (preset, offload, stream, seg), name in zip(setups, args.setups):
        model = None
        try:
            model = build(args, f"{preset}+fused")
            if offload or seg > 1:
                ckpt_ext.patch_llama(model, policy=preset, offload="cpu" if offload else None,
                                     offload_stream=stream, segment_layers=seg)
            ids = torch.randint(args.vocab, (args.batch, args.seq), device=args.device)
            warm = ids[:, :args.warmup_seq] if args.warmup_seq else ids
            sync(args.device)
            t0 = time.perf_counter()
            step(model, warm)                          # the gradients, pools, compiles
            sync(args.device)
            first = time.perf_counter() - t0
            before = offloader_stats(model) if offload else None
            t0 = time.perf_counter()
            peak = ckpt_ext.peak_memory_bytes(step, model, ids)
            sync(args.device)
            t = time.perf_counter() - t0
            stats = offloader_stats(model) if offload else None
        except torch.cuda.OutOfMemoryError as exc:
            print(f"{name:<22} OOM: {str(exc).splitlines()[0][:160]}", flush=True)
            continue
        finally:
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        times[name] = t
        if offload:
            m = plan.offload_step_peak(preset, dims, args.vocab, args.batch, args.seq, dtype,
                                       path=path, segment_layers=seg, stream=stream)
            # the host pool's buffers: with streamed inputs the rebuilt inputs' too
            mhost = m.host_peak if stream else m.host
            pool = stats["device_pool_bytes"] if stats else 0
            host = stats["host_bytes"] if stats else 0
            grew = before is not None and stats is not None and \
                before["device_pool_bytes"] != pool
            # a pool allocated (or grown) inside the measured step is in its peak already
            measured = peak if grew else peak + pool
            extra = (f"  (peak {gib(peak)}{' incl.' if grew else ' +'} device pool {gib(pool)} "
                     f"GiB; plan's pool "
                     f"{gib(m.pool)})  host {gib(host)} GiB / modelled {gib(mhost)} = "
                     f"{host / max(mhost, 1):.3f}")
            modelled = m.peak
        else:
            sp = plan.step_peak(preset, dims, args.vocab, args.batch, args.seq, dtype,
                                path=path, segment_layers=seg)
            modelled = sp.peak
            measured, extra = peak, f"  (the plan's peak: {sp.phase})"
        flops, recompute = step_flops(args, preset)
        per_layer_1m = t / args.layers * (2**20 / args.seq) ** 2 * 32
        plan_flops = getattr(plan, "step_flops", None)
        if plan_flops is not None:     # the plan's own count, where this commit has it
            flops = sum(plan_flops(preset, dims, args.vocab, args.batch, args.seq,
                                   segment_layers=seg).values())
        estimate = getattr(plan, "step_time_estimate", None)
        if estimate is not None:
            est = estimate(preset, dims, args.vocab, args.batch, args.seq, segment_layers=seg)
            est_1m = estimate(preset, dims[:1] * 32, args.vocab, args.batch, 2**20,
                              segment_layers=seg)
            time_text = (f"step {t:.3g} s / modelled {est:.3g} s = {t / est:.3g} "
                         f"(plan.step_time_estimate{', no host link' if offload else ''}; "
                         f"at S 1M, 32 layers: {est_1m / 60:.1f} min)")
        else:
            time_text = "no time model in this commit's ckpt_ext.plan (step_time_estimate)"
        print(f"{name:<22} peak {gib(measured)} GiB / modelled {gib(modelled)} GiB "
              f"= {measured / modelled:.3f} ({measured / T / 1024:.1f} / "
              f"{modelled / T / 1024:.1f} KiB/token){extra}", flush=True)
        print(f"{name:<22} step {t:8.2f} s (first {first:.2f} s)  {flops / 1e12:.4g} TFLOP "
              f"({recompute / 1e12:.4g} recompute) = {flops / t / 1e12:.3g} TFLOP/s  32 "
              f"layers at S 1M by S^2: {per_layer_1m / 60:.1f} min", flush=True)
        print(f"{name:<22} {time_text}", flush=True)
    for preset in FUSED:
        a, b = times.get(preset), times.get(f"{preset}+offload")
        if a and b:
            print(f"{preset}: step time offload/none {b / a:.3f} (goal <= 1.03 at S >= 32K; "
                  f"one step each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
