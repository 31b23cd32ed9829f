"""Ulysses sequence parallelism inside the fused layer op (the option ``sequence_parallel``):
2 and 4 processes on gloo (CPU), each holding S/N positions of every sequence, give the
single-process op's output on the whole sequence and its gradients (x's, concatenated; the
weights' and adapters', summed over the group): fp64 within 1e-10, fp32 within the accuracy
rule's bound. Every preset, the whole layer and the attention sublayer, GQA with fewer and with
as many KV heads as ranks (repeated / split), per-head q/k norms, LoRA dropout (global rows),
left padding with and without HF eager's uniform empty rows, packed sequences, a sliding
window, several local chunks, head rounds, torch.compile(fullgraph=True). Bad input refuses
on every rank.

One spawned group runs every case of a world size (the cases travel in one file)."""
import datetime
import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist

if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from reference import (
    FACTOR_GRAD,
    FACTOR_OUT,
    check_vs_baseline,
    layer_weights_with_adapters,
    packed_segment_ids,
    rope_args,
    rope_tables,
)
from test_distributed import TIMEOUT_S, spawn_ranks

from ckpt_ext import blocks, config

linux_only = pytest.mark.skipif(sys.platform != "linux",
                                reason="spawned gloo workers are tested on Linux")

H, IM, R, B = 32, 48, 3, 2
DROPOUT = [0.1, 0.2, 0.3, 0.15, 0.25, 0.35, 0.4]


def make_case(seed, dtype=torch.float64, hq=4, hkv=2, s=24, preset="balanced", part="layer",
              qk_norm=False, padded=False, eager=False, packed=False, window=None,
              chunk_rows=None, hidden=H):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    weights = layer_weights_with_adapters(hidden, hq, hkv, IM, R, dtype, g)
    d = hidden // hq
    if qk_norm:
        weights["self_attn.q_norm.weight"] = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
        weights["self_attn.k_norm.weight"] = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    kw = dict(num_heads=hq, num_kv_heads=hkv, lora_scaling=[0.5 + 0.1 * i for i in range(7)],
              lora_dropout=DROPOUT, dropout_seed=torch.tensor(4242 + seed), window=window,
              preset=preset, part=part)
    if padded:  # left padding: row 0 by 5 (inside rank 0's share), row 1 by 15 (past it)
        mask = torch.ones(B, s, dtype=torch.bool)
        mask[0, :5] = False
        mask[1, :15] = False
        kw.update(key_padding_mask=mask, uniform_empty_rows=eager)
    if packed:
        kw["segment_ids"] = packed_segment_ids(B, s, [7, 10, 3])
    cos, sin = rope_tables(s, d, dtype=dtype)
    chunk = None
    if chunk_rows is not None:  # the layer's per-token working set (tests/test_chunked_layer.py)
        width = 4 * hq * d + (3 * IM if part == "layer" else 0)
        chunk = str(chunk_rows * width * max(4, dtype.itemsize))
    return dict(x=torch.randn(B, s, hidden, generator=g, dtype=dtype),
                dy=torch.randn(B, s, hidden, generator=g, dtype=dtype),
                weights=weights, cos=cos, sin=sin, kw=kw, chunk=chunk)


def run(c, rank=0, world=1, group="", fn=blocks.decoder_layer):
    """(y, dx, {name: gradient}) of rank's share of the sequence (all of it for world 1)."""
    s = c["x"].shape[1] // world
    share = lambda t: t[:, rank * s:(rank + 1) * s] if t is not None else None
    x = share(c["x"]).clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in c["weights"].items()}
    kw = dict(c["kw"])
    for name in ("key_padding_mask", "segment_ids"):
        if name in kw:
            kw[name] = share(kw[name])
    bad = c.get("bad_rank1") if rank == 1 else None  # only this rank's input is bad
    if bad == "mask":  # one position short
        kw["key_padding_mask"] = kw["key_padding_mask"][:, :-1]
    if bad == "segment_dtype":  # int32 where rank 0 passes int64: the gathers would not pair
        kw["segment_ids"] = kw["segment_ids"].int()
    if bad == "lora_scaling":  # one entry short
        kw["lora_scaling"] = kw["lora_scaling"][:-1]
    if bad == "op_chunk_rows":  # other chunks: their exchanges would not pair
        kw["chunk_rows"] = kw["chunk_rows"] + 1
    # rank 1 without the byte cap ("chunk"): more rounds
    cap = c["chunk"] if c["chunk"] is not None and bad != "chunk" else config.current().chunk_bytes
    with config.patch(chunk_bytes=cap):
        y = fn(x, blocks.LayerOptions(
            weights=w, **rope_args((share(c["cos"]), share(c["sin"]))), sequence_parallel=group,
            **kw))
        y.backward(share(c["dy"]))
    return y.detach(), x.grad, {n: t.grad for n, t in w.items() if t.grad is not None}


def outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return ("raised", type(e).__name__, str(e))


