"""The HTTP app's middleware and error handlers.

Every error leaves as OpenAI-shaped JSON (``protocol.APIError``): the handlers
map Starlette's 404/405, a client gone mid-body (499) and any unexpected
exception (500, traceback logged by uvicorn). The middleware, outermost first
as ``api_server.build_app`` stacks it: WebSocket origin check, API keys and
their quotas, body size limit (the body read timeout is ``limits.py``'s).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aioengine.entrypoints.protocol import APIError, bearer_token
from aioengine.entrypoints.quotas import QuotaManager
from aioengine.entrypoints.serving import RequestGroup

logger = logging.getLogger(__name__)

# Paths served without an API key: the health probe and the static chat page
# (which then authenticates its WebSocket itself).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/metrics", "/reset_prefix_cache")


def error_response(exc: APIError) -> JSONResponse:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        error = APIError(404, f"no route for {method} {path}", None, "unknown_route")
    elif exc.status_code == 405:
        allowed = headers.get("Allow", "")
        error = APIError(
            405,
            f"{method} is not allowed on {path}" + (f" (allowed: {allowed})" if allowed else ""),
            None,
            "method_not_allowed",
        )
    else:
        error = APIError(exc.status_code, exc.detail or "request failed", None, None)
    response = error_response(error)
    response.headers.update(headers)  # 405's Allow
    return response


async def client_disconnect_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # gone while sending its body; nobody reads this


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response and uvicorn logs the traceback.
    return error_response(APIError(500, "internal server error", None, "internal_error"))


API_KEY_SCOPE = "aioengine.api_key"
"""Where ``APIKeyMiddleware`` leaves the caller's ``quotas.KeyState`` in the ASGI scope."""


class APIKeyMiddleware:
    """401 for HTTP requests to protected paths without ``Authorization: Bearer KEY``
    naming a configured key (``--api-key`` or ``--api-keys-file``); the key's
    ``KeyState`` goes into ``scope[API_KEY_SCOPE]`` for its limits.

    WebSockets authenticate in their own protocol (query parameter or an
    ``auth`` message), since browsers cannot set headers on them.
    """

    def __init__(self, app: ASGIApp, quotas: QuotaManager) -> None:
        self.app = app
        self.quotas = quotas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            token = bearer_token(dict(scope["headers"]).get(b"authorization"))
            state = self.quotas.authenticate(token)
            if state is None:
                response = error_response(
                    APIError(
                        401,
                        "missing or invalid API key (send 'Authorization: Bearer <key>')",
                        None,
                        "invalid_api_key",
                    )
                )
                await response(scope, receive, send)
                return
            scope[API_KEY_SCOPE] = state
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for HTTP bodies over ``max_body_bytes`` (checked on ``Content-Length``
    and again while chunked bodies are read)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413, f"request body exceeds {self.max_body_bytes} bytes", None, "request_too_large"
        )

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
                origin.decode("latin-1"), headers.get(b"host", b"").decode("latin-1")
            ):
                logger.warning("refused a WebSocket from origin %r", origin.decode("latin-1"))
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008})  # the server answers 403
                return
        await self.app(scope, receive, send)


def admit_request(
    request: Request, group: RequestGroup, model: str | None, prompt_tokens: int
) -> None:
    """Hold the caller's key quota for this API request (released by ``group.close()``).

    Raises:
        APIError: 404 model not allowed for the key, 429 over one of its limits.
    """
    state = request.scope.get(API_KEY_SCOPE)
    if state is not None:
        group.lease = request.app.state.quotas.admit(
            state, model or group.serving.model_name, prompt_tokens
        )
