"""Worker subprocess entry: load the model, allocate the KV cache, serve steps.

Started with the ``spawn`` method by ``MultiprocExecutor``. It reads
``SchedulerOutput`` messages from the engine->worker ring and answers each
with a ``ModelRunnerOutput`` on the worker->engine ring; the first message it
sends is the ``WorkerReady`` handshake with ``num_blocks``. It exits on a
``Shutdown`` message, when the engine closes its ring (end of file on the
doorbell), or, through ``PR_SET_PDEATHSIG``, when the engine process dies.

Under tensor parallelism every rank runs ``worker_main`` with its own pair
of rings: each joins the process group, sends its own handshake, and runs
every step; only rank 0 answers steps. A failed step leaves the ranks'
collectives out of step, so with several ranks it ends the process (rank 0
sends the traceback first) and the engine restarts them all.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import traceback

from aioengine.config import EngineConfig
from aioengine.ipc.messages import (
    LoadModel,
    Shutdown,
    WorkerError,
    WorkerReady,
    decode_to_worker,
    encode,
)
from aioengine.ipc.shm_ring import RingHandle, ShmRing
from aioengine.logger import configure_logging

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def process_title(rank: int, standby: bool) -> str:
    """The worker's ``/proc/PID/comm`` (at most 15 bytes): ``aioengine-wrk0``
    serving, ``aioengine-sby0`` waiting as a standby; ``ps -o comm`` and the
    tests tell the two apart by it."""
    return f"aioengine-{'sby' if standby else 'wrk'}{rank}"[:15]


def _set_process_title(title: str) -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_NAME, title.encode(), 0, 0, 0)
    except OSError:
        pass


def _no_tqdm_semaphore() -> None:
    """Keep tqdm from creating its ``multiprocessing.RLock`` in this process.

    Every tqdm bar (transformers and gguf print some while loading) creates, once per
    process, a named POSIX semaphore registered with the resource tracker, which a
    spawned worker shares with the engine. A SIGKILLed worker never unregisters it,
    and at shutdown the tracker warned "There appear to be 1 leaked semaphore objects"
    (one per killed worker). A thread lock is all one process needs.
    """
    try:
        import tqdm.std
    except ImportError:
        return
    tqdm.std.TqdmDefaultWriteLock.mp_lock = None


def _prewarm() -> None:
    """What a standby worker does before it is needed: the imports (torch,
    the model code, transformers) and the C++ kernels' existing build, i.e. all
    of a start but reading the weights and allocating the KV cache."""
    import torch  # noqa: F401

    import aioengine.worker.model_runner  # noqa: F401
    from triton_kernels import cpu_ops

    cpu_ops.load()


# See worker_main; read by libgomp when torch is first imported.
DEFAULT_GOMP_SPINCOUNT = "10000"


def worker_main(config: EngineConfig, ring_in_handle: RingHandle, ring_out_handle: RingHandle,
                parent_pid: int, dist: tuple[int, str, int, int] | None = None,
                standby: bool = False, allow_kernel_build: bool = True) -> None:
    """Run until shutdown. Never raises: failures go back as ``WorkerError``.

    Args:
        dist: ``(rank, init_method, world_size, num_threads)`` of a
            tensor-parallel rank; None for the single worker.
        standby: do the imports, then wait for ``LoadModel`` before loading the
            model (a spare that replaces a crashed worker in well under a second);
            ``Shutdown`` or the engine closing the ring ends it.
        allow_kernel_build: False for every worker after the first: the C++
            kernels come from the existing build or not at all (the torch path,
            logged), never from a compile during a restart.
    """
    _die_with_parent(parent_pid)
    configure_logging()  # the level ``aioengine serve --log-level`` exported, if any
    _no_tqdm_semaphore()
    rank = 0 if dist is None else dist[0]
    _set_process_title(process_title(rank, standby))
    if not allow_kernel_build:
        os.environ["AIOENGINE_CPU_KERNELS_BUILD"] = "0"  # read by triton_kernels.cpu_ops
    if dist is not None:
        # Before torch is imported: OpenMP reads it once.
        os.environ["OMP_NUM_THREADS"] = str(dist[3])
    # libgomp's threads spin for 300,000 iterations (OMP_WAIT_POLICY unset) at every
    # barrier before sleeping. With one more busy process than cores, each of the
    # ~120 matmuls of a step then waits a scheduler slice: a batch-1 decode step ran
    # 10x slower beside a single busy loop on the 2-core dev machine. 10,000 spins
    # cost nothing measurable on an idle machine and keep most of the speed under
    # contention (bench/README.md). Set GOMP_SPINCOUNT yourself to override.
    os.environ.setdefault("GOMP_SPINCOUNT", DEFAULT_GOMP_SPINCOUNT)
    # Ctrl-C in a terminal, or a service manager's SIGTERM, reaches the whole
    # process group; the engine decides when the worker stops (it drains first)
    # and PR_SET_PDEATHSIG ends the worker if the engine dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ring_in = ShmRing.attach(ring_in_handle)
    ring_out = ShmRing.attach(ring_out_handle)
    if standby:
        try:
            _prewarm()
            msg = decode_to_worker(ring_in.get())
        except EOFError:
            msg = Shutdown()
        except BaseException:
            ring_out.put(encode(WorkerError(traceback.format_exc())))
            msg = Shutdown()
        if not isinstance(msg, LoadModel):
            ring_in.close()
            ring_out.close()
            return
        _set_process_title(process_title(rank, standby=False))
    try:
        import torch

        if dist is not None:
            from aioengine.distributed.parallel_state import init_tensor_parallel

            torch.set_num_threads(dist[3])
            init_tensor_parallel(rank, dist[2], dist[1])
        elif config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
        from aioengine.worker.model_runner import ModelRunner

        runner = ModelRunner(config)
        ring_out.put(encode(WorkerReady(runner.num_blocks, runner.block_size, runner.max_model_len,
                                        runner.model.parameter_bytes(), runner.load_time)))
    except BaseException:
        ring_out.put(encode(WorkerError(traceback.format_exc())))
        return
    try:
        while True:
            try:
                msg = decode_to_worker(ring_in.get())
            except EOFError:
                break
            if isinstance(msg, Shutdown):
                break
            try:
                out = runner.execute_model(msg)
            except Exception:
                if rank == 0:
                    ring_out.put(encode(WorkerError(traceback.format_exc())))
                if dist is None:
                    continue
                logger.error("tensor-parallel rank %d failed a step; exiting:\n%s", rank,
                             traceback.format_exc())
                os._exit(1)
            if rank == 0:
                ring_out.put(encode(out))
    except BrokenPipeError:
        pass
    finally:
        ring_in.close()
        ring_out.close()
