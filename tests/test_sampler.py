"""Batched sampler: each processing step has its effect, per row."""

from __future__ import annotations

import torch

from aioengine.worker.sampler import SamplingBatch, sample

VOCAB = 8


def batch(rows: int, **overrides) -> SamplingBatch:
    def full(v, dtype=torch.float32):
        return torch.full((rows,), v, dtype=dtype)

    b = SamplingBatch(
        temperature=full(1.0), top_p=full(1.0), top_k=full(0, torch.int64), min_p=full(0.0),
        presence_penalty=full(0.0), frequency_penalty=full(0.0), repetition_penalty=full(1.0),
        generators=[torch.Generator().manual_seed(i) for i in range(rows)],
        greedy=[False] * rows, num_logprobs=[-1] * rows)
    for k, v in overrides.items():
        setattr(b, k, v)
    return b


def draws(logits_row: torch.Tensor, b: SamplingBatch, n: int = 300) -> set[int]:
    seen = set()
    for _ in range(n):
        tokens, _ = sample(logits_row.clone(), b)
        seen.update(tokens.tolist())
    return seen


def test_greedy_rows_take_argmax_beside_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0, 0, 0]] * 2)
    b = batch(2, greedy=[True, False], temperature=torch.tensor([0.0, 1.0]))
    for _ in range(20):
        tokens, _ = sample(logits.clone(), b)
        assert tokens[0].item() == 1


def test_top_k_limits_the_draws():
    logits = torch.zeros(1, VOCAB)
    assert draws(logits, batch(1)) == set(range(VOCAB))
    b = batch(1, top_k=torch.tensor([2]), need_top_k=True)
    logits = torch.tensor([[0.0, 0.1, 3.0, 0.2, 2.9, 0, 0, 0]])
    assert draws(logits, b) == {2, 4}


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[4.0, 3.9, -5, -5, -5, -5, -5, -5]])
    b = batch(1, top_p=torch.tensor([0.5]), need_top_p=True)
    assert draws(logits, b) == {0}
    b = batch(1, top_p=torch.tensor([0.9]), need_top_p=True)
    assert draws(logits, b) == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0, 0, 0, 0]])
    assert len(draws(logits, batch(1))) > 2
    b = batch(1, min_p=torch.tensor([0.5]), need_min_p=True)
    assert draws(logits, b) == {0, 1}


def test_penalties_and_bias_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0, 0, 0, 0, 0, 0]])
    out_ids = torch.tensor([[0, 0, -1]])
    b = batch(1, greedy=[True], all_greedy=True, need_penalties=True, output_token_ids=out_ids,
              frequency_penalty=torch.tensor([0.3]))
    assert sample(logits.clone(), b)[0].item() == 1  # 3.0 - 2*0.3 < 2.5
    b = batch(1, greedy=[True], all_greedy=True, need_penalties=True, output_token_ids=out_ids,
              presence_penalty=torch.tensor([0.4]))
    assert sample(logits.clone(), b)[0].item() == 0  # 3.0 - 0.4 > 2.5
    b = batch(1, greedy=[True], all_greedy=True, need_penalties=True, output_token_ids=out_ids,
              repetition_penalty=torch.tensor([1.5]))
    assert sample(logits.clone(), b)[0].item() == 1  # 3.0 / 1.5 < 2.5
    b = batch(1, greedy=[True], all_greedy=True,
              logit_bias=(torch.tensor([0]), torch.tensor([5]), torch.tensor([10.0])))
    assert sample(logits.clone(), b)[0].item() == 5


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def run(rows: list[int]) -> list[int]:
        b = batch(len(rows), generators=[torch.Generator().manual_seed(100 + r) for r in rows])
        out = []
        for _ in range(10):
            out.append(sample(logits[rows].clone(), b)[0].tolist())
        return [o[rows.index(1)] for o in out]

    assert run([1]) == run([0, 1, 2])


def test_logprobs_are_raw_and_include_the_sampled_token():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0, 0, 0, 0, 0]])
    b = batch(1, greedy=[True], all_greedy=True, num_logprobs=[2],
              logit_bias=(torch.tensor([0]), torch.tensor([0]), torch.tensor([50.0])))
    tokens, lps = sample(logits.clone(), b)
    assert tokens.item() == 0
    raw = logits.log_softmax(-1)[0]
    (tok, lp), *top = lps[0]
    assert tok == 0 and abs(lp - raw[0].item()) < 1e-6
    assert [t for t, _ in top] == [2, 1]


