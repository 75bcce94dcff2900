"""The target of each spawned worker process.

``multiprocessing`` pickles the target by its module path; pointing it here
instead of at ``aioengine.worker.worker.worker_main`` keeps the engine process
from importing the worker (and through it torch, the model and the kernels):
only the child imports them.
"""

from __future__ import annotations


def run_worker(*args: object) -> None:
    """``aioengine.worker.worker.worker_main(*args)``, imported in the child."""
    from aioengine.worker.worker import worker_main

    worker_main(*args)  # type: ignore[arg-type]
