"""Put ckpt_ext's recompute into a Hugging Face LLaMA-family model, in place.

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa")
    ckpt_ext.patch_llama(model, policy="balanced")
    loss = model(input_ids, attention_mask=mask, labels=labels, use_cache=False).loss
    ckpt_ext.unpatch_llama(model)

(``use_cache=False``: transformers defaults to ``use_cache=True`` even for training forwards,
and a forward that must fill a KV cache runs HF's layers, unfused; a warning says so.)

Supported: Llama, Mistral, Qwen2 and Qwen3 (``config.model_type`` ``llama``, ``mistral``,
``qwen2``, ``qwen3``), as ``*ForCausalLM`` or any model whose ``base_model`` is the bare
``*Model``. Each decoder layer keeps its HF class and parameters; only an instance-level
``forward`` is set (a ``_PatchedForward``), so ``isinstance`` checks, hooks on the layer,
``output_hidden_states`` and ``state_dict`` are unchanged, and ``unpatch_llama`` deletes it.

Per layer, the preset (``ckpt_ext.presets``) decides what a *training* forward does: grad
enabled and no KV cache (``use_cache`` false, ``past_key_values`` None):

* ``none``: nothing is patched; the layer is HF's, untouched.
* ``torch``: HF's forward under ``torch.utils.checkpoint(use_reentrant=False)``.
* ``fast`` / ``balanced`` / ``min_memory``: one call of the fused C++ op
  ``torch.ops.ckpt_ext.decoder_layer`` with the layer's own weights.

Everything else runs HF's own forward ("delegates"): inference (grad disabled), generation and
any call with a KV cache, and every training call that the fused op would compute differently:
an attention mask that is not exactly causal plus key padding (a sliding window that cuts in,
packed sequences, custom masks), ``output_attentions``, autocast or mixed dtypes, hooks on the
layer's submodules, projections replaced after patching (LoRA). A delegation during training
is warned once per reason; ``layer.forward.calls`` counts fused and delegated calls.

What can never be fused is refused by ``patch_llama`` with a ``ValueError``: other model
types, attention implementations other than ``eager``/``sdpa`` (flash-attention and flex
masks are not 4-D tensors that can be checked here), attention dropout, projections that are
not plain ``nn.Linear`` (LoRA/PEFT, quantized layers), activations other than SiLU, norms
with different eps. Rope variants are not refused: these four layer classes all apply
``q * cos + rotate_half(q) * sin`` with the cos/sin the model computes outside the layers
(rope scaling types such as linear, dynamic, yarn or llama3 change only those, attention
scaling included), and the fused op applies the same formula to the same cos/sin. A
partial rotary (cos/sin narrower than head_dim, which these classes do not produce) is
caught per call and delegated.
"""
from __future__ import annotations

import collections
import functools
import inspect
import warnings
import weakref
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import _C  # noqa: F401  (registers torch.ops.ckpt_ext)
from ..presets import FUSED_PRESETS, check_policy

__all__ = ["patch_llama", "unpatch_llama", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ATTENTION"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ATTENTION = ("eager", "sdpa")

Policy = Union[str, Sequence[str], Callable[[int], str]]

_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = set(_ATTN_LINEARS) | {"q_norm", "k_norm", "rotary_emb"}
_MLP_CHILDREN = set(_MLP_LINEARS) | {"act_fn"}
# transformers 5.x installs this forward hook on layers and attentions once any output_* is
# requested; it records only while its collector is active (see _inert).
_HF_CAPTURE_HOOK = "output_capturing_hook"


# ---- finding the model's pieces --------------------------------------------------------------

def _decoder_layers(model: nn.Module) -> Tuple[nn.Module, nn.ModuleList]:
    """``(owner, layers)``: the bare ``*Model`` and its ``layers``."""
    for owner in (getattr(model, "base_model", None), getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return owner, layers
    raise ValueError(
        f"patch_llama: could not find the decoder layers of {type(model).__name__} (looked for "
        "model.model.layers and model.layers); pass a transformers *ForCausalLM or *Model of "
        f"the families {', '.join(SUPPORTED_MODEL_TYPES)}")


def _model_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"patch_llama: {type(model).__name__} has no .config; pass a "
                         "transformers model (LlamaForCausalLM, Qwen2Model, ...)")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"patch_llama: model_type {model_type!r} is not supported; supported are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (the fused op implements exactly their "
            "decoder layer: RMSNorm, RoPE, GQA causal attention, SwiGLU)")
    return config


