"""Segments of several decoder layers (``patch_llama(..., segment_layers=k)``, ckpt_ext.segments):
the loss and every gradient equal those of one-layer segments (k = 1) bit for bit on the CPU,
fp32 and bf16, with PEFT LoRA dropout, padding, packed sequences, offload, the fused presets, a
k that does not divide the layer count, several families and an MoE one, sequence parallelism
on 2 gloo processes, FSDP2 on 2 gloo processes (fully_shard per layer: each replayed layer's
parameters gathered for its replay); the rebuilt inputs are the ones the backward uses and
each is freed after its layer's backward, the inputs of layers 2..k after the forward; a layer
that runs HF's forward ends the segment; the host bytes of k = 2 and 4 are 1/2 and 1/4 of
k = 1's (bench/segments.py's measurement); a weight released before the rebuild raises; bad
values and the combinations not built are refused."""
import contextlib
import copy
import importlib.util
import math
import os
import pathlib
import warnings
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason="segments are tested on HF models")

import ckpt_ext  # noqa: E402
from ckpt_ext import segments  # noqa: E402
from ckpt_ext.hf.patch import _decoder_layers  # noqa: E402
from hf_fixtures import TINY, padded_batch, tiny_model  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def model_of(family="llama", layers=4, seed=0, lora_dropout=None, dtype=None, **config):
    model = tiny_model(family, {**TINY, "num_hidden_layers": layers, **config}, seed=seed,
                       perturb=True)
    if lora_dropout is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=lora_dropout, init_lora_weights=False,
            target_modules=LORA_TARGETS))
    if dtype is not None:
        model = model.to(dtype)
    return model.train()


def batch_of(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "packed":  # segment ids from position_ids, no attention mask
        lengths = [9, 3, 14, 6]
        ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        return dict(input_ids=ids, position_ids=pos, labels=ids.clone())
    if kind == "padded":
        ids, mask, labels = padded_batch(TINY["vocab_size"], 2, 19, pad=5, seed=seed % 1000)
        return dict(input_ids=ids, attention_mask=mask, labels=labels)
    ids = torch.randint(1, TINY["vocab_size"], (2, 16), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


def step(model, batch, seed, autocast=None, **call):
    torch.manual_seed(seed)  # the LoRA dropout seeds drawn per layer call
    if autocast is not None:
        with torch.autocast("cpu", dtype=autocast):
            loss = model(**batch, use_cache=False, **call).loss
    else:
        loss = model(**batch, use_cache=False, **call).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_bitwise(ref, got):
    assert torch.equal(ref[0], got[0]), (ref[0], got[0])
    assert ref[1].keys() == got[1].keys() and len(ref[1]) > 0
    bad = [n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])]
    assert not bad, bad


class Rebuilds:
    """Counts the segments' rebuilds (monkeypatched onto Segment._rebuild)."""

    def __init__(self, monkeypatch):
        self.count = 0
        rebuild = segments.Segment._rebuild

        def counted(seg, upto):
            self.count += 1
            return rebuild(seg, upto)
        monkeypatch.setattr(segments.Segment, "_rebuild", counted)


def multi_layer_segments(layers, k):
    """The segments of more than one layer among ``layers`` layers grouped k at a time."""
    return sum(1 for start in range(0, layers, k) if min(k, layers - start) > 1)


def fused_calls(model):
    return [layer.forward.calls["fused"] for layer in _decoder_layers(model)[1]]


def compare(base, k, batch, seed, monkeypatch, policy="min_memory", offload=None,
            autocast=None, **call):
    """Steps of ``base`` patched with segment_layers=1 and k (deep copies); the results, after
    checking the k run rebuilt once per segment of several layers."""
    layers = len(_decoder_layers(base)[1])
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, policy, offload=offload)
    ckpt_ext.patch_llama(model, policy, offload=offload, segment_layers=k)
    counter = Rebuilds(monkeypatch)
    got = step(model, batch, seed, autocast, **call)
    assert counter.count == multi_layer_segments(layers, k)
    assert fused_calls(model) == [1] * layers
    return step(ref, batch, seed, autocast, **call), got, model


# ---- exact: k equal to k = 1, bit for bit ----------------------------------------------------

@pytest.mark.parametrize("layers,k", [(4, 2), (4, 4), (3, 2)], ids=["4x2", "4x4", "3x2"])
@pytest.mark.parametrize("setup", ["plain", "lora_dropout", "padded", "packed", "offload",
                                   "lora_offload_padded"])
