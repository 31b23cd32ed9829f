"""The kernel throughputs file (ckpt_ext/throughputs.py): its reader, the rates it gives a
step-time estimate, and the attention rates built from bench/attention.py's rows."""
import json

import pytest

from ckpt_ext import plan
from ckpt_ext import throughputs as tp

HEADERS = {"command": "python bench/attention.py --backend-rows", "commit": "abc1234",
           "machine": "NVIDIA H100 80GB HBM3", "date": "2026-11-27"}


def _rates():
    return [tp.Rate("attention_forward", 300.0, seq_max=8192),
            tp.Rate("attention_forward", 360.0),
            tp.Rate("attention_backward", 170.0, source="x.csv"),
            tp.Rate("matmul", 420.0)]


def test_round_trip_rates_and_estimate(tmp_path):
    path = tmp_path / "t.json"
    data = tp.write_throughputs(path, HEADERS, _rates(), note="test")
    assert data["format"] == tp.FORMAT and json.loads(path.read_text()) == data
    t = tp.load_throughputs(path)
    assert t.headers["note"] == "test" and t.source == str(path)
    assert t.rate("attention_forward", 8192) == 300.0
    assert t.rate("attention_forward", 8193) == 360.0
    assert t.step_time_kwargs(1 << 20) == {"attention_fwd_tflops": 360.0,
                                           "attention_bwd_tflops": 170.0,
                                           "matmul_tflops": 420.0}
    # the seconds agree with the plan's estimate at the same rates
    layers = [plan.LayerDims(4096, 32, 8, 128, 14336)] * 2
    S = 32768
    flops = plan.step_flops("min_memory", layers, 128256, 1, S)
    want = plan.step_time_estimate("min_memory", layers, 128256, 1, S,
                                   **t.step_time_kwargs(S))
    assert t.seconds(flops, S) == pytest.approx(want, rel=1e-12)
    by_hand = (flops["attention_forward"] / 360e12 + flops["attention_backward"] / 170e12
               + flops["matmul"] / 420e12)
    assert t.seconds(flops, S) == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(ValueError, match="unknown kinds"):
        t.seconds({"softmax": 1}, S)
    with pytest.raises(ValueError, match="kind must be one of"):
        t.rate("conv", S)


def test_default_is_the_plans_constants():
    t = tp.default_throughputs()
    assert t.step_time_kwargs(4096) == {"attention_fwd_tflops": plan.ATTENTION_FWD_TFLOPS,
                                        "attention_bwd_tflops": plan.ATTENTION_BWD_TFLOPS,
                                        "matmul_tflops": plan.MATMUL_TFLOPS}


def _good():
    return {"format": tp.FORMAT, **HEADERS, "rates": [r.as_dict() for r in _rates()]}


def _broken(change):
    data = _good()
    change(data)
    return data


MALFORMED = [
    ("json", "[1, 2", "cannot read the kernel throughputs file"),
    ("format", _broken(lambda d: d.update(format="x")), "not a kernel throughputs file"),
    ("header", _broken(lambda d: d.update(machine="")), "header 'machine' must be"),
    ("extra", _broken(lambda d: d.update(speed=1)), r"unknown key\(s\) \['speed'\]"),
    ("rates", _broken(lambda d: d.update(rates={})), "rates must be a list"),
    ("kind", _broken(lambda d: d["rates"][0].update(kind="attn")), "rate 0: kind must be"),
    ("tflops", _broken(lambda d: d["rates"][3].update(tflops=0)),
     "rate 3: tflops must be a positive number"),
    ("nan", _broken(lambda d: d["rates"][3].update(tflops=float("nan"))),
     "rate 3: tflops must be a positive number"),
    ("bounds", _broken(lambda d: d["rates"][0].update(seq_min=9000)),
     "rate 0: seq_min 9000 > seq_max 8192"),
    ("gap", _broken(lambda d: d["rates"][1].update(seq_min=9000)),
     "no attention_forward rate serves every sequence length"),
    ("missing", _broken(lambda d: d["rates"].pop(3)),
     "no matmul rate serves every sequence length"),
]


