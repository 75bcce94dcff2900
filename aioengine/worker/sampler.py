"""Batched sampling from logits, one random generator per request.

All requests of a step are processed as one ``[num_reqs, vocab]`` tensor:
logit bias, min_tokens masking, penalties, grammar bitmask, then per row either
an argmax (greedy rows) or a draw (sampled rows). A draw applies temperature
and the min-p, top-k and top-p (nucleus) filters as thresholds on the row's
unnormalised probabilities, then picks a token by inverse transform sampling
(Devroye 1986, "Non-Uniform Random Variate Generation", §2.1): the first token,
in vocabulary order, whose cumulative kept probability exceeds ``u``, with ONE
uniform ``u`` per row per step from the request's own ``torch.Generator``. A
seeded request therefore gives the same tokens alone or inside any batch, with
any filters on the other rows. On a CPU the draw is the C++ kernel
``triton_kernels/csrc/sampling.cpp`` (no sort of the vocabulary: one exp pass and a
sample select per filter; about 0.7 ms of one core for 32 rows of 49,152 at
temperature 0.8, top-p 0.95 on the default model's logits after random prompts),
elsewhere its torch twin ``triton_kernels.reference.sample_from_logits``.
Seeded tokens changed with the switch to the kernel (as vLLM's change between versions),
and in about 1 draw in 800 when its exp became an inline polynomial (a last-bit
difference moving a boundary of the cumulative distribution).

A step whose rows are all plain greedy (no logprobs, penalties, logit bias, min_tokens
ban or grammar: ``model_runner.argmax_only``) never reaches this module: the LM head's
fused argmax (``compute_greedy_tokens``) gives its tokens without writing the logits.

Penalties follow the OpenAI definition (presence, frequency over generated
tokens) and CTRL (Keskar et al. 2019, §4.1) for ``repetition_penalty`` over
prompt and generated tokens, as vLLM applies them.

``apply_top_k_top_p_min_p`` (filters as -inf masks, by partial sorts) is what
speculative decoding's draft model and verifier use on their probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_kernels import cpu_ops


@dataclass
class SamplingBatch:
    """Per-row settings of one step, built by the model runner.

    Attributes:
        temperature, top_p, min_p, presence_penalty, frequency_penalty,
        repetition_penalty: ``[num_reqs]`` fp32.
        top_k: ``[num_reqs]`` int64, 0 disables.
        generators: one per row; a sampled row draws one fp64 uniform from it per step.
        greedy: row uses argmax.
        output_token_ids: ``[num_reqs, max_output_len]`` int64 padded with -1 (only when
            a penalty or min_tokens is in use).
        prompt_token_ids: ``[num_reqs, max_prompt_len]`` padded with -1 (only with
            repetition penalty).
        num_logprobs: per row, -1 for none.
        logit_bias: ``(rows, token_ids, biases)`` or None.
        min_tokens_mask: ``(rows, token_ids)`` to set to -inf, or None.
        penalty_rows: ``[k]`` int64, the rows that set a penalty (None: all rows).
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
    penalty_rows: torch.Tensor | None = None


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
    """Presence, frequency and repetition penalties, in place, on the rows that
    set one (``batch.penalty_rows``; all rows when None). Returns ``logits``."""
    assert batch.output_token_ids is not None
    vocab = logits.shape[1]
    rows = batch.penalty_rows
    sub = logits if rows is None else logits[rows]
    out_ids = batch.output_token_ids if rows is None else batch.output_token_ids[rows]
    out_counts = _token_counts(out_ids, vocab)
    seen = out_counts > 0
    if batch.prompt_token_ids is not None:
        prompt_ids = batch.prompt_token_ids if rows is None else batch.prompt_token_ids[rows]
        seen |= _token_counts(prompt_ids, vocab) > 0

    def col(t: torch.Tensor) -> torch.Tensor:
        return (t if rows is None else t[rows]).unsqueeze(1)

    rep = col(batch.repetition_penalty)
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - col(batch.frequency_penalty) * out_counts
    sub = sub - col(batch.presence_penalty) * (out_counts > 0).float()
    if rows is None:
        return sub
    logits[rows] = sub
    return logits


