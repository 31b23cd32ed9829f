"""The plan's figures under sequence parallelism (``python -m ckpt_ext.plan --sequence-parallel
N``) for N = 1, 2, 4, 8 GPUs: per GPU, per fused preset with offload (and ``min_memory`` in
segments of K layers, ``--segment-layers``, at the K that reaches furthest when it is not 1), the
longest sequence and at it the saved bytes, the device peak, the host bytes, the all-to-all
bytes per layer and the step time. A model of the engine (``ckpt_ext.plan``), not a measurement: it needs no GPU.

Defaults: LLaMA-3.1-8B LoRA (bf16 base), B 1, 80 GiB devices with the plan's default headroom,
192 GiB of host memory per GPU, the plan's H100 rates (``--throughputs FILE`` for others) and
the all-to-all at ``--link-gbytes-per-s`` (default the plan's NVLink-class assumption).

    python bench/plan_sequence_parallel.py --out bench/results/plan_sequence_parallel.txt

The output: provenance lines, then a Markdown table (docs/distributed.md quotes it whole).
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _harness import plan_arguments, write_plan_result  # noqa: E402

from ckpt_ext import plan, plan_cli  # noqa: E402

LLAMA31_8B = ["--hidden-size", "4096", "--heads", "32", "--kv-heads", "8",
              "--intermediate-size", "14336", "--layers", "32", "--vocab-size", "128256"]


def main(argv=None) -> int:
    ap = plan_arguments(__doc__, "bench/results/plan_sequence_parallel.txt", "192GiB")
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--link-gbytes-per-s", default=str(plan.SP_LINK_GBYTES_PER_S))
    ap.add_argument("--throughputs", default=None)
    a = ap.parse_args(argv)
    cli = LLAMA31_8B + ["--batch", "1", "--seq", "8", "--weights", "lora", "--offload",
                        "--device-memory", a.device_memory, "--host-memory", a.host_memory,
                        "--link-gbytes-per-s", a.link_gbytes_per_s]
    if a.throughputs:
        cli += ["--throughputs", a.throughputs]
    args = plan_cli._parser().parse_args(cli)
    for name in ("device_memory", "host_memory", "cuda_context"):
        setattr(args, name, plan.parse_bytes(getattr(args, name)))
    args.rates = (plan_cli.load_throughputs(args.throughputs) if args.throughputs
                  else plan_cli.default_throughputs())
    layers = [plan.LayerDims(4096, 32, 8, 128, 14336)] * 32
    lines = ["| GPUs | setup | longest S | per GPU tokens | saved per GPU | device peak | "
             "host per GPU | all-to-all fwd / bwd per layer | step s (all-to-all s) | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for N in (int(x) for x in a.gpus.split(",")):
        for setup in ("balanced", "min_memory"):
            # the longest S first (at a placeholder S), then every figure at it
            row = next(r for r in plan_cli.sequence_parallel_rows(args, layers, 128256, 1, 8 * N,
                                                                  plan._dtype("bf16"), N)
                       if r["setup"] == setup + " + offload")
            S = row["longest"]
            r = next(r for r in plan_cli.sequence_parallel_rows(args, layers, 128256, 1, S,
                                                                plan._dtype("bf16"), N)
                     if r["setup"] == setup + " + offload")
            assert r["fits"], (N, setup, S)
            lines.append(
                f"| {N} | `{setup}` + offload | {S:,} | {S // N:,} | "
                f"{plan.format_bytes(r['saved'])} | {plan.format_bytes(r['peak'])} | "
                f"{plan.format_bytes(r['host'])} | {plan.format_bytes(r['a2a_fwd'])} / "
                f"{plan.format_bytes(r['a2a_bwd'])} | {r['step_s']:,.0f} ({r['a2a_s']:,.1f}) | "
                f"{r['tokens_per_s']:,.0f} |")
        # min_memory in segments of K layers (issue 58): the K that reaches furthest
        S, k = plan.longest_sequence_segments(
            layers, 128256, 1, "bf16", args.device_memory, "lora",
            host_memory=args.host_memory, sequence_parallel=N,
            headroom=plan.headroom_bytes(args.device_memory))
        if k > 1:
            args.segments = k
            name = f"min_memory in {k}-layer segments + offload"
            r = next(r for r in plan_cli.sequence_parallel_rows(args, layers, 128256, 1, S,
                                                                plan._dtype("bf16"), N)
                     if r["setup"] == name)
            assert r["fits"], (N, name, S)
            lines.append(
                f"| {N} | `min_memory` in {k}-layer segments + offload | {S:,} | {S // N:,} | "
                f"{plan.format_bytes(r['saved'])} | {plan.format_bytes(r['peak'])} | "
                f"{plan.format_bytes(r['host'])} | {plan.format_bytes(r['a2a_fwd'])} / "
                f"{plan.format_bytes(r['a2a_bwd'])} | {r['step_s']:,.0f} ({r['a2a_s']:,.1f}) | "
                f"{r['tokens_per_s']:,.0f} |")
            args.segments = 1
    # the target: 8M tokens on 8 GPUs, min_memory + offload, what stands in the way
    S8, n8 = 8 << 20, 8
    p = plan.sp_step_peak("min_memory", layers, 128256, 1, S8, n8, "bf16", train_weights=False,
                          offload=True, host_limit=args.host_memory)
    room = (args.device_memory - plan.headroom_bytes(args.device_memory)
            - plan.model_state_bytes(layers, 128256, "bf16", "lora"))
    lines.append(f"at S {S8:,} on {n8} GPUs, min_memory + offload, per GPU: peak "
                 f"{p.peak / 2**30:.2f} GiB against {room / 2**30:.2f} GiB left for the step; "
                 f"a query chunk's exchanged copies {p.round / 2**30:.2f} GiB, whole tensors "
                 f"{p.whole / 2**30:.2f} GiB, "
                 f"kept on device {p.kept / 2**30:.2f} GiB, host {p.host / 2**30:.2f} GiB")
    write_plan_result(a.out, f"LLaMA-3.1-8B LoRA, B 1, bf16, {a.device_memory} per GPU (plan "
                      f"headroom: 1 GiB + 5%), host {a.host_memory} per GPU, offload, all-to-all "
                      f"at {a.link_gbytes_per_s} GB/s, rates: {args.rates.source}", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
