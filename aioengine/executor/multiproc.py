"""Runs the model in spawned worker subprocesses behind shared-memory rings.

engine --SchedulerOutput--> ring_in --> worker
engine <--ModelRunnerOutput-- ring_out <-- worker

With ``tensor_parallel_size`` N > 1 there are N workers (ranks) in one
torch.distributed process group (gloo: the model computes on CPU; rendezvous on a
free loopback port). Each rank has its own pair of rings: every step is put
on all N input rings (N single-reader rings rather than one broadcast ring:
the message is a few hundred bytes, so N copies cost microseconds); only
rank 0 answers with a ``ModelRunnerOutput``; the other ranks' output rings
carry only their handshake. Any rank's death is a worker crash: ``sentinel``
is then an epoll fd that becomes readable when any rank's process sentinel
does, and ``is_alive()`` is true only while every rank lives.

Across nodes (``parallel.nnodes`` > 1) this executor runs on node 0 and starts
only node 0's ranks, as above; rank 0 hosts the group's rendezvous at
``master_addr:master_port`` and forwards every step to the other nodes' ranks
(``distributed.step_channel``). A remote rank that dies, or a host that drops,
breaks rank 0's next collective (at once when the peer's sockets close, else
after ``distributed_timeout_s``): rank 0 reports the step failed and exits, so
the death looks exactly like a local one, and the restart waits at the
rendezvous for the other nodes to rejoin.

The engine process creates and unlinks both segments. On the event loop a
step is ``await ring_in.put_async`` then ``await ring_out.get_async`` (a pipe
doorbell watched with ``loop.add_reader``): the loop serves other work while
the worker computes. A dead worker shows as end of file on the doorbell, and
the process sentinel is watched too, so the step raises ``WorkerDiedError``
at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import select
import sys
import time

from aioengine.config import EngineConfig
from aioengine.distributed.layout import DistInit, route_addr
from aioengine.errors import WorkerDiedError
from aioengine.executor._worker_entry import run_worker
from aioengine.executor.abstract import Executor
from aioengine.ipc.messages import (
    LoadModel,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    decode_from_worker,
    encode,
)
from aioengine.ipc.shm_ring import ShmRing
from aioengine.models.arch import check_parallel_config

RING_CAPACITY = 16 << 20  # bytes per direction; one step message is far smaller
HANDSHAKE_RING_CAPACITY = 1 << 20  # ranks > 0 send only their handshake (or a traceback)
STARTUP_TIMEOUT_S = 600.0
# Across nodes, how long a restarted group waits at the rendezvous per attempt
# (the engine then tries again): it bounds how long a shutdown waits too.
RESTART_RENDEZVOUS_S = 60.0
ERROR_GRACE_S = 3.0  # after one rank fails at start, how long to collect the others' errors


@contextlib.contextmanager
def _main_module_hidden():
    """Keep ``spawn`` from re-running the user's script in the worker.

    The worker needs nothing from ``__main__``; without this, a script that
    builds ``LLM(...)`` at top level (no ``if __name__ == "__main__"`` guard)
    would start the engine again inside its own worker.
    """
    main = sys.modules["__main__"]
    saved_file = getattr(main, "__file__", None)
    saved_spec = getattr(main, "__spec__", None)
    if saved_file is not None:
        del main.__file__
    main.__spec__ = None
    try:
        yield
    finally:
        if saved_file is not None:
            main.__file__ = saved_file
        main.__spec__ = saved_spec


def _threads_per_rank(config: EngineConfig) -> int:
    """Torch intra-op threads of each worker; 0 leaves torch's default (one worker).
    With several workers (tensor-parallel ranks times data-parallel replicas)
    the cores are divided among them."""
    p = config.parallel
    workers = p.tensor_parallel_size // p.nnodes * p.data_parallel_size  # on this node
    if p.num_threads or workers == 1:
        return p.num_threads
    return max(1, (os.cpu_count() or 1) // workers)


def dist_inits(config: EngineConfig, *, first_start: bool) -> list[DistInit]:
    """How each of this node's ranks joins the group (an empty list without
    tensor parallelism). On one host: a free loopback port; across nodes: the
    master's address, this node's own address and the collective timeout.
    ``first_start`` False (a restart or a standby) waits ``RESTART_RENDEZVOUS_S``
    at the rendezvous instead of ``STARTUP_TIMEOUT_S``."""
    p = config.parallel
    if p.tensor_parallel_size == 1:
        return []
    threads = _threads_per_rank(config) or os.cpu_count() or 1  # 0: one rank on this node
    if p.nnodes == 1:
        from aioengine.distributed.parallel_state import get_open_port

        method = f"tcp://127.0.0.1:{get_open_port()}"
        return [
            DistInit(rank, p.tensor_parallel_size, method, threads)
            for rank in range(p.tensor_parallel_size)
        ]
    layout = p.node_layout
    host = f"[{p.master_addr}]" if ":" in p.master_addr else p.master_addr
    node_addr = p.node_addr
    if not node_addr and not os.environ.get("GLOO_SOCKET_IFNAME"):
        node_addr = route_addr(p.master_addr, p.master_port)
    return [
        DistInit(
            rank,
            p.tensor_parallel_size,
            f"tcp://{host}:{p.master_port}",
            threads,
            remote_ranks=layout.remote_ranks,
            node_addr=node_addr,
            rendezvous_timeout_s=STARTUP_TIMEOUT_S if first_start else RESTART_RENDEZVOUS_S,
            collective_timeout_s=p.distributed_timeout_s,
        )
        for rank in layout.local_ranks
    ]


def _worker_config(config: EngineConfig) -> EngineConfig:
    """The config a worker gets: without tensor parallelism (no ``dist`` tuple to
    carry the thread count) its ``num_threads`` is ``_threads_per_rank``, so the
    replicas of ``-dp N`` divide the cores too instead of each taking them all."""
    if config.parallel.tensor_parallel_size > 1:
        return config
    threads = _threads_per_rank(config)
    if threads == config.parallel.num_threads:
        return config
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, num_threads=threads)
    )


class MultiprocExecutor(Executor):
    """Spawns the worker (one per tensor-parallel rank) and exchanges step messages.

    Attributes (besides the executor interface):
        processes, rings_in, rings_out: one per rank on this host (all of
            them on one host; node 0's across nodes); ``process``,
            ``ring_in``, ``ring_out``, ``pid`` are rank 0's.
        rank_weight_bytes: each of those ranks' parameter bytes from its handshake.

    Args:
        config: engine settings.
        standby: spawn the workers but let them stop after their imports; the
            executor is usable once ``activate()`` returns (``AsyncEngine``
            keeps one such spare to replace a crashed worker).
        allow_kernel_build: False for a restart or a standby: the workers never
            compile the C++ kernels (see ``worker_main``).

    Raises (constructor, and ``activate``):
        ValueError: ``tensor_parallel_size`` does not split the model's heads
            (before anything is spawned).
        WorkerDiedError: a worker failed to load the model or died at start;
            the message carries the tracebacks of the ranks that failed.
    """

    def __init__(
        self, config: EngineConfig, *, standby: bool = False, allow_kernel_build: bool = True
    ) -> None:
        check_parallel_config(config)
        if config.parallel.node_rank != 0:
            raise ValueError(
                "only node 0 runs the engine; node_rank "
                f"{config.parallel.node_rank} runs worker ranks only "
                "(distributed.worker_node)"
            )
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        inits = dist_inits(config, first_start=allow_kernel_build and not standby)
        self.num_local_ranks = n = max(1, len(inits))
        self.rings_in = [ShmRing.create(RING_CAPACITY, role="producer") for _ in range(n)]
        self.rings_out = [
            ShmRing.create(RING_CAPACITY if rank == 0 else HANDSHAKE_RING_CAPACITY, role="consumer")
            for rank in range(n)
        ]
        self.ring_in, self.ring_out = self.rings_in[0], self.rings_out[0]
        self._epoll: select.epoll | None = None
        ctx = multiprocessing.get_context("spawn")
        worker_config = _worker_config(config)
        self.processes = [
            ctx.Process(
                target=run_worker,
                name=f"aioengine-worker-{rank}",
                daemon=True,
                args=(
                    worker_config,
                    self.rings_in[rank].handle(),
                    self.rings_out[rank].handle(),
                    os.getpid(),
                    inits[rank] if inits else None,
                    standby,
                    allow_kernel_build,
                ),
            )
            for rank in range(n)
        ]
        self.process = self.processes[0]
        self.standby = standby
        self._t0 = time.perf_counter()
        with _main_module_hidden():
            for process in self.processes:
                process.start()
        if n > 1:
            self._epoll = select.epoll()
            for process in self.processes:
                self._epoll.register(process.sentinel, select.EPOLLIN)
        if not standby:
            self._finish_start()

    def activate(self) -> MultiprocExecutor:
        """Make a standby executor serve: its workers load the model now. Blocking
        (seconds at most: the imports are done); returns ``self``.

        Raises:
            WorkerDiedError: a worker died while waiting or failed to load; the
                executor is shut down then.
        """
        if not self.standby:
            return self
        self.standby = False
        self._t0 = time.perf_counter()
        try:
            for ring in self.rings_in:
                ring.put(encode(LoadModel()), timeout=1.0)
        except (BrokenPipeError, EOFError, TimeoutError) as exc:
            self.shutdown()
            raise WorkerDiedError(f"the standby worker is gone: {exc!r}") from exc
        self._finish_start()
        return self

    def _finish_start(self) -> None:
        try:
            readies = self._handshake()
        except BaseException:
            self.shutdown()
            raise
        ready = readies[0]
        if any(r.num_blocks != ready.num_blocks for r in readies):
            self.shutdown()
            raise WorkerDiedError(
                f"ranks disagree on num_blocks: {[r.num_blocks for r in readies]}"
            )
        self.num_blocks = ready.num_blocks
        self.max_model_len = ready.max_model_len
        self.weight_bytes = ready.weight_bytes
        self.rank_weight_bytes = [r.weight_bytes for r in readies]
        self.load_time = time.perf_counter() - self._t0

    def _handshake(self) -> list[WorkerReady]:
        """Every rank's ``WorkerReady``; any rank's failure raises ``WorkerDiedError``
        with the tracebacks of all ranks that failed within ``ERROR_GRACE_S``."""
        if self.num_local_ranks == 1 and self.tp_size == 1:
            try:
                ready = self._receive(self.ring_out.get(timeout=STARTUP_TIMEOUT_S))
            except (EOFError, TimeoutError) as exc:
                raise WorkerDiedError(f"worker did not start: {exc!r}") from exc
            assert isinstance(ready, WorkerReady)
            return [ready]
        readies: dict[int, WorkerReady] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(readies) + len(errors) < self.num_local_ranks and time.monotonic() < deadline:
            for rank, ring in enumerate(self.rings_out):
                if rank in readies or rank in errors:
                    continue
                try:
                    msg = decode_from_worker(ring.get(timeout=0.05))
                except TimeoutError:
                    continue
                except EOFError:
                    errors[rank] = f"exited (code {self.processes[rank].exitcode})"
                    continue
                if isinstance(msg, WorkerError):
                    errors[rank] = msg.message
                elif isinstance(msg, WorkerReady):
                    readies[rank] = msg
                else:
                    errors[rank] = f"sent {type(msg).__name__} before its handshake"
            if errors:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if errors or len(readies) < self.num_local_ranks:
            detail = "\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items()))
            raise WorkerDiedError(
                f"tensor-parallel workers did not start:\n{detail or 'timed out'}"
            )
        return [readies[rank] for rank in range(self.num_local_ranks)]

    @property
    def pid(self) -> int | None:
        return self.processes[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    @property
    def sentinel(self) -> int:
        """An fd that becomes readable when a worker exits: rank 0's process
        sentinel with one rank, else an epoll fd over every rank's sentinel."""
        if self._epoll is None:
            return self.process.sentinel
        return self._epoll.fileno()

    @property
    def exited_process(self) -> multiprocessing.process.BaseProcess | None:
        """The first rank whose process has exited, if any."""
        return next((p for p in self.processes if p.exitcode is not None), None)

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    @staticmethod
    def _receive(data: bytes) -> ModelRunnerOutput | WorkerReady:
        msg = decode_from_worker(data)
        if isinstance(msg, WorkerError):
            raise WorkerDiedError(f"worker error:\n{msg.message}")
        return msg

    def _runner_output(self, data: bytes) -> ModelRunnerOutput:
        msg = self._receive(data)
        if not isinstance(msg, ModelRunnerOutput):
            raise WorkerDiedError(f"the worker answered a step with {type(msg).__name__}")
        return msg

    def _died(self) -> WorkerDiedError:
        process = self.exited_process or self.process
        return WorkerDiedError(f"worker process died (exit code {process.exitcode})")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank, blocking (``LLM``)."""
        try:
            data = encode(scheduler_output)
            for ring in self.rings_in:
                ring.put(data)
            return self._runner_output(self.ring_out.get())
        except (EOFError, BrokenPipeError) as exc:
            raise self._died() from exc

    async def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank without blocking the event loop."""
        try:
            data = encode(scheduler_output)
            for ring in self.rings_in:
                await ring.put_async(data)
            return self._runner_output(await self.ring_out.get_async())
        except (EOFError, BrokenPipeError) as exc:
            await asyncio.sleep(0)
            raise self._died() from exc

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Put a step on every rank's ring without waiting for its output: the
        worker reads it as soon as it has finished the steps before it."""
        try:
            data = encode(scheduler_output)
            for ring in self.rings_in:
                ring.put(data)
        except (EOFError, BrokenPipeError) as exc:
            raise self._died() from exc

    def get_output(self) -> ModelRunnerOutput:
        """The oldest submitted step's output, blocking."""
        try:
            return self._runner_output(self.ring_out.get())
        except (EOFError, BrokenPipeError) as exc:
            raise self._died() from exc

    async def submit_async(self, scheduler_output: SchedulerOutput) -> None:
        try:
            data = encode(scheduler_output)
            for ring in self.rings_in:
                await ring.put_async(data)
        except (EOFError, BrokenPipeError) as exc:
            await asyncio.sleep(0)
            raise self._died() from exc

    async def get_output_async(self) -> ModelRunnerOutput:
        try:
            return self._runner_output(await self.ring_out.get_async())
        except (EOFError, BrokenPipeError) as exc:
            await asyncio.sleep(0)
            raise self._died() from exc

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every rank (politely, then SIGKILL) and unlink every segment. Idempotent."""
        for process, ring in zip(self.processes, self.rings_in):
            if process.is_alive():
                try:
                    ring.try_put(encode(Shutdown()))
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout)
        if self._epoll is not None:
            self._epoll.close()
        for ring in self.rings_in + self.rings_out:
            ring.close()
            ring.unlink()
