"""The plan's figures for a mixture-of-experts model (``python -m ckpt_ext.plan`` on an MoE
config): Qwen3-30B-A3B (H 2048, 48 layers, 32/4 heads, head_dim 128, 128 experts of I 768,
top-k 8, V 151936), LoRA on the attention over a bf16 base, ``output_router_logits=False``,
B 1, one 80 GiB GPU, offload with 256 GiB of host memory: per fused preset, the longest
sequence with the plan's headroom (the CUDA context, 1 GiB, and 5% for the allocator's
fragmentation) and with the CUDA context alone, without and with LoRA r 16 on the routed
experts (PEFT's ``target_parameters``: the factors the fused op is given, their state bytes).
Then, with ``output_router_logits=True`` (HF's load-balancing loss) and no expert LoRA, the
longest sequence per fused preset with the plan's headroom when every MoE layer keeps its
(tokens, experts) logits and HF's softmax of them (``router_aux_loss="exact"``) and when it
keeps only its (3, experts) statistics (``"fused"``). A model of the engine
(``ckpt_ext.plan``), not a measurement: it needs no GPU.

    python bench/plan_moe.py --out bench/results/plan_moe.txt

The output: provenance lines, then a Markdown table (docs/hf.md quotes it).
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _harness import plan_arguments, write_plan_result  # noqa: E402

from ckpt_ext import plan  # noqa: E402
from ckpt_ext.hf.families import layer_dims_from_config  # noqa: E402

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "vocab_size": 151936,
                 "output_router_logits": False}


def main(argv=None) -> int:
    a = plan_arguments(__doc__, "bench/results/plan_moe.txt").parse_args(argv)
    memory, host = plan.parse_bytes(a.device_memory), plan.parse_bytes(a.host_memory)
    layers = layer_dims_from_config(QWEN3_30B_A3B)
    V, dt = QWEN3_30B_A3B["vocab_size"], "bf16"
    headrooms = (("plan headroom", plan.headroom_bytes(memory)),
                 ("CUDA context only", plan.headroom_bytes(memory, fragmentation=0.0)))
    lines = ["| expert LoRA | model state | headroom | setup | longest S | device peak | "
             "host bytes |", "|---|---|---|---|---|---|---|"]
    for rank in (0, 16):
        state = plan.model_state_bytes(layers, V, dt, "lora", expert_lora_rank=rank)
        for name, headroom in headrooms:
            for setup in plan.OFFLOAD_SETUPS:
                S = plan.longest_sequence_offload(setup, layers, V, 1, dt, memory, host, "lora",
                                                  headroom=headroom, expert_lora_rank=rank)
                p = plan.offload_step_peak(setup, layers, V, 1, max(S, 1), dt,
                                           train_weights=False, host_limit=host)
                assert state + p.peak + headroom <= memory, (rank, name, setup, S)
                lines.append(f"| {'r ' + str(rank) if rank else 'none'} | "
                             f"{plan.format_bytes(state)} | {name} | `{setup}` + offload | "
                             f"{S:,} | {plan.format_bytes(p.peak)} | "
                             f"{plan.format_bytes(p.host)} |")
    lines += ["", ("| router aux loss | setup | longest S | device peak | host bytes | kept for "
                   "the loss at that S |"), "|---|---|---|---|---|---|"]
    state = plan.model_state_bytes(layers, V, dt, "lora")
    headroom = plan.headroom_bytes(memory)
    for mode in ("exact", "fused"):
        aux = [dataclasses.replace(x, router_logits=True, router_aux_loss=mode) for x in layers]
        for setup in plan.OFFLOAD_SETUPS:
            S = plan.longest_sequence_offload(setup, aux, V, 1, dt, memory, host, "lora",
                                              headroom=headroom)
            p = plan.offload_step_peak(setup, aux, V, 1, max(S, 1), dt, train_weights=False,
                                       host_limit=host)
            assert state + p.peak + headroom <= memory, (mode, setup, S)
            kept = plan.router_logits_bytes(aux, max(S, 1), dt)
            lines.append(f"| {mode} | `{setup}` + offload | {S:,} | "
                         f"{plan.format_bytes(p.peak)} | {plan.format_bytes(p.host)} | "
                         f"{plan.format_bytes(kept)} |")
    write_plan_result(a.out, f"Qwen3-30B-A3B, LoRA r 16 on the attention (bf16 base), "
                      f"output_router_logits=False (then True: exact and fused aux loss), B 1, "
                      f"bf16, {a.device_memory} device, host {a.host_memory}, offload (cuda "
                      f"path)", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
