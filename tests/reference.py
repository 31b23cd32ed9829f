"""The one place the tests take references and the accuracy rule from.

* The accuracy rule: ``check_vs_baseline`` (a low-precision result against a float64
  reference and plain PyTorch at the same dtype) and ``check_f64`` (a float64 result).
* Independent plain-PyTorch references (no kernel code): ``rotate_half``,
  ``rope_reference``, ``rms_norm_reference``, ``attention_reference`` (explicit S x S softmax,
  repeated K/V; from ``ckpt_ext.plain``, shared with bench/), ``swiglu_reference``, a whole
  LLaMA decoder layer
  (``reference_layer``), SwiGLU with PEFT LoRA adapters (and LoRA dropout replayed with the
  op's masks, ``replayed_dropout``), each with the gated activation ``gate_activation`` (silu,
  or GeGLU's gelu_tanh); and the fixtures the tests share.
"""
import math

import torch
import torch.nn.functional as F

from ckpt_ext.modules import DecoderLayer
# The dense attention (explicit S x S softmax, every mask rule as a bool matrix) lives in
# ckpt_ext.plain, plain PyTorch with no kernel code, so that bench/ uses the same one without
# importing tests/; the tests take it from here under these names.
from ckpt_ext.plain import attention as attention_reference  # noqa: F401
from ckpt_ext.plain import attention_allowed as allowed_matrix  # noqa: F401

F64 = torch.float64


# ---- the accuracy rule ---------------------------------------------------------------------
# A result computed at a low-precision dtype is compared with an independent plain-PyTorch
# reference run in float64 on exactly the same input values. The baseline is the same
# plain-PyTorch code at the test dtype (what a user gets without ckpt_ext). The result's max
# abs error against the reference must be at most FACTOR_OUT (outputs) / FACTOR_GRAD
# (gradients) times the baseline's. A baseline that happens to be exact or nearly so (out = v
# at S = 1, a bias gradient that is a plain sum) is floored at FLOOR_ULPS[dtype] units in the
# last place (eps) of the reference's magnitude: its largest finite |value|, or the `scale` a
# caller shares between the gradients of one op. Entries with no finite reference (lse = -inf
# on rows with nothing to attend) must be exactly equal. Float64 results: check_f64.
#
# FLOOR_ULPS: half an ulp for float16 / bfloat16 (no test in the suite needs more); 3 for
# float32. On CPU the largest need is 1.26 (test_ops.py::test_swiglu_non_unit_last_stride, y).
# On a GPU, Triton's float32 exp and sigmoid are the hardware approximations (ex2.approx, about
# 2 ulps) where PyTorch's are correctly rounded, so on the smallest cases (S = 1, T = 1, where
# plain PyTorch's own error is one or two ulps) the kernels' float32 error reached 2.6 ulps of
# the magnitude (H100, triton 3.6: attention out and lse, SwiGLU y). A floor of 3 ulps (6 for
# outputs, 9 for gradients after FACTOR) is still orders of magnitude under any indexing or
# masking error. These replace four floors: 4 eps * max(1, |ref|) (test_ops,
# test_triton_attention: 2 ulps for outputs, 1.33 for gradients), 2 ulps (test_triton_swiglu)
# and half an ulp (test_cuda_rowwise).
FACTOR_OUT, FACTOR_GRAD = 2.0, 3.0
FLOOR_ULPS = {torch.float16: 0.5, torch.bfloat16: 0.5, torch.float32: 3.0}


