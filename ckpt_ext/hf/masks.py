"""What decides a batch's attention mask, read where the model receives it.

HF's decoder layers get a mask that transformers built from the model's 2-D
``attention_mask`` and ``position_ids`` (and, for windowed layers, the config's sliding
window). ``patch_llama`` reads those inputs once per forward, with a forward pre-hook on the
bare ``*Model``, and hands the fused layers what the kernels take: a key padding mask, packed
segment ids and the layer's window. Nothing is inferred from the 4-D mask the layers receive,
except when a patched layer is called outside its model's forward (then
``padding_mask_from_4d`` checks, with a host sync, that the mask is causal + key padding).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor


class BatchMasks(NamedTuple):
    """The masks of one forward. ``custom``: why the batch's mask is not one the fused kernels
    express (the layers then run HF's forward), or None."""

    key_padding_mask: Optional[Tensor] = None   # bool (B, S), True = real token
    segment_ids: Optional[Tensor] = None        # int (B, S): packed documents
    custom: Optional[str] = None


def packed_segment_ids(position_ids: Tensor, compiling: bool) -> Optional[Tensor]:
    """transformers' packed-sequence rule: a new document starts wherever ``position_ids`` does
    not increase by one. ``(B, S)`` int32 segment ids (the layers keep them for backward: half
    the bytes of int64), or None when no row is packed (decided only outside compilation, as
    transformers does: a compiled graph always carries the ids)."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, dim=-1, prepend=first) != 1
    ids = starts.cumsum(-1, dtype=torch.int32)
    if not compiling and not bool(ids[:, -1].any()):
        return None
    return ids


def describe(attention_mask, position_ids, compiling: bool) -> BatchMasks:
    """The masks the fused layers use for a model call with these inputs (no KV cache)."""
    if attention_mask is None:
        if position_ids is None or not isinstance(position_ids, Tensor) or position_ids.dim() != 2:
            return BatchMasks()
        return BatchMasks(segment_ids=packed_segment_ids(position_ids, compiling))
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        return BatchMasks(custom="a custom attention mask (not a 2-D padding mask) was given")
    kpm = attention_mask.bool()
    if not compiling and bool(kpm.all()):
        kpm = None
    return BatchMasks(key_padding_mask=kpm)


def padding_mask_from_4d(mask: Tensor, b: int, s: int) -> Tuple[bool, Optional[Tensor]]:
    """``(ok, key_padding_mask)`` for a 4-D HF mask ``(1 or B, 1, S, >= S)``: bool (True = may
    attend) or additive float (0 = may attend, the dtype's min = masked).

    ``ok`` only when every row is exactly ``causal & key_padding_mask[None, :]``, except that
    a query row which may attend nothing there (a padded query before the first real token)
    may also be fully unmasked, as transformers makes such rows for SDPA. The fused op
    outputs 0 on those rows; HF whatever its kernel gives. ``key_padding_mask`` (B, S) is
    read off the last query row, which may attend every real key; None when all are real."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != s or mask.shape[3] < s \
            or mask.shape[0] not in (1, b):
        return False, None
    mask = mask[..., :s]
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    elif mask.is_floating_point():
        allowed = mask[:, 0] == 0
        if not bool((allowed | (mask[:, 0] == torch.finfo(mask.dtype).min)).all()):
            return False, None  # additive biases other than 0 / masked
    else:
        return False, None
    allowed = allowed.expand(b, s, s)
    kpm = allowed[:, -1, :].clone()
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    expected = causal & kpm[:, None, :]
    rows_ok = (allowed == expected).all(-1) | (~expected.any(-1) & allowed.all(-1))
    if not bool(rows_ok.all()):
        return False, None
    return True, (None if bool(kpm.all()) else kpm)
