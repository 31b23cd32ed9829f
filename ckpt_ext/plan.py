"""The recompute planner: what each preset keeps and recomputes, and the ``auto`` choice.

Memory model (exact; ``tests/test_blocks.py`` checks it against ``saved_activation_bytes``):
a decoder layer under a fused preset saves ``B*S*per_token_bytes(preset)`` bytes
(:func:`ckpt_ext.presets.per_token_bytes`). The cos/sin tables and the key padding mask are
shared by all layers, a few bytes per token once per model, and are left out of the budget.

Recompute model: the forward FLOPs of what a preset recomputes in backward, per layer,
counting matrix products only (2 FLOPs per multiply-add; norms, RoPE and the SwiGLU product
are element-wise and left out). With T = B*S tokens, causal attention (a query attends
(S+1)/2 keys on average), H hidden, Hq/Hkv heads, D head dim, I intermediate size:

    scores    = B*Hq*D*S*(S+1)           Q K^T over the causal triangle
    pv        = B*Hq*D*S*(S+1)           P V
    qkv       = 2*T*H*(Hq + 2*Hkv)*D     q, k, v projections
    o_proj    = 2*T*Hq*D*H
    gate_up   = 4*T*H*I
    down      = 2*T*I*H

    fast        scores                                 (the attention backward rebuilds the
                                                        softmax tiles P = exp(Q K^T - lse))
    balanced    scores + qkv + gate_up
    min_memory  scores + qkv + gate_up + scores + pv + o_proj   (attention forward, o_proj)
    torch       scores + scores + pv + qkv + o_proj + gate_up + down
                                                       (the whole layer forward, and the
                                                        softmax tiles again in SDPA's flash
                                                        backward, as in every other row)

A family that norms a sublayer's output before the residual add (Gemma 2/3, OLMo-2/3:
``LayerDims.attention_output_norm`` / ``mlp_output_norm``) saves the same bytes and recomputes
that output for the norm's backward: + o_proj for fast and balanced (min_memory recomputes it
already); + gate_up + down for balanced and min_memory (the MLP forward once more, since the
down projection's output is needed before the SwiGLU backward starts), + down alone for fast
(from its saved gate/up).

:func:`choose_presets` picks, per layer, one of the fused presets so that the layers' saved
bytes fit a budget with the least total recompute. It solves this small multiple-choice
knapsack exactly: both bytes and FLOPs are B*S times a per-token integer, so it keeps the
Pareto front of (bytes per token, FLOPs per token) over the layers seen so far. Exactness makes
it monotone (a larger budget never gives more recompute), and it depends on shapes only.

LM head (``head_saved_bytes``): HF's ``lm_head`` + ``ForCausalLMLoss`` keeps the head's input
(e*H per token), the float32 log-softmax of the upcast logits (4*V per token, saved by
``log_softmax`` and read by ``nll_loss``) and the shifted labels (8 per token), plus a 4-byte
scalar; it also returns the (B, S, V) logits in the model dtype, alive as long as the output
is. ``ckpt_ext.ops.linear_cross_entropy`` keeps the input, the labels and a float32 lse per
token (e*H + 12 per token).

CLI: ``python -m ckpt_ext.plan CONFIG --batch B --seq S [--dtype bf16] [--budget 20GiB]``.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from . import _C
from ._normed_head import walks_vocabulary
from .presets import FUSED_PRESETS, per_token_bytes

__all__ = ["LayerDims", "layer_dims_from_config", "parse_bytes", "format_bytes",
           "recompute_flops", "layer_bytes", "head_saved_bytes", "choose_presets", "step_peak",
           "StepPeak", "model_state_bytes", "longest_sequence", "OffloadPeak",
           "offload_device_bytes", "offload_split", "offload_step_peak",
           "longest_sequence_offload", "main"]

Budget = Union[int, str]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
# Cheapest recompute first: the order in which ties between layers' options are broken.
_CHOICES = ("fast", "balanced", "min_memory")


@dataclass(frozen=True)
class LayerDims:
    """The shape of one decoder layer: H, Hq, Hkv, D, I, and whether the family norms the
    attention's / the MLP's output before the residual add (module docstring)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    attention_output_norm: bool = False
    mlp_output_norm: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerDims: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LayerDims: num_kv_heads must divide num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")

    def kwargs(self) -> dict:
        """The keyword arguments of ``presets.per_token_bytes``."""
        return dict(H=self.hidden_size, Hq=self.num_heads, Hkv=self.num_kv_heads,
                    D=self.head_dim, I=self.intermediate_size)

    @classmethod
    def from_hf_layer(cls, layer, num_heads: int, family=None) -> "LayerDims":
        """From an HF Llama-family decoder layer (``self_attn.q_proj/k_proj``, ``mlp.gate_proj``)
        and its number of query heads, read off the projection shapes (Phi-3's fused qkv_proj,
        Phi-3's and GLM's fused gate_up_proj: their row blocks); ``family``
        (``ckpt_ext.hf.families``, LLaMA's when None) says which output norms it may have, and
        the layer whether they are there (an nn.Identity in a norm's place is none)."""
        from .hf.families import LLAMA, layer_norms
        norms = layer_norms(layer, family or LLAMA)
        out_norms = dict(attention_output_norm="attention_output_norm" in norms,
                         mlp_output_norm="mlp_output_norm" in norms)
        attn, mlp = layer.self_attn, layer.mlp
        inter = (mlp.gate_up_proj.out_features // 2 if "gate_up_proj" in mlp._modules
                 else mlp.gate_proj.out_features)
        if "qkv_proj" in attn._modules:
            qkv, head_dim = attn.qkv_proj, int(attn.head_dim)
            return cls(qkv.in_features, num_heads, (qkv.out_features // head_dim - num_heads) // 2,
                       head_dim, inter, **out_norms)
        q, k = attn.q_proj, attn.k_proj
        head_dim = q.out_features // num_heads
        return cls(q.in_features, num_heads, k.out_features // head_dim, head_dim, inter,
                   **out_norms)


def _config_value(config, name, default=None):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name,
                                                                               default)
    return default if value is None else value


