"""Which kernel serves each attention call on CUDA: the Triton kernels or one of torch's SDPA
aten ops, and the plumbing that makes an SDPA op compute exactly what the call asks.

The CUDA implementations of ``ckpt_ext::attention_fwd`` / ``attention_bwd`` are
:func:`attention_fwd` / :func:`attention_bwd` here (registered by ``ckpt_ext._backend``): each
call is described by a :class:`Call`, a backend is chosen for it (:func:`choose`), and the
call goes to the Triton launcher of ``ckpt_ext.kernels.attention`` or to a vendor adapter:

* ``flash``: ``aten._flash_attention_forward`` / ``_backward`` (FlashAttention-2 in torch),
  (B, S, H, D) operands, GQA K/V unexpanded, causal bottom-right aligned when Sq < Sk, the
  causal sliding window through ``window_size_left``; fp16 / bf16; head_dim a multiple of 8
  up to 256 (192 on sm86 / sm89, whose backward stops there).
* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` / ``_backward``, (B, H, S, D)
  operands, GQA unexpanded, causal only top-left (a query chunk is split, see below); lse
  (B, H, S, 1); fp16 / bf16; head_dim a multiple of 8 up to 128.
* ``efficient``: ``aten._efficient_attention_forward`` / ``_backward`` (the CUTLASS kernels
  behind SDPA's memory-efficient backend), (B, S, H, D) operands, causal bottom-right through
  its mask type 2; GQA K/V expanded to Hq heads (copies, refused beyond 2 GiB of them) and
  dK/dV summed back over each group in fp32; lse padded to a multiple of 32 rows; fp16 / bf16
  / fp32.

Rules (:func:`refusals`). A vendor op serves a call only when it computes exactly what the
call asks: the dtype and head_dim above; no softcap; a window only on ``flash`` and only
causal; and never a call whose rows can see nothing (Sk = 0): the vendor kernels give NaN
there, where the op's contract is out 0, lse -inf, zero gradients. With none of the masks
every causal row sees at least its own key, so no other row can be empty. A key_padding_mask
or segment_ids go only to ``flash``'s variable-length op (``ckpt_ext.attention_varlen``), and
only when their shape allows it: ids that never decrease along a row (packed documents), or
one run of real keys per row (padding), one of the two, no window with a padding mask. Which
of these holds is read from the masks (one host sync per mask tensor) only when a vendor
backend would otherwise serve the call; rows that see nothing never reach the vendor op.
Determinism follows torch's convention. Under ``attention_dq = "auto"`` (the default) a
backward reads :func:`ckpt_ext.config.determinism` (torch's flag, or what
``ops.attention(deterministic=)`` asked) at each call: with the flag off the fastest backward
the table names serves (cuDNN's, flash's and efficient's fastest variants, Triton's
``atomic`` dQ: not bit-reproducible); with ``torch.use_deterministic_algorithms(True)`` only
deterministic ones (Triton ``separate`` or ``ordered``; ``flash`` running FlashAttention-2's
deterministic backward, ``efficient`` with ``num_splits_key=1`` (one program walks all key
blocks of a head, dQ summed in a fixed order); ``cudnn`` never), as torch's SDPA backwards do;
with ``warn_only=True`` the fastest, and one warning per process when it is not deterministic
(:func:`warn_if_not_deterministic`). Under an explicit ``"separate"`` or ``"ordered"`` a vendor
backward serves only in its deterministic variant, under ``"atomic"`` any; a pinned backend
serves as asked (a pinned cuDNN backward under "auto" with the flag on raises). torch selects
FlashAttention-2's deterministic backward by its process-wide flag alone, so the adapter turns
it on around the one aten call (:func:`deterministic_torch`).

Query chunks (Sq < Sk with q_offset, the sequence-tiled layer's calls). Causal rows see no key
past q_offset + Sq, so the keys are cut there. A backend with a bottom-right causal alignment
(flash, efficient) then serves the chunk with one causal call. Elsewhere (cudnn) the chunk is
two calls merged by their lse: non-causal on the earlier keys [0, q_offset), causal on the
chunk's own keys [q_offset, q_offset + Sq) (a square, where top-left and bottom-right agree):
``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b`` in
fp32. The backward runs each piece's backward with the *merged* out and lse: P = exp(s - lse)
is then each piece's share of the whole row's softmax and D = rowsum(dO * O) the whole row's,
so dQ = dQ_a + dQ_b and the pieces' dK / dV are exactly those of the whole call. dK / dV add
into the layer's fp32 accumulators (dk_acc / dv_acc) in fp32.

Choice. The ``attention_backend`` setting (``CKPT_EXT_ATTN_BACKEND``): ``"auto"`` (default)
reads the choice table, ``"triton"`` / ``"flash"`` / ``"cudnn"`` / ``"efficient"`` pin one
backend; a pinned vendor backend that cannot serve a call raises :class:`BackendRefused`
naming the rules it lacks. The table (:class:`Table`, JSON) maps shape buckets to an ordered
list of backends, fastest first; the first that may serve the call wins, Triton otherwise.
In format 2 a backward's list names Triton per dQ mode (``triton:separate``,
``triton:ordered``, ``triton:atomic``) and holds every backend measured, so that its first
entry is the fastest backward and its first deterministic entry the fastest deterministic
one; format-1 lists name ``triton`` once (read as ``triton:separate``, the mode they were
measured in) and end at it. The shipped
table (``attention_backends.json`` beside this module) holds the rules of one H200 run
(bench/results/gpu_h200_2026-11-27/quick_d_attention.txt: sm90, bf16, head_dim 128, causal,
unmasked and packed calls; its ``note`` and ``measured`` say what ran); every other call goes
to Triton. The ``attention_table`` setting (``CKPT_EXT_ATTN_TABLE``) names another file
(``bench/attention.py --backend-rows --write-table`` writes one from its measurements,
``--from-csv`` from the CSV of an earlier run). Nothing is
measured at run time. Calls on CPU tensors never come here (the ATen kernels serve them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import threading
import warnings
from typing import Callable, Optional

import torch

from . import _checks, attention_varlen, config

__all__ = ["BACKENDS", "DQ_MODES", "BackendRefused", "Call", "Capabilities", "Table", "choose",
           "select", "Selection", "triton_dq_mode", "refusals", "entry", "attention_fwd",
           "attention_bwd", "vendor_fwd", "vendor_bwd", "merge", "load_table", "current_table",
           "cuda_capabilities", "ADAPTERS"]

BACKENDS = ("triton", "flash", "cudnn", "efficient")
VENDOR = BACKENDS[1:]
# The Triton backward's dQ modes (the attention_dq values other than "auto"), and the table's
# name for Triton's backward in each: "triton:separate" etc.; a bare "triton" is
# "triton:separate" (the mode format-1 tables were measured in; a forward has no dQ mode).
DQ_MODES = ("separate", "ordered", "atomic")
TRITON_ENTRIES = tuple(f"triton:{m}" for m in DQ_MODES)
SHIPPED_TABLE = pathlib.Path(__file__).with_name("attention_backends.json")
TABLE_FORMAT = "ckpt_ext attention backend table 2"
TABLE_FORMATS = ("ckpt_ext attention backend table 1", TABLE_FORMAT)

# The aten namespace the adapters call through, looked up at each call: tests put a recorder
# in its place to check the arguments handed to the ops.
aten = torch.ops.aten

_HALF = frozenset((torch.float16, torch.bfloat16))
_ELEMENT_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                torch.float64: "fp64"}


class BackendRefused(RuntimeError):
    """A pinned attention backend cannot serve a call; the message names the rules it lacks."""


# ---- the call ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Call:
    """What the choice needs to know of one attention_fwd / attention_bwd call."""

    phase: str                 # "fwd" or "bwd"
    dtype: torch.dtype
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    causal: bool
    q_offset: int = 0
    masked: bool = False       # a key_padding_mask is given
    segments: bool = False     # segment_ids are given
    window: Optional[int] = None
    softcap: float = 0.0
    # why the masks' shape keeps the call off the variable-length op (None: it does not, or
    # the masks were not read; see ckpt_ext.attention_varlen.describe)
    masks_refusal: Optional[str] = None

    @classmethod
    def of(cls, phase, q, k, key_padding_mask, segment_ids, window, causal, q_offset=0,
           softcap=0.0) -> "Call":
        B, Hq, Sq, D = q.shape
        return cls(phase, q.dtype, B, Hq, k.shape[1], Sq, k.shape[2], D, bool(causal),
                   int(q_offset), key_padding_mask is not None, segment_ids is not None,
                   window, float(softcap))

    @property
    def keys(self) -> int:
        """The keys any row can see: a causal row sees none past q_offset + Sq."""
        return self.q_offset + self.Sq if self.causal else self.Sk

    @property
    def live_window(self) -> Optional[int]:
        """The window, or None where it hides nothing (window >= the keys seen)."""
        return self.window if self.window is not None and self.window < self.keys else None

    @property
    def masks(self) -> str:
        """The table's name for the call's masks: "none", "padded", "packed" or "both"."""
        return {(False, False): "none", (True, False): "padded", (False, True): "packed",
                (True, True): "both"}[(self.masked, self.segments)]

    @property
    def chunk(self) -> bool:
        """A causal query chunk after the sequence's first keys: it needs a bottom-right
        causal alignment, or the split into two calls."""
        return self.causal and self.q_offset > 0


# ---- what the device and this torch offer --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The vendor backends a device and this torch offer, and their limits. Built for a CUDA
    device by :func:`cuda_capabilities`; tests build their own."""

    arch: str                              # e.g. "sm90": the table's bucket key
    backends: frozenset                    # vendor backends available here
    dtypes: dict                           # backend -> frozenset of dtypes it takes
    max_head_dim: dict                     # backend -> largest head_dim
    bottom_right: frozenset = frozenset(("flash", "efficient"))   # causal Sq < Sk aligned right
    window: frozenset = frozenset()        # backends serving the causal sliding window
    # backends whose adapters run a deterministic backward when asked (efficient: with
    # num_splits_key=1; flash: FlashAttention-2's, under torch's deterministic flag)
    deterministic_bwd: frozenset = frozenset(("efficient", "flash"))
    # backends that take GQA K/V as they are; the others get copies expanded to Hq heads, up
    # to this many bytes of expanded K and V together
    native_gqa: frozenset = frozenset(("flash", "cudnn"))
    expand_limit_bytes: int = 2 << 30
    # backends serving padded and packed calls through a variable-length op
    varlen: frozenset = frozenset(("flash",))



