"""Whether the fused op can stand in for an HF decoder layer's modules, and the op's tensors read
from a checked layer: what ckpt_ext.hf.patch asks of every layer, and ckpt_ext.hf.moe of the
dense part of a mixture-of-experts layer (the MoE block itself is checked and read there).

The structure checks (``structure_problem``) run at patch time and at every training forward:
submodules and parameters the op does not compute, projections wrapped by other libraries,
norms that are not the family's RMSNorm, instance-level forwards and forward hooks the op would
bypass. ``layer_tensors`` reads the op's weight slots, LoRA scalings, dropout probabilities and
fused projections' dropout streams of a layer those checks passed.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch.nn as nn

from ..blocks import PROJECTIONS, WEIGHT_SLOTS
from . import zero
from .adapters import FUSED_MODULES, read_layer_projections, read_projection
from .families import Family, layer_norms, norm_eps

__all__ = ["structure_problem", "hook_problem", "foreign_forward", "hf_collector",
           "capture_inert", "layer_tensors", "ATTENTIONS_FIX"]

_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# Phi-3: fused qkv_proj / gate_up_proj (ckpt_ext.hf.adapters), activation_fn, and residual
# dropouts (fused while their p is 0)
_RESID_DROPOUTS = ("resid_attn_dropout", "resid_mlp_dropout")
_LAYER_CHILDREN = {"self_attn", "mlp", *_RESID_DROPOUTS}  # and the family's norms (needed)
_ATTN_CHILDREN = set(_ATTN_LINEARS) | {"rotary_emb", "qkv_proj"}  # and the family's q/k norms
_MLP_CHILDREN = set(_MLP_LINEARS) | {"act_fn", "activation_fn", "gate_up_proj"}
# transformers 5.x installs this forward hook on layers and attentions once any output_* is
# requested; it records only while its collector is active (see capture_inert).
_HF_CAPTURE_HOOK = "output_capturing_hook"


def structure_problem(layer: nn.Module, family: Family, hooks: bool = False,
                       projections: bool = True) -> Optional[str]:
    """Why the fused op cannot stand in for this dense layer's modules, or None. Checked at patch
    time and at every training forward, where it also catches projections wrapped or switched
    after patching (PEFT) and, with ``hooks``, forward hooks on submodules that the fused op
    would not run. ``projections=False`` (patch time) leaves out what PEFT can change later
    (adapters, dropout, merging): those make a call delegate, never a patch fail."""
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    needed = {"self_attn", "mlp"} | family.modules
    if attn is None or mlp is None or not needed <= set(layer._modules):
        return f"it lacks one of {', '.join(sorted(needed))}"
    for parent, expected, where in ((layer, _LAYER_CHILDREN | needed, ""),
                                    (attn, _ATTN_CHILDREN | set(family.qk_norms), "self_attn."),
                                    (mlp, _MLP_CHILDREN, "mlp.")):
        extra = set(parent._modules) - expected
        if extra:
            return ("it has submodules the fused op does not compute: "
                    f"{', '.join(where + e for e in sorted(extra))}")
    for parent, where in ((layer, ""), (attn, "self_attn."), (mlp, "mlp.")):
        own = [name for name, _ in parent.named_parameters(recurse=False)]
        if own:   # e.g. attention sinks: tensors the fused op would leave out of the math
            return ("it has parameters the fused op does not compute with: "
                    f"{', '.join(where + n for n in own)}")
    for parent, names, where in ((attn, _ATTN_LINEARS, "self_attn"), (mlp, _MLP_LINEARS, "mlp")):
        fused = [p.split(".")[1] for p in FUSED_MODULES if p.startswith(where + ".")
                 and p.split(".")[1] in parent._modules]
        parts = {p.split(".")[1] for f in fused for p in FUSED_MODULES[f"{where}.{f}"]}
        missing = [n for n in names if (n in parts) == (n in parent._modules)]
        if missing:
            return (f"{where} has {'both' if parts & set(parent._modules) else 'neither'} "
                    f"{', '.join(f'{where}.{n}' for n in missing)} and a fused projection "
                    "holding them")
    for name in _RESID_DROPOUTS:
        drop = layer._modules.get(name)
        if drop is not None and (type(drop) is not nn.Dropout or drop.p > 0):
            return (f"{name} is {drop!r}: the fused op has no residual dropout (set "
                    "config.resid_pdrop = 0.0)")
    for path in (*PROJECTIONS, *FUSED_MODULES) if projections else ():
        parent, name = path.split(".")
        if name in layer._modules[parent]._modules:
            proj = read_projection(layer._modules[parent]._modules[name], layer.training)
            if isinstance(proj, str):
                return f"{path} is {proj}"
    for name, norm in layer_norms(layer, family).items():
        if (not type(norm).__name__.endswith("RMSNorm") or norm_eps(norm) is None
                or set(dict(norm.named_parameters())) != {"weight"}):
            return f"{name} is a {type(norm).__name__}, not the family's RMSNorm"
    q_norm, k_norm = family.qk_norms
    if (attn._modules.get(q_norm) is None) != (attn._modules.get(k_norm) is None):
        return f"self_attn has only one of {q_norm}/{k_norm}"
    for name, mod in layer.named_modules():
        if not name:
            continue
        if foreign_forward(mod):
            return (f"{name} has an instance-level forward (accelerate offload hooks, another "
                    "patch, or transformers recording outputs), which the fused op would bypass")
        problem = hook_problem(layer, name, mod) if hooks else None
        if problem:
            return problem
    return None


ATTENTIONS_FIX = ("ask for output_attentions only in forwards that do not train, or use policy "
                   "'none' for the layers whose attentions you need")


def hook_problem(layer: nn.Module, name: str, module: nn.Module) -> Optional[str]:
    """Why forward hooks on ``module`` (a submodule of ``layer``, at ``name``) keep the fused op
    from standing in for it, naming the hooks' owner and the fix; None when the fused op may
    skip them: transformers' output capturing while it does not record attentions, and
    DeepSpeed ZeRO-3's gathering hooks inside a ZeRO-3 leaf layer (whose own hooks gather all
    of its parameters, ckpt_ext.hf.zero)."""
    found = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    if not found:
        return None
    capture = [h for h in found if getattr(h, "__name__", "") == _HF_CAPTURE_HOOK]
    deepspeed = [h for h in found if zero.is_deepspeed_hook(h)]
    own = [h for h in found if not any(h is x for x in capture + deepspeed)]
    if capture and not capture_inert():
        return ("output_attentions is being recorded (transformers' output-capturing hook on "
                f"{name}), and the fused op never forms attention weights: {ATTENTIONS_FIX}")
    if deepspeed and not zero.is_leaf(layer):
        return (f"DeepSpeed ZeRO-3's hooks on {name} gather its parameters only when it is "
                "called, and the fused op does not call it: call the layer through its model "
                "(patch_llama makes the fused layers ZeRO-3 leaf modules at the model's "
                "forward, so that the layer's own hooks gather everything), or mark them "
                "yourself with deepspeed.utils.set_z3_leaf_modules(model, "
                f"[{type(layer).__name__}])")
    if own:
        names = ", ".join(sorted({getattr(h, "__qualname__", type(h).__name__) for h in own}))
        return (f"{name} has forward hooks of your own ({names}), which the fused op would "
                "not run: register them on the decoder layer itself (they then run around "
                "the fused call), or remove them for training")
    return None


def foreign_forward(module: nn.Module) -> bool:
    """An instance-level ``forward`` other than the class's own bound to the module and other
    than ours (a patched layer's forward says ``ckpt_ext_patched``)."""
    own = module.__dict__.get("forward")
    if own is None or getattr(own, "ckpt_ext_patched", False):
        return False
    return not (getattr(own, "__self__", None) is module
                and getattr(own, "__func__", None) is type(module).forward)


@functools.lru_cache(maxsize=None)
def hf_collector():
    """The context that transformers' output-capturing hooks record into (None where absent).
    Imported on first use, so that ``import ckpt_ext`` never imports transformers."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def capture_inert() -> bool:
    """Whether transformers' output-capturing hooks (installed for good once any output_* is
    asked for) are not recording attentions now."""
    collector = hf_collector()
    if collector is None:
        return False
    active = collector.get()
    return not (active and "attentions" in active)


def layer_tensors(layer: nn.Module, family: Family, fused: Optional[dict] = None
                   ) -> Union[str, Tuple[list, list, list, list]]:
    """The op's ``weights``, ``lora_scaling``, ``lora_dropout`` and ``lora_streams`` lists for
    a layer whose structure was checked (``family``: its norm map; ``fused``: its fused
    projections' row blocks, ``LayerRecord.fused``), or why a projection cannot be fused (its
    adapters are read here, once per call). The lists are empty without adapters / without
    dropout / without fused projections' dropout."""
    named = {f"{slot}.weight": norm.weight for slot, norm in layer_norms(layer, family).items()}
    scaling, dropout, lora = [], [], False
    fused = fused or {}
    read = read_layer_projections(layer, layer.training, PROJECTIONS, fused)
    if isinstance(read, str):
        return read
    projs, streams = read
    for path in PROJECTIONS:
        proj = projs[path]
        named[f"{path}.weight"], named[f"{path}.bias"] = proj.weight, proj.bias
        named[f"{path}.lora_A"], named[f"{path}.lora_B"] = proj.lora_A, proj.lora_B
        scaling.append(proj.scaling)
        dropout.append(proj.dropout)
        lora = lora or proj.lora_A is not None
    dropout = dropout if any(p > 0 for p in dropout) else []
    return ([named.get(slot) for slot in WEIGHT_SLOTS], scaling if lora else [], dropout,
            streams if dropout and fused else [])
