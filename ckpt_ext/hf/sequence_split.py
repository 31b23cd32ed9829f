"""Refuse fused training forwards while sequence parallelism has taken over attention, or
let the fused layers take part in it (DeepSpeed's Ulysses).

Sequence (context) parallelism for Hugging Face models works by replacing the attention
function that HF's decoder layers call, so that each rank's shard of the sequence attends over
the whole sequence:

* torch's ``context_parallel`` (``torch.distributed.tensor.experimental``): while its context
  is active, ``torch.nn.functional.scaled_dot_product_attention`` is its ring attention, which
  HF's ``sdpa`` attention calls.
* DeepSpeed's Ulysses (``UlyssesSPAttentionHF.register_with_transformers``): transformers'
  ``ALL_ATTENTION_FUNCTIONS`` holds, under the model's own ``attn_implementation`` name, an
  all-to-all wrapper around the original function (any other attention function registered
  there in place of transformers' own is treated the same way).

A fused layer (the presets ``fast``, ``balanced``, ``min_memory`` and ``auto``) computes its
attention inside one op and calls neither: under sequence parallelism it would attend over its
own rank's tokens only and train on wrong losses without a word. Unless the model was
patched with ``sequence_parallel=group`` (the fused layers then run Ulysses themselves,
``ckpt_ext.hf.sequence_parallel``), ``refuse_split_attention`` raises instead, naming what
replaced the attention and what to do: ``policy="torch"`` (HF's layers under
``torch.utils.checkpoint``) or ``policy="none"`` / ``unpatch_llama``, whose layers call the replaced function and keep
working, as do forwards without grad (the fused layers run HF's forward there); or train
without sequence parallelism.

DeepSpeed's Ulysses (the ALST route: HF ``Trainer`` / TRL with ``ParallelismConfig(sp_size=N)``)
is not refused: its wrapper closes over a ``UlyssesSPAttentionHF`` whose ``process_group`` is
its sequence-parallel group, and the fused layers run Ulysses in that group themselves, as if
patched with ``sequence_parallel=`` it (``deepspeed_ulysses_group``, read by the model's
pre-hook at every training forward, so registering before or after ``patch_llama`` is alike),
on the batch that DeepSpeed's ``UlyssesSPDataLoaderAdapter`` cut (``shift_labels``, global
``position_ids``). HF's layers (policy ``"torch"``, forwards without grad) call its wrapper.

What is detected is the replaced function itself, not a configuration name: context_parallel's
wrapper is found among the functions it installed, and the registry entry by the module that
defined it. Other replacements of torch's SDPA are left alone (they may be kernels computing
the same attention). context_parallel's newer module-wrapper form puts hooks on the attention
modules it is given, and a fused layer with hooks on its submodules already runs HF's forward.
Under ``torch.compile`` the check is traced with the rest of the model's pre-hook: the graph
guards on both functions, so entering context_parallel or registering Ulysses after
compilation recompiles and refuses.

Every rank refuses, so that none waits in a collective for one that raised. The decision reads
only (1) process-wide state that the sequence-parallel setup installs in every process of its
group (each rank of a context-parallel mesh enters ``context_parallel``, each Ulysses rank calls
``register_with_transformers``; the ring or all-to-all collectives would fail without all of
them), (2) which of the model's layers are fused, (3) whether grad is enabled; never the
rank's data (the data-dependent reasons a layer runs HF's forward instead are not consulted),
and it runs at the model forward's entry, before any collective of that forward. A program
whose ranks run the same code therefore raises on all of them at the same point. The decision
is not reduced over a process group: that would add a collective and a host sync to every
training forward of every distributed run, and would deadlock pipeline-parallel stages, whose
forwards do not run in step; and a rank whose model is not patched has no hook to take part
in such a reduction anyway.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["split_attention", "refuse_split_attention", "deepspeed_ulysses_group"]

# torch's own SDPA: torch.nn.functional re-exports the C function (with a docstring added)
_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
# The package of context_parallel (its module has moved between torch releases: experimental.
# _attention, experimental._context_parallel._attention); that module keeps the functions it
# installed in _replaced_functions (wrapper -> (name, original)).
_CONTEXT_PARALLEL = "torch.distributed.tensor.experimental."


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}." \
        f"{getattr(fn, '__qualname__', None) or type(fn).__name__}"


def _context_parallel_sdpa() -> bool:
    """Whether ``torch.nn.functional.scaled_dot_product_attention`` is context_parallel's ring
    attention now (its context is active on this rank)."""
    sdpa = F.scaled_dot_product_attention
    if sdpa is _TORCH_SDPA:
        return False
    module = getattr(sdpa, "__module__", None) or ""  # where the wrapper was defined
    if not module.startswith(_CONTEXT_PARALLEL):
        return False
    return sdpa in getattr(sys.modules.get(module), "_replaced_functions", {})


def _registered_attention(impl: str):
    """The function transformers' ``ALL_ATTENTION_FUNCTIONS`` holds for ``impl``, or None (not
    registered: HF's layers then use their own eager attention)."""
    utils = sys.modules.get("transformers.modeling_utils")
    registry = getattr(utils, "ALL_ATTENTION_FUNCTIONS", None)
    if registry is None:
        return None
    return registry.get(impl)