def layer_dims_from_config(config) -> list:
    """One LayerDims per decoder layer of an HF config (object or dict): hidden_size,
    num_attention_heads, num_key_value_heads (default: the heads), head_dim (default
    hidden_size // heads), intermediate_size, num_hidden_layers."""
    missing = [n for n in ("hidden_size", "num_attention_heads", "intermediate_size",
                           "num_hidden_layers") if _config_value(config, n) is None]
    if missing:
        raise ValueError(f"config: missing {', '.join(missing)}")
    def integer(name, default=None):
        value = _config_value(config, name, default)
        try:
            if isinstance(value, bool):
                raise TypeError
            return operator.index(value)
        except TypeError:
            raise ValueError(f"config: {name} must be an int, got {value!r}") from None

    H = integer("hidden_size")
    heads = integer("num_attention_heads")
    if heads <= 0:
        raise ValueError(f"config: num_attention_heads must be a positive int, got {heads}")
    kv = integer("num_key_value_heads", heads)
    D = integer("head_dim", H // heads)
    from .hf.families import FAMILIES, LLAMA
    family = FAMILIES.get(_config_value(config, "model_type"), LLAMA)
    flag = family.output_norms_flag  # HyperCLOVA X's use_post_norm
    out_norms = flag is None or _config_value(config, flag, True) is not False
    dims = LayerDims(H, heads, kv, D, integer("intermediate_size"),
                     attention_output_norm=out_norms and "attention_output_norm" in family.norms,
                     mlp_output_norm=out_norms and "mlp_output_norm" in family.norms)
    layers = integer("num_hidden_layers")
    if layers <= 0:
        raise ValueError(f"config: num_hidden_layers must be a positive int, got {layers}")
    return [dims] * layers


# ---- bytes ---------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Budget, what: str = "activation_budget") -> int:
    """Bytes from an int or a string such as "20GiB", "512MB", "1.5 GiB", "4096" (KB/MB/GB/TB
    are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; case-insensitive)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string such as '20GiB', got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be non-negative, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be an int or a string such as '20GiB', got "
                        f"{type(value).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{what}: cannot read {value!r} as bytes; use an int or a number with "
                         f"one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Bytes in binary units with 2 decimals: "20.00 GiB"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be a torch dtype or one of {', '.join(_DTYPES)}, got {dtype!r}")


def layer_bytes(preset: str, dims: LayerDims, B: int, S: int, dtype) -> int:
    """Bytes one layer saves under a fused preset (or ``torch``): B*S*per_token_bytes."""
    return B * S * per_token_bytes(preset, dtype=_dtype(dtype), **dims.kwargs())


def head_saved_bytes(B: int, S: int, H: int, V: int, dtype, fused: bool) -> int:
    """Bytes the LM head + loss keeps for backward (see the module docstring): HF's
    ``B*S*(e*H + 4*V + 8) + 4``, the fused op's ``B*S*(e*H + 12)``."""
    e = _dtype(dtype).itemsize
    return B * S * (e * H + 12) if fused else B * S * (e * H + 4 * V + 8) + 4


# ---- the step's peak ---------------------------------------------------------------------------
PEAK_SETUPS = ("hf_gc", "hf_gc+fused", "fast", "balanced", "min_memory")
_PATHS = ("cuda", "cpu")


@dataclass(frozen=True)
class StepPeak:
    """The activation memory of one training step (see :func:`step_peak`)."""

    saved: int      # kept for backward when the forward ends: layers, head, cos/sin
    peak: int       # the most allocated at once above the step's start
    phase: str      # where the peak is


def layer_chunk_rows(d: LayerDims, e: int, chunk_bytes: int) -> int:
    """Tokens per chunk of a fused decoder layer (csrc/layer_math.cpp ``layer_chunk_rows``):
    the byte cap over the chunk's per-token working set, the attention's q, out, dout and dq
    (4 Hq D) and the MLP's three (rows, I) tensors, at the compute width (float32 at least)."""
    width = 4 * d.num_heads * d.head_dim + 3 * d.intermediate_size
    return max(1, chunk_bytes // (width * max(4, e)))


def step_peak(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, dtype, *,
              path: str = "cuda", train_weights: bool = True,
              chunk_bytes: Optional[int] = None) -> StepPeak:
    """A model of the activation memory of one training step of a Llama-style
    ``*ForCausalLM`` (a forward with labels, then backward), above what the step starts with
    (weights, the ids, and parameter gradients from an earlier step, added to in place).

    ``setup``: ``"hf_gc"`` (HF gradient checkpointing with HF's final norm, head and loss),
    ``"hf_gc+fused"`` (the same checkpointing with a fused loss: the ``torch`` preset with
    ``patch_llama``'s head), or a fused preset with the fused head (``"fast"``,
    ``"balanced"``, ``"min_memory"``). ``path``: ``"cuda"`` (the Triton kernels) or ``"cpu"``
    (the ATen kernels), whose transients differ. ``train_weights``: a full fine-tune (the
    top layer's and the head's weight gradients exist as new tensors before they are added
    to ``.grad``); False for LoRA on a frozen base (the adapters' gradients are negligible).
    ``chunk_bytes``: the byte cap of the token chunks, by default the one the kernels read
    (``CKPT_EXT_CHUNK_BYTES``, 64 MiB unless set).

    The peak is the larger of two moments (T = B*S tokens, e the element size, Q = Hq*D,
    K = Hkv*D):

    * the head: everything saved, and in the fused head's forward the final norm's output
      (e*T*H, dropped after it), the normed rows of one chunk of the byte cap and, on the
      CPU, one (rows, V) fp32 logits buffer within the cap; in its backward dx (e*T*H), the
      normed rows and their gradient for one chunk, that buffer (Triton: a dlogits chunk of
      about max(rows*H, 2^25) elements, and training the head an fp32 accumulator of the
      chunk's dx) and, training the head, its weight gradient (e*V*H), over several token
      chunks with an fp32 sum (4*V*H more) unless the rows are few enough to be normalised in
      one piece (``_normed_head.walks_vocabulary``: (2e + 4)*T < 4*V); in HF's head, dx and the
      gradients of the fp32 log-softmax and of the logits (T*V*(4 + e)), or the logits'
      gradient with the weight gradient when that is more;
    * the top layer's backward (the layers below still hold what they saved), the larger of
      its MLP part and its attention part. Counted from the allocator at the peak (CPU, every
      preset, ``tests/test_plan.py``), besides the saved bytes: the torch preset re-runs HF's
      layer, 6 (T, H), 2 (T, Q), 2 (T, K) and 6 (T, I) tensors; the fused presets' MLP part
      holds dy, the MLP input and its gradient (and for ``min_memory`` the recomputed h, q,
      k, v, out) with the SwiGLU backward's (rows, I) work: on the CPU six fp32 (rows, I)
      buffers together within the byte cap (four for ``fast``, whose gate/up are saved), in
      the Triton kernels three (rows, I) tensors of the layer's token chunk (three (rows, I)
      tensors at the compute width within the cap; training the weights over several chunks,
      their gradients' fp32 sum and one chunk's gradients besides); their attention
      part 9 (T, H), 5 (T, Q) and 6 (T, K) tensors (``fast``: 3 and 3, its q/k/v are saved;
      ``min_memory``: one more (T, Q), out) and, training the weights, the layer's weight
      gradients; the Triton dQ adds an fp32 (T, Q) accumulator.

    The sequence-sized terms are what the sequence-tiled layer removes; the model is kept
    in step with the code by the test that measures it.
    """
    if setup not in PEAK_SETUPS:
        raise ValueError(f"step_peak: setup must be one of {', '.join(PEAK_SETUPS)}; got "
                         f"{setup!r}")
    if path not in _PATHS:
        raise ValueError(f"step_peak: path must be 'cuda' or 'cpu', got {path!r}")
    _check_shape_args(B, S)
    layers = list(layers)
    if not layers:
        raise ValueError("step_peak: layers must not be empty")
    e = _dtype(dtype).itemsize
    T = B * S
    if chunk_bytes is None:
        chunk_bytes = _C.chunk_bytes()
    d = max(layers, key=lambda x: x.hidden_size * x.intermediate_size)
    H, Hq, D, I = d.hidden_size, d.num_heads, d.head_dim, d.intermediate_size
    Q, K = Hq * D, d.num_kv_heads * D
    preset = "torch" if setup.startswith("hf_gc") else setup
    layers_saved = sum(layer_bytes(preset, x, B, S, dtype) for x in layers)
    rope = 2 * S * D * e
    lse = 4 * Hq * T
    fused_head = setup != "hf_gc"
    if fused_head:   # the pre-norm hidden state, the labels, a float32 lse
        head_saved = T * (e * H + 12)
    else:            # HF's norm (an fp32 copy of its input, the fp32 rsqrt, the normalised
        # rows in the input dtype), then the head (its input, the fp32 log-softmax, labels)
        head_saved = T * (4 * H + 4 + e * H) + head_saved_bytes(B, S, H, V, dtype, fused=False)
    saved = layers_saved + rope + head_saved

    # the head, forward (the logits buffers) or backward (the gradients)
    dw = e * V * H if train_weights else 0
    if fused_head:
        rows = min(T, max(1, chunk_bytes // (4 * H)))
        if train_weights and walks_vocabulary(T, V, e):
            rows = T       # its backward normalises the rows in one piece
        # training the weight over several token chunks: an fp32 accumulator, or each
        # chunk's gradient beside the fp32 sum
        dw_sum = 4 * V * H if train_weights and rows < T else 0
        if path == "cpu":    # one (rows, V) fp32 logits buffer within the cap, both ways
            fwd_logits = bwd_logits = min(rows * V * 4, max(V * 4, chunk_bytes))
        else:                # Triton: tiles in forward; in backward a dlogits chunk of about
            fwd_logits = 0   # max(rows*H, 2^25) elements, and training the head an fp32 dx
            bwd_logits = e * max(rows * H, 1 << 25) + (4 * rows * H if train_weights else 0)
        forward = e * T * H + e * rows * H + fwd_logits
        backward = e * T * H + 2 * e * rows * H + bwd_logits + dw + dw_sum
        head_work = max(forward, backward)
    else:
        head_work = e * T * H + max(T * V * (4 + e), T * V * e + dw)
    head_peak = saved + head_work

    # the top layer's backward
    grads = e * H * (2 * Q + 2 * K + 3 * I) if train_weights else 0
    if preset == "torch":
        layer_work = e * T * (6 * H + 2 * Q + 2 * K + 6 * I) + lse
        phase = "top layer backward (HF's layer re-run)"
    else:
        # The MLP walks token chunks of the cap (three (rows, I) tensors at the compute width)
        mlp_rows = min(T, max(1, chunk_bytes // (3 * max(4, e) * I)))
        if path == "cpu":   # (rows, I) fp32 buffers within the cap: six, or four with the
            n = 4 if preset == "fast" else 6        # gate/up that fast saves
            swiglu = n * 4 * I * min(T, max(1, chunk_bytes // (n * 4 * I)))
        else:               # the Triton backward's dh, dgate, dup of one chunk
            swiglu = 3 * e * mlp_rows * I
        if train_weights and mlp_rows < T:   # the weights' gradients summed over chunks:
            swiglu += 3 * I * H * (4 + e)     # an fp32 sum and the chunk's own
        rows = layer_chunk_rows(d, e, chunk_bytes)
        if rows >= T:        # one chunk: the layer as written out
            if preset == "min_memory":
                mlp = e * T * (4 * H + 2 * Q + 2 * K) + lse + swiglu
                attn = e * T * (9 * H + 6 * Q + 6 * K)
            elif preset == "balanced":
                mlp = e * T * 3 * H + swiglu
                attn = e * T * (9 * H + 5 * Q + 6 * K)
            else:
                mlp = e * T * 3 * H + swiglu
                attn = e * T * (9 * H + 3 * Q + 3 * K)
            if path == "cuda":
                attn += 4 * T * Q
        else:                # token chunks: dy, dx, k and v (kept by fast), fp32 dk/dv sums
            whole = e * T * 2 * H + (0 if preset == "fast" else 2 * e * T * K) + 8 * T * K
            if path == "cpu":
                n = 4 if preset == "fast" else 6
                swiglu = n * 4 * I * min(rows, max(1, chunk_bytes // (n * 4 * I)))
            else:
                swiglu = 3 * e * rows * I
            # the chunk's n, h, MLP input and dh, q before and after RoPE and out beside the
            # MLP's backward; then dh, n, dn with q, out, dout, dq and dq before RoPE
            mlp = whole + e * rows * (4 * H + 3 * Q) + swiglu
            attn = whole + e * rows * (3 * H + 6 * Q)
            if path == "cuda":   # the Triton dQ's fp32 accumulator
                attn += 4 * rows * Q
            else:                # the CPU backward's fp32 copies of a kv head's keys and
                attn += 16 * T * K   # values and its dk, dv sums, (T, D) each, per head
            if train_weights:   # the layer's gradients summed over the chunks in fp32
                grads += (4 - e) * H * (2 * Q + 2 * K + 3 * I) if e < 4 else 0
        attn += grads
        layer_work = max(mlp, attn)
        phase = f"top layer backward ({'MLP' if mlp >= attn else 'attention'} part)"
    layer_peak = layers_saved + rope + layer_work
    if head_peak >= layer_peak:
        return StepPeak(saved, head_peak, "head backward")
    return StepPeak(saved, layer_peak, phase)


def model_state_bytes(layers: Sequence[LayerDims], V: int, dtype, weights: str,
                      lora_rank: int = 16, tied: bool = False) -> int:
    """Bytes the model and its optimizer hold outside the step: ``weights="full"``, a full
    fine-tune with AdamW on fp32 weights (weights, gradients and two moments: 16 bytes a
    parameter, as under ``Trainer(bf16=True)``); ``"lora"``, a frozen base in ``dtype`` with
    rank-``lora_rank`` adapters on every projection (fp32, AdamW: 16 bytes an adapter
    parameter)."""
    e = _dtype(dtype).itemsize
    base = V * layers[0].hidden_size * (1 if tied else 2) + layers[0].hidden_size
    adapters = 0
    for x in layers:
        H, Q, K, I = (x.hidden_size, x.num_heads * x.head_dim, x.num_kv_heads * x.head_dim,
                      x.intermediate_size)
        base += H * (2 * Q + 2 * K + 3 * I) + 2 * H
        adapters += lora_rank * ((H + Q) + 2 * (H + K) + (Q + H) + 2 * (H + I) + (I + H))
    if weights == "full":
        return 16 * base
    if weights == "lora":
        return e * base + 16 * adapters
    raise ValueError(f"model_state_bytes: weights must be 'full' or 'lora', got {weights!r}")


def _longest_fitting(fits, limit: int) -> int:
    """The largest S in [1, limit] with fits(S), fits being monotone (a bisection); 0 if even
    S = 1 does not fit."""
    if not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def longest_sequence(setup: str, layers: Sequence[LayerDims], V: int, B: int, dtype,
                     device_memory: int, weights: str, *, path: str = "cuda",
                     limit: int = 1 << 26) -> int:
    """The longest S (at most ``limit``) whose step fits ``device_memory`` with the model
    state of ``weights`` (:func:`model_state_bytes`), by :func:`step_peak`; 0 if none does."""
    state = model_state_bytes(layers, V, dtype, weights)
    fits = lambda s: state + step_peak(setup, layers, V, B, s, dtype, path=path,  # noqa: E731
                                       train_weights=weights == "full").peak <= device_memory
    return _longest_fitting(fits, limit)


# ---- offload (ckpt_ext.offload) ------------------------------------------------------------------
OFFLOAD_SETUPS = ("fast", "balanced", "min_memory")


@dataclass(frozen=True)
class OffloadPeak:
    """One training step with ``offload="cpu"`` (see :func:`offload_step_peak`)."""

    peak: int           # device: the step's peak above its start
    host: int           # host pool bytes held when the forward ends
    offloaded: int      # layers whose saved tensors are in host memory
    kept: int           # bytes of the layers past the host cap, kept on the device
    pool: int           # the device prefetch pool


def offload_device_bytes(layers: Sequence[LayerDims], presets: Sequence[str], B: int, S: int,
                         dtype, prefetch: int = 1) -> int:
    """The device prefetch pool: ``prefetch + 1`` slots (the layer running backward and the
    ones being copied back), each as large as the largest layer's saved bytes."""
    sizes = sorted((layer_bytes(p, x, B, S, dtype) for p, x in zip(presets, layers)),
                   reverse=True)
    return sum(sizes[:prefetch + 1])


def offload_split(layers: Sequence[LayerDims], presets: Sequence[str], B: int, S: int, dtype,
                  host_limit: Optional[int] = None):
    """(layers offloaded, host bytes, device bytes kept): the layers, in forward order, move to
    host memory while the host total stays within ``host_limit``; the rest stay (as the
    offloader does with ``offload_limit``)."""
    host = kept = n = 0
    full = False
    for p, x in zip(presets, layers):
        b = layer_bytes(p, x, B, S, dtype)
        if not full and (host_limit is None or host + b <= host_limit):
            host, n = host + b, n + 1
        else:
            full, kept = True, kept + b
    return n, host, kept


def offload_step_peak(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, dtype,
                      *, path: str = "cuda", train_weights: bool = True,
                      host_limit: Optional[int] = None, prefetch: int = 1) -> OffloadPeak:
    """:func:`step_peak` of a fused preset with its layers' saved bytes in host memory: the
    peak less the bytes of the offloaded layers plus the device prefetch pool (counted at
    every phase, which overstates the head's phase, when the pool is still empty)."""
    if setup not in OFFLOAD_SETUPS:
        raise ValueError(f"offload_step_peak: setup must be one of {', '.join(OFFLOAD_SETUPS)} "
                         f"(offload moves what a fused layer saves); got {setup!r}")
    layers = list(layers)
    presets = [setup] * len(layers)
    base = step_peak(setup, layers, V, B, S, dtype, path=path, train_weights=train_weights)
    n, host, kept = offload_split(layers, presets, B, S, dtype, host_limit)
    pool = offload_device_bytes(layers[:n], presets[:n], B, S, dtype, prefetch) if n else 0
    return OffloadPeak(base.peak - host + pool, host, n, kept, pool)


def longest_sequence_offload(setup: str, layers: Sequence[LayerDims], V: int, B: int, dtype,
                             device_memory: int, host_memory: Optional[int], weights: str, *,
                             path: str = "cuda", limit: int = 1 << 26) -> int:
    """The longest S (at most ``limit``) whose offloaded step (:func:`offload_step_peak` with
    ``host_memory`` as the host cap) fits ``device_memory`` with the model state; 0 if none."""
    state = model_state_bytes(layers, V, dtype, weights)

    def fits(s):
        p = offload_step_peak(setup, layers, V, B, s, dtype, path=path,
                              train_weights=weights == "full", host_limit=host_memory)
        return state + p.peak <= device_memory

    return _longest_fitting(fits, limit)


# ---- FLOPs ---------------------------------------------------------------------------------
def _flops_per_token(preset: str, d: LayerDims, S: int) -> int:
    """Recompute FLOPs of one layer divided by B*S (an integer: see the module docstring)."""
    H, Hq, Hkv, D, I = (d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim,
                        d.intermediate_size)
    scores = pv = Hq * D * (S + 1)
    qkv = 2 * H * (Hq + 2 * Hkv) * D
    o_proj = 2 * Hq * D * H
    gate_up = 4 * H * I
    down = 2 * I * H
    # the output norms' backward reads the sublayer's output (module docstring)
    out_norms = (d.mlp_output_norm * (down if preset == "fast" else gate_up + down)
                 + (d.attention_output_norm and preset != "min_memory") * o_proj)
    if preset == "fast":
        return scores + out_norms
    if preset == "balanced":
        return scores + qkv + gate_up + out_norms
    if preset == "min_memory":
        return 2 * scores + pv + qkv + gate_up + o_proj + out_norms
    if preset == "torch":
        return 2 * scores + pv + qkv + o_proj + gate_up + down
    raise ValueError(f"recompute_flops: preset must be one of 'fast', 'balanced', "
                     f"'min_memory', 'torch'; got {preset!r}")


def recompute_flops(preset: str, dims: LayerDims, B: int, S: int) -> int:
    """Forward FLOPs that ``preset`` recomputes in one layer's backward (module docstring)."""
    return B * S * _flops_per_token(preset, dims, S)


# ---- the chooser ---------------------------------------------------------------------------
def _check_shape_args(B, S):
    for name, v in (("B", B), ("S", S)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"choose_presets: {name} must be a positive int, got {v!r}")


def choose_presets(layers: Sequence[LayerDims], B: int, S: int, dtype,
                   budget_bytes: Budget) -> list:
    """One fused preset per layer ("fast", "balanced" or "min_memory") such that the layers'
    saved bytes, ``sum B*S*per_token_bytes``, are at most ``budget_bytes`` (an int or a string
    such as "20GiB"), with the least total recompute FLOPs (module docstring); among choices
    of equal recompute, the fewest bytes. Exact, deterministic and monotone: a larger budget
    never gives more recompute.

    Raises ValueError naming the smallest budget that fits (every layer "min_memory") when
    ``budget_bytes`` is below it.
    """
    budget = parse_bytes(budget_bytes)
    _check_shape_args(B, S)
    layers = list(layers)
    if not layers:
        return []
    dt = _dtype(dtype)
    ptb = np.array([[per_token_bytes(p, dtype=dt, **d.kwargs()) for p in _CHOICES]
                    for d in layers], dtype=np.int64)                      # (L, 3)
    ptf = np.array([[_flops_per_token(p, d, S) for p in _CHOICES] for d in layers],
                   dtype=np.int64)                                          # (L, 3)
    smallest = B * S * int(ptb[:, 2].sum())
    if budget < smallest:
        raise ValueError(
            f"activation_budget of {budget} bytes ({format_bytes(budget)}) is below the "
            f"smallest that fits: {smallest} bytes ({format_bytes(smallest)}), every one of the "
            f"{len(layers)} decoder layers 'min_memory', at B={B}, S={S}, {str(dt)[6:]}. Raise the "
            f"budget or shorten the batch")
    cap = budget // (B * S)                       # per-token budget: ptb sums are integers
    tail_min = np.concatenate([np.cumsum(ptb[::-1, 2])[::-1][1:], [0]])   # later layers' min
    bytes_, flops = np.zeros(1, np.int64), np.zeros(1, np.int64)
    parents, options = [], []
    for i in range(len(layers)):
        cb = (bytes_[:, None] + ptb[i][None, :]).ravel()                  # state-major
        cf = (flops[:, None] + ptf[i][None, :]).ravel()
        idx = np.flatnonzero(cb + tail_min[i] <= cap)
        order = idx[np.lexsort((idx, cf[idx], cb[idx]))]   # bytes, then FLOPs, then index
        f_sorted = cf[order]
        # Pareto front: keep a state only if it recomputes less than every cheaper one.
        prev_min = np.minimum.accumulate(np.concatenate([[np.iinfo(np.int64).max],
                                                         f_sorted[:-1]]))
        keep = order[f_sorted < prev_min]
        bytes_, flops = cb[keep], cf[keep]
        parents.append(keep // 3)
        options.append(keep % 3)
    state = int(np.argmin(flops))       # fewest FLOPs; the front's bytes fall as FLOPs rise
    chosen = []
    for i in range(len(layers) - 1, -1, -1):
        chosen.append(_CHOICES[int(options[i][state])])
        state = int(parents[i][state])
    return chosen[::-1]


# ---- CLI -----------------------------------------------------------------------------------
def _read_config(path: str) -> dict:
    """The config at ``path`` (a config.json or a model directory); ValueError naming the file
    when it cannot be read or is not a JSON object."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if isinstance(config, dict) and "hidden_size" not in config:
        config = config.get("text_config", config)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object (an HF config), got "
                         f"{type(config).__name__}")
    return config


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _table(rows, header):
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in
                               enumerate(zip(r, widths))) for r in cells)


def _tflop(n: int) -> str:
    return f"{n / 1e12:.3f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ckpt_ext.plan",
        description="Saved-activation bytes of each ckpt_ext preset, recompute FLOPs, the LM "
                    "head with and without the fused loss, and the 'auto' choice for a budget.")
    ap.add_argument("config", nargs="?", help="an HF config.json (or a model directory)")
    ap.add_argument("--hidden-size", type=_positive_int)
    ap.add_argument("--heads", type=_positive_int, help="num_attention_heads")
    ap.add_argument("--kv-heads", type=_positive_int, help="num_key_value_heads (default: --heads)")
    ap.add_argument("--head-dim", type=_positive_int, help="default hidden_size // heads")
    ap.add_argument("--intermediate-size", type=_positive_int)
    ap.add_argument("--layers", type=_positive_int, help="num_hidden_layers")
    ap.add_argument("--vocab-size", type=_positive_int)
    ap.add_argument("--batch", type=_positive_int, required=True)
    ap.add_argument("--seq", type=_positive_int, required=True)
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--budget", help="bytes for the decoder layers' saved activations, e.g. "
                                     "20GiB or 512MB: prints the 'auto' choice")
    ap.add_argument("--device-memory", help="a device's memory, e.g. 80GiB: prints the longest "
                                            "sequence whose step fits it, per setup")
    ap.add_argument("--weights", choices=("full", "lora"), default="full",
                    help="what the device also holds (with --device-memory): 'full', fp32 "
                         "weights, gradients and AdamW moments (16 B a parameter); 'lora', the "
                         "frozen base in --dtype plus rank-16 adapters on every projection")
    ap.add_argument("--path", choices=_PATHS, default="cuda",
                    help="whose transients the peak model counts: the Triton kernels (cuda) or "
                         "the ATen kernels (cpu)")
    ap.add_argument("--offload", action="store_true",
                    help="also print each fused preset with offload='cpu': device peak, host "
                         "bytes, and (with --device-memory) the longest sequence that fits")
    ap.add_argument("--host-memory", help="with --offload: the host memory for saved layer "
                                          "tensors (offload_limit), e.g. 256GiB")
    args = ap.parse_args(argv)
    if args.host_memory is not None and not args.offload:
        ap.error("argument --host-memory: applies with --offload only")
    for name in ("budget", "device_memory", "host_memory"):
        if getattr(args, name) is not None:
            try:
                parse_bytes(getattr(args, name), f"argument --{name.replace('_', '-')}")
            except (TypeError, ValueError) as e:
                ap.error(str(e))

    try:
        config = _read_config(args.config) if args.config else {}
    except ValueError as e:
        ap.error(f"argument config: {e}")
    for key, arg in (("hidden_size", "hidden_size"), ("num_attention_heads", "heads"),
                     ("num_key_value_heads", "kv_heads"), ("head_dim", "head_dim"),
                     ("intermediate_size", "intermediate_size"),
                     ("num_hidden_layers", "layers"), ("vocab_size", "vocab_size")):
        if getattr(args, arg) is not None:
            config[key] = getattr(args, arg)
    try:
        layers = layer_dims_from_config(config)
    except ValueError as e:
        ap.error(f"{e} (give a config.json or --hidden-size/--heads/--intermediate-size/"
                 f"--layers)")
    if "vocab_size" not in config:
        ap.error("missing vocab_size (in the config or --vocab-size)")
    V = config["vocab_size"]
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        ap.error(f"vocab_size must be a positive int (in the config or --vocab-size), got {V!r}")
    B, S, dtype = args.batch, args.seq, _DTYPES[args.dtype]
    d = layers[0]
    L, T = len(layers), B * S
    head_hf = head_saved_bytes(B, S, d.hidden_size, V, dtype, fused=False)
    head_fused = head_saved_bytes(B, S, d.hidden_size, V, dtype, fused=True)
    print(f"{L} layers, H {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads}, head_dim "
          f"{d.head_dim}, I {d.intermediate_size}, V {V}; B {B}, S {S} ({T} tokens), "
          f"{str(dtype).replace('torch.', '')}")
    rows = []
    for preset in ("fast", "balanced", "min_memory", "torch"):
        ptb = sum(per_token_bytes(preset, dtype=dtype, **x.kwargs()) for x in layers)
        model = B * S * ptb
        flops = sum(recompute_flops(preset, x, B, S) for x in layers)
        rows.append([preset, f"{ptb // L:,}", format_bytes(model // L), format_bytes(model),
                     format_bytes(model + head_hf), format_bytes(model + head_fused),
                     _tflop(flops // L), _tflop(flops)])
    print(_table(rows, ["preset", "B/token/layer", "per layer", "layers", "+ HF head",
                        "+ fused head", "recompute TFLOP/layer", "recompute TFLOP"]))
    e = dtype.itemsize
    print(f"LM head + loss, saved for backward: HF {format_bytes(head_hf)} (per token: hidden "
          f"{e}*H + fp32 log-softmax 4*V + labels 8 = {e * d.hidden_size + 4 * V + 8:,} B; "
          f"it also returns the {T} x {V} logits, {format_bytes(T * V * e)}); fused "
          f"{format_bytes(head_fused)} (hidden + labels + fp32 lse = "
          f"{e * d.hidden_size + 12:,} B/token)")
    print("recompute: forward FLOPs redone in backward (matmuls only; see ckpt_ext.plan); "
          "'torch' is listed for comparison and never chosen by 'auto'")
    _print_steps(args, layers, V, B, S, dtype)
    if args.offload:
        _print_offload(args, layers, V, B, S, dtype)
    if args.budget is not None:
        try:
            chosen = choose_presets(layers, B, S, dtype, args.budget)
        except ValueError as err:
            print(f"auto: {err}", file=sys.stderr)
            return 2
        used = sum(layer_bytes(p, x, B, S, dtype) for p, x in zip(chosen, layers))
        flops = sum(recompute_flops(p, x, B, S) for p, x in zip(chosen, layers))
        counts = ", ".join(f"{chosen.count(p)} x {p}" for p in FUSED_PRESETS if p in chosen)
        print(f"auto for a budget of {format_bytes(parse_bytes(args.budget))}: {counts}; "
              f"layers keep {format_bytes(used)} ({format_bytes(used + head_fused)} with the "
              f"fused head), recompute {_tflop(flops)} TFLOP")
        print("per layer: " + " ".join(p for p in chosen))
    return 0


_SETUP_NAMES = {"hf_gc": "HF checkpointing, HF head", "hf_gc+fused": "HF checkpointing, fused loss",
                "fast": "fast", "balanced": "balanced", "min_memory": "min_memory"}


def _print_steps(args, layers, V, B, S, dtype) -> None:
    """The step table: saved bytes and peak per setup (and the longest sequence that fits)."""
    train = args.weights == "full"
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    header = ["step (" + ("full fine-tune" if train else "LoRA") + f", {args.path} path)",
              "saved", "peak", "peak KiB/token", "peak is in"]
    if memory is not None:
        state = model_state_bytes(layers, V, dtype, args.weights)
        header.append(f"longest S in {format_bytes(memory)}")
    rows = []
    for setup in PEAK_SETUPS:
        p = step_peak(setup, layers, V, B, S, dtype, path=args.path, train_weights=train)
        row = [_SETUP_NAMES[setup], format_bytes(p.saved), format_bytes(p.peak),
               f"{p.peak / (B * S) / 1024:,.1f}", p.phase]
        if memory is not None:
            row.append(f"{longest_sequence(setup, layers, V, B, dtype, memory, args.weights, path=args.path):,}")
        rows.append(row)
    print(_table(rows, header))
    print("peak: the most a training step allocates at once above its start, gradients of an "
          "earlier step present (ckpt_ext.plan.step_peak); the fused presets use the fused "
          "head and final norm")
    if memory is not None:
        print(f"model state on the device ({args.weights}): {format_bytes(state)}; longest S: "
              f"batch {B}, the step's peak plus the model state within the device memory")



def _print_offload(args, layers, V, B, S, dtype) -> None:
    """The offload table: device peak, host bytes and the longest sequence per fused preset."""
    train = args.weights == "full"
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    host = parse_bytes(args.host_memory) if args.host_memory is not None else None
    header = [f"offload='cpu' ({'full fine-tune' if train else 'LoRA'}, {args.path} path)",
              "device peak", "of it the prefetch pool", "host bytes", "layers in host",
              "kept on device"]
    if memory is not None:
        header.append(f"longest S in {format_bytes(memory)}"
                      + (f" + {format_bytes(host)} host" if host is not None else ""))
    rows = []
    for setup in OFFLOAD_SETUPS:
        p = offload_step_peak(setup, layers, V, B, S, dtype, path=args.path, train_weights=train,
                              host_limit=host)
        row = [setup, format_bytes(p.peak), format_bytes(p.pool), format_bytes(p.host),
               f"{p.offloaded}/{len(layers)}", format_bytes(p.kept)]
        if memory is not None:
            longest = longest_sequence_offload(setup, layers, V, B, dtype, memory, host,
                                               args.weights, path=args.path)
            row.append(f"{longest:,}")
        rows.append(row)
    print(_table(rows, header))
    print("offload: each fused layer's saved tensors go to host memory in forward and come back "
          "one layer ahead in backward; the device keeps a pool of two layers' worth"
          + ("; past --host-memory the remaining layers keep theirs on the device"
             if host is not None else " (no --host-memory: no cap)"))


if __name__ == "__main__":
    sys.exit(main())
