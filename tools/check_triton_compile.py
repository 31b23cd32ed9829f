#!/usr/bin/env python
"""Ahead-of-time compile check of ckpt_ext's Triton kernels for sm_90 / sm_80, no GPU needed.

Every ``@triton.jit`` kernel of ``kernels/attention.py`` and ``kernels/swiglu_mlp.py`` is
compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` for the
launch configurations the launchers can pick, and the resources of each cubin are reported:
dynamic shared memory (``metadata.shared``), registers / stack / static shared / local memory
(``cuobjdump --dump-resource-usage``) and spill bytes (the ``ptxas -v`` log that Triton prints
with ``TRITON_DUMP_PTXAS_LOG=1``). Each compile is judged as the launchers judge it on a GPU
(``kernels/_launch.py``: ``fits`` on the ``Resources`` the driver would report: registers,
local memory / 4 as spills, shared memory against the per-block budget, 227 KiB H100,
163 KiB A100), so the report says which candidate each specialization launches.

Sweep (``--quick`` keeps a few entries of each part):
  attention  bf16, HEAD_DIM 128 and 64, CAUSAL False/True, no mask: every candidate config of
             the arch family (90 -> hopper, 80 -> ampere) for fwd, dkdv and dq;
             one axis at a time, the candidates compiled in order up to the first that fits
             (what CKPT_EXT_AUTOTUNE=0 launches): fp16, fp32, HEAD_DIM 16/80/256, key padding
             mask,
             plus the corner fp32 + HEAD_DIM 256 + mask; the D = rowsum(dO * O) pre-pass once
             per (dtype, HEAD_DIM).
  softcap    (only when named with --part) the attention kernels with SOFTCAP, causal: bf16
             every candidate at HEAD_DIM 128 and 64; the first fitting config of fp16 / fp32
             HEAD_DIM 128 and bf16 HEAD_DIM 256; the atomic-dQ dK/dV kernel (bf16, 128).
  swiglu     bf16, every candidate of swiglu_mlp.candidate_configs: forward (STORE_GATE_UP
             False/True) and the recompute backward, no biases, DOT_IEEE False, and both with
             LoRA adapters on every projection (rank pad 16); with the first fitting config (what
             CKPT_EXT_AUTOTUNE=0 launches): fp16, fp32 with DOT_IEEE True and both biases, and
             the save="gate_up" backward (RECOMPUTE False) per dtype and with LoRA; the
             persistent-grid variants (CKPT_EXT_SWIGLU_GRID=persistent) of the first fitting
             bf16 configs (forward, and backward without LoRA). Backward candidates are one per
             epilogue piece width (EPI_N, ``e32`` in the config column), widest first; the
             first fitting LoRA configs at rank pads 32 and
             64; and the GeGLU variants (ACTIVATION "gelu_tanh") of the first fitting bf16
             configs, forward and both backward kinds, with and without LoRA.

Specialization model (what Triton's JIT would derive at a typical launch): contiguous tensors
with 16-byte aligned data, so pointers carry ``tt.divisibility=16``, unit strides are the
constant 1 (the JIT turns an int argument equal to 1 into a constexpr), the other strides and
the model sizes (head_dim multiples, H, I) are multiples of 16; sequence length / token count,
head counts and GQA group are left unspecialized.

Usage:
  python tools/check_triton_compile.py [--arch 90 80] [--quick] [--jobs N] [--out PATH]

The kernels come from ``ckpt_ext.kernels`` when that imports, else (e.g. a virtual environment
where ckpt_ext is not installed or its extension does not load) they are loaded by path from
this checkout's ``kernels/`` as the package ``ckpt_ext_kernels_aot.kernels``;
``--kernels-from-path`` forces the latter. Triton compiles into a fresh temporary cache directory (removed at the end)
so that every kernel really goes through ptxas and its log is seen. Exit status 1 when any
compile fails or when a bf16/fp16 specialization has no candidate that fits (the launcher then
falls back to the one that spills least; ``--allow-spills`` reports those without failing). ``--part`` limits the sweep to attention or
swiglu.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime
import importlib
import importlib.util
import io
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FALLBACK_PACKAGE = "ckpt_ext_kernels_aot"

# Per-block shared memory a kernel may opt into (bytes), as the launch policy falls back to.
SMEM_BUDGET = {90: 227 * 1024, 80: 163 * 1024}
ARCH_FAMILY = {90: "hopper", 80: "ampere"}
TYPE_NAME = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
HALF = ("bf16", "fp16")          # dtypes whose kept configs must not spill
ELT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}

ATTN_KERNEL = {"fwd": "_attn_fwd_kernel", "dkdv": "_attn_bwd_dkdv_kernel",
               "dq": "_attn_bwd_dq_kernel", "pre": "_attn_bwd_preprocess_kernel"}
SWIGLU_KERNEL = {"fwd": "_swiglu_fwd_kernel", "bwd_recompute": "_swiglu_bwd_recompute_kernel",
                 "bwd_gate_up": "_swiglu_bwd_recompute_kernel"}
# Triton's defaults for a plain kernel[grid](...) launch without num_warps / num_stages.
JIT_DEFAULT_WARPS, JIT_DEFAULT_STAGES = 4, 3


# --------------------------------------------------------------------------------------------
# Loading the kernel modules
# --------------------------------------------------------------------------------------------
def _load_by_path():
    """Load this checkout's kernels/ as the synthetic package FALLBACK_PACKAGE.kernels, whose
    parent stands for ckpt_ext without running its __init__ (the kernels import
    ``ckpt_ext._checks``, plain Python, relatively)."""
    import types

    pkg_dir = REPO / "kernels"
    name = f"{FALLBACK_PACKAGE}.kernels"
    if name not in sys.modules:
        parent = types.ModuleType(FALLBACK_PACKAGE)
        parent.__path__ = [str(REPO / "ckpt_ext")]
        sys.modules[FALLBACK_PACKAGE] = parent
        spec = importlib.util.spec_from_file_location(
            name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
    attention = importlib.import_module(f"{name}.attention")
    swiglu_mlp = importlib.import_module(f"{name}.swiglu_mlp")
    return attention, swiglu_mlp


def load_kernel_modules(force_path: bool):
    """(attention, swiglu_mlp, how they were found)."""
    note = ""
    if not force_path:
        try:
            from ckpt_ext.kernels import attention, swiglu_mlp
            return attention, swiglu_mlp, "ckpt_ext.kernels"
        except Exception as exc:  # noqa: BLE001 - any import problem means: use the files
            first = (str(exc).splitlines() or [""])[0]
            note = f" (ckpt_ext.kernels not importable: {type(exc).__name__}: {first[:160]})"
    attention, swiglu_mlp = _load_by_path()
    return attention, swiglu_mlp, (f"{FALLBACK_PACKAGE}.kernels loaded from "
                                   f"{REPO / 'kernels'}{note}")


def _prepare_environment():
    """Compile for real GPUs (not the interpreter) and let ptxas logs reach the workers."""
    removed = os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    return removed


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------
_MODULES = {}


def _worker_init(force_path: bool):
    _prepare_environment()
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    attention, swiglu_mlp, _ = load_kernel_modules(force_path)
    _MODULES["attention"] = attention
    _MODULES["swiglu_mlp"] = swiglu_mlp


_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_RESOURCE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _cubin_resources(cubin: bytes, cuobjdump: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        proc = subprocess.run([cuobjdump, "--dump-resource-usage", path],
                              capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(path)
    m = _RESOURCE.search(proc.stdout)
    if not m:
        return {"cuobjdump_error": _first_line(proc.stderr or proc.stdout) or "no resource line"}
    reg, stack, shared, local = map(int, m.groups())
    return {"regs": reg, "stack": stack, "static_shared": shared, "local": local}


def compile_job(job: dict, cuobjdump: str) -> dict:
    """Compile one kernel specialization; returns the job's result fields."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = getattr(_MODULES[job["module"]], job["kernel"])
    res = {"ok": False}
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=job["signature"],
                                        constexprs=job["constexprs"], attrs=job["attrs"])
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", job["arch"], 32),
                                      options=job["options"])
    except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
        res["seconds"] = time.perf_counter() - t0
        text = f"{type(exc).__name__}: {exc}"
        res["error"] = _first_line(text)
        res["error_detail"] = "\n".join(text.splitlines()[:25])
        return res
    res["seconds"] = time.perf_counter() - t0
    res["ok"] = True
    res["shared"] = int(compiled.metadata.shared)
    res.update(_cubin_resources(compiled.asm["cubin"], cuobjdump))
    ptxas = log.getvalue()
    frame = _PTXAS_FRAME.search(ptxas)
    regs = _PTXAS_REGS.search(ptxas)
    if frame:
        res["spill_stores"], res["spill_loads"] = int(frame.group(2)), int(frame.group(3))
    if regs:
        res["ptxas_regs"] = int(regs.group(1))
    if job.get("sass"):   # which matrix instructions the cubin uses (sm_90: HGMMA = wgmma)
        res.update(_sass_mma_counts(compiled.asm["cubin"], cuobjdump))
    return res


