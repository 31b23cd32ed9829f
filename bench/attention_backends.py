"""Attention per backend at the attention issue's shapes, the layer's own chunk calls included.

Rows (GPU defaults: bf16, D 128, Hq/Hkv 32/8, causal, B 1): whole sequences S 32K and 8K
(``--seqs``; the first runs first, the others last), and the layer's query chunks against
all their keys (``--chunks Sq:Sk``): the chunk rows ``plan.layer_chunk_rows`` gives at LLaMA-3-8B dims under the kernels' byte cap
(282 at 64 MiB), and 1056 rows (two waves of 128-row programs for 32 heads on 132 SMs), each
the last chunk of S 32K (and of S 128K for the 282 rows), i.e. causal aligned to the bottom
right (query i at position Sk - Sq + i).

Providers, each timed forward and forward+backward (``_harness.time_ms``: do_bench's median on
a GPU, the host clock on the CPU) and checked against ``ops``'s output (relative error, so that
a backend computing another function, e.g. top-left causal on a chunk, shows):

* ``ops``: ``ckpt_ext.ops.attention`` (its own routing; ``q_offset`` for chunks);
* ``flash``, ``cudnn``, ``efficient``: torch's aten ops, K/V unexpanded (GQA) where the op takes
  them, else expanded inside the timed call (the note says so); chunks with ``is_causal``
  (right only where the op aligns bottom-right: the error column tells), and ``efficient`` on
  chunks through ``_efficient_attention_forward``'s bottom-right mask type;
* ``cpu_flash`` (default on the CPU only): ``_scaled_dot_product_flash_attention_for_cpu``,
  top-left causal, so that a CPU run goes through the timing and the error check too.

FLOPs: 4 Hq D per visible (query, key) pair forward, 3.5x that forward+backward. A failing
provider prints its error in the note and the run goes on.

    python bench/attention_backends.py [--seqs 8192 32768] [--chunks 282:32768 1056:32768]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_ext.ops as ops  # noqa: E402
from ckpt_ext import plan  # noqa: E402
from _harness import print_table, provenance, time_ms  # noqa: E402

aten = torch.ops.aten
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROVIDERS = ("ops", "flash", "cudnn", "efficient", "cpu_flash")


def default_chunks(D=128):
    """The layer's chunk rows at LLaMA-3-8B dims (bf16, the 64 MiB default cap) and 1056."""
    dims = plan.LayerDims(4096, 32, 8, D, 14336)
    rows = plan.layer_chunk_rows(dims, 2, 64 << 20)
    return [f"{rows}:32768", "1056:32768", f"{rows}:131072"]


def expand(t, g):
    return t if g == 1 else t.repeat_interleave(g, 1)


def provider_fn(name, q, k, v, chunk, scale):
    """(fn(q, k, v) -> out (B, Hq, Sq, D), note) for one provider."""
    g = q.shape[1] // k.shape[1]
    Sq, Sk = q.shape[2], k.shape[2]
    if name == "ops":
        return (lambda q, k, v: ops.attention(q, k, v, causal=True, scale=scale,
                                              q_offset=Sk - Sq)), ""
    if name == "flash":
        def call(q, k, v, g=1):
            return aten._scaled_dot_product_flash_attention(
                q, expand(k, g), expand(v, g), 0.0, True, False, scale=scale)[0]
    elif name == "cudnn":
        def call(q, k, v, g=1):
            return aten._scaled_dot_product_cudnn_attention(
                q, expand(k, g), expand(v, g), None, True, 0.0, True, False, scale=scale)[0]
    elif name == "efficient" and not chunk:
        def call(q, k, v, g=1):
            return aten._scaled_dot_product_efficient_attention(
                q, expand(k, g), expand(v, g), None, True, 0.0, True, scale=scale)[0]
    elif name == "efficient":
        def call(q, k, v, g=1):   # custom_mask_type 2: causal from the bottom right
            return aten._efficient_attention_forward(
                q.transpose(1, 2), expand(k, g).transpose(1, 2), expand(v, g).transpose(1, 2),
                None, None, None, Sq, Sk, 0.0, 2, True, scale=scale)[0].transpose(1, 2)
    elif name == "cpu_flash":   # the CPU's flash kernel (top-left causal): the dry run's
        def call(q, k, v, g=1):   # stand-in for the CUDA ops
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, expand(k, g), expand(v, g), 0.0, True, scale=scale)[0]
    else:
        raise ValueError(name)
    try:                            # GQA unexpanded, if the op takes it
        with torch.no_grad():
            call(q, k, v)
        return call, ""
    except Exception as exc:        # noqa: BLE001
        first = (str(exc).strip().splitlines() or [""])[0][:60]
        return (lambda q, k, v: call(q, k, v, g)), f"K/V expanded ({type(exc).__name__}: {first})"


