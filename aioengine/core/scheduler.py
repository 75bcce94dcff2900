"""Continuous batching without phases (vLLM v1 style).

Every step, each scheduled request gets some new tokens: running requests
first (one token for a decode, a chunk for an unfinished prompt), then
waiting ones in (priority, arrival) order, all under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). When
blocks run out, the lowest-priority, latest-arrived running request is
preempted: its blocks are freed and it is recomputed later (Kwon et al. 2023,
§4.5, recomputation). Requests join and leave the batch at every step
(Orca, Yu et al. OSDI 2022, iteration-level scheduling).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from aioengine.config import SchedulerConfig
from aioengine.core.block_pool import KVCacheBlock
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.core.step_cost import StepCostModel, prefill_context
from aioengine.errors import SchedulerQueueFull
from aioengine.ipc.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingMetadata,
    SchedulerOutput,
)
from aioengine.request import Request, RequestStatus
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.scheduling import SpecDecodeScheduler

# While requests decode and prompts keep arriving, after this many steps in a row with
# a prompt chunk the next step carries none: the chunked-prefill cap's reference, a
# decode-only step's time, is measured only on such steps, and a machine that slowed
# (other work on its cores) or sped up since would otherwise keep an old one.
REFERENCE_REFRESH_STEPS = 32


@dataclass
class SchedulerStats:
    """Counters kept by the scheduler (cumulative unless said otherwise)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_scheduled_reqs_last_step: int = 0
    num_scheduled_tokens_last_step: int = 0
    max_reqs_in_step: int = 0
    num_multi_request_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass
class _StepBuilder:
    """The step ``schedule()`` is building.

    Attributes:
        token_budget: tokens left of ``max_num_batched_tokens``.
        prefill_budget: tokens left for prompt chunks (new prompts, unfinished
            ones, recomputation after a preemption); below ``token_budget``
            while requests decode (``Scheduler.prefill_token_cap``). Worked out
            from ``prefill_cap`` on first use: a decode-only step never needs it,
            and the cap's step-time fit is the costliest part of ``schedule()``
            (issue 16: it sits between a step's output and the next step).
        prefill_req_ids: the requests scheduled for a prompt chunk.
        num_scheduled_tokens: new tokens per scheduled request id.
        new_block_ids: blocks allocated this step, per running request id.
        spec_tokens: draft tokens scheduled after a request's last token
            (speculative decoding), per request id.
        scheduled_running, scheduled_new, scheduled_resumed: the requests
            scheduled, by kind (resumed: back after a preemption).
    """

    token_budget: int
    prefill_cap: Callable[[], int]
    _prefill_budget: int | None = None
    prefill_req_ids: set[str] = field(default_factory=set)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    scheduled_resumed: list[Request] = field(default_factory=list)

    @property
    def prefill_budget(self) -> int:
        if self._prefill_budget is None:
            self._prefill_budget = self.prefill_cap()
        return self._prefill_budget

    @prefill_budget.setter
    def prefill_budget(self, value: int) -> None:
        self._prefill_budget = value

    def settle_prefill_budget(self) -> None:
        """Work the budget out now if it is not yet (before its inputs change)."""
        self.prefill_budget  # noqa: B018 (the getter settles it)


@dataclass
class LaunchedStep:
    """A step scheduled ahead of its output (async scheduling, ``Scheduler.launch``).

    Attributes:
        requests: the step's requests, in ``SchedulerOutput`` order.
        num_computed_before: each one's ``num_computed_tokens`` before the step.
        num_preemptions: each one's ``num_preemptions`` when scheduled: a request
            preempted (and maybe resumed) since then drops this step's token.
    """

    requests: list[Request]
    num_computed_before: list[int]
    num_preemptions: list[int]