@pytest.mark.parametrize("name, content, match", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_names_the_file(tmp_path, name, content, match):
    path = tmp_path / f"bad_{name}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match) as info:
        tp.load_throughputs(path)
    assert str(info.value).startswith(str(path))


def test_ranges_in_pieces_cover_every_length(tmp_path):
    rates = [tp.Rate("attention_forward", 1.0, 1, 100), tp.Rate("attention_forward", 2.0, 101),
             tp.Rate("attention_backward", 3.0, 50), tp.Rate("attention_backward", 4.0, 1, 49),
             tp.Rate("matmul", 5.0)]
    t = tp.throughputs_from_dict({"format": tp.FORMAT, **HEADERS,
                                  "rates": [r.as_dict() for r in rates]})
    assert [t.rate("attention_forward", s) for s in (1, 100, 101)] == [1.0, 1.0, 2.0]
    assert [t.rate("attention_backward", s) for s in (1, 49, 50, 10**7)] == [4.0, 4.0, 3.0, 3.0]


def test_attention_rates_from_backend_rows(tmp_path):
    path = tmp_path / "rows.csv"
    lines = ["# device: NVIDIA H100", "backend,served_by,mode,sq,sk,q_offset,causal,tflops,ms"]
    for backend, S, f, b in (("auto", 8192, 300.0, 200.0), ("auto", 32768, 350.0, 240.0),
                             ("triton", 32768, 340.0, 170.0)):
        lines += [f"{backend},triton,fwd,{S},{S},0,True,{f},1.0",
                  f"{backend},triton,bwd,{S},{S},0,True,{b},1.0",
                  f"{backend},triton,fwd+bwd,{S},{S},0,True,1.0,1.0"]
    lines += ["auto,flash,bwd,1056,32768,31712,True,999.0,1.0",   # a chunk: not a whole S
              "auto,flash,bwd,4096,4096,0,True,nan,1.0"]            # did not run
    path.write_text("\n".join(lines) + "\n")
    rates = tp.from_backend_rows(path, "auto", matmul_tflops=410.0)
    t = tp.throughputs_from_dict({"format": tp.FORMAT, **HEADERS,
                                  "rates": [r.as_dict() for r in rates]})
    assert t.rate("attention_backward", 4096) == 200.0        # up to the first measured S
    assert t.rate("attention_backward", 8193) == 240.0
    assert t.rate("attention_backward", 1 << 20) == 240.0     # the longest: beyond it too
    assert t.rate("attention_forward", 8192) == 300.0 and t.rate("matmul", 1) == 410.0
    assert tp.from_backend_rows(path, "triton")[1].tflops == 170.0
    with pytest.raises(ValueError, match="no 'cudnn' attention_forward rows"):
        tp.from_backend_rows(path, "cudnn")
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"other.csv: not bench/attention.py --backend-rows"):
        tp.from_backend_rows(bad)


# ---- format 2: rates per query-chunk row count, and the strict backward's ----------------------
def _chunked():
    """Whole-sequence rates, chunk rates at up to 512 and above 512 rows, strict rates."""
    return [tp.Rate("attention_forward", 400.0, rows_max=512),
            tp.Rate("attention_forward", 450.0, rows_min=513),
            tp.Rate("attention_forward", 500.0),
            tp.Rate("attention_backward", 380.0, rows_max=512, source="c.csv"),
            tp.Rate("attention_backward", 450.0, rows_min=513),
            tp.Rate("attention_backward", 530.0),
            tp.Rate("attention_backward_strict", 170.0, rows_min=1),
            tp.Rate("attention_backward_strict", 380.0),
            tp.Rate("matmul", 400.0)]


