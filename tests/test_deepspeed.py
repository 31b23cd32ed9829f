"""A patched model under DeepSpeed ZeRO-3 and ZeRO-2 (deepspeed's CPU accelerator, 2 processes on
gloo). Each rank trains a few SGD steps on its own batch through the DeepSpeed engine, patched
before or after ``deepspeed.initialize``, with full fine-tuning and with LoRA on a model
partitioned before patching, and through HF's ``Trainer`` and TRL's ``SFTTrainer`` with a ZeRO-3
config. All runs share one pair of processes (spawned once per session). Checked:
the fused ops ran (the profiler saw them), the losses and the final parameters equal the
unpatched model's under the same config, and, while a decoder layer runs its backward, its own
parameters are gathered and the LM head's weight is not (it is gathered only around the fused
loss's forward and backward)."""
import contextlib
import importlib.util
import os
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers", reason="transformers is not installed: these tests need it "
                    "(pip install -e '.[test]')")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed: the ZeRO tests need it (pip install -e '.[test]')",
                allow_module_level=True)
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

WORLD, STEPS, B, S, V, LAYERS = 2, 2, 2, 13, 97, 2
TIMEOUT_S = 300  # all runs: about 70 s on 2 idle cores; a hung collective must not hang the suite
FUSED_OPS = ("ckpt_ext::decoder_layer_fwd", "ckpt_ext::decoder_layer_bwd",
             "ckpt_ext::linear_cross_entropy_fwd", "ckpt_ext::linear_cross_entropy_bwd")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Engine runs: (name, ZeRO stage, patched: None / "before" / "after" initialize, LoRA).
ENGINE_RUNS = [("z3", 3, None, False), ("z3-before", 3, "before", False),
               ("z3-after", 3, "after", False), ("z2", 2, None, False),
               ("z2-before", 2, "before", False), ("z3-lora", 3, None, True),
               ("z3-lora-before", 3, "before", True),
               # Qwen2-MoE: the experts' 3-D gate_up_proj / down_proj partitioned like the rest;
               # with LoRA, the shared expert's adapters and the experts' (target_parameters)
               ("z3-moe", 3, None, False), ("z3-moe-before", 3, "before", False),
               ("z3-moe-after", 3, "after", False), ("z3-moe-lora", 3, None, True),
               ("z3-moe-lora-before", 3, "before", True)]
TRAINER_RUNS = [("trainer-z3", 3, None, False), ("trainer-z3-patched", 3, "before", False),
                ("sft-z3-patched", 3, "before", False)]


def ds_config(stage):
    zero = {"stage": stage}
    if stage == 3:  # partition every parameter, however small
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**6, "wall_clock_breakdown": False}


# A tiny Qwen2-MoE (top 2 of 4 experts, a gated shared expert) for the runs named "*-moe*".
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 48, "norm_topk_prob": True}


def make_model(family="llama", layers=LAYERS):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=V, use_cache=False,
                               pad_token_id=0, **(MOE if family == "qwen2_moe" else {}))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def add_lora(model, experts=False):
    """PEFT LoRA on every projection; with ``experts`` on the MoE experts' 3-D weights too
    (``target_parameters``)."""
    import peft
    torch.manual_seed(1)
    extra = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} \
        if experts else {}
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             init_lora_weights=False, **extra)  # B != 0: every adapter trains
    return peft.get_peft_model(model, config)