def test_llama_equals_one_layer_segments(setup, layers, k, monkeypatch):
    seed = fresh_seed()
    lora = 0.05 if "lora" in setup else None
    base = model_of(layers=layers, seed=seed % 1000, lora_dropout=lora)
    kind = "padded" if "padded" in setup else "packed" if setup == "packed" else "plain"
    batch = batch_of(kind, seed)
    offload = "cpu" if "offload" in setup else None
    ref, got, model = compare(base, k, batch, seed, monkeypatch, offload=offload)
    assert_bitwise(ref, got)
    if setup == "plain":  # and HF's own layers, within rounding
        hf = step(copy.deepcopy(base), batch, seed)
        torch.testing.assert_close(got[0], hf[0], rtol=1e-5, atol=1e-6)
        for n in hf[1]:
            torch.testing.assert_close(got[1][n], hf[1][n], rtol=1e-4, atol=1e-6, msg=n)
    if offload:
        stats = _decoder_layers(model)[1][0].forward.shared.offloader.stats()
        assert stats["host_in_use"] == 0 and stats["live_layers"] == 0
        assert stats["host_allocations"] == math.ceil(layers / k)


def test_offload_limit(monkeypatch):
    """offload_limit of one layer input: the first segment's input goes to the host, the
    second's stays on the device (the limit counts only what a call saves: layers 2..k save
    no input)."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000, lora_dropout=0.05)
    batch = batch_of("padded", seed)
    x = batch["input_ids"].numel() * TINY["hidden_size"] * 4
    results, stats = [], []
    for k in (1, 2):
        model = copy.deepcopy(base)
        ckpt_ext.patch_llama(model, "min_memory", offload="cpu", offload_limit=x,
                             segment_layers=k)
        results.append(step(model, batch, seed))
        stats.append(_decoder_layers(model)[1][0].forward.shared.offloader.stats())
    assert_bitwise(*results)
    assert [s["host_bytes"] for s in stats] == [x, x]
    assert all(s["host_in_use"] == 0 for s in stats)


@pytest.mark.parametrize("setup", ["bf16", "bf16_lora_offload", "autocast_bf16"])
def test_bf16_equals_one_layer_segments(setup, monkeypatch):
    seed = fresh_seed()
    lora = 0.05 if "lora" in setup else None
    dtype = torch.bfloat16 if setup.startswith("bf16") else None
    base = model_of(seed=seed % 1000, lora_dropout=lora, dtype=dtype)
    ref, got, _ = compare(base, 2, batch_of("padded", seed), seed, monkeypatch,
                          offload="cpu" if "offload" in setup else None,
                          autocast=torch.bfloat16 if setup == "autocast_bf16" else None)
    assert_bitwise(ref, got)
    want = torch.float32 if setup == "autocast_bf16" else torch.bfloat16
    assert all(g.dtype == want for g in got[1].values())


@pytest.mark.parametrize("policy", ["fast", "balanced", ["balanced", "min_memory", "fast",
                                                         "min_memory"]],
                         ids=["fast", "balanced", "list"])
def test_presets_compose(policy, monkeypatch):
    """Layers 2..k of a segment keep their preset's residuals (offloaded) and drop their
    input only."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000, lora_dropout=0.05)
    ref, got, model = compare(base, 2, batch_of("padded", seed), seed, monkeypatch,
                              policy=policy, offload="cpu")
    assert_bitwise(ref, got)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_families(family, monkeypatch):
    seed = fresh_seed()
    base = model_of(family, layers=3, seed=seed % 1000, lora_dropout=0.05)
    ref, got, _ = compare(base, 2, batch_of("padded", seed), seed, monkeypatch, offload="cpu")
    assert_bitwise(ref, got)


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "olmo2", "gemma2"])
def test_family_fixtures(family, monkeypatch):
    """hf_fixtures' tiny models of families with other layer layouts (Gemma 3's sliding
    layers and norms around both sublayers, Phi-3's fused projections, OLMo-2's output norms,
    Gemma 2's soft-capped eager attention), 3 layers in segments of 2."""
    from hf_fixtures import make_model
    seed = fresh_seed()
    base = make_model(family, seed=seed % 1000).train()
    ref, got, _ = compare(base, 2, batch_of("plain", seed), seed, monkeypatch, offload="cpu")
    assert_bitwise(ref, got)


