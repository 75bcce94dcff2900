"""Graceful shutdown for ``aioengine serve``: drain, then stop.

On the first SIGTERM or SIGINT ``GracefulServer``:

1. refuses new requests (the engine raises ``EngineDeadError``: HTTP 503 and
   WebSocket ``error`` 503; ``/health`` answers 503 so a load balancer stops
   sending) and closes the listening sockets (no new connections);
2. lets the requests in flight, HTTP and WebSocket alike, run on for up to
   ``drain_timeout`` seconds;
3. ends the rest with a clear message (an SSE ``error`` event, a WebSocket
   ``error``, a 503 for a JSON request);
4. hands over to uvicorn's shutdown, whose lifespan stops the worker and
   unlinks every shared-memory segment; the process exits 0.

A second signal skips what is left of the drain. uvicorn itself would
re-raise the signal after shutting down, which makes the exit status
"killed by SIGTERM"; a drained server exits 0 instead.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette

logger = logging.getLogger("aioengine.serve")

DEFAULT_DRAIN_TIMEOUT_S = 20.0
# After the drain, how long uvicorn waits for responses to finish sending.
FLUSH_TIMEOUT_S = 5


class GracefulServer(uvicorn.Server):
    """uvicorn's ``Server`` with a drain on SIGTERM/SIGINT (see the module doc).

    Args:
        config: the uvicorn config (its ``timeout_graceful_shutdown`` bounds
            the flush after the drain).
        app: the Starlette app of ``server.build_app``.
        drain_timeout: seconds in-flight requests may run on after the signal.
    """

    def __init__(self, config: uvicorn.Config, app: Starlette,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._skip_drain = asyncio.Event()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it runs between two bytecodes of whatever the loop
        # was doing, so it only schedules work on the loop.
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is not None:
            logger.warning("%s again: ending the requests still in flight now", name)
            self._skip_drain.set()
            return
        logger.warning("%s: draining (no new requests; up to %.0f s for those in flight)",
                       name, self.drain_timeout)
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        serving = getattr(self.app.state, "serving", None)
        if serving is None or not self.started:  # still loading: nothing to drain
            self.should_exit = True
            return
        engine = serving.engine
        engine.begin_drain()
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while engine.num_in_flight and not self._skip_drain.is_set():
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._skip_drain.wait(), min(left, 0.05))
            except TimeoutError:
                pass
        if engine.num_in_flight:
            n = engine.num_in_flight
            reason = ("a second signal" if self._skip_drain.is_set()
                      else f"the {self.drain_timeout:g} s drain timeout")
            engine.abort_all(f"the server is shutting down; the request was aborted after "
                             f"{reason}")
            logger.warning("aborted %d request(s) still in flight", n)
            # Let the handlers send those errors before uvicorn closes the sockets.
            await asyncio.sleep(0.1)
        else:
            logger.info("drained: no request in flight")
        self.should_exit = True
