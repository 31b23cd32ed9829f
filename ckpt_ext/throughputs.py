"""Kernel throughputs for step-time estimates: the file format, its reader and a builder.

The plan's step time (``ckpt_ext.plan.step_time_estimate``) divides the FLOPs it counts in
three parts (``plan.step_flops``: ``attention_forward``, ``attention_backward``, ``matmul``)
by a rate for each. This module holds those rates in a file a GPU run writes, so that another
GPU, another backend or a later kernel changes the estimate without a code change.

File format (JSON, :data:`FORMAT`)::

    {"format": "ckpt_ext kernel throughputs 2",
     "command": ..., "commit": ..., "machine": ..., "date": ...,     # provenance, non-empty
     "note": "...",                                                   # optional
     "rates": [{"kind": "attention_backward", "tflops": 170.0,
                "seq_min": 1, "seq_max": 16384,                       # optional, inclusive
                "rows_min": 1, "rows_max": 1152,                      # optional, inclusive
                "source": "bench/results/....csv"},                   # optional
               ...]}

An optional ``"overheads"`` object gives the time model's costs beyond FLOPs
(:data:`OVERHEADS`: ``chunk_sum_gbytes_per_s``, the float32 weight-gradient sums of the
layer's token chunks; ``chunk_launch_seconds`` and ``lora_chunk_launch_seconds``, the host's
issue time per layer chunk without and with LoRA); those it leaves out keep the plan's
defaults (:class:`Overheads`).

``kind`` is one of :data:`KINDS`; a rate serves a step of sequence length S when
``seq_min <= S <= seq_max`` (an absent bound: no limit); the first matching rate of a kind
wins, so narrower ranges go first. ``attention_backward`` is the attention backward under the
default settings (``attention_dq="auto"`` with torch's determinism flag off: the fastest
backward), ``attention_backward_strict`` the one under
``torch.use_deterministic_algorithms(True)`` (deterministic backwards only; a file without
such rates gives the default's rate for it). A rate with ``rows_min`` / ``rows_max`` holds the
attention of the sequence-tiled layer's query chunks of that many rows (against the keys up to
the chunk's end), so that a rule for the layer's chunk rows can weigh fewer, larger chunks
against the memory they take; it serves only chunked calls (:meth:`Throughputs.rate` with
``rows`` below S), and a rate without them serves whole sequences and every chunk no bounded
rate serves. Each of ``attention_forward``, ``attention_backward`` and ``matmul`` (and
``attention_backward_strict`` when given) must have rates without row bounds for every S (a
last entry without bounds), so that any estimate can be made: :func:`load_throughputs` checks
this and raises a ValueError naming the file when the file is not one. Format-1 files (no row
bounds, no strict rates) still load.

API: :func:`load_throughputs` (path -> :class:`Throughputs`), :func:`default_throughputs`
(the plan's own H100 rates, ``plan.ATTENTION_FWD_TFLOPS`` etc.), :meth:`Throughputs.rate`
(kind, S, chunk rows -> TFLOP/s), :meth:`Throughputs.chunk_rates` (the rates per chunk row
count at S), :meth:`Throughputs.seconds` (a ``plan.step_flops`` dict, S, chunk rows, strict
-> seconds), :meth:`Throughputs.step_time_kwargs` (S, chunk rows, strict -> the rate keywords
of ``plan.step_time_estimate``), :func:`write_throughputs`, and :func:`from_backend_rows`
(the rows ``bench/attention.py --backend-rows`` writes -> attention rates per measured S and
chunk row count, default and strict).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
from typing import Optional, Sequence

from ._checks import _open_results_file

__all__ = ["FORMAT", "KINDS", "HEADERS", "Rate", "Throughputs", "Overheads", "OVERHEADS",
           "load_throughputs", "throughputs_from_dict", "write_throughputs", "default_throughputs",
           "from_backend_rows", "FASTEST"]

FORMAT = "ckpt_ext kernel throughputs 2"
FORMATS = ("ckpt_ext kernel throughputs 1", FORMAT)
KINDS = ("attention_forward", "attention_backward", "attention_backward_strict", "matmul")
STRICT = "attention_backward_strict"
REQUIRED = tuple(k for k in KINDS if k != STRICT)   # the kinds plan.step_flops counts
HEADERS = ("command", "commit", "machine", "date")
# The keywords of plan.step_time_estimate, per kind.
_ESTIMATE_KWARGS = {"attention_forward": "attention_fwd_tflops",
                    "attention_backward": "attention_bwd_tflops", "matmul": "matmul_tflops"}
_BOUNDS = ("seq_min", "seq_max", "rows_min", "rows_max")


@dataclasses.dataclass(frozen=True)
class Rate:
    kind: str
    tflops: float
    seq_min: Optional[int] = None
    seq_max: Optional[int] = None
    source: Optional[str] = None
    rows_min: Optional[int] = None     # a query chunk's rows (the layer's chunk rows)
    rows_max: Optional[int] = None

    @property
    def chunked(self) -> bool:
        """Whether it holds query chunks of some row counts (it has row bounds)."""
        return self.rows_min is not None or self.rows_max is not None

    def serves(self, S: int, rows: Optional[int] = None) -> bool:
        """Whether it serves sequence length S in query chunks of ``rows`` rows (None: whole
        sequences, which only rates without row bounds serve)."""
        if (self.seq_min is not None and S < self.seq_min) or (
                self.seq_max is not None and S > self.seq_max):
            return False
        if rows is None:
            return not self.chunked
        return ((self.rows_min is None or rows >= self.rows_min)
                and (self.rows_max is None or rows <= self.rows_max))

    def as_dict(self) -> dict:
        d = {"kind": self.kind, "tflops": self.tflops}
        for key in _BOUNDS + ("source",):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


# What a step of the sequence-tiled layer costs beyond its FLOPs (the plan's time model of
# auto, ckpt_ext.plan.layer_seconds), from the H200 profile of one LLaMA-3-8B layer at S 4,096
# (bench/results/gpu_h200_2026-11-27/quick_e_lora_profile.txt, commit 67ac4f8, when the layer
# ran 4 attention and 11 MLP chunks there):
# * chunk_sum_gbytes_per_s: each chunk past the first adds its weight gradients into float32
#   sums, (8 + e) bytes of traffic a weight; `fast`'s aten::add_ took 6.93 ms for about 18.9 GB
#   (10 MLP and 3 attention adds of 176M and 42M weights, 10 bytes each): 2.7 TB/s, 57% of the
#   H200's 4.8; the same share of an H100's 3.35 TB/s is 1.9 TB/s;
# * chunk_launch_seconds: the host's issue time per layer chunk (forward and backward), where
#   the device waits on it: `fast`'s step took 23.2 ms against 20.4 ms of device time, about
#   0.2 ms over its 15 chunks;
# * lora_chunk_launch_seconds: the same with PEFT LoRA on the 7 projections, whose small ops
#   the host issues per chunk: `fast@lora` took 48.6 ms for 16.1 ms of device time, about
#   3.2 ms per chunk.
# A layer's time in the model is the larger of its device time and its host time (the host
# issues ahead while the device works). HF's own layer counts as one chunk. A throughputs file
# may give its own values ("overheads", below).
CHUNK_SUM_GBYTES_PER_S = 1900.0
CHUNK_LAUNCH_SECONDS = 0.2e-3
LORA_CHUNK_LAUNCH_SECONDS = 3.2e-3
OVERHEADS = ("chunk_sum_gbytes_per_s", "chunk_launch_seconds", "lora_chunk_launch_seconds")


@dataclasses.dataclass(frozen=True)
class Overheads:
    """The time model's costs beyond FLOPs (see the constants above)."""

    chunk_sum_gbytes_per_s: float = CHUNK_SUM_GBYTES_PER_S
    chunk_launch_seconds: float = CHUNK_LAUNCH_SECONDS
    lora_chunk_launch_seconds: float = LORA_CHUNK_LAUNCH_SECONDS


