"""Quantized weights on the CPU: quant_reference, the C++ kernels (csrc/quant_ops.cpp) and
the dispatch of triton_kernels.quant.

- ``quant_reference.dequantize`` equals ``gguf.quants.dequantize`` bit for bit, every format.
- The C++ dequantizer equals the reference bit for bit, every format, on each of its
  instruction-set paths (AVX-512, AVX2, scalar: all compiled into one build).
- A quantized linear equals ``F.linear`` on the dequantized weight within a bound set by
  fp32 summation order, every format and path, 1-64 rows of x on both sides of the GEMV
  / GEMM switch, odd N, several K, with and without bias; mixed parts (Q4_K beside Q6_K
  beside dense fp32) give their outputs side by side.
- The embedding gathers the right rows; ids out of range are refused.
- The weights may be a read-only memory map: nothing is written, nothing copied.

Test blocks are random bytes with finite fp16 scales: every bit pattern of the quants is
a valid block, and gguf has no K-quant quantizer to make them another way.
"""

from __future__ import annotations

from pathlib import Path
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from triton_kernels import cpu_ops, quant, quant_reference
from triton_kernels.quant import QuantizedWeight

QT = GGMLQuantizationType
FORMATS = list(quant.SUPPORTED_QTYPES)
#: byte offsets of each block's fp16 scales (ggml-common.h)
SCALE_OFFSETS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
                 QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3}

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None,
                                   reason="the C++ CPU kernels did not build here")


@pytest.fixture(autouse=True)
def fp32_activations():
    """These tests check the kernels with fp32 activations, exact up to summation order
    (the AMX GEMM in its default bf16 hi + lo mode is held to the same bound); the int8
    activations and plain-bf16 GEMM have their own tests (test_q8_activations.py,
    test_quant_amx.py)."""
    ops = cpu_ops.load()
    before = ops is not None and (ops.q8_activations(), ops.bf16_gemm())
    cpu_ops.set_q8_activations(False)
    cpu_ops.set_bf16_gemm(False)
    cpu_ops.set_amx(True)
    yield
    if before:
        cpu_ops.set_q8_activations(before[0])
        cpu_ops.set_bf16_gemm(before[1])
    cpu_ops.set_amx(cpu_ops.amx_requested())


def skip_unless_path(isa: str) -> None:
    """AMX runs only where the CPU (and OS) have it; the other paths are in every x86 build
    that has them and lower requests are served by the best path there is."""
    if isa == "amx" and cpu_ops.load().quant_isa() != ISAS["amx"]:
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused its tile state)")


def random_weight(qtype: QT, rows: int, cols: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """GGUF bytes ``[rows, row_bytes]`` of random blocks with finite fp16 scales (values
    for F16/BF16)."""
    rng = np.random.default_rng(seed)
    if qtype == QT.F16:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        bits = (rng.standard_normal((rows, cols)) * scale).astype(np.float32).view(np.uint32)
        return (bits >> 16).astype(np.uint16).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        d = (rng.standard_normal((rows, cols // block_size, 1)) * scale * 0.02).astype(np.float16)
        blocks[..., off:off + 2] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def block_cols(qtype: QT, blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * blocks


#: The AMX GEMM's fp32-grade mode on top of the summation-order bound: x and w as bf16
#: hi + lo are each within 2^-18 of themselves and lo * lo is dropped, so a product is
#: within 3 * 2^-18 of exact.
AMX_X3_REL = 3 * 2 ** -18


def best_path_rel() -> float:
    """The extra bound of the best path's GEMM (the AMX one where it runs)."""
    return AMX_X3_REL if cpu_ops.load().quant_isa() == ISAS["amx"] else 0.0


def assert_linear_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None, extra_rel: float = 0.0) -> None:
    """``out`` equals ``F.linear(x, w, bias)`` up to fp32 summation order: within 1e-5 (plus
    ``extra_rel``) of ``|x| @ |w|^T`` per element (a wrong value anywhere in a row is off
    by far more)."""
    expected = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    bound = (1e-5 + extra_rel) * (x.double().abs() @ w.double().abs().T) + 1e-6
    err = (out.double() - expected).abs()
    assert out.shape == expected.shape and out.dtype == torch.float32
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"off by {worst:.1f}x the summation-order bound"
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=bound.max().item(), rtol=1e-5)


# -- the torch reference against gguf ------------------------------------------------------


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (16, 2)])
def test_reference_equals_gguf_bit_for_bit(qtype, rows, blocks):
    data = random_weight(qtype, rows, block_cols(qtype, blocks) * (5 if qtype in (QT.F16, QT.BF16)
                                                                 else 1), seed=rows + blocks)
    expected = gguf_quants.dequantize(data, qtype)
    ours = quant_reference.dequantize(torch.from_numpy(data), qtype)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert np.array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))


