"""Drop-in modules for LLaMA-style layers, with Hugging Face parameter names.

An HF ``LlamaDecoderLayer`` state_dict loads strictly into ``DecoderLayer`` (and Qwen2's, with
``attention_bias=True, o_bias=False``; Qwen3's with ``qk_norm=True``). ``policy`` selects the
preset, what is saved for backward (see ``ckpt_ext.presets``):

* ``none``: plain PyTorch (SDPA attention), nothing recomputed;
* ``torch``: the plain layer under ``torch.utils.checkpoint(use_reentrant=False)``;
* ``fast`` / ``balanced`` / ``min_memory``: the fused path, one C++ autograd Function per
  layer (``torch.ops.ckpt_ext.decoder_layer``) over the kernel ops.

Shapes: hidden_states (B, S, H); position_embeddings = (cos, sin), each (1 or B, S, head_dim)
as HF's rotary embedding returns them; key_padding_mask bool (B, S), True = real token.
Attention is causal.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import offload as _offload
from .. import ops, plain
from .._checks import _check_activation, _check_bool, _check_eps
from ..blocks import decoder_layer
from ..layer_record import LayerDims, LayerRecord
from ..presets import FUSED_PRESETS, check_policy

__all__ = ["LayerConfig", "RMSNorm", "SwiGLUMLP", "Attention", "DecoderLayer"]

PositionEmbeddings = Tuple[Tensor, Tensor]


@dataclass(frozen=True)
class LayerConfig:
    """Everything that shapes one decoder layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: Optional[int] = None        # default hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False          # biases on q/k/v (and o_proj unless o_bias says)
    o_bias: Optional[bool] = None         # o_proj bias; None = attention_bias (Qwen2: False)
    mlp_bias: bool = False
    qk_norm: bool = False                 # Qwen3's per-head RMSNorm on q and k

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                     "head_dim"):
            value = getattr(self, name)
            if value is None and name == "head_dim":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("attention_bias", "mlp_bias", "qk_norm", "o_bias"):
            _check_bool("LayerConfig", name, getattr(self, name), allow_none=name == "o_bias")
        _check_eps("LayerConfig", "rms_norm_eps", self.rms_norm_eps)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, got "
                             f"{self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads="
                             f"{self.num_heads}; pass head_dim")
        if self.dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.dim}")

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def dims(self) -> LayerDims:
        """The layer's shape as the planner and the offloader read it."""
        return LayerDims(self.hidden_size, self.num_heads, self.num_kv_heads, self.dim,
                         self.intermediate_size)


# ---- plain PyTorch math (presets "none" / "torch") -----------------------------------------

def _attention_plain(q: Tensor, k: Tensor, v: Tensor, scale: float,
                     key_padding_mask: Optional[Tensor]) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    allowed = key_padding_mask[:, None, None, :] & causal
    # A row with nothing to attend would be NaN in SDPA: let it attend anywhere, then zero it.
    empty = ~allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty, scale=scale,
                                         enable_gqa=gqa)
    return out.masked_fill(empty, 0.0)


def _check_position_embeddings(position_embeddings) -> PositionEmbeddings:
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2
            and all(isinstance(t, Tensor) for t in position_embeddings)):
        raise TypeError("position_embeddings must be a pair of tensors (cos, sin), each "
                        "(1 or B, S, head_dim), as HF's rotary embedding returns them; got "
                        f"{type(position_embeddings).__name__}"
                        + (f" of length {len(position_embeddings)}"
                           if isinstance(position_embeddings, (tuple, list)) else ""))
    return position_embeddings


# ---- modules -------------------------------------------------------------------------------

class _WithPolicy(nn.Module):
    """A module with a ``policy`` (``ckpt_ext.presets``), validated where it is set, once:
    setting it on a module sets it on every module inside that has one (a DecoderLayer's
    attention, MLP and norms), unchecked. Constructors set it last, after their children."""

    @property
    def policy(self) -> str:
        return self._policy

    @policy.setter
    def policy(self, value: str) -> None:
        value = check_policy(value)
        for m in self.modules():
            if isinstance(m, _WithPolicy):
                m.__dict__["_policy"] = value


class RMSNorm(_WithPolicy):
    """HF ``LlamaRMSNorm``: ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, policy: str = "balanced"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.policy = policy

    def forward(self, x: Tensor) -> Tensor:
        if self.policy in FUSED_PRESETS:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        return plain.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, policy={self.policy!r}"


class SwiGLUMLP(_WithPolicy):
    """HF ``LlamaMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; x (..., H).
    ``activation="gelu_tanh"``: Gemma's GeGLU, ``gelu(approximate="tanh")`` in place of silu."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 policy: str = "balanced", activation: str = "silu"):
        super().__init__()
        _check_activation("SwiGLUMLP", activation)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.policy = policy
        self.activation = activation

    def _plain(self, x: Tensor) -> Tensor:
        g = self.gate_proj(x)
        act = F.silu(g) if self.activation == "silu" else F.gelu(g, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))

    def forward(self, x: Tensor) -> Tensor:
        if self.policy == "none":
            return self._plain(x)
        if self.policy == "torch":
            return torch_checkpoint(self._plain, x, use_reentrant=False)
        return ops.swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight,
                              self.down_proj.weight, self.gate_proj.bias, self.up_proj.bias,
                              self.down_proj.bias,
                              save="gate_up" if self.policy == "fast" else "input",
                              activation=self.activation)


