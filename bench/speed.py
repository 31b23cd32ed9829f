"""The speed table: step time and peak of ckpt_ext's presets beside Hugging Face's setups.

The question users ask (the speed issue): at the lengths people train, is a patched model
faster than HF's own layer, with or without HF's gradient checkpointing and a fused loss? The
model is transformers' ``LlamaForCausalLM`` from a config with random weights, by default
LLaMA-3-8B's dims cut to 4 decoder layers and the head (H 4096, I 14336, 32/8 heads, vocab
128256, llama3 RoPE, SDPA attention, bf16, B 1), built on the device. Rows, each a fresh model:

* ``hf``: HF's model as it is, no checkpointing (everything autograd saves);
* ``hf_gc``: HF gradient checkpointing (``use_reentrant=False``; transformers >= 5.2x names
  the switch ``activation_checkpointing_enable``, older ones ``gradient_checkpointing_enable``:
  whichever the installed one has without a deprecation warning) with HF's loss;
* ``hf_gc+fused_loss``: the same checkpointing with ckpt_ext's fused LM-head loss only
  (``patch_llama(policy="torch", fuse_lm_head=True)``: the layers stay HF's checkpointed ones);
* ``fast`` / ``balanced`` / ``min_memory``: ``patch_llama(model, policy=<preset>)`` (fused
  layers and the fused loss);
* ``auto``: ``patch_llama(model, policy="auto")``: each layer's way to run (HF's layer,
  checkpointed or not, or a fused preset) chosen per forward by the plan's time model within
  the GPU's memory less the model state and headroom (``--auto-budget`` passes an
  ``activation_budget`` instead; the dry run on the CPU, which needs one, passes 1 GiB); the
  row's ``paths`` column says what it chose per shape;

and each again with PEFT LoRA (``<row>@lora``: rank ``--lora`` 16, alpha 2r, dropout
``--lora-dropout`` 0, on q/k/v/o/gate/up/down, the base frozen; ``--lora 0``: no LoRA rows).
A full fine-tune row trains every weight (their gradients in the model dtype; no optimizer).

Per row and S in ``--seqs`` (4096, 16384, 65536): ``--warmup`` untimed steps (Triton's
compiles and tuning), then ``--reps`` timed steps, each ``model(input_ids, labels=input_ids,
use_cache=False).loss.backward()`` with the gradients set to None before it: ``step_ms`` is
their median (CUDA events; the host clock on the CPU) and ``peak_bytes`` the allocator's peak
over them above what was allocated before (``torch.cuda.max_memory_allocated``; on the CPU
``ckpt_ext.peak_memory_bytes`` of one more, untimed step). A step that runs out of memory
makes an ``OOM`` row and the run goes on (``no fit``: ``auto``'s plan found no mix that fits,
its message in the note); a longer S of that row is then not tried (its row says so). ``--deadline`` (seconds from the start): no row starts after it (``skipped``).

Then the table per S and the issue's goals, each with its figure: ``fast`` at most 1.0x ``hf``;
``min_memory`` at most 1.0x ``hf_gc+fused_loss`` (at S >= 65536: 0.9x, and its peak at most
0.6x); each preset's LoRA increment (``p@lora - p``) at most 1.5x HF's (``hf@lora - hf``);
``auto`` at most the fastest HF row that ran. Writes ``--out`` (default
``bench/results/speed_<device>.csv``, provenance header).

    python bench/speed.py [--seqs 4096,16384,65536] [--rows hf fast ...] [--lora 16]
    python bench/speed.py --dry-run     # CPU, tiny sizes (tests/test_bench_speed.py): no figures
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import warnings

import torch

import ckpt_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (Clock, device_tag, elapsed_log, hf_checkpointing, print_table,  # noqa: E402
                      provenance, write_csv)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SETUPS = ("hf", "hf_gc", "hf_gc+fused_loss", "fast", "balanced", "min_memory", "auto")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --dry-run: the CPU, tiny dims (argparse's values for these are replaced)
DRY = {"device": "cpu", "dtype": "float32", "layers": 2, "hidden": 64, "intermediate": 128,
       "heads": 4, "kv_heads": 2, "vocab": 256, "seqs": [32, 64], "lora": 4, "warmup": 1,
       "reps": 2}
CPU_NOTE = "CPU run: tiny sizes or the host clock, NOT GPU figures"
CSV_FIELDS = ["row", "setup", "lora", "seq", "status", "step_ms", "peak_bytes",
              "peak_kib_per_token", "reps", "paths", "note"]


# ---- the model of a row -------------------------------------------------------------------------

def build_model(a, setup: str, lora: bool):
    """A fresh ``LlamaForCausalLM`` on ``a.device`` set up for ``setup`` (``SETUPS``), with
    PEFT LoRA of rank ``a.lora`` when ``lora``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
        rms_norm_eps=1e-5, max_position_embeddings=max(131072, max(a.seqs)),
        tie_word_embeddings=False, use_cache=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device(a.device):   # initialised on the device: no host copy
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=DTYPES[a.dtype])
    model.train()
    if setup.startswith("hf_gc"):
        # before get_peft_model, which then makes the embeddings' output require grad
        hf_checkpointing(model)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=a.lora, lora_alpha=2 * a.lora, lora_dropout=a.lora_dropout,
            target_modules=LORA_TARGETS))
    if setup == "hf_gc+fused_loss":
        ckpt_ext.patch_llama(model, policy="torch", fuse_lm_head=True)
    elif setup == "auto":
        kwargs = {} if a.auto_budget is None else {"activation_budget": a.auto_budget}
        ckpt_ext.patch_llama(model, policy="auto", **kwargs)
    elif setup not in ("hf", "hf_gc"):
        ckpt_ext.patch_llama(model, policy=setup)
    return model


