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

from aot import aot_run

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


# ------------------------------------------------------------------------------------------
# Pruning by what the compiler reports (kernels/_launch.py)
# ------------------------------------------------------------------------------------------
R = _launch.Resources
BUDGET = 227 * 1024


def test_prune_keeps_what_compiled_without_spills_within_shared_memory():
    cfgs = [attention._cfg(128, 128, 8, 3), attention._cfg(128, 64, 8, 3),
            attention._cfg(64, 64, 4, 3), attention._cfg(32, 32, 4, 2)]
    res = [R(255, 4, 200000), R(168, 0, 240000), R(160, 0, 98304), R(90, 0, 24576)]
    # spills, over the budget, fits, fits: the fitting ones, in order
    assert _launch.prune(cfgs, res, BUDGET) == cfgs[2:]
    assert not _launch.fits(res[0], BUDGET) and not _launch.fits(res[1], BUDGET)
    assert _launch.fits(res[1], 240000)
    assert _launch.prune(cfgs, res, 240000) == cfgs[1:]
    # nothing fits: the one that spills least within shared memory (less shared on a tie)
    spilling = [R(255, 8, 1000), R(255, 2, 300000), R(255, 2, 9000), R(255, 2, 5000)]
    assert _launch.prune(cfgs, spilling, BUDGET) == [cfgs[3]]
    # a config that did not load (None) is never kept; none loads: nothing
    assert _launch.prune(cfgs, [None, None, R(1, 0, 1), None], BUDGET) == [cfgs[2]]
    assert _launch.prune(cfgs, [None] * 4, BUDGET) == []
    assert not _launch.fits(None, BUDGET)


def test_prune_keeps_the_first_fitting_of_each_group():
    from ckpt_ext.kernels import swiglu_mlp

    cands = swiglu_mlp.candidate_configs("bwd", "subtiled")[:6]
    # the 128x128 tile in pieces of 128, 64, 32; the next tile in 128, 64, 32
    assert [c.kwargs["EPI_N"] for c in cands] == [128, 64, 32, 128, 64, 32]
    res = [R(255, 6, 1), R(200, 0, 1), R(180, 0, 1), R(255, 9, 1), R(255, 1, 1), R(190, 0, 1)]
    kept = _launch.prune(cands, res, BUDGET, swiglu_mlp.tile_of)
    assert kept == [cands[1], cands[5]]
    assert _launch.prune(cands, res, BUDGET) == [cands[1], cands[2], cands[5]]


class FakeCompiled:
    def __init__(self, resources):
        self.resources, self.loaded = resources, False

    def _init_handles(self):
        from triton.runtime.errors import OutOfResources

        if self.resources is None:
            raise OutOfResources(300000, 232448, "shared memory")
        self.loaded = True
        self.n_regs, self.n_spills = self.resources.regs, self.resources.spills
        self.metadata = type("Meta", (), {"shared": self.resources.shared})


