"""The fp8 KV cache (``--kv-cache-dtype fp8`` = ``fp8_e4m3``, ``fp8_e5m2``; OFP8 E4M3 and
E5M2 as torch.float8_e4m3fn / torch.float8_e5m2, unscaled, saturating when written).

- The C++ cache write (``csrc/fp8.h`` ``store_row``: AVX-512 lanes and the scalar tail)
  equals torch's own conversion of the saturated values bit for bit, over every fp16
  value, every rounding tie of each format and its fp32 neighbours, and a random sweep.
- The kernels read every one of the 256 codes exactly (NaN, infinities and subnormals
  included), and their outputs equal a float64 torch oracle over the same fp8 cache:
  decode (the blocked AVX-512 kernel on 1 and 2 threads, the portable kernel that CPUs
  without AVX-512 run) over ragged lengths, batch sizes 1, 7 and 33 and GQA groups 1, 3
  and 8; prefill chunks with cached prefixes and decode rows among them (AVX-512 tiles,
  portable loops, and the AMX-BF16 tiles where the CPU has them); the fused decoder
  layers against the Python layer loop.
- Block copies (copy-on-write) move fp8 blocks byte for byte.
- On the default model, teacher-forced against the fp16 cache (16 prompts x 64 tokens of
  the fp16 run's greedy continuation; free-running greedy runs part at the first
  near-tie and compare different texts after it). Measured 2026-12-07 (two runs): E4M3
  991-996/1024 next tokens agree (96.8-97.3%), perplexity on ``TEXT`` 0.2% lower, mean
  |logprob difference| of the greedy tokens 0.049; E5M2 942-945/1024 (92.0-92.3%),
  perplexity 6.8% higher, 0.094-0.097.
  E4M3 keeps 3 mantissa bits (a relative rounding error up to 2^-4), E5M2 2 (2^-3), so
  E5M2 costs about twice as much. The thresholds hold each to what was measured with a
  margin of about half its gap to the fp16 cache.
- The config refuses fp8 where no kernel reads it (CUDA, non-fp32 activations), naming
  the option.
"""

from __future__ import annotations

import math

import pytest
import torch

import triton_kernels
from triton_kernels import attention_plan, cpu_ops, reference
from test_reference_attention import make_batch

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="the C++ CPU kernels did not build here")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def fp8_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return reference.to_kv_cache_dtype(x, dtype)


def write(values: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """``values`` (fp32, padded with zeros to rows of head_dim) through the C++ write;
    the cache's bytes."""
    n = -(-values.numel() // head_dim)
    rows = torch.zeros(n * head_dim)
    rows[:values.numel()] = values
    rows = rows.view(n, 1, head_dim)
    cache = torch.zeros(n, 1, 1, head_dim, dtype=dtype)
    assert cpu_ops.reshape_and_cache(rows, rows, cache, cache.clone(), torch.arange(n))
    return cache.view(-1)[:values.numel()].view(torch.uint8)


def probe_values(dtype: torch.dtype) -> torch.Tensor:
    """Every fp16 value (finite, infinite, NaN); each rounding tie of ``dtype`` (the
    midpoint of two neighbouring codes, and of the largest code and the next step past
    it) with its fp32 neighbours on both sides; large and tiny values; a random sweep
    of fp32 bit patterns over the exponents around the format's range."""
    every_fp16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = codes[torch.isfinite(codes)].unique()  # sorted, one zero
    step_past = grid[-1] * (1 + 2.0 ** -MANTISSA_BITS[dtype])
    edges = torch.cat([grid, step_past.view(1)])
    mids = (edges[1:] + edges[:-1]) / 2
    ties = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)),
                      mids.nextafter(torch.tensor(-math.inf))])
    g = torch.Generator().manual_seed(7)
    sweep = (torch.randint(0, 1 << 31, (200_000,), generator=g, dtype=torch.int64)
             .to(torch.int32).view(torch.float32))
    sweep = sweep[sweep.abs() < 1e6]
    specials = torch.tensor([math.inf, -math.inf, math.nan, 1e30, -1e30, 1e-30, -1e-30,
                             0.0, -0.0, 2.0 ** -20, 1e5, 7e4])
    x = torch.cat([every_fp16.float(), ties, specials, sweep])
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])  # 64: AVX-512 lanes only; 40: 32 + scalar tail
def test_cache_write_equals_torchs_conversion_bit_for_bit(dtype, head_dim):
    x = probe_values(dtype)
    ours = write(x, dtype, head_dim)
    top = torch.finfo(dtype).max
    expected = x.clamp(-top, top).to(dtype).view(torch.uint8)  # torch's rounding, saturated
    bad = (ours != expected).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} of {x.numel()} differ, e.g. {x[bad[:5]].tolist()}"
                              f" -> {ours[bad[:5]].tolist()} vs {expected[bad[:5]].tolist()}")
    # The torch twin of the write is the same function.
    assert torch.equal(reference.to_kv_cache_dtype(x, dtype).view(torch.uint8), ours)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_cache_write_saturates_and_keeps_nan(dtype):
    top = torch.finfo(dtype).max
    beyond = torch.tensor([top * 1.03, top * 1.1, 1e9, math.inf])
    out = write(torch.cat([beyond, -beyond, torch.tensor([math.nan])]), dtype, 64)
    values = out.view(dtype).float()
    assert values[:4].eq(top).all() and values[4:8].eq(-top).all(), values
    assert values[8].isnan()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_planned_write_takes_the_kernel_and_equals_the_torch_twin(dtype):
    """The model's write (``triton_kernels.reshape_and_cache`` with a plan) of fp32 K/V into
    an fp8 cache: the C++ kernel, equal to the torch twin's bytes; -1 slots skipped."""
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, d = 6, 16, 3, 64
    key = torch.randn(20, heads, d, generator=g) * 200  # some beyond E4M3's 448
    value = torch.randn(20, heads, d, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:20]
    slots[3] = -1
    caches = [torch.zeros(num_blocks, block_size, heads, d, dtype=dtype) for _ in range(4)]
    plan = triton_kernels.plan_attention(slots, torch.zeros(20, 1, dtype=torch.int32),
                                         torch.arange(21, dtype=torch.int32),
                                         torch.ones(20, dtype=torch.int32), 1, 1, caches[0])
    triton_kernels.reshape_and_cache(key, value, caches[0], caches[1], slots, plan)
    attention_plan.reshape_and_cache_planned(key, value, caches[2], caches[3], plan)
    for ours, twin in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.view(torch.uint8), twin.view(torch.uint8))
    written = caches[0].view(-1, heads, d)[slots[slots >= 0]]
    assert torch.equal(written.view(torch.uint8),
                       fp8_cache(key[slots >= 0], dtype).view(torch.uint8))
    assert caches[0].view(torch.uint8).count_nonzero() > 0