class Scheduler:
    """Decides what runs each step and applies the sampled tokens.

    Async scheduling (``launch``): a step's counters move when it is scheduled,
    each request that samples in it holds one placeholder token until its output
    arrives (``num_placeholders``), so the next step can be scheduled before
    that; a request that ends while a launched step still computes for it keeps
    its blocks until the last such step's output is applied; one preempted while
    a launched step samples for it still gets that token (its generator drew it).

    Args:
        config: limits.
        kv_cache_manager: owner of the block tables.
        max_model_len: context length in tokens.
        sampling_metadata: builds the worker-side sampling settings of a request.
        speculative_config: drafts to verify (``spec_decode.scheduling``); None: off.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        sampling_metadata: Callable[[Request], SamplingMetadata],
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self._sampling_metadata = sampling_metadata
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key()
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []
        self.preempted_req_ids: list[str] = []
        self._known_to_worker: set[str] = set()
        self.stats = SchedulerStats()
        self.step_cost = StepCostModel()
        # Steps in a row that carried a prompt chunk beside decode rows (the cap's
        # decode-only reference is not re-measured in them).
        self._mixed_steps_in_a_row = 0
        self._step_id = 0
        self._scheduled_order: list[Request] = []
        # Async scheduling: sampled tokens not yet applied, launched steps not yet
        # applied, per request id; requests whose blocks wait for those steps.
        self._placeholders: dict[str, int] = {}
        self._num_in_flight: dict[str, int] = {}
        # Placeholders of requests preempted while their launched step sampled: that
        # token is still appended when it arrives (its generator drew for it).
        self._preempted_placeholders: dict[str, int] = {}
        self._deferred_free: list[Request] = []
        self.spec = (
            SpecDecodeScheduler(speculative_config, max_model_len)
            if speculative_config is not None
            else None
        )

    # -- requests in and out ------------------------------------------------
    def add_request(self, request: Request, check_queue_limit: bool = True) -> None:
        """Queue a request.

        Args:
            check_queue_limit: False for a request whose place its parent
                request reserved when it was admitted (an ``n > 1`` sample).

        Raises:
            SchedulerQueueFull: the waiting queue is full.
        """
        if check_queue_limit and len(self.waiting) >= self.config.max_waiting_requests:
            raise SchedulerQueueFull(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def add_forked_request(
        self, parent: Request, child: Request, num_tokens: int | None = None
    ) -> None:
        """Start ``child`` from ``parent``'s KV blocks (beam search's and
        ``n > 1`` sampling's fork).

        The child's first ``num_tokens`` tokens (default
        ``parent.num_computed_tokens``; see ``KVCacheManager.fork``) must be the
        parent's. A running parent shares those tokens' blocks with the child
        and the child runs from the next step on, from its last token at the
        latest (whose logits it needs), reaching the worker as a new request;
        a parent without blocks (preempted) leaves the child to wait and
        recompute like any request.
        """
        self.requests[child.request_id] = child
        if (
            parent.status == RequestStatus.RUNNING
            and parent.request_id in self.kv_cache_manager.req_to_blocks
        ):
            num_shared = parent.num_computed_tokens if num_tokens is None else num_tokens
            self.kv_cache_manager.fork(parent, child, num_shared)
            child.num_computed_tokens = min(num_shared, child.num_tokens - 1)
            child.num_cached_tokens = max(parent.num_cached_tokens, 0)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            self._enqueue_waiting(child)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests (stop string matched, client gone, abort); frees blocks."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> None:
        self._placeholders.pop(request.request_id, None)
        self._preempted_placeholders.pop(request.request_id, None)
        if self._num_in_flight.get(request.request_id):
            # A launched step still writes its K/V: the blocks go when it is done.
            self._deferred_free.append(request)
        else:
            self.kv_cache_manager.free(request)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        if request.request_id in self._known_to_worker:
            self._known_to_worker.discard(request.request_id)
            self.finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def num_placeholders(self, request: Request) -> int:
        """Tokens ``request`` sampled in launched steps whose output is not applied
        yet (async scheduling; always 0 otherwise)."""
        return self._placeholders.get(request.request_id, 0)

    def _num_tokens_ahead(self, request: Request) -> int:
        """``num_tokens`` counting the placeholder tokens of launched steps."""
        return request.num_tokens + self._placeholders.get(request.request_id, 0)

    def _ends_in_flight(self, request: Request) -> bool:
        """A launched step's token takes ``request`` to ``max_tokens`` or the
        context length: nothing more to schedule for it."""
        ahead = self._placeholders.get(request.request_id, 0)
        return bool(ahead) and (
            request.num_output_tokens + ahead >= request.max_tokens
            or request.num_tokens + ahead >= self.max_model_len
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_seats(self) -> int:
        """Seats of ``max_num_seqs`` no running request holds (``_num_seated``)."""
        return max(0, self.config.max_num_seqs - self._num_seated())

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks:
        running requests first, then waiting ones, then the message."""
        budget = self.config.max_num_batched_tokens
        step = _StepBuilder(budget, lambda: min(budget, self.prefill_token_cap()))
        self._schedule_running(step)
        self._schedule_waiting(step)
        return self._make_output(step)

    def prefill_token_cap(self) -> int:
        """Most prompt tokens this step may carry (``chunked_prefill_itl_ratio``):
        while requests decode, as many as keep the step's predicted time
        (``StepCostModel``) within the ratio of a decode-only step's, that step
        counting the requests still to be prefilled as decode rows too (they
        join the streams: a burst is admitted in a few steps), the chunk charged
        the attention to the longest prefix of a prompt under way (a later chunk
        of a long prompt is shorter), at least one KV block so prompts progress;
        otherwise, or before the worker's step times allow a prediction,
        ``max_num_batched_tokens``."""
        budget = self.config.max_num_batched_tokens
        ratio = self.config.chunked_prefill_itl_ratio
        if not ratio or not self.config.enable_chunked_prefill:
            return budget
        if self._mixed_steps_in_a_row >= REFERENCE_REFRESH_STEPS:
            # A decode-only step now and then keeps the reference measured (the
            # machine may have slowed or sped up since the last one).
            return 0
        num_decodes = num_prefilling = prefix = 0
        for r in self.running:
            ahead = self._num_tokens_ahead(r) - r.num_computed_tokens
            if ahead == 1 and not self._ends_in_flight(r):
                num_decodes += 1
            elif ahead > 1:
                num_prefilling += 1
                prefix = max(prefix, r.num_computed_tokens)
        # Requests still to be prefilled (running a chunk, or waiting) will decode
        # beside these rows: the reference step is theirs together (a burst).
        joining = min(
            num_prefilling + len(self.waiting), max(0, self.config.max_num_seqs - num_decodes)
        )
        cap = (
            self.step_cost.max_prefill_tokens(num_decodes, ratio, joining, prefix)
            if num_decodes
            else None
        )
        if cap is None:
            return budget
        return min(budget, max(cap, self.kv_cache_manager.block_size))

    def _observe_step_time(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Feed the step's shape and the worker's time to ``step_cost``: a request
        given one token (plus drafts) is a decode row, longer ones prompt chunks."""
        drafts = output.scheduled_spec_decode_tokens
        num_reqs = output.num_reqs
        if not drafts and output.total_num_scheduled_tokens == num_reqs:
            # Decode-only (every request scheduled for one token): no prefill, no context.
            self._mixed_steps_in_a_row = 0
            self.step_cost.observe(
                num_reqs, 0, runner_output.forward_time + runner_output.sample_time, 0
            )
            return
        computed = [r.num_computed_tokens for r in output.scheduled_new_reqs] + [
            r.num_computed_tokens for r in output.scheduled_cached_reqs
        ]
        num_decodes = num_prefill = context = 0
        has_chunk = False  # a prompt chunk (drafts alone are not one)
        for req_id, num_new, before in zip(output.req_ids(), output.num_scheduled_tokens, computed):
            num_drafts = len(drafts.get(req_id, ()))
            if num_new - num_drafts == 1:
                num_decodes += 1
                num_prefill += num_drafts
                context += prefill_context(before + 1, num_drafts)
            else:
                num_prefill += num_new
                context += prefill_context(before, num_new)
                has_chunk = True
        if num_decodes:
            self._mixed_steps_in_a_row = self._mixed_steps_in_a_row + 1 if has_chunk else 0
        self.step_cost.observe(
            num_decodes,
            num_prefill,
            runner_output.forward_time + runner_output.sample_time,
            context,
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        """A decode token for each running request, or its next prompt chunk.
        When blocks run out, requests are preempted (``_pick_victim``) until the
        allocation fits; if the victim is the request itself, it waits."""
        placeholders = self._placeholders
        allocate_slots = self.kv_cache_manager.allocate_slots
        running = RequestStatus.RUNNING
        for request in list(self.running):
            if step.token_budget <= 0:
                break
            if request.status != running:
                continue  # preempted for an earlier request in this loop
            rid = request.request_id
            ahead = placeholders.get(rid, 0) if placeholders else 0
            if ahead and self._ends_in_flight(request):
                continue
            num_left = len(request.all_token_ids) + ahead - request.num_computed_tokens
            is_prefill = num_left > 1  # a prompt chunk; a decode has one token left
            num_new = min(num_left, step.token_budget)
            if is_prefill:
                num_new = min(num_new, step.prefill_budget)
            if num_new <= 0:
                continue
            new_blocks = None
            if self.spec is not None:
                new_blocks = self._allocate_with_drafts(request, num_new, step)
            if new_blocks is not None:
                num_new += len(step.spec_tokens.get(rid, ()))
            else:
                new_blocks = allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self._pick_victim()
                if victim is None:
                    break  # nothing can be preempted for it: it waits a step
                self._preempt(victim, step)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                continue
            step.scheduled_running.append(request)
            step.num_scheduled_tokens[rid] = num_new
            step.new_block_ids[rid] = [b.block_id for b in new_blocks]
            step.token_budget -= num_new
            if is_prefill:
                step.prefill_budget -= num_new
                step.prefill_req_ids.add(rid)

    def _allocate_with_drafts(
        self, request: Request, num_new: int, step: _StepBuilder
    ) -> list[KVCacheBlock] | None:
        """Blocks for a decode plus its drafts (speculative decoding), or None
        (no drafts, or not enough free blocks: drafts never preempt)."""
        if self.spec is None:
            return None
        num_spec = self.spec.num_spec_tokens(request, step.token_budget, len(self.running))
        if not num_spec:
            return None
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + num_spec)
        if new_blocks is not None:
            step.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        return new_blocks

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Waiting requests in (priority, arrival) order while the budget lasts.
        A waiting request of strictly higher priority than a running one may
        preempt it for a seat or for blocks; one whose grammar is still
        compiling is passed over. After a preemption only higher-priority
        requests than every running one are admitted (no thrashing)."""
        blocked_by_preemption = bool(self.preempted_req_ids)
        index = 0  # of the next waiting request to consider
        while index < len(self.waiting) and min(step.token_budget, step.prefill_budget) > 0:
            request = self.waiting[index]
            if (
                request.structured_output_request is not None
                and not request.structured_output_request.is_ready()
            ):
                index += 1
                continue
            if blocked_by_preemption and request.priority >= min(
                (r.priority for r in self.running), default=request.priority
            ):
                break
            if self._num_seated() >= self.config.max_num_seqs:
                if not self._preempt_for(request, step):
                    break
                continue
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > step.token_budget:
                break
            num_new = min(num_new, step.token_budget, step.prefill_budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks) is None:
                if not self._preempt_for(request, step) and not self._preempt_idle_for(
                    request, step
                ):
                    break
                continue
            self.waiting.pop(index)
            self._admit(request, num_hit, num_new, step)

    def _num_seated(self) -> int:
        """Running requests that hold a seat of ``max_num_seqs``: a beam whose
        token was taken back (``Request.pop_output_token``) has nothing to
        compute until its siblings catch up, so it holds none. Counting it
        deadlocked a beam search wider than ``max_num_seqs`` once one of its
        beams was preempted: the idle siblings filled every seat, the preempted
        beam could never be readmitted, and they waited for it forever."""
        return sum(1 for r in self.running if r.num_computed_tokens < self._num_tokens_ahead(r))

    def _admit(self, request: Request, num_hit: int, num_new: int, step: _StepBuilder) -> None:
        """Move a waiting request whose blocks are allocated into ``running``."""
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.num_scheduled_tokens[request.request_id] = num_new
        step.token_budget -= num_new
        step.prefill_budget -= num_new
        step.prefill_req_ids.add(request.request_id)
        if request.request_id in self._known_to_worker:
            step.scheduled_resumed.append(request)
        else:
            step.scheduled_new.append(request)
            self._known_to_worker.add(request.request_id)

    def _pick_victim(self, than: Request | None = None) -> Request | None:
        """The one preemption rule: the lowest-priority, latest-arrived running
        request; with ``than``, only one of strictly lower priority than it. A
        request whose blocks other requests hit earlier in this step is never
        picked: they read the K/V it is about to write."""
        candidates = [
            r for r in self.running if not self.kv_cache_manager.num_unwritten_shared_blocks(r)
        ]
        if not candidates:
            return None
        victim = max(candidates, key=Request.sort_key)
        if than is not None and victim.priority <= than.priority:
            return None
        return victim

    def _preempt_for(self, request: Request, step: _StepBuilder) -> bool:
        """Preempt a running request of lower priority than ``request``; False if none."""
        victim = self._pick_victim(than=request)
        if victim is None:
            return False
        self._preempt(victim, step)
        return True

    def _preempt_idle_for(self, request: Request, step: _StepBuilder) -> bool:
        """Preempt a running request with nothing to compute (a beam waiting for
        its siblings, its candidates kept by its group) that does not come
        before ``request``; False if none. Without it a preempted beam whose
        siblings held the blocks it needs waited for them while they waited for
        it: the search and everything queued behind it hung."""
        idle = [
            r
            for r in self.running
            if r.num_computed_tokens >= self._num_tokens_ahead(r)
            and r.sort_key() >= request.sort_key()
            and not self.kv_cache_manager.num_unwritten_shared_blocks(r)
        ]
        if not idle:
            return False
        self._preempt(max(idle, key=Request.sort_key), step)
        return True

    def _preempt(self, victim: Request, step: _StepBuilder | None = None) -> None:
        """Free a running request's blocks and requeue it; it is recomputed
        later (Kwon et al. 2023, §4.5). If ``step`` had already scheduled it,
        its tokens go back to the budget."""
        if step is not None:
            # The cap is of the step as it stood before any preemption (the
            # running requests and the queue it reads are about to change).
            step.settle_prefill_budget()
        self.running.remove(victim)
        self.kv_cache_manager.free(victim, num_valid_tokens=victim.num_computed_tokens)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        num_ahead = self._placeholders.pop(victim.request_id, 0)
        if num_ahead:
            # Its launched step still samples a token, and the request's generator
            # draws for it: the token is appended when it arrives (before the
            # next schedule(), see EngineCore._launch_next), as the synchronous
            # engine would have, so a seeded stream does not depend on when the
            # request was preempted. On resume the worker gets the engine's tokens.
            self._preempted_placeholders[victim.request_id] = num_ahead
            victim.engine_chose_tokens = True
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        if victim.request_id in self._known_to_worker:
            self.preempted_req_ids.append(victim.request_id)
        self._enqueue_waiting(victim)
        if step is not None and victim in step.scheduled_running:
            step.scheduled_running.remove(victim)
            num_returned = step.num_scheduled_tokens.pop(victim.request_id)
            step.token_budget += num_returned
            if victim.request_id in step.prefill_req_ids:
                step.prefill_budget += num_returned
                step.prefill_req_ids.discard(victim.request_id)
            step.new_block_ids.pop(victim.request_id, None)
            step.spec_tokens.pop(victim.request_id, None)

    def _make_output(self, step: _StepBuilder) -> SchedulerOutput:
        """The step's ``SchedulerOutput`` (new requests, then running, then
        resumed ones), and the bookkeeping of what the worker now knows."""
        # Forked requests (beam search) run straight from their parent's blocks but
        # are new to the worker, which gets their whole block table and tokens.
        forked = [r for r in step.scheduled_running if r.request_id not in self._known_to_worker]
        if forked:
            step.scheduled_running = [r for r in step.scheduled_running if r not in forked]
            step.scheduled_new = forked + step.scheduled_new
            self._known_to_worker.update(r.request_id for r in forked)
            for r in forked:
                self.kv_cache_manager.take_cow_replaced(r.request_id)
        for r in step.scheduled_new:
            r.engine_chose_tokens = False

        def new_token_ids(r: Request) -> list[int]:
            if not r.engine_chose_tokens:
                return []
            r.engine_chose_tokens = False
            return r.all_token_ids[r.num_computed_tokens :]

        self._step_id += 1
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=r.all_token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=self._sampling_metadata(r),
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in step.scheduled_new
        ]
        cached_reqs = [
            CachedRequestData(
                req_id=r.request_id,
                new_block_ids=step.new_block_ids[r.request_id],
                num_computed_tokens=r.num_computed_tokens,
                cow_block_ids=self.kv_cache_manager.take_cow_replaced(r.request_id),
                new_token_ids=new_token_ids(r),
            )
            for r in step.scheduled_running
        ]
        cached_reqs += [
            CachedRequestData(
                req_id=r.request_id,
                new_block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                resumed=True,
                new_token_ids=new_token_ids(r),
            )
            for r in step.scheduled_resumed
        ]
        order = step.scheduled_new + step.scheduled_running + step.scheduled_resumed
        output = SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=[step.num_scheduled_tokens[r.request_id] for r in order],
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            scheduled_spec_decode_tokens=step.spec_tokens,
            copy_blocks=self.kv_cache_manager.take_copy_blocks(),
        )
        self.finished_req_ids = []
        self.preempted_req_ids = []
        self._scheduled_order = order
        self._record_step(output)
        return output

    @property
    def scheduled_requests(self) -> list[Request]:
        """The last ``schedule()``'s requests, in ``SchedulerOutput`` order."""
        return self._scheduled_order

    def _record_step(self, output: SchedulerOutput) -> None:
        stats = self.stats
        num_reqs = output.num_reqs
        stats.num_steps += num_reqs > 0
        stats.num_scheduled_reqs_last_step = num_reqs
        stats.num_scheduled_tokens_last_step = output.total_num_scheduled_tokens
        stats.max_reqs_in_step = max(stats.max_reqs_in_step, num_reqs)
        stats.num_multi_request_steps += num_reqs > 1
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)

    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """Advance the counters of the step ``schedule()`` just built, before it
        runs (async scheduling): ``num_computed_tokens`` moves by the scheduled
        tokens and each request that samples in it gets a placeholder token, so
        the next ``schedule()`` gives it its next position. Apply the output with
        ``update_from_output(output, runner_output, launched)``."""
        order = self._scheduled_order
        before = [r.num_computed_tokens for r in order]
        for request, num_new in zip(order, output.num_scheduled_tokens):
            rid = request.request_id
            if request.num_computed_tokens + num_new >= self._num_tokens_ahead(request):
                self._placeholders[rid] = self._placeholders.get(rid, 0) + 1
            request.num_computed_tokens += num_new
            self._num_in_flight[rid] = self._num_in_flight.get(rid, 0) + 1
        return LaunchedStep(list(order), before, [r.num_preemptions for r in order])

    def _update_launched(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput, launched: LaunchedStep
    ) -> list[tuple[Request, int | None, list[tuple[int, float]] | None]]:
        """``update_from_output`` for a launched step: counters already moved;
        tokens of requests that ended or were preempted since are dropped."""
        results: list[tuple[Request, int | None, list[tuple[int, float]] | None]] = []
        logprobs = runner_output.logprobs
        for k, request in enumerate(launched.requests):
            rid = request.request_id
            left = self._num_in_flight.get(rid, 0) - 1
            if left > 0:
                self._num_in_flight[rid] = left
            else:
                self._num_in_flight.pop(rid, None)
            if request.is_finished:
                continue
            if (
                request.status != RequestStatus.RUNNING
                or request.num_preemptions != launched.num_preemptions[k]
            ):
                # Preempted after it was scheduled: only a sampled token is kept.
                token = runner_output.sampled_token_ids[k]
                if token >= 0 and self._take_preempted_placeholder(request):
                    results.append(self._append_launched_token(request, token, logprobs, k))
                continue
            before = launched.num_computed_before[k]
            self.stats.num_prompt_tokens += max(
                0, min(before + output.num_scheduled_tokens[k], request.num_prompt_tokens) - before
            )
            token = runner_output.sampled_token_ids[k]
            if token < 0:
                results.append((request, None, None))
                continue
            left = self._placeholders.get(rid, 0) - 1
            if left > 0:
                self._placeholders[rid] = left
            else:
                self._placeholders.pop(rid, None)
            results.append(self._append_launched_token(request, token, logprobs, k))
        if self._deferred_free:
            done = [r for r in self._deferred_free if not self._num_in_flight.get(r.request_id)]
            self._deferred_free = [r for r in self._deferred_free if r not in done]
            for request in done:
                self.kv_cache_manager.free(request)
        return results

    def _take_preempted_placeholder(self, request: Request) -> bool:
        """Whether ``request``, preempted and still waiting, holds a placeholder
        of a launched step (one less after this)."""
        rid = request.request_id
        left = self._preempted_placeholders.get(rid, 0)
        if left > 1:
            self._preempted_placeholders[rid] = left - 1
        else:
            self._preempted_placeholders.pop(rid, None)
        return left > 0 and request.status == RequestStatus.PREEMPTED

    def _append_launched_token(
        self, request: Request, token: int, logprobs: list | None, k: int
    ) -> tuple[Request, int | None, list[tuple[int, float]] | None]:
        self.stats.num_generation_tokens += 1
        request.append_output_token_ids([token])
        self._check_stop(request, token)
        return (request, token, logprobs[k] if logprobs else None)

    def has_preempted_placeholders(self) -> bool:
        """A preempted request still waits for a launched step's token: nothing
        may be scheduled before that output is applied (async scheduling)."""
        return bool(self._preempted_placeholders)

    def update_from_output(
        self,
        output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        launched: LaunchedStep | None = None,
    ) -> list[tuple[Request, int | None, list[tuple[int, float]] | None]]:
        """Advance ``num_computed_tokens`` and append sampled tokens.

        Returns:
            ``(request, new_token_id or None, logprobs)`` per scheduled request
            still alive, in schedule order. Requests that reached EOS, a stop
            token, ``max_tokens`` or the context length are finished here.
            ``launched``: the step was ``launch``ed (async scheduling).
        """
        if self.config.chunked_prefill_itl_ratio and self.config.enable_chunked_prefill:
            self._observe_step_time(output, runner_output)  # only the cap reads the fit
        if launched is not None:
            return self._update_launched(output, runner_output, launched)
        results: list[tuple[Request, int | None, list[tuple[int, float]] | None]] = []
        logprobs = runner_output.logprobs
        drafts_of = output.scheduled_spec_decode_tokens
        spec_token_ids = runner_output.spec_token_ids
        sampled = runner_output.sampled_token_ids
        stats = self.stats
        running = RequestStatus.RUNNING
        for k, (request, num_new) in enumerate(
            zip(self._scheduled_order, output.num_scheduled_tokens)
        ):
            if request.status != running:
                continue  # finished (aborted) or preempted while the step ran
            if spec_token_ids is not None:
                request.spec_token_ids = spec_token_ids[k]
            drafts = drafts_of.get(request.request_id) if drafts_of else None
            if drafts:
                assert runner_output.num_accepted_tokens is not None  # a step with drafts
                results.extend(
                    self._apply_verified(
                        request,
                        num_new,
                        drafts,
                        runner_output.num_accepted_tokens[k],
                        runner_output.sampled_token_ids[k],
                    )
                )
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens = computed = before + num_new
            num_prompt_tokens = len(request.prompt_token_ids)
            if before < num_prompt_tokens:
                stats.num_prompt_tokens += min(computed, num_prompt_tokens) - before
            token = sampled[k]
            if token < 0 or computed < len(request.all_token_ids):
                results.append((request, None, None))
                continue
            stats.num_generation_tokens += 1
            request.append_output_token_ids([token])
            self._check_stop(request, token)
            results.append((request, token, logprobs[k] if logprobs else None))
        return results

    def _apply_verified(
        self, request: Request, num_new: int, drafts: list[int], num_accepted: int, token: int
    ) -> list[tuple[Request, int | None, list[tuple[int, float]] | None]]:
        """A decode step with drafts: emit the accepted drafts and the token after
        them, one at a time (a stop ends the rest), and roll the rejected
        drafts' slots back (``num_computed_tokens`` and blocks)."""
        assert self.spec is not None
        request.num_computed_tokens += num_new - (len(drafts) - num_accepted)
        self.spec.observe(request, len(drafts), num_accepted)
        results: list[tuple[Request, int | None, list[tuple[int, float]] | None]] = []
        for t in drafts[:num_accepted] + [token]:
            self.stats.num_generation_tokens += 1
            request.append_output_token_ids([t])
            results.append((request, t, None))
            self._check_stop(request, t)
            if request.is_finished:
                return results
        self.kv_cache_manager.rollback(request)
        return results

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        status = None
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
        if status is None and (
            num_output_tokens >= request.max_tokens
            or len(request.all_token_ids) >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_requests([request.request_id], status)
