"""The checks transformers' own model tests make of a causal LM, run on patched models of every
supported family (``hf_fixtures.FAMILIES``), each against the same model unpatched:

* a training step on a padded batch (the fused layers and the fused head): loss and gradients;
* ``return_dict=False`` with labels: HF's tuple, the loss first;
* ``policy="auto"``, which sizes the layers from their modules, and a float64 model;
* a grad-enabled training-mode forward handed a KV cache (under the keyword this transformers
  version uses, with and without ``use_cache``): the cache is filled in HF's format and length,
  and the next token's logits read from it are HF's;
* greedy generation after a training step.

A transformers release that renames a keyword the patch reads (the cache one went from
``past_key_values`` to ``cache`` in 5.24) fails here rather than in a user's run.
"""
import copy
import inspect
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the HF model checks need transformers")
from transformers import DynamicCache  # noqa: E402

import ckpt_ext  # noqa: E402
from hf_fixtures import EAGER_ONLY, FAMILIES, PAD, TINY, make_batch, make_model  # noqa: E402

FAMILY_IDS = list(FAMILIES)
TOL = dict(rtol=1e-4, atol=1e-5)


def pair(family):
    """(unpatched, patched with the defaults: fused layers and fused head), same weights."""
    ref = make_model(family, "sdpa")
    return ref, ckpt_ext.patch_llama(copy.deepcopy(ref))


def cache_keyword(model) -> str:
    """The keyword under which this transformers version's model forward takes a cache."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layer_calls(model, key):
    return sum(layer.forward.calls[key] for layer in model.model.layers)


def loss_and_grads(model, **call):
    model.zero_grad(set_to_none=True)
    out = model(**call)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    return out, loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                if p.grad is not None}


def assert_same_grads(got, ref):
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, **TOL, msg=name)


def padded(family):
    """A padded batch that the family's fused layers take: left padding, or right padding for
    the soft-capped families (their fully masked left-padding rows run HF's layer, by design:
    tests/test_hf.py)."""
    ids, mask, labels = make_batch(pad=True)
    if family in EAGER_ONLY:
        ids, mask, labels = (t.roll(-PAD, dims=1) for t in (ids, mask, labels))
    return ids, mask, labels


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_padded_training_step_matches_hf(family):
    ref, model = pair(family)
    ids, mask, labels = padded(family)
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    _, loss_r, grads_r = loss_and_grads(ref.train(), **call)
    out, loss, grads = loss_and_grads(model.train(), **call)
    assert model.forward.calls["fused"] == 1 and out.logits is None  # the fused head ran
    assert layer_calls(model, "fused") == TINY["num_hidden_layers"]
    torch.testing.assert_close(loss, loss_r, **TOL)
    assert_same_grads(grads, grads_r)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_auto_policy_trains_every_family(family):
    """policy="auto" reads each layer's dtype and shape from the layer (post-norm families
    such as OLMo-2 and EXAONE 4.0 have no input norm to read it from)."""
    ref = make_model(family, "sdpa")
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "auto", activation_budget="1GiB")
    ids, mask, labels = padded(family)
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    _, loss_r, grads_r = loss_and_grads(ref.train(), **call)
    _, loss, grads = loss_and_grads(model.train(), **call)
    assert layer_calls(model, "fused") == TINY["num_hidden_layers"]
    torch.testing.assert_close(loss, loss_r, **TOL)
    assert_same_grads(grads, grads_r)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_float64_training_step_matches_hf(family):
    """A float64 model trains fused (OLMo-2, OLMo-3 and ERNIE 4.5 hand their layers float32
    rotary tables, which HF's RoPE promotes)."""
    ref = make_model(family, "sdpa").double()
    model = ckpt_ext.patch_llama(copy.deepcopy(ref))
    ids, mask, labels = padded(family)
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    _, loss_r, grads_r = loss_and_grads(ref.train(), **call)
    _, loss, grads = loss_and_grads(model.train(), **call)
    assert layer_calls(model, "fused") == TINY["num_hidden_layers"]
    # HF's loss function casts the logits with .float(): its loss is float32; the fused head
    # keeps float64
    torch.testing.assert_close(loss, loss_r.double(), **TOL)
    assert_same_grads(grads, grads_r)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_return_dict_false_gives_hf_tuple_with_the_loss_first(family):
    ref, model = pair(family)
    ids, mask, labels = padded(family)
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False,
                return_dict=False)
    out_r, loss_r, grads_r = loss_and_grads(ref.train(), **call)
    out, loss, grads = loss_and_grads(model.train(), **call)
    assert isinstance(out_r, tuple) and isinstance(out, tuple)
    assert model.forward.calls["fused"] == 1
    # HF's tuple drops None fields: the fused head forms no logits, so its tuple is the loss
    # alone where HF's is (loss, logits)
    assert len(out) == 1 and len(out_r) == 2
    torch.testing.assert_close(loss, loss_r, **TOL)
    assert_same_grads(grads, grads_r)


