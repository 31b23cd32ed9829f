"""A patched model under DDP and FSDP2 (fully_shard per decoder layer and at the root, with and
without a bf16 MixedPrecisionPolicy): 2 processes on gloo, CPU. Each rank trains a few SGD
steps on its own batch; the losses equal the unpatched model's under the same wrapper and,
without mixed precision, a single-process run that averages the ranks' gradients. A Qwen3-MoE with PEFT LoRA on the
experts' 3-D weights takes one FSDP2 step in float64: loss and LoRA gradients equal one
process's."""
import datetime
import gc
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers", reason="transformers is not installed: these tests need it "
                    "(pip install -e '.[test]')")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from hf_fixtures import padded_batch, tiny_model  # noqa: E402

WORLD, STEPS, B, S = 2, 2, 2, 13
TIMEOUT_S = 240  # a run takes about 20 s; a hung collective must not hang the suite


# phi3: fused qkv_proj / gate_up_proj (their blocks' gradients concatenated into the sharded
# fused weights') and partial rotary embeddings
# qwen3_moe: the experts' 3-D gate_up_proj (E, 2I, H) and down_proj (E, H, I) sharded over the
# experts dim, top 2 of 4 renormalised
FAMILY_CONFIG = {"llama": {}, "phi3": dict(rope_parameters=dict(
    rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True}}


def make_model(family="llama"):
    return tiny_model(family, dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=97, use_cache=False, pad_token_id=0,
                                   **FAMILY_CONFIG[family]))


def batch(rank):
    return padded_batch(97, B, S, pad_row=rank % B, pad=3, seed=100 + rank)


