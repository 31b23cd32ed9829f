"""Segments of several fused decoder layers: only the segment's first input is kept.

``patch_llama(model, policy="min_memory", segment_layers=k)`` groups consecutive fused layer
calls of one model forward k at a time. Transformers calls each decoder layer on its own, so a
segment is not one call: each fused layer call runs under saved-tensor hooks (``call``) that
know its place in its segment.

* **forward**: the segment's first layer's input is packed as it is without segments (by the
  model's ``ckpt_ext.offload.Offloader``, else by the saved-tensor hooks around the call, if
  any) and held by the segment, autograd holding a placeholder that names the segment; layers
  2..k save a placeholder in place of their input, and everything else they save (their
  preset's residuals, which the offloader moves as usual; weights, cos/sin, masks and the
  dropout seed, which stay) as before. Each call records what it was called with (the op and
  its ``LayerOptions``, the dropout seed included), the CPU (and CUDA) RNG state and the
  autocast state.
* **backward**: the first placeholder unpacked (layer k's, whose backward runs first) unpacks
  the segment's input and re-runs layers 1..k-1 forward without grad from it, with the
  recorded arguments, RNG and autocast states, and keeps their outputs: the inputs of layers
  2..k. Each is handed to its layer's backward once and dropped by the segment then, so it is
  freed when that backward ends; the first layer's backward gets the input that the rebuild
  unpacked (outer hooks such as ``torch.utils.checkpoint``'s allow one unpack). A second
  backward through a graph kept with ``retain_graph=True`` rebuilds again.
* **QLoRA** (bitsandbytes bases, ckpt_ext.hf.quantized): a call records its ``Transient``
  with the rest; the rebuild fills it around its replay of the call (the same dequantization
  of the same quantized state: the same weights) and frees it after, one layer at a time. A
  later layer's node pre-hook runs the rebuild before that layer's own weights are filled for
  its backward, so no two layers' dequantized weights are alive at once.
* **FSDP2** (``fully_shard`` on each decoder layer): a call records a ``gather`` that the
  rebuild enters around its replay of the call: it gathers the layer's parameters (FSDP2's
  ``unshard``, which fills the very tensors the forward read) and releases them after
  (``reshard``), unless FSDP2 had already started gathering them for the layer's own backward
  (its backward prefetch), which then keeps them. A replay whose weights were released and
  not gathered again (sharding the rebuild does not know: a weight emptied, or its storage
  freed) raises a RuntimeError.
* **DeepSpeed ZeRO-3** (a fused layer is a ZeRO-3 leaf module, gathered for its forward and
  its backward only): the recorded ``gather`` makes the layer's parameters available for the
  replay without taking any from ZeRO-3's coordinator: those it holds are read as they are,
  those it is prefetching for the layer's own backward are waited for and stay gathered for
  it, and only the partitioned ones are gathered (``deepspeed.zero.GatheredParameters``) and
  partitioned again after the replay (``ckpt_ext.hf.patch._zero3_gather``).

A layer joins the running segment only when its input *is* the previous fused call's output
(the same tensor, not changed in place since; or a view of all of it, which is what FSDP2's
pre-forward hook passes on through an identity autograd node; or an alias of all of it that
autograd nodes of one input each made, which is what ZeRO-3's hooks pass on, their nodes
returning the output detached): anything that runs between two layers, or a layer that runs
HF's forward instead of the fused op, starts a new segment. The
rebuilt inputs are therefore the very values the forward computed (the op is deterministic on
the CPU), and the gradients equal those of one-layer segments bit for bit.

* **streamed inputs** (an offloader with ``stream=True``, ``min_memory``): the segment's first
  input stays in host memory (``ckpt_ext.offload``); the rebuild copies it to the device for
  its replay, and each rebuilt input goes to host memory as it is made (through the
  offloader, within its limit; past it, it stays on the device), held there until its layer's
  backward, which reads it a token chunk at a time, ends.

The cost: k - 1 more layer forwards per segment of k layers in backward, and, while a segment's
backward runs, up to k - 1 rebuilt layer inputs on the device beside the layer's own backward
(in host memory with streamed inputs).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterable, List, Optional

import torch
from torch import Tensor

from .offload import Offloader, _layer_saved_bytes, offloaded

__all__ = ["check_segment_layers", "Chain", "Segment", "call"]


def check_segment_layers(value, what: str = "patch_llama") -> int:
    """``value`` if it is an int >= 1 (1: every layer its own segment), else a ValueError
    naming ``segment_layers``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: segment_layers must be an int >= 1 (the decoder layers per "
                         f"segment; 1 keeps every layer's input), got {value!r}")
    return value


