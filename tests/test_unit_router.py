"""The data-parallel router and the summed statistics (``aioengine.engine.data_parallel``).

The routing rule is checked against the module docstring's three steps, and
the prompt hashes against the KV cache manager's own, so a router that looked
up other hashes than the ones the replicas cache would fail here.
"""

from __future__ import annotations

import pytest

from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.engine.core import EngineStats
from aioengine.engine.data_parallel import PrefixCacheRouter, sum_stats
from aioengine.errors import EngineDeadError
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams


def test_most_cached_blocks_wins_at_equal_load_ties_go_to_the_lower_load():
    router = PrefixCacheRouter(block_size=16)
    d = router.route(loads=[0, 0, 0], cached_blocks=[2, 5, 4])
    assert (d.replica, d.cached_blocks, d.reason) == (1, 5, "prefix")
    d = router.route(loads=[3, 2, 1], cached_blocks=[30, 30, 30])
    assert (d.replica, d.reason) == (2, "prefix")


def test_each_request_in_flight_costs_four_blocks_of_cached_prefix():
    """A short prefix every prompt shares (a template's default system prompt)
    does not outweigh one more queued request; a long conversation's does."""
    router = PrefixCacheRouter(block_size=16)
    d = router.route(loads=[1, 0], cached_blocks=[2, 0])
    assert (d.replica, d.reason) == (1, "least_loaded")
    d = router.route(loads=[1, 0], cached_blocks=[4, 0])  # a tie: the lower load
    assert d.replica == 1
    d = router.route(loads=[2, 0], cached_blocks=[20, 0])
    assert (d.replica, d.cached_blocks, d.reason) == (0, 20, "prefix")


def test_no_cached_block_goes_to_the_least_loaded_lowest_rank_first():
    router = PrefixCacheRouter(block_size=16)
    assert router.route([2, 1, 1], [0, 0, 0]).replica == 1
    assert router.route([0, 0], [0, 0]).reason == "least_loaded"
    assert router.decisions["least_loaded"] == 2


def test_an_imbalanced_load_overrides_the_prefix():
    router = PrefixCacheRouter(block_size=16, balance_abs_threshold=8, balance_rel_threshold=1.5)
    # 20 against 2: past both thresholds, the idle replica takes it.
    d = router.route([20, 2], [100, 0])
    assert (d.replica, d.reason) == (1, "balance")
    # 9 against 2 is past the relative threshold but not the absolute one (7 <= 8).
    assert router.route([9, 2], [100, 0]).reason == "prefix"
    # 30 against 25: past the absolute threshold, not the relative one.
    assert router.route([30, 21], [100, 0]).reason == "prefix"


def test_replicas_that_cannot_take_requests_are_skipped():
    router = PrefixCacheRouter(block_size=16)
    d = router.route([None, 5], [9, 0])
    assert d.replica == 1
    with pytest.raises(EngineDeadError, match="no engine replica"):
        router.route([None, None], [0, 0])


def test_round_robin_cycles_over_live_replicas_and_ignores_caches():
    router = PrefixCacheRouter(block_size=16, policy="round_robin")
    picks = [router.route([0, None, 0], [0, 9, 9]).replica for _ in range(4)]
    assert picks == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="routing policy"):
        PrefixCacheRouter(block_size=16, policy="random")


def test_prompt_hashes_are_the_kv_cache_managers():
    """A prompt the manager cached is found block for block by the router's hashes,
    cache_salt included; a different salt finds nothing."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    req = Request(
        "a",
        tokens,
        SamplingParams(max_tokens=1),
        max_tokens=1,
        eos_token_id=None,
        cache_salt="tenant-1",
    )
    assert kv.allocate_slots(req, len(tokens)) is not None
    router = PrefixCacheRouter(block_size=4)
    hashes = router.prompt_hashes(tokens, cache_salt="tenant-1")
    assert hashes == req.block_hashes[:3]
    assert all(kv.block_pool.get_cached_block(h) is not None for h in hashes)
    other = router.prompt_hashes(tokens, cache_salt="tenant-2")
    assert all(kv.block_pool.get_cached_block(h) is None for h in other)


def test_sum_stats_adds_counts_and_recomputes_ratios():
    a = EngineStats(
        num_running=2,
        num_kv_blocks_total=100,
        num_kv_blocks_used=50,
        kv_cache_usage=0.5,
        prefix_cache_hits=7,
        max_reqs_in_step=4,
        last_step_time=0.02,
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=8,
        spec_decode_num_accepted_tokens=4,
        spec_decode_num_accepted_tokens_per_pos=[2, 1, 1],
        block_usage_map=[1, 0],
    )
    b = EngineStats(
        num_running=1,
        num_kv_blocks_total=100,
        num_kv_blocks_used=0,
        prefix_cache_hits=3,
        max_reqs_in_step=6,
        last_step_time=0.01,
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=8,
        spec_decode_num_accepted_tokens=0,
        spec_decode_num_accepted_tokens_per_pos=[0],
        block_usage_map=[2],
    )
    total = sum_stats([a, b])
    assert (total.num_running, total.prefix_cache_hits, total.num_kv_blocks_total) == (3, 10, 200)
    assert total.kv_cache_usage == 0.25
    assert total.max_reqs_in_step == 6 and total.last_step_time == 0.02
    assert total.spec_decode_acceptance_rate == 4 / 16
    assert total.spec_decode_mean_acceptance_length == 1 + 4 / 4
    assert total.spec_decode_num_accepted_tokens_per_pos == [2, 1, 1]
    assert total.block_usage_map == [1, 0, 2]
