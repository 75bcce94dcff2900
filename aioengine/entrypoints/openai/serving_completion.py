"""``POST /v1/completions`` (OpenAI API reference, "Create completion"): one
or more prompts (text or token ids), ``n`` samples each, optional ``echo``."""

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
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    make_usage,
    parse_request,
)
from aioengine.entrypoints.serving import OpenAIServing, RequestGroup
from aioengine.sampling_params import CompletionOutput


async def completions(request: Request) -> Response:
    serving: OpenAIServing = request.app.state.serving
    req = parse_request(CompletionRequest, await request.body())
    serving.check_model(req.model)
    req.check_supported()
    prompts = await serving.completion_prompts(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    plan = [(ids, text, serving.sampling_params(req, len(ids))) for ids, text in prompts]
    serving.check_queue_room([params for _, _, params in plan])
    await serving.prepare_structured_outputs(req, plan[0][2])
    group = RequestGroup(serving)
    try:
        admit_request(request, group, req.model, sum(len(ids) for ids, _, _ in plan))
        for i, (ids, _, params) in enumerate(plan):
            engine_id = request_id if len(plan) == 1 else f"{request_id}-{i}"
            group.add(serving.add_request(engine_id, ids, params, req))
    except APIError:
        group.close()
        raise
    n = plan[0][2].n
    echoes = [
        (text if text is not None else serving.engine.tokenizer.decode(ids)) if req.echo else ""
        for ids, text, _ in plan
    ]
    prompt_tokens = sum(len(ids) for ids, _, _ in plan)
    if req.stream:
        return SSEResponse(
            _completion_stream(serving, req, request_id, n, echoes, prompt_tokens, group), group
        )
    return await until_disconnect(
        request, group, _completion_full(serving, req, request_id, n, echoes, prompt_tokens, group)
    )


async def _completion_full(
    serving: OpenAIServing,
    req: CompletionRequest,
    request_id: str,
    n: int,
    echoes: list[str],
    prompt_tokens: int,
    group: RequestGroup,
) -> Response:
    final, cached = await collect(group, n)
    choices = []
    for index in sorted(final):
        c, echo = final[index], echoes[index // n]
        logprobs = None
        if req.logprobs is not None and c.logprobs is not None:
            logprobs = serving.completion_logprobs(c.token_ids, c.logprobs, req.logprobs, len(echo))
        choices.append(
            CompletionChoice(
                index=index,
                text=echo + c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    completion_tokens = sum(len(c.token_ids) for c in final.values())
    body = CompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=choices,
        usage=make_usage(prompt_tokens, completion_tokens, cached),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def _completion_stream(
    serving: OpenAIServing,
    req: CompletionRequest,
    request_id: str,
    n: int,
    echoes: list[str],
    prompt_tokens: int,
    group: RequestGroup,
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Any = None) -> bytes:
        return sse(
            CompletionChunk(
                id=request_id,
                created=created,
                model=serving.model_name,
                choices=choices,
                usage=usage,
            )
        )

    # Text offset of each choice's next delta (OpenAI's logprobs.text_offset).
    offsets = {index: len(echoes[index // n]) for index in range(len(echoes) * n)}

    deltas = DeltaEvents(lambda index, text: chunk([CompletionChoice(index=index, text=text)]))

    def choice_event(index: int, c: CompletionOutput) -> bytes:
        logprobs: CompletionLogprobs | None = None
        if req.logprobs is not None:
            ids, entries = delta_logprobs(c)
            logprobs = serving.completion_logprobs(ids, entries, req.logprobs, offsets[index])
        offsets[index] += len(c.delta_text)
        if logprobs is None and c.finish_reason is None and c.stop_reason is None:
            return deltas.event(index, c.delta_text)
        return chunk(
            [
                CompletionChoice(
                    index=index,
                    text=c.delta_text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            ]
        )

    def usage_event(completion_tokens: int, cached: int) -> bytes:
        return chunk([], make_usage(prompt_tokens, completion_tokens, cached))

    if req.echo:
        for index in range(len(echoes) * n):
            yield chunk([CompletionChoice(index=index, text=echoes[index // n])])
    async for event in stream_events(
        group, n, choice_event, usage_event if req.include_usage else None
    ):
        yield event
