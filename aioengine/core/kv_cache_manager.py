"""Per-request block tables over the shared ``BlockPool``, with prefix caching.

The scheduler talks to this class only: ``get_computed_blocks`` finds the
longest cached prefix, ``allocate_slots`` reserves blocks for new tokens (or
changes nothing and returns None), ``free`` returns a request's blocks.

How blocks are shared: prefix-cache hits and forks
--------------------------------------------------
A block is registered in the hash map as soon as it is allocated for the
tokens that fill it, before the step that writes its K/V has run (as vLLM v1
does). So a request admitted later in the same step (another request with
the same system prompt) already hits it. That is safe because the model
writes every new token's K/V into the cache before attention reads the
cache, layer by layer (``models/llama.py``), so the sharer reads what the
owner wrote in the same forward pass. A hit covers only full blocks that lie
before the hitting request's first token to compute, so nobody writes such
a block again.

``fork(parent, child)`` (beam search, PagedAttention §4.4) shares more: the
child takes the parent's whole written block table, the partial last block
included, with every reference count raised. The next write into a shared
block is a copy-on-write: ``allocate_slots`` gives the writer a fresh block
in that table slot and records a ``(src, dst)`` pair that the worker copies,
all layers at once, before the step's forward (``take_copy_blocks``). The
last holder of a block writes in place, so two sharers of a partial block
cost one copy. A pending copy keeps a reference on its source until it is
taken, so the source cannot be handed out (and overwritten) in the same
step; a copy whose destination is freed before the step is dropped.

Registering before writing has one consequence: a request freed before its
step ran (preempted later in the same ``schedule()`` call) holds registered
blocks whose K/V were never written. ``free`` forgets those hashes, and
``num_unwritten_shared_blocks`` tells the scheduler when another request has
already hit such a block in this step, so preempting the owner would leave
that request reading K/V nobody writes.
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
        prefix_cache_queries, prefix_cache_hits: tokens looked up in the cache
            and tokens found there, counted once each time a request is
            admitted (its first successful ``allocate_slots``), cumulative.
            A lookup whose allocation fails is not counted, so a request
            that waits for blocks over many steps counts once. Zero while
            caching is off.
        num_cow_copies: blocks copied on write (cumulative; a copy dropped
            because its request was freed before the step is not counted).
        num_forks: ``fork`` calls (cumulative).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_cow_copies = 0
        self.num_forks = 0
        # (src, dst) block copies for the next step; each holds a reference on src.
        self._pending_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # block id -> references held by pending copies (not by any block table):
        # the last table holding such a source writes it in place.
        self._copy_holds: dict[int, int] = {}
        # request id -> [(block table index, new block id)] replaced by copy-on-write.
        self._cow_replaced: dict[str, list[tuple[int, int]]] = {}
        # Blocks taken as prefix-cache hits since the last take_copy_blocks (this step).
        self._hit_block_ids: set[int] = set()

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
        are needed. The lookup is counted in ``prefix_cache_queries/hits``
        only once ``allocate_slots`` admits the request with these blocks.

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
        return blocks, len(blocks) * self.block_size

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
        block_size = self.block_size
        if not new_computed_blocks:
            req_blocks = self.req_to_blocks.get(request.request_id)
            if req_blocks is not None and num_new_tokens > 0:
                num_computed = request.num_computed_tokens
                num_required = -(-(num_computed + num_new_tokens) // block_size)
                first = num_computed // block_size
                if num_required <= len(req_blocks) and (
                    req_blocks[first].ref_cnt == 1
                    if num_required == first + 1
                    else all(b.ref_cnt == 1 for b in req_blocks[first:num_required])
                ):
                    # The common decode step: the tokens fit in blocks the request
                    # alone holds (nothing to allocate or copy; a block referenced
                    # once has no pending copy holding it either).
                    if self.enable_caching:
                        self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
                    return []
        return self._allocate(request, num_new_tokens, new_computed_blocks)

    def _allocate(self, request: Request, num_new_tokens: int,
                  new_computed_blocks: list[KVCacheBlock] | None = None
                  ) -> list[KVCacheBlock] | None:
        """``allocate_slots`` in full: prefix-cache hits, new blocks, copy-on-write."""
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Blocks of the table this step writes into that another request also holds
        # (a fork): each needs a private copy first.
        cow = [] if new_computed_blocks or num_new_tokens <= 0 else [
            i for i in range(num_computed // self.block_size, min(num_required, len(req_blocks)))
            if req_blocks[i].ref_cnt - self._copy_holds.get(req_blocks[i].block_id, 0) > 1]
        # Hits that sit in the free queue stop being free once taken.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(cow) > self.block_pool.num_free_blocks - num_free_hits:
            return None
        if self.enable_caching and request.request_id not in self.req_to_blocks:
            # Admission: count the prefix-cache lookup now that it is used.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        for i in cow:
            src = req_blocks[i]
            (dst,) = self.block_pool.get_new_blocks(1)
            # The table's reference on src moves to the pending copy (released by
            # take_copy_blocks), so src stays allocated until the worker has copied it.
            self._pending_copies.append((src, dst))
            self._copy_holds[src.block_id] = self._copy_holds.get(src.block_id, 0) + 1
            req_blocks[i] = dst
            self._cow_replaced.setdefault(request.request_id, []).append((i, dst.block_id))
            self.num_cow_copies += 1
        self.block_pool.touch(new_computed_blocks)
        self._hit_block_ids.update(b.block_id for b in new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        return new_blocks

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Give ``child`` the parent's written block table, sharing every block.

        The child's first ``num_tokens`` tokens must equal the parent's; the
        child starts with at most that many computed tokens (set
        ``child.num_computed_tokens``). Every shared block's reference count
        goes up by one, the partial last block's too; the first write into a
        shared block copies it (``allocate_slots``). Blocks past those tokens
        are not shared. Allocates nothing, so it cannot fail for lack of
        blocks. Source: PagedAttention (Kwon et al. 2023) §4.4, vLLM v0's
        ``BlockSpaceManager.fork``.

        Args:
            num_tokens: the parent's tokens whose K/V the child takes (default
                ``parent.num_computed_tokens``; more only once the step that
                computes them has run, before its output is applied).

        Raises:
            KeyError: the parent holds no blocks.
            ValueError: the child already holds blocks, or the parent's blocks
                do not cover ``num_tokens``.
        """
        if parent.request_id not in self.req_to_blocks:
            raise KeyError(f"request {parent.request_id!r} holds no blocks")
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        num_written = parent.num_computed_tokens if num_tokens is None else num_tokens
        if cdiv(num_written, self.block_size) > len(self.req_to_blocks[parent.request_id]):
            raise ValueError(f"request {parent.request_id!r} holds fewer than {num_written} "
                             "tokens' blocks")
        blocks = self.req_to_blocks[parent.request_id][:cdiv(num_written, self.block_size)]
        self.block_pool.share(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        num_full = num_written // self.block_size
        child.block_hashes = list(parent.block_hashes[:num_full])
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_full)
        self.num_forks += 1

    def take_copy_blocks(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block-id pairs the worker must copy before the next
        forward (``SchedulerOutput.copy_blocks``), and the sources' references
        released. Call once per step, after the step's allocations; the
        destinations are distinct and never a source in the same list."""
        pairs = [(src.block_id, dst.block_id) for src, dst in self._pending_copies]
        self.block_pool.free_blocks([src for src, _ in self._pending_copies])
        self._pending_copies = []
        self._copy_holds.clear()
        self._hit_block_ids.clear()
        return pairs

    def take_cow_replaced(self, request_id: str) -> list[tuple[int, int]]:
        """``(block table index, new block id)`` of the request's blocks that
        copy-on-write replaced since the last call (the worker's table update)."""
        return self._cow_replaced.pop(request_id, [])

    def num_shared_blocks(self) -> int:
        """Blocks held by more than one request (forks and prefix-cache hits)."""
        return self.block_pool.num_shared_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        # Draft tokens (speculative decoding) are not the request's tokens yet:
        # only blocks full of its own tokens get a hash.
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks, tail first (its prefix stays cached longest).

        Blocks are registered when allocated, before their K/V are written.
        A request freed before the step that writes them has run (preempted
        in the same ``schedule()`` call) passes ``num_valid_tokens``: every
        block it alone holds that is not fully inside those tokens loses its
        hash, so no later request hits K/V that were never written. Blocks
        other requests also hold are left alone (see
        ``num_unwritten_shared_blocks``).

        Args:
            num_valid_tokens: tokens whose K/V are written (the request's
                ``num_computed_tokens`` before this step). None, for a request
                whose steps have all run (finished, aborted between steps or
                while its last step is already with the worker), keeps every
                hash.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._cow_replaced.pop(request.request_id, None)
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size:]:
                if block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
        if self._pending_copies:
            # A copy into a block this request alone held is moot: drop it (and
            # release its source) so the block can be handed out again this step.
            gone = {id(b) for b in blocks if b.ref_cnt == 1}
            moot = [p for p in self._pending_copies if id(p[1]) in gone]
            if moot:
                self._pending_copies = [p for p in self._pending_copies if id(p[1]) not in gone]
                self.block_pool.free_blocks([src for src, _ in moot])
                for src, _ in moot:
                    self._copy_holds[src.block_id] -= 1
                self.num_cow_copies -= len(moot)
        self.block_pool.free_blocks(reversed(blocks))

    def rollback(self, request: Request) -> None:
        """After a speculative step: drop the blocks past
        ``request.num_computed_tokens`` (allocated only for rejected drafts)
        and register the blocks the accepted drafts filled, so the block table
        and hashes are those of a run that never speculated.

        Call once the step's tokens are appended and ``num_computed_tokens``
        has moved back over the rejected drafts. The dropped blocks never had a
        hash (``_cache_full_blocks`` stops at the request's own tokens).
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(blocks) > keep:
            self.block_pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)

    def num_unwritten_shared_blocks(self, request: Request) -> int:
        """Blocks this request is to write in the current step that other
        requests have already taken as prefix-cache hits.

        Such a hit (a concurrent request with the same prefix) relies on this
        request's step writing the K/V. Preempting this request before the
        step runs leaves the other requests reading K/V nobody writes, so the
        scheduler must not pick it as a victim while this is nonzero (or must
        preempt those requests too). Call between ``allocate_slots`` and the
        step; ``request.num_computed_tokens`` must not yet include the step's
        tokens. Only blocks taken as hits since the last ``take_copy_blocks``
        (in this step) count: a block a fork shares was written in an earlier
        step, and preempting one of its sharers leaves the others their K/V.
        Counting those too deadlocked a fork group on a full cache: every
        sharer of the partial last block was spared, none could get its
        copy-on-write block.
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        return sum(1 for block in blocks[request.num_computed_tokens // self.block_size:]
                   if block.ref_cnt > 1 and block.block_id in self._hit_block_ids)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks' cold runs, weight reloads).

        Returns:
            False, changing nothing, while any request holds blocks.
        """
        return self.block_pool.reset_prefix_cache()
