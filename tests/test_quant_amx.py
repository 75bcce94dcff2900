"""The quantized GEMM on AMX-BF16 tiles in bf16 (``csrc/quant_amx.h``), the default on
AMX CPUs (``AIOENGINE_BF16_GEMM``; test_quant_cpu.py holds the fp32-grade mode to the
fp32 bound; the rest of the suite runs the exact fp32 path, tests/conftest.py).

- The kernel equals ``F.linear`` on the dequantized weight within the error of bf16 x and
  weights (each rounded to 8 significant bits: a product off by about 2^-8 of ``|x| |w|``,
  1.5 x 2^-8 with the fp32 sums), every format, odd shapes, 9-64 rows; and it is not the
  fp32 result.
- On the default Q4_1 model, 16 sequences side by side (rows where the AMX GEMM runs),
  against the exact fp32 path (AMX off): next-token agreement over 16 prompts x 64
  teacher-forced tokens of the fp32 greedy continuation, and perplexity on a fixed text.
  Measured: 1020 of 1024 (99.6%) agree, perplexity 0.1% lower (31.74 vs 31.77): both
  within the 1% issue 15 asks of a default; the thresholds below hold it there.

Skipped on CPUs without AMX-BF16 (the AVX-512, AVX2 and scalar paths are tested in
test_quant_cpu.py everywhere they run).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from teacher_forcing import TEXT, agreement, default_llm, greedy_sequences, teacher_forced
from test_quant_cpu import FORMATS, QT, block_cols, random_weight
from triton_kernels import cpu_ops, quant_reference

pytestmark = pytest.mark.skipif(
    cpu_ops.load() is None or cpu_ops.load().quant_isa() != 3,
    reason="no AMX-BF16 on this CPU (or the OS refused its tile state)")


@pytest.fixture(autouse=True)
def bf16_gemm():
    """The plain-bf16 AMX GEMM for the test, the process's settings restored after."""
    before = cpu_ops.load().bf16_gemm()
    cpu_ops.set_amx(True)
    cpu_ops.set_bf16_gemm(True)
    yield
    cpu_ops.set_bf16_gemm(before)
    cpu_ops.set_amx(cpu_ops.amx_requested())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_bf16_gemm_equals_f_linear_within_bf16_rounding(qtype):
    ops = cpu_ops.load()
    g = torch.Generator().manual_seed(int(qtype))
    k_quant = qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K)
    for n, blocks in ([(37, 2), (51, 1)] if k_quant else [(37, 5), (51, 18)]):
        k = block_cols(qtype, blocks) + (3 if qtype in (QT.F16, QT.BF16) else 0)
        data = torch.from_numpy(random_weight(qtype, n, k, seed=n + blocks))
        w = quant_reference.dequantize(data, qtype)
        bias = torch.randn(n, generator=g)
        for m in (9, 16, 33, 64):
            x = torch.randn(m, k, generator=g)
            b = bias if m % 2 else None
            out = ops.quant_linear(x, [data], [int(qtype)], k, b, 3)
            expected = F.linear(x.double(), w.double(), None if b is None else b.double())
            # x and w each rounded to bf16's 8 significant bits (unit roundoff 2^-8): a
            # product within 2^-7 + 2^-16 relative; AMX's fp32 sums (of pairs of products,
            # then into C) add a little on the way
            bound = (2**-7 + 2**-15) * (x.double().abs() @ w.double().abs().T) + 1e-6
            worst = ((out.double() - expected).abs() / bound).max().item()
            assert worst <= 1.0, f"M={m} N={n} K={k}: off by {worst:.2f}x the bf16 bound"
            # the bf16 path ran: an fp32 result would sit within 1e-5 of the bound's base
            assert not torch.allclose(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


THIRTY_TWO_VALUE_FORMATS = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]


