"""The attention backward's launch configurations (kernels/attention_tuning.py): the sweep's
candidates, the winners file and its reader, the launcher reading it, a forced configuration
computing the same gradients; and ahead-of-time register / spill reports of a few sweep
candidates for sm_90."""
import json
import os
from pathlib import Path

import pytest
import torch

from ckpt_ext import config
from ckpt_ext.kernels import _launch, attention
from ckpt_ext.kernels import attention_tuning as tuning

from aot import aot_run
from reference import attention_reference

C = tuning.Candidate
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- candidates ------------------------------------------------------------------------------
def test_candidate_config_round_trip_and_checks():
    c = C(64, 128, 8, 3, 168)
    cfg = c.to_config()
    assert cfg.kwargs == {"BLOCK_M": 64, "BLOCK_N": 128}
    assert (cfg.num_warps, cfg.num_stages, cfg.maxnreg, cfg.num_ctas) == (8, 3, 168, 1)
    assert C.of_config(cfg) == c and C.of_config(C(32, 64, 4, 2).to_config()).maxnreg is None
    assert C.from_dict(c.as_dict()) == c
    # what the untimed and pruning launchers pass at launch: the cap and cluster too
    assert _launch._config_kwargs(cfg) == {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8,
                                           "num_stages": 3, "maxnreg": 168}
    assert _launch._config_kwargs(C(64, 64, 4, 2, None, 2).to_config())["num_ctas"] == 2
    assert "maxnreg" not in _launch._config_kwargs(C(64, 64, 4, 2).to_config())
    assert c.label == "64x128 w8 s3 r168" and C(64, 64, 4, 2, None, 2).label == "64x64 w4 s2 c2"
    for bad, match in ((dict(block_m=48), "block_m must be a power of two"),
                       (dict(num_warps=2), "num_warps must be 4, 8 or 16"),
                       (dict(num_stages=0), "num_stages must be an int in 1..6"),
                       (dict(maxnreg=300), "maxnreg must be None or an int in 24..255"),
                       (dict(num_ctas=3), "num_ctas must be 1, 2 or 4")):
        args = dict(block_m=64, block_n=64, num_warps=4, num_stages=2) | bad
        with pytest.raises(ValueError, match=match):
            C(**args)


@pytest.mark.parametrize("kind", ["dkdv", "dq"])
def test_sweep_candidates_baseline_first_then_the_axes_in_order(kind):
    base = attention.attention_configs(kind, "hopper")
    cands = tuning.sweep_candidates(kind, baseline=base)
    assert cands[:len(base)] == [C.of_config(b) for b in base]
    assert len(set(cands)) == len(cands)
    rest = cands[len(base):]
    held = (lambda c: c.block_n) if kind == "dkdv" else (lambda c: c.block_m)
    areas = [c.block_m * c.block_n for c in tuning.sweep_candidates(kind)]
    assert areas == sorted(areas, reverse=True)
    for c in tuning.sweep_candidates(kind):
        assert c.block_m * c.block_n >= 16 * 32 * c.num_warps   # no idle warps
        assert c.num_warps % 4 == 0 and c.num_ctas == 1
        assert c.maxnreg in (None, 168)
    # every point of the axes that passes the filter, once: tiles x warps x stages x caps
    tiles = {"dkdv": [(m, n) for m in (16, 32, 64, 128) for n in (64, 128)],
             "dq": [(m, n) for m in (64, 128) for n in (32, 64, 128)]}[kind]
    expected = {C(m, n, w, s, r) for m, n in tiles for w in (4, 8) for s in (1, 2, 3, 4)
                for r in (None, 168) if m * n >= 16 * 32 * w}
    assert set(tuning.sweep_candidates(kind)) == expected
    assert set(rest) == expected - set(cands[:len(base)])
    assert all(held(c) in (64, 128) for c in rest)


