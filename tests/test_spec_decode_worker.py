"""The worker's side of speculative decoding: n-gram drafts, logits selection,
batch expansion (spec_decode/ngram_proposer.py, spec_decode/verifier.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.models.llama import AttentionMetadata
from aioengine.spec_decode import verifier
from aioengine.spec_decode.ngram_proposer import NgramProposer, propose_ngram


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_ngram_proposes_what_followed_the_longest_match():
    # Last 3 tokens (7, 8, 9) occur at 0..2 followed by 1, 2; (8, 9) also occurs
    # at 5..6 followed by 5: the longer match wins.
    t = ids(7, 8, 9, 1, 2, 8, 9, 5, 0, 7, 8, 9)
    assert propose_ngram(t, 2, 3, 2).tolist() == [1, 2]
    # With max 2 the latest (8, 9) match wins.
    assert propose_ngram(t, 2, 2, 2).tolist() == [5, 0]


def test_ngram_needs_prompt_lookup_min_tokens_of_match():
    t = ids(1, 2, 3, 4, 9, 4)
    assert propose_ngram(t, 1, 3, 3).tolist() == [9, 4]   # "4" matched once, at index 3
    assert propose_ngram(t, 2, 3, 3).tolist() == []       # no 2-gram (9, 4) earlier
    assert propose_ngram(ids(5), 1, 3, 3).tolist() == []
    assert propose_ngram(ids(5, 5), 1, 3, 3).tolist() == [5]


def test_ngram_proposal_is_capped():
    t = ids(*range(10), *range(3))
    assert propose_ngram(t, 1, 3, 4).tolist() == [3, 4, 5, 6]
    proposer = NgramProposer(1, 3, 4)
    assert proposer.propose([t, t], [2, 0]) == [[3, 4], []]


def test_logits_indices_keep_every_draft_position():
    # Requests: 3 tokens (1 + 2 drafts), a 5-token prefill chunk (no sample),
    # 1 token (plain decode).
    cu = np.array([0, 3, 8, 9])
    got = verifier.logits_indices(cu, np.array([True, False, True]), np.array([2, 0, 0]))
    assert got.tolist() == [0, 1, 2, 8]


@pytest.fixture(scope="module")
def runner():
    from aioengine import LLM

    llm = LLM(executor="inproc", num_gpu_blocks_override=16)
    yield llm.executor.runner
    llm.shutdown()


def test_batch_expansion_scores_like_one_multi_token_query(runner):
    """Two requests, 4 and 3 query tokens over 37 and 20 cached tokens: each token
    as its own one-token decode gives the logits the causal multi-token query
    gives (fp32, to 1e-4)."""
    model, bs = runner.model, runner.block_size
    g = torch.Generator().manual_seed(0)
    ctx, q = np.array([37, 20]), np.array([4, 3])
    table = np.zeros((2, 8), dtype=np.int32)
    table[0, :4], table[1, :3] = [0, 1, 2, 3], [4, 5, 6]
    # Fill the context first (one prefill step), then score the queries both ways.
    tokens = [torch.randint(100, 5000, (int(c + n),), generator=g) for c, n in zip(ctx, q)]

    def metadata(starts, counts):
        req = np.repeat(np.arange(2), counts)
        pos = starts[req] + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                 counts)
        slots = table[req, pos // bs].astype(np.int64) * bs + pos % bs
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        seq = (starts + counts).astype(np.int32)
        attn = AttentionMetadata(torch.from_numpy(slots), torch.from_numpy(table.copy()),
                                 torch.from_numpy(cu), torch.from_numpy(seq),
                                 int(counts.max()), int(seq.max()))
        ids_ = torch.cat([t[s:s + n] for t, s, n in zip(tokens, starts, counts)])
        return ids_, torch.from_numpy(pos), attn, req

    ids0, pos0, attn0, _ = metadata(np.zeros(2, dtype=np.int64), ctx)
    model.forward(ids0, pos0, runner.kv_cache, attn0)
    ids1, pos1, attn1, req = metadata(ctx, q)
    multi = model.compute_logits(model.forward(ids1, pos1, runner.kv_cache, attn1))
    expanded = verifier.batch_expansion(q, q - 1, pos1.numpy(), req, table, bs,
                                        attn1.slot_mapping)
    assert expanded is not None and expanded.max_seqlen_q == 1
    single = model.compute_logits(model.forward(ids1, pos1, runner.kv_cache, expanded))
    torch.testing.assert_close(single, multi, atol=1e-4, rtol=1e-4)
    # A step with a prefill chunk keeps the usual metadata.
    assert verifier.batch_expansion(q, np.array([3, 0]), pos1.numpy(), req, table, bs,
                                    attn1.slot_mapping) is None
