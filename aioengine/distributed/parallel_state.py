"""The tensor-parallel process group of one worker and its collectives.

Each worker process of a ``tensor_parallel_size`` > 1 engine calls
``init_tensor_parallel`` once; the model and the runner then ask
``get_tp_rank()`` / ``get_tp_size()`` and call ``all_reduce``,
``gather_to_first`` and ``broadcast_from_first``. With one worker no group
exists, the rank is 0, the size 1, and nothing here is called.

The collectives are torch.distributed's. The model runs on CPU (the loader
never moves a tensor to a GPU), so the default backend is gloo even where
CUDA is available: NCCL only takes CUDA tensors and would fail the first
collective; pass ``backend="nccl"`` once the model runs on CUDA.

Across nodes (``init_multi_node``) the group is the same gloo group, but its
sockets bind the node's own address (``DistInit.node_addr``), rank 0 hosts the
rendezvous store at the master address, collectives time out after
``DistInit.collective_timeout_s`` once the group serves, and a second group of
rank 0 and the ranks on other nodes carries the steps (``step_channel``).
"""

from __future__ import annotations

import datetime
import socket
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from aioengine.distributed.layout import DistInit

_TP_RANK = 0
_TP_SIZE = 1
_STEP_GROUP: dist.ProcessGroup | None = None
# Gloo bound to one address: torch's own "gloo" picks its address from
# GLOO_SOCKET_IFNAME or the hostname only, and two nodes on one interface (or a
# host with several) need to name theirs.
BOUND_GLOO = "aioengine-gloo"
_bind_addr = ""
_gloo_backends: list[dist.ProcessGroupGloo] = []


def get_open_port() -> int:
    """A free TCP port on the loopback interface, for ``init_method``.

    The port is free when returned; another process could take it before the
    ranks bind it (the usual race of this recipe, also vLLM's).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the process group of ``world_size`` ranks as ``rank``.

    Args:
        rank: 0 .. world_size - 1; rank 0 answers the engine.
        world_size: the tensor-parallel size.
        init_method: rendezvous address, e.g. ``"tcp://127.0.0.1:29500"``
            (``"env://"`` reads MASTER_ADDR / MASTER_PORT as torchrun sets them).
        backend: ``"gloo"`` or ``"nccl"``; None picks gloo, the backend of
            the CPU tensors the model computes on (whether or not CUDA is
            available).
        timeout_s: how long a collective (and the rendezvous) may wait for a
            peer, seconds. A peer that dies closes its sockets, so the others
            fail at once rather than after the timeout.

    Raises:
        RuntimeError: the rendezvous failed or timed out.
    """
    global _TP_RANK, _TP_SIZE
    if backend is None:
        backend = "gloo"  # the model's tensors are on CPU; NCCL takes CUDA tensors only
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _TP_RANK, _TP_SIZE = rank, world_size


def _make_bound_gloo(store: dist.Store, rank: int, size: int,
                     timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """``Backend.register_backend`` creator: a gloo group on ``_bind_addr``."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_bind_addr) if _bind_addr
                        else dist.ProcessGroupGloo.create_default_device()]
    group = dist.ProcessGroupGloo(store, rank, size, options)
    _gloo_backends.append(group)
    return group


def init_multi_node(init: DistInit) -> None:
    """Join a group whose ranks run on several nodes (``DistInit.multi_node``).

    Rank 0 hosts the rendezvous store at ``init.init_method``'s address (the
    master) and waits up to ``init.rendezvous_timeout_s`` for the other ranks;
    they retry connecting for as long. Every rank's gloo sockets bind
    ``init.node_addr``. Afterwards ``step_group()`` holds rank 0 and
    ``init.remote_ranks``. Call ``set_collective_timeout`` once the model is
    loaded (the loading ranks wait for one another with the long timeout).

    Raises:
        RuntimeError / DistStoreError: the rendezvous failed or timed out.
    """
    global _TP_RANK, _TP_SIZE, _STEP_GROUP, _bind_addr
    url = urlsplit(init.init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://HOST:PORT, got {init.init_method!r}")
    timeout = datetime.timedelta(seconds=init.rendezvous_timeout_s)
    store = dist.TCPStore(url.hostname, url.port, init.world_size, is_master=init.rank == 0,
                          timeout=timeout, wait_for_workers=True)
    _bind_addr = init.node_addr
    if BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_GLOO, _make_bound_gloo, devices=["cpu"])
    dist.init_process_group(BOUND_GLOO, store=store, rank=init.rank,
                            world_size=init.world_size, timeout=timeout)
    _TP_RANK, _TP_SIZE = init.rank, init.world_size
    # Always gloo, whatever the model's group uses: the step is CPU bytes.
    _STEP_GROUP = dist.new_group([0, *init.remote_ranks], backend=BOUND_GLOO)


def set_collective_timeout(seconds: float) -> None:
    """How long each later collective of this process's groups may wait for a peer."""
    for group in _gloo_backends:
        group._set_default_timeout(datetime.timedelta(seconds=seconds))


def step_group() -> dist.ProcessGroup | None:
    """Rank 0 and the ranks on other nodes (None on one host, or outside it)."""
    return _STEP_GROUP


def destroy_tensor_parallel() -> None:
    """Leave the process group (if any). Idempotent."""
    global _TP_RANK, _TP_SIZE, _STEP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _STEP_GROUP = 0, 1, None
    _gloo_backends.clear()


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x`` (any shape)."""
    dist.all_reduce(x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` any rank passed (e.g. ``num_blocks``)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_gather_object(value: object) -> list[object]:
    """Every rank's ``value``, in rank order (startup only: pickles)."""
    out: list[object] = [None] * _TP_SIZE
    dist.all_gather_object(out, value)
    return out


def gather_to_first(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on rank 0.

    ``x`` must have the same shape on every rank. Returns the concatenation
    on rank 0 (``x.shape`` with ``dim`` multiplied by the tp size) and None
    elsewhere.
    """
    x = x.contiguous()
    if _TP_RANK == 0:
        parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=dim)
    dist.gather(x, None, dst=0)
    return None


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (in place on the others; same shape and dtype)."""
    dist.broadcast(x, src=0)
    return x
