"""The patched *ForCausalLM's LM head and loss (no logits), and policy="auto" with a budget."""
import copy

import pytest
import torch

import ckpt_ext
from ckpt_ext.hf.lm_head import FinalNorm
from ckpt_ext.presets import per_token_bytes

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: these tests need it "
    "(pip install -e '.[test]')")
from hf_fixtures import padded_batch, tiny_model  # noqa: E402

V, B, S = 311, 2, 19


def make_model(seed=0, **overrides):
    return tiny_model("llama", {**dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=V, pad_token_id=0, use_cache=False), **overrides},
        seed=seed)


def make_batch(seed=1):
    return padded_batch(V, B, S, pad_row=1, pad=5, seed=seed, shift=False)


def step(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("extra", ["none", "num_items", "shift_labels"])
def test_fused_head_matches_hf_without_logits(tied, extra):
    ref = make_model(tie_word_embeddings=tied)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref))
    ids, mask, labels = make_batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if extra == "num_items":
        inputs["num_items_in_batch"] = torch.tensor(23)
    elif extra == "shift_labels":
        inputs["shift_labels"] = torch.roll(labels, -3, dims=1)
    out_r, grads_r = step(ref, **inputs)
    out, grads = step(model, **inputs)
    assert out.logits is None and model.forward.calls["fused"] == 1
    torch.testing.assert_close(out.loss, out_r.loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(grads_r)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_eval_generation_and_no_labels_return_logits():
    ref = make_model()
    model = ckpt_ext.patch_llama(copy.deepcopy(ref))
    ids, mask, labels = make_batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want.logits)
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (B, S, V)
    assert model.forward.calls == {"fused": 0, "hf": 2}
    assert torch.equal(model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False),
                       ref.generate(ids[:1, :5], max_new_tokens=3, do_sample=False))
    ckpt_ext.unpatch_llama(model)
    assert "forward" not in model.__dict__


def test_no_logits_sized_tensor_is_saved():
    ref = make_model()
    ids, mask, labels = make_batch()
    run = lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    plain = ckpt_ext.saved_activation_bytes(run, ref)
    head_off = ckpt_ext.saved_activation_bytes(
        run, ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory", fuse_lm_head=False))
    fused = ckpt_ext.saved_activation_bytes(
        run, ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory"))
    # HF's head keeps the fp32 log-softmax (4V per token); the fused one a 4-byte lse instead
    # (plus an 8-byte divisor once)
    assert head_off - fused >= B * S * (4 * V - 4) - 8, (head_off, fused)
    assert fused < plain


def family_model(family, seed=0):
    """make_model's tiny shape in another family (Gemma 2: eager attention, its soft-cap)."""
    return tiny_model(family, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=V, pad_token_id=0, use_cache=False),
        impl="eager" if family == "gemma2" else "sdpa", seed=seed, perturb=True)


# Gemma's final norm multiplies by 1 + w in float32 and casts last, OLMo-2's by w and casts
# last, EXAONE 4.0's as LLaMA's, Helium's as OLMo-2's: the norm runs inside the head with the
# family's rounding
@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2", "gemma3_text", "olmo2",
                                    "exaone4", "helium"])
