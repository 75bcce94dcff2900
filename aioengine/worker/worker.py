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

Across nodes, the ranks on the engine's node keep their rings; the ranks on
other nodes have none (``remote_rank_main``): rank 0 forwards each message it
reads to them over the step broadcast (``distributed.step_channel``) and, while
idle, exchanges a heartbeat with them. A broken group (a peer died, or timed
out) ends every surviving rank: on node 0 the engine restarts its ranks, on
the other nodes ``distributed.worker_node`` does, and they meet again at the
master's rendezvous.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import traceback
from typing import TYPE_CHECKING

from aioengine.config import EngineConfig
from aioengine.distributed.layout import DistInit
from aioengine.ipc.messages import (
    LoadModel,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    decode_to_worker,
    encode,
)
from aioengine.ipc.shm_ring import RingHandle, ShmRing
from aioengine.logger import configure_logging

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from aioengine.distributed.step_channel import StepChannel
    from aioengine.worker.model_runner import ModelRunner

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


def _prewarm(config: EngineConfig) -> None:
    """What a standby worker does before it is needed: the imports (torch,
    the model code, and for an HF folder transformers' config classes, read
    once) and the C++ kernels' existing build, i.e. all of a start but reading
    the weights and allocating the KV cache."""
    import torch  # noqa: F401

    import aioengine.worker.model_runner  # noqa: F401
    from aioengine.models.loader import is_gguf, load_hf_config
    from triton_kernels import cpu_ops

    cpu_ops.load()
    if not is_gguf(config.model.model_path):
        load_hf_config(config.model.model_path)  # imports transformers: ~2 s on a CPU


# See worker_main; read by libgomp when torch is first imported.
DEFAULT_GOMP_SPINCOUNT = "10000"


def worker_main(config: EngineConfig, ring_in_handle: RingHandle | None,
                ring_out_handle: RingHandle | None, parent_pid: int,
                dist: DistInit | None = None, standby: bool = False,
                allow_kernel_build: bool = True, node_conn: Connection | None = None) -> None:
    """Run until shutdown. Never raises: failures go back as ``WorkerError``.

    Args:
        ring_in_handle, ring_out_handle: the rank's rings; None for a rank on
            another node than the engine's, which reads its steps from rank 0's
            broadcast instead (``remote_rank_main``) and answers nothing.
        dist: how a tensor-parallel rank joins its group; None for the single
            worker.
        standby: do the imports, then wait for ``LoadModel`` before loading the
            model (a spare that replaces a crashed worker in well under a second);
            ``Shutdown`` or the engine closing the ring ends it.
        allow_kernel_build: False for every worker after the first: the C++
            kernels come from the existing build or not at all (the torch path,
            logged), never from a compile during a restart.
        node_conn: a remote rank's pipe to its node (``distributed.worker_node``):
            a standby waits on it for the signal to join (end of file stops it);
            every remote rank sends on it once it joined the group. A standby
            local rank waits for ``LoadModel`` instead.
    """
    _die_with_parent(parent_pid)
    configure_logging()  # the level ``aioengine serve --log-level`` exported, if any
    _no_tqdm_semaphore()
    rank = 0 if dist is None else dist.rank
    _set_process_title(process_title(rank, standby))
    if not allow_kernel_build:
        os.environ["AIOENGINE_CPU_KERNELS_BUILD"] = "0"  # read by triton_kernels.cpu_ops
    if dist is not None:
        # Before torch is imported: OpenMP reads it once.
        os.environ["OMP_NUM_THREADS"] = str(dist.num_threads)
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
    if ring_in_handle is None or ring_out_handle is None:
        assert dist is not None, "only a tensor-parallel rank runs without rings"
        if standby:
            _wait_as_standby(config, node_conn)
            _set_process_title(process_title(rank, standby=False))
        remote_rank_main(config, dist, node_conn)
        return
    ring_in = ShmRing.attach(ring_in_handle)
    ring_out = ShmRing.attach(ring_out_handle)
    if standby:
        try:
            _prewarm(config)
            msg = decode_to_worker(ring_in.get())
        except EOFError:
            msg = Shutdown()
        except BaseException:
            ring_out.put(encode(WorkerError(traceback.format_exc())))
            msg = Shutdown()
        if not isinstance(msg, LoadModel):
            ring_in.close()
            ring_out.close()
            # Never used: skip the interpreter's teardown of torch and transformers
            # (seconds on a busy CPU, which the engine's shutdown would wait for).
            logging.shutdown()
            os._exit(0)
        _set_process_title(process_title(rank, standby=False))
    try:
        runner, channel = _start(config, dist)
        ring_out.put(encode(WorkerReady(runner.num_blocks, runner.block_size, runner.max_model_len,
                                        runner.model.parameter_bytes(), runner.load_time)))
    except BaseException:
        ring_out.put(encode(WorkerError(traceback.format_exc())))
        return
    # Rank 0 of a group with ranks on other nodes forwards every message and, while
    # idle, checks that the group lives (a heartbeat each quarter of the timeout).
    heartbeat_s = None
    if channel is not None and dist is not None:
        heartbeat_s = max(0.5, dist.collective_timeout_s / 4)
    try:
        while True:
            try:
                data = ring_in.get(timeout=heartbeat_s)
            except EOFError:
                break
            except TimeoutError:
                data = None
            try:
                if data is None:
                    channel.heartbeat()  # type: ignore[union-attr]
                    continue
                msg = decode_to_worker(data)
                if isinstance(msg, Shutdown):
                    if channel is not None:
                        with contextlib.suppress(Exception):  # a node already gone
                            channel.send(data)
                    break
                if not isinstance(msg, SchedulerOutput):
                    continue  # LoadModel: only a standby waits for one
                if channel is not None:
                    channel.send(data)  # the bytes as read: no second encoding
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
    if dist is not None:
        # Skip the group's teardown at exit: with a peer already gone it waits, and
        # the engine's shutdown then waits its 5 s before killing this process.
        logging.shutdown()
        os._exit(0)


