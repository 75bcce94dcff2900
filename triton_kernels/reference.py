"""Torch implementations of the paged KV-cache kernels: the CPU path and the test oracle.

Each function here is the twin of a Triton kernel (``cache_ops.py``,
``paged_attention_triton.py``) and is what the engine runs on CPU tensors, so it is
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

The per-call plan (gather indices, masks, the decode/prefill split) and its execution
come from ``attention_plan.py``, which also holds the once-per-step planned path the
engine runs; the entry points here plan afresh on every call (imported lazily: that
module imports this one's gather and SDPA helpers).

Cache requirement: slots past a sequence's length are read (then masked) by the
gather, so the cache must never hold NaN or Inf (allocate it with ``torch.zeros``);
a masked NaN would still poison the softmax-weighted sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._validation import FP8_DTYPES, check_attention, check_cache_write

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
    num_blocks, block_size = key_cache.shape[:2]
    slots, written = _valid_slots(slot_mapping.long(), num_blocks * block_size)
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        _write_slots(key, value, key_cache, value_cache, slots, written)
        return
    if written is not None:
        key, value = key[written], value[written]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    key_cache[block_ids, offsets] = key
    value_cache[block_ids, offsets] = value


def _valid_slots(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(slots >= 0, indices of those tokens or None when all are)``; one ``aminmax``.

    Raises:
        IndexError: for a slot past the end of the cache.
    """
    if slots.numel() == 0:
        return slots, None
    lo, hi = (int(x) for x in torch.aminmax(slots))
    if hi >= num_slots:
        raise IndexError(f"slot {hi} is past the end of the cache ({num_slots} slots)")
    if lo >= 0:
        return slots, None
    # Padding tokens (slot -1) are rare: filter only when present.
    written = (slots >= 0).nonzero().squeeze(1)
    return slots[written], written


def _write_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor,
                 written: torch.Tensor | None) -> None:
    """One ``index_copy_`` per contiguous cache on its ``[num_slots, heads, dim]`` view:
    a fifth of the time of a two-index put (block, offset)."""
    if written is not None:
        key, value = key[written], value[written]
    if slots.numel() == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_slots = num_blocks * block_size
    # A narrower cache (--kv-cache-dtype) stores K/V rounded to its dtype. torch has no
    # index_copy_ of fp8 on the CPU: an fp8 cache is written through its bytes.
    for x, cache in ((key, key_cache), (value, value_cache)):
        rows = to_kv_cache_dtype(x, cache.dtype)
        if cache.dtype in FP8_DTYPES:
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slots, rows)