class CompilingStub:
    """A kernel whose ``warmup`` reports the given resources per BLOCK_M, or per (BLOCK_M,
    BLOCK_N, num_warps, num_stages) (None: the driver refuses to load it) and whose launches
    are recorded."""

    def __init__(self, resources):
        self.resources, self.compiled, self.launched = resources, [], []

    def warmup(self, *args, grid, **kwargs):
        self.compiled.append((kwargs["BLOCK_M"], args, kwargs.get("HEAD_DIM")))
        full = (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"])
        return FakeCompiled(self.resources[full if full in self.resources
                                           else kwargs["BLOCK_M"]])

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launched.append((grid, args, kwargs))
        return run


def test_pruned_launcher_compiles_in_order_and_launches_the_first_that_fits():
    cfgs = [attention._cfg(128, 64, 8, 3), attention._cfg(64, 64, 4, 3),
            attention._cfg(32, 32, 4, 2), attention._cfg(16, 16, 4, 2)]
    stub = CompilingStub({128: R(255, 3, 1000), 64: None, 32: R(100, 0, 1000),
                          16: R(60, 0, 500)})
    launch = _launch.Pruned(stub, cfgs, BUDGET, autotune=False, key=["HEAD_DIM"],
                            autotune_kwargs={})
    launch["grid"](1, 2, HEAD_DIM=128)
    # autotuning off: compiled in order up to the first that fits, for the launch's arguments
    assert [m for m, _, _ in stub.compiled] == [128, 64, 32]
    assert all(args == (1, 2) and d == 128 for _, args, d in stub.compiled)
    assert launch.kept == [cfgs[2]]
    assert [(c, r) for c, r in launch.report] == [(cfgs[0], R(255, 3, 1000)), (cfgs[1], None),
                                                  (cfgs[2], R(100, 0, 1000))]
    assert stub.launched[0][2]["BLOCK_M"] == 32 and stub.launched[0][1] == (1, 2)
    launch["grid"](3, HEAD_DIM=128)  # decided once per launcher (one cache key)
    assert len(stub.compiled) == 3 and len(stub.launched) == 2

    # autotuning on: every candidate compiled, the autotuner gets those that fit
    tuned = []
    stub = CompilingStub({128: R(255, 3, 1000), 64: R(128, 0, 1000), 32: R(100, 0, 1000),
                          16: R(60, 0, 300000)})
    launch = _launch.Pruned(stub, cfgs, BUDGET, autotune=True, key=["HEAD_DIM"],
                            autotune_kwargs={"reset_to_zero": ["DQ"]})

    def fake_autotune(configs, key, **kw):
        tuned.append((configs, key, kw))
        return lambda kernel: kernel
    import triton
    real, triton.autotune = triton.autotune, fake_autotune
    try:
        launch["grid"](1, HEAD_DIM=64)
    finally:
        triton.autotune = real
    assert [m for m, _, _ in stub.compiled] == [128, 64, 32, 16]
    assert tuned == [([cfgs[1], cfgs[2]], ["HEAD_DIM"], {"reset_to_zero": ["DQ"]})]

    nothing = _launch.Pruned(CompilingStub({m: None for m in (128, 64, 32, 16)}), cfgs,
                             BUDGET, autotune=False, key=[], autotune_kwargs={})
    with pytest.raises(RuntimeError, match="no candidate configuration loads"):
        nothing["grid"](1)


def test_launchers_prune_every_candidate_on_a_gpu_only(monkeypatch):
    """On a GPU the launchers hand the kernel's whole candidate list and the device's shared
    memory to the pruning launcher; in the interpreter they launch the fixed blocks as
    before (nothing compiled, nothing pruned)."""
    from ckpt_ext.kernels import swiglu_mlp

    seen = {}

    def spy(kernel, configs, **kw):
        seen[kernel] = (list(configs), kw.get("smem_budget"), kw.get("group"))
        return real(kernel, configs, **kw)
    real = _launch.select
    monkeypatch.setattr(_launch, "select", spy)
    _launch.reload_policy()
    dev = torch.device("cuda" if CUDA else "cpu")
    swiglu_mlp._bwd_launcher(dev, torch.bfloat16 if CUDA else torch.float32, "tf32", False,
                             False, True, True, (False, False), None)
    attention._launcher("fwd", dev, torch.float32, 64, True, False, False, False, "tf32")
    _launch.reload_policy()
    (bwd_cfgs, bwd_budget, group), = [v for k, v in seen.items()
                                      if k is swiglu_mlp._swiglu_bwd_recompute_kernel]
    fwd_cfgs, fwd_budget, _ = seen[attention._attn_fwd_kernel]
    if not CUDA:
        assert _launch.INTERPRET, "the CPU runs the kernels through the interpreter only"
        assert bwd_cfgs == fwd_cfgs == [] and bwd_budget is None and fwd_budget is None
        return
    info = _launch.device_info(dev)
    assert bwd_cfgs == swiglu_mlp.candidate_configs("bwd") and group is swiglu_mlp.tile_of
    assert fwd_cfgs == attention.attention_configs("fwd", info.arch)
    assert bwd_budget == fwd_budget == info.smem_budget


def test_candidate_lists():
    from ckpt_ext.kernels import swiglu_mlp

    fwd = swiglu_mlp.candidate_configs("fwd")
    assert fwd and all("EPI_N" not in c.kwargs for c in fwd)
    sub = swiglu_mlp.candidate_configs("bwd", "subtiled")
    whole = swiglu_mlp.candidate_configs("bwd", "whole")
    assert [swiglu_mlp.tile_of(c) for c in whole] == [swiglu_mlp.tile_of(c) for c in fwd]
    assert all(c.kwargs["EPI_N"] == c.kwargs["BLOCK_N"] for c in whole)
    assert all(c.kwargs["BLOCK_N"] % c.kwargs["EPI_N"] == 0 and c.kwargs["EPI_N"] >= 16
               for c in sub)
    assert len(sub) > len(whole)
    with pytest.raises(ValueError, match="epilogue must be 'subtiled' or 'whole'"):
        swiglu_mlp.candidate_configs("bwd", "halves")
    with pytest.raises(ValueError, match="kind must be one of"):
        swiglu_mlp.candidate_configs("bwd_dx")
    for kind in ("fwd", "dkdv", "dq"):
        for family in ("hopper", "ampere"):
            cands = attention.attention_configs(kind, family)
            smallest = min(cands, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
            assert cands[-1] is smallest  # the last resort is tried last


# A few attention forward candidates, bf16, head_dim 128, causal, compiled ahead of time for
# sm_90 by tools/check_triton_compile.py's machinery (what the driver would report: registers,
# local memory / 4 as spills, shared memory).
_AOT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import check_triton_compile as t
t._prepare_environment()
attention, _, _ = t.load_kernel_modules(False)
t._MODULES["attention"] = attention
cuobjdump = t.find_cuobjdump()
out = []
for bm, bn, w, s in json.loads(sys.argv[2]):
    cfg = attention._cfg(bm, bn, w, s)
    res = t.compile_job(t.attention_job(attention, "fwd", cfg.kwargs, w, s), cuobjdump)
    r = t.aot_resources(res)
    out.append(None if r is None else [r.regs, r.spills, r.shared, res.get("spill_stores")])
print("AOT" + json.dumps(out))
"""


def test_aot_compiled_candidates_are_pruned_by_their_reported_resources():
    """Compiles a few sm_90 candidates ahead of time (no GPU: triton's bundled ptxas) and checks
    the pruning decision on what the compiler reported for them: exactly those without
    spills and within Hopper's shared memory are kept, in order, and the first of them is what
    CKPT_EXT_AUTOTUNE=0 launches; at least one candidate is dropped for its spills."""
    import json
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools"
    # 128x64 w8 and 128x32 w4 spilled on sm_90 with triton 3.6 and 3.9; 128x32 w8 did not
    shapes = [(128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3), (32, 32, 4, 2)]
    found, _ = aot_run(_AOT_SCRIPT, str(tools), json.dumps(shapes))
    if any(r is None for r in found):
        print(f"AOT compile for sm_90 gave no resources for some candidates: {found}")
        pytest.skip("cuobjdump gave no resource line (AOT resources unavailable)")
    resources = [R(*r[:3]) for r in found]
    print("sm_90 bf16 D128 causal fwd:", dict(zip(shapes, resources)),
          "ptxas spill stores:", [r[3] for r in found])
    # the driver's count (local memory) and ptxas's log agree on which ones spill
    assert all((r.spills > 0) == bool(f[3]) for r, f in zip(resources, found)
               if f[3] is not None), found
    cfgs = [attention._cfg(*c) for c in shapes]
    kept = _launch.prune(cfgs, resources, BUDGET)
    assert kept == [c for c, r in zip(cfgs, resources) if r.spills == 0 and r.shared <= BUDGET]
    assert kept, resources
    assert any(r.spills for r in resources), "no candidate spilled: nothing was pruned"
    assert all(r.regs <= 255 for r in resources)
    stub = CompilingStub(dict(zip(shapes, resources)))
    first = _launch.Pruned(stub, cfgs, BUDGET, autotune=False, key=[], autotune_kwargs={})
    first["grid"](0)
    assert first.kept == kept[:1]


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