def max_err(got, ref):
    """Max abs difference on entries where ref is finite; the others must be equal."""
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = torch.isfinite(ref)
    assert torch.equal(got[~finite], ref[~finite]), "non-finite reference entries differ"
    return (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0


def magnitude(*refs):
    """Largest finite |value| over the given reference tensors (0 if there is none)."""
    finite = [r[torch.isfinite(r)].abs() for r in refs if r is not None]
    return max([0.0] + [f.max().item() for f in finite if f.numel()])


def check_vs_baseline(name, got, base, ref, factor, dtype=None, scale=None):
    """Assert the accuracy rule for one result and return err / bound.

    got: the result under test; base: plain PyTorch's result at the test dtype, or a sequence
    of such results (two exact formulas that round differently: the largest error counts);
    ref: the float64 reference; factor: FACTOR_OUT or FACTOR_GRAD; dtype: whose eps sets the
    floor (default got's dtype; pass the compute dtype where got is upcast, as under autocast);
    scale: magnitude of the floor, default magnitude(ref). The gradients of one op may share one
    (the largest of theirs): at S = 1, for instance, dq and dk of attention are exactly 0 while
    their rounding error scales with dout, the magnitude of dv."""
    dtype = got.dtype if dtype is None else dtype
    assert not torch.isnan(got).any(), f"{name}: NaN in the result"
    bases = (base,) if isinstance(base, torch.Tensor) else tuple(base)
    err = max_err(got, ref)
    base_err = max(max_err(b, ref) for b in bases)
    scale = magnitude(ref) if scale is None else scale
    floor = FLOOR_ULPS[dtype] * torch.finfo(dtype).eps * scale
    bound = factor * max(base_err, floor)
    print(f"  {name}: err {err:.3g}  bound {bound:.3g}  (plain {base_err:.3g})")
    assert err <= bound, (f"{name}: error {err:.3g} > bound {bound:.3g} = {factor}x plain "
                          f"PyTorch's {base_err:.3g} (floor {floor:.3g})")
    return err / bound if bound else 0.0


def check_f64(name, got, ref, dtype=F64, scale=None):
    """Tight comparison of a float64 result (1e-12 of the magnitude), or of a float32 output
    such as lse (4 units in the last place); scale as in check_vs_baseline."""
    err = max_err(got, ref)
    scale = max(1.0, magnitude(ref) if scale is None else scale)
    bound = (1e-12 if dtype == F64 else 4 * torch.finfo(dtype).eps) * scale
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


# ---- references of single ops -------------------------------------------------------------
def rotate_half(x):
    """HF's rotate_half: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_reference(q, k, cos, sin):
    """HF apply_rotary_pos_emb: q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (1 or B, S, D)
    broadcast over heads; computes in the promoted dtype of its inputs."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_interleaved_reference(q, k, cos, sin):
    """HF's interleaved apply_rotary_pos_emb (GLM-4, Helium, ERNIE 4.5): the tables keep the
    half-split layout of width R <= D; their first half, each column repeated twice, rotates
    the pairs (2i, 2i + 1) of the first R dims; the dims past R pass through."""
    R = cos.shape[-1]
    cos = cos[..., :R // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin[..., :R // 2].repeat_interleave(2, dim=-1).unsqueeze(1)

    def rotate(t):
        rot, rest = t[..., :R], t[..., R:]
        pairs = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat((rot * cos + pairs * sin, rest), dim=-1)

    return rotate(q), rotate(k)


def rms_norm_reference(x, weight, eps):
    """HF LlamaRMSNorm.forward, verbatim semantics: x upcast to float32 (float64 stays),
    normalised, cast back to x's dtype, times weight (the result in the promoted dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32) if dtype != F64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def family_rms_norm_reference(x, weight, eps, offset, cast_last):
    """The other families' RMSNorms as HF writes them: Gemma's ``(x_n * (1.0 +
    w.float())).type_as(x)`` (offset 1, cast last), OLMo-2's ``(w * x_n).to(x.dtype)``
    (offset 0, cast last); without cast_last, LLaMA's rounding times ``offset + w``."""
    if not cast_last:
        return rms_norm_reference(x, weight + offset, eps)
    h = x.to(torch.float32) if x.dtype != F64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.to(h.dtype))).to(x.dtype)


def gate_activation(g, activation="silu"):
    """The gated MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, torch's
    ``gelu(approximate="tanh")``, HF's ``gelu_pytorch_tanh``), in g's dtype."""
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"gate_activation: unknown activation {activation!r}")


def swiglu_reference(x, wg, wu, wd, bg=None, bu=None, bd=None, activation="silu"):
    """``down(act(gate(x)) * up(x))`` in nn.Linear layout (act: gate_activation); returns
    (y, gate, up)."""
    gate = F.linear(x, wg, bg)
    up = F.linear(x, wu, bu)
    return F.linear(gate_activation(gate, activation) * up, wd, bd), gate, up


# ---- a whole decoder layer -----------------------------------------------------------------
def rope_args(pe):
    """The layer op's cos= / sin= from a (cos, sin) pair, none for None (an MLP sublayer)."""
    return {} if pe is None else dict(cos=pe[0], sin=pe[1])