def _sass_mma_counts(cubin: bytes, cuobjdump: str) -> dict:
    """Counts of HGMMA (sm_90's warpgroup MMA), HMMA (the older warp MMA) and LDL / STL
    (local memory: spills) instructions in a cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        proc = subprocess.run([cuobjdump, "--dump-sass", path], capture_output=True, text=True,
                              timeout=300)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        return {"sass_error": _first_line(proc.stderr or proc.stdout) or "cuobjdump failed"}
    return {op.lower(): len(re.findall(rf"\b{op}\b", proc.stdout))
            for op in ("HGMMA", "HMMA", "LDL", "STL")}


def _launch_module():
    """kernels/_launch.py as the loaded kernel modules import it."""
    if "attention" not in _MODULES:
        _MODULES["attention"], _MODULES["swiglu_mlp"], _ = load_kernel_modules(False)
    return _MODULES["attention"]._launch


def aot_resources(res: dict):
    """What the driver would report for a compile (``_launch.Resources``): registers, and
    spills as the driver's n_spills counts them (its per-thread local memory, which holds
    ptxas's stack frame, / 4) from cuobjdump; shared memory from the metadata. None when the
    compile or cuobjdump failed."""
    if not res.get("ok") or "regs" not in res:
        return None
    return _launch_module().Resources(res["regs"], (res["stack"] + res["local"]) // 4,
                                      res["shared"])


def aot_fits(job: dict, res: dict) -> bool:
    """Whether the launcher keeps this compile (``_launch.fits``)."""
    return _launch_module().fits(aot_resources(res), job["budget"])


def _run_job(job: dict, cuobjdump: str) -> dict:
    """One compile, or a chain: its candidates compiled in order up to the first that fits
    (what CKPT_EXT_AUTOTUNE=0 launches)."""
    if "chain" not in job:
        return compile_job(job, cuobjdump)
    done = []
    for sub in job["chain"]:
        done.append(compile_job(sub, cuobjdump))
        if aot_fits(sub, done[-1]):
            break
    return {"ok": all(r.get("ok") for r in done), "chain": done}


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------
def make_signature(fn, pointers: dict, unit: set, div16: set, floats: set, constexprs: dict):
    """Triton signature / constexprs / attrs of ``fn`` under the specialization model.

    pointers: arg -> element type ("bf16", "fp32", "u8"); unit: int args equal to 1 (passed as
    constexpr 1, as the JIT does); div16: int args that are multiples of 16; floats: fp32 args;
    constexprs: the tl.constexpr args. Every other argument is a plain i32.
    """
    names = list(fn.arg_names)
    declared = {p.name for p in fn.params if p.is_constexpr}
    known = set(pointers) | unit | div16 | floats | set(constexprs)
    unknown = known - set(names)
    if unknown:
        raise SystemExit(f"{fn.__name__}: arguments {sorted(unknown)} are not parameters of the "
                         f"kernel (its parameters: {names}); update this script")
    missing = declared - set(constexprs)
    if missing:
        raise SystemExit(f"{fn.__name__}: no value for the constexpr parameters {sorted(missing)}")
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in unit:
            signature[name] = "constexpr"
            consts[name] = 1
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, consts, attrs


def _strides(prefixes, dims="bhsd"):
    return [f"stride_{p}{d}" for p in prefixes for d in dims]


def attention_job(attention, kind: str, blocks: dict, num_warps: int, num_stages: int, *,
                  arch: int = 90, maxnreg=None, num_ctas: int = 1, sass: bool = False) -> dict:
    """``compile_job``'s job for one launch configuration of an attention kernel (``kind``:
    an ``ATTN_KERNEL`` key) in its common specialization: bf16, head_dim 128, causal, no mask;
    ``blocks`` its block sizes (BLOCK_M, BLOCK_N), the rest the launch options."""
    sig, consts, attrs = attention_signature(attention, kind, "bf16", 128, True, False, blocks)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if num_ctas != 1:
        options["num_ctas"] = num_ctas
    return dict(module="attention", kernel=ATTN_KERNEL[kind], arch=arch, signature=sig,
                constexprs=consts, attrs=attrs, options=options, sass=sass)


def attention_signature(attention, kind: str, dtype: str, head_dim: int, causal: bool,
                        has_mask: bool, meta: dict, dq_atomic: bool = False,
                        softcap: bool = False, dq_ordered: bool = False):
    """(signature, constexprs, attrs) of an attention kernel as its launcher passes them
    (dq_atomic: the dK/dV kernel of CKPT_EXT_ATTN_DQ=atomic; dq_ordered, with dq_atomic: of
    CKPT_EXT_ATTN_DQ=ordered; softcap: SOFTCAP, the capped scores)."""
    import torch

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    common = attention._common_meta(head_dim, causal, tdtype)
    fn = getattr(attention, ATTN_KERNEL[kind])
    if kind == "pre":
        pointers = {"Out": dtype, "DOut": dtype, "Lse": "fp32", "Delta": "fp32", "Lse2": "fp32"}
        strides = _strides("og")
        consts = {"HEAD_DIM": head_dim, "D_PAD": common["D_PAD"], "BLOCK_M": meta["BLOCK_M"]}
        # row_pitch: Sq rounded up to attention._ROW_PITCH, a multiple of 16 as the JIT sees it
        return make_signature(fn, pointers, {s for s in strides if s.endswith("d")},
                              {s for s in strides if not s.endswith("d")} | {"row_pitch"},
                              set(), consts)
    out_names = {"fwd": ["Out"], "dkdv": ["DK", "DV"], "dq": ["DQ"]}[kind]
    pointers = {n: dtype for n in ["Q", "K", "V"] + out_names}
    pointers["Mask"] = "u8" if has_mask else dtype  # bool mask viewed as uint8, else q itself
    for name in ("SegId", "SegLo", "SegHi"):        # no segment ids: q itself
        pointers[name] = dtype
    pointers["Lse" if kind == "fwd" else "Lse2"] = "fp32"
    prefixes = {"fwd": ["q", "k", "v", "o"], "dq": ["q", "k", "v", "g", "d"],
                "dkdv": ["q", "k", "v", "g", "d", "a"]}[kind]
    if kind != "fwd":
        pointers["DOut"] = dtype
        pointers["Delta"] = "fp32"
    if kind == "dkdv":
        pointers["DQA"] = "fp32"  # the fp32 dQ sums (atomic mode), else dq itself
        pointers["Sem"] = "i32"   # the ordered sums' counters, else delta (never read)
    strides = _strides(prefixes)
    unit = {s for s in strides if s.endswith("d")}
    div16 = {s for s in strides if not s.endswith("d")} | {"S_BUCKET", "SQ_BUCKET"}
    if kind != "fwd":
        div16.add("row_pitch")  # Sq rounded up to attention._ROW_PITCH
    if has_mask:
        unit.add("stride_ms")          # contiguous (B, S) mask; stride_mb = S, unspecialized
    else:
        div16 |= {"stride_mb", "stride_ms"}   # both 0 when there is no mask
    floats = {"qk_scale", "cap_in", "cap_out"} | (set() if kind == "fwd" else {"sm_scale"})
    consts = dict(common, HAS_MASK=has_mask, HAS_SEG=False, WINDOW=False, SOFTCAP=softcap,
                  BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"])
    if kind == "dkdv":
        consts["DQ_ATOMIC"] = dq_atomic or dq_ordered
        consts["DQ_ORDERED"] = dq_ordered
        consts["ACCUMULATE"] = False  # dk / dv stored (no query-chunk accumulators)
    return make_signature(fn, pointers, unit, div16, floats, consts)


def swiglu_signature(swiglu_mlp, kind: str, dtype: str, meta: dict, store_gate_up=False,
                     biases=False, dot_ieee=False, lora=False, persistent=False, rank_pad=16,
                     activation="silu"):
    """kind: fwd, bwd_recompute (save="input") or bwd_gate_up (the same kernel reading the
    saved gate/up). lora: adapters on all three projections (rank pad ``rank_pad``) and the
    down adapter's dropout on (DROP_D, the mask hashed in the tile: the heaviest variant the
    launcher runs; its backward stores h and leaves the down adapter's dA / h'A^T sums,
    NEED_DAD / NEED_HA, to swiglu_mlp._down_pieces); without, the LoRA buffers are the unused
    fp32 placeholders.
    persistent: the CKPT_EXT_SWIGLU_GRID=persistent variant (programs loop over tiles).
    activation: the ACTIVATION constexpr ("silu", or "gelu_tanh" for GeGLU)."""
    fn = getattr(swiglu_mlp, SWIGLU_KERNEL[kind])
    ptr_names = ["x_ptr", "wg_ptr", "wu_ptr", "bg_ptr", "bu_ptr"]
    ptr_names += (["h_ptr", "gate_ptr", "up_ptr"] if kind == "fwd"
                  else ["dh_ptr", "dgate_ptr", "dup_ptr", "h_ptr", "gate_ptr", "up_ptr"])
    pointers = {n: dtype for n in ptr_names}
    lora_ptrs = ["xag_ptr", "lbg_ptr", "xau_ptr", "lbu_ptr", "lad_ptr", "ha_ptr"]
    if kind != "fwd":
        lora_ptrs += ["dyb_ptr", "dlad_ptr"]
    pointers.update({n: "fp32" for n in lora_ptrs})
    unit = {"stride_xh", "stride_wgh", "stride_wuh", "stride_oi"}
    div16 = {"H", "I", "T_BUCKET", "stride_xt", "stride_wgi", "stride_wui", "stride_ot"}
    floats = {"s_g", "s_u", "inv_d"} if kind == "fwd" else {"s_g", "s_u", "s_d", "inv_d"}
    if kind != "fwd":
        unit.add("stride_dhi")
        div16.add("stride_dht")
    consts = {"HAS_BG": biases, "HAS_BU": biases, "DOT_IEEE": dot_ieee,
              "LORA_G": lora, "LORA_U": lora, "LORA_D": lora, "R_G": rank_pad, "R_U": rank_pad,
              "R_D": rank_pad, "DROP_D": lora, "PERSISTENT": persistent, "ACTIVATION": activation,
              # the adapters' dots as swiglu_mlp._lora_precision chooses them under torch's
              # default "highest" float32 matmul precision
              "LORA_PREC": ("ieee" if dot_ieee else "tf32") if dtype == "fp32" else "tf32x3",
              **{k: meta[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}}
    if kind == "fwd":
        consts["STORE_GATE_UP"] = store_gate_up
    else:
        consts.update(RECOMPUTE=kind == "bwd_recompute", STORE_H=True, EPI_N=meta["EPI_N"],
                      NEED_DAD=False, NEED_HA=False)
    return make_signature(fn, pointers, unit, div16, floats, consts)


# --------------------------------------------------------------------------------------------
# Job list
# --------------------------------------------------------------------------------------------
def _cfg_text(meta: dict, warps: int, stages: int) -> str:
    if "BLOCK_K" in meta:
        epilogue = f" e{meta['EPI_N']}" if "EPI_N" in meta else ""
        return (f"{meta['BLOCK_M']}x{meta['BLOCK_N']}x{meta['BLOCK_K']} g{meta['GROUP_M']}"
                f"{epilogue} w{warps} s{stages}")
    if "BLOCK_N" in meta:
        return f"{meta['BLOCK_M']}x{meta['BLOCK_N']} w{warps} s{stages}"
    return " ".join(f"{k}={v}" for k, v in meta.items()) + f" w{warps} s{stages}"


def build_jobs(attention, swiglu_mlp, archs, quick: bool, parts=("attention", "swiglu")) -> list:
    jobs = []

    def add(**job):
        job["id"] = len(jobs)
        jobs.append(job)

    def chain(subjobs):
        """Candidates compiled in order up to the first that fits (one job for the pool)."""
        add(chain=subjobs, short=subjobs[0]["short"], arch=subjobs[0]["arch"],
            dtype=subjobs[0]["dtype"], spec=subjobs[0]["spec"], config="(in order)",
            part=subjobs[0]["part"], cost=sum(j["cost"] for j in subjobs))

    for arch in archs:
        family = ARCH_FAMILY[arch]
        budget = SMEM_BUDGET[arch]

        # ---- attention -----------------------------------------------------------------
        pre_done = set()

        def add_pre(dtype, head_dim):
            if (dtype, head_dim) in pre_done:
                return
            pre_done.add((dtype, head_dim))
            meta = dict(attention.pre_config().kwargs)
            sig, consts, attrs = attention_signature(attention, "pre", dtype, head_dim, False,
                                                     False, meta)
            add(module="attention", kernel=ATTN_KERNEL["pre"], short="attn_pre", arch=arch,
                dtype=dtype, spec=f"D{head_dim}", config=_cfg_text(
                    meta, JIT_DEFAULT_WARPS, JIT_DEFAULT_STAGES), part="attention",
                signature=sig, constexprs=consts, attrs=attrs,
                options={"num_warps": JIT_DEFAULT_WARPS, "num_stages": JIT_DEFAULT_STAGES},
                cost=head_dim)

        def attn_job(kind, cfg, dtype, head_dim, causal, has_mask, part, dq_atomic=False,
                     softcap=False):
            sig, consts, attrs = attention_signature(attention, kind, dtype, head_dim, causal,
                                                     has_mask, cfg.kwargs, dq_atomic, softcap)
            d_pad = consts["D_PAD"]
            spec = f"D{head_dim}" + (f"(pad{d_pad})" if d_pad != head_dim else "")
            spec += " causal" if causal else " full"
            spec += " mask" if has_mask else ""
            spec += " atomic-dq" if dq_atomic else ""
            spec += " softcap" if softcap else ""
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            return dict(module="attention", kernel=ATTN_KERNEL[kind], short=f"attn_{kind}",
                        arch=arch, dtype=dtype, spec=spec,
                        config=_cfg_text(cfg.kwargs, cfg.num_warps, cfg.num_stages),
                        part=part, signature=sig, constexprs=consts, attrs=attrs,
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                        budget=budget, head_dim=head_dim, causal=causal,
                        # fp32 (IEEE) dots are lowered to FMAs: far longer ptxas runs than
                        # bf16 tiles.
                        cost=bm * bn * d_pad * (16 if dtype == "fp32" else 1)
                        * (2 if kind != "fwd" else 1))

        def attn_first(kind, *spec, **flags):
            chain([attn_job(kind, c, *spec, **flags)
                   for c in attention.attention_configs(kind, family)])

        head_dims = [128] if quick else [128, 64]
        causals = [True] if quick else [False, True]
        for head_dim in (head_dims if "attention" in parts else []):
            add_pre("bf16", head_dim)
            for kind in ("fwd", "dkdv", "dq"):
                cands = attention.attention_configs(kind, family)
                for cfg in (cands[:2] if quick else cands):
                    for causal in causals:
                        add(**attn_job(kind, cfg, "bf16", head_dim, causal, False,
                                       "attention-configs"))

        variants = [("fp16", 128, False), ("fp32", 128, False), ("bf16", 16, False),
                    ("bf16", 80, False), ("bf16", 256, False), ("bf16", 128, True),
                    ("fp32", 256, True)]
        if quick:
            variants = [("fp32", 128, False), ("bf16", 80, True)]
        for dtype, head_dim, has_mask in (variants if "attention" in parts else []):
            add_pre(dtype, head_dim)
            for kind in ("fwd", "dkdv", "dq"):
                for causal in causals:
                    attn_first(kind, dtype, head_dim, causal, has_mask,
                               "attention-specializations")
        # CKPT_EXT_ATTN_DQ=atomic: the dK/dV kernel that also adds dQ with atomics
        for dtype, head_dim in ((("bf16", 128), ("bf16", 64)) if "attention" in parts else ()):
            for causal in causals:
                attn_first("dkdv", dtype, head_dim, causal, False, "attention-specializations",
                           dq_atomic=True)
        # softcap > 0 (SOFTCAP): bf16 causal, every candidate at HEAD_DIM 128 and 64, the first
        # fitting one of the other dtypes and of HEAD_DIM 256, and the atomic-dQ dK/dV kernel
        if "softcap" in parts:
            capped = [("bf16", 128, True), ("bf16", 64, True), ("fp16", 128, False),
                      ("fp32", 128, False), ("bf16", 256, False)]
            if quick:
                capped = [("bf16", 128, False)]
            for dtype, head_dim, every in capped:
                for kind in ("fwd", "dkdv", "dq"):
                    if every:
                        for cfg in attention.attention_configs(kind, family):
                            add(**attn_job(kind, cfg, dtype, head_dim, True, False,
                                           "attention-softcap", softcap=True))
                    else:
                        attn_first(kind, dtype, head_dim, True, False, "attention-softcap",
                                   softcap=True)
            attn_first("dkdv", "bf16", 128, True, False, "attention-softcap", dq_atomic=True,
                       softcap=True)

        # ---- swiglu ----------------------------------------------------------------------
        def swiglu_job(kind, dtype, cfg, store=False, biases=False, ieee=False, lora=False,
                       persistent=False, rank_pad=16, activation="silu"):
            meta, warps, stages = cfg.kwargs, cfg.num_warps, cfg.num_stages
            sig, consts, attrs = swiglu_signature(swiglu_mlp, kind, dtype, meta, store, biases,
                                                  ieee, lora, persistent, rank_pad, activation)
            bits = ["gelu_tanh"] if activation != "silu" else []
            bits += ["saved_gate_up"] if kind == "bwd_gate_up" else []
            bits += ["persistent"] if persistent else []
            if kind == "fwd":
                bits.append("store_gate_up" if store else "no_store")
            bits.append("bias" if biases else "no_bias")
            bits.append("ieee" if ieee else "tc")
            if lora:
                bits.append("lora+drop" + (f" r{rank_pad}" if rank_pad != 16 else ""))
            cost = (meta.get("BLOCK_M", 1) * meta.get("BLOCK_N", 1) * meta.get("BLOCK_K", 1)
                    * ELT_SIZE[dtype] * (8 if lora else 1))
            return dict(module="swiglu_mlp", kernel=SWIGLU_KERNEL[kind], short=f"swiglu_{kind}",
                        arch=arch, dtype=dtype, spec=" ".join(bits) or "-",
                        config=_cfg_text(meta, warps, stages), part="swiglu", signature=sig,
                        constexprs=consts, attrs=attrs,
                        options={"num_warps": warps, "num_stages": stages}, cost=cost,
                        budget=budget)

        def candidates(kind, epilogue="subtiled"):
            return swiglu_mlp.candidate_configs("fwd" if kind == "fwd" else "bwd", epilogue)

        def swiglu_first(kind, dtype, **flags):
            # the launcher keeps the widest epilogue piece that fits of each tile; in order,
            # the first that fits is the first it launches
            chain([swiglu_job(kind, dtype, c, **flags) for c in candidates(kind)])

        if "swiglu" in parts:
            for lora in (False, True):
                for kind, store in (("fwd", False), ("fwd", True), ("bwd_recompute", False)):
                    if lora and store:
                        continue
                    cands = candidates(kind)
                    for cfg in (cands[:2] if quick else cands):
                        add(**swiglu_job(kind, "bf16", cfg, store=store, lora=lora))
            for dtype in (["fp32"] if quick else ["fp16", "fp32"]):
                half = dtype != "fp32"
                for store in (False, True):
                    swiglu_first("fwd", dtype, store=store, biases=not half, ieee=not half)
                swiglu_first("bwd_recompute", dtype, biases=not half, ieee=not half)
                if half:
                    swiglu_first("fwd", dtype, lora=True)
                    swiglu_first("bwd_recompute", dtype, lora=True)
            # save="gate_up": the same backward kernel reading the saved gate/up.
            for dtype in (["bf16"] if quick else ["bf16", "fp16", "fp32"]):
                swiglu_first("bwd_gate_up", dtype, ieee=dtype == "fp32")
            swiglu_first("bwd_gate_up", "bf16", lora=True)
            # larger adapter ranks (rank pads 32 and 64)
            for rank_pad in (() if quick else (32, 64)):
                for kind in ("fwd", "bwd_recompute"):
                    swiglu_first(kind, "bf16", lora=True, rank_pad=rank_pad)
            # CKPT_EXT_SWIGLU_GRID=persistent (the LoRA backward keeps one program per tile: its
            # loop spills on sm_90).
            for kind, lora in (("fwd", False), ("fwd", True), ("bwd_recompute", False)):
                swiglu_first(kind, "bf16", lora=lora, persistent=True)
            # ACTIVATION="gelu_tanh" (GeGLU), with and without LoRA (its epilogue keeps g live
            # for the derivative).
            for kind, lora in (("bwd_recompute", False), ("fwd", False),
                               ("bwd_recompute", True), ("fwd", True), ("bwd_gate_up", False),
                               ("bwd_gate_up", True))[:2 if quick else None]:
                swiglu_first(kind, "bf16", lora=lora, activation="gelu_tanh")
    return jobs


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _fmt(value, width, right=True):
    text = "-" if value is None else str(value)
    return text.rjust(width) if right else text.ljust(width)


def _spill_text(r):
    if not r.get("ok"):
        return None
    if "spill_stores" not in r:
        return "?"
    return f"{r['spill_stores']}/{r['spill_loads']}"


def format_table(rows) -> list:
    cols = [("kernel", 30, False), ("arch", 5, False), ("dtype", 5, False),
            ("specialization", 26, False), ("config", 22, False), ("ok", 4, False),
            ("shared", 7, True), ("regs", 4, True), ("spill st/ld", 11, True),
            ("stack", 5, True), ("local", 5, True), ("fits", 4, False),
            ("launch", 6, False), ("s", 5, True)]
    head = " ".join(_fmt(n, w, r) for n, w, r in cols)
    lines = [head, "-" * len(head)]
    for j, r in rows:
        fits = None
        if r.get("ok") and "budget" in j:
            fits = "yes" if aot_fits(j, r) else "NO"
        vals = [j["kernel"], f"sm{j['arch']}", j["dtype"], j["spec"], j["config"],
                "ok" if r.get("ok") else "FAIL", r.get("shared"), r.get("regs"),
                _spill_text(r), r.get("stack"), r.get("local"), fits,
                "first" if j.get("first") else None, f"{r.get('seconds', 0):.1f}"]
        lines.append(" ".join(_fmt(v, w, rt) for v, (_, w, rt) in zip(vals, cols)))
    return lines


def mark_launched(rows) -> list:
    """Mark (``first``) the row each specialization launches with CKPT_EXT_AUTOTUNE=0: the
    first of its candidates, in order, that fits (every earlier one was compiled: a whole
    sweep or a chain); returns the bf16/fp16 specializations where none fits."""
    groups = {}
    for j, r in rows:
        if "budget" in j:
            groups.setdefault((j["kernel"], j["arch"], j["dtype"], j["spec"]), []).append((j, r))
    none_fits = []
    for key, members in groups.items():
        first = next((j for j, r in members if r.get("ok") and aot_fits(j, r)), None)
        if first is not None:
            first["first"] = True
        elif key[2] in HALF:
            none_fits.append(key)
    return none_fits


def _spills(r) -> bool:
    return bool(r.get("spill_stores", 0) or r.get("spill_loads", 0) or r.get("local", 0))


def summarize(rows, allow_spills: bool = False) -> tuple:
    lines = []
    failures = [(j, r) for j, r in rows if not r.get("ok")]
    by_kernel = {}
    for j, r in rows:
        key = (j["kernel"], j["arch"])
        n_ok, n = by_kernel.get(key, (0, 0))
        by_kernel[key] = (n_ok + bool(r.get("ok")), n + 1)
    lines.append(f"compiles: {len(rows)}, ok: {len(rows) - len(failures)}, failed: {len(failures)}")
    for (kernel, arch), (n_ok, n) in sorted(by_kernel.items()):
        lines.append(f"  {kernel:32s} sm{arch}: {n_ok}/{n} ok")

    lines.append("")
    lines.append(f"failures: {len(failures)}")
    for j, r in failures:
        lines.append(f"  {j['kernel']} sm{j['arch']} {j['dtype']} {j['spec']} [{j['config']}]: "
                     f"{r.get('error', '?')}")
        for detail in r.get("error_detail", "").splitlines()[1:]:
            lines.append(f"      | {detail}")

    spills = [(j, r) for j, r in rows if r.get("ok") and (r.get("spill_stores", 0) or
                                                          r.get("spill_loads", 0) or
                                                          r.get("local", 0))]
    lines.append("")
    lines.append(f"spills (ptxas spill stores/loads > 0 or local memory > 0): {len(spills)}")
    for j, r in spills:
        lines.append(f"  {j['kernel']} sm{j['arch']} {j['dtype']} {j['spec']} [{j['config']}]: "
                     f"spill stores {r.get('spill_stores', '?')} B, loads "
                     f"{r.get('spill_loads', '?')} B, stack {r.get('stack')} B, "
                     f"local {r.get('local')} B, regs {r.get('regs')}")
    unknown = [(j, r) for j, r in rows if r.get("ok") and "spill_stores" not in r]
    if unknown:
        lines.append(f"  (no ptxas log for {len(unknown)} compiles; spills unknown there)")

    over = [(j, r) for j, r in rows if r.get("ok") and "budget" in j and r["shared"] > j["budget"]]
    none_fits = mark_launched(rows)
    lines.append("")
    lines.append(f"bf16/fp16 specializations with no candidate that fits (the launcher falls "
                 f"back to the least spilling one; "
                 f"{'reported only, --allow-spills' if allow_spills else 'these fail the run'}):"
                 f" {len(none_fits)}")
    for kernel, arch, dtype, spec in none_fits:
        lines.append(f"  {kernel} sm{arch} {dtype} {spec}")

    lines.append("")
    lines.append(f"configs over the shared-memory budget (dropped) "
                 f"(sm90 {SMEM_BUDGET[90]} B, sm80 {SMEM_BUDGET[80]} B): {len(over)}")
    for j, r in over:
        lines.append(f"  {j['kernel']} sm{j['arch']} {j['dtype']} {j['spec']} [{j['config']}]: "
                     f"shared {r['shared']} B > {j['budget']} B")
    return lines, len(failures), (0 if allow_spills else len(none_fits))


def _tool_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        lines = [l for l in out.stdout.splitlines() if l.strip()]
        return lines[-1].strip() if lines else "?"
    except Exception as exc:  # noqa: BLE001
        return f"? ({exc})"


def _git_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                "kernels"], capture_output=True, text=True, timeout=30).stdout
        return f"{head}" + (" (kernels/ has uncommitted changes)" if dirty.strip() else "")
    except Exception:  # noqa: BLE001
        return "?"


def ptxas_for(arch: int) -> str:
    """The ptxas Triton runs for this target (3.9 uses its ptxas-blackwell for sm_90 too)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(arch).path
    except Exception:  # noqa: BLE001 - older layouts: the bundled ptxas
        import triton
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def find_cuobjdump() -> str:
    import triton

    candidates = [os.environ.get("CUOBJDUMP", ""), "/usr/local/cuda/bin/cuobjdump",
                  str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"),
                  shutil.which("cuobjdump") or ""]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("check_triton_compile: no cuobjdump found (set CUOBJDUMP)")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=[90, 80],
                        help="compute capabilities to target (default: 90 80)")
    parser.add_argument("--quick", action="store_true", help="a small sweep")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (1 or 2, default 2)")
    parser.add_argument("--part", choices=["attention", "swiglu", "softcap"], nargs="+",
                        default=["attention", "swiglu"],
                        help="kernel families to compile (softcap: the attention kernels with "
                             "SOFTCAP, only when named)")
    parser.add_argument("--allow-spills", action="store_true",
                        help="report bf16/fp16 specializations with no fitting candidate "
                             "without failing")
    parser.add_argument("--kernels-from-path", action="store_true",
                        help=f"load kernels/ by path (as {FALLBACK_PACKAGE}) even when "
                             "ckpt_ext.kernels imports")
    args = parser.parse_args(argv)
    jobs_n = max(1, min(2, args.jobs))

    interp = _prepare_environment()
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    import torch
    import triton

    attention, swiglu_mlp, source = load_kernel_modules(args.kernels_from_path)
    _MODULES["attention"], _MODULES["swiglu_mlp"] = attention, swiglu_mlp
    cuobjdump = find_cuobjdump()
    archs = list(dict.fromkeys(args.arch))
    jobs = build_jobs(attention, swiglu_mlp, archs, args.quick, tuple(args.part))

    cache_dir = tempfile.mkdtemp(prefix="ckpt_ext_triton_aot_cache.")
    os.environ["TRITON_CACHE_DIR"] = cache_dir

    command = " ".join([sys.executable, *sys.argv])
    if os.environ.get("PYTHONPATH"):
        command = f"PYTHONPATH={os.environ['PYTHONPATH']} {command}"
    header = [
        "ckpt_ext Triton AOT compile check (tools/check_triton_compile.py)",
        f"date:      {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"command:   {command}",
        f"python:    {sys.version.split()[0]} ({sys.executable})",
        f"triton:    {triton.__version__} ({Path(triton.__file__).parent})",
        f"torch:     {torch.__version__}",
        *[f"ptxas:     sm_{a}: {_tool_version(p)} ({p})" for a, p in
          ((a, ptxas_for(a)) for a in archs)],
        f"cuobjdump: {cuobjdump}",
        f"kernels:   {source}; git {_git_state()}",
        f"targets:   {', '.join(f'sm_{a} ({ARCH_FAMILY[a]} configs)' for a in archs)}; "
        f"sweep {'quick' if args.quick else 'full'} ({', '.join(args.part)}); {jobs_n} worker(s); "
        f"{len(jobs)} compiles",
        "model:     contiguous tensors, 16-byte aligned pointers, unit strides = constexpr 1, "
        "other strides / H / I multiples of 16, S and T unspecialized",
        "columns:   shared = metadata.shared (dynamic, bytes); regs/stack/local from cuobjdump; "
        "spill st/ld = ptxas -v spill store/load bytes;",
        "           fits = what the launcher keeps (kernels/_launch.py fits: no spills, i.e. "
        "stack + local = 0, and shared <= per-block budget);",
        "           launch = the candidate CKPT_EXT_AUTOTUNE=0 launches (the first that fits, "
        "in order); s = compile s",
    ]
    if interp is not None:
        header.append(f"note:      TRITON_INTERPRET={interp!r} was set and has been removed")
    for line in header:
        print(line, flush=True)
    print(flush=True)

    results = {}
    t_start = time.perf_counter()
    order = sorted(jobs, key=lambda j: -j["cost"])  # long compiles first, to balance the pool
    ctx = multiprocessing.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(max_workers=jobs_n, mp_context=ctx, initializer=_worker_init,
                                    initargs=(args.kernels_from_path,)) as pool:
            futures = {pool.submit(_run_job, j, cuobjdump): j for j in order}
            for done, fut in enumerate(cf.as_completed(futures), 1):
                j = futures[fut]
                try:
                    r = fut.result()
                except Exception as exc:  # noqa: BLE001 - a dead worker fails its job
                    r = {"ok": False, "error": f"worker error: {type(exc).__name__}: {exc}",
                         "error_detail": ""}
                results[j["id"]] = r
                status = "ok" if r.get("ok") else "FAIL " + r.get("error", "")[:100]
                if "chain" in r:
                    status += f" ({len(r['chain'])} of the candidates compiled)"
                print(f"[{done}/{len(jobs)} {time.perf_counter() - t_start:6.0f}s] "
                      f"{j['short']} sm{j['arch']} {j['dtype']} {j['spec']} [{j['config']}]: "
                      f"{status}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    wall = time.perf_counter() - t_start

    rows = []
    for j in jobs:
        r = results[j["id"]]
        if "chain" in j and "chain" in r:
            rows.extend(zip(j["chain"], r["chain"]))
        else:
            rows.append((j, r))
    mark_launched(rows)
    report = []
    for part, title in (("attention-configs", "attention: every candidate config (bf16)"),
                        ("attention-specializations",
                         "attention: specializations, candidates in order up to the first that "
                         "fits, and the rowsum pre-pass"),
                        ("attention-softcap", "attention with softcap (SOFTCAP), causal"),
                        ("swiglu", "swiglu")):
        part_rows = [(j, r) for j, r in rows if j["part"] == part
                     or (part == "attention-specializations" and j["short"] == "attn_pre")]
        if part == "attention-configs":
            part_rows = [(j, r) for j, r in part_rows if j["short"] != "attn_pre"]
        if not part_rows:
            continue
        report.append(f"== {title}")
        report.extend(format_table(part_rows))
        report.append("")
    summary, n_failed, n_spilled = summarize(rows, args.allow_spills)  # marks "first" too
    report.append("== summary")
    report.extend(summary)
    report.append("")
    report.append(f"wall time: {wall:.0f} s for {len(jobs)} compiles with {jobs_n} worker(s)")
    problems = ([f"{n_failed} compile failures"] if n_failed else []) + (
        [f"{n_spilled} bf16/fp16 specializations without a fitting candidate"]
        if n_spilled else [])
    report.append("RESULT: " + (f"FAILED ({', '.join(problems)})" if problems else
                                "all compiled; every bf16/fp16 specialization has a candidate "
                                "that fits"))
    for line in report:
        print(line)
    sys.stdout.flush()
    if args.out:
        Path(args.out).write_text("\n".join(header + [""] + report) + "\n")
    return 1 if (n_failed or n_spilled) else 0


if __name__ == "__main__":
    sys.exit(main())
