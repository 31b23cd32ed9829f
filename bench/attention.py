"""Benchmark the Triton flash-attention kernels against torch SDPA (flash backend) and eager.

GPU (default sweep): causal, bf16, head_dim 64 (Hq = 32) and 128 (Hq = 16), Hkv = Hq, S in
{1k, 2k, 4k, 8k, 16k} at 16k tokens per batch (B = 16384 // S), plus one GQA row per head_dim
(Hkv = Hq / 4, S = 4k), plus a packed row (documents of 1k tokens packed into S = 8k, given as
segment ids) and a sliding-window row (window 1k, S = 8k) per head_dim. On the packed and
windowed rows SDPA and eager get the equivalent dense (B, 1, S, S) boolean mask (SDPA then
runs its memory-efficient or math backend: flash takes no mask), and the FLOPs counted are
those of the visible (query, key) pairs only: 4 * Hq * D * pairs forward. Reports forward,
backward and forward+backward TFLOP/s (median over
repetitions, CUDA events, after warmup), prints a table and writes
``bench/results/attention_<device>.csv`` whose header comment records the device, torch and
triton versions, the command and the date.

FLOPs (FlashAttention convention): forward 4 * B * Hq * S^2 * D, halved when causal (masked
rows: 4 * Hq * D * visible pairs); backward 2.5x forward; forward+backward 3.5x forward.

``--backend-rows`` times the op itself (``torch.ops.ckpt_ext.attention_fwd`` / ``_bwd``, any
merge of a query chunk included) with each attention backend pinned (triton under each dQ mode,
``triton:separate`` / ``triton:ordered`` / ``triton:atomic``; flash, cudnn, efficient, their
backwards the deterministic ones where they have one; and auto: the choice table) at the
decoder layer's call shapes: whole sequences and query chunks (Sq = chunk rows, Sk = the keys
they see, dK / dV into fp32 accumulators), and writes
``bench/results/attention_backends_<device>.csv``; ``--write-table FILE`` turns the times into
a choice table (format 2) for ``CKPT_EXT_ATTN_TABLE``. ``--backend-packed-doc N`` times each
shape again with packed documents of N tokens (segment ids: flash's variable-length op or
Triton), which make the table's rules for packed calls. ``--from-csv FILE --write-table OUT``
writes the table from the CSV of an earlier ``--backend-rows`` run (alone, or inside a results
file; no GPU needed), its arch from the CSV's ``arch:`` line, its GPU's name or ``--arch``.

Without a GPU the script runs the kernels under the Triton interpreter at a tiny size, labels
the run "CPU interpreter run: NOT a performance figure", and writes
``bench/results/attention_cpu_smoke.csv``; it exists so that CI exercises this script.

    python bench/attention.py                         # full GPU sweep
    python bench/attention.py --seqlens 2048 --head-dims 128 --reps 10
    python bench/attention.py --cpu-size 1,2,64,16    # CPU smoke size B,H,S,D
    python bench/attention.py --mask-seqlen 16384 --packed-doc 2048 --window 4096
    python bench/attention.py --backend-rows --write-table attention_backends_h100.json
    python bench/attention.py --backend-rows --backend-packed-doc 4096   # packed rows too
    # the shipped table, from the H200 run's results file:
    python bench/attention.py --write-table ckpt_ext/attention_backends.json
        --from-csv bench/results/gpu_h200_2026-11-27/quick_d_attention.txt
"""
import argparse
import math
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402,F401  (after TRITON_INTERPRET; its version goes in the header)

