"""ckpt_ext.attention_varlen: padded and packed attention calls on FlashAttention-2's
variable-length op, and their routing by ckpt_ext.attention_route.

* The cut: for every mask layout the route serves (packed documents of odd lengths, left,
  right and two-sided padding, a row with no real key), causal or not, with and without a
  window, whole and chunked, every query row lies in exactly one sequence, and the keys each
  sequence's row sees under the vendor's bottom-right causal alignment are exactly the rows of
  the dense mask (``ckpt_ext.plain.attention_allowed``); the rows in no sequence are the rows
  that see nothing.
* The plumbing, exact in float64: a CPU stand-in of the variable-length op (plain PyTorch per
  sequence; its backward uses the out and lse it is given, as the vendor's does, and it checks
  the cumulative lengths, maxima and layouts it receives) through the same functions the CUDA
  route calls, over query chunks with dK / dV added into accumulators, against the
  plain-PyTorch float64 reference; rows that see nothing give 0, -inf and zero gradients.
* The masks read once per tensor; ids that decrease and padding with holes refused with the
  reason, and then served by the fallback (or a pinned backend raising with the rule).
* The arguments handed to ``aten._flash_attention_forward`` / ``_backward`` with fake CUDA
  tensors.
* A patched HF model whose CPU attention ops are the router with the stand-in pinned: packed
  and padded batches through the tiled layer's own calls give the ATen kernels' loss and
  gradients.
* On a GPU (skipped here with the reason): flash's variable-length op pinned against float64.
"""
import math

import pytest
import torch

import ckpt_ext  # noqa: F401  (registers the ops)
from ckpt_ext import attention_route as route
from ckpt_ext import attention_varlen as varlen
from ckpt_ext import config

from reference import (F64, FACTOR_GRAD, FACTOR_OUT, allowed_matrix, attention_in_chunks,
                       attention_reference, check_f64, check_vs_baseline, magnitude)
from test_attention_route import (CpuFlashBottomRight, CpuFlashTopLeft, _sm90, _table,
                                  cpu_caps, rand_qkv)
from test_attention_route import fake_cuda  # noqa: F401  (the fixture)

cpu_ops = torch.ops.ckpt_ext


# ---- the masks users have ----------------------------------------------------------------------
def packed_ids(doc_lengths_per_row, dtype=torch.int32):
    """Segment ids as transformers' packing makes them: a new id at each document start."""
    rows = []
    for lengths in doc_lengths_per_row:
        rows.append(torch.cat([torch.full((n,), i, dtype=dtype)
                               for i, n in enumerate(lengths)]))
    return torch.stack(rows)


def padding(S, runs):
    """A key padding mask (B, S) with the real keys [a, e) of each row (None: no real key)."""
    m = torch.zeros(len(runs), S, dtype=torch.bool)
    for b, run in enumerate(runs):
        if run is not None:
            m[b, run[0]:run[1]] = True
    return m


S = 13
LAYOUTS = {
    "packed": dict(segment_ids=packed_ids([[4, 1, 6, 2], [13]])),
    "packed-many": dict(segment_ids=packed_ids([[1, 1, 3, 5, 2, 1], [7, 6]])),
    "left-pad": dict(key_padding_mask=padding(S, [(5, 13), (0, 13)])),
    "right-pad": dict(key_padding_mask=padding(S, [(0, 9), (0, 1)])),
    "both-sides": dict(key_padding_mask=padding(S, [(3, 10), None])),
}


def _layout(masks):
    got = varlen.describe(masks.get("key_padding_mask"), masks.get("segment_ids"))
    assert isinstance(got, varlen.Layout), got
    return got


# ---- the cut -----------------------------------------------------------------------------------
def _visible(seq, causal, window):
    """The (query, key) position pairs one sequence computes under the vendor's rules:
    causal aligned bottom-right (the last query with the last key), the window left of it."""
    b, q0, q1, k0, k1 = seq
    pairs = set()
    for i in range(q1 - q0):
        for j in range(k1 - k0):
            diag = i + (k1 - k0) - (q1 - q0)
            if causal and j > diag:
                continue
            if window is not None and j <= diag - window:
                continue
            pairs.add((b, q0 + i, k0 + j))
    return pairs


