"""The WebSocket API at ``/v1/ws``: several requests multiplexed on one socket.

JSON text messages; the protocol is written down in docs/websocket.md. Each
request runs as its own task and streams ``delta`` messages tagged with the
client's ``id``, then ends with exactly one ``done`` (or one ``error`` if it
could not start). A ``cancel`` message, or closing the socket, aborts the
request in the engine at once. Bad input is answered with an ``error``
message; it never closes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from aioengine.entrypoints import ws_messages
from aioengine.entrypoints.ws_messages import AuthOk, Delta, Done, Error, Hello, Pong
from aioengine.entrypoints.protocol import (
    bearer_token,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    make_usage,
    parse_object,
)
from aioengine.entrypoints.limits import ConnectionLimits, FrameRateLimiter
from aioengine.entrypoints.quotas import KeyState, QuotaManager
from aioengine.entrypoints.serving import OpenAIServing, RequestGroup
from aioengine.errors import EngineDeadError

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25
MAX_ID_LENGTH = 256


class WebSocketSession:
    """One client connection.

    Args:
        websocket: the accepted-to-be socket.
        serving: the API's engine access.
        quotas: the server's keys; when set, the client must authenticate
            (``?api_key=``, ``Authorization: Bearer``, or an ``auth`` message)
            before requests, and each request counts against its key's limits.
        max_requests: concurrent requests allowed on this connection.
    """

    def __init__(self, websocket: WebSocket, serving: OpenAIServing,
                 quotas: QuotaManager | None, max_requests: int) -> None:
        self.ws = websocket
        self.serving = serving
        self.quotas = quotas
        self.key: KeyState | None = None
        self.max_requests = max_requests
        self.authenticated = quotas is None or self._handshake_key_ok()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.stats_task: asyncio.Task[None] | None = None
        self.closing = False
        self._send_lock = asyncio.Lock()

    def _handshake_key_ok(self) -> bool:
        key = self.ws.query_params.get("api_key")
        if key is None:
            key = bearer_token(self.ws.headers.get("authorization"))
        return key is not None and self._key_matches(key)

    def _key_matches(self, key: str) -> bool:
        assert self.quotas is not None
        state = self.quotas.authenticate(key)
        if state is not None:
            self.key = state  # later requests count against this key
        return state is not None

    # -- sending --------------------------------------------------------------------------
    async def send(self, message: ws_messages.ServerMessage) -> None:
        await self._send_text(ws_messages.encode(message))

    async def _send_text(self, text: str) -> None:
        async with self._send_lock:
            await self.ws.send_text(text)

    async def send_error(self, message: str, code: int, request_id: str | None = None,
                         param: str | None = None, retry_after: float | None = None) -> None:
        unset = msgspec.UNSET
        await self.send(Error(
            message, code, unset if request_id is None else request_id,
            unset if param is None else param,
            # seconds, as Retry-After
            unset if retry_after is None else max(1, round(retry_after))))

    # -- the receive loop ------------------------------------------------------------------
    async def run(self) -> None:
        await self.ws.accept()
        await self.send(Hello(model=self.serving.model_name,
                              max_model_len=self.serving.max_model_len,
                              max_concurrent_requests=self.max_requests,
                              auth_required=not self.authenticated))
        limits = getattr(self.ws.app.state, "limits", None) or ConnectionLimits()
        frames = FrameRateLimiter(limits.ws_max_frames_per_s, limits.ws_frame_burst)
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if not frames.allow():
                    # A flood would keep the one event loop busy for everyone.
                    logger.warning("closing a WebSocket over %g frames/s",
                                   limits.ws_max_frames_per_s)
                    await self.ws.close(1008, "too many messages")
                    break
                raw = message.get("text")
                if raw is None:
                    raw = message.get("bytes") or b""
                await self.handle(raw)
        except WebSocketDisconnect:
            pass
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel every request of this connection (aborting them in the engine)."""
        self.closing = True
        tasks = list(self.tasks.values())
        if self.stats_task is not None:
            tasks.append(self.stats_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def handle(self, raw: str | bytes) -> None:
        """Act on one client message; problems become ``error`` messages."""
        try:
            message = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # RecursionError: nesting deeper than the interpreter's recursion limit.
            await self.send_error(f"malformed JSON: {exc}", 400)
            return
        if not isinstance(message, dict):
            await self.send_error("a message must be a JSON object", 400)
            return
        kind = message.get("type")
        request_id = message.get("id")
        echo_id = request_id if isinstance(request_id, str) else None
        if kind == "auth":
            await self._auth(message)
        elif kind == "ping":
            await self.send(Pong())
        elif not self.authenticated:
            await self.send_error("authenticate first: send {\"type\": \"auth\", \"api_key\": "
                                  "...} or connect with ?api_key=", 401, echo_id)
        elif kind in ("chat", "completion"):
            await self._start_request(kind, message)
        elif kind == "cancel":
            task = self.tasks.get(request_id) if isinstance(request_id, str) else None
            if task is None:
                await self.send_error(f"no running request with id {request_id!r}", 404,
                                      echo_id)
            else:
                task.cancel()
        elif kind == "subscribe_stats":
            if self.stats_task is None or self.stats_task.done():
                self.stats_task = asyncio.ensure_future(self._stats_loop())
        elif kind == "unsubscribe_stats":
            if self.stats_task is not None:
                self.stats_task.cancel()
                self.stats_task = None
        else:
            await self.send_error(f"unknown message type {kind!r}; expected one of chat, "
                                  "completion, cancel, auth, subscribe_stats, "
                                  "unsubscribe_stats, ping", 400, echo_id)

    async def _auth(self, message: dict[str, Any]) -> None:
        key = message.get("api_key")
        if self.quotas is None or (isinstance(key, str) and self._key_matches(key)):
            self.authenticated = True
            await self.send(AuthOk())
        else:
            await self.send_error("invalid API key", 401)

    async def _start_request(self, kind: str, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID_LENGTH:
            await self.send_error(f"'id' must be a non-empty string of at most {MAX_ID_LENGTH} "
                                  "characters", 400, None, "id")
            return
        if request_id in self.tasks:
            await self.send_error(f"a request with id {request_id!r} is already running", 400,
                                  request_id, "id")
            return
        if len(self.tasks) >= self.max_requests:
            await self.send_error(f"at most {self.max_requests} concurrent requests per "
                                  "connection", 429, request_id)
            return
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = parse_object(schema, message)
            self.serving.check_model(req.model)
            req.check_supported()
            if (req.n or 1) != 1:
                raise APIError(400, "'n' must be 1 on the WebSocket", "n", "invalid_value")
        except APIError as exc:
            await self.send_error(exc.message, exc.status, request_id, exc.param)
            return
        self.tasks[request_id] = asyncio.ensure_future(self._run_request(request_id, req))

    # -- one request ---------------------------------------------------------------------------
    async def _run_request(self, client_id: str, req: SamplingRequest) -> None:
        t_start = time.perf_counter()
        t_first: float | None = None
        group = RequestGroup(self.serving)
        text_parts: list[str] = []
        num_tokens = 0
        prompt_len = 0
        cached = 0
        finish_reason: str | None = None
        stop_reason: str | int | None = None
        try:
            try:
                if isinstance(req, ChatCompletionRequest):
                    prompt_ids = await self.serving.chat_prompt(req)
                else:
                    prompts = await self.serving.completion_prompts(req)
                    if len(prompts) != 1:
                        raise APIError(400, "one prompt per WebSocket request", "prompt",
                                       "invalid_value")
                    prompt_ids = prompts[0][0]
                prompt_len = len(prompt_ids)
                params = self.serving.sampling_params(req, prompt_len)
                if req.use_beam_search:
                    raise APIError(400, "beam search does not stream: use POST "
                                   "/v1/completions or /v1/chat/completions with 'stream': "
                                   "false", "use_beam_search", "unsupported")
                await self.serving.prepare_structured_outputs(req, params)
                if self.key is not None and self.quotas is not None:
                    group.lease = self.quotas.admit(
                        self.key, req.model or self.serving.model_name, prompt_len)
                engine_id = f"ws-{id(self):x}-{client_id}"
                group.add(self.serving.add_request(engine_id, prompt_ids, params, req))
            except APIError as exc:
                await self.send_error(exc.message, exc.status, client_id, exc.param,
                                      exc.retry_after)
                return
            # Chat with tools: "delta" messages also carry OpenAI-shaped "tool_calls"
            # fragments, and "done" the complete calls (docs/websocket.md).
            streamer = (self.serving.tool_call_streamer(req)
                        if isinstance(req, ChatCompletionRequest) else None)
            try:
                async for _, out in group:
                    cached = out.num_cached_tokens
                    c = out.outputs[0]
                    num_tokens = len(c.token_ids)
                    if c.delta_token_ids and t_first is None:
                        t_first = time.perf_counter()
                    if c.delta_text or c.delta_token_ids:
                        text_parts.append(c.delta_text)
                        delta = Delta(client_id, c.delta_text, c.delta_token_ids)
                        if streamer is not None:
                            content, calls = (streamer.finish(c.text) if c.finish_reason
                                              else streamer.update(c.text))
                            delta.content = content
                            if calls:
                                delta.tool_calls = calls
                        await self.send(delta)
                    if c.finish_reason is not None:
                        finish_reason, stop_reason = c.finish_reason, c.stop_reason
                        if (streamer is not None and streamer.tool_calls
                                and finish_reason == "stop"):
                            finish_reason = "tool_calls"
            except asyncio.CancelledError:
                if self.closing:
                    raise
                finish_reason = "abort"  # a client "cancel"; the group aborted the request
            except EngineDeadError as exc:
                await self.send_error(str(exc), 503, client_id)
                return
            t_end = time.perf_counter()
            tokens_per_s = None
            if t_first is not None and num_tokens > 1 and t_end > t_first:
                tokens_per_s = (num_tokens - 1) / (t_end - t_first)
            await self.send(Done(
                id=client_id, finish_reason=finish_reason, stop_reason=stop_reason,
                text="".join(text_parts),
                usage=make_usage(prompt_len, num_tokens, cached).model_dump(),
                ttft_s=None if t_first is None else t_first - t_start,
                tokens_per_s=tokens_per_s,
                tool_calls=streamer.tool_calls if streamer is not None else msgspec.UNSET))
        except asyncio.CancelledError:
            if self.closing:
                raise
            # Cancelled before the engine request existed: still one "done".
            await self.send(Done(id=client_id, finish_reason="abort", stop_reason=None, text="",
                                 usage=make_usage(prompt_len, 0, 0).model_dump(),
                                 ttft_s=None, tokens_per_s=None))
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the socket went away while sending; close() cleans up
        except Exception:
            logger.exception("WebSocket request %r failed", client_id)
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self.send_error("internal error", 500, client_id)
        finally:
            group.close()
            self.tasks.pop(client_id, None)

    async def _stats_loop(self) -> None:
        engine = self.serving.engine
        try:
            while True:
                stats = engine.stats(include_block_map=True)
                await self._send_text(ws_messages.encode_stats(time.time(), stats))
                await asyncio.sleep(STATS_INTERVAL_S)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass


async def websocket_endpoint(websocket: WebSocket) -> None:
    app = websocket.app
    session = WebSocketSession(websocket, app.state.serving, app.state.quotas,
                               app.state.max_ws_requests)
    await session.run()