#: First width of the partial sort that looks for a top-p nucleus (grown x8 when
#: the nucleus is wider, up to the whole vocabulary).
TOP_P_FIRST_WIDTH = 256


def _top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Rows of ``logits`` ``[r, vocab]`` with every logit below the row's
    ``top_k``-th largest set to -inf (ties with it are kept), by one partial sort
    (``topk``) of width ``max(top_k)``: no full-vocabulary sort."""
    k = top_k.clamp(1, logits.shape[1])
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_mask_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_top_p_mask`` by a full sort of each row (for wide nuclei)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mask = (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    return torch.empty_like(logits).scatter_(1, sorted_idx,
                                             sorted_logits.masked_fill(mask, float("-inf")))


def _top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of ``logits`` ``[r, vocab]`` outside the top-p nucleus (Holtzman et
    al. 2020, §3.1) set to -inf: a token is kept when the probability mass of the
    tokens before it, in descending order, is below ``top_p``.

    The nucleus is first looked for with a partial sort (``topk``) of
    ``TOP_P_FIRST_WIDTH`` tokens, then of 8x as many for rows whose first tokens
    already hold half of ``top_p``; the remaining rows (flat distributions, wide
    nuclei) are sorted whole. A peaked distribution never pays for a full sort."""
    vocab = logits.shape[1]
    probs = logits.softmax(-1)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    rows_left = torch.arange(logits.shape[0])
    to_sort = []
    width = TOP_P_FIRST_WIDTH
    while rows_left.numel() and width <= vocab // 8:
        values, indices = probs[rows_left].topk(width, dim=-1)
        cum = values.cumsum(-1)
        threshold = top_p[rows_left]
        mass = cum[:, -1]
        done = mass >= threshold
        rows = rows_left[done]
        keep[rows] = keep[rows].scatter(
            1, indices[done], (cum - values)[done] < threshold[done].unsqueeze(1))
        flat = ~done & (mass < threshold / 2)
        to_sort.append(rows_left[flat])
        rows_left = rows_left[~done & ~flat]
        width *= 8
    rows = torch.cat(to_sort + [rows_left])
    if rows.numel() == logits.shape[0]:
        return _top_p_mask_sorted(logits, top_p)
    out = logits.masked_fill(~keep, float("-inf"))
    if rows.numel():
        out[rows] = _top_p_mask_sorted(logits[rows], top_p[rows])
    return out


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch,
                            inplace: bool = False) -> torch.Tensor:
    """Mask logits outside top-k / the top-p nucleus / the min-p floor with -inf.

    Each filter touches only the rows that set it (``top_k > 0``, ``top_p < 1``,
    ``min_p > 0``); top-p applies to what top-k left. No full-vocabulary sort
    (partial sorts only, see ``_top_k_mask`` and ``_top_p_mask``).

    Args:
        logits: ``[num_reqs, vocab]`` fp32, already divided by the temperature.
        batch: per-row ``top_k``, ``top_p``, ``min_p`` (``need_*`` flags say
            whether any row sets one).
        inplace: mask ``logits`` itself rather than a copy.
    Returns:
        ``[num_reqs, vocab]``: a new tensor unless ``inplace`` (``logits`` itself
        when no filter applies).
    """
    if not (batch.need_min_p or batch.need_top_k or batch.need_top_p):
        return logits
    if not inplace:
        logits = logits.clone()
    if batch.need_min_p:
        rows = torch.nonzero(batch.min_p > 0).squeeze(1)
        if rows.numel():
            sub = logits[rows]
            probs = sub.softmax(-1)
            floor = probs.max(-1, keepdim=True).values * batch.min_p[rows].unsqueeze(1)
            logits[rows] = sub.masked_fill(probs < floor, float("-inf"))
    if batch.need_top_k:
        rows = torch.nonzero(batch.top_k > 0).squeeze(1)
        if rows.numel():
            logits[rows] = _top_k_mask(logits[rows], batch.top_k[rows])
    if batch.need_top_p:
        rows = torch.nonzero(batch.top_p < 1.0).squeeze(1)
        if rows.numel():
            logits[rows] = _top_p_mask(logits[rows], batch.top_p[rows])
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``[num_reqs]`` int64: each row's argmax, the first index among equal maxima
    (``Tensor.max(dim)``'s indices: the same as ``argmax``, about 2-3x faster on
    a CPU for a ``[32, 49152]`` fp32 tensor)."""
    return logits.max(-1).indices


def row_uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """``[len(generators)]`` fp64 in ``[0, 1)``: one draw from each row's own generator
    (so a row's stream depends on nothing else in the batch)."""
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])


