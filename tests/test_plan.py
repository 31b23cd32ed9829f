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
                   "torch": 96 + 96 + 96 + 768 + 384 + 1536 + 768}
    with pytest.raises(ValueError, match="preset must be one of"):
        plan.recompute_flops("none", d, 1, 3)


def test_recompute_flops_with_output_norms_by_hand():
    """The same layer with Gemma's / OLMo-2's output norms: the MLP forward again (gate/up
    1536 + down 768) for balanced and min_memory, only down (768) for fast, which keeps
    gate/up; o_proj (384) again for fast and balanced; the torch row recomputes the whole
    layer anyway."""
    base = LayerDims(8, 2, 1, 4, 16)
    d = LayerDims(8, 2, 1, 4, 16, attention_output_norm=True, mlp_output_norm=True)
    extra = {"fast": 768 + 384, "balanced": 2304 + 384, "min_memory": 2304, "torch": 0}
    for preset, more in extra.items():
        assert plan.recompute_flops(preset, d, 1, 3) == \
            plan.recompute_flops(preset, base, 1, 3) + more, preset
        assert plan.layer_bytes(preset, d, 1, 3, torch.bfloat16) == \
            plan.layer_bytes(preset, base, 1, 3, torch.bfloat16), preset


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
    olmo = dict(cfg.to_dict(), model_type="olmo2")
    assert plan.layer_dims_from_config(olmo) == [LayerDims(64, 4, 2, 16, 176, True, True)] * 3
    # GLM-4's one gate_up_proj and output norms; HyperCLOVA X with and without its Peri-LN
    from ckpt_ext.hf.families import FAMILIES
    small = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                 pad_token_id=0)
    glm4 = transformers.Glm4ForCausalLM(transformers.Glm4Config(**small))
    assert LayerDims.from_hf_layer(glm4.model.layers[0], 4, FAMILIES["glm4"]) == \
        LayerDims(64, 4, 2, 16, 176, True, True) == \
        plan.layer_dims_from_config(glm4.config)[0]
    for post in (True, False):
        clova = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("hyperclovax", use_post_norm=post, **small))
        want = LayerDims(64, 4, 2, 16, 176, post, post)
        assert LayerDims.from_hf_layer(clova.model.layers[0], 4, FAMILIES["hyperclovax"]) == want
        assert plan.layer_dims_from_config(clova.config) == [want]


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


def test_cli_step_table_and_longest_sequence(capsys):
    """The step table: saved and peak per setup as step_peak models them, and with
    --device-memory the longest sequence that fits, per setup."""
    assert plan.main(DIMS_ARGS + ["--device-memory", "2GiB", "--weights", "lora",
                                  "--path", "cpu"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("step (LoRA, cpu path)"):]
    layers = [LayerDims(64, 4, 2, 16, 176)] * 4
    for setup, name in plan._SETUP_NAMES.items():
        line = next(x for x in table.splitlines() if x.startswith(name + " "))
        p = plan.step_peak(setup, layers, 1000, 2, 128, "bf16", path="cpu", train_weights=False)
        longest = plan.longest_sequence(setup, layers, 1000, 2, "bf16", 2 * 2**30, "lora",
                                        path="cpu")
        assert plan.format_bytes(p.peak) in line and f"{longest:,}" in line, (line, longest)
    assert "longest S in 2.00 GiB" in out


def test_cli_errors(capsys):
    assert plan.main(DIMS_ARGS + ["--budget", "1KiB"]) == 2
    assert "smallest that fits: 131072 bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--batch", "2", "--seq", "128"])
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--seq", "0"), ("--batch", "-1"), ("--seq", "x"),
                                        ("--batch", "2.5"), ("--hidden-size", "0"),
                                        ("--vocab-size", "-3"), ("--budget", "3 parsecs"),
                                        ("--device-memory", "lots"), ("--weights", "qlora"),
                                        ("--path", "tpu")])
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


# ---- the step's peak: the model against the CPU allocator --------------------------------------
PEAK_CASES = {
    # a small vocabulary: the top layer's backward sets the peak (T below the SwiGLU chunk)
    "layer-bound": dict(H=256, heads=4, kv=2, D=40, I=1200, V=1024, L=3, S=900),
    # a large vocabulary: the head sets it
    "head-bound": dict(H=192, heads=6, kv=3, D=32, I=640, V=8000, L=2, S=500),
    # the SwiGLU chunk below T
    "chunked": dict(H=96, heads=4, kv=1, D=32, I=5000, V=512, L=2, S=1000),
    # the fused layer in token chunks (about 150 tokens under this cap)
    "layer-chunks": dict(H=128, heads=4, kv=2, D=32, I=400, V=512, L=2, S=1100,
                         cap=(4 * 128 + 3 * 400) * 4 * 150),
}


