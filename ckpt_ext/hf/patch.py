r"""Put ckpt_ext's recompute into a Hugging Face LLaMA-family model, in place.

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa")
    ckpt_ext.patch_llama(model, policy="balanced")
    loss = model(input_ids, attention_mask=mask, labels=labels, use_cache=False).loss
    ckpt_ext.unpatch_llama(model)

Supported: the ``config.model_type``\ s of ``SUPPORTED_MODEL_TYPES`` (Llama, Mistral,
Ministral, Qwen2, Qwen3, SmolLM3: its layers without RoPE run the op with cos = 1, sin = 0;
Granite: its residual multiplier is the op's ``residual_scale``, its attention multiplier the
softmax scale; OLMo-2/3: post-norms and whole-projection q/k norms; EXAONE 4.0: post-norms,
per-head q/k norms, no RoPE on a hybrid model's full-attention layers; GLM, GLM-4, Helium,
ERNIE 4.5: RoPE on interleaved pairs (the op's ``rope_interleaved``), GLM-4's norms around both
sublayers, ERNIE's float32 cos/sin as they come; Hunyuan (dense): q/k norms after RoPE (the
op's ``qk_norm_after_rope``); HyperCLOVA X: Peri-LN (output norms, or none where the
config's use_post_norm is off) and Granite's multipliers; CWM: sliding layers as Ministral's;
Gemma, Gemma 2, Gemma 3 (text), VaultGemma:
(1 + w) norms, norms around both sublayers (not VaultGemma), GeGLU; Phi-3 / Phi-4-mini: its fused
``qkv_proj`` and ``gate_up_proj`` are read as row blocks (``ckpt_ext.hf.adapters``), its
partial rotary embeddings are cos/sin narrower than a head; what each family's layer computes
is in ``ckpt_ext.hf.families``) from transformers 5, as ``*ForCausalLM``, the bare ``*Model``,
or a ``peft.PeftModel`` around either (patch before or after wrapping); and Gemma 3's
multimodal ``Gemma3ForConditionalGeneration``, LLaVA, Mistral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL
(``families.MULTIMODAL``; the Qwen language models' M-RoPE tables reach the layers composed),
whose language model's layers are patched: the pre-hook sits on the multimodal bare model,
which receives the batch's 2-D mask; LLaVA's, Mistral 3's and Qwen-VL's images are embeddings
in the causal text stream (fused), Gemma 3's image tokens attend bidirectionally, so a batch
with them runs HF's layers (``_image_inputs``). Each decoder layer keeps its HF class and
parameters; only an instance-level ``forward`` is set (a ``_PatchedForward``), so
``isinstance`` checks, hooks on the layer, ``output_hidden_states`` and ``state_dict`` are
unchanged, and ``unpatch_llama`` deletes it.

Per layer, the preset (``ckpt_ext.presets``) decides what a *training* forward does (grad
enabled, no KV cache):

* ``none``: nothing is patched; the layer is HF's, untouched.
* ``torch``: HF's forward under ``torch.utils.checkpoint(use_reentrant=False)`` (or under HF's
  own gradient checkpointing when that is on: once is enough).
* ``fast`` / ``balanced`` / ``min_memory``: one call of the fused op
  ``torch.ops.ckpt_ext.decoder_layer`` with the layer's own tensors, LoRA adapters included.
  Under ``torch.autocast`` it computes as HF's modules do under the same autocast; under
  ``torch.compile`` it is one opaque op with the preset's residuals.

The masks come from the model's inputs (``ckpt_ext.hf.masks``): the 2-D ``attention_mask``
becomes a key padding mask; without one, packed ``position_ids`` become segment ids; the
config's sliding window applies to the layers it names; for ``eager`` models a query row with
nothing to attend averages all values, as HF's eager attention does. HF gradient checkpointing
on the model (turned on before or after patching) is taken over: with the default policy, fused
layers use ``min_memory``, which keeps what HF's checkpointing keeps (the layer input) and
recomputes less. ``policy="auto"`` chooses the presets per forward shape for an
``activation_budget``; ``fuse_lm_head`` puts a ``*ForCausalLM``'s training loss through
``ckpt_ext.ops.linear_cross_entropy`` (``ckpt_ext.hf.lm_head``).

Everything else runs HF's own forward ("delegates"): inference (grad disabled), generation and
any call with a KV cache, and every training call the fused op would compute differently: a
custom attention mask, ``output_attentions``, hooks on the layer's submodules, a projection
PEFT or anything else wrapped in a way the op does not compute (DoRA, several active adapters,
LoRA dropout in training, quantised base layers). A delegation during training is warned once
per reason; ``layer.forward.calls`` counts fused and delegated calls (outside compilation).

Under DeepSpeed ZeRO-3 the fused layers become ZeRO-3 leaf modules, gathered whole for their
forward and again for their backward, and the fused head gathers its weight only around the
loss's forward and backward (``ckpt_ext.hf.zero``); ZeRO-2 needs nothing.

What can never be fused is refused by ``patch_llama`` with a ``PatchRefused``
(``ckpt_ext.hf.errors``; a ValueError and a NotImplementedError), before anything changes:
other model types (MoE families the op does not compute among them), attention
implementations the fused op does not replace, attention dropout, activations other than SiLU
and tanh-approximate GELU, norms with different eps, MoE settings and layouts it does not
compute, a layer with an instance-level forward already, ``router_aux_loss="fused"`` without
the fused MoE head, ``sequence_parallel`` with layers left unfused. Rope variants are not
refused: these layer classes all apply ``q * cos + rotate_half(q) * sin`` with the cos/sin the
model computes outside the layers (rope scaling types change only those; Phi-4-mini's partial
rotary embeddings are narrower cos/sin), and the fused op applies the same formula to the same
cos/sin.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import math
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import _C  # noqa: F401  (registers torch.ops.ckpt_ext)
from .._checks import _check_bool
from ..blocks import decoder_layer
from ..offload import resolve as resolve_offload
from .. import segments as _segments
from ..presets import FUSED_PRESETS, PRESETS, check_policy
from . import moe, zero
from .errors import PatchRefused
from .cache import uses_cache
from ..layer_record import LayerDims, LayerRecord
from .layer_checks import (ATTENTIONS_FIX as _ATTENTIONS_FIX, foreign_forward as _foreign_forward,
                           layer_tensors as _layer_tensors,
                           structure_problem as _dense_structure_problem)
from .families import (FAMILIES, MULTIMODAL, Family, activation, layer_dims,
                       layer_record, text_positions)
from .lm_head import (FinalNorm, FusedHeadForward, _fsdp2_module_type, _is_dtensor,
                      check_router_aux_loss, final_norm_problem, head_problem)
from .masks import BatchMasks, describe, padding_mask_from_4d
from . import quantized
from . import sequence_parallel as _sp
from .sequence_split import deepspeed_ulysses_group, refuse_split_attention

__all__ = ["patch_llama", "unpatch_llama", "PatchRefused", "SUPPORTED_MODEL_TYPES",
           "SUPPORTED_ATTENTION"]

SUPPORTED_MODEL_TYPES = tuple(FAMILIES) + tuple(MULTIMODAL)
SUPPORTED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")

Policy = Union[str, Sequence[str], Callable[[int], str]]  # a preset, per layer, or "auto"



# ---- finding the model's pieces --------------------------------------------------------------

def _decoder_layers(model: nn.Module) -> Tuple[nn.Module, nn.ModuleList]:
    """``(owner, layers)``: the bare ``*Model`` and its ``layers``."""
    model = _unwrap_peft(model)
    bare = getattr(model, "model", None)
    for owner in (getattr(model, "base_model", None), bare, model,
                  getattr(bare, "language_model", None), getattr(model, "language_model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return owner, layers
    raise PatchRefused(
        f"patch_llama: could not find the decoder layers of {type(model).__name__} (looked for "
        "model.model.layers, model.layers and a language_model's layers); pass a transformers "
        f"*ForCausalLM or *Model of the families {', '.join(SUPPORTED_MODEL_TYPES)}")


def _mask_owner(model: nn.Module, owner: nn.Module) -> nn.Module:
    """The module whose call receives the batch's 2-D attention mask: the multimodal bare model
    around a language model ``owner`` (which receives 4-D masks built from it), else
    ``owner`` itself."""
    model = _unwrap_peft(model)
    for outer in (getattr(model, "model", None), model):
        if outer is not None and outer is not owner and \
                getattr(outer, "language_model", None) is owner:
            return outer
    return owner


def _image_inputs(named: dict, compiling: bool) -> Optional[str]:
    """Why a multimodal model's call cannot run the causal fused layers (its batch has image
    tokens, which attend bidirectionally), or None for a text-only call."""
    if named.get("pixel_values") is not None or named.get("mm_encoder_outputs"):
        return ("the batch has images (pixel_values): image tokens attend bidirectionally, "
                "which the causal fused op does not compute")
    types = named.get("token_type_ids")
    if types is None:
        return None
    if compiling:
        return ("token_type_ids was given under torch.compile, where whether it marks image "
                "tokens is not known before the run; pass token_type_ids=None for text-only "
                "batches")
    if bool((types == 1).any()):
        return ("token_type_ids marks image tokens, which attend bidirectionally; the causal "
                "fused op does not compute that")
    return None


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``peft.PeftModel`` (itself for anything else)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and type(model).__name__.startswith("Peft") else model


def _model_config(model: nn.Module):
    config = getattr(_unwrap_peft(model), "config", None)
    if config is None:
        raise PatchRefused(f"patch_llama: {type(model).__name__} has no .config; pass a "
                         "transformers model (LlamaForCausalLM, Qwen2Model, ...)")
    model_type = getattr(config, "model_type", None)
    if model_type in MULTIMODAL:  # the text stack's config
        text = config.get_text_config()
        allowed = MULTIMODAL[model_type].text_types or frozenset(FAMILIES)
        if text is config or getattr(text, "model_type", None) not in allowed:
            raise PatchRefused(
                f"patch_llama: model_type {model_type!r} with a text config of model_type "
                f"{getattr(text, 'model_type', None)!r} is not supported (supported: "
                f"{', '.join(sorted(allowed))})")
        return text
    if moe.refusal(model_type):  # MoE families the op does not compute, with the reason
        raise PatchRefused(f"patch_llama: {moe.refusal(model_type)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PatchRefused(
            f"patch_llama: model_type {model_type!r} is not supported; supported are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (the fused op implements exactly their "
            "decoder layer: RMSNorm, RoPE, GQA causal attention, a gated MLP)")
    return config


def _attn_implementation(config) -> str:
    return getattr(config, "_attn_implementation", None) or "eager"


def _resolve_policy(policy: Policy, n_layers: int) -> List[str]:
    if policy == "auto":
        return ["auto"] * n_layers
    if isinstance(policy, str):
        return [check_policy(policy, "policy", PRESETS + ("auto",))] * n_layers
    if callable(policy):
        return [check_policy(policy(i), f"policy({i})") for i in range(n_layers)]
    if isinstance(policy, (list, tuple)):
        if len(policy) != n_layers:
            raise ValueError(f"policy: a list needs one preset per decoder layer ({n_layers} "
                             f"layers), got {len(policy)}")
        return [check_policy(p, f"policy[{i}]") for i, p in enumerate(policy)]
    raise TypeError("policy must be a preset name, a list of presets (one per layer) or a "
                    f"callable (layer_idx) -> preset; got {type(policy).__name__}")


# ---- what the fused op needs from a layer ----------------------------------------------------

def _structure_problem(layer: nn.Module, family: Family, hooks: bool = False,
                       projections: bool = True) -> Optional[str]:
    """Why the fused op cannot stand in for this layer's modules, or None (the checks of
    ckpt_ext.hf.layer_checks; an MoE layer's block is checked by ckpt_ext.hf.moe)."""
    if moe.is_moe_layer(layer):  # its MoE block checked there, the rest as a dense layer
        return moe.structure_problem(layer, family, hooks, projections)
    return _dense_structure_problem(layer, family, hooks, projections)


