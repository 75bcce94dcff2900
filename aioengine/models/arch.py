"""A model's shape from its HF config, and the tensor-parallel checks on it.

Torch-free and free of model code: the engine process imports this module to
refuse a ``tensor_parallel_size`` the model cannot be split over before any
worker starts (the forward passes live in the worker: ``aioengine.models.decoder``
and the family modules that ``registry`` names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioengine.config import EngineConfig
from aioengine.models import registry

__all__ = ["ModelShapes", "check_parallel_config", "check_tensor_parallel_size"]


@dataclass(frozen=True)
class ModelShapes:
    """The shapes of a decoder-only transformer, as its HF ``config.json`` names them:
    what the engine process needs to check a parallel layout. The worker's
    ``aioengine.models.decoder.ModelArch`` reads the whole architecture (RoPE
    tables, per-family twists) and needs torch.

    Every family of ``registry`` splits the same way under tensor parallelism (heads,
    MLP rows, vocabulary): Qwen3's and Gemma 3's per-head Q/K norms and Gemma's extra
    norms are replicated, Phi-3's fused ``qkv_proj``/``gate_up_proj`` are split into
    their parts before sharding, and ``head_dim`` may differ from ``hidden_size //
    num_heads`` (Qwen3, Gemma), so the checks below are on head counts only.

    Attributes:
        family: ``registry.ModelFamily.name`` (``"gemma3"``).
        num_heads: query heads (``num_attention_heads``).
        num_kv_heads: key/value heads (``num_key_value_heads``; = ``num_heads``
            without grouped-query attention).
        head_dim: per-head width (``head_dim``, else ``hidden_size // num_heads``).
    """

    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShapes:
        """Read the shapes from a ``PretrainedConfig`` or anything with its fields.

        Raises:
            registry.UnsupportedModelError: (a ValueError) no model family implements
                the config's architecture; the message names every supported one.
            ValueError: ``num_attention_heads`` is not a multiple of
                ``num_key_value_heads``.
        """
        family = registry.family_of_config(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        return cls(
            model_type=getattr(config, "model_type", ""),
            family=family.name,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def check_tensor_parallel_size(
    tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int
) -> None:
    """Refuse a ``tp_size`` the heads or the MLP cannot be split over evenly
    (Megatron-LM column/row split: Shoeybi et al. 2019, §3).

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``tp_size``; or
            ``num_kv_heads >= tp_size`` and not a multiple of it; or
            ``num_kv_heads < tp_size`` and ``tp_size`` not a multiple of
            ``num_kv_heads``; or ``intermediate_size`` not a multiple of it.
            The message names the numbers.
    """
    if tp_size == 1:
        return
    if num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's "
            f"{num_heads} attention heads"
        )
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's {num_kv_heads} KV heads"
        )
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} is not a multiple of the model's "
            f"{num_kv_heads} KV heads (needed to replicate KV heads evenly)"
        )
    if intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's "
            f"intermediate_size {intermediate_size}"
        )


def check_parallel_config(config: EngineConfig) -> None:
    """Refuse, in the engine process and before any worker starts, a
    ``tensor_parallel_size`` the model's heads cannot be split over.

    Raises:
        ValueError: see ``check_tensor_parallel_size`` (the message names the numbers).
    """
    tp_size = config.parallel.tensor_parallel_size
    if tp_size == 1:
        return
    from aioengine.models.loader import load_hf_config  # metadata only, no torch

    arch = ModelShapes.from_hf_config(load_hf_config(config.model.model_path))
    check_tensor_parallel_size(tp_size, arch.num_heads, arch.num_kv_heads, arch.intermediate_size)
