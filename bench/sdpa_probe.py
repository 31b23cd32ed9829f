"""What torch's SDPA aten ops accept and compute: one line per op and question.

For the attention routing (the attention issue): which of torch's attention ops that return
the log-sum-exp can serve a call of ``ckpt_ext.ops.attention`` as it is, on this machine's
torch. Ops: ``flash`` (``aten._scaled_dot_product_flash_attention``), ``cudnn``
(``_scaled_dot_product_cudnn_attention``), ``efficient``
(``_scaled_dot_product_efficient_attention``), ``flash_varlen`` (``_flash_attention_forward``
on packed rows with cumulative lengths), ``efficient_varlen`` (``_efficient_attention_forward``
with ``custom_mask_type`` 2, its bottom-right causal mask), ``varlen_attn``
(``torch.nn.attention.varlen.varlen_attn``, where it exists) and ``cpu_flash``
(``_scaled_dot_product_flash_attention_for_cpu``, the CPU stand-in the tests use). Questions,
each answered against an fp32 reference of the same inputs (relative error
``|out - ref| / |ref|``; bf16 matches below 2e-2):

* ``meta``: the call on meta tensors (the op's shape function: the arguments as this script
  passes them, out's and lse's shapes), on any machine;
* ``mha``: Hq = Hkv, Sq = Sk, causal: does it run and match; the lse's shape, dtype and
  whether it is the natural-log lse of the reference (after dropping a trailing 1 and padding
  rows);
* ``gqa``: Hkv < Hq unexpanded: accepted, and right;
* ``gqa_bwd``: the same through autograd: dk's shape (Hkv or Hq heads) and whether dq, dk, dv
  match the reference's;
* ``causal_sq<sk``: Sq < Sk with the op's causal flag: top-left (key j <= query i) or
  bottom-right (j <= i + Sk - Sq) aligned, or neither;
* ``empty_rows``: Sq > Sk with the causal flag: an op aligned bottom-right leaves the first
  Sq - Sk rows with no key: NaN, 0 or finite; a top-left op has no such rows;
* ``fp32``: float32 inputs accepted.

Every call is wrapped: an op that raises prints ``error: <type>: <first line>``, and the script
always exits 0 (it reports; the tests check). Sizes: B 2, Hq 4, Hkv 2, D 128, S 128, Sq/Sk
64/192 (``--head-dim``, ``--seq`` change them); bf16 on CUDA, fp32 on the CPU (``--dtype``).

    python bench/sdpa_probe.py [--device cuda] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import math
import platform
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
aten = torch.ops.aten


# ---- the reference -------------------------------------------------------------------------
def reference(q, k, v, causal, align, scale):
    """fp32 (out, lse) of q (B, Hq, Sq, D) against k, v (B, Hkv, Sk, D); align "top-left" or
    "bottom-right" when causal. Rows that see nothing: out 0, lse -inf."""
    q, k, v = q.float(), k.float(), v.float()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    Sq, Sk = q.shape[2], k.shape[2]
    if causal:
        shift = 0 if align == "top-left" else Sk - Sq
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + shift, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- the ops: each (q, k, v (B, H, S, D), causal, scale) -> (out (B, Hq, Sq, D), lse) --------
def _flash(q, k, v, causal, scale):
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _cudnn(q, k, v, causal, scale):
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                 scale=scale)
    return r[0], r[1]


def _efficient(q, k, v, causal, scale):
    r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                     scale=scale)
    return r[0], r[1]


def _packed(t):
    """(B, H, S, D) -> (B*S, H, D) and the cumulative lengths."""
    B, H, S, D = t.shape
    cu = torch.arange(0, (B + 1) * S, S, device=t.device, dtype=torch.int32)
    return t.transpose(1, 2).reshape(B * S, H, D), cu


def _unpack(o, B, S):
    return o.reshape(B, S, o.shape[-2], o.shape[-1]).transpose(1, 2)


def _flash_varlen(q, k, v, causal, scale):
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    (qp, cq), (kp, ck), (vp, _) = _packed(q), _packed(k), _packed(v)
    r = aten._flash_attention_forward(qp, kp, vp, cq, ck, Sq, Sk, 0.0, causal, False,
                                      scale=scale)
    return _unpack(r[0], B, Sq), r[1]


def _efficient_varlen(q, k, v, causal, scale):
    """custom_mask_type 2: causal from the bottom right (0: none)."""
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    r = aten._efficient_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, Sq, Sk,
        0.0, 2 if causal else 0, True, scale=scale)
    return r[0].transpose(1, 2), r[1]


def _varlen_attn(q, k, v, causal, scale):
    from torch.nn.attention import varlen
    fn = varlen.varlen_attn
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    (qp, cq), (kp, ck), (vp, _) = _packed(q), _packed(k), _packed(v)
    params = inspect.signature(fn).parameters
    kw = {"scale": scale}
    if "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        kw["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    if "return_aux" in params:
        kw["return_aux"] = varlen.AuxRequest(lse=True)
        out, lse = fn(qp, kp, vp, cq, ck, Sq, Sk, **kw)
    else:
        out, lse = fn(qp, kp, vp, cq, ck, Sq, Sk, **kw), None
    return _unpack(out, B, Sq), lse


def _cpu_flash(q, k, v, causal, scale):
    r = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return r[0], r[1]


OPS = {"flash": _flash, "cudnn": _cudnn, "efficient": _efficient,
       "flash_varlen": _flash_varlen, "efficient_varlen": _efficient_varlen,
       "varlen_attn": _varlen_attn, "cpu_flash": _cpu_flash}
SCHEMAS = {"flash": "_scaled_dot_product_flash_attention",
           "cudnn": "_scaled_dot_product_cudnn_attention",
           "efficient": "_scaled_dot_product_efficient_attention",
           "flash_varlen": "_flash_attention_forward",
           "efficient_varlen": "_efficient_attention_forward",
           "cpu_flash": "_scaled_dot_product_flash_attention_for_cpu"}


# ---- the questions -------------------------------------------------------------------------
def lse_rows(lse, B, H, Sq):
    """The op's lse as (B, H, Sq) fp32, or None when its layout is not recognised."""
    if lse is None:
        return None
    x = lse.float()
    if x.dim() == 4 and x.shape[-1] == 1:          # cuDNN: (B, H, S, 1)
        x = x[..., 0]
    if x.dim() == 2 and x.shape == (H, B * Sq):    # packed: (H, total)
        x = x.reshape(H, B, Sq).transpose(0, 1)
    if x.dim() == 3 and x.shape[:2] == (B, H) and x.shape[2] >= Sq:   # padded rows
        x = x[..., :Sq]
    elif x.dim() == 3 and x.shape[:2] == (B, Sq):  # (B, S, H)
        x = x.transpose(1, 2)
    return x if x.shape == (B, H, Sq) else None


