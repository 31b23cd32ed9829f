"""Ulysses sequence parallelism for a patched HF model: ``patch_llama(model, ...,
sequence_parallel=group)``.

Every rank of ``group`` (a ``torch.distributed`` process group of N ranks) holds the same global
batch and keeps S/N consecutive positions of each sequence: rank r the positions
``r*S/N .. (r+1)*S/N - 1``. ``shard_batch`` cuts a batch so (labels shifted BEFORE the cut, as
``shift_labels``; global ``position_ids``; the count of labelled tokens over the whole batch as
``num_items_in_batch``). The patched model's decoder layers then run the fused op with
``sequence_parallel`` = the group's name: q/k/v are exchanged by all-to-all inside the op so
that each rank attends over the whole sequence for num_heads/N heads (csrc/ulysses.h); the
rest of the layer stays on the rank's tokens. The fused head's loss over the rank's tokens,
divided by the global ``num_items_in_batch``, is the rank's share of the batch's mean loss:
the shares sum to it over the group, and so do the gradients: ``all_reduce_grads(model,
group)`` sums the parameter gradients over the group after backward.

With data parallelism as well (a (dp, sp) device mesh, ``group = mesh.get_group("sp")``, one
global batch per dp index): a wrapper that reduces over every dp x sp rank averages over all of
them, so multiply the loss by N instead of calling ``all_reduce_grads``: DDP over the world,
FSDP2 ``fully_shard`` over the flattened mesh (or call ``set_gradient_divide_factor(dp)`` on
every FSDP module and keep the loss), HSDP over the 2-D mesh, DeepSpeed ZeRO-3 with
``mpu=deepspeed.runtime.sequence_parallel.parallel_state_sp`` (its default reduce-scatter;
its all-reduce path, taken with ``"reduce_scatter": false`` for buckets within
``reduce_bucket_size``, divides by dp itself: factor 1 there). FSDP2 over the dp ranks only:
factor 1, then ``all_reduce_grads`` (it sums the shards). docs/distributed.md has the table.

Under ``torch.compile`` the agreements and mask gathers below are custom ops
(``ckpt_ext::sp_agree``, ``ckpt_ext::sp_agree_gather``) that run eagerly inside the graph:
a compiled model has no graph break on their account.

What the hooks do per forward (``masks`` and ``same_seed`` below): the padding mask and the
packed-document ids are decided on the whole batch (after the forward's agreement, one
all-gather: of the 2-D attention mask, or without one of the position_ids), so that every rank
passes the op the same kinds of tensors; the LoRA dropout seed drawn per layer call is the
group's first rank's on every rank (it rides on the layer call's agreement record), and the op
hashes its masks on global token rows. A fused layer under
``sequence_parallel`` never falls back to HF's forward (that would attend over the rank's
tokens only): a reason to fall back raises instead.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import PatchRefused
from .masks import BatchMasks, describe, packed_segment_ids

__all__ = ["group_name", "group_size", "shard_batch", "all_reduce_grads", "masks", "same_seed",
           "agree", "refuse", "sum_over_group"]


def _dist():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("sequence_parallel: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    return dist


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def group_name(group) -> str:
    """The registered name of ``group`` (patch_llama's ``sequence_parallel``): a
    ``torch.distributed`` ProcessGroup that this rank belongs to. ValueError otherwise."""
    dist = _dist()
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"patch_llama: sequence_parallel must be a torch.distributed "
                         f"ProcessGroup (e.g. dist.new_group(ranks) or a device mesh's "
                         f"get_group()), got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("patch_llama: sequence_parallel is a group this rank does not belong "
                         f"to (global rank {dist.get_rank()})")
    _RANK_SIZE[group.group_name] = (dist.get_rank(group), group.size())
    return group.group_name


def _gather_tokens(t: Tensor, name: str) -> Tensor:
    """(B, S) of this rank -> (B, N*S) over the group, in rank order."""
    g = _group(name)
    n = g.size()
    src = t.t().contiguous()
    out = src.new_empty((n * src.shape[0],) + tuple(src.shape[1:]))
    _dist().all_gather_into_tensor(out, src, group=g)
    return out.t()


# ---- one verdict for the group ----------------------------------------------------------------
#
# A check that fails on one rank only must fail on every rank: the others would otherwise wait
# in the next exchange until the group's timeout. Each refusal point below runs one all-gather
# of a small record (an error kind, the fields that must match over the group, the refusing
# rank's message) and every rank raises the same error. The op does the same inside
# (csrc/ulysses.h, ulysses::agree).

_KINDS = (None, ValueError, TypeError, NotImplementedError, RuntimeError)
# Every record is 128 int64 words whatever the point (the op's too), so that two ranks at
# different points still exchange the same bytes: kind, value, fields, zeros, then the message.
_WORDS, _MESSAGE_BYTES = 128, 768
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dtype_code(t) -> int:
    return _DTYPES.index(t.dtype) + 1 if isinstance(t, Tensor) and t.dtype in _DTYPES else 0


def _device(name: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) \
        if _dist().get_backend(_group(name)) == "nccl" else torch.device("cpu")


# This rank's (rank, size) in each group, by name: read outside compiled code (group_name,
# patch_llama) so that a compiled forward slices its share with constants.
_RANK_SIZE: dict = {}


def _rank_size(name: str) -> tuple:
    if name not in _RANK_SIZE:
        g = _group(name)
        _RANK_SIZE[name] = (g.rank(), g.size())
    return _RANK_SIZE[name]


def _verdict(head: Tensor, name: str, fields: str, message: str) -> Tensor:
    """The agreement itself (eager, inside the custom ops below): this rank's record (``head``:
    kind, value, the field values; then ``message``) all-gathered over group ``name``; raises
    the first refusing rank's error or the first field that differs (``fields``: JSON
    one line "count<TAB>what" per field). Returns rank 0's value (0-dim int64)."""
    at_message = _WORDS - _MESSAGE_BYTES // 8
    if head.numel() > at_message:
        raise ValueError(f"sequence_parallel.agree: at most {at_message - 2} field values")
    record = torch.zeros(_WORDS, dtype=torch.int64)
    record[:head.numel()] = head.to(torch.int64).cpu()
    text = message.encode()[:_MESSAGE_BYTES - 4]
    if text:
        record.view(torch.uint8)[8 * at_message:8 * at_message + len(text)] = \
            torch.frombuffer(bytearray(text), dtype=torch.uint8)
    g = _group(name)
    n = g.size()
    out = record.new_empty(n * record.numel(), device=_device(name))
    _dist().all_gather_into_tensor(out, record.to(out.device), group=g)
    every = out.cpu().view(n, -1)
    for r in range(n):
        k = int(every[r, 0])
        if k:
            msg = bytes(every[r, at_message:].contiguous().view(torch.uint8).tolist())
            msg = msg.rstrip(b"\0").decode(errors="replace")
            raise _KINDS[k](f"{msg} [sequence_parallel: refused on rank {r} of the group's "
                            f"{n} ranks; every rank raises this]")
    at = 2
    for line in filter(None, fields.split("\n")):
        count, what = line.split("\t", 1)
        count = int(count)
        cols = every[:, at:at + count]
        if not bool((cols == cols[0]).all()):
            ranks = "; ".join(f"rank {r} {tuple(cols[r].tolist())}" for r in range(n))
            raise ValueError(f"patch_llama(sequence_parallel=...): every rank passes {what}; "
                             f"the ranks passed {ranks}")
        at += count
    return every[0, 1].clone()


