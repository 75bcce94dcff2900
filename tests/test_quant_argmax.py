"""The LM head's fused greedy argmax (``quant.argmax_linear``, ``csrc/quant_ops.h``
``quant_linear_argmax_into``) and where the model runner takes it.

The kernel runs the same tiles and sums as ``quant.linear`` but keeps only each row's
running maximum, so its tokens must be ``quant.linear(...).argmax(-1)`` exactly, first
index among equal maxima. Checked on every CPU path (scalar, AVX2, AVX-512, AMX in bf16
and bf16 hi + lo), at the GEMV's and the GEMM's row counts, with planted ties (identical
weight rows, so identical logits) inside one tile, across tiles and across the two
threads' ranges, with and without a bias, on random Q8_0/Q4_0/Q4_1/F32 weights and on
the default model's real Q8_0 LM head (``token_embd``, 49,152 x 576).

The LM head decoded once into AMX bf16 tiles (``quant.pack_amx_tiles``, the model's
``lm_head_tiles``) must give the per-call decode's logits bit for bit and its argmax.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from test_quant_cpu import ISAS, block_cols, random_weight
from triton_kernels import cpu_ops, quant
from triton_kernels.quant import QuantizedWeight

QT = GGMLQuantizationType
needs_kernels = pytest.mark.skipif(cpu_ops.load() is None,
                                   reason="the C++ CPU kernels did not build here")


@pytest.fixture
def two_threads():
    """Two torch threads (each takes half the tiles; the merge is tested too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def restore_gemm_settings():
    ops = cpu_ops.load()
    before = ops.bf16_gemm()
    yield
    cpu_ops.set_bf16_gemm(before)
    cpu_ops.set_amx(cpu_ops.amx_requested())


def paths() -> list[tuple[str, bool, bool]]:
    """(isa, amx on, bf16 GEMM) for every path this build and CPU have."""
    out = [("scalar", False, True), ("avx2", False, True), ("avx512", False, True)]
    if cpu_ops.load() is not None and cpu_ops.load().quant_isa() == ISAS["amx"]:
        out += [("amx", True, True), ("amx", True, False)]
    return out


def planted(qtype: QT, rows: int, blocks: int, seed: int) -> tuple[list, torch.Tensor, int]:
    """Weight parts whose row of largest norm is copied to rows 3, 20 (same 32-row tile),
    40 (next tile) and rows - 5 (the other thread's range), the dense weight, and the
    planted row (x along it makes the copies the top logits, tied: Cauchy-Schwarz)."""
    cols = block_cols(qtype, blocks) if qtype != QT.F32 else 32 * blocks
    if qtype == QT.F32:
        data = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        dense = data
    else:
        data = torch.from_numpy(random_weight(qtype, rows, cols, seed=seed).copy())
        dense = QuantizedWeight(data, qtype, (rows, cols)).dequantize()
    top = int(dense.norm(dim=1).argmax())
    for r in (3, 20, 40, rows - 5):
        data[r] = data[top]
    if qtype != QT.F32:
        dense = QuantizedWeight(data, qtype, (rows, cols)).dequantize()
    return [data], dense, top


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.F32], ids=lambda t: t.name)
def test_fused_argmax_is_the_argmax_of_the_logits_with_ties(qtype, two_threads,
                                                           restore_gemm_settings):
    ops = cpu_ops.load()
    rows, blocks = 1000, 6
    parts, dense, top = planted(qtype, rows, blocks, seed=int(qtype) + 1)
    cols = dense.shape[1]
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(rows, generator=g)
    bias[3] = bias[20] = bias[40] = bias[rows - 5] = bias[top]
    seen_ties = 0
    for isa, amx, bf16 in paths():
        cpu_ops.set_amx(amx)
        cpu_ops.set_bf16_gemm(bf16)
        for m in (1, 3, 8, 9, 16, 17, 32, 33, 64):
            x = torch.randn(m, cols, generator=g)
            x[::2] = dense[top] * 100  # every other row's top logits: the planted tie
            for b in (None, bias):
                logits = ops.quant_linear(x, parts, [int(qtype)], cols, b, ISAS[isa])
                tokens = ops.quant_linear_argmax(x, parts, [int(qtype)], cols, b, ISAS[isa])
                expected = logits.argmax(-1)
                assert torch.equal(tokens, expected), (isa, amx, bf16, m, b is not None)
                is_top = logits == logits.max(-1, keepdim=True).values
                seen_ties += int((is_top.sum(-1) > 1).sum())
    assert seen_ties > 0  # the planted rows did tie: the lowest index was chosen