@pytest.mark.parametrize("router_logits", [False, True], ids=["no_aux", "aux_loss"])
def test_moe_family(router_logits, monkeypatch):
    """Qwen3-MoE with a dense layer between MoE layers; with output_router_logits the rebuild
    recomputes a layer's logits and drops them (the forward's were collected)."""
    seed = fresh_seed()
    base = tiny_model("qwen3_moe", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=128, pad_token_id=0, rms_norm_eps=1e-5,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], router_aux_loss_coef=0.1), seed=seed % 1000, perturb=True).train()
    call = dict(output_router_logits=True) if router_logits else {}
    ref, got, _ = compare(base, 2, batch_of("padded", seed), seed, monkeypatch, offload="cpu",
                          **call)
    assert_bitwise(ref, got)


def test_frozen_first_layer_saves_nothing(monkeypatch):
    """LoRA on layers 1..3 only, the base frozen: layer 0's call saves nothing (no input needs
    a gradient), so it cannot start a segment that layer 1 rebuilds from; layers 1, 2 form one
    and layer 3 its own."""
    peft = pytest.importorskip("peft")
    seed = fresh_seed()
    base = peft.get_peft_model(model_of(seed=seed % 1000), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.05, init_lora_weights=False,
        target_modules=LORA_TARGETS, layers_to_transform=[1, 2, 3])).train()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory")
    ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    counter = Rebuilds(monkeypatch)
    batch = batch_of("padded", seed)
    got = step(model, batch, seed)
    assert counter.count == 1
    assert_bitwise(step(ref, batch, seed), got)
    assert not any("layers.0." in n for n in got[1])


def test_hf_gradient_checkpointing_default_policy(monkeypatch):
    """HF checkpointing on, the default policy: min_memory layers in segments."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the HF checkpointing notice
        ref, got, _ = compare(base, 2, batch_of("plain", seed), seed, monkeypatch, policy=None)
    assert_bitwise(ref, got)


# ---- what the rebuild does ---------------------------------------------------------------------

def test_rebuilt_inputs_are_the_ones_used(monkeypatch):
    """A rebuild that hands out a changed input changes the gradients (the placeholders are
    what the backward reads), and one that hands out the right one does not."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000)
    batch = batch_of("plain", seed)
    ref = copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory")
    model = copy.deepcopy(base)
    ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    want = step(ref, batch, seed)
    input_of = segments.Segment.input_of
    def changed_input(seg, place):
        x, held = input_of(seg, place)
        return x * 1.5, held
    monkeypatch.setattr(segments.Segment, "input_of", changed_input)
    changed = step(model, batch, seed)
    assert torch.equal(changed[0], want[0])  # the forward is not touched
    assert not torch.equal(changed[1]["model.layers.1.self_attn.q_proj.weight"],
                           want[1]["model.layers.1.self_attn.q_proj.weight"])
    monkeypatch.setattr(segments.Segment, "input_of", input_of)
    assert_bitwise(want, step(model, batch, seed))


