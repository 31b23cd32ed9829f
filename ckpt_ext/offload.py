"""Saved layer tensors in host memory: copied out in forward, prefetched back in backward.

A fused decoder layer (``torch.ops.ckpt_ext.decoder_layer``) saves its input and its preset's
residuals for backward. With ``offload="cpu"`` (``ckpt_ext.modules.DecoderLayer``,
``ckpt_ext.patch_llama``) each fused layer call runs under
``torch.autograd.graph.saved_tensors_hooks`` installed by an :class:`Offloader`:

* **forward (pack)**: every activation the layer's C++ Function saves (the input ``x`` and the
  residuals; never the weights, nor cos/sin, masks, segment ids or the dropout seed, which the
  call passes in and all layers share) is copied into a buffer of the offloader's *host pool*,
  and autograd keeps only a small handle to it, so the device tensor is released. On CUDA the
  host pool is pinned memory and the copy runs on a side stream after an event of the compute
  stream; ``record_stream`` keeps the source alive for the allocator until the copy is done.
* **backward (unpack)**: the first unpack of layer i's tensors fetches them (if not already
  prefetched) into a slot of the *device pool* and then starts the copy of the layer called
  before it (i - 1), so that copy overlaps layer i's backward. On CUDA the compute stream waits
  on the copy's event, never the host. A device slot is reused once the layer that holds it
  has released its saved tensors (after its backward); on CUDA the next copy into it waits on
  an event recorded at that release.
* **pools**: host buffers go back to the pool when autograd releases the handles (after the
  layer's backward, or when a graph is dropped, e.g. after an exception) and are reused by the
  next step; ``limit`` caps the host bytes in use at once, by whole layer calls: a layer
  whose saved tensors (counted from the op's fakes before it runs) would pass it keeps them all
  on the device (:func:`admits`, the rule ``ckpt_ext.plan.offload_split`` reads too).

* **streamed inputs** (``stream=True``): a ``min_memory`` layer call saves its input alone
  (and, for an MoE layer, its routing). Its input then stays in host memory through the
  backward: the unpack hands the layer's C++ backward the host copy itself, and the backward
  copies it to the device a token chunk at a time as its walk reads it (twice: once for the
  keys, once for the queries; the copies run on the compute stream, which first waits for the
  forward's copy out). The device holds no pool slot for it, one chunk at a time instead: what
  lets a layer's backward at a million tokens and more leave the device its whole-sequence
  gradients, keys and sums (``ckpt_ext.plan.offload_step_peak(..., stream=True)``). Other
  calls (other presets, sequence parallelism, an MLP-only part) use the pool as before. With
  segments (``ckpt_ext.segments``) a segment's rebuilt inputs go to host memory as well.
  The price: the copies are not overlapped with compute; at the lengths where the pool is
  what does not fit, each chunk's attention takes far longer than its copy.

On a CPU-only machine the same code runs with the CPU as the "device": the host pool and the
device pool are separate allocations and the copies are synchronous.
"""
from __future__ import annotations

import itertools
import threading
import warnings
from typing import Iterable, List, Optional

import torch
from torch import Tensor

from . import _checks

__all__ = ["Offloader", "resolve", "offloaded", "default_offloader", "admits",
           "OFFLOAD_TARGETS"]

OFFLOAD_TARGETS = ("cpu",)
_KEYS = itertools.count()
_ALIGN = 256  # bytes; each tensor's start in a device slot


def admits(in_use: int, nbytes: int, limit: int | None) -> bool:
    """The offload limit's rule: a layer call's saved tensors (``nbytes``) go to host memory
    when the host bytes already in use plus theirs stay within ``limit`` (None: no cap);
    otherwise the call keeps all of them on the device. The one definition: the
    :class:`Offloader` applies it per call, ``ckpt_ext.plan.offload_split`` layer by layer."""
    return limit is None or in_use + nbytes <= limit