def test_sweep_candidates_options_filters_and_errors():
    few = tuning.sweep_candidates("dq", block_m=[64], block_n=[32], warps=[4], stages=[3],
                                  maxnreg=[None, 128], num_ctas=[1, 2])
    # no cap before a cap, no cluster before a cluster
    assert few == [C(64, 32, 4, 3, None, 1), C(64, 32, 4, 3, None, 2),
                   C(64, 32, 4, 3, 128, 1), C(64, 32, 4, 3, 128, 2)]
    # a cluster of 4 would split the 64 query rows into 16: allowed; 8 warps on 64x32: idle
    assert C(64, 32, 4, 3, None, 4) in tuning.sweep_candidates(
        "dq", block_m=[64], block_n=[32], warps=[4, 8], stages=[3], maxnreg=[None],
        num_ctas=[4])
    assert not tuning.sweep_candidates("dq", block_m=[64], block_n=[32], warps=[8])
    assert len(tuning.sweep_candidates("dkdv", limit=5)) == 5
    base = attention.attention_configs("dq", "hopper")
    assert len(tuning.sweep_candidates("dq", limit=2, baseline=base)) == len(base) + 2
    # the order does not depend on the order the axes are given in
    assert (tuning.sweep_candidates("dkdv", warps=[8, 4], stages=[4, 1, 2, 3])
            == tuning.sweep_candidates("dkdv", warps=[4, 8], stages=[1, 2, 3, 4]))
    with pytest.raises(ValueError, match="kind must be one of"):
        tuning.sweep_candidates("fwd")
    assert tuning.sweep_candidates("dq", limit=0, baseline=base) == [C.of_config(c)
                                                                     for c in base]
    with pytest.raises(ValueError, match="limit must be None or >= 0"):
        tuning.sweep_candidates("dq", limit=-1)


# ---- the winners file ------------------------------------------------------------------------
HEADERS = {"command": "python bench/attention_bwd_sweep.py", "commit": "abc1234",
           "machine": "NVIDIA H100 80GB HBM3", "date": "2026-11-27 12:00:00 UTC",
           "triton": "3.6.0"}


def entry(kernel="dkdv", sq=32768, sk=32768, cfg=None, **kw):
    fields = dict(kernel=kernel, arch="sm_90", dtype="bf16", head_dim=128, causal=True,
                  sq=sq, sk=sk, config=cfg or C(64, 128, 8, 3), ms=50.0, baseline_ms=60.0)
    if kernel == "dkdv":
        fields.update(dq_atomic=False, accumulate=False)
    fields.update(kw)
    return tuning.Entry(**fields)


def test_winners_file_round_trip_and_lookup(tmp_path):
    entries = [entry(), entry(sq=1024, sk=32768, cfg=C(32, 128, 8, 2), accumulate=True),
               entry("dq", cfg=C(128, 64, 8, 3, 168)),
               entry("dq", sq=1024, cfg=C(64, 64, 4, 3))]
    path = tmp_path / "w.json"
    tuning.write_winners(path, HEADERS, entries, note="test")
    data = json.loads(path.read_text())
    assert data["format"] == tuning.FORMAT
    assert {k: data[k] for k in tuning.HEADERS} == HEADERS
    w = tuning.load_winners(path)
    assert w.entries == tuple(entries) and w.headers["note"] == "test"
    look = w.lookup
    # exact keys, then the nearest (sq, sk) in log2 distance
    assert look("dkdv", "sm_90", "bf16", 128, True, 32768, 32768, False, False).config == \
        C(64, 128, 8, 3)
    assert look("dkdv", "sm_90", "bf16", 128, True, 16384, 16384, False, False).sq == 32768
    assert look("dkdv", "sm_90", "bf16", 128, True, 512, 32768, False, True).sq == 1024
    # accumulate=False excludes the accumulate=True entry even where it is nearer
    assert look("dkdv", "sm_90", "bf16", 128, True, 512, 32768, False, False).sq == 32768
    assert look("dq", "sm_90", "bf16", 128, True, 2048, 32768).sq == 1024
    assert look("dq", "sm_90", "bf16", 128, True, 8192, 32768).sq == 32768
    for miss in (("dq", "sm_80", "bf16", 128, True), ("dq", "sm_90", "fp16", 128, True),
                 ("dq", "sm_90", "bf16", 64, True), ("dq", "sm_90", "bf16", 128, False)):
        assert look(*miss, 4096, 4096) is None, miss
    assert look("dkdv", "sm_90", "bf16", 128, True, 4096, 4096, True, False) is None
    # a tie in distance goes to the larger shape
    tie = tuning.Winners({}, (entry("dq", sq=1024, sk=1024), entry("dq", sq=4096, sk=4096)))
    assert tie.lookup("dq", "sm_90", "bf16", 128, True, 2048, 2048).sq == 4096


