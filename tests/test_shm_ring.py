"""Tests for aioengine.ipc.shm_ring: the SPSC shared-memory ring and its doorbells."""

from __future__ import annotations

import asyncio
import glob
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from aioengine.ipc.shm_ring import RingHandle, ShmRing

REPO_ROOT = Path(__file__).resolve().parents[1]
SLEEP = b"\x01sleep"  # echo worker: wait 0.3 s, then echo


def _segments() -> list[str]:
    return glob.glob(f"/dev/shm/aioengine_{os.getpid()}_*")


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = set(_segments())
    yield
    assert set(_segments()) <= before, "a test left a shared memory segment in /dev/shm"


def _pair(capacity: int) -> tuple[ShmRing, ShmRing]:
    producer = ShmRing.create(capacity, role="producer")
    return producer, ShmRing.attach(producer.handle())


def _dispose(owner: ShmRing, *others: ShmRing) -> None:
    for ring in others:
        ring.close()
    owner.close()
    owner.unlink()


def _echo_worker(h_in: RingHandle, h_out: RingHandle) -> None:
    """Spawned worker: echo every message until the engine closes ring_in."""
    ring_in, ring_out = ShmRing.attach(h_in), ShmRing.attach(h_out)
    try:
        while True:
            message = ring_in.get()
            if message == SLEEP:
                time.sleep(0.3)
            ring_out.put(message)
    except EOFError:
        pass
    finally:
        ring_in.close()
        ring_out.close()


def _start_echo(capacity: int) -> tuple[mp.process.BaseProcess, ShmRing, ShmRing]:
    ring_in = ShmRing.create(capacity, role="producer")
    ring_out = ShmRing.create(capacity, role="consumer")
    ctx = mp.get_context("spawn")
    # The handles go straight into the Process args and nowhere else, so the
    # engine's copies of the worker's fds close after start(): EOF works both ways.
    proc = ctx.Process(target=_echo_worker, args=(ring_in.handle(), ring_out.handle()))
    proc.start()
    return proc, ring_in, ring_out


# ---------------------------------------------------------------- one process