# -- the draw: inverse transform sampling, one uniform per row -------------------------------


def _full_sort_reference(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """An independent oracle of the draw: min-p, top-k and top-p by a full-vocabulary sort
    (as the sampler did before thresholds), then inverse transform sampling over the kept
    tokens in vocabulary order with one fp64 uniform from each sampled row's generator."""
    temperature = torch.where(b.temperature < 1e-5, 1.0, b.temperature)
    logits = logits / temperature.unsqueeze(1)
    probs = logits.softmax(-1)
    floor = probs.max(-1, keepdim=True).values * b.min_p.unsqueeze(1)
    logits = logits.masked_fill((probs < floor) & (b.min_p > 0).unsqueeze(1), float("-inf"))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    k = torch.where(b.top_k > 0, b.top_k, vocab)
    mask = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    p = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
    mask |= (p.cumsum(-1) - p) >= b.top_p.unsqueeze(1)
    logits = torch.empty_like(logits).scatter_(
        1, sorted_idx, sorted_logits.masked_fill(mask, float("-inf")))
    cdf = logits.double().softmax(-1).cumsum(-1)
    tokens = logits.argmax(-1)
    for row, gen in enumerate(b.generators):
        if not b.greedy[row]:
            u = torch.rand(1, dtype=torch.float64, generator=gen)
            tokens[row] = torch.searchsorted(cdf[row], u * cdf[row, -1], right=True).item()
    return tokens


def test_draws_match_a_full_sort_reference():
    """Mixed greedy/sampled rows with top-k, top-p (one nucleus wider than any partial
    sort, from flat logits) and min-p: the same tokens, step after step, as the full-sort
    oracle with the same generators. (Replaces the test that pinned the exponential-race
    tokens: seeded tokens changed when the draw became one uniform per row.)"""
    vocab, rows = 3000, 6
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([[4.0], [4.0], [0.05], [4.0], [2.0], [4.0]])
    settings = dict(
        temperature=torch.tensor([0.0, 0.8, 1.0, 1.2, 0.7, 1.0]),
        top_k=torch.tensor([0, 40, 0, 0, 5, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.99, 0.8, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2]))

    def make() -> SamplingBatch:
        return batch(rows, generators=[torch.Generator().manual_seed(7 + r) for r in range(rows)],
                     greedy=[True] + [False] * 5, need_top_k=True, need_top_p=True,
                     need_min_p=True, **settings)

    ours, ref = make(), make()
    for _ in range(20):
        logits = torch.randn(rows, vocab, generator=gen) * scale
        tokens, _ = sample(logits.clone(), ours)
        assert tokens.tolist() == _full_sort_reference(logits, ref).tolist()


def _chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against probabilities ``expected`` (over
    the tokens with expected > 0): the probability of a statistic this large by chance."""
    n = counts.sum()
    support = expected > 0
    stat = ((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         stat.double() / 2))


# (temperature, top_k, top_p, min_p, expected probabilities) over logits LOGITS, worked
# out by hand from the definitions: each case keeps the token at its filter's boundary
# and drops the one after, so an off-by-one in a filter fails.
LOGITS = torch.tensor([[2.0, 1.0, 0.0, 1.0, -1.0, 0.5, -3.0, float("-inf")]])


def _softmax_over(keep: list[int], temperature: float) -> torch.Tensor:
    x = LOGITS[0].double() / temperature
    out = torch.zeros(8, dtype=torch.float64)
    out[keep] = x[keep].softmax(-1)
    return out


def _cases() -> list[tuple[str, float, int, float, float, torch.Tensor]]:
    every = [0, 1, 2, 3, 4, 5, 6]
    full = _softmax_over(every, 1.0)
    # T 1: p = 0.465, 0.171, 0.063, 0.171, 0.023, 0.104, 0.003, 0. top-p 0.6 keeps 0 and
    # 1 (0.465 before it), and 3 as 1's tie (a sort would drop it: 0.636 before it).
    assert full[0] < 0.6 < full[0] + full[1]
    hot = _softmax_over(every, 2.0)
    # T 2: 0.298, 0.181, 0.110, 0.181, 0.066, 0.141, 0.024: top-p 0.75 keeps 0, 1, 3, 5.
    assert hot[0] + hot[1] + hot[3] < 0.75 < hot[0] + hot[1] + hot[3] + hot[5]
    return [
        ("temperature 1", 1.0, 0, 1.0, 0.0, full),
        ("temperature 0.5", 0.5, 0, 1.0, 0.0, _softmax_over(every, 0.5)),
        ("temperature 2", 2.0, 0, 1.0, 0.0, hot),
        ("top-k 3 (tie kept)", 1.0, 3, 1.0, 0.0, _softmax_over([0, 1, 3], 1.0)),
        ("top-k 2 (tie kept)", 1.0, 2, 1.0, 0.0, _softmax_over([0, 1, 3], 1.0)),
        ("top-k 4", 1.0, 4, 1.0, 0.0, _softmax_over([0, 1, 3, 5], 1.0)),
        ("top-p 0.6", 1.0, 0, 0.6, 0.0, _softmax_over([0, 1, 3], 1.0)),
        ("top-p 0.75, T 2", 2.0, 0, 0.75, 0.0, _softmax_over([0, 1, 3, 5], 2.0)),
        # min-p 0.3: e^-1 = 0.37 >= 0.3 > e^-1.5 = 0.22.
        ("min-p 0.3", 1.0, 0, 1.0, 0.3, _softmax_over([0, 1, 3], 1.0)),
        ("min-p 0.2", 1.0, 0, 1.0, 0.2, _softmax_over([0, 1, 3, 5], 1.0)),
        # min-p 0.2 and top-k 4 keep 0, 1, 3, 5 (0.51, 0.19, 0.19, 0.11 renormalised);
        # top-p 0.75 of that drops 5 (0.89 before it).
        ("min-p + top-k + top-p", 1.0, 4, 0.75, 0.2, _softmax_over([0, 1, 3], 1.0)),
        # T 0.5, top-k 4: 0.757, 0.103, 0.103, 0.038; top-p 0.85 drops 5 (0.96 before it).
        ("T 0.5 + top-k 4 + top-p 0.85", 0.5, 4, 0.85, 0.0, _softmax_over([0, 1, 3], 0.5)),
    ]


def _draw_counts(impl, temperature: float, top_k: int, top_p: float, min_p: float,
                 n: int, seed: int) -> torch.Tensor:
    rows = torch.zeros(n, dtype=torch.int64)
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    tokens = impl(LOGITS, rows, torch.full((n,), temperature), torch.full((n,), top_k),
                  torch.full((n,), top_p), torch.full((n,), min_p), uniforms)
    return torch.bincount(tokens, minlength=8).double()


def _implementations() -> list:
    from triton_kernels import cpu_ops, reference

    impls = [reference.sample_from_logits]
    if cpu_ops.load() is not None:
        impls.append(cpu_ops.load().sample_from_logits)
    return impls


def test_draws_follow_the_filtered_distribution():
    """Chi-square of 20,000 draws per case against the hand-computed distribution, for
    the C++ kernel and its torch twin; a token outside the kept set is never drawn."""
    for impl in _implementations():
        for i, (name, temperature, top_k, top_p, min_p, expected) in enumerate(_cases()):
            counts = _draw_counts(impl, temperature, top_k, top_p, min_p, 20_000, i)
            assert counts[expected == 0].sum() == 0, (impl, name, counts)
            assert _chi_square_p_value(counts, expected) > 1e-4, (impl, name, counts, expected)


def test_a_wrong_distribution_fails_the_chi_square():
    """The test above can fail: top-p 0.6 draws tested against the top-k 4 distribution,
    and temperature 1 draws against temperature 0.9."""
    impl = _implementations()[-1]
    counts = _draw_counts(impl, 1.0, 0, 0.6, 0.0, 20_000, 0)
    assert _chi_square_p_value(counts, _softmax_over([0, 1, 3, 5], 1.0)) < 1e-4
    counts = _draw_counts(impl, 1.0, 0, 1.0, 0.0, 20_000, 0)
    assert _chi_square_p_value(counts, _softmax_over(list(range(7)), 0.9)) < 1e-4


def test_kernel_and_torch_twin_agree_on_wide_vocabularies():
    """Same uniforms, same tokens (up to rounding at a boundary of the cumulative
    distribution) over a 49,152 vocabulary, peaked and flat rows, every filter mix; the
    kernel's tokens do not depend on its thread count."""
    from triton_kernels import cpu_ops, reference

    ops = cpu_ops.load()
    if ops is None:
        import pytest
        pytest.skip("C++ kernels unavailable")
    gen = torch.Generator().manual_seed(1)
    n, vocab = 64, 49_152
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.1, 8.0, n).unsqueeze(1)
    args = (torch.arange(n), torch.rand(n, generator=gen) * 1.5 + 0.1,
            torch.randint(0, 200, (n,), generator=gen) * (torch.rand(n, generator=gen) < 0.5),
            torch.where(torch.rand(n, generator=gen) < 0.7, torch.rand(n, generator=gen), 1.0),
            torch.where(torch.rand(n, generator=gen) < 0.3, torch.rand(n, generator=gen) * 0.2,
                        0.0),
            torch.rand(n, dtype=torch.float64, generator=gen))
    ours = ops.sample_from_logits(logits, *args)
    twin = reference.sample_from_logits(logits, *args)
    assert (ours == twin).float().mean() >= 0.95, (ours != twin).sum()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ops.sample_from_logits(logits, *args).tolist() == ours.tolist()
    finally:
        torch.set_num_threads(threads)