@functools.lru_cache(maxsize=None)
def _checkpoints_in_call(cls: type) -> bool:
    """Whether HF's gradient checkpointing of ``cls`` wraps ``__call__`` (transformers releases up
    to about 5.17: ``GradientCheckpointingLayer.__call__`` runs ``nn.Module.__call__``, and so an
    instance-level forward, under ``_gradient_checkpointing_func``) rather than the class forward
    (later releases), which an instance-level forward replaces."""
    code = getattr(cls.__call__, "__code__", None)
    return code is not None and "_gradient_checkpointing_func" in code.co_names


class _CallThrough:
    """A patched layer's ``_gradient_checkpointing_func`` where HF checkpoints in ``__call__``:
    it calls through, so that HF's checkpoint does not wrap the fused op, which keeps what it
    needs itself (else the layer would run its forward three times). ``_PatchedForward`` puts
    what it hands to HF's forward under ``checkpoint``, the function HF had set."""

    def __init__(self, checkpoint: Callable):
        self.checkpoint = checkpoint

    def __call__(self, function: Callable, *args, **kwargs):
        return function(*args, **kwargs)


def _take_over_call_checkpoint(layer: nn.Module) -> None:
    func = layer.__dict__.get("_gradient_checkpointing_func")
    if func is not None and not isinstance(func, _CallThrough) and \
            _checkpoints_in_call(type(layer)):
        layer._gradient_checkpointing_func = _CallThrough(func)


