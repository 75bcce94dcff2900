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
from dataclasses import dataclass

from aioengine.config import SchedulerConfig
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.ipc.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from aioengine.request import Request, RequestStatus


class SchedulerQueueFull(RuntimeError):
    """The waiting queue is at ``max_waiting_requests`` (HTTP 429)."""


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


class Scheduler:
    """Decides what runs each step and applies the sampled tokens.

    Args:
        config: limits.
        kv_cache_manager: owner of the block tables.
        max_model_len: context length in tokens.
        sampling_metadata: builds the worker-side sampling settings of a request.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, sampling_metadata) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self._sampling_metadata = sampling_metadata
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []   # sorted by Request.sort_key()
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []
        self.preempted_req_ids: list[str] = []
        self._known_to_worker: set[str] = set()
        self.stats = SchedulerStats()
        self._step_id = 0

    # -- requests in and out ------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            SchedulerQueueFull: the waiting queue is full.
        """
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise SchedulerQueueFull(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def add_forked_request(self, parent: Request, child: Request) -> None:
        """Start ``child`` from ``parent``'s KV blocks (beam search's fork).

        The child's first ``parent.num_computed_tokens`` tokens must be the
        parent's. A running parent shares its written blocks with the child
        (``KVCacheManager.fork``) and the child runs from the next step on,
        reaching the worker as a new request; a parent without blocks
        (preempted) leaves the child to wait and recompute like any request.
        """
        self.requests[child.request_id] = child
        if parent.status == RequestStatus.RUNNING and parent.request_id in self.kv.req_to_blocks:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
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
        self.kv.free(request)
        if request.request_id in self._known_to_worker:
            self._known_to_worker.discard(request.request_id)
            self.finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []

        def pick_victim(than: Request | None = None) -> Request | None:
            """The lowest-priority, latest-arrived running request; with ``than``,
            only one of strictly lower priority than it. A request whose blocks
            other requests hit earlier in this step is never picked: they read
            the K/V it is about to write."""
            candidates = [r for r in self.running
                          if not self.kv.num_unwritten_shared_blocks(r)]
            if not candidates:
                return None
            victim = max(candidates, key=Request.sort_key)
            if than is not None and victim.priority <= than.priority:
                return None
            return victim

        def preempt_worst(than: Request | None = None) -> Request | None:
            nonlocal budget
            victim = pick_victim(than)
            if victim is None:
                return None
            self._preempt(victim)
            if victim in scheduled_running:
                scheduled_running.remove(victim)
                budget += num_scheduled.pop(victim.request_id)
                new_block_ids.pop(victim.request_id, None)
            return victim

        # Running requests first: a decode token each, or the next prompt chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = self.kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = pick_victim()
                if victim is None:
                    break
                victim_index = self.running.index(victim)
                preempt_worst()
                if victim is request:
                    break
                if victim_index < i:
                    i -= 1
                new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is None:
                if request in self.running:
                    i += 1  # nothing could be preempted for it; it waits a step
                continue  # else it was itself preempted and the list shifted
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            budget -= num_new
            i += 1

        # Then waiting ones in (priority, arrival) order. A waiting request of
        # strictly higher priority than a running one may preempt it for a seat
        # or for blocks.
        scheduled_new: list[Request] = []
        resumed: list[Request] = []
        blocked_by_preemption = bool(self.preempted_req_ids)
        next_waiting = 0  # index of the next waiting request to consider
        while next_waiting < len(self.waiting) and budget > 0:
            request = self.waiting[next_waiting]
            if (request.structured_output_request is not None
                    and not request.structured_output_request.is_ready()):
                next_waiting += 1  # its grammar is still compiling: it waits, others go
                continue
            if blocked_by_preemption and request.priority >= min(
                    (r.priority for r in self.running), default=request.priority):
                break
            if len(self.running) >= self.config.max_num_seqs:
                if preempt_worst(than=request) is None:
                    break
                continue
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks)
            if new_blocks is None:
                if preempt_worst(than=request) is None:
                    break
                continue
            self.waiting.pop(next_waiting)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if request.request_id in self._known_to_worker:
                resumed.append(request)
            else:
                scheduled_new.append(request)
                self._known_to_worker.add(request.request_id)

        # Forked requests (beam search) run straight from their parent's blocks but
        # are new to the worker.
        forked = [r for r in scheduled_running if r.request_id not in self._known_to_worker]
        if forked:
            scheduled_running = [r for r in scheduled_running if r not in forked]
            scheduled_new = forked + scheduled_new
            self._known_to_worker.update(r.request_id for r in forked)
            for r in forked:
                r.engine_chose_tokens = False
                self.kv.take_cow_replaced(r.request_id)  # its whole table is sent

        def new_token_ids(r: Request) -> list[int]:
            if not r.engine_chose_tokens:
                return []
            r.engine_chose_tokens = False
            return r.all_token_ids[r.num_computed_tokens:]

        for r in scheduled_new:
            r.engine_chose_tokens = False
        self._step_id += 1
        new_reqs = [NewRequestData(
            req_id=r.request_id, token_ids=r.all_token_ids,
            num_prompt_tokens=r.num_prompt_tokens,
            sampling=self._sampling_metadata(r),
            block_ids=self.kv.get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens) for r in scheduled_new]
        cached_reqs = [CachedRequestData(
            req_id=r.request_id, new_block_ids=new_block_ids[r.request_id],
            num_computed_tokens=r.num_computed_tokens,
            cow_block_ids=self.kv.take_cow_replaced(r.request_id),
            new_token_ids=new_token_ids(r)) for r in scheduled_running]
        cached_reqs += [CachedRequestData(
            req_id=r.request_id, new_block_ids=self.kv.get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens, resumed=True,
            new_token_ids=new_token_ids(r)) for r in resumed]
        order = scheduled_new + scheduled_running + resumed
        output = SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=[num_scheduled[r.request_id] for r in order],
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            copy_blocks=self.kv.take_copy_blocks(),
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

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request, num_valid_tokens=request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if request.request_id in self._known_to_worker:
            self.preempted_req_ids.append(request.request_id)
        self._enqueue_waiting(request)

    def _record_step(self, output: SchedulerOutput) -> None:
        s = self.stats
        n = output.num_reqs
        s.num_steps += n > 0
        s.num_scheduled_reqs_last_step = n
        s.num_scheduled_tokens_last_step = output.total_num_scheduled_tokens
        s.max_reqs_in_step = max(s.max_reqs_in_step, n)
        s.num_multi_request_steps += n > 1
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput
                           ) -> list[tuple[Request, int | None, list[tuple[int, float]] | None]]:
        """Advance ``num_computed_tokens`` and append sampled tokens.

        Returns:
            ``(request, new_token_id or None, logprobs)`` per scheduled request
            still alive, in schedule order. Requests that reached EOS, a stop
            token, ``max_tokens`` or the context length are finished here.
        """
        results = []
        logprobs = runner_output.logprobs
        for k, (request, num_new) in enumerate(zip(self._scheduled_order,
                                                   output.num_scheduled_tokens)):
            if request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            before = request.num_computed_tokens
            request.num_computed_tokens += num_new
            self.stats.num_prompt_tokens += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - before)
            token = runner_output.sampled_token_ids[k]
            if token < 0 or request.num_computed_tokens < request.num_tokens:
                results.append((request, None, None))
                continue
            self.stats.num_generation_tokens += 1
            request.append_output_token_ids([token])
            self._check_stop(request, token)
            results.append((request, token, logprobs[k] if logprobs else None))
        return results

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        status = None
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
        if status is None and (request.num_output_tokens >= request.max_tokens
                               or request.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_requests([request.request_id], status)