def oracle(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """Causal paged attention in float64 over the cache's own values (every row of
    sequence i at position seq_len - q_len + j sees keys 0 .. position)."""
    num_heads = query.shape[1]
    block_size, num_kv_heads, d = key_cache.shape[1:]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(seq_lens.numel()):
        q0, q1, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seq_lens[i])
        blocks = block_tables[i, :-(-n // block_size)].long()
        k = key_cache[blocks].double().reshape(-1, num_kv_heads, d)[:n]
        v = value_cache[blocks].double().reshape(-1, num_kv_heads, d)[:n]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q = query[q0:q1].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = torch.arange(n - (q1 - q0), n)
        scores.masked_fill_(torch.arange(n)[None, :] > pos[:, None], -math.inf)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def fp8_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """``make_batch`` with fp8 caches: K of the model's scale, V over a wide range of
    magnitudes (subnormals to saturated) so every exponent of the format is read."""
    batch = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 16, head_dim=head_dim,
                       seed=seed)
    g = torch.Generator().manual_seed(seed)
    v = batch["value_cache"]
    spread = 2.0 ** torch.randint(-14, 9, v.shape, generator=g).float()
    batch["key_cache"] = fp8_cache(batch["key_cache"] * 2, dtype)
    batch["value_cache"] = fp8_cache(v * spread, dtype)
    batch["block_tables"] = batch["block_tables"].clamp(max=v.shape[0] - 1)
    return batch


def assert_close_to_oracle(out, batch, scale, rel=1e-5):
    expected = oracle(batch["query"], batch["key_cache"], batch["value_cache"],
                      batch["block_tables"], batch["cu_seqlens_q"], batch["seq_lens"], scale)
    vmax = batch["value_cache"].float().abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=rel * vmax, rtol=0)


