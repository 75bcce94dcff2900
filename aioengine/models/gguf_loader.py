"""GGUF files: the header (metadata, tensor table), the model config, and the tensors
memory-mapped in their stored formats.

A GGUF file (llama.cpp, ``ggml/docs/gguf.md``) is a little-endian header, then the tensor
data: ``magic "GGUF", version u32, tensor_count u64, kv_count u64``, ``kv_count``
key/value pairs, ``tensor_count`` tensor infos (name, dims fastest-first, GGML type,
offset into the data section), padding to ``general.alignment`` (32 by default), data.

The header is parsed here with ``struct`` straight off a memory map. ``gguf.GGUFReader``
(the reference this is tested against, field by field and tensor by tensor) builds a
numpy view for every element of every metadata array: 2.8 s for the default model's
147k tokenizer entries, every time a process opens the file. This reader takes about
40 ms with the string arrays skipped (the worker never needs the vocabulary) and keeps
``gguf``'s own enums and block sizes (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``).

Tensors come back as views of one copy-on-write mapping of the file
(``mmap.ACCESS_COPY``): pages are read on first touch and stay file-backed (shared by
every worker of the model through the page cache) until written, which nothing does:
quantized tensors as ``QuantizedWeight`` (uint8 ``[rows, row_bytes]``), F16/BF16
matrices likewise, F32 tensors as fp32 tensors. The exceptions are Q and K, whose rows
llama.cpp's converter permutes (see ``unpermute_rows``): reordering them copies those
rows into process memory.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

from triton_kernels.quant import SUPPORTED_QTYPES, QuantizedWeight

QT = GGMLQuantizationType
#: ``general.architecture`` values this engine runs (``llama`` also covers Mistral files).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
#: Types a tensor may be stored in: the kernels' formats plus plain fp32.
SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = (QT.F32, *SUPPORTED_QTYPES)

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # v1 had 32-bit counts; llama.cpp itself dropped it in 2023
_MAX_DIMS = 4            # GGML_MAX_DIMS
# GGUFValueType id -> struct format of the fixed-size scalar types.
_SCALAR_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                  11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# llama.cpp tensor names (gguf.TENSOR_NAMES for MODEL_ARCH.LLAMA) -> HF parameter names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 RoPE: per-frequency divisors, not a parameter
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


class SkippedArray(int):
    """A metadata array of strings that was not decoded (``GGUFFile.read(path,
    string_arrays=False)``); its value is the element count."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        shape: logical shape in torch order (``[rows, cols]`` for a matrix: GGUF lists
            dims fastest-first, so this is the file's dims reversed).
        ggml_type: the raw GGML type id (may name a type ``gguf`` does not know).
        offset: byte offset of the data from the start of the file.
        nbytes: bytes of the data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.ggml_type)

    @property
    def type_name(self) -> str:
        try:
            return self.qtype.name
        except ValueError:
            return f"unknown type id {self.ggml_type}"


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header; tensor data stays on disk until ``map_tensors``.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: ``{key: value}``; strings as ``str``, arrays as lists (string arrays
            as ``SkippedArray`` unless read with ``string_arrays=True``).
        tensors: ``{name: GGUFTensorInfo}`` in file order.
        data_offset: where the data section starts (bytes).
        file_size: bytes.
    """

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int
    file_size: int
    _mapping: list = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def read(cls, path: str, *, string_arrays: bool = False) -> GGUFFile:
        """Parse the header of ``path`` (reads no tensor data).

        Args:
            string_arrays: decode arrays of strings (the vocabulary, the BPE merges);
                skipped by default, which makes the parse about 20x faster.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a GGUF file (the message says what the first bytes are), an
                unsupported version or byte order, or a truncated or inconsistent header
                (a tensor past the end of the file, say); the message names the file.
        """
        size = os.path.getsize(path)
        if size < 24:
            raise ValueError(f"{path} is not a GGUF file ({size} bytes, shorter than a "
                             f"GGUF header)")
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return cls._parse(path, buf, size, string_arrays)
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise ValueError(f"{path}: corrupt or truncated GGUF header ({exc})") from None
        finally:
            buf.close()

    @classmethod
    def _parse(cls, path: str, buf: mmap.mmap, size: int, string_arrays: bool) -> GGUFFile:
        magic = bytes(buf[:4])
        if magic != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                             f"b'GGUF')")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in _GGUF_VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError(f"{path} is a big-endian GGUF file; only little-endian "
                                 f"files are supported")
            raise ValueError(f"{path} is GGUF version {version}; supported: "
                             f"{', '.join(map(str, _GGUF_VERSIONS))}")
        # Every entry takes at least 8 bytes: a count beyond that is corruption, not a model.
        if 8 * (tensor_count + kv_count) > size:
            raise ValueError(f"{path}: corrupt GGUF header ({tensor_count} tensors and "
                             f"{kv_count} metadata keys in {size} bytes)")
        reader = _HeaderReader(buf, 24, size)
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("I"), string_arrays)
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        entries = []
        for _ in range(tensor_count):
            name = reader.string()
            n_dims = reader.scalar("I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            dims = reader.unpack(f"<{n_dims}Q", 8 * n_dims)
            ggml_type, offset = reader.unpack("<IQ", 12)
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        data_offset = -(-reader.pos // alignment) * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in entries:
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} appears twice")
            nbytes = _tensor_nbytes(path, name, shape, ggml_type)
            start = data_offset + offset
            if offset % alignment or start + nbytes > size:
                raise ValueError(f"{path}: tensor {name!r} ({nbytes} bytes at offset {start}) "
                                 f"lies outside the {size}-byte file or is misaligned: "
                                 f"the file is truncated or corrupt")
            tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
        return cls(path, version, metadata, tensors, data_offset, size)

    # -- metadata ------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        """``general.architecture``. Raises ValueError when the file has none."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path} has no general.architecture in its metadata")
        return arch

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """``{architecture}.{suffix}`` (``llama.block_count``), or ``default``."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def type_counts(self) -> dict[str, int]:
        """``{type name: number of tensors}``, most frequent first (``{"Q4_1": 210, ...}``)."""
        counts: dict[str, int] = {}
        for info in self.tensors.values():
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    # -- tensor data -----------------------------------------------------------------------------
    def _map(self) -> mmap.mmap:
        # One private (copy-on-write) mapping per file object, shared by all its tensors: torch
        # keeps it alive through every view, and writable pages spare torch's warning about
        # read-only buffers while the file itself can never be written.
        if not self._mapping:
            with open(self.path, "rb") as f:
                self._mapping.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        return self._mapping[0]

    def raw_tensor(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 view of the mapped file: ``[rows, row_bytes]`` for a
        matrix (``[..., row_bytes]`` in general), no copy, nothing read until touched."""
        info = self.tensors[name]
        data = torch.frombuffer(self._map(), dtype=torch.uint8, count=info.nbytes,
                                offset=info.offset)
        return data.view(*info.shape[:-1], -1)

    def tensor(self, name: str) -> torch.Tensor | QuantizedWeight:
        """The tensor in its stored format.

        Returns:
            F32: an fp32 view ``shape`` of the file. A matrix of any other supported
            type: a ``QuantizedWeight`` over the file's bytes. A vector stored as F16,
            BF16 or a block format (a norm or bias in some files): fp32, dequantized.

        Raises:
            ValueError: a type the kernels do not run (``check_gguf_model`` names them all).
        """
        info = self.tensors[name]
        qtype = _checked_type(self.path, info)
        raw = self.raw_tensor(name)
        if qtype == QT.F32:
            return raw.view(torch.float32).view(info.shape)
        if len(info.shape) == 2:
            return QuantizedWeight(raw, qtype, info.shape)
        if len(info.shape) != 1:
            raise ValueError(f"{self.path}: tensor {name!r} has shape {list(info.shape)}; only "
                             f"vectors and matrices are supported")
        return QuantizedWeight(raw.view(1, -1), qtype, (1, info.shape[0])).dequantize()[0]


