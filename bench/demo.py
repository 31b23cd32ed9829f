"""The demo: the peak memory of a training step against sequence length, where ckpt_ext matters.

    python bench/demo.py [--out demo_results]   # 7 minutes on a busy 2-core machine (bench/results)

Activation memory grows with the number of tokens; at a few hundred tokens a small model's
step is dominated by its weights, gradients and fixed-size buffers, and every setup looks
alike (``torch.utils.checkpoint`` even peaks lowest there). This demo shows the regime the
engine exists for, in two panels of one picture:

1. **Measured, on this machine.** A small LLaMA-style model (transformers
   ``LlamaForCausalLM`` from a config: 4 layers, H 256, 4/2 heads, I 1024, vocab 2048, fp32 on
   a CPU) trains at each of three sequence lengths (128, 1024, 4096 tokens, batch 1) under
   three setups on the same weights and tokens:

   * ``HF checkpointing + fused loss``: ``model.activation_checkpointing_enable()`` with
     ``patch_llama(model, "torch")`` (HF's layer re-run in backward, ckpt_ext's fused LM
     head and loss) -- what a user has today, plus the fused loss;
   * ``balanced`` and ``min_memory``: ``patch_llama(model, preset)``.

   Each point is ``ckpt_ext.peak_memory_bytes`` of one training step (forward with labels,
   backward) above what was allocated before it, with the gradients of an earlier step
   present (the CPU allocator's events from the profiler; the CUDA allocator's statistics on
   a GPU). The lines through them are the plan's model of the same step
   (``ckpt_ext.plan.step_peak``): filled markers are measured (labelled with the peak),
   lines are the plan. The panel plots the peak per token (the peak divided by S), where
   the setups' differences show at every length: up to about a thousand tokens HF
   checkpointing peaks lowest here (the fused layer's backward returns all its weight
   gradients together), at 4,096 tokens ``min_memory`` does; the plan's lines cross where the
   measured points do.
2. **Extrapolated by the plan, not measured here:** LLaMA-3.1-8B with LoRA (bf16, B 1, the
   GPU path) on an 80 GB H100: the device memory a step needs (model state + step peak)
   against S, for HF checkpointing with HF's loss and with the fused loss, ``balanced``,
   ``min_memory``, and ``balanced`` / ``min_memory`` with ``offload="cpu"`` (256 GiB of host
   memory a GPU: 2 TiB shared by 8). The horizontal lines are the H100's 81,559 MiB and what
   is left after the plan's headroom for the CUDA context and fragmentation
   (``python -m ckpt_ext.plan --help``); crosses are the committed H100 measurements
   (bench/results/gpu_h100_2026-11-24/capacity_*.csv). On a CPU, offload moves memory to
   itself and shows nothing, which is why offload appears only in this panel.

It also prints each setup's loss against HF checkpointing's (the same model and tokens: they
agree to float32 rounding) and each point's step time: the median of ``--reps`` steps after a
warm-up step, none of them under the profiler. The times
are of the CPU kernels (ckpt_ext's ATen path on a CPU, not the Triton kernels) at the load
average printed beside them: they say nothing about GPU speed.

Outputs go to ``--out`` (default ``demo_results/``, ignored by git): ``demo_<device>.csv``
(the measured points, with the command, commit, machine, load and date in its header) and
``demo_<device>.png``. ``--seqs``, ``--layers``, ``--hidden`` ... change the measured model.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

# The CPU profiler behind peak_memory_bytes logs every start and stop ("USDT: ...
# profiler_start"): keep kineto quiet before torch loads it (and filter what still comes).
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

import ckpt_ext  # noqa: E402
from ckpt_ext import plan  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (device_name, device_tag, hf_checkpointing, provenance,  # noqa: E402
                      write_csv)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
H100_DIR = os.path.join(RESULTS, "gpu_h100_2026-11-24")
SETUPS = ("hf_gc+fused", "balanced", "min_memory")
NAMES = {"hf_gc": "HF checkpointing, HF loss", "hf_gc+fused": "HF checkpointing + fused loss",
         "balanced": "balanced", "min_memory": "min_memory", "fast": "fast"}
COLORS = {"hf_gc": "tab:gray", "hf_gc+fused": "tab:red", "balanced": "tab:orange",
          "min_memory": "tab:blue", "fast": "tab:purple"}
SIZES = {  # device kind -> the measured model
    "cpu": dict(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=1024, vocab=2048,
                seqs="128,1024,4096", dtype="float32"),
    "cuda": dict(layers=4, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                 seqs="4096,8192,16384", dtype="bfloat16"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The extrapolation: LLaMA-3.1-8B LoRA on an H100 80GB (nvidia-smi: 81559 MiB)
LLAMA31_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                  vocab=128256)
H100_BYTES = 81559 * 2**20
HOST_PER_GPU = 256 * 2**30


# ---- quiet profiling ---------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_fds():
    """Route what C++ writes to fds 1 and 2 into a file while the block runs, then pass on
    every line but kineto's USDT/profiler logging."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        try:
            for fd in (1, 2):
                os.dup2(tmp.fileno(), fd)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in saved.items():
                os.dup2(old, fd)
                os.close(old)
            tmp.seek(0)
            keep = [x for x in tmp.read().decode(errors="replace").splitlines()
                    if not re.match(r"^(USDT|STAGE|INFO|WARNING):|.*ActivityProfiler", x)]
            if keep:
                print("\n".join(keep), file=sys.stderr)


