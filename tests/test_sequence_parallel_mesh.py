"""Sequence parallelism on a data-parallel x sequence-parallel mesh: 4 gloo processes (CPU),
dp 2 x sp 2 (``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))``), a tiny HF
LLaMA patched with ``sequence_parallel=mesh.get_group("sp")``, each sp pair training on its own
global batch cut by ``shard_batch``. Under DDP over the 4 ranks, FSDP2 (``fully_shard`` per
layer and at the root over the flattened dp x sp mesh, with the loss times the sp size or with
``set_gradient_divide_factor``, and with PEFT LoRA adapters and their dropout; HSDP over the
2-D mesh; ``fully_shard`` over dp with the gradients summed over sp) and DeepSpeed ZeRO-3 (its sequence-data-parallel groups, ``mpu``
= DeepSpeed's ``parallel_state_sp``), the loss and every gradient equal a single process's: each
sp pair's losses sum to its batch's mean loss, and the gradient is the mean over the dp ranks of
each batch's gradient. fp64 within 1e-10 for torch's wrappers; ZeRO-3 (its reduction takes no
fp64) in fp32 by the accuracy rule. One spawned group of 4 serves every case."""
import functools
import gc
import importlib
import importlib.util
import os
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed: these tests need it "
                    "(pip install -e '.[test]')")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from reference import FACTOR_GRAD, FACTOR_OUT, check_vs_baseline
from test_distributed import spawn_ranks
from test_sequence_parallel import hf_batch, hf_model, outcome

WORLD, SP = 4, 2
DP = WORLD // SP
# fsdp2-lora-dropout: PEFT LoRA with dropout (frozen base, adapters sharded), over the
# flattened mesh: each sp group's seeds are its first rank's, as the single process draws them
TORCH_RUNS = ("ddp", "fsdp2", "fsdp2-divide-factor", "hsdp", "fsdp2-over-dp", "fsdp2-lora-dropout")
LORA_DROPOUT = 0.3


def layers_of(model):
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).model.layers


def global_batch(d):
    """dp rank d's global batch (both ranks of its sp pair pass it to shard_batch): left
    padding past the first sp rank's share, or packed documents across the ranks' boundary."""
    return hf_batch("padded" if d == 0 else "packed")


def full_grads(model):
    """Every parameter's gradient, whole (FSDP2's DTensor shards gathered), by name."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n] = g.detach().clone()
    return out


def torch_run(kind, mesh, flat):
    """One training step under ``kind`` (TORCH_RUNS): (this rank's loss, every gradient)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import ckpt_ext
    from ckpt_ext.hf import sequence_parallel as sp
    sp_group = mesh.get_group("sp")
    model = hf_model(LORA_DROPOUT if "lora" in kind else None)
    ckpt_ext.patch_llama(model, "balanced", sequence_parallel=sp_group)
    batch = sp.shard_batch(global_batch(mesh.get_local_rank("dp")), sp_group)
    factor = SP  # the wrapper averages over all dp x sp ranks: times SP, the sum over sp
    wrapped = model
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)  # the world: dp x sp
    else:
        shard_mesh = {"hsdp": mesh, "fsdp2-over-dp": mesh["dp"]}.get(kind, flat)
        for layer in layers_of(model):
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        if kind == "fsdp2-divide-factor":  # divide by dp instead of the dp x sp ranks
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(DP)
            factor = 1
        if kind == "fsdp2-over-dp":  # averaged over dp; summed over sp below
            factor = 1
    torch.manual_seed(77)  # the LoRA dropout seeds (each sp group: its first rank's)
    loss = wrapped(**batch, use_cache=False).loss
    (loss * factor).backward()
    if kind == "fsdp2-over-dp":
        sp.all_reduce_grads(model, sp_group)
    result = (loss.detach(), full_grads(model),
              [layer.forward.calls["fused"] for layer in layers_of(model)])
    if kind == "fsdp2":  # the wrapper summed over sp already: summing again is refused
        result += (outcome(lambda m=model: sp.all_reduce_grads(m, sp_group)),)
    del wrapped, model  # DDP's reducer freed while the group lives (tests/test_distributed.py)
    gc.collect()
    return result


