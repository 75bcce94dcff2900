"""Triton kernels for weights in GGML block formats: dequantize, and a dequantizing matmul.

A weight ``[N, K]`` (``[out_features, in_features]``) is stored as GGUF stores it: row
``n`` is ``K / QK`` blocks of ``TYPE_SIZE`` bytes each, rows back to back, so ``data``
is a uint8 tensor ``[N, K / QK * TYPE_SIZE]`` (``triton_kernels.quant.QuantizedWeight``).
Block layouts are llama.cpp's (``ggml/src/ggml-common.h``: ``block_q8_0``,
``block_q4_0``, ``block_q4_1``, ``block_q5_0``, ``block_q5_1``, ``block_q4_K``,
``block_q5_K``, ``block_q6_K``), decoded as ``dequantize_row_*`` in
``ggml/src/ggml-quants.c`` and the ``gguf`` package's ``quants.py`` do.

- ``_dequant_tile``: the one place that knows the layouts. It decodes a ``[BLOCK_N,
  BLOCK_K]`` tile of the weight from its packed rows, worked on as ``[BLOCK_N, groups,
  GROUP]`` where GROUP elements share a scale (a legacy block or a K-quant sub-block of
  32, a Q6_K scale's 16): scales, mins and the 6-bit K-quant sub-block scales are
  decoded once per group, the quants (nibbles, high bits) per element. Every product
  it forms (fp16 scale x small integers) is exact in fp32, so the values are bit-exact
  with the reference whatever the compiler fuses into FMAs.
- ``_dequantize_kernel``: ``[BLOCK_N, BLOCK_K]`` tiles of the dense weight, written out
  (for prefill-sized M: dequantize once, then cuBLAS).
- ``_dequant_matmul_kernel``: ``y = x @ W.T (+ bias)`` with tiles ``BLOCK_M x BLOCK_N``
  over ``BLOCK_K`` steps (a multiple of GROUP): each step loads an ``x`` tile, decodes
  the weight tile in registers from the packed bytes and feeds ``tl.dot`` (fp32
  accumulation), so the weight crosses memory once, packed.
  Programs are ordered in groups of ``GROUP_M`` row tiles as in the Triton matmul
  tutorial, so neighbouring programs share weight tiles in L2.

Torch twin: ``QuantizedWeight.dequantize`` and ``F.linear``; the tests compare with
``gguf.quants.dequantize`` itself.
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
def _dequant_tile(w_ptr, offs_n, mask_n, k_start, K, stride_wn,
                  QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``W[offs_n, k_start : k_start + BLOCK_K]`` as ``[BLOCK_N, BLOCK_K]``, decoded
    from the packed rows at ``w_ptr`` (0 where masked: rows past ``mask_n``, columns past
    ``K``; masked bytes are never read).

    The tile is worked on as ``[BLOCK_N, BLOCK_K / GROUP, GROUP]``: GROUP elements share
    one scale (and min), which are decoded once per group as ``[BLOCK_N, groups]``; only
    the quants are loaded per element. Byte offsets of the fields are those of
    llama.cpp's ``block_*`` structs (d, dmin, m: fp16; j: an element's index in its block):
    Q8_0 {d, qs[32] int8}; Q4_0 {d, qs[16]}; Q4_1 {d, m, qs[16]}; Q5_0 {d, qh u32,
    qs[16]}; Q5_1 {d, m, qh u32, qs[16]} (low nibble of qs[j] for j < 16, high nibble
    of qs[j - 16] after, fifth bit = bit j of qh); Q4_K {d, dmin, scales[12], qs[128]};
    Q5_K {d, dmin, scales[12], qh[32], qs[128]}; Q6_K {ql[128], qh[64], scales[16] int8,
    d}. Every product below is fp16 scale x small integers, exact in fp32, so the values
    equal ``gguf.quants.dequantize`` bit for bit whatever the compiler fuses into FMAs.
    """
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if QTYPE == F16 or QTYPE == BF16:
        w = _dense16_tile(rows, mask_n, k_start, K, QTYPE == BF16, BLOCK_K)
    else:
        w = _block_tile(rows, mask_n, k_start, K, QTYPE, QK, TYPE_SIZE, GROUP,
                        BLOCK_N, BLOCK_K)
    return w


