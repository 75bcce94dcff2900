"""Batched sampling from logits, one random generator per request.

All requests of a step are processed as one ``[num_reqs, vocab]`` tensor:
logit bias, min_tokens masking, penalties, temperature, top-k, top-p, min-p,
then a draw. The draw uses the exponential-race form of categorical sampling
(``argmax(p / q)`` with ``q ~ Exp(1)``, equivalent to Gumbel-max), where each
request's noise row comes from its own ``torch.Generator`` so a seeded request
gives the same tokens alone or inside any batch.

Penalties follow the OpenAI definition (presence, frequency over generated
tokens) and CTRL (Keskar et al. 2019, §4.1) for ``repetition_penalty`` over
prompt and generated tokens, as vLLM applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row settings of one step, built by the model runner.

    Attributes:
        temperature, top_p, min_p, presence_penalty, frequency_penalty,
        repetition_penalty: ``[num_reqs]`` fp32.
        top_k: ``[num_reqs]`` int64, 0 disables.
        generators: one per row.
        greedy: row uses argmax.
        output_token_ids: ``[num_reqs, max_output_len]`` int64 padded with -1 (only when
            a penalty or min_tokens is in use).
        prompt_token_ids: ``[num_reqs, max_prompt_len]`` padded with -1 (only with
            repetition penalty).
        num_logprobs: per row, -1 for none.
        logit_bias: ``(rows, token_ids, biases)`` or None.
        min_tokens_mask: ``(rows, token_ids)`` to set to -inf, or None.
        grammar_bitmask: ``(rows [k] int64, bitmask [k, ceil(vocab / 32)] int32)``
            of the structured-output rows, or None (structured outputs).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    generators: list[torch.Generator]
    greedy: list[bool]
    num_logprobs: list[int]
    output_token_ids: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    all_greedy: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    need_penalties: bool = False


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, len]`` padded with -1 -> counts ``[rows, vocab]``."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32)
    ids = torch.where(token_ids < 0, vocab_size, token_ids)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                          bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit a grammar forbids, for all
    constrained rows at once.

    Args:
        logits: ``[num_reqs, vocab]``.
        rows: ``[k]`` int64, the constrained rows of ``logits``.
        bitmask: ``[k, ceil(vocab_mask / 32)]`` int32, xgrammar's packed layout
            (bit ``j % 32`` of word ``j // 32`` allows token ``j``). Logit
            columns past the mask's width (padding of the embedding) are forbidden.
    """
    k, vocab = rows.shape[0], logits.shape[1]
    device = logits.device
    rows, bitmask = rows.to(device), bitmask.to(device, non_blocking=True)
    shifts = _BIT_SHIFTS if device.type == "cpu" else _BIT_SHIFTS.to(device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(k, -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[1]
    assert batch.output_token_ids is not None
    out_counts = _token_counts(batch.output_token_ids, vocab)
    seen = out_counts > 0
    if batch.prompt_token_ids is not None:
        seen |= _token_counts(batch.prompt_token_ids, vocab) > 0
    rep = batch.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * out_counts
    logits = logits - batch.presence_penalty.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask logits outside top-k / the top-p nucleus / the min-p floor with -inf."""
    if batch.need_min_p:
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * batch.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if not (batch.need_top_k or batch.need_top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.need_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab).unsqueeze(0)
        mask |= ranks >= k.unsqueeze(1)
    if batch.need_top_p:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
        # Keep a token if the mass strictly before it is below top_p.
        mass_before = probs.cumsum(-1) - probs
        mask |= mass_before >= batch.top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch
           ) -> tuple[torch.Tensor, list[list[tuple[int, float]] | None] | None]:
    """Pick one token per row.

    Args:
        logits: ``[num_reqs, vocab]`` fp32 (modified in place where convenient).
        batch: per-row settings.

    Returns:
        ``([num_reqs] int64 token ids, logprobs)``: logprobs is None when no row
        asked; else per row None or ``[(sampled, lp), (top1, lp), ...]`` from
        the model's raw distribution (before any processing), as vLLM returns.
    """
    raw_logprobs = None
    if any(n >= 0 for n in batch.num_logprobs):
        raw_logprobs = logits.log_softmax(-1)
    if batch.logit_bias is not None:
        rows, ids, bias = batch.logit_bias
        logits.index_put_((rows, ids), bias, accumulate=True)
    if batch.min_tokens_mask is not None:
        rows, ids = batch.min_tokens_mask
        logits[rows, ids] = float("-inf")
    if batch.need_penalties:
        logits = apply_penalties(logits, batch)
    if batch.grammar_bitmask is not None:
        # Last, so greedy argmax and the draw below both see it.
        apply_grammar_bitmask(logits, *batch.grammar_bitmask)

    if batch.all_greedy:
        tokens = logits.argmax(-1)
    else:
        temperature = torch.where(batch.temperature < 1e-5, 1.0, batch.temperature)
        scaled = apply_top_k_top_p_min_p(logits / temperature.unsqueeze(1), batch)
        probs = scaled.softmax(-1)
        noise = torch.empty_like(probs)
        for row, gen in enumerate(batch.generators):
            if not batch.greedy[row]:
                noise[row].exponential_(generator=gen)
        tokens = (probs / noise).argmax(-1)
        greedy_rows = torch.tensor(batch.greedy)
        if greedy_rows.any():
            tokens = torch.where(greedy_rows, logits.argmax(-1), tokens)

    if raw_logprobs is None:
        return tokens, None
    out: list[list[tuple[int, float]] | None] = []
    token_list = tokens.tolist()
    max_top = max(batch.num_logprobs)
    top = raw_logprobs.topk(max_top, dim=-1) if max_top > 0 else None
    for row, n in enumerate(batch.num_logprobs):
        if n < 0:
            out.append(None)
            continue
        entry = [(token_list[row], float(raw_logprobs[row, token_list[row]]))]
        if top is not None and n > 0:
            entry += list(zip(top.indices[row, :n].tolist(), top.values[row, :n].tolist()))
        out.append(entry)
    return tokens, out