def ds_config(reduce_scatter):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0,
                                  "reduce_scatter": reduce_scatter},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**6,
            "wall_clock_breakdown": False}


ZERO3_RUNS = {"zero3": True, "zero3-no-reduce-scatter": False}  # name: reduce_scatter


def zero3_runs(rank):
    """DeepSpeed ZeRO-3 with its sequence-data-parallel groups (deepspeed's parallel_state_sp as
    the engine's mpu: sp groups of consecutive ranks, ZeRO over all of them); the model patched
    with sequence_parallel= DeepSpeed's sp group. fp32. With ZeRO-3's reduce-scatter (the
    default) the gradients are averaged over all dp x sp ranks: the loss times the sp size;
    with ``reduce_scatter: false`` its all-reduce divides by dp only: the loss as it is.
    {name: outcome of (this rank's loss, every gradient, fused calls per layer)}."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.utils import safe_get_full_grad
    from test_distributed import make_model

    import ckpt_ext
    from ckpt_ext.hf import sequence_parallel as sp
    # As in tests/test_deepspeed.py: no shared-memory allreduce op built (gloo does it all)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    mpu.initialize_sequence_parallel(SP)
    group = mpu.get_sequence_parallel_group()

    def run(reduce_scatter):
        model = make_model()
        ckpt_ext.patch_llama(model, "balanced", sequence_parallel=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                          config=ds_config(reduce_scatter), mpu=mpu)
        batch = sp.shard_batch(global_batch(rank // SP), group)
        loss = engine(**batch, use_cache=False).loss
        engine.backward(loss * (SP if reduce_scatter else 1))
        grads = {n: safe_get_full_grad(p).detach().clone() for n, p in model.named_parameters()}
        calls = [layer.forward.calls["fused"] for layer in model.model.layers]
        engine.destroy()
        return loss.detach(), grads, calls

    return {name: outcome(lambda rs=rs: run(rs)) for name, rs in ZERO3_RUNS.items()}


def _worker(rank, init_file, out_dir):
    from test_distributed import init_gloo_rank
    init_gloo_rank(rank, WORLD, init_file)
    warnings.simplefilter("ignore")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (DP, SP), mesh_dim_names=("dp", "sp"))
        flat = mesh._flatten("dp_sp")  # FSDP over every rank, sp inside
        results = {"dp": mesh.get_local_rank("dp"), "sp": mesh.get_local_rank("sp")}
        times = results["times"] = {}
        for kind in TORCH_RUNS:
            t0 = time.monotonic()
            results[kind] = outcome(lambda kind=kind: torch_run(kind, mesh, flat))
            times[kind] = time.monotonic() - t0
        if importlib.util.find_spec("deepspeed") is not None:
            t0 = time.monotonic()
            results.update(zero3_runs(rank))
            times["zero3"] = time.monotonic() - t0
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory):
    if sys.platform != "linux":
        pytest.skip("spawned gloo workers are tested on Linux")
    out = tmp_path_factory.mktemp("mesh")
    t0 = time.monotonic()
    ranks = spawn_ranks(_worker, (str(out / "init"), str(out)), out,
                        "sequence-parallel dp x sp mesh", world=WORLD)
    print(f"4 ranks done in {time.monotonic() - t0:.1f} s; per run (rank 0): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in ranks[0]["times"].items()))
    return ranks


@functools.cache
def single_process(dtype=torch.float64, lora_dropout=None):
    """Each dp rank's batch's loss, and the mean of their gradients: one process, unsharded
    (the same engine: the model patched without sequence_parallel)."""
    from test_distributed import make_model

    import ckpt_ext
    losses, grads = [], {}
    for d in range(DP):
        model = make_model().to(dtype) if lora_dropout is None else hf_model(lora_dropout)
        ckpt_ext.patch_llama(model, "balanced")
        torch.manual_seed(77)
        loss = model(**global_batch(d), use_cache=False).loss
        (loss / DP).backward()
        losses.append(loss.detach())
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[n] = grads.get(n, 0) + p.grad
    return losses, grads


def results_of(ranks, kind):
    for r, res in enumerate(ranks):
        assert res[kind][0] == "ok", f"{kind}: rank {r} raised {res[kind][1:]}"
        assert res[kind][1][2] == [1, 1], f"{kind}: rank {r} fused calls {res[kind][1][2]}"
    return [res[kind][1] for res in ranks]


def pair_losses(ranks, got):
    """dp rank d's loss: the sum of its sp ranks' shares."""
    return [sum(g[0] for res, g in zip(ranks, got) if res["dp"] == d) for d in range(DP)]


@pytest.mark.parametrize("kind", TORCH_RUNS)
def test_torch_wrappers_on_dp_x_sp_mesh(mesh_ranks, kind):
    """DDP over the world and FSDP2 (flattened dp x sp, its divide factor, HSDP, over dp with
    all_reduce_grads over sp; PEFT LoRA with dropout over the flattened mesh): fp64, loss and
    gradients within 1e-10 of the single process."""
    assert [(r["dp"], r["sp"]) for r in mesh_ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want_losses, want = single_process(lora_dropout=LORA_DROPOUT if "lora" in kind else None)
    got = results_of(mesh_ranks, kind)
    for d, (loss, w) in enumerate(zip(pair_losses(mesh_ranks, got), want_losses)):
        torch.testing.assert_close(loss, w, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, d=d: f"{kind} dp {d} loss: {m}")
    for r, (_, grads, *_) in enumerate(got):
        assert grads.keys() == want.keys(), (kind, r)
        for n, w in want.items():
            torch.testing.assert_close(grads[n], w, rtol=1e-10, atol=1e-10,
                                       msg=lambda m, n=n, r=r: f"{kind} rank {r} {n}: {m}")
    if kind == "fsdp2":  # all_reduce_grads on gradients FSDP2 reduced over sp: refused
        for r, res in enumerate(got):
            assert res[3][0] == "raised" and "do not call all_reduce_grads" in res[3][2] \
                and "multiply the loss by the group's size 2" in res[3][2], (r, res[3])
    # each rank's loss is its share only, and the two batches differ
    assert not torch.allclose(got[0][0], want_losses[0])
    assert not torch.allclose(want_losses[0], want_losses[1])


@pytest.mark.parametrize("kind", list(ZERO3_RUNS))
def test_zero3_sequence_data_parallel(mesh_ranks, kind):
    """DeepSpeed ZeRO-3 with mpu=parallel_state_sp (sp 2 inside ZeRO over 4 ranks): with its
    reduce-scatter (the default) the loss times the sp size, with ``reduce_scatter: false`` the
    loss as it is (that path divides by dp only), give the single process's gradient. fp32: the
    accuracy rule against the fp64 single process, with the fp32 single process as the
    baseline."""
    if kind not in mesh_ranks[0]:
        pytest.skip("deepspeed is not installed: the ZeRO-3 runs need it "
                    "(pip install -e '.[test]')")
    got = results_of(mesh_ranks, kind)
    base_losses, base = single_process(torch.float32)
    ref_losses, ref = single_process()
    for d, loss in enumerate(pair_losses(mesh_ranks, got)):
        check_vs_baseline(f"{kind} dp {d} loss", loss.double(), base_losses[d].double(),
                          ref_losses[d], FACTOR_OUT, dtype=torch.float32)
    for r, (_, grads, *_) in enumerate(got):
        assert grads.keys() == ref.keys(), r
        for n, w in ref.items():
            check_vs_baseline(f"{kind} rank {r} {n}", grads[n], base[n], w, FACTOR_GRAD)