def _attn_implementation(config) -> str:
    return getattr(config, "_attn_implementation", None) or "eager"


def _resolve_policy(policy: Policy, n_layers: int) -> List[str]:
    if isinstance(policy, str):
        return [check_policy(policy, "policy")] * n_layers
    if callable(policy):
        return [check_policy(policy(i), f"policy({i})") for i in range(n_layers)]
    if isinstance(policy, (list, tuple)):
        if len(policy) != n_layers:
            raise ValueError(f"policy: a list needs one preset per decoder layer ({n_layers} "
                             f"layers), got {len(policy)}")
        return [check_policy(p, f"policy[{i}]") for i, p in enumerate(policy)]
    raise TypeError("policy must be a preset name, a list of presets (one per layer) or a "
                    f"callable (layer_idx) -> preset; got {type(policy).__name__}")


def _returns_tuple(forward: Callable) -> bool:
    """transformers 4.x decoder layers return a tuple ``(hidden_states, ...)`` (annotated
    ``Tuple[...]``); 5.x ones return the tensor (annotated ``torch.Tensor``)."""
    annotation = inspect.signature(forward).return_annotation
    if isinstance(annotation, str):
        return annotation.replace(" ", "") not in ("torch.Tensor", "Tensor")
    return annotation is not torch.Tensor


# ---- what the fused op needs from a layer ----------------------------------------------------

def _structure_problem(layer: nn.Module, hooks: bool = False) -> Optional[str]:
    """Why the fused op cannot stand in for this layer's modules, or None. Cheap enough for
    every forward, where it also catches projections wrapped after patching (LoRA) and, with
    ``hooks``, forward hooks on submodules that the fused op would not run."""
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    if attn is None or mlp is None or not {"input_layernorm",
                                           "post_attention_layernorm"} <= set(layer._modules):
        return "it lacks self_attn, mlp, input_layernorm or post_attention_layernorm"
    for parent, expected, where in ((layer, _LAYER_CHILDREN, ""), (attn, _ATTN_CHILDREN,
                                    "self_attn."), (mlp, _MLP_CHILDREN, "mlp.")):
        extra = set(parent._modules) - expected
        if extra:
            return ("it has submodules the fused op does not compute: "
                    f"{', '.join(where + e for e in sorted(extra))}")
    for parent, names, where in ((attn, _ATTN_LINEARS, "self_attn"), (mlp, _MLP_LINEARS, "mlp")):
        for name in names:
            lin = parent._modules.get(name)
            if type(lin) is not nn.Linear:
                return (f"{where}.{name} is a {type(lin).__name__}, not a plain nn.Linear "
                        "(LoRA/PEFT adapters and quantized layers compute more than the weight "
                        "the fused op reads)")
    for name, norm in _norms(layer).items():
        if (not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon")
                or set(dict(norm.named_parameters())) != {"weight"}):
            return f"{name} is a {type(norm).__name__}, not the family's RMSNorm"
    if (attn._modules.get("q_norm") is None) != (attn._modules.get("k_norm") is None):
        return "self_attn has only one of q_norm/k_norm"
    for name, mod in layer.named_modules():
        if not name:
            continue
        if _foreign_forward(mod):
            return (f"{name} has an instance-level forward (accelerate offload hooks, another "
                    "patch, or transformers recording outputs), which the fused op would bypass")
        if hooks and not (_inert(mod._forward_hooks) and _inert(mod._forward_pre_hooks)):
            return (f"{name} has forward hooks (or output_attentions is being recorded), which "
                    "the fused op would not run")
    return None


