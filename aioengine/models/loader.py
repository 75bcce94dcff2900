"""Model config, tokenizer and weights from a GGUF file or an HF folder.

- GGUF: our own reader (``gguf_loader``): the config from the file's metadata, the
  tensors memory-mapped in their stored formats (quantized ones as
  ``QuantizedWeight``), Q/K rows put back in HF order. The tokenizer is transformers'
  (built from the file's metadata) and cached as ``tokenizer.json`` after the first
  build, which is 20x faster to load again.
- HF folder: ``config.json`` through transformers, ``*.safetensors`` through
  ``safetensors``; with ``quantization="int8"`` or ``"int4"`` the linear weights are
  quantized at load to GGML block formats (``QUANTIZATION_FORMATS``).

The forward pass is ours (``aioengine.models.registry`` picks the family's class);
transformers only supplies config, tokenizer and chat template. Importing this module
imports no torch: the engine process checks the model (``inspect_model``) before it
starts a worker.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

# Moved to aioengine.tokenizer (the engine process loads it without model code).
from aioengine.tokenizer import (  # noqa: F401
    load_tokenizer,
    model_display_name,
    tokenizer_cache_dir,
)

if TYPE_CHECKING:
    import torch

    from triton_kernels.quant import QuantizedWeight

logger = logging.getLogger(__name__)

QT = GGMLQuantizationType
QUANTIZATION_METHODS = ("none", "int8", "int4")
#: ``--quantization`` -> (format of the Q/K/V/O and MLP projections, format of the
#: embedding and LM head). Weight-only, groups of 32 weights along the input dimension:
#: int8 is Q8_0 (int8 values, one fp16 scale per group: 8.5 bits/weight); int4 is Q4_1
#: (4-bit values with an fp16 scale and an fp16 minimum per group: 5 bits/weight; the
#: minimum makes it more accurate than the symmetric Q4_0 for 0.5 bit more, and it is the
#: format of the default GGUF, which the kernels are tuned for). The embedding and LM
#: head stay at Q8_0 under int4, as llama.cpp's Q4 files keep them at 6-8 bits: the LM
#: head's error lands directly on the logits.
QUANTIZATION_FORMATS: dict[str, tuple[GGMLQuantizationType, GGMLQuantizationType]] = {
    "int8": (QT.Q8_0, QT.Q8_0),
    "int4": (QT.Q4_1, QT.Q8_0),
}
_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                "gate_proj.weight", "up_proj.weight", "down_proj.weight")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf")


@functools.lru_cache(maxsize=4)
def _gguf_header(path: str, mtime_ns: int, size: int):
    from aioengine.models.gguf_file import GGUFFile

    return GGUFFile.read(path)


def gguf_file(model_path: str):
    """The parsed header of a GGUF file (``gguf_file.GGUFFile``), cached per process
    while the file is unchanged. Raises FileNotFoundError / ValueError (see ``read``)."""
    st = os.stat(model_path)
    return _gguf_header(os.path.realpath(model_path), st.st_mtime_ns, st.st_size)


# -- what the engine process checks before any worker starts ---------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What a model is and how its weights are stored, from metadata alone.

    Attributes:
        architecture: ``llama``, ``qwen2`` ...
        quantization: ``"gguf"`` (the file's own formats), ``"int8"`` / ``"int4"``
            (quantized at load), or ``"none"`` (dense, in the compute dtype).
        weight_formats: ``{format: number of tensors}`` as they will be held, e.g.
            ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``.
    """

    architecture: str
    quantization: str
    weight_formats: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs: ``gguf weights Q4_1 x210, F32 x61, Q8_0 x1``."""
        formats = ", ".join(f"{k} x{v}" for k, v in self.weight_formats.items())
        return f"{self.quantization} weights {formats}" if formats else self.quantization


def inspect_model(model_path: str, quantization: str = "none", dtype: str = "float32"
                  ) -> ModelInfo:
    """Check a model from its metadata (the GGUF header, or ``config.json`` and the
    safetensors headers) without reading any weights.

    Raises:
        FileNotFoundError: no such file, or an HF folder without ``*.safetensors``.
        ValueError: not a GGUF file, a corrupt header, an unsupported architecture or
            tensor type, or ``quantization`` given for a GGUF file (already quantized);
            the message names the file and the problem.
    """
    # "auto" is resolved in the worker (fp32 for quantized weights on a CPU; it logs it)
    dense = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "auto": "F32"}[dtype]
    if is_gguf(model_path):
        from aioengine.models.gguf_loader import check_gguf_model

        if quantization != "none":
            raise ValueError(_already_quantized(model_path, quantization))
        f = gguf_file(model_path)
        check_gguf_model(f)
        counts: dict[str, int] = {}
        for info in f.tensors.values():
            # Vectors (norms, biases) and F32 tensors are held dense in the compute dtype.
            fmt = dense if len(info.shape) == 1 or info.type_name == "F32" else info.type_name
            counts[fmt] = counts.get(fmt, 0) + 1
        return ModelInfo(f.architecture, "gguf", dict(sorted(counts.items(),
                                                              key=lambda kv: -kv[1])))
    config = load_hf_config(model_path)
    from aioengine.models.registry import UnsupportedModelError, family_of_config

    try:
        family_of_config(config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{model_path}: {exc}") from None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    counts = {}
    for name, shape in _safetensors_shapes(model_path).items():
        if tied and name == "lm_head.weight":
            continue
        fmt = _hf_format(name, shape, quantization)
        fmt = fmt.name if fmt is not None else dense
        counts[fmt] = counts.get(fmt, 0) + 1
    return ModelInfo(config.model_type, quantization,
                     dict(sorted(counts.items(), key=lambda kv: -kv[1])))


def _already_quantized(model_path: str, quantization: str) -> str:
    return (f"--quantization {quantization} quantizes an HF checkpoint at load; {model_path} is "
            f"a GGUF file, already quantized (its tensors run in their stored formats): "
            f"drop the flag")


def _safetensors_files(model_path: str) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    return files


def _safetensors_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for f in _safetensors_files(model_path):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


def _hf_format(name: str, shape: tuple[int, ...], quantization: str
               ) -> GGMLQuantizationType | None:
    """The block format ``--quantization`` gives this HF tensor, or None to keep it dense
    (vectors, biases, anything else, and rows not a multiple of the block size)."""
    if quantization == "none" or len(shape) != 2:
        return None
    proj_format, table_format = QUANTIZATION_FORMATS[quantization]
    if name.endswith(_PROJECTIONS):
        qtype = proj_format
    elif name in _TABLES:
        qtype = table_format
    else:
        return None
    from gguf import GGML_QUANT_SIZES

    return qtype if shape[1] % GGML_QUANT_SIZES[qtype][0] == 0 else None


# -- config (the tokenizer and display name moved to aioengine.tokenizer) --------------------


def load_hf_config(model_path: str):
    """The model's config: a ``transformers.PretrainedConfig`` for an HF folder; for a
    GGUF file the same fields (HF ``config.json`` names) from the file's metadata
    (``gguf_loader.hf_config_dict``), without importing transformers.

    Raises:
        ValueError: see ``gguf_loader.check_gguf_model``.
    """
    if is_gguf(model_path):
        from aioengine.models.gguf_loader import check_gguf_model

        return SimpleNamespace(**check_gguf_model(gguf_file(model_path)))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


# -- weights ---------------------------------------------------------------------------------


def load_weights(model_path: str, hf_config, dtype: torch.dtype, quantization: str = "none"
                 ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """All weights as ``{hf_parameter_name: tensor or QuantizedWeight}`` on the CPU.

    GGUF: each tensor in its stored format, mapped from the file (``gguf_loader``);
    F32 tensors are fp32 views of the file. HF: dense tensors in ``dtype``, except that
    ``quantization`` ``"int8"``/``"int4"`` quantizes the projections, the embedding and
    the LM head at load (``QUANTIZATION_FORMATS``; gguf's reference quantizers).

    Raises:
        FileNotFoundError: an HF folder holds no ``*.safetensors`` file.
        ValueError: ``quantization`` with a GGUF file, or a file the loader refuses.
    """
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got "
                         f"{quantization!r}")
    if is_gguf(model_path):
        from aioengine.models.gguf_loader import check_gguf_model, load_gguf_weights

        if quantization != "none":
            raise ValueError(_already_quantized(model_path, quantization))
        f = gguf_file(model_path)
        return load_gguf_weights(f, check_gguf_model(f))
    from safetensors import safe_open

    from triton_kernels.quant import QuantizedWeight

    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    weights: dict[str, Any] = {}
    for path in _safetensors_files(model_path):
        with safe_open(str(path), "pt") as sf:
            for name in sf.keys():
                if tied and name == "lm_head.weight":
                    continue  # tied: the model uses the embedding, a copy would be dead weight
                tensor = sf.get_tensor(name)
                qtype = _hf_format(name, tuple(tensor.shape), quantization)
                weights[name] = (tensor.to(dtype) if qtype is None
                                 else QuantizedWeight.quantize(tensor, qtype))
    return weights