def test_reference_keeps_leading_dims_and_refuses_bad_input():
    data = random_weight(QT.Q4_1, 6, 64, seed=1)
    flat = quant_reference.dequantize(torch.from_numpy(data), QT.Q4_1)
    stacked = quant_reference.dequantize(torch.from_numpy(data).view(2, 3, -1), QT.Q4_1)
    assert torch.equal(stacked.reshape(6, 64), flat)
    with pytest.raises(ValueError, match="uint8"):
        quant_reference.dequantize(torch.zeros(2, 40, dtype=torch.int8), QT.Q4_1)
    with pytest.raises(ValueError, match="whole number"):
        quant_reference.dequantize(torch.zeros(2, 41, dtype=torch.uint8), QT.Q4_1)


def test_quantized_weight_dequantize_is_the_reference_and_quantize_round_trips():
    dense = torch.randn(12, 96, generator=torch.Generator().manual_seed(0))
    for qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.F16, QT.BF16):
        w = QuantizedWeight.quantize(dense, qtype)
        expected = gguf_quants.dequantize(w.data.numpy(), qtype)
        assert np.array_equal(w.dequantize().numpy(), expected)
        # the quantizer's error is small against the weight: the layout is read right
        assert (w.dequantize() - dense).abs().max() < 0.2 * dense.abs().max()


# -- the C++ dequantizer and embedding ------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_kernel_dequantize_equals_reference_bit_for_bit(qtype, isa):
    skip_unless_path(isa)
    ops = cpu_ops.load()
    for rows, blocks in [(1, 1), (5, 3), (33, 2)]:
        cols = block_cols(qtype, blocks) * (37 if qtype in (QT.F16, QT.BF16) else 1)
        data = torch.from_numpy(random_weight(qtype, rows, cols, seed=rows * blocks))
        expected = quant_reference.dequantize(data, qtype)
        out = ops.quant_dequantize(data, int(qtype), cols, ISAS[isa])
        assert out.shape == (rows, cols)
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), (rows, cols)


@needs_kernels
def test_the_build_reports_its_best_path_and_lower_paths_are_there():
    ops = cpu_ops.load()
    flags = Path("/proc/cpuinfo").read_text()
    best = ops.quant_isa()
    avx512 = 2 if " avx512f" in flags else 1 if " avx2" in flags else 0
    amx = " amx_bf16" in flags and " amx_tile" in flags and " avx512_bf16" in flags
    assert best in ((3, 2) if amx else (avx512,))  # 2 on an AMX CPU: the OS said no
    if amx and best == 3:  # the switch: off, the GEMM is the AVX-512 path to the bit
        data = torch.from_numpy(random_weight(QT.Q4_1, 40, 256, seed=8))
        x = torch.randn(32, 256)
        avx512 = ops.quant_linear(x, [data], [int(QT.Q4_1)], 256, None, 2)
        assert cpu_ops.set_amx(False) is False
        assert torch.equal(ops.quant_linear(x, [data], [int(QT.Q4_1)], 256, None, -1), avx512)
        assert cpu_ops.set_amx(True) is True
        assert not torch.equal(ops.quant_linear(x, [data], [int(QT.Q4_1)], 256, None, -1),
                               avx512)


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_embedding_gathers_and_dequantizes_the_rows(qtype):
    cols = block_cols(qtype, 2) * (9 if qtype in (QT.F16, QT.BF16) else 1)
    data = torch.from_numpy(random_weight(qtype, 50, cols, seed=3))
    weight = QuantizedWeight(data, qtype, (50, cols))
    ids = torch.tensor([[7, 0, 49], [7, 3, 21]])
    out = quant.embedding(ids, weight)
    assert out.shape == (2, 3, cols)
    expected = quant_reference.dequantize(data, qtype)[ids]
    assert torch.equal(out, expected)
    with pytest.raises((RuntimeError, IndexError)):
        quant.embedding(torch.tensor([50]), weight)
    with pytest.raises((RuntimeError, IndexError)):
        quant.embedding(torch.tensor([-1]), weight)


