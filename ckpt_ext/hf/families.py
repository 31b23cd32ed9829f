"""What each supported ``model_type``'s decoder layer computes, as the fused op's options.

All supported families are LLaMA-shaped decoder layers (RMSNorm, RoPE, GQA attention, a gated
MLP); they differ along a few axes that the op takes as options:

* which norms the layer has and what each one norms: ``norms`` maps the op's norm slots
  (``ckpt_ext.blocks.WEIGHT_SLOTS`` without ``.weight``) to the layer's module names. The
  names mean different things per family: Gemma's ``post_attention_layernorm`` norms the
  attention's output (the op's ``attention_output_norm``), LLaMA's is the MLP's pre-norm (the
  op's ``post_attention_layernorm``); OLMo-2 has no pre-norms at all. q/k norms
  (``self_attn.q_norm`` / ``k_norm``) are taken wherever the layer has them; their weight's
  width says per head (Qwen3, Gemma 3) or over the whole projection (OLMo-2);
* how a norm rounds: ``norm_offset`` (Gemma multiplies by 1 + w) and ``norm_cast_last``
  (Gemma and OLMo-2 apply the weight in float32 and cast the result; LLaMA casts first);
* the gated activation, read from ``mlp.act_fn`` (Phi-3, GLM: ``mlp.activation_fn``): SiLU,
  or GELU-tanh for Gemma's GeGLU;
* which dims RoPE pairs: ``rope_interleaved`` (GLM, GLM-4, Helium, ERNIE 4.5: (2i, 2i + 1);
  LLaMA: (i, i + R/2));
* the q/k norms' module names (``qk_norms``; Hunyuan: ``query_layernorm`` / ``key_layernorm``)
  and their place: ``qk_norm_after_rope`` (Hunyuan norms the rotated projections).

This module is the only reader of an HF decoder layer: :func:`layer_record` builds the one
``ckpt_ext.layer_record.LayerRecord`` per layer that the patch, the planner and the offloader
read (:func:`layer_dims`: its shape alone; :func:`layer_dims_from_config`: the shapes from a
config, for the plan's CLI). The head rules (``HEAD_RULES``: what a model's forward does
between its head and its loss, by the transformers class that defines the forward) are family
knowledge too and live here.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from typing import Callable, List, Mapping, NamedTuple, Optional, Tuple

import torch.nn as nn

from ..blocks import LAYER_ARGS
from ..layer_record import LayerDims, LayerRecord
from .adapters import fused_row_sizes


# ---- the head rules ------------------------------------------------------------------------------
# A head rule reads the model's config and gives (problem or None, logit_scale, softcap): what
# the forward does to lm_head's output before its loss_function, as linear_cross_entropy's
# arguments.
HeadRule = Callable[[object], Tuple[Optional[str], float, float]]


def _positive_number(x) -> bool:
    return (isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
            and x > 0)


def plain_head(config) -> Tuple[Optional[str], float, float]:
    """logits = lm_head(h)."""
    return None, 1.0, 0.0


def scaled_head(config, divide: bool) -> Tuple[Optional[str], float, float]:
    """logits = lm_head(h) / config.logits_scaling (``divide``: GraniteForCausalLM) or
    lm_head(h) * config.logits_scaling (HyperCLOVAXForCausalLM, as muP)."""
    scaling = getattr(config, "logits_scaling", 1.0)
    if not _positive_number(scaling):
        return (f"config.logits_scaling={scaling!r} is not a finite number > 0", 1.0, 0.0)
    return None, (1.0 / float(scaling) if divide else float(scaling)), 0.0


def softcapped_head(config) -> Tuple[Optional[str], float, float]:
    """logits = cap tanh(lm_head(h) / cap) with cap = config.final_logit_softcapping, when it
    is not None (Gemma2ForCausalLM, Gemma3ForCausalLM, VaultGemmaForCausalLM)."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return None, 1.0, 0.0
    if not _positive_number(cap):
        return (f"config.final_logit_softcapping={cap!r} is not None or a finite number > 0",
                1.0, 0.0)
    return None, 1.0, float(cap)