DECODE_BATCHES = {  # seq_lens: around the blocked kernel's 16-key chunks, ragged
    "batch1": [300],
    "batch7": [1, 3, 16, 17, 47, 129, 300],
    "batch33": [1 + (37 * i) % 211 for i in range(33)],  # >= 4 a thread: whole-sequence tasks
}


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("lens", DECODE_BATCHES)
def test_decode_kernels_equal_the_fp64_oracle(lens, num_heads, num_kv_heads, head_dim, dtype):
    seq_lens = DECODE_BATCHES[lens]
    batch = fp8_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, dtype,
                      seed=head_dim + num_heads + len(seq_lens))
    scale = batch["scale"] * 4  # peaked rows: a dropped chunk or a wrong rescale is far off
    threads = torch.get_num_threads()
    try:
        for num_threads, portable in ((1, False), (2, False), (2, True)):
            torch.set_num_threads(num_threads)
            out = torch.full_like(batch["query"], math.nan)
            cpu_ops.load().paged_attention_decode(
                out, batch["query"], batch["key_cache"], batch["value_cache"],
                batch["block_tables"], batch["seq_lens"], scale, portable)
            assert_close_to_oracle(out, batch, scale)
    finally:
        torch.set_num_threads(threads)


# (q_len, seq_len): whole prompts, chunks after unaligned and aligned prefixes, several
# 256-key spans, and decode rows among them (a mixed step's rows).
PREFILL_CHUNKS = [(5, 5), (16, 53), (1, 90), (40, 40), (33, 333), (17, 33), (1, 1)]


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_prefill_kernels_equal_the_fp64_oracle(num_heads, num_kv_heads, head_dim, dtype):
    q_lens, seq_lens = zip(*PREFILL_CHUNKS, strict=True)
    batch = fp8_batch(list(q_lens), list(seq_lens), num_heads, num_kv_heads, head_dim, dtype,
                      seed=head_dim + num_heads)
    scale = batch["scale"] * 4
    threads = torch.get_num_threads()
    try:
        for num_threads, portable in ((1, False), (2, False), (2, True)):
            torch.set_num_threads(num_threads)
            out = cpu_ops.prefill_attention(
                batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                batch["seq_lens"], batch["cu_seqlens_q"], scale, portable=portable)
            assert_close_to_oracle(out, batch, scale)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_prefill_amx_tiles_equal_the_fp64_oracle(num_heads, num_kv_heads, head_dim, dtype,
                                                 amx_attention):
    # fp8 K/V are exact in bf16, so the tiles take them whole (no lo half). fp32-grade
    # (the default: Q and P as bf16 hi + lo): within 2^-12 of max|V| on peaked rows;
    # plain bf16 (Q and P rounded to 8 significant bits): within 2 * 2^-8 of max|V|.
    q_lens, seq_lens = zip(*PREFILL_CHUNKS, strict=True)
    batch = fp8_batch(list(q_lens), list(seq_lens), num_heads, num_kv_heads, head_dim, dtype,
                      seed=head_dim + num_heads)
    threads = torch.get_num_threads()
    try:
        for bf16, sharpen, rel in ((False, 4, 2.0 ** -12), (True, 1, 2 * 2.0 ** -8)):
            amx_attention.set_bf16_attention(bf16)
            scale = batch["scale"] * sharpen
            for num_threads in (1, 2):
                torch.set_num_threads(num_threads)
                out = cpu_ops.prefill_attention(
                    batch["query"], batch["key_cache"], batch["value_cache"],
                    batch["block_tables"], batch["seq_lens"], batch["cu_seqlens_q"], scale)
                assert_close_to_oracle(out, batch, scale, rel)
    finally:
        torch.set_num_threads(threads)


