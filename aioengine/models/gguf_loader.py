"""A GGUF file as a Llama-family model: its config from the metadata, the checks made
before a worker starts, and the tensors memory-mapped in their stored formats.

Tensors come back as views of one copy-on-write mapping of the file
(``mmap.ACCESS_COPY``): pages are read on first touch and stay file-backed (shared by
every worker of the model through the page cache) until written, which nothing does:
quantized tensors as ``QuantizedWeight`` (uint8 ``[rows, row_bytes]``), F16/BF16
matrices likewise, F32 tensors as fp32 tensors. The exceptions are Q and K, whose rows
llama.cpp's converter permutes (see ``unpermute_rows``): reordering them copies those
rows into process memory.

The config and checks import no torch (the engine process runs them before it starts
a worker, and importing torch first would hold the worker back by seconds); the tensor
functions import it where they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aioengine.models import registry
from aioengine.models.gguf_file import GGUFFile, checked_type

if TYPE_CHECKING:
    import torch

    from triton_kernels.quant import QuantizedWeight

#: ``general.architecture`` values this engine runs (``llama`` also covers Mistral files).
SUPPORTED_GGUF_ARCHITECTURES = registry.SUPPORTED_GGUF_ARCHITECTURES

# llama.cpp tensor names (gguf.TENSOR_NAMES for MODEL_ARCH.LLAMA) -> HF parameter names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 RoPE: per-frequency divisors, not a parameter
    # Phi-3's LongRoPE factors: read into the config (``_longrope_scaling``), not parameters.
    "rope_factors_long.weight": "rope_factors_long",
    "rope_factors_short.weight": "rope_factors_short",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# -- the model: config, checks, weights ---------------------------------------------------------


# -- per-architecture tensor names and metadata (llama.cpp's gguf-py TENSOR_NAMES and
# convert_hf_to_gguf.py, read backwards) ---------------------------------------------------

_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma: ``ffn_norm`` is the norm before the MLP, its post-attention norm has a name of its own.
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, **_QK_NORM_NAMES,
                      "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3: Q/K/V in one tensor; ``ffn_up`` holds gate and up (gate rows first).
_PHI3_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                     "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                     "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "llama": _BLOCK_NAMES,
    "qwen2": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
    "gemma2": {k: v for k, v in _GEMMA_BLOCK_NAMES.items() if k not in _QK_NORM_NAMES},
    "gemma3": _GEMMA_BLOCK_NAMES,
    "phi3": _PHI3_BLOCK_NAMES,
}
#: Architectures whose converter permutes Q/K rows for GPT-J-style RoPE (``LlamaModel``).
PERMUTED_ARCHITECTURES = ("llama",)
#: Architectures whose converter stores RMSNorm weights as ``1 + weight`` (Gemma).
NORM_SHIFTED_ARCHITECTURES = ("gemma2", "gemma3")


def block_names(architecture: str) -> dict[str, str]:
    """llama.cpp block tensor name -> HF name under ``model.layers.{i}.``."""
    return ARCH_BLOCK_NAMES.get(architecture, _BLOCK_NAMES)


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF parameter name of a llama.cpp tensor name, or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = block_names(architecture)
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def _family_config(f: GGUFFile, config: dict[str, Any]) -> None:
    """The keys of ``config`` (HF names) that one architecture adds or changes, in place.

    Gemma: llama.cpp keeps no ``query_pre_attn_scalar`` (it scales by
    ``1/sqrt(head_dim)``, or ``1/sqrt(hidden/heads)`` for the 27B models, which it
    recognises by their layer count: 46 for Gemma 2, 62 for Gemma 3) and no layer
    pattern (every other layer local for Gemma 2, five of six for Gemma 3); Gemma 3's
    local layers use ``rope.freq_base_swa`` (10000) and no scaling.
    """
    arch, n = f.architecture, config["num_hidden_layers"]
    family = registry.family_of_gguf(arch)
    config["model_type"] = family.model_types[0]
    config["architectures"] = [family.architectures[0]]
    window = f.arch_key("attention.sliding_window")
    if arch in ("gemma2", "gemma3"):
        big = n == (46 if arch == "gemma2" else 62)
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                           if big else config["head_dim"])
        config["final_logit_softcapping"] = f.arch_key("final_logit_softcapping")
        config["attn_logit_softcapping"] = f.arch_key("attn_logit_softcapping")
        # ``attention.sliding_window_pattern``: a period (layer i local unless the last of
        # its period), or one bool per layer (True: local); llama.cpp's default without it.
        pattern = f.arch_key("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):
            if len(pattern) != n:
                raise ValueError(f"{f.path}: {arch}.attention.sliding_window_pattern has "
                                 f"{len(pattern)} entries for {n} layers")
            local = [bool(p) for p in pattern]
        else:
            local = [i % int(pattern) < int(pattern) - 1 for i in range(n)]
        config["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
        config["sliding_window"] = int(window or 4096)
        if arch == "gemma3":
            full = dict(config.pop("rope_scaling") or {"rope_type": "default"})
            full["rope_theta"] = config.pop("rope_theta")
            config["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": float(
                    f.arch_key("rope.freq_base_swa", 10000.0))}}
    elif arch == "phi3":
        if window:
            config["sliding_window"] = int(window)
        rope_dim = _int_key(f, "rope.dimension_count", config["head_dim"])
        if rope_dim != config["head_dim"]:
            config["partial_rotary_factor"] = rope_dim / config["head_dim"]
        if "rope_factors_long.weight" in f.tensors:
            config["rope_scaling"] = _longrope_scaling(f, config)


def _int_key(f: GGUFFile, suffix: str, default: int | None = None) -> int:
    value = f.arch_key(suffix, default)
    if value is None:
        raise ValueError(f"{f.path}: metadata key {f.architecture}.{suffix} is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{f.path}: {f.architecture}.{suffix} is {value!r}; expected one "
                         f"integer (per-layer values are not supported)")
    return value


def hf_config_dict(f: GGUFFile) -> dict[str, Any]:
    """The model's config in HF ``config.json`` terms, from the file's metadata alone.

    The mapping is llama.cpp's ``convert_hf_to_gguf.py`` read backwards (and what
    transformers' ``get_gguf_config`` produces for these keys): ``block_count`` ->
    ``num_hidden_layers``, ``embedding_length`` -> ``hidden_size``,
    ``feed_forward_length`` -> ``intermediate_size``, ``attention.head_count(_kv)``,
    ``attention.layer_norm_rms_epsilon``, ``rope.freq_base`` -> ``rope_theta``,
    ``context_length`` -> ``max_position_embeddings``, ``rope.scaling.*`` ->
    ``rope_scaling``; ``tie_word_embeddings`` is the absence of ``output.weight``.

    Raises:
        ValueError: an unsupported architecture, a missing or per-layer key, a RoPE
            scaling type or partial rotary dimension this model does not implement.
    """
    arch = f.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise registry.UnsupportedModelError(
            f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    hidden = _int_key(f, "embedding_length")
    heads = _int_key(f, "attention.head_count")
    kv_heads = _int_key(f, "attention.head_count_kv", heads)
    head_dim = _int_key(f, "attention.key_length", hidden // heads if heads else 0)
    rope_dim = _int_key(f, "rope.dimension_count", head_dim)
    if rope_dim != head_dim and arch != "phi3":
        raise ValueError(f"{f.path}: RoPE over {rope_dim} of {head_dim} head dimensions "
                         f"(partial rotary) is not supported")
    embed = f.tensors.get("token_embd.weight")
    vocab = f.arch_key("vocab_size")
    if vocab is None:
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else (embed.shape[0] if embed else None)
    config: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _int_key(f, "feed_forward_length"),
        "num_hidden_layers": _int_key(f, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": _int_key(f, "context_length", 2048),
        "rope_theta": float(f.arch_key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(f),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
    }
    _family_config(f, config)
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = f.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = value
    return config


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``rope.scaling.*`` (llama.cpp's ``llama_rope_scaling_type``)."""
    kind = f.arch_key("rope.scaling.type", "none")
    factor = f.arch_key("rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor or 1.0)}
        original = f.arch_key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                          ("rope.scaling.yarn_beta_slow", "beta_slow"),
                          ("rope.scaling.attn_factor", "attention_factor")):
            value = f.arch_key(key)
            if value is not None:
                scaling[name] = float(value)
        return scaling
    raise ValueError(f"{f.path}: RoPE scaling type {kind!r} is not supported "
                     f"(supported: none, linear, yarn, and llama3's rope_freqs tensor)")


