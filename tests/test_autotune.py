"""The autotune setting (CKPT_EXT_AUTOTUNE): its parsing, the fixed attention configuration it
picks, and (on a GPU) that the autotuned launchers agree with the fixed ones the other tests
use."""
import os
import subprocess
import sys

import pytest
import torch

from ckpt_ext import config, kernels
from ckpt_ext.kernels import _launch, attention

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), (None, True)])
def test_switch_values(value, expected):
    environ = {} if value is None else {"CKPT_EXT_AUTOTUNE": value}
    assert config.from_environment(environ).autotune is expected
    with config.patch(autotune=expected):
        assert kernels.autotune_enabled() is expected


@pytest.mark.parametrize("value", ["off", "", "2"])
def test_switch_rejects_other_values(value):
    with pytest.raises(ValueError, match="CKPT_EXT_AUTOTUNE must be one of '0', '1'"):
        config.from_environment({"CKPT_EXT_AUTOTUNE": value})


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
    ("ampere", "dkdv atomic", 128, 16, 32, 4, 2): 32,
    ("ampere", "dkdv atomic", 128, 16, 16, 4, 2): 0,
    ("ampere", "dq", 128, 128, 64, 8, 2): 68, ("ampere", "dq", 128, 128, 32, 8, 2): 20,
    ("ampere", "dq", 128, 64, 64, 8, 2): 0, ("ampere", "dq", 64, 128, 32, 8, 2): 0,
    # the full sweep (bench/results/triton_compile_attention_sm90_sm80_triton3.9.txt) and the
    # head_dim 256 / 16x16 tiles added after it
    ("ampere", "dq", 64, 64, 64, 4, 2): 24, ("ampere", "dq", 64, 64, 32, 4, 2): 12,
    ("ampere", "dq", 128, 64, 64, 4, 2): 4, ("ampere", "dq", 64, 64, 32, 8, 2): 0,
    ("ampere", "dq", 128, 64, 32, 8, 2): 0, ("ampere", "dq", 256, 64, 32, 8, 2): 0,
    ("ampere", "dq", 256, 64, 32, 4, 2): 32, ("ampere", "dq", 256, 32, 32, 4, 2): 0,
    ("hopper", "dq", 256, 64, 32, 8, 2): 76, ("hopper", "dq", 256, 64, 32, 4, 2): 40,
    ("hopper", "dq", 256, 32, 32, 4, 2): 0,
    ("hopper", "fwd", 256, 64, 32, 4, 2): 60, ("hopper", "fwd", 256, 64, 32, 8, 2): 0,
    ("hopper", "fwd", 256, 32, 32, 4, 2): 0,
    ("ampere", "fwd", 256, 64, 32, 4, 2): 52, ("ampere", "fwd", 256, 64, 32, 8, 2): 0,
    ("ampere", "fwd", 256, 32, 32, 4, 2): 0,
    ("hopper", "dkdv", 256, 16, 32, 4, 2): 128, ("hopper", "dkdv", 256, 16, 16, 4, 2): 0,
    ("ampere", "dkdv", 256, 16, 16, 4, 2): 0,
    ("hopper", "dkdv atomic", 128, 16, 16, 4, 2): 0, ("hopper", "dkdv atomic", 64, 16, 16, 4, 2): 0,
}


