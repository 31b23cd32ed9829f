"""QLoRA: decoder layers whose projections are bitsandbytes 4-bit / 8-bit layers under PEFT LoRA
(ckpt_ext.hf.quantized). The models are loaded as users load them (``from_pretrained`` with a
``BitsAndBytesConfig``, ``prepare_model_for_kbit_training``, ``get_peft_model``) from tiny
random checkpoints, on the CPU in float32 compute; the fused model's loss and adapter gradients
are held to the accuracy rule against a float64 model with the dequantized weights, with the
unpatched PEFT + bitsandbytes model as the baseline.
"""
import copy
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the QLoRA tests need it "
    "(pip install -e '.[test]')")
peft = pytest.importorskip("peft", reason="peft is not installed: the QLoRA tests need it "
                           "(pip install -e '.[test]')")
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: the QLoRA "
                          "tests need it (pip install -e '.[test]')")

from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

import ckpt_ext  # noqa: E402
from ckpt_ext import blocks  # noqa: E402
from ckpt_ext.hf import quantized  # noqa: E402
from ckpt_ext.hf.adapters import read_projection  # noqa: E402
from hf_fixtures import make_batch, make_model  # noqa: E402
from reference import FACTOR_GRAD, FACTOR_OUT, check_vs_baseline  # noqa: E402
from test_lora_dropout import replay_fused_dropout  # noqa: E402

QUANTS = {
    "nf4-dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                   bnb_4bit_compute_dtype=torch.float32),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
    # the other two 4-bit variants (segments' tests)
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.float32),
    "fp4-dq": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                   bnb_4bit_compute_dtype=torch.float32),
}
# LoRA on these; k_proj and up_proj stay bare quantized layers
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
STREAMS = {path: blocks.PROJECTIONS.index(path) for path in blocks.PROJECTIONS
           if path.split(".")[1] in TARGETS}
# Phi-3: LoRA on its fused modules (their dropout stream: their first projection's)
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PHI3_STREAMS = {"self_attn.qkv_proj": 0, "self_attn.o_proj": 3, "mlp.gate_up_proj": 4,
                "mlp.down_proj": 6}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family (and config overrides) -> a saved tiny checkpoint of it (perturbed weights)."""
    saved = {}

    def get(family, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in saved:
            path = tmp_path_factory.mktemp(family)
            make_model(family, "sdpa", **overrides).save_pretrained(path)
            saved[key] = path
        return saved[key]
    return get


def qlora_model(path, quant, dropout=0.0, targets=TARGETS):
    """The QLoRA recipe on a checkpoint: quantized load, prepare_model_for_kbit_training
    (fp32 norms, embeddings and head; HF gradient checkpointing on), LoRA adapters (random B,
    so that every adapter gradient is nonzero), training mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=BitsAndBytesConfig(**QUANTS[quant]), device_map="cpu",
            dtype=torch.float32, attn_implementation="sdpa")
        model = peft.prepare_model_for_kbit_training(model)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets,
        init_lora_weights=False))
    return model.train()


def released(t):
    """A placeholder between passes: no memory (one element, expanded to its filled shape)."""
    return t.untyped_storage().nbytes() <= t.element_size()


def bnb_weight(module):
    """The weight a bitsandbytes layer multiplies with in training, read through its own
    forward (of the identity, without its bias: exact in float32), independently of
    ckpt_ext's dequantization."""
    bias, training = module.bias, module.training
    module.bias = None
    module.train()
    try:
        with torch.enable_grad():
            eye = torch.eye(module.in_features, requires_grad=True)
            w = module(eye).detach().t().contiguous()
    finally:
        module.bias = bias
        module.train(training)
    return w


def dense_f64(model):
    """A float64 copy of a QLoRA model whose bitsandbytes layers are nn.Linear with the weights
    bitsandbytes multiplies with (``bnb_weight``; exact in float64): the reference."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if quantized.is_quantized_base(module):
            parent = ref.get_submodule(name.rpartition(".")[0])
            dense = nn.Linear(module.in_features, module.out_features,
                              bias=module.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(bnb_weight(module))
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            dense.weight.requires_grad_(False)
            if dense.bias is not None:
                dense.bias.requires_grad_(module.bias.requires_grad)
            parent._modules[name.rpartition(".")[2]] = dense
    return ref.double()


def loss_and_grads(model, ids, mask, labels, **call):
    """The model's training loss and gradients; for the float64 reference the loss is taken
    from its logits in float64 (transformers' loss upcasts logits to float32 only)."""
    model.zero_grad(set_to_none=True)
    if next(model.parameters()).dtype == torch.float64:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **call).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                               ignore_index=-100)
    else:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False,
                     **call).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def fused_calls(model):
    return [dict(layer.forward.calls) for layer in model.get_base_model().model.layers]