class _Call:
    """One fused layer call of a segment, as its rebuild replays it."""
    __slots__ = ("fn", "options", "cpu_rng", "cuda_rng", "device", "autocast", "transient",
                 "gather", "shapes")

    def __init__(self, fn: Callable, options, x: Tensor, transient=None, gather=None):
        self.fn, self.options, self.transient, self.gather = fn, options, transient, gather
        # the weights' shapes as the call read them (a released ZeRO-3 parameter is emptied)
        self.shapes = [w.shape if isinstance(w, Tensor) else None
                       for w in getattr(options, "weights", ()) or ()]
        self.device = x.device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        kind = x.device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                         torch.is_autocast_cache_enabled())

    def run(self, x: Tensor) -> Tensor:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        kind, enabled, dtype, cache = self.autocast
        # QLoRA: the call's quantized weights dequantized again for this forward (the same
        # dequantization, so the same weights) and freed after it
        fill = self.transient if self.transient else contextlib.nullcontext()
        # FSDP2: the layer's parameters gathered for this forward and released after it
        gathered = self.gather() if self.gather is not None else contextlib.nullcontext()
        with gathered, torch.autocast(kind, dtype=dtype, enabled=enabled,
                                      cache_enabled=cache), fill:
            _check_filled(self.options, self.shapes)
            out = self.fn(x, self.options)
        return out[0] if isinstance(out, tuple) else out


def _check_filled(options, shapes) -> None:
    """A RuntimeError if a weight the call read has been released since (its storage freed,
    or the tensor emptied: its shape no longer ``shapes``' entry, what the call read): sharded
    parameters that the replay did not gather again."""
    for w, shape in zip(getattr(options, "weights", ()) or (), shapes):
        if not isinstance(w, Tensor):
            continue
        if w.shape != shape or w.numel() and \
                w.untyped_storage().nbytes() < (w.storage_offset() + 1) * w.element_size():
            raise RuntimeError(
                "ckpt_ext segments: a weight of a layer that a segment's rebuild replays was "
                "released after its forward and not gathered again (parameters sharded in a "
                "way the rebuild does not gather, e.g. by FSDP2 on an outer module only); "
                "fully_shard each decoder layer, or patch the model with segment_layers=1")