from ckpt_ext import config  # noqa: E402
from ckpt_ext.kernels import attention  # noqa: E402
# the dense attention and mask rule the tests compare with (tests/reference.py re-exports them)
from ckpt_ext.plain import attention as attention_reference  # noqa: E402
from ckpt_ext.plain import attention_allowed as allowed_matrix  # noqa: E402
from _harness import commit, device_tag, provenance, time_ms, write_csv  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd+bwd")
# the Triton providers and the attention_dq setting each runs its backward under (None: the
# environment's)
TRITON_DQ = {"triton": None, "triton_atomic": "atomic", "triton_ordered": "ordered"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="1024,2048,4096,8192,16384",
                   help="comma-separated sequence lengths (GPU)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens // S")
    p.add_argument("--head-dims", default="64,128", help="comma-separated head dims (GPU)")
    p.add_argument("--heads", default="64:32,128:16",
                   help="query heads per head_dim as D:Hq pairs (GPU)")
    p.add_argument("--gqa-seqlen", type=int, default=4096,
                   help="S of the extra GQA row per head_dim (Hkv = Hq/4); 0 disables it")
    p.add_argument("--mask-seqlen", type=int, default=8192,
                   help="S of the packed and windowed rows (GPU); 0 disables them")
    p.add_argument("--packed-doc", type=int, default=1024,
                   help="document length of the packed row (segment ids)")
    p.add_argument("--window", type=int, default=1024, help="window of the sliding-window row")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="GPU dtype")
    p.add_argument("--no-causal", action="store_true", help="benchmark non-causal attention")
    p.add_argument("--providers", default="triton,sdpa,eager",
                   help="comma-separated subset of triton,triton_atomic,triton_ordered,sdpa,"
                        "eager (triton_atomic / triton_ordered: the backward with "
                        "attention_dq='atomic' / 'ordered')")
    p.add_argument("--warmup", type=int, default=None, help="warmup iterations (GPU 5, CPU 1)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (GPU 30, CPU 3)")
    p.add_argument("--cpu-size", default="1,2,64,16", help="B,H,S,D of the CPU interpreter smoke run")
    p.add_argument("--out", default=None, help="CSV path (default bench/results/attention_<device>.csv)")
    # Rows per attention backend at the decoder layer's own call shapes (instead of the sweep).
    p.add_argument("--backend-rows", action="store_true",
                   help="time ckpt_ext's attention op with each backend pinned (--backends) at "
                        "whole sequences (--backend-seqlens) and at the sequence-tiled layer's "
                        "query chunks (--chunk-rows x --chunk-keys), instead of the sweep; "
                        "writes bench/results/attention_backends_<device>.csv")
    p.add_argument("--backends", default="triton,flash,cudnn,efficient,auto",
                   help="attention_backend values timed by --backend-rows ('auto': the table; "
                        "'auto:strict': the table as under torch.use_deterministic_algorithms("
                        "True); 'triton': its backward under each dQ mode, the rows "
                        "triton:separate, triton:ordered, triton:atomic; 'triton:<mode>' one of "
                        "them)")
    p.add_argument("--backend-shape", default="1,32,8,128",
                   help="B,Hq,Hkv,D of the --backend-rows calls (default LLaMA-3-8B heads)")
    p.add_argument("--backend-seqlens", default="8192,32768",
                   help="whole-sequence lengths of --backend-rows (Sq = Sk = S)")
    p.add_argument("--chunk-rows", default="282,1056",
                   help="query rows per chunk of --backend-rows (Sq; 282: the default 64 MiB "
                        "chunk cap at LLaMA-3-8B dims, 1056: two waves of 128-row programs on "
                        "132 SMs at 32 heads)")
    p.add_argument("--chunk-keys", default="8192,32768",
                   help="keys each chunk sees (Sk; the chunk is the last rows: q_offset = "
                        "Sk - Sq)")
    p.add_argument("--layer-dims", default="", metavar="H,HQ,HKV,D,I",
                   help="with --backend-rows: also the calls the sequence-tiled decoder layer "
                        "of these dims makes at each --layer-seqlens S (its own chunk rows, "
                        "ckpt_ext.plan.layer_chunk_rows at --chunk-bytes; each chunk's Sk = "
                        "the keys it sees, s0 + rows): the first, a middle and the last chunk "
                        "(e.g. 4096,32,8,128,14336 for LLaMA-3-8B; its heads and head dim must "
                        "be --backend-shape's)")
    p.add_argument("--layer-seqlens", default="32768",
                   help="sequence lengths S of the --layer-dims calls")
    p.add_argument("--chunk-bytes", default=None,
                   help="the layer's chunk byte cap for --layer-dims (bytes or KiB/MiB/GiB; "
                        "default: the kernels' own, CKPT_EXT_CHUNK_BYTES, 64 MiB unless set)")
    p.add_argument("--sms", type=int, default=None,
                   help="the GPU's multiprocessors for --layer-dims, whose chunks on CUDA hold "
                        "at least the rows that fill them and the GEMMs' minimum "
                        "(ckpt_ext._C.cuda_min_rows); "
                        "default: the CUDA device's when there is one, else 0 (the CPU's chunks)")
    p.add_argument("--backend-packed-doc", type=int, default=0, metavar="N",
                   help="with --backend-rows: also each shape packed, documents of N tokens "
                        "given as segment ids (padded and packed calls: flash's variable-length "
                        "op or Triton); 0: none")
    p.add_argument("--write-table", default=None, metavar="FILE",
                   help="with --backend-rows or --from-csv: write an attention backend choice "
                        "table from the measured times (CKPT_EXT_ATTN_TABLE=FILE makes 'auto' "
                        "read it)")
    p.add_argument("--from-csv", default=None, metavar="FILE",
                   help="with --write-table: the times of a --backend-rows CSV (alone, or the "
                        "CSV inside a results file), measured elsewhere; no GPU needed")
    p.add_argument("--arch", default=None,
                   help="with --from-csv: the table's arch (e.g. sm90) when the CSV does not "
                        "record it (an 'arch:' line) and its device is not a known GPU")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------
