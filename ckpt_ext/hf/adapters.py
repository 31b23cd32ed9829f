"""A decoder layer's projections as the fused op takes them: plain ``nn.Linear``, or a PEFT
LoRA ``Linear`` around one.

A LoRA projection computes ``x W^T + b + scaling * dropout(x) A^T B^T`` (PEFT's
``lora.Linear``); the op's four slots per projection are ``weight, bias, lora_A, lora_B``,
``scaling`` goes into its ``lora_scaling`` list and, in training, the dropout probability into
``lora_dropout`` (the op draws its own masks from a seed and replays them in backward, so
PEFT's ``nn.Dropout`` module itself never runs on the fused path). Read at every call, since PEFT can wrap,
merge, disable or switch adapters at any time; what cannot be fused comes back as a reason
string and the layer runs HF's (and PEFT's) own forward.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch.nn as nn
from torch import Tensor


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


def read_projection(module: nn.Module, training: bool) -> Union[Projection, str]:
    """The tensors of one projection, or why the fused op cannot compute it."""
    if type(module) is nn.Linear:
        return Projection(module.weight, module.bias)
    lora = _lora_linear_class()
    if lora is None or type(module) is not lora:
        return (f"a {type(module).__name__}, not a plain nn.Linear or a PEFT LoRA Linear "
                "(quantised and other adapter layers compute more than the fused op reads)")
    base = module.base_layer
    if type(base) is not nn.Linear:
        return f"a LoRA layer around a {type(base).__name__} (quantised base layers)"
    if getattr(module, "fan_in_fan_out", False):
        return "a LoRA layer with fan_in_fan_out=True"
    if module.disable_adapters:
        if module.merged:
            return "a LoRA layer whose adapters are disabled while merged (PEFT unmerges them)"
        return Projection(base.weight, base.bias)
    if module.merged:
        return Projection(base.weight, base.bias)
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return Projection(base.weight, base.bias)
    if len(active) > 1:
        return f"a LoRA layer with several active adapters ({', '.join(active)})"
    name = active[0]
    if module.use_dora.get(name, False):
        return "a LoRA layer with DoRA (use_dora=True)"
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
    return Projection(base.weight, base.bias, a.weight, b.weight, float(module.scaling[name]),
                      p)
