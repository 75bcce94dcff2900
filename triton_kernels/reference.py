"""Torch implementations of the paged KV-cache kernels: the CPU path and the test oracle.

Each function here is the twin of a Triton kernel (``cache_ops.py``,
``paged_attention.py``) and is what the engine runs on CPU tensors, so it is
vectorised over the whole batch: no Python loop over sequences or tokens.

Attention over the paged cache (Kwon et al. 2023, "Efficient Memory Management
for Large Language Model Serving with PagedAttention", §4) is done in three steps:

1. gather each sequence's K/V blocks through its block table into a padded
   ``[num_seqs, max_seqlen_k, num_kv_heads, head_dim]`` tensor;
2. build a boolean mask from positions (causal, and key position < seq_len);
3. run ``torch.nn.functional.scaled_dot_product_attention`` (softmax in fp32).

Decode rows (one new token per sequence) and prefill rows (several) are handled
separately, so one long prompt chunk in a batch of decodes does not pad every
decode to the chunk's length.

Cache requirement: slots past a sequence's length are read (then masked) by the
gather, so the cache must never hold NaN or Inf (allocate it with ``torch.zeros``);
a masked NaN would still poison the softmax-weighted sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._validation import check_attention, check_cache_write

# enable_gqa arrived in torch 2.5; older versions repeat the KV heads instead.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

# Reusable gather buffers for CPU. Allocations above glibc's mmap threshold (32 MiB) are
# returned to the OS on free, so a fresh buffer per call pays a page fault per 4 KiB: at
# batch 64 x 1k context in fp32 that made the gather 8x slower than the copy itself.
_workspace: dict[tuple[int, torch.dtype, bool], torch.Tensor] = {}


def _buffer(slot: int, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """An uninitialised ``shape`` tensor; on CPU a view of a grow-only buffer reused across
    calls (``slot`` keeps the K and V buffers apart)."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    # An inference tensor cannot be written outside inference mode, so keep one per mode.
    key = (slot, dtype, torch.is_inference_mode_enabled())
    buf = _workspace.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        _workspace[key] = buf
    return buf[:numel].view(shape)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V into their cache slots, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 (or int32); slot = block_id * block_size +
            offset in block; -1 skips the token (padding).

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
        IndexError: for a slot past the end of the cache.
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_slots = num_blocks * block_size
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(slots))
    if hi >= num_slots:
        raise IndexError(f"slot {hi} is past the end of the cache ({num_slots} slots)")
    if lo < 0:  # padding tokens (slot -1) are rare: filter only when present
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        # One index_copy_ per cache on the [num_slots, heads, dim] view: a fifth of the
        # time of a two-index put (block, offset).
        key_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slots, key)
        value_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slots, value)
        return
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    key_cache[block_ids, offsets] = key
    value_cache[block_ids, offsets] = value


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_seqlen_k: int,
               slot: int) -> torch.Tensor:
    """``[num_seqs, max_seqlen_k, num_kv_heads, head_dim]`` view of each sequence's cached
    tokens, in order. Past a sequence's length it holds whatever its blocks hold."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    num_seqs = block_tables.shape[0]
    blocks_per_seq = -(-max_seqlen_k // block_size)
    # Padding entries of a block table are arbitrary; clamp so they index a real block
    # (whose tokens are then masked out).
    block_ids = block_tables[:, :blocks_per_seq].clamp(0, num_blocks - 1).reshape(-1)
    out = _buffer(slot, (num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim),
                  cache.dtype, cache.device)
    torch.index_select(cache, 0, block_ids, out=out)
    return out.view(num_seqs, blocks_per_seq * block_size, num_kv_heads, head_dim)[
        :, :max_seqlen_k]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, is_causal: bool = False) -> torch.Tensor:
    """SDPA on ``[batch, heads, rows, head_dim]`` with grouped KV heads."""
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  is_causal=is_causal, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          is_causal=is_causal)


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
            max_seqlen_k: int) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    k = _gather_kv(key_cache, block_tables, max_seqlen_k, 0).transpose(1, 2)
    v = _gather_kv(value_cache, block_tables, max_seqlen_k, 1).transpose(1, 2)
    # The query heads of one KV group become rows of one head: [S, kv_heads, group, D]
    # against [S, kv_heads, L, D] needs no GQA expansion and the key-padding mask
    # broadcasts over the rows.
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if num_seqs == 1 and seq_lens.device.type == "cpu" and int(seq_lens[0]) == max_seqlen_k:
        mask = None
    else:
        positions = torch.arange(max_seqlen_k, device=query.device)
        mask = (positions < seq_lens[:, None]).view(num_seqs, 1, 1, max_seqlen_k)
    out = _sdpa(q, k, v, mask, scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
             token_seq: torch.Tensor, token_row: torch.Tensor, scale: float,
             max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """Padded attention for ragged query rows.

    ``query[t]`` is row ``token_row[t]`` of sequence ``token_seq[t]`` (indices into
    ``seq_lens``, ``q_lens`` and ``block_tables``).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    k = _gather_kv(key_cache, block_tables, max_seqlen_k, 0).transpose(1, 2)
    v = _gather_kv(value_cache, block_tables, max_seqlen_k, 1).transpose(1, 2)
    if num_seqs == 1 and num_tokens == max_seqlen_k and int(seq_lens[0]) == num_tokens:
        # A cold prompt alone: plain causal attention, which SDPA does without a mask.
        out = _sdpa(query.unsqueeze(0).transpose(1, 2), k, v, None, scale, is_causal=True)
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
    q = query.new_zeros(num_seqs, max_seqlen_q, num_heads, head_dim)
    q[token_seq, token_row] = query
    # Row j of sequence i sits at position seq_len - q_len + j and sees keys 0..position.
    # Padding rows (j >= q_len) see at least key 0, so no row of the softmax is empty.
    q_positions = ((seq_lens - q_lens)[:, None]
                   + torch.arange(max_seqlen_q, device=query.device))
    k_positions = torch.arange(max_seqlen_k, device=query.device)
    mask = (k_positions <= q_positions[:, :, None]).unsqueeze(1)
    out = _sdpa(q.transpose(1, 2), k, v, mask, scale)
    return out.transpose(1, 2)[token_seq, token_row]


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           max_seqlen_k: int) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32 block ids.
        seq_lens: ``[num_seqs]`` int32 context lengths in tokens, including the new token.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_seqlen_k: ``max(seq_lens)`` as a Python int.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
    """
    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seqlen_k)


def paged_attention_prefill(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """Causal attention of ragged query rows over their paged context.

    Any batch: cold prompts, chunked prefill, prompts with a cached prefix, decodes.
    Rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` belong to sequence i; its row j sits at
    position ``seq_lens[i] - q_len_i + j`` and attends to key positions 0..position.
    See ``paged_attention`` in the package for the argument shapes.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
    """
    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k,
                    cu_seqlens_q, max_seqlen_q)
    return _ragged(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                   max_seqlen_q, max_seqlen_k)


def _ragged(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
            scale: float, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    num_tokens = query.shape[0]
    num_seqs = seq_lens.shape[0]
    device = query.device
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens,
                                        output_size=num_tokens)
    token_row = torch.arange(num_tokens, device=device) - cu[token_seq]
    is_decode = q_lens == 1
    num_decodes = int(is_decode.sum())
    if num_decodes == 0 or num_decodes == num_seqs or max_seqlen_q == 1:
        return _prefill(query, key_cache, value_cache, block_tables, seq_lens, q_lens,
                        token_seq, token_row, scale, max_seqlen_q, max_seqlen_k)

    # Mixed batch: the decodes go through the decode path, the rest is padded only to the
    # longest of the rest. The data-dependent maxima cost a sync, which only matters to the
    # CUDA callers of this function (tests), not to the CPU path.
    out = torch.empty_like(query)
    dec_seqs = is_decode.nonzero().squeeze(1)
    dec_tokens = cu[dec_seqs]
    dec_max_k = int(seq_lens[dec_seqs].max())
    out[dec_tokens] = _decode(query[dec_tokens], key_cache, value_cache,
                              block_tables[dec_seqs], seq_lens[dec_seqs], scale, dec_max_k)
    pre_seqs = (~is_decode).nonzero().squeeze(1)
    pre_tokens = (~is_decode[token_seq]).nonzero().squeeze(1)
    local_seq = torch.cumsum(~is_decode, 0) - 1  # batch index -> index among the rest
    pre_max_k = int(seq_lens[pre_seqs].max())
    out[pre_tokens] = _prefill(query[pre_tokens], key_cache, value_cache,
                               block_tables[pre_seqs], seq_lens[pre_seqs], q_lens[pre_seqs],
                               local_seq[token_seq[pre_tokens]], token_row[pre_tokens], scale,
                               max_seqlen_q, pre_max_k)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_seqlen_q: int,
                    max_seqlen_k: int) -> torch.Tensor:
    """Torch twin of the unified entry point: decode when every sequence has one query
    row, else the ragged prefill path. Argument shapes as in the package's
    ``paged_attention``.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
    """
    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k,
                    cu_seqlens_q, max_seqlen_q)
    if max_seqlen_q == 1 and query.shape[0] == seq_lens.shape[0]:
        return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                       max_seqlen_k)
    return _ragged(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                   max_seqlen_q, max_seqlen_k)