def _foreign_forward(module: nn.Module) -> bool:
    """An instance-level ``forward`` other than the class's own bound to the module (which
    transformers 4.5x leaves behind after recording outputs) and other than ours."""
    own = module.__dict__.get("forward")
    if own is None or isinstance(own, _PatchedForward):
        return False
    return not (getattr(own, "__self__", None) is module
                and getattr(own, "__func__", None) is type(module).forward)


@functools.lru_cache(maxsize=None)
def _hf_collector():
    """transformers 5.x: the context that its output-capturing hooks record into (None in
    versions that pass output_attentions to the layers). Imported on first use, so that
    ``import ckpt_ext`` never imports transformers."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _inert(hooks) -> bool:
    """True for no hooks, or only transformers 5.x's output-capturing hooks while they do not
    record attentions (they are installed for good once any output_* is asked for)."""
    if not hooks:
        return True
    collector = _hf_collector()
    if collector is None or not all(getattr(h, "__name__", "") == _HF_CAPTURE_HOOK
                                    for h in hooks.values()):
        return False
    active = collector.get()
    return not (active and "attentions" in active)


def _norms(layer: nn.Module) -> dict:
    attn = layer._modules["self_attn"]
    norms = {name: layer._modules.get(name) for name in ("input_layernorm",
                                                           "post_attention_layernorm")}
    norms.update({f"self_attn.{name}": attn._modules.get(name) for name in ("q_norm", "k_norm")})
    return {name: norm for name, norm in norms.items() if norm is not None}


def _eps(layer: nn.Module) -> float:
    values = {name: float(norm.variance_epsilon) for name, norm in _norms(layer).items()}
    if len(set(values.values())) != 1:
        raise ValueError(f"the norms have different eps {values}; the fused op takes one eps "
                         "for all of them")
    return next(iter(values.values()))


class _LayerSpec:
    """What one fused layer passes to the op besides tensors."""

    def __init__(self, layer: nn.Module, config):
        attn = layer.self_attn
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(attn, "head_dim", None) or
                            config.hidden_size // config.num_attention_heads)
        self.scale = float(attn.scaling)
        self.eps = _eps(layer)
        q, k, o = attn.q_proj, attn.k_proj, attn.o_proj
        shapes_ok = (q.out_features == self.num_heads * self.head_dim
                     and k.out_features == self.num_kv_heads * self.head_dim
                     and attn.v_proj.out_features == k.out_features
                     and o.in_features == q.out_features
                     and self.num_heads % self.num_kv_heads == 0 and self.head_dim % 2 == 0)
        if not shapes_ok:
            raise ValueError(
                f"projection shapes q {tuple(q.weight.shape)}, k {tuple(k.weight.shape)}, o "
                f"{tuple(o.weight.shape)} do not match num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}")


_SILU = ("SiLU", "SiLUActivation")


def _attention_dropout(layer: nn.Module, config) -> float:
    return float(getattr(layer.self_attn, "attention_dropout",
                         getattr(config, "attention_dropout", 0.0)) or 0.0)


def _check_fusable(layer: nn.Module, idx: int, config) -> _LayerSpec:
    def refuse(why: str) -> ValueError:
        return ValueError(f"patch_llama: cannot fuse decoder layer {idx} "
                          f"({type(layer).__name__}): {why}. Use policy 'none' or 'torch' "
                          "for it (a list or callable policy picks per layer)")

    problem = _structure_problem(layer)
    if problem:
        raise refuse(problem)
    impl = _attn_implementation(config)
    if impl not in SUPPORTED_ATTENTION:
        raise refuse(
            f"attn_implementation={impl!r} is not supported (only {SUPPORTED_ATTENTION}): its "
            "masks (2-D padding masks, packed sequences described by position_ids, block "
            "masks) cannot be verified to be causal + padding, so the fused causal attention "
            "could silently differ. Load the model with attn_implementation='sdpa'; in "
            "training the fused op replaces the attention kernel anyway")
    dropout = _attention_dropout(layer, config)
    if dropout > 0:
        raise refuse(f"attention_dropout={dropout}: the fused op has no dropout to replay. Set "
                     "config.attention_dropout = 0.0 ('torch' replays dropout exactly)")
    act = type(layer.mlp._modules.get("act_fn")).__name__
    if act not in _SILU:
        raise refuse(f"hidden_act={getattr(config, 'hidden_act', None)!r} (mlp.act_fn is a "
                     f"{act}): the fused MLP is SwiGLU, with a SiLU gate")
    try:
        return _LayerSpec(layer, config)
    except ValueError as e:
        raise refuse(str(e)) from None


# ---- attention mask -> key padding mask ------------------------------------------------------

class _MaskCache:
    """One conversion per mask object: every layer of a forward gets the same mask. The entry
    holds a weak reference, so a new mask at a reused address is never mistaken for it."""

    def __init__(self):
        self.ref, self.key, self.value = None, None, (False, None)

    def __getstate__(self):  # pickling a patched model drops the cache (weakrefs do not pickle)
        return {}

    def __setstate__(self, state):
        self.__init__()

    def lookup(self, mask: Tensor, b: int, s: int) -> Tuple[bool, Optional[Tensor]]:
        key = (mask._version, b, s)
        if self.ref is None or self.ref() is not mask or self.key != key:
            self.value = _padding_mask_from(mask, b, s)
            self.ref, self.key = weakref.ref(mask), key
        return self.value


def _padding_mask_from(mask: Tensor, b: int, s: int) -> Tuple[bool, Optional[Tensor]]:
    """``(ok, key_padding_mask)`` for a 4-D HF mask ``(1 or B, 1, S, >= S)``: bool (True = may
    attend) or additive float (0 = may attend, the dtype's min = masked).

    ``ok`` only when every row is exactly ``causal & key_padding_mask[None, :]``, except that
    a query row which may attend nothing there (a padded query before the first real token)
    may also be fully unmasked, as older transformers make such rows for SDPA. The fused op
    outputs 0 on those rows; HF whatever its kernel gives. ``key_padding_mask`` (B, S) is
    read off the last query row, which may attend every real key; None when all are real."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != s or mask.shape[3] < s \
            or mask.shape[0] not in (1, b):
        return False, None
    # transformers 4.x may build the mask one key wider than S without a cache; its attention
    # functions use the first S keys, and so does this.
    mask = mask[..., :s]
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    elif mask.is_floating_point():
        allowed = mask[:, 0] == 0
        if not bool((allowed | (mask[:, 0] == torch.finfo(mask.dtype).min)).all()):
            return False, None  # additive biases other than 0 / masked
    else:
        return False, None
    allowed = allowed.expand(b, s, s)
    kpm = allowed[:, -1, :].clone()
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    expected = causal & kpm[:, None, :]
    rows_ok = (allowed == expected).all(-1) | (~expected.any(-1) & allowed.all(-1))
    if not bool(rows_ok.all()):
        return False, None
    return True, (None if bool(kpm.all()) else kpm)


# ---- the patched forward ---------------------------------------------------------------------

class _Shared:
    """State shared by the layers of one patched model."""

    def __init__(self, owner: nn.Module, layers: nn.ModuleList):
        self.owner, self.layers = owner, layers
        self.masks = _MaskCache()
        self.warned: set = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"ckpt_ext.patch_llama: {message}", stacklevel=4)


