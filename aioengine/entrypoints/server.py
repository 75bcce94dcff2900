"""The HTTP server: a Starlette app with OpenAI-compatible routes.

``build_app(config, ...)`` returns the app; its lifespan starts the
``AsyncEngine`` and shuts it down. Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions``: JSON, or SSE with
  ``"stream": true`` (``data: {chunk}`` events, then ``data: [DONE]``).
- ``GET /v1/models``, ``GET /health``, ``GET /v1/engine/stats`` (``EngineStats``
  as JSON), ``GET /metrics`` (Prometheus), ``POST /tokenize``,
  ``POST /detokenize`` (vLLM shapes).
- ``/v1/ws``: the WebSocket protocol (``websocket.py``, docs/websocket.md).
- ``/``: the chat page from ``web/`` when the folder has an ``index.html``
  (Starlette's ``StaticFiles``: nothing outside that folder is served).

CORS is off (no ``Access-Control-Allow-*`` headers) unless ``allowed_origins``
lists origins, and a WebSocket handshake from a browser page of another
origin is refused with 403 unless that origin is listed.

A client that disconnects aborts its request at once, streaming or not, so
its KV blocks are freed. Errors are OpenAI-shaped JSON (``protocol.APIError``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import EngineDeadError
from aioengine.entrypoints.protocol import (
    bearer_token,
    APIError,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelQuantization,
    TokenizeRequest,
    TokenizeResponse,
    make_usage,
    parse_request,
)
from aioengine.entrypoints.serving import OpenAIServing, RequestGroup
from aioengine.sampling_params import CompletionOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_WS_REQUESTS = 16
# The chat page: web/ of the repository (a checkout or an editable install),
# else the copy a wheel installs as aioengine/web (pyproject's package-dir).
_REPO_WEB_DIR = Path(__file__).resolve().parents[2] / "web"
DEFAULT_WEB_DIR = (_REPO_WEB_DIR if (_REPO_WEB_DIR / "index.html").is_file()
                   else Path(__file__).resolve().parents[1] / "web")
# Paths served without an API key: the health probe and the static chat page
# (which then authenticates its WebSocket itself).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/metrics", "/reset_prefix_cache")


# -- errors and middleware -------------------------------------------------------------------


def error_response(exc: APIError) -> JSONResponse:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        error = APIError(404, f"no route for {method} {path}", None, "unknown_route")
    elif exc.status_code == 405:
        allowed = headers.get("Allow", "")
        error = APIError(405, f"{method} is not allowed on {path}"
                         + (f" (allowed: {allowed})" if allowed else ""), None,
                         "method_not_allowed")
    else:
        error = APIError(exc.status_code, exc.detail or "request failed", None, None)
    response = error_response(error)
    response.headers.update(headers)  # 405's Allow
    return response


async def _client_disconnect_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # gone while sending its body; nobody reads this


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response and uvicorn logs the traceback.
    return error_response(APIError(500, "internal server error", None, "internal_error"))


class APIKeyMiddleware:
    """401 for HTTP requests to protected paths without ``Authorization: Bearer KEY``.

    WebSockets authenticate in their own protocol (query parameter or an
    ``auth`` message), since browsers cannot set headers on them.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            token = bearer_token(dict(scope["headers"]).get(b"authorization"))
            if token is None or not hmac.compare_digest(token.encode("latin-1"),
                                                        self.expected):
                response = error_response(APIError(
                    401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    None, "invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for HTTP bodies over ``max_body_bytes`` (checked on ``Content-Length``
    and again while chunked bodies are read)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_body_bytes} bytes", None,
                        "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


class WebSocketOriginMiddleware:
    """403 for a WebSocket handshake whose ``Origin`` is neither this server's
    own (same scheme-less host and port as ``Host``) nor in ``allowed_origins``.

    Browsers send ``Origin`` on every WebSocket handshake and, unlike
    ``fetch``, apply no CORS check to WebSockets, so without this any web page
    a user visits could drive the API through their browser. Clients that are
    not browsers (``websockets``, the terminal chat) send no ``Origin`` and are
    let through. ``"*"`` in ``allowed_origins`` allows every origin.
    """

    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allow_all = "*" in allowed_origins
        self.allowed = {o.rstrip("/").lower() for o in allowed_origins}

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        if self.allow_all or origin in self.allowed:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(host) and parts.netloc == host.lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            headers = dict(scope["headers"])
            origin = headers.get(b"origin")
            if origin is not None and not self.origin_allowed(
                    origin.decode("latin-1"), headers.get(b"host", b"").decode("latin-1")):
                logger.warning("refused a WebSocket from origin %r", origin.decode("latin-1"))
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008})  # the server answers 403
                return
        await self.app(scope, receive, send)


