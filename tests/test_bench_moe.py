"""bench/moe.py end to end on a tiny shape: every row runs, the fused rows' loss and gradients
match HF gradient checkpointing's, and the CSV carries the goal line."""
import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("transformers", reason="bench/moe.py builds a transformers Qwen3-MoE model")

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "bench" / "moe.py")
moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(moe)


def test_tiny_run(tmp_path, monkeypatch):
    out = tmp_path / "moe.csv"
    monkeypatch.setattr(sys, "argv", [
        "moe.py", "--seq", "48", "--hidden", "32", "--experts", "6", "--top-k", "2",
        "--expert-i", "16", "--layers", "2", "--vocab", "64", "--reps", "1", "--out", str(out)])
    assert moe.main() == 0
    lines = out.read_text().splitlines()
    assert any("min_memory peak / hf_gc peak" in line for line in lines)
    rows = [line.split(",") for line in lines if not line.startswith("#")]
    header, body = rows[0], {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert header[:3] == ["row", "seq", "peak_mib"]
    assert set(body) == {"hf_gc", "fast", "balanced", "min_memory"}
    for name in ("fast", "balanced", "min_memory"):
        assert float(body[name]["loss_diff"]) < 1e-4, body[name]
        assert float(body[name]["max_grad_diff"]) < 1e-4, body[name]
        assert float(body[name]["peak_mib"]) > 0
