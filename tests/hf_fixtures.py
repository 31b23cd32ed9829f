"""The tiny Hugging Face models and batches that the HF tests build (transformers required).

Each test module keeps its own config values and names them here: ``tiny_model`` makes a model
of a family from them, seeded; ``padded_batch`` a left-padded batch with its labels;
``assert_compiled_replays_eager`` the torch.compile check of a patched model. ``FAMILIES`` holds
one tiny configuration of each supported family (and of the variants that take another path),
which ``make_model`` builds with perturbed weights and ``make_batch`` feeds.
"""
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def tiny_model(family="llama", config=None, *, impl="sdpa", cls=AutoModelForCausalLM, seed=0,
               perturb=False, bias_noise=0.1):
    """``cls`` of ``family`` from the ``config`` values, its init seeded with ``seed``. With
    ``perturb`` the weights move off that init, so that norms, biases and projections all
    matter: norm weights 1 + 0.3 noise, biases ``bias_noise`` * noise (None: as the
    projections), the rest + 0.05 noise. Skips when transformers has no such family."""
    try:
        cfg = AutoConfig.for_model(family, **(config or {}))
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no {family} models")
    torch.manual_seed(seed)
    model = cls.from_config(cfg, attn_implementation=impl)
    if perturb:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * noise)
                elif bias_noise is not None and name.endswith("bias"):
                    p.copy_(bias_noise * noise)
                else:
                    p.add_(0.05 * noise)
    return model


# ---- one tiny model of each supported family ---------------------------------------------

TINY = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=172, vocab_size=128, pad_token_id=0,
            rms_norm_eps=1e-5)
# Llama with every bias it can have (o_proj included); Qwen2 has q/k/v biases and an o_proj
# without; Qwen3 has q_norm/k_norm; Mistral's default sliding window (4096) is longer than S;
# Ministral interleaves sliding and full layers, here with a window shorter than S; SmolLM3's
# middle layer applies no RoPE; Granite scales residual branches, scores and embeddings; OLMo-2
# norms each sublayer's output instead of its input, and q/k over the whole projection; OLMo-3
# adds interleaved sliding windows; Gemma multiplies its norms by (1 + w) and gates with
# GELU-tanh; Gemma 3 adds norms after both sublayers, per-head q/k norms, its own attention
# scale and a local RoPE on its sliding layers; Phi-3 fuses q/k/v into qkv_proj and gate/up
# into gate_up_proj, and phi3_partial (Phi-4-mini's partial_rotary_factor) rotates only the
# first half of each head, and phi3_longrope (Phi-3-128k's LongRoPE, S past its original 8
# positions: the long factors and a cos/sin scale of sqrt(2)) rescales the rotary frequencies;
# Gemma 2 soft-caps its attention scores (eager attention only); EXAONE 4.0 norms each
# sublayer's output (LLaMA's rounding) and q/k per head, and a hybrid one (a sliding window)
# applies no RoPE on its full-attention layers (exaone4; exaone4_global: no window, RoPE on
# every layer); GLM, GLM-4 and Helium rotate interleaved pairs (GLM: the first half of each
# head, glm_full_rotary all of it), GLM-4 norms both sublayers' inputs and outputs, and
# GLM's MLP is one gate_up_proj; ERNIE 4.5 rotates interleaved pairs too, from float32
# tables, with biases on every projection; Hunyuan norms q and k per head after RoPE;
# HyperCLOVA X norms both sublayers' inputs and outputs (Peri-LN; without use_post_norm its
# output norms are nn.Identity) with Granite's multipliers; CWM interleaves sliding layers;
# VaultGemma is Gemma 2 without its output norms.
FAMILIES = {"llama": dict(attention_bias=True, mlp_bias=True), "mistral": {}, "qwen2": {},
            "qwen3": {}, "ministral": dict(sliding_window=6, layer_types=[
                "sliding_attention", "full_attention", "sliding_attention"]),
            "smollm3": dict(no_rope_layers=[1, 0, 1]),
            "granite": dict(residual_multiplier=0.6, attention_multiplier=0.2,
                            embedding_multiplier=3.0, logits_scaling=1.0),
            "olmo2": {}, "olmo3": dict(sliding_window=6, layer_types=[
                "sliding_attention", "full_attention", "sliding_attention"]),
            "gemma": {}, "gemma3_text": dict(query_pre_attn_scalar=24, sliding_window=6,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention"]),
            "gemma2": dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                           final_logit_softcapping=3.0, sliding_window=6,
                           layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention"]),
            "phi3": {},
            "phi3_partial": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      partial_rotary_factor=0.5)),
            "phi3_longrope": dict(max_position_embeddings=64, original_max_position_embeddings=8,
                                  rope_parameters=dict(
                                      rope_type="longrope", rope_theta=10000.0,
                                      original_max_position_embeddings=8,
                                      short_factor=[1.0 + 0.1 * i for i in range(8)],
                                      long_factor=[1.5 + 0.2 * i for i in range(8)])),
            "exaone4": dict(sliding_window=6, layer_types=[
                "sliding_attention", "full_attention", "sliding_attention"]),
            "exaone4_global": dict(sliding_window=None, layer_types=["full_attention"] * 3),
            "glm": {}, "glm4": {}, "helium": dict(attention_bias=True, mlp_bias=True),
            "glm_full_rotary": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                         partial_rotary_factor=1.0)),
            "ernie4_5": dict(use_bias=True),
            "hunyuan_v1_dense": dict(attention_bias=True),
            "hyperclovax": dict(residual_multiplier=0.6, attention_multiplier=0.2,
                                embedding_multiplier=3.0, logits_scaling=0.5),
            "hyperclovax_no_post_norm": dict(use_post_norm=False, residual_multiplier=0.6),
            "cwm": dict(sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                                       "sliding_attention"]),
            "vaultgemma": dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention"])}