_NOT_CAUSAL = ("the attention mask is not exactly causal + key padding (a sliding window "
               "shorter than the sequence, packed sequences or a custom mask)")
_CACHE = ("use_cache=True or past_key_values was given: the KV cache must be filled, so HF's "
          "forward runs. transformers defaults to use_cache=True even for training forwards: "
          "pass use_cache=False to the model, or set model.config.use_cache = False")


class _PatchedForward:
    """The instance-level ``forward`` of a patched decoder layer (see the module docstring).
    ``calls`` counts the calls by path: ``fused``, ``torch``, ``delegated: <reason>``."""

    def __init__(self, layer: nn.Module, idx: int, preset: str, spec: Optional[_LayerSpec],
                 shared: _Shared, config):
        self.layer, self.idx, self.preset, self.spec = layer, idx, preset, spec
        self.shared, self.config = shared, config
        params = inspect.signature(self.original).parameters.values()
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        self.returns_tuple = _returns_tuple(self.original)
        self.calls: collections.Counter = collections.Counter()

    @property
    def original(self) -> Callable:
        """HF's forward: the class attribute, bound to the layer."""
        return type(self.layer).forward.__get__(self.layer, type(self.layer))

    def __repr__(self) -> str:
        return f"<ckpt_ext patched forward: layer {self.idx}, preset {self.preset!r}>"

    def __call__(self, hidden_states: Tensor, *args, **kwargs):
        if args:  # HF passes all but hidden_states by keyword; name any positional ones
            if len(args) > len(self.positional):
                raise TypeError(f"{type(self.layer).__name__}.forward takes at most "
                                f"{len(self.positional) + 1} positional arguments")
            kwargs.update(zip(self.positional, args))
        if not torch.is_grad_enabled():
            return self._delegate("grad is disabled (inference)", hidden_states, kwargs)
        if kwargs.get("use_cache") or kwargs.get("past_key_values",
                                                 kwargs.get("past_key_value")) is not None:
            return self._delegate(_CACHE, hidden_states, kwargs, warn=self.layer.training)
        # Decided the same way in a forward and in its recompute: HF's checkpointing is taken
        # over only by patch_llama, never while a step may be in flight.
        hf_checkpoints = self._hf_checkpoints_this_call()
        if hf_checkpoints or (self.layer.training and getattr(self.shared.owner,
                                                              "gradient_checkpointing", False)):
            self.shared.warn_once("hf checkpointing", _HF_GC_MESSAGE)
        if self.preset == "torch":
            if hf_checkpoints:  # HF checkpoints this layer already: once is enough
                self.calls["torch (by HF's checkpoint)"] += 1
                return self.original(hidden_states, **kwargs)
            self.calls["torch"] += 1
            return torch_checkpoint(self.original, hidden_states, use_reentrant=False, **kwargs)
        if hf_checkpoints and _hf_checkpoint_site(type(self.layer)) != "forward":
            return self._delegate(
                "HF's gradient checkpointing, turned on after patch_llama, wraps this call, so "
                "HF's forward runs under it; call patch_llama again to have fused layers skip "
                "HF's checkpoint", hidden_states, kwargs, warn=True)
        reason = self._why_not_fused(hidden_states, kwargs)
        kpm = None
        if reason is None and kwargs.get("attention_mask") is not None:
            ok, kpm = self.shared.masks.lookup(kwargs["attention_mask"], hidden_states.shape[0],
                                               hidden_states.shape[1])
            reason = None if ok else _NOT_CAUSAL
        if reason is not None:
            return self._delegate(reason, hidden_states, kwargs, warn=True)
        self.calls["fused"] += 1
        out = self._fused(hidden_states, kwargs["position_embeddings"], kpm)
        return (out,) if self.returns_tuple else out

    def _hf_checkpoints_this_call(self) -> bool:
        """Whether HF's gradient checkpointing wraps this call (transformers < 5) or the class
        forward that this call would run (5.x)."""
        layer = self.layer
        if not layer.training:
            return False
        if _hf_checkpoint_site(type(layer)) == "loop":
            owner = self.shared.owner
            return bool(getattr(owner, "gradient_checkpointing", False)) and not isinstance(
                owner.__dict__.get("_gradient_checkpointing_func"), _SkipPatchedLayers)
        return bool(getattr(layer, "gradient_checkpointing", False))

    def _delegate(self, reason: str, hidden_states: Tensor, kwargs, warn: bool = False):
        self.calls[f"delegated: {reason}"] += 1
        if warn:
            self.shared.warn_once(reason, f"a training forward of decoder layer {self.idx} "
                                  f"(preset {self.preset!r}) ran HF's forward, not the fused "
                                  f"op: {reason} (warned once per reason)")
        return self.original(hidden_states, **kwargs)

    def _why_not_fused(self, x: Tensor, kwargs) -> Optional[str]:
        """Why this call cannot go through the fused op, or None (the mask is checked apart)."""
        layer, spec = self.layer, self.spec
        impl = _attn_implementation(self.config)
        if impl not in SUPPORTED_ATTENTION:
            return f"attn_implementation is now {impl!r}"
        if kwargs.get("output_attentions"):
            return "output_attentions=True (the fused op never forms attention weights)"
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            if kwargs.get(key) is not None:
                return f"{key} was given (packed sequences)"
        if layer.training and _attention_dropout(layer, self.config) > 0:
            return "attention_dropout > 0 (set after patching)"
        if type(layer.mlp._modules.get("act_fn")).__name__ not in _SILU:
            return "mlp.act_fn is not SiLU"
        if kwargs.get("is_causal") is False or not getattr(layer.self_attn, "is_causal", True):
            return "attention is not causal (is_causal=False)"
        if kwargs.get("attention_mask") is None and impl == "eager":
            return "attention_mask=None with eager attention means no mask at all"
        problem = _structure_problem(layer, hooks=True)
        if problem:
            return problem
        pe = kwargs.get("position_embeddings")
        if pe is None:
            return "position_embeddings was not given"
        cos, sin = pe
        if x.dim() != 3 or cos.dim() != 3 or cos.shape[1:] != (x.shape[1], spec.head_dim) \
                or cos.shape[0] not in (1, x.shape[0]) or sin.shape != cos.shape:
            return (f"position_embeddings of shape {tuple(cos.shape)} do not fit hidden_states "
                    f"{tuple(x.shape)} and head_dim {spec.head_dim}")
        if cos.requires_grad or sin.requires_grad:
            return "cos/sin require grad"
        if torch.is_autocast_enabled(x.device.type):
            return (f"autocast is enabled on {x.device.type} (the fused op computes in the "
                    "weights' dtype: load the model in the training dtype instead)")
        dtypes = {x.dtype, cos.dtype, sin.dtype} | {p.dtype for p in layer.parameters()}
        devices = {x.device, cos.device, sin.device} | {p.device for p in layer.parameters()}
        if len(dtypes) != 1 or len(devices) != 1 or not x.is_floating_point():
            return (f"hidden_states, cos/sin and weights differ in dtype or device "
                    f"({sorted(map(str, dtypes))}, {sorted(map(str, devices))})")
        return None

    def _fused(self, x: Tensor, position_embeddings, kpm: Optional[Tensor]) -> Tensor:
        layer, spec = self.layer, self.spec
        a, m = layer.self_attn, layer.mlp
        qn, kn = a._modules.get("q_norm"), a._modules.get("k_norm")
        cos, sin = position_embeddings
        return torch.ops.ckpt_ext.decoder_layer(
            x, layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
            a.o_proj.weight, a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias,
            None if qn is None else qn.weight, None if kn is None else kn.weight,
            cos, sin, kpm, layer.post_attention_layernorm.weight, m.gate_proj.weight,
            m.up_proj.weight, m.down_proj.weight, m.gate_proj.bias, m.up_proj.bias,
            m.down_proj.bias, spec.num_heads, spec.num_kv_heads, spec.eps, spec.scale,
            self.preset)


