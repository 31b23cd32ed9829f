"""A decoder layer's projections as the fused op takes them: plain ``nn.Linear``, or a PEFT
LoRA ``Linear`` around one; a bitsandbytes 4-bit or 8-bit layer, bare or under PEFT's LoRA
wrappers for them, in the same way with a placeholder for its weight that
``ckpt_ext.hf.quantized`` fills with the dequantized weight around each pass of the op.

A LoRA projection computes ``x W^T + b + scaling * dropout(x) A^T B^T`` (PEFT's
``lora.Linear``); the op's four slots per projection are ``weight, bias, lora_A, lora_B``,
``scaling`` goes into its ``lora_scaling`` list and, in training, the dropout probability into
``lora_dropout`` (the op draws its own masks from a seed and replays them in backward, so
PEFT's ``nn.Dropout`` module itself never runs on the fused path). Read at every call, since PEFT can wrap,
merge, disable or switch adapters at any time; what cannot be fused comes back as a reason
string and the layer runs HF's (and PEFT's) own forward.

Phi-3 fuses projections: ``qkv_proj`` holds q, k and v, ``gate_up_proj`` gate and up, as row
blocks of one weight. ``read_layer_projections`` hands the op's slots the blocks (views whose
backward concatenates the blocks' gradients into the fused weight's), PEFT's one ``lora_A``
of the fused module to each of its projections and one dropout stream (``lora_streams``), so
that the op computes exactly what the fused module with its one adapter computes.
"""
from __future__ import annotations

import functools
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from . import quantized


class Projection(NamedTuple):
    weight: Tensor
    bias: Optional[Tensor]
    lora_A: Optional[Tensor] = None
    lora_B: Optional[Tensor] = None
    scaling: float = 0.0
    dropout: float = 0.0  # the adapter input's dropout probability in this (training) call


@functools.lru_cache(maxsize=None)
def _lora_linear_class():
    """peft's LoRA Linear class, or None without peft (imported on first use)."""
    try:
        from peft.tuners.lora import Linear
    except ImportError:
        return None
    return Linear


def _lora_quantized_classes() -> tuple:
    """peft's LoRA wrappers of bitsandbytes' 4-bit and 8-bit layers (those peft defines: it
    defines them only once bitsandbytes is installed)."""
    if "bitsandbytes" not in sys.modules:
        return ()
    try:
        from peft.tuners.lora import bnb as lora_bnb
    except ImportError:
        return ()
    return tuple(c for c in (getattr(lora_bnb, n, None) for n in ("Linear4bit", "Linear8bitLt"))
                 if c is not None)


def _base_weight(base: nn.Module) -> Union[Tensor, str]:
    """The base layer's weight for the op's slot: a plain nn.Linear's weight, a placeholder
    for a bitsandbytes layer's dequantized one (ckpt_ext.hf.quantized), or why neither."""
    if type(base) is nn.Linear:
        return base.weight
    if quantized.is_quantized_base(base):
        if torch.compiler.is_compiling():
            return (f"a {type(base).__name__} read under torch.compile: the fused layers "
                    "dequantize bitsandbytes weights in eager mode, which a layer gets when "
                    "it holds bitsandbytes layers at patch time (quantize, then patch)")
        problem = quantized.quantized_problem(base)
        return problem if problem else quantized.placeholder(base)
    return f"a LoRA layer around a {type(base).__name__} (other quantised base layers)"


