"""Multimodal models whose language model is a supported family, patched: the decoder layers
are the language model's. Gemma 3 (``Gemma3ForConditionalGeneration``, the gemma-3-4b/12b/27b
checkpoints): text-only batches run the fused layers and head, a batch with image tokens (which
attend bidirectionally) runs HF's layers, with the reason. LLaVA and Mistral 3: images are
embeddings in the causal text stream, so batches with images run fused too; so are Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's, whose M-RoPE reaches the layers as composed cos/sin tables.
Compared with the same tiny model unpatched: loss and every gradient."""
import copy
import warnings

import pytest
import torch

import ckpt_ext

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: these tests need it "
    "(pip install -e '.[test]')")
Gemma3Config = getattr(transformers, "Gemma3Config", None)
if Gemma3Config is None:
    pytest.skip(f"transformers {transformers.__version__} has no Gemma 3", allow_module_level=True)
from transformers import (Gemma3ForConditionalGeneration, LlavaConfig,  # noqa: E402
                          LlavaForConditionalGeneration, Mistral3Config,
                          Mistral3ForConditionalGeneration)

from hf_fixtures import assert_compiled_replays_eager  # noqa: E402

V, IMAGE, B, S = 300, 299, 2, 17
TOL = dict(rtol=1e-4, atol=1e-5)


def seeded(cls, cfg, seed, norm_center=1.0, impl="sdpa"):
    """``cls`` from ``cfg`` with its init seeded, its weights moved off that init so every norm
    and projection matters: norms ``norm_center`` + 0.3 noise (Gemma stores w - 1, so 0), the
    rest + 0.05 noise."""
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=impl)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(norm_center + 0.3 * noise) if "norm" in name else p.add_(0.05 * noise)
    return model


def make_model(seed=0, impl="sdpa", **text):
    """A tiny Gemma3ForConditionalGeneration (a 1-layer SigLIP tower, 4 tokens per image), its
    weights moved off their init so every norm and projection matters."""
    cfg = Gemma3Config(
        text_config=dict(dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, vocab_size=V, pad_token_id=0,
            query_pre_attn_scalar=24, sliding_window=6, rms_norm_eps=1e-5, use_cache=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]), **text),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=7),
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_index=297, eoi_token_index=298)
    return seeded(Gemma3ForConditionalGeneration, cfg, seed, norm_center=0.0, impl=impl)


def text_batch(seed=1, pad=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 290, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask, ids.masked_fill(mask == 0, -100)


def image_batch(seed=2):
    """One row with an image: 4 image tokens (token_type_ids 1) at positions 3-6."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 290, (1, S), generator=g)
    ids[0, 3:7] = IMAGE
    return dict(input_ids=ids, pixel_values=torch.randn(1, 3, 28, 28, generator=g),
                token_type_ids=(ids == IMAGE).long(), labels=ids.masked_fill(ids == IMAGE, -100))


def step(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want):
    (out, grads), (out_r, grads_r) = got, want
    torch.testing.assert_close(out.loss, out_r.loss, **TOL)
    assert set(grads) == set(grads_r)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=name)


def layer_calls(model, key="fused"):
    return [layer.forward.calls[key] for layer in model.model.language_model.layers]


def test_multimodal_model_types_are_supported():
    assert {"gemma3", "llava", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"} <= \
        set(ckpt_ext.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("types", [None, "zeros"], ids=["no-token-types", "text-token-types"])
@pytest.mark.parametrize("policy", ["fast", "balanced", "min_memory"])
def test_text_batches_run_fused_layers_and_head(policy, types):
    """Left-padded text, with or without the all-zero token_type_ids a processor gives text:
    every layer and the head run fused, and the loss and every gradient (the vision tower's
    get none) equal the unpatched model's; the step keeps less."""
    ref = make_model()
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), policy)
    ids, mask, labels = text_batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if types == "zeros":
        inputs["token_type_ids"] = torch.zeros_like(ids)
    got = step(model, **inputs)
    assert got[0].logits is None and model.forward.calls == {"fused": 1, "hf": 0}
    assert layer_calls(model) == [1, 1, 1]
    assert_same(got, step(ref, **inputs))
    run = lambda m: m(**inputs).loss  # noqa: E731
    assert ckpt_ext.saved_activation_bytes(run, model) < \
        0.5 * ckpt_ext.saved_activation_bytes(run, ref)