def test_each_rebuilt_input_is_freed_after_its_layers_backward(monkeypatch):
    """k = 4: the first unpack (layer 4's) rebuilds layers 2..4's inputs; when layer j's input
    is handed out, those of the layers above (whose backward is done) are gone; the first
    layer's input comes from the rebuild's unpack of it."""
    seed = fresh_seed()
    model = model_of(seed=seed % 1000)
    ckpt_ext.patch_llama(model, "min_memory", segment_layers=4)
    handed, alive_at = [], []
    input_of = segments.Segment.input_of

    def watched(seg, place):
        alive_at.append((place, [r() is not None for r in handed], len(seg.inputs)))
        x, held = input_of(seg, place)
        handed.append(weakref.ref(x))
        return x, held
    monkeypatch.setattr(segments.Segment, "input_of", watched)
    step(model, batch_of("plain", seed), seed)
    assert [a[0] for a in alive_at] == [3, 2, 1, 0]
    assert all(not any(alive) for _, alive, _ in alive_at)
    assert [a[2] for a in alive_at] == [0, 3, 2, 1]  # rebuilt at the first, held until used
    assert all(r() is None for r in handed)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_forward_frees_the_inputs_of_later_layers(offload):
    """After the forward (before backward) a layer's output is alive only where it is the
    input of a segment's first layer and no offloader took it, or the last layer's (the head
    keeps it): the placeholders and their hooks hold nothing of the inputs they stand for."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000)
    batch = batch_of("plain", seed)
    alive = {}
    for k in (1, 2, 4):
        model = copy.deepcopy(base)
        ckpt_ext.patch_llama(model, "min_memory", offload=offload, segment_layers=k)
        outputs = []
        for layer in model.model.layers:
            layer.register_forward_hook(lambda mod, a, out: outputs.append(weakref.ref(out)))
        loss = model(**batch, use_cache=False).loss
        alive[k] = [r() is not None for r in outputs]
        loss.backward()
    if offload:
        assert alive[1] == alive[2] == alive[4] == [False, False, False, True]
    else:
        assert alive == {1: [True] * 4, 2: [False, True, False, True],
                         4: [False, False, False, True]}


def test_retain_graph_rebuilds_again(monkeypatch):
    seed = fresh_seed()
    base = model_of(seed=seed % 1000, lora_dropout=0.05)
    batch = batch_of("padded", seed)
    grads = {}
    for k in (1, 2):
        model = copy.deepcopy(base)
        ckpt_ext.patch_llama(model, "min_memory", offload="cpu", segment_layers=k)
        counter = Rebuilds(monkeypatch)
        torch.manual_seed(seed)
        loss = model(**batch, use_cache=False).loss
        loss.backward(retain_graph=True)
        loss.backward()
        assert counter.count == (0 if k == 1 else 4)
        grads[k] = {n: p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}
    assert all(torch.equal(grads[1][n], grads[2][n]) for n in grads[1])


def test_a_layer_on_hfs_forward_ends_the_segment(monkeypatch):
    """A hook on a submodule of layer 1 makes it run HF's forward; layer 2's input is then not
    a fused call's output, so it starts a segment: layers [0], [2, 3] (one rebuild)."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000)
    batch = batch_of("padded", seed)
    results = []
    for k in (1, 2):
        model = copy.deepcopy(base)
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=k)
        model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
        counter = Rebuilds(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the delegation warning
            results.append(step(model, batch, seed))
        assert counter.count == (0 if k == 1 else 1)
        assert fused_calls(model) == [1, 0, 1, 1]
    assert_bitwise(*results)


def test_rng_and_autocast_state_replayed():
    """The rebuild runs each call with the CPU RNG state and autocast state of its forward,
    and leaves the caller's RNG state as it was; the gradient is that of the plain calls."""
    seen = []

    def fn(x, scale):  # sin saves its input: the placeholder of places 1, 2
        seen.append((torch.rand(()).item(), torch.is_autocast_enabled("cpu")))
        return x.sin() * scale

    def run(chain, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = segments.call(chain, None, fn, x, [], 2.0)
        y = segments.call(chain, None, fn, y, [], 3.0)
        return segments.call(chain, None, fn, y, [], 0.5)

    x0 = torch.randn(4)
    x = x0.clone().requires_grad_()
    run(None, x).sum().backward()
    want = x.grad
    seen.clear()
    chain = segments.Chain(3, record=True)
    x = x0.clone().requires_grad_()
    torch.manual_seed(5)
    y = run(chain, x)
    forward = list(seen)
    assert [len(s.calls) for s in chain.segments] == [3]
    assert [f[1] for f in forward] == [True, False, False]
    state = torch.get_rng_state()
    y.sum().backward()
    assert seen[3:] == forward[:2] and chain.segments[0].rebuilds == 1
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(x.grad, want)


def test_saved_bytes_keep_one_input_per_segment():
    """saved_activation_bytes sees through the segments' hooks: k = 2 and 4 save 2 and 3
    layer inputs less than k = 1 on 4 layers (min_memory saves the input alone)."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000)
    batch = batch_of("plain", seed)
    saved = {}
    for k in (1, 2, 4):
        model = copy.deepcopy(base)
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=k)
        saved[k] = ckpt_ext.saved_activation_bytes(
            lambda: model(**batch, use_cache=False).loss)
    x = batch["input_ids"].numel() * TINY["hidden_size"] * 4
    assert saved[1] - saved[2] == 2 * x and saved[1] - saved[4] == 3 * x


def test_under_torch_checkpoint(monkeypatch):
    """A model forward under torch.utils.checkpoint (its hooks around the layers' own): the
    same gradients as k = 1."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000, lora_dropout=0.05)
    batch = batch_of("padded", seed)
    grads = []
    for k in (1, 2):
        model = copy.deepcopy(base)
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=k)
        torch.manual_seed(seed)
        torch.utils.checkpoint.checkpoint(lambda: model(**batch, use_cache=False).loss,
                                          use_reentrant=False).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_matches_one_layer_segments(monkeypatch):
    """On CUDA (pinned host pool, side-stream copies, the CUDA RNG state recorded) k = 2
    within rounding of k = 1 (the GPU kernels need not be deterministic), one host buffer
    per segment."""
    seed = fresh_seed()
    base = model_of(seed=seed % 1000, lora_dropout=0.05).cuda()
    batch = {k: v.cuda() for k, v in batch_of("padded", seed).items()}
    ref, got, model = compare(base, 2, batch, seed, monkeypatch, offload="cpu")
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], rtol=1e-4, atol=1e-5, msg=n)
    off = _decoder_layers(model)[1][0].forward.shared.offloader
    assert off.stats()["host_allocations"] == 2 and off.stats()["host_in_use"] == 0
    assert all(b.is_pinned() for b in off.host_buffers())


