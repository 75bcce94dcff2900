"""Parallel sampling: one request with ``n > 1`` as ``n`` child requests.

The children share the prompt (and so, through prefix caching, its KV
blocks) and are scheduled and sampled independently; their outputs are
gathered back into one ``RequestOutput`` per step with only the samples that
changed. A request with ``n == 1`` is its own single child (same id), so the
rest of the engine has one path. Child ``i`` of request ``r`` is ``"r#i"``, as
in vLLM's ``ParentRequest``.
"""

from __future__ import annotations

import dataclasses

from aioengine.engine.input_processor import EngineCoreRequest
from aioengine.sampling_params import CompletionOutput, RequestOutput, SamplingParams


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
