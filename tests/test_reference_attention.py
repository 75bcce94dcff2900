"""triton_kernels.reference (the CPU attention path) against a naive loop oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_kernels
from triton_kernels import attention_plan, reference

HEAD_DIM = 8
GQA = [(2, 2), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): group sizes 1, 3, 8


def naive_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                    scale):
    """One query row and head at a time, walking the block table token by token, in
    float64. Slow; for tiny shapes only."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i in range(seq_lens.shape[0]):
        q_start, q_end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        seq_len, q_len = int(seq_lens[i]), q_end - q_start
        for j in range(q_len):
            position = seq_len - q_len + j
            slots = [(int(block_tables[i, p // block_size]), p % block_size)
                     for p in range(position + 1)]
            for h in range(num_heads):
                keys = torch.stack([key_cache[b, o, h // group] for b, o in slots]).double()
                values = torch.stack([value_cache[b, o, h // group] for b, o in slots]).double()
                scores = keys @ query[q_start + j, h].double() * scale
                out[q_start + j, h] = torch.softmax(scores, 0) @ values
    return out


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype=torch.float32,
               head_dim=HEAD_DIM, seed=0, extra_columns=2, padding=10**6):
    """Random cache, query and metadata for sequences with the given new-token counts and
    total lengths. Block ids are shuffled; block-table padding holds ``padding``."""
    assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + extra_columns
    block_tables = torch.full((len(seq_lens), width), padding, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(cu_seqlens_q[-1]), num_heads, head_dim, generator=gen)
    return {
        "query": query.to(dtype), "key_cache": key_cache.to(dtype),
        "value_cache": value_cache.to(dtype), "block_tables": block_tables,
        "cu_seqlens_q": cu_seqlens_q, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": 1 / math.sqrt(head_dim), "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(seq_lens),
    }


def run_reference(batch):
    return reference.paged_attention(**batch)


def run_naive(batch):
    return naive_attention(batch["query"], batch["key_cache"], batch["value_cache"],
                           batch["block_tables"], batch["cu_seqlens_q"], batch["seq_lens"],
                           batch["scale"])


def assert_close_to_naive(batch, out, atol=2e-5):
    assert out.shape == batch["query"].shape and out.dtype == batch["query"].dtype
    torch.testing.assert_close(out.double(), run_naive(batch), atol=atol, rtol=0)


# Scenario name -> (q_lens, seq_lens) for a block size bs.
SCENARIOS = {
    "decode_len_1": lambda bs: ([1], [1]),
    "decode_one_block_multiple": lambda bs: ([1], [2 * bs]),
    "decode_ragged": lambda bs: ([1, 1, 1, 1], [1, bs, 2 * bs + 5, bs - 3]),
    "cold_prompt": lambda bs: ([bs + 7], [bs + 7]),
    "cold_prompts_ragged": lambda bs: ([3, 2 * bs, 1], [3, 2 * bs, 1]),
    "prefix_hit": lambda bs: ([5], [2 * bs + 5]),
    "prefix_hit_whole_blocks": lambda bs: ([bs], [3 * bs]),
    "mixed": lambda bs: ([1, 9, 1, bs, 4, 1], [2 * bs + 1, 9, bs, 2 * bs, bs + 3, 1]),
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reference_matches_naive_fp32(scenario, num_heads, num_kv_heads, block_size):
    q_lens, seq_lens = SCENARIOS[scenario](block_size)
    batch = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, block_size)
    assert_close_to_naive(batch, run_reference(batch))


@pytest.mark.parametrize("scenario", ["decode_ragged", "mixed", "prefix_hit"])
def test_dispatcher_uses_reference_on_cpu(scenario):
    batch = make_batch(*SCENARIOS[scenario](16), 6, 2, 16)
    torch.testing.assert_close(triton_kernels.paged_attention(**batch), run_reference(batch),
                               atol=0, rtol=0)


def test_decode_entry_points_match_unified_entry():
    batch = make_batch([1, 1, 1], [1, 40, 17], 6, 2, 16)
    args = (batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
            batch["seq_lens"], batch["scale"], batch["max_seqlen_k"])
    expected = run_reference(batch)
    torch.testing.assert_close(reference.paged_attention_decode(*args), expected)
    torch.testing.assert_close(triton_kernels.paged_attention_decode(*args), expected)
    torch.testing.assert_close(triton_kernels.paged_attention_prefill(**batch), expected)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("scenario", ["decode_ragged", "mixed", "cold_prompt"])
def test_reference_half_precision_within_tolerance(scenario, dtype, atol):
    # The oracle sees the same rounded inputs, so only the kernel's own rounding counts.
    batch = make_batch(*SCENARIOS[scenario](16), 6, 2, 16, dtype=dtype)
    out = run_reference(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), run_naive(batch), atol=atol, rtol=0)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_reference_random_batches(data):
    block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    num_heads, num_kv_heads = data.draw(st.sampled_from(GQA), label="heads")
    num_seqs = data.draw(st.integers(1, 4), label="num_seqs")
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs),
                         label="seq_lens")
    q_lens = [data.draw(st.integers(1, s), label="q_len") for s in seq_lens]
    batch = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, block_size, seed=sum(seq_lens))
    assert_close_to_naive(batch, run_reference(batch))


def test_block_table_padding_is_never_used():
    # -1, 0 and out-of-range ids in the padding columns must not change the result.
    outs = [run_reference(make_batch([1, 6, 1], [3, 20, 33], 6, 2, 16, padding=p))
            for p in (-1, 0, 10**6)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)


def test_works_inside_and_outside_inference_mode():
    # Regression: the CPU gather buffers are reused across calls; one created under
    # torch.inference_mode() cannot be written outside it.
    batch = make_batch([1, 1], [300, 17], 6, 2, 16)
    with torch.inference_mode():
        inside = run_reference(batch)
    outside = run_reference(batch)
    torch.testing.assert_close(inside, outside, atol=0, rtol=0)


def test_result_does_not_alias_reused_buffers():
    first_batch = make_batch([1, 1], [40, 17], 6, 2, 16, seed=1)
    first = run_reference(first_batch)
    snapshot = first.clone()
    run_reference(make_batch([1, 1], [40, 17], 6, 2, 16, seed=2))
    torch.testing.assert_close(first, snapshot, atol=0, rtol=0)


# -- reshape_and_cache -----------------------------------------------------------------------


def test_reshape_and_cache_writes_slots_and_skips_minus_one():
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    # key/value as views of one fused projection, as the model produces them.
    qkv = torch.randn(6, 3 * num_kv_heads * head_dim)
    key = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(6, 2, 8)
    value = qkv[:, 2 * num_kv_heads * head_dim:].view(6, 2, 8)
    slot_mapping = torch.tensor([0, -1, 7, 19, -1, 9], dtype=torch.int64)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    expected_k = torch.zeros_like(key_cache)
    expected_v = torch.zeros_like(value_cache)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[token]
            expected_v[slot // block_size, slot % block_size] = value[token]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_reshape_and_cache_into_a_layer_view_of_the_whole_cache():
    kv_cache = torch.zeros(3, 2, 4, 4, 2, 8)  # [layers, 2, blocks, block_size, heads, dim]
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    triton_kernels.reshape_and_cache(key, value, kv_cache[1, 0], kv_cache[1, 1],
                                     torch.tensor([5, 14]))
    assert torch.equal(kv_cache[1, 0, 1, 1], key[0]) and torch.equal(kv_cache[1, 1, 3, 2], value[1])
    assert kv_cache[0].abs().sum() == 0 and kv_cache[2].abs().sum() == 0
    assert int((kv_cache[1] != 0).any(-1).any(-1).sum()) == 4  # two slots x (K, V)


def test_cache_then_attend_round_trip():
    # A prompt written by reshape_and_cache then read back by attention equals plain
    # causal attention over the prompt.
    num_heads, num_kv_heads, head_dim, block_size, n = 6, 2, 8, 4, 11
    key_cache = torch.zeros(8, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    q, k, v = (torch.randn(n, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    block_table = torch.tensor([[6, 2, 5]], dtype=torch.int32)
    slots = torch.tensor([int(block_table[0, p // block_size]) * block_size + p % block_size
                          for p in range(n)])
    triton_kernels.reshape_and_cache(k, v, key_cache, value_cache, slots)
    out = triton_kernels.paged_attention(q, key_cache, value_cache, block_table,
                                         torch.tensor([0, n], dtype=torch.int32),
                                         torch.tensor([n], dtype=torch.int32), 0.5, n, n)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1), is_causal=True, scale=0.5).transpose(0, 1)
    torch.testing.assert_close(out, expected)


# -- argument checks -------------------------------------------------------------------------


def _bad(batch, **changes):
    return {**batch, **changes}


@pytest.mark.parametrize("change,message", [
    (lambda b: {"query": b["query"][:, :, :4]}, "head_dim"),
    (lambda b: {"query": b["query"][:, :5]}, "not a multiple of num_kv_heads"),
    (lambda b: {"query": b["query"].double()}, "dtype"),
    (lambda b: {"value_cache": b["value_cache"][:-1]}, "value_cache shape"),
    (lambda b: {"block_tables": b["block_tables"][:1]}, "block_tables has 1 rows"),
    (lambda b: {"block_tables": b["block_tables"].float()}, "block_tables must be int32"),
    (lambda b: {"seq_lens": b["seq_lens"].float()}, "seq_lens must be int32"),
    (lambda b: {"cu_seqlens_q": b["cu_seqlens_q"][:-1]}, "cu_seqlens_q must have"),
    (lambda b: {"max_seqlen_k": 10**6}, "max_seqlen_k"),
    (lambda b: {"max_seqlen_q": 0}, "max_seqlen_q"),
    (lambda b: {"query": b["query"].to("meta")}, "one device"),
])
def test_attention_argument_errors(change, message):
    batch = make_batch([1, 6], [20, 6], 6, 2, 16)
    with pytest.raises(ValueError, match=message):
        reference.paged_attention(**_bad(batch, **change(batch)))


def test_decode_rejects_more_rows_than_sequences():
    b = make_batch([1, 1], [20, 6], 6, 2, 16)
    with pytest.raises(ValueError, match="one query per sequence"):
        reference.paged_attention_decode(torch.cat([b["query"], b["query"]]), b["key_cache"],
                                         b["value_cache"], b["block_tables"], b["seq_lens"],
                                         b["scale"], b["max_seqlen_k"])


@pytest.mark.parametrize("args,message", [
    ({"key": torch.randn(3, 2, 4)}, "key must be"),
    ({"value": torch.randn(3, 2, 8, dtype=torch.float16)}, "value dtype"),
    ({"slot_mapping": torch.tensor([0, 1])}, "slot_mapping has 2 entries"),
    ({"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, "slot_mapping must be int32"),
])
def test_reshape_and_cache_argument_errors(args, message):
    kwargs = {"key": torch.randn(3, 2, 8), "value": torch.randn(3, 2, 8),
                  "key_cache": torch.zeros(4, 4, 2, 8), "value_cache": torch.zeros(4, 4, 2, 8),
                  "slot_mapping": torch.tensor([0, 1, 2])}
    with pytest.raises(ValueError, match=message):
        triton_kernels.reshape_and_cache(**{**kwargs, **args})


# -- one plan per step -----------------------------------------------------------------------


def _slot_mapping(batch) -> torch.Tensor:
    """The cache slots of each sequence's new tokens, as the model runner builds them."""
    block_size = batch["key_cache"].shape[1]
    slots = []
    for i in range(batch["seq_lens"].shape[0]):
        q_len = int(batch["cu_seqlens_q"][i + 1] - batch["cu_seqlens_q"][i])
        seq_len = int(batch["seq_lens"][i])
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(batch["block_tables"][i, p // block_size]) * block_size
                         + p % block_size)
    return torch.tensor(slots, dtype=torch.int64)


def _plan(batch, slot_mapping=None):
    return triton_kernels.plan_attention(
        _slot_mapping(batch) if slot_mapping is None else slot_mapping, batch["block_tables"],
        batch["cu_seqlens_q"], batch["seq_lens"], batch["max_seqlen_q"], batch["max_seqlen_k"],
        batch["key_cache"])


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_planned_attention_equals_unplanned_and_serves_every_layer(scenario, num_heads,
                                                                  num_kv_heads):
    # One plan, several "layers" with different caches and queries: each planned call must
    # equal the self-planning call (bit for bit on the torch path; the C++ decode kernel
    # of cpu_ops, when built, sums in another order) and the naive oracle.
    q_lens, seq_lens = SCENARIOS[scenario](16)
    batches = [make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 16, seed=s)
               for s in range(3)]
    for b in batches[1:]:  # a step's layers share the metadata, not the contents
        b["block_tables"] = batches[0]["block_tables"]
        b["cu_seqlens_q"] = batches[0]["cu_seqlens_q"]
    plan = _plan(batches[0])
    for b in batches:
        planned = triton_kernels.paged_attention(**b, plan=plan)
        torch.testing.assert_close(planned, run_reference(b), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(attention_plan.paged_attention_planned(
            b["query"], b["key_cache"], b["value_cache"], plan, b["scale"]), run_reference(b),
            atol=0, rtol=0)
        assert_close_to_naive(b, planned)


def test_planned_cache_write_equals_unplanned_with_padding_slots():
    key_cache = torch.zeros(5, 4, 2, 8)
    value_cache = torch.zeros_like(key_cache)
    key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slot_mapping = torch.tensor([0, -1, 7, 19, -1, 9])
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    triton_kernels.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    plan = triton_kernels.plan_attention(slot_mapping, torch.zeros(6, 5, dtype=torch.int32),
                                         torch.arange(7, dtype=torch.int32),
                                         torch.full((6,), 20, dtype=torch.int32), 1, 20, key_cache)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, plan=plan)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 4  # the two -1 tokens are skipped


def test_plan_checks_slots_and_metadata_once():
    batch = make_batch([1, 6], [20, 6], 6, 2, 16)
    num_slots = batch["key_cache"].shape[0] * 16
    with pytest.raises(IndexError, match="past the end of the cache"):
        _plan(batch, slot_mapping=torch.tensor([0] * 6 + [num_slots]))
    slots = _slot_mapping(batch)
    with pytest.raises(ValueError, match="cu_seqlens_q must have"):
        _plan({**batch, "cu_seqlens_q": batch["cu_seqlens_q"][:-1]}, slots)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        _plan({**batch, "max_seqlen_k": 10**6}, slots)
    # seq_lens beyond max_seqlen_k (or below 1) would send the C++ kernel past the block
    # table's row: refused once per step.
    for bad in (torch.tensor([21, 6], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)):
        with pytest.raises(ValueError, match="seq_lens must be in"):
            _plan({**batch, "seq_lens": bad}, slots)


def test_planned_calls_reject_tensors_of_another_step():
    batch = make_batch([1, 6], [20, 6], 6, 2, 16)
    plan = _plan(batch)
    with pytest.raises(ValueError, match="do not match the plan"):
        triton_kernels.paged_attention(**{**batch, "query": batch["query"][:3]}, plan=plan)
    with pytest.raises(ValueError, match="do not match the plan"):
        triton_kernels.paged_attention(**{**batch, "key_cache": batch["key_cache"][:-1],
                                          "value_cache": batch["value_cache"][:-1]}, plan=plan)
    with pytest.raises(ValueError, match="do not match the plan"):
        triton_kernels.reshape_and_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8),
                                         batch["key_cache"], batch["value_cache"],
                                         torch.tensor([0, 1]), plan=plan)
