"""Peak memory and the longest sequence that trains: a LLaMA-3.1-8B-shaped LoRA model per setup.

The model is transformers' ``LlamaForCausalLM`` built from a config with random weights (by
default LLaMA-3.1-8B's shape: H 4096, I 14336, 32 layers, 32/8 heads, vocab 128256, llama3
RoPE with theta 500000; SDPA attention; bf16), built on the device, wrapped in a PEFT LoRA
model (r 16, alpha 32, no dropout, every projection; the bf16 base frozen). Setups:

* ``hf_gc``: HF gradient checkpointing (``use_reentrant=False``) and HF's own loss, which
  forms the (S, vocab) logits and their fp32 log-softmax;
* ``hf_gc+fused_loss``: the same checkpointing with ckpt_ext's fused LM-head loss only:
  ``patch_llama(model, policy="torch", fuse_lm_head=True)`` (the ``torch`` preset leaves a layer
  to HF's own checkpointing when that is on; only the loss changes);
* ``min_memory`` / ``balanced`` / ``fast``: ``patch_llama(model, policy=<preset>)`` (fused
  decoder layers and the fused loss).

Each setup builds its own model. A step is one sequence (B 1, S tokens, labels = input ids):
``model(input_ids, labels=..., use_cache=False).loss.backward()``, the gradients then set to
None. Per setup and S in ``--seqs`` (``--warmup`` untimed steps at that S first: the fused
kernels autotune per power-of-two length bucket), one measured step gives

* ``peak_bytes``: ``torch.cuda.max_memory_allocated()`` during the step above what was
  allocated before it (``base_bytes``: weights, adapters, input ids); on CPU
  ``ckpt_ext.peak_memory_bytes`` of a second, untimed step (the CPU allocator's reports
  through the profiler; ``base_bytes`` NaN there);
* ``step_s``: forward + backward (CUDA events; the host clock on CPU);
* ``saved_bytes`` (smallest S only): what the forward leaves saved for backward
  (``ckpt_ext.saved_activation_bytes``).

``--capacity [SETUP ...]`` (CUDA only; no names: every setup run) then searches, per setup, the
longest S, a multiple of ``--granularity``, whose step runs without
``torch.cuda.OutOfMemoryError``. The peaks measured so far are fitted as ``a + b*S`` (the two
longest that ran) and solved for the memory free after ``torch.cuda.empty_cache()`` less
``--margin-gib``; that S is tried, each success refits and tries further up, and after a
failure the search steps down by the granularity times 1, 2, 4, ... (never below halfway to the
last success), bisecting until the longest success and the shortest failure are one
granularity apart. Step times are fitted as ``c1*S + c2*S^2`` (attention is quadratic): a
trial whose estimate would overrun the setup's ``--time-budget`` (seconds of search) or the
run's ``--deadline`` is not run, and the result says the search was cut by time. A trial at a
new power-of-two length bucket also autotunes the fused kernels (time, and a transient copy of
one (S, H) gradient); ``CKPT_EXT_AUTOTUNE=0`` launches untuned configurations instead.
``--deadline`` (seconds from the start) also applies to the rest: no setup or length starts
after it, and what was skipped is listed as such.

Prints the steps (one row per setup and S, capacity trials included) and, with
``--capacity``, one row per searched setup; writes ``bench/results/capacity_<device>.csv``
(provenance header; rewritten after every setup, so a run stopped from outside keeps what it
measured).

    python bench/capacity.py [--seqs 4096,16384] [--setups hf_gc min_memory ...]
    python bench/capacity.py --capacity hf_gc hf_gc+fused_loss min_memory [--time-budget 60]
    python bench/capacity.py --device cpu --layers 2 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --vocab 256 --seqs 64,128          # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import torch

import ckpt_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (Clock, device_tag, elapsed_log, hf_checkpointing, print_table,  # noqa: E402
                      provenance, write_csv)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SETUPS = ("hf_gc", "hf_gc+fused_loss", "min_memory", "balanced", "fast")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GiB = 2**30
CPU_NOTE = ("CPU run: peak_bytes from the profiler's memory events (base_bytes NaN); "
            "not GPU figures")

CSV_FIELDS = ["kind", "setup", "seq", "status", "peak_bytes", "peak_kib_per_token", "step_s",
              "base_bytes", "saved_bytes", "fit_a_bytes", "fit_b_bytes_per_token",
              "predicted_seq", "max_ok_seq", "min_failed_seq", "cut_by_time", "note"]


# ---- model ------------------------------------------------------------------------------------

def build_model(args, setup: str):
    """A fresh LoRA-wrapped ``LlamaForCausalLM`` on ``args.device`` set up for ``setup``."""
    import peft
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False, use_cache=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    # Allocated and initialised (normal, std 0.02) on the device itself: no CPU copy of 8B.
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=DTYPES[args.dtype])
    model.train()
    if setup.startswith("hf_gc"):
        # get_peft_model sees it on and calls enable_input_require_grads itself
        hf_checkpointing(model)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    if setup == "hf_gc+fused_loss":
        ckpt_ext.patch_llama(model, policy="torch", fuse_lm_head=True)
    elif setup != "hf_gc":
        ckpt_ext.patch_llama(model, policy=setup)
    return model


def paths(model) -> str:
    """How the decoder layers ran since patching (``hf``: unpatched; else the patched forward's
    call counts by path, e.g. ``fused x32``) and whether the LM-head loss is the fused one."""
    from ckpt_ext.hf.lm_head import FusedHeadForward

    inner = model.get_base_model()
    counts = {}
    for layer in inner.model.layers:
        calls = getattr(layer.forward, "calls", None)
        path = "hf" if calls is None else "+".join(sorted(calls)) or "no calls"
        counts[path] = counts.get(path, 0) + 1
    head = "fused" if isinstance(inner.__dict__.get("forward"), FusedHeadForward) else "hf"
    return f"layers: {', '.join(f'{p} x{n}' for p, n in counts.items())}; head: {head}"


def free_memory() -> None:
    """Collect what a step left behind and hand the allocator's cached blocks back, so that
    the next step (or model) starts from the same state."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- one step ---------------------------------------------------------------------------------

