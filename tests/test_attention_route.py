"""ckpt_ext.attention_route: which kernel serves a CUDA attention call, and the SDPA plumbing.

* The chunk split and the merge by lse, exact in float64 on the CPU: ATen's CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``, top-left aligned) stands in for the
  CUDA ops, once as a top-left backend (a query chunk becomes two calls merged by lse, each
  piece's backward given the merged out and lse) and once made bottom-right (one call), run
  through the same router the CUDA registration uses, over query chunks whose dK / dV add into
  fp32 (here fp64) accumulators; compared with the plain-PyTorch fp64 reference. In bfloat16
  the merged results meet the suite's 2x / 3x rule.
* The rules (dtype, head_dim, masks, softcap, window, rows that see nothing, determinism of a
  backward, pinned backends raising with the rule they lack) on described calls.
* The choice table: the shipped one (the H200 measurement) picks per bucket what the
  measured times say and Triton outside its buckets; a file overrides it.
* The arguments handed to the CUDA aten ops, with fake CUDA tensors (FakeTensorMode): shapes,
  strides, dtypes, the causal alignment, lse layouts, GQA expansion and the results' layout.
* On a GPU (skipped here with the reason): every available SDPA backend, pinned, against the
  Triton kernels and float64 through the registered op.
"""
import dataclasses
import json
import math

import pytest
import torch

import ckpt_ext  # noqa: F401  (registers the ops)
from ckpt_ext import attention_route as route
from ckpt_ext import config

from reference import (F64, FACTOR_GRAD, FACTOR_OUT, attention_in_chunks, attention_reference,
                       check_f64, check_vs_baseline, magnitude)

aten = torch.ops.aten
cpu_ops = torch.ops.ckpt_ext


# ---- ATen's CPU flash kernel standing in for the CUDA ops -------------------------------------
class CpuFlashTopLeft:
    """A vendor adapter over the CPU flash kernel: causal aligned top-left, as cuDNN's; GQA
    K/V unexpanded (the kernel reads head h // group)."""

    name = "cpu-flash"
    bottom_right = False

    def fwd(self, q, k, v, causal, scale, window=None):
        assert window is None
        assert not causal or q.shape[2] == k.shape[2], "top-left causal asked for Sq < Sk"
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                    scale=scale)
        return out, lse

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None, deterministic=False):
        assert not causal or q.shape[2] == k.shape[2]
        Hkv = k.shape[1]
        # The CPU kernel reads lse in its own layout, (B, S, H) in memory.
        lse_cpu = lse.transpose(1, 2).contiguous().transpose(1, 2)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse_cpu, 0.0, causal, scale=scale)
        return dq, route._group_sum(dk, Hkv), route._group_sum(dv, Hkv)


class CpuFlashBottomRight(CpuFlashTopLeft):
    """The same kernel made bottom-right aligned: Sk - Sq zero query rows in front, a
    top-left call on the square, the last Sq rows kept (zero rows with zero dout add
    nothing to the gradients)."""

    name = "cpu-flash-br"
    bottom_right = True

    @staticmethod
    def _pad(t, Sk):
        B, H, Sq, D = t.shape
        return torch.cat([t.new_zeros(B, H, Sk - Sq, D), t], 2)

    def fwd(self, q, k, v, causal, scale, window=None):
        Sq, Sk = q.shape[2], k.shape[2]
        if not causal or Sq == Sk:
            return super().fwd(q, k, v, causal, scale, window)
        out, lse = super().fwd(self._pad(q, Sk), k, v, True, scale)
        return out[:, :, Sk - Sq:], lse[:, :, Sk - Sq:]

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None, deterministic=False):
        Sq, Sk = q.shape[2], k.shape[2]
        if not causal or Sq == Sk:
            return super().bwd(dout, q, k, v, out, lse, causal, scale, window, deterministic)
        B, H = q.shape[:2]
        lse_pad = torch.cat([lse.new_zeros(B, H, Sk - Sq), lse], 2)
        dq, dk, dv = super().bwd(self._pad(dout, Sk), self._pad(q, Sk), k, v,
                                 self._pad(out, Sk), lse_pad, True, scale)
        return dq[:, :, Sk - Sq:], dk, dv


ALL_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def cpu_caps(**kw):
    """Capabilities of a pretend device whose "flash" is the bottom-right stand-in and whose
    "cudnn" the top-left one (both take every dtype, so that float64 runs through them)."""
    base = dict(arch="cpu", backends=frozenset(("flash", "cudnn")),
                dtypes={"flash": ALL_DTYPES, "cudnn": ALL_DTYPES, "efficient": ALL_DTYPES},
                max_head_dim={"flash": 256, "cudnn": 256, "efficient": 256},
                bottom_right=frozenset(("flash",)))
    base.update(kw)
    return route.Capabilities(**base)


def cpu_router(caps=None):
    caps = caps or cpu_caps()
    return route.Router(capabilities=lambda device: caps,
                        adapters={"flash": CpuFlashBottomRight(), "cudnn": CpuFlashTopLeft()},
                        fallback_fwd=cpu_ops.attention_fwd, fallback_bwd=cpu_ops.attention_bwd)


def vendor_ops(adapter):
    """attention_fwd / attention_bwd signatures over route.vendor_fwd / vendor_bwd (no masks)."""
    def fwd(q, k, v, mask, seg, window, causal, scale, q_offset=0, softcap=0.0):
        assert mask is None and seg is None and window is None and softcap == 0.0
        return route.vendor_fwd(adapter, q, k, v, causal, scale, q_offset)

    def bwd(dout, q, k, v, out, lse, mask, seg, window, causal, scale, q_offset=0, dk_acc=None,
            dv_acc=None, softcap=0.0):
        return route.vendor_bwd(adapter, dout, q, k, v, out, lse, causal, scale, q_offset, None,
                                dk_acc, dv_acc)
    return fwd, bwd


def rand_qkv(B, Hq, Hkv, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g, dtype=F64).to(dtype)
                     for H in (Hq, Hkv, Hkv, Hq))
    return q, k, v, dout


