"""What a training step costs in memory: ``saved_activation_bytes`` (what a forward leaves
held for backward) and ``peak_memory_bytes`` (the most a call allocates at once)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import torch

__all__ = ["saved_activation_bytes", "peak_memory_bytes"]


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def saved_activation_bytes(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Bytes that ``fn(*args, **kwargs)`` leaves saved for backward.

    Runs ``fn`` once under ``torch.autograd.graph.saved_tensors_hooks`` and adds up the
    storages of every tensor an autograd node saves (built-in ops, Python and C++ autograd
    Functions, the inputs kept by ``ckpt_ext.checkpoint`` and ``torch.utils.checkpoint``).
    Each storage counts once, at its full size, however many tensors view it; parameters (and
    views of parameters) are excluded, since they are held whether or not a backward follows.
    What an active ``torch.utils.checkpoint`` region saves internally is discarded by it and
    so, correctly, not counted.

    Example: ``saved_activation_bytes(layer, x)`` for ``nn.Sequential(nn.Linear(a, b),
    nn.GELU())`` in fp32 is ``4 * (x.numel() + N * b)``: the Linear saves x, GELU saves its
    input.
    """
    storages: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t) and t.layout == torch.strided:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            storages[key] = max(storages.get(key, 0), storage.nbytes())
        # A detached alias: holding the tensor itself would tie a saved output to its own node.
        return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args, **kwargs)
    total = sum(storages.values())  # every counted storage is still alive: `out` holds them
    del out
    return total


def _tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in ``obj``: a tensor, a module's parameters and buffers, or (up to a few
    levels deep) the items of lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _compute_device(fn: Callable, args: tuple, kwargs: dict) -> torch.device:
    """The device ``fn(*args, **kwargs)`` computes on: the first CUDA device among the tensors
    of the arguments (and of ``fn`` itself when it is a module, or a bound method of one); the
    CPU when they are all on the CPU; with no tensor at all, the current CUDA device if CUDA
    is available, else the CPU."""
    owner = getattr(fn, "__self__", None)
    found = False
    for t in _tensors([fn, owner, list(args), kwargs]):
        found = True
        if t.device.type == "cuda":
            return t.device
    if not found and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _CpuMeter:
    """One CPU measurement's running total and peak of allocated bytes, above its start."""

    def __init__(self):
        self.total = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.total += nbytes
        self.peak = max(self.peak, self.total)


# The CPU measurements in progress, outermost first. torch.profiler runs one session per
# process, so nested measurements share it: each inner call ends the session that is running,
# hands its events to every open measurement, and runs one of its own; when it returns, a new
# session carries the outer measurements on.
_open_meters: list = []
_meter_lock = threading.Lock()


def _cpu_session():
    from torch.profiler import ProfilerActivity, profile
    session = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    session.start()
    return session


def _close_session(session) -> None:
    """Stop ``session`` and add its CPU memory events, in time order, to every open meter.
    Events of the same timestamp (an allocation freed at once can share one) count their
    allocations before their frees: a block exists before it is freed, so the peak is never
    read below what was allocated."""
    session.stop()
    events = [(e.start_ns(), e.nbytes() < 0, i, e.nbytes())
              for i, e in enumerate(session.profiler.kineto_results.events())
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    for *_, nbytes in sorted(events):
        for meter in _open_meters:
            meter.add(nbytes)


_session = None  # the profiler session of the open meters (None when there are none)


def _cpu_peak(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """(fn's result, peak CPU bytes above the start), from the CPU allocator's reports that
    ``torch.profiler`` records as memory events: each allocation and free, in time order,
    moves a running total, whose maximum is the peak. Memory freed that was allocated before
    the call counts as negative. Calls nest (see ``_open_meters``); a profiler that someone
    else started is left running and the call is refused (it would have to end that one)."""
    global _session
    with _meter_lock:
        if _session is None and torch.autograd._profiler_enabled():
            raise RuntimeError(
                "peak_memory_bytes: a torch profiler is already running in this process; on "
                "the CPU the peak is read from a profiler session of its own, which would end "
                "yours. Measure outside your profiler (or read the memory events of your own "
                "profile with profile_memory=True)")
        if _session is not None:
            _close_session(_session)
        meter = _CpuMeter()
        _open_meters.append(meter)
        _session = _cpu_session()
    try:
        out = fn(*args, **kwargs)
    finally:
        with _meter_lock:
            _close_session(_session)
            _open_meters.remove(meter)
            _session = _cpu_session() if _open_meters else None
    return out, meter.peak


# The CUDA measurements in progress: [device, highest allocated bytes seen before the last
# reset of the device's peak]. A nested call resets the peak statistics, so it first folds the
# peak so far into every open measurement on its device.
_open_cuda: list = []


def _cuda_peak(fn: Callable, args: tuple, kwargs: dict,
               device: torch.device) -> tuple[Any, int]:
    """(fn's result, peak bytes of the caching allocator on ``device`` above the start)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    with _meter_lock:
        for entry in _open_cuda:
            if entry[0] == device:
                entry[1] = max(entry[1], torch.cuda.max_memory_allocated(device))
        mine = [device, base]
        _open_cuda.append(mine)
    # The reset is global to the device: the peak is read relative to `base`, not to zero.
    torch.cuda.reset_peak_memory_stats(device)
    try:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
    finally:
        with _meter_lock:
            _open_cuda.remove(mine)
    return out, max(0, max(mine[1], torch.cuda.max_memory_allocated(device)) - base)


def peak_memory_bytes(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """The peak of allocated bytes above the start while ``fn(*args, **kwargs)`` runs.

    For a training step, pass a function that runs forward and backward
    (``peak_memory_bytes(step, model, batch)``); what is allocated before the call (weights,
    inputs, gradients not yet cleared) is the base and does not count, and the peak is the
    largest amount allocated above that base at any moment of the call (0 if the call never
    allocates more than it frees). fn's result is discarded, after the measurement, so memory
    it returns counts in the peak.

    The device measured is the one ``fn`` computes on: the first CUDA device among the
    tensors in the arguments (lists, tuples and dicts are searched; a module, passed as ``fn``
    or as an argument, contributes its parameters and buffers), else the CPU; with no tensor
    at all, the current CUDA device when CUDA is available, else the CPU. Only that device is
    measured.

    * CUDA: the caching allocator's statistics: ``torch.cuda.memory_allocated`` before the
      call, ``torch.cuda.reset_peak_memory_stats`` (which resets the device's peak for every
      other reader too), ``torch.cuda.max_memory_allocated`` after it, less the start. Calls
      nest: an inner call's reset keeps the outer call's peak so far.
    * CPU: the CPU allocator's reports of each allocation and free, recorded by
      ``torch.profiler.profile(profile_memory=True)`` around the call, summed in time order.
      The profiler records every operator too, which slows the call down: do not time it.
      It counts allocations of torch's CPU allocator (every CPU tensor), from all threads.
      The profiler cannot size a block allocated before it started, so on CPU a free of
      memory older than the call is not seen: the peak is then that of the call's own
      allocations, above what CUDA would report (in a training step, where the gradients are
      cleared before the call, nothing older is freed). Calls nest: a call inside ``fn``
      measures its own part, and the outer call still sees all of it. A torch profiler
      that the caller started is left running, and the call raises a RuntimeError instead
      (the measurement would need a profiler session of its own).
    """
    device = _compute_device(fn, args, kwargs)
    if device.type == "cuda":
        out, peak = _cuda_peak(fn, args, kwargs, device)
    else:
        out, peak = _cpu_peak(fn, args, kwargs)
    del out
    return int(peak)