def to_kv_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the KV cache stores it in ``dtype``: ``x.to(dtype)`` (round to nearest
    even), and for the fp8 caches (OFP8 E4M3 / E5M2, ``--kv-cache-dtype fp8`` /
    ``fp8_e5m2``) saturated at the largest finite value, +-448 / +-57344, infinities
    included (vLLM's saturating fp8 writes; NaN stays NaN). The torch twin of
    ``csrc/fp8.h``'s ``store_row``; same shape."""
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)  # NaN passes through clamp
    return x.to(dtype)


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, max_seqlen_k: int,
               slot: int) -> torch.Tensor:
    """``[num_seqs, max_seqlen_k, num_kv_heads, head_dim]`` view of each sequence's cached
    tokens, in order, from ``block_ids`` (``[num_seqs * blocks_per_seq]``, already clamped
    into the cache). Past a sequence's length it holds whatever its blocks hold."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    out = _buffer(slot, (block_ids.shape[0], block_size, num_kv_heads, head_dim), cache.dtype,
                  cache.device)
    torch.index_select(cache, 0, block_ids, out=out)
    return out.view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_seqlen_k]


def _gather_ids(block_tables: torch.Tensor, max_seqlen_k: int, num_blocks: int,
                block_size: int) -> torch.Tensor:
    """The block ids ``_gather_kv`` reads: each row's first ``ceil(max_seqlen_k /
    block_size)`` entries, flattened. Padding entries of a block table are arbitrary;
    clamping makes them index a real block (whose tokens are then masked out)."""
    blocks_per_seq = -(-max_seqlen_k // block_size)
    return block_tables[:, :blocks_per_seq].clamp(0, num_blocks - 1).reshape(-1)


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
    from .attention_plan import _decode, _plan_decode

    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k)
    num_blocks, block_size = key_cache.shape[:2]
    plan = _plan_decode(block_tables, seq_lens, max_seqlen_k, num_blocks, block_size)
    return _decode(query, key_cache, value_cache, plan, scale)


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
    from .attention_plan import _plan, _run

    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k,
                    cu_seqlens_q, max_seqlen_q)
    num_blocks, block_size = key_cache.shape[:2]
    plan = _plan(block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                 query.shape[0], num_blocks, block_size, force_prefill=True)
    return _run(query, key_cache, value_cache, plan, scale)


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
    from .attention_plan import _plan, _run

    check_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seqlen_k,
                    cu_seqlens_q, max_seqlen_q)
    num_blocks, block_size = key_cache.shape[:2]
    plan = _plan(block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                 query.shape[0], num_blocks, block_size)
    return _run(query, key_cache, value_cache, plan, scale)


# -- the model's element-wise ops (torch forms; cpu_ops has the fused C++ twins) -------------


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight`` as HF's
    ``LlamaRMSNorm`` computes it (normalised in fp32, cast back before the weight).

    Args:
        x, residual: ``[num_tokens, hidden]``, same dtype.
        weight: ``[hidden]``.
    """
    residual.add_(x)
    if residual.dtype == torch.float32:
        x.copy_(F.rms_norm(residual, (residual.shape[-1],), weight, eps))
        return
    h = residual.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    x.copy_(weight * h.to(residual.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2 * d]`` (SwiGLU, Shazeer 2020)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole KV blocks, every layer and both K and V, in place (torch twin of the C++
    and Triton ``copy_blocks``; vLLM's cache kernel of that name, used for copy-on-write,
    PagedAttention §4.4).

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (any
            trailing block shape).
        block_mapping: ``[num_pairs, 2]`` int64 ``(src, dst)`` block ids; destinations
            distinct and never a source in the same call.

    Raises:
        ValueError: on a malformed cache or mapping.
        IndexError: for a block id outside the cache.
    """
    from ._validation import check_copy_blocks

    check_copy_blocks(kv_cache, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    num_blocks = kv_cache.shape[2]
    if int(block_mapping.min()) < 0 or int(block_mapping.max()) >= num_blocks:
        raise IndexError(f"block id outside the cache's {num_blocks} blocks")
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    # Advanced indexing gathers every source before any destination is written.
    kv_cache[:, :, dst] = kv_cache[:, :, src]


# -- sampling (torch twin of csrc/sampling.cpp) ----------------------------------------------


def sample_from_logits(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits[rows]``: temperature, the min-p, top-k and top-p
    (Holtzman et al. 2020, §3.1) filters as thresholds on the unnormalised probabilities,
    then inverse transform sampling (Devroye 1986, §2.1) with one uniform per row, over
    the kept tokens in vocabulary order. The same rule as the C++ kernel (its header says
    it in full); this one sorts each filtered row whole, so it is the slow path (and the
    one a GPU runs).

    Args:
        logits: ``[num_rows, vocab]`` fp32.
        rows: ``[n]`` int64, the rows to sample.
        temperature, top_p, min_p: ``[n]`` fp32 (temperature > 0; top_p 1 and min_p 0 are
            off).
        top_k: ``[n]`` int64 (0 is off).
        uniforms: ``[n]`` fp64 in ``[0, 1)``.

    Returns:
        ``[n]`` int64 token ids, on ``logits``' device.
    """
    device = logits.device
    x = logits[rows.to(device)].float()
    n, vocab = x.shape
    m = x.max(-1, keepdim=True).values
    e = ((x - m) / temperature.to(device).unsqueeze(1)).exp()
    # The kept set of a row is {e >= t}; the largest token (e == 1) always passes.
    t = torch.full((n, 1), torch.finfo(torch.float32).smallest_normal, device=device)
    t = torch.maximum(t, min_p.to(device).clamp(max=1.0).unsqueeze(1))
    k = top_k.to(device)
    k_rows = torch.nonzero((k > 0) & (k < vocab)).squeeze(1)
    if k_rows.numel():
        kept = torch.where(e[k_rows] >= t[k_rows], e[k_rows], 0.0)
        kth = kept.topk(int(k[k_rows].max()), dim=-1).values.gather(1, (k[k_rows] - 1)[:, None])
        t[k_rows] = torch.maximum(t[k_rows], kth)
    p = top_p.to(device)
    p_rows = torch.nonzero(p < 1.0).squeeze(1)
    if p_rows.numel():
        kept = torch.where(e[p_rows] >= t[p_rows], e[p_rows], 0.0)
        desc = kept.sort(dim=-1, descending=True).values
        cum = desc.double().cumsum(-1)
        goal = p[p_rows].double().unsqueeze(1) * cum[:, -1:]
        cut = (cum < goal).sum(-1, keepdim=True).clamp(max=vocab - 1)
        t[p_rows] = torch.maximum(t[p_rows], desc.gather(1, cut))
    cdf = torch.where(e >= t, e, 0.0).double().cumsum(-1)
    target = uniforms.to(device).double().unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=vocab - 1)