# -- responses -------------------------------------------------------------------------------


def _sse(chunk: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(chunk, BaseModel):
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that aborts its engine requests however it ends: normal
    end, client disconnect (the generator is cancelled), or a disconnect before
    the generator ever started (then only this ``finally`` runs)."""

    def __init__(self, content: AsyncIterator[bytes], group: RequestGroup) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


async def _until_disconnect(request: Request, group: RequestGroup,
                            work: Awaitable[Response]) -> Response:
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


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def _delta_logprobs(c: CompletionOutput) -> tuple[list[int], list[dict[int, float]]]:
    """The sampled tokens and logprob entries this update added."""
    n = len(c.delta_token_ids)
    if not n or c.logprobs is None:
        return [], []
    return c.delta_token_ids, c.logprobs[-n:]


# -- chat completions ------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    serving = _serving(request)
    req = parse_request(ChatCompletionRequest, await request.body())
    serving.check_model(req.model)
    req.check_supported()
    prompt_ids = await serving.chat_prompt(req)
    params = serving.sampling_params(req, len(prompt_ids))
    await serving.prepare_structured_outputs(req, params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = RequestGroup(serving)
    group.add(serving.add_request(request_id, prompt_ids, params, req))
    if req.stream:
        return SSEResponse(_chat_stream(serving, req, request_id, params.n, len(prompt_ids),
                                        group), group)
    return await _until_disconnect(request, group, _chat_full(serving, req, request_id,
                                                              len(prompt_ids), group))


async def _chat_full(serving: OpenAIServing, req: ChatCompletionRequest, request_id: str,
                     prompt_len: int, group: RequestGroup) -> Response:
    final: dict[int, CompletionOutput] = {}
    cached = 0
    try:
        async for _, out in group:
            cached = out.num_cached_tokens
            for c in out.outputs:
                final[c.index] = c
    except EngineDeadError as exc:
        raise APIError(503, str(exc), None, "engine_unavailable") from None
    choices = []
    for index in sorted(final):
        c = final[index]
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=serving.chat_logprobs(
                c.token_ids, c.logprobs, req.top_logprobs or 0))
        message, finish_reason = serving.chat_message(req, c)
        choices.append(ChatCompletionChoice(
            index=index, message=message, logprobs=logprobs,
            finish_reason=finish_reason, stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in final.values())
    body = ChatCompletionResponse(id=request_id, model=serving.model_name, choices=choices,
                                  usage=make_usage(prompt_len, completion_tokens, cached))
    return Response(body.model_dump_json(), media_type="application/json")


async def _chat_stream(serving: OpenAIServing, req: ChatCompletionRequest, request_id: str,
                       n: int, prompt_len: int, group: RequestGroup) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> bytes:
        return _sse(ChatCompletionChunk(id=request_id, created=created, model=serving.model_name,
                                        choices=choices, usage=usage))

    for index in range(n):
        yield chunk([ChatCompletionStreamChoice(index=index,
                                                delta={"role": "assistant", "content": ""})])
    num_tokens: dict[int, int] = {}
    cached = 0
    # With tools, each choice's text goes through its tool-call parser: content
    # deltas, then delta.tool_calls (id and name once, then argument fragments).
    streamers = {index: serving.tool_call_streamer(req) for index in range(n)}
    try:
        async for _, out in group:
            cached = out.num_cached_tokens
            for c in out.outputs:
                num_tokens[c.index] = len(c.token_ids)
                if not (c.delta_text or c.delta_token_ids or c.finish_reason):
                    continue
                logprobs = None
                if req.logprobs:
                    ids, entries = _delta_logprobs(c)
                    logprobs = ChatChoiceLogprobs(content=serving.chat_logprobs(
                        ids, entries, req.top_logprobs or 0))
                delta: dict[str, Any] = {"content": c.delta_text}
                finish_reason = c.finish_reason
                streamer = streamers[c.index]
                if streamer is not None:
                    content, calls = (streamer.finish(c.text) if c.finish_reason
                                      else streamer.update(c.text))
                    delta = {"content": content} if content or not calls else {}
                    if calls:
                        delta["tool_calls"] = calls
                    if finish_reason == "stop" and streamer.tool_calls:
                        finish_reason = "tool_calls"
                yield chunk([ChatCompletionStreamChoice(
                    index=c.index, delta=delta, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=c.stop_reason)])
    except EngineDeadError as exc:
        yield _sse(APIError(503, str(exc), None, "engine_unavailable").body())
        yield _SSE_DONE
        return
    if req.include_usage:
        yield chunk([], make_usage(prompt_len, sum(num_tokens.values()), cached))
    yield _SSE_DONE


# -- completions -----------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    serving = _serving(request)
    req = parse_request(CompletionRequest, await request.body())
    serving.check_model(req.model)
    req.check_supported()
    prompts = await serving.completion_prompts(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    plan = [(ids, text, serving.sampling_params(req, len(ids))) for ids, text in prompts]
    await serving.prepare_structured_outputs(req, plan[0][2])
    group = RequestGroup(serving)
    try:
        for i, (ids, _, params) in enumerate(plan):
            engine_id = request_id if len(plan) == 1 else f"{request_id}-{i}"
            group.add(serving.add_request(engine_id, ids, params, req))
    except APIError:
        group.close()
        raise
    n = plan[0][2].n
    echoes = [(text if text is not None else serving.engine.tokenizer.decode(ids))
              if req.echo else "" for ids, text, _ in plan]
    prompt_tokens = sum(len(ids) for ids, _, _ in plan)
    if req.stream:
        return SSEResponse(_completion_stream(serving, req, request_id, n, echoes, prompt_tokens,
                                              group), group)
    return await _until_disconnect(request, group, _completion_full(
        serving, req, request_id, n, echoes, prompt_tokens, group))


async def _completion_full(serving: OpenAIServing, req: CompletionRequest, request_id: str,
                           n: int, echoes: list[str], prompt_tokens: int,
                           group: RequestGroup) -> Response:
    final: dict[int, CompletionOutput] = {}
    cached: dict[int, int] = {}
    try:
        async for prompt_index, out in group:
            cached[prompt_index] = out.num_cached_tokens
            for c in out.outputs:
                final[prompt_index * n + c.index] = c
    except EngineDeadError as exc:
        raise APIError(503, str(exc), None, "engine_unavailable") from None
    choices = []
    for index in sorted(final):
        c, echo = final[index], echoes[index // n]
        logprobs = None
        if req.logprobs is not None and c.logprobs is not None:
            logprobs = serving.completion_logprobs(c.token_ids, c.logprobs, req.logprobs,
                                                   len(echo))
        choices.append(CompletionChoice(index=index, text=echo + c.text, logprobs=logprobs,
                                        finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in final.values())
    body = CompletionResponse(id=request_id, model=serving.model_name, choices=choices,
                              usage=make_usage(prompt_tokens, completion_tokens,
                                               sum(cached.values())))
    return Response(body.model_dump_json(), media_type="application/json")


async def _completion_stream(serving: OpenAIServing, req: CompletionRequest, request_id: str,
                             n: int, echoes: list[str], prompt_tokens: int,
                             group: RequestGroup) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage=None) -> bytes:
        return _sse(CompletionChunk(id=request_id, created=created, model=serving.model_name,
                                    choices=choices, usage=usage))

    num_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    cached: dict[int, int] = {}
    for index in range(len(echoes) * n):
        offsets[index] = len(echoes[index // n])
        if req.echo:
            yield chunk([CompletionChoice(index=index, text=echoes[index // n])])
    try:
        async for prompt_index, out in group:
            cached[prompt_index] = out.num_cached_tokens
            for c in out.outputs:
                index = prompt_index * n + c.index
                num_tokens[index] = len(c.token_ids)
                if not (c.delta_text or c.delta_token_ids or c.finish_reason):
                    continue
                logprobs: CompletionLogprobs | None = None
                if req.logprobs is not None:
                    ids, entries = _delta_logprobs(c)
                    logprobs = serving.completion_logprobs(ids, entries, req.logprobs,
                                                           offsets[index])
                offsets[index] += len(c.delta_text)
                yield chunk([CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs,
                                              finish_reason=c.finish_reason,
                                              stop_reason=c.stop_reason)])
    except EngineDeadError as exc:
        yield _sse(APIError(503, str(exc), None, "engine_unavailable").body())
        yield _SSE_DONE
        return
    if req.include_usage:
        yield chunk([], make_usage(prompt_tokens, sum(num_tokens.values()),
                                   sum(cached.values())))
    yield _SSE_DONE


# -- other routes ----------------------------------------------------------------------------


async def list_models(request: Request) -> Response:
    serving = _serving(request)
    info = serving.engine.model_info
    quantization = None if info is None else ModelQuantization(
        method=info.quantization, weight_formats=info.weight_formats)
    body = ModelList(data=[ModelCard(id=serving.model_name, root=serving.engine.model_path,
                                     max_model_len=serving.max_model_len,
                                     created=int(serving.engine.started_at),
                                     quantization=quantization)])
    return Response(body.model_dump_json(), media_type="application/json")


async def health(request: Request) -> Response:
    """200 while the engine serves; 503 (with ``Retry-After``) while its worker
    restarts, before it started, and once the server drains for shutdown."""
    serving: OpenAIServing | None = getattr(request.app.state, "serving", None)
    if serving is None or not serving.engine.healthy:
        return error_response(APIError(503, "the engine is not healthy (its model worker is "
                                       "starting or restarting)", None, "engine_unavailable",
                                       retry_after=1.0))
    if serving.engine.draining:
        return error_response(APIError(503, "the server is shutting down", None,
                                       "engine_unavailable"))
    return Response(status_code=200)


async def engine_stats(request: Request) -> Response:
    """``EngineStats`` as JSON; ``?block_map=1`` fills ``block_usage_map``."""
    serving = _serving(request)
    stats = serving.engine.stats(
        include_block_map=request.query_params.get("block_map") in ("1", "true"))
    return JSONResponse(dataclasses.asdict(stats))


async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prefix block (vLLM's ``POST /reset_prefix_cache``), e.g.
    before a cold-start benchmark. 200 ``{"reset": true}``; 409 while requests hold
    blocks (nothing changes then)."""
    serving = _serving(request)
    if not serving.engine.reset_prefix_cache():
        raise APIError(409, "requests are running: the prefix cache can only be reset "
                       "when no request holds KV blocks; nothing was changed", None,
                       "requests_running")
    return JSONResponse({"reset": True})


async def tokenize(request: Request) -> Response:
    serving = _serving(request)
    req = parse_request(TokenizeRequest, await request.body())
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt",
                       "invalid_value")
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages,
                                     add_generation_prompt=req.add_generation_prompt)
        tokens = await serving.chat_prompt(chat)
    else:
        tokens = await serving.engine.tokenize(req.prompt, req.add_special_tokens is not False)
    token_strs = None
    if req.return_token_strs:
        token_strs = serving.engine.tokenizer.convert_ids_to_tokens(tokens)
    body = TokenizeResponse(count=len(tokens), max_model_len=serving.max_model_len,
                            tokens=tokens, token_strs=token_strs)
    return Response(body.model_dump_json(), media_type="application/json")


