"""Gemma 2 and Gemma 3 (text), from the Gemma papers (Gemma Team 2024, "Gemma 2", §2;
2025, "Gemma 3", §2) and HF transformers' ``modeling_gemma2/3``.

Their block differs from Llama's in every part, each a layer module or an
``DecoderArch`` field the shared decoder reads:

- RMSNorm with ``(1 + weight)`` (the offset added at load), embeddings scaled by
  ``sqrt(hidden_size)`` (in the compute dtype, as HF rounds it);
- four norms per block: before and after attention, before and after the MLP;
- GeGLU MLP (``gelu_pytorch_tanh``, ``layers.activation.gelu_tanh_and_mul``);
- softmax scale ``query_pre_attn_scalar ** -0.5``;
- Gemma 2: attention-logit soft-capping and final-logit soft-capping
  (``cap * tanh(x / cap)``); local sliding-window and global layers alternating;
- Gemma 3: per-head Q/K RMSNorm (``1 + weight`` too), five local layers per global
  one (``layer_types``), with their own RoPE base (``rope_parameters`` per layer type).

A GGUF file stores every norm already as ``1 + weight`` (llama.cpp's converter adds
it); ``gguf_loader`` takes it off again so the weights arrive in HF terms.
"""

from __future__ import annotations

from aioengine.models.decoder import CausalLM


class GemmaForCausalLM(CausalLM):
    """Gemma 2 (``gemma2``) and Gemma 3 text (``gemma3_text``; GGUF ``gemma2``, ``gemma3``)."""