@needs_kernels
def test_fused_argmax_mixed_parts_nan_and_bad_input():
    ops = cpu_ops.load()
    g = torch.Generator().manual_seed(3)
    a = torch.from_numpy(random_weight(QT.Q8_0, 70, 64, seed=1).copy())
    b = torch.from_numpy(random_weight(QT.Q4_0, 50, 64, seed=2).copy())
    for m in (2, 20):
        x = torch.randn(m, 64, generator=g)
        logits = ops.quant_linear(x, [a, b], [8, 2], 64, None, -1)
        assert torch.equal(ops.quant_linear_argmax(x, [a, b], [8, 2], 64, None, -1),
                           logits.argmax(-1))
        x[0, 5] = float("nan")  # a NaN row: every logit NaN, torch takes index 0
        logits = ops.quant_linear(x, [a, b], [8, 2], 64, None, -1)
        assert torch.equal(ops.quant_linear_argmax(x, [a, b], [8, 2], 64, None, -1),
                           logits.argmax(-1))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        ops.quant_linear_argmax(torch.randn(2, 32), [a], [8], 64, None, -1)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        ops.quant_linear_argmax(torch.randn(2, 64), [a], [8], 64, torch.randn(3), -1)
    # the Python entry: None where it does not apply, the caller computes logits
    qa = QuantizedWeight(a, QT.Q8_0, (70, 64))
    assert quant.argmax_linear(torch.randn(2, 64), torch.randn(70, 64)) is None  # dense
    assert quant.argmax_linear(torch.randn(2, 64, dtype=torch.bfloat16), qa) is None
    assert quant.argmax_linear(torch.randn(2, 63), qa) is None
    x = torch.randn(5, 64)
    assert torch.equal(quant.argmax_linear(x, qa), quant.linear(x, qa).argmax(-1))


def default_lm_head() -> QuantizedWeight:
    """The default model's tied Q8_0 LM head (``token_embd``), or a skip."""
    from gguf import GGUFReader

    from aioengine.config import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type == QT.Q8_0
    data = torch.from_numpy(np.ascontiguousarray(tensor.data).reshape(len(tensor.data), -1))
    return QuantizedWeight(data, QT.Q8_0, (data.shape[0], 576))


needs_amx = pytest.mark.skipif(cpu_ops.load() is None or cpu_ops.load().quant_isa() != ISAS["amx"],
                               reason="no AMX-BF16 GEMM on this CPU or build")


