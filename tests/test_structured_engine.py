"""Structured outputs through the engine (offline ``LLM``, in-process worker):
constrained requests survive preemption and recomputation with their matcher
state intact and give the same greedy tokens as alone; ``n > 1`` samples are
each constrained; a bad grammar raises before anything is queued."""

from __future__ import annotations

import re

import pytest

from aioengine import LLM, SamplingParams, StructuredOutputsParams
from aioengine.structured import GrammarError
from tests.parity import assert_greedy_parity

PATTERN = r"[a-z][a-z ]{70,90}\."
PROMPTS = ["The weather today is", "My favourite food is", "Once upon a time",
           "The best way to learn is", "In the year 3000", "A good friend always",
           ]


@pytest.fixture(scope="module")
def tight():
    engine = LLM(executor="inproc", num_gpu_blocks_override=8, block_size=16, max_num_seqs=8)
    yield engine
    engine.shutdown()


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=60, logprobs=2,
                          structured_outputs=StructuredOutputsParams(regex=PATTERN), **kw)


@pytest.mark.slow
def test_constrained_requests_survive_preemption_and_match_alone(tight):
    before = tight.stats().num_preemptions
    outs = tight.generate(PROMPTS, params(), use_tqdm=False)
    assert tight.stats().num_preemptions > before, "the workload must preempt"

    def top2(c):
        return [sorted(lp.values(), reverse=True)[:2] for lp in c.logprobs]

    for prompt, out in zip(PROMPTS, outs):
        got = out.outputs[0]
        assert got.finish_reason == "stop" and re.fullmatch(PATTERN, got.text), got.text
        alone = tight.generate([prompt], params(), use_tqdm=False)[0].outputs[0]
        n = min(len(got.token_ids), len(alone.token_ids))
        assert_greedy_parity(prompt, got.token_ids[:n], alone.token_ids[:n], top2(got)[:n],
                             top2(alone)[:n])


def test_n_samples_each_follow_the_grammar(tight):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=("alpha", "beta")))
    out = tight.generate(["Pick one:"], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(c.text in ("alpha", "beta") and c.finish_reason == "stop" for c in out.outputs)


def test_a_stop_string_ends_a_constrained_request_cleanly(tight):
    p = SamplingParams(temperature=0, max_tokens=40, stop=["e"],
                       structured_outputs=StructuredOutputsParams(regex=PATTERN))
    c = tight.generate(["Tell me something:"], p, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "e" and "e" not in c.text
    assert tight.stats().num_kv_blocks_used == 0


def test_a_bad_grammar_raises_before_queueing(tight):
    with pytest.raises(GrammarError):
        tight.generate(["x"], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(unclosed")), use_tqdm=False)
    assert not tight.engine.has_unfinished_requests()