# ---- public API ------------------------------------------------------------------------------

_GC_SAVED = "_ckpt_ext_gradient_checkpointing"  # a layer's HF flag, turned off by patching
_HF_GC_MESSAGE = ("HF gradient checkpointing is enabled as well: layers with a ckpt_ext preset "
                  "recompute once (HF's checkpoint is skipped for fused layers and does the "
                  "work of 'torch' ones); layers with policy 'none' keep HF's checkpointing. "
                  "Turned on after patch_llama, it is taken over only by patching again")


@functools.lru_cache(maxsize=None)
def _hf_checkpoint_site(layer_cls: type) -> str:
    """Where HF's gradient checkpointing wraps a decoder layer: ``"loop"`` (transformers before
    4.52: the model's layer loop calls ``_gradient_checkpointing_func(layer.__call__, ...)``),
    ``"call"`` (4.52-4.57: ``GradientCheckpointingLayer.__call__``, around the patched forward)
    or ``"forward"`` (5.x: the class ``forward``, which the patched forward calls only when it
    delegates)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return "loop"
    if not issubclass(layer_cls, GradientCheckpointingLayer):
        return "loop"
    return "call" if "__call__" in GradientCheckpointingLayer.__dict__ else "forward"


class _SkipPatchedLayers:
    """Stands in for the bare model's ``_gradient_checkpointing_func``, which transformers
    before 4.52 calls in its layer loop as ``func(layer.__call__, *args)``: patched layers
    recompute by themselves and run directly; other calls go to HF's function."""

    def __init__(self, func: Callable):
        self.func = func

    def __call__(self, fn, *args, **kwargs):
        layer = getattr(fn, "__self__", None)
        if isinstance(getattr(layer, "__dict__", {}).get("forward"), _PatchedForward):
            return fn(*args, **kwargs)
        return self.func(fn, *args, **kwargs)