def draw_tokens(logits: torch.Tensor, rows: torch.Tensor | None, batch: SamplingBatch
                ) -> torch.Tensor:
    """Sample one token for each of ``rows`` of ``logits`` by temperature, min-p, top-k,
    top-p, then inverse transform sampling with one uniform from the row's generator
    (the rule in full: ``triton_kernels/csrc/sampling.h``).

    Args:
        logits: ``[num_reqs, vocab]`` fp32, read in place (not modified).
        rows: ``[n]`` int64, the sampled rows; None: every row, in order.
        batch: per-row settings of all ``num_reqs`` rows; ``need_*`` False turns a
            filter off for every row.

    Returns:
        ``[n]`` int64 token ids.
    """
    if rows is None:
        rows = torch.arange(logits.shape[0])
        temperature, generators = batch.temperature, batch.generators

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t
    else:
        temperature = batch.temperature[rows]
        generators = [batch.generators[i] for i in rows.tolist()]

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[rows]
    n = rows.shape[0]
    temperature = torch.where(temperature < 1e-5, 1.0, temperature)
    top_k = pick(batch.top_k) if batch.need_top_k else torch.zeros(n, dtype=torch.int64)
    top_p = pick(batch.top_p) if batch.need_top_p else torch.ones(n)
    min_p = pick(batch.min_p) if batch.need_min_p else torch.zeros(n)
    return cpu_ops.sample_from_logits(logits, rows, temperature.float(), top_k.long(),
                                      top_p.float(), min_p.float(), row_uniforms(generators))


def sample(logits: torch.Tensor, batch: SamplingBatch
           ) -> tuple[torch.Tensor, list[list[tuple[int, float]] | None] | None]:
    """Pick one token per row.

    Greedy rows cost one argmax; sampled rows are drawn by ``draw_tokens`` (one
    uniform each from the row's own generator, whatever the filters); penalties
    and logprobs are computed for the rows that ask.

    Args:
        logits: ``[num_reqs, vocab]`` fp32 (modified in place where convenient).
        batch: per-row settings.

    Returns:
        ``([num_reqs] int64 token ids, logprobs)``: logprobs is None when no row
        asked; else per row None or ``[(sampled, lp), (top1, lp), ...]`` from
        the model's raw distribution (before any processing), as vLLM returns.
    """
    raw_logprobs = None
    logprob_rows = [row for row, n in enumerate(batch.num_logprobs) if n >= 0]
    if logprob_rows:
        raw_logprobs = logits[logprob_rows].log_softmax(-1)
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
        tokens = greedy_tokens(logits)
    elif not any(batch.greedy):
        tokens = draw_tokens(logits, None, batch).to(logits.device)
    else:
        sampled = [row for row, g in enumerate(batch.greedy) if not g]
        tokens = greedy_tokens(logits)
        index = torch.tensor(sampled, dtype=torch.int64)
        tokens[index] = draw_tokens(logits, index, batch).to(tokens.device)

    if raw_logprobs is None:
        return tokens, None
    out: list[list[tuple[int, float]] | None] = [None] * len(batch.num_logprobs)
    token_list = tokens.tolist()
    max_top = max(batch.num_logprobs)
    top = raw_logprobs.topk(max_top, dim=-1) if max_top > 0 else None
    for k, row in enumerate(logprob_rows):
        n = batch.num_logprobs[row]
        entry = [(token_list[row], float(raw_logprobs[k, token_list[row]]))]
        if top is not None and n > 0:
            entry += list(zip(top.indices[k, :n].tolist(), top.values[k, :n].tolist()))
        out[row] = entry
    return tokens, out

