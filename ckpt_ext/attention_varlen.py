"""Padded and packed attention calls on a variable-length vendor op (FlashAttention-2's).

A call with a ``key_padding_mask`` or packed ``segment_ids`` is exactly a set of independent
unmasked attentions when the mask has a simple shape. FlashAttention-2's variable-length
entry point (``aten._flash_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``) computes
such a set in one launch: the sequences' rows are concatenated, ``(T, H, D)``, and the
cumulative lengths say where each starts. This module turns a call into at most two such
launches and back:

* **Describe the masks** (:func:`describe`, one host sync, cached per mask tensor so the
  layers and chunks of one forward share it): the key runs of each batch row.

  - ``segment_ids`` whose values never decrease along a row (transformers' packing rule
    makes them so): each run of equal ids is one document, and each document is one
    contiguous run. Other ids are refused (the Triton kernels serve them: a document split
    in two runs would attend across the gap there).
  - ``key_padding_mask`` whose real keys form one contiguous run per row (left or right
    padding, or both): that run. A row with holes is refused; a row with no real key has no
    run.

* **Cut a call into sequences** (:func:`plan`), for the query rows ``[q_offset, q_offset +
  Sq)`` of a (possibly chunked) call, each sequence ``(b, q0, q1, k0, k1)`` in positions:

  - packed, causal: the chunk's rows of each document against the document's keys up to the
    chunk's last row (``k1 == q1``, so FlashAttention-2's bottom-right causal alignment is the
    positions' own); non-causal: against the whole document.
  - padded, causal: the rows of the run against the run's keys up to the row (as packed);
    the rows after the run see all of it, a second, non-causal launch; the rows before it see
    nothing and get out 0, lse -inf, zero gradients here, never a vendor call (which would
    give NaN). Non-causal: every row against the whole run.

* **Run them** (:func:`varlen_fwd`, :func:`varlen_bwd`): gather the rows (a view when the
  sequences are adjacent, as one packed row's are), launch, and put the results back in the
  op's layouts; each launch's dK / dV add into the keys' fp32 accumulators. Every query row
  is in exactly one sequence or in none, so nothing is merged.

The sliding window rides on the launch (``window_size_left``) for packed causal calls: the
bottom-right alignment makes it the positions' window. A window with a padding mask stays on
Triton (the rows after the run would need a windowed non-causal launch).
"""
from __future__ import annotations

import bisect
import dataclasses
import threading

import torch

from ._checks import _stat_dtype

__all__ = ["Layout", "Sequences", "describe", "plan", "varlen_fwd", "varlen_bwd"]


# ---- the masks' key runs -----------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Layout:
    """The key runs of a batch: ``runs[b]`` the sorted ``(start, end)`` runs of row b
    (packed: the documents, covering every position; padded: the real keys' run, or none)."""

    kind: str                      # "packed" or "padded"
    runs: tuple
    Sk: int
    _plans: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._starts = tuple(tuple(s for s, _ in row) for row in self.runs)

    @classmethod
    def packed(cls, segment_ids) -> "Layout | str":
        """The documents of ``segment_ids`` (B, Sk) on any device (one host sync), or why the
        varlen route cannot serve them."""
        B, Sk = segment_ids.shape
        if Sk == 0:
            return cls("packed", ((),) * B, 0)
        s = segment_ids
        change = torch.nonzero(s[:, 1:] != s[:, :-1])            # (n, 2): (row, position - 1)
        falls = (s[:, 1:] < s[:, :-1]).any().reshape(1).to(change.dtype)
        host = torch.cat([falls, change.reshape(-1)]).tolist()    # the one transfer
        if host[0]:
            return ("segment_ids decrease along a row: the varlen route serves ids that never "
                    "decrease (each document one contiguous run, as packing makes them)")
        bounds = [[0] for _ in range(B)]
        for b, p in zip(host[1::2], host[2::2]):
            bounds[b].append(p + 1)
        return cls("packed", tuple(tuple(zip(row, row[1:] + [Sk])) for row in bounds), Sk)

    @classmethod
    def padded(cls, key_padding_mask) -> "Layout | str":
        """The real keys' run of each row of ``key_padding_mask`` (B, Sk) (one host sync), or
        why the varlen route cannot serve them."""
        B, Sk = key_padding_mask.shape
        if Sk == 0:
            return cls("padded", ((),) * B, 0)
        m = key_padding_mask.to(torch.uint8)
        stats = torch.stack([m.sum(1, dtype=torch.int64), m.argmax(1),
                             Sk - m.flip(1).argmax(1)], 1).tolist()
        runs = []
        for b, (n, first, end) in enumerate(stats):
            if n and end - first != n:
                return (f"key_padding_mask row {b} has {n} real keys in more than one run "
                        f"(between positions {first} and {end}): the varlen route serves one "
                        f"run of real keys per row (left or right padding)")
            runs.append(((first, end),) if n else ())
        return cls("padded", tuple(runs), Sk)

    def first_run(self, b: int, pos: int) -> int:
        """The index of the run of row b that holds position ``pos`` (packed runs cover
        every position)."""
        return max(bisect.bisect_right(self._starts[b], pos) - 1, 0)