class _HeaderReader:
    """Sequential little-endian reads over the header with bounds checks."""

    def __init__(self, buf: mmap.mmap, pos: int, size: int) -> None:
        self.buf, self.pos, self.size = buf, pos, size

    def unpack(self, fmt: str, nbytes: int) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += nbytes
        return values

    def scalar(self, code: str) -> Any:
        value = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += struct.calcsize(code)
        return value

    def _skip(self, nbytes: int) -> int:
        start = self.pos
        if nbytes < 0 or start + nbytes > self.size:
            raise struct.error(f"a {nbytes}-byte item at offset {start} runs past the end")
        self.pos += nbytes
        return start

    def string(self) -> str:
        n = self.scalar("Q")
        start = self._skip(n)
        return self.buf[start:start + n].decode("utf-8")

    def value(self, value_type: int, string_arrays: bool) -> Any:
        code = _SCALAR_FORMAT.get(value_type)
        if code is not None:
            return self.scalar(code)
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        item_type, count = self.unpack("<IQ", 12)
        code = _SCALAR_FORMAT.get(item_type)
        if code is not None:
            width = struct.calcsize(code)
            start = self._skip(width * count)
            return list(struct.unpack_from(f"<{count}{code}", self.buf, start))
        if item_type == _STRING:
            if string_arrays:
                return [self.string() for _ in range(count)]
            for _ in range(count):  # variable-length: walk the lengths only
                self._skip(self.scalar("Q"))
            return SkippedArray(count)
        if item_type == _ARRAY:
            return [self.value(_ARRAY, string_arrays) for _ in range(count)]
        raise ValueError(f"unknown GGUF metadata array type {item_type}")