# Providers: each returns {mode: callable} for one shape
# ------------------------------------------------------------------------------------------
def eager_attention(q, k, v, causal, scale, allowed=None):
    """Plain PyTorch: S x S scores, fp32 softmax. q (B, Hq, S, D), k/v (B, Hkv, S, D);
    allowed: None or the dense bool (B, 1, S, S) mask, causal included."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif causal:
        S = q.shape[2]
        upper = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def sdpa_attention(q, k, v, causal, scale, allowed=None):
    """torch SDPA restricted to the flash backend on CUDA (default backends on CPU); with a
    dense mask `allowed` (B, 1, S, S) SDPA's own backend choice (flash takes no mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    if allowed is not None:
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    with sdpa_kernel(backend):
        if group > 1:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                      enable_gqa=True)
            except (RuntimeError, TypeError):
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def autograd_fns(fn, q, k, v, dout, causal, scale):
    """fwd / bwd / fwd+bwd callables for an autograd-based implementation."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return fn(*leaves, causal, scale)

    graph = {}

    def prepare_bwd():
        graph["out"] = fn(*leaves, causal, scale)

    def bwd():
        for t in leaves:
            t.grad = None
        graph["out"].backward(dout, retain_graph=True)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        fn(*leaves, causal, scale).backward(dout)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}, prepare_bwd


def with_dq_mode(mode, fn):
    """fn called with the attention_dq setting ``mode`` (the launcher reads it at every
    backward)."""
    def call():
        with config.patch(attention_dq=mode):
            return fn()
    return call


def triton_fns(q, k, v, dout, causal, scale, segment_ids=None, window=None, dq_mode=None,
               q_offset=0, accumulate=False):
    """dq_mode: None (the attention_dq setting, CKPT_EXT_ATTN_DQ) or "separate" / "atomic" /
    "ordered";
    q_offset, accumulate: a query chunk, its dK/dV added into fp32 accumulators (the layer's
    call)."""
    saved = {}
    masks = (None, segment_ids, window)
    B, Hkv, Sk, D = k.shape
    acc = [torch.zeros(B, Sk, Hkv, D, device=q.device, dtype=torch.float32).transpose(1, 2)
           for _ in range(2)] if accumulate else [None, None]

    def fwd():
        return attention.attention_fwd(q, k, v, *masks, causal, scale, q_offset)

    def prepare_bwd():
        saved["out"], saved["lse"] = fwd()

    def bwd():
        return attention.attention_bwd(dout, q, k, v, saved["out"], saved["lse"], *masks, causal,
                                       scale, q_offset, *acc)

    def fwd_bwd():
        out, lse = attention.attention_fwd(q, k, v, *masks, causal, scale, q_offset)
        return attention.attention_bwd(dout, q, k, v, out, lse, *masks, causal, scale, q_offset,
                                       *acc)

    if dq_mode is not None:
        bwd, fwd_bwd = with_dq_mode(dq_mode, bwd), with_dq_mode(dq_mode, fwd_bwd)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}, prepare_bwd


# ------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------
def fwd_flops(B, Hq, S, D, causal):
    return 4.0 * B * Hq * S * S * D * (0.5 if causal else 1.0)


MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def mask_inputs(kind, param, B, S, causal, device):
    """(segment_ids, window, dense allowed (B, 1, S, S) or None, label) of a row: kind None
    (plain causal/full), "packed" (documents of `param` tokens back to back) or "window"."""
    if kind is None:
        return None, None, None, ""
    seg = window = None
    if kind == "packed":
        seg = (torch.arange(S, device=device) // param).expand(B, S).contiguous()
    else:
        window = param
    allowed = allowed_matrix(B, S, None, causal, device, seg, window)
    return seg, window, allowed, f"{kind}:{param}"


def bench_shape(B, Hq, Hkv, S, D, dtype, causal, providers, warmup, reps, device,
                mask_kind=None, mask_param=None):
    """Rows (dicts) for every provider and mode at one shape (and mask: see mask_inputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, Hq, S, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=gen)
    dout = torch.randn(B, Hq, S, D, device=device, dtype=dtype, generator=gen)
    scale = D ** -0.5
    seg, window, allowed, label = mask_inputs(mask_kind, mask_param, B, S, causal, device)
    flops = (fwd_flops(B, Hq, S, D, causal) if allowed is None
             else 4.0 * Hq * D * allowed.sum().item())

    def with_mask(fn):
        return lambda q, k, v, causal, scale: fn(q, k, v, causal, scale, allowed)

    rows = []
    for prov in providers:
        note = ""
        try:
            if prov in TRITON_DQ:  # dQ: the environment's, atomic or ordered
                fns, prepare = triton_fns(q, k, v, dout, causal, scale, seg, window,
                                          TRITON_DQ[prov])
            elif prov == "sdpa":
                fns, prepare = autograd_fns(with_mask(sdpa_attention), q, k, v, dout, causal,
                                            scale)
            else:
                fns, prepare = autograd_fns(with_mask(eager_attention), q, k, v, dout, causal,
                                            scale)
            results = {}
            for mode in MODES:
                if mode == "bwd":
                    prepare()
                results[mode] = time_ms(fns[mode], warmup, reps, device)
        except torch.cuda.OutOfMemoryError:
            results, note = {m: float("nan") for m in MODES}, "OOM"
        except RuntimeError as exc:  # e.g. flash backend unavailable for this shape
            results, note = {m: float("nan") for m in MODES}, f"error: {str(exc).splitlines()[0][:80]}"
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        for mode in MODES:
            ms = results[mode]
            tflops = flops * MODE_FLOP_FACTOR[mode] / (ms * 1e-3) / 1e12
            rows.append(dict(provider=prov, mode=mode, head_dim=D, hq=Hq, hkv=Hkv, batch=B,
                             seqlen=S, mask=label, dtype=str(dtype).replace("torch.", ""),
                             causal=causal, ms=ms, tflops=tflops, note=note))
    return rows


