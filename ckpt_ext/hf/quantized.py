"""QLoRA: projections whose base weight is quantized by bitsandbytes, dequantized per layer pass.

A bitsandbytes ``Linear4bit`` (nf4 or fp4, with or without double quantization, any
blocksize; ``LinearNF4`` / ``LinearFP4`` alike) or a frozen ``Linear8bitLt``
(``has_fp16_weights=False``), bare or as the base layer of PEFT's LoRA wrappers for them, has
no dense weight for the fused op to read. Its projection's weight slot gets a *placeholder*
instead: a tensor that holds no memory except while the layer runs. :class:`Transient` fills
the placeholders of one layer call with the dequantized weights (one dequantization per module,
shared by the pass's token chunks; a fused module's projections take row views of it) just
before the op's forward and frees them after it; an autograd pre-hook on the op's node fills
them again just before its backward (where the op recomputes) and a post-hook frees them when
that backward is done. The op saves the placeholder (a leaf that needs no gradient), never the
dequantized tensor, so between the passes no layer holds a dequantized weight, and only one
layer's exist at a time. An outer recompute (HF gradient checkpointing) calls the patched
forward again, which dequantizes again. Under torch.compile such a layer runs in eager mode
(ckpt_ext.hf.patch ``_eager_call``: a graph break), since the placeholders' fills and the
node hooks are eager-mode operations.

What the dequantized weight is:

* 4-bit: bitsandbytes' own ``dequantize_4bit`` of the module's packed data and quant state
  (its CUDA kernels on a GPU, two of them with double quantization), cast to the compute dtype:
  what its ``MatMul4Bit`` multiplies with in forward and backward (on the CPU bit for bit).
* 8-bit: ``CB * SCB / 127`` in the compute dtype, bitsandbytes' formula for CPU training
  (``MatMul8bitFp``) and for its CUDA backward. On CUDA bitsandbytes' training forward is
  LLM.int8() instead (the input quantized per row, outlier columns above the threshold chosen
  over the whole call), which a token-chunked layer cannot reproduce: the fused layer computes
  with the dequantized weight there too (docs/hf.md, "QLoRA").
* The compute dtype is the layer's: the autocast dtype under autocast, else the hidden states'
  dtype (bitsandbytes' ``compute_dtype`` casts the input to it instead; with fp32 hidden
  states and a bf16 ``bnb_4bit_compute_dtype`` outside autocast the fused base projection is
  computed in fp32, more precisely than bitsandbytes does).
* A ``Linear4bit`` whose weight an eval forward without grad repacked for bitsandbytes' AVX512-BF16
  CPU kernel (``quant_state.packing_format_for_cpu``) is read through bitsandbytes' inverse of
  that layout, into a copy (the module is left as it is): its codes, and the block scales the
  repacking rounded to bf16, which is what the module holds from then on.

Nothing here imports bitsandbytes: a module can only be one of its layers once it is imported.
"""
from __future__ import annotations

import copy
import sys
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["is_quantized_base", "quantized_problem", "placeholder", "row_placeholder",
           "is_placeholder", "dequantize", "Transient", "compute_dtype"]

_SOURCE = "_ckpt_ext_dequantize"  # a placeholder's (module, (start, stop) or None)
_PINNED = "_ckpt_ext_pinned"      # a placeholder's backwards in progress (Transient.attach)
_PLACEHOLDERS = "_ckpt_ext_placeholders"  # a quantized module's placeholders, by rows


def _bnb_classes() -> Tuple[tuple, tuple]:
    """bitsandbytes' 4-bit and 8-bit linear classes, or empty tuples while it is not
    imported."""
    bnb = sys.modules.get("bitsandbytes")
    nn_mod = getattr(bnb, "nn", None) if bnb is not None else None
    if nn_mod is None:
        return (), ()
    four = tuple(c for c in (getattr(nn_mod, n, None) for n in ("Linear4bit", "LinearNF4",
                                                                  "LinearFP4")) if c)
    eight = tuple(c for c in (getattr(nn_mod, "Linear8bitLt", None),) if c)
    return four, eight


