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


# -- the sampler at batch size: no full sort, sampled rows only, same tokens -----------------


def _reference_sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The sampler before partial sorts: a full-vocabulary sort for top-k/top-p and
    ``exponential_`` per row; seeded requests must keep these tokens."""
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
    probs = logits.softmax(-1)
    noise = torch.ones_like(probs)
    for row, gen in enumerate(b.generators):
        if not b.greedy[row]:
            noise[row].exponential_(generator=gen)
    return torch.where(torch.tensor(b.greedy), logits.argmax(-1), (probs / noise).argmax(-1))


def test_partial_sort_sampling_keeps_the_seeded_tokens():
    """Mixed greedy/sampled rows with top-k, top-p (one nucleus wider than the first
    partial sort, from flat logits) and min-p: the same tokens, step after step,
    as the full-sort sampler with ``exponential_`` per row."""
    from aioengine.worker import sampler

    vocab, rows = 3000, 6
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([[4.0], [4.0], [0.05], [4.0], [2.0], [4.0]])
    settings = dict(
        temperature=torch.tensor([0.0, 0.8, 1.0, 1.2, 0.7, 1.0]),
        top_k=torch.tensor([0, 40, 0, 0, 5, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.99, 0.8, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2]))

    def make() -> SamplingBatch:
        b = batch(rows, generators=[torch.Generator().manual_seed(7 + r) for r in range(rows)],
                  greedy=[True] + [False] * 5, need_top_k=True, need_top_p=True,
                  need_min_p=True, **settings)
        return b

    ours, ref = make(), make()
    assert sampler.TOP_P_FIRST_WIDTH < vocab * 0.99  # row 2's nucleus needs widening
    for _ in range(8):
        logits = torch.randn(rows, vocab, generator=gen) * scale
        tokens, _ = sample(logits.clone(), ours)
        assert tokens.tolist() == _reference_sample(logits, ref).tolist()


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
