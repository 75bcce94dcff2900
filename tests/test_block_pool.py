"""BlockPool, FreeKVCacheBlockQueue and KVCacheManager."""

from __future__ import annotations

import pytest

from aioengine.core.block_pool import (
    ROOT_BLOCK_HASH,
    BlockPool,
    hash_block_tokens,
    hash_request_blocks,
)
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), 8, None, cache_salt=salt)


def test_hash_chain_is_deterministic_and_depends_on_parent_and_salt():
    a = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert len(a) * 8 >= 128
    assert a != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(ROOT_BLOCK_HASH, [5, 6, 7, 8]), "must chain on the parent"
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4], ("tenant",)) != a
    chain = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, 0, ROOT_BLOCK_HASH)
    assert chain == [a, b], "only full blocks are hashed"


def test_free_queue_order_after_frees_and_eviction():
    pool = BlockPool(6)
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    pool.cache_full_block(blocks[0], b"h0")
    pool.cache_full_block(blocks[1], b"h1")
    pool.free_blocks(reversed(blocks))
    # Uncached block 2 goes to the front (evicted first); cached ones to the back,
    # tail first so the prefix block 0 is evicted last.
    assert pool.free_block_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.get_cached_block(b"h0") is blocks[0]
    taken = pool.get_new_blocks(5)
    assert [b.block_id for b in taken] == [2, 3, 4, 5, 1]
    assert pool.get_cached_block(b"h1") is None, "evicted for reuse"
    assert pool.get_cached_block(b"h0") is blocks[0]


def test_prefix_hit_shares_blocks_and_ref_counts():
    kv = KVCacheManager(16, BS)
    tokens = list(range(10))
    r1 = make_request("a", tokens)
    assert kv.get_computed_blocks(r1) == ([], 0)
    assert kv.allocate_slots(r1, len(tokens)) is not None
    r1.num_computed_tokens = len(tokens)
    r2 = make_request("b", tokens[:8] + [99, 98])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits] == kv.get_block_ids("a")[:2]
    kv.allocate_slots(r2, 2, hits)
    assert [b.ref_cnt for b in hits] == [2, 2]
    kv.free(r1)
    assert [b.ref_cnt for b in hits] == [1, 1]
    kv.free(r2)
    assert kv.block_pool.num_free_blocks == 16
    # The partial third block (tokens 8, 9) was never cached.
    assert len(kv.block_pool.cached_block_hash_to_block) == 2


def test_fully_cached_prompt_recomputes_last_token():
    kv = KVCacheManager(16, BS)
    tokens = list(range(8))
    r1 = make_request("a", tokens)
    kv.allocate_slots(r1, 8)
    r2 = make_request("b", tokens)
    hits, n = kv.get_computed_blocks(r2)
    assert n == 4 and len(hits) == 1, "the last block is left to compute so its logits exist"


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(16, BS)
    tokens = list(range(9))
    kv.allocate_slots(make_request("a", tokens, salt="x"), 9)
    assert kv.get_computed_blocks(make_request("b", tokens, salt="y"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", tokens, salt="x"))[1] == 8


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(4, BS)
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.free(r1)  # two cached blocks now sit free
    r2 = make_request("b", list(range(8)) + list(range(100, 120)))
    hits, _ = kv.get_computed_blocks(r2)
    assert len(hits) == 2
    before = ([b.ref_cnt for b in kv.block_pool.blocks], kv.block_pool.num_free_blocks,
              kv.block_pool.free_block_queue.block_ids(),
              dict(kv.block_pool.cached_block_hash_to_block))
    assert kv.allocate_slots(r2, 20, hits) is None
    after = ([b.ref_cnt for b in kv.block_pool.blocks], kv.block_pool.num_free_blocks,
             kv.block_pool.free_block_queue.block_ids(),
             dict(kv.block_pool.cached_block_hash_to_block))
    assert before == after
    assert "b" not in kv.req_to_blocks


def test_double_free_is_an_error():
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])