@needs_amx
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q5_0], ids=lambda t: t.name)
def test_packed_tiles_are_the_decoded_bf16_weight_and_give_the_same_logits(
        qtype, two_threads, restore_gemm_settings):
    rows, blocks = 1000, 6  # 1000 = 31 tiles of 32 rows + a tail of 8
    data = torch.from_numpy(random_weight(qtype, rows, block_cols(qtype, blocks), seed=5).copy())
    w = QuantizedWeight(data, qtype, (rows, block_cols(qtype, blocks)))
    cols = w.shape[1]
    tiles = quant.pack_amx_tiles(w)
    assert tiles.dtype == torch.int16 and tuple(tiles.shape) == (32, blocks, 32, 32)
    # the layout: tile t, chunk c, row r holds weight row 32 t + r's values 32 c .. 32 c + 31
    # in bf16 (round to nearest even), zeros past the last row
    as_rows = tiles.permute(0, 2, 1, 3).reshape(32 * 32, cols)
    expected = w.dequantize().to(torch.bfloat16).view(torch.int16)
    assert torch.equal(as_rows[:rows], expected)
    assert not as_rows[rows:].any()
    g = torch.Generator().manual_seed(11)
    bias = torch.randn(rows, generator=g)
    cpu_ops.set_amx(True)
    cpu_ops.set_bf16_gemm(True)
    for m in (1, 8, 9, 16, 32, 33, 64):
        x = torch.randn(m, cols, generator=g)
        for b in (None, bias):
            logits = quant.linear(x, w, b)
            assert torch.equal(quant.linear(x, w, b, amx_tiles=tiles), logits), (m, b is not None)
            tokens = quant.argmax_linear(x, w, b, amx_tiles=tiles)
            assert torch.equal(tokens, torch.argmax(logits, -1)), (m, b is not None)
    # where the bf16 AMX GEMM does not run (its fp32-grade mode, AMX off) the tiles are
    # ignored: the exact paths' output, which differs from bf16's
    x = torch.randn(32, cols, generator=g)
    bf16 = quant.linear(x, w)
    for amx, bf16_gemm in ((True, False), (False, True)):
        cpu_ops.set_amx(amx)
        cpu_ops.set_bf16_gemm(bf16_gemm)
        exact = quant.linear(x, w)
        assert not torch.equal(exact, bf16)
        assert torch.equal(quant.linear(x, w, amx_tiles=tiles), exact)
        assert torch.equal(quant.argmax_linear(x, w, amx_tiles=tiles), exact.argmax(-1))
    ops = cpu_ops.load()
    with pytest.raises(RuntimeError, match="amx_tiles must be"):
        ops.quant_linear_packed(x, data, int(qtype), cols, tiles[:-1].contiguous())
    with pytest.raises(RuntimeError, match="not a 32-value format"):
        ops.quant_amx_pack(torch.zeros(4, 2 * 144, dtype=torch.uint8), int(QT.Q4_K), 512)


@needs_amx
def test_packed_default_lm_head_bitwise_and_the_switch(two_threads, restore_gemm_settings,
                                                       monkeypatch, caplog):
    import logging

    from aioengine.models.decoder import CausalLM

    lm_head = default_lm_head()
    cpu_ops.set_amx(True)
    cpu_ops.set_bf16_gemm(True)
    # the model's own packing: on where the engine runs the bf16 AMX GEMM, logged once
    monkeypatch.setenv("AIOENGINE_AMX", "1")
    monkeypatch.setenv("AIOENGINE_BF16_GEMM", "1")
    holder = type("Model", (), {"lm_head": lm_head})()
    assert CausalLM.pack_lm_head(holder) is None  # off unless asked for
    monkeypatch.setenv("AIOENGINE_PACKED_LM_HEAD", "1")
    with caplog.at_level(logging.INFO, logger="aioengine.models.decoder"):
        tiles = CausalLM.pack_lm_head(holder)
    assert tiles is not None and tiles.numel() * 2 == 49152 * 576 * 2
    assert "56.6 MB more memory" in caplog.text
    g = torch.Generator().manual_seed(0)
    emb = quant.embedding(torch.randint(0, lm_head.shape[0], (64, 2), generator=g), lm_head)
    mix = torch.rand(64, 1, generator=g)
    hidden = (emb[:, 0] * mix + emb[:, 1] * (1 - mix)) * 30
    hidden[1::2] = torch.randn(32, 576, generator=g)  # and plain noise: no clear winner
    for m in (9, 16, 32, 33, 64):
        x = hidden[:m].contiguous()
        logits = quant.linear(x, lm_head)
        assert torch.equal(quant.linear(x, lm_head, amx_tiles=tiles), logits), m
        assert torch.equal(quant.argmax_linear(x, lm_head, amx_tiles=tiles),
                           torch.argmax(logits, -1)), m
    # the model hands its tiles to both LM head entries
    seen = []
    for name in ("linear", "argmax_linear"):
        fn = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, fn=fn, **kw: seen.append(kw) or fn(*a, **kw))
    holder.lm_head_tiles, holder.tp_size = tiles, 1
    holder.arch = type("Arch", (), {"final_logit_softcap": None})()
    x = hidden[:32].contiguous()
    assert torch.equal(CausalLM.compute_greedy_tokens(holder, x),
                       CausalLM.compute_logits(holder, x).argmax(-1))
    assert [kw["amx_tiles"] is tiles for kw in seen] == [True, True]
    for env in ({"AIOENGINE_PACKED_LM_HEAD": "0"}, {"AIOENGINE_AMX": "0"},
                {"AIOENGINE_BF16_GEMM": "0"}):
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            assert CausalLM.pack_lm_head(holder) is None, env
    holder.lm_head = torch.randn(8, 64)  # a dense head: nothing to pack
    assert CausalLM.pack_lm_head(holder) is None