def uncapped_text_head(config) -> Tuple[Optional[str], float, float]:
    """logits = lm_head(h) (Gemma3ForConditionalGeneration, whose forward applies no final
    soft-cap); a text config that sets one is refused (another transformers version's forward
    may apply it)."""
    cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        return (f"text_config.final_logit_softcapping={cap!r} is set, and whether this "
                "forward applies it depends on the transformers version", 1.0, 0.0)
    return None, 1.0, 0.0


def moe_head(config) -> Tuple[Optional[str], float, float]:
    """logits = lm_head(h) (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM,
    OlmoeForCausalLM). With output_router_logits (the config's or the call's) their forward
    adds router_aux_loss_coef times the routers' load-balancing loss to the loss; the fused
    forward does the same with transformers' own loss function (ckpt_ext.hf.moe.aux_loss), or
    with router_aux_loss="fused" from the layers' statistics (moe.load_balancing_loss)."""
    return None, 1.0, 0.0


class Family(NamedTuple):
    """A decoder layer's norm layout and rounding (module docstring); a field named as an
    argument of the op (``ckpt_ext.blocks.LAYER_ARGS``) is passed to it as it is."""

    norms: Mapping[str, str]     # op norm slot -> the layer's module name
    norm_offset: float = 0.0
    norm_cast_last: bool = False
    rope_interleaved: bool = False
    qk_norms: Tuple[str, str] = ("q_norm", "k_norm")  # self_attn's q/k norm modules, if any
    qk_norm_after_rope: bool = False
    # a model with a sliding window applies no RoPE on its full-attention layers (EXAONE 4.0)
    full_layers_nope: bool = False
    # the config flag that, when False, leaves the output norms out (nn.Identity in their
    # place: HyperCLOVA X's use_post_norm)
    output_norms_flag: Optional[str] = None
    # (transformers class whose forward computes the head and loss, its head rule): set per
    # model_type in FAMILIES with .head()
    heads: Tuple[Tuple[str, HeadRule], ...] = ()

    def head(self, cls: str, rule: Optional[HeadRule] = None) -> "Family":
        """This layout with the head of the transformers class ``cls`` (the one defining the
        forward; ``rule``: what it does to the logits, ``plain_head`` when None)."""
        return self._replace(heads=self.heads + ((cls, rule or plain_head),))

    @property
    def modules(self) -> frozenset:
        """The layer's own norm modules (children of the layer)."""
        return frozenset(self.norms.values())


LLAMA = Family({"input_layernorm": "input_layernorm",
                "post_attention_layernorm": "post_attention_layernorm"})
# Gemma 2/3: pre- and post-norms around both sublayers ("sandwich"), norms times (1 + w)
GEMMA = Family({"input_layernorm": "input_layernorm",
                "attention_output_norm": "post_attention_layernorm",
                "post_attention_layernorm": "pre_feedforward_layernorm",
                "mlp_output_norm": "post_feedforward_layernorm"},
               norm_offset=1.0, norm_cast_last=True)
# OLMo-2/3: no pre-norms; each sublayer's output is normed before the residual add
OLMO2 = Family({"attention_output_norm": "post_attention_layernorm",
                "mlp_output_norm": "post_feedforward_layernorm"}, norm_cast_last=True)

# Gemma (1): LLaMA's pre-norms, times (1 + w)
GEMMA1 = Family(LLAMA.norms, norm_offset=1.0, norm_cast_last=True)
# VaultGemma: Gemma 2 without the output norms (its MLP pre-norm keeps Gemma 2's name)
VAULTGEMMA = Family({"input_layernorm": "input_layernorm",
                     "post_attention_layernorm": "pre_feedforward_layernorm"},
                    norm_offset=1.0, norm_cast_last=True)
