#!/usr/bin/env python
"""Sweep the Triton attention backward's launch configurations on a GPU; write the winners.

For each shape bucket (``--buckets SQ:SK,...``: SQ query rows against SK keys; SQ < SK is a
query chunk holding the last SQ positions, its dK/dV added into fp32 accumulators, as the
sequence-tiled layer calls it) and each backward kernel (``dkdv``, ``dq``), every candidate of
``attention_tuning.sweep_candidates`` (the kernel's built-in candidates first: the baseline)
is launched alone through ``ckpt_ext.kernels.attention.attention_bwd`` under
``attention_tuning.force``, the other kernel at its usual launch:

1. compiled (``--jobs`` worker processes compile ahead into Triton's cache while the main
   process measures), and skipped when the compiler reports spills or too much shared memory
   (the launchers would prune it: ``kernels/_launch.py``); ``--max-spills`` words per thread
   are let through and timed, to see whether a tile that spills a little beats the spill-free
   smaller ones (a winner that spills is written with its ``spills``, which the launcher then
   allows);
2. checked: its dQ / dK / dV against the usual launch's, relative error (norm) under 1e-2
   (half precision; fp32 1e-4), no NaN: a wrong or racy config never wins;
3. timed: the whole backward (pre-pass, dK/dV, dQ), CUDA events, the median of ``--reps``;
   then the ``--top`` fastest are timed again, interleaved, with ``2 * --reps``.

The fastest per (kernel, bucket) is written to ``--out`` (the winners file read at launch:
``CKPT_EXT_ATTN_BWD_CONFIGS``, or shipped as ``kernels/attention_bwd_configs.json``) after
every (kernel, bucket), with its time and the baseline's (the first built-in candidate that
fits: what ``CKPT_EXT_AUTOTUNE=0`` launches). Last, the two winners together against the two
baselines at ``--check-seq`` (B 1, whole causal sequence: the attention issue's S 32K goal).
TFLOP/s count the backward as 2.5 forwards (5 tile matmuls; 4 * B * Hq * D per visible pair
each forward), as bench/attention.py does. ``--budget`` (seconds) stops measuring new
candidates in time to write what was found.

On the CPU (``TRITON_INTERPRET=1``, tiny sizes, fp32 / fp16) the same path runs as a dry run:
the interpreter uses each candidate's block sizes; times are not figures.

  python bench/attention_bwd_sweep.py --out attention_bwd_configs.json           # GPU
  TRITON_INTERPRET=1 python bench/attention_bwd_sweep.py --device cpu --dtype fp32 \\
      --shape 1,2,1,16 --buckets 48:48,16:48 --block-m 16 --block-n 16,32 --limit 2 \\
      --check-seq 32 --out /tmp/w.json                                          # dry run
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--shape", default="1,32,8,128", help="B,Hq,Hkv,D (LLaMA-3-8B heads)")
    p.add_argument("--buckets", default="32768:32768,1056:32768,282:32768",
                   help="SQ:SK shape buckets, comma-separated; SQ < SK: a query chunk (the "
                        "last SQ positions, dK/dV into fp32 accumulators)")
    p.add_argument("--kernels", default="dkdv,dq")
    p.add_argument("--block-m", default="", help="BLOCK_M values (default: per kernel)")
    p.add_argument("--block-n", default="", help="BLOCK_N values (default: per kernel)")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3,4")
    p.add_argument("--maxnreg", default="none,168", help="register caps; 'none': no cap")
    p.add_argument("--num-ctas", default="1", help="cluster sizes (sm_90); 1: no cluster")
    p.add_argument("--max-spills", type=int, default=32,
                   help="time candidates that spill at most this many words per thread too "
                        "(the launchers keep none that spill unless a winner was measured "
                        "with spills; 0: spill-free ones only)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most N candidates per kernel after its built-in ones")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=4, help="re-timed finalists per kernel, bucket")
    p.add_argument("--check-seq", type=int, default=32768,
                   help="S of the last check (winners together against the baselines); 0: none")
    p.add_argument("--jobs", type=int, default=None,
                   help="compile workers (default: CPU count, at most 16, on CUDA; 0 on CPU)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: stop measuring new candidates after this")
    p.add_argument("--out", required=True, help="the winners file to write")
    p.add_argument("--commit", default=None, help="the commit to record (default: git)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def caps(text):
    return [None if x.strip().lower() == "none" else int(x) for x in text.split(",") if x]


def twin(n):
    """A small length that Triton's JIT specializes as it does n (its remainder mod 16, and
    whether it is 1): a compile worker's kernels are those the main process launches, in a
    launch that takes microseconds off the GPU the main process is timing on."""
    return n if n <= 64 else 64 + n % 16


def buckets_of(text):
    out = []
    for item in text.split(","):
        sq, _, sk = item.partition(":")
        sq, sk = int(sq), int(sk or sq)
        if not 0 < sq <= sk:
            raise SystemExit(f"--buckets: each SQ:SK needs 0 < SQ <= SK, got {item!r}")
        out.append((sq, sk))
    return out


def candidates(args, kind, family):
    from ckpt_ext.kernels import attention
    from ckpt_ext.kernels import attention_tuning as tuning

    return tuning.sweep_candidates(
        kind, block_m=ints(args.block_m) or None, block_n=ints(args.block_n) or None,
        warps=ints(args.warps), stages=ints(args.stages), maxnreg=caps(args.maxnreg),
        num_ctas=ints(args.num_ctas), limit=args.limit,
        baseline=attention.attention_configs(kind, family))


# ---- one bucket's inputs and its backward ------------------------------------------------------
class Bucket:
    """The inputs of one (SQ, SK) backward call and the usual launch's gradients."""

    def __init__(self, args, sq, sk, seed, measure=True):
        import torch

        from ckpt_ext.kernels import attention

        B, Hq, Hkv, D = ints(args.shape)
        if not measure:   # a compile worker: a small twin of the same specialization
            sq, off = twin(sq), twin(sk - sq)
            sk = sq + off
        self.sq, self.sk, self.offset = sq, sk, sk - sq
        self.dims = (B, Hq, Hkv, D)
        dtype = getattr(torch, DTYPES[args.dtype])
        dev = torch.device(args.device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.q, self.dout = (torch.randn(B, sq, Hq, D, generator=gen, device=dev,
                                         dtype=dtype).transpose(1, 2) for _ in range(2))
        self.k, self.v = (torch.randn(B, sk, Hkv, D, generator=gen, device=dev,
                                      dtype=dtype).transpose(1, 2) for _ in range(2))
        self.scale = D ** -0.5
        self.chunk = sq < sk
        self.accs = ([torch.zeros(B, Hkv, sk, D, device=dev, dtype=torch.float32)
                      for _ in range(2)] if self.chunk else [None, None])
        if not measure:   # a compile worker: the same specialization, values that run
            self.out = torch.randn_like(self.q)
            self.lse = torch.full((B, Hq, sq), 10.0, device=dev)
            return
        self.out, self.lse = attention.attention_fwd(self.q, self.k, self.v, None, None, None,
                                                     True, self.scale, self.offset)
        self.base = self.grads()

    @property
    def label(self):
        return (f"Sq={self.sq} Sk={self.sk}" + (f" q_offset={self.offset} dK/dV accumulated"
                                                if self.chunk else ""))

    def run(self):
        from ckpt_ext.kernels import attention

        return attention.attention_bwd(self.dout, self.q, self.k, self.v, self.out, self.lse,
                                       None, None, None, True, self.scale, self.offset,
                                       *self.accs)

    def grads(self):
        """(dq, dk, dv) of one call (accumulators zeroed first), copied."""
        if self.chunk:
            for a in self.accs:
                a.zero_()
        dq, dk, dv = self.run()
        if self.chunk:
            dk, dv = self.accs
        return [t.detach().float().clone() for t in (dq, dk, dv)]

    def flops(self):
        B, Hq, _, D = self.dims
        pairs = (self.sq * self.sq / 2 if not self.chunk
                 else self.sq * self.offset + self.sq * (self.sq + 1) / 2)
        return 2.5 * 4.0 * B * Hq * D * pairs


def sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, reps):
    """Median ms of ``reps`` calls (CUDA events on a GPU, the host clock on the CPU)."""
    import torch

    samples = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def sig(x):
    """x to 4 significant digits (a tiny dry-run figure stays positive)."""
    return float(f"{x:.4g}")


