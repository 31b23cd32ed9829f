"""Host cost of one Triton launcher call without the kernel: median microseconds per launch.

Each launcher of ``ckpt_ext.kernels`` (attention fwd/bwd, SwiGLU fwd/bwd, LM-head loss
fwd/bwd) is called on a small problem with the kernel launch itself stubbed out: the stub
replaces the ``run`` method of Triton's kernel class, so everything up to the kernel call
(validation, allocation, launch policy, launcher cache lookup, grid and argument building)
runs and is timed, the kernel does not. The torch work a launcher does around its kernel
(the SwiGLU down projection and weight-gradient matmuls, the LM head's merge of partials)
is part of the figure, so the problems are tiny to keep that small; the figures are for
comparing launcher versions on one machine, not absolute GPU launch latencies.

On CPU (the default when no GPU is present) the kernels are Triton's interpreted functions
(TRITON_INTERPRET=1 is set before triton is imported) and ``InterpretedFunction.run`` is
stubbed. With ``--device cuda`` the real kernels launch (asynchronously) on a GPU, with
``CKPT_EXT_AUTOTUNE=0`` unless set, and the host time per call is measured without a
synchronisation in the timed loop.

Usage:
  python bench/launch_overhead.py [--device cpu|cuda] [--reps N] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu: interpreter kernels, stubbed; cuda: real launches (default: cuda "
                        "when available)")
    p.add_argument("--reps", type=int, default=2000, help="timed calls per launcher")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of --reps calls; the lowest per-round median is reported")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--kernels", metavar="DIR",
                   help="load the kernel modules from this kernels/ directory (e.g. an exported "
                        "older commit) instead of ckpt_ext.kernels, to compare launcher versions")
    return p.parse_args(argv)


def _kernel_modules(directory):
    """(attention, swiglu_mlp, linear_cross_entropy) from ckpt_ext.kernels, or from a kernels/
    directory loaded by path as the package ``ckpt_ext_bench.kernels`` (its parent stands for
    the ckpt_ext/ directory beside it, whose __init__ is not run: the kernels import
    ``ckpt_ext._checks`` relatively)."""
    import importlib
    import importlib.util
    import types

    if directory is None:
        from ckpt_ext.kernels import attention, linear_cross_entropy, swiglu_mlp
        return attention, swiglu_mlp, linear_cross_entropy
    pkg_dir = Path(directory).resolve()
    parent = types.ModuleType("ckpt_ext_bench")
    parent.__path__ = [str(pkg_dir.parent / "ckpt_ext")]
    sys.modules["ckpt_ext_bench"] = parent
    spec = importlib.util.spec_from_file_location(
        "ckpt_ext_bench.kernels", pkg_dir / "__init__.py",
        submodule_search_locations=[str(pkg_dir)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["ckpt_ext_bench.kernels"] = pkg
    spec.loader.exec_module(pkg)
    return tuple(importlib.import_module(f"ckpt_ext_bench.kernels.{m}")
                 for m in ("attention", "swiglu_mlp", "linear_cross_entropy"))


def _stub_kernels():
    """Replace the interpreter's kernel execution by a call that only evaluates the grid."""
    from triton.runtime.interpreter import InterpretedFunction

    def run(self, *args, grid, warmup, **kwargs):
        return grid(kwargs) if callable(grid) else grid

    InterpretedFunction.run = run


