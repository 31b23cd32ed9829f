"""LM head + cross-entropy benchmark: HF's head and loss vs ``ckpt_ext.ops.linear_cross_entropy``
vs a chunked plain-PyTorch baseline (and TRL's fused head when ``trl`` is importable).

For every (vocab, tokens) case, in one run and on the same weights, hidden (T, H) -> mean loss:

* ``hf``      - ``F.linear(hidden, W).float()`` then ``F.cross_entropy(..., ignore_index=-100)``,
  what ``LlamaForCausalLM`` with ``ForCausalLMLoss`` runs (labels already shifted). Autograd
  keeps the fp32 log-softmax, T x V x 4 bytes.
* ``chunked`` - the same math over chunks of ``--chunk`` tokens, each chunk under
  ``torch.utils.checkpoint``: only the chunks' inputs are saved, the chunk logits recomputed
  in backward (plain PyTorch; a (chunk, V) fp32 transient).
* ``fused``   - ``ckpt_ext.ops.linear_cross_entropy``: Triton on a GPU (the ATen CPU kernels
  on CPU); keeps hidden, labels and an fp32 lse per token.
* ``trl``     - TRL's ``ChunkedLogProbFunction`` (its ``add_fused_lm_head`` kernel), when
  ``trl`` is importable: -sum(log p(label)) / count.

Reported per variant: forward / backward / total ms per step (CUDA events or host clock, warmup,
median); the peak memory of a step above what was allocated before it (GPU only; includes
dW and dhidden, the same for all); the bytes saved for backward
(``ckpt_ext.saved_activation_bytes``); the max abs difference of loss and gradients to ``hf``.

GPU (default: LLaMA-3-8B H 4096, vocab 32000 and 128256, 4k/8k/16k tokens, bf16)::

    python bench/lm_head.py [--vocab 32000 128256] [--tokens 4096 8192 16384] [--reps 10]

Without a GPU: CPU figures at small sizes (H 256, T 512, the same vocabularies; ATen CPU
kernels, NOT GPU predictions), then a smoke run of the Triton kernels through the interpreter
at a tiny size (checks the plumbing only: NOT a performance figure). Writes
``bench/results/lm_head_<device>.csv`` (``lm_head_cpu.csv`` on CPU).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import ckpt_ext  # noqa: E402
from _harness import (device_name, device_tag, peak_mib, print_table, provenance,  # noqa: E402
                      time_steps, write_csv)
from ckpt_ext._backend import use_triton  # noqa: E402

try:
    from trl.kernels import ChunkedLogProbFunction
except Exception:  # noqa: BLE001 - trl missing or unusable: the row is left out
    ChunkedLogProbFunction = None

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IGNORE = -100
CPU_LABEL = "CPU run: ATen kernels (and a Triton interpreter smoke row), NOT GPU figures"


def hf_head(h, w, labels, chunk):
    logits = F.linear(h, w).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE)


def _chunk_sum(hc, w, lc):
    return F.cross_entropy(F.linear(hc, w).float(), lc, ignore_index=IGNORE, reduction="sum")


def chunked_head(h, w, labels, chunk):
    total = 0.0
    for t0 in range(0, h.shape[0], chunk):
        total = total + checkpoint(_chunk_sum, h[t0:t0 + chunk], w, labels[t0:t0 + chunk],
                                   use_reentrant=False)
    return total / (labels != IGNORE).sum().clamp(min=1)


def fused_head(h, w, labels, chunk):
    return ckpt_ext.ops.linear_cross_entropy(h, w, labels, ignore_index=IGNORE)


def trl_head(h, w, labels, chunk):
    mask = labels != IGNORE
    log_probs = ChunkedLogProbFunction.apply(h, w, None, labels.clamp(min=0), 1.0, 32768, None,
                                             1.0, ("log_probs",))[0]
    return -(log_probs * mask).sum() / mask.sum().clamp(min=1)


VARIANTS = {"hf": hf_head, "chunked": chunked_head, "fused": fused_head, "trl": trl_head}


def measure(fn, h, w, labels, chunk, warmup, reps):
    """Median forward / backward / total ms; peak MiB of one step above what was allocated
    before it (GPU); MiB saved for backward; (loss, dh, dw) of the last step."""
    def step(clock=None):
        h.grad = w.grad = None
        if clock:
            clock.mark()
        loss = fn(h, w, labels, chunk)
        if clock:
            clock.mark()
        loss.backward()
        if clock:
            clock.mark()
        return loss.detach()

    times = time_steps(step, warmup, reps)
    h.grad = w.grad = None
    peak = peak_mib(step)
    loss = step(None)  # the result compared across variants
    grads = (h.grad.detach().clone(), w.grad.detach().clone())
    h.grad = w.grad = None
    saved = ckpt_ext.saved_activation_bytes(fn, h, w, labels, chunk) / 2**20
    return {**times, "peak_mib": peak, "saved_mib": saved, "result": (loss,) + grads}


def run_case(variants, V, H, T, dtype, device, chunk, warmup, reps, tag=""):
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(T, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = torch.nn.Parameter((torch.randn(V, H, generator=g) * H ** -0.5).to(device=device,
                                                                            dtype=dtype))
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.1] = IGNORE
    labels = labels.to(device)
    res = {v: measure(VARIANTS[v], h, w, labels, chunk, warmup, reps) for v in variants}
    ref = res["hf"]["result"] if "hf" in res else None
    rows = []
    for v, r in res.items():
        diff = (max((a.float() - b.float()).abs().max().item() for a, b in zip(r["result"], ref))
                if ref is not None else math.nan)
        base = res.get("hf", r)
        rows.append({"variant": v + tag, "V": V, "H": H, "tokens": T,
                     "dtype": str(dtype).replace("torch.", ""),
                     **{k: r[k] for k in ("fwd_ms", "bwd_ms", "total_ms", "peak_mib",
                                          "saved_mib")},
                     "total_x_hf": r["total_ms"] / base["total_ms"],
                     "saved_x_hf": r["saved_mib"] / base["saved_mib"],
                     "max_diff_vs_hf": diff})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", nargs="+", type=int, default=[32000, 128256])
    ap.add_argument("--hidden", type=int, default=4096 if CUDA else 256)
    ap.add_argument("--tokens", nargs="+", type=int,
                    default=[4096, 8192, 16384] if CUDA else [512])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if CUDA else "fp32")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of 'chunked'")
    ap.add_argument("--warmup", type=int, default=3 if CUDA else 1)
    ap.add_argument("--reps", type=int, default=10 if CUDA else 2)
    ap.add_argument("--no-smoke", action="store_true", help="CPU: skip the interpreter row")
    ap.add_argument("--out", default=None, help="CSV path (default bench/results/"
                                                "lm_head_<device>.csv)")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if CUDA else "cpu")
    dtype = DTYPES[args.dtype]
    variants = ["hf", "chunked", "fused"] + (["trl"] if ChunkedLogProbFunction and CUDA else [])
    if not CUDA:
        print(CPU_LABEL)
    rows = []
    for V in args.vocab:
        for T in args.tokens:
            rows += run_case(variants, V, args.hidden, T, dtype, device, args.chunk,
                             args.warmup, args.reps)
    if not CUDA and not args.no_smoke:
        # The Triton kernels through the interpreter: plumbing only, not a performance figure.
        with use_triton("cpu"):
            rows += run_case(["hf", "fused"], 500, 64, 48, torch.float32, device, 16, 0, 1,
                             tag="_interp")

    cols = ["variant", "V", "H", "tokens", "dtype", "fwd_ms", "bwd_ms", "total_ms", "total_x_hf",
            "peak_mib", "saved_mib", "saved_x_hf", "max_diff_vs_hf"]
    print(f"device: {device_name(device)}; torch {torch.__version__}; triton {triton.__version__}")
    print_table(cols, rows, ".4g")
    if not CUDA:
        print(CPU_LABEL)
    if ChunkedLogProbFunction is None:
        print("trl not importable: no 'trl' rows")

    out = pathlib.Path(args.out) if args.out else RESULTS / f"lm_head_{device_tag()}.csv"
    write_csv(out, provenance(device, "" if CUDA else CPU_LABEL), cols, rows)


if __name__ == "__main__":
    main()
