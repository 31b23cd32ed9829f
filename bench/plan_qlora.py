"""The plan's QLoRA figures (``python -m ckpt_ext.plan --weights qlora``): LLaMA-3.1-8B on a 24 GB
and an 80 GB GPU and LLaMA-3.1-70B on an 80 GB GPU, nf4 with double quantization, B 1, bf16
activations: the model state, and per setup the longest sequence that fits, without offload and
with ``offload="cpu"`` into the host memory given, and ``min_memory`` in segments of K layers
(``--segment-layers``) at the K that reaches furthest. A model of the engine
(``ckpt_ext.plan``), not a measurement: it needs no GPU.

    python bench/plan_qlora.py --out bench/results/plan_qlora.txt

The output: provenance lines, then a Markdown table (docs/hf.md quotes it whole).
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _harness import plan_arguments, write_plan_result  # noqa: E402

from ckpt_ext import plan  # noqa: E402

V = 128256
MODELS = {"LLaMA-3.1-8B": [plan.LayerDims(4096, 32, 8, 128, 14336)] * 32,
          "LLaMA-3.1-70B": [plan.LayerDims(8192, 64, 8, 128, 28672)] * 80}
CASES = [("LLaMA-3.1-8B", "24GiB"), ("LLaMA-3.1-8B", "80GiB"), ("LLaMA-3.1-70B", "80GiB")]
SETUPS = [("HF checkpointing, fused loss", "hf_gc+fused", False), ("`balanced`", "balanced", False),
          ("`min_memory`", "min_memory", False), ("`balanced` + offload", "balanced", True),
          ("`min_memory` + offload", "min_memory", True)]


def main(argv=None) -> int:
    ap = plan_arguments(__doc__, "bench/results/plan_qlora.txt", "128GiB")
    ap.add_argument("--quant", default="nf4", choices=plan.QUANTS)
    a = ap.parse_args(argv)
    host = plan.parse_bytes(a.host_memory)
    lines = ["| model | GPU | model state | setup | longest S |", "|---|---|---|---|---|"]
    for name, memory in CASES:
        layers, device = MODELS[name], plan.parse_bytes(memory)
        headroom = plan.headroom_bytes(device)
        state = plan.model_state_bytes(layers, V, "bf16", "qlora", quant=a.quant)
        for words, setup, offload in SETUPS:
            kw = dict(headroom=headroom, quant=a.quant)
            n = (plan.longest_sequence_offload(setup, layers, V, 1, "bf16", device, host,
                                               "qlora", **kw) if offload else
                 plan.longest_sequence(setup, layers, V, 1, "bf16", device, "qlora", **kw))
            lines.append(f"| {name} | {memory} | {plan.format_bytes(state)} | {words} | "
                         f"{n:,} |")
        for offload in (False, True):   # min_memory in segments: the best K (issue 58)
            n, k = plan.longest_sequence_segments(layers, V, 1, "bf16", device, "qlora",
                                                  offload=offload, host_memory=host,
                                                  headroom=headroom, quant=a.quant)
            seg = f"in {k}-layer segments" if k > 1 else "in segments (K 1 reaches furthest)"
            lines.append(f"| {name} | {memory} | {plan.format_bytes(state)} | `min_memory` {seg}"
                         f"{' + offload' if offload else ''} | {n:,} |")
    write_plan_result(a.out, f"QLoRA {a.quant} with double quantization, LoRA rank "
                      f"{plan.LORA_RANK} on every projection, B 1, bf16 activations, plan "
                      f"headroom 1 GiB + 5%, host {a.host_memory} for offload", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