# A device where only Triton serves (the arch is replaced where a table is read).
_TRITON_ONLY = Capabilities(arch="", backends=frozenset(), dtypes={}, max_head_dim={})

_caps_cache: dict = {}
_caps_lock = threading.Lock()


def cuda_capabilities(device: torch.device) -> Capabilities:
    """The capabilities of a CUDA device under this torch (cached per device index). Every
    limit here is what torch's SDPA documents or checks for its backends; the GPU tests of
    tests/test_attention_route.py check them against the real ops."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    caps = _caps_cache.get(index)
    if caps is not None:
        return caps
    major, minor = torch.cuda.get_device_capability(index)
    have = set()
    if (major, minor) >= (8, 0):
        if hasattr(aten, "_flash_attention_forward") and _flash_built():
            have.add("flash")
        if (hasattr(aten, "_scaled_dot_product_cudnn_attention")
                and torch.backends.cudnn.is_available()
                and (torch.backends.cudnn.version() or 0) >= 90000):
            have.add("cudnn")
    if (major, minor) >= (5, 0) and hasattr(aten, "_efficient_attention_forward"):
        have.add("efficient")
    efficient_dtypes = {torch.float16, torch.float32}
    if (major, minor) >= (8, 0):
        efficient_dtypes.add(torch.bfloat16)
    window = set()
    if "flash" in have and "window_size_left" in str(aten._flash_attention_forward.default._schema):
        window.add("flash")
    caps = Capabilities(
        arch=f"sm{major}{minor}", backends=frozenset(have),
        dtypes={"flash": _HALF, "cudnn": _HALF, "efficient": frozenset(efficient_dtypes)},
        # FlashAttention-2's backward stops at head_dim 192 on sm86 / sm89 (shared memory).
        max_head_dim={"flash": 192 if (major, minor) in ((8, 6), (8, 9)) else 256,
                      "cudnn": 128, "efficient": 256},
        window=frozenset(window), varlen=frozenset(("flash",)) & frozenset(have))
    with _caps_lock:
        _caps_cache[index] = caps
    return caps


def _flash_built() -> bool:
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(probe()) if probe is not None else True


# ---- the rules ---------------------------------------------------------------------------------
_NAMES = {"flash": "flash (aten._flash_attention_forward)",
          "cudnn": "cudnn (aten._scaled_dot_product_cudnn_attention)",
          "efficient": "efficient (aten._efficient_attention_forward)"}


def refusals(backend: str, call: Call, caps: Capabilities) -> list:
    """The rules of this call that ``backend`` cannot serve exactly (empty: it can). Determinism
    is not among them (:func:`choose` applies it)."""
    if backend == "triton":
        return []
    if backend not in VENDOR:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    out = []
    if backend not in caps.backends:
        out.append(f"availability: {backend} is not available on this device ({caps.arch}) "
                   f"with this torch")
    if call.dtype not in caps.dtypes.get(backend, ()):
        takes = ", ".join(sorted(_DTYPE_NAMES.get(d, str(d)) for d in
                                 caps.dtypes.get(backend, ())))
        out.append(f"dtype: {backend} takes {takes or 'nothing here'}, the call is "
                   f"{_DTYPE_NAMES.get(call.dtype, call.dtype)}")
    multiple = 4 if call.dtype == torch.float32 else 8
    limit = caps.max_head_dim.get(backend, 0)
    if call.D % multiple or call.D > limit:
        out.append(f"head_dim: {backend} takes multiples of {multiple} up to {limit}, the call "
                   f"has {call.D}")
    if call.masked or call.segments:
        what = {"padded": "key_padding_mask", "packed": "segment_ids",
                "both": "key_padding_mask with segment_ids"}[call.masks]
        if backend not in caps.varlen:
            out.append(f"{what}: {backend} has no variable-length op (padded and packed rows go "
                       f"to {' or '.join(sorted(caps.varlen)) or 'none here'}, else to Triton)")
        elif call.masks == "both":
            out.append(f"{what}: the variable-length op takes one of them")
        elif call.masked and call.live_window is not None:
            out.append("window with key_padding_mask: the rows after the real keys would need "
                       "a windowed non-causal launch")
        if call.masks_refusal is not None and backend in caps.varlen:
            out.append(f"{what}: {call.masks_refusal}")
    if call.softcap > 0:
        out.append(f"softcap: {backend} has no logit soft-capping")
    if call.Hq != call.Hkv and backend not in caps.native_gqa:
        copy = 2 * call.B * call.keys * call.Hq * call.D * _ELEMENT_BYTES.get(call.dtype, 8)
        if copy > caps.expand_limit_bytes:
            out.append(f"gqa: {backend} takes K/V with Hq heads, and expanding these "
                       f"({call.Hkv} -> {call.Hq} heads) would copy {copy / 2**30:.2f} GiB "
                       f"(limit {caps.expand_limit_bytes / 2**30:.2f} GiB)")
    if call.live_window is not None and not (call.causal and backend in caps.window):
        out.append(f"window: {backend} has no "
                   f"{'causal ' if call.causal else 'non-causal '}sliding window")
    if call.Sq > 0 and call.keys == 0:
        out.append(f"empty rows: every row sees no key (Sk = 0), where {backend} gives NaN "
                   f"and the op gives out 0, lse -inf")
    return out


def entry(name: str) -> tuple:
    """(backend, dQ mode) of a table entry: ("triton", mode) for "triton:<mode>", ("triton",
    "separate") for a bare "triton", (vendor, None) for a vendor backend."""
    if name == "triton":
        return ("triton", "separate")
    if name.startswith("triton:"):
        return ("triton", name[len("triton:"):])
    return (name, None)


@dataclasses.dataclass(frozen=True)
class Selection:
    """What serves one call (:func:`select`): the ``backend``; for a backward, Triton's dQ
    mode (``dq_mode``, None elsewhere) and whether the backward is bit-reproducible
    (``deterministic``: a vendor adapter is asked for its deterministic variant)."""

    backend: str
    dq_mode: Optional[str] = None
    deterministic: bool = True

    @property
    def name(self) -> str:
        """The table's name for it: "triton:<mode>" for a Triton backward."""
        return f"triton:{self.dq_mode}" if self.dq_mode else self.backend


