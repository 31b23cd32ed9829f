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

Will a run fit (``--device-memory``): per setup, the step's peak (:func:`step_peak`) plus the
model state (:func:`model_state_bytes`, per GPU under ``--shard``) plus the memory kept free
(:func:`headroom_bytes`: the CUDA context and the allocator's fragmentation) against the
device memory; the longest S that fits; and a step time ESTIMATED from FLOPs
(:func:`step_time_estimate`). The HF-checkpointing rows were recalibrated against the H100
measurement of LLaMA-3.1-8B LoRA (bench/results/gpu_h100_2026-11-24/capacity_peak.csv):
HF's bf16 norms keep fp32 copies of their inputs, PEFT's fp32 adapters keep fp32 copies of
each projection's input, and HF's loss keeps fp32 gradients of the logits; the test holds the
model within 10% of every measured peak there.

Sums are Python ints: at absurd sizes (S 1e14) they pass 2**63, where int64 wraps silently.
The CLI bounds its inputs (S up to 2**32, B up to 2**20, bytes up to 1 EiB) with a usage error.

CLI: ``python -m ckpt_ext.plan CONFIG --batch B --seq S [--dtype bf16] [--budget 20GiB]
[--device-memory 80GiB --weights lora [--shard N] [--offload [--host-memory 200GiB]]]``
(``--help`` says what each means).
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

    experts = _config_value(config, "num_experts", 0) or \
        _config_value(config, "num_local_experts", 0)
    if experts:  # intermediate_size is not the experts' width: refuse rather than misplan
        raise NotImplementedError(
            f"config: a mixture-of-experts model ({experts} experts, model_type "
            f"{_config_value(config, 'model_type')!r}); the plan does not model routed experts "
            "yet (patch_llama fuses qwen3_moe, qwen2_moe, mixtral and olmoe with a given "
            "preset; bench/moe.py measures their step peak)")
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
      fp32 gradients of nll_loss and of the log-softmax's input (8*T*V, fp32 whatever the
      logits' dtype), or the logits' gradient in the model dtype with the weight gradient
      when that is more;
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

    In a low-precision model HF's re-run layer also keeps its two RMSNorms' fp32 input
    copies ((8 - e)*H a token beyond the fp32 count) and, under LoRA (``train_weights``
    False, PEFT's fp32 adapters), each adapted projection's input cast to fp32
    (4*(5H + Q + I) in place of e*(2H + I)); HF's loss keeps fp32 (T, V) gradients (8*T*V at
    its log-softmax's backward) whatever the logits' dtype. These terms were recalibrated
    against the H100 measurement of LLaMA-3.1-8B LoRA (``tests/test_plan.py`` reads it).

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
    else:            # the loss's gradients are fp32 whatever the logits' dtype: nll_loss's
        # (T, V) and log_softmax's input gradient beside it, 8*T*V; then the logits' gradient
        # in the model dtype with the weight gradient
        head_work = e * T * H + max(8 * T * V, T * V * e + dw)
    head_peak = saved + head_work

    # the top layer's backward
    grads = e * H * (2 * Q + 2 * K + 3 * I) if train_weights else 0
    if preset == "torch":
        layer_work = e * T * (6 * H + 2 * Q + 2 * K + 6 * I) + lse
        if e < 4:
            # HF's RMSNorm upcasts its input and keeps the fp32 copy for backward: the input
            # norm's 4H beside the checkpointed input, the post-attention norm's 4H in place
            # of h (e*H); the fp32 count above cannot see either
            layer_work += T * (8 - e) * H
            if not train_weights:
                # PEFT's adapters in fp32 (its default autocast_adapter_dtype=True) on a
                # low-precision base: each adapted projection casts its input to fp32 and
                # lora_A keeps that copy (q, k, v, gate, up: 4H each; o_proj 4Q; down 4I), in
                # place of the normed rows (2 e*H) and the SwiGLU product (e*I) that the
                # weights' gradients would keep
                layer_work += T * (4 * (5 * H + Q + I) - e * (2 * H + I))
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
                      lora_rank: int = 16, tied: bool = False, shard: int = 1) -> int:
    """Bytes the model and its optimizer hold outside the step, per GPU: ``weights="full"``, a
    full fine-tune with AdamW on fp32 weights (weights, gradients and two moments: 16 bytes a
    parameter, as under ``Trainer(bf16=True)``); ``"lora"``, a frozen base in ``dtype`` with
    rank-``lora_rank`` adapters on every projection (fp32, AdamW: 16 bytes an adapter
    parameter). ``shard``: the sharding degree of FSDP / ZeRO-3 (each GPU holds 1/shard of
    it, and the gathered parameters of two units in ``dtype``, the one running and the one
    prefetched, the larger of a decoder layer and the embedding or head)."""
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ValueError(f"model_state_bytes: shard must be a positive int, got {shard!r}")
    e = _dtype(dtype).itemsize
    H0 = layers[0].hidden_size
    base = V * H0 * (1 if tied else 2) + H0
    adapters = 0
    unit = V * H0
    for x in layers:
        H, Q, K, I = (x.hidden_size, x.num_heads * x.head_dim, x.num_kv_heads * x.head_dim,
                      x.intermediate_size)
        base += H * (2 * Q + 2 * K + 3 * I) + 2 * H
        unit = max(unit, H * (2 * Q + 2 * K + 3 * I) + 2 * H)
        adapters += lora_rank * ((H + Q) + 2 * (H + K) + (Q + H) + 2 * (H + I) + (I + H))
    if weights == "full":
        state = 16 * base
    elif weights == "lora":
        state = e * base + 16 * adapters
    else:
        raise ValueError(f"model_state_bytes: weights must be 'full' or 'lora', got {weights!r}")
    if shard == 1:
        return state
    return -(-state // shard) + 2 * e * unit


# ---- headroom: what the device holds outside the allocator's count --------------------------
# The CUDA context (the driver's, cuBLAS/cuDNN handles and workspaces, loaded kernels: about
# 0.5-1 GiB under torch on an H100) and the caching allocator's fragmentation (blocks reserved
# but not allocated). The H100 capacity search (bench/results/gpu_h100_2026-11-24/) bracketed
# what these took on an 80 GB card between 2.0 GiB (36,864 tokens of HF checkpointing failed)
# and 9.0 GiB (32,768 ran); 1 GiB + 5% of 79.6 GiB is 5.0 GiB.
CUDA_CONTEXT_BYTES = 1 << 30
FRAGMENTATION = 0.05


def headroom_bytes(device_memory: int, cuda_context: int = CUDA_CONTEXT_BYTES,
                   fragmentation: float = FRAGMENTATION) -> int:
    """The device memory a plan keeps free: ``cuda_context`` bytes plus ``fragmentation``
    times the device memory."""
    return cuda_context + int(fragmentation * device_memory)


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
                     limit: int = 1 << 26, headroom: int = 0, shard: int = 1) -> int:
    """The longest S (at most ``limit``) whose step fits ``device_memory`` less ``headroom``
    (:func:`headroom_bytes`) with the model state of ``weights`` (:func:`model_state_bytes`,
    sharded ``shard`` ways), by :func:`step_peak`; 0 if none does."""
    room = device_memory - headroom - model_state_bytes(layers, V, dtype, weights, shard=shard)
    fits = lambda s: step_peak(setup, layers, V, B, s, dtype, path=path,  # noqa: E731
                               train_weights=weights == "full").peak <= room
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
                             path: str = "cuda", limit: int = 1 << 26, headroom: int = 0,
                             shard: int = 1) -> int:
    """The longest S (at most ``limit``) whose offloaded step (:func:`offload_step_peak` with
    ``host_memory`` as the host cap, None for none) fits ``device_memory`` less ``headroom``
    with the model state; 0 if none."""
    room = device_memory - headroom - model_state_bytes(layers, V, dtype, weights, shard=shard)

    def fits(s):
        p = offload_step_peak(setup, layers, V, B, s, dtype, path=path,
                              train_weights=weights == "full", host_limit=host_memory)
        return p.peak <= room

    return _longest_fitting(fits, limit)