def _dense(t: Tensor) -> bool:
    """Whether t's elements fill numel() consecutive slots of memory in some order (then a
    copy keeps its strides within a buffer of its size)."""
    return t.is_contiguous() or _checks._dense(t)


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Entry:
    """One offloaded tensor: its host copy and, once fetched, its device copy; a streamed
    entry is never fetched (``packed``: on CUDA the event after its copy out)."""
    __slots__ = ("group", "host", "buf", "key", "nbytes", "size", "stride", "dtype", "device",
                 "offset", "dev", "streamed", "packed", "__weakref__")

    def __init__(self, group, host, buf, key, t: Tensor, streamed: bool = False):
        self.group, self.host, self.buf, self.key = group, host, buf, key
        self.nbytes = t.numel() * t.element_size()
        self.size, self.stride, self.dtype, self.device = t.size(), t.stride(), t.dtype, t.device
        self.offset = 0
        self.dev: Optional[Tensor] = None
        self.streamed, self.packed = streamed, None


class _Handle:
    """What autograd holds for an offloaded tensor; its release returns the buffers."""
    __slots__ = ("entry", "owner", "__weakref__")

    def __init__(self, entry: _Entry, owner: "Offloader"):
        self.entry, self.owner = entry, owner

    def __del__(self):
        try:
            self.owner._release(self.entry)
        except Exception:  # interpreter shutdown
            pass


class _Group:
    """The tensors one fused layer call offloaded."""
    __slots__ = ("gid", "entries", "live", "slot", "ready", "fetched", "nbytes", "full",
                 "used", "expected", "__weakref__")

    def __init__(self, gid: int, expected: Optional[int] = None):
        self.gid, self.entries, self.live, self.used = gid, [], 0, False
        self.expected = expected  # the bytes the call will save, when known
        self.slot, self.ready, self.fetched, self.nbytes, self.full = None, None, False, 0, False


class _Slot:
    __slots__ = ("buf", "owner", "free_event")

    def __init__(self, buf: Tensor):
        self.buf, self.owner, self.free_event = buf, None, None


