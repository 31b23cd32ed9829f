"""The decoder layer's mixture-of-experts MLP (num_experts_per_tok > 0): the router (softmax or
sigmoid scores, top-k, optional renormalisation), the routed SwiGLU experts in transformers 5's
layout and an optional shared expert with its sigmoid gate, against an independent dense
plain-PyTorch reference (tests/reference.py: moe_reference, every expert on every token):
float64 to 1e-12 in every preset and part, float32 within the accuracy rule on the grouped
GEMM path (aligned sizes) and the per-expert one (odd sizes), top-k from 1 to E, token chunks
equal to one chunk, what each preset saves (the routing, never a routed intermediate),
torch.compile without graph breaks, and the refusals of bad input."""
import pytest
import torch

from ckpt_ext import blocks, config

from reference import (FACTOR_GRAD, FACTOR_OUT, check_f64, check_vs_baseline, reference_layer,
                       rope_args, rope_tables)

F64 = torch.float64
NH, NKV = 4, 2
# (router, norm_topk_prob, shared expert, shared gate): the families' layouts
ROUTINGS = {
    "qwen2_moe": ("softmax", False, True, True),   # softmax, shared expert behind a gate
    "mixtral": ("softmax", True, False, False),    # Mixtral / Qwen3-MoE: renormalised top-k
    "olmoe": ("softmax", False, False, False),
    "sigmoid_shared": ("sigmoid", True, True, False),  # sigmoid scores, ungated shared expert
}


def moe_case(dtype, routing="qwen2_moe", *, hidden=16, experts=5, inter=8, k=2, shared_i=12,
             b=2, s=9, seed=0, expert_lora=None):
    """(x, weights, pe, dy, kw): a layer with attention and an MoE MLP, weights by slot.
    expert_lora: (rank, weights) to give PEFT LoRA factors to the expert weights named
    ("gate_up_proj", "down_proj" or both), in PEFT's layouts, with scalings 0.7 and 1.3."""
    router, norm, shared, gate = ROUTINGS[routing]
    g = torch.Generator().manual_seed(seed)
    d = hidden // NH

    def w(*shape, scale=0.3):
        return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)

    weights = {"input_layernorm.weight": 1 + w(hidden, scale=0.2),
               "post_attention_layernorm.weight": 1 + w(hidden, scale=0.2),
               "self_attn.q_proj.weight": w(NH * d, hidden),
               "self_attn.k_proj.weight": w(NKV * d, hidden),
               "self_attn.v_proj.weight": w(NKV * d, hidden),
               "self_attn.o_proj.weight": w(hidden, NH * d),
               "mlp.gate.weight": w(experts, hidden, scale=1.0),
               "mlp.experts.gate_up_proj": w(experts, 2 * inter, hidden),
               "mlp.experts.down_proj": w(experts, hidden, inter)}
    if shared:
        weights.update({"mlp.gate_proj.weight": w(shared_i, hidden),
                        "mlp.up_proj.weight": w(shared_i, hidden),
                        "mlp.down_proj.weight": w(hidden, shared_i)})
    if gate:
        weights["mlp.shared_expert_gate.weight"] = w(1, hidden)
    x = torch.randn(b, s, hidden, generator=g, dtype=F64).to(dtype)
    dy = torch.randn(b, s, hidden, generator=g, dtype=F64).to(dtype)
    kw = dict(num_heads=NH, num_kv_heads=NKV, num_experts_per_tok=k, router=router,
              norm_topk_prob=norm)
    if expert_lora:
        r, names = expert_lora
        dims = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
        for name in names:
            out, inp = dims[name]
            weights[f"mlp.experts.{name}.lora_A"] = w(r * experts, inp)
            weights[f"mlp.experts.{name}.lora_B"] = w(out, r * experts)
        kw["expert_lora_scaling"] = [0.7 if "gate_up_proj" in names else 0.0,
                                     1.3 if "down_proj" in names else 0.0]
    return x, weights, rope_tables(s, d, dtype=dtype), dy, kw