def reference_grads(q, k, v, dout, causal, scale, window=None):
    """out, lse, dq, dk, dv of the plain-PyTorch reference at q's dtype (float64 for the
    ground truth)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, None, causal, scale, None, window)
    out.backward(dout.to(out.dtype))
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def causal_references(q, k, v, dout, scale, window=None):
    """(float64 ground truth, plain PyTorch at q's dtype) of causal attention, for
    :func:`check_accuracy_rule`."""
    return (reference_grads(*(t.double() for t in (q, k, v, dout)), True, scale, window),
            reference_grads(q, k, v, dout, True, scale, window))


def check_accuracy_rule(got, references, dtype=None):
    """out within 2x and dq, dk, dv within 3x plain PyTorch's error against float64 (the
    gradients' scale: the ground truth's largest)."""
    want, base = references
    grad_scale = magnitude(want["dq"], want["dk"], want["dv"])
    check_vs_baseline("out", got["out"], base["out"], want["out"], FACTOR_OUT)
    for name in ("dq", "dk", "dv"):
        check_vs_baseline(name, got[name], base[name], want[name], FACTOR_GRAD, dtype,
                          scale=grad_scale)


# ---- the split and the merge, exact in float64 -------------------------------------------------
@pytest.mark.parametrize("backend", ["cudnn", "flash"])          # split / one bottom-right call
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rows", [5, 8, 24])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_chunks_exact_in_float64(backend, causal, rows, heads):
    """Query chunks of ``rows`` rows (q_offset = the chunk's start) through the vendor path
    (the router's vendor_fwd / vendor_bwd, lse kept in fp64: the op hands fp32 lse on), dK / dV
    summed in fp64 accumulators over the chunks: out, lse, dq, dk, dv of the whole sequence
    equal the float64 reference to 1e-12."""
    B, S, D, scale = 2, 24, 16, 0.3
    q, k, v, dout = rand_qkv(B, *heads, S, D, F64)
    want = reference_grads(q, k, v, dout, causal, scale)
    adapter = cpu_router().adapters[backend]
    got = attention_in_chunks(*vendor_ops(adapter), q, k, v, dout, None, causal, scale,
                              None, None, rows, acc_dtype=F64)
    grad_scale = magnitude(want["dq"], want["dk"], want["dv"])
    for name in ("out", "lse", "dq", "dk", "dv"):
        check_f64(name, got[name], want[name],
                  scale=None if name in ("out", "lse") else grad_scale)


def test_split_is_two_calls_merged_and_each_backward_sees_the_merged_out():
    """The top-left backend serves a chunk after the first keys with a non-causal call on the
    earlier keys and a causal one on its own, and both backward pieces receive the merged out
    and lse (not their own): with a piece's own out the gradients would be wrong."""
    calls = []

    class Recording(CpuFlashTopLeft):
        def fwd(self, q, k, v, causal, scale, window=None):
            calls.append(("fwd", k.shape[2], causal))
            return super().fwd(q, k, v, causal, scale, window)

        def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None,
                deterministic=False):
            calls.append(("bwd", k.shape[2], causal, out.clone(), lse.clone()))
            return super().bwd(dout, q, k, v, out, lse, causal, scale, window, deterministic)

    q, k, v, dout = rand_qkv(1, 2, 1, 20, 16, F64)
    qc, dc = q[:, :, 12:18], dout[:, :, 12:18]
    out, lse = route.vendor_fwd(Recording(), qc, k, v, True, 0.25, q_offset=12)
    dq, dk, dv = route.vendor_bwd(Recording(), dc, qc, k, v, out, lse, True, 0.25, q_offset=12)
    assert [c[:3] for c in calls] == [("fwd", 12, False), ("fwd", 6, True), ("bwd", 12, False),
                                      ("bwd", 6, True)]
    for c in calls[2:]:
        assert torch.equal(c[3], out) and torch.equal(c[4], lse)
    # keys 18, 19 are seen by no row of the chunk: zero gradients; the others match fp64.
    assert dk[:, :, 18:].abs().max() == 0 and dv[:, :, 18:].abs().max() == 0
    dfull = torch.zeros_like(dout)
    dfull[:, :, 12:18] = dc
    want = reference_grads(q, k, v, dfull, True, 0.25)
    check_f64("out", out, want["out"][:, :, 12:18])
    check_f64("dq", dq, want["dq"][:, :, 12:18])
    check_f64("dk", dk, want["dk"])
    check_f64("dv", dv, want["dv"])


def test_merge_is_the_attention_over_both_key_sets():
    """merge() of two disjoint key sets' (out, lse) equals one call over their union."""
    q, k, v, _ = rand_qkv(2, 3, 3, 10, 8, F64, seed=3)
    ad = CpuFlashTopLeft()
    whole = ad.fwd(q, k, v, False, 0.5)
    a = ad.fwd(q, k[:, :, :4], v[:, :, :4], False, 0.5)
    b = ad.fwd(q, k[:, :, 4:], v[:, :, 4:], False, 0.5)
    out, lse = route.merge(*a, *b, F64)
    check_f64("out", out, whole[0])
    check_f64("lse", lse, whole[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merged_half_precision_meets_the_accuracy_rule(dtype):
    """bf16 / fp16 chunks through the split (each piece's out rounded to the dtype, merged in
    fp32): out within 2x and the gradients within 3x plain PyTorch's error at the dtype."""
    B, Hq, Hkv, S, D = 1, 4, 2, 48, 32
    scale = D ** -0.5
    q, k, v, dout = rand_qkv(B, Hq, Hkv, S, D, dtype, seed=5)
    references = causal_references(q, k, v, dout, scale)
    router = cpu_router()
    with config.patch(attention_backend="cudnn"):
        got = attention_in_chunks(router.fwd, router.bwd, q, k, v, dout, None, True, scale,
                                  None, None, 16)
    assert got["out"].dtype == dtype and got["lse"].dtype == torch.float32
    check_accuracy_rule(got, references, dtype)


# ---- routing through the router: settings, fallbacks ------------------------------------------
def test_masked_and_capped_calls_fall_back_and_rows_that_see_nothing_stay_exact():
    """Under "auto" with a table preferring the stand-in, calls with a padding mask, segment
    ids or a softcap go to the fallback (here the ATen CPU op): a fully padded row gives out 0,
    lse -inf and zero gradients, never NaN."""
    q, k, v, dout = rand_qkv(2, 2, 2, 12, 16, F64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1] = False   # batch row 1 sees nothing
    table = route.Table(rules=({"backends": ("cudnn",)},))
    router = cpu_router()
    with config.patch(attention_backend="auto"), _table(table):
        out, lse = router.fwd(q, k, v, None, None, None, True, 0.25)
        assert router.last == "cudnn"
        out, lse = router.fwd(q, k, v, mask, None, None, True, 0.25)
        assert router.last == "triton"
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.equal(lse[1], torch.full_like(lse[1], -math.inf))
        dq, dk, dv = router.bwd(dout, q, k, v, out, lse, mask, None, None, True, 0.25)
        assert router.last == "triton" and not any(t.isnan().any() for t in (dq, dk, dv))
        assert dq[1].abs().max() == 0 and dk[1].abs().max() == 0 and dv[1].abs().max() == 0
        seg = torch.zeros(2, 12, dtype=torch.int64)
        router.fwd(q, k, v, None, seg, None, True, 0.25)
        assert router.last == "triton"
        router.fwd(q, k, v, None, None, None, True, 0.25, 0, 30.0)
        assert router.last == "triton"


def test_pinned_backend_raises_with_the_rule_it_lacks():
    q, k, v, _ = rand_qkv(1, 2, 2, 8, 16, F64)
    mask = torch.ones(1, 8, dtype=torch.bool)
    router = cpu_router()
    with config.patch(attention_backend="cudnn"):
        with pytest.raises(route.BackendRefused, match="key_padding_mask"):
            router.fwd(q, k, v, mask, None, None, True, 0.25)
        with pytest.raises(route.BackendRefused, match="window: cudnn has no causal"):
            router.fwd(q, k, v, None, None, 3, True, 0.25)
        with pytest.raises(route.BackendRefused, match="softcap"):
            router.fwd(q, k, v, None, None, None, True, 0.25, 0, 5.0)
        router.fwd(q, k, v, None, None, 8, True, 0.25)   # window >= S hides nothing: served
        assert router.last == "cudnn"
    with config.patch(attention_backend="efficient"):
        with pytest.raises(route.BackendRefused, match="availability: efficient"):
            router.fwd(q, k, v, None, None, None, True, 0.25)


def test_default_settings_send_calls_outside_the_shipped_table_to_triton():
    """The shipped table holds the H200's measurement (sm90 rules only, bf16, head_dim 128,
    causal): with the default settings a call on another device (here the CPU stand-in,
    arch "cpu") goes to the fallback (the Triton launchers on CUDA), whatever the device
    offers."""
    assert config.KernelConfig().attention_backend == "auto"
    assert config.KernelConfig().attention_table == ""
    shipped = route.load_table(route.SHIPPED_TABLE)
    assert not shipped.always_triton and shipped.default == ("triton",)
    assert {(r["arch"], r["dtype"], r["head_dim"], r["causal"]) for r in shipped.rules} == {
        ("sm90", "bf16", 128, True)}
    q, k, v, dout = rand_qkv(1, 4, 2, 16, 16, torch.float32)
    router = cpu_router()
    with config.patch(attention_backend="auto", attention_table=""):
        assert route.current_table() == shipped
        out, lse = router.fwd(q, k, v, None, None, None, True, 0.25)
        assert router.last == "triton"
        ref = cpu_ops.attention_fwd(q, k, v, None, None, None, True, 0.25)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
        # bf16 at head_dim 128 too: the table has no rule for this arch
        q, k, v, _ = rand_qkv(1, 4, 2, 16, 128, torch.bfloat16)
        router.fwd(q, k, v, None, None, None, True, 128 ** -0.5)
        assert router.last == "triton"
    call = route.Call("fwd", torch.bfloat16, 1, 32, 8, 282, 4096, 128, True, 3814)
    assert route.choose(call, dataclasses.replace(_sm90(), arch="sm80"), "auto",
                        shipped) == "triton"


def test_router_skips_the_table_on_an_arch_it_does_not_name(monkeypatch):
    """With the shipped table (sm90 rules only) every call on another arch goes straight to
    the fallback, no choice made and its masks unread, as with an empty table; on sm90 a
    packed call that flash would serve has its masks read (here described as refused, so the
    choice is made again and Triton serves it)."""
    chosen = []
    real_select = route.select
    monkeypatch.setattr(route, "select", lambda *a, **kw: chosen.append(a[0]) or real_select(
        *a, **kw))
    shipped = route.load_table(route.SHIPPED_TABLE)
    assert shipped.triton_only_on("sm80") and shipped.triton_only_on("cpu")
    assert not shipped.triton_only_on("sm90")
    any_arch = route.Table(({"phase": "fwd", "backends": ("flash",)},))
    assert not any_arch.triton_only_on("sm80")            # a rule without arch: every device
    assert not route.Table((), ("flash", "triton")).triton_only_on("sm80")
    assert route.Table().triton_only_on("sm90")
    q, k, v, _ = rand_qkv(1, 4, 2, 16, 128, torch.bfloat16)
    seg = torch.tensor([[0] * 9 + [1] * 7])
    ref = cpu_ops.attention_fwd(q, k, v, None, seg, None, True, 128 ** -0.5)
    for arch, reads, choices in (("sm80", 0, 0), ("sm90", 1, 2)):
        router, seen = cpu_router(cpu_caps(arch=arch)), []
        router.describe = lambda mask, ids, seen=seen: seen.append(ids) or "test: refused"
        chosen.clear()
        with config.patch(attention_backend="auto", attention_table=""):
            out, lse = router.fwd(q, k, v, None, seg, None, True, 128 ** -0.5)
        assert router.last == "triton" and len(seen) == reads, arch
        assert len(chosen) == choices, arch
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def _shipped_choice(dq_mode="separate", arch="sm90", **kw):
    return route.choose(_call(**kw), _sm90(arch=arch), "auto",
                        route.load_table(route.SHIPPED_TABLE), dq_mode)


_S, _ROWS = 32768, 1152   # the H200 run's whole sequence; the layer's chunk rows there
_CHUNK = dict(Sq=_ROWS, Sk=_S, q_offset=18 * _ROWS)   # keys 21888: past every bounded rule
_PACKED = dict(segments=True)


@pytest.mark.parametrize("call, dq_mode, want", [
    # unmasked: cuDNN measured fastest forward and backward at every shape ...
    (dict(Sq=_S, Sk=_S), "separate", "cudnn"),
    (dict(phase="bwd", Sq=_S, Sk=_S), "atomic", "cudnn"),
    # ... but its backward is not deterministic: under "separate" the next listed, Triton
    (dict(phase="bwd", Sq=_S, Sk=_S), "separate", "triton"),
    (dict(phase="bwd", Sq=8192, Sk=8192), "separate", "triton"),
    (dict(Sq=1056, Sk=_S, q_offset=_S - 1056), "separate", "cudnn"),
    (dict(phase="bwd", Sq=1056, Sk=_S, q_offset=_S - 1056), "separate", "triton"),
    (dict(phase="bwd", Sq=1056, Sk=_S, q_offset=_S - 1056), "atomic", "cudnn"),
    (dict(Sq=512, Sk=_S, q_offset=_S - 512), "separate", "cudnn"),
    (dict(Sq=_ROWS, Sk=17280, q_offset=17280 - _ROWS), "separate", "cudnn"),
    (_CHUNK, "separate", "cudnn"),
    (dict(_CHUNK, phase="bwd"), "separate", "triton"),
    (dict(_CHUNK, phase="bwd"), "atomic", "cudnn"),
    # the layer's first chunk (q_offset 0, 1152 rows): flash's deterministic backward ran
    # second to cuDNN's, ahead of Triton's
    (dict(phase="bwd", Sq=_ROWS, Sk=_ROWS), "separate", "flash"),
    (dict(Sq=_ROWS, Sk=_ROWS), "separate", "cudnn"),
    # packed documents: flash's variable-length op (cuDNN has none) ...
    (dict(_PACKED, Sq=1056, Sk=_S, q_offset=_S - 1056), "separate", "flash"),
    (dict(_PACKED, phase="bwd", Sq=1056, Sk=_S, q_offset=_S - 1056), "separate", "flash"),
    (dict(_PACKED, **_CHUNK), "separate", "flash"),
    (dict(_PACKED, Sq=_S, Sk=_S), "separate", "flash"),
    # ... except the whole 32K sequence's backward, where Triton's was faster
    (dict(_PACKED, phase="bwd", Sq=_S, Sk=_S), "atomic", "triton"),
    (dict(_PACKED, phase="bwd", Sq=_ROWS, Sk=_ROWS), "separate", "flash"),
    # outside the measured buckets: Triton
    (dict(Sq=_S, Sk=_S, dtype=torch.float32), "separate", "triton"),
    (dict(Sq=_S, Sk=_S, dtype=torch.float16), "separate", "triton"),
    (dict(Sq=_S, Sk=_S, D=64), "separate", "triton"),
    (dict(Sq=_S, Sk=_S, causal=False), "separate", "triton"),
    (dict(Sq=_S, Sk=_S, masked=True), "separate", "triton"),
    (dict(_CHUNK, masked=True), "atomic", "triton"),
])
def test_shipped_table_follows_the_h200_measurement(call, dq_mode, want):
    """The shipped table (bench/results/gpu_h200_2026-11-27/quick_d_attention.txt, bf16,
    head_dim 128, causal, Hq/Hkv 32/8) on a described sm90 with every backend: what the
    measured times say, and Triton on any other GPU."""
    assert _shipped_choice(dq_mode, **call) == want
    assert _shipped_choice(dq_mode, arch="sm80", **call) == "triton"


def test_shipped_table_names_its_measurement():
    data = json.loads(route.SHIPPED_TABLE.read_text())
    assert "cudnn" not in _sm90().deterministic_bwd     # why "separate" backwards skip it
    measured = "\n".join(data["measured"])
    for text in ("source: bench/results/gpu_h200_2026-11-27/quick_d_attention.txt",
                 "device: NVIDIA H200", "arch: sm90", "commit: 67ac4f8", "date: 2026-11-27"):
        assert text in measured
    assert "H200" in data["note"] and "quick_d_attention.txt" in data["note"]
    assert "DESIGN" not in data["note"] and "STYLE" not in data["note"]


# ---- the rules on described calls --------------------------------------------------------------
def _sm90(**kw):
    base = dict(arch="sm90", backends=frozenset(route.VENDOR),
                dtypes={"flash": route._HALF, "cudnn": route._HALF,
                        "efficient": frozenset((torch.float16, torch.bfloat16, torch.float32))},
                max_head_dim={"flash": 256, "cudnn": 128, "efficient": 256},
                window=frozenset(("flash",)))
    base.update(kw)
    return route.Capabilities(**base)


def _call(**kw):
    base = dict(phase="fwd", dtype=torch.bfloat16, B=1, Hq=32, Hkv=8, Sq=1024, Sk=1024, D=128,
                causal=True)
    base.update(kw)
    return route.Call(**base)


@pytest.mark.parametrize("change, backend, rule", [
    (dict(dtype=torch.float32), "flash", "dtype: flash takes bf16, fp16"),
    (dict(dtype=torch.float32), "cudnn", "dtype: cudnn"),
    (dict(dtype=torch.float64), "efficient", "dtype: efficient"),
    (dict(D=256), "cudnn", "head_dim: cudnn takes multiples of 8 up to 128"),
    (dict(D=72 + 4), "flash", "head_dim: flash"),
    (dict(D=288), "flash", "head_dim"),
    (dict(masked=True), "cudnn", "key_padding_mask: cudnn has no variable-length op"),
    (dict(segments=True), "efficient", "segment_ids: efficient has no variable-length op"),
    (dict(segments=True, masks_refusal="ids decrease"), "flash", "segment_ids: ids decrease"),
    (dict(masked=True, segments=True), "flash", "key_padding_mask with segment_ids: the"),
    (dict(masked=True, window=128), "flash", "window with key_padding_mask"),
    (dict(softcap=50.0), "flash", "softcap"),
    (dict(window=128), "cudnn", "window: cudnn has no causal"),
    (dict(window=128), "efficient", "window"),
    (dict(window=128, causal=False), "flash", "window: flash has no non-causal"),
    (dict(Sq=0, Sk=0, causal=False), "flash", None),   # nothing to compute: Triton, no raise
    (dict(Sq=4096, Sk=1 << 20, q_offset=(1 << 20) - 4096), "efficient", "gqa: efficient"),
])
def test_each_rule_excludes_the_backend(change, backend, rule):
    call = _call(**change)
    lacking = route.refusals(backend, call, _sm90())
    if rule is None:
        assert route.choose(call, _sm90(), backend) == "triton"
        return
    assert any(rule in r for r in lacking), lacking
    with pytest.raises(route.BackendRefused, match=rule.split(":")[0]):
        route.choose(call, _sm90(), backend)
    table = route.Table(rules=({"backends": (backend, "triton")},))
    assert route.choose(call, _sm90(), "auto", table) == "triton"


def test_served_calls():
    caps = _sm90()
    for backend in route.VENDOR:
        assert route.refusals(backend, _call(), caps) == []
        assert route.refusals(backend, _call(q_offset=3000, Sq=282, Sk=3282), caps) == []
    assert route.refusals("flash", _call(window=512), caps) == []     # causal window: flash
    # padded and packed calls: flash's variable-length op (the masks' shape is checked later)
    assert route.refusals("flash", _call(masked=True), caps) == []
    assert route.refusals("flash", _call(segments=True, window=512, q_offset=300), caps) == []
    assert route.refusals("cudnn", _call(window=1024), caps) == []    # window >= keys: none
    assert route.refusals("efficient", _call(dtype=torch.float32, D=84), caps) == []
    # rows that see nothing: a call with no keys
    assert any("empty rows" in r for r in route.refusals(
        "flash", _call(Sk=0, causal=False, Sq=4), caps))
    assert route.refusals("flash", _call(), _sm90(backends=frozenset()))[0].startswith(
        "availability")


def test_backward_determinism():
    """A vendor backward serves under attention_dq "separate" (or "ordered") only if
    deterministic: efficient (num_splits_key=1) and flash (FlashAttention-2's deterministic
    backward, under the flag its adapter turns on); cudnn never. "atomic" or a pin allows
    any."""
    caps = _sm90()
    bwd = _call(phase="bwd")
    table = route.Table(rules=({"phase": "bwd", "backends": ("cudnn", "flash", "efficient")},
                               {"backends": ("cudnn",)}))
    assert route.choose(_call(), caps, "auto", table, "separate") == "cudnn"   # forward
    assert route.choose(bwd, caps, "auto", table, "separate") == "flash"
    assert route.choose(bwd, caps, "auto", table, "ordered") == "flash"   # deterministic too
    assert route.choose(bwd, caps, "auto", table, "atomic") == "cudnn"
    assert route.choose(bwd, caps, "cudnn", None, "separate") == "cudnn"        # pinned
    only_cudnn = route.Table(rules=({"backends": ("cudnn",)},))
    assert route.choose(bwd, caps, "auto", only_cudnn, "separate") == "triton"


# ---- attention_dq "auto": torch's determinism flag decides ------------------------------------
FLAGS = {"off": (False, False), "warn": (True, True), "strict": (True, False)}


@pytest.fixture
def torch_flag():
    """Sets torch.use_deterministic_algorithms as FLAGS names it; the user's back after."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())

    def set_flag(name):
        on, warn_only = FLAGS[name]
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
        assert config.determinism() == name
    yield set_flag
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def fresh_warning(monkeypatch):
    """The one-time warning not yet given in this process."""
    import threading
    monkeypatch.setattr(route, "_warned", threading.Event())


def _auto(call, flag, arch="sm90", table=None, **caps):
    return route.select(_call(**call), _sm90(arch=arch, **caps), "auto",
                        table or route.load_table(route.SHIPPED_TABLE), "auto",
                        config.determinism())


_SEP = ("triton", "separate", True)


@pytest.mark.parametrize("call, off, strict", [
    # whole 32K and the layer's query chunks: cuDNN's backward (non-deterministic) when the
    # flag is off; on, Triton's fastest deterministic mode (the H200 CSV timed "separate" only)
    (dict(phase="bwd", Sq=_S, Sk=_S), ("cudnn", None, False), _SEP),
    (dict(phase="bwd", Sq=1056, Sk=_S, q_offset=_S - 1056), ("cudnn", None, False), _SEP),
    (dict(_CHUNK, phase="bwd"), ("cudnn", None, False), _SEP),
    # the layer's first chunk: flash's deterministic backward ran second there
    (dict(phase="bwd", Sq=_ROWS, Sk=_ROWS), ("cudnn", None, False), ("flash", None, True)),
    # packed: flash's variable-length op, in its fastest variant when the flag is off
    (dict(_PACKED, phase="bwd", Sq=1056, Sk=_S, q_offset=_S - 1056), ("flash", None, False),
     ("flash", None, True)),
    (dict(_PACKED, phase="bwd", Sq=_S, Sk=_S), _SEP, _SEP),
    # forwards do not depend on the flag
    (dict(Sq=_S, Sk=_S), ("cudnn", None, True), ("cudnn", None, True)),
    # outside the measured buckets: Triton "separate" (the default list names no other mode)
    (dict(phase="bwd", Sq=_S, Sk=_S, D=64), _SEP, _SEP),
])
@pytest.mark.parametrize("flag", ["off", "warn", "strict"])
def test_auto_follows_torchs_determinism_flag_on_sm90_and_sm80(torch_flag, call, off, strict,
                                                               flag):
    """attention_dq "auto" with the shipped table on a described sm90 (every backend) and
    sm80 (no rule: Triton): the flag off and warn_only take the fastest backward measured,
    the flag on the fastest deterministic one."""
    torch_flag(flag)
    want = strict if flag == "strict" else off
    got = _auto(call, flag)
    assert (got.backend, got.dq_mode, got.deterministic) == want
    sm80 = _auto(call, flag, arch="sm80")
    assert (sm80.backend, sm80.dq_mode) == (("triton", "separate") if call.get("phase")
                                            else ("triton", None))


def test_auto_takes_the_fastest_triton_mode_the_flag_allows(torch_flag):
    """A format-2 list where Triton's modes were faster: off, the fastest (atomic), on, the
    fastest deterministic one (ordered, ahead of flash and separate); on a described sm80
    whose rule lists flash first, flash either way (deterministic only when the flag is on).
    An explicit mode keeps its own place; a list naming no deterministic entry falls back to
    Triton "separate"."""
    table = route.Table(rules=(
        {"phase": "bwd", "head_dim": 64, "backends": ("cudnn", "triton:atomic")},
        {"arch": "sm90", "phase": "bwd", "backends": (
            "triton:atomic", "cudnn", "triton:ordered", "flash", "triton:separate")},
        {"arch": "sm80", "phase": "bwd", "backends": ("flash", "triton:atomic",
                                                      "triton:separate")}))
    sm80_caps = dict(backends=frozenset(("flash", "efficient")))
    bwd = dict(phase="bwd")
    for flag, sm90, sm80, few in (
            ("off", ("triton", "atomic", False), ("flash", None, False), ("cudnn", None, False)),
            ("warn", ("triton", "atomic", False), ("flash", None, False),
             ("cudnn", None, False)),
            ("strict", ("triton", "ordered", True), ("flash", None, True), _SEP)):
        torch_flag(flag)
        for got, want in ((_auto(bwd, flag, table=table), sm90),
                          (_auto(bwd, flag, "sm80", table, **sm80_caps), sm80),
                          (_auto(dict(bwd, D=64), flag, table=table), few)):
            assert (got.backend, got.dq_mode, got.deterministic) == want, flag
    for mode, want in (("separate", "flash"), ("ordered", "triton"), ("atomic", "triton")):
        assert route.choose(_call(**bwd), _sm90(), "auto", table, mode) == want


def test_pinned_backends_under_auto(torch_flag):
    """Pinned under "auto": flash and efficient run their deterministic backward only when
    the flag is on; cudnn's backward is refused when it is (as torch's SDPA leaves cuDNN out
    then); a pinned Triton takes the list's fastest mode the flag allows."""
    table = route.Table(rules=({"phase": "bwd", "backends": ("triton:atomic", "cudnn",
                                                              "triton:separate")},))
    bwd = _call(phase="bwd")
    for flag in ("off", "warn", "strict"):
        torch_flag(flag)
        det = config.determinism()
        for backend in ("flash", "efficient"):
            got = route.select(bwd, _sm90(), backend, table, "auto", det)
            assert (got.backend, got.deterministic) == (backend, flag == "strict")
        got = route.select(bwd, _sm90(), "triton", table, "auto", det)
        assert got.dq_mode == ("separate" if flag == "strict" else "atomic")
        if flag == "strict":
            with pytest.raises(route.BackendRefused, match="determinism: cudnn has no "
                                                           "deterministic backward"):
                route.select(bwd, _sm90(), "cudnn", table, "auto", det)
        else:
            assert route.select(bwd, _sm90(), "cudnn", table, "auto", det).backend == "cudnn"
    # an explicit dQ mode keeps today's rule: a pinned backend serves whatever the flag
    assert route.select(bwd, _sm90(), "cudnn", table, "separate", "strict").backend == "cudnn"


def test_the_router_under_auto_warns_once_with_warn_only(torch_flag, fresh_warning):
    """The router on the CPU stand-ins, a table preferring cuDNN's backward (not
    deterministic): the flag off, cudnn serves silently; warn_only, cudnn serves and one
    warning names the op and what ran, once per process; on, Triton (the fallback) serves.
    Each result matches the fallback's."""
    import warnings

    q, k, v, dout = rand_qkv(1, 4, 2, 16, 16, torch.float32)
    router = cpu_router()
    table = route.Table(rules=({"phase": "bwd", "backends": ("cudnn", "triton:separate")},
                               {"backends": ("triton",)}))
    with config.patch(attention_backend="auto", attention_dq="auto"), _table(table):
        out, lse = router.fwd(q, k, v, None, None, None, True, 0.25)
        want = cpu_ops.attention_bwd(dout, q, k, v, out, lse, None, None, None, True, 0.25)
        messages = []
        for flag, served, warned in (("off", "cudnn", 0), ("warn", "cudnn", 1),
                                     ("warn", "cudnn", 0), ("strict", "triton", 0),
                                     ("warn", "cudnn", 0)):
            torch_flag(flag)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.25)
            assert router.last == served, flag
            mine = [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                    and "ckpt_ext::attention_bwd" in str(w.message)]
            assert len(mine) == warned, (flag, [str(w.message) for w in caught])
            messages += mine
            for a, b in zip(got, want):   # fp32 sums in another order: a few ulps
                assert (a - b).abs().max() <= 64 * torch.finfo(torch.float32).eps * max(
                    1.0, b.abs().max())
    assert "not deterministic (cudnn)" in messages[0] and "warn_only=True" in messages[0]


@pytest.mark.parametrize("user_flag", [(False, False), (True, True), (True, False)])
def test_flash_backward_runs_under_torchs_deterministic_flag(fake_cuda, monkeypatch,
                                                            user_flag):
    """Asked for a deterministic backward, the flash adapter runs the aten call (dense and
    variable-length) with torch.use_deterministic_algorithms(True) in force, and gives the
    user's setting (off, warn-only, on) back after it; not asked, it leaves the flag alone."""
    seen = []

    class Watching:
        def __getattr__(self, name):
            call = getattr(fake_cuda, name)

            def wrapped(*args, **kwargs):
                if name == "_flash_attention_backward":
                    seen.append((torch.are_deterministic_algorithms_enabled(),
                                 torch.is_deterministic_algorithms_warn_only_enabled()))
                return call(*args, **kwargs)
            return wrapped
    monkeypatch.setattr(route, "aten", Watching())
    adapter = route.FlashAdapter()
    q, k, v, dout, _, _ = _fake_inputs(1, 8, 2, 64, 64, 64)
    lse = torch.empty(1, 8, 64, device="cuda")
    cu = torch.zeros(2, dtype=torch.int32, device="cuda")
    flat = [t.transpose(1, 2).reshape(64, t.shape[1], 64) for t in (q, k, v, dout)]
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(user_flag[0], warn_only=user_flag[1])
        for deterministic in (True, False):
            adapter.bwd(dout, q, k, v, dout, lse, True, 0.1, None, deterministic)
            adapter.varlen_bwd(flat[3], flat[0], flat[1], flat[2], flat[3], lse.select(0, 0), cu, cu, 64,
                               64, True, 0.1, None, deterministic)
            assert (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) == user_flag
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert seen == [(True, False)] * 2 + [user_flag] * 2


# ---- the table -----------------------------------------------------------------------------------
def test_table_rules_match_buckets(tmp_path):
    data = {"format": route.TABLE_FORMAT, "default": "triton", "rules": [
        {"arch": "sm90", "phase": "fwd", "chunk": True, "sq_max": 2048, "backends": "flash"},
        {"arch": "sm90", "dtype": "bf16", "keys_min": 8192, "backends": ["cudnn", "flash"]},
    ]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    table = route.load_table(path)
    assert table.lookup(_call(q_offset=1000, Sk=2024), "sm90") == ("flash",)
    assert table.lookup(_call(q_offset=1000, Sk=2024), "sm80") == ("triton",)
    assert table.lookup(_call(Sq=8192, Sk=8192), "sm90") == ("cudnn", "flash")
    assert table.lookup(_call(phase="bwd", q_offset=1000, Sk=2024), "sm90") == ("triton",)
    with config.patch(attention_table=str(path)):
        assert route.current_table() == table
    route.forget_tables()


def test_format_1_tables_still_load(tmp_path):
    """A format-1 file (Triton named once, timed under "separate", lists cut after it) loads,
    its "triton" read as "triton:separate"; it may not name a dQ mode."""
    one = "ckpt_ext attention backend table 1"
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"format": one, "default": "triton", "rules": [
        {"phase": "bwd", "backends": ["cudnn", "flash", "triton"]}]}))
    table = route.load_table(path)
    bwd = _call(phase="bwd")
    assert table.lookup(bwd, "sm90") == ("cudnn", "flash", "triton")
    assert route.entry("triton") == ("triton", "separate") == route.entry("triton:separate")
    assert route.choose(bwd, _sm90(), "auto", table, "separate") == "flash"
    assert route.choose(bwd, _sm90(), "auto", table, "atomic") == "cudnn"
    assert table.triton_only_on("sm80") is False     # a rule without arch: every device
    path.write_text(json.dumps({"format": one, "rules": [{"backends": ["triton:atomic"]}]}))
    with pytest.raises(ValueError, match="backends"):
        route.load_table(path)


