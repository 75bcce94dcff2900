"""Each step from rank 0 to the ranks on other nodes: a broadcast of its bytes.

The engine's host feeds its own ranks through shared-memory rings; a rank on
another host has no ring, so rank 0 forwards every message it reads from its
ring (the ``ipc.messages`` encoding, unchanged: a ``SchedulerOutput``, or
``Shutdown``) with a broadcast on the step group (``parallel_state.step_group``:
rank 0 and the remote ranks), as vLLM and SGLang broadcast their step metadata
on a CPU (gloo) group beside the device group.

Wire format: one broadcast of a fixed ``INLINE_BYTES`` buffer, ``[length
(int64, little-endian)][first bytes of the message]``; a message longer than
the buffer holds sends its rest in a second broadcast. A decode step for 32
requests is a few hundred bytes, so a step costs one collective.

Heartbeat: length -1, then an all-reduce of one number over the step group, so
both sides wait on each other: while the engine is idle a silent dead host is
noticed within the collective timeout (``DistInit.collective_timeout_s``), on
either side.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

INLINE_BYTES = 4 << 10
_HEADER = struct.Struct("<q")
_HEARTBEAT = -1


class StepChannel:
    """One end of the step broadcast (rank 0 sends, the remote ranks receive).

    Args:
        group: the step group; rank 0 (global) is the source.

    Every method raises what the collective raises (``RuntimeError`` /
    ``torch.distributed.DistError``) when a peer died or timed out: the group is
    then broken and the process should exit.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._buffer = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        self._view = self._buffer.numpy().data  # a writable memoryview of the tensor
        self._one = torch.ones(1, dtype=torch.int64)

    def send(self, data: bytes) -> None:
        """Broadcast one encoded message (rank 0)."""
        head = INLINE_BYTES - _HEADER.size
        _HEADER.pack_into(self._view, 0, len(data))
        self._view[_HEADER.size:_HEADER.size + min(len(data), head)] = data[:head]
        dist.broadcast(self._buffer, src=0, group=self.group)
        if len(data) > head:
            dist.broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8), src=0,
                           group=self.group)

    def heartbeat(self) -> None:
        """Tell the remote ranks the group lives, and hear back from them (rank 0)."""
        _HEADER.pack_into(self._view, 0, _HEARTBEAT)
        dist.broadcast(self._buffer, src=0, group=self.group)
        dist.all_reduce(self._one.fill_(1), group=self.group)

    def recv(self) -> bytes | None:
        """The next message from rank 0, or None for a heartbeat (remote ranks)."""
        dist.broadcast(self._buffer, src=0, group=self.group)
        (length,) = _HEADER.unpack_from(self._view, 0)
        if length == _HEARTBEAT:
            dist.all_reduce(self._one.fill_(1), group=self.group)
            return None
        head = INLINE_BYTES - _HEADER.size
        data = bytes(self._view[_HEADER.size:_HEADER.size + min(length, head)])
        if length > head:
            rest = torch.empty(length - head, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        return data
