"""Mixture-of-experts decoder layers of transformers 5 (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
as the fused op takes them.

Their attention is the LLaMA-shaped one the other families have; their MLP is a sparse MoE
block ``mlp`` with a top-k router ``mlp.gate`` (``weight`` (E, H)), the routed experts
``mlp.experts`` (``gate_up_proj`` (E, 2I, H), the gate's I rows first, and ``down_proj``
(E, H, I); an activation ``act_fn``) and, in Qwen2-MoE, a shared expert ``mlp.shared_expert``
(a dense gated MLP) behind a sigmoid gate ``mlp.shared_expert_gate`` (1, H). The op computes
that block itself (``num_experts_per_tok > 0``, csrc/moe_math.h): its router scores are HF's
softmax in float32, then top-k, then (Mixtral always; the others by ``norm_topk_prob``) the k
weights divided by their sum; the shared expert goes into the op's dense MLP slots.

Everything of a layer but the MoE block is checked and read as for a dense layer
(ckpt_ext.hf.layer_checks), on a view of the layer whose ``mlp`` is the shared expert, or a stand-in
without weights where there is none; this module checks the MoE block and fills the op's MoE
slots. Layers whose ``mlp`` is dense (Qwen2/3-MoE's ``mlp_only_layers`` and the layers between
``decoder_sparse_step``) are dense layers to the op.

With ``output_router_logits=True`` (the config's, or one forward's) transformers collects every
router's logits through a hook on the router module, which a fused layer never calls: the
fused layer asks the op for them instead (its ``router_logits`` output, (B*S, E) in HF's dtype,
differentiable) and adds them to transformers' collection in the layer's place
(``record_router_logits``), so the model's ``router_logits``, HF's ``load_balancing_loss_func``
on them and its gradient through the router are HF's. The fused LM head adds that loss as HF's
forward does (ckpt_ext.hf.lm_head).

That collection is a (B*S, E) tensor per MoE layer kept until the loss (and HF's softmax of
each beside it while the loss runs): 2 x 48 x 128 x 2 bytes a token for Qwen3-30B-A3B in
bf16. With ``patch_llama(..., router_aux_loss="fused")`` the fused head's training forward has
each fused MoE layer return instead the (3, E) float32 statistics the loss is made of (the op's
``router_stats``: HF's attention_mask-weighted top-k counts, softmax sums and token count),
and ``load_balancing_loss`` makes HF's value of their sums over the layers; the gradient of the
softmax sums reaches the router through the op's backward, which recomputes the logits. The
output's ``router_logits`` is then None; calls that do not go through the fused head's loss
(no labels, generation) return the logits as HF does (under sequence parallelism the
statistics, below).

PEFT LoRA on the expert weights (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])``, one or both) wraps ``mlp.experts`` in one ``ParamWrapper`` per
targeted weight (nested), which folds ``W_e + s B_e A_e`` into the weight inside its own
forward. The fused op is given the base weights, each wrapper's active factors in PEFT's
layouts (``lora_A`` (r E, in), ``lora_B`` (out, r E), B_e = lora_B.view(out, r, E)[:, :, e])
in the slots ``mlp.experts.<weight>.lora_A`` / ``lora_B`` and the two scalings
(``expert_lora_scaling``), and computes the low-rank terms per expert block itself
(csrc/moe_math.h), never the folded weight. Read at every call (``layer_tensors``): disabled or
merged adapters give the base weight alone, as PEFT's forward computes it; several active
adapters on a wrapper, or a dropout module on one (PEFT refuses lora_dropout, lora_bias and DoRA
there), make the call run PEFT's own forward with the reason.

Under ``sequence_parallel=`` a layer routes the rank's own tokens (the op's MoE MLP is
per token); the load-balancing loss there needs ``router_aux_loss="fused"``, whose statistics
are summed over the group (``RouterStats``; calls that run HF's head, without labels or grad,
collect them too: ckpt_ext.hf.lm_head); the exact mode's logits are refused (``SP_REFUSAL``),
and so is a bare model called with output_router_logits (``SP_BARE_REFUSAL``).

Refused by name (``REFUSED`` for model types, and settings; patch_llama raises PatchRefused):
Mixtral's ``router_jitter_noise`` in training, OLMoE's ``clip_qkv``, quantized experts,
wrappers on the experts other than PEFT's ParamWrapper, routers and expert layouts other than
the ones above (set after patching, the first two make the layers run HF's forward).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn as nn

from ..blocks import WEIGHT_SLOTS
from . import layer_checks
from .families import (ACTIVATIONS, MOE_FAMILIES, MoeFamily, expert_wrappers,  # noqa: F401
                       is_moe_layer, moe_layer_options as layer_options, moe_shape as _shape)

__all__ = ["MOE_FAMILIES", "REFUSED", "ROUTER_STATS_KEY", "RouterStats", "aux_loss",
           "is_moe_layer", "layer_options", "layer_tensors", "load_balancing_loss",
           "record_router_logits", "recording_router_logits", "refusal",
           "router_stats_of_logits", "structure_problem"]


# MoE model types the op does not compute, and why.
REFUSED = {
    "gpt_oss": "gpt-oss's experts are transposed, interleave gate and up, carry biases and "
               "gate with (up + 1) * glu clamped at a limit, its router takes top-k before the "
               "softmax with a bias, and its attention has sinks and alternating windows; the "
               "fused op computes none of these",
    "glm4_moe": "GLM-4.5's router is a sigmoid with an expert-score correction bias, "
                "group-limited top-k and routed_scaling_factor, and its first layers are dense "
                "with a different width; the fused op's router has none of these",
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention and group-limited router are not "
                   "the fused op's",
    "qwen3_next": "Qwen3-Next's linear-attention layers are not the fused op's",
    "jamba": "Jamba's Mamba layers are not the fused op's",
}


def refusal(model_type: str) -> Optional[str]:
    """Why patch_llama does not fuse this MoE model type, or None."""
    why = REFUSED.get(model_type)
    return None if why is None else (
        f"model_type {model_type!r} is a mixture-of-experts model the fused op does not "
        f"compute: {why}. The fused MoE families are {', '.join(sorted(MOE_FAMILIES))}; train "
        "this one without patch_llama (HF gradient checkpointing)")


SP_REFUSAL = ("output_router_logits=True with sequence_parallel= and router_aux_loss='exact' is "
              "not implemented: each rank routes its own tokens, and HF's load-balancing loss "
              "of one rank's logits is not the whole sequence's; patch with "
              "router_aux_loss='fused' (the statistics are summed over the group) or train "
              "with output_router_logits=False")
SP_BARE_REFUSAL = ("output_router_logits=True with sequence_parallel= reached the decoder layers "
                   "outside the patched *ForCausalLM's forward (the bare model called "
                   "directly), which is what asks them for their router statistics "
                   "(router_aux_loss='fused'); each rank's logits alone would give one rank's "
                   "load-balancing loss, not the whole sequence's: call the *ForCausalLM, or "
                   "pass output_router_logits=False to the bare model")


# ---- the dense view -----------------------------------------------------------------------

class _NoMlp(nn.Module):
    """A weightless stand-in for the dense MLP of an MoE layer without a shared expert: the
    dense checks find a gated MLP there, and its slots are emptied again (layer_tensors)."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(1, 1, bias=False)
        self.up_proj = nn.Linear(1, 1, bias=False)
        self.down_proj = nn.Linear(1, 1, bias=False)
        self.act_fn = nn.SiLU()
        self.requires_grad_(False)


