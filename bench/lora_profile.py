"""Where PEFT LoRA's time goes in the fused presets: one profiled step per row, top kernels.

The question (the GPU issue): at LLaMA-7B dims, S 4096, the fused presets' LoRA increments
(``<preset>@lora`` minus ``<preset>``) were 3.3-3.7 ms against HF's 0.79 ms. This takes
``bench/block.py``'s rows at LLaMA-3-8B layer dims (H 4096, Hq/Hkv 32/8, I 14336, B 1,
S 4096, bf16 on CUDA; ``--hidden`` etc. change them): ``none`` (ckpt_ext's plain layer),
``fast`` / ``balanced`` / ``min_memory``, ``hf`` (transformers' layer), and with PEFT LoRA of
rank ``--lora`` (16) on every projection ``hf@lora`` and ``<preset>@lora`` (the fused op on
that layer's tensors, as ``patch_llama`` calls it). Per row: ``--warmup`` untimed steps, the
median of ``--reps`` timed steps (CUDA events; host clock on the CPU), then one step under
``torch.profiler`` whose top ``--top`` kernels by device time (CPU ops by self time on the CPU)
are printed. Then the LoRA increments and the issue's goals: each preset's increment at most
2x HF's, ``fast@lora`` no slower than ``hf@lora``.

    python bench/lora_profile.py [--seq 4096] [--lora 16] [--top 12]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import block  # noqa: E402
from _harness import Clock, median, provenance, sync  # noqa: E402

PRESETS = ("fast", "balanced", "min_memory")


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 4096), ("heads", 32), ("kv-heads", 8),
                          ("intermediate", 14336), ("seq", 4096), ("batch", 1), ("lora", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--dtype", choices=sorted(block.DTYPES),
                   default="bfloat16" if cuda else "float32")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    bargs = block.parse_args([
        "--hidden", str(a.hidden), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
        "--intermediate", str(a.intermediate), "--seq", str(a.seq), "--batch", str(a.batch),
        "--dtype", a.dtype, "--device", a.device, "--lora", str(a.lora),
        "--lora-dropout", str(a.lora_dropout), "--presets", "none", *PRESETS])
    device = torch.device(a.device)
    for line in provenance(device):
        print(f"# {line}")
    print(f"# H {a.hidden}, Hq/Hkv {a.heads}/{a.kv_heads}, I {a.intermediate}, B {a.batch}, "
          f"S {a.seq}, {a.dtype}, LoRA r {a.lora} dropout {a.lora_dropout}, warmup {a.warmup}, "
          f"reps {a.reps}", flush=True)
    rows, inputs, restore = block.build_rows(bargs, device, block.DTYPES[a.dtype])
    names = [n for n in ("none", *PRESETS, "hf", "hf@lora", *(f"{x}@lora" for x in PRESETS))
             if n in rows]

    def step(name):
        fwd, params, setup, key = rows[name]
        setup()
        x, pe, g = inputs[key]
        for t in [x] + params:
            t.grad = None
        fwd(x, pe).backward(g)

    med = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sorts = (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + [
        "self_cpu_time_total"]
    for name in names:
        for _ in range(a.warmup):
            step(name)
        times = []
        for _ in range(a.reps):
            sync(device)
            clock = Clock(device)
            clock.mark()
            step(name)
            clock.mark()
            times.append(clock.elapsed_ms(0, 1))
        med[name] = median(times)
        sync(device)
        with profile(activities=activities) as prof:
            step(name)
            sync(device)
        print(f"\n== {name}: step {med[name]:.3f} ms (median of {a.reps}); top {a.top} by "
              f"{sorts[0]}", flush=True)
        for key in sorts:      # the profiler's column names changed between versions
            try:
                print(prof.key_averages().table(sort_by=key, row_limit=a.top,
                                                max_name_column_width=70))
                break
            except Exception as exc:   # noqa: BLE001
                print(f"(no table by {key}: {type(exc).__name__}: {exc})")
    if restore is not None:
        restore()
    print("\nstep ms: " + ", ".join(f"{n} {med[n]:.3f}" for n in names))
    if "hf" in med and "hf@lora" in med:
        hf_inc = med["hf@lora"] - med["hf"]
        print(f"LoRA increment hf {hf_inc:.3f} ms")
        for n in PRESETS:
            if n in med and f"{n}@lora" in med:
                inc = med[f"{n}@lora"] - med[n]
                ratio = inc / hf_inc if hf_inc > 0 else float("inf")
                print(f"LoRA increment {n} {inc:.3f} ms = {ratio:.2f}x hf's "
                      f"[{'ok' if ratio <= 2 else 'MISSED'}: <= 2x]; {n}@lora / hf@lora "
                      f"{med[f'{n}@lora'] / med['hf@lora']:.3f}")
        if "fast@lora" in med:
            r = med["fast@lora"] / med["hf@lora"]
            print(f"goal fast@lora <= hf@lora: {r:.3f} [{'ok' if r <= 1 else 'MISSED'}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