def select(call: Call, caps: Capabilities, setting: str = "auto", table: "Table" = None,
           dq_setting: str = "separate", determinism: str = "off") -> Selection:
    """What serves ``call``. ``setting`` is the attention_backend setting, ``dq_setting`` the
    attention_dq one and ``determinism`` what the backward must be under ``dq_setting``
    "auto" (``config.determinism()``: "off", "warn" or "strict").

    With ``setting`` "auto" the table's preference list for the call's bucket (:func:`entry`
    names) decides: the first backend that may serve the call (:func:`refusals`), else
    Triton. A backward then depends on the dQ setting:

    * "auto", determinism "off" or "warn": the first entry that may serve, whichever it is
      (the fastest backward measured; a vendor runs its fastest variant, a Triton entry names
      its dQ mode);
    * "auto", determinism "strict": the first deterministic one (not cudnn, not
      triton:atomic; flash and efficient in their deterministic variant), Triton "separate"
      if the list has none;
    * an explicit mode, "separate", "ordered" or "atomic": Triton's place in the list is that
      mode's entry (the first Triton entry when the list has none of it), the vendors before
      it tried, only deterministic ones under "separate" and "ordered".

    A pinned vendor backend that cannot serve the call raises BackendRefused, and so does a
    pinned cudnn backward under "auto" with determinism "strict" (torch's flag takes cuDNN's
    backward out of SDPA's choice too); a pinned "triton" backward under "auto" takes the
    dQ mode of the list's first Triton entry the determinism allows."""
    backward = call.phase == "bwd"
    auto = dq_setting == "auto"
    strict = (determinism == "strict") if auto else dq_setting in config.DETERMINISTIC_DQ

    def triton(mode):
        if not backward:
            return Selection("triton")
        return Selection("triton", mode, mode in config.DETERMINISTIC_DQ)

    if setting == "triton" or call.Sq == 0:  # Sq 0: nothing to compute, Triton's empty path
        if not auto or not backward or call.Sq == 0:
            return triton("separate" if auto else dq_setting)
        setting, caps = "auto", dataclasses.replace(_TRITON_ONLY, arch=caps.arch)
    if setting != "auto":
        lacking = refusals(setting, call, caps)
        if backward and auto and strict and setting not in caps.deterministic_bwd:
            lacking.append(f"determinism: {setting} has no deterministic backward, and "
                           f"torch.use_deterministic_algorithms(True) is set (attention_dq "
                           f"'auto')")
        if lacking:
            raise BackendRefused(
                f"ckpt_ext attention: the pinned backend {_NAMES.get(setting, setting)} "
                f"(attention_backend / CKPT_EXT_ATTN_BACKEND) cannot serve this "
                f"{call.phase} call (B={call.B}, Hq={call.Hq}, Hkv={call.Hkv}, Sq={call.Sq}, "
                f"Sk={call.Sk}, D={call.D}, causal={call.causal}, q_offset={call.q_offset}): "
                + "; ".join(lacking) + ". Set attention_backend='auto' or 'triton' for it.")
        return Selection(setting, None, strict and setting in caps.deterministic_bwd)
    table = current_table() if table is None else table
    names = [entry(e) for e in table.lookup(call, caps.arch)]
    if not backward or not auto:
        tritons = [i for i, (b, _) in enumerate(names) if b == "triton"]
        at = next((i for i in tritons if names[i][1] == dq_setting or not backward),
                  tritons[0] if tritons else len(names))
        # Triton at its place, in the setting's mode; its other entries are not its place
        names = [n for n in names[:at] if n[0] != "triton"] + [("triton", dq_setting)]
    for backend, mode in names:
        if backend == "triton":
            if auto and strict and mode not in config.DETERMINISTIC_DQ:
                continue
            return triton(mode)
        if refusals(backend, call, caps):
            continue
        if backward and strict and backend not in caps.deterministic_bwd:
            continue
        return Selection(backend, None, not backward or strict)
    return triton("separate" if auto else dq_setting)