_NO_MLP = _NoMlp()


class _DenseView(nn.Module):
    """The layer as a dense layer: its own modules, with ``mlp`` the MoE block's shared expert
    (or _NO_MLP). Made per call (it shares the layer's modules and its training flag)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self._modules.update(layer._modules)
        shared = layer._modules["mlp"]._modules.get("shared_expert")
        self._modules["mlp"] = shared if shared is not None else _NO_MLP
        self.training = layer.training
        self._z3_leaf = getattr(layer, "_z3_leaf", False)  # ZeRO-3 leaf: the layer's own hooks


def _param_names(module: nn.Module) -> set:
    return {name for name, _ in module.named_parameters(recurse=False)}


def structure_problem(layer: nn.Module, family, hooks: bool, projections: bool
                      ) -> Optional[str]:
    """Why the fused op cannot stand in for this MoE layer (None if it can): the MoE block's
    structure, and the rest as ckpt_ext.hf.layer_checks checks a dense layer (on _DenseView)."""
    problem = layer_checks.structure_problem(_DenseView(layer), family, hooks=hooks,
                                       projections=projections)
    if problem:
        return problem
    mlp = layer._modules["mlp"]
    fam = next((f for f in MOE_FAMILIES.values() if f.block == type(mlp).__name__), None)
    if fam is None:
        return (f"mlp is a {type(mlp).__name__}, not one of the MoE blocks the fused op "
                f"computes ({', '.join(f.block for f in MOE_FAMILIES.values())})")
    expected = {"gate", "experts"} | ({"shared_expert", "shared_expert_gate"} if fam.shared
                                      else set())
    if set(mlp._modules) != expected:
        return (f"mlp has the submodules {sorted(mlp._modules)}, not {sorted(expected)} (a "
                "wrapped or replaced MoE block computes more than the fused op reads)")
    if _param_names(mlp):
        return f"mlp has parameters the fused op does not compute with: {sorted(_param_names(mlp))}"
    router = mlp._modules["gate"]
    if type(router).__name__ != fam.router or _param_names(router) != {"weight"} or router._modules:
        return (f"mlp.gate is a {type(router).__name__} with parameters "
                f"{sorted(_param_names(router))}, not {fam.router} with one weight (an unknown "
                "router type)")
    experts, wrappers = expert_wrappers(mlp._modules["experts"])
    problem = _wrappers_problem(wrappers)
    if problem:
        return problem
    if type(experts).__name__ != fam.experts:
        return (f"mlp.experts{'.base_layer' * len(wrappers)} is a {type(experts).__name__}, "
                f"not {fam.experts}: the fused op takes transformers' experts, bare or inside "
                "PEFT's LoRA ParamWrapper (target_parameters), no other wrapper")
    if _param_names(experts) != {"gate_up_proj", "down_proj"} or \
            set(experts._modules) - {"act_fn"}:
        return (f"mlp.experts has parameters {sorted(_param_names(experts))} and submodules "
                f"{sorted(experts._modules)}, not transformers 5's gate_up_proj, down_proj "
                "and act_fn")
    for name in ("gate_up_proj", "down_proj"):
        t = getattr(experts, name)
        if not t.is_floating_point():
            return (f"mlp.experts.{name} is {t.dtype}: quantized expert weights are not "
                    "computed by the fused op")
    if type(experts._modules.get("act_fn")).__name__ not in ACTIVATIONS:
        return (f"mlp.experts.act_fn is a {type(experts._modules.get('act_fn')).__name__}; the "
                "fused experts gate with SiLU or tanh-approximate GELU")
    if fam.shared:
        gate = mlp._modules["shared_expert_gate"]
        if type(gate) is not nn.Linear or gate.bias is not None:
            return (f"mlp.shared_expert_gate is a {type(gate).__name__}"
                    f"{' with a bias' if getattr(gate, 'bias', None) is not None else ''}, not "
                    "a plain nn.Linear without bias (adapters on the shared expert's gate are "
                    "not fused)")
    for name, mod in mlp.named_modules():
        if mod is mlp._modules.get("shared_expert") or name.startswith("shared_expert."):
            continue  # checked on the view
        where = f"mlp.{name}" if name else "mlp"
        if layer_checks.foreign_forward(mod):
            return (f"{where} has an instance-level forward (accelerate offload hooks, another "
                    "patch, or transformers recording outputs), which the fused op would bypass")
        if hooks:  # transformers' router-logits hook on mlp.gate is stood in for by the op
            problem = layer_checks.hook_problem(layer, where, mod)
            if problem:
                return problem
    return None


# ---- PEFT LoRA on the expert weights (LoraConfig(target_parameters=[...])) --------------------

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _param_wrapper_class():
    """peft's ParamWrapper class, or None without peft."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return None
    return ParamWrapper


