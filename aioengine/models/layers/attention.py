"""Attention over the paged KV cache, with sliding windows and logit soft-capping.

The forward pass runs one flat, ragged batch: every scheduled request's new tokens
are concatenated into ``[num_tokens]``, and attention follows each request's block
table (PagedAttention, Kwon et al. 2023, §4.1). K/V of the new tokens are written into
the cache slots of ``slot_mapping`` first, then attention reads the cache, so
prefills, prefill chunks, prefix-cache hits and decodes all take the same path.

Plain causal attention runs ``triton_kernels.paged_attention`` (Triton on CUDA, the
planned torch/C++ path on CPU). A layer with a sliding window (Mistral, Gemma 2/3
local layers, Qwen2 where ``use_sliding_window``) or attention-logit soft-capping
(Gemma 2) runs ``windowed_paged_attention`` below, torch on any device: it gathers
only each sequence's last ``window + num_new_tokens - 1`` positions from its block
table, so a sliding-window layer never reads a block that left its window. Blocks
that left every layer's window are not freed: the block manager keeps a sequence's
whole block table (the global layers of Gemma need it anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton_kernels


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch lives in the paged cache.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot (block_id * block_size + offset).
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 offsets of each request's new tokens.
        seq_lens: ``[num_seqs]`` int32 context length including the new tokens.
        max_seqlen_q, max_seqlen_k: host-side maxima of the two.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def windowed_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, attn: AttentionMetadata, scale: float,
                             sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Causal attention where query position ``p`` sees keys ``p - window < k <= p``.

    The window is HF transformers' (``sliding_window`` keys including the query's own
    position, the mask of ``masking_utils.sliding_window_overlay``). Soft-capping is
    Gemma 2's (Gemma Team 2024, §2): ``softcap * tanh(scores / softcap)`` on the scaled
    logits, before the mask. Softmax in fp32.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            already holding this step's K/V.
        sliding_window: keys per query (None: the whole context).
        softcap: None for none.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    _num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = key_cache.view(-1, num_kv_heads, head_dim)
    values = value_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    cu = attn.cu_seqlens_q.tolist()
    seq_lens = attn.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        q0, q1 = cu[i], cu[i + 1]
        n_q = q1 - q0
        if n_q == 0:
            continue
        first_q = seq_len - n_q
        start = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
        pos = torch.arange(start, seq_len, device=query.device)
        blocks = attn.block_tables[i].to(query.device)[pos // block_size].long()
        slots = blocks * block_size + pos % block_size
        k, v = keys[slots], values[slots]                    # [n_k, kv_heads, head_dim]
        q = query[q0:q1].reshape(n_q, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q.float(), k.float()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(first_q, seq_len, device=query.device)[:, None]
        allowed = pos[None, :] <= q_pos
        if sliding_window is not None:
            allowed &= pos[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v.float())
        out[q0:q1] = o.reshape(n_q, num_heads, head_dim).to(query.dtype)
    return out


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, attn: AttentionMetadata,
                    plan: triton_kernels.AttentionPlan | None, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None
                    ) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: this layer's ``[num_blocks, block_size, num_kv_heads,
            head_dim]``.
        plan: ``triton_kernels.plan_attention`` of the step (shared by all layers).
        sliding_window: None, or keys per query; a window at least as long as every
            context in the step is plain causal attention.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, attn.slot_mapping,
                                     plan=plan)
    if sliding_window is not None and sliding_window >= attn.max_seqlen_k:
        sliding_window = None
    if sliding_window is None and softcap is None:
        return triton_kernels.paged_attention(
            query, key_cache, value_cache, attn.block_tables, attn.cu_seqlens_q, attn.seq_lens,
            scale, attn.max_seqlen_q, attn.max_seqlen_k, plan=plan)
    return windowed_paged_attention(query, key_cache, value_cache, attn, scale, sliding_window,
                                    softcap)