def run(x, weights, pe, dy, kw, preset, part, fn=blocks.decoder_layer, frozen=()):
    """(y, dx, {slot: gradient}) of the op, every weight trained but those named in frozen."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_(n not in frozen) for n, t in weights.items()}
    y = fn(x, blocks.LayerOptions(weights=w, **rope_args(pe), preset=preset, part=part, **kw))
    y.backward(dy)
    return y.detach(), x.grad, {n: t.grad for n, t in w.items() if t.grad is not None}


def run_reference(x, weights, pe, dy, kw, part, dtype=None, force_idx=None, frozen=(),
                  factored=False):
    """The same through reference_layer, at `dtype` (default x's); factored: expert LoRA
    computed beside the weights, not folded into them (moe_reference)."""
    dtype = dtype or x.dtype
    x = x.to(dtype).clone().requires_grad_()
    w = {n: t.to(dtype).clone().requires_grad_(n not in frozen) for n, t in weights.items()}
    cos, sin = (t.to(dtype) for t in pe)
    moe = dict(k=kw["num_experts_per_tok"], router=kw["router"],
               norm_topk_prob=kw["norm_topk_prob"], force_idx=force_idx,
               expert_lora_scaling=kw.get("expert_lora_scaling") or (0.0, 0.0),
               expert_lora_factored=factored)
    y = reference_layer(w, x, cos, sin, None, NH, NKV, part=part, moe=moe)
    y.backward(dy.to(dtype))
    mlp_only = part == "mlp"
    return y.detach(), x.grad, {n: t.grad for n, t in w.items()
                                if t.grad is not None and not (mlp_only and n.startswith(
                                    ("self_attn.", "input_layernorm.")))}


def reference_routing(x, weights, pe, kw, part):
    """The top-k experts plain PyTorch picks at x's dtype (to route a float64 reference of a
    low-precision run the same way): the MoE input is captured from reference_layer."""
    import reference
    seen = {}
    original = reference.moe_reference

    def capture(p, m, k, router="softmax", **rest):
        logits = torch.nn.functional.linear(m.reshape(-1, m.shape[-1]), p["mlp.gate.weight"])
        wide = logits.float()
        scores = torch.softmax(wide, -1) if router == "softmax" else torch.sigmoid(wide)
        seen["idx"] = scores.topk(k, -1).indices
        return original(p, m, k, router=router, **rest)

    reference.moe_reference = capture
    try:
        with torch.no_grad():
            moe = dict(k=kw["num_experts_per_tok"], router=kw["router"],
                       norm_topk_prob=kw["norm_topk_prob"])
            reference_layer(weights, x, *pe, None, NH, NKV, part=part, moe=moe)
    finally:
        reference.moe_reference = original
    return seen["idx"]


def assert_f64(got, ref):
    (y, dx, g), (y1, dx1, g1) = got, ref
    check_f64("y", y, y1)
    check_f64("dx", dx, dx1)
    assert g.keys() == g1.keys(), (sorted(g), sorted(g1))
    for n in g1:
        check_f64(n, g[n], g1[n])


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("part", ["layer", "mlp"])
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_fp64_matches_the_dense_reference(preset, part, routing):
    """Output and every gradient (router, experts, shared expert and its gate, norms,
    attention, x) equal the dense reference to 1e-12."""
    case = moe_case(F64, routing)
    assert_f64(run(*case, preset, part), run_reference(*case, part))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_top_k(k):
    """top-k from 1 to E (E = 4), sigmoid and softmax scores."""
    for routing in ("mixtral", "sigmoid_shared"):
        case = moe_case(F64, routing, experts=4, k=k, seed=k)
        assert_f64(run(*case, "min_memory", "mlp"), run_reference(*case, "mlp"))


@pytest.mark.parametrize("sizes", [dict(hidden=16, inter=8), dict(hidden=24, inter=10)],
                         ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_fp32_meets_the_accuracy_rule(preset, sizes):
    """float32 against the float64 reference, within the accuracy rule of plain PyTorch at
    float32 (both routed as plain PyTorch routes at float32). H 16, I 8 take
    torch._grouped_mm (16-byte rows); H 24, I 10 the per-expert matmuls."""
    case = moe_case(torch.float32, "qwen2_moe", experts=6, k=3, b=2, s=11, seed=5, **sizes)
    x, weights, pe, _, kw = case
    idx = reference_routing(x, weights, pe, kw, "layer")
    got = run(*case, preset, "layer")
    base = run_reference(*case, "layer", force_idx=idx)
    ref = run_reference(*case, "layer", dtype=F64, force_idx=idx)
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
    check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
    assert got[2].keys() == ref[2].keys()
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


def chunk_cap(rows, dtype, weights, k, part):
    """CKPT_EXT_CHUNK_BYTES for chunks of `rows` tokens: the attention's 4 Hq*D per token (the
    layer) plus the MoE MLP's k max(3 H + 5 I, H + 7 I) + H + 3 E and the shared expert's 3 I,
    at the compute width (float32 at least); the layer's chunk-rows rule in
    csrc/layer_math.cpp."""
    e, h, i = weights["mlp.experts.down_proj"].shape
    width = k * max(3 * h + 5 * i, h + 7 * i) + h + 3 * e
    if "mlp.gate_proj.weight" in weights:
        width += 3 * weights["mlp.gate_proj.weight"].shape[0]
    if part == "layer":
        width += 4 * weights["self_attn.q_proj.weight"].shape[0]
    return str(rows * width * max(4, dtype.itemsize))


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_chunks_equal_one_chunk(monkeypatch, preset):
    """Token chunks of 1, 4 and 13 rows (two sequences of 9: pieces of one sequence and whole
    sequences) give the one-chunk output and gradients to 1e-12."""
    case = moe_case(F64, "qwen2_moe")
    for part in ("layer", "mlp"):
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
        whole = run(*case, preset, part)
        for rows in (1, 4, 13):
            config.update(chunk_bytes=chunk_cap(rows, F64, case[1],
                                                case[4]["num_experts_per_tok"], part))
            assert_f64(run(*case, preset, part), whole)


@pytest.mark.parametrize("part", ["layer", "mlp"])
@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_grouped_gradient_sums_over_chunks_meet_the_accuracy_rule(preset, part):
    """float32 with 16-byte rows (torch._grouped_mm) in token chunks of 1 and 4 rows: after
    the first chunk each expert weight's gradient is added a block of experts at a time, the
    block's products within the same byte cap (6 experts: at 1 row blocks of 1 for gate_up
    and of 2 or 3 for down; at 4 rows blocks of 5 and 1, or all 6; experts without rows in a
    chunk).
    Output and gradients against the float64 reference, within the accuracy rule."""
    case = moe_case(torch.float32, "qwen2_moe", experts=6, k=3, b=2, s=11, seed=5,
                    hidden=16, inter=8)
    x, weights, pe, _, kw = case
    idx = reference_routing(x, weights, pe, kw, part)
    base = run_reference(*case, part, force_idx=idx)
    ref = run_reference(*case, part, dtype=F64, force_idx=idx)
    for rows in (1, 4):
        config.update(chunk_bytes=chunk_cap(rows, torch.float32, weights,
                                            kw["num_experts_per_tok"], part))
        got = run(*case, preset, part)
        check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
        check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
        assert got[2].keys() == ref[2].keys()
        for n in ref[2]:
            check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


def saved_shapes(fn):
    """The shapes of what autograd saves while fn() runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_saves_the_routing_and_no_routed_intermediate(preset):
    """Besides x and the weights, the op saves the routing (T, k) and the preset's attention
    residuals and h; no (T * k, ...) or (T, I) routed tensor, in any preset."""
    x, weights, pe, _, kw = moe_case(torch.float32, "qwen2_moe", k=3, b=2, s=9)
    b, s, h = x.shape
    t, k = b * s, 3
    assert blocks.MOE_RESIDUALS["layer", preset][:2] == ("topk_idx", "topk_w")
    assert "gate" not in blocks.MOE_RESIDUALS["layer", preset]
    w = {n: v.clone().requires_grad_() for n, v in weights.items()}
    xx = x.clone().requires_grad_()
    shapes = saved_shapes(lambda: blocks.decoder_layer(xx, blocks.LayerOptions(
        weights=w, **rope_args(pe), preset=preset, **kw)))
    others = [sh for sh in shapes if sh not in {tuple(v.shape) for v in w.values()}
              and sh != tuple(x.shape) and sh != tuple(pe[0].shape) and sh != (0,)]
    d = h // NH
    expected = {"fast": [(b, NH, s, d), (b, NKV, s, d), (b, NKV, s, d), (b, NH, s, d),
                         (b, NH, s)],
                "balanced": [(b, NH, s, d), (b, NH, s)], "min_memory": []}[preset]
    assert sorted(others) == sorted([(t, k), (t, k)] + expected), others
    if preset != "min_memory":
        assert shapes.count(tuple(x.shape)) == 2  # x and h


