"""ckpt_ext.hf.patch_llama on tiny Hugging Face models, against the same model unpatched.

Tiny configs (hidden 64, 3 layers, 4 heads / 2 KV heads of 16, intermediate 172, vocab 128,
fp32, CPU) with random non-trivial weights, norm weights and biases. Where a batch has left
padding, logits are compared at real tokens only and the loss leaves out every label that a
padded position predicts: a query row that may attend nothing is 0 in the fused op and
whatever HF's kernel gives there (eager: the mean of all values), and neither is meaningful.
"""
import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the HF patch tests need it "
    "(pip install -e '.[test]')")
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

import ckpt_ext  # noqa: E402
from hf_fixtures import (B, EAGER_ONLY, FAMILIES, MODEL_TYPE, S, TINY,  # noqa: E402
                         assert_compiled_replays_eager, make_batch, make_model)
from ckpt_ext.hf.masks import padding_mask_from_4d as _padding_mask_from  # noqa: E402
from ckpt_ext.hf.patch import patch_llama as _patch_llama, unpatch_llama  # noqa: E402


def patch_llama(model, *args, **kwargs):
    """These tests compare logits, so the LM head stays HF's (fuse_lm_head=False); the fused
    head is tested in tests/test_lm_head_hf.py."""
    kwargs.setdefault("fuse_lm_head", False)
    return _patch_llama(model, *args, **kwargs)

TOL = dict(rtol=1e-4, atol=1e-5)
STRICT = dict(rtol=1e-5, atol=1e-6)  # packed, windowed and eager-padding parity