def test_format_2_lists_place_triton_per_dq_mode():
    """A format-2 backward list names Triton per dQ mode and is not cut: under a dQ mode
    Triton's place is that mode's entry (the first Triton entry when the list has none of
    it), the vendors before it tried, the deterministic modes skipping cudnn."""
    caps = _sm90()
    bwd = _call(phase="bwd")
    table = route.Table(rules=({"phase": "bwd", "backends": (
        "triton:atomic", "cudnn", "triton:ordered", "flash", "triton:separate", "efficient")},
        {"phase": "fwd", "backends": ("cudnn", "triton:atomic", "flash")}))
    assert route.choose(bwd, caps, "auto", table, "atomic") == "triton"    # fastest there
    assert route.choose(bwd, caps, "auto", table, "ordered") == "triton"   # before flash
    assert route.choose(bwd, caps, "auto", table, "separate") == "flash"   # cudnn skipped
    no_ordered = route.Table(rules=({"backends": ("cudnn", "triton:separate", "flash",
                                                  "triton:atomic")},))
    assert route.choose(bwd, caps, "auto", no_ordered, "ordered") == "triton"  # first Triton
    assert route.choose(bwd, caps, "auto", no_ordered, "atomic") == "cudnn"
    # a forward: the first Triton entry is Triton, whatever its mode
    assert route.choose(_call(), caps, "auto", table, "separate") == "cudnn"
    assert route.choose(_call(), _sm90(backends=frozenset(("flash",))), "auto", table,
                        "separate") == "triton"
    # cudnn refused (head_dim 256): the next entry; under "atomic" Triton's place is its own
    # entry, past flash
    assert route.choose(_call(phase="bwd", D=256), caps, "auto", no_ordered,
                        "atomic") == "flash"
    assert route.choose(_call(D=256), caps, "auto", table, "atomic") == "triton"


