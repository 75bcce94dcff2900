"""Runs the ``ModelRunner`` in this process (tests, debugging, ``LLM`` with
``executor="inproc"``). The async form runs the step in a thread so the event
loop stays free. This is the one executor that imports model code into the
engine process."""

from __future__ import annotations

import asyncio

from aioengine.config import EngineConfig
from aioengine.errors import WorkerDiedError
from aioengine.executor.abstract import Executor
from aioengine.ipc.messages import ModelRunnerOutput, SchedulerOutput


class InprocExecutor(Executor):
    """The model in this process; see ``Executor`` for the interface."""

    def __init__(self, config: EngineConfig) -> None:
        from aioengine.worker.model_runner import ModelRunner

        if config.parallel.num_threads:
            import torch

            torch.set_num_threads(config.parallel.num_threads)
        self.runner: ModelRunner | None = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.load_time = self.runner.load_time

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise WorkerDiedError("the in-process executor is shut down")
        return self.runner.execute_model(scheduler_output)

    async def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return await asyncio.to_thread(self.execute_model, scheduler_output)
        except WorkerDiedError:
            raise
        except Exception as exc:
            raise WorkerDiedError(f"model step failed: {exc!r}") from exc

    def is_alive(self) -> bool:
        return self.runner is not None

    def shutdown(self) -> None:
        self.runner = None