def _inner(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def paths(model) -> str:
    """How the decoder layers ran (``hf`` unpatched, else the patched forward's call counts by
    path), ``auto``'s choices per shape, and whether the loss was the fused one."""
    from ckpt_ext.hf.lm_head import FusedHeadForward

    inner = _inner(model)
    counts, chosen = {}, {}
    for layer in inner.model.layers:
        fwd = layer.__dict__.get("forward")
        calls = getattr(fwd, "calls", None)
        path = "hf" if calls is None else "+".join(sorted(calls)) or "no calls"
        counts[path] = counts.get(path, 0) + 1
        shared = getattr(fwd, "shared", None)
        if shared is not None and getattr(shared, "auto", None):
            chosen = shared.auto
    head = "fused" if isinstance(inner.__dict__.get("forward"), FusedHeadForward) else "hf"
    text = f"layers: {', '.join(f'{p} x{n}' for p, n in counts.items())}; head: {head}"
    for key, presets in chosen.items():
        runs = []
        for p in presets:     # "min_memory x3, fast x1" in layer order
            if runs and runs[-1][0] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        text += f"; auto at B {key[0]} S {key[1]}: " + ", ".join(f"{p} x{n}" for p, n in runs)
    return text


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the measurement -----------------------------------------------------------------------------

def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def measure(model, a, seq: int) -> dict:
    """``a.warmup`` untimed steps, then ``a.reps`` timed ones at ``seq`` tokens: ``status``
    (ok / OOM), ``step_ms`` (median), ``peak_bytes`` (see the module docstring)."""
    cuda = torch.device(a.device).type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(seq)
    ids = torch.randint(a.vocab, (1, seq), generator=gen).to(a.device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    times, peak, ok, refused = [], math.nan, True, None
    try:
        for _ in range(a.warmup):
            step()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            free_memory()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.reps):
            clock = Clock(a.device)
            clock.mark()
            step()
            clock.mark()
            times.append(clock.elapsed_ms(0, 1))
            model.zero_grad(set_to_none=True)
        if cuda:
            peak = torch.cuda.max_memory_allocated() - base
        else:
            model.zero_grad(set_to_none=True)
            peak = ckpt_ext.peak_memory_bytes(step)
    except Exception as exc:   # noqa: BLE001  (out of memory and auto's refusal are rows;
        if isinstance(exc, ValueError) and str(exc).startswith("auto"):   # others raise)
            refused = str(exc).splitlines()[0]
        elif not _oom(exc):
            raise
        ok = False
    # out of the except block: the traceback and the partial graph it held are gone
    model.zero_grad(set_to_none=True)
    if not ok:
        free_memory()
        if refused:    # policy="auto" found no mix that fits: the plan's OOM
            return {"status": "no fit", "step_ms": math.nan, "peak_bytes": math.nan,
                    "note": refused}
        return {"status": "OOM", "step_ms": math.nan, "peak_bytes": math.nan}
    return {"status": "ok", "step_ms": statistics.median(times), "peak_bytes": peak,
            "peak_kib_per_token": peak / seq / 1024, "reps": len(times)}


# ---- goals ---------------------------------------------------------------------------------------

def _ms(rows, name, seq):
    r = rows.get((name, seq))
    return r["step_ms"] if r is not None and r["status"] == "ok" else math.nan


def _verdict(ratio: float, bound: float) -> str:
    if math.isnan(ratio):
        return "not measured"
    return "met" if ratio <= bound else "missed"


def goals(rows: dict, seqs, lora: bool) -> list:
    """The speed issue's goals per S (lines of text): each ratio, its bound and met / missed."""
    out = []
    for s in seqs:
        def line(what, num, den, bound):
            # a ratio over a difference of noisy times (the LoRA increments) may have no
            # meaning: a denominator that is not positive gives none
            ratio = num / den if den > 0 else math.nan
            out.append(f"goal S={s}: {what} = {num:.1f} / {den:.1f} ms = {ratio:.3f} "
                       f"(<= {bound}: {_verdict(ratio, bound)})")
        line("fast / hf", _ms(rows, "fast", s), _ms(rows, "hf", s), 1.0)
        bound = 0.9 if s >= 65536 else 1.0
        line("min_memory / hf_gc+fused_loss", _ms(rows, "min_memory", s),
             _ms(rows, "hf_gc+fused_loss", s), bound)
        if s >= 65536:
            mm, ref = rows.get(("min_memory", s)), rows.get(("hf_gc+fused_loss", s))
            peak = (mm["peak_bytes"] / ref["peak_bytes"]
                    if mm and ref and mm["status"] == ref["status"] == "ok" else math.nan)
            out.append(f"goal S={s}: peak min_memory / hf_gc+fused_loss = {peak:.3f} "
                       f"(<= 0.6: {_verdict(peak, 0.6)})")
        hf_rows = [n for n in ("hf", "hf_gc", "hf_gc+fused_loss")
                   if not math.isnan(_ms(rows, n, s))]
        fastest = min(hf_rows, key=lambda n: _ms(rows, n, s), default="hf")
        line(f"auto / fastest HF row that ran ({fastest})", _ms(rows, "auto", s),
             _ms(rows, fastest, s), 1.0)
        if lora:
            hf_inc = _ms(rows, "hf@lora", s) - _ms(rows, "hf", s)
            for p in ("fast", "balanced", "min_memory"):
                inc = _ms(rows, f"{p}@lora", s) - _ms(rows, p, s)
                line(f"LoRA increment {p} / hf", inc, hf_inc, 1.5)
    return out


# ---- the run -------------------------------------------------------------------------------------

def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seqs", default="4096,16384,65536", help="comma-separated lengths")
    p.add_argument("--rows", nargs="+", choices=SETUPS, default=list(SETUPS), metavar="SETUP",
                   help=f"the setups to run (each also with LoRA): {', '.join(SETUPS)}")
    p.add_argument("--lora", type=int, default=16, help="LoRA rank of the @lora rows; 0: none")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--auto-budget", default=None,
                   help="the auto row's activation_budget (bytes or '20GiB'; default: "
                        "patch_llama's own)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per row and S")
    p.add_argument("--reps", type=int, default=3, help="timed steps per row and S (median)")
    p.add_argument("--deadline", type=float, default=1e9,
                   help="seconds from the start after which no row starts")
    for name, default in (("layers", 4), ("hidden", 4096), ("intermediate", 14336),
                          ("heads", 32), ("kv-heads", 8), ("vocab", 128256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--out", help="CSV path (default bench/results/speed_<device>.csv)")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU at tiny sizes (a check that the bench runs, no figures)")
    a = p.parse_args(argv)
    try:
        a.seqs = sorted({int(s) for s in a.seqs.split(",") if s.strip()})
    except ValueError:
        p.error(f"--seqs must be comma-separated integers, got {a.seqs!r}")
    if a.dry_run:
        for k, v in DRY.items():
            if k != "lora" or a.lora:     # --lora 0 (no LoRA rows) holds in the dry run too
                setattr(a, k, v)
        if a.auto_budget is None:   # on the CPU patch_llama's auto needs a budget
            a.auto_budget = "1GiB"
    if not a.seqs or a.seqs[0] < 2:
        p.error("--seqs needs lengths >= 2")
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; this torch sees none (--dry-run: the CPU)")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"--hidden ({a.hidden}) must divide by --heads ({a.heads}) and --heads by "
                f"--kv-heads ({a.kv_heads})")
    if a.warmup < 0 or a.reps < 1 or a.lora < 0:
        p.error("--warmup must be >= 0, --reps >= 1 and --lora >= 0")
    if not 0 <= a.lora_dropout < 1:
        p.error(f"--lora-dropout must be in [0, 1), got {a.lora_dropout}")
    return a


