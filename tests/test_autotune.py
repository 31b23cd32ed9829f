"""The CKPT_EXT_AUTOTUNE switch: its parsing, the fixed attention configuration it picks, and
(on a GPU) that the autotuned launchers agree with the fixed ones the other tests use."""
import os
import subprocess
import sys

import pytest
import torch

from ckpt_ext import kernels
from ckpt_ext.kernels import attention

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), (None, True)])
def test_switch_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CKPT_EXT_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("CKPT_EXT_AUTOTUNE", value)
    assert kernels.autotune_enabled() is expected


@pytest.mark.parametrize("value", ["off", "", "2"])
def test_switch_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("CKPT_EXT_AUTOTUNE", value)
    with pytest.raises(ValueError, match="CKPT_EXT_AUTOTUNE must be '0' or '1'"):
        kernels.autotune_enabled()


def smem_and_regs(kind, c, d_pad, elt):
    """Shared memory (bytes): two streamed tiles per stage, the resident tiles and (backward)
    2 KiB of lse/delta rows; and the register model's fp32 words per thread, restated from its
    description (accumulators, resident tiles, one step's score tiles)."""
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    resident, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    tiles = max(c.num_stages, 1) * 2 * streamed + (1 if kind == "fwd" else 2) * resident
    smem = tiles * d_pad * elt + (0 if kind == "fwd" else 2048)
    half = elt / 4
    words = {"fwd": bm * d_pad * (1 + half) + bm * bn * (1 + half),
             "dq": bm * d_pad * (1 + 2 * half) + bm * bn * (2 + half),
             "dkdv": (2 * bn * d_pad * (1 + half) + 2 * bm * d_pad * half
                      + bm * bn * (4 + half))}[kind]
    warps = min(c.num_warps, bn // 16) if kind == "dkdv" else c.num_warps
    return smem, words / (32 * warps)


# Triton's own shared-memory allocation (bytes) for bf16, head_dim 128, found by AOT compiles
# for sm_90 with tools/check_triton_compile.py (triton 3.6 and 3.9 agree).
MEASURED_SM90_D128_BF16 = {
    ("fwd", 128, 128, 3): 229376, ("fwd", 64, 32, 2): 49152,
    ("dq", 128, 64, 3): 163840, ("dq", 64, 64, 3): 131072,
    ("dkdv", 64, 128, 3): 164864, ("dkdv", 32, 64, 3): 82944, ("dkdv", 16, 32, 2): 25728,
}


def test_shared_memory_model_never_under_triton():
    for (kind, bm, bn, stages), real in MEASURED_SM90_D128_BF16.items():
        est = attention._smem_bytes(kind, attention._cfg(bm, bn, 4, stages), 128, 2)
        assert real <= est <= 1.4 * real, (kind, bm, bn, stages, real, est)
    # head_dim 256 dq, 64x64, 3 stages: Triton allocates 262144 B, over Hopper's 232448 B
    assert attention._smem_bytes("dq", attention._cfg(64, 64, 4, 3), 256, 2) >= 262144


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("arch, budget", [("hopper", 227 * 1024), ("ampere", 163 * 1024),
                                          ("ampere", 99 * 1024)])
@pytest.mark.parametrize("d_pad", [16, 64, 128, 256])
def test_pruned_attention_configs_fit(kind, arch, budget, d_pad):
    """CKPT_EXT_AUTOTUNE=0 launches the first of these; every one fits the device, in the
    candidates' order; with no room at all the smallest tile is still offered."""
    configs = attention._CONFIGS[(kind, arch)]
    kept = attention._prune(kind, configs, d_pad, 2, budget)
    assert all(attention.estimate_resources(kind, c, d_pad, 2) == smem_and_regs(kind, c, d_pad, 2)
               for c in configs)
    limit = attention._REG_LIMIT[kind]
    fitting = [c for c in configs
               if (lambda m, r: m <= budget and r <= limit)(*smem_and_regs(kind, c, d_pad, 2))]
    smallest = min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
    assert kept == (fitting or [smallest])
    if d_pad <= 128 and arch == "hopper":
        assert fitting, "Hopper must fit a tuned tile up to head_dim 128"
    assert attention._prune(kind, configs, d_pad, 2, 1024) == [smallest]


# Spill-store bytes that ptxas reports for the attention kernels (tools/check_triton_compile.py,
# triton 3.9, bf16, causal unless marked "full"; "atomic": the dK/dV kernel of
# CKPT_EXT_ATTN_DQ=atomic): (arch, kind, head_dim, BLOCK_M, BLOCK_N, warps, stages) -> bytes.
MEASURED_SPILLS = {
    ("hopper", "fwd", 128, 128, 64, 8, 3): 16, ("hopper", "fwd", 128, 128, 32, 4, 3): 104,
    ("hopper", "fwd", 128, 128, 32, 8, 3): 0, ("hopper", "fwd", 128, 64, 64, 4, 3): 16,
    ("hopper", "fwd", 128, 64, 32, 4, 2): 0, ("hopper", "fwd", 64, 128, 64, 8, 3): 0,
    ("hopper", "dkdv", 128, 32, 128, 8, 2): 132, ("hopper", "dkdv", 128, 64, 64, 8, 2): 376,
    ("hopper", "dkdv", 128, 32, 64, 8, 2): 16, ("hopper", "dkdv", 128, 32, 64, 4, 2): 364,
    ("hopper", "dkdv", 128, 16, 64, 4, 2): 80, ("hopper", "dkdv", 128, 16, 128, 8, 2): 0,
    ("hopper", "dkdv", 64, 64, 128, 8, 3): 12, ("hopper", "dkdv", 64, 32, 128, 8, 3): 0,
    ("hopper", "dkdv atomic", 128, 64, 64, 8, 2): 524,
    ("hopper", "dkdv atomic", 128, 32, 64, 8, 2): 132,
    ("hopper", "dkdv atomic", 128, 16, 64, 4, 2): 284,
    ("hopper", "dkdv atomic", 128, 16, 32, 4, 2): 0,
    ("hopper", "dkdv atomic", 64, 64, 128, 8, 3): 224,
    ("hopper", "dkdv atomic", 64, 16, 128, 8, 2): 0,
    ("hopper", "dq", 128, 128, 64, 8, 2): 8, ("hopper", "dq", 128, 128, 32, 8, 2): 0,
    ("hopper", "dq", 128, 64, 64, 8, 2): 0, ("hopper", "dq", 64, 128, 64, 8, 3): 0,
    ("ampere", "fwd", 128, 128, 64, 8, 2): 104, ("ampere", "fwd", 128, 128, 32, 8, 3): 0,
    ("ampere", "fwd", 64, 128, 64, 8, 2): 0,
    ("ampere", "dkdv", 128, 32, 128, 8, 2): 120, ("ampere", "dkdv", 128, 64, 64, 8, 2): 8,
    ("ampere", "dkdv", 128, 32, 64, 4, 2): 84, ("ampere", "dkdv", 128, 16, 64, 4, 2): 36,
    ("ampere", "dkdv", 128, 16, 128, 8, 2): 0, ("ampere", "dkdv", 64, 32, 128, 8, 2): 0,
    ("ampere", "dkdv atomic", 128, 64, 64, 8, 2): 304,
    ("ampere", "dkdv atomic", 128, 32, 64, 8, 2): 32,
    ("ampere", "dkdv atomic", 128, 16, 64, 4, 2): 236,
    ("ampere", "dkdv atomic", 64, 32, 128, 8, 2): 80,
    ("ampere", "dkdv atomic", 64, 16, 128, 8, 2): 0,
    ("ampere", "dq", 128, 128, 64, 8, 2): 68, ("ampere", "dq", 128, 128, 32, 8, 2): 20,
    ("ampere", "dq", 128, 64, 64, 8, 2): 0, ("ampere", "dq", 64, 128, 32, 8, 2): 0,
}


def test_register_model_drops_every_measured_spill():
    """The register model keeps a config only if its AOT compile did not spill, and the first
    config kept for head_dim 64 and 128 (what CKPT_EXT_AUTOTUNE=0 launches) was measured
    spill-free on its architecture. Atomic dQ at head_dim 128 keeps only the smallest tile (the
    last resort), which spills 32 B on sm_80."""
    for (family, kind, d, bm, bn, warps, stages), spill in MEASURED_SPILLS.items():
        atomic = kind.endswith("atomic")
        kind = kind.split()[0]
        cfg = attention._cfg(bm, bn, warps, stages)
        kept = attention._prune(kind, [cfg, attention._cfg(16, 16, 4, 1)], d, 2, 227 * 1024,
                                atomic)
        assert (cfg in kept) <= (spill == 0), (family, kind, d, bm, bn, warps, stages, atomic)
    for family in ("hopper", "ampere"):
        for d in (64, 128):
            for kind, atomic in (("fwd", False), ("dkdv", False), ("dkdv", True), ("dq", False)):
                first = attention.attention_candidate_configs(kind, family, d, torch.bfloat16,
                                                              227 * 1024, atomic)[0]
                key = (family, kind + (" atomic" if atomic else ""), d, first.kwargs["BLOCK_M"],
                       first.kwargs["BLOCK_N"], first.num_warps, first.num_stages)
                if atomic and d == 128:
                    assert (key[3], key[4]) == (16, 32), key
                    continue
                assert MEASURED_SPILLS.get(key) == 0, key


class StubKernel:
    """Records launches; configs with BLOCK_M above ``fits_up_to`` fail as Triton does when a
    kernel's shared memory exceeds the device's."""

    def __init__(self, fits_up_to):
        self.fits_up_to, self.launched, self.tried = fits_up_to, [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from triton.runtime.errors import OutOfResources

            self.tried.append(kwargs["BLOCK_M"])
            if kwargs["BLOCK_M"] > self.fits_up_to:
                raise OutOfResources(300000, 232448, "shared memory")
            self.launched.append((grid, args, kwargs))
        return run


def test_untuned_launcher_skips_configs_the_device_refuses():
    configs = [attention._cfg(128, 64, 8, 3), attention._cfg(64, 64, 4, 3),
               attention._cfg(32, 32, 4, 2)]
    stub = StubKernel(fits_up_to=64)
    launch = attention._FirstThatFits(stub, configs)
    launch["grid"](1, 2, HEAD_DIM=256, CAUSAL=True)
    assert stub.tried == [128, 64]
    assert stub.launched[0][1] == (1, 2)
    kw = stub.launched[0][2]
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (64, 64, 4, 3)
    assert kw["HEAD_DIM"] == 256 and kw["CAUSAL"] is True
    # remembered per specialization: the refused config is not compiled again
    launch["grid"](3, 4, HEAD_DIM=256, CAUSAL=True)
    assert stub.tried == [128, 64, 64]
    launch["grid"](3, 4, HEAD_DIM=64, CAUSAL=True)  # another specialization starts over
    assert stub.tried == [128, 64, 64, 128, 64]

    none_fit = attention._FirstThatFits(StubKernel(fits_up_to=16), configs)
    with pytest.raises(RuntimeError, match="no candidate configuration fits"):
        none_fit["grid"](1, HEAD_DIM=256)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the autotuner does not run in the "
                                     "Triton interpreter)")
def test_autotuned_launchers_agree_with_fixed_ones(tmp_path):
    code = r"""
import torch, ckpt_ext
from ckpt_ext.kernels import attention, swiglu_mlp
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = attention.attention_fwd(q, k, v, None, None, None, True, 0.125)
dq, dk, dv = attention.attention_bwd(torch.ones_like(out), q, k, v, out, lse, None, None, None,
                                     True, 0.125)
x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
wg, wu = (torch.randn(688, 256, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(2))
wd = torch.randn(256, 688, device="cuda", dtype=torch.bfloat16) * 0.05
y = swiglu_mlp.swiglu_fwd(x, wg, wu, wd, None, None, None, [], [], False)[0]
torch.save([t.cpu() for t in (out, lse, dq, dk, dv, y)], __import__("sys").argv[1])
"""
    paths = {}
    for mode in ("0", "1"):
        paths[mode] = str(tmp_path / f"autotune_{mode}.pt")
        env = dict(os.environ, CKPT_EXT_AUTOTUNE=mode)
        res = subprocess.run([sys.executable, "-c", code, paths[mode]], env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
    fixed, tuned = (torch.load(paths[m]) for m in ("0", "1"))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "y"), fixed, tuned):
        # different tile sizes sum in different orders: bf16-rounding-level differences only
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{name}: {m}")
