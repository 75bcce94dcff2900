"""Per-API-key limits (issue 22): ``quotas.py`` on a fake clock (buckets refill
on time, tokens count prompt + completion, constant-time lookup, the file
format), then one real server with an ``--api-keys-file`` and ``--api-key``:
the tighter key gets 429 at its limit while the other key is unaffected, over
HTTP and the WebSocket, and ``/metrics`` counts per key by name.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator

import httpx
import pytest
import websockets
from reliability_util import ServerInfo, own_server

from aioengine.entrypoints import quotas as quotas_module
from aioengine.entrypoints.protocol import APIError
from aioengine.entrypoints.quotas import (
    APIKeySpec,
    QuotaManager,
    load_api_keys,
    parse_api_keys,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(window_s: float = 60.0, **limits) -> tuple[QuotaManager, FakeClock]:
    clock = FakeClock()
    return QuotaManager([APIKeySpec.from_key("k", "secret", **limits)], window_s, clock), clock


# -- quotas.py on a fake clock --------------------------------------------------------------


def test_requests_per_minute_refill_on_time():
    quotas, clock = manager(requests_per_minute=2)
    key = quotas.authenticate("secret")
    quotas.admit(key, "m", 1).release(0)
    quotas.admit(key, "m", 1).release(0)
    with pytest.raises(APIError) as info:
        quotas.admit(key, "m", 1)
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.retry_after == pytest.approx(30.0)  # one request refills in 60/2 s
    clock.now += 29.0
    with pytest.raises(APIError):
        quotas.admit(key, "m", 1)
    clock.now += 1.0
    quotas.admit(key, "m", 1).release(0)
    clock.now += 60.0  # a whole window: the full allowance again, never more
    quotas.admit(key, "m", 1).release(0)
    quotas.admit(key, "m", 1).release(0)
    with pytest.raises(APIError):
        quotas.admit(key, "m", 1)
    assert key.num_rejected == {"requests": 3}


def test_tokens_per_minute_count_prompt_and_completion_tokens():
    quotas, clock = manager(tokens_per_minute=100)
    key = quotas.authenticate("secret")
    quotas.admit(key, "m", 30).release(20)    # 50 used
    quotas.admit(key, "m", 40).release(10)    # 100 used
    with pytest.raises(APIError) as info:
        quotas.admit(key, "m", 1)
    assert info.value.status == 429
    assert "tokens per minute" in info.value.message
    assert info.value.retry_after == pytest.approx(0.6)  # 1 token at 100/60 per s
    # Completion tokens can take the bucket below zero: the wait grows with the debt.
    clock.now += 60.0
    quotas.admit(key, "m", 10).release(140)   # level -50
    with pytest.raises(APIError) as info:
        quotas.admit(key, "m", 10)
    assert info.value.retry_after == pytest.approx(36.0)  # (10 + 50) * 0.6
    clock.now += 36.0
    quotas.admit(key, "m", 10).release(0)
    assert (key.num_prompt_tokens, key.num_generation_tokens) == (90, 170)
    # A prompt bigger than a whole minute's allowance can never pass.
    with pytest.raises(APIError) as info:
        quotas.admit(key, "m", 101)
    assert "exceeds" in info.value.message and info.value.retry_after == 60.0


def test_concurrency_cap_frees_on_release_once():
    quotas, _ = manager(max_concurrent_requests=1)
    key = quotas.authenticate("secret")
    lease = quotas.admit(key, "m", 5)
    with pytest.raises(APIError) as info:
        quotas.admit(key, "m", 5)
    assert info.value.status == 429 and info.value.retry_after == 1.0
    lease.release(3)
    lease.release(3)  # idempotent: one slot, counted once
    assert key.running == 0 and key.num_generation_tokens == 3
    quotas.admit(key, "m", 5)


def test_allowed_models_is_a_404_for_others():
    quotas, _ = manager(allowed_models=("small",))
    key = quotas.authenticate("secret")
    quotas.admit(key, "small", 1)
    with pytest.raises(APIError) as info:
        quotas.admit(key, "big", 1)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_keys_compared_in_constant_time(monkeypatch):
    specs = [APIKeySpec.from_key(f"k{i}", f"key-{i}") for i in range(5)]
    quotas = QuotaManager(specs)
    calls = []
    real = quotas_module.hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(quotas_module.hmac, "compare_digest", counting)
    assert quotas.authenticate("key-0").name == "k0"
    assert len(calls) == 5  # no early exit at the first match
    calls.clear()
    assert quotas.authenticate("key-9") is None and quotas.authenticate(None) is None
    assert len(calls) == 5
    # Digests of equal length are compared, never the raw keys.
    assert all(len(a) == len(b) == 32 for a, b in calls)


def test_keys_file_json_and_yaml(tmp_path):
    digest = hashlib.sha256(b"team-b-key").hexdigest()
    (tmp_path / "keys.yaml").write_text(
        "keys:\n"
        "  - name: team-a\n    key: team-a-key\n    requests_per_minute: 5\n"
        "    allowed_models: small\n"
        f"  - name: team-b\n    key_sha256: {digest}\n    tokens_per_minute: 1000\n"
        "    max_concurrent_requests: 2\n")
    a, b = load_api_keys(tmp_path / "keys.yaml")
    assert (a.name, a.requests_per_minute, a.allowed_models) == ("team-a", 5, ("small",))
    assert (b.tokens_per_minute, b.max_concurrent_requests) == (1000, 2)
    assert QuotaManager([a, b]).authenticate("team-b-key").name == "team-b"
    (tmp_path / "keys.json").write_text(json.dumps([{"name": "x", "key": "y"}]))
    (x,) = load_api_keys(tmp_path / "keys.json")
    assert x.requests_per_minute is None
    for bad, needle in [([{"name": "x"}], "exactly one"),
                        ([{"name": "x", "key": "a", "rpm": 3}], "unknown field"),
                        ([{"name": "x", "key": "a"}, {"name": "x", "key": "b"}], "twice"),
                        ([{"name": "x", "key": "a"}, {"name": "y", "key": "a"}], "twice"),
                        ([{"name": "x", "key": "a", "tokens_per_minute": 0}], "positive"),
                        ([{"name": "x", "key_sha256": "zz"}], "hex"),
                        ({}, "non-empty list")]:
        with pytest.raises(ValueError, match=needle):
            parse_api_keys(bad)


# -- a real server ---------------------------------------------------------------------------

TIGHT_KEY, LOOSE_KEY, TPM_KEY, ONLY_OTHER_KEY = "k-tight", "k-loose", "k-tpm", "k-other"
TIGHT_RPM = 2
TPM_LIMIT = 150


@pytest.fixture(scope="module")
def qserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    tmp = tmp_path_factory.mktemp("quotas")
    keys = tmp / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{name: tight, key: {TIGHT_KEY}, requests_per_minute: {TIGHT_RPM}}}\n"
        f"  - name: loose\n    key_sha256: {hashlib.sha256(LOOSE_KEY.encode()).hexdigest()}\n"
        "    requests_per_minute: 1000\n"
        f"  - {{name: tpm, key: {TPM_KEY}, tokens_per_minute: {TPM_LIMIT}}}\n"
        f"  - {{name: other, key: {ONLY_OTHER_KEY}, allowed_models: [another-model]}}\n")
    # A 10-minute window: nothing refills noticeably while this module runs
    # (the refill itself is tested on the fake clock above).
    with own_server(tmp, "--api-keys-file", str(keys), "--quota-window-seconds", "600",
                    "--max-num-seqs", "16") as info:
        yield info


def body(max_tokens: int = 4, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


async def post(server: ServerInfo, key: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        return await client.post("/v1/chat/completions", json=body(**kw))


async def ws_chat(server: ServerInfo, key: str, rid: str) -> dict:
    async with websockets.connect(f"{server.ws_url}?api_key={key}") as ws:
        assert json.loads(await ws.recv())["auth_required"] is False
        await ws.send(json.dumps({"type": "chat", "id": rid, **body()}))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if msg.get("id") == rid and msg["type"] in ("done", "error"):
                return msg


def scrape(server: ServerInfo) -> str:
    return httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=30).text


def key_metric(text: str, name: str, key_name: str, reason: str | None = None) -> float:
    labels = f'key_name="{key_name}"' + (f',reason="{reason}"' if reason else "")
    for line in text.splitlines():
        if line.startswith(f"aioengine:{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{labels}}} in /metrics")


def test_tighter_key_gets_429_at_its_limit_and_the_other_is_unaffected(qserver):
    async def go():
        tight = await asyncio.gather(*(post(qserver, TIGHT_KEY) for _ in range(TIGHT_RPM)))
        over = await post(qserver, TIGHT_KEY)
        over_ws = await ws_chat(qserver, TIGHT_KEY, "t-ws")
        loose = await asyncio.gather(*(post(qserver, LOOSE_KEY) for _ in range(4)))
        loose_ws = await ws_chat(qserver, LOOSE_KEY, "l-ws")
        return tight, over, over_ws, loose, loose_ws

    tight, over, over_ws, loose, loose_ws = asyncio.run(go())
    assert [r.status_code for r in tight] == [200] * TIGHT_RPM, [r.text for r in tight]
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and "requests per minute" in error["message"]
    # One request refills in 600 / 2 s; Retry-After says so.
    assert 250 <= int(over.headers["retry-after"]) <= 300, over.headers
    assert over_ws["type"] == "error" and over_ws["code"] == 429, over_ws
    assert over_ws["retry_after"] >= 250
    assert [r.status_code for r in loose] == [200] * 4, [r.text for r in loose]
    assert loose_ws["type"] == "done", loose_ws
    text = scrape(qserver)
    assert key_metric(text, "api_key_requests_total", "tight") == TIGHT_RPM
    assert key_metric(text, "api_key_rejected_requests_total", "tight", "requests") == 2
    assert key_metric(text, "api_key_requests_total", "loose") == 5
    assert key_metric(text, "api_key_rejected_requests_total", "loose", "requests") == 0
    for secret in (TIGHT_KEY, LOOSE_KEY, TPM_KEY, ONLY_OTHER_KEY):
        assert secret not in text


def test_tokens_per_minute_count_prompt_plus_completion(qserver):
    async def go():
        responses = []
        while len(responses) < 10:
            r = await post(qserver, TPM_KEY, max_tokens=16)
            responses.append(r)
            if r.status_code != 200:
                break
        return responses

    responses = asyncio.run(go())
    ok, refused = responses[:-1], responses[-1]
    assert ok and all(r.status_code == 200 for r in ok)
    assert refused.status_code == 429, refused.text
    assert "tokens per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    usage = [r.json()["usage"] for r in ok]
    prompt = sum(u["prompt_tokens"] for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    prompt_len = usage[0]["prompt_tokens"]
    assert all(u["completion_tokens"] == 16 for u in usage), usage
    # Refused exactly when the prompt no longer fits in what prompt + completion
    # tokens left of the minute, though counting prompt tokens alone it would fit.
    assert TPM_LIMIT - (prompt + completion) < prompt_len, usage
    assert TPM_LIMIT - (prompt + completion) + usage[-1]["total_tokens"] >= prompt_len, usage
    assert TPM_LIMIT - prompt >= prompt_len, "the test must tell prompt-only accounting apart"
    text = scrape(qserver)
    assert key_metric(text, "api_key_prompt_tokens_total", "tpm") == prompt
    assert key_metric(text, "api_key_generation_tokens_total", "tpm") == completion
    assert key_metric(text, "api_key_requests_running", "tpm") == 0


def test_allowed_models_single_api_key_and_bad_keys(qserver):
    async def go():
        return (await post(qserver, ONLY_OTHER_KEY), await post(qserver, qserver.api_key),
                await post(qserver, "not-a-key"))

    other, default, bad = asyncio.run(go())
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert default.status_code == 200, default.text  # --api-key keeps working
    assert bad.status_code == 401
    assert key_metric(scrape(qserver), "api_key_rejected_requests_total", "other",
                      "model") == 1


def test_bad_keys_file_is_one_line_and_exit_1(tmp_path):
    import subprocess
    import sys

    from conftest import REPO_ROOT

    bad = tmp_path / "keys.yaml"
    bad.write_text("keys:\n  - name: a\n    key: k\n    requests_per_minute: -1\n")
    for path, needle in [(bad, "requests_per_minute must be a positive integer"),
                         (tmp_path / "missing.yaml", "No such file")]:
        proc = subprocess.run([sys.executable, "-m", "aioengine.entrypoints.cli", "serve",
                               "--port", "0", "--api-keys-file", str(path)],
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "--api-keys-file" in lines[0] and needle in lines[0], lines
