"""The WebSocket API (/v1/ws) with the ``websockets`` client against a real
server subprocess: multiplexing, cancel, auth, stats and bad input."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
# Long enough that it is still running when cancelled or dropped.
LONG = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


async def connect(server, with_key: bool = True):
    url = server.ws_url_with_key if with_key else server.ws_url
    ws = await websockets.connect(url, max_size=None)
    hello = json.loads(await ws.recv())
    assert hello["type"] == "hello"
    return ws, hello


async def send(ws, **message) -> None:
    await ws.send(json.dumps(message))


async def recv(ws, timeout: float = 60) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def run_one(ws, request_id: str) -> tuple[list[dict], dict]:
    """Messages for ``request_id`` until its ``done``: (deltas, done)."""
    deltas = []
    while True:
        message = await recv(ws)
        assert message.get("id") == request_id, message
        if message["type"] == "delta":
            deltas.append(message)
        elif message["type"] == "done":
            return deltas, message
        else:
            raise AssertionError(message)


def test_ws_chat_matches_http_answer(server):
    http = httpx.post(f"{server.base_url}/v1/chat/completions", headers=server.headers,
                      json={"messages": CAPITAL, "temperature": 0, "max_tokens": 32},
                      timeout=60).json()

    async def go():
        ws, hello = await connect(server)
        assert hello["model"] == "SmolLM2-135M-Instruct" and not hello["auth_required"]
        async with ws:
            await send(ws, type="chat", id="q1", messages=CAPITAL, temperature=0, max_tokens=32)
            return await run_one(ws, "q1")

    deltas, done = asyncio.run(go())
    text = http["choices"][0]["message"]["content"]
    assert "Paris" in done["text"]
    assert done["text"] == text == "".join(d["text"] for d in deltas)
    assert done["finish_reason"] == http["choices"][0]["finish_reason"]
    usage = done["usage"]
    assert usage["completion_tokens"] == sum(len(d["token_ids"]) for d in deltas)
    assert usage["completion_tokens"] == http["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == http["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert done["ttft_s"] > 0 and done["tokens_per_s"] > 0


def test_ws_multiplexes_requests_on_one_socket(server):
    async def go():
        ws, _ = await connect(server)
        async with ws:
            await send(ws, type="chat", id="a", messages=CAPITAL, temperature=0, max_tokens=12,
                       ignore_eos=True)
            await send(ws, type="completion", id="b", prompt="One, two, three,", temperature=0,
                       max_tokens=6, ignore_eos=True)
            deltas: dict[str, list] = {"a": [], "b": []}
            dones: dict[str, dict] = {}
            while len(dones) < 2:
                m = await recv(ws)
                assert m["type"] in ("delta", "done"), m
                if m["type"] == "delta":
                    assert m["id"] not in dones, "no delta after done"
                    deltas[m["id"]].append(m)
                else:
                    assert m["id"] not in dones, "one done per request"
                    dones[m["id"]] = m
            return deltas, dones

    deltas, dones = asyncio.run(go())
    assert dones["a"]["usage"]["completion_tokens"] == 12
    assert dones["b"]["usage"]["completion_tokens"] == 6
    for rid in "ab":
        assert dones[rid]["finish_reason"] == "length"
        assert "".join(d["text"] for d in deltas[rid]) == dones[rid]["text"]


def test_ws_cancel_stops_a_long_request(server):
    baseline = server.stats()["num_kv_blocks_used"]

    async def go():
        ws, _ = await connect(server)
        async with ws:
            await send(ws, type="chat", id="long", **LONG)
            for _ in range(3):
                assert (await recv(ws))["type"] == "delta"
            running = server.stats()["num_running"]
            await send(ws, type="cancel", id="long")
            while (m := await recv(ws))["type"] == "delta":
                pass
            return running, m

    running, done = asyncio.run(go())
    assert running == 1
    assert done["type"] == "done" and done["id"] == "long"
    assert done["finish_reason"] == "abort"
    assert 3 <= done["usage"]["completion_tokens"] < 2000
    stats = server.wait_for_stats(lambda s: s["num_running"] == 0, timeout=1.0)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_kv_blocks_used"] == baseline


def test_ws_closing_the_socket_aborts_its_requests(server):
    baseline = server.stats()["num_kv_blocks_used"]

    async def go():
        ws, _ = await connect(server)
        await send(ws, type="chat", id="x", **LONG)
        await send(ws, type="completion", id="y", prompt="Count to a thousand:",
                   max_tokens=2000, ignore_eos=True)
        seen = set()
        while seen != {"x", "y"}:
            m = await recv(ws)
            seen.add(m["id"])
        await ws.close()

    asyncio.run(go())
    stats = server.wait_for_stats(lambda s: s["num_running"] == 0, timeout=1.0)
    assert stats["num_running"] == 0 and stats["num_kv_blocks_used"] == baseline


def test_ws_bad_input_gets_errors_and_the_socket_stays_usable(server):
    async def go():
        ws, _ = await connect(server)
        async with ws:
            replies = []
            await ws.send("{not json")
            replies.append(await recv(ws))
            await ws.send("[1, 2]")
            replies.append(await recv(ws))
            await send(ws, type="dance", id="d")
            replies.append(await recv(ws))
            await send(ws, type="chat", id="t", messages=CAPITAL, temperature="hot")
            replies.append(await recv(ws))
            await send(ws, type="chat", messages=CAPITAL)
            replies.append(await recv(ws))
            await send(ws, type="cancel", id="nobody")
            replies.append(await recv(ws))
            await send(ws, type="chat", id="m", model="gpt-nope", messages=CAPITAL)
            replies.append(await recv(ws))
            await send(ws, type="chat", id="big", messages=CAPITAL, max_tokens=10**6)
            replies.append(await recv(ws))
            await send(ws, type="chat", id="ok", messages=CAPITAL, temperature=0, max_tokens=32)
            return replies, await run_one(ws, "ok")

    replies, (_, done) = asyncio.run(go())
    assert all(r["type"] == "error" and r["message"] for r in replies), replies
    assert [r["code"] for r in replies] == [400, 400, 400, 400, 400, 404, 404, 400]
    assert replies[2]["id"] == "d"
    assert replies[3]["id"] == "t" and replies[3]["param"] == "temperature"
    assert replies[4]["param"] == "id"
    assert replies[5]["id"] == "nobody"
    assert replies[7]["id"] == "big" and replies[7]["param"] == "max_tokens"
    assert "Paris" in done["text"]


def test_ws_auth_by_message(server):
    async def go():
        ws, hello = await connect(server, with_key=False)
        async with ws:
            replies = [hello]
            await send(ws, type="chat", id="early", messages=CAPITAL)
            replies.append(await recv(ws))
            await send(ws, type="auth", api_key="wrong")
            replies.append(await recv(ws))
            await send(ws, type="auth", api_key=server.api_key)
            replies.append(await recv(ws))
            await send(ws, type="chat", id="late", messages=CAPITAL, temperature=0, max_tokens=4)
            return replies, await run_one(ws, "late")

    (hello, early, wrong, ok), (_, done) = asyncio.run(go())
    assert hello["auth_required"] is True
    assert early["type"] == "error" and early["code"] == 401 and early["id"] == "early"
    assert wrong["type"] == "error" and wrong["code"] == 401
    assert ok == {"type": "auth_ok"}
    assert done["usage"]["completion_tokens"] >= 1


def test_ws_stats_subscription(server):
    async def go():
        ws, _ = await connect(server)
        async with ws:
            await send(ws, type="subscribe_stats")
            first = await recv(ws, timeout=2)
            second = await recv(ws, timeout=2)
            await send(ws, type="unsubscribe_stats")
            await send(ws, type="ping")
            while (m := await recv(ws, timeout=2))["type"] == "stats":
                pass
            return first, second, m

    first, second, last = asyncio.run(go())
    assert first["type"] == second["type"] == "stats"
    assert 0.1 < second["time"] - first["time"] < 1.0
    assert len(first["block_usage_map"]) == first["num_kv_blocks_total"] > 0
    assert {"num_running", "num_waiting", "max_reqs_in_step"} <= set(first)
    assert last == {"type": "pong"}


def test_ws_concurrent_request_cap(server):
    async def go():
        ws, hello = await connect(server)
        cap = hello["max_concurrent_requests"]
        async with ws:
            for i in range(cap + 1):
                await send(ws, type="completion", id=f"r{i}", prompt="Hi", max_tokens=200,
                           ignore_eos=True)
            refused = None
            while refused is None:
                m = await recv(ws)
                if m["type"] == "error":
                    refused = m
            for i in range(cap):
                await send(ws, type="cancel", id=f"r{i}")
            dones = set()
            while len(dones) < cap:
                m = await recv(ws)
                if m["type"] == "done":
                    dones.add(m["id"])
            return cap, refused, dones

    cap, refused, dones = asyncio.run(go())
    assert refused["code"] == 429 and refused["id"] == f"r{cap}"
    assert dones == {f"r{i}" for i in range(cap)}
    stats = server.wait_for_stats(lambda s: s["num_running"] + s["num_waiting"] == 0, 1.0)
    assert stats["num_running"] + stats["num_waiting"] == 0


@pytest.mark.parametrize("ws_url_suffix", ["", "?api_key=wrong"])
def test_ws_without_valid_key_must_authenticate(server, ws_url_suffix):
    async def go():
        async with websockets.connect(server.ws_url + ws_url_suffix) as ws:
            return json.loads(await ws.recv())

    assert asyncio.run(go())["auth_required"] is True
