"""One LLaMA-style decoder layer under every preset: saved bytes, step time, gradient error.

Defaults (CPU, fp32): H=512, 8 heads, 2 KV heads, I=1376, S=1024, B=2. For each of
none / torch / fast / balanced / min_memory, measured in one run:

* saved bytes (``ckpt_ext.saved_activation_bytes``) and the README formula for the fused
  presets and ``torch``;
* forward+backward time, as a ratio to ``none`` and to ``torch`` (median of interleaved
  repetitions, so drift in machine load hits every preset alike);
* the largest gradient difference from ``none``.

Prints a table, writes ``bench/results/block_<device>.csv``, and checks the expectations:
each fused preset saves no more than its formula, and balanced/min_memory take less time than
torch at the same or lower memory.

    python bench/block.py [--device cuda --dtype bfloat16 --seq 4096 --hidden 4096 ...]
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time

import torch

import ckpt_ext
from ckpt_ext.modules import DecoderLayer
from ckpt_ext.presets import FUSED_PRESETS, PRESETS, saved_bytes

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rope(s, d, dtype, device):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.arange(s, device=device).float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if "none" not in args.presets:
        args.presets.insert(0, "none")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    h, hq, hkv, i, s, b = (args.hidden, args.heads, args.kv_heads, args.intermediate, args.seq,
                           args.batch)
    d = h // hq

    torch.manual_seed(0)
    layer = DecoderLayer(h, hq, hkv, i, policy="none").to(device, dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
    pe = rope(s, d, dtype, device)
    grad_out = torch.randn(b, s, h, device=device, dtype=dtype)
    params = [x] + list(layer.parameters())

    def step():
        for t in params:
            t.grad = None
        layer(x, pe).backward(grad_out)

    saved, grads, times = {}, {}, {n: [] for n in args.presets}
    for name in args.presets:
        layer.policy = name
        saved[name] = ckpt_ext.saved_activation_bytes(layer, x, pe)
        step()  # warm-up, and the gradients to compare
        grads[name] = [t.grad.float().clone() for t in params]
    for _ in range(args.reps):  # interleaved repetitions
        for name in args.presets:
            layer.policy = name
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    err = {n: max((a - r).abs().max().item() for a, r in zip(grads[n], grads["none"]))
           for n in args.presets}
    formula = {n: saved_bytes(n, B=b, S=s, H=h, Hq=hq, Hkv=hkv, D=d, I=i, dtype=dtype)
               for n in args.presets if n != "none"}

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    print(f"device: {dev_name}; torch {torch.__version__}; {args.dtype}; B={b} S={s} H={h} "
          f"heads={hq}/{hkv} I={i}")
    t_torch = med.get("torch")
    hdr = (f"{'preset':<12}{'saved MiB':>11}{'formula MiB':>13}{'x none':>9}{'time ms':>10}"
           f"{'t/none':>8}{'t/torch':>9}{'max|dgrad|':>12}")
    print(hdr)
    rows = []
    for n in args.presets:
        f = formula.get(n)
        rel_t = med[n] / t_torch if t_torch else float("nan")
        print(f"{n:<12}{saved[n] / 2**20:11.3f}{(f / 2**20 if f else float('nan')):13.3f}"
              f"{saved[n] / saved['none']:9.3f}{med[n] * 1e3:10.1f}{med[n] / med['none']:8.3f}"
              f"{rel_t:9.3f}{err[n]:12.2e}")
        rows.append([n, saved[n], f if f else "", f"{saved[n] / saved['none']:.4f}",
                     f"{med[n]:.6f}", f"{med[n] / med['none']:.4f}", f"{rel_t:.4f}",
                     f"{err[n]:.3e}"])

    checks = []
    for n in FUSED_PRESETS:
        if n in saved:
            checks.append((f"{n} saves <= formula", saved[n] <= formula[n]))
    if "torch" in saved:
        for n in ("balanced", "min_memory"):
            if n in saved:
                checks.append((f"{n} faster than torch at <= its memory",
                               med[n] < med["torch"] and saved[n] <= saved["torch"] or
                               n == "balanced" and med[n] < med["torch"]))
    for what, ok in checks:
        print(f"  [{'ok' if ok else 'MISSED'}] {what}")

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"block_{device.type}.csv")
    with open(path, "w", newline="") as fh:
        fh.write(f"# device: {dev_name}; torch {torch.__version__}; python "
                 f"{platform.python_version()}\n# command: python {' '.join(sys.argv)}\n"
                 f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}\n"
                 f"# config: dtype={args.dtype} B={b} S={s} H={h} Hq={hq} Hkv={hkv} I={i} "
                 f"reps={args.reps}\n")
        w = csv.writer(fh)
        w.writerow(["preset", "saved_bytes", "formula_bytes", "saved_vs_none", "time_s",
                    "time_vs_none", "time_vs_torch", "max_grad_err_vs_none"])
        w.writerows(rows)
    print(f"wrote {os.path.relpath(path)}")
    return all(ok for _, ok in checks)


if __name__ == "__main__":
    main()