def test_image_batches_run_hf_layers_with_the_reason():
    """Image tokens attend bidirectionally: a batch with pixel_values, or with token_type_ids
    that mark image tokens, runs HF's layers (warned, with the reason) and equals HF; the
    next text batch is fused again."""
    ref = make_model()
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    inputs = image_batch()
    with pytest.warns(UserWarning, match="the batch has images"):
        got = step(model, **inputs)
    assert_same(got, step(ref, **inputs))
    assert layer_calls(model) == [0, 0, 0]
    no_pixels = {k: v for k, v in inputs.items() if k != "pixel_values"}
    with pytest.warns(UserWarning, match="token_type_ids marks image tokens"):
        got = step(model, **no_pixels)
    assert_same(got, step(ref, **no_pixels))
    assert layer_calls(model) == [0, 0, 0]
    ids, mask, labels = text_batch()
    assert_same(step(model, input_ids=ids, attention_mask=mask, labels=labels),
                step(ref, input_ids=ids, attention_mask=mask, labels=labels))
    assert layer_calls(model) == [1, 1, 1]


def test_eval_generation_and_unpatch():
    """Eval and generation run HF's head and return logits as HF's; unpatching removes the
    hook from the multimodal model, the layers' and the final norm's forwards."""
    ref = make_model()
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory")
    ids, mask, _ = text_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   ref(input_ids=ids, attention_mask=mask).logits, **TOL)
    assert torch.equal(model.generate(ids[1:, :6], max_new_tokens=3, do_sample=False),
                       ref.generate(ids[1:, :6], max_new_tokens=3, do_sample=False))
    assert model.model._forward_pre_hooks
    ckpt_ext.unpatch_llama(model)
    assert not model.model._forward_pre_hooks
    assert "forward" not in model.__dict__
    assert "forward" not in model.model.language_model.norm.__dict__
    assert all("forward" not in layer.__dict__ for layer in model.model.language_model.layers)


def test_a_final_softcap_in_the_text_config_keeps_hf_head():
    """This forward applies no final soft-cap; a text config that sets one keeps HF's head
    (whether the forward applies it depends on the transformers version), layers fused."""
    ref = make_model(final_logit_softcapping=2.0)
    with pytest.warns(UserWarning, match="LM head is not fused: text_config.final_logit_"):
        model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    ids, mask, labels = text_batch()
    got = step(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert got[0].logits is not None and layer_calls(model) == [1, 1, 1]
    assert_same(got, step(ref, input_ids=ids, attention_mask=mask, labels=labels))


def test_peft_lora_on_the_language_model_is_fused_and_exact():
    """PEFT LoRA on the language model's projections (the usual text fine-tune of a Gemma 3
    checkpoint): fused, and the adapters' gradients equal the unpatched PEFT model's."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    ref = peft.get_peft_model(make_model(), lora)
    with torch.no_grad():   # B starts at zero: move it so that A's gradient is not zero
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    ids, mask, labels = text_batch()
    got = step(model, input_ids=ids, attention_mask=mask, labels=labels)
    want = step(ref, input_ids=ids, attention_mask=mask, labels=labels)
    assert len(got[1]) == 2 * 7 * 3   # A and B of 7 projections in 3 layers, nothing else
    assert_same(got, want)
    assert [layer.forward.calls["fused"]
            for layer in model.base_model.model.model.language_model.layers] == [1, 1, 1]


def test_compiled_text_batches_have_no_graph_breaks():
    model = ckpt_ext.patch_llama(make_model(), "balanced")

    def loss_and_grads(m, ids, mask, labels):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                               for n, p in m.named_parameters() if p.grad is not None}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_compiled_replays_eager(model, loss_and_grads, text_batch(),
                                      dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=1e-6))


# ---- LLaVA and Mistral 3: images in the causal stream -------------------------------------------
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, vocab_size=V, pad_token_id=0, rms_norm_eps=1e-5,
            use_cache=False)


def causal_vlm(kind, text_type, seed=0):
    """A tiny LLaVA (CLIP tower, 4 patches per 28-pixel image) or Mistral 3 (Pixtral tower,
    16 patches merged 2x2 into 4 tokens) around a ``text_type`` language model."""
    text = dict(TEXT, model_type=text_type)
    if kind == "llava":
        cls, cfg = LlavaForConditionalGeneration, LlavaConfig(
            text_config=text, vision_config=dict(
                model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
                num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                projection_dim=32), image_token_index=IMAGE, vision_feature_layer=-1)
    else:
        cls, cfg = Mistral3ForConditionalGeneration, Mistral3Config(
            text_config=text, vision_config=dict(
                model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=7, head_dim=16),
            image_token_index=IMAGE, spatial_merge_size=2, vision_feature_layer=-1)
    return seeded(cls, cfg, seed)


def causal_vlm_batch(kind, seed=3):
    """Two rows: the first with an image (4 image tokens at 3-6) and right padding, the second
    text only; labels ignore the image tokens and the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 290, (2, S), generator=g)
    ids[0, 3:7] = IMAGE
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, -3:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    inputs = dict(input_ids=ids, attention_mask=mask, use_cache=False,
                  pixel_values=torch.randn(1, 3, 28, 28, generator=g),
                  labels=ids.masked_fill((ids == IMAGE) | (mask == 0), -100))
    if kind == "mistral3":
        inputs["image_sizes"] = torch.tensor([[28, 28]])
    return inputs


