"""Request state as counters, not phases (vLLM v1 style).

A request has ``num_tokens`` tokens (prompt plus output so far) of which
``num_computed_tokens`` have their K/V in the cache. Each step the scheduler
hands it ``num_tokens - num_computed_tokens`` new tokens or fewer (a prefill
chunk); there is no separate prefill or decode phase.
"""

from __future__ import annotations

import enum
import time

from aioengine.sampling_params import SamplingParams
from aioengine.structured.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id (a parent with ``n > 1`` fans out to children).
        prompt_token_ids: prompt tokens.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose K/V are in the cache.
        num_cached_tokens: prompt tokens found in the prefix cache when first
            scheduled (-1 before that).
        block_hashes: chained hashes of this request's full blocks, extended
            as tokens are appended.
        priority: lower runs first (vLLM semantics); FCFS within a priority.
        arrival_time: ``time.monotonic()`` seconds at arrival.
        max_tokens: resolved limit of new tokens (never None here).
        cache_salt: extra key that keeps this tenant's blocks private.
        structured_output_request: grammar and matcher of a constrained
            request (None when unconstrained).
        spec_token_ids: draft tokens the worker proposed after the last
            token (speculative decoding); not part of ``all_token_ids``.
        engine_chose_tokens: the engine replaced tokens the worker sampled (beam
            search); the next step sends the worker the uncomputed tokens.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams,
                 max_tokens: int, eos_token_id: int | None, priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: str | int | None = None
        self.seed = 0  # of this request's own generator, set by the engine
        self.first_scheduled_time: float | None = None
        self.structured_output_request: StructuredOutputRequest | None = None
        self.spec_token_ids: list[int] = []
        self.engine_chose_tokens = False

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def pop_output_token(self, block_size: int) -> int:
        """Drop and return the last generated token (beam search keeps continuations
        the worker did not sample); block hashes that covered it are forgotten."""
        token = self.output_token_ids.pop()
        self.all_token_ids.pop()
        del self.block_hashes[len(self.all_token_ids) // block_size:]
        return token

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