def describe_lse(lse, ref_lse, B, H, Sq):
    if lse is None:
        return "lse none"
    rows = lse_rows(lse, B, H, Sq)
    text = f"lse {tuple(lse.shape)} {str(lse.dtype).replace('torch.', '')}"
    if rows is None:
        return text + " (layout not recognised)"
    err = (rows - ref_lse).abs().max().item()
    err2 = (rows * math.log(2) - ref_lse).abs().max().item()
    kind = ("natural log" if err < 5e-2 else "log2" if err2 < 5e-2 else
            f"differs (max {err:.3g})")
    return f"{text}, {kind}"


def inputs(B, Hq, Hkv, Sq, Sk, D, dtype, device, grad=False):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=gen, device=device, dtype=dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def ask(op, question, a, dtype, device, tol):
    """One answer line's text."""
    B, Hq, S, D = 2, 4, a.seq, a.head_dim
    scale = D ** -0.5
    if question == "meta":
        q, k, v = (torch.empty(B, Hq, S, D, device="meta", dtype=dtype) for _ in range(3))
        out, lse = op(q, k, v, True, scale)
        lse_text = "none" if lse is None else f"{tuple(lse.shape)} {str(lse.dtype)[6:]}"
        return f"meta kernel: out {tuple(out.shape)}, lse {lse_text} (the call's arguments)"
    if question == "mha":
        q, k, v = inputs(B, Hq, Hq, S, S, D, dtype, device)
        out, lse = op(q, k, v, True, scale)
        ref, ref_lse = reference(q, k, v, True, "top-left", scale)
        err = rel(out, ref)
        return (f"{'ok' if err < tol else 'WRONG'} (rel err {err:.2g}); "
                + describe_lse(lse, ref_lse, B, Hq, S))
    if question == "gqa":
        q, k, v = inputs(B, Hq, Hq // 2, S, S, D, dtype, device)
        out, _ = op(q, k, v, True, scale)
        err = rel(out, reference(q, k, v, True, "top-left", scale)[0])
        return (f"accepted, {'right' if err < tol else 'WRONG'} (rel err {err:.2g}), out "
                f"{tuple(out.shape)}")
    if question == "gqa_bwd":
        q, k, v = inputs(B, Hq, Hq // 2, S, S, D, dtype, device, grad=True)
        out, _ = op(q, k, v, True, scale)
        gen = torch.Generator(device=device).manual_seed(1)
        dout = torch.randn(out.shape, generator=gen, device=device, dtype=dtype)
        got = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(reference(qr, kr, vr, True, "top-left", scale)[0],
                                   (qr, kr, vr), dout.float())
        if any(g is None for g in got):
            return "backward gave None for " + ", ".join(
                n for n, g in zip("qkv", got) if g is None)
        shape = tuple(got[1].shape)
        if got[1].shape != want[1].shape:
            return f"dk {shape}: Hq-headed (needs a sum over the group), dq {tuple(got[0].shape)}"
        errs = [rel(g, w) for g, w in zip(got, want)]
        return (f"dk {shape} (Hkv heads), {'right' if max(errs) < tol else 'WRONG'} "
                f"(rel err dq/dk/dv {errs[0]:.2g}/{errs[1]:.2g}/{errs[2]:.2g})")
    if question == "causal_sq<sk":
        q, k, v = inputs(B, Hq, Hq, S // 2, S + S // 2, D, dtype, device)
        out, _ = op(q, k, v, True, scale)
        errs = {al: rel(out, reference(q, k, v, True, al, scale)[0])
                for al in ("top-left", "bottom-right")}
        best = min(errs, key=errs.get)
        verdict = best if errs[best] < tol else "neither"
        return (f"{verdict} (rel err top-left {errs['top-left']:.2g}, bottom-right "
                f"{errs['bottom-right']:.2g}), Sq/Sk {S // 2}/{S + S // 2}")
    if question == "empty_rows":
        q, k, v = inputs(B, Hq, Hq, S + S // 2, S // 2, D, dtype, device)
        out, lse = op(q, k, v, True, scale)
        n = (S + S // 2) - S // 2
        top_left = rel(out, reference(q, k, v, True, "top-left", scale)[0])
        if top_left < tol:
            return (f"top-left on Sq > Sk (rel err {top_left:.2g}): every row sees key 0, no "
                    f"empty rows")
        head = out[:, :, :n].float()
        nan = bool(torch.isnan(head).any())
        zero = bool((head == 0).all())
        rest = rel(out[:, :, n:], reference(q, k, v, True, "bottom-right", scale)[0][:, :, n:])
        lse_head = lse_rows(lse, B, Hq, S + S // 2)
        lse_text = "" if lse_head is None else f", their lse {lse_head[..., :n].flatten()[0]:.3g}"
        return (f"first {n} rows (bottom-right: nothing to see) "
                f"{'NaN' if nan else '0' if zero else 'finite, not 0'}{lse_text}; other rows "
                f"vs bottom-right rel err {rest:.2g}")
    if question == "fp32":
        q, k, v = inputs(B, Hq, Hq, S, S, D, torch.float32, device)
        out, _ = op(q, k, v, True, scale)
        err = rel(out, reference(q, k, v, True, "top-left", scale)[0])
        return f"accepted, {'right' if err < 1e-3 else 'WRONG'} (rel err {err:.2g})"
    raise ValueError(question)


QUESTIONS = ("meta", "mha", "gqa", "gqa_bwd", "causal_sq<sk", "empty_rows", "fp32")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=128, help="S; Sq/Sk are S/2 and 3S/2")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    a = p.parse_args(argv)
    dtype = DTYPES[a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")]
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    # provenance without importing ckpt_ext (bench/_harness.py does): this part has 15 s
    dev = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
           if a.device.startswith("cuda") else f"CPU ({platform.machine()})")
    print(f"# device: {dev}")
    print(f"# versions: torch {torch.__version__}, python {platform.python_version()}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"# B 2, Hq 4, Hkv 2 (gqa), D {a.head_dim}, S {a.seq}, {dtype}, {a.device}; "
          f"tolerance {tol:g}")
    for name in a.ops:
        schema = SCHEMAS.get(name)
        op_obj = getattr(aten, schema, None) if schema else None
        if schema and op_obj is None:
            print(f"{name:<17} {'(op)':<13} absent from this torch (aten.{schema})")
            continue
        for question in QUESTIONS:
            try:
                text = ask(OPS[name], question, a, dtype, a.device, tol)
            except Exception as exc:   # noqa: BLE001 -- the probe reports every failure
                first = (str(exc).strip().splitlines() or [""])[0][:100]
                text = f"error: {type(exc).__name__}: {first}"
            print(f"{name:<17} {question:<13} {text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
