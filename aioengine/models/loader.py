"""Model config, tokenizer and weights from a GGUF file or an HF folder.

Weights come through well-kept libraries: ``gguf`` (via transformers' GGUF
reader, which dequantizes and undoes llama.cpp's Q/K row permutation and maps
tensor names to HF names) and ``safetensors``. The forward pass is ours
(``aioengine.models.llama``); transformers only supplies config, tokenizer,
chat template and tensors.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _split_gguf(path: str) -> tuple[str, str]:
    p = Path(path)
    return str(p.parent), p.name


def load_hf_config(model_path: str):
    """``transformers.PretrainedConfig`` of a GGUF file or an HF folder."""
    from transformers import AutoConfig

    if model_path.endswith(".gguf"):
        folder, name = _split_gguf(model_path)
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(model_path: str):
    """Fast tokenizer (with chat template) of a GGUF file or an HF folder."""
    from transformers import AutoTokenizer

    if model_path.endswith(".gguf"):
        folder, name = _split_gguf(model_path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(model_path)


def model_display_name(model_path: str) -> str:
    """The model's own name: GGUF ``general.name`` with the file stem as fallback,
    or the folder name of an HF checkout."""
    p = Path(model_path)
    if p.suffix == ".gguf":
        name = p.stem
        # Q4_1 and similar quantization suffixes are not part of the model's name.
        base, _, quant = name.rpartition(".")
        return base if base and quant.upper().startswith(("Q", "F", "BF", "IQ")) else name
    return p.resolve().name


def load_weights(model_path: str, hf_config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All weights as ``{hf_parameter_name: tensor}`` in ``dtype`` on the CPU.

    GGUF tensors are dequantized (Q4_1 etc. to fp32 first, then cast).

    Raises:
        FileNotFoundError: an HF folder holds no ``*.safetensors`` file.
    """
    if model_path.endswith(".gguf"):
        return _load_gguf_weights(model_path, hf_config, dtype)
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            weights[name] = tensor.to(dtype)
    return weights


def _load_gguf_weights(model_path: str, hf_config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # An empty HF model on the meta device only serves to map GGUF tensor
    # names to HF names; no memory is allocated for it.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    os.environ.setdefault("TQDM_MININTERVAL", "0.5")
    parsed = load_gguf_checkpoint(model_path, return_tensors=True, model_to_load=skeleton)
    return {name: t.to(dtype) for name, t in parsed["tensors"].items()}