def test_rates_per_chunk_rows_and_the_strict_backward(tmp_path):
    """A rate with row bounds serves the query chunks of that many rows, whole sequences only
    the rates without (a chunk of at least S rows is a whole sequence); the strict backward's
    rates serve strict estimates; the seconds follow."""
    path = tmp_path / "t.json"
    data = tp.write_throughputs(path, HEADERS, _chunked())
    assert data["format"] == tp.FORMAT == "ckpt_ext kernel throughputs 2"
    t = tp.load_throughputs(path)
    assert t.has_strict
    S = 32768
    assert [t.rate("attention_backward", S, rows) for rows in (None, 1, 512, 513, 4096, S)] \
        == [530.0, 380.0, 380.0, 450.0, 450.0, 530.0]
    assert [t.rate("attention_backward_strict", S, rows) for rows in (None, 512, 4096)] \
        == [380.0, 170.0, 170.0]
    assert t.step_time_kwargs(S, 1152) == {"attention_fwd_tflops": 450.0,
                                           "attention_bwd_tflops": 450.0, "matmul_tflops": 400.0}
    assert t.step_time_kwargs(S, 1152, strict=True)["attention_bwd_tflops"] == 170.0
    assert t.step_time_kwargs(S, strict=True)["attention_bwd_tflops"] == 380.0
    assert t.chunk_rates("attention_backward", S) == [(None, 512, 380.0), (513, None, 450.0)]
    assert t.chunk_rates("attention_backward", S, strict=True) == [(1, None, 170.0)]
    flops = {"attention_forward": 4e15, "attention_backward": 10e15, "matmul": 8e15}
    assert t.seconds(flops, S, 1152, strict=True) == pytest.approx(
        4e15 / 450e12 + 10e15 / 170e12 + 8e15 / 400e12, rel=1e-12)
    assert t.seconds(flops, S) == pytest.approx(4e15 / 500e12 + 10e15 / 530e12 + 8e15 / 400e12,
                                                rel=1e-12)


def test_files_without_strict_rates_and_format_1(tmp_path):
    """No strict rates: the strict backward's rate is the default's. A format-1 file still
    loads; it may hold neither row bounds nor strict rates."""
    t = tp.throughputs_from_dict(_good())
    assert not t.has_strict and t.rate("attention_backward_strict", 4096) == 170.0
    assert t.step_time_kwargs(4096, 300, strict=True) == t.step_time_kwargs(4096)
    assert not tp.default_throughputs().has_strict
    one = dict(_good(), format="ckpt_ext kernel throughputs 1")
    assert tp.throughputs_from_dict(one).rate("attention_forward", 9000) == 360.0
    one["rates"][0]["rows_max"] = 512
    with pytest.raises(ValueError, match=r"rate 0: unknown key\(s\) \['rows_max'\]"):
        tp.throughputs_from_dict(one, "one.json")
    one["rates"][0].pop("rows_max")
    one["rates"].append({"kind": "attention_backward_strict", "tflops": 1.0})
    with pytest.raises(ValueError, match="kind must be one of"):
        tp.throughputs_from_dict(one, "one.json")


@pytest.mark.parametrize("change, match", [
    (lambda r: r.pop(7), "no attention_backward_strict rate serves every sequence length"),
    (lambda r: r.pop(5), "no attention_backward rate serves every .* chunks only"),
    (lambda r: r[0].update(rows_min=600), "rate 0: rows_min 600 > rows_max 512"),
    (lambda r: r[1].update(rows_min=0), "rate 1: rows_min must be a positive int"),
])
def test_malformed_format_2(change, match):
    data = {"format": tp.FORMAT, **HEADERS, "rates": [r.as_dict() for r in _chunked()]}
    change(data["rates"])
    with pytest.raises(ValueError, match=match):
        tp.throughputs_from_dict(data, "t.json")


def _write_rows(path, rows):
    """A --backend-rows CSV of (backend, mode, sq, sk, q_offset, tflops, ms) rows."""
    lines = ["# device: test", "backend,served_by,mode,sq,sk,q_offset,causal,masks,tflops,ms"]
    lines += [f"{b},{b},{m},{sq},{sk},{off},True,none,{t},{ms}"
              for b, m, sq, sk, off, t, ms in rows]
    path.write_text("\n".join(lines) + "\n")