def _sp_worker(rank, world, init_file, out_dir):
    import datetime
    import torch.distributed as dist
    from ckpt_ext.hf import sequence_parallel as sp
    from test_distributed import TIMEOUT_S
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        rebuilds = [0]
        rebuild = segments.Segment._rebuild

        def counted(seg, upto):
            rebuilds[0] += 1
            return rebuild(seg, upto)
        segments.Segment._rebuild = counted
        results = {}
        for key in ("padded", "packed"):
            base = model_of(seed=3, lora_dropout=0.05)
            batch = batch_of(key, 11)
            if key == "padded":  # an even length for the 2-way split
                batch = {n: t[:, :18] for n, t in batch.items()}
            batch = sp.shard_batch(batch, group)
            for k in (1, 2):
                model = copy.deepcopy(base)
                ckpt_ext.patch_llama(model, "min_memory", sequence_parallel=group,
                                     offload="cpu", segment_layers=k)
                before = rebuilds[0]
                # rank 0 draws the seeds (the group agrees on them)
                loss, grads = step(model, batch, 77 + 1000 * rank)
                results[key, k] = (loss, grads, rebuilds[0] - before)
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_two_ranks(tmp_path):
    """patch_llama(sequence_parallel=group) on 2 gloo processes: the rebuild runs the layers'
    exchanges on every rank in the same order; each rank's loss and gradient shares equal k =
    1's bit for bit (LoRA dropout, offload, padded and packed batches)."""
    pytest.importorskip("peft")
    from test_distributed import spawn_ranks
    ranks = spawn_ranks(_sp_worker, (2, str(tmp_path / "init"), str(tmp_path)), tmp_path,
                        "segments under sequence parallelism", world=2)
    for res in ranks:
        for key in ("padded", "packed"):
            (loss1, grads1, n1), (loss2, grads2, n2) = res[key, 1], res[key, 2]
            assert (n1, n2) == (0, 2)
            assert_bitwise((loss1, grads1), (loss2, grads2))


