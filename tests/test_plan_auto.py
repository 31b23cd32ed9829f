"""policy="auto" by time: the plan's layer time model (FLOPs, the chunks' weight-gradient sums,
the host's per-chunk issue time), its choice over HF's layer, its checkpointed run and the fused
presets (checked against a brute force over every mix), the device's room as the budget, and
patch_llama running what it chose."""
import copy
import itertools
import math

import pytest
import torch

import ckpt_ext
from ckpt_ext import config, plan
from ckpt_ext.layer_record import LayerDims
from ckpt_ext.throughputs import (Overheads, default_throughputs, throughputs_from_dict,
                                  write_throughputs)

GiB = 2**30
LLAMA3_8B = LayerDims(4096, 32, 8, 128, 14336)
V = 128256
BF16 = torch.bfloat16
RATES = dict(attention_fwd_tflops=350.0, attention_bwd_tflops=170.0, matmul_tflops=400.0)


def _room(layers, device_gib, weights):
    total = device_gib * GiB
    return total - plan.headroom_bytes(total) - plan.model_state_bytes(layers, V, BF16, weights)


# ---- the time model ------------------------------------------------------------------------------
def test_layer_seconds_by_hand():
    """fp64 arithmetic from the counts: FLOPs at the rates, (n - 1) weight-sized fp32 sums of
    (8 + e) bytes a weight, the host's issue time per chunk, the larger of device and host."""
    d, B, S = LLAMA3_8B, 1, 16384
    T = B * S
    H, Q, K, I = 4096, 4096, 1024, 14336
    attn = 2 * Q * (S + 1) * T                       # scores and P V, causal, per layer
    proj = 2 * T * (H * (Q + 2 * K) + Q * H + 3 * H * I)
    o = Overheads(chunk_sum_gbytes_per_s=1000.0, chunk_launch_seconds=1e-3,
                  lora_chunk_launch_seconds=2e-3)
    # none: forward, 2.5x in the attention backward, dx and dW: nothing recomputed
    none = attn / 350e12 + 2.5 * attn / 170e12 + 3 * proj / 400e12
    got = plan.layer_seconds("none", d, B, S, BF16, overheads=o, **RATES)
    assert got == pytest.approx(none, rel=1e-12)
    # fast at one chunk: the same FLOPs; at four, three sums of every weight
    assert plan.layer_seconds("fast", d, B, S, BF16, chunks=1, overheads=o, **RATES) == \
        pytest.approx(none, rel=1e-12)
    params = H * (2 * Q + 2 * K) + 3 * H * I
    four = plan.layer_seconds("fast", d, B, S, BF16, chunks=4, overheads=o, **RATES)
    assert four - none == pytest.approx(3 * params * 10 / 1000e9, rel=1e-9)
    # no sums for a frozen base (LoRA): the adapters' gradients are small
    lora = dict(train_weights=False, lora_rank=16)
    assert plan.layer_seconds("fast", d, B, S, BF16, chunks=4, overheads=o, **lora, **RATES) \
        == pytest.approx(plan.layer_seconds("fast", d, B, S, BF16, overheads=o, **lora,
                                            **RATES), rel=1e-12)
    # torch: the whole forward once more (attention forward and every projection)
    torch_s = plan.layer_seconds("torch", d, B, S, BF16, overheads=o, **RATES)
    assert torch_s - none == pytest.approx(attn / 350e12 + proj / 400e12, rel=1e-9)
    # a tiny layer is the host's: chunks x (launch + LoRA launch); HF's layer is one chunk
    tiny = LayerDims(64, 4, 2, 16, 128)
    assert plan.layer_seconds("fast", tiny, 1, 64, BF16, chunks=3, overheads=o, **lora) == \
        pytest.approx(3 * 3e-3)
    assert plan.layer_seconds("none", tiny, 1, 64, BF16, chunks=3, overheads=o, **lora) == \
        pytest.approx(3e-3)
    assert plan.layer_seconds("torch", tiny, 1, 64, BF16, overheads=o) == pytest.approx(4e-3 / 3)


