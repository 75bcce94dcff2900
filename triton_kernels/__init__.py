"""Paged KV-cache attention for aioengine: Triton kernels on CUDA, torch on CPU.

The model calls only the functions below. Each dispatches on the device of its
tensors: CUDA tensors go to the Triton kernels (``cache_ops.py``,
``paged_attention_triton.py``), anything else to the torch implementation in
``reference.py`` (with a step planned once for every layer: ``attention_plan.py``).
Triton is imported on the first CUDA call, so the CPU path works where Triton is
missing or broken.

This package imports nothing from ``aioengine``: it needs only torch (and Triton
for CUDA). OpenAI ships an unrelated package also named ``triton_kernels``; the
two must not be installed in one environment.

Layout the functions share:

- ``key_cache``, ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
  each (``kv_cache[layer, 0]`` and ``kv_cache[layer, 1]``); head_dim stride 1.
  Allocate the cache with ``torch.zeros``: the CPU path reads, then masks, unused slots,
  and a NaN there would leak through the masked softmax.
- ``block_tables``: ``[num_seqs, max_num_blocks_per_seq]`` int32; padding entries are
  arbitrary and never used.
- ``cu_seqlens_q``: ``[num_seqs + 1]`` int32; ``seq_lens``: ``[num_seqs]`` int32 context
  lengths including this step's tokens (whose K/V ``reshape_and_cache`` has written).
- ``max_seqlen_q``, ``max_seqlen_k``: the exact maxima as Python ints, so launching
  a kernel never waits on the GPU.
"""

from __future__ import annotations

import torch

from . import attention_plan, reference
from ._validation import FP8_DTYPES

__all__ = [
    "AttentionPlan",
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "plan_attention",
    "reshape_and_cache",
    "silu_and_mul",
]

AttentionPlan = attention_plan.AttentionPlan


def plan_attention(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, key_cache: torch.Tensor) -> AttentionPlan | None:
    """One step's metadata checked and its index math done once, for every layer's
    ``reshape_and_cache`` and ``paged_attention`` (pass it as ``plan=``).

    On CPU this is where the gather indices, masks and the split of a mixed batch are
    computed (the way vLLM's attention backends build per-step metadata); the per-layer
    calls then only gather and run SDPA. The Triton kernels compute their indices
    in-kernel, so on CUDA it returns None and the calls take their usual path.

    Args:
        slot_mapping, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k: as
            in ``reshape_and_cache`` and ``paged_attention``.
        key_cache: any one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``
            cache (for its geometry and device).

    Raises:
        ValueError: on malformed metadata.
        IndexError: for a slot past the end of the cache.
    """
    if key_cache.is_cuda:
        return None
    num_blocks, block_size = key_cache.shape[:2]
    return attention_plan.plan_attention(slot_mapping, block_tables, cu_seqlens_q, seq_lens,
                                         max_seqlen_q, max_seqlen_k, num_blocks, block_size)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      plan: AttentionPlan | None = None) -> None:
    """Write this step's K/V into the paged cache, in place (PagedAttention, Kwon et al. 2023,
    §4.1).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype; views
            of a fused QKV projection are fine (head_dim stride 1 on CUDA).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 (int32 accepted); slot = block_id *
            block_size + offset; -1 skips the token.
        plan: this step's ``plan_attention`` (built from the same ``slot_mapping``); on CPU
            the slots were checked there and are not checked again.

    On CPU a cache narrower than fp32 activations (``--kv-cache-dtype``) stores K/V
    rounded to nearest even; an fp8 one (OFP8 E4M3 / E5M2, unscaled) also saturated at
    its largest finite value, written by the C++ kernel (``cpu_ops.reshape_and_cache``)
    or its torch twin (``reference.to_kv_cache_dtype``), bit for bit alike.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or (CUDA) strides.
    """
    if plan is not None and not key_cache.is_cuda:
        if key_cache.dtype in FP8_DTYPES and plan.slots is not None:
            attention_plan._check_plan(plan, key, key_cache, value_cache)
            from . import cpu_ops

            if cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
                return
        attention_plan.reshape_and_cache_planned(key, value, key_cache, value_cache, plan)
        return
    if key_cache.is_cuda:
        from .cache_ops import reshape_and_cache as impl
    else:
        impl = reference.reshape_and_cache
    impl(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_seqlen_q: int,
                    max_seqlen_k: int, plan: AttentionPlan | None = None) -> torch.Tensor:
    """Causal attention of any batch over the paged KV cache.

    One entry for decode, prefill, chunked prefill, prompts with a cached prefix and
    mixed batches. Sequence i owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
    (q_len_i of them); its row j sits at position ``seq_lens[i] - q_len_i + j`` and
    attends to key positions 0..position. Query head h reads KV head
    ``h // (num_heads // num_kv_heads)`` (GQA). Softmax in fp32.

    On CUDA: the decode kernel when ``max_seqlen_q == 1`` and every sequence has one row
    (split-K Flash-Decoding when the batch cannot fill the GPU), else the prefill kernel.
    Elsewhere: the torch reference.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, ragged over sequences.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            the query's dtype (fp16, bf16 or fp32).
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32.
        seq_lens: ``[num_seqs]`` int32, new tokens included.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_seqlen_q, max_seqlen_k: ``max(q_len)``, ``max(seq_lens)`` as Python ints.
        plan: this step's ``plan_attention`` of the same metadata; on CPU the metadata is
            then neither re-checked nor re-indexed.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or (CUDA) strides.
    """
    if plan is not None and not query.is_cuda:
        from . import cpu_ops

        return cpu_ops.paged_attention_planned(query, key_cache, value_cache, plan, scale)
    if not query.is_cuda:
        return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                         cu_seqlens_q, seq_lens, scale, max_seqlen_q,
                                         max_seqlen_k)
    if max_seqlen_q == 1 and query.shape[0] == seq_lens.shape[0]:
        from .paged_attention_triton import paged_attention_decode as decode
        return decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                      max_seqlen_k)
    from .paged_attention_triton import paged_attention_prefill as prefill
    return prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                   max_seqlen_q, max_seqlen_k)


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           max_seqlen_k: int) -> torch.Tensor:
    """Decode-only attention: ``query`` is ``[num_seqs, num_heads, head_dim]``, one new
    token per sequence; other arguments as in ``paged_attention``. Triton on CUDA (split-K
    chosen automatically), torch elsewhere.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or (CUDA) strides.
    """
    if query.is_cuda:
        from .paged_attention_triton import paged_attention_decode as impl
    else:
        impl = reference.paged_attention_decode
    return impl(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seqlen_k)


