"""Would an "x, out, lse" preset pay? The plan's what-if, not a measurement (no GPU needed).

``balanced`` saves x, out, lse and h per layer; ``min_memory`` saves x and re-runs the attention
forward in backward. A preset saving x, out and lse (``balanced`` without h) would skip that
attention re-run for one o projection GEMM more than ``balanced`` (h = x + o_proj(out)), at
two thirds of ``balanced``'s bytes. ``auto`` with offload (``plan.choose_presets_offload``)
mixes the presets per layer by time within the device and host memory; this script runs that
same chooser twice at each sequence length: as it is, and with ``balanced`` replaced by the
x, out, lse layer (its bytes and its time: ``balanced``'s less h, plus the o projection's
forward FLOPs at the matmul rate; its working set taken as ``balanced``'s). The step time of
the two choices, side by side, says what the preset would buy: with both available, at least the
better of the two.

LLaMA-3.1-8B, LoRA r 16 on a bf16 base (its state and its GEMMs), B 1, one 80 GiB GPU with
the plan's headroom, offload with ``--host-memory`` of host memory, the plan's H100 rates:

    python bench/plan_out_lse.py --out bench/results/plan_out_lse.txt
"""
from __future__ import annotations

import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _harness import plan_arguments, write_plan_result  # noqa: E402

from ckpt_ext import plan  # noqa: E402
from ckpt_ext.layer_record import LayerDims  # noqa: E402

LLAMA31_8B = LayerDims(4096, 32, 8, 128, 14336)
LAYERS, VOCAB = 32, 128256


@contextlib.contextmanager
def balanced_without_h():
    """The plan with its ``balanced`` layer replaced by the x, out, lse one (bytes: less h, in
    the residual stream's dtype; time: plus the o projection's forward at the matmul rate)."""
    real_bytes, real_secs = plan.layer_bytes, plan._layer_compute_seconds

    def layer_bytes(preset, d, B, S, dtype, *a, **k):
        b = real_bytes(preset, d, B, S, dtype, *a, **k)
        return b - B * S * d.hidden_size * plan._dtype(dtype).itemsize \
            if preset == "balanced" else b

    def seconds(preset, d, B, S, train_weights, fwd_rate, bwd_rate, mm_rate, **lora):
        t = real_secs(preset, d, B, S, train_weights, fwd_rate, bwd_rate, mm_rate, **lora)
        o_proj = 2 * B * S * d.num_heads * d.head_dim * d.hidden_size
        return t + o_proj / (mm_rate * 1e12) if preset == "balanced" else t

    plan.layer_bytes, plan._layer_compute_seconds = layer_bytes, seconds
    try:
        yield
    finally:
        plan.layer_bytes, plan._layer_compute_seconds = real_bytes, real_secs


def choice(S: int, memory: int, host: int):
    layers = [LLAMA31_8B] * LAYERS
    room = memory - plan.headroom_bytes(memory) - plan.model_state_bytes(layers, VOCAB, "bf16",
                                                                         "lora")
    try:
        return plan.choose_presets_offload(layers, VOCAB, 1, S, "bf16", room, host,
                                           train_weights=False, lora_rank=plan.LORA_RANK)
    except ValueError:
        return None


def describe(c) -> str:
    if c is None:
        return "does not fit | - "
    counts = ", ".join(f"{c.presets.count(p)} {p}" for p in ("fast", "balanced", "min_memory")
                       if p in c.presets)
    return f"{counts} | {c.seconds:,.0f}"


def main(argv=None) -> int:
    a = plan_arguments(__doc__, "bench/results/plan_out_lse.txt").parse_args(argv)
    memory, host = plan.parse_bytes(a.device_memory), plan.parse_bytes(a.host_memory)
    lines = ["| S | auto + offload today (layers) | step s | with x, out, lse for balanced "
             "(layers) | step s | time saved, both available |", "|---|---|---|---|---|---|"]
    for S in (131072, 262144, 393216, 524288, 655360, 786432, 917504, 1048576):
        today = choice(S, memory, host)
        with balanced_without_h():
            lean = choice(S, memory, host)
        # with both presets available the chooser could take either choice (a mix of all
        # four could do a little better): the saving is at least this
        saved = "-" if today is None or lean is None else \
            f"{max(0.0, 100 * (1 - lean.seconds / today.seconds)):.1f}%"
        lines.append(f"| {S:,} | {describe(today)} | "
                     f"{describe(lean).replace('balanced', 'x, out, lse')} | {saved} |")
    write_plan_result(a.out, f"LLaMA-3.1-8B, LoRA (bf16 base), B 1, {a.device_memory} device "
                      f"with the plan's headroom, offload with {a.host_memory} host, the plan's "
                      "H100 rates; auto's choice by time (plan.choose_presets_offload), "
                      "as it is and with balanced replaced by an x, out, lse layer", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