H200_SWEEP = (Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu_h200_2026-11-27"
              / "quick_s_attention_bwd_configs.json")


def test_shipped_file_is_the_h200_sweep():
    """The shipped winners are the H200 sweep's file as it came back (nothing edited): its
    headers, and entries for sm_90 bf16 head_dim 128 causal only."""
    assert tuning.SHIPPED.read_bytes() == H200_SWEEP.read_bytes()
    w = tuning.load_winners(tuning.SHIPPED)
    assert set(tuning.HEADERS) <= set(w.headers)
    assert "H200" in w.headers["machine"] and w.headers["commit"].startswith("67ac4f8")
    assert {(e.arch, e.dtype, e.head_dim, e.causal) for e in w.entries} == {
        ("sm_90", "bf16", 128, True)}
    assert {(e.kernel, e.sq, e.sk, e.accumulate) for e in w.entries} == {
        ("dkdv", 32768, 32768, False), ("dkdv", 1056, 32768, True),
        ("dkdv", 282, 32768, True), ("dq", 32768, 32768, None), ("dq", 1056, 32768, None),
        ("dq", 282, 32768, None)}
    # each winner at most as slow as the baseline it was measured against
    assert all(e.ms <= e.baseline_ms for e in w.entries)


@pytest.mark.parametrize("kernel, capability, dtype, causal, sq, sk, atomic, accumulate, want", [
    # the whole sequence (the launch's buckets: S clamped to 32768)
    ("dkdv", (9, 0), torch.bfloat16, True, 32768, 32768, False, False, (C(64, 128, 8, 4), 0)),
    ("dkdv", (9, 0), torch.bfloat16, True, 4096, 4096, False, False, (C(64, 128, 8, 4), 0)),
    # query chunks adding dK / dV into the accumulators: 1056 rows (bucket 2048), 282 (512)
    ("dkdv", (9, 0), torch.bfloat16, True, 2048, 32768, False, True, (C(64, 64, 4, 2), 6)),
    ("dkdv", (9, 0), torch.bfloat16, True, 512, 32768, False, True, (C(64, 64, 4, 2), 6)),
    ("dq", (9, 0), torch.bfloat16, True, 2048, 32768, None, None, (C(128, 64, 8, 3), 0)),
    # the dK/dV kernel with the atomic dQ was not swept; other dtypes, GPUs, non-causal: none
    ("dkdv", (9, 0), torch.bfloat16, True, 32768, 32768, True, False, None),
    ("dkdv", (9, 0), torch.bfloat16, True, 2048, 32768, True, True, None),
    ("dkdv", (9, 0), torch.float16, True, 32768, 32768, False, False, None),
    ("dkdv", (8, 0), torch.bfloat16, True, 32768, 32768, False, False, None),
    ("dq", (9, 0), torch.float32, True, 2048, 32768, None, None, None),
    ("dq", (9, 0), torch.bfloat16, False, 2048, 32768, None, None, None),
])
def test_shipped_winners_serve_their_buckets(kernel, capability, dtype, causal, sq, sk, atomic,
                                             accumulate, want):
    tuning.forget()
    try:
        with config.patch(attention_bwd_configs=""):
            assert tuning.winner(kernel, capability, dtype, 128, causal, sq, sk, atomic,
                                 accumulate) == want
            if want is not None:   # another head_dim: the built-in candidates
                assert tuning.winner(kernel, capability, dtype, 64, causal, sq, sk, atomic,
                                     accumulate) is None
    finally:
        tuning.forget()


def _good():
    return tuning.winners_dict(HEADERS, [entry(), entry("dq")])


def _broken(change):
    data = _good()
    change(data)
    return data


