"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama block with Q/K/V and gate/up stored fused
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``, gate rows first), ``longrope`` (``su``)
RoPE scaling (``layers.rotary``) and partial rotary where ``partial_rotary_factor`` is
set (Phi-4-mini: 3/4 of each head). A sliding window, where the config sets one
(Phi-3-mini: 2047), applies to every layer."""

from __future__ import annotations

from typing import Any

import torch

from aioengine.models.decoder import CausalLM, DecoderArch
from triton_kernels.quant import QuantizedWeight


def split_rows(w: torch.Tensor | QuantizedWeight, sizes: list[int]
               ) -> list[torch.Tensor | QuantizedWeight]:
    """Consecutive row blocks of ``sizes`` rows (views; quantized rows stay quantized)."""
    if sum(sizes) != w.shape[0]:
        raise ValueError(f"a fused weight of {w.shape[0]} rows does not split into {sizes}")
    parts, start = [], 0
    for n in sizes:
        parts.append(w.slice_rows(start, start + n) if isinstance(w, QuantizedWeight)
                     else w[start:start + n])
        start += n
    return parts


class Phi3ForCausalLM(CausalLM):
    """Phi-3 family (``model_type`` ``phi3``, GGUF ``phi3``)."""

    def prepare_weights(self, weights: dict[str, Any], arch: DecoderArch) -> None:
        """Split the fused projections into Llama's names, so that tensor parallelism
        shards them like every other family's and the model re-fuses them."""
        # A GGUF file's LongRoPE factors are in the config already (gguf_loader).
        weights.pop("rope_factors_long", None)
        weights.pop("rope_factors_short", None)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            for fused, names, sizes in (
                    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                            "self_attn.v_proj"), [q, kv, kv]),
                    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"),
                     [arch.intermediate_size] * 2)):
                for kind in ("weight", "bias"):
                    w = weights.pop(f"{p}{fused}.{kind}", None)
                    if w is not None:
                        for name, part in zip(names, split_rows(w, sizes)):
                            weights[f"{p}{name}.{kind}"] = part
