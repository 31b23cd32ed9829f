"""Segments of several decoder layers (``segment_layers`` = k > 1) under DeepSpeed ZeRO-3
(deepspeed's CPU accelerator, 2 processes on gloo, as tests/test_deepspeed.py): a segment's
rebuild replays layers whose parameters ZeRO-3 has partitioned, and gathers them for the replay
(``ckpt_ext.hf.patch._zero3_gather``).

Each rank trains a few SGD steps of a tiny 5-layer LLaMA with LoRA (and a Qwen2-MoE with LoRA on
its experts too) under ZeRO-3 with every parameter released after each use (no persistence, no
reuse), patched with ``min_memory`` before or after ``deepspeed.initialize``, with k = 1, 2 and 3
(neither divides 5). Checked against k = 1 under the same config, bit for bit: the losses, every
trainable parameter's full gradient at every step (``safe_get_full_grad``) and the final
parameters; the rebuilds ran (counted) and replayed layers whose parameters were partitioned
(and, with ZeRO-3's prefetch on, in flight); what the replay gathered it released again, and
after each backward every parameter is partitioned, as with k = 1. Without the gather the
replay reads released weights and raises."""
import collections
import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed: these tests need it "
                    "(pip install -e '.[test]')")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed: the ZeRO tests need it (pip install -e '.[test]')",
                allow_module_level=True)
if importlib.util.find_spec("peft") is None:
    pytest.skip("peft is not installed: these tests need it (pip install -e '.[test]')",
                allow_module_level=True)
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from test_deepspeed import (B, add_lora, batch, decoder, make_model,  # noqa: E402
                            run_rank, session_runs)

LAYERS, STEPS = 5, 3
TIMEOUT_S = 420  # all runs: about 100 s on 2 idle cores

# (name, family, patched before / after initialize, k, options)
RUNS = [(f"{family}-{when}-k{k}", family, when, k, {})
        for family, whens, ks in (("llama", ("before", "after"), (1, 2, 3)),
                                  ("qwen2_moe", ("before",), (1, 2)))
        for when in whens for k in ks]
RUNS += [(f"llama-prefetch-k{k}", "llama", "after", k, {"prefetch": True}) for k in (1, 2)]
RUNS += [(f"llama-offload-k{k}", "llama", "before", k, {"offload": "cpu"}) for k in (1, 3)]
FAILING = ("llama-nogather-k2", "llama", "after", 2, {"no_gather": True})


