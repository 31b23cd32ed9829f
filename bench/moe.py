"""Mixture-of-experts layers: the step peak and time of the fused MoE layer beside HF's.

Default (CPU, fp32): a Qwen3-MoE-shaped tiny model (64 experts, top-k 8, H 256, expert I 128,
4 heads / 2 KV heads of 64, 2 layers, vocab 2048), one sequence of S 4096. Rows, on the same
weights and batch:

* ``hf_gc``: transformers' model with HF gradient checkpointing
  (``activation_checkpointing_enable()``, its defaults) and its default experts implementation,
  the loss through ckpt_ext's fused LM head (``patch_llama(model, "none")``);
* ``fast`` / ``balanced`` / ``min_memory``: ``patch_llama(model, preset)`` (fused layers and
  fused head).

Per row: the step peak (``ckpt_ext.peak_memory_bytes`` of one forward+backward, gradients
cleared before), the median step time of ``--reps`` steps, the loss's and the largest
gradient's difference from ``hf_gc``. Goal (issue 43): ``min_memory``'s peak at most 0.5x
``hf_gc``'s, printed ``[ok]`` / ``[MISSED]``.

``--layer`` (CUDA): one Qwen3-30B-A3B decoder layer (128 experts, top-k 8, H 2048, expert I
768, 32 heads / 4 KV heads of 128; ``--layer-shape``) at ``--tokens`` (32768) in bf16,
forward+backward: HF's ``Qwen3MoeDecoderLayer`` (its default experts implementation) against
the fused op per preset, on the same weights: time, peak and the largest relative difference
of the output, dx and the router's gradient from HF's (Liger's fused MoE: 28.2 ms, 8.26 GB on
an H100). ``--device cpu`` runs the same code in fp32 at a small ``--layer-shape`` (the GPU
call's dry run).

``--expert-lora-rank r``: every row with PEFT LoRA (rank r, alpha 2r) on the attention and on
both expert weights (``target_parameters``), the base frozen: HF's row folds the experts'
adapters into their weights inside PEFT's forward, the fused rows give the op the factors.
Written to ``moe_expert_lora_<device>.csv``. With ``--layer`` the same adapters go on the one
layer (``peft.inject_adapter_in_model``, factors drawn with std 0.02); the rows compare the
output, dx and every adapter's gradient with HF's (the router is frozen), written to
``moe_layer_expert_lora_<device>.csv``.

Writes ``bench/results/moe_<device>.csv`` (or ``moe_layer_<device>.csv``).

    python bench/moe.py [--seq 4096] [--reps 3] [--expert-lora-rank 16]
    python bench/moe.py --layer [--tokens 32768] [--expert-lora-rank 16]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

import ckpt_ext
from ckpt_ext import blocks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (device_name, device_tag, hf_checkpointing, median, provenance,  # noqa: E402
                      write_csv)

PRESETS = ("fast", "balanced", "min_memory")


def tiny_qwen3_moe(args):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_i,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        vocab_size=args.vocab, max_position_embeddings=max(args.seq, 4096), pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():  # off the init: routers that pick different experts per token
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.train()


def with_expert_lora(model, rank):
    """The model under PEFT LoRA of rank ``rank`` on the attention and the expert weights."""
    import peft
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          target_parameters=["mlp.experts.gate_up_proj",
                                             "mlp.experts.down_proj"])
    torch.manual_seed(2)
    return peft.get_peft_model(model, cfg).train()


def model_rows(args) -> list:
    base = tiny_qwen3_moe(args)
    if args.expert_lora_rank:
        base = with_expert_lora(base, args.expert_lora_rank)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.seq), generator=g)

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    rows, ref = [], None
    for name in ("hf_gc", *PRESETS):
        model = copy.deepcopy(base)
        if name == "hf_gc":
            hf_checkpointing(model, use_reentrant=None)
            ckpt_ext.patch_llama(model, "none")  # HF's layers, the fused loss
        else:
            ckpt_ext.patch_llama(model, name)
        loss = step(model)  # warm-up; its gradients are the row's
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        peak = ckpt_ext.peak_memory_bytes(step, model)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            step(model)
            times.append(time.perf_counter() - t0)
        if ref is None:
            ref = (loss, grads)
        grad_diff = max((grads[n] - ref[1][n]).abs().max().item() for n in ref[1])
        rows.append({"row": name, "seq": args.seq, "peak_mib": peak / 2**20,
                     "step_s": median(times), "loss": loss.item(),
                     "loss_diff": abs(loss.item() - ref[0].item()), "max_grad_diff": grad_diff})
        print(f"{name:>10}: peak {peak / 2**20:9.1f} MiB  step {median(times):7.3f} s  "
              f"loss {loss.item():.6f}  max |dgrad| {grad_diff:.2e}", flush=True)
        del model
    return rows


LAYER_SHAPE = "2048,128,8,768,32,4,128"  # Qwen3-30B-A3B: H, E, top-k, expert I, Hq, Hkv, D
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def layer_lora(layer, rank):
    """PEFT LoRA of rank ``rank`` (alpha 2 rank) on ``layer``'s attention and both expert
    weights, the base frozen, the factors drawn with std 0.02 (seeded): (the layer, the op's
    factor slots, its ``lora_scaling`` and ``expert_lora_scaling``)."""
    import peft

    from ckpt_ext.hf.families import expert_wrappers
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                          target_modules=list(ATTENTION),
                          target_parameters=["mlp.experts.gate_up_proj",
                                             "mlp.experts.down_proj"])
    layer = peft.inject_adapter_in_model(cfg, layer)
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if ".lora_" in n:
                p.normal_(0, 0.02)
    slots, scaling = {}, dict.fromkeys(blocks.PROJECTIONS, 0.0)
    for name in ATTENTION:
        proj = getattr(layer.self_attn, name)
        slots[f"self_attn.{name}.lora_A"] = proj.lora_A["default"].weight
        slots[f"self_attn.{name}.lora_B"] = proj.lora_B["default"].weight
        scaling[f"self_attn.{name}"] = float(proj.scaling["default"])
    expert_scaling = {}
    for w in expert_wrappers(layer.mlp.experts)[1]:
        slots[f"mlp.experts.{w.parameter_name}.lora_A"] = w.lora_A["default"].weight
        slots[f"mlp.experts.{w.parameter_name}.lora_B"] = w.lora_B["default"].weight
        expert_scaling[w.parameter_name] = float(w.scaling["default"])
    return (layer, slots, [scaling[p] for p in blocks.PROJECTIONS],
            [expert_scaling["gate_up_proj"], expert_scaling["down_proj"]])


def layer_rows(args) -> list:
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeDecoderLayer,
                                                                  Qwen3MoeRotaryEmbedding)
    H, E, K, I, HQ, HKV, D = (int(v) for v in args.layer_shape.split(","))
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=H, num_attention_heads=HQ, num_key_value_heads=HKV,
        head_dim=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=True, num_hidden_layers=1, max_position_embeddings=args.tokens)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen3MoeDecoderLayer(cfg, 0).to(dev, dt).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    x = torch.randn(1, args.tokens, H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    pos = torch.arange(args.tokens, device=dev)[None]
    cos, sin = Qwen3MoeRotaryEmbedding(cfg).to(dev)(x, pos)
    weights = dict(layer.named_parameters())  # the slots' names, before any PEFT wrapper
    lora = {}
    if args.expert_lora_rank:
        layer, slots, scaling, expert_scaling = layer_lora(layer, args.expert_lora_rank)
        weights.update(slots)
        lora = {"lora_scaling": scaling, "expert_lora_scaling": expert_scaling}
    # compared with HF's: the output, dx and the router's gradient, or with LoRA (the router
    # frozen) every adapter's
    trained = [p for p in layer.parameters() if p.requires_grad] if lora else \
        [weights["mlp.gate.weight"]]

    def hf():
        return layer(x, position_embeddings=(cos, sin), attention_mask=None)

    def fused(preset):
        return lambda: blocks.decoder_layer(x, blocks.LayerOptions(
            weights=weights, cos=cos, sin=sin, num_heads=HQ, num_kv_heads=HKV,
            eps=cfg.rms_norm_eps, num_experts_per_tok=K, norm_topk_prob=True, preset=preset,
            **lora))

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows, ref = [], None
    for name, fn in [("hf", hf)] + [(p, fused(p)) for p in PRESETS]:
        def step(fn=fn):
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dy)
            return out

        for _ in range(2):
            step()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = step()  # the row's output and gradients beside HF's (a routing tie may differ)
        got = (out.detach().float(), x.grad.float(), *(p.grad.float() for p in trained))
        ref = got if ref is None else ref
        err = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
                  for a, b in zip(got, ref))
        layer.zero_grad(set_to_none=True)
        x.grad = None
        peak = ckpt_ext.peak_memory_bytes(lambda _x: step(), x)  # x names the device
        times = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        rows.append({"row": name, "seq": args.tokens, "peak_mib": peak / 2**20,
                     "step_s": median(times), "rel_err_vs_hf": err})
        print(f"{name:>10}: peak {peak / 2**20:9.1f} MiB  fwd+bwd {1e3 * median(times):8.2f} ms  "
              f"max rel err vs hf (y, dx, d {'adapters' if lora else 'router'}) {err:.2e}",
              flush=True)
    best = min(rows[1:], key=lambda r: r["step_s"])
    gb = lambda r: r["peak_mib"] * 2**20 / 1e9  # noqa: E731 - decimal GB, as Liger reports
    print(f"goal (Liger's fused MoE on an H100: 28.2 ms, 8.26 GB): fastest fused {best['row']} "
          f"{1e3 * best['step_s']:.2f} ms, peak {gb(best):.2f} GB; hf "
          f"{1e3 * rows[0]['step_s']:.2f} ms, {gb(rows[0]):.2f} GB")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-i", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layer", action="store_true", help="one Qwen3-30B-A3B layer on CUDA")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layer-shape", default=LAYER_SHAPE,
                    help="--layer's H,E,top-k,expert I,Hq,Hkv,D (default Qwen3-30B-A3B's)")
    ap.add_argument("--device", default="cuda",
                    help="--layer's device: cuda (bf16), or cpu (fp32; a dry run of the code)")
    ap.add_argument("--expert-lora-rank", type=int, default=0,
                    help="PEFT LoRA of this rank on the attention and the experts (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.layer:
        if args.device == "cuda" and not torch.cuda.is_available():
            print("--layer needs a CUDA GPU (a Qwen3-30B-A3B layer at 32K tokens), or "
                  "--device cpu for a dry run at a small --layer-shape")
            return 2
        lora = f", LoRA r {args.expert_lora_rank} on attention and experts" \
            if args.expert_lora_rank else ""
        print(f"{device_name()}: one Qwen3-MoE layer, H,E,top-k,I,Hq,Hkv,D = {args.layer_shape}, "
              f"{args.tokens} tokens{lora}")
        rows = layer_rows(args)
        fields = ["row", "seq", "peak_mib", "step_s", "rel_err_vs_hf"]
        name = "moe_layer_expert_lora" if args.expert_lora_rank else "moe_layer"
        out = args.out or os.path.join("bench", "results", f"{name}_{device_tag()}.csv")
        write_csv(out, provenance(args.device if args.device == "cuda" else None), fields, rows)
        return 0
    lora = f", LoRA r {args.expert_lora_rank} on attention and experts" \
        if args.expert_lora_rank else ""
    print(f"{device_name()}: Qwen3-MoE-shaped model, E {args.experts}, top-k {args.top_k}, "
          f"H {args.hidden}, expert I {args.expert_i}, {args.layers} layers, S {args.seq}{lora}")
    rows = model_rows(args)
    by = {r["row"]: r for r in rows}
    ratio = by["min_memory"]["peak_mib"] / by["hf_gc"]["peak_mib"]
    goal = f"min_memory peak / hf_gc peak = {ratio:.3f} (goal <= 0.5)"
    print(("[ok] " if ratio <= 0.5 else "[MISSED] ") + goal)
    fields = ["row", "seq", "peak_mib", "step_s", "loss", "loss_diff", "max_grad_diff"]
    name = "moe_expert_lora" if args.expert_lora_rank else "moe"
    out = args.out or os.path.join("bench", "results", f"{name}_{device_tag()}.csv")
    write_csv(out, provenance(note="CPU: peaks are the allocator's, times not a performance "
                              "figure") + [goal + lora], fields, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
