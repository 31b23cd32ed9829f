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

    def add_session(self, peak: int, change: int) -> None:
        """Fold in one profiler session: its peak and its net change, both above its start."""
        self.peak = max(self.peak, self.total + peak)
        self.total += change


# The CPU measurements in progress, outermost first. torch.profiler runs one session per
# process, so nested measurements share it: each inner call ends the session that is running,
# hands its events to every open measurement, and runs one of its own; when it returns, a new
# session carries the outer measurements on.
_open_meters: list = []
_meter_lock = threading.Lock()


class _CpuSession:
    """A torch profiler session that records the CPU allocator's events, bracketed by a
    one-byte probe: allocated just after the session starts, freed just before it stops.

    Each allocation event carries the allocator's running total after it
    (``total_allocated``, updated under the allocator's lock), which orders the events
    exactly; their timestamps do not (two events close together can share one or come out
    swapped when a thread moves between cores). The probe's two events pin down the total at
    the session's start and end, and the peak is the highest total between them."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile
        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profile.start()
        self.probe = torch.empty(1, dtype=torch.uint8)

    def close(self) -> tuple[int, int]:
        """Stop the session: (its peak, its net change), in bytes above its start."""
        ptr = self.probe.data_ptr()
        del self.probe
        self.profile.stop()
        return _session_bytes(_cpu_allocations(self.profile), ptr)


def _cpu_allocations(profile) -> list:
    """The CPU allocator events of a stopped profiler session, each as
    (timestamp, address, bytes: negative for a free, allocator total after it)."""
    from torch._C._profiler import _EventType
    found, stack = [], list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            f = event.extra_fields
            if f.device.type == "cpu":
                found.append((event.start_time_ns, f.ptr, f.alloc_size, f.total_allocated))
    return sorted(found)


def _session_bytes(allocations: list, probe_ptr: int) -> tuple[int, int]:
    """(peak, net change) above the start of a session whose allocator events are
    ``allocations`` and whose probe (one byte) lives at ``probe_ptr``."""
    opened = next((total for _, ptr, n, total in allocations if ptr == probe_ptr and n == 1),
                  None)
    closed = next((total for _, ptr, n, total in allocations if ptr == probe_ptr and n == -1),
                  None)
    if opened is None or closed is None:
        raise RuntimeError(
            "peak_memory_bytes: the torch profiler recorded no CPU allocator events for this "
            "call (profile_memory=True records them in every torch build this library "
            "supports); the CPU peak cannot be read")
    # `opened` counts the probe; every event between the probe's two holds it too.
    highest = max((total for _, ptr, n, total in allocations
                   if not (ptr == probe_ptr and abs(n) == 1)), default=opened)
    return max(0, highest - opened), closed - (opened - 1)


_session = None  # the profiler session of the open meters (None when there are none)


def _close_session(session: _CpuSession) -> None:
    """Stop ``session`` and fold its peak and net change into every open meter."""
    peak, change = session.close()
    for meter in _open_meters:
        meter.add_session(peak, change)


def _cpu_peak(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """(fn's result, peak CPU bytes above the start), from the CPU allocator's reports that
    ``torch.profiler`` records as memory events: each allocation and free carries the
    allocator's running total after it, and the peak is the highest total less the total at
    the start (see ``_CpuSession``). Memory freed that was allocated before the call counts
    as negative. Calls nest (see ``_open_meters``); a profiler that someone
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
        _session = _CpuSession()
    try:
        out = fn(*args, **kwargs)
    finally:
        with _meter_lock:
            _close_session(_session)
            _open_meters.remove(meter)
            _session = _CpuSession() if _open_meters else None
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
      ``torch.profiler.profile(profile_memory=True)`` around the call: each report carries
      the allocator's running total, whose highest value less the start is the peak.
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
