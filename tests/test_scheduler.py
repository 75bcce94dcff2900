"""Scheduler logic, stepped against a deterministic stand-in for the model.

The stand-in "samples" a token that is a hash of the whole sequence so far,
so any token repeated, lost or reordered around a preemption changes every
later token, exactly as a real model would.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest

from aioengine.config import SchedulerConfig
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.core.scheduler import Scheduler, SchedulerQueueFull
from aioengine.ipc.messages import ModelRunnerOutput, SamplingMetadata
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams
from tests.factories import distinct_prompt

BS = 16


def next_token(tokens: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(repr(tokens).encode()).digest()[:2], "little") + 10


def meta(request: Request) -> SamplingMetadata:
    return SamplingMetadata(0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, 0, -1, 0, [], [])


class Harness:
    def __init__(self, num_blocks: int, **config) -> None:
        self.kv = KVCacheManager(num_blocks, BS)
        self.sched = Scheduler(SchedulerConfig(**config), self.kv, 100_000, meta)
        self.steps: list[dict[str, int]] = []
        self.finished: list[str] = []

    def add(self, rid: str, prompt_len: int, max_tokens: int, priority: int = 0,
            arrival: float | None = None) -> Request:
        prompt = distinct_prompt(rid, prompt_len)
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    max_tokens, None, priority, arrival)
        self.sched.add_request(r)
        return r

    def step(self) -> None:
        so = self.sched.schedule()
        order = self.sched._scheduled_order
        self.steps.append(dict(zip([r.request_id for r in order], so.num_scheduled_tokens)))
        sampled = []
        for r, n in zip(order, so.num_scheduled_tokens):
            done = r.num_computed_tokens + n >= r.num_tokens
            sampled.append(next_token(r.all_token_ids) if done else -1)
        running_before = {r.request_id for r in order}
        self.sched.update_from_output(so, ModelRunnerOutput(so.step_id, sampled, None, 0, 0))
        for rid in running_before:
            req = self.sched.requests.get(rid)
            if req is None and rid not in self.finished:
                self.finished.append(rid)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("did not finish")


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def test_preemption_repeats_and_loses_nothing():
    h = Harness(num_blocks=24, max_num_batched_tokens=256, max_num_seqs=16)
    reqs = [h.add(f"r{i}", 40 + 13 * i, 30 + 7 * i) for i in range(10)]
    h.run()
    assert h.sched.stats.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert h.kv.block_pool.num_free_blocks == 24


def test_long_prefill_never_stalls_running_streams():
    h = Harness(num_blocks=1000, max_num_batched_tokens=512, max_num_seqs=16)
    streams = [h.add(f"s{i}", 20, 60) for i in range(4)]
    for _ in range(3):
        h.step()
    h.add("long", 4000, 4)
    start = len(h.steps)
    h.run()
    # The 4,000-token prompt was chunked over several steps...
    long_steps = [i for i, s in enumerate(h.steps) if "long" in s]
    assert len(long_steps) >= 4000 // 512
    assert all(h.steps[i]["long"] <= 512 for i in long_steps)
    # ...and every running stream got its next token at every step meanwhile.
    for s in streams:
        seen = [i for i, step in enumerate(h.steps) if s.request_id in step and i >= start]
        gaps = [b - a for a, b in itertools.pairwise(seen)]
        assert max(gaps) <= 2
    assert any(len(step) > 1 and "long" in step for step in h.steps)


def test_without_chunked_prefill_the_long_prompt_waits_for_budget():
    h = Harness(num_blocks=1000, max_num_batched_tokens=512, max_num_seqs=16,
                enable_chunked_prefill=False)
    h.add("a", 20, 4)
    h.add("long", 600, 4)
    h.step()
    assert "long" not in h.steps[0], "a prompt over the budget is never split when off"


def test_high_priority_request_arriving_last_finishes_first():
    h = Harness(num_blocks=1000, max_num_batched_tokens=512, max_num_seqs=2)
    for i in range(4):
        h.add(f"low{i}", 30, 40, priority=1, arrival=float(i))
    h.step()
    h.step()
    h.add("high", 30, 40, priority=0, arrival=10.0)
    h.run()
    # low0 and low1 held both seats; high took low1's (the latest arrival of
    # the lowest priority). Only low0, two steps ahead, may finish before it.
    assert h.finished[:2] == ["low0", "high"], h.finished
    assert h.sched.stats.num_preemptions == 1


def test_fcfs_within_a_priority():
    h = Harness(num_blocks=1000, max_num_batched_tokens=512, max_num_seqs=1)
    for i in range(3):
        h.add(f"r{i}", 10, 3, arrival=float(i))
    h.run()
    assert h.finished == ["r0", "r1", "r2"]


def test_waiting_queue_is_bounded():
    h = Harness(num_blocks=100, max_waiting_requests=3)
    for i in range(3):
        h.add(f"r{i}", 10, 3)
    with pytest.raises(SchedulerQueueFull):
        h.add("r3", 10, 3)
    h.step()  # admitting requests makes room again
    h.add("r4", 10, 3)


def test_budget_and_seq_cap_hold_every_step():
    h = Harness(num_blocks=400, max_num_batched_tokens=100, max_num_seqs=5)
    for i in range(12):
        h.add(f"r{i}", 30 + 11 * i, 10)
    h.run()
    assert all(sum(s.values()) <= 100 and len(s) <= 5 for s in h.steps)
    assert h.sched.stats.max_reqs_in_step == 5