def choose(call: Call, caps: Capabilities, setting: str = "auto", table: "Table" = None,
           dq_mode: str = "separate", determinism: str = "off") -> str:
    """The backend serving ``call`` (:func:`select`'s, with ``dq_mode`` the attention_dq
    setting)."""
    return select(call, caps, setting, table, dq_mode, determinism).backend


_warned = threading.Event()


def warn_if_not_deterministic(chosen: Selection, determinism: str) -> None:
    """Under ``torch.use_deterministic_algorithms(True, warn_only=True)`` (determinism
    "warn") a backward that is not bit-reproducible runs, as torch's own kernels do, and
    warns once per process naming the op and what ran."""
    if determinism != "warn" or chosen.deterministic or _warned.is_set():
        return
    _warned.set()
    warnings.warn(
        f"ckpt_ext::attention_bwd ran a backward that is not deterministic ({chosen.name}), "
        f"with torch.use_deterministic_algorithms(True, warn_only=True) set. Under "
        f"attention_dq='auto' warn_only keeps the fastest backward and warns once; without "
        f"warn_only only deterministic backwards serve, and attention_dq='separate' or "
        f"'ordered' (or ops.attention(deterministic=True)) asks for one.", UserWarning,
        stacklevel=3)


def triton_dq_mode(call: Call, arch: str, table: "Table" = None) -> str:
    """How a Triton backward of ``call`` on a device of ``arch`` forms dQ: the attention_dq
    setting, or under "auto" the dQ mode the table's list for the call names first among
    those torch's determinism flag allows (:func:`select` with Triton pinned; "separate"
    where the list names none), warning once under warn_only when it is "atomic". The
    Triton launcher asks at each backward; the router reaches the same mode, Triton's
    entries coming in its list in the same order."""
    settings = config.current()
    if settings.attention_dq != "auto":
        return settings.attention_dq
    determinism = config.determinism()
    chosen = select(call, dataclasses.replace(_TRITON_ONLY, arch=arch), "triton", table,
                    "auto", determinism)
    warn_if_not_deterministic(chosen, determinism)
    return chosen.dq_mode


# ---- the choice table --------------------------------------------------------------------------
_EXACT_KEYS = {"arch": str, "dtype": str, "head_dim": int, "causal": bool, "chunk": bool,
               "phase": str, "gqa": int, "masks": str}
MASKS = ("none", "padded", "packed", "both")
_RANGE_KEYS = ("sq", "keys", "bh")   # query rows, keys seen, B * Hq


def _bucket(call: Call, arch: str) -> dict:
    return {"arch": arch, "dtype": _DTYPE_NAMES.get(call.dtype, str(call.dtype)),
            "head_dim": call.D, "causal": call.causal, "chunk": call.chunk,
            "phase": call.phase, "gqa": call.Hq // max(call.Hkv, 1), "masks": call.masks,
            "sq": call.Sq, "keys": call.keys, "bh": call.B * call.Hq}


