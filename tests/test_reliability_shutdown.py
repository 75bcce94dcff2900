"""Graceful shutdown of a real ``aioengine serve`` on SIGTERM and SIGINT
(issue 9): it stops accepting, lets requests in flight finish up to
``--drain-timeout``, aborts the rest with a clear message, stops the worker,
unlinks every shared-memory segment and exits 0.

The servers here seat two requests at a time (``--max-num-seqs 2``), which
also makes waiting and priority preemption deterministic for their metrics,
and have no ``--allowed-origins`` (CORS off).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets
from reliability_util import (
    Outcome,
    ServerInfo,
    metric,
    own_server,
    pid_alive,
    shm_segments,
    sse_request,
    wait_until,
    worker_pid,
    worker_processes,
    ws_request,
)

DRAIN_TIMEOUT_S = 10.0
MAX_WAITING = 3
SERVER_ARGS = ("--max-num-seqs", "2", "--max-waiting-requests", str(MAX_WAITING),
               "--drain-timeout", str(DRAIN_TIMEOUT_S))


@pytest.fixture(scope="module")
def sserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """Ends with test_sigterm_drains_then_exits_0, which stops it."""
    with own_server(tmp_path_factory.mktemp("shutdown"), *SERVER_ARGS) as info:
        yield info


SHORT = 48  # tokens of the requests that finish during a drain


def chat(content: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **extra}


def http_client(server: ServerInfo) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                             timeout=httpx.Timeout(120))


def scrape(server: ServerInfo) -> str:
    return httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=30).text


def test_cors_and_cross_origin_websockets_off_by_default(sserver):
    r = httpx.options(f"{sserver.base_url}/v1/chat/completions", timeout=10, headers={
        "Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"})
    assert not any(h.startswith("access-control-") for h in r.headers), r.headers
    r = httpx.get(f"{sserver.base_url}/v1/models", timeout=10,
                  headers={**sserver.headers, "Origin": "http://elsewhere.example"})
    assert r.status_code == 200
    assert not any(h.startswith("access-control-") for h in r.headers), r.headers

    async def ws_status(origin: str) -> int:
        try:
            async with websockets.connect(sserver.ws_url_with_key, origin=origin) as ws:
                await ws.recv()
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    assert asyncio.run(ws_status("http://elsewhere.example")) == 403
    assert asyncio.run(ws_status(sserver.base_url)) == 101  # the chat page's own origin


def test_waiting_and_preemption_metrics_move(sserver):
    before = scrape(sserver)
    long = chat("Write a long poem about the sea.", 60)

    async def go() -> str:
        events = [asyncio.Event() for _ in range(3)]
        async with http_client(sserver) as client:
            a = asyncio.ensure_future(sse_request(client, long, started=events[0]))
            b = asyncio.ensure_future(sse_request(client, long, started=events[1]))
            await asyncio.wait_for(asyncio.gather(events[0].wait(), events[1].wait()), 120)
            # Both seats taken: a more urgent request preempts the later one ...
            c = asyncio.ensure_future(sse_request(client, {**long, "priority": -1},
                                                  started=events[2]))
            await asyncio.wait_for(events[2].wait(), 120)
            # ... which waits, with another that finds no seat.
            d = asyncio.ensure_future(sse_request(client, long))
            deadline = time.monotonic() + 30
            while True:
                during = (await client.get("/metrics")).text
                if metric(during, "aioengine:num_requests_waiting") >= 2 \
                        or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            for task in (a, b, c, d):
                task.cancel()
            await asyncio.gather(a, b, c, d, return_exceptions=True)
            return during

    during = asyncio.run(go())
    assert metric(during, "aioengine:num_requests_running") == 2
    assert metric(during, "aioengine:num_requests_waiting") == 2
    assert metric(during, "aioengine:num_preemptions_total") - \
        metric(before, "aioengine:num_preemptions_total") == 1
    stats = sserver.wait_for_stats(lambda s: s["num_running"] == s["num_waiting"] == 0,
                                   timeout=5)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_kv_blocks_used"] == 0


def test_over_the_waiting_limit_429_at_once_and_the_others_finish(sserver):
    """Backpressure (issue 4): two seats taken, the waiting queue full; the next
    request is refused with 429 and Retry-After at once, and every request
    already admitted still completes."""
    async def go():
        async with http_client(sserver) as client:
            events = [asyncio.Event(), asyncio.Event()]
            seated = [asyncio.ensure_future(sse_request(client, chat("Count to twenty.", 24),
                                                        started=e)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            queued = [asyncio.ensure_future(sse_request(client, chat("Say hi.", 4)))
                      for _ in range(MAX_WAITING)]
            deadline = time.monotonic() + 30
            while (await client.get("/v1/engine/stats")).json()["num_waiting"] < MAX_WAITING:
                assert time.monotonic() < deadline, "the queue never filled"
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            refused = await client.post("/v1/chat/completions", json=chat("One more.", 4))
            elapsed = time.monotonic() - t0
            outcomes = await asyncio.gather(*seated, *queued)
            return refused, elapsed, outcomes

    refused, elapsed, outcomes = asyncio.run(go())
    assert refused.status_code == 429, refused.text
    assert refused.headers.get("retry-after")
    assert refused.json()["error"]["message"]
    assert elapsed < 2.0, "refused at once, not after queueing"
    assert [o.kind for o in outcomes] == ["done"] * (2 + MAX_WAITING)
    stats = sserver.wait_for_stats(lambda s: s["num_running"] == s["num_waiting"] == 0,
                                   timeout=10)
    assert stats["num_kv_blocks_used"] == 0


def _check_drain(server: ServerInfo, sig: signal.Signals) -> None:
    pid = server.process.pid
    worker = worker_pid(pid)
    assert worker is not None
    assert len(shm_segments(pid)) == 2 * len(worker_processes(pid)) == 4
    url = server.ws_url_with_key

    async def go():
        started = [asyncio.Event(), asyncio.Event()]
        async with http_client(server) as client:
            # Two short requests take both seats; three long ones queue behind them. The
            # short ones must still be running when the long ones arrive (4 tokens ended
            # before that once the quantized kernels made decoding fast) and finish well
            # inside the drain timeout.
            sse_short = asyncio.ensure_future(sse_request(client, chat("Say hi.", SHORT),
                                                          started=started[0]))
            ws_short = asyncio.ensure_future(ws_request(
                url, {"type": "chat", "id": "short", **chat("Say hi.", SHORT)},
                started=started[1]))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            story = chat("Tell me a very long story about a lighthouse.", 1000)
            sse_long = asyncio.ensure_future(sse_request(client, story))
            ws_long = asyncio.ensure_future(ws_request(url, {"type": "chat", "id": "long",
                                                             **story}))
            json_long = asyncio.ensure_future(client.post("/v1/chat/completions", json=story))
            idle_ws = await websockets.connect(url)
            await idle_ws.recv()
            deadline = time.monotonic() + 60
            while True:
                stats = (await client.get("/v1/engine/stats")).json()
                if stats["num_running"] + stats["num_waiting"] == 5:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.02)

            t_signal = time.monotonic()
            server.process.send_signal(sig)
            await asyncio.sleep(0.5)
            # No new connections ...
            refused = False
            try:
                async with httpx.AsyncClient(timeout=5) as fresh:
                    await fresh.get(f"{server.base_url}/health")
            except httpx.ConnectError:
                refused = True
            # ... and no new requests on an open one.
            await idle_ws.send(json.dumps({"type": "chat", "id": "late", **chat("hi", 2)}))
            late = json.loads(await asyncio.wait_for(idle_ws.recv(), 10))
            await idle_ws.close()
            streams = await asyncio.wait_for(
                asyncio.gather(sse_short, ws_short, sse_long, ws_long), DRAIN_TIMEOUT_S + 30)
            plain = await asyncio.wait_for(json_long, 30)
            return t_signal, refused, late, streams, plain

    t_signal, refused, late, streams, plain = asyncio.run(go())
    sse_short, ws_short, sse_long, ws_long = streams
    assert refused, "a new connection was accepted while draining"
    assert late["type"] == "error" and late["code"] == 503, late
    assert "shutting down" in late["message"]
    # In flight and short enough: finished normally during the drain.
    for outcome in (sse_short, ws_short):
        assert (outcome.kind, outcome.finish_reason) == ("done", "length"), outcome
        assert outcome.ended_at - t_signal < DRAIN_TIMEOUT_S
    # Too long: ended with a clear message when the drain timed out.
    for outcome in (sse_long, ws_long):
        assert isinstance(outcome, Outcome) and outcome.kind == "error", outcome
        assert outcome.status == 503, outcome
        assert "shutting down" in outcome.message and "drain timeout" in outcome.message
        assert DRAIN_TIMEOUT_S - 1 < outcome.ended_at - t_signal < DRAIN_TIMEOUT_S + 10
    assert plain.status_code == 503, plain.text
    assert "shutting down" in plain.json()["error"]["message"]

    server.process.wait(timeout=60)
    exited = time.monotonic() - t_signal
    assert server.process.returncode == 0, server.log_tail()
    assert wait_until(lambda: not pid_alive(worker), timeout=5), "the worker outlived the server"
    assert shm_segments(pid) == set()
    log = server.log_path.read_text(errors="replace")
    assert f"{sig.name}: draining" in log, server.log_tail()
    assert "Traceback" not in log, server.log_tail(200)
    print(f"{sig.name}: 2 short requests finished, 3 long ones aborted at the "
          f"{DRAIN_TIMEOUT_S:g} s drain timeout; exit 0 after {exited:.1f} s")


def test_sigterm_drains_then_exits_0(sserver):
    """Stops this module's server."""
    _check_drain(sserver, signal.SIGTERM)


def test_sigint_drains_then_exits_0(tmp_path_factory):
    with own_server(tmp_path_factory.mktemp("sigint"), *SERVER_ARGS) as info:
        _check_drain(info, signal.SIGINT)