# -- the quantized linear ----------------------------------------------------------------


LINEAR_ROWS = [1, 2, 3, 4, 5, 8, 17, 32, 40, 64]  # AMX: 2, 2, 3, 4 groups of 16


@needs_kernels
@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_kernel_linear_equals_f_linear_on_the_dequantized_weight(qtype, isa):
    skip_unless_path(isa)
    ops = cpu_ops.load()
    g = torch.Generator().manual_seed(int(qtype))
    # N = 37, 51, 70: 4-row tiles with 1, 3, 2 rows left over; AMX's 32-row tiles with 5,
    # 19 (two A tiles, the second short) and 6
    shapes = [(1, 1), (37, 2), (51, 1), (70, 1)] if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else \
        [(1, 1), (37, 5), (51, 2), (70, 18)]
    for n, blocks in shapes:
        k = block_cols(qtype, blocks) + (3 if qtype in (QT.F16, QT.BF16) else 0)
        data = torch.from_numpy(random_weight(qtype, n, k, seed=n + blocks))
        w = quant_reference.dequantize(data, qtype)
        bias = torch.randn(n, generator=g)
        for m in LINEAR_ROWS:
            x = torch.randn(m, k, generator=g)
            out = ops.quant_linear(x, [data], [int(qtype)], k, bias if m % 2 else None,
                                   ISAS[isa])
            assert_linear_close(out, x, w, bias if m % 2 else None,
                                AMX_X3_REL if isa == "amx" else 0.0)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 6, 40])
def test_mixed_parts_give_their_outputs_side_by_side(m):
    # Q4_K_M files store Q and K as Q4_K and V as Q6_K; a dense fp32 part may sit beside.
    g = torch.Generator().manual_seed(m)
    k = 512
    q = QuantizedWeight(torch.from_numpy(random_weight(QT.Q4_K, 24, k, seed=1)), QT.Q4_K, (24, k))
    v = QuantizedWeight(torch.from_numpy(random_weight(QT.Q6_K, 9, k, seed=2)), QT.Q6_K, (9, k))
    dense = torch.randn(5, k, generator=g)
    weight = quant.fuse_rows([q, v, dense])
    assert isinstance(weight, tuple)
    full = torch.cat([q.dequantize(), v.dequantize(), dense])
    bias = torch.randn(38, generator=g)
    x = torch.randn(m, k, generator=g)
    assert_linear_close(quant.linear(x, weight, bias), x, full, bias, best_path_rel())
    # leading dims are kept
    x3 = torch.randn(2, m, k, generator=g)
    out3 = quant.linear(x3, weight)
    assert out3.shape == (2, m, 38)
    assert_linear_close(out3.reshape(-1, 38), x3.reshape(-1, k), full, extra_rel=best_path_rel())