MALFORMED = [
    ("json", "{not json", "cannot read the attention backward configs file"),
    ("format", _broken(lambda d: d.update(format="other")), "format must be"),
    ("header", _broken(lambda d: d.pop("commit")), "header 'commit' must be a non-empty"),
    ("entries", _broken(lambda d: d.update(entries={})), "entries must be a list"),
    ("kernel", _broken(lambda d: d["entries"][0].update(kernel="fwd")),
     "entry 0: kernel must be one of"),
    ("arch", _broken(lambda d: d["entries"][1].update(arch="hopper")),
     "entry 1: arch must be like 'sm_90'"),
    ("sq", _broken(lambda d: d["entries"][0].update(sq=0)), "entry 0: sq must be a positive"),
    ("causal", _broken(lambda d: d["entries"][0].update(causal=1)),
     "entry 0: causal must be a bool"),
    ("config", _broken(lambda d: d["entries"][0]["config"].pop("num_warps")),
     "entry 0: config must be an object with BLOCK_M"),
    ("config_value", _broken(lambda d: d["entries"][1]["config"].update(BLOCK_M=24)),
     "entry 1: config: Candidate: block_m must be a power of two"),
    ("unknown", _broken(lambda d: d["entries"][0].update(speed=1)),
     r"entry 0: unknown key\(s\) \['speed'\]"),
    ("spills", _broken(lambda d: d["entries"][0].update(spills=-1)),
     "entry 0: spills must be an int >= 0"),
    ("duplicate", _broken(lambda d: d["entries"].append(dict(d["entries"][0]))),
     "two entries have the same bucket"),
]


@pytest.mark.parametrize("name, content, match", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_names_the_file(tmp_path, name, content, match):
    path = tmp_path / f"bad_{name}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match) as info:
        tuning.load_winners(path)
    assert str(info.value).startswith(str(path)), info.value
    # read at launch through the setting: the same error, naming the file
    tuning.forget()
    try:
        with config.patch(attention_bwd_configs=str(path)):
            with pytest.raises(ValueError, match=match) as info:
                tuning.winner("dq", (9, 0), torch.bfloat16, 128, True, 4096, 4096)
        assert str(path) in str(info.value)
    finally:
        tuning.forget()


def test_setting_names_an_existing_file(tmp_path):
    with pytest.raises(ValueError, match="CKPT_EXT_ATTN_BWD_CONFIGS must be '' .* existing"):
        config.from_environment({"CKPT_EXT_ATTN_BWD_CONFIGS": str(tmp_path / "none.json")})
    path = tmp_path / "w.json"
    tuning.write_winners(path, HEADERS, [entry("dq", cfg=C(64, 32, 4, 2))])
    assert config.from_environment(
        {"CKPT_EXT_ATTN_BWD_CONFIGS": str(path)}).attention_bwd_configs == str(path)


@pytest.fixture
def as_if_on_hopper(monkeypatch):
    """The launchers as a GPU builds them (no interpreter, an sm_90 device), without
    launching anything: the caches are emptied before and after."""
    info = _launch.DeviceInfo("hopper", (9, 0), 227 * 1024, 132)
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "device_info", lambda device: info)
    monkeypatch.setattr(_launch, "autotuning", lambda: False)
    _launch._clear_caches()
    tuning.forget()
    yield torch.device("cuda", 0)
    _launch._clear_caches()
    tuning.forget()