def assert_rule(got, base, ref):
    """The accuracy rule for the loss and every gradient (got, base: float32; ref: float64)."""
    (loss, grads), (loss_b, grads_b), (loss_r, grads_r) = got, base, ref
    # the reference computes what bitsandbytes computes
    torch.testing.assert_close(loss_b.double(), loss_r, rtol=1e-5, atol=0)
    check_vs_baseline("loss", loss, loss_b, loss_r, FACTOR_OUT)
    assert set(grads) == set(grads_b) == set(grads_r)
    assert grads and all("lora_" in n for n in grads)
    for name in grads_r:
        check_vs_baseline(name, grads[name], grads_b[name], grads_r[name], FACTOR_GRAD)


def run_three(model, batch, preset, dropout, streams=STREAMS, **patch):
    """(fused, unpatched PEFT + bitsandbytes, float64 dense) loss and gradients."""
    ref = dense_f64(model)
    fused = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF gradient checkpointing: the fused layers skip it
        ckpt_ext.patch_llama(fused, preset, **patch)
    if dropout:
        replay_fused_dropout(model, streams, dropout)
        replay_fused_dropout(ref, streams, dropout)
    ids, mask, labels = batch
    base = loss_and_grads(model, ids, mask, labels)
    want = loss_and_grads(ref, ids, mask, labels)
    torch.manual_seed(1234)
    got = loss_and_grads(fused, ids, mask, labels)
    n = len(fused.get_base_model().model.layers)
    assert fused_calls(fused) == [{"fused": 1}] * n
    return got, base, want


# ---- the dequantized weight ---------------------------------------------------------------------

@pytest.mark.parametrize("blocksize", [32, 64, 128, 256])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True], ids=["plain", "double-quant"])
def test_4bit_weight_is_what_bitsandbytes_multiplies_with(blocksize, quant_type, double):
    """A Linear4bit's dequantized weight times x is bitsandbytes' own training forward, bit for
    bit on the CPU (odd shapes: 37 x 83, not a multiple of the block)."""
    torch.manual_seed(blocksize)
    lin = nn.Linear(83, 37)
    m = bnb.nn.Linear4bit(83, 37, compute_dtype=torch.float32, compress_statistics=double,
                          quant_type=quant_type)
    m.load_state_dict(lin.state_dict())
    m.weight.blocksize = blocksize
    m = m.to("cpu")
    assert m.weight.quant_state.blocksize == blocksize and m.weight.quant_state.nested == double
    x = torch.randn(5, 83, requires_grad=True)
    want = m(x)
    w = quantized.dequantize(m, torch.float32)
    assert w.shape == (37, 83) and w.dtype == torch.float32
    assert torch.equal(F.linear(x, w, m.bias), want)
    # and it is a 4-bit approximation of the dense weight, not something else
    err = (w - lin.weight).abs().max().item()
    assert 0 < err < 0.5 * lin.weight.abs().max().item()
    assert quantized.dequantize(m, torch.float64).dtype == torch.float64


def test_8bit_weight_is_cb_times_scb_over_127():
    """A frozen Linear8bitLt's dequantized weight is CB * SCB / 127, and x times it is
    bitsandbytes' CPU training forward, bit for bit."""
    torch.manual_seed(0)
    lin = nn.Linear(83, 37)
    m = bnb.nn.Linear8bitLt(83, 37, has_fp16_weights=False, threshold=6.0)
    m.load_state_dict(lin.state_dict())
    m = m.to("cpu").train()
    w = quantized.dequantize(m, torch.float32)
    cb, scb = m.weight.CB, m.weight.SCB
    torch.testing.assert_close(w.double(), cb.double() * scb.double()[:, None] / 127,
                               rtol=1e-6, atol=0)
    x = torch.randn(5, 83, requires_grad=True)
    want = m(x)  # moves CB / SCB to m.state: read from there now
    assert m.weight.CB is None and m.state.CB is not None
    assert torch.equal(F.linear(x, quantized.dequantize(m, torch.float32), m.bias), want)


def test_unusable_quantized_layers_are_refused_by_name():
    """has_fp16_weights=True, a layer not quantized yet, and other quantizers' layers: a reason
    naming the class (the layer then runs HF's forward)."""
    trainable = bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=True).to("cpu")
    assert "has_fp16_weights=True" in read_projection(trainable, True)
    fresh = bnb.nn.Linear4bit(16, 8)  # never moved to a device: not quantized
    assert "not quantized yet" in read_projection(fresh, True)
    sharded = bnb.nn.Linear4bit(16, 8).to("cpu")
    assert read_projection(sharded, True).weight.numel() == 0  # a placeholder: fused
    sharded.weight.ds_id = 3  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    assert "sharded (DeepSpeed ZeRO-3 or FSDP2)" in read_projection(sharded, True)

    class QuantLinear(nn.Module):  # the shape of GPTQ / AWQ / HQQ layers: not an nn.Linear
        pass
    assert "QuantLinear, not a plain nn.Linear" in read_projection(QuantLinear(), True)


