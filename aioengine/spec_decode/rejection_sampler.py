"""Verification of draft tokens: speculative sampling that keeps the target's distribution.

For a request with drafts ``d_1..d_k`` the target model scored ``k + 1``
positions in one forward: row ``j`` (``0 <= j <= k``) is the target's
distribution ``p_j`` of the token after ``d_1..d_j``. The draft came from
``q_j`` (a point mass on ``d_{j+1}`` for n-gram drafts).

- Sampled requests (Leviathan et al. 2023, "Fast Inference from Transformers
  via Speculative Decoding", Algorithm 1 and Appendix A.1; Chen et al. 2023,
  "Accelerating LLM Decoding with Speculative Sampling", Algorithm 2): draft
  ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``, in
  order; at the first rejection the token is drawn from
  ``norm(max(0, p_j - q_j))`` and the step ends; when all ``k`` are accepted a
  bonus token is drawn from ``p_k``. Every emitted token is then distributed
  exactly as the target would have sampled it alone. With a point-mass draft
  the acceptance probability is ``p_j(d)`` and the residual is ``p_j`` with
  ``d`` removed.
- Greedy requests accept the longest prefix of drafts equal to the target's
  argmax, then emit the argmax at the first mismatch (or the bonus argmax):
  exactly the tokens greedy decoding without drafts produces.

Everything is batched over all drafts of all requests; the only per-request
Python work is drawing each request's random numbers from its own generator
(so a seeded request samples the same alone or in any batch). The random
numbers are the main sampler's (``worker/sampler.py``): fp64 uniforms from the
request's ``torch.Generator``, one per accept test and one per drawn token,
which is picked by inverse transform sampling (``draw_from_probs``). A sampled
request with ``k`` drafts therefore takes exactly ``k + 1`` uniforms per step,
whatever is accepted, and its tokens depend only on its own rows.
"""

from __future__ import annotations

import torch

from aioengine.worker.sampler import row_uniforms
from triton_kernels import cpu_ops