@needs_kernels
def test_rows_of_a_wider_buffer_and_non_contiguous_x():
    # slice_rows views and weights inside a bigger mapping have a row stride of their own
    data = torch.from_numpy(random_weight(QT.Q8_0, 40, 128, seed=5))
    wide = torch.zeros(40, data.shape[1] + 16, dtype=torch.uint8)
    wide[:, :data.shape[1]] = data
    weight = QuantizedWeight.__new__(QuantizedWeight)  # bypass the contiguity of __init__
    object.__setattr__(weight, "data", wide[:, :data.shape[1]])
    object.__setattr__(weight, "qtype", QT.Q8_0)
    object.__setattr__(weight, "shape", (40, 128))
    x = torch.randn(3, 256)[:, ::2]
    expected_w = quant_reference.dequantize(data, QT.Q8_0)
    assert_linear_close(quant.linear(x, weight), x.contiguous(), expected_w)
    part = QuantizedWeight(data, QT.Q8_0, (40, 128)).slice_rows(10, 27)
    assert_linear_close(quant.linear(x, part), x.contiguous(), expected_w[10:27])


@needs_kernels
def test_weights_in_a_read_only_memory_map_are_read_in_place(tmp_path):
    data = random_weight(QT.Q4_1, 64, 256, seed=6)
    path = tmp_path / "w.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
    # torch warns about a non-writable array once per process (TORCH_WARN_ONCE), so
    # whether it warns here depends on the tests before; the point is the no-copy below.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable", category=UserWarning)
        tensor = torch.from_numpy(mapped)
    weight = QuantizedWeight(tensor, QT.Q4_1, (64, 256))
    assert weight.data.data_ptr() == mapped.ctypes.data  # no copy
    x = torch.randn(2, 256)
    expected_w = quant_reference.dequantize(torch.from_numpy(data), QT.Q4_1)
    assert_linear_close(quant.linear(x, weight), x, expected_w)
    x20 = torch.randn(20, 256)  # the GEMM path too
    assert_linear_close(quant.linear(x20, weight), x20, expected_w, extra_rel=best_path_rel())
    assert np.array_equal(np.fromfile(path, dtype=np.uint8).reshape(data.shape), data)


@needs_kernels
def test_dispatch_takes_the_kernel_and_falls_back_where_it_must(monkeypatch):
    data = torch.from_numpy(random_weight(QT.Q5_0, 16, 64, seed=7))
    weight = QuantizedWeight(data, QT.Q5_0, (16, 64))
    w = weight.dequantize()
    calls = []
    real = cpu_ops.load()

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def quant_linear(self, *args):
            calls.append(args[0].shape)
            return real.quant_linear(*args)

    monkeypatch.setattr(cpu_ops, "_module", Spy())
    x = torch.randn(3, 64)
    assert_linear_close(quant.linear(x, weight), x, w)
    assert calls == [(3, 64)]
    # bf16 activations, gradients: the torch path, same answer
    xb = x.bfloat16()
    torch.testing.assert_close(quant.linear(xb, weight), F.linear(xb, w.bfloat16()))
    xg = x.clone().requires_grad_()
    quant.linear(xg, weight).sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 64))
    assert len(calls) == 1
    # a mis-shaped x gets torch's own error, not a crash
    with pytest.raises(RuntimeError):
        quant.linear(torch.randn(2, 65), weight)
    # the kernels switched off: the torch path
    monkeypatch.setattr(cpu_ops, "_module", None)
    assert_linear_close(quant.linear(x, weight), x, w)
    assert len(calls) == 1


@needs_kernels
def test_kernel_refuses_parts_that_do_not_fit():
    ops = cpu_ops.load()
    data = torch.from_numpy(random_weight(QT.Q4_0, 4, 64, seed=8))
    with pytest.raises(RuntimeError, match="uint8"):
        ops.quant_linear(torch.randn(1, 64), [data[:, :30]], [int(QT.Q4_0)], 64)
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        ops.quant_linear(torch.randn(1, 48), [data], [int(QT.Q4_0)], 48)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quant_linear(torch.randn(1, 64), [data], [int(QT.Q2_K)], 64)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        ops.quant_linear(torch.randn(1, 32), [data], [int(QT.Q4_0)], 64)
