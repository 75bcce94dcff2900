"""Log output of aioengine's own loggers (``aioengine.*`` and ``triton_kernels.*``).

``aioengine serve --log-level`` configures them in the server process and, through
the ``AIOENGINE_LOG_LEVEL`` environment variable, in the worker processes it spawns
(a spawned process starts with Python's default logging, which shows warnings only).
Library use (``LLM``) leaves logging to the application unless that variable is set.
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "AIOENGINE_LOG_LEVEL"
_LOGGERS = ("aioengine", "triton_kernels")


def configure_logging(level: str | None = None) -> None:
    """Send our loggers' records at ``level`` and above to stderr.

    Args:
        level: a ``logging`` level name (any case); None reads ``AIOENGINE_LOG_LEVEL``
            and does nothing when it is unset. A given level is also exported in that
            variable for child processes.

    Raises:
        ValueError: for an unknown level name.
    """
    level = (level or os.environ.get(LOG_LEVEL_ENV) or "").upper()
    if not level:
        return
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"unknown log level {level!r}")
    os.environ[LOG_LEVEL_ENV] = level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in _LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level)
        log.handlers[:] = [handler]
        log.propagate = False