@pytest.mark.parametrize("data, match", [
    ({"rules": []}, "format"),
    ({"format": route.TABLE_FORMAT, "rules": [{"backends": "sdpa"}]}, "backends"),
    ({"format": route.TABLE_FORMAT, "rules": [{"backends": "triton:fast"}]}, "backends"),
    ({"format": route.TABLE_FORMAT, "rules": [{"seq": 4, "backends": "flash"}]}, "unknown key"),
    ({"format": route.TABLE_FORMAT, "rules": [{"causal": 1, "backends": "flash"}]}, "bool"),
    ({"format": route.TABLE_FORMAT, "rules": [{"sq_min": "4", "backends": "flash"}]}, "int"),
])
def test_bad_tables_name_the_file(tmp_path, data, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match) as info:
        route.load_table(path)
    assert str(path) in str(info.value)


def test_settings_read_from_the_environment(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": route.TABLE_FORMAT}))
    got = config.from_environment({"CKPT_EXT_ATTN_BACKEND": "cudnn",
                                   "CKPT_EXT_ATTN_TABLE": str(path)})
    assert (got.attention_backend, got.attention_table) == ("cudnn", str(path))
    with pytest.raises(ValueError, match="CKPT_EXT_ATTN_BACKEND must be one of 'auto', "
                                         "'triton', 'flash', 'cudnn', 'efficient'"):
        config.from_environment({"CKPT_EXT_ATTN_BACKEND": "sdpa"})
    with pytest.raises(ValueError, match="CKPT_EXT_ATTN_TABLE must be '' .* existing file"):
        config.from_environment({"CKPT_EXT_ATTN_TABLE": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match="attention_table"):
        with config.patch(attention_table=str(tmp_path / "missing.json")):
            pass


# ---- the CUDA plumbing with fake CUDA tensors ---------------------------------------------------
class Recorder:
    """Stands for torch.ops.aten inside attention_route: records every call's name and
    arguments, then runs the op (on fake tensors: its shape function). The efficient backward's
    shape function in torch 2.13 lacks the ``out`` argument, so it is served here with
    the results it documents: gradients shaped like query, key, value."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(aten, name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "_efficient_attention_backward":
                _, q, k, v = args[:4]
                return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                        torch.empty((), device=q.device))
            return op(*args, **kwargs)
        return call

    def named(self, name):
        return [c for c in self.calls if c[0] == name]


def _bshd_laid(t):
    return t.transpose(1, 2).is_contiguous()


@pytest.fixture
def fake_cuda(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    recorder = Recorder()
    monkeypatch.setattr(route, "aten", recorder)
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield recorder


def _fake_inputs(B, Hq, Hkv, Sq, Sk, D, dtype=torch.bfloat16):
    """q (B, Hq, Sq, D) and k, v (B, Hkv, Sk, D) views of (B, S, H, D) projections, as the
    layer holds them; dout likewise; fp32 accumulators (B, Hkv, Sk, D) laid out (B, Sk, Hkv, D)."""
    def proj(S, H):
        return torch.empty(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2)
    acc = torch.zeros(B, Sk, Hkv, D, device="cuda", dtype=torch.float32).transpose(1, 2)
    return proj(Sq, Hq), proj(Sk, Hkv), proj(Sk, Hkv), proj(Sq, Hq), acc, acc.clone()


def _check_results(out, lse, dq, B, Hq, Sq, D, dtype):
    assert out.shape == (B, Hq, Sq, D) and out.dtype == dtype and _bshd_laid(out)
    assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert dq.shape == (B, Hq, Sq, D) and dq.dtype == dtype and _bshd_laid(dq)


def _fake_router():
    return route.Router(capabilities=lambda device: _sm90())


def test_flash_plumbing_on_fake_cuda(fake_cuda):
    """A query chunk (282 rows after 3,000 keys, GQA 32/8) in one bottom-right causal flash
    call: (B, S, H, D) operands with a unit last stride, K/V unexpanded and cut at the chunk's
    end, lse (B, Hq, Sq); the causal window as window_size_left."""
    B, Hq, Hkv, Sq, off, D = 2, 32, 8, 282, 3000, 128
    q, k, v, dout, dk_acc, dv_acc = _fake_inputs(B, Hq, Hkv, Sq, off + Sq + 50, D)
    router = _fake_router()
    with config.patch(attention_backend="flash"):
        out, lse = router.fwd(q, k, v, None, None, None, True, 0.1, off)
        dq, dk, dv = router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1, off,
                                dk_acc, dv_acc)
        router.fwd(q, k, v, None, None, 1024, True, 0.1, off)
    _check_results(out, lse, dq, B, Hq, Sq, D, torch.bfloat16)
    assert dk.shape == (0,) and dv.shape == (0,)
    (_, fa, fkw), (_, wa, wkw) = fake_cuda.named("_flash_attention_forward")
    for t, shape in zip(fa[:3], ((B, Sq, Hq, D), (B, off + Sq, Hkv, D), (B, off + Sq, Hkv, D))):
        assert t.shape == shape and t.stride(-1) == 1
    assert fa[3:10] == (None, None, Sq, off + Sq, 0.0, True, False) and fkw == {"scale": 0.1}
    assert wkw == {"scale": 0.1, "window_size_left": 1023, "window_size_right": 0}
    (_, ba, bkw), = fake_cuda.named("_flash_attention_backward")
    assert ba[0].shape == (B, Sq, Hq, D) and ba[5].shape == (B, Hq, Sq)
    assert ba[6:12] == (None, None, Sq, off + Sq, 0.0, True)


def test_cudnn_plumbing_on_fake_cuda(fake_cuda):
    """cuDNN is top-left aligned: a chunk is a non-causal call on the earlier keys and a
    causal one on its own keys; lse comes as (B, H, S, 1) and goes back so; dK / dV of the two
    pieces land in their slices of the accumulators."""
    B, Hq, Hkv, Sq, off, D = 1, 8, 2, 96, 160, 64
    q, k, v, dout, dk_acc, dv_acc = _fake_inputs(B, Hq, Hkv, Sq, off + Sq, D)
    router = _fake_router()
    with config.patch(attention_backend="cudnn"):
        out, lse = router.fwd(q, k, v, None, None, None, True, 0.1, off)
        dq, _, _ = router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1, off,
                              dk_acc, dv_acc)
        # whole sequence, no accumulators: dk / dv returned in k's dtype and layout
        q2, k2, v2, d2, _, _ = _fake_inputs(B, Hq, Hkv, 64, 64, D)
        o2, l2 = router.fwd(q2, k2, v2, None, None, None, True, 0.1)
        _, dk2, dv2 = router.bwd(d2, q2, k2, v2, o2, l2, None, None, None, True, 0.1)
    _check_results(out, lse, dq, B, Hq, Sq, D, torch.bfloat16)
    assert dk2.shape == k2.shape and dk2.dtype == k2.dtype and _bshd_laid(dk2)
    fwds = fake_cuda.named("_scaled_dot_product_cudnn_attention")
    assert [(a[1].shape[2], a[6]) for _, a, _ in fwds] == [(off, False), (Sq, True), (64, True)]
    for _, a, _ in fwds:
        assert a[0].shape == (B, Hq, Sq if a[0].shape[2] == Sq else 64, D)
        assert a[1].shape[1] == Hkv and a[4] is True and all(t.stride(-1) == 1 for t in a[:3])
    bwds = fake_cuda.named("_scaled_dot_product_cudnn_attention_backward")
    assert [(a[2].shape[2], a[14]) for _, a, _ in bwds] == [(off, False), (Sq, True), (64, True)]
    assert bwds[0][1][5].shape == (B, Hq, Sq, 1)
    # both pieces get the same (merged) out and lse
    assert bwds[0][1][4] is not None and bwds[0][1][4].shape == bwds[1][1][4].shape


def test_efficient_plumbing_on_fake_cuda(fake_cuda):
    """efficient: K/V expanded to Hq heads, causal mask type 2 (bottom-right), lse sliced from
    its 32-row padding and padded back for the backward, num_splits_key=1 under a
    deterministic setting ("separate", or "auto" with torch's flag on) and left to torch
    under "atomic" and "auto" with the flag off; dK / dV summed back to Hkv."""
    B, Hq, Hkv, Sq, off, D = 1, 8, 2, 100, 60, 64
    q, k, v, dout, dk_acc, dv_acc = _fake_inputs(B, Hq, Hkv, Sq, off + Sq, D, torch.float32)
    router = _fake_router()
    with config.patch(attention_backend="efficient"):
        out, lse = router.fwd(q, k, v, None, None, None, True, 0.1, off)
        with config.patch(attention_dq="separate"):
            dq, dk, dv = router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1, off)
        with config.patch(attention_dq="atomic"):
            router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1, off)
        with config.patch(attention_dq="auto"):
            router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1, off)
            with config.asking_determinism("strict"):
                router.bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1, off)
    _check_results(out, lse, dq, B, Hq, Sq, D, torch.float32)
    assert dk.shape == k.shape and _bshd_laid(dk)
    (_, fa, fkw), = fake_cuda.named("_efficient_attention_forward")
    assert fa[1].shape == (B, off + Sq, Hq, D) and fa[9:11] == (2, True)
    (_, b1, k1), (_, b2, k2), (_, _, k3), (_, _, k4) = fake_cuda.named(
        "_efficient_attention_backward")
    assert b1[10].shape == (B, Hq, 128) and b1[14] == 2
    assert [k["num_splits_key"] for k in (k1, k2, k3, k4)] == [1, None, None, 1]


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_fake_non_causal_chunk_and_fp32_rules(fake_cuda, backend):
    """A non-causal chunk sees every key (one call on all of them); fp32 reaches only
    efficient."""
    q, k, v, *_ = _fake_inputs(1, 4, 4, 32, 96, 64, torch.bfloat16)
    router = _fake_router()
    with config.patch(attention_backend=backend):
        out, lse = router.fwd(q, k, v, None, None, None, False, 0.1, 40)
        assert out.shape == q.shape and lse.shape == q.shape[:3]
        q32, k32, v32, *_ = _fake_inputs(1, 4, 4, 32, 96, 64, torch.float32)
        if backend == "efficient":
            router.fwd(q32, k32, v32, None, None, None, False, 0.1, 40)
        else:
            with pytest.raises(route.BackendRefused, match="dtype"):
                router.fwd(q32, k32, v32, None, None, None, False, 0.1, 40)
    keys = [c[1][1].shape[1 if backend != "cudnn" else 2] for c in fake_cuda.calls
            if "backward" not in c[0]]
    assert keys and all(n == 96 for n in keys)


# ---- on a GPU: each backend through the registered op ------------------------------------------
def _gpu_backends():
    if not torch.cuda.is_available():
        return []
    return sorted(route.cuda_capabilities(torch.device("cuda")).backends)


@pytest.mark.gpu(reason="the SDPA backends need a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("window", [None, 40])
def test_gpu_backend_matches_fp64_in_chunks(backend, window):
    """bf16, GQA 8/2, hd 128: whole sequence and query chunks (dK / dV into fp32 accumulators)
    through torch.ops.ckpt_ext with the backend pinned: within 2x / 3x plain PyTorch's error
    against float64, as the Triton kernels are."""
    if backend not in _gpu_backends():
        pytest.skip(f"{backend} is not available on this GPU / torch")
    if window is not None and backend != "flash":
        pytest.skip(f"{backend} serves no window (refused by rule)")
    torch.manual_seed(0)
    B, Hq, Hkv, S, D, scale = 2, 8, 2, 250, 128, 128 ** -0.5   # odd lengths: 250, 96, 58
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                     for H in (Hq, Hkv, Hkv, Hq))
    references = causal_references(q, k, v, dout, scale, window)
    ops = torch.ops.ckpt_ext
    with config.patch(attention_backend=backend):
        for rows in (S, 96):
            got = attention_in_chunks(ops.attention_fwd, ops.attention_bwd, q, k, v, dout, None,
                                      True, scale, None, window, rows)
            assert route.CUDA_ROUTER.last == backend
            check_accuracy_rule(got, references)


def _bucket_inputs(seed):
    """(q, k, v, dout, scale, causal_references) on the GPU at the shipped table's bucket:
    bf16, B 1, GQA 32/8, head_dim 128, S 2000."""
    torch.manual_seed(seed)
    B, Hq, Hkv, S, D, scale = 1, 32, 8, 2000, 128, 128 ** -0.5
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                     for H in (Hq, Hkv, Hkv, Hq))
    return q, k, v, dout, scale, causal_references(q, k, v, dout, scale)


def _recording(served):
    """attention_fwd / attention_bwd through the registered ops, each call's backend
    (CUDA_ROUTER.last) appended to ``served``."""
    ops = torch.ops.ckpt_ext

    def recorded(op):
        def call(*args):
            got = op(*args)
            served.append(route.CUDA_ROUTER.last)
            return got
        return call
    return recorded(ops.attention_fwd), recorded(ops.attention_bwd)


@pytest.mark.gpu(reason="the shipped table's SDPA backends need a CUDA GPU")
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_gpu_shipped_table_mixes_backends_within_the_rule(dq_mode):
    """The default settings on an sm90 GPU, in the shipped table's measured bucket (bf16, hd
    128, causal, GQA 32/8): cuDNN's forward, and a backward by another backend reading its out
    and lse (under "separate": Triton's, flash's on whole calls of at most 1,152 rows) or by
    cuDNN (under "atomic"), whole and in query chunks with dK / dV into fp32 accumulators:
    within 2x / 3x of plain PyTorch's error against float64."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the shipped table has rules for sm90 only")
    if not {"cudnn", "flash"} <= set(_gpu_backends()):
        pytest.skip("cudnn or flash is not available on this GPU / torch")
    q, k, v, dout, scale, references = _bucket_inputs(2)
    S = q.shape[2]
    served = []
    fwd, bwd = _recording(served)
    atomic = dq_mode == "atomic"
    with config.patch(attention_backend="auto", attention_table="", attention_dq=dq_mode):
        # whole: one call each; chunks of 700 rows: the first (q_offset 0, 700 keys) a whole
        # call of the table's small bucket, then two query chunks
        for rows, expect in ((S, ["cudnn", "cudnn" if atomic else "triton"]),
                             (700, ["cudnn", "cudnn" if atomic else "flash"]
                              + ["cudnn", "cudnn" if atomic else "triton"] * 2)):
            served.clear()
            got = attention_in_chunks(fwd, bwd, q, k, v, dout, None, True, scale, None, None,
                                      rows)
            assert served == expect, (rows, served)
            check_accuracy_rule(got, references)


@pytest.mark.gpu(reason="torch's determinism flag over the CUDA backends needs a CUDA GPU")
def test_gpu_strict_steps_are_bitwise_equal_and_the_default_meets_the_rule(torch_flag):
    """attention_dq "auto" with the shipped table (on an sm90, its bucket: bf16, hd 128,
    causal, GQA 32/8; elsewhere Triton), whole and in query chunks of 700 rows with dK / dV
    into fp32 accumulators: with torch.use_deterministic_algorithms(True) two steps are
    equal bit for bit and only deterministic backwards served; with the flag off (the
    fastest backwards, cuDNN's where the table says) a step is within 2x / 3x plain
    PyTorch's error against float64."""
    q, k, v, dout, scale, references = _bucket_inputs(3)
    S = q.shape[2]
    served = []
    _, bwd = _recording(served)

    def step():
        return [attention_in_chunks(torch.ops.ckpt_ext.attention_fwd, bwd, q, k, v, dout, None,
                                    True, scale, None, None, rows) for rows in (S, 700)]

    with config.patch(attention_backend="auto", attention_table="", attention_dq="auto"):
        torch_flag("strict")
        first, second = step(), step()
        strict_served = list(served)
        torch_flag("off")
        served.clear()
        default = step()
    assert "cudnn" not in strict_served, strict_served
    for a, b in zip(first, second):
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert torch.equal(a[name], b[name]), name
    for got in default:
        check_accuracy_rule(got, references)
    if torch.cuda.get_device_capability() == (9, 0) and "cudnn" in _gpu_backends():
        assert "cudnn" in served, served      # the default's backward: cuDNN's where it won


@pytest.mark.gpu(reason="the SDPA backends need a CUDA GPU")
def test_gpu_default_is_triton_and_auto_follows_a_table(tmp_path):
    if not _gpu_backends():
        pytest.skip("no SDPA backend available on this GPU / torch")
    # head_dim 64: outside every bucket of the shipped table (measured at 128), so Triton
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.ops.ckpt_ext.attention_fwd(q, k, v, None, None, None, True, 0.125)
    assert route.CUDA_ROUTER.last == "triton"
    backend = _gpu_backends()[0]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": route.TABLE_FORMAT, "rules": [
        {"phase": "fwd", "backends": [backend]}]}))
    with config.patch(attention_table=str(path)):
        torch.ops.ckpt_ext.attention_fwd(q, k, v, None, None, None, True, 0.125)
        assert route.CUDA_ROUTER.last == backend
    route.forget_tables()