@dataclasses.dataclass(frozen=True, eq=False)
class Throughputs:
    """Checked rates with the provenance headers of their file, and the time model's
    overheads (the file's ``overheads``, else the defaults)."""

    rates: tuple
    headers: dict
    source: str = ""
    overheads: Overheads = Overheads()

    @property
    def has_strict(self) -> bool:
        """Whether the file measured the backward under torch's determinism flag (else the
        strict rate is the default one)."""
        return any(r.kind == STRICT for r in self.rates)

    def _kind(self, kind: str, strict: bool = False) -> str:
        if kind not in KINDS:
            raise ValueError(f"Throughputs.rate: kind must be one of {KINDS}, got {kind!r}")
        if strict and kind == "attention_backward":
            kind = STRICT
        return kind if kind != STRICT or self.has_strict else "attention_backward"

    def rate(self, kind: str, S: int, rows: Optional[int] = None) -> float:
        """TFLOP/s of ``kind`` at sequence length S, the attention in query chunks of ``rows``
        rows (None, or at least S: whole sequences): the first rate of that kind serving them
        (:meth:`Rate.serves`). ``attention_backward_strict`` is ``attention_backward``'s in a
        file without strict rates."""
        kind = self._kind(kind)
        if rows is not None and rows >= S:
            rows = None
        for r in self.rates:
            if r.kind == kind and r.serves(S, rows):
                return r.tflops
        raise ValueError(f"{self.source or 'throughputs'}: no {kind} rate serves S={S}")

    def chunk_rates(self, kind: str, S: int, strict: bool = False) -> list:
        """[(rows_min, rows_max, TFLOP/s)] of ``kind`` (the strict backward's with ``strict``)
        at sequence length S: the query-chunk row counts the file has rates for (bounds None:
        no limit), in file order; empty when it has none (every chunk then takes the
        whole-sequence rate)."""
        kind = self._kind(kind, strict)
        return [(r.rows_min, r.rows_max, r.tflops) for r in self.rates
                if r.kind == kind and r.chunked and (r.seq_min is None or S >= r.seq_min)
                and (r.seq_max is None or S <= r.seq_max)]

    def step_time_kwargs(self, S: int, rows: Optional[int] = None, strict: bool = False) -> dict:
        """``attention_fwd_tflops`` / ``attention_bwd_tflops`` / ``matmul_tflops`` at S (the
        attention in query chunks of ``rows`` rows; with ``strict`` the backward under torch's
        determinism flag), the keywords ``plan.step_time_estimate`` takes."""
        return {_ESTIMATE_KWARGS[k]: self.rate(self._kind(k, strict), S,
                                               None if k == "matmul" else rows)
                for k in REQUIRED}

    def seconds(self, flops: dict, S: int, rows: Optional[int] = None,
                strict: bool = False) -> float:
        """Seconds for FLOPs split as ``plan.step_flops`` returns them, at sequence length S
        (``rows``, ``strict``: :meth:`step_time_kwargs`)."""
        unknown = set(flops) - set(REQUIRED)
        if unknown:
            raise ValueError(f"Throughputs.seconds: FLOPs of unknown kinds {sorted(unknown)} "
                             f"(kinds: {REQUIRED})")
        kw = self.step_time_kwargs(S, rows, strict)
        return sum(n / (kw[_ESTIMATE_KWARGS[k]] * 1e12) for k, n in flops.items())


