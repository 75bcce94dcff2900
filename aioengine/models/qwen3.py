"""Qwen3 (dense): the Llama block with per-head RMSNorm on Q and K (``q_norm``,
``k_norm``, over ``head_dim``) before RoPE, no Q/K/V bias, and a ``head_dim`` of its own
(``num_heads * head_dim`` need not equal ``hidden_size``). The Q/K norms are the
shared attention's ``qk_norm`` (``decoder.CausalLM.attention``) and the fused C++ decode
step's ``q_norm``/``k_norm`` layer weights; this class exists so the registry names one
class per family."""

from __future__ import annotations

from aioengine.models.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 (``model_type`` ``qwen3``, GGUF ``qwen3``)."""
