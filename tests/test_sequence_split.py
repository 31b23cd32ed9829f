"""Fused layers refuse to train under sequence parallelism (ckpt_ext.hf.sequence_split), on
every rank, while HF's own layers (policy "torch" / "none", unpatched) keep calling the
attention that sequence parallelism installed: torch's context_parallel and DeepSpeed's Ulysses,
each in 2 processes on gloo (CPU), and the Ulysses registration in one process.

The sequence is S = 14 tokens: even, so that each rank holds 7, and not a multiple of
2 * WORLD, so that context_parallel's default head-tail load balancer stays off and rank r holds
tokens 7r .. 7r + 6 in order."""
import datetime
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

from test_distributed import TIMEOUT_S, WORLD, make_model, spawn_ranks  # noqa: E402

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


def patched(policy, **kw):
    import ckpt_ext
    model = make_model()
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


def ulysses_run(rank):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    # As in tests/test_deepspeed.py: no shared-memory allreduce op built (gloo does it all)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    ids, pos = full_batch()
    reference = make_model().model(input_ids=ids, position_ids=pos).last_hidden_state.detach()
    # Every rank registers; "sdpa" in ALL_ATTENTION_FUNCTIONS becomes Ulysses' all-to-all
    UlyssesSPAttentionHF.register_with_transformers(make_model(), "sdpa", WORLD, B)
    shard = slice(rank * S // WORLD, (rank + 1) * S // WORLD)
    results = {"reference": reference[:, shard]}
    for name, policy, kw in (("unpatched", None, {}), ("none", "none", {}),
                             ("torch", "torch", {}), ("balanced", "balanced", {}),
                             ("auto", "auto", dict(activation_budget="1GiB")),
                             ("torch, balanced", ["torch", "balanced"], {})):
        model = patched(policy, **kw)
        results[name] = outcome(lambda: train_step(model, ids[:, shard], pos[:, shard]))
    return results


RUNS = {"context_parallel": context_parallel_run, "ulysses": ulysses_run}


def _worker(rank, init_file, out_dir, run):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.set_num_threads(1)  # two processes on two cores
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
def test_ulysses_refuses_fused_layers_on_every_rank(tmp_path):
    """After DeepSpeed Ulysses' register_with_transformers on both ranks, a fused model
    (balanced, auto, or fused on one layer of two) raises on both ranks, naming the replaced
    attention function and the layers (before, each rank attended over its own 7 tokens);
    unpatched, policy "none" and "torch" give each rank its shard of the single-process
    output."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: the Ulysses run needs it "
                    "(pip install -e '.[test]')")
    pytest.importorskip("einops", reason="einops is not installed (deepspeed's Ulysses needs it)")
    for rank, res in enumerate(run_workers(tmp_path, "ulysses")):
        where = f"rank {rank}"
        for name, layers in (("balanced", "0, 1"), ("auto", "0, 1"), ("torch, balanced", "1")):
            assert_refused(res[name], f"{where}, policy {name!r}",
                           "ALL_ATTENTION_FUNCTIONS['sdpa']", "Ulysses",
                           f"decoder layers {layers} run", "policy='torch'")
        for name in ("unpatched", "none", "torch"):
            assert_same(res[name], ("ok", res["reference"]), f"{where}, policy {name!r}")


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
