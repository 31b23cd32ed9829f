"""bench/peak.py: the setup names, and a tiny CPU run against bounds computed by hand."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_peak", ROOT / "bench" / "peak.py")
peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peak)


def test_setup_names():
    assert peak.setup_kind("hf_gc") == (False, None, False)
    assert peak.setup_kind("lora:min_memory+fused") == (True, "min_memory", True)
    assert peak.setup_kind("balanced+hf_head") == (False, "balanced", False)
    for bad in ("min_memory", "qlora:hf_gc", "fastest+fused", "torch+other"):
        with pytest.raises(ValueError, match="setup"):
            peak.setup_kind(bad)
    with pytest.raises(SystemExit):
        peak.main(["--setups", "nope"])


def test_tiny_cpu_run():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    S, V, H = 48, 512, 32
    out = peak.main(["--device", "cpu", "--seq", str(S), "--layers", "1", "--hidden", str(H),
                     "--intermediate", "64", "--heads", "4", "--kv-heads", "2", "--vocab",
                     str(V), "--setups", "hf_gc", "min_memory+fused", "lora:min_memory+fused"])
    # HF's head forms the fp32 logits (S, V) and their log-softmax (S, V) at once
    assert out["hf_gc"] >= 2 * 4 * S * V
    # the gradients exist from the warm-up step; the full fine-tune's step still forms the
    # head's weight gradient (V, H) before adding it in place
    assert out["min_memory+fused"] >= 4 * V * H
    # under LoRA the frozen head forms no gradient: never more; the fused loss: less than HF's
    assert 0 < out["lora:min_memory+fused"] <= out["min_memory+fused"] < out["hf_gc"]
