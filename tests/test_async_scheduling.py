"""Async scheduling (``async_scheduling=True``, vLLM v1's overlap): the engine
schedules step N+1 before step N's output is applied; the output must be the
one the synchronous engine gives, and every block must come back.

Real default model, in-process executor (its steps run in order when their
output is asked for, so the engine-side overlap is exercised exactly as with
the worker subprocess). Greedy outputs are compared under the near-tie rule
(tests/parity.py): the two engines batch different rows in some steps (a
request that stopped at step N still computes in the launched step N+1).
"""

from __future__ import annotations

import pytest

from aioengine import LLM, SamplingParams
from aioengine.config import EngineConfig, resolve_async_scheduling
from tests.parity import NEAR_TIE, assert_greedy_parity, top2_gap

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "Count from 1 to 30:",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colors:",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
]


def run(llm: LLM, async_on: bool, prompts: list[str], params: list[SamplingParams]):
    llm.engine.core.async_scheduling = async_on
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.core.async_scheduling = False


def assert_same_greedy(ours, ref) -> None:
    """Token ids, finish reasons and texts equal, up to a near-tie where they
    first differ (both runs' top-two logprobs there within 1e-3)."""
    for a, b in zip(ours, ref):
        x, y = a.outputs[0], b.outputs[0]
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)):
            if s != t:
                gaps = [top2_gap(list(c.logprobs[i].values())) for c in (x, y)]
                assert max(gaps) < NEAR_TIE, (a.request_id, i, x.token_ids, y.token_ids)
                print(f"near-tie at token {i}: gaps {gaps}")
                break
        else:
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert x.text == y.text


def blocks_all_free(llm: LLM) -> bool:
    kv = llm.engine.kv_cache_manager
    return kv.block_pool.num_used_blocks == 0 and not kv.req_to_blocks


@pytest.fixture(scope="module")
def llm():
    engine = LLM(executor="inproc", max_num_seqs=32)
    yield engine
    engine.shutdown()


def test_mixed_batch_with_stops_equals_the_synchronous_engine(llm):
    """Different lengths, EOS, stop strings and stop token ids in one batch."""
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 2 * i, logprobs=2,
                       stop=[" 7", "\n\n"] if i % 3 == 0 else [],
                       ignore_eos=i % 2 == 0)
        for i in range(len(PROMPTS))
    ]
    ref = run(llm, False, PROMPTS, params)
    ours = run(llm, True, PROMPTS, params)
    assert_same_greedy(ours, ref)
    assert any(o.outputs[0].finish_reason == "stop" for o in ref)
    assert blocks_all_free(llm)


def test_the_next_step_is_scheduled_before_this_ones_output(llm):
    """Overlap happens: after one ``step()`` a second step is already launched,
    holding a placeholder token for the decoding request."""
    core = llm.engine.core
    core.async_scheduling = True
    try:
        llm.engine.add_request("overlap", llm.tokenizer.encode("Hello there"),
                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        llm.engine.step()
        request = core.scheduler.requests["overlap"]
        assert len(core._in_flight) == 1
        assert core.scheduler.num_placeholders(request) == 1
        assert request.num_computed_tokens == request.num_tokens
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    finally:
        core.async_scheduling = False
    assert not core._in_flight and blocks_all_free(llm)


def test_an_aborted_request_keeps_its_blocks_until_its_launched_step_is_done(llm):
    core = llm.engine.core
    kv = llm.engine.kv_cache_manager
    core.async_scheduling = True
    try:
        for i in range(3):
            llm.engine.add_request(f"ab{i}", llm.tokenizer.encode(PROMPTS[i]),
                                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for _ in range(3):
            llm.engine.step()
        launched = core._in_flight[0][1]
        assert "ab1" in [r.request_id for r in launched.requests]
        llm.engine.abort_request("ab1")
        assert "ab1" in kv.req_to_blocks  # the launched step still writes its K/V
        llm.engine.step()
        assert "ab1" not in kv.req_to_blocks
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    finally:
        core.async_scheduling = False
    assert blocks_all_free(llm)


def test_preemption_under_a_tiny_cache_equals_the_synchronous_engine():
    tight = LLM(executor="inproc", num_gpu_blocks_override=10, block_size=8, max_num_seqs=8)
    try:
        params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
                  for _ in PROMPTS[:5]]
        ref = run(tight, False, PROMPTS[:5], params)
        before = tight.stats().num_preemptions
        assert before > 0
        ours = run(tight, True, PROMPTS[:5], params)
        assert tight.stats().num_preemptions > before
        assert_same_greedy(ours, ref)
        assert all(len(o.outputs[0].token_ids) == 16 for o in ours)
        assert blocks_all_free(tight)
    finally:
        tight.shutdown()


def test_requests_that_need_their_token_first_run_synchronously(llm):
    """``n > 1`` children waiting for child 0's prefill: no step is launched
    ahead until they forked; the samples equal the synchronous engine's."""
    core = llm.engine.core
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True)
    ref = run(llm, False, ["Tell me a joke."], [params])
    core.async_scheduling = True
    try:
        llm.engine.add_request("fork", llm.tokenizer.encode("Tell me a joke."), params)
        assert not core.can_overlap()
        llm.engine.step()
        assert not core._in_flight  # the prefill ran synchronously; the children forked
        assert core.can_overlap()
    finally:
        core.async_scheduling = False
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    ours = run(llm, True, ["Tell me a joke."], [params])
    assert [c.token_ids for c in ours[0].outputs] == [c.token_ids for c in ref[0].outputs]
    assert blocks_all_free(llm)