def every_code_batch(dtype, finite_only=False):
    """One sequence of one key: K zero, V every one of the 256 codes (head_dim 256), so
    the attention output is V itself, exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    if finite_only:
        codes = torch.where(codes.float().isfinite(), codes.float(), 0.0).to(dtype)
    key_cache = torch.zeros(2, 16, 1, 256, dtype=dtype)
    value_cache = torch.zeros(2, 16, 1, 256, dtype=dtype)
    value_cache[1, 0, 0] = codes
    query = torch.randn(1, 2, 256)
    tables = torch.tensor([[1]], dtype=torch.int32)
    lens, cu = torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    expected = codes.float().expand(2, 256)[None]
    return query, key_cache, value_cache, tables, lens, cu, expected


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_kernels_read_every_code_exactly(dtype):
    query, kc, vc, tables, lens, cu, expected = every_code_batch(dtype)
    for portable in (False, True):
        out = torch.empty_like(query)
        cpu_ops.load().paged_attention_decode(out, query, kc, vc, tables, lens, 0.125, portable)
        torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)
        out = cpu_ops.prefill_attention(query, kc, vc, tables, lens, cu, 0.125,
                                        portable=portable)
        torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_amx_tiles_read_every_finite_code_exactly(dtype, amx_attention):
    # Finite codes only: the fp32-grade tiles multiply V by P's lo half (0 here), and
    # 0 * inf is NaN.
    query, kc, vc, tables, lens, cu, expected = every_code_batch(dtype, finite_only=True)
    out = cpu_ops.prefill_attention(query, kc, vc, tables, lens, cu, 0.125)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fused_decode_layers_over_an_fp8_cache_equal_the_python_forward(dtype):
    """The fused step (C++ write, decode and prefill kernels) against the Python layer loop
    (torch twin write, gather, upcast, SDPA) over one fp8 cache, a mixed step of prompt
    chunks and decode rows. Both write the same rounding of K/V that agree to ~1e-6 in
    fp32, so an fp8 code may differ by one step where a value sits at a rounding tie;
    the outputs agree to well within one such step's effect."""
    from test_decode_layers import ARCHS, count_fused_steps, hf_config, mixed_step, our_model

    model = our_model(hf_config(**ARCHS["llama_gqa3"]))
    input_ids, positions, kv_cache, attn = mixed_step(model, [7, 1, 20, 1], [30, 17, 20, 60],
                                                      16, seed=5)
    cache = fp8_cache(kv_cache, dtype)
    calls = count_fused_steps(model.decode_layers)
    cache_fused = cache.clone()
    hidden = model.forward(input_ids, positions, cache_fused, attn)
    assert calls == [True], "the step did not take the fused path"
    model.decode_layers = None
    cache_python = cache.clone()
    expected = model.forward(input_ids, positions, cache_python, attn)
    fused, python = cache_fused.view(torch.uint8), cache_python.view(torch.uint8)
    assert not torch.equal(fused, cache.view(torch.uint8)), "nothing was written"
    written = (fused != cache.view(torch.uint8)).sum().item()
    differ = (fused != python).sum().item()
    print(f"{differ} of {written} written cache bytes differ")
    assert differ <= 1e-2 * written, f"{differ} of {written} written cache bytes differ"
    diff = (cache_fused.float() - cache_python.float()).abs()
    step = cache_python.float().abs() * 2.0 ** -MANTISSA_BITS[dtype] + 2.0 ** -9
    assert (diff <= step).all(), "a cache value differs by more than one fp8 step"
    torch.testing.assert_close(hidden, expected, atol=1e-3 * expected.abs().max().item(),
                               rtol=0)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_block_copies_move_fp8_blocks_byte_for_byte(dtype):
    g = torch.Generator().manual_seed(2)
    kv = fp8_cache(torch.randn(3, 2, 8, 16, 2, 64, generator=g) * 100, dtype)
    mapping = torch.tensor([[1, 5], [2, 6], [0, 7]])
    expected = kv.clone().view(torch.uint8)
    expected[:, :, mapping[:, 1]] = expected[:, :, mapping[:, 0]]
    ours, twin = kv.clone(), kv.clone()
    triton_kernels.copy_blocks(ours, mapping)  # the C++ kernel
    reference.copy_blocks(twin, mapping)
    assert torch.equal(ours.view(torch.uint8), expected)
    assert torch.equal(twin.view(torch.uint8), expected)


