"""patch_llama on tiny mixture-of-experts models of transformers 5 (Qwen3-MoE with a dense layer
between its MoE layers, Qwen2-MoE with its gated shared expert, q/k/v biases and a dense layer,
Mixtral, OLMoE with q/k norms over the projection), each against the same model unpatched:
loss and every gradient, eager and SDPA attention, padded and unpadded batches, the presets,
token chunks, LoRA on the attention and the shared expert, torch.compile; and the settings and
families the fused op refuses by name."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the HF MoE tests need transformers")

import ckpt_ext  # noqa: E402
from hf_fixtures import assert_compiled_replays_eager, padded_batch, tiny_model  # noqa: E402

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, vocab_size=128, pad_token_id=0,
            rms_norm_eps=1e-5)
# Qwen3-MoE renormalises its top 3 of 8 and has a dense middle layer (mlp_only_layers);
# Qwen2-MoE adds the gated shared expert and q/k/v biases, only its middle layer an MoE one
# (decoder_sparse_step 2); Mixtral
# always renormalises; OLMoE does not, and norms q/k over the whole projection.
MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                         norm_topk_prob=True, mlp_only_layers=[1]),
       "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, qkv_bias=True,
                         decoder_sparse_step=2),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
       "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)}
TOL = dict(rtol=1e-4, atol=1e-5)
B, S = 2, 17


def make(family, impl="sdpa", **overrides):
    return tiny_model(family, {**BASE, **MOE[family], **overrides}, impl=impl, perturb=True)


def batch(pad):
    ids, mask, labels = padded_batch(BASE["vocab_size"], B, S, pad=5 if pad else 0)
    return ids, (mask if pad else None), labels


def loss_and_grads(model, ids, mask, labels, **call):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **call)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(ref, got, experts_trained=True):
    (out_r, grads_r), (out_g, grads_g) = ref, got
    torch.testing.assert_close(out_g.loss, out_r.loss, **TOL)
    assert grads_g.keys() == grads_r.keys()
    assert any("experts.gate_up_proj" in n for n in grads_r) == experts_trained
    for name in grads_r:
        torch.testing.assert_close(grads_g[name], grads_r[name], **TOL, msg=name)


def fused_calls(model):
    return [layer.forward.calls["fused"] for layer in model.model.layers]


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(MOE))
def test_family_matches_unpatched(family, impl, pad):
    """Loss and every gradient (router, experts, shared expert and its gate, attention, norms,
    embeddings) equal HF's; every layer, MoE or dense, runs the fused op."""
    ref = make(family, impl)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", fuse_lm_head=False)
    data = batch(pad)
    assert_same(loss_and_grads(ref, *data), loss_and_grads(model, *data))
    assert fused_calls(model) == [1, 1, 1]


@pytest.mark.parametrize("policy", ["fast", "min_memory", ["min_memory", "fast", "balanced"]],
                         ids=["fast", "min_memory", "list"])
