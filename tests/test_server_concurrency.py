"""Concurrent clients and disconnects against a real server subprocess.

Batching is read from /v1/engine/stats (the engine's own counters), never
inferred from timing.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

PROMPTS = [f"Tell me fact number {i} about the ocean." for i in range(8)]
LONG = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}


def test_eight_concurrent_streams_complete_and_share_steps(server):
    before = server.stats()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=8 + 2 * i, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage.completion_tokens, finish

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(go())
    assert [n for _, n, _ in results] == [8 + 2 * i for i in range(8)]
    assert all(finish == "length" and text for text, _, finish in results)
    after = server.stats()
    assert after["max_reqs_in_step"] > 1
    assert after["num_multi_request_steps"] > before["num_multi_request_steps"]
    assert after["num_requests_finished"] - before["num_requests_finished"] == 8
    assert after["num_running"] == 0


def test_sse_client_disconnect_aborts_the_request(server):
    baseline = server.stats()
    assert baseline["num_running"] == 0

    async def go() -> int:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions", json=LONG) as response:
                assert response.status_code == 200
                tokens = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        tokens += "role" not in delta
                    if tokens == 5:
                        break
                running = server.stats()["num_running"]
            # Leaving both blocks closes the connection mid-stream.
            return running

    assert asyncio.run(go()) == 1
    stats = server.wait_for_stats(
        lambda s: s["num_running"] == 0
        and s["num_kv_blocks_used"] == baseline["num_kv_blocks_used"], timeout=1.0)
    assert stats["num_running"] == 0
    assert stats["num_kv_blocks_used"] == baseline["num_kv_blocks_used"]
    assert stats["num_generation_tokens"] - baseline["num_generation_tokens"] < 2000


def test_non_streaming_client_disconnect_aborts_the_request(server):
    baseline = server.stats()
    body = {**LONG, "stream": False}

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=60) as client:
            task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            while server.stats()["num_running"] == 0:
                assert not task.done(), task.result().text
                await asyncio.sleep(0.05)
            task.cancel()  # drops the connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    stats = server.wait_for_stats(
        lambda s: s["num_running"] == 0
        and s["num_kv_blocks_used"] == baseline["num_kv_blocks_used"], timeout=1.0)
    assert stats["num_running"] == 0
    assert stats["num_kv_blocks_used"] == baseline["num_kv_blocks_used"]