# the windows the route serves: causal, packed (test_refusals checks the others)
CUTS = [(name, causal, window) for name in sorted(LAYOUTS) for causal in (True, False)
        for window in (None, 3) if window is None or (causal and name.startswith("packed"))]


@pytest.mark.parametrize("name, causal, window", CUTS)
@pytest.mark.parametrize("rows", [S, 5, 4])
def test_the_sequences_see_exactly_what_the_mask_allows(name, causal, window, rows):
    masks = LAYOUTS[name]
    layout = _layout(masks)
    allowed = allowed_matrix(2, S, masks.get("key_padding_mask"), causal, "cpu",
                             masks.get("segment_ids"), window)[:, 0]
    for q0 in range(0, S, rows):
        Sq = min(rows, S - q0)
        seqs = varlen.plan(layout, Sq, q0, causal)
        covered, pairs = [], set()
        for launch in seqs.launches:
            for seq in launch.seqs:
                assert seq[4] - seq[3] >= 1, "a sequence with no key reached the launch"
                covered += [(seq[0], r) for r in range(seq[1], seq[2])]
                pairs |= _visible(seq, launch.causal, window)
            assert launch.max_q == max(s[2] - s[1] for s in launch.seqs)
            assert launch.max_k == max(s[4] - s[3] for s in launch.seqs)
        assert len(covered) == len(set(covered)), "a query row in two sequences"
        want = {(b, i, j) for b in range(2) for i in range(q0, q0 + Sq) for j in range(S)
                if allowed[b, i, j]}
        assert pairs == want
        empty = {(b, i) for b in range(2) for i in range(q0, q0 + Sq) if not allowed[b, i].any()}
        assert empty == {(b, i) for b in range(2) for i in range(q0, q0 + Sq)} - set(covered)
        assert sum(n for _, n, _, _ in seqs.rows) == 2 * Sq


def test_one_packed_row_gathers_views():
    """A packed batch of one row: each launch's queries and keys are one range of the
    flattened rows (views, no copy)."""
    layout = _layout(dict(segment_ids=packed_ids([[300, 212, 500, 12]])))
    for q0, Sq in ((0, 1024), (256, 282), (700, 324)):
        launch, = varlen.plan(layout, Sq, q0, True).launches
        assert len(launch.q_ranges) == 1 and len(launch.k_ranges) == 1
        assert launch.k_ranges[0][0] == max(s for s, _ in layout.runs[0] if s <= q0)