@dataclasses.dataclass(frozen=True)
class Table:
    """An ordered list of rules: each a dict of bucket constraints (exact ``arch``, ``dtype``,
    ``head_dim``, ``causal``, ``chunk``, ``phase``, ``gqa``, ``masks`` (one of
    :data:`MASKS`); inclusive ranges ``sq_min`` / ``sq_max``, ``keys_min`` / ``keys_max``,
    ``bh_min`` / ``bh_max``; an absent key matches anything) and ``backends``, the preference
    order for the calls it matches (backend names, and in format 2 Triton per dQ mode:
    :func:`entry`). The first matching rule decides; no match: ``default``."""

    rules: tuple = ()
    default: tuple = ("triton",)
    source: str = ""

    @property
    def always_triton(self) -> bool:
        return not self.rules and entry(self.default[0])[0] == "triton"

    @functools.cached_property
    def _arches(self) -> Optional[frozenset]:
        """The arches the rules name (None: a rule without ``arch`` matches any device)."""
        if any("arch" not in rule for rule in self.rules):
            return None
        return frozenset(rule["arch"] for rule in self.rules)

    def triton_only_on(self, arch: str) -> bool:
        """Whether every call on a device of ``arch`` goes to Triton: no rule names that arch
        (nor leaves it out) and the default starts with Triton."""
        return entry(self.default[0])[0] == "triton" and (
            self._arches is not None and arch not in self._arches)

    def lookup(self, call: Call, arch: str) -> tuple:
        bucket = _bucket(call, arch)
        for rule in self.rules:
            if all(_matches(bucket, key, want) for key, want in rule.items()
                   if key != "backends"):
                return rule["backends"]
        return self.default

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> "Table":
        where = source or "attention backend table"

        def bad(why):
            return ValueError(f"{where}: {why}")

        if not isinstance(data, dict) or data.get("format") not in TABLE_FORMATS:
            raise bad(f"not an attention backend table (format must be one of "
                      f"{TABLE_FORMATS})")
        # format 1 names Triton once ("triton", measured under "separate"); format 2 also per
        # dQ mode
        known = BACKENDS + (TRITON_ENTRIES if data["format"] == TABLE_FORMAT else ())

        def backends(value, what):
            names = [value] if isinstance(value, str) else value
            if (not isinstance(names, list) or not names
                    or any(n not in known for n in names)):
                raise bad(f"{what} must be a backend or a list of backends among {known}, "
                          f"got {value!r}")
            return tuple(names)

        rules = []
        for i, rule in enumerate(data.get("rules", [])):
            if not isinstance(rule, dict) or "backends" not in rule:
                raise bad(f"rule {i} must be an object with 'backends'")
            checked = {"backends": backends(rule["backends"], f"rule {i}: backends")}
            for key, want in rule.items():
                if key == "backends":
                    continue
                if key in _EXACT_KEYS:
                    kind = _EXACT_KEYS[key]
                    if type(want) is not kind:
                        raise bad(f"rule {i}: {key} must be a {kind.__name__}, got {want!r}")
                    if key == "masks" and want not in MASKS:
                        raise bad(f"rule {i}: masks must be one of {MASKS}, got {want!r}")
                elif key.endswith(("_min", "_max")) and key[:-4] in _RANGE_KEYS:
                    if type(want) is not int:
                        raise bad(f"rule {i}: {key} must be an int, got {want!r}")
                else:
                    known = list(_EXACT_KEYS) + [f"{r}_{end}" for r in _RANGE_KEYS
                                                 for end in ("min", "max")]
                    raise bad(f"rule {i}: unknown key {key!r} (keys: {', '.join(known)})")
                checked[key] = want
            rules.append(checked)
        default = backends(data.get("default", "triton"), "default")
        return cls(tuple(rules), default, source)


def _matches(bucket, key, want) -> bool:
    if key.endswith("_min"):
        return bucket[key[:-4]] >= want
    if key.endswith("_max"):
        return bucket[key[:-4]] <= want
    return bucket[key] == want


def load_table(path) -> Table:
    """Read and check a table file (ValueError naming the file if it is not one)."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the attention backend table: {exc}") from exc
    return Table.from_dict(data, str(path))


_tables: dict = {}


def current_table() -> Table:
    """The table the ``attention_table`` setting names (the shipped one when empty), read
    once per path (:func:`forget_tables` reads again)."""
    path = config.current().attention_table or str(SHIPPED_TABLE)
    table = _tables.get(path)
    if table is None:
        table = _tables[path] = load_table(path)
    return table


def forget_tables() -> None:
    """Read the table files again at the next call (after a GPU run rewrote one)."""
    _tables.clear()


# ---- plumbing shared by the adapters -----------------------------------------------------------
# Written with narrow / cat / clone rather than indexing and copy_, which also run on fake CUDA
# tensors in a CPU-only torch (the tests check the plumbing so).
def _contiguous(t):
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def _rows_last(t):
    """A (B, H, S, D) view as (B, S, H, D) with a contiguous last dimension (copied only if
    it is not)."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else _contiguous(t)


def _bshd(t):
    """(B, H, S, D) -> (B, S, H, D) contiguous (no copy when it is laid out so already)."""
    return _contiguous(t.transpose(1, 2))


def _as_bshd_layout(t):
    """t (B, H, S, D) laid out (B, S, H, D) in memory, as the op returns its results."""
    return _bshd(t).transpose(1, 2)


