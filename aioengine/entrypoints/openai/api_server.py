"""The HTTP server's app wiring: routes, middleware, lifespan.

``build_app(config, ...)`` returns the app; its lifespan starts the
``AsyncEngine`` and shuts it down. Routes:

- ``POST /v1/chat/completions`` (``serving_chat``), ``POST /v1/completions``
  (``serving_completion``): JSON, or SSE with ``"stream": true``
  (``streaming``: ``data: {chunk}`` events, then ``data: [DONE]``).
- ``GET /v1/models``, ``GET /health``, ``GET /v1/engine/stats`` (``EngineStats``
  as JSON), ``GET /metrics`` (Prometheus), ``POST /tokenize``,
  ``POST /detokenize`` (vLLM shapes).
- ``/v1/ws``: the WebSocket protocol (``entrypoints/websocket.py`` and its
  typed messages ``ws_messages.py``, docs/websocket.md).
- ``/``: the chat page from ``web/`` when the folder has an ``index.html``
  (Starlette's ``StaticFiles``: nothing outside that folder is served).

CORS is off (no ``Access-Control-Allow-*`` headers) unless ``allowed_origins``
lists origins, and a WebSocket handshake from a browser page of another
origin is refused with 403 unless that origin is listed.

A client that disconnects aborts its request at once, streaming or not, so
its KV blocks are freed. Errors are OpenAI-shaped JSON (``protocol.APIError``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from aioengine.config import EngineConfig
from aioengine.engine.data_parallel import DPAsyncEngine
from aioengine.entrypoints.limits import BodyReadTimeoutMiddleware, ConnectionLimits
from aioengine.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    WebSocketOriginMiddleware,
    api_error_handler,
    client_disconnect_handler,
    error_response,
    http_exception_handler,
    internal_error_handler,
)
from aioengine.entrypoints.openai.serving_chat import chat_completions
from aioengine.entrypoints.openai.serving_completion import completions
from aioengine.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelQuantization,
    TokenizeRequest,
    TokenizeResponse,
    parse_request,
)
from aioengine.entrypoints.quotas import WINDOW_S, APIKeySpec, QuotaManager
from aioengine.entrypoints.serving import OpenAIServing

if TYPE_CHECKING:
    from aioengine.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_WS_REQUESTS = 16
# The chat page: web/ of the repository (a checkout or an editable install),
# else the copy a wheel installs as aioengine/web (pyproject's package-dir).
_REPO_WEB_DIR = Path(__file__).resolve().parents[3] / "web"
DEFAULT_WEB_DIR = (
    _REPO_WEB_DIR
    if (_REPO_WEB_DIR / "index.html").is_file()
    else Path(__file__).resolve().parents[2] / "web"
)


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


# -- routes other than the two completions ---------------------------------------------------


async def list_models(request: Request) -> Response:
    serving = _serving(request)
    info = serving.engine.model_info
    quantization = (
        None
        if info is None
        else ModelQuantization(method=info.quantization, weight_formats=info.weight_formats)
    )
    body = ModelList(
        data=[
            ModelCard(
                id=serving.model_name,
                root=serving.engine.model_path,
                max_model_len=serving.max_model_len,
                created=int(serving.engine.started_at),
                quantization=quantization,
            )
        ]
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def health(request: Request) -> Response:
    """200 while the engine serves; 503 (with ``Retry-After``) while its worker
    restarts, before it started, and once the server drains for shutdown."""
    serving: OpenAIServing | None = getattr(request.app.state, "serving", None)
    if serving is None or not serving.engine.healthy:
        return error_response(
            APIError(
                503,
                "the engine is not healthy (its model worker is starting or restarting)",
                None,
                "engine_unavailable",
                retry_after=1.0,
            )
        )
    if serving.engine.draining:
        return error_response(
            APIError(503, "the server is shutting down", None, "engine_unavailable")
        )
    return Response(status_code=200)


async def engine_stats(request: Request) -> Response:
    """``EngineStats`` as JSON; ``?block_map=1`` fills ``block_usage_map``;
    ``?steps=1`` adds ``recent_steps``: the latest steps' ``[requests, tokens,
    worker idle s, worker busy s]`` (per replica under data parallelism)."""
    serving = _serving(request)
    include_block_map = request.query_params.get("block_map") in ("1", "true")
    include_steps = request.query_params.get("steps") in ("1", "true")
    engine = serving.engine
    body = dataclasses.asdict(engine.stats(include_block_map=include_block_map))
    if isinstance(engine, DPAsyncEngine):  # the totals above, each replica's below
        body["replicas"] = [dataclasses.asdict(s) for s in engine.replica_stats(include_block_map)]
        body["routing"] = dict(engine.router.decisions)
        if include_steps:
            for part, replica in zip(body["replicas"], engine.replicas, strict=True):
                part["recent_steps"] = replica.recent_steps() if replica.core is not None else []
    elif include_steps:
        body["recent_steps"] = engine.recent_steps()
    return JSONResponse(body)


async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prefix block (vLLM's ``POST /reset_prefix_cache``), e.g.
    before a cold-start benchmark. 200 ``{"reset": true}``; 409 while requests hold
    blocks (nothing changes then)."""
    serving = _serving(request)
    if not serving.engine.reset_prefix_cache():
        raise APIError(
            409,
            "requests are running: the prefix cache can only be reset "
            "when no request holds KV blocks; nothing was changed",
            None,
            "requests_running",
        )
    return JSONResponse({"reset": True})


