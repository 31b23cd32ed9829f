"""Tests of ckpt_ext.plan: the byte and FLOP models, the exact chooser and the CLI."""
import itertools
import json
import subprocess
import sys

import pytest
import torch

import ckpt_ext
from ckpt_ext import plan
from ckpt_ext.plan import LayerDims, choose_presets, parse_bytes
from ckpt_ext.presets import saved_bytes

LLAMA3_8B = LayerDims(4096, 32, 8, 128, 14336)


# ---- parse_bytes -----------------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [("20GiB", 20 * 2**30), ("512MB", 512 * 10**6),
                                       ("1.5 GiB", 3 * 2**29), ("4096", 4096), ("7b", 7),
                                       ("3kib", 3072), (12345, 12345), ("2TB", 2 * 10**12)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad,exc", [("20 gigs", ValueError), ("GiB", ValueError),
                                     ("-5GiB", ValueError), (-1, ValueError), (1.5, TypeError),
                                     (True, TypeError)])
def test_parse_bytes_rejects(bad, exc):
    with pytest.raises(exc, match="activation_budget"):
        parse_bytes(bad)


# ---- cost models -----------------------------------------------------------------------------
def test_layer_bytes_come_from_presets():
    for preset in ("fast", "balanced", "min_memory"):
        got = plan.layer_bytes(preset, LLAMA3_8B, 2, 100, "bf16")
        shared = saved_bytes(preset, B=2, S=100, dtype=torch.bfloat16,
                             **LLAMA3_8B.kwargs()) - got
        assert shared == 2 * 100 * 128 * 2  # cos and sin (1, S, D): the shared inputs only


def test_recompute_flops_by_hand():
    """H 8, Hq 2, Hkv 1, D 4, I 16, B 1, S 3: causal scores 2*4*(3*4/2)*2 = 96 (P V too),
    q/k/v 2*3*8*(2+2)*4 = 768, o_proj 2*3*8*8 = 384, gate/up 4*3*8*16 = 1536, down 768."""
    d = LayerDims(8, 2, 1, 4, 16)
    got = {p: plan.recompute_flops(p, d, 1, 3) for p in ("fast", "balanced", "min_memory",
                                                          "torch")}
    assert got == {"fast": 96, "balanced": 96 + 768 + 1536,
                   "min_memory": 96 + 768 + 1536 + 96 + 96 + 384,
                   "torch": 96 + 96 + 768 + 384 + 1536 + 768}
    with pytest.raises(ValueError, match="preset must be one of"):
        plan.recompute_flops("none", d, 1, 3)


# ---- choose_presets --------------------------------------------------------------------------
def _cost(presets, layers, B, S, dtype=torch.bfloat16):
    used = sum(plan.layer_bytes(p, d, B, S, dtype) for p, d in zip(presets, layers))
    flops = sum(plan.recompute_flops(p, d, B, S) for p, d in zip(presets, layers))
    return used, flops