def throughputs_from_dict(data, source: str = "") -> Throughputs:
    fmt = data.get("format") if isinstance(data, dict) else None
    bad, headers = _open_results_file(data, source, "kernel throughputs",
                                      fmt if fmt in FORMATS else FORMAT, HEADERS)
    # format 1: no row bounds, no strict rates
    keys = {"kind", "tflops", "source"} | set(_BOUNDS if fmt == FORMAT else _BOUNDS[:2])
    kinds = KINDS if fmt == FORMAT else REQUIRED
    unknown = set(data) - set(HEADERS) - {"format", "note", "rates", "overheads"}
    if unknown:
        raise bad(f"unknown key(s) {sorted(unknown)}")
    given = data.get("overheads", {})
    if not isinstance(given, dict) or set(given) - set(OVERHEADS):
        raise bad(f"overheads must be an object with keys among {list(OVERHEADS)}, got "
                  f"{given!r}")
    for key, v in given.items():
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0 \
                or (v == 0 and key == "chunk_sum_gbytes_per_s"):
            raise bad(f"overheads: {key} must be a finite number >= 0 (a rate > 0), got {v!r}")
    overheads = Overheads(**{k: float(v) for k, v in given.items()})
    entries = data.get("rates")
    if not isinstance(entries, list):
        raise bad(f"rates must be a list, got {entries!r}")
    rates = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise bad(f"rate {i} must be an object, got {e!r}")
        extra = set(e) - keys
        if extra:
            raise bad(f"rate {i}: unknown key(s) {sorted(extra)}")
        if e.get("kind") not in kinds:
            raise bad(f"rate {i}: kind must be one of {list(kinds)}, got {e.get('kind')!r}")
        t = e.get("tflops")
        if type(t) not in (int, float) or not math.isfinite(t) or t <= 0:
            raise bad(f"rate {i}: tflops must be a positive number, got {t!r}")
        for key in _BOUNDS:
            if key in e and (type(e[key]) is not int or e[key] < 1):
                raise bad(f"rate {i}: {key} must be a positive int, got {e[key]!r}")
        for lo, hi in (("seq_min", "seq_max"), ("rows_min", "rows_max")):
            if e.get(lo, 1) > e.get(hi, e.get(lo, 1)):
                raise bad(f"rate {i}: {lo} {e[lo]} > {hi} {e[hi]}")
        if "source" in e and not isinstance(e["source"], str):
            raise bad(f"rate {i}: source must be a string, got {e['source']!r}")
        rates.append(Rate(e["kind"], float(t), e.get("seq_min"), e.get("seq_max"),
                          e.get("source"), e.get("rows_min"), e.get("rows_max")))
    for kind in KINDS:
        if (kind in REQUIRED or any(r.kind == kind for r in rates)) and not _covers(rates, kind):
            raise bad(f"no {kind} rate serves every sequence length (end the {kind} rates "
                      f"with one without bounds; rows_min / rows_max ones serve chunks only)")
    return Throughputs(tuple(rates), headers, str(source), overheads)


