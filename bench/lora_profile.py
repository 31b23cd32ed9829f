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

``--count`` (for a CPU, where nothing can be timed that says what a GPU does) counts instead
of timing: one step per row under ``torch.profiler`` with the recorded shapes, its aten ops
and Triton launches with their counts, the FLOPs of the matrix products and the bytes the
other ops move (``bench/_opcount.py``), per row and as each row's LoRA increment. Run it with
the Triton launchers on the CPU, as a GPU runs them, in bfloat16 (the kernels' refusal of
bfloat16 dots under the interpreter, whose results are wrong, is lifted: nothing here reads
a result; float16 counts the same bytes, but the CPU's float16 GEMMs crawl)::

    TRITON_INTERPRET=1 CKPT_EXT_BACKEND=triton python bench/lora_profile.py --count \
        --dtype bfloat16 [--extrapolate 4096]

``--extrapolate S`` counts at ``--seq`` and at twice it and extends each figure linearly in
the sequence length to S (what a token adds; the attention's S^2 work is inside kernels
either way, and the LoRA terms are linear in the tokens).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _opcount
import block
from _harness import Clock, commit, median, provenance, sync

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
    p.add_argument("--count", action="store_true",
                   help="count ops, FLOPs and bytes per row instead of timing (see above)")
    p.add_argument("--extrapolate", type=int, metavar="S",
                   help="with --count: also count at 2x --seq and extend linearly to S")
    p.add_argument("--bandwidth", type=float, default=3.0, metavar="TB/S",
                   help="with --count: the memory bandwidth that turns bytes into ms")
    a = p.parse_args(argv)
    if a.count:
        return count_main(a)
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
    names = row_names(rows)

    def step(name):
        run_step(rows, inputs, name)

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


def row_names(rows):
    return [n for n in ("none", *PRESETS, "hf", "hf@lora", *(f"{x}@lora" for x in PRESETS))
            if n in rows]


def run_step(rows, inputs, name):
    """One forward + backward of row ``name`` (its set-up first)."""
    fwd, params, setup, key = rows[name]
    setup()
    x, pe, g = inputs[key]
    for t in [x] + params:
        t.grad = None
    fwd(x, pe).backward(g)


def block_args(a, seq):
    return block.parse_args([
        "--hidden", str(a.hidden), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
        "--intermediate", str(a.intermediate), "--seq", str(seq), "--batch", str(a.batch),
        "--dtype", a.dtype, "--device", a.device, "--lora", str(a.lora),
        "--lora-dropout", str(a.lora_dropout), "--presets", *PRESETS])


def count_rows(a, seq):
    """row name -> {op: Counted} of one step of each row at sequence length seq."""
    device = torch.device(a.device)
    rows, inputs, restore = block.build_rows(block_args(a, seq), device, block.DTYPES[a.dtype])
    out = {}
    for name in row_names(rows):
        if name == "none":
            continue
        run_step(rows, inputs, name)   # first calls: lazy imports, launcher caches
        with _opcount.triton_launches(), profile(activities=[ProfilerActivity.CPU],
                                                 record_shapes=True) as prof:
            run_step(rows, inputs, name)
        out[name] = _opcount.count_ops(prof)
    if restore is not None:
        restore()
    return out


def _fmt(c, scale=1.0):
    return (f"{c.count:6d} {c.flops * scale / 1e9:12.4f} GFLOP {c.bytes * scale / 2**20:12.2f} "
            f"MiB")


def _split(counts):
    """(products' FLOPs, products' operand bytes, other ops' bytes) of {op: Counted}."""
    mm = [c for k, c in counts.items() if k in _opcount._MATMUL]
    ew = [c for k, c in counts.items() if k not in _opcount._MATMUL]
    return (sum(c.flops for c in mm), sum(c.bytes for c in mm), sum(c.bytes for c in ew))


def count_main(a):
    """--count: the op accounting of every row, and each row's LoRA increment."""
    if a.device != "cpu":
        print("--count profiles CPU ops; use --device cpu", file=sys.stderr)
        return 2
    backend = os.environ.get("CKPT_EXT_BACKEND", "")
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the counts read no result: let bfloat16 through the interpreter's dots
        from ckpt_ext.kernels import _launch
        check = _launch.check_operands
        _launch.check_operands = lambda op, *named, uses_dot=True: check(op, *named,
                                                                           uses_dot=False)
    for line in provenance(torch.device("cpu"), note="op counts, not timings"):
        print(f"# {line}")
    print(f"# commit: {commit()}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')} "
          f"CKPT_EXT_BACKEND={backend or '(unset: ATen CPU kernels)'}")
    print(f"# H {a.hidden}, Hq/Hkv {a.heads}/{a.kv_heads}, I {a.intermediate}, B {a.batch}, "
          f"S {a.seq}, {a.dtype}, LoRA r {a.lora} dropout {a.lora_dropout}; one forward + "
          f"backward per row, counted as bench/_opcount.py says", flush=True)
    counts = count_rows(a, a.seq)
    for name, c in counts.items():
        print(f"\n== {name}: ops, FLOPs of products, bytes (products: operands and result)")
        for op, v in sorted(c.items(), key=lambda kv: (-kv[1].bytes, kv[0])):
            print(f"  {op:44s} {_fmt(v)}")
        t = _opcount.totals(c)
        fl, mmb, ewb = _split(c)
        print(f"  {'total':44s} {_fmt(t)}; products {fl / 1e9:.4f} GFLOP, {mmb / 2**20:.2f} "
              f"MiB; other ops {ewb / 2**20:.2f} MiB")
    scaled = None
    if a.extrapolate:
        twice = count_rows(a, 2 * a.seq)
        f = (a.extrapolate - a.seq) / a.seq   # x(S) = x(s) + (S - s) (x(2s) - x(s)) / s

        def extend(c1, c2):
            ops = set(c1) | set(c2)
            z = _opcount.Counted(0, 0, 0)
            return {k: _opcount.Counted(*(round(u + f * (w - u)) for u, w in
                                          zip(c1.get(k, z), c2.get(k, z)))) for k in ops}
        scaled = {n: extend(counts[n], twice[n]) for n in counts}
    print("\n== LoRA increments (<row>@lora minus <row>): ops whose count, FLOPs or bytes "
          "differ")
    bases = [n for n in ("hf", *PRESETS) if n in counts and f"{n}@lora" in counts]
    for n in bases:
        d = _opcount.difference(counts[f"{n}@lora"], counts[n])
        print(f"\n-- {n}@lora - {n}")
        for op, v in sorted(d.items(), key=lambda kv: (-abs(kv[1].bytes), kv[0])):
            print(f"  {op:44s} {_fmt(v)}")
    print(f"\n== summary at S {a.seq}: LoRA increment = row@lora - row")
    sets = [(a.seq, counts)] + ([(a.extrapolate, scaled)] if scaled else [])
    for s, cs in sets:
        print(f"\nS {s}{' (extrapolated)' if cs is scaled else ''}: increment in ops, products' "
              f"GFLOP, products' operand MiB, other ops' MiB, all bytes at "
              f"{a.bandwidth:g} TB/s in ms")
        for n in bases:
            inc = _opcount.difference(cs[f"{n}@lora"], cs[n])
            t = _opcount.totals(inc)
            fl, mmb, ewb = _split(inc)
            print(f"  {n:11s} {t.count:+6d} ops {fl / 1e9:+10.3f} GFLOP {mmb / 2**20:+10.1f} MiB "
                  f"{ewb / 2**20:+10.1f} MiB  {(mmb + ewb) / (a.bandwidth * 1e9):+7.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
