"""Hugging Face integration: ``patch_llama`` (also ``patch_model``) / ``unpatch_llama`` put
ckpt_ext's fused layers into the LLaMA-style families of ``SUPPORTED_MODEL_TYPES``
(``ckpt_ext.hf.patch``; see its docstring).

One module per concern: ``patch`` (the decoder-layer patch and the public API), ``masks``
(the batch's masks from the model's inputs), ``adapters`` (plain and PEFT LoRA projections),
``lm_head`` (the loss without logits), ``zero`` (what DeepSpeed ZeRO-3 gathers when),
``families`` (what each model_type's layer computes, as the op's options).
``import ckpt_ext`` never imports transformers; these modules import it on first use.
"""
from .errors import PatchRefused
from .patch import SUPPORTED_ATTENTION, SUPPORTED_MODEL_TYPES, patch_llama, unpatch_llama

patch_model = patch_llama  # the general name: every family, not only Llama

__all__ = ["patch_llama", "patch_model", "unpatch_llama", "PatchRefused",
           "SUPPORTED_MODEL_TYPES", "SUPPORTED_ATTENTION"]
