"""``saved_activation_bytes``: what a forward pass leaves held for backward."""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["saved_activation_bytes"]


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def saved_activation_bytes(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Bytes that ``fn(*args, **kwargs)`` leaves saved for backward.

    Runs ``fn`` once under ``torch.autograd.graph.saved_tensors_hooks`` and adds up the
    storages of every tensor an autograd node saves (built-in ops, Python and C++ autograd
    Functions, the inputs kept by ``ckpt_ext.checkpoint`` and ``torch.utils.checkpoint``).
    Each storage counts once, at its full size, however many tensors view it; parameters (and
    views of parameters) are excluded, since they are held whether or not a backward follows.
    What an active ``torch.utils.checkpoint`` region saves internally is discarded by it and
    so, correctly, not counted.

    Example: ``saved_activation_bytes(layer, x)`` for ``nn.Sequential(nn.Linear(a, b),
    nn.GELU())`` in fp32 is ``4 * (x.numel() + N * b)``: the Linear saves x, GELU saves its
    input.
    """
    storages: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t) and t.layout == torch.strided:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            storages[key] = max(storages.get(key, 0), storage.nbytes())
        # A detached alias: holding the tensor itself would tie a saved output to its own node.
        return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args, **kwargs)
    total = sum(storages.values())  # every counted storage is still alive: `out` holds them
    del out
    return total