def test_exact_against_brute_force():
    """Layers of different shapes: the chooser's recompute is the least over all 3**L
    assignments that fit, for budgets across the whole range."""
    layers = [LayerDims(64, 4, 2, 16, 176), LayerDims(64, 4, 4, 16, 96),
              LayerDims(64, 4, 1, 16, 256), LayerDims(64, 4, 2, 16, 176),
              LayerDims(64, 8, 2, 8, 128)]
    B, S = 2, 33
    every = [(_cost(c, layers, B, S), c)
             for c in itertools.product(("fast", "balanced", "min_memory"), repeat=len(layers))]
    lo = min(u for (u, _), _ in every)
    hi = max(u for (u, _), _ in every)
    for budget in list(range(lo, hi + 1, max(1, (hi - lo) // 97))) + [hi]:
        chosen = choose_presets(layers, B, S, torch.bfloat16, budget)
        used, flops = _cost(chosen, layers, B, S)
        best = min(f for (u, f), _ in every if u <= budget)
        assert used <= budget and flops == best, (budget, chosen)


def test_monotone_and_ends():
    layers = [LLAMA3_8B] * 32
    B, S = 4, 4096
    lo = sum(plan.layer_bytes("min_memory", d, B, S, "bf16") for d in layers)
    hi = sum(plan.layer_bytes("fast", d, B, S, "bf16") for d in layers)
    assert choose_presets(layers, B, S, "bf16", lo) == ["min_memory"] * 32
    assert choose_presets(layers, B, S, "bf16", hi) == ["fast"] * 32
    last = None
    for budget in range(lo, hi + 1, (hi - lo) // 150):
        chosen = choose_presets(layers, B, S, "bf16", budget)
        used, flops = _cost(chosen, layers, B, S)
        assert used <= budget
        if last is not None:
            assert flops <= last, budget
        last = flops


def test_budget_below_min_memory_names_the_smallest():
    layers = [LLAMA3_8B] * 2
    smallest = 2 * 8 * 1024 * 2 * 4096
    assert choose_presets(layers, 8, 1024, torch.bfloat16, smallest) == ["min_memory"] * 2
    with pytest.raises(ValueError, match=f"smallest that fits: {smallest} bytes \\(128.00 MiB\\)"):
        choose_presets(layers, 8, 1024, torch.bfloat16, smallest - 1)
    with pytest.raises(ValueError, match="B must be a positive int"):
        choose_presets(layers, 0, 1024, torch.bfloat16, "1GiB")


def test_string_budget_and_only_shapes_matter():
    layers = [LLAMA3_8B] * 4
    a = choose_presets(layers, 1, 2048, torch.bfloat16, "300MiB")
    assert a == choose_presets(tuple(layers), 1, 2048, "bf16", 300 * 2**20)
    # Per layer at S 2048: min_memory 16 MiB, balanced 48.25 MiB, fast 184.25 MiB. All
    # balanced (193 MiB) leaves room, and one layer down to min_memory pays for another up to
    # fast (297 MiB), which saves more (q/k/v + gate/up) than it costs (attention + o_proj).
    assert sorted(a) == ["balanced", "balanced", "fast", "min_memory"]


def test_layer_dims_from_config_and_hf_layer():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    dims = plan.layer_dims_from_config(cfg)
    assert dims == [LayerDims(64, 4, 2, 16, 176)] * 3
    assert plan.layer_dims_from_config(cfg.to_dict()) == dims
    model = transformers.LlamaForCausalLM(cfg)
    assert LayerDims.from_hf_layer(model.model.layers[0], 4) == dims[0]


# ---- the LM head ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_head_bytes_measured(dtype):
    """What HF's head + loss keeps, measured on a tiny LlamaForCausalLM: the saved bytes of
    the whole model with labels minus those of its base model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, vocab_size=101,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    B, S = 2, 9
    ids = torch.randint(0, 101, (B, S))
    whole = ckpt_ext.saved_activation_bytes(
        lambda: model(ids, labels=ids, use_cache=False).loss)
    base = ckpt_ext.saved_activation_bytes(
        lambda: model.model(ids, use_cache=False).last_hidden_state)
    assert whole - base == plan.head_saved_bytes(B, S, 32, 101, dtype, fused=False)


# ---- CLI ------------------------------------------------------------------------------------
DIMS_ARGS = ["--hidden-size", "64", "--heads", "4", "--kv-heads", "2", "--intermediate-size",
             "176", "--layers", "4", "--vocab-size", "1000", "--batch", "2", "--seq", "128"]


def test_cli_on_a_config(tmp_path, capsys):
    """``python -m ckpt_ext.plan`` in a subprocess; the same in-process by dimensions and by a
    model directory gives the same output."""
    cfg = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "ckpt_ext.plan", str(tmp_path / "config.json"),
                        "--batch", "2", "--seq", "128", "--dtype", "bf16", "--budget", "300KiB"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for word in ("fast", "balanced", "min_memory", "torch", "HF", "fused", "auto"):
        assert word in out, out
    want = choose_presets([LayerDims(64, 4, 2, 16, 176)] * 4, 2, 128, "bf16", "300KiB")
    assert "per layer: " + " ".join(want) in out
    assert plan.main(DIMS_ARGS + ["--budget", "300KiB"]) == 0
    assert capsys.readouterr().out == out
    assert plan.main([str(tmp_path), "--batch", "2", "--seq", "128", "--budget", "300KiB"]) == 0
    assert capsys.readouterr().out == out


def test_cli_errors(capsys):
    assert plan.main(DIMS_ARGS + ["--budget", "1KiB"]) == 2
    assert "smallest that fits: 131072 bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--batch", "2", "--seq", "128"])
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--seq", "0"), ("--batch", "-1"), ("--seq", "x"),
                                        ("--batch", "2.5"), ("--hidden-size", "0"),
                                        ("--vocab-size", "-3"), ("--budget", "3 parsecs")])
def test_cli_bad_argument_is_a_usage_error(flag, value, capsys):
    args = list(DIMS_ARGS)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    with pytest.raises(SystemExit) as exc:
        plan.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("content,why", [
    (None, "No such file"), ('{"hidden_size": 64,', "not valid JSON"),
    ("[1, 2]", "JSON object"), (b"\xff\xfe\x00", "not valid JSON"),
    ('{"hidden_size": "64", "num_attention_heads": 4, "intermediate_size": 176, '
     '"num_hidden_layers": 2, "vocab_size": 100}', "hidden_size must be an int"),
    ('{"hidden_size": 64, "num_attention_heads": 0, "intermediate_size": 176, '
     '"num_hidden_layers": 2, "vocab_size": 100}', "num_attention_heads must be a positive"),
    ('{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 176, '
     '"num_hidden_layers": 2, "vocab_size": "100"}', "vocab_size must be a positive int")])
def test_cli_bad_config_is_a_usage_error(tmp_path, content, why, capsys):
    """A missing, unreadable or malformed config exits 2 with a message, not a traceback."""
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        plan.main([str(path), "--batch", "2", "--seq", "8"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert why in err and out == "", (out, err)


def test_cli_usage_error_exit_status(tmp_path):
    """The exit status and message of ``python -m ckpt_ext.plan`` itself."""
    for args, name in (([str(tmp_path / "missing.json"), "--batch", "2", "--seq", "8"],
                        "argument config"), (DIMS_ARGS + ["--seq", "0"], "argument --seq")):
        r = subprocess.run([sys.executable, "-m", "ckpt_ext.plan", *args], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert name in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stdout == ""
