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
    docstring: they cost recompute)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    attention_output_norm: bool = False
    mlp_output_norm: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerDims: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LayerDims: num_kv_heads must divide num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")

    def kwargs(self) -> dict:
        """The keyword arguments of ``presets.per_token_bytes``."""
        return dict(H=self.hidden_size, Hq=self.num_heads, Hkv=self.num_kv_heads,
                    D=self.head_dim, I=self.intermediate_size)




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