class Segment:
    """The layer calls of one segment, its first input as the first layer saved it, and the
    rebuilt inputs of its later layers while the backward needs them. ``rebuilds`` counts the
    rebuilds run (one per backward through the segment)."""

    def __init__(self):
        self.calls: List[_Call] = []
        self.first = None            # the first layer's packed input (a tensor or a handle);
        # set by the first layer's pack (a segment whose first call saved nothing ends there)
        self.unpack_first: Optional[Callable] = None
        self.inputs: dict = {}       # place in the segment -> (rebuilt input, what holds it)
        self.rebuilds = 0
        # streamed inputs: the offloader's hold (a rebuilt input -> (host copy, its handle))
        self.hold: Optional[Callable] = None

    def input_of(self, place: int):
        """The input of the segment's layer at ``place`` and what keeps it valid while that
        layer's backward reads it (a host buffer's handle, or None): the first layer's as the
        rebuild unpacked it (or unpacked now), a later layer's rebuilt if not held; the
        segment lets go of it."""
        got = self.inputs.pop(place, None)
        if place == 0:  # the first layer's: as the rebuild unpacked it, or its own unpack
            return got if got is not None else (
                self.first if self.unpack_first is None else self.unpack_first(self.first),
                None)
        if got is None:
            self._rebuild(place)
            got = self.inputs.pop(place)
        return got

    def prepare(self, place: int) -> None:
        """Rebuild the inputs up to ``place`` now if the segment does not hold that input (the
        node pre-hook of a layer whose weights are filled for its backward: the rebuild runs
        before they are, so that it dequantizes its layers' weights one layer at a time)."""
        if place and place not in self.inputs:
            self._rebuild(place)

    def _rebuild(self, upto: int) -> None:
        x = self.first if self.unpack_first is None else self.unpack_first(self.first)
        # the first layer's backward takes its input from here: its packed input is unpacked
        # once (hooks around the call, torch.utils.checkpoint's among them, allow no more)
        self.inputs[0] = (x, None)
        device = self.calls[0].device
        if x.device != device:   # a streamed input, in host memory: the replay's copy
            x = x.to(device, non_blocking=True)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for place in range(1, upto + 1):
                x = self.calls[place - 1].run(x)
                self.inputs[place] = (x, None) if self.hold is None else self.hold(x)
        self.rebuilds += 1


class _Placeholder:
    """What autograd holds in place of the input of a segment's layer: for the first, a
    reference to the segment, which holds the input as the first layer's hooks packed it
    (``Segment.first``); for layers 2..k, nothing of it."""
    __slots__ = ("segment", "place", "held")

    def __init__(self, segment: Segment, place: int):
        self.segment, self.place, self.held = segment, place, None


class Chain:
    """One model forward's segments: the running segment and the last fused call's output.
    ``k``: the layers per segment. ``segments`` lists the segments in forward order (kept only
    with ``record=True``, for tests: it holds them past their backward)."""

    def __init__(self, k: int, record: bool = False):
        self.k = check_segment_layers(k, "Chain")
        self.segment: Optional[Segment] = None
        self.last = None             # weakref to the last fused call's output
        self.version = -1
        # the last output's autograd node and memory (pointer, dtype, shape, strides, offset):
        # what tells an alias of it once that tensor object is gone (ZeRO-3's hook returns
        # the layer's output detached, and drops the output itself)
        self.node = None
        self.memory = None
        self.segments: Optional[List[Segment]] = [] if record else None

    def place(self, x: Tensor):
        """(segment, place) for a fused call with input ``x``."""
        seg = self.segment
        if seg is not None and len(seg.calls) < self.k and self._follows(x):
            return seg, len(seg.calls)
        self.segment = seg = Segment()
        if self.segments is not None:
            self.segments.append(seg)
        return seg, 0

    def _follows(self, x: Tensor) -> bool:
        """``x`` holds the last fused call's output as that call made it: the output itself or
        a view of all of it (``_is_whole``), or an alias of all of it made by autograd nodes of
        one input each (``_made_from``), which shares its version counter; its version
        unchanged since."""
        if x._version != self.version:
            return False
        last = self.last() if self.last is not None else None
        if _is_whole(x, last):
            return True
        return self.memory is not None and _memory(x) == self.memory and \
            _made_from(x.grad_fn, self.node)

    def done(self, y: Tensor) -> None:
        self.last, self.version = weakref.ref(y), y._version
        self.node, self.memory = y.grad_fn, _memory(y)


def _memory(t: Tensor):
    return (t.untyped_storage().data_ptr(), t.dtype, t.shape, t.stride(), t.storage_offset())


def _is_whole(x: Tensor, last: Optional[Tensor]) -> bool:
    """``x`` is ``last``, or a view of all of it as it is (the same values): what a hook that
    passes a module's input through an identity autograd node makes of it (FSDP2's pre-forward
    hook, which registers the layer's post-backward that way)."""
    if last is None:
        return False
    if x is last:
        return True
    base = last if last._base is None else last._base
    return x._base is base and x.dtype == last.dtype and x.shape == last.shape and \
        x.stride() == last.stride() and x.storage_offset() == last.storage_offset()