def test_layer_seconds_refuses_bad_input():
    with pytest.raises(ValueError, match="preset must be one of none, torch, fast"):
        plan.layer_seconds("quick", LLAMA3_8B, 1, 64, BF16)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        plan.layer_seconds("fast", LLAMA3_8B, 1, 64, BF16, chunks=0)
    with pytest.raises(ValueError, match="chunk_sum_gbytes_per_s must be a positive"):
        plan.layer_seconds("fast", LLAMA3_8B, 1, 64, BF16, chunks=2,
                           overheads=Overheads(chunk_sum_gbytes_per_s=0.0))


def test_layer_chunks_are_the_engines():
    """ceil(B*S / rows) with the engine's rows: on CUDA at least 4,096 (LLaMA-3-8B: 16K tokens
    are 4 chunks); the CPU's rows within the cap."""
    assert plan.layer_chunks(LLAMA3_8B, 1, 4096, BF16, chunk_bytes=64 << 20) == 1
    assert plan.layer_chunks(LLAMA3_8B, 1, 16384, BF16, chunk_bytes=64 << 20) == 4
    assert plan.layer_chunks(LLAMA3_8B, 2, 16384, BF16, chunk_bytes=64 << 20) == 8
    rows = plan.layer_chunk_rows(LLAMA3_8B, 2, 64 << 20, 0)
    assert plan.layer_chunks(LLAMA3_8B, 1, 4096, BF16, path="cpu", chunk_bytes=64 << 20) == \
        -(-4096 // rows) > 1


# ---- the choice ------------------------------------------------------------------------------------
def _brute_force(layers, S, room, **kw):
    """The fastest mix of AUTO_CHOICES whose modelled peak fits room (ties: fewer bytes)."""
    lora = {k: kw[k] for k in ("train_weights", "lora_rank") if k in kw}
    tw = kw.get("train_weights", True)
    work, cost = {}, {}
    for p in plan.AUTO_CHOICES:
        setup = "hf_gc+fused" if p == "torch" else p
        peak = plan.step_peak(setup, layers, V, 1, S, BF16, train_weights=tw).peak
        saved = [plan._saved_bytes(p, x, 1, S, BF16, tw) for x in layers]
        work[p] = peak - sum(saved)
        n = plan.layer_chunks(layers[0], 1, S, BF16)
        cost[p] = (saved[0], plan.layer_seconds(p, layers[0], 1, S, BF16, chunks=n, **lora))
    best = None
    for mix in itertools.product(plan.AUTO_CHOICES, repeat=len(layers)):
        b = sum(cost[p][0] for p in mix)
        if b + max(work[p] for p in mix) > room:
            continue
        key = (round(sum(cost[p][1] for p in mix), 12), b)
        if best is None or key < best[0]:
            best = (key, mix)
    return best


@pytest.mark.parametrize("weights", ["full", "lora"])
def test_room_to_spare_at_4k_is_the_fastest_fitting_setup(weights):
    """LLaMA-3-8B dims, 3 layers, an 80 GiB device, S 4K: auto's choice is the fastest of all
    5^3 mixes that fit (a brute force), which is the fastest uniform setup, and it is never
    slower than HF's layer or its checkpointed run."""
    layers = [LLAMA3_8B] * 3
    kw = dict(train_weights=weights == "full", lora_rank=0 if weights == "full" else 16)
    room = _room(layers, 80, weights)
    got = plan.choose_auto(layers, V, 1, 4096, BF16, room=room, **kw)
    (secs, saved), mix = _brute_force(layers, 4096, room, **kw)
    assert got.presets == mix and got.saved == saved
    assert got.seconds == pytest.approx(secs, rel=1e-9)
    lk = {k: v for k, v in kw.items()}
    for p in plan.AUTO_CHOICES:       # room for everything: each uniform setup fits
        uniform = 3 * plan.layer_seconds(p, LLAMA3_8B, 1, 4096, BF16, **lk)
        assert got.seconds <= uniform * (1 + 1e-12), p
    assert got.peak <= room and got.chunks == (1, 1, 1)


def test_tight_room_mixes_and_more_room_is_never_slower():
    """Between the smallest room that fits and one with room to spare the choice matches the
    brute force at every step, its peak fits, and its time never rises with the room."""
    layers = [LLAMA3_8B] * 3
    S = 32768
    top = plan.choose_auto(layers, V, 1, S, BF16, room=10**15).peak   # unconstrained
    low = plan.step_peak("min_memory", layers, V, 1, S, BF16).peak
    with pytest.raises(ValueError, match=f"smallest that fits: {low} bytes"):
        plan.choose_auto(layers, V, 1, S, BF16, room=low - 1)
    last = math.inf
    mixes = set()
    last_ruled = math.inf
    for room in [low + k * (top - low) // 12 for k in range(13)]:
        # at the cap's chunks (the chunk rule off), against the brute force at those chunks
        got = plan.choose_auto(layers, V, 1, S, BF16, room=room, chunk_rule=False)
        (secs, saved), mix = _brute_force(layers, S, room)
        assert got.presets == mix, (room, got.presets, mix)
        assert got.peak <= room
        assert got.seconds <= last * (1 + 1e-12)
        last = got.seconds
        mixes.add(got.presets)
        # with the chunk rule (tests/test_chunk_rule.py holds it to its own brute force):
        # never slower than at the cap's chunks, within the room, never slower with more room
        ruled = plan.choose_auto(layers, V, 1, S, BF16, room=room)
        assert ruled.peak <= room and ruled.seconds <= got.seconds * (1 + 1e-12)
        assert ruled.seconds <= last_ruled * (1 + 1e-12)
        last_ruled = ruled.seconds
    assert ("min_memory",) * 3 in mixes and len(mixes) >= 3, mixes


def test_at_128k_it_is_min_memory_where_the_room_is_tight():
    """LLaMA-3-8B, 32 layers, PEFT LoRA r 16, S 128K: HF's layer (checkpointed or not) never
    fits beside the rest; at the smallest room that fits every layer is min_memory; on an
    80 GiB H100 most are, the rest balanced (faster, and within the room); with offload
    configured the plan's offload choice (choose_presets_offload) fits the same room."""
    layers = [LLAMA3_8B] * 32
    kw = dict(train_weights=False, lora_rank=16)
    S = 131072
    need = plan.step_peak("min_memory", layers, V, 1, S, BF16, train_weights=False).peak
    tight = plan.choose_auto(layers, V, 1, S, BF16, room=need, **kw)
    assert tight.presets == ("min_memory",) * 32 and tight.peak == need
    room = _room(layers, 80, "lora")
    h100 = plan.choose_auto(layers, V, 1, S, BF16, room=room, **kw)
    assert set(h100.presets) <= {"balanced", "min_memory"}
    assert h100.presets.count("min_memory") > 16 and h100.peak <= room
    # the chunk rule: fewer, larger chunks where the room holds them; the cap's 4,096 rows
    # (32 chunks) when chunk_bytes is pinned
    assert all(n < 32 for n in h100.chunks) and h100.peak <= room
    with config.patch(chunk_bytes=config.KernelConfig.chunk_bytes):
        pinned = plan.choose_auto(layers, V, 1, S, BF16, room=room, **kw)
    assert pinned.presets == h100.presets and pinned.chunks == (32,) * 32
    off = plan.choose_presets_offload(layers, V, 1, S, BF16, room, 256 * GiB, **kw)
    assert off.peak <= room


def test_budget_counts_the_layers_saved_bytes_only():
    """activation_budget: the layers' saved bytes at most the budget (HF's plain layer counted
    by plain_layer_bytes), the fastest such mix."""
    layers = [LLAMA3_8B] * 2
    S = 8192
    plain = plan.plain_layer_bytes(LLAMA3_8B, 1, S, BF16)
    fast = plan.layer_bytes("fast", LLAMA3_8B, 1, S, BF16)
    assert plain > fast
    got = plan.choose_auto(layers, V, 1, S, BF16, budget=2 * plain)
    assert got.saved <= 2 * plain and got.peak == 0
    got_small = plan.choose_auto(layers, V, 1, S, BF16, budget=plain + fast)
    assert got_small.saved <= plain + fast and got_small.seconds >= got.seconds
    with pytest.raises(ValueError, match="exactly one of room"):
        plan.choose_auto(layers, V, 1, S, BF16)
    with pytest.raises(ValueError, match="exactly one of room"):
        plan.choose_auto(layers, V, 1, S, BF16, room=1, budget=1)


def test_moe_layers_choose_among_the_fused_presets():
    moe = LayerDims(2048, 32, 4, 128, 0, experts=128, top_k=8, expert_intermediate_size=768)
    got = plan.choose_auto([moe, moe], V, 1, 4096, BF16, budget=10**12)
    assert set(got.presets) <= {"fast", "balanced", "min_memory"}


def test_plain_layer_bytes_is_the_torch_presets_rerun():
    """HF's plain layer keeps what the torch preset's re-run holds at its backward: step_peak
    of "none" and "hf_gc+fused" differ by that layer's bytes less one layer input per
    layer."""
    d, S = LLAMA3_8B, 4096
    plain = plan.plain_layer_bytes(d, 1, S, BF16)
    e = 2
    assert plain == e * S * (6 * 4096 + 2 * 4096 + 2 * 1024 + 6 * 14336) + 4 * 32 * S \
        + S * 6 * 4096
    lora = plan.plain_layer_bytes(d, 1, S, BF16, train_weights=False)
    assert lora - plain == S * (4 * (5 * 4096 + 4096 + 14336) - 2 * (2 * 4096 + 14336))
    none = plan.step_peak("none", [d] * 2, V, 1, S, BF16)
    assert none.saved >= 2 * plain


# ---- the throughputs file's overheads -------------------------------------------------------------
def test_throughputs_file_overheads(tmp_path):
    rates = default_throughputs()
    assert rates.overheads == Overheads()
    headers = {"command": "test", "commit": "x", "machine": "m", "date": "2026-12-06"}
    path = tmp_path / "t.json"
    write_throughputs(path, headers, rates.rates, overheads={"chunk_launch_seconds": 5e-4})
    back = ckpt_ext.throughputs.load_throughputs(path)
    assert back.overheads == Overheads(chunk_launch_seconds=5e-4)
    data = {"format": "ckpt_ext kernel throughputs 2", **headers,
            "rates": [r.as_dict() for r in rates.rates]}
    for bad in ({"chunk_launch_us": 1.0}, {"chunk_sum_gbytes_per_s": 0}, [1],
                {"lora_chunk_launch_seconds": -1.0}):
        with pytest.raises(ValueError, match="overheads"):
            throughputs_from_dict(dict(data, overheads=bad), "t.json")


# ---- patch_llama ------------------------------------------------------------------------------------
def _tiny():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(int(torch.randint(2**31, ())))
    return transformers.LlamaForCausalLM(cfg).double()


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def test_patch_runs_hf_layer_and_checkpoint_when_auto_chooses_them(monkeypatch):
    """A choice of HF's layer and its checkpointed run (forced here: at tiny sizes the time
    model ties them with the fused presets, which save less) runs those paths, and the step
    equals HF's (float64)."""
    ref = _tiny()
    ids = torch.randint(128, (2, 19))
    asked = []

    def choose(*args, **kw):
        asked.append(kw)
        return plan.AutoChoice(("none", "torch", "fast"), 1.0, 0, 0, (1, 1, 1))

    monkeypatch.setattr(plan, "choose_auto", choose)
    model = ckpt_ext.patch_llama(copy.deepcopy(ref), "auto", activation_budget="1GiB")
    loss, grads = _step(model, ids)
    loss_r, grads_r = _step(ref, ids)
    calls = [dict(layer.forward.calls) for layer in model.model.layers]
    assert calls == [{"none": 1}, {"torch": 1}, {"fused": 1}], calls
    assert asked[0]["budget"] == GiB and asked[0]["room"] is None
    assert asked[0]["path"] == "cpu"
    # HF's loss is float32 even in a float64 model (its cross-entropy upcasts to float32)
    torch.testing.assert_close(loss.double(), loss_r.double(), rtol=1e-6, atol=1e-7)
    assert set(grads) == set(grads_r)
    for n, g in grads_r.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_device_room_is_memory_less_state_and_headroom(monkeypatch):
    """No activation_budget on CUDA: the device's memory less the model's state (weights, and
    for those that train their gradient and AdamW's two moments) and the headroom."""
    model = ckpt_ext.patch_llama(_tiny(), "auto")
    shared = model.model.layers[0].forward.shared
    total = 80 * GiB

    class Props:
        total_memory = total

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    n = sum(p.numel() for p in model.parameters())
    assert shared.device_room("cuda:0", True) == total - 4 * 8 * n - plan.headroom_bytes(total)
    # a frozen base: weights only
    for p in model.parameters():
        p.requires_grad_(False)
    assert shared.device_room("cuda:0", False) == total - 8 * n - plan.headroom_bytes(total)
    with pytest.raises(ValueError, match="policy='auto' on the CPU .* needs activation_budget"):
        shared.device_room("cpu", True)


@pytest.mark.parametrize("offload", [None, "cpu"], ids=["device", "offload"])
def test_patch_without_budget_chooses_within_the_device_room(monkeypatch, offload):
    """No activation_budget, a CUDA device: the choice for a shape is the plan's for the room
    device_room gives (here set), with offload the plan's offload choice within that room and
    each preset's working set; a room below every layer at min_memory raises, naming it."""
    from ckpt_ext.hf.families import layer_dims_from_config
    model = ckpt_ext.patch_llama(_tiny().float(), "auto", offload=offload)
    shared = model.model.layers[0].forward.shared
    dims = layer_dims_from_config(model.config)
    room = {"bytes": 10**12}
    monkeypatch.setattr(type(shared), "device_room", lambda self, device, tw: room["bytes"])
    got = shared._choice(1, 64, torch.float32, True, 0, 0, device="cuda:0")
    rates = default_throughputs()
    if offload is None:
        want = plan.choose_auto(dims, 128, 1, 64, torch.float32, room=10**12, path="cuda",
                                overheads=rates.overheads, **rates.step_time_kwargs(64))
        assert got == list(want.presets)
    else:
        assert len(got) == 3 and set(got) <= {"fast", "balanced", "min_memory"}
    room["bytes"] = 1000
    with pytest.raises(ValueError, match="1000 B|smallest that fits"):
        shared._choice(1, 65, torch.float32, True, 0, 0, device="cuda:0")


def test_offload_without_budget_falls_back_to_segments(monkeypatch):
    """No activation_budget, a CUDA device, offload_limit one layer input: a room one byte
    below every layer at min_memory's step peak (plan.offload_step_peak) fits no mix; auto
    falls back to min_memory in segments of the plan's k (choose_segment_layers within that
    room, offload_limit as the host memory), k > 1; a room that nothing fits names both."""
    from ckpt_ext.hf.families import layer_dims_from_config
    b, s = 1, 64
    x = b * s * 64 * 4
    model = ckpt_ext.patch_llama(_tiny().float(), "auto", offload="cpu", offload_limit=x)
    shared = model.model.layers[0].forward.shared
    dims = layer_dims_from_config(model.config)
    one = plan.offload_step_peak("min_memory", dims, 128, b, s, torch.float32, path="cuda",
                                 host_limit=x).peak
    room = {"bytes": one - 1}
    monkeypatch.setattr(type(shared), "device_room", lambda self, device, tw: room["bytes"])
    got = shared._choice(b, s, torch.float32, True, 0, 0, device="cuda:0")
    assert got == ["min_memory"] * 3
    (k, why), = shared.auto_segments.values()
    want = plan.choose_segment_layers(dims, 128, b, s, torch.float32, one - 1, x, path="cuda",
                                      **default_throughputs().step_time_kwargs(s))
    assert k == want.segment_layers > 1 and want.peak < one
    assert "hold no mix of presets" in why
    room["bytes"] = 1000
    with pytest.raises(ValueError, match="hold no mix of presets.*nor does min_memory in "
                                         "segments.*no k in 1..3 fits"):
        shared._choice(b, s + 1, torch.float32, True, 0, 0, device="cuda:0")
