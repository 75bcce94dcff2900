"""The GGUF file format: header (metadata, tensor table) parsed without reading tensor data.

A GGUF file (llama.cpp, ``ggml/docs/gguf.md``) is a little-endian header, then the tensor
data: ``magic "GGUF", version u32, tensor_count u64, kv_count u64``, ``kv_count``
key/value pairs, ``tensor_count`` tensor infos (name, dims fastest-first, GGML type,
offset into the data section), padding to ``general.alignment`` (32 by default), data.

The header is parsed here with ``struct`` straight off a memory map. ``gguf.GGUFReader``
(the reference this is tested against, field by field and tensor by tensor) builds a
numpy view for every element of every metadata array: 2.8 s for the default model's
147k tokenizer entries, every time a process opens the file. This reader takes about
40 ms with the string arrays skipped (the worker never needs the vocabulary) and keeps
``gguf``'s own enums and block sizes. It imports no torch, so the engine process can
check a file before it starts a worker.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

QT = GGMLQuantizationType
#: Types a tensor may be stored in: plain fp32 and the formats the kernels run
#: (``triton_kernels.quant.SUPPORTED_QTYPES``, which imports torch; a test holds the two
#: equal).
SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = (
    QT.F32, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16,
    QT.BF16)

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # v1 had 32-bit counts; llama.cpp itself dropped it in 2023
_MAX_DIMS = 4            # GGML_MAX_DIMS
# GGUFValueType id -> struct format of the fixed-size scalar types.
_SCALAR_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                  11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


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
    """A parsed GGUF header; tensor data stays on disk (``gguf_loader.map_tensor``).

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
    def mapping(self) -> mmap.mmap:
        # One private (copy-on-write) mapping per file object, shared by all its tensors: torch
        # keeps it alive through every view, and writable pages spare torch's warning about
        # read-only buffers while the file itself can never be written.
        if not self._mapping:
            with open(self.path, "rb") as f:
                self._mapping.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        return self._mapping[0]


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


def checked_type(path: str, info: GGUFTensorInfo) -> GGMLQuantizationType:
    """The tensor's type. Raises ValueError naming tensor and type when the kernels do not
    run it (IQ*, Q2_K, Q3_K, Q8_1 ...)."""
    try:
        qtype = info.qtype
    except ValueError:
        qtype = None
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {info.name!r} is stored as {info.type_name}, which "
                         f"aioengine cannot run; supported: {_type_list()}")
    return qtype