def rel_err(got, want):
    import torch

    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---- compile workers -----------------------------------------------------------------------
_W = {}


def _worker_init(argv):
    args = parse_args(argv)
    os.environ["CKPT_EXT_AUTOTUNE"] = "0"
    _W["args"] = args
    _W["buckets"] = [Bucket(args, sq, sk, args.seed, measure=False)
                     for sq, sk in buckets_of(args.buckets)]


def _worker_compile(kind, cand, index):
    """Compile (and run once) one candidate for one bucket into Triton's cache."""
    from ckpt_ext.kernels import attention_tuning as tuning

    try:
        with tuning.force(**{kind: cand}):
            _W["buckets"][index].run()
        sync(_W["args"].device)
        r = tuning.launch_reports().get((kind, cand))
        return None if r is None else (r.regs, r.spills, r.shared)
    except Exception as exc:   # reported by the main process when it runs the same
        return f"{type(exc).__name__}: {exc}"


# ---- the sweep -----------------------------------------------------------------------------
def provenance(args, device_name, triton_version):
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=30).stdout.strip()
            dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT,
                                   capture_output=True, timeout=30).returncode
            commit = (commit + ("+uncommitted changes" if dirty else "")) or "unknown"
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    import torch

    return {"command": " ".join(shlex.quote(a) for a in
                                ["python", os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "commit": commit,
            "machine": f"{device_name}; torch {torch.__version__}, CUDA {torch.version.cuda}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S UTC"),
            "triton": triton_version}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ["CKPT_EXT_AUTOTUNE"] = "0"   # the usual launch = the first built-in that fits
    import torch
    import triton

    from ckpt_ext.kernels import _launch
    from ckpt_ext.kernels import attention_tuning as tuning

    t_start = time.monotonic()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu with "
                         "TRITON_INTERPRET=1 for the dry run)")
    if not cuda and not _launch.INTERPRET:
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 set before triton is imported")
    if cuda:
        info = _launch.device_info(torch.device("cuda"))
        family, cap, budget = info.arch, info.capability, info.smem_budget
        device_name = (f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}, "
                       f"{info.sm_count} SMs)")
    else:
        family, cap, budget = "hopper", (9, 0), None
        device_name = "CPU, Triton interpreter (dry run: times are NOT figures)"
    arch = f"sm_{cap[0]}{cap[1]}"
    headers = provenance(args, device_name, triton.__version__)
    for key in tuning.HEADERS:
        print(f"# {key}: {headers[key]}")
    jobs = args.jobs if args.jobs is not None else (min(16, os.cpu_count() or 1) if cuda else 0)
    deadline = None if args.budget is None else t_start + args.budget
    half = args.dtype != "fp32"
    tol = 1e-2 if half else 1e-4
    kinds = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for k in kinds:
        if k not in tuning.KERNELS:
            raise SystemExit(f"--kernels: each must be one of {list(tuning.KERNELS)}, got {k!r}")
    bucket_shapes = buckets_of(args.buckets)
    cands = {k: candidates(args, k, family) for k in kinds}
    from ckpt_ext.kernels import attention

    builtin = {k: {tuning.Candidate.of_config(c) for c in attention.attention_configs(k, family)}
               for k in kinds}
    print(f"# sweep: {args.dtype}, B,Hq,Hkv,D {args.shape}, causal, buckets "
          f"{args.buckets}; candidates " + ", ".join(f"{k} {len(c)}" for k, c in cands.items())
          + f"; compile workers {jobs}; budget {args.budget} s")

    buckets = [Bucket(args, sq, sk, args.seed) for sq, sk in bucket_shapes]
    pool, futures = None, {}
    if jobs > 0:
        ctx = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init,
                                      initargs=(argv,))
        for bi in range(len(buckets)):
            for k in kinds:
                for c in cands[k]:
                    futures[(k, c, bi)] = pool.submit(_worker_compile, k, c, bi)

    entries, combined = [], {}
    out_path = Path(args.out)

    def over_budget():
        return deadline is not None and time.monotonic() > deadline

    stopped = False
    for bi, bucket in enumerate(buckets):
        for k in kinds:
            rows = []   # (ms, candidate)
            baseline = None
            spills = {}
            for c in cands[k]:
                if over_budget():
                    stopped = True
                    break
                fut = futures.get((k, c, bi))
                ahead = fut.result() if fut is not None else None
                if isinstance(ahead, tuple) and not _launch.fits(_launch.Resources(*ahead),
                                                                 budget, args.max_spills):
                    # the worker's compile of the same specialization: not launched here
                    print(f"{k} {bucket.label} {c.label}: pruned (regs {ahead[0]} spills "
                          f"{ahead[1]} smem {ahead[2]})")
                    continue
                note = ""
                try:
                    with tuning.force(**{k: c}):
                        got = bucket.grads()
                        sync(args.device)
                        res = tuning.launch_reports().get((k, c))
                        fits = True
                        if cuda:
                            fits = _launch.fits(res, budget, args.max_spills)
                        spills[c] = res.spills if res is not None else 0
                        if res is not None:
                            note = f"regs {res.regs} spills {res.spills} smem {res.shared}"
                        if not fits:
                            print(f"{k} {bucket.label} {c.label}: pruned ({note or 'no load'})")
                            continue
                        errs = [rel_err(g, b) for g, b in zip(got, bucket.base)]
                        if max(errs) > tol:
                            print(f"{k} {bucket.label} {c.label}: WRONG (rel err dq/dk/dv "
                                  + "/".join(f"{e:.1e}" for e in errs) + ")")
                            continue
                        ms = time_ms(bucket.run, args.device, args.reps)
                except Exception as exc:   # a config the device refuses: reported, skipped
                    print(f"{k} {bucket.label} {c.label}: FAILED {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}")
                    continue
                is_base = baseline is None and c in builtin[k] and not spills.get(c)
                if is_base:
                    baseline = (ms, c)
                rows.append((ms, c))
                print(f"{k} {bucket.label} {c.label}: {ms:.3f} ms, bwd "
                      f"{bucket.flops() / ms / 1e9:.1f} TFLOP/s, max rel err "
                      f"{max(errs):.1e}{', ' + note if note else ''}"
                      f"{' (baseline)' if is_base else ''}")
            if not rows:
                print(f"{k} {bucket.label}: nothing measured")
                if stopped:
                    break
                continue
            # the finalists again, interleaved, twice the repetitions
            finalists = [c for _, c in sorted(rows, key=lambda r: r[0])[:max(args.top, 1)]]
            if baseline is not None and baseline[1] not in finalists:
                finalists.append(baseline[1])
            again = {c: [] for c in finalists}
            for _ in range(2):
                for c in finalists:
                    with tuning.force(**{k: c}):
                        again[c].append(time_ms(bucket.run, args.device, args.reps))
            final = {c: min(v) for c, v in again.items()}
            win = min(final, key=final.get)
            base_ms = final[baseline[1]] if baseline is not None else None
            entry = tuning.Entry(
                kernel=k, arch=arch, dtype=args.dtype, head_dim=bucket.dims[3], causal=True,
                sq=bucket.sq, sk=bucket.sk, config=win,
                dq_atomic=False if k == "dkdv" else None,
                accumulate=bucket.chunk if k == "dkdv" else None,
                ms=sig(final[win]), baseline_ms=sig(base_ms) if base_ms else None,
                tflops=sig(bucket.flops() / final[win] / 1e9),
                baseline=baseline[1].label if baseline is not None else None,
                spills=spills.get(win, 0))
            entries.append(entry)
            combined.setdefault(bi, {})[k] = (win, baseline[1] if baseline else None)
            tuning.write_winners(out_path, headers, entries,
                                 note=f"sweep of {args.dtype}, B,Hq,Hkv,D {args.shape}, causal; "
                                      "ms: the whole backward with this kernel's config, the "
                                      "other kernel at its usual launch")
            print(f"winner {k} {bucket.label}: {win.label} {final[win]:.3f} ms"
                  + (f" / baseline {baseline[1].label} {base_ms:.3f} ms = "
                     f"{final[win] / base_ms:.3f}" if base_ms else " (no baseline fits)"))
            if stopped:
                break
        if stopped:
            print(f"budget of {args.budget} s reached: later candidates not measured")
            break
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    if not entries:
        tuning.write_winners(out_path, headers, [], note="the sweep measured nothing")
        print(f"wrote {out_path} (no entries)")
        return 1

    # the winners together against the baselines, at the whole-sequence check shape
    if args.check_seq and not (deadline is not None and time.monotonic() > deadline + 20):
        whole = next((bi for bi, b in enumerate(buckets) if not b.chunk), None)
        picks = combined.get(whole, {})
        if picks:
            del buckets
            check_args = parse_args(argv + ["--buckets", f"{args.check_seq}:{args.check_seq}"])
            bucket = Bucket(check_args, args.check_seq, args.check_seq, args.seed + 1)
            wins = {k: w for k, (w, _) in picks.items()}
            bases = {k: b for k, (_, b) in picks.items() if b is not None}
            times = {}
            for name, force in (("baseline", bases), ("winners", wins)):
                with tuning.force(**force):
                    got = bucket.grads()
                    errs = [rel_err(g, b) for g, b in zip(got, bucket.base)]
                    times[name] = time_ms(bucket.run, args.device, 2 * args.reps)
                print(f"check {bucket.label} {name} "
                      + " ".join(f"{k} {c.label}" for k, c in force.items())
                      + f": {times[name]:.3f} ms, bwd {bucket.flops() / times[name] / 1e9:.1f} "
                        f"TFLOP/s, max rel err {max(errs):.1e}")
            print(f"check {bucket.label}: winners / baseline = "
                  f"{times['winners'] / times['baseline']:.3f}")
    print(f"wrote {out_path}: {len(entries)} entries in {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
