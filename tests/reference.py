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
