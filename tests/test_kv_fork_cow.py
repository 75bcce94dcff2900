"""Fork and copy-on-write of KV blocks (KVCacheManager.fork, PagedAttention §4.4).

A unit test pins the one case beam search lives on: two sharers of a partial
block cost exactly one copy, scheduled before the write. A hypothesis state
machine then plays scheduler and worker over fork / append / free / preempt
on small pools: the "worker" applies ``take_copy_blocks`` before writing each
step's tokens into simulated K/V slots, and the test checks after every step
that every live request reads back exactly its own tokens, that no block is
written while another table holds it, that reference counts equal the number
of tables holding each block, and that freeing everything returns every block.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), 64, None)


def test_partial_shared_block_is_copied_once_before_the_write():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = _request("p", list(range(6)))
    assert kv.allocate_slots(parent, 6) is not None
    parent.num_computed_tokens = 6           # the prefill ran: 1 full + 1 partial block
    parent.append_output_token_ids([100])
    b0, b1 = kv.req_to_blocks["p"]
    child = _request("c", list(range(6)))
    child.append_output_token_ids([200])     # the other beam: same prefix, own last token
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.req_to_blocks["c"] == [b0, b1]
    assert (b0.ref_cnt, b1.ref_cnt) == (2, 2)
    assert kv.num_shared_blocks() == 2
    free_before = kv.block_pool.num_free_blocks

    # The first writer into the shared partial block gets a copy ...
    assert kv.allocate_slots(parent, 1) == []
    new = kv.req_to_blocks["p"][1]
    assert new is not b1 and new.ref_cnt == 1
    assert kv.take_cow_replaced("p") == [(1, new.block_id)]
    # ... the last holder writes in place: no second copy.
    assert kv.allocate_slots(child, 1) == []
    assert kv.req_to_blocks["c"] == [b0, b1]
    assert kv.take_cow_replaced("c") == []
    assert kv.take_copy_blocks() == [(b1.block_id, new.block_id)]
    assert kv.num_cow_copies == 1
    assert (b0.ref_cnt, b1.ref_cnt) == (2, 1)
    assert kv.block_pool.num_free_blocks == free_before - 1
    assert kv.take_copy_blocks() == []       # taken once

    kv.free(parent)
    kv.free(child)
    assert kv.block_pool.num_free_blocks == 8


def test_failed_allocation_changes_nothing_even_with_a_copy_due():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    parent = _request("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.append_output_token_ids([1])
    child = _request("c", list(range(7)))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    other = _request("o", [9])
    kv.allocate_slots(other, 1)              # the last free block
    tables = {k: list(v) for k, v in kv.req_to_blocks.items()}
    refs = [b.ref_cnt for b in kv.block_pool.blocks]
    assert kv.allocate_slots(parent, 1) is None   # the copy needs a block; none is free
    assert {k: list(v) for k, v in kv.req_to_blocks.items()} == tables
    assert [b.ref_cnt for b in kv.block_pool.blocks] == refs
    assert kv.take_copy_blocks() == [] and kv.num_cow_copies == 0


def test_fork_does_not_share_blocks_past_the_written_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = _request("p", list(range(9)))
    kv.allocate_slots(parent, 9)             # 3 blocks, nothing written yet but 8 tokens
    parent.num_computed_tokens = 8
    child = _request("c", list(range(9)))
    kv.fork(parent, child)
    assert len(kv.req_to_blocks["c"]) == 2
    assert [b.ref_cnt for b in kv.req_to_blocks["p"]] == [2, 2, 1]
    # Full written blocks shared at a block boundary: the child's next block is new.
    child.num_computed_tokens = 8
    assert len(kv.allocate_slots(child, 1)) == 1
    assert kv.take_copy_blocks() == []


class ForkMachine(RuleBasedStateMachine):
    """Requests decode one token per step; forks copy a request mid-block."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Request] = {}
        self.slots: dict[int, list[int | None]] = {}
        self.counter = 0
        self.rng = random.Random(0)

    @initialize(num_blocks=st.integers(3, 14), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
        self.slots = {i: [None] * BLOCK_SIZE for i in range(num_blocks)}

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _run_step(self, batch: list[tuple[Request, int]]) -> None:
        """The worker: copies first, then each request's new tokens into its slots."""
        pairs = self.kv.take_copy_blocks()
        dsts = [d for _, d in pairs]
        assert len(set(dsts)) == len(dsts) and not set(dsts) & {s for s, _ in pairs}
        snapshot = {s: list(self.slots[s]) for s, _ in pairs}
        for src, dst in pairs:
            self.slots[dst] = list(snapshot[src])
        for request, num_new in batch:
            table = self.kv.req_to_blocks[request.request_id]
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
                block = table[pos // BLOCK_SIZE]
                assert block.ref_cnt == 1, f"{block} written while shared"
                self.slots[block.block_id][pos % BLOCK_SIZE] = request.all_token_ids[pos]
        for request, num_new in batch:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids([self.rng.randrange(1000)])

    @precondition(lambda self: len(self.live) < 6)
    @rule(prompt_len=st.integers(1, 11))
    def admit(self, prompt_len: int) -> None:
        request = _request(self._new_id(), [self.rng.randrange(1000) for _ in range(prompt_len)])
        computed, num_hit = self.kv.get_computed_blocks(request)
        if self.kv.allocate_slots(request, prompt_len - num_hit, computed) is None:
            return
        request.num_computed_tokens = num_hit
        self.live[request.request_id] = request
        self._run_step([(request, prompt_len - num_hit)])

    @precondition(lambda self: self.live and len(self.live) < 8)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        # A beam candidate: the parent's computed tokens, then its own next token.
        tokens = parent.all_token_ids[:parent.num_computed_tokens]
        child = _request(self._new_id(), tokens[:1])
        child.prompt_token_ids = tokens[:1]
        child.all_token_ids = list(tokens)
        child.append_output_token_ids([self.rng.randrange(1000)])
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def step(self, data, preempt: bool) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        batch = []
        for rid in ids:
            request = self.live[rid]
            if request.num_tokens >= 40:
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if self.kv.allocate_slots(request, num_new) is not None:
                batch.append((request, num_new))
        if preempt and batch:
            # Preempted after its allocation, before the step ran (scheduler's victim).
            victim, _ = batch.pop()
            self.kv.free(victim, num_valid_tokens=victim.num_computed_tokens)
            del self.live[victim.request_id]
        self._run_step(batch)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @rule()
    def free_all(self) -> None:
        for request in self.live.values():
            self.kv.free(request)
        self.live.clear()
        assert self.kv.take_copy_blocks() == []
        assert self.kv.block_pool.num_free_blocks == self.kv.num_blocks

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        if not hasattr(self, "kv"):
            return
        holders: dict[int, int] = {}
        for blocks in self.kv.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.kv.block_pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), b
            assert (b in self.kv.block_pool.free_block_queue) == (b.ref_cnt == 0)
        assert set(self.kv.req_to_blocks) == set(self.live)
        assert self.kv.num_shared_blocks() == sum(1 for n in holders.values() if n > 1)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for request in self.live.values():
            table = self.kv.req_to_blocks[request.request_id]
            seen = [self.slots[table[p // BLOCK_SIZE].block_id][p % BLOCK_SIZE]
                    for p in range(request.num_computed_tokens)]
            assert seen == request.all_token_ids[:request.num_computed_tokens], request


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
