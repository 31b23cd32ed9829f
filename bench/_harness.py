"""The one timing and provenance harness of the benchmarks in bench/.

* Timing: ``time_ms`` (median ms per call of a function) runs ``triton.testing.do_bench`` on
  a GPU (L2 flush, CUDA events) and the host clock on the CPU. ``Clock`` marks the device
  timeline with CUDA events on a GPU and reads ``time.perf_counter`` on the CPU;
  ``time_steps`` (median forward / backward / total ms of a training step, marked inside the
  step) and interleaved loops (``Clock`` around each step, ``median``) are built on it.
* Memory: ``peak_mib`` (``ckpt_ext.peak_memory_bytes`` of one untimed step, in MiB).
* Provenance and output: ``device_name`` / ``device_tag``, ``provenance`` (the header every
  CSV starts with: device, versions, command, date), ``write_csv``, ``print_table``.
"""
from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

import ckpt_ext


def _is_cuda(device) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def sync(device=None) -> None:
    """Wait for the GPU (a no-op on the CPU)."""
    if _is_cuda(device):
        torch.cuda.synchronize()


class Clock:
    """Marks on the device timeline (CUDA events) or host clock (CPU); ms between marks.
    device: where the timed work runs (default: the GPU if there is one)."""

    def __init__(self, device=None):
        self.cuda = _is_cuda(device)
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def elapsed_ms(self, i, j):
        if self.cuda:
            torch.cuda.synchronize()
            return self.marks[i].elapsed_time(self.marks[j])
        return (self.marks[j] - self.marks[i]) * 1e3


def median(samples: Iterable[float]) -> float:
    return statistics.median(list(samples))


def time_ms(fn: Callable[[], object], warmup: int, reps: int, device=None,
            chunk: int = 1) -> float:
    """Median ms per call of ``fn()`` over about ``reps`` samples, after about ``warmup``
    untimed calls.

    On a GPU: ``triton.testing.do_bench`` (the L2 cache flushed before each call, CUDA events
    around it, the median), whose warm-up and repetitions are time budgets: ``warmup`` and
    ``reps`` times one call's duration, so that the counts keep their meaning. On the CPU: the
    host clock, ``chunk`` calls per sample (for functions too short to time one call at a
    time)."""
    if _is_cuda(device):
        from triton.testing import do_bench
        fn()                                  # compiles / tunes outside the estimate
        clock = Clock(device)
        clock.mark()
        fn()
        clock.mark()
        one = max(clock.elapsed_ms(0, 1), 1e-3)
        return do_bench(fn, warmup=max(warmup, 1) * one, rep=max(reps, 1) * one,
                        return_mode="median")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        clock = Clock(device)
        clock.mark()
        for _ in range(chunk):
            fn()
        clock.mark()
        samples.append(clock.elapsed_ms(0, 1) / chunk)
    return median(samples)


def time_steps(step: Callable[[Optional[Clock]], object], warmup: int, reps: int) -> dict:
    """Median forward / backward / total ms of ``step(clock)``, which marks the clock before
    the forward, between forward and backward, and after the backward; ``step(None)`` runs
    untimed (the warm-up, which includes autotuning each new shape)."""
    for _ in range(warmup):
        step(None)
    fwd, bwd, tot = [], [], []
    for _ in range(reps):
        clock = Clock()
        step(clock)
        fwd.append(clock.elapsed_ms(0, 1))
        bwd.append(clock.elapsed_ms(1, 2))
        tot.append(clock.elapsed_ms(0, 2))
    return {"fwd_ms": median(fwd), "bwd_ms": median(bwd), "total_ms": median(tot)}


def peak_mib(step: Callable[[Optional[Clock]], object]) -> float:
    """MiB one untimed ``step`` allocates above what was allocated before it (CUDA; NaN on
    CPU). The caller clears gradients first, so that the base excludes them."""
    if not torch.cuda.is_available():
        return math.nan
    return ckpt_ext.peak_memory_bytes(step, None) / 2**20


