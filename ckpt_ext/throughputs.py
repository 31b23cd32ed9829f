"""Kernel throughputs for step-time estimates: the file format, its reader and a builder.

The plan's step time (``ckpt_ext.plan.step_time_estimate``) divides the FLOPs it counts in
three parts (``plan.step_flops``: ``attention_forward``, ``attention_backward``, ``matmul``)
by a rate for each. This module holds those rates in a file a GPU run writes, so that another
GPU, another backend or a later kernel changes the estimate without a code change.

File format (JSON, :data:`FORMAT`)::

    {"format": "ckpt_ext kernel throughputs 1",
     "command": ..., "commit": ..., "machine": ..., "date": ...,     # provenance, non-empty
     "note": "...",                                                   # optional
     "rates": [{"kind": "attention_backward", "tflops": 170.0,
                "seq_min": 1, "seq_max": 16384,                       # optional, inclusive
                "source": "bench/results/....csv"},                   # optional
               ...]}

``kind`` is one of :data:`KINDS`; a rate serves a step of sequence length S when
``seq_min <= S <= seq_max`` (an absent bound: no limit); the first matching rate of a kind
wins, so narrower ranges go first. Every kind must have a rate for every S (a last entry
without bounds), so that any estimate can be made: :func:`load_throughputs` checks this and
raises a ValueError naming the file when the file is not one.

API: :func:`load_throughputs` (path -> :class:`Throughputs`), :func:`default_throughputs`
(the plan's own H100 rates, ``plan.ATTENTION_FWD_TFLOPS`` etc.), :meth:`Throughputs.rate`
(kind, S -> TFLOP/s), :meth:`Throughputs.seconds` (a ``plan.step_flops`` dict and S ->
seconds), :meth:`Throughputs.step_time_kwargs` (S -> the rate keywords of
``plan.step_time_estimate``), :func:`write_throughputs`, and :func:`from_backend_rows`
(the rows ``bench/attention.py --backend-rows`` writes -> attention rates per measured S).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
from typing import Optional, Sequence

from ._checks import _open_results_file

__all__ = ["FORMAT", "KINDS", "HEADERS", "Rate", "Throughputs", "load_throughputs",
           "throughputs_from_dict", "write_throughputs", "default_throughputs",
           "from_backend_rows"]

FORMAT = "ckpt_ext kernel throughputs 1"
KINDS = ("attention_forward", "attention_backward", "matmul")
HEADERS = ("command", "commit", "machine", "date")
# The keywords of plan.step_time_estimate, per kind.
_ESTIMATE_KWARGS = {"attention_forward": "attention_fwd_tflops",
                    "attention_backward": "attention_bwd_tflops", "matmul": "matmul_tflops"}


@dataclasses.dataclass(frozen=True)
class Rate:
    kind: str
    tflops: float
    seq_min: Optional[int] = None
    seq_max: Optional[int] = None
    source: Optional[str] = None

    def serves(self, S: int) -> bool:
        return ((self.seq_min is None or S >= self.seq_min)
                and (self.seq_max is None or S <= self.seq_max))

    def as_dict(self) -> dict:
        d = {"kind": self.kind, "tflops": self.tflops}
        for key in ("seq_min", "seq_max", "source"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


@dataclasses.dataclass(frozen=True, eq=False)
class Throughputs:
    """Checked rates with the provenance headers of their file."""

    rates: tuple
    headers: dict
    source: str = ""

    def rate(self, kind: str, S: int) -> float:
        """TFLOP/s of ``kind`` at sequence length S: the first rate of that kind serving S."""
        if kind not in KINDS:
            raise ValueError(f"Throughputs.rate: kind must be one of {KINDS}, got {kind!r}")
        for r in self.rates:
            if r.kind == kind and r.serves(S):
                return r.tflops
        raise ValueError(f"{self.source or 'throughputs'}: no {kind} rate serves S={S}")

    def step_time_kwargs(self, S: int) -> dict:
        """``attention_fwd_tflops`` / ``attention_bwd_tflops`` / ``matmul_tflops`` at S, the
        keywords ``plan.step_time_estimate`` takes."""
        return {_ESTIMATE_KWARGS[k]: self.rate(k, S) for k in KINDS}

    def seconds(self, flops: dict, S: int) -> float:
        """Seconds for FLOPs split as ``plan.step_flops`` returns them, at sequence length S."""
        unknown = set(flops) - set(KINDS)
        if unknown:
            raise ValueError(f"Throughputs.seconds: FLOPs of unknown kinds {sorted(unknown)} "
                             f"(kinds: {KINDS})")
        return sum(n / (self.rate(k, S) * 1e12) for k, n in flops.items())


def throughputs_from_dict(data, source: str = "") -> Throughputs:
    bad, headers = _open_results_file(data, source, "kernel throughputs", FORMAT, HEADERS)
    unknown = set(data) - set(HEADERS) - {"format", "note", "rates"}
    if unknown:
        raise bad(f"unknown key(s) {sorted(unknown)}")
    entries = data.get("rates")
    if not isinstance(entries, list):
        raise bad(f"rates must be a list, got {entries!r}")
    rates = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise bad(f"rate {i} must be an object, got {e!r}")
        extra = set(e) - {"kind", "tflops", "seq_min", "seq_max", "source"}
        if extra:
            raise bad(f"rate {i}: unknown key(s) {sorted(extra)}")
        if e.get("kind") not in KINDS:
            raise bad(f"rate {i}: kind must be one of {list(KINDS)}, got {e.get('kind')!r}")
        t = e.get("tflops")
        if type(t) not in (int, float) or not math.isfinite(t) or t <= 0:
            raise bad(f"rate {i}: tflops must be a positive number, got {t!r}")
        for key in ("seq_min", "seq_max"):
            if key in e and (type(e[key]) is not int or e[key] < 1):
                raise bad(f"rate {i}: {key} must be a positive int, got {e[key]!r}")
        if e.get("seq_min", 1) > e.get("seq_max", e.get("seq_min", 1)):
            raise bad(f"rate {i}: seq_min {e['seq_min']} > seq_max {e['seq_max']}")
        if "source" in e and not isinstance(e["source"], str):
            raise bad(f"rate {i}: source must be a string, got {e['source']!r}")
        rates.append(Rate(e["kind"], float(t), e.get("seq_min"), e.get("seq_max"),
                          e.get("source")))
    for kind in KINDS:
        if not _covers(rates, kind):
            raise bad(f"no {kind} rate serves every sequence length (end the {kind} rates "
                      f"with one without seq_min / seq_max)")
    return Throughputs(tuple(rates), headers, str(source))


def _covers(rates, kind) -> bool:
    """Whether the kind's ranges, taken in order, leave no S >= 1 unserved."""
    spans = [((r.seq_min or 1), r.seq_max) for r in rates if r.kind == kind]
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
                      note: Optional[str] = None) -> dict:
    """Write a throughputs file (checked by the reader first); returns its JSON object."""
    data = {"format": FORMAT, **{k: headers[k] for k in HEADERS}}
    if note:
        data["note"] = note
    data["rates"] = [r.as_dict() for r in rates]
    throughputs_from_dict(data, str(path))
    pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