def _made_from(node, target, steps: int = 8) -> bool:
    """``node`` is ``target``, or reaches it within ``steps`` autograd nodes of one input
    each (DeepSpeed ZeRO-3's pre-backward and post-backward nodes, which return their input
    detached: an alias sharing its memory and version counter)."""
    if target is None:
        return False
    for _ in range(steps + 1):
        if node is target:
            return True
        nexts = [n for n, _ in getattr(node, "next_functions", ()) or () if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


def _outer_hooks():
    """The saved-tensor hooks active around this call as (pack, unpack), or (None, None)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return hooks if hooks is not None else (None, None)


def call(chain: Optional[Chain], offloader: Optional[Offloader], fn: Callable, x: Tensor,
         keep: Iterable[Tensor], options, transient=None, gather=None):
    """``fn(x, options)``, a fused layer call, as a member of ``chain``'s running segment
    (None: ``ckpt_ext.offload.offloaded``, the call on its own); its saved tensors offloaded
    by ``offloader`` (None: kept on the device).

    ``transient``: the call's ``ckpt_ext.hf.quantized.Transient`` (QLoRA), filled by the caller
    around this call; the rebuild fills it again around its replay of the call and frees it
    after. A later layer of a segment with one gets a node pre-hook (registered before the
    caller's ``Transient.attach``, so it runs first) that rebuilds the segment's inputs before
    its own weights are filled for its backward: one layer's dequantized weights at a time.

    ``gather``: for a layer whose parameters are sharded (FSDP2, ZeRO-3), a function
    returning a context that gathers them around the rebuild's replay of the call and releases
    after it what it gathered (the replay reads the same parameter tensors the call read,
    filled again)."""
    if chain is None or not torch.is_grad_enabled():
        return offloaded(offloader, fn, x, keep, options)
    if offloader is not None and torch.cuda.is_available() and \
            torch.cuda.is_current_stream_capturing():
        return offloaded(offloader, fn, x, keep, options)  # refuses capture
    seg, place = chain.place(x)
    seg.calls.append(_Call(fn, options, x, transient, gather))
    # what the call's other saved tensors go through: the offloader's hooks, or without one the
    # saved-tensor hooks around the call (ckpt_ext.saved_activation_bytes then counts what the
    # segment keeps), or none
    inner_pack, inner_unpack = _outer_hooks() if offloader is None else (None, None)
    if offloader is not None:
        nbytes = None
        if offloader.limit is not None:
            nbytes = _layer_saved_bytes(x, options)
            if place:  # its input is not saved
                nbytes -= x.numel() * x.element_size()
        streams = offloader.streams(options)
        inner_pack, inner_unpack = offloader.pack_unpack(keep, nbytes, x if streams else None)
        if not place and streams:
            seg.hold = offloader.hold

    # the input, for the pack hook to recognise; emptied after the call, since autograd keeps
    # the hooks of what was packed, and a placeholder must not keep the input alive
    given = [x]

    def pack(t: Tensor):
        if given and t is given[0]:
            if not place:
                seg.first = t if inner_pack is None else inner_pack(t)
                seg.unpack_first = inner_unpack
            return _Placeholder(seg, place)
        return t if inner_pack is None else inner_pack(t)

    def unpack(packed):
        if isinstance(packed, _Placeholder):
            # autograd holds the placeholder until the layer's backward ends, and with it
            # what keeps the input valid (a streamed input's host buffer)
            x, packed.held = packed.segment.input_of(packed.place)
            return x
        return packed if inner_unpack is None else inner_unpack(packed)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = fn(x, options)
    finally:
        given.clear()
    y = out[0] if isinstance(out, tuple) else out
    chain.done(y)
    if place and transient and y.grad_fn is not None:
        y.grad_fn.register_prehook(lambda grad_outputs: seg.prepare(place))
    if not place and seg.first is None:
        # nothing saved (no input of the call needs a gradient: frozen first layers): no
        # input to rebuild from, so the next layer starts a segment of its own
        chain.segment = None
    return out