def test_seeded_rows_ignore_the_filters_and_size_of_the_batch():
    """A seeded row alone equals the same row among 32 rows whose other rows are greedy,
    top-k, top-p or min-p: each draw takes one uniform from the row's own generator."""
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(32, 500, generator=gen) * 3 for _ in range(10)]

    def run(rows: list[int]) -> list[int]:
        n = len(rows)
        b = batch(n, generators=[torch.Generator().manual_seed(1000 + r) for r in rows],
                  greedy=[r % 4 == 1 for r in rows],
                  temperature=torch.tensor([0.0 if r % 4 == 1 else 0.9 for r in rows]),
                  top_k=torch.tensor([20 if r % 4 == 2 else 0 for r in rows]),
                  top_p=torch.tensor([0.7 if r % 4 in (0, 2) else 1.0 for r in rows]),
                  min_p=torch.tensor([0.1 if r % 4 == 3 else 0.0 for r in rows]),
                  need_top_k=any(r % 4 == 2 for r in rows),
                  need_top_p=any(r % 4 in (0, 2) for r in rows),
                  need_min_p=any(r % 4 == 3 for r in rows))
        return [sample(x[rows].clone(), b)[0][rows.index(12)].item() for x in steps]

    alone = run([12])
    assert alone == run(list(range(32)))
    assert alone == run([5, 12, 30])
    assert len(set(alone)) > 3  # sampled, not stuck on the argmax


