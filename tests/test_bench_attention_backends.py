"""bench/attention.py --backend-rows: the layer's call shapes, the FLOP count of a query chunk,
the choice table written from measured times (read back by ckpt_ext.attention_route), and a
tiny CPU run (Triton interpreter; the SDPA backends noted as needing CUDA)."""
import csv
import importlib.util
import json
import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "bench" / "attention.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

from ckpt_ext import attention_route as route  # noqa: E402


def test_layer_call_shapes_and_pairs():
    args = bench.parse_args(["--backend-rows", "--backend-seqlens", "8192",
                             "--chunk-rows", "282,1056", "--chunk-keys", "1000,32768"])
    assert bench.layer_call_shapes(args) == [
        (8192, 8192, 0), (282, 1000, 718), (282, 32768, 32486), (1056, 32768, 31712)]
    # a chunk of 3 rows after 5 keys sees 6 + 7 + 8 keys (its own included); whole causal S
    # counts S^2 / 2
    assert bench.visible_pairs(3, 8, 5, True) == 21
    assert bench.visible_pairs(4, 4, 0, True) == 8
    assert bench.visible_pairs(3, 8, 5, False) == 24


def _rows(times):
    """Bench rows from {(sq, sk, backend): (fwd ms, bwd ms)}."""
    out = []
    for (sq, sk, backend), (f, b) in times.items():
        for mode, ms in (("fwd", f), ("bwd", b), ("fwd+bwd", f + b)):
            out.append(dict(backend=backend, mode=mode, head_dim=128, sq=sq, sk=sk,
                            q_offset=sk - sq, dtype="bfloat16", causal=True, ms=ms))
    return out


def test_choice_table_orders_backends_by_measured_time():
    nan = float("nan")
    rows = _rows({(1024, 1024, "triton"): (1.0, 3.0), (1024, 1024, "flash"): (1.2, 2.0),
                  (1024, 1024, "cudnn"): (0.9, nan),
                  (282, 8192, "triton"): (2.0, 5.0), (282, 8192, "cudnn"): (1.5, 6.0),
                  (282, 32768, "triton"): (4.0, 9.0), (282, 32768, "efficient"): (5.0, 8.0),
                  (1056, 32768, "triton"): (7.0, 20.0), (1056, 32768, "flash"): (6.0, 15.0),
                  (1056, 32768, "auto"): (0.1, 0.1)})
    table = route.Table.from_dict(bench.choice_table(rows, "sm90", ["# test"]))

    def pick(phase, Sq, Sk):
        call = route.Call(phase, torch.bfloat16, 1, 32, 8, Sq, Sk, 128, True, Sk - Sq)
        return table.lookup(call, "sm90")

    assert pick("fwd", 1024, 1024) == ("cudnn", "triton")       # slower ones after Triton cut
    assert pick("bwd", 1024, 1024) == ("flash", "triton")       # cudnn did not run (NaN)
    assert pick("fwd", 282, 8192) == ("cudnn", "triton")
    assert pick("bwd", 200, 4000) == ("triton",)                # smallest bucket containing it
    assert pick("bwd", 282, 20000) == ("efficient", "triton")
    assert pick("fwd", 1056, 32768) == ("flash", "triton")      # 'auto' rows never listed
    assert pick("fwd", 4000, 100000) == ("flash", "triton")     # beyond: the largest bucket
    assert table.lookup(route.Call("fwd", torch.bfloat16, 1, 32, 8, 1024, 1024, 128, True),
                        "sm80") == ("triton",)                  # another GPU: default


def test_cpu_backend_rows_run_and_write_a_table(tmp_path):
    out, table = tmp_path / "rows.csv", tmp_path / "table.json"
    bench.main(["--backend-rows", "--backend-shape", "1,2,2,16", "--backend-seqlens", "32",
                "--chunk-rows", "8", "--chunk-keys", "32", "--out", str(out),
                "--write-table", str(table)])
    lines = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    assert {r["backend"] for r in rows} == {"triton", "flash", "cudnn", "efficient", "auto"}
    assert all(r["note"] == "needs CUDA" for r in rows
               if r["backend"] != "triton" or r["sq"] != r["sk"])
    triton = [r for r in rows if r["backend"] == "triton" and r["sq"] == r["sk"]]
    assert len(triton) == 3 and all(float(r["ms"]) > 0 for r in triton)
    loaded = route.load_table(table)
    assert json.loads(table.read_text())["measured"][0].startswith("device: CPU")
    call = route.Call("fwd", torch.float32, 1, 2, 2, 32, 32, 16, True)
    assert loaded.lookup(call, "cpu") == ("triton",)