def _fsdp2_worker(rank, world, init_file, out_dir):
    import datetime
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from ckpt_ext.hf import patch as hf_patch
    from test_distributed import TIMEOUT_S
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        torch.set_num_threads(1)
        rebuilds, gathers = [0], []
        rebuild, gather = segments.Segment._rebuild, hf_patch._fsdp2_gather

        def counted(seg, upto):
            rebuilds[0] += 1
            return rebuild(seg, upto)

        def watched(layer):
            # the bytes of the parameter tensors the forward read (FSDP2's unsharded ones)
            # before the rebuild's gathering, during its replay and after
            read, factory = list(layer.parameters()), gather(layer)
            if factory is None:  # not an FSDP2 module
                return None

            def held():
                return sum(p.untyped_storage().nbytes() for p in read)

            @contextlib.contextmanager
            def context():
                entry = [layer.idx, held()]
                with factory():
                    entry.append(held())
                    yield
                gathers.append(entry + [held()])
            return context
        segments.Segment._rebuild, hf_patch._fsdp2_gather = counted, watched
        mesh = init_device_mesh("cpu", (world,))
        base = model_of(seed=5)
        full = sum(p.numel() * p.element_size() for p in base.model.layers[0].parameters())
        batch = batch_of("padded", 21 + rank)
        results = {}
        for k in (1, 2, 4):
            model = copy.deepcopy(base)
            ckpt_ext.patch_llama(model, "min_memory", segment_layers=k)
            for idx, layer in enumerate(model.model.layers):
                layer.idx = idx
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            before, gathers[:] = rebuilds[0], []
            torch.manual_seed(9)
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()
                     if p.grad is not None}
            # after the backward, FSDP2 has released every layer's unsharded parameters
            left = sum(p.untyped_storage().nbytes() for layer in model.model.layers
                       for p in layer._get_fsdp_state()._fsdp_param_groups[0].fsdp_params
                       for p in [p.unsharded_param])
            results[k] = (loss.detach(), grads, rebuilds[0] - before, list(gathers),
                          fused_calls(model), left)
        results["full"] = full
        # fully_shard on the model only: the layers' parameters are the root's, which the
        # rebuild does not gather; refused when patching and at a forward after patching
        refusals = []
        model = copy.deepcopy(base)
        fully_shard(model, mesh=mesh)
        try:
            ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
        except NotImplementedError as e:
            refusals.append(str(e))
        results["refusals"] = refusals
        # fully_shard on a module around the layers (not the root) after patching: its
        # backward gathers all their parameters before the layers' backwards and keeps them to
        # its end, so the rebuild finds them gathered (the fused head is left out: it reads the
        # final norm, which this wrapping releases before the head)
        for k in (1, 2):
            model = copy.deepcopy(base)
            ckpt_ext.patch_llama(model, "min_memory", segment_layers=k, fuse_lm_head=False)
            fully_shard(model.model, mesh=mesh)
            fully_shard(model, mesh=mesh)
            before = rebuilds[0]
            torch.manual_seed(9)
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            results["outer", k] = (loss.detach(), {
                n: p.grad.full_tensor() for n, p in model.named_parameters()
                if p.grad is not None}, rebuilds[0] - before)
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_ranks(tmp_path):
    """FSDP2 (fully_shard on each of 4 decoder layers and the model) on 2 gloo processes:
    segments of 2 and 4 rebuild once per segment; each replayed layer's parameters (FSDP2's
    unsharded tensors, which the forward read) are gathered for its replay, and released after
    it unless FSDP2 had already started gathering them for the layer's own backward (its
    backward prefetch of the next layer); after the backward none is left gathered. Each rank's
    loss and reduced gradients equal k = 1's bit for bit: the same op on the same values, and
    the same reductions in the same order."""
    from test_distributed import spawn_ranks
    ranks = spawn_ranks(_fsdp2_worker, (2, str(tmp_path / "init"), str(tmp_path)), tmp_path,
                        "segments under FSDP2", world=2)
    for res in ranks:
        full = res["full"]
        for k, rebuilt, gathered in [
                (1, 0, []),
                # layer 2 replayed in layer 3's backward, layer 0 in layer 1's; each was being
                # gathered (prefetched) for its own backward, which comes next: kept for it
                (2, 2, [[2, 0, full, full], [0, 0, full, full]]),
                # layers 0, 1, 2 replayed in layer 3's backward: 0 and 1 released after their
                # replay, 2 (prefetched) kept
                (4, 1, [[0, 0, full, 0], [1, 0, full, 0], [2, 0, full, full]])]:
            loss, grads, n, g, calls, left = res[k]
            assert (n, g, calls, left) == (rebuilt, gathered, [1] * 4, 0), (k, n, g, left)
            assert_bitwise(res[1][:2], (loss, grads))
        # fully_shard on an outer module only: refused when patching after it; sharded so
        # after patching, the outer module keeps the parameters gathered through the backward
        assert len(res["refusals"]) == 1 and "fully_shard each decoder layer" in \
            res["refusals"][0] and "segment_layers=1" in res["refusals"][0], res["refusals"]
        assert (res["outer", 1][2], res["outer", 2][2]) == (0, 2)
        assert_bitwise(res["outer", 1][:2], res["outer", 2][:2])


# ---- item 4: host bytes and step peak (bench/segments.py) --------------------------------------

