"""``DPAsyncEngine`` behind the real app on stand-in replicas (unit tier:
``tests/factories.py``'s tokenizer and ``FakeExecutor``, no model, no process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.data_parallel import DPAsyncEngine
from aioengine.entrypoints.openai.api_server import build_app
from tests.factories import FakeExecutor, make_config, make_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


async def _start_dp(config):
    replicas = []
    for rank in range(config.parallel.data_parallel_size):
        parallel = dataclasses.replace(config.parallel, data_parallel_rank=rank)
        replica_config = dataclasses.replace(config, parallel=parallel)
        replicas.append(await AsyncEngine.from_parts(replica_config, make_tokenizer(),
                                                     FakeExecutor))
    return DPAsyncEngine(config, replicas)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # max_model_len (512 tokens) beyond one replica's cache (64 blocks of 4 tokens).
    config = make_config(max_model_len=512, data_parallel_size=2, executor="process",
                         standby_worker=False)
    app = build_app(config, engine_factory=_start_dp, web_dir="")
    with TestClient(app) as c:
        yield c


def test_no_max_tokens_defaults_to_one_replicas_cache_not_the_sum(client):
    """The default ``max_tokens`` is bounded by the cache of the replica the request
    runs on: the replicas' summed blocks gave twice that, and every request that
    left out ``max_tokens`` was refused with 400 (more blocks than the cache)."""
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64 * 4
    with client.websocket_connect("/v1/ws") as ws:
        ws.receive_json()  # hello
        ws.send_json({"type": "chat", "id": "a", "model": "fake-model", "messages": MESSAGES})
        while (m := ws.receive_json())["type"] == "delta":
            pass
        assert m["type"] == "done", m


def test_replica_workers_divide_the_cores_without_tensor_parallelism(monkeypatch):
    """``-dp 2`` alone (no ``-tp``): each replica's worker gets half the cores
    (docs/distributed.md); the thread count used to reach a worker only in the
    tensor-parallel ``dist`` tuple, so both took every core."""
    from aioengine.executor import multiproc

    monkeypatch.setattr(multiproc.os, "cpu_count", lambda: 16)
    dp2 = make_config(data_parallel_size=2, executor="process")
    assert multiproc._worker_config(dp2).parallel.num_threads == 8
    one = make_config(executor="process")
    assert multiproc._worker_config(one) is one  # torch's default, as before
    pinned = make_config(data_parallel_size=2, executor="process", num_threads=3)
    assert multiproc._worker_config(pinned).parallel.num_threads == 3


def test_generate_refuses_data_parallel_in_one_line(monkeypatch):
    """``aioengine generate -dp 2``: one error line, not ``LLM``'s traceback."""
    from aioengine.entrypoints import cli

    monkeypatch.setattr(cli, "_engine_config", lambda args: None)  # no model file read
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "hi", "-dp", "2"])
    assert str(exc.value) == ("aioengine: error: --data-parallel-size is for aioengine serve; "
                              "generate runs one engine")


def test_reset_prefix_cache_is_all_replicas_or_none(client):
    """409 "nothing was changed" while one replica runs a request: the idle
    replica's prefix cache must be left too (it used to be reset anyway)."""
    import asyncio

    from aioengine.sampling_params import SamplingParams

    engine = client.app.state.serving.engine
    prompt_ids = list(range(40, 60))

    async def warm_then_hold():
        first = engine.replicas[0].add_request("warm", prompt_ids, SamplingParams(max_tokens=1))
        async for _ in first:
            pass
        held = engine.replicas[1].add_request("held", prompt_ids, SamplingParams(
            max_tokens=200, ignore_eos=True))
        await asyncio.sleep(0.05)
        return held

    hashes = engine.router.prompt_hashes(prompt_ids)
    engine.replicas[1].executor.delay_s = 0.01
    try:
        client.portal.call(warm_then_hold)
        assert engine.replicas[1].num_in_flight == 1
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 409, r.text
        from aioengine.engine.data_parallel import num_cached_blocks

        assert num_cached_blocks(engine.replicas[0], hashes) == len(prompt_ids) // 4
    finally:
        engine.abort("held")
        engine.replicas[1].executor.delay_s = 0.0
    assert client.post("/reset_prefix_cache").status_code == 200
    assert num_cached_blocks(engine.replicas[0], hashes) == 0