def _worker(rank, world, init_file, cases_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        torch.set_num_threads(1)
        cases = torch.load(cases_file, weights_only=False)
        group = dist.group.WORLD.group_name
        results = {}
        for key, c in cases.items():
            if c.get("bad_shape") and rank == 1:  # this rank passes one position less
                c = dict(c, x=c["x"][:, :-world], dy=c["dy"][:, :-world], cos=c["cos"][:, :-world],
                         sin=c["sin"][:, :-world])
            # torch.compile(fullgraph=True): no graph break around the op and its exchanges
            # (aot_eager: AOTAutograd traces the op's fakes; inductor's compile adds only time)
            fn = torch.compile(blocks.decoder_layer, fullgraph=True, backend="aot_eager") \
                if c.get("compile") else blocks.decoder_layer
            results[key] = outcome(lambda c=c, fn=fn: run(c, rank, world, c.get("group", group),
                                                          fn))
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(tmp_path, world, cases):
    out = tmp_path / f"world{world}"
    out.mkdir()
    torch.save(cases, out / "cases.pt")
    return spawn_ranks(_worker, (world, str(out / "init"), str(out / "cases.pt"), str(out)), out,
                       f"sequence-parallel world {world}", world=world)


def assert_matches(key, c, ranks, rtol, atol):
    ref_y, ref_dx, ref_g = run(c)
    for r, res in enumerate(ranks):
        assert res[key][0] == "ok", f"{key}: rank {r} raised {res[key][1:]}"
    ys, dxs, gs = zip(*(res[key][1] for res in ranks))
    scale = lambda t: max(1.0, t.abs().max().item())
    torch.testing.assert_close(torch.cat(ys, 1), ref_y, rtol=rtol, atol=atol * scale(ref_y),
                               msg=lambda m: f"{key} y: {m}")
    torch.testing.assert_close(torch.cat(dxs, 1), ref_dx, rtol=rtol, atol=atol * scale(ref_dx),
                               msg=lambda m: f"{key} dx: {m}")
    assert gs[0].keys() == ref_g.keys(), key
    for n, want in ref_g.items():
        got = sum(g[n] for g in gs)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol * scale(want),
                                   msg=lambda m, n=n: f"{key} {n}: {m}")


def as_f64(c):
    """The case with its floating tensors in float64 (the same values)."""
    up = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return dict(c, x=up(c["x"]), dy=up(c["dy"]), cos=up(c["cos"]), sin=up(c["sin"]),
                weights={n: up(t) for n, t in c["weights"].items()})


def assert_accuracy_rule(key, c, ranks):
    """float32: the sequence-parallel result's error against the float64 op on the same values
    within the accuracy rule's factor of the single-process float32 op's."""
    base_y, base_dx, base_g = run(c)
    ref_y, ref_dx, ref_g = run(as_f64(c))
    assert all(res[key][0] == "ok" for res in ranks), [res[key][1:] for res in ranks]
    ys, dxs, gs = zip(*(res[key][1] for res in ranks))
    check_vs_baseline(f"{key} y", torch.cat(ys, 1), base_y, ref_y, FACTOR_OUT)
    check_vs_baseline(f"{key} dx", torch.cat(dxs, 1), base_dx, ref_dx, FACTOR_GRAD)
    for n, want in ref_g.items():
        check_vs_baseline(f"{key} {n}", sum(g[n] for g in gs), base_g[n], want, FACTOR_GRAD)


