"""``POST /v1/chat/completions`` (OpenAI API reference, "Create chat completion").

The conversation is rendered with the model's chat template; tool calls in
the output are parsed per the model's format (``tools/parsers.py``), in the
stream too (``delta.tool_calls``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aioengine.entrypoints.openai.middleware import admit_request
from aioengine.entrypoints.openai.streaming import (
    DeltaEvents,
    SSEResponse,
    collect,
    delta_logprobs,
    sse,
    stream_events,
    until_disconnect,
)
from aioengine.entrypoints.protocol import (
    APIError,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    make_usage,
    parse_request,
)
from aioengine.entrypoints.serving import OpenAIServing, RequestGroup
from aioengine.sampling_params import CompletionOutput


async def chat_completions(request: Request) -> Response:
    serving: OpenAIServing = request.app.state.serving
    req = parse_request(ChatCompletionRequest, await request.body())
    serving.check_model(req.model)
    req.check_supported()
    prompt_ids = await serving.chat_prompt(req)
    params = serving.sampling_params(req, len(prompt_ids))
    await serving.prepare_structured_outputs(req, params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = RequestGroup(serving)
    try:
        admit_request(request, group, req.model, len(prompt_ids))
        group.add(serving.add_request(request_id, prompt_ids, params, req))
    except APIError:
        group.close()
        raise
    if req.stream:
        return SSEResponse(
            _chat_stream(serving, req, request_id, params.n, len(prompt_ids), group), group
        )
    return await until_disconnect(
        request, group, _chat_full(serving, req, request_id, params.n, len(prompt_ids), group)
    )


async def _chat_full(
    serving: OpenAIServing,
    req: ChatCompletionRequest,
    request_id: str,
    n: int,
    prompt_len: int,
    group: RequestGroup,
) -> Response:
    final, cached = await collect(group, n)
    choices = []
    for index in sorted(final):
        c = final[index]
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            logprobs = ChatChoiceLogprobs(
                content=serving.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
            )
        message, finish_reason = serving.chat_message(req, c)
        choices.append(
            ChatCompletionChoice(
                index=index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    completion_tokens = sum(len(c.token_ids) for c in final.values())
    body = ChatCompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=choices,
        usage=make_usage(prompt_len, completion_tokens, cached),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def _chat_stream(
    serving: OpenAIServing,
    req: ChatCompletionRequest,
    request_id: str,
    n: int,
    prompt_len: int,
    group: RequestGroup,
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(choices: list[ChatCompletionStreamChoice], usage: Any = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=request_id,
                created=created,
                model=serving.model_name,
                choices=choices,
                usage=usage,
            )
        )

    # With tools, each choice's text goes through its tool-call parser: content
    # deltas, then delta.tool_calls (id and name once, then argument fragments).
    streamers = {index: serving.tool_call_streamer(req) for index in range(n)}

    deltas = DeltaEvents(
        lambda index, text: chunk(
            [ChatCompletionStreamChoice(index=index, delta={"content": text})]
        )
    )

    def choice_event(index: int, c: CompletionOutput) -> bytes:
        logprobs = None
        if req.logprobs:
            ids, entries = delta_logprobs(c)
            logprobs = ChatChoiceLogprobs(
                content=serving.chat_logprobs(ids, entries, req.top_logprobs or 0)
            )
        delta: dict[str, Any] = {"content": c.delta_text}
        finish_reason = c.finish_reason
        streamer = streamers[index]
        if (
            streamer is None
            and logprobs is None
            and finish_reason is None
            and c.stop_reason is None
        ):
            return deltas.event(index, c.delta_text)
        if streamer is not None:
            content, calls = streamer.finish(c.text) if c.finish_reason else streamer.update(c.text)
            delta = {"content": content} if content or not calls else {}
            if calls:
                delta["tool_calls"] = calls
            if finish_reason == "stop" and streamer.tool_calls:
                finish_reason = "tool_calls"
        return chunk(
            [
                ChatCompletionStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            ]
        )

    def usage_event(completion_tokens: int, cached: int) -> bytes:
        return chunk([], make_usage(prompt_len, completion_tokens, cached))

    for index in range(n):
        yield chunk(
            [ChatCompletionStreamChoice(index=index, delta={"role": "assistant", "content": ""})]
        )
    async for event in stream_events(
        group, n, choice_event, usage_event if req.include_usage else None
    ):
        yield event