def _work_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_sum(t, Hkv):
    """(B, Hq, S, D) gradients of expanded K/V -> (B, Hkv, S, D), each KV head's query group
    summed in fp32 (fp64 stays)."""
    B, Hq, S, D = t.shape
    if Hq == Hkv:
        return t
    return t.to(_work_dtype(t.dtype)).view(B, Hkv, Hq // Hkv, S, D).sum(2)


def _expand_kv(t, Hq):
    """(B, Hkv, S, D) -> (B, Hq, S, D), query head h reading KV head h // (Hq // Hkv); a copy
    laid out (B, S, Hq, D)."""
    B, Hkv, S, D = t.shape
    if Hkv == Hq:
        return t
    rows = t.transpose(1, 2).unsqueeze(3).expand(B, S, Hkv, Hq // Hkv, D)
    return rows.reshape(B, S, Hq, D).transpose(1, 2)


# ---- the vendor adapters -----------------------------------------------------------------------
_flag_lock = threading.Lock()


@contextlib.contextmanager
def deterministic_torch(on: bool):
    """``torch.use_deterministic_algorithms(True)`` (without warn_only) for the block when
    ``on`` and it is not in force already: FlashAttention-2's backward in torch is
    deterministic under that flag and under nothing else. The flag is process-wide, so the
    block holds one aten call and restores the user's setting after it, under a lock (two
    threads of this module never interleave their restores); another thread's CUDA op that
    runs meanwhile sees the flag too."""
    if not on or (torch.are_deterministic_algorithms_enabled()
                  and not torch.is_deterministic_algorithms_warn_only_enabled()):
        yield
        return
    with _flag_lock:
        before = (torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# Each adapter computes one call with no q_offset: fwd(q, k, v, causal, scale, window) ->
# (out (B, Hq, Sq, D), lse (B, Hq, Sq) in the natural log), causal with Sq < Sk only where
# ``bottom_right``; bwd(dout, q, k, v, out, lse, causal, scale, window, deterministic) ->
# (dq, dk, dv) with dk / dv (B, Hkv, Sk, D) (in fp32 where a GQA group was summed).
class FlashAdapter:
    name = "flash"
    bottom_right = True

    @staticmethod
    def _window(causal, window):
        if window is None:
            return {}
        return {"window_size_left": window - 1, "window_size_right": 0 if causal else window - 1}

    def fwd(self, q, k, v, causal, scale, window=None):
        Sq, Sk = q.shape[2], k.shape[2]
        out, lse = aten._flash_attention_forward(
            _rows_last(q), _rows_last(k), _rows_last(v), None, None, Sq, Sk, 0.0, bool(causal),
            False, scale=float(scale), **self._window(causal, window))[:2]
        return out.transpose(1, 2), lse

    def _aten_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                  window, deterministic):
        """aten's FlashAttention-2 backward without dropout (dense: cu_q, cu_k None)."""
        rng = torch.zeros((2,), dtype=torch.uint64, device=q.device)     # dropout 0: unused
        unused = torch.zeros((), dtype=torch.uint64, device=q.device)
        with deterministic_torch(deterministic):
            return aten._flash_attention_backward(
                dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, bool(causal), rng,
                unused, scale=float(scale), **self._window(causal, window))

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None, deterministic=False):
        dq, dk, dv = self._aten_bwd(_bshd(dout), _rows_last(q), _rows_last(k), _rows_last(v),
                                    _bshd(out), lse.contiguous(), None, None, q.shape[2],
                                    k.shape[2], causal, scale, window, deterministic)
        Hkv = k.shape[1]
        return (dq.transpose(1, 2), _group_sum(dk.transpose(1, 2), Hkv),
                _group_sum(dv.transpose(1, 2), Hkv))

    # The variable-length entry points (ckpt_ext.attention_varlen): q (Tq, Hq, D), k / v
    # (Tk, Hkv, D), the sequences' int32 cumulative lengths; lse (Hq, Tq).
    def varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
        out, lse = aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, bool(causal), False, scale=float(scale),
            **self._window(causal, window))[:2]
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"flash (aten._flash_attention_forward): the variable-length "
                               f"lse came as {tuple(lse.shape)}, not (Hq, Tq) = "
                               f"{(q.shape[1], q.shape[0])}; this torch's layout is not "
                               f"supported (set attention_backend='triton')")
        return out, lse

    def varlen_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                   window=None, deterministic=False):
        dq, dk, dv = self._aten_bwd(_contiguous(dout), q, k, v, _contiguous(out),
                                    lse.contiguous(), cu_q, cu_k, max_q, max_k, causal, scale,
                                    window, deterministic)
        Tk, Hkv, D = k.shape
        if dk.shape[1] != Hkv:   # Hq-headed: each KV head's query group summed in fp32
            dk, dv = (t.to(_work_dtype(t.dtype)).view(Tk, Hkv, -1, D).sum(2) for t in (dk, dv))
        return dq, dk, dv


class CudnnAdapter:
    name = "cudnn"
    bottom_right = False

    def fwd(self, q, k, v, causal, scale, window=None):
        assert window is None, "cudnn serves no window"
        q, k, v = (_rows_last(t).transpose(1, 2) for t in (q, k, v))
        out, lse = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, bool(causal), False, scale=float(scale))[:2]
        return out, lse.reshape(q.shape[:3])        # (B, H, S, 1) -> (B, H, S)

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None, deterministic=False):
        Sq, Sk = q.shape[2], k.shape[2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)       # dropout 0: unused
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        q, k, v = (_rows_last(t).transpose(1, 2) for t in (q, k, v))
        # out and dout in one layout, (B, S, H, D), as the forward returned out.
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            _bshd(dout).transpose(1, 2), q, k, v, _bshd(out).transpose(1, 2),
            lse.contiguous().unsqueeze(-1), seed, offset, None, None, None, Sq, Sk, 0.0,
            bool(causal), scale=float(scale))
        Hkv = k.shape[1]
        return dq, _group_sum(dk, Hkv), _group_sum(dv, Hkv)


