"""One decoder layer as every consumer reads it: its shape, its norms, the fused op's options.

A :class:`LayerRecord` is built once per layer by whoever reads the layer itself: for a
Hugging Face model ``ckpt_ext.hf.families.layer_record`` (the only reader of an HF layer), for
``ckpt_ext.modules.DecoderLayer`` its ``LayerConfig``. The consumers read the record, never the
layer again: ``ckpt_ext.hf.patch`` and ``ckpt_ext.modules`` call the op with
:meth:`LayerRecord.options` (the record's options plus the call's tensors), the planner
(``ckpt_ext.plan``) and the offloader take its shape, :class:`LayerDims`, as do the
benchmarks.

This module depends on the op's record of arguments (``ckpt_ext.blocks.LayerOptions``) and on
nothing of the HF integration.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from .blocks import LAYER_ARGS, LayerOptions

__all__ = ["LayerDims", "LayerRecord"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LayerOptions)
             if f.default is not dataclasses.MISSING}


@dataclass(frozen=True)
class LayerDims:
    """The shape of one decoder layer: H, Hq, Hkv, D, I, and whether the layer norms the
    attention's / the MLP's output before the residual add (``ckpt_ext.plan``'s module
    docstring: they cost recompute).

    A mixture-of-experts layer has ``experts`` > 0 routed SwiGLU experts of
    ``expert_intermediate_size`` each, ``top_k`` of them per token; its
    ``intermediate_size`` is then its shared expert's (Qwen2-MoE), 0 when it has none.
    ``router_logits``: the step makes HF's load-balancing loss (HF's ``output_router_logits``),
    which the plan counts: with ``router_aux_loss`` "exact" the layer returns its (tokens,
    experts) router logits for it, with "fused" (``patch_llama(router_aux_loss="fused")``) its
    (3, experts) float32 statistics only."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    attention_output_norm: bool = False
    mlp_output_norm: bool = False
    experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    router_logits: bool = False
    router_aux_loss: str = "exact"

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "experts", "top_k", "expert_intermediate_size"):
            value = getattr(self, name)
            least = 0 if name in ("experts", "top_k", "expert_intermediate_size") or (
                name == "intermediate_size" and self.experts) else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive" if least else "a non-negative"
                raise ValueError(f"LayerDims: {name} must be {kind} int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LayerDims: num_kv_heads must divide num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(f"LayerDims: top_k must be in [1, experts={self.experts}], "
                                 f"got {self.top_k}")
            if self.expert_intermediate_size <= 0:
                raise ValueError("LayerDims: expert_intermediate_size must be a positive int "
                                 f"with experts, got {self.expert_intermediate_size}")
        elif self.top_k or self.expert_intermediate_size or self.router_logits \
                or self.router_aux_loss != "exact":
            raise ValueError("LayerDims: top_k, expert_intermediate_size, router_logits and "
                             "router_aux_loss need experts > 0 (a mixture-of-experts layer)")
        if self.router_aux_loss not in ("exact", "fused"):
            raise ValueError("LayerDims: router_aux_loss must be 'exact' or 'fused', got "
                             f"{self.router_aux_loss!r}")

    @property
    def moe(self) -> bool:
        """Whether the layer's FFN is a mixture of experts."""
        return self.experts > 0

    def ffn_kwargs(self) -> dict:
        """The MoE keyword arguments of ``ckpt_ext._C.layer_chunk_rows`` / ``mlp_chunk_rows``
        (none for a dense layer)."""
        if not self.experts:
            return {}
        return dict(hidden=self.hidden_size, experts=self.experts, top_k=self.top_k,
                    expert_intermediate=self.expert_intermediate_size)

    def ffn_parameters(self) -> int:
        """The FFN's weights: a dense SwiGLU's 3 H I; an MoE FFN's experts (E 3 H I_e), its
        router (E H) and its shared expert (3 H I)."""
        H = self.hidden_size
        return 3 * H * self.intermediate_size + self.experts * (
            3 * H * self.expert_intermediate_size + H)

    def active_intermediate(self) -> int:
        """The SwiGLU width one token runs through: I, or top_k I_e plus the shared I."""
        return self.intermediate_size + self.top_k * self.expert_intermediate_size

    def kwargs(self) -> dict:
        """The keyword arguments of ``presets.per_token_bytes``."""
        return dict(H=self.hidden_size, Hq=self.num_heads, Hkv=self.num_kv_heads,
                    D=self.head_dim, I=self.intermediate_size, top_k=self.top_k)


@dataclass(frozen=True)
class LayerRecord:
    """One decoder layer: ``dims`` (its shape), ``norms`` (the op's norm slots, its
    ``WEIGHT_SLOTS`` names without ``.weight``, mapped to the layer's module paths: which
    norms it has), ``fields`` (the op's per-layer options, ``LAYER_FIELDS``, by name),
    ``window`` (its sliding window, None for full attention), ``rope`` (whether it rotates q
    and k), ``fused`` (its fused projections' row blocks, e.g. Phi-3's qkv_proj) and
    ``source`` (what the reader built it from, e.g. the HF family; opaque to the consumers)."""

    dims: LayerDims
    norms: Mapping[str, str] = field(default_factory=dict)
    fields: Mapping[str, Any] = field(default_factory=dict)
    window: Optional[int] = None
    rope: bool = True
    fused: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)
    source: Any = None

    def __post_init__(self):
        unknown = set(self.fields) - set(LAYER_ARGS)
        if unknown:
            raise ValueError(f"LayerRecord: fields {sorted(unknown)} are not arguments of the op "
                             f"(ckpt_ext.blocks.LAYER_ARGS)")

    def __getattr__(self, name: str):
        # the op's options by name: record.num_heads, record.eps, ... (the schema's default
        # where the record leaves one out)
        if name in LAYER_ARGS and name != "weights":
            fields = self.__dict__.get("fields", {})
            return fields[name] if name in fields else _DEFAULTS[name]
        raise AttributeError(name)

    @property
    def slots(self) -> Tuple[str, ...]:
        """The norm weight slots the layer fills (``WEIGHT_SLOTS`` names)."""
        return tuple(f"{slot}.weight" for slot in self.norms)

    def options(self, **call) -> LayerOptions:
        """The op's arguments for one call (``ckpt_ext.blocks.LayerOptions``): the record's
        options with the call's (weights, tables, masks, preset, ...)."""
        return LayerOptions(**{**self.fields, **call})

    def replace(self, **changes) -> "LayerRecord":
        return dataclasses.replace(self, **changes)
