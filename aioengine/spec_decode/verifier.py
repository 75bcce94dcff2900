"""The worker's side of speculative decoding.

A request with drafts ``d_1..d_k`` is scheduled ``1 + k`` tokens: its last
token and the drafts, at positions ``n - 1 .. n - 1 + k``. The paged attention
already takes several query tokens per request (causal within the request),
so one forward scores them all; the runner keeps the logits of all ``k + 1``
positions (``logits_indices``), ``verify`` accepts a prefix of the drafts and
picks the token after it (``rejection_sampler``), and ``propose_next`` drafts
for the next step from the request's token row.

K/V of rejected drafts stay in the cache past the request's new
``num_computed_tokens``; the scheduler moves that back, so the next step
overwrites them (they are never read: attention reads ``seq_lens`` tokens).

Requests without drafts in the same step take the runner's normal sampler
(penalties, logprobs, grammars); the scheduler drafts only for requests the
verification covers (``spec_decode.scheduling.can_speculate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from aioengine.ipc.messages import SchedulerOutput
from aioengine.models.llama import AttentionMetadata
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.dynamic import DraftGate
from aioengine.spec_decode.ngram_proposer import NgramProposer
from aioengine.spec_decode.rejection_sampler import rejection_sample
from aioengine.worker.sampler import apply_top_k_top_p_min_p

if TYPE_CHECKING:
    from aioengine.worker.model_runner import CachedRequestState, ModelRunner


def write_draft_tokens(so: SchedulerOutput, states: list[CachedRequestState],
                       token_ids: np.ndarray) -> np.ndarray | None:
    """Put each request's scheduled drafts into its token row after its last token.

    Returns:
        ``[num_reqs]`` int64 draft counts aligned with ``states``, or None
        when the step has no drafts.
    """
    spec = so.scheduled_spec_decode_tokens
    if not spec:
        return None
    num_draft = np.zeros(len(states), dtype=np.int64)
    for i, state in enumerate(states):
        drafts = spec.get(state.req_id)
        if drafts:
            token_ids[state.row, state.num_tokens:state.num_tokens + len(drafts)] = drafts
            num_draft[i] = len(drafts)
    return num_draft


def logits_indices(cu_num_tokens: np.ndarray, sampling_mask: np.ndarray,
                   num_draft: np.ndarray) -> np.ndarray:
    """Flat token indices whose logits are kept: the last ``1 + k_i`` tokens of
    each sampling request ``i`` (``k_i = 0`` keeps only its last token).

    Args:
        cu_num_tokens: ``[num_reqs + 1]`` cumulative scheduled tokens.
        sampling_mask: ``[num_reqs]`` bool, the request samples this step.
        num_draft: ``[num_reqs]`` draft counts.
    """
    ends = cu_num_tokens[1:][sampling_mask]
    counts = num_draft[sampling_mask] + 1
    total = int(counts.sum())
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(ends - counts, counts) + offsets


def batch_expansion(num_scheduled: np.ndarray, num_draft: np.ndarray, positions: np.ndarray,
                    row_of_token: np.ndarray, block_table: np.ndarray, block_size: int,
                    slot_mapping: torch.Tensor) -> AttentionMetadata | None:
    """Attention metadata that scores every token of a decode-with-drafts step as
    its own one-token sequence (vLLM v0's batch-expansion scorer).

    Token ``j`` of a request (its last token, then the drafts) becomes a decode
    of a sequence of ``position + 1`` tokens over the request's block table. The
    forward writes every token's K/V for a layer before that layer's attention,
    so a draft attends to the drafts before it: exactly the causal attention of
    the request's ``1 + k`` query tokens. The step is then all decodes, which
    the fused CPU decode layers (and the decode attention kernels) take; a
    ``1 + k``-token query would take the general path, about 2x slower for
    ``k = 4`` on the default model.

    Returns:
        The expanded metadata, or None when some request is prefilling (a
        chunk of its prompt is in the step): then the usual metadata serves.
    """
    if not np.array_equal(num_scheduled, num_draft + 1):
        return None
    seq_lens = positions + 1
    max_seqlen_k = int(seq_lens.max())
    block_tables = block_table[row_of_token, :-(-max_seqlen_k // block_size)]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)),
        cu_seqlens_q=torch.arange(positions.shape[0] + 1, dtype=torch.int32),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
    )


def verify(runner: ModelRunner, logits: torch.Tensor, states: list[CachedRequestState],
           num_draft: np.ndarray, so: SchedulerOutput, sample_plain
           ) -> tuple[torch.Tensor, np.ndarray, list | None]:
    """Sample the requests without drafts, verify the ones with drafts.

    Args:
        logits: ``[sum(num_draft + 1), vocab]`` fp32, rows grouped per request.
        states: the sampling requests, aligned with ``num_draft``.
        num_draft: ``[len(states)]`` draft counts.
        sample_plain: ``(logits [m, vocab], states) -> (tokens [m], logprobs)``,
            the runner's normal sampler for the requests without drafts.

    Returns:
        ``(tokens [len(states)] int64, num_accepted [len(states)] int64,
        logprobs or None)``: request ``i`` emits its first ``num_accepted[i]``
        drafts, then ``tokens[i]``.
    """
    counts = num_draft + 1
    last_row = np.cumsum(counts) - 1
    tokens = torch.empty(len(states), dtype=torch.int64)
    num_accepted = np.zeros(len(states), dtype=np.int64)
    plain = np.flatnonzero(num_draft == 0)
    spec = np.flatnonzero(num_draft > 0)
    logprobs_out = None
    if plain.size:
        plain_tokens, plain_logprobs = sample_plain(logits[torch.from_numpy(last_row[plain])],
                                                    [states[i] for i in plain])
        tokens[torch.from_numpy(plain)] = plain_tokens
        if plain_logprobs is not None:
            logprobs_out = [None] * len(states)
            for i, lp in zip(plain.tolist(), plain_logprobs):
                logprobs_out[i] = lp
    if spec.size:
        spec_states = [states[i] for i in spec]
        k = num_draft[spec]
        first_row = last_row[spec] - k
        rows = np.repeat(first_row, k + 1) + (np.arange(int((k + 1).sum()))
                                              - np.repeat(np.cumsum(k + 1) - (k + 1), k + 1))
        spec_logits = logits[torch.from_numpy(rows)]
        expanded = [s for s, n in zip(spec_states, k.tolist()) for _ in range(n + 1)]
        batch = runner._sampling_batch(expanded)
        if batch.logit_bias is not None:
            r, t, b = batch.logit_bias
            spec_logits.index_put_((r, t), b, accumulate=True)
        argmax = spec_logits.argmax(-1)
        greedy = [s.sampling.temperature < 1e-5 for s in spec_states]
        probs = None
        if not all(greedy):
            temperature = torch.where(batch.temperature < 1e-5, 1.0, batch.temperature)
            probs = apply_top_k_top_p_min_p(spec_logits / temperature.unsqueeze(1),
                                            batch).softmax(-1)
        drafts = torch.from_numpy(np.concatenate([
            runner.token_ids[s.row, s.num_tokens:s.num_tokens + n]
            for s, n in zip(spec_states, k.tolist())]))
        draft_probs = None
        if probs is not None:  # a draft model's q for its sampled drafts (n-gram: none)
            qs = [runner.drafter.draft_probs(s, runner.token_ids[s.row, s.num_tokens:
                                                                 s.num_tokens + n])
                  for s, n in zip(spec_states, k.tolist())]
            if any(q is not None for q in qs):
                draft_probs = torch.cat([q if q is not None else probs.new_zeros(n, probs.shape[1])
                                         for q, n in zip(qs, k.tolist())])
        spec_tokens, acc = rejection_sample(probs, argmax, drafts, k.tolist(), greedy,
                                            [s.generator for s in spec_states], draft_probs)
        tokens[torch.from_numpy(spec)] = spec_tokens
        num_accepted[spec] = acc.numpy()
    return tokens, num_accepted, logprobs_out


def rollback_block_tables(states: list[CachedRequestState], seq_lens: np.ndarray,
                          num_draft: np.ndarray, num_accepted: np.ndarray,
                          block_size: int) -> None:
    """Mirror ``KVCacheManager.rollback`` in the worker's block tables: after
    a verification the scheduler keeps ``cdiv(num_computed_tokens, block_size)``
    blocks of the request, so the next step's new block ids continue from
    there (otherwise they land one entry too far and K/V go to a freed block).

    Args:
        seq_lens: ``[len(states)]`` tokens in the cache after this step's forward.
        num_draft, num_accepted: ``[len(states)]`` per request.
    """
    for state, seq_len, k, a in zip(states, seq_lens.tolist(), num_draft.tolist(),
                                    num_accepted.tolist()):
        if k:
            valid = seq_len - (k - a)
            state.num_blocks = min(state.num_blocks, -(-valid // block_size))


class DraftProposer:
    """Drafts for the next step, from the requests' token rows (n-gram), as many
    per request as the dynamic rule keeps (``spec_decode.dynamic``).

    Args:
        config: the speculative settings.
        max_model_len: context length; no draft reaches past it.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.num_speculative_tokens)
        self.gate = DraftGate(config.verify_token_cost)

    def propose_next(self, token_ids: np.ndarray, states: list[CachedRequestState]
                     ) -> list[list[int]]:
        """Per state, its drafts (empty for requests verification does not cover:
        logprobs, penalties; and for all when the batch is at
        ``disable_by_batch_size``, where the scheduler would not take them).

        Every proposal is remembered, verified or not, and scored against the
        tokens the next step emits (``DraftGate``); the dynamic rule then keeps
        a prefix of each, the whole proposal or nothing, for the next step's
        batch (taken to be this step's size).
        """
        cfg = self.config
        if cfg.disable_by_batch_size and len(states) >= cfg.disable_by_batch_size:
            return [[] for _ in states]  # nothing would be verified: nothing to pay for
        rows, caps = [], []
        for s in states:
            p = s.sampling
            eligible = (p.logprobs < 0 and not p.presence_penalty and not p.frequency_penalty
                        and p.repetition_penalty == 1.0)
            rows.append(token_ids[s.row, :s.num_tokens])
            caps.append(self.max_model_len - s.num_tokens if eligible else 0)
        estimates = self.gate.observe([s.req_id for s in states], rows)
        proposals = self.ngram.propose(rows, caps)
        keep = self.gate.decide(estimates, [len(d) for d in proposals], len(states),
                                [s.sampling.temperature >= 1e-5 for s in states])
        for est, s, d in zip(estimates, states, proposals):
            self.gate.proposed(est, s.num_tokens, d)
        return [d[:k] for d, k in zip(proposals, keep.tolist())]

    def draft_probs(self, state: CachedRequestState, drafts: np.ndarray) -> None:
        """N-gram drafts are point masses: no ``q``."""
        return None