def test_launcher_puts_the_winner_first(tmp_path, as_if_on_hopper):
    dev = as_if_on_hopper
    win = C(32, 128, 4, 4, 168)
    path = tmp_path / "w.json"
    tuning.write_winners(path, HEADERS, [entry(cfg=win), entry("dq", cfg=C(64, 64, 8, 2))])
    spec = (dev, torch.bfloat16, 128, True, False, False, False, "tf32")
    builtin = attention.attention_configs("dkdv", "hopper")
    # the shipped file (the H200 sweep): its winner for the whole bf16 sequence ...
    assert attention._bwd_choice("dkdv", dev, torch.bfloat16, 128, True, 32768, 32768, False,
                                 False, False) == (C(64, 128, 8, 4), False, 0)
    # ... and for fp16, which it did not sweep, no entry: the built-in order
    first, only, spills = attention._bwd_choice("dkdv", dev, torch.float16, 128, True, 32768,
                                                32768, False, False, False)
    assert (first, only, spills) == (None, False, 0)
    launcher, _ = attention._launcher("dkdv", *spec, False, False, False, first, only)
    assert [C.of_config(c) for c in launcher.configs] == [C.of_config(c) for c in builtin]
    with config.patch(attention_bwd_configs=str(path)):
        first, only, spills = attention._bwd_choice("dkdv", dev, torch.bfloat16, 128, True,
                                                    32768, 32768, False, False, False)
        assert (first, only, spills) == (win, False, 0)
        launcher, _ = attention._launcher("dkdv", *spec, False, False, False, first, only)
        got = [C.of_config(c) for c in launcher.configs]
        assert got[0] == win and got[1:] == [C.of_config(c) for c in builtin]
        assert launcher.configs[0].maxnreg == 168
        # a winner that is a built-in candidate moves to the front, not twice
        dq_first, _, _ = attention._bwd_choice("dq", dev, torch.bfloat16, 128, True, 4096,
                                               32768, None, None, False)
        assert dq_first == C(64, 64, 8, 2)
        launcher, _ = attention._launcher("dq", *spec, False, False, False, dq_first, False)
        got = [C.of_config(c) for c in launcher.configs]
        assert got[0] == dq_first and got.count(dq_first) == 1
        assert sorted(got, key=repr) == sorted(
            [C.of_config(c) for c in attention.attention_configs("dq", "hopper")], key=repr)
        # another dtype, an sm_80 device or a soft-capped kernel: no entry, no file read
        assert attention._bwd_choice("dkdv", dev, torch.float16, 128, True, 32768, 32768,
                                     False, False, False) == (None, False, 0)
        assert attention._bwd_choice("dkdv", dev, torch.bfloat16, 128, True, 32768, 32768,
                                     False, False, True) == (None, False, 0)
        # forced: that one alone, whatever the file says
        with tuning.force(dkdv=C(16, 64, 4, 2)):
            first, only, _ = attention._bwd_choice("dkdv", dev, torch.bfloat16, 128, True,
                                                   32768, 32768, False, False, True)
            assert (first, only) == (C(16, 64, 4, 2), True)
            launcher, _ = attention._launcher("dkdv", *spec, False, False, False, first, only)
            assert [C.of_config(c) for c in launcher.configs] == [C(16, 64, 4, 2)]
        assert tuning.forced("dkdv") is None


def test_a_winner_measured_with_spills_lets_the_launcher_keep_that_many(tmp_path,
                                                                         as_if_on_hopper):
    dev = as_if_on_hopper
    win = C(32, 128, 8, 2)
    path = tmp_path / "w.json"
    tuning.write_winners(path, HEADERS, [entry(cfg=win, spills=24)])
    assert tuning.load_winners(path).entries[0].spills == 24
    spec = (dev, torch.bfloat16, 128, True, False, False, False, "tf32")
    with config.patch(attention_bwd_configs=str(path)):
        choice = attention._bwd_choice("dkdv", dev, torch.bfloat16, 128, True, 32768, 32768,
                                       False, False, False)
        assert choice == (win, False, 24)
        launcher, _ = attention._launcher("dkdv", *spec, False, False, False, *choice)
        assert launcher.max_spills == 24 and C.of_config(launcher.configs[0]) == win
    # what the launcher keeps with that allowance: 24 spilled words pass, 25 do not
    R = _launch.Resources
    cfgs = [win.to_config(), C(16, 128, 8, 2).to_config()]
    assert _launch.prune(cfgs, [R(255, 24, 98560), R(246, 0, 82048)], 227 * 1024,
                         max_spills=24) == cfgs
    assert _launch.prune(cfgs, [R(255, 25, 98560), R(246, 0, 82048)], 227 * 1024,
                         max_spills=24) == cfgs[1:]
    assert _launch.prune(cfgs, [R(255, 24, 98560), R(246, 0, 82048)], 227 * 1024) == cfgs[1:]


def test_force_rejects_unknown_kernels_and_values():
    with pytest.raises(ValueError, match="kernels are"):
        with tuning.force(fwd=C(64, 64, 4, 2)):
            pass
    with pytest.raises(TypeError, match="dq must be a Candidate"):
        with tuning.force(dq=(64, 64, 4, 2)):
            pass


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the sweep (bench/attention_bwd_sweep.py) checks this")
@pytest.mark.parametrize("dkdv, dq", [(C(16, 64, 4, 2), C(64, 16, 4, 2)),
                                      (C(64, 16, 8, 3), C(16, 32, 4, 3))])
