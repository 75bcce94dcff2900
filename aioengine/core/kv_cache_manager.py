"""Per-request block tables over the shared ``BlockPool``, with prefix caching.

The scheduler talks to this class only: ``get_computed_blocks`` finds the
longest cached prefix, ``allocate_slots`` reserves blocks for new tokens (or
changes nothing and returns None), ``free`` returns a request's blocks.
"""

from __future__ import annotations

from aioengine.core.block_pool import (
    ROOT_BLOCK_HASH,
    BlockPool,
    KVCacheBlock,
    hash_request_blocks,
)
from aioengine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of all live requests.

    Args:
        num_blocks: blocks in the KV cache (reported by the worker).
        block_size: tokens per block.
        enable_caching: automatic prefix caching on or off.

    Attributes:
        req_to_blocks: request id -> its block table (``KVCacheBlock`` list).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up and
            found in the cache (cumulative).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        extra = (request.cache_salt,) if request.cache_salt else ()
        hashes.extend(hash_request_blocks(request.all_token_ids, self.block_size, len(hashes),
                                          parent, extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request.

        At least the last token is always left to compute, since its logits
        are needed. Counts the lookup in ``prefix_cache_queries/hits``.

        Returns:
            (blocks, num_computed_tokens) where num_computed_tokens =
            len(blocks) * block_size.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Reserve blocks so ``num_new_tokens`` more tokens fit.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are
                already in its blocks.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: prefix-cache hits to take into the block table
                first (only for a request without blocks).

        Returns:
            The newly allocated blocks (possibly empty), or None when the free
            blocks do not suffice; then nothing at all has changed.
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Hits that sit in the free queue stop being free once taken.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            return None
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (its prefix stays cached longest)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