def test_masked_rows_and_extreme_settings():
    """Only the allowed token of a row masked to one token; top-p near 0, top-k 1 and
    min-p 1 give the argmax; top-k above the vocabulary and a tiny temperature work."""
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(4))
    argmax = logits.argmax(-1)
    masked = torch.full((1, 100), float("-inf"))
    masked[0, 37] = 0.0
    for impl in _implementations():
        assert impl(masked, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0]),
                    torch.tensor([0.9]), torch.tensor([0.0]),
                    torch.tensor([0.999], dtype=torch.float64)).item() == 37
        n = 5
        for top_k, top_p, min_p, temperature in ((0, 1e-6, 0.0, 1.0), (1, 1.0, 0.0, 1.0),
                                                 (0, 1.0, 1.0, 1.0), (0, 1.0, 0.0, 1e-4)):
            out = impl(logits, torch.arange(n), torch.full((n,), temperature),
                       torch.full((n,), top_k), torch.full((n,), top_p),
                       torch.full((n,), min_p), torch.full((n,), 0.999, dtype=torch.float64))
            assert out.tolist() == argmax.tolist()
        out = impl(logits, torch.arange(n), torch.ones(n), torch.full((n,), 1000),
                   torch.ones(n), torch.zeros(n), torch.rand(n, dtype=torch.float64))
        assert ((out >= 0) & (out < 100)).all()