def _deepspeed_ulysses(impl: str):
    """The ``UlyssesSPAttentionHF`` behind the function that transformers'
    ``ALL_ATTENTION_FUNCTIONS`` holds for ``impl`` when that function is the wrapper DeepSpeed's
    ``register_with_transformers`` installed (deepspeed 0.19.8 ``ulysses_sp.py``: a closure
    over it), else None. Found by the function and the object it closes over, not by a name;
    deepspeed is not imported."""
    fn = _registered_attention(impl)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            obj = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        cls = type(obj)
        if cls.__name__ == "UlyssesSPAttentionHF" and \
                (cls.__module__ or "").startswith("deepspeed."):
            return obj
    return None


def deepspeed_ulysses_group(impl: str, training: bool = True):
    """DeepSpeed Ulysses' sequence-parallel group (its ``process_group``, the SP group of its
    mpu) while its wrapper is the attention function of ``impl`` and splits the sequence: not
    for a model in eval mode when it was registered with ``disable_in_eval`` (its wrapper then
    calls the original attention over the unsplit batch). None otherwise."""
    ulysses = _deepspeed_ulysses(impl)
    if ulysses is None or (not training and getattr(ulysses, "disable_in_eval", False)):
        return None
    return getattr(ulysses, "process_group", None)


def split_attention(impl: str) -> Optional[str]:
    """What replaced the attention function that HF's layers of attn_implementation ``impl``
    call (sequence parallelism, see the module docstring), or None when it is their own."""
    if impl == "sdpa" and _context_parallel_sdpa():
        return ("torch's context_parallel (torch.distributed.tensor.experimental."
                "context_parallel) is active: torch.nn.functional.scaled_dot_product_attention, "
                "which HF's sdpa attention calls, is its ring attention over the sharded "
                "sequence")
    fn = _registered_attention(impl)
    if fn is not None:
        module = getattr(fn, "__module__", None) or ""
        if module != "transformers" and not module.startswith("transformers."):
            ulysses = "deepspeed" in module and "sequence_parallel" in module
            return (f"transformers' ALL_ATTENTION_FUNCTIONS[{impl!r}] is {_name(fn)}, not "
                    "transformers' own attention"
                    + (" (DeepSpeed Ulysses' register_with_transformers installed it for "
                       "sequence parallelism)" if ulysses else ""))
    return None


def refuse_split_attention(impl: str, fused_layers: Callable[[], Sequence[int]],
                           sequence_parallel: bool = False) -> None:
    """Raise a RuntimeError when a training forward (grad enabled) of a model whose layers
    ``fused_layers()`` (their indices; asked only when needed) run the fused op would bypass an
    attention function that sequence parallelism replaced (``split_attention``).
    ``sequence_parallel``: the model was patched with ``sequence_parallel=`` (its fused layers
    run Ulysses themselves): a registered attention function is then not theirs to call; an
    active context_parallel (the two would split the sequence twice) is refused by
    ``sequence_parallel.masks``, on every rank of the group at once."""
    if not torch.is_grad_enabled():
        return
    if sequence_parallel:  # context_parallel refused by sequence_parallel.masks, on every rank
        return
    if _deepspeed_ulysses(impl) is not None:  # the fused layers take part (patch.py)
        return
    what = split_attention(impl)
    if what is None:
        return
    fused = list(fused_layers())
    if not fused:
        return
    raise RuntimeError(
        f"ckpt_ext.patch_llama: {what}. The patched model's decoder layers "
        f"{', '.join(map(str, fused))} run the fused op, which computes attention itself over "
        "this rank's tokens only, so its training would be silently wrong. The fused layers "
        "take part in sequence parallelism through their own route: "
        "patch_llama(model, ..., sequence_parallel=group), Ulysses inside the fused op, with "
        "the batch cut by ckpt_ext.hf.sequence_parallel.shard_batch (torch's ring attention "
        "inside the fused op is not built). Or patch with policy='torch' (HF's layers under "
        "activation checkpointing) or policy='none', or call ckpt_ext.unpatch_llama(model), "
        "to keep this sequence parallelism")