def rope_tables(s, d, dtype, batch=1, offset=None):
    pos = torch.arange(s, dtype=torch.float64)[None].repeat(batch, 1)
    if offset is not None:
        pos = pos + offset[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = pos[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def expert_weight(p, name, scaling):
    """The expert weight p["mlp.experts.<name>"] (E, out, in) with PEFT's LoRA on it folded in,
    expert by expert: W_e + scaling * B_e A_e, A_e the rows e r .. e r + r - 1 of lora_A (r E,
    in) and B_e the columns e, e + E, ... of lora_B (out, r E) (PEFT's ParamWrapper layout);
    W itself without factors in p."""
    w = p[f"mlp.experts.{name}"]
    a = p.get(f"mlp.experts.{name}.lora_A")
    if a is None:
        return w
    b = p[f"mlp.experts.{name}.lora_B"]
    e = w.shape[0]
    r = a.shape[0] // e
    return w + scaling * torch.stack([b[:, i::e] @ a[i * r:(i + 1) * r] for i in range(e)])


def expert_factors(p, name):
    """(A (E, r, in), B (E, out, r)) of PEFT's LoRA on p["mlp.experts.<name>"], sliced per
    expert as in expert_weight; None without factors."""
    a = p.get(f"mlp.experts.{name}.lora_A")
    if a is None:
        return None
    b = p[f"mlp.experts.{name}.lora_B"]
    e = p[f"mlp.experts.{name}"].shape[0]
    r = a.shape[0] // e
    return (torch.stack([a[i * r:(i + 1) * r] for i in range(e)]),
            torch.stack([b[:, i::e] for i in range(e)]))


def moe_reference(p, m, k, router="softmax", norm_topk_prob=False, activation="silu",
                  force_idx=None, record=None, expert_lora_scaling=(0.0, 0.0),
                  expert_lora_factored=False):
    """A mixture-of-experts MLP on m (..., H), written densely: every expert on every token
    (a (T, E, H) tensor, fine at test sizes), then mixed by the (T, E) matrix of the routing
    weights (0 off the top k). p: the op's slots by name ("mlp.gate.weight" (E, H),
    "mlp.experts.gate_up_proj" (E, 2I, H), gate rows first, "mlp.experts.down_proj" (E, H, I);
    the shared expert "mlp.gate_proj/up_proj/down_proj.weight" and its gate
    "mlp.shared_expert_gate.weight" (1, H) when present). router: "softmax" | "sigmoid" scores
    in float32 (float64 stays); force_idx (T, k): use this choice of experts instead of the
    top k (a float64 reference of a low-precision run routes as the run's baseline did);
    record: a list the router's logits (T, E) are appended to (HF's router_logits);
    expert_lora_scaling: the scalings of LoRA factors on the two expert weights given in p
    (expert_weight); expert_lora_factored: their terms computed as s (x A_e^T) B_e^T beside
    the base weight's, not folded into it (the same math, rounded otherwise)."""
    shape = m.shape
    m = m.reshape(-1, shape[-1])
    logits = F.linear(m, p["mlp.gate.weight"])
    if record is not None:
        record.append(logits)
    wide = logits.to(torch.float32) if logits.dtype != F64 else logits
    scores = torch.softmax(wide, -1) if router == "softmax" else torch.sigmoid(wide)
    idx = scores.topk(k, -1).indices if force_idx is None else force_idx
    sel = scores.gather(1, idx)
    if norm_topk_prob:
        sel = sel / sel.sum(-1, keepdim=True)
    mix = torch.zeros_like(scores).scatter(1, idx, sel).to(m.dtype)      # (T, E)
    fold = (expert_weight if not expert_lora_factored else
            lambda p, name, s: p[f"mlp.experts.{name}"])
    gate_up = fold(p, "gate_up_proj", expert_lora_scaling[0])
    down = fold(p, "down_proj", expert_lora_scaling[1])
    gu = torch.einsum("th,eoh->teo", m, gate_up)  # (T, E, 2I)
    f = expert_factors(p, "gate_up_proj") if expert_lora_factored else None
    if f is not None:
        u = torch.einsum("th,erh->ter", m, f[0])
        gu = gu + expert_lora_scaling[0] * torch.einsum("ter,eor->teo", u, f[1])
    i = gu.shape[-1] // 2
    a = gate_activation(gu[..., :i], activation) * gu[..., i:]
    every = torch.einsum("tei,ehi->teh", a, down)  # (T, E, H)
    f = expert_factors(p, "down_proj") if expert_lora_factored else None
    if f is not None:
        u = torch.einsum("tei,eri->ter", a, f[0])
        every = every + expert_lora_scaling[1] * torch.einsum("ter,ehr->teh", u, f[1])
    y = (mix.unsqueeze(-1) * every).sum(1)
    if "mlp.gate_proj.weight" in p:
        shared = swiglu_reference(m, p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"],
                                  p["mlp.down_proj.weight"], activation=activation)[0]
        if "mlp.shared_expert_gate.weight" in p:
            shared = torch.sigmoid(F.linear(m, p["mlp.shared_expert_gate.weight"])) * shared
        y = y + shared
    return y.view(shape)


def reference_layer(p, x, cos, sin, mask, hq, hkv, eps=1e-6, qk_norm=False, norm_offset=0.0,
                    part="layer", activation="silu", softcap=0.0, rope_interleaved=False,
                    qk_norm_after_rope=False, moe=None):
    """p: a DecoderLayer state_dict (HF names), or the op's weight slots by name: a norm absent
    from p is the identity, "attention_output_norm.weight" / "mlp_output_norm.weight" norm a
    sublayer's output before the residual add, q/k norms of width heads * head_dim norm the
    whole projection. Norms multiply by (norm_offset + w). part: "layer", "attention" (x + the
    attention sublayer) or "mlp" (x + the MLP sublayer); activation: the MLP's
    (gate_activation); softcap > 0: the attention's scaled scores are capped to
    tanh(s / softcap) * softcap (HF Gemma 2's eager attention); rope_interleaved: RoPE as
    rope_interleaved_reference (tables of width R <= D); qk_norm_after_rope: the q/k norms
    norm the rotated projections (Hunyuan); moe: the MLP is moe_reference with these keyword
    arguments (k, router, ...). Computes in x's dtype."""
    def rms(t, w):
        if w is None:
            return t
        if w.shape[-1] != t.shape[-1]:  # over the whole projection (B, S, heads, D)
            return rms(t.flatten(2), w).view(t.shape)
        return (norm_offset + w) * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    def lin(t, name):
        return F.linear(t, p[name + ".weight"], p.get(name + ".bias"))

    def mlp(h):
        m = rms(h, p.get("post_attention_layernorm.weight"))
        if moe is not None:
            return h + rms(moe_reference(p, m, activation=activation, **moe),
                           p.get("mlp_output_norm.weight"))
        y = lin(gate_activation(lin(m, "mlp.gate_proj"), activation) * lin(m, "mlp.up_proj"),
                "mlp.down_proj")
        return h + rms(y, p.get("mlp_output_norm.weight"))

    if part == "mlp":
        return mlp(x)
    b, s, _ = x.shape
    d = p["self_attn.q_proj.weight"].shape[0] // hq
    n = rms(x, p.get("input_layernorm.weight"))
    q = lin(n, "self_attn.q_proj").view(b, s, hq, d)
    k = lin(n, "self_attn.k_proj").view(b, s, hkv, d)
    v = lin(n, "self_attn.v_proj").view(b, s, hkv, d).transpose(1, 2)
    with_norms = qk_norm or "self_attn.q_norm.weight" in p
    rope = rope_interleaved_reference if rope_interleaved else rope_reference
    if qk_norm_after_rope:
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if with_norms:
        q, k = rms(q, p["self_attn.q_norm.weight"]), rms(k, p["self_attn.k_norm.weight"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if not qk_norm_after_rope:
        q, k = rope(q, k, cos, sin)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    probs = probs.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # nothing to attend -> 0
    o = lin((probs @ v).transpose(1, 2).reshape(b, s, -1), "self_attn.o_proj")
    h = x + rms(o, p.get("attention_output_norm.weight"))
    return h if part == "attention" else mlp(h)


def make_layer(h, hq, hkv, i, dtype, policy="balanced", **kw):
    layer = DecoderLayer(h, hq, hkv, i, policy=policy, **kw).to(dtype)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, t in layer.named_parameters():
            if "norm" in name:
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif name.endswith("bias"):
                t.copy_(0.1 * torch.randn_like(t))
    return layer


def layer_weights_with_adapters(h, hq, hkv, i, rank, dtype, g):
    """The weights of make_layer(h, hq, hkv, i, dtype) (torch's generator: seed it first) with
    LoRA adapters of ``rank`` on every projection drawn from generator ``g`` (B non-zero, as
    after some training), keyed as ckpt_ext.blocks.decoder_layer takes them."""
    from ckpt_ext import blocks
    layer = make_layer(h, hq, hkv, i, dtype=dtype)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    for path in blocks.PROJECTIONS:
        w = weights[f"{path}.weight"]
        weights[f"{path}.lora_A"] = 0.3 * torch.randn(rank, w.shape[1], generator=g, dtype=dtype)
        weights[f"{path}.lora_B"] = 0.3 * torch.randn(w.shape[0], rank, generator=g, dtype=dtype)
    return weights


def make_mask(kind, b, s):
    if kind == "none":
        return None
    mask = torch.ones(b, s, dtype=torch.bool)
    lengths = torch.randint(1, s + 1, (b,))
    for r in range(b):  # left padding, as HF batches prompts
        mask[r, : s - lengths[r]] = False
    if kind == "fully_padded":
        mask[-1] = False
    return mask


# ---- attention baselines shared by the attention kernel tests ------------------------------

def packed_segment_ids(B, S, lengths, device="cpu", dtype=torch.int64, shuffle_ids=True):
    """(B, S) ids of documents packed back to back: row b holds runs of the given lengths
    (cycled until S is filled). shuffle_ids: the ids are a random permutation (not sorted, and
    rows share ids), else 0, 1, 2, ... ."""
    rows = []
    for b in range(B):
        ids, n, d = [], 0, 0
        while n < S:
            run = min(lengths[(b + d) % len(lengths)], S - n)
            ids += [d] * run
            n, d = n + run, d + 1
        rows.append(ids)
    out = torch.tensor(rows, dtype=torch.int64)
    if shuffle_ids:
        perm = torch.randperm(int(out.max()) + 1) * 7 - 3  # arbitrary, negative ones included
        out = perm[out]
    return out.to(dtype).to(device)


def eager_flash_identity_grads(q, k, v, mask, causal, scale, dout, out, segment_ids=None,
                               window=None, softcap=0.0):
    """Plain PyTorch backward at q's dtype via dS = P * (dP - rowsum(dO * O)), S x S in memory.

    q, dout, out (B, Hq, S, D); k, v (B, Hkv, S, D). Returns dict dq, dk, dv (GQA summed).
    softcap > 0: scores capped (tanh(s / softcap) * softcap) and dS times 1 - tanh^2.
    """
    B, Hq, S, D = q.shape
    group = Hq // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k_rep.transpose(-1, -2)) * scale
    if softcap > 0:
        t = torch.tanh(scores / softcap)
        scores = t * softcap
    allowed = allowed_matrix(B, S, mask, causal, q.device, segment_ids, window)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    p = torch.where(allowed.any(dim=-1, keepdim=True), torch.softmax(scores, dim=-1), zero)
    dp = dout @ v_rep.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
    if softcap > 0:
        ds = ds * (1 - t * t)
    dq = (ds @ k_rep) * scale
    dk = ((ds.transpose(-1, -2) @ q) * scale).view(B, -1, group, S, D).sum(dim=2)
    dv = (p.transpose(-1, -2) @ dout).view(B, -1, group, S, D).sum(dim=2)
    return dict(dq=dq, dk=dk, dv=dv)


# ---- SwiGLU MLP with PEFT LoRA adapters ----------------------------------------------------

SWIGLU_NEEDS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down",
                "A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down")


def lora_linear(t, w, b, lora_a=None, lora_b=None, scale=0.0, drop=None):
    """PEFT's LoRA Linear: ``linear(t, w, b) + scale * lora_B(lora_A(drop(t)))`` with t
    converted to the adapter's dtype for the low-rank path (drop, when given, applied after
    the conversion: PEFT's dropout) and the sum returned in t's dtype."""
    y = F.linear(t, w, b)
    if lora_a is None:
        return y
    ta = t.to(lora_a.dtype)
    if drop is not None:
        ta = drop(ta)
    return (y + scale * F.linear(F.linear(ta, lora_a), lora_b)).to(t.dtype)


def replayed_dropout(seed, stream, p, row_offset=0):
    """The dropout the kernel ops apply to an adapter's input (stream 4 | 5 | 6 for gate, up,
    down), as a function for lora_linear's ``drop``: the op ``lora_dropout``, whose mask is
    the documented hash (tests/test_lora_dropout.py checks it against numpy), so a reference
    sees the masks of the op under test. None for p = 0."""
    if not p:
        return None
    return lambda t: torch.ops.ckpt_ext.lora_dropout(t, seed, stream, p, row_offset)


def swiglu_lora_reference(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None,
                          lora=(), scaling=(), activation="silu", dropout=(), seed=None):
    """``down(act(gate(x)) * up(x))`` with optional adapters, plain PyTorch, differentiable.

    lora: [] or [A_gate, B_gate, A_up, B_up, A_down, B_down] (None where a projection has no
    adapter); scaling: [] or the 3 scales; activation: gate_activation's; dropout: [] or the 3
    probabilities of the adapters' inputs, masks replayed from ``seed`` (replayed_dropout).
    Computes in the dtypes it is given: pass float64 tensors for the ground truth, the test
    dtypes for the eager baseline."""
    lora = list(lora) or [None] * 6
    scaling = list(scaling) or [0.0] * 3
    drop = [replayed_dropout(seed, 4 + p, q) for p, q in enumerate(list(dropout) or [0.0] * 3)]
    gate = lora_linear(x, w_gate, b_gate, lora[0], lora[1], scaling[0], drop[0])
    up = lora_linear(x, w_up, b_up, lora[2], lora[3], scaling[1], drop[1])
    return lora_linear(gate_activation(gate, activation) * up, w_down, b_down, lora[4], lora[5],
                       scaling[2], drop[2])


def make_swiglu_lora(T, H, I, dtype, lora_dtype, ranks, bias, device="cpu", seed=0):
    """Inputs of one SwiGLU-with-LoRA case, drawn in their dtypes (the float64 reference sees
    the same values). ranks: (r_gate, r_up, r_down), None = no adapter on that projection.

    Returns (args, lora, scaling, dy) with args = (x, w_gate, w_up, w_down, b_gate, b_up,
    b_down). B is not zero (as after some training) so every gradient path is exercised."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dt).to(device)

    x = rnd(T, H)
    args = [x, rnd(I, H, scale=H ** -0.5), rnd(I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5)]
    args += [rnd(I, scale=0.5), rnd(I, scale=0.5), rnd(H, scale=0.5)] if bias else [None] * 3
    lora, scaling = [], []
    for r, (n_in, n_out) in zip(ranks, ((H, I), (H, I), (I, H))):
        if r is None:
            lora += [None, None]
        else:
            lora += [rnd(r, n_in, scale=n_in ** -0.5, dt=lora_dtype),
                     rnd(n_out, r, scale=r ** -0.5, dt=lora_dtype)]
        scaling.append(2.0 / r if r else 0.0)
    return args, lora, scaling, rnd(T, H)


# The 14 results of swiglu_fwd / swiglu_bwd, in the ops' order.
SWIGLU_OUT_NAMES = ("y", "dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down",
                    "dA_gate", "dB_gate", "dA_up", "dB_up", "dA_down", "dB_down")


def check_swiglu_lora(out, base, ref, needs=(True,) * 12, exact=False):
    """exact: float64 run, tight check; else the 2x / 3x baseline rule. Gradients not wanted
    or not applicable must be the empty placeholder."""
    grad_scale = magnitude(*[r for r in ref[1:] if r is not None])
    for name, want, o, b, r in zip(SWIGLU_OUT_NAMES, [True, True, *needs], out, base, ref):
        if r is None or not want:
            assert o.shape == (0,), f"{name}: expected an empty placeholder, got {o.shape}"
            continue
        assert o.shape == r.shape and o.dtype == b.dtype, (name, o.shape, o.dtype)
        scale = None if name == "y" else grad_scale
        if exact:
            check_f64(name, o, r, scale=scale)
        else:
            check_vs_baseline(name, o, b, r, FACTOR_OUT if name == "y" else FACTOR_GRAD,
                              o.dtype, scale=scale)


def swiglu_lora_grads(args, lora, scaling, dy, dtype=None, **kw):
    """y and the 12 + 1 gradients of swiglu_lora_reference by autograd, in the op's order:
    (y, dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, [dA_gate, dB_gate, dA_up, dB_up,
    dA_down, dB_down]); None where a tensor is absent. dtype: convert every tensor first (e.g.
    torch.float64 for the ground truth); kw: swiglu_lora_reference's activation, dropout,
    seed."""
    def prep(t):
        if t is None:
            return None
        return (t.to(dtype) if dtype is not None else t).detach().clone().requires_grad_()

    a = [prep(t) for t in args]
    lo = [prep(t) for t in lora]
    y = swiglu_lora_reference(*a, lora=lo, scaling=scaling, **kw)
    y.backward(dy.to(y.dtype))
    gradient = [t.grad if t is not None else None for t in a]
    return (y.detach(), *gradient, [t.grad if t is not None else None for t in lo])


# ---- attention over query chunks -----------------------------------------------------------
def attention_in_chunks(fwd, bwd, q, k, v, dout, mask, causal, scale, segment_ids, window,
                        rows, acc_dtype=torch.float32, softcap=0.0):
    """attention_fwd / attention_bwd (``fwd``, ``bwd``: the op or a launcher) over the query
    chunks [q0, q0 + rows) of q (q_offset = q0) against all keys: out, lse and dq concatenated
    over the chunks, dk / dv summed into acc_dtype accumulators (dk_acc / dv_acc, here laid out
    (B, Sk, Hkv, D) like the decoder layer's projections); softcap passed on to both.
    Returns dict(out, lse, dq, dk, dv)."""
    B, Hkv, Sk, D = k.shape
    dk_acc = torch.zeros(B, Sk, Hkv, D, dtype=acc_dtype, device=q.device).transpose(1, 2)
    dv_acc = torch.zeros_like(dk_acc)
    outs, lses, dqs = [], [], []
    for q0 in range(0, q.shape[2], rows):
        qc, dc = q[:, :, q0:q0 + rows], dout[:, :, q0:q0 + rows]
        out, lse = fwd(qc, k, v, mask, segment_ids, window, causal, scale, q0, softcap)
        dq, dk, dv = bwd(dc, qc, k, v, out, lse, mask, segment_ids, window, causal, scale, q0,
                         dk_acc, dv_acc, softcap)
        assert dk.shape == (0,) and dv.shape == (0,) and dk.dtype == k.dtype, (dk.shape, dk.dtype)
        assert out.shape == qc.shape and lse.shape == qc.shape[:3] and dq.shape == qc.shape
        outs.append(out), lses.append(lse), dqs.append(dq)
    return dict(out=torch.cat(outs, 2), lse=torch.cat(lses, 2), dq=torch.cat(dqs, 2),
                dk=dk_acc, dv=dv_acc)


def attention_abs_sums(q, k, v, dout, mask, causal, scale, segment_ids=None, window=None):
    """The scale of the rounding of attention's sums, whatever their order: for out, dq, dk and
    dv the largest sum of the absolute values of its terms (P |V|, |dS| |K| scale, |dS|^T |Q|
    scale and P^T |dO|, GQA heads summed), in float64. A result with cancelling terms (dk, dv
    summed over query chunks) rounds relative to this, not to its own magnitude."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    allowed = allowed_matrix(B, k.shape[2], mask, causal, q.device, segment_ids, window)
    s = (q @ kr.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ vr
    ds = p * (dout @ vr.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    group = lambda t: t.view(B, Hkv, G, *t.shape[2:]).sum(2)  # noqa: E731
    return dict(out=magnitude(p @ vr.abs()), dq=magnitude(ds.abs() @ kr.abs() * scale),
                dk=magnitude(group(ds.abs().transpose(-1, -2) @ q.abs() * scale)),
                dv=magnitude(group(p.transpose(-1, -2) @ dout.abs())))


def check_close_ulps(name, got, want, ulps, dtype=None, scale=None):
    """|got - want| <= ulps * eps(dtype) * scale entry-wise where want is finite (the other
    entries equal); scale defaults to magnitude(want): the tight check of two computations of
    one result that differ only in the order of their fp sums."""
    dtype = got.dtype if dtype is None else dtype
    scale = magnitude(want) if scale is None else scale
    err = max_err(got, want)
    bound = ulps * torch.finfo(dtype).eps * max(scale, 1e-30)
    print(f"  {name}: differs by {err:.3g} (bound {bound:.3g})")
    assert err <= bound, f"{name}: differs by {err:.3g} > {bound:.3g} ({ulps} ulps)"
