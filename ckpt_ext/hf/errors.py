"""The exception ``patch_llama`` raises when it refuses a model: ``PatchRefused``."""


class PatchRefused(ValueError, NotImplementedError):
    """``patch_llama`` will not patch this model as asked: a model type, layer structure,
    setting or combination of options that the fused op does not compute (the message names it
    and what to use instead). Raised before anything is changed. A subclass of both ValueError
    and NotImplementedError, the types these refusals raised before it existed, so that code
    catching either keeps working; catch ``ckpt_ext.PatchRefused`` to catch every refusal (for
    example, to fall back to HF gradient checkpointing). Malformed arguments (an unknown preset
    name, a wrong type, a budget that is not a size) raise plain ValueError or TypeError."""