def _measured_peak(case, setup, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: "
                                       "the peak is measured on an HF model")
    c = PEAK_CASES[case]
    if "cap" in c:
        monkeypatch.setenv("CKPT_EXT_CHUNK_BYTES", str(c["cap"]))
    cfg = transformers.LlamaConfig(
        hidden_size=c["H"], intermediate_size=c["I"], num_hidden_layers=c["L"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv"], head_dim=c["D"],
        vocab_size=c["V"], rms_norm_eps=1e-5, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.train()
    if setup.startswith("hf_gc"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if setup != "hf_gc":
        ckpt_ext.patch_llama(model, "torch" if setup == "hf_gc+fused" else setup)
    ids = torch.randint(c["V"], (1, c["S"]), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
    step()                                  # the gradients exist from here on, as in training
    saved = ckpt_ext.saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss)
    return saved, ckpt_ext.peak_memory_bytes(step)


@pytest.mark.parametrize("case", sorted(PEAK_CASES))
@pytest.mark.parametrize("setup", plan.PEAK_SETUPS)
def test_step_peak_model_matches_the_cpu_allocator(case, setup, monkeypatch):
    """plan.step_peak (path="cpu") within 10% of the measured peak of a training step, and
    its saved bytes within 2% of saved_activation_bytes, in shapes it was not fitted on."""
    if torch.cuda.is_available():
        pytest.skip("measures the CPU allocator (the model's CUDA path is checked by "
                    "tools/gpu_validate.sh capacity)")
    c = PEAK_CASES[case]
    saved, peak = _measured_peak(case, setup, monkeypatch)
    model = plan.step_peak(setup, [LayerDims(c["H"], c["heads"], c["kv"], c["D"], c["I"])] *
                           c["L"], c["V"], 1, c["S"], torch.float32, path="cpu",
                           chunk_bytes=c.get("cap"))
    if setup.startswith("hf_gc"):
        # HF's checkpoint holds cos/sin in the kwargs of its recompute: alive (the peak has
        # them) but out of sight of saved-tensor hooks; the model counts them as kept.
        saved += 2 * 4 * c["S"] * c["D"]
    print(f"{case} {setup}: peak {peak} model {model.peak} ({model.phase}); saved {saved} "
          f"model {model.saved}")
    assert abs(model.peak - peak) <= 0.10 * peak, (model.peak, peak, model.phase)
    assert abs(model.saved - saved) <= 0.02 * saved, (model.saved, saved)


def test_step_peak_orders_the_setups_at_llama3_8b():
    """At LLaMA-3-8B shapes on the GPU path, bf16, S 32k: the fused presets peak below HF
    checkpointing with a fused loss, which peaks below HF checkpointing with HF's head; the
    LoRA model state is a fraction of the full fine-tune's."""
    layers = [LLAMA3_8B] * 32
    peaks = {s: plan.step_peak(s, layers, 128256, 1, 32768, "bf16", train_weights=False).peak
             for s in plan.PEAK_SETUPS}
    assert peaks["min_memory"] < peaks["hf_gc+fused"] < peaks["hf_gc"]
    assert peaks["balanced"] < peaks["fast"]
    full = plan.model_state_bytes(layers, 128256, "bf16", "full")
    lora = plan.model_state_bytes(layers, 128256, "bf16", "lora")
    assert 15.5 * 8.0e9 < full < 16.5 * 8.1e9 and lora < full / 7


def test_longest_sequence_is_the_last_that_fits():
    layers = [LayerDims(512, 8, 2, 64, 1792)] * 4
    budget = 3 * 2**30
    for setup in plan.PEAK_SETUPS:
        s = plan.longest_sequence(setup, layers, 16384, 1, "fp32", budget, "lora")
        state = plan.model_state_bytes(layers, 16384, "fp32", "lora")
        fits = lambda n: state + plan.step_peak(setup, layers, 16384, 1, n, "fp32",  # noqa: E731
                                                train_weights=False).peak <= budget
        assert s > 0 and fits(s) and not fits(s + 1), (setup, s)
    assert plan.longest_sequence("min_memory", layers, 16384, 1, "fp32", 1000, "lora") == 0


def test_step_peak_rejects_bad_arguments():
    layers = [LLAMA3_8B]
    with pytest.raises(ValueError, match="setup must be one of"):
        plan.step_peak("none", layers, 10, 1, 8, "bf16")
    with pytest.raises(ValueError, match="path must be 'cuda' or 'cpu'"):
        plan.step_peak("fast", layers, 10, 1, 8, "bf16", path="tpu")
    with pytest.raises(ValueError, match="S must be a positive int"):
        plan.step_peak("fast", layers, 10, 1, 0, "bf16")
    with pytest.raises(ValueError, match="weights must be 'full' or 'lora'"):
        plan.model_state_bytes(layers, 10, "bf16", "qlora")
