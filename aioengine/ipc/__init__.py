"""Engine <-> worker IPC: shared-memory rings (``shm_ring``) and typed step messages."""

from aioengine.ipc.shm_ring import RingHandle, ShmRing

__all__ = ["RingHandle", "ShmRing"]