def _wrappers_problem(wrappers: list) -> Optional[str]:
    """Why the fused op cannot compute the PEFT ParamWrappers around mlp.experts (None if it
    can): one per targeted expert weight, each PEFT's own class with a single adapter layout the
    op reads (layer_tensors reads which adapter is active at every call)."""
    cls = _param_wrapper_class()
    seen = set()
    for depth, w in enumerate(wrappers):
        where = "mlp.experts" + ".base_layer" * depth
        if cls is None or type(w) is not cls:
            return f"{where} is a {type(w).__name__}, not PEFT's LoRA ParamWrapper"
        name = w.parameter_name
        if name not in _EXPERT_WEIGHTS or name in seen:
            return (f"{where} is PEFT's ParamWrapper of {name!r}"
                    f"{' a second time' if name in seen else ''}: the fused op takes LoRA on "
                    "mlp.experts.gate_up_proj and mlp.experts.down_proj, once each")
        seen.add(name)
        if getattr(w, "fan_in_fan_out", False) or not getattr(w, "_did_swap_in_out_features",
                                                               False):
            return (f"{where} (PEFT LoRA on experts.{name}) reads the weight as (experts, in, "
                    "out) (fan_in_fan_out, or a transposed expert layout); the fused op takes "
                    "transformers 5's (experts, out, in)")
    return None


