"""N-gram prompt lookup (vLLM's ``ngram`` method; Saxena 2023, "prompt lookup decoding").

The last ``n`` tokens of a request (prompt and output so far) are looked up
earlier in the same tokens, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``; where they occurred, the tokens that followed are the
draft. Input-grounded answers (summaries, edits, code copied with a change)
repeat long spans of their prompt, so the draft is often right; open-ended
text rarely matches and then nothing is proposed (the step costs what a
normal decode costs).

The match is vectorized with numpy: candidates are the positions holding the
last token, and each extends backwards one comparison per n-gram length over
all candidates at once, so a 2,000-token context costs a few tens of
microseconds.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, prompt_lookup_min: int, prompt_lookup_max: int,
                  num_speculative_tokens: int) -> np.ndarray:
    """Draft tokens for one request.

    Args:
        token_ids: ``[num_tokens]`` int64, prompt then output so far.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths to try (tokens).
        num_speculative_tokens: most tokens to propose.

    Returns:
        ``[k]`` int64 with ``0 <= k <= num_speculative_tokens``: what followed
        the longest n-gram (``prompt_lookup_min <= n <= prompt_lookup_max``)
        equal to the last ``n`` tokens, at its latest earlier occurrence;
        empty when no such n-gram occurs. A match near the end proposes fewer
        tokens (only what exists after it).
    """
    num_tokens = token_ids.shape[0]
    if num_tokens < prompt_lookup_min + 1 or num_speculative_tokens <= 0:
        return token_ids[:0]
    # Candidate match ends: earlier positions holding the last token.
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    if ends.size == 0:
        return token_ids[:0]
    # Extend every candidate backwards; length[c] = matched tokens (capped at max).
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for d in range(1, prompt_lookup_max):
        if d >= num_tokens - 1:
            break
        idx = ends - d
        ok = alive & (idx >= 0)
        ok[ok] = token_ids[idx[ok]] == token_ids[num_tokens - 1 - d]
        alive = ok
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < prompt_lookup_min:
        return token_ids[:0]
    # The latest occurrence among the longest: closest to what is being written.
    end = int(ends[np.flatnonzero(length == best)[-1]])
    return token_ids[end + 1:end + 1 + num_speculative_tokens]


class NgramProposer:
    """Proposes drafts for a batch of requests from their token rows.

    Args:
        prompt_lookup_min, prompt_lookup_max, num_speculative_tokens: as in
            ``SpeculativeConfig``.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_rows: list[np.ndarray], max_tokens: list[int]) -> list[list[int]]:
        """One draft per request.

        Args:
            token_rows: per request, ``[num_tokens]`` int64 (views are fine).
            max_tokens: per request, most draft tokens it may take (room left
                in the context); 0 proposes nothing.
        """
        return [propose_ngram(row, self.prompt_lookup_min, self.prompt_lookup_max,
                              min(self.num_speculative_tokens, cap)).tolist()
                if cap > 0 else [] for row, cap in zip(token_rows, max_tokens)]