# The agreement as custom ops: opaque to torch.compile (no graph break; they run eagerly inside
# the compiled graph, collectives and raise included), registered as ordered side effects, so
# that a compiled graph keeps one whose result goes unused (a layer's agreement without LoRA
# dropout; a pure op would be dropped) and keeps them in program order.
@torch.library.custom_op("ckpt_ext::sp_agree", mutates_args=())
def _agree_op(head: Tensor, group: str, fields: str, message: str) -> Tensor:
    return _verdict(head, group, fields, message)


@_agree_op.register_fake
def _(head, group, fields, message):
    return head.new_empty((), dtype=torch.int64)


@torch.library.custom_op("ckpt_ext::sp_agree_gather", mutates_args=())
def _agree_gather_op(head: Tensor, tokens: Tensor, group: str, fields: str,
                     message: str) -> Tensor:
    """The agreement, then ``tokens`` (B, S/N) of every rank gathered to (B, S)."""
    _verdict(head, group, fields, message)
    return _gather_tokens(tokens, group)


@_agree_gather_op.register_fake
def _(head, tokens, group, fields, message):
    return tokens.new_empty((tokens.shape[0], _rank_size(group)[1] * tokens.shape[1]))


if hasattr(torch.library, "_register_effectful_op"):  # torch >= 2.10
    for _op in ("ckpt_ext::sp_agree", "ckpt_ext::sp_agree_gather"):
        torch.library._register_effectful_op(_op, torch.library.EffectType.ORDERED)


