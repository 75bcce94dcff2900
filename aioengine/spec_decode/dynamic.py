"""Dynamic speculation: how many drafts each request verifies, from the step's expected gain.

A draft token is worth verifying when the tokens it is expected to add are worth
more than the time its query row adds to the step. The cost model is linear in
the step's query tokens ``N`` (requests plus drafts), in units of a one-token
decode step::

    t(N) = (1 - c) + c * N          c = SpeculativeConfig.verify_token_cost

(on the 2-core dev CPU a 4-token verification step costs about 1.7 decode
steps and a 16-request decode step about 5.4, so ``c`` is about 0.25; on a GPU,
where a small batch is bound by reading the weights, ``c`` is near 0). A step
of ``b`` decodes makes ``E = b`` tokens; a draft at position ``j`` of request
``i`` adds ``P_ij`` (the probability that drafts ``1..j`` are all accepted) to
``E`` and ``c`` to ``t``, so it raises the step's tokens per second exactly
when ``P_ij > c * E / t(N)``. The threshold grows with the batch: ``c`` at
batch 1 (0.25), about 0.84 at 16 requests (a big batch is nearly compute-bound
and a draft row costs nearly what a request's row does). Drafts are taken
greedily, most probable first, while they pass, with ``E`` and ``N`` updated
after each: the goodput rule of Liu et al. 2024 ("Optimizing Speculative
Decoding for Serving Large Language Models Using Goodput", SmartSpec), with
our linear cost model in place of their profiled one.

``P_ij = a_i * r_i ** (j - 1)``: ``a_i`` is the request's recent acceptance of
a first draft and ``r_i`` of a draft after an accepted one (copying a span
is bursty: after one accepted draft the next is likely right too). Both are
exponentially decayed counts with a prior (``AcceptanceEstimate``), updated by
comparing the request's last proposal with the tokens the step actually
emitted. That comparison also works when the proposal was not verified (the
batch was past the threshold): the first draft is right exactly when the
emitted token equals it, which for a sampled request happens with the
probability that verification would have accepted it (``p(d)`` for a point
mass). So a request's estimate stays current while it is not speculating,
and it resumes when the batch shrinks or its text turns into a copy.

A sampled request decides as if it were alone (batch 1): how many drafts it
verifies decides how many random numbers its generator gives, so a seeded
request must not draft differently in another batch, or it would sample
other tokens. Greedy output does not depend on the drafts, so greedy
requests share the batch's rule (the requests that matter in a big batch).

The gate decides from history only (earlier proposals and emitted tokens),
never from the current step's outcome, so the rejection sampler's guarantee
(the output distribution is the target's) holds whatever it decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Priors, as (accepted, observations) pseudo-counts: a first draft is as likely
# right as wrong; after an accepted draft the next one is likely right.
FIRST_PRIOR = (1.0, 2.0)
NEXT_PRIOR = (1.4, 2.0)
# Each observation keeps this share of the earlier counts (about 4 observations of memory:
# a copied span starts and ends abruptly).
DECAY = 0.75
# A step without a proposal to score moves the counts this far back toward the priors,
# so a request whose drafts a draft model stopped proposing (nothing to score) tries
# again after a while (about 14 steps to go half way).
RELAX = 0.95
# A request not seen for this many proposals is forgotten (finished or long preempted).
FORGET_AFTER = 256


@dataclass
class AcceptanceEstimate:
    """One request's recent acceptance, as decayed pseudo-counts.

    Attributes:
        first_accepted, first_seen: first drafts accepted / observed.
        next_accepted, next_seen: drafts after an accepted one accepted / observed.
        num_tokens: the request's token count when ``proposal`` was made.
        proposal: the last drafts proposed (verified or not).
        last_seen: the gate's call counter at the last update (for forgetting).
    """

    first_accepted: float = FIRST_PRIOR[0]
    first_seen: float = FIRST_PRIOR[1]
    next_accepted: float = NEXT_PRIOR[0]
    next_seen: float = NEXT_PRIOR[1]
    num_tokens: int = 0
    proposal: tuple[int, ...] = ()
    last_seen: int = 0

    @property
    def first(self) -> float:
        """Probability that a first draft is accepted."""
        return self.first_accepted / self.first_seen

    @property
    def next(self) -> float:
        """Probability that a draft after an accepted one is accepted."""
        return self.next_accepted / self.next_seen

    def observe(self, emitted: np.ndarray) -> None:
        """Compare ``proposal`` with the tokens emitted since it was made.

        Args:
            emitted: ``[m]`` int64, the request's tokens after position
                ``num_tokens`` (``m >= 1``): the accepted drafts and the token
                after them when the proposal was verified, the one sampled
                token when it was not.
        """
        k = min(len(self.proposal), emitted.shape[0])
        if k == 0:
            return
        same = np.asarray(self.proposal[:k]) == emitted[:k]
        num_accepted = k if same.all() else int(np.argmin(same))
        self.first_accepted = DECAY * self.first_accepted + (num_accepted >= 1)
        self.first_seen = DECAY * self.first_seen + 1
        # Positions 2..k seen: those after an accepted draft, up to the first rejection.
        seen_next = min(num_accepted + 1, k) - 1
        if seen_next > 0:
            accepted_next = num_accepted - 1
            keep = DECAY ** seen_next
            self.next_accepted = keep * self.next_accepted + accepted_next
            self.next_seen = keep * self.next_seen + seen_next

    def relax(self) -> None:
        """No proposal to score this step: drift toward the priors."""
        self.first_accepted = RELAX * self.first_accepted + (1 - RELAX) * FIRST_PRIOR[0]
        self.first_seen = RELAX * self.first_seen + (1 - RELAX) * FIRST_PRIOR[1]
        self.next_accepted = RELAX * self.next_accepted + (1 - RELAX) * NEXT_PRIOR[0]
        self.next_seen = RELAX * self.next_seen + (1 - RELAX) * NEXT_PRIOR[1]


def threshold(batch_size: int, verify_token_cost: float) -> float:
    """Acceptance probability a first draft needs in a step of ``batch_size``
    decodes and no other drafts: ``c * b / t(b)`` (module docstring)."""
    c = verify_token_cost
    return c * batch_size / ((1.0 - c) + c * batch_size)


def num_drafts(first: np.ndarray, nxt: np.ndarray, max_drafts: np.ndarray,
               verify_token_cost: float, batch_size: int | None = None,
               alone: np.ndarray | None = None) -> np.ndarray:
    """Drafts to verify per request in one step (the goodput rule above).

    Args:
        first, nxt: ``[num_reqs]`` each request's ``a_i`` and ``r_i``.
        max_drafts: ``[num_reqs]`` int, the most each may verify (its proposal's
            length; 0 for a request that does not speculate).
        verify_token_cost: ``c`` of the cost model; 0 takes every draft.
        batch_size: decodes in the step (default ``num_reqs``).
        alone: ``[num_reqs]`` bool, requests decided as if alone in a batch of
            1 (their drafts then depend on their own history only); the others
            share the step's rule, counting these requests' drafts.

    Returns:
        ``[num_reqs]`` int64, ``0 <= k_i <= max_drafts[i]``.
    """
    max_drafts = np.asarray(max_drafts, dtype=np.int64)
    if verify_token_cost <= 0:
        return max_drafts.copy()
    num_reqs = max_drafts.shape[0]
    b = num_reqs if batch_size is None else batch_size
    width = int(max_drafts.max()) if num_reqs else 0
    if width == 0:
        return np.zeros(num_reqs, dtype=np.int64)
    out = np.zeros(num_reqs, dtype=np.int64)
    tokens, rows = float(b), float(b)
    if alone is not None and alone.any():
        first, nxt = np.asarray(first, dtype=np.float64), np.asarray(nxt, dtype=np.float64)
        for i in np.flatnonzero(alone).tolist():
            k = int(num_drafts(first[i:i + 1], nxt[i:i + 1], max_drafts[i:i + 1],
                               verify_token_cost)[0])
            out[i] = k
            tokens += float(first[i] * (nxt[i] ** np.arange(k)).sum())
            rows += k
        max_drafts = np.where(alone, 0, max_drafts)
    # P_ij for j = 1..width, -1 where j > max_drafts[i].
    j = np.arange(width)
    p = np.asarray(first, dtype=np.float64)[:, None] * np.asarray(nxt, dtype=np.float64
                                                                  )[:, None] ** j[None, :]
    p[j[None, :] >= max_drafts[:, None]] = -1.0
    # P_ij falls with j (r_i <= 1), so the most probable first respects each prefix.
    order = np.argsort(-p, axis=None, kind="stable")
    probs = p.ravel()[order]
    c = verify_token_cost
    taken = 0
    for prob in probs.tolist():
        if prob <= c * tokens / ((1.0 - c) + c * rows):
            break
        tokens += prob
        rows += 1.0
        taken += 1
    np.add.at(out, order[:taken] // width, 1)
    return out


class DraftGate:
    """Per-request acceptance estimates and the per-step decision, in the worker.

    Args:
        verify_token_cost: ``c`` of the cost model (``SpeculativeConfig``).
    """

    def __init__(self, verify_token_cost: float) -> None:
        self.verify_token_cost = verify_token_cost
        self._estimates: dict[str, AcceptanceEstimate] = {}
        self._calls = 0

    def estimate(self, req_id: str) -> AcceptanceEstimate:
        """The request's estimate (created with the priors)."""
        est = self._estimates.get(req_id)
        if est is None:
            est = self._estimates[req_id] = AcceptanceEstimate()
        return est

    def observe(self, req_ids: list[str], token_rows: list[np.ndarray]) -> list[AcceptanceEstimate]:
        """Score each request's last proposal against its tokens now (``[num_tokens]``
        rows); returns the estimates in order."""
        self._calls += 1
        out = []
        for req_id, row in zip(req_ids, token_rows):
            est = self.estimate(req_id)
            if est.proposal and row.shape[0] > est.num_tokens:
                est.observe(row[est.num_tokens:])
            elif not est.proposal:
                est.relax()
            est.proposal = ()
            est.last_seen = self._calls
            out.append(est)
        if len(self._estimates) > 2 * FORGET_AFTER:
            stale = self._calls - FORGET_AFTER
            self._estimates = {k: v for k, v in self._estimates.items() if v.last_seen > stale}
        return out

    def decide(self, estimates: list[AcceptanceEstimate], max_drafts: list[int],
               batch_size: int, sampled: list[bool]) -> np.ndarray:
        """``[len(estimates)]`` drafts to verify next step (``num_drafts``).

        ``sampled`` requests decide alone: how many drafts they verify decides
        how many random numbers their generator gives, so a seeded request
        would otherwise sample other tokens in another batch. Greedy output is
        the same whatever is drafted, so greedy requests share the batch's rule.
        """
        first = np.array([e.first for e in estimates])
        nxt = np.array([e.next for e in estimates])
        return num_drafts(first, nxt, np.asarray(max_drafts, dtype=np.int64),
                          self.verify_token_cost, batch_size, np.array(sampled, dtype=bool))

    def proposed(self, estimate: AcceptanceEstimate, num_tokens: int,
                 proposal: list[int]) -> None:
        """Remember what was proposed at ``num_tokens`` (verified or not), to score
        it at the next ``observe``."""
        estimate.num_tokens = num_tokens
        estimate.proposal = tuple(proposal)
