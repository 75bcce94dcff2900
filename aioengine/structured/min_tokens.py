"""When a grammar and ``min_tokens`` disagree, the grammar wins.

``min_tokens`` masks a request's stop tokens (EOS and ``stop_token_ids``) until it
has generated that many tokens; a grammar masks every token it does not accept
next. Once a grammar is complete (``{"type": "boolean"}`` after ``true``, a
``choice`` after its word) it accepts only EOS, so both masks together forbid
every token, and a sampler handed a row of -inf logits returns an arbitrary id
(token 0). The output must match the grammar, so the grammar wins: for such a row
the ``min_tokens`` mask is lifted, the request samples EOS and ends with
``finish_reason: "stop"`` before ``min_tokens``, exactly as it would without
``min_tokens``. Rows where the grammar allows any token that ``min_tokens`` does
not ban keep the mask, so ``min_tokens`` holds wherever it can. This is vLLM's rule
too (vllm-project/vllm#54218, "Let terminal grammars stop under min_tokens").
"""

from __future__ import annotations

import numpy as np
import torch


def grammar_allows_only(bitmask_row: np.ndarray, token_ids: list[int]) -> bool:
    """Whether a grammar's next-token mask allows nothing outside ``token_ids``.

    Args:
        bitmask_row: ``int32 [ceil(vocab / 32)]``, xgrammar's packed layout (bit
            ``j % 32`` of word ``j // 32`` allows token ``j``).
        token_ids: token ids (ids past the mask are ignored).
    """
    rest = bitmask_row.view(np.uint32).copy()
    for t in token_ids:
        if 0 <= t < rest.shape[0] * 32:
            rest[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return not rest.any()


def lift_min_tokens_where_grammar_ends(
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None,
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``min_tokens`` mask without the rows whose grammar allows only banned tokens.

    Args:
        min_tokens_mask: ``(rows [m], token_ids [m])`` int64, the logits to set to -inf
            (``SamplingBatch.min_tokens_mask``), or None.
        grammar_bitmask: ``(rows [k] int64, bitmask [k, ceil(vocab / 32)] int32)``
            (``SamplingBatch.grammar_bitmask``), or None.

    Returns:
        ``min_tokens_mask`` itself when no row changes, else the kept entries (None when
        none is left).
    """
    if min_tokens_mask is None or grammar_bitmask is None:
        return min_tokens_mask
    rows, token_ids = min_tokens_mask
    grammar_rows, bitmask = grammar_bitmask
    bitmask_np = bitmask.numpy()
    banned: dict[int, list[int]] = {}
    for r, t in zip(rows.tolist(), token_ids.tolist()):
        banned.setdefault(r, []).append(t)
    lifted = [r for k, r in enumerate(grammar_rows.tolist())
              if r in banned and grammar_allows_only(bitmask_np[k], banned[r])]
    if not lifted:
        return min_tokens_mask
    keep = ~torch.isin(rows, torch.tensor(lifted, dtype=rows.dtype))
    if not bool(keep.any()):
        return None
    return rows[keep], token_ids[keep]
