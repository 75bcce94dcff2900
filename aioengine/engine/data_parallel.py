"""Data parallelism: several engine replicas behind one API server.

``aioengine serve --data-parallel-size N`` (vLLM's flag; SGLang's ``--dp-size``)
starts N ``AsyncEngine`` replicas. Each is a whole engine: its own
``EngineCore`` (scheduler, KV cache manager with its own prefix cache), its
own worker process(es) with ``-tp`` ranks, standby worker and restart logic.
A worker crash therefore ends only its own replica's in-flight requests; the
others go on serving while it restarts.

All replicas' engine cores run on this process's one event loop (scheduling
a step costs well under the worker's forward), so the router reads each
replica's prefix cache directly and its answer is exact at the moment of
routing, where SGLang's router keeps an approximate radix tree of what it
sent to each worker.

Routing (``PrefixCacheRouter``), per request, among the replicas that are
healthy and not draining:

1. If the load is out of balance (the busiest replica has more than
   ``balance_abs_threshold`` requests more than the idlest, and more than
   ``balance_rel_threshold`` times as many), the least loaded replica takes
   it: a shared system prompt must not pull every user onto one replica.
2. Otherwise the replica with the best score, ``cached_blocks -
   load_penalty_blocks * load``: the leading blocks of the prompt its prefix
   cache holds (same chained block hashes as the KV cache manager, the
   request's ``cache_salt`` included), less ``load_penalty_blocks`` (4
   blocks, 64 tokens) per request it already has in flight; ties go to the
   lower load, then the lower rank. A conversation's next turn thus lands
   where its earlier turns are cached, over HTTP and WebSocket alike, while
   that keeps paying; a short prefix every prompt shares (a chat template's
   default system prompt) does not pull new conversations onto one replica,
   since one more queued request there costs more than its blocks save.
3. If the chosen replica's waiting queue is full, the least loaded other
   replica takes it (429 only when every queue is full).

Load is a replica's requests in flight (added and not yet finished: running,
waiting and not yet scheduled). ``data_parallel_routing="round_robin"``
ignores the caches (for comparison in bench/data_parallel.py).

The engine's statistics are the replicas' summed (``stats``), and each
replica's own (``replica_stats``); /metrics labels every series with its
replica (``engine="0"``, as vLLM does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from aioengine.config import EngineConfig
from aioengine.core.block_pool import ROOT_BLOCK_HASH, BlockHash, hash_request_blocks
from aioengine.engine.async_engine import (
    AsyncEngine,
    generate_stream,
    LatencyObserver,
    RequestStream,
)
from aioengine.engine.beam_search import BeamSearchParams
from aioengine.engine.core import EngineStats
from aioengine.errors import EngineDeadError, SchedulerQueueFull
from aioengine.sampling_params import RequestOutput, SamplingParams
from aioengine.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# EngineStats fields that are not summed over replicas (see ``sum_stats``).
_MAX_FIELDS = ("max_reqs_in_step", "last_step_time", "last_forward_time")
# Float EngineStats fields that are summed (cumulative seconds).
_SUMMED_TIMES = ("worker_idle_time", "worker_busy_time")


@dataclass(frozen=True)
class RoutingDecision:
    """Where one request went and why.

    Attributes:
        replica: index of the replica.
        cached_blocks: leading prompt blocks that replica held cached.
        reason: ``"prefix"``, ``"least_loaded"``, ``"balance"`` or ``"round_robin"``.
    """

    replica: int
    cached_blocks: int
    reason: str


class PrefixCacheRouter:
    """Chooses a replica per request (module docstring, "Routing").

    Args:
        block_size: tokens per KV block (the replicas' ``CacheConfig.block_size``).
        policy: ``"prefix"`` or ``"round_robin"``.
        load_penalty_blocks: cached blocks one request in flight is worth.
        balance_abs_threshold, balance_rel_threshold: when the load counts as
            out of balance (SGLang's router has the same knobs).
    """

    def __init__(
        self,
        block_size: int,
        policy: str = "prefix",
        load_penalty_blocks: float = 4.0,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"routing policy must be 'prefix' or 'round_robin', got {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.load_penalty_blocks = load_penalty_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._next = 0
        self.decisions: dict[str, int] = dict.fromkeys(
            ("prefix", "least_loaded", "balance", "round_robin"), 0
        )

    def prompt_hashes(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """Chained hashes of the prompt's full blocks, as ``KVCacheManager`` computes them."""
        extra = (cache_salt,) if cache_salt else ()
        return hash_request_blocks(prompt_token_ids, self.block_size, 0, ROOT_BLOCK_HASH, extra)

    def route(self, loads: Sequence[int | None], cached_blocks: Sequence[int]) -> RoutingDecision:
        """Pick a replica.

        Args:
            loads: per replica, requests in flight; None for a replica that
                cannot take requests (worker down, draining).
            cached_blocks: per replica, leading prompt blocks in its prefix cache.

        Raises:
            EngineDeadError: no replica can take a request.
        """
        load = {i: n for i, n in enumerate(loads) if n is not None}
        live = list(load)
        if not live:
            raise EngineDeadError("no engine replica is ready (their workers are restarting)")
        if self.policy == "round_robin":
            for _ in range(len(loads)):
                i, self._next = self._next % len(loads), self._next + 1
                if i in load:
                    return self._decide(i, cached_blocks[i], "round_robin")
        least = min(live, key=lambda i: (load[i], i))
        busiest = max(load.values())
        if (
            busiest - load[least] > self.balance_abs_threshold
            and busiest > self.balance_rel_threshold * load[least]
        ):
            return self._decide(least, cached_blocks[least], "balance")
        best = min(
            live, key=lambda i: (self.load_penalty_blocks * load[i] - cached_blocks[i], load[i], i)
        )
        reason = "prefix" if cached_blocks[best] > 0 else "least_loaded"
        return self._decide(best, cached_blocks[best], reason)

    def _decide(self, replica: int, cached_blocks: int, reason: str) -> RoutingDecision:
        self.decisions[reason] += 1
        return RoutingDecision(replica, cached_blocks, reason)


def num_cached_blocks(engine: AsyncEngine, hashes: Sequence[BlockHash]) -> int:
    """Leading blocks of ``hashes`` in ``engine``'s prefix cache (read only: nothing
    is touched, counted or evicted)."""
    core = engine.core
    if core is None:
        return 0
    kv = core.kv_cache_manager
    if not kv.enable_caching:
        return 0
    n = 0
    for block_hash in hashes:
        if kv.block_pool.get_cached_block(block_hash) is None:
            break
        n += 1
    return n


def sum_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """Replicas' ``EngineStats`` as one: counts summed, ``max_reqs_in_step`` and the
    last step's times the maximum, ratios recomputed from the summed counts,
    block maps concatenated in replica order."""
    total = EngineStats()
    for f in dataclasses.fields(EngineStats):
        values = [getattr(p, f.name) for p in parts]
        if f.name in _MAX_FIELDS:
            setattr(total, f.name, max(values, default=0))
        elif f.name == "spec_decode_num_accepted_tokens_per_pos":
            width = max((len(v) for v in values), default=0)
            setattr(total, f.name, [sum(v[k] for v in values if k < len(v)) for k in range(width)])
        elif f.name == "block_usage_map":
            setattr(total, f.name, [b for v in values for b in v])
        elif f.type in ("int", int) or f.name in _SUMMED_TIMES:
            setattr(total, f.name, sum(values))
    if total.num_kv_blocks_total:
        total.kv_cache_usage = total.num_kv_blocks_used / total.num_kv_blocks_total
    if total.spec_decode_num_drafts:
        total.spec_decode_acceptance_rate = (
            total.spec_decode_num_accepted_tokens / total.spec_decode_num_draft_tokens
        )
        total.spec_decode_mean_acceptance_length = (
            1 + total.spec_decode_num_accepted_tokens / total.spec_decode_num_drafts
        )
    return total


class DPAsyncEngine:
    """``data_parallel_size`` ``AsyncEngine`` replicas behind ``AsyncEngine``'s API.

    Use ``engine = await DPAsyncEngine.start(config)``; the API server takes it
    where it takes an ``AsyncEngine``. ``replicas[i]`` is replica ``i``.
    """

    def __init__(self, config: EngineConfig, replicas: list[AsyncEngine]) -> None:
        self.config = config
        self.replicas = replicas
        self.router = PrefixCacheRouter(
            config.cache.block_size, config.parallel.data_parallel_routing
        )
        first = replicas[0]
        self.model_path = first.model_path
        self.served_model_name = first.served_model_name
        self.model_info = first.model_info
        self.tokenizer = first.tokenizer
        self.started_at = first.started_at
        self._latency_observer: LatencyObserver | None = None

    @classmethod
    async def start(cls, config: EngineConfig) -> DPAsyncEngine:
        """Start every replica at once (their workers spawn side by side).

        Raises:
            whatever ``AsyncEngine.start`` raises; replicas already started are
            shut down first.
        """
        n = config.parallel.data_parallel_size
        configs = [
            dataclasses.replace(
                config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank)
            )
            for rank in range(n)
        ]
        results = await asyncio.gather(
            *(AsyncEngine.start(c) for c in configs), return_exceptions=True
        )
        started = [r for r in results if isinstance(r, AsyncEngine)]
        failed = [r for r in results if not isinstance(r, AsyncEngine)]
        if failed:
            await asyncio.gather(*(r.shutdown() for r in started), return_exceptions=True)
            raise failed[0]
        logger.info(
            "data parallel: %d engine replicas, routing %s",
            n,
            config.parallel.data_parallel_routing,
        )
        return cls(config, started)

    # -- what the API server reads -----------------------------------------------------
    @property
    def healthy(self) -> bool:
        """True while any replica serves (the others may be restarting a worker)."""
        return any(r.healthy for r in self.replicas)

    @property
    def draining(self) -> bool:
        return all(r.draining for r in self.replicas)

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def num_worker_restarts(self) -> int:
        return sum(r.num_worker_restarts for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def latency_observer(self) -> LatencyObserver | None:
        return self._latency_observer

    @latency_observer.setter
    def latency_observer(self, observer: LatencyObserver | None) -> None:
        self._latency_observer = observer
        for r in self.replicas:
            r.latency_observer = observer

    # -- requests --------------------------------------------------------------------
    def route(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> RoutingDecision:
        """Where a request with this prompt would go now (``PrefixCacheRouter.route``).

        Raises:
            EngineDeadError: no replica can take a request.
        """
        if self.router.policy == "round_robin":
            cached = [0] * len(self.replicas)
        else:
            hashes = self.router.prompt_hashes(prompt_token_ids, cache_salt)
            cached = [num_cached_blocks(r, hashes) for r in self.replicas]
        loads = [r.num_in_flight if r.healthy and not r.draining else None for r in self.replicas]
        if all(r.draining for r in self.replicas):
            raise EngineDeadError("the server is shutting down")
        return self.router.route(loads, cached)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Route the request and queue it on that replica; if that replica's waiting
        queue is full, on the least loaded other one that takes requests.
        Errors as ``AsyncEngine.add_request`` (``SchedulerQueueFull`` only when
        every such replica's queue is full)."""
        decision = self.route(prompt_token_ids, cache_salt)
        others = sorted(
            (
                i
                for i, r in enumerate(self.replicas)
                if i != decision.replica and r.healthy and not r.draining
            ),
            key=lambda i: (self.replicas[i].num_in_flight, i),
        )
        *first, last = [decision.replica, *others]
        for i in first:
            try:
                return self.replicas[i].add_request(
                    request_id, prompt_token_ids, params, priority, cache_salt
                )
            except SchedulerQueueFull:
                continue
        return self.replicas[last].add_request(
            request_id, prompt_token_ids, params, priority, cache_salt
        )

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """As ``AsyncEngine.generate``, on the routed replica."""
        return generate_stream(self, prompt, params, request_id, priority)

    def new_request_id(self, prefix: str = "req") -> str:
        return self.replicas[0].new_request_id(prefix)

    def abort(self, request_id: str) -> None:
        """End a request on whichever replica holds it; unknown ids are ignored."""
        for r in self.replicas:
            r.abort(request_id)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile on every replica (each caches its own), so whichever is routed to
        finds it compiled. Raises ``GrammarError`` as ``AsyncEngine.compile_grammar``."""
        await asyncio.gather(*(r.compile_grammar(params) for r in self.replicas))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.replicas[0].tokenize(text, add_special_tokens)

    async def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        return await self.replicas[0].apply_chat_template(messages, add_generation_prompt, tools)

    def reset_prefix_cache(self) -> bool:
        """Reset every replica's prefix cache, or none: False, changing nothing,
        while any replica's requests hold blocks (as ``AsyncEngine``; the API
        answers 409 "nothing was changed")."""
        if any(r.core is None or r.stats().num_kv_blocks_used for r in self.replicas):
            return False
        return all([r.reset_prefix_cache() for r in self.replicas])

    def stats(self, include_block_map: bool = False) -> EngineStats:
        """The replicas' statistics summed (``sum_stats``)."""
        return sum_stats(self.replica_stats(include_block_map))

    def replica_stats(self, include_block_map: bool = False) -> list[EngineStats]:
        """Each replica's ``EngineStats``, in rank order (a replica whose worker is
        starting reports zeros)."""
        return [
            r.stats(include_block_map) if r.core is not None else EngineStats()
            for r in self.replicas
        ]

    # -- lifecycle -------------------------------------------------------------------
    def begin_drain(self) -> None:
        for r in self.replicas:
            r.begin_drain()

    def abort_all(self, message: str) -> None:
        for r in self.replicas:
            r.abort_all(message)

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))
