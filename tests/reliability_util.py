"""Helpers for the reliability tests (``test_reliability_*.py``): a server of
their own (they kill it, so they cannot share the session one), its worker
process, its shared-memory segments, its resident memory, and small clients
for SSE and the WebSocket that record how each request ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets
from conftest import ServerInfo, start_server

__all__ = ["Outcome", "ServerInfo", "metric", "own_server", "pid_alive", "rss_kib",
           "shm_segments", "sse_request", "standby_pid", "start_server", "wait_until",
           "worker_pid", "worker_processes", "ws_request"]


@contextmanager
def own_server(tmp_dir: Path, *args: str) -> Iterator[ServerInfo]:
    """A server for one module or test. A test may kill it; otherwise it is
    stopped with SIGTERM here, must exit 0 and must have logged no traceback."""
    info = start_server(tmp_dir, *args)
    try:
        yield info
    finally:
        if info.process.poll() is None:
            info.process.send_signal(signal.SIGTERM)
            try:
                info.process.wait(timeout=60)
            except Exception:
                info.process.kill()
                info.process.wait()
                raise
            assert info.process.returncode == 0, info.log_tail()
            assert "Traceback" not in info.log_path.read_text(errors="replace"), \
                info.log_tail(200)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def worker_pid(server_pid: int) -> int | None:
    """The serving model worker (rank 0) among the server's children: not the
    resource tracker, not the standby worker (``worker.process_title``)."""
    for kid in _children(server_pid):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ")
            comm = Path(f"/proc/{kid}/comm").read_text().strip()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline \
                and comm == "aioengine-wrk0":
            return kid
    return None


def worker_processes(server_pid: int) -> list[int]:
    """Every model worker of the server, serving or standby (two rings each)."""
    kids = []
    for kid in _children(server_pid):
        try:
            # By command line: a standby still starting has no name of its own yet.
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline and pid_alive(kid):
            kids.append(kid)
    return kids


def standby_pid(server_pid: int) -> int | None:
    """The server's standby worker (rank 0), if it has one."""
    for kid in _children(server_pid):
        try:
            if Path(f"/proc/{kid}/comm").read_text().strip() == "aioengine-sby0":
                return kid
        except OSError:
            continue
    return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def spawned_workers() -> set[int]:
    """Live spawned children of this process (workers), the resource tracker aside."""
    kids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            kids |= {int(k) for k in (task / "children").read_text().split()}
        except OSError:
            pass
    workers = set()
    for kid in kids:
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline and pid_alive(kid):
            workers.add(kid)
    return workers


def shm_segments(server_pid: int) -> set[str]:
    """Names of the server's rings in /dev/shm (``aioengine_{pid}_{random}``)."""
    prefix = f"aioengine_{server_pid}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def rss_kib(pid: int) -> int:
    """``VmRSS`` of a process in KiB."""
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert match, f"no VmRSS for {pid}"
    return int(match.group(1))


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def metric(text: str, name: str) -> float:
    """The value of one unlabelled-or-model-labelled sample in a /metrics scrape."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


# -- clients that record how a request ended ---------------------------------------------


@dataclass
class Outcome:
    """How one client request ended.

    ``kind``: ``"done"`` (finished normally), ``"error"`` (an SSE error event
    or a WebSocket error message; ``status`` holds its code), ``"http"`` (a
    non-200 answer; ``status``), ``"dropped"`` (the client left on purpose).
    """

    kind: str
    status: int = 200
    message: str = ""
    finish_reason: str | None = None
    num_deltas: int = 0
    ended_at: float = 0.0
    retry_after: str | None = None
    events: list = field(default_factory=list)


async def sse_request(client: httpx.AsyncClient, body: dict, *,
                      started: asyncio.Event | None = None, drop_after: int | None = None,
                      path: str = "/v1/chat/completions") -> Outcome:
    """POST a streaming request; ``started`` is set at the first token;
    ``drop_after`` tokens (0: before any) closes the connection on purpose."""
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome("http", response.status_code, response.text,
                           ended_at=time.monotonic(),
                           retry_after=response.headers.get("retry-after"))
        if drop_after == 0:
            return Outcome("dropped", ended_at=time.monotonic())
        outcome = Outcome("open")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.ended_at = time.monotonic()
                if outcome.kind == "open":
                    outcome.kind = "incomplete"
                return outcome
            event = json.loads(line[6:])
            if "error" in event:
                outcome.kind = "error"
                outcome.status = 503 if event["error"].get("code") == "engine_unavailable" else 500
                outcome.message = event["error"]["message"]
                continue
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content", choice.get("text"))
                if text or choice.get("finish_reason"):
                    outcome.num_deltas += 1
                    if started is not None:
                        started.set()
                if choice.get("finish_reason"):
                    outcome.kind, outcome.finish_reason = "done", choice["finish_reason"]
            if drop_after is not None and outcome.num_deltas >= drop_after:
                return Outcome("dropped", ended_at=time.monotonic())
    outcome.ended_at = time.monotonic()
    return outcome if outcome.kind != "open" else Outcome("incomplete", message="no [DONE]")


async def ws_request(url: str, message: dict, *, started: asyncio.Event | None = None,
                     drop_after: int | None = None, abort: bool = False) -> Outcome:
    """One request on its own WebSocket; ``drop_after`` tokens closes the
    socket on purpose (``abort``: without a close handshake)."""
    async with websockets.connect(url, max_size=None, open_timeout=60) as ws:
        hello = json.loads(await ws.recv())
        assert hello["type"] == "hello", hello
        if drop_after == 0:
            await ws.send(json.dumps(message))
            if abort:
                ws.transport.abort()
            return Outcome("dropped", ended_at=time.monotonic())
        await ws.send(json.dumps(message))
        outcome = Outcome("open")
        async for raw in ws:
            msg = json.loads(raw)
            if msg.get("id") != message["id"]:
                continue
            if msg["type"] == "delta":
                outcome.num_deltas += 1
                if started is not None:
                    started.set()
                if drop_after is not None and outcome.num_deltas >= drop_after:
                    if abort:
                        ws.transport.abort()
                    return Outcome("dropped", ended_at=time.monotonic())
            elif msg["type"] == "done":
                outcome.kind, outcome.finish_reason = "done", msg["finish_reason"]
                outcome.ended_at = time.monotonic()
                return outcome
            elif msg["type"] == "error":
                outcome.kind, outcome.status, outcome.message = "error", msg["code"], \
                    msg["message"]
                outcome.ended_at = time.monotonic()
                return outcome
    return Outcome("incomplete", message="socket closed", ended_at=time.monotonic())
