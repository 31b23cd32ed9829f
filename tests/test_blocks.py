"""The fused decoder layer: presets vs an independent plain-PyTorch LLaMA layer, gradcheck,
saved bytes against the README formulas, HF compatibility and errors."""
import pytest
import torch
import torch.utils.checkpoint

import ckpt_ext
from ckpt_ext import blocks
from ckpt_ext.modules import DecoderLayer
from ckpt_ext.presets import FUSED_PRESETS, PRESETS, saved_bytes

from reference import make_layer, make_mask, reference_layer, rope_tables


def run(layer, x, pe, mask):
    x = x.detach().requires_grad_()
    y = layer(x, pe, mask)
    grad_out = torch.randn_like(y, generator=torch.Generator().manual_seed(1))
    y.backward(grad_out)
    grads = {"x": x.grad}
    grads.update({n: t.grad for n, t in layer.named_parameters()})
    return y.detach(), grads, grad_out


CASES = [  # (S, B, Hq, Hkv, mask): every S, batch 1 and 3, MHA and GQA, each mask kind
    (1, 1, 4, 4, "none"), (1, 3, 4, 2, "left_pad"), (17, 1, 4, 2, "none"),
    (17, 3, 4, 4, "fully_padded"), (17, 3, 4, 2, "left_pad"), (129, 1, 4, 4, "left_pad"),
    (129, 3, 4, 2, "fully_padded"), (129, 3, 4, 2, "none"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("s,b,hq,hkv,mask_kind", CASES)
def test_every_preset_matches_reference(dtype, s, b, hq, hkv, mask_kind):
    h, i = 64, 172
    layer = make_layer(h, hq, hkv, i, dtype)
    x = torch.randn(b, s, h, dtype=dtype)
    pe = rope_tables(s, h // hq, dtype)
    mask = make_mask(mask_kind, b, s)

    # reference in fp64 from the same weights
    p64 = {k: v.detach().double().requires_grad_() for k, v in layer.state_dict().items()}
    x64 = x.double().requires_grad_()
    y_ref = reference_layer(p64, x64, *(t.double() for t in pe), mask, hq, hkv)
    _, _, grad_out = run(layer, x, pe, mask)  # only for grad_out's values
    y_ref.backward(grad_out.double())
    ref_grads = {"x": x64.grad, **{k: v.grad for k, v in p64.items()}}

    rtol, atol = (1e-10, 1e-10) if dtype == torch.float64 else (1e-4, 2e-5)
    for preset in PRESETS:
        layer.zero_grad(set_to_none=True)
        layer.policy = preset
        y, grads, _ = run(layer, x, pe, mask)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.double(), y_ref.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{preset} output: {m}")
        for name, g in grads.items():
            torch.testing.assert_close(g.double(), ref_grads[name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"{preset} grad {name}: {m}")


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_gradcheck_decoder_layer_fp64(preset):
    torch.manual_seed(1)
    layer = make_layer(8, 2, 1, 12, torch.float64, policy=preset, attention_bias=True,
                       mlp_bias=True, qk_norm=True)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    pe = rope_tables(4, 4, torch.float64, batch=2, offset=torch.tensor([0.0, 3.0]))
    mask = torch.tensor([[True] * 4, [False, True, True, True]])
    params = list(layer.parameters())

    def fn(x, *ps):
        return torch.func.functional_call(layer, dict(zip(dict(layer.named_parameters()), ps)),
                                          (x, pe, mask))
    assert torch.autograd.gradcheck(fn, (x, *params), atol=1e-7)


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_gradcheck_sublayer_blocks_fp64(preset):
    torch.manual_seed(2)
    d64 = dict(dtype=torch.float64, requires_grad=True)
    b, s, h, hq, hkv, d, i = 2, 5, 8, 4, 2, 4, 6
    x = torch.randn(b, s, h, **d64)
    nw = (1 + 0.2 * torch.randn(h, dtype=torch.float64)).requires_grad_()
    wq, wk, wv = (torch.randn(n * d, h, **d64) for n in (hq, hkv, hkv))
    wo = torch.randn(h, hq * d, **d64)
    bq = torch.randn(hq * d, **d64)
    pe = rope_tables(s, d, torch.float64)
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    attn = lambda x, nw, wq, wk, wv, wo, bq: blocks.attention_block(  # noqa: E731
        x, nw, wq, wk, wv, wo, pe, num_heads=hq, num_kv_heads=hkv, b_q=bq,
        key_padding_mask=mask, preset=preset)
    assert torch.autograd.gradcheck(attn, (x, nw, wq, wk, wv, wo, bq), atol=1e-7)

    wg, wu = torch.randn(i, h, **d64), torch.randn(i, h, **d64)
    wd, bd = torch.randn(h, i, **d64), torch.randn(h, **d64)
    mlp = lambda x, nw, wg, wu, wd, bd: blocks.mlp_block(  # noqa: E731
        x, nw, wg, wu, wd, b_down=bd, preset=preset)
    assert torch.autograd.gradcheck(mlp, (x, nw, wg, wu, wd, bd), atol=1e-7)


def test_sublayers_compose_to_the_layer():
    layer = make_layer(32, 4, 2, 48, torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    pe = rope_tables(9, 8, torch.float64)
    a, m = layer.self_attn, layer.mlp
    h = blocks.attention_block(x, layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight,
                               a.v_proj.weight, a.o_proj.weight, pe, num_heads=4,
                               num_kv_heads=2)
    y = blocks.mlp_block(h, layer.post_attention_layernorm.weight, m.gate_proj.weight,
                         m.up_proj.weight, m.down_proj.weight)
    torch.testing.assert_close(y, layer(x, pe), rtol=1e-12, atol=1e-12)


# ---- bytes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("preset", ["torch", *FUSED_PRESETS])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_saved_bytes_match_formula(dtype, hq, hkv, preset, with_mask):
    b, s, h, i = 3, 19, 64, 96
    d = h // hq
    layer = make_layer(h, hq, hkv, i, dtype, policy=preset)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    pe = rope_tables(s, d, dtype)
    mask = make_mask("left_pad", b, s) if with_mask else None
    measured = ckpt_ext.saved_activation_bytes(layer, x, pe, mask)
    expected = saved_bytes(preset, B=b, S=s, H=h, Hq=hq, Hkv=hkv, D=d, I=i, dtype=dtype,
                           mask=with_mask)
    assert measured == expected


def test_saved_bytes_order_and_none_is_largest():
    b, s, h = 2, 64, 64
    x = torch.randn(b, s, h, requires_grad=True)
    pe = rope_tables(s, 16, torch.float32)
    got = {}
    for preset in PRESETS:
        layer = make_layer(h, 4, 2, 172, torch.float32, policy=preset)
        got[preset] = ckpt_ext.saved_activation_bytes(layer, x, pe)
    assert got["none"] > got["fast"] > got["balanced"] > got["min_memory"] == got["torch"]


# ---- behaviour -----------------------------------------------------------------------------

def test_no_grad_saves_nothing_and_matches():
    layer = make_layer(32, 4, 2, 48, torch.float32)
    x = torch.randn(2, 7, 32)
    pe = rope_tables(7, 8, torch.float32)
    with torch.no_grad():
        y = layer(x, pe)
    assert not y.requires_grad
    layer.policy = "none"
    torch.testing.assert_close(y, layer(x, pe).detach(), rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        layer.policy = "min_memory"
        torch.testing.assert_close(layer(x, pe), y, rtol=1e-6, atol=1e-6)


def test_double_backward_raises_and_the_advice_holds():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    layer = make_layer(16, 2, 2, 24, torch.float64, policy="balanced")
    x = torch.randn(1, 3, 16, dtype=torch.float64, requires_grad=True)
    pe = rope_tables(3, 8, torch.float64)
    y = layer(x, pe)
    with pytest.raises(RuntimeError, match="double backward.*SDPBackend.MATH"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    for preset in ("none", "torch"):  # what the message advises works at second order
        layer.policy = preset
        with sdpa_kernel(SDPBackend.MATH):
            fn = lambda t: layer(t, pe).square().sum()  # noqa: E731
            assert torch.autograd.gradcheck(lambda t: torch.autograd.grad(
                fn(t), t, create_graph=True)[0], (x,))


def test_policy_is_validated_once_where_it_is_set(monkeypatch):
    """A DecoderLayer checks the policy it is given once (not again in each submodule), and
    setting it checks the new value once and gives it to every submodule."""
    from ckpt_ext.modules import layers
    checked = []
    real = layers.check_policy

    def spy(policy, *args):
        checked.append(policy)
        return real(policy, *args)

    monkeypatch.setattr(layers, "check_policy", spy)
    layer = DecoderLayer(32, 4, 2, 48, qk_norm=True, policy="fast")
    assert checked.count("fast") == 1
    checked.clear()
    layer.policy = "min_memory"
    assert checked == ["min_memory"]
    assert {m.policy for m in layer.modules() if hasattr(m, "policy")} == {"min_memory"}
    with pytest.raises(ValueError, match="policy"):
        layer.policy = "fastest"
    assert layer.self_attn.q_norm.policy == "min_memory"


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="policy"):
        DecoderLayer(32, 4, 2, 48, policy="fastest")
    with pytest.raises(ValueError, match="num_kv_heads"):
        DecoderLayer(32, 4, 3, 48)
    layer = make_layer(32, 4, 2, 48, torch.float32)
    pe = rope_tables(5, 8, torch.float32)
    with pytest.raises(ValueError, match=r"x must have 3 dims \(B, S, H\)"):
        layer(torch.randn(5, 32), pe)
    with pytest.raises(ValueError, match="cos/sin"):
        layer(torch.randn(1, 5, 32), (pe[0].requires_grad_(), pe[1]))
    with pytest.raises(TypeError, match="position_embeddings must be a pair"):
        layer(torch.randn(1, 5, 32), pe[0])
    wide = torch.randn(1, 5, 10)  # partial rotary embeddings take R <= head_dim, R even
    with pytest.raises(ValueError, match=r"cos must be \(B or 1, S, R\) with an even rotary "
                       r"width R <= head_dim=8, got shape \(1, 5, 10\)"):
        layer(torch.randn(1, 5, 32), (wide, wide))
    with pytest.raises(TypeError, match="input_layernorm.weight is float32 but x is bfloat16"):
        layer(torch.randn(1, 5, 32, dtype=torch.bfloat16), pe)
    # position embeddings: x's dtype, or float32 for a half-precision x (ERNIE 4.5's)
    half = make_layer(32, 4, 2, 48, torch.bfloat16)
    xh = torch.randn(1, 5, 32, dtype=torch.bfloat16)
    pe32 = rope_tables(5, 8, torch.float32)   # pe[0] requires grad now
    torch.testing.assert_close(half(xh, pe32), half(xh, tuple(t.bfloat16() for t in pe32)),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="cos is float64 but x is bfloat16; outside autocast"):
        half(xh, tuple(t.double() for t in pe32))
    with pytest.raises(TypeError,
                       match=r"sin must have the dtype of cos \(float32\), got bfloat16"):
        half(xh, (pe32[0], pe32[1].bfloat16()))
    with pytest.raises(ValueError, match="mlp.down_proj.weight must have shape \\(32, 4\\)"):
        blocks.mlp_block(torch.randn(1, 2, 32), torch.ones(32), torch.ones(4, 32),
                         torch.ones(4, 32), torch.ones(32, 5))
    with pytest.raises(ValueError, match="preset"):
        blocks.mlp_block(torch.randn(1, 2, 32), torch.ones(32), torch.ones(4, 32),
                         torch.ones(4, 32), torch.ones(32, 4), preset="none")
    w = blocks.pack_weights({"post_attention_layernorm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match="preset must be one of"):
        blocks.decoder_layer(torch.randn(1, 2, 32), blocks.LayerOptions(
            weights=w, num_heads=1, num_kv_heads=1, eps=1e-6, scale=1.0, part="mlp",
            preset="quick"))  # straight to the C++ op's own check
    with pytest.raises(ValueError, match="unknown weight names"):
        blocks.pack_weights({"mlp.router.weight": torch.ones(4, 32)})


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(rms_norm_eps=-1.0), ValueError, "rms_norm_eps must be a finite number >= 0, got -1.0"),
    (dict(rms_norm_eps=float("nan")), ValueError, "rms_norm_eps must be a finite number >= 0"),
    (dict(attention_bias="yes"), TypeError, "attention_bias must be a bool"),
    (dict(mlp_bias=None), TypeError, "mlp_bias must be a bool"),
    (dict(head_dim=0), ValueError, "head_dim must be positive, got 0"),
    (dict(head_dim=8.0), TypeError, "head_dim must be an int, got float"),
])
def test_layer_config_refuses_what_it_would_misread(kwargs, exc, match):
    """A negative eps gave NaN rows, "yes" switched biases on, head_dim=0 meant the default."""
    with pytest.raises(exc, match=match):
        DecoderLayer(32, 4, 2, 48, **kwargs)


def test_the_layer_op_refuses_a_bad_eps():
    w = blocks.pack_weights({"post_attention_layernorm.weight": torch.ones(32),
                             "mlp.gate_proj.weight": torch.ones(4, 32),
                             "mlp.up_proj.weight": torch.ones(4, 32),
                             "mlp.down_proj.weight": torch.ones(32, 4)})
    for eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            blocks.decoder_layer(torch.randn(1, 2, 32), weights=w, num_heads=1,
                                 num_kv_heads=1, eps=eps, scale=1.0, part="mlp",
                                 preset="balanced")


@pytest.mark.parametrize("preset", FUSED_PRESETS)
@pytest.mark.parametrize("shape", [(0, 5), (2, 0)], ids=["B=0", "S=0"])
def test_empty_input_gives_empty_output(preset, shape):
    layer = make_layer(32, 4, 2, 48, torch.float32, policy=preset)
    x = torch.randn(*shape, 32, requires_grad=True)
    y = layer(x, rope_tables(shape[1], 8, torch.float32))
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


def test_hf_llama_layer_state_dict_loads_and_matches():
    pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[test]')")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=172, rms_norm_eps=1e-5, attention_bias=True,
                      mlp_bias=True, attn_implementation="eager")
    # fp32: HF's RMSNorm computes in fp32 whatever the input dtype, so fp64 cannot be tight.
    hf = LlamaDecoderLayer(cfg, layer_idx=0)
    with torch.no_grad():
        for name, t in hf.named_parameters():
            t.add_(0.1 * torch.randn_like(t))
    ours = DecoderLayer(64, 4, 2, 172, rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True,
                        policy="balanced")
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)

    x = torch.randn(2, 11, 64)
    pos = torch.arange(11)[None].repeat(2, 1)
    pe = LlamaRotaryEmbedding(cfg)(x, pos)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    out = hf(x, attention_mask=causal, position_embeddings=pe, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(ours(x, pe), out, rtol=1e-4, atol=1e-5)


def test_fused_layer_inside_torch_checkpoint():
    # Unpacking the block's saved tensors runs the outer checkpoint's recomputation, which
    # must see autograd enabled (a regression: the backward used to switch it off first).
    layer = make_layer(64, 4, 2, 96, torch.float64, policy="balanced")
    x = torch.randn(2, 9, 64, dtype=torch.float64, requires_grad=True)
    pe = rope_tables(9, 16, torch.float64)
    torch.utils.checkpoint.checkpoint(layer, x, pe, use_reentrant=False).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    layer(x, pe).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=0)


# ---- the op's spec from C++: residual layout, arguments by name, opcheck ----------------------

_PART_WEIGHTS = {"layer": ("",), "attention": ("input_layernorm.", "self_attn."),
                 "mlp": ("post_attention_layernorm.", "mlp.")}


def _layer_call(dtype, compute_dtype=None, b=2, s=5, requires_grad=False, part="layer"):
    """x and decoder_layer's arguments (but preset) for a small GQA layer's ``part``,
    given the weights of that part alone (as blocks.attention_block and mlp_block do)."""
    layer = make_layer(32, 4, 2, 48, dtype)
    weights = blocks.pack_weights({n: t.detach().requires_grad_(requires_grad)
                                   for n, t in layer.named_parameters()
                                   if n.startswith(_PART_WEIGHTS[part])})
    cos, sin = rope_tables(s, 8, dtype)
    x = torch.randn(b, s, 32, dtype=dtype, requires_grad=requires_grad)
    return x, dict(weights=weights, cos=cos, sin=sin, num_heads=4, num_kv_heads=2, eps=1e-6,
                   scale=8 ** -0.5, compute_dtype=compute_dtype, part=part)


def _op_args(args):
    """The layer ops' positional arguments after x, from decoder_layer's by name."""
    return blocks.LayerOptions(**args).op_args()


@pytest.mark.parametrize("dtype,compute_dtype", [(torch.float32, None), (torch.float64, None),
                                                 (torch.float32, torch.bfloat16)],
                         ids=["fp32", "fp64", "fp32-bf16"])
@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_saved_residuals_follow_the_spec_and_the_formula(dtype, compute_dtype, preset):
    """decoder_layer_fwd returns the residuals C++ names for each part (blocks.RESIDUALS), the
    sublayers' share up to the whole layer's, and their bytes are presets.per_token_bytes."""
    from ckpt_ext.presets import per_token_bytes
    b, s = 2, 5
    x, args = _layer_call(dtype, compute_dtype, b, s)
    per_part = {}
    for part in blocks.PARTS:
        _, saved, _ = torch.ops.ckpt_ext.decoder_layer_fwd(
            x, *_op_args({**args, "part": part, "preset": preset}))
        names = blocks.RESIDUALS[part, preset]
        assert len(saved) == len(names)
        per_part[part] = dict(zip(names, saved))
    whole = set(per_part["attention"]) | set(per_part["mlp"]) | ({"h"} if preset != "min_memory"
                                                                 else set())
    assert set(per_part["layer"]) == whole
    saved_bytes = sum(t.numel() * t.element_size() for t in per_part["layer"].values())
    expected = b * s * per_token_bytes(preset, H=32, Hq=4, Hkv=2, D=8, I=48, dtype=dtype,
                                       compute_dtype=compute_dtype)
    assert x.numel() * x.element_size() + saved_bytes == expected
    # every part's bytes, as the formula and the offloader's per-call count give them
    from ckpt_ext.offload import _layer_saved_bytes
    for part, saved in per_part.items():
        got = x.numel() * x.element_size() + sum(t.numel() * t.element_size()
                                                 for t in saved.values())
        assert got == b * s * per_token_bytes(preset, H=32, Hq=4, Hkv=2, D=8, I=48,
                                              dtype=dtype, compute_dtype=compute_dtype,
                                              part=part), part
        options = blocks.LayerOptions(**{**args, "part": part, "preset": preset})
        assert _layer_saved_bytes(x, options) == got, part


def test_decoder_layer_names_its_arguments():
    assert blocks.LAYER_ARGS[0] == "weights" and blocks.LAYER_ARGS[-3:] == ("part", "preset",
                                                                       "chunk_rows")
    x, args = _layer_call(torch.float32)
    with pytest.raises(TypeError, match="unknown arguments \\['heads'\\]"):
        blocks.decoder_layer(x, heads=4, **args)
    with pytest.raises(TypeError, match="heads"):
        blocks.LayerOptions(heads=4, **args)


def test_options_record_is_the_registered_schema():
    """LayerOptions has one field per argument of the registered op after x, in its order,
    each with the schema's default (a list default as a tuple), and those without one are
    required; the op called with the record's defaults is the op called with its own."""
    import dataclasses
    schema = torch.ops.ckpt_ext.decoder_layer.default._schema.arguments[1:]
    fields = dataclasses.fields(blocks.LayerOptions)
    assert [f.name for f in fields] == [a.name for a in schema] == list(blocks.LAYER_ARGS)
    for f, a in zip(fields, schema):
        if a.has_default_value():
            d = a.default_value
            assert f.default == (tuple(d) if isinstance(d, list) else d), f.name
        else:
            assert f.default is dataclasses.MISSING, f.name
    assert [f.name for f in fields if f.default is dataclasses.MISSING] == ["weights"]
    x, args = _layer_call(torch.float32)
    args.pop("scale")  # the op's default: 1 / sqrt(head_dim), here 8 ** -0.5 exactly
    explicit = blocks.decoder_layer(x, blocks.LayerOptions(**args, scale=8 ** -0.5))
    by_op, _ = torch.ops.ckpt_ext.decoder_layer(x, **args)  # the op's own defaults
    torch.testing.assert_close(blocks.decoder_layer(x, blocks.LayerOptions(**args)), explicit,
                               rtol=0, atol=0)
    torch.testing.assert_close(by_op, explicit, rtol=0, atol=0)
    mha = dict(args, num_kv_heads=None, weights=None)
    w = make_layer(32, 4, 4, 48, torch.float32)
    mha["weights"] = blocks.pack_weights(dict(w.named_parameters()))
    torch.testing.assert_close(blocks.decoder_layer(x, blocks.LayerOptions(**mha)),
                               blocks.decoder_layer(x, blocks.LayerOptions(**mha)
                                                    .replace(num_kv_heads=4)), rtol=0, atol=0)


@pytest.mark.parametrize("part", ["attention", "mlp"])
def test_part_given_a_whole_layer_ignores_the_other_weights(part):
    """decoder_layer(part=...) given a whole layer's weights computes what it computes with its
    own part's weights alone, and the other part's weights get no gradient (before: an
    internal autograd error in backward)."""
    layer = make_layer(32, 4, 2, 48, torch.float32)
    cos, sin = rope_tables(5, 8, torch.float32)
    x = torch.randn(2, 5, 32)

    def grads(names):
        w = {n: t.detach().clone().requires_grad_() for n, t in layer.named_parameters()
             if n in names}
        xx = x.clone().requires_grad_()
        y = blocks.decoder_layer(xx, blocks.LayerOptions(
            weights=w, cos=cos, sin=sin, num_heads=4, num_kv_heads=2, part=part))
        y.backward(torch.ones_like(y))
        return y, xx.grad, {n: t.grad for n, t in w.items()}

    every = [n for n, _ in layer.named_parameters()]
    own = [n for n in every if n.startswith(_PART_WEIGHTS[part])]
    y, dx, g = grads(every)
    y1, dx1, g1 = grads(own)
    torch.testing.assert_close(y, y1, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx1, rtol=0, atol=0)
    for n in every:
        if n in own:
            torch.testing.assert_close(g[n], g1[n], rtol=0, atol=0, msg=n)
        else:
            assert g[n] is None, n


def _layer_opcheck_samples():
    samples = []
    for part in blocks.PARTS:
        for preset in FUSED_PRESETS:
            x, args = _layer_call(torch.float32, part=part)
            args.update(preset=preset, key_padding_mask=make_mask("left_pad", 2, 5))
            rest = _op_args(args)
            samples.append(("decoder_layer_fwd", (x, *rest)))
            y, saved, _ = torch.ops.ckpt_ext.decoder_layer_fwd(x, *rest)
            needs = [w is not None for w in args["weights"]]
            samples.append(("decoder_layer_bwd", (torch.randn_like(y), x, *rest, saved, needs)))
            xg, argsg = _layer_call(torch.float32, requires_grad=True, part=part)
            argsg.update(preset=preset)
            samples.append(("decoder_layer", (xg, *_op_args(argsg))))
    return samples


@pytest.mark.parametrize("sample", range(len(_layer_opcheck_samples())))
def test_opcheck_decoder_layer(sample):
    name, args = _layer_opcheck_samples()[sample]
    torch.library.opcheck(getattr(torch.ops.ckpt_ext, name).default, args)
