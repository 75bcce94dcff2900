"""Argument checks shared by the torch reference and the Triton host wrappers.

Every check reads only shapes, dtypes, devices and the host-side ints, never tensor
contents, so it costs a few microseconds and never synchronises with a GPU.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The 8-bit KV caches (``--kv-cache-dtype fp8`` / ``fp8_e5m2``; OFP8 E4M3 and E5M2).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Return the common device of ``tensors``; ValueError if they differ."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return first


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {_shape(t)}")


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """key_cache / value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same
    shape and float dtype."""
    if key_cache.ndim != 4:
        raise ValueError("key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {_shape(key_cache)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {_shape(value_cache)} differs from key_cache "
                         f"shape {_shape(key_cache)}")
    if key_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"key_cache dtype must be float16, bfloat16, float32, float8_e4m3fn "
                         f"or float8_e5m2, got {key_cache.dtype}")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype "
                         f"{key_cache.dtype}")


def check_cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Arguments of ``reshape_and_cache``; raises ValueError on any mismatch."""
    check_kv_cache(key_cache, value_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.ndim != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match "
                             f"the cache, got shape {_shape(t)}")
        if t.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the cache dtype "
                             f"{key_cache.dtype}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{key.shape[0]} tokens")
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping)


def check_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_k: int,
                   block_size: int, cu_seqlens_q: torch.Tensor | None = None,
                   max_seqlen_q: int | None = None, num_tokens: int | None = None) -> None:
    """A step's attention metadata on its own; decode when ``cu_seqlens_q`` is None.

    Raises:
        ValueError: on a wrong rank or dtype, a row count that does not match, or maxima
            the block table cannot hold.
    """
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} "
                         "sequences")
    if not 1 <= max_seqlen_k <= block_tables.shape[1] * block_size:
        raise ValueError(f"max_seqlen_k={max_seqlen_k} must be in [1, "
                         f"{block_tables.shape[1] * block_size}] (block_tables has "
                         f"{block_tables.shape[1]} columns of {block_size} tokens)")
    if cu_seqlens_q is None:
        if num_tokens is not None and num_tokens != num_seqs:
            raise ValueError(f"decode takes one query per sequence: query has {num_tokens} rows "
                             f"for {num_seqs} sequences")
        return
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, "
                         f"got {cu_seqlens_q.shape[0]}")
    if max_seqlen_q is None or not 1 <= max_seqlen_q <= max(num_tokens or 0, 1):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} must be in [1, num_tokens={num_tokens}]")
    if max_seqlen_q > max_seqlen_k:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} exceeds max_seqlen_k={max_seqlen_k}: "
                         "seq_lens include the new query tokens")
    check_same_device(block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)


def check_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_k: int,
                    cu_seqlens_q: torch.Tensor | None = None,
                    max_seqlen_q: int | None = None) -> None:
    """Arguments of the attention entry points; decode when ``cu_seqlens_q`` is None.

    Raises:
        ValueError: on a wrong rank, shape, dtype or device, a head count that is not a
            multiple of the KV head count, or maxima the block table cannot hold.
    """
    check_kv_cache(key_cache, value_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if query.ndim != 3:
        raise ValueError("query must be [num_tokens, num_heads, head_dim], "
                         f"got shape {_shape(query)}")
    num_tokens, num_heads, q_head_dim = query.shape
    if q_head_dim != head_dim:
        raise ValueError(f"query head_dim {q_head_dim} differs from the cache head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache dtype "
                         f"{key_cache.dtype}")
    check_metadata(block_tables, seq_lens, max_seqlen_k, block_size, cu_seqlens_q, max_seqlen_q,
                   num_tokens)
    if cu_seqlens_q is None:
        check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                          block_tables=block_tables, seq_lens=seq_lens)
    else:
        check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                          block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                          seq_lens=seq_lens)


def check_copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``kv_cache`` ``[num_layers, 2, num_blocks, ...]`` of a float dtype and
    ``block_mapping`` ``[num_pairs, 2]`` int64 on the same device; ValueError otherwise.
    Block ids are checked by the kernels (they are tensor contents)."""
    if kv_cache.dim() < 4 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must be [num_layers, 2, num_blocks, ...], got "
                         f"{_shape(kv_cache)}")
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache must be fp16, bf16, fp32 or fp8, got {kv_cache.dtype}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got {_shape(block_mapping)}")
    if block_mapping.dtype != torch.int64:
        raise ValueError(f"block_mapping must be int64, got {block_mapping.dtype}")
    check_same_device(kv_cache=kv_cache, block_mapping=block_mapping)