# ---- the plumbing, exact in float64 ------------------------------------------------------------
class CpuVarlen(CpuFlashBottomRight):
    """A stand-in of the variable-length op in plain PyTorch, sequence by sequence: causal
    aligned bottom-right, the window left of the diagonal, GQA K/V unexpanded; lse (Hq, Tq).
    Its backward uses the out and lse it is given. It checks what it receives: int32
    cumulative lengths that end at the rows given, the maxima, a unit last stride, and no
    sequence without keys."""

    name = "cpu-varlen"

    def __init__(self):
        self.launches = []

    @staticmethod
    def _lengths(cu_q, cu_k, q, k, max_q, max_k):
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        cq, ck = cu_q.tolist(), cu_k.tolist()
        assert len(cq) == len(ck) >= 2 and cq[0] == ck[0] == 0
        assert cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
        lq = [b - a for a, b in zip(cq, cq[1:])]
        lk = [b - a for a, b in zip(ck, ck[1:])]
        assert max_q == max(lq) and max_k == max(lk) and min(lk) >= 1
        assert q.stride(-1) == 1 and k.stride(-1) == 1
        return list(zip(cq, lq, ck, lk))

    @staticmethod
    def _scores(q, k, causal, scale, window):
        """q (ql, Hq, D), k (kl, Hkv, D) -> scaled scores (Hq, ql, kl), -inf where hidden."""
        group = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
        ql, kl = q.shape[0], k.shape[0]
        diag = torch.arange(ql)[:, None] + kl - ql
        j = torch.arange(kl)[None, :]
        hide = torch.zeros(ql, kl, dtype=torch.bool)
        if causal:
            hide |= j > diag
            assert ql <= kl, "a causal sequence with more queries than keys"
        if window is not None:
            assert causal
            hide |= j <= diag - window
        return s.masked_fill(hide, -math.inf)

    def varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
        self.launches.append(("fwd", causal, cu_q.tolist(), cu_k.tolist()))
        outs, lses = [], []
        group = q.shape[1] // k.shape[1]
        for q0, ql, k0, kl in self._lengths(cu_q, cu_k, q, k, max_q, max_k):
            s = self._scores(q[q0:q0 + ql], k[k0:k0 + kl], causal, scale, window)
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[..., None])
            outs.append(torch.einsum("hqk,khd->qhd", p,
                                     v[k0:k0 + kl].repeat_interleave(group, 1)))
            lses.append(lse)
        return torch.cat(outs).to(q.dtype), torch.cat(lses, 1)

    def varlen_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                   window=None, deterministic=False):
        self.launches.append(("bwd", causal, cu_q.tolist(), cu_k.tolist()))
        assert lse.shape == (q.shape[1], q.shape[0]) and dout.shape == out.shape == q.shape
        Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        group = Hq // Hkv
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape[0], Hkv, D, dtype=F64)
        dv = torch.zeros_like(dk)
        for q0, ql, k0, kl in self._lengths(cu_q, cu_k, q, k, max_q, max_k):
            qs, ks, vs = q[q0:q0 + ql], k[k0:k0 + kl], v[k0:k0 + kl]
            do, o = dout[q0:q0 + ql], out[q0:q0 + ql]
            p = torch.exp(self._scores(qs, ks, causal, scale, window)
                          - lse[:, q0:q0 + ql, None])
            vr, kr = vs.repeat_interleave(group, 1), ks.repeat_interleave(group, 1)
            dp = torch.einsum("qhd,khd->hqk", do, vr)
            delta = (do * o).sum(-1).transpose(0, 1)[..., None]           # (Hq, ql, 1)
            ds = p * (dp - delta) * scale
            dq[q0:q0 + ql] = torch.einsum("hqk,khd->qhd", ds, kr)
            grouped = lambda t: t.view(kl, Hkv, group, D).sum(2)           # noqa: E731
            dk[k0:k0 + kl] = grouped(torch.einsum("hqk,qhd->khd", ds, qs))
            dv[k0:k0 + kl] = grouped(torch.einsum("hqk,qhd->khd", p, do))
        return dq, dk, dv


def varlen_ops(adapter, describe=varlen.describe):
    """attention_fwd / attention_bwd signatures straight over attention_varlen (the lse stays
    float64 for float64 inputs)."""
    def seqs_of(q, mask, seg, causal, q_offset):
        return varlen.plan(describe(mask, seg), q.shape[2], q_offset, causal)

    def fwd(q, k, v, mask, seg, window, causal, scale, q_offset=0, softcap=0.0):
        return varlen.varlen_fwd(adapter, q, k, v, seqs_of(q, mask, seg, causal, q_offset),
                                 scale, window)

    def bwd(dout, q, k, v, out, lse, mask, seg, window, causal, scale, q_offset=0, dk_acc=None,
            dv_acc=None, softcap=0.0):
        return varlen.varlen_bwd(adapter, dout, q, k, v, out, lse,
                                 seqs_of(q, mask, seg, causal, q_offset), scale, window, dk_acc,
                                 dv_acc)
    return fwd, bwd


def _reference(q, k, v, dout, masks, causal, scale, window):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, masks.get("key_padding_mask"), causal, scale,
                                   masks.get("segment_ids"), window)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rows", [S, 5])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_exact_in_float64(name, causal, rows, heads):
    masks = LAYOUTS[name]
    window = 4 if causal and "segment_ids" in masks else None
    q, k, v, dout = rand_qkv(2, heads[0], heads[1], S, 8, F64, seed=rows + len(name))
    want = _reference(q, k, v, dout, masks, causal, 0.3, window)
    fwd, bwd = varlen_ops(CpuVarlen())
    got = attention_in_chunks(fwd, bwd, q, k, v, dout, masks.get("key_padding_mask"), causal,
                              0.3, masks.get("segment_ids"), window, rows, acc_dtype=F64)
    for key in ("out", "dq", "dk", "dv"):
        check_f64(key, got[key], want[key])
    finite = torch.isfinite(want["lse"])
    assert torch.equal(finite, torch.isfinite(got["lse"]))
    assert (got["lse"][~finite] == -math.inf).all()
    check_f64("lse", got["lse"][finite], want["lse"][finite])
    if not finite.all():   # rows that see nothing: 0 and zero gradients, exactly
        rows_empty = ~finite[:, 0]
        assert got["out"].transpose(1, 2)[rows_empty].abs().max() == 0
        assert got["dq"].transpose(1, 2)[rows_empty].abs().max() == 0