def _covers(rates, kind) -> bool:
    """Whether the kind's ranges, taken in order, leave no S >= 1 unserved."""
    spans = [((r.seq_min or 1), r.seq_max) for r in rates if r.kind == kind and not r.chunked]
    spans.sort(key=lambda span: (span[0], math.inf if span[1] is None else span[1]))
    reach = 0                       # every S <= reach is served
    for lo, hi in spans:
        if lo > reach + 1:
            return False
        if hi is None:
            return True
        reach = max(reach, hi)
    return False


def load_throughputs(path) -> Throughputs:
    """Read and check a throughputs file (ValueError naming the file when it is not one)."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the kernel throughputs file: {exc}") from exc
    return throughputs_from_dict(data, str(path))


def write_throughputs(path, headers: dict, rates: Sequence[Rate],
                      note: Optional[str] = None, overheads: Optional[dict] = None) -> dict:
    """Write a throughputs file (checked by the reader first); returns its JSON object.
    ``overheads``: measured values of the time model's :data:`OVERHEADS` (the rest default)."""
    data = {"format": FORMAT, **{k: headers[k] for k in HEADERS}}
    if note:
        data["note"] = note
    data["rates"] = [r.as_dict() for r in rates]
    if overheads:
        data["overheads"] = dict(overheads)
    throughputs_from_dict(data, str(path))
    pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


# The plan's default rates, measured on an H100 80GB (bench/results/gpu_h100_2026-11-24/
# attention_nvidia_h100_80gb_hbm3.csv, D 128, causal, bf16): the Triton attention forward ran
# 329-372 TFLOP/s and its backward 151-180 TFLOP/s (FLOPs counted as there: backward 2.5x
# forward; the backward under "separate", deterministic: the strict rate too, and below what
# the default settings' fastest backward may reach); the LM head's bf16 GEMMs about 410
# TFLOP/s forward (lm_head_nvidia_h100_80gb_hbm3.csv, V 128256, H 4096).
ATTENTION_FWD_TFLOPS = 350.0
ATTENTION_BWD_TFLOPS = 170.0
MATMUL_TFLOPS = 400.0


def default_throughputs() -> Throughputs:
    """The plan's own rates (the H100 figures above, ``plan.ATTENTION_FWD_TFLOPS`` etc.), one
    per kind for every S."""
    values = {"attention_forward": ATTENTION_FWD_TFLOPS,
              "attention_backward": ATTENTION_BWD_TFLOPS, "matmul": MATMUL_TFLOPS}
    return Throughputs(tuple(Rate(k, float(v), source="ckpt_ext.plan") for k, v in
                             values.items()),
                       {"command": "(none: ckpt_ext.plan's constants)", "commit": "-",
                        "machine": "NVIDIA H100 80GB HBM3 (bench/results/gpu_h100_2026-11-24)",
                        "date": "2026-11-24"}, "ckpt_ext.plan")


# The backends whose backward, as bench/attention.py --backend-rows times it, is
# deterministic: Triton under "separate" or "ordered" (a bare "triton": a CSV written before
# the rows named the mode, timed under "separate"), flash and efficient (their deterministic
# variants); and the row of the "auto" backend under torch's determinism flag.
_DETERMINISTIC_ROWS = frozenset(("triton", "triton:separate", "triton:ordered", "flash",
                                 "efficient"))
