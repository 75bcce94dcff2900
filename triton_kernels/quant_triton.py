"""Triton kernels for weights in GGML block formats: dequantize, and a dequantizing matmul.

A weight ``[N, K]`` (``[out_features, in_features]``) is stored as GGUF stores it: row
``n`` is ``K / QK`` blocks of ``TYPE_SIZE`` bytes each, rows back to back, so ``data``
is a uint8 tensor ``[N, K / QK * TYPE_SIZE]`` (``triton_kernels.quant.QuantizedWeight``).
Block layouts are llama.cpp's (``ggml/src/ggml-common.h``: ``block_q8_0``,
``block_q4_0``, ``block_q4_1``, ``block_q5_0``, ``block_q5_1``, ``block_q4_K``,
``block_q5_K``, ``block_q6_K``), decoded as ``dequantize_row_*`` in
``ggml/src/ggml-quants.c`` and the ``gguf`` package's ``quants.py`` do.

- ``_dequant_elements``: the one place that knows the layouts. Given, for each element,
  a pointer to its block and its index inside the block, it loads the bytes it needs
  (scale, min, packed sub-block scales, nibble, high bit) and returns the fp32 value.
  Being elementwise it works on tiles of any shape and orientation; the products it
  forms (fp16 scale x small integers) are exact in fp32, so the values are bit-exact
  with the reference whatever the compiler fuses into FMAs.
- ``_dequantize_kernel``: ``[BLOCK_N, BLOCK_K]`` tiles of the dense weight, written out
  (for prefill-sized M: dequantize once, then cuBLAS).
- ``_dequant_matmul_kernel``: ``y = x @ W.T (+ bias)`` with tiles ``BLOCK_M x BLOCK_N``
  over ``BLOCK_K`` steps (a multiple of the block size): each step loads an ``x`` tile,
  decodes the ``[BLOCK_K, BLOCK_N]`` weight tile in registers from the packed bytes
  and feeds ``tl.dot`` (fp32 accumulation), so the weight crosses memory once, packed.
  Programs are ordered in groups of ``GROUP_M`` row tiles as in the Triton matmul
  tutorial, so neighbouring programs share weight tiles in L2.

Torch twin: ``QuantizedWeight.dequantize`` (``gguf.quants.dequantize``) and ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["SUPPORTED_QTYPES", "dequant_matmul", "dequantize"]

QT = GGMLQuantizationType
#: Formats these kernels read (F32 weights are plain tensors: use ``F.linear``).
SUPPORTED_QTYPES: tuple[GGMLQuantizationType, ...] = (
    QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16, QT.BF16)
_K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)

# ggml type ids as compile-time constants for the QTYPE branches.
F16: tl.constexpr = tl.constexpr(int(QT.F16))
BF16: tl.constexpr = tl.constexpr(int(QT.BF16))
Q4_0: tl.constexpr = tl.constexpr(int(QT.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(QT.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(QT.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(QT.Q5_1))
Q8_0: tl.constexpr = tl.constexpr(int(QT.Q8_0))
Q4_K: tl.constexpr = tl.constexpr(int(QT.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(QT.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(QT.Q6_K))


@triton.jit
def _load_u8(ptr, mask):
    """Bytes at ``ptr`` as int32 (0 where masked)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _load_f16(ptr, mask):
    """The little-endian fp16 at ``ptr``, as fp32. Loaded byte by byte: a legacy block
    (18, 20, 22 bytes) puts its fields at any offset, and rows may be sliced views."""
    bits = _load_u8(ptr, mask) | (_load_u8(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(ptr, shift, mask):
    """``(byte >> shift) & 0xF`` of the byte at ``ptr``, as int32."""
    return (_load_u8(ptr, mask) >> shift) & 0xF


@triton.jit
def _k_scale_min(scales_ptr, sub, mask):
    """6-bit scale and min of sub-block ``sub`` (0..7) of a Q4_K/Q5_K super-block, from
    its 12 packed bytes (llama.cpp ``get_scale_min_k4``): sub-blocks 0-3 keep theirs in
    the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 take their low 4
    bits from byte 8-11's two nibbles and their top 2 from the spare bits of bytes 0-7."""
    t = sub % 4
    a = _load_u8(scales_ptr + t, mask)
    b = _load_u8(scales_ptr + 4 + t, mask)
    c = _load_u8(scales_ptr + 8 + t, mask)
    low = sub < 4
    scale = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
    minimum = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _dequant_elements(block_ptr, j, mask, QTYPE: tl.constexpr):
    """fp32 values of elements ``j`` (int32, 0 <= j < block size) of the blocks that
    start at ``block_ptr`` (uint8 pointers). Any shape; ``j`` broadcasts against
    ``block_ptr``; masked elements read no memory and come out 0.

    Field offsets in bytes, as in llama.cpp's ``block_*`` structs (d, dmin: fp16):
    Q8_0 {d, qs[32] int8}; Q4_0 {d, qs[16]}; Q4_1 {d, m, qs[16]}; Q5_0 {d, qh u32, qs[16]};
    Q5_1 {d, m, qh u32, qs[16]} (element j: low nibble of qs[j] for j < 16, high
    nibble of qs[j - 16] after; fifth bit: bit j of qh); Q4_K {d, dmin, scales[12],
    qs[128]}; Q5_K {d, dmin, scales[12], qh[32], qs[128]}; Q6_K {ql[128], qh[64],
    scales[16] int8, d}; F16/BF16: one 2-byte element per "block".
    """
    if QTYPE == Q8_0:
        d = _load_f16(block_ptr, mask)
        q = tl.load(block_ptr + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * d
    elif QTYPE == Q4_0:
        d = _load_f16(block_ptr, mask)
        q = _nibble(block_ptr + 2 + j % 16, (j // 16) * 4, mask)
        w = (q - 8).to(tl.float32) * d
    elif QTYPE == Q4_1:
        d = _load_f16(block_ptr, mask)
        m = _load_f16(block_ptr + 2, mask)
        q = _nibble(block_ptr + 4 + j % 16, (j // 16) * 4, mask)
        w = d * q.to(tl.float32) + m
    elif QTYPE == Q5_0:
        d = _load_f16(block_ptr, mask)
        high = (_load_u8(block_ptr + 2 + j // 8, mask) >> (j % 8)) & 1
        q = _nibble(block_ptr + 6 + j % 16, (j // 16) * 4, mask) | (high << 4)
        w = (q - 16).to(tl.float32) * d
    elif QTYPE == Q5_1:
        d = _load_f16(block_ptr, mask)
        m = _load_f16(block_ptr + 2, mask)
        high = (_load_u8(block_ptr + 4 + j // 8, mask) >> (j % 8)) & 1
        q = _nibble(block_ptr + 8 + j % 16, (j // 16) * 4, mask) | (high << 4)
        w = d * q.to(tl.float32) + m
    elif QTYPE == Q4_K:
        # 8 sub-blocks of 32; qs byte i of 64-element chunk c holds elements c*64 + i
        # (low nibble) and c*64 + 32 + i (high nibble).
        sub = j // 32
        d = _load_f16(block_ptr, mask)
        dmin = _load_f16(block_ptr + 2, mask)
        scale, minimum = _k_scale_min(block_ptr + 4, sub, mask)
        q = _nibble(block_ptr + 16 + (j // 64) * 32 + j % 32, (sub % 2) * 4, mask)
        w = (d * scale) * q.to(tl.float32) - dmin * minimum
    elif QTYPE == Q5_K:
        # As Q4_K, plus a fifth bit: bit `sub` of qh[j % 32].
        sub = j // 32
        d = _load_f16(block_ptr, mask)
        dmin = _load_f16(block_ptr + 2, mask)
        scale, minimum = _k_scale_min(block_ptr + 4, sub, mask)
        high = (_load_u8(block_ptr + 16 + j % 32, mask) >> sub) & 1
        q = _nibble(block_ptr + 48 + (j // 64) * 32 + j % 32, (sub % 2) * 4, mask)
        q = q | (high << 4)
        w = (d * scale) * q.to(tl.float32) - dmin * minimum
    elif QTYPE == Q6_K:
        # Two halves of 128; in half h, element r takes a nibble of ql[h*64 + r % 64]
        # (low for r < 64) and 2 bits of qh[h*32 + r % 32] (pair r // 32); an int8
        # scale per 16 elements.
        half = j // 128
        r = j % 128
        low = _nibble(block_ptr + half * 64 + r % 64, (r // 64) * 4, mask)
        high = (_load_u8(block_ptr + 128 + half * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        q = (low | (high << 4)) - 32
        scale = tl.load(block_ptr + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _load_f16(block_ptr + 208, mask)
        w = (d * scale.to(tl.float32)) * q.to(tl.float32)
    elif QTYPE == F16:
        w = _load_f16(block_ptr + j, mask)
    else:
        tl.static_assert(QTYPE == BF16, "unsupported GGML type")
        bits = (_load_u8(block_ptr + j, mask) | (_load_u8(block_ptr + j + 1, mask) << 8))
        w = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return w


@triton.jit
def _dequantize_kernel(
    w_ptr, out_ptr, N, K, stride_wn, stride_on,
    QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); one [BLOCK_N, BLOCK_K] tile each.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    block_ptr = w_ptr + rows * stride_wn + ((offs_k // QK) * TYPE_SIZE)[None, :]
    w = _dequant_elements(block_ptr, (offs_k % QK)[None, :], mask, QTYPE)
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_ym,
    QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # 1D grid in grouped order (Triton matmul tutorial): GROUP_M row tiles walk the
    # column tiles together, so a weight tile is reused from L2 by GROUP_M programs.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_kb[None, :] * stride_xk
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + offs_kb
        mask_k = offs_k < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # The transposed weight tile [BLOCK_K, BLOCK_N], decoded from its packed bytes.
        block_ptr = w_rows + ((offs_k // QK) * TYPE_SIZE)[:, None]
        w = _dequant_elements(block_ptr, (offs_k % QK)[:, None],
                              mask_k[:, None] & mask_n[None, :], QTYPE)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Kernels built while TRITON_INTERPRET=1 run on CPU tensors in Triton's interpreter.
_INTERPRETED = not isinstance(_dequant_matmul_kernel, triton.runtime.JITFunction)

#: From this many rows of ``x`` on, ``dequant_matmul`` dequantizes the weight once and
#: calls cuBLAS (``F.linear``): the fused kernel decodes every weight tile once per
#: ``BLOCK_M`` rows, which stops paying once the matmul is compute-bound. vLLM's GGUF
#: path makes the same switch; this value is a first guess, not tuned on a GPU.
DEQUANT_THEN_GEMM_MIN_M = 64

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"unknown GGML type {qtype!r}") from None
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"GGML type {qtype.name} is not supported by the Triton kernels; "
                         f"supported: {', '.join(t.name for t in SUPPORTED_QTYPES)}")
    return qtype


def _check_weight(data: torch.Tensor, qtype: GGMLQuantizationType | int,
                  shape: tuple[int, int]) -> tuple[GGMLQuantizationType, int, int, int, int]:
    """(qtype, N, K, block size, type size) after checking ``data`` against them."""
    qtype = _check_qtype(qtype)
    if len(shape) != 2:
        raise ValueError(f"shape must be (rows, cols), got {tuple(shape)}")
    n, k = (int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n < 0 or k < 0 or k % block_size:
        raise ValueError(f"{qtype.name} needs cols divisible by {block_size}, got shape "
                         f"{(n, k)}")
    row_bytes = k // block_size * type_size
    if data.dtype != torch.uint8 or data.dim() != 2 or tuple(data.shape) != (n, row_bytes):
        raise ValueError(f"{qtype.name} weight {n}x{k} needs uint8 data [{n}, {row_bytes}], "
                         f"got {data.dtype} {list(data.shape)}")
    # Blocks are read as bytes within a row; rows may be a sliced view of a larger tensor.
    if data.stride(1) != 1 and row_bytes > 1:
        raise ValueError(f"data must have stride 1 within a row, got strides {data.stride()}")
    return qtype, n, k, block_size, type_size


def _check_device(data: torch.Tensor) -> None:
    # Checked after every other argument, so the argument errors can be tested on CPU.
    if data.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"the Triton quantized kernels need CUDA tensors, got {data.device}; "
                         "use triton_kernels.quant.linear, which runs the torch path on CPU")


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType | int,
               shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight ``[N, K]`` of GGML-format ``data`` (Triton).

    In fp32 it equals ``gguf.quants.dequantize`` (``QuantizedWeight.dequantize``) bit for
    bit; other dtypes are that value rounded to nearest.

    Args:
        data: uint8 ``[N, row_bytes]`` on CUDA (CPU under ``TRITON_INTERPRET=1``), stride
            1 within a row; ``row_bytes = K / block_size * type_size``
            (``gguf.GGML_QUANT_SIZES``), blocks laid out as in llama.cpp.
        qtype: one of ``SUPPORTED_QTYPES``.
        shape: ``(N, K)``.
        dtype: of the result (fp32, fp16 or bf16).

    Returns:
        ``[N, K]`` contiguous, ``dtype``, on ``data``'s device.

    Raises:
        ValueError: unsupported format or dtype, ``K`` not a multiple of the block size,
            ``data`` of the wrong dtype, shape or strides, or not on CUDA.
    """
    qtype, n, k, block_size, type_size = _check_weight(data, qtype, shape)
    if dtype not in _X_DTYPES:
        raise ValueError(f"dequantize writes fp32, fp16 or bf16, not {dtype}")
    _check_device(data)
    out = torch.empty((n, k), dtype=dtype, device=data.device)
    if out.numel() == 0:
        return out
    block_n, block_k = (16, 64) if _INTERPRETED else (32, 256)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        data, out, n, k, data.stride(0), out.stride(0),
        QTYPE=int(qtype), QK=block_size, TYPE_SIZE=type_size,
        BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def _matmul_config(m: int, qtype: GGMLQuantizationType) -> dict:
    """Tile sizes and launch parameters for ``_dequant_matmul_kernel`` (heuristics, not
    yet tuned on a GPU). BLOCK_K is a whole number of blocks (256 = one K-quant
    super-block per row per step); small M (decode) gets narrow column tiles so that a
    GEMV still spreads over many SMs; 8 warps once the decoded weight tile passes 4096
    elements, to keep its per-thread share (and the decode's temporaries) in registers."""
    k_quant = qtype in _K_QUANTS
    if _INTERPRETED:  # small tiles: several programs and K steps on tiny test shapes
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256 if k_quant else 64,
                "GROUP_M": 2}
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64
    block_k = 256 if k_quant else 128
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8,
            "num_warps": 8 if block_n * block_k > 4096 else 4,
            "num_stages": 2 if k_quant else 3}


def dequant_matmul(x: torch.Tensor, data: torch.Tensor, qtype: GGMLQuantizationType | int,
                   shape: tuple[int, int], bias: torch.Tensor | None = None, *,
                   method: str | None = None) -> torch.Tensor:
    """``y = x @ dequant(W).T (+ bias)`` with ``W`` in a GGML block format (Triton).

    Below ``DEQUANT_THEN_GEMM_MIN_M`` rows (decode, small batches) one fused kernel
    decodes weight tiles in registers and feeds ``tl.dot``, so only the packed bytes
    are read; from there on the weight is dequantized once into ``x``'s dtype
    (``dequantize``) and multiplied by ``F.linear`` (cuBLAS). Either way the weight
    enters the product rounded to ``x``'s dtype, as ``F.linear(x, W.to(x.dtype))`` does,
    with fp32 accumulation (fp32 ``x``: IEEE fp32 products, no TF32).

    Args:
        x: ``[M, K]`` fp16, bf16 or fp32 on CUDA (CPU under ``TRITON_INTERPRET=1``), any
            strides.
        data: uint8 ``[N, row_bytes]`` on ``x``'s device, stride 1 within a row (see
            ``dequantize``).
        qtype: one of ``SUPPORTED_QTYPES``.
        shape: ``(N, K)`` of the weight.
        bias: ``[N]`` or None, any float dtype (added in fp32 by the fused kernel).
        method: ``"fused"`` or ``"dequantize"`` forces one path (tests, benchmarks);
            None picks by M.

    Returns:
        ``[M, N]`` contiguous, ``x``'s dtype.

    Raises:
        ValueError: unsupported format, ``x`` not 2-D or of another dtype, mismatched
            ``K``, ``N`` or devices, ``data`` of the wrong dtype, shape or strides,
            tensors not on CUDA, or an unknown ``method``.
    """
    qtype, n, k, block_size, type_size = _check_weight(data, qtype, shape)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for a {n}x{k} weight, got {list(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.device != data.device:
        raise ValueError(f"x is on {x.device} but data on {data.device}")
    if bias is not None:
        if tuple(bias.shape) != (n,) or not bias.is_floating_point() or bias.device != x.device:
            raise ValueError(f"bias must be a float [{n}] tensor on {x.device}, got "
                             f"{bias.dtype} {list(bias.shape)} on {bias.device}")
        bias = bias.contiguous()
    if method not in (None, "fused", "dequantize"):
        raise ValueError(f"method must be None, 'fused' or 'dequantize', got {method!r}")
    _check_device(data)
    m = x.shape[0]
    if method is None:
        method = "dequantize" if m >= DEQUANT_THEN_GEMM_MIN_M else "fused"
    if method == "dequantize":
        weight = dequantize(data, qtype, (n, k), dtype=x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    config = _matmul_config(m, qtype)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _dequant_matmul_kernel[grid](
        x, data, bias if bias is not None else y, y, m, n, k,
        x.stride(0), x.stride(1), data.stride(0), y.stride(0),
        QTYPE=int(qtype), QK=block_size, TYPE_SIZE=type_size, HAS_BIAS=bias is not None,
        # fp32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa).
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        **config,
    )
    return y


def random_weight(qtype: GGMLQuantizationType | int, rows: int, cols: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Random uint8 ``[rows, row_bytes]`` blocks of ``qtype`` with every bit pattern
    likely, for tests and benchmarks (CPU tensor).

    The legacy formats and F16/BF16 are ``QuantizedWeight.quantize`` of a normal weight
    (llama.cpp's rounding). The K-quants, which ``gguf`` cannot quantize, are random
    bytes whose fp16 super-block scales (``d``, and ``dmin`` of Q4_K/Q5_K) are replaced
    by finite values of either sign around 0.01, so no block is inf or NaN.

    Raises:
        ValueError: unsupported format or ``cols`` not a multiple of its block size.
    """
    qtype = _check_qtype(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{qtype.name} needs cols divisible by {block_size}, got {cols}")
    if qtype not in _K_QUANTS:
        from .quant import QuantizedWeight

        dense = torch.randn(rows, cols, generator=generator)
        return QuantizedWeight.quantize(dense, qtype).data
    blocks = torch.randint(0, 256, (rows, cols // block_size, type_size), dtype=torch.uint8,
                           generator=generator)
    # Q6_K ends with d; Q4_K/Q5_K start with d, dmin.
    scale_at, num_scales = (208, 1) if qtype == QT.Q6_K else (0, 2)
    scales = (torch.randn(rows, cols // block_size, num_scales, generator=generator)
              * 0.01).half()
    blocks[..., scale_at:scale_at + 2 * num_scales] = scales.view(torch.uint8)
    return blocks.view(rows, -1)


def _benchmark() -> None:
    """Decode- and prefill-shaped matmuls on a 4096 x 4096 weight, every format: the
    fused kernel, dequantize + cuBLAS, and cuBLAS on a dense fp16 weight."""
    from triton.testing import do_bench

    n = k = 4096
    dense = torch.randn(n, k, dtype=torch.float16, device="cuda")
    print(f"{'format':>6} {'M':>5} {'fused ms':>9} {'deq+gemm ms':>12} {'fp16 gemm ms':>13}")
    for qtype in SUPPORTED_QTYPES:
        data = random_weight(qtype, n, k).cuda()
        for m in (1, 16, 256):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            ms = [do_bench(functools.partial(dequant_matmul, x, data, qtype, (n, k),
                                             method=method))
                  for method in ("fused", "dequantize")]
            gemm = do_bench(functools.partial(F.linear, x, dense))
            print(f"{qtype.name:>6} {m:>5} {ms[0]:>9.4f} {ms[1]:>12.4f} {gemm:>13.4f}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("the quantized Triton kernels' benchmark needs a CUDA GPU")
    _benchmark()
