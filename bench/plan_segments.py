"""The plan's longest sequences with ``min_memory`` in segments of several layers
(``python -m ckpt_ext.plan --segment-layers K|auto``): LLaMA-3.1-8B LoRA and QLoRA (nf4 with
double quantization), B 1, bf16, 80 GiB GPUs with the plan's headroom, offload into the host
memory given per GPU, on one GPU and under sequence parallelism over 8. Per case the longest S
with one layer a segment (today's step), and the longest over every K with the smallest K that
reaches it, each with its step time estimate at the plan's H100 rates; on one GPU with offload,
the same with streamed inputs (``--offload-stream``: ``offload_step_peak(..., stream=True)``),
its step time with the copies serialized with compute at the plan's host link rate. A model of
the engine (``ckpt_ext.plan``), not a measurement: it needs no GPU.

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
             "longest S | K | its step s | tokens/s | streamed: longest S | K | its step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for weights, N, host_text, offload in CASES:
        host = plan.parse_bytes(host_text) if host_text else None
        one = _longest(weights, N, device, host, offload, 1)
        n, k = plan.longest_sequence_segments(
            LAYERS, V, 1, "bf16", device, weights, offload=offload, host_memory=host,
            sequence_parallel=N, headroom=plan.headroom_bytes(device))
        secs = _seconds(weights, N, n, k)
        where = (host_text if host_text else "no cap") if offload else "no offload"
        streamed = "- | - | -"
        if offload and N == 1:
            ns, ks = plan.longest_sequence_segments(
                LAYERS, V, 1, "bf16", device, weights, offload=True, host_memory=host,
                headroom=plan.headroom_bytes(device), stream=True)
            copied = plan.stream_copy_bytes(LAYERS, 1, ns, "bf16", ks, host)
            copy_s = copied / (plan.HOST_LINK_GBYTES_PER_S * 1e9)
            secs_s = _seconds(weights, N, ns, ks) + copy_s
            streamed = f"{ns:,} | {ks} | {secs_s:,.0f}"
            notes.append(f"streamed copies, {weights} {host_text or 'no cap'}: "
                         f"{copied / 2**30:,.0f} GiB serialized with compute a step at S "
                         f"{ns:,}, {copy_s:,.1f} s of its {secs_s:,.0f} s "
                         f"({copy_s / secs_s:.2%})")
        lines.append(f"| {'QLoRA nf4' if weights == 'qlora' else 'LoRA'} | {N} | {where} | "
                     f"{one:,} | {_seconds(weights, N, one, 1):,.0f} | {n:,} | {k} | "
                     f"{secs:,.0f} | {n / secs:,.0f} | {streamed} |")
    write_plan_result(a.out, f"LLaMA-3.1-8B, LoRA rank {plan.LORA_RANK} on every projection "
                      f"(QLoRA: nf4, double quantization), B 1, bf16, min_memory, "
                      f"{a.device_memory} per GPU (plan headroom 1 GiB + 5%), offload into the "
                      f"host memory given per GPU, sequence parallelism's all-to-all at "
                      f"{plan.SP_LINK_GBYTES_PER_S:g} GB/s, streamed inputs' copies at "
                      f"{plan.HOST_LINK_GBYTES_PER_S:g} GB/s, rates: the plan's H100 rates",
                      lines + notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