def test_penalties_touch_only_the_rows_that_ask():
    logits = torch.tensor([[3.0, 2.5, 0, 0, 0, 0, 0, 0]] * 2)
    out_ids = torch.tensor([[0, 0, -1]] * 2)
    b = batch(2, greedy=[True, True], all_greedy=True, need_penalties=True,
              output_token_ids=out_ids, frequency_penalty=torch.tensor([0.0, 0.3]),
              penalty_rows=torch.tensor([1]))
    assert sample(logits.clone(), b)[0].tolist() == [0, 1]


def test_logprobs_only_for_the_rows_that_ask():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0, 0, 0, 0, 0], [3.0, 2.0, 1.0, 0, 0, 0, 0, 0]])
    b = batch(2, greedy=[True, True], all_greedy=True, num_logprobs=[-1, 1])
    tokens, lps = sample(logits.clone(), b)
    assert tokens.tolist() == [2, 0] and lps[0] is None
    raw = logits[1].log_softmax(-1)
    assert lps[1][0] == (0, lps[1][1][1]) and abs(lps[1][0][1] - raw[0].item()) < 1e-6


def _kept_distribution(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                       min_p: float) -> torch.Tensor:
    """The filtered distribution of one row, straight from the definitions in fp64 with a
    full sort (vLLM's order: temperature, min-p, top-k, then top-p over what is left,
    ties with the last kept token kept): ``[vocab]`` probabilities, 0 outside the kept set."""
    probs = (row.double() / temperature).softmax(-1)
    keep = probs >= min_p * probs.max()
    if 0 < top_k < row.numel():
        kth = probs.masked_fill(~keep, 0).sort(descending=True).values[top_k - 1]
        keep &= probs >= kth
    if top_p < 1.0:
        kept = probs.masked_fill(~keep, 0)
        desc = kept.sort(descending=True).values
        cum = desc.cumsum(0)
        cut = int((cum < top_p * cum[-1]).sum())
        keep &= probs >= desc[cut]
    out = probs.masked_fill(~keep, 0)
    return out / out.sum()


def _cdf_midpoint_draws(impl, row: torch.Tensor, settings: tuple, expected: torch.Tensor
                        ) -> None:
    """Inverse transform sampling picks token j exactly when u falls in its interval of the
    kept set's cumulative distribution (vocabulary order): a u at the middle of each kept
    token's interval must give that token, and a fine grid of u only kept tokens. Tokens
    whose interval is under 1e-6 wide are skipped (fp32 rounding of the sums)."""
    temperature, top_k, top_p, min_p = settings
    cdf = expected.cumsum(0)
    ids = torch.nonzero(expected > 1e-6).squeeze(1)
    mids = (cdf[ids] - expected[ids] / 2).clamp(0.0, 1.0 - 1e-12)
    grid = (torch.arange(2000, dtype=torch.float64) + 0.5) / 2000
    uniforms = torch.cat([mids, grid])
    n = uniforms.numel()
    tokens = impl(row.unsqueeze(0), torch.zeros(n, dtype=torch.int64),
                  torch.full((n,), float(temperature)), torch.full((n,), top_k),
                  torch.full((n,), float(top_p)), torch.full((n,), float(min_p)), uniforms)
    assert tokens[:ids.numel()].tolist() == ids.tolist(), (impl, settings)
    assert bool((expected[tokens[ids.numel():]] > 0).all()), (impl, settings)