def test_whole_call_returns_gradients_in_the_op_layouts():
    """Without accumulators the backward returns dK / dV (B, Hkv, Sk, D) laid out (B, Sk, Hkv,
    D) in k's dtype, zero for keys no row sees; out and dq laid out (B, Sq, Hq, D)."""
    masks = LAYOUTS["both-sides"]
    q, k, v, dout = rand_qkv(2, 4, 2, S, 8, F64, seed=3)
    fwd, bwd = varlen_ops(CpuVarlen())
    out, lse = fwd(q, k, v, masks["key_padding_mask"], None, None, True, 0.3)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, masks["key_padding_mask"], None, None, True, 0.3)
    want = _reference(q, k, v, dout, masks, True, 0.3, None)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.transpose(1, 2).is_contiguous() and got.dtype == F64, name
        check_f64(name, got, want[name])
    assert lse.is_contiguous() and lse.shape == (2, 4, S)
    assert dk[0, :, :3].abs().max() == 0 and dk[1].abs().max() == 0


# ---- reading the masks -------------------------------------------------------------------------
def test_masks_read_once_per_tensor_and_again_after_an_inplace_change(monkeypatch):
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    ids = packed_ids([[3, 4, 6]])
    first = varlen.describe(None, ids)
    assert varlen.describe(None, ids) is first and len(reads) == 1
    assert first.runs == (((0, 3), (3, 7), (7, 13)),)
    ids[0, 10:] = 5                      # a new document: the layout is read again
    again = varlen.describe(None, ids)
    assert again is not first and again.runs == (((0, 3), (3, 7), (7, 10), (10, 13)),)
    assert len(reads) == 2
    same_values = ids.clone()            # another tensor: read on its own
    assert varlen.describe(None, same_values) is not again and len(reads) == 3
    with torch.inference_mode():         # no version counter: read at every call
        frozen = packed_ids([[3, 10]])
        assert varlen.describe(None, frozen).runs == (((0, 3), (3, 13)),)
        assert varlen.describe(None, frozen).runs == (((0, 3), (3, 13)),)
    assert len(reads) == 5


@pytest.mark.parametrize("B", [0, 2])
def test_calls_where_no_row_sees_anything(B):
    """Every key padded (or no batch row at all): no launch; out 0, lse -inf, zero
    gradients."""
    adapter = CpuVarlen()
    q, k, v, dout = rand_qkv(B, 4, 2, S, 8, F64)
    mask = torch.zeros(B, S, dtype=torch.bool)
    fwd, bwd = varlen_ops(adapter)
    out, lse = fwd(q, k, v, mask, None, None, True, 0.3)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, mask, None, None, True, 0.3)
    assert adapter.launches == []
    assert out.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape
    assert (out == 0).all() and (lse == -math.inf).all()
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("masks, match", [
    (dict(segment_ids=torch.tensor([[0, 0, 1, 1, 0]])), "decrease along a row"),
    (dict(key_padding_mask=torch.tensor([[True, False, True, True, False]])),
     "row 0 has 3 real keys in more than one run"),
    (dict(key_padding_mask=torch.ones(1, 5, dtype=torch.bool),
          segment_ids=torch.zeros(1, 5, dtype=torch.int64)), "together with segment_ids"),
])
def test_layouts_the_route_refuses_say_why(masks, match):
    got = varlen.describe(masks.get("key_padding_mask"), masks.get("segment_ids"))
    assert isinstance(got, str) and match in got


# ---- routing ----------------------------------------------------------------------------------
def varlen_router(caps=None):
    caps = caps or cpu_caps(window=frozenset(("flash",)))
    return route.Router(capabilities=lambda device: caps,
                        adapters={"flash": CpuVarlen(), "cudnn": CpuFlashTopLeft()},
                        fallback_fwd=cpu_ops.attention_fwd, fallback_bwd=cpu_ops.attention_bwd)


