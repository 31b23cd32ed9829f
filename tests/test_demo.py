"""bench/demo.py at a tiny size: what it writes, where, and that it stays quiet."""
import csv
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--device", "cpu", "--seqs", "24,40", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--kv-heads", "2", "--intermediate", "64", "--vocab", "128"]


def test_demo_writes_its_results_folder_quietly(tmp_path):
    """The demo's outputs go to --out (nothing tracked is rewritten); the CSV names the
    command, the commit, the load and the date; every setup ran at every length, gives HF
    checkpointing's loss, and has a measured peak; no profiler logging reaches the user."""
    pytest.importorskip("transformers", reason="the demo trains a transformers model")
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                            text=True).stdout
    out = tmp_path / "res"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "demo.py"), *TINY, "--out",
                        str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "USDT" not in r.stdout + r.stderr and "profiler_start" not in r.stderr, r.stderr
    assert "load average" in r.stdout and "CPU (ATen) kernels" in r.stdout
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    assert after == before
    lines = (out / "demo_cpu.csv").read_text().splitlines()
    header = [x for x in lines if x.startswith("#")]
    for word in ("# device:", "# command:", "# commit:", "# date:", "# load average"):
        assert any(x.startswith(word) for x in header), (word, header)
    rows = list(csv.DictReader(x for x in lines if not x.startswith("#")))
    assert sorted((r["setup"], int(r["seq"])) for r in rows) == sorted(
        (s, n) for s in ("hf_gc+fused", "balanced", "min_memory") for n in (24, 40))
    for row in rows:
        assert int(row["peak_bytes"]) > 0 and int(row["plan_peak_bytes"]) > 0
        assert abs(float(row["loss_minus_hf_gc"])) < 1e-4, row
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: the picture is not checked")
    else:
        assert (out / "demo_cpu.png").stat().st_size > 10_000


def test_default_results_folder_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", "demo_results/demo_cpu.png"], cwd=ROOT)
    assert r.returncode == 0


def test_demo_bad_arguments_name_them(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for args, name in ((["--seqs", "8,x"], "argument --seqs"),
                       (["--hidden", "30"], "argument --hidden"),
                       (["--out", str(blocked / "sub")], "argument --out")):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "demo.py"), *TINY,
                            "--out", str(tmp_path), *args], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ))
        assert r.returncode == 2 and name in r.stderr, r.stderr