@pytest.mark.parametrize("expert_lora", [None, (4, ("gate_up_proj", "down_proj"))],
                         ids=["plain", "expert_lora"])
def test_compiles_without_graph_breaks(monkeypatch, expert_lora):
    """torch.compile (fullgraph) of a chunked MoE layer (with LoRA factors on its experts, too):
    no graph break, the eager results."""
    torch._dynamo.reset()
    case = moe_case(torch.float32, "qwen2_moe", seed=3, expert_lora=expert_lora)
    config.update(chunk_bytes=chunk_cap(4, torch.float32, case[1], 2, "layer"))
    eager = run(*case, "min_memory", "layer")
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(blocks.decoder_layer, backend="aot_eager", fullgraph=True)
    got = run(*case, "min_memory", "layer", fn=compiled)
    assert sum(counts["graph_break"].values()) == 0, dict(counts["graph_break"])
    torch.testing.assert_close(got[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-6, atol=1e-6)
    for n in eager[2]:
        torch.testing.assert_close(got[2][n], eager[2][n], rtol=1e-6, atol=1e-6)


def test_bf16_meets_the_accuracy_rule():
    """bfloat16 weights and input (the grouped GEMM path in bfloat16): within the accuracy rule
    of plain PyTorch at bfloat16."""
    case = moe_case(torch.bfloat16, "mixtral", hidden=16, inter=8, experts=4, k=2, seed=7)
    x, weights, pe, _, kw = case
    idx = reference_routing(x, weights, pe, kw, "mlp")
    got = run(*case, "balanced", "mlp")
    base = run_reference(*case, "mlp", force_idx=idx)
    ref = run_reference(*case, "mlp", dtype=F64, force_idx=idx)
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
    check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


@pytest.mark.parametrize("change,match", [
    (dict(num_experts_per_tok=6), "num_experts_per_tok=6 is larger than the number of experts"),
    (dict(num_experts_per_tok=-1), "num_experts_per_tok must be >= 0"),
    (dict(router="softmax_topk"), "router must be one of 'softmax', 'sigmoid'"),
    (dict(num_experts_per_tok=0), "mlp.gate.weight is given but num_experts_per_tok is 0"),
    ("transposed", "mlp.experts.gate_up_proj.*transformers 5"),
    ("no_shared", "mlp.shared_expert_gate.weight needs a shared expert"),
    ("int8", "mlp.experts.down_proj is"),
])
def test_bad_input_is_refused(change, match):
    x, weights, pe, _, kw = moe_case(torch.float32, "qwen2_moe", inter=6)
    if change == "transposed":  # gpt-oss's (E, H, 2I)
        weights["mlp.experts.gate_up_proj"] = weights["mlp.experts.gate_up_proj"].transpose(1, 2)
    elif change == "no_shared":
        for n in ("gate_proj", "up_proj", "down_proj"):
            del weights[f"mlp.{n}.weight"]
    elif change == "int8":  # a quantized expert weight
        weights["mlp.experts.down_proj"] = weights["mlp.experts.down_proj"].to(torch.int8)
    else:
        kw = dict(kw, **change)
    with pytest.raises((ValueError, TypeError), match=match):
        blocks.decoder_layer(x, blocks.LayerOptions(weights=weights, **rope_args(pe), **kw))


def test_the_reference_can_fail():
    """The comparison is sensitive: renormalising the top-k weights, or dropping the shared
    gate, changes the output far beyond the tolerance."""
    x, weights, pe, dy, kw = moe_case(F64, "qwen2_moe")
    got = run(x, weights, pe, dy, kw, "balanced", "layer")[0]
    with pytest.raises(AssertionError):
        check_f64("y", got, run_reference(x, weights, pe, dy, dict(kw, norm_topk_prob=True),
                                          "layer")[0])
    without_gate = {n: t for n, t in weights.items() if n != "mlp.shared_expert_gate.weight"}
    with pytest.raises(AssertionError):
        check_f64("y", got, run_reference(x, without_gate, pe, dy, kw, "layer")[0])


def test_autocast_meets_the_accuracy_rule():
    """float32 weights and input under bfloat16 autocast (the compute dtype bfloat16: router,
    experts and shared expert in bfloat16, the router's scores in float32): within the accuracy
    rule of the plain PyTorch reference under the same autocast."""
    case = moe_case(torch.float32, "qwen2_moe", hidden=16, inter=8, experts=4, k=2, seed=11)
    x, weights, pe, dy, kw = case
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx = reference_routing(x, weights, pe, kw, "layer")
        got = run(*case, "min_memory", "layer")
        base = run_reference(*case, "layer", force_idx=idx)
    ref = run_reference(*case, "layer", dtype=F64, force_idx=idx)
    assert got[0].dtype == torch.float32
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT, dtype=torch.bfloat16)
    check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD, dtype=torch.bfloat16)
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD,
                          dtype=torch.bfloat16)


