"""Triton attention over the paged KV cache: decode, split-K decode and prefill/extend.

Keys and values live in fixed-size blocks found through a per-sequence block
table (PagedAttention, Kwon et al. 2023, §4). Every kernel walks a sequence's
context in tiles of ``BLOCK_N`` tokens, looks up each token's physical block,
and keeps the online-softmax state ``m_i`` (running max), ``l_i`` (running sum)
and ``acc`` (unnormalised output) of FlashAttention-2 (Dao 2023, Algorithm 1),
in the base-2 form of the Triton fused-attention tutorial.

- ``_paged_attention_decode_kernel``: one new token per sequence; one program per
  (sequence, KV head) serves all query heads of the group, so each K/V tile is read once.
- ``_paged_attention_decode_split_kernel`` + ``_paged_attention_decode_reduce_kernel``:
  Flash-Decoding (Dao, Haziza, Massa, Sizov 2023): the context is split into
  partitions handled by separate programs, each writing a normalised partial output
  and its log-sum-exp, then merged. Used when (sequences x KV heads) is too few
  programs to fill the GPU.
- ``_paged_attention_prefill_kernel``: ragged query rows (``cu_seqlens_q``) with causal
  masking relative to the cached prefix: row j of a sequence with q_len new tokens
  and seq_len tokens in total sits at position seq_len - q_len + j.

Torch twins: ``reference.paged_attention_decode`` / ``reference.paged_attention_prefill``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._validation import check_attention

RCP_LN2 = 1.4426950408889634  # 1 / ln(2): exp(x) == exp2(x * RCP_LN2)


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, q_pos,
    k_cache_ptr, v_cache_ptr, block_table_ptr,
    start_n, end_n, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, stride_btb,
    offs_d, mask_d,
    IS_CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold key tokens [start_n, end_n) of one sequence and KV head into (acc, l_i, m_i).

    q: [BLOCK_M, HEAD_DIM]; q_pos: [BLOCK_M] absolute positions (used when IS_CAUSAL);
    k_cache_ptr / v_cache_ptr already point at the KV head; block_table_ptr at the
    sequence's block-table row.
    """
    for tile_start in range(start_n, end_n, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end_n
        # Token -> physical block; tokens past end_n never read the block table.
        block_ids = tl.load(block_table_ptr + (offs_n // BLOCK_SIZE) * stride_btb,
                            mask=mask_n, other=0).to(tl.int64)
        offs_in_block = offs_n % BLOCK_SIZE
        mask_kv = mask_n[None, :] & mask_d[:, None]
        k = tl.load(k_cache_ptr + (block_ids * stride_kb + offs_in_block * stride_kt)[None, :]
                    + offs_d[:, None], mask=mask_kv, other=0.0)  # [HEAD_DIM, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if IS_CAUSAL:
            keep = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        else:
            keep = mask_n[None, :]
        qk = tl.where(keep, qk, float("-inf"))
        # Every tile has a visible key for every row (tiles start at key 0 or inside
        # the visible range), so m_ij is finite and exp2(-inf - m_ij) is 0.
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (block_ids * stride_vb + offs_in_block * stride_vt)[:, None]
                    + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],
                    other=0.0)  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bts, stride_btb,
    head_dim,
    QUERY_GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid: (num_seqs, num_kv_heads). Rows of the tile are the group's query heads.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < QUERY_GROUP_SIZE
    mask_d = offs_d < head_dim
    heads = kv_head * QUERY_GROUP_SIZE + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, offs_g,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        block_tables_ptr + seq * stride_bts,
        0, seq_len, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt, stride_btb,
        offs_d, mask_d,
        False, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )
    acc = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _paged_attention_decode_split_kernel(
    mid_o_ptr, mid_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale, partition_size,
    stride_qs, stride_qh,
    stride_mos, stride_moh, stride_mop, stride_mls, stride_mlh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bts, stride_btb,
    head_dim,
    QUERY_GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid: (num_seqs, num_kv_heads, num_splits). Split p covers key tokens
    # [p * partition_size, (p + 1) * partition_size) of the sequence.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start_n = split * partition_size
    if start_n >= seq_len:  # the reduce kernel ignores this split
        return
    end_n = tl.minimum(start_n + partition_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < QUERY_GROUP_SIZE
    mask_d = offs_d < head_dim
    heads = kv_head * QUERY_GROUP_SIZE + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, offs_g,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        block_tables_ptr + seq * stride_bts,
        start_n, end_n, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt, stride_btb,
        offs_d, mask_d,
        False, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )
    # Normalised partial output and its log2-sum-exp2 (in the scaled, base-2 domain).
    acc = acc / l_i[:, None]
    lse = m_i + tl.math.log2(l_i)
    mask_gd = mask_g[:, None] & mask_d[None, :]
    tl.store(mid_o_ptr + seq * stride_mos + heads[:, None] * stride_moh + split * stride_mop
             + offs_d[None, :], acc, mask=mask_gd)
    tl.store(mid_lse_ptr + seq * stride_mls + heads * stride_mlh + split, lse, mask=mask_g)


@triton.jit
def _paged_attention_decode_reduce_kernel(
    out_ptr, mid_o_ptr, mid_lse_ptr, seq_lens_ptr, partition_size,
    stride_os, stride_oh,
    stride_mos, stride_moh, stride_mop, stride_mls, stride_mlh,
    head_dim,
    BLOCK_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # Grid: (num_seqs, num_heads). out = sum_p w_p * o_p / sum_p w_p, w_p = 2^(lse_p - max).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_splits = tl.cdiv(seq_len, partition_size)  # splits that wrote a result

    offs_p = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_p = offs_p < num_splits
    mask_d = offs_d < head_dim
    lse = tl.load(mid_lse_ptr + seq * stride_mls + head * stride_mlh + offs_p, mask=mask_p,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    w = tl.math.exp2(lse - lse_max)
    o = tl.load(mid_o_ptr + seq * stride_mos + head * stride_moh + offs_p[:, None] * stride_mop
                + offs_d[None, :], mask=mask_p[:, None] & mask_d[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d,
             acc.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _paged_attention_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bts, stride_btb,
    head_dim,
    QUERY_GROUP_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid: (cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads); tiles past a sequence's
    # q_len exit at once.
    start_m = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_q_ptr + seq + 1) - q_start).to(tl.int32)
    if start_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # tokens cached before this step's rows
    kv_head = head // QUERY_GROUP_SIZE

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    rows = q_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Causal: no row of this tile sees past the tile's last position.
    end_n = tl.minimum(seq_len, context_len + (start_m + 1) * BLOCK_M)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, q_pos,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        block_tables_ptr + seq * stride_bts,
        0, end_n, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt, stride_btb,
        offs_d, mask_d,
        True, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )
    acc = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# Kernels built while TRITON_INTERPRET=1 run on CPU tensors in Triton's interpreter.
_INTERPRETED = not isinstance(_paged_attention_decode_kernel, triton.runtime.JITFunction)

# Flash-Decoding partitions are at least this many tokens: shorter ones cost more in
# the reduction than they gain in parallelism.
_MIN_PARTITION_SIZE = 256
_MAX_SPLITS = 64


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on CPU: a small number that still exercises splitting
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_triton(query: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor) -> None:
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in head_dim, got strides {t.stride()}")
    if key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"the Triton attention kernels do not read an fp8 KV cache "
                         f"({key_cache.dtype}); --kv-cache-dtype fp8 runs on the CPU only")
    if query.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"the Triton attention kernels need CUDA tensors, got {query.device}; "
                         "use triton_kernels.paged_attention, which runs the torch reference "
                         "on CPU")


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else None


