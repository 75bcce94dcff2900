"""Moved to ``aioengine.executor.multiproc``; re-exported for old imports."""

from aioengine.errors import WorkerDiedError
from aioengine.executor.multiproc import MultiprocExecutor
from aioengine.models.arch import check_parallel_config

__all__ = ["MultiprocExecutor", "WorkerDiedError", "check_parallel_config"]
