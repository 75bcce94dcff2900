"""Round-trip latency: ShmRing against multiprocessing.Pipe, engine side on uvloop.

The engine side runs on a uvloop event loop and sends a ~200-byte step-like
message; a ``spawn``ed worker decodes it, re-encodes it and sends it back.

- ``shm_ring``: msgspec msgpack over two ShmRings; engine awaits ``get_async``.
- ``mp_pipe``: ``multiprocessing.Pipe`` with the same dict pickled by
  ``Connection.send``; engine awaits readability with ``loop.add_reader``,
  then ``recv()``.
- ``*_idle_1ms``: a 1 ms pause before each round trip (a fifth as many), so
  the worker has stopped spinning and must be woken from ``poll()``: closer
  to serving, where a model step separates messages.
- ``*_blocking``: the same pairs without an event loop, for reference.

Usage: python bench/ipc_ring.py [--round-trips 5000] [--warmup 500]
Prints a table; writes bench/results/ipc_ring.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioengine.ipc.shm_ring import RingHandle, ShmRing

IDLE_GAP_S = 0.001  # worker has stopped spinning and sleeps in poll()
RESULTS = Path(__file__).resolve().parent / "results" / "ipc_ring.json"


def make_message() -> dict:
    """A step-output-sized dict (about 200 bytes as msgpack)."""
    return {
        "step": 12345,
        "req_ids": [f"req-{i}" for i in range(8)],
        "sampled_token_ids": [[1000 + i] for i in range(8)],
        "num_computed_tokens": [512 + i for i in range(8)],
        "finished": [],
        "num_preempted": 0,
        "stop_reasons": [None] * 8,
    }


def ring_echo(h_in: RingHandle, h_out: RingHandle) -> None:
    ring_in, ring_out = ShmRing.attach(h_in), ShmRing.attach(h_out)
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    try:
        while True:
            ring_out.put(encode(decode(ring_in.get())))
    except EOFError:
        pass
    finally:
        ring_in.close()
        ring_out.close()


def pipe_echo(conn) -> None:
    try:
        while True:
            conn.send(conn.recv())
    except EOFError:
        pass


def summarize(name: str, samples_ns: list[int]) -> dict:
    samples_us = sorted(s / 1000 for s in samples_ns)
    n = len(samples_us)
    return {
        "name": name,
        "round_trips": n,
        "median_us": round(statistics.median(samples_us), 2),
        "p99_us": round(samples_us[min(n - 1, int(n * 0.99))], 2),
        "mean_us": round(statistics.fmean(samples_us), 2),
        "min_us": round(samples_us[0], 2),
    }


async def ring_async(
    ring_in: ShmRing, ring_out: ShmRing, msg: dict, n: int, gap_s: float = 0.0
) -> list[int]:
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = clock()
        await ring_in.put_async(encode(msg))
        decode(await ring_out.get_async())
        samples.append(clock() - t0)
    return samples


def ring_blocking(ring_in: ShmRing, ring_out: ShmRing, msg: dict, n: int) -> list[int]:
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = clock()
        ring_in.put(encode(msg))
        decode(ring_out.get())
        samples.append(clock() - t0)
    return samples


async def pipe_async(conn, msg: dict, n: int, gap_s: float = 0.0) -> list[int]:
    loop = asyncio.get_running_loop()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = clock()
        conn.send(msg)
        if not conn.poll():
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), readable.set_result, None)
            try:
                await readable
            finally:
                loop.remove_reader(conn.fileno())
        conn.recv()
        samples.append(clock() - t0)
    return samples


def pipe_blocking(conn, msg: dict, n: int) -> list[int]:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = clock()
        conn.send(msg)
        conn.recv()
        samples.append(clock() - t0)
    return samples


def bench_ring(ctx, msg: dict, n: int, warmup: int) -> list[dict]:
    ring_in = ShmRing.create(1 << 20, role="producer")
    ring_out = ShmRing.create(1 << 20, role="consumer")
    proc = ctx.Process(target=ring_echo, args=(ring_in.handle(), ring_out.handle()))
    proc.start()
    try:
        uvloop.run(ring_async(ring_in, ring_out, msg, warmup))
        results = [summarize("shm_ring", uvloop.run(ring_async(ring_in, ring_out, msg, n)))]
        idle = uvloop.run(ring_async(ring_in, ring_out, msg, n // 5, IDLE_GAP_S))
        results.append(summarize("shm_ring_idle_1ms", idle))
        ring_blocking(ring_in, ring_out, msg, warmup)
        results.append(summarize("shm_ring_blocking", ring_blocking(ring_in, ring_out, msg, n)))
    finally:
        ring_in.close()  # the worker sees EOF and exits
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        ring_out.close()
        ring_in.unlink()
        ring_out.unlink()
    return results


def bench_pipe(ctx, msg: dict, n: int, warmup: int) -> list[dict]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=pipe_echo, args=(child,))
    proc.start()
    child.close()
    try:
        uvloop.run(pipe_async(parent, msg, warmup))
        results = [summarize("mp_pipe", uvloop.run(pipe_async(parent, msg, n)))]
        idle = uvloop.run(pipe_async(parent, msg, n // 5, IDLE_GAP_S))
        results.append(summarize("mp_pipe_idle_1ms", idle))
        os.set_blocking(parent.fileno(), True)  # add_reader made it non-blocking
        pipe_blocking(parent, msg, warmup)
        results.append(summarize("mp_pipe_blocking", pipe_blocking(parent, msg, n)))
    finally:
        parent.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return results


def in_process_cost(msg: dict, n: int) -> dict:
    """Per-message cost of put + try_get in one process (includes the doorbell write)."""
    payload = msgspec.msgpack.encode(msg)
    with ShmRing.create(1 << 20, role="producer") as producer:
        consumer = ShmRing.attach(producer.handle())
        t0 = time.perf_counter_ns()
        for _ in range(n):
            producer.try_put(payload)
            consumer.try_get()
        elapsed = time.perf_counter_ns() - t0
        consumer.close()
    return {"name": "put+try_get (one process)", "per_message_us": round(elapsed / n / 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    msg = make_message()
    size = len(msgspec.msgpack.encode(msg))
    results = bench_ring(ctx, msg, args.round_trips, args.warmup)
    results += bench_pipe(ctx, msg, args.round_trips, args.warmup)
    local = in_process_cost(msg, args.round_trips)

    print(f"round trip, {size}-byte message, {args.round_trips} round trips, {os.cpu_count()} CPUs")
    print(f"{'transport':<20}{'median us':>11}{'p99 us':>10}{'mean us':>10}{'min us':>9}")
    for r in results:
        print(
            f"{r['name']:<20}{r['median_us']:>11.1f}{r['p99_us']:>10.1f}"
            f"{r['mean_us']:>10.1f}{r['min_us']:>9.1f}"
        )
    print(f"{local['name']}: {local['per_message_us']:.2f} us per message")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "ipc_ring",
        "message_bytes": size,
        "round_trips": args.round_trips,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "results": results,
        "in_process": local,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
