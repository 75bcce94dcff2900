"""Shared fixtures: one real ``aioengine serve`` subprocess for the server tests;
and the two test tiers.

Tiers: the modules in ``UNIT_MODULES`` are the unit tier (``make test-fast``:
no model file, no server or worker subprocess; tests/factories.py has the
stand-ins), except their tests marked ``e2e``. Every other test is marked
``e2e`` here at collection, so a new test module is end-to-end until it is
listed. ``pytest -m "not e2e"`` runs the unit tier, ``pytest -m e2e`` the rest.
In the unit tier every warning is an error (``STRICT_WARNINGS``, with its named
exceptions); pyproject.toml's filters hold for the e2e tier.

``server`` starts ``python -m aioengine.entrypoints.cli serve`` once per test
session on a free port of 127.0.0.1, with a small KV cache and an API key
(so the same server covers the authenticated and the plain paths: every
client passes ``server.api_key``), waits for ``/health`` and stops it with
SIGTERM at the end. Starting a server costs ~20-40 s on this machine; reuse
this fixture rather than starting another one.

The executor is the default (``process``) unless ``AIOENGINE_TEST_EXECUTOR``
says otherwise (``inproc``), or the subprocess executor is not there yet.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# On AMX CPUs the quantized GEMM defaults to bf16 tiles (99.6% greedy agreement with
# fp32, tests/test_quant_amx.py); the HF-parity and fused-step tests hold the exact fp32
# path to their references, so the suite (and the servers it starts) runs that one; the
# AMX tests switch it on themselves (cpu_ops.set_amx).
os.environ.setdefault("AIOENGINE_AMX", "0")
UNIT_MODULES = frozenset({
    "test_block_pool.py", "test_block_pool_property.py", "test_import_boundaries.py",
    "test_kv_fork_cow.py", "test_cli_help.py", "test_cli_generate.py",
    "test_sampler.py", "test_scheduler.py", "test_shm_ring.py", "test_tool_parsers.py",
    "test_unit_engine.py", "test_unit_http.py", "test_unit_router.py",
})


# The unit tier's warning filters (later ones win): every warning is an error,
# except these, each named.
STRICT_WARNINGS = (
    "error",
    # Deprecations inside third-party libraries (transformers, starlette, hypothesis):
    # theirs to fix. Ours stay errors (the next two).
    "ignore::DeprecationWarning",
    "ignore::PendingDeprecationWarning",
    "error::DeprecationWarning:aioengine.*",
    "error::DeprecationWarning:tests.*",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name not in UNIT_MODULES:
            item.add_marker(pytest.mark.e2e)
        elif item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.filterwarnings(*STRICT_WARNINGS))
SERVER_START_TIMEOUT_S = 180.0
TEST_API_KEY = "test-key-123"


def server_executor() -> str:
    """Executor for the test server: env ``AIOENGINE_TEST_EXECUTOR``, else the default."""
    name = os.environ.get("AIOENGINE_TEST_EXECUTOR")
    if name:
        return name
    if importlib.util.find_spec("aioengine.engine.multiproc_executor") is None:
        return "inproc"
    return "process"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerInfo:
    """A running test server.

    Attributes:
        base_url: ``http://127.0.0.1:PORT`` (OpenAI clients add ``/v1``).
        ws_url: ``ws://127.0.0.1:PORT/v1/ws`` (no key; add ``?api_key=``).
        api_key: the server's API key.
        log_path: the server's combined stdout/stderr.
        process: the server process.
    """

    base_url: str
    ws_url: str
    api_key: str
    log_path: Path
    process: subprocess.Popen

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def ws_url_with_key(self) -> str:
        return f"{self.ws_url}?api_key={self.api_key}"

    def stats(self) -> dict:
        """``GET /v1/engine/stats`` (the engine's one ``EngineStats`` snapshot)."""
        r = httpx.get(f"{self.base_url}/v1/engine/stats", headers=self.headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_for_stats(self, predicate: Callable[[dict], bool], timeout: float = 1.0,
                       interval: float = 0.02) -> dict:
        """Poll stats until ``predicate(stats)``; returns the last snapshot (check it)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(interval)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_server(tmp_dir: Path, *extra_args: str, api_key: str = TEST_API_KEY) -> ServerInfo:
    """Start ``aioengine serve`` and wait for ``/health``.

    Raises:
        RuntimeError: the process exited or did not become healthy in time
            (the message holds the end of its log).
    """
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "aioengine.entrypoints.cli", "serve", "--port", str(port),
           "--kv-cache-memory", "0.25", "--executor", server_executor(), "--api-key", api_key,
           "--log-level", "warning", *extra_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log = open(log_path, "wb")  # noqa: SIM115 - the server writes to it for its whole life
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                               cwd=REPO_ROOT)
    log.close()
    info = ServerInfo(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/ws", api_key,
                      log_path, process)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{info.log_tail()}")
        try:
            if httpx.get(f"{info.base_url}/health", timeout=2).status_code == 200:
                return info
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(info)
    raise RuntimeError(f"server not healthy after {SERVER_START_TIMEOUT_S} s:\n{info.log_tail()}")


def stop_server(info: ServerInfo) -> None:
    if info.process.poll() is None:
        info.process.send_signal(signal.SIGTERM)
        try:
            info.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            info.process.kill()
            info.process.wait()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module's tests, the count restored after them. For small
    models' steps on a shared machine: more threads only add OpenMP barriers that wait
    whenever another thread is descheduled. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def amx_attention():
    """The C++ kernels' AMX switch on for the test (the suite runs with ``AIOENGINE_AMX=0``),
    the attention's bf16 setting and the switch restored after; skips where the CPU has no
    AMX-BF16 (or the OS refused its tile state). Yields the loaded kernels module."""
    from triton_kernels import cpu_ops

    ops = cpu_ops.load()
    if ops.quant_isa() != 3:
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused its tile state)")
    before = ops.bf16_attention()
    cpu_ops.set_amx(True)
    yield ops
    ops.set_bf16_attention(before)
    cpu_ops.set_amx(cpu_ops.amx_requested())


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer saved as HF files, for random-weight test models."""
    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(default_model_path()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """The shared test server (API key ``server.api_key``)."""
    info = start_server(tmp_path_factory.mktemp("server"))
    try:
        yield info
    finally:
        stop_server(info)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal.
    assert info.process.returncode in (0, -signal.SIGTERM), \
        f"server exit code {info.process.returncode}:\n{info.log_tail()}"
    assert "Traceback" not in info.log_path.read_text(errors="replace"), info.log_tail(200)


def post_all(server, *requests: tuple[str, dict]) -> list[dict]:
    """POST the requests concurrently (they share engine steps); all must be 200."""
    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=300) as client:
            return await asyncio.gather(*(client.post(p, json=b) for p, b in requests))

    responses = asyncio.run(go())
    for r, (path, data) in zip(responses, requests):
        assert r.status_code == 200, f"{path} {data}: {r.status_code} {r.text}"
    return [r.json() for r in responses]