def _read_expert_lora(w: nn.Module, experts: int):
    """The active adapter of one ParamWrapper: (lora_A, lora_B, scaling), None when no adapter
    computes (disabled, merged into the base weight, or none active), or why it cannot be
    fused. Read at every call: PEFT can merge, disable or switch adapters at any time."""
    where = f"PEFT LoRA on mlp.experts.{w.parameter_name}"
    if w.disable_adapters:
        if w.merged:
            return f"{where} is disabled while merged (PEFT unmerges it)"
        return None
    if w.merged:
        return None
    active = [a for a in w.active_adapters if a in w.lora_A]
    if not active:
        return None
    if len(active) > 1:
        return (f"{where} has several active adapters ({', '.join(active)}); the fused op "
                "computes one")
    name = active[0]
    if w.use_dora.get(name, False):
        return f"{where} uses DoRA (use_dora=True)"
    if type(w.lora_dropout[name]) is not nn.Identity:
        return (f"{where} has a {type(w.lora_dropout[name]).__name__} as its lora_dropout: "
                "PEFT refuses dropout on expert parameters (its delta is folded into the "
                "weight) and the fused op computes none there")
    a, b = w.lora_A[name], w.lora_B[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear:
        return f"{where}: its adapter is not a pair of nn.Linear"
    if a.bias is not None or b.bias is not None:
        return f"{where} has lora_bias=True"
    if w.num_experts != experts or a.weight.shape[0] % experts:
        return (f"{where} has {w.num_experts} experts and lora_A {tuple(a.weight.shape)}, not "
                f"rank * {experts} rows")
    return a.weight, b.weight, float(w.scaling[name])


def _expert_lora(mlp: nn.Module, experts: int):
    """{weight name: (lora_A, lora_B, scaling)} of the experts' active adapters ({} without),
    or why they cannot be fused."""
    _, wrappers = expert_wrappers(mlp._modules["experts"])
    out = {}
    for w in wrappers:
        got = _read_expert_lora(w, experts)
        if isinstance(got, str):
            return got
        if got is not None:
            out[w.parameter_name] = got
    return out


def _collected() -> Optional[dict]:
    """What transformers' output-capturing hooks record into in this forward (None: nothing
    is being recorded, or transformers is absent)."""
    collector = layer_checks.hf_collector()
    return collector.get() if collector is not None else None


def recording_router_logits() -> bool:
    """Whether transformers is collecting the routers' logits in this forward (the model's
    ``output_router_logits``, from its config or the call)."""
    active = _collected()
    return bool(active) and "router_logits" in active


def record_router_logits(out):
    """The layer's output from the op's ``(output, router_logits)``, the logits added to
    transformers' collection where the router's own hook would have added them (the layers run
    in order, so each lands at its layer's place)."""
    y, logits = out
    active = _collected()
    if active is not None and "router_logits" in active:
        active["router_logits"].append(logits)
    return y


def _load_balancing_loss_func(model: nn.Module):
    """transformers' load_balancing_loss_func of the modeling module whose CausalLM forward
    ``model`` runs (the one that forward calls)."""
    owner = next(c for c in type(model).__mro__ if "forward" in vars(c))
    func = getattr(sys.modules.get(owner.__module__), "load_balancing_loss_func", None)
    if func is None:
        raise NotImplementedError(
            f"{owner.__qualname__}'s module has no load_balancing_loss_func: the fused LM head "
            "cannot add this model's router load-balancing loss (patch with fuse_lm_head=False)")
    return func


def router_stats_of_logits(logits, top_k: int, attention_mask=None):
    """The (3, E) float32 statistics of one layer's router logits (T, E) as transformers'
    load_balancing_loss_func reduces them (the op's ``router_stats`` for a layer that ran HF's
    forward): the attention_mask-weighted counts of each expert in the top-k of the softmax,
    the weighted softmax sums and the weight sum (in every column); no mask: every token
    weighs 1."""
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    e = probs.shape[-1]
    if attention_mask is None:
        w = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    else:
        w = attention_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
    counts = torch.zeros(e, dtype=torch.float32, device=probs.device).scatter_add_(
        0, chosen, w.repeat_interleave(top_k))
    return torch.stack([counts, (probs.float() * w.unsqueeze(-1)).sum(0), w.sum().expand(e)])


def load_balancing_loss(stats: Sequence, num_experts: int):
    """transformers' load_balancing_loss_func from the layers' (3, E) statistics (the op's
    ``router_stats``, or ``router_stats_of_logits``) instead of their logits: with the sums
    over layers C (top-k counts), P (softmax sums) and N (tokens, every layer's counted),
    ``num_experts * sum_e (C_e / N) * (P_e / N)``, float32 as HF's (the sums in the stats'
    dtype, float64 for a float64 model)."""
    device = stats[0].device
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in stats))
    total = torch.stack([s.to(device=device, dtype=dtype) for s in stats]).sum(0)
    n = total[2, 0]
    return (torch.sum((total[0] / n) * (total[1] / n)) * num_experts).float()


