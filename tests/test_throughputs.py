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