def test_round_trip_in_one_process():
    producer, consumer = _pair(1024)
    assert consumer.try_get() is None
    producer.put(b"hello")
    producer.put(b"")
    producer.put(b"head:", memoryview(b"body"), bytearray(b"!"))
    tokens = np.arange(5, dtype=np.int32)
    producer.put(tokens)
    assert consumer.get(timeout=1) == b"hello"
    assert consumer.get(timeout=1) == b""
    assert consumer.try_get() == b"head:body!"
    assert np.array_equal(np.frombuffer(consumer.try_get(), dtype=np.int32), tokens)
    assert consumer.try_get() is None
    _dispose(producer, consumer)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(8, 64).map(lambda words: words * 8),
    ops=st.lists(st.one_of(st.integers(0, 600), st.none()), max_size=200),
)
def test_wrap_around_preserves_order_and_content(capacity, ops):
    """Random sizes and interleavings against a deque model; many wraps."""
    producer, consumer = _pair(capacity)
    rng = random.Random(len(ops))
    model: deque[bytes] = deque()
    used = 0

    def record(n: int) -> int:
        return 8 + (n + 7) // 8 * 8

    for op in ops:
        if op is None:
            got = consumer.try_get()
            assert got == (model.popleft() if model else None)
            if got is not None:
                used -= record(len(got))
            continue
        size = op % (capacity - 7)  # 0 .. capacity - 8: always fits an empty ring
        message = rng.randbytes(size)
        if size % 3 == 0:
            ok = producer.try_put(message[: size // 2], memoryview(message)[size // 2 :])
        else:
            ok = producer.try_put(message)
        assert ok == (used + record(size) <= capacity)
        if ok:
            model.append(message)
            used += record(size)
    while model:
        assert consumer.try_get() == model.popleft()
    assert consumer.try_get() is None
    _dispose(producer, consumer)


def test_message_larger_than_capacity_raises_value_error():
    producer, consumer = _pair(64)
    with pytest.raises(ValueError, match="does not fit"):
        producer.put(b"x" * 65)
    with pytest.raises(ValueError, match="largest message: 56 bytes"):
        producer.try_put(b"x" * 40, b"y" * 17)
    producer.put(b"z" * 56)  # capacity minus the 8-byte length fits
    assert consumer.get(timeout=1) == b"z" * 56
    _dispose(producer, consumer)


def test_bad_capacity_and_role_raise_value_error():
    with pytest.raises(ValueError, match="multiple of 8"):
        ShmRing.create(100, role="producer")
    with pytest.raises(ValueError, match="at least 64"):
        ShmRing.create(8, role="producer")
    with pytest.raises(ValueError, match="role"):
        ShmRing.create(64, role="both")


def test_wrong_end_and_second_handle_raise():
    producer, consumer = _pair(64)
    with pytest.raises(RuntimeError, match="consumer's end"):
        consumer.put(b"x")
    with pytest.raises(RuntimeError, match="producer's end"):
        producer.try_get()
    with pytest.raises(RuntimeError, match="already taken"):
        producer.handle()
    with pytest.raises(RuntimeError, match="owner"):
        consumer.unlink()
    _dispose(producer, consumer)


def test_full_ring_producer_waits_until_consumer_drains():
    producer, consumer = _pair(128)  # a 40-byte message takes 48: two fit
    messages = [bytes([i]) * 40 for i in range(10)]
    num_put = 0

    def produce():
        nonlocal num_put
        for message in messages:
            producer.put(message)
            num_put += 1

    thread = threading.Thread(target=produce)
    thread.start()
    time.sleep(0.2)
    assert num_put == 2 and thread.is_alive()
    received = [consumer.get(timeout=2) for _ in messages]
    thread.join(2)
    assert not thread.is_alive()
    assert received == messages
    _dispose(producer, consumer)


def test_blocking_calls_time_out():
    producer, consumer = _pair(64)
    with pytest.raises(TimeoutError):
        consumer.get(timeout=0.02)
    producer.put(b"x" * 56)
    with pytest.raises(TimeoutError):
        producer.put(b"y", timeout=0.02)
    _dispose(producer, consumer)


def test_put_async_awaits_room_without_blocking_the_loop():
    producer, consumer = _pair(64)

    async def main():
        producer.try_put(b"a" * 56)
        put = asyncio.ensure_future(producer.put_async(b"b" * 56))
        await asyncio.sleep(0.05)
        assert not put.done()
        assert await consumer.get_async() == b"a" * 56
        await asyncio.wait_for(put, 1)
        assert await consumer.get_async() == b"b" * 56

    uvloop.run(main())
    _dispose(producer, consumer)


def test_close_is_idempotent_and_peer_close_is_eof():
    producer, consumer = _pair(64)
    producer.put(b"last")
    producer.close()
    producer.close()
    assert consumer.get(timeout=1) == b"last"  # data before EOF is delivered
    with pytest.raises(EOFError):
        consumer.get(timeout=1)
    consumer.close()
    consumer.close()
    producer.unlink()
    producer.unlink()


def test_close_wakes_a_pending_get_async_with_eof():
    producer, consumer = _pair(64)

    async def main():
        get = asyncio.ensure_future(consumer.get_async())
        await asyncio.sleep(0.01)
        consumer.close()
        with pytest.raises(EOFError):
            await asyncio.wait_for(get, 1)

    uvloop.run(main())
    _dispose(producer)


def test_handle_pickles_outside_spawn():
    """A handle sent over an existing connection (resource_sharer path) attaches."""
    producer = ShmRing.create(64, role="producer")
    handle = pickle.loads(pickle.dumps(producer.handle()))
    consumer = ShmRing.attach(handle)
    producer.put(b"via pickle")
    assert consumer.get(timeout=1) == b"via pickle"
    with pytest.raises(ValueError, match="already attached"):
        ShmRing.attach(handle)
    _dispose(producer, consumer)


def test_attach_does_not_register_with_resource_tracker(monkeypatch):
    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: calls.append(name))
    producer = ShmRing.create(64, role="producer")
    assert calls == ["/" + producer.name]  # the owner is tracked: crash safety net
    patched = resource_tracker.register
    consumer = ShmRing.attach(producer.handle())
    assert calls == ["/" + producer.name]
    assert resource_tracker.register is patched
    _dispose(producer, consumer)


def test_forgotten_owner_unlinks_when_collected():
    producer = ShmRing.create(64, role="producer")
    path = f"/dev/shm/{producer.name}"
    assert os.path.exists(path)
    del producer
    assert not os.path.exists(path)


# ----------------------------------------------------------- spawned worker


@pytest.mark.e2e  # a spawned process
def test_spawned_echo_on_uvloop_with_responsive_loop():
    proc, ring_in, ring_out = _start_echo(1 << 16)
    rng = random.Random(0)
    sizes = [rng.choice([0, 1, 7, 200, 3000, 20000, (1 << 16) - 8]) for _ in range(1000)]
    messages = [rng.randbytes(n) for n in sizes]

    async def ticker(ticks: list[float]) -> None:
        while True:
            await asyncio.sleep(0.001)
            ticks.append(time.monotonic())

    async def exchange():
        for message in messages:
            await ring_in.put_async(message)
            assert await ring_out.get_async() == message

    async def main():
        ticks: list[float] = []
        tick_task = asyncio.ensure_future(ticker(ticks))
        await asyncio.wait_for(exchange(), 30)  # a lost doorbell fails instead of hanging
        # The worker holds this one for 0.3 s: the loop must keep ticking and
        # must not burn CPU while it awaits the doorbell.
        num_ticks, cpu0, t0 = len(ticks), time.process_time(), time.monotonic()
        await ring_in.put_async(SLEEP)
        assert await asyncio.wait_for(ring_out.get_async(), 10) == SLEEP
        waited, cpu = time.monotonic() - t0, time.process_time() - cpu0
        tick_task.cancel()
        assert waited >= 0.29
        assert len(ticks) - num_ticks >= 50
        assert cpu < 0.5 * waited, f"engine used {cpu:.3f} s CPU in a {waited:.3f} s await"

    try:
        uvloop.run(main())
    finally:
        ring_in.close()  # EOF for the worker's get(): it exits on its own
        proc.join(5)
        exitcode = proc.exitcode
        if exitcode is None:
            proc.kill()
            proc.join()
        ring_out.close()
        ring_in.unlink()
        ring_out.unlink()
    assert exitcode == 0


@pytest.mark.e2e  # a spawned process
def test_sigkilled_worker_get_async_cancels_and_sees_eof():
    proc, ring_in, ring_out = _start_echo(1 << 12)

    async def main():
        await ring_in.put_async(b"ping")
        assert await asyncio.wait_for(ring_out.get_async(), 10) == b"ping"
        # Cancelling a pending get_async removes its reader and consumes nothing.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ring_out.get_async(), 0.05)
        assert ring_out._waiting is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        # The worker's doorbell fds died with it: EOF instead of a hang.
        with pytest.raises(EOFError):
            await asyncio.wait_for(ring_out.get_async(), 2)
        with pytest.raises(BrokenPipeError):
            await ring_in.put_async(b"anyone?")

    try:
        uvloop.run(main())
    finally:
        if proc.is_alive():
            proc.kill()
        for ring in (ring_in, ring_out):
            ring.close()
            ring.unlink()
    assert proc.exitcode == -signal.SIGKILL


CHILD_EXIT_SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from aioengine.ipc.shm_ring import ShmRing
    from test_shm_ring import _echo_worker

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        for kill in (False, True):
            ring_in = ShmRing.create(4096, role="producer")
            ring_out = ShmRing.create(4096, role="consumer")
            proc = ctx.Process(target=_echo_worker, args=(ring_in.handle(), ring_out.handle()))
            proc.start()
            ring_in.put(b"ping")
            assert ring_out.get(timeout=10) == b"ping"
            if kill:
                os.kill(proc.pid, signal.SIGKILL)
            ring_in.close()
            proc.join(10)
            ring_out.close()
            ring_in.unlink()
            ring_out.unlink()
        print("done", os.getpid())
    """
)


@pytest.mark.e2e  # a spawned process
def test_no_resource_tracker_warnings_at_exit():
    """The whole engine process (and its tracker and workers) exits with a clean stderr."""
    script = CHILD_EXIT_SCRIPT.format(root=str(REPO_ROOT), tests=str(REPO_ROOT / "tests"))
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("done")
    assert result.stderr == "", result.stderr
    pid = result.stdout.split()[1]
    assert glob.glob(f"/dev/shm/aioengine_{pid}_*") == []