# The keyword under which the fused LM head hands the bare model a forward's RouterStats; the
# bare model's pre-hook (ckpt_ext.hf.patch) takes it out into the forward's own state, so that
# concurrent forwards of one model (several threads) each collect their own statistics.
ROUTER_STATS_KEY = "ckpt_ext_router_stats"


class RouterStats(list):
    """The (3, E) statistics the fused MoE layers of one forward append (router_aux_loss=
    "fused"), one list per forward. Under sequence parallelism (``group``: the group's
    registered name, ``ranks`` its size) each entry is already the sum over the group's ranks
    (differentiable, ``sequence_parallel.sum_over_group``), so that every rank makes the whole
    sequence's loss."""

    group: str = ""
    ranks: int = 1


def aux_loss(model: nn.Module, loss, outputs, attention_mask, output_router_logits,
             stats: list | None = None):
    """(loss, aux_loss) as the MoE CausalLM forwards of transformers 5 make them from the bare
    model's ``outputs``: with ``output_router_logits``, aux_loss = load_balancing_loss_func(
    outputs.router_logits, num_experts, num_experts_per_tok, attention_mask) (transformers'
    own function) and loss + router_aux_loss_coef * aux_loss; else (loss, None). ``stats``:
    the fused MoE layers' statistics (router_aux_loss="fused"); the loss is then
    ``load_balancing_loss`` of them and of the statistics of any logits a layer that ran HF's
    forward recorded. Summed over a sequence-parallel group (``RouterStats.ranks`` > 1), the
    statistics are the whole sequence's on every rank, and each rank adds its 1/ranks share of
    ``router_aux_loss_coef * aux_loss`` (the shares sum to it, as the ranks' losses sum to the
    whole batch's; the sum's backward gives each rank the whole gradient of its tokens).
    ``loss`` None (a call without labels): (None, aux_loss)."""
    if not output_router_logits:
        return loss, None
    if stats is None:
        aux = _load_balancing_loss_func(model)(outputs.router_logits, model.num_experts,
                                               model.num_experts_per_tok, attention_mask)
        coef = model.router_aux_loss_coef
    else:
        group, ranks = getattr(stats, "group", ""), getattr(stats, "ranks", 1)
        of_logits = [router_stats_of_logits(lg, model.num_experts_per_tok, attention_mask)
                     for lg in (outputs.router_logits or ())]
        if ranks > 1:  # a layer that ran HF's forward recorded its rank's tokens' logits
            from .sequence_parallel import sum_over_group
            of_logits = [sum_over_group(s, group) for s in of_logits]
        stats = list(stats) + of_logits
        if not stats:  # no MoE layer ran: HF's function returns 0 then
            return loss, 0
        aux = load_balancing_loss(stats, model.num_experts)
        coef = model.router_aux_loss_coef / ranks
    return (None if loss is None else loss + coef * aux.to(loss.device)), aux