# EXAONE 4.0: OLMo-2's post-norms with LLaMA's rounding (cast, then w), per-head q/k norms; a
# hybrid model's full-attention layers apply no RoPE (uses_rope)
EXAONE4 = Family(OLMO2.norms, full_layers_nope=True)
# GLM (glm-4-9b), Helium and ERNIE 4.5: LLaMA's layout, RoPE on interleaved pairs (GLM's
# partial: the first half of each head; ERNIE's tables stay float32); Helium's norms apply w
# in float32 and cast last
GLM = Family(LLAMA.norms, rope_interleaved=True)
HELIUM = Family(LLAMA.norms, norm_cast_last=True, rope_interleaved=True)
# HyperCLOVA X: Peri-LN, a pre-norm and an output norm around both sublayers (the output
# norms are nn.Identity, no norm, when the config's use_post_norm is off); Granite's multipliers
HYPERCLOVAX = Family({"input_layernorm": "input_layernorm", "attention_output_norm": "post_norm1",
                      "post_attention_layernorm": "post_attention_layernorm",
                      "mlp_output_norm": "post_norm2"}, output_norms_flag="use_post_norm")
# Hunyuan (dense): LLaMA's layout, per-head q/k norms (their own names) of the rotated q/k
HUNYUAN = Family(LLAMA.norms, qk_norms=("query_layernorm", "key_layernorm"),
                 qk_norm_after_rope=True)
# GLM-4-0414: norms around both sublayers (as Gemma 2, with its own names), LLaMA's rounding
GLM4 = Family({"input_layernorm": "input_layernorm",
               "attention_output_norm": "post_self_attn_layernorm",
               "post_attention_layernorm": "post_attention_layernorm",
               "mlp_output_norm": "post_mlp_layernorm"}, rope_interleaved=True)

# Qwen2-VL / Qwen2.5-VL / Qwen3-VL's language models: Qwen2 (Qwen3: with q/k norms) layers
# whose multimodal RoPE (M-RoPE) is composed into ordinary (B, S, D) cos/sin tables by the
# rotary embedding before the layers (Qwen3-VL's deepstack adds visual features to the hidden
# state between layers, outside them).
# Their position_ids are (3 or 4, B, S); only a 4-row tensor carries text positions, from
# which transformers reads packed sequences (row 0), as the fused layers do.
MROPE = frozenset({"qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"})

# model_type -> its layer's Family with its head (HEAD_RULES)
FAMILIES = {
    "llama": LLAMA.head("LlamaForCausalLM"), "mistral": LLAMA.head("MistralForCausalLM"),
    "ministral": LLAMA.head("MinistralForCausalLM"), "qwen2": LLAMA.head("Qwen2ForCausalLM"),
    "qwen3": LLAMA.head("Qwen3ForCausalLM"), "smollm3": LLAMA.head("SmolLM3ForCausalLM"),
    "granite": LLAMA.head("GraniteForCausalLM", functools.partial(scaled_head, divide=True)),
    "gemma": GEMMA1.head("GemmaForCausalLM"),
    "gemma2": GEMMA.head("Gemma2ForCausalLM", softcapped_head),
    "gemma3_text": GEMMA.head("Gemma3ForCausalLM", softcapped_head),
    "olmo2": OLMO2.head("Olmo2ForCausalLM"), "olmo3": OLMO2.head("Olmo3ForCausalLM"),
    "phi3": LLAMA.head("Phi3ForCausalLM"), "exaone4": EXAONE4.head("Exaone4ForCausalLM"),
    "glm": GLM.head("GlmForCausalLM"), "glm4": GLM4.head("Glm4ForCausalLM"),
    "helium": HELIUM.head("HeliumForCausalLM"),
    "vaultgemma": VAULTGEMMA.head("VaultGemmaForCausalLM", softcapped_head),
    "ernie4_5": GLM.head("Ernie4_5ForCausalLM"),
    "hunyuan_v1_dense": HUNYUAN.head("HunYuanDenseV1ForCausalLM"),
    "hyperclovax": HYPERCLOVAX.head("HyperCLOVAXForCausalLM",
                                    functools.partial(scaled_head, divide=False)),
    "cwm": LLAMA.head("CwmForCausalLM"),
    # mixture-of-experts MLPs (ckpt_ext.hf.moe); OLMoE's q/k norms span the projection
    "qwen3_moe": LLAMA.head("Qwen3MoeForCausalLM", moe_head),
    "qwen2_moe": LLAMA.head("Qwen2MoeForCausalLM", moe_head),
    "mixtral": LLAMA.head("MixtralForCausalLM", moe_head),
    "olmoe": LLAMA.head("OlmoeForCausalLM", moe_head),
    # the M-RoPE language models: their heads are their multimodal models' (MULTIMODAL)
    **{t: LLAMA for t in sorted(MROPE)}}


