"""What the chat and completion handlers share: one collect path (a
non-streaming response waits for every sample's final output) and one SSE
path (``data: {chunk}`` events per changed sample, an optional usage chunk,
then ``data: [DONE]``; OpenAI API reference, "Streaming").

Samples are numbered as the OpenAI API numbers choices: prompt ``p``'s sample
``i`` of ``n`` is choice ``p * n + i`` (a chat request has one prompt).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_json
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from aioengine.entrypoints.protocol import APIError
from aioengine.entrypoints.serving import RequestGroup
from aioengine.errors import EngineDeadError
from aioengine.sampling_params import CompletionOutput

SSE_DONE = b"data: [DONE]\n\n"


def sse(chunk: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying ``chunk`` as JSON."""
    if isinstance(chunk, BaseModel):
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class DeltaEvents:
    """The SSE events of plain text deltas (no logprobs, no finish or stop
    reason: every token of a stream but the last), without building and
    serializing a pydantic chunk per token (issue 16: at 32 streams that was
    the engine process's largest per-step cost after the socket writes).

    ``render(index, text)`` makes the event as the schema does; it is called
    once per choice index with a marker text, and the bytes around the marker's
    JSON are kept. Each event is then ``prefix + to_json(text) + suffix``:
    pydantic-core's own string encoder, so the bytes equal ``render``'s. If the
    marker is not found exactly once, every event is rendered.
    """

    _MARKER = "\x00aioengine-delta\x00"

    def __init__(self, render: Callable[[int, str], bytes]) -> None:
        self._render = render
        self._parts: dict[int, tuple[bytes, bytes] | None] = {}

    def event(self, index: int, text: str) -> bytes:
        """The event of choice ``index``'s delta ``text``."""
        try:
            parts = self._parts[index]
        except KeyError:
            parts = self._parts[index] = self._split(index)
        if parts is None:
            return self._render(index, text)
        return parts[0] + to_json(text) + parts[1]

    def _split(self, index: int) -> tuple[bytes, bytes] | None:
        marker = to_json(self._MARKER)
        full = self._render(index, self._MARKER)
        if full.count(marker) != 1:
            return None
        prefix, _, suffix = full.partition(marker)
        return prefix, suffix


def engine_unavailable(exc: EngineDeadError) -> APIError:
    return APIError(503, str(exc), None, "engine_unavailable")


def delta_logprobs(c: CompletionOutput) -> tuple[list[int], list[dict[int, float]]]:
    """The sampled tokens and logprob entries this update added."""
    n = len(c.delta_token_ids)
    if not n or c.logprobs is None:
        return [], []
    return c.delta_token_ids, c.logprobs[-n:]


class SSEResponse(StreamingResponse):
    """An event stream that aborts its engine requests however it ends: normal
    end, client disconnect (the generator is cancelled), or a disconnect before
    the generator ever started (then only this ``finally`` runs)."""

    def __init__(self, content: AsyncIterator[bytes], group: RequestGroup) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


async def until_disconnect(
    request: Request, group: RequestGroup, work: Awaitable[Response]
) -> Response:
    """Run a non-streaming request; abort it if the client disconnects first.

    The body has been read, so the next ASGI message is ``http.disconnect``.
    """

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            group.close()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


async def collect(group: RequestGroup, n: int) -> tuple[dict[int, CompletionOutput], int]:
    """Every choice's final output, and the prompt tokens served from the
    prefix cache (summed over prompts).

    Raises:
        APIError: 503 when the engine died or shut down meanwhile.
    """
    final: dict[int, CompletionOutput] = {}
    cached: dict[int, int] = {}
    try:
        async for prompt_index, out in group:
            cached[prompt_index] = out.num_cached_tokens
            for c in out.outputs:
                final[prompt_index * n + c.index] = c
    except EngineDeadError as exc:
        raise engine_unavailable(exc) from None
    return final, sum(cached.values())


async def stream_events(
    group: RequestGroup,
    n: int,
    choice_event: Callable[[int, CompletionOutput], bytes],
    usage_event: Callable[[int, int], bytes] | None,
) -> AsyncIterator[bytes]:
    """The SSE body after any opening events: ``choice_event(index, output)``
    for each choice that changed, ``usage_event(completion_tokens,
    cached_tokens)`` when usage was asked for, then ``[DONE]``. An engine that
    dies meanwhile ends the stream with an OpenAI error event, then ``[DONE]``."""
    num_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    try:
        async for prompt_index, out in group:
            cached[prompt_index] = out.num_cached_tokens
            for c in out.outputs:
                index = prompt_index * n + c.index
                num_tokens[index] = len(c.token_ids)
                if c.delta_text or c.delta_token_ids or c.finish_reason:
                    yield choice_event(index, c)
    except EngineDeadError as exc:
        yield sse(engine_unavailable(exc).body())
        yield SSE_DONE
        return
    if usage_event is not None:
        yield usage_event(sum(num_tokens.values()), sum(cached.values()))
    yield SSE_DONE