def _head(error, fields: Mapping[str, tuple], value) -> tuple:
    """(record head, fields as text, message) for the ops above; ``value`` an int or a 0-dim
    integer tensor (traced under torch.compile)."""
    kind = 0 if error is None else next(
        (i for i, k in enumerate(_KINDS) if k is not None and isinstance(error, k)), 4)
    values = [int(v) for vs in fields.values() for v in vs]
    if isinstance(value, Tensor):
        head = torch.cat([torch.tensor([kind], dtype=torch.int64),
                          value.reshape(1).to(torch.int64),
                          torch.tensor(values, dtype=torch.int64)])
    else:
        head = torch.tensor([kind, int(value)] + values, dtype=torch.int64)
    spec = "\n".join(f"{len(vs)}\t{what}" for what, vs in fields.items())
    return head, spec, "" if error is None else str(error)


def agree(name: str, error: Optional[BaseException] = None,
          fields: Optional[Mapping[str, tuple]] = None, value: int = 0) -> int:
    """Every rank of group ``name`` at the same refusal point: one all-gather of this rank's
    ``error`` (None: it found none), its ``fields`` (what must match over the group: the same
    names and counts on every rank) and ``value``. Raises on every rank the first refusing
    rank's error (its type, its message, the rank named), or, when none refused, a ValueError
    naming the first field that differs and each rank's values. Returns rank 0's ``value``."""
    head, spec, message = _head(error, dict(fields or {}), value)
    return int(torch.ops.ckpt_ext.sp_agree(head, name, spec, message))


def refuse(name: str, error: BaseException):
    """Raise ``error`` on every rank of group ``name`` (the others, at their next refusal
    point, raise it too)."""
    agree(name, error)
    raise error  # not reached: agree raised


def _shape(t, dims: int = 4) -> tuple:
    """A fixed-length record of an optional tensor: (present, its dims, its sizes padded)."""
    if not isinstance(t, Tensor):
        return (0 if t is None else -1,) + (0,) * (dims + 1)
    sizes = tuple(t.shape)[:dims]
    return (1, t.dim()) + sizes + (0,) * (dims - len(sizes))


