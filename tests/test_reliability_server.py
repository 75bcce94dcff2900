"""Reliability of a real ``aioengine serve`` (issue 9), on one server of this
module's own, in this order: metrics that move, limits, a WebSocket fuzz, a
load test of 200 clients, a SIGKILLed worker, and last a SIGKILLed server
(whose worker must not outlive it).

The server: a 256-token context (so "the rest of the context" is short),
1 MiB bodies and frames, 4 requests per WebSocket, one allowed CORS origin,
room for 256 running requests so the load test never meets a 429.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets
import websockets.sync.client
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability_util import (
    Outcome,
    ServerInfo,
    metric,
    own_server,
    pid_alive,
    rss_kib,
    shm_segments,
    sse_request,
    wait_until,
    worker_pid,
    worker_processes,
    ws_request,
)

MAX_MODEL_LEN = 256
MAX_BODY = 1 << 20
MAX_WS_REQUESTS = 4
ALLOWED_ORIGIN = "http://allowed.example"


@pytest.fixture(scope="module")
def rserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    with own_server(tmp_path_factory.mktemp("reliability"),
                    "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "0.5",
                    "--max-body-mib", "1", "--max-ws-requests", str(MAX_WS_REQUESTS),
                    "--allowed-origins", ALLOWED_ORIGIN, "--max-num-seqs", "256",
                    "--max-waiting-requests", "1024") as info:
        yield info


def scrape(server: ServerInfo) -> str:
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=30)
    assert r.status_code == 200
    return r.text


def chat(content: str, max_tokens: int | None = 6, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "ignore_eos": True,
            "temperature": 0, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def http_client(server: ServerInfo, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                             timeout=httpx.Timeout(120), **kw)


# -- metrics -----------------------------------------------------------------------------------


def test_metrics_move_when_they_should(rserver):
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds", "request_queue_time_seconds"]
    before = scrape(rserver)
    assert metric(before, "aioengine:num_requests_running") == 0
    assert metric(before, "aioengine:kv_cache_usage_perc") == 0
    assert metric(before, "aioengine:engine_healthy") == 1
    content = "Name three colours of the rainbow, one per line, and nothing else."

    async def go() -> tuple[str, Outcome, Outcome]:
        started = asyncio.Event()
        async with http_client(rserver) as client:
            task = asyncio.ensure_future(sse_request(client, chat(content), started=started))
            await asyncio.wait_for(started.wait(), 120)
            during = (await client.get("/metrics")).text
            first = await asyncio.wait_for(task, 120)
        # The same prompt again, over the WebSocket: its full blocks are cached.
        second = await ws_request(rserver.ws_url_with_key, {"type": "chat", "id": "again",
                                                            **chat(content)})
        return during, first, second

    during, first, second = asyncio.run(go())
    assert (first.kind, first.finish_reason) == ("done", "length"), first
    assert (second.kind, second.finish_reason) == ("done", "length"), second
    assert metric(during, "aioengine:num_requests_running") == 1
    assert metric(during, "aioengine:kv_cache_usage_perc") > 0
    assert metric(during, "aioengine:num_kv_blocks_used") > 0

    rserver.wait_for_stats(lambda s: s["num_running"] == 0, timeout=5)
    after = scrape(rserver)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert metric(after, "aioengine:num_requests_running") == 0
    assert metric(after, "aioengine:num_requests_waiting") == 0
    assert metric(after, "aioengine:kv_cache_usage_perc") == 0
    prompt_len = json.loads(httpx.post(
        f"{rserver.base_url}/tokenize", headers=rserver.headers,
        json={"messages": chat(content)["messages"]}).text)["count"]
    assert delta("aioengine:prefix_cache_queries_total") == 2 * prompt_len
    # The second request found every full block of the prompt but recomputes
    # its last token.
    assert delta("aioengine:prefix_cache_hits_total") == (prompt_len - 1) // 16 * 16
    assert delta("aioengine:prompt_tokens_total") == 2 * prompt_len - delta(
        "aioengine:prefix_cache_hits_total")
    assert delta("aioengine:generation_tokens_total") == 12
    assert delta("aioengine:request_success_total") == 2
    assert delta("aioengine:num_preemptions_total") == 0  # moves: test_reliability_shutdown.py
    for name in ["time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"]:
        assert delta(f"aioengine:{name}_count") == 2, name
    assert delta("aioengine:inter_token_latency_seconds_count") == 10  # 5 gaps per request
    for name in histograms:
        assert delta(f"aioengine:{name}_sum") > 0, name
    # e2e >= TTFT for the same two requests.
    assert delta("aioengine:e2e_request_latency_seconds_sum") >= \
        delta("aioengine:time_to_first_token_seconds_sum")


# -- limits --------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413(rserver):
    big = json.dumps(chat("x" * (MAX_BODY + 10)))
    r = httpx.post(f"{rserver.base_url}/v1/chat/completions", headers=rserver.headers,
                   content=big, timeout=30)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is checked while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536].encode()

    r = httpx.post(f"{rserver.base_url}/v1/chat/completions", headers=rserver.headers,
                   content=chunks(), timeout=30)
    assert r.status_code == 413, r.text


def test_deeply_nested_json_is_400_not_500(rserver):
    for body in ["[" * 100_000, '{"messages": ' + "[" * 100_000, '{"a":' * 50_000]:
        r = httpx.post(f"{rserver.base_url}/v1/chat/completions", headers=rserver.headers,
                       content=body, timeout=30)
        assert r.status_code == 400, r.text


def test_prompt_plus_max_tokens_beyond_the_context_is_400(rserver):
    url = f"{rserver.base_url}/v1/chat/completions"
    r = httpx.post(url, headers=rserver.headers, json=chat("hi", max_tokens=MAX_MODEL_LEN),
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    assert str(MAX_MODEL_LEN) in r.json()["error"]["message"]
    r = httpx.post(url, headers=rserver.headers, json=chat("word " * 400, max_tokens=None),
                   timeout=30)
    assert r.status_code == 400, r.text
    # A chat request has no "prompt" field: the error names the one it has.
    assert r.json()["error"]["param"] == "messages"


def test_absent_max_tokens_means_the_rest_of_the_context(rserver):
    def prompt_len(k: int) -> int:
        r = httpx.post(f"{rserver.base_url}/tokenize", headers=rserver.headers,
                       json={"messages": chat("word " * k)["messages"]}, timeout=30)
        return r.json()["count"]

    k = 200
    k += MAX_MODEL_LEN - 6 - prompt_len(k)  # about one token per " word"
    n = prompt_len(k)
    assert MAX_MODEL_LEN - 12 < n < MAX_MODEL_LEN, n
    r = httpx.post(f"{rserver.base_url}/v1/chat/completions", headers=rserver.headers,
                   json=chat("word " * k, max_tokens=None), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == n
    assert body["usage"]["completion_tokens"] == MAX_MODEL_LEN - n
    assert body["choices"][0]["finish_reason"] == "length"

    async def over_ws() -> Outcome:
        return await ws_request(rserver.ws_url_with_key,
                                {"type": "chat", "id": "rest", **chat("word " * k, None)})

    outcome = asyncio.run(over_ws())
    assert (outcome.kind, outcome.finish_reason) == ("done", "length"), outcome
    assert outcome.num_deltas == MAX_MODEL_LEN - n


def test_websocket_caps_concurrent_requests_per_connection(rserver):
    async def go() -> tuple[dict, list[dict]]:
        async with websockets.connect(rserver.ws_url_with_key) as ws:
            assert json.loads(await ws.recv())["max_concurrent_requests"] == MAX_WS_REQUESTS
            for i in range(MAX_WS_REQUESTS + 1):
                await ws.send(json.dumps({"type": "chat", "id": f"r{i}",
                                          **chat("Tell me a story.", 200)}))
            refused = None
            while refused is None:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] == "error":
                    refused = msg
            for i in range(MAX_WS_REQUESTS):
                await ws.send(json.dumps({"type": "cancel", "id": f"r{i}"}))
            dones = []
            while len(dones) < MAX_WS_REQUESTS:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] == "done":
                    dones.append(msg)
            return refused, dones

    refused, dones = asyncio.run(go())
    assert refused["id"] == f"r{MAX_WS_REQUESTS}" and refused["code"] == 429, refused
    assert sorted(d["id"] for d in dones) == [f"r{i}" for i in range(MAX_WS_REQUESTS)]
    assert {d["finish_reason"] for d in dones} <= {"abort", "length"}
    stats = rserver.wait_for_stats(lambda s: s["num_running"] == 0, timeout=5)
    assert stats["num_running"] == 0


def test_websocket_frame_over_the_limit_closes_cleanly(rserver):
    async def go() -> websockets.ConnectionClosed:
        async with websockets.connect(rserver.ws_url_with_key, max_size=None) as ws:
            await ws.recv()
            await ws.send("x" * (MAX_BODY + 1))
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            return info.value

    closed = asyncio.run(go())
    assert closed.rcvd is not None and closed.rcvd.code == 1009, closed


def test_cors_only_for_allowed_origins(rserver):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{rserver.base_url}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    ok = preflight(ALLOWED_ORIGIN)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers
    r = httpx.get(f"{rserver.base_url}/v1/models", headers={**rserver.headers,
                                                             "Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{rserver.base_url}/v1/models", headers={**rserver.headers,
                                                             "Origin": ALLOWED_ORIGIN})
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_websocket_origin_check(rserver):
    port = rserver.base_url.rsplit(":", 1)[1]

    async def status(origin: str | None) -> int:
        try:
            async with websockets.connect(rserver.ws_url_with_key, origin=origin) as ws:
                assert json.loads(await ws.recv())["type"] == "hello"
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    async def go() -> dict:
        origins = [None, f"http://127.0.0.1:{port}", ALLOWED_ORIGIN, "http://evil.example",
                   f"http://127.0.0.1:{int(port) + 1}", "null", f"https://evil.example:{port}"]
        return {o: await status(o) for o in origins}

    got = asyncio.run(go())
    assert got == {None: 101, f"http://127.0.0.1:{port}": 101, ALLOWED_ORIGIN: 101,
                   "http://evil.example": 403, f"http://127.0.0.1:{int(port) + 1}": 403,
                   "null": 403, f"https://evil.example:{port}": 403}, got


def _raw_get(server: ServerInfo, path: str) -> tuple[int, bytes]:
    """GET with the path sent byte for byte (clients normalise ``..``)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_static_files_never_leave_web_dir(rserver):
    status, body = _raw_get(rserver, "/")
    assert status == 200 and b"<html" in body.lower()
    for path in ["/..%2F..%2Fetc/passwd", "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
                 "/..%2f..%2fpyproject.toml", "/../pyproject.toml", "/%2e%2e%2fpyproject.toml",
                 "/..%252f..%252fetc/passwd", "/....//....//etc/passwd",
                 "/static/..%2F..%2F..%2Fetc/passwd", "/%2Fetc%2Fpasswd", "//etc/passwd",
                 "/..\\..\\etc\\passwd"]:
        status, body = _raw_get(rserver, path)
        assert status in (400, 404), (path, status)
        assert b"root:" not in body and b"[project]" not in body, path


