"""Rotary position embeddings (Su et al. 2021, RoFormer §3.4) and their scaled variants.

``rope_parameters`` reads a layer type's RoPE settings from an HF config in either
form transformers accepts (``rope_parameters``, per layer type for Gemma 3, or the
older ``rope_theta`` / ``rope_scaling``). ``rotary_embedding`` builds the cos/sin
tables: the default schedule here; ``llama3``, ``linear``, ``dynamic``, ``yarn`` and
``longrope`` (Phi-3's ``su``) from transformers' ``ROPE_INIT_FUNCTIONS``. LongRoPE
(Ding et al. 2024) uses its short factors for positions below
``original_max_position_embeddings`` and its long factors from there on, per position
(as vLLM does); HF switches the whole sequence to the long factors once it is longer,
so the two agree on every sequence shorter than the original context.
"""

from __future__ import annotations

from typing import Any

import torch

_LEGACY_TYPES = {"su": "longrope"}


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...}`` for ``layer_type`` (``"full_attention"`` /
    ``"sliding_attention"``; per-type dicts are Gemma 3's), with
    ``partial_rotary_factor`` filled in from the config where it sits outside."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif params and not any(isinstance(v, dict) for v in params.values()):
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = _LEGACY_TYPES.get(kind, kind)
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is not None:
        params.setdefault("partial_rotary_factor", factor)
    return params


def rotary_dim(config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """Leading head dimensions RoPE rotates (``head_dim * partial_rotary_factor``)."""
    return int(head_dim * rope_parameters(config, layer_type).get("partial_rotary_factor", 1.0))


def _hf_config(config: Any):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    return AutoConfig.for_model(**vars(config))  # a GGUF file's config (loader.load_hf_config)


def inv_freq_schedules(config: Any, head_dim: int, layer_type: str | None
                       ) -> tuple[torch.Tensor, float, tuple[torch.Tensor, float, int] | None]:
    """``(inv_freq [rotary_dim / 2] fp32, attention_scaling, long)`` where ``long`` is
    LongRoPE's ``(inv_freq, scaling, original_max_position_embeddings)`` or None.

    Raises:
        ValueError: a ``rope_type`` transformers does not define.
    """
    params = rope_parameters(config, layer_type)
    kind = params["rope_type"]
    dim = rotary_dim(config, head_dim, layer_type)
    if kind == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0, None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {kind!r}; supported: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}")
    hf = _hf_config(config)
    per_type = isinstance((getattr(hf, "rope_parameters", None) or {}).get(layer_type), dict)
    lt = layer_type if per_type else None
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", layer_type=lt)
    long = None
    if kind == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            hf, "original_max_position_embeddings", None)
        if original:
            long_freq, long_scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=original + 1,
                                                                layer_type=lt)
            long = (long_freq.float(), float(long_scaling), int(original))
    return inv_freq.float(), float(scaling), long


class RotaryEmbedding:
    """cos/sin tables ``[max_position, rotary_dim]`` and their application.

    ``apply`` rotates the first ``rotary_dim`` dimensions of each head of
    ``[num_tokens, heads, head_dim]`` by rotate-half (GPT-NeoX layout, the one HF uses
    after un-permuting GGUF Q/K weights): ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``;
    the rest of the head passes through (partial rotary, Phi-4-mini). The tables hold
    ``[cos, cos]`` and ``[-sin, sin]`` so that is ``x * cos + roll(x) * sin``: three ops
    instead of eight, and bit-identical (negation is exact).

    Args:
        inv_freq: ``[rotary_dim / 2]`` fp32.
        max_position: table rows (positions).
        scaling: multiplies cos and sin (YaRN/LongRoPE attention factor).
        long: LongRoPE's ``(inv_freq, scaling, original_max)``: rows from
            ``original_max`` on use it.
    """

    def __init__(self, inv_freq: torch.Tensor, max_position: int, scaling: float,
                 dtype: torch.dtype, long: tuple[torch.Tensor, float, int] | None = None) -> None:
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        if long is not None and long[2] < max_position:
            long_freqs = torch.outer(t[long[2]:], long[0])
            cos[long[2]:] = long_freqs.cos() * long[1]
            sin[long[2]:] = long_freqs.sin() * long[1]
        self.half = inv_freq.shape[0]
        self.rotary_dim = 2 * self.half
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype)
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, heads, head_dim]``; ``cos``/``sin``: rows of the tables
        for the tokens' positions, ``[num_tokens, 1, rotary_dim]``."""
        if self.rotary_dim == x.shape[-1]:
            return x * cos + torch.roll(x, self.half, dims=-1) * sin
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + torch.roll(rot, self.half, dims=-1) * sin, rest), dim=-1)


def rotary_embedding(config: Any, head_dim: int, layer_type: str | None, max_position: int,
                     dtype: torch.dtype, freq_factors: torch.Tensor | None = None
                     ) -> RotaryEmbedding:
    """The ``RotaryEmbedding`` of ``layer_type``'s RoPE settings.

    Args:
        freq_factors: a GGUF file's ``rope_freqs`` (llama3 RoPE), ``[rotary_dim / 2]``:
            divides the frequencies, as llama.cpp's ``ggml_rope_ext`` does.
    """
    inv_freq, scaling, long = inv_freq_schedules(config, head_dim, layer_type)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float().reshape(inv_freq.shape)
    return RotaryEmbedding(inv_freq, max(max_position, 1), scaling, dtype, long)
