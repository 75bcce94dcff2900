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
