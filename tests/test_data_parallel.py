"""``aioengine serve --data-parallel-size 2`` on the default model, through real clients.

- 16 concurrent chat streams all complete, with the same greedy text as the
  one-engine session server, and both replicas served some of them.
- A conversation's second turn lands on the replica that served its first:
  its prompt's cached tokens show in ``usage`` and in that replica's prefix
  cache hits.
- SIGKILL of one replica's worker: the requests running there end with an
  error, the other replica's requests complete untouched, and the killed
  replica serves again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.reliability_util import own_server, sse_request, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # the served name of the default model
SYSTEM = ("You are a concise assistant for a travel agency. Answer in one or two "
          "sentences and never invent prices.")
QUESTIONS = [f"Name one thing to see in city number {i} of Europe." for i in range(16)]


def _chat(i: int) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTIONS[i]}]}


async def _all_texts(base_url: str, api_key: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key)

    async def one(i: int) -> str:
        text = ""
        stream = await client.chat.completions.create(**_chat(i), stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text

    try:
        return await asyncio.gather(*(one(i) for i in range(len(QUESTIONS))))
    finally:
        await client.close()


def _serving_workers(server_pid: int) -> list[int]:
    """The serving (not standby) model workers of the server, one per replica."""
    from tests.reliability_util import _children

    out = []
    for kid in _children(server_pid):
        try:
            if Path(f"/proc/{kid}/comm").read_text().strip() == "aioengine-wrk0":
                out.append(kid)
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory):
    with own_server(tmp_path_factory.mktemp("dp"), "--data-parallel-size", "2",
                    "--executor", "process") as info:
        yield info


def test_sixteen_streams_match_one_engine_and_both_replicas_serve(dp_server, server):
    before = dp_server.stats()["replicas"]
    texts = asyncio.run(_all_texts(dp_server.base_url, dp_server.api_key))
    reference = asyncio.run(_all_texts(server.base_url, server.api_key))
    assert all(texts), texts
    assert texts == reference
    after = dp_server.stats()
    served = [a["num_requests_finished"] - b["num_requests_finished"]
              for a, b in zip(after["replicas"], before, strict=True)]
    assert sum(served) == len(QUESTIONS) and min(served) > 0, served
    # The totals are the replicas' sums.
    assert after["num_requests_finished"] == sum(
        r["num_requests_finished"] for r in after["replicas"])
    assert after["num_kv_blocks_total"] == sum(r["num_kv_blocks_total"] for r in after["replicas"])


def test_a_follow_up_turn_lands_on_the_replica_with_its_prefix(dp_server):
    client = openai.OpenAI(base_url=f"{dp_server.base_url}/v1", api_key=dp_server.api_key)
    messages = [{"role": "system", "content": SYSTEM + " Today is a long day of planning "
                 "trips to the north of Scotland, with many questions about trains."},
                {"role": "user", "content": "Which city should I start from?"}]
    before = dp_server.stats()["replicas"]
    first = client.chat.completions.create(model=MODEL, messages=messages,
                                           temperature=0, max_tokens=16)
    mid = dp_server.stats()["replicas"]
    (home,) = [i for i, (a, b) in enumerate(zip(mid, before, strict=True))
               if a["num_requests_finished"] > b["num_requests_finished"]]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And how long is the train from there?"}]
    for _ in range(3):  # every later turn too
        second = client.chat.completions.create(model=MODEL, messages=messages,
                                                temperature=0, max_tokens=8)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens // 16 * 16 - 16, (cached, first.usage)
        now = dp_server.stats()["replicas"]
        gained = [a["prefix_cache_hits"] - b["prefix_cache_hits"]
                  for a, b in zip(now, mid, strict=True)]
        assert gained[home] >= cached and gained[1 - home] == 0, (home, gained)
        mid = now
    routing = dp_server.stats()["routing"]
    assert routing["prefix"] >= 3


def test_killing_one_replicas_worker_leaves_the_other_untouched(dp_server):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 160, "ignore_eos": True,
            }

    async def go():
        async with httpx.AsyncClient(base_url=dp_server.base_url, headers=dp_server.headers,
                                     timeout=300) as client:
            tasks = [asyncio.create_task(sse_request(client, {**body, "messages": [
                {"role": "user", "content": f"Count slowly from {i}."}]})) for i in range(6)]
            # Wait until all six run (three per replica: the load balances them).
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                running = [r["num_running"] for r in dp_server.stats()["replicas"]]
                if sum(running) == 6:
                    break
                await asyncio.sleep(0.05)
            assert sum(running) == 6 and min(running) > 0, running
            workers = _serving_workers(dp_server.process.pid)
            assert len(workers) == 2, workers
            os.kill(workers[0], signal.SIGKILL)
            return running, await asyncio.gather(*tasks)

    running, outcomes = asyncio.run(go())
    kinds = sorted(o.kind for o in outcomes)
    errors, done = kinds.count("error"), kinds.count("done")
    # One replica's requests failed, all of the other's finished their 160 tokens.
    assert (errors, done) in ((running[0], running[1]), (running[1], running[0])), kinds
    assert all(o.finish_reason == "length" for o in outcomes if o.kind == "done")

    def series(name: str) -> list[float]:
        scrape = httpx.get(f"{dp_server.base_url}/metrics", headers=dp_server.headers).text
        return [float(ln.split()[-1]) for ln in scrape.splitlines()
                if ln.startswith(f"aioengine:{name}{{")]

    # One series per replica (engine="0", "1"): exactly one worker restarted.
    assert sorted(series("worker_restarts_total")) == [0.0, 1.0]
    # The killed replica serves again, and both take requests.
    assert wait_until(lambda: series("engine_healthy") == [1.0, 1.0], timeout=60)
    assert httpx.get(f"{dp_server.base_url}/health", timeout=10).status_code == 200
    texts = asyncio.run(_all_texts(dp_server.base_url, dp_server.api_key))
    assert all(texts)