class Multimodal(NamedTuple):
    """A multimodal model_type whose text stack is one of FAMILIES: its decoder layers are its
    language model's (``model.model.language_model.layers``)."""

    text_types: Optional[frozenset]  # the text config's model_types; None: any of FAMILIES
    # image tokens attend bidirectionally (Gemma 3): a batch with images runs HF's layers;
    # otherwise images are embeddings merged into the causal text stream (LLaVA, Mistral 3)
    bidirectional_images: bool
    # (transformers class whose forward computes the head and loss, its head rule)
    head: Tuple[str, HeadRule] = ("", plain_head)


MULTIMODAL = {
    "gemma3": Multimodal(frozenset({"gemma3_text"}), True,
                         ("Gemma3ForConditionalGeneration", uncapped_text_head)),
    "llava": Multimodal(None, False, ("LlavaForConditionalGeneration", plain_head)),
    "mistral3": Multimodal(None, False, ("Mistral3ForConditionalGeneration", plain_head)),
    "qwen2_vl": Multimodal(frozenset({"qwen2_vl_text"}), False,
                           ("Qwen2VLForConditionalGeneration", plain_head)),
    "qwen2_5_vl": Multimodal(frozenset({"qwen2_5_vl_text"}), False,
                             ("Qwen2_5_VLForConditionalGeneration", plain_head)),
    "qwen3_vl": Multimodal(frozenset({"qwen3_vl_text"}), False,
                           ("Qwen3VLForConditionalGeneration", plain_head))}

# The transformers classes whose forward the fused head reproduces, by the name of the class
# that defines the forward (from FAMILIES and MULTIMODAL): each computes logits = lm_head(last
# hidden state), then the rule's transform, then loss_function(logits, labels, vocab_size,
# **kwargs).
HEAD_RULES = {**{cls: rule for family in FAMILIES.values() for cls, rule in family.heads},
              **dict(m.head for m in MULTIMODAL.values())}


def text_positions(model_type: str, position_ids):
    """The position_ids from which a model_type's masks read packed sequences: as given, or for
    the M-RoPE language models (MROPE) row 0 of a (4, B, S) tensor and nothing otherwise."""
    if model_type not in MROPE:
        return position_ids
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def uses_rope(config, family: Family, layer_idx: Optional[int]) -> bool:
    """Whether decoder layer ``layer_idx`` rotates q and k, as its attention's forward decides:
    not where SmolLM3's ``no_rope_layers`` marks 0, nor on the full-attention layers of a
    ``family.full_layers_nope`` model with a ``sliding_window`` (EXAONE 4.0's "global NoPE");
    True everywhere else (and for a layer whose index is not known)."""
    if layer_idx is None:
        return True
    flags = getattr(config, "no_rope_layers", None)
    if flags is not None:
        return bool(flags[layer_idx])
    if family.full_layers_nope and getattr(config, "sliding_window", None) is not None:
        return config.layer_types[layer_idx] == "sliding_attention"
    return True


def layer_norms(layer: nn.Module, family: Family) -> dict:
    """The layer's norms by the op's slot (without ``.weight``): the family's map, then q/k
    norms where the attention has them (``family.qk_norms``: their module names). An
    nn.Identity in a norm's place (HyperCLOVA X without use_post_norm) is no norm."""
    attn = layer._modules["self_attn"]
    norms = {slot: layer._modules.get(name) for slot, name in family.norms.items()}
    norms.update({f"self_attn.{slot}": attn._modules.get(name)
                  for slot, name in zip(("q_norm", "k_norm"), family.qk_norms)})
    return {name: norm for name, norm in norms.items()
            if norm is not None and type(norm) is not nn.Identity}


# mlp.act_fn classes -> the op's activation (tanh-approximate GELUs are one function)
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh",
               "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
               "FastGELUActivation": "gelu_tanh"}