@pytest.mark.parametrize("use_cache", [True, None], ids=["use_cache", "cache_only"])
@pytest.mark.parametrize("family", FAMILY_IDS)
def test_training_forward_with_a_cache_fills_it_as_hf_does(family, use_cache):
    """Grad enabled, training mode, a DynamicCache handed over: the layers must run HF's
    forward (the fused op fills no cache), with a warning that says why."""
    ref, model = pair(family)
    ids = torch.randint(1, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(4))
    key = cache_keyword(ref)
    caches, logits = [], []
    for m in (ref, model):
        m.train()
        cache = DynamicCache(config=m.config)
        call = {"input_ids": ids[:, :5], key: cache}
        if use_cache is not None:
            call["use_cache"] = use_cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m(**call).logits.sum().backward()
        if m is model:
            assert layer_calls(model, "fused") == 0
            assert any("KV cache" in str(w.message) for w in caught), [str(w.message)
                                                                     for w in caught]
        # no warning that the library causes (a deprecated keyword of its own, say)
        assert not any("deprecated" in str(w.message) for w in caught), [str(w.message)
                                                                         for w in caught]
        with torch.no_grad():
            logits.append(m(input_ids=ids[:, 5:], **{key: cache}, use_cache=True).logits)
        caches.append(cache)
    ref_cache, cache = caches
    assert type(cache) is type(ref_cache)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 6
    for layer_r, layer in zip(ref_cache.layers, cache.layers):
        torch.testing.assert_close(layer.keys, layer_r.keys, **TOL)
        torch.testing.assert_close(layer.values, layer_r.values, **TOL)
    torch.testing.assert_close(logits[1], logits[0], **TOL)


def test_a_layer_handed_only_a_cache_runs_hf():
    """transformers 5.24's Gemma 2 passes its layers ``cache=`` and no ``use_cache`` (5.17:
    ``past_key_values=``): a patched layer handed only the cache fills it."""
    _, model = pair("gemma2")
    layer = model.model.layers[0]
    x = torch.randn(1, 4, TINY["hidden_size"], requires_grad=True)
    pos = torch.arange(4)[None]
    cache = DynamicCache(config=model.config)
    with pytest.warns(UserWarning, match="KV cache"):
        layer(x, position_embeddings=model.model.rotary_emb(x, pos), position_ids=pos,
              **{cache_keyword(layer): cache})
    assert cache.get_seq_length() == 4


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_generation_after_a_training_step_is_hf(family):
    ref, model = pair(family)
    ids, mask, labels = padded(family)
    for m in (ref, model):
        loss_and_grads(m.train(), input_ids=ids, attention_mask=mask, labels=labels,
                       use_cache=False)
        m.eval()
    prompt, prompt_mask, _ = make_batch(pad=True, s=9)
    kw = dict(attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = ref.generate(prompt, **kw)
    assert want.shape[1] == prompt.shape[1] + 6
    torch.testing.assert_close(model.generate(prompt, **kw), want, rtol=0, atol=0)


def test_a_fused_training_forward_logs_no_transformers_deprecation():
    """The library must not cause transformers' deprecation warnings (5.24 logs one for every
    ``past_key_values=`` given to a model output or forward)."""
    import logging

    from transformers.utils import logging as hf_logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    root = hf_logging.get_logger("transformers")
    root.addHandler(handler)
    hf_logging.warning_once.cache_clear()  # messages already logged in this process log again
    try:
        _, model = pair("llama")
        ids, mask, labels = make_batch(pad=True)
        loss_and_grads(model.train(), input_ids=ids, attention_mask=mask, labels=labels,
                       use_cache=False)
        assert model.forward.calls["fused"] == 1
    finally:
        root.removeHandler(handler)
    assert not [m for m in records if "deprecat" in m], records
