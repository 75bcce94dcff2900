"""AsyncEngine on uvloop with the worker subprocess: streaming, abort, and
recovery from a SIGKILLed worker without restarting the engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import uvloop

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine, EngineDeadError
from aioengine.sampling_params import SamplingParams


def run(coro):
    return uvloop.run(coro)


def config() -> EngineConfig:
    return EngineConfig.from_kwargs(num_gpu_blocks_override=400, max_num_seqs=16)


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams) -> str:
    text = ""
    async for out in engine.generate(prompt, params):
        text += "".join(c.delta_text for c in out.outputs)
    return text


def test_abort_frees_blocks_and_worker_crash_recovers():
    async def main():
        engine = await AsyncEngine.start(config())
        try:
            # A stream left early aborts its request and frees its blocks at once.
            base = engine.stats().num_kv_blocks_used
            agen = engine.generate("Tell me a long story.",
                                   SamplingParams(max_tokens=500, ignore_eos=True))
            async for _ in agen:
                break
            await agen.aclose()
            assert engine.stats().num_running == 0
            assert engine.stats().num_kv_blocks_used == base

            old = engine.executor
            segments = [old.ring_in.name, old.ring_out.name]
            params = SamplingParams(max_tokens=1000, ignore_eos=True)
            tasks = [asyncio.create_task(collect(engine, f"Story number {i}:", params))
                     for i in range(8)]
            while engine.stats().num_running < 8:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            os.kill(old.pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert time.monotonic() - t0 < 2.0
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert not engine.healthy
            with pytest.raises(EngineDeadError):
                engine.add_request("during-restart", [1, 2, 3], SamplingParams(max_tokens=2))
            deadline = time.monotonic() + 120
            while not engine.healthy:
                assert time.monotonic() < deadline, "the worker was not restarted"
                await asyncio.sleep(0.2)
            assert engine.num_worker_restarts == 1
            assert engine.executor is not old
            assert not any(os.path.exists(f"/dev/shm/{n}") for n in segments)
            text = await collect(engine, "The capital of France is",
                                 SamplingParams(temperature=0, max_tokens=8))
            assert "Paris" in text
            assert engine.stats().num_running == 0
        finally:
            await engine.shutdown()
        assert not engine.executor.is_alive()

    run(main())
