"""Dynamic speculation (spec_decode/dynamic.py): which drafts a step verifies.

The rule is exercised through the worker's n-gram proposer (``DraftProposer``)
with request states made by hand and a token table standing in for the model:
every request repeats a phrase, so the n-gram lookup always has a draft, and
the test decides what the "model" emits after each step. A rule that ignored
the batch size, or a request's acceptance, fails here.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aioengine.ipc.messages import SamplingMetadata
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.dynamic import num_drafts, threshold
from aioengine.spec_decode.verifier import DraftProposer
from aioengine.worker.model_runner import CachedRequestState

PHRASE = [11, 12, 13, 14, 15, 16, 17, 18]
WIDTH = 256


def greedy() -> SamplingMetadata:
    return SamplingMetadata(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                            presence_penalty=0.0, frequency_penalty=0.0,
                            repetition_penalty=1.0, seed=0, logprobs=-1, min_tokens=0,
                            stop_token_ids=[], logit_bias=[])


class Batch:
    """``n`` requests, each its phrase twice and then the phrase's first token."""

    def __init__(self, n: int) -> None:
        self.token_ids = np.zeros((n, WIDTH), dtype=np.int64)
        self.states = []
        for i in range(n):
            text = PHRASE * 2 + PHRASE[:1]
            self.token_ids[i, :len(text)] = text
            self.states.append(CachedRequestState(f"r{i}", i, 4, len(text), 0, greedy(),
                                                  None))  # type: ignore[arg-type]

    def emit(self, state: CachedRequestState, drafts: list[int], right: bool) -> None:
        """One step of a greedy "model" verifying ``drafts``: when ``right`` it
        continues the phrase from the last token, else it writes a token never
        seen before; it emits the drafts that match it and its next token."""
        row, n = state.row, state.num_tokens
        if right:
            last = int(self.token_ids[row, n - 1])
            start = PHRASE.index(last) + 1 if last in PHRASE else 0
            truth = [PHRASE[(start + j) % len(PHRASE)] for j in range(len(drafts) + 1)]
        else:
            truth = [1000 + n]
        a = 0
        while a < len(drafts) and drafts[a] == truth[a]:
            a += 1
        self.token_ids[row, n:n + a + 1] = truth[:a + 1]
        state.num_tokens += a + 1


def proposer(**kw) -> DraftProposer:
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3,
                            **kw)
    return DraftProposer(cfg, max_model_len=WIDTH - 1)


def test_a_batch_past_the_threshold_gets_no_drafts():
    """A request that has not shown its acceptance yet (prior 0.5) drafts alone
    (threshold 0.25 at batch 1) but not among 6 (threshold 0.67); the same
    requests, once their drafts keep being right, draft among 6 too."""
    alone = Batch(1)
    assert len(proposer().propose_next(alone.token_ids, alone.states)[0]) > 0

    batch = Batch(6)
    p = proposer()
    drafts = p.propose_next(batch.token_ids, batch.states)
    assert drafts == [[]] * 6, "six unproven requests must not draft"
    # The proposals were still made and are scored against what the "model" emits,
    # so acceptance is learnt while nothing is verified.
    for _ in range(6):
        for s, d in zip(batch.states, drafts):
            batch.emit(s, d, right=True)
        drafts = p.propose_next(batch.token_ids, batch.states)
    assert all(len(d) == 3 for d in drafts), drafts
    # No rule at all (cost 0) drafts at once.
    fresh = Batch(6)
    assert all(proposer(verify_token_cost=0.0).propose_next(fresh.token_ids, fresh.states))


def test_a_request_with_low_acceptance_stops_proposing():
    """Alone, a request drafts; after its first drafts are rejected a few times
    it stops; when its text turns back into a copy (shadow-scored proposals
    right again) it resumes."""
    batch = Batch(1)
    p = proposer()
    state = batch.states[0]
    history = []
    for _ in range(8):
        drafts = p.propose_next(batch.token_ids, batch.states)[0]
        history.append(len(drafts))
        batch.emit(state, drafts, right=False)
        # Back onto the phrase, so the n-gram lookup has a draft next step.
        n = state.num_tokens
        batch.token_ids[0, n:n + 3] = PHRASE[:3]
        state.num_tokens += 3
    assert history[0] > 0 and history[-3:] == [0, 0, 0], history
    for _ in range(8):
        drafts = p.propose_next(batch.token_ids, batch.states)[0]
        batch.emit(state, drafts, right=True)
    assert len(p.propose_next(batch.token_ids, batch.states)[0]) == 3


def test_no_proposals_at_disable_by_batch_size():
    batch = Batch(8)
    assert proposer(verify_token_cost=0.0).propose_next(batch.token_ids, batch.states) == [[]] * 8


def goodput(first, nxt, k, cost, b) -> float:
    """Expected tokens per unit of step time with ``k[i]`` drafts for request ``i``."""
    tokens = b + sum(a * r ** j for a, r, ki in zip(first, nxt, k) for j in range(ki))
    return tokens / ((1 - cost) + cost * (b + sum(k)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.integers(0, 3), st.booleans()),
                min_size=1, max_size=4),
       st.sampled_from([0.05, 0.25, 0.5]))
def test_the_rule_maximises_expected_tokens_per_second(reqs, cost):
    """Against every choice of draft counts: the rule's goodput is the best.
    Requests marked ``alone`` (sampled) take their batch-1 choice; the others'
    choice is the best given theirs."""
    first = [a for a, _, _, _ in reqs]
    nxt = [r for _, r, _, _ in reqs]
    cap = [m for _, _, m, _ in reqs]
    alone = [x for _, _, _, x in reqs]
    b = len(reqs)
    got = num_drafts(np.array(first), np.array(nxt), np.array(cap), cost, alone=np.array(alone))
    assert all(0 <= g <= m for g, m in zip(got.tolist(), cap))
    for i in np.flatnonzero(alone).tolist():
        assert got[i] == num_drafts(np.array(first[i:i + 1]), np.array(nxt[i:i + 1]),
                                    np.array(cap[i:i + 1]), cost)[0]
    choices = [range(m + 1) if not a else [int(g)] for m, a, g in zip(cap, alone, got)]
    best = max(goodput(first, nxt, k, cost, b) for k in itertools.product(*choices))
    assert goodput(first, nxt, got.tolist(), cost, b) >= best - 1e-9


def test_a_sampled_request_drafts_as_if_alone():
    """Its drafts must not depend on the batch (a seeded request samples with
    them); a greedy one's do."""
    batch = Batch(6)
    for s in batch.states[:3]:
        s.sampling.temperature = 0.8
    drafts = proposer().propose_next(batch.token_ids, batch.states)
    assert [len(d) > 0 for d in drafts] == [True] * 3 + [False] * 3


def test_the_threshold_grows_with_the_batch():
    assert threshold(1, 0.25) == 0.25
    assert 0.83 < threshold(16, 0.25) < 0.85
    assert threshold(64, 0.0) == 0.0