# ---- router logits (router_logits=True): HF's output_router_logits ----------------------------

def logits_loss(y, logits, dy, dl, use_y=True):
    """A loss on the layer's output and on its router logits as a load-balancing loss reads
    them (through their softmax), so that both gradients flow back through the op."""
    loss = (logits.softmax(-1) * dl).sum()
    return loss + (y * dy).sum() if use_y else loss


def run_logits(x, weights, pe, dy, kw, preset, part, dl, fn=blocks.decoder_layer, use_y=True):
    """(y, router logits, dx, {slot: gradient}) of the op with router_logits=True."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in weights.items()}
    y, logits = fn(x, blocks.LayerOptions(weights=w, **rope_args(pe), preset=preset, part=part,
                                          router_logits=True, **kw))
    logits_loss(y, logits, dy, dl, use_y).backward()
    return (y.detach(), logits.detach(), x.grad,
            {n: t.grad for n, t in w.items() if t.grad is not None})


def run_logits_reference(x, weights, pe, dy, kw, part, dl, use_y=True, dtype=None):
    """The same through reference_layer (its router's logits recorded), at `dtype`."""
    dtype = dtype or x.dtype
    x = x.to(dtype).clone().requires_grad_()
    w = {n: t.to(dtype).clone().requires_grad_() for n, t in weights.items()}
    cos, sin = (t.to(dtype) for t in pe)
    record = []
    moe = dict(k=kw["num_experts_per_tok"], router=kw["router"],
               norm_topk_prob=kw["norm_topk_prob"], record=record)
    y = reference_layer(w, x, cos, sin, None, NH, NKV, part=part, moe=moe)
    (logits,) = record
    logits_loss(y, logits, dy.to(dtype), dl.to(dtype), use_y).backward()
    mlp_only = part == "mlp"
    return y.detach(), logits.detach(), x.grad, {
        n: t.grad for n, t in w.items()
        if t.grad is not None and not (mlp_only and n.startswith(("self_attn.",
                                                                    "input_layernorm.")))}


def logits_grad(case, seed=1):
    x, weights = case[0], case[1]
    g = torch.Generator().manual_seed(seed)
    e = weights["mlp.gate.weight"].shape[0]
    return torch.randn(x.shape[0] * x.shape[1], e, generator=g, dtype=F64).to(x.dtype)


def assert_f64_second(got, ref, name="router_logits"):
    """As assert_f64, with the op's second output (``name``: the router logits or statistics);
    a weight the reference leaves without a gradient (the experts when only the second output
    reaches the loss) must have a zero one."""
    (y, second, dx, g), (y1, second1, dx1, g1) = got, ref
    check_f64(name, second, second1)
    for n in set(g) - set(g1):
        assert not g[n].any(), n
    assert_f64((y, dx, {n: g[n] for n in g if n in g1}), (y1, dx1, g1))


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_router_logits_fp64(preset, routing):
    """router_logits=True: the op's second output is the router's logits (B*S, E), and a loss
    on them (through their softmax, as HF's load-balancing loss) adds its gradient to the
    router weight, the MLP input's norm, the attention and x: all equal the dense reference
    to 1e-12; the output is the one without router_logits."""
    case = moe_case(F64, routing)
    dl = logits_grad(case)
    got = run_logits(*case, preset, "layer", dl)
    assert_f64_second(got, run_logits_reference(*case, "layer", dl))
    assert torch.equal(got[0], run(*case, preset, "layer")[0])
    assert got[3]["mlp.gate.weight"].abs().max() > 0


def test_router_logits_of_the_mlp_part_and_alone():
    """part 'mlp'; and a loss on the router logits alone (the output unused: no gradient
    reaches y, and the op's backward takes a zero one)."""
    case = moe_case(F64, "mixtral", seed=2)
    dl = logits_grad(case, seed=3)
    assert_f64_second(run_logits(*case, "balanced", "mlp", dl),
                      run_logits_reference(*case, "mlp", dl))
    assert_f64_second(run_logits(*case, "min_memory", "layer", dl, use_y=False),
                      run_logits_reference(*case, "layer", dl, use_y=False))


def test_router_logits_unused_change_nothing():
    """With router_logits=True and a loss on the output only, the gradients are bitwise those
    without router_logits (no gradient is materialised for the unused logits)."""
    case = moe_case(torch.float32, "qwen2_moe", seed=4)
    x, weights, pe, dy, kw = case
    want = run(*case, "balanced", "layer")
    xx = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in weights.items()}
    y, _ = blocks.decoder_layer(xx, blocks.LayerOptions(
        weights=w, **rope_args(pe), router_logits=True, **kw))
    y.backward(dy)
    assert torch.equal(y, want[0]) and torch.equal(xx.grad, want[1])
    for n, gw in want[2].items():
        assert torch.equal(w[n].grad, gw), n


def test_router_logits_save_nothing_more():
    """The logits are an output, not a residual: the op saves the same tensors with and
    without router_logits; without it the op's second output is an empty tensor that takes no
    gradient."""
    x, weights, pe, _, kw = moe_case(torch.float32, "qwen2_moe", k=3)
    w = {n: v.clone().requires_grad_() for n, v in weights.items()}
    xx = x.clone().requires_grad_()
    for preset in ("balanced", "min_memory"):
        def call(preset=preset, **extra):
            return blocks.decoder_layer(xx, blocks.LayerOptions(
                weights=w, **rope_args(pe), preset=preset, **kw, **extra))
        assert sorted(saved_shapes(call)) == sorted(saved_shapes(
            lambda: call(router_logits=True)))
    _, second = torch.ops.ckpt_ext.decoder_layer(
        xx, **blocks.LayerOptions(weights=w, **rope_args(pe), **kw).__dict__)
    assert second.shape == (0,) and not second.requires_grad


