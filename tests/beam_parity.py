"""Beam-search parity against HF transformers' ``generate(num_beams=k, ...)``.

The near-tie rule of DESIGN.md, for beams: the k returned sequences must be equal
token for token and in the same order. Where they first differ (rank r), it is a
tie, not a bug, only if the reference's scores at rank r and a neighbouring rank
are within ``NEAR_TIE`` (the order of two equal-scored beams flipped), or if our
beam at rank r scores within ``NEAR_TIE`` of the reference's (a tie earlier in the
search picked another, equally good, beam); the comparison stops there and the
tie is reported.
"""

from __future__ import annotations

from parity import NEAR_TIE


def hf_beam_search(model, prompt_ids: list[int], k: int, max_new_tokens: int,
                   length_penalty: float, early_stopping, eos_token_id: int | None
                   ) -> tuple[list[list[int]], list[float]]:
    """HF's k best sequences (generated tokens, EOS kept, padding cut) and their scores.

    Runs on one thread: beside a busy engine worker, HF's small batched matmuls ran
    15x slower on two oversubscribed cores than on one.
    """
    import torch

    ids = torch.tensor([prompt_ids])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = _generate(model, ids, k, max_new_tokens, length_penalty, early_stopping,
                        eos_token_id)
    finally:
        torch.set_num_threads(threads)
    seqs = []
    for row in out.sequences[:, ids.shape[1]:].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[:row.index(eos_token_id) + 1]
        seqs.append([t for t in row if t != -1])
    return seqs, out.sequences_scores.tolist()


def _generate(model, ids, k, max_new_tokens, length_penalty, early_stopping, eos_token_id):
    import torch

    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          num_beams=k, num_return_sequences=k, do_sample=False,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          eos_token_id=eos_token_id, pad_token_id=-1 if eos_token_id is None
                          else eos_token_id, output_scores=True, return_dict_in_generate=True)


def assert_beam_parity(name: str, ours: list[list[int]], our_scores: list[float],
                       ref: list[list[int]], ref_scores: list[float]) -> str | None:
    """Fail unless the beams match up to a near-tie; a report line if one was met."""
    assert len(ours) == len(ref), f"{name}: {len(ours)} beams, reference {len(ref)}"
    for r, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            assert abs(our_scores[r] - ref_scores[r]) < NEAR_TIE, (
                f"{name}: beam {r} equal but scores {our_scores[r]} vs {ref_scores[r]}")
            continue
        neighbours = [ref_scores[j] for j in (r - 1, r + 1) if 0 <= j < len(ref_scores)]
        order_tie = any(abs(ref_scores[r] - s) < NEAR_TIE for s in neighbours)
        equal_score = abs(our_scores[r] - ref_scores[r]) < NEAR_TIE
        assert order_tie or equal_score, (
            f"{name}: beam {r} differs and is no near-tie (scores ours {our_scores}, "
            f"reference {ref_scores})\nours: {a}\nref:  {b}")
        report = f"{name}: near-tie at beam {r} (scores {our_scores[r]:.5f} / {ref_scores[r]:.5f})"
        print(report)
        return report
    return None
