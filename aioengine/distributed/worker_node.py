"""A node other than node 0: it runs only tensor-parallel ranks, no engine, no API.

``aioengine serve --nnodes N --node-rank R`` (R > 0), or a torchrun process
with ``RANK`` > 0, runs ``run_worker_node``: it spawns this node's ranks
(``NodeLayout.local_ranks``), each of which waits at the master's rendezvous,
joins the group and runs the steps rank 0 broadcasts. When any of them exits
(the group broke: node 0 restarted it, or another rank died) the others are
stopped and all are started again, to wait for the next group: node 0 rebuilds
the group after every failure and this node rejoins it without being
restarted; a spare set of ranks (imports done, no model) makes the rejoin skip
the cold start. SIGTERM or SIGINT ends the node (its ranks die with it through
``PR_SET_PDEATHSIG``).

Waiting is on the ranks' process sentinels and a signal pipe
(``multiprocessing.connection.wait``), not by polling.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
from multiprocessing.connection import Connection

from aioengine.config import EngineConfig
from aioengine.executor._worker_entry import run_worker
from aioengine.executor.multiproc import _main_module_hidden, _worker_config, dist_inits

logger = logging.getLogger(__name__)
REJOIN_DELAY_S = 1.0  # between a broken group and the next try, so a failing start cannot spin


class _Ranks:
    """One set of this node's rank processes, each with a pipe: a spare rank
    waits on it for the signal to join; every rank says on it when it joined."""

    def __init__(self, config: EngineConfig, *, spare: bool, allow_kernel_build: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        children = []
        for init in dist_inits(config, first_start=True):
            ours, theirs = ctx.Pipe()
            self.conns.append(ours)
            children.append(theirs)
            self.processes.append(ctx.Process(
                target=run_worker, name=f"aioengine-worker-{init.rank}", daemon=True,
                args=(_worker_config(config), None, None, os.getpid(), init, spare,
                      allow_kernel_build, theirs)))
        with _main_module_hidden():
            for process in self.processes:
                process.start()
        for conn in children:
            conn.close()  # the child holds its own copy
        self.num_joined = 0

    def activate(self) -> bool:
        """Let spare ranks join; False if one of them is gone."""
        try:
            for conn in self.conns:
                conn.send(True)
        except OSError:
            return False
        return all(p.is_alive() for p in self.processes)

    def read_joined(self, ready: list) -> None:
        """Count the ranks that said they joined; stop watching a closed pipe."""
        for conn in [c for c in self.conns if c in ready]:
            try:
                conn.recv()
                self.num_joined += 1
            except (EOFError, OSError):
                self.conns.remove(conn)
                conn.close()

    def stop(self) -> None:
        for conn in self.conns:
            conn.close()
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()


def run_worker_node(config: EngineConfig) -> int:
    """Run this node's ranks until SIGTERM/SIGINT; returns the exit status (0).

    With ``parallel.standby_worker`` (the default) a spare set of ranks, imports
    done and no model loaded, waits beside the serving ones, so a rejoin skips
    the cold start (as node 0's standby worker does).

    Raises:
        ValueError: ``config`` is for node 0 or has no second node.
    """
    p = config.parallel
    if p.nnodes < 2 or p.node_rank == 0:
        raise ValueError("run_worker_node is for nodes 1 .. nnodes - 1")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)
        try:
            os.write(wake_w, b"x")
        except BlockingIOError:
            pass

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    ranks: _Ranks | None = None
    spare: _Ranks | None = None
    attempt = 0
    try:
        while not stopping:
            attempt += 1
            if spare is not None and spare.activate():
                ranks, spare = spare, None
            else:
                if spare is not None:
                    spare.stop()
                    spare = None
                ranks = _Ranks(config, spare=False, allow_kernel_build=attempt == 1)
            logger.info("node %d: ranks %s waiting for the group at %s:%d (attempt %d)",
                        p.node_rank, list(p.node_layout.local_ranks), p.master_addr,
                        p.master_port, attempt)
            sentinels = [q.sentinel for q in ranks.processes]
            while True:
                ready = multiprocessing.connection.wait([wake_r, *sentinels, *ranks.conns])
                if stopping or any(fd in ready for fd in sentinels):
                    break
                ranks.read_joined(ready)
                if (p.standby_worker and spare is None
                        and ranks.num_joined == len(ranks.processes)):
                    # After the join, as node 0 starts its standby after its first worker:
                    # the spare's imports must not slow the ranks' own start.
                    spare = _Ranks(config, spare=True, allow_kernel_build=False)
            exited = [q for q in ranks.processes if q.sentinel in ready]
            ranks.stop()
            if exited and not stopping:
                q = exited[0]
                if q.exitcode == 0:  # node 0 shut its group down
                    logger.info("node %d: the group closed; waiting for the next one",
                                p.node_rank)
                else:
                    logger.warning("node %d: %s exited (code %s); rejoining the next group",
                                   p.node_rank, q.name, q.exitcode)
                multiprocessing.connection.wait([wake_r], timeout=REJOIN_DELAY_S)
    finally:
        for group in (ranks, spare):
            if group is not None:
                group.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_r)
        os.close(wake_w)
    logger.info("node %d: stopped", p.node_rank)
    return 0
