"""The engine's exceptions, in one place, with the HTTP status each maps to.

Modules that raised these before the move re-export them, so
``from aioengine.engine.core import RequestRejected`` and the like keep working.
``SamplingParamError`` (a bad sampling field, 400) stays beside ``SamplingParams``
and ``GrammarError`` (a constraint the grammar library refuses, 400) beside the
structured-output parameters; both are re-exported here.
"""

from __future__ import annotations

from aioengine.sampling_params import SamplingParamError
from aioengine.structured.params import GrammarError

__all__ = [
    "EngineDeadError",
    "GrammarError",
    "RequestRejected",
    "SamplingParamError",
    "SchedulerQueueFull",
    "WorkerDiedError",
]


class RequestRejected(ValueError):
    """A request that can never run: empty, too long for the context, or needing
    more KV blocks than the whole cache holds (HTTP 400).

    Attributes:
        param: the request field at fault (``prompt``, ``max_tokens``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SchedulerQueueFull(RuntimeError):
    """The waiting queue is at ``max_waiting_requests`` (HTTP 429)."""


class WorkerDiedError(RuntimeError):
    """The worker process exited, failed to start, or failed a step."""


class EngineDeadError(RuntimeError):
    """The worker died or is restarting, or the server is shutting down; in-flight
    requests were ended (HTTP 503)."""