def run(model, ids, mask, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads


def assert_same(ref, got, mask, tol=TOL):
    (out_r, grads_r), (out_g, grads_g) = ref, got
    keep = torch.ones(out_r.logits.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(out_g.logits[keep], out_r.logits[keep], **tol)
    torch.testing.assert_close(out_g.loss, out_r.loss, **tol)
    assert grads_g.keys() == grads_r.keys()
    for name in grads_r:
        torch.testing.assert_close(grads_g[name], grads_r[name], **tol, msg=name)


def calls(model, key="fused"):
    return [layer.forward.calls[key] if hasattr(layer.forward, "calls") else None
            for layer in model.model.layers]


# ---- numerics -------------------------------------------------------------------------------

@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_balanced_matches_unpatched(family, impl, pad):
    if family in EAGER_ONLY and impl != "eager":
        pytest.skip(f"transformers runs {family} with eager attention only: the eager case "
                    "covers it")
    ref_model = make_model(family, impl)
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    ids, mask, labels = make_batch(pad)
    if family in EAGER_ONLY and pad:  # left padding under capped eager attention: HF's forward
        with pytest.warns(UserWarning, match="nothing to attend"):
            got = run(model, ids, mask, labels)
        assert_same(run(ref_model, ids, mask, labels), got, mask)
        assert calls(model) == [0, 0, 0]
        return
    assert_same(run(ref_model, ids, mask, labels), run(model, ids, mask, labels), mask)
    assert calls(model) == [1, 1, 1]  # every layer went through the fused op


@pytest.mark.parametrize("policy", ["fast", "min_memory", "torch", ["none", "torch", "fast"],
                                    lambda i: ("min_memory", "balanced", "none")[i]],
                         ids=["fast", "min_memory", "torch", "list", "callable"])
def test_other_presets_match_unpatched(policy):
    ref_model = make_model("qwen2", "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), policy)
    ids, mask, labels = make_batch(pad=True)
    assert_same(run(ref_model, ids, mask, labels), run(model, ids, mask, labels), mask)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adamw_loss_curve(family):
    ids, mask, labels = make_batch(pad=True)
    curves = []
    for patched in (False, True):
        model = make_model(family, "sdpa")
        if patched:
            patch_llama(model, "balanced")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(10):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(torch.tensor(losses))
    assert curves[0][-1] < curves[0][0]  # it trains
    torch.testing.assert_close(curves[1], curves[0], **TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_same_tokens(family):
    ref_model = make_model(family, "sdpa").eval()
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    ids, mask, _ = make_batch(pad=True, s=9)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = ref_model.generate(ids, **kw)
    torch.testing.assert_close(model.generate(ids, **kw), ref, rtol=0, atol=0)
    assert ref.shape[1] == ids.shape[1] + 8


@pytest.mark.parametrize("family", list(FAMILIES))
def test_saved_bytes_at_most_a_fifth(family):
    # S=128: long enough that the layers, not the embedding and the LM head, dominate.
    ref_model = make_model(family, "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    ids = torch.randint(1, TINY["vocab_size"], (2, 128))

    def forward(m):
        return m(input_ids=ids, use_cache=False).logits

    plain = ckpt_ext.saved_activation_bytes(forward, ref_model)
    fused = ckpt_ext.saved_activation_bytes(forward, model)
    assert calls(model) == [1, 1, 1]
    assert 5 * fused <= plain, f"balanced saves {fused} bytes, unpatched {plain}"


def test_bare_model_and_positional_arguments():
    ref_model = make_model("qwen3", "eager", cls=AutoModel)
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    x = torch.randn(B, S, TINY["hidden_size"], requires_grad=True)
    pos = torch.arange(S)[None]
    pe = ref_model.rotary_emb(x, pos)
    causal = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
    ref = ref_model.layers[1](x, causal, pos, position_embeddings=pe)
    got = model.layers[1](x, causal, pos, position_embeddings=pe)  # mask, ids positionally
    got = got[0] if isinstance(got, tuple) else got
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(got, ref, **TOL)
    assert model.layers[1].forward.calls["fused"] == 1


# ---- HF behaviour kept -----------------------------------------------------------------------

def test_isinstance_state_dict_and_unpatch():
    ref_model = make_model("qwen3", "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    layer_cls = type(ref_model.model.layers[0])
    assert all(type(layer) is layer_cls for layer in model.model.layers)
    assert list(model.state_dict()) == list(ref_model.state_dict())
    for key, value in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    other = make_model("qwen3", "sdpa", seed=7)
    model.load_state_dict(other.state_dict(), strict=True)
    ref_model.load_state_dict(model.state_dict(), strict=True)
    for key, value in other.state_dict().items():
        assert torch.equal(ref_model.state_dict()[key], value)

    ids, mask, labels = make_batch(pad=True)
    ref = run(ref_model, ids, mask, labels)
    assert_same(ref, run(model, ids, mask, labels), mask)
    assert unpatch_llama(model) is model
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert_same(ref, run(model, ids, mask, labels), mask)
    unpatch_llama(model)  # a second unpatch changes nothing
    patch_llama(model, "fast")  # patch again, after unpatching
    assert_same(ref, run(model, ids, mask, labels), mask)
    patch_llama(model, "min_memory")  # re-patching replaces the earlier patch
    assert [layer.forward.preset for layer in model.model.layers] == ["min_memory"] * 3


@pytest.mark.parametrize("policy", ["none", "balanced"])
def test_patch_unpatch_cycles_leave_no_hook_behind(policy):
    """policy="none" fuses no layer but installs the model's pre-hook all the same: unpatching
    must remove it (one more hook per cycle was left, and unpatched layers kept receiving the
    hook's keyword)."""
    model = make_model("llama", "sdpa")
    bare = model.model
    before = (len(bare._forward_pre_hooks), len(bare._forward_hooks))
    seen = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sorted(kwargs)),
                                     with_kwargs=True)
    for _ in range(3):
        patch_llama(model, policy)
        assert len(bare._forward_pre_hooks) == before[0] + 1
        unpatch_llama(model)
    assert (len(bare._forward_pre_hooks), len(bare._forward_hooks)) == before
    ids, mask, labels = make_batch(pad=True)
    seen.clear()
    run(model, ids, mask, labels)
    assert seen and not any("ckpt_ext_forward" in kw for kw in seen), seen


def test_hooks_hidden_states_and_attentions():
    ref_model = make_model("llama", "eager")
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    ids, mask, labels = make_batch(pad=True)
    seen = []
    model.model.layers[2].register_forward_hook(lambda mod, args, out: seen.append(out))
    out, _ = run(model, ids, mask, labels, output_hidden_states=True)
    ref, _ = run(ref_model, ids, mask, labels, output_hidden_states=True)
    assert len(seen) == 1 and calls(model) == [1, 1, 1]
    assert len(out.hidden_states) == len(ref.hidden_states) == 4
    keep = mask.bool()
    for h_got, h_ref in zip(out.hidden_states, ref.hidden_states):
        torch.testing.assert_close(h_got[keep], h_ref[keep], **TOL)
    # output_attentions needs the attention weights: those calls run HF's forward.
    out, _ = run(model, ids, mask, labels, output_attentions=True)
    ref, _ = run(ref_model, ids, mask, labels, output_attentions=True)
    assert calls(model) == [1, 1, 1] and len(out.attentions) == 3
    for a_got, a_ref in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(a_got, a_ref, **TOL)
    out, _ = run(model, ids, mask, labels)  # and the next plain call is fused again
    assert calls(model) == [2, 2, 2]


def _zero3_like_hook(module, args):
    """Stands for DeepSpeed ZeRO-3's gathering hook: patch_llama tells DeepSpeed's hooks by the
    module that defines them."""


_zero3_like_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"


def test_delegation_warnings_name_the_hooks_owner_and_the_fix():
    model = patch_llama(make_model("llama", "eager"), "balanced")
    ids, mask, labels = make_batch(pad=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    # Hooks of the user's own on a submodule: named, with where to put them instead.
    handle = q_proj.register_forward_hook(lambda mod, args, out: None)
    with pytest.warns(UserWarning, match=r"self_attn\.q_proj has forward hooks of your own "
                      r"\(.*<lambda>\).*register them on the decoder layer itself"):
        run(model, ids, mask, labels)
    assert calls(model) == [0, 1, 1]
    handle.remove()
    # output_attentions: transformers' capturing hooks record attention weights.
    with pytest.warns(UserWarning, match="output_attentions.*never forms attention weights: "
                      "ask for output_attentions only in forwards that do not train"):
        run(model, ids, mask, labels, output_attentions=True)
    # DeepSpeed ZeRO-3's hooks on the submodules of a layer that is not a ZeRO-3 leaf module.
    handle = q_proj.register_forward_pre_hook(_zero3_like_hook)
    with pytest.warns(UserWarning, match=r"DeepSpeed ZeRO-3's hooks on self_attn\.q_proj.*"
                      r"set_z3_leaf_modules\(model, \[LlamaDecoderLayer\]\)"):
        run(model, ids, mask, labels)
    before = calls(model)
    model.model.layers[0]._z3_leaf = True  # the layer's own hooks gather everything: fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, ids, mask, labels)
    assert calls(model) == [n + 1 for n in before]
    handle.remove()


def test_training_forward_with_kv_cache_delegates_and_warns():
    ref_model = make_model("mistral", "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    ids, mask, labels = make_batch(pad=True)
    ref = ref_model(input_ids=ids, attention_mask=mask, labels=labels)  # use_cache defaults on
    with pytest.warns(UserWarning, match="use_cache=False"):
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls(model) == [0, 0, 0]
    torch.testing.assert_close(got.loss, ref.loss, **TOL)
    assert got.past_key_values.get_seq_length() == S  # the cache was filled as HF fills it


@pytest.mark.parametrize("family,overrides,windows", [
    ("mistral", dict(sliding_window=5), [5, 5, 5]),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
     [None, 4, 4]),
    ("ministral", dict(sliding_window=4, layer_types=["full_attention", "sliding_attention",
                                                      "sliding_attention"]), [None, 4, 4]),
], ids=["mistral-all-layers", "qwen2-layers-from-1", "ministral-interleaved"])
def test_sliding_window_shorter_than_sequence_is_fused(family, overrides, windows):
    ref_model = make_model(family, "sdpa", **overrides)
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    assert [layer.forward.spec.window for layer in model.model.layers] == windows
    ids, mask, labels = make_batch(pad=True)
    assert_same(run(ref_model, ids, mask, labels), run(model, ids, mask, labels), mask, STRICT)
    assert calls(model) == [1, 1, 1]


def packed_batch(lengths, seed=3):
    """One row of concatenated documents, as DataCollatorWithFlattening gives it: position ids
    restart at each document, no attention mask, the first label of each document ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100
    return ids, pos, labels


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3_partial", "olmo2", "gemma3_text",
                                    "gemma2"])
def test_packed_sequences_are_fused(family):
    ref_model = make_model(family, "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), "min_memory")
    ids, pos, labels = packed_batch([7, 1, 12, 3])
    ref = run(ref_model, ids, None, labels, position_ids=pos)
    got = run(model, ids, None, labels, position_ids=pos)
    # Gemma's sqrt(H) embedding scale and (1 + w) norms make its activations several times
    # larger, and its fp32 rounding differences with them: the default tolerance there
    assert_same(ref, got, None, TOL if family.startswith("gemma") else STRICT)
    assert calls(model) == [1, 1, 1]
    # the documents are independent: each alone gives the same logits as in the pack
    alone = ref_model(input_ids=ids[:, 8:20], use_cache=False).logits
    torch.testing.assert_close(got[0].logits[:, 8:20], alone, **TOL)


def test_hf_gradient_checkpointing_warns_and_recomputes_once():
    ref_model = make_model("llama", "sdpa")
    model = copy.deepcopy(ref_model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match="HF gradient checkpointing is enabled"):
        patch_llama(model, ["balanced", "torch", "none"])
    runs = [0, 0, 0]
    for i in (1, 2):  # HF's MLP starts in the forward and once more in the recompute
        model.model.layers[i].mlp.register_forward_pre_hook(
            lambda mod, args, i=i: runs.__setitem__(i, runs[i] + 1))
    ids, mask, labels = make_batch(pad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(model, ids, mask, labels)
    # the fused layer ran once, never under HF's checkpoint; 'torch' and 'none' recompute once
    assert model.model.layers[0].forward.calls == {"fused": 1}
    assert runs == [0, 2, 2]
    assert_same(run(ref_model, ids, mask, labels), got, mask)
    unpatch_llama(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers
               if hasattr(layer, "gradient_checkpointing"))


def _checkpoint_in_call(model):
    """Give the model's decoder layers the checkpointing of transformers up to 5.17: HF's
    checkpoint wraps ``__call__`` (so an instance-level forward runs under it), not the class
    forward as in later releases."""
    cls = type(model.model.layers[0])
    raw_forward = getattr(cls.forward, "__wrapped__", cls.forward)

    class CallCheckpointedLayer(cls):
        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(
                    functools.partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)

    CallCheckpointedLayer.forward = raw_forward  # later releases wrap forward in a subclass too
    for layer in model.model.layers:
        layer.__class__ = CallCheckpointedLayer
    return model


@pytest.mark.parametrize("enable", ["before", "after"])
def test_hf_checkpointing_in_call_is_taken_over(enable):
    """transformers <= 5.17 (checkpoint in __call__): the fused layer still runs once per
    forward, 'torch' and 'none' are checkpointed once, and unpatching gives HF's function back."""
    ref_model = _checkpoint_in_call(make_model("llama", "sdpa"))
    ref_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = _checkpoint_in_call(copy.deepcopy(make_model("llama", "sdpa")))
    hf_func = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if enable == "before":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            hf_func = model.model.layers[0]._gradient_checkpointing_func
        patch_llama(model, ["balanced", "torch", "none"])
        if enable == "after":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            hf_func = model.model.layers[0]._gradient_checkpointing_func
        runs = [0, 0, 0]
        for i in (1, 2):  # a hook on the fused layer's MLP would make it delegate
            model.model.layers[i].mlp.register_forward_pre_hook(
                lambda mod, args, i=i: runs.__setitem__(i, runs[i] + 1))
        ids, mask, labels = make_batch(pad=True)
        got = run(model, ids, mask, labels)
    assert model.model.layers[0].forward.calls == {"fused": 1}
    assert runs == [0, 2, 2]  # forward + one recompute each
    assert_same(run(ref_model, ids, mask, labels), got, mask)
    unpatch_llama(model)
    assert model.model.layers[0]._gradient_checkpointing_func is hf_func


def test_hf_gradient_checkpointing_turned_on_after_patching():
    ref_model = make_model("qwen2", "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, labels = make_batch(pad=True)
    ref = run(ref_model, ids, mask, labels)
    with pytest.warns(UserWarning, match="HF gradient checkpointing is enabled"):
        got = run(model, ids, mask, labels)  # transformers < 5: HF's forward, under HF's checkpoint
    assert_same(ref, got, mask)
    with pytest.warns(UserWarning, match="HF gradient checkpointing is enabled"):
        patch_llama(model, "balanced")  # takes HF's checkpointing over
    assert_same(ref, run(model, ids, mask, labels), mask)
    assert [layer.forward.calls for layer in model.model.layers] == [{"fused": 1}] * 3


def test_wrapped_projection_or_submodule_hook_after_patching_delegates():
    class LoraLike(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.a = base, nn.Linear(base.in_features, 2, bias=False)
            self.b = nn.Linear(2, base.out_features, bias=False)

        def forward(self, x):
            return self.base(x) + self.b(self.a(x))

    ref_model = make_model("llama", "sdpa")
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    for m in (ref_model, model):
        torch.manual_seed(3)
        m.model.layers[1].self_attn.v_proj = LoraLike(m.model.layers[1].self_attn.v_proj)
    model.model.layers[2].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    ref_model.model.layers[2].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    ids, mask, labels = make_batch(pad=False)
    with pytest.warns(UserWarning, match="not a plain nn.Linear"):
        got = run(model, ids, mask, labels)
    assert calls(model) == [1, 0, 0]
    assert_same(run(ref_model, ids, mask, labels), got, mask)


# ---- the mask conversion ---------------------------------------------------------------------

def test_padding_mask_from_hf_masks():
    s = 6
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    kpm = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # left, right
    allowed = (causal & kpm[:, None, :])[:, None]
    ok, got = _padding_mask_from(allowed, 2, s)
    assert ok and torch.equal(got, kpm)
    additive = torch.zeros(2, 1, s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ok, got = _padding_mask_from(additive, 2, s)
    assert ok and torch.equal(got, kpm)
    ok, got = _padding_mask_from(causal[None, None], 2, s)  # broadcast batch, no padding
    assert ok and got is None
    unmasked_rows = allowed.clone()
    unmasked_rows[0, 0, :2] = True  # older HF unmasks fully padded query rows for SDPA
    assert _padding_mask_from(unmasked_rows, 2, s)[0]
    unmasked_rows[0, 0, 1, 1] = False  # but a padded row that attends some keys is not padding
    assert not _padding_mask_from(unmasked_rows, 2, s)[0]
    window = allowed & torch.ones(s, s, dtype=torch.bool).triu(-2)
    assert not _padding_mask_from(window, 2, s)[0]
    block = allowed.clone()
    block[:, :, 4:, :4] = False  # packed: two documents
    assert not _padding_mask_from(block, 2, s)[0]
    assert not _padding_mask_from(block[:1], 1, s)[0]
    assert not _padding_mask_from(additive.masked_fill(allowed, 0.5), 2, s)[0]  # a bias
    assert not _padding_mask_from(allowed[..., :s - 1], 2, s)[0]  # cross-length
    wider = torch.cat([allowed, torch.zeros(2, 1, s, 1, dtype=torch.bool)], -1)
    assert _padding_mask_from(wider, 2, s)[0]  # transformers 4.x: keys beyond S are unused


# ---- refusals --------------------------------------------------------------------------------

def test_policy_errors():
    model = make_model("llama", "sdpa")
    # the one string that is not a preset, 'auto', is listed; a layer's own preset cannot be it
    with pytest.raises(ValueError, match="policy must be one of 'none', 'torch', 'fast', "
                                         "'balanced', 'min_memory', 'auto'; got 'quick'"):
        patch_llama(model, "quick")
    with pytest.raises(ValueError, match=r"policy: a list needs one preset per decoder layer "
                                         r"\(3 layers\), got 2"):
        patch_llama(model, ["none", "fast"])
    with pytest.raises(ValueError, match=r"policy\[1\] must be one of .*'min_memory'; got "):
        patch_llama(model, ["none", "fastest", "fast"])
    with pytest.raises(ValueError, match=r"policy\(2\) must be one of"):
        patch_llama(model, lambda i: "fast" if i < 2 else None)
    with pytest.raises(TypeError, match="policy must be a preset name"):
        patch_llama(model, 3)
    for flag in ("no", None, 0):  # "no" fused the head: a flag is never read by truthiness
        with pytest.raises(TypeError, match="patch_llama: fuse_lm_head must be a bool"):
            patch_llama(model, fuse_lm_head=flag)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert "forward" not in model.__dict__


def _lora_like(model):
    class Adapter(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x)

    attn = model.model.layers[1].self_attn
    attn.q_proj = Adapter(attn.q_proj)
    return model


def test_unknown_projection_patches_and_delegates():
    model = patch_llama(_lora_like(make_model("llama", "sdpa")), "balanced")
    ids, mask, labels = make_batch(pad=False)
    with pytest.warns(UserWarning, match="self_attn.q_proj is a Adapter, not a plain nn.Linear"):
        run(model, ids, mask, labels)
    assert calls(model) == [1, 0, 1]


def _eps_mismatch(model):
    model.model.layers[0].post_attention_layernorm.variance_epsilon = 1e-3
    return model


@pytest.mark.parametrize("build, match", [
    (lambda: make_model("llama", "flex_attention"), "attn_implementation='flex_attention'"),
    (lambda: make_model("llama", "sdpa", attention_dropout=0.1), "attention_dropout=0.1"),
    (lambda: _eps_mismatch(make_model("qwen3", "sdpa")), "different eps"),
    (lambda: make_model("qwen2", "sdpa", hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda: make_model("phi3", "sdpa", resid_pdrop=0.1), r"resid_pdrop = 0\.0"),
], ids=["flex_attention", "dropout", "eps", "activation", "phi3-resid-dropout"])
def test_refused_at_patch_time(build, match):
    model = build()
    with pytest.raises(ckpt_ext.PatchRefused, match=match):
        patch_llama(model, "balanced")
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    patch_llama(model, "torch")  # the unfused presets take anything HF runs


def test_refuses_other_models_and_foreign_forwards():
    cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    with pytest.raises(ckpt_ext.PatchRefused, match="decoder layers of GPT2LMHeadModel"):
        patch_llama(AutoModelForCausalLM.from_config(cfg))
    model = make_model("llama", "sdpa")
    model.config.model_type = "falcon"
    with pytest.raises(ckpt_ext.PatchRefused, match="model_type 'falcon' is not supported"):
        patch_llama(model)
    model.config.model_type = "gemma3"   # multimodal, but its text config is not gemma3_text
    with pytest.raises(ckpt_ext.PatchRefused,
                       match="text config of model_type 'gemma3' is not supported"):
        patch_llama(model)
    model = make_model("llama", "sdpa")
    config = model.config
    del model.config
    with pytest.raises(ckpt_ext.PatchRefused, match="LlamaForCausalLM has no .config"):
        patch_llama(model)
    model.config = config
    layer = model.model.layers[2]
    layer.forward = lambda *a, **k: type(layer).forward(layer, *a, **k)
    with pytest.raises(ckpt_ext.PatchRefused,
                       match="layer 2 already has an instance-level forward"):
        patch_llama(model)


def test_one_exception_type_for_refusals():
    """Every refusal of patch_llama is a ckpt_ext.PatchRefused (the tests of each refusal
    catch it), exported from ckpt_ext and ckpt_ext.hf and a subclass of both types the
    refusals raised before it (ValueError for layers, NotImplementedError for MoE families and
    settings), so older except clauses keep catching them; malformed arguments are not
    refusals and stay plain ValueError / TypeError."""
    assert ckpt_ext.PatchRefused is ckpt_ext.hf.PatchRefused
    assert "PatchRefused" in ckpt_ext.__all__ and "PatchRefused" in ckpt_ext.hf.__all__
    assert issubclass(ckpt_ext.PatchRefused, ValueError)
    assert issubclass(ckpt_ext.PatchRefused, NotImplementedError)
    model = make_model("llama", "sdpa")
    for bad, kind in (("quick", ValueError), (["fast"], ValueError), (3, TypeError)):
        with pytest.raises(kind) as info:  # an unknown preset, a list too short, not a policy
            patch_llama(model, bad)
        assert not isinstance(info.value, ckpt_ext.PatchRefused), info.value


@pytest.mark.parametrize("policy", ["fast", "balanced", "min_memory"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eager_left_padding_rows_match_hf(policy, family):
    """HF eager attention averages all values on a query row that may attend nothing (every
    score is the dtype's minimum); the patched model reproduces it, so the loss may include
    the labels predicted from padded positions and still equal HF's, gradients included."""
    ref_model = make_model(family, "eager")
    model = patch_llama(copy.deepcopy(ref_model), policy)
    ids, mask, _ = make_batch(pad=True)
    labels = ids.clone()  # nothing ignored: padded rows feed the loss
    ref, got = run(ref_model, ids, mask, labels), run(model, ids, mask, labels)
    torch.testing.assert_close(got[0].logits, ref[0].logits, **STRICT)
    assert_same(ref, got, None, STRICT)
    assert calls(model) == [1, 1, 1]


def test_flash_attention_models_are_fused():
    """A model configured for flash_attention_2 (what padding-free training recommends) trains
    through the fused kernel, which replaces its attention: set after construction on CPU,
    where HF's own flash path could not run at all."""
    ref_model = make_model("llama", "sdpa")
    model = copy.deepcopy(ref_model)
    model.config._attn_implementation = "flash_attention_2"
    patch_llama(model, "balanced")
    ids, pos, labels = packed_batch([9, 4, 11])
    assert_same(run(ref_model, ids, None, labels, position_ids=pos),
                run(model, ids, None, labels, position_ids=pos), None, STRICT)
    assert calls(model) == [1, 1, 1]


def test_a_copy_of_a_patched_model_unpatches_cleanly():
    model = patch_llama(make_model("llama", "sdpa"), "balanced")
    twin = copy.deepcopy(model)
    assert len(twin.model._forward_pre_hooks) == 1 and not twin.model._forward_hooks
    unpatch_llama(twin)
    assert not twin.model._forward_pre_hooks and not twin.model._forward_hooks
    assert not twin.model._forward_hooks_with_kwargs
    assert len(model.model._forward_pre_hooks) == 1  # the original keeps its patch
    patch_llama(twin, "min_memory")
    ids, mask, labels = make_batch(pad=True)
    assert_same(run(model, ids, mask, labels), run(twin, ids, mask, labels), mask)
    assert calls(twin) == [1, 1, 1]


def test_one_model_in_several_threads_keeps_each_forwards_masks():
    """Concurrent forwards of one patched model, each with its own padding mask or packed
    position_ids, each get the unpatched model's logits and loss for their own batch (the masks
    travel with the forward's call, not in a slot on the model)."""
    import threading

    seed = int(torch.randint(2**31, ()))
    ref_model = make_model("llama", "sdpa", seed=seed)
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    g = torch.Generator().manual_seed(seed)
    s = 24
    batches = []
    for pad in (3, 11):  # left padding of different lengths in the two rows
        ids = torch.randint(1, TINY["vocab_size"], (B, s), generator=g)
        mask = torch.ones(B, s, dtype=torch.long)
        mask[pad % B, :pad] = 0
        batches.append(dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask))
    ids, pos, _ = packed_batch([5, 9, 10], seed=seed)
    batches.append(dict(input_ids=ids, position_ids=pos))
    batches.append(dict(input_ids=batches[0]["input_ids"]))  # no mask at all
    with torch.no_grad():
        want = [ref_model(**b, labels=b["input_ids"], use_cache=False) for b in batches]
    rounds, failures, errors = 12, [], []
    barrier = threading.Barrier(len(batches))

    def work(k):
        try:
            barrier.wait()
            for r in range(rounds):
                out = model(**batches[k], labels=batches[k]["input_ids"], use_cache=False)
                keep = batches[k].get("attention_mask", torch.ones(out.logits.shape[:2])).bool()
                if not (torch.allclose(out.logits[keep], want[k].logits[keep], **TOL)
                        and torch.allclose(out.loss, want[k].loss, **TOL)):
                    failures.append((k, r))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not failures, failures
    assert sum(calls(model)) == 3 * rounds * len(batches)  # every call ran the fused op


def test_granite_logits_scaling_fuses_head_and_layers():
    """Granite divides its logits by logits_scaling: the fused head applies it (the op's
    logit_scale), so the head is fused without a warning, the layers too, and the loss and
    every gradient are the unpatched model's. Without the scale the loss would differ."""
    ref_model = make_model("granite", "sdpa", logits_scaling=4.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*LM head is not fused")
        model = patch_llama(copy.deepcopy(ref_model), "balanced", fuse_lm_head=True)
    ids, mask, labels = make_batch(pad=True)
    (out_r, grads_r), (out, grads) = run(ref_model, ids, mask, labels), run(model, ids, mask,
                                                                             labels)
    assert out.logits is None and model.forward.calls == {"fused": 1, "hf": 0}
    torch.testing.assert_close(out.loss, out_r.loss, **TOL)
    assert grads.keys() == grads_r.keys()
    for name in grads_r:
        torch.testing.assert_close(grads[name], grads_r[name], **TOL, msg=name)
    assert calls(model) == [1, 1, 1]
    unscaled = copy.deepcopy(ref_model)
    unscaled.config.logits_scaling = 1.0
    assert (run(unscaled, ids, mask, labels)[0].loss - out_r.loss).abs() > 100 * TOL["atol"]


@pytest.mark.parametrize("policy", ["fast", "min_memory"])
def test_gemma2_right_padding_is_fused(policy, monkeypatch):
    """Right padding under Gemma 2's capped eager attention leaves no row with nothing to attend
    (every padded row sees real keys within its window of 6): the layers are fused and match
    HF; padding longer than the window leaves rows empty, and those calls run HF's forward.
    The check syncs once per forward and window (two windows: 6 and full), not per layer."""
    from ckpt_ext.hf import patch as patch_module
    checked = []
    real_check = patch_module._may_have_empty_rows
    monkeypatch.setattr(patch_module, "_may_have_empty_rows",
                        lambda kpm, window: checked.append(window) or real_check(kpm, window))
    ref_model = make_model("gemma2")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, TINY["vocab_size"], (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    model = patch_llama(copy.deepcopy(ref_model), policy)
    assert_same(run(ref_model, ids, mask, labels), run(model, ids, mask, labels), mask)
    assert calls(model) == [1, 1, 1]
    assert sorted(checked, key=str) == [6, None], checked   # layers 0 and 2 share window 6
    mask[0, -9:] = 0  # 9 padded keys: the last rows of the windowed layers see none
    labels = ids.masked_fill(mask == 0, -100)
    with pytest.warns(UserWarning, match="nothing to attend"):
        got = run(model, ids, mask, labels)
    assert_same(run(ref_model, ids, mask, labels), got, mask)
    assert calls(model) == [1, 2, 1]  # the full-attention layer stays fused


@pytest.mark.parametrize("where", ["self_attn", "mlp", ""])
def test_a_parameter_outside_the_op_is_refused(where):
    """A tensor the fused op would leave out of the math, registered directly on the layer,
    its attention (e.g. GPT-OSS-style attention sinks) or its MLP, is refused at patch time
    with its name, never dropped silently."""
    model = make_model("llama", "sdpa")
    owner = model.model.layers[1]
    owner = owner.get_submodule(where) if where else owner
    owner.register_parameter("sinks", nn.Parameter(torch.zeros(4)))
    name = f"{where}.sinks" if where else "sinks"
    with pytest.raises(ckpt_ext.PatchRefused, match=rf"decoder layer 1 .*parameters the fused "
                                                     rf"op does not compute with: {name}"):
        patch_llama(model, "balanced")


def test_a_wrong_norm_map_fails(monkeypatch):
    """The norm slots mean different things per family: Gemma 3's post_attention_layernorm
    norms the attention's output, LLaMA's is the MLP's pre-norm. With two slots swapped the
    patched model runs fused and no longer matches HF (with the family's map it does:
    test_balanced_matches_unpatched); a map that leaves a norm out is refused at patch time,
    never dropped silently."""
    from ckpt_ext.hf import families
    ref_model = make_model("gemma3_text", "sdpa")
    ids, mask, labels = make_batch(pad=False)
    ref = run(ref_model, ids, mask, labels)[0].loss
    right = families.FAMILIES["gemma3_text"]
    swapped = dict(right.norms)
    swapped["attention_output_norm"], swapped["post_attention_layernorm"] = (
        swapped["post_attention_layernorm"], swapped["attention_output_norm"])
    monkeypatch.setitem(families.FAMILIES, "gemma3_text", right._replace(norms=swapped))
    model = patch_llama(copy.deepcopy(ref_model), "balanced")
    loss = run(model, ids, mask, labels)[0].loss
    assert calls(model) == [1, 1, 1] and (loss - ref).abs() > 1e-3
    llama_map = {**families.LLAMA.norms, "post_attention_layernorm": "pre_feedforward_layernorm"}
    monkeypatch.setitem(families.FAMILIES, "gemma3_text", right._replace(norms=llama_map))
    with pytest.raises(ValueError, match="post_feedforward_layernorm"):
        patch_llama(copy.deepcopy(ref_model), "balanced")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MODEL_TYPE])
def test_family_rounding_is_the_hf_norms(family):
    """Every norm of the family (the layer's, its q/k norms, the final norm) computed as the
    fused op computes it, with the family's norm_offset and norm_cast_last, equals HF's norm
    module bit for bit in bf16; the other cast order differs (so the comparison can fail)."""
    from ckpt_ext.hf.families import FAMILIES as MAP
    from ckpt_ext.hf.families import layer_norms
    model = make_model(family, "sdpa").to(torch.bfloat16)
    fam = MAP[MODEL_TYPE.get(family, family)]
    norms = {**layer_norms(model.model.layers[0], fam), "norm": model.model.norm}
    g = torch.Generator().manual_seed(7)
    other_differs = False
    for name, norm in norms.items():
        x = torch.randn(3, 5, norm.weight.shape[0], generator=g).mul(4).to(torch.bfloat16)
        eps = ckpt_ext.hf.families.norm_eps(norm)
        with torch.no_grad():
            want = norm(x)
            got = ckpt_ext.ops.rms_norm(x, norm.weight, eps, offset=fam.norm_offset,
                                        cast_last=fam.norm_cast_last)
            other = ckpt_ext.ops.rms_norm(x, norm.weight, eps, offset=fam.norm_offset,
                                          cast_last=not fam.norm_cast_last)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        other_differs |= not torch.equal(other, want)
    assert other_differs


def assert_peft_dropout_exact(family, preset, streams):
    """PEFT LoRA with dropout 0.2 on the modules of ``streams`` (path in the layer -> the
    stream of the op's mask for it): every layer of the patched model fused, and its loss and
    adapter gradients equal the unpatched PEFT model's that replays the op's masks. Returns
    (the patched model, its batch, the reference loss)."""
    peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need it "
                               "(pip install -e '.[test]')")
    from test_lora_dropout import replay_fused_dropout
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, init_lora_weights=False,
                          target_modules=[path.split(".")[1] for path in streams])
    torch.manual_seed(0)
    ref = peft.get_peft_model(make_model(family, "sdpa"), cfg)
    model = patch_llama(copy.deepcopy(ref), preset)
    batch = make_batch(pad=True)
    replay_fused_dropout(ref, streams, 0.2)
    loss_r, grads_r = loss_and_grads(ref, *batch)
    torch.manual_seed(1234)
    loss, grads = loss_and_grads(model, *batch)
    inner = model.get_base_model()
    assert [layer.forward.calls["fused"] for layer in inner.model.layers] == [1, 1, 1]
    torch.testing.assert_close(loss, loss_r, **TOL)
    assert set(grads) == set(grads_r) and all("lora_" in n for n in grads)
    assert len(grads) == 3 * 2 * len(streams)   # A and B of each adapted module, 3 layers
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=name)
    return model, batch, loss_r


# ---- Phi-3: fused projections, LoRA on them, partial RoPE --------------------------------------

def loss_and_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


def test_split_rows_views_and_one_gradient():
    """The fused weight's blocks are views of it; their gradients come back as one tensor, the
    blocks' gradients in order (a block the loss does not read: zeros)."""
    from ckpt_ext.hf.adapters import split_rows
    w = torch.randn(10, 3, requires_grad=True)
    q, k, v = split_rows(w, (4, 3, 3))
    assert [t.data_ptr() for t in (q, k, v)] == [w.data_ptr() + 4 * n * 3 for n in (0, 4, 7)]
    dq, dv = torch.randn(4, 3), torch.randn(3, 3)
    (g,) = torch.autograd.grad((q * dq).sum() + (v * dv).sum(), w)
    torch.testing.assert_close(g, torch.cat([dq, torch.zeros(3, 3), dv]), rtol=0, atol=0)
    assert type(q.grad_fn).__name__ == "SplitWithSizesBackward0"  # one node: one cat


def test_phi3_reads_fused_projections_and_partial_rope():
    """The spec reads qkv_proj's and gate_up_proj's row blocks; phi3_partial's cos/sin are
    half as wide as a head, and the op takes them as they are."""
    model = patch_llama(make_model("phi3_partial", "sdpa"), "balanced")
    spec = model.model.layers[0].forward.spec
    d = TINY["head_dim"]
    assert spec.fused == {"self_attn.qkv_proj": (4 * d, 2 * d, 2 * d),
                          "mlp.gate_up_proj": (TINY["intermediate_size"],) * 2}
    cos, _ = model.model.rotary_emb(torch.zeros(1, 3, 64), torch.arange(3)[None])
    assert cos.shape[-1] == d // 2
    # policy="auto" reads the same blocks, and the layer's record carries them
    from ckpt_ext.hf import families
    assert spec.dims == families.layer_dims(model.model.layers[0], 4)
    assert families.layer_dims(model.model.layers[0], 4).kwargs() == dict(
        H=64, Hq=4, Hkv=2, D=d, I=TINY["intermediate_size"], top_k=0)


@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_phi3_peft_lora_dropout_is_one_mask_per_fused_projection(preset, monkeypatch):
    """PEFT LoRA on qkv_proj, o_proj, gate_up_proj, down_proj with lora_dropout > 0: every layer
    fused, and loss and adapter gradients equal the unpatched PEFT model whose dropout modules
    apply the op's masks, ONE per fused module (the stream of its first projection: q 0, o 3,
    gate 4, down 6). Giving q/k/v (gate/up) their own streams fails the comparison."""
    from ckpt_ext.hf import patch as patch_module
    model, batch, loss_r = assert_peft_dropout_exact(
        "phi3_partial", preset, {"self_attn.qkv_proj": 0, "self_attn.o_proj": 3,
                                 "mlp.gate_up_proj": 4, "mlp.down_proj": 6})
    # each projection its own stream (lora_streams=[]): other masks, another loss
    tensors = patch_module._layer_tensors
    monkeypatch.setattr(patch_module, "_layer_tensors",
                        lambda *a: (*tensors(*a)[:3], []))
    torch.manual_seed(1234)
    loss_own, _ = loss_and_grads(model, *batch)
    assert (loss_own - loss_r).abs() > 1e3 * TOL["atol"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-dropout"])
def test_phi3_compiled_has_no_graph_breaks_and_replays_eager(lora):
    """torch.compile of a patched Phi-3 (partial RoPE; fused projections split inside the
    graph, with or without PEFT adapters and their dropout): no graph break, and under aot_eager
    the eager loss and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make_model("phi3_partial", "sdpa")
    if lora:
        peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need "
                                   "it (pip install -e '.[test]')")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.3, init_lora_weights=False,
            target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    patch_llama(model, "balanced")
    assert_compiled_replays_eager(model, loss_and_grads, make_batch(pad=True), TOL, TOL,
                                  use_cache=False)


@pytest.mark.parametrize("hf_checkpointing", [False, True], ids=["plain", "hf-gc"])
def test_compiled_model_with_delegating_layers_replays_eager(hf_checkpointing):
    """Layers that run HF's forward (PEFT DoRA adapters, which the fused op does not compute)
    under torch.compile: the patched forward calls HF's class forward, not the layer's instance
    forward again (dynamo resolved a bound ``forward.__get__`` to the instance attribute, the
    patched forward itself, and recursed without end); loss and gradients equal eager's, with
    and without HF gradient checkpointing."""
    peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA tests need it "
                               "(pip install -e '.[test]')")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = peft.get_peft_model(make_model("llama", "sdpa"), peft.LoraConfig(
        r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
        target_modules=["q_proj", "v_proj"]))
    if hf_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    patch_llama(model, "balanced")
    batch = make_batch(pad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_e, grads_e = loss_and_grads(model, *batch)
        compiled = torch.compile(model, backend="aot_eager")
        loss_c, grads_c = loss_and_grads(compiled, *batch)
    delegated = [k for layer in model.base_model.model.model.layers
                 for k in layer.__dict__["forward"].calls
                 if k.startswith("delegated")]
    assert delegated, "the DoRA layers were expected to run HF's forward"
    torch.testing.assert_close(loss_c, loss_e, **TOL)
    assert grads_c.keys() == grads_e.keys() and any("lora_magnitude" in n for n in grads_e)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, **TOL, msg=name)


# ---- GLM-4: interleaved partial RoPE, one gate_up_proj, norms around both sublayers ----------

@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_glm4_peft_lora_dropout_is_exact(preset):
    """PEFT LoRA with dropout on q/k/v, o_proj, the fused gate_up_proj and down_proj of GLM-4:
    every layer fused, and loss and adapter gradients equal the unpatched PEFT model replaying
    the op's masks (gate_up_proj's one adapter reads one dropped input: stream 4)."""
    assert_peft_dropout_exact("glm4", preset, {
        "self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2,
        "self_attn.o_proj": 3, "mlp.gate_up_proj": 4, "mlp.down_proj": 6})


def test_glm4_compiled_has_no_graph_breaks_and_replays_eager():
    torch._dynamo.reset()
    model = patch_llama(make_model("glm4", "sdpa"), "balanced")
    assert_compiled_replays_eager(model, loss_and_grads, make_batch(pad=True), TOL, TOL,
                                  use_cache=False)


@pytest.mark.parametrize("family", ["glm4", "hyperclovax_no_post_norm", "hunyuan_v1_dense"])
def test_auto_policy_and_offload_read_the_new_families(family):
    """policy="auto" sizes each layer from its modules (GLM-4's one gate_up_proj, HyperCLOVA
    X's nn.Identity output norms) and offload keeps their saved tensors in host memory: both
    fused, with HF's loss and gradients."""
    ref = make_model(family, "sdpa")
    batch = make_batch(pad=True)
    want = run(ref, *batch)
    for options in (dict(policy="auto", activation_budget="1GiB"),
                    dict(policy="min_memory", offload="cpu")):
        model = patch_llama(copy.deepcopy(ref), **options)
        assert_same(want, run(model, *batch), batch[1])
        assert calls(model) == [1, 1, 1], options
        off = model.model.layers[0].forward.shared.offloader
        assert (off is not None and off.stats()["host_allocations"] > 0) == ("offload" in options)
