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
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Tuple

import torch.nn as nn


class Family(NamedTuple):
    """A decoder layer's norm layout and rounding (module docstring)."""

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

FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "ministral": LLAMA, "qwen2": LLAMA,
            "qwen3": LLAMA, "smollm3": LLAMA, "granite": LLAMA, "gemma": GEMMA1,
            "gemma2": GEMMA, "gemma3_text": GEMMA, "olmo2": OLMO2, "olmo3": OLMO2,
            "phi3": LLAMA, "exaone4": EXAONE4, "glm": GLM, "glm4": GLM4, "helium": HELIUM,
            "vaultgemma": VAULTGEMMA, "ernie4_5": GLM, "hunyuan_v1_dense": HUNYUAN,
            "hyperclovax": HYPERCLOVAX, "cwm": LLAMA,
            # mixture-of-experts MLPs (ckpt_ext.hf.moe); OLMoE's q/k norms span the projection
            "qwen3_moe": LLAMA, "qwen2_moe": LLAMA, "mixtral": LLAMA, "olmoe": LLAMA,
            **{t: LLAMA for t in sorted(MROPE)}}


class Multimodal(NamedTuple):
    """A multimodal model_type whose text stack is one of FAMILIES: its decoder layers are its
    language model's (``model.model.language_model.layers``)."""

    text_types: Optional[frozenset]  # the text config's model_types; None: any of FAMILIES
    # image tokens attend bidirectionally (Gemma 3): a batch with images runs HF's layers;
    # otherwise images are embeddings merged into the causal text stream (LLaVA, Mistral 3)
    bidirectional_images: bool


MULTIMODAL = {"gemma3": Multimodal(frozenset({"gemma3_text"}), True),
              "llava": Multimodal(None, False), "mistral3": Multimodal(None, False),
              "qwen2_vl": Multimodal(frozenset({"qwen2_vl_text"}), False),
              "qwen2_5_vl": Multimodal(frozenset({"qwen2_5_vl_text"}), False),
              "qwen3_vl": Multimodal(frozenset({"qwen3_vl_text"}), False)}


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
        mlp = mlp["experts"]._modules
    return ACTIVATIONS.get(type(mlp.get("act_fn", mlp.get("activation_fn"))).__name__)


def norm_eps(norm: nn.Module) -> Optional[float]:
    """An RMSNorm's epsilon (``variance_epsilon``; Gemma 3's norms call it ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if eps is None else float(eps)