@pytest.mark.parametrize("policy", ["fast", "min_memory"])
@pytest.mark.parametrize("kind,text_type", [("llava", "llama"), ("llava", "qwen2"),
                                            ("mistral3", "mistral")])
def test_causal_vlm_batches_with_images_run_fused(kind, text_type, policy):
    """The vision tower runs as HF's; the language model's layers and the head are fused on a
    batch with an image and padding, and the loss and every gradient (the tower's included)
    equal the unpatched model's; unpatching restores HF's forwards."""
    ref = causal_vlm(kind, text_type)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), policy)
    inputs = causal_vlm_batch(kind)
    got = step(model, **inputs)
    assert got[0].logits is None and model.forward.calls == {"fused": 1, "hf": 0}
    assert [layer.forward.calls["fused"] for layer in model.model.language_model.layers] == [1, 1]
    want = step(ref, **inputs)
    assert any("vision_tower" in name for name in want[1])
    assert_same(got, want)
    ckpt_ext.unpatch_llama(model)
    assert not model.model._forward_pre_hooks and "forward" not in model.__dict__


def test_multimodal_text_stack_must_be_a_supported_family():
    model = causal_vlm("llava", "llama")
    model.config.text_config.model_type = "falcon"
    with pytest.raises(ValueError, match="text config of model_type 'falcon' is not supported"):
        ckpt_ext.patch_llama(model)
    assert "forward" not in model.__dict__


def test_a_cache_on_the_text_config_names_it():
    """transformers fills a KV cache when the text config says use_cache: the layers run HF's
    forward, and the warning names the config that decides it."""
    model = causal_vlm("llava", "llama")
    model.config.text_config.use_cache = True
    ckpt_ext.patch_llama(model, "balanced")
    inputs = {k: v for k, v in causal_vlm_batch("llava").items() if k != "use_cache"}
    with pytest.warns(UserWarning, match=r"model.config.text_config.use_cache"):
        model(**inputs)
    assert [layer.forward.calls["fused"] for layer in model.model.language_model.layers] == [0, 0]


# ---- Qwen2-VL, Qwen2.5-VL and Qwen3-VL: M-RoPE, images in the causal stream ----------------------
QWEN_VL = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
           "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def qwen_vl(kind, seed=0):
    """A tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL: a small vision tower, 16 patches of a
    56-pixel image merged 2x2 into 4 tokens; M-RoPE sections 2/3/3 of the 8 rotary pairs of a
    16-dim head (Qwen3-VL: interleaved, and deepstack features from both vision blocks added
    after the first two text layers)."""
    text = dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           mrope_section=[2, 3, 3],
                                           mrope_interleaved=kind == "qwen3_vl"))
    if kind != "qwen3_vl":
        text.pop("head_dim")
    ids = dict(image_token_id=IMAGE, video_token_id=298, vision_start_token_id=297,
               vision_end_token_id=296)
    if kind == "qwen3_vl":
        cls, cfg = transformers.Qwen3VLForConditionalGeneration, transformers.Qwen3VLConfig(
            text_config=text, vision_config=dict(
                depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                num_position_embeddings=16, deepstack_visual_indexes=[0, 1]), **ids)
    elif kind == "qwen2_5_vl":
        cls, cfg = transformers.Qwen2_5_VLForConditionalGeneration, transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                fullatt_block_indexes=[0]), **ids)
    else:
        cls, cfg = transformers.Qwen2VLForConditionalGeneration, transformers.Qwen2VLConfig(
            text_config=text, vision_config=dict(
                depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2), **ids)
    return seeded(cls, cfg, seed)


