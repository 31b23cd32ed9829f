"""bench/attention.py --backend-rows: the layer's call shapes, the FLOP count of a query chunk,
the choice table written from measured times (read back by ckpt_ext.attention_route), and a
tiny CPU run (Triton interpreter; the SDPA backends noted as needing CUDA)."""
import csv
import importlib.util
import json
import math
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
    # packed documents of 4: rows 5, 6, 7 see 2, 3, 4 keys of theirs (all 4 when not causal);
    # a whole S 6 counts 1 + 2 + 3 + 4 and 1 + 2 (the second document holds 2 tokens)
    assert bench.visible_pairs(3, 8, 5, True, doc=4) == 9
    assert bench.visible_pairs(3, 8, 5, False, doc=4) == 12
    assert bench.visible_pairs(6, 6, 0, True, doc=4) == 13
    assert bench.visible_pairs(2, 6, 4, False, doc=4) == 4


def test_layer_chunk_calls_follow_the_layers_chunk_rows():
    """--layer-dims: the calls the sequence-tiled layer makes, its chunk rows from the
    layer's own formula (ckpt_ext.plan.layer_chunk_rows), each chunk seeing the keys up to
    its end; the last chunk holds what is left."""
    from ckpt_ext import plan

    args = bench.parse_args(["--backend-rows", "--backend-seqlens", "32768", "--chunk-rows",
                             "1056", "--chunk-keys", "32768", "--layer-dims",
                             "4096,32,8,128,14336", "--layer-seqlens", "32768,200",
                             "--chunk-bytes", "64MiB"])
    rows = plan.layer_chunk_rows(plan.LayerDims(4096, 32, 8, 128, 14336), 2, 64 * 2**20)
    assert rows == 282   # the attention issue's figure at LLaMA-3-8B dims
    n = -(-32768 // rows)
    calls = bench.layer_chunk_calls(args)
    assert [c[:3] for c in calls] == [
        (rows, rows, 0), (rows, (n // 2 + 1) * rows, n // 2 * rows),
        (32768 - (n - 1) * rows, 32768, (n - 1) * rows), (200, 200, 0)]
    assert calls[2][3] == f"layer S 32768: chunk {n}/{n} of {rows} rows (cap {64 * 2**20} B)"
    assert calls[3][3] == "layer S 200: one chunk"
    # merged after the given shapes, each shape once
    shapes = bench.layer_call_shapes(args)
    assert shapes[:2] == [(32768, 32768, 0), (1056, 32768, 31712)]
    assert shapes[2:] == [c[:3] for c in calls]
    # the cap the kernels read when none is given; heads must match --backend-shape
    from ckpt_ext import _C
    default = bench.parse_args(["--layer-dims", "4096,32,8,128,14336"])
    assert bench.layer_chunk_calls(default)[0][0] == plan.layer_chunk_rows(
        plan.LayerDims(4096, 32, 8, 128, 14336), 2, _C.chunk_bytes())
    # on an H100 (132 SMs) the layer's chunks hold the CUDA minimum: 4,096 rows for the GEMMs
    # (above the 1,152 that fill it at 32 heads)
    h100 = bench.parse_args(["--layer-dims", "4096,32,8,128,14336", "--layer-seqlens", "32768",
                             "--chunk-bytes", "64MiB", "--sms", "132"])
    assert bench.layer_chunk_calls(h100)[0][:3] == (4096, 4096, 0)
    assert bench.layer_chunk_calls(h100)[-1][:3] == (4096, 32768, 7 * 4096)
    with pytest.raises(SystemExit, match="must be --backend-shape's"):
        bench.layer_chunk_calls(bench.parse_args(["--layer-dims", "4096,32,32,128,14336"]))


def test_cpu_layer_chunk_rows_run(tmp_path):
    """The CPU smoke run at the layer's own tiny call shapes: Triton (interpreter) at each
    chunk, the layer's label in the CSV."""
    out = tmp_path / "rows.csv"
    bench.main(["--backend-rows", "--backends", "triton:separate", "--backend-shape", "1,2,1,16",
                "--backend-seqlens", "", "--chunk-rows", "", "--layer-dims", "32,2,1,16,64",
                "--layer-seqlens", "40", "--chunk-bytes", "8192", "--out", str(out)])
    lines = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    rows = [r for r in csv.DictReader(lines) if r["mode"] == "fwd+bwd"]
    # width 4*2*16 + 3*64 = 320 per row at 4 bytes: 6 rows per chunk of 8 KiB; 7 chunks
    assert [(int(r["sq"]), int(r["sk"]), int(r["q_offset"])) for r in rows] == [
        (6, 6, 0), (6, 24, 18), (4, 40, 36)]
    assert [r["call"] for r in rows] == [f"layer S 40: chunk {i}/7 of 6 rows (cap 8192 B)"
                                         for i in (1, 4, 7)]
    assert all(float(r["ms"]) > 0 and float(r["tflops"]) > 0 and not r["note"] for r in rows)


def _rows(times, masks="none"):
    """Bench rows from {(sq, sk, backend): (fwd ms, bwd ms)}."""
    out = []
    for (sq, sk, backend), (f, b) in times.items():
        for mode, ms in (("fwd", f), ("bwd", b), ("fwd+bwd", f + b)):
            out.append(dict(backend=backend, mode=mode, head_dim=128, sq=sq, sk=sk,
                            q_offset=sk - sq, dtype="bfloat16", causal=True, masks=masks,
                            ms=ms))
    return out


def test_choice_table_keeps_packed_rows_apart():
    """Rows measured with packed documents make rules for packed calls only, and the rules
    of unmasked rows do not serve packed calls."""
    rows = _rows({(1024, 1024, "triton"): (1.0, 3.0), (1024, 1024, "flash"): (0.8, 2.0)})
    rows += _rows({(1024, 1024, "triton"): (0.5, 1.0), (1024, 1024, "flash"): (0.7, 2.5)},
                  masks="packed 256")
    table = route.Table.from_dict(bench.choice_table(rows, "sm90", ["# test"]))
    for segments, fwd, bwd in ((False, ("flash", "triton"), ("flash", "triton:separate")),
                               (True, ("triton", "flash"), ("triton:separate", "flash"))):
        for phase, want in (("fwd", fwd), ("bwd", bwd)):
            call = route.Call(phase, torch.bfloat16, 1, 32, 8, 1024, 1024, 128, True,
                              segments=segments)
            assert table.lookup(call, "sm90") == want, (segments, phase)
    padded = route.Call("fwd", torch.bfloat16, 1, 32, 8, 1024, 1024, 128, True, masked=True)
    assert table.lookup(padded, "sm90") == ("triton",)        # no padded rows: the default


def test_cpu_packed_rows_run(tmp_path):
    """--backend-packed-doc: each shape again with packed documents given as segment ids (Triton in
    the interpreter here), the FLOPs those of the documents' pairs."""
    out = tmp_path / "rows.csv"
    bench.main(["--backend-rows", "--backends", "triton:atomic", "--backend-shape", "1,2,1,16",
                "--backend-seqlens", "24", "--chunk-rows", "8", "--chunk-keys", "24",
                "--backend-packed-doc", "5", "--out", str(out)])
    lines = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    rows = [r for r in csv.DictReader(lines) if r["mode"] == "fwd"]
    assert [(r["sq"], r["sk"], r["masks"]) for r in rows] == [
        ("24", "24", "none"), ("8", "24", "none"), ("24", "24", "packed 5"),
        ("8", "24", "packed 5")]
    for r in rows:
        assert float(r["ms"]) > 0 and not r["note"]
        pairs = bench.visible_pairs(int(r["sq"]), 24, int(r["q_offset"]), True,
                                    5 if r["masks"] != "none" else 0)
        assert float(r["tflops"]) == pytest.approx(4 * 2 * 16 * pairs / float(r["ms"]) / 1e9,
                                                   rel=1e-3)


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

    # every backend that ran, fastest first (not cut at Triton); a backward's bare "triton"
    # rows (no dQ mode named) are the "separate" mode's
    assert pick("fwd", 1024, 1024) == ("cudnn", "triton", "flash")
    assert pick("bwd", 1024, 1024) == ("flash", "triton:separate")   # cudnn did not run (NaN)
    assert pick("fwd", 282, 8192) == ("cudnn", "triton")
    assert pick("bwd", 200, 4000) == ("triton:separate", "cudnn")  # smallest bucket holding it
    assert pick("bwd", 282, 20000) == ("efficient", "triton:separate")
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
    # "triton" stands for its backward under each dQ mode
    assert {r["backend"] for r in rows} == {"triton:separate", "triton:ordered",
                                            "triton:atomic", "flash", "cudnn", "efficient",
                                            "auto"}
    assert all(r["note"] == "needs CUDA" for r in rows if not r["backend"].startswith("triton"))
    # Triton: the whole sequence and the query chunk (dK/dV into accumulators) both timed
    triton = [r for r in rows if r["backend"].startswith("triton")]
    assert len(triton) == 18 and all(float(r["ms"]) > 0 and not r["note"] for r in triton)
    assert {(r["sq"], r["sk"], r["call"]) for r in triton} == {("32", "32", "whole"),
                                                               ("8", "32", "query chunk")}
    loaded = route.load_table(table)
    written = json.loads(table.read_text())
    assert written["measured"][0].startswith("device: CPU")
    assert written["format"] == route.TABLE_FORMAT == "ckpt_ext attention backend table 2"
    # the forward names Triton once; the backward per dQ mode, in the order of their times
    call = route.Call("fwd", torch.float32, 1, 2, 2, 32, 32, 16, True)
    assert loaded.lookup(call, "cpu") == ("triton",)
    bwd = {(r["sq"], r["backend"]): float(r["ms"]) for r in triton if r["mode"] == "bwd"}
    for sq, q_offset in ((32, 0), (8, 24)):
        call = route.Call("bwd", torch.float32, 1, 2, 2, sq, 32, 16, True, q_offset)
        assert loaded.lookup(call, "cpu") == tuple(sorted(
            route.TRITON_ENTRIES, key=lambda name: (bwd[(str(sq), name)], name)))
    # --from-csv on the CSV just written: the same rows (as written: 6 significant digits),
    # the same rules, the CSV's provenance under the file's name
    header, read, preamble = bench.read_backend_rows(out)
    assert preamble == [] and header[0].startswith("device: CPU") and "arch: cpu" in header
    assert [(r["backend"], r["mode"], r["sq"], r["sk"], r["q_offset"], r["causal"], r["note"])
            for r in read] == [(r["backend"], r["mode"], int(r["sq"]), int(r["sk"]),
                                int(r["q_offset"]), r["causal"] == "True", r["note"])
                               for r in rows]
    assert all(math.isnan(r["ms"]) == (not r["backend"].startswith("triton")) for r in read)
    again = tmp_path / "again.json"
    bench.main(["--from-csv", str(out), "--write-table", str(again)])
    rebuilt = json.loads(again.read_text())
    assert rebuilt["rules"] == written["rules"]
    assert rebuilt["measured"][:2] == [f"source: {out} (its backend-rows CSV)", "arch: cpu"]
    # the CSV's own lines after them (its commit line once, its arch line moved up)
    assert rebuilt["measured"][2:] == [line for line in written["measured"]
                                       if not line.startswith("arch:")]
    with pytest.raises(SystemExit, match="needs --write-table"):
        bench.main(["--from-csv", str(out)])


# ---- the table from a CSV measured elsewhere (--from-csv) ---------------------------------------
H200 = ROOT / "bench" / "results" / "gpu_h200_2026-11-27" / "quick_d_attention.txt"


def _full_rows():
    """Rows with every column, a NaN (a refused backend), a note with a comma, both bools."""
    nan = float("nan")
    rows = []
    for i, (backend, ms, causal, note) in enumerate([
            ("triton", 1.23456789, True, ""), ("flash", 0.5, True, "layer S 40: chunk 1/7"),
            ("cudnn", nan, True, "error: no varlen, sorry"), ("triton", 2.0, False, "")]):
        rows.append(dict(backend=backend, served_by="" if math.isnan(ms) else backend,
                         mode=bench.MODES[i % 3], batch=1, hq=32, hkv=8, head_dim=128,
                         sq=1056 + i, sk=32768, q_offset=32768 - 1056 - i, dtype="bfloat16",
                         causal=causal, masks="packed 4096" if i == 1 else "none", ms=ms,
                         tflops=ms * 3, call="query chunk", note=note))
    return rows


def _same(read, rows):
    assert len(read) == len(rows)
    for got, want in zip(read, rows):
        assert set(got) == set(bench.BACKEND_FIELDS)
        for key, value in want.items():
            if isinstance(value, float):
                assert type(got[key]) is float
                assert (math.isnan(got[key]) and math.isnan(value)
                        or got[key] == pytest.approx(value, rel=1e-5)), key
            else:
                assert type(got[key]) is type(value) and got[key] == value, key


def test_backend_rows_csv_round_trips(tmp_path):
    """read_backend_rows reads what the bench's writer wrote: alone, or inside a results file
    with other lines above (their '#' lines kept apart) and a JSON table below."""
    rows = _full_rows()
    header = ["device: NVIDIA H100 80GB HBM3 (CUDA 12.4)", "date: 2026-01-02T03:04:05+00:00"]
    alone = tmp_path / "rows.csv"
    bench.write_csv(alone, header, bench.BACKEND_FIELDS, rows)
    got_header, read, preamble = bench.read_backend_rows(alone)
    assert (got_header, preamble) == (header, [])
    _same(read, rows)
    text = alone.read_text()
    inside = tmp_path / "results.txt"
    inside.write_text("# device: NVIDIA H100, 550.54, 81559 MiB\n# git: abc1234 (the caller)\n"
                      "  triton Sq=1056: fwd 1.2 ms\nwrote rows.csv\n" + text
                      + '{\n "format": "x",\n "rules": []\n}\n# part d: ok\n')
    got_header, read, preamble = bench.read_backend_rows(inside)
    assert got_header == header
    assert preamble == ["device: NVIDIA H100, 550.54, 81559 MiB", "git: abc1234 (the caller)"]
    _same(read, rows)
    lines = text.splitlines()
    broken = tmp_path / "broken.csv"
    broken.write_text("\n".join(lines[:4] + [lines[4].rsplit(",", 2)[0]] + lines[5:]) + "\n")
    with pytest.raises(ValueError, match=r"broken.csv:5: 15 cells"):
        bench.read_backend_rows(broken)
    broken.write_text(text.replace(",True,", ",yes,", 1))
    with pytest.raises(ValueError, match=r"column 'causal' holds 'yes'"):
        bench.read_backend_rows(broken)
    broken.write_text("# device: x\nbackend,mode\ntriton,fwd\n")
    with pytest.raises(ValueError, match="no backend-rows CSV"):
        bench.read_backend_rows(broken)


@pytest.mark.parametrize("header, preamble, given, want", [
    (["device: NVIDIA H200 (CUDA 13.0)"], [], None, "sm90"),
    (["device: NVIDIA H100 80GB HBM3 (CUDA 12.4)"], [], None, "sm90"),
    (["device: NVIDIA A100-SXM4-80GB (CUDA 12.1)"], [], None, "sm80"),
    (["device: NVIDIA A10G (CUDA 12.1)"], [], None, "sm86"),
    (["device: NVIDIA L40S (CUDA 12.1)"], [], None, "sm89"),
    (["device: CPU x86_64, 2 cores -- CPU (Triton interpreter) run"], [], None, "cpu"),
    (["device: NVIDIA H200 (CUDA 13.0)", "arch: sm90"], [], "sm90", "sm90"),
    (["device: Some New GPU (CUDA 14.0)"], [], "sm120", "sm120"),
    (["device: NVIDIA A100 (CUDA 12.1)"], [], "sm80", "sm80"),
    ([], ["device: NVIDIA H200, 580.159.04, 143771 MiB"], None, "sm90"),
])
def test_csv_arch(header, preamble, given, want):
    assert bench.csv_arch(header, preamble, given) == want


def test_csv_arch_refuses_guesses():
    with pytest.raises(SystemExit, match="give it with --arch"):
        bench.csv_arch(["device: Some New GPU (CUDA 14.0)"], [])
    with pytest.raises(SystemExit, match="--arch sm80 but the CSV was measured on sm90"):
        bench.csv_arch(["device: NVIDIA H200 (CUDA 13.0)", "arch: sm90"], [], "sm80")


def _device_table():
    """The table the H200 printed after its CSV (written there by --write-table before
    choice_table added its unbounded last rules)."""
    text = H200.read_text()
    start = text.index('{\n "format"')
    return json.loads(text[start:text.index("\n}\n", start) + 2])


def _format1(rule):
    """A format-2 rule as format 1 wrote it: Triton named once, the list cut after it."""
    names = ["triton" if route.entry(n)[0] == "triton" else n for n in rule["backends"]]
    return dict(rule, backends=names[:names.index("triton") + 1])


def test_from_csv_rebuilds_the_h200_table_and_the_shipped_one(tmp_path):
    """--from-csv on the H200's results file: the device's own rules (format 1 there: each of
    our lists cut after Triton is the device's), then per (phase, masks, chunk) bucket whose
    measured shapes hold none largest in both sq and keys an unbounded rule; and exactly the
    table shipped in the package. The CSV's Triton rows name no dQ mode (they ran under the
    default, "separate"): the backward lists name triton:separate and no other mode."""
    out = tmp_path / "table.json"
    bench.main(["--from-csv", str(H200), "--write-table", str(out)])
    table = json.loads(out.read_text())
    device = _device_table()
    assert device["format"] == "ckpt_ext attention backend table 1"
    assert table["format"] == "ckpt_ext attention backend table 2"
    bounded = [r for r in table["rules"] if "sq_max" in r or "keys_max" in r
               or not r["chunk"]]
    assert [_format1(r) for r in bounded] == device["rules"]
    extra = [r for r in table["rules"] if _format1(r) not in device["rules"]]
    assert [(r["phase"], r["masks"], r["backends"]) for r in extra] == [
        ("bwd", "none", ["cudnn", "triton:separate", "flash", "efficient"]),
        ("bwd", "packed", ["flash", "triton:separate"]),
        ("fwd", "none", ["cudnn", "triton", "flash", "efficient"]),
        ("fwd", "packed", ["flash", "triton"])]
    assert all(r["chunk"] and "sq_max" not in r and "keys_max" not in r for r in extra)
    names = {n for r in table["rules"] for n in r["backends"]}
    assert "triton:separate" in names and not names & {"triton:ordered", "triton:atomic"}
    assert all(("triton" in r["backends"]) == (r["phase"] == "fwd") for r in table["rules"])
    assert "ran under attention_dq='separate'" in table["note"]
    assert table["measured"][:3] == [
        "source: bench/results/gpu_h200_2026-11-27/quick_d_attention.txt (its backend-rows CSV)",
        "arch: sm90", "commit: 67ac4f8 (as the caller said)"]
    assert table["measured"][3:] == device["measured"]
    assert table == json.loads((ROOT / "ckpt_ext" / "attention_backends.json").read_text())


def test_choice_table_adds_an_unbounded_rule_when_no_shape_is_largest():
    """Chunks measured at (512, 32768), (1056, 32768) and (1152, 17280): a chunk of 1152 rows
    seeing 20000 keys is in none of their rules; the last rule gives it the order of the
    shape with the most work (1056 x 32768), not the default."""
    rows = _rows({(512, 32768, "triton"): (1.0, 1.0), (512, 32768, "cudnn"): (2.0, 2.0),
                  (1056, 32768, "triton"): (3.0, 3.0), (1056, 32768, "flash"): (2.0, 2.0),
                  (1152, 17280, "triton"): (3.0, 1.0), (1152, 17280, "cudnn"): (2.0, 2.0)})
    table = route.Table.from_dict(bench.choice_table(rows, "sm90", ["# test"], note="n"))

    def pick(phase, Sq, keys):
        return table.lookup(route.Call(phase, torch.bfloat16, 1, 32, 8, Sq, keys, 128, True,
                                       keys - Sq), "sm90")

    assert pick("fwd", 1152, 20000) == ("flash", "triton")
    assert pick("fwd", 2048, 65536) == ("flash", "triton")
    assert pick("fwd", 1152, 17280) == ("cudnn", "triton")
    assert pick("bwd", 1152, 17280) == ("triton:separate", "cudnn")
    assert pick("fwd", 500, 30000) == ("triton", "cudnn")
    # a grid of shapes needs no extra rule: its largest is unbounded already
    grid = bench.choice_table(_rows({(512, 8192, "triton"): (1.0, 1.0),
                                     (1024, 32768, "triton"): (1.0, 1.0)}), "sm90", [])
    assert [("sq_max" in r, "keys_max" in r) for r in grid["rules"]] == [(True, True),
                                                                         (False, False)] * 2


def test_bare_triton_rows_take_the_dq_mode_of_their_run(tmp_path):
    """A CSV written before the rows named Triton's dQ mode: its bare "triton" rows ran under
    the CKPT_EXT_ATTN_DQ of its command line ("separate" when it sets none)."""
    rows = _rows({(1024, 1024, "triton"): (1.0, 3.0), (1024, 1024, "cudnn"): (0.8, 2.0)})
    for value in ("atomic", "ordered"):
        header = [f"command: CKPT_EXT_ATTN_DQ={value} python bench/attention.py --backend-rows"]
        assert bench.csv_dq_mode(header, []) == value
        table = bench.choice_table(rows, "sm90", header, bare_triton=value)
        assert [r["backends"] for r in table["rules"]] == [["cudnn", f"triton:{value}"],
                                                           ["cudnn", "triton"]]
    assert bench.csv_dq_mode(["command: python bench/attention.py --backend-rows"], []) \
        == "separate"
    assert bench.csv_dq_mode([], ["command: CKPT_EXT_ATTN_DQ=atomic python x"]) == "atomic"


def test_backend_settings_name_triton_per_dq_mode():
    assert bench.backend_settings(["auto:strict"]) == {"auto:strict": {
        "attention_backend": "auto", "attention_dq": "auto", "determinism": "strict"}}
    assert bench.backend_settings(["triton", "cudnn", "auto"]) == {
        "triton:separate": {"attention_backend": "triton", "attention_dq": "separate"},
        "triton:ordered": {"attention_backend": "triton", "attention_dq": "ordered"},
        "triton:atomic": {"attention_backend": "triton", "attention_dq": "atomic"},
        "cudnn": {"attention_backend": "cudnn", "attention_dq": "separate"},
        "auto": {"attention_backend": "auto"}}
    for bad in ("triton:fast", "sdpa"):
        with pytest.raises(SystemExit, match="unknown backend"):
            bench.backend_settings([bad])