class EfficientAdapter:
    name = "efficient"
    bottom_right = True
    LSE_ROWS = 32   # the forward pads lse to a multiple of this many rows

    @staticmethod
    def _mask_type(causal):
        return 2 if causal else 0   # 2: causal aligned bottom-right (top-left when Sq == Sk)

    def fwd(self, q, k, v, causal, scale, window=None):
        assert window is None, "efficient serves no window here"
        Hq, Sq = q.shape[1], q.shape[2]
        k, v = _expand_kv(k, Hq), _expand_kv(v, Hq)
        out, lse = aten._efficient_attention_forward(
            _rows_last(q), _rows_last(k), _rows_last(v), None, None, None, None, None, 0.0,
            self._mask_type(causal), True, scale=float(scale))[:2]
        return out.transpose(1, 2), lse.narrow(2, 0, Sq)

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None, deterministic=False):
        B, Hq, Sq, _ = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        k, v = _expand_kv(k, Hq), _expand_kv(v, Hq)
        rows = -(-Sq // self.LSE_ROWS) * self.LSE_ROWS
        lse_pad = torch.cat([lse.float(), torch.full((B, Hq, rows - Sq), math.inf,
                                                     dtype=torch.float32, device=q.device)], 2)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)       # dropout 0: unused
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._efficient_attention_backward(
            _bshd(dout), _rows_last(q), _rows_last(k), _rows_last(v), None, _bshd(out), None,
            None, Sq, Sk, lse_pad, 0.0, seed, offset, self._mask_type(causal), False,
            scale=float(scale), num_splits_key=1 if deterministic else None)
        return (dq.transpose(1, 2), _group_sum(dk.transpose(1, 2), Hkv),
                _group_sum(dv.transpose(1, 2), Hkv))


ADAPTERS = {"flash": FlashAdapter(), "cudnn": CudnnAdapter(), "efficient": EfficientAdapter()}


# ---- query chunks: one call, or two merged by lse ---------------------------------------------
def merge(out_a, lse_a, out_b, lse_b, dtype):
    """The attention over the union of two disjoint key sets from each set's out and lse
    (every row non-empty in both): (out in ``dtype``, lse in fp32, fp64 for fp64)."""
    wdt = _work_dtype(dtype)
    lse_a, lse_b = lse_a.to(wdt), lse_b.to(wdt)
    lse = torch.logaddexp(lse_a, lse_b)
    out = (out_a.to(wdt) * torch.exp(lse_a - lse).unsqueeze(-1)
           + out_b.to(wdt) * torch.exp(lse_b - lse).unsqueeze(-1))
    return out.to(dtype), lse


def vendor_fwd(adapter, q, k, v, causal, scale, q_offset=0, window=None):
    """The forward of a call with no masks through ``adapter``: (out (B, Hq, Sq, D) laid out
    (B, Sq, Hq, D), lse (B, Hq, Sq) contiguous, fp32 (fp64 for fp64 inputs))."""
    Sq = q.shape[2]
    keys = q_offset + Sq if causal else k.shape[2]
    k, v = k.narrow(2, 0, keys), v.narrow(2, 0, keys)
    if not causal or q_offset == 0 or adapter.bottom_right:
        out, lse = adapter.fwd(q, k, v, causal, scale, window)
        lse = lse.to(_work_dtype(q.dtype))
    else:
        if window is not None:
            raise ValueError(f"{adapter.name}: a windowed query chunk needs a bottom-right "
                             f"causal alignment")
        out_a, lse_a = adapter.fwd(q, k.narrow(2, 0, q_offset), v.narrow(2, 0, q_offset),
                                   False, scale)
        out_b, lse_b = adapter.fwd(q, k.narrow(2, q_offset, Sq), v.narrow(2, q_offset, Sq),
                                   True, scale)
        out, lse = merge(out_a, lse_a, out_b, lse_b, q.dtype)
    return _as_bshd_layout(out), _contiguous(lse)


def vendor_bwd(adapter, dout, q, k, v, out, lse, causal, scale, q_offset=0, window=None,
               dk_acc=None, dv_acc=None, deterministic=False):
    """The backward of a call with no masks through ``adapter``, given the (merged) out and
    lse of the forward: (dq, dk, dv) as attention_bwd returns them (dk / dv added into dk_acc /
    dv_acc when given, and then (0,) placeholders)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    keys = q_offset + Sq if causal else Sk
    k, v = k.narrow(2, 0, keys), v.narrow(2, 0, keys)
    if not causal or q_offset == 0 or adapter.bottom_right:
        dq, dk, dv = adapter.bwd(dout, q, k, v, out, lse, causal, scale, window, deterministic)
        parts = [(0, dk, dv)]
    else:
        if window is not None:
            raise ValueError(f"{adapter.name}: a windowed query chunk needs a bottom-right "
                             f"causal alignment")
        # Each piece's backward with the merged out and lse: its share of the whole gradient.
        dq_a, dk_a, dv_a = adapter.bwd(dout, q, k.narrow(2, 0, q_offset),
                                       v.narrow(2, 0, q_offset), out, lse, False, scale, None,
                                       deterministic)
        dq_b, dk_b, dv_b = adapter.bwd(dout, q, k.narrow(2, q_offset, Sq),
                                       v.narrow(2, q_offset, Sq), out, lse, True, scale, None,
                                       deterministic)
        dq = (dq_a.to(_work_dtype(q.dtype)) + dq_b).to(q.dtype)
        parts = [(0, dk_a, dv_a), (q_offset, dk_b, dv_b)]
    dq = _as_bshd_layout(dq.to(q.dtype))
    if dk_acc is not None:
        for start, dk, dv in parts:
            dk_acc.narrow(2, start, dk.shape[2]).add_(dk)
            dv_acc.narrow(2, start, dv.shape[2]).add_(dv)
        return (dq, torch.empty((0,), dtype=k.dtype, device=q.device),
                torch.empty((0,), dtype=v.dtype, device=q.device))

    def whole(grads, like):
        """The pieces' gradients over the keys in order, zero for the keys no row sees,
        in like's dtype and laid out (B, Sk, Hkv, D)."""
        pieces = [g.to(like.dtype).transpose(1, 2) for g in grads]
        if keys < Sk:
            pieces.append(torch.zeros((B, Sk - keys, Hkv, D), dtype=like.dtype,
                                      device=q.device))
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)
        return _contiguous(joined).transpose(1, 2)

    return dq, whole([p[1] for p in parts], k), whole([p[2] for p in parts], v)


# ---- the registered CUDA implementations -----------------------------------------------------
def _triton_fwd(*args):
    from .kernels import attention
    return attention.attention_fwd(*args)