def make_moe_case(seed, experts=5, k=2, shared=True, **kw):
    """make_case's layer with a mixture-of-experts MLP (router, routed experts in transformers
    5's layout; with ``shared`` the dense MLP slots, LoRA included, are the shared expert): the
    experts see the rank's own tokens only, so the routing and the expert gradients summed over
    the ranks must equal the single process's."""
    c = make_case(seed, **kw)
    g = torch.Generator().manual_seed(1000 + seed)
    dtype = c["x"].dtype
    hidden = c["x"].shape[-1]
    w = lambda *shape: (0.3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    weights = dict(c["weights"])
    if not shared:
        for name in list(weights):
            if name.startswith("mlp."):
                del weights[name]
    weights.update({"mlp.gate.weight": w(experts, hidden) / 0.3,
                    "mlp.experts.gate_up_proj": w(experts, 2 * IM // 2, hidden),
                    "mlp.experts.down_proj": w(experts, hidden, IM // 2)})
    kwargs = dict(c["kw"], num_experts_per_tok=k, norm_topk_prob=not shared, router="softmax")
    if not shared:  # no LoRA on the absent dense MLP
        kwargs["lora_scaling"] = kwargs["lora_scaling"][:4] + [0.0] * 3
        kwargs["lora_dropout"] = kwargs["lora_dropout"][:4] + [0.0] * 3
    return dict(c, weights=weights, kw=kwargs)


def op_chunk_rows(c, rows, **extra):
    """Case ``c`` with the op's chunk_rows option (the chunk rule's rows), not the cap."""
    return dict(c, kw=dict(c["kw"], chunk_rows=rows), **extra)


CASES_2 = {
    # GQA, KV heads split (Hkv 2 = N), LoRA dropout, left padding, two sequences
    **{f"{p}-gqa-padded": make_case(1, preset=p, padded=True)
       for p in ("fast", "balanced", "min_memory")},
    # KV heads repeated (Hkv 1 < N), per-head q/k norms, packed sequences
    **{f"{p}-mqa-qknorm-packed": make_case(2, preset=p, hkv=1, qk_norm=True, packed=True)
       for p in ("fast", "min_memory")},
    "balanced-eager-empty-rows": make_case(3, padded=True, eager=True),
    # several chunks of each rank's 12 tokens (5, 5, 2), a sliding window, the sublayer alone
    "balanced-chunks-window": make_case(4, chunk_rows=5, window=7),
    "min_memory-attention-chunks": make_case(5, preset="min_memory", part="attention",
                                             chunk_rows=5, hkv=4),
    # head rounds: 2 KV heads per rank, exchanged one at a time under the small byte cap
    "balanced-rounds-padded": make_case(15, hq=8, hkv=4, chunk_rows=5, padded=True),
    "min_memory-rounds-mha-qknorm-eager": make_case(16, preset="min_memory", hq=4, hkv=4,
                                                    chunk_rows=5, qk_norm=True, padded=True,
                                                    eager=True),
    "fast-rounds-packed-window": make_case(17, preset="fast", hq=8, hkv=4, chunk_rows=5,
                                           packed=True, window=9),
    "compiled-balanced-chunks-padded": dict(make_case(14, chunk_rows=5, padded=True),
                                            compile=True),
    # mixture-of-experts MLPs on each rank's tokens: a shared expert with LoRA and dropout,
    # padding; then routed experts only, packed sequences, several chunks
    "min_memory-moe-shared-padded": make_moe_case(22, preset="min_memory", padded=True),
    "fast-moe-packed-chunks": make_moe_case(23, preset="fast", shared=False, k=3, packed=True,
                                            chunk_rows=5),
    "balanced-moe-window": make_moe_case(24, window=9),
    # query-chunked rounds: each round's queries go out in chunks of 4 of each rank's 12
    # tokens (3 chunks, each attending as 2 pieces at different offsets), HF eager's empty rows
    "min_memory-qchunks-padded-eager": make_case(22, preset="min_memory", chunk_rows=4,
                                                 padded=True, eager=True),
    # the op's chunk_rows option: chunks of 5 of each rank's 12 tokens under the default cap
    "balanced-op-chunk-rows-padded": op_chunk_rows(make_case(25, padded=True), 5),
}
FP32_2 = {"fp32-balanced": make_case(6, dtype=torch.float32, padded=True),
          "fp32-fast-mqa": make_case(7, dtype=torch.float32, preset="fast", hkv=1)}
BAD_2 = {"bad-heads": make_case(8, hq=3, hkv=3, hidden=48),
         "bad-kv-heads": make_case(9, hq=6, hkv=3, hidden=48),
         "bad-shape": dict(make_case(10), bad_shape=True),
         "bad-group": dict(make_case(11), group="no-such-group"),
         # only rank 1's input is bad: both ranks raise, at once (no rank left in an exchange)
         "bad-mask-rank1": dict(make_case(18, padded=True), bad_rank1="mask"),
         "bad-segment-dtype-rank1": dict(make_case(19, packed=True), bad_rank1="segment_dtype"),
         "bad-lora-scaling-rank1": dict(make_case(20), bad_rank1="lora_scaling"),
         "bad-rounds-rank1": dict(make_case(21, hq=8, hkv=4, chunk_rows=5), bad_rank1="chunk"),
         "bad-op-chunk-rows-rank1": op_chunk_rows(make_case(26), 5, bad_rank1="op_chunk_rows")}
CASES_4 = {
    "min_memory-hkv2-repeated": make_case(12, preset="min_memory", s=28, padded=True),
    "fast-hkv4-split": make_case(13, preset="fast", hkv=4, s=28, qk_norm=True, packed=True),
    # query-chunked rounds: chunks of 3 of each rank's 7 tokens (3, 3, 1), 4 pieces each
    "balanced-qchunks-packed-window": make_case(23, s=28, chunk_rows=3, packed=True, window=6),
    "min_memory-qchunks-eager-rounds": make_case(24, preset="min_memory", hq=8, hkv=8, s=28,
                                                 chunk_rows=3, padded=True, eager=True),
}


@linux_only
def test_two_ranks_equal_one_process(tmp_path):
    """fp64: 1e-10 (scaled by the reference's magnitude where above 1); fp32: the accuracy
    rule against the float64 op, with the single-process float32 op as the baseline; bad input
    refused on both ranks with the error naming the argument."""
    ranks = run_world(tmp_path, 2, {**CASES_2, **FP32_2, **BAD_2})
    for key, c in CASES_2.items():
        assert_matches(key, c, ranks, 1e-10, 1e-10)
    for key, c in FP32_2.items():
        assert_accuracy_rule(key, c, ranks)
    expect = {"bad-heads": "num_heads=3 must be divisible",
              "bad-kv-heads": "num_kv_heads=3 must be a multiple or a divisor",
              "bad-shape": "every rank passes x of the same shape",
              "bad-group": "sequence_parallel='no-such-group' is not a registered",
              "bad-mask-rank1": "key_padding_mask must have shape (2, 12)",
              "bad-segment-dtype-rank1": "every rank passes the same kinds of masks",
              "bad-lora-scaling-rank1": "lora_scaling",
              "bad-rounds-rank1": "head rounds (the head rounds follow CKPT_EXT_CHUNK_BYTES",
              "bad-op-chunk-rows-rank1": "the same token chunk rows (chunk_rows, or the rows "
                                         "CKPT_EXT_CHUNK_BYTES gives)"}
    refused_on_1 = ("bad-mask-rank1", "bad-lora-scaling-rank1")
    for key, needle in expect.items():
        for r, res in enumerate(ranks):
            assert res[key][0] == "raised", f"{key}: rank {r} ran without error"
            assert needle in res[key][2], f"{key}: rank {r}: {res[key][2]}"
            if key in refused_on_1:  # rank 0 names the rank whose input was bad
                assert "refused on rank 1 of the group's 2 ranks" in res[key][2], res[key][2]


@linux_only
def test_four_ranks_equal_one_process(tmp_path):
    ranks = run_world(tmp_path, 4, CASES_4)
    for key, c in CASES_4.items():
        assert_matches(key, c, ranks, 1e-10, 1e-10)


# ---- a patched HF model: patch_llama(sequence_parallel=group) and shard_batch ----------------

HF_S = 14  # 7 tokens per rank


def hf_model(lora_dropout=None, moe=False):
    pytest.importorskip("transformers")
    if moe:  # a tiny Qwen3-MoE: top 3 of 8 experts renormalised, a dense middle layer
        from test_hf_moe import make
        return make("qwen3_moe").double()
    from test_distributed import make_model
    model = make_model().double()
    if lora_dropout is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=lora_dropout,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # B off zero, as after some training
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def hf_batch(kind):
    from hf_fixtures import padded_batch
    ids, mask, labels = padded_batch(97, 2, HF_S, pad_row=1, pad=9, seed=21)
    if kind == "padded":  # row 1 left-padded past rank 0's share
        return dict(input_ids=ids, attention_mask=mask, labels=labels)
    # packed: documents of 5, 6 and 3 tokens in row 0, 9 and 5 in row 1, no mask
    pos = torch.tensor([list(range(5)) + list(range(6)) + list(range(3)),
                        list(range(9)) + list(range(5))])
    return dict(input_ids=ids.clamp(min=1), position_ids=pos, labels=ids.clamp(min=1))


HF_CASES = {  # name: (policy, peft lora_dropout or None, batch)
    "balanced-padded": ("balanced", None, "padded"),
    "balanced-offload-packed": ("balanced", None, "packed"),
    "min_memory-lora-dropout-packed": ("min_memory", 0.3, "packed"),
    "fast-lora-dropout-padded": ("fast", 0.2, "padded"),
    # DDP over the group: it averages the gradients, so the loss is multiplied by N
    "ddp-balanced-padded": ("balanced", None, "padded"),
    # mixture-of-experts layers: each rank routes its own tokens
    "moe-min_memory-padded": ("min_memory", None, "padded"),
    "moe-fast-packed": ("fast", None, "packed"),
    # the load-balancing loss from the layers' statistics summed over the group
    "moe-aux-fused-padded": ("balanced", None, "padded"),
}


def hf_kwargs(key):
    """(patch_llama's extra arguments, the forward's) of an HF case."""
    if "aux-fused" in key:
        return dict(router_aux_loss="fused"), dict(output_router_logits=True)
    return {}, {}


# torch.compile of the whole patched model: the padding mask gathered and LoRA dropout's seed
# agreed (ckpt_ext::sp_agree_gather, ckpt_ext::sp_agree); packed documents' position_ids
COMPILED_CASES = {"compiled-lora-dropout-padded": ("padded", 0.2),
                  "compiled-packed": ("packed", None)}

ONE_RANK_BAD = {"no-position-ids-rank1": "no-position-ids", "mask-shape-rank1": "mask-shape",
                "cache-rank1": "cache"}


def hf_step(model, batch, seed=77):
    """Loss and gradients of one training step (the LoRA dropout seeds drawn after
    torch.manual_seed(seed))."""
    torch.manual_seed(seed)
    loss = model(**{"use_cache": False, **batch}).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def context_parallel_step(group):
    """A training step of a model patched with sequence_parallel= inside torch's
    context_parallel (which splits the sequence a second time): refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import ckpt_ext
    model = hf_model()
    ckpt_ext.patch_llama(model, sequence_parallel=group)
    batch = hf_batch("packed")
    ids, pos = batch["input_ids"].clone(), batch["position_ids"].clone()
    with context_parallel(init_device_mesh("cpu", (dist.get_world_size(),)),
                          buffers=[ids, pos], buffer_seq_dims=[1, 1]):
        return hf_step(model, dict(input_ids=ids, position_ids=pos, labels=ids))


def accelerate_cp_step(group, rank, world):
    """A training step of a model patched with sequence_parallel= inside accelerate's
    maybe_context_parallel with ParallelismConfig(cp_size=2) (torch's context_parallel
    underneath): refused on every rank. Accelerate's own refusal to set it up comes back as
    ("setup", message)."""
    try:
        import accelerate
        from accelerate.parallelism_config import ParallelismConfig
    except ImportError as e:
        return ("setup", f"accelerate with ParallelismConfig is not installed ({e})")

    import ckpt_ext
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")  # the group exists already
    try:
        acc = accelerate.Accelerator(cpu=True,
                                     parallelism_config=ParallelismConfig(cp_size=world))
    except Exception as e:  # noqa: BLE001 - reported by the test as its skip reason
        return ("setup", f"{type(e).__name__}: {e}")
    model = hf_model()
    ckpt_ext.patch_llama(model, sequence_parallel=group)
    batch = hf_batch("packed")
    ids, pos = batch["input_ids"].clone(), batch["position_ids"].clone()
    with acc.maybe_context_parallel(buffers=[ids, pos], buffer_seq_dims=[1, 1]):
        return hf_step(model, {"input_ids": ids, "position_ids": pos, "labels": ids})


def _hf_worker(rank, world, init_file, out_dir):
    import ckpt_ext
    from ckpt_ext.hf import sequence_parallel as sp
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        results = {}
        for key, (policy, dropout, kind) in HF_CASES.items():
            def case(policy=policy, dropout=dropout, kind=kind, key=key):
                model = hf_model(dropout, moe="moe" in key)
                patch_kw, call_kw = hf_kwargs(key)
                ckpt_ext.patch_llama(model, policy, sequence_parallel=group,
                                     offload="cpu" if "offload" in key else None, **patch_kw)
                batch = {**sp.shard_batch(hf_batch(kind), group), **call_kw}
                if "ddp" in key:
                    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
                    loss = ddp(**batch, use_cache=False).loss
                    (loss * world).backward()
                    loss, grads = loss.detach(), {}
                    del ddp  # its reducer freed while the group lives (tests/test_distributed.py)
                    gc.collect()
                else:
                    # rank 0 draws the single process's seeds; the other ranks' draws are unused
                    loss, grads = hf_step(model, batch, seed=77 + 1000 * rank)
                    sp.all_reduce_grads(model, group)
                layers = (model.base_model.model if dropout is not None else model).model.layers
                off = layers[0].forward.shared.offloader
                return loss, {n: p.grad for n, p in model.named_parameters()
                              if p.grad is not None}, grads, off and off.stats()
            results[key] = outcome(case)
        # the whole model compiled (aot_eager): the eager step's loss and gradients on this
        # rank, dynamo's graph breaks counted
        for key, (kind, dropout) in COMPILED_CASES.items():
            def compiled(kind=kind, dropout=dropout):
                from torch._dynamo.utils import counters
                model = hf_model(dropout)
                ckpt_ext.patch_llama(model, "balanced", sequence_parallel=group)
                batch = sp.shard_batch(hf_batch(kind), group)
                verdicts, agreed = [], sp._verdict  # the group's agreements, counted

                def counted(*args):
                    verdicts.append(args[1])
                    return agreed(*args)
                sp._verdict = counted
                try:
                    eager = hf_step(model, batch, seed=77 + 1000 * rank)
                    eager_verdicts = len(verdicts)
                    model.zero_grad()
                    torch._dynamo.reset()
                    counters.clear()
                    loss, grads = hf_step(torch.compile(model, backend="aot_eager"), batch,
                                          seed=77 + 1000 * rank)
                finally:
                    sp._verdict = agreed
                breaks = dict(counters["graph_break"])
                return eager, (loss, {n.replace("_orig_mod.", ""): g for n, g in grads.items()}), \
                    breaks, (eager_verdicts, len(verdicts) - eager_verdicts)
            results[key] = outcome(compiled)

        def compiled_bad_mask():  # rank 1's mask one position short: refused on both, compiled
            model = hf_model()
            ckpt_ext.patch_llama(model, sequence_parallel=group)
            batch = sp.shard_batch(hf_batch("padded"), group)
            if rank == 1:
                batch["attention_mask"] = batch["attention_mask"][:, :-1]
            return hf_step(torch.compile(model, backend="aot_eager"), batch)
        results["compiled-mask-shape-rank1"] = outcome(compiled_bad_mask)
        # only rank 1's input is bad: both ranks raise at the same point (no rank left waiting
        # in an exchange until the timeout)
        for key, bad in ONE_RANK_BAD.items():
            def one_bad(bad=bad):
                model = hf_model()
                ckpt_ext.patch_llama(model, sequence_parallel=group)
                batch = sp.shard_batch(hf_batch("padded"), group)
                extra = {}
                if rank == 1 and bad == "no-position-ids":
                    del batch["position_ids"]
                if rank == 1 and bad == "mask-shape":
                    batch["attention_mask"] = batch["attention_mask"][:, :-1]
                if rank == 1 and bad == "cache":
                    extra["use_cache"] = True
                return hf_step(model, {**batch, **extra})
            results[key] = outcome(one_bad)
        def router_logits():  # the load-balancing loss would be of one rank's tokens
            model = ckpt_ext.patch_llama(hf_model(moe=True), sequence_parallel=group)
            return hf_step(model, {**sp.shard_batch(hf_batch("padded"), group),
                                   "output_router_logits": True})
        results["moe-router-logits"] = outcome(router_logits)
        results["context-parallel"] = outcome(lambda: context_parallel_step(group))
        results["accelerate-cp"] = outcome(lambda: accelerate_cp_step(group, rank, world))
        results["torch-policy"] = outcome(
            lambda: ckpt_ext.patch_llama(hf_model(), "torch", sequence_parallel=group))
        results["odd-length"] = outcome(lambda: sp.shard_batch(
            {k: v[:, :-1] for k, v in hf_batch("padded").items()}, group))
        results["not-a-group"] = outcome(
            lambda: ckpt_ext.patch_llama(hf_model(), sequence_parallel="0"))
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_ranks(tmp_path_factory):
    """One spawned 2-rank group for every HF-model case (its results per rank)."""
    out = tmp_path_factory.mktemp("hf")
    return spawn_ranks(_hf_worker, (2, str(out / "init"), str(out)), out,
                       "sequence-parallel HF model", world=2)


@linux_only
def test_patched_hf_model_two_ranks_equal_one_process(hf_ranks):
    """A tiny fp64 HF LLaMA patched with sequence_parallel=group on 2 gloo ranks, its batch cut
    by shard_batch: the ranks' losses sum to the single-process loss of the whole batch and the
    gradients summed over the group equal its gradients (1e-10), with left padding past rank
    0's share, packed documents across the ranks' boundary, offload="cpu", PEFT LoRA with
    dropout (each rank seeded differently: the group's first rank's seed per layer call on
    every rank, masks on global rows), a Qwen3-MoE (each rank routing its own tokens; with
    router_aux_loss="fused" the load-balancing loss of the whole sequence, from the statistics
    summed over the group). Bad input refuses on every rank."""
    import ckpt_ext
    ranks = hf_ranks
    for key, (policy, dropout, kind) in HF_CASES.items():
        model = hf_model(dropout, moe="moe" in key)
        patch_kw, call_kw = hf_kwargs(key)
        ckpt_ext.patch_llama(model, policy, **patch_kw)
        want_loss, want = hf_step(model, {**hf_batch(kind), **call_kw})
        for r, res in enumerate(ranks):
            assert res[key][0] == "ok", f"{key}: rank {r} raised {res[key][1:]}"
        losses = [res[key][1][0] for res in ranks]
        torch.testing.assert_close(sum(losses), want_loss, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, key=key: f"{key} loss: {m}")
        assert not torch.allclose(losses[0], want_loss)  # each rank holds a share only
        for r, res in enumerate(ranks):
            got, own, off = res[key][1][1:]
            if "offload" in key:  # the saved layer tensors went through the host pool
                assert off["host_allocations"] > 0, off
            assert got.keys() == want.keys(), key
            for n, w in want.items():
                torch.testing.assert_close(got[n], w, rtol=1e-10, atol=1e-10,
                                           msg=lambda m, n=n, key=key: f"{key} {n}: {m}")
            if r == 0 and own:  # the sum is needed: a rank's own gradients are its share only
                n = next(n for n in own if "q_proj" in n)
                assert not torch.allclose(own[n], want[n]), key
    expect = {"torch-policy": "sequence_parallel needs every decoder layer fused",
              "context-parallel": "torch's context_parallel is active as well",
              "odd-length": "sequence length 13 of input_ids is not divisible",
              "not-a-group": "sequence_parallel must be a torch.distributed ProcessGroup",
              "no-position-ids-rank1": "the model needs position_ids",
              "mask-shape-rank1": "every rank passes attention_mask of the same shape",
              "cache-rank1": "decoder layer 0 cannot run the fused op",
              "moe-router-logits": "output_router_logits=True with sequence_parallel= and "
                                   "router_aux_loss='exact' is not implemented"}
    for key, needle in expect.items():
        for r, res in enumerate(ranks):
            assert res[key][0] == "raised", f"{key}: rank {r} ran without error"
            assert needle in res[key][2], f"{key}: rank {r}: {res[key][2]}"
            if key == "torch-policy":  # a refusal of patch_llama
                assert res[key][1] == "PatchRefused", res[key]
            if key in ("no-position-ids-rank1", "cache-rank1"):
                assert "refused on rank 1 of the group's 2 ranks" in res[key][2], res[key][2]


@linux_only
def test_compiled_hf_model_two_ranks(hf_ranks):
    """torch.compile (aot_eager) of a model patched with sequence_parallel= on 2 gloo ranks:
    no graph break (the group's agreements and mask gathers are custom ops, opaque to dynamo),
    every agreement kept in the graph, each rank's loss and gradients equal its eager step's
    (the same seeds), and the ranks' sum the single process's (1e-10), with a padding mask and
    LoRA dropout, and with packed documents. Bad input on rank 1 only raises on both."""
    import ckpt_ext
    for key, (kind, dropout) in COMPILED_CASES.items():
        model = hf_model(dropout)
        ckpt_ext.patch_llama(model, "balanced")
        want_loss, want = hf_step(model, hf_batch(kind))
        for r, res in enumerate(hf_ranks):
            assert res[key][0] == "ok", f"{key}: rank {r} raised {res[key][1:]}"
            (eager_loss, eager), (loss, grads), breaks, verdicts = res[key][1]
            print(f"{key}, rank {r}: graph breaks {sum(breaks.values())} {breaks}; the group's "
                  f"agreements per step, eager and compiled: {verdicts}")
            assert not breaks, f"{key}: rank {r}: graph breaks {breaks}"
            # the forward's and each layer's: none dropped from the graph (a layer's result is
            # unused without LoRA dropout)
            assert verdicts == (3, 3), f"{key}: rank {r}: agreements {verdicts}"
            torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=1e-12)
            assert grads.keys() == eager.keys() == want.keys(), key
            for n, g in eager.items():
                torch.testing.assert_close(grads[n], g, rtol=1e-12, atol=1e-12,
                                           msg=lambda m, n=n, r=r, key=key:
                                           f"{key} rank {r} {n}: {m}")
        losses = [res[key][1][1][0] for res in hf_ranks]
        torch.testing.assert_close(sum(losses), want_loss, rtol=1e-10, atol=1e-10)
        for n, w in want.items():  # the ranks' shares summed
            torch.testing.assert_close(sum(res[key][1][1][1][n] for res in hf_ranks), w,
                                       rtol=1e-10, atol=1e-10,
                                       msg=lambda m, n=n, key=key: f"{key} {n}: {m}")
    for r, res in enumerate(hf_ranks):  # only rank 1's mask is bad: both raise, compiled
        got = res["compiled-mask-shape-rank1"]
        assert got[0] == "raised" and "every rank passes attention_mask of the same shape" \
            in got[2], f"rank {r}: {got}"


@linux_only
def test_accelerate_cp_size_refused_on_every_rank(hf_ranks):
    """accelerate's ParallelismConfig(cp_size=2) (torch's ring attention) with a model patched
    with sequence_parallel=: every rank raises naming the supported route. Skipped, with
    accelerate's reason, where accelerate will not set cp_size up (it takes FSDP2 or a
    multi-GPU setup; on the CPU it refuses MULTI_CPU)."""
    res = [r["accelerate-cp"] for r in hf_ranks]
    if all(r[0] == "ok" and isinstance(r[1], tuple) and r[1][0] == "setup" for r in res):
        print(f"accelerate could not set up cp_size=2 here: {res[0][1][1]}")
        pytest.skip(f"accelerate could not set up cp_size=2 here: {res[0][1][1]}")
    for r, got in enumerate(res):
        assert got[0] == "raised", f"rank {r} ran without error: {got}"
        assert "sequence_parallel=" in got[2] and "context_parallel is active" in got[2], got


# ---- the router statistics of MoE layers under sequence_parallel (router_aux_loss="fused") ----

# A collective left waiting fails the case after this long (its error is then gloo's timeout,
# not the refusal the test asks for), well within spawn_ranks' limit.
ROUTER_TIMEOUT_S = 60


def router_case(key, group, rank):
    """One case of _router_worker on this rank: a tiny fp64 Qwen3-MoE patched with
    sequence_parallel=group and router_aux_loss="fused", the batch cut by shard_batch."""
    import ckpt_ext
    from ckpt_ext.hf import sequence_parallel as sp
    model = ckpt_ext.patch_llama(hf_model(moe=True), sequence_parallel=group,
                                 router_aux_loss="fused")
    batch = sp.shard_batch(hf_batch("padded"), group)
    if key == "router-stats-rank1":  # only rank 0 asks for the load-balancing loss
        return hf_step(model, {**batch, "output_router_logits": rank == 0})
    unlabelled = {k: v for k, v in batch.items()
                  if k not in ("labels", "shift_labels", "num_items_in_batch")}
    if key == "bare-model":  # the bare model does not ask its layers for statistics
        return model.model(**unlabelled, use_cache=False, output_router_logits=True)
    if key == "no-labels":  # HF's head: logits, aux_loss; each rank adds 1/N of it
        out = model(**unlabelled, use_cache=False, output_router_logits=True)
        (out.aux_loss / dist.get_world_size(group)).backward()
        sp.all_reduce_grads(model, group)
        return out.logits.detach(), out.aux_loss.detach(), out.router_logits, {
            n: p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    if key == "labels-no-grad":  # HF's head and loss (evaluation), as a tuple
        with torch.no_grad():
            return model(**batch, use_cache=False, output_router_logits=True,
                         return_dict=False)
    raise KeyError(key)


ROUTER_CASES = ("router-stats-rank1", "bare-model", "no-labels", "labels-no-grad")


def _router_worker(rank, world, init_file, out_dir):
    from test_distributed import init_gloo_rank
    init_gloo_rank(rank, world, init_file, timeout_s=ROUTER_TIMEOUT_S)
    try:
        group = dist.group.WORLD
        results = {key: outcome(lambda key=key: router_case(key, group, rank))
                   for key in ROUTER_CASES}
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@linux_only
def test_moe_router_statistics_two_ranks(tmp_path, monkeypatch):
    """Qwen3-MoE (fp64) on 2 gloo ranks with router_aux_loss="fused". Ranks that differ in
    output_router_logits (rank 0 sums its layers' statistics over the group, rank 1 asks for
    none) both raise at the first MoE layer, naming the argument, instead of waiting in
    mismatched collectives until the group's timeout. Calls that run HF's head (no labels;
    labels without grad) get the router statistics all the same: every rank's aux_loss is the
    unpatched single process's of the whole batch, the ranks' logits are its logits, their
    losses sum to its loss, and the routers' gradients of aux_loss / N summed over the ranks
    are its gradients of aux_loss (1e-10); router_logits is None. The bare model called
    directly with output_router_logits=True is refused on both ranks, naming why."""
    pytest.importorskip("transformers")
    ranks = spawn_ranks(_router_worker, (2, str(tmp_path / "init"), str(tmp_path)), tmp_path,
                        "sequence-parallel MoE router statistics", world=2)
    for r, res in enumerate(ranks):
        got = res["router-stats-rank1"]
        assert got[0] == "raised" and got[1] == "ValueError", f"rank {r}: {got}"
        assert "every rank passes output_router_logits alike" in got[2], f"rank {r}: {got[2]}"
        assert "rank 0 (1,); rank 1 (0,)" in got[2], f"rank {r}: {got[2]}"
        got = res["bare-model"]
        assert got[0] == "raised" and got[1] == "NotImplementedError", f"rank {r}: {got}"
        assert "outside the patched *ForCausalLM's forward" in got[2], f"rank {r}: {got[2]}"
    for key in ("no-labels", "labels-no-grad"):
        for r, res in enumerate(ranks):
            assert res[key][0] == "ok", f"{key}: rank {r} raised {res[key][1:]}"
    # the single process: the same fused layers on the whole sequence (the exact mode), HF's
    # load-balancing loss of their logits computed in float64 throughout
    import ckpt_ext
    from test_hf_moe import hf_aux_fp64
    ref = ckpt_ext.patch_llama(hf_model(moe=True))
    monkeypatch.setattr(sys.modules[type(ref).__module__], "load_balancing_loss_func",
                        hf_aux_fp64)
    ref.train()
    batch = hf_batch("padded")
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    want = ref(**unlabelled, use_cache=False, output_router_logits=True)
    assert want.aux_loss.dtype == torch.float64 and want.router_logits
    want.aux_loss.backward()
    routers = {n: p.grad for n, p in ref.named_parameters() if n.endswith("mlp.gate.weight")}
    tol, aux_tol = dict(rtol=1e-10, atol=1e-10), dict(rtol=1e-7, atol=0)  # aux_loss: float32
    logits, aux, router_logits, grads = zip(*(res["no-labels"][1] for res in ranks))
    torch.testing.assert_close(torch.cat(logits, 1), want.logits, **tol)
    for r in range(len(ranks)):
        torch.testing.assert_close(aux[r].double(), want.aux_loss, **aux_tol)
        assert router_logits[r] is None
        assert grads[r].keys() == routers.keys() and routers
        for n, g in routers.items():
            torch.testing.assert_close(grads[r][n], g, **tol, msg=n)
    want_loss = ref.loss_function(want.logits.detach(), batch["labels"], ref.vocab_size) + \
        ref.router_aux_loss_coef * want.aux_loss.detach()
    loss, aux, logits = zip(*(res["labels-no-grad"][1] for res in ranks))
    # HF's cross-entropy is float32 (a float64 model's too); the aux share is 2e-4 of the loss
    assert ref.router_aux_loss_coef * want.aux_loss > 1e-4 * want_loss
    torch.testing.assert_close(sum(loss).double(), want_loss, rtol=1e-6, atol=0)
    assert not torch.allclose(loss[0].double(), want_loss)  # each rank holds a share only
    torch.testing.assert_close(torch.cat(logits, 1), want.logits, **tol)
    for a in aux:
        torch.testing.assert_close(a.double(), want.aux_loss, **aux_tol)