def test_presets_and_the_fused_head(policy):
    ref = make("qwen2_moe")
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), policy)  # the fused LM head too
    data = batch(True)
    assert_same(loss_and_grads(ref, *data), loss_and_grads(model, *data))
    assert fused_calls(model) == [1, 1, 1]
    assert model.forward.calls["fused"] == 1  # the head and loss too


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_packed_sequences(family):
    """One row of packed documents (position ids restarting, no mask, as
    DataCollatorWithFlattening gives it): HF's loss and gradients, every layer fused."""
    lengths = [7, 1, 12, 3]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, BASE["vocab_size"], (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100
    ref = make(family)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory", fuse_lm_head=False)
    assert_same(loss_and_grads(ref, ids, None, labels, position_ids=pos),
                loss_and_grads(model, ids, None, labels, position_ids=pos))
    assert fused_calls(model) == [1, 1, 1]


def test_token_chunks(monkeypatch):
    """A chunk cap of a few tokens (the layers tile the sequence): HF's loss and gradients."""
    ref = make("qwen3_moe")
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory", fuse_lm_head=False)
    ckpt_ext.config.update(chunk_bytes="16KiB")  # 2-3 tokens of an MoE layer's chunk
    data = batch(True)
    assert_same(loss_and_grads(ref, *data), loss_and_grads(model, *data))


def test_lora_on_attention_and_shared_expert():
    """PEFT LoRA on the attention and the shared expert's projections (the base frozen): loss
    and the adapters' gradients equal PEFT's own forward."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"])
    ref = peft.get_peft_model(make("qwen2_moe"), cfg)
    model = copy.deepcopy(ref)
    ckpt_ext.patch_llama(model, "balanced", fuse_lm_head=False)
    data = batch(True)
    r, g = loss_and_grads(ref, *data), loss_and_grads(model, *data)
    assert any("lora_A" in n and "shared_expert" in n for n in r[1])
    assert_same(r, g, experts_trained=False)
    assert sum(fused_calls(model.base_model.model)) == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_lora_dropout_on_attention(family):
    """PEFT LoRA with lora_dropout 0.2 on q/k/v/o of the MoE layers (and the dense layer
    between): every layer fused, and the loss and the adapters' gradients equal PEFT's own
    forward whose dropout modules apply the fused op's masks (one seed per layer call)."""
    peft = pytest.importorskip("peft")
    from test_lora_dropout import replay_fused_dropout
    from ckpt_ext import blocks
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, init_lora_weights=False,
                          target_modules=attention)
    ref = peft.get_peft_model(make(family), cfg)
    model = copy.deepcopy(ref)
    ckpt_ext.patch_llama(model, "balanced", fuse_lm_head=False)
    replay_fused_dropout(ref, {path: blocks.PROJECTIONS.index(path) for path in
                               (f"self_attn.{name}" for name in attention)}, 0.2)
    data = batch(True)
    r = loss_and_grads(ref, *data)
    torch.manual_seed(1234)
    g = loss_and_grads(model, *data)
    assert sum(fused_calls(model.base_model.model)) == 3
    assert len(r[1]) == 3 * 4 * 2  # lora_A and lora_B of 4 projections in 3 layers
    assert_same(r, g, experts_trained=False)
    torch.manual_seed(4321)  # other masks: another loss
    assert abs(loss_and_grads(model, *data)[0].loss - g[0].loss) > 1e-6


def test_compiles_without_graph_breaks():
    model = ckpt_ext.patch_llama(make("mixtral"), "min_memory", fuse_lm_head=False)

    def run(m, ids, mask, labels):
        out, grads = loss_and_grads(m, ids, mask, labels)
        return out.loss, {n.replace("_orig_mod.", ""): g for n, g in grads.items()}

    assert_compiled_replays_eager(model, run, batch(True), TOL, TOL, use_cache=False)


# ---- router logits and the load-balancing loss (output_router_logits=True) ------------------

# A coefficient large enough that the aux loss's gradient is a large share of the router's
# (a fused layer that dropped it would be far outside TOL: test_aux_loss_gradient_counts)
AUX = dict(router_aux_loss_coef=0.5)


def assert_same_moe(ref, got):
    """assert_same, and the aux loss and every router's logits (one per MoE layer, in order)."""
    (out_r, _), (out_g, _) = ref, got
    assert out_r.aux_loss is not None and out_r.aux_loss.item() > 0
    torch.testing.assert_close(out_g.aux_loss, out_r.aux_loss, **TOL)
    assert len(out_g.router_logits) == len(out_r.router_logits) > 0
    for a, b in zip(out_g.router_logits, out_r.router_logits):
        assert a.dtype == b.dtype and a.requires_grad
        torch.testing.assert_close(a, b, **TOL)
    assert_same(ref, got)


@pytest.mark.parametrize("where", ["config", "call"])
@pytest.mark.parametrize("family", list(MOE))
def test_router_logits_and_aux_loss_match_unpatched(family, where):
    """output_router_logits=True in the config or in the call, a left-padded batch (HF's aux
    loss masks the padding): the router logits, aux_loss, the loss with
    router_aux_loss_coef * aux_loss and every gradient equal HF's; every layer and the LM head
    run fused (no warning)."""
    config = dict(AUX, output_router_logits=True) if where == "config" else AUX
    call = dict(output_router_logits=True) if where == "call" else {}
    ref = make(family, **config)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    data = batch(True)
    want = loss_and_grads(ref, *data, **call)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = loss_and_grads(model, *data, **call)
    assert_same_moe(want, got)
    assert fused_calls(model) == [1, 1, 1]
    assert model.forward.calls == {"fused": 1, "hf": 0}