# (the mask tensor, its version, the layout), newest last. The tensors are held: while a
# tensor's Python object lives, torch hands that same object to every later call that gets the
# tensor (the C++ layer's chunks, its backward), so identity is a sound key; a weak reference
# would die between the calls and the masks be read again at each. At most _CACHE_SIZE masks
# (B * S ints or bools each) stay alive past their use.
_cache: list = []
_cache_lock = threading.Lock()
_CACHE_SIZE = 4


def describe(key_padding_mask, segment_ids) -> "Layout | str":
    """The :class:`Layout` of a call's masks (exactly one of them given), or a string saying
    why the varlen route cannot serve them. Reads the mask once per tensor (and in-place
    version): a forward's layers and chunks and its backward share the answer."""
    if key_padding_mask is not None and segment_ids is not None:
        return "key_padding_mask together with segment_ids: the varlen route takes one of them"
    t = key_padding_mask if key_padding_mask is not None else segment_ids
    if t is None:
        raise ValueError("describe: neither key_padding_mask nor segment_ids was given")
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return ("the masks cannot be read while a CUDA graph is being captured (the varlen "
                "route needs their runs on the host)")
    version = _version(t)
    with _cache_lock:
        for held, seen, layout in _cache:
            if held is t and seen == version is not None:
                return layout
    layout = (Layout.padded(t) if key_padding_mask is not None else Layout.packed(t))
    if version is None:        # an inference tensor: no version counter, so not kept
        return layout
    with _cache_lock:
        _cache[:] = [e for e in _cache if e[0] is not t][-(_CACHE_SIZE - 1):]
        _cache.append((t, version, layout))
    return layout


def _version(t) -> "int | None":
    """t's in-place version, or None for a tensor that has none (made under inference_mode)."""
    if t.is_inference():
        return None
    return t._version


# ---- a call's sequences ------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Launch:
    """One variable-length launch: its sequences ``(b, q0, q1, k0, k1)`` in positions, and
    where their rows lie in the call's flattened ``(B * Sq)`` queries and ``(B * Sk)`` keys."""

    causal: bool
    seqs: tuple
    q_ranges: tuple                # coalesced (flat start, rows) of the gathered queries
    k_ranges: tuple                # coalesced (flat start, rows) of the gathered keys
    key_slices: tuple              # (b, k0, rows, offset in the gathered keys) per batch row
    cu_q: tuple
    cu_k: tuple
    max_q: int
    max_k: int
    _device_cu: dict = dataclasses.field(default_factory=dict, repr=False)

    def cu(self, device):
        """The cumulative lengths as int32 tensors on ``device`` (made once per device; on
        CUDA through pinned memory, so no sync)."""
        key = str(device)
        got = self._device_cu.get(key)
        if got is None:
            got = self._device_cu[key] = tuple(_int32_on(v, device)
                                               for v in (self.cu_q, self.cu_k))
        return got


