"""The KV-cache keywords of the supported transformers versions, recognised in one place.

transformers 5.17 hands a decoder layer its cache as ``past_key_values=`` and its model outputs
carry it in a ``past_key_values`` field; 5.24 renamed both to ``cache`` (the old keyword is a
deprecated alias that warns), and several of its bare models (Gemma 2, Gemma 3, VaultGemma,
OLMo-3, CWM, Qwen3-VL) no longer pass ``use_cache`` to their layers at all: the cache object is
the only sign that one must be filled. A patched layer or head that looked for one spelling
only would run fused and leave the cache empty. Every check of "does this call use a KV cache"
and every read or write of an output's cache goes through here.
"""
from __future__ import annotations

from typing import Any, Mapping

# Every keyword under which a supported transformers version passes a KV cache to a model,
# a decoder layer or an attention module (``past_key_value``: the singular of older layers).
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")


def uses_cache(kwargs: Mapping[str, Any]) -> bool:
    """Whether a call with these keywords reads or fills a KV cache: ``use_cache`` is true,
    or a cache object is given under any of ``CACHE_KEYWORDS``."""
    return bool(kwargs.get("use_cache")) or any(kwargs.get(k) is not None
                                                for k in CACHE_KEYWORDS)


def _output_cache_field() -> str:
    """The field of transformers' model outputs that holds the cache in this version (read off
    the dataclass's field table, which torch.compile traces; ``dataclasses.fields`` it does
    not: a graph break at every patched model's output)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
        else "past_key_values"


def output_cache(outputs) -> Any:
    """The cache a transformers model output carries (None when it has none), read under this
    version's field name (so no deprecation warning)."""
    return getattr(outputs, _output_cache_field(), None)


def causal_lm_output(*, loss, outputs, moe_fields=None, logits=None):
    """transformers' ``CausalLMOutputWithPast`` for a forward that formed no logits (or
    ``logits``): ``loss`` and the bare model's ``outputs`` (cache, hidden states, attentions)
    under this version's field names; with ``moe_fields`` (``aux_loss``, ``router_logits``)
    the ``MoeCausalLMOutputWithPast`` of the mixture-of-experts CausalLM forwards."""
    from transformers.modeling_outputs import (
        CausalLMOutputWithPast,
        MoeCausalLMOutputWithPast,
    )
    cls = CausalLMOutputWithPast if moe_fields is None else MoeCausalLMOutputWithPast
    return cls(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
               attentions=outputs.attentions, **(moe_fields or {}),
               **{_output_cache_field(): output_cache(outputs)})
