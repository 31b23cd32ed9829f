"""The fused path in the setups people train with: torch.autocast, torch.compile, HF gradient
checkpointing, PEFT LoRA adapters, and HF's Trainer. Each test checks that the fused op really
ran (saved bytes, call counts), not a flag, and compares with the unpatched model."""
import copy
import os
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext.modules import DecoderLayer
from ckpt_ext.presets import FUSED_PRESETS, saved_bytes

from reference import make_layer, rope_tables

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: these tests need it "
    "(pip install -e '.[test]')")
from hf_fixtures import padded_batch, tiny_model  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=172, vocab_size=128, pad_token_id=0,
            rms_norm_eps=1e-5, use_cache=False)
B, S = 2, 17


def make_model(family="llama", dtype=torch.float32, seed=0, **overrides):
    # transformers runs Gemma 2 (its attention soft-cap) with eager attention only
    return tiny_model(family, {**TINY, **overrides}, seed=seed, perturb=True, bias_noise=None,
                      impl="eager" if family == "gemma2" else "sdpa").to(dtype)


def make_batch(seed=1):
    return padded_batch(TINY["vocab_size"], B, S, pad=4, seed=seed)


def fused_calls(model):
    return sum(layer.forward.calls["fused"] for layer in model.model.layers)


def loss_and_grads(model, ids, mask, labels, autocast=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach().double(), {n.removeprefix("_orig_mod."): p.grad.double()
                                    for n, p in model.named_parameters() if p.grad is not None}


def model_saved_bytes(model, ids, mask, labels, autocast=None):
    def step():
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return ckpt_ext.saved_activation_bytes(step)


def rel_err(got, ref):
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---- autocast ----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", FUSED_PRESETS)
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_saved_bytes_match_the_formula(preset, amp):
    h, hq, hkv, d, i, s = 64, 4, 2, 16, 172, 33
    layer = make_layer(h, hq, hkv, i, torch.float32, policy=preset)
    x = torch.randn(2, s, h, requires_grad=True)
    pe = rope_tables(s, d, torch.float32)
    with torch.autocast("cpu", dtype=amp):
        got = ckpt_ext.saved_activation_bytes(layer, x, pe)
        y = layer(x, pe)
    assert y.dtype == torch.float32  # the residual stream stays in the master dtype
    assert got == saved_bytes(preset, B=2, S=s, H=h, Hq=hq, Hkv=hkv, D=d, I=i,
                              dtype=torch.float32, compute_dtype=amp)


# families whose norms round differently from LLaMA's (norm_cast_last, norm_offset) or sit
# elsewhere (post-norms: OLMo-2, EXAONE 4.0; sandwich norms: Gemma 2/3, GLM-4), and RoPE on
# interleaved pairs (GLM-4, Helium, ERNIE 4.5: from float32 tables), q/k norms after RoPE
# (Hunyuan)
AUTOCAST_FAMILIES = {"llama": {}, "olmo2": {}, "gemma": {},
                     "gemma3_text": dict(query_pre_attn_scalar=24),
                     "gemma2": dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0, sliding_window=6,
                                    layer_types=["sliding_attention", "full_attention"]),
                     "phi3": {},
                     "exaone4": dict(sliding_window=6,
                                     layer_types=["sliding_attention", "full_attention"]),
                     "glm4": {}, "helium": {}, "ernie4_5": {}, "hunyuan_v1_dense": {}}


@pytest.mark.parametrize("family", list(AUTOCAST_FAMILIES))
@pytest.mark.parametrize("weights,amp", [(torch.float32, torch.bfloat16),
                                         (torch.bfloat16, torch.bfloat16),
                                         (torch.bfloat16, None)],
                         ids=["fp32-master", "bf16", "bf16-no-autocast"])