def test_the_router_serves_padded_and_packed_calls_on_the_varlen_op():
    """Under "auto" with a table preferring flash: packed and padded calls go to its
    variable-length op (fp32 results within the fallback's rounding); ids that decrease,
    padding with holes, both masks, a window with padding go to the fallback, exactly."""
    q, k, v, dout = rand_qkv(2, 4, 2, S, 8, torch.float32, seed=5)
    router = varlen_router()
    table = route.Table(rules=({"backends": ("flash",)},))
    falls = torch.tensor([[1] * 6 + [0] * 7, [2] * 13])
    holes = padding(S, [(0, 13), (2, 6)])
    holes[1, 9:11] = True
    cases = [(LAYOUTS["packed"], None, "flash"), (LAYOUTS["left-pad"], None, "flash"),
             (LAYOUTS["packed-many"], 3, "flash"), (dict(segment_ids=falls), None, "triton"),
             (dict(key_padding_mask=holes), None, "triton"),
             (dict(LAYOUTS["left-pad"], segment_ids=LAYOUTS["packed"]["segment_ids"]), None,
              "triton"),
             (LAYOUTS["right-pad"], 3, "triton")]
    # attention_dq "atomic": flash's backward is not deterministic without torch's flag
    with config.patch(attention_backend="auto", attention_dq="atomic"), _table(table):
        for masks, window, served in cases:
            mask, seg = masks.get("key_padding_mask"), masks.get("segment_ids")
            out, lse = router.fwd(q, k, v, mask, seg, window, True, 0.3)
            assert router.last == served, (masks, window)
            dq, dk, dv = router.bwd(dout, q, k, v, out, lse, mask, seg, window, True, 0.3)
            assert router.last == served
            want_out, want_lse = cpu_ops.attention_fwd(q, k, v, mask, seg, window, True, 0.3)
            want = cpu_ops.attention_bwd(dout, q, k, v, want_out, want_lse, mask, seg, window,
                                         True, 0.3)
            tol = 8 * torch.finfo(torch.float32).eps * 8
            assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
            for name, a, b in (("out", out, want_out), ("dq", dq, want[0]),
                               ("dk", dk, want[1]), ("dv", dv, want[2])):
                assert (a - b).abs().max() <= tol * max(1.0, b.abs().max()), (name, served)


def test_refusals():
    """Pinned, flash raises naming the rule the masks break; the other vendors name their
    missing variable-length op."""
    q, k, v, _ = rand_qkv(2, 4, 2, S, 8, torch.float32)
    router = varlen_router()
    falls = torch.tensor([[1] * 6 + [0] * 7, [2] * 13])
    with config.patch(attention_backend="flash"):
        with pytest.raises(route.BackendRefused, match="segment_ids: segment_ids decrease"):
            router.fwd(q, k, v, None, falls, None, True, 0.3)
        with pytest.raises(route.BackendRefused, match="window with key_padding_mask"):
            router.fwd(q, k, v, LAYOUTS["left-pad"]["key_padding_mask"], None, 3, True, 0.3)
        with pytest.raises(route.BackendRefused, match="window: flash has no non-causal"):
            router.fwd(q, k, v, None, LAYOUTS["packed"]["segment_ids"], 3, False, 0.3)
        router.fwd(q, k, v, None, LAYOUTS["packed"]["segment_ids"], 3, True, 0.3)
        assert router.last == "flash"
    with config.patch(attention_backend="cudnn"):
        with pytest.raises(route.BackendRefused, match="cudnn has no variable-length op"):
            router.fwd(q, k, v, None, LAYOUTS["packed"]["segment_ids"], None, True, 0.3)
    no_varlen = varlen_router(cpu_caps(varlen=frozenset()))
    with config.patch(attention_backend="flash"):
        with pytest.raises(route.BackendRefused, match="flash has no variable-length op"):
            no_varlen.fwd(q, k, v, LAYOUTS["left-pad"]["key_padding_mask"], None, None, True,
                          0.3)