def _tensor_nbytes(path: str, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"{path}: tensor {name!r} has unknown GGML type id {ggml_type}; "
                         f"supported: {_type_list()}") from None
    n = 1
    for d in shape:
        n *= d
    if shape[-1] % block_size:
        raise ValueError(f"{path}: tensor {name!r} has {shape[-1]} columns, not a multiple of "
                         f"its {GGMLQuantizationType(ggml_type).name} block size {block_size}")
    return n // block_size * type_size


def _type_list() -> str:
    return ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)


def _checked_type(path: str, info: GGUFTensorInfo) -> GGMLQuantizationType:
    try:
        qtype = info.qtype
    except ValueError:
        qtype = None
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {info.name!r} is stored as {info.type_name}, which "
                         f"aioengine cannot run; supported: {_type_list()}")
    return qtype


# -- the model: config, checks, weights ---------------------------------------------------------


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name, or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


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
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    hidden = _int_key(f, "embedding_length")
    heads = _int_key(f, "attention.head_count")
    kv_heads = _int_key(f, "attention.head_count_kv", heads)
    head_dim = _int_key(f, "attention.key_length", hidden // heads if heads else 0)
    rope_dim = _int_key(f, "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{f.path}: RoPE over {rope_dim} of {head_dim} head dimensions "
                         f"(partial rotary) is not supported")
    embed = f.tensors.get("token_embd.weight")
    vocab = f.arch_key("vocab_size")
    if vocab is None:
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else (embed.shape[0] if embed else None)
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
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


def check_gguf_model(f: GGUFFile) -> dict[str, Any]:
    """Everything that can be refused from the header alone, before a worker starts:
    the architecture and its keys (``hf_config_dict``), every tensor's type, name and the
    presence of the tensors the model needs. Returns the config dict.

    Raises:
        ValueError: the first problem found, naming the tensor or key.
    """
    config = hf_config_dict(f)
    for info in f.tensors.values():
        _checked_type(f.path, info)
        if hf_name(info.name) is None:
            raise ValueError(f"{f.path}: tensor {info.name!r} has no counterpart in the "
                             f"{f.architecture} model")
    needed = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"]) for n in _BLOCK_NAMES]
    missing = [n for n in needed if n not in f.tensors]
    if missing:
        raise ValueError(f"{f.path}: tensors missing: {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")
    return config


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
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _gather_rows(t: torch.Tensor | QuantizedWeight, index: torch.Tensor
                 ) -> torch.Tensor | QuantizedWeight:
    # numpy's take is a single-threaded memcpy per row: torch's index_select on a few
    # hundred KB wakes the OpenMP team, which costs ~20 ms per tensor on a busy machine.
    data = t.data if isinstance(t, QuantizedWeight) else t
    rows = torch.from_numpy(np.take(data.numpy(), index.numpy(), axis=0))
    return QuantizedWeight(rows, t.qtype, t.shape) if isinstance(t, QuantizedWeight) else rows


def load_gguf_weights(f: GGUFFile, config: dict[str, Any]
                      ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor under its HF name, in its stored format (see ``GGUFFile.tensor``).

    For the ``llama`` architecture, Q and K rows (and biases) are put back in HF order
    (``unpermute_rows``); Qwen2 files are written unpermuted. ``rope_freqs`` (llama3
    RoPE) comes back under that name, fp32 ``[head_dim / 2]``.

    Args:
        config: ``hf_config_dict(f)`` (head counts for the permutation).
    """
    permuted = f.architecture == "llama"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name in f.tensors:
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{f.path}: tensor {name!r} has no counterpart in the model")
        t = f.tensor(name)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            n = heads if ".attn_q." in name else kv_heads
            t = _gather_rows(t, unpermute_rows(t.shape[0], n))
        weights[target] = t
    return weights