# ---- the measured model -------------------------------------------------------------------------
def build(a, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=a.hidden, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, vocab_size=a.vocab, rms_norm_eps=1e-5,
                      max_position_embeddings=max(a.seqs), use_cache=False,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                 dtype=DTYPES[a.dtype])
    return model.train()


def set_setup(model, setup):
    ckpt_ext.unpatch_llama(model)
    if setup == "hf_gc+fused":
        hf_checkpointing(model)
        ckpt_ext.patch_llama(model, "torch")
    else:
        (getattr(model, "activation_checkpointing_disable", None) or
         model.gradient_checkpointing_disable)()
        ckpt_ext.patch_llama(model, setup)


def measure(model, ids, device, reps):
    """(loss, step seconds, peak bytes): an untimed warm-up step (it takes the Triton compiles
    of the shape on CUDA and leaves the gradients a training run has), the median wall time of
    ``reps`` timed steps, then one step under peak_memory_bytes (not timed: the profiler slows
    it)."""
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for p in model.parameters():
        p.grad = None
    loss = step().item()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    with _quiet_fds():
        peak = ckpt_ext.peak_memory_bytes(step)
    return loss, statistics.median(times), peak


def load_average() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "unknown"


def commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                             capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, timeout=10).stdout
        return (sha or "unknown") + (" (with uncommitted changes)" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- the picture ----------------------------------------------------------------------------------
def h100_points():
    """The committed H100 measurements of LLaMA-3.1-8B LoRA: (setup, S, device bytes, note)."""
    import csv
    out = []
    for name in ("capacity_peak.csv", "capacity_min_memory_128k.csv"):
        path = os.path.join(H100_DIR, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rows = csv.DictReader(x for x in f if not x.startswith("#"))
            for r in rows:
                setup = {"hf_gc+fused_loss": "hf_gc+fused"}.get(r["setup"], r["setup"])
                if r["kind"] in ("point", "trial") and r["peak_bytes"] and \
                        setup in ("hf_gc", "hf_gc+fused", "min_memory") and \
                        int(r["seq"]) >= 16384:
                    out.append((setup, int(r["seq"]),
                                int(r["base_bytes"]) + int(r["peak_bytes"])))
    return out


def picture(path, a, rows, device, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture (pip install matplotlib)")
        return
    import numpy as np

    dtype = DTYPES[a.dtype]
    gpu = device.type == "cuda"
    layers = [plan.LayerDims(a.hidden, a.heads, a.kv_heads, a.hidden // a.heads,
                             a.intermediate)] * a.layers
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6))

    # left: measured here, with the plan's curves through the points. Per token, so that
    # the setups' differences show at every length (the peak itself is this times S).
    seqs = np.unique(np.geomspace(min(a.seqs) / 2, max(a.seqs) * 2, 80).astype(int))
    unit, uname = (2**30, "GiB") if gpu else (2**20, "MiB")
    for setup in SETUPS:
        model = [plan.step_peak(setup, layers, a.vocab, 1, int(s), dtype,
                                path="cuda" if gpu else "cpu").peak / s / 1024 for s in seqs]
        left.plot(seqs, model, color=COLORS[setup], lw=1.6, label=f"{NAMES[setup]} (plan)")
        pts = [r for r in rows if r["setup"] == setup]
        left.scatter([r["seq"] for r in pts], [r["peak_bytes"] / r["seq"] / 1024 for r in pts],
                     s=55, color=COLORS[setup], edgecolor="black", zorder=3,
                     label=f"{NAMES[setup]} (measured)")
        for r in pts:   # HF checkpointing's labels on the left, the others' on the right
            left.annotate(f"{r['peak_bytes'] / unit:.1f} {uname}",
                          (r["seq"], r["peak_bytes"] / r["seq"] / 1024),
                          textcoords="offset points", fontsize=7, color=COLORS[setup],
                          xytext=(-8, -3) if setup == "hf_gc+fused" else (7, -3),
                          ha="right" if setup == "hf_gc+fused" else "left")
    left.set_xscale("log", base=2)
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}")
    left.xaxis.set_major_formatter(plain)
    left.set_xticks(sorted(set(a.seqs) | {min(a.seqs) // 2, max(a.seqs) * 2}))
    left.set_ylim(bottom=0)
    left.set_xlabel("sequence length S (tokens, batch 1)")
    left.set_ylabel("peak memory of a training step per token (KiB)\n(the peak is this x S; "
                    "labels: the measured peak)")
    left.set_title(f"Measured on this machine: {title}", fontsize=9)
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7.5, loc="upper right")

    # right: the plan's extrapolation to LLaMA-3.1-8B LoRA on an H100 80GB
    big = [plan.LayerDims(4096, 32, 8, 128, 14336)] * 32
    V = LLAMA31_8B["vocab"]
    state = plan.model_state_bytes(big, V, "bf16", "lora")
    kept = plan.headroom_bytes(H100_BYTES)
    usable = H100_BYTES - kept
    S = np.linspace(1024, 320 * 1024, 140).astype(int)
    gib = 2**30
    for setup in ("hf_gc", "hf_gc+fused", "balanced", "min_memory"):
        y = [(state + plan.step_peak(setup, big, V, 1, int(s), "bf16",
                                     train_weights=False).peak) / gib for s in S]
        longest = plan.longest_sequence(setup, big, V, 1, "bf16", H100_BYTES, "lora",
                                        headroom=kept)
        right.plot(S / 1024, y, color=COLORS[setup], lw=1.6,
                   label=f"{NAMES[setup]}: up to {longest / 1024:.0f}K")
    for setup in ("balanced", "min_memory"):
        y = [(state + plan.offload_step_peak(setup, big, V, 1, int(s), "bf16",
                                             train_weights=False,
                                             host_limit=HOST_PER_GPU).peak) / gib for s in S]
        longest = plan.longest_sequence_offload(setup, big, V, 1, "bf16", H100_BYTES,
                                                HOST_PER_GPU, "lora", headroom=kept)
        right.plot(S / 1024, y, color=COLORS[setup], lw=1.6, ls="--",
                   label=f"{NAMES[setup]} + offload: up to {longest / 1024:.0f}K")
    right.axhline(H100_BYTES / gib, color="black", lw=1.2)
    right.text(4, H100_BYTES / gib + 1.2, "H100 80GB: 79.6 GiB", fontsize=8)
    right.axhline(usable / gib, color="black", lw=0.8, ls=":")
    right.text(318, usable / gib - 4.5, f"usable: {usable / gib:.1f} GiB ({kept / gib:.1f} GiB "
               "kept for the CUDA context and fragmentation)", fontsize=8, ha="right")
    right.axhline(state / gib, color="0.5", lw=0.8, ls=":")
    right.text(318, state / gib - 4.0, f"model state (bf16 base + LoRA): {state / gib:.1f} GiB",
               fontsize=8, color="0.35", ha="right")
    right.scatter([], [], marker="X", s=70, color="white", edgecolor="black",
                  label="measured on an H100, 2026-11-24")
    for setup, s, total in h100_points():
        right.scatter([s / 1024], [total / gib], marker="X", s=70, color=COLORS[setup],
                      edgecolor="black", zorder=3)
        if setup == "min_memory" and s > 100_000:
            right.annotate("min_memory measured before the\nsequence-tiled layer (54b2d2f): "
                           "today's\ncode keeps less, by the plan", (s / 1024, total / gib),
                           textcoords="offset points", xytext=(8, -30), fontsize=7.5)
    right.set_xlim(0, 320)
    right.set_ylim(0, 110)
    right.set_xlabel("sequence length S (K tokens, batch 1)")
    right.set_ylabel("device memory of a training step (GiB): model state + step peak")
    right.set_title("Extrapolated by ckpt_ext.plan (not measured here): LLaMA-3.1-8B, LoRA r16, "
                    "bf16,\non one H100 80GB; offload with 256 GiB of host memory a GPU",
                    fontsize=9)
    right.grid(alpha=0.3)
    right.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.relpath(path)}")


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("Activation memory"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo_results",
                   help="folder for the CSV and the picture (default demo_results/, ignored "
                        "by git)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--reps", type=int, default=3,
                   help="timed steps per point after the warm-up step; the median is printed "
                        "(default 3)")
    p.add_argument("--seqs", help="measured sequence lengths, comma-separated (default "
                                  f"{SIZES['cpu']['seqs']} on a CPU, {SIZES['cuda']['seqs']} "
                                  "on a GPU)")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       help=f"default {SIZES['cpu'][name]} on a CPU, {SIZES['cuda'][name]} "
                            "on a GPU")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = "cuda" if a.device.startswith("cuda") else "cpu"
    for k, v in SIZES[kind].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    try:
        a.seqs = sorted({int(x) for x in str(a.seqs).split(",")})
    except ValueError:
        p.error(f"argument --seqs: comma-separated ints, got {a.seqs!r}")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
        if getattr(a, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be a positive int")
    if a.reps < 1:
        p.error(f"argument --reps: must be a positive int, got {a.reps}")
    if min(a.seqs) < 2:
        p.error("argument --seqs: each length must be at least 2")
    try:   # before minutes of measuring: the results folder must be writable
        os.makedirs(a.out, exist_ok=True)
        with tempfile.TemporaryFile(dir=a.out):
            pass
    except OSError as e:
        p.error(f"argument --out: cannot write to {a.out!r}: {e.strerror or e}")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"argument --hidden: {a.hidden} must be divisible by --heads {a.heads}, and "
                f"--heads by --kv-heads {a.kv_heads}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    device = torch.device(a.device)
    started, load0, code = time.time(), load_average(), commit()   # before any output is written
    model = build(a, device)
    n = sum(p.numel() for p in model.parameters())
    shape = (f"{a.layers} layers, H {a.hidden}, {a.heads}/{a.kv_heads} heads, I "
             f"{a.intermediate}, vocab {a.vocab}, {a.dtype}, {n / 1e6:.1f}M params, batch 1")
    print(f"device: {device_name(device)}; torch {torch.__version__}; load average {load0}")
    print(f"model: transformers LlamaForCausalLM, {shape}")
    print(f"measuring {len(SETUPS)} setups x S {', '.join(map(str, a.seqs))}: a warm-up step, "
          f"{a.reps} timed steps and a step under the memory profiler, per point")
    g = torch.Generator().manual_seed(1)
    ids_all = torch.randint(0, a.vocab, (1, max(a.seqs)), generator=g).to(device)
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(SETUPS) * len(a.seqs), desc="demo", unit="point", file=sys.stderr)
    except ImportError:
        bar = None
    rows = []
    for S in a.seqs:
        ids = ids_all[:, :S]
        for setup in SETUPS:
            if bar is not None:
                bar.set_postfix_str(f"S {S} {setup}")
            set_setup(model, setup)
            loss, seconds, peak = measure(model, ids, device, a.reps)
            plan_peak = plan.step_peak(
                setup, [plan.LayerDims(a.hidden, a.heads, a.kv_heads, a.hidden // a.heads,
                                       a.intermediate)] * a.layers, a.vocab, 1, S,
                DTYPES[a.dtype], path="cuda" if device.type == "cuda" else "cpu").peak
            rows.append(dict(setup=setup, seq=S, peak_bytes=peak, plan_peak_bytes=plan_peak,
                             plan_over_measured=plan_peak / peak, loss=loss, step_s=seconds,
                             load_average=load_average()))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    ckpt_ext.unpatch_llama(model)
    load1 = load_average()

    unit, uname = (2**30, "GiB") if device.type == "cuda" else (2**20, "MiB")
    print()
    head = f"{'S':>6}  {'setup':<30} {'peak ' + uname:>10} {'plan':>8} {'plan/meas':>9} " \
           f"{'loss - HF ckpt':>14} {'step s':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ref = next(x for x in rows if x["seq"] == r["seq"] and x["setup"] == "hf_gc+fused")
        r["loss_minus_hf_gc"] = r["loss"] - ref["loss"]
        print(f"{r['seq']:>6}  {NAMES[r['setup']]:<30} {r['peak_bytes'] / unit:>10.1f} "
              f"{r['plan_peak_bytes'] / unit:>8.1f} {r['plan_over_measured']:>9.3f} "
              f"{r['loss_minus_hf_gc']:>14.2e} {r['step_s']:>7.2f}")
    wall = time.time() - started
    kernels = ("the Triton kernels" if device.type == "cuda" else
               "ckpt_ext's CPU (ATen) kernels, not the GPU ones")
    caveat = "" if device.type == "cuda" else " -- CPU times say nothing about GPU speed"
    print(f"step s: the median of {a.reps} steps after a warm-up step, run by {kernels}; load "
          f"average {load0} before, {load1} after (1/5/15 min){caveat}")
    print(f"demo wall time {wall:.0f} s")

    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"demo_{device_tag(device=device)}")
    header = provenance(device) + [
        f"commit: {code}",
        f"load average (1/5/15 min): {load0} at the start, {load1} at the end; wall {wall:.0f} s",
        f"model: transformers LlamaForCausalLM, {shape}",
        "setups: hf_gc+fused = activation_checkpointing_enable() (gradient_checkpointing_enable() "
        "before transformers 5.24) + patch_llama(model, 'torch'); "
        "balanced / min_memory = patch_llama(model, preset)",
        "peak_bytes: ckpt_ext.peak_memory_bytes of one forward+backward step, gradients of the "
        "step before present; plan_peak_bytes: ckpt_ext.plan.step_peak of the same step; "
        f"step_s: the median wall time of {a.reps} steps after an untimed warm-up step "
        f"({kernels})"]
    write_csv(stem + ".csv", header, ["setup", "seq", "peak_bytes", "plan_peak_bytes",
                                      "plan_over_measured", "loss", "loss_minus_hf_gc",
                                      "step_s", "load_average"], rows)
    picture(stem + ".png", a, rows, device,
            f"{shape}\n{device_name(device)}, commit {code}")


if __name__ == "__main__":
    main()