# ---- FLOPs ---------------------------------------------------------------------------------
def _flops_parts(preset: str, d: LayerDims, S: int):
    """Recompute FLOPs of one layer divided by B*S, as (attention, matmul): the attention's
    score and P V products, and the projections (module docstring). Integers."""
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
        return scores, out_norms
    if preset == "balanced":
        return scores, qkv + gate_up + out_norms
    if preset == "min_memory":
        return 2 * scores + pv, qkv + gate_up + o_proj + out_norms
    if preset == "torch":
        return 2 * scores + pv, qkv + o_proj + gate_up + down
    raise ValueError(f"recompute_flops: preset must be one of 'fast', 'balanced', "
                     f"'min_memory', 'torch'; got {preset!r}")


def _flops_per_token(preset: str, d: LayerDims, S: int) -> int:
    """Recompute FLOPs of one layer divided by B*S (an integer: see the module docstring)."""
    return sum(_flops_parts(preset, d, S))


def recompute_flops(preset: str, dims: LayerDims, B: int, S: int) -> int:
    """Forward FLOPs that ``preset`` recomputes in one layer's backward (module docstring)."""
    return B * S * _flops_per_token(preset, dims, S)


# ---- the step's time (an estimate) -------------------------------------------------------------
# Rates on an H100 80GB (bench/results/gpu_h100_2026-11-24/attention_nvidia_h100_80gb_hbm3.csv,
# D 128, causal, bf16): the Triton attention forward ran 329-372 TFLOP/s and its backward
# 151-180 TFLOP/s (FLOPs counted as there: backward 2.5x forward); the LM head's bf16 GEMMs
# about 410 TFLOP/s forward (lm_head_nvidia_h100_80gb_hbm3.csv, V 128256, H 4096).
ATTENTION_FWD_TFLOPS = 350.0
ATTENTION_BWD_TFLOPS = 170.0
MATMUL_TFLOPS = 400.0


