"""The planned CPU attention: one step's index math done once for every layer.

Everything attention needs besides Q and the cache contents (gather indices, masks, the
split of a mixed batch) depends only on the step's metadata, which every layer shares.
``plan_attention`` computes it once per step, as vLLM's attention backends build their
metadata once per step; the per-layer work (``paged_attention_planned``,
``reshape_and_cache_planned``) is then gathers and SDPA only. ``cpu_ops`` runs the decode
rows of a plan through its C++ kernel.

The torch oracle in ``reference.py`` builds a throwaway plan per call with the same
``_plan``/``_run``, so the planned and unplanned paths compute the same thing; the
gather and SDPA helpers live there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validation import check_index, check_metadata
from .reference import _gather_ids, _gather_kv, _sdpa, _valid_slots, _write_slots


@dataclass(frozen=True)
class _DecodePlan:
    block_table: torch.Tensor  # [num_seqs, blocks_per_seq] int32, contiguous, clamped
    seq_lens: torch.Tensor  # [num_seqs] int32, contiguous
    num_seqs: int
    max_seqlen_k: int
    mask: torch.Tensor | None  # [num_seqs, 1, 1, max_seqlen_k] bool; None: nothing masked


@dataclass(frozen=True)
class _PrefillPlan:
    block_ids: torch.Tensor
    num_seqs: int
    max_seqlen_q: int
    max_seqlen_k: int
    mask: torch.Tensor | None  # [num_seqs, 1, max_seqlen_q, max_seqlen_k]; None: plain causal
    token_seq: torch.Tensor  # [num_tokens] sequence of each query row
    token_row: torch.Tensor  # [num_tokens] row of each query row within its sequence


@dataclass(frozen=True)
class _SeqPlan:
    """Per-sequence metadata of a step with prompt chunks, as the C++ layers take it."""

    block_table: torch.Tensor  # [num_seqs, blocks_per_seq] int32, contiguous, clamped
    seq_lens: torch.Tensor  # [num_seqs] int32, contiguous
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, contiguous (cu_seqlens_q)


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention and cache-write index math for the CPU path, shared by every
    layer. Built by ``plan_attention``; opaque to callers.

    A batch is all decodes (``prefill`` None), all prefill rows (``decode`` None), or
    mixed: the decode rows ``decode_tokens`` go through the decode path and the rest,
    ``prefill_tokens``, are padded only to the longest of the rest.
    """

    num_tokens: int
    num_blocks: int
    block_size: int
    decode: _DecodePlan | None
    prefill: _PrefillPlan | None
    decode_tokens: torch.Tensor | None
    prefill_tokens: torch.Tensor | None
    slots: torch.Tensor | None  # [num_written] int64 cache slots; None: no slot_mapping given
    written_tokens: torch.Tensor | None  # tokens with a slot >= 0; None: every token
    seqs: _SeqPlan | None = None  # every sequence's metadata when prefill is not None


def _plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_k: int,
                 num_blocks: int, block_size: int) -> _DecodePlan:
    num_seqs = seq_lens.shape[0]
    if num_seqs == 1 and seq_lens.device.type == "cpu" and int(seq_lens[0]) == max_seqlen_k:
        mask = None
    else:
        positions = torch.arange(max_seqlen_k, device=seq_lens.device)
        mask = (positions < seq_lens[:, None]).view(num_seqs, 1, 1, max_seqlen_k)
    block_ids = _gather_ids(block_tables, max_seqlen_k, num_blocks, block_size)
    block_table = block_ids.view(num_seqs, -1).to(torch.int32)
    return _DecodePlan(block_table, seq_lens.to(torch.int32).contiguous(), num_seqs,
                       max_seqlen_k, mask)


def _plan_prefill(block_tables: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
                  token_seq: torch.Tensor, token_row: torch.Tensor, max_seqlen_q: int,
                  max_seqlen_k: int, num_blocks: int, block_size: int) -> _PrefillPlan:
    """``token_seq[t]``/``token_row[t]``: sequence (index into ``seq_lens``, ``q_lens``,
    ``block_tables``) and row of query row t."""
    num_tokens = token_seq.shape[0]
    num_seqs = seq_lens.shape[0]
    block_ids = _gather_ids(block_tables, max_seqlen_k, num_blocks, block_size)
    if num_seqs == 1 and num_tokens == max_seqlen_k and int(seq_lens[0]) == num_tokens:
        # A cold prompt alone: plain causal attention, which SDPA does without a mask.
        mask = None
    else:
        # Row j of sequence i sits at position seq_len - q_len + j and sees keys
        # 0..position. Padding rows (j >= q_len) see at least key 0, so no row of the
        # softmax is empty.
        q_positions = ((seq_lens - q_lens)[:, None]
                       + torch.arange(max_seqlen_q, device=seq_lens.device))
        k_positions = torch.arange(max_seqlen_k, device=seq_lens.device)
        mask = (k_positions <= q_positions[:, :, None]).unsqueeze(1)
    return _PrefillPlan(block_ids, num_seqs, max_seqlen_q, max_seqlen_k, mask, token_seq,
                        token_row)