def test_chunk_and_strict_rates_from_backend_rows(tmp_path):
    """'fastest': per shape the fastest backend that ran (default) and the fastest
    deterministic one (strict: Triton separate / ordered, flash, efficient; not cudnn or
    triton:atomic); a chunk row count's rate is its calls' FLOPs over their time; row ranges
    up to each measured count. 'auto': the auto rows, strict from the auto:strict ones."""
    path = tmp_path / "rows.csv"
    rows = []
    for b, f, bw in (("cudnn", 600.0, 530.0), ("triton:atomic", 500.0, 450.0),
                     ("triton:separate", 500.0, 380.0), ("flash", 340.0, 180.0),
                     ("auto", 600.0, 530.0), ("auto:strict", 600.0, 380.0)):
        rows += [(b, "fwd", 8192, 8192, 0, f, 1.0), (b, "bwd", 8192, 8192, 0, bw, 1.0)]
    # chunks of 1000 rows at two key counts: (100 x 1 + 200 x 3) / 4 = 175 TFLOP/s for triton
    rows += [("triton:separate", "bwd", 1000, 2000, 1000, 100.0, 1.0),
             ("triton:separate", "bwd", 1000, 4000, 3000, 200.0, 3.0),
             ("cudnn", "bwd", 1000, 4000, 3000, 450.0, 1.0),
             ("triton:separate", "fwd", 1000, 4000, 3000, 300.0, 1.0),
             ("triton:ordered", "bwd", 300, 4000, 3700, 160.0, 1.0),
             ("flash", "bwd", 300, 4000, 3700, 150.0, 1.0),
             ("flash", "bwd", 300, 4000, 3700, float("nan"), 1.0)]
    _write_rows(path, rows)
    t = tp.throughputs_from_dict({"format": tp.FORMAT, **HEADERS, "rates": [
        r.as_dict() for r in tp.from_backend_rows(path, tp.FASTEST, matmul_tflops=400.0)]})
    assert t.has_strict
    assert [t.rate("attention_backward", 8192, rows) for rows in (None, 300, 1000, 5000)] \
        == [530.0, 160.0, 450.0, 450.0]
    assert [t.rate("attention_backward_strict", 8192, rows) for rows in (None, 300, 1000)] \
        == [380.0, 160.0, 175.0]
    assert t.rate("attention_forward", 8192, 1000) == 300.0
    assert t.chunk_rates("attention_backward", 8192) == [(1, 300, 160.0), (301, None, 450.0)]
    auto = tp.from_backend_rows(path, "auto", matmul_tflops=400.0)
    t = tp.throughputs_from_dict({"format": tp.FORMAT, **HEADERS,
                                  "rates": [r.as_dict() for r in auto]})
    assert (t.rate("attention_backward", 8192), t.rate("attention_backward_strict", 8192)) \
        == (530.0, 380.0)
    cudnn = tp.from_backend_rows(path, "cudnn", matmul_tflops=400.0)
    assert not any(r.kind == "attention_backward_strict" for r in cudnn)


def test_h200_rates_default_and_strict():
    """The H200 run's CSV (no auto rows; Triton timed under "separate"): 'fastest' gives
    cuDNN's backward by default and Triton's (or flash's on the layer's first chunk) strict,
    at the figures the CSV holds."""
    import pathlib

    csv_path = (pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
                / "gpu_h200_2026-11-27" / "quick_d_attention.txt")
    t = tp.throughputs_from_dict({"format": tp.FORMAT, **HEADERS, "rates": [
        r.as_dict() for r in tp.from_backend_rows(csv_path, tp.FASTEST, 400.0)]})
    # the CSV's rows: cudnn,cudnn,bwd,...,32768,32768,0,...,530.578 and triton ... 379.271;
    # at 1056 x 32768 cudnn 452.979 and triton 171.486; at 1152 rows (x 17280) 454 and 174.445
    for rows, default, strict in ((None, 530.578, 379.271), (1056, 452.979, 171.486),
                                  (1152, 454.0, 174.445), (4096, 454.0, 174.445)):
        assert t.rate("attention_backward", 32768, rows) == pytest.approx(default, abs=1e-3)
        assert t.rate("attention_backward_strict", 32768, rows) == pytest.approx(strict,
                                                                                 abs=1e-3)
    # the layer's first chunk, a whole 1152: flash's deterministic backward, 88.96 there
    assert t.rate("attention_backward_strict", 1152) == pytest.approx(88.9601, abs=1e-3)