def test_register_model_drops_every_measured_spill():
    """The register model keeps a config only if its AOT compile did not spill, and the first
    config launched for head_dim 64, 128 and 256 (what CKPT_EXT_AUTOTUNE=0 launches: kept on
    its merits, or the last resort when nothing is) was measured spill-free on its
    architecture. Atomic dQ at head_dim 128 and dK/dV at 256 launch the last resort, 16x16."""
    def signature(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages

    checked = 0
    for (family, kind, d, bm, bn, warps, stages), spill in MEASURED_SPILLS.items():
        atomic = kind.endswith("atomic")
        kind = kind.split()[0]
        if (bm, bn, warps, stages) not in map(signature, attention.attention_configs(kind, family)):
            continue  # no longer a candidate there (e.g. the 4-warp 64-row dQ tiles on Ampere)
        checked += 1
        cfg = attention._cfg(bm, bn, warps, stages)
        kept = attention._prune(kind, [cfg, attention._cfg(16, 16, 4, 1)], d, 2, 227 * 1024,
                                atomic)
        assert (cfg in kept) <= (spill == 0), (family, kind, d, bm, bn, warps, stages, atomic)
    assert checked >= 50, checked
    for family in ("hopper", "ampere"):
        for d in (64, 128, 256):
            for kind, atomic in (("fwd", False), ("dkdv", False), ("dkdv", True), ("dq", False)):
                if atomic and d == 256:
                    continue
                budget = _launch.smem_budget_for((9, 0) if family == "hopper" else (8, 0))
                first = attention.attention_candidate_configs(kind, family, d, torch.bfloat16,
                                                              budget, atomic)[0]
                key = (family, kind + (" atomic" if atomic else ""), d, first.kwargs["BLOCK_M"],
                       first.kwargs["BLOCK_N"], first.num_warps, first.num_stages)
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
    launch = _launch.FirstThatFits(stub, configs)
    launch["grid"](1, 2, HEAD_DIM=256, CAUSAL=True)
    assert stub.tried == [128, 64]
    assert stub.launched[0][1] == (1, 2)
    kw = stub.launched[0][2]
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (64, 64, 4, 3)
    assert kw["HEAD_DIM"] == 256 and kw["CAUSAL"] is True
    assert launch.chosen is configs[1]
    # remembered by the launcher (one per launcher-cache key): the refused config is not
    # compiled again
    launch["grid"](3, 4, HEAD_DIM=256, CAUSAL=True)
    assert stub.tried == [128, 64, 64]

    none_fit = _launch.FirstThatFits(StubKernel(fits_up_to=16), configs)
    with pytest.raises(RuntimeError, match="no candidate configuration fits"):
        none_fit["grid"](1, HEAD_DIM=256)


@pytest.mark.gpu(reason="needs a CUDA GPU (the autotuner does not run in the Triton "
                        "interpreter)")
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


# ------------------------------------------------------------------------------------------
# The launch policy module and the SwiGLU resource model
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, expected", [("highest", "ieee"), ("high", "tf32"),
                                               ("medium", "tf32")])
def test_fp32_dot_precision_follows_torch(setting, expected):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        assert _launch.dot_precision(torch.float32) == expected
        # half precision: tensor-core dots whatever the setting
        assert _launch.dot_precision(torch.bfloat16) == "tf32"
        assert _launch.dot_precision(torch.float16) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("name, values", [
    ("CKPT_EXT_SWIGLU_GRID", "'tiles', 'persistent'"),
    ("CKPT_EXT_SWIGLU_EPILOGUE", "'subtiled', 'whole'")])
@pytest.mark.parametrize("value", ["Persistent", "", "2"])
def test_variant_switches_reject_other_values(name, values, value):
    with pytest.raises(ValueError, match=f"{name} must be one of {values}"):
        config.from_environment({name: value})
    current = config.current()
    assert (current.swiglu_grid, current.swiglu_epilogue) == ("persistent", "subtiled")


def test_host_arithmetic():
    assert [_launch.cdiv(a, 16) for a in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [_launch.next_pow2(n) for n in (0, 1, 2, 3, 17, 64)] == [1, 1, 2, 4, 32, 64]
    assert _launch.pow2_bucket(5, 16) == 16 and _launch.pow2_bucket(129, 16) == 256
    assert _launch.pow2_bucket(40000, 128, 32768) == 32768


def test_launchers_are_cached_per_specialization():
    from ckpt_ext.kernels import swiglu_mlp

    # The device the launchers run on here: the GPU, or the CPU under the interpreter.
    dev = torch.device("cuda" if CUDA else "cpu")
    a = swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False, None)
    assert swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False, None) is a
    b = swiglu_mlp._fwd_launcher(dev, torch.float32, "tf32", False, False, False, None)
    assert b is not a and b[1]["DOT_IEEE"] is False and a[1]["DOT_IEEE"] is True
    _launch.reload_policy()
    assert swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False, None) is not a