def _plan(block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
          seq_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, num_tokens: int,
          num_blocks: int, block_size: int, force_prefill: bool = False,
          slots: torch.Tensor | None = None,
          written_tokens: torch.Tensor | None = None) -> AttentionPlan:
    num_seqs = seq_lens.shape[0]

    def plan(decode=None, prefill=None, decode_tokens=None, prefill_tokens=None):
        seqs = None
        if prefill is not None and seq_lens.device.type == "cpu":
            blocks_per_seq = -(-max_seqlen_k // block_size)
            seqs = _SeqPlan(_gather_ids(block_tables, max_seqlen_k, num_blocks, block_size)
                            .view(num_seqs, blocks_per_seq).to(torch.int32),
                            seq_lens.to(torch.int32).contiguous(),
                            cu_seqlens_q.to(torch.int32).contiguous())
        return AttentionPlan(num_tokens, num_blocks, block_size, decode, prefill,
                             decode_tokens, prefill_tokens, slots, written_tokens, seqs)

    if not force_prefill and max_seqlen_q == 1 and num_tokens == num_seqs:
        return plan(decode=_plan_decode(block_tables, seq_lens, max_seqlen_k, num_blocks,
                                        block_size))
    device = seq_lens.device
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens,
                                        output_size=num_tokens)
    token_row = torch.arange(num_tokens, device=device) - cu[token_seq]
    is_decode = q_lens == 1
    num_decodes = int(is_decode.sum())
    if num_decodes == 0 or num_decodes == num_seqs or max_seqlen_q == 1:
        return plan(prefill=_plan_prefill(block_tables, seq_lens, q_lens, token_seq, token_row,
                                          max_seqlen_q, max_seqlen_k, num_blocks, block_size))
    # Mixed batch. The data-dependent maxima cost a sync, which only matters to the CUDA
    # callers of this path (tests), not to the CPU path.
    dec_seqs = is_decode.nonzero().squeeze(1)
    dec_max_k = int(seq_lens[dec_seqs].max())
    decode = _plan_decode(block_tables[dec_seqs], seq_lens[dec_seqs], dec_max_k, num_blocks,
                          block_size)
    pre_seqs = (~is_decode).nonzero().squeeze(1)
    pre_tokens = (~is_decode[token_seq]).nonzero().squeeze(1)
    local_seq = torch.cumsum(~is_decode, 0) - 1  # batch index -> index among the rest
    pre_max_k = int(seq_lens[pre_seqs].max())
    prefill = _plan_prefill(block_tables[pre_seqs], seq_lens[pre_seqs], q_lens[pre_seqs],
                            local_seq[token_seq[pre_tokens]], token_row[pre_tokens],
                            max_seqlen_q, pre_max_k, num_blocks, block_size)
    return plan(decode, prefill, cu[dec_seqs], pre_tokens)


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            plan: _DecodePlan, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    block_ids = plan.block_table.view(-1)
    k = _gather_kv(key_cache, block_ids, num_seqs, plan.max_seqlen_k, 0).transpose(1, 2)
    v = _gather_kv(value_cache, block_ids, num_seqs, plan.max_seqlen_k, 1).transpose(1, 2)
    k, v = k.to(query.dtype), v.to(query.dtype)  # no copy unless the cache is narrower
    # The query heads of one KV group become rows of one head: [S, kv_heads, group, D]
    # against [S, kv_heads, L, D] needs no GQA expansion and the key-padding mask
    # broadcasts over the rows.
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = _sdpa(q, k, v, plan.mask, scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             plan: _PrefillPlan, scale: float) -> torch.Tensor:
    """Padded attention for ragged query rows."""
    num_tokens, num_heads, head_dim = query.shape
    k = _gather_kv(key_cache, plan.block_ids, plan.num_seqs, plan.max_seqlen_k, 0).transpose(1, 2)
    v = _gather_kv(value_cache, plan.block_ids, plan.num_seqs, plan.max_seqlen_k,
                   1).transpose(1, 2)
    k, v = k.to(query.dtype), v.to(query.dtype)  # no copy unless the cache is narrower
    if plan.mask is None:
        out = _sdpa(query.unsqueeze(0).transpose(1, 2), k, v, None, scale, is_causal=True)
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
    q = query.new_zeros(plan.num_seqs, plan.max_seqlen_q, num_heads, head_dim)
    q[plan.token_seq, plan.token_row] = query
    out = _sdpa(q.transpose(1, 2), k, v, plan.mask, scale)
    return out.transpose(1, 2)[plan.token_seq, plan.token_row]


