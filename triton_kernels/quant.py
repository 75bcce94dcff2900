"""Weights stored in GGML block formats (GGUF), used without dequantizing them first.

A ``QuantizedWeight`` is a linear layer's weight ``[rows, cols]`` (``[out_features,
in_features]``) kept in the byte layout of a GGUF file: each row is ``cols /
block_size`` blocks of the format, rows back to back, so ``data`` is a uint8 tensor
``[rows, row_bytes]`` that may be a view of the memory-mapped file itself. Formats are
``gguf.GGMLQuantizationType`` values; block layouts are llama.cpp's
(``ggml/src/ggml-common.h``; the ``gguf`` package's ``quants.py`` is their Python twin).

The model calls only ``linear``, ``argmax_linear`` (the greedy LM head), ``embedding``,
``fuse_rows`` and ``pack_amx_tiles`` (the LM head's weight decoded once for AMX); each
runs the C++ kernels (``csrc/quant_ops.cpp``) on fp32 CPU activations when they are built
(``cpu_ops.load()``), Triton on CUDA (``quant_triton.dequant_matmul``),
and the dequantize-then-``F.linear`` torch path (``quant_reference``) otherwise
(``argmax_linear`` returns None there: the caller takes the logits' argmax).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from . import cpu_ops, quant_reference

__all__ = [
    "SUPPORTED_QTYPES",
    "GGMLQuantizationType",
    "QuantizedWeight",
    "Weight",
    "argmax_linear",
    "embedding",
    "fuse_rows",
    "linear",
    "pack_amx_tiles",
    "packed_lm_head_requested",
]

QT = GGMLQuantizationType
#: Formats the kernels read directly. F32 tensors are plain fp32 tensors, never wrapped.
SUPPORTED_QTYPES: tuple[GGMLQuantizationType, ...] = (
    QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16, QT.BF16)


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[rows, cols]`` weight in one GGML block format.

    Attributes:
        data: uint8 ``[rows, row_bytes]``, C-contiguous, ``row_bytes = cols //
            block_size * type_size`` (``gguf.GGML_QUANT_SIZES``).
        qtype: the block format.
        shape: logical ``(rows, cols)``, i.e. ``(out_features, in_features)``.

    Raises:
        ValueError: unsupported format, ``cols`` not a multiple of the block size, or
            ``data`` of the wrong dtype or shape.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        qtype = GGMLQuantizationType(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        if qtype not in SUPPORTED_QTYPES:
            raise ValueError(f"GGML type {qtype.name} is not supported; supported: "
                             f"{', '.join(t.name for t in SUPPORTED_QTYPES)}")
        rows, cols = (int(s) for s in self.shape)
        object.__setattr__(self, "shape", (rows, cols))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if cols % block_size:
            raise ValueError(f"{qtype.name} needs cols divisible by {block_size}, got {cols}")
        row_bytes = cols // block_size * type_size
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (rows, row_bytes):
            raise ValueError(f"{qtype.name} weight {rows}x{cols} needs uint8 data "
                             f"[{rows}, {row_bytes}], got {self.data.dtype} "
                             f"{list(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes of ``data``."""
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense ``[rows, cols]`` tensor on ``data``'s device, through
        ``quant_reference`` (bit-exact with ``gguf.quants.dequantize`` in fp32)."""
        return quant_reference.dequantize(self.data, self.qtype).to(dtype)

    def slice_rows(self, start: int, stop: int) -> QuantizedWeight:
        """Rows ``[start, stop)`` (a view of ``data``)."""
        return QuantizedWeight(self.data[start:stop], self.qtype, (stop - start, self.shape[1]))

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: GGMLQuantizationType) -> QuantizedWeight:
        """Quantize a dense ``[rows, cols]`` weight with the ``gguf`` package's quantizers
        (llama.cpp's reference rounding). Used for ``--quantization`` and test models.

        Raises:
            NotImplementedError: the package has no quantizer for ``qtype`` (the K-quants).
        """
        rows, cols = weight.shape
        array = weight.detach().float().cpu().numpy()
        data = gguf_quants.quantize(array, GGMLQuantizationType(qtype))  # F16/BF16 too
        data = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
        return cls(torch.from_numpy(data), qtype, (rows, cols))


#: What a linear layer's weight may be: dense ``[rows, cols]``, one quantized matrix,
#: or parts whose outputs are concatenated (Q/K/V of different formats, say).
Weight = torch.Tensor | QuantizedWeight | tuple


def fuse_rows(parts: Sequence[torch.Tensor | QuantizedWeight]) -> Weight:
    """One weight whose output is the parts' outputs side by side (fused QKV, gate/up).

    Dense parts are concatenated, quantized parts of one format have their rows
    concatenated (bytes, no re-quantization), and a mix stays a tuple of parts.

    Raises:
        ValueError: parts with different ``cols``.
    """
    parts = list(parts)
    if len({_shape(p)[1] for p in parts}) != 1:
        raise ValueError(f"fuse_rows: parts have different cols: {[_shape(p) for p in parts]}")
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({p.qtype for p in parts}) == 1:
        rows = sum(p.shape[0] for p in parts)
        return QuantizedWeight(torch.cat([p.data for p in parts]), parts[0].qtype,
                               (rows, parts[0].shape[1]))
    return tuple(parts)


def _shape(w: Weight) -> tuple[int, int]:
    if isinstance(w, tuple):
        return sum(_shape(p)[0] for p in w), _shape(w[0])[1]
    return tuple(w.shape)


def packed_lm_head_requested() -> bool:
    """``AIOENGINE_PACKED_LM_HEAD=1`` (default off): whether the model decodes its LM head's
    weight once into AMX bf16 tiles (``pack_amx_tiles``) where the quantized GEMM runs on
    AMX in bf16 (``cpu_ops.amx_requested`` and ``bf16_gemm_requested``), trading 2 bytes a
    parameter of memory (56.6 MB for SmolLM2-135M's 49,152 x 576 head) for a step that
    loads the tiles instead of decoding the Q8_0 blocks every time. Off by default: in
    the engine's step the head is read from DRAM after the layers, and twice the bytes
    cost about what the decode saves (32 rows, 2 threads: 2.9 against 3.1 ms; the head
    alone, warm in L3: 1.4 against 2.3 ms; bench/README.md)."""
    return os.environ.get("AIOENGINE_PACKED_LM_HEAD", "0").strip().lower() in (
        "1", "true", "yes", "on")


#: Formats whose blocks of 32 values ``pack_amx_tiles`` decodes.
_AMX_PACK_QTYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)


def pack_amx_tiles(weight: Weight) -> torch.Tensor | None:
    """``weight`` decoded once into the bf16 A tiles of the C++ AMX GEMM
    (``csrc/quant_ops.h`` ``quant_amx_pack``; ``csrc/quant_amx.h``): int16 (bf16 bits)
    ``[ceil(rows / 32), cols / 32, 32, 32]``, per 32 weight rows and 32-value chunk of K
    the chunk's rows, zeros past the last row. ``linear`` and ``argmax_linear`` given them
    (``amx_tiles=``) load the tiles where the GEMM runs on AMX in bf16 (9+ rows of x)
    instead of decoding the blocks each call; the values are the ones that decode makes,
    so the outputs are bit for bit the same (tests/test_quant_argmax.py).

    Args:
        weight: a ``QuantizedWeight`` in Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 on the CPU.

    Returns:
        The tiles (2 bytes a parameter), or None where they would not be used: another
        weight or format, no C++ build, a CPU without AMX-BF16.
    """
    if (not isinstance(weight, QuantizedWeight) or weight.qtype not in _AMX_PACK_QTYPES
            or weight.device.type != "cpu" or weight.shape[0] == 0):
        return None
    ops = cpu_ops.load()
    if ops is None or ops.quant_isa() != 3:  # 3: AMX (resolve_isa)
        return None
    return ops.quant_amx_pack(weight.data, int(weight.qtype), weight.shape[1])


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, *,
           amx_tiles: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``.

    fp32 CPU activations with CPU weights go to the C++ kernels (GEMV up to 8 rows, a
    tile-buffered GEMM above; ``csrc/quant_ops.h``), CUDA ones to
    ``quant_triton.dequant_matmul``; anything else (other dtypes, activations that need
    gradients, no C++ build) dequantizes with ``quant_reference`` and calls ``F.linear``.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]`` dense, quantized, or a tuple of parts (``fuse_rows``).
        bias: ``[N]`` or None.
        amx_tiles: ``pack_amx_tiles(weight)`` or None: the AMX GEMM loads them instead of
            decoding the weight (same output bit for bit).

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight.to(x.dtype), bias)
    if x.device.type == "cuda":
        return _cuda_linear(x, weight, bias)
    out = _cpu_linear(x, weight, bias, amx_tiles)
    if out is not None:
        return out
    if isinstance(weight, tuple):
        out = torch.cat([linear(x, part) for part in weight], dim=-1)
        return out if bias is None else out + bias
    return F.linear(x, weight.dequantize(x.dtype), bias)


def _cpu_kernel_operands(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None):
    """``(ops, parts, qtypes, cols, rows)`` for the C++ quantized kernels, or None where
    they do not apply: activations other than fp32 CPU or needing gradients, a bias
    that is not a plain fp32 CPU vector, no C++ build, a weight it cannot take, or
    ``cols``/bias length not matching ``x``."""
    if (x.dtype != torch.float32 or x.device.type != "cpu"
            or (x.requires_grad and torch.is_grad_enabled())):
        return None
    if bias is not None and not (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                 and bias.dim() == 1 and not bias.requires_grad):
        return None
    ops = cpu_ops.load()
    spec = cpu_ops.weight_parts(weight) if ops is not None else None
    if spec is None:
        return None
    parts, qtypes, cols = spec
    rows = sum(p.shape[0] for p in parts)
    if cols != x.shape[-1] or (bias is not None and bias.shape[0] != rows):
        return None
    return ops, parts, qtypes, cols, rows


def _cpu_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None,
                amx_tiles: torch.Tensor | None = None):
    """The C++ path, or None where it does not apply."""
    kernel = _cpu_kernel_operands(x, weight, bias)
    if kernel is None or kernel[3] == 0:
        return None  # let the torch path raise its usual shape error
    ops, parts, qtypes, cols, rows = kernel
    x2 = x if x.dim() == 2 else x.reshape(-1, cols)
    if x2.stride(-1) != 1 or x2.is_neg():
        x2 = x2.contiguous()
    b = None if bias is None else bias.contiguous()
    if amx_tiles is not None and len(parts) == 1:
        out = ops.quant_linear_packed(x2, parts[0], qtypes[0], cols, amx_tiles, b)
    else:
        out = ops.quant_linear(x2, parts, qtypes, cols, b)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], rows)


def argmax_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, *,
                  amx_tiles: torch.Tensor | None = None) -> torch.Tensor | None:
    """``linear(x, weight, bias).argmax(-1)`` without the ``[M, N]`` output: the greedy LM
    head. The C++ kernel computes the same tiles with the same sums as ``linear`` and keeps
    only each row's running maximum and its index (``csrc/quant_ops.h``,
    ``quant_linear_argmax_into``), so the result is ``linear``'s argmax token for token:
    the first index among equal maxima, NaN counted as the largest, as ``torch.argmax``.

    Args:
        x: ``[M, K]`` fp32 CPU activations.
        weight: ``[N, K]`` quantized, or a tuple of parts (``fuse_rows``); dense
            ``[N, K]`` fp32 weights go through ``F.linear`` elsewhere, so they return None.
        bias: ``[N]`` or None.
        amx_tiles: ``pack_amx_tiles(weight)`` or None, as for ``linear``.

    Returns:
        ``[M]`` int64 indices, or None where the kernel does not apply (a dense weight,
        another dtype or device, activations that need gradients, no C++ build, shapes
        that do not fit): the caller computes the logits instead.
    """
    if isinstance(weight, torch.Tensor) or x.dim() != 2 or x.shape[0] == 0:
        return None
    kernel = _cpu_kernel_operands(x, weight, bias)
    if kernel is None or kernel[4] == 0:
        return None
    ops, parts, qtypes, cols, _ = kernel
    if x.stride(-1) != 1 or x.is_neg():
        x = x.contiguous()
    b = None if bias is None else bias.contiguous()
    if amx_tiles is not None and len(parts) == 1:
        return ops.quant_linear_packed(x, parts[0], qtypes[0], cols, amx_tiles, b, argmax=True)
    return ops.quant_linear_argmax(x, parts, qtypes, cols, b)


def _cuda_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    from .quant_triton import dequant_matmul  # written beside this module; CUDA only

    if isinstance(weight, tuple):
        out = torch.cat([_cuda_linear(x, part, None) for part in weight], dim=-1)
        return out if bias is None else out + bias
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight.to(x.dtype), bias)
    out = dequant_matmul(x.reshape(-1, x.shape[-1]), weight.data, weight.qtype, weight.shape,
                         bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape ``[...]``) of an embedding table ``[vocab, hidden]``
    as fp32 ``[..., hidden]``; only those rows are dequantized (in C++ on the CPU when the
    kernels are built).

    Raises:
        IndexError or RuntimeError: an id outside ``[0, vocab)``.
    """
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    cols = weight.shape[1]
    ops = cpu_ops.load() if weight.data.device.type == "cpu" else None
    if ops is not None:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        return ops.quant_embedding(flat, weight.data, int(weight.qtype), cols).reshape(
            *ids.shape, cols)
    rows = weight.data[ids.reshape(-1)]
    return quant_reference.dequantize(rows, weight.qtype).reshape(*ids.shape, cols)
