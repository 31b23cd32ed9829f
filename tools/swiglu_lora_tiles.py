#!/usr/bin/env python
"""Which tile the LoRA backward SwiGLU kernel gets on sm_90, and which part of it costs the
registers: ahead-of-time compiles (no GPU) with tools/check_triton_compile.py's machinery.

1. The candidate chain (``swiglu_mlp.candidate_configs("bwd")``, in order, up to the first
   that the launcher keeps: no spills, shared memory within the H100's budget) of the bf16
   recompute backward with adapters on gate, up and down and the down adapter's dropout, as a
   frozen-base LoRA step launches it: ``--variant launched`` (the down adapter's dA and h'A^T
   sums outside the kernel: NEED_DAD / NEED_HA off, h stored) and ``--variant in-tile`` (the
   sums as atomic adds in the tiles, h not stored: the launcher before it moved them out).
2. With ``--parts``: each LoRA part alone at the 128x128x64 and 128x64x64 tiles.

    python tools/swiglu_lora_tiles.py [--variant launched in-tile] [--parts] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import check_triton_compile as aot

VARIANTS = {
    "launched": {"NEED_DAD": False, "NEED_HA": False, "STORE_H": True},
    "in-tile": {"NEED_DAD": True, "NEED_HA": True, "STORE_H": False},
}
NO_LORA = {"LORA_G": False, "LORA_U": False, "LORA_D": False, "DROP_D": False,
           "NEED_DAD": False, "NEED_HA": False, "STORE_H": False}
PARTS = {
    "no adapters": NO_LORA,
    "gate/up adapters only": {**NO_LORA, "LORA_G": True, "LORA_U": True},
    "down: dh term only": {**NO_LORA, "LORA_D": True, "DROP_D": True},
    "down: dh term + dA / h'A^T sums": {**NO_LORA, "LORA_D": True, "DROP_D": True,
                                         "NEED_DAD": True, "NEED_HA": True},
    "all, sums outside (launched)": VARIANTS["launched"],
    "all, sums in the tile": VARIANTS["in-tile"],
}
H100_SHARED = 232448   # bytes per block (kernels/_launch.py's budget on an H100)


def compile_bwd(sw, cuobjdump, meta, warps, stages, changes):
    sig, consts, attrs = aot.swiglu_signature(sw, "bwd_recompute", "bf16", meta, lora=True)
    consts = {**consts, **changes}
    job = {"module": "swiglu_mlp", "kernel": aot.SWIGLU_KERNEL["bwd_recompute"], "arch": 90,
           "signature": sig, "constexprs": consts, "attrs": attrs,
           "options": {"num_warps": warps, "num_stages": stages}, "budget": H100_SHARED}
    # a fresh cache for every compile, so that ptxas runs (and logs its spills) each time
    with tempfile.TemporaryDirectory(prefix="ckpt_ext_lora_tiles.") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        res = aot.compile_job(job, cuobjdump)
    return res, aot.aot_fits(job, res)


def line(label, meta, warps, stages, res, fits):
    if not res.get("ok"):
        return f"{label:34s} {aot._cfg_text(meta, warps, stages):28s} FAILED {res.get('error')}"
    return (f"{label:34s} {aot._cfg_text(meta, warps, stages):28s} regs {res.get('regs'):>3} "
            f"spill {res.get('spill_stores', '?')}/{res.get('spill_loads', '?')} B "
            f"stack {res.get('stack')} B {'kept' if fits else 'dropped'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", nargs="+", choices=sorted(VARIANTS),
                   default=["launched", "in-tile"])
    p.add_argument("--parts", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)
    aot._prepare_environment()
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    import triton
    att, sw, source = aot.load_kernel_modules(False)
    aot._MODULES["attention"], aot._MODULES["swiglu_mlp"] = att, sw
    cuobjdump = aot.find_cuobjdump()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ptxas = aot._tool_version(aot.ptxas_for(90))
    out = ["# the LoRA backward SwiGLU kernel's sm_90 tiles, compiled ahead of time (no GPU)",
           f"# command: python {' '.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}",
           f"# date: {date}; machine: CPU only (compiles, no launches)",
           f"# git: {aot._git_state()}; triton {triton.__version__}; ptxas {ptxas}",
           f"# kernels: {source}",
           ("# bf16, rank pad 16, tf32x3 adapter dots, H / I multiples of 16; kept = no spills "
            "and shared memory within the H100's budget (the launcher's rule)")]

    def emit(text):
        out.append(text)
        print(text, flush=True)

    for t in out:
        print(t)
    for name in a.variant:
        emit(f"\n== candidate chain, {name}")
        for cfg in sw.candidate_configs("bwd"):
            meta = dict(cfg.kwargs)
            res, fits = compile_bwd(sw, cuobjdump, meta, cfg.num_warps, cfg.num_stages,
                                    VARIANTS[name])
            emit(line(name, meta, cfg.num_warps, cfg.num_stages, res, fits))
            if fits:
                break
    if a.parts:
        emit("\n== each part alone")
        for bm, bn, warps, stages in ((128, 128, 8, 3), (128, 64, 8, 4)):
            meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "EPI_N": 32}
            for label, changes in PARTS.items():
                res, fits = compile_bwd(sw, cuobjdump, meta, warps, stages, changes)
                emit(line(label, meta, warps, stages, res, fits))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