_SLOT = {name: i for i, name in enumerate(WEIGHT_SLOTS)}
_DENSE_MLP_SLOTS = [i for i, name in enumerate(WEIGHT_SLOTS)
                    if name.startswith(("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj."))]


def layer_tensors(layer: nn.Module, family, fused):
    """The op's (weights, lora_scaling, lora_dropout, lora_streams, expert_lora_scaling) for an
    MoE layer, as ckpt_ext.hf.layer_checks reads a dense layer's (LoRA on the attention and on
    the shared expert included), with the MoE slots filled: the experts' base weights and, with
    PEFT LoRA on them, their factors (slots mlp.experts.<weight>.lora_A / lora_B) and the two
    scalings ([] without); or why the layer cannot be fused."""
    got = layer_checks.layer_tensors(_DenseView(layer), family, fused)
    if isinstance(got, str):
        return got
    weights, scaling, dropout, streams = got
    weights = list(weights)
    mlp = layer.mlp
    if "shared_expert" not in mlp._modules:
        for i in _DENSE_MLP_SLOTS:
            weights[i] = None
    experts = expert_wrappers(mlp._modules["experts"])[0]
    weights[_SLOT["mlp.gate.weight"]] = mlp.gate.weight
    weights[_SLOT["mlp.experts.gate_up_proj"]] = experts.gate_up_proj
    weights[_SLOT["mlp.experts.down_proj"]] = experts.down_proj
    gate = mlp._modules.get("shared_expert_gate")
    if gate is not None:
        weights[_SLOT["mlp.shared_expert_gate.weight"]] = gate.weight
    lora = _expert_lora(mlp, int(_shape(experts.down_proj)[0]))
    if isinstance(lora, str):
        return lora
    for name, (a, b, _) in lora.items():
        weights[_SLOT[f"mlp.experts.{name}.lora_A"]] = a
        weights[_SLOT[f"mlp.experts.{name}.lora_B"]] = b
    expert_scaling = [lora[name][2] if name in lora else 0.0 for name in _EXPERT_WEIGHTS] \
        if lora else []
    return weights, scaling, dropout, streams, expert_scaling
