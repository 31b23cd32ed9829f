"""Drop-in ``nn.Module`` replacements for LLaMA-style blocks (HF parameter names)."""
from .layers import Attention, DecoderLayer, LayerConfig, RMSNorm, SwiGLUMLP

__all__ = ["Attention", "DecoderLayer", "LayerConfig", "RMSNorm", "SwiGLUMLP"]