def masks(name: str, attention_mask, position_ids) -> BatchMasks:
    """The masks of a forward under sequence_parallel (group ``name``): as ``describe`` would
    give for the whole batch, this rank's share. position_ids are required (the global
    positions of the rank's tokens: without them HF numbers each rank's tokens from 0).
    torch's context_parallel active as well is refused (it would split the sequence twice).
    Every rank's verdict is agreed first (``agree``)."""
    from .sequence_split import _context_parallel_sdpa
    error = None
    if _context_parallel_sdpa():
        error = RuntimeError(
            "ckpt_ext.patch_llama: the model was patched with sequence_parallel= (Ulysses "
            "inside the fused layers) and torch's context_parallel is active as well; use "
            "one of them: sequence_parallel= with the batch cut by "
            "ckpt_ext.hf.sequence_parallel.shard_batch, outside context_parallel")
    elif not isinstance(position_ids, Tensor) or position_ids.dim() != 2:
        error = ValueError("patch_llama(sequence_parallel=...): the model needs position_ids "
                           "(B, S/N), the global positions of this rank's tokens "
                           "(ckpt_ext.hf.sequence_parallel.shard_batch gives them); got "
                           f"{None if position_ids is None else tuple(position_ids.shape)}")
    fields = {
        "attention_mask of the same shape (present, dims, sizes)": _shape(attention_mask),
        "position_ids of the same shape and dtype (present, dims, sizes, dtype code)":
            _shape(position_ids) + (_dtype_code(position_ids),)}
    padding = isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
    if error is not None or (attention_mask is not None and not padding):
        agree(name, error, fields)  # raises, or a custom mask (not gathered)
        if error is None:
            return describe(attention_mask, None, compiling=False)
    # one all-gather: the 2-D padding mask, or without one the position_ids (packed documents)
    head, spec, _ = _head(None, fields, 0)
    whole = torch.ops.ckpt_ext.sp_agree_gather(
        head, attention_mask.to(torch.int32) if padding else position_ids, name, spec, "")
    compiling = torch.compiler.is_compiling()
    s = position_ids.shape[1]
    rank = _rank_size(name)[0]
    if padding:
        kpm = describe(whole, None, compiling).key_padding_mask
        return BatchMasks(key_padding_mask=None if kpm is None else
                          kpm[:, rank * s:(rank + 1) * s].contiguous())
    seg = packed_segment_ids(whole, compiling)
    return BatchMasks(segment_ids=None if seg is None else
                      seg[:, rank * s:(rank + 1) * s].contiguous())


def same_seed(seed: Optional[Tensor], name: str, error: Optional[BaseException] = None,
              router: bool = False) -> Optional[Tensor]:
    """A decoder layer's refusal point (``agree``; every layer call of every rank comes here,
    or to ``refuse``), ``error`` this rank's refusal of the call (None: none): the LoRA
    dropout seed of the group's first rank, on every rank (a tensor all along, so that a
    compiled model traces it). ``router``: whether the call returns its router statistics or
    logits (the model's ``output_router_logits``), which must agree over the group: a rank
    that sums its statistics over the group waits for the others to do the same."""
    head, spec, message = _head(error, {
        "LoRA dropout (a seed drawn or not)": (seed is not None,),
        "output_router_logits alike (the MoE layer's router statistics asked or not)": (router,)},
        0 if seed is None else seed)
    first = torch.ops.ckpt_ext.sp_agree(head, name, spec, message)
    return None if seed is None else first.to(seed.dtype)


def group_size(name: str) -> int:
    """The number of ranks of group ``name``."""
    return _rank_size(name)[1]


def sum_over_group(t: Tensor, name: str) -> Tensor:
    """``t`` summed over the ranks of group ``name``, differentiably (the backward sums the
    ranks' gradients: each rank's ``t`` gets the gradient of every rank's use of the sum)."""
    from torch.distributed.nn.functional import all_reduce
    return all_reduce(t, group=_group(name))