def test_autocast_hf_model_is_fused_and_as_accurate_as_hf(weights, amp, family):
    """bf16 autocast over fp32 or bf16 weights, and bf16 weights trained without autocast (a
    common LoRA setup; ERNIE 4.5's position embeddings then stay float32 beside bf16 hidden
    states): every layer fused, errors against fp64 within 3x HF's own."""
    ids, mask, labels = make_batch()
    if family == "gemma2":   # right padding: left padding leaves rows that the capped eager
        ids, mask, labels = (t.flip(1) for t in (ids, mask, labels))  # attention runs as HF
    cfg = AUTOCAST_FAMILIES[family]
    ref64 = make_model(family, dtype=weights, **cfg).double()
    loss64, grads64 = loss_and_grads(ref64, ids, mask, labels)
    hf = make_model(family, dtype=weights, **cfg)
    loss_hf, grads_hf = loss_and_grads(hf, ids, mask, labels, autocast=amp)
    model = ckpt_ext.patch_llama(copy.deepcopy(hf))
    loss_ck, grads_ck = loss_and_grads(model, ids, mask, labels, autocast=amp)
    assert fused_calls(model) == TINY["num_hidden_layers"]
    # the fused model's error against fp64 is within a small multiple of HF's own
    err_hf, err_ck = abs(loss_hf - loss64).item(), abs(loss_ck - loss64).item()
    assert err_ck <= 3 * err_hf + 1e-3, (err_ck, err_hf)
    for name, g64 in grads64.items():
        e_hf, e_ck = rel_err(grads_hf[name], g64), rel_err(grads_ck[name], g64)
        assert e_ck <= 3 * e_hf + 1e-3, (name, e_ck, e_hf)
    assert model_saved_bytes(model, ids, mask, labels, amp) < \
        model_saved_bytes(hf, ids, mask, labels, amp) * 0.6