@pytest.mark.gpu(reason="the SDPA backends need a CUDA GPU")
@pytest.mark.parametrize("backend", ["efficient", "flash"])
def test_gpu_deterministic_backward_is_bitwise_repeatable(backend):
    """What the determinism rule assumes: efficient's backward with num_splits_key=1, and
    flash's under the flag the adapter turns on, repeat bit for bit (a check, not a proof: a
    nondeterministic sum can repeat by chance); torch's flag is the user's again after."""
    if backend not in _gpu_backends():
        pytest.skip(f"{backend} is not available on this GPU / torch")
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    ops = torch.ops.ckpt_ext
    before = torch.are_deterministic_algorithms_enabled()
    with config.patch(attention_backend=backend, attention_dq="separate"):
        out, lse = ops.attention_fwd(q, k, v, None, None, None, True, 0.1)
        runs = [ops.attention_bwd(dout, q, k, v, out, lse, None, None, None, True, 0.1)
                for _ in range(5)]
    assert torch.are_deterministic_algorithms_enabled() == before
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, runs[0]))


def _table(table):
    """A block in which current_table() returns ``table``."""
    class Block:
        def __enter__(self):
            self.saved = dict(route._tables)
            route._tables.clear()
            path = config.current().attention_table or str(route.SHIPPED_TABLE)
            route._tables[path] = table

        def __exit__(self, *exc):
            route._tables.clear()
            route._tables.update(self.saved)
    return Block()


