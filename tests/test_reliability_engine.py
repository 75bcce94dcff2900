"""AsyncEngine shut down while it restarts a crashed worker (issue 9): the
worker being started must not be orphaned with its shared-memory rings."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import uvloop
from reliability_util import pid_alive, shm_segments, spawned_workers, wait_until

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine


def test_shutdown_during_a_worker_restart_leaves_no_worker_and_no_segment():
    segments_before = shm_segments(os.getpid())
    workers_before = spawned_workers()

    async def main() -> tuple[int, int, float]:
        engine = await AsyncEngine.start(EngineConfig.from_kwargs(num_gpu_blocks_override=64))
        old = engine.executor.pid
        os.kill(old, signal.SIGKILL)
        # The restart has begun once a new worker process is loading.
        deadline = time.monotonic() + 60
        while not (spawned_workers() - workers_before - {old}):
            assert time.monotonic() < deadline, "no new worker was started"
            await asyncio.sleep(0.05)
        assert not engine.healthy
        (new,) = spawned_workers() - workers_before - {old}
        t0 = time.monotonic()
        await asyncio.wait_for(engine.shutdown(), 300)
        took = time.monotonic() - t0
        # Regression: shutdown() used to cancel the restart task and return
        # while its thread went on starting a worker that only the garbage
        # collector and the thread pool's exit would ever stop.
        assert not pid_alive(old)
        assert wait_until(lambda: not pid_alive(new), timeout=5), "the new worker outlived it"
        assert shm_segments(os.getpid()) == segments_before
        return took

    took = uvloop.run(main())
    print(f"shutdown during a restart took {took:.1f} s (it waits for the new worker to "
          f"come up, then stops it)")