def _f32_vector(f: GGUFFile, name: str) -> list[float]:
    """A small F32 tensor's values, read from the file without torch."""
    import struct

    info = f.tensors[name]
    if info.type_name != "F32" or len(info.shape) != 1:
        raise ValueError(f"{f.path}: tensor {name!r} is {info.type_name} {list(info.shape)}; "
                         f"expected an F32 vector")
    return list(struct.unpack_from(f"<{info.shape[0]}f", f.mapping(), info.offset))


def _longrope_scaling(f: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE as HF ``rope_scaling`` from what ``convert_hf_to_gguf.py``
    (``Phi3MiniModel``) writes: the ``rope_factors_long``/``rope_factors_short`` tensors,
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``."""
    original = _int_key(f, "rope.scaling.original_context_length")
    scaling: dict[str, Any] = {
        "rope_type": "longrope", "original_max_position_embeddings": original,
        "long_factor": _f32_vector(f, "rope_factors_long.weight"),
        "short_factor": _f32_vector(f, "rope_factors_short.weight"),
    }
    attn_factor = f.arch_key("rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    config["original_max_position_embeddings"] = original
    return scaling


def check_gguf_model(f: GGUFFile) -> dict[str, Any]:
    """Everything that can be refused from the header alone, before a worker starts:
    the architecture and its keys (``hf_config_dict``), every tensor's type, name and the
    presence of the tensors the model needs. Returns the config dict.

    Raises:
        ValueError: the first problem found, naming the tensor or key.
    """
    config = hf_config_dict(f)
    for info in f.tensors.values():
        checked_type(f.path, info)
        if hf_name(info.name, f.architecture) is None:
            raise ValueError(f"{f.path}: tensor {info.name!r} has no counterpart in the "
                             f"{f.architecture} model")
    needed = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"])
        for n in block_names(f.architecture)]
    missing = [n for n in needed if n not in f.tensors]
    if missing:
        raise ValueError(f"{f.path}: tensors missing: {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")
    return config


def raw_tensor(f: GGUFFile, name: str) -> torch.Tensor:
    """The tensor's bytes as a uint8 view of the mapped file: ``[rows, row_bytes]`` for a
    matrix (``[..., row_bytes]`` in general), no copy, nothing read until touched."""
    import torch

    info = f.tensors[name]
    data = torch.frombuffer(f.mapping(), dtype=torch.uint8, count=info.nbytes,
                            offset=info.offset)
    return data.view(*info.shape[:-1], -1)


def map_tensor(f: GGUFFile, name: str) -> torch.Tensor | QuantizedWeight:
    """The tensor in its stored format.

    Returns:
        F32: an fp32 view ``shape`` of the file. A matrix of any other supported
        type: a ``QuantizedWeight`` over the file's bytes. A vector stored as F16,
        BF16 or a block format (a norm or bias in some files): fp32, dequantized.

    Raises:
        ValueError: a type the kernels do not run (``check_gguf_model`` names them all).
    """
    import torch
    from gguf import GGMLQuantizationType

    from triton_kernels.quant import QuantizedWeight

    info = f.tensors[name]
    qtype = checked_type(f.path, info)
    raw = raw_tensor(f, name)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(torch.float32).view(info.shape)
    if len(info.shape) == 2:
        return QuantizedWeight(raw, qtype, info.shape)
    if len(info.shape) != 1:
        raise ValueError(f"{f.path}: tensor {name!r} has shape {list(info.shape)}; only "
                         f"vectors and matrices are supported")
    return QuantizedWeight(raw.view(1, -1), qtype, (1, info.shape[0])).dequantize()[0]


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``hf = gguf[index]``.

    ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) stores Q and K (weights and
    biases) with each head's rows interleaved for GPT-J-style RoPE::

        w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)

    so GGUF row ``h * 2d + 2i + j`` is HF row ``h * 2d + j * d + i`` (``d`` = head_dim / 2).
    The inverse is a pure row gather, which on quantized data reorders whole byte rows.
    For K, ``num_heads`` is the number of KV heads.

    Returns:
        ``[num_rows]`` int64.
    """
    import torch

    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _gather_rows(t: torch.Tensor | QuantizedWeight, index: torch.Tensor
                 ) -> torch.Tensor | QuantizedWeight:
    import numpy as np
    import torch

    from triton_kernels.quant import QuantizedWeight

    # numpy's take is a single-threaded memcpy per row: torch's index_select on a few
    # hundred KB wakes the OpenMP team, which costs ~20 ms per tensor on a busy machine.
    data = t.data if isinstance(t, QuantizedWeight) else t
    rows = torch.from_numpy(np.take(data.numpy(), index.numpy(), axis=0))
    return QuantizedWeight(rows, t.qtype, t.shape) if isinstance(t, QuantizedWeight) else rows


def load_gguf_weights(f: GGUFFile, config: dict[str, Any]
                      ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor under its HF name, in its stored format (see ``map_tensor``).

    For the ``llama`` architecture, Q and K rows (and biases) are put back in HF order
    (``unpermute_rows``); Qwen2/3, Gemma and Phi-3 files are written unpermuted. Gemma's
    norms come back as HF's ``weight`` (the file holds ``1 + weight``). ``rope_freqs`` (llama3
    RoPE) comes back under that name, fp32 ``[head_dim / 2]``.

    Args:
        config: ``hf_config_dict(f)`` (head counts for the permutation).
    """
    permuted = f.architecture in PERMUTED_ARCHITECTURES
    shifted = f.architecture in NORM_SHIFTED_ARCHITECTURES
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name in f.tensors:
        target = hf_name(name, f.architecture)
        if target is None:
            raise ValueError(f"{f.path}: tensor {name!r} has no counterpart in the model")
        t = map_tensor(f, name)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            n = heads if ".attn_q." in name else kv_heads
            t = _gather_rows(t, unpermute_rows(t.shape[0], n))
        if shifted and target.endswith("norm.weight"):
            t = t - 1.0  # the converter stored Gemma's 1 + weight; HF terms are weight
        weights[target] = t
    return weights