@pytest.mark.parametrize("qtype", THIRTY_TWO_VALUE_FORMATS, ids=lambda t: t.name)
def test_table_decoder_gives_the_same_tiles_as_the_fp32_decoder(qtype):
    """The A tiles of the 32-value formats come from a bf16 table of each block's values
    picked by vpermw (``set_amx_table_decode``): the same bf16 values as rounding the
    fp32 dequantized weights, so the GEMM is bit for bit the same; and both are the exact
    dot products of the bf16-rounded x and weights up to the fp32 sums' rounding (a
    wrong nibble, scale or row would be far outside that). Tail tiles of weight rows
    (37 = 32 + 5), K of an odd number of 32-value chunks (544), 9-64 rows of x."""
    ops = cpu_ops.load()
    g = torch.Generator().manual_seed(100 + int(qtype))
    before = ops.set_amx_table_decode(True)
    try:
        for n, blocks in ((37, 17), (64, 18)):
            k = block_cols(qtype, blocks)
            data = torch.from_numpy(random_weight(qtype, n, k, seed=n * blocks))
            w = quant_reference.dequantize(data, qtype).bfloat16().double()
            for m in (9, 16, 17, 32, 33, 64):
                x = torch.randn(m, k, generator=g)
                ops.set_amx_table_decode(True)
                table = ops.quant_linear(x, [data], [int(qtype)], k, None, 3)
                ops.set_amx_table_decode(False)
                fp32 = ops.quant_linear(x, [data], [int(qtype)], k, None, 3)
                assert torch.equal(table, fp32), f"M={m} N={n} K={k}: the decoders differ"
                xb = x.bfloat16().double()
                exact = xb @ w.T
                bound = 2**-13 * (xb.abs() @ w.abs().T) + 1e-6
                worst = ((table.double() - exact).abs() / bound).max().item()
                assert worst <= 1.0, f"M={m} N={n} K={k}: {worst:.2f}x the fp32 sum bound"
    finally:
        ops.set_amx_table_decode(before)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "hi_lo"])
@pytest.mark.parametrize("qtype", THIRTY_TWO_VALUE_FORMATS, ids=lambda t: t.name)
def test_decode_ring_gives_the_bits_of_the_whole_buffer(qtype, bf16):
    """Up to 32 rows of x (one pass over the row groups) gemm_tile decodes each chunk of K
    two ahead into a ring of 4 chunks; more rows keep every chunk for the later passes. A
    row of y depends only on its own row of x, in the same order of tile products, so the
    first 32 rows of a 64-row call (the whole buffer) must equal a 32-row call (the ring)
    bit for bit, as must 9 and 17 rows (17 and 32 in the hi + lo mode: its lo tiles too).
    K of 1, 3, 5 and 18 chunks (fewer than, about and more than the ring); 7 tiles of
    weight rows and a tail (229 = 7 x 32 + 5), so tiles prefetch the rows 4 tiles on
    while they decode."""
    ops = cpu_ops.load()
    cpu_ops.set_bf16_gemm(bf16)
    g = torch.Generator().manual_seed(200 + int(qtype))
    n = 229
    for blocks in (1, 3, 5, 18):
        k = block_cols(qtype, blocks)
        data = torch.from_numpy(random_weight(qtype, n, k, seed=blocks))
        bias = torch.randn(n, generator=g)
        x = torch.randn(64, k, generator=g)
        whole = ops.quant_linear(x, [data], [int(qtype)], k, bias, 3)
        for m in (9, 17, 32) if bf16 else (17, 32):  # hi + lo: AMX from 17 rows
            ring = ops.quant_linear(x[:m].contiguous(), [data], [int(qtype)], k, bias, 3)
            assert torch.equal(ring, whole[:m]), f"M={m} K={k}: the ring's rows differ"
        argmax = ops.quant_linear_argmax(x[:32].contiguous(), [data], [int(qtype)], k, bias, 3)
        assert torch.equal(argmax, whole[:32].argmax(dim=1)), f"K={k}: argmax differs"


# -- the default model, 16 sequences side by side ------------------------------------------

@pytest.fixture(scope="module")
def model(one_thread):
    return default_llm()


def test_bf16_gemm_agreement_and_perplexity_against_the_fp32_path(model):
    text = model.tokenizer.encode(TEXT, add_special_tokens=False)
    cpu_ops.set_amx(False)  # the exact fp32 path (AVX-512)
    try:
        prompt_ids, seqs = greedy_sequences(model)
        ref = teacher_forced(model, seqs)
        ref_text = teacher_forced(model, [text] * 9)[0]  # 9 rows: the GEMM, not the GEMV
    finally:
        cpu_ops.set_amx(True)
    ours = teacher_forced(model, seqs)
    ours_text = teacher_forced(model, [text] * 9)[0]

    a = agreement(prompt_ids, seqs, ref, ours, text, ref_text, ours_text)
    print(a.report("bf16 GEMM against the fp32 path", len(text)))
    assert a.total == 16 * 64
    assert a.agree >= 0.99 * a.total
    assert abs(a.ppl_ours / a.ppl_ref - 1) <= 0.01
    assert not torch.allclose(ours_text, ref_text, atol=1e-5)  # the bf16 path did run
