"""EngineCore: scheduler, KV cache manager and executor, on token ids only.

One ``step()`` schedules the next batch (``SchedulerOutput``: new tokens per
request, block tables, grammar bitmasks), has the executor run it, and applies
the sampled tokens (``EngineCoreOutputs``). It knows no text: tokenization and
validation are ``input_processor``'s, detokenization and stop strings
``output_processor``'s, ``n > 1`` fan-out ``parallel_sampling``'s (vLLM v1's
split of the same jobs). ``LLMEngine`` composes the four; ``LLM`` and
``AsyncEngine`` loop over its step.
"""

from __future__ import annotations

import collections
import functools
import logging
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from aioengine.config import EngineConfig, resolve_async_scheduling
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.core.scheduler import LaunchedStep, Scheduler
from aioengine.engine.beam_search import BeamSearchGroup, BeamSearchParams
from aioengine.engine.input_processor import EngineCoreRequest
from aioengine.engine.parallel_sampling import SampleForks
from aioengine.errors import RequestRejected, SchedulerQueueFull
from aioengine.executor.abstract import Executor
from aioengine.ipc.messages import ModelRunnerOutput, SamplingMetadata, SchedulerOutput
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams
from aioengine.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# Steps kept in ``EngineCore.recent_steps`` (a 2-request-per-stream run at 64
# streams of 128 tokens is about 260 steps).
RECENT_STEPS = 4096

__all__ = ["EngineCore", "EngineCoreOutput", "EngineCoreOutputs", "EngineStats", "RequestRejected"]


@dataclass
class EngineStats:
    """One snapshot read by /metrics, the chat page and the tests.

    Token and request counts are cumulative unless named ``*_last_step``;
    times are seconds. ``worker_idle_time`` sums, over steps, the worker's wait
    between its previous step's end and the step's start (the engine-side time
    on the critical path, ``ModelRunnerOutput.idle_time``); ``worker_busy_time``
    sums its forward + sampling.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_multi_request_steps: int = 0
    max_reqs_in_step: int = 0
    num_reqs_last_step: int = 0
    num_tokens_last_step: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    last_step_time: float = 0.0
    last_forward_time: float = 0.0
    worker_idle_time: float = 0.0
    worker_busy_time: float = 0.0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_acceptance_rate: float = 0.0
    spec_decode_mean_acceptance_length: float = 0.0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_kv_blocks_shared: int = 0
    num_cow_copies: int = 0
    block_usage_map: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one step did for one (child) request.

    Attributes:
        new_token_ids: tokens sampled this step, in order (empty for a prompt
            chunk; several under speculative decoding).
        new_logprobs: per new token, ``[(token_id, logprob), ...]``; None when
            not asked for.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once the core
            finished it (EOS, stop token, grammar end, max_tokens, context).
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens found in the prefix cache (-1 before
            the request was first scheduled).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = -1


@dataclass
class EngineCoreOutputs:
    """One step's outputs.

    Attributes:
        outputs: one per scheduled request still alive, in schedule order.
        scheduled_new_request_ids: requests scheduled for the first time.
        scheduled_time: ``time.monotonic()`` when the step was scheduled.
        executed: False when nothing could be scheduled (the executor was not
            called: all waiting requests wait for a grammar, or nothing fits).
        finished_beam_searches: beam searches that ended this step (their
            ``finished`` beams, best first).
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduled_new_request_ids: list[str] = field(default_factory=list)
    scheduled_time: float = 0.0
    executed: bool = True
    finished_beam_searches: list[BeamSearchGroup] = field(default_factory=list)