# -- hostile WebSocket input ------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=False) | st.text(max_size=12))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)
_TYPES = ["chat", "completion", "cancel", "auth", "ping", "subscribe_stats",
          "unsubscribe_stats"]
_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | _json,
     "content": st.text(max_size=40) | _json}), max_size=3) | _json
_fields = {"id": st.text(max_size=300) | _json, "messages": _messages,
           "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=8) | _json,
           "max_tokens": st.integers(-3, 400) | _json, "temperature": st.floats() | _json,
           "n": st.integers(-1, 3) | _json, "stop": _json, "seed": _json, "logit_bias": _json,
           "stream": _json, "model": st.text(max_size=10) | _json, "api_key": _json,
           "priority": _json, "logprobs": _json, "top_logprobs": _json, "cache_salt": _json}
_objects = st.fixed_dictionaries(
    {"type": st.sampled_from(_TYPES) | st.text(max_size=12) | _json},
    optional=_fields).map(json.dumps)
class _Big:
    """A large frame, built only when sent (so a failing example prints short)."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind, self.size = kind, size

    def __repr__(self) -> str:
        return f"_Big({self.kind!r}, {self.size})"

    def __len__(self) -> int:
        return len(self.render())

    def render(self) -> str:
        if self.kind == "deep":  # nesting far past the recursion limit
            return "[" * self.size
        if self.kind == "over":  # over the frame limit: the server closes (1009)
            return json.dumps({"type": "chat", "id": "huge", "prompt": "a" * self.size})
        return json.dumps({"type": "chat", "id": "big",  # big but allowed: a 400
                           "messages": [{"role": "user", "content": "ab " * self.size}]})


_frames = st.one_of(
    st.text(max_size=200),                                      # mostly not JSON
    st.binary(max_size=200),                                    # binary frames
    _json.map(json.dumps),                                      # JSON, mostly not an object
    _objects,                                                   # objects, typed or not
    st.text(max_size=40).map(lambda i: json.dumps({"type": "cancel", "id": i})),
    st.integers(1_000, MAX_BODY // 2).map(lambda k: _Big("deep", k)),
    st.integers(MAX_BODY, MAX_BODY + 4096).map(lambda k: _Big("over", k)),
    st.integers(20_000, 100_000).map(lambda k: _Big("big", k)),
)
_KNOWN_REPLIES = {"error", "delta", "done", "auth_ok", "pong", "stats"}


class _Bystander(threading.Thread):
    """Another client on its own socket, running short requests one after the
    other for as long as the fuzz lasts; any error or close is recorded."""

    def __init__(self, server: ServerInfo) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.completed = 0
        self.problems: list[str] = []

    def run(self) -> None:
        try:
            with websockets.sync.client.connect(self.server.ws_url_with_key) as ws:
                ws.recv(timeout=60)
                while not self.stop.is_set():
                    rid = f"by-{self.completed}"
                    ws.send(json.dumps({"type": "chat", "id": rid, **chat("Count to ten.", 4)}))
                    while True:
                        msg = json.loads(ws.recv(timeout=120))
                        if msg.get("id") != rid:
                            continue
                        if msg["type"] == "done":
                            if msg["finish_reason"] != "length":
                                self.problems.append(f"finished with {msg}")
                            self.completed += 1
                            break
                        if msg["type"] == "error":
                            self.problems.append(f"error {msg}")
                            return
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            self.problems.append(repr(exc))


def _fuzz_one(server: ServerInfo, frames: list, counter: list[int]) -> None:
    """Send ``frames`` on a fresh socket, then a barrier; every reply must be a
    known message and every error a 4xx. A frame over the limit ends the
    example: the server closes the socket (1009), and may reset the TCP
    connection while the client still writes, losing the close frame."""
    counter[0] += 1
    barrier = f"barrier-{counter[0]}"
    over_limit = False
    with websockets.sync.client.connect(server.ws_url_with_key, max_size=None,
                                        open_timeout=60) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "hello"
        try:
            for frame in frames:
                data = frame.render() if isinstance(frame, _Big) else frame
                over_limit = len(data) > MAX_BODY
                ws.send(data)
                if over_limit:
                    break
            # The server handles a socket's messages in order: the answer to
            # this cancel comes after the answers to every frame above.
            ws.send(json.dumps({"type": "cancel", "id": barrier}))
            deadline = time.monotonic() + 60
            while True:
                reply = json.loads(ws.recv(timeout=max(1.0, deadline - time.monotonic())))
                assert isinstance(reply, dict) and reply.get("type") in _KNOWN_REPLIES, reply
                if reply["type"] == "error":
                    assert isinstance(reply["message"], str) and reply["message"], reply
                    assert isinstance(reply["code"], int) and 400 <= reply["code"] < 500, reply
                    if reply.get("id") == barrier:
                        assert reply["code"] == 404
                        break
            assert not over_limit, "a frame over the limit was accepted"
        except websockets.ConnectionClosed as exc:
            assert over_limit, f"the server closed the socket: {exc!r}"
            assert exc.rcvd is None or exc.rcvd.code == 1009, exc


def test_websocket_fuzz_never_crashes_and_spares_other_sockets(rserver):
    bystander = _Bystander(rserver)
    bystander.start()
    counter = [0]

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(st.lists(_frames, min_size=1, max_size=4))
    # Found by this fuzz: nesting past the recursion limit raised RecursionError
    # out of json.loads and killed the socket with a 500-style abnormal close.
    @example([_Big("deep", MAX_BODY // 2)])
    @example([json.dumps({"type": "cancel", "id": "never-started"}), b"\xff\xfe{", "{}"])
    def fuzz(frames: list) -> None:
        _fuzz_one(rserver, frames, counter)

    try:
        fuzz()
    finally:
        bystander.stop.set()
        bystander.join(timeout=180)
    assert not bystander.is_alive()
    assert bystander.problems == [] and bystander.completed >= 1, \
        (bystander.problems, bystander.completed)
    print(f"WebSocket fuzz: {counter[0]} sockets; the bystander completed "
          f"{bystander.completed} requests meanwhile")
    assert httpx.get(f"{rserver.base_url}/health").status_code == 200
    stats = rserver.wait_for_stats(lambda s: s["num_running"] == s["num_waiting"] == 0,
                                   timeout=30)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_kv_blocks_used"] == 0
    log = rserver.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "internal error" not in log, rserver.log_tail(100)


# -- load -----------------------------------------------------------------------------------------

NUM_CLIENTS = 200
LOAD_MAX_TOKENS = 6
TOPICS = ["rivers", "bread", "owls", "trains", "glaciers", "violins", "tides", "moss"]


async def _load_round(server: ServerInfo, round_index: int) -> list[tuple[str, bool, Outcome]]:
    rng = random.Random(round_index)
    droppers = set(rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 4))

    async def client_run(i: int, client: httpx.AsyncClient) -> tuple[str, bool, Outcome]:
        kind = "sse" if i % 2 == 0 else "ws"
        drop_after = rng.randint(0, LOAD_MAX_TOKENS - 1) if i in droppers else None
        body = {"messages": [{"role": "user",
                              "content": f"Client {i}: one fact about {TOPICS[i % 8]}."}],
                "max_tokens": LOAD_MAX_TOKENS, "temperature": 0.8, "seed": i}
        await asyncio.sleep(rng.random() * 2)  # arrivals spread over two seconds
        if kind == "sse":
            coro = sse_request(client, body, drop_after=drop_after)
        else:
            coro = ws_request(server.ws_url_with_key, {"type": "chat", "id": f"c{i}", **body},
                              drop_after=drop_after, abort=bool(i % 4 == 1))
        return kind, drop_after is not None, await asyncio.wait_for(coro, 300)

    limits = httpx.Limits(max_connections=NUM_CLIENTS + 10, max_keepalive_connections=0)
    async with http_client(server, limits=limits) as client:
        return await asyncio.gather(*(client_run(i, client) for i in range(NUM_CLIENTS)))


def test_load_200_streaming_clients_with_disconnects(rserver):
    rss = []
    for round_index in range(3):
        t0 = time.monotonic()
        results = asyncio.run(_load_round(rserver, round_index))
        elapsed = time.monotonic() - t0
        for kind, dropper, outcome in results:
            assert outcome.kind != "http" or outcome.status < 500, outcome
            assert outcome.kind != "http" or outcome.status != 429, \
                "the server was sized for no 429s"
            assert outcome.kind in ("done", "dropped"), (kind, outcome)
            if not dropper:
                assert outcome.kind == "done", (kind, outcome)
            if outcome.kind == "done":
                assert outcome.finish_reason in ("length", "stop"), outcome
        stats = rserver.wait_for_stats(
            lambda s: s["num_running"] == s["num_waiting"] == s["num_kv_blocks_used"] == 0,
            timeout=60, interval=0.2)
        assert stats["num_running"] == stats["num_waiting"] == 0, stats
        assert stats["num_kv_blocks_used"] == 0 and stats["kv_cache_usage"] == 0, stats
        rss.append(rss_kib(rserver.process.pid))
        print(f"load round {round_index + 1}: {NUM_CLIENTS} clients in {elapsed:.1f} s, "
              f"{sum(o.kind == 'done' for _, _, o in results)} done, "
              f"{sum(o.kind == 'dropped' for _, _, o in results)} dropped, "
              f"server RSS {rss[-1] / 1024:.1f} MiB")
    assert rss[2] <= rss[0] * 1.10, f"RSS grew from {rss[0]} KiB to {rss[2]} KiB"


# -- a worker killed mid-stream -------------------------------------------------------------------


def test_worker_sigkill_fails_requests_fast_and_the_server_recovers(rserver):
    pid = rserver.process.pid
    old_worker = worker_pid(pid)
    assert old_worker is not None
    old_segments = shm_segments(pid)
    assert len(old_segments) == 2 * len(worker_processes(pid)) == 4, old_segments  # + standby
    before = scrape(rserver)
    long_chat = chat("Write a long story about a lighthouse keeper.", 200)

    async def go():
        starts = [asyncio.Event() for _ in range(8)]
        async with http_client(rserver) as client:
            tasks = [asyncio.ensure_future(sse_request(client, long_chat, started=starts[i]))
                     for i in range(4)]
            tasks += [asyncio.ensure_future(ws_request(
                rserver.ws_url_with_key, {"type": "chat", "id": f"w{i}", **long_chat},
                started=starts[4 + i])) for i in range(4)]
            plain = [asyncio.ensure_future(client.post("/v1/chat/completions", json=long_chat))
                     for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 180)
            while (await client.get("/v1/engine/stats")).json()["num_running"] < 10:
                await asyncio.sleep(0.05)
            t_kill = time.monotonic()
            os.kill(old_worker, signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            responses = await asyncio.wait_for(asyncio.gather(*plain), 30)
            t_plain = time.monotonic()

            # While the worker restarts: 503 with Retry-After at once, never a hang.
            health = await client.get("/health")
            during = []
            for i in range(3):
                t = time.monotonic()
                r = await asyncio.wait_for(
                    client.post("/v1/chat/completions", json=chat("hi", 2)), 10)
                during.append(("json", r.status_code, r.headers.get("retry-after"),
                               time.monotonic() - t))
                t = time.monotonic()
                o = await asyncio.wait_for(sse_request(client, chat("hi", 2)), 10)
                during.append(("sse", o.status, o.retry_after, time.monotonic() - t))
                t = time.monotonic()
                o = await asyncio.wait_for(ws_request(
                    rserver.ws_url_with_key, {"type": "chat", "id": f"d{i}", **chat("hi", 2)}),
                    10)
                during.append(("ws", o.status, "-", time.monotonic() - t))
            still_restarting = (await client.get("/health")).status_code == 503
            return t_kill, outcomes, responses, t_plain, health, during, still_restarting

    t_kill, outcomes, responses, t_plain, health, during, still_restarting = asyncio.run(go())
    detection = max(o.ended_at for o in outcomes) - t_kill
    for o in outcomes:
        assert o.kind == "error" and o.status == 503, o
        assert "worker" in o.message, o
    assert detection < 2.0, detection
    for r in responses:
        assert r.status_code == 503, r.text
        assert "worker" in r.json()["error"]["message"]
    assert t_plain - t_kill < 2.0
    assert health.status_code == 503
    assert health.headers.get("retry-after")
    if still_restarting:  # everything above ran while the worker was down
        for kind, status, retry_after, took in during:
            assert status == 503 and retry_after, (kind, status, retry_after)
            assert took < 5.0, (kind, took)

    # Back without restarting the server.
    assert wait_until(lambda: httpx.get(f"{rserver.base_url}/health").status_code == 200,
                      timeout=240, interval=0.2), rserver.log_tail()
    restart_time = time.monotonic() - t_kill
    r = httpx.post(f"{rserver.base_url}/v1/chat/completions", headers=rserver.headers,
                   json=chat("What is the capital of France?", 4), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4

    new_worker = worker_pid(pid)
    assert new_worker not in (None, old_worker)
    assert not pid_alive(old_worker)
    # The standby took over with its own rings (the killed worker's are unlinked)
    # and a new standby has its own.
    assert wait_until(lambda: len(worker_processes(pid)) == 2, timeout=30)
    new_segments = shm_segments(pid)
    assert len(old_segments - new_segments) == 2 and len(new_segments) == 4, (old_segments,
                                                                               new_segments)
    after = scrape(rserver)
    assert metric(after, "aioengine:worker_restarts_total") == 1
    assert metric(after, "aioengine:engine_healthy") == 1
    # Counters carry over the restart (Prometheus counters never go back).
    for name in ["generation_tokens_total", "prompt_tokens_total", "request_success_total",
                 "prefix_cache_queries_total", "num_steps_total"]:
        assert metric(after, f"aioengine:{name}") >= metric(before, f"aioengine:{name}"), name
    print(f"worker SIGKILL: 8 streams + 2 JSON requests ended {detection:.3f} s after the "
          f"kill; /health 200 again after {restart_time:.1f} s; requests during the restart: "
          f"{[(k, s, round(t, 3)) for k, s, _, t in during]}"
          f" (window {'covered' if still_restarting else 'partly missed'})")


def test_server_sigkill_takes_its_worker_and_segments_with_it(rserver):
    """Runs last: it kills this module's server."""
    pid = rserver.process.pid
    worker = worker_pid(pid)
    assert worker is not None and pid_alive(worker)
    assert len(shm_segments(pid)) == 2 * len(worker_processes(pid)) == 4
    t0 = time.monotonic()
    rserver.process.kill()
    rserver.process.wait(timeout=30)
    assert wait_until(lambda: not pid_alive(worker), timeout=10, interval=0.02), \
        "the worker outlived its server"
    worker_gone = time.monotonic() - t0
    # The server's resource tracker unlinks what the dead server left.
    assert wait_until(lambda: not shm_segments(pid), timeout=30), shm_segments(pid)
    print(f"server SIGKILL: worker gone after {worker_gone:.3f} s, segments after "
          f"{time.monotonic() - t0:.2f} s")
