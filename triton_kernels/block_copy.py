"""Triton kernel that copies whole KV blocks, every layer and K and V, in one launch.

vLLM's ``copy_blocks`` cache kernel: the engine's copy-on-write (PagedAttention, Kwon et
al. 2023, §4.4) gives the writer of a shared block a fresh one and the worker copies
the shared block's contents there before the step's forward. One program per
``(pair, layer, K or V)``, each copying one block in ``BLOCK`` element chunks. Torch twin:
``reference.copy_blocks``; the CPU path is ``csrc/copy_blocks.cpp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validation import check_copy_blocks


@triton.jit
def _copy_blocks_kernel(cache_ptr, mapping_ptr, stride_layer, stride_kv, stride_block,
                        numel_per_block, BLOCK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + (plane // 2) * stride_layer + (plane % 2) * stride_kv
    for start in range(0, numel_per_block, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel_per_block
        x = tl.load(base + src * stride_block + offs, mask=mask)
        tl.store(base + dst * stride_block + offs, x, mask=mask)


_INTERPRETED = not isinstance(_copy_blocks_kernel, triton.runtime.JITFunction)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks ``src -> dst`` for every ``(src, dst)`` row of ``block_mapping``, in place.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, ...block...]`` CUDA tensor, each block's
            elements contiguous (the worker's cache is fully contiguous).
        block_mapping: ``[num_pairs, 2]`` int64 on the cache's device; destinations
            distinct and never a source. Ids are not bounds-checked.

    Raises:
        ValueError: malformed arguments, a non-contiguous block, or CPU tensors outside
            the Triton interpreter.
    """
    check_copy_blocks(kv_cache, block_mapping)
    if kv_cache.device.type != "cuda" and not _INTERPRETED:
        raise ValueError("the Triton copy_blocks needs CUDA tensors; use "
                         "triton_kernels.copy_blocks, which dispatches on the device")
    block = kv_cache[0, 0, 0]
    if not block.is_contiguous():
        raise ValueError("copy_blocks needs each block of kv_cache to be contiguous")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0 or kv_cache.numel() == 0:
        return
    mapping = block_mapping.contiguous()
    numel = block.numel()
    _copy_blocks_kernel[(num_pairs, kv_cache.shape[0] * 2)](
        kv_cache, mapping, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), numel,
        BLOCK=min(4096, triton.next_power_of_2(numel)))