def batch(rank, step):
    g = torch.Generator().manual_seed(100 + 10 * step + rank)
    ids = torch.randint(1, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[rank % B, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    return ids.masked_fill(mask == 0, 0), mask, labels


def decoder(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner, inner.model.layers


def probe_backward(model, record):
    """When layer 0's input gradient is formed (its backward is done, its parameters not yet
    released), record the ZeRO status of its first parameter and of the LM head's weight."""
    inner, layers = decoder(model)
    layer = layers[0]

    def pre_hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if x.requires_grad:
            def on_grad(grad):
                status = lambda p: getattr(getattr(p, "ds_status", None), "name", "-")
                record.append((status(next(layer.parameters())),
                               status(inner.lm_head._parameters["weight"])))
            x.register_hook(on_grad)

    return layer.register_forward_pre_hook(pre_hook, with_kwargs=True)


@contextlib.contextmanager
def profiled(ops, on=True):
    """Adds the names of the ckpt_ext ops that the profiler saw in the block to ``ops``."""
    if not on:
        yield
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    ops.update(e.key for e in prof.key_averages() if e.key.startswith("ckpt_ext::"))


def full_params(model):
    """Every trainable parameter, gathered, by name."""
    import deepspeed
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().clone() for n, p in named}


def fused_counts(model):
    _, layers = decoder(model)
    return [layer.forward.calls["fused"] if hasattr(layer.forward, "calls") else 0
            for layer in layers]


def engine_run(rank, stage, patched, lora, family="llama"):
    import deepspeed
    import ckpt_ext
    config = ds_config(stage)
    model = make_model(family)
    if lora:  # partitioned before patching and initialize (as zero.Init would); base frozen
        model = add_lora(model, experts=family == "qwen2_moe")
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
    if patched == "before":
        ckpt_ext.patch_llama(model, "balanced")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if patched == "after":
        ckpt_ext.patch_llama(model, "balanced")
    statuses, ops, losses = [], set(), []
    probe = probe_backward(model, statuses)
    for step in range(STEPS):
        ids, mask, labels = batch(rank, step)
        with profiled(ops, on=step == 0):
            loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    probe.remove()
    fused = fused_counts(model)
    overlap = None
    if patched == "after":  # one backward through two forwards: their head gathers overlap
        ids, mask, labels = batch(rank, 0)
        two = [engine(input_ids=ids, attention_mask=mask, labels=labels).loss for _ in range(2)]
        engine.backward(two[0] + two[1])
        overlap = [p.ds_status.name for p in model.parameters()]
    from ckpt_ext.hf.zero import is_deepspeed_hook
    q_proj = decoder(model)[1][0].self_attn.q_proj
    child_hooks = [is_deepspeed_hook(h) for h in (*q_proj._forward_pre_hooks.values(),
                                                  *q_proj._forward_hooks.values())]
    result = {"losses": losses, "params": full_params(model), "ops": ops,
              "child_hooks": child_hooks, "overlap": overlap,
              "statuses": statuses, "fused": fused,
              "frozen_with_grad": [n for n, p in model.named_parameters()
                                   if not p.requires_grad and p.grad is not None]}
    engine.destroy()
    return result


def trainer_run(rank, stage, patched, lora, out_dir, sft=False):
    """HF's Trainer (or TRL's SFTTrainer) with a ZeRO config: it builds the engine itself, and
    the model, made after the config, is partitioned at construction (zero.Init)."""
    from transformers import Trainer, TrainingArguments
    import ckpt_ext

    ops, losses, statuses, probes = set(), [], [], []
    common = dict(output_dir=os.path.join(out_dir, f"trainer-{rank}"),
                  per_device_train_batch_size=B, max_steps=STEPS, learning_rate=0.5,
                  optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                  report_to=[], save_strategy="no", logging_steps=1, deepspeed=ds_config(stage),
                  dataloader_drop_last=True, seed=0, data_seed=0, disable_tqdm=True)
    if sft:
        import datasets
        import trl
        base, args = trl.SFTTrainer, trl.SFTConfig(max_length=S, bf16=False, **common)
        texts = [" ".join(f"w{int(t)}" for t in batch(r, step)[0][i])
                 for step in range(STEPS) for r in range(WORLD) for i in range(B)]
        rows = {"train_dataset": datasets.Dataset.from_dict({"text": texts}),
                "processing_class": word_tokenizer()}
    else:
        base, args = Trainer, TrainingArguments(**common)
        rows = {"train_dataset": [
            {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]}
            for step in range(STEPS) for r in range(WORLD)
            for ids, mask, labels in [batch(r, step)] for i in range(B)]}

    class Probe(base):  # the profiler around the first step's forward and backward
        def training_step(self, model, *args, **kwargs):
            if not probes:  # after deepspeed.initialize, as in engine_run
                probes.append(probe_backward(self.model, statuses))
                if sft:
                    # accelerate sees no GPU backend here and counts one process, while
                    # DeepSpeed trains on two: its gather of TRL's token metrics then fails on
                    # gloo. Metrics only: keep each rank's own.
                    self.accelerator.gather_for_metrics = lambda t, **kwargs: t
            with profiled(ops, on=not losses):
                loss = super().training_step(model, *args, **kwargs)
            losses.append(loss.item())
            return loss

    model = make_model()  # under zero.Init: the Trainer's DeepSpeed config is active
    if patched:
        ckpt_ext.patch_llama(model, "balanced")
    trainer = Probe(model=model, args=args, **rows)
    trainer.train()
    probes[0].remove()
    return {"losses": losses, "params": full_params(trainer.model_wrapped.module), "ops": ops,
            "statuses": statuses, "fused": fused_counts(model)}


def word_tokenizer():
    """A word-level tokenizer of the words w0 .. w{V-2}, one token each (w0 pads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {**{f"w{i}": i for i in range(V - 1)}, "<unk>": V - 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="w0", eos_token="w2",
                                   unk_token="<unk>")


def run_rank(rank, init_file, out_dir, runs, timeout_s: int = TIMEOUT_S) -> None:
    """One spawned rank: gloo set up for DeepSpeed on the CPU, then each ``(name, fn)`` of
    ``runs`` (a None result: not run here), timed; the results saved as ``<rank>.pt``."""
    from test_distributed import init_gloo_rank
    init_gloo_rank(rank, WORLD, init_file, timeout_s)
    warnings.simplefilter("ignore")
    # On the CPU accelerator DeepSpeed JIT-compiles a shared-memory allreduce op when its
    # communication backend starts (minutes on 2 cores, once per machine); gloo does every
    # collective these runs need without it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    try:
        results, times = {}, {}
        for name, fn in runs:
            t0 = time.monotonic()
            result = fn()
            if result is not None:
                results[name] = result
                times[name] = time.monotonic() - t0
        results["times"] = times
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker(rank, init_file, out_dir):
    def run(name, stage, patched, lora):
        if name.startswith("sft") and importlib.util.find_spec("trl") is None:
            return None
        if name.startswith(("trainer", "sft")):
            return trainer_run(rank, stage, patched, lora, out_dir, sft=name.startswith("sft"))
        return engine_run(rank, stage, patched, lora,
                          "qwen2_moe" if "-moe" in name else "llama")
    run_rank(rank, init_file, out_dir,
             [(r[0], lambda r=r: run(*r)) for r in ENGINE_RUNS + TRAINER_RUNS])


def _run_workers(worker, shared, timeout_s: int) -> str:
    """Runs ``worker`` on WORLD spawned processes; "done in N s", or what went wrong."""
    start = time.monotonic()
    ctx = mp.start_processes(worker, args=(str(shared / "init"), str(shared)), nprocs=WORLD,
                             start_method="spawn", join=False)
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > start + timeout_s:
                return f"the DeepSpeed workers did not finish within {timeout_s} s; killed"
    except Exception as e:  # a worker failed: its traceback
        return f"a DeepSpeed worker failed: {e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return f"done in {time.monotonic() - start:.1f} s"


def session_runs(tmp_path_factory, folder: str, worker, timeout_s: int, label: str) -> list:
    """``worker``'s runs, once per session even under pytest-xdist (the first worker to get
    here runs them in ``folder``; the others wait on a file lock and read its results): each
    rank's saved results."""
    filelock = pytest.importorskip("filelock", reason="filelock is not installed (torch "
                                   "depends on it)")
    base = tmp_path_factory.getbasetemp()  # under xdist, the session's folder is its parent
    shared = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / folder
    shared.mkdir(exist_ok=True)
    with filelock.FileLock(str(shared / "lock")):
        if not (shared / "outcome").exists():
            (shared / "outcome").write_text(_run_workers(worker, shared, timeout_s))
    outcome = (shared / "outcome").read_text()
    if not outcome.startswith("done"):
        pytest.fail(outcome, pytrace=False)
    results = [torch.load(shared / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    print(f"{label}: {outcome}; per run (rank 0): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in results[0]["times"].items()))
    return results


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory):
    """Every run above, once per session even under pytest-xdist (``session_runs``)."""
    if sys.platform != "linux":
        pytest.skip("spawned gloo workers are tested on Linux")
    pytest.importorskip("accelerate", reason="accelerate is not installed: Trainer needs it "
                        "(pip install -e '.[test]')")
    return session_runs(tmp_path_factory, "deepspeed-runs", _worker, TIMEOUT_S,
                        "DeepSpeed runs")


def check_against_unpatched(results, name, ref):
    for rank, res in enumerate(results):
        got, want = res[name], res[ref]
        where = f"{name} (rank {rank})"
        assert got["fused"] == [STEPS] * LAYERS, f"{where}: fused calls per layer {got['fused']}"
        assert not want["ops"], f"{ref}: the unpatched model ran {want['ops']}"
        assert set(FUSED_OPS) <= got["ops"], f"{where}: the profiler saw only {got['ops']}"
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} losses: {m}")
        assert got["params"].keys() == want["params"].keys()
        for pname, p in got["params"].items():
            torch.testing.assert_close(p, want["params"][pname], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where} {pname}: {m}")


def check_gathering(results, name, fused=True, head=True):
    """When a fused layer 0 finishes its backward its parameters are still gathered (for the
    whole of its backward) and the head's weight is not (released after the loss's backward);
    unpatched, HF's q_proj has released its own weight by then."""
    layer = "AVAILABLE" if fused else "NOT_AVAILABLE"
    for rank, res in enumerate(results):
        statuses = [(s[0], s[1] if head else "NOT_AVAILABLE") for s in res[name]["statuses"]]
        assert statuses and all(s == (layer, "NOT_AVAILABLE") for s in statuses), \
            f"{name} (rank {rank}): (layer 0, lm_head.weight) status in layer 0's backward " \
            f"{statuses}"


def test_zero3_patched_before_initialize(zero_runs):
    check_against_unpatched(zero_runs, "z3-before", "z3")
    check_gathering(zero_runs, "z3", fused=False)
    check_gathering(zero_runs, "z3-before")


def test_zero3_patched_after_initialize(zero_runs):
    check_against_unpatched(zero_runs, "z3-after", "z3")
    check_gathering(zero_runs, "z3-after")
    # ZeRO-3 hooked every submodule before the layers became leaves: its hooks are recognised
    # (and skipped by the fused path, which ran above).
    for rank, res in enumerate(zero_runs):
        hooks = res["z3-after"]["child_hooks"]
        assert hooks and all(hooks), (rank, hooks)
        # A backward through two forwards ran and left every parameter released.
        assert set(res["z3-after"]["overlap"]) == {"NOT_AVAILABLE"}, res["z3-after"]["overlap"]


def test_zero2(zero_runs):
    check_against_unpatched(zero_runs, "z2-before", "z2")
    for z2, z3 in (("z2", "z3"), ("z2-before", "z3-before")):  # the same training
        torch.testing.assert_close(torch.tensor(zero_runs[0][z2]["losses"]),
                                   torch.tensor(zero_runs[0][z3]["losses"]),
                                   rtol=1e-5, atol=1e-6)


def test_zero3_lora(zero_runs):
    check_against_unpatched(zero_runs, "z3-lora-before", "z3-lora")
    for rank, res in enumerate(zero_runs):  # only adapters train; the base got no gradient
        lora = res["z3-lora-before"]
        assert lora["params"] and all("lora_" in n for n in lora["params"]), rank
        assert not lora["frozen_with_grad"], (rank, lora["frozen_with_grad"])


def test_zero3_moe(zero_runs):
    """The experts' 3-D weights, the router and the shared expert, partitioned: patched before
    or after initialize, the fused layers gather them with the rest of the layer and train as
    HF's (whose MoE blocks DeepSpeed makes leaf modules itself)."""
    for name in ("z3-moe-before", "z3-moe-after"):
        check_against_unpatched(zero_runs, name, "z3-moe")
        check_gathering(zero_runs, name)
    check_gathering(zero_runs, "z3-moe", fused=False)
    for rank, res in enumerate(zero_runs):
        params = res["z3-moe-before"]["params"]
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in params), sorted(params)
        assert params["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3, rank


def test_zero3_moe_lora(zero_runs):
    """LoRA (attention, shared expert and the experts' 3-D weights) on a partitioned
    Qwen2-MoE: the shared expert's and the experts' adapters, inside DeepSpeed's leaf MoE
    block, train as HF's (PEFT's forward); layer 0's input needs no gradient (frozen
    embeddings)."""
    check_against_unpatched(zero_runs, "z3-moe-lora-before", "z3-moe-lora")
    for rank, res in enumerate(zero_runs):
        lora = res["z3-moe-lora-before"]
        assert any("shared_expert" in n for n in lora["params"]), rank
        assert any("mlp.experts" in n for n in lora["params"]), sorted(lora["params"])
        assert lora["params"] and all("lora_" in n for n in lora["params"]), rank
        assert not lora["frozen_with_grad"], (rank, lora["frozen_with_grad"])


def test_trainer_with_zero3_config(zero_runs):
    check_against_unpatched(zero_runs, "trainer-z3-patched", "trainer-z3")
    check_gathering(zero_runs, "trainer-z3", fused=False)
    check_gathering(zero_runs, "trainer-z3-patched")


def test_sft_trainer_with_zero3_config(zero_runs):
    if "sft-z3-patched" not in zero_runs[0]:
        pytest.skip("trl is not installed: the SFTTrainer run needs it (pip install -e '.[test]')")
    # TRL computes its loss with a fused head of its own (ckpt_ext's head stands aside), so
    # only the decoder layers' ops are ckpt_ext's here, and TRL's head manages its weight.
    for rank, res in enumerate(zero_runs):
        got = res["sft-z3-patched"]
        assert got["fused"] == [STEPS] * LAYERS, (rank, got["fused"])
        assert set(FUSED_OPS[:2]) <= got["ops"], (rank, got["ops"])
        assert all(torch.isfinite(torch.tensor(got["losses"]))), got["losses"]
    check_gathering(zero_runs, "sft-z3-patched", head=False)
