"""Launch configurations of the attention backward: the sweep's candidates and its winners file.

The backward's two kernels (``dkdv``: one program per key block; ``dq``: one per query block,
see ``kernels/attention.py``) launch with a ``triton.Config``: the tile (BLOCK_M query rows by
BLOCK_N keys), the warps per program, the software-pipelining depth (``num_stages``) and two
options of Triton's CUDA backend that matter on sm_90: ``maxnreg`` (a register cap per thread,
the ``.maxnreg`` PTX directive: a lower cap can fit two programs per multiprocessor where one
fitted, at the price of spills, which the launchers' pruning catches) and ``num_ctas`` (a
thread-block cluster per program, Hopper only). ``num_warps`` is kept a multiple of 4, so
that every program is made of whole warpgroups (the unit of sm_90's ``wgmma``).

* :func:`sweep_candidates` lists what ``bench/attention_bwd_sweep.py`` measures on a GPU: a
  pure function of the axes, in a fixed order, the kernels' built-in candidates first (the
  baseline each winner is measured against).
* The winners file (JSON, :data:`FORMAT`) holds, besides the sweep's provenance (``command``,
  ``commit``, ``machine``, ``date``, ``triton``), one entry per kernel and shape bucket: the
  bucket (``kernel``, ``arch`` as ``"sm_90"``, ``dtype``, ``head_dim``, ``causal``, the query
  rows ``sq`` and keys ``sk`` it was measured at, and for ``dkdv`` the ``dq_atomic`` and
  ``accumulate`` variants) and the winning ``config``, with its time and the baseline's.
  :func:`load_winners` checks a file and raises ValueError naming it when it is not one.
* At launch (:func:`winner`), the file the ``attention_bwd_configs`` setting names
  (``CKPT_EXT_ATTN_BWD_CONFIGS``; empty: :data:`SHIPPED`, this package's own) is read once
  per path; an entry serves a launch when its exact keys equal the launch's and, among
  those, its (sq, sk) is nearest to the launch's in log2 distance (ties: the larger shape).
  The winner goes first in the kernel's candidate list; the launchers still prune by the
  compiler's report (``kernels/_launch.py``), so a winner that spills under this device's
  Triton falls back to the built-in order. An entry may record ``spills`` (words per thread):
  the sweep found that config faster than every spill-free one although it spills that much,
  and the launcher then keeps candidates with at most as many spills. Soft-capped kernels (another register budget) and
  the Triton interpreter do not read the file.
* :func:`force` pins one configuration per kernel for the duration of a block (the sweep
  itself; tests), in the interpreter too (there only the block sizes count).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import pathlib
import threading
from typing import Iterable, Optional, Sequence

from .._checks import _open_results_file

__all__ = ["FORMAT", "SHIPPED", "KERNELS", "HEADERS", "Candidate", "sweep_candidates", "Entry",
           "Winners", "load_winners", "winners_dict", "write_winners", "current_winners",
           "forget", "winner", "force", "forced", "note_launch", "launch_reports"]

FORMAT = "ckpt_ext attention backward configs 1"
SHIPPED = pathlib.Path(__file__).with_name("attention_bwd_configs.json")
KERNELS = ("dkdv", "dq")
HEADERS = ("command", "commit", "machine", "date", "triton")
DTYPES = ("bf16", "fp16", "fp32")


# --------------------------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One launch configuration of a backward kernel (hashable: part of a launcher's cache
    key)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: Optional[int] = None
    num_ctas: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if type(v) is not int or v < 16 or v & (v - 1):
                raise ValueError(f"Candidate: {name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (4, 8, 16):
            raise ValueError(f"Candidate: num_warps must be 4, 8 or 16 (whole warpgroups), "
                             f"got {self.num_warps!r}")
        if type(self.num_stages) is not int or not 1 <= self.num_stages <= 6:
            raise ValueError(f"Candidate: num_stages must be an int in 1..6, got "
                             f"{self.num_stages!r}")
        if self.maxnreg is not None and (type(self.maxnreg) is not int
                                         or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"Candidate: maxnreg must be None or an int in 24..255, got "
                             f"{self.maxnreg!r}")
        if self.num_ctas not in (1, 2, 4):
            raise ValueError(f"Candidate: num_ctas must be 1, 2 or 4, got {self.num_ctas!r}")

    @property
    def label(self) -> str:
        """Short text, e.g. ``64x128 w8 s3`` (`` r168`` with a register cap, `` c2`` with a
        cluster)."""
        text = f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"
        if self.maxnreg is not None:
            text += f" r{self.maxnreg}"
        return text + (f" c{self.num_ctas}" if self.num_ctas != 1 else "")

    def blocks(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}

    def to_config(self):
        """The ``triton.Config`` (the options left at their defaults are not passed)."""
        import triton

        extra = {}
        if self.maxnreg is not None:
            extra["maxnreg"] = self.maxnreg
        if self.num_ctas != 1:
            extra["num_ctas"] = self.num_ctas
        return triton.Config(self.blocks(), num_warps=self.num_warps,
                             num_stages=self.num_stages, **extra)

    @classmethod
    def of_config(cls, config) -> "Candidate":
        """Of a ``triton.Config`` with BLOCK_M and BLOCK_N."""
        return cls(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
                   config.num_stages, getattr(config, "maxnreg", None),
                   getattr(config, "num_ctas", 1))

    def as_dict(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "num_warps": self.num_warps, "num_stages": self.num_stages,
                "maxnreg": self.maxnreg, "num_ctas": self.num_ctas}

    @classmethod
    def from_dict(cls, data, where: str = "config") -> "Candidate":
        keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
        if not isinstance(data, dict) or any(k not in data for k in keys):
            raise ValueError(f"{where} must be an object with {', '.join(keys)} (and optional "
                             f"maxnreg, num_ctas), got {data!r}")
        unknown = set(data) - set(keys) - {"maxnreg", "num_ctas"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}")
        try:
            return cls(data["BLOCK_M"], data["BLOCK_N"], data["num_warps"], data["num_stages"],
                       data.get("maxnreg"), data.get("num_ctas", 1))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


# The tile axes each kernel is swept over: dK/dV hold a key tile (BLOCK_N) and stream query
# tiles (BLOCK_M); dQ the other way round.
_TILES = {"dkdv": {"block_m": (16, 32, 64, 128), "block_n": (64, 128)},
          "dq": {"block_m": (64, 128), "block_n": (32, 64, 128)}}


def sweep_candidates(kind: str, *, block_m: Optional[Sequence[int]] = None,
                     block_n: Optional[Sequence[int]] = None,
                     warps: Sequence[int] = (4, 8), stages: Sequence[int] = (1, 2, 3, 4),
                     maxnreg: Sequence[Optional[int]] = (None, 168),
                     num_ctas: Sequence[int] = (1,), min_per_thread: int = 16,
                     baseline: Iterable = (), limit: Optional[int] = None) -> list:
    """The candidates the sweep measures for kernel ``kind`` ("dkdv" or "dq"), in order.

    First ``baseline`` (Candidates or ``triton.Config``: the kernel's built-in list, so that
    each winner is compared with what launches today), then the product of the axes, larger
    tiles first, then more warps, fewer stages, no register cap before a cap, no cluster
    before a cluster. Tiles default per kernel (dK/dV: BLOCK_M 16..128 x BLOCK_N 64, 128; dQ:
    BLOCK_M 64, 128 x BLOCK_N 32..128). A product point is dropped when a thread would hold
    fewer than ``min_per_thread`` elements of the BLOCK_M x BLOCK_N score tile (warps that have
    nothing to do) or when a cluster would split a tile below 16 rows. Duplicates are kept
    once, where they first appear; ``limit``: at most that many after the baseline.
    """
    if kind not in _TILES:
        raise ValueError(f"sweep_candidates: kind must be one of {list(_TILES)}, got {kind!r}")
    if min_per_thread < 1:
        raise ValueError(f"sweep_candidates: min_per_thread must be >= 1, got {min_per_thread}")
    if limit is not None and limit < 0:
        raise ValueError(f"sweep_candidates: limit must be None or >= 0, got {limit}")
    bms = sorted(set(block_m or _TILES[kind]["block_m"]), reverse=True)
    bns = sorted(set(block_n or _TILES[kind]["block_n"]), reverse=True)
    out, seen = [], set()

    def add(c):
        if c not in seen:
            seen.add(c)
            out.append(c)

    for c in baseline:
        add(c if isinstance(c, Candidate) else Candidate.of_config(c))
    n_base = len(out)
    # larger tiles first; among equal areas the larger held dimension first
    held = "block_n" if kind == "dkdv" else "block_m"
    tiles = sorted(itertools.product(bms, bns),
                   key=lambda t: (-t[0] * t[1], -(t[1] if held == "block_n" else t[0])))
    caps = sorted(set(maxnreg), key=lambda r: (r is not None, -(r or 0)))
    for (bm, bn), w, s, r, ctas in itertools.product(
            tiles, sorted(set(warps), reverse=True), sorted(set(stages)), caps,
            sorted(set(num_ctas))):
        if bm * bn < min_per_thread * 32 * w:
            continue
        if ctas > 1 and (bm if held == "block_m" else bn) // ctas < 16:
            continue
        add(Candidate(bm, bn, w, s, r, ctas))
    return out[:n_base + limit] if limit is not None else out


# --------------------------------------------------------------------------------------------
# The winners file
# --------------------------------------------------------------------------------------------
_EXACT = {"kernel": str, "arch": str, "dtype": str, "head_dim": int, "causal": bool}
_OPTIONAL_EXACT = {"dq_atomic": bool, "accumulate": bool}
_NUMBERS = ("ms", "baseline_ms", "tflops")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One shape bucket's winner. ``dq_atomic`` / ``accumulate`` None: any (dQ kernel)."""

    kernel: str
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    sq: int
    sk: int
    config: Candidate
    dq_atomic: Optional[bool] = None
    accumulate: Optional[bool] = None
    ms: Optional[float] = None
    baseline_ms: Optional[float] = None
    tflops: Optional[float] = None
    baseline: Optional[str] = None
    spills: int = 0

    def as_dict(self) -> dict:
        d = {"kernel": self.kernel, "arch": self.arch, "dtype": self.dtype,
             "head_dim": self.head_dim, "causal": self.causal, "sq": self.sq, "sk": self.sk}
        for key in ("dq_atomic", "accumulate"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["config"] = self.config.as_dict()
        if self.spills:
            d["spills"] = self.spills
        for key in _NUMBERS + ("baseline",):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


def _entry(data, i: int, bad) -> Entry:
    if not isinstance(data, dict):
        raise bad(f"entry {i} must be an object, got {data!r}")
    fields = {}
    for key, kind in _EXACT.items():
        if type(data.get(key)) is not kind:
            raise bad(f"entry {i}: {key} must be a {kind.__name__}, got {data.get(key)!r}")
        fields[key] = data[key]
    if fields["kernel"] not in KERNELS:
        raise bad(f"entry {i}: kernel must be one of {list(KERNELS)}, got {fields['kernel']!r}")
    if fields["dtype"] not in DTYPES:
        raise bad(f"entry {i}: dtype must be one of {list(DTYPES)}, got {fields['dtype']!r}")
    if not fields["arch"].startswith("sm_") or not fields["arch"][3:].isdigit():
        raise bad(f"entry {i}: arch must be like 'sm_90', got {fields['arch']!r}")
    for key in ("sq", "sk"):
        v = data.get(key)
        if type(v) is not int or v < 1:
            raise bad(f"entry {i}: {key} must be a positive int, got {v!r}")
        fields[key] = v
    for key, kind in _OPTIONAL_EXACT.items():
        if key in data:
            if type(data[key]) is not kind:
                raise bad(f"entry {i}: {key} must be a {kind.__name__}, got {data[key]!r}")
            fields[key] = data[key]
    for key in _NUMBERS:
        if key in data:
            if type(data[key]) not in (int, float) or not data[key] > 0:
                raise bad(f"entry {i}: {key} must be a positive number, got {data[key]!r}")
            fields[key] = float(data[key])
    if "spills" in data:
        if type(data["spills"]) is not int or data["spills"] < 0:
            raise bad(f"entry {i}: spills must be an int >= 0, got {data['spills']!r}")
        fields["spills"] = data["spills"]
    if "baseline" in data:
        if not isinstance(data["baseline"], str):
            raise bad(f"entry {i}: baseline must be a string, got {data['baseline']!r}")
        fields["baseline"] = data["baseline"]
    known = set(_EXACT) | set(_OPTIONAL_EXACT) | set(_NUMBERS) | {"sq", "sk", "config",
                                                                  "baseline", "spills"}
    unknown = set(data) - known
    if unknown:
        raise bad(f"entry {i}: unknown key(s) {sorted(unknown)} (keys: {sorted(known)})")
    try:
        fields["config"] = Candidate.from_dict(data.get("config"), f"entry {i}: config")
    except ValueError as exc:
        raise bad(str(exc)) from None
    return Entry(**fields)


@dataclasses.dataclass(frozen=True, eq=False)
class Winners:
    """A checked winners file: its provenance headers and entries."""

    headers: dict
    entries: tuple = ()
    source: str = ""

    def lookup(self, kernel: str, arch: str, dtype: str, head_dim: int, causal: bool, sq: int,
               sk: int, dq_atomic: Optional[bool] = None,
               accumulate: Optional[bool] = None) -> Optional[Entry]:
        """The entry serving a launch: exact keys equal (an entry's absent ``dq_atomic`` /
        ``accumulate`` matches either), then the nearest (sq, sk) in log2 distance, the larger
        on a tie; None when no entry has the exact keys."""
        best, best_key = None, None
        for e in self.entries:
            if (e.kernel, e.arch, e.dtype, e.head_dim, e.causal) != (kernel, arch, dtype,
                                                                     head_dim, causal):
                continue
            if e.dq_atomic is not None and dq_atomic is not None and e.dq_atomic != dq_atomic:
                continue
            if (e.accumulate is not None and accumulate is not None
                    and e.accumulate != accumulate):
                continue
            dist = abs(math.log2(e.sq / max(sq, 1))) + abs(math.log2(e.sk / max(sk, 1)))
            key = (dist, -e.sq * e.sk)
            if best_key is None or key < best_key:
                best, best_key = e, key
        return best


def winners_from_dict(data, source: str = "") -> Winners:
    bad, headers = _open_results_file(data, source, "attention backward configs", FORMAT,
                                      HEADERS)
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise bad(f"entries must be a list, got {entries!r}")
    checked = tuple(_entry(e, i, bad) for i, e in enumerate(entries))
    keys = [(e.kernel, e.arch, e.dtype, e.head_dim, e.causal, e.dq_atomic, e.accumulate, e.sq,
             e.sk) for e in checked]
    if len(set(keys)) != len(keys):
        raise bad("two entries have the same bucket (kernel, arch, dtype, head_dim, causal, "
                  "dq_atomic, accumulate, sq, sk)")
    return Winners(headers, checked, str(source))


def load_winners(path) -> Winners:
    """Read and check a winners file (ValueError naming the file when it is not one)."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the attention backward configs file: "
                         f"{exc}") from exc
    return winners_from_dict(data, str(path))


def winners_dict(headers: dict, entries: Sequence[Entry], note: Optional[str] = None) -> dict:
    """The JSON object of a winners file (checked by the reader before it is returned)."""
    data = {"format": FORMAT}
    data.update({key: headers[key] for key in HEADERS})
    if note:
        data["note"] = note
    data["entries"] = [e.as_dict() for e in entries]
    winners_from_dict(data, "winners_dict")
    return data


def write_winners(path, headers: dict, entries: Sequence[Entry],
                  note: Optional[str] = None) -> None:
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(winners_dict(headers, entries, note), indent=1) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Read at launch
# --------------------------------------------------------------------------------------------
_files: dict = {}
_lock = threading.Lock()


def current_winners() -> Winners:
    """The winners file the ``attention_bwd_configs`` setting names (the shipped one when
    empty), read once per path."""
    from .. import config

    path = getattr(config.current(), "attention_bwd_configs", "") or str(SHIPPED)
    found = _files.get(path)
    if found is None:
        with _lock:
            found = _files[path] = load_winners(path)
    return found


def forget() -> None:
    """Read the winners files again at the next launch."""
    _files.clear()
    _winner.cache_clear()


def dtype_name(dtype) -> str:
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16",
            "torch.float32": "fp32"}.get(str(dtype), str(dtype))


@functools.lru_cache(maxsize=4096)
def _winner(winners: Winners, kernel, arch, dtype, head_dim, causal, sq, sk, dq_atomic,
            accumulate) -> Optional[tuple]:
    e = winners.lookup(kernel, arch, dtype, head_dim, causal, sq, sk, dq_atomic, accumulate)
    return None if e is None else (e.config, e.spills)


def winner(kernel: str, capability: tuple, dtype, head_dim: int, causal: bool, sq: int,
           sk: int, dq_atomic: Optional[bool] = None,
           accumulate: Optional[bool] = None) -> Optional[tuple]:
    """(config, spills) of the current winners file's entry for a launch, or None (sq, sk:
    the launch's query rows and keys; pass bucketed values to keep the cache small).
    ``spills``: the spill words per thread the winner was measured with (0 for most); the
    launcher keeps candidates with at most that many (``_launch.fits``)."""
    arch = f"sm_{capability[0]}{capability[1]}"
    return _winner(current_winners(), kernel, arch, dtype_name(dtype), head_dim, bool(causal),
                   sq, sk, dq_atomic, accumulate)


# --------------------------------------------------------------------------------------------
# Pinned configurations (the sweep)
# --------------------------------------------------------------------------------------------
_forced: dict = {}
_reports: dict = {}


@contextlib.contextmanager
def force(**by_kernel):
    """Launch the backward kernels named (``dkdv=``, ``dq=``: a Candidate, or None to leave
    one alone) with exactly that configuration inside the block: on a GPU compiled and
    launched even if it spills (what the compiler reported is in :func:`launch_reports`), in
    the interpreter with its block sizes."""
    unknown = set(by_kernel) - set(KERNELS)
    if unknown:
        raise ValueError(f"force: kernels are {list(KERNELS)}, got {sorted(unknown)}")
    for name, c in by_kernel.items():
        if c is not None and not isinstance(c, Candidate):
            raise TypeError(f"force: {name} must be a Candidate or None, got {c!r}")
    before = dict(_forced)
    _forced.update({k: c for k, c in by_kernel.items() if c is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(before)


def forced(kernel: str) -> Optional[Candidate]:
    return _forced.get(kernel) if _forced else None


def note_launch(kernel: str, launcher) -> None:
    """Called by the backward after a launch: with a forced configuration, keeps what the
    compiler reported for it (the launcher's ``report``, on a GPU)."""
    if _forced and kernel in _forced:
        report = getattr(launcher, "report", None)
        if report:
            _reports[(kernel, _forced[kernel])] = report[0][1]


def launch_reports() -> dict:
    """{(kernel, Candidate): Resources or None} of the forced launches so far."""
    return dict(_reports)
