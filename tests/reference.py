"""An independent plain-PyTorch LLaMA decoder layer (explicit softmax, repeated K/V, no
ckpt_ext code) and the fixtures the layer tests share."""
import math

import torch
import torch.nn.functional as F

from ckpt_ext.modules import DecoderLayer


def rope_tables(s, d, dtype, batch=1, offset=None):
    pos = torch.arange(s, dtype=torch.float64)[None].repeat(batch, 1)
    if offset is not None:
        pos = pos + offset[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = pos[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def reference_layer(p, x, cos, sin, mask, hq, hkv, eps=1e-6, qk_norm=False):
    """p: a DecoderLayer state_dict (HF names). Computes in x's dtype."""
    def rms(t, w):
        return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    def lin(t, name):
        return F.linear(t, p[name + ".weight"], p.get(name + ".bias"))

    def rot(t):
        h = t.shape[-1] // 2
        return torch.cat([-t[..., h:], t[..., :h]], -1)

    b, s, _ = x.shape
    d = p["self_attn.q_proj.weight"].shape[0] // hq
    n = rms(x, p["input_layernorm.weight"])
    q = lin(n, "self_attn.q_proj").view(b, s, hq, d)
    k = lin(n, "self_attn.k_proj").view(b, s, hkv, d)
    v = lin(n, "self_attn.v_proj").view(b, s, hkv, d).transpose(1, 2)
    if qk_norm:
        q, k = rms(q, p["self_attn.q_norm.weight"]), rms(k, p["self_attn.k_norm.weight"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    c, sn = cos[:, None], sin[:, None]
    q, k = q * c + rot(q) * sn, k * c + rot(k) * sn
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    probs = probs.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # nothing to attend -> 0
    h = x + lin((probs @ v).transpose(1, 2).reshape(b, s, -1), "self_attn.o_proj")
    m = rms(h, p["post_attention_layernorm.weight"])
    return h + lin(F.silu(lin(m, "mlp.gate_proj")) * lin(m, "mlp.up_proj"), "mlp.down_proj")


def make_layer(h, hq, hkv, i, dtype, policy="balanced", **kw):
    layer = DecoderLayer(h, hq, hkv, i, policy=policy, **kw).to(dtype)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, t in layer.named_parameters():
            if "norm" in name:
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif name.endswith("bias"):
                t.copy_(0.1 * torch.randn_like(t))
    return layer


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

def allowed_matrix(B, S, mask, causal, device, segment_ids=None, window=None):
    """Bool (B, 1, S, S): query i may attend key j. The dense form of every attention mask rule:
    causal j <= i; key_padding_mask[b, j]; segment_ids[b, i] == segment_ids[b, j]; window (HF's
    sliding_window_overlay, key j visible iff i - window < j; not causal: also j < i + window).
    """
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    allowed = torch.ones(S, S, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window) & (causal | (j < i + window))
    allowed = allowed.expand(B, 1, S, S)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return allowed


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
                               window=None):
    """Plain PyTorch backward at q's dtype via dS = P * (dP - rowsum(dO * O)), S x S in memory.

    q, dout, out (B, Hq, S, D); k, v (B, Hkv, S, D). Returns dict dq, dk, dv (GQA summed).
    """
    B, Hq, S, D = q.shape
    group = Hq // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k_rep.transpose(-1, -2)) * scale
    allowed = allowed_matrix(B, S, mask, causal, q.device, segment_ids, window)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    p = torch.where(allowed.any(dim=-1, keepdim=True), torch.softmax(scores, dim=-1), zero)
    dp = dout @ v_rep.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
    dq = (ds @ k_rep) * scale
    dk = ((ds.transpose(-1, -2) @ q) * scale).view(B, -1, group, S, D).sum(dim=2)
    dv = (p.transpose(-1, -2) @ dout).view(B, -1, group, S, D).sum(dim=2)
    return dict(dq=dq, dk=dk, dv=dv)


# ---- SwiGLU MLP with PEFT LoRA adapters ----------------------------------------------------

SWIGLU_NEEDS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down",
                "A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down")


def lora_linear(t, w, b, lora_a=None, lora_b=None, scale=0.0):
    """PEFT's LoRA Linear: ``linear(t, w, b) + scale * lora_B(lora_A(t))`` with t converted to
    the adapter's dtype for the low-rank path and the sum returned in t's dtype."""
    y = F.linear(t, w, b)
    if lora_a is None:
        return y
    return (y + scale * F.linear(F.linear(t.to(lora_a.dtype), lora_a), lora_b)).to(t.dtype)


def swiglu_lora_reference(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None,
                          lora=(), scaling=()):
    """``down(silu(gate(x)) * up(x))`` with optional adapters, plain PyTorch, differentiable.

    lora: [] or [A_gate, B_gate, A_up, B_up, A_down, B_down] (None where a projection has no
    adapter); scaling: [] or the 3 scales. Computes in the dtypes it is given: pass float64
    tensors for the ground truth, the test dtypes for the eager baseline."""
    lora = list(lora) or [None] * 6
    scaling = list(scaling) or [0.0] * 3
    gate = lora_linear(x, w_gate, b_gate, lora[0], lora[1], scaling[0])
    up = lora_linear(x, w_up, b_up, lora[2], lora[3], scaling[1])
    return lora_linear(F.silu(gate) * up, w_down, b_down, lora[4], lora[5], scaling[2])


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


def swiglu_lora_grads(args, lora, scaling, dy, dtype=None):
    """y and the 12 + 1 gradients of swiglu_lora_reference by autograd, in the op's order:
    (y, dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, [dA_gate, dB_gate, dA_up, dB_up,
    dA_down, dB_down]); None where a tensor is absent. dtype: convert every tensor first (e.g.
    torch.float64 for the ground truth)."""
    def prep(t):
        if t is None:
            return None
        return (t.to(dtype) if dtype is not None else t).detach().clone().requires_grad_()

    a = [prep(t) for t in args]
    lo = [prep(t) for t in lora]
    y = swiglu_lora_reference(*a, lora=lo, scaling=scaling)
    y.backward(dy.to(y.dtype))
    gradient = [t.grad if t is not None else None for t in a]
    return (y.detach(), *gradient, [t.grad if t is not None else None for t in lo])
