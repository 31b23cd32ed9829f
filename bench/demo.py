"""The main demo: one LLaMA-style model trained one step at a time under every preset.

For each preset (none / torch / fast / balanced / min_memory by default) on the same weights
and the same batch, it measures

* the peak memory of a training step above what was allocated before it
  (``ckpt_ext.peak_memory_bytes``: the CUDA allocator's statistics on a GPU, the profiler's
  memory events on a CPU, in an untimed step) and the bytes the forward leaves saved for
  backward (``ckpt_ext.saved_activation_bytes``);
* the step time (forward + backward after ``--warmup`` steps: the median of ``--steps``
  steps, CUDA events on a GPU, ``time.perf_counter`` on a CPU), as a ratio to ``none``;
* agreement with ``none``: the loss and every parameter gradient (max abs error, and max over
  parameters of ``max|g - g_none| / max|g_none|``).

The model is an HF ``LlamaForCausalLM`` built from a config and patched with
``ckpt_ext.hf.patch_llama`` (``none`` is HF's own layer, untouched) -- the way users meet the
project. Without transformers (``--model auto`` falls back, or ``--model ckpt_ext``) it is a
stack of ``ckpt_ext.modules.DecoderLayer`` with an embedding and an LM head, where ``none`` is
the plain PyTorch layer. Sizes follow the device found:

* GPU: LLaMA-7B-shaped layers (H 4096, 32 heads, I 11008), S 4096, batch 1, bf16, 4 layers;
* CPU: H 256, 8 heads, I 688, S 256, batch 2, fp32, 4 layers (a couple of minutes on 2 cores).

Setups people train with, on the HF model: ``--amp bfloat16`` runs every step under
``torch.autocast`` with fp32 master weights; ``--compile`` runs the model under
``torch.compile`` (inductor on a GPU, aot_eager on a CPU); ``--lora`` wraps it in a PEFT LoRA
model (rank 8 on every projection, base frozen). The output files get the setup in their name.

Prints a table, writes ``bench/results/demo_<device>.csv`` (device, versions, command and date
in its header) and a Pareto plot of the step's peak memory against step time,
``demo_<device>.png``.

    python bench/demo.py [--layers 8] [--seq 2048] [--presets none balanced] [--steps 5] ...
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckpt_ext
from ckpt_ext.modules import DecoderLayer, RMSNorm
from ckpt_ext.presets import FUSED_PRESETS, PRESETS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (Clock, device_name, device_tag, median, print_table,  # noqa: E402
                      provenance, write_csv)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = {  # device kind -> defaults
    "cuda": dict(hidden=4096, heads=32, kv_heads=32, intermediate=11008, layers=4, vocab=32000,
                 seq=4096, batch=1, dtype="bfloat16", steps=10, warmup=2),
    "cpu": dict(hidden=256, heads=8, kv_heads=8, intermediate=688, layers=4, vocab=1024,
                seq=256, batch=2, dtype="float32", steps=5, warmup=1),
}


# ---- the two models ---------------------------------------------------------------------------

class CkptExtLlama(nn.Module):
    """Embedding, ``ckpt_ext.modules.DecoderLayer`` stack, final RMSNorm, LM head."""

    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(a.hidden, a.heads, a.kv_heads, a.intermediate, rms_norm_eps=1e-5,
                         policy="none") for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, 1e-5, policy="none")
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        self.head_dim = a.hidden // a.heads
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def set_policy(self, preset: str) -> None:
        for layer in self.layers:
            layer.policy = preset

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        d = self.head_dim  # rotary cos/sin as HF's LlamaRotaryEmbedding computes them
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=ids.device).float() / d)
        freqs = torch.arange(ids.shape[1], device=ids.device)[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        pe = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        for layer in self.layers:
            x = layer(x, pe)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class HFLlama(nn.Module):
    """A transformers ``LlamaForCausalLM`` from a config, patched per preset."""

    def __init__(self, a):
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(hidden_size=a.hidden, num_attention_heads=a.heads,
                          num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                          num_hidden_layers=a.layers, vocab_size=a.vocab,
                          max_position_embeddings=max(a.seq, 2048), rms_norm_eps=1e-5,
                          use_cache=False)
        dtype = DTYPES[a.dtype]
        self.model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                      dtype=dtype)
        if a.lora:
            import peft
            self.model = peft.get_peft_model(self.model, peft.LoraConfig(
                r=8, lora_alpha=16, lora_dropout=0.05, target_modules=[
                    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        self.amp = DTYPES[a.amp] if a.amp else None
        self.compile = a.compile
        self.forward_fn = self.model

    def set_policy(self, preset: str) -> None:
        from ckpt_ext.hf import patch_llama

        patch_llama(self.model, preset)
        if self.compile:
            torch._dynamo.reset()
            backend = "inductor" if next(self.model.parameters()).is_cuda else "aot_eager"
            self.forward_fn = torch.compile(self.model, backend=backend)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(ids.device.type, dtype=self.amp or torch.bfloat16,
                            enabled=self.amp is not None):
            return self.forward_fn(input_ids=ids, labels=ids, use_cache=False).loss

    def _layers(self):
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") \
            else self.model
        return inner.model.layers

    def fused_layers(self) -> int:
        """Layers whose forwards so far (since patching) all ran the fused op (not counted
        under torch.compile)."""
        return sum(1 for layer in self._layers()
                   if set(getattr(layer.forward, "calls", {})) == {"fused"})


def build_model(a, device, dtype) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        if a.model == "hf":
            return HFLlama(a).train()  # built in dtype: HF keeps its rotary inv_freq in fp32
        return CkptExtLlama(a).to(dtype).train()


# ---- measuring --------------------------------------------------------------------------------

class Progress:
    """tqdm if installed, else a one-line counter on stderr."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="demo", unit="step", file=sys.stderr)
        except ImportError:
            self.bar, self.n, self.total = None, 0, total

    def update(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
            return
        self.n += 1
        done = int(30 * self.n / self.total)
        sys.stderr.write(f"\rdemo [{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} "
                         f"{what:<24}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")


def step(model, ids) -> float:
    for p in model.parameters():
        p.grad = None
    loss = model.loss(ids)
    loss.backward()
    return loss.item()


def check(model, preset, ids, reference):
    """Saved bytes, and the loss and gradients of one step compared with ``reference`` (the
    ``none`` run's ``(loss, grads)``; None for that run itself). Returns the row and
    ``(loss, grads)``."""
    model.set_policy(preset)
    row = {"preset": preset}
    row["saved_bytes"] = ckpt_ext.saved_activation_bytes(model.loss, ids)
    row["loss"] = loss = step(model, ids)
    grads = [p.grad.detach().float().cpu() for p in model.parameters() if p.grad is not None]
    # the step's peak above what is resident before it (weights, ids; gradients cleared): the
    # CUDA allocator's statistics, on CPU the profiler's memory events (an untimed step)
    for p in model.parameters():
        p.grad = None
    row["peak_bytes"] = ckpt_ext.peak_memory_bytes(step, model, ids)
    if hasattr(model, "fused_layers"):
        row["fused_layers"] = model.fused_layers()
    if reference is not None:
        ref_loss, ref_grads = reference
        row["loss_abs_err"] = abs(loss - ref_loss)
        row["grad_max_abs_err"] = max((g - r).abs().max().item()
                                      for g, r in zip(grads, ref_grads))
        row["grad_max_rel_err"] = max(
            ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            for g, r in zip(grads, ref_grads))
    return row, (loss, grads)


def time_presets(model, rows, ids, device, a, progress) -> None:
    """Step times of every preset, taking the presets in turn step after step so that a change
    in the machine's load hits them all alike."""
    times = {r["preset"]: [] for r in rows}
    for i in range(a.warmup - 1 + a.steps):
        for r in rows:
            preset = r["preset"]
            model.set_policy(preset)
            for p in model.parameters():
                p.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
            clock = Clock(device)
            clock.mark()
            step(model, ids)
            clock.mark()
            if i >= a.warmup - 1:
                times[preset].append(clock.elapsed_ms(0, 1) / 1e3)
            progress.update(f"{preset}: {'warmup' if i < a.warmup - 1 else 'step'}")
    for r in rows:
        r["step_s"] = median(times[r["preset"]])


# ---- reporting --------------------------------------------------------------------------------

def mib(n) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def print_results(rows, device) -> None:
    head = ["preset", "peak MiB", "x none", "saved MiB", "x none", "step ms", "x none", "loss",
            "|dloss|", "grad abs err", "grad rel err"]
    lines = []
    for r in rows:
        cells = [r["preset"], mib(r["peak_bytes"]), f"{r['peak_ratio']:.3f}",
                 mib(r["saved_bytes"]), f"{r['saved_ratio']:.3f}"]
        cells += [f"{1e3 * r['step_s']:.1f}", f"{r['time_ratio']:.2f}", f"{r['loss']:.6f}"]
        cells += [f"{r[k]:.2e}" if k in r else "(ref)" for k in
                  ("loss_abs_err", "grad_max_abs_err", "grad_max_rel_err")]
        lines.append(cells)
    print_table(head, lines, rule=True)


CSV_FIELDS = ["preset", "saved_bytes", "saved_ratio", "peak_bytes", "peak_ratio", "step_s",
              "time_ratio", "loss", "loss_abs_err", "grad_max_abs_err", "grad_max_rel_err",
              "fused_layers"]


def pareto_plot(path, rows, device, title) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    gpu = device.type == "cuda"
    key, label = "peak_bytes", f"peak memory of a step ({'GiB' if gpu else 'MiB'})"
    scale = 2**30 if gpu else 2**20
    pts = [(r["time_ratio"], r[key] / scale, r["preset"]) for r in rows]
    frontier = sorted(p for p in pts if not any(
        q[0] <= p[0] and q[1] <= p[1] and q[:2] != p[:2] for q in pts))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.step([p[0] for p in frontier], [p[1] for p in frontier], where="post", color="0.6",
            lw=1, zorder=1, label="Pareto frontier")
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    labeled, seen_kinds = [], set()
    for t, m, name in pts:
        fused = name in FUSED_PRESETS
        kind = "fused (ckpt_ext)" if fused else "unfused (HF layer / torch.utils.checkpoint)"
        ax.scatter([t], [m], s=60, zorder=2, marker="o" if fused else "s",
                   color="tab:blue" if fused else "tab:gray",
                   label=None if kind in seen_kinds else kind)
        seen_kinds.add(kind)
        crowded = any(abs(t - u) < 0.12 * dx and abs(m - v) < 0.08 * dy for u, v in labeled)
        ax.annotate(name, (t, m), textcoords="offset points",
                    xytext=(6, -14) if crowded else (6, 4))
        labeled.append((t, m))
    ax.set_xlabel("step time / step time of 'none'")
    ax.set_ylabel(label)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available, the default), cuda or cpu")
    p.add_argument("--model", choices=("auto", "hf", "ckpt_ext"), default="auto",
                   help="hf: LlamaForCausalLM patched with patch_llama; ckpt_ext: a "
                        "DecoderLayer stack; auto (default): hf if transformers imports")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS,
                   metavar="PRESET", help=f"presets to compare (default: all of {PRESETS}); "
                   "'none' always runs, first: it is the reference")
    for name in ("hidden", "heads", "kv_heads", "intermediate", "layers", "vocab", "seq",
                 "batch", "steps", "warmup", "dtype"):
        gpu, cpu = SIZES["cuda"][name], SIZES["cpu"][name]
        p.add_argument(f"--{name.replace('_', '-')}", default=None,
                       type=str if name == "dtype" else int,
                       choices=sorted(DTYPES) if name == "dtype" else None,
                       help=f"default: {gpu} on a GPU, {cpu} on a CPU")
    p.add_argument("--amp", choices=["bfloat16", "float16"],
                   help="HF model: every step under torch.autocast (fp32 master weights)")
    p.add_argument("--compile", action="store_true", help="HF model: under torch.compile")
    p.add_argument("--lora", action="store_true",
                   help="HF model: wrapped in a PEFT LoRA model (rank 8, every projection, "
                        "lora_dropout 0.05)")
    p.add_argument("--out", default=RESULTS, help="folder for the CSV and the plot "
                   "(default: bench/results)")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in SIZES["cuda" if a.device.startswith("cuda") else "cpu"].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.model == "auto":
        try:
            import transformers  # noqa: F401
            a.model = "hf"
        except ImportError:
            a.model = "ckpt_ext"
    a.presets = ["none"] + [x for x in dict.fromkeys(a.presets) if x != "none"]
    if (a.amp or a.compile or a.lora) and a.model != "hf":
        p.error("--amp, --compile and --lora apply to the HF model (--model hf)")
    if a.amp and a.dtype != "float32":
        p.error("--amp keeps fp32 master weights: use it with --dtype float32")
    a.warmup = max(a.warmup, 1)
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"--hidden {a.hidden} must be divisible by --heads {a.heads}, and --heads by "
                f"--kv-heads {a.kv_heads}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    model = build_model(a, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    shape = (f"{a.layers} layers, H {a.hidden}, {a.heads}/{a.kv_heads} heads, I {a.intermediate},"
             f" vocab {a.vocab}, B {a.batch}, S {a.seq}, {a.dtype}, {n_params / 1e6:.1f}M params"
             + (f", autocast {a.amp}" if a.amp else "") + (", compiled" if a.compile else "")
             + (", LoRA r8 (dropout 0.05)" if a.lora else ""))
    model_desc = ("transformers LlamaForCausalLM + ckpt_ext.hf.patch_llama" if a.model == "hf"
                  else "ckpt_ext.modules.DecoderLayer stack")
    print(f"device: {device_name(device)}; torch {torch.__version__}")
    print(f"model: {model_desc}: {shape}")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)

    progress = Progress(len(a.presets) * (1 + a.warmup - 1 + a.steps))
    rows, reference = [], None
    for preset in a.presets:  # 'none' first: the reference
        row, result = check(model, preset, ids, reference)
        reference = reference or result
        rows.append(row)
        progress.update(f"{preset}: check")
    time_presets(model, rows, ids, device, a, progress)
    progress.close()
    base = rows[0]
    for r in rows:
        r["saved_ratio"] = r["saved_bytes"] / base["saved_bytes"]
        r["time_ratio"] = r["step_s"] / base["step_s"]
        r["peak_ratio"] = r["peak_bytes"] / max(base["peak_bytes"], 1)
    print()
    print_results(rows, device)
    if a.model == "hf" and not a.compile:
        for r in rows:
            if r["preset"] in FUSED_PRESETS and r.get("fused_layers") != a.layers:
                print(f"warning: with preset {r['preset']!r} only {r.get('fused_layers')} of "
                      f"{a.layers} layers ran the fused op")

    os.makedirs(a.out, exist_ok=True)
    slug = device_tag(device=device) + "".join(
        f"_{tag}" for tag, on in (("amp", a.amp), ("compiled", a.compile), ("lora", a.lora)) if on)
    stem = os.path.join(a.out, f"demo_{slug}")
    header = provenance(device) + [
        f"model: {model_desc}: {shape}",
        "saved_bytes: ckpt_ext.saved_activation_bytes of the loss forward; peak_bytes: "
        "ckpt_ext.peak_memory_bytes of a step (allocated above the weights and the batch; CUDA "
        "allocator statistics, on CPU the profiler's memory events); step_s: forward+backward, "
        f"median of {a.steps} steps after {a.warmup} warmup; errors vs 'none'"]
    write_csv(stem + ".csv", header, CSV_FIELDS, rows)
    pareto_plot(stem + ".png", rows, device,
                f"{model_desc}\n{shape}\n{device_name(device)}")


if __name__ == "__main__":
    main()
