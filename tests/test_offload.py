"""offload="cpu": the fused layers' saved tensors in a host pool, prefetched back in backward.

On the CPU the "device" is the CPU and the host pool a separate allocation, so these tests
check what does not depend on streams: results bit for bit equal to offload=None (every
preset, LoRA with dropout, packed sequences, autocast bf16, a patched HF model), that autograd
holds handles to pooled copies only (by storage identity), the prefetch order, the device pool
of two slots whatever the layer count, pool reuse across steps, an exception inside a step,
the offload_limit split (against ckpt_ext.plan.offload_split), torch.compile (tensors kept,
one warning, no graph breaks) and bad arguments. The CUDA tests (pinned memory, side stream,
overlap in a profiler trace, the sanitizer, CUDA graph capture refused) skip without a GPU.
"""
import copy
import gc
import itertools
import os
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

import ckpt_ext
from ckpt_ext import plan, plan_cli
from ckpt_ext.hf import families
from ckpt_ext.modules import DecoderLayer
from ckpt_ext.offload import Offloader

H, HQ, HKV, I = 64, 4, 2, 88
PRESETS = ("fast", "balanced", "min_memory")
CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU: pinned memory, side-stream copies and events only exist there"


def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def rope(s, d, device="cpu"):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.cat([f, f], -1)
    return emb.cos()[None].to(device), emb.sin()[None].to(device)


def stack(n, preset, offload=None, seed=0, device="cpu"):
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(DecoderLayer(H, HQ, HKV, I, policy=preset, offload=offload)
                                 for _ in range(n))
    with torch.no_grad():
        for p in layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return layers.to(device)


def run(layers, x0, cos, sin, mask=None, dy=None):
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    h = x * 1.0
    for layer in layers:
        h = layer(h, (cos, sin), mask)
    dy = torch.randn_like(h) if dy is None else dy
    h.backward(dy)
    return h.detach(), x.grad, [p.grad.clone() for p in layers.parameters()], dy


def assert_equal_runs(a, b):
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert all(torch.equal(g, r) for g, r in zip(a[2], b[2]))


# ---- arguments ------------------------------------------------------------------------------

