"""The LM head and loss of a patched ``*ForCausalLM``, without logits.

In a training forward (grad enabled, ``labels`` given, no KV cache, all positions kept), the
patched forward runs the bare model, then ``ckpt_ext.ops.linear_cross_entropy`` on its last
hidden state with HF's label shift (or the ``shift_labels`` given), ``ignore_index`` and
``num_items_in_batch`` (a tensor stays a tensor: no host sync). It returns HF's
``CausalLMOutputWithPast`` with ``logits=None``: the ``(B, S, V)`` logits are never formed
(with ``return_dict=False``, HF's tuple of the fields that are not None: the loss first).
Every other call (eval, generate, no labels, ``logits_to_keep``, a head or loss the op does
not compute) runs HF's forward and returns logits as before (with router_aux_loss="fused"
under sequence parallelism, the MoE layers' statistics instead of router logits for its
aux_loss). TRL's own fused head calls the bare model and its own head, so it keeps working,
with the decoder layers fused underneath.

What the model's forward does between its head and its loss is looked up by the transformers
class that defines that forward (``families.HEAD_RULES``), never guessed from the config alone:
Llama and the families like it pass the logits on as they are, Granite divides them by
``config.logits_scaling`` (the op's ``logit_scale``), Gemma 2 and Gemma 3 soft-cap them by
``config.final_logit_softcapping`` when it is set (the op's ``softcap``); the MoE CausalLMs
(Qwen2/3-MoE, Mixtral, OLMoE) pass them on as they are and, with ``output_router_logits``, add
``router_aux_loss_coef`` times transformers' load-balancing loss of the router logits the
fused layers return (ckpt_ext.hf.moe.aux_loss), as their forward does; with
``patch_llama(router_aux_loss="fused")`` the same loss of the (3, E) statistics the fused MoE
layers return instead of their logits (ckpt_ext.hf.moe.load_balancing_loss). A model whose forward
is not one of those (a subclass with a forward of its own, another family) keeps HF's head,
with the reason.

The bare model's final RMSNorm (``model.norm``) gets an instance-level forward too
(``FinalNorm``): ``ckpt_ext.ops.rms_norm`` with the family's rounding (Gemma's 1 + w, Gemma's
and OLMo-2's float32 product cast last), which keeps the pre-norm rows for backward where
HF's norm keeps an fp32 copy of them and its normalised rows. Its output carries its input,
and a fused training forward hands that pre-norm hidden state to ``linear_cross_entropy`` with
the norm's weight: the norm then runs inside the head op, chunk by chunk, and the step keeps
only the pre-norm hidden state (``ckpt_ext._normed_head``); the norm's own output and its graph
are dropped. ``torch.compile`` traces the attribute like any other (no graph break).

Under FSDP2 the fused head runs inside the ``*ForCausalLM``'s own call, after the root unit's
pre-forward hook has unsharded the parameters it manages, so it reads ``lm_head.weight`` and
the norm's weight gathered, as HF's head does, and autograd accumulates their gradients into
FSDP2's unsharded parameters, which its post-backward reduce-scatters. An ``lm_head`` that is an
FSDP2 unit of its own (``fully_shard(model.lm_head)``, alone or grouped with the norm) runs the
fused loss as its forward, through its ``__call__``: its hooks unshard it around the loss, again
for its backward, and reduce-scatter after. The norm runs inside the head only when the head is
no unit of its own (its MixedPrecisionPolicy would cast the pre-norm rows going in, where HF's
casts the normed ones) and no FSDP2 unit lies between the ``*ForCausalLM`` and the norm:
``fully_shard(model.model)`` (or on the language model, or on the norm) reshards the norm's
weight when the bare model's forward ends, before the head, and its backward gathers it again
only when the gradient reaches the bare model's output. There the norm's output goes to the
head op as it is (computed inside the bare model's call: by ``FinalNorm``, or by HF's forward
for a norm with hooks of its own), and the norm's backward runs within that unit's. A head
weight that is a DTensor at the call, the head no unit of its own (its unit not unsharded:
``forward`` called directly rather than the module, or tensor parallelism), gets HF's forward.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from . import moe, quantized
from .errors import PatchRefused
from .cache import causal_lm_output, uses_cache
from .families import Family, HeadRule, head_rule, moe_head as _moe_head, norm_eps
from .zero import gathered_for_head, raw_parameter


@functools.lru_cache(maxsize=None)
def _hf_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss
    return ForCausalLMLoss


def head_transform(model: nn.Module,
                   rule: Optional[HeadRule] = None) -> Tuple[Optional[str], float, float]:
    """(why the fused head cannot stand in for this model's head and loss, or None;
    logit_scale; softcap): the op's arguments that reproduce the model's head. ``rule``: the
    model's head rule when already looked up (``head_rule``)."""
    head = getattr(model, "lm_head", None)
    if quantized.is_quantized_base(head):
        return (f"lm_head is a bitsandbytes {type(head).__name__}: the fused loss needs a dense "
                "head weight (leave lm_head out of the quantization: bitsandbytes' default, "
                "llm_int8_skip_modules)"), 1.0, 0.0
    if not _plain_linear(head):
        return f"lm_head is a {type(head).__name__}, not a plain nn.Linear", 1.0, 0.0
    if not isinstance(getattr(model, "model", None), nn.Module):
        return "the model has no bare .model to run before the head", 1.0, 0.0
    if getattr(model, "loss_function", None) is not _hf_causal_lm_loss():
        return "the model's loss_function is not transformers' ForCausalLMLoss", 1.0, 0.0
    if rule is None:
        problem, rule = head_rule(model)
        if problem:
            return problem, 1.0, 0.0
    return rule(getattr(model, "config", None))


