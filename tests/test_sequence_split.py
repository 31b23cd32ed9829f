"""Fused layers refuse to train under torch's context_parallel (ckpt_ext.hf.sequence_split), on
every rank, while HF's own layers (policy "torch" / "none", unpatched) keep calling the
attention that it installed; under DeepSpeed's Ulysses (registered for real, before or after
patching, and through HF's Trainer with ParallelismConfig(sp_size=2)) the fused layers take
part in its group and match the single process. Each in 2 processes on gloo (CPU); another
library's registered attention function in one process.

The sequence is S = 14 tokens: even, so that each rank holds 7, and not a multiple of
2 * WORLD, so that context_parallel's default head-tail load balancer stays off and rank r holds
tokens 7r .. 7r + 6 in order."""
import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed: these tests need it "
                    "(pip install -e '.[test]')")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from test_distributed import (WORLD, init_gloo_rank, make_model,  # noqa: E402
                              spawn_ranks)

B, S, V = 2, 14, 97
REFUSED = "ckpt_ext.patch_llama: "  # how the refusal's message starts
linux_only = pytest.mark.skipif(sys.platform != "linux",
                                reason="spawned gloo workers are tested on Linux")


def full_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(1, V, (B, S), generator=g), torch.arange(S).expand(B, S).clone()


def outcome(fn):
    """("ok", value) or ("raised", exception type name, message): what a worker reports."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return ("raised", type(e).__name__, str(e))


def patched(policy, dtype=torch.float32, **kw):
    import ckpt_ext
    model = make_model().to(dtype)
    if policy is not None:
        ckpt_ext.patch_llama(model, policy, **kw)
    return model


def train_step(model, ids, pos):
    """A training forward and backward of the bare model; its output's values."""
    out = model.model(input_ids=ids, position_ids=pos).last_hidden_state
    out.sum().backward()
    return out.detach()


def assert_refused(result, where, *needles):
    got = "it ran without error" if result[0] == "ok" else f"{result[1]}: {result[2]:.300}"
    assert result[0] == "raised" and result[1] == "RuntimeError" and \
        result[2].startswith(REFUSED), f"{where}: not refused, {got}"
    for needle in needles:
        assert needle in result[2], f"{where}: the refusal does not say {needle!r}: {result[2]}"


def assert_same(got, want, where):
    """Two outcomes alike: the same exception, or values equal."""
    assert got[0] == want[0], f"{where}: {got[:2]} where the unpatched model gave {want[:2]}"
    if got[0] == "raised":
        assert got[1:] == want[1:], f"{where}: {got[1:]} != {want[1:]}"
    else:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where}: {m}")


# ---- the workers ------------------------------------------------------------------------------

def context_parallel_run(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (WORLD,))
    ids, pos = full_batch()
    results = {}
    for name, policy in (("unpatched", None), ("none", "none"), ("torch", "torch"),
                         ("balanced", "balanced")):
        model = patched(policy)
        local_ids, local_pos = ids.clone(), pos.clone()  # sharded in place by the context
        with context_parallel(mesh, buffers=[local_ids, local_pos], buffer_seq_dims=[1, 1]):
            results[name] = outcome(lambda: train_step(model, local_ids, local_pos))
            with torch.no_grad():
                results[name + " no grad"] = outcome(
                    lambda: model.model(input_ids=local_ids,
                                        position_ids=local_pos).last_hidden_state)
        if name == "balanced":  # the context left: the fused layers train again
            results["balanced after"] = outcome(lambda: (
                train_step(model, ids, pos),
                [layer.forward.calls["fused"] for layer in model.model.layers])[1])
    return results


def _ulysses_batch():
    """A fp64 batch as a data collator gives it to DeepSpeed's UlyssesSPDataLoaderAdapter:
    ids, labels (some ignored) and global position_ids (the adapter requires them)."""
    ids, pos = full_batch()
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt, not trained on
    labels[1, 9:12] = -100
    return dict(input_ids=ids, labels=labels, position_ids=pos)