def test_quantized_head_is_not_fused_with_the_reason(checkpoints):
    """A quantized lm_head (bitsandbytes leaves it dense unless told): the layers fuse, the head
    stays HF's, and the warning says why."""
    model = qlora_model(checkpoints("llama"), "nf4-dq")
    inner = model.get_base_model()
    head = bnb.nn.Linear4bit(inner.lm_head.in_features, inner.lm_head.out_features, bias=False,
                             compute_dtype=torch.float32)
    head.load_state_dict(inner.lm_head.state_dict())
    inner.lm_head = head.to("cpu")
    with pytest.warns(UserWarning, match="LM head is not fused: lm_head is a bitsandbytes "
                      "Linear4bit"):
        ckpt_ext.patch_llama(model, "min_memory")
    ids, mask, labels = make_batch(pad=True)
    loss, _ = loss_and_grads(model, ids, mask, labels)
    assert torch.isfinite(loss) and fused_calls(model) == [{"fused": 1}] * 3


# ---- whole models -------------------------------------------------------------------------------

# every family of the issue x quantization x preset, LoRA dropout on every other case; Phi-3's
# fused modules once
CASES = [(f, q, p, 0.2 * (i % 2)) for i, (f, q, p) in enumerate(
    (f, q, p) for f in ("llama", "qwen3", "mistral") for q in ("nf4-dq", "fp4", "int8")
    for p in ("fast", "balanced", "min_memory"))] + [("phi3", "nf4-dq", "balanced", 0.2)]


@pytest.mark.parametrize("family,quant,preset,dropout", CASES,
                         ids=[f"{f}-{q}-{p}-drop{d}" for f, q, p, d in CASES])
def test_qlora_matches_peft_bitsandbytes(checkpoints, family, quant, preset, dropout):
    """Every layer fused; loss and every adapter gradient within the accuracy rule of the float64
    dense reference, bitsandbytes + PEFT unpatched being the baseline (left padding; with LoRA
    dropout, the unpatched models replay the op's masks). Llama has biases on every
    projection; Phi-3's quantized qkv_proj / gate_up_proj give their row blocks."""
    phi3 = family == "phi3"
    model = qlora_model(checkpoints(family), quant, dropout, PHI3_TARGETS if phi3 else TARGETS)
    assert_rule(*run_three(model, make_batch(pad=True), preset, dropout,
                           PHI3_STREAMS if phi3 else STREAMS))


@pytest.mark.parametrize("family,quant", [("llama", "nf4-dq"), ("llama", "int8"),
                                          ("qwen3", "fp4"), ("mistral", "int8")])