async def detokenize(request: Request) -> Response:
    serving = _serving(request)
    req = parse_request(DetokenizeRequest, await request.body())
    serving.check_model(req.model)
    serving.check_token_ids(req.tokens, "tokens")
    body = DetokenizeResponse(prompt=serving.engine.tokenizer.decode(req.tokens))
    return Response(body.model_dump_json(), media_type="application/json")


async def metrics(request: Request) -> Response:
    text, content_type = request.app.state.metrics.render()
    return Response(text, media_type=content_type)


# -- the app ---------------------------------------------------------------------------------


class _StaticWeb:
    """The chat page's files behind the catch-all mount at ``/``.

    The router hands this mount every request no route matched in full: an
    API path with a wrong method gets 405 (with ``Allow``) instead of a file
    lookup, and any other method than GET/HEAD on any other path is an unknown
    route, 404 (``StaticFiles`` alone would answer 405, so ``POST
    /v1/embeddings`` looked like a known route).
    """

    def __init__(self, static: StaticFiles, api_methods: dict[str, set[str]]) -> None:
        self.static = static
        self.api_methods = api_methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            allowed = self.api_methods.get(scope["path"])
            if allowed is not None:
                raise HTTPException(405, headers={"Allow": ", ".join(sorted(allowed))})
            if scope["method"] not in ("GET", "HEAD"):
                raise HTTPException(404)
        await self.static(scope, receive, send)


