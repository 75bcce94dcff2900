"""The C++ CPU kernels (triton_kernels/csrc/, one file per kernel) against the torch path.

The decode attention kernel reads K/V in place through the block table; it must equal
the gather + SDPA reference (and the naive loop oracle) over ragged lengths, GQA
groups, block sizes and shuffled block ids. The fused element-wise ops must equal
their torch forms, which follow HF's LlamaRMSNorm and SwiGLU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import triton_kernels
from triton_kernels import cpu_ops, reference
from test_reference_attention import GQA, SCENARIOS, _plan, assert_close_to_naive, make_batch

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="the C++ CPU kernels did not build here")


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA + [(4, 4)])
@pytest.mark.parametrize("seq_lens", [[1], [17], [1, 40, 33, 16, 300], [2000]])
def test_decode_kernel_equals_reference(seq_lens, num_heads, num_kv_heads, block_size):
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, block_size,
                       head_dim=64)
    plan = _plan(batch)
    out = cpu_ops.decode_attention(batch["query"], batch["key_cache"], batch["value_cache"],
                                   plan.decode, batch["scale"])
    expected = reference.paged_attention(**batch)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("scenario", ["decode_ragged", "mixed", "decode_len_1"])
def test_planned_dispatcher_uses_the_kernel_and_matches_naive(scenario, monkeypatch):
    # The model's path (plan=) goes through the C++ kernel for decode rows: count calls.
    batch = make_batch(*SCENARIOS[scenario](16), 6, 2, 16)
    calls = []
    real = cpu_ops.load().paged_attention_decode

    class Spy:
        def __getattr__(self, name):
            return getattr(cpu_ops._module, name)

        def paged_attention_decode(self, *args):
            calls.append(args[1].shape[0])
            return real(*args)

    monkeypatch.setattr(cpu_ops, "_module", Spy())
    out = triton_kernels.paged_attention(**batch, plan=_plan(batch))
    assert calls, "the planned CPU path did not use the C++ decode kernel"
    assert_close_to_naive(batch, out)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_decode_kernel_half_precision(dtype, atol):
    # The engine routes half dtypes to torch (faster there); the kernel itself still works.
    batch = make_batch([1, 1, 1], [5, 70, 31], 8, 2, 16, dtype=dtype, head_dim=64)
    plan = _plan(batch).decode
    out = torch.empty_like(batch["query"])
    cpu_ops.load().paged_attention_decode(out, batch["query"], batch["key_cache"],
                                          batch["value_cache"], plan.block_table, plan.seq_lens,
                                          batch["scale"])
    assert cpu_ops._ops_for(dtype) is None and cpu_ops._ops_for(torch.float32) is not None
    torch.testing.assert_close(out.float(), reference.paged_attention(**batch).float(),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 80, 128, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA + [(10, 2)])
def test_blocked_and_portable_kernels_equal_the_reference(num_heads, num_kv_heads, head_dim,
                                                          cache_dtype):
    # The blocked AVX-512 kernel takes fp32 queries with head_dim a multiple of 16 (40
    # goes to the portable one on every CPU); both must equal SDPA over the widened cache
    # at ragged lengths around its 16-key chunks, group sizes 1/3/8/5 (its 4-head tiles
    # plus a remainder), 1 and 2 threads (tasks split by keys) and padded block tables.
    seq_lens = [1, 15, 16, 17, 47, 300, 2]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 16,
                       head_dim=head_dim)
    for name in ("key_cache", "value_cache"):
        batch[name] = batch[name].to(cache_dtype)
    plan = _plan(batch).decode
    expected = reference.paged_attention(**{**batch, "key_cache": batch["key_cache"].float(),
                                            "value_cache": batch["value_cache"].float()})
    threads = torch.get_num_threads()
    try:
        # 1 thread: 7 sequences >= 4 per thread, so a blocked task takes all KV heads of
        # its sequence; 2 threads: one KV head a task.
        for num_threads, portable in ((1, False), (2, False), (2, True)):
            torch.set_num_threads(num_threads)
            out = torch.full_like(batch["query"], float("nan"))
            cpu_ops.load().paged_attention_decode(out, batch["query"], batch["key_cache"],
                                                  batch["value_cache"], plan.block_table,
                                                  plan.seq_lens, batch["scale"], portable)
            torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


# Decode lengths around the blocked kernel's 16-key chunks and quads: 1, a partial quad,
# exactly one chunk, one more, several chunks plus a ragged tail, and many (7 sequences:
# at 2 threads fewer than 4 a thread, so a task is one KV head).
DECODE_LENS = [1, 3, 16, 17, 47, 129, 300]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_decode_kernel_window_softcap_equal_the_torch_reference(num_heads, num_kv_heads,
                                                                head_dim, cache_dtype):
    # The decode kernel's online softmax (one pass, 16 keys a chunk, the accumulator
    # rescaled when a chunk raises a head's max) against the torch oracle with HF's
    # sliding-window and soft-cap masks on the widened cache: groups 1/3/8, head_dim
    # 64/80/128, fp32/fp16/bf16 caches, ragged lengths, 1 thread (a task takes every KV
    # head of a sequence) and 2 (one KV head a task), and the portable kernel. The scores
    # are sharpened (scale x 4) so a wrong rescale or a dropped chunk is far off.
    from types import SimpleNamespace

    from aioengine.models.layers.attention import windowed_paged_attention

    batch = make_batch([1] * len(DECODE_LENS), DECODE_LENS, num_heads, num_kv_heads, 16,
                       head_dim=head_dim, seed=head_dim + num_heads)
    for name in ("key_cache", "value_cache"):
        batch[name] = batch[name].to(cache_dtype)
    plan = _plan(batch).decode
    attn = SimpleNamespace(cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
                           block_tables=plan.block_table)
    scale = batch["scale"] * 4
    threads = torch.get_num_threads()
    try:
        for window, softcap in ((None, None), (24, None), (None, 1.5), (16, 2.0)):
            expected = windowed_paged_attention(
                batch["query"], batch["key_cache"].float(), batch["value_cache"].float(), attn,
                scale, window, softcap)
            for num_threads, portable in ((1, False), (2, False), (1, True)):
                torch.set_num_threads(num_threads)
                out = torch.full_like(batch["query"], float("nan"))
                cpu_ops.load().paged_attention_decode(
                    out, batch["query"], batch["key_cache"], batch["value_cache"],
                    plan.block_table, plan.seq_lens, scale, portable, window or 0, softcap or 0.0)
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


# (q_len, seq_len) per sequence: a whole prompt (prefix 0) of 1, 5 and 70 tokens (five
# 16-token tiles), chunks after a prefix that is not block-aligned (37), block-aligned
# (16) and long enough for several 256-key spans (300), and a decode row among them.
PREFILL_CHUNKS = [(5, 5), (16, 53), (1, 90), (70, 70), (33, 333), (17, 33), (1, 1)]


def prefill_case(chunks, num_heads: int, num_kv_heads: int, head_dim: int,
                 cache_dtype: torch.dtype):
    """A prefill batch of ``chunks`` ``[(q_len, seq_len)]`` with its caches in
    ``cache_dtype``: ``(batch, block_tables clamped to the cache, attention metadata
    for windowed_paged_attention)``."""
    from types import SimpleNamespace

    q_lens, seq_lens = zip(*chunks, strict=True)
    batch = make_batch(list(q_lens), list(seq_lens), num_heads, num_kv_heads, 16,
                       head_dim=head_dim, seed=head_dim + num_heads)
    for name in ("key_cache", "value_cache"):
        batch[name] = batch[name].to(cache_dtype)
    block_tables = batch["block_tables"].clamp(max=batch["key_cache"].shape[0] - 1)
    attn = SimpleNamespace(cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
                           block_tables=block_tables)
    return batch, block_tables, attn


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_prefill_kernel_equals_the_torch_reference(num_heads, num_kv_heads, head_dim,
                                                   cache_dtype):
    # The C++ chunked-prefill attention (AVX-512 tiles on 1 and 2 threads, and the portable
    # loops) against the torch oracle with HF's causal, sliding-window and soft-cap masks
    # (windowed_paged_attention) on the widened cache: ragged chunks and prefixes, groups
    # 1/3/8. A kernel that let a query see a later key, dropped the prefix, mis-rescaled a
    # span of the online softmax or read the wrong head fails by far more than rounding.
    from aioengine.models.layers.attention import windowed_paged_attention

    batch, block_tables, attn = prefill_case(PREFILL_CHUNKS, num_heads, num_kv_heads,
                                             head_dim, cache_dtype)
    threads = torch.get_num_threads()
    try:
        for window, softcap in ((None, None), (24, None), (None, 1.5)):
            expected = windowed_paged_attention(
                batch["query"], batch["key_cache"].float(), batch["value_cache"].float(), attn,
                batch["scale"] * 4, window, softcap)  # x4: peaked softmax rows
            for num_threads, portable in ((1, False), (2, False), (2, True)):
                torch.set_num_threads(num_threads)
                out = cpu_ops.prefill_attention(
                    batch["query"], batch["key_cache"], batch["value_cache"], block_tables,
                    batch["seq_lens"], batch["cu_seqlens_q"], batch["scale"] * 4, window,
                    softcap, portable)
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


# (q_len, seq_len) for the AMX prefill tiles: chunk lengths 1..40 with tails that are not
# a multiple of the 16-token tile, prefixes 0..600 (block-aligned 256, partial 53 - 16,
# 333 - 33, 600 with 40 new tokens: three 256-key spans), and 1-token rows among them.
AMX_PREFILL_CHUNKS = [(5, 5), (16, 53), (1, 90), (40, 40), (33, 333), (17, 33), (1, 1),
                      (40, 640), (9, 265), (23, 23)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_prefill_amx_tiles_equal_the_torch_reference(num_heads, num_kv_heads, head_dim,
                                                     cache_dtype, amx_attention):
    # The AMX-BF16 prefill tiles (csrc/attention.h prefill_amx) against the torch oracle:
    # groups 1/3/8, head_dim 64/80 (a half-filled 32-dim chunk)/128, fp32/fp16/bf16 caches,
    # padded block tables, causal, window and soft-cap masks, 1 and 2 threads, both
    # precisions. fp32-grade (the default: hi + lo operands, three products a tile) on
    # sharpened scores (scale x 4), where a dropped span or a wrong mask is far off, within
    # 2e-4 (the lo * lo terms left out, 2^-16 of a product, on scores up to ~20). Plain
    # bf16 (set_bf16_attention(True)): Q, K, P and V rounded to 8 significant bits,
    # relative error 2^-8 each, so the output is within two bf16 roundings of the largest
    # |v| (2 * 2^-8 * max|v|) at the model's scale.
    from aioengine.models.layers.attention import windowed_paged_attention

    batch, block_tables, attn = prefill_case(AMX_PREFILL_CHUNKS, num_heads, num_kv_heads,
                                             head_dim, cache_dtype)
    key_cache, value_cache = batch["key_cache"].float(), batch["value_cache"].float()
    bf16_atol = 2 * 2.0**-8 * value_cache.abs().max().item()
    threads = torch.get_num_threads()
    try:
        for bf16, sharpen, atol in ((False, 4, 2e-4), (True, 1, bf16_atol)):
            amx_attention.set_bf16_attention(bf16)
            scale = batch["scale"] * sharpen
            for window, softcap in ((None, None), (24, None), (None, 1.5), (16, 2.0)):
                if window is None and softcap is None:
                    expected = reference.paged_attention(
                        batch["query"], key_cache, value_cache, block_tables,
                        batch["cu_seqlens_q"], batch["seq_lens"], scale,
                        batch["max_seqlen_q"], batch["max_seqlen_k"])
                else:
                    expected = windowed_paged_attention(batch["query"], key_cache,
                                                        value_cache, attn, scale, window,
                                                        softcap)
                for num_threads in (1, 2):
                    torch.set_num_threads(num_threads)
                    out = cpu_ops.prefill_attention(
                        batch["query"], batch["key_cache"], batch["value_cache"],
                        block_tables, batch["seq_lens"], batch["cu_seqlens_q"], scale,
                        window, softcap)
                    torch.testing.assert_close(out, expected, atol=atol, rtol=0)
    finally:
        torch.set_num_threads(threads)


def test_prefill_amx_tiles_read_only_the_sequence_tokens(amx_attention):
    # The AMX tiles pad partial key groups, chunks and head dims with zeros rather than
    # reading past a sequence's keys: NaN in every other slot changes nothing.
    q_lens, seq_lens = [7, 20, 1], [7, 45, 30]
    batch = make_batch(q_lens, seq_lens, 9, 3, 16, head_dim=80)
    block_tables = batch["block_tables"].clamp(max=batch["key_cache"].shape[0] - 1)
    args = (block_tables, batch["seq_lens"], batch["cu_seqlens_q"], batch["scale"])
    clean = cpu_ops.prefill_attention(batch["query"], batch["key_cache"],
                                      batch["value_cache"], *args)
    for cache in (batch["key_cache"], batch["value_cache"]):
        used = torch.zeros(cache.shape[:2], dtype=torch.bool)
        for i, n in enumerate(seq_lens):
            for p in range(n):
                used[int(block_tables[i, p // 16]), p % 16] = True
        cache[~used] = float("nan")
    poisoned = cpu_ops.prefill_attention(batch["query"], batch["key_cache"],
                                         batch["value_cache"], *args)
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


def test_decode_kernel_reads_only_the_sequence_tokens():
    # NaN in every slot past each sequence's length and in unused blocks: a kernel that
    # read them would return NaN.
    batch = make_batch([1, 1], [20, 7], 6, 2, 16, head_dim=64)
    plan = _plan(batch)
    clean = cpu_ops.decode_attention(batch["query"], batch["key_cache"],
                                     batch["value_cache"], plan.decode, batch["scale"])
    for cache in (batch["key_cache"], batch["value_cache"]):
        used = torch.zeros(cache.shape[:2], dtype=torch.bool)
        for i, n in enumerate([20, 7]):
            for p in range(n):
                used[int(batch["block_tables"][i, p // 16]), p % 16] = True
        cache[~used] = float("nan")
    poisoned = cpu_ops.decode_attention(batch["query"], batch["key_cache"],
                                        batch["value_cache"], plan.decode, batch["scale"])
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0),
                                        (torch.float16, 0.0)])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fused_add_rms_norm_equals_torch(rows, dtype, atol):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    x_ref, res_ref = x.clone(), residual.clone()
    reference.fused_add_rms_norm(x_ref, res_ref, weight, 1e-5)
    triton_kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    # The residual add is one rounding in both; the norm's sum order differs in fp32.
    torch.testing.assert_close(residual, res_ref, atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(x, x_ref, atol=atol, rtol=1e-5)
    else:  # one rounding step of the output dtype at most
        assert (x.float() - x_ref.float()).abs().max() <= (x_ref.float().abs().max() / 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_torch(dtype):
    x = (torch.randn(5, 2 * 1536) * 4).to(dtype)
    expected = reference.silu_and_mul(x)
    out = triton_kernels.silu_and_mul(x)
    assert out.shape == (5, 1536) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5 if dtype ==
                               torch.float32 else 2e-2, rtol=1e-5 if dtype == torch.float32
                               else 1e-2)


def test_a_build_killed_midway_does_not_block_the_next(tmp_path):
    # torch's build lock, left behind by a builder killed mid-build, used to make every
    # later load wait forever. Reproduce the leftover in a fresh extensions dir.
    code = ("import os, pathlib, triton_kernels.cpu_ops as c; "
            "d = c._build_root() / f'aioengine_cpu_ops_{c._build_key()}'; "
            "d.mkdir(parents=True, exist_ok=True); (d / 'lock').touch(); "
            "m = c.load(); print('loaded', m is not None, (d / 'lock').exists())")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=540)
    assert result.returncode == 0, result.stderr
    assert "loaded True False" in result.stdout


def test_switched_off_by_environment_uses_torch_path():
    """And says so, once (the second ``load()`` is answered from the first), as
    docs/troubleshooting.md §5 tells the user to look for."""
    code = ("import torch, triton_kernels; from triton_kernels import cpu_ops; "
            "assert cpu_ops.load() is None; assert cpu_ops.load() is None; "
            "x = torch.randn(2, 8); r = torch.randn(2, 8); "
            "triton_kernels.fused_add_rms_norm(x, r, torch.ones(8), 1e-6); "
            "print(triton_kernels.silu_and_mul(torch.randn(2, 8)).shape)")
    env = {**os.environ, "AIOENGINE_CPU_KERNELS": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 4])" in result.stdout
    # No logging configured: the message reaches stderr through logging's last resort.
    warning = "aioengine CPU kernels unavailable, using the torch path: AIOENGINE_CPU_KERNELS=0"
    assert result.stderr.count(warning) == 1, result.stderr