class Offloader:
    """Host pool, device pool and prefetch order shared by the fused layers of one model.

    ``device``: where the layers compute (a CUDA device, or ``"cpu"`` for the CPU path);
    ``limit``: the most host bytes held at once (None: no cap); ``prefetch``: how many layers
    ahead of the one running backward to copy back (1 or more); ``stream``: ``min_memory``
    layer inputs stay in host memory through the backward, which reads them a token chunk at
    a time (see the module's docstring).

    ``stats()`` reports the pools; with ``record=True``, ``events`` lists in order
    ``("pack", call)`` at a layer call's first offloaded tensor, ``("backward", call)`` at the
    first unpack of its tensors (its backward starting), and ``("fetch" | "prefetch", call)``
    when its copy back is started (calls are numbered in forward order).
    """

    def __init__(self, limit: Optional[int] = None, *, prefetch: int = 1, stream: bool = False,
                 record: bool = False):
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise TypeError(f"offload_limit must be an int number of bytes or None, got "
                                f"{type(limit).__name__}")
            if limit < 0:
                raise ValueError(f"offload_limit must be >= 0 bytes, got {limit}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"offload prefetch must be an int >= 1, got {prefetch!r}")
        if not isinstance(stream, bool):
            raise TypeError(f"offload stream must be True or False, got {stream!r}")
        self.limit, self.prefetch, self.stream, self.record = limit, prefetch, stream, record
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._groups: "dict[int, _Group]" = {}     # alive groups in call order
        self._free_host: "dict[tuple, List[Tensor]]" = {}
        self._host_bytes = 0          # allocated host pool bytes
        self._host_in_use = 0
        self._host_allocations = 0
        self._slots: List[_Slot] = []
        self._streams: dict = {}      # CUDA device index -> side stream
        self.events: list = []
        self.key = f"offloader-{next(_KEYS)}"  # names it in the once-only compile warning

    def __reduce__(self):
        # A copy (deepcopy, pickle) gets empty pools of its own: buffers, streams and the
        # lock are not copied.
        return (_new_offloader, (self.limit, self.prefetch, self.record, self.stream))

    # ---- pools ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """host_bytes: the host pool's allocated bytes; host_in_use: held by saved tensors;
        host_allocations: buffers allocated so far; device_pool_bytes: the device slots'
        bytes; device_slots: their count; live_layers: layer calls with tensors held."""
        with self._lock:
            return dict(host_bytes=self._host_bytes, host_in_use=self._host_in_use,
                        host_allocations=self._host_allocations,
                        device_pool_bytes=sum(s.buf.numel() for s in self._slots),
                        device_slots=len(self._slots), live_layers=len(self._groups))

    def host_buffers(self) -> List[Tensor]:
        """The host pool's free buffers (for tests: storage identity)."""
        with self._lock:
            return [b for bufs in self._free_host.values() for b in bufs]

    def device_buffers(self) -> List[Tensor]:
        with self._lock:
            return [s.buf for s in self._slots]

    def _take_host(self, nbytes: int, cuda: bool) -> Tensor:
        key = (nbytes, cuda)
        bufs = self._free_host.get(key)
        if bufs:
            return bufs.pop()
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
        self._host_bytes += nbytes
        self._host_allocations += 1
        return buf

    def _side(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    # ---- hooks ----------------------------------------------------------------------------

    def _pack(self, group: _Group, keep: Iterable[Tensor], t: Tensor,
              streamed_id: Optional[int] = None):
        if any(t is k for k in keep) or isinstance(t, torch.nn.Parameter) or group.full:
            return t
        if not t.is_floating_point() or t.layout != torch.strided or t.numel() == 0:
            return t
        src = t if _dense(t) else t.contiguous()
        nbytes = src.numel() * src.element_size()
        cuda = src.is_cuda
        with self._lock:
            if not group.entries and group.expected is not None and \
                    not admits(self._host_in_use, group.expected, self.limit):
                group.full = True  # the whole layer call stays on the device
                return t
            if not admits(self._host_in_use, nbytes, self.limit):
                group.full = True
                return t
            buf = self._take_host(nbytes, cuda)
            self._host_in_use += nbytes
            if not group.entries:
                self._groups[group.gid] = group
                if self.record:
                    self.events.append(("pack", group.gid))
            host = buf.view(src.dtype).as_strided(src.size(), src.stride())
            entry = _Entry(group, host, buf, (nbytes, cuda), src, streamed=id(t) == streamed_id)
            group.entries.append(entry)
            group.live += 1
            if not entry.streamed:
                group.nbytes += _round(nbytes)
        if cuda:
            side = self._side(src.device)
            side.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
                if entry.streamed:
                    entry.packed = torch.cuda.Event()
                    entry.packed.record(side)
            src.record_stream(side)
        else:
            host.copy_(src)
        return _Handle(entry, self)

    def _unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        entry = packed.entry
        group = entry.group
        with self._lock:
            if not group.used:
                group.used = True
                if self.record:
                    self.events.append(("backward", group.gid))
            if not group.fetched:
                self._fetch(group, "fetch")
            self._prefetch_before(group)
            dev = entry.dev
            ready = group.ready
            if entry.streamed:   # the host copy itself, once its copy out is done
                dev, ready = entry.host, entry.packed
                if ready is not None:
                    torch.cuda.current_stream(entry.device).wait_event(ready)
                return dev
        if ready is not None:
            torch.cuda.current_stream(dev.device).wait_event(ready)
        return dev

    def _prefetch_before(self, group: _Group) -> None:
        ids = [g for g in self._groups if g < group.gid]
        for gid in ids[::-1][:self.prefetch]:
            g = self._groups[gid]
            if not g.fetched:
                self._fetch(g, "prefetch")

    def _fetch(self, group: _Group, why: str) -> None:
        """Copy a group's tensors, but for streamed ones, into a free device slot (holding the
        lock)."""
        if self.record:
            self.events.append((why, group.gid))
        entries = [e for e in group.entries if not e.streamed]
        if not entries:          # streamed alone: nothing comes back
            group.fetched = True
            return
        first = entries[0]
        device = first.device
        slot = None
        for s in self._slots:
            if s.owner is None and s.buf.device == device:
                slot = s
                break
        if slot is None:
            slot = _Slot(torch.empty(0, dtype=torch.uint8, device=device))
            self._slots.append(slot)
        if slot.buf.numel() < group.nbytes:  # grow: the allocator orders the old one's frees
            slot.buf = torch.empty(group.nbytes, dtype=torch.uint8, device=device)
            slot.free_event = None
        slot.owner = group
        group.slot = slot
        offset = 0
        views = []
        for e in entries:
            e.offset = offset
            views.append(slot.buf[offset:offset + e.nbytes].view(e.dtype)
                         .as_strided(e.size, e.stride))
            offset += _round(e.nbytes)
        if device.type == "cuda":
            side = self._side(device)
            if slot.free_event is not None:
                side.wait_event(slot.free_event)
                slot.free_event = None
            with torch.cuda.stream(side):
                for e, v in zip(entries, views):
                    v.copy_(e.host, non_blocking=True)
                    e.dev = v
                ev = torch.cuda.Event()
                ev.record(side)
            slot.buf.record_stream(side)
            group.ready = ev
        else:
            for e, v in zip(entries, views):
                v.copy_(e.host)
                e.dev = v
        group.fetched = True

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            group = entry.group
            if entry.buf is None:
                return
            self._free_host.setdefault(entry.key, []).append(entry.buf)
            self._host_in_use -= entry.buf.numel()
            entry.buf = entry.host = entry.dev = entry.packed = None
            group.live -= 1
            if group.live == 0:
                self._groups.pop(group.gid, None)
                slot = group.slot
                if slot is not None:
                    slot.owner = None
                    if slot.buf.is_cuda:
                        ev = torch.cuda.Event()
                        ev.record(torch.cuda.current_stream(slot.buf.device))
                        slot.free_event = ev
                group.slot = group.ready = None

    # ---- calling a layer ------------------------------------------------------------------

    def hooks(self, keep: Iterable[Tensor], nbytes: Optional[int] = None,
              streamed: Optional[Tensor] = None):
        """The saved-tensor hooks for one layer call; ``keep``: tensors that stay where they are
        (weights and the inputs all layers share); ``nbytes``: what the call will save, if
        known (the limit then keeps or moves the call's tensors together); ``streamed``: the
        call's input when it is to stay in host memory through the backward (``streams``)."""
        return torch.autograd.graph.saved_tensors_hooks(
            *self.pack_unpack(keep, nbytes, streamed))

    def pack_unpack(self, keep: Iterable[Tensor], nbytes: Optional[int] = None,
                    streamed: Optional[Tensor] = None):
        """The ``(pack, unpack)`` pair that ``hooks`` installs, for a caller that puts its own
        saved-tensor hooks around them (``ckpt_ext.segments``)."""
        group = _Group(next(self._ids), nbytes)
        keep = [k for k in keep if isinstance(k, Tensor)]
        # autograd keeps the hooks of what was packed until the backward: they must not keep
        # the streamed input alive, so it is known by its id (it is alive while the call runs,
        # the only time the pack hook is called)
        streamed_id = None if streamed is None else id(streamed)
        return (lambda t: self._pack(group, keep, t, streamed_id)), self._unpack

    def streams(self, options) -> bool:
        """Whether a fused layer call with these ``LayerOptions`` leaves its input in host
        memory through the backward: with ``stream=True``, a ``min_memory`` call of an
        attention layer without sequence parallelism (the backward that reads its input a
        chunk at a time)."""
        return self.stream and options.preset == "min_memory" and options.part != "mlp" and \
            not options.sequence_parallel

    def hold(self, t: Tensor):
        """``t`` moved to host memory for a backward to read as a streamed input (a segment's
        rebuilt input): (the host tensor, a handle that keeps it until dropped); past the
        limit, (``t``, None): it stays where it is."""
        pack, unpack = self.pack_unpack((), t.numel() * t.element_size(), t)
        handle = pack(t)
        return unpack(handle), (handle if isinstance(handle, _Handle) else None)


def _new_offloader(limit, prefetch, record, stream=False) -> Offloader:
    return Offloader(limit, prefetch=prefetch, record=record, stream=stream)


_COMPILE_WARNED: set = set()


@torch.compiler.assume_constant_result
def _warn_compile(key: str) -> bool:
    """The warning that offload is off in a compiled region, once per offloader. To dynamo a
    constant: it runs while the graph is traced, with no graph break."""
    if key not in _COMPILE_WARNED:
        _COMPILE_WARNED.add(key)
        warnings.warn("ckpt_ext offload: under torch.compile the fused layers keep their saved "
                      "tensors on the device (offload='cpu' runs in eager mode only)",
                      stacklevel=2)
    return True


_DEFAULT_LOCK = threading.Lock()
_STRONG: dict = {}


def default_offloader() -> Offloader:
    """The process-wide offloader that ``DecoderLayer(offload="cpu")`` layers share (no cap)."""
    with _DEFAULT_LOCK:
        if "cpu" not in _STRONG:
            _STRONG["cpu"] = Offloader()
        return _STRONG["cpu"]


def resolve(offload, offload_limit=None, what: str = "offload", *,
            shared: bool = False, stream: bool = False) -> Optional[Offloader]:
    """``offload`` (None, "cpu" or an Offloader) and ``offload_limit`` (bytes, a string such as
    "64GiB", or None) checked; the Offloader to use, or None. ``shared``: "cpu" without a cap
    gives the process-wide ``default_offloader()`` instead of a new one. ``stream``
    (``{what}_stream``): the Offloader's ``stream`` (streamed ``min_memory`` inputs)."""
    if not isinstance(stream, bool):
        raise TypeError(f"{what}_stream must be True or False, got {stream!r}")
    if offload_limit is not None and offload is None:
        raise ValueError(f"{what}_limit applies with {what}='cpu' only, got {what}=None")
    if stream and offload is None:
        raise ValueError(f"{what}_stream applies with {what}='cpu' only, got {what}=None")
    if offload is None:
        return None
    if isinstance(offload, Offloader):
        if offload_limit is not None:
            raise ValueError(f"{what}_limit: give the cap to the Offloader itself")
        if stream:
            raise ValueError(f"{what}_stream: give stream=True to the Offloader itself")
        return offload
    if offload not in OFFLOAD_TARGETS:
        raise ValueError(f"{what} must be None, 'cpu' (host memory) or a "
                         f"ckpt_ext.offload.Offloader; got {offload!r}")
    if offload_limit is not None:
        from .config import parse_bytes
        offload_limit = parse_bytes(offload_limit, f"{what}_limit")
        return Offloader(offload_limit, stream=stream)
    if stream:
        return Offloader(stream=True)
    return default_offloader() if shared else Offloader()


def offloaded(offloader: Optional[Offloader], fn, x: Tensor, keep: Iterable[Tensor], options):
    """``fn(x, options)`` (a fused layer call: ``options`` a ``blocks.LayerOptions``, e.g. a
    ``LayerRecord.options(...)``) with its saved tensors offloaded by ``offloader``; ``keep``:
    tensors that must stay (weights, shared inputs). Without grad, or with no offloader, a
    plain call. Under torch.compile the tensors stay on the device (one warning); during CUDA
    graph capture offloading is refused."""
    if offloader is None or not torch.is_grad_enabled():
        return fn(x, options)
    if torch.compiler.is_compiling():
        _warn_compile(offloader.key)
        return fn(x, options)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("ckpt_ext offload: CUDA graph capture is not supported with "
                           "offload='cpu' (its copies and events are host-driven); capture the "
                           "model with offload=None")
    nbytes = _layer_saved_bytes(x, options) if offloader.limit is not None else None
    with offloader.hooks(keep, nbytes, x if offloader.streams(options) else None):
        return fn(x, options)


def _layer_saved_bytes(x: Tensor, options) -> int:
    """The bytes a decoder_layer call with these arguments (a ``blocks.LayerOptions``) saves
    besides its shared inputs: B*S times ``presets.per_token_bytes`` of its part and preset
    (x and the residuals the engine keeps, an MoE layer's routing included), at the shapes its weights give, with the autocast
    dtype as the compute dtype when autocast is on."""
    from .blocks import _SLOT_INDEX
    from .presets import per_token_bytes
    a = options
    compute = a.compute_dtype
    if compute is None and torch.is_autocast_enabled(x.device.type):
        compute = torch.get_autocast_dtype(x.device.type)

    def rows(slot: str) -> int:
        w = a.weights[_SLOT_INDEX[slot]]
        return 0 if w is None else w.shape[0]
    heads = a.num_heads
    kv_heads = heads if a.num_kv_heads is None else a.num_kv_heads
    D = rows("self_attn.q_proj.weight") // heads if heads else 0
    b, s, H = x.shape
    return b * s * per_token_bytes(a.preset, H=H, Hq=heads, Hkv=kv_heads, D=D,
                                   I=rows("mlp.gate_proj.weight"), dtype=x.dtype,
                                   compute_dtype=compute, part=a.part,
                                   top_k=a.num_experts_per_tok)