@needs_kernels
def test_fused_argmax_on_the_default_models_lm_head(two_threads, restore_gemm_settings):
    lm_head = default_lm_head()
    g = torch.Generator().manual_seed(0)
    # hidden states near real ones: token embeddings (tied head: that token wins big) and
    # mixes of two (two tokens close to each other at the top)
    emb = quant.embedding(torch.randint(0, lm_head.shape[0], (64, 2), generator=g), lm_head)
    mix = torch.rand(64, 1, generator=g)
    hidden = (emb[:, 0] * mix + emb[:, 1] * (1 - mix)) * 30
    for _, amx, bf16 in paths()[2:]:  # the engine's paths: AVX-512 and AMX
        cpu_ops.set_amx(amx)
        cpu_ops.set_bf16_gemm(bf16)
        for m in (1, 8, 32, 64):
            x = hidden[:m].contiguous()
            assert torch.equal(quant.argmax_linear(x, lm_head), quant.linear(x, lm_head).argmax(-1))


@needs_kernels
def test_the_runner_takes_the_fused_head_for_plain_greedy_steps_and_tokens_are_unchanged(
        monkeypatch):
    """The default model, 12 greedy requests side by side (GEMV and GEMM rows): the same
    tokens with the fused head as with logits + sampler; a request that asks for logprobs,
    a penalty, a logit bias or is under min_tokens sends its steps down the logits path
    (calls counted)."""
    from aioengine import LLM, SamplingParams

    llm = LLM(executor="inproc", max_num_seqs=16, num_threads=1)
    try:
        model = llm.executor.runner.model
        calls = {"fused": 0, "logits": 0}
        fused, logits = model.compute_greedy_tokens, model.compute_logits

        def count(name, fn):
            def wrapper(hidden):
                calls[name] += 1
                return fn(hidden)
            return wrapper

        monkeypatch.setattr(model, "compute_greedy_tokens", count("fused", fused))
        monkeypatch.setattr(model, "compute_logits", count("logits", logits))
        prompts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(12)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        with_fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert calls["fused"] >= 12 and calls["logits"] == 0
        monkeypatch.setattr(model, "compute_greedy_tokens", lambda hidden: None)
        unfused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert calls["logits"] >= 12
        assert with_fused == unfused
        monkeypatch.setattr(model, "compute_greedy_tokens", count("fused", fused))
        # a row that needs more than its argmax sends the whole step to logits + sampler
        greedy = dict(temperature=0, max_tokens=3, ignore_eos=True)
        for extra in (dict(logprobs=1), dict(presence_penalty=0.5), dict(repetition_penalty=1.2),
                      dict(logit_bias={13: 1.0}),  # EOS (a stop token) banned throughout:
                      dict(min_tokens=3, ignore_eos=False, stop_token_ids=[2])):
            calls.update(fused=0, logits=0)
            llm.generate(prompts[:2], [SamplingParams(**greedy),
                                       SamplingParams(**{**greedy, **extra})])
            assert calls["fused"] == 0 and calls["logits"] >= 3, extra
    finally:
        llm.shutdown()
