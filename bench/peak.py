"""Peak memory per token of one training step, per setup, on an HF Llama built from a config.

The question a user asks first: does a step fit? ``ckpt_ext.peak_memory_bytes`` of one
forward+backward step (labels = input ids), above what is allocated before it: the weights,
the ids and the gradients of the untimed warm-up step before it, which this step adds to in
place, as every step after a training run's first does. Beside it, the bytes the forward
leaves saved and ``ckpt_ext.plan.step_peak``'s model of the peak. Defaults: H 512, I 1792, 8/2 heads,
vocab 16384, 4 layers, B 1, S 4096, fp32, SDPA, on the CPU (the profiler's memory events) or
CUDA (allocator statistics) as ``--device`` says. Setups (``--setups``):

* ``hf_gc``: HF gradient checkpointing (``use_reentrant=False``) with HF's head and loss;
* ``torch+fused``: the same checkpointing, with ckpt_ext's fused LM-head loss only
  (``patch_llama(model, policy="torch")``);
* ``<preset>+fused``: ``patch_llama(model, policy=<preset>)`` (fused layers and loss);
* ``<preset>+hf_head``: ``patch_llama(model, policy=<preset>, fuse_lm_head=False)``;
* a ``lora:`` prefix wraps the model in PEFT LoRA first (r 16, alpha 32, no dropout, every
  projection; base and head frozen).

Prints one line per setup: peak MiB and KiB per token, the model's peak and its ratio to the
measured one, saved MiB.

    python bench/peak.py [--seq 4096] [--setups hf_gc min_memory+fused lora:min_memory+fused]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import ckpt_ext
from ckpt_ext import plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import hf_checkpointing  # noqa: E402

PRESETS = ("torch", "fast", "balanced", "min_memory")
# (preset, fused head) -> the setup name of ckpt_ext.plan.step_peak
PLAN_SETUPS = {(None, False): "hf_gc", ("torch", True): "hf_gc+fused", ("fast", True): "fast",
               ("balanced", True): "balanced", ("min_memory", True): "min_memory"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def setup_kind(text: str):
    """(lora, preset or None, fused head) of a setup name; ValueError naming it if unknown."""
    lora, _, rest = text.rpartition(":")
    if lora not in ("", "lora"):
        raise ValueError(f"unknown prefix {lora!r} in setup {text!r} (only 'lora:')")
    if rest == "hf_gc":
        return bool(lora), None, False
    preset, _, head = rest.partition("+")
    if preset not in PRESETS or head not in ("fused", "hf_head"):
        raise ValueError(f"setup {text!r}: expected hf_gc or <preset>+fused / <preset>+hf_head "
                         f"with a preset of {PRESETS}, optionally prefixed with 'lora:'")
    return bool(lora), preset, head == "fused"


def build(args, setup: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    lora, preset, fused = setup_kind(setup)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      rms_norm_eps=1e-5, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                 dtype=DTYPES[args.dtype]).train()
    if preset in (None, "torch"):
        hf_checkpointing(model)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    if preset is not None:
        ckpt_ext.patch_llama(model, policy=preset, fuse_lm_head=fused)
    return model


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags of the model ``build`` makes (and its device and dtype), with this bench's
    defaults; the other benches of a whole model take the same."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    for name, default in (("layers", 4), ("hidden", 512), ("intermediate", 1792), ("heads", 8),
                          ("kv-heads", 2), ("vocab", 16384)):
        p.add_argument(f"--{name}", type=int, default=default)


def step(model, ids):
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", default=[
        "hf_gc", "min_memory+hf_head", "torch+fused", "fast+fused", "balanced+fused",
        "min_memory+fused", "lora:hf_gc", "lora:torch+fused", "lora:min_memory+fused"])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    add_model_args(p)
    args = p.parse_args(argv)
    for s in args.setups:
        try:
            setup_kind(s)
        except ValueError as exc:
            p.error(f"--setups: {exc}")
    if args.seq < 2 or args.batch < 1:
        p.error(f"--seq must be >= 2 and --batch >= 1, got {args.seq} and {args.batch}")
    tokens = args.batch * args.seq
    print(f"H {args.hidden}, I {args.intermediate}, {args.heads}/{args.kv_heads} heads, vocab "
          f"{args.vocab}, {args.layers} layers, B {args.batch}, S {args.seq}, {args.dtype}, "
          f"{args.device}")
    out = {}
    dims = [plan.LayerDims(args.hidden, args.heads, args.kv_heads, args.hidden // args.heads,
                           args.intermediate)] * args.layers
    for setup in args.setups:
        model = build(args, setup)
        ids = torch.randint(args.vocab, (args.batch, args.seq), device=args.device)
        step(model, ids)                                   # warm-up: the gradients now exist
        saved = ckpt_ext.saved_activation_bytes(
            lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
        t0 = time.perf_counter()
        peak = ckpt_ext.peak_memory_bytes(step, model, ids)
        out[setup] = peak
        lora, preset, fused = setup_kind(setup)
        modelled = ""
        kind = PLAN_SETUPS.get((preset, fused))
        if kind is not None:
            m = plan.step_peak(kind, dims, args.vocab, args.batch, args.seq, DTYPES[args.dtype],
                               path="cuda" if args.device.startswith("cuda") else "cpu",
                               train_weights=not lora).peak
            modelled = f"  model {m / 2**20:9.1f} MiB ({m / peak:.3f}x)"
        print(f"{setup:<26} peak {peak / 2**20:9.1f} MiB  {peak / tokens / 1024:7.1f} KiB/token"
              f"{modelled}  saved {saved / 2**20:8.1f} MiB  (measured step "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        del model
    return out


if __name__ == "__main__":
    main()
