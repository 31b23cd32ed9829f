#!/usr/bin/env python
"""Ahead-of-time compile of the attention backward sweep's candidates for sm_90, no GPU needed.

Every candidate of ``attention_tuning.sweep_candidates`` for the dK/dV and dQ kernels (the
built-in ones first, in their order) is compiled for ``--arch`` (bf16, head_dim 128, causal,
no mask, dK/dV stored rather than accumulated: the whole-sequence specialization) with
``tools/check_triton_compile.py``'s machinery, and judged as the launchers judge it
(``kernels/_launch.py``: no spills, shared memory within the budget). The report says, per
kernel, what ``CKPT_EXT_AUTOTUNE=0`` launches today (the first built-in candidate that fits)
and how many sweep candidates fit: the part of the sweep a GPU run will time. The Triton that
compiles is the one importable (``PYTHONPATH=DIR`` for another, e.g. 3.6 as on the GPU image),
and its version heads the report.

  python tools/attention_bwd_aot.py [--arch 90] [--jobs 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import multiprocessing
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--kernels", default="dkdv,dq")
    p.add_argument("--limit", type=int, default=None, help="at most N after the built-in ones")
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args(argv)

    import check_triton_compile as t
    t._prepare_environment()
    import triton

    attention, _, how = t.load_kernel_modules(False)
    from ckpt_ext.kernels import attention_tuning as tuning
    from ckpt_ext.kernels import _launch

    family = "hopper" if args.arch >= 90 else "ampere"
    budget = t.SMEM_BUDGET.get(args.arch, 227 * 1024)
    cuobjdump = t.find_cuobjdump()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    lines = [f"# command: {' '.join(shlex.quote(a) for a in ['python'] + sys.argv)}",
             f"# commit: {commit}",
             f"# machine: ahead-of-time compile on the CPU for sm_{args.arch} (no GPU); "
             f"kernels from {how}",
             f"# triton: {triton.__version__} ({Path(triton.__file__).parent})",
             f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC",
             "# bf16, head_dim 128, causal, no mask, dK/dV stored; spills = (stack + local) / 4 "
             f"as the driver counts them; fits: no spills and shared <= {budget} B; HGMMA / "
             "HMMA: sm_90's warpgroup MMA / the warp MMA instructions in the SASS"]
    jobs = []
    for kind in [k for k in args.kernels.split(",") if k]:
        base = attention.attention_configs(kind, family)
        for c in tuning.sweep_candidates(kind, baseline=base, limit=args.limit):
            builtin = c in {tuning.Candidate.of_config(b) for b in base}
            jobs.append((kind, c, builtin, t.attention_job(
                attention, kind, c.blocks(), c.num_warps, c.num_stages, arch=args.arch,
                maxnreg=c.maxnreg, num_ctas=c.num_ctas, sass=True)))
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx, initializer=t._worker_init,
                                initargs=(False,)) as pool:
        results = list(pool.map(t.compile_job, [j[3] for j in jobs],
                                [cuobjdump] * len(jobs)))
    summary = {}
    for (kind, c, builtin, _), res in zip(jobs, results):
        r = t.aot_resources(res)
        fits = _launch.fits(r, budget)
        s = summary.setdefault(kind, {"n": 0, "fit": 0, "launched": None})
        s["n"] += 1
        s["fit"] += fits
        if builtin and fits and s["launched"] is None:
            s["launched"] = c.label
        what = (f"regs {r.regs:3d} spills {r.spills:4d} smem {r.shared:6d} "
                f"HGMMA {res.get('hgmma', '?'):>3} HMMA {res.get('hmma', '?'):>3}"
                if r is not None
                else f"no resources ({res.get('error') or res.get('cuobjdump_error')})")
        lines.append(f"{kind:4} {c.label:22} {'built-in' if builtin else 'sweep':8} {what} "
                     f"{'fits' if fits else 'pruned'}")
    for kind, s in summary.items():
        lines.append(f"summary {kind}: {s['fit']} of {s['n']} candidates fit; CKPT_EXT_AUTOTUNE=0 "
                     f"launches {s['launched'] or 'none of the built-in ones (the least spilling)'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