def step_flops(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, *,
               train_weights: bool = True) -> dict:
    """The FLOPs of one training step of ``setup`` (:data:`PEAK_SETUPS`), Python ints, in
    three parts: ``attention_forward`` (the causal scores and P V of every layer's forward,
    and again where the setup re-runs the attention forward in backward: ``min_memory`` and
    HF checkpointing), ``attention_backward`` (2.5 times the forward: dV, dP, dQ, dK and the
    score tiles rebuilt, as the attention benchmark counts them) and ``matmul`` (every
    projection and the head, 2 FLOPs a multiply-add: forward; backward once for the input
    gradients and, with ``train_weights``, once more for the weight gradients (LoRA: a frozen
    base, the rank-r adapters left out); the projections each preset recomputes
    (:func:`recompute_flops`) and, with the fused head, its logits once more)."""
    if setup not in PEAK_SETUPS:
        raise ValueError(f"step_flops: setup must be one of {', '.join(PEAK_SETUPS)}; got "
                         f"{setup!r}")
    _check_shape_args(B, S)
    T = B * S
    preset = "torch" if setup.startswith("hf_gc") else setup
    reruns = 1 if preset in ("min_memory", "torch") else 0
    fwd = bwd = matmul = 0
    passes = 3 if train_weights else 2
    for d in layers:
        attn = 2 * d.num_heads * d.head_dim * (S + 1)       # scores and P V, per token
        fwd += T * attn * (1 + reruns)
        bwd += T * attn * 5 // 2
        matmul += T * (passes * _flops_parts("torch", d, S)[1] + _flops_parts(preset, d, S)[1])
    head = 2 * T * layers[0].hidden_size * V
    matmul += head * passes + (head if setup != "hf_gc" else 0)
    return {"attention_forward": fwd, "attention_backward": bwd, "matmul": matmul}