def test_aux_loss_gradient_counts():
    """The comparison is sensitive: the load-balancing loss's gradient changes the routers'
    gradients far beyond the tolerance (an op that dropped it would fail the tests above)."""
    ref = make("olmoe", **AUX)
    data = batch(True)
    with_aux = loss_and_grads(ref, *data, output_router_logits=True)[1]
    without = loss_and_grads(ref, *data)[1]
    name = "model.layers.0.mlp.gate.weight"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(with_aux[name], without[name], **TOL)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_logits_unpadded_eager_and_hf_head(family):
    """No attention mask (HF's aux loss counts every token), eager attention, HF's own LM head
    (fuse_lm_head=False) over the fused layers: HF's results."""
    ref = make(family, "eager", **AUX)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "min_memory", fuse_lm_head=False)
    data = batch(False)
    assert_same_moe(loss_and_grads(ref, *data, output_router_logits=True),
                    loss_and_grads(model, *data, output_router_logits=True))
    assert fused_calls(model) == [1, 1, 1]


@pytest.mark.parametrize("policy", ["fast", "min_memory"])
def test_router_logits_presets(policy):
    ref = make("qwen2_moe", output_router_logits=True, **AUX)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), policy)
    data = batch(True)
    assert_same_moe(loss_and_grads(ref, *data), loss_and_grads(model, *data))
    assert fused_calls(model) == [1, 1, 1]
    assert model.forward.calls["fused"] == 1


def test_router_logits_token_chunks(monkeypatch):
    """A chunk cap of a few tokens: the router logits, aux loss and gradients of HF and of the
    one-chunk fused model."""
    ref = make("qwen3_moe", output_router_logits=True, **AUX)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    data = batch(True)
    whole = loss_and_grads(model, *data)
    ckpt_ext.config.update(chunk_bytes="16KiB")  # 2-3 tokens of an MoE layer's chunk
    chunked = loss_and_grads(model, *data)
    assert_same_moe(loss_and_grads(ref, *data), chunked)
    assert_same_moe(whole, chunked)


