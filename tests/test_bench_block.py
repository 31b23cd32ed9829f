"""bench/block.py: the goal arithmetic of the GPU validation, and a tiny end-to-end run."""
import csv
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_block", ROOT / "bench" / "block.py")
block = importlib.util.module_from_spec(spec)
spec.loader.exec_module(block)

MiB = 2**20


def verdicts(saved, per_layer, med, formula, input_bytes):
    return {what.split(" (")[0]: ok
            for what, _, ok in block.goals(saved, per_layer, med, formula, input_bytes)}


def numbers(**over):
    per_layer = {"none": 100 * MiB, "torch": 4 * MiB, "fast": 48 * MiB, "balanced": 12 * MiB,
                 "min_memory": 4 * MiB}
    med = {"none": 1.0, "torch": 1.30, "fast": 0.93, "balanced": 1.08, "min_memory": 1.18}
    for k, v in over.items():
        (per_layer if k.endswith("_bytes") else med)[k.rsplit("_", 1)[0]] = v
    saved = {n: b + MiB for n, b in per_layer.items()}  # + the shared cos/sin
    formula = {n: saved[n] for n in ("torch", "fast", "balanced", "min_memory")}
    return saved, per_layer, med, formula, 4 * MiB


def test_all_goals_met():
    v = verdicts(*numbers())
    assert len(v) == 12 and all(v.values()), v


@pytest.mark.parametrize("change, missed", [
    ({"min_memory_bytes": 4.3 * MiB}, "min_memory saves per layer <= 1.05x the layer input bytes"),
    ({"min_memory_time": 1.21}, "min_memory steps <= 1.20x none"),
    ({"balanced_bytes": 12.6 * MiB}, "balanced saves per layer <= 0.125x none's bytes"),
    ({"balanced_time": 1.11}, "balanced steps <= 1.10x none"),
    ({"fast_bytes": 50.1 * MiB}, "fast saves per layer <= 0.5x none's bytes"),
    ({"fast_time": 0.96}, "fast steps <= 0.95x none"),
])
def test_each_goal_can_be_missed(change, missed):
    v = verdicts(*numbers(**change))
    assert [k for k, ok in v.items() if not ok][:1] == [missed], v


def test_torch_line_interpolates_at_the_presets_memory():
    saved, per_layer, med, formula, inp = numbers()
    # balanced keeps 12 of none's 100 MiB; torch keeps 4: f = 88/96 of the layers checkpointed
    t, f = block.torch_line_time("balanced", per_layer, med)
    assert f == pytest.approx(88 / 96) and t == pytest.approx(1.0 + 88 / 96 * 0.30)
    # just slower than the line: missed; min_memory slower than torch itself: missed
    v = verdicts(*numbers(balanced_time=t + 1e-3, min_memory_time=1.31))
    assert not v["balanced beats torch at its memory point"]
    assert not v["min_memory beats torch at its memory point"]
    assert v["fast beats torch at its memory point"]
    assert block.torch_line_time("fast", dict(per_layer, fast=101 * MiB), med) is None


def test_formula_miss_fails_the_run_even_when_not_strict():
    saved, per_layer, med, formula, inp = numbers()
    formula["balanced"] -= 1
    v = verdicts(saved, per_layer, med, formula, inp)
    assert not v["balanced saves <= its formula"]


def test_tiny_run_writes_csv(tmp_path):
    out = tmp_path / "block.csv"
    ok = block.main(["--device", "cpu", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                     "--intermediate", "96", "--seq", "17", "--batch", "2", "--reps", "1",
                     "--csv", str(out)])
    assert ok  # the formulas hold; the goals are informational at this shape
    lines = out.read_text().splitlines()
    assert any(line.startswith("# goal ") for line in lines)
    rows = {r["row"]: r for r in csv.DictReader(line for line in lines if line[0] != "#")}
    assert {"none", "torch", "fast", "balanced", "min_memory"} <= set(rows)
    for n in ("fast", "balanced", "min_memory", "torch"):
        assert int(rows[n]["saved_bytes"]) == int(rows[n]["formula_bytes"]), n
    assert float(rows["min_memory"]["max_grad_err_vs_none"]) < 1e-4
    # the peak is measured on CPU too: none's step holds at least what its forward saves
    # beyond the resident input and cos/sin (torch saves exactly those)
    peak = {n: int(rows[n]["peak_bytes"]) for n in ("none", "torch", "min_memory")}
    assert peak["none"] >= int(rows["none"]["saved_bytes"]) - int(rows["torch"]["saved_bytes"])
    assert peak["min_memory"] > 0, peak
    if "hf_gc" in rows:  # HF's layer with the same weights computes the same gradients
        assert float(rows["hf_gc"]["max_grad_err_vs_none"]) < 1e-4
        assert int(rows["hf_gc"]["per_layer_bytes"]) == int(rows["torch"]["per_layer_bytes"])