def step_time_estimate(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, *,
                       train_weights: bool = True,
                       attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                       attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                       matmul_tflops: float = MATMUL_TFLOPS) -> float:
    """Seconds for one training step, ESTIMATED from :func:`step_flops` at fixed rates (H100
    figures by default); memory-bound work (norms, RoPE, SwiGLU, the optimizer), copies and
    launch gaps are left out."""
    f = step_flops(setup, layers, V, B, S, train_weights=train_weights)
    return (f["attention_forward"] / (attention_fwd_tflops * 1e12)
            + f["attention_backward"] / (attention_bwd_tflops * 1e12)
            + f["matmul"] / (matmul_tflops * 1e12))


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
    # Python ints throughout: at long sequences the FLOP sums pass 2**63 (S 1e14 at LLaMA-3-8B
    # shapes), where int64 arrays wrap around silently.
    ptb = [[per_token_bytes(p, dtype=dt, **d.kwargs()) for p in _CHOICES] for d in layers]
    ptf = [[_flops_per_token(p, d, S) for p in _CHOICES] for d in layers]
    smallest = B * S * sum(row[2] for row in ptb)
    if budget < smallest:
        raise ValueError(
            f"activation_budget of {budget} bytes ({format_bytes(budget)}) is below the "
            f"smallest that fits: {smallest} bytes ({format_bytes(smallest)}), every one of the "
            f"{len(layers)} decoder layers 'min_memory', at B={B}, S={S}, {str(dt)[6:]}. Raise the "
            f"budget or shorten the batch")
    cap = budget // (B * S)                       # per-token budget: ptb sums are integers
    tail_min = [0] * len(layers)                  # the later layers' least bytes
    for i in range(len(layers) - 2, -1, -1):
        tail_min[i] = tail_min[i + 1] + ptb[i + 1][2]
    front = [(0, 0)]                              # (bytes, FLOPs) per token of each state
    parents, options = [], []
    for i in range(len(layers)):
        cand = [(b + ptb[i][o], f + ptf[i][o], 3 * s + o)          # state-major index
                for s, (b, f) in enumerate(front) for o in range(3)
                if b + ptb[i][o] + tail_min[i] <= cap]
        cand.sort()                                # bytes, then FLOPs, then index
        # Pareto front: keep a state only if it recomputes less than every cheaper one.
        kept, least = [], None
        for b, f, idx in cand:
            if least is None or f < least:
                kept.append((b, f, idx))
                least = f
        front = [(b, f) for b, f, _ in kept]
        parents.append([idx // 3 for _, _, idx in kept])
        options.append([idx % 3 for _, _, idx in kept])
    # fewest FLOPs (the first such: the front's bytes fall as FLOPs rise)
    state = min(range(len(front)), key=lambda k: (front[k][1], k))
    chosen = []
    for i in range(len(layers) - 1, -1, -1):
        chosen.append(_CHOICES[options[i][state]])
        state = parents[i][state]
    return chosen[::-1]


# ---- CLI -----------------------------------------------------------------------------------
# Bounds of the CLI's inputs: far past any real run (a billion-token sequence, an exabyte), and
# what keeps every figure printable.
_MAX = {"seq": 1 << 32, "batch": 1 << 20, "dim": 1 << 24, "layers": 1 << 16,
        "vocab": 1 << 32, "shard": 1 << 20, "gpus": 1 << 10}
_MAX_BYTES = 1 << 60


def _hf_hub_cache() -> str:
    """The local Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read at each call)."""
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                  "huggingface"), "hub")


def _hf_cache_config(model_id: str) -> Optional[str]:
    """The cached config.json of ``model_id`` (its ``main`` revision) in the local Hugging Face
    cache, or None; nothing is downloaded."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        try_to_load_from_cache = None
    if try_to_load_from_cache is not None:
        try:
            found = try_to_load_from_cache(model_id, "config.json", cache_dir=_hf_hub_cache())
        except Exception:    # a malformed id: not in the cache
            return None
        return found if isinstance(found, str) else None
    repo = os.path.join(_hf_hub_cache(), "models--" + model_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            path = os.path.join(repo, "snapshots", f.read().strip(), "config.json")
    except OSError:
        return None
    return path if os.path.isfile(path) else None


def _read_config(path: str) -> dict:
    """The config at ``path`` (a config.json, a model directory, or the id of a model in the
    local Hugging Face cache); ValueError naming the file when it cannot be found or read or
    is not a JSON object."""
    if not os.path.exists(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        cached = _hf_cache_config(path)
        if cached is None:
            raise ValueError(
                f"{path!r} is neither a file nor a model in the local Hugging Face cache "
                f"(HF_HUB_CACHE); fetch its config with `hf download {path} config.json`, or "
                f"give a config.json path")
        path = cached
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


def _bounded_int(limit: int):
    """argparse type: an int in [1, limit] (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
        if value > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit:,}, got {text}")
        return value
    parse.__name__ = "int"
    return parse


_positive_int = _bounded_int(_MAX["dim"])


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be a positive number below 1e9, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def _table(rows, header):
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in
                               enumerate(zip(r, widths))).rstrip() for r in cells)


def _tflop(n: int) -> str:
    return f"{n / 1e12:.3f}"


def host_ram_bytes() -> Optional[int]:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


_WEIGHTS_HELP = (
    "what the device holds besides the step (with --device-memory): 'full' (default), a full "
    "fine-tune: fp32 master weights, fp32 gradients and AdamW's two fp32 moments, 16 bytes a "
    "parameter (Trainer(bf16=True) / autocast), about 120 GiB for an 8B model, so it needs "
    "--shard on an 80 GB GPU; 'lora', a frozen base in --dtype (2 bytes a parameter in bf16) "
    "plus rank-16 adapters on every projection trained in fp32 with AdamW (PEFT's default)")

