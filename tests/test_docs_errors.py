"""docs/api.md's error table against the running server: every documented
(status, ``type``, ``code``) row is produced by a real request, and every
code the tests know how to produce is documented, so the table and the code
cannot drift apart.

Most rows come from the shared ``server``; ``queue_full`` (429) and
``engine_unavailable`` (503) need a server with a waiting queue of one that
is then told to shut down, so they share one small server of their own.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from aioengine.entrypoints.protocol import _ERROR_TYPES
from conftest import ServerInfo, start_server, stop_server

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
COMPLETIONS = "/v1/completions"
# Codes no request should be able to produce.
UNTRIGGERABLE = {"internal_error": "a 500 is a bug; nothing documented produces one"}


def documented_errors() -> list[tuple[int, str, str]]:
    """(status, type, code) for each code of each row of api.md's error table."""
    text = API_MD.read_text()
    section = text[text.index("## Errors"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            status, error_type = int(cells[0]), cells[1].strip("`")
            codes = re.findall(r"`([a-z_]+)`", cells[3])
            assert codes, f"api.md error row without a code: {line}"
            rows += [(status, error_type, code) for code in codes]
    return rows


DOCUMENTED = documented_errors()


# -- how to produce each code on the shared server ---------------------------------------------


def _stream_then(server: ServerInfo, then: Callable[[httpx.Client], httpx.Response]
                 ) -> httpx.Response:
    """``then(client)`` while a streamed request holds KV blocks."""
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c, \
            c.stream("POST", COMPLETIONS, json=body) as stream:
        lines = stream.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # running, blocks held
        return then(c)


TRIGGERS: dict[str, Callable[[httpx.Client, ServerInfo], httpx.Response]] = {
    "invalid_json": lambda c, s: c.post(COMPLETIONS, content=b"{",
                                        headers={"Content-Type": "application/json"}),
    "invalid_type": lambda c, s: c.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": "5"}),
    "invalid_value": lambda c, s: c.post(COMPLETIONS, json={"prompt": "Hi", "top_p": 0}),
    "missing_required_parameter": lambda c, s: c.post(COMPLETIONS, json={"max_tokens": 1}),
    "unsupported": lambda c, s: c.post(COMPLETIONS, json={"prompt": "Hi", "suffix": "x"}),
    "invalid_api_key": lambda c, s: httpx.get(f"{s.base_url}/v1/models", timeout=30),
    "model_not_found": lambda c, s: c.post(COMPLETIONS, json={"prompt": "Hi", "model": "x"}),
    "unknown_route": lambda c, s: c.post("/v1/embeddings", json={"input": "Hi"}),
    "method_not_allowed": lambda c, s: c.get(COMPLETIONS),
    "requests_running": lambda c, s: _stream_then(s, lambda k: k.post("/reset_prefix_cache")),
    "request_too_large": lambda c, s: c.post(COMPLETIONS, content=b" " * ((8 << 20) + 1),
                                             headers={"Content-Type": "application/json"}),
}
# Produced by test_queue_full_and_engine_unavailable below.
SMALL_SERVER_CODES = {"queue_full", "engine_unavailable"}


def check_error(r: httpx.Response, status: int, error_type: str, code: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == error_type and body["error"]["code"] == code, body
    assert body["error"]["message"], body


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def test_the_table_and_the_triggers_name_the_same_codes():
    documented = {code for _, _, code in DOCUMENTED}
    known = set(TRIGGERS) | SMALL_SERVER_CODES | set(UNTRIGGERABLE)
    assert documented == known, (f"documented, no test: {documented - known}; "
                                 f"tested, not documented: {known - documented}")
    for status, error_type, code in DOCUMENTED:  # the types protocol.APIError sends
        assert _ERROR_TYPES[status] == error_type, (status, error_type, code)


@pytest.mark.parametrize("status,error_type,code",
                         [pytest.param(*row, id=f"{row[0]}-{row[2]}") for row in DOCUMENTED
                          if row[2] in TRIGGERS])
def test_documented_error_is_what_the_server_answers(server, http, status, error_type, code):
    check_error(TRIGGERS[code](http, server), status, error_type, code)


def test_queue_full_and_engine_unavailable(tmp_path_factory):
    """429 ``queue_full`` with one request running and one waiting; then, once the
    server is told to stop, 503 ``engine_unavailable`` on a connection still open."""
    rows = {code: (status, error_type) for status, error_type, code in DOCUMENTED}
    info = start_server(tmp_path_factory.mktemp("small-server"), "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", "--drain-timeout", "60")
    long = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.Client(base_url=info.base_url, headers=info.headers, timeout=120) as c, \
                c.stream("POST", COMPLETIONS, json=long) as running, \
                c.stream("POST", COMPLETIONS, json=long) as waiting:
            assert running.status_code == waiting.status_code == 200
            stats = info.wait_for_stats(lambda s: (s["num_running"], s["num_waiting"]) == (1, 1),
                                        timeout=60, interval=0.1)
            assert (stats["num_running"], stats["num_waiting"]) == (1, 1), stats
            with httpx.Client(base_url=info.base_url, headers=info.headers,
                              timeout=30) as kept:
                r = kept.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1})
                check_error(r, *rows["queue_full"], "queue_full")
                assert int(r.headers["Retry-After"]) >= 1
                # Draining: the listening socket closes, this kept-alive connection stays.
                info.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while (r := kept.get("/health")).status_code == 200:
                    assert time.monotonic() < deadline, "/health stayed 200 after SIGTERM"
                    time.sleep(0.05)
                check_error(r, *rows["engine_unavailable"], "engine_unavailable")
                r = kept.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1})
                check_error(r, *rows["engine_unavailable"], "engine_unavailable")
    finally:
        stop_server(info)


# -- docs/troubleshooting.md names real metrics and panel figures ------------------------------

TROUBLESHOOTING_MD = API_MD.parent / "troubleshooting.md"


def test_troubleshooting_names_only_real_metrics(server, http):
    """Every ``aioengine:*`` name on the page is one ``/metrics`` exposes."""
    text = http.get("/metrics").text
    exposed = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            exposed.add(line.split()[2])
        elif line and not line.startswith("#"):
            exposed.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    named = set(re.findall(r"aioengine:[a-z0-9_]+", TROUBLESHOOTING_MD.read_text()))
    assert len(named) >= 15, named
    assert named <= exposed, f"not in /metrics: {sorted(named - exposed)}"


def test_troubleshooting_names_only_real_panel_figures():
    page = (API_MD.parents[1] / "web" / "index.html").read_text()
    labels = set(re.findall(r"<dt>([^<]+)</dt>", page))
    doc = TROUBLESHOOTING_MD.read_text()
    start = doc.index("**Engine** panel") + len("**Engine** panel")
    panel_line = doc[start:doc.index("block grid")]
    named = set(re.findall(r"\*([A-Z][^*]+)\*", panel_line))
    assert len(named) >= 6 and named <= labels, (named, labels)
