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

LoRA on a frozen base (``lora_rank`` r, ``expert_lora_rank`` r_e of :func:`recompute_flops`,
:func:`step_flops` and the time estimates; the CLI's ``--weights lora`` is r
:data:`LORA_RANK`): an adapter on a projection in -> out computes x A^T, then (x A^T) B^T,
2 r (in + out) FLOPs a token, on q, k, v, o and the dense MLP's (or shared expert's) gate, up
and down, and with r_e on the routed experts' gate_up_proj (H -> 2 I_e) and down_proj
(I_e -> H) for each of a token's top_k copies. A preset that recomputes a projection
recomputes its adapter too (the same rows as above); a step adds each adapter's forward and
twice that in backward (dx through B then A; dA and dB).

:func:`choose_presets` picks, per layer, one of the fused presets so that the layers' saved
bytes fit a budget with the least total recompute. It solves this small multiple-choice
knapsack exactly: both bytes and FLOPs are B*S times a per-token integer, so it keeps the
Pareto front of (bytes per token, FLOPs per token) over the layers seen so far. Exactness makes
it monotone (a larger budget never gives more recompute), and it depends on shapes only.

Chunk rows (:func:`choose_chunk_rows`): the fused layer's token rows a chunk, for time
where memory allows: one chunk when the step fits, else the fastest candidate count of chunks
that fits (:func:`layer_seconds` at the throughputs' rates per query-chunk rows), else the
cap's; ``patch_llama`` hands them to the op (its ``chunk_rows`` option) unless
``chunk_bytes`` is pinned, and :func:`choose_auto` weighs them.

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

The planner reads layer shapes (``ckpt_ext.layer_record.LayerDims``) and nothing of the HF
integration; the engine's own numbers it reads from the engine: the chunk rows
(``ckpt_ext._C.layer_chunk_rows``, ``ffn_row_width``, and the CPU SwiGLU's and linear
cross-entropy's ``swiglu_buffers``, ``swiglu_chunk_rows``, ``lce_chunk_rows``), the residual layout (``presets.per_token_bytes``), the
offload rule (``ckpt_ext.offload.admits``) and the chunk cap (``ckpt_ext.config``).

Segments of several layers (``segment_layers`` k of :func:`step_peak`,
:func:`offload_step_peak`, :func:`sp_step_peak`, :func:`step_flops` and the longest-S searches;
the fused presets, as ``patch_llama(segment_layers=k)``): of k consecutive layers only the first
keeps its input (on the device or offloaded; the others keep what their preset saves besides
it, nothing under ``min_memory``); the segment's backward re-runs its first k - 1 layers
forward to rebuild the others' inputs and holds them beside its layers' backwards
(:func:`segment_bytes`). Under ``min_memory`` the host holds 1/k of the inputs, the device
k - 1 rebuilt ones more at a segment's backward, the step one more forward of k - 1 layers a
segment; for ``min_memory``, :func:`choose_segment_layers` picks k by time,
:func:`longest_sequence_segments` the k that reaches furthest, and :func:`cpu_step_peak` is the
CPU allocator's peak the plan predicts.

Streamed inputs (``stream`` of :func:`offload_step_peak` and the offloaded searches,
``min_memory`` only; ``patch_llama(..., offload="cpu", offload_stream=True)``): an offloaded
layer input stays in host memory through the backward, which copies it to the device a token
chunk at a time, so no prefetch pool holds whole inputs; in segments the rebuilt inputs go to
host memory too, and the rebuild is a device phase of its own. The copies run serialized with
compute (:func:`stream_copy_bytes`, timed at the host link's rate).

CLI: ``python -m ckpt_ext.plan CONFIG --batch B --seq S [--dtype bf16] [--budget 20GiB]
[--device-memory 80GiB --weights lora [--shard N] [--offload [--host-memory 200GiB]
[--offload-stream]]]
[--segment-layers K|auto] [--sequence-parallel N] [--throughputs FILE]`` (``--help`` says what
each means; ``ckpt_ext.plan_cli``, which reads HF configs).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from . import _C, config, offload
from ._normed_head import rows_within_cap, walks_vocabulary
from .config import parse_bytes
from .layer_record import LayerDims
from .presets import per_token_bytes

__all__ = ["LayerDims", "parse_bytes", "format_bytes",
           "recompute_flops", "layer_bytes", "head_saved_bytes", "choose_presets", "step_peak",
           "StepPeak", "model_state_bytes", "longest_sequence", "OffloadPeak",
           "QUANTS", "quantized_bytes", "dequantized_bytes",
           "offload_device_bytes", "offload_split", "offload_step_peak",
           "longest_sequence_offload", "OffloadChoice", "choose_presets_offload",
           "choose_offload_layers", "SpPeak", "sp_exchange_bytes", "sp_step_peak",
           "sp_longest_sequence", "sp_step_time", "sp_round_kv_heads", "sp_kv_repeats",
           "AUTO_CHOICES", "AutoChoice", "choose_auto", "layer_seconds", "layer_chunks",
           "plain_layer_bytes", "parameter_state_bytes", "segment_bounds", "segment_bytes",
           "SegmentChoice", "choose_segment_layers", "longest_sequence_segments",
           "cpu_step_peak", "stream_copy_bytes", "ChunkChoice", "choose_chunk_rows",
           "chunk_row_candidates", "engine_chunks"]

Budget = Union[int, str]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
# Cheapest recompute first: the order in which ties between layers' options are broken.
_CHOICES = ("fast", "balanced", "min_memory")


# ---- bytes ---------------------------------------------------------------------------------
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


def plain_layer_bytes(d: LayerDims, B: int, S: int, dtype, train_weights: bool = True) -> int:
    """Bytes HF's decoder layer (dense) keeps for backward without checkpointing, as counted
    from the allocator at the top of HF's re-run layer in the ``torch`` preset's backward
    (:func:`step_peak`): 6 (T, H), 2 (T, Q), 2 (T, K) and 6 (T, I) tensors and the float32
    lse; in a low-precision model its RMSNorms' fp32 input copies ((8 - e) H a token) and,
    under LoRA (``train_weights`` False), PEFT's fp32 adapters' copies of each adapted
    projection's input (4 (5 H + Q + I) in place of e (2 H + I)). The re-run's count includes
    a few of the backward's transients, so this errs high for the plain layer."""
    e = _dtype(dtype).itemsize
    T = B * S
    H, Q, K, I = (d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim,
                  d.intermediate_size)
    total = e * T * (6 * H + 2 * Q + 2 * K + 6 * I) + 4 * d.num_heads * T
    if e < 4:
        # HF's RMSNorm upcasts its input and keeps the fp32 copy for backward: the input
        # norm's 4H beside the layer input, the post-attention norm's 4H in place of h (e*H);
        # the fp32 count above cannot see either
        total += T * (8 - e) * H
        if not train_weights:
            # PEFT's adapters in fp32 (its default autocast_adapter_dtype=True) on a
            # low-precision base: each adapted projection casts its input to fp32 and lora_A
            # keeps that copy (q, k, v, gate, up: 4H each; o_proj 4Q; down 4I), in place of
            # the normed rows (2 e*H) and the SwiGLU product (e*I) the weights' gradients keep
            total += T * (4 * (5 * H + Q + I) - e * (2 * H + I))
    return total


def _saved_bytes(preset: str, d: LayerDims, B: int, S: int, dtype,
                 train_weights: bool = True) -> int:
    """What one layer keeps for backward under any of :data:`AUTO_CHOICES`."""
    if preset == "none":
        return plain_layer_bytes(d, B, S, dtype, train_weights)
    return layer_bytes(preset, d, B, S, dtype)


# ---- segments of several layers ------------------------------------------------------------
def _check_segment_layers(k, setup: str, where: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}: segment_layers must be a positive int, got {k!r}")
    if k > 1 and setup not in _CHOICES:
        raise ValueError(f"{where}: segment_layers={k} applies to the fused presets "
                         f"({', '.join(_CHOICES)}: a segment rebuilds its layers' inputs with "
                         f"the fused layer's forward); got setup {setup!r}")


def segment_bounds(n_layers: int, segment_layers: int) -> list:
    """The segments of ``n_layers`` decoder layers grouped ``segment_layers`` (k) at a time in
    forward order, as ``(first, stop)`` index pairs; the last one holds the remainder (fewer
    than k layers when k does not divide the count)."""
    _check_segment_layers(segment_layers, "min_memory", "segment_bounds")
    return [(a, min(a + segment_layers, n_layers)) for a in range(0, n_layers, segment_layers)]


def _input_bytes(d: LayerDims, B: int, S: int, dtype) -> int:
    """A decoder layer's input, (B, S, H) in ``dtype``: what a segment's layers 2..k do not
    keep."""
    return B * S * d.hidden_size * _dtype(dtype).itemsize


def _call_bytes(layers, presets, B, S, dtype, segment_layers: int = 1) -> list:
    """What each fused layer call keeps for backward, in forward order: its preset's saved
    bytes, less its input for layers 2..k of a segment (``segment_layers`` k: their input is
    rebuilt; ``min_memory``'s layers 2..k keep nothing)."""
    out = [layer_bytes(p, x, B, S, dtype) for p, x in zip(presets, layers)]
    if segment_layers > 1:
        for a, b in segment_bounds(len(out), segment_layers):
            for i in range(a + 1, b):
                out[i] -= _input_bytes(layers[i], B, S, dtype)
    return out


def segment_bytes(layers: Sequence[LayerDims], B: int, S: int, dtype, segment_layers: int,
                  preset: str = "min_memory") -> tuple:
    """A fused ``preset`` (``min_memory`` by default) in segments of k = ``segment_layers``
    layers, per segment in forward order: (the bytes it keeps from its forward to its
    backward: its first layer's saved bytes and what its layers 2..k save besides their
    inputs, nothing for ``min_memory``, whose layers save their input alone; the bytes its
    backward rebuilds: the inputs of its layers 2..k). A segment's backward re-runs its first
    k - 1 layers forward to rebuild those inputs and holds them while its layers' backwards
    walk down, each freed after its layer's backward: at its top layer's backward it holds
    all k - 1 rebuilt ones. k = 1: every layer's saved bytes, nothing rebuilt."""
    _check_segment_layers(segment_layers, preset, "segment_bytes")
    layers = list(layers)
    calls = _call_bytes(layers, [preset] * len(layers), B, S, dtype, segment_layers)
    bounds = segment_bounds(len(layers), segment_layers)
    return (tuple(sum(calls[a:b]) for a, b in bounds),
            tuple(sum(_input_bytes(x, B, S, dtype) for x in layers[a + 1:b])
                  for a, b in bounds))


def _rebuilt_peak(held, rebuilt) -> int:
    """The most the device holds beyond what the segments keep on it (``held``: each segment's
    kept bytes on the device, 0 when offloaded): at segment j's top layer's backward the
    segments above j have freed theirs and j holds its rebuilt inputs, so
    max_j(the kept bytes of the segments up to j + rebuilt_j) less all the kept bytes."""
    below, most = 0, 0
    for b, r in zip(held, rebuilt):
        below += b
        most = max(most, below + r)
    return most - below


def head_saved_bytes(B: int, S: int, H: int, V: int, dtype, fused: bool) -> int:
    """Bytes the LM head + loss keeps for backward (see the module docstring): HF's
    ``B*S*(e*H + 4*V + 8) + 4``, the fused op's ``B*S*(e*H + 12)``."""
    e = _dtype(dtype).itemsize
    return B * S * (e * H + 12) if fused else B * S * (e * H + 4 * V + 8) + 4


# The rank of the plan's LoRA (``--weights lora``: adapters on every projection), PEFT's usual
# r 16: its state (model_state_bytes) and, in the CLI's step times, its GEMMs (step_flops).
LORA_RANK = 16
# QLoRA (``weights="qlora"``): bitsandbytes' quantizations of the base projections and the
# blocksize its 4-bit loads use
QUANTS = ("nf4", "fp4", "int8")
BNB_BLOCKSIZE = 64


def quantized_bytes(rows: int, cols: int, quant: str, double_quant: bool = True) -> int:
    """Bytes of one (rows, cols) projection weight quantized by bitsandbytes: 4-bit (nf4, fp4),
    two codes a byte and one scale per :data:`BNB_BLOCKSIZE` weights, an fp32 scale or, with
    ``double_quant``, an 8-bit one with an fp32 scale per 256 of them; int8 (LLM.int8()'s
    frozen weight), a byte a weight and an fp32 scale per row."""
    if quant not in QUANTS:
        raise ValueError(f"quantized_bytes: quant must be one of {', '.join(QUANTS)}, got "
                         f"{quant!r}")
    n = rows * cols
    if quant == "int8":
        return n + 4 * rows
    blocks = -(-n // BNB_BLOCKSIZE)
    scales = blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks
    return -(-n // 2) + scales


def dequantized_bytes(layers: Sequence[LayerDims], dtype) -> int:
    """QLoRA: the largest layer's projections dequantized in ``dtype``, what a fused layer
    holds through each of its passes (one layer at a time)."""
    e = _dtype(dtype).itemsize
    return e * max(sum(r * c for r, c in _projection_shapes(x)) for x in layers)


def _projection_shapes(x: LayerDims) -> list:
    """A dense layer's projection weights as (rows, cols): q, k, v, o, gate, up, down."""
    H, Q, K, I = (x.hidden_size, x.num_heads * x.head_dim, x.num_kv_heads * x.head_dim,
                  x.intermediate_size)
    return [(Q, H), (K, H), (K, H), (H, Q), (I, H), (I, H), (H, I)]


# ---- the step's peak ---------------------------------------------------------------------------
PEAK_SETUPS = ("hf_gc", "hf_gc+fused", "fast", "balanced", "min_memory")
_PATHS = ("cuda", "cpu")


@dataclass(frozen=True)
class StepPeak:
    """The activation memory of one training step (see :func:`step_peak`)."""

    saved: int      # kept for backward when the forward ends: layers, head, cos/sin
    peak: int       # the most allocated at once above the step's start
    phase: str      # where the peak is


# The plan's GPU (path "cuda"): an H100's 132 multiprocessors, as its rates are H100 figures;
# the layer's chunks there hold at least _C.cuda_min_rows of them (csrc/chunking.h: the
# attention's occupancy and the GEMMs' minimum, _C.gemm_min_rows).
CUDA_SMS = 132


def layer_chunk_rows(d: LayerDims, e: int, chunk_bytes: int, sms: int = 0) -> int:
    """Tokens per chunk of a fused decoder layer at element size ``e`` and byte cap
    ``chunk_bytes`` on a GPU of ``sms`` multiprocessors (0: the CPU): the engine's own rule
    (csrc/chunking.h ``layer_chunk_rows`` with ``cuda_min_rows`` on a GPU, through
    ``ckpt_ext._C``)."""
    return _C.layer_chunk_rows(d.num_heads * d.head_dim, d.intermediate_size, e, chunk_bytes,
                               min_rows=_C.cuda_min_rows(sms, d.num_heads) if sms > 0 else 0,
                               **d.ffn_kwargs())


def mlp_chunk_rows(d: LayerDims, e: int, chunk_bytes: int, path: str = "cuda") -> int:
    """Tokens per chunk of a fused layer's FFN (csrc/chunking.h ``mlp_chunk_rows``): at
    least ``_C.gemm_min_rows`` on ``"cuda"``."""
    return _C.mlp_chunk_rows(d.intermediate_size, e, chunk_bytes,
                             min_rows=_C.gemm_min_rows if path == "cuda" else 0,
                             **d.ffn_kwargs())


def ffn_row_width(d: LayerDims) -> int:
    """Elements one token holds in a chunk of the layer's FFN backward (the engine's
    csrc/chunking.h ``ffn_row_width``, through ``ckpt_ext._C``)."""
    return _C.ffn_row_width(d.intermediate_size, **d.ffn_kwargs())


def router_logits_bytes(layers: Sequence[LayerDims], T: int, dtype) -> int:
    """What the layers of a step with HF's load-balancing loss (``LayerDims.router_logits``)
    keep through it for that loss: with ``router_aux_loss`` "exact" each one's (T, E) logits in
    ``dtype`` and the same-size softmax of HF's loss function; with "fused" its (3, E) float32
    statistics (csrc/moe_math.h ``router_stats``)."""
    e = _dtype(dtype).itemsize
    return sum(2 * e * T * x.experts if x.router_aux_loss == "exact" else 3 * 4 * x.experts
               for x in layers if x.router_logits)


def _widest(layers: Sequence[LayerDims]) -> LayerDims:
    """The layer whose backward the step's peak is modelled on (the widest FFN working set)."""
    return max(layers, key=lambda x: (x.hidden_size * ffn_row_width(x), x.ffn_parameters()))


def _check_chunk_rows(rows, where: str) -> int:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"{where}: chunk_rows must be a positive int (token rows a chunk) or "
                         f"None (the byte cap's rows), got {rows!r}")
    return rows


def _chunk_size(B: int, S: int, rows: int) -> int:
    """The token rows of the fused layer's largest chunk when it is given ``rows`` rows a
    chunk (csrc/layer_math.cpp ``layer_chunks``): as many whole sequences as fit, at most all
    B; else ``rows`` of one sequence."""
    return min(B, rows // S) * S if rows >= S else rows


def engine_chunks(B: int, S: int, rows: int) -> int:
    """The fused layer's token chunks at ``rows`` rows a chunk (csrc/layer_math.cpp
    ``layer_chunks``): ``ceil(B / (rows // S))`` chunks of whole sequences when a sequence
    fits, else ``B * ceil(S / rows)`` pieces."""
    if rows >= S:
        return -(-B // (rows // S))
    return B * -(-S // rows)


def step_peak(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, dtype, *,
              path: str = "cuda", train_weights: bool = True,
              chunk_bytes: Optional[int] = None, quantized_base: bool = False,
              segment_layers: int = 1, _offloaded: Optional[tuple] = None,
              chunk_rows: Optional[int] = None) -> StepPeak:
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
    (``ckpt_ext.config``'s ``chunk_bytes``, 64 MiB unless set); on ``"cuda"`` the layer's
    chunks hold at least the rows that fill :data:`CUDA_SMS` multiprocessors
    (:func:`layer_chunk_rows`), which may pass the cap. ``chunk_rows``: the fused layers'
    token rows a chunk given to the op (its option ``chunk_rows``, :func:`choose_chunk_rows`),
    in place of the cap's rows for the layer and its MLP (the CPU SwiGLU and the LM head still
    chunk within the cap); a chunk then holds whole sequences while they fit, else pieces of
    one.

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
      gradients; the Triton dQ adds an fp32 (T, Q) accumulator. Over several token chunks
      the whole tensors are dy, dx, k and v (unless kept) and their fp32 gradient sums, and
      the rest is one chunk's: its MLP part holds the chunk's n, h, MLP input and dh, q
      before and after RoPE and out (``fast`` reads its kept q and out), ``min_memory``'s
      recomputed output, o_proj output and lse of the chunk, and, training the weights, the
      layer's fp32 gradient sums, which exist from the first chunk's backward on
      (``tests/test_chunk_rule.py`` holds this to the CPU allocator at 1 to 8 chunks).

    In a low-precision model HF's re-run layer also keeps its two RMSNorms' fp32 input
    copies ((8 - e)*H a token beyond the fp32 count) and, under LoRA (``train_weights``
    False, PEFT's fp32 adapters), each adapted projection's input cast to fp32
    (4*(5H + Q + I) in place of e*(2H + I)); HF's loss keeps fp32 (T, V) gradients (8*T*V at
    its log-softmax's backward) whatever the logits' dtype. These terms were recalibrated
    against the H100 measurement of LLaMA-3.1-8B LoRA (``tests/test_plan.py`` reads it).

    ``quantized_base`` (QLoRA, ``train_weights`` False): the base projections are
    bitsandbytes-quantized and dequantized for each layer pass (``ckpt_ext.hf.quantized``): a
    fused layer holds its whole dequantized weights in ``dtype`` through its backward (e times
    the layer's projection parameters, counted in the top layer's backward; one layer's at a
    time), HF's re-run layer one projection's at a time (the largest).

    ``segment_layers`` k (a fused preset; :func:`segment_bytes`): the layers run in segments
    of k consecutive layers, whose layers 2..k keep no input (``min_memory``'s nothing at
    all); a segment's backward re-runs its first k - 1 layers forward to rebuild the inputs of
    the others and holds them while its layers' backwards walk down, so the top layer's
    backward has the segment's k - 1 rebuilt inputs beside it (the largest, over the segments,
    of their rebuilt inputs with what the segments up to them keep). k = 1 is the step as it
    is.

    The sequence-sized terms are what the sequence-tiled layer removes; the model is kept
    in step with the code by the test that measures it.
    """
    if setup not in PEAK_SETUPS + ("none",):
        raise ValueError(f"step_peak: setup must be one of {', '.join(PEAK_SETUPS)} or "
                         f"'none'; got {setup!r}")
    if path not in _PATHS:
        raise ValueError(f"step_peak: path must be 'cuda' or 'cpu', got {path!r}")
    _check_shape_args(B, S)
    layers = list(layers)
    if not layers:
        raise ValueError("step_peak: layers must not be empty")
    e = _dtype(dtype).itemsize
    T = B * S
    if chunk_bytes is None:
        chunk_bytes = config.current().chunk_bytes
    if chunk_rows is not None:
        _check_chunk_rows(chunk_rows, "step_peak")
    d = _widest(layers)
    H, Hq, D, I = d.hidden_size, d.num_heads, d.head_dim, d.intermediate_size
    Q, K = Hq * D, d.num_kv_heads * D
    preset = "torch" if setup.startswith("hf_gc") else setup
    if quantized_base and (train_weights or any(x.moe for x in layers)):
        raise ValueError("step_peak: quantized_base (QLoRA) is a frozen dense base: pass "
                         "train_weights=False, and layers without experts")
    if preset in ("torch", "none") and any(x.moe for x in layers):
        raise NotImplementedError(
            f"step_peak: setup {setup!r} with mixture-of-experts layers: the plan models HF's "
            "layer for dense layers only (bench/moe.py measures HF checkpointing's MoE "
            "step peak); plan a fused preset")
    _check_segment_layers(segment_layers, setup, "step_peak")
    if segment_layers > 1:
        kept, rebuilds = segment_bytes(layers, B, S, dtype, segment_layers, preset)
        layers_saved = sum(kept) + router_logits_bytes(layers, T, dtype)
        rebuilt = _rebuilt_peak(kept, rebuilds)
    else:
        rebuilt = 0
        layers_saved = sum(_saved_bytes(preset, x, B, S, dtype, train_weights)
                           for x in layers) + router_logits_bytes(layers, T, dtype)
    # what the device holds of the layers' saved bytes; offload_step_peak's: the offloaded
    # calls' bytes in host memory, the prefetch pool on the device
    held = layers_saved
    streamed = 0     # offload_step_peak's streamed inputs: one token chunk of the input
    if _offloaded is not None:
        host, pool, rebuilt, streamed = _offloaded
        held = layers_saved - host + pool
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
        rows = min(T, rows_within_cap(H, e, chunk_bytes))   # the normed head's chunks
        if train_weights and walks_vocabulary(T, V, e):
            rows = T       # its backward normalises the rows in one piece
        # training the weight over several token chunks: an fp32 accumulator, or each
        # chunk's gradient beside the fp32 sum
        dw_sum = 4 * V * H if train_weights and rows < T else 0
        if path == "cpu":    # one (rows, V) fp32 logits buffer within the cap, both ways (the
            # CPU linear cross-entropy's chunks of the normed head's rows)
            fwd_logits = bwd_logits = 4 * V * min(rows, _C.lce_chunk_rows(V, 4, 1, chunk_bytes))
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
    head_peak = held + rope + head_saved + head_work

    # the top layer's backward
    params = H * (2 * Q + 2 * K) + d.ffn_parameters()
    grads = e * params if train_weights else 0
    if preset == "torch":
        layer_work = plain_layer_bytes(d, B, S, dtype, train_weights)
        phase = "top layer backward (HF's layer re-run)"
    elif preset == "none":   # the top layer's saved tensors are counted; its dy and dx
        layer_work = e * T * 2 * H + grads
        phase = "top layer backward (HF's layer)"
    else:
        # The MLP walks token chunks of the cap (three (rows, I) tensors at the compute width)
        # or of the given rows (a chunk's whole sequences, or a piece of one)
        mlp_rows = min(T, mlp_chunk_rows(d, e, chunk_bytes, path) if chunk_rows is None
                       else _chunk_size(B, S, chunk_rows))
        # an MoE FFN's backward holds its chunk's ffn_row_width at the compute width (at
        # least fp32), on either path (csrc/moe_math.cpp)
        moe_row = ffn_row_width(d) * max(4, e) if d.moe else 0
        if d.moe:
            swiglu = moe_row * mlp_rows
        elif path == "cpu":   # (rows, I) fp32 buffers within the cap: six, or four with the
            n = _C.swiglu_buffers(True, preset == "fast")   # gate/up that fast saves
            swiglu = n * 4 * I * min(T, _C.swiglu_chunk_rows(I, n, 4, chunk_bytes))
        else:               # the Triton backward's dh, dgate, dup of one chunk
            swiglu = 3 * e * mlp_rows * I
        if train_weights and mlp_rows < T:   # the weights' gradients summed over chunks:
            swiglu += d.ffn_parameters() * (4 + e)     # an fp32 sum and the chunk's own
        elif train_weights and path == "cpu" and not d.moe:
            # one chunk: the FFN's weight gradients are formed while all but one of the
            # chunk's (rows, I) buffers are still alive
            swiglu = max(swiglu, swiglu * (n - 1) // n + e * d.ffn_parameters())
        rows = (layer_chunk_rows(d, e, chunk_bytes, CUDA_SMS if path == "cuda" else 0)
                if chunk_rows is None else _chunk_size(B, S, chunk_rows))
        if rows >= T:        # one chunk: the layer as written out. The backward rebuilds
            # what the attention part needs before the MLP part runs, so beside dy, the MLP
            # input and its gradient the MLP part holds the normed x, q before and after RoPE,
            # k before and after RoPE and v (and min_memory's recomputed attention output,
            # o_proj's output and h, and its lse); counted from the allocator at the peak
            if preset == "min_memory":
                mlp = e * T * (6 * H + 3 * Q + 3 * K) + lse + swiglu
                attn = e * T * (9 * H + 6 * Q + 6 * K)
            elif preset == "balanced":
                mlp = e * T * (4 * H + 2 * Q + 3 * K) + swiglu
                attn = e * T * (9 * H + 5 * Q + 6 * K)
            else:
                mlp = e * T * 3 * H + swiglu
                attn = e * T * (9 * H + 3 * Q + 3 * K)
            if path == "cuda":
                attn += 4 * T * Q
        else:                # token chunks: dy, dx, k and v (kept by fast), fp32 dk/dv sums
            whole = e * T * 2 * H + (0 if preset == "fast" else 2 * e * T * K) + 8 * T * K
            if d.moe:
                swiglu = moe_row * rows
            elif path == "cpu":
                n = _C.swiglu_buffers(True, preset == "fast")
                swiglu = n * 4 * I * min(rows, _C.swiglu_chunk_rows(I, n, 4, chunk_bytes))
            else:
                swiglu = 3 * e * rows * I
            # the chunk's n, h, MLP input and dh, q before and after RoPE and out beside the
            # MLP's backward (fast reads its kept q and out); then dh, n, dn with q, out,
            # dout, dq and dq before RoPE
            mlp = whole + e * rows * (4 * H + (Q if preset == "fast" else 3 * Q)) + swiglu
            attn = whole + e * rows * (3 * H + 6 * Q)
            if preset == "min_memory":   # the chunk's recomputed attention output and lse,
                mlp += e * rows * (Q + H) + lse // T * rows    # and its o_proj output
                attn += e * rows * (Q + H) + lse // T * rows
            if path == "cuda":   # the Triton dQ's fp32 accumulator
                attn += 4 * rows * Q
            else:                # the CPU backward's fp32 copies of a kv head's keys and
                attn += 16 * T * K   # values and its dk, dv sums, (T, D) each, per head
            if train_weights:   # the layer's gradients summed over the chunks in fp32, there
                grads += (4 - e) * params if e < 4 else 0   # from the first chunk's backward
                mlp += grads    # on: the later chunks' MLP parts run beside them
        attn += grads
        layer_work = max(mlp, attn)
        phase = f"top layer backward ({'MLP' if mlp >= attn else 'attention'} part)"
    if quantized_base:   # the dequantized weights of the layer running its backward
        layer_work += e * (params if preset not in ("torch", "none") else
                           max(r * c for r, c in _projection_shapes(d)))
    layer_peak = held + rebuilt + rope + layer_work + streamed
    if rebuilt:
        phase += " beside its segment's rebuilt inputs"
    if head_peak >= layer_peak:
        return StepPeak(saved, head_peak, "head backward")
    return StepPeak(saved, layer_peak, phase)


def model_state_bytes(layers: Sequence[LayerDims], V: int, dtype, weights: str,
                      lora_rank: int | None = None, tied: bool = False, shard: int = 1,
                      expert_lora_rank: int = 0, quant: str = "nf4",
                      double_quant: bool = True) -> int:
    """Bytes the model and its optimizer hold outside the step, per GPU: ``weights="full"``, a
    full fine-tune with AdamW on fp32 weights (weights, gradients and two moments: 16 bytes a
    parameter, as under ``Trainer(bf16=True)``); ``"lora"``, a frozen base in ``dtype`` with
    rank-``lora_rank`` adapters (:data:`LORA_RANK` unless given) on every projection (fp32,
    AdamW: 16 bytes an adapter parameter). ``shard``: the sharding degree of FSDP / ZeRO-3
    (each GPU holds 1/shard of it, and the gathered parameters of two units in ``dtype``, the
    one running and the one prefetched, the larger of a decoder layer and the embedding or
    head).

    A mixture-of-experts layer (``LayerDims.experts``) holds its experts (E 3 H I_e), router
    (E H) and shared expert; ``"lora"`` puts the adapters on the attention and the shared
    expert, and with ``expert_lora_rank`` r > 0 on the routed experts too (PEFT's
    ``target_parameters``: r (H + 2 I_e) for gate_up_proj and r (I_e + H) for down_proj per
    expert).

    ``"qlora"``: the projections quantized by bitsandbytes (``quant``, ``double_quant``:
    :func:`quantized_bytes`), the embeddings, norms and head in fp32 (as
    ``peft.prepare_model_for_kbit_training`` leaves them), and the LoRA adapters as for
    ``"lora"``; dense layers on one device (the fused layers refuse sharded quantized
    weights, so ``shard`` must be 1)."""
    if isinstance(expert_lora_rank, bool) or not isinstance(expert_lora_rank, int) \
            or expert_lora_rank < 0:
        raise ValueError("model_state_bytes: expert_lora_rank must be a non-negative int, got "
                         f"{expert_lora_rank!r}")
    if lora_rank is None:
        lora_rank = LORA_RANK
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
        layer = H * (2 * Q + 2 * K) + x.ffn_parameters() + 2 * H
        base += layer
        unit = max(unit, layer)
        adapters += lora_rank * ((H + Q) + 2 * (H + K) + (Q + H))
        if I:
            adapters += lora_rank * (2 * (H + I) + (I + H))
        adapters += expert_lora_rank * x.experts * (2 * H + 3 * x.expert_intermediate_size)
    if weights == "full":
        state = 16 * base
    elif weights == "lora":
        state = e * base + 16 * adapters
    elif weights == "qlora":
        if any(x.moe for x in layers) or expert_lora_rank:
            raise ValueError("model_state_bytes: weights='qlora' plans dense layers (bitsandbytes "
                             "does not quantize HF's fused expert weights)")
        if shard != 1:
            raise ValueError("model_state_bytes: weights='qlora' is unsharded (shard=1): the "
                             "fused layers refuse ZeRO-3 / FSDP2-sharded quantized weights")
        quantized = sum(quantized_bytes(r, c, quant, double_quant)
                        for x in layers for r, c in _projection_shapes(x))
        dense = V * H0 * (1 if tied else 2) + H0 + sum(2 * x.hidden_size for x in layers)
        return quantized + 4 * dense + 16 * adapters
    else:
        raise ValueError("model_state_bytes: weights must be 'full', 'lora' or 'qlora', got "
                         f"{weights!r}")
    if shard == 1:
        return state
    return -(-state // shard) + 2 * e * unit


def parameter_state_bytes(params) -> int:
    """The model state of actual parameters, as :func:`model_state_bytes` counts a config's:
    every parameter's bytes, and for each one that trains (``requires_grad``) its gradient and
    AdamW's two moments, in its dtype (as ``torch.optim.AdamW`` keeps them): 4 times its bytes.
    Each tensor counts once."""
    seen, total = set(), 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        total += 4 * n if p.requires_grad else n
    return total


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
                     limit: int = 1 << 26, headroom: int = 0, shard: int = 1,
                     expert_lora_rank: int = 0, quant: str = "nf4",
                     double_quant: bool = True, segment_layers: int = 1) -> int:
    """The longest S (at most ``limit``) whose step fits ``device_memory`` less ``headroom``
    (:func:`headroom_bytes`) with the model state of ``weights`` (:func:`model_state_bytes`,
    sharded ``shard`` ways, ``expert_lora_rank``; ``quant``, ``double_quant`` for
    ``"qlora"``), by :func:`step_peak` (with ``segment_layers``); 0 if none does."""
    _check_segment_layers(segment_layers, setup, "longest_sequence")
    room = device_memory - headroom - model_state_bytes(
        layers, V, dtype, weights, shard=shard, expert_lora_rank=expert_lora_rank, quant=quant,
        double_quant=double_quant)
    fits = lambda s: step_peak(setup, layers, V, B, s, dtype, path=path,  # noqa: E731
                               train_weights=weights == "full",
                               quantized_base=weights == "qlora",
                               segment_layers=segment_layers).peak <= room
    return _longest_fitting(fits, limit)


# ---- offload (ckpt_ext.offload) ------------------------------------------------------------------
OFFLOAD_SETUPS = ("fast", "balanced", "min_memory")


@dataclass(frozen=True)
class OffloadPeak:
    """One training step with ``offload="cpu"`` (see :func:`offload_step_peak`)."""

    peak: int           # device: the step's peak above its start
    host: int           # host pool bytes held when the forward ends
    offloaded: int      # layer calls whose saved tensors are in host memory
    kept: int           # bytes of the calls past the host cap, kept on the device
    pool: int           # the device prefetch pool
    rebuilt: int = 0    # segments: the rebuilt layer inputs beside the top layer's backward
    calls: int = 0      # the layer calls that save (min_memory in segments: one a segment)
    # streamed inputs (offload_step_peak(..., stream=True)); without stream host_peak is
    # host, and the rest are 0 / False
    stream: bool = False
    host_peak: int = 0      # the most host bytes at once (streamed: the first inputs of the
    # segments up to the running one and its rebuilt inputs sent to host memory)
    host_rebuilt: int = 0   # streamed: the most rebuilt inputs in host memory at once
    rebuild: int = 0        # streamed: the device peak of the segments' rebuild (a phase of
    # its own: the step's peak is the larger of it and the other phases)
    copies: int = 0         # streamed: bytes copied serialized with compute in a step


def offload_device_bytes(layers: Sequence[LayerDims], presets: Sequence[str], B: int, S: int,
                         dtype, prefetch: int = 1) -> int:
    """The device prefetch pool: ``prefetch + 1`` slots (the layer running backward and the
    ones being copied back), each as large as the largest layer's saved bytes."""
    return _pool([layer_bytes(p, x, B, S, dtype) for p, x in zip(presets, layers)], prefetch)


def _pool(sizes, prefetch: int) -> int:
    """The prefetch pool of layers saving ``sizes`` bytes: the prefetch + 1 largest."""
    return sum(sorted(sizes, reverse=True)[:prefetch + 1])


def _offload_split(layers, presets, B, S, dtype, host_limit, segment_layers: int = 1):
    """(the saved bytes of the calls offloaded, host bytes, device bytes kept), in forward
    order by the offloader's rule (``ckpt_ext.offload.admits``): one call a layer, with
    ``segment_layers`` k > 1 less the inputs of a segment's layers 2..k (a call that saves
    nothing, ``min_memory``'s layers 2..k, is neither moved nor kept)."""
    moved, host, kept = [], 0, 0
    for b in _call_bytes(layers, presets, B, S, dtype, segment_layers):
        if not b:            # a segment's layer 2..k under min_memory: nothing saved
            continue
        if offload.admits(host, b, host_limit):
            moved.append(b)
            host += b
        else:
            kept += b
    return moved, host, kept


def offload_split(layers: Sequence[LayerDims], presets: Sequence[str], B: int, S: int, dtype,
                  host_limit: Optional[int] = None, segment_layers: int = 1):
    """(layers offloaded, host bytes, device bytes kept): each layer, in forward order, moves
    to host memory when the host total stays within ``host_limit``, else stays on the device
    (the offloader's rule with ``offload_limit``, ``ckpt_ext.offload.admits``). With
    ``segment_layers`` k > 1 (:func:`segment_bytes`) a segment's layers 2..k save no input:
    under ``min_memory`` the calls that save are the segments' first layers, each moving its
    input: (calls offloaded, host, kept)."""
    if segment_layers != 1:
        for p in set(presets):
            _check_segment_layers(segment_layers, p, "offload_split")
    moved, host, kept = _offload_split(layers, presets, B, S, dtype, host_limit,
                                       segment_layers)
    return len(moved), host, kept


def _check_stream(stream, setup: str, where: str) -> bool:
    """``stream`` must be a bool, and True only for ``min_memory`` (the streamed backward reads
    a layer call that saves its input alone)."""
    if not isinstance(stream, bool):
        raise ValueError(f"{where}: stream must be a bool, got {stream!r}")
    if stream and setup != "min_memory":
        raise ValueError(f"{where}: stream=True applies to setup 'min_memory' only (the "
                         f"streamed backward copies a layer's input chunk by chunk, and only "
                         f"min_memory's layer calls save their input alone); got setup "
                         f"{setup!r}")
    return stream


def _layer_rows(d: LayerDims, B: int, S: int, e: int, chunk_bytes: int, path: str) -> int:
    """The token rows of the fused layer's largest chunk at the cap (one chunk: all B*S)."""
    rows = layer_chunk_rows(d, e, chunk_bytes, CUDA_SMS if path == "cuda" else 0)
    return B * S if rows >= B * S else _chunk_size(B, S, rows)


def _forward_work(d: LayerDims, B: int, S: int, e: int, chunk_bytes: int, path: str) -> int:
    """The device bytes of a ``min_memory`` layer's forward beside its input and output (a
    count from csrc/layer_math.cpp ``attention_layer_forward``, not measured): over several
    token chunks the whole k and v, and one chunk's normed x, q before and after RoPE, k
    before and after RoPE, v, the attention output and float32 lse, h, the MLP input and
    output rows and the SwiGLU forward's (rows, I) work (on ``"cuda"`` gate, up and their
    product; on the CPU its fp32 buffers within the cap); one chunk: those of all B*S rows."""
    T = B * S
    H, Q, K, I = (d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim,
                  d.intermediate_size)
    rows = _layer_rows(d, B, S, e, chunk_bytes, path)
    keys = 2 * e * T * K if rows < T else 0
    mlp_rows = min(rows, mlp_chunk_rows(d, e, chunk_bytes, path))
    if d.moe:
        swiglu = ffn_row_width(d) * max(4, e) * mlp_rows
    elif path == "cpu":
        n = _C.swiglu_buffers(False, False)
        swiglu = n * 4 * I * min(mlp_rows, _C.swiglu_chunk_rows(I, n, 4, chunk_bytes))
    else:
        swiglu = 3 * e * mlp_rows * I
    return keys + e * rows * (4 * H + 3 * Q + 3 * K) + 4 * d.num_heads * rows + swiglu


def _stream_walk(layers, B, S, dtype, k, host_limit, chunk_bytes, path):
    """The streamed step of ``min_memory`` in segments of k (k = 1: every layer its own) under
    the offloader's rule (``ckpt_ext.offload.admits``), as a dict: ``host`` (the first inputs
    in host memory when the forward ends), ``moved`` (those calls' bytes), ``kept`` (the first
    inputs past the cap, on the device), ``host_peak``, ``host_rebuilt``, ``rebuilt`` (the
    most the device holds of rebuilt inputs past the cap beside a top layer's backward, as
    :func:`_rebuilt_peak` counts it), ``rebuild`` (the rebuild phase's device bytes, the most over
    the segments and their replayed layers: the kept first inputs of the segments up to the
    running one, its rebuilt inputs kept so far, dy, the replay's input, output and work;
    0 without a replay; the cos/sin tables and router logits left to the caller), ``copies`` (the
    bytes copied serialized with compute) and ``per_segment`` (each segment's, in forward
    order: (its first input's bytes if in host memory else 0, its serialized bytes)).

    Backward, from the last segment: the host holds the first inputs of the segments up to
    the running one (the ones above were released after their backwards); the rebuild
    replays the segment's layers 1..k-1 forward, each from a device copy of its input (the
    first copied in from host memory, whole), and sends each output (the next layer's input)
    to host memory when the cap admits it, else keeps it on the device. A replay holds the
    segment top layer's incoming gradient dy, its input and output, and its forward's work
    (:func:`_forward_work`). Copies serialized with compute: each streamed layer backward
    reads its input twice (2x), the rebuild reads the first input once and writes each hosted
    output once."""
    e = _dtype(dtype).itemsize
    L = len(layers)
    sizes = _call_bytes(layers, ["min_memory"] * L, B, S, dtype, k)
    bounds = segment_bounds(L, k)
    host, moved, first_host, first_dev = 0, [], [], []
    for a, _ in bounds:     # forward: the segments' first inputs, in forward order
        b = sizes[a]
        if offload.admits(host, b, host_limit):
            host += b
            moved.append(b)
            first_host.append(b)
            first_dev.append(0)
        else:
            first_host.append(0)
            first_dev.append(b)
    host_peak, host_rebuilt, most_dev, rebuild = host, 0, 0, 0
    per_segment = [None] * len(bounds)
    for j in range(len(bounds) - 1, -1, -1):
        a, stop = bounds[j]
        in_use = sum(first_host[:j + 1])
        below = sum(first_dev[:j + 1])
        dy = _input_bytes(layers[stop - 1], B, S, dtype)
        kept_rebuilt, hosted, copies = 0, 0, 2 * first_host[j]
        prev_hosted = first_host[j] > 0        # the first input comes in from host memory
        if stop - a > 1 and first_host[j]:
            copies += first_host[j]
        for i in range(a, stop - 1):
            x_in = _input_bytes(layers[i], B, S, dtype) if prev_hosted else 0
            out = _input_bytes(layers[i + 1], B, S, dtype)
            work = _forward_work(layers[i], B, S, e, chunk_bytes, path)
            rebuild = max(rebuild, below + kept_rebuilt + x_in + out + dy + work)
            if offload.admits(in_use, out, host_limit):
                in_use += out
                hosted += out
                copies += 3 * out       # out to host, then read twice by its backward
                prev_hosted = True
            else:
                kept_rebuilt += out
                prev_hosted = False
        host_peak = max(host_peak, in_use)
        host_rebuilt = max(host_rebuilt, hosted)
        most_dev = max(most_dev, below + kept_rebuilt)
        per_segment[j] = (first_host[j], copies)
    all_kept = sum(first_dev)
    return {"host": host, "moved": moved, "kept": all_kept, "host_peak": host_peak,
            "host_rebuilt": host_rebuilt, "rebuilt": most_dev - all_kept,
            "rebuild": rebuild,
            "copies": sum(c for _, c in per_segment), "per_segment": per_segment}


def stream_copy_bytes(layers: Sequence[LayerDims], B: int, S: int, dtype,
                      segment_layers: int = 1, host_limit: Optional[int] = None) -> int:
    """The bytes a streamed ``min_memory`` step (``offload_step_peak(..., stream=True)``)
    copies between host and device serialized with compute: each layer backward whose input
    is in host memory reads it twice, chunk by chunk (2x its input), and each segment's
    rebuild reads its first input in (1x) and writes its hosted rebuilt inputs out (1x each);
    inputs past ``host_limit`` stay on the device and copy nothing. The forward's copies of
    the segments' first inputs to host memory overlap compute, as without streaming, and are
    not counted."""
    _check_segment_layers(segment_layers, "min_memory", "stream_copy_bytes")
    _check_shape_args(B, S)
    layers = list(layers)
    return _stream_walk(layers, B, S, dtype, segment_layers, host_limit,
                        config.current().chunk_bytes, "cuda")["copies"]


def offload_step_peak(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, dtype,
                      *, path: str = "cuda", train_weights: bool = True,
                      host_limit: Optional[int] = None, prefetch: int = 1,
                      quantized_base: bool = False, segment_layers: int = 1,
                      chunk_bytes: Optional[int] = None, stream: bool = False) -> OffloadPeak:
    """:func:`step_peak` of a fused preset with its layers' saved bytes in host memory: the
    peak less the bytes of the offloaded layers plus the device prefetch pool (counted at
    every phase, which overstates the head's phase, when the pool is still empty).

    ``segment_layers`` k > 1 (:func:`segment_bytes`): a segment's layers 2..k save no input,
    so under ``min_memory`` the host holds the segments' first inputs alone and the pool's
    ``prefetch + 1`` slots are segment inputs (the running one and the ones copied back); the
    device holds the running segment's k - 1 rebuilt inputs beside the top layer's backward
    (``rebuilt``), with the calls past the host cap. ``calls``: the layer calls that save
    bytes (under ``min_memory`` the segments). ``chunk_bytes``: :func:`step_peak`.

    ``stream`` (``min_memory`` only, else ValueError; ``Offloader(stream=True)``,
    ``patch_llama(..., offload="cpu", offload_stream=True)``): a layer call's input in host
    memory stays there through the backward, which copies it to the device one token chunk
    at a time as its chunk walk reads it. No prefetch pool (``pool`` 0): the top layer's
    backward holds one chunk of its input (the layer's chunk rows x H, all B*S in one chunk)
    beside its working set. With segments (k > 1) each segment's rebuild replays its first
    k - 1 layers forward from a device copy of each input (the first copied in from host
    memory) and sends each output, the next layer's input, to host memory through the same
    offloader (the host cap counts it; past the cap it stays on the device: ``rebuilt``), so
    the host holds the first inputs of the segments up to the running one and at most its
    k - 1 rebuilt inputs (``host_peak``, ``host_rebuilt``). The rebuild is a device phase of
    its own (``rebuild``): the kept inputs, the cos/sin tables and router logits, the
    segment top layer's incoming gradient dy, one replayed layer's input and output and its
    forward's work (:func:`_forward_work`; QLoRA: its dequantized weights); ``peak`` is the
    largest of the head's, the top layer backward's and the rebuild's. ``copies``: the bytes
    copied serialized with compute (:func:`stream_copy_bytes`)."""
    if setup not in OFFLOAD_SETUPS:
        raise ValueError(f"offload_step_peak: setup must be one of {', '.join(OFFLOAD_SETUPS)} "
                         f"(offload moves what a fused layer saves); got {setup!r}")
    _check_segment_layers(segment_layers, setup, "offload_step_peak")
    layers = list(layers)
    if _check_stream(stream, setup, "offload_step_peak"):
        return _stream_step_peak(layers, V, B, S, dtype, path, train_weights, host_limit,
                                 quantized_base, segment_layers, chunk_bytes)
    presets = [setup] * len(layers)
    sizes = _call_bytes(layers, presets, B, S, dtype, segment_layers)
    moved, host, kept = _offload_split(layers, presets, B, S, dtype, host_limit,
                                       segment_layers)
    pool = _pool(moved, prefetch)
    rebuilt = 0
    if segment_layers > 1:   # the offloaded calls are in host memory: at segment j's top
        # layer's backward the device holds the pool, the calls kept on it up to j and j's
        # rebuilt inputs
        in_host, on_device = 0, []
        for b in sizes:
            on_device.append(b if b and not offload.admits(in_host, b, host_limit) else 0)
            in_host += b - on_device[-1]
        bounds = segment_bounds(len(layers), segment_layers)
        rebuilt = _rebuilt_peak([sum(on_device[a:b]) for a, b in bounds],
                                segment_bytes(layers, B, S, dtype, segment_layers, setup)[1])
    base = step_peak(setup, layers, V, B, S, dtype, path=path, train_weights=train_weights,
                     quantized_base=quantized_base, segment_layers=segment_layers,
                     chunk_bytes=chunk_bytes, _offloaded=(host, pool, rebuilt, 0))
    return OffloadPeak(base.peak, host, len(moved), kept, pool, rebuilt,
                       sum(1 for b in sizes if b), host_peak=host)


def _stream_step_peak(layers, V, B, S, dtype, path, train_weights, host_limit,
                      quantized_base, k, chunk_bytes) -> OffloadPeak:
    """:func:`offload_step_peak` with ``stream=True`` (its docstring)."""
    _check_shape_args(B, S)
    if not layers:
        raise ValueError("offload_step_peak: layers must not be empty")
    if chunk_bytes is None:
        chunk_bytes = config.current().chunk_bytes
    e = _dtype(dtype).itemsize
    w = _stream_walk(layers, B, S, dtype, k, host_limit, chunk_bytes, path)
    d = _widest(layers)
    chunk = e * d.hidden_size * _layer_rows(d, B, S, e, chunk_bytes, path) if w["moved"] or \
        w["host_rebuilt"] else 0
    base = step_peak("min_memory", layers, V, B, S, dtype, path=path,
                     train_weights=train_weights, quantized_base=quantized_base,
                     segment_layers=k, chunk_bytes=chunk_bytes,
                     _offloaded=(w["host"], 0, w["rebuilt"], chunk))
    peak = base.peak
    if w["rebuild"]:
        rebuild = (w["rebuild"] + 2 * S * d.head_dim * e
                   + router_logits_bytes(layers, B * S, dtype)
                   + (dequantized_bytes(layers, dtype) if quantized_base else 0))
        peak = max(peak, rebuild)
    else:
        rebuild = 0
    sizes = _call_bytes(layers, ["min_memory"] * len(layers), B, S, dtype, k)
    return OffloadPeak(peak, w["host"], len(w["moved"]), w["kept"], 0, w["rebuilt"],
                       sum(1 for b in sizes if b), True, w["host_peak"], w["host_rebuilt"],
                       rebuild, w["copies"])


def cpu_step_peak(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, dtype, *,
                  train_weights: bool = True, offload: bool = False,
                  host_limit: Optional[int] = None, prefetch: int = 1,
                  segment_layers: int = 1, chunk_bytes: Optional[int] = None,
                  quantized_base: bool = False, stream: bool = False) -> int:
    """The CPU allocator's peak (``ckpt_ext.peak_memory_bytes``) of a training step after the
    first, as the plan predicts it: :func:`step_peak` on the ``"cpu"`` path, or with
    ``offload`` (``offload="cpu"``, ``offload_limit=host_limit``) :func:`offload_step_peak`
    less its prefetch pool: on a CPU-only machine the offloader's host and device pools are
    both CPU memory, allocated in the first step and reused, so a later step allocates
    neither (the offloaded calls' bytes go into the host pool's buffers). ``segment_layers``:
    segments of k layers (:func:`segment_bytes`); ``chunk_bytes``: the chunk cap the step runs
    with (default the setting's). ``stream`` (with ``offload``, ``min_memory`` only):
    :func:`offload_step_peak`'s streamed step, whose pool is 0 (the input's chunks, the
    rebuild's device copies and its outputs' copies are the step's own allocations; its
    rebuilt inputs go into the host pool's buffers); a model, not yet held to the
    allocator."""
    _check_stream(stream, setup, "cpu_step_peak")
    if stream and not offload:
        raise ValueError("cpu_step_peak: stream=True streams offloaded inputs: pass "
                         "offload=True with it")
    if not offload:
        return step_peak(setup, layers, V, B, S, dtype, path="cpu", train_weights=train_weights,
                         chunk_bytes=chunk_bytes, quantized_base=quantized_base,
                         segment_layers=segment_layers).peak
    p = offload_step_peak(setup, layers, V, B, S, dtype, path="cpu",
                          train_weights=train_weights, host_limit=host_limit, prefetch=prefetch,
                          quantized_base=quantized_base, segment_layers=segment_layers,
                          chunk_bytes=chunk_bytes, stream=stream)
    return p.peak - p.pool


def longest_sequence_offload(setup: str, layers: Sequence[LayerDims], V: int, B: int, dtype,
                             device_memory: int, host_memory: Optional[int], weights: str, *,
                             path: str = "cuda", limit: int = 1 << 26, headroom: int = 0,
                             shard: int = 1, expert_lora_rank: int = 0, quant: str = "nf4",
                             double_quant: bool = True, segment_layers: int = 1,
                             stream: bool = False) -> int:
    """The longest S (at most ``limit``) whose offloaded step (:func:`offload_step_peak` with
    ``host_memory`` as the host cap, None for none, ``segment_layers`` and ``stream``) fits
    ``device_memory`` less ``headroom`` with the model state (``expert_lora_rank``, ``quant``,
    ``double_quant``: :func:`model_state_bytes`); 0 if none."""
    _check_segment_layers(segment_layers, setup, "longest_sequence_offload")
    _check_stream(stream, setup, "longest_sequence_offload")
    room = device_memory - headroom - model_state_bytes(
        layers, V, dtype, weights, shard=shard, expert_lora_rank=expert_lora_rank, quant=quant,
        double_quant=double_quant)

    def fits(s):
        p = offload_step_peak(setup, layers, V, B, s, dtype, path=path,
                              train_weights=weights == "full", host_limit=host_memory,
                              quantized_base=weights == "qlora", segment_layers=segment_layers,
                              stream=stream)
        return p.peak <= room

    return _longest_fitting(fits, limit)


# ---- FLOPs ---------------------------------------------------------------------------------
def _check_ranks(lora_rank, expert_lora_rank, where: str) -> None:
    for name, r in (("lora_rank", lora_rank), ("expert_lora_rank", expert_lora_rank)):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"{where}: {name} must be a non-negative int, got {r!r}")


def _projection_flops(d: LayerDims, lora_rank: int | None = None,
                      expert_lora_rank: int = 0) -> tuple:
    """Forward FLOPs per token of a layer's projection groups (qkv, o_proj, gate_up, down):
    the weights' GEMMs (module docstring); or, with ``lora_rank`` r given, the adapters' (an
    adapter of rank r on a projection in -> out: x A^T then (x A^T) B^T, 2 r (in + out)) where
    :func:`model_state_bytes` puts them: r on q, k, v, o and the dense MLP's (or the shared
    expert's) gate, up and down, and ``expert_lora_rank`` r_e on the routed experts'
    gate_up_proj (H -> 2 I_e) and down_proj (I_e -> H), for each of a token's top_k copies."""
    H, Hq, Hkv, D = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim
    Q, K = Hq * D, Hkv * D
    if lora_rank is None:
        I = d.active_intermediate()     # an MoE token's top_k experts and shared expert
        return (2 * H * (Q + 2 * K), 2 * Q * H,
                4 * H * I + 2 * H * d.experts,      # with an MoE router's logits
                2 * I * H)
    r, re, Is, Ie, k = lora_rank, expert_lora_rank, d.intermediate_size, \
        d.expert_intermediate_size, d.top_k
    return (2 * r * ((H + Q) + 2 * (H + K)), 2 * r * (Q + H),
            (4 * r * (H + Is) if Is else 0) + 2 * re * k * (H + 2 * Ie),
            (2 * r * (Is + H) if Is else 0) + 2 * re * k * (Ie + H))


def _recomputed(preset: str, d: LayerDims, groups: tuple) -> int:
    """The forward FLOPs per token of the projection ``groups`` (:func:`_projection_flops`)
    that ``preset`` recomputes in backward (module docstring)."""
    qkv, o_proj, gate_up, down = groups
    if preset == "none":     # HF's layer as it is: nothing recomputed
        return 0
    # the output norms' backward reads the sublayer's output (module docstring)
    out_norms = (d.mlp_output_norm * (down if preset == "fast" else gate_up + down)
                 + (d.attention_output_norm and preset != "min_memory") * o_proj)
    if preset == "fast":     # an MoE layer's fast keeps no gate/up: recomputed
        return out_norms + (gate_up if d.moe else 0)
    if preset == "balanced":
        return qkv + gate_up + out_norms
    if preset == "min_memory":
        return qkv + gate_up + o_proj + out_norms
    if preset == "torch":
        return qkv + o_proj + gate_up + down
    raise ValueError(f"recompute_flops: preset must be one of 'fast', 'balanced', "
                     f"'min_memory', 'torch'; got {preset!r}")


def _flops_parts(preset: str, d: LayerDims, S: int, lora_rank: int = 0,
                 expert_lora_rank: int = 0):
    """Recompute FLOPs of one layer divided by B*S, as (attention, matmul): the attention's
    score and P V products, and the projections (module docstring), with their LoRA adapters'
    (:func:`_projection_flops`) when a rank is given. Integers."""
    scores = pv = d.num_heads * d.head_dim * (S + 1)
    matmul = _recomputed(preset, d, _projection_flops(d))
    if lora_rank or expert_lora_rank:
        matmul += _recomputed(preset, d, _projection_flops(d, lora_rank, expert_lora_rank))
    if preset in ("none", "fast", "balanced"):
        return scores, matmul
    return 2 * scores + pv, matmul


def _lora_step_flops(preset: str, d: LayerDims, lora_rank: int, expert_lora_rank: int) -> int:
    """The adapters' FLOPs per token of one layer's step (:func:`step_flops`): their forward,
    twice that in backward (dx through B then A; dA and dB) and what ``preset`` recomputes."""
    if not (lora_rank or expert_lora_rank):
        return 0
    groups = _projection_flops(d, lora_rank, expert_lora_rank)
    return 3 * sum(groups) + _recomputed(preset, d, groups)


def _flops_per_token(preset: str, d: LayerDims, S: int, lora_rank: int = 0,
                     expert_lora_rank: int = 0) -> int:
    """Recompute FLOPs of one layer divided by B*S (an integer: see the module docstring)."""
    return sum(_flops_parts(preset, d, S, lora_rank, expert_lora_rank))


def recompute_flops(preset: str, dims: LayerDims, B: int, S: int, *, lora_rank: int = 0,
                    expert_lora_rank: int = 0) -> int:
    """Forward FLOPs that ``preset`` recomputes in one layer's backward (module docstring),
    with LoRA adapters of ``lora_rank`` / ``expert_lora_rank`` (:func:`_projection_flops`) on
    the projections it recomputes."""
    _check_ranks(lora_rank, expert_lora_rank, "recompute_flops")
    if preset not in ("fast", "balanced", "min_memory", "torch"):   # ("none": HF's layer,
        # which recomputes nothing, is auto's choice only: layer_seconds)
        raise ValueError(f"recompute_flops: preset must be one of 'fast', 'balanced', "
                         f"'min_memory', 'torch'; got {preset!r}")
    return B * S * _flops_per_token(preset, dims, S, lora_rank, expert_lora_rank)


# ---- the step's time (an estimate) -------------------------------------------------------------
# The default rates: H100 figures (ckpt_ext.throughputs says where they come from).
from .throughputs import ATTENTION_BWD_TFLOPS, ATTENTION_FWD_TFLOPS, MATMUL_TFLOPS  # noqa: E402


def step_flops(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, *,
               train_weights: bool = True, lora_rank: int = 0,
               expert_lora_rank: int = 0, segment_layers: int = 1) -> dict:
    """The FLOPs of one training step of ``setup`` (:data:`PEAK_SETUPS`), Python ints, in
    three parts: ``attention_forward`` (the causal scores and P V of every layer's forward,
    and again where the setup re-runs the attention forward in backward: ``min_memory`` and
    HF checkpointing), ``attention_backward`` (2.5 times the forward: dV, dP, dQ, dK and the
    score tiles rebuilt, as the attention benchmark counts them) and ``matmul`` (every
    projection and the head, 2 FLOPs a multiply-add: forward; backward once for the input
    gradients and, with ``train_weights``, once more for the weight gradients; the projections
    each preset recomputes (:func:`recompute_flops`) and, with the fused head, its logits once
    more).

    LoRA on a frozen base (``train_weights`` False): with ``lora_rank`` r the rank-r adapters
    on every projection (q, k, v, o and the dense MLP's or shared expert's gate, up, down), with
    ``expert_lora_rank`` r_e those on the routed experts' gate_up_proj and down_proj (each of a
    token's top_k copies), as :func:`model_state_bytes` counts their state: each adapter's
    GEMMs x A^T and (x A^T) B^T forward (2 r (in + out) a token), twice that in backward (dx
    through B then A; dA and dB) and again where the preset recomputes its projection (for an
    MoE layer every fused preset recomputes the experts' gate/up). The low-rank products some
    backward kernels rebuild rather than save (x A^T for dB: 2 r in a token) are left out.

    ``segment_layers`` k > 1 (a fused preset; :func:`segment_bytes`): each segment's backward
    runs its first k - 1 layers' forward once more (attention forward, every projection and
    adapter) to rebuild the other layers' inputs."""
    if setup not in PEAK_SETUPS:
        raise ValueError(f"step_flops: setup must be one of {', '.join(PEAK_SETUPS)}; got "
                         f"{setup!r}")
    _check_shape_args(B, S)
    _check_ranks(lora_rank, expert_lora_rank, "step_flops")
    _check_segment_layers(segment_layers, setup, "step_flops")
    if train_weights and (lora_rank or expert_lora_rank):
        raise ValueError("step_flops: lora_rank / expert_lora_rank count adapters on a frozen "
                         "base: pass train_weights=False with them")
    T = B * S
    preset = "torch" if setup.startswith("hf_gc") else setup
    fwd = bwd = matmul = 0
    for d in layers:
        f, b, m = _layer_flops(preset, d, B, S, train_weights, lora_rank, expert_lora_rank)
        fwd, bwd, matmul = fwd + f, bwd + b, matmul + m
    for d in _rebuilt_layers(layers, segment_layers):
        f, m = _forward_flops(d, B, S, lora_rank, expert_lora_rank)
        fwd, matmul = fwd + f, matmul + m
    passes = 3 if train_weights else 2
    head = 2 * T * layers[0].hidden_size * V
    matmul += head * passes + (head if setup != "hf_gc" else 0)
    return {"attention_forward": fwd, "attention_backward": bwd, "matmul": matmul}


def _layer_flops(preset: str, d: LayerDims, B: int, S: int, train_weights: bool,
                 lora_rank: int = 0, expert_lora_rank: int = 0) -> tuple:
    """One layer's (attention forward, attention backward, matmul) FLOPs of a step
    (:func:`step_flops`'s parts; ``preset`` "torch" for HF's checkpointing)."""
    T = B * S
    attn = 2 * d.num_heads * d.head_dim * (S + 1)       # scores and P V, per token
    reruns = 1 if preset in ("min_memory", "torch") else 0
    passes = 3 if train_weights else 2
    matmul = T * (passes * _flops_parts("torch", d, S)[1] + _flops_parts(preset, d, S)[1]
                  + _lora_step_flops(preset, d, lora_rank, expert_lora_rank))
    return T * attn * (1 + reruns), T * attn * 5 // 2, matmul


def _rebuilt_layers(layers: Sequence[LayerDims], segment_layers: int) -> list:
    """The layers a step in segments of ``segment_layers`` runs forward once more: each
    segment's first k - 1 (none when k = 1)."""
    layers = list(layers)
    return [layers[i] for a, b in segment_bounds(len(layers), segment_layers)
            for i in range(a, b - 1)]


def _forward_flops(d: LayerDims, B: int, S: int, lora_rank: int = 0,
                   expert_lora_rank: int = 0) -> tuple:
    """(attention, matmul) FLOPs of one layer's forward: the causal scores and P V, every
    projection and, with a rank, its adapters (:func:`_projection_flops`)."""
    T = B * S
    matmul = sum(_projection_flops(d))
    if lora_rank or expert_lora_rank:
        matmul += sum(_projection_flops(d, lora_rank, expert_lora_rank))
    return T * 2 * d.num_heads * d.head_dim * (S + 1), T * matmul


def step_time_estimate(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, *,
                       train_weights: bool = True, lora_rank: int = 0,
                       expert_lora_rank: int = 0, segment_layers: int = 1,
                       attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                       attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                       matmul_tflops: float = MATMUL_TFLOPS) -> float:
    """Seconds for one training step, ESTIMATED from :func:`step_flops` at fixed rates (H100
    figures by default); memory-bound work (norms, RoPE, SwiGLU, the optimizer), copies and
    launch gaps are left out. ``lora_rank`` / ``expert_lora_rank`` / ``segment_layers``:
    :func:`step_flops`."""
    f = step_flops(setup, layers, V, B, S, train_weights=train_weights, lora_rank=lora_rank,
                   expert_lora_rank=expert_lora_rank, segment_layers=segment_layers)
    return (f["attention_forward"] / (attention_fwd_tflops * 1e12)
            + f["attention_backward"] / (attention_bwd_tflops * 1e12)
            + f["matmul"] / (matmul_tflops * 1e12))


# ---- auto with offload: the choice by time -----------------------------------------------------
# With offload, what a layer saves crosses the host link twice a step (down in its forward, up
# one layer ahead of its backward), overlapped with the layers' compute. The plan's model of a
# layer's time is the larger of its compute (forward, backward and the preset's recompute at the
# throughputs' rates) and its copies (2 x its saved bytes at the host link's rate); a layer past
# the host cap stays on the device and copies nothing. The host link rate is an assumption, not
# a measurement: PCIe Gen5 x16 carries 64 GB/s a direction at most, and the GPUs of a node share
# the host's memory bandwidth.
HOST_LINK_GBYTES_PER_S = 25.0


@dataclass(frozen=True)
class OffloadChoice:
    """``auto`` with offload (:func:`choose_presets_offload`)."""

    presets: tuple      # one per layer, in forward order
    seconds: float      # the step time estimate, copies overlapped per layer
    peak: int           # device: the step's peak above its start
    host: int           # host bytes
    kept: int           # saved bytes of the layers past the host cap, on the device


def _layer_compute_seconds(preset, d, B, S, train_weights, fwd_rate, bwd_rate, mm_rate,
                           lora_rank=0, expert_lora_rank=0):
    """One layer's forward, backward and recompute time (``step_flops``'s parts, one layer)."""
    fwd, bwd, mm = _layer_flops(preset, d, B, S, train_weights, lora_rank, expert_lora_rank)
    return fwd / (fwd_rate * 1e12) + bwd / (bwd_rate * 1e12) + mm / (mm_rate * 1e12)


def _check_rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def choose_offload_layers(layers: Sequence[LayerDims], B: int, S: int, dtype, room: int,
                          host_memory: Optional[int], *, working: Optional[dict] = None,
                          base_seconds: float = 0.0, train_weights: bool = True,
                          lora_rank: int = 0, expert_lora_rank: int = 0, prefetch: int = 1,
                          host_link_gbytes_per_s: float = HOST_LINK_GBYTES_PER_S,
                          attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                          attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                          matmul_tflops: float = MATMUL_TFLOPS) -> Optional[OffloadChoice]:
    """The choice by time of ``auto`` with offload, over the decoder layers alone (the one
    rule that :func:`choose_presets_offload` and ``patch_llama(policy="auto", offload="cpu")``
    both read): one fused preset per layer with the least estimated time (each layer the
    larger of its compute and its two host copies, ``base_seconds`` added) such that
    ``working[p]`` (the largest over the presets used; None: 0) plus what the device holds of
    the layers, the prefetch pool (the ``prefetch + 1`` largest offloaded layers) and the
    layers past ``host_memory`` (the offloader's forward-order rule; None: no cap), is at most
    ``room`` bytes. The search runs over the count of each preset (every split of the layers
    into ``fast``, ``balanced`` and ``min_memory``), each placed in two orders
    (``min_memory`` first in forward order, or ``fast`` first): exact for models whose layers
    are alike, a heuristic otherwise. Ties go to the smaller peak. None when no mix fits.
    ``lora_rank`` / ``expert_lora_rank``: the adapters' FLOPs in each layer's compute
    (:func:`step_flops`). Raises ValueError naming a rate that is not a positive finite
    number."""
    layers = list(layers)
    _check_shape_args(B, S)
    _check_ranks(lora_rank, expert_lora_rank, "choose_offload_layers")
    lora = {"lora_rank": lora_rank, "expert_lora_rank": expert_lora_rank} \
        if lora_rank or expert_lora_rank else {}
    link = _check_rate("host_link_gbytes_per_s", host_link_gbytes_per_s) * 1e9
    rates = tuple(_check_rate(n, v) for n, v in (
        ("attention_fwd_tflops", attention_fwd_tflops),
        ("attention_bwd_tflops", attention_bwd_tflops), ("matmul_tflops", matmul_tflops)))
    work = working if working is not None else dict.fromkeys(_CHOICES, 0)
    L = len(layers)
    best = None
    for n_min in range(L + 1):
        for n_bal in range(L - n_min + 1):
            n_fast = L - n_min - n_bal
            mix = ["min_memory"] * n_min + ["balanced"] * n_bal + ["fast"] * n_fast
            for order in (mix, mix[::-1]):
                moved, host, kept = [], 0, 0
                secs = base_seconds
                for p, d in zip(order, layers):
                    b = layer_bytes(p, d, B, S, dtype)
                    compute = _layer_compute_seconds(p, d, B, S, train_weights, *rates, **lora)
                    if offload.admits(host, b, host_memory):
                        moved.append(b)
                        host += b
                        secs += max(compute, 2 * b / link)
                    else:
                        kept += b
                        secs += compute
                peak = max((work[p] for p in set(order)), default=0) + kept \
                    + _pool(moved, prefetch)
                if peak > room:
                    continue
                key = (secs, peak)
                if best is None or key < best[0]:
                    best = (key, OffloadChoice(tuple(order), secs, peak, host, kept))
                if n_min == L or n_fast == L:
                    break                        # one order only
    return None if best is None else best[1]


def choose_presets_offload(layers: Sequence[LayerDims], V: int, B: int, S: int, dtype,
                           room: int, host_memory: Optional[int], *, path: str = "cuda",
                           train_weights: bool = True, lora_rank: int = 0,
                           expert_lora_rank: int = 0, prefetch: int = 1,
                           quantized_base: bool = False,
                           host_link_gbytes_per_s: float = HOST_LINK_GBYTES_PER_S,
                           attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                           attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                           matmul_tflops: float = MATMUL_TFLOPS) -> OffloadChoice:
    """``auto`` with offload, chosen by time, for the whole step: :func:`choose_offload_layers`
    with the LM head's time added and each preset's working set counted in the device peak,
    which must fit ``room`` bytes (the device less the model state and headroom) with at most
    ``host_memory`` bytes in host memory; ``quantized_base``: QLoRA (:func:`step_peak`).

    The device peak of a mix is the largest of its presets' working sets (:func:`step_peak`
    less the layers' saved bytes) plus what the device holds of the layers: the prefetch pool
    and the layers past the host cap. Raises ValueError when no mix fits (not even every layer
    ``min_memory``)."""
    layers = list(layers)
    _check_shape_args(B, S)
    work = {}
    for p in _CHOICES:
        full = step_peak(p, layers, V, B, S, dtype, path=path, train_weights=train_weights,
                         quantized_base=quantized_base).peak
        work[p] = full - sum(layer_bytes(p, x, B, S, dtype) for x in layers)
    head = 2 * B * S * layers[0].hidden_size * V * ((3 if train_weights else 2) + 1)
    head_s = head / (_check_rate("matmul_tflops", matmul_tflops) * 1e12)
    best = choose_offload_layers(layers, B, S, dtype, room, host_memory, working=work,
                                 base_seconds=head_s, train_weights=train_weights,
                                 lora_rank=lora_rank, expert_lora_rank=expert_lora_rank,
                                 prefetch=prefetch, host_link_gbytes_per_s=host_link_gbytes_per_s,
                                 attention_fwd_tflops=attention_fwd_tflops,
                                 attention_bwd_tflops=attention_bwd_tflops,
                                 matmul_tflops=matmul_tflops)
    if best is None:
        raise ValueError(
            f"auto with offload: no mix of fused presets fits {format_bytes(room)} of device "
            f"memory for the step at B={B}, S={S} (every layer min_memory with "
            f"{format_bytes(host_memory) if host_memory is not None else 'uncapped'} host "
            f"memory does not); shorten the sequence or raise the host or device memory")
    return best


# ---- segments: how many layers a segment holds, chosen by time ----------------------------------
@dataclass(frozen=True)
class SegmentChoice:
    """``min_memory`` in segments of ``segment_layers`` layers (:func:`choose_segment_layers`)."""

    segment_layers: int     # k: consecutive layers a segment holds (the runtime's one int)
    seconds: float          # the step time estimate, copies overlapped per segment
    peak: int               # device: the step's peak above its start
    host: int               # host bytes (0 without offload)
    kept: int               # offload: the inputs of the segments past the host cap


def _segment_seconds(layers, V, B, S, dtype, k, host_memory, offloaded, train_weights, link,
                     rates, lora, stream: bool = False) -> float:
    """The step of ``min_memory`` in segments of k: per segment the larger of its compute
    (its layers' forward, backward and recompute, and the forward of its first k - 1 layers
    once more) and, offloaded, its input's two host copies at ``link`` bytes/s; plus the LM
    head's GEMMs (the fused head's logits once more). ``stream``: per segment the larger of
    its compute and its input's copy to host memory in forward, plus its copies serialized
    with compute (:func:`stream_copy_bytes`) at ``link``."""
    walk = _stream_walk(layers, B, S, dtype, k, host_memory, config.current().chunk_bytes,
                        "cuda")["per_segment"] if stream else None
    secs, host = 0.0, 0
    H = layers[0].hidden_size
    head = 2 * B * S * H * V * ((3 if train_weights else 2) + 1)
    secs += head / (rates[2] * 1e12)
    sizes = _call_bytes(layers, ["min_memory"] * len(layers), B, S, dtype, k)
    for a, b in segment_bounds(len(layers), k):
        nbytes = sum(sizes[a:b])    # the segment's calls: its first layer's under min_memory
        compute = sum(_layer_compute_seconds("min_memory", d, B, S, train_weights, *rates,
                                             **lora) for d in layers[a:b])
        for d in layers[a:b - 1]:
            f, m = _forward_flops(d, B, S, **lora)
            compute += f / (rates[0] * 1e12) + m / (rates[2] * 1e12)
        if stream:
            hosted, serial = walk[a // k]    # the segment's, in forward order
            compute = max(compute, hosted / link) + serial / link
        elif offloaded and offload.admits(host, nbytes, host_memory):
            host += nbytes
            compute = max(compute, 2 * nbytes / link)
        secs += compute
    return secs


def choose_segment_layers(layers: Sequence[LayerDims], V: int, B: int, S: int, dtype,
                          room: int, host_memory: Optional[int] = None, *,
                          offload: bool = True, path: str = "cuda", train_weights: bool = True,
                          quantized_base: bool = False, lora_rank: int = 0,
                          expert_lora_rank: int = 0, prefetch: int = 1,
                          host_link_gbytes_per_s: float = HOST_LINK_GBYTES_PER_S,
                          attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                          attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                          matmul_tflops: float = MATMUL_TFLOPS,
                          layers_only: bool = False, stream: bool = False) -> SegmentChoice:
    """``segment_layers`` chosen by time (the rule of ``--segment-layers auto``): of the k in
    1..len(layers) whose ``min_memory`` step in segments of k fits ``room`` bytes of device
    memory (:func:`offload_step_peak` with ``host_memory`` as the host cap, the segments
    past it keeping their inputs on the device; ``offload`` False: :func:`step_peak`), the
    one with the least estimated time, the smaller k of equal times. The time: per segment
    the larger of its compute (its layers' forward, backward and recompute, and the rebuild:
    the forward of its first k - 1 layers once more, at the rates) and, offloaded, its
    input's two host copies at ``host_link_gbytes_per_s``, plus the LM head's GEMMs. When the
    host holds every layer's input (k = 1), k = 1 is the fastest unless the copies bind;
    when it runs short, the k that fits. One k for the whole model, as
    ``patch_llama(segment_layers=k)`` takes it. ``layers_only``: ``room`` bounds only what
    the device holds of the layers, as ``patch_llama``'s ``activation_budget`` does with
    offload (the prefetch pool, the inputs past the host cap and the running segment's
    rebuilt inputs; without offload the segments' kept bytes and the rebuilt inputs), and the
    choice's ``peak`` is those bytes. ``stream`` (with ``offload``): the streamed step
    (:func:`offload_step_peak`'s ``stream``), timed per segment as the larger of its compute
    and its input's copy to host memory, plus the copies serialized with compute
    (:func:`stream_copy_bytes`) at the link's rate; its ``host`` is the most host bytes at
    once (the rebuilt inputs included). Raises ValueError when no k fits."""
    layers = list(layers)
    _check_shape_args(B, S)
    _check_ranks(lora_rank, expert_lora_rank, "choose_segment_layers")
    if _check_stream(stream, "min_memory", "choose_segment_layers") and not offload:
        raise ValueError("choose_segment_layers: stream=True streams offloaded inputs: pass "
                         "offload=True with it")
    if not layers:
        raise ValueError("choose_segment_layers: layers must not be empty")
    link = _check_rate("host_link_gbytes_per_s", host_link_gbytes_per_s) * 1e9
    rates = tuple(_check_rate(n, v) for n, v in (
        ("attention_fwd_tflops", attention_fwd_tflops),
        ("attention_bwd_tflops", attention_bwd_tflops), ("matmul_tflops", matmul_tflops)))
    lora = {"lora_rank": lora_rank, "expert_lora_rank": expert_lora_rank} \
        if lora_rank or expert_lora_rank else {}
    best = None
    for k in range(1, len(layers) + 1):
        if offload:
            p = offload_step_peak("min_memory", layers, V, B, S, dtype, path=path,
                                  train_weights=train_weights, host_limit=host_memory,
                                  prefetch=prefetch, quantized_base=quantized_base,
                                  segment_layers=k, stream=stream)
            peak, host, kept = p.peak, p.host_peak if stream else p.host, p.kept
            if layers_only:
                peak = p.pool + p.kept + p.rebuilt
        elif layers_only:
            held, rebuilt = segment_bytes(layers, B, S, dtype, k)
            peak, host, kept = sum(held) + _rebuilt_peak(held, rebuilt), 0, 0
        else:
            peak = step_peak("min_memory", layers, V, B, S, dtype, path=path,
                             train_weights=train_weights, quantized_base=quantized_base,
                             segment_layers=k).peak
            host = kept = 0
        if peak > room:
            continue
        secs = _segment_seconds(layers, V, B, S, dtype, k, host_memory, offload,
                                train_weights, link, rates, lora, stream)
        if best is None or secs < best.seconds * (1 - 1e-12):
            best = SegmentChoice(k, secs, peak, host, kept)
    if best is None:
        where = (f"{format_bytes(host_memory) if host_memory is not None else 'uncapped'} host "
                 "memory" if offload else "no offload")
        raise ValueError(
            f"segment_layers: no k in 1..{len(layers)} fits min_memory's "
            f"{'layer bytes on the device' if layers_only else 'step'} into "
            f"{format_bytes(room)} of device memory at B={B}, S={S} ({where}); the device "
            f"terms of the top layer's backward bind: shorten the sequence")
    return best


def longest_sequence_segments(layers: Sequence[LayerDims], V: int, B: int, dtype,
                              device_memory: int, weights: str, *, offload: bool = True,
                              host_memory: Optional[int] = None, sequence_parallel: int = 1,
                              path: str = "cuda", limit: int = 1 << 26, headroom: int = 0,
                              shard: int = 1, expert_lora_rank: int = 0, quant: str = "nf4",
                              double_quant: bool = True, stream: bool = False) -> tuple:
    """(S, k): the longest sequence ``min_memory`` reaches in segments of k layers, over
    k in 1..len(layers), and the smallest k that reaches it: :func:`longest_sequence_offload`
    (``offload``; ``stream``: its streamed step), :func:`longest_sequence`, or with
    ``sequence_parallel`` N > 1 :func:`sp_longest_sequence` (S the whole sequence), for each
    k. (0, 1) if none fits."""
    layers = list(layers)
    if _check_stream(stream, "min_memory", "longest_sequence_segments") and \
            (not offload or sequence_parallel > 1):
        raise ValueError("longest_sequence_segments: stream=True streams offloaded inputs "
                         "on one GPU: pass offload=True and sequence_parallel=1 with it (the "
                         "sequence-parallel backward reads its inputs whole)")
    best = (0, 1)
    for k in range(1, len(layers) + 1):
        if sequence_parallel > 1:
            if weights == "qlora":
                raise ValueError("longest_sequence_segments: the plan has no QLoRA sequence-"
                                 "parallel model")
            n = sp_longest_sequence("min_memory", layers, V, B, sequence_parallel, dtype,
                                    device_memory, weights, path=path, offload=offload,
                                    host_memory=host_memory, limit=limit, headroom=headroom,
                                    shard=shard, expert_lora_rank=expert_lora_rank,
                                    segment_layers=k)
        elif offload:
            n = longest_sequence_offload("min_memory", layers, V, B, dtype, device_memory,
                                         host_memory, weights, path=path, limit=limit,
                                         headroom=headroom, shard=shard,
                                         expert_lora_rank=expert_lora_rank, quant=quant,
                                         double_quant=double_quant, segment_layers=k,
                                         stream=stream)
        else:
            n = longest_sequence("min_memory", layers, V, B, dtype, device_memory, weights,
                                 path=path, limit=limit, headroom=headroom, shard=shard,
                                 expert_lora_rank=expert_lora_rank, quant=quant,
                                 double_quant=double_quant, segment_layers=k)
        if n > best[0]:
            best = (n, k)
    return best


# ---- auto: the fastest setup that fits, over every way a layer can run ------------------------
# HF's layer as it is ("none"), under torch.utils.checkpoint ("torch"), and the fused presets.
AUTO_CHOICES = ("none", "torch", "fast", "balanced", "min_memory")
from .throughputs import Overheads  # noqa: E402


def layer_chunks(d: LayerDims, B: int, S: int, dtype, *, path: str = "cuda",
                 chunk_bytes: Optional[int] = None, chunk_rows: Optional[int] = None) -> int:
    """Token chunks of a fused layer's step (:func:`engine_chunks`) at ``chunk_rows`` rows a
    chunk, or at the engine's rows for the cap (:func:`layer_chunk_rows` at ``chunk_bytes`` or
    the setting's; on ``"cuda"`` at least ``_C.cuda_min_rows`` for :data:`CUDA_SMS`)."""
    if chunk_rows is None:
        if chunk_bytes is None:
            chunk_bytes = config.current().chunk_bytes
        chunk_rows = layer_chunk_rows(d, _dtype(dtype).itemsize, chunk_bytes,
                                      CUDA_SMS if path == "cuda" else 0)
    return engine_chunks(B, S, _check_chunk_rows(chunk_rows, "layer_chunks"))


def layer_seconds(preset: str, d: LayerDims, B: int, S: int, dtype, *, chunks: int = 1,
                  train_weights: bool = True, lora_rank: int = 0, expert_lora_rank: int = 0,
                  overheads: Optional[Overheads] = None,
                  attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                  attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                  matmul_tflops: float = MATMUL_TFLOPS) -> float:
    """One layer's step time in the plan's model (an ESTIMATE), for ``preset`` among
    :data:`AUTO_CHOICES`: the larger of its device time and its host time.

    Device: its FLOPs (forward, backward, the preset's recompute; ``none`` recomputes nothing,
    ``torch`` the whole forward) at the rates, and, for a fused preset over ``chunks`` > 1
    token chunks training the weights, the float32 sums of the weight gradients: ``chunks - 1``
    times (8 + e) bytes a weight at ``overheads.chunk_sum_gbytes_per_s``. Host: the issue time
    of ``chunks`` chunks (HF's layer: one; checkpointed: 4/3, its forward issued twice) at
    ``overheads.chunk_launch_seconds``, plus ``lora_chunk_launch_seconds`` each with LoRA
    (``lora_rank`` or ``expert_lora_rank`` > 0). ``overheads``: :class:`Overheads` (default:
    the constants in ``ckpt_ext.throughputs``, from the H200 profile)."""
    if preset not in AUTO_CHOICES:
        raise ValueError(f"layer_seconds: preset must be one of {', '.join(AUTO_CHOICES)}; got "
                         f"{preset!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"layer_seconds: chunks must be a positive int, got {chunks!r}")
    o = Overheads() if overheads is None else overheads
    rates = tuple(_check_rate(n, v) for n, v in (
        ("attention_fwd_tflops", attention_fwd_tflops),
        ("attention_bwd_tflops", attention_bwd_tflops), ("matmul_tflops", matmul_tflops)))
    lora = bool(lora_rank or expert_lora_rank)
    device = _layer_compute_seconds(preset, d, B, S, train_weights, *rates,
                                    lora_rank=lora_rank, expert_lora_rank=expert_lora_rank)
    fused = preset in _CHOICES
    n = chunks if fused else 1
    host_chunks = n if preset != "torch" else 4 / 3   # the re-run forward issues its kernels
    if fused and train_weights and n > 1:            # again: about a third of the layer's
        e = _dtype(dtype).itemsize
        params = d.hidden_size * (2 * d.num_heads + 2 * d.num_kv_heads) * d.head_dim \
            + d.ffn_parameters()
        device += (n - 1) * params * (8 + e) / (_check_rate(
            "chunk_sum_gbytes_per_s", o.chunk_sum_gbytes_per_s) * 1e9)
    host = host_chunks * (o.chunk_launch_seconds
                          + (o.lora_chunk_launch_seconds if lora else 0.0))
    return max(device, host)


# ---- the fused layer's chunk rows, chosen for time where memory allows -------------------------
@dataclass(frozen=True)
class ChunkChoice:
    """The chunk rule's choice for one fused preset (:func:`choose_chunk_rows`)."""

    rows: int           # token rows a chunk: the op's chunk_rows
    chunks: int         # the layer's token chunks at B, S (engine_chunks)
    seconds: float      # the preset's layers' time at them (layer_seconds, summed)
    peak: int           # the step's modelled peak with them (step_peak, the mix's saved bytes)
    fits: bool          # peak <= room; False: nothing fit, and rows are the cap's
    layer_seconds: tuple = ()   # each layer's time at them, in forward order
    cap_rows: int = 0   # the rows the byte cap gives (the most chunks the rule considers)


# Every chunk count up to this one is a candidate of the rule; past it the counts go 25% apart
# (and the cap's count is always one): at long sequences in small chunks (the CPU's 64 MiB cap
# gives a few hundred rows) the rule then weighs tens of counts, not thousands.
_EVERY_COUNT = 64


def _counts_to(n: int) -> list:
    """1 .. n, every count up to _EVERY_COUNT, then 25% apart, n included."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k = k + 1 if k < _EVERY_COUNT else max(k + 1, -(-k * 5 // 4))
    return out + [n]


def chunk_row_candidates(B: int, S: int, cap_rows: int) -> list:
    """The rows a chunk the chunk rule weighs, fewest chunks first: for each candidate count
    of chunks (:func:`_counts_to`, up to the cap's) the fewest rows that give it, from one chunk
    (B*S rows) to the count ``cap_rows`` (the cap's rows) gives, the most chunks. Whole
    sequences packed while one fits (counts up to B), then pieces of each sequence (B times a
    count)."""
    _check_chunk_rows(cap_rows, "chunk_row_candidates")
    out = {}
    if cap_rows >= S:                              # the cap's chunks hold whole sequences
        for c in _counts_to(engine_chunks(B, S, cap_rows)):
            rows = -(-B // c) * S
            out.setdefault(engine_chunks(B, S, rows), rows)
    else:
        for c in _counts_to(B):                    # whole sequences
            rows = -(-B // c) * S
            out.setdefault(engine_chunks(B, S, rows), rows)
        for k in _counts_to(-(-S // cap_rows))[1:]:   # pieces of every sequence
            rows = max(-(-S // k), cap_rows)
            out.setdefault(engine_chunks(B, S, rows), rows)
    return [out[n] for n in sorted(out)]


def _flat_throughputs(overheads: Optional[Overheads], **rates):
    """A Throughputs of one rate per kind for every S and row count (the plan's scalar rate
    keywords), with ``overheads``."""
    from .throughputs import Rate, Throughputs
    kinds = {"attention_fwd_tflops": "attention_forward",
             "attention_bwd_tflops": "attention_backward", "matmul_tflops": "matmul"}
    return Throughputs(tuple(Rate(kinds[k], _check_rate(k, v)) for k, v in rates.items()),
                       {}, "the plan's rates", Overheads() if overheads is None else overheads)


def choose_chunk_rows(preset: str, layers: Sequence[LayerDims], V: int, B: int, S: int, dtype,
                      *, room: Budget, saved: Optional[int] = None, path: str = "cuda",
                      train_weights: bool = True, lora_rank: int = 0,
                      expert_lora_rank: int = 0, chunk_bytes: Optional[int] = None,
                      quantized_base: bool = False, throughputs=None,
                      strict: bool = False) -> ChunkChoice:
    """The chunk rule: the token rows a chunk of the fused layers running ``preset`` (one of
    "fast", "balanced", "min_memory"), for time where memory allows.

    One chunk (the whole batch, B*S rows) when the step fits ``room`` with it; else, of the
    candidate rows (:func:`chunk_row_candidates`: from one chunk down to the rows of the byte
    cap, ``chunk_bytes`` or the setting's, which on ``"cuda"`` are at least
    ``_C.cuda_min_rows`` of :data:`CUDA_SMS`), the fastest whose step fits, by the plan's time
    model (:func:`layer_seconds` of each layer at :func:`engine_chunks` chunks, the attention
    at ``throughputs``' rates for query chunks of those rows, :meth:`Throughputs.rate`; of
    equal times, the fewer chunks); when none fits, the cap's rows (``fits`` False).

    The step fits when its modelled peak (:func:`step_peak` with ``chunk_rows``) is at most
    ``room`` bytes (an int or "20GiB"). ``saved``: the bytes the step's layers keep when they
    are a mix (``patch_llama``'s policy, or ``auto``'s choice: each at its preset); the peak is
    then step_peak's less its own layers' saved bytes plus these (the working set of this
    preset's backward on top of the mix's saved bytes). ``throughputs``: a
    :class:`ckpt_ext.throughputs.Throughputs` (None: ``default_throughputs()``), with its
    overheads; ``strict``: the attention backward's strict rate. ``quantized_base``,
    ``lora_rank``, ``expert_lora_rank``, ``train_weights``, ``path``: :func:`step_peak` and
    :func:`layer_seconds`.

    Who calls it: ``patch_llama`` at each training forward (cached per shape) when no
    ``chunk_bytes`` is pinned (``ckpt_ext.config.chunk_bytes_pinned``) and a budget is known
    (``activation_budget``, or on CUDA the device's memory less the model state and headroom),
    for ``auto``'s choice and for fixed presets alike; :func:`choose_auto`; the plan CLI."""
    if preset not in _CHOICES:
        raise ValueError(f"choose_chunk_rows: preset must be one of {', '.join(_CHOICES)} (the "
                         f"fused presets, whose layer runs in token chunks); got {preset!r}")
    if path not in _PATHS:
        raise ValueError(f"choose_chunk_rows: path must be 'cuda' or 'cpu', got {path!r}")
    _check_shape_args(B, S)
    layers = list(layers)
    if not layers:
        raise ValueError("choose_chunk_rows: layers must not be empty")
    limit = parse_bytes(room, "choose_chunk_rows: room")
    if saved is not None and (isinstance(saved, bool) or not isinstance(saved, int)
                              or saved < 0):
        raise ValueError(f"choose_chunk_rows: saved must be a non-negative int of bytes or "
                         f"None, got {saved!r}")
    if chunk_bytes is None:
        chunk_bytes = config.current().chunk_bytes
    if throughputs is None:
        from .throughputs import default_throughputs
        throughputs = default_throughputs()
    dt = _dtype(dtype)
    cap_rows = layer_chunk_rows(_widest(layers), dt.itemsize, chunk_bytes,
                                CUDA_SMS if path == "cuda" else 0)
    own = sum(layer_bytes(preset, x, B, S, dt) for x in layers)
    lora = {"lora_rank": lora_rank, "expert_lora_rank": expert_lora_rank}
    times = {}

    def peak_of(rows):
        p = step_peak(preset, layers, V, B, S, dt, path=path, train_weights=train_weights,
                      chunk_bytes=chunk_bytes, quantized_base=quantized_base,
                      chunk_rows=rows).peak
        return p if saved is None else p - own + saved

    def seconds_of(rows):
        n = engine_chunks(B, S, rows)
        rates = throughputs.step_time_kwargs(S, rows if n > 1 else None, strict)
        per = []
        for x in layers:
            if x not in times:
                times[x] = layer_seconds(preset, x, B, S, dt, chunks=n,
                                         train_weights=train_weights,
                                         overheads=throughputs.overheads, **lora, **rates)
            per.append(times[x])
        times.clear()
        return tuple(per)

    def choice(rows, peak, fits):
        per = seconds_of(rows)
        return ChunkChoice(rows, engine_chunks(B, S, rows), sum(per), peak, fits, per, cap_rows)

    candidates = chunk_row_candidates(B, S, cap_rows)
    one = candidates[0]
    peak = peak_of(one)
    if peak <= limit:
        return choice(one, peak, True)
    best = None
    for rows in candidates[1:]:
        peak = peak_of(rows)
        if peak > limit:
            continue
        c = choice(rows, peak, True)
        if best is None or c.seconds < best.seconds * (1 - 1e-12):
            best = c
    if best is None:
        return choice(cap_rows, peak_of(cap_rows), False)
    return best


@dataclass(frozen=True)
class AutoChoice:
    """``auto``'s choice (:func:`choose_auto`)."""

    presets: tuple      # one per layer, in forward order, among AUTO_CHOICES
    seconds: float      # the layers' estimated step time (the head left out: the same in all)
    saved: int          # the layers' saved bytes
    peak: int           # the step's modelled peak (step_peak of the mix; 0 under a budget)
    chunks: tuple       # the fused layers' token chunks (1 for HF's layers)
    # the fused layers' chunk_rows by the chunk rule (choose_chunk_rows; None: the cap's rows,
    # and for HF's layers), and each layer's time in the model, in forward order
    rows: tuple = ()
    layer_seconds: tuple = ()


def choose_auto(layers: Sequence[LayerDims], V: int, B: int, S: int, dtype, *,
                room: Optional[int] = None, budget: Optional[Budget] = None,
                path: str = "cuda", train_weights: bool = True, lora_rank: int = 0,
                expert_lora_rank: int = 0, chunk_bytes: Optional[int] = None,
                overheads: Optional[Overheads] = None, quantized_base: bool = False,
                attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                matmul_tflops: float = MATMUL_TFLOPS, chunk_rule: Optional[bool] = None,
                throughputs=None) -> AutoChoice:
    """``patch_llama(policy="auto")``'s choice: one of :data:`AUTO_CHOICES` per layer (HF's
    layer and its checkpointed run for dense layers only) with the least estimated time
    (:func:`layer_seconds`, each fused layer at its :func:`layer_chunks`), among the mixes
    that fit; of equal times, the fewest saved bytes.

    Exactly one of ``room`` and ``budget``: ``room`` bytes for the step's peak above its start
    (the device less the model state and the headroom): the mix's saved bytes plus the largest
    working set of the setups it uses (each :func:`step_peak` less its layers' saved bytes);
    or ``budget`` (``activation_budget``: an int or "20GiB") for the layers' saved bytes alone.
    Solved per working-set bound as a multiple-choice knapsack over (bytes, seconds), keeping
    the Pareto front (exact: a larger room never gives a slower choice). Raises ValueError
    naming the smallest budget or room that fits when none does (every layer
    ``min_memory``). ``quantized_base``: QLoRA's dequantized weights in the working sets
    (:func:`step_peak`).

    The chunk rows (``chunk_rule``; None: on unless ``chunk_bytes`` is given or the setting
    is pinned, ``ckpt_ext.config.chunk_bytes_pinned``; off, every fused layer at the cap's
    rows): in a ``room`` each fused preset may run at any of the chunk rule's candidate rows
    (:func:`chunk_row_candidates`), its working set and time at them (:func:`step_peak` with
    ``chunk_rows``; :func:`layer_seconds` at ``throughputs``' rates for those query rows, None:
    these rates for every row count, with ``overheads``), so that per working-set bound each
    preset runs its fastest rows within it: still exact and monotone. Then each fused preset
    of the mix gets :func:`choose_chunk_rows`'s rows within the whole room, the mix's saved
    bytes given, where they are no slower (of equal times: one chunk, or fewer). Under a
    ``budget`` the presets are chosen at the cap's chunks, and the rule's rows are taken where
    the budget holds the mix's saved bytes and the preset's working set together."""
    if (room is None) == (budget is None):
        raise ValueError("choose_auto: give exactly one of room (bytes for the step's peak) "
                         "and budget (bytes for the layers' saved activations)")
    _check_shape_args(B, S)
    layers = list(layers)
    if not layers:
        return AutoChoice((), 0.0, 0, 0, ())
    dt = _dtype(dtype)
    limit = parse_bytes(budget) if budget is not None else int(room)
    dense = not any(x.moe for x in layers)
    options = AUTO_CHOICES if dense else _CHOICES
    lora = {"lora_rank": lora_rank, "expert_lora_rank": expert_lora_rank}
    rates = {"attention_fwd_tflops": attention_fwd_tflops,
             "attention_bwd_tflops": attention_bwd_tflops, "matmul_tflops": matmul_tflops}
    if chunk_rule is None:
        chunk_rule = chunk_bytes is None and not config.chunk_bytes_pinned()
    tp = throughputs if throughputs is not None else _flat_throughputs(overheads, **rates)
    peak_kw = dict(path=path, train_weights=train_weights, chunk_bytes=chunk_bytes,
                   quantized_base=quantized_base)
    saved = [[_saved_bytes(p, x, B, S, dt, train_weights) for p in options] for x in layers]
    own = [sum(row[k] for row in saved) for k in range(len(options))]
    # Each option's variants: (working set, rows (None: the cap's), chunks, seconds per layer).
    # HF's layers and, without the rule or under a budget, the fused presets: one, at the cap;
    # with the rule in a room, a fused preset's rows that no other of them beats in both
    # working set and time (chunk_row_candidates)
    cap_chunks = [layer_chunks(x, B, S, dt, path=path, chunk_bytes=chunk_bytes) for x in layers]
    variants = []
    for k, p in enumerate(options):
        if chunk_rule and budget is None and p in _CHOICES:
            variants.append(_pareto(_chunk_variants(p, layers, V, B, S, dt, own[k], tp, lora,
                                                    peak_kw)))
            continue
        secs = tuple(layer_seconds(p, x, B, S, dt, chunks=n, train_weights=train_weights,
                                   overheads=overheads, **lora, **rates)
                     for x, n in zip(layers, cap_chunks))
        if budget is not None:
            w = 0
        else:
            setup = "hf_gc+fused" if p == "torch" else p
            w = step_peak(setup, layers, V, B, S, dt, **peak_kw).peak - own[k]
        n = cap_chunks if p in _CHOICES else [1] * len(layers)
        variants.append([(w, None, tuple(n), secs)])
    best = None
    for bound in sorted({v[0] for vs in variants for v in vs}):   # the largest working set
        # each option at its fastest variant within the bound (of equal times, fewer chunks)
        pick = {}
        for k, vs in enumerate(variants):
            within = [v for v in vs if v[0] <= bound]
            if within:
                pick[k] = min(within, key=lambda v: (sum(v[3]), max(v[2])))
        cap = limit - bound
        front = [(0, 0.0, ())]                    # (bytes, seconds, choices): Pareto front
        for i in range(len(layers)):
            cand = sorted((b + saved[i][k], t + v[3][i], ch + (k,))
                          for b, t, ch in front for k, v in pick.items()
                          if b + saved[i][k] <= cap)
            front, least = [], math.inf
            for b, t, ch in cand:
                if t < least * (1 - 1e-12):
                    front.append((b, t, ch))
                    least = t
            if not front:
                break
        if not front:
            continue
        b, t, ch = front[-1]     # the fastest; of equal times, the fewest bytes
        key = (t, b)
        if best is None or key < best[0]:
            best = (key, ch, {k: pick[k] for k in set(ch)})
    if best is None:
        k = options.index("min_memory")
        need = own[k] + (min(v[0] for v in variants[k]) if budget is None else 0)
        what = "activation_budget" if budget is not None else "room for the step"
        raise ValueError(
            f"auto: {what} of {format_bytes(limit)} is below the smallest that fits: {need} "
            f"bytes ({format_bytes(need)}), every one of the {len(layers)} decoder layers "
            f"'min_memory', at B={B}, S={S}, {str(dt)[6:]}. Shorten the sequence or the batch")
    (t, b), ch, used = best
    presets = tuple(options[k] for k in ch)
    per = [used[k][3][i] for i, k in enumerate(ch)]
    chunks = [used[k][2][i] for i, k in enumerate(ch)]
    rows = [used[k][1] for k in ch]
    works = {k: b + v[0] for k, v in used.items()}
    if chunk_rule:
        # the rule within the whole room (the mix's saved bytes given): one chunk where it
        # fits, else the fastest rows; taken where it is no slower than the choice above
        # (in a room the choice is exact, so this only breaks ties toward fewer chunks; under
        # a budget the budget's bytes beyond the saved ones hold the chunks' working set)
        for k in used:
            p = options[k]
            if p not in _CHOICES:
                continue
            c = choose_chunk_rows(p, layers, V, B, S, dt, room=limit, saved=b, throughputs=tp,
                                  **peak_kw, **lora)
            mine = [i for i, q in enumerate(ch) if q == k]
            if not c.fits or any(c.layer_seconds[i] > per[i] * (1 + 1e-12) for i in mine):
                continue
            for i in mine:
                rows[i], chunks[i], per[i] = c.rows, c.chunks, c.layer_seconds[i]
            works[k] = c.peak
        t = sum(per)
    peak = 0 if budget is not None else max(works.values())
    return AutoChoice(presets, t, b, peak, tuple(chunks), tuple(rows), tuple(per))


def _chunk_variants(preset, layers, V, B, S, dt, own, tp, lora, peak_kw) -> list:
    """(working set, rows, chunks per layer, seconds per layer) of a fused preset at each of
    the chunk rule's candidate rows (:func:`chunk_row_candidates`), ``own`` its layers' saved
    bytes."""
    chunk_bytes = peak_kw["chunk_bytes"]
    if chunk_bytes is None:
        chunk_bytes = config.current().chunk_bytes
    path = peak_kw["path"]
    cap_rows = layer_chunk_rows(_widest(layers), dt.itemsize, chunk_bytes,
                                CUDA_SMS if path == "cuda" else 0)
    out = []
    for rows in chunk_row_candidates(B, S, cap_rows):
        n = engine_chunks(B, S, rows)
        kw = tp.step_time_kwargs(S, rows if n > 1 else None)
        by_dims = {}
        secs = tuple(by_dims.setdefault(x, layer_seconds(
            preset, x, B, S, dt, chunks=n, train_weights=peak_kw["train_weights"],
            overheads=tp.overheads, **lora, **kw)) for x in layers)
        work = step_peak(preset, layers, V, B, S, dt, chunk_rows=rows, **peak_kw).peak - own
        out.append((work, rows, (n,) * len(layers), secs))
    return out


def _pareto(variants: list) -> list:
    """The variants no other beats in both working set and total time (of equal ones, the
    first: the fewest chunks)."""
    kept, least = [], math.inf
    for _, total, _, v in sorted((v[0], sum(v[3]), i, v) for i, v in enumerate(variants)):
        if total < least:
            kept.append(v)
            least = total
    return kept


# ---- sequence parallelism (Ulysses inside the fused layer) ------------------------------------
# N GPUs share each sequence of S tokens: each holds S/N consecutive tokens of every layer's
# input and residuals, and the attention runs over the whole sequence for Hq/N query heads
# after an all-to-all of q, k, v (each rank sends head block j of its tokens to rank j), its out
# and lse going back the same way. What the engine exchanges (the sequence_parallel code of
# the fused layer, csrc/ulysses.h and csrc/layer_math.cpp's sp_forward / sp_backward), per layer
# and rank, as tensors of the rank's T = B*S/N tokens (KV heads repeated to N when Hkv < N):
#
#   forward            q, k, v to heads; out (model dtype) and lse (fp32) back to tokens
#   backward           k, v to heads; per query chunk q, out, lse and dout to heads and dq back
#   (balanced, fast)   to tokens; dk, dv back to tokens (fast's kept q, k, v are exchanged too)
#   backward           k, v to heads; per query chunk q to heads, the recomputed out and lse back
#   (min_memory)       to tokens (their exchanged copies kept for the backward), dout to heads,
#                      dq back; dk, dv back: the same bytes as the other presets
#
# An all-to-all keeps 1/N of each tensor on the rank: it sends (N-1)/N of it and receives as
# much. The attention goes in head rounds (sp_round_kv_heads: r KV heads per rank at a time, as
# many as fit the chunk cap, at least one) with the queries in the rank's token chunks: only a
# round's k, v and their fp32 gradient sums span the gathered sequence, and the backward holds
# every round's at once (as many values as the rank's own k, v), walking the chunks as the
# sequence-tiled layer does.
SP_LINK_GBYTES_PER_S = 300.0   # GB/s per GPU and direction: an assumption (NVLink 4 is 450 GB/s
# per direction per H100; an all-to-all reaches less), not a measurement


def _check_sp(d: LayerDims, N: int) -> None:
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise ValueError(f"sequence_parallel must be a positive int, got {N!r}")
    if d.router_logits and d.router_aux_loss == "exact" and N > 1:
        raise NotImplementedError(f"sequence_parallel {N} with router logits: the engine "
                                  "refuses router_aux_loss='exact' under sequence_parallel (plan "
                                  "with --router-aux-loss fused or --no-router-logits)")
    if d.num_heads % N:
        raise ValueError(f"sequence_parallel {N}: num_attention_heads {d.num_heads} must be "
                         f"divisible by it (each GPU attends with Hq/N query heads)")
    if d.num_kv_heads % N and N % d.num_kv_heads:
        raise ValueError(f"sequence_parallel {N}: num_key_value_heads {d.num_kv_heads} must be "
                         f"a multiple or a divisor of it")


def sp_kv_repeats(num_kv_heads: int, N: int) -> int:
    """KV head repeats before the exchange (the engine's ``ulysses::kv_repeats``): 1 when N
    divides the KV heads, else N / Hkv."""
    return 1 if num_kv_heads % N == 0 else N // num_kv_heads


def sp_local_tokens(S: int, N: int) -> int:
    """Tokens per GPU of a sequence of S under sequence parallelism of N (S divisible by N)."""
    if S % N:
        raise ValueError(f"sequence_parallel {N}: the sequence length {S} must be divisible by "
                         f"it (pad the sequence to a multiple of {N})")
    return S // N


def sp_exchange_bytes(preset: str, d: LayerDims, B: int, S: int, N: int, dtype) -> tuple:
    """(forward, backward) bytes one GPU sends (and receives as much) in one layer's
    all-to-alls under sequence parallelism of N, S the whole sequence (see above)."""
    _check_sp(d, N)
    if preset not in _CHOICES:
        raise ValueError(f"sp_exchange_bytes: preset must be one of {_CHOICES}, got {preset!r}")
    T = B * sp_local_tokens(S, N)
    e = _dtype(dtype).itemsize
    Q = d.num_heads * d.head_dim
    K = d.num_kv_heads * sp_kv_repeats(d.num_kv_heads, N) * d.head_dim
    lse = 4 * d.num_heads
    fwd = T * (e * (Q + 2 * K) + e * Q + lse)                 # q, k, v; out, lse
    bwd = T * (e * (Q + 2 * K) + 2 * e * Q + lse              # q, k, v, out, dout, lse
               + e * (Q + 2 * K))                              # dq, dk, dv
    return fwd * (N - 1) // N, bwd * (N - 1) // N


def sp_round_kv_heads(d: LayerDims, B: int, S_local: int, N: int, e: int,
                      chunk_bytes: int) -> int:
    """KV heads per GPU in one attention round (the engine's ``sp_round_kv_heads``): the most,
    a divisor of the KV heads per GPU, whose k, v, dk, dv over the gathered sequence fit the
    chunk cap at the compute width (at least one)."""
    rep = sp_kv_repeats(d.num_kv_heads, N)
    kv = d.num_kv_heads * rep // N
    per = B * S_local * N * d.head_dim * 4 * max(4, e)
    r = kv
    while r > 1 and (kv % r or r * per > chunk_bytes):
        r -= 1
    return r


@dataclass(frozen=True)
class SpPeak:
    """One GPU's share of a sequence-parallel training step (see :func:`sp_step_peak`)."""

    saved: int      # kept for backward when the forward ends, on this GPU (host included)
    peak: int       # device: the most allocated at once above the step's start
    phase: str      # where the peak is
    host: int       # host pool bytes (offload), 0 without
    round: int      # one query chunk's exchanged tensors (beside the tiled layer's chunk)
    whole: int = 0  # the whole tensors of the top layer's attention backward (dy, dx, every
    # round's k, v over the gathered sequence and their fp32 gradient sums)
    kept: int = 0   # saved bytes of the layers past the host cap, kept on the device


def sp_step_peak(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, N: int,
                 dtype, *, path: str = "cuda", train_weights: bool = True,
                 offload: bool = False, host_limit: Optional[int] = None, prefetch: int = 1,
                 chunk_bytes: Optional[int] = None, segment_layers: int = 1) -> SpPeak:
    """A GPU's step under sequence parallelism of N (S the whole sequence): :func:`step_peak`
    (or :func:`offload_step_peak`) of its S/N tokens with the whole tensors of the engine's
    sequence-parallel backward in place of the tiled layer's, or, when more, the top layer's
    attention backward of that path: the layers' saved bytes (less the offloaded ones plus
    the prefetch pool), the cos/sin tables, the whole dy and dx, every round's k, v over the
    gathered sequence and their fp32 gradient sums (the rank's own k, v are dropped once
    exchanged), the weights' gradients when trained, the tiled layer's attention chunk and
    one query chunk's exchanged tensors: a round's q, out, dout and dq as exchanged with the
    exchange's send and receive buffers, ``min_memory``'s exchanged q and out of every round
    (kept from the recompute) and on CUDA the Triton dQ's fp32 accumulator of a piece (a
    model from the code, not measured on a GPU). N = 1 is :func:`step_peak` itself.
    ``segment_layers`` k > 1: segments of k layers (:func:`segment_bytes`), their first
    inputs saved (or offloaded) and k - 1 rebuilt inputs beside the top layer's
    backward (the rebuild runs the layers' forward exchanges: :func:`sp_step_time`)."""
    if setup not in OFFLOAD_SETUPS:
        raise ValueError(f"sp_step_peak: setup must be one of {', '.join(OFFLOAD_SETUPS)} "
                         f"(sequence parallelism is the fused layer's); got {setup!r}")
    _check_segment_layers(segment_layers, setup, "sp_step_peak")
    layers = list(layers)
    for d in layers:
        _check_sp(d, N)
    S_l = sp_local_tokens(S, N)
    seg = {"segment_layers": segment_layers}
    if offload:
        base = offload_step_peak(setup, layers, V, B, S_l, dtype, path=path,
                                 train_weights=train_weights, host_limit=host_limit,
                                 prefetch=prefetch, **seg)
        ref = step_peak(setup, layers, V, B, S_l, dtype, path=path, train_weights=train_weights,
                        **seg)
        saved, host, peak, phase = ref.saved, base.host, base.peak, "see the offload table"
    else:
        ref = step_peak(setup, layers, V, B, S_l, dtype, path=path, train_weights=train_weights,
                        **seg)
        saved, host, peak, phase = ref.saved, 0, ref.peak, ref.phase
    kept = base.kept if offload else 0
    if N == 1:
        return SpPeak(saved, peak, phase, host, 0, 0, kept)
    e = _dtype(dtype).itemsize
    if chunk_bytes is None:
        chunk_bytes = config.current().chunk_bytes
    T = B * S_l
    d = max(layers, key=lambda x: x.hidden_size * x.intermediate_size)
    H, D = d.hidden_size, d.head_dim
    Q = d.num_heads * D
    rep = sp_kv_repeats(d.num_kv_heads, N)
    K = d.num_kv_heads * rep * D
    presets = [setup] * len(layers)
    held = sum(_call_bytes(layers, presets, B, S_l, dtype, segment_layers))
    if offload:   # the pool, the kept calls and the rebuilt inputs (offload_step_peak)
        held += base.pool - base.host + base.rebuilt
    elif segment_layers > 1:
        held += _rebuilt_peak(*segment_bytes(layers, B, S_l, dtype, segment_layers, setup))
    rope = 2 * S_l * D * e
    # dy, dx; every round's k, v over the gathered sequence and their fp32 gradient sums
    whole = e * T * 2 * H + T * 2 * K * (e + max(4, e))
    # the tiled layer's (step_peak at S/N): dy, dx, k and v (kept by fast), fp32 dk/dv sums
    tiled = e * T * 2 * H + (0 if setup == "fast" else 2 * e * T * d.num_kv_heads * D) \
        + 8 * T * d.num_kv_heads * D
    grads = e * H * (2 * Q + 2 * d.num_kv_heads * D + 3 * d.intermediate_size) \
        if train_weights else 0
    rows = min(T, layer_chunk_rows(d, e, chunk_bytes, CUDA_SMS if path == "cuda" else 0))
    if train_weights and rows < T and e < 4:   # the layer's gradients summed in fp32
        grads += (4 - e) * H * (2 * Q + 2 * d.num_kv_heads * D + 3 * d.intermediate_size)
    r = sp_round_kv_heads(d, B, S_l, N, e, chunk_bytes)
    rounds = d.num_kv_heads * rep // (N * r)
    rnd = 6 * e * rows * Q // rounds                      # a round's q, out, dout, dq, buffers
    if setup == "min_memory":
        rnd += 2 * e * rows * Q                           # every round's exchanged q, out
    if path == "cuda":
        rnd += 4 * rows * Q // (rounds * N)               # the Triton dQ's fp32 accumulator
    chunk = e * rows * (3 * H + 6 * Q)                    # the tiled layer's attention chunk
    if path == "cpu":   # the CPU backward's fp32 copies of a kv head's keys and values and
        chunk += 16 * T * K   # its dk, dv sums, (T, D) each, per head
    attn = held + rope + whole + grads + chunk + rnd
    peak = peak + max(0, whole - tiled)
    if attn > peak:
        return SpPeak(saved, attn, "top layer attention backward (a query chunk of a round)",
                      host, rnd, whole, kept)
    return SpPeak(saved, peak, phase, host, rnd, whole, kept)


def sp_longest_sequence(setup: str, layers: Sequence[LayerDims], V: int, B: int, N: int,
                        dtype, device_memory: int, weights: str, *, path: str = "cuda",
                        offload: bool = False, host_memory: Optional[int] = None,
                        limit: int = 1 << 26, headroom: int = 0, shard: int = 1,
                        expert_lora_rank: int = 0, segment_layers: int = 1) -> int:
    """The longest whole sequence S (a multiple of N, at most ``limit`` tokens per GPU) whose
    per-GPU step (:func:`sp_step_peak`, with ``segment_layers``) fits ``device_memory`` less
    ``headroom`` with the model state (sharded ``shard`` ways; ``expert_lora_rank``:
    :func:`model_state_bytes`); 0 if none."""
    _check_segment_layers(segment_layers, setup, "sp_longest_sequence")
    room = device_memory - headroom - model_state_bytes(layers, V, dtype, weights, shard=shard,
                                                        expert_lora_rank=expert_lora_rank)

    def fits(s_local):
        return sp_step_peak(setup, layers, V, B, s_local * N, N, dtype, path=path,
                            train_weights=weights == "full", offload=offload,
                            host_limit=host_memory,
                            segment_layers=segment_layers).peak <= room

    return N * _longest_fitting(fits, limit)


def sp_step_time(setup: str, layers: Sequence[LayerDims], V: int, B: int, S: int, N: int,
                 dtype, *, train_weights: bool = True, lora_rank: int = 0,
                 expert_lora_rank: int = 0, segment_layers: int = 1,
                 link_gbytes_per_s: float = SP_LINK_GBYTES_PER_S,
                 attention_fwd_tflops: float = ATTENTION_FWD_TFLOPS,
                 attention_bwd_tflops: float = ATTENTION_BWD_TFLOPS,
                 matmul_tflops: float = MATMUL_TFLOPS) -> tuple:
    """(compute seconds, all-to-all seconds) of one GPU's step under sequence parallelism of N,
    ESTIMATED: :func:`step_flops` of the whole sequence divided by N (each GPU's tokens for the
    projections and the head, its Hq/N heads over all S for the attention) at the given rates,
    and every layer's exchanged bytes (:func:`sp_exchange_bytes`, forward and backward) at
    ``link_gbytes_per_s`` (GB/s a direction), not overlapped with compute (the engine waits
    for each exchange). ``lora_rank`` / ``expert_lora_rank`` / ``segment_layers``:
    :func:`step_flops`; with segments each rebuilt layer's forward exchanges its q, k, v, out
    and lse once more."""
    f = step_flops(setup, layers, V, B, S, train_weights=train_weights, lora_rank=lora_rank,
                   expert_lora_rank=expert_lora_rank, segment_layers=segment_layers)
    compute = (f["attention_forward"] / (attention_fwd_tflops * 1e12)
               + f["attention_backward"] / (attention_bwd_tflops * 1e12)
               + f["matmul"] / (matmul_tflops * 1e12)) / N
    sent = sum(sum(sp_exchange_bytes(setup, d, B, S, N, dtype)) for d in layers) \
        + sum(sp_exchange_bytes(setup, d, B, S, N, dtype)[0]
              for d in _rebuilt_layers(layers, segment_layers))
    return compute, sent / (link_gbytes_per_s * 1e9)


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


if __name__ == "__main__":   # python -m ckpt_ext.plan: the CLI (ckpt_ext.plan_cli)
    from ckpt_ext.plan_cli import main
    sys.exit(main())