def _bench():
    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_segments", root / "bench" / "segments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offloaded_host_bytes_divide_by_k():
    """A 4-layer model with offload: the host pool of k = 2 and 4 holds 1/2 and 1/4 of k = 1's
    bytes, exactly one layer input per segment; the step's allocator peak is measured."""
    bench = _bench()
    args = bench.parse(["--device", "cpu", "--seq", "96", "--hidden", "64", "--intermediate",
                        "160", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
                        "--segments", "1", "2", "4"])
    out = bench.measure(args)
    x = out[1]["layer_input_bytes"]
    assert x == 96 * 64 * 4
    assert [out[k]["host_bytes"] for k in (1, 2, 4)] == [4 * x, 2 * x, x]
    assert [out[k]["host_allocations"] for k in (1, 2, 4)] == [4, 2, 1]
    assert out[2]["host_bytes"] * 2 == out[1]["host_bytes"] == out[4]["host_bytes"] * 4
    assert all(out[k]["peak"] > 0 for k in (1, 2, 4))


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_segment_layers_raise(bad):
    model = model_of(layers=2)
    with pytest.raises(ValueError, match="segment_layers"):
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=bad)
    assert not fused_calls_patched(model)


def fused_calls_patched(model):
    return [layer for layer in _decoder_layers(model)[1] if "forward" in layer.__dict__]


@pytest.mark.parametrize("policy,words", [
    ("auto", "policy='auto'"), ("torch", "needs every decoder layer fused"),
    (["min_memory", "none"], "layers \\[1\\]")])
def test_policies_not_built_are_refused(policy, words):
    model = model_of(layers=2)
    kwargs = dict(activation_budget="1GiB") if policy == "auto" else {}
    with pytest.raises(NotImplementedError, match=words):
        ckpt_ext.patch_llama(model, policy, segment_layers=2, **kwargs)
    assert not fused_calls_patched(model)
    ckpt_ext.patch_llama(model, policy, segment_layers=1, **kwargs)  # k = 1: as before


class _FakeDTensor(torch.nn.Parameter):
    """A parameter whose type reads as a DTensor's (tensor parallelism, or FSDP2 on a module
    around the layer): sharding that a segment's rebuild does not gather."""


_FakeDTensor.__name__ = "DTensor"


def test_foreign_sharding_refused_at_patch_and_at_forward():
    """DTensor parameters of a layer that is not itself an FSDP2 module: refused at patch and,
    set up after patching, at the forward. (ZeRO-3 parameters are gathered by the rebuild:
    tests/test_deepspeed_segments.py.)"""
    model = model_of(layers=2)
    p = model.model.layers[1].mlp.down_proj.weight
    p.__class__ = _FakeDTensor
    with pytest.raises(NotImplementedError, match="DTensors.*segment_layers=1"):
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    p.__class__ = torch.nn.Parameter
    ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    p.__class__ = _FakeDTensor
    with pytest.raises(NotImplementedError, match="DTensors.*segment_layers=1"):
        step(model, batch_of("plain", 1), 1)
    p.__class__ = torch.nn.Parameter
    with torch.no_grad():  # inference: no segments, nothing refused
        model(**batch_of("plain", 1), use_cache=False)


def test_released_weight_raises_in_the_rebuild():
    """A weight released between the forward and the rebuild (as sharding wrappers that the
    rebuild does not gather would) raises a RuntimeError naming the way out, instead of
    replaying the layer with it."""
    model = model_of(layers=2)
    ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    torch.manual_seed(1)
    loss = model(**batch_of("plain", 1), use_cache=False).loss
    model.model.layers[0].mlp.up_proj.weight.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="released after its forward.*segment_layers=1"):
        loss.backward()


def test_compile_refused():
    model = model_of(layers=2)
    ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(NotImplementedError, match="torch.compile"):
        step(compiled, batch_of("plain", 1), 1)


def test_qwen3_vl_refused_by_name():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3VLForConditionalGeneration"):
        pytest.skip("no Qwen3-VL in this transformers")
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=300,
                rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                        mrope_section=[2, 3, 3],
                                                        mrope_interleaved=True))
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
        num_position_embeddings=16, deepstack_visual_indexes=[0]))
    model = transformers.Qwen3VLForConditionalGeneration(cfg)
    with pytest.raises(NotImplementedError, match="deepstack"):
        ckpt_ext.patch_llama(model, "min_memory", segment_layers=2)
    ckpt_ext.patch_llama(model, "min_memory")


# ---- policy="auto" with offload: segments where offload_limit binds --------------------------