# ---- provenance and output -----------------------------------------------------------------
def elapsed_log(t_start: float) -> Callable[[str], None]:
    """A print that prefixes each message with the seconds since ``t_start``
    (``time.perf_counter()``), flushed: a long benchmark's progress lines."""
    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)
    return log


def hf_checkpointing(model, use_reentrant: bool | None = False):
    """Turn on HF's gradient checkpointing of ``model``'s decoder layers, as a user would:
    ``activation_checkpointing_enable`` where transformers has it (its name since 5.24, where
    ``gradient_checkpointing_enable`` warns that it is deprecated), else the old name.
    ``use_reentrant=None`` keeps transformers' own default."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def device_tag(cpu: str = "cpu", device=None) -> str:
    """The GPU's name as a file-name tag (``cpu`` without one)."""
    if not _is_cuda(device):
        return cpu
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")


def device_name(device=None) -> str:
    """The GPU's name and CUDA version, or the CPU's architecture, cores and torch threads."""
    if _is_cuda(device):
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} threads)")


def versions() -> str:
    """torch, triton and transformers (those that import) and python."""
    out = [f"torch {torch.__version__}"]
    for name in ("triton", "transformers"):
        module = sys.modules.get(name)
        if module is None and name == "triton":
            try:
                import triton as module
            except ImportError:
                module = None
        if module is not None:
            out.append(f"{name} {module.__version__}")
    return ", ".join(out + [f"python {platform.python_version()}"])


def commit() -> str:
    """The repository's short commit hash, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(device=None, note: str = "") -> list:
    """The provenance lines every result file starts with: device (and ``note``, e.g. that a
    CPU run is not a performance figure), versions, the command that ran (with the
    ``CKPT_EXT_*`` switches set in the environment), the UTC date."""
    switches = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                if k.startswith("CKPT_EXT_")]
    command = " ".join(switches + [shlex.quote(a) for a in
                                   ["python", os.path.relpath(sys.argv[0])] + sys.argv[1:]])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return [f"device: {device_name(device)}" + (f" -- {note}" if note else ""),
            f"versions: {versions()}",
            f"command: {command}",
            f"date: {date}"]


def plan_arguments(doc: str, out: str, host_memory: str = "256GiB"):
    """The arguments every plan script takes: ``--out`` (its results file, default ``out``),
    the device and the host memory a GPU has; the script adds its own."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=out)
    ap.add_argument("--device-memory", default="80GiB")
    ap.add_argument("--host-memory", default=host_memory)
    return ap


def write_plan_result(path, setup: str, lines: Sequence[str]) -> None:
    """A results file of the plan's model (no measurement): the provenance, the commit and
    ``setup`` as ``# `` header lines, then ``lines``; written to ``path`` and printed."""
    head = provenance(note="the plan's model, no measurement") + [f"commit: {commit()}",
                                                                  f"setup: {setup}"]
    text = "\n".join("# " + h for h in head) + "\n" + "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(text, end="")


def write_csv(path, header: Sequence[str], fields: Sequence[str], rows: Iterable) -> None:
    """``# ``-prefixed header lines (provenance first), then a CSV with the named columns;
    rows are dicts (missing keys left empty, floats written to 6 significant digits) or
    sequences in the order of ``fields``."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            cells = [r.get(k, "") for k in fields] if isinstance(r, dict) else list(r)
            w.writerow([_cell(c) for c in cells])
    print(f"wrote {os.path.relpath(path)}")


def print_table(fields: Sequence[str], rows: Iterable, float_format: str = ".3f",
                rule: bool = False) -> None:
    """Right-aligned columns: the header, then rows (dicts or sequences as in write_csv; floats
    in ``float_format``, strings as given); rule: a dashed line under the header."""
    def text(v):
        return format(v, float_format) if isinstance(v, float) else str(v)

    lines = [[text(r.get(k, "")) for k in fields] if isinstance(r, dict) else
             [text(c) for c in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(fields, *lines)]
    head = [list(fields)] + ([["-" * w for w in widths]] if rule else [])
    for cells in head + lines:
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value
