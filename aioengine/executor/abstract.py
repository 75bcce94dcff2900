"""What an executor is: the one object the engine hands each step to.

An executor runs ``SchedulerOutput`` steps on the model somewhere (this
process, or worker subprocesses behind shared-memory rings) and answers each
with a ``ModelRunnerOutput``. ``EngineCore`` and ``AsyncEngine`` talk to it
only through this interface, so neither cares where the model runs.

Lifecycle: the constructor starts the workers and returns once they have
loaded the model and answered the handshake (``num_blocks``, ``max_model_len``
are then set); ``execute_model``/``execute_model_async`` run steps; a dead
worker shows as ``WorkerDiedError`` from a step and as ``is_alive()`` False (a
watchable ``sentinel`` fd where the executor has processes); ``shutdown()``
stops everything and is idempotent.

Errors: ``WorkerDiedError`` (``aioengine.errors``) for a worker that died,
failed to start or failed a step; ``ValueError`` from the constructor for a
configuration the model cannot run (before anything is started).
"""

from __future__ import annotations

import abc
import collections
import multiprocessing.process

from aioengine.errors import WorkerDiedError
from aioengine.ipc.messages import ModelRunnerOutput, SchedulerOutput

__all__ = ["Executor", "WorkerDiedError"]


class Executor(abc.ABC):
    """Base of every executor.

    Attributes:
        num_blocks: KV cache blocks the worker allocated (from its handshake).
        max_model_len: context length in tokens (from its handshake).
        load_time: seconds from start to ready.
    """

    num_blocks: int
    max_model_len: int
    load_time: float = 0.0

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step, blocking.

        Raises:
            WorkerDiedError: the worker died or failed the step.
        """

    @abc.abstractmethod
    async def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step without blocking the event loop.

        Raises:
            WorkerDiedError: the worker died or failed the step (``is_alive()``
                tells the two apart).
        """

    # -- steps in flight (async scheduling) --------------------------------------------
    # ``submit`` hands a step over without waiting; ``get_output`` returns the oldest
    # submitted step's output. An executor whose worker queues steps (the rings of
    # ``MultiprocExecutor``) overrides them so the worker finds step N+1 waiting when
    # it finishes step N. This default runs each step when its output is asked for:
    # correct, in order, without overlap.

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Queue a step; its output comes from a later ``get_output``.

        Raises:
            WorkerDiedError: the worker is gone.
        """
        self._queued_steps().append(scheduler_output)

    def get_output(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step, blocking.

        Raises:
            WorkerDiedError: the worker died or failed that step.
        """
        return self.execute_model(self._queued_steps().popleft())

    async def submit_async(self, scheduler_output: SchedulerOutput) -> None:
        """``submit`` without blocking the event loop."""
        self._queued_steps().append(scheduler_output)

    async def get_output_async(self) -> ModelRunnerOutput:
        """``get_output`` without blocking the event loop."""
        return await self.execute_model_async(self._queued_steps().popleft())

    def _queued_steps(self) -> collections.deque[SchedulerOutput]:
        queue = self.__dict__.get("_step_queue")
        if queue is None:
            queue = self.__dict__["_step_queue"] = collections.deque()
        return queue

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """True while every worker of this executor lives."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources. Idempotent."""

    @property
    def sentinel(self) -> int | None:
        """An fd that becomes readable when a worker exits, for ``loop.add_reader``;
        None when the model runs in this process."""
        return None

    @property
    def exited_process(self) -> multiprocessing.process.BaseProcess | None:
        """The first worker process that has exited, if any (for its exit code)."""
        return None

    def activate(self) -> Executor:
        """Make a standby executor serve (its workers load the model now);
        returns ``self``. Executors without a standby mode are always active."""
        return self