# Spill bytes ptxas reported for SwiGLU configs (tools/check_triton_compile.py, triton 3.9, bf16;
# bench/results/triton_compile_swiglu_sm90_sm80_triton3.9.txt, and runs for former candidates
# and for backward epilogue widths and adapter ranks the launcher does not pick):
# (kind, arch, lora, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, EPI_N) -> spill stores;
# lora: False or the adapters' rank pad (LoRA on all three projections, every gradient, the
# down adapter's dropout); EPI_N: the backward's epilogue piece (BLOCK_N: the whole tile), None
# for the forward. The LoRA backward rows are those of the kernel that leaves the gate/up
# adapters' gradient pieces to the launcher.
MEASURED_SWIGLU_SPILLS = {
    ("fwd", "ampere", False, 128, 128, 64, 8, 3, None): 196,
    ("fwd", "ampere", False, 256, 64, 64, 8, 3, None): 32,
    ("fwd", "ampere", False, 128, 64, 64, 4, 4, None): 340,
    ("fwd", "ampere", False, 128, 64, 64, 8, 4, None): 0,
    ("fwd", "hopper", False, 128, 128, 64, 8, 3, None): 0,
    ("fwd", "hopper", 16, 128, 64, 64, 8, 4, None): 0,
    ("fwd", "ampere", 16, 64, 128, 64, 8, 4, None): 8,
    ("fwd", "ampere", 16, 128, 128, 64, 8, 3, None): 9736,
    ("fwd", "ampere", 16, 128, 64, 64, 8, 4, None): 0,
    ("fwd", "hopper", 32, 64, 32, 64, 8, 3, None): 0, ("fwd", "ampere", 32, 64, 32, 64, 8, 3, None): 0,
    ("fwd", "hopper", 64, 64, 32, 64, 8, 3, None): 0, ("fwd", "ampere", 64, 64, 32, 64, 8, 3, None): 0,
    # backward, whole-tile epilogue
    ("bwd", "hopper", False, 128, 128, 64, 8, 3, 128): 24,
    ("bwd", "hopper", False, 256, 64, 64, 8, 3, 64): 36,
    ("bwd", "hopper", False, 128, 64, 64, 4, 4, 64): 64,
    ("bwd", "hopper", False, 128, 64, 64, 8, 4, 64): 0,
    ("bwd", "hopper", False, 128, 128, 32, 8, 4, 128): 24,
    ("bwd", "ampere", False, 128, 128, 32, 8, 4, 128): 188,
    ("bwd", "ampere", False, 128, 64, 64, 8, 4, 64): 0,
    ("bwd", "ampere", False, 64, 64, 64, 4, 4, 64): 0,
    # backward, subtiled epilogue
    ("bwd", "hopper", False, 128, 128, 64, 8, 3, 64): 0,
    ("bwd", "hopper", False, 128, 128, 64, 8, 3, 32): 0,
    ("bwd", "hopper", False, 128, 128, 64, 8, 4, 32): 0,
    ("bwd", "hopper", False, 256, 64, 64, 8, 3, 16): 0,
    ("bwd", "hopper", False, 128, 64, 64, 4, 4, 16): 0,
    ("bwd", "hopper", False, 128, 128, 32, 8, 4, 32): 0,
    ("bwd", "ampere", False, 128, 128, 64, 8, 3, 64): 272,
    ("bwd", "ampere", False, 128, 128, 64, 8, 3, 32): 8068,
    ("bwd", "ampere", False, 128, 64, 64, 4, 4, 32): 192,
    ("bwd", "ampere", False, 128, 64, 64, 4, 4, 16): 280,
    ("bwd", "ampere", False, 128, 128, 32, 8, 4, 64): 144,
    ("bwd", "ampere", False, 128, 128, 32, 8, 4, 32): 184,
    # LoRA backward, rank pad 16
    ("bwd", "hopper", 16, 128, 128, 64, 8, 3, 32): 1148,
    ("bwd", "hopper", 16, 256, 64, 64, 8, 3, 16): 1168,
    ("bwd", "hopper", 16, 128, 64, 64, 4, 4, 16): 844,
    ("bwd", "hopper", 16, 128, 64, 64, 8, 4, 64): 72,
    ("bwd", "hopper", 16, 128, 64, 64, 8, 4, 32): 0,
    ("bwd", "hopper", 16, 64, 128, 64, 8, 4, 32): 88,
    ("bwd", "hopper", 16, 128, 64, 32, 8, 4, 64): 80,
    ("bwd", "hopper", 16, 128, 64, 32, 8, 4, 32): 0,
    ("bwd", "hopper", 16, 64, 64, 64, 4, 4, 64): 36,
    ("bwd", "hopper", 16, 64, 64, 64, 4, 4, 32): 0,
    ("bwd", "hopper", 16, 32, 64, 128, 4, 3, 64): 0,
    ("bwd", "hopper", 16, 64, 32, 64, 8, 3, 32): 0,
    ("bwd", "hopper", 16, 32, 32, 64, 4, 3, 32): 0,
    ("bwd", "ampere", 16, 128, 64, 64, 8, 4, 16): 80,
    ("bwd", "ampere", 16, 128, 64, 64, 8, 4, 32): 152,
    ("bwd", "ampere", 16, 128, 64, 32, 8, 4, 16): 80,
    ("bwd", "ampere", 16, 64, 128, 64, 8, 4, 32): 568,
    ("bwd", "ampere", 16, 64, 64, 64, 4, 4, 32): 44,
    ("bwd", "ampere", 16, 64, 64, 64, 4, 4, 16): 0,
    ("bwd", "ampere", 16, 32, 64, 128, 4, 3, 64): 0,
    ("bwd", "ampere", 16, 64, 32, 64, 8, 3, 32): 0,
    ("bwd", "ampere", 16, 32, 32, 64, 4, 3, 32): 0,
    # LoRA backward, rank pads 32 and 64
    ("bwd", "hopper", 32, 32, 64, 128, 4, 3, 16): 32,
    ("bwd", "hopper", 32, 32, 64, 128, 4, 3, 32): 76,
    ("bwd", "hopper", 32, 64, 64, 64, 4, 4, 16): 180,
    ("bwd", "ampere", 32, 64, 64, 64, 4, 4, 16): 104,
    ("bwd", "hopper", 64, 32, 64, 128, 4, 3, 64): 0,
    ("bwd", "ampere", 64, 32, 64, 128, 4, 3, 64): 56,
    ("bwd", "hopper", 32, 64, 32, 64, 8, 3, 32): 0, ("bwd", "ampere", 32, 64, 32, 64, 8, 3, 32): 0,
    ("bwd", "hopper", 64, 64, 32, 64, 8, 3, 32): 0, ("bwd", "ampere", 64, 64, 32, 64, 8, 3, 32): 0,
    ("bwd", "hopper", 32, 32, 32, 64, 4, 3, 32): 0, ("bwd", "ampere", 32, 32, 32, 64, 4, 3, 32): 0,
    ("bwd", "hopper", 64, 32, 32, 64, 4, 3, 32): 0, ("bwd", "ampere", 64, 32, 32, 64, 4, 3, 32): 0,
}
# Shared memory Triton allocated (bytes, bf16): (arch, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
MEASURED_SWIGLU_SMEM = {
    ("hopper", 128, 128, 64, 8, 3): 147456, ("ampere", 128, 128, 64, 8, 3): 98304,
    ("hopper", 128, 64, 64, 8, 4): 131072, ("ampere", 128, 64, 64, 8, 4): 98304,
    ("hopper", 32, 64, 128, 4, 3): 81920, ("ampere", 64, 64, 64, 4, 4): 73728,
    ("hopper", 64, 32, 64, 8, 3): 49152, ("ampere", 64, 32, 64, 8, 3): 32768,
}


