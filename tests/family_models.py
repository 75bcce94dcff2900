"""Tiny random-weight models of every supported family, built with transformers (no hub)
and saved as an HF safetensors folder and as a GGUF file written the way llama.cpp's
``convert_hf_to_gguf.py`` writes it.

The GGUF side takes its tensor names from the ``gguf`` package's own HF -> GGUF name
map (``gguf.get_tensor_name_map``, what the converter uses), permutes Llama's Q/K rows
(``LlamaModel.permute``), stores Gemma's norms as ``1 + weight`` and Llama 3's RoPE
scaling as the ``rope_freqs`` tensor, so the loader's reading of each is tested against
an independent writer. Weights are F32 in both files: the same model, the same tokens.

Weights are drawn wider than transformers' init (std 0.02 makes a 64-wide model's
logits nearly flat, and every step a near-tie); norms are random too, so that Gemma's
``1 + weight`` and a missing offset differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf_models import _add_tokenizer, convert_permute

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Gemma 2's template, shortened: it refuses the system role as the real one does.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + "
    "'<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

CORPUS = ["The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
          "In the beginning the engineers wrote a small engine that served many models to "
          "many people at once on a small machine.", "Hello there, who are you? Be brief."]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>",
                  "<end_of_turn>"]


def tiny_tokenizer():
    """``(tokenizer, gguf_metadata)``: a byte-level BPE of about 400 tokens trained here
    on ``CORPUS`` (a 49k vocabulary would make every GGUF tokenizer build take seconds),
    and its ``tokenizer.*`` GGUF keys as llama.cpp's converter writes a GPT-2-style one."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>",
                                        eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    model = json.loads(tk.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    specials = set(SPECIAL_TOKENS)
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": [t for t, _ in vocab],
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t, _ in vocab],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m
                                  for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": tokenizer.bos_token_id,
        "tokenizer.ggml.eos_token_id": tokenizer.eos_token_id,
        "tokenizer.ggml.unknown_token_id": tokenizer.eos_token_id,
        "tokenizer.ggml.padding_token_id": tokenizer.eos_token_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    return tokenizer, meta


SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
WINDOW = 8  # tokens: every test prompt but the shortest is longer


@dataclass(frozen=True)
class Family:
    """One tiny model: its HF config class name and fields, GGUF architecture, template."""

    name: str
    config_class: str
    config: dict[str, Any]
    gguf_arch: str
    template: str
    fused_decode: bool           # the C++ decode step runs it (all but partial rotary)
    extra: dict[str, Any] = field(default_factory=dict)


FAMILIES = {
    "llama3": Family("llama3", "LlamaConfig", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False), "llama", LLAMA3_TEMPLATE, True),
    "mistral": Family("mistral", "MistralConfig", dict(
        sliding_window=WINDOW, head_dim=16, tie_word_embeddings=False), "llama", CHATML, True),
    "qwen2": Family("qwen2", "Qwen2Config", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1000000.0}),
        "qwen2", CHATML, True),
    "qwen3": Family("qwen3", "Qwen3Config", dict(
        head_dim=32, tie_word_embeddings=True), "qwen3", CHATML, True),
    "gemma2": Family("gemma2", "Gemma2Config", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0), "gemma2", GEMMA_TEMPLATE,
        True),
    "gemma3": Family("gemma3", "Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}}),
        "gemma3", GEMMA_TEMPLATE, True),
    "phi3": Family("phi3", "Phi3Config", dict(
        # LongRoPE's short factors below 128 positions (every test sequence), the long
        # ones past it; max / original sets the attention factor.
        max_position_embeddings=512, original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.1, 1.3, 1.6],
                         "long_factor": [1.5, 2.0, 3.0, 4.5],
                         "original_max_position_embeddings": 128},
        tie_word_embeddings=False), "phi3", PHI3_TEMPLATE, False),
    # Phi-3-mini-4k's shape: whole-head RoPE, no scaling; a GGUF of it loads.
    "phi3_plain": Family("phi3_plain", "Phi3Config", dict(tie_word_embeddings=False), "phi3",
                         PHI3_TEMPLATE, True),
}


def hf_config(family: Family, vocab_size: int, bos: int, eos: int):
    import transformers

    cls = getattr(transformers, family.config_class)
    return cls(**SHAPE | family.config, vocab_size=vocab_size, bos_token_id=bos,
               eos_token_id=eos, pad_token_id=eos)


def build_hf_model(family: Family, tokenizer, seed: int = 0):
    """The random-weight transformers model, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    config = hf_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if family.name.startswith("gemma") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_((0.15 if family.name.startswith("gemma") else 1.0)
                        * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * 1.5)
    return model.eval()


def save_hf_folder(model, tokenizer, family: Family, folder: Path) -> Path:
    """``config.json``, ``model.safetensors`` and the tokenizer with the family's template."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.chat_template = family.template
    tokenizer.save_pretrained(str(folder))
    return folder


def _llama3_rope_freqs(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """``rope_freqs`` as ``convert_hf_to_gguf.py`` (``LlamaModel.generate_extra_tensors``)
    computes it: per-frequency divisors of llama3 RoPE."""
    base = params["rope_theta"]
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model, family: Family, path: Path, tokenizer_meta: dict) -> Path:
    """The HF model as llama.cpp's converter would write it (F32 tensors), with the
    tokenizer keys ``tokenizer_meta`` (``tiny_tokenizer``) and the family's template."""
    cfg = model.config
    arch = family.gguf_arch
    meta = dict(tokenizer_meta)
    meta["tokenizer.chat_template"] = family.template
    n_layers = cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    params = cfg.rope_parameters
    if "full_attention" in params:
        params = params["full_attention"]
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-random-{family.name}")
    w.add_block_count(n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(params["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(rotary)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if params.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    if params.get("rope_type") == "longrope":  # Phi3MiniModel's keys and tensors
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        factor = cfg.max_position_embeddings / params["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", np.array(params["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(params["short_factor"], np.float32))
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if cfg.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    _add_tokenizer(w, meta)

    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = convert_permute(data, heads, kv_heads if ".k_proj." in name else None)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    if params.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(params, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