FASTEST = "fastest"
STRICT_AUTO = "auto:strict"


def from_backend_rows(csv_path, backend: str = "auto",
                      matmul_tflops: Optional[float] = None) -> list:
    """Attention rates from the CSV ``bench/attention.py --backend-rows`` writes (causal, no
    masks; FLOPs counted as the plan counts them: backward 2.5 forwards), "fwd" and "bwd"
    TFLOP/s of the ``backend`` rows: at whole sequences (Sq == Sk, q_offset 0) one rate per
    kind and measured S, covering the lengths up to it (the longest measured also every longer
    S); at query chunks (q_offset > 0) one rate per kind and measured row count Sq (the
    chunk's FLOPs over its time, summed over the key counts measured at that Sq), with
    ``rows_min`` / ``rows_max`` covering the row counts up to it (the largest also every
    larger one). ``backend`` "fastest": at each shape the fastest backend that ran (the
    default settings' choice), and for ``attention_backward_strict`` the fastest of those whose
    backward is deterministic (Triton separate / ordered, flash, efficient); "auto": the
    table's choice, with ``attention_backward_strict`` from the "auto:strict" rows (the bench
    under torch's flag) where the CSV has them; another backend: its rows, no strict rates.
    With ``matmul_tflops``, a matmul rate too. Returns the Rates (``write_throughputs`` makes
    a file of them). ValueError naming the file when it holds no such rows."""
    path = pathlib.Path(csv_path)
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    # alone, or inside a results file: from its column line to the first line that is not a row
    start = next((i for i, ln in enumerate(lines) if ln.startswith("backend,")), 0)
    end = next((i for i in range(start + 1, len(lines)) if "," not in lines[i]), len(lines))
    lines = lines[start:end]
    # (kind, chunked, sq) -> {backend: [(flops, seconds)]}
    measured = {}
    for row in csv.DictReader(lines):
        try:
            sq, sk, off = int(row["sq"]), int(row["sk"]), int(row["q_offset"])
            t, ms = float(row["tflops"]), float(row["ms"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not bench/attention.py --backend-rows output "
                             f"({type(exc).__name__}: {exc})") from None
        chunk = off > 0
        if (row.get("mode") not in ("fwd", "bwd") or row.get("masks", "none") != "none"
                or (not chunk and (sq != sk or off != 0))
                or row.get("causal") not in ("True", "true", "1")
                or not (math.isfinite(t) and t > 0 and math.isfinite(ms) and ms > 0)):
            continue
        kind = "attention_forward" if row["mode"] == "fwd" else "attention_backward"
        measured.setdefault((kind, chunk, sq), {}).setdefault(row.get("backend"), []).append(
            (t * 1e12 * ms * 1e-3, ms * 1e-3))

    def rate_of(times):
        flops, secs = map(sum, zip(*times))
        return flops / secs / 1e12

    def pick(by_backend, strict):
        """(TFLOP/s, the backend's name) of the shape, or None."""
        if backend == FASTEST:
            names = [b for b in by_backend if not strict or b in _DETERMINISTIC_ROWS]
        else:
            names = [STRICT_AUTO if strict and backend == "auto" else backend]
        got = [(rate_of(by_backend[b]), b) for b in names if b in by_backend]
        return max(got) if got else None

    rates = []
    for kind, strict in (("attention_forward", False), ("attention_backward", False),
                         ("attention_backward", True)):
        if strict and backend not in (FASTEST, "auto"):
            continue
        for chunk in (True, False):
            shapes = sorted((sq, pick(b, strict)) for (k, c, sq), b in measured.items()
                            if k == kind and c == chunk)
            shapes = [(sq, got) for sq, got in shapes if got is not None]
            if not shapes:
                if not chunk and not (strict and backend == "auto"):
                    raise ValueError(f"{path}: no {backend!r} {kind} rows at whole causal "
                                     f"sequences")
                continue
            lo = 1
            for i, (n, (tflops, name)) in enumerate(shapes):
                top = None if i == len(shapes) - 1 else n
                where = f"{path.name}: {name} at " + (f"chunks of {n} rows" if chunk
                                                      else f"S {n}")
                rates.append(Rate(STRICT if strict else kind, round(tflops, 3),
                                  None if chunk else lo, None if chunk else top, where,
                                  lo if chunk else None, top if chunk else None))
                lo = n + 1
    if matmul_tflops is not None:
        rates.append(Rate("matmul", float(matmul_tflops), source="given"))
    return rates
