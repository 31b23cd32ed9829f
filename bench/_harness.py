"""Timing pieces shared by the kernel benchmarks (bench/swiglu.py, bench/lm_head.py)."""
from __future__ import annotations

import math
import re
import statistics
import time
from typing import Callable, Optional

import torch


class Clock:
    """Marks on the device timeline (CUDA events) or host clock (CPU); ms between marks."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
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
    return {"fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
            "total_ms": statistics.median(tot)}


def peak_mib(step: Callable[[Optional[Clock]], object]) -> float:
    """MiB one untimed ``step`` allocates above what was allocated before it (CUDA; NaN on
    CPU). The caller clears gradients first, so that the base excludes them."""
    if not torch.cuda.is_available():
        return math.nan
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(None)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def device_tag(cpu: str = "cpu") -> str:
    """The GPU's name as a file-name tag (``cpu`` without one)."""
    if not torch.cuda.is_available():
        return cpu
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")