def _autocast_step(model, ids, mask, labels, backward_in):
    """Forward under bf16 autocast; backward outside it ("out"), inside the same block ("in")
    or inside a nested block of another autocast dtype ("fp16")."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if backward_in == "in":
            loss.backward()
        elif backward_in == "fp16":
            with torch.autocast("cpu", dtype=torch.float16):
                loss.backward()
    if backward_in == "out":
        loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                    if p.grad is not None}


@pytest.mark.parametrize("fuse_head", [True, False], ids=["fused-head", "hf-head"])
@pytest.mark.parametrize("preset", ["none", "torch", *FUSED_PRESETS])
def test_backward_inside_autocast_equals_backward_outside(preset, fuse_head):
    """loss.backward() inside the torch.autocast block of the forward (as many training scripts
    do) gives the gradients of a backward outside it, exactly, and as accurate as HF's own
    model against fp64 under the same autocast."""
    seed = int(torch.randint(2**31, ()))
    ids, mask, labels = make_batch(seed=seed)
    hf = make_model(seed=seed)
    model = ckpt_ext.patch_llama(copy.deepcopy(hf), policy=preset, fuse_lm_head=fuse_head)
    loss_out, grads_out = _autocast_step(model, ids, mask, labels, "out")
    loss_in, grads_in = _autocast_step(model, ids, mask, labels, "in")
    assert torch.equal(loss_in, loss_out)
    assert set(grads_in) == set(grads_out) and len(grads_in) == len(list(hf.parameters()))
    for name, g in grads_out.items():
        assert torch.equal(grads_in[name], g), name
    loss64, grads64 = loss_and_grads(copy.deepcopy(hf).double(), ids, mask, labels)
    loss_hf, grads_hf = _autocast_step(hf, ids, mask, labels, "in")
    assert abs(loss_in - loss64).item() <= 3 * abs(loss_hf - loss64).item() + 1e-3
    for name, g64 in grads64.items():
        e_hf, e_ck = rel_err(grads_hf[name], g64), rel_err(grads_in[name], g64)
        assert e_ck <= 3 * e_hf + 1e-3, (name, e_ck, e_hf)


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_fused_layer_backward_ignores_the_autocast_state_it_runs_under(preset):
    """The fused layer's backward computes in the dtypes its forward chose: a backward under
    another autocast dtype, or with autocast off, gives the same gradients, exactly, and they
    are those of plain PyTorch in fp64 up to bf16 error."""
    h, hq, hkv, d, i, s = 64, 4, 2, 16, 172, 19
    layer = make_layer(h, hq, hkv, i, torch.float32, policy=preset)
    pe = rope_tables(s, d, torch.float32)
    x0 = torch.randn(2, s, h)
    dy = torch.randn(2, s, h)
    results = []
    for backward_under in (None, torch.bfloat16, torch.float16):
        x = x0.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, pe)
        with torch.autocast("cpu", dtype=backward_under or torch.bfloat16,
                            enabled=backward_under is not None):
            y.backward(dy)
        results.append([x.grad] + [p.grad for p in layer.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    ref = make_layer(h, hq, hkv, i, torch.float64, policy="none")
    ref.load_state_dict(layer.state_dict())
    x = x0.double().requires_grad_()
    ref(x, tuple(t.double() for t in pe)).backward(dy.double())
    for got, want in zip(results[0], [x.grad] + [p.grad for p in ref.parameters()]):
        assert rel_err(got.double(), want) < 0.05


# ---- torch.compile -------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_compiled_layer_keeps_the_preset(preset):
    torch._dynamo.reset()
    layer = make_layer(64, 4, 2, 172, torch.float32, policy=preset)
    x = torch.randn(2, 33, 64, requires_grad=True)
    pe = rope_tables(33, 16, torch.float32)
    mask = torch.ones(2, 33, dtype=torch.bool)
    mask[1, :5] = False
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert ckpt_ext.saved_activation_bytes(compiled, x, pe, mask) == \
        ckpt_ext.saved_activation_bytes(layer, x, pe, mask)
    params = [x, *layer.parameters()]
    g_eager = torch.autograd.grad(layer(x, pe, mask).square().sum(), params)
    g_comp = torch.autograd.grad(compiled(x, pe, mask).square().sum(), params)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_inductor_layer_keeps_the_preset():
    torch._dynamo.reset()
    layer = make_layer(32, 2, 1, 48, torch.float32, policy="min_memory")
    x = torch.randn(1, 9, 32, requires_grad=True)
    pe = rope_tables(9, 16, torch.float32)
    compiled = torch.compile(layer, backend="inductor")
    eager = ckpt_ext.saved_activation_bytes(layer, x, pe)
    assert ckpt_ext.saved_activation_bytes(compiled, x, pe) <= 1.1 * eager
    g_eager = torch.autograd.grad(layer(x, pe).sum(), [x, *layer.parameters()])
    g_comp = torch.autograd.grad(compiled(x, pe).sum(), [x, *layer.parameters()])
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma3_text"])
@pytest.mark.parametrize("preset", ["balanced", "min_memory"])
def test_compiled_hf_model_has_no_graph_breaks_and_keeps_the_preset(preset, family):
    torch._dynamo.reset()
    ids, mask, labels = make_batch()
    model = ckpt_ext.patch_llama(make_model(family, **AUTOCAST_FAMILIES[family]), preset)
    eager_bytes = model_saved_bytes(model, ids, mask, labels)
    loss_e, grads_e = loss_and_grads(model, ids, mask, labels)
    explain = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, labels=labels)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    compiled_bytes = model_saved_bytes(compiled, ids, mask, labels)
    assert compiled_bytes <= 1.1 * eager_bytes, (compiled_bytes, eager_bytes)
    loss_c, grads_c = loss_and_grads(compiled, ids, mask, labels)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6)


# ---- HF gradient checkpointing ------------------------------------------------------------------

@pytest.mark.parametrize("when", ["before", "after"])
def test_hf_gradient_checkpointing_default_policy_holds_no_more(when):
    ids, mask, labels = make_batch()
    hf = make_model()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_bytes = model_saved_bytes(hf, ids, mask, labels)
    loss_hf, grads_hf = loss_and_grads(hf, ids, mask, labels)
    model = copy.deepcopy(hf)
    if when == "after":
        model.gradient_checkpointing_disable()
    with pytest.warns(UserWarning, match="'min_memory'") if when == "before" else \
            warnings.catch_warnings():
        ckpt_ext.patch_llama(model)
    if when == "after":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match="'min_memory'") if when == "after" else \
            warnings.catch_warnings():
        ours = model_saved_bytes(model, ids, mask, labels)
    # HF's checkpoint keeps cos/sin and the mask alive in its recompute closure, where saved-
    # tensor hooks do not see them; the fused op saves them (once for all layers): count them.
    shared = 2 * S * TINY["head_dim"] * 4 + B * S
    assert ours <= hf_bytes + shared, (ours, hf_bytes, shared)
    assert fused_calls(model) == TINY["num_hidden_layers"]
    loss, grads = loss_and_grads(model, ids, mask, labels)
    torch.testing.assert_close(loss, loss_hf, rtol=1e-5, atol=1e-6)
    for name, g in grads_hf.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)


def test_hf_gradient_checkpointing_explicit_policy_is_honoured_with_a_warning():
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match=r"\['balanced'\] keep more than the layer input"):
        ckpt_ext.patch_llama(model, "balanced")
    ids, mask, labels = make_batch()
    loss_and_grads(model, ids, mask, labels)
    assert [layer.forward.preset for layer in model.model.layers] == ["balanced"] * 2
    assert fused_calls(model) == TINY["num_hidden_layers"]


# ---- PEFT LoRA -----------------------------------------------------------------------------------

def _peft():
    return pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need it "
                               "(pip install -e '.[test]')")


def lora_model(family, targets, order, preset="balanced", seed=0, **cfg):
    peft = _peft()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                             init_lora_weights=False, **cfg)
    base = make_model(family, seed=seed)
    if order == "patch-then-wrap":
        ckpt_ext.patch_llama(base, preset)
        torch.manual_seed(seed)
        return peft.get_peft_model(base, config)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(base, config)
    ckpt_ext.patch_llama(wrapped, preset)
    return wrapped


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family,targets", [("llama", ALL), ("qwen2", ["q_proj", "v_proj"]),
                                            ("qwen3", ALL), ("olmo2", ALL),
                                            ("gemma3_text", ALL)])
@pytest.mark.parametrize("order", ["wrap-then-patch", "patch-then-wrap"])
@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_lora_is_fused_with_exact_gradients(family, targets, order, preset):
    peft = _peft()
    ids, mask, labels = make_batch()
    base = make_model(family)
    torch.manual_seed(0)  # the adapters' initialisation, as in lora_model
    ref = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False))
    model = lora_model(family, targets, order, preset)
    loss_r, grads_r = loss_and_grads(ref, ids, mask, labels)
    loss, grads = loss_and_grads(model, ids, mask, labels)
    inner = model.get_base_model()
    assert sum(layer.forward.calls["fused"] for layer in inner.model.layers) == 2
    torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(grads_r) and all("lora_" in n for n in grads)  # base frozen
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)
    assert ckpt_ext.unpatch_llama(model) is model
    assert all("forward" not in layer.__dict__ for layer in inner.model.layers)


def test_lora_disabled_and_merged_adapters():
    peft = _peft()
    ids, mask, labels = make_batch()
    model = lora_model("llama", ALL, "wrap-then-patch")
    base = make_model("llama")
    with model.disable_adapter():  # every parameter frozen: no backward to run
        loss_off = model(input_ids=ids, attention_mask=mask, labels=labels).loss.double()
    torch.testing.assert_close(loss_off, loss_and_grads(base, ids, mask, labels)[0],
                               rtol=1e-5, atol=1e-6)
    loss_on, _ = loss_and_grads(model, ids, mask, labels)
    model.merge_adapter()  # the adapters live in the frozen base weights now
    loss_merged = model(input_ids=ids, attention_mask=mask, labels=labels).loss.double()
    torch.testing.assert_close(loss_merged, loss_on, rtol=1e-4, atol=1e-5)
    model.unmerge_adapter()
    inner = model.get_base_model()
    assert sum(layer.forward.calls["fused"] for layer in inner.model.layers) == 6  # off, on, merged
    dropout = peft.get_peft_model(make_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj"]))
    ckpt_ext.patch_llama(dropout)
    loss_and_grads(dropout, ids, mask, labels)  # fused, with the op's own dropout
    assert sum(layer.forward.calls["fused"] for layer in dropout.get_base_model().model.layers) \
        == 2


def test_lora_fp32_adapters_on_a_bf16_base():
    peft = _peft()
    ids, mask, labels = make_batch()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ALL,
                          init_lora_weights=False)
    torch.manual_seed(0)
    ref = peft.get_peft_model(make_model("llama", dtype=torch.bfloat16), cfg)
    assert ref.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype \
        == torch.float32
    model = copy.deepcopy(ref)
    ckpt_ext.patch_llama(model)
    torch.manual_seed(0)
    ref64 = peft.get_peft_model(make_model("llama").double(), cfg)
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    loss64, grads64 = loss_and_grads(ref64, ids, mask, labels)
    loss_r, grads_r = loss_and_grads(ref, ids, mask, labels)
    loss, grads = loss_and_grads(model, ids, mask, labels)
    assert sum(layer.forward.calls["fused"] for layer in model.get_base_model().model.layers) == 2
    assert abs(loss - loss64) <= 3 * abs(loss_r - loss64) + 1e-2
    for name, g64 in grads64.items():
        assert rel_err(grads[name], g64) <= 3 * rel_err(grads_r[name], g64) + 1e-2, name


# ---- HF Trainer ---------------------------------------------------------------------------------

def test_trainer_bf16_runs_the_fused_op(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed: Trainer needs it "
                        "(pip install -e '.[test]')")
    from transformers import Trainer, TrainingArguments

    ids, mask, labels = make_batch()
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]}
            for i in range(B)] * 2
    model = ckpt_ext.patch_llama(make_model())
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             max_steps=2, bf16=True, use_cpu=True, report_to=[],
                             logging_steps=1, save_strategy="no", learning_rate=1e-3)
    Trainer(model=model, args=args, train_dataset=rows).train()
    assert fused_calls(model) == 2 * TINY["num_hidden_layers"]


# ---- TRL SFTTrainer ---------------------------------------------------------------------------

def _sft_setup(tmp_path, **config):
    trl = pytest.importorskip("trl", reason="trl is not installed: the SFTTrainer tests need it "
                              "(pip install -e '.[test]')")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install "
                                   "-e '.[test]')")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(TINY["vocab_size"] - 3)]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[j] for j in torch.randint(0, len(words), (int(n),), generator=g))
             for n in torch.randint(5, 20, (8,), generator=g)]
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                         max_length=24, use_cpu=True, report_to=[], save_strategy="no",
                         logging_steps=1, learning_rate=1e-3, **config)
    return trl, datasets.Dataset.from_dict({"text": texts}), tok, args


def test_sft_trainer_with_its_gradient_checkpointing_runs_min_memory(tmp_path):
    trl, data, tok, args = _sft_setup(tmp_path)
    model = ckpt_ext.patch_llama(make_model())
    with pytest.warns(UserWarning, match="'min_memory'"):
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        trainer.train()
    assert args.gradient_checkpointing  # TRL's default
    assert fused_calls(model) == 2 * TINY["num_hidden_layers"]


def _sft_lora_train(tmp_path, sft_config=None, **patch_kwargs):
    """Two SFTTrainer steps of a patched tiny model with LoRA r 4 (dropout 0.05) on every
    projection; returns (trainer, the transformers model inside PEFT), its layers fused in
    both steps."""
    peft = _peft()
    trl, data, tok, args = _sft_setup(tmp_path, **(sft_config or {}))
    model = ckpt_ext.patch_llama(make_model(), **patch_kwargs)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=ALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data,
                                 processing_class=tok, peft_config=config)
        trainer.train()
    inner = trainer.model.get_base_model()
    assert sum(layer.forward.calls["fused"] for layer in inner.model.layers) == \
        2 * TINY["num_hidden_layers"]
    return trainer, inner


def test_sft_trainer_lora_runs_the_fused_op(tmp_path):
    _, inner = _sft_lora_train(tmp_path, dict(bf16=True))
    assert all(not p.requires_grad for n, p in inner.named_parameters() if "lora_" not in n)


def test_sft_trainer_lora_with_offload_trains_as_without(tmp_path):
    """TRL's SFTTrainer (its gradient checkpointing taken over: min_memory) with LoRA and
    lora_dropout, patched with offload="cpu": the layer inputs went through the host pool, and
    the logged losses and the trained adapters equal the run without offload bit for bit (on
    the CPU the copies are exact)."""
    results = {}
    for offload in (None, "cpu"):
        trainer, inner = _sft_lora_train(tmp_path / str(offload), offload=offload)
        if offload:
            stats = inner.model.layers[0].forward.shared.offloader.stats()
            assert stats["host_allocations"] > 0 and stats["live_layers"] == 0, stats
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        adapters = {n: p.detach().clone() for n, p in inner.named_parameters() if "lora_" in n}
        results[offload] = losses, adapters
    (loss0, ad0), (loss1, ad1) = results[None], results["cpu"]
    assert len(loss0) == 2 and loss1 == loss0
    assert ad0.keys() == ad1.keys() and len(ad0) > 0
    for n in ad0:
        assert torch.equal(ad1[n], ad0[n]), n


def test_sft_trainer_packed_patched_holds_no_more_than_unpatched(tmp_path):
    """TRL packing (padding-free: position_ids restart per document), fp32, TRL's gradient
    checkpointing on: the patched model's step peaks no higher than the unpatched one's, and
    saves no more. The fused layers keep the cos/sin tables as saved tensors; HF's checkpoint
    keeps them too, in the kwargs of its recompute (alive, but out of sight of saved-tensor
    hooks), so they are added to the unpatched side."""
    def batch_and_model(patched):
        trl, data, tok, args = _sft_setup(tmp_path, packing=True, padding_free=True)
        model = make_model()
        if patched:
            ckpt_ext.patch_llama(model, "min_memory")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data,
                                     processing_class=tok)
        batch = next(iter(trainer.get_train_dataloader()))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False})   # as trainer.train() does with TRL's default
        model.train()
        return trainer, batch

    measures = {}
    for patched in (False, True):
        trainer, batch = batch_and_model(patched)
        assert "attention_mask" not in batch and batch["position_ids"].shape[0] == 1
        step = lambda: trainer.compute_loss(trainer.model, dict(batch))  # noqa: E731
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = ckpt_ext.saved_activation_bytes(step)
            step().backward()                                 # gradients exist, as in training
            peak = ckpt_ext.peak_memory_bytes(lambda: step().backward())
        measures[patched] = saved, peak
        if patched:
            assert fused_calls(trainer.model) == 3 * TINY["num_hidden_layers"]
            T, D = batch["input_ids"].numel(), TINY["head_dim"]
            cos_sin = 2 * 4 * T * D
    (saved_hf, peak_hf), (saved, peak) = measures[False], measures[True]
    assert saved <= saved_hf + cos_sin, (saved, saved_hf, cos_sin)
    assert peak <= peak_hf, (peak, peak_hf)


def test_compiled_packed_batch_matches_eager():
    torch._dynamo.reset()
    lengths = [6, 1, 10]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    model = ckpt_ext.patch_llama(make_model(), "balanced")
    ref = make_model()

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                               for n, p in m.named_parameters()}
    loss_r, grads_r = step(ref)
    compiled = torch.compile(model, backend="aot_eager")
    loss_c, grads_c = step(compiled)
    saved = lambda m: ckpt_ext.saved_activation_bytes(  # noqa: E731
        lambda: m(input_ids=ids, position_ids=pos, labels=ids).loss)
    assert saved(compiled) < 0.7 * saved(ref)  # the fused layers (and head) ran
    torch.testing.assert_close(loss_c, loss_r, rtol=1e-5, atol=1e-6)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_through_the_triton_kernels():
    """The same exactness with the Triton kernels (interpreter on CPU): the adapters' rank-r
    terms inside the SwiGLU and attention tiles."""
    peft = _peft()
    from ckpt_ext import use_triton
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (the "
                    "conftest sets it on machines without a GPU)")
    ids, mask, labels = make_batch()
    base = make_model("llama")
    torch.manual_seed(0)
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=ALL, init_lora_weights=False))
    model = copy.deepcopy(ref)
    ckpt_ext.patch_llama(model, "balanced")
    loss_r, grads_r = loss_and_grads(ref, ids, mask, labels)
    with use_triton("cpu"):
        loss, grads = loss_and_grads(model, ids, mask, labels)
    torch.testing.assert_close(loss, loss_r, rtol=1e-4, atol=1e-5)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, rtol=2e-3, atol=1e-5, msg=name)