def test_forced_blocks_give_the_reference_gradients(dkdv, dq, monkeypatch):
    """A forced configuration's block sizes (in the interpreter) compute the same gradients
    as the fp64 reference: GQA, causal, odd lengths, and a query chunk adding into fp32
    accumulators as the layer calls it."""
    launched = []
    real = _launch.Fixed.__getitem__

    def spy(self, grid):
        launched.append(dict(self.meta() if callable(self.meta) else self.meta))
        return real(self, grid)

    monkeypatch.setattr(_launch.Fixed, "__getitem__", spy)
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, S, D, scale = 1, 4, 2, 45, 16, 0.3
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64)
                     for h in (Hq, Hkv, Hkv, Hq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*leaves, None, True, scale)
    ref_out.backward(dout)
    ref = [t.grad for t in leaves]
    f = [t.float() for t in (q, k, v, dout)]
    with tuning.force(dkdv=dkdv, dq=dq):
        out, lse = attention.attention_fwd(f[0], f[1], f[2], None, None, None, True, scale)
        grads = attention.attention_bwd(f[3], f[0], f[1], f[2], out, lse, None, None, None,
                                        True, scale)
        off = 29
        accs = [torch.zeros(B, Hkv, S, D) for _ in range(2)]
        qc, dc = f[0][:, :, off:], f[3][:, :, off:]
        out_c, lse_c = attention.attention_fwd(qc, f[1], f[2], None, None, None, True, scale,
                                               off)
        dq_c, _, _ = attention.attention_bwd(dc, qc, f[1], f[2], out_c, lse_c, None, None,
                                             None, True, scale, off, *accs)
    # the forced blocks were launched (the interpreter's own are 32 x 32), each twice
    assert launched.count(dkdv.blocks()) == 2 and launched.count(dq.blocks()) == 2, launched
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-5, (name, float(err))
    assert (dq_c.double() - ref[0][:, :, off:]).norm() / ref[0][:, :, off:].norm() < 1e-5
    # the chunk's share of dK / dV: the reference with only the chunk's rows' upstream grads
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, _ = attention_reference(*leaves, None, True, scale)
    mask = torch.zeros_like(dout)
    mask[:, :, off:] = 1
    o.backward(dout * mask)
    for got, want in zip(accs, (leaves[1].grad, leaves[2].grad)):
        assert (got.double() - want).norm() / want.norm() < 1e-5


# ---- ahead-of-time register / spill reports for sm_90 -----------------------------------------
_AOT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import check_triton_compile as t
t._prepare_environment()
import triton
attention, _, _ = t.load_kernel_modules(False)
t._MODULES["attention"] = attention
cuobjdump = t.find_cuobjdump()
out = []
for kind, bm, bn, w, s, cap in json.loads(sys.argv[2]):
    res = t.compile_job(t.attention_job(attention, kind, {"BLOCK_M": bm, "BLOCK_N": bn}, w, s,
                                        maxnreg=cap), cuobjdump)
    r = t.aot_resources(res)
    out.append(None if r is None else [r.regs, r.spills, r.shared, res.get("spill_stores")])