_EPILOG = """\
Will my run fit? Give the model, --batch, --seq and --device-memory (and --weights lora for
LoRA). For each setup it prints "fits" or "does not fit" at the S asked, the longest S that
fits, and an estimated step time. The device memory a plan keeps free: --cuda-context (1 GiB:
the CUDA context, cuBLAS workspaces and loaded kernels) plus --fragmentation (5%% of the
device: the caching allocator's reserved-but-unused blocks); the H100 capacity search in
bench/results/gpu_h100_2026-11-24/ bracketed the real figure between 2.0 and 9.0 GiB on an
80 GB card. An H100 "80GB" has 81559MiB (79.6 GiB). Step times are ESTIMATES: FLOPs (matmuls
and attention, forward, backward, recompute) at H100 rates, --attention-fwd-tflops 350 and
--attention-bwd-tflops 170 (the Triton attention kernels ran 329-372 and 151-180 TFLOP/s) and
--matmul-tflops 400 (the LM head's GEMMs ran about 410); memory-bound work and the optimizer
step are left out. On the H100 they came to 0.83-1.03x the measured LLaMA-3.1-8B LoRA steps.

examples:
  python -m ckpt_ext.plan meta-llama/Llama-3.1-8B --batch 1 --seq 131072 \\
      --device-memory 80GiB --weights lora --offload --host-memory 200GiB
  python -m ckpt_ext.plan config.json --batch 1 --seq 8192 --device-memory 80GiB --shard 8
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ckpt_ext.plan", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Saved-activation bytes of each ckpt_ext preset, recompute FLOPs, the LM "
                    "head with and without the fused loss, the step's peak memory, whether a "
                    "step fits a device, and the 'auto' choice for a budget.")
    ap.add_argument("config", nargs="?",
                    help="an HF config.json, a model directory, or a model id in the local "
                         "Hugging Face cache (e.g. meta-llama/Llama-3.1-8B; nothing is "
                         "downloaded); or give the dimensions below")
    dim = _positive_int
    ap.add_argument("--hidden-size", type=dim)
    ap.add_argument("--heads", type=dim, help="num_attention_heads")
    ap.add_argument("--kv-heads", type=dim, help="num_key_value_heads (default: --heads)")
    ap.add_argument("--head-dim", type=dim, help="default hidden_size // heads")
    ap.add_argument("--intermediate-size", type=dim)
    ap.add_argument("--layers", type=_bounded_int(_MAX["layers"]), help="num_hidden_layers")
    ap.add_argument("--vocab-size", type=_bounded_int(_MAX["vocab"]))
    ap.add_argument("--batch", type=_bounded_int(_MAX["batch"]), required=True,
                    help="sequences per step on one GPU")
    ap.add_argument("--seq", type=_bounded_int(_MAX["seq"]), required=True,
                    help="tokens per sequence, S")
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--budget", help="bytes for the decoder layers' saved activations, e.g. "
                                     "20GiB or 512MB: prints the 'auto' choice")
    ap.add_argument("--device-memory", help="one GPU's memory, e.g. 80GiB or 81559MiB: prints "
                                            "per setup whether the step fits at --seq, and the "
                                            "longest S that fits")
    ap.add_argument("--weights", choices=("full", "lora"), default="full", help=_WEIGHTS_HELP)
    ap.add_argument("--shard", type=_bounded_int(_MAX["shard"]), default=1,
                    help="the sharding degree of FSDP / ZeRO-3 (default 1: none): the model "
                         "state per GPU is 1/N of it plus two gathered units (a layer or the "
                         "head) in --dtype")
    ap.add_argument("--path", choices=_PATHS, default="cuda",
                    help="whose transients the peak model counts: the Triton kernels (cuda) or "
                         "the ATen kernels (cpu)")
    ap.add_argument("--offload", action="store_true",
                    help="also plan each fused preset with offload='cpu' (saved layer tensors "
                         "in host memory): device peak, host bytes, fits or not")
    ap.add_argument("--host-memory", help="with --offload: host memory for one GPU's saved "
                                          "tensors (offload_limit), e.g. 200GiB; default this "
                                          "machine's RAM / --gpus-per-node")
    ap.add_argument("--gpus-per-node", type=_bounded_int(_MAX["gpus"]), default=1,
                    help="GPUs sharing one host's RAM (default 1): divides the default "
                         "--host-memory")
    ap.add_argument("--cuda-context", default="1GiB",
                    help="device memory kept for the CUDA context (default 1GiB)")
    ap.add_argument("--fragmentation", type=_fraction, default=FRAGMENTATION,
                    help="fraction of the device memory kept for the allocator's "
                         "fragmentation (default 0.05)")
    ap.add_argument("--attention-fwd-tflops", type=_positive_float,
                    default=ATTENTION_FWD_TFLOPS, help="attention forward rate for the step "
                    "time estimate (default 350: the Triton kernel on an H100)")
    ap.add_argument("--attention-bwd-tflops", type=_positive_float,
                    default=ATTENTION_BWD_TFLOPS, help="attention backward rate (default 170: "
                    "the Triton kernel on an H100)")
    ap.add_argument("--matmul-tflops", type=_positive_float, default=MATMUL_TFLOPS,
                    help="matmul rate for the step time estimate (default 400, an H100)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.host_memory is not None and not args.offload:
        ap.error("argument --host-memory: applies with --offload only")
    for name in ("budget", "device_memory", "host_memory", "cuda_context"):
        if getattr(args, name) is not None:
            flag = f"argument --{name.replace('_', '-')}"
            try:
                value = parse_bytes(getattr(args, name), flag)
            except (TypeError, ValueError) as e:
                ap.error(str(e))
            if value > _MAX_BYTES:
                ap.error(f"{flag}: must be at most 1 EiB ({_MAX_BYTES:,} bytes), got "
                         f"{getattr(args, name)!r}")
            setattr(args, name, value)

    if args.offload:
        try:
            _host_memory(args)
        except ValueError as e:
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
    except NotImplementedError as e:
        ap.error(str(e))
    except ValueError as e:
        ap.error(f"{e} (give a config.json or --hidden-size/--heads/--intermediate-size/"
                 f"--layers)")
    if "vocab_size" not in config:
        ap.error("missing vocab_size (in the config or --vocab-size)")
    V = config["vocab_size"]
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        ap.error(f"vocab_size must be a positive int (in the config or --vocab-size), got {V!r}")
    for name, value, limit in (("hidden_size", layers[0].hidden_size, _MAX["dim"]),
                               ("intermediate_size", layers[0].intermediate_size, _MAX["dim"]),
                               ("num_attention_heads", layers[0].num_heads, _MAX["dim"]),
                               ("head_dim", layers[0].head_dim, _MAX["dim"]),
                               ("num_hidden_layers", len(layers), _MAX["layers"]),
                               ("vocab_size", V, _MAX["vocab"])):
        if value > limit:
            ap.error(f"config: {name} must be at most {limit:,}, got {value:,}")
    B, S, dtype = args.batch, args.seq, _DTYPES[args.dtype]
    d = layers[0]
    L, T = len(layers), B * S
    head_hf = head_saved_bytes(B, S, d.hidden_size, V, dtype, fused=False)
    head_fused = head_saved_bytes(B, S, d.hidden_size, V, dtype, fused=True)
    print(f"{L} layers, H {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads}, head_dim "
          f"{d.head_dim}, I {d.intermediate_size}, V {V}; B {B}, S {S:,} ({T:,} tokens), "
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
          f"it also returns the {T:,} x {V:,} logits, {format_bytes(T * V * e)}); fused "
          f"{format_bytes(head_fused)} (hidden + labels + fp32 lse = "
          f"{e * d.hidden_size + 12:,} B/token)")
    print("recompute: forward FLOPs redone in backward (matmuls only; see ckpt_ext.plan); "
          "'torch' is listed for comparison and never chosen by 'auto'")
    print()
    _print_steps(args, layers, V, B, S, dtype)
    if args.offload:
        print()
        _print_offload(args, layers, V, B, S, dtype)
    if args.device_memory is not None:
        print()
        _print_verdict(args, layers, V, B, S, dtype)
    if args.budget is not None:
        print()
        try:
            chosen = choose_presets(layers, B, S, dtype, args.budget)
        except ValueError as err:
            print(f"auto: {err}", file=sys.stderr)
            return 2
        used = sum(layer_bytes(p, x, B, S, dtype) for p, x in zip(chosen, layers))
        flops = sum(recompute_flops(p, x, B, S) for p, x in zip(chosen, layers))
        counts = ", ".join(f"{chosen.count(p)} x {p}" for p in FUSED_PRESETS if p in chosen)
        print(f"auto for a budget of {format_bytes(args.budget)}: {counts}; "
              f"layers keep {format_bytes(used)} ({format_bytes(used + head_fused)} with the "
              f"fused head), recompute {_tflop(flops)} TFLOP")
        print("per layer: " + " ".join(p for p in chosen))
    return 0


_SETUP_NAMES = {"hf_gc": "HF checkpointing, HF head", "hf_gc+fused": "HF checkpointing, fused loss",
                "fast": "fast", "balanced": "balanced", "min_memory": "min_memory"}


def _weights_words(args) -> str:
    words = "full fine-tune" if args.weights == "full" else "LoRA"
    return words + (f", sharded {args.shard} ways" if args.shard > 1 else "")


def _print_steps(args, layers, V, B, S, dtype) -> None:
    """The step table: saved bytes and peak per setup."""
    train = args.weights == "full"
    header = [f"step ({_weights_words(args)}, {args.path} path)", "saved", "peak",
              "peak KiB/token", "peak is in"]
    rows = []
    for setup in PEAK_SETUPS:
        p = step_peak(setup, layers, V, B, S, dtype, path=args.path, train_weights=train)
        rows.append([_SETUP_NAMES[setup], format_bytes(p.saved), format_bytes(p.peak),
                     f"{p.peak / (B * S) / 1024:,.1f}", p.phase])
    print(_table(rows, header))
    print("peak: the most a training step allocates at once above its start, gradients of an "
          "earlier step present (ckpt_ext.plan.step_peak); the fused presets use the fused "
          "head and final norm")


def _host_memory(args):
    """(host bytes for one GPU's offloaded tensors, how it was chosen)."""
    if args.host_memory is not None:
        return args.host_memory, "--host-memory"
    ram = host_ram_bytes()
    if ram is None:
        raise ValueError("argument --host-memory: this OS does not report its RAM; give "
                         "--host-memory (offload never assumes unlimited host memory)")
    return ram // args.gpus_per_node, (f"this machine's RAM {format_bytes(ram)} / "
                                       f"--gpus-per-node {args.gpus_per_node}; give "
                                       f"--host-memory for the training host's")


