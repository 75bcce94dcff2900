"""Triton kernel that writes new tokens' K/V into the paged KV cache.

The block-table indirection of PagedAttention (Kwon et al. 2023, §4.1): each new
token has a precomputed slot, ``block_id * block_size + offset``, and its K and V
rows for every KV head are copied there. Torch twin: ``reference.reshape_and_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validation import check_cache_write


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # One program per token: all of its KV heads at once.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    kc_ptrs = (key_cache_ptr + block_id * stride_kcb + block_offset * stride_kcs
               + offs_h[:, None] * stride_kch + offs_d[None, :])
    vc_ptrs = (value_cache_ptr + block_id * stride_vcb + block_offset * stride_vcs
               + offs_h[:, None] * stride_vch + offs_d[None, :])
    tl.store(kc_ptrs, k, mask=mask)
    tl.store(vc_ptrs, v, mask=mask)


# Kernels built while TRITON_INTERPRET=1 run on CPU tensors in Triton's interpreter.
_INTERPRETED = not isinstance(_reshape_and_cache_kernel, triton.runtime.JITFunction)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V into their cache slots, in place (Triton).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, any
            token/head strides (e.g. views of a fused QKV projection), head_dim stride 1.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            head_dim stride 1 (``kv_cache[layer, 0]`` / ``kv_cache[layer, 1]``).
        slot_mapping: ``[num_tokens]`` int64 (or int32); slot = block_id * block_size +
            offset; -1 skips the token. Slots are not bounds-checked.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices, a head_dim stride other than 1,
            or CPU tensors outside the Triton interpreter.
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in head_dim, got strides "
                             f"{t.stride()}")
    if key.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"the Triton reshape_and_cache needs CUDA tensors, got {key.device}; "
                         "use triton_kernels.reshape_and_cache, which runs the torch "
                         "reference on CPU")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=triton.next_power_of_2(head_dim),
    )
