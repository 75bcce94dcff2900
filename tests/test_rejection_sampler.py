"""The rejection sampler (spec_decode/rejection_sampler.py) keeps the target's distribution.

The statistical tests run speculative decoding of a small Markov chain (the
"target model": ``P[next | last]`` over 4 tokens) with drafts from another
chain (draft-model case) or a fixed successor table (n-gram's point mass),
many sequences at once, and compare the joint distribution of the first
three emitted tokens with the target's own, ``P[a|s] P[b|a] P[c|b]``, by
Pearson's chi-square test over the 64 cells (63 degrees of freedom). Seeds are fixed, so the test is
deterministic; it fails when the p-value is below 1e-3 (a correct sampler
passes with probability 0.999 for a given seed, and did for these). A sampler
that emits the draft whenever ``p(d) > 0`` (no rejection), forgets to remove
the draft from the residual, or skips the bonus token lands in p-values far
below 1e-12 (checked in ``test_a_wrong_sampler_is_caught``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.spec_decode.rejection_sampler import rejection_sample

V = 4
START = 0
NUM_SEQS = 20000
P_THRESHOLD = 1e-3


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's statistic and its chi-square(cells - 1) upper tail."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def first_tokens_pvalue(outs: list, expected: dict[tuple[int, ...], float], n: int,
                        min_cells: int = 8) -> float:
    """Chi-square p-value of the first ``len(key)`` tokens of ``n`` sampled outputs
    against ``expected`` (probability per token tuple). Cells expected fewer than 5
    times are pooled into one (the test's validity rule); every observed tuple must be
    one of ``expected``'s and at least ``min_cells`` cells must remain."""
    width = len(next(iter(expected)))
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:width])
        assert key in expected, f"{key} is outside the top-3 chain"
        counts[key] = counts.get(key, 0) + 1
    big = [c for c in sorted(expected) if expected[c] * n >= 5]
    small = [c for c in expected if c not in big]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    want = [expected[c] * n for c in big] + [sum(expected[c] for c in small) * n]
    if not small:
        observed, want = observed[:-1], want[:-1]
    assert len(big) >= min_cells
    return chisquare_pvalue(np.array(observed, dtype=np.float64), np.array(want))


def _dirichlet(g: torch.Generator, concentration: float) -> torch.Tensor:
    x = -torch.log(torch.rand(V, V, generator=g, dtype=torch.float64)) ** (1 / concentration)
    x = x / x.sum(-1, keepdim=True)
    return (0.9 * x + 0.1 / V).float()  # every cell > 0: expected counts stay >= 5


def simulate(P: torch.Tensor, draft: str, k: int, sampler=rejection_sample, seed: int = 0
             ) -> np.ndarray:
    """Emit >= 3 tokens per sequence by speculative steps; returns ``[NUM_SEQS, 3]``."""
    g = torch.Generator().manual_seed(seed)
    Q = _dirichlet(torch.Generator().manual_seed(seed + 100), 0.5)
    successor = torch.tensor([(t + 1) % V for t in range(V)])  # the "n-gram" guess
    gens = [torch.Generator().manual_seed(seed * NUM_SEQS + i) for i in range(NUM_SEQS)]
    out = [[] for _ in range(NUM_SEQS)]
    last = torch.full((NUM_SEQS,), START)
    while True:
        live = [i for i in range(NUM_SEQS) if len(out[i]) < 3]
        if not live:
            break
        n = len(live)
        cur = last[live]
        drafts = torch.empty(n, k, dtype=torch.int64)
        qs = torch.empty(n, k, V)
        prev = cur
        for j in range(k):
            if draft == "model":
                qs[:, j] = Q[prev]
                drafts[:, j] = torch.multinomial(Q[prev], 1, generator=g).squeeze(1)
            else:
                drafts[:, j] = successor[prev]
            prev = drafts[:, j]
        # Target rows: after the last token, then after each draft.
        ctx = torch.cat([cur[:, None], drafts], 1)                 # [n, k + 1]
        probs = P[ctx].reshape(n * (k + 1), V)
        tokens, num_acc = sampler(probs, probs.argmax(-1), drafts.reshape(-1), [k] * n,
                                  [False] * n, [gens[i] for i in live],
                                  qs.reshape(n * k, V) if draft == "model" else None)
        for row, i in enumerate(live):
            a = int(num_acc[row])
            out[i].extend(drafts[row, :a].tolist() + [int(tokens[row])])
            last[i] = out[i][-1]
    return np.array([o[:3] for o in out])


