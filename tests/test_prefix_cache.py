"""Automatic prefix caching: it never changes an answer, it really skips
prefill, ``n > 1`` samples share their prompt's blocks, and tenants with
different ``cache_salt``s never share.

The first tests pin down behaviours of ``KVCacheManager`` without a model
(regressions of bugs found while writing this file). The rest run the real
default model in-process: one engine with caching on and a small KV cache
(80 blocks of 16 tokens) and one with caching off as the reference. Greedy
outputs are compared with the near-tie rule of DESIGN.md
(``tests/parity.py``). The engine runs through ``LLM.run_until_finished``
with the executor's ``execute_model`` and the engine's ``step`` wrapped, so
the tests read the block pool between ``schedule()`` and the forward, and
after each step.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from aioengine import LLM, SamplingParams
from aioengine.core.block_pool import ROOT_BLOCK_HASH, hash_request_blocks
from aioengine.config import SchedulerConfig
from aioengine.core.kv_cache_manager import KVCacheManager, cdiv
from aioengine.core.scheduler import Scheduler
from aioengine.engine.llm_engine import EngineStep
from aioengine.ipc.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.request import Request
from aioengine.sampling_params import CompletionOutput, RequestOutput
from tests.parity import assert_greedy_parity

BS = 4  # block size of the model-free tests


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), 8, None, cache_salt=salt)


# -- KVCacheManager alone ------------------------------------------------------------

def test_blocks_of_a_request_preempted_before_its_step_ran_are_not_cache_hits():
    """Blocks are registered when allocated, before the step writes them. A
    request preempted in the same ``schedule()`` call never runs that step,
    so its registered blocks hold no (or stale) K/V: they must not be hits.
    Before the fix, ``free`` kept their hashes and the next request with the
    same prompt was served unwritten K/V."""
    kv = KVCacheManager(16, BS)
    tokens = list(range(10))
    first = make_request("a", tokens)
    kv.allocate_slots(first, 4)           # step 1 ran: block 0 written
    first.num_computed_tokens = 4
    kv.allocate_slots(first, 6)           # step 2 scheduled: blocks 1, 2 registered ...
    assert kv.get_computed_blocks(make_request("probe", tokens))[1] == 8
    kv.free(first, num_valid_tokens=first.num_computed_tokens)  # ... and preempted
    again = make_request("b", tokens)
    _, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 4, "only the block whose step ran may be a hit"
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    # The forgotten blocks are free and uncached: first in line for reuse.
    assert kv.block_pool.free_block_queue.block_ids()[:2] == [1, 2]


def test_unwritten_shared_blocks_are_reported_until_their_step_ran():
    """A request admitted in the same step hits blocks the first one has just
    registered; preempting the first before the step would strand it, and
    ``num_unwritten_shared_blocks`` is how the scheduler can tell."""
    kv = KVCacheManager(16, BS)
    tokens = list(range(10))
    first, second = make_request("a", tokens), make_request("b", tokens)
    kv.allocate_slots(first, 10)
    hits, num_hit = kv.get_computed_blocks(second)
    kv.allocate_slots(second, 10 - num_hit, hits)
    second.num_computed_tokens = num_hit
    assert num_hit == 8
    assert kv.num_unwritten_shared_blocks(first) == 2
    assert kv.num_unwritten_shared_blocks(second) == 0
    first.num_computed_tokens = second.num_computed_tokens = 10  # the step ran
    assert kv.num_unwritten_shared_blocks(first) == 0


def test_prefix_cache_stats_count_each_admission_once():
    """A waiting request whose allocation fails is looked up again every
    step; before the fix each lookup was counted, so the hit rate of a busy
    engine was inflated by requests that had not run yet."""
    kv = KVCacheManager(6, BS)
    owner = make_request("a", list(range(20)))
    kv.allocate_slots(owner, 20)
    owner.num_computed_tokens = 20
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 0)
    waiting = make_request("b", list(range(8)) + list(range(100, 110)))
    for _ in range(3):  # three steps without room
        hits, num_hit = kv.get_computed_blocks(waiting)
        assert kv.allocate_slots(waiting, waiting.num_tokens - num_hit, hits) is None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 0)
    kv.free(owner)
    hits, num_hit = kv.get_computed_blocks(waiting)
    assert kv.allocate_slots(waiting, waiting.num_tokens - num_hit, hits) is not None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20 + 18, 8)
    off = KVCacheManager(4, BS, enable_caching=False)
    off.allocate_slots(make_request("c", list(range(8))), 8)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_duplicate_block_is_evicted_before_findable_cached_blocks():
    """Two requests that compute the same block each hold a copy; only the
    first is findable. The copy used to keep a hash, so once freed it sat in
    the LRU tail like a useful block and pushed findable blocks out first."""
    kv = KVCacheManager(8, BS)
    tokens = list(range(8))  # two full blocks; the second is the last token's
    first, second = make_request("a", tokens), make_request("b", tokens)
    kv.allocate_slots(first, 8)
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 4  # block 1 holds the last token: recomputed, a duplicate
    kv.allocate_slots(second, 4, hits)
    duplicate = kv.req_to_blocks["b"][1]
    assert duplicate.block_hash is None
    first.num_computed_tokens = second.num_computed_tokens = 8
    kv.free(first)
    kv.free(second)
    queue = kv.block_pool.free_block_queue.block_ids()
    assert queue[0] == duplicate.block_id, "the unfindable copy is reused first"
    assert queue[-2:] == [1, 0], "findable blocks last, the prefix last of all"


def run_fake_step(scheduler: Scheduler, slots: dict[tuple[int, int], int]) -> None:
    """One step with a stand-in worker that keeps, per KV slot, the token whose
    K/V it holds. Like the model, it writes every new token first, then every
    scheduled request reads its whole context: each slot read must hold that
    request's token at that position."""
    kv = scheduler.kv_cache_manager
    so = scheduler.schedule()
    batch = [(scheduler.requests[rid], n) for rid, n in
             zip(so.req_ids(), so.num_scheduled_tokens)]
    for request, n in batch:
        table = kv.req_to_blocks[request.request_id]
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + n):
            slots[table[pos // BS].block_id, pos % BS] = request.all_token_ids[pos]
    for request, n in batch:
        table = kv.req_to_blocks[request.request_id]
        for pos in range(request.num_computed_tokens + n):
            held = slots.get((table[pos // BS].block_id, pos % BS))
            assert held == request.all_token_ids[pos], (
                f"{request.request_id} reads position {pos} from block "
                f"{table[pos // BS].block_id}, which holds {held}, not "
                f"{request.all_token_ids[pos]}")
    sampled = [7 if r.num_computed_tokens + n >= r.num_tokens else -1 for r, n in batch]
    scheduler.update_from_output(so, ModelRunnerOutput(so.step_id, sampled, None, 0.0, 0.0))


def test_priority_preemption_never_strands_a_same_step_prefix_hit():
    """r4 (low priority) computes the rest of its prompt this step and
    registers the block it fills; r0 (high priority, same prompt) is admitted
    in the same step and hits that block, relying on r4 writing it; then r1
    needs blocks and preempts r4, so nobody writes the block r0 reads."""
    kv = KVCacheManager(7, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=13), kv, 100,
                          lambda request: None)
    slots: dict[tuple[int, int], int] = {}
    prompt = [10, 11, 12, 13, 14]

    def add(rid: str, tokens: list[int], priority: int, max_tokens: int) -> None:
        scheduler.add_request(Request(rid, tokens, SamplingParams(max_tokens=max_tokens),
                                      max_tokens, None, priority=priority,
                                      arrival_time=float(len(scheduler.requests))))

    add("r5", list(range(1000, 1012)), 0, 2)
    add("r4", prompt, 1, 1)
    run_fake_step(scheduler, slots)  # r5: 12 tokens; r4: 1 token (budget 13)
    for rid in ("r0", "r1", "r2", "r3"):
        add(rid, prompt, 0, 1)
    while scheduler.has_unfinished_requests():
        run_fake_step(scheduler, slots)
    assert kv.block_pool.num_free_blocks == 7


# -- the real model ------------------------------------------------------------------

NUM_BLOCKS = 80   # on-side KV cache: 1,280 tokens
BLOCK_SIZE = 16
MAX_TOKENS = 6
CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Tallinn", "Perth", "Quito"]
_ids = itertools.count()


def policy_text(num_rules: int, start: int = 0) -> str:
    return " ".join(
        f"Rule {i}: orders of more than {10 * i + 5} units ship from the "
        f"{CITIES[i % len(CITIES)]} warehouse within {i % 5 + 1} business days, and "
        f"returns need a receipt dated within {14 + i} days." for i in range(start, num_rules))


QUESTIONS = ["Where do orders of 60 units ship from?",
             "How long do I have to return an order under rule 7?",
             "Which rule mentions Perth?",
             "Summarize the return policy in one sentence."]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(executor="inproc", num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm_off():
    engine = LLM(executor="inproc", enable_prefix_caching=False, block_size=BLOCK_SIZE)
    yield engine
    engine.shutdown()


def chat_ids(llm: LLM, system: str, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    """Four prompts sharing a ~440-token system prompt, differing after it."""
    system = "You answer questions about our shipping policy. " + policy_text(12)
    return [chat_ids(llm, system, q) for q in QUESTIONS]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def top2(c: CompletionOutput) -> list[list[float]]:
    return [sorted(lp.values(), reverse=True)[:2] for lp in c.logprobs]


def assert_shared_blocks_are_never_rewritten(llm: LLM, so=None) -> None:
    """Why a prefix-cache hit needs no copy-on-write, checked on the live engine.

    Before a step (``so`` given): a shared block that a scheduled request
    writes in this step is one it registered in this step, and every other
    holder took it as a hit for exactly the same tokens at the same position
    and writes past it. Between steps: every shared block is full, cached
    and lies below every holder's ``num_computed_tokens``, or it is shared by
    a fork (``n > 1`` samples): at one index in every holder's table, over
    tokens they all agree on as far as they have computed; their next write
    into it copies it first.
    """
    kv = llm.engine.kv_cache_manager
    requests = llm.engine.scheduler.requests
    holders = defaultdict(list)  # block id -> [(request, index in its table)]
    for rid, table in kv.req_to_blocks.items():
        for i, block in enumerate(table):
            holders[block.block_id].append((requests[rid], i))
    if so is None:
        for block_id, held in holders.items():
            if len(held) < 2:
                continue
            if all((i + 1) * BLOCK_SIZE <= r.num_computed_tokens for r, i in held):
                assert kv.block_pool.blocks[block_id].block_hash is not None
                continue
            i = held[0][1]
            end = min((i + 1) * BLOCK_SIZE, *(r.num_computed_tokens for r, _ in held))
            assert all(j == i for _, j in held), "a fork shares a block at one index"
            assert len({tuple(r.all_token_ids[i * BLOCK_SIZE:end]) for r, _ in held}) == 1
        return
    for rid, num_new in zip(so.req_ids(), so.num_scheduled_tokens):
        writer = requests[rid]
        start = writer.num_computed_tokens
        table = kv.req_to_blocks[rid]
        for i in range(start // BLOCK_SIZE, cdiv(start + num_new, BLOCK_SIZE)):
            held = holders[table[i].block_id]
            if len(held) == 1:
                continue
            tokens = writer.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            assert len(tokens) == BLOCK_SIZE, "a partial block is shared"
            for other, j in held:
                if other is writer:
                    continue
                assert j == i and other.all_token_ids[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE] == tokens
                assert (j + 1) * BLOCK_SIZE <= other.num_computed_tokens


def drive(llm: LLM, requests: list[tuple[list[int], SamplingParams, str | None]],
          check_sharing: bool = True) -> tuple[list[RequestOutput], int]:
    """Add ``(token_ids, params, cache_salt)`` requests together and step the
    engine until all finish.

    Returns:
        The final outputs in request order, and the most KV blocks in use
        right after any ``schedule()`` (blocks are allocated there).
    """
    pool = llm.engine.kv_cache_manager.block_pool
    ids = []
    for token_ids, params, salt in requests:
        ids.append(f"pc{next(_ids)}")
        llm.add_request(ids[-1], token_ids, params, cache_salt=salt)
    peak = 0
    executor = llm.executor
    execute_model = executor.execute_model

    def checked_execute_model(so: SchedulerOutput) -> ModelRunnerOutput:
        # Between schedule() and the forward: the blocks of this step are allocated.
        nonlocal peak
        peak = max(peak, pool.num_used_blocks)
        if check_sharing:
            assert_shared_blocks_are_never_rewritten(llm, so)
        return execute_model(so)

    engine_step = llm.engine.step

    def checked_step() -> EngineStep:
        step = engine_step()
        if check_sharing:
            assert_shared_blocks_are_never_rewritten(llm)
        return step

    executor.execute_model = checked_execute_model
    llm.engine.step = checked_step
    try:
        final = llm.run_until_finished()
    finally:
        del executor.execute_model, llm.engine.step
    assert pool.num_used_blocks == 0
    return [final[i] for i in ids], peak


def assert_same_answers(name: str, ours: list[RequestOutput], ref: list[RequestOutput]) -> None:
    for k, (a, b) in enumerate(zip(ours, ref)):
        a, b = a.outputs[0], b.outputs[0]
        assert_greedy_parity(f"{name}[{k}]", a.token_ids, b.token_ids, top2(a), top2(b))


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def reference(llm_off, prompts) -> list[RequestOutput]:
    """Caching off: the four prompts in one batch."""
    return drive(llm_off, [(p, GREEDY, None) for p in prompts])[0]


def test_shared_long_prefix_same_answers_and_hits_only_with_caching_on(
        llm, llm_off, prompts, reference):
    shared = common_prefix_len(prompts[0], prompts[1])
    assert shared > 400 and all(common_prefix_len(prompts[0], p) == shared for p in prompts[1:])
    before = llm.stats()
    first, _ = drive(llm, [(prompts[0], GREEDY, None)])
    rest, _ = drive(llm, [(p, GREEDY, None) for p in prompts[1:]])
    # Later prompts skip every full block of the shared prefix.
    assert [o.num_cached_tokens for o in rest] == [shared // BLOCK_SIZE * BLOCK_SIZE] * 3
    # A fully cached prompt still recomputes its last token.
    again, _ = drive(llm, [(prompts[0], GREEDY, None)])
    assert again[0].num_cached_tokens == (len(prompts[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert_same_answers("shared-prefix", first + rest, reference)
    assert_same_answers("fully-cached", again, reference[:1])
    # The engine's counters: every admitted prompt looked up once, hits as above.
    after = llm.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == \
        sum(map(len, prompts)) + len(prompts[0])
    assert after.prefix_cache_hits - before.prefix_cache_hits == \
        3 * (shared // BLOCK_SIZE * BLOCK_SIZE) + again[0].num_cached_tokens > 0
    # With caching off nothing is looked up or hit.
    off = llm_off.stats()
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)
    assert all(o.num_cached_tokens == 0 for o in reference)


def test_concurrent_requests_with_one_prefix_give_same_answers(llm, prompts, reference):
    """All four arrive in one step on a cold cache (``reset_prefix_cache``
    forgets every block): the first computes the prefix and the others hit
    its blocks in the same forward pass."""
    kv = llm.engine.kv_cache_manager
    assert kv.reset_prefix_cache()
    assert not kv.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    outs, _ = drive(llm, [(p, GREEDY, None) for p in prompts])
    shared = common_prefix_len(prompts[0], prompts[1])
    assert [o.num_cached_tokens for o in outs] == \
        [0] + [shared // BLOCK_SIZE * BLOCK_SIZE] * 3
    assert_same_answers("concurrent", outs, reference)


def test_evicted_and_recomputed_blocks_give_same_answers(llm, prompts, reference):
    """Another tenant's long request takes nearly every free block: the LRU
    evicts most of the prompts' cached blocks and the tenant's data lands in
    them. Prefilling 1,200 real tokens to get there would cost minutes on
    this machine, so the tenant is played through the same
    ``KVCacheManager`` calls the scheduler makes, and its "K/V" are random
    numbers written into the blocks it got: a stale hit cannot go unnoticed.
    Then the prompts again: surviving blocks are hits, the rest recomputed."""
    kv = llm.engine.kv_cache_manager
    pool = kv.block_pool
    hashes = hash_request_blocks(prompts[0], BLOCK_SIZE, 0, ROOT_BLOCK_HASH)
    if not all(pool.get_cached_block(h) is not None for h in hashes):
        drive(llm, [(p, GREEDY, None) for p in prompts])  # cache the prompts' blocks
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    num_tokens = (pool.num_free_blocks - 4) * BLOCK_SIZE
    tenant = Request("tenant", list(range(1000, 1000 + num_tokens)), GREEDY, 1, None)
    blocks = kv.allocate_slots(tenant, num_tokens, [])
    assert blocks is not None
    kv_cache = llm.executor.runner.kv_cache  # [layers, 2, blocks, block_size, heads, dim]
    ids = torch.tensor([b.block_id for b in blocks])
    kv_cache[:, :, ids] = torch.randn_like(kv_cache[:, :, ids])
    kv.free(tenant, num_valid_tokens=0)  # its blocks hold no real K/V: forget their hashes
    cached = [pool.get_cached_block(h) is not None for h in hashes]
    assert not all(cached), "nothing was evicted"
    # The LRU frees a request's blocks tail first, so what survives is a prefix.
    num_left = cached.index(False)
    assert not any(cached[num_left:])
    evicted, _ = drive(llm, [(p, GREEDY, None) for p in prompts])
    assert evicted[0].num_cached_tokens == num_left * BLOCK_SIZE
    assert_same_answers("after-eviction", evicted, reference)


def test_n4_holds_at_most_1_1x_the_blocks_of_n1(llm):
    """The four samples share the prompt's blocks by reference count, the
    partial last one too until each sharer but the last copies it on its
    first write (``parallel_sampling.SampleForks``): one partial block each."""
    prompt = llm.tokenizer.encode(policy_text(40))[:1000]
    assert len(prompt) == 1000
    kv = llm.engine.kv_cache_manager
    peaks = {}
    for n in (1, 4):
        assert kv.reset_prefix_cache()
        params = SamplingParams(n=n, temperature=0.8, seed=7, max_tokens=4, ignore_eos=True)
        (out,), peaks[n] = drive(llm, [(prompt, params, None)])
        assert len(out.outputs) == n
        assert all(len(c.token_ids) == 4 for c in out.outputs)
    print(f"peak KV blocks: n=1 {peaks[1]}, n=4 {peaks[4]} ({peaks[4] / peaks[1]:.3f}x)")
    assert peaks[1] == cdiv(1000 + 4 - 1, BLOCK_SIZE)
    assert peaks[4] <= 1.1 * peaks[1]
    assert peaks[4] == 1000 // BLOCK_SIZE + 4


def test_cache_salt_keeps_two_tenants_apart(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompt = chat_ids(llm, "You are a helpful assistant.", QUESTIONS[2])
    (alice,), _ = drive(llm, [(prompt, params, "alice")])
    hits_before = llm.stats().prefix_cache_hits
    (bob,), _ = drive(llm, [(prompt, params, "bob")])
    assert bob.num_cached_tokens == 0
    assert llm.stats().prefix_cache_hits == hits_before, "bob hit alice's blocks"
    (alice_again,), _ = drive(llm, [(prompt, params, "alice")])
    assert alice_again.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert_same_answers("salt", [bob, alice_again], [alice, alice])