def is_quantized_base(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes 4-bit or 8-bit linear layer (of any state)."""
    four, eight = _bnb_classes()
    return type(module) in four + eight


def quantized_problem(module: nn.Module) -> Optional[str]:
    """Why the fused op cannot dequantize this bitsandbytes layer (``is_quantized_base``), or
    None. The reason completes "... is <reason>"."""
    four, _ = _bnb_classes()
    name = type(module).__name__
    w = module._parameters.get("weight")
    if w is None:
        return f"a {name} without a weight"
    if hasattr(w, "ds_id") or type(w).__name__ == "DTensor" or hasattr(w, "_local_tensor"):
        return (f"a {name} whose weight is sharded (DeepSpeed ZeRO-3 or FSDP2): quantized base "
                "weights are not gathered by the fused layers; train QLoRA with DDP or on one "
                "device")
    if type(module) in four:
        state = getattr(w, "quant_state", None) or getattr(module, "quant_state", None)
        if state is None or not getattr(w, "bnb_quantized", True):
            return (f"a {name} that is not quantized yet (bitsandbytes quantizes it when it "
                    "is moved to its device)")
        shape = tuple(state.shape)
        if shape != (module.out_features, module.in_features):
            return (f"a {name} whose quantized weight has shape {shape}, not (out_features, "
                    f"in_features) = ({module.out_features}, {module.in_features})")
        return None
    state = module.state
    if state.has_fp16_weights:
        return (f"a {name} with has_fp16_weights=True (its weight trains in 16 bits and is "
                "quantized again at every call): load it frozen (BitsAndBytesConfig("
                "load_in_8bit=True) does)")
    cb = state.CB if state.CB is not None else getattr(w, "CB", None)
    scb = state.SCB if state.SCB is not None else getattr(w, "SCB", None)
    if cb is None or scb is None:
        return (f"a {name} that is not quantized yet (bitsandbytes quantizes it when it is "
                "moved to its device)")
    if tuple(cb.shape) != (module.out_features, module.in_features):
        return (f"a {name} whose int8 weight has shape {tuple(cb.shape)}, not (out_features, "
                f"in_features) = ({module.out_features}, {module.in_features})")
    return None


def _unpacked_for_cpu(data: Tensor, state) -> Tuple[Tensor, object]:
    """The standard packed data and a quant state for a 4-bit weight that bitsandbytes repacked
    for its AVX512-BF16 CPU kernel (``state.packing_format_for_cpu``), the module left as it
    is. bitsandbytes' inverse restores the codes' layout; its block scales are those of the
    repacked state (dequantized when it was double-quantized, rounded to bf16, kept as one
    row of blocks per output row), which the inverse would quantize again: they are laid out
    back here as plain float32 scales (no double quantization) instead."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
    scales = state.absmax  # (in_features // blocksize, out_features), bf16
    st = copy.copy(state)
    st.original_nested = False  # keep the inverse from quantizing the scales again
    q, st = _convert_weight_packed_for_cpu_inverse(data, st)
    st.absmax = scales.t().reshape(-1).float()
    st.nested = False
    return q, st


def dequantize(module: nn.Module, dtype: torch.dtype) -> Tensor:
    """The dense (out_features, in_features) weight of a bitsandbytes layer that
    ``quantized_problem`` passed, in ``dtype``, computed as bitsandbytes computes the weight
    its training matmuls use (see the module docstring)."""
    four, _ = _bnb_classes()
    w = module.weight
    if type(module) in four:
        from bitsandbytes.functional import dequantize_4bit
        state = w.quant_state if w.quant_state is not None else module.quant_state
        data = w.data
        if getattr(state, "packing_format_for_cpu", False):
            data, state = _unpacked_for_cpu(data, state)
        return dequantize_4bit(data, state).to(dtype)
    state = module.state
    cb = state.CB if state.CB is not None else w.CB
    scb = state.SCB if state.SCB is not None else w.SCB
    return cb.to(dtype).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))


# ---- placeholders -----------------------------------------------------------------------------

