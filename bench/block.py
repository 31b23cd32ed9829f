"""One LLaMA-style decoder layer under every preset: saved bytes, peak memory, step time.

Defaults (CPU, fp32): H=512, 8 heads, 2 KV heads, I=1376, S=1024, B=2. ``--llama7b`` takes the
LLaMA-7B layer of the GPU validation (H=4096, 32 heads, I=11008, B=1, S=4096, bf16, CUDA).
Rows, all measured in one run on the same weights and inputs:

* none / torch / fast / balanced / min_memory: ``ckpt_ext.modules.DecoderLayer`` per preset;
* hf / hf_gc (when transformers imports; ``--no-hf`` drops them): transformers'
  ``LlamaDecoderLayer`` (SDPA attention) carrying the same weights, without and with HF's own
  gradient checkpointing (``activation_checkpointing_enable()`` with its defaults);
* ``--amp bfloat16`` adds ``<preset>@amp`` rows: an fp32-master copy of the layer under
  ``torch.autocast`` (input, grad_out and cos/sin in fp32, as in mixed-precision training);
* ``--compile`` adds ``<preset>@compiled`` rows: the layer under ``torch.compile`` (inductor
  on CUDA, aot_eager on CPU).
* ``--lora R`` adds ``hf@lora`` (HF's layer with PEFT LoRA adapters of rank R on every
  projection, ``--lora-dropout`` P, base weights frozen) and ``<preset>@lora`` rows: the fused
  op on that layer's tensors, as ``patch_llama`` calls it (adapters fused, dropout masks hashed
  from a per-call seed). Their gradients (the adapters') are compared with ``hf@lora``'s when
  P = 0; with P > 0 the two draw different masks and the column says ``nan``.

For each row: saved bytes (``ckpt_ext.saved_activation_bytes``) and, for the fused presets and
``torch``, the preset's formula (docs/presets.md); the peak memory a forward+backward step allocates above what
was resident before it (``ckpt_ext.peak_memory_bytes``: the CUDA allocator's statistics, on CPU
the profiler's memory events, in an untimed step of its own); the step time as a ratio to
``none`` and to ``torch`` (median of interleaved repetitions, so that drift in the machine's
load hits every row alike); the largest gradient difference from ``none``.

Then the goals, each printed with its figure as ``[ok]`` or ``[MISSED]``:

* every fused preset saves no more than its formula;
* min_memory saves at most 1.05x the layer input's bytes and steps in at most 1.20x ``none``;
* balanced saves at most 1/8 of ``none`` and steps in at most 1.10x ``none``;
* fast saves at most 1/2 of ``none`` and steps in at most 0.95x ``none``;
* every fused preset beats ``torch`` at its memory point: checkpointing a fraction f of a deep
  stack's layers with ``torch.utils.checkpoint`` moves a layer along the straight line from
  (saved, time) of ``none`` to that of ``torch``; at the f where that line saves what the preset
  saves, the preset must take less time (for min_memory, f = 1: plainly faster than torch).

Writes ``bench/results/block_<device>.csv`` (header: device, versions, command, date, goals).
Exits non-zero when a preset saves more than its formula, and with ``--llama7b`` or
``--strict`` also when a goal is missed (the goals are set for that shape on a GPU).

    python bench/block.py [--reps 9]
    python bench/block.py --llama7b [--reps 10]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import ckpt_ext
from ckpt_ext.modules import DecoderLayer
from ckpt_ext.presets import FUSED_PRESETS, PRESETS, saved_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Clock, device_name, median, provenance, sync, write_csv  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rope(s, d, dtype, device):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.arange(s, device=device).float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


HF_ROWS = ("hf", "hf_gc")
LLAMA7B = dict(hidden=4096, heads=32, kv_heads=32, intermediate=11008, seq=4096, batch=1,
               dtype="bfloat16", device="cuda")


def hf_layer(ours: DecoderLayer, h, hq, hkv, i, eps, device, dtype):
    """transformers' LlamaDecoderLayer with ``ours``'s weights, inside a one-layer LlamaModel
    (whose ``gradient_checkpointing_enable`` is HF's own switch), or None without transformers."""
    try:
        from transformers import LlamaConfig, LlamaModel
    except ImportError as exc:
        print(f"transformers not importable ({exc}): no hf / hf_gc rows")
        return None, None
    cfg = LlamaConfig(hidden_size=h, num_attention_heads=hq, num_key_value_heads=hkv,
                      intermediate_size=i, num_hidden_layers=1, vocab_size=8,
                      rms_norm_eps=eps, use_cache=False, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = LlamaModel(cfg).to(device, dtype).train()
    layer = model.layers[0]
    layer.load_state_dict(ours.state_dict(), strict=True)
    return model, layer


def hf_step_fn(layer):
    def fwd(x, pe):
        out = layer(x, attention_mask=None, position_embeddings=pe, use_cache=False)
        return out[0] if isinstance(out, tuple) else out
    return fwd


def torch_line_time(n, per_layer, med):
    """(time, f): the step time of torch checkpointing applied to the fraction f of a stack's
    layers that makes it save per layer what preset ``n`` saves (the straight line from
    ``none`` to ``torch``), or None when ``n`` saves more than ``none``."""
    span = per_layer["none"] - per_layer["torch"]
    f = (per_layer["none"] - per_layer[n]) / span if span > 0 else 1.0
    if f < 0:
        return None
    return med["none"] + min(f, 1.0) * (med["torch"] - med["none"]), f


def goals(saved, per_layer, med, formula, input_bytes):
    """(description, figure, ok) per goal of the GPU validation, for the rows present. The
    memory goals use the per-layer bytes: what one more layer of a model keeps."""
    out = []
    for n in formula:  # the fused presets, and their @amp / @compiled rows
        if n in saved and n.split("@")[0] in FUSED_PRESETS:
            out.append((f"{n} saves <= its formula (one layer, cos/sin included)",
                        f"{saved[n] / 2**20:.3f} vs {formula[n] / 2**20:.3f} MiB",
                        saved[n] <= formula[n]))
    limits = {"min_memory": ("the layer input", input_bytes, 1.05, 1.20),
              "balanced": ("none's", per_layer["none"], 1 / 8, 1.10),
              "fast": ("none's", per_layer["none"], 1 / 2, 0.95)}
    for n, (what, ref, mem_cap, time_cap) in limits.items():
        if n not in saved:
            continue
        out.append((f"{n} saves per layer <= {mem_cap:.3g}x {what} bytes",
                    f"{per_layer[n] / ref:.4f}x", per_layer[n] <= mem_cap * ref))
        out.append((f"{n} steps <= {time_cap:.2f}x none", f"{med[n] / med['none']:.3f}x",
                    med[n] <= time_cap * med["none"]))
    if "torch" in saved:
        for n in FUSED_PRESETS:
            if n not in saved:
                continue
            line = torch_line_time(n, per_layer, med)
            if line is None:
                out.append((f"{n} beats torch at its memory point", "saves more than none",
                            False))
                continue
            t_line, f = line
            ok = med[n] < t_line and (f <= 1 or per_layer[n] <= per_layer["torch"])
            out.append((f"{n} beats torch at its memory point (f={min(f, 1):.2f})",
                        f"{med[n] / t_line:.3f}x torch's time there", ok))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama7b", action="store_true",
                   help="H=4096, 32/32 heads, I=11008, B=1, S=4096, bf16 on CUDA (options "
                        "given explicitly still win)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--strict", action="store_true",
                   help="exit non-zero when any goal is missed (implied by --llama7b); "
                        "otherwise only a preset saving more than its formula fails the run")
    p.add_argument("--amp", choices=["bfloat16", "float16"],
                   help="add <preset>@amp rows: fp32 master weights under torch.autocast")
    p.add_argument("--compile", action="store_true",
                   help="add <preset>@compiled rows (torch.compile of the layer)")
    p.add_argument("--lora", type=int, metavar="R",
                   help="add PEFT LoRA rows (rank R, every projection; needs peft)")
    p.add_argument("--lora-dropout", type=float, default=0.05, metavar="P",
                   help="the LoRA rows' lora_dropout (default 0.05)")
    p.add_argument("--device")
    p.add_argument("--csv", help="where to write the table (default: "
                                 "bench/results/block_<device>.csv)")
    args = p.parse_args(argv)
    defaults = dict(hidden=512, heads=8, kv_heads=2, intermediate=1376, seq=1024, batch=2,
                    dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu")
    if args.llama7b:
        defaults.update(LLAMA7B)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    if "none" not in args.presets:
        args.presets.insert(0, "none")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda (or --llama7b) needs a CUDA GPU; this torch sees none")
    if args.lora is not None and args.lora < 1:
        p.error(f"--lora must be a rank >= 1, got {args.lora}")
    if not 0.0 <= args.lora_dropout < 1.0:
        p.error(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden ({args.hidden}) must divide by --heads ({args.heads}) and --heads by "
                f"--kv-heads ({args.kv_heads})")
    return args


class Measured:
    """Per row name: saved bytes of one layer, per-layer bytes, peak bytes of a step, median step
    seconds, max gradient difference from ``none``; and the formulas of the fused rows."""

    def __init__(self):
        self.saved, self.per_layer, self.peak, self.med, self.err, self.formula = (
            {}, {}, {}, {}, {}, {})
        self.input_bytes = 0


def build_rows(args, device, dtype):
    """(rows, inputs, restore): rows maps a name to (forward(x, pe), parameters, set-up before
    each use, inputs key); inputs maps a key to (x, (cos, sin), grad_out); restore() puts HF's
    model back as it was (or None without the hf rows)."""
    h, hq, hkv, i, s, b = (args.hidden, args.heads, args.kv_heads, args.intermediate, args.seq,
                           args.batch)
    d = h // hq
    torch.manual_seed(0)
    layer = DecoderLayer(h, hq, hkv, i, policy="none").to(device, dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
    pe = rope(s, d, dtype, device)
    grad_out = torch.randn(b, s, h, device=device, dtype=dtype)

    inputs = {"": (x, pe, grad_out)}
    rows = {}
    for name in args.presets:
        rows[name] = (layer, list(layer.parameters()),
                      lambda name=name: setattr(layer, "policy", name), "")
    model = None
    if not args.no_hf:
        eps = layer.input_layernorm.variance_epsilon
        model, hfl = hf_layer(layer, h, hq, hkv, i, eps, device, dtype)
    if model is not None:
        fwd = hf_step_fn(hfl)
        # transformers >= 5.2x renamed the switch (the old name warns); 5.17 has only the old
        on = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        off = getattr(model, "activation_checkpointing_disable",
                      model.gradient_checkpointing_disable)
        rows["hf"] = (fwd, list(hfl.parameters()), off, "")
        rows["hf_gc"] = (fwd, list(hfl.parameters()), on, "")
    fused_rows = [n for n in args.presets if n in FUSED_PRESETS]
    if args.amp:
        amp = DTYPES[args.amp]
        master = DecoderLayer(h, hq, hkv, i, policy="none").to(device)
        master.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
        inputs["amp"] = (x.detach().float().requires_grad_(), rope(s, d, torch.float32, device),
                         grad_out.float())

        def amp_fwd(x, pe):
            with torch.autocast(device.type, dtype=amp):
                return master(x, pe)
        for name in ["none"] + fused_rows:
            rows[f"{name}@amp"] = (amp_fwd, list(master.parameters()),
                                   lambda name=name: setattr(master, "policy", name), "amp")
    if args.compile:
        backend = "inductor" if device.type == "cuda" else "aot_eager"
        for name in fused_rows:
            twin = DecoderLayer(h, hq, hkv, i, policy=name).to(device, dtype)
            twin.load_state_dict(layer.state_dict())
            rows[f"{name}@compiled"] = (torch.compile(twin, backend=backend, fullgraph=True),
                                        list(twin.parameters()), lambda: None, "")
    if args.lora:
        lora_rows(args, rows, model, fused_rows)
    return rows, inputs, (rows["hf"][2] if model is not None else None)


def lora_rows(args, rows, model, fused_rows):
    """hf@lora and <preset>@lora: a copy of HF's layer with PEFT adapters, and the fused op on
    its tensors (what a patched PEFT model runs)."""
    if model is None:
        print("--lora needs transformers (the hf rows): no LoRA rows")
        return
    try:
        import peft
    except ImportError as exc:
        print(f"peft not importable ({exc}): no LoRA rows")
        return
    import copy

    from ckpt_ext.blocks import LayerOptions, decoder_layer
    from ckpt_ext.hf.families import LLAMA
    from ckpt_ext.hf.patch import _layer_tensors

    lora_model = copy.deepcopy(model)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft.inject_adapter_in_model(peft.LoraConfig(
        r=args.lora, lora_alpha=2 * args.lora, lora_dropout=args.lora_dropout,
        target_modules=targets, init_lora_weights=False), lora_model)
    layer = lora_model.layers[0].train()
    for name, t in layer.named_parameters():
        t.requires_grad_("lora_" in name)
    params = [t for t in layer.parameters() if t.requires_grad]
    rows["hf@lora"] = (hf_step_fn(layer), params, lambda: None, "")
    attn = layer.self_attn
    hq, hkv = args.heads, args.kv_heads
    eps = layer.input_layernorm.variance_epsilon

    def fused(preset):
        def fwd(x, pe):
            weights, scaling, dropout, _ = _layer_tensors(layer, LLAMA)  # no fused projections
            seed = torch.randint(2**31 - 1, (), dtype=torch.int64) if dropout else None
            return decoder_layer(x, LayerOptions(
                weights=weights, cos=pe[0], sin=pe[1], lora_scaling=scaling,
                lora_dropout=dropout, dropout_seed=seed, num_heads=hq, num_kv_heads=hkv,
                eps=eps, scale=attn.scaling, preset=preset))
        return fwd
    for name in fused_rows:
        rows[f"{name}@lora"] = (fused(name), params, lambda: None, "")


def measure(args) -> Measured:
    """Saved bytes, peak memory, step times (interleaved repetitions) and gradient
    differences of every row."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    h, hq, hkv, i, s, b = (args.hidden, args.heads, args.kv_heads, args.intermediate, args.seq,
                           args.batch)
    d = h // hq
    rows, inputs, restore = build_rows(args, device, dtype)

    def step(name):
        fwd, params, _, key = rows[name]
        xi, pei, gi = inputs[key]
        for t in [xi] + params:
            t.grad = None
        fwd(xi, pei).backward(gi)

    m = Measured()
    grads, times = {}, {n: [] for n in rows}
    for name, (fwd, params, setup, key) in rows.items():
        setup()
        xi, pei, _ = inputs[key]
        m.saved[name] = ckpt_ext.saved_activation_bytes(fwd, xi, pei)
        # a second layer on top adds what each further layer of a model adds: the shared cos
        # and sin tables, saved by the first, count once
        m.per_layer[name] = ckpt_ext.saved_activation_bytes(
            lambda x, pe: fwd(fwd(x, pe), pe), xi, pei) - m.saved[name]
        step(name)  # warm-up (Triton compiles here), and the gradients to compare
        grads[name] = [t.grad.float().clone() for t in [xi] + params]
        # peak above what is resident before a step (weights, inputs, grad_out): the CUDA
        # allocator's statistics, or on CPU the profiler's memory events (an untimed step)
        for t in [xi] + params:  # as step() does first, so that the base excludes the grads
            t.grad = None
        m.peak[name] = ckpt_ext.peak_memory_bytes(lambda x: step(name), xi)
    for _ in range(args.reps):  # interleaved repetitions
        for name, (_, _, setup, _) in rows.items():
            setup()
            sync(device)
            clock = Clock(device)
            clock.mark()
            step(name)
            clock.mark()
            times[name].append(clock.elapsed_ms(0, 1) / 1e3)
    if restore is not None:
        restore()
    m.med = {n: median(v) for n, v in times.items()}
    def err(n):  # the LoRA rows' gradients are the adapters': compared with hf@lora's
        ref = "hf@lora" if n.endswith("@lora") else "none"
        if ref == "hf@lora" and args.lora_dropout > 0:
            return float("nan")  # PEFT's and the fused op's masks differ
        return max((a - r).abs().max().item() for a, r in zip(grads[n], grads[ref]))
    m.err = {n: err(n) for n in rows}
    fused_rows = [n for n in args.presets if n in FUSED_PRESETS]
    m.formula = {n: saved_bytes(n, B=b, S=s, H=h, Hq=hq, Hkv=hkv, D=d, I=i, dtype=dtype)
                 for n in args.presets if n != "none"}
    m.formula.update({f"{n}@amp": saved_bytes(n, B=b, S=s, H=h, Hq=hq, Hkv=hkv, D=d, I=i,
                                              dtype=torch.float32,
                                              compute_dtype=DTYPES[args.amp])
                      for n in fused_rows if args.amp})
    m.formula.update({f"{n}@compiled": m.formula[n] for n in fused_rows if args.compile})
    m.formula.update({f"{n}@lora": saved_bytes(n, B=b, S=s, H=h, Hq=hq, Hkv=hkv, D=d, I=i,
                                               dtype=dtype, lora_dropout=args.lora_dropout > 0)
                      for n in fused_rows if args.lora and f"{n}@lora" in rows})
    m.input_bytes = b * s * h * torch.empty((), dtype=dtype).element_size()
    return m


CSV_FIELDS = ["row", "saved_bytes", "formula_bytes", "per_layer_bytes", "per_layer_vs_none",
              "peak_bytes", "time_s", "time_vs_none", "time_vs_torch", "max_grad_err_vs_none"]


def report(args, m: Measured):
    """Print the table and the goals; return (csv rows, goal checks)."""
    h, hq, hkv, i, s, b = (args.hidden, args.heads, args.kv_heads, args.intermediate, args.seq,
                           args.batch)
    print(f"device: {device_name(args.device)}; {args.dtype}; B={b} S={s} H={h} heads={hq}/{hkv} "
          f"I={i}; layer input {m.input_bytes / 2**20:.1f} MiB")
    med, per_layer = m.med, m.per_layer
    t_torch = med.get("torch")
    mib = lambda v: f"{v / 2**20:.3f}" if v is not None else "nan"  # noqa: E731
    print(f"{'row':<12}{'saved MiB':>11}{'formula MiB':>13}{'/layer MiB':>12}{'x none':>8}"
          f"{'peak MiB':>10}{'time ms':>10}{'t/none':>8}{'t/torch':>9}{'max|dgrad|':>12}")
    csv_rows = []
    for n in med:
        rel_t = med[n] / t_torch if t_torch else float("nan")
        rel_m = per_layer[n] / per_layer["none"]
        print(f"{n:<12}{mib(m.saved[n]):>11}{mib(m.formula.get(n)):>13}{mib(per_layer[n]):>12}"
              f"{rel_m:8.4f}{mib(m.peak.get(n)):>10}{med[n] * 1e3:10.2f}"
              f"{med[n] / med['none']:8.3f}{rel_t:9.3f}{m.err[n]:12.2e}")
        csv_rows.append([n, m.saved[n], m.formula.get(n, ""), per_layer[n], f"{rel_m:.5f}",
                         m.peak.get(n, ""), f"{med[n]:.6f}", f"{med[n] / med['none']:.4f}",
                         f"{rel_t:.4f}", f"{m.err[n]:.3e}"])
    print("saved: one layer's saved bytes (cos/sin included); /layer: what each further layer "
          "of a model adds; x none: /layer over none's; peak: allocated above the resident "
          "weights and inputs during a step (ckpt_ext.peak_memory_bytes)")

    checks = goals(m.saved, per_layer, med, m.formula, m.input_bytes)
    binding = args.llama7b or args.strict
    print("goals" + ("" if binding else " (informational: they are set for --llama7b on a GPU; "
                                         "--strict makes a miss fail this run)"))
    for what, figure, ok in checks:
        print(f"  [{'ok' if ok else 'MISSED'}] {what}: {figure}")
    return csv_rows, checks


def write(args, csv_rows, checks):
    """The CSV: provenance, the configuration and the goals as header lines, then the rows."""
    device = torch.device(args.device)
    path = args.csv or os.path.join(RESULTS, f"block_{device.type}.csv")
    header = provenance(device) + [
        f"config: dtype={args.dtype} B={args.batch} S={args.seq} H={args.hidden} "
        f"Hq={args.heads} Hkv={args.kv_heads} I={args.intermediate} reps={args.reps}"]
    header += [f"goal {'ok' if ok else 'MISSED'}: {what}: {figure}" for what, figure, ok in checks]
    write_csv(path, header, CSV_FIELDS, csv_rows)
    return path


def main(argv=None):
    args = parse_args(argv)
    csv_rows, checks = report(args, measure(args))
    write(args, csv_rows, checks)
    binding = args.llama7b or args.strict
    formulas_ok = all(ok for what, _, ok in checks if "formula" in what)
    return formulas_ok and (all(ok for _, _, ok in checks) or not binding)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
