"""ckpt_ext: activation recompute for training LLaMA-style transformers.

Public API:
    checkpoint(fn, *args, preserve_rng_state=True, **kwargs)   C++ segment checkpoint
    saved_activation_bytes(fn, *args, **kwargs)                  bytes held for backward
    peak_memory_bytes(fn, *args, **kwargs)                       peak bytes allocated by fn
    ops.attention / ops.swiglu_mlp / ops.rms_norm                differentiable kernel ops
    ops.linear_cross_entropy                                     LM-head loss without logits
    modules.DecoderLayer / Attention / SwiGLUMLP / RMSNorm       drop-in modules, policy=
    presets.PRESETS, presets.saved_bytes                         the presets and their bytes
    patch_llama(model, policy=None, *, activation_budget=None, fuse_lm_head=True,
                offload=None, offload_limit=None, host_link_gbytes_per_s=None,
                sequence_parallel=None, router_aux_loss="exact", segment_layers=1),
    patch_model (the same), unpatch_llama(model)                 HF LLaMA-style families
    PatchRefused                                                 what patch_llama refuses
    SUPPORTED_MODEL_TYPES                                        the model_types patched
    offload.Offloader                                            saved layer tensors in host memory
    plan (python -m ckpt_ext.plan)                               bytes per preset, auto choice
    config.current() / config.patch(**settings)                 the kernel settings
    use_triton(device_type="cpu")                                Triton launchers in a block
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the ckpt_ext operators)
from . import _backend, blocks, config, modules, offload, ops, presets
from ._backend import use_triton
from .checkpoint import checkpoint
from .hf import SUPPORTED_MODEL_TYPES, PatchRefused, patch_llama, patch_model, unpatch_llama
from .memory import peak_memory_bytes, saved_activation_bytes

__all__ = ["checkpoint", "saved_activation_bytes", "peak_memory_bytes", "patch_llama",
           "patch_model", "unpatch_llama", "PatchRefused", "SUPPORTED_MODEL_TYPES", "ops",
           "blocks", "modules", "offload", "presets", "config", "use_triton"]
__version__ = "0.1.0"

_backend.register_from_environment()
