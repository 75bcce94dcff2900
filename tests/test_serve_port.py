"""``aioengine serve --port 0``: the system picks a free port, and the startup
message names that port (not ``:0``) in a URL a user can paste and reach.

The server is started as a user would (``python -m aioengine.entrypoints.cli
serve``); the test reads its ``ready`` line, parses the URL, and talks to it
with the OpenAI client.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import pytest

from aioengine.entrypoints.cli import ready_message
from tests.conftest import REPO_ROOT, SERVER_START_TIMEOUT_S, TEST_API_KEY, server_executor

READY = re.compile(r"ready (http://\S+)")


def read_until_ready(process: subprocess.Popen) -> tuple[str, str]:
    """``(url, everything printed so far)`` once the ``ready`` line appears.

    Raises:
        AssertionError: the process exited or printed no ``ready`` line in time.
    """
    assert process.stdout is not None
    out = ""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                assert process.poll() is None, f"server exited:\n{out}"
                continue
            line = process.stdout.readline()
            if not line:
                raise AssertionError(f"server exited with {process.wait()}:\n{out}")
            out += line
            match = READY.search(line)
            if match:
                return match.group(1), out
    raise AssertionError(f"no 'ready' line after {SERVER_START_TIMEOUT_S} s:\n{out}")


def test_port_0_prints_the_bound_port_and_that_url_serves():
    openai = pytest.importorskip("openai")
    cmd = [sys.executable, "-m", "aioengine.entrypoints.cli", "serve", "--port", "0",
           "--kv-cache-memory", "0.05", "--executor", server_executor(),
           "--api-key", TEST_API_KEY, "--log-level", "warning", "--no-standby-worker"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), NO_COLOR="1", COLUMNS="200")
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=REPO_ROOT)
    try:
        url, out = read_until_ready(process)
        port = int(url.rsplit(":", 1)[1])
        assert url == f"http://127.0.0.1:{port}" and port != 0, out
        assert ":0 " not in out and not out.rstrip().endswith(":0"), out
        with openai.OpenAI(base_url=f"{url}/v1", api_key=TEST_API_KEY, max_retries=0) as client:
            answer = client.completions.create(model=client.models.list().data[0].id,
                                               prompt="The capital of France is", max_tokens=3,
                                               temperature=0)
        assert answer.choices[0].text and answer.usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=30)  # drains and closes the pipe
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("host,want", [
    ("127.0.0.1", "http://127.0.0.1:8123"),
    ("localhost", "http://localhost:8123"),
    ("::1", "http://[::1]:8123"),
    ("0.0.0.0", "http://127.0.0.1:8123 (listening on 0.0.0.0:8123, every interface)"),
    ("::", "http://[::1]:8123 (listening on [::]:8123, every interface)"),
])
def test_ready_message_is_a_url_to_paste(host, want):
    assert ready_message(host, 8123) == want