def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"offload must be None, 'cpu'"):
        DecoderLayer(H, HQ, HKV, I, offload="gpu")
    with pytest.raises(ValueError, match=r"offload_limit must be non-negative"):
        DecoderLayer(H, HQ, HKV, I, offload="cpu", offload_limit=-1)
    with pytest.raises(TypeError, match=r"offload_limit must be an int"):
        DecoderLayer(H, HQ, HKV, I, offload="cpu", offload_limit=1.5)
    with pytest.raises(ValueError, match=r"offload_limit applies with offload='cpu' only"):
        DecoderLayer(H, HQ, HKV, I, offload_limit=1024)
    with pytest.raises(ValueError, match=r"offload_limit must be >= 0"):
        Offloader(-5)
    with pytest.raises(ValueError, match=r"prefetch must be an int >= 1"):
        Offloader(prefetch=0)
    layer = DecoderLayer(H, HQ, HKV, I, policy="torch", offload="cpu")
    cos, sin = rope(8, H // HQ)
    with pytest.raises(NotImplementedError, match=r"policy 'torch' is not fused"):
        layer(torch.randn(1, 8, H), (cos, sin))
    with torch.no_grad():  # no grad: nothing is saved, nothing refused
        layer(torch.randn(1, 8, H), (cos, sin))


# ---- exactness ------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_bit_for_bit_equal_to_no_offload(preset):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, s = 2, 24
    x0 = torch.randn(b, s, H, generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, :5] = False
    cos, sin = rope(s, H // HQ)
    off = Offloader(record=True)
    ref = run(stack(3, preset, seed=seed), x0, cos, sin, mask)
    got = run(stack(3, preset, off, seed=seed), x0, cos, sin, mask, ref[3])
    assert_equal_runs(got, ref)
    # It did offload: one pack per layer, every saved tensor of the preset moved.
    assert [e for e in off.events if e[0] == "pack"] == [("pack", i) for i in range(3)]
    residuals = 1 + len(ckpt_ext.blocks.RESIDUALS["layer", preset])
    assert off.stats()["host_allocations"] == 3 * residuals
    assert off.stats()["host_in_use"] == 0 and off.stats()["live_layers"] == 0


def test_autocast_bf16_bit_for_bit():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 16, H, generator=g)
    cos, sin = rope(16, H // HQ)
    outs = []
    for off in (None, Offloader()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(run(stack(2, "balanced", off, seed=seed), x0, cos, sin,
                            dy=outs[0][3] if outs else None))
    assert_equal_runs(outs[1], outs[0])


# ---- what autograd holds --------------------------------------------------------------------

@pytest.mark.parametrize("offload", [None, "pool"])
def test_autograd_holds_pooled_copies_only(offload):
    """The layer input is released after forward (autograd holds a handle to a host pool
    buffer instead), and backward reads tensors in the device pool's slots."""
    off = Offloader() if offload else None
    layers = stack(3, "min_memory", off)
    cos, sin = rope(16, H // HQ)
    x = torch.randn(1, 16, H, requires_grad=True)
    inputs, h = [], x * 1.0
    for layer in layers:
        inputs.append(weakref.ref(h))
        h = layer(h, (cos, sin))
    gc.collect()
    alive = [r() is not None for r in inputs]
    if off is None:  # the check can fail: without offload autograd keeps every layer input
        assert alive == [True, True, True]
        return
    assert alive == [False, False, False]
    host = {e.buf.untyped_storage().data_ptr() for g in off._groups.values() for e in g.entries}
    assert len(host) == 3
    for g in off._groups.values():
        for e in g.entries:  # the copy autograd's handle points to lives in the pool buffer
            assert e.host.untyped_storage().data_ptr() == e.buf.untyped_storage().data_ptr()
    h.sum().backward()
    slots = {b.untyped_storage().data_ptr() for b in off.device_buffers()}
    assert host and not (host & slots)
    assert off.stats()["device_slots"] == 2
    # every pooled host buffer is back in the free list, none was lost
    assert host == {b.untyped_storage().data_ptr() for b in off.host_buffers()}


def test_backward_reads_the_device_pool():
    off = Offloader()
    layers = stack(4, "balanced", off)
    cos, sin = rope(16, H // HQ)
    x = torch.randn(1, 16, H, requires_grad=True)
    seen = []
    real = Offloader._unpack

    def spy(self, packed):
        t = real(self, packed)
        if isinstance(packed, ckpt_ext.offload._Handle):
            seen.append(t.untyped_storage().data_ptr())
        return t
    Offloader._unpack = spy
    try:
        h = x * 1.0
        for layer in layers:
            h = layer(h, (cos, sin))
        h.sum().backward()
    finally:
        Offloader._unpack = real
    slots = {b.untyped_storage().data_ptr() for b in off.device_buffers()}
    assert len(seen) == 4 * 4 and set(seen) <= slots  # x, out, lse, h per layer


# ---- prefetch order, pools ------------------------------------------------------------------

@pytest.mark.parametrize("n", [4, 7])
def test_prefetch_order_and_two_device_slots(n):
    off = Offloader(record=True)
    layers = stack(n, "min_memory", off)
    cos, sin = rope(16, H // HQ)
    run(layers, torch.randn(1, 16, H), cos, sin)
    back = [e for e in off.events if e[0] != "pack"]
    # layer i is fetched while layer i+1's backward runs: after the top layer's own fetch,
    # each first use of layer i starts the copy of layer i-1
    expect = [("backward", n - 1), ("fetch", n - 1)]
    for i in range(n - 1, 0, -1):
        expect.append(("prefetch", i - 1))
        expect.append(("backward", i - 1))
    assert back == expect
    assert off.stats()["device_slots"] == 2  # independent of the layer count
    x_bytes = 16 * H * 4
    assert off.stats()["device_pool_bytes"] == 2 * ((x_bytes + 255) // 256 * 256)


def test_prefetch_two_ahead():
    off = Offloader(prefetch=2, record=True)
    run(stack(4, "min_memory", off), torch.randn(1, 16, H), *rope(16, H // HQ))
    back = [e for e in off.events if e[0] in ("fetch", "prefetch")]
    assert back == [("fetch", 3), ("prefetch", 2), ("prefetch", 1), ("prefetch", 0)]
    assert off.stats()["device_slots"] == 3


def test_pools_reused_across_steps():
    off = Offloader()
    layers = stack(3, "fast", off)
    cos, sin = rope(16, H // HQ)
    run(layers, torch.randn(2, 16, H), cos, sin)
    first = off.stats()
    buffers = {b.untyped_storage().data_ptr() for b in off.host_buffers()}
    slots = {b.untyped_storage().data_ptr() for b in off.device_buffers()}
    for _ in range(2):
        run(layers, torch.randn(2, 16, H), cos, sin)
    assert off.stats() == first
    assert {b.untyped_storage().data_ptr() for b in off.host_buffers()} == buffers
    assert {b.untyped_storage().data_ptr() for b in off.device_buffers()} == slots
    assert first["host_in_use"] == 0 and first["host_allocations"] > 0


def test_exception_inside_a_step_leaks_nothing():
    seed = fresh_seed()
    off = Offloader()
    layers = stack(3, "balanced", off, seed=seed)
    cos, sin = rope(16, H // HQ)
    x0 = torch.randn(1, 16, H)
    run(layers, x0, cos, sin)
    before = off.stats()

    # in forward: the third layer gets a malformed input after two layers offloaded theirs
    def forward_fails():
        h = x0.clone().requires_grad_(True) * 1.0
        h = layers[1](layers[0](h, (cos, sin)), (cos, sin))
        assert off.stats()["live_layers"] == 2
        layers[2](h[..., :-1], (cos, sin))
    with pytest.raises(Exception):
        forward_fails()
    gc.collect()
    assert off.stats() == before

    # in backward: a hook raises after the top layer's backward
    h = x0.clone().requires_grad_(True) * 1.0
    mid = layers[0](h, (cos, sin))
    mid.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    out = layers[2](layers[1](mid, (cos, sin)), (cos, sin))
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    del out, mid, h
    gc.collect()
    assert off.stats() == before

    # still usable and exact
    ref = run(stack(3, "balanced", seed=seed), x0, cos, sin)
    assert_equal_runs(run(layers, x0, cos, sin, dy=ref[3]), ref)
    assert off.stats() == before


@pytest.mark.parametrize("preset", ["min_memory", "balanced"])
def test_offload_limit_split(preset):
    n, b, s = 5, 1, 16
    dims = [plan.LayerDims(H, HQ, HKV, H // HQ, I)] * n
    per_layer = plan.layer_bytes(preset, dims[0], b, s, torch.float32)
    limit = 2 * per_layer + per_layer // 2
    layers = stack(n, preset)
    off = Offloader(limit, record=True)
    for layer in layers:
        layer.offloader = off
    cos, sin = rope(s, H // HQ)
    x = torch.randn(b, s, H, requires_grad=True)
    inputs, h = [], x * 1.0
    peak_in_use = 0
    for layer in layers:
        inputs.append(weakref.ref(h))
        h = layer(h, (cos, sin))
        peak_in_use = max(peak_in_use, off.stats()["host_in_use"])
    gc.collect()
    n_off, host, kept = plan.offload_split(dims, [preset] * n, b, s, torch.float32, limit)
    assert n_off == 2 and kept == (n - 2) * per_layer
    # whole layers, as the plan counts them: layers 0, 1 moved all they saved; layer 2 would
    # pass the cap, so it and the layers after it keep everything on the device
    assert peak_in_use == host <= limit
    assert [r() is not None for r in inputs] == [False, False] + [True] * (n - 2)
    packs = {gid for kind, gid in off.events if kind == "pack"}
    assert packs == {0, 1}
    h.sum().backward()
    assert off.stats()["host_in_use"] == 0


def test_patch_llama_limit_string_and_errors():
    transformers = pytest.importorskip("transformers")
    from hf_fixtures import tiny_model
    model = tiny_model("llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=64))
    with pytest.raises(ValueError, match=r"offload must be None, 'cpu'"):
        ckpt_ext.patch_llama(model, offload="gpu")
    with pytest.raises(ValueError, match=r"offload_limit must be non-negative"):
        ckpt_ext.patch_llama(model, offload="cpu", offload_limit=-3)
    with pytest.raises(ValueError, match=r"offload_limit: cannot read"):
        ckpt_ext.patch_llama(model, offload="cpu", offload_limit="lots")
    ckpt_ext.patch_llama(model, offload="cpu", offload_limit="1MiB")
    shared = model.model.layers[0].forward.shared
    assert shared.offloader.limit == 2**20
    assert transformers is not None


# ---- HF models: LoRA with dropout, packed sequences, autocast, auto -------------------------

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def hf_step(model, seed, **batch):
    torch.manual_seed(seed)  # the LoRA dropout seeds
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("setup", ["lora_dropout", "packed", "autocast_bf16", "padded_fast",
                                   "hf_gradient_checkpointing"])
def test_hf_bit_for_bit(setup):
    pytest.importorskip("transformers")
    from hf_fixtures import padded_batch, tiny_model
    seed = fresh_seed()
    model = tiny_model("llama", TINY, perturb=True)
    preset = "fast" if setup == "padded_fast" else "min_memory"
    if setup == "lora_dropout":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.2, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
    model.train()
    policy = preset
    if setup == "hf_gradient_checkpointing":  # taken over: the default policy is min_memory
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = None
    other = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the HF checkpointing notice
        ckpt_ext.patch_llama(model, policy)
        ckpt_ext.patch_llama(other, policy, offload="cpu")
    if setup == "packed":
        g = torch.Generator().manual_seed(seed)
        lengths = [9, 3, 14, 6]
        ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        batch = dict(input_ids=ids, position_ids=pos, labels=ids.clone())
    else:
        ids, mask, labels = padded_batch(TINY["vocab_size"], 2, 20, seed=seed % 1000)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if setup == "autocast_bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref, got = hf_step(model, seed, **batch), hf_step(other, seed, **batch)
    else:
        ref, got = hf_step(model, seed, **batch), hf_step(other, seed, **batch)
    assert torch.equal(ref[0], got[0])
    assert ref[1].keys() == got[1].keys() and len(ref[1]) > 0
    assert all(torch.equal(ref[1][k], got[1][k]) for k in ref[1])
    layers = ckpt_ext.hf.patch._decoder_layers(other)[1]
    off = layers[0].forward.shared.offloader
    assert off.stats()["host_allocations"] > 0 and off.stats()["host_in_use"] == 0
    assert [f.forward.calls["fused"] for f in layers] == [1, 1, 1]


def test_hf_eval_and_no_grad_untouched():
    pytest.importorskip("transformers")
    from hf_fixtures import tiny_model
    model = tiny_model("llama", TINY)
    ckpt_ext.patch_llama(model, "min_memory", offload="cpu")
    off = model.model.layers[0].forward.shared.offloader
    with torch.no_grad():
        model(input_ids=torch.randint(1, 100, (1, 12)), use_cache=False)
    assert off.stats()["host_allocations"] == 0


def _tiny_dims(model):
    return [families.layer_dims(layer, TINY["num_attention_heads"])
            for layer in model.model.layers]


def _mix_cost(order, dims, b, s, budget, host_cap, link, rates):
    """An independent evaluation of one per-layer assignment with offload: (seconds, device
    bytes) or None when the device bytes (the two largest offloaded layers and the layers past
    the host cap) pass the budget. Compute from plan.step_flops of one layer less its head."""
    V = 7
    moved, host, kept, secs = [], 0, 0, 0.0
    for p, d in zip(order, dims):
        f = plan.step_flops(p, [d], V, b, s, train_weights=True)
        head = 2 * b * s * d.hidden_size * V * 4
        compute = (f["attention_forward"] / (rates[0] * 1e12)
                   + f["attention_backward"] / (rates[1] * 1e12)
                   + (f["matmul"] - head) / (rates[2] * 1e12))
        nbytes = plan.layer_bytes(p, d, b, s, torch.float32)
        if host_cap is None or host + nbytes <= host_cap:
            moved.append(nbytes)
            host += nbytes
            secs += max(compute, 2 * nbytes / (link * 1e9))
        else:
            kept += nbytes
            secs += compute
    device = kept + sum(sorted(moved, reverse=True)[:2])
    return (secs, device) if device <= budget else None


def _auto_case(name, dims, b, s):
    """(budget, offload_limit, host link GB/s, expected presets) for the tiny model: copies
    dominate its layers' compute at 25 GB/s, so the fast and balanced cases use links fast
    enough for their copies to hide (above ~2,600 and ~8,300 GB/s)."""
    nb = {p: plan.layer_bytes(p, dims[0], b, s, torch.float32)
          for p in ("fast", "balanced", "min_memory")}
    big = 1 << 40
    return {"default_link": (big, None, None, ["min_memory"] * 3),
            "fast": (big, None, 1e5, ["fast"] * 3),
            "balanced_by_link": (big, None, 5e3, ["balanced"] * 3),
            "balanced_by_budget": (2 * nb["balanced"], None, 1e5, ["balanced"] * 3),
            "mixed": (nb["fast"] + nb["min_memory"], None, 1e5, None),
            "host_cap": (2 * nb["balanced"] + nb["fast"], 2 * nb["balanced"], 5e3, None)}[name]


@pytest.mark.parametrize("case", ["default_link", "fast", "balanced_by_link",
                                  "balanced_by_budget", "mixed", "host_cap"])
def test_auto_with_offload_chooses_by_the_plans_time(case):
    """policy='auto' with offload: the runtime's presets are the plan's choice by time
    (plan.choose_offload_layers at the default throughputs, the offloader's limit and
    prefetch, the given host link) and the fastest of the 3^3 assignments evaluated
    independently; the model trains exactly as with the same presets given explicitly."""
    pytest.importorskip("transformers")
    from hf_fixtures import padded_batch, tiny_model
    from ckpt_ext.throughputs import default_throughputs
    seed = fresh_seed()
    model = tiny_model("llama", TINY, perturb=True)
    b, s = 2, 16
    dims = _tiny_dims(model)
    budget, cap, link, want = _auto_case(case, dims, b, s)
    explicit = copy.deepcopy(model)
    kw = {} if link is None else {"host_link_gbytes_per_s": link}
    ckpt_ext.patch_llama(model, "auto", activation_budget=budget, offload="cpu",
                         offload_limit=cap, **kw)
    model.train()
    ids, mask, labels = padded_batch(TINY["vocab_size"], b, s, seed=seed % 1000)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    got = hf_step(model, seed, **batch)
    chosen = list(model.model.layers[0].forward.shared.auto.values())
    assert len(chosen) == 1
    chosen = chosen[0]
    rates = default_throughputs().step_time_kwargs(s)
    ref = plan.choose_offload_layers(dims, b, s, torch.float32, budget, cap,
                                     host_link_gbytes_per_s=link or plan.HOST_LINK_GBYTES_PER_S,
                                     **rates)
    assert chosen == list(ref.presets)
    if want is not None:
        assert chosen == want
    costs = {}
    for order in itertools.product(("fast", "balanced", "min_memory"), repeat=3):
        c = _mix_cost(order, dims, b, s, budget, cap, link or plan.HOST_LINK_GBYTES_PER_S,
                      (rates["attention_fwd_tflops"], rates["attention_bwd_tflops"],
                       rates["matmul_tflops"]))
        if c is not None:
            costs[order] = c
    best = min(costs.values())
    assert costs[tuple(chosen)][0] == pytest.approx(best[0], rel=1e-9)
    if case == "mixed":   # one fast layer beside min_memory ones beats balanced everywhere
        assert sorted(chosen) == ["fast", "min_memory", "min_memory"]
    if case == "host_cap":   # two balanced layers fill the host; one fast stays on the device
        assert sorted(chosen) == ["balanced", "balanced", "fast"]
    ckpt_ext.patch_llama(explicit, list(chosen), offload="cpu", offload_limit=cap)
    explicit.train()
    ref_step = hf_step(explicit, seed, **batch)
    assert torch.equal(got[0], ref_step[0])
    assert got[1].keys() == ref_step[1].keys() and len(got[1]) > 0
    assert all(torch.equal(got[1][k], ref_step[1][k]) for k in got[1])
    assert [f.forward.calls["fused"] for f in model.model.layers] == [1, 1, 1]


def test_auto_with_offload_refuses_bad_input():
    """A host link that is not a positive finite number, a host link without auto and
    offload, and a budget below the prefetch pool at min_memory: ValueErrors naming them."""
    pytest.importorskip("transformers")
    from hf_fixtures import tiny_model
    model = tiny_model("llama", TINY)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "25"):
        with pytest.raises(ValueError, match="host_link_gbytes_per_s must be a positive"):
            ckpt_ext.patch_llama(model, "auto", activation_budget="1GiB", offload="cpu",
                                 host_link_gbytes_per_s=bad)
    with pytest.raises(ValueError, match="host_link_gbytes_per_s applies to policy='auto' with "
                                         "offload only"):
        ckpt_ext.patch_llama(model, "auto", activation_budget="1GiB",
                             host_link_gbytes_per_s=100)
    with pytest.raises(ValueError, match="host_link_gbytes_per_s must be a positive"):
        plan.choose_offload_layers(_tiny_dims(model), 1, 8, torch.float32, 1 << 30, None,
                                   host_link_gbytes_per_s=-5)
    with pytest.raises(ValueError, match="matmul_tflops must be a positive"):
        plan.choose_offload_layers(_tiny_dims(model), 1, 8, torch.float32, 1 << 30, None,
                                   matmul_tflops=0)
    b, s = 2, 16
    dims = _tiny_dims(model)
    pool = plan.offload_device_bytes(dims, ["min_memory"] * 3, b, s, torch.float32)
    ckpt_ext.patch_llama(model, "auto", activation_budget=pool - 1, offload="cpu")
    model.train()
    ids = torch.randint(1, 100, (b, s))
    with pytest.raises(ValueError, match=rf"below the offload prefetch pool .*the smallest "
                                         rf"budget that fits is {pool}$"):
        model(input_ids=ids, labels=ids, use_cache=False)
    ckpt_ext.patch_llama(model, "auto", activation_budget=pool, offload="cpu")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert list(model.model.layers[0].forward.shared.auto.values()) == [["min_memory"] * 3]


# ---- torch.compile --------------------------------------------------------------------------

def test_compile_keeps_tensors_on_device_with_one_warning():
    torch._dynamo.reset()
    seed = fresh_seed()
    off = Offloader()
    layers = stack(2, "min_memory", off, seed=seed)
    cos, sin = rope(16, H // HQ)
    x0 = torch.randn(1, 16, H)

    def f(h):
        for layer in layers:
            h = layer(h, (cos, sin))
        return h
    explain = torch._dynamo.explain(f)(x0.clone().requires_grad_(True))
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    ckpt_ext.offload._COMPILE_WARNED.discard(off.key)
    compiled = torch.compile(f, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = x0.clone().requires_grad_(True)
        y = compiled(x)
        y2 = compiled(x0.clone().requires_grad_(True))
    msgs = [str(w.message) for w in caught if "offload" in str(w.message)]
    assert len(msgs) == 1 and "torch.compile" in msgs[0]
    assert off.stats()["host_allocations"] == 0
    dy = torch.randn_like(y)
    y.backward(dy)
    del y2
    ref = run(stack(2, "min_memory", seed=seed), x0, cos, sin, dy=dy)
    assert torch.equal(x.grad, ref[1])


# ---- plan -----------------------------------------------------------------------------------

def test_plan_offload_peak_is_independent_of_layer_count():
    d = plan.LayerDims(4096, 32, 8, 128, 14336)
    peaks = [plan.offload_step_peak("min_memory", [d] * n, 128256, 1, 131072, torch.bfloat16,
                                    train_weights=False) for n in (8, 32)]
    assert peaks[0].peak == peaks[1].peak
    assert peaks[1].host == 32 * plan.layer_bytes("min_memory", d, 1, 131072, torch.bfloat16)
    base = plan.step_peak("min_memory", [d] * 32, 128256, 1, 131072, torch.bfloat16,
                          train_weights=False)
    assert peaks[1].peak == base.peak - peaks[1].host + peaks[1].pool
    with pytest.raises(ValueError, match="offload moves what a fused layer saves"):
        plan.offload_step_peak("hf_gc", [d], 100, 1, 16, torch.bfloat16)


def test_plan_cli_offload(capsys):
    rc = plan_cli.main(["--hidden-size", "4096", "--heads", "32", "--kv-heads", "8",
                    "--intermediate-size", "14336", "--layers", "32", "--vocab-size", "128256",
                    "--batch", "1", "--seq", "131072", "--weights", "lora", "--offload",
                    "--device-memory", "80GiB", "--host-memory", "256GiB"])
    out = capsys.readouterr().out
    assert rc == 0 and "offload='cpu'" in out
    assert "host memory for offloaded tensors: 256.00 GiB (--host-memory)" in out
    assert next(line for line in out.splitlines() if line.startswith("min_memory")
                and "32/32" in line)  # every layer's saved tensors in host memory at S 131,072
    row = next(line for line in out.splitlines() if line.startswith("min_memory + offload"))
    longest = int(row.split()[-3].replace(",", ""))  # the verdict's longest S, its step s and
    # tokens/s
    # 8B LoRA, 80 GiB device, 256 GiB host: the host holds 1M tokens of layer inputs
    # (32 * 8 KiB per token) and the search stops at the host cap
    assert longest >= 1_000_000
    d = plan.LayerDims(4096, 32, 8, 128, 14336)
    n, host, kept = plan.offload_split([d] * 32, ["min_memory"] * 32, 1, longest + 1,
                                       torch.bfloat16, 256 * 2**30)
    assert n < 32  # one more token and a layer would stay on the device
    with pytest.raises(SystemExit):
        plan_cli.main(["--hidden-size", "64", "--heads", "4", "--intermediate-size", "96",
                   "--layers", "2", "--vocab-size", "10", "--batch", "1", "--seq", "8",
                   "--host-memory", "1GiB"])


def test_cpu_step_peak_holds_the_pool_not_the_layers():
    """The allocator's peak of a second step (the pools exist already): with offload it
    does not grow with the layer count; without it grows by one layer input per layer."""
    cos, sin = rope(64, H // HQ)
    x0 = torch.randn(2, 64, H)

    def step(layers):
        h = x0.clone().requires_grad_(True) * 1.0
        for layer in layers:
            h = layer(h, (cos, sin))
        h.sum().backward()

    peaks = {}
    for off in (False, True):
        for n in (2, 6):
            layers = stack(n, "min_memory", Offloader() if off else None)
            step(layers)
            peaks[off, n] = ckpt_ext.peak_memory_bytes(step, layers)
    x_bytes = x0.numel() * 4
    assert peaks[False, 6] - peaks[False, 2] >= 4 * x_bytes
    assert peaks[True, 6] == peaks[True, 2]


# ---- CUDA -----------------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_cuda_pinned_side_stream_and_exact():
    seed = fresh_seed()
    off = Offloader(record=True)
    cos, sin = rope(256, H // HQ, "cuda")
    x0 = torch.randn(2, 256, H, device="cuda")
    ref = run(stack(4, "balanced", seed=seed, device="cuda"), x0, cos, sin)
    got = run(stack(4, "balanced", off, seed=seed, device="cuda"), x0, cos, sin, dy=ref[3])
    torch.cuda.synchronize()
    assert torch.allclose(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5)
    assert all(b.is_pinned() for b in off.host_buffers())
    assert all(b.is_cuda for b in off.device_buffers()) and off.stats()["device_slots"] == 2
    assert len(off._streams) == 1


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_cuda_graph_capture_refused():
    layers = stack(1, "min_memory", Offloader(), device="cuda")
    cos, sin = rope(16, H // HQ, "cuda")
    x = torch.randn(1, 16, H, device="cuda", requires_grad=True)
    layers[0](x, (cos, sin)).sum().backward()  # warm up
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph capture is not supported"):
        with torch.cuda.graph(g):
            layers[0](x, (cos, sin))


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_cuda_copies_overlap_compute_in_profiler_trace():
    """A host-to-device copy of the side stream runs while a compute kernel runs."""
    h, hq, hkv, i, s = 1024, 8, 8, 2816, 4096
    torch.manual_seed(0)
    off = Offloader()
    layers = torch.nn.ModuleList(DecoderLayer(h, hq, hkv, i, policy="min_memory", offload=off)
                                 for _ in range(4)).cuda().to(torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in rope(s, h // hq, "cuda"))
    x0 = torch.randn(1, s, h, device="cuda", dtype=torch.bfloat16)
    run(layers, x0, cos, sin)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(layers, x0, cos, sin)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in ev if "HtoD" in e.name or "Memcpy HtoD" in e.name]
    kernels = [e for e in ev if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies, "no host-to-device copies in the trace"

    def overlap(a, b):
        return a.time_range.start < b.time_range.end and b.time_range.start < a.time_range.end
    assert any(overlap(c, k) for c in copies for k in kernels)


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_cuda_sanitizer_finds_no_race():
    code = (
        "import torch, ckpt_ext\n"
        "from ckpt_ext.modules import DecoderLayer\n"
        "from ckpt_ext.offload import Offloader\n"
        "off = Offloader()\n"
        "layers = torch.nn.ModuleList(DecoderLayer(64, 4, 2, 128, policy=p, offload=off) "
        "for p in ('min_memory', 'balanced', 'fast')).cuda()\n"
        "s = 128\n"
        "inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))\n"
        "f = torch.outer(torch.arange(s).float(), inv); e = torch.cat([f, f], -1)\n"
        "cos, sin = e.cos()[None].cuda(), e.sin()[None].cuda()\n"
        "for _ in range(2):\n"
        "    h = torch.randn(1, s, 64, device='cuda', requires_grad=True) * 1.0\n"
        "    for l in layers: h = l(h, (cos, sin))\n"
        "    h.sum().backward()\n"
        "torch.cuda.synchronize(); print('ok')\n")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-4000:]
    assert "CSAN" not in r.stderr, r.stderr[-4000:]


@pytest.mark.parametrize("family, ranks", [("llama", (8, 0)), ("qwen3_moe", (4, 4))])
def test_auto_with_offload_counts_the_adapters(family, ranks):
    """policy='auto' with offload on a PEFT model: the time model counts its adapters' GEMMs
    (rank read off the lora_A weights: dense (r, in), experts' (r * E, in)), so the choice is
    the plan's for that rank with frozen base weights."""
    pytest.importorskip("peft")
    import peft
    from hf_fixtures import TINY as FIXTURE_TINY
    from hf_fixtures import make_model, padded_batch
    from test_hf_moe import make as make_moe
    from ckpt_ext.throughputs import default_throughputs
    model = make_moe(family) if family == "qwen3_moe" else make_model(family)
    extra = ({"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
             if family == "qwen3_moe" else {})
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=ranks[0], lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] +
        ([] if family == "qwen3_moe" else ["gate_proj", "up_proj", "down_proj"]), **extra))
    b, s = 2, 16
    ckpt_ext.patch_llama(model, "auto", activation_budget=1 << 40, offload="cpu",
                         host_link_gbytes_per_s=1e5)
    base = model.get_base_model()
    shared = base.model.layers[0].forward.shared
    assert shared.lora_ranks() == ranks
    ids, mask, labels = padded_batch(FIXTURE_TINY["vocab_size"], b, s)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    (key, chosen), = shared.auto.items()
    assert key == (b, s, torch.float32, False, *ranks)
    ref = plan.choose_offload_layers(shared.layer_dims(), b, s, torch.float32, 1 << 40, None,
                                     train_weights=False, lora_rank=ranks[0],
                                     expert_lora_rank=ranks[1], host_link_gbytes_per_s=1e5,
                                     **default_throughputs().step_time_kwargs(s))
    assert chosen == list(ref.presets)