print("TRITON " + triton.__version__)
print("AOT" + json.dumps(out))
"""

# Another triton to compile with, besides the one installed here: a directory holding it
# (``pip install --no-deps --target DIR triton==3.6.0``, the GPU image's version).
_OTHER_TRITON = os.environ.get("CKPT_EXT_AOT_TRITON", "")


@pytest.mark.parametrize("site", ["installed"] + ([_OTHER_TRITON] if _OTHER_TRITON else []))
def test_aot_sweep_candidates_report_registers_and_spills_for_sm_90(site):
    """A few sweep candidates of both backward kernels (bf16, head_dim 128, causal), register
    capped and not, compiled for sm_90 ahead of time by tools/check_triton_compile.py's
    machinery (no GPU: triton's bundled ptxas; what the driver would report: registers, local
    memory / 4 as spills, shared memory). With the triton installed here (3.9.0 in this
    project's CPU environment; the GPU image has 3.6.0, which CKPT_EXT_AOT_TRITON=DIR adds as a
    second run): the cap holds (registers <= maxnreg) and, on a tile that wanted more
    registers, spills at least as much; ptxas's spill stores and the driver's count agree; the
    launchers' pruning keeps exactly the spill-free ones within Hopper's shared memory."""
    tools = Path(__file__).resolve().parents[1] / "tools"
    # the first built-in dK/dV candidate (since the one-loop causal walk: spill-free under
    # triton 3.6, 14 words under 3.9), the same capped at 168 (spills more under both), the
    # first built-in dQ candidate capped (3.6: spill-free, 3.9: spills), and a dQ tile that
    # compiles spill-free under both
    cands = [C(64, 128, 8, 3), C(64, 128, 8, 3, 168), C(128, 64, 8, 3, 168), C(64, 64, 4, 3)]
    kinds = ["dkdv", "dkdv", "dq", "dq"]
    job = [[k, c.block_m, c.block_n, c.num_warps, c.num_stages, c.maxnreg]
           for k, c in zip(kinds, cands)]
    found, out = aot_run(_AOT_SCRIPT, str(tools), json.dumps(job),
                         pythonpath=None if site == "installed" else site)
    version = next((ln[7:] for ln in out.splitlines() if ln.startswith("TRITON ")), "?")
    if any(r is None for r in found):
        print(f"AOT compile for sm_90 gave no resources for some candidates: {found}")
        pytest.skip("cuobjdump gave no resource line (AOT resources unavailable)")
    res = [_launch.Resources(*r[:3]) for r in found]
    print(f"triton {version} ({'installed here' if site == 'installed' else site}), sm_90, "
          f"bf16 D128 causal:",
          {f"{k} {c.label}": f"regs {r.regs} spills {r.spills} smem {r.shared}"
           for k, c, r in zip(kinds, cands, res)})
    if site != "installed":
        assert version.startswith("3.6"), f"CKPT_EXT_AOT_TRITON: expected triton 3.6, got {version}"
        # what the GPU image launches: the first built-in dK/dV tile compiles without spills
        # (the one-loop causal walk; the two-loop walk spilled 192 words here)
        assert res[0].spills == 0, f"dkdv {cands[0].label} spills under triton 3.6: {res[0]}"
    assert all(r.regs <= 255 for r in res)
    for c, r in zip(cands, res):
        if c.maxnreg is not None:
            assert r.regs <= c.maxnreg, (c, r)
    if res[0].regs > 168:   # the uncapped tile wanted more than the cap gives
        assert res[1].spills >= res[0].spills, res[:2]
    # the driver's count (local memory) and ptxas's log agree on which ones spill
    assert all((r.spills > 0) == bool(f[3]) for r, f in zip(res, found) if f[3] is not None)
    budget = 227 * 1024
    for kind in ("dkdv", "dq"):
        pairs = [(c.to_config(), r) for k, c, r in zip(kinds, cands, res) if k == kind]
        kept = _launch.prune([p[0] for p in pairs], [p[1] for p in pairs], budget)
        fitting = [cfg for cfg, r in pairs if r.spills == 0 and r.shared <= budget]
        if fitting:
            assert kept == fitting, (kind, pairs)
        else:   # none fits: the one that spills least, so that something runs
            assert kept == [min(pairs, key=lambda p: (p[1].spills, p[1].shared))[0]], pairs


def test_winners_file_ships_with_the_package():
    """The winners file lies beside the kernel modules, whose .py and .json files setup.py's
    build_py copies into a built install (tests/test_packaging.py builds that layout)."""
    assert tuning.SHIPPED.name == "attention_bwd_configs.json" and tuning.SHIPPED.is_file()
    assert tuning.SHIPPED.parent == Path(tuning.__file__).resolve().parent


def test_sweep_workers_compile_twins_of_the_same_specialization():
    """The sweep's compile workers run small twins of each bucket: every length Triton's JIT
    specializes (query rows, keys, the chunk's offset) keeps its remainder mod 16 and
    whether it is 1, so the twin compiles the kernel the main process launches."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "attention_bwd_sweep.py"
    spec = importlib.util.spec_from_file_location("attention_bwd_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--out", "x.json", "--device", "cpu", "--dtype", "fp32",
                             "--shape", "1,2,1,16"])
    for sq, sk in [(32768, 32768), (1056, 32768), (282, 32768), (56, 32768), (1, 4097),
                   (17, 17), (100, 131)]:
        b = sweep.Bucket(args, sq, sk, 0, measure=False)
        assert b.sq <= 80 and b.offset <= 80
        for got, want in ((b.sq, sq), (b.sk, sk), (b.offset, sk - sq)):
            assert got % 16 == want % 16 and (got == 1) == (want == 1), (sq, sk, got, want)
        assert b.chunk == (sq < sk)