def test_router_logits_without_labels_and_as_a_tuple():
    """Without labels (HF's head: logits, and aux_loss not added) and with return_dict=False
    (HF's tuple without the logits the fused head never forms: loss, aux_loss, then the
    router logits)."""
    ref = make("olmoe", output_router_logits=True, **AUX)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    ids, mask, labels = batch(True)
    model.train()
    ref.train()
    want = ref(input_ids=ids, attention_mask=mask, use_cache=False)
    got = model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert got.loss is None and fused_calls(model) == [1, 1, 1]
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    got = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False,
                return_dict=False)
    assert isinstance(got, tuple) and len(got) == 3
    torch.testing.assert_close(got[0], want.loss, **TOL)
    torch.testing.assert_close(got[1], want.aux_loss, **TOL)
    for a, b in zip(got[2], want.router_logits, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_router_logits_compile_without_graph_breaks():
    """torch.compile of a model collecting its router logits, fused LM head and aux loss: no
    graph break, the eager loss and gradients. (transformers installs its output-capturing
    hooks on the first forward that asks for an output, under a threading lock dynamo does not
    trace, the unpatched model alike: one eager forward installs them first.)"""
    model = ckpt_ext.patch_llama(make("qwen2_moe", output_router_logits=True, **AUX),
                                 "min_memory")
    ids, mask, _ = batch(True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)

    def run(m, ids, mask, labels):
        out, grads = loss_and_grads(m, ids, mask, labels)
        return out.loss, {n.replace("_orig_mod.", ""): g for n, g in grads.items()}

    assert_compiled_replays_eager(model, run, batch(True), TOL, TOL, use_cache=False)


# ---- the fused load-balancing loss (router_aux_loss="fused") ---------------------------------

def hf_aux_fp64(router_logits, num_experts, top_k, mask):
    """transformers' load-balancing loss of these logits, in float64 throughout (HF's own
    function rounds its sums to float32)."""
    w = torch.ones(router_logits[0].shape[0], dtype=torch.float64) if mask is None \
        else mask.reshape(-1).double()
    counts = sum(torch.zeros(num_experts, dtype=torch.float64).scatter_add_(
        0, lg.softmax(-1).topk(top_k, -1).indices.reshape(-1), w.repeat_interleave(top_k))
        for lg in router_logits)
    probs = sum((lg.double().softmax(-1) * w[:, None]).sum(0) for lg in router_logits)
    n = w.sum() * len(router_logits)
    return (counts / n * probs / n).sum() * num_experts


def assert_fused_aux(ref, got, tol):
    """aux_loss (HF's dtype, float32), the loss (HF's cross-entropy is float32 in a float64
    model, the fused head's float64) and every gradient; no router logits returned."""
    (out_r, grads_r), (out_g, grads_g) = ref, got
    assert out_g.router_logits is None and out_g.aux_loss.dtype == out_r.aux_loss.dtype
    torch.testing.assert_close(out_g.aux_loss, out_r.aux_loss, **tol)
    torch.testing.assert_close(out_g.loss, out_r.loss, **tol, check_dtype=False)
    assert grads_g.keys() == grads_r.keys()
    for name in grads_r:
        torch.testing.assert_close(grads_g[name], grads_r[name], **tol, msg=name)


@pytest.mark.parametrize("family", list(MOE))
def test_fused_router_aux_loss_matches_unpatched(family, monkeypatch):
    """router_aux_loss="fused", float64, a left-padded batch: the MoE layers return only their
    (3, E) statistics, and aux_loss, the loss and every gradient equal the unpatched model's
    (HF's float32 cross-entropy and probability sums: TOL), and the exact mode's with HF's
    loss function computed in float64 throughout to 1e-10 (the aux value to float32, its
    dtype); router_logits is None; every layer and the head run fused; each layer's
    statistics are those of the exact mode's logits."""
    ref = make(family, output_router_logits=True, **AUX).double()
    ref.set_experts_implementation("eager")  # grouped_mm takes no float64
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", router_aux_loss="fused")
    data = batch(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = loss_and_grads(model, *data)
    assert_fused_aux(loss_and_grads(ref, *data), got, TOL)
    assert fused_calls(model) == [1, 1, 1]
    assert model.forward.calls == {"fused": 1, "hf": 0}
    exact = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    monkeypatch.setattr(ckpt_ext.hf.moe, "_load_balancing_loss_func",
                        lambda model: hf_aux_fp64)
    want = loss_and_grads(exact, *data)
    out = want[0]
    assert out.aux_loss.dtype == torch.float64
    torch.testing.assert_close(got[0].aux_loss.double(), out.aux_loss, rtol=1e-7, atol=0)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-10, atol=1e-12, msg=name)
    stats = []  # the layers' statistics themselves, against the exact mode's logits
    model.model(input_ids=data[0], attention_mask=data[1], use_cache=False,
                output_router_logits=True, **{ckpt_ext.hf.moe.ROUTER_STATS_KEY: stats})
    assert len(stats) == len(out.router_logits) > 0
    for st, lg in zip(stats, out.router_logits):
        assert st.dtype == torch.float64 and st.shape == (3, ref.num_experts)
        w = data[1].reshape(-1).double()
        p = lg.detach().softmax(-1)
        torch.testing.assert_close(st[1], w @ p, rtol=1e-12, atol=1e-12)
        assert torch.equal(st[2], w.sum().expand(ref.num_experts))
        assert st[0].sum() == w.sum() * ref.num_experts_per_tok


def test_fused_router_aux_loss_chunks_hf_layers_and_presets():
    """Token chunks of a few tokens, one MoE layer left to HF's forward (policy "none": its
    logits' statistics join the fused layers'), float32 and no attention mask, the presets:
    HF's aux loss, loss and gradients; and the coefficient's share is far beyond the
    tolerance (a fused head that dropped the statistics' gradient would fail)."""
    ref = make("olmoe", output_router_logits=True, **AUX)
    data = batch(True)
    want = loss_and_grads(ref, *data)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), ["min_memory", "none", "fast"],
                                 router_aux_loss="fused")
    ckpt_ext.config.update(chunk_bytes="16KiB")  # 2-3 tokens of an MoE layer's chunk
    try:
        got = loss_and_grads(model, *data)
    finally:
        ckpt_ext.config.update(chunk_bytes=ckpt_ext.config.KernelConfig.chunk_bytes)
    assert_fused_aux(want, got, TOL)
    layers = model.model.layers
    assert [layers[i].forward.calls["fused"] for i in (0, 2)] == [1, 1]
    assert "forward" not in layers[1].__dict__  # HF's own layer
    unpadded = batch(False)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", router_aux_loss="fused")
    assert_fused_aux(loss_and_grads(ref, *unpadded), loss_and_grads(model, *unpadded), TOL)
    without = loss_and_grads(ref, *data, output_router_logits=False)[1]
    name = "model.layers.0.mlp.gate.weight"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[1][name], without[name], **TOL)