def _take_over_hf_checkpointing(shared: _Shared) -> None:
    """Keep HF's gradient checkpointing from recomputing a patched layer a second time."""
    owner = shared.owner
    func = owner.__dict__.get("_gradient_checkpointing_func")
    if func is not None and not isinstance(func, _SkipPatchedLayers):
        owner._gradient_checkpointing_func = _SkipPatchedLayers(func)
    if _hf_checkpoint_site(type(shared.layers[0])) == "call":
        for layer in shared.layers:
            patched = layer.__dict__.get("forward")
            if isinstance(patched, _PatchedForward) and patched.preset in FUSED_PRESETS \
                    and layer.__dict__.get("gradient_checkpointing"):
                layer.__dict__[_GC_SAVED] = True
                layer.gradient_checkpointing = False


def patch_llama(model: nn.Module, policy: Policy = "balanced") -> nn.Module:
    """Give every decoder layer of ``model`` a recompute preset; returns ``model`` (patched in
    place). ``policy``: a preset name for every layer, a list with one per layer, or a
    callable ``(layer_idx) -> preset``; presets are ``ckpt_ext.presets.PRESETS``. Raises
    ValueError, before changing anything, when a layer asked to be fused cannot be (see the
    module docstring). Patching a patched model first undoes the earlier patch."""
    owner, layers = _decoder_layers(model)
    config = _model_config(model)
    presets = _resolve_policy(policy, len(layers))
    specs = {}
    for idx, (layer, preset) in enumerate(zip(layers, presets)):
        if _foreign_forward(layer):
            raise ValueError(f"patch_llama: decoder layer {idx} already has an instance-level "
                             "forward (accelerate hooks or another patch), which patching "
                             "would drop")
        if preset in FUSED_PRESETS:
            specs[idx] = _check_fusable(layer, idx, config)
    unpatch_llama(model)
    shared = _Shared(owner, layers)
    for idx, (layer, preset) in enumerate(zip(layers, presets)):
        if preset != "none":
            layer.forward = _PatchedForward(layer, idx, preset, specs.get(idx), shared, config)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()) \
            and any(p != "none" for p in presets):
        warnings.warn(f"ckpt_ext.patch_llama: {_HF_GC_MESSAGE}", stacklevel=2)
        shared.warned.add("hf checkpointing")
    _take_over_hf_checkpointing(shared)
    return model


def unpatch_llama(model: nn.Module) -> nn.Module:
    """Undo ``patch_llama``: every layer gets HF's forward back (and HF's gradient
    checkpointing its say). Returns ``model``; a model that is not patched is unchanged."""
    owner, layers = _decoder_layers(model)
    func = owner.__dict__.get("_gradient_checkpointing_func")
    if isinstance(func, _SkipPatchedLayers):
        owner._gradient_checkpointing_func = func.func
    for layer in layers:
        if isinstance(layer.__dict__.get("forward"), _PatchedForward):
            del layer.__dict__["forward"]
        if layer.__dict__.pop(_GC_SAVED, False):
            layer.gradient_checkpointing = True
    return model