@pytest.mark.parametrize("preset", ["balanced", "min_memory"])
def test_router_logits_chunks_equal_one_chunk(monkeypatch, preset):
    """Token chunks of 1 and 4 rows: the one-chunk logits and gradients to 1e-12."""
    case = moe_case(F64, "qwen2_moe")
    dl = logits_grad(case)
    for part in ("layer", "mlp"):
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
        whole = run_logits(*case, preset, part, dl)
        for rows in (1, 4):
            config.update(chunk_bytes=chunk_cap(rows, F64, case[1],
                                                case[4]["num_experts_per_tok"], part))
            assert_f64_second(run_logits(*case, preset, part, dl), whole)


def test_router_logits_compile_without_graph_breaks(monkeypatch):
    """torch.compile (fullgraph) of a chunked layer returning its router logits: no graph
    break, the eager logits and gradients."""
    torch._dynamo.reset()
    case = moe_case(torch.float32, "olmoe", seed=6)
    dl = logits_grad(case)
    config.update(chunk_bytes=chunk_cap(4, torch.float32, case[1], 2, "layer"))
    eager = run_logits(*case, "min_memory", "layer", dl)
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(blocks.decoder_layer, backend="aot_eager", fullgraph=True)
    got = run_logits(*case, "min_memory", "layer", dl, fn=compiled)
    assert sum(counts["graph_break"].values()) == 0, dict(counts["graph_break"])
    for a, b in zip(got[:3], eager[:3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for n in eager[3]:
        torch.testing.assert_close(got[3][n], eager[3][n], rtol=1e-6, atol=1e-6)


def test_router_logits_under_autocast():
    """bfloat16 autocast: the logits in bfloat16 (HF's router under autocast), the logits,
    their gradient's share in x and the router weight within the accuracy rule."""
    case = moe_case(torch.float32, "mixtral", hidden=16, inter=8, experts=4, k=2, seed=12)
    dl = logits_grad(case)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run_logits(*case, "balanced", "mlp", dl, use_y=False)
        base = run_logits_reference(*case, "mlp", dl, use_y=False)
    ref = run_logits_reference(*case, "mlp", dl, use_y=False, dtype=F64)
    assert got[1].dtype == torch.bfloat16
    bf = dict(dtype=torch.bfloat16)
    check_vs_baseline("router_logits", got[1], base[1], ref[1], FACTOR_OUT, **bf)
    check_vs_baseline("dx", got[2], base[2], ref[2], FACTOR_GRAD, **bf)
    for n in ("mlp.gate.weight", "post_attention_layernorm.weight"):
        check_vs_baseline(n, got[3][n], base[3][n], ref[3][n], FACTOR_GRAD, **bf)


@pytest.mark.parametrize("change", [dict(num_experts_per_tok=0), dict(part="attention")],
                         ids=["dense", "attention"])
def test_router_logits_need_an_moe_mlp(change):
    x, weights, pe, _, kw = moe_case(torch.float32, "olmoe")
    if change.get("num_experts_per_tok") == 0:
        weights = {n: t for n, t in weights.items() if not n.startswith("mlp.")}
        weights.update({"mlp.gate_proj.weight": torch.randn(8, 16),
                        "mlp.up_proj.weight": torch.randn(8, 16),
                        "mlp.down_proj.weight": torch.randn(16, 8)})
    with pytest.raises(ValueError, match="router_logits=True needs a mixture-of-experts MLP"):
        blocks.decoder_layer(x, blocks.LayerOptions(weights=weights, **rope_args(pe),
                                                    router_logits=True, **{**kw, **change}))


def _router_logits_opcheck_samples():
    """The three layer ops of an MoE layer with router_logits=True, the backward given the
    logits' gradient (the ops without it: tests/test_blocks.py's samples)."""
    samples = []
    for with_logits in (True,):
        x, weights, pe, dy, kw = moe_case(torch.float32, "qwen2_moe", seed=8)
        o = blocks.LayerOptions(weights=weights, **rope_args(pe), router_logits=with_logits,
                                **kw)
        rest = o.op_args()
        samples.append(("decoder_layer_fwd", (x, *rest)))
        _, saved, logits = torch.ops.ckpt_ext.decoder_layer_fwd(x, *rest)
        needs = [w is not None for w in o.weights]
        dl = torch.randn_like(logits) if with_logits else None
        samples.append(("decoder_layer_bwd", (dy, x, *rest, saved, needs, dl)))
        w = {n: t.clone().requires_grad_() for n, t in weights.items()}
        og = o.replace(weights=w)
        samples.append(("decoder_layer", (x.clone().requires_grad_(), *og.op_args())))
    return samples


@pytest.mark.parametrize("sample", range(3))
def test_opcheck_router_logits(sample):
    name, args = _router_logits_opcheck_samples()[sample]
    torch.library.opcheck(getattr(torch.ops.ckpt_ext, name).default, args)


# ---- PEFT LoRA on the expert weights (slots mlp.experts.<weight>.lora_A / lora_B) -------------

BOTH = ("gate_up_proj", "down_proj")
EXPERT_BASE = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.mark.parametrize("names", [BOTH, ("gate_up_proj",), ("down_proj",)],
                         ids=["both", "gate_up", "down"])
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
def test_expert_lora_fp64_matches_the_reference(preset, names):
    """LoRA factors on one or both expert weights (rank 3, float64: the per-expert path):
    output and every gradient, the factors' included, equal the reference that folds each
    expert's B_e A_e into its weight, to 1e-12; the base experts frozen (the usual case) give
    the same factor gradients and none for the experts."""
    case = moe_case(F64, "qwen2_moe", expert_lora=(3, names), seed=2)
    got, ref = run(*case, preset, "layer"), run_reference(*case, "layer")
    assert_f64(got, ref)
    assert all(f"mlp.experts.{n}.lora_{ab}" in got[2] for n in names for ab in "AB")
    frozen = run(*case, preset, "layer", frozen=EXPERT_BASE)
    assert not set(EXPERT_BASE) & set(frozen[2])
    assert_f64(frozen, run_reference(*case, "layer", frozen=EXPERT_BASE))


def test_expert_lora_changes_the_output():
    """The factors count: the op with them differs from the op without them, and the reference
    with them scaled differently differs from the op (the comparison can fail)."""
    case = moe_case(F64, "mixtral", expert_lora=(2, BOTH), seed=4)
    x, weights, pe, dy, kw = case
    got = run(*case, "balanced", "mlp")[0]
    base = {n: t for n, t in weights.items() if ".lora_" not in n}
    plain = dict(kw, expert_lora_scaling=[])
    with pytest.raises(AssertionError):
        check_f64("y", got, run(x, base, pe, dy, plain, "balanced", "mlp")[0])
    with pytest.raises(AssertionError):
        check_f64("y", got, run_reference(x, weights, pe, dy,
                                          dict(kw, expert_lora_scaling=[0.7, 1.0]), "mlp")[0])


@pytest.mark.parametrize("sizes", [dict(hidden=16, inter=8, r=4), dict(hidden=24, inter=10, r=3)],
                         ids=["grouped_mm", "per_expert"])
def test_expert_lora_fp32_meets_the_accuracy_rule(sizes):
    """float32 with LoRA on both expert weights, the base experts frozen: H 16, I 8, rank 4
    (16-byte rows) take torch._grouped_mm for the low-rank GEMMs too; H 24, I 10, rank 3 the
    per-expert matmuls. Within the accuracy rule of plain PyTorch at float32."""
    sizes = dict(sizes)
    r = sizes.pop("r")
    case = moe_case(torch.float32, "qwen2_moe", experts=6, k=3, b=2, s=11, seed=5,
                    expert_lora=(r, BOTH), **sizes)
    x, weights, pe, _, kw = case
    idx = reference_routing(x, weights, pe, kw, "layer")
    got = run(*case, "min_memory", "layer", frozen=EXPERT_BASE)
    base = run_reference(*case, "layer", force_idx=idx, frozen=EXPERT_BASE)
    ref = run_reference(*case, "layer", dtype=F64, force_idx=idx, frozen=EXPERT_BASE)
    check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
    check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
    assert got[2].keys() == ref[2].keys()
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


@pytest.mark.parametrize("preset", ["balanced", "min_memory"])
def test_expert_lora_chunks_equal_one_chunk(preset):
    """Token chunks of 1 and 4 rows: the factors' gradients summed over the chunks equal the
    one-chunk ones to 1e-12 (and so the rest)."""
    case = moe_case(F64, "qwen2_moe", expert_lora=(3, BOTH), seed=6)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    whole = run(*case, preset, "layer", frozen=EXPERT_BASE)
    for rows in (1, 4):
        config.update(chunk_bytes=chunk_cap(rows, F64, case[1], case[4]["num_experts_per_tok"],
                                            "layer"))
        assert_f64(run(*case, preset, "layer", frozen=EXPERT_BASE), whole)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)


@pytest.mark.parametrize("change,match", [
    ("no_scaling", "expert_lora_scaling must have two entries"),
    ("one_scaling", "expert_lora_scaling must be \\[\\] or two scalings"),
    ("no_B", "mlp.experts.gate_up_proj.lora_A and mlp.experts.gate_up_proj.lora_B come together"),
    ("rank_rows", "mlp.experts.down_proj.lora_A must be \\(rank \\* num_experts, in\\)"),
    ("B_shape", "mlp.experts.down_proj.lora_B"),
    ("dense", "expert_lora_scaling is given but num_experts_per_tok is 0"),
])
def test_expert_lora_bad_input_is_refused(change, match):
    x, weights, pe, _, kw = moe_case(torch.float32, "qwen2_moe", expert_lora=(2, BOTH))
    if change == "no_scaling":
        kw = dict(kw, expert_lora_scaling=[])
    elif change == "one_scaling":
        kw = dict(kw, expert_lora_scaling=[1.0])
    elif change == "no_B":
        del weights["mlp.experts.gate_up_proj.lora_B"]
    elif change == "rank_rows":  # 2 E + 1 rows: not rank * E
        a = weights["mlp.experts.down_proj.lora_A"]
        weights["mlp.experts.down_proj.lora_A"] = torch.cat([a, a[:1]])
    elif change == "B_shape":  # (r E, out): lora_B transposed
        weights["mlp.experts.down_proj.lora_B"] = weights["mlp.experts.down_proj.lora_B"].t()
    else:
        weights = {n: t for n, t in weights.items() if not n.startswith("mlp.experts")
                   and n not in ("mlp.gate.weight", "mlp.shared_expert_gate.weight")}
        kw = dict(kw, num_experts_per_tok=0)
    with pytest.raises(ValueError, match=match):
        blocks.decoder_layer(x, blocks.LayerOptions(weights=weights, **rope_args(pe), **kw))


def test_expert_lora_under_autocast_meets_the_accuracy_rule():
    """float32 weights and float32 factors under bfloat16 autocast (the factors cast to the
    compute dtype): within the accuracy rule of plain PyTorch under the same autocast, the
    larger error of its two exact formulas counting: the factors folded into the weights
    (PEFT's forward) or their terms beside the weights' (the op's, which never forms W + s BA;
    in bfloat16 the two round differently)."""
    case = moe_case(torch.float32, "mixtral", hidden=16, inter=8, experts=4, k=2, seed=12,
                    expert_lora=(4, BOTH))
    x, weights, pe, dy, kw = case
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx = reference_routing(x, weights, pe, kw, "mlp")
        got = run(*case, "balanced", "mlp", frozen=EXPERT_BASE)
        folded = run_reference(*case, "mlp", force_idx=idx, frozen=EXPERT_BASE)
        factored = run_reference(*case, "mlp", force_idx=idx, frozen=EXPERT_BASE,
                                 factored=True)
    ref = run_reference(*case, "mlp", dtype=F64, force_idx=idx, frozen=EXPERT_BASE)
    bf = {"dtype": torch.bfloat16}
    check_vs_baseline("y", got[0], (folded[0], factored[0]), ref[0], FACTOR_OUT, **bf)
    check_vs_baseline("dx", got[1], (folded[1], factored[1]), ref[1], FACTOR_GRAD, **bf)
    assert got[2].keys() == ref[2].keys()
    for n in ref[2]:
        check_vs_baseline(n, got[2][n], (folded[2][n], factored[2][n]), ref[2][n], FACTOR_GRAD,
                          **bf)


# ---- router statistics (router_stats=True): the fused load-balancing loss --------------------

def stats_reference(logits, k, mask=None):
    """(3, E) from (T, E) logits as HF's load_balancing_loss_func reduces them: the weighted
    top-k counts of softmax(logits), the weighted softmax sums and the weight sum."""
    p = torch.softmax(logits, -1)
    w = torch.ones(p.shape[0], dtype=p.dtype) if mask is None else mask.reshape(-1).to(p.dtype)
    counts = torch.zeros(p.shape[1], dtype=p.dtype).scatter_add_(
        0, p.topk(k, -1).indices.reshape(-1), w.repeat_interleave(k))
    return torch.stack([counts, w @ p, w.sum().expand(p.shape[1])])


def stats_loss(y, stats, dy, c, use_y=True):
    """A loss on the statistics as HF's reads them (counts times probabilities over the token
    count squared) plus a random linear term, so that the probabilities' gradient is not
    proportional to the counts; and on the output unless use_y is False."""
    loss = (stats[0] * stats[1]).sum() / stats[2, 0] ** 2 + (c * stats[1]).sum()
    return loss + (y * dy).sum() if use_y else loss


def run_stats(x, weights, pe, dy, kw, preset, part, c, mask=None, use_y=True,
              fn=blocks.decoder_layer):
    """(y, stats, dx, {slot: gradient}) of the op with router_stats=True."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in weights.items()}
    y, stats = fn(x, blocks.LayerOptions(weights=w, **rope_args(pe), preset=preset, part=part,
                                         key_padding_mask=mask, router_stats=True, **kw))
    stats_loss(y, stats, dy, c, use_y).backward()
    return (y.detach(), stats.detach(), x.grad,
            {n: t.grad for n, t in w.items() if t.grad is not None})


def run_stats_reference(x, weights, pe, dy, kw, part, c, mask=None, use_y=True):
    """The same through reference_layer (its router logits recorded, reduced by
    stats_reference), at x's dtype."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in weights.items()}
    record = []
    moe = {"k": kw["num_experts_per_tok"], "router": kw["router"],
           "norm_topk_prob": kw["norm_topk_prob"], "record": record}
    y = reference_layer(w, x, *pe, mask if part == "layer" else None, NH, NKV, part=part,
                        moe=moe)
    (logits,) = record
    stats = stats_reference(logits, kw["num_experts_per_tok"], mask)
    stats_loss(y, stats, dy, c, use_y).backward()
    mlp_only = part == "mlp"
    return y.detach(), stats.detach(), x.grad, {
        n: t.grad for n, t in w.items()
        if t.grad is not None and not (mlp_only and n.startswith(("self_attn.",
                                                                    "input_layernorm.")))}


def left_padding(b, s, seed=0):
    """A (B, S) bool key padding mask with 0 .. S-2 padded positions on the left per row (row
    0 unpadded)."""
    g = torch.Generator().manual_seed(seed)
    pads = torch.randint(0, s - 1, (b,), generator=g)
    pads[0] = 0
    return torch.arange(s)[None, :] >= pads[:, None]


def stats_case(routing="qwen2_moe", seed=0, **kw):
    case = moe_case(F64, routing, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 100)
    c = torch.randn(case[1]["mlp.gate.weight"].shape[0], generator=g, dtype=F64)
    return case, c


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("preset,padded", [("fast", False), ("balanced", True),
                                           ("min_memory", True)])
def test_router_stats_fp64(preset, routing, padded):
    """router_stats=True: the op's second output is HF's load-balancing statistics of the
    layer's tokens (3, E), weighted by the key padding mask, and a loss on them adds its
    gradient (through the probability sums) to the router weight, the MLP input's norm, the
    attention and x: all equal the dense reference to 1e-12 (a sigmoid router's statistics
    are still of the softmax, as HF's loss function computes); the output is the one without
    router_stats."""
    case, c = stats_case(routing, k=2 if routing != "olmoe" else 3)
    mask = left_padding(case[0].shape[0], case[0].shape[1]) if padded else None
    got = run_stats(*case, preset, "layer", c, mask)
    assert_f64_second(got, run_stats_reference(*case, "layer", c, mask), "router_stats")
    assert got[1].dtype == F64 and got[1].shape == (3, case[1]["mlp.gate.weight"].shape[0])
    want_y = blocks.decoder_layer(case[0], blocks.LayerOptions(
        weights=case[1], **rope_args(case[2]), preset=preset, key_padding_mask=mask,
        **case[4]))
    assert torch.equal(got[0], want_y)
    assert got[3]["mlp.gate.weight"].abs().max() > 0
    n_real = case[0].shape[0] * case[0].shape[1] if mask is None else int(mask.sum())
    assert got[1][0].sum() == n_real * case[4]["num_experts_per_tok"]


def test_router_stats_chunks_equal_one_chunk():
    """Token chunks of 1, 3 and 4 rows (the statistics summed over chunks, each chunk's rows
    weighted by its share of the mask): the one-chunk statistics and gradients to 1e-12, the
    part 'mlp' and a loss on the statistics alone included."""
    case, c = stats_case("mixtral", seed=3, b=3, s=7)
    mask = left_padding(3, 7, seed=4)
    for part, use_y, preset, chunks in (("layer", True, "balanced", (1, 4)),
                                        ("mlp", True, "min_memory", (3,)),
                                        ("layer", False, "min_memory", (4,))):
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
        whole = run_stats(*case, preset, part, c, mask, use_y)
        assert_f64_second(whole, run_stats_reference(*case, part, c, mask, use_y),
                          "router_stats")
        try:
            for rows in chunks:
                config.update(chunk_bytes=chunk_cap(rows, F64, case[1],
                                                    case[4]["num_experts_per_tok"], part))
                assert_f64_second(run_stats(*case, preset, part, c, mask, use_y), whole,
                                  "router_stats")
        finally:
            config.update(chunk_bytes=config.KernelConfig.chunk_bytes)


def test_router_stats_float32_and_compile():
    """float32: the statistics in float32 within the accuracy rule of the float64 reference;
    torch.compile (fullgraph) of a chunked layer: no graph break, the eager statistics and
    gradients."""
    torch._dynamo.reset()
    case = moe_case(torch.float32, "olmoe", seed=6)
    c = torch.randn(case[1]["mlp.gate.weight"].shape[0], generator=torch.Generator()
                    .manual_seed(7)).to(torch.float32)
    mask = left_padding(2, 9, seed=8)
    try:
        config.update(chunk_bytes=chunk_cap(4, torch.float32, case[1], 2, "layer"))
        eager = run_stats(*case, "min_memory", "layer", c, mask)
        counts = torch._dynamo.utils.counters
        counts.clear()
        compiled = torch.compile(blocks.decoder_layer, backend="aot_eager", fullgraph=True)
        got = run_stats(*case, "min_memory", "layer", c, mask, fn=compiled)
    finally:
        config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    assert sum(counts["graph_break"].values()) == 0, dict(counts["graph_break"])
    assert eager[1].dtype == torch.float32
    for a, b in zip(got[:3], eager[:3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for n in eager[3]:
        torch.testing.assert_close(got[3][n], eager[3][n], rtol=1e-6, atol=1e-6)
    x, weights, pe, dy, kw = case
    ref = run_stats_reference(x.double(), {n: t.double() for n, t in weights.items()},
                              tuple(t.double() for t in pe), dy.double(), kw, "layer",
                              c.double(), mask)
    torch.testing.assert_close(eager[1].double(), ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager[3]["mlp.gate.weight"].double(),
                               ref[3]["mlp.gate.weight"], rtol=1e-4, atol=1e-5)


def test_router_stats_under_autocast_reduce_the_logits():
    """bfloat16 autocast: the statistics are float32 and are exactly what HF's loss function
    reduces the op's own bfloat16 router logits to (top-k counts equal; the sums to float32
    rounding); their gradient into the router weight is that of the same loss on the logits
    within float32 rounding."""
    x, weights, pe, dy, kw = moe_case(torch.float32, "mixtral", hidden=16, inter=8, experts=4,
                                      k=2, seed=12)
    mask = left_padding(2, 9, seed=13)
    c = torch.randn(4, generator=torch.Generator().manual_seed(14))
    grads = []
    for stats_mode in (True, False):
        w = {n: t.clone().requires_grad_() for n, t in weights.items()}
        o = blocks.LayerOptions(weights=w, **rope_args(pe), key_padding_mask=mask,
                                router_stats=stats_mode, router_logits=not stats_mode, **kw)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the op only
            y, second = blocks.decoder_layer(x, o)
        if stats_mode:
            stats = second
        else:
            assert second.dtype == torch.bfloat16
            second = stats_reference(second.float(), 2, mask)
            want = second.detach()
        stats_loss(y, second, dy, c, use_y=False).backward()
        grads.append(w["mlp.gate.weight"].grad)
    assert stats.dtype == torch.float32
    assert torch.equal(stats[0], want[0]) and torch.equal(stats[2], want[2])
    torch.testing.assert_close(stats[1], want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("bad", ["with_logits", "attention", "drouter_shape"])
def test_router_stats_refusals(bad):
    """router_stats with router_logits, on a part without the MLP, and a statistics gradient
    of the wrong shape: clear errors naming the argument."""
    x, weights, pe, dy, kw = moe_case(torch.float32, "olmoe")
    o = blocks.LayerOptions(weights=weights, **rope_args(pe), router_stats=True, **kw)
    if bad == "with_logits":
        with pytest.raises(ValueError, match="router_logits and router_stats are exclusive"):
            blocks.decoder_layer(x, o.replace(router_logits=True))
    elif bad == "attention":
        with pytest.raises(ValueError, match="router_stats=True needs a mixture-of-experts"):
            blocks.decoder_layer(x, o.replace(part="attention"))
    else:
        rest = o.op_args()
        _, saved, stats = torch.ops.ckpt_ext.decoder_layer_fwd(x, *rest)
        assert stats.shape == (3, weights["mlp.gate.weight"].shape[0])
        needs = [w is not None for w in o.weights]
        with pytest.raises(ValueError, match="drouter_logits"):
            torch.ops.ckpt_ext.decoder_layer_bwd(dy, x, *rest, saved, needs,
                                                 torch.zeros(2, stats.shape[1]))


def test_opcheck_router_stats():
    """The forward and backward ops with router_stats=True (the backward given the
    statistics' gradient) pass torch.library.opcheck (the autograd op's path:
    test_router_stats_float32_and_compile)."""
    x, weights, pe, dy, kw = moe_case(torch.float32, "qwen2_moe", seed=8)
    mask = left_padding(2, 9, seed=9)
    o = blocks.LayerOptions(weights=weights, **rope_args(pe), router_stats=True,
                            key_padding_mask=mask, **kw)
    rest = o.op_args()
    torch.library.opcheck(torch.ops.ckpt_ext.decoder_layer_fwd.default, (x, *rest))
    _, saved, stats = torch.ops.ckpt_ext.decoder_layer_fwd(x, *rest)
    needs = [w is not None for w in o.weights]
    torch.library.opcheck(torch.ops.ckpt_ext.decoder_layer_bwd.default,
                          (dy, x, *rest, saved, needs, torch.randn_like(stats)))