def test_fused_router_aux_loss_without_labels_returns_logits():
    """Without labels the fused head runs HF's forward: the router logits are HF's, in
    fused mode too."""
    ref = make("mixtral", output_router_logits=True, **AUX)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", router_aux_loss="fused")
    ids, mask, _ = batch(True)
    want = ref(input_ids=ids, attention_mask=mask, use_cache=False)
    got = model(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    assert len(got.router_logits) == len(want.router_logits) == 3


def test_fused_router_aux_loss_in_several_threads():
    """Two threads running training forwards of one model patched with router_aux_loss=
    "fused", each on its own batch (one padded, one not, of different lengths), many times:
    each forward's aux_loss, loss and router gradients (torch.autograd.grad, so that the
    threads' gradients stay apart) are its own batch's, as one thread alone computes them (the
    statistics travel with the forward's own call, not in a list on the model)."""
    import threading

    ref = make("qwen3_moe", output_router_logits=True, **AUX)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", router_aux_loss="fused")
    model.train()
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    ids, mask, labels = batch(True)
    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    other = torch.randint(1, BASE["vocab_size"], (3, 11), generator=g)
    batches = [dict(input_ids=ids, attention_mask=mask, labels=labels),
               dict(input_ids=other, labels=other)]

    def step(b):
        out = model(**b, use_cache=False)
        return out.aux_loss.detach(), out.loss.detach(), torch.autograd.grad(out.loss, routers)

    want = [step(b) for b in batches]
    torch.testing.assert_close(want[0][0], loss_and_grads(ref, ids, mask, labels)[0].aux_loss,
                               **TOL)
    assert not torch.allclose(want[0][0], want[1][0])  # the two batches' losses differ
    rounds, failures, errors = 30, [], []
    barrier = threading.Barrier(2)

    def work(k):
        try:
            barrier.wait()
            for r in range(rounds):
                aux, loss, grads = step(batches[k])
                same = torch.allclose(aux, want[k][0], **TOL) and \
                    torch.allclose(loss, want[k][1], **TOL) and \
                    all(torch.allclose(a, b, **TOL) for a, b in zip(grads, want[k][2]))
                if not same:
                    failures.append((k, r))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not failures, failures
    assert model.forward.calls == {"fused": 2 + 2 * rounds, "hf": 0}


@pytest.mark.parametrize("case,match", [
    ("mode", "router_aux_loss must be one of"),
    ("hf_head", "fuse_lm_head=False"),
    ("bare", "not a \\*ForCausalLM"),
    ("dense", "no mixture-of-experts layers"),
])
def test_fused_router_aux_loss_refusals(case, match):
    if case == "dense":
        model = tiny_model("llama", {**BASE})
    else:
        model = make("qwen3_moe", output_router_logits=True)
    kw = {"router_aux_loss": "fused"}
    if case == "mode":
        kw["router_aux_loss"] = "approximate"
    elif case == "hf_head":
        kw["fuse_lm_head"] = False
    elif case == "bare":
        model = model.model
    # an unknown mode is a malformed argument; the others are refusals
    kind = ValueError if case == "mode" else ckpt_ext.PatchRefused
    with pytest.raises(kind, match=match) as info:
        ckpt_ext.patch_llama(model, "balanced", **kw)
    assert isinstance(info.value, ckpt_ext.PatchRefused) == (case != "mode")
    assert "forward" not in model.__dict__


# ---- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family,setting,match", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("olmoe", dict(clip_qkv=2.0), "clip_qkv=2.0"),
])
def test_settings_are_refused_by_name(family, setting, match):
    with pytest.raises(ckpt_ext.PatchRefused, match=match):
        ckpt_ext.patch_llama(make(family, **setting))


@pytest.mark.parametrize("family,setting", [("olmoe", "clip_qkv"),
                                             ("mixtral", "router_jitter_noise")])
def test_settings_set_after_patching_run_hfs_forward(family, setting):
    """OLMoE's config.clip_qkv (read by its attention at every call) and Mixtral's MoE block's
    jitter_noise (its router_jitter_noise, training only) set after patching: the fused op
    computes neither, so the layers run HF's forward with a warning naming the setting, as
    for attention dropout, and the loss and every gradient are the unpatched model's with the
    same setting (which differ from those without it). Set back, the layers fuse again."""
    ref = make(family)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced")
    data = batch(True)
    without = loss_and_grads(ref, *data)

    def put(m, value):
        if setting == "clip_qkv":
            m.config.clip_qkv = value
        else:
            for layer in m.model.layers:
                layer.mlp.jitter_noise = value

    for m in (ref, model):
        put(m, 0.1 if setting == "clip_qkv" else 0.4)
    torch.manual_seed(5)  # the jitter's draws
    want = loss_and_grads(ref, *data)
    assert abs(want[0].loss - without[0].loss) > 1e-3  # the setting changes HF's loss
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match=f"{setting.replace('router_', '')}.*set after patching"):
        got = loss_and_grads(model, *data)
    assert_same(want, got)
    assert fused_calls(model) == [0, 0, 0]
    for m in (ref, model):
        put(m, None if setting == "clip_qkv" else 0.0)
    assert_same(without, loss_and_grads(model, *data))
    assert fused_calls(model) == [1, 1, 1]