def head_problem(model: nn.Module) -> Optional[str]:
    """Why the fused head cannot stand in for this model's head and loss, or None."""
    return head_transform(model)[0]


ROUTER_AUX_LOSS_MODES = ("exact", "fused")


def check_router_aux_loss(mode, model: nn.Module, owner: nn.Module, layers,
                          fuse_lm_head: bool) -> None:
    """patch_llama's ``router_aux_loss``: "exact", or "fused" where the fused LM head makes the
    load-balancing loss of the MoE layers' statistics (PatchRefused naming what is missing;
    ValueError for another mode)."""
    if mode not in ROUTER_AUX_LOSS_MODES:
        raise ValueError(f"patch_llama: router_aux_loss must be one of {ROUTER_AUX_LOSS_MODES}, "
                         f"got {mode!r}")
    if mode == "exact":
        return
    why = None
    if not any(moe.is_moe_layer(layer) for layer in layers):
        why = "the model has no mixture-of-experts layers"
    elif not fuse_lm_head:
        why = ("fuse_lm_head=False: the fused LM head makes the loss of the layers' "
               "statistics; HF's head needs the logits (use router_aux_loss='exact')")
    elif model is owner or getattr(model, "lm_head", None) is None:
        why = f"{type(model).__name__} is not a *ForCausalLM with the LM head that adds the loss"
    elif "forward" in model.__dict__ and not isinstance(model.__dict__["forward"],
                                                          FusedHeadForward):
        why = f"{type(model).__name__} already has an instance-level forward"
    else:
        problem, rule = head_rule(model)
        problem = problem or head_problem(model)
        if problem is None and rule is not _moe_head:
            problem = f"{type(model).__name__}'s forward adds no load-balancing loss"
        if problem:
            why = f"the LM head cannot be fused: {problem}"
    if why:
        raise PatchRefused(f"patch_llama: router_aux_loss='fused' needs the fused LM head of an "
                         f"MoE *ForCausalLM: {why}")


# The attribute of a FinalNorm output that holds the norm's input (set only for outputs that
# may reach the fused head: grad enabled).
_PRENORM = "_ckpt_ext_prenorm"


def final_norm_problem(norm: Optional[nn.Module]) -> Optional[str]:
    """Why ``norm`` cannot run as ``ckpt_ext.ops.rms_norm``, or None."""
    if norm is None:
        return "the bare model has no .norm"
    if (not type(norm).__name__.endswith("RMSNorm") or norm_eps(norm) is None
            or set(dict(norm.named_parameters())) != {"weight"}):
        return f"model.norm is a {type(norm).__name__}, not the family's RMSNorm"
    if "forward" in norm.__dict__:
        return "model.norm already has an instance-level forward"
    return None