def test_masks_are_read_only_when_a_vendor_would_serve():
    """With the shipped table (Triton everywhere) or a table that sends masked calls to
    Triton, the masks are never read (no host sync)."""
    reads = []

    def describe(mask, seg):
        reads.append(1)
        return varlen.describe(mask, seg)
    router = varlen_router()
    router.describe = describe
    q, k, v, _ = rand_qkv(1, 2, 2, S, 8, torch.float32)
    seg = LAYOUTS["packed"]["segment_ids"][:1]
    masked_to_triton = route.Table(rules=({"masks": "packed", "backends": ("triton",)},
                                          {"backends": ("flash",)}))
    with config.patch(attention_backend="auto"):
        router.fwd(q, k, v, None, seg, None, True, 0.3)
        with _table(masked_to_triton):
            router.fwd(q, k, v, None, seg, None, True, 0.3)
            assert router.last == "triton"
            router.fwd(q, k, v, None, None, None, True, 0.3)
            assert router.last == "flash"
    assert reads == []
    with pytest.raises(ValueError, match="masks must be one of"):
        route.Table.from_dict({"format": route.TABLE_FORMAT,
                               "rules": [{"masks": "padding", "backends": "flash"}]})


# ---- the CUDA plumbing with fake CUDA tensors --------------------------------------------------
def test_flash_varlen_plumbing_on_fake_cuda(fake_cuda):  # noqa: F811 (the fixture)
    """A packed query chunk (282 rows at offset 3,000, GQA 32/8) in one variable-length call:
    (T, H, D) operands, int32 cumulative lengths, the host maxima; lse (Hq, T) handed back to
    the backward; the chunk's dK / dV added into the accumulators."""
    from test_attention_route import _fake_inputs
    B, Hq, Hkv, Sq, off, D = 1, 32, 8, 282, 3000, 128
    docs = [1000, 2100, 400, 782]                    # the chunk [3000, 3282) crosses two
    ends = [sum(docs[:i + 1]) for i in range(len(docs))]
    layout = varlen.Layout("packed", (tuple(zip([0] + ends[:-1], ends)),), sum(docs))
    q, k, v, dout, dk_acc, dv_acc = _fake_inputs(B, Hq, Hkv, Sq, sum(docs), D)
    seg = torch.empty(B, sum(docs), dtype=torch.int32, device="cuda")
    router = route.Router(capabilities=lambda device: _sm90(),
                          describe=lambda mask, ids: layout)
    with config.patch(attention_backend="flash", attention_dq="atomic"):
        out, lse = router.fwd(q, k, v, None, seg, None, True, 0.1, off)
        router.bwd(dout, q, k, v, out, lse, None, seg, None, True, 0.1, off, dk_acc, dv_acc)
    assert out.shape == (B, Hq, Sq, D) and out.transpose(1, 2).is_contiguous()
    assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    (_, fa, fkw), = fake_cuda.named("_flash_attention_forward")
    keys = off + Sq - 1000                            # from the first document's start
    assert [t.shape for t in fa[:3]] == [(Sq, Hq, D), (keys, Hkv, D), (keys, Hkv, D)]
    assert fa[3].dtype == fa[4].dtype == torch.int32 and fa[3].shape == fa[4].shape == (3,)
    assert fa[5:10] == (off + Sq - 3100, 2100, 0.0, True, False) and fkw == {"scale": 0.1}
    (_, ba, _), = fake_cuda.named("_flash_attention_backward")
    assert ba[0].shape == (Sq, Hq, D) and ba[5].shape == (Hq, Sq)
    assert ba[8:12] == (off + Sq - 3100, 2100, 0.0, True)


# ---- on a GPU ----------------------------------------------------------------------------------
GPU_S = 250
GPU_MASKS = {"packed": dict(segment_ids=packed_ids([[37, 1, 100, 112], [GPU_S]])),
             "left-pad": dict(key_padding_mask=padding(GPU_S, [(60, GPU_S), (0, GPU_S)])),
             "right-pad": dict(key_padding_mask=padding(GPU_S, [(0, 171), None]))}


@pytest.mark.gpu(reason="flash's variable-length op needs a CUDA GPU")
@pytest.mark.parametrize("name, window", [("packed", None), ("packed", 40), ("left-pad", None),
                                          ("right-pad", None)])