def _run(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
         plan: AttentionPlan, scale: float, decode=None) -> torch.Tensor:
    """``decode``: the implementation of the decode rows (default ``_decode``)."""
    decode = decode or _decode
    if plan.prefill is None:
        return decode(query, key_cache, value_cache, plan.decode, scale)
    if plan.decode is None:
        return _prefill(query, key_cache, value_cache, plan.prefill, scale)
    out = torch.empty_like(query)
    out[plan.decode_tokens] = decode(query[plan.decode_tokens], key_cache, value_cache,
                                     plan.decode, scale)
    out[plan.prefill_tokens] = _prefill(query[plan.prefill_tokens], key_cache, value_cache,
                                        plan.prefill, scale)
    return out


def plan_attention(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, num_blocks: int, block_size: int) -> AttentionPlan:
    """Validate one step's metadata and do its index math once for every layer.

    Arguments as in ``paged_attention`` and ``reshape_and_cache`` (the new tokens'
    ``slot_mapping``), plus the cache geometry. ``slot_mapping`` entries are checked
    against the cache here, so the per-layer calls do not re-check them.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices of the metadata, or a
            ``seq_lens`` entry outside ``[1, max_seqlen_k]``.
        IndexError: for a slot past the end of the cache.
    """
    check_metadata(block_tables, seq_lens, max_seqlen_k, block_size, cu_seqlens_q,
                   max_seqlen_q, num_tokens=slot_mapping.shape[0])
    check_index("slot_mapping", slot_mapping, 1)
    if seq_lens.numel():
        # The C++ decode kernel walks each row's seq_len tokens of the block table.
        lo, hi = (int(x) for x in torch.aminmax(seq_lens))
        if lo < 1 or hi > max_seqlen_k:
            raise ValueError(f"seq_lens must be in [1, max_seqlen_k={max_seqlen_k}], "
                             f"got {lo}..{hi}")
    slots, written = _valid_slots(slot_mapping.long(), num_blocks * block_size)
    return _plan(block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                 slot_mapping.shape[0], num_blocks, block_size, slots=slots,
                 written_tokens=written)


def cache_dtype_ok(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a KV cache of ``cache_dtype`` serves activations of ``dtype`` on the CPU
    path: the same dtype, or an fp16/bf16/fp8 (E4M3, E5M2) cache under fp32 activations."""
    return cache_dtype == dtype or (dtype == torch.float32 and cache_dtype in (
        torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2))


def _check_plan(plan: AttentionPlan, query_or_key: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor) -> None:
    """The cheap per-layer checks left once a plan exists: shapes against the plan. The
    cache has the query's dtype, or is fp16/bf16/fp8 under fp32 (``--kv-cache-dtype``)."""
    if (query_or_key.shape[0] != plan.num_tokens
            or tuple(key_cache.shape[:2]) != (plan.num_blocks, plan.block_size)
            or value_cache.shape != key_cache.shape
            or not cache_dtype_ok(query_or_key.dtype, key_cache.dtype)
            or value_cache.dtype != key_cache.dtype):
        raise ValueError(
            f"tensors do not match the plan: {query_or_key.shape[0]} tokens of "
            f"{query_or_key.dtype} for a plan of {plan.num_tokens}; caches "
            f"{list(key_cache.shape)} {key_cache.dtype} / {list(value_cache.shape)} "
            f"{value_cache.dtype} for {plan.num_blocks} blocks of {plan.block_size}")


def paged_attention_planned(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, plan: AttentionPlan, scale: float,
                            decode=None) -> torch.Tensor:
    """``paged_attention`` with the step's metadata already planned by ``plan_attention``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        decode: the implementation of the decode rows (``cpu_ops`` passes its C++
            kernel); default the gather + SDPA path here.

    Raises:
        ValueError: if the tensors do not match the plan.
    """
    _check_plan(plan, query, key_cache, value_cache)
    return _run(query, key_cache, value_cache, plan, scale, decode=decode)


def reshape_and_cache_planned(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, plan: AttentionPlan) -> None:
    """``reshape_and_cache`` with the slots validated once per step by ``plan_attention``.

    Raises:
        ValueError: if the tensors do not match the plan, or the cache is not contiguous.
    """
    _check_plan(plan, key, key_cache, value_cache)
    if plan.slots is None or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("reshape_and_cache_planned needs a plan with slot_mapping and "
                         "contiguous caches")
    _write_slots(key, value, key_cache, value_cache, plan.slots, plan.written_tokens)