def bench_row(name, B, Hq, Hkv, Sq, Sk, D, dtype, device, warmup, reps, ref):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=gen, device=device, dtype=dtype)
    dout = torch.randn(B, Hq, Sq, D, generator=gen, device=device, dtype=dtype)
    scale = D ** -0.5
    pairs = B * (Sq * (Sk - Sq) + Sq * (Sq + 1) // 2)
    flops = 4.0 * Hq * D * pairs
    row = dict(provider=name, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, fwd_ms=math.nan,
               fb_ms=math.nan, fwd_tflops=math.nan, fb_tflops=math.nan, rel_err=math.nan,
               note="")
    try:
        fn, row["note"] = provider_fn(name, q, k, v, Sq < Sk, scale)
        with torch.no_grad():
            out = fn(q, k, v)
        if ref.get("out") is None:
            ref["out"] = out.float()
        else:
            r = ref["out"]
            row["rel_err"] = ((out.float() - r).norm() / r.norm()).item()
        del out
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                return fn(q, k, v)

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(dout)

        row["fwd_ms"] = time_ms(fwd, warmup, reps, device)
        row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
        try:
            row["fb_ms"] = time_ms(fwd_bwd, warmup, reps, device)
            row["fb_tflops"] = 3.5 * flops / (row["fb_ms"] * 1e-3) / 1e12
        except Exception as exc:    # noqa: BLE001
            first = (str(exc).strip().splitlines() or [""])[0][:70]
            row["note"] += f" backward: {type(exc).__name__}: {first}"
    except Exception as exc:        # noqa: BLE001
        first = (str(exc).strip().splitlines() or [""])[0][:60]
        row["note"] = f"{type(exc).__name__}: {first}"
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    row["note"] = row["note"].strip()
    return row


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if cuda else "float32")
    p.add_argument("--heads", default="32:8", help="Hq:Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqs", nargs="*", type=int, default=[32768, 8192])
    p.add_argument("--chunks", nargs="*", default=None, help="Sq:Sk pairs (default: the "
                   "layer's chunk rows at LLaMA-3-8B dims and 1056, against 32K keys)")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=None,
                   help="default: ops flash cudnn efficient, and cpu_flash on the CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    Hq, Hkv = (int(x) for x in a.heads.split(":"))
    if a.providers is None:
        a.providers = list(PROVIDERS[:4]) + ([] if a.device.startswith("cuda") else ["cpu_flash"])
    dtype = DTYPES[a.dtype]
    chunks = default_chunks(a.head_dim) if a.chunks is None else a.chunks
    # the first whole sequence, then the chunks, then the other whole sequences: under a
    # timeout the shapes never measured before come early
    chunk_shapes = [tuple(int(x) for x in c.split(":")) for c in chunks]
    shapes = [(S, S) for S in a.seqs[:1]] + chunk_shapes + [(S, S) for S in a.seqs[1:]]
    for line in provenance(a.device, "" if a.device.startswith("cuda")
                           else "CPU run: NOT a performance figure"):
        print(f"# {line}")
    print(f"# {a.dtype}, D {a.head_dim}, Hq/Hkv {Hq}/{Hkv}, B {a.batch}, causal (bottom-right "
          f"on chunks), CKPT_EXT_AUTOTUNE={os.environ.get('CKPT_EXT_AUTOTUNE', '(unset)')}, "
          f"warmup {a.warmup}, reps {a.reps}", flush=True)
    rows = []
    providers = ["ops"] + [x for x in a.providers if x != "ops"]   # ops first: the reference
    for Sq, Sk in shapes:
        ref = {}
        for name in providers:
            r = bench_row(name, a.batch, Hq, Hkv, Sq, Sk, a.head_dim, dtype, a.device,
                          a.warmup, a.reps, ref)
            rows.append(r)
            print(f"  {name:<9} Sq {Sq:>7} Sk {Sk:>7}: fwd {r['fwd_ms']:.3g} ms, f+b "
                  f"{r['fb_ms']:.3g} ms, rel err {r['rel_err']:.2g} {r['note']}", flush=True)
    print()
    print("TFLOP/s (fwd; f+b = 3.5x fwd FLOPs); rel err against ops's output")
    print_table(["provider", "Sq", "Sk", "fwd_ms", "fwd_tflops", "fb_ms", "fb_tflops",
                 "rel_err", "note"], rows, ".3g")
    for Sq, Sk in shapes:   # one line per shape, for the GPU run's summary
        cells = []
        for r in rows:
            if (r["Sq"], r["Sk"]) == (Sq, Sk):
                err = "" if r["provider"] == "ops" else f" (err {r['rel_err']:.1g})"
                cells.append(f"{r['provider']} {r['fb_tflops']:.3g}{err}")
        print(f"shape Sq/Sk {Sq}/{Sk}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
