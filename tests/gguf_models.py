"""Small random-weight GGUF files written the way llama.cpp's converter writes them.

``write_llama_gguf`` builds a Llama model with ``gguf.GGUFWriter``: HF-order weights,
quantized with the ``gguf`` package's quantizers (or, for the K-quants, which it cannot
quantize, random blocks with finite fp16 scales), Q and K rows permuted with
``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, and the default model's tokenizer
metadata so that transformers and the engine can both tokenize. The HF-order blocks are
returned too: they are what a correct loader must give back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aioengine.config import default_model_path
from aioengine.models.gguf_file import GGUFFile

QT = GGMLQuantizationType

# Where each K-quant block keeps its fp16 super-block scales (ggml-common.h): Q4_K and
# Q5_K start with d and dmin, Q6_K ends with d.
_FP16_SCALES = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
_SCALE_RANGE = {QT.Q4_K: 2e-3, QT.Q5_K: 1e-3, QT.Q6_K: 2e-4}


@dataclass(frozen=True)
class TinyLlama:
    """Shape of the test model (hidden and intermediate multiples of 256 for the K-quants)."""

    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context: int = 512
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def convert_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's ``convert_hf_to_gguf.py``, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def random_blocks(rows: int, cols: int, qtype: GGMLQuantizationType,
                  rng: np.random.Generator) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 of one format. gguf quantizes Gaussian weights for the
    formats it can; K-quants are random bytes with small finite fp16 scales."""
    if qtype in _FP16_SCALES:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
        for offset in _FP16_SCALES[qtype]:
            scale = rng.uniform(0.2, 1.0, blocks.shape[:2]) * _SCALE_RANGE[qtype]
            blocks[:, :, offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
        return blocks.reshape(rows, -1)
    dense = rng.normal(0.0, 0.08, (rows, cols)).astype(np.float32)
    if qtype == QT.F32:
        return dense.view(np.uint8)
    return np.ascontiguousarray(gguf.quants.quantize(dense, qtype)).view(np.uint8).reshape(
        rows, -1)


def default_layer_types() -> list[dict[str, GGMLQuantizationType]]:
    """Every format across the two layers (and the 32- and 256-element block sizes)."""
    return [
        {"attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q5_0, "attn_output": QT.Q5_1,
         "ffn_gate": QT.Q8_0, "ffn_up": QT.F16, "ffn_down": QT.BF16},
        {"attn_q": QT.Q4_K, "attn_k": QT.Q6_K, "attn_v": QT.Q5_K, "attn_output": QT.F32,
         "ffn_gate": QT.Q4_1, "ffn_up": QT.Q8_0, "ffn_down": QT.Q6_K},
    ]


def tokenizer_metadata() -> dict:
    """The default model's tokenizer keys (a real BPE vocabulary, chat template)."""
    f = GGUFFile.read(default_model_path(), string_arrays=True)
    return {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}


def write_llama_gguf(path: Path, shape: TinyLlama = TinyLlama(),
                     layer_types: list[Mapping[str, GGMLQuantizationType]] | None = None,
                     embed_type: GGMLQuantizationType = QT.Q8_0,
                     output_type: GGMLQuantizationType = QT.Q6_K, seed: int = 0,
                     architecture: str = "llama", tokenizer: dict | None = None,
                     extra_tensors: Mapping[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
                     ) -> dict[str, tuple[np.ndarray, GGMLQuantizationType, tuple[int, int]]]:
    """Write a random Llama GGUF; returns ``{hf_name: (hf-order bytes or fp32, type, shape)}``.

    Args:
        layer_types: per layer, the format of each projection (``default_layer_types``).
        tokenizer: tokenizer metadata (``tokenizer_metadata()``; pass it in to read the
            default file once per test module).
    """
    rng = np.random.default_rng(seed)
    layer_types = layer_types or default_layer_types()
    assert len(layer_types) == shape.layers
    tokenizer = tokenizer if tokenizer is not None else tokenizer_metadata()
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-random-llama")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    _add_tokenizer(w, tokenizer)

    expected: dict[str, tuple[np.ndarray, GGMLQuantizationType, tuple[int, int]]] = {}

    def add(gguf_name: str, hf: str, rows: int, cols: int, qtype: GGMLQuantizationType,
            permute_heads: int | None = None) -> None:
        data = random_blocks(rows, cols, qtype, rng)
        expected[hf] = (data, qtype, (rows, cols))
        stored = data
        if permute_heads is not None:  # permuting rows commutes with per-row quantization
            index = convert_permute(np.arange(rows), shape.heads, permute_heads)
            stored = data[index]
        w.add_tensor(gguf_name, np.ascontiguousarray(stored), raw_dtype=qtype)

    def add_norm(gguf_name: str, hf: str) -> None:
        values = (1.0 + rng.normal(0.0, 0.1, shape.hidden)).astype(np.float32)
        expected[hf] = (values, QT.F32, (shape.hidden,))
        w.add_tensor(gguf_name, values)

    add("token_embd.weight", "model.embed_tokens.weight", vocab, shape.hidden, embed_type)
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for i, types in enumerate(layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add_norm(b + "attn_norm.weight", p + "input_layernorm.weight")
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", q_rows, shape.hidden,
            types["attn_q"], permute_heads=shape.heads)
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", kv_rows, shape.hidden,
            types["attn_k"], permute_heads=shape.kv_heads)
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", kv_rows, shape.hidden,
            types["attn_v"])
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", shape.hidden, q_rows,
            types["attn_output"])
        add_norm(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", shape.intermediate,
            shape.hidden, types["ffn_gate"])
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", shape.intermediate, shape.hidden,
            types["ffn_up"])
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", shape.hidden,
            shape.intermediate, types["ffn_down"])
    add_norm("output_norm.weight", "model.norm.weight")
    if not shape.tied:
        add("output.weight", "lm_head.weight", vocab, shape.hidden, output_type)
    for name, (array, qtype) in extra_tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _add_tokenizer(w: gguf.GGUFWriter, meta: dict) -> None:
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(meta["tokenizer.chat_template"])


def dequantized(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
                ) -> torch.Tensor:
    """fp32 values of ``write_llama_gguf``'s expected entry (gguf's dequantizer)."""
    if qtype == QT.F32:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float32).reshape(shape))
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(shape))