def paged_attention_prefill(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """``paged_attention`` always through the prefill/extend path (the Triton prefill kernel
    on CUDA, even for decode rows). Same arguments and errors."""
    if query.is_cuda:
        from .paged_attention_triton import paged_attention_prefill as impl
    else:
        impl = reference.paged_attention_prefill
    return impl(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                max_seqlen_q, max_seqlen_k)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight`` (vLLM's fused
    residual add + RMSNorm; RMSNorm, Zhang & Sennrich 2019, normalised in fp32 as HF's
    ``LlamaRMSNorm``). One C++ pass on CPU (``cpu_ops``), torch ops elsewhere.

    Args:
        x, residual: ``[num_tokens, hidden]``, same dtype; both are overwritten.
        weight: ``[hidden]``.
    """
    if x.is_cuda:
        reference.fused_add_rms_norm(x, residual, weight, eps)
        return
    from . import cpu_ops

    cpu_ops.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): ``[num_tokens, 2 * d]`` -> ``silu(x[:, :d]) * x[:, d:]``,
    ``[num_tokens, d]``. One C++ pass on CPU (``cpu_ops``), torch ops elsewhere."""
    if x.is_cuda:
        return reference.silu_and_mul(x)
    from . import cpu_ops

    return cpu_ops.silu_and_mul(x)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole KV blocks, every layer and K and V at once, in place: the worker's half of
    copy-on-write (PagedAttention, Kwon et al. 2023, §4.4; vLLM's ``copy_blocks``).

    Triton on CUDA (``block_copy.py``), the C++ kernel on CPU (``csrc/copy_blocks.cpp``),
    the torch twin (``reference.copy_blocks``) where the C++ kernels are unavailable.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, each
            block contiguous.
        block_mapping: ``[num_pairs, 2]`` int64 ``(src, dst)`` block ids on the cache's
            device; destinations distinct and never a source in the same call.

    Raises:
        ValueError: on a malformed cache or mapping.
        IndexError (torch twin), RuntimeError (C++): a block id outside the cache.
    """
    if kv_cache.is_cuda:
        from .block_copy import copy_blocks as impl

        impl(kv_cache, block_mapping)
        return
    from . import cpu_ops

    ops = cpu_ops.load()
    if ops is None or not kv_cache[0, 0, 0].is_contiguous() or not hasattr(ops, "copy_blocks"):
        reference.copy_blocks(kv_cache, block_mapping)
        return
    from ._validation import check_copy_blocks

    check_copy_blocks(kv_cache, block_mapping)
    ops.copy_blocks(kv_cache, block_mapping.contiguous())