def sanity_check(device, dtype):
    """Max |triton - reference| of out on a small shape (the tests' reference attention,
    ckpt_ext.plain.attention, in float32), so that a broken build is not benchmarked."""
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 64, device=device, dtype=dtype, generator=gen) for _ in range(3))
    seg = (torch.arange(64, device=device) // 24).expand(1, 64)
    err = 0.0
    for masks in ((None, None), (seg, None), (None, 9)):
        out, _ = attention.attention_fwd(q, k, v, None, *masks, True, 0.125)
        ref, _ = attention_reference(q.float(), k.float(), v.float(), None, True, 0.125, *masks)
        err = max(err, (out.float() - ref).abs().max().item())
    return err


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------
def print_table(rows, providers):
    shapes = []
    for r in rows:
        key = (r["head_dim"], r["hq"], r["hkv"], r["batch"], r["seqlen"], r["mask"])
        if key not in shapes:
            shapes.append(key)
    by = {(r["head_dim"], r["hq"], r["hkv"], r["batch"], r["seqlen"], r["mask"], r["provider"],
           r["mode"]): r for r in rows}
    head = f"{'D':>4} {'Hq/Hkv':>7} {'B':>4} {'S':>6} {'mask':>12} |"
    for prov in providers:
        head += f" {prov + ' fwd':>12} {'bwd':>7} {'f+b':>7} |"
    if "triton" in providers and "sdpa" in providers:
        head += f" {'f+b vs sdpa':>11}"
    print("TFLOP/s (higher is better)")
    print(head)
    print("-" * len(head))
    for key in shapes:
        D, hq, hkv, B, S, mask = key
        line = f"{D:>4} {f'{hq}/{hkv}':>7} {B:>4} {S:>6} {mask or '-':>12} |"
        for prov in providers:
            vals = [by[key + (prov, m)]["tflops"] for m in MODES]
            note = by[key + (prov, "fwd")]["note"]
            if note:
                line += f" {note[:28]:>28} |"
            else:
                line += f" {vals[0]:>12.3g} {vals[1]:>7.3g} {vals[2]:>7.3g} |"
        if "triton" in providers and "sdpa" in providers:
            t, s = by[key + ("triton", "fwd+bwd")]["tflops"], by[key + ("sdpa", "fwd+bwd")]["tflops"]
            line += f" {t / s:>10.2f}x" if s == s and s > 0 and t == t else f" {'n/a':>11}"
        print(line)


def goal_verdicts(rows, causal):
    """The GPU validation's attention goal: Triton forward+backward at least SDPA-flash's
    throughput at head_dim 128, causal, S 4096 (MHA rows), one line per matching shape."""
    out = []
    by = {(r["provider"], r["head_dim"], r["hq"], r["hkv"], r["batch"], r["seqlen"]): r
          for r in rows if r["mode"] == "fwd+bwd" and not r["mask"]}
    for (prov, D, hq, hkv, B, S), r in by.items():
        if prov != "triton" or D != 128 or S != 4096 or hq != hkv or not causal:
            continue
        sdpa = by.get(("sdpa", D, hq, hkv, B, S))
        t, f = r["tflops"], sdpa["tflops"] if sdpa else float("nan")
        if not (t == t and f == f and f > 0):
            out.append(f"goal n/a: attention f+b >= SDPA flash (D=128, causal, S=4096, B={B}): "
                       f"triton {t:.3g}, sdpa {f:.3g} TFLOP/s")
            continue
        out.append(f"goal {'ok' if t >= f else 'MISSED'}: attention f+b >= SDPA flash (D=128, "
                   f"causal, S=4096, B={B}, Hq={hq}): {t / f:.3f}x ({t:.0f} vs {f:.0f} TFLOP/s)")
    return out


CSV_FIELDS = ["provider", "mode", "head_dim", "hq", "hkv", "batch", "seqlen", "mask", "dtype",
              "causal", "ms", "tflops", "note"]


# ------------------------------------------------------------------------------------------
# Backend rows: the op with each attention backend pinned, at the layer's call shapes
# ------------------------------------------------------------------------------------------
BACKEND_FIELDS = ["backend", "served_by", "mode", "batch", "hq", "hkv", "head_dim", "sq", "sk",
                  "q_offset", "dtype", "causal", "masks", "ms", "tflops", "call", "note"]


def layer_call_shapes(args, elem_bytes=2):
    """(Sq, Sk, q_offset) of the calls timed, each once: whole sequences, then each chunk size
    against each key count (the chunk holds the last Sq of the Sk positions, as the layer's
    chunk does when its keys end at the chunk's end), then with --layer-dims the layer's own
    calls (:func:`layer_chunk_calls`; ``elem_bytes``: the activations' element size)."""
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    shapes = [(S, S, 0) for S in ints(args.backend_seqlens)]
    shapes += [(rows, keys, keys - rows) for keys in ints(args.chunk_keys)
               for rows in ints(args.chunk_rows) if rows < keys]
    shapes += [c[:3] for c in layer_chunk_calls(args, elem_bytes)]
    return list(dict.fromkeys(shapes))


def layer_chunk_calls(args, elem_bytes=2):
    """The attention calls of the sequence-tiled decoder layer of --layer-dims at each
    --layer-seqlens S, as (Sq, Sk, q_offset, label): its chunk rows are
    ``ckpt_ext.plan.layer_chunk_rows`` (the C++ layer's formula) at --chunk-bytes and --sms
    (on CUDA at least the rows that fill the GPU); chunk i
    holds rows [s0, s0 + Sq) with s0 = i * rows and sees the keys [0, s0 + Sq) (Sk = s0 + Sq,
    q_offset = s0, dK/dV added into fp32 accumulators); the first, a middle and the last chunk
    (which holds S - s0 rows). A sequence within one chunk is one whole call (Sq = Sk = S)."""
    if not args.layer_dims:
        return []
    from ckpt_ext import plan

    H, Hq, Hkv, D, I = (int(x) for x in args.layer_dims.split(","))
    shape = [int(x) for x in args.backend_shape.split(",")]
    if (Hq, Hkv, D) != tuple(shape[1:]):
        raise SystemExit(f"--layer-dims: heads and head dim (Hq {Hq}, Hkv {Hkv}, D {D}) must "
                         f"be --backend-shape's {tuple(shape[1:])}")
    cap = (config.parse_bytes(args.chunk_bytes, "--chunk-bytes") if args.chunk_bytes
           else config.current().chunk_bytes)
    sms = args.sms if args.sms is not None else (
        torch.cuda.get_device_properties(0).multi_processor_count
        if torch.cuda.is_available() else 0)
    rows = plan.layer_chunk_rows(plan.LayerDims(H, Hq, Hkv, D, I), elem_bytes, cap, sms)
    calls = []
    for S in (int(x) for x in args.layer_seqlens.split(",") if x):
        if S <= rows:
            calls.append((S, S, 0, f"layer S {S}: one chunk"))
            continue
        n = -(-S // rows)
        for i in sorted({0, n // 2, n - 1}):
            s0 = i * rows
            sq = min(rows, S - s0)
            calls.append((sq, s0 + sq, s0,
                          f"layer S {S}: chunk {i + 1}/{n} of {rows} rows (cap {cap} B)"))
    return calls


def visible_pairs(Sq, Sk, q_offset, causal, doc=0):
    """(query, key) pairs a call computes: the FLOP count's base (4 * B * Hq * D each forward).
    Whole causal sequences count S^2 / 2, as the sweep does. ``doc``: packed documents of that
    many tokens (the last one shorter), each row seeing its own document's keys."""
    if doc:
        pairs = 0
        for p in range(q_offset, q_offset + Sq):
            start = p - p % doc
            pairs += (p - start + 1) if causal else min(doc, Sk - start)
        return pairs
    if not causal:
        return Sq * Sk
    if q_offset == 0 and Sq == Sk:
        return Sq * Sq / 2
    return Sq * q_offset + Sq * (Sq + 1) / 2


def packed_ids(B, Sk, doc, device):
    """Segment ids (B, Sk) int32 of documents of ``doc`` tokens, as packing makes them."""
    return (torch.arange(Sk, device=device, dtype=torch.int32) // doc).expand(B, Sk).contiguous()


def backend_fns(q, k, v, dout, causal, scale, q_offset, accumulate, segment_ids=None):
    """fwd / bwd / fwd+bwd of torch.ops.ckpt_ext's attention (merges included), served by the
    attention_backend setting in effect when they run; chunk calls (``accumulate``) add dK / dV
    into fp32 accumulators as the layer does; ``segment_ids``: packed documents."""
    ops = torch.ops.ckpt_ext
    B, Hkv, Sk, D = k.shape
    acc = [torch.zeros(B, Sk, Hkv, D, device=q.device, dtype=torch.float32).transpose(1, 2)
           for _ in range(2)] if accumulate else [None, None]
    saved = {}

    def fwd():
        return ops.attention_fwd(q, k, v, None, segment_ids, None, causal, scale, q_offset)

    def prepare_bwd():
        saved["out"], saved["lse"] = fwd()

    def bwd():
        return ops.attention_bwd(dout, q, k, v, saved["out"], saved["lse"], None, segment_ids,
                                 None, causal, scale, q_offset, *acc)

    def fwd_bwd():
        prepare_bwd()
        return bwd()

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}, prepare_bwd


def backend_settings(names):
    """{row name: the ckpt_ext.config settings it is timed under} for --backends: "triton"
    stands for Triton under each dQ mode (triton:separate, triton:ordered, triton:atomic);
    a vendor backend runs its deterministic backward where it has one (attention_dq
    "separate"), so that its place in a table's list holds for deterministic backwards too;
    "auto" runs under the settings in effect, "auto:strict" under attention_dq "auto" as with
    torch.use_deterministic_algorithms(True) (the rows ckpt_ext.throughputs reads for the
    strict backward's rates; the "determinism" entry, config.asking_determinism's)."""
    from ckpt_ext import attention_route

    out = {}
    for name in names:
        for row in (attention_route.TRITON_ENTRIES if name == "triton" else (name,)):
            backend, mode = attention_route.entry(row)
            if row != "auto:strict" and (
                    backend not in attention_route.BACKENDS + ("auto",)
                    or (mode is not None and mode not in attention_route.DQ_MODES)):
                raise SystemExit(f"bench/attention.py: --backends: unknown backend {name!r} "
                                 f"(triton, triton:<{'|'.join(attention_route.DQ_MODES)}>, "
                                 f"flash, cudnn, efficient, auto, auto:strict)")
            if row == "auto:strict":
                out[row] = {"attention_backend": "auto", "attention_dq": "auto",
                            "determinism": "strict"}
            elif backend == "auto":
                out[row] = {"attention_backend": "auto"}
            else:
                out[row] = {"attention_backend": backend, "attention_dq": mode or "separate"}
    return out


def bench_backends(args, device, dtype, warmup, reps, causal):
    """Rows for every backend and mode at every shape of layer_call_shapes."""
    from ckpt_ext import attention_route

    B, Hq, Hkv, D = (int(x) for x in args.backend_shape.split(","))
    backends = backend_settings(b for b in args.backends.split(",") if b)
    rows = []
    labels = {c[:3]: c[3] for c in layer_chunk_calls(args, dtype.itemsize)}
    shapes = [(*shape, 0) for shape in layer_call_shapes(args, dtype.itemsize)]
    if args.backend_packed_doc > 0:
        shapes += [(*shape, args.backend_packed_doc)
                   for shape in layer_call_shapes(args, dtype.itemsize)]
    for Sq, Sk, q_offset, doc in shapes:
        seg = packed_ids(B, Sk, doc, device) if doc else None
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, Sq, Hq, D, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        k, v = (torch.randn(B, Sk, Hkv, D, device=device, dtype=dtype, generator=gen)
                .transpose(1, 2) for _ in range(2))
        dout = torch.randn(B, Sq, Hq, D, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        flops = 4.0 * B * Hq * D * visible_pairs(Sq, Sk, q_offset, causal, doc)
        for backend, settings in backends.items():
            note, served = "", {}
            results = {m: float("nan") for m in MODES}
            if device != "cuda" and settings["attention_backend"] != "triton":
                note = "needs CUDA"   # the CPU smoke run: the Triton kernels only
            else:
                try:
                    if device == "cuda":
                        fns, prepare = backend_fns(q, k, v, dout, causal, D ** -0.5, q_offset,
                                                   Sq < Sk, seg)
                    else:  # the interpreter smoke run: the Triton launchers directly
                        fns, prepare = triton_fns(q, k, v, dout, causal, D ** -0.5, seg,
                                                  q_offset=q_offset, accumulate=Sq < Sk)
                    determinism = settings.get("determinism")
                    with config.patch(**{k: v for k, v in settings.items()
                                         if k != "determinism"}), \
                            config.asking_determinism(determinism):
                        for mode in MODES:
                            if mode == "bwd":
                                prepare()
                            results[mode] = time_ms(fns[mode], warmup, reps, device)
                            # the backend of the mode's last call (fwd+bwd: the backward's)
                            served[mode] = (attention_route.CUDA_ROUTER.last or ""
                                            if device == "cuda" else "triton")
                except torch.cuda.OutOfMemoryError:
                    note = "OOM"
                except (RuntimeError, ValueError) as exc:
                    note = f"error: {str(exc).splitlines()[0][:120]}"
                finally:
                    if device == "cuda":
                        torch.cuda.empty_cache()
            for mode in MODES:
                ms = results[mode]
                rows.append(dict(backend=backend, served_by=served.get(mode, ""), mode=mode, batch=B, hq=Hq,
                                 hkv=Hkv, head_dim=D, sq=Sq, sk=Sk, q_offset=q_offset,
                                 dtype=str(dtype).replace("torch.", ""), causal=causal,
                                 masks=f"packed {doc}" if doc else "none", ms=ms,
                                 tflops=flops * MODE_FLOP_FACTOR[mode] / (ms * 1e-3) / 1e12,
                                 call=labels.get((Sq, Sk, q_offset), "whole" if Sq == Sk
                                                 else "query chunk"),
                                 note=note))
            print(f"  {backend:>9} Sq={Sq} Sk={Sk} q_offset={q_offset}"
                  + (f" packed {doc}" if doc else "") + ": "
                  + (note or ", ".join(f"{x['mode']} {x['ms']:.3g} ms ({x['tflops']:.0f} TFLOP/s)"
                                       for x in rows[-3:])), flush=True)
    return rows


def choice_table(rows, arch, header, note=None, bare_triton="separate"):
    """The attention backend choice table (format 2) the measured rows say: per phase
    (forward: the "fwd" times, backward: the "bwd" times) and shape, every pinned backend that
    ran, fastest first: a backward's Triton once per dQ mode timed (``triton:<mode>``), a
    forward's once (``triton``, its fastest row: the forward has no dQ mode). Rows of a bare
    ``triton`` (a CSV written before the rows named the dQ mode) were timed under
    ``bare_triton``, the attention_dq setting of that run. Shapes become rules on (chunk, sq,
    keys) with
    ``_max`` bounds at the measured sizes (the largest unbounded), ascending, so that a call
    takes the rule of the smallest measured shape that contains it. Where no measured shape
    is the largest in both sq and keys (e.g. chunks of 512 and 1056 rows against 32768 keys
    and 1152 rows against 17280), a last rule without bounds gives the calls beyond every
    bounded rule the order of the shape with the most work (sq * keys). ``note``: the
    table's note (default: how it was written)."""
    from ckpt_ext import attention_route

    measured = {}
    for r in rows:
        if (r["backend"] in ("auto", "auto:strict") or r["mode"] not in ("fwd", "bwd")
                or r["ms"] != r["ms"]):
            continue
        keys = r["q_offset"] + r["sq"] if r["causal"] else r["sk"]
        masks = r.get("masks", "none").split(" ")[0]         # "packed N": the table's "packed"
        key = (r["dtype"], r["head_dim"], bool(r["causal"]), r["q_offset"] > 0, r["mode"], masks)
        name = r["backend"]
        if attention_route.entry(name)[0] == "triton":
            name = "triton" if r["mode"] == "fwd" else (
                f"triton:{bare_triton}" if name == "triton" else name)
        times = measured.setdefault(key, {}).setdefault((r["sq"], keys), {})
        times[name] = min(r["ms"], times.get(name, math.inf))
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    rules = []
    for (dtype, D, causal, chunk, phase, masks), by_shape in sorted(measured.items()):
        sqs = sorted({s for s, _ in by_shape})
        keyss = sorted({k for _, k in by_shape})
        bucket = {"arch": arch, "dtype": names.get(dtype, dtype), "head_dim": D,
                  "causal": causal, "chunk": chunk, "phase": phase, "masks": masks}
        orders = {}
        for sq, keys in sorted(by_shape):
            order = [b for b, _ in sorted(by_shape[(sq, keys)].items(),
                                          key=lambda item: (item[1], item[0]))]
            orders[(sq, keys)] = order
            rule = dict(bucket)
            if sq != sqs[-1]:
                rule["sq_max"] = sq
            if keys != keyss[-1]:
                rule["keys_max"] = keys
            rule["backends"] = order
            rules.append(rule)
        if (sqs[-1], keyss[-1]) not in by_shape:   # no rule unbounded in both: add one
            most_work = max(by_shape, key=lambda shape: (shape[0] * shape[1], shape))
            rules.append(dict(bucket, backends=orders[most_work]))
    table = {"format": attention_route.TABLE_FORMAT,
             "note": note or ("written by bench/attention.py --backend-rows --write-table from "
                              "the times below; first matching rule wins, its backends tried "
                              "in order"),
             "measured": header, "default": "triton", "rules": rules}
    attention_route.Table.from_dict(table, "the written table")   # the reader accepts it
    return table


# What a backend-rows CSV holds in each column (the rest are strings), as write_csv wrote it.
_INT_FIELDS = frozenset(("batch", "hq", "hkv", "head_dim", "sq", "sk", "q_offset"))
_FLOAT_FIELDS = frozenset(("ms", "tflops"))
_BOOL_FIELDS = frozenset(("causal",))
# GPU names (the "device:" line) -> the table's arch, for files written before the "arch:" line
_GPU_ARCHS = ((r"\bGH200\b|\bH(100|200|800|20)\b", "sm90"), (r"\bA(100|800|30)\b", "sm80"),
              (r"\bA(10|10G|40)\b|RTX A\d000|RTX 30\d0", "sm86"),
              (r"\bL(4|40|40S)\b|RTX 40\d0|RTX \d000 Ada", "sm89"),
              (r"\bB(100|200)\b|GB200", "sm100"))


def _parse_cell(field, text, where):
    try:
        if field in _INT_FIELDS:
            return int(text)
        if field in _FLOAT_FIELDS:
            return float(text)          # "nan" included: a backend that did not run
        if field in _BOOL_FIELDS:
            return {"True": True, "False": False}[text]
    except (ValueError, KeyError):
        raise ValueError(f"{where}: column {field!r} holds {text!r}, not a "
                         f"{'bool (True/False)' if field in _BOOL_FIELDS else 'number'}") from None
    return text


def read_backend_rows(path):
    """(header, rows, preamble) of the CSV ``--backend-rows`` writes, alone or inside a results
    file (anything before its column line skipped): header, the ``# `` lines right above the
    column line (the writer's provenance), without the ``# ``; rows, dicts typed as the writer
    wrote them (ints, the ``causal`` bool, ``ms`` / ``tflops`` floats with ``nan``); preamble,
    the file's other ``#`` lines above the column line. The rows end at the file's end or at
    the first line of fewer than two cells (a blank line, a JSON ``{``); ``#`` lines among
    them are skipped, a line of another width raises ValueError naming the line."""
    import csv

    path = pathlib.Path(path)
    lines = path.read_text().splitlines()
    columns = ",".join(BACKEND_FIELDS)
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == columns)
    except StopIteration:
        raise ValueError(f"{path}: no backend-rows CSV (no line {columns!r})") from None
    top = start
    while top > 0 and lines[top - 1].startswith("# "):
        top -= 1
    header = [line[2:] for line in lines[top:start]]
    preamble = [line.lstrip("#").strip() for line in lines[:top] if line.startswith("#")]
    rows = []
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("#"):
            continue
        cells = next(csv.reader([line]), [])
        if len(cells) < 2:
            break
        where = f"{path}:{number}"
        if len(cells) != len(BACKEND_FIELDS):
            raise ValueError(f"{where}: {len(cells)} cells, the columns are "
                             f"{len(BACKEND_FIELDS)} ({columns})")
        rows.append({f: _parse_cell(f, c, where) for f, c in zip(BACKEND_FIELDS, cells)})
    if not rows:
        raise ValueError(f"{path}: the backend-rows CSV has no rows")
    return header, rows, preamble


def _header_value(lines, *names):
    """The text after ``name:`` of the first line starting with one of ``names`` (or None)."""
    for line in lines:
        for name in names:
            if line.startswith(name + ":"):
                return line[len(name) + 1:].strip()
    return None


def csv_arch(header, preamble, given=None):
    """The table's arch of a backend-rows CSV: its ``arch:`` line (written since the tables
    came from CSVs), else the GPU named by its ``device:`` line ("cpu" for a CPU run), checked
    against ``given`` (``--arch``), which alone serves a GPU this module does not name."""
    import re

    written = _header_value(header, "arch")
    device = _header_value(header, "device") or _header_value(preamble, "device") or ""
    if written is not None:
        if given and given != written:
            raise SystemExit(f"bench/attention.py: --arch {given} but the CSV was measured "
                             f"on {written} ({device})")
        return written
    if given:
        return given
    if device.startswith("CPU"):
        return "cpu"
    for pattern, arch in _GPU_ARCHS:
        if re.search(pattern, device):
            return arch
    raise SystemExit(f"bench/attention.py: cannot tell the arch of the device {device!r} of "
                     f"the CSV; give it with --arch (e.g. sm90: torch.cuda."
                     f"get_device_capability() (9, 0))")


def csv_dq_mode(header, preamble):
    """The attention_dq setting a CSV's bare ``triton`` rows ran under: CKPT_EXT_ATTN_DQ in
    its command line, else the default of the bench's runs until the rows named the dQ mode,
    "separate"."""
    import re

    command = " ".join(filter(None, (_header_value(header, "command"),
                                     _header_value(preamble, "command"))))
    found = re.search(r"CKPT_EXT_ATTN_DQ=(\w+)", command)
    return found.group(1) if found else "separate"


def _table_note(rows, arch, header, source, bare_triton="separate"):
    """The note of a table written from a CSV: what was measured, where, and how the rules
    are read."""
    def uniq(values):
        return ", ".join(str(v) for v in dict.fromkeys(values))

    timed = [r for r in rows if r["backend"] not in ("auto", "auto:strict")]
    whole = sorted({r["sq"] for r in timed if r["q_offset"] == 0 and r["sq"] == r["sk"]})
    chunks = sorted({(r["sq"], r["sk"]) for r in timed if r["q_offset"] > 0})
    heads = uniq(f"B {r['batch']}, Hq/Hkv {r['hq']}/{r['hkv']}" for r in timed)
    shapes = []
    if whole:
        shapes.append("whole sequences S " + ", ".join(str(s) for s in whole))
    if chunks:
        shapes.append("query chunks (Sq x Sk, q_offset = Sk - Sq) "
                      + ", ".join(f"{sq}x{sk}" for sq, sk in chunks))
    causal = uniq("causal" if r["causal"] else "non-causal" for r in timed)
    return (f"Measured on {_header_value(header, 'device') or 'an unnamed device'} ({arch}) on "
            f"{_header_value(header, 'date') or 'an unrecorded date'}, from {source}: "
            f"ckpt_ext's attention op (attention_fwd / attention_bwd) with each backend pinned "
            f"({uniq(r['backend'] for r in timed)}) at {uniq(r['dtype'] for r in timed)}, "
            f"head_dim {uniq(r['head_dim'] for r in timed)}, {causal}, {heads}: "
            f"{'; '.join(shapes)}; masks {uniq(r['masks'] for r in timed)}. Each rule lists, "
            f"for its phase and shape, every backend that ran there, fastest first, a "
            f"backward's Triton per dQ mode it ran in (triton:<mode>)"
            + (f" (the CSV's Triton rows name no mode: they ran under attention_dq="
               f"'{bare_triton}', so Triton appears as triton:{bare_triton} only)"
               if any(r["backend"] == "triton" for r in timed) else "")
            + "; the vendors' backwards ran deterministic where they have one (flash, "
            f"efficient). The first matching rule wins and its backends are tried in order; a "
            f"backward that must be deterministic skips the entries without a deterministic "
            f"backward (cudnn, triton:atomic). Every other call (another GPU, dtype, head_dim "
            f"or causality, a key_padding_mask) takes the default, Triton "
            f"(triton:separate). Written by bench/attention.py --from-csv {source} "
            f"--write-table.")


def main_from_csv(args):
    """--from-csv FILE --write-table OUT: the choice table of measured rows, no GPU needed."""
    import json

    if not args.write_table:
        raise SystemExit("bench/attention.py: --from-csv needs --write-table OUT")
    path = pathlib.Path(args.from_csv)
    try:
        source = str(path.resolve().relative_to(RESULTS.parent.parent))
    except ValueError:
        source = str(path)
    header, rows, preamble = read_backend_rows(path)
    arch = csv_arch(header, preamble, args.arch)
    commit_text = (_header_value(header, "commit", "git")
                   or _header_value(preamble, "commit", "git") or "not recorded in the file")
    measured = [f"source: {source} (its backend-rows CSV)", f"arch: {arch}"]
    if _header_value(header, "commit") is None:
        measured.append(f"commit: {commit_text}")
    measured += [line for line in header if not line.startswith("arch:")]
    bare = csv_dq_mode(header, preamble)
    table = choice_table(rows, arch, measured, _table_note(rows, arch, header, source, bare),
                         bare)
    pathlib.Path(args.write_table).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.write_table} ({len(table['rules'])} rules, arch {arch}, from "
          f"{len(rows)} rows of {source})")
    return table


def main_backend_rows(args, cuda, causal):
    if cuda:
        dtype = DTYPES[args.dtype]
        warmup = 5 if args.warmup is None else args.warmup
        reps = 30 if args.reps is None else args.reps
        device = "cuda"
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm{major}{minor}"
        note = ""
    else:
        print("CPU interpreter run: NOT a performance figure (Triton rows only)")
        dtype, warmup, reps, device, arch = torch.float32, 1, 2, "cpu", "cpu"
        note = "CPU (Triton interpreter) run: NOT a performance figure"
    rows = bench_backends(args, device, dtype, warmup, reps, causal)
    header = provenance(device, note) + [
        f"config: dtype {str(dtype).replace('torch.', '')}, causal {causal}, warmup {warmup}, "
        f"reps {reps}, B,Hq,Hkv,D {args.backend_shape}",
        f"arch: {arch}", f"commit: {commit()}",
        "calls: torch.ops.ckpt_ext.attention_fwd / attention_bwd with attention_backend pinned "
        "(merges included); chunk rows (Sq < Sk, q_offset = Sk - Sq) add dK/dV into fp32 "
        "accumulators; served_by: the backend that ran",
        "flops: 4*B*Hq*D*(visible pairs) forward (whole causal: S^2/2 pairs); bwd = 2.5x fwd; "
        "fwd+bwd = 3.5x fwd"]
    print_backend_rows(rows)
    out = (pathlib.Path(args.out) if args.out
           else RESULTS / f"attention_backends_{device_tag()}.csv")
    write_csv(out, header, BACKEND_FIELDS, rows)
    if args.write_table:
        import json
        table = choice_table(rows, arch, header)
        pathlib.Path(args.write_table).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.write_table} ({len(table['rules'])} rules)")


def print_backend_rows(rows):
    print("TFLOP/s (fwd / bwd / fwd+bwd) per backend at the layer's call shapes")
    shapes = []
    for r in rows:
        if (r["sq"], r["sk"], r["masks"]) not in shapes:
            shapes.append((r["sq"], r["sk"], r["masks"]))
    for sq, sk, masks in shapes:
        line = f"  Sq={sq:>6} Sk={sk:>6}" + (f" {masks}" if masks != "none" else "") + " |"
        for r in rows:
            if (r["sq"], r["sk"], r["masks"]) == (sq, sk, masks) and r["mode"] == "fwd":
                trio = [x["tflops"] for x in rows if (x["sq"], x["sk"], x["masks"], x["backend"])
                        == (sq, sk, masks, r["backend"])]
                text = r["note"][:20] if r["note"] else "/".join(f"{t:.0f}" for t in trio)
                line += f" {r['backend']} {text} |"
        print(line)


def main(argv=None):
    args = parse_args(argv)
    if args.from_csv:
        if args.backend_rows:
            sys.exit("bench/attention.py: --from-csv reads times, --backend-rows measures them: "
                     "give one")
        return main_from_csv(args)
    if args.backend_rows:
        return main_backend_rows(args, torch.cuda.is_available(), not args.no_causal)
    if args.write_table:
        sys.exit("bench/attention.py: --write-table needs --backend-rows or --from-csv")
    providers = [p for p in args.providers.split(",") if p]
    unknown = set(providers) - set(TRITON_DQ) - {"sdpa", "eager"}
    if unknown:
        sys.exit(f"bench/attention.py: unknown providers {sorted(unknown)}")
    causal = not args.no_causal
    cuda = torch.cuda.is_available()

    if cuda:
        device_name = torch.cuda.get_device_name()
        dtype = DTYPES[args.dtype]
        warmup = 5 if args.warmup is None else args.warmup
        reps = 30 if args.reps is None else args.reps
        err = sanity_check("cuda", dtype)
        print(f"{device_name}: sanity max|triton - reference| = {err:.3g} ({args.dtype})")
        heads = dict(tuple(int(x) for x in pair.split(":")) for pair in args.heads.split(","))
        shapes = []
        for D in (int(x) for x in args.head_dims.split(",")):
            hq = heads.get(D, max(1, 2048 // D))
            for S in (int(x) for x in args.seqlens.split(",")):
                shapes.append((max(1, args.tokens // S), hq, hq, S, D))
            if args.gqa_seqlen and hq % 4 == 0:
                S = args.gqa_seqlen
                shapes.append((max(1, args.tokens // S), hq, hq // 4, S, D))
            if args.mask_seqlen:
                S = args.mask_seqlen
                shapes.append((max(1, args.tokens // S), hq, hq, S, D, "packed", args.packed_doc))
                shapes.append((max(1, args.tokens // S), hq, hq, S, D, "window", args.window))
        out_path = pathlib.Path(args.out) if args.out else RESULTS / f"attention_{device_tag()}.csv"
        device = "cuda"
    else:
        print("CPU interpreter run: NOT a performance figure (no CUDA GPU; TRITON_INTERPRET=1)")
        dtype = torch.float32  # bf16 tl.dot is wrong in the interpreter
        warmup = 1 if args.warmup is None else args.warmup
        reps = 3 if args.reps is None else args.reps
        B, H, S, D = (int(x) for x in args.cpu_size.split(","))
        shapes = [(B, H, H, S, D)]
        if H % 2 == 0:
            shapes.append((B, H, H // 2, S, D))
        quarter = max(1, S // 4)
        shapes += [(B, H, H, S, D, "packed", quarter), (B, H, H, S, D, "window", quarter)]
        out_path = pathlib.Path(args.out) if args.out else RESULTS / "attention_cpu_smoke.csv"
        device = "cpu"
        torch.set_num_threads(1)  # steadier timings on a shared CPU; still not a figure

    rows = []
    for B, hq, hkv, S, D, *mask in shapes:
        rows += bench_shape(B, hq, hkv, S, D, dtype, causal, providers, warmup, reps, device, *mask)
        r = {x["provider"] + " " + x["mode"]: x["ms"] for x in rows[-3 * len(providers):]}
        print(f"  D={D} Hq/Hkv={hq}/{hkv} B={B} S={S}{' ' + rows[-1]['mask'] if mask else ''}: "
              + ", ".join(f"{k} {v:.3g} ms" for k, v in r.items() if not math.isnan(v)), flush=True)

    print()
    if not cuda:
        print("CPU interpreter run: NOT a performance figure")
    print_table(rows, providers)
    verdicts = goal_verdicts(rows, causal) if cuda else []
    for line in verdicts:
        print(line)
    note = "" if cuda else "CPU (Triton interpreter) run: NOT a performance figure"
    header = provenance(device, note) + [
        f"config: dtype {str(dtype).replace('torch.', '')}, causal {causal}, warmup {warmup}, "
        f"reps {reps}",
        "flops: fwd = 4*B*Hq*S^2*D (x0.5 causal), masked rows 4*Hq*D*(visible pairs); "
        "bwd = 2.5x fwd; fwd+bwd = 3.5x fwd",
        "sdpa: torch SDPA with SDPBackend.FLASH_ATTENTION on CUDA (MATH on CPU); on packed/window "
        "rows the equivalent dense bool mask, SDPA's own backend; "
        "eager: S x S scores, fp32 softmax",
    ] + verdicts
    write_csv(out_path, header, CSV_FIELDS, rows)


if __name__ == "__main__":
    main()
