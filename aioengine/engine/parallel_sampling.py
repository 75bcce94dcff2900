"""Parallel sampling: one request with ``n > 1`` as ``n`` child requests.

The children share the prompt's KV blocks and are scheduled and sampled
independently; their outputs are gathered back into one ``RequestOutput``
per step with only the samples that changed. A request with ``n == 1`` is its
own single child (same id), so the rest of the engine has one path. Child
``i`` of request ``r`` is ``"r#i"``, as in vLLM's ``ParentRequest``.

Child 0 prefills the prompt alone; the others wait in ``SampleForks`` and
fork its block table once that prefill has run, the partial last block
included (PagedAttention, Kwon et al. 2023, §4.4), so the prompt is computed
and stored once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aioengine.engine.input_processor import EngineCoreRequest
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import CompletionOutput, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from aioengine.core.scheduler import Scheduler


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def parent_request_id(child_id: str) -> str:
    """The id of the request a child id belongs to (itself when ``n == 1``)."""
    return child_id.rpartition("#")[0] or child_id


class ParentRequest:
    """The ``n`` samples of one request and what has been streamed of them.

    Attributes:
        completions: per sample, the cumulative ``CompletionOutput``.
        num_cached_tokens: prompt tokens served from the prefix cache
            (the first child scheduled reports it; -1 before).
    """

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request_id = request.request_id
        self.params: SamplingParams = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.n = self.params.n
        self.completions = [CompletionOutput(index=i) for i in range(self.n)]
        self.num_cached_tokens = -1
        self.child_requests = [
            dataclasses.replace(
                request,
                request_id=child_request_id(request.request_id, i, self.n),
                seed=None if self.params.seed is None else self.params.seed + i,
            )
            for i in range(self.n)
        ]

    @property
    def child_request_ids(self) -> list[str]:
        return [c.request_id for c in self.child_requests]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def make_request_output(self, indices: list[int], error: str | None = None) -> RequestOutput:
        """The ``RequestOutput`` of this step: snapshots of the samples ``indices``."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_snapshot(self.completions[i]) for i in indices],
            finished=self.finished,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            error=error,
        )


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        c.delta_text,
        list(c.delta_token_ids),
        list(c.logprobs) if c.logprobs is not None else None,
        c.finish_reason,
        c.stop_reason,
    )


class SampleForks:
    """Children 1..n-1 of ``n > 1`` requests, waiting for child 0's prefill.

    Once the step that completes child 0's prefill has run (``fork_after_step``,
    before the step's output is applied, so a child 0 that ends on its first
    token still holds its blocks), each waiting child takes child 0's block
    table for the prompt with every reference count raised, the partial last
    block's too (``Scheduler.add_forked_request``), and computes from the
    prompt's last token on: that token's logits give its first sample, drawn
    from its own generator (the seed and its draws are those of a child that
    prefilled alone), and its write is the partial block's copy-on-write. A
    child for which no seat of ``max_num_seqs`` is free then, or whose grammar
    is still compiling, is queued instead and recomputes the prompt past the
    prefix cache's full blocks. Each child was counted against
    ``max_waiting_requests`` when its request was admitted.

    Args:
        scheduler: where forked and queued children go.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._waiting: dict[str, list[Request]] = {}  # child 0's id -> the others

    @property
    def num_waiting(self) -> int:
        """Children waiting for a prefill (not in the scheduler yet)."""
        return sum(len(children) for children in self._waiting.values())

    def get(self, request_id: str) -> Request | None:
        """A child waiting for a fork, or None."""
        for children in self._waiting.values():
            for child in children:
                if child.request_id == request_id:
                    return child
        return None

    def add(self, first: Request, others: list[Request]) -> None:
        """Queue ``first``; ``others`` fork from it once its prefill has run.

        Raises:
            SchedulerQueueFull: from the scheduler, for ``first``.
        """
        self.scheduler.add_request(first)
        if others:
            self._waiting[first.request_id] = others

    def fork_after_step(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        """Fork the children of every child 0 whose prefill the step that just
        ran completed.

        Args:
            scheduled: the step's ``(request, num_scheduled_tokens)``, the
                requests' counters not yet advanced by it.
        """
        for first, num_new in scheduled:
            if (
                first.request_id not in self._waiting
                or first.num_computed_tokens + num_new < first.num_tokens
            ):
                continue
            others = self._waiting.pop(first.request_id)
            if first.status != RequestStatus.RUNNING:
                self._queue(others)  # ended while the step ran
                continue
            for child in others:
                structured = child.structured_output_request
                if self.scheduler.num_free_seats and (structured is None or structured.is_ready()):
                    self.scheduler.add_forked_request(first, child, first.num_tokens)
                else:
                    self._queue([child])

    def discard(self, request_ids: Iterable[str]) -> None:
        """Forget ended children; the children of an ended child 0 are queued."""
        ended = set(request_ids)
        for first_id in list(self._waiting):
            others = [c for c in self._waiting[first_id] if c.request_id not in ended]
            if first_id in ended:
                del self._waiting[first_id]
                self._queue(others)
            elif others:
                self._waiting[first_id] = others
            else:
                del self._waiting[first_id]

    def _queue(self, children: list[Request]) -> None:
        for child in children:
            self.scheduler.add_request(child, check_queue_limit=False)