def qwen_vl_batch(seed=4):
    """Row 0: vision start, 4 image tokens, vision end; row 1 left-padded text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 290, (2, S), generator=g)
    ids[0, 2], ids[0, 3:7], ids[0, 7] = 297, IMAGE, 296
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return dict(input_ids=ids, attention_mask=mask, use_cache=False,
                pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == IMAGE).int(),
                labels=ids.masked_fill((ids >= 296) | (mask == 0), -100))


@pytest.mark.parametrize("policy", ["fast", "min_memory"])
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_batches_with_images_run_fused(kind, policy):
    """M-RoPE's per-token cos/sin (the image tokens' positions follow their grid) reach the
    fused layers as the rotary embedding composes them; loss and every gradient as HF's."""
    cls = QWEN_VL[kind]
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    ref = qwen_vl(kind)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), policy)
    inputs = qwen_vl_batch()
    got = step(model, **inputs)
    assert got[0].logits is None and model.forward.calls == {"fused": 1, "hf": 0}
    assert [layer.forward.calls["fused"] for layer in model.model.language_model.layers] == [1, 1]
    assert_same(got, step(ref, **inputs))


@pytest.mark.parametrize("rows", [4, 2], ids=["text-row", "2d"])
def test_qwen_vl_packed_positions_follow_transformers(rows):
    """Without an attention mask, transformers reads packed sequences from the text positions
    (row 0 of (4, B, S) position_ids) and from nothing else: 2-D position_ids that restart are
    one causal sequence to it. The fused layers read them the same way (segments or none)."""
    if not hasattr(transformers, QWEN_VL["qwen2_5_vl"]):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen2.5-VL")
    ref = qwen_vl("qwen2_5_vl")
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 290, (1, S), generator=g)
    text = torch.cat([torch.arange(7), torch.arange(S - 7)])[None]   # two documents
    position_ids = text.expand(4, 1, S) if rows == 4 else text
    inputs = dict(input_ids=ids, position_ids=position_ids, labels=ids, use_cache=False)
    got, want = step(model, **inputs), step(ref, **inputs)
    assert_same(got, want)
    assert [layer.forward.calls["fused"] for layer in model.model.language_model.layers] == [1, 1]
    one = step(ref, input_ids=ids, labels=ids, use_cache=False,
               position_ids=text.expand(4, 1, S) if rows == 2 else text)
    # the two readings differ, so the comparison above can fail
    assert (one[0].loss - want[0].loss).abs() > 1e-4


@pytest.mark.parametrize("options", [dict(policy="auto", activation_budget="1GiB"),
                                     dict(policy="min_memory", offload="cpu")],
                         ids=["auto", "offload"])
def test_auto_policy_and_offload_read_the_language_model(options):
    """policy="auto" sizes the language model's layers from its own config; offload keeps
    their saved tensors in host memory; both fused and exact on a batch with an image."""
    qwen3 = hasattr(transformers, QWEN_VL["qwen3_vl"])
    ref = qwen_vl("qwen3_vl") if qwen3 else causal_vlm("llava", "llama")
    inputs = qwen_vl_batch() if qwen3 else causal_vlm_batch("llava")
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), **options)
    assert_same(step(model, **inputs), step(ref, **inputs))
    layers = model.model.language_model.layers
    assert [layer.forward.calls["fused"] for layer in layers] == [1, 1]
    off = layers[0].forward.shared.offloader
    if "offload" in options:   # the saved tensors went through the host pool and came back
        assert off.stats()["host_allocations"] > 0 and off.stats()["host_in_use"] == 0
    else:
        assert off is None
