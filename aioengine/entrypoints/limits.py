"""Connection limits: what keeps slow, idle and flooding clients from holding the
server (issue 22; docs/limits.md lists every limit and its flag).

uvicorn bounds a connection between two requests (``timeout_keep_alive``) and
the number of connections and tasks (``limit_concurrency``: 503 beyond), but
not a connection that opens and then sends its request head slowly or never
(slowloris), nor a body that trickles in. Here:

- ``TimedHttpToolsProtocol``: uvicorn's httptools protocol that closes a
  connection whose request line and headers have not all arrived within
  ``header_timeout_s`` of the connection opening or of the previous response;
- ``BodyReadTimeoutMiddleware``: 408 when a request body has not fully arrived
  within ``body_timeout_s`` of the first read;
- ``FrameRateLimiter``: a token bucket per WebSocket; a client that sends
  frames faster than allowed is closed with 1008 (policy violation).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aioengine.entrypoints.protocol import APIError


@dataclass(frozen=True)
class ConnectionLimits:
    """Every bound on a client connection (seconds and counts).

    Attributes:
        timeout_keep_alive_s: an idle keep-alive connection is closed after this
            (uvicorn's ``timeout_keep_alive``).
        header_timeout_s: the request line and headers must arrive within this.
        body_timeout_s: the whole request body must arrive within this (408).
        limit_concurrency: connections plus in-flight tasks before uvicorn
            answers 503 (``limit_concurrency``).
        ws_ping_interval_s, ws_ping_timeout_s: a WebSocket that does not answer
            a ping within the timeout (a client that never reads) is closed.
        ws_max_frames_per_s, ws_frame_burst: a WebSocket's sustained and burst
            frame rate; beyond it the socket is closed with 1008.
    """

    timeout_keep_alive_s: int = 5
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    limit_concurrency: int = 2048
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 20.0
    ws_max_frames_per_s: float = 50.0
    ws_frame_burst: int = 200

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive_s", "header_timeout_s", "body_timeout_s",
                     "limit_concurrency", "ws_ping_interval_s", "ws_ping_timeout_s",
                     "ws_max_frames_per_s", "ws_frame_burst"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def timed_http_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's ``HttpToolsProtocol`` with a request-head timeout (for ``Config(http=...)``)."""

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        """Closes the connection when a request head takes over ``header_timeout_s``
        from the connection opening or from the previous response being sent."""

        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Between requests uvicorn's keep-alive timeout applies; this one covers
            # a next request whose head starts but never ends.
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedHttpToolsProtocol


class BodyReadTimeoutMiddleware:
    """408 ``request_timeout`` when an HTTP request body has not fully arrived
    within ``body_timeout_s`` seconds of the app's first read (a client sending
    one byte a second). Reads after the body (waiting for a disconnect) are not
    limited."""

    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        body_done = False

        async def timed_receive() -> Message:
            nonlocal deadline, body_done
            if body_done:
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.body_timeout_s
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                               f"{self.body_timeout_s:g} s", None, "request_timeout") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)


class FrameRateLimiter:
    """Token bucket over one WebSocket's incoming frames.

    Args:
        rate: frames per second sustained.
        burst: frames allowed at once.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.level = float(burst)
        self._updated = time.monotonic()

    def allow(self) -> bool:
        """Take one frame; False when the client is over its rate."""
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self._updated) * self.rate)
        self._updated = now
        if self.level < 1:
            return False
        self.level -= 1
        return True
