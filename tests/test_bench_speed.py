"""bench/speed.py: the speed table's dry run (the CPU, tiny sizes) end to end, its OOM rows and
its goal lines."""
import csv
import importlib.util
import math
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_speed", ROOT / "bench" / "speed.py")
speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(speed)


def _csv_rows(path):
    lines = path.read_text().splitlines()
    return lines, list(csv.DictReader(line for line in lines if not line.startswith("#")))


def test_dry_run_every_row_and_length(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = tmp_path / "speed.csv"
    # the GPU's arguments first: --dry-run replaces the sizes and the device
    speed.main(["--device", "cuda", "--seqs", "4096,16384", "--layers", "4", "--dry-run",
                "--reps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    lines, rows = _csv_rows(out)
    assert lines[0].startswith("# device: CPU") and "NOT GPU figures" in lines[0]
    names = [s + suffix for suffix in ("", "@lora") for s in speed.SETUPS]
    got = {(r["row"], int(r["seq"])): r for r in rows}
    assert set(got) == {(n, s) for n in names for s in (32, 64)}, sorted(got)
    for r in rows:
        assert r["status"] == "ok", r
        assert 0 < float(r["step_ms"]) < 60_000 and int(r["reps"]) == 2
        assert float(r["peak_bytes"]) > 0
    # HF's loss forms the (S, vocab) fp32 log-softmax: at least 4*S*V bytes
    for n in ("hf", "hf_gc"):
        assert float(got[n, 64]["peak_bytes"]) >= 4 * 64 * 256
    # how each row's layers and head ran: HF's, HF's under the torch preset, the fused op
    assert got["hf", 32]["paths"] == "layers: hf x2; head: hf"
    assert got["hf_gc", 32]["paths"] == "layers: hf x2; head: hf"
    assert got["hf_gc+fused_loss", 32]["paths"] == "layers: torch x2; head: fused"
    for p in ("fast", "balanced", "min_memory"):
        assert got[p, 32]["paths"] == "layers: fused x2; head: fused"
        assert got[p + "@lora", 32]["paths"] == "layers: fused x2; head: fused"
    # auto: its choice per shape
    assert re.fullmatch(r"layers: .+; head: fused; auto at B 1 S 32: .+; auto at B 1 S 64: .+",
                        got["auto", 32]["paths"]), got["auto", 32]["paths"]
    # the table per S and a goal line per goal, each with its figure and verdict
    for s in (32, 64):
        assert f"== S {s}: step ms and peak MiB" in printed
        for what in ("fast / hf", r"min_memory / hf_gc\+fused_loss",
                     r"auto / fastest HF row that ran \(hf(_gc)?(\+fused_loss)?\)",
                     "LoRA increment fast / hf", "LoRA increment min_memory / hf"):
            assert re.search(rf"^goal S={s}: {what} = -?[\d.]+ / -?[\d.]+ ms = "
                             r"(-?[\d.]+|nan) \(<= 1\.[05]: (met|missed|not measured)\)$",
                             printed, re.M), (s, what)
    assert re.search(r"^\[ *[\d.]+ s\] hf: model built in [\d.]+ s", printed, re.M)


class _Model(torch.nn.Module):
    """Runs out of memory above ``limit`` tokens (as the CUDA allocator would say)."""

    def __init__(self, limit):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.limit = limit

    def forward(self, input_ids, labels, use_cache):
        if input_ids.shape[1] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return type("Out", (), {"loss": (self.w * input_ids.shape[1]).sum()})()


def _args(**kw):
    a = speed.parse_args(["--dry-run"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_measure_out_of_memory_is_a_row():
    model = _Model(limit=40)
    ok = speed.measure(model, _args(), 32)
    assert ok["status"] == "ok" and ok["reps"] == 2 and ok["peak_bytes"] > 0
    oom = speed.measure(model, _args(), 64)
    assert oom["status"] == "OOM" and math.isnan(oom["step_ms"])
    assert model.w.grad is None        # the failed step's partial gradients are gone


def test_main_keeps_oom_rows_and_goes_on(tmp_path, monkeypatch, capsys):
    built = []

    def build(a, setup, lora):
        built.append((setup, lora))
        return _Model(limit=40 if setup == "hf" else 10**6)

    monkeypatch.setattr(speed, "build_model", build)
    monkeypatch.setattr(speed, "paths", lambda model: "fake")
    monkeypatch.setitem(speed.DRY, "seqs", [32, 64, 96])
    out = tmp_path / "speed.csv"
    speed.main(["--dry-run", "--rows", "hf", "fast", "--out", str(out)])
    _, rows = _csv_rows(out)
    got = {(r["row"], int(r["seq"])): r for r in rows}
    assert got["hf", 32]["status"] == "ok" and got["hf", 64]["status"] == "OOM"
    # the longer S of a row that ran out of memory is not tried
    assert got["hf", 96]["status"] == "OOM"
    assert got["hf", 96]["note"] == "not tried: S=64 did not fit"
    assert all(got["fast", s]["status"] == "ok" for s in (32, 64, 96))
    assert built == [("hf", False), ("fast", False), ("hf", True), ("fast", True)]
    printed = capsys.readouterr().out
    assert re.search(r"^ +hf +OOM +$", printed, re.M), printed
    assert re.search(r"^goal S=64: fast / hf = [\d.]+ / nan ms = nan \(<= 1.0: not measured\)$",
                     printed, re.M), printed


def test_auto_refusal_is_a_row():
    """policy="auto" finding no mix that fits (the plan's ValueError) is a "no fit" row with
    the plan's message; another ValueError is a bug and raises."""
    class Refusing(_Model):
        def forward(self, input_ids, labels, use_cache):
            raise ValueError(self.message)

    model = Refusing(10**6)
    model.message = "auto: room for the step of 1.00 GiB is below the smallest that fits"
    row = speed.measure(model, _args(), 32)
    assert row["status"] == "no fit" and row["note"] == model.message
    model.message = "shapes do not match"
    with pytest.raises(ValueError, match="shapes do not match"):
        speed.measure(model, _args(), 32)


def test_deadline_skips_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(speed, "build_model", lambda a, setup, lora: _Model(10**6))
    monkeypatch.setattr(speed, "paths", lambda model: "fake")
    out = tmp_path / "speed.csv"
    speed.main(["--dry-run", "--rows", "hf", "--lora", "0", "--deadline", "0",
                "--out", str(out)])
    _, rows = _csv_rows(out)
    assert {r["status"] for r in rows} == {"skipped (deadline)"} and len(rows) == 2


def test_arguments_refused_with_their_names():
    with pytest.raises(SystemExit):
        speed.parse_args(["--seqs", "4k"])
    with pytest.raises(SystemExit):
        speed.parse_args(["--dry-run", "--lora-dropout", "1.5"])


def test_checkpointing_switch_without_deprecation_warning():
    transformers = pytest.importorskip("transformers")
    import warnings

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        speed.hf_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
