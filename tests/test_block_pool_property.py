"""Property test of KVCacheManager + BlockPool: random request histories on
small pools, checking every invariant of the pool after every step.

A hypothesis state machine plays the scheduler and the worker. Rules admit
requests (prefix-cache lookup, then allocation), continue them (a prefill
chunk or a decode token), fork them (several requests with one prompt
admitted in the same step, so later ones hit blocks the first registers in
that step), free them, preempt them after allocation but before their step
runs, put the pool under allocation pressure (evicting cached blocks) and
reset the prefix cache. The "worker" writes each computed token into a
simulated K/V slot, so the test can also check that a cached block holds
exactly the tokens its hash names: a hit never serves K/V nobody wrote.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aioengine.core.block_pool import BlockHash, KVCacheBlock
from aioengine.core.kv_cache_manager import KVCacheManager, cdiv
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_LEN = 40  # tokens per request, prompt and output
# Prompts are a prefix of one of these, then a few own tokens, so requests
# share prefixes of every length, including partial blocks.
PREFIXES = [list(range(100 * k, 100 * k + 32)) for k in range(3)]
SALTS = [None, "tenant-a"]


def next_token(token_ids: list[int]) -> int:
    """The simulated model: greedy, so equal sequences continue equally."""
    return 5000 + (sum(token_ids) * 31 + len(token_ids)) % 5


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager
        self.live: dict[str, Request] = {}       # holding blocks, all steps run
        self.preempted: dict[str, Request] = {}  # freed, waiting to be readmitted
        self.seen: list[Request] = []
        self.expected: dict[BlockHash, tuple[int, ...]] = {}
        self.slots: dict[int, list[int | None]] = {}  # simulated K/V per block
        self.counter = 0
        self.fresh = 10_000  # unique tokens for allocation pressure

    @initialize(num_blocks=st.integers(4, 16))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self.slots = {b: [None] * BLOCK_SIZE for b in range(num_blocks)}

    # -- helpers: the scheduler's and the worker's side -------------------------
    def new_request(self, tokens: list[int], salt: str | None) -> Request:
        self.counter += 1
        request = Request(f"r{self.counter}", tokens, SamplingParams(max_tokens=MAX_LEN),
                          MAX_LEN, None, cache_salt=salt)
        self.seen.append(request)
        return request

    def snapshot(self) -> tuple:
        pool = self.kv.block_pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks],
                pool.free_block_queue.block_ids(), dict(pool.cached_block_hash_to_block),
                {rid: list(t) for rid, t in self.kv.req_to_blocks.items()},
                self.kv.prefix_cache_queries, self.kv.prefix_cache_hits)

    def admit(self, request: Request, chunk: int) -> int | None:
        """Lookup + allocation as the scheduler does it; returns the tokens
        to compute, or None (and checks nothing moved) when blocks are short."""
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit < request.num_tokens, "the last token must be recomputed for its logits"
        assert num_hit == len(hits) * BLOCK_SIZE
        num_new = min(request.num_tokens - num_hit, chunk)
        before = self.snapshot()
        if self.kv.allocate_slots(request, num_new, hits) is None:
            assert self.snapshot() == before, "a failed allocation changed something"
            return None
        request.num_computed_tokens = num_hit
        return num_new

    def execute(self, request: Request, num_new: int) -> None:
        """The worker: write the step's tokens into their slots, sample."""
        table = self.kv.req_to_blocks[request.request_id]
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            self.slots[table[pos // BLOCK_SIZE].block_id][pos % BLOCK_SIZE] = \
                request.all_token_ids[pos]
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens and request.num_tokens < MAX_LEN:
            request.append_output_token_ids([next_token(request.all_token_ids)])

    def prompt(self, prefix: int, length: int, own: int) -> list[int]:
        self.fresh += own
        return PREFIXES[prefix][:length] + list(range(self.fresh - own, self.fresh))

    # -- rules --------------------------------------------------------------------
    @rule(prefix=st.integers(0, 2), length=st.integers(0, 32), own=st.integers(0, 5),
          salt=st.sampled_from(SALTS), chunk=st.integers(1, MAX_LEN))
    def add(self, prefix: int, length: int, own: int, salt: str | None, chunk: int) -> None:
        tokens = self.prompt(prefix, length, own) or [1]
        request = self.new_request(tokens, salt)
        num_new = self.admit(request, chunk)
        if num_new is not None:
            self.live[request.request_id] = request
            self.execute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def append(self, data: st.DataObject, chunk: int) -> None:
        """One more step: the rest of the prompt (in a chunk) or a decode token."""
        request = data.draw(st.sampled_from(sorted(self.live.values(),
                                                   key=lambda r: r.request_id)))
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        if num_new == 0:
            return  # at MAX_LEN
        before = self.snapshot()
        if self.kv.allocate_slots(request, num_new) is None:
            assert self.snapshot() == before, "a failed allocation changed something"
            return
        self.execute(request, num_new)

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 32), n=st.integers(2, 4),
          salt=st.sampled_from(SALTS))
    def fork(self, prefix: int, length: int, n: int, salt: str | None) -> None:
        """``n`` requests with one prompt admitted in one step: all allocate
        (later ones hit blocks the first has just registered), then the step
        runs for all of them."""
        tokens = self.prompt(prefix, length, 1)
        admitted = []
        for _ in range(n):
            request = self.new_request(tokens, salt)
            num_new = self.admit(request, MAX_LEN)
            if num_new is None:
                break
            admitted.append((request, num_new))
        for request, num_new in admitted:
            self.live[request.request_id] = request
            self.execute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live, key=str)))
        self.kv.free(self.live.pop(request))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def preempt_before_step(self, data: st.DataObject, chunk: int) -> None:
        """Scheduled (blocks allocated and registered), then preempted in the
        same ``schedule()`` call: the step never runs for it."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live, key=str)))]
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        if num_new and self.kv.allocate_slots(request, num_new) is None:
            return
        assert self.kv.num_unwritten_shared_blocks(request) == 0
        self.kv.free(request, num_valid_tokens=request.num_computed_tokens)
        request.num_computed_tokens = 0
        del self.live[request.request_id]
        self.preempted[request.request_id] = request

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, MAX_LEN))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        request = self.preempted[data.draw(st.sampled_from(sorted(self.preempted, key=str)))]
        num_new = self.admit(request, chunk)
        if num_new is not None:
            del self.preempted[request.request_id]
            self.live[request.request_id] = request
            self.execute(request, num_new)

    @rule(fill=st.floats(0.5, 1.0))
    def evict(self, fill: float) -> None:
        """Allocation pressure: a new request with unique tokens takes most
        free blocks, evicting cached ones from the free queue's front."""
        num_blocks = max(1, int(self.kv.block_pool.num_free_blocks * fill))
        num_tokens = min(num_blocks * BLOCK_SIZE, MAX_LEN - 1)
        held = {b.block_id: b.block_hash for table in self.kv.req_to_blocks.values()
                for b in table}
        request = self.new_request(self.prompt(0, 0, num_tokens), None)
        num_new = self.admit(request, MAX_LEN)
        if num_new is None:
            assert self.kv.block_pool.num_free_blocks < cdiv(num_tokens, BLOCK_SIZE)
            return
        # Only free blocks are evicted: blocks that requests hold keep their hash.
        pool = self.kv.block_pool
        assert all(pool.blocks[i].block_hash == h for i, h in held.items())
        self.live[request.request_id] = request
        self.execute(request, num_new)

    @rule()
    def reset(self) -> None:
        pool = self.kv.block_pool
        in_use = pool.num_used_blocks > 0
        before = self.snapshot()
        assert self.kv.reset_prefix_cache() is (not in_use)
        if in_use:
            assert self.snapshot() == before
        else:
            assert not pool.cached_block_hash_to_block
            assert all(b.block_hash is None for b in pool.blocks)

    # -- invariants -----------------------------------------------------------------
    @invariant()
    def every_block_is_free_xor_referenced(self) -> None:
        pool = self.kv.block_pool
        queue = pool.free_block_queue
        free_ids = queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, \
            "a block appears twice in the free queue"
        # The links agree in both directions.
        block: KVCacheBlock | None = queue._tail.prev_free_block
        backwards = []
        while block is not None and block is not queue._head:
            backwards.append(block.block_id)
            block = block.prev_free_block
        assert backwards[::-1] == free_ids
        free = set(free_ids)
        for b in pool.blocks:
            assert (b.block_id in free) != (b.ref_cnt > 0), b
            assert b.ref_cnt >= 0
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_used_blocks == sum(b.ref_cnt > 0 for b in pool.blocks)

    @invariant()
    def ref_counts_equal_block_table_references(self) -> None:
        held = Counter()
        for table in self.kv.req_to_blocks.values():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids)), "a block appears twice in one block table"
            held.update(ids)
        assert set(self.kv.req_to_blocks) == set(self.live)
        for b in self.kv.block_pool.blocks:
            assert b.ref_cnt == held[b.block_id], b

    @invariant()
    def hash_map_matches_blocks(self) -> None:
        pool = self.kv.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_block_hash_to_block), \
            "a hashed block is missing from the map"

    @invariant()
    def cached_blocks_hold_the_tokens_their_hash_names(self) -> None:
        for request in self.seen:
            for i, block_hash in enumerate(request.block_hashes):
                self.expected[block_hash] = tuple(
                    request.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        for block_hash, block in self.kv.block_pool.cached_block_hash_to_block.items():
            assert tuple(self.slots[block.block_id]) == self.expected[block_hash], (
                f"block {block.block_id} is cached for {self.expected[block_hash]} "
                f"but holds {self.slots[block.block_id]}")

    @invariant()
    def shared_blocks_are_full_and_never_written_again(self) -> None:
        """Why there is no copy-on-write: a block held by two requests is
        full, cached, and below every holder's next write position."""
        for request in self.live.values():
            table = self.kv.req_to_blocks[request.request_id]
            assert len(table) >= cdiv(request.num_computed_tokens, BLOCK_SIZE)
            for i, block in enumerate(table):
                if block.ref_cnt > 1:
                    assert block.block_hash is not None
                    assert (i + 1) * BLOCK_SIZE <= request.num_computed_tokens
                if block.block_hash is not None:
                    assert block.block_hash == request.block_hashes[i]


BlockPoolMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockPoolProperties = BlockPoolMachine.TestCase