def _start(config: EngineConfig, dist: DistInit | None) -> tuple[ModelRunner, StepChannel | None]:
    """Join the group (if any), load the model; the step channel of rank 0 and
    the remote ranks when the group spans nodes."""
    import torch

    channel = None
    if dist is None:
        if config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
    else:
        from aioengine.distributed import parallel_state

        torch.set_num_threads(dist.num_threads)
        if dist.multi_node:
            from aioengine.distributed.step_channel import StepChannel

            parallel_state.init_multi_node(dist)
            check_same_config(config, parallel_state.all_gather_object(config_fingerprint(config)))
            if dist.rank == 0 or dist.rank in dist.remote_ranks:
                channel = StepChannel(parallel_state.step_group())  # type: ignore[arg-type]
        else:
            parallel_state.init_tensor_parallel(dist.rank, dist.world_size, dist.init_method)
    from aioengine.worker.model_runner import ModelRunner

    runner = ModelRunner(config)
    if dist is not None and dist.multi_node:
        from aioengine.distributed import parallel_state

        parallel_state.set_collective_timeout(dist.collective_timeout_s)
    return runner, channel


def config_fingerprint(config: EngineConfig) -> dict[str, object]:
    """What every node's ranks must agree on (each node starts them from its own
    flags): the model file's name, the dtypes, the KV cache and the sizes."""
    m, c, p = config.model, config.cache, config.parallel
    return {"model": os.path.basename(m.model_path.rstrip("/")), "dtype": m.dtype,
            "quantization": m.quantization, "max_model_len": m.max_model_len,
            "block_size": c.block_size, "kv_cache_memory": c.kv_cache_memory_bytes,
            "num_gpu_blocks_override": c.num_gpu_blocks_override,
            "kv_cache_dtype": c.kv_cache_dtype, "tensor_parallel_size": p.tensor_parallel_size,
            "nnodes": p.nnodes}


def check_same_config(config: EngineConfig, fingerprints: list[object]) -> None:
    """Raise ``ValueError`` naming the first setting where a rank differs from rank 0."""
    first = fingerprints[0]
    assert isinstance(first, dict)
    for rank, other in enumerate(fingerprints):
        assert isinstance(other, dict)
        for key, value in first.items():
            if other.get(key) != value:
                raise ValueError(f"rank {rank} was started with {key}={other.get(key)!r} but "
                                 f"rank 0 with {key}={value!r}: start every node with the "
                                 f"same flags but --node-rank")


def _wait_as_standby(config: EngineConfig, go: Connection | None) -> None:
    """Do the imports, then wait for the node's signal; exit on end of file."""
    try:
        _prewarm(config)
        if go is not None:
            go.recv()
    except EOFError:
        os._exit(0)
    except BaseException:
        logger.error("standby rank failed its imports:\n%s", traceback.format_exc())
        os._exit(1)


def remote_rank_main(config: EngineConfig, dist: DistInit,
                     node_conn: Connection | None = None) -> None:
    """A rank on another node than the engine's: join, load, then run every step
    rank 0 broadcasts until ``Shutdown``. Any failure ends the process (its
    node restarts it to rejoin the next group); it answers nothing, but tells
    ``node_conn`` once it joined."""
    rank = dist.rank
    try:
        runner, channel = _start(config, dist)
    except BaseException as exc:
        logger.error("tensor-parallel rank %d did not join the group at %s: %s", rank,
                     dist.init_method, str(exc).strip().splitlines()[-1] if str(exc) else
                     type(exc).__name__)
        logger.debug("%s", traceback.format_exc())
        os._exit(1)
    assert channel is not None
    logger.info("tensor-parallel rank %d joined the group at %s (%d KV blocks)", rank,
                dist.init_method, runner.num_blocks)
    if node_conn is not None:
        with contextlib.suppress(OSError):
            node_conn.send(True)
    code = 0
    try:
        while True:
            data = channel.recv()
            if data is None:
                continue
            msg = decode_to_worker(data)
            if isinstance(msg, Shutdown):
                logger.info("tensor-parallel rank %d: the engine shut the group down", rank)
                break
            if isinstance(msg, SchedulerOutput):
                runner.execute_model(msg)
    except Exception as exc:
        logger.warning("tensor-parallel rank %d left the group: %s", rank,
                       str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__)
        code = 1
    # Skip the group's teardown: its peers may be gone, and a collective now would wait.
    logging.shutdown()
    os._exit(code)
