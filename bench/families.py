"""Saved activation bytes and the step's peak of one tiny model per supported text family
(``ckpt_ext.hf.families.FAMILIES``), unpatched against patched presets, and proof that the
fused op ran: every decoder layer's ``forward.calls["fused"]``; beside them, what a user would
otherwise run: HF gradient checkpointing with the fused loss (no logits).

All models share one shape (hidden 128, 2 layers, 4 heads / 2 KV heads of 32, intermediate
344, vocab 256), fp32, B 2, S 64 with one right-padded row (8 pads). Each family keeps what
makes it itself (Gemma's sandwich norms and GeGLU, OLMo-2's post-norms, Phi-3's fused
projections, SmolLM3's layers without RoPE, ...) at its transformers defaults, with the
windows and multipliers below. The peak is ckpt_ext.peak_memory_bytes of a training step
after a first one. CPU, a minute: python bench/families.py (prints the table in docs/results.md)."""
import argparse
import copy
import os
import sys
import warnings

import torch

import ckpt_ext
from ckpt_ext.hf.families import FAMILIES, MROPE
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import hf_checkpointing  # noqa: E402

warnings.simplefilter("ignore")

SHAPE = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256, use_cache=False,
             pad_token_id=0)
WINDOWED = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
OVERRIDES = {
    "mistral": dict(sliding_window=16), "ministral": WINDOWED, "olmo3": WINDOWED,
    "exaone4": WINDOWED,
    "qwen2": dict(use_sliding_window=False), "smollm3": dict(no_rope_layers=[1, 0]),
    "granite": dict(residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
    "gemma2": dict(WINDOWED, query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(WINDOWED, query_pre_attn_scalar=32),
    "vaultgemma": dict(WINDOWED, query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0),
}
# transformers implements Gemma 2's (and VaultGemma's) soft-capping in eager attention only
IMPL = {"gemma2": "eager", "vaultgemma": "eager"}


def measured(model, ids, mask):
    def loss():
        return model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss().backward()
    return (ckpt_ext.saved_activation_bytes(loss),
            ckpt_ext.peak_memory_bytes(lambda: loss().backward()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=64)
    # the text families (a multimodal model_type runs one of them: gemma3 is gemma3_text),
    # without the M-RoPE language models, which exist only inside Qwen2-VL / Qwen2.5-VL
    ap.add_argument("--families", nargs="*", default=[t for t in FAMILIES if t not in MROPE])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, SHAPE["vocab_size"], (2, args.seq), generator=g)
    mask = torch.ones(2, args.seq, dtype=torch.long)
    mask[0, -8:] = 0  # right padding, as training batches are padded
    print(f"B 2, S {args.seq}, fp32; saved bytes / step peak bytes; fused = layers x calls that "
          "ran the fused op in the patched steps\n")
    print("| family | unpatched | HF checkpointing + fused loss | balanced | min_memory | "
          "min_memory saved / unpatched | min_memory peak / HF ckpt + fused | fused |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families:
        cfg = AutoConfig.for_model(family, **{**SHAPE, **OVERRIDES.get(family, {})})
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(cfg, attn_implementation=IMPL.get(family, "sdpa"))
        cells, fused = [measured(base, ids, mask)], []
        # what a user would otherwise run: HF's checkpointing, the layers unpatched, and the
        # loss without logits (policy "none" leaves every layer HF's, the head fused)
        gc = copy.deepcopy(base)
        hf_checkpointing(gc)
        cells.append(measured(ckpt_ext.patch_llama(gc, "none"), ids, mask))
        for preset in ("balanced", "min_memory"):
            model = ckpt_ext.patch_llama(copy.deepcopy(base), preset)
            cells.append(measured(model, ids, mask))
            fused.append(sum(layer.forward.calls["fused"] for layer in model.model.layers))
        row = " | ".join(f"{s:,} / {p:,}" for s, p in cells)
        print(f"| {family} | {row} | {cells[3][0] / cells[0][0]:.3f} | "
              f"{cells[3][1] / cells[1][1]:.3f} | {'/'.join(map(str, fused))} |")


if __name__ == "__main__":
    main()