def _no_rope_tables(cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """cos = 1, sin = 0 at cos's shape: q * 1 + rotate_half(q) * 0 is q exactly, so a layer
    without RoPE runs the same op. Broadcast views of one element each: nothing sequence-sized
    is allocated or saved."""
    one = torch.ones((1, 1, 1), dtype=cos.dtype, device=cos.device)
    return one.expand(cos.shape), torch.zeros_like(one).expand(sin.shape)


def _tables_for(x: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """The rotary tables as the op takes them for ``x``. OLMo-2, OLMo-3 and ERNIE 4.5 hand
    their layers float32 tables whatever the model's dtype; for a float64 model HF's RoPE
    promotes them to float64 (exactly), so they are widened here. (A float16/bfloat16 input
    takes float32 tables as they are: the op's RoPE computes in float32.)"""
    if x.dtype == torch.float64 and cos.dtype != x.dtype:
        return cos.to(x.dtype), sin.to(x.dtype)
    return cos, sin


def _window(spec: LayerRecord, x: Tensor) -> Optional[int]:
    """The layer's window for this call (None when it covers the whole sequence)."""
    return spec.window if spec.window is not None and spec.window < x.shape[1] else None


_CAPPED_EMPTY_ROWS = (
    "rows with nothing to attend (left padding, or padding longer than the sliding window) "
    "under soft-capped eager attention: HF averages all values there, and that row's capped "
    "gradient is not a sum the fused op computes. Pad on the right (then the fused op runs), "
    "or use policy 'torch' for this model")


def _may_have_empty_rows(key_padding_mask: Optional[Tensor], window: Optional[int]) -> bool:
    """Whether some query row may attend no key: a causal row i sees keys
    max(0, i - window + 1) .. i, so it is empty when all of those are padding. One host sync
    (a bool of B*S elements); under torch.compile every padded batch counts as one that may."""
    if key_padding_mask is None:
        return False
    if torch.compiler.is_compiling():
        return True
    real = key_padding_mask.to(torch.int32).cumsum(1)
    if window is not None:
        real = real - torch.nn.functional.pad(real, (window, 0))[:, :real.shape[1]]
    return bool((real == 0).any())


def _attention_dropout(layer: nn.Module, config) -> float:
    return float(getattr(layer.self_attn, "attention_dropout",
                         getattr(config, "attention_dropout", 0.0)) or 0.0)


def _unfused_setting(layer: nn.Module, config) -> Optional[str]:
    """A setting that patch_llama refuses, set after patching, which HF's modules read at every
    call (so each call checks it, as attention dropout): OLMoE's ``clip_qkv`` (its attention
    clamps q/k/v after their projections) and, in training, Mixtral's router jitter (the MoE
    block's ``jitter_noise``, from ``router_jitter_noise``). None when there is none."""
    clip = getattr(getattr(layer.self_attn, "config", config), "clip_qkv", None)
    if clip is not None:
        return (f"clip_qkv={clip} (set after patching): q/k/v clamped after their projections, "
                "which the fused op does not compute")
    jitter = getattr(layer._modules.get("mlp"), "jitter_noise", 0.0)
    if layer.training and float(jitter or 0.0) > 0:
        return (f"jitter_noise={jitter} (router_jitter_noise, set after patching): random "
                "scaling of the MoE input in training, which the fused op does not compute")
    return None


def _check_fusable(layer: nn.Module, idx: int, config) -> LayerRecord:
    def refuse(why: str) -> PatchRefused:
        return PatchRefused(f"patch_llama: cannot fuse decoder layer {idx} "
                          f"({type(layer).__name__}): {why}. Use policy 'none' or 'torch' "
                          "for it (a list or callable policy picks per layer)")

    problem = _structure_problem(layer, FAMILIES[config.model_type], projections=False)
    if problem:
        raise refuse(problem)
    impl = _attn_implementation(config)
    if impl not in SUPPORTED_ATTENTION:
        raise refuse(
            f"attn_implementation={impl!r} is not supported (only {SUPPORTED_ATTENTION}). Load "
            "the model with attn_implementation='sdpa'; in training the fused op replaces the "
            "attention kernel anyway")
    dropout = _attention_dropout(layer, config)
    if dropout > 0:
        raise refuse(f"attention_dropout={dropout}: the fused op has no dropout to replay. Set "
                     "config.attention_dropout = 0.0 ('torch' replays dropout exactly)")
    if activation(layer) is None:
        mlp = layer.mlp._modules
        act = type(mlp.get("act_fn", mlp.get("activation_fn"))).__name__
        raise refuse(f"hidden_act={getattr(config, 'hidden_act', None)!r} (mlp.act_fn is a "
                     f"{act}): the fused MLP gates with SiLU (SwiGLU) or tanh-approximate GELU "
                     "(GeGLU)")
    try:
        return layer_record(layer, config)
    except (ValueError, NotImplementedError) as e:  # a shape or setting the op does not take
        raise refuse(str(e)) from None


# ---- state shared by the layers of one patched model ------------------------------------------

class _ForwardState(NamedTuple):
    """What one model forward hands its layers: the masks its inputs describe and, with
    policy="auto", the presets chosen for its shapes. It travels with the forward's own call
    (a keyword argument the bare model passes to every layer), so concurrent forwards of one
    model, from several threads, each see their own."""

    masks: BatchMasks
    presets: Optional[List[str]]
    # _may_have_empty_rows of the forward's padding mask, per sliding window (None: full
    # causal): one host sync per window and forward, not per layer call
    empty_rows: Dict[Optional[int], bool]
    # the sequence-parallel group of this forward, by name: patch_llama's sequence_parallel, or
    # DeepSpeed Ulysses' group while its wrapper is transformers' attention function (the fused
    # layers then take part in it, ckpt_ext.hf.sequence_split.deepspeed_ulysses_group)
    sequence_parallel: str = ""
    # router_aux_loss="fused": the list (moe.RouterStats) to which this forward's fused MoE
    # layers append their (3, E) load-balancing statistics; the fused LM head hands it to the
    # bare model under moe.ROUTER_STATS_KEY. None: the layers return their router logits
    # when transformers collects them.
    router_stats: Optional[list] = None
    # segment_layers > 1 in a training forward: the forward's chain of segments
    # (ckpt_ext.segments), which each fused layer call joins
    segments: Optional[_segments.Chain] = None
    # the chunk rule's token rows a chunk per fused preset (the op's chunk_rows,
    # ckpt_ext.plan.choose_chunk_rows), for this forward's shapes; None: the cap's rows
    chunk_rows: Optional[Dict[str, int]] = None


# The keyword under which the bare model's pre-hook hands the layers a _ForwardState.
_FORWARD_KEY = "ckpt_ext_forward"


def _host_link_default() -> float:
    from ..plan import HOST_LINK_GBYTES_PER_S
    return HOST_LINK_GBYTES_PER_S


class _Shared:
    """State shared by the layers of one patched model (none of it per forward): the policy,
    the "auto" choices per shape, the warnings given, and the pre-hook on the bare model that
    hands each forward's layers its _ForwardState."""

    def __init__(self, owner: nn.Module, layers: nn.ModuleList, default_policy: bool,
                 budget: Optional[int] = None, offloader=None, host_link: Optional[float] = None,
                 hook_owner: Optional[nn.Module] = None, bidirectional_images: bool = False,
                 auto_policy: bool = False):
        self.owner, self.layers, self.default_policy = owner, layers, default_policy
        # The module whose pre-hook reads the batch's masks: the bare model, or the multimodal
        # model around its language model (owner), which receives them 2-D (_mask_owner)
        self.hook_owner = owner if hook_owner is None else hook_owner
        self.bidirectional_images = bidirectional_images  # batches with images run HF's
        self.auto_policy = auto_policy or budget is not None   # policy="auto"
        self.budget = budget                   # policy="auto": the decoder layers' budget
        self.offloader = offloader             # offload="cpu": the model's ckpt_ext.offload
        self.host_link = _host_link_default() if host_link is None else host_link  # GB/s
        self.auto: dict = {}                   # (B, S, dtype) -> presets, one per layer
        # auto with offload, where no mix of presets fits: the same keys -> (k, why): min_memory
        # in segments of k layers (the plan's choose_segment_layers), and the error the mix's
        # search gave (raised instead where segments are not built: _auto_segments_problem)
        self.auto_segments: dict = {}
        self.rows: dict = {}                   # (B, S, ..., presets) -> the chunk rule's rows
        self.warned: set = set()
        params = [p for p in inspect.signature(type(self.hook_owner).forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        self.positional = [p.name for p in params]

    sequence_parallel = ""  # patch_llama's group, by name (ckpt_ext.hf.sequence_parallel)
    segment_layers = 1      # patch_llama's segment_layers (ckpt_ext.segments)
    router_aux_loss = "exact"  # patch_llama's router_aux_loss

    def __setstate__(self, state):  # pickles of older versions kept per-forward fields
        state.pop("masks", None)
        state.pop("auto_presets", None)
        state.pop("router_stats", None)
        state.setdefault("offloader", None)
        state.setdefault("host_link", _host_link_default())
        state.setdefault("hook_owner", state["owner"])
        state.setdefault("bidirectional_images", False)
        state.setdefault("auto_policy", state.get("budget") is not None)
        state.setdefault("rows", {})
        state.setdefault("auto_segments", {})
        self.__dict__.update(state)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"ckpt_ext.patch_llama: {message}", stacklevel=4)

    def forward_group(self) -> str:
        """The sequence-parallel group of a forward starting now, by name ("" for none):
        patch_llama's ``sequence_parallel``, else DeepSpeed Ulysses' group while its wrapper is
        the attention function (HF Trainer / TRL with ParallelismConfig(sp_size=N), registered
        before or after patching: the fused layers take part in it; HF's layers, policy
        "torch", delegated or without grad, call its wrapper). Read on every rank alike."""
        sp = self.sequence_parallel
        impl = _attn_implementation(self.owner.config)
        if not sp and torch.is_grad_enabled() and impl in SUPPORTED_ATTENTION:
            group = deepspeed_ulysses_group(impl, training=self.owner.training)
            if group is not None:
                sp = _sp.group_name(group)
        return sp

    def before_model(self, owner, args, kwargs):
        # Sequence parallelism replaced the attention that fused layers would bypass: refuse
        # (ckpt_ext.hf.sequence_split; other attn_implementations make the layers delegate).
        impl = _attn_implementation(self.owner.config)
        sp = self.forward_group()
        segmented = self.segment_layers > 1 and torch.is_grad_enabled()
        if segmented:  # before anything of ZeRO-3 or sequence parallelism runs
            _refuse_segments_now(self, sp)
        refuse_split_attention(impl, lambda: [f.idx for f in _patched(self.layers)
                                              if f.preset != "torch"]
                               if impl in SUPPORTED_ATTENTION else [],
                               sequence_parallel=bool(self.sequence_parallel))
        if not torch.compiler.is_compiling():  # HF checkpointing turned on after patching
            for patched in _patched(self.layers):
                _take_over_call_checkpoint(patched.layer)
            # ZeRO-3 set up after patching: the layers' hooks, which run after this one,
            # then gather all of each fused layer's parameters (ckpt_ext.hf.zero).
            zero.make_leaves(self.fused_layers())
        # the fused LM head's list for this forward's router statistics (router_aux_loss=
        # "fused"), taken out of the bare model's keywords into the forward's state
        stats = kwargs.get(moe.ROUTER_STATS_KEY)
        kwargs = {k: v for k, v in kwargs.items() if k != moe.ROUTER_STATS_KEY}
        named = dict(zip(self.positional, args), **kwargs)
        compiling = torch.compiler.is_compiling()
        positions = text_positions(self.owner.config.model_type, named.get("position_ids"))
        masks = describe(named.get("attention_mask"), positions, compiling) \
            if not sp else _sp.masks(sp, named.get("attention_mask"), positions)
        if self.bidirectional_images and masks.custom is None:
            images = _image_inputs(named, compiling)
            if images is not None:
                masks = BatchMasks(custom=images)
        presets = self.choose(named) if self.auto_policy else None
        k = self.segment_layers
        if presets is not None and self.offloader is not None and torch.is_grad_enabled():
            k = self.auto_segment_layers(named, sp)   # auto's segments (1: none)
        chain = _segments.Chain(k) if k > 1 and torch.is_grad_enabled() else None
        # the chunk rule's rows: not under sequence parallelism, nor in segments (whose
        # rebuilt inputs the rule's peak model does not count): the cap's rows there
        rows = self.chunk_rows(named, presets) if not sp and chain is None else None
        return args, {**kwargs, _FORWARD_KEY: _ForwardState(masks, presets, {}, sp, stats,
                                                            chain, rows)}

    def choose(self, named) -> Optional[List[str]]:
        """policy="auto": the presets of this forward's shapes (cached per shape and dtype)."""
        shapes = self._shapes(named)
        if shapes is None:
            return None
        return self._choice(*shapes)

    def auto_segment_layers(self, named, sp: str) -> int:
        """policy="auto" with offload, in a training forward: the segments' k of this forward's
        shapes (1 unless the offload choice fell back to segments, ``_offload_choice``). Where
        segments are not built (``_auto_segments_problem``) a k > 1 raises the ValueError of
        the mix's search instead, with the reason."""
        shapes = self._shapes(named)
        if shapes is None:
            return 1
        k = self._auto_k(*shapes)
        if k > 1:
            problem = _auto_segments_problem(self, sp)
            if problem:
                _refuse_auto_segments(self.auto_segments[self._key(*shapes)], problem)
        return k

    @staticmethod
    def _key(b: int, s: int, dtype: torch.dtype, train_weights: bool, lora_rank: int = 0,
             expert_lora_rank: int = 0, device: str = "cpu", dequantized: int = 0) -> tuple:
        """The cache key of auto's choices for one shape (``self.auto``, ``auto_segments``)."""
        return (b, s, dtype, train_weights, lora_rank, expert_lora_rank) + \
            ((dequantized,) if dequantized else ())

    @torch.compiler.assume_constant_result
    def _auto_k(self, *shapes) -> int:
        """The segments' k that ``_choice`` chose for these shapes (1: none); a constant to
        torch.compile, as ``_choice`` is."""
        return self.auto_segments.get(self._key(*shapes), (1, ""))[0]

    def chunk_rows(self, named, presets: Optional[List[str]]) -> Optional[Dict[str, int]]:
        """The chunk rule's rows a chunk per fused preset of this forward
        (ckpt_ext.plan.choose_chunk_rows, cached per shape), or None (the op's default: the
        byte cap's rows): when no chunk_bytes is pinned (ckpt_ext.config.chunk_bytes_pinned),
        without offload, and with a budget known (``chunk_room``). ``presets``: auto's choice
        for this forward, else each layer's patched preset. Forwards without grad (which the
        layers delegate to HF's forward) get none."""
        if self.offloader is not None or self.sequence_parallel or not torch.is_grad_enabled():
            return None
        from .. import config
        if config.chunk_bytes_pinned():
            return None
        shapes = self._shapes(named)
        if shapes is None:
            return None
        if presets is None:
            presets = [f.preset if isinstance(f, _PatchedForward) else "none"
                       for f in (layer.__dict__.get("forward") for layer in self.layers)]
            if "auto" in presets:
                return None
        rows = self._rows(*shapes, presets=tuple(presets),
                          chunk_bytes=config.current().chunk_bytes)
        return dict(rows) if rows else None

    def chunk_room(self, device: str, train_weights: bool, dequantized: int = 0
                   ) -> Optional[int]:
        """The bytes the chunk rule fits a step in: activation_budget (less QLoRA's
        ``dequantized`` transient), else on CUDA the device's room for the step
        (``device_room``), else None (no budget known: the cap's rows). Parameters sharded by
        ZeRO-3 or FSDP2 are out of device_room's count, so with them only activation_budget
        gives one."""
        if self.budget is not None:
            return self.budget - dequantized
        if device.startswith("cuda") and not any(
                hasattr(p, "ds_id") or hasattr(p, "_local_tensor")
                for p in self.owner.parameters()):
            return self.device_room(device, train_weights)
        return None

    @torch.compiler.assume_constant_result
    def _rows(self, b: int, s: int, dtype: torch.dtype, train_weights: bool,
              lora_rank: int = 0, expert_lora_rank: int = 0, device: str = "cpu",
              dequantized: int = 0, *, presets: tuple = (), chunk_bytes: int = 0) -> tuple:
        """((preset, rows), ...) of the chunk rule for one shape and mix of presets, cached;
        () when no budget is known. The mix's saved bytes are its layers' at their presets
        (ckpt_ext.plan's models of HF's layer for "none" and "torch")."""
        key = (b, s, dtype, train_weights, lora_rank, expert_lora_rank, dequantized, presets,
               chunk_bytes)
        if key in self.rows:
            return self.rows[key]
        room = self.chunk_room(device, train_weights, dequantized)
        fused = sorted(set(presets) & set(FUSED_PRESETS))
        out = ()
        if room is not None and fused:
            from ..plan import _saved_bytes, choose_chunk_rows
            from ..throughputs import default_throughputs
            dims = self.layer_dims()
            saved = sum(_saved_bytes(p, x, b, s, dtype, train_weights)
                        for p, x in zip(presets, dims))
            out = tuple(
                (p, c.rows) for p, c in (
                    (p, choose_chunk_rows(
                        p, dims, int(self.owner.config.vocab_size), b, s, dtype, room=room,
                        saved=saved, path="cuda" if device.startswith("cuda") else "cpu",
                        train_weights=train_weights, lora_rank=lora_rank,
                        expert_lora_rank=expert_lora_rank, chunk_bytes=chunk_bytes,
                        quantized_base=bool(dequantized), throughputs=default_throughputs()))
                    for p in fused) if c.fits)
        self.rows[key] = out
        return out

    def _shapes(self, named) -> Optional[tuple]:
        """(B, S, dtype, train_weights, lora rank, expert lora rank, device, dequantized) of
        this forward, what the plan's choices read; None without a (B, S, ...) input."""
        x = named.get("input_ids")
        x = named.get("inputs_embeds") if x is None else x
        if x is None or x.dim() < 2:
            return None
        # Any floating parameter of the first layer gives the dtype and device (post-norm
        # families such as OLMo-2 and EXAONE 4.0 have no input norm)
        weight = next(p for p in self.layers[0].parameters() if p.is_floating_point())
        device = weight.device.type
        dtype = weight.dtype
        if torch.is_autocast_enabled(device) and weight.dtype == torch.float32:
            dtype = torch.float32  # residuals stay fp32; the compute dtype only saves less
        # LoRA and other frozen bases: no weight gradients of the projections (the time model)
        train_weights = any(p.requires_grad for layer in self.layers
                            for n, p in layer.named_parameters()
                            if p.dim() >= 2 and "lora_" not in n)
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else dtype
        return (int(x.shape[0]), int(x.shape[1]), dtype, train_weights, *self.lora_ranks(),
                str(weight.device), self.dequantized_bytes(compute.itemsize))

    @torch.compiler.assume_constant_result
    def dequantized_bytes(self, itemsize: int) -> int:
        """QLoRA: the bytes of the largest layer's dequantized projections at ``itemsize``
        (what a fused layer holds through each of its passes, one layer at a time:
        ckpt_ext.hf.quantized), 0 without bitsandbytes layers."""
        return itemsize * max(sum(m.in_features * m.out_features for m in layer.modules()
                                  if quantized.is_quantized_base(m))
                              for layer in self.layers)

    @torch.compiler.assume_constant_result
    def lora_ranks(self) -> Tuple[int, int]:
        """(dense rank, expert rank) of the layers' PEFT adapters (the largest), 0 where there
        are none: the time model's LoRA GEMMs (ckpt_ext.plan counts them on every
        projection). A dense ``lora_A`` is (r, in); an expert one (r * E, in)."""
        dense = experts = 0
        dims = None          # the layers' shapes, read only for expert adapters
        for i, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                if ".lora_A." not in name or p.dim() != 2:
                    continue
                if ".experts." in name:
                    dims = self.layer_dims() if dims is None else dims
                    if dims[i].experts:
                        experts = max(experts, p.shape[0] // dims[i].experts)
                        continue
                dense = max(dense, p.shape[0])
        return dense, experts

    def device_room(self, device: str, train_weights: bool) -> int:
        """policy="auto" without activation_budget on a CUDA device: the bytes a step may take,
        the device's memory less the model state (ckpt_ext.plan.parameter_state_bytes of the
        bare model's parameters, and an untied LM head's V x H weight beside them, trained with
        the embeddings or not) and the headroom (ckpt_ext.plan.headroom_bytes)."""
        from ..plan import headroom_bytes, parameter_state_bytes
        if not device.startswith("cuda"):
            raise ValueError("patch_llama: policy='auto' on the CPU (or another device that is "
                             f"not CUDA: {device}) needs activation_budget (bytes, or a string "
                             "such as '20GiB'); on CUDA the device's memory less the model "
                             "state and headroom is the budget")
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        params = list(self.owner.parameters())
        state = parameter_state_bytes(params)
        config = self.owner.config
        if not getattr(config, "tie_word_embeddings", False):
            embed = self.owner.get_input_embeddings().weight
            head = embed.numel() * embed.element_size()
            state += 4 * head if embed.requires_grad else head
        return total - state - headroom_bytes(total)

    def _offload_choice(self, b: int, s: int, dtype: torch.dtype, train_weights: bool,
                        lora_rank: int = 0, expert_lora_rank: int = 0,
                        room: Optional[int] = None, dequantized: int = 0
                        ) -> Tuple[List[str], Optional[Tuple[int, str]]]:
        """policy="auto" with offload: the plan's choice by time (ckpt_ext.plan.
        choose_offload_layers) within the activation budget, which bounds what the device
        holds of the layers (the offloader's prefetch pool and the layers past its limit),
        and the offloader's host limit, at the plan's throughputs and the host link rate.
        Without a budget (``room``: the device's bytes for the step, ``device_room``) each
        preset's working set (ckpt_ext.plan.step_peak less its layers' saved bytes) counts
        in the device's bytes too. ``dequantized``: QLoRA's transient (``dequantized_bytes``),
        held besides: taken off the budget, or in the working sets (step_peak's
        quantized_base). Returns (presets, None), or where no mix fits and the host limit
        binds, (min_memory everywhere, (k, the search's error)): ``_segment_fallback``.
        With streamed inputs (``offload_stream``) every layer runs ``min_memory``, streamed,
        in segments of the k (1 included) that ``_segment_fallback`` picks by time."""
        from ..plan import choose_offload_layers, format_bytes, layer_bytes, step_peak
        from ..throughputs import default_throughputs
        dims = self.layer_dims()
        off = self.offloader
        if off.stream:
            message = (f"auto with offload_stream=True: min_memory with streamed inputs "
                       f"does not fit at B={b}, S={s} in any segment length")
            k = self._segment_fallback(message, b, s, dtype, train_weights, lora_rank,
                                       expert_lora_rank, room, dequantized)
            return ["min_memory"] * len(dims), (k, message)
        working = None
        if room is not None:
            vocab = int(self.owner.config.vocab_size)
            working = {p: step_peak(p, dims, vocab, b, s, dtype, train_weights=train_weights,
                                    quantized_base=bool(dequantized)).peak
                       - sum(layer_bytes(p, x, b, s, dtype) for x in dims)
                       for p in ("fast", "balanced", "min_memory")}
        choice = choose_offload_layers(
            dims, b, s, dtype, self.budget - dequantized if room is None else room, off.limit,
            working=working, train_weights=train_weights,
            lora_rank=lora_rank, expert_lora_rank=expert_lora_rank, prefetch=off.prefetch,
            host_link_gbytes_per_s=self.host_link,
            **default_throughputs().step_time_kwargs(s))
        if choice is None:
            from ..plan import _offload_split, _pool
            mins = ["min_memory"] * len(dims)
            moved, _, kept = _offload_split(dims, mins, b, s, dtype, off.limit)
            pool = _pool(moved, off.prefetch)
            if room is not None:
                message = (f"auto with offload: the device's {format_bytes(room)} for "
                           f"the step hold no mix of presets at B={b}, S={s}: the "
                           f"prefetch pool at min_memory ({format_bytes(pool)}) plus the "
                           f"layers past offload_limit ({format_bytes(kept)}) plus "
                           f"min_memory's working set ({format_bytes(working['min_memory'])})"
                           "; shorten the sequence or the batch")
            else:
                message = (f"activation_budget {format_bytes(self.budget)} is below the "
                           f"offload prefetch pool at min_memory ({format_bytes(pool)}) plus "
                           f"the layers past offload_limit ({format_bytes(kept)})"
                           + _dequantized_words(dequantized) + f" at B={b}, S={s}; the "
                           f"smallest budget that fits is {pool + kept + dequantized}")
            if off.limit is None:   # no host cap: segments hold no less on the device
                raise ValueError(message)
            k = self._segment_fallback(message, b, s, dtype, train_weights, lora_rank,
                                       expert_lora_rank, room, dequantized)
            return mins, (k, message)
        return list(choice.presets), None

    def _segment_fallback(self, message: str, b: int, s: int, dtype: torch.dtype,
                          train_weights: bool, lora_rank: int, expert_lora_rank: int,
                          room: Optional[int], dequantized: int) -> int:
        """auto with offload where no mix of presets fits and offload_limit binds: the k of
        ``min_memory`` in segments of k layers, chosen by time by the plan
        (ckpt_ext.plan.choose_segment_layers, with offload_limit as the host memory) among
        those that fit: the device's ``room`` for the step (its step peak), or with
        activation_budget (less QLoRA's ``dequantized``) what the device holds of the layers
        (the prefetch pool, the segment inputs past offload_limit and the running segment's
        rebuilt inputs: ``layers_only``), as the budget bounds for the mixes; with streamed
        inputs, the streamed step (the plan's ``stream``). Raises ValueError naming both when
        no k fits either."""
        from ..plan import choose_segment_layers
        from ..throughputs import default_throughputs
        off = self.offloader
        try:
            seg = choose_segment_layers(
                self.layer_dims(), int(self.owner.config.vocab_size), b, s, dtype,
                self.budget - dequantized if room is None else room, off.limit, offload=True,
                path="cpu" if room is None else "cuda", train_weights=train_weights,
                quantized_base=bool(dequantized), lora_rank=lora_rank,
                expert_lora_rank=expert_lora_rank, prefetch=off.prefetch,
                host_link_gbytes_per_s=self.host_link, layers_only=room is None,
                stream=off.stream, **default_throughputs().step_time_kwargs(s))
        except ValueError as e:
            raise ValueError(f"{message}; nor does min_memory in segments of several layers "
                             f"(patch_llama's segment_layers, which auto tries when "
                             f"offload_limit binds): {e}") from None
        return seg.segment_layers

    @torch.compiler.assume_constant_result
    def _choice(self, b: int, s: int, dtype: torch.dtype, train_weights: bool,
                lora_rank: int = 0, expert_lora_rank: int = 0,
                device: str = "cpu", dequantized: int = 0) -> List[str]:
        """The presets for one shape, cached; a constant to torch.compile, which guards on
        the shapes it is called with (the choice depends on nothing else). Without offload
        the plan's choice by time over every way a layer can run (ckpt_ext.plan.choose_auto:
        HF's layer, its torch.utils.checkpoint run, the fused presets) within
        activation_budget (the layers' saved bytes), or without one on CUDA within the
        device's room for the step (``device_room``). ``dequantized``: QLoRA's transient
        (``dequantized_bytes``), held besides the layers' saved bytes: taken off the budget,
        or in the working sets against the device's room."""
        key = self._key(b, s, dtype, train_weights, lora_rank, expert_lora_rank, device,
                        dequantized)
        if key in self.auto:
            return self.auto[key]
        room = self.device_room(device, train_weights) if self.budget is None else None
        if self.offloader is not None:
            presets, segments = self._offload_choice(b, s, dtype, train_weights, lora_rank,
                                                     expert_lora_rank, room=room,
                                                     dequantized=dequantized)
            if segments is not None:
                self.auto_segments[key] = segments
            self.auto[key] = presets
        else:
            from ..plan import choose_auto, format_bytes
            from ..throughputs import default_throughputs
            rates = default_throughputs()
            budget = self.budget - dequantized if self.budget is not None else None
            try:   # the presets; the chunk rows follow them (chunk_rows)
                choice = choose_auto(self.layer_dims(), int(self.owner.config.vocab_size), b,
                                     s, dtype, room=room, budget=budget,
                                     path="cuda" if device.startswith("cuda") else "cpu",
                                     train_weights=train_weights, lora_rank=lora_rank,
                                     expert_lora_rank=expert_lora_rank,
                                     quantized_base=bool(dequantized), chunk_rule=False,
                                     overheads=rates.overheads, **rates.step_time_kwargs(s))
            except ValueError as e:
                if not dequantized or budget is None:
                    raise
                raise ValueError(f"{e} (QLoRA: activation_budget {self.budget} bytes less "
                                 f"one layer's dequantized weights, {dequantized} bytes "
                                 f"({format_bytes(dequantized)}), which it holds too)") from None
            self.auto[key] = list(choice.presets)
        return self.auto[key]

    def layer_dims(self) -> List[LayerDims]:
        """The layers' shapes (their records' dims, as families.layer_dims reads them)."""
        config = self.owner.config
        return [layer_dims(layer, int(config.num_attention_heads),
                           FAMILIES[config.model_type]) for layer in self.layers]

    def fused_layers(self) -> List[nn.Module]:
        """The layers whose training forward can be the fused op."""
        return [f.layer for f in _patched(self.layers) if f.preset != "torch"]

    def install(self) -> None:
        self.hook_owner.register_forward_pre_hook(self.before_model, with_kwargs=True)

    @staticmethod
    def remove_from(module: nn.Module) -> None:
        """Remove every hook of a ``_Shared`` from ``module`` (found by the hook's owner, so
        that this also works in a deepcopy or unpickled copy of a patched model, and after a
        patch that fused no layer: policy="none" installs the hook all the same)."""
        for hooks, extras in ((module._forward_pre_hooks,
                               (module._forward_pre_hooks_with_kwargs,)),
                              (module._forward_hooks, (module._forward_hooks_with_kwargs,
                                                       module._forward_hooks_always_called))):
            for key in [k for k, h in hooks.items()
                        if isinstance(getattr(h, "__self__", None), _Shared)]:
                del hooks[key]
                for extra in extras:
                    extra.pop(key, None)


_CACHE = ("use_cache=True or a KV cache (cache= / past_key_values=) was given: the cache must "
          "be filled, so HF's forward runs. transformers defaults to use_cache=True even for training forwards: "
          "pass use_cache=False to the model, or set model.config.use_cache = False (a "
          "multimodal model's: model.config.text_config.use_cache)")
_HF_GC_DEFAULT = ("HF gradient checkpointing is enabled: fused layers with the default policy "
                  "use 'min_memory', which keeps only each layer's input, as HF's "
                  "checkpointing does, and recomputes less; HF's checkpoint is skipped for them")
_HF_GC_EXPLICIT = ("HF gradient checkpointing is enabled, and the fused layers keep what the "
                   "policy says: {presets} keep more than the layer input that HF's "
                   "checkpointing keeps. Use policy='min_memory' (or the default) to hold no "
                   "more than HF's checkpointing")


class _PatchedForward:
    """The instance-level ``forward`` of a patched decoder layer (see the module docstring).
    ``calls`` counts the calls by path: ``fused``, ``torch``, ``delegated: <reason>``."""

    ckpt_ext_patched = True  # ours, not another library's forward (layer_checks.foreign_forward)

    def __init__(self, layer: nn.Module, idx: int, preset: str, spec: Optional[LayerRecord],
                 shared: _Shared, config):
        self.layer, self.idx, self.preset, self.spec = layer, idx, preset, spec
        self.shared, self.config = shared, config
        params = inspect.signature(self.original).parameters.values()
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        self.calls: collections.Counter = collections.Counter()
        self.__signature__ = inspect.signature(self.original)  # what HF's forward declares
        # QLoRA: a layer with bitsandbytes projections runs in eager mode under torch.compile
        # (_eager_call), where its dequantized weights' placeholders and hooks work
        self.quantized = any(quantized.is_quantized_base(m) for m in layer.modules())

    @property
    def original(self) -> Callable:
        """HF's forward: the class attribute, bound to the layer."""
        return functools.partial(type(self.layer).forward, self.layer)

    def __repr__(self) -> str:
        return f"<ckpt_ext patched forward: layer {self.idx}, preset {self.preset!r}>"

    def _count(self, key: str) -> None:
        if not torch.compiler.is_compiling():
            self.calls[key] += 1

    def __call__(self, hidden_states: Tensor, *args, **kwargs):
        if getattr(self, "quantized", False) and torch.compiler.is_compiling():
            return _eager_call(self, hidden_states, *args, **kwargs)
        # This forward's masks and presets, from the model's pre-hook (None when the layer is
        # called outside its model's forward).
        state = kwargs.pop(_FORWARD_KEY, None)
        if args:  # HF passes all but hidden_states by keyword; name any positional ones
            if len(args) > len(self.positional):
                raise TypeError(f"{type(self.layer).__name__}.forward takes at most "
                                f"{len(self.positional) + 1} positional arguments")
            kwargs.update(zip(self.positional, args))
        if not torch.is_grad_enabled() and not self.shared.sequence_parallel:
            return self._delegate("grad is disabled (inference)", hidden_states, kwargs)
        # patch_llama's sequence_parallel, or DeepSpeed Ulysses' group (the model's pre-hook)
        sp = self.shared.sequence_parallel or (state.sequence_parallel if state is not None
                                               else "")
        if uses_cache(kwargs):
            return self._delegate(_CACHE, hidden_states, kwargs, warn=self.layer.training, sp=sp)
        hf_checkpointing = self.layer.training and bool(
            getattr(self.layer, "gradient_checkpointing", False))
        preset = self.preset
        if preset == "auto":  # chosen for this forward's shapes; min_memory outside one
            chosen = state.presets if state is not None else None
            preset = chosen[self.idx] if chosen is not None else "min_memory"
        if preset == "none":   # policy="auto" chose HF's layer as it is
            self._count("none")
            return self._hf_forward(hidden_states, kwargs)
        if preset == "torch":
            self._count("torch")
            if hf_checkpointing:  # HF checkpoints the layer: once is enough
                return self._hf_forward(hidden_states, kwargs)
            return torch_checkpoint(self.original, hidden_states, use_reentrant=False, **kwargs)
        if hf_checkpointing:
            if self.shared.default_policy:
                preset = "min_memory"
                self.shared.warn_once("hf checkpointing", _HF_GC_DEFAULT)
            elif preset not in ("min_memory", "auto") and self.preset != "auto" and \
                    "hf checkpointing" not in self.shared.warned:
                self.shared.warn_once("hf checkpointing", _HF_GC_EXPLICIT.format(
                    presets=sorted({f.preset for f in _patched(self.shared.layers)} - {"min_memory",
                                                                                      "torch"})))
        reason, masks = self._why_not_fused(hidden_states, kwargs, state)
        read = moe.layer_tensors if self.spec.num_experts_per_tok else _layer_tensors
        tensors = read(self.layer, self.spec.source, self.spec.fused) if reason is None else None
        if isinstance(tensors, str):
            reason = tensors
        if reason is not None:
            return self._delegate(reason, hidden_states, kwargs, warn=True, sp=sp)
        self._count("fused")
        return self._fused(hidden_states, kwargs["position_embeddings"], masks, preset, *tensors,
                           sp=sp, stats=state.router_stats if state is not None else None,
                           chain=state.segments if state is not None else None,
                           chunk_rows=state.chunk_rows if state is not None and not sp
                           else None)

    def _delegate(self, reason: str, hidden_states: Tensor, kwargs, warn: bool = False,
                  sp: Optional[str] = None):
        sp = self.shared.sequence_parallel if sp is None else sp
        if sp:  # on every rank (the others at their same_seed)
            _sp.refuse(sp, RuntimeError(
                f"ckpt_ext.patch_llama(sequence_parallel=...): decoder layer {self.idx} cannot "
                f"run the fused op ({reason}), and HF's forward would attend over this rank's "
                "tokens only" if self.shared.sequence_parallel else
                f"ckpt_ext.patch_llama: decoder layer {self.idx} cannot run the fused op "
                f"({reason}) under DeepSpeed Ulysses, whose group the fused layers take part "
                "in; the other ranks run the fused op, so no rank goes on"))
        self._count(f"delegated: {reason}")
        if warn:
            self.shared.warn_once(reason, f"a training forward of decoder layer {self.idx} "
                                  f"(preset {self.preset!r}) ran HF's forward, not the fused "
                                  f"op: {reason} (warned once per reason)")
        return self._hf_forward(hidden_states, kwargs)

    def _hf_forward(self, hidden_states: Tensor, kwargs):
        """HF's forward, under HF's checkpoint where ``_CallThrough`` took it out of HF's
        ``__call__`` (the class forward of later transformers applies it itself)."""
        layer = self.layer
        call = layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(call, _CallThrough) and layer.gradient_checkpointing and layer.training \
                and torch.is_grad_enabled():
            return call.checkpoint(functools.partial(self.original, **kwargs), hidden_states)
        return self.original(hidden_states, **kwargs)

    def _masks(self, x: Tensor, kwargs, state: Optional[_ForwardState]
               ) -> Tuple[Optional[str], BatchMasks]:
        """The masks of this call: those the model's inputs describe inside a model forward;
        outside one (a layer called directly), the 4-D mask checked to be causal + padding."""
        masks = state.masks if state is not None else None
        if masks is None:
            mask = kwargs.get("attention_mask")
            if mask is None:
                if _attn_implementation(self.config) == "eager":
                    return "attention_mask=None with eager attention means no mask at all", \
                        BatchMasks()
                return None, BatchMasks()
            ok, kpm = padding_mask_from_4d(mask, x.shape[0], x.shape[1])
            if not ok:
                return ("the attention mask is not exactly causal + key padding (the layer was "
                        "called outside its model's forward)"), BatchMasks()
            return None, BatchMasks(key_padding_mask=kpm)
        if masks.custom is not None:
            return masks.custom, masks
        for t in (masks.key_padding_mask, masks.segment_ids):
            if t is not None and tuple(t.shape) != tuple(x.shape[:2]):
                return (f"the model's masks of shape {tuple(t.shape)} do not fit hidden_states "
                        f"{tuple(x.shape)}"), masks
        return None, masks

    def _why_not_fused(self, x: Tensor, kwargs, state: Optional[_ForwardState]
                       ) -> Tuple[Optional[str], BatchMasks]:
        """Why this call cannot go through the fused op (or None), and its masks."""
        layer, spec = self.layer, self.spec
        impl = _attn_implementation(self.config)
        if impl not in SUPPORTED_ATTENTION:
            return f"attn_implementation is now {impl!r}", BatchMasks()
        if kwargs.get("output_attentions"):
            return f"output_attentions=True, and the fused op never forms attention weights: " \
                f"{_ATTENTIONS_FIX}", BatchMasks()
        if layer.training and _attention_dropout(layer, self.config) > 0:
            return "attention_dropout > 0 (set after patching)", BatchMasks()
        unfused = _unfused_setting(layer, self.config)
        if unfused:
            return unfused, BatchMasks()
        if kwargs.get("is_causal") is False or not getattr(layer.self_attn, "is_causal", True):
            return "attention is not causal (is_causal=False)", BatchMasks()
        problem = _structure_problem(layer, spec.source, hooks=True,
                                     projections=False)  # read once, later
        if problem:
            return problem, BatchMasks()
        pe = kwargs.get("position_embeddings")
        if pe is None:
            return "position_embeddings was not given", BatchMasks()
        cos, sin = pe
        # cos/sin narrower than head_dim: partial rotary embeddings (Phi-4-mini)
        if x.dim() != 3 or cos.dim() != 3 or cos.shape[1] != x.shape[1] \
                or cos.shape[2] > spec.dims.head_dim or cos.shape[2] % 2 \
                or cos.shape[0] not in (1, x.shape[0]) or sin.shape != cos.shape:
            return (f"position_embeddings of shape {tuple(cos.shape)} do not fit hidden_states "
                    f"{tuple(x.shape)} and head_dim {spec.dims.head_dim}"), BatchMasks()
        if cos.requires_grad or sin.requires_grad:
            return "cos/sin require grad", BatchMasks()
        reason, masks = self._masks(x, kwargs, state)
        if reason is None and spec.softcap and impl == "eager":
            window = _window(spec, x)
            cache = state.empty_rows if state is not None and state.masks is masks else {}
            if window not in cache:
                cache[window] = _may_have_empty_rows(masks.key_padding_mask, window)
            if cache[window]:
                reason = _CAPPED_EMPTY_ROWS
        return reason, masks

    def _fused(self, x: Tensor, position_embeddings, masks: BatchMasks, preset: str,
               weights: list, scaling: list, dropout: list, streams: list,
               expert_scaling: Sequence[float] = (), sp: Optional[str] = None,
               stats: Optional[list] = None,
               chain: Optional[_segments.Chain] = None,
               chunk_rows: Optional[Dict[str, int]] = None) -> Tensor:
        sp = self.shared.sequence_parallel if sp is None else sp
        spec = self.spec
        cos, sin = _tables_for(x, *position_embeddings)
        if not spec.rope:
            cos, sin = _no_rope_tables(cos, sin)
        window = _window(spec, x)
        # LoRA dropout: a fresh seed per call from torch's CPU generator (torch.manual_seed
        # fixes it; checkpointing's RNG replay redraws the same one); the op hashes its masks
        # from it and saves it for the backward.
        seed = torch.randint(2**31 - 1, (), dtype=torch.int64) if dropout else None
        # an MoE layer returns its load-balancing statistics to the forward's list while the
        # fused head collects them (router_aux_loss="fused"), else its router logits while
        # transformers does
        stats_sink = stats if spec.num_experts_per_tok else None
        router_stats = stats_sink is not None
        router_logits = (bool(spec.num_experts_per_tok) and not router_stats
                         and moe.recording_router_logits())
        if sp:  # one seed for the group: masks hash global rows; router outputs alike
            refusal = None
            if router_logits:
                refusal = NotImplementedError(
                    f"patch_llama: {moe.SP_BARE_REFUSAL}"
                    if self.shared.router_aux_loss == "fused" else
                    f"patch_llama: {moe.SP_REFUSAL}")
            seed = _sp.same_seed(seed, sp, refusal, router=router_stats or router_logits)
        options = spec.options(
            weights=weights, cos=cos, sin=sin, key_padding_mask=masks.key_padding_mask,
            segment_ids=masks.segment_ids, window=window,
            # capped layers reach here only without empty rows (_why_not_fused)
            uniform_empty_rows=_attn_implementation(self.config) == "eager" and not spec.softcap,
            lora_scaling=scaling, lora_dropout=dropout, dropout_seed=seed, lora_streams=streams,
            expert_lora_scaling=list(expert_scaling), preset=preset, sequence_parallel=sp,
            router_logits=router_logits, router_stats=router_stats,
            chunk_rows=chunk_rows.get(preset) if chunk_rows else None)
        # ZeRO-3: the gradients of leaf blocks inside the layer (DeepSpeed's MoE blocks)
        x = zero.reduce_inner_leaves(self.layer, x)
        # QLoRA: quantized bases' weights dequantized for this forward and for the op's
        # backward only (ckpt_ext.hf.quantized)
        with quantized.Transient(weights, quantized.compute_dtype(x)) as transient:
            # a plain call (its saved tensors offloaded with offload="cpu"), or one layer of a
            # segment (segment_layers > 1), which keeps its input only if it is the first
            out = _segments.call(chain, self.shared.offloader, decoder_layer, x,
                                 [*weights, cos, sin, masks.key_padding_mask,
                                  masks.segment_ids, seed], options, transient,
                                 _segment_gather(self.layer) if chain is not None else None)
        transient.attach(out)
        if router_stats:
            y, stats = out
            if sp:  # the whole sequence's statistics on every rank (moe.RouterStats)
                stats = _sp.sum_over_group(stats, sp)
                stats_sink.group, stats_sink.ranks = sp, _sp.group_size(sp)
            stats_sink.append(stats)
            return y
        return moe.record_router_logits(out) if router_logits else out


@torch.compiler.disable
def _eager_call(forward: "_PatchedForward", hidden_states: Tensor, *args, **kwargs):
    """A patched layer with bitsandbytes projections called under torch.compile: the call
    runs in eager mode, a graph break, fused there (its weights dequantized for each pass
    outside the graph, ckpt_ext.hf.quantized)."""
    return forward(hidden_states, *args, **kwargs)


def _dequantized_words(n: int) -> str:
    """The part of a budget error that names QLoRA's transient (nothing without one)."""
    if not n:
        return ""
    from ..plan import format_bytes
    return (f" plus one layer's dequantized weights ({format_bytes(n)}, bitsandbytes layers "
            "dequantized for each pass)")


def _patched(layers) -> List[_PatchedForward]:
    return [f for f in (layer.__dict__.get("forward") for layer in layers)
            if isinstance(f, _PatchedForward)]


# ---- segments of several layers (ckpt_ext.segments) -------------------------------------------

_SEGMENTS_INSTEAD = "use segment_layers=1 (every layer keeps its own input) for it"


def _fsdp2_module():
    """FSDP2's module class, or () (which no module is an instance of) without it."""
    return _fsdp2_module_type() or ()


def _sharding_problem(layers) -> Optional[str]:
    """Why the layers' parameters cannot serve a segment's rebuild, which re-runs layer
    forwards inside another layer's backward (None when they can): FSDP (1) and parameters
    sharded by a module other than the layer itself release or hold them in ways the rebuild
    does not gather. A layer that is itself an FSDP2 module (``fully_shard`` on each decoder
    layer) is gathered by the rebuild (``_fsdp2_gather``), and so is one whose parameters are
    DeepSpeed ZeRO-3 parameters (``_zero3_gather``; a fused layer is a ZeRO-3 leaf module)."""
    FSDPModule = _fsdp2_module()
    for idx, layer in enumerate(layers):
        if any(c.__name__ == "FullyShardedDataParallel" for c in type(layer).__mro__):
            return f"decoder layer {idx} is wrapped by FSDP (1); FSDP2's fully_shard on each " \
                "decoder layer is supported"
        own = isinstance(layer, FSDPModule)
        inner = [name for name, mod in layer.named_modules()
                 if name and isinstance(mod, FSDPModule)]
        if inner:
            return f"decoder layer {idx} has modules sharded by FSDP2 of their own " \
                f"({inner[0]!r}); fully_shard the whole decoder layer instead"
        for p in layer.parameters():
            if not own and _is_dtensor(p):
                return f"decoder layer {idx}'s parameters are DTensors sharded by a module " \
                    "other than the layer (FSDP2 on an outer module only, or tensor " \
                    "parallelism); with FSDP2, fully_shard each decoder layer"
    return None


def _fsdp2_gather(layer: nn.Module) -> Optional[Callable]:
    """For a decoder layer that is an FSDP2 module, a function returning a context that gathers
    its parameters (``unshard``) for a segment's replay of its forward and releases them
    (``reshard``) after, unless they were gathered already (FSDP2's backward prefetch, or the
    layer's own backward): those stay for the layer's backward. None for other layers.

    The replay reads the parameter tensors the forward read, which FSDP2 fills again in place
    when it gathers (as it does for any saved weight's backward); checked here."""
    if not isinstance(layer, _fsdp2_module()):
        return None
    read = list(layer.parameters())  # the unsharded parameters of this forward

    @contextlib.contextmanager
    def gathered():
        groups = list(layer._get_fsdp_state()._fsdp_param_groups)
        held = all(g.is_unsharded or getattr(g, "_all_gather_result", None) is not None
                   for g in groups)
        layer.unshard()
        try:
            now = list(layer.parameters())
            if len(now) != len(read) or any(a is not b for a, b in zip(read, now)):
                raise RuntimeError(
                    "ckpt_ext segments: FSDP2 gathered other parameter tensors than the "
                    "forward read for a segment's rebuild; patch the model with "
                    "segment_layers=1")
            yield
        finally:
            if not held:
                layer.reshard()
    return gathered


def _zero3_gather(layer: nn.Module) -> Optional[Callable]:
    """For a decoder layer whose parameters are DeepSpeed ZeRO-3 parameters, a function
    returning a context that makes them available for a segment's replay of its forward and
    releases, after it, exactly those it gathered itself. None for other layers.

    The replay runs inside a later layer's backward, where ZeRO-3's coordinator may hold some
    of them: available (the later layer's, kept for reuse, or persistent) or in flight (its
    prefetch for this layer's own backward, in its registry of all-gathers under way). Those
    it leaves to the coordinator: in-flight ones are waited for (the registry's handle, which
    stays there: the coordinator's own wait is then a no-op) and stay gathered for the layer's
    backward, which the coordinator had fetched them for. The partitioned ones are gathered
    with ``deepspeed.zero.GatheredParameters`` and partitioned again when the replay is done;
    every rank replays the same layers in the same order, so the collectives match. The replay
    reads the parameter tensors the forward read, which ZeRO-3 fills again in place."""
    params = [p for p in layer.parameters() if zero.is_zero3_param(p)]
    if not params:
        return None

    @contextlib.contextmanager
    def gathered():
        import deepspeed
        from deepspeed.runtime.zero import ZeroParamStatus
        inflight = [p for p in params if p.ds_status == ZeroParamStatus.INFLIGHT]
        if inflight:
            registry = _zero3_inflight_registry(layer)
            handles = [registry.get(p) if registry is not None else None for p in inflight]
            if any(h is None for h in handles):
                raise RuntimeError(
                    "ckpt_ext segments: a parameter of a layer that a segment's rebuild replays "
                    "is being gathered by ZeRO-3, and its all-gather is not in the registry of "
                    "the DeepSpeed engine whose hooks are on the layer; patch the model with "
                    "segment_layers=1")
            for handle in {id(h): h for h in handles}.values():
                handle.wait()
        mine = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        with deepspeed.zero.GatheredParameters(mine, enabled=bool(mine)):
            yield
    return gathered


def _zero3_inflight_registry(layer: nn.Module):
    """The registry of ZeRO-3's all-gathers under way (parameter -> handle) of the DeepSpeed
    engine whose hooks gather ``layer``'s parameters: its ``ds_inflight_param_registry``, on
    the module the engine was given, found through its hooks on the layer; None if none."""
    hooks = [h for h in (*layer._forward_pre_hooks.values(), *layer._forward_hooks.values())
             if zero.is_deepspeed_hook(h)]
    seen = set()
    for _ in range(3):  # the hooks, what they wrap (torch.compiler.disable), what that closes on
        found = []
        for fn in hooks:
            fn = inspect.unwrap(fn)
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    owner = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                registry = getattr(getattr(owner, "module", None), "ds_inflight_param_registry",
                                   None)
                if registry is not None:
                    return registry
                if callable(owner):
                    found.append(owner)
        hooks = found
    return None


def _segment_gather(layer: nn.Module) -> Optional[Callable]:
    """The gather of a segment's replay of ``layer``'s call: FSDP2's or ZeRO-3's, else None."""
    gather = _fsdp2_gather(layer)
    return gather if gather is not None else _zero3_gather(layer)


def _check_segments(k: int, presets: List[str], layers, config, sequence_parallel) -> None:
    """patch_llama's refusals of ``segment_layers`` = k > 1 (PatchRefused, before anything
    changes): combinations that segments are not built for."""
    if k == 1:
        return
    head = f"patch_llama: segment_layers={k}"
    if "auto" in presets:
        raise PatchRefused(f"{head} with policy='auto' is not built (auto chooses its own "
                           "segments, with offload='cpu' where offload_limit binds); give a "
                           f"fused preset, e.g. policy='min_memory', or {_SEGMENTS_INSTEAD}")
    unfused = [i for i, p in enumerate(presets) if p not in FUSED_PRESETS]
    if unfused:
        raise PatchRefused(
            f"{head} needs every decoder layer fused (a segment rebuilds its layers' inputs "
            f"with the fused op); layers {unfused} have policy {presets[unfused[0]]!r}. Use "
            "'fast', 'balanced' or 'min_memory' for every layer, or " + _SEGMENTS_INSTEAD)
    if config.model_type in _SEGMENTS_REFUSED:
        raise PatchRefused(f"{head}: {_SEGMENTS_REFUSED[config.model_type]}; "
                           f"{_SEGMENTS_INSTEAD}")
    problem = _sharding_problem(layers)
    if problem:
        raise PatchRefused(f"{head}: {problem}, which a segment's rebuild (layer forwards "
                           f"inside the backward) is not built for; {_SEGMENTS_INSTEAD}")


# model_types (of the text stack) whose model runs something between two decoder layers, so
# that a layer's input is not the previous layer's output
_SEGMENTS_REFUSED = {
    "qwen3_vl_text": "Qwen3-VL adds visual features to the hidden states between its first "
                     "decoder layers (deepstack), so a layer's input is not the previous "
                     "layer's output",
}


@torch.compiler.disable
def _refuse_compiled_segments(k: int) -> None:
    """Raised outside the graph (a graph break), so that it reaches the caller as it is."""
    raise NotImplementedError(
        f"ckpt_ext.patch_llama: segment_layers={k} under torch.compile is not built (a "
        "segment's saved-tensor hooks run in eager mode only); run the model eagerly, or "
        "patch it with segment_layers=1 to compile it")


def _refuse_segments_now(shared: "_Shared", sp: str) -> None:
    """The refusals of segments that can only be seen when a forward starts (the same on
    every rank of a group: each reads the same settings)."""
    k = shared.segment_layers
    if torch.compiler.is_compiling():
        _refuse_compiled_segments(k)
    if sp and not shared.sequence_parallel:  # DeepSpeed Ulysses' group (not tested)
        raise NotImplementedError(
            f"ckpt_ext.patch_llama: segment_layers={k} with sequence parallelism (DeepSpeed "
            f"Ulysses' group) is not built; patch the model with segment_layers=1")
    problem = _sharding_problem(shared.layers)
    if problem:
        raise NotImplementedError(
            f"ckpt_ext.patch_llama: segment_layers={k}: {problem} (set up after patching), "
            "which a segment's rebuild is not built for; patch the model with "
            "segment_layers=1")


def _auto_segments_problem(shared: "_Shared", sp: str) -> Optional[str]:
    """Why segments of several layers, chosen by policy="auto", cannot run this forward (None
    when they can): the combinations patch_llama refuses for ``segment_layers`` > 1."""
    if torch.compiler.is_compiling():
        return "a forward under torch.compile (a segment's saved-tensor hooks run eagerly only)"
    if sp and not shared.sequence_parallel:
        return "sequence parallelism in DeepSpeed Ulysses' group"
    unfused = [i for i, layer in enumerate(shared.layers)
               if not isinstance(layer.__dict__.get("forward"), _PatchedForward)
               or layer.__dict__["forward"].preset not in FUSED_PRESETS + ("auto",)]
    if unfused:
        return f"decoder layers {unfused} are not fused"
    model_type = shared.owner.config.model_type
    if model_type in _SEGMENTS_REFUSED:
        return _SEGMENTS_REFUSED[model_type]
    return _sharding_problem(shared.layers)


@torch.compiler.disable
def _refuse_auto_segments(choice: Tuple[int, str], problem: str) -> None:
    """auto's segments where they are not built: the mix's error, with why (outside the graph
    under torch.compile, so that it reaches the caller as it is)."""
    k, message = choice
    raise ValueError(f"{message} (min_memory in segments of {k} layers would fit, but "
                     f"segments are not built here: {problem})")


# ---- public API ------------------------------------------------------------------------------

def patch_llama(model: nn.Module, policy: Optional[Policy] = None, *,
                activation_budget: Optional[Union[int, str]] = None,
                fuse_lm_head: bool = True, offload: Optional[str] = None,
                offload_limit: Optional[Union[int, str]] = None,
                offload_stream: bool = False,
                host_link_gbytes_per_s: Optional[float] = None,
                sequence_parallel=None, router_aux_loss: str = "exact",
                segment_layers: int = 1) -> nn.Module:
    """Give every decoder layer of ``model`` a recompute preset; returns ``model`` (patched in
    place).

    ``model``: a transformers ``*ForCausalLM`` or ``*Model`` of ``SUPPORTED_MODEL_TYPES``, or a
    ``peft.PeftModel`` around one. ``policy``: a preset name for every layer, a list with one
    per layer, a callable ``(layer_idx) -> preset`` (presets: ``ckpt_ext.presets.PRESETS``), or
    ``"auto"``: at each training forward each layer's way to run is chosen for the batch size,
    sequence length and dtype, by the plan's time model, among HF's layer as it is
    (``"none"``), under ``torch.utils.checkpoint`` (``"torch"``) and the fused presets: the
    fastest mix that fits (``ckpt_ext.plan.choose_auto``). What must fit: on CUDA without
    ``activation_budget``, the step's modelled peak within the device's memory less the model
    state (``ckpt_ext.plan.parameter_state_bytes``) and headroom; with ``activation_budget``
    (bytes, or a string such as ``"20GiB"``; needed on the CPU) the decoder layers' saved
    bytes. A budget or room below every layer at ``min_memory`` raises a ValueError naming the
    smallest that fits. The default (None) is ``"balanced"``, and
    ``"min_memory"`` for calls made while HF gradient checkpointing is on (it keeps what HF's
    checkpointing keeps). ``fuse_lm_head``: a ``*ForCausalLM``'s training loss runs through
    ``ckpt_ext.ops.linear_cross_entropy`` and its output's ``logits`` is None
    (``ckpt_ext.hf.lm_head``). ``offload="cpu"``: what the fused layers save for backward
    is kept in host memory and prefetched back one layer ahead in backward
    (``ckpt_ext.offload``; one pool per model); ``offload_limit`` (bytes or "64GiB") caps the
    host bytes, past it the remaining layers keep their tensors on the device. With
    ``policy="auto"`` and offload the presets are chosen per layer by the plan's time model
    (``ckpt_ext.plan.choose_offload_layers``: each layer the larger of its compute at
    ``ckpt_ext.throughputs.default_throughputs`` and its two host copies at
    ``host_link_gbytes_per_s``, default ``ckpt_ext.plan.HOST_LINK_GBYTES_PER_S``, 25 GB/s, an
    assumption until measured) so that what the device holds of the layers (the prefetch pool
    and the layers past ``offload_limit``) fits ``activation_budget`` (see docs/offload.md).
    Where no mix fits and ``offload_limit`` binds, every layer runs ``min_memory`` in segments
    of the k (see ``segment_layers``) that ``ckpt_ext.plan.choose_segment_layers`` picks by
    time among those that fit (``offload_limit`` as the host memory; with
    ``activation_budget`` what must fit is the layers' device bytes: the prefetch pool, the
    segment inputs past the limit and the running segment's rebuilt inputs); where segments
    are not built (those below) the forward raises the mixes' ValueError with the reason, and
    where no k fits either, a ValueError naming both.
    ``sequence_parallel``: a ``torch.distributed`` group over which every sequence is split
    (Ulysses, inside the fused layers: ``ckpt_ext.hf.sequence_parallel``, whose
    ``shard_batch`` cuts the batch); every layer must be fused. Its ranks' gradients are their
    tokens' shares: ``all_reduce_grads`` sums them, or, under DDP / FSDP2 / ZeRO-3 over a
    data-parallel x sequence-parallel mesh, the loss's factor that module's docstring gives.
    ``router_aux_loss`` (MoE models with ``output_router_logits``): ``"exact"`` (default)
    returns every MoE layer's router
    logits as transformers does and adds HF's load-balancing loss of them; ``"fused"`` has
    each fused MoE layer return only its O(experts) statistics of that loss (top-k counts,
    softmax sums, token count: ``ckpt_ext.hf.moe.load_balancing_loss``), not its
    (tokens, experts) logits, for the fused LM head's loss: the same aux_loss and gradients,
    and ``router_logits`` None in that output (needs ``fuse_lm_head`` on a
    ``*ForCausalLM``; under ``sequence_parallel`` the statistics are summed over the group and
    each rank adds its share of the loss, calls without labels or grad included; "exact" is
    refused there).
    ``offload_stream=True`` (with ``offload="cpu"``): a ``min_memory`` layer's input stays in
    host memory through its backward, which copies it to the device a token chunk at a time,
    instead of coming back whole into the device prefetch pool; a segment's rebuilt inputs go
    to host memory too (``ckpt_ext.offload``; the plan's ``--offload-stream``). For the
    longest sequences, where the pool is what does not fit: the copies are not overlapped
    with compute. With ``policy="auto"`` every layer then runs ``min_memory``, streamed, in
    segments of the k (1 included) that ``ckpt_ext.plan.choose_segment_layers`` picks by time
    among those that fit.
    ``segment_layers`` (an int >= 1, default 1: every layer keeps its own input): consecutive
    fused layers of a training forward grouped k at a time (``ckpt_ext.segments``): a segment
    keeps its first layer's input only (on the device, or offloaded with ``offload``; layers
    2..k keep their preset's residuals besides the input, as before), and its backward first
    re-runs layers 1..k-1 forward (no grad, the recorded RNG and autocast states and dropout
    seeds) to rebuild the other inputs, each held until its layer's backward: k - 1 more layer
    forwards per segment for 1/k of the saved inputs, the gradients equal to k = 1's bit for
    bit (on the CPU). A layer whose input is not the previous fused layer's output (it ran
    HF's forward, or the model did something in between) starts a new segment. With
    ``sequence_parallel`` the rebuild runs the layers' exchanges on every rank in the same
    order; with bitsandbytes (QLoRA) projections the rebuild dequantizes each layer's weights
    again for its forward and frees them after it (one layer's at a time); with FSDP2's
    ``fully_shard`` on each decoder layer the rebuild gathers each replayed layer's parameters
    for its replay and releases them after it (unless FSDP2 is already gathering them for
    that layer's backward); under DeepSpeed ZeRO-3 it gathers each replayed layer's
    partitioned parameters for its replay and partitions them again after it (those ZeRO-3
    holds or is prefetching for the layer's backward it leaves to ZeRO-3). Not built with
    k > 1 (PatchRefused naming what to use): ``policy="auto"`` (which picks k itself with
    offload, above) and presets other than the fused ones, FSDP (1), FSDP2 on a module around
    the layers only,
    tensor-parallel DTensor parameters and Qwen3-VL; a forward under ``torch.compile`` or in
    DeepSpeed Ulysses' group raises NotImplementedError.

    The fused layers' token chunks: unless ``chunk_bytes`` is pinned
    (``CKPT_EXT_CHUNK_BYTES``, or ``ckpt_ext.config.patch`` / ``update``), at each training
    forward the chunk rule (``ckpt_ext.plan.choose_chunk_rows``) picks each fused preset's
    rows for time where a budget is known (``activation_budget``, or on CUDA the device's
    room as for ``"auto"``; fixed presets included, not with offload or
    ``sequence_parallel``): one chunk when the step fits, else the fastest count that fits.
    Without a budget, or pinned, the chunks are the cap's.

    Raises ``ckpt_ext.PatchRefused`` (a ValueError and a NotImplementedError), before changing
    anything, when the model, or a layer asked to be fused, cannot be (see the module
    docstring); malformed arguments raise ValueError or TypeError. Patching a patched model
    first undoes the earlier patch."""
    _check_bool("patch_llama", "fuse_lm_head", fuse_lm_head)
    segment_layers = _segments.check_segment_layers(segment_layers)
    owner, layers = _decoder_layers(model)
    config = _model_config(model)
    check_router_aux_loss(router_aux_loss, _unwrap_peft(model), owner, layers, fuse_lm_head)
    budget = None
    if policy == "auto":
        if activation_budget is not None:
            from ..plan import parse_bytes
            budget = parse_bytes(activation_budget)
    elif activation_budget is not None:
        raise ValueError("patch_llama: activation_budget applies to policy='auto' only, got "
                         f"policy={policy!r}")
    offloader = resolve_offload(offload, offload_limit, stream=offload_stream)
    host_link = _host_link_default()
    if host_link_gbytes_per_s is not None:
        if policy != "auto" or offloader is None:
            raise ValueError("patch_llama: host_link_gbytes_per_s applies to policy='auto' with "
                             f"offload only, got policy={policy!r}, offload={offload!r}")
        v = host_link_gbytes_per_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError("patch_llama: host_link_gbytes_per_s must be a positive finite "
                             f"number of GB/s, got {v!r}")
        host_link = float(v)
    presets = _resolve_policy("balanced" if policy is None else policy, len(layers))
    specs = {}
    for idx, (layer, preset) in enumerate(zip(layers, presets)):
        if _foreign_forward(layer):
            raise PatchRefused(f"patch_llama: decoder layer {idx} already has an instance-level "
                             "forward (accelerate hooks or another patch), which patching "
                             "would drop")
        if preset in FUSED_PRESETS or preset == "auto":
            specs[idx] = _check_fusable(layer, idx, config)
    sp_name = _sp.check_patch(sequence_parallel, presets)
    _check_segments(segment_layers, presets, layers, config, sequence_parallel)
    unpatch_llama(model)
    multimodal = MULTIMODAL.get(getattr(_unwrap_peft(model).config, "model_type", None))
    shared = _Shared(owner, layers, default_policy=policy is None, budget=budget,
                     auto_policy=policy == "auto",
                     offloader=offloader, host_link=host_link, hook_owner=_mask_owner(model, owner),
                     bidirectional_images=multimodal is not None and
                     multimodal.bidirectional_images)
    for idx, (layer, preset) in enumerate(zip(layers, presets)):
        if preset != "none":
            layer.forward = _PatchedForward(layer, idx, preset, specs.get(idx), shared, config)
            _take_over_call_checkpoint(layer)
    shared.sequence_parallel = sp_name
    shared.router_aux_loss = router_aux_loss
    shared.segment_layers = segment_layers
    shared.install()
    _patch_head(_unwrap_peft(model), owner, fuse_lm_head, shared, FAMILIES[config.model_type],
                router_aux_loss)
    gc_on = any(getattr(layer, "gradient_checkpointing", False) is True for layer in layers)
    fused = set(presets) & set(FUSED_PRESETS)
    if gc_on and fused:
        if policy is None:
            shared.warn_once("hf checkpointing", _HF_GC_DEFAULT)
        elif fused - {"min_memory"}:
            shared.warn_once("hf checkpointing", _HF_GC_EXPLICIT.format(
                presets=sorted(fused - {"min_memory"})))
    return model


def _patch_head(model: nn.Module, owner: nn.Module, fuse: bool, shared: _Shared,
                family: Family, router_aux_loss: str = "exact") -> None:
    if not fuse or model is owner or getattr(model, "lm_head", None) is None:
        return
    if "forward" in model.__dict__:
        shared.warn_once("head", f"the LM head is not fused: {type(model).__name__} already "
                         "has an instance-level forward (another patch, or TRL's fused head)")
        return
    problem = head_problem(model)
    if problem:
        shared.warn_once("head", f"the LM head is not fused: {problem}")
        return
    model.forward = FusedHeadForward(model, owner, shared=shared,
                                     router_aux_loss=router_aux_loss)
    # The final norm runs inside the head op, rounding as the family's norms do.
    norm = owner._modules.get("norm")
    if final_norm_problem(norm) is None:
        norm.forward = FinalNorm(norm, family)


def unpatch_llama(model: nn.Module) -> nn.Module:
    """Undo ``patch_llama``: every layer gets HF's forward back. Returns ``model``; a model
    that is not patched is unchanged."""
    owner, layers = _decoder_layers(model)
    for module in {id(m): m for m in (owner, _mask_owner(model, owner))}.values():
        _Shared.remove_from(module)
    for patched in _patched(layers):
        del patched.layer.__dict__["forward"]
        call = patched.layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(call, _CallThrough):
            patched.layer._gradient_checkpointing_func = call.checkpoint
    inner = _unwrap_peft(model)
    if isinstance(inner.__dict__.get("forward"), FusedHeadForward):
        del inner.__dict__["forward"]
    norm = owner._modules.get("norm")
    if norm is not None and isinstance(norm.__dict__.get("forward"), FinalNorm):
        del norm.__dict__["forward"]
    return model