def _print_offload(args, layers, V, B, S, dtype) -> None:
    """The offload table: device peak, host bytes and copy volume per fused preset."""
    train = args.weights == "full"
    host, how = _host_memory(args)
    print(f"host memory for offloaded tensors: "
          f"{format_bytes(host) if host is not None else 'no cap'} ({how})")
    header = [f"offload='cpu' ({_weights_words(args)}, {args.path} path)", "device peak",
              "of it the prefetch pool", "host bytes", "layers in host", "kept on device"]
    rows = []
    for setup in OFFLOAD_SETUPS:
        p = offload_step_peak(setup, layers, V, B, S, dtype, path=args.path, train_weights=train,
                              host_limit=host)
        rows.append([setup, format_bytes(p.peak), format_bytes(p.pool), format_bytes(p.host),
                     f"{p.offloaded}/{len(layers)}", format_bytes(p.kept)])
    print(_table(rows, header))
    print("offload: each fused layer's saved tensors go to host memory in forward and come back "
          "one layer ahead in backward; the device keeps a pool of two layers' worth; past the "
          "host memory the remaining layers keep theirs on the device")


def _longest_text(n: int, limit: int = 1 << 26) -> str:
    if n == 0:
        return "none"
    return f">= {n:,}" if n >= limit else f"{n:,}"