def test_qlora_packed_sequences(checkpoints, family, quant):
    """Packed documents (position ids restart, no mask): fused, within the rule."""
    model = qlora_model(checkpoints(family), quant)
    ref, fused = dense_f64(model), copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(fused, "min_memory")
    g = torch.Generator().manual_seed(3)
    lengths = [7, 1, 12, 3]
    ids = torch.randint(1, 128, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100
    runs = [loss_and_grads(m, ids, None, labels, position_ids=pos) for m in (fused, model, ref)]
    assert fused_calls(fused) == [{"fused": 1}] * 3
    assert_rule(*runs)


def test_qlora_with_offload_matches(checkpoints):
    """offload='cpu' with quantized bases: the saved activations go to the host pool, the
    placeholders (never holding memory between passes) stay; same result."""
    model = qlora_model(checkpoints("llama"), "nf4-dq", 0.2)
    assert_rule(*run_three(model, make_batch(pad=True), "balanced", 0.2, offload="cpu"))


def test_dequantized_once_per_pass_and_never_kept(checkpoints, monkeypatch):
    """Each quantized module is dequantized once in the forward and once in the backward of each
    layer (shared by the token chunks and by a fused module's projections), and the op saves
    only placeholders, which hold no memory between the passes."""
    model = qlora_model(checkpoints("llama"), "nf4-dq")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(model, "min_memory")
    counts = {}
    dequantize = quantized.dequantize

    def counting(module, dtype):
        counts[id(module)] = counts.get(id(module), 0) + 1
        return dequantize(module, dtype)
    monkeypatch.setattr(quantized, "dequantize", counting)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    ids, mask, labels = make_batch(pad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    modules = [m for m in model.modules() if quantized.is_quantized_base(m)]
    assert len(modules) == 3 * 7 and sorted(counts.values()) == [1] * 21
    holders = [t for t in saved if quantized.is_placeholder(t)]
    assert len(holders) == 3 * 7 and all(released(t) for t in holders)
    shapes = {(m.out_features, m.in_features) for m in modules}
    assert not any(tuple(t.shape) in shapes for t in saved
                   if not quantized.is_placeholder(t) and not isinstance(t, nn.Parameter))
    loss.backward()
    assert sorted(counts.values()) == [2] * 21
    assert all(released(t) for t in holders)


@pytest.mark.parametrize("quant", ["nf4-dq", "fp4"])
def test_eval_forward_before_training_step(checkpoints, quant):
    """An eval forward without grad repacks Linear4bit weights for bitsandbytes' AVX512-BF16 CPU
    kernel (quant_state.packing_format_for_cpu; done here by bitsandbytes' own conversion on
    CPUs without it); the next fused training step reads the repacked weights (their codes and
    their bf16 block scales) rightly: within the rule against the model holding those same
    weights in the usual layout. Shapes that bitsandbytes can repack (rows a multiple of 32,
    columns of the blocksize)."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu, dequantize_blockwise
    model = qlora_model(checkpoints("llama", intermediate_size=192), quant)
    fused = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(fused, "balanced")
    ids, mask, labels = make_batch(pad=True)
    fused.eval()
    with torch.no_grad():
        fused(input_ids=ids, attention_mask=mask, use_cache=False)
    fused.train()
    layers4 = [m for m in fused.modules() if quantized.is_quantized_base(m)]
    for m in layers4:
        if not getattr(m.weight.quant_state, "packing_format_for_cpu", False):
            assert not m.support_avx512bf16_for_cpu  # bitsandbytes repacks where it can
            m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu(
                m.weight.data, m.weight.quant_state)
    assert all(m.weight.quant_state.packing_format_for_cpu for m in layers4)
    # the reference: the unrepacked model with the block scales rounded to bf16 as repacking
    # rounds them
    for m in model.modules():
        if quantized.is_quantized_base(m):
            st = m.weight.quant_state
            scales = (dequantize_blockwise(st.absmax, st.state2) + st.offset if st.nested
                      else st.absmax)
            st.absmax, st.nested = scales.float().bfloat16().float(), False
    ref = dense_f64(model)
    base = loss_and_grads(model, ids, mask, labels)
    got = loss_and_grads(fused, ids, mask, labels)
    assert fused_calls(fused) == [{"delegated: grad is disabled (inference)": 1, "fused": 1}] * 3
    assert_rule(got, base, loss_and_grads(ref, ids, mask, labels))
    # the module is left repacked, as bitsandbytes left it
    assert all(m.weight.quant_state.packing_format_for_cpu for m in layers4)


def test_compiled_qlora_model_runs_its_layers_fused_in_eager_mode(checkpoints, monkeypatch):
    """torch.compile (aot_eager) of a patched QLoRA model (HF gradient checkpointing on, as the
    recipe leaves it): each quantized layer runs fused in eager mode (a graph break, its
    dequantization outside the graph), with the eager model's loss and adapter gradients. A
    projection read while compiling (a layer quantized after patching) is refused by name."""
    model = qlora_model(checkpoints("llama"), "nf4-dq", 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(model, "balanced")
    batch = make_batch(pad=True)
    torch.manual_seed(7)
    loss_e, grads_e = loss_and_grads(model, *batch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(7)
    loss_c, grads_c = loss_and_grads(compiled, *batch)
    assert fused_calls(model) == [{"fused": 2}] * 3
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    grads_c = {n.replace("_orig_mod.", ""): g for n, g in grads_c.items()}
    assert grads_c.keys() == grads_e.keys() and grads_e
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_c[n], g, rtol=1e-5, atol=1e-7, msg=n)
    torch._dynamo.reset()
    proj = model.get_base_model().model.layers[0].self_attn.q_proj
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "under torch.compile" in read_projection(proj, True)


def test_step_peak_holds_one_layers_dequantized_weights(checkpoints):
    """The CPU allocator's peak of a min_memory QLoRA step grows with the depth by what each
    layer saves (its input), not by its dequantized weights: 6 layers peak less than one
    layer's dequantized bytes above 2 layers."""
    peaks, per_layer = {}, None
    ids, mask, labels = make_batch(pad=True)
    for n in (2, 6):
        model = qlora_model(checkpoints("llama", num_hidden_layers=n, intermediate_size=512),
                            "nf4-dq")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.patch_llama(model, "min_memory")
        layer = model.get_base_model().model.layers[0]
        per_layer = 4 * sum(m.in_features * m.out_features for m in layer.modules()
                            if quantized.is_quantized_base(m))

        def step():
            model(input_ids=ids, attention_mask=mask, labels=labels,
                  use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        peaks[n] = ckpt_ext.peak_memory_bytes(step)
        assert fused_calls(model) == [{"fused": 1}] * n
    print(f"  peaks {peaks}, one layer's dequantized weights {per_layer}")
    assert peaks[6] - peaks[2] < per_layer


# ---- segments of several layers (segment_layers=k, ckpt_ext.segments) -------------------------

def segment_step(model, k, preset, batch, seed, offload=None, monkeypatch=None):
    """A deep copy of ``model`` patched with ``segment_layers=k``: its loss and gradients for
    LoRA dropout seeds drawn after torch.manual_seed(seed), and the rebuilds it ran."""
    from ckpt_ext import segments
    fused = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF gradient checkpointing: the fused layers skip it
        ckpt_ext.patch_llama(fused, preset, offload=offload, segment_layers=k)
    rebuilds = []
    rebuild = segments.Segment._rebuild

    def counted(seg, upto):
        rebuilds.append(upto)
        return rebuild(seg, upto)
    monkeypatch.setattr(segments.Segment, "_rebuild", counted)
    torch.manual_seed(seed)
    got = loss_and_grads(fused, *batch)
    monkeypatch.undo()
    n = len(fused.get_base_model().model.layers)
    assert fused_calls(fused) == [{"fused": 1}] * n
    return got, rebuilds


SEGMENT_CASES = [  # quant, layers, k, preset, offload
    ("nf4-dq", 4, 2, "min_memory", None), ("nf4-dq", 3, 2, "balanced", "cpu"),
    ("nf4", 4, 4, "min_memory", None), ("fp4", 4, 2, "balanced", None),
    ("fp4-dq", 3, 2, "min_memory", None), ("int8", 4, 4, "min_memory", "cpu"),
    ("int8", 3, 2, "balanced", None)]


@pytest.mark.parametrize("quant,layers,k,preset,offload", SEGMENT_CASES,
                         ids=[f"{q}-{n}x{k}-{p}" + ("-offload" if o else "")
                              for q, n, k, p, o in SEGMENT_CASES])
def test_segments_equal_one_layer_segments(checkpoints, quant, layers, k, preset, offload,
                                           monkeypatch):
    """segment_layers=k on QLoRA layers (LoRA dropout 0.05, left padding): the rebuild
    dequantizes each replayed layer's weights again, so the loss and every adapter gradient
    equal those of k = 1 bit for bit, one rebuild per segment of several layers."""
    seed = int.from_bytes(__import__("os").urandom(4), "little")
    print(f"seed {seed}")
    model = qlora_model(checkpoints("llama", num_hidden_layers=layers), quant, 0.05)
    batch = make_batch(pad=True, seed=seed % 1000)
    (loss1, grads1), none = segment_step(model, 1, preset, batch, seed, offload, monkeypatch)
    (loss, grads), rebuilds = segment_step(model, k, preset, batch, seed, offload, monkeypatch)
    assert none == [] and rebuilds == [min(k, layers - a) - 1 for a in range(0, layers, k)
                                       if min(k, layers - a) > 1]
    assert torch.equal(loss, loss1), (loss, loss1)
    assert grads.keys() == grads1.keys() and grads and all("lora_" in n for n in grads)
    assert not [n for n in grads if not torch.equal(grads[n], grads1[n])]


@pytest.mark.parametrize("mode", ["autocast_bf16", "retain_graph"])
def test_segments_under_autocast_and_a_second_backward(checkpoints, mode):
    """bf16 autocast (the rebuild dequantizes in the recorded compute dtype) and a second
    backward through a retained graph (which rebuilds and dequantizes again): segments of 2
    equal k = 1 bit for bit."""
    model = qlora_model(checkpoints("llama", num_hidden_layers=4), "fp4-dq", 0.05)
    ids, mask, labels = make_batch(pad=True, seed=5)
    runs = []
    for k in (1, 2):
        fused = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.patch_llama(fused, "min_memory", segment_layers=k)
        torch.manual_seed(11)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast_bf16"):
            loss = fused(input_ids=ids, attention_mask=mask, labels=labels,
                         use_cache=False).loss
        loss.backward(retain_graph=mode == "retain_graph")
        if mode == "retain_graph":
            loss.backward()
        assert fused_calls(fused) == [{"fused": 1}] * 4
        runs.append((loss.detach(), {n: p.grad for n, p in fused.named_parameters()
                                     if p.grad is not None}))
    (loss1, grads1), (loss2, grads2) = runs
    assert torch.equal(loss1, loss2) and grads1.keys() == grads2.keys() and grads1
    assert not [n for n in grads1 if not torch.equal(grads1[n], grads2[n])]


def test_segment_rebuild_dequantizes_one_layer_at_a_time(checkpoints, monkeypatch):
    """A segment of 4 QLoRA layers: each quantized module of layers 1..3 is dequantized three
    times (forward, the rebuild's forward, backward), layer 4's twice; at no moment are two
    layers' dequantized weights filled in (the rebuild runs before the last layer's weights are
    filled for its backward), and none is left filled after the step."""
    model = qlora_model(checkpoints("llama", num_hidden_layers=4), "nf4-dq", 0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=4)
    layers = model.get_base_model().model.layers
    layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()
                if quantized.is_quantized_base(m)}
    counts, filled, most, holders = {}, {}, [0], []
    dequantize = quantized.dequantize

    def counting(module, dtype):
        counts[id(module)] = counts.get(id(module), 0) + 1
        return dequantize(module, dtype)
    fill, free = quantized.Transient.fill, quantized.Transient.free

    def filling(self):
        fill(self)
        idx = {layer_of[id(getattr(p, "_ckpt_ext_dequantize")[0])] for p in self.holders}
        assert len(idx) == 1
        filled[id(self)] = idx.pop()
        holders.extend(self.holders)
        # the layers whose placeholders hold a dequantized weight now
        live = {layer_of[id(getattr(p, "_ckpt_ext_dequantize")[0])] for p in holders
                if not released(p)}
        most[0] = max(most[0], len(live), len(set(filled.values())))

    def freeing(self):
        free(self)
        filled.pop(id(self), None)
    monkeypatch.setattr(quantized, "dequantize", counting)
    monkeypatch.setattr(quantized.Transient, "fill", filling)
    monkeypatch.setattr(quantized.Transient, "free", freeing)
    ids, mask, labels = make_batch(pad=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    assert sorted(counts.values()) == [1] * 28 and not filled
    loss.backward()
    per_layer = [sorted(n for m, n in counts.items() if layer_of[m] == i) for i in range(4)]
    assert per_layer == [[3] * 7] * 3 + [[2] * 7]
    assert most[0] == 1 and not filled
    assert holders and all(released(p) for p in holders)


def test_segment_step_peak_holds_one_layers_dequantized_weights(checkpoints):
    """The CPU allocator's peak of a min_memory QLoRA step with segments of 2 exceeds k = 1's by
    the rebuilt input and the rebuild's working set (measured: 3.3 layer inputs), less than a
    quarter of one layer's dequantized weights; a rebuild run while the last layer's weights
    are filled for its backward (two layers' at once) measured half of them above k = 1."""
    ids, mask, labels = make_batch(pad=True)
    model = qlora_model(checkpoints("llama", num_hidden_layers=4, intermediate_size=512),
                        "nf4-dq")
    layer = model.get_base_model().model.layers[0]
    per_layer = 4 * sum(m.in_features * m.out_features for m in layer.modules()
                        if quantized.is_quantized_base(m))
    peaks = {}
    for k in (1, 2):
        fused = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.patch_llama(fused, "min_memory", segment_layers=k)

        def step():
            fused(input_ids=ids, attention_mask=mask, labels=labels,
                  use_cache=False).loss.backward()
        peaks[k] = ckpt_ext.peak_memory_bytes(step)
    x_bytes = 4 * ids.numel() * model.config.hidden_size
    print(f"  peaks {peaks}, one layer input {x_bytes}, one layer's dequantized {per_layer}")
    assert peaks[2] - peaks[1] < per_layer / 4


# ---- the plan (ckpt_ext.plan, weights="qlora") against the CPU allocator ------------------------

PLAN_CASE = dict(H=256, heads=4, kv=2, D=40, I=1200, V=1024, L=3)


@pytest.fixture(scope="module")
def plan_checkpoint(tmp_path_factory):
    c = PLAN_CASE
    cfg = transformers.LlamaConfig(
        hidden_size=c["H"], intermediate_size=c["I"], num_hidden_layers=c["L"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv"], head_dim=c["D"],
        vocab_size=c["V"], rms_norm_eps=1e-5, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("plan_llama")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def measured_peak(model, policy, S):
    """The CPU allocator's peak of a training step of the QLoRA model patched with ``policy``
    at (1, S) tokens, gradients of an earlier step present."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(model, policy)
    ids = torch.randint(PLAN_CASE["V"], (1, S), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    step()
    peak = ckpt_ext.peak_memory_bytes(step)
    ckpt_ext.unpatch_llama(model)
    return peak


@pytest.mark.parametrize("setup", ["min_memory", "fast"])
def test_plan_step_peak_of_qlora_within_10pct_of_the_cpu_allocator(plan_checkpoint, setup):
    """plan.step_peak(quantized_base=True) (the dense LoRA step and one layer's dequantized
    weights) within 10% of the measured peak of an nf4 QLoRA step (fp32, CPU path)."""
    if torch.cuda.is_available():
        pytest.skip("measures the CPU allocator")
    from ckpt_ext import plan
    c, S = PLAN_CASE, 900
    model = qlora_model(plan_checkpoint, "nf4-dq", targets="all-linear")
    peak = measured_peak(model, setup, S)
    layers = [plan.LayerDims(c["H"], c["heads"], c["kv"], c["D"], c["I"])] * c["L"]
    want = plan.step_peak(setup, layers, c["V"], 1, S, torch.float32, path="cpu",
                          train_weights=False, quantized_base=True)
    print(f"  {setup}: measured {peak}, plan {want.peak} ({want.phase})")
    assert abs(want.peak - peak) <= 0.10 * peak


def test_min_memory_qlora_peaks_below_hf_checkpointing_at_4k(plan_checkpoint):
    """At S 4096 an nf4 QLoRA step with min_memory peaks below HF gradient checkpointing with
    the fused loss (policy 'torch', bitsandbytes' own forward) on the same model, and the plan
    has both within 10%."""
    if torch.cuda.is_available():
        pytest.skip("measures the CPU allocator")
    from ckpt_ext import plan
    c, S = PLAN_CASE, 4096
    model = qlora_model(plan_checkpoint, "nf4-dq", targets="all-linear")
    fused = measured_peak(model, "min_memory", S)
    hf = measured_peak(model, "torch", S)
    print(f"  min_memory {fused}, HF checkpointing + fused loss {hf}")
    assert fused < hf
    layers = [plan.LayerDims(c["H"], c["heads"], c["kv"], c["D"], c["I"])] * c["L"]
    for setup, peak in (("min_memory", fused), ("hf_gc+fused", hf)):
        want = plan.step_peak(setup, layers, c["V"], 1, S, torch.float32, path="cpu",
                              train_weights=False, quantized_base=True).peak
        assert abs(want - peak) <= 0.10 * peak, (setup, want, peak)


def test_qlora_under_bf16_autocast(checkpoints):
    """Under bf16 autocast (Trainer(bf16=True)) the QLoRA model's layers and its fp32 head (as
    prepare_model_for_kbit_training leaves it) stay fused: the dequantized weights in bf16, the
    loss and the adapter gradients within the rule at bf16 against the float64 reference,
    PEFT + bitsandbytes under the same autocast being the baseline."""
    model = qlora_model(checkpoints("llama"), "nf4-dq")
    ref = dense_f64(model)
    fused = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(fused, "balanced")
    assert type(fused.get_base_model().forward).__name__ == "FusedHeadForward"
    assert fused.get_base_model().lm_head.weight.dtype == torch.float32
    batch = make_batch(pad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(fused, *batch)
        base = loss_and_grads(model, *batch)
    want = loss_and_grads(ref, *batch)
    assert fused_calls(fused) == [{"fused": 1}] * 3
    (loss, grads), (loss_b, grads_b), (loss_r, grads_r) = got, base, want
    check_vs_baseline("loss", loss, loss_b, loss_r, FACTOR_OUT, dtype=torch.bfloat16)
    assert set(grads) == set(grads_b) == set(grads_r) and grads
    for name in grads_r:
        check_vs_baseline(name, grads[name], grads_b[name], grads_r[name], FACTOR_GRAD,
                          dtype=torch.bfloat16)


def test_auto_budget_counts_one_layers_dequantized_weights(checkpoints):
    """policy="auto": the activation budget holds one layer's dequantized weights besides the
    layers' saved bytes. The QLoRA model chooses, for a budget, what the same model with a
    dense base chooses for that budget less the transient; below every layer 'min_memory'
    plus the transient the forward raises, naming it; with offload too."""
    from ckpt_ext import plan
    ids, mask, labels = make_batch(pad=True)
    B, S = ids.shape
    path = checkpoints("llama")
    model = qlora_model(path, "nf4-dq")
    layers = model.get_base_model().model.layers
    transient = 4 * sum(m.in_features * m.out_features for m in layers[0].modules()
                        if quantized.is_quantized_base(m))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        dense = peft.prepare_model_for_kbit_training(dense)
    torch.manual_seed(0)
    dense = peft.get_peft_model(dense, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)).train()
    dims = [plan.LayerDims(64, 4, 2, 16, 172)] * 3
    least = sum(plan.layer_bytes("min_memory", d, B, S, torch.float32) for d in dims)
    fast = sum(plan.layer_bytes("fast", d, B, S, torch.float32) for d in dims)

    def chosen(m, budget, **kw):
        m = copy.deepcopy(m)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.patch_llama(m, "auto", activation_budget=budget, **kw)
        loss_and_grads(m, ids, mask, labels)
        (key, presets), = m.get_base_model().model.layers[0].forward.shared.auto.items()
        return key, presets, m
    for budget in (least, (least + fast) // 2, fast, 1 << 30):
        key, got, m = chosen(model, budget + transient)
        assert key[-1] == transient
        assert got == chosen(dense, budget)[1], budget
        assert sum(c.get("fused", 0) for c in fused_calls(m)) == \
            sum(p not in ("none", "torch") for p in got)
    with pytest.raises(ValueError, match="one layer's dequantized weights"):
        chosen(model, least + transient - 1)
    # with offload: chosen by time within the budget less the transient, same loss
    key, got, m = chosen(model, 1 << 40, offload="cpu")
    assert key[-1] == transient and fused_calls(m) == [{"fused": 1}] * 3
    torch.testing.assert_close(loss_and_grads(m, ids, mask, labels)[0],
                               loss_and_grads(model, ids, mask, labels)[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("quant", ["nf4-dq", "int8"])
def test_sft_trainer_trains_a_qlora_model_fused(tmp_path, checkpoints, quant):
    """TRL's SFTTrainer (its gradient checkpointing and bf16 on, as SFTConfig defaults: the
    fused layers take the checkpointing over, min_memory) on a patched QLoRA model: every layer
    fused at both steps, and the logged losses those of the unpatched model's run."""
    from test_training_setups import _sft_setup
    losses = {}
    for patched in (False, True):
        trl, data, tok, args = _sft_setup(tmp_path / str(patched))
        model = qlora_model(checkpoints("llama"), quant)
        if patched:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ckpt_ext.patch_llama(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data,
                                     processing_class=tok)
            trainer.train()
        assert args.gradient_checkpointing and args.bf16  # SFTConfig's defaults
        losses[patched] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if patched:
            assert fused_calls(model) == [{"fused": 2}] * 3
    # bf16 autocast in both runs: the losses agree to bf16's resolution (half its eps, relative)
    assert len(losses[True]) == 2
    torch.testing.assert_close(losses[True], losses[False], rtol=2**-9, atol=0)


# ---- DDP ----------------------------------------------------------------------------------------

def _ddp_batch(rank):
    from hf_fixtures import padded_batch
    return padded_batch(128, 2, 13, pad_row=rank % 2, pad=3, seed=100 + rank)


def _ddp_worker(rank, init_file, path, out_dir):
    import torch.distributed as dist
    from test_distributed import STEPS, WORLD, init_gloo_rank
    init_gloo_rank(rank, WORLD, init_file)
    try:
        model = qlora_model(path, "nf4-dq")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.patch_llama(model, "balanced")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.5)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            ids, mask, labels = _ddp_batch(rank)
            loss = ddp(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.save({"losses": losses, "fused": fused_calls(model),
                    "lora": {n: p.detach().clone() for n, p in model.named_parameters()
                             if "lora_" in n}}, f"{out_dir}/{rank}.pt")
        del ddp, opt, loss
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_qlora_under_ddp_trains_like_one_process(tmp_path, checkpoints):
    """A patched nf4 QLoRA model under DDP (2 gloo ranks, SGD on the adapters): every layer
    fused on every rank, and the ranks' losses and adapters those of one unpatched process
    stepping with the mean of their gradients."""
    from test_distributed import STEPS, WORLD, spawn_ranks
    path = checkpoints("llama")
    got = spawn_ranks(_ddp_worker, (str(tmp_path / "init"), str(path), str(tmp_path)),
                      tmp_path, "DDP")
    ref = qlora_model(path, "nf4-dq")
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    losses = [[] for _ in range(WORLD)]
    for _ in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            ids, mask, labels = _ddp_batch(rank)
            loss = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            (loss / WORLD).backward()
            losses[rank].append(loss.item())
        opt.step()
    for rank, r in enumerate(got):
        assert r["fused"] == [{"fused": STEPS}] * 3
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses[rank]),
                                   rtol=1e-5, atol=1e-6)
        for n, p in ref.named_parameters():
            if "lora_" in n:
                torch.testing.assert_close(r["lora"][n], p.detach(), rtol=1e-4, atol=1e-6)


# ---- sequence parallelism -----------------------------------------------------------------------

def _sp_batch():
    from hf_fixtures import padded_batch
    ids, mask, labels = padded_batch(128, 2, 14, pad_row=1, pad=9, seed=21)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _sp_worker(rank, init_file, path, out_dir):
    import torch.distributed as dist
    from ckpt_ext.hf import sequence_parallel as sp
    from test_distributed import WORLD, init_gloo_rank
    init_gloo_rank(rank, WORLD, init_file)
    try:
        group = dist.group.WORLD
        model = qlora_model(path, "nf4-dq")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.patch_llama(model, "balanced", sequence_parallel=group)
        batch = sp.shard_batch(_sp_batch(), group)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        sp.all_reduce_grads(model, group)
        torch.save({"loss": loss.detach(), "fused": fused_calls(model),
                    "grads": {n: p.grad for n, p in model.named_parameters()
                              if p.grad is not None}}, f"{out_dir}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_qlora_sequence_parallel_two_ranks_equal_one_process(tmp_path, checkpoints):
    """A patched nf4 QLoRA model with sequence_parallel= on 2 gloo ranks (each dequantizing its
    layers' weights itself), its padded batch cut by shard_batch: the ranks' losses sum to the
    one-process loss and the gradients summed over the group equal its gradients."""
    from test_distributed import spawn_ranks
    path = checkpoints("llama")
    got = spawn_ranks(_sp_worker, (str(tmp_path / "init"), str(path), str(tmp_path)),
                      tmp_path, "sequence parallel")
    model = qlora_model(path, "nf4-dq")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(model, "balanced")
    loss = model(**_sp_batch(), use_cache=False).loss
    loss.backward()
    torch.testing.assert_close(sum(r["loss"] for r in got), loss.detach(), rtol=1e-5, atol=0)
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for r in got:
        assert r["fused"] == [{"fused": 1}] * 3 and r["grads"].keys() == want.keys()
        for n, w in want.items():
            torch.testing.assert_close(r["grads"][n], w, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("quant", ["nf4-dq", "int8"])
def test_whole_model_under_torch_checkpoint(checkpoints, quant):
    """torch.utils.checkpoint (non-reentrant) around the whole patched QLoRA model: its
    recompute runs inside a layer op's backward, after that op's pre-hook filled the layer's
    dequantized weights, and must neither free them under the op nor save them with another
    shape than the forward did (before: "different metadata", and a freed weight read). The
    loss and every gradient equal the run without the outer checkpoint bit for bit, the
    layers ran fused, and the weights are released after the backward."""
    from torch.utils.checkpoint import checkpoint
    model = qlora_model(checkpoints("llama"), quant, dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.patch_llama(model, "min_memory")
    ids, mask, labels = make_batch(pad=True)

    def run(wrapped):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)  # the dropout seeds; the checkpoint replays the RNG state

        def loss_of(i, m):
            return model(input_ids=i, attention_mask=m, labels=labels, use_cache=False).loss
        loss = checkpoint(loss_of, ids, mask, use_reentrant=False) if wrapped \
            else loss_of(ids, mask)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        want = run(False)
    holders = [t for t in saved if quantized.is_placeholder(t)]
    got = run(True)
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and any("lora_A" in n for n in want[1])
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
    assert all(calls for calls in fused_calls(model))
    assert holders and all(released(t) and not getattr(t, quantized._PINNED, 0)
                           for t in holders)