def ds_config(prefetch):
    """ZeRO-3 that partitions every parameter and releases it after each use; with
    ``prefetch`` its coordinator prefetches the next parameters of its trace (from the second
    step, once it has recorded it), a few thousand elements at a time: fewer than a layer's
    (about 30 000), so that a replay finds parameters of its layer still in flight (with a
    bucket of a layer or more, the coordinator's wait for the later layer's bucket completes
    them too)."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 3000 if prefetch else 0}
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**6, "wall_clock_breakdown": False}


class Watch:
    """Counts the rebuilds and, for each replayed layer call, the ZeRO-3 status of its
    weights before and after the replay."""

    def __init__(self):
        from ckpt_ext import segments
        self.rebuilds, self.replays = 0, collections.Counter()
        self.saved = segments.Segment._rebuild, segments._Call.run
        rebuild, run = self.saved
        watch = self

        def counted(segment, upto):
            watch.rebuilds += 1
            return rebuild(segment, upto)

        def watched(call, x):
            ws = [w for w in call.options.weights if hasattr(w, "ds_status")]
            before = [w.ds_status.name for w in ws]
            out = run(call, x)
            watch.replays.update(zip(before, (w.ds_status.name for w in ws)))
            return out

        segments.Segment._rebuild, segments._Call.run = counted, watched

    def close(self):
        from ckpt_ext import segments
        segments.Segment._rebuild, segments._Call.run = self.saved


def engine_run(rank, family, when, k, options):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    import ckpt_ext
    from ckpt_ext.hf import patch as hf_patch
    config = ds_config(options.get("prefetch", False))
    model = add_lora(make_model(family, LAYERS), experts=family == "qwen2_moe")
    deepspeed.zero.Init(module=model, config_dict_or_path=config)  # partitioned before both
    kwargs = {"segment_layers": k, "offload": options.get("offload")}
    if when == "before":
        ckpt_ext.patch_llama(model, "min_memory", **kwargs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in named], lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if when == "after":
        ckpt_ext.patch_llama(model, "min_memory", **kwargs)
    gather = hf_patch._segment_gather
    if options.get("no_gather"):
        hf_patch._segment_gather = lambda layer: None
    watch = Watch()
    losses, grads, left, error = [], [], [], None
    try:
        for step in range(STEPS):
            ids, mask, labels = batch(rank, step)
            loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
            engine.backward(loss)
            left.append(sorted({p.ds_status.name for p in model.parameters()}))
            grads.append({n: safe_get_full_grad(p).clone() for n, p in named})
            engine.step()
            losses.append(loss.item())
    except RuntimeError as e:
        if not options.get("no_gather"):
            raise
        error = str(e)
    finally:
        watch.close()
        hf_patch._segment_gather = gather
    if error is not None:
        return {"error": error, "rebuilds": watch.rebuilds}
    import test_deepspeed
    fused = [layer.forward.calls["fused"] for layer in decoder(model)[1]]
    result = {"losses": losses, "grads": grads, "params": test_deepspeed.full_params(model),
              "rebuilds": watch.rebuilds, "replays": dict(watch.replays), "left": left,
              "fused": fused, "error": None}
    engine.destroy()
    return result


def _worker(rank, init_file, out_dir):
    run_rank(rank, init_file, out_dir,
             [(name, lambda run=(family, when, k, options): engine_run(rank, *run))
              for name, family, when, k, options in RUNS + [FAILING]], TIMEOUT_S)


@pytest.fixture(scope="session")
def segment_runs(tmp_path_factory):
    """Every run above, once per session even under pytest-xdist (test_deepspeed's
    ``session_runs``)."""
    if sys.platform != "linux":
        pytest.skip("spawned gloo workers are tested on Linux")
    return session_runs(tmp_path_factory, "ds-segment-runs", _worker, TIMEOUT_S,
                        "DeepSpeed segment runs")


def rebuilds_per_backward(k):
    """The segments of more than one layer among LAYERS layers in segments of k."""
    sizes = [min(k, LAYERS - start) for start in range(0, LAYERS, k)]
    return sum(size > 1 for size in sizes) if k > 1 else 0


def check_bitwise(results, name, ref):
    for rank, res in enumerate(results):
        got, want = res[name], res[ref]
        where = f"{name} (rank {rank}) against {ref}"
        assert got["fused"] == want["fused"] == [STEPS] * LAYERS, (where, got["fused"])
        assert got["losses"] == want["losses"], f"{where}: losses {got['losses']} " \
            f"!= {want['losses']}"
        for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
            assert g.keys() == w.keys() and g, where
            for pname, grad in g.items():
                assert torch.equal(grad, w[pname]), \
                    f"{where}: step {step} gradient of {pname} differs by " \
                    f"{(grad - w[pname]).abs().max().item()}"
        for pname, p in got["params"].items():
            assert torch.equal(p, want["params"][pname]), f"{where}: parameter {pname}"
        # every parameter partitioned again after each backward, as with k = 1
        assert got["left"] == want["left"] == [["NOT_AVAILABLE"]] * STEPS, \
            (where, got["left"], want["left"])


def check_rebuilds(results, name, k):
    for rank, res in enumerate(results):
        got = res[name]
        assert got["rebuilds"] == STEPS * rebuilds_per_backward(k), \
            f"{name} (rank {rank}): {got['rebuilds']} rebuilds"
        replays = got["replays"]
        # the replayed layers' weights were partitioned, gathered for the replay and
        # partitioned again after it (nothing else is in flight or kept without prefetch)
        assert replays.get(("NOT_AVAILABLE", "NOT_AVAILABLE"), 0) > 0, (name, rank, replays)
        assert set(replays) <= {("NOT_AVAILABLE", "NOT_AVAILABLE"),
                                ("INFLIGHT", "AVAILABLE"), ("AVAILABLE", "AVAILABLE")}, \
            (name, rank, replays)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("k", [2, 3])
def test_llama_lora_segments_equal_one_layer_segments(segment_runs, when, k):
    name = f"llama-{when}-k{k}"
    check_bitwise(segment_runs, name, f"llama-{when}-k1")
    check_rebuilds(segment_runs, name, k)
    for rank, res in enumerate(segment_runs):
        assert res[name]["grads"][0] and all("lora_" in n for n in res[name]["grads"][0])
        assert set(res[name]["replays"]) == {("NOT_AVAILABLE", "NOT_AVAILABLE")}, \
            (name, rank, res[name]["replays"])


def test_moe_lora_segments_equal_one_layer_segments(segment_runs):
    """Qwen2-MoE with LoRA on attention, the shared expert and the experts' 3-D weights:
    DeepSpeed's leaf MoE blocks inside each fused layer (their gradients reduced by
    ``zero.reduce_inner_leaves``' node, which lies between two layers of a segment)."""
    check_bitwise(segment_runs, "qwen2_moe-before-k2", "qwen2_moe-before-k1")
    check_rebuilds(segment_runs, "qwen2_moe-before-k2", 2)
    for rank, res in enumerate(segment_runs):
        assert any("mlp.experts" in n for n in res["qwen2_moe-before-k2"]["grads"][0]), rank


def test_prefetched_parameters_are_left_to_the_coordinator(segment_runs):
    """With ZeRO-3's prefetch, a replayed layer's parameters may be in flight for its own
    backward: the replay waits for them and leaves them gathered (for that backward, which
    releases them); still bit for bit."""
    check_bitwise(segment_runs, "llama-prefetch-k2", "llama-prefetch-k1")
    check_rebuilds(segment_runs, "llama-prefetch-k2", 2)
    for rank, res in enumerate(segment_runs):
        replays = res["llama-prefetch-k2"]["replays"]
        assert replays.get(("INFLIGHT", "AVAILABLE"), 0) > 0, (rank, replays)


def test_offloaded_segments(segment_runs):
    """offload="cpu" with segments under ZeRO-3: the segment's first input goes through the
    offloader, the rebuild unpacks it."""
    check_bitwise(segment_runs, "llama-offload-k3", "llama-offload-k1")
    check_rebuilds(segment_runs, "llama-offload-k3", 3)


def test_without_the_gather_the_replay_raises(segment_runs):
    """The gather is what makes the replay valid: without it the replay finds the layer's
    weights released and raises instead of computing with them."""
    for rank, res in enumerate(segment_runs):
        got = res["llama-nogather-k2"]
        assert got["error"] and "released after its forward" in got["error"], (rank, got)
        assert got["rebuilds"] >= 1, (rank, got)