async def tokenize(request: Request) -> Response:
    serving = _serving(request)
    req = parse_request(TokenizeRequest, await request.body())
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(
            400, "give exactly one of 'prompt' and 'messages'", "prompt", "invalid_value"
        )
    if req.messages is not None:
        chat = ChatCompletionRequest(
            messages=req.messages, add_generation_prompt=req.add_generation_prompt
        )
        tokens = await serving.chat_prompt(chat)
    else:
        tokens = await serving.engine.tokenize(req.prompt, req.add_special_tokens is not False)
    token_strs = None
    if req.return_token_strs:
        token_strs = serving.engine.tokenizer.convert_ids_to_tokens(tokens)
    body = TokenizeResponse(
        count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens, token_strs=token_strs
    )
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


def _routes(
    websocket_endpoint: Callable[..., Awaitable[None]], web_dir: str | Path | None
) -> list[Route | WebSocketRoute | Mount]:
    """The API routes, then the chat page's files at ``/`` when ``web_dir``
    (default: ``DEFAULT_WEB_DIR``) holds an ``index.html``."""
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
        static = _StaticWeb(StaticFiles(directory=web, html=True), api_methods)
        routes.append(Mount("/", app=static, name="web"))
    return routes


def _middleware(
    origins: list[str], quotas: QuotaManager | None, max_body_bytes: int, limits: ConnectionLimits
) -> list[Middleware]:
    """Outermost first: CORS must answer preflights (which carry no API key) and
    add its headers to 401s too; then WebSocket origins, API keys (with
    quotas), the body size limit and the body read timeout."""
    middleware = []
    if origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
                max_age=600,
            )
        )
    middleware.append(Middleware(WebSocketOriginMiddleware, allowed_origins=origins))
    if quotas is not None:
        middleware.append(Middleware(APIKeyMiddleware, quotas=quotas))
    middleware.append(Middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes))
    middleware.append(Middleware(BodyReadTimeoutMiddleware, body_timeout_s=limits.body_timeout_s))
    return middleware


def build_app(
    config: EngineConfig,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_ws_requests: int = DEFAULT_MAX_WS_REQUESTS,
    web_dir: str | Path | None = None,
    allowed_origins: list[str] | None = None,
    api_keys: list[APIKeySpec] | None = None,
    quota_window_s: float = WINDOW_S,
    limits: ConnectionLimits | None = None,
    tool_call_parser: str = "auto",
    engine_factory: Callable[[EngineConfig], Awaitable[AsyncEngine]] | None = None,
) -> Starlette:
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
        api_keys: keys with their own limits (``quotas.load_api_keys``); with
            ``api_key`` too, that one is the key ``default``, without limits.
        quota_window_s: the period of the per-minute limits (seconds; tests
            shorten it).
        limits: connection limits (``limits.ConnectionLimits``; docs/limits.md);
            the app applies the body timeout and the WebSocket frame rate, the
            uvicorn config the others.
        tool_call_parser: the model's tool-call format (``tools/parsers.py``),
            ``auto`` to pick it from the chat template.
        engine_factory: starts the engine in the lifespan; default
            ``AsyncEngine.start`` (the unit tests pass a fake engine's).
    """
    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.entrypoints.metrics import EngineMetrics
    from aioengine.entrypoints.websocket import websocket_endpoint

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        try:
            if engine_factory is not None:
                engine = await engine_factory(config)
            elif config.parallel.data_parallel_size > 1:
                engine = await DPAsyncEngine.start(config)
            else:
                engine = await AsyncEngine.start(config)
        except Exception as exc:
            # For the caller (``aioengine serve`` reports it in one line); the
            # traceback is for --log-level debug.
            app.state.startup_error = exc
            logger.debug("the engine failed to start", exc_info=True)
            raise
        app.state.serving = OpenAIServing(engine, tool_call_parser)
        app.state.metrics = EngineMetrics(engine, app.state.quotas)
        app.state.load_time = time.perf_counter() - t0
        try:
            yield
        finally:
            await engine.shutdown()

    specs = list(api_keys or [])
    if api_key:
        specs.append(APIKeySpec.from_key("default", api_key))
    quotas = QuotaManager(specs, quota_window_s) if specs else None
    limits = limits or ConnectionLimits()
    routes = _routes(websocket_endpoint, web_dir)
    middleware = _middleware(list(allowed_origins or []), quotas, max_body_bytes, limits)
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_exception_handler,
            ClientDisconnect: client_disconnect_handler,
            Exception: internal_error_handler,
        },
    )
    app.state.api_key = api_key
    app.state.quotas = quotas
    app.state.limits = limits
    app.state.max_ws_requests = max_ws_requests
    return app
