"""Llama-family decoder: Llama 2/3.x (``llama3`` RoPE scaling, 128k vocabularies, untied
heads), SmolLM2, Mistral (sliding-window attention where the config sets it) and
Qwen2/2.5 (Q/K/V biases; sliding-window fields, off by default).

Their block is the shared one (``decoder.CausalLM``) with nothing added: pre-norm
RMSNorm, fused QKV (+bias), rotate-half RoPE, paged attention, SiLU-gated MLP. The
names below stay importable from here for the code and tests that predate the
registry.
"""

from __future__ import annotations

from aioengine.models.decoder import CausalLM, DecoderArch, weight_format, weight_nbytes
from aioengine.models.layers.attention import AttentionMetadata
from aioengine.models.layers.norm import rms_norm
from aioengine.models.layers.rotary import RotaryEmbedding
from aioengine.models.registry import SUPPORTED_MODEL_TYPES

#: The shape of any supported model (``decoder.DecoderArch``); the old name.
LlamaArch = DecoderArch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AttentionMetadata",
    "LlamaArch",
    "LlamaForCausalLM",
    "RotaryEmbedding",
    "rms_norm",
    "weight_format",
    "weight_nbytes",
]


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 (see the module docstring and ``decoder.CausalLM``)."""
