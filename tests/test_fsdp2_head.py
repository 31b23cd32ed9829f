"""The fused LM head (and the final norm inside it) under the FSDP2 layouts users apply, on 2
gloo processes (CPU), float64, the model's weights perturbed off their init (so that the norm's
weight matters):

  per_layer        fully_shard on each decoder layer, then on the *ForCausalLM
  per_layer_bare   the same and fully_shard(model.model) between: the final norm's weight is
                   in the bare model's unit, resharded before the head runs
  root             fully_shard on the *ForCausalLM only
  head_unit        per_layer and fully_shard(lm_head) before the root: the fused loss runs as
                   the head's forward, through its FSDP2 hooks
  norm_head_unit   per_layer and fully_shard([model.norm, lm_head]) before the root (the
                   norm, a unit, runs as HF's: in float32, so the one-process comparison of
                   this layout takes the looser tolerance)
  embed_head_unit  per_layer and fully_shard([model.embed_tokens, lm_head]) before the root:
                   what FSDP2 asks for tied embeddings in a unit of their own

with untied and tied embeddings, patched before and after fully_shard, and PEFT LoRA on the
attention (the head and the norm frozen). Each rank runs two forwards and backwards on its own
batch: the head is fused at every call; the loss and every gathered gradient
(``full_tensor()``, FSDP2's mean over the ranks) equal those of the unpatched model under the
same layout (to the tolerance of the expert-LoRA FSDP2 test, rtol 1e-5 / atol 2e-7: HF's loss
casts the logits to float32, ours does not) and those of the patched model in one process on
both batches (1e-10 / 1e-13).
Under a bf16 MixedPrecisionPolicy (float32 model) per_layer, per_layer_bare and head_unit
equal the unpatched model within test_distributed's bf16 tolerance, and each other bit for bit.
Tied embeddings with fully_shard(model.model) are refused by FSDP2 itself at fully_shard
(the tied weight would be in two units), patched or not."""
import functools
import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed: these tests need it "
                    "(pip install -e '.[test]')")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from hf_fixtures import tiny_model  # noqa: E402
from test_distributed import WORLD, batch, init_gloo_rank, spawn_ranks  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "init_lora_weights": False,
        "target_modules": ["q_proj", "v_proj"]}

# (layout, embeddings, when patch_llama runs relative to fully_shard)
CASES = [("per_layer", "untied", "before"), ("per_layer", "tied", "before"),
         ("per_layer_bare", "untied", "before"), ("root", "untied", "before"),
         ("root", "tied", "before"), ("per_layer", "untied", "after"),
         ("per_layer_bare", "untied", "after"), ("per_layer", "lora", "before"),
         ("per_layer_bare", "lora", "before"), ("head_unit", "untied", "before"),
         ("head_unit", "untied", "after"), ("norm_head_unit", "untied", "before"),
         ("head_unit", "lora", "before"), ("embed_head_unit", "tied", "before"),
         ("embed_head_unit", "untied", "before")]
# under a bf16 MixedPrecisionPolicy (float32 model): the layouts where the norm leaves the head
MIXED = [("per_layer", "untied", "before"), ("per_layer_bare", "untied", "before"),
         ("head_unit", "untied", "before")]
REFUSED = [("per_layer_bare", "tied", "before")]