@triton.jit
def _dense16_tile(rows, mask_n, k_start, K, IS_BF16: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_dequant_tile`` of an F16 or BF16 weight (little-endian 2-byte elements)."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    ptr = rows + (offs_k * 2)[None, :]
    bits = _load_u8(ptr, mask) | (_load_u8(ptr + 1, mask) << 8)
    if IS_BF16:
        w = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        w = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return w


@triton.jit
def _block_tile(rows, mask_n, k_start, K, QTYPE: tl.constexpr, QK: tl.constexpr,
                TYPE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """``_dequant_tile`` of a block format; ``rows``: ``[BLOCK_N, 1]`` row pointers."""
    # K is a whole number of blocks (and so of groups): a group is all in or all out.
    group_k = k_start + tl.arange(0, BLOCK_K // GROUP) * GROUP  # first column of each group
    mask2 = mask_n[:, None] & (group_k < K)[None, :]  # [BLOCK_N, groups]
    block2 = rows + ((group_k // QK) * TYPE_SIZE)[None, :]  # each group's block
    g = ((group_k % QK) // GROUP)[None, :]  # the group's index in its block
    j = g[:, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]  # [1, groups, GROUP]
    block3 = block2[:, :, None]
    mask3 = mask2[:, :, None]
    if QTYPE == Q8_0:
        d = _load_f16(block2, mask2)
        q = tl.load(block3 + 2 + j, mask=mask3, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * d[:, :, None]
    elif QTYPE == Q4_0:
        d = _load_f16(block2, mask2)
        q = _nibble(block3 + 2 + j % 16, (j // 16) * 4, mask3)
        w = (q - 8).to(tl.float32) * d[:, :, None]
    elif QTYPE == Q4_1:
        d = _load_f16(block2, mask2)
        m = _load_f16(block2 + 2, mask2)
        q = _nibble(block3 + 4 + j % 16, (j // 16) * 4, mask3)
        w = d[:, :, None] * q.to(tl.float32) + m[:, :, None]
    elif QTYPE == Q5_0:
        d = _load_f16(block2, mask2)
        high = (_load_u8(block3 + 2 + j // 8, mask3) >> (j % 8)) & 1
        q = _nibble(block3 + 6 + j % 16, (j // 16) * 4, mask3) | (high << 4)
        w = (q - 16).to(tl.float32) * d[:, :, None]
    elif QTYPE == Q5_1:
        d = _load_f16(block2, mask2)
        m = _load_f16(block2 + 2, mask2)
        high = (_load_u8(block3 + 4 + j // 8, mask3) >> (j % 8)) & 1
        q = _nibble(block3 + 8 + j % 16, (j // 16) * 4, mask3) | (high << 4)
        w = d[:, :, None] * q.to(tl.float32) + m[:, :, None]
    elif QTYPE == Q4_K or QTYPE == Q5_K:
        # Groups are the 8 sub-blocks of 32. qs byte i of 64-element chunk c holds
        # elements c*64 + i (low nibble) and c*64 + 32 + i (high nibble); Q5_K's fifth
        # bit of element j is bit j // 32 of qh[j % 32].
        scale, minimum = _k_scale_min(block2 + 4, g, mask2)
        a = _load_f16(block2, mask2) * scale
        b = _load_f16(block2 + 2, mask2) * minimum
        qs_at = 16 if QTYPE == Q4_K else 48
        q = _nibble(block3 + qs_at + (j // 64) * 32 + j % 32, ((j // 32) % 2) * 4, mask3)
        if QTYPE == Q5_K:
            q = q | (((_load_u8(block3 + 16 + j % 32, mask3) >> (j // 32)) & 1) << 4)
        w = a[:, :, None] * q.to(tl.float32) - b[:, :, None]
    else:
        # Q6_K, groups of 16 (one int8 scale each). In half h of the block, element r
        # takes a nibble of ql[h*64 + r % 64] (low for r < 64) and bit pair r // 32 of
        # qh[h*32 + r % 32].
        tl.static_assert(QTYPE == Q6_K, "unsupported GGML type")
        scale = tl.load(block2 + 192 + g, mask=mask2, other=0).to(tl.int8, bitcast=True)
        a = _load_f16(block2 + 208, mask2) * scale.to(tl.float32)
        half = j // 128
        r = j % 128
        low = _nibble(block3 + half * 64 + r % 64, (r // 64) * 4, mask3)
        high = (_load_u8(block3 + 128 + half * 32 + r % 32, mask3) >> ((r // 32) * 2)) & 3
        w = a[:, :, None] * ((low | (high << 4)) - 32).to(tl.float32)
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _dequantize_kernel(
    w_ptr, out_ptr, N, K, stride_wn, stride_on,
    QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); one [BLOCK_N, BLOCK_K] tile each.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w = _dequant_tile(w_ptr, offs_n, mask_n, k_start, K, stride_wn,
                      QTYPE, QK, TYPE_SIZE, GROUP, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_k < K)[None, :])


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_ym,
    QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (k_start + offs_kb < K)[None, :],
                    other=0.0)
        # The weight tile [BLOCK_N, BLOCK_K], decoded from its packed bytes in registers.
        w = _dequant_tile(w_ptr, offs_n, mask_n, k_start, K, stride_wn,
                          QTYPE, QK, TYPE_SIZE, GROUP, BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
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


def _group(qtype: GGMLQuantizationType) -> int:
    """Elements that share one scale: a Q6_K scale covers 16, a Q4_K/Q5_K sub-block and
    every legacy block 32; F16/BF16 have none (the tile is decoded elementwise)."""
    return 16 if qtype == QT.Q6_K else 1 if qtype in (QT.F16, QT.BF16) else 32


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
                         "use triton_kernels.quant.linear, which has CPU paths")


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
        QTYPE=int(qtype), QK=block_size, TYPE_SIZE=type_size, GROUP=_group(qtype),
        BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def _matmul_config(m: int, qtype: GGMLQuantizationType, dtype: torch.dtype) -> dict:
    """Tile sizes and launch parameters for ``_dequant_matmul_kernel``.

    Chosen so that ptxas (sm_90, Triton 3.9) keeps the decoded tile in registers:
    at most about 32 weight elements per thread, and no spills but a few bytes for
    Q5_K at 64 rows. Not yet timed on a GPU. Small M (decode) gets narrow column tiles,
    so that a GEMV still spreads over many SMs, and for K-quants one whole super-block
    per row per step; from 17 rows, 64-wide K steps (two legacy blocks, two K-quant
    sub-blocks: the decoder needs only whole groups, not whole super-blocks). fp32
    ``x`` goes through IEEE FMAs, not tensor cores, and gets small K steps.
    """
    k_quant = qtype in _K_QUANTS
    if _INTERPRETED:  # small tiles: several programs and K steps on tiny test shapes
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256 if k_quant else 64,
                "GROUP_M": 2}
    if dtype == torch.float32:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4}
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256 if k_quant else 128,
                "GROUP_M": 8, "num_warps": 8 if k_quant else 4}
    return {"BLOCK_M": 32 if m <= 32 else 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
            "num_warps": 8}


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
    config = _matmul_config(m, qtype, x.dtype)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _dequant_matmul_kernel[grid](
        x, data, bias if bias is not None else y, y, m, n, k,
        x.stride(0), x.stride(1), data.stride(0), y.stride(0),
        QTYPE=int(qtype), QK=block_size, TYPE_SIZE=type_size, GROUP=_group(qtype),
        HAS_BIAS=bias is not None,
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
