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
        # No standby: the restart then spawns and loads a fresh worker, the
        # slow path this test needs a window into (the standby's is below).
        engine = await AsyncEngine.start(EngineConfig.from_kwargs(num_gpu_blocks_override=64,
                                                                  standby_worker=False))
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


def test_shutdown_right_after_a_kill_with_a_standby_leaves_nothing():
    """The standby path: killed, then shut down while the standby takes over (or
    just after); neither the standby, nor the one spawned behind it, nor any
    segment may outlive the engine."""
    segments_before = shm_segments(os.getpid())
    workers_before = spawned_workers()

    async def main() -> set[int]:
        engine = await AsyncEngine.start(EngineConfig.from_kwargs(num_gpu_blocks_override=64))
        deadline = time.monotonic() + 60
        while engine._standby is None:  # spawned once the first worker is ready
            assert time.monotonic() < deadline, "no standby worker"
            await asyncio.sleep(0.05)
        standby_pid = engine._standby.pid
        os.kill(engine.executor.pid, signal.SIGKILL)
        while engine.healthy:
            await asyncio.sleep(0.01)
        seen = spawned_workers() - workers_before
        await asyncio.wait_for(engine.shutdown(), 120)
        return seen | {standby_pid}

    seen = uvloop.run(main())
    assert wait_until(lambda: not any(pid_alive(p) for p in seen), timeout=10)
    assert not (spawned_workers() - workers_before)
    assert shm_segments(os.getpid()) == segments_before