class EngineCore:
    """Scheduler, KV cache manager and executor behind ``step()``.

    Args:
        config: engine settings.
        executor: runs the steps (its handshake gives ``num_blocks`` and
            ``max_model_len``).
        structured_output_manager: grammar compile cache (kept across worker
            restarts by ``AsyncEngine``).
        eos_token_id: the tokenizer's end-of-sequence id (None: none).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        structured_output_manager: StructuredOutputManager,
        eos_token_id: int | None,
    ) -> None:
        self.config = config
        self.executor = executor
        self.eos_token_id = eos_token_id
        self.max_model_len = executor.max_model_len
        self.block_size = config.cache.block_size
        self.kv_cache_manager = KVCacheManager(
            executor.num_blocks, self.block_size, config.cache.enable_prefix_caching
        )
        # A partial, not the bound method: the scheduler must not hold the core (and
        # through it the executor) in a reference cycle, or a replaced core's worker
        # processes and pipes stay open until the garbage collector runs.
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            self.max_model_len,
            functools.partial(sampling_metadata, eos_token_id=eos_token_id),
            config.speculative,
        )
        self.structured_output_manager = structured_output_manager
        self._seed_rng = random.Random(config.model.seed)
        self.last_step_time = 0.0
        self.last_forward_time = 0.0
        self.beam_searches: dict[str, BeamSearchGroup] = {}
        self._beam_of: dict[str, BeamSearchGroup] = {}
        self.sample_forks = SampleForks(self.scheduler)
        self.async_scheduling, why = resolve_async_scheduling(config)
        logger.info("async scheduling %s (%s)", "on" if self.async_scheduling else "off", why)
        # Launched steps whose output is not applied yet, oldest first (at most 2).
        self._in_flight: collections.deque[tuple[SchedulerOutput, LaunchedStep, float]] = (
            collections.deque()
        )
        self.last_worker_idle_time = 0.0
        self.worker_idle_time = 0.0
        self.worker_busy_time = 0.0
        # The latest steps' (requests, tokens, worker idle s, worker busy s), for
        # the benchmarks' per-step figures (``GET /v1/engine/stats?steps=1``).
        self.recent_steps: collections.deque[tuple[int, int, float, float]] = collections.deque(
            maxlen=RECENT_STEPS
        )

    # -- requests ---------------------------------------------------------------
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queue the children of one parent, all or none: the first prefills the
        prompt, the others fork its blocks after that (``SampleForks``).

        Raises:
            SchedulerQueueFull: the waiting queue has no room for all of them.
        """
        self._check_queue_room(len(requests))
        children = []
        for core_request in requests:
            request = Request(
                core_request.request_id,
                core_request.prompt_token_ids,
                core_request.sampling_params,
                core_request.max_tokens,
                self.eos_token_id,
                core_request.priority,
                core_request.arrival_time,
                core_request.cache_salt,
            )
            request.seed = (
                core_request.seed
                if core_request.seed is not None
                else self._seed_rng.getrandbits(63)
            )
            structured = core_request.sampling_params.structured_outputs
            if structured is not None:
                request.structured_output_request = self.structured_output_manager.new_request(
                    structured
                )
            children.append(request)
        self.sample_forks.add(children[0], children[1:])

    def _check_queue_room(self, num_requests: int) -> None:
        """Raise ``SchedulerQueueFull`` unless ``num_requests`` more fit in the
        waiting queue (children waiting for a fork count as waiting).

        Raises:
            RequestRejected: ``num_requests`` (``n``, a beam width) is more than
                the whole queue holds, so the request could never be admitted
                (400; a 429 would have the client retry forever).
        """
        limit = self.config.scheduler.max_waiting_requests
        if num_requests > limit:
            raise RequestRejected(
                f"n={num_requests} is more than the waiting queue holds "
                f"(max_waiting_requests={limit})",
                "n",
            )
        if self.num_waiting + num_requests > limit:
            raise SchedulerQueueFull(f"waiting queue is full ({limit} requests)")

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled, ``n > 1`` children waiting for a fork too."""
        return self.scheduler.num_waiting + self.sample_forks.num_waiting

    def add_beam_search(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        """Queue a beam search (``BeamSearchGroup``): its first beam prefills the
        prompt; it ends in ``EngineCoreOutputs.finished_beam_searches``.

        Raises:
            SchedulerQueueFull: the waiting queue has no room for
                ``params.beam_width`` requests. A search counts as its beams, as
                ``n > 1`` sampling counts as its samples, when it is admitted;
                the beams it forks later, or that a preemption requeues, join
                the queue past the limit (refusing one would fail a search
                already running).
            ValueError: ``request_id`` is already a beam search here.
        """
        if request_id in self.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_queue_room(params.beam_width)
        # Each beam computes one token a step; the group decides which beams go on,
        # when one ends and which token it keeps, so a beam never stops by itself.
        beam_params = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens + 1, ignore_eos=True
        )
        eos = None if params.ignore_eos else self.eos_token_id

        def make_request(rid: str, output_token_ids: list[int]) -> Request:
            r = Request(
                rid,
                prompt_token_ids,
                beam_params,
                params.max_tokens + 1,
                self.eos_token_id,
                priority,
                arrival_time,
                cache_salt,
            )
            r.append_output_token_ids(output_token_ids)
            return r

        first = make_request(f"{request_id}#beam0", [])
        group = BeamSearchGroup(request_id, first, params, eos, make_request)
        # Beyond SamplingParams' own bound of 20: the top 2k logprobs of every beam.
        beam_params.logprobs = group.state.num_candidates
        self.scheduler.add_request(first)
        self.beam_searches[request_id] = group
        self._beam_of[first.request_id] = group

    def abort_beam_search(self, request_id: str) -> bool:
        """End a beam search and free its beams' blocks; False if unknown."""
        group = self.beam_searches.pop(request_id, None)
        if group is None:
            return False
        self.scheduler.finish_requests(group.beam_ids, RequestStatus.FINISHED_ABORTED)
        for rid in group.beam_ids:
            self._beam_of.pop(rid, None)
        group.beams = []
        return True

    def _step_beam_searches(self, groups: dict[str, BeamSearchGroup]) -> list[BeamSearchGroup]:
        done = []
        for group in groups.values():
            if not group.ready():
                continue
            old = set(group.beam_ids)
            finished = group.advance(self.scheduler)
            for rid in old - set(group.beam_ids):
                self._beam_of.pop(rid, None)
            for beam in group.beams:
                self._beam_of[beam.request_id] = group
            if finished:
                self.beam_searches.pop(group.request_id, None)
                done.append(group)
        return done

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """End requests (abort, or a stop string the output processor matched)
        and free their blocks; unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, status)
        self.sample_forks.discard(request_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Returns False (changing nothing) while
        any request holds blocks, as vLLM does."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or launched steps whose output is still to be applied."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_request(self, request_id: str) -> Request | None:
        """A live (child) request: in the scheduler, or waiting to fork its
        prompt's blocks (``SampleForks``); None if unknown."""
        return self.scheduler.requests.get(request_id) or self.sample_forks.get(request_id)

    def pending_grammars(self) -> list[Future]:
        """Compile futures of waiting requests whose grammar is not ready yet."""
        return [
            r.structured_output_request.grammar_future
            for r in self.scheduler.waiting
            if r.structured_output_request is not None
            and not r.structured_output_request.is_ready()
        ]

    def _sampling_metadata(self, request: Request) -> SamplingMetadata:
        return sampling_metadata(request, self.eos_token_id)

    # -- steps ------------------------------------------------------------------
    def can_overlap(self) -> bool:
        """Async scheduling may schedule the next step before this one's output:
        it is on, and no request needs its step-N token on the engine side before
        step N+1 is planned (speculative decoding, structured outputs, beam
        search, ``n > 1`` children waiting for child 0's first token)."""
        return (
            self.async_scheduling
            and self.scheduler.spec is None
            and not self.beam_searches
            and not self.sample_forks.num_waiting
            and not any(
                r.structured_output_request is not None for r in self.scheduler.requests.values()
            )
        )

    def _launch_next(self) -> SchedulerOutput | None:
        """Schedule and launch one more step if overlap is allowed, fewer than two
        steps are in flight and there is work; the step to submit, or None."""
        if len(self._in_flight) >= 2 or not self.can_overlap():
            return None
        if self._in_flight and self.scheduler.has_preempted_placeholders():
            # A preempted request's token is still in flight: were it resumed
            # now, it would be sampled again at that position.
            return None
        if not self.scheduler.has_unfinished_requests():
            return None
        scheduler_output = self.schedule()
        if _is_idle(scheduler_output):
            return None
        launched = self.scheduler.launch(scheduler_output)
        self._in_flight.append((scheduler_output, launched, time.monotonic()))
        return scheduler_output

    def _apply_oldest(self, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        scheduler_output, launched, scheduled_time = self._in_flight.popleft()
        return self.update_from_output(scheduler_output, runner_output, scheduled_time, launched)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run on the executor (blocking), apply the sampled tokens.

        With async scheduling the next step is submitted before this one's output
        is awaited (``_launch_next``), so the worker never waits for the engine.

        Raises:
            WorkerDiedError: from the executor; the step is then not applied.
        """
        if self._in_flight or self.can_overlap():
            while (scheduler_output := self._launch_next()) is not None:
                self.executor.submit(scheduler_output)
            if not self._in_flight:
                return EngineCoreOutputs(executed=False)
            try:
                runner_output = self.executor.get_output()
            except BaseException:
                self._in_flight.popleft()
                raise
            return self._apply_oldest(runner_output)
        scheduler_output = self.schedule()
        if _is_idle(scheduler_output):
            return EngineCoreOutputs(executed=False)
        scheduled_time = time.monotonic()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.update_from_output(scheduler_output, runner_output, scheduled_time)

    async def step_async(self) -> EngineCoreOutputs:
        """``step()`` with the executor awaited: the event loop serves other
        work while the worker computes."""
        if self._in_flight or self.can_overlap():
            while (scheduler_output := self._launch_next()) is not None:
                await self.executor.submit_async(scheduler_output)
            if not self._in_flight:
                return EngineCoreOutputs(executed=False)
            try:
                runner_output = await self.executor.get_output_async()
            except BaseException:
                self._in_flight.popleft()
                raise
            return self._apply_oldest(runner_output)
        scheduler_output = self.schedule()
        if _is_idle(scheduler_output):
            return EngineCoreOutputs(executed=False)
        scheduled_time = time.monotonic()
        runner_output = await self.executor.execute_model_async(scheduler_output)
        return self.update_from_output(scheduler_output, runner_output, scheduled_time)

    def schedule(self) -> SchedulerOutput:
        """The next step; constrained requests that sample in it get their
        ``grammar_bitmask`` rows (none at all when no such request runs)."""
        scheduler_output = self.scheduler.schedule()
        ids, constrained = [], []
        for request, num_new in zip(
            self.scheduler.scheduled_requests, scheduler_output.num_scheduled_tokens
        ):
            if (
                request.structured_output_request is not None
                and request.num_computed_tokens + num_new >= request.num_tokens
            ):
                ids.append(request.request_id)
                constrained.append(request.structured_output_request)
        if constrained:
            scheduler_output.structured_output_request_ids = ids
            scheduler_output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                constrained
            ).tobytes()
        return scheduler_output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        scheduled_time: float = 0.0,
        launched: LaunchedStep | None = None,
    ) -> EngineCoreOutputs:
        """Apply one step's sampled tokens: advance the requests, feed the
        grammars, finish what reached EOS, a stop token, a grammar's end,
        ``max_tokens`` or the context length. ``launched``: the step was
        scheduled ahead (async scheduling)."""
        self.last_forward_time = runner_output.forward_time + runner_output.sample_time
        self.last_worker_idle_time = runner_output.idle_time
        self.worker_idle_time += runner_output.idle_time
        self.worker_busy_time += self.last_forward_time
        self.recent_steps.append(
            (
                scheduler_output.num_reqs,
                scheduler_output.total_num_scheduled_tokens,
                runner_output.idle_time,
                self.last_forward_time,
            )
        )
        if launched is None:
            # Before the output moves any counter: a child 0 that ends on its first
            # token still holds the prompt's blocks for its siblings to fork.
            self.sample_forks.fork_after_step(
                zip(self.scheduler.scheduled_requests, scheduler_output.num_scheduled_tokens)
            )
        outputs: dict[str, EngineCoreOutput] = {}
        beam_groups: dict[str, BeamSearchGroup] = {}
        beam_of = self._beam_of
        for request, token, logprobs in self.scheduler.update_from_output(
            scheduler_output, runner_output, launched
        ):
            group = beam_of.get(request.request_id) if beam_of else None
            if group is not None:
                if token is not None:
                    group.accept(request, logprobs, self.block_size)
                    beam_groups[group.request_id] = group
                continue
            output = outputs.get(request.request_id)
            if output is None:  # the request's first token this step (drafts give several)
                output = outputs[request.request_id] = EngineCoreOutput(request.request_id, [])
            output.num_cached_tokens = request.num_cached_tokens
            if token is None:
                continue
            if request.structured_output_request is not None and not self._accept_structured(
                request, token
            ):
                # Not emitted: the request ends before the token its grammar forbids.
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                continue
            output.new_token_ids.append(token)
            if logprobs is not None:
                output.new_logprobs = (output.new_logprobs or []) + [logprobs]
            if request.is_finished:
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
        return EngineCoreOutputs(
            list(outputs.values()),
            [new_request.req_id for new_request in scheduler_output.scheduled_new_reqs],
            scheduled_time,
            finished_beam_searches=self._step_beam_searches(beam_groups) if beam_groups else [],
        )

    def _accept_structured(self, request: Request, token: int) -> bool:
        """Advance a constrained request's matcher; a finished grammar stops it.

        Returns:
            False when the grammar rejects ``token``: the request is finished
            (``stop`` unless it had already finished) and the token must not
            be emitted. A sampler can only pick such a token from a row its
            masks left without any allowed token (every logit -inf or NaN);
            structured/min_tokens.py keeps ``min_tokens`` from doing that.
        """
        structured = request.structured_output_request
        if structured is None or structured.matcher is None:
            return True
        if structured.accept_token(token):
            if not request.is_finished and structured.is_terminated:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            return True
        logger.warning(
            "request %s: the sampler chose token %d, which its grammar forbids (no token "
            "was left allowed: logits -inf or NaN); it ends before that token",
            request.request_id,
            token,
        )
        if not request.is_finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        return False

    # -- stats ------------------------------------------------------------------
    def stats(self, include_block_map: bool = False) -> EngineStats:
        """The stats snapshot (``num_requests_finished`` is the output
        processor's, filled by ``LLMEngine``); ``include_block_map`` adds the
        per-block state list (for the chat page's KV grid)."""
        counters = self.scheduler.stats
        kv_cache = self.kv_cache_manager
        pool = kv_cache.block_pool
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.num_waiting,
            num_kv_blocks_total=pool.num_blocks,
            num_kv_blocks_used=pool.num_used_blocks,
            kv_cache_usage=pool.usage,
            prefix_cache_queries=kv_cache.prefix_cache_queries,
            prefix_cache_hits=kv_cache.prefix_cache_hits,
            num_preemptions=counters.num_preemptions,
            num_steps=counters.num_steps,
            num_multi_request_steps=counters.num_multi_request_steps,
            max_reqs_in_step=counters.max_reqs_in_step,
            num_reqs_last_step=counters.num_scheduled_reqs_last_step,
            num_tokens_last_step=counters.num_scheduled_tokens_last_step,
            num_prompt_tokens=counters.num_prompt_tokens,
            num_generation_tokens=counters.num_generation_tokens,
            last_step_time=self.last_step_time,
            last_forward_time=self.last_forward_time,
            worker_idle_time=self.worker_idle_time,
            worker_busy_time=self.worker_busy_time,
            num_kv_blocks_shared=pool.num_shared_blocks,
            num_cow_copies=kv_cache.num_cow_copies,
            **self._spec_stats(),
            block_usage_map=self.block_usage_map() if include_block_map else [],
        )

    def _spec_stats(self) -> dict:
        """Speculative decoding's ``EngineStats`` fields (vLLM's spec_decode)."""
        spec = self.scheduler.spec
        if spec is None:
            return {}
        s = spec.stats
        return dict(
            spec_decode_num_drafts=s.num_drafts,
            spec_decode_num_draft_tokens=s.num_draft_tokens,
            spec_decode_num_accepted_tokens=s.num_accepted_tokens,
            spec_decode_acceptance_rate=s.acceptance_rate,
            spec_decode_mean_acceptance_length=s.mean_acceptance_length,
            spec_decode_num_accepted_tokens_per_pos=list(s.num_accepted_tokens_per_pos),
        )

    def block_usage_map(self) -> list[int]:
        """Per block: 0 free, 1 free but holding a cached prefix, 2 in use, 3 in
        use by more than one request (a fork or a prefix-cache hit)."""
        return [
            (3 if b.ref_cnt > 1 else 2) if b.ref_cnt else (1 if b.block_hash is not None else 0)
            for b in self.kv_cache_manager.block_pool.blocks
        ]


def sampling_metadata(request: Request, eos_token_id: int | None) -> SamplingMetadata:
    """The worker-side sampling settings of ``request`` (EOS joins the stop ids
    unless ``ignore_eos``)."""
    params = request.sampling_params
    stop_ids = list(params.stop_token_ids)
    if not params.ignore_eos and eos_token_id is not None:
        stop_ids.append(eos_token_id)
    return SamplingMetadata(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        seed=request.seed,
        logprobs=-1 if params.logprobs is None else params.logprobs,
        min_tokens=params.min_tokens,
        stop_token_ids=stop_ids,
        logit_bias=[(int(t), float(b)) for t, b in params.logit_bias.items()],
    )


def _is_idle(scheduler_output: SchedulerOutput) -> bool:
    """Nothing to run and nothing for the worker to forget or drop."""
    return (
        scheduler_output.num_reqs == 0
        and not scheduler_output.finished_req_ids
        and not scheduler_output.preempted_req_ids
    )