def test_cuda_registration_goes_through_the_router():
    """The CUDA implementations registered by ckpt_ext._backend: attention through this
    module's router, the other ops their Triton launchers."""
    from ckpt_ext import _backend
    assert _backend._cuda_impl("attention_fwd") is route.attention_fwd
    assert _backend._cuda_impl("attention_bwd") is route.attention_bwd
    assert _backend._cuda_impl("swiglu_fwd").__name__ == "swiglu_fwd"
    assert route.CUDA_ROUTER.fallback_fwd is route._triton_fwd
    assert route.CUDA_ROUTER.adapters is route.ADAPTERS


@pytest.mark.gpu(reason="the SDPA backends need a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("vendor_phase", ["fwd", "bwd"])
def test_gpu_vendor_and_triton_phases_mix_exactly(backend, vendor_phase):
    """A table may give the forward and the backward of one call to different backends (the
    shipped one gives unmasked forwards to cuDNN and leaves deterministic backwards on
    Triton): the backward then reads the other backend's out and lse. bf16, GQA 8/2, hd 128,
    whole sequence and query chunks, against float64 under the 2x / 3x rule."""
    if backend not in _gpu_backends():
        pytest.skip(f"{backend} is not available on this GPU / torch")
    torch.manual_seed(1)
    B, Hq, Hkv, S, D, scale = 2, 8, 2, 250, 128, 128 ** -0.5
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                     for H in (Hq, Hkv, Hkv, Hq))
    references = causal_references(q, k, v, dout, scale)
    other = "bwd" if vendor_phase == "fwd" else "fwd"
    table = route.Table.from_dict({"format": route.TABLE_FORMAT, "rules": [
        {"phase": vendor_phase, "backends": [backend]},
        {"phase": other, "backends": ["triton"]}]})
    ops = torch.ops.ckpt_ext
    # the default dq mode for a Triton backward; a vendor backward that is not deterministic
    # serves only attention_dq="atomic"
    dq = "atomic" if vendor_phase == "bwd" else "separate"
    with config.patch(attention_backend="auto", attention_dq=dq), _table(table):
        for rows in (S, 96):
            got = attention_in_chunks(ops.attention_fwd, ops.attention_bwd, q, k, v, dout, None,
                                      True, scale, None, None, rows)
            assert route.CUDA_ROUTER.last == (backend if vendor_phase == "bwd" else "triton")
            check_accuracy_rule(got, references)