def test_the_options_map_to_torchs_fp8_dtypes_and_refuse_where_unsupported():
    from aioengine.config import CacheConfig
    from aioengine.worker.model_runner import choose_kv_cache_dtype

    for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                        ("fp8_e5m2", torch.float8_e5m2)):
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
        assert choose_kv_cache_dtype(name, torch.float32, "cpu") == dtype
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {name} is supported on a CPU"):
            choose_kv_cache_dtype(name, torch.float32, "cuda")
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {name} needs --dtype float32"):
            choose_kv_cache_dtype(name, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8_e4m3fnuz")


def test_the_triton_kernels_refuse_an_fp8_cache():
    from triton_kernels.paged_attention_triton import _check_triton

    cache = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 KV cache"):
        _check_triton(torch.zeros(1, 1, 64), cache, cache)


# -- the default model -------------------------------------------------------------------

#: Teacher-forced next-token agreement with the fp16 cache and perplexity ratio on TEXT
#: (measured 96.8-97.3% / 0.998 for E4M3, 92.0-92.3% / 1.068 for E5M2; the module docstring).
MIN_AGREEMENT = {torch.float8_e4m3fn: 0.95, torch.float8_e5m2: 0.88}
MAX_PPL_RATIO = {torch.float8_e4m3fn: 1.01, torch.float8_e5m2: 1.10}
#: Mean |logprob difference| of the fp16 run's greedy tokens (measured 0.049 / 0.094).
MAX_MEAN_LOGPROB_DIFF = {torch.float8_e4m3fn: 0.1, torch.float8_e5m2: 0.2}


@pytest.fixture(scope="module")
def fp16_run(one_thread):
    """The default model with an fp16 cache: the greedy continuations and the teacher-forced
    log-softmaxes, the reference of the fp8 caches (swapped into the same runner)."""
    from aioengine import LLM
    from teacher_forcing import TEXT, greedy_sequences, teacher_forced

    llm = LLM(executor="inproc", max_num_seqs=16, num_threads=1, kv_cache_dtype="float16")
    prompt_ids, seqs = greedy_sequences(llm)
    text = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    ref = teacher_forced(llm, seqs), teacher_forced(llm, [text])[0]
    return llm, prompt_ids, seqs, text, ref


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_default_model_over_an_fp8_cache_stays_near_the_fp16_cache(dtype, fp16_run):
    from teacher_forcing import teacher_forced

    llm, prompt_ids, seqs, text, (ref, ref_text) = fp16_run
    from test_decode_layers import count_fused_steps

    runner = llm.executor.runner
    assert runner.model.decode_layers is not None, "the default model runs the fused step"
    fp16_cache = runner.kv_cache
    runner.kv_cache = torch.zeros(fp16_cache.shape, dtype=dtype)
    calls = count_fused_steps(runner.model.decode_layers)
    try:
        ours = teacher_forced(llm, seqs)
        (ours_text,) = teacher_forced(llm, [text])
    finally:
        runner.kv_cache = fp16_cache
        del runner.model.decode_layers.forward  # count_fused_steps' wrapper
    assert calls and all(calls), "a step left the fused path"
    agree = total = 0
    diffs = []
    for s, p, r, o in zip(seqs, prompt_ids, ref, ours, strict=True):
        gen = slice(len(p) - 1, len(s) - 1)
        agree += int((o[gen].argmax(-1) == r[gen].argmax(-1)).sum())
        total += gen.stop - gen.start
        tokens = torch.tensor(s[len(p):])[:, None]
        diffs.append((o[gen].gather(1, tokens) - r[gen].gather(1, tokens)).abs().flatten())
    target = torch.tensor(text[1:])[:, None]
    ppl_ratio = math.exp(-(ours_text.gather(1, target).mean()
                           - ref_text.gather(1, target).mean()).item())
    mean_diff = torch.cat(diffs).mean().item()
    print(f"{dtype}: {agree}/{total} next tokens agree with the fp16 cache; perplexity "
          f"ratio {ppl_ratio:.4f}; mean |logprob difference| {mean_diff:.4f}")
    assert agree >= MIN_AGREEMENT[dtype] * total
    assert ppl_ratio <= MAX_PPL_RATIO[dtype]
    assert mean_diff <= MAX_MEAN_LOGPROB_DIFF[dtype]


@pytest.mark.slow
def test_the_engine_serves_from_an_fp8_cache_of_twice_the_fp16_blocks(one_thread):
    """Through ``LLM.generate`` (prefill, mixed and decode steps of the scheduler): the
    runner holds a float8_e4m3fn cache, twice the blocks of fp16 in the same memory, and
    greedy output starts as the fp16 cache's does (the first 3 tokens of each prompt;
    measured: the runs part after 4 to 32 tokens, at near-ties)."""
    from aioengine import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for kv in ("float16", "fp8"):
        llm = LLM(executor="inproc", num_threads=1, kv_cache_dtype=kv,
                  kv_cache_memory_bytes=64 << 20)
        runs[kv] = (llm.executor.runner, [list(o.outputs[0].token_ids)
                                          for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    (half, half_out), (fp8, fp8_out) = runs["float16"], runs["fp8"]
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.num_blocks == 2 * half.num_blocks
    for a, b in zip(fp8_out, half_out, strict=True):
        assert a[:3] == b[:3], (a, b)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_the_torch_path_reads_an_fp8_cache_as_the_kernels_do(dtype):
    """Where the C++ kernels are off (``AIOENGINE_CPU_KERNELS=0``) or missing, the planned
    attention gathers, upcasts and runs SDPA over the same fp8 cache: equal to the fp64
    oracle, decode rows and prompt chunks alike."""
    q_lens, seq_lens = zip(*PREFILL_CHUNKS, strict=True)
    batch = fp8_batch(list(q_lens), list(seq_lens), 9, 3, 64, dtype, seed=3)
    plan = triton_kernels.plan_attention(
        torch.zeros(batch["query"].shape[0], dtype=torch.int64), batch["block_tables"],
        batch["cu_seqlens_q"], batch["seq_lens"], batch["max_seqlen_q"],
        batch["max_seqlen_k"], batch["key_cache"])
    out = attention_plan.paged_attention_planned(batch["query"], batch["key_cache"],
                                                 batch["value_cache"], plan, batch["scale"])
    assert_close_to_oracle(out, batch, batch["scale"])
