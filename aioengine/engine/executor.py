"""Executors run model steps: in this process, or in a worker subprocess.

Both offer the same interface, so ``LLM`` and ``AsyncEngine`` do not care
where the model runs:

- ``num_blocks``, ``max_model_len``: from the worker's handshake.
- ``execute_model(so)``: run a step, blocking.
- ``await execute_model_async(so)``: run a step without blocking the loop.
- ``shutdown()``.
"""

from __future__ import annotations

import asyncio

from aioengine.config import EngineConfig
from aioengine.ipc.messages import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """The worker process exited or failed a step."""


class InprocExecutor:
    """Runs the ``ModelRunner`` in this process (tests, debugging, ``LLM`` with
    ``executor="inproc"``). The async form runs the step in a thread so the
    event loop stays free."""

    def __init__(self, config: EngineConfig) -> None:
        from aioengine.worker.model_runner import ModelRunner

        if config.parallel.num_threads:
            import torch
            torch.set_num_threads(config.parallel.num_threads)
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.load_time = self.runner.load_time

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)

    async def execute_model_async(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return await asyncio.to_thread(self.runner.execute_model, so)
        except Exception as exc:
            raise WorkerDiedError(f"model step failed: {exc!r}") from exc

    def is_alive(self) -> bool:
        return self.runner is not None

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]


def make_executor(config: EngineConfig, *, allow_kernel_build: bool = True):
    """The executor ``config.parallel.executor`` names; ``allow_kernel_build``
    False (a restart) keeps its workers from compiling the C++ kernels."""
    if config.parallel.executor == "inproc":
        return InprocExecutor(config)
    from aioengine.engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, allow_kernel_build=allow_kernel_build)


def make_standby_executor(config: EngineConfig):
    """A spare ``MultiprocExecutor`` (workers spawned, imports under way, no model)
    to replace a crashed one with ``activate()``; None when the config keeps none."""
    if config.parallel.executor != "process" or not config.parallel.standby_worker:
        return None
    from aioengine.engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, standby=True, allow_kernel_build=False)
