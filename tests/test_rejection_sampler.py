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


# -- the random numbers: the main sampler's scheme (one fp64 uniform per test or draw) ------


def inverse_transform(dist: torch.Tensor, u: float) -> int:
    """The first token whose cumulative mass exceeds ``u`` times the total."""
    cum = dist.double().cumsum(0)
    return int(torch.searchsorted(cum, u * cum[-1], right=True))


def random_rows(seed: int, rows: int, vocab: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, vocab, generator=g, dtype=torch.float64) ** 3
    x[torch.rand(rows, vocab, generator=g) < 0.2] = 0.0
    x[:, 0] += 1e-3  # every row has mass
    return (x / x.sum(-1, keepdim=True)).float()


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_each_token_is_the_inverse_transform_draw_of_the_requests_own_uniforms(draft):
    """Request with k drafts: its generator gives u_1..u_k for the accept tests
    (draft j accepted while u_j q(d_j) < p(d_j)) and u_{k+1} for the token after
    them, drawn from the residual max(0, p - q) (or p, the bonus) by inverse transform:
    k + 1 fp64 uniforms per step, whatever is accepted, as the main sampler's one per
    token. (The exponential race it replaced took a vocabulary's worth per step.)"""
    checked = {"rejected": 0, "bonus": 0}
    for seed in range(300):
        k = 1 + seed % 3
        p = random_rows(seed, k + 1)
        drafts = (p[:k].argmax(-1) if seed % 2 else  # half likely accepted
                  torch.multinomial(random_rows(seed + 7, k), 1,
                                    generator=torch.Generator().manual_seed(seed)).squeeze(1))
        q = random_rows(seed + 13, k) if draft == "model" else None
        if q is not None:
            q[torch.arange(k), drafts] += 0.5  # the draft's own token is likely under q
            q = q / q.sum(-1, keepdim=True)
        gen = torch.Generator().manual_seed(1000 + seed)
        twin = torch.Generator().manual_seed(1000 + seed)
        tokens, acc = rejection_sample(p, p.argmax(-1), drafts, [k], [False], [gen], q)
        u = torch.rand(k + 1, dtype=torch.float64, generator=twin).tolist()
        assert torch.equal(gen.get_state(), twin.get_state()), "not k + 1 uniforms"
        qd = [1.0] * k if q is None else [float(q[j, drafts[j]]) for j in range(k)]
        want_acc = 0
        while want_acc < k and u[want_acc] * qd[want_acc] < float(p[want_acc, drafts[want_acc]]):
            want_acc += 1
        assert int(acc[0]) == want_acc, seed
        dist = p[want_acc].clone()
        if want_acc < k:
            checked["rejected"] += 1
            if q is None:
                dist[drafts[want_acc]] = 0.0
            else:
                dist = (dist - q[want_acc]).clamp(min=0.0)
        else:
            checked["bonus"] += 1
        assert int(tokens[0]) == inverse_transform(dist, u[k]), seed
    assert min(checked.values()) > 40, checked


def test_a_seeded_request_verifies_the_same_alone_and_in_any_batch():
    """Rows of other requests (greedy or sampled, any draft count) change nothing
    for a request: its tokens and acceptances depend on its rows and generator only."""
    g = torch.Generator().manual_seed(5)
    ks = [2, 0, 3, 1, 2, 4]
    greedy = [False, True, False, False, True, False]
    rows = sum(ks) + len(ks)
    p = random_rows(11, rows)
    q = random_rows(12, sum(ks))
    drafts = torch.randint(0, 6, (sum(ks),), generator=g)
    seeds = [100 + i for i in range(len(ks))]
    tokens, acc = rejection_sample(p, p.argmax(-1), drafts, ks, greedy,
                                   [torch.Generator().manual_seed(s) for s in seeds], q)
    row0 = np.cumsum([0] + [k + 1 for k in ks])
    d0 = np.cumsum([0] + ks)
    for i, k in enumerate(ks):
        pr = p[row0[i]:row0[i + 1]]
        t, a = rejection_sample(pr, pr.argmax(-1), drafts[d0[i]:d0[i + 1]], [k], [greedy[i]],
                                [torch.Generator().manual_seed(seeds[i])], q[d0[i]:d0[i + 1]])
        assert (int(t[0]), int(a[0])) == (int(tokens[i]), int(acc[i])), i


def test_draws_from_probs_follow_them():
    from aioengine.spec_decode.rejection_sampler import draw_from_probs

    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 20000
    tokens = draw_from_probs(probs.expand(n, -1).contiguous(),
                             [torch.Generator().manual_seed(i) for i in range(n)])
    counts = np.bincount(tokens.numpy(), minlength=5)
    assert counts[1] == 0
    keep = probs.numpy() > 0
    pvalue = chisquare_pvalue(counts[keep].astype(np.float64), probs.numpy()[keep] * n)
    assert pvalue > P_THRESHOLD, pvalue