def _preimport_transformers() -> None:
    # AsyncEngine.start loads the tokenizer and (in-process executor) the model
    # in two threads at once; transformers' lazy module is not safe to import
    # concurrently ("cannot import name 'AutoConfig'"), so import it first.
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401


def build_app(config: EngineConfig, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              max_ws_requests: int = DEFAULT_MAX_WS_REQUESTS,
              web_dir: str | Path | None = None,
              allowed_origins: list[str] | None = None,
              tool_call_parser: str = "auto") -> Starlette:
    """The Starlette app; its lifespan starts and stops the engine (then
    ``app.state.serving`` is the ``OpenAIServing`` and ``app.state.load_time``
    the engine's load time in seconds; if the start fails, the exception is
    ``app.state.startup_error`` too).

    Args:
        config: engine settings.
        api_key: when set, every endpoint but ``/health`` and the static page
            needs ``Authorization: Bearer <api_key>`` (WebSocket: see
            docs/websocket.md).
        max_body_bytes: larger HTTP bodies are refused with 413.
        max_ws_requests: concurrent requests per WebSocket connection.
        web_dir: folder served at ``/`` (default: the repository's ``web/``, or
            the installed package's copy of it),
            only if it holds an ``index.html``.
        allowed_origins: browser origins (``"https://chat.example.com"``, or
            ``"*"``) allowed cross-origin: CORS headers for them, and their
            WebSocket handshakes. None or empty: CORS off, WebSockets only
            from this server's own pages or from non-browser clients.
        tool_call_parser: the model's tool-call format (``tools/parsers.py``),
            ``auto`` to pick it from the chat template.
    """
    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.entrypoints.metrics import EngineMetrics
    from aioengine.entrypoints.websocket import websocket_endpoint

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(_preimport_transformers)
            engine = await AsyncEngine.start(config)
        except Exception as exc:
            # For the caller (``aioengine serve`` reports it in one line); the
            # traceback is for --log-level debug.
            app.state.startup_error = exc
            logger.debug("the engine failed to start", exc_info=True)
            raise
        app.state.serving = OpenAIServing(engine, tool_call_parser)
        app.state.metrics = EngineMetrics(engine)
        app.state.load_time = time.perf_counter() - t0
        try:
            yield
        finally:
            await engine.shutdown()

    routes: list[Route | WebSocketRoute | Mount] = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/engine/stats", engine_stats, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
    ]
    web = Path(web_dir) if web_dir is not None else DEFAULT_WEB_DIR
    if (web / "index.html").is_file():
        api_methods = {r.path: set(r.methods or ()) for r in routes if isinstance(r, Route)}
        routes.append(Mount("/", app=_StaticWeb(StaticFiles(directory=web, html=True),
                                                api_methods), name="web"))

    # Outermost first: CORS must answer preflights (which carry no API key) and
    # add its headers to 401s too.
    origins = list(allowed_origins or [])
    middleware = []
    if origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins,
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"],
                                     max_age=600))
    middleware.append(Middleware(WebSocketOriginMiddleware, allowed_origins=origins))
    if api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=api_key))
    middleware.append(Middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes))
    app = Starlette(
        routes=routes, middleware=middleware, lifespan=lifespan,
        exception_handlers={APIError: _api_error_handler, HTTPException: _http_exception_handler,
                            ClientDisconnect: _client_disconnect_handler,
                            Exception: _internal_error_handler})
    app.state.api_key = api_key
    app.state.max_ws_requests = max_ws_requests
    return app