def _ulysses_step(model, batch, group):
    """One training step as transformers' Trainer takes it under ParallelismConfig(sp_size=N)
    with sp_backend="deepspeed" (transformers.integrations.deepspeed.deepspeed_sp_compute_loss:
    labels = shift_labels, the shards' losses weighted by their labelled tokens over the
    group), the gradients then summed over the group (DeepSpeed's engine averages them over
    its sequence-data-parallel group, here the same N ranks, after the loss's all_gather
    multiplied them by N). Returns (loss, {name: gradient})."""
    from torch.distributed.nn.functional import all_gather
    loss = model(**{**batch, "labels": batch["shift_labels"]}).loss
    good = (batch["shift_labels"] != -100).sum()
    losses, goods = torch.stack(all_gather(loss, group=group)), torch.stack(
        all_gather(good, group=group))
    total = (losses * goods).sum() / goods.sum()
    total.backward()
    n = dist.get_world_size(group)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            grads[name] = p.grad / n
    return total.detach(), grads


def ulysses_run(rank):
    """DeepSpeed's Ulysses registered for real (deepspeed's CPU accelerator, gloo), once, after
    one model was patched and before the others; each rank's batch cut by DeepSpeed's own
    UlyssesSPDataLoaderAdapter (shift_labels, global position_ids)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    from ckpt_ext.hf.sequence_split import deepspeed_ulysses_group
    # As in tests/test_deepspeed.py: no shared-memory allreduce op built (gloo does it all)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    ids, pos = full_batch()
    whole = _ulysses_batch()
    # the single process of each policy (the same engine: HF's loss upcasts logits to fp32,
    # the fused head's stays fp64), before Ulysses is registered (it would cut attention's
    # sequence); every model alike from make_model's seed
    policies = (("unpatched", None, {}), ("torch", "torch", {}),
                ("balanced, patched before", "balanced", {}),
                ("balanced, patched after", "balanced", {}),
                ("min_memory", "min_memory", {}),
                ("auto", "auto", dict(activation_budget="1GiB")),
                ("torch, balanced", ["torch", "balanced"], {}))
    results = {}
    for name, policy, kw in policies:
        reference = patched(policy, torch.float64, **kw)
        torch.manual_seed(0)
        want_loss = reference(**whole).loss
        want_loss.backward()
        results[name + " reference"] = (want_loss.detach(), {
            n: p.grad for n, p in reference.named_parameters() if p.grad is not None})
    with torch.no_grad():
        results["reference no grad"] = reference.model(
            input_ids=ids, position_ids=pos).last_hidden_state[:, rank * S // WORLD:
                                                              (rank + 1) * S // WORLD]
    models = {"balanced, patched before": patched("balanced", torch.float64)}
    results["group before"] = deepspeed_ulysses_group("sdpa")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    unregistered = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)  # for the Trainer's run below
    # Every rank registers; "sdpa" in ALL_ATTENTION_FUNCTIONS becomes Ulysses' all-to-all
    mpu = UlyssesSPAttentionHF.register_with_transformers(make_model(), "sdpa", WORLD, B)
    group = mpu.get_sequence_parallel_group()
    results["group found"] = deepspeed_ulysses_group("sdpa") is group
    loader = UlyssesSPDataLoaderAdapter(
        torch.utils.data.DataLoader([{k: v[i] for k, v in whole.items()} for i in range(B)],
                                    batch_size=B),
        sp_rank=dist.get_rank(group), sp_group=group, sp_world_size=WORLD,
        device=torch.device("cpu"))
    # rank r: the first rank's batch, tokens 7r .. 7r + 6; its shards are column slices, which
    # the Trainer's move to the GPU makes contiguous (HF's loss views shift_labels flat)
    batch = {k: v.contiguous() if torch.is_tensor(v) else v
             for k, v in next(iter(loader)).items()}
    results["batch"] = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    for name, policy, kw in policies[:2] + policies[3:]:
        models[name] = patched(policy, torch.float64, **kw)
    for name, model in models.items():
        torch.manual_seed(0)
        results[name] = outcome(lambda model=model: _ulysses_step(model, batch, group))
        if name != "unpatched":
            results[name + " calls"] = [dict(layer.forward.calls)
                                        for layer in model.model.layers]
        with torch.no_grad():  # HF's layers call Ulysses' wrapper
            results[name + " no grad"] = outcome(lambda model=model: model.model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"]).last_hidden_state)
    # only rank 1 asks for the cache (its layers would run HF's forward): both ranks raise
    model = models["balanced, patched after"]
    results["cache on rank 1"] = outcome(lambda: _ulysses_step(
        model, {**batch, "use_cache": rank == 1}, group))
    # HF's Trainer registers Ulysses itself (accelerate's ParallelismConfig(sp_size=2)): undo
    # the last registration and DeepSpeed's SP state before each (it registers once per process)
    def unregister():
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(unregistered)
        state = importlib.import_module("deepspeed.runtime.sequence_parallel.parallel_state_sp")
        state._SEQUENCE_PARALLEL_GROUP = state._SEQUENCE_DATA_PARALLEL_GROUP = None
    for policy in (None, "balanced"):
        unregister()
        results[f"trainer {policy}"] = outcome(lambda policy=policy: trainer_step(whole, policy))
    return results


def trainer_step(whole, policy):
    """One SGD step of HF's Trainer with ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    on a model of ``policy`` (None: unpatched): DeepSpeed's engine (ZeRO stage 0, no gradient
    clipping, fp32: its gradient reduction takes no fp64), its register_with_transformers
    after patching, its UlyssesSPDataLoaderAdapter, the Trainer's loss. Returns (its losses,
    the parameters after the step, each layer's calls) and the single process's loss and
    gradients, or ("setup", why) where accelerate will not set it up. The unpatched model's
    loss gets shift_labels made contiguous, as the Trainer's move to a GPU makes them (on the
    CPU HF's loss cannot view the adapter's column slice flat)."""
    import tempfile

    import transformers.loss.loss_utils as loss_utils
    from transformers import Trainer, TrainingArguments
    try:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig
    except ImportError as e:
        return ("setup", f"accelerate without ParallelismConfig sp_size ({e})")
    reference = patched(policy)
    loss = reference(**whole).loss
    loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    losses = []

    class Recording(Trainer):
        def training_step(self, model, *args, **kwargs):
            loss = super().training_step(model, *args, **kwargs)
            losses.append(loss.detach())
            return loss

    hf_loss = loss_utils.LOSS_MAPPING["ForCausalLM"]

    def contiguous_labels(*args, shift_labels=None, **kwargs):
        return hf_loss(*args, **kwargs, shift_labels=None if shift_labels is None
                       else shift_labels.contiguous())

    rows = [{k: v[i] for k, v in whole.items()} for i in range(B)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=B, max_steps=1, learning_rate=0.5,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
            report_to=[], save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
            deepspeed={"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
                       "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True,
                       "gradient_clipping": 0.0, "steps_per_print": 10**6},
            parallelism_config=ParallelismConfig(
                sp_backend="deepspeed", sp_size=WORLD,
                sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")))
        model = patched(policy)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            trainer = Recording(model=model, args=args, train_dataset=rows)
        except ValueError as e:  # accelerate's refusal of this setup
            return ("setup", f"{type(e).__name__}: {e}")
        loss_utils.LOSS_MAPPING["ForCausalLM"] = contiguous_labels
        try:
            trainer.train()
        finally:
            loss_utils.LOSS_MAPPING["ForCausalLM"] = hf_loss
    steps = {n: (before[n] - p.detach()) / 0.5 for n, p in model.named_parameters()}
    calls = [dict(layer.forward.calls) for layer in model.model.layers] if policy else None
    return (losses, steps, calls), (loss.detach(), want)


RUNS = {"context_parallel": context_parallel_run, "ulysses": ulysses_run}


def _worker(rank, init_file, out_dir, run):
    init_gloo_rank(rank, WORLD, init_file)
    try:
        torch.manual_seed(0)
        torch.save(RUNS[run](rank), os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # both ranks done before either tears the group down
    finally:
        dist.destroy_process_group()


def run_workers(tmp_path, run):
    """Each rank's results (tests/test_distributed.py's spawn_ranks: a rank left waiting in a
    collective fails the test instead of hanging it)."""
    out = tmp_path / run
    out.mkdir()
    return spawn_ranks(_worker, (str(out / "init"), str(out), run), out, run)


# ---- the tests --------------------------------------------------------------------------------

@linux_only
def test_context_parallel_refuses_fused_layers_on_every_rank(tmp_path):
    """Under torch's context_parallel a fused model's training forward raises on both ranks
    (before, it attended over its rank's 7 tokens only); HF's layers (unpatched, policy "none"
    and "torch", and the fused model without grad) call context_parallel's SDPA as before. On
    the CPU that SDPA raises itself (DTensor has no sharding strategy for the CPU flash kernel),
    so they are compared by outcome: exactly the unpatched model's. After the context the fused
    model trains fused again."""
    for rank, res in enumerate(run_workers(tmp_path, "context_parallel")):
        where = f"rank {rank}"
        assert_refused(res["balanced"], where, "context_parallel", "decoder layers 0, 1",
                       "policy='torch'", "unpatch_llama")
        for name in ("none", "torch"):
            assert_same(res[name], res["unpatched"], f"{where}, policy {name!r}")
        for name in ("none", "torch", "balanced"):
            assert_same(res[f"{name} no grad"], res["unpatched no grad"],
                        f"{where}, policy {name!r} without grad")
        assert res["balanced after"] == ("ok", [1, 1]), f"{where}: {res['balanced after']}"


@linux_only
def test_deepspeed_ulysses_fused_layers_take_part(tmp_path):
    """DeepSpeed's Ulysses (the ALST route of ParallelismConfig(sp_size=N)) registered for real
    on 2 gloo ranks, after one model was patched and before the others: the fused layers find
    its group by the registered function (not the name "sdpa") and run Ulysses in it, HF's
    layers (policy "torch", a mixed policy, no grad) call DeepSpeed's wrapper; with the batch
    cut by DeepSpeed's UlyssesSPDataLoaderAdapter (shift_labels) and the Trainer's loss
    weighting, the loss and every gradient equal the single process's (fp64, 1e-10). A rank
    whose fused layer cannot run the fused op (the cache on rank 1 only) makes both raise."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: the Ulysses run needs it "
                    "(pip install -e '.[test]')")
    pytest.importorskip("einops", reason="einops is not installed (deepspeed's Ulysses needs it)")
    ranks = run_workers(tmp_path, "ulysses")
    names = ("unpatched", "torch", "balanced, patched before", "balanced, patched after",
             "min_memory", "auto", "torch, balanced")
    fused = {"torch": 0, "torch, balanced": 1}
    for rank, res in enumerate(ranks):
        where = f"rank {rank}"
        assert res["group before"] is None and res["group found"], where
        assert res["batch"]["shift_labels"].shape == (B, S // WORLD), res["batch"].keys()
        assert "labels" not in res["batch"], where  # the adapter's shift_labels only
        for name in names:
            want_loss, want = res[name + " reference"]
            got = res[name]
            assert got[0] == "ok", f"{where}, {name}: raised {got[1:]}; " + str(
                {k: v[:2] for k, v in res.items() if isinstance(v, tuple) and v[0] == "raised"})
            loss, grads = got[1]
            torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10,
                                       msg=lambda m, name=name: f"{where}, {name} loss: {m}")
            assert grads.keys() == want.keys(), (where, name)
            for n, w in want.items():
                torch.testing.assert_close(grads[n], w, rtol=1e-10, atol=1e-10,
                                           msg=lambda m, n=n, name=name: f"{where} {name} {n}: {m}")
            if name != "unpatched":  # the fused layers ran fused, none delegated
                calls = res[name + " calls"]
                assert sum(c.get("fused", 0) for c in calls) == fused.get(name, 2), (name, calls)
                assert not any(k.startswith("delegated") and k != "delegated: grad is disabled "
                               "(inference)" for c in calls for k in c), (name, calls)
            assert_same(res[name + " no grad"], ("ok", res["reference no grad"]),
                        f"{where}, {name} without grad")
        got, plain = res["trainer balanced"], res["trainer None"]
        assert got[0] == "ok" and plain[0] == "ok", \
            f"{where}, the Trainer: raised {got[1:]} (unpatched: {plain[1:]})"
        if got[1][0] == "setup":
            print(f"{where}: accelerate could not set up the Trainer's sp_size=2 here: "
                  f"{got[1][1]}")
        else:
            (losses, steps, calls), (want_loss, want) = got[1]
            (plain_losses, plain_steps, _), _ = plain[1]
            assert len(losses) == 1 and calls == [{"fused": 1}, {"fused": 1}], (losses, calls)
            torch.testing.assert_close(losses[0], want_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}, the Trainer's loss: {m}")
            torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)
            # The fused route's step is the unpatched model's Trainer step, and both are one
            # multiple of the single process's gradient for every parameter: N times with the
            # releases this test was first written against (the loss's all_gather summed the
            # ranks' shares in backward, and the engine's data-parallel group here is one
            # rank), once with transformers 5.25 / accelerate 1.16 / deepspeed 0.19.8, which
            # no longer over-count. The fused route follows either.
            first = next(iter(want))
            factor = 1 if torch.allclose(plain_steps[first], want[first], rtol=1e-4,
                                         atol=1e-6) else WORLD
            for n, w in want.items():
                torch.testing.assert_close(steps[n], plain_steps[n], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=n: f"{where}, Trainer, {n}: {m}")
                torch.testing.assert_close(steps[n], factor * w, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=n: f"{where}, Trainer, {n}, "
                                           f"{factor}x the single process's: {m}")
        got = res["cache on rank 1"]
        assert got[0] == "raised" and "refused on rank 1 of the group's 2 ranks" in got[2] \
            and "under DeepSpeed Ulysses" in got[2], f"{where}: {got}"


