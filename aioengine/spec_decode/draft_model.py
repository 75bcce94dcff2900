"""Draft-model proposals (vLLM's ``draft_model`` method; llama.cpp's ``--model-draft``).

A smaller model with the target's tokenizer runs in the same worker and
proposes ``k`` tokens per request by ``k`` autoregressive forwards from the
request's last token: greedy requests take the draft's argmax, sampled ones
draw from the draft's distribution ``q`` (the request's temperature and
top-k/top-p/min-p applied to the draft's logits), and ``q`` is kept for the
rejection sampler (``rejection_sample(..., draft_probs=q)``): the target's
distribution is then kept exactly whatever the draft is.

The draft's paged KV cache mirrors the target's block ids: the same block
``b`` of a request holds the target's K/V in the target's cache and the
draft's in its own, smaller per-layer tensors, so the scheduler, the block
manager, prefix caching, copy-on-write (``copy_blocks`` is applied to both)
and preemption need nothing new. The draft cache has
``max_num_seqs * scratch_blocks_per_seq`` more blocks than the target's:
positions past a request's allocated blocks (its next token and the drafts,
which the scheduler allocates only when it schedules them) are written to the
request's scratch blocks for the duration of one proposal.

Which draft K/V are valid is tracked per request (``draft_num_computed``:
positions ``[0, draft_num_computed)`` hold the draft's K/V of the request's
real tokens, in its real blocks). A proposal first catches up: one forward
over the request's tokens from ``draft_num_computed`` to its last token (the
whole prompt for a new or resumed request, the accepted drafts' successor
after a verification, or more after steps without drafting), whose last
logits give the first draft; then ``k - 1`` one-token decodes. Positions the
proposal wrote for drafts that were later accepted stay valid (same token,
same position, in a real block); rejected ones are simply overwritten later.
A new request always recomputes from position 0: its prefix-cached blocks
may have come from a request that never ran the draft over them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from aioengine.config import EngineConfig
from aioengine.models import registry
from aioengine.models.decoder import DecoderArch
from aioengine.models.layers.attention import AttentionMetadata
from aioengine.models.loader import load_hf_config, load_weights
from aioengine.spec_decode.dynamic import DraftGate
from aioengine.spec_decode.rejection_sampler import draw_from_probs
from aioengine.worker.sampler import apply_top_k_top_p_min_p

if TYPE_CHECKING:
    from aioengine.worker.model_runner import CachedRequestState, ModelRunner

logger = logging.getLogger(__name__)

#: Catch-ups of at most this many tokens per request run as one-token decodes.
EXPAND_MAX_QUERY = 8


class DraftModelProposer:
    """The draft model, its paged KV cache and its proposals.

    Args:
        config: engine settings; ``config.speculative.model`` is the draft.
        target: the target's runner (its block tables, dtype, cache sizes).

    Raises:
        ValueError: the draft's vocabulary size is not the target's.
    """

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        from aioengine.worker.model_runner import (
            choose_dtype,
            choose_kv_cache_dtype,
            cpu_flags,
            resident_zeros,
        )

        t0 = time.perf_counter()
        spec = config.speculative
        assert spec is not None and spec.model is not None
        self.config = spec
        self.target = target
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.gate = DraftGate(spec.verify_token_cost)
        path = spec.model
        self.dtype, _ = choose_dtype(config.model.dtype, "cpu", cpu_flags(), path.endswith(".gguf"))
        try:
            kv_dtype = choose_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, "cpu")
        except ValueError:
            kv_dtype = self.dtype
        hf_config = load_hf_config(path)
        arch = DecoderArch.from_hf_config(hf_config)
        if arch.vocab_size != target.arch.vocab_size:
            raise ValueError(
                f"speculative draft model {path!r} has a vocabulary of "
                f"{arch.vocab_size} tokens, the target {target.arch.vocab_size}"
            )
        model_class = registry.model_class(registry.family_of_config(hf_config))
        weights = load_weights(path, hf_config, self.dtype)
        self.model = model_class(arch, weights, self.dtype, target.max_model_len + 1)
        self.arch = self.model.arch
        self.block_size = bs = target.block_size
        self.max_model_len = target.max_model_len
        self.num_target_blocks = target.num_blocks
        # A proposal writes positions n - 1 .. n + k - 2 past the n - 1 computed ones.
        self.scratch_blocks_per_seq = -(-self.num_speculative_tokens // bs) + 1
        self.max_num_seqs = config.scheduler.max_num_seqs
        num_blocks = self.num_target_blocks + self.max_num_seqs * self.scratch_blocks_per_seq
        a = self.arch
        self.kv_cache = resident_zeros(
            (a.num_layers, 2, num_blocks, bs, a.num_kv_heads, a.head_dim), kv_dtype
        )
        logger.info(
            "draft model %s: %.1f MB, KV cache of %d blocks, ready in %.2f s",
            path,
            self.model.parameter_bytes() / 1e6,
            num_blocks,
            time.perf_counter() - t0,
        )

    # -- cache bookkeeping ----------------------------------------------------------------
    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Apply the step's copy-on-write ``[n, 2]`` (src, dst) to the draft cache too."""
        import triton_kernels

        triton_kernels.copy_blocks(self.kv_cache, pairs)

    @staticmethod
    def reset(state: CachedRequestState) -> None:
        """Nothing of the request is in the draft cache (preempted and resumed)."""
        state.draft_num_computed = 0
        state.draft_pending = None
        state.draft_probs = None

    def _credit_accepted(self, token_ids: np.ndarray, state: CachedRequestState) -> None:
        """After a verification: the last proposal's K/V of drafts that were
        accepted (same token at the same position, written to a real block) is
        valid; extend ``draft_num_computed`` over them."""
        pending, state.draft_pending = state.draft_pending, None
        if pending is None:
            return
        n0, proposed, real_end = pending
        if state.draft_num_computed != n0:
            return
        # Positions n0 .. n0 + len - 2 hold proposed[:-1]; trust only positions
        # before the last token (the target has computed them).
        span = min(len(proposed) - 1, state.num_tokens - 1 - n0)
        if span <= 0:
            return
        got = token_ids[state.row, n0 : n0 + span]
        match = int(np.cumprod(got == np.asarray(proposed[:span])).sum())
        state.draft_num_computed = min(n0 + match, real_end)

    # -- proposals ----------------------------------------------------------------------
    def _block_tables(self, states: list[CachedRequestState], width: int) -> np.ndarray:
        """``[len(states), width]`` draft block tables: each request's real blocks,
        then its own scratch blocks."""
        rows = np.array([s.row for s in states], dtype=np.int64)
        num_blocks = np.array([s.num_blocks for s in states], dtype=np.int64)
        real = self.target.block_table[rows, :width].astype(np.int64)
        col = np.arange(width)[None, :]
        over = np.clip(col - num_blocks[:, None], 0, self.scratch_blocks_per_seq - 1)
        scratch = (
            self.num_target_blocks
            + np.arange(len(states))[:, None] * self.scratch_blocks_per_seq
            + over
        )
        return np.where(col < num_blocks[:, None], real, scratch)

    def _forward(
        self,
        tables: np.ndarray,
        token_ids: np.ndarray,
        positions: np.ndarray,
        num_query: np.ndarray,
        seq_lens: np.ndarray,
    ) -> torch.Tensor:
        """One draft forward; returns fp32 logits ``[len(num_query), vocab]`` of each
        request's last query token."""
        bs = self.block_size
        cu = np.zeros(len(num_query) + 1, dtype=np.int64)
        np.cumsum(num_query, out=cu[1:])
        req_of_token = np.repeat(np.arange(len(num_query)), num_query)
        slots = tables[req_of_token, positions // bs] * bs + positions % bs
        max_k = int(seq_lens.max())
        width = -(-max_k // bs)
        if 1 < int(num_query.max()) <= EXPAND_MAX_QUERY:
            # Batch expansion (as the verifier scores drafts): each token a one-token
            # decode over its request's blocks, so the fused decode layers take the
            # step; a layer writes all tokens' K/V before attending, so it is causal.
            attn = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots),
                block_tables=torch.from_numpy(
                    np.ascontiguousarray(tables[req_of_token, :width].astype(np.int32))
                ),
                cu_seqlens_q=torch.arange(len(positions) + 1, dtype=torch.int32),
                seq_lens=torch.from_numpy((positions + 1).astype(np.int32)),
                max_seqlen_q=1,
                max_seqlen_k=max_k,
            )
        else:
            attn = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots),
                block_tables=torch.from_numpy(
                    np.ascontiguousarray(tables[:, :width].astype(np.int32))
                ),
                cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
                seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
                max_seqlen_q=int(num_query.max()),
                max_seqlen_k=max_k,
            )
        hidden = self.model.forward(
            torch.from_numpy(token_ids), torch.from_numpy(positions), self.kv_cache, attn
        )
        return self.model.compute_logits(hidden[torch.from_numpy(cu[1:] - 1)])

    def _draw(
        self, logits: torch.Tensor, states: list[CachedRequestState]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens ``[m]`` and, when some request samples, ``q`` ``[m, vocab]``
        (the distribution each sampled token was drawn from; greedy rows unused).
        A sampled row's token is drawn from ``q`` by inverse transform sampling with
        one fp64 uniform from the request's generator (``draw_from_probs``, the main
        sampler's scheme): ``k`` drafts take ``k`` uniforms, whatever the batch."""
        greedy = [s.sampling.temperature < 1e-5 for s in states]
        tokens = logits.argmax(-1)
        if all(greedy):
            return tokens, None
        batch = self.target._sampling_batch(states)
        temperature = torch.where(batch.temperature < 1e-5, 1.0, batch.temperature)
        q = apply_top_k_top_p_min_p(logits / temperature.unsqueeze(1), batch).softmax(-1)
        sampled = [i for i, g in enumerate(greedy) if not g]
        index = torch.tensor(sampled, dtype=torch.int64)
        tokens[index] = draw_from_probs(q[index], [states[i].generator for i in sampled])
        return tokens, q

    def propose_next(
        self, token_ids: np.ndarray, states: list[CachedRequestState]
    ) -> list[list[int]]:
        """Per state, its drafts (empty for requests verification does not cover,
        or when the batch is at ``disable_by_batch_size``: the scheduler would
        not take them), as many as the dynamic rule keeps (``DraftGate``; none
        for a request it keeps at 0, which then costs no draft forward). Keeps
        each sampled request's ``q`` in ``state.draft_probs``."""
        out: list[list[int]] = [[] for _ in states]
        cfg = self.config
        if cfg.disable_by_batch_size and len(states) >= cfg.disable_by_batch_size:
            return out
        picked, caps = [], []
        for i, s in enumerate(states):
            p = s.sampling
            s.draft_probs = None
            if (
                p.logprobs >= 0
                or p.presence_penalty
                or p.frequency_penalty
                or p.repetition_penalty != 1.0
            ):
                s.draft_pending = None
                continue
            cap = min(self.num_speculative_tokens, self.max_model_len - s.num_tokens)
            if cap > 0:
                self._credit_accepted(token_ids, s)
                picked.append(i)
                caps.append(cap)
        # The dynamic rule (spec_decode.dynamic) before drafting: a request it keeps
        # at 0 costs no draft forward, one it keeps at k costs k - 1 decodes.
        estimates = self.gate.observe([states[i].req_id for i in picked],
                                      [token_ids[states[i].row, :states[i].num_tokens]
                                       for i in picked])
        keep = self.gate.decide(estimates, caps, len(states),
                                [states[i].sampling.temperature >= 1e-5 for i in picked]).tolist()
        chosen = [j for j, k in enumerate(keep) if k > 0]
        picked = [picked[j] for j in chosen]
        caps = [keep[j] for j in chosen]
        estimates = [estimates[j] for j in chosen]
        if not picked:
            return out
        sel = [states[i] for i in picked]
        cap = np.array(caps, dtype=np.int64)
        n = np.array([s.num_tokens for s in sel], dtype=np.int64)
        rows = np.array([s.row for s in sel], dtype=np.int64)
        start = np.minimum([s.draft_num_computed for s in sel], n - 1)
        width = int(((n + cap - 2) // self.block_size).max()) + 1
        tables = self._block_tables(sel, width)

        # Catch up to the last token; its logits give the first draft.
        num_query = n - start
        cu = np.cumsum(num_query) - num_query
        req_of_token = np.repeat(np.arange(len(sel)), num_query)
        positions = start[req_of_token] + np.arange(int(num_query.sum())) - cu[req_of_token]
        logits = self._forward(
            tables, token_ids[rows[req_of_token], positions], positions, num_query, n
        )
        drafts = np.zeros((len(sel), int(cap.max())), dtype=np.int64)
        probs: list[list[torch.Tensor]] = [[] for _ in sel]
        active = np.arange(len(sel))
        for j in range(int(cap.max())):
            act_states = [sel[i] for i in active]
            tokens, q = self._draw(logits, act_states)
            drafts[active, j] = tokens.numpy()
            if q is not None:
                for r, i in enumerate(active.tolist()):
                    probs[i].append(q[r])
            active = active[cap[active] > j + 1]
            if not active.size:
                break
            # One decode: draft j at position n + j, for the requests wanting more.
            positions = n[active] + j
            tables_a = tables[active]
            logits = self._forward(
                tables_a,
                drafts[active, j],
                positions,
                np.ones(active.size, dtype=np.int64),
                positions + 1,
            )
        real_end = np.array([s.num_blocks for s in sel]) * self.block_size
        for k, (i, s) in enumerate(zip(picked, sel)):
            proposal = drafts[k, : cap[k]].tolist()
            out[i] = proposal
            self.gate.proposed(estimates[k], int(n[k]), proposal)
            s.draft_num_computed = int(min(n[k], real_end[k]))
            s.draft_pending = (int(n[k]), proposal, int(real_end[k]))
            if probs[k] and s.sampling.temperature >= 1e-5:
                s.draft_probs = torch.stack(probs[k])
        return out

    def draft_probs(self, state: CachedRequestState, drafts: np.ndarray) -> torch.Tensor | None:
        """``q`` ``[len(drafts), vocab]`` of a sampled request's scheduled drafts
        (a prefix of its last proposal), or None for a greedy request."""
        if state.draft_probs is None:
            return None
        pending = state.draft_pending
        if pending is None or pending[1][: len(drafts)] != drafts.tolist():
            raise RuntimeError(
                f"request {state.req_id}: scheduled drafts are not its last proposal"
            )
        return state.draft_probs[: len(drafts)]