def loss_of(model, rank):
    ids, mask, labels = batch(rank)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def init_gloo_rank(rank, world, init_file, timeout_s=TIMEOUT_S):
    """A spawned worker's gloo group of ``world`` ranks (collectives time out after
    ``timeout_s``: a hang fails instead of stalling the suite), with the
    environment a launcher would set (DeepSpeed and accelerate read it) and one torch thread
    (the ranks share the machine's cores)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def _worker(rank, init_file, wrapper, patched, out_dir, family="llama"):
    import ckpt_ext
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        model = make_model(family)
        if patched:  # True, or "offload": the saved layer tensors in host memory
            ckpt_ext.patch_llama(model, "balanced",
                                 offload="cpu" if patched == "offload" else None)
        if wrapper == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) \
                if wrapper == "fsdp2-bf16" else MixedPrecisionPolicy()
            # A CPU mesh: without one, fully_shard builds its default mesh on the CUDA device
            # when CUDA is available (which ran out of memory on a GPU machine shared by many
            # test workers), while this model and its gloo group are on the CPU.
            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, rank)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        inner = model.module if wrapper == "ddp" else model
        fused = sum(layer.forward.calls["fused"] for layer in inner.model.layers) if patched else 0
        off = inner.model.layers[0].forward.shared.offloader if patched else None
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in inner.named_parameters()}
        torch.save({"losses": losses, "fused": fused, "params": params,
                    "offload": off.stats() if off is not None else None},
                   os.path.join(out_dir, f"{rank}.pt"))
        # Free DDP's reducer while the group is still registered. Freed later (at the return,
        # after destroy_process_group), it drops the last reference to the gloo group and its
        # destructor joins gloo's worker threads with the GIL held, while a worker thread
        # needs the GIL to free a finished work's Python thread-local state: a deadlock at
        # exit (py-spy: ~Reducer -> ~ProcessGroupGloo -> thread::join; runLoop ->
        # ~AsyncBarrierWork -> ~ThreadLocalState -> gil_scoped_acquire), about one DDP run
        # in four here.
        del model, inner, opt, loss
        gc.collect()
        dist.barrier()  # both ranks done before either tears the group down
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, args, out, label, world=WORLD):
    """Run ``worker(rank, *args)`` on ``world`` spawned processes and return each rank's
    ``out/<rank>.pt``; fails (after killing them) when the workers do not finish within
    TIMEOUT_S, as a rank left waiting in a collective would not."""
    ctx = mp.start_processes(worker, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=2):  # raises if a worker failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            done = sorted(f.name for f in out.glob("*.pt"))
            pytest.fail(f"{label} workers did not finish within {TIMEOUT_S} s (results "
                        f"written: {done or 'none'}); killed")
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(world)]


def run_distributed(tmp_path, wrapper, patched, family="llama"):
    out = tmp_path / f"{family}-{wrapper}-{patched}"
    out.mkdir()
    return spawn_ranks(_worker, (str(out / "init"), wrapper, patched, str(out), family), out,
                       wrapper)


def single_process_losses(family="llama", params=False):
    """The ranks' losses of a single process that steps with the mean of their gradients (and,
    with ``params``, its final parameters by name)."""
    model = make_model(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = [[] for _ in range(WORLD)]
    for _ in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            loss = loss_of(model, rank)
            (loss / WORLD).backward()
            losses[rank].append(loss.item())
        opt.step()
    if params:
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "fsdp2-bf16"])
def test_patched_model_trains_like_unpatched(tmp_path, wrapper):
    patched = run_distributed(tmp_path, wrapper, True)
    plain = run_distributed(tmp_path, wrapper, False)
    assert all(r["fused"] == STEPS * 2 for r in patched)  # 2 layers per step, on every rank
    tol = dict(rtol=2e-2, atol=2e-2) if wrapper == "fsdp2-bf16" else dict(rtol=1e-5, atol=1e-6)
    for p, u in zip(patched, plain):
        torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(u["losses"]), **tol)
    if wrapper != "fsdp2-bf16":
        for rank, ref in enumerate(single_process_losses()):
            torch.testing.assert_close(torch.tensor(patched[rank]["losses"]), torch.tensor(ref),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_fsdp2_per_layer_with_offload_equals_without(tmp_path):
    """fully_shard per layer with offload="cpu": the losses equal the same run's without offload
    bit for bit; the layer inputs went through the host pool (FSDP2's unsharded parameters
    did not: 2 layers x 4 saved activations of balanced per step, the same buffers reused)."""
    offloaded = run_distributed(tmp_path, "fsdp2", "offload")
    kept = run_distributed(tmp_path, "fsdp2", True)
    for o, k in zip(offloaded, kept):
        assert o["losses"] == k["losses"]
        assert o["fused"] == STEPS * 2
        assert o["offload"]["host_allocations"] == 2 * 4 and o["offload"]["host_in_use"] == 0


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_phi3_under_fsdp2_trains_like_unpatched(tmp_path):
    """Phi-3 (fused projections, partial RoPE) with fully_shard per layer: fused, and the losses
    equal the unpatched model's and the single-process run's."""
    patched = run_distributed(tmp_path, "fsdp2", True, "phi3")
    plain = run_distributed(tmp_path, "fsdp2", False, "phi3")
    assert all(r["fused"] == STEPS * 2 for r in patched)
    for p, u in zip(patched, plain):
        torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(u["losses"]),
                                   rtol=1e-5, atol=1e-6)
    for rank, ref in enumerate(single_process_losses("phi3")):
        torch.testing.assert_close(torch.tensor(patched[rank]["losses"]), torch.tensor(ref),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_moe_under_fsdp2_trains_like_unpatched(tmp_path):
    """Qwen3-MoE with fully_shard per layer (the 3-D expert weights sharded like the rest):
    fused, and the losses and the final parameters (gathered) equal those of the unpatched
    model trained in one process on the mean of the ranks' gradients (one spawned run: the
    unpatched model under FSDP2 is the dense tests' check)."""
    patched = run_distributed(tmp_path, "fsdp2", True, "qwen3_moe")
    assert all(r["fused"] == STEPS * 2 for r in patched)
    ref_losses, ref_params = single_process_losses("qwen3_moe", params=True)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in ref_params)
    for rank, got in enumerate(patched):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses[rank]),
                                   rtol=1e-5, atol=1e-6)
        assert got["params"].keys() == ref_params.keys()
        for name, want in ref_params.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")