def joint_pvalue(P: torch.Tensor, seqs: np.ndarray) -> float:
    Pd = P.double().numpy()
    expected = np.einsum("a,ab,bc->abc", Pd[START], Pd, Pd).reshape(-1) * len(seqs)
    observed = np.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3)
    return chisquare_pvalue(observed, expected)


@pytest.mark.parametrize("draft,k", [("ngram", 2), ("ngram", 3), ("model", 2)])
def test_emitted_tokens_follow_the_target_distribution(draft, k):
    P = _dirichlet(torch.Generator().manual_seed(7), 0.5)
    seqs = simulate(P, draft, k)
    pvalue = joint_pvalue(P, seqs)
    assert pvalue > P_THRESHOLD, f"chi-square rejects the target distribution: p={pvalue:.2e}"


def accept_whenever_possible(probs, argmax, drafts, k, greedy, gens, q=None):
    """A wrong sampler: takes every draft the target allows at all."""
    n = len(k)
    kk = k[0]
    p = probs.reshape(n, kk + 1, V)
    d = drafts.reshape(n, kk)
    ok = p[torch.arange(n)[:, None], torch.arange(kk)[None, :], d] > 0
    acc = ok.int().cumprod(1).sum(1)
    rows = p[torch.arange(n), acc]
    tok = torch.stack([torch.multinomial(rows[i], 1, generator=gens[i])[0] for i in range(n)])
    return tok, acc


def test_a_wrong_sampler_is_caught():
    P = _dirichlet(torch.Generator().manual_seed(7), 0.5)
    assert joint_pvalue(P, simulate(P, "ngram", 2, accept_whenever_possible)) < 1e-12


def test_greedy_accepts_the_longest_matching_prefix():
    # 3 requests: drafts [5, 6, 7] (argmax 5, 6, 9, 1 -> accept 2, emit 9),
    # [] (emit argmax 4), [2, 3] (argmax 2, 3, 8 -> all accepted, bonus 8).
    argmax = torch.tensor([5, 6, 9, 1, 4, 2, 3, 8])
    tokens, acc = rejection_sample(None, argmax, torch.tensor([5, 6, 7, 2, 3]), [3, 0, 2],
                                   [True] * 3, [torch.Generator()] * 3)
    assert acc.tolist() == [2, 0, 2] and tokens.tolist() == [9, 4, 8]
    # A first-draft mismatch accepts nothing even when later drafts match.
    tokens, acc = rejection_sample(None, torch.tensor([1, 6, 7]), torch.tensor([0, 7]), [2],
                                   [True], [torch.Generator()])
    assert acc.tolist() == [0] and tokens.tolist() == [1]


def test_point_mass_acceptance_rate_is_the_target_probability():
    # One draft token d with p(d) = 0.3: accepted in 30% of seeded trials.
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.25] * 4])
    n = 4000
    acc = 0
    for i in range(n):
        _, a = rejection_sample(probs, probs.argmax(-1), torch.tensor([0]), [1], [False],
                                [torch.Generator().manual_seed(i)])
        acc += int(a[0])
    assert abs(acc / n - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5


def test_rejected_point_mass_never_resamples_the_draft():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])
    for i in range(200):
        tok, a = rejection_sample(probs, probs.argmax(-1), torch.tensor([0]), [1], [False],
                                  [torch.Generator().manual_seed(i)])
        if int(a[0]) == 0:
            assert int(tok[0]) == 1


def test_row_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="target rows"):
        rejection_sample(None, torch.zeros(3, dtype=torch.int64), torch.tensor([1]), [1],
                         [True], [torch.Generator()])
