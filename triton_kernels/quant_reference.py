"""Torch dequantizers for the GGML block formats: the oracle of the C++ and Triton kernels.

Each function turns GGUF bytes ``[..., row_bytes]`` (uint8, any device) into fp32
``[..., cols]``, bit for bit equal to ``gguf.quants.dequantize`` (the ``gguf``
package's numpy twin of llama.cpp's ``dequantize_row_*`` in
``ggml/src/ggml-quants.c``). Block layouts are llama.cpp's ``ggml/src/ggml-common.h``:

=======  ======  =====  ===========================================================
format   block   bytes  layout (fp16 scales little-endian)
=======  ======  =====  ===========================================================
Q8_0     32      34     d, qs[32] int8;                   w = d * q
Q4_0     32      18     d, qs[16] (low nibbles: 0-15, high: 16-31);  w = d * (q - 8)
Q4_1     32      20     d, m, qs[16];                     w = d * q + m
Q5_0     32      22     d, qh[4] (bit j: 5th bit of j), qs[16];  w = d * (q - 16)
Q5_1     32      24     d, m, qh[4], qs[16];              w = d * q + m
Q4_K     256     144    d, dmin, scales[12] (8 x 6-bit scale/min), qs[128];
                        sub-block j of 32: w = (d * sc_j) * q - dmin * m_j
Q5_K     256     176    d, dmin, scales[12], qh[32], qs[128]; as Q4_K, 5-bit q
Q6_K     256     210    ql[128], qh[64], scales[16] int8, d;
                        sub-block j of 16: w = (d * sc_j) * (q - 32)
F16      1       2      IEEE half
BF16     1       2      bfloat16 (the high half of an fp32)
=======  ======  =====  ===========================================================

The order of the operations is the reference's (``(d * sc) * q`` for Q6_K, say); every
product of an fp16 scale and a small integer is exact in fp32, so a fused multiply-add
in a kernel rounds the same way as the reference's multiply then add.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["dequantize"]

QT = GGMLQuantizationType
QK_K = 256


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of each block, as fp32 ``[n_blocks, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, g, 16 or 32]`` bytes -> ``[n, g, 2 * width]``: low nibbles, then high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` little-endian uint32 bytes -> ``[n, 32]`` bits (bit j of the word)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 6-bit scales and mins ``[n, 8]`` (``get_scale_min_k4``:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 split over bytes 8-11 and the
    top 2 bits of bytes 0-7)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    ml = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    # 4 groups of 32 bytes: the low nibbles are sub-block 2g, the high ones 2g + 1
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    ml = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    ql = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    # bit j of qh[l] is the 5th bit of element l of sub-block j
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    qh = (b[:, 16:48].unsqueeze(1) >> shifts) & 1
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)   # two halves of 128 elements
    qh = b[:, 128:192].reshape(n, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(b, 208)
    # half h, element 32 * s + l: low 4 bits from ql (nibble s // 2 of byte 32 * (s % 2) + l),
    # high 2 bits from bits 2s, 2s + 1 of qh[l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # [n, 2, 128]
    # arange, not torch.tensor([...]): no host-to-device copy, so a CUDA graph can capture it
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((qh.unsqueeze(2) >> shifts) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).to(torch.int8) - 32
    dl = (d * scales).unsqueeze(-1)  # [n, 16, 1]
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _f16_rows(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16_rows(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the high half of an fp32: widen the bits, no rounding
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1,
    QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
}


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """GGUF bytes ``[..., row_bytes]`` of format ``qtype`` -> fp32 ``[..., cols]``.

    ``data`` is only read (it may be a read-only view of a memory-mapped file).

    Raises:
        ValueError: ``data`` is not uint8, ``row_bytes`` is not a whole number of blocks,
            or ``qtype`` is not a format listed above.
    """
    qtype = GGMLQuantizationType(qtype)
    if data.dtype != torch.uint8:
        raise ValueError(f"dequantize: uint8 data expected, got {data.dtype}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    *lead, row_bytes = data.shape
    if row_bytes % type_size:
        raise ValueError(f"dequantize: {row_bytes} bytes per row is not a whole number of "
                         f"{qtype.name} blocks of {type_size} bytes")
    cols = row_bytes // type_size * block_size
    if qtype == QT.F16:
        return _f16_rows(data)
    if qtype == QT.BF16:
        return _bf16_rows(data)
    if qtype == QT.F32:
        return data.contiguous().view(torch.float32)
    fn = _BLOCK_DEQUANTIZERS.get(qtype)
    if fn is None:
        raise ValueError(f"dequantize: no dequantizer for {qtype.name}")
    blocks = data.reshape(-1, type_size)
    return fn(blocks).reshape(*lead, cols)


def quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., K]`` (K a multiple of 32) rounded as the int8-activation kernels see it
    (``cpu_ops.set_q8_activations``; llama.cpp's ``quantize_row_q8_0``): per 32-value
    block ``d = max|x| / 127``, ``q = round(x / d)`` (half to even), returned as ``q * d``
    in fp32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)
