"""Physical KV blocks, their LRU free queue and the prefix-cache hash map.

Source: PagedAttention (Kwon et al., SOSP 2023, §4.2-4.4) for blocks and
block tables; vLLM v1's prefix caching design for hash-chained full blocks
kept reusable in the free queue until evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

BlockHash = bytes
# Every chain starts from this fixed root, so equal token prefixes hash equally
# in every process and every run.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"aioengine/root").digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int],
                      extra_keys: tuple[object, ...] = ()) -> BlockHash:
    """Hash of one full block: SHA-256(parent, token ids, extra keys), 256 bits.

    Args:
        parent_hash: hash of the previous block (``ROOT_BLOCK_HASH`` for the first).
        token_ids: exactly ``block_size`` token ids.
        extra_keys: anything else that changes the block's K/V or its
            visibility (a tenant's ``cache_salt``).
    """
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, start_block: int,
                        parent_hash: BlockHash, extra_keys: tuple[object, ...] = ()
                        ) -> list[BlockHash]:
    """Chained hashes of full blocks ``start_block..`` of ``token_ids``."""
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        parent_hash = hash_block_tokens(
            parent_hash, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes


class KVCacheBlock:
    """Metadata of one physical KV block (the data lives in the worker).

    Attributes:
        block_id: index into the KV cache tensor's block dimension.
        ref_cnt: block tables that hold this block.
        block_hash: set while the block is full and registered in the cache.
        prev_free_block, next_free_block: links of the free queue.
    """

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list through the blocks: O(1) pop from the front,
    append at the back and removal from the middle.

    The front is the next block to evict (least recently freed); a cached
    block that gets a hit is removed from the middle.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block.

        Raises:
            ValueError: the queue is empty.
        """
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free_block
        assert first is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def block_ids(self) -> list[int]:
        """Front-to-back block ids (tests and debugging)."""
        ids, block = [], self._head.next_free_block
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free_block
        return ids


class BlockPool:
    """All KV blocks, the free queue and the ``block_hash -> block`` map.

    Args:
        num_blocks: blocks in the KV cache tensor.
        enable_caching: keep full blocks findable by hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one block table (forks, prefix-cache hits)."""
        return sum(1 for b in self.blocks if b.ref_cnt > 1)

    def share(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more reference on blocks already in use (a fork).

        Raises:
            ValueError: a block is free (nothing holds it to share).
        """
        blocks = list(blocks)
        if any(b.ref_cnt < 1 for b in blocks):
            raise ValueError("only blocks in use can be shared")
        for block in blocks:
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the free queue front, evicting cached ones.

        Raises:
            ValueError: fewer free blocks than asked (nothing is changed).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a block that just became full; the first writer of a hash wins.

        A later block with the same contents (two requests computed the same
        prefix in one step, or a request recomputed a block it had as its last
        token) stays unhashed: nothing can find it, so once freed it goes to
        the front of the free queue instead of pushing findable blocks out.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching 0 go to the queue's back
        in the given order (callers pass a request's blocks tail first, so a
        prefix outlives its suffix)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Uncached blocks hold nothing reusable: evict them first.
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: its K/V were never written (the step that was
        to write them did not run for its request), so no request may hit it."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Returns False (and does nothing) while any
        block is in use, as vLLM does."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