def test_final_norm_runs_inside_the_head_and_keeps_only_its_input(family):
    """The bare model's final RMSNorm runs inside the head op: the step keeps the pre-norm
    hidden state only, where HF's norm before the fused head keeps it, its normalised rows and
    the normed rows the head reads. Same loss and gradients; unpatching restores HF's norm."""
    ref = make_model() if family == "llama" else family_model(family)
    ids, mask, labels = make_batch()
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory")
    assert isinstance(model.model.norm.__dict__.get("forward"), FinalNorm)
    run = lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    with torch.profiler.profile() as prof:
        out, grads = step(model, input_ids=ids, attention_mask=mask, labels=labels)
    names = {e.name for e in prof.events()}
    assert "ckpt_ext::rms_norm_linear_cross_entropy_fwd" in names
    assert "ckpt_ext::rms_norm_linear_cross_entropy_bwd" in names
    out_r, grads_r = step(ref, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, out_r.loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(grads_r)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # Gemma's offset matters: the norm with LLaMA's rounding gives another loss (OLMo-2's cast
    # order shows only in half precision: test_linear_cross_entropy's bf16 cases)
    if family.startswith("gemma"):
        llama_rounding = copy.deepcopy(model)
        final = llama_rounding.model.norm.forward
        final.offset, final.cast_last = 0.0, False
        assert (run(llama_rounding) - out_r.loss).abs() > 1e-4

    inside = ckpt_ext.saved_activation_bytes(run, model)
    outside = copy.deepcopy(model)
    del outside.model.norm.__dict__["forward"]      # HF's norm, then the fused head
    H = ref.config.hidden_size
    assert outside.forward.calls["fused"] >= 1
    assert ckpt_ext.saved_activation_bytes(run, outside) - inside >= 2 * 4 * B * S * H
    ckpt_ext.unpatch_llama(model)
    assert "forward" not in model.model.norm.__dict__


def test_auto_fits_the_budget_and_more_budget_never_recomputes_more():
    ref = make_model()
    ids, mask, labels = make_batch()
    dims = dict(H=64, Hq=4, Hkv=2, D=16, I=96, dtype=torch.float32)
    per_layer = {p: B * S * per_token_bytes(p, **dims) for p in ("fast", "balanced",
                                                                 "min_memory")}
    # without a budget the device's memory is the budget, on CUDA only: a CPU forward refuses
    unbounded = ckpt_ext.patch_llama(copy.deepcopy(ref), "auto")
    with pytest.raises(ValueError, match="policy='auto' on the CPU .* needs activation_budget"):
        unbounded(input_ids=ids, attention_mask=mask, labels=labels)
    small = ckpt_ext.patch_llama(copy.deepcopy(ref), "auto",
                                 activation_budget=2 * per_layer["min_memory"] - 1)
    with pytest.raises(ValueError, match=str(2 * per_layer["min_memory"])):
        small(input_ids=ids, attention_mask=mask, labels=labels)
    chosen = []
    for budget in (2 * per_layer["min_memory"], per_layer["balanced"] + per_layer["min_memory"],
                   2 * per_layer["fast"]):
        model = ckpt_ext.patch_llama(copy.deepcopy(ref), "auto", activation_budget=budget)
        fused_head = ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory")
        run = lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
        layers_bytes = ckpt_ext.saved_activation_bytes(run, model) - \
            ckpt_ext.saved_activation_bytes(run, fused_head) + 2 * per_layer["min_memory"]
        assert layers_bytes <= budget, (layers_bytes, budget)
        chosen.append(layers_bytes)
        out, grads = step(model, input_ids=ids, attention_mask=mask, labels=labels)
        out_r, grads_r = step(ref, input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(out.loss, out_r.loss, rtol=1e-5, atol=1e-6)
    assert chosen == sorted(chosen)  # more budget: more bytes kept, never less


def test_auto_under_compile_has_no_graph_breaks():
    torch._dynamo.reset()
    model = ckpt_ext.patch_llama(make_model(), "auto", activation_budget="10MiB")
    ids, mask, labels = make_batch()
    explain = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, labels=labels)
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.parametrize("n", [0, "tensor"])
def test_num_items_in_batch_zero_through_a_patched_model(n):
    """A patched model's training loss with num_items_in_batch == 0 is 0 with zero gradients
    (the op's documented value), not the summed loss."""
    model = ckpt_ext.patch_llama(make_model(seed=int(torch.randint(2**31, ()))))
    ids, mask, labels = make_batch(seed=int(torch.randint(2**31, ())))
    out, grads = step(model, input_ids=ids, attention_mask=mask, labels=labels,
                      num_items_in_batch=torch.tensor(0) if n == "tensor" else n)
    assert model.forward.calls["fused"] == 1
    assert out.loss.shape == () and out.loss.item() == 0.0
    assert grads and all((g == 0).all() for g in grads.values())
    out, grads = step(model, input_ids=ids, attention_mask=mask, labels=labels,
                      num_items_in_batch=7)
    assert out.loss.item() > 0 and any((g != 0).any() for g in grads.values())


# ---- heads that transform the logits: Granite's logits_scaling, Gemma 2's final soft-cap ----
def fused_head(model):
    """The model with its head fused: through patch_llama where its family is supported,
    else (a family patch_llama does not take yet) with the fused forward set directly, as
    patch_llama sets it, after the same head_problem check."""
    from ckpt_ext.hf.lm_head import FusedHeadForward, head_problem
    from ckpt_ext.hf.patch import SUPPORTED_MODEL_TYPES

    if model.config.model_type in SUPPORTED_MODEL_TYPES:
        return ckpt_ext.patch_llama(model)
    assert head_problem(model) is None, head_problem(model)
    model.forward = FusedHeadForward(model)
    return model


def check_transformed_head(ref, name, value, none_value):
    """ref patched (fused_head) gives ref's loss and every gradient, with the fused head run;
    the same model with config.<name> = none_value (no transform) gives another loss, so a
    fused head that ignored the transform would fail."""
    model = fused_head(copy.deepcopy(ref))
    ids, mask, labels = make_batch(seed=int(torch.randint(2**31, ())))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    out_r, grads_r = step(ref, **inputs)
    out, grads = step(model, **inputs)
    assert out.logits is None and model.forward.calls == {"fused": 1, "hf": 0}
    torch.testing.assert_close(out.loss, out_r.loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(grads_r)
    for n, g in grads_r.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)
    plain = copy.deepcopy(ref)
    setattr(plain.config, name, none_value)
    assert getattr(ref.config, name) == value
    assert (step(plain, **inputs)[0].loss - out_r.loss).abs() > 1e-3


@pytest.mark.parametrize("family,scaling,extra", [
    ("granite", 4.0, dict(tie_word_embeddings=False)),
    ("granite", 4.0, dict(tie_word_embeddings=True)),
    ("hyperclovax", 0.25, dict(use_post_norm=True)),
    ("hyperclovax", 0.25, dict(use_post_norm=False))],
    ids=["granite-untied", "granite-tied", "hyperclovax-peri-ln", "hyperclovax-no-post-norm"])
def test_logits_scaling_runs_in_the_fused_head(family, scaling, extra):
    """GraniteForCausalLM divides its logits by logits_scaling, HyperCLOVAXForCausalLM
    multiplies them by it (muP): the fused head (with the final norm inside it) applies 1/4
    and 0.25 as the op's logit_scale; HyperCLOVA X's layers fused with Peri-LN or, with
    use_post_norm off, the nn.Identity output norms left out."""
    ref = tiny_model(family, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=V, pad_token_id=0, use_cache=False,
        logits_scaling=scaling, residual_multiplier=0.6, attention_multiplier=0.2,
        embedding_multiplier=3.0, **extra), seed=3, perturb=True)
    check_transformed_head(ref, "logits_scaling", scaling, 1.0)