def mib(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v / 2**20:.1f}"


def main(argv=None) -> list:
    """Runs the table; returns its rows (dicts, as in the CSV)."""
    t_start = time.perf_counter()
    a = parse_args(argv)
    cuda = torch.device(a.device).type == "cuda"
    lora_note = (f"PEFT LoRA r {a.lora} alpha {2 * a.lora} dropout {a.lora_dropout} on "
                 f"{'/'.join(LORA_TARGETS)} (base frozen)" if a.lora else "no LoRA rows")
    shape = (f"LlamaForCausalLM {a.layers} layers + head, H {a.hidden}, I {a.intermediate}, "
             f"{a.heads}/{a.kv_heads} heads, vocab {a.vocab}, {a.dtype}, SDPA, B 1; "
             f"@lora rows: {lora_note}; warmup {a.warmup}, median of {a.reps}")
    print(shape, flush=True)
    if not cuda:
        print(CPU_NOTE)

    log = elapsed_log(t_start)

    out = a.out or os.path.join(RESULTS, f"speed_{device_tag(device=a.device)}.csv")
    header = provenance(a.device, "" if cuda else CPU_NOTE) + [
        f"model: {shape}",
        "step_ms: the median forward+backward step (gradients set to None before each); "
        "peak_bytes: the allocator's peak over the timed steps above what was allocated "
        "before them (CPU: ckpt_ext.peak_memory_bytes of one more step)"]
    names = [(s, False) for s in a.rows] + ([(s, True) for s in a.rows] if a.lora else [])
    results, rows = {}, []
    for setup, lora in names:
        name = setup + ("@lora" if lora else "")
        if time.perf_counter() - t_start >= a.deadline:
            log(f"{name}: skipped (deadline)")
            for s in a.seqs:
                results[name, s] = {"status": "skipped (deadline)"}
                rows.append(dict(results[name, s], row=name, setup=setup, lora=int(lora), seq=s))
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build_model(a, setup, lora)
        notes = sorted({str(w.message).splitlines()[0][:160] for w in caught
                        if issubclass(w.category, (DeprecationWarning, FutureWarning))})
        log(f"{name}: model built in {time.perf_counter() - t0:.1f} s"
            + (f" (deprecation warnings: {'; '.join(notes)})" if notes else ""))
        failed_at = None
        for s in a.seqs:
            if failed_at is not None:
                row = {"status": results[name, failed_at]["status"],
                       "note": f"not tried: S={failed_at} did not fit"}
            elif time.perf_counter() - t_start >= a.deadline:
                row = {"status": "skipped (deadline)"}
            else:
                row = measure(model, a, s)
                if row["status"] in ("OOM", "no fit"):
                    failed_at = s
            results[name, s] = row
            log(f"{name} S={s}: {row['status']}"
                + (f", step {row['step_ms']:.1f} ms, peak {mib(row['peak_bytes'])} MiB"
                   if row["status"] == "ok" else ""))
        ran = paths(model)
        log(f"{name}: {ran}")
        for s in a.seqs:
            rows.append(dict(results[name, s], row=name, setup=setup, lora=int(lora), seq=s,
                             paths=ran))
        del model
        free_memory()
        write_csv(out, header, CSV_FIELDS, rows)   # a run stopped from outside keeps these
    write_csv(out, header, CSV_FIELDS, rows)

    for s in a.seqs:
        print(f"\n== S {s}: step ms and peak MiB (B 1, {a.layers} layers + head, {a.dtype})")
        print_table(["row", "status", "step ms", "peak MiB"],
                    [[r["row"], r["status"],
                      f"{r['step_ms']:.1f}" if r["status"] == "ok" else "",
                      mib(r.get("peak_bytes"))] for r in rows if r["seq"] == s], rule=True)
    print()
    for line in goals(results, a.seqs, bool(a.lora)):
        print(line)
    return rows


if __name__ == "__main__":
    main()