class Runner:
    """Runs and measures steps of one setup's model."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.cuda = torch.device(args.device).type == "cuda"

    def ids(self, seq: int) -> torch.Tensor:
        return torch.randint(self.args.vocab, (1, seq), device=self.args.device)

    def _step(self, ids) -> None:
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    def _try_step(self, seq: int) -> bool:
        """One step at ``seq`` tokens; False if it ran out of memory. Gradients are None before
        and after, and after a failure the memory it held is handed back."""
        self.model.zero_grad(set_to_none=True)
        try:
            self._step(self.ids(seq))
            ok = True
        except torch.cuda.OutOfMemoryError:
            ok = False
        # Out of the except block, the traceback and the partial graph its frames held are gone.
        self.model.zero_grad(set_to_none=True)
        if not ok:
            free_memory()
        return ok

    def step(self, seq: int) -> dict:
        """One measured step at ``seq`` tokens: ``status`` ok or OOM, ``peak_bytes`` (and per
        token), ``step_s``, ``base_bytes``, ``wall_s`` (host seconds, failures included).
        On CPU the peak comes from a second, untimed step under the profiler
        (``ckpt_ext.peak_memory_bytes``), which slows the step it watches."""
        clock = Clock(self.args.device)
        ran = {}

        def timed_step(_):
            t0 = time.perf_counter()
            clock.mark()
            ran["ok"] = self._try_step(seq)
            clock.mark()
            ran["wall"] = time.perf_counter() - t0

        base = peak = math.nan
        if self.cuda:  # the timed step is measured too: the allocator's statistics cost nothing
            base = torch.cuda.memory_allocated()
            peak = ckpt_ext.peak_memory_bytes(timed_step, None)
        else:
            timed_step(None)
        wall = ran["wall"]
        if not ran["ok"]:
            return {"status": "OOM", "step_s": wall, "wall_s": wall, "base_bytes": base}
        if not self.cuda:
            ids = self.ids(seq)
            self.model.zero_grad(set_to_none=True)
            peak = ckpt_ext.peak_memory_bytes(
                lambda model, ids: self._step(ids), self.model, ids)
            self.model.zero_grad(set_to_none=True)
        return {"status": "ok", "peak_bytes": peak, "peak_kib_per_token": peak / seq / 1024,
                "step_s": clock.elapsed_ms(0, 1) / 1e3, "wall_s": wall, "base_bytes": base}

    def warmup(self, seq: int) -> bool:
        """``--warmup`` untimed steps; False if one ran out of memory."""
        return all(self._try_step(seq) for _ in range(self.args.warmup))

    def saved_bytes(self, seq: int) -> int:
        ids = self.ids(seq)
        return ckpt_ext.saved_activation_bytes(
            lambda: self.model(input_ids=ids, labels=ids, use_cache=False).loss)


# ---- fits and the capacity search -------------------------------------------------------------

def fit_memory(points):
    """(a, b) of peak = a + b*S through the two longest successful steps (a = 0 with one), or
    None before any."""
    ok = sorted((p["seq"], p["peak_bytes"]) for p in points if p["status"] == "ok")
    if not ok:
        return None
    if len(ok) == 1 or ok[-1][0] == ok[-2][0]:
        return 0.0, ok[-1][1] / ok[-1][0]
    (s1, m1), (s2, m2) = ok[-2:]
    b = (m2 - m1) / (s2 - s1)
    return m2 - b * s2, b


def predict(fit, budget: float, g: int):
    """The longest multiple of ``g`` whose fitted peak fits ``budget`` (None without a fit that
    grows with S)."""
    if fit is None or not fit[1] > 0:
        return None
    return int((budget - fit[0]) / fit[1]) // g * g


def fit_time(points):
    """(c1, c2) of step time = c1*S + c2*S^2: least squares of the time per token, c1 + c2*S,
    over the successful steps (c2 = 0 with one length; clipped at 0), or None before any."""
    ok = [(p["seq"], p["step_s"] / p["seq"]) for p in points if p["status"] == "ok"]
    if not ok:
        return None
    n = len(ok)
    ms = sum(s for s, _ in ok) / n
    mt = sum(t for _, t in ok) / n
    var = sum((s - ms) ** 2 for s, _ in ok)
    c2 = max(0.0, sum((s - ms) * (t - mt) for s, t in ok) / var) if var else 0.0
    return max(mt - c2 * ms, 0.0), c2


def search(runner, points, budget: float, args, deadline: float, log) -> dict:
    """The capacity search of one setup (see the module docstring). ``runner.step(S)``: one
    step's row (``status`` ok or OOM, ``peak_bytes``, ``step_s``, ``wall_s``); ``points``: the
    setup's measured steps so far, trials are appended to it; ``budget``: the bytes a step may
    allocate above its base; ``deadline``: a ``time.perf_counter()`` value. Returns the
    summary row."""
    g = args.granularity
    start = time.perf_counter()
    lo = max((p["seq"] for p in points if p["status"] == "ok"), default=0)
    hi = min((p["seq"] for p in points if p["status"] == "OOM"), default=None)
    mem_fit = fit_memory(points)
    predicted = predict(mem_fit, budget, g)
    cut, note = False, "converged: the longest success and the shortest failure are adjacent"
    failures = 0  # consecutive failed trials: the step down doubles with each
    while True:
        up = (lo // g + 1) * g  # the multiples of g not yet decided: up, ..., down
        down = None if hi is None else (hi - 1) // g * g
        if down is not None and up > down:
            break
        if hi is None:  # nothing failed yet: the refitted prediction, at least one step up
            nxt = max(predict(fit_memory(points), budget, g) or 0, up)
        else:
            mid = (lo + hi) // 2 // g * g
            nxt = max(hi - (2 ** (failures - 1)) * g, mid) if failures else mid
            nxt = min(max(nxt // g * g, up), down)
        t_fit = fit_time(points)
        est = t_fit[0] * nxt + t_fit[1] * nxt * nxt if t_fit else math.nan
        now = time.perf_counter()
        left = min(args.time_budget - (now - start), deadline - now)
        if not est * 1.1 <= left:  # also when there is no estimate (nan)
            cut = True
            note = (f"S={nxt} not tried: ~{est:.0f} s estimated, {max(left, 0):.0f} s left"
                    if t_fit else f"S={nxt} not tried: no successful step to estimate from")
            log(f"  {note}")
            break
        row = runner.step(nxt)
        row.update(kind="trial", seq=nxt)
        points.append(row)
        log(f"  trial S={nxt}: {row['status']}"
            + (f", peak {row['peak_bytes'] / GiB:.2f} GiB" if row["status"] == "ok" else "")
            + f", {row['wall_s']:.1f} s (estimated {est:.1f} s)")
        if row["status"] == "ok":
            lo, failures = nxt, 0
        else:
            hi, failures = nxt, failures + 1
    return {"kind": "capacity", "status": "cut by time" if cut else "done",
            "fit_a_bytes": mem_fit[0] if mem_fit else math.nan,
            "fit_b_bytes_per_token": mem_fit[1] if mem_fit else math.nan,
            "predicted_seq": predicted if predicted is not None else "",
            "max_ok_seq": lo or "", "min_failed_seq": hi if hi is not None else "not tried",
            "cut_by_time": cut, "note": note}


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--seqs", default="4096,16384",
                   help="comma-separated sequence lengths measured per setup")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each measured one")
    p.add_argument("--capacity", nargs="*", choices=SETUPS, metavar="SETUP",
                   help="search the longest sequence that trains (CUDA only) for these setups "
                        "(no names: every setup in --setups)")
    p.add_argument("--granularity", type=int, default=4096)
    p.add_argument("--margin-gib", type=float, default=2.0,
                   help="memory left unused by the first prediction (fragmentation)")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="seconds per setup for the capacity search")
    p.add_argument("--deadline", type=float, default=240.0,
                   help="seconds from the start after which nothing new is started")
    for name, default in (("layers", 32), ("hidden", 4096), ("intermediate", 14336),
                          ("heads", 32), ("kv-heads", 8), ("vocab", 128256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--out", help="CSV path (default bench/results/capacity_<device>.csv)")
    a = p.parse_args(argv)
    try:
        a.seqs = sorted({int(s) for s in a.seqs.split(",") if s.strip()})
    except ValueError:
        p.error(f"--seqs must be comma-separated integers, got {a.seqs!r}")
    if not a.seqs or a.seqs[0] < 2:
        p.error("--seqs needs lengths >= 2")
    cuda = torch.device(a.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; this torch sees none")
    if a.capacity is not None:
        if not cuda:
            raise RuntimeError("--capacity searches for the longest sequence before "
                               "torch.cuda.OutOfMemoryError: it needs --device cuda")
        a.capacity = a.capacity or list(a.setups)
        missing = set(a.capacity) - set(a.setups)
        if missing:
            p.error(f"--capacity {' '.join(sorted(missing))}: not in --setups")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"--hidden ({a.hidden}) must divide by --heads ({a.heads}) and --heads by "
                f"--kv-heads ({a.kv_heads})")
    if a.granularity < 1 or a.warmup < 0:
        p.error("--granularity must be >= 1 and --warmup >= 0")
    return a


def gib(v) -> str:
    return "nan" if isinstance(v, float) and math.isnan(v) else f"{v / GiB:.2f}"


def main(argv=None) -> list:
    """Runs the benchmark; returns the CSV rows."""
    t_start = time.perf_counter()
    a = parse_args(argv)
    deadline = t_start + a.deadline
    cuda = torch.device(a.device).type == "cuda"
    shape = (f"LlamaForCausalLM {a.layers} layers, H {a.hidden}, I {a.intermediate}, "
             f"{a.heads}/{a.kv_heads} heads, vocab {a.vocab}, {a.dtype}, SDPA; PEFT LoRA r16 "
             f"alpha 32 on {'/'.join(LORA_TARGETS)}, base frozen; B 1")
    print(shape, flush=True)
    if not cuda:
        print(CPU_NOTE)

    log = elapsed_log(t_start)

    rows, summaries = [], []
    out = a.out or os.path.join(RESULTS, f"capacity_{device_tag(device=a.device)}.csv")
    header = provenance(a.device, "" if cuda else CPU_NOTE) + [
        f"model: {shape}",
        f"PYTORCH_CUDA_ALLOC_CONF: {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}",
        "peak_bytes: torch.cuda.max_memory_allocated() of one forward+backward step above "
        "base_bytes (allocated before it; on CPU ckpt_ext.peak_memory_bytes of an untimed "
        "step); step_s: that step's time after "
        f"{a.warmup} warm-up step(s) at the same S; saved_bytes: "
        "ckpt_ext.saved_activation_bytes of the forward (smallest S); trial rows: capacity "
        "search steps (no warm-up); capacity rows: its result"]

    for setup in a.setups:
        if time.perf_counter() >= deadline:
            log(f"{setup}: skipped (deadline)")
            rows += [{"kind": "point", "setup": setup, "seq": s, "status": "skipped (deadline)"}
                     for s in a.seqs]
            write_csv(out, header, CSV_FIELDS, rows)
            continue
        log(f"{setup}: building the model")
        model = build_model(a, setup)
        runner = Runner(model, a)
        points = []
        for i, seq in enumerate(a.seqs):
            if time.perf_counter() >= deadline:
                points.append({"kind": "point", "seq": seq, "status": "skipped (deadline)"})
                continue
            if runner.warmup(seq):
                row = runner.step(seq)
                if i == 0 and row["status"] == "ok":
                    row["saved_bytes"] = runner.saved_bytes(seq)
            else:
                row = {"status": "OOM", "note": "in the warm-up"}
            row.update(kind="point", seq=seq)
            points.append(row)
            log(f"{setup} S={seq}: {row['status']}, peak {gib(row.get('peak_bytes', math.nan))}"
                f" GiB, step {row.get('step_s', math.nan):.3f} s")
        ran = paths(model)
        log(f"{setup}: {ran}")
        summary = None
        if a.capacity and setup in a.capacity:
            free_memory()
            budget = torch.cuda.mem_get_info()[0] - a.margin_gib * GiB
            log(f"{setup}: capacity search, {budget / GiB:.1f} GiB for a step")
            summary = search(runner, points, budget, a, deadline, log)
            summary["setup"] = setup
            summaries.append(summary)
        for p in points:
            p["setup"] = setup
            p.setdefault("note", ran)
        rows += points + ([summary] if summary else [])
        del runner, model
        free_memory()
        write_csv(out, header, CSV_FIELDS, rows)

    print()
    print_table(["setup", "S", "status", "peak GiB", "KiB/token", "step s", "base GiB",
                 "saved MiB"],
                [[r["setup"], r["seq"], r["status"], gib(r.get("peak_bytes", math.nan)),
                  f"{r.get('peak_kib_per_token', math.nan):.1f}",
                  f"{r.get('step_s', math.nan):.3f}", gib(r.get("base_bytes", math.nan)),
                  f"{r['saved_bytes'] / 2**20:.3f}" if r.get("saved_bytes") else ""]
                 for r in rows if r["kind"] in ("point", "trial")], rule=True)
    if summaries:
        print()
        print_table(["setup", "predicted S", "longest ok S", "shortest failed S",
                     "peak ~ a + b*S (GiB, KiB/token)", "search"],
                    [[s["setup"], s["predicted_seq"], s["max_ok_seq"], s["min_failed_seq"],
                      f"{gib(s['fit_a_bytes'])} + {s['fit_b_bytes_per_token'] / 1024:.1f}*S",
                      f"{s['status']}: {s['note']}"] for s in summaries], rule=True)
    return rows


if __name__ == "__main__":
    main()
