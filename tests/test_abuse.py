"""Connection abuse (issue 22): slow request heads and bodies, a thousand idle
connections, WebSockets that never read and one that floods frames, all at
once, against a server with short limits (docs/limits.md). Each abuser is cut
off by its limit, and a well-behaved client's time to first token during the
abuse stays near its time to first token without it (both printed).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets
from reliability_util import ServerInfo, own_server

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
PING_S = 1.0
FRAMES_PER_S = 50
NUM_IDLE = 1000
NUM_SLOW_HEADERS = 8
NUM_SLOW_BODIES = 8
NUM_SILENT_WS = 4
NUM_PROBES = 6


@pytest.fixture(scope="module")
def aserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    with own_server(tmp_path_factory.mktemp("abuse"),
                    "--header-timeout", str(HEADER_TIMEOUT_S),
                    "--body-timeout", str(BODY_TIMEOUT_S), "--timeout-keep-alive", "2",
                    "--ws-ping-interval", str(PING_S), "--ws-ping-timeout", str(PING_S),
                    "--ws-max-frames-per-s", str(FRAMES_PER_S)) as info:
        yield info


def host_port(server: ServerInfo) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


async def probe_ttft(server: ServerInfo, n: int) -> list[float]:
    """Time to first token of ``n`` streaming requests, one after the other (s)."""
    ttfts = []
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                 timeout=60) as client:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"Probe {i}: name a colour."}],
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                first = None
                async for line in r.aiter_lines():
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.monotonic() - t0
            assert first is not None
            ttfts.append(first)
    return ttfts


async def slow_head(server: ServerInfo) -> float:
    """Send a request head one byte a second; seconds until the server hangs up."""
    reader, writer = await asyncio.open_connection(*host_port(server))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
    t0 = time.monotonic()
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                    break
            except TimeoutError:
                pass
    except (ConnectionError, OSError):
        pass
    writer.close()
    return time.monotonic() - t0


async def slow_body(server: ServerInfo) -> tuple[int | None, float]:
    """Full headers, then the body one byte a second: (status answered, seconds)."""
    reader, writer = await asyncio.open_connection(*host_port(server))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 f"{server.api_key}\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(body)}\r\n\r\n".encode())
    t0 = time.monotonic()
    status = None
    for char in body:
        try:
            writer.write(char.encode())
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 1.0)
            if line:
                status = int(line.split()[1])
            break
        except TimeoutError:
            continue
        except (ConnectionError, OSError):
            break
    writer.close()
    return status, time.monotonic() - t0


async def silent_ws(server: ServerInfo, i: int) -> float:
    """A WebSocket that asks for a long answer and never reads; seconds until the
    server has closed it (seen when the client finally drains it)."""
    ws = await websockets.connect(server.ws_url_with_key, max_queue=1, ping_interval=None)
    await ws.send(json.dumps({"type": "chat", "id": f"silent-{i}", "max_tokens": 200,
                              "messages": [{"role": "user", "content": "Tell a story."}]}))
    t0 = time.monotonic()
    await asyncio.sleep(2 * PING_S + 3)  # not reading: no pong goes back
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 5)
    except websockets.ConnectionClosed:
        return time.monotonic() - t0
    finally:
        await ws.close()


async def flood_ws(server: ServerInfo) -> tuple[int, int, float, int | None]:
    """Frames as fast as possible: (frames sent, pongs the server answered,
    seconds the server took to close, its close code)."""
    ws = await websockets.connect(server.ws_url_with_key)
    assert json.loads(await ws.recv())["type"] == "hello"
    sent = pongs = 0
    t0 = time.monotonic()
    try:
        for _ in range(5_000):
            await ws.send('{"type": "ping"}')
            sent += 1
            if sent % 100 == 0:
                await asyncio.sleep(0)
        while True:
            if json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "pong":
                pongs += 1
    except websockets.ConnectionClosed as exc:
        return sent, pongs, time.monotonic() - t0, exc.rcvd.code if exc.rcvd else None
    finally:
        await ws.close()


def test_abusers_are_cut_off_and_others_keep_their_ttft(aserver):
    # Warm up, then the baseline.
    asyncio.run(probe_ttft(aserver, 2))
    baseline = asyncio.run(probe_ttft(aserver, NUM_PROBES))

    idle = []
    for _ in range(NUM_IDLE):
        idle.append(socket.create_connection(host_port(aserver), timeout=10))
    t_idle = time.monotonic()

    async def abuse() -> tuple:
        tasks = [asyncio.ensure_future(slow_head(aserver)) for _ in range(NUM_SLOW_HEADERS)]
        tasks += [asyncio.ensure_future(slow_body(aserver)) for _ in range(NUM_SLOW_BODIES)]
        tasks += [asyncio.ensure_future(silent_ws(aserver, i)) for i in range(NUM_SILENT_WS)]
        flood = asyncio.ensure_future(flood_ws(aserver))
        await asyncio.sleep(0.5)
        during = await probe_ttft(aserver, NUM_PROBES)
        results = await asyncio.gather(*tasks)
        return during, results, await flood

    during, results, (flood_sent, pongs, flood_s, flood_code) = asyncio.run(abuse())
    heads = results[:NUM_SLOW_HEADERS]
    bodies = results[NUM_SLOW_HEADERS:NUM_SLOW_HEADERS + NUM_SLOW_BODIES]
    silents = results[NUM_SLOW_HEADERS + NUM_SLOW_BODIES:]

    # Idle connections: closed by the header timeout.
    deadline = t_idle + HEADER_TIMEOUT_S + 10
    closed = 0
    for sock in idle:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if sock.recv(1) == b"":
                closed += 1
        except (TimeoutError, OSError):
            pass
        sock.close()
    assert closed == NUM_IDLE, f"{NUM_IDLE - closed} idle connections still open"
    assert all(t < HEADER_TIMEOUT_S + 2 for t in heads), heads
    assert all(status == 408 for status, _ in bodies), bodies
    assert all(t < BODY_TIMEOUT_S + 2 for _, t in bodies), bodies
    assert all(t < 2 * PING_S + 8 for t in silents), silents
    # The flood is answered up to its burst and rate, then closed with 1008.
    assert flood_code == 1008, flood_code
    assert pongs <= 200 + FRAMES_PER_S * flood_s + 10, (pongs, flood_s)

    base, abused = statistics.median(baseline), statistics.median(during)
    print(f"TTFT median without abuse {base * 1000:.0f} ms {[round(t, 3) for t in baseline]}, "
          f"during abuse {abused * 1000:.0f} ms {[round(t, 3) for t in during]} "
          f"({NUM_IDLE} idle connections, {NUM_SLOW_HEADERS} slow heads, {NUM_SLOW_BODIES} "
          f"slow bodies, {NUM_SILENT_WS} WebSockets that never read, one flooding "
          f"(sent {flood_sent} frames, {pongs} answered before its 1008 close)); slow heads "
          f"cut after {max(heads):.1f} s, slow bodies 408 after {max(t for _, t in bodies):.1f} s, "
          f"silent WebSockets closed within {max(silents):.1f} s")
    assert abused < 3 * base + 0.5, (baseline, during)
    # Nothing the abusers started is left in the engine.
    stats = aserver.wait_for_stats(lambda s: s["num_running"] == s["num_waiting"] == 0,
                                   timeout=30)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_kv_blocks_used"] == 0
    assert httpx.get(f"{aserver.base_url}/health").status_code == 200