def test_gpu_flash_varlen_matches_fp64_in_chunks(name, window):
    """bf16, GQA 8/2, hd 128, packed and padded, whole and in query chunks (dK / dV into fp32
    accumulators) through torch.ops.ckpt_ext with flash pinned: within 2x / 3x plain
    PyTorch's error against float64."""
    if "flash" not in route.cuda_capabilities(torch.device("cuda")).varlen:
        pytest.skip("flash's variable-length op is not available on this GPU / torch")
    masks = {key: t.cuda() for key, t in GPU_MASKS[name].items()}
    torch.manual_seed(0)
    B, Hq, Hkv, D, scale = 2, 8, 2, 128, 128 ** -0.5
    q, k, v, dout = (torch.randn(B, H, GPU_S, D, device="cuda", dtype=torch.bfloat16)
                     for H in (Hq, Hkv, Hkv, Hq))
    want = _reference(*(t.double() for t in (q, k, v, dout)), masks, True, scale, window)
    base = _reference(q, k, v, dout, masks, True, scale, window)
    grad_scale = magnitude(want["dq"], want["dk"], want["dv"])
    ops = torch.ops.ckpt_ext
    with config.patch(attention_backend="flash"):
        for rows in (GPU_S, 96):
            got = attention_in_chunks(ops.attention_fwd, ops.attention_bwd, q, k, v, dout,
                                      masks.get("key_padding_mask"), True, scale,
                                      masks.get("segment_ids"), window, rows)
            assert route.CUDA_ROUTER.last == "flash"
            check_vs_baseline("out", got["out"], base["out"], want["out"], FACTOR_OUT)
            for key in ("dq", "dk", "dv"):
                check_vs_baseline(key, got[key], base[key], want[key], FACTOR_GRAD,
                                  scale=grad_scale)


# ---- through the decoder layer: a patched HF model ---------------------------------------------
def _no_fallback(*args):
    raise AssertionError("a call reached the fallback: the pinned stand-in should serve it")


@pytest.mark.parametrize("batch", ["packed", "padded"])
def test_patched_model_through_the_varlen_route(batch):
    """A patched tiny LLaMA (``min_memory``, the layer tiled into query chunks of 7 rows) whose
    CPU attention ops are replaced by the router with the variable-length stand-in pinned:
    packed documents (position ids) and a left-padded batch give the loss, logits and every
    gradient of the same model on the ATen kernels, through the layer's own calls (query
    chunks at their offsets, dK / dV into its accumulators, the recomputed forward)."""
    import copy
    import warnings

    from hf_fixtures import TINY, make_model, padded_batch
    from test_hf import TOL, run

    ref_model = ckpt_ext.patch_llama(make_model("llama", "sdpa"), "min_memory")
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(4)
    if batch == "packed":
        lengths = [9, 1, 15, 4]
        ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), generator=g)
        kwargs = dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
        mask, labels = None, ids.clone()
    else:
        ids, mask, labels = padded_batch(TINY["vocab_size"], 2, 23, pad=6, seed=4)
        kwargs = {}
    width = 4 * TINY["num_attention_heads"] * TINY["head_dim"] + 3 * TINY["intermediate_size"]
    adapter = CpuVarlen()
    router = varlen_router()
    router.adapters = {"flash": adapter}
    router.fallback_fwd = router.fallback_bwd = _no_fallback
    with config.patch(chunk_bytes=str(7 * width * 4)):
        want = run(ref_model, ids, mask, labels, **kwargs)
        lib = torch.library.Library("ckpt_ext", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="(?s).*Overriding a previously")
                lib.impl("attention_fwd", router.fwd, "CPU")
                lib.impl("attention_bwd", router.bwd, "CPU")
            with config.patch(attention_backend="flash", attention_dq="atomic"):
                got = run(model, ids, mask, labels, **kwargs)
        finally:
            lib._destroy()
    chunked = [c for c in adapter.launches if c[0] == "bwd" and len(c[2]) > 1]
    assert chunked, "the stand-in served no call"
    # every layer's every query chunk, forward and backward (min_memory's recompute included)
    assert len(adapter.launches) >= 3 * 2 * (-(-ids.shape[1] // 7)), len(adapter.launches)
    (out_w, grads_w), (out_g, grads_g) = want, got
    torch.testing.assert_close(out_g.loss, out_w.loss, **TOL)
    assert grads_g.keys() == grads_w.keys()
    for name in grads_w:
        torch.testing.assert_close(grads_g[name], grads_w[name], **TOL, msg=name)
    # the ATen kernels are back: a call no longer reaches the stand-in
    seen = len(adapter.launches)
    torch.ops.ckpt_ext.attention_fwd(*rand_qkv(1, 2, 2, 5, 8, torch.float32)[:3], None,
                                     torch.zeros(1, 5, dtype=torch.int32), None, True, 0.3)
    assert len(adapter.launches) == seen