def build(embeddings, dtype=torch.float64):
    """The tiny LLaMA in ``dtype`` (tied or untied embeddings, or PEFT LoRA on an untied one)."""
    model = tiny_model("llama", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=97, use_cache=False, pad_token_id=0,
                                     tie_word_embeddings=embeddings == "tied"),
                       perturb=True).to(dtype)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (embeddings == "tied")
    if embeddings == "lora":
        import peft
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard(model, layout, mesh, bf16=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    fully_shard = functools.partial(fully_shard, mp_policy=policy)
    lm = causal_lm(model)
    if layout != "root":
        for layer in lm.model.layers:
            fully_shard(layer, mesh=mesh)
    if layout == "per_layer_bare":
        fully_shard(lm.model, mesh=mesh)
    if layout == "head_unit":
        fully_shard(lm.lm_head, mesh=mesh)
    if layout == "norm_head_unit":
        fully_shard([lm.model.norm, lm.lm_head], mesh=mesh)
    if layout == "embed_head_unit":
        fully_shard([lm.model.embed_tokens, lm.lm_head], mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_case(model, layout, order, patched, mesh, rank, bf16=False):
    import ckpt_ext
    if patched and order == "before":
        ckpt_ext.patch_llama(model, "balanced")
    shard(model, layout, mesh, bf16)
    if patched and order == "after":
        ckpt_ext.patch_llama(model, "balanced")
    lm = causal_lm(model)
    ids, mask, labels = batch(rank)
    losses, grads = [], []
    for _ in range(2):  # the second call after FSDP2 has resharded everything once
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    out = {"losses": losses, "grads": grads}
    if patched:
        out["calls"] = dict(lm.forward.calls)
        out["norm_in_head"] = lm.forward.last_norm_in_head
    return out


def _worker(rank, init_file, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    init_gloo_rank(rank, WORLD, init_file)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for case in CASES:
            layout, embeddings, order = case
            for patched in (True, False):
                results[case + (patched,)] = run_case(build(embeddings), layout, order, patched,
                                                      mesh, rank)
                gc.collect()
        for case in MIXED:
            layout, embeddings, order = case
            for patched in (True, False):
                results[case + (patched, "bf16")] = run_case(
                    build(embeddings, torch.float32), layout, order, patched, mesh, rank, True)
                gc.collect()
        for case in REFUSED:
            layout, embeddings, order = case
            for patched in (True, False):
                try:
                    run_case(build(embeddings), layout, order, patched, mesh, rank)
                    results[case + (patched,)] = None
                except ValueError as e:
                    results[case + (patched,)] = str(e)
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def one_process(embeddings):
    """Loss per rank's batch and the gradient of their mean, patched, in one process."""
    import ckpt_ext
    model = ckpt_ext.patch_llama(build(embeddings), "balanced")
    losses = []
    for rank in range(WORLD):
        ids, mask, labels = batch(rank)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        (loss / WORLD).backward()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo workers are tested on Linux")
def test_fused_head_under_fsdp2_layouts(tmp_path):
    got = spawn_ranks(_worker, (str(tmp_path / "init"), str(tmp_path)), tmp_path,
                      "FSDP2 fused head")
    refs = {e: one_process(e) for e in ("untied", "tied", "lora")}
    loose, tight = dict(rtol=1e-5, atol=2e-7), dict(rtol=1e-10, atol=1e-13)
    for rank, res in enumerate(got):
        for case in CASES:
            layout, embeddings, order = case
            label = f"rank {rank} {layout} {embeddings} patched {order} fully_shard"
            mine, hf = res[case + (True,)], res[case + (False,)]
            assert mine["calls"] == {"fused": 2, "hf": 0}, (label, mine["calls"])
            # the final norm runs inside the head unless the bare model, the head or the norm
            # is a unit of its own (the norm's hooks make it run as HF's: no pre-norm rows)
            assert mine["norm_in_head"] == {"per_layer_bare": False, "head_unit": False,
                                            "norm_head_unit": None,
                                            "embed_head_unit": False}.get(layout, True), label
            ref_losses, ref_grads = refs[embeddings]
            names = set(ref_grads)
            if embeddings == "lora":
                assert names and all("lora_" in n for n in names), names
            else:
                assert {"lm_head.weight", "model.norm.weight"} & names == (
                    {"model.norm.weight"} if embeddings == "tied" else
                    {"lm_head.weight", "model.norm.weight"})
            # a norm that is an FSDP2 unit has hooks, so it runs as HF's (in float32), not
            # as the one process's fused norm
            one = loose if layout == "norm_head_unit" else tight
            for step in range(2):
                torch.testing.assert_close(mine["losses"][step], hf["losses"][step], **loose,
                                           msg=lambda m: f"{label}, loss vs unpatched: {m}")
                torch.testing.assert_close(mine["losses"][step], ref_losses[rank], **one,
                                           msg=lambda m: f"{label}, loss vs one process: {m}")
                for want, tol, what in ((hf["grads"][step], loose, "unpatched FSDP2"),
                                        (ref_grads, one, "patched, one process")):
                    assert mine["grads"][step].keys() == want.keys(), (label, what)
                    for n, g in want.items():
                        torch.testing.assert_close(
                            mine["grads"][step][n], g, **tol,
                            msg=lambda m, n=n, w=what: f"{label}, {n} vs {w}: {m}")
        # bf16: each layout's loss within test_distributed's bf16 tolerance of the unpatched
        # model's and every gradient within 3e-2 of it in norm (measured: 1.4e-2 at most); the
        # layouts that keep the norm out of the head equal per_layer's bit for bit (one token
        # chunk: the op computes what the norm and the head compute written out)
        first = res[MIXED[0] + (True, "bf16")]
        for case in MIXED:
            mine, hf = res[case + (True, "bf16")], res[case + (False, "bf16")]
            label = f"rank {rank} {case[0]}, bf16 MixedPrecisionPolicy"
            assert mine["calls"] == {"fused": 2, "hf": 0}, (label, mine["calls"])
            for step in range(2):
                torch.testing.assert_close(mine["losses"][step], hf["losses"][step], rtol=2e-2,
                                           atol=2e-2, msg=lambda m: f"{label}: {m}")
                assert mine["grads"][step].keys() == hf["grads"][step].keys()
                for n, g in hf["grads"][step].items():
                    err = ((mine["grads"][step][n] - g).norm() / g.norm()).item()
                    assert err < 3e-2, (label, n, err)
                    torch.testing.assert_close(mine["grads"][step][n], first["grads"][step][n],
                                               rtol=0, atol=0)
                assert mine["losses"][step] == first["losses"][step], label
        for case in REFUSED:
            for patched in (True, False):
                msg = res[case + (patched,)]
                assert msg is not None and "shared with a parameter already managed" in msg, msg