@dataclasses.dataclass(eq=False)
class Sequences:
    """A call cut into launches; ``rows``: the flattened query rows in order, each
    ``(flat start, rows, launch index or -1 for rows that see nothing, offset in the
    launch's rows)``."""

    launches: tuple
    rows: tuple
    total_rows: int


def _int32_on(values, device):
    t = torch.tensor(values, dtype=torch.int32)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _coalesce(ranges):
    out = []
    for start, n in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return tuple(out)


def _launch(causal, seqs, Sq, Sk, q_offset) -> Launch:
    q_ranges, k_ranges, slices, cu_q, cu_k = [], [], [], [0], [0]
    for b, q0, q1, k0, k1 in seqs:
        q_ranges.append((b * Sq + q0 - q_offset, q1 - q0))
        k_ranges.append((b * Sk + k0, k1 - k0))
        if slices and slices[-1][0] == b and slices[-1][1] + slices[-1][2] == k0:
            b_, s_, n_, o_ = slices[-1]
            slices[-1] = (b_, s_, n_ + k1 - k0, o_)
        else:
            slices.append((b, k0, k1 - k0, cu_k[-1]))
        cu_q.append(cu_q[-1] + q1 - q0)
        cu_k.append(cu_k[-1] + k1 - k0)
    return Launch(causal, tuple(seqs), _coalesce(q_ranges), _coalesce(k_ranges), tuple(slices),
                  tuple(cu_q), tuple(cu_k), max(q1 - q0 for _, q0, q1, _, _ in seqs),
                  max(k1 - k0 for _, _, _, k0, k1 in seqs))


def plan(layout: Layout, Sq: int, q_offset: int, causal: bool) -> Sequences:
    """The launches of the call whose query rows are ``[q_offset, q_offset + Sq)`` (see the
    module docstring), cached on the layout."""
    key = (Sq, q_offset, bool(causal))
    got = layout._plans.get(key)
    if got is not None:
        return got
    lo, hi, Sk = q_offset, q_offset + Sq, layout.Sk
    own, whole = [], []        # causal sequences; sequences that see all their keys
    for b, runs in enumerate(layout.runs):
        for start, end in runs[layout.first_run(b, lo):] if layout.kind == "packed" else runs:
            if layout.kind == "packed" and start >= hi:
                break
            q0, q1 = max(start, lo), min(end, hi)
            if causal:
                if q0 < q1:
                    own.append((b, q0, q1, start, q1))
                if layout.kind == "padded" and max(end, lo) < hi:
                    whole.append((b, max(end, lo), hi, start, end))
            elif layout.kind == "padded":
                whole.append((b, lo, hi, start, end))
            elif q0 < q1:
                whole.append((b, q0, q1, start, end))
    launches = tuple(_launch(c, s, Sq, Sk, q_offset) for c, s in ((True, own), (False, whole))
                     if s)
    pieces = sorted((b * Sq + q0 - lo, q1 - q0, i, offset)
                    for i, launch in enumerate(launches)
                    for (b, q0, q1, _, _), offset in zip(launch.seqs, launch.cu_q))
    rows, at = [], 0
    for start, n, i, offset in pieces:
        if start > at:
            rows.append((at, start - at, -1, 0))
        rows.append((start, n, i, offset))
        at = start + n
    if at < len(layout.runs) * Sq:
        rows.append((at, len(layout.runs) * Sq - at, -1, 0))
    got = layout._plans[key] = Sequences(launches, tuple(rows), len(layout.runs) * Sq)
    return got


# ---- the plumbing ------------------------------------------------------------------------------
# narrow / cat only (no indexing), as attention_route's adapters: they also run on fake CUDA
# tensors in a CPU-only torch.
def _flat_rows(t):
    """(B, H, S, D) -> (B * S, H, D) with a unit last stride (a view when t is laid out
    (B, S, H, D))."""
    B, H, S, D = t.shape
    return t.transpose(1, 2).reshape(B * S, H, D)


