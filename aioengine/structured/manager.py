"""``StructuredOutputManager``: compiles grammars off the event loop and builds
each step's ``grammar_bitmask`` (vLLM v1's ``StructuredOutputManager``).

The engine process owns it. Compiles run in one worker thread and are cached
by ``StructuredOutputsParams.key()`` (failures too, so a bad schema sent again
is answered at once). After every step the engine advances the matchers with
the sampled tokens (``accept_tokens``); before the next one it fills one mask
row per constrained request that samples in that step (``grammar_bitmask``).
Unconstrained requests are never touched.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from aioengine.structured.backend import XgrammarBackend
from aioengine.structured.params import StructuredOutputsParams
from aioengine.structured.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

# Compiled grammars kept (schemas, regexes ...); each is a few hundred KB at most.
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputManager:
    """Grammar compile cache and per-step bitmasks.

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: width of the logits (tokens).
        eos_token_id: the token that ends a finished grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.backend = XgrammarBackend(tokenizer, vocab_size, eos_token_id)
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._torch_bitmask = None

    # -- compiling ------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The (cached) compile of ``params``: a future of the ``CompiledGrammar``
        that raises ``GrammarError``. Never blocks."""
        key = params.key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._executor.submit(self.backend.compile, params)
        self._cache[key] = future
        while len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    async def compile_async(self, params: StructuredOutputsParams) -> None:
        """Compile (or find cached) without blocking the loop.

        Raises:
            GrammarError: the library cannot compile it.
        """
        await asyncio.wrap_future(self.compile(params))

    def compile_sync(self, params: StructuredOutputsParams) -> None:
        """Compile in the caller's thread's wait (offline ``LLM``).

        Raises:
            GrammarError: the library cannot compile it.
        """
        self.compile(params).result()

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """The grammar state of a new request (its compile starts or is cached)."""
        return StructuredOutputRequest(params, self.compile(params), self.backend)

    # -- every step -----------------------------------------------------------------
    def grammar_bitmask(self, requests: list[StructuredOutputRequest]) -> np.ndarray:
        """``int32 [len(requests), ceil(vocab_size / 32)]``: row ``i`` allows the
        tokens ``requests[i]``'s grammar accepts next. Every request must be ready."""
        import torch
        import xgrammar as xgr

        n = len(requests)
        if self._torch_bitmask is None or self._torch_bitmask.shape[0] < n:
            self._torch_bitmask = xgr.allocate_token_bitmask(max(n, 16), self.vocab_size)
        bitmask = self._torch_bitmask[:n]
        bitmask.fill_(-1)
        for i, so in enumerate(requests):
            if so.matcher is None:  # its grammar failed to compile: only EOS may follow
                bitmask[i] = 0
                eos = self.backend.eos_token_id
                if eos is not None:
                    bitmask[i, eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
            elif not so.matcher.is_terminated():
                so.matcher.fill_next_token_bitmask(bitmask, i)
        assert bitmask.dtype == torch.int32
        return bitmask.numpy().copy()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