def _tile_n(head_dim: int) -> int:
    if _INTERPRETED:
        return 16
    return 64 if head_dim <= 128 else 32


def _decode_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int,
                       device: torch.device) -> int:
    """Splits per sequence so that about two programs run per SM (Flash-Decoding)."""
    programs = num_seqs * num_kv_heads
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs),
                 triton.cdiv(max_seqlen_k, _MIN_PARTITION_SIZE), _MAX_SPLITS)
    return max(splits, 1)


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_seqlen_k: int, *,
                           num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (Triton).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, head_dim stride 1.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            query's dtype (fp16, bf16 or fp32), head_dim stride 1.
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32; entries past
            ``cdiv(seq_len, block_size)`` are never read.
        seq_lens: ``[num_seqs]`` int32 context lengths (tokens, >= 1, new token included).
        scale: softmax scale.
        max_seqlen_k: ``max(seq_lens)`` as a Python int; sizes the split-K grid.
        num_splits: force the number of Flash-Decoding partitions (1 = no split);
            by default chosen from the batch size, KV heads and the GPU's SM count.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or strides, or num_splits < 1.
    """
    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    _check_triton(query, key_cache, value_cache)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = _decode_num_splits(num_seqs, num_kv_heads, max_seqlen_k, query.device)
    block_n = _tile_n(head_dim)
    meta = {
        "QUERY_GROUP_SIZE": group,
        "BLOCK_G": max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        "BLOCK_SIZE": block_size,
        "BLOCK_N": block_n,
        "HEAD_DIM": max(16, triton.next_power_of_2(head_dim)),
        "DOT_PRECISION": _dot_precision(query.dtype),
    }
    kv_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                  value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))
    qk_scale = scale * RCP_LN2
    if num_splits == 1:
        _paged_attention_decode_kernel[(num_seqs, num_kv_heads)](
            out, query, key_cache, value_cache, block_tables, seq_lens,
            qk_scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *kv_strides,
            block_tables.stride(0), block_tables.stride(1),
            head_dim,
            **meta,
        )
        return out

    partition_size = triton.cdiv(triton.cdiv(max_seqlen_k, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seqlen_k, partition_size)
    mid_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                        device=query.device)
    mid_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                          device=query.device)
    _paged_attention_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        mid_o, mid_lse, query, key_cache, value_cache, block_tables, seq_lens,
        qk_scale, partition_size,
        query.stride(0), query.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        *kv_strides,
        block_tables.stride(0), block_tables.stride(1),
        head_dim,
        **meta,
    )
    _paged_attention_decode_reduce_kernel[(num_seqs, num_heads)](
        out, mid_o, mid_lse, seq_lens, partition_size,
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        head_dim,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        HEAD_DIM=meta["HEAD_DIM"],
    )
    return out


def paged_attention_prefill(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """Causal attention of ragged query rows over their paged context (Triton).

    Serves any batch: cold prompts, chunked prefill, prompts with a cached prefix and
    decode rows. Row j of sequence i (``cu_seqlens_q[i] + j``) sits at position
    ``seq_lens[i] - q_len_i + j`` and attends to key positions 0..position; the new
    tokens' K/V must already be in the cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, head_dim stride 1.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            query's dtype, head_dim stride 1.
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 row offsets of each sequence's queries.
        seq_lens: ``[num_seqs]`` int32 context lengths, new tokens included.
        scale: softmax scale.
        max_seqlen_q: ``max(q_len)`` as a Python int; sizes the grid.
        max_seqlen_k: ``max(seq_lens)`` as a Python int; checked against the block table.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or strides.
    """
    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k,
                    cu_seqlens_q, max_seqlen_q)
    _check_triton(query, key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if _INTERPRETED:
        block_m, block_n, num_warps = 16, 16, 4
    elif head_dim <= 128:
        block_m, block_n, num_warps = 64, 64, 4
    else:
        block_m, block_n, num_warps = 32, 32, 4
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _paged_attention_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
        scale * RCP_LN2,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        head_dim,
        QUERY_GROUP_SIZE=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=num_warps,
    )
    return out
