"""The plan's longest sequences with ``min_memory`` in segments of several layers
(``python -m ckpt_ext.plan --segment-layers K|auto``): LLaMA-3.1-8B LoRA and QLoRA (nf4 with
double quantization), B 1, bf16, 80 GiB GPUs with the plan's headroom, offload into the host
memory given per GPU, on one GPU and under sequence parallelism over 8. Per case the longest S
with one layer a segment (today's step), and the longest over every K with the smallest K that
reaches it, each with its step time estimate at the plan's H100 rates. A model of the engine
(``ckpt_ext.plan``), not a measurement: it needs no GPU.

    python bench/plan_segments.py --out bench/results/plan_segments.txt

The cases name their host memory (``--host-memory`` is not read). The output: provenance
lines, then a Markdown table (docs/offload.md quotes it whole).
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _harness import plan_arguments, write_plan_result  # noqa: E402

from ckpt_ext import plan  # noqa: E402

V = 128256
LAYERS = [plan.LayerDims(4096, 32, 8, 128, 14336)] * 32
# (weights, GPUs, host memory per GPU or None for none, offload)
CASES = [("lora", 1, "128GiB", True), ("lora", 1, "256GiB", True), ("lora", 1, None, True),
         ("lora", 8, "128GiB", True), ("lora", 8, "256GiB", True),
         ("qlora", 1, "128GiB", True), ("qlora", 1, None, False)]


def _seconds(weights, N, S, k) -> float:
    kw = dict(train_weights=False, lora_rank=plan.LORA_RANK, segment_layers=k)
    if N == 1:
        return plan.step_time_estimate("min_memory", LAYERS, V, 1, S, **kw)
    return sum(plan.sp_step_time("min_memory", LAYERS, V, 1, S, N, "bf16", **kw))


def _longest(weights, N, device, host, offload, k) -> int:
    kw = dict(headroom=plan.headroom_bytes(device), segment_layers=k)
    if N > 1:
        return plan.sp_longest_sequence("min_memory", LAYERS, V, 1, N, "bf16", device, weights,
                                        offload=offload, host_memory=host, **kw)
    if offload:
        return plan.longest_sequence_offload("min_memory", LAYERS, V, 1, "bf16", device, host,
                                             weights, **kw)
    return plan.longest_sequence("min_memory", LAYERS, V, 1, "bf16", device, weights, **kw)


def main(argv=None) -> int:
    ap = plan_arguments(__doc__, "bench/results/plan_segments.txt")
    a = ap.parse_args(argv)
    device = plan.parse_bytes(a.device_memory)
    lines = ["| weights | GPUs | host per GPU | K = 1: longest S | its step s | segments: "
             "longest S | K | its step s | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for weights, N, host_text, offload in CASES:
        host = plan.parse_bytes(host_text) if host_text else None
        one = _longest(weights, N, device, host, offload, 1)
        n, k = plan.longest_sequence_segments(
            LAYERS, V, 1, "bf16", device, weights, offload=offload, host_memory=host,
            sequence_parallel=N, headroom=plan.headroom_bytes(device))
        secs = _seconds(weights, N, n, k)
        where = (host_text if host_text else "no cap") if offload else "no offload"
        lines.append(f"| {'QLoRA nf4' if weights == 'qlora' else 'LoRA'} | {N} | {where} | "
                     f"{one:,} | {_seconds(weights, N, one, 1):,.0f} | {n:,} | {k} | "
                     f"{secs:,.0f} | {n / secs:,.0f} |")
    write_plan_result(a.out, f"LLaMA-3.1-8B, LoRA rank {plan.LORA_RANK} on every projection "
                      f"(QLoRA: nf4, double quantization), B 1, bf16, min_memory, "
                      f"{a.device_memory} per GPU (plan headroom 1 GiB + 5%), offload into the "
                      f"host memory given per GPU, sequence parallelism's all-to-all at "
                      f"{plan.SP_LINK_GBYTES_PER_S:g} GB/s, rates: the plan's H100 rates", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
