"""Which model code runs which checkpoint: HF ``architectures`` / ``model_type`` and GGUF
``general.architecture`` -> a model family and its class.

Imports no torch (the engine process checks a model before it starts a worker); the
model class is imported only by ``model_class``. Each family names the twists of the
Llama block it needs (read by ``decoder.DecoderArch``); the twists' code lives in the
layer modules (``layers/``) and the family's module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture no model family implements; the message is one
    line naming it and every supported one."""


@dataclass(frozen=True)
class ModelFamily:
    """One family of checkpoints that share a model class.

    Attributes:
        name: our name (``"gemma3"``).
        title: how people call it, for messages (``"Gemma 3"``).
        model_types: HF ``config.model_type`` values.
        architectures: HF ``config.architectures`` values.
        gguf_architectures: llama.cpp ``general.architecture`` values.
        model: ``"module:Class"`` under ``aioengine.models``.
        qk_norm: per-head RMSNorm on Q and K before RoPE (Qwen3, Gemma 3).
        gemma_norms: Gemma's block: ``(1 + weight)`` RMSNorms, embeddings scaled by
            ``sqrt(hidden_size)``, norms before and after attention and MLP.
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    model: str
    qk_norm: bool = False
    gemma_norms: bool = False


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", "Llama 2/3.x, SmolLM", ("llama",), ("LlamaForCausalLM",), ("llama",),
                "llama:LlamaForCausalLM"),
    # llama.cpp writes Mistral 7B files as ``llama``.
    ModelFamily("mistral", "Mistral", ("mistral",), ("MistralForCausalLM",), (),
                "llama:LlamaForCausalLM"),
    ModelFamily("qwen2", "Qwen2/2.5", ("qwen2",), ("Qwen2ForCausalLM",), ("qwen2",),
                "llama:LlamaForCausalLM"),
    ModelFamily("qwen3", "Qwen3", ("qwen3",), ("Qwen3ForCausalLM",), ("qwen3",),
                "qwen3:Qwen3ForCausalLM", qk_norm=True),
    ModelFamily("gemma2", "Gemma 2", ("gemma2",), ("Gemma2ForCausalLM",), ("gemma2",),
                "gemma:GemmaForCausalLM", gemma_norms=True),
    ModelFamily("gemma3", "Gemma 3 (text)", ("gemma3_text",), ("Gemma3ForCausalLM",),
                ("gemma3",), "gemma:GemmaForCausalLM", qk_norm=True, gemma_norms=True),
    ModelFamily("phi3", "Phi-3/3.5/4-mini", ("phi3",), ("Phi3ForCausalLM",), ("phi3",),
                "phi3:Phi3ForCausalLM"),
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(
    a for f in FAMILIES for a in f.gguf_architectures)


def supported_summary() -> str:
    """``Llama 2/3.x, SmolLM (llama), Mistral (mistral), ...`` for messages."""
    return ", ".join(f"{f.title} ({'/'.join(f.model_types)})" for f in FAMILIES)


def family_of_config(config: Any) -> ModelFamily:
    """The family of an HF config (``PretrainedConfig``, or the namespace
    ``loader.load_hf_config`` builds from a GGUF file): ``architectures`` first, then
    ``model_type``.

    Raises:
        UnsupportedModelError: neither names a supported family.
    """
    names = tuple(getattr(config, "architectures", None) or ())
    model_type = getattr(config, "model_type", "") or ""
    for family in FAMILIES:
        if any(a in family.architectures for a in names):
            return family
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    shown = f"architecture {names[0]!r} (model_type {model_type!r})" if names else \
        f"model_type {model_type!r}"
    hint = ""
    if model_type == "gemma3":
        hint = " (the multimodal Gemma 3 checkpoint: serve its text model, Gemma3ForCausalLM)"
    raise UnsupportedModelError(f"{shown} is not supported{hint}; supported: "
                                f"{supported_summary()}")


def family_of_gguf(architecture: str) -> ModelFamily:
    """The family of a GGUF ``general.architecture``.

    Raises:
        UnsupportedModelError: not one of ``SUPPORTED_GGUF_ARCHITECTURES``.
    """
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    raise UnsupportedModelError(f"GGUF architecture {architecture!r} is not supported; "
                                f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")


def model_class(family: ModelFamily) -> type:
    """The family's model class (imports torch)."""
    module, name = family.model.split(":")
    return getattr(importlib.import_module(f"aioengine.models.{module}"), name)