def _distribution_cases() -> list[tuple[str, torch.Tensor, tuple]]:
    gen = torch.Generator().manual_seed(5)
    small = torch.randn(1000, generator=gen).mul(3 * 64).round() / 64
    # On a 1/64 grid: distinct logits stay distinct in fp32 probabilities (49,152 random
    # reals have neighbours closer than fp32 resolves: a tie in fp32, not in fp64).
    wide = torch.randn(49_152, generator=gen).mul(2.5 * 64).round() / 64
    peaked = wide.clone()
    peaked[:40] += 12.0
    cases = [("top-p", small, (0.8, 0, 0.95, 0.0)),
             ("top-p 1.0", small, (0.8, 0, 1.0, 0.0)),
             ("top-k 1", small, (1.0, 1, 1.0, 0.0)),
             ("top-k > vocab", small, (1.0, 1005, 1.0, 0.0)),
             ("top-k 50 + top-p", small, (0.7, 50, 0.9, 0.0)),
             ("min-p", small, (1.0, 0, 1.0, 0.1)),
             ("min-p + top-k + top-p", small, (1.2, 300, 0.8, 0.02)),
             ("tiny temperature", small, (1e-3, 0, 0.95, 0.0)),
             ("large temperature", small, (50.0, 0, 0.9, 0.0)),
             ("wide top-p", wide, (0.8, 0, 0.95, 0.0)),
             ("wide top-k 1000", wide, (1.0, 1000, 1.0, 0.0)),
             ("peaked top-p", peaked, (0.8, 0, 0.95, 0.0))]
    # Ties at the top-p boundary: integer logits, top-p set to the middle of a tie group's
    # mass, so the cut falls inside the group and every token of it must be kept.
    ties = torch.randn(1000, generator=gen).mul(2).round()
    probs = ties.double().softmax(-1)
    values = probs.unique().flip(0)
    group = values[3]
    above = probs[probs > group].sum()
    top_p = float(above + (probs == group).sum() * group / 2)
    assert int((probs == group).sum()) > 10
    cases.append(("ties at the top-p boundary", ties, (1.0, 0, top_p, 0.0)))
    top_k = int((probs > group).sum()) + 2
    cases.append(("ties at the top-k boundary", ties, (1.0, top_k, 1.0, 0.0)))
    return cases


def test_kept_set_and_probabilities_equal_the_definition():
    """The C++ kernel and its torch twin draw from exactly the distribution the filters
    define (a straightforward fp64 full-sort implementation here): the same kept set,
    every kept token where its cumulative interval says, nothing else; for top-p only,
    top-p 1.0, top-k 1, top-k above the vocabulary, top-k with top-p, min-p, all three,
    temperatures 1e-3 and 50, 49,152-token rows (flat and peaked) and ties at the top-p
    and top-k boundaries."""
    for name, row, settings in _distribution_cases():
        expected = _kept_distribution(row, *settings)
        if name.startswith("ties at the top-p"):
            group = expected[expected > 0].min()
            assert int((expected == group).sum()) > 10, name  # the whole tie group kept
        if name == "top-k 1" or name == "tiny temperature":
            assert int((expected > 0).sum()) == 1, name
        # The twin gathers one row per uniform: the kernel alone on the wide rows.
        impls = _implementations() if row.numel() <= 1000 else _implementations()[1:]
        for impl in impls:
            _cdf_midpoint_draws(impl, row, settings, expected)


def test_kernel_rows_do_not_depend_on_order_duplicates_or_threads():
    """Batch invariance inside the kernel: a row's token is the same whatever rows come
    with it, in any order, duplicated, at 1 or 2 threads (threads take rows one by one)."""
    from triton_kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        import pytest
        pytest.skip("C++ kernels unavailable")
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(24, 49_152, generator=gen) * torch.linspace(0.5, 4.0, 24).unsqueeze(1)
    n = 24
    settings = (torch.rand(n, generator=gen) + 0.3,
                torch.randint(0, 100, (n,), generator=gen) * (torch.arange(n) % 3 == 0),
                torch.where(torch.arange(n) % 2 == 0, 0.9, 1.0),
                torch.where(torch.arange(n) % 5 == 0, 0.05, 0.0),
                torch.rand(n, dtype=torch.float64, generator=gen))
    alone = [int(ops.sample_from_logits(logits, torch.tensor([i]),
                                        *(s[i:i + 1] for s in settings))) for i in range(n)]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            order = torch.randperm(n, generator=gen)
            order = torch.cat([order, order[:7]])
            out = ops.sample_from_logits(logits, order, *(s[order] for s in settings))
            assert out.tolist() == [alone[i] for i in order.tolist()], t
    finally:
        torch.set_num_threads(threads)