def _print_verdict(args, layers, V, B, S, dtype) -> None:
    """Fits / does not fit per setup at the S asked, the longest S, the step time estimate."""
    train = args.weights == "full"
    memory = args.device_memory
    headroom = headroom_bytes(memory, args.cuda_context, args.fragmentation)
    usable = memory - headroom
    state = model_state_bytes(layers, V, dtype, args.weights, shard=args.shard)
    room = usable - state
    print(f"will it fit: {_weights_words(args)}, B {B}, S {S:,}, {args.path} path, on "
          f"{format_bytes(memory)} of device memory")
    print(f"  kept free: CUDA context {format_bytes(args.cuda_context)} + allocator "
          f"fragmentation {args.fragmentation:.0%} of the device "
          f"({format_bytes(int(args.fragmentation * memory))}) = {format_bytes(headroom)}; "
          f"usable {format_bytes(usable)}")
    whole = model_state_bytes(layers, V, dtype, args.weights)
    if args.shard > 1:
        print(f"  model state per GPU ({args.weights}): {format_bytes(state)} = 1/{args.shard} "
              f"of {format_bytes(whole)} + two gathered units in {args.dtype} "
              f"({format_bytes(state - -(-whole // args.shard))})")
    else:
        print(f"  model state ({args.weights}): {format_bytes(state)}")
    print(f"  left for the step: {format_bytes(room) if room > 0 else 'nothing'}")
    host = _host_memory(args)[0] if args.offload else None
    rates = dict(attention_fwd_tflops=args.attention_fwd_tflops,
                 attention_bwd_tflops=args.attention_bwd_tflops,
                 matmul_tflops=args.matmul_tflops)
    cases = [(setup, False) for setup in PEAK_SETUPS]
    if args.offload:
        cases += [(setup, True) for setup in OFFLOAD_SETUPS]
    rows = []
    for setup, offload in cases:
        if offload:
            peak = offload_step_peak(setup, layers, V, B, S, dtype, path=args.path,
                                     train_weights=train, host_limit=host).peak
        else:
            peak = step_peak(setup, layers, V, B, S, dtype, path=args.path,
                             train_weights=train).peak
        total = state + peak + headroom
        if room <= 0:
            verdict, longest = "does not fit (model state)", "none"
        else:
            verdict = "fits" if peak <= room else "does not fit"
            kw = dict(path=args.path, headroom=headroom, shard=args.shard)
            longest = _longest_text(
                longest_sequence_offload(setup, layers, V, B, dtype, memory, host,
                                         args.weights, **kw) if offload else
                longest_sequence(setup, layers, V, B, dtype, memory, args.weights, **kw))
        secs = step_time_estimate(setup, layers, V, B, S, train_weights=train, **rates)
        rows.append([_SETUP_NAMES[setup] + (" + offload" if offload else ""),
                     format_bytes(peak), format_bytes(total), verdict, longest, f"{secs:,.2f}"])
    print(_table(rows, ["setup", "step peak", "state + peak + kept free", f"at S {S:,}",
                        "longest S", "step s (estimate)"]))
    if room <= 0:
        print(f"does not fit: the model state, {format_bytes(state)}, > the usable device "
              f"memory, {format_bytes(usable)} ({format_bytes(memory)} less "
              f"{format_bytes(headroom)} kept free)"
              + ("; a full fine-tune keeps 16 B a parameter" if args.weights == "full" else ""))
        need = _smallest_shard(layers, V, B, S, dtype, args, headroom)
        if need:
            print(f"  sharded (--shard N, FSDP / ZeRO-3): min_memory fits S {S:,} from --shard "
                  f"{need}, where the state is "
                  f"{format_bytes(model_state_bytes(layers, V, dtype, args.weights, shard=need))}"
                  f" per GPU; rerun with --shard {need} for the per-GPU figures")
        else:
            print("  no sharding degree up to 4096 makes room: the gathered units alone are "
                  "too large")
    print(f"step s: an ESTIMATE from FLOPs (forward, backward, recompute; ckpt_ext.plan."
          f"step_flops) at {args.attention_fwd_tflops:g} / {args.attention_bwd_tflops:g} "
          f"TFLOP/s for the attention forward / backward and {args.matmul_tflops:g} for "
          f"matmuls (H100 figures: 0.83-1.03x the measured LLaMA-3.1-8B LoRA steps at S 8K-16K); "
          f"norms, SwiGLU, the optimizer" + (", the offload copies" if args.offload else "")
          + " and launch gaps are left out")


def _smallest_shard(layers, V, B, S, dtype, args, headroom) -> int:
    """The smallest sharding degree (up to 4096) at which min_memory fits S, or 0."""
    peak = step_peak("min_memory", layers, V, B, S, dtype, path=args.path,
                     train_weights=args.weights == "full").peak
    for n in range(1, 4097):
        if model_state_bytes(layers, V, dtype, args.weights, shard=n) + peak + headroom <= \
                args.device_memory:
            return n
    return 0


if __name__ == "__main__":
    sys.exit(main())