class Attention(_WithPolicy):
    """HF ``LlamaAttention`` (causal, GQA, RoPE; optional q/k/v/o biases and Qwen3 q/k norms).

    forward(hidden_states (B, S, H) already normed, position_embeddings, key_padding_mask)
    -> (B, S, H). Fused presets run ``ckpt_ext.ops`` (attention saves q, k, v, out, lse).
    """

    def __init__(self, config: LayerConfig, policy: str = "balanced"):
        super().__init__()
        c, d = config, config.dim
        o_bias = c.attention_bias if c.o_bias is None else c.o_bias
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, d
        self.scaling = d ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden_size, bias=o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(d, c.rms_norm_eps)
            self.k_norm = RMSNorm(d, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.policy = policy

    def _heads(self, x: Tensor, proj: nn.Linear, heads: int, norm: Optional[RMSNorm]) -> Tensor:
        t = proj(x).view(*x.shape[:-1], heads, self.head_dim)
        return (t if norm is None else norm(t)).transpose(1, 2)

    def _attend(self, x: Tensor, position_embeddings: PositionEmbeddings,
                key_padding_mask: Optional[Tensor]) -> Tensor:
        b, s, _ = x.shape
        q = self._heads(x, self.q_proj, self.num_heads, self.q_norm)
        k = self._heads(x, self.k_proj, self.num_kv_heads, self.k_norm)
        v = self._heads(x, self.v_proj, self.num_kv_heads, None)
        cos, sin = position_embeddings
        if self.policy in FUSED_PRESETS:
            q, k = ops.rope(q, k, cos, sin)
            out = ops.attention(q, k, v, causal=True, scale=self.scaling,
                                key_padding_mask=key_padding_mask)
        else:
            q, k = plain.rope(q, k, cos, sin)
            out = _attention_plain(q, k, v, self.scaling, key_padding_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, hidden_states: Tensor, position_embeddings: PositionEmbeddings,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        if self.policy == "torch":
            return torch_checkpoint(self._attend, hidden_states, position_embeddings,
                                    key_padding_mask, use_reentrant=False)
        return self._attend(hidden_states, position_embeddings, key_padding_mask)


class DecoderLayer(_WithPolicy):
    """HF ``LlamaDecoderLayer``: ``h = x + attn(norm(x)); y = h + mlp(norm(h))``.

    forward(hidden_states (B, S, H), position_embeddings (cos, sin), key_padding_mask=None)
    -> (B, S, H). With a fused preset the whole layer is one C++ autograd Function that saves
    what the preset says (``ckpt_ext.presets``). ``offload="cpu"`` keeps what it saves in host
    memory until backward (``ckpt_ext.offload``; ``offload_limit``: a host byte cap, which gives
    the layer an offloader of its own; or pass a shared ``ckpt_ext.offload.Offloader``).
    ``activation``: the MLP's, "silu" or "gelu_tanh" (Gemma's GeGLU; see ``SwiGLUMLP``).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, *, head_dim: Optional[int] = None,
                 rms_norm_eps: float = 1e-6, attention_bias: bool = False,
                 mlp_bias: bool = False, o_bias: Optional[bool] = None, qk_norm: bool = False,
                 activation: str = "silu", policy: str = "balanced", offload=None,
                 offload_limit=None):
        super().__init__()
        # offload="cpu": the fused layer's saved tensors go to host memory (ckpt_ext.offload);
        # layers built without a cap share one process-wide offloader, so each prefetches the
        # layer called before it.
        self.offloader = _offload.resolve(offload, offload_limit, shared=True)
        self.config = c = LayerConfig(hidden_size, num_heads, num_kv_heads, intermediate_size,
                                      head_dim, rms_norm_eps, attention_bias, o_bias, mlp_bias,
                                      qk_norm)
        self.self_attn = Attention(c)
        self.mlp = SwiGLUMLP(hidden_size, intermediate_size, mlp_bias, activation=activation)
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.policy = policy

    def _plain(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor]) -> Tensor:
        h = x + self.self_attn._attend(self.input_layernorm(x), (cos, sin), mask)
        return h + self.mlp._plain(self.post_attention_layernorm(h))

    @property
    def record(self) -> LayerRecord:
        """The layer as the op and the planner read it (``ckpt_ext.layer_record``)."""
        a = self.self_attn
        norms = ("input_layernorm", "post_attention_layernorm") + (
            ("self_attn.q_norm", "self_attn.k_norm") if self.config.qk_norm else ())
        return LayerRecord(self.config.dims, norms={n: n for n in norms}, fields=dict(
            num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
            eps=self.input_layernorm.variance_epsilon, scale=a.scaling,
            activation=self.mlp.activation))

    def _fused(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor]) -> Tensor:
        options = self.record.options(weights=dict(self.named_parameters()), cos=cos, sin=sin,
                                      key_padding_mask=mask, preset=self.policy)
        return _offload.offloaded(self.offloader, decoder_layer, x,
                                  [*options.weights, cos, sin, mask], options)

    def forward(self, hidden_states: Tensor, position_embeddings: PositionEmbeddings,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        cos, sin = _check_position_embeddings(position_embeddings)
        if self.offloader is not None and self.policy not in FUSED_PRESETS and \
                torch.is_grad_enabled():
            raise NotImplementedError(
                f"DecoderLayer: offload='cpu' moves what a fused layer saves; policy "
                f"{self.policy!r} is not fused. Use policy 'min_memory' (or 'balanced'/'fast') "
                "with offload, or offload=None")
        if self.policy == "none":
            return self._plain(hidden_states, cos, sin, key_padding_mask)
        if self.policy == "torch":
            return torch_checkpoint(self._plain, hidden_states, cos, sin, key_padding_mask,
                                    use_reentrant=False)
        return self._fused(hidden_states, cos, sin, key_padding_mask)