def shard_batch(batch: Mapping, group, *, ignore_index: int = -100,
                pad_token_id: Optional[int] = None) -> dict:
    """This rank's share of a global causal-LM ``batch`` (every rank of ``group`` passes the
    same one): ``input_ids`` (B, S) (or ``inputs_embeds`` (B, S, H)), optional
    ``attention_mask``, ``position_ids`` (default: 0 .. S-1) and ``labels``. Returns the
    model's keyword arguments: each cut to positions ``rank*S/N .. (rank+1)*S/N - 1``, the
    labels shifted over the whole sequence first (``shift_labels``, also passed as ``labels``),
    and ``num_items_in_batch``, the labelled tokens of the whole batch (so that each rank's
    loss is its share of the batch's mean). S must be a multiple of N, or give
    ``pad_token_id``: the batch is then padded on the right (attention_mask 0, labels
    ignore_index)."""
    group_name(group)
    dist = _dist()
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    key = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    x = batch.get(key)
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError("shard_batch: the batch needs input_ids (B, S) or inputs_embeds "
                         "(B, S, H)")
    b, s = x.shape[:2]
    out = {k: v for k, v in batch.items()
           if k not in (key, "attention_mask", "position_ids", "labels", "shift_labels")}
    mask = batch.get("attention_mask")
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=x.device).expand(b, s)
    labels = batch.get("labels")
    shift = batch.get("shift_labels")
    if shift is None and labels is not None:
        shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    pad = (-s) % n
    if pad:
        if pad_token_id is None:
            raise ValueError(f"shard_batch: the sequence length {s} of {key} is not divisible "
                             f"by the sequence_parallel group's size {n}; pad the batch to a "
                             f"multiple of {n}, or pass pad_token_id to pad it on the right")
        x = F.pad(x, (0, 0, 0, pad) if key == "inputs_embeds" else (0, pad),
                  value=0 if key == "inputs_embeds" else pad_token_id)
        mask = F.pad(mask if mask is not None else torch.ones(b, s, dtype=torch.long,
                                                             device=x.device), (0, pad))
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], 1)
        if shift is not None:
            shift = F.pad(shift, (0, pad), value=ignore_index)
        s += pad
    share = slice(rank * (s // n), (rank + 1) * (s // n))
    out[key] = x[:, share].contiguous()
    out["position_ids"] = pos[:, share].contiguous()
    if mask is not None:
        out["attention_mask"] = mask[:, share].contiguous()
    if shift is not None:
        out["shift_labels"] = shift[:, share].contiguous()
        out["labels"] = out["shift_labels"]
        out["num_items_in_batch"] = (shift != ignore_index).sum()
    return out


def all_reduce_grads(model: torch.nn.Module, group) -> None:
    """Sum every parameter gradient of ``model`` over ``group`` (after backward): each rank's
    gradients are its tokens' share. Under FSDP2 over the data-parallel ranks only (``fully_shard``
    over a mesh's "dp" dimension; every rank of ``group`` holds the same shards) the local
    shards are summed. Not for a wrapper that already reduces over ``group`` (DDP or FSDP2 over
    every rank, HSDP over a (dp, sp) mesh: multiply the loss by N instead): a gradient sharded
    over a mesh that holds other ranks of ``group`` raises ValueError (on every rank alike)."""
    dist = _dist()
    members = set(dist.get_process_group_ranks(group))
    me = dist.get_rank()
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        mesh = getattr(g, "device_mesh", None)
        if mesh is not None:  # a DTensor (FSDP2): its mesh must not reduce over the group
            shared = sorted(members & set(mesh.mesh.flatten().tolist()) - {me})
            if shared:
                raise ValueError(
                    f"all_reduce_grads: the gradient of {n} is a DTensor over a device mesh "
                    f"that holds ranks {shared} of the sequence_parallel group as well "
                    f"(FSDP2 over every rank, or HSDP over a (dp, sp) mesh), so the wrapper "
                    f"already reduced it over the group: do not call all_reduce_grads; multiply "
                    f"the loss by the group's size {len(members)} instead (or call "
                    f"set_gradient_divide_factor(dp size) on every FSDP module)")
            with torch.no_grad():
                g = g.to_local()  # the shard itself, reduced in place
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)


def check_patch(group, presets) -> str:
    """patch_llama's ``sequence_parallel``: "" for None, else the group's name; every layer must
    run the fused op (HF's forward would attend over the rank's tokens only: PatchRefused)."""
    if group is None:
        return ""
    name = group_name(group)
    from ..presets import FUSED_PRESETS
    unfused = [i for i, p in enumerate(presets) if p not in FUSED_PRESETS and p != "auto"]
    if unfused:
        raise PatchRefused(f"patch_llama: sequence_parallel needs every decoder layer fused; "
                         f"layers {unfused} have policy {presets[unfused[0]]!r} (HF's forward "
                         "would attend over this rank's tokens only)")
    return name