# The plan's default rates, measured on an H100 80GB (bench/results/gpu_h100_2026-11-24/
# attention_nvidia_h100_80gb_hbm3.csv, D 128, causal, bf16): the Triton attention forward ran
# 329-372 TFLOP/s and its backward 151-180 TFLOP/s (FLOPs counted as there: backward 2.5x
# forward); the LM head's bf16 GEMMs about 410 TFLOP/s forward
# (lm_head_nvidia_h100_80gb_hbm3.csv, V 128256, H 4096).
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


def from_backend_rows(csv_path, backend: str = "auto",
                      matmul_tflops: Optional[float] = None) -> list:
    """Attention rates from the CSV ``bench/attention.py --backend-rows`` writes: the
    ``backend`` rows at whole causal sequences (Sq == Sk, q_offset 0, no masks), its "fwd"
    and "bwd" TFLOP/s (FLOPs counted as the plan counts them: backward 2.5 forwards), one rate
    per kind and measured S, covering the lengths up to it (the longest measured also every
    longer S); with ``matmul_tflops``, a matmul rate too. Returns the Rates
    (``write_throughputs`` makes a file of them). ValueError naming the file when it holds
    no such rows."""
    path = pathlib.Path(csv_path)
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    measured = {}
    for row in csv.DictReader(lines):
        try:
            sq, sk, off = int(row["sq"]), int(row["sk"]), int(row["q_offset"])
            t = float(row["tflops"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not bench/attention.py --backend-rows output "
                             f"({type(exc).__name__}: {exc})") from None
        if (row.get("backend") != backend or row.get("mode") not in ("fwd", "bwd")
                or row.get("masks", "none") != "none" or sq != sk or off != 0
                or row.get("causal") not in ("True", "true", "1")
                or not math.isfinite(t) or t <= 0):
            continue
        kind = "attention_forward" if row["mode"] == "fwd" else "attention_backward"
        measured[(kind, sk)] = t
    rates = []
    for kind in ("attention_forward", "attention_backward"):
        seqs = sorted(s for k, s in measured if k == kind)
        if not seqs:
            raise ValueError(f"{path}: no {backend!r} {kind} rows at whole causal sequences")
        lo = 1
        for i, S in enumerate(seqs):
            last = i == len(seqs) - 1
            rates.append(Rate(kind, measured[(kind, S)], lo, None if last else S,
                              f"{path.name}: {backend} at S {S}"))
            lo = S + 1
    if matmul_tflops is not None:
        rates.append(Rate("matmul", float(matmul_tflops), source="given"))
    return rates