def _problems(device, torch, modules):
    """name -> zero-argument callable running one launcher call."""
    attention, swiglu_mlp, linear_cross_entropy = modules

    dt = torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    B, Hq, Hkv, S, D = 1, 4, 2, 64, 64
    q, k, v = rnd(B, Hq, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    kpm = torch.ones(B, S, dtype=torch.bool, device=device)
    out, lse = attention.attention_fwd(q, k, v, None, None, None, True, 0.125)
    dout = rnd(B, Hq, S, D)

    T, H, I, r = 4, 16, 32, 4
    x, wg, wu, wd = rnd(T, H), rnd(I, H), rnd(I, H), rnd(H, I)
    dy = rnd(T, H)
    lora = [rnd(r, H, dtype=torch.float32), rnd(I, r, dtype=torch.float32),
            rnd(r, H, dtype=torch.float32), rnd(I, r, dtype=torch.float32),
            rnd(r, I, dtype=torch.float32), rnd(H, r, dtype=torch.float32)]
    scal = [0.5, 0.5, 0.5]
    needs = [True] * 12

    V = 64
    hid, w_lm = rnd(T, H), rnd(V, H)
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    loss, lse_lm = linear_cross_entropy.linear_cross_entropy_fwd(hid, w_lm, None, labels, -100)
    dloss = torch.ones(T, dtype=torch.float32, device=device)

    return {
        "attention_fwd causal": lambda: attention.attention_fwd(
            q, k, v, None, None, None, True, 0.125),
        "attention_fwd padding mask": lambda: attention.attention_fwd(
            q, k, v, kpm, None, None, True, 0.125),
        "attention_bwd causal": lambda: attention.attention_bwd(
            dout, q, k, v, out, lse, None, None, None, True, 0.125),
        "swiglu_fwd": lambda: swiglu_mlp.swiglu_fwd(
            x, wg, wu, wd, None, None, None, [], [], False),
        "swiglu_fwd lora": lambda: swiglu_mlp.swiglu_fwd(
            x, wg, wu, wd, None, None, None, lora, scal, False),
        "swiglu_bwd": lambda: swiglu_mlp.swiglu_bwd(
            dy, x, wg, wu, wd, None, None, None, [], [], None, None, needs),
        "linear_cross_entropy_fwd": lambda: linear_cross_entropy.linear_cross_entropy_fwd(
            hid, w_lm, None, labels, -100),
        "linear_cross_entropy_bwd": lambda: linear_cross_entropy.linear_cross_entropy_bwd(
            dloss, hid, w_lm, None, labels, lse_lm, -100, [True, True, False]),
    }


_BATCH = 20


def _median_us(fn, reps, rounds, clock):
    """Median over batches of _BATCH calls of the time per call (us); the lowest of the
    rounds' medians (the round least disturbed by other work on the machine)."""
    for _ in range(max(50, reps // 10)):
        fn()
    meds = []
    for _ in range(rounds):
        ts = []
        for _ in range(max(1, reps // _BATCH)):
            t0 = clock()
            for _ in range(_BATCH):
                fn()
            ts.append((clock() - t0) / _BATCH)
        meds.append(statistics.median(ts) * 1e6)
    return min(meds)


def _git_head():
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


def main(argv=None) -> int:
    args = _parse(argv)
    device = args.device
    if device is None or device == "cpu":
        try:
            import torch
            has_cuda = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            has_cuda = False
        device = device or ("cuda" if has_cuda else "cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported
    else:
        os.environ.setdefault("CKPT_EXT_AUTOTUNE", "0")
    import torch
    import triton

    if device == "cpu":
        _stub_kernels()
        # One intra-op thread: the tiny CPU matmuls of the launchers would otherwise time the
        # thread pool's wake-ups, which vary with the machine's load.
        torch.set_num_threads(1)
    problems = _problems(device, torch, _kernel_modules(args.kernels))
    header = [
        "ckpt_ext launcher host overhead (bench/launch_overhead.py): median us per call, "
        "kernel stubbed" if device == "cpu" else
        "ckpt_ext launcher host overhead (bench/launch_overhead.py): median us per call, "
        "real asynchronous launches",
        f"date:    {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"command: {' '.join([Path(sys.executable).name, *sys.argv])}",
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus; "
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}; device {device}, "
        f"{torch.get_num_threads()} torch thread(s)"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""),
        f"kernels: {args.kernels or 'ckpt_ext.kernels'}; git {_git_head()}; "
        f"reps {args.reps} x {args.rounds} rounds",
        "timer:   " + ("thread CPU time (time.thread_time), batches of 20 calls" if device == "cpu"
                       else "wall time (time.perf_counter), batches of 20 calls"),
    ]
    # CPU: this thread's CPU time, so that other processes on a shared machine do not count;
    # GPU: wall time of the asynchronous launches.
    clock = time.thread_time if device == "cpu" else time.perf_counter
    rows = []
    for name, fn in problems.items():
        rows.append((name, _median_us(fn, args.reps, args.rounds, clock)))
    lines = header + ["", f"{'launcher':32s} {'us/call':>9s}"]
    lines += [f"{name:32s} {us:9.1f}" for name, us in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