def test_latency_histograms_carry_the_replicas_engine_label(client):
    """Like every other series (docs/distributed.md): a request that ran on
    replica 1 shows in ``engine="1"``'s histograms, not in one unlabelled pool."""
    import re

    from aioengine.sampling_params import SamplingParams

    engine = client.app.state.serving.engine

    def count(text: str, rank: int) -> float:
        series = f'aioengine:time_to_first_token_seconds_count{{engine="{rank}",'
        m = re.search("^" + re.escape(series + 'model_name="fake-model"}') + r" (\S+)$",
                      text, re.M)
        return float(m.group(1)) if m else 0.0

    before = client.get("/metrics").text

    async def on_replica_1():
        stream = engine.replicas[1].add_request("lat", [50, 51, 52], SamplingParams(max_tokens=3))
        async for _ in stream:
            pass

    client.portal.call(on_replica_1)
    after = client.get("/metrics").text
    assert count(after, 1) == count(before, 1) + 1
    assert count(after, 0) == count(before, 0)
    for name in ("inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert f'aioengine:{name}_count{{engine="1",model_name="fake-model"}}' in after


def test_a_full_waiting_queue_on_the_routed_replica_spills_to_another():
    """Prefix routing sends a hot prompt to the replica that caches it; once that
    replica's waiting queue is full the request goes to another one, not 429
    while that one sits idle. 429 only when every queue is full."""
    import asyncio

    from aioengine.errors import SchedulerQueueFull
    from aioengine.sampling_params import SamplingParams

    async def go():
        config = make_config(max_model_len=512, data_parallel_size=2, executor="process",
                             standby_worker=False, max_waiting_requests=2)
        engine = await _start_dp(config)
        try:
            prompt_ids = list(range(40, 80))  # 10 blocks: worth 2 requests of load
            async for _ in engine.replicas[0].add_request("warm", prompt_ids,
                                                          SamplingParams(max_tokens=1)):
                pass
            for i in range(4):  # queued at once: nothing runs in between
                engine.add_request(f"r{i}", prompt_ids, SamplingParams(max_tokens=2))
            assert [r.num_in_flight for r in engine.replicas] == [2, 2]
            with pytest.raises(SchedulerQueueFull):
                engine.add_request("r4", prompt_ids, SamplingParams(max_tokens=2))
        finally:
            await engine.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("dp", [1, 2])
def test_more_prompts_than_every_waiting_queue_holds_is_400_not_429(dp):
    """A completions request with more prompts than all waiting queues hold could
    never be admitted: 400 on ``prompt`` (it was 429, retried forever). With two
    replicas the prompts spread over both queues."""
    async def start(config):
        if dp > 1:
            return await _start_dp(config)
        return await AsyncEngine.from_parts(config, make_tokenizer(), FakeExecutor)

    config = make_config(max_model_len=512, max_waiting_requests=2, data_parallel_size=dp,
                         executor="process", standby_worker=False)
    with TestClient(build_app(config, engine_factory=start, web_dir="")) as c:
        body = {"model": "fake-model", "max_tokens": 2}
        r = c.post("/v1/completions", json=body | {"prompt": ["a", "b", "c"]})
        if dp == 1:
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        else:
            assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
        r = c.post("/v1/completions", json=body | {"prompt": ["a", "b", "c", "d", "e"]})
        assert r.status_code == 400, r.text
        assert c.post("/v1/completions", json=body | {"prompt": ["a", "b"]}).status_code == 200


def test_preflight_counts_every_workers_kv_cache(monkeypatch):
    """``-dp 2`` (or ``-tp 2``): each worker allocates ``--kv-cache-memory``, so two
    caches must fit in the free memory, not one (the second worker's would fail
    late, after the model loads)."""
    from aioengine.entrypoints import preflight

    gib = 1 << 30
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 3 * gib)
    one = make_config(num_gpu_blocks_override=None, kv_cache_memory_bytes=2 * gib)
    preflight.check_model(one)  # fits
    two = make_config(num_gpu_blocks_override=None, kv_cache_memory_bytes=2 * gib,
                      data_parallel_size=2, executor="process")
    with pytest.raises(preflight.StartupError, match=r"per worker \(2 workers: 4 GiB\)"):
        preflight.check_model(two)