def test_quantized_experts_are_refused():
    model = make("olmoe")
    experts = model.model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data.to(torch.int8),
                                           requires_grad=False)
    with pytest.raises(ckpt_ext.PatchRefused, match="quantized expert weights"):
        ckpt_ext.patch_llama(model)


def test_other_wrappers_on_the_experts_are_refused():
    """A module around mlp.experts that is not PEFT's ParamWrapper (another adapter library, a
    quantization wrapper): patching refuses, naming it."""
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.base_layer = inner

        def forward(self, *args, **kwargs):
            return self.base_layer(*args, **kwargs)

    model = make("mixtral")
    mlp = model.model.layers[1].mlp
    mlp.experts = Wrapper(mlp.experts)
    with pytest.raises(ckpt_ext.PatchRefused, match="mlp.experts is a Wrapper"):
        ckpt_ext.patch_llama(model)


def test_top_k_beyond_the_experts_is_refused():
    model = make("mixtral")
    model.model.layers[2].mlp.gate.top_k = 5  # 4 experts
    with pytest.raises(ckpt_ext.PatchRefused, match="top_k=5 must be in 1..4"):
        ckpt_ext.patch_llama(model)


@pytest.mark.parametrize("model_type", ["gpt_oss", "glm4_moe"])
def test_other_moe_families_are_refused_by_name(model_type):
    class Config:
        pass

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.config.model_type = model_type
            self.layers = torch.nn.ModuleList([torch.nn.Linear(1, 1)])

    with pytest.raises(ckpt_ext.PatchRefused, match=f"model_type '{model_type}' is a "
                       "mixture-of-experts model"):
        ckpt_ext.patch_llama(Model())


@pytest.mark.parametrize("offload", [None, "cpu"], ids=["device", "offload"])
def test_auto_policy_chooses_for_moe(offload):
    """policy='auto' on a model of MoE and dense layers (Qwen2-MoE: its middle layer sparse,
    with a shared expert): the layers' shapes it reads off the modules are the plan's reading
    of the config (experts, top-k, expert and shared sizes), its choice for a budget between
    the smallest and the largest is the plan's choice by time (ckpt_ext.plan.choose_auto; the
    routing counted in every preset's saved bytes), and the loss and every gradient are HF's."""
    from ckpt_ext import plan
    from ckpt_ext.hf.families import layer_dims_from_config
    ref = make("qwen2_moe")
    dims = layer_dims_from_config(ref.config)
    assert [d.experts for d in dims] == [0, 8, 0]
    ids, mask, labels = batch(True)
    B_, S_ = ids.shape
    saved = {p: B_ * S_ * sum(plan.per_token_bytes(p, dtype=torch.float32, **d.kwargs())
                              for d in dims) for p in ("balanced", "min_memory")}
    budget = (saved["balanced"] + saved["min_memory"]) // 2
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "auto", activation_budget=budget,
                                 offload=offload)
    shared = model.model.layers[0].forward.shared
    assert shared.layer_dims() == dims
    got = loss_and_grads(model, ids, mask, labels)
    chosen = shared.auto[B_, S_, torch.float32, True, 0, 0]
    if offload is None:   # the plan's choice by time (an MoE model: fused presets only)
        from ckpt_ext.throughputs import default_throughputs
        rates = default_throughputs()
        want = plan.choose_auto(dims, ref.config.vocab_size, B_, S_, torch.float32,
                                budget=budget, path="cpu", overheads=rates.overheads,
                                **rates.step_time_kwargs(S_))
        assert chosen == list(want.presets)
        assert want.saved <= budget and want.saved == sum(
            plan.layer_bytes(p, d, B_, S_, torch.float32) for p, d in zip(chosen, dims))
    assert set(chosen) <= {"fast", "balanced", "min_memory"}
    assert fused_calls(model) == [1, 1, 1]
    assert_same(loss_and_grads(ref, ids, mask, labels), got)


