"""Executors: where the model runs (see ``abstract.Executor`` for the interface).

- ``inproc.InprocExecutor``: in this process.
- ``multiproc.MultiprocExecutor``: worker subprocesses (one per tensor-parallel
  rank) behind shared-memory rings.

``make_executor`` picks one from ``config.parallel.executor``. Importing this
package imports neither model code nor torch; the in-process executor imports
them when constructed.
"""

from __future__ import annotations

from aioengine.config import EngineConfig
from aioengine.errors import WorkerDiedError
from aioengine.executor.abstract import Executor

__all__ = ["Executor", "WorkerDiedError", "make_executor", "make_standby_executor"]


def make_executor(config: EngineConfig, *, allow_kernel_build: bool = True) -> Executor:
    """The executor ``config.parallel.executor`` names; ``allow_kernel_build``
    False (a restart) keeps its workers from compiling the C++ kernels.

    Raises:
        ValueError: a tensor-parallel size the model cannot be split over.
        WorkerDiedError: a worker failed to start.
    """
    if config.parallel.executor == "inproc":
        from aioengine.executor.inproc import InprocExecutor

        return InprocExecutor(config)
    from aioengine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, allow_kernel_build=allow_kernel_build)


def make_standby_executor(config: EngineConfig) -> Executor | None:
    """A spare ``MultiprocExecutor`` (workers spawned, imports under way, no model)
    to replace a crashed one with ``activate()``; None when the config keeps none."""
    if config.parallel.executor != "process" or not config.parallel.standby_worker:
        return None
    from aioengine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, standby=True, allow_kernel_build=False)