def read_projection(module: nn.Module, training: bool) -> Union[Projection, str]:
    """The tensors of one projection, or why the fused op cannot compute it. A bitsandbytes
    4-bit or 8-bit base (bare or under PEFT LoRA) gives a placeholder weight
    (ckpt_ext.hf.quantized)."""
    if type(module) is nn.Linear:
        return Projection(module.weight, module.bias)
    if quantized.is_quantized_base(module):
        weight = _base_weight(module)
        return weight if isinstance(weight, str) else Projection(weight, module.bias)
    lora = _lora_linear_class()
    if lora is None or (type(module) is not lora
                        and type(module) not in _lora_quantized_classes()):
        return (f"a {type(module).__name__}, not a plain nn.Linear, a bitsandbytes 4-bit or "
                "8-bit linear layer or a PEFT LoRA layer around one (other quantised and "
                "adapter layers compute more than the fused op reads)")
    base = module.base_layer
    weight = _base_weight(base)
    if isinstance(weight, str):
        return weight
    if getattr(module, "fan_in_fan_out", False):
        return "a LoRA layer with fan_in_fan_out=True"
    if module.disable_adapters:
        if module.merged:
            return "a LoRA layer whose adapters are disabled while merged (PEFT unmerges them)"
        return Projection(weight, base.bias)
    if module.merged:
        return Projection(weight, base.bias)
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return Projection(weight, base.bias)
    if len(active) > 1:
        return f"a LoRA layer with several active adapters ({', '.join(active)})"
    name = active[0]
    if module.use_dora.get(name, False):
        return "a LoRA layer with DoRA (use_dora=True)"
    if name in getattr(module, "lora_variant", {}):
        return f"a LoRA layer with a LoRA variant ({type(module.lora_variant[name]).__name__})"
    dropout = module.lora_dropout[name]
    if type(dropout) is nn.Dropout:
        p = float(dropout.p) if training else 0.0
        if p >= 1.0:
            return "a LoRA layer with lora_dropout=1.0 (its adapter input is always zero)"
    elif type(dropout) is nn.Identity:
        p = 0.0
    else:
        return f"a LoRA layer whose lora_dropout is a {type(dropout).__name__}, not nn.Dropout"
    a, b = module.lora_A[name], module.lora_B[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear:
        return "a LoRA layer whose adapter is not a pair of nn.Linear"
    if a.bias is not None or b.bias is not None:
        return "a LoRA layer with lora_bias=True"
    return Projection(weight, base.bias, a.weight, b.weight, float(module.scaling[name]), p)


# ---- fused projections (Phi-3's qkv_proj and gate_up_proj) -----------------------------------

# A fused module's path (relative to the decoder layer) -> the op's projections its output rows
# hold, in order: qkv_proj's rows are q, k, v (Hq*D, Hkv*D, Hkv*D), gate_up_proj's gate, up
# (I, I; HF chunks its output in two).
FUSED_MODULES = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def split_rows(t: Optional[Tensor], sizes: Tuple[int, ...]) -> list:
    """``t``'s row blocks of ``sizes`` as views (Nones for t None). One ``split_with_sizes``:
    its backward concatenates the blocks' gradients into one tensor of t's shape (zeros for a
    block without one), where slicing each block would give each its own zero-filled gradient
    of t's whole size to sum; torch.compile and FSDP2 see an ordinary ATen view op."""
    if t is None:
        return [None] * len(sizes)
    return list(t.split(list(sizes), 0))


def _split_weight(w: Tensor, sizes: Tuple[int, ...]) -> list:
    """A fused module's weight's row blocks (``split_rows``); for a quantized base's
    placeholder, placeholders of its row blocks (filled with views of one dequantization)."""
    if not quantized.is_placeholder(w):
        return split_rows(w, sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [quantized.row_placeholder(w, a, a + n) for a, n in zip(starts, sizes)]


def fused_row_sizes(layer: nn.Module, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> Dict[str, Tuple[int, ...]]:
    """The fused modules of ``layer`` (``FUSED_MODULES``) -> their row blocks; a ValueError
    when a module's out_features does not match (read from the module: a PEFT wrapper has
    them too)."""
    sizes = {}
    for path in FUSED_MODULES:
        parent, name = path.split(".")
        mod = getattr(layer, parent)._modules.get(name)
        if mod is None:
            continue
        out = getattr(mod, "out_features", None)
        if name == "qkv_proj":
            blocks = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        else:
            blocks = (out // 2, out // 2) if out else (0, 0)
        if out is None or out != sum(blocks) or 0 in blocks:
            want = " + ".join(map(str, blocks))
            raise ValueError(f"{path} has out_features {out}, not {want} "
                             f"({', '.join(FUSED_MODULES[path])})")
        sizes[path] = blocks
    return sizes


def read_layer_projections(layer: nn.Module, training: bool, projections: Sequence[str],
                           fused: Dict[str, Tuple[int, ...]]
                           ) -> Union[Tuple[Dict[str, Projection], List[int]], str]:
    """The op's projections (``projections``: its order, ckpt_ext.blocks.PROJECTIONS) of a
    layer, read from plain or fused modules (``fused``: ``fused_row_sizes``), and each one's
    LoRA dropout stream; or why one cannot be fused. A fused module's projections take its
    weight's (bias', lora_B's) row blocks through ``split_rows``, its lora_A itself (so that
    the gradients of the shared A add up), its scaling and dropout; they share one stream,
    that of its first projection, so that its dropout is one mask over the shared input, as
    PEFT's single dropout module."""
    found: Dict[str, Projection] = {}
    streams = list(range(len(projections)))
    for path, sizes in fused.items():
        parent, name = path.split(".")
        proj = read_projection(getattr(layer, parent)._modules[name], training)
        if isinstance(proj, str):
            return f"{path} is {proj}"
        parts = FUSED_MODULES[path]
        for part, w, b, lb in zip(parts, _split_weight(proj.weight, sizes),
                                  split_rows(proj.bias, sizes), split_rows(proj.lora_B, sizes)):
            found[part] = proj._replace(weight=w, bias=b, lora_B=lb)
            streams[projections.index(part)] = projections.index(parts[0])
    for path in projections:
        if path in found:
            continue
        parent, name = path.split(".")
        proj = read_projection(getattr(layer, parent)._modules[name], training)
        if isinstance(proj, str):
            return f"{path} is {proj}"
        found[path] = proj
    return found, streams