def draw_from_probs(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` by inverse transform sampling (Devroye 1986,
    §2.1), with one fp64 uniform per row from the row's own generator: the first
    token, in vocabulary order, whose cumulative probability exceeds ``u`` times the
    row's total (rows need not be normalised). The main sampler's draw
    (``cpu_ops.sample_from_logits`` with temperature 1 and no filter, on ``log p``).

    Args:
        probs: ``[n, vocab]`` fp32, non-negative, each row with a positive entry.
        generators: ``n`` generators; each gives one uniform.

    Returns:
        ``[n]`` int64 token ids.
    """
    n = probs.shape[0]
    rows = torch.arange(n, dtype=torch.int64)
    return cpu_ops.sample_from_logits(
        probs.float().log().contiguous(), rows, torch.ones(n), torch.zeros(n, dtype=torch.int64),
        torch.ones(n), torch.zeros(n), row_uniforms(generators))


def rejection_sample(target_probs: torch.Tensor | None, target_argmax: torch.Tensor,
                     draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                     greedy: list[bool], generators: list[torch.Generator],
                     draft_probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject every request's drafts and pick the token that follows.

    Args:
        target_probs: ``[num_rows, vocab]`` fp32 target distributions, rows
            grouped by request (``num_draft_tokens[i] + 1`` rows for request
            ``i``), after temperature, top-k/top-p/min-p; None when every
            request is greedy.
        target_argmax: ``[num_rows]`` int64, the greedy token of each row.
        draft_token_ids: ``[num_drafts]`` int64, all requests' drafts in order
            (``num_drafts = sum(num_draft_tokens)``).
        num_draft_tokens: per request, its draft count ``k_i >= 0``.
        greedy: per request, accept by argmax instead of by probability.
        generators: per request, its random generator (unused for greedy); a
            sampled request with ``k`` drafts takes ``k + 1`` fp64 uniforms from it.
        draft_probs: ``[num_drafts, vocab]`` draft distributions ``q``; None for
            point-mass drafts (n-gram).

    Returns:
        ``(output_token_ids [num_reqs] int64, num_accepted [num_reqs] int64)``:
        request ``i`` emits ``drafts_i[:num_accepted[i]] + [output_token_ids[i]]``.
    """
    num_reqs = len(num_draft_tokens)
    k = torch.tensor(num_draft_tokens, dtype=torch.int64)
    num_rows = target_argmax.shape[0]
    if num_rows != int(k.sum()) + num_reqs:
        raise ValueError(f"{num_rows} target rows for {num_reqs} requests with "
                         f"{int(k.sum())} drafts (want drafts + one per request)")
    row_start = torch.cumsum(k + 1, 0) - (k + 1)                    # [num_reqs]
    req_of_draft = torch.repeat_interleave(torch.arange(num_reqs), k)  # [num_drafts]
    pos_in_req = torch.arange(draft_token_ids.shape[0]) - (row_start - torch.arange(num_reqs)
                                                          )[req_of_draft]
    row_of_draft = row_start[req_of_draft] + pos_in_req
    greedy_t = torch.tensor(greedy, dtype=torch.bool)

    accepted = draft_token_ids == target_argmax[row_of_draft]
    if target_probs is not None and not all(greedy):
        # u < p / q, written u * q < p so a zero q never divides; one fp64 uniform per
        # draft from the request's generator, every draft tested (k per step).
        uniforms = torch.zeros(draft_token_ids.shape[0], dtype=torch.float64)
        starts = (row_start - torch.arange(num_reqs)).tolist()
        for i, (gen, n) in enumerate(zip(generators, num_draft_tokens)):
            if not greedy[i] and n:
                uniforms[starts[i]:starts[i] + n] = torch.rand(n, dtype=torch.float64,
                                                               generator=gen)
        p = target_probs[row_of_draft, draft_token_ids].double()
        q = (torch.ones_like(p) if draft_probs is None
             else draft_probs[torch.arange(draft_token_ids.shape[0]), draft_token_ids].double())
        by_prob = uniforms * q < p
        accepted = torch.where(greedy_t[req_of_draft], accepted, by_prob)

    # Leading accepted drafts: the first rejected position, or k when none is.
    num_accepted = k.clone()
    rejected = ~accepted
    if rejected.any():
        num_accepted.scatter_reduce_(0, req_of_draft[rejected], pos_in_req[rejected], "amin")
    out_rows = row_start + num_accepted
    tokens = target_argmax[out_rows].clone()
    if target_probs is None or all(greedy):
        return tokens, num_accepted

    # Sampled rows: the residual norm(max(0, p - q)) after a rejection, p itself
    # for the bonus token. Normalisation is implicit in the inverse transform.
    dist = target_probs[out_rows].clone()                            # [num_reqs, vocab]
    was_rejected = num_accepted < k
    if was_rejected.any():
        rej_reqs = torch.nonzero(was_rejected).squeeze(1)
        rej_drafts = (row_start - torch.arange(num_reqs))[rej_reqs] + num_accepted[rej_reqs]
        if draft_probs is None:
            dist[rej_reqs, draft_token_ids[rej_drafts]] = 0.0
        else:
            dist[rej_reqs] = (dist[rej_reqs] - draft_probs[rej_drafts]).clamp_(min=0.0)
        # p <= q everywhere only when p == q, where rejection has probability 0;
        # rounding can still get here: fall back to p.
        empty = dist[rej_reqs].sum(-1) <= 0
        if empty.any():
            dist[rej_reqs[empty]] = target_probs[out_rows[rej_reqs[empty]]]
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    index = torch.tensor(sampled_rows, dtype=torch.int64)
    tokens[index] = draw_from_probs(dist[index], [generators[i] for i in sampled_rows])
    return tokens, num_accepted
