"""Hugging Face integration: ``patch_llama`` / ``unpatch_llama`` put ckpt_ext's fused layers
into Llama, Mistral, Qwen2 and Qwen3 models (``ckpt_ext.hf.patch``; see its docstring).

One module per concern: ``patch`` (the decoder-layer patch and the public API), ``masks``
(the batch's masks from the model's inputs), ``adapters`` (plain and PEFT LoRA projections),
``lm_head`` (the loss without logits), ``zero`` (what DeepSpeed ZeRO-3 gathers when).
``import ckpt_ext`` never imports transformers; these modules import it on first use.
"""
from .patch import SUPPORTED_ATTENTION, SUPPORTED_MODEL_TYPES, patch_llama, unpatch_llama

__all__ = ["patch_llama", "unpatch_llama", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ATTENTION"]
