"""Checks ``aioengine serve`` (and ``generate``, ``chat``) runs before any heavy
work, so a bad start ends in well under a second with one line on stderr and
exit code 1.

What is checked, each from cheap reads only (no torch, no transformers, no
weights): the model file is a readable regular file, a GGUF file whose
header, metadata and tensor table parse and whose tensor data the file
holds in full (a truncated download), or an HF folder's config.json beside
its ``*.safetensors`` files; its architecture is one our model code
implements and it carries a tokenizer; ``--max-model-len`` is within the
model's context length; the KV cache memory holds at least
two blocks of this model and fits in the memory the machine has free; and
the listening address is free (the socket is bound here and handed to
uvicorn, so nothing can take the port while the model loads).

Every failure is a ``StartupError`` whose message is the line the user sees.

The GGUF header is read here with ``struct`` instead of ``gguf.GGUFReader``:
the reader builds numpy views of every vocabulary string (49k tokens and 49k
merges in the default model) and takes seconds; this reads the same layout
(GGUF v2/v3, github.com/ggml-org/ggml/blob/master/docs/gguf.md) in tens of
milliseconds and skips the arrays.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import mmap
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aioengine.models import registry

# HF model types and GGUF architectures the model registry implements (torch-free).
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(registry.SUPPORTED_MODEL_TYPES
                                              + registry.SUPPORTED_GGUF_ARCHITECTURES))
MIN_KV_BLOCKS = 2  # ModelRunner refuses fewer

_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format of a scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 4,  # auto: at most fp32
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


class StartupError(Exception):
    """A start that cannot succeed; the message is the one line shown to the user."""


@dataclass
class ModelShape:
    """What the checks need of a model: its architecture, KV cache geometry and
    context length (tokens; None where the model file does not say)."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int | None = None

    def kv_bytes_per_block(self, block_size: int, dtype: str, tp: int = 1,
                           kv_cache_dtype: str = "auto") -> int:
        """Bytes of one KV block on one rank (K and V of every layer), as the worker sizes
        it: elements of ``kv_cache_dtype``, or of the activations' ``dtype`` under ``auto``."""
        element = _DTYPE_BYTES[dtype if kv_cache_dtype == "auto" else kv_cache_dtype]
        return (self.num_layers * 2 * block_size * max(1, self.num_kv_heads // tp)
                * self.head_dim * element)


@dataclass
class GGUFHeader:
    """The parts of a GGUF file's header the checks read.

    Attributes:
        metadata: scalar and string values by key (arrays are skipped: None).
        data_end: byte offset where the last tensor's data ends (what the
            file's size must reach).
    """

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    num_tensors: int = 0
    data_end: int = 0


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, what: str) -> None:
        self.buf, self.pos, self.what = buf, 0, what

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise StartupError(f"{self.what} is truncated: its header ends at byte "
                               f"{len(self.buf)} (re-download or re-convert it)")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            self.take(f"{len(self.buf)}x")  # raises "truncated"
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def skip_array(self) -> None:
        item_type, count = self.take("I"), self.take("Q")
        if item_type == _STRING:
            for _ in range(count):
                n = self.take("Q")  # the length prefix, then skip the bytes
                self.pos += n
                if self.pos > len(self.buf):
                    self.take("B")
        elif item_type in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item_type])
            if self.pos > len(self.buf):
                self.take("B")
        elif item_type == _ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            raise StartupError(f"{self.what} is not a valid GGUF file (unknown metadata "
                               f"type {item_type})")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            self.skip_array()
            return None
        if value_type not in _SCALARS:
            raise StartupError(f"{self.what} is not a valid GGUF file (unknown metadata "
                               f"type {value_type})")
        return self.take(_SCALARS[value_type])


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's header, metadata and tensor table (not the tensor data).

    Raises:
        StartupError: unreadable, not GGUF, truncated, or a tensor of a type
            this ``gguf`` package does not know.
    """
    what = f"model file {path}"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise StartupError(f"{what} is not a GGUF file ({size} bytes)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except PermissionError:
        raise StartupError(f"cannot read {what}: permission denied") from None
    except OSError as exc:
        raise StartupError(f"cannot read {what}: {exc.strerror or exc}") from None
    with buf:
        if buf[:4] != _GGUF_MAGIC:
            raise StartupError(f"{what} is not a GGUF file (it starts with "
                               f"{bytes(buf[:4])!r}, not b'GGUF')")
        r = _Reader(buf, what)
        r.pos = 4
        version = r.take("I")
        if version not in (2, 3):
            raise StartupError(f"{what} is GGUF version {version}; versions 2 and 3 are "
                               f"supported")
        num_tensors, num_kv = r.take("Q"), r.take("Q")
        header = GGUFHeader(version, num_tensors=num_tensors)
        for _ in range(num_kv):
            key = r.string()
            header.metadata[key] = r.value(r.take("I"))
        quant_sizes = _ggml_quant_sizes()
        ends = []
        for _ in range(num_tensors):
            name = r.string()
            n_dims = r.take("I")
            dims = [r.take("Q") for _ in range(n_dims)]
            ggml_type, offset = r.take("I"), r.take("Q")
            try:
                block, type_size = quant_sizes[ggml_type]
            except KeyError:
                raise StartupError(f"{what}: tensor {name} has unknown GGML type "
                                   f"{ggml_type}") from None
            numel = 1
            for d in dims:
                numel *= d
            ends.append(offset + numel // block * type_size)
        alignment = header.metadata.get("general.alignment") or 32
        data_start = -(-r.pos // alignment) * alignment
        header.data_end = data_start + max(ends, default=0)
        if header.data_end > size:
            raise StartupError(f"{what} is truncated: {size} bytes, but its tensors need "
                               f"{header.data_end} (re-download it)")
    return header


def _ggml_quant_sizes() -> dict[int, tuple[int, int]]:
    """GGML type id -> (elements per block, bytes per block), from ``gguf.constants``.

    That module needs only ``enum``; loaded from its file it spares importing
    the ``gguf`` package (numpy and the rest: half a second, more on a busy
    machine), which matters for a check meant to answer at once.
    """
    spec = importlib.util.find_spec("gguf")
    locations = list(spec.submodule_search_locations or []) if spec else []
    constants = None
    for location in locations:
        path = Path(location) / "constants.py"
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location("_aioengine_gguf_constants", path)
            if file_spec is not None and file_spec.loader is not None:
                constants = importlib.util.module_from_spec(file_spec)
                file_spec.loader.exec_module(constants)
                break
    if constants is None:
        import gguf.constants as constants
    return {int(t): sizes for t, sizes in constants.GGML_QUANT_SIZES.items()}


def gguf_shape(header: GGUFHeader, path: str | Path) -> ModelShape:
    """The architecture, KV geometry and context length from GGUF metadata
    (``{arch}.block_count`` ...; ``{arch}.context_length``, 2048 where absent, as
    ``gguf_loader`` reads it)."""
    m = header.metadata
    arch = m.get("general.architecture")
    if not isinstance(arch, str):
        raise StartupError(f"model file {path} has no general.architecture")
    try:
        num_heads = int(m[f"{arch}.attention.head_count"])
        shape = ModelShape(arch, int(m[f"{arch}.block_count"]),
                           int(m.get(f"{arch}.attention.head_count_kv") or num_heads),
                           int(m.get(f"{arch}.attention.key_length")
                               or m[f"{arch}.embedding_length"] // num_heads),
                           int(m.get(f"{arch}.context_length") or 2048))
    except (KeyError, TypeError, ZeroDivisionError):
        # Not one of ours anyway: the architecture check names the real problem.
        shape = ModelShape(arch, 0, 0, 0)
    return shape


def hf_shape(folder: str | Path) -> ModelShape:
    """The architecture, KV geometry and context length (``max_position_embeddings``;
    None where config.json has none: transformers' default differs by model type)
    from an HF folder's config.json."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except PermissionError:
        raise StartupError(f"cannot read {path}: permission denied") from None
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise StartupError(f"{path} is not a JSON object")
    arch = str(config.get("model_type", ""))
    try:
        num_heads = int(config["num_attention_heads"])
        shape = ModelShape(arch, int(config["num_hidden_layers"]),
                           int(config.get("num_key_value_heads") or num_heads),
                           int(config.get("head_dim") or config["hidden_size"] // num_heads),
                           int(config["max_position_embeddings"])
                           if config.get("max_position_embeddings") else None)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        shape = ModelShape(arch, 0, 0, 0)
    return shape


def check_model(config: Any) -> ModelShape:
    """Check ``config``'s model file and KV cache sizing (an ``EngineConfig``).

    Raises:
        StartupError: see the module docstring.
    """
    model_path = Path(config.model.model_path)
    if config.model.is_gguf:
        if not model_path.is_file():
            raise StartupError(f"model file {model_path} is not a regular file")
        header = read_gguf_header(model_path)
        shape = gguf_shape(header, model_path)
        if shape.architecture in SUPPORTED_ARCHITECTURES and \
                not header.metadata.get("tokenizer.ggml.model"):
            raise StartupError(f"model file {model_path} has no tokenizer "
                               f"(tokenizer.ggml.model); convert it with its tokenizer")
    else:
        shape = hf_shape(model_path)
    if shape.architecture not in SUPPORTED_ARCHITECTURES:
        raise StartupError(f"model {model_path} has architecture {shape.architecture!r}, "
                           f"which aioengine does not implement (supported: "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    if shape.num_layers <= 0 or shape.num_kv_heads <= 0 or shape.head_dim <= 0:
        raise StartupError(f"model {model_path} lacks its layer or attention-head counts")
    if not config.model.is_gguf and not any(model_path.glob("*.safetensors")):
        raise StartupError(f"no *.safetensors files in {model_path}")  # the loader's words
    requested = config.model.max_model_len
    if requested and shape.context_length and requested > shape.context_length:
        raise StartupError(f"--max-model-len {requested} exceeds the model's context length "
                           f"of {shape.context_length} tokens (0 takes the model's own)")
    cache = config.cache
    per_block = shape.kv_bytes_per_block(cache.block_size, config.model.dtype,
                                         config.parallel.tensor_parallel_size,
                                         cache.kv_cache_dtype)
    if cache.num_gpu_blocks_override is not None:
        kv_bytes, flag = cache.num_gpu_blocks_override * per_block, "--num-gpu-blocks-override"
    else:
        kv_bytes, flag = cache.kv_cache_memory_bytes, "--kv-cache-memory"
        blocks = kv_bytes // per_block
        if blocks < MIN_KV_BLOCKS:
            need = MIN_KV_BLOCKS * per_block / (1 << 20)
            raise StartupError(
                f"--kv-cache-memory {kv_bytes / (1 << 30):.3g} GiB holds {blocks} KV "
                f"block(s) of this model; at least {MIN_KV_BLOCKS} are needed ({need:.1f} "
                f"MiB; 1 GiB holds {(1 << 30) // per_block})")
    # Every worker holds its own: each tensor-parallel rank of each replica on this node.
    p = config.parallel
    workers = p.tensor_parallel_size // p.nnodes * p.data_parallel_size
    available = available_memory_bytes()
    if available is not None and kv_bytes * workers > available:
        each = (f" per worker ({workers} workers: {kv_bytes * workers / (1 << 30):.3g} GiB)"
                if workers > 1 else "")
        raise StartupError(
            f"{flag}: a KV cache of {kv_bytes / (1 << 30):.3g} GiB{each} is more than the "
            f"{available / (1 << 30):.1f} GiB of memory this machine has free")
    return shape


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (as uvicorn binds it).

    Raises:
        StartupError: the address is in use, not this machine's, or invalid.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock.bind((host, port))
    except OverflowError:
        sock.close()
        raise StartupError(f"--port {port} is not a TCP port (0-65535)") from None
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        hint = (" (another server is listening there: stop it or pick another --port)"
                if exc.errno == errno.EADDRINUSE else "")
        raise StartupError(f"cannot listen on {where}: {reason}{hint}") from None
    return sock
