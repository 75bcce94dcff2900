"""A node other than node 0: it runs only tensor-parallel ranks, no engine, no API.

``aioengine serve --nnodes N --node-rank R`` (R > 0), or a torchrun process
with ``RANK`` > 0, runs ``run_worker_node``: it spawns this node's ranks
(``NodeLayout.local_ranks``), each of which waits at the master's rendezvous,
joins the group and runs the steps rank 0 broadcasts. When any of them exits
(the group broke: node 0 restarted it, or another rank died) the others are
stopped and all are started again, to wait for the next group: node 0 rebuilds
the group after every failure and this node rejoins it without being
restarted. SIGTERM or SIGINT ends the node (its ranks die with it through
``PR_SET_PDEATHSIG``).

Waiting is on the ranks' process sentinels and a signal pipe
(``multiprocessing.connection.wait``), not by polling.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal

from aioengine.config import EngineConfig
from aioengine.executor._worker_entry import run_worker
from aioengine.executor.multiproc import _main_module_hidden, _worker_config, dist_inits

logger = logging.getLogger(__name__)
REJOIN_DELAY_S = 1.0  # between a broken group and the next try, so a failing start cannot spin


def run_worker_node(config: EngineConfig) -> int:
    """Run this node's ranks until SIGTERM/SIGINT; returns the exit status (0).

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
    ctx = multiprocessing.get_context("spawn")
    worker_config = _worker_config(config)
    first = True
    generation = 0
    try:
        while not stopping:
            generation += 1
            inits = dist_inits(config, first_start=True)
            processes = [
                ctx.Process(target=run_worker, name=f"aioengine-worker-{init.rank}", daemon=True,
                            args=(worker_config, None, None, os.getpid(), init, False, first))
                for init in inits
            ]
            with _main_module_hidden():
                for process in processes:
                    process.start()
            first = False
            logger.info("node %d: ranks %s waiting for the group at %s (attempt %d)",
                        p.node_rank, [i.rank for i in inits], inits[0].init_method, generation)
            ready = multiprocessing.connection.wait([wake_r] + [q.sentinel for q in processes])
            exited = [q for q in processes if q.sentinel in ready]
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join()
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
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_r)
        os.close(wake_w)
    logger.info("node %d: stopped", p.node_rank)
    return 0