def _config(bm, bn, bk, w, s, epi):
    """The SwiGLU config of a MEASURED_SWIGLU_SPILLS key (EPI_N only for the backward)."""
    import triton

    extra = {} if epi is None else {"EPI_N": epi}
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, **extra},
                         num_warps=w, num_stages=s)


def test_swiglu_model_flags_every_measured_spill():
    from ckpt_ext.kernels import swiglu_mlp

    for (kind, arch, lora, *cfg), spill in MEASURED_SWIGLU_SPILLS.items():
        est = swiglu_mlp.estimate_resources(kind, _config(*cfg), arch, torch.bfloat16,
                                            lora=bool(lora), rank_pad=lora or 16)
        assert not (spill and est["spill_free"]), (kind, arch, lora, cfg, spill, est)


def test_swiglu_smem_model_matches_triton():
    from ckpt_ext.kernels import swiglu_mlp

    for (arch, *cfg), real in MEASURED_SWIGLU_SMEM.items():
        est = swiglu_mlp.estimate_resources("fwd", _config(*cfg, None), arch, torch.bfloat16)
        assert est["smem"] == real, (arch, cfg, real, est)


@pytest.mark.parametrize("epilogue", ["subtiled", "whole"])
@pytest.mark.parametrize("arch", ["hopper", "ampere"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind, lora", [("fwd", False), ("fwd", 16), ("fwd", 32), ("fwd", 64),
                                        ("bwd", False), ("bwd", 16), ("bwd", 32), ("bwd", 64)])