@pytest.mark.parametrize("family", sorted(MOE))
def test_the_plan_reads_moe_configs(family):
    """layer_dims_from_config gives each layer of an HF MoE model the experts, top-k, expert
    size and shared expert its modules have (the dense layers between: mlp_only_layers,
    decoder_sparse_step), and the plan's parameters are the model's."""
    from ckpt_ext import plan
    from ckpt_ext.hf.families import layer_dims_from_config
    model = make(family, output_router_logits=True)
    dims = layer_dims_from_config(model.config)
    assert len(dims) == len(model.model.layers)
    for d, layer in zip(dims, model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        assert d.moe == (experts is not None)
        assert d.router_logits == d.moe
        if experts is None:
            assert d.intermediate_size == layer.mlp.gate_proj.weight.shape[0]
            continue
        E, two_i, H = experts.gate_up_proj.shape
        assert (d.experts, d.expert_intermediate_size, d.hidden_size) == (E, two_i // 2, H)
        assert d.top_k == MOE[family]["num_experts_per_tok"]
        shared = getattr(layer.mlp, "shared_expert", None)
        assert d.intermediate_size == (shared.gate_proj.weight.shape[0] if shared else 0)
    # the base's parameters besides the norms (the plan: 2 H a layer and the final H), and
    # Qwen2-MoE's shared-expert gate (H a layer) and q/k/v biases, which the plan leaves out
    H, L = BASE["hidden_size"], len(dims)
    counted = plan.model_state_bytes(dims, BASE["vocab_size"], torch.float32, "lora",
                                     lora_rank=0) // 4 - (2 * L + 1) * H
    assert counted == sum(p.numel() for n, p in model.named_parameters()
                          if not ("norm" in n or "shared_expert_gate" in n
                                  or n.endswith("_proj.bias")))


# ---- PEFT LoRA on the expert weights (LoraConfig(target_parameters=[...])) -------------------

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def expert_lora_pair(family, target_parameters=EXPERTS, r=4, dropout=0.2, overrides=None,
                     policy="balanced", **lora):
    """(PEFT reference, patched copy): LoRA on the attention (with lora_dropout ``dropout``, its
    masks replayed in the reference from the fused op's seeds) and on the expert weights named
    in ``target_parameters``; the base model frozen, as PEFT leaves it. PEFT refuses dropout on
    expert parameters, so the attention's dropout is set on its modules after get_peft_model."""
    peft = pytest.importorskip("peft")
    from test_lora_dropout import replay_fused_dropout

    from ckpt_ext import blocks
    cfg = peft.LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=ATTENTION, target_parameters=target_parameters,
                          **lora)
    ref = peft.get_peft_model(make(family, **(overrides or {})), cfg)
    model = copy.deepcopy(ref)
    ckpt_ext.patch_llama(model, policy, fuse_lm_head=False)
    if dropout:
        for layer in model.get_base_model().model.layers:
            for name in ATTENTION:
                proj = getattr(layer.self_attn, name)
                proj.lora_dropout[proj.active_adapters[0]] = torch.nn.Dropout(dropout)
        replay_fused_dropout(ref, {f"self_attn.{n}": blocks.PROJECTIONS.index(f"self_attn.{n}")
                                   for n in ATTENTION}, dropout)
    return ref, model


def compare_expert_lora(ref, model, weights=("gate_up_proj", "down_proj")):
    """Loss and every trainable gradient equal PEFT's own forward; every layer fused; the
    experts' factors among the gradients and the frozen experts without one."""
    data = batch(True)
    r = loss_and_grads(ref, *data)
    torch.manual_seed(1234)
    g = loss_and_grads(model, *data)
    assert sum(fused_calls(model.get_base_model())) == 3, fused_calls(model.get_base_model())
    # the wrappers nest: the outer one's factors are experts.lora_*, the inner experts.base_layer.*
    expert_factors = [n for n in r[1] if ".mlp.experts." in n and ".lora_" in n]
    moe_layers = sum(1 for layer in ref.get_base_model().model.layers
                     if "experts" in layer.mlp._modules)
    assert len(expert_factors) == 2 * len(weights) * moe_layers, expert_factors
    assert_same(r, g, experts_trained=False)
    return r, g


@pytest.mark.parametrize("family,policy", [("qwen3_moe", "balanced"), ("mixtral", "fast"),
                                           ("qwen2_moe", "min_memory")])
def test_lora_on_experts_matches_peft(family, policy):
    """PEFT LoRA on both expert weights (the wrappers nested) and on the attention with dropout
    0.2 (Qwen2-MoE: its gated shared expert untouched by the adapters), the fused op given the
    factors, never the merged weight: loss and every adapter gradient equal PEFT's forward, in
    each preset; rank 4 keeps the low-rank GEMMs on torch._grouped_mm."""
    compare_expert_lora(*expert_lora_pair(family, policy=policy))


@pytest.mark.parametrize("target", ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
def test_lora_on_one_expert_weight_in_token_chunks(target):
    """LoRA on one of the two expert weights at rank 3 (the low-rank GEMMs per expert: rank rows
    not 16-byte aligned), in token chunks of a few tokens: PEFT's loss and gradients."""
    ref, model = expert_lora_pair("qwen3_moe", [target], r=3, dropout=0.0, policy="min_memory")
    ckpt_ext.config.update(chunk_bytes="16KiB")
    compare_expert_lora(ref, model, weights=(target.rsplit(".", 1)[1],))


def test_rslora_and_a_named_adapter():
    """use_rslora (scaling alpha / sqrt(r)) under an adapter that is not "default": the fused op
    reads the active adapter's factors and scaling."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, use_rslora=True,
                          target_modules=ATTENTION, target_parameters=EXPERTS)
    ref = peft.get_peft_model(make("mixtral"), cfg, adapter_name="experts_r4")
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", fuse_lm_head=False)
    assert ref.get_base_model().model.layers[0].mlp.experts.scaling["experts_r4"] == 4.0
    compare_expert_lora(ref, model)


def test_disabled_expert_adapters_are_not_computed():
    """Inside PEFT's disable_adapter() the fused op gets the base experts alone, as PEFT's forward
    computes them; outside it the factors again."""
    ref, model = expert_lora_pair("olmoe", dropout=0.0)
    ids, mask, labels = batch(False)

    def loss(m):  # a training forward (the fused path), nothing trainable left to backward
        m.train()
        return m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss

    with ref.disable_adapter(), model.disable_adapter():
        r, g = loss(ref), loss(model)
    torch.testing.assert_close(g, r, **TOL)
    assert sum(fused_calls(model.get_base_model())) == 3
    torch.testing.assert_close(loss(model), loss(ref), **TOL)
    assert abs(loss(model) - g) > 1e-4  # the adapters count
    assert sum(fused_calls(model.get_base_model())) == 9


def delegated(model):
    return [k for layer in model.get_base_model().model.layers for k in layer.forward.calls
            if k.startswith("delegated")]


def test_expert_adapters_the_op_does_not_compute_delegate_by_name():
    """Two active adapters on the experts, or a dropout module put on an expert wrapper by hand
    (PEFT itself refuses lora_dropout there): the MoE layers run PEFT's own forward, with a
    warning naming why; the loss is still PEFT's."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=ATTENTION,
                          target_parameters=EXPERTS)
    ref = peft.get_peft_model(make("qwen3_moe"), cfg)
    ref.add_adapter("second", peft.LoraConfig(r=2, init_lora_weights=False,
                                              target_parameters=EXPERTS))
    ref.base_model.set_adapter(["default", "second"])
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "balanced", fuse_lm_head=False)
    data = batch(False)
    with pytest.warns(UserWarning, match="several active adapters"):
        got = loss_and_grads(model, *data)[0].loss
    torch.testing.assert_close(got, loss_and_grads(ref, *data)[0].loss, **TOL)
    assert delegated(model) and all("mlp.experts" in k and "several active adapters" in k
                                    for k in delegated(model)), delegated(model)

    ref, model = expert_lora_pair("mixtral", dropout=0.0)
    model.get_base_model().model.layers[1].mlp.experts.lora_dropout["default"] = \
        torch.nn.Dropout(0.1)
    with pytest.warns(UserWarning, match="PEFT refuses dropout on expert parameters"):
        loss_and_grads(model, *batch(False))
    assert len(delegated(model)) == 1


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_plan_counts_the_expert_factors_peft_makes(family):
    """The plan's expert LoRA state (--expert-lora-rank r) is 16 bytes (fp32 weight, gradient
    and AdamW's two moments) for each factor element PEFT's target_parameters create: the
    tensors the fused op is given."""
    peft = pytest.importorskip("peft")
    from ckpt_ext import plan
    from ckpt_ext.hf.families import layer_dims_from_config
    model = make(family)
    dims = layer_dims_from_config(model.config)
    cfg = peft.LoraConfig(r=3, target_parameters=EXPERTS)
    factors = sum(p.numel() for n, p in peft.get_peft_model(model, cfg).named_parameters()
                  if ".mlp.experts." in n and ".lora_" in n)
    extra = [plan.model_state_bytes(dims, BASE["vocab_size"], torch.float32, "lora",
                                    lora_rank=0, expert_lora_rank=r) for r in (0, 3)]
    assert factors > 0 and extra[1] - extra[0] == 16 * factors