class FinalNorm:
    """The instance-level ``forward`` of a patched model's final RMSNorm (module docstring),
    rounding as the model's ``family`` does. A norm with forward hooks of its own runs HF's
    forward."""

    def __init__(self, norm: nn.Module, family: Family):
        self.norm = norm
        self.eps = norm_eps(norm)
        self.offset, self.cast_last = family.norm_offset, family.norm_cast_last
        self.__signature__ = inspect.signature(self.original)

    @property
    def original(self) -> Callable:
        return functools.partial(type(self.norm).forward, self.norm)

    def __repr__(self) -> str:
        return "<ckpt_ext patched final RMSNorm>"

    def __call__(self, hidden_states):
        norm = self.norm
        if norm._forward_hooks or norm._forward_pre_hooks or not isinstance(hidden_states,
                                                                             torch.Tensor):
            return self.original(hidden_states)
        out = ops.rms_norm(hidden_states, norm.weight, self.eps, offset=self.offset,
                           cast_last=self.cast_last)
        if torch.is_grad_enabled():
            setattr(out, _PRENORM, hidden_states)
        return out

    def head_args(self) -> dict:
        """The norm as ``linear_cross_entropy``'s arguments."""
        return dict(norm_weight=self.norm.weight, norm_eps=self.eps,
                    norm_offset=self.offset, norm_cast_last=self.cast_last)


def _is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (a parameter that FSDP2 keeps sharded, or tensor parallelism),
    read without importing torch.distributed where it is not built."""
    return t is not None and (type(t).__name__ == "DTensor"
                              or type(getattr(t, "data", None)).__name__ == "DTensor")


def _fsdp2_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed, or before FSDP2
        return None
    return FSDPModule


def _fsdp2_unit(module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` applied to it)."""
    fsdp = _fsdp2_module_type()
    return fsdp is not None and isinstance(module, fsdp)


def _plain_linear(module) -> bool:
    """Whether ``module`` is an ``nn.Linear``, or one that ``fully_shard`` made an FSDP2 unit
    (its class FSDP2's subclass of nn.Linear), and no subclass of it."""
    if type(module) is nn.Linear:
        return True
    if not _fsdp2_unit(module):
        return False
    fsdp = _fsdp2_module_type()
    base = [c for c in type(module).__mro__[1:] if not issubclass(c, fsdp)]
    return bool(base) and base[0] is nn.Linear


def _as_forward_of(module: nn.Module, fn: Callable, x: torch.Tensor):
    """``fn(x)`` run as ``module``'s forward, through ``module.__call__`` and so inside its
    hooks: on an FSDP2 unit, the unit unsharded before and resharded after, its pre-backward
    hook on the result (unshard again) and its post-backward one on ``x`` (reduce-scatter)."""
    own = module.__dict__.get("forward")
    module.forward = fn
    try:
        return module(x)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _path_to(root: nn.Module, target: nn.Module) -> list:
    """The modules from ``root``'s child down to ``target`` (included) on the way through
    ``root``'s submodules; empty when ``target`` is not among them."""
    for name, mod in root.named_modules(remove_duplicate=False):
        if mod is target:
            mods, cur = [], root
            for part in name.split(".") if name else []:
                cur = cur._modules[part]
                mods.append(cur)
            return mods
    return []


