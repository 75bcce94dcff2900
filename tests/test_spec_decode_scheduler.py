"""Speculative decoding in the scheduler (spec_decode/scheduling.py), with a simulated worker.

The "model" is a deterministic next-token function of the tokens so far. A
scheduler that speculates and one that never does are fed the same request;
the speculating one gets drafts whose first ``m`` tokens are the model's own
continuation and the rest wrong (``m`` and the draft length drawn by
hypothesis), and its simulated worker accepts exactly the matching prefix, as
greedy verification does. After every speculative step the plain run is
advanced to the same ``num_computed_tokens``; then the request's tokens, its
block count, each block's hash, the pool's free blocks and its set of cached
hashes must all be equal: rollback left nothing behind.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aioengine.config import SchedulerConfig
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.core.scheduler import Scheduler
from aioengine.ipc.messages import ModelRunnerOutput
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.scheduling import SpecDecodeScheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_MODEL_LEN = 200


def model(tokens: list[int]) -> int:
    return 1000 + (sum(tokens) * 7 + len(tokens) * 3) % 13


def continuation(tokens: list[int], n: int) -> list[int]:
    out, t = [], list(tokens)
    for _ in range(n):
        out.append(model(t))
        t.append(out[-1])
    return out


def make_scheduler(spec: SpeculativeConfig | None, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, MAX_MODEL_LEN,
                     lambda r: None, spec)


def run_step(sched: Scheduler, drafts_for) -> None:
    """One step with a simulated greedy worker; ``drafts_for(request)`` gives the
    next drafts (None: the worker does not speculate)."""
    so = sched.schedule()
    sampled, accepted, next_drafts = [], [], []
    for request, n in zip(sched.scheduled_requests, so.num_scheduled_tokens):
        if request.num_computed_tokens + n < request.num_tokens:
            sampled.append(-1)
            accepted.append(0)
            next_drafts.append([])
            continue
        drafts = so.scheduled_spec_decode_tokens.get(request.request_id, [])
        truth = continuation(request.all_token_ids, len(drafts) + 1)
        a = 0
        while a < len(drafts) and drafts[a] == truth[a]:
            a += 1
        sampled.append(truth[a])
        accepted.append(a)
        emitted = request.all_token_ids + truth[:a + 1]
        next_drafts.append(drafts_for(emitted) if drafts_for else [])
    spec = drafts_for is not None
    ro = ModelRunnerOutput(so.step_id, sampled, None, 0.0, 0.0,
                           accepted if spec else None, next_drafts if spec else None)
    sched.update_from_output(so, ro)


def snapshot(sched: Scheduler, request: Request) -> dict:
    kv = sched.kv_cache_manager
    blocks = kv.req_to_blocks.get(request.request_id, [])
    return {
        "num_computed_tokens": request.num_computed_tokens,
        "tokens": list(request.all_token_ids),
        "num_blocks": len(blocks),
        "block_hashes": [b.block_hash for b in blocks],
        "num_free_blocks": kv.block_pool.num_free_blocks,
        "cached_hashes": set(kv.block_pool.cached_block_hash_to_block),
    }


@settings(max_examples=60, deadline=None)
@given(prompt_len=st.integers(1, 23), caching=st.booleans(),
       plan=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=40))
def test_rollback_leaves_what_a_run_without_speculation_has(prompt_len, caching, plan):
    cfg = SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.0)
    spec, plain = make_scheduler(cfg, caching), make_scheduler(None, caching)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt = [(7 * i) % 50 for i in range(prompt_len)]
    a = Request("r", prompt, params, 60, None)
    b = Request("r", prompt, params, 60, None)
    spec.add_request(a)
    plain.add_request(b)
    steps = iter(plan * 10)

    def drafts_for(tokens: list[int]) -> list[int]:
        correct, wrong = next(steps, (0, 0))
        return continuation(tokens, correct) + [2000 + i for i in range(wrong)]

    while not a.is_finished:
        run_step(spec, drafts_for)
        if a.is_finished:
            break
        while b.num_computed_tokens < a.num_computed_tokens:
            run_step(plain, None)
        assert snapshot(spec, a) == snapshot(plain, b)
    while not b.is_finished:
        run_step(plain, None)
    assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 60
    assert spec.kv_cache_manager.block_pool.num_free_blocks == NUM_BLOCKS
    assert spec.spec.stats.num_draft_tokens >= spec.spec.stats.num_accepted_tokens


def test_drafts_stop_at_max_tokens_and_budget():
    cfg = SpeculativeConfig(num_speculative_tokens=4)
    sched = make_scheduler(cfg)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    r = Request("r", [1, 2, 3], params, 3, None)
    sched.add_request(r)
    run_step(sched, lambda t: continuation(t, 4))        # prefill: 1 token, 4 drafts back
    so = sched.schedule()
    # 1 output so far, max_tokens 3: at most 1 draft (plus the bonus token).
    assert so.scheduled_spec_decode_tokens == {"r": r.spec_token_ids[:1]}
    assert so.num_scheduled_tokens == [2]


def test_low_acceptance_turns_drafting_off_for_a_cooldown():
    cfg = SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.5, window=8,
                            cooldown_steps=5)
    sched = make_scheduler(cfg)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    r = Request("r", [1, 2, 3], params, 60, None)
    sched.add_request(r)
    drafted = []
    for _ in range(20):
        run_step(sched, lambda t: [2000, 2001, 2002, 2003])  # always wrong
        drafted.append(sched.spec.stats.num_draft_tokens)
    # Prefill, then 2 verifications of 4 wrong drafts (8 = window), then 5 steps off.
    steps_with_drafts = [i for i in range(1, 20) if drafted[i] > drafted[i - 1]]
    assert steps_with_drafts[:3] == [1, 2, 8], drafted
    assert sched.spec.stats.num_accepted_tokens == 0


def test_ineligible_requests_never_draft():
    assert not SpecDecodeScheduler.can_speculate(
        Request("a", [1], SamplingParams(logprobs=2), 5, None))
    assert not SpecDecodeScheduler.can_speculate(
        Request("a", [1], SamplingParams(presence_penalty=0.5), 5, None))
    assert not SpecDecodeScheduler.can_speculate(
        Request("a", [1], SamplingParams(min_tokens=3), 5, None))
    assert SpecDecodeScheduler.can_speculate(
        Request("a", [1], SamplingParams(temperature=0.8, top_p=0.9), 5, None))


def test_no_drafts_while_disable_by_batch_size_requests_run():
    """The default stops drafting at 8 running requests (vLLM's
    ``disable_by_batch_size``; vLLM's default never stops): with 8 running no
    request is verified with drafts; once one has finished, the other 7 are."""
    cfg = SpeculativeConfig(num_speculative_tokens=2)
    assert cfg.disable_by_batch_size == 8
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256), kv, MAX_MODEL_LEN,
                      lambda r: None, cfg)
    for i in range(8):
        params = SamplingParams(temperature=0, max_tokens=3 if i == 0 else 40, ignore_eos=True)
        sched.add_request(Request(f"r{i}", [1 + i, 2, 3], params, params.max_tokens, None))
    counts = []
    for _ in range(8):
        before = sched.spec.stats.num_draft_tokens
        running = len(sched.running) + len(sched.waiting)
        run_step(sched, lambda t: continuation(t, 2))
        counts.append((running, sched.spec.stats.num_draft_tokens - before))
    assert [d for n, d in counts if n == 8] == [0, 0, 0], counts
    assert [d for n, d in counts if n == 7][:3] == [14, 14, 14], counts
