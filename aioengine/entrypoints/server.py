"""Moved to ``aioengine.entrypoints.openai`` (``api_server`` wires the app,
``serving_chat``/``serving_completion`` hold the two completion routes,
``streaming`` their collect and SSE paths, ``middleware`` the middleware and
error handlers). The names below are re-exported for old imports."""

from aioengine.entrypoints.openai.api_server import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WS_REQUESTS,
    DEFAULT_WEB_DIR,
    build_app,
)
from aioengine.entrypoints.openai.middleware import (
    API_KEY_SCOPE,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    WebSocketOriginMiddleware,
    error_response,
)
from aioengine.entrypoints.openai.streaming import SSE_DONE, SSEResponse, sse

__all__ = [
    "API_KEY_SCOPE",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_WS_REQUESTS",
    "DEFAULT_WEB_DIR",
    "SSE_DONE",
    "APIKeyMiddleware",
    "BodySizeLimitMiddleware",
    "SSEResponse",
    "WebSocketOriginMiddleware",
    "build_app",
    "error_response",
    "sse",
]
