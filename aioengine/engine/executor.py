"""Moved to ``aioengine.executor``; these names are re-exported for old imports."""

from aioengine.errors import WorkerDiedError
from aioengine.executor import Executor, make_executor, make_standby_executor
from aioengine.executor.inproc import InprocExecutor

__all__ = [
    "Executor",
    "InprocExecutor",
    "WorkerDiedError",
    "make_executor",
    "make_standby_executor",
]