def _triton_bwd(*args):
    from .kernels import attention
    return attention.attention_bwd(*args)


@dataclasses.dataclass
class Router:
    """The choice and its dispatch, with what it depends on given: ``capabilities(device)``,
    the vendor ``adapters``, and the ``fallback_fwd`` / ``fallback_bwd`` taking the op's
    arguments (the Triton launchers on CUDA; tests pass the ATen CPU ops and CPU adapters)."""

    capabilities: Callable = cuda_capabilities
    adapters: dict = dataclasses.field(default_factory=lambda: ADAPTERS)
    fallback_fwd: Callable = _triton_fwd
    fallback_bwd: Callable = _triton_bwd
    # the masks' runs (attention_varlen.describe; tests of the plumbing on fake tensors, whose
    # data cannot be read, pass their own)
    describe: Callable = attention_varlen.describe
    last: Optional[str] = None   # the backend of the latest call (for tests and benchmarks)

    def _triton_only(self, device) -> bool:
        """Whether every call on ``device`` goes to the fallback under the current settings
        (the setting "triton", or "auto" with a table that names no other backend for this
        device's arch): the calls then go there before any other work."""
        setting = config.current().attention_backend
        if setting == "triton" or (setting == "auto" and current_table().triton_only_on(
                self.capabilities(device).arch)):
            self.last = "triton"
            return True
        return False

    def selection(self, call: Call, device, determinism: str = "off") -> Selection:
        settings = config.current()
        return select(call, self.capabilities(device), settings.attention_backend, None,
                      settings.attention_dq, determinism)

    def backend(self, call: Call, device) -> str:
        return self.selection(call, device).backend

    def _route(self, call: Call, q, key_padding_mask, segment_ids, determinism="off"):
        """(selection, the call's sequences for the variable-length op or None). The masks
        are read only when a vendor backend would serve the call by the rules that need no
        data; if their shape then refuses it, the choice is made again knowing why."""
        chosen = self.selection(call, q.device, determinism)
        self.last = chosen.backend
        if chosen.backend == "triton" or not (call.masked or call.segments):
            return chosen, None
        layout = self.describe(key_padding_mask, segment_ids)
        if isinstance(layout, str):
            chosen = self.selection(dataclasses.replace(call, masks_refusal=layout), q.device,
                                    determinism)
            self.last = chosen.backend
            return chosen, None
        return chosen, attention_varlen.plan(layout, call.Sq, call.q_offset, call.causal)

    def fwd(self, q, k, v, key_padding_mask, segment_ids, window, causal, scale, q_offset=0,
            softcap=0.0):
        args = (q, k, v, key_padding_mask, segment_ids, window, causal, scale, q_offset,
                softcap)
        if self._triton_only(q.device):
            return self.fallback_fwd(*args)
        _checks._check_qkv("attention_fwd", q, k, v, key_padding_mask, segment_ids, window,
                           scale, q_offset, softcap)
        call = Call.of("fwd", q, k, key_padding_mask, segment_ids, window, causal, q_offset,
                       softcap)
        chosen, seqs = self._route(call, q, key_padding_mask, segment_ids)
        backend = chosen.backend
        if backend == "triton":
            return self.fallback_fwd(*args)
        if seqs is not None:
            out, lse = attention_varlen.varlen_fwd(self.adapters[backend], q, k, v, seqs, scale,
                                                   call.live_window)
        else:
            out, lse = vendor_fwd(self.adapters[backend], q, k, v, causal, scale, q_offset,
                                  call.live_window)
        return out, lse.float()

    def bwd(self, dout, q, k, v, out, lse, key_padding_mask, segment_ids, window, causal, scale,
            q_offset=0, dk_acc=None, dv_acc=None, softcap=0.0):
        args = (dout, q, k, v, out, lse, key_padding_mask, segment_ids, window, causal, scale,
                q_offset, dk_acc, dv_acc, softcap)
        if self._triton_only(q.device):
            return self.fallback_bwd(*args)
        _checks._check_attention_bwd("attention_bwd", dout, q, k, v, out, lse,
                                     key_padding_mask, segment_ids, window, scale, q_offset,
                                     dk_acc, dv_acc, softcap)
        call = Call.of("bwd", q, k, key_padding_mask, segment_ids, window, causal, q_offset,
                       softcap)
        # torch's determinism flag, read at each backward (it matters under attention_dq "auto")
        determinism = config.determinism()
        chosen, seqs = self._route(call, q, key_padding_mask, segment_ids, determinism)
        backend, deterministic = chosen.backend, chosen.deterministic
        if backend == "triton":   # the launcher takes the same dQ mode (triton_dq_mode)
            return self.fallback_bwd(*args)
        if config.current().attention_dq == "auto":
            warn_if_not_deterministic(chosen, determinism)
        if seqs is not None:
            return attention_varlen.varlen_bwd(self.adapters[backend], dout, q, k, v, out, lse,
                                               seqs, scale, call.live_window, dk_acc, dv_acc,
                                               deterministic)
        return vendor_bwd(self.adapters[backend], dout, q, k, v, out, lse, causal, scale,
                          q_offset, call.live_window, dk_acc, dv_acc, deterministic)


CUDA_ROUTER = Router()


def attention_fwd(q, k, v, key_padding_mask, segment_ids, window, causal, scale, q_offset=0,
                  softcap=0.0):
    """The CUDA ``attention_fwd``: the chosen backend's forward (see the module docstring)."""
    return CUDA_ROUTER.fwd(q, k, v, key_padding_mask, segment_ids, window, causal, scale,
                           q_offset, softcap)


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, segment_ids, window, causal, scale,
                  q_offset=0, dk_acc=None, dv_acc=None, softcap=0.0):
    """The CUDA ``attention_bwd``: the chosen backend's backward (see the module docstring)."""
    return CUDA_ROUTER.bwd(dout, q, k, v, out, lse, key_padding_mask, segment_ids, window,
                           causal, scale, q_offset, dk_acc, dv_acc, softcap)
