"""Where the tensor-parallel ranks run: one host, or several nodes.

Torch-free (the engine process imports it). ``NodeLayout`` says which ranks
each node starts; ``DistInit`` is what one worker process is told to join the
group with; ``layout_from_torchrun_env`` reads the variables torchrun sets.

Across nodes the ranks are split evenly and in order: with ``nnodes`` nodes and
``tensor_parallel_size`` N, node ``r`` runs ranks ``[r * N / nnodes, (r + 1) *
N / nnodes)``. Node 0 runs the API server, the engine and ranks ``0 ..
N / nnodes - 1`` (fed through shared-memory rings); the ranks of the other
nodes are fed by rank 0's broadcast of each step (``step_channel``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

# torchrun's agent keeps its own store on MASTER_PORT; the engine's group meets one port up.
TORCHRUN_PORT_OFFSET = 1


@dataclass(frozen=True)
class NodeLayout:
    """The nodes of one tensor-parallel group.

    Attributes:
        nnodes: nodes (hosts, or torchrun processes) the ranks are spread over.
        node_rank: this node, 0 .. nnodes - 1; node 0 serves the API.
        tp_size: tensor-parallel ranks in all.
    """

    nnodes: int
    node_rank: int
    tp_size: int

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def ranks_of_node(self, node_rank: int) -> range:
        k = self.ranks_per_node
        return range(node_rank * k, (node_rank + 1) * k)

    @property
    def local_ranks(self) -> range:
        return self.ranks_of_node(self.node_rank)

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """Ranks not on node 0: they receive each step by broadcast."""
        return tuple(range(self.ranks_per_node, self.tp_size))


@dataclass(frozen=True)
class DistInit:
    """How one worker process joins the tensor-parallel group.

    Attributes:
        rank: its tensor-parallel rank; rank 0 answers the engine.
        world_size: the tensor-parallel size.
        init_method: ``"tcp://HOST:PORT"``; with several nodes, the master's
            address, where rank 0 hosts the rendezvous store.
        num_threads: torch intra-op threads of the rank.
        remote_ranks: ranks on other nodes than the engine's (empty on one host).
        node_addr: the address this rank's gloo sockets bind and other nodes
            reach it at; "" keeps torch's rule (``GLOO_SOCKET_IFNAME``, else
            the hostname).
        rendezvous_timeout_s: how long joining (and loading the model until the
            first collective) may wait for the other ranks, seconds.
        collective_timeout_s: how long one collective may wait for a peer once
            the group serves, seconds: how soon a silent dead host is noticed.
    """

    rank: int
    world_size: int
    init_method: str
    num_threads: int
    remote_ranks: tuple[int, ...] = ()
    node_addr: str = ""
    rendezvous_timeout_s: float = 600.0
    collective_timeout_s: float = 600.0

    @property
    def multi_node(self) -> bool:
        return bool(self.remote_ranks)


def check_node_layout(nnodes: int, node_rank: int, tp_size: int, dp_size: int) -> None:
    """Refuse a node count the ranks cannot be spread over.

    Raises:
        ValueError: naming the numbers.
    """
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} is not in [0, {nnodes})")
    if nnodes > 1 and tp_size % nnodes:
        raise ValueError(f"tensor_parallel_size {tp_size} cannot be spread evenly over "
                         f"{nnodes} nodes (it must be a multiple of nnodes)")
    if nnodes > 1 and dp_size > 1:
        raise ValueError("data_parallel_size > 1 with nnodes > 1 is not supported: run one "
                         "multi-node group per replica (docs/distributed.md)")


def route_addr(master_addr: str, master_port: int) -> str:
    """This host's address on the route to ``master_addr``: what the other
    nodes can reach it at (a UDP ``connect`` sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, master_port))
        except OSError:
            return ""
        return s.getsockname()[0]


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (``torch.distributed.run``) tells each process it starts."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def torchrun_env(environ: os._Environ[str] | dict[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun variables, or None outside torchrun (``RANK`` and
    ``WORLD_SIZE`` unset, or a world of one).

    Raises:
        ValueError: a variable is missing or not a number.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        if world <= 1:
            return None
        return TorchrunEnv(rank=int(env["RANK"]), world_size=world,
                           local_rank=int(env.get("LOCAL_RANK", "0")),
                           local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                           master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))
    except KeyError as exc:
        raise ValueError(f"torchrun environment: {exc.args[0]} is not set") from None
    except ValueError as exc:
        raise ValueError(f"torchrun environment: {exc}") from None