# ---- FSDP2 with PEFT LoRA on the experts' 3-D weights (target_parameters) ----------------------

EXPERT_LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "init_lora_weights": False,  # B != 0
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def expert_lora_model(dtype):
    """The tiny Qwen3-MoE with PEFT LoRA (seeded) on the attention and on both expert weights
    (the ParamWrappers nested), base frozen, in ``dtype``."""
    import peft
    model = make_model("qwen3_moe").to(dtype)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(**EXPERT_LORA))


def _expert_lora_worker(rank, init_file, out_dir, dtype):
    import ckpt_ext
    init_gloo_rank(rank, WORLD, init_file)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = expert_lora_model(dtype)
        ckpt_ext.patch_llama(model, "balanced")
        mesh = init_device_mesh("cpu", (WORLD,))
        layers = model.get_base_model().model.layers
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = loss_of(model, rank)
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        calls = [dict(layer.forward.calls) for layer in layers]
        torch.save({"loss": loss.item(), "grads": grads, "calls": calls},
                   os.path.join(out_dir, f"{rank}.pt"))
        del model, loss
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_moe_expert_lora_under_fsdp2_equals_one_process(tmp_path):
    """PEFT LoRA on the attention and on the experts' 3-D weights (the slots
    mlp.experts.{gate_up_proj,down_proj}.lora_{A,B}), fully_shard per layer and at the root
    (the factors sharded like the rest, the frozen base beside them), patched, in float64: every
    layer fused with the factors (nothing delegated to PEFT's forward), and each rank's loss and
    every LoRA gradient (gathered: the mean over the ranks) equal those of the unpatched PEFT
    model in one process on the same two batches."""
    pytest.importorskip("peft", reason="peft is not installed: the expert LoRA test needs it")
    import ckpt_ext
    dtype = torch.float64
    got = spawn_ranks(_expert_lora_worker, (str(tmp_path / "init"), str(tmp_path), dtype),
                      tmp_path, "FSDP2 expert LoRA")
    ref = expert_lora_model(dtype)
    ref.get_base_model().set_experts_implementation("eager")  # grouped_mm takes no float64
    one = ckpt_ext.patch_llama(expert_lora_model(dtype), "balanced")
    want, losses = {}, {}
    for name, model in (("unpatched", ref), ("patched", one)):
        losses[name] = []
        for rank in range(WORLD):
            ids, mask, labels = batch(rank)
            if name == "patched":
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            else:  # HF's loss in float64 (its own casts the logits to float32, as ours does not)
                logits = model(input_ids=ids, attention_mask=mask).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
            (loss / WORLD).backward()
            losses[name].append(loss.item())
        want[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sum(".mlp.experts." in n and ".lora_" in n for n in want["unpatched"]) == 2 * 2 * 2
    # the unpatched router's float32 softmax and the op's round apart: a few 1e-8 here
    tols = {"unpatched": {"rtol": 1e-5, "atol": 2e-7}, "patched": {"rtol": 1e-10, "atol": 1e-13}}
    for rank, r in enumerate(got):
        assert [c.get("fused", 0) for c in r["calls"]] == [1, 1], r["calls"]
        assert not any(k.startswith("delegated") for c in r["calls"] for k in c), r["calls"]
        for name, tol in tols.items():
            torch.testing.assert_close(r["loss"], losses[name][rank], **tol)
            assert r["grads"].keys() == want[name].keys()
            for n, g in want[name].items():
                torch.testing.assert_close(
                    r["grads"][n], g, **tol, msg=lambda m, k=rank, w=name, n=n: f"{w}, rank {k} {n}: {m}")