def _auto_segments_case(seed, budget_inputs):
    """A 4-layer model patched with auto and offload, offload_limit one layer input (8 KiB at
    B=2, S=16, fp32) and activation_budget ``budget_inputs`` inputs: every layer min_memory
    needs 4 on the device (the pool's one and the three past the limit)."""
    base = model_of(seed=seed % 1000, lora_dropout=0.05)
    batch = batch_of("plain", seed)
    x = batch["input_ids"].numel() * TINY["hidden_size"] * 4
    model = copy.deepcopy(base)
    ckpt_ext.patch_llama(model, "auto", activation_budget=budget_inputs * x, offload="cpu",
                         offload_limit=x)
    return base, batch, x, model


def test_auto_chooses_segments_when_the_host_runs_short(monkeypatch):
    """No mix of presets fits 3 inputs; min_memory in segments of k (the plan's choice by
    time, k = 2 or 3 hold 3) does: the step equals min_memory with segment_layers=k, bit for
    bit, and rebuilds once per segment of several layers."""
    from ckpt_ext import plan
    seed = fresh_seed()
    base, batch, x, model = _auto_segments_case(seed, 3)
    counter = Rebuilds(monkeypatch)
    got = step(model, batch, seed)
    shared = _decoder_layers(model)[1][0].forward.shared
    assert list(shared.auto.values()) == [["min_memory"] * 4]
    (k, why), = shared.auto_segments.values()
    dims = shared.layer_dims()
    want = plan.choose_segment_layers(dims, TINY["vocab_size"], 2, 16, torch.float32, 3 * x, x,
                                      host_link_gbytes_per_s=shared.host_link,
                                      layers_only=True,
                                      **ckpt_ext.throughputs.default_throughputs()
                                      .step_time_kwargs(16))
    assert k == want.segment_layers and k in (2, 3) and want.peak <= 3 * x
    assert "activation_budget" in why
    assert counter.count == multi_layer_segments(4, k)
    assert fused_calls(model) == [1] * 4
    ref = copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory", offload="cpu", offload_limit=x, segment_layers=k)
    with torch.no_grad():  # inference: no segments
        model(**batch, use_cache=False)
    assert counter.count == multi_layer_segments(4, k)
    assert shared.offloader.stats()["host_bytes"] == x
    assert_bitwise(step(ref, batch, seed), got)


def test_auto_keeps_one_layer_segments_where_they_fit(monkeypatch):
    """4 inputs hold every layer min_memory: no segments, no rebuild, as before."""
    seed = fresh_seed()
    base, batch, x, model = _auto_segments_case(seed, 4)
    counter = Rebuilds(monkeypatch)
    got = step(model, batch, seed)
    shared = _decoder_layers(model)[1][0].forward.shared
    assert list(shared.auto.values()) == [["min_memory"] * 4] and not shared.auto_segments
    assert counter.count == 0
    ref = copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory", offload="cpu", offload_limit=x)
    assert_bitwise(step(ref, batch, seed), got)


def test_auto_segments_error_when_nothing_fits():
    """2 inputs: neither a mix nor any k fits; the error names both. No offload_limit:
    segments hold no less on the device, the mix's error alone."""
    seed = fresh_seed()
    _, batch, x, model = _auto_segments_case(seed, 2)
    with pytest.raises(ValueError, match=r"activation_budget 16\.00 KiB is below the offload "
                                         r"prefetch pool .*; nor does min_memory in segments "
                                         r".*no k in 1\.\.4 fits"):
        step(model, batch, seed)
    ckpt_ext.patch_llama(model, "auto", activation_budget=x, offload="cpu")
    with pytest.raises(ValueError, match=r"the smallest budget that fits is 16384$"):
        step(model, batch, seed)


def test_auto_segments_refused_where_segments_are_not_built():
    """Parameters sharded in a way the rebuild does not gather (DTensors of a layer that is
    not an FSDP2 module, set up after patching) and torch.compile: auto does not run k > 1
    there; the mix's error, with the reason."""
    seed = fresh_seed()
    _, batch, x, model = _auto_segments_case(seed, 3)
    p = _decoder_layers(model)[1][1].input_layernorm.weight
    p.__class__ = _FakeDTensor
    with pytest.raises(ValueError, match=r"is below the offload prefetch pool .*segments of \d "
                                         r"layers would fit, but .*DTensors"):
        step(model, batch, seed)
    p.__class__ = torch.nn.Parameter
    _, batch, x, model = _auto_segments_case(seed, 3)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match=r"is below the offload prefetch pool .*would fit, "
                                         r"but .*torch.compile"):
        step(compiled, batch, seed)