class _RegisteredAttention:
    """An attention function of another library put in place of transformers' own, counting its
    calls (it computes what the original does)."""

    __module__ = "sequence_split_probe"

    def __init__(self, original):
        self.original, self.calls = original, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def test_replaced_registered_attention_refuses_fused_training_only():
    """In one process, the registry entry replaced as DeepSpeed's Ulysses replaces it (deepspeed
    0.19.8, ulysses_sp.py, register_with_transformers: ``ALL_ATTENTION_FUNCTIONS[
    core_attn_implementation] = uattn_wrapper``, an instance-level entry of transformers'
    AttentionInterface that shadows the class-wide one): a fused training forward raises, naming
    the function; without grad the fused model runs HF's layers, which call it, as policy
    "torch" and "none" do in training; with the entry removed the fused model trains fused."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    ids, pos = full_batch()
    models = {policy: patched(policy) for policy in ("balanced", "torch", "none")}
    registered = _RegisteredAttention(ALL_ATTENTION_FUNCTIONS["sdpa"])
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)  # restored after
    ALL_ATTENTION_FUNCTIONS["sdpa"] = registered
    try:
        with pytest.raises(RuntimeError, match=r"ALL_ATTENTION_FUNCTIONS\['sdpa'\] is "
                           r"sequence_split_probe\._RegisteredAttention, not transformers' own"):
            train_step(models["balanced"], ids, pos)
        assert registered.calls == 0
        with torch.no_grad():
            models["balanced"].model(input_ids=ids, position_ids=pos)
        assert registered.calls == 2  # one per layer
        for policy in ("torch", "none"):
            registered.calls = 0
            train_step(models[policy], ids, pos)
            assert registered.calls >= 2, policy  # "torch" recomputes in backward
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(local)
    train_step(models["balanced"], ids, pos)
    assert [layer.forward.calls["fused"] for layer in models["balanced"].model.layers] == [1, 1]