# transformers runs these with eager attention only (Gemma 2: its soft-capping); make_model
# builds them eager whatever impl is asked.
EAGER_ONLY = {"gemma2", "vaultgemma"}
# The model_type of a FAMILIES entry that is a variant of another family.
MODEL_TYPE = {"phi3_partial": "phi3", "phi3_longrope": "phi3", "exaone4_global": "exaone4",
              "glm_full_rotary": "glm", "hyperclovax_no_post_norm": "hyperclovax"}
B, S, PAD = 2, 17, 5


def make_model(family="llama", impl="sdpa", cls=AutoModelForCausalLM, seed=0, **overrides):
    return tiny_model(MODEL_TYPE.get(family, family), {**TINY, **FAMILIES[family], **overrides},
                      impl="eager" if family in EAGER_ONLY else impl, cls=cls, seed=seed,
                      perturb=True)


def make_batch(pad: bool, seed=1, s=S):
    if not pad:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, TINY["vocab_size"], (B, s), generator=g)
        return ids, None, ids.clone()
    return padded_batch(TINY["vocab_size"], B, s, pad=PAD, seed=seed)


def padded_batch(vocab, b, s, *, pad_row=0, pad=5, seed=1, shift=True):
    """(input_ids, attention_mask, labels), each (b, s): ids drawn from [1, vocab) with
    ``seed``, row ``pad_row`` left-padded by ``pad`` tokens (id 0, mask 0, label -100); with
    ``shift`` also the label that a padded position predicts is -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[pad_row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if shift:
        labels[:, 1:][mask[:, :-1] == 0] = -100  # predicted from a padded position
    return ids.masked_fill(mask == 0, 0), mask, labels


def assert_compiled_replays_eager(model, loss_and_grads, batch, loss_tol, grad_tol, **call):
    """torch.compile of a patched model: no graph break (dynamo's explain of a forward with
    ``batch`` = (ids, mask, labels) and the keywords ``call``), and under aot_eager the eager
    loss (``loss_tol``) and every gradient (``grad_tol``) for the same torch.manual_seed (LoRA
    dropout seeds are drawn from it). ``loss_and_grads(model, ids, mask, labels)`` -> (loss,
    {name: grad}) with compile's "_orig_mod." prefix removed."""
    ids, mask, labels = batch
    explain = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, labels=labels,
                                           **call)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    torch.manual_seed(7)
    loss_e, grads_e = loss_and_grads(model, ids, mask, labels)
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(7)
    loss_c, grads_c = loss_and_grads(compiled, ids, mask, labels)
    torch.testing.assert_close(loss_c, loss_e, **loss_tol)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, **grad_tol, msg=name)


def llama_from_dims(c, impl="sdpa"):
    """A randomly initialised LlamaForCausalLM in train mode with the dims of ``c`` (keys H, I,
    L, heads, kv, D, V; seed 0), for the tests that measure a step's peak."""
    cfg = transformers.LlamaConfig(
        hidden_size=c["H"], intermediate_size=c["I"], num_hidden_layers=c["L"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv"], head_dim=c["D"],
        vocab_size=c["V"], rms_norm_eps=1e-5, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    model.train()
    return model