def gemma2_model(cap, seed=4, family="gemma2"):
    """A tiny Gemma2ForCausalLM (or Gemma3ForCausalLM: family "gemma3_text"; eager attention:
    HF's SDPA has no attention soft-cap) whose logits reach about a unit, so that a cap of 1.5
    bends them."""
    return tiny_model(family, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=V, pad_token_id=0, use_cache=False,
        final_logit_softcapping=cap, sliding_window=8), impl="eager", seed=seed, perturb=True)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_final_softcap_runs_in_the_fused_head(family):
    """Gemma2ForCausalLM and Gemma3ForCausalLM soft-cap their logits
    (final_logit_softcapping): the fused head applies it as the op's softcap, loss and every
    gradient as HF's."""
    ref = gemma2_model(cap=1.5, family=family)
    check_transformed_head(ref, "final_logit_softcapping", 1.5, None)


def test_head_rules_follow_the_forward_the_model_runs():
    """The op's logit_scale / softcap come from the class that defines the model's forward;
    a forward the fused head does not reproduce (a subclass's own) keeps HF's head with the
    reason, and so does a config value the op refuses."""
    from ckpt_ext.hf.lm_head import head_problem, head_transform

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, intermediate_size=48, vocab_size=V, pad_token_id=0)
    for family in ("llama", "olmo2", "phi3"):
        assert head_transform(tiny_model(family, small)) == (None, 1.0, 0.0), family
    assert head_transform(gemma2_model(cap=30.0)) == (None, 1.0, 30.0)
    assert head_transform(gemma2_model(cap=None)) == (None, 1.0, 0.0)
    granite = tiny_model("granite", dict(small, logits_scaling=8.0))
    assert head_transform(granite) == (None, 0.125, 0.0)
    granite.config.logits_scaling = 0.0
    assert "logits_scaling=0.0 is not a finite number > 0" in head_problem(granite)
    clova = tiny_model("hyperclovax", dict(small, logits_scaling=8.0))
    assert head_transform(clova) == (None, 8.0, 0.0)
    clova.config.logits_scaling = float("inf")
    assert "logits_scaling=inf is not a finite number > 0" in head_problem(clova)
    bad_cap = gemma2_model(cap=-2.0)
    assert "final_logit_softcapping=-2.0" in head_problem(bad_cap)
    # A Llama whose forward a subclass replaces (here: doubling the loss): HF's head stays.
    base = make_model()

    class DoubledLoss(type(base)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.loss is not None:
                out.loss = 2 * out.loss
            return out

    model = copy.deepcopy(base)
    model.__class__ = DoubledLoss
    assert "the forward of " in head_problem(model) and "DoubledLoss" in head_problem(model)
    with pytest.warns(UserWarning, match="LM head is not fused: DoubledLoss runs the forward"):
        ckpt_ext.patch_llama(model)
    assert "forward" not in model.__dict__
    ids, mask, labels = make_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = base(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, 2 * want.loss, rtol=1e-5, atol=1e-6)