def activation(layer: nn.Module) -> Optional[str]:
    """The op's name for the layer's gated activation, or None when the op has none."""
    mlp = layer.mlp._modules
    if "experts" in mlp:  # an MoE block: its experts' activation (ckpt_ext.hf.moe)
        mlp = base_experts(mlp["experts"])._modules
    return ACTIVATIONS.get(type(mlp.get("act_fn", mlp.get("activation_fn"))).__name__)


def norm_eps(norm: nn.Module) -> Optional[float]:
    """An RMSNorm's epsilon (``variance_epsilon``; Gemma 3's norms call it ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if eps is None else float(eps)


# ---- the layer record ---------------------------------------------------------------------------

def layer_dims(layer: nn.Module, num_heads: int, family: Optional[Family] = None) -> LayerDims:
    """The shape of an HF Llama-family decoder layer (``self_attn.q_proj/k_proj``,
    ``mlp.gate_proj``) with ``num_heads`` query heads, read off the projection shapes
    (Phi-3's fused qkv_proj, Phi-3's and GLM's fused gate_up_proj: their row blocks);
    ``family`` (LLaMA's when None) says which output norms it may have, and the layer whether
    they are there (an nn.Identity in a norm's place is none). An MoE layer's MLP fields are
    read off its block (``_moe_dims``)."""
    out_norms = _output_norms(layer, family or LLAMA)
    attn, mlp = layer.self_attn, layer.mlp
    if is_moe_layer(layer):
        ffn = _moe_dims(layer)
    else:
        ffn = dict(intermediate_size=mlp.gate_up_proj.out_features // 2
                   if "gate_up_proj" in mlp._modules else mlp.gate_proj.out_features)
    if "qkv_proj" in attn._modules:
        qkv, head_dim = attn.qkv_proj, int(attn.head_dim)
        return LayerDims(qkv.in_features, num_heads,
                         (qkv.out_features // head_dim - num_heads) // 2, head_dim, **ffn,
                         **out_norms)
    q, k = attn.q_proj, attn.k_proj
    head_dim = q.out_features // num_heads
    return LayerDims(q.in_features, num_heads, k.out_features // head_dim, head_dim, **ffn,
                     **out_norms)


def _moe_dims(layer: nn.Module) -> dict:
    """LayerDims' MLP fields of an MoE layer read off its modules: experts, top_k, the
    experts' intermediate size and the shared expert's (0 without one)."""
    mlp = layer.mlp
    experts, _, i = moe_shape(base_experts(mlp.experts).down_proj)
    shared = mlp._modules.get("shared_expert")
    return dict(intermediate_size=0 if shared is None else
                moe_shape(shared.gate_proj.weight)[0],
                experts=int(experts), top_k=int(mlp.gate.top_k), expert_intermediate_size=int(i))


def _output_norms(layer: nn.Module, family: Family) -> dict:
    """LayerDims' output-norm flags: which of the family's output norms the layer has."""
    norms = layer_norms(layer, family)
    return dict(attention_output_norm="attention_output_norm" in norms,
                mlp_output_norm="mlp_output_norm" in norms)


def layer_window(config, layer: nn.Module) -> Optional[int]:
    """The layer's sliding window as transformers applies it: the config's ``sliding_window``
    on layers that ``layer_types`` marks ``sliding_attention`` (Qwen2/Qwen3, Ministral's
    interleaved layers), or on every layer when the config has no ``layer_types`` (Mistral);
    None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is None:
        return int(window)
    idx = getattr(layer.self_attn, "layer_idx", None)
    return int(window) if idx is not None and types[idx] == "sliding_attention" else None


def layer_eps(layer: nn.Module, family: Family) -> float:
    """The one epsilon of the layer's norms (the op takes one); ValueError if they differ."""
    values = {name: norm_eps(norm) for name, norm in layer_norms(layer, family).items()}
    if len(set(values.values())) != 1:
        raise ValueError(f"the norms have different eps {values}; the fused op takes one eps "
                         "for all of them")
    return next(iter(values.values()))


def layer_record(layer: nn.Module, config) -> LayerRecord:
    """The record of one HF decoder layer of a ``FAMILIES`` model (``config``: its text
    config): shape, norms, the op's per-layer options, window, RoPE, fused projections' row
    blocks; ``source`` is its :class:`Family`. ValueError when the projections' shapes do not
    match the config's heads."""
    attn = layer.self_attn
    family = FAMILIES[config.model_type]
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(attn, "head_dim", None) or
                   config.hidden_size // config.num_attention_heads)
    # Phi-3's fused projections: their row blocks (checked here), read per call as q/k/v,
    # gate/up (ckpt_ext.hf.adapters); projections PEFT or others wrapped are read per call,
    # here only the shapes that modules declare are checked against the config.
    fused = fused_row_sizes(layer, num_heads, num_kv_heads, head_dim)

    def dims(name):
        mod = attn._modules.get(name)
        if mod is None:  # a block of qkv_proj, checked above
            return None, None
        return getattr(mod, "out_features", None), getattr(mod, "in_features", None)
    (q_out, q_in), (k_out, k_in), (v_out, _), (o_out, o_in) = (
        dims(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    shapes_ok = (q_out in (None, num_heads * head_dim)
                 and k_out in (None, num_kv_heads * head_dim)
                 and v_out in (None, num_kv_heads * head_dim)
                 and o_in in (None, num_heads * head_dim)
                 and num_heads % num_kv_heads == 0 and head_dim % 2 == 0)
    if not shapes_ok:
        raise ValueError(
            f"projection out/in features q ({q_out}, {q_in}), k ({k_out}, {k_in}), o "
            f"({o_out}, {o_in}) do not match num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    fields = dict(
        # the family's options that are the op's (its rounding, RoPE pairs, q/k norm place)
        **{name: getattr(family, name) for name in family._fields if name in LAYER_ARGS},
        num_heads=num_heads, num_kv_heads=num_kv_heads, eps=layer_eps(layer, family),
        scale=float(attn.scaling),
        # Gemma 2's attention logit soft-capping (0: none)
        softcap=float(getattr(attn, "attn_logit_softcapping", None) or 0.0),
        # Granite multiplies each sublayer's output before the residual add
        residual_scale=float(getattr(layer, "residual_multiplier", 1.0)),
        activation=activation(layer),
        # an MoE block's options ({} for a dense MLP), read by ckpt_ext.hf.moe
        **moe_layer_options(layer, config))
    present = layer_norms(layer, family)
    names = {**family.norms, **{f"self_attn.{slot}": f"self_attn.{name}"
                                for slot, name in zip(("q_norm", "k_norm"), family.qk_norms)}}
    # the shape from the config and what the modules declare (a projection another library
    # wrapped may declare nothing; it is read per call, or refused then)
    mlp = layer.mlp._modules
    if is_moe_layer(layer):
        ffn = _moe_dims(layer)
    else:
        gate_up = getattr(mlp.get("gate_up_proj"), "out_features", None)
        inter = gate_up // 2 if gate_up else getattr(mlp.get("gate_proj"), "out_features", None)
        ffn = dict(intermediate_size=int(inter or config.intermediate_size))
    dims = LayerDims(int(config.hidden_size), num_heads, num_kv_heads, head_dim, **ffn,
                     **_output_norms(layer, family))
    return LayerRecord(
        dims=dims,
        norms={slot: names[slot] for slot in present}, fields=fields,
        window=layer_window(config, layer),
        rope=uses_rope(config, family, getattr(attn, "layer_idx", None)), fused=fused,
        source=family)


# ---- mixture-of-experts blocks ------------------------------------------------------------------
# The MoE part of a layer's record (its options); ckpt_ext.hf.moe checks the block and reads its
# tensors.

class MoeFamily(NamedTuple):
    """What a model_type's MoE block is made of, by class name (transformers 5)."""

    block: str
    router: str
    experts: str
    # the config flag that renormalises the top-k weights (None: always, as Mixtral)
    norm_flag: Optional[str] = "norm_topk_prob"
    shared: bool = False  # shared_expert + shared_expert_gate (Qwen2-MoE)


MOE_FAMILIES = {
    "qwen3_moe": MoeFamily("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts"),
    "qwen2_moe": MoeFamily("Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "Qwen2MoeExperts",
                           shared=True),
    "mixtral": MoeFamily("MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts",
                         norm_flag=None),
    "olmoe": MoeFamily("OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts"),
}


def expert_wrappers(experts: nn.Module) -> tuple:
    """(the experts module, the PEFT ``ParamWrapper``s around it, outermost first): LoRA through
    ``LoraConfig(target_parameters=[...])`` wraps ``mlp.experts`` once per targeted weight."""
    wrappers = []
    while type(experts).__name__ == "ParamWrapper" and "base_layer" in experts._modules:
        wrappers.append(experts)
        experts = experts._modules["base_layer"]
    return experts, wrappers


def base_experts(experts: nn.Module) -> nn.Module:
    """The experts module inside PEFT's ParamWrappers (itself when unwrapped)."""
    return expert_wrappers(experts)[0]


def is_moe_layer(layer: nn.Module) -> bool:
    """Whether the decoder layer's ``mlp`` is a sparse MoE block (it has routed experts)."""
    mlp = layer._modules.get("mlp")
    return mlp is not None and "experts" in mlp._modules


def moe_layer_options(layer: nn.Module, config) -> dict:
    """The op's MoE options for the layer ({} for a dense MLP): num_experts_per_tok, router,
    norm_topk_prob. Raises NotImplementedError naming a setting the op does not compute."""
    if not is_moe_layer(layer):
        return {}
    model_type = config.model_type
    fam = MOE_FAMILIES.get(model_type)
    mlp = layer.mlp
    if fam is None or type(mlp).__name__ != fam.block:
        raise ValueError(f"mlp is a {type(mlp).__name__} in a {model_type!r} model; the fused "
                         f"MoE blocks are {', '.join(f.block for f in MOE_FAMILIES.values())}")
    jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise NotImplementedError(
            f"{model_type} with router_jitter_noise={jitter} (random scaling of "
            "the MoE input in training) is not implemented by the fused MoE layer: set "
            "config.router_jitter_noise = 0.0, or use policy 'torch'")
    if getattr(config, "clip_qkv", None) is not None:
        raise NotImplementedError(
            f"{model_type} with clip_qkv={config.clip_qkv} (q/k/v clamped after "
            "their projections) is not implemented by the fused layer: use a model with "
            "clip_qkv=None, or policy 'torch'")
    router = mlp.gate
    k, experts = int(router.top_k), int(moe_shape(router.weight)[0])
    if not 0 < k <= experts:
        raise ValueError(f"mlp.gate.top_k={k} must be in 1..{experts} (the experts)")
    base = base_experts(mlp.experts)
    gate_up, down = moe_shape(base.gate_up_proj), moe_shape(base.down_proj)
    h = moe_shape(router.weight)[1]
    i = down[-1]
    if tuple(gate_up) != (experts, 2 * i, h) or tuple(down) != (experts, h, i):
        raise ValueError(
            f"the experts' weights gate_up_proj {tuple(gate_up)} and down_proj "
            f"{tuple(down)} are not transformers 5's layout (E, 2I, H) and (E, H, I) "
            f"with E={experts}, H={h}")
    if getattr(base, "is_transposed", False) or \
            getattr(base, "is_concatenated", True) is False or \
            getattr(base, "has_bias", False):
        raise ValueError("the experts are transposed, interleaved or biased (not the layout "
                         "of transformers 5's Qwen-MoE, Mixtral and OLMoE experts)")
    act = ACTIVATIONS.get(type(base.act_fn).__name__)
    shared = mlp._modules.get("shared_expert")
    if shared is not None:
        shared_act = ACTIVATIONS.get(type(shared._modules.get("act_fn")).__name__)
        if shared_act != act:
            raise ValueError(f"the shared expert's activation ({shared_act}) is not the "
                             f"experts' ({act})")
    norm = True if fam.norm_flag is None else bool(getattr(router, "norm_topk_prob", False))
    return {"num_experts_per_tok": k, "router": "softmax", "norm_topk_prob": norm}


def moe_shape(t) -> tuple:
    """A parameter's shape; a ZeRO-3 partitioned one's full shape (``ds_shape``), not the
    empty tensor it holds outside its module's gathering."""
    return tuple(getattr(t, "ds_shape", t.shape))


def _config_value(config, name, default=None):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name,
                                                                               default)
    return default if value is None else value


def layer_dims_from_config(config) -> List[LayerDims]:
    """One LayerDims per decoder layer of an HF config (object or dict): hidden_size,
    num_attention_heads, num_key_value_heads (default: the heads), head_dim (default
    hidden_size // heads), intermediate_size, num_hidden_layers; the output norms of its
    model_type's family (LLaMA's for a model_type not in ``FAMILIES``). A mixture of
    experts (num_experts or num_local_experts) gives its sparse layers' experts, top-k
    (num_experts_per_tok), expert size (moe_intermediate_size, else intermediate_size: Mixtral,
    OLMoE), shared expert (shared_expert_intermediate_size, 0 without) and
    output_router_logits, and its dense layers (mlp_only_layers, decoder_sparse_step)
    intermediate_size. ValueError naming what is missing or not an int (or, for
    mlp_only_layers, not a list of ints)."""
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
    family = FAMILIES.get(_config_value(config, "model_type"), LLAMA)
    flag = family.output_norms_flag  # HyperCLOVA X's use_post_norm
    out_norms = flag is None or _config_value(config, flag, True) is not False
    dims = LayerDims(H, heads, kv, D, integer("intermediate_size"),
                     attention_output_norm=out_norms and "attention_output_norm" in family.norms,
                     mlp_output_norm=out_norms and "mlp_output_norm" in family.norms)
    layers = integer("num_hidden_layers")
    if layers <= 0:
        raise ValueError(f"config: num_hidden_layers must be a positive int, got {layers}")
    experts = integer("num_experts", 0) or integer("num_local_experts", 0)
    if not experts:
        return [dims] * layers
    # a mixture of experts: qwen3_moe / qwen2_moe size their experts by moe_intermediate_size
    # (intermediate_size is then their dense layers'), mixtral / olmoe by intermediate_size;
    # qwen2_moe adds a shared expert (shared_expert_intermediate_size)
    moe_size = _config_value(config, "moe_intermediate_size")
    expert_size = integer("moe_intermediate_size") if moe_size is not None else dims.intermediate_size
    shared = integer("shared_expert_intermediate_size", 0)
    top_k = integer("num_experts_per_tok")
    if not 1 <= top_k <= experts:
        raise ValueError(f"config: num_experts_per_tok must be in [1, {experts}], got {top_k}")
    sparse = dataclasses.replace(dims, intermediate_size=shared, experts=experts, top_k=top_k,
                                 expert_intermediate_size=expert_size,
                                 router_logits=bool(_config_value(config,
                                                                  "output_router_logits", False)))
    # dense layers between (qwen2_moe / qwen3_moe): mlp_only_layers, decoder_sparse_step
    only = _config_value(config, "mlp_only_layers", None)
    if only is None:
        only = ()
    if not isinstance(only, (list, tuple)) or \
            any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in only):
        raise ValueError(f"config: mlp_only_layers must be a list of layer indices (ints), got "
                         f"{only!r}")
    dense = set(only)
    step = integer("decoder_sparse_step", 1)
    if step <= 0:
        raise ValueError(f"config: decoder_sparse_step must be a positive int, got {step}")
    return [dims if i in dense or (i + 1) % step else sparse for i in range(layers)]


def head_rule(model: nn.Module) -> Tuple[Optional[str], Optional[HeadRule]]:
    """(problem, None) when the forward ``model`` runs is not one of ``HEAD_RULES`` (defined
    by transformers under that name), else (None, its rule). Deliberately keyed by the class
    that defines ``forward``, not the config: a subclass with a forward of its own keeps HF's
    head."""
    owner = next((c for c in type(model).__mro__ if "forward" in vars(c)), None)
    rule = None
    if owner is not None and owner.__module__.startswith("transformers."):
        rule = HEAD_RULES.get(owner.__name__)
    if rule is None:
        name = "no forward" if owner is None else f"the forward of {owner.__qualname__}"
        return (f"{type(model).__name__} runs {name}, not one of the transformers forwards "
                f"whose head and loss the fused op reproduces ({', '.join(HEAD_RULES)})"), None
    return None, rule