def _gather(flat, ranges, dim=0):
    parts = [flat.narrow(dim, start, n) for start, n in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _assemble(parts, seqs: Sequences, fill, dim=0):
    """The call's rows in order from each launch's rows (``parts[i]``, rows along ``dim``),
    ``fill(n)`` for the rows that see nothing."""
    pieces = [fill(n) if i < 0 else parts[i].narrow(dim, offset, n)
              for _, n, i, offset in seqs.rows]
    if not pieces:                # no rows at all (B = 0)
        return fill(0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def varlen_fwd(adapter, q, k, v, seqs: Sequences, scale, window=None):
    """The forward of a padded or packed call through ``adapter.varlen_fwd``: out (B, Hq, Sq,
    D) laid out (B, Sq, Hq, D), lse (B, Hq, Sq) contiguous in fp32 (fp64 for fp64 inputs);
    rows that see nothing: out 0, lse -inf."""
    B, Hq, Sq, D = q.shape
    qf, kf, vf = _flat_rows(q), _flat_rows(k), _flat_rows(v)
    outs, lses = [], []
    wdt = _stat_dtype(q)
    for launch in seqs.launches:
        cu_q, cu_k = launch.cu(q.device)
        out, lse = adapter.varlen_fwd(_gather(qf, launch.q_ranges), _gather(kf, launch.k_ranges),
                                      _gather(vf, launch.k_ranges), cu_q, cu_k, launch.max_q,
                                      launch.max_k, launch.causal, scale, window)
        outs.append(out)
        lses.append(lse.to(wdt))
    out = _assemble(outs, seqs, lambda n: q.new_zeros((n, Hq, D)))
    lse = _assemble(lses, seqs, lambda n: torch.full((Hq, n), float("-inf"), dtype=wdt,
                                                     device=q.device), dim=1)
    return (out.view(B, Sq, Hq, D).transpose(1, 2),
            lse.view(Hq, B, Sq).permute(1, 0, 2).contiguous())


def varlen_bwd(adapter, dout, q, k, v, out, lse, seqs: Sequences, scale, window=None,
               dk_acc=None, dv_acc=None, deterministic=False):
    """The backward of a padded or packed call through ``adapter.varlen_bwd``, given the
    forward's out and lse: (dq, dk, dv) as attention_bwd returns them (dk / dv added into
    dk_acc / dv_acc when given, and then (0,) placeholders)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    qf, kf, vf, of, df = (_flat_rows(t) for t in (q, k, v, out, dout))
    lse_rows = lse.to(_stat_dtype(q)).permute(1, 0, 2).reshape(Hq, B * Sq)
    accumulate = dk_acc is not None
    if not accumulate:
        dk_acc, dv_acc = (torch.zeros((B, Sk, Hkv, D), dtype=_stat_dtype(k), device=q.device)
                          .transpose(1, 2) for _ in range(2))
    dqs = []
    for launch in seqs.launches:
        cu_q, cu_k = launch.cu(q.device)
        dq, dk, dv = adapter.varlen_bwd(
            _gather(df, launch.q_ranges), _gather(qf, launch.q_ranges),
            _gather(kf, launch.k_ranges), _gather(vf, launch.k_ranges),
            _gather(of, launch.q_ranges), _gather(lse_rows, launch.q_ranges, 1).contiguous(),
            cu_q, cu_k, launch.max_q, launch.max_k, launch.causal, scale, window, deterministic)
        dqs.append(dq)
        for b, k0, n, offset in launch.key_slices:
            dk_acc.select(0, b).narrow(1, k0, n).add_(dk.narrow(0, offset, n).transpose(0, 1))
            dv_acc.select(0, b).narrow(1, k0, n).add_(dv.narrow(0, offset, n).transpose(0, 1))
    dq = _assemble(dqs, seqs, lambda n: q.new_zeros((n, Hq, D)))
    dq = dq.to(q.dtype).view(B, Sq, Hq, D).transpose(1, 2)
    if accumulate:
        return (dq, torch.empty((0,), dtype=k.dtype, device=q.device),
                torch.empty((0,), dtype=v.dtype, device=q.device))

    def laid(acc, like):
        return acc.transpose(1, 2).to(like.dtype).transpose(1, 2)
    return dq, laid(dk_acc, k), laid(dv_acc, v)