def test_swiglu_first_kept_config_is_measured_spill_free(kind, arch, dtype, lora, epilogue):
    """What CKPT_EXT_AUTOTUNE=0 launches was compiled without spills (bf16 figures; fp16 has
    the same register allocation), every kept LoRA backward config too (their rule is fitted,
    not summed), and every kept config fits the family's shared memory."""
    from ckpt_ext.kernels import swiglu_mlp

    rows = swiglu_mlp.launch_configs(kind, arch, dtype, lora=bool(lora),
                                     rank_pad=lora or 16, epilogue=epilogue)
    kept = [(c, est) for c, est in rows if est["kept"]]
    assert kept
    if kind == "bwd" and lora and epilogue == "subtiled":
        for c, _ in kept:
            key = (kind, arch, lora, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],
                   c.kwargs["BLOCK_K"], c.num_warps, c.num_stages, c.kwargs["EPI_N"])
            assert MEASURED_SWIGLU_SPILLS.get(key) == 0, key
    c = kept[0][0]
    key = (kind, arch, lora, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
           c.num_warps, c.num_stages, c.kwargs.get("EPI_N"))
    assert MEASURED_SWIGLU_SPILLS.get(key) == 0, key
    budget = _launch.smem_budget_for((9, 0) if arch == "hopper" else (8, 0))
    assert all(est["smem"] <= budget for _, est in kept)
    if kind == "bwd":
        assert all(c.kwargs["BLOCK_N"] % c.kwargs["EPI_N"] == 0 for c, _ in rows)
        if epilogue == "whole":
            assert all(c.kwargs["EPI_N"] == c.kwargs["BLOCK_N"] for c, _ in rows)
    else:
        assert all("EPI_N" not in c.kwargs for c, _ in rows)
    # a device with little shared memory still gets a config
    assert swiglu_mlp.kept_configs(kind, arch, dtype, lora=lora, smem_budget=16384,
                                   epilogue=epilogue)


def test_subtiled_epilogue_keeps_the_largest_hopper_tile():
    """The subtiled backward keeps the 128x128 tile on sm_90 (whole, it spills 24 B), in the
    widest piece the model calls spill-free; whole-tile epilogues keep the old first choice."""
    from ckpt_ext.kernels import swiglu_mlp

    sub = swiglu_mlp.kept_configs("bwd", "hopper", torch.bfloat16)[0]
    whole = swiglu_mlp.kept_configs("bwd", "hopper", torch.bfloat16, epilogue="whole")[0]
    assert (sub.kwargs["BLOCK_M"], sub.kwargs["BLOCK_N"], sub.kwargs["EPI_N"]) == (128, 128, 32)
    assert (whole.kwargs["BLOCK_M"], whole.kwargs["BLOCK_N"], whole.kwargs["EPI_N"]) == (128, 64, 64)
    with pytest.raises(ValueError, match="epilogue must be 'subtiled' or 'whole'"):
        swiglu_mlp.launch_configs("bwd", "hopper", torch.bfloat16, epilogue="halves")
    with pytest.raises(ValueError, match="kind must be one of"):
        swiglu_mlp.estimate_resources("bwd_dx", sub, "hopper", torch.bfloat16)