def take_prenorm(hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """The input of the FinalNorm call that produced ``hidden``, unlinked from it (so that
    ``hidden`` no longer holds it), or None when ``hidden`` did not come from one. (Set to
    None rather than deleted: torch.compile traces attribute stores, not deletions.)"""
    pre = getattr(hidden, _PRENORM, None)
    if pre is not None:
        setattr(hidden, _PRENORM, None)
    return pre


class FusedHeadForward:
    """The instance-level ``forward`` of a patched ``*ForCausalLM``. ``calls`` counts
    ``fused`` and ``hf`` calls (outside compilation). ``owner``: the text model whose final
    norm may run inside the head (``model.model``, or a multimodal model's language model)."""

    def __init__(self, model: nn.Module, owner: Optional[nn.Module] = None, *, shared=None,
                 router_aux_loss: str = "exact"):
        self.model = model
        self.owner = owner
        # the patched layers' shared state (ckpt_ext.hf.patch)
        self.shared = shared
        self.router_aux_loss = router_aux_loss
        params = inspect.signature(type(model).forward).parameters.values()
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        self.calls = {"fused": 0, "hf": 0}
        # the modules from the model down to its final norm (found at the first fused call)
        self._norm_path = None
        # whether the last fused call ran the final norm inside the head op (None: no call yet
        # or no FinalNorm output)
        self.last_norm_in_head = None
        # The class's head rule, looked up once (the class does not change; the config values
        # are read at each call).
        _, self.rule = head_rule(model)
        # What inspect.signature(model.forward) reports: Trainer keeps the dataset columns
        # that the model's forward names.
        self.__signature__ = inspect.signature(self.original)

    @property
    def original(self) -> Callable:
        return functools.partial(type(self.model).forward, self.model)

    def __repr__(self) -> str:
        return "<ckpt_ext patched forward: LM head and loss without logits>"

    def _count(self, key: str) -> None:
        if not torch.compiler.is_compiling():
            self.calls[key] += 1

    def __call__(self, *args, **kwargs):
        kwargs.update(zip(self.positional, args))
        labels = kwargs.get("labels")
        fusable = (labels is not None and torch.is_grad_enabled() and not uses_cache(kwargs)
                   and isinstance(kwargs.get("logits_to_keep", 0), int)
                   and kwargs.get("logits_to_keep", 0) == 0 and self.rule is not None)
        if fusable:
            problem, logit_scale, softcap = head_transform(self.model, self.rule)
            # A sharded head weight here, the head not an FSDP2 unit of its own (unsharded at
            # its call), means no FSDP2 hook unsharded it (the module's forward called
            # directly) or tensor parallelism: HF's forward, which handles the latter.
            head = self.model.lm_head
            fusable = problem is None and (_fsdp2_unit(head) or not any(
                _is_dtensor(raw_parameter(head, n)) for n in ("weight", "bias")))
        if not fusable:
            self._count("hf")
            if self._router_stats_under_sp(kwargs):
                return self._hf_with_router_stats(**kwargs)
            return self.original(**kwargs)
        self._count("fused")
        return self._fused(logit_scale=logit_scale, softcap=softcap, **kwargs)

    def norm_in_head(self, norm: nn.Module) -> bool:
        """Whether the final norm may run inside the head op: not when an FSDP2 unit other than
        the ``*ForCausalLM``'s owns its weight (``fully_shard`` on the bare model, the language
        model or the norm), which reshards it after the bare model's forward and gathers it for
        backward only through the bare model's output; nor when the weight is a DTensor; nor
        when ``lm_head`` is an FSDP2 unit, whose MixedPrecisionPolicy would cast the pre-norm
        rows going in where HF's casts the normed ones."""
        if _is_dtensor(raw_parameter(norm, "weight")):
            return False
        fsdp = _fsdp2_module_type()
        if fsdp is None:
            return True
        if isinstance(self.model.lm_head, fsdp):
            return False
        path = getattr(self, "_norm_path", None)
        if path is None or path[-1:] != [norm]:
            path = self._norm_path = _path_to(self.model, norm)
        return not any(isinstance(m, fsdp) for m in path)

    def _router_stats_under_sp(self, kwargs) -> bool:
        """Whether a call that runs HF's forward (no labels, logits_to_keep, no grad) needs
        the router statistics instead of the logits: router_aux_loss="fused", the load-balancing
        loss asked for (output_router_logits, the call's or the config's), and a
        sequence-parallel group, under which one rank's logits are not the whole sequence's."""
        if getattr(self, "router_aux_loss", "exact") != "fused" or self.rule is not _moe_head \
                or self.shared is None:
            return False
        asked = kwargs.get("output_router_logits")
        if asked is None:
            asked = self.model.config.output_router_logits
        return bool(asked) and bool(self.shared.forward_group())

    def _hf_with_router_stats(self, return_dict=None, **kwargs):
        """HF's forward (its logits, and its loss with labels) without router logits, the fused
        MoE layers returning their statistics summed over the group instead; aux_loss is the
        whole sequence's load-balancing loss, and a loss gets this rank's share of
        router_aux_loss_coef * aux_loss, as the fused head adds them (ckpt_ext.hf.moe.aux_loss).
        router_logits is None."""
        if return_dict is None:
            return_dict = getattr(self.model.config, "return_dict", True)
        stats = moe.RouterStats()
        out = self.original(**{**kwargs, "output_router_logits": False, "return_dict": True,
                               moe.ROUTER_STATS_KEY: stats})
        loss, aux = moe.aux_loss(self.model, out.loss, out, kwargs.get("attention_mask"), True,
                                 stats)
        out = causal_lm_output(loss=loss, outputs=out, logits=out.logits,
                               moe_fields=dict(aux_loss=aux, router_logits=None))
        return out if return_dict else out.to_tuple()

    def _fused(self, labels, logits_to_keep=0, logit_scale=1.0, softcap=0.0, return_dict=None,
               **kwargs):
        # return_dict as transformers' can_return_tuple reads it: the argument, else the
        # config's. The bare model always returns its output object here (it is read by
        # name); a tuple is made at the end, as HF's forward makes one.
        if return_dict is None:
            return_dict = getattr(self.model.config, "return_dict", True)
        num_items = kwargs.get("num_items_in_batch")
        ignore_index = kwargs.get("ignore_index", -100)
        shift_labels = kwargs.get("shift_labels")
        bare = self.model.model
        moe_head = self.rule is _moe_head
        if moe_head:  # the model's forward resolves it so and hands it to the bare model
            router_logits = kwargs.get("output_router_logits")
            if router_logits is None:
                router_logits = self.model.config.output_router_logits
            kwargs["output_router_logits"] = router_logits
        stats = None
        if moe_head and router_logits and getattr(self, "router_aux_loss", "exact") == "fused":
            # the fused MoE layers append their (3, E) statistics instead of their logits, to
            # this forward's own list (the bare model's pre-hook puts it in the forward's state)
            stats = kwargs[moe.ROUTER_STATS_KEY] = moe.RouterStats()
        outputs = bare(**kwargs, return_dict=True)
        hidden = outputs.last_hidden_state
        norm = (getattr(self, "owner", None) or bare)._modules.get("norm")
        prenorm = take_prenorm(hidden)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = self.model.lm_head
        # Read past ZeRO-3's getter: under ZeRO-3 the weight is gathered only around the
        # loss's forward and its backward (ckpt_ext.hf.zero).
        weight, bias = raw_parameter(head, "weight"), raw_parameter(head, "bias")
        labels = shift_labels.to(hidden.device)
        norm_args = {}
        in_head = prenorm is not None and self.norm_in_head(norm)
        if not torch.compiler.is_compiling():
            self.last_norm_in_head = None if prenorm is None else in_head
        if in_head:
            # the final norm inside the head op, on the pre-norm rows (a ZeRO-3 norm has
            # DeepSpeed's hooks: it ran as HF's); else the normed rows as they are
            hidden = prenorm
            norm_args = norm.forward.head_args()

        def loss_of(hidden):
            # read at the call: an FSDP2 head unit swaps in its unsharded parameters then
            w, b = raw_parameter(head, "weight"), raw_parameter(head, "bias")
            device = hidden.device.type
            if torch.is_autocast_enabled(device):  # the head's matmul in the autocast dtype
                dtype = torch.get_autocast_dtype(device)
                w = w.to(dtype)
                b = None if b is None else b.to(dtype)
                if not norm_args:  # the op casts the normed rows itself
                    hidden = hidden.to(dtype)
            elif not norm_args and hidden.dtype != w.dtype:
                hidden = hidden.to(w.dtype)
            return ops.linear_cross_entropy(hidden, w, labels, bias=b, ignore_index=ignore_index,
                                            num_items_in_batch=num_items,
                                            logit_scale=logit_scale, softcap=softcap,
                                            **norm_args)

        if _fsdp2_unit(head):  # fully_shard(lm_head): the loss inside the head's own call
            loss = _as_forward_of(head, loss_of, hidden)
        else:
            loss = gathered_for_head([weight, bias], hidden, loss_of)
        if moe_head:  # HF's MoE output: the load-balancing loss added when it is asked for
            loss, aux = moe.aux_loss(self.model, loss, outputs, kwargs.get("attention_mask"),
                                     router_logits, stats)
            out = causal_lm_output(loss=loss, outputs=outputs, moe_fields=dict(
                aux_loss=aux, router_logits=None if stats is not None else outputs.router_logits))
        else:
            out = causal_lm_output(loss=loss, outputs=outputs)
        # HF's tuple drops the None fields: with no logits formed, the loss is first and the
        # fields after it (cache, hidden states, attentions) follow when the call asked for them
        return out if return_dict else out.to_tuple()
