"""bench/capacity.py: a tiny CPU run end to end, and the capacity search on a simulated GPU."""
import argparse
import csv
import importlib.util
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_capacity", ROOT / "bench" / "capacity.py")
capacity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(capacity)

TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128",
        "--heads", "4", "--kv-heads", "2", "--vocab", "256"]


def test_tiny_cpu_run_writes_a_row_per_setup_and_length(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = tmp_path / "capacity.csv"
    capacity.main(TINY + ["--seqs", "64,96", "--setups", "hf_gc", "min_memory",
                          "--out", str(out)])
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# device: CPU")
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    points = {(r["setup"], int(r["seq"])): r for r in rows if r["kind"] == "point"}
    assert set(points) == {(s, n) for s in ("hf_gc", "min_memory") for n in (64, 96)}
    for r in points.values():
        assert r["status"] == "ok"
        assert 0 < float(r["step_s"]) < 60
        assert float(r["peak_bytes"]) > 0  # measured on CPU (profiler memory events)
        assert math.isnan(float(r["base_bytes"]))
    for n in (64, 96):  # HF's head forms the (S, vocab) logits and their fp32 log-softmax
        assert float(points["hf_gc", n]["peak_bytes"]) >= 2 * 4 * n * 256
    # HF's layers and loss under its checkpointing; min_memory's layers and loss all fused
    assert points["hf_gc", 64]["note"] == "layers: hf x2; head: hf"
    assert points["min_memory", 64]["note"] == "layers: fused x2; head: fused"
    # saved bytes at the smallest length: the fused loss keeps no logits
    saved = {s: int(points[s, 64]["saved_bytes"]) for s in ("hf_gc", "min_memory")}
    assert 0 < saved["min_memory"] < saved["hf_gc"]
    assert points["hf_gc", 96]["saved_bytes"] == ""


def test_capacity_needs_cuda():
    with pytest.raises(RuntimeError, match="--capacity"):
        capacity.main(TINY + ["--capacity"])


class FakeRunner:
    """A step of S tokens peaks at A + B*S bytes and fails above ``limit``."""
    A, B = 1e6, 1000.0

    def __init__(self, limit, seconds_per_token=1e-9):
        self.limit, self.spt, self.tried = limit, seconds_per_token, []

    def step(self, seq):
        self.tried.append(seq)
        peak = self.A + self.B * seq
        if peak > self.limit:
            return {"status": "OOM", "peak_bytes": math.nan, "step_s": 0.0, "wall_s": 0.0}
        t = self.spt * seq
        return {"status": "ok", "peak_bytes": peak, "step_s": t, "wall_s": t}


def run_search(budget, runner, time_budget=60.0):
    points = [dict(runner.step(s), seq=s) for s in (4096, 16384)]
    runner.tried.clear()
    args = argparse.Namespace(granularity=4096, time_budget=time_budget)
    return capacity.search(runner, points, budget, args, capacity.time.perf_counter() + 60,
                           lambda msg: None)


LIMIT = FakeRunner.A + FakeRunner.B * 50_000  # 49152 = 12 * 4096 fits, 53248 does not


def test_search_from_a_cautious_prediction_steps_up():
    runner = FakeRunner(LIMIT)
    result = run_search(LIMIT - 3e6, runner)
    assert result["predicted_seq"] == 45056
    assert runner.tried == [45056, 49152, 53248]
    assert (result["max_ok_seq"], result["min_failed_seq"]) == (49152, 53248)
    assert not result["cut_by_time"] and result["status"] == "done"
    assert result["fit_b_bytes_per_token"] == pytest.approx(FakeRunner.B)


def test_search_from_an_optimistic_prediction_steps_down_then_bisects():
    runner = FakeRunner(LIMIT)
    result = run_search(LIMIT + 20e6, runner)
    assert runner.tried == [69632, 65536, 57344, 40960, 49152, 53248]
    assert (result["max_ok_seq"], result["min_failed_seq"]) == (49152, 53248)


def test_search_skips_a_trial_that_would_overrun_the_time_budget():
    runner = FakeRunner(LIMIT, seconds_per_token=1e-3)  # 16 s at 16384, ~45 s at 45056
    result = run_search(LIMIT - 3e6, runner, time_budget=30.0)
    assert runner.tried == []
    assert result["cut_by_time"] and result["status"] == "cut by time"
    assert (result["max_ok_seq"], result["min_failed_seq"]) == (16384, "not tried")
    assert result["note"].startswith("S=45056 not tried")