def _placeholder_of(module: nn.Module, rows, device) -> Tensor:
    """The one placeholder of ``module``'s weight rows ``rows`` (None: all), made on first use
    and the same tensor at every later call: a forward run again (a segment's rebuild, an
    outer torch.utils.checkpoint's recompute) saves the very tensor that the op's backward
    pre-hook fills (``Transient.attach``). The base is frozen and its dequantization the same
    at every fill, so calls in flight together may share it."""
    made = module.__dict__.setdefault(_PLACEHOLDERS, {})
    t = made.get(rows)
    if t is None or t.device != device:
        t = torch.empty(0, device=device)
        setattr(t, _SOURCE, (module, rows))
        made[rows] = t
    return t


def placeholder(module: nn.Module) -> Tensor:
    """An empty tensor standing for ``module``'s dequantized weight in the op's weight slot;
    ``Transient`` fills it around the op's passes (one per module: ``_placeholder_of``)."""
    return _placeholder_of(module, None, module.weight.device)


def row_placeholder(t: Tensor, start: int, stop: int) -> Tensor:
    """A placeholder for rows [start, stop) of placeholder ``t``'s weight (a fused module's
    projection, ckpt_ext.hf.adapters.split_rows)."""
    module, rows = getattr(t, _SOURCE)
    if rows is not None:
        start, stop = rows[0] + start, rows[0] + stop
    return _placeholder_of(module, (start, stop), t.device)


def is_placeholder(t: Optional[Tensor]) -> bool:
    return t is not None and hasattr(t, _SOURCE)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the fused layer computes its projections in for hidden states ``x``: the
    autocast dtype under autocast (as the op's Autocast kernel chooses it), else x's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return x.dtype


class Transient:
    """The placeholders among one layer call's weights, filled for each pass and freed after.

    ``with Transient(weights, dtype) as t: out = op(...)`` fills them for the forward and frees
    them on exit; ``t.attach(out)`` (inside or after) hooks the op's autograd node so that its
    backward fills them first and frees them when done. Without placeholders both are no-ops.
    """

    def __init__(self, weights: Iterable[Optional[Tensor]], dtype: torch.dtype):
        self.holders: List[Tensor] = [w for w in weights if is_placeholder(w)]
        self.dtype = dtype

    def __bool__(self) -> bool:
        return bool(self.holders)

    def fill(self) -> None:
        dense: Dict[int, Tensor] = {}
        for p in self.holders:
            if getattr(p, _PINNED, 0):   # filled for a backward that is running (attach)
                continue
            module, rows = getattr(p, _SOURCE)
            if id(module) not in dense:
                with torch.no_grad():
                    dense[id(module)] = dequantize(module, self.dtype)
            w = dense[id(module)]
            p.data = w if rows is None else w[rows[0]:rows[1]]

    def free(self) -> None:
        # one element (a NaN) expanded to the filled shape: no memory held, the shape kept for
        # torch.utils.checkpoint, which compares the shapes a recompute saved with the
        # forward's after the recompute has freed them; a read between passes shows
        for p in self.holders:
            if not getattr(p, _PINNED, 0):
                p.data = torch.full((), float("nan"), dtype=p.dtype,
                                    device=p.device).expand(p.shape)

    def __enter__(self) -> "Transient":
        if self.holders:
            self.fill()
        return self

    def __exit__(self, *exc) -> None:
        if self.holders:
            self.free()

    def attach(self, out: Union[Tensor, tuple]) -> None:
        """Fill before, free after the backward of the node that made ``out`` (the op's output,
        or its first element)."""
        y = out[0] if isinstance(out, (tuple, list)) else out
        node = y.grad_fn if self.holders else None
        if node is None:
            return
        node.register_prehook(lambda grad_outputs: self._pin(+1))
        node.register_hook(lambda grad_inputs, grad_outputs: self._pin(-1))

    def _pin(self, step: int) -> None:
        """The node's backward starting (+1: fill, then pin) or done (-1: unpin, then free).
        While pinned, the holders stay filled: a forward that runs inside that backward (an
        outer torch.utils.checkpoint's recompute, which the op's unpacking triggers after
        this pre-hook) neither dequantizes them again nor frees them under the op. A backward
        that raises leaves them pinned (filled) until the layer's next backward ends."""
        if step > 0:
            self.fill()
        for p in self.holders:
            setattr(p, _PINNED, max(0, getattr(p, _PINNED, 0) + step))
        if step < 0:
            self.free()
