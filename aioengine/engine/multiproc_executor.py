"""Runs the model in a spawned worker subprocess behind two shared-memory rings.

engine --SchedulerOutput--> ring_in --> worker
engine <--ModelRunnerOutput-- ring_out <-- worker

The engine process creates and unlinks both segments. On the event loop a
step is ``await ring_in.put_async`` then ``await ring_out.get_async`` (a pipe
doorbell watched with ``loop.add_reader``): the loop serves other work while
the worker computes. A dead worker shows as end of file on the doorbell, and
the process sentinel is watched too, so the step raises ``WorkerDiedError``
at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
import time

from aioengine.config import EngineConfig
from aioengine.engine.executor import WorkerDiedError
from aioengine.ipc.messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    decode_from_worker,
    encode,
)
from aioengine.ipc.shm_ring import ShmRing
from aioengine.worker.worker import worker_main

RING_CAPACITY = 16 << 20   # bytes per direction; one step message is far smaller
STARTUP_TIMEOUT_S = 600.0


@contextlib.contextmanager
def _main_module_hidden():
    """Keep ``spawn`` from re-running the user's script in the worker.

    The worker needs nothing from ``__main__``; without this, a script that
    builds ``LLM(...)`` at top level (no ``if __name__ == "__main__"`` guard)
    would start the engine again inside its own worker.
    """
    main = sys.modules.get("__main__")
    saved_file = getattr(main, "__file__", None)
    saved_spec = getattr(main, "__spec__", None)
    if saved_file is not None:
        del main.__file__
    main.__spec__ = None
    try:
        yield
    finally:
        if saved_file is not None:
            main.__file__ = saved_file
        main.__spec__ = saved_spec


class MultiprocExecutor:
    """Spawns the worker and exchanges step messages with it.

    Raises (constructor):
        WorkerDiedError: the worker failed to load the model or died at start;
            the message carries its traceback.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ring_in = ShmRing.create(RING_CAPACITY, role="producer")
        self.ring_out = ShmRing.create(RING_CAPACITY, role="consumer")
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=worker_main, name="aioengine-worker", daemon=True,
            args=(config, self.ring_in.handle(), self.ring_out.handle(), os.getpid()))
        t0 = time.perf_counter()
        with _main_module_hidden():
            self.process.start()
        try:
            ready = self._receive(self.ring_out.get(timeout=STARTUP_TIMEOUT_S))
        except (EOFError, TimeoutError) as exc:
            self.shutdown()
            raise WorkerDiedError(f"worker did not start: {exc!r}") from exc
        except WorkerDiedError:
            self.shutdown()
            raise
        assert isinstance(ready, WorkerReady)
        self.num_blocks = ready.num_blocks
        self.max_model_len = ready.max_model_len
        self.weight_bytes = ready.weight_bytes
        self.load_time = time.perf_counter() - t0

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @staticmethod
    def _receive(data: bytes):
        msg = decode_from_worker(data)
        if isinstance(msg, WorkerError):
            raise WorkerDiedError(f"worker error:\n{msg.message}")
        return msg

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step, blocking (``LLM``)."""
        try:
            self.ring_in.put(encode(so))
            return self._receive(self.ring_out.get())
        except (EOFError, BrokenPipeError) as exc:
            raise WorkerDiedError(
                f"worker process died (exit code {self.process.exitcode})") from exc

    async def execute_model_async(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step without blocking the event loop."""
        try:
            await self.ring_in.put_async(encode(so))
            return self._receive(await self.ring_out.get_async())
        except (EOFError, BrokenPipeError) as exc:
            await asyncio.sleep(0)
            raise WorkerDiedError(
                f"worker process died (exit code {self.process.exitcode})") from exc

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the worker (politely, then SIGKILL) and unlink both segments. Idempotent."""
        if self.process.is_alive():
            try:
                self.ring_in.try_put(encode(Shutdown()))
            except Exception:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)
        for ring in (self.ring_in, self.ring_out):
            ring.close()
            ring.unlink()