def test_a_preempted_seeded_sampled_request_keeps_its_draws(monkeypatch):
    """Regression: a seeded sampled request preempted while its launched step
    computed lost that step's token, but its generator had drawn for it, so
    every later token differed from the synchronous engine's. Seeded streams
    must not depend on the scheduling."""
    tight = LLM(executor="inproc", num_gpu_blocks_override=10, block_size=8, max_num_seqs=8)
    try:
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16,
                                 ignore_eos=True) for i in range(5)]
        ref = run(tight, False, PROMPTS[:5], params)
        scheduler = tight.engine.core.scheduler
        kept = []  # tokens of preempted requests that arrived from a launched step
        take = scheduler._take_preempted_placeholder
        monkeypatch.setattr(scheduler, "_take_preempted_placeholder",
                            lambda r: kept.append(r.request_id) or take(r))
        ours = run(tight, True, PROMPTS[:5], params)
        assert kept  # the case this test is about happened
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]
        assert blocks_all_free(tight)
    finally:
        tight.shutdown()


def test_greedy_batch_invariance_and_seeds_hold_with_async_scheduling_on(llm):
    """tests/test_api_streaming.py's batch-invariance and seed checks, async on:
    prompt 0 alone, the first 8 together, 32 together (greedy, near-tie rule);
    a seeded sampled request alone and in the batch of 32 gives the same tokens."""
    prompts = [f"Here is a short fact about {s}:" for s in (
        "the sea", "a mountain", "bread", "a violin", "winter", "a library", "the sun",
        "a bicycle", "coffee", "a forest", "trains", "the moon", "rain", "a castle", "chess",
        "honey", "a river", "snow", "a garden", "the desert", "clocks", "a lighthouse", "tea",
        "a volcano", "owls", "a bridge", "glass", "the wind", "paper", "a harbour", "salt")]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12,
                            ignore_eos=True)
    seeded_prompt = "Invent a name for a new colour."

    def top2(c):
        return [sorted(lp.values(), reverse=True)[:2] for lp in c.logprobs]

    alone = run(llm, True, prompts[:1], [greedy])[0].outputs[0]
    seeded_alone = run(llm, True, [seeded_prompt], [seeded])[0].outputs[0]
    eight = [o.outputs[0] for o in run(llm, True, prompts[:8], [greedy] * 8)]
    before = llm.stats().max_reqs_in_step
    out = run(llm, True, prompts + [seeded_prompt], [greedy] * len(prompts) + [seeded])
    assert llm.stats().max_reqs_in_step == 32 >= before
    thirty_two = [o.outputs[0] for o in out[:-1]]
    assert out[-1].outputs[0].token_ids == seeded_alone.token_ids
    for name, c in (("batch 8", eight[0]), ("batch 32", thirty_two[0])):
        assert_greedy_parity(f"prompt 0, batch 1 vs {name}", c.token_ids, alone.token_ids,
                             top2(c), top2(alone))
    for i in range(8):
        assert_greedy_parity(f"prompt {i}, batch 8 vs 32", thirty_two[i].token_ids,
                             eight[i].token_ids, top2(thirty_two[i]), top2(eight[i]))
    assert blocks_all_free(llm)


def test_auto_turns_async_scheduling_on_only_with_a_cpu_to_spare(monkeypatch):
    """``async_scheduling=None`` (auto): on when the CPUs this process may use
    outnumber the workers' torch threads; off in process; an explicit value and
    AIOENGINE_ASYNC_SCHEDULING win."""
    monkeypatch.delenv("AIOENGINE_ASYNC_SCHEDULING", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))

    def on(**kw) -> bool:
        kw.setdefault("executor", "process")
        return resolve_async_scheduling(EngineConfig.from_kwargs(**kw))[0]

    assert not on()  # the worker's default threads take all 4 CPUs
    assert on(num_threads=3)
    assert not on(num_threads=4)
    assert not on(num_threads=2, data_parallel_size=2)  # 2 workers x 2 threads
    assert on(num_threads=1, data_parallel_size=2)
    assert not on(num_threads=1, executor="inproc")  # no overlap in one process
    assert on(async_scheduling=True) and not on(async_scheduling=False, num_threads=1)
    monkeypatch.setenv("AIOENGINE_ASYNC_SCHEDULING", "1")
    assert on() and on(executor="inproc") and not on(async_scheduling=False)
    monkeypatch.setenv("AIOENGINE_ASYNC_SCHEDULING", "0")
    assert not on(num_threads=1) and on(async_scheduling=True)
    # The CLI's own words work in the environment and in LLM(...); "auto" keeps the rule;
    # anything else is refused rather than read as off (or, for a string, as on).
    monkeypatch.setenv("AIOENGINE_ASYNC_SCHEDULING", "on")
    assert on(num_threads=4)
    monkeypatch.setenv("AIOENGINE_ASYNC_SCHEDULING", "auto")
    assert on(num_threads=1) and not on(num_threads=4)
    monkeypatch.setenv("AIOENGINE_ASYNC_SCHEDULING", "maybe")
    with pytest.raises(ValueError, match="AIOENGINE_ASYNC_SCHEDULING must be on, off or auto"):
        on(num_threads=1)
    monkeypatch.delenv("AIOENGINE_ASYNC_SCHEDULING")
    assert not on(async_scheduling="off", num_threads=1) and on(async_scheduling="on")
    assert on(async_scheduling="auto", num_threads=1)
    with pytest.raises(ValueError, match="async_scheduling must be on, off or auto"):
        on(async_scheduling="maybe")


def test_cli_async_scheduling_flag():
    import argparse

    from aioengine.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    chosen = {flags: engine_kwargs(parser.parse_args(flags))["async_scheduling"]
              for flags in ((), ("--async-scheduling",), ("--async-scheduling", "auto"),
                            ("--async-scheduling", "off"), ("--no-async-scheduling",))}
    assert list(chosen.values()) == [None, True, None, False, False]
