"""The HTTP and WebSocket layers in-process (unit tier): Starlette's
``TestClient`` against the real app and the real ``AsyncEngine`` on a
stand-in model (``tests/factories.py``: in-memory byte tokenizer,
``FakeExecutor``). No model file, no subprocess.

The stand-in's greedy output is known exactly (``greedy_output``), so every
text below is checked character for character.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from aioengine.engine.async_engine import AsyncEngine
from aioengine.entrypoints import ws_messages
from aioengine.entrypoints.openai.api_server import build_app
from tests.factories import FakeExecutor, greedy_output, make_config, make_tokenizer

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    async def start(config):
        return await AsyncEngine.from_parts(config, make_tokenizer(), FakeExecutor)

    app = build_app(make_config(max_model_len=512), engine_factory=start, web_dir="")
    with TestClient(app) as c:
        yield c


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    tokenizer = make_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    return make_tokenizer().decode(greedy_output(prompt_ids, max_tokens))


def sse_events(response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# -- completions ---------------------------------------------------------------------------------


def test_chat_completion_is_the_stand_in_models_greedy_text(client):
    r = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 9, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = chat_prompt_ids(MESSAGES)
    assert body["choices"][0]["message"]["content"] == expected_text(prompt_ids, 9)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 9
    assert body["model"] == "fake-model" and body["id"].startswith("chatcmpl-")


def test_chat_stream_deltas_join_to_the_text_then_usage_then_done(client):
    body = {
        "messages": MESSAGES,
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-1])
    assert text == expected_text(chat_prompt_ids(MESSAGES), 9)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_number_choices_prompt_major_and_echo(client):
    tokenizer = make_tokenizer()
    r = client.post(
        "/v1/completions",
        json={"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 5, "temperature": 0, "echo": True},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt = ["ab", "xyz"][c["index"] // 2]
        assert c["text"] == prompt + expected_text(tokenizer.encode(prompt), 5)
    assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": 5, "completion_tokens": 20}


def test_streamed_completion_equals_the_full_one_for_each_choice(client):
    body = {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 6, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()["choices"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in full}


def test_stop_string_cuts_the_text_streamed_or_not(client):
    prompt_ids = make_tokenizer().encode("stop here")
    full_text = expected_text(prompt_ids, 24)
    stop = full_text[5:7]
    want = full_text[: full_text.index(stop)]
    body = {"prompt": "stop here", "max_tokens": 24, "temperature": 0, "stop": [stop]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (want, "stop", stop)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    deltas = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(deltas) == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


# -- bad input: OpenAI-shaped 4xx, and the server keeps serving -----------------------------------


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"prompt": "a", "max_tokens": 10_000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[]], "max_tokens": 1}, 400, "prompt"),
        ("/v1/completions", {"prompt": [999_999], "max_tokens": 1}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 1}, 400, "messages"),
        ("/v1/chat/completions", {"model": "other", "messages": MESSAGES}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(client, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    assert_openai_error(client.post(path, **kwargs), status, param)
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_unknown_route_is_404_and_wrong_method_405(client):
    assert_openai_error(client.get("/v1/nope"), 404)
    r = client.get("/v1/chat/completions")
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"


def test_a_failed_step_is_503_for_its_requests_and_the_next_request_runs(client):
    engine: AsyncEngine = client.app.state.serving.engine
    assert isinstance(engine.executor, FakeExecutor)
    engine.executor.fail_next = True
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert assert_openai_error(r, 503)["code"] == "engine_unavailable"
    engine.executor.fail_next = True
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}
    ) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable"
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
    assert ok.json()["choices"][0]["text"] == expected_text(make_tokenizer().encode("x"), 3)


# -- the other routes ----------------------------------------------------------------------------


def test_health_models_stats_tokenize_detokenize(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["fake-model"] and models[0]["max_model_len"] == 512
    stats = client.get("/v1/engine/stats?block_map=1").json()
    assert stats["num_kv_blocks_total"] == 64 and len(stats["block_usage_map"]) == 64
    assert stats["num_requests_finished"] >= 1 and stats["num_running"] == 0
    assert "recent_steps" not in stats
    steps = client.get("/v1/engine/stats?steps=1").json()["recent_steps"]
    # One record per applied step (a step the worker failed is counted, not applied).
    assert 0 < len(steps) <= stats["num_steps"] and all(s[3] == 0.001 for s in steps)
    assert stats["worker_busy_time"] == pytest.approx(0.001 * len(steps))
    tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert tokens["tokens"] == chat_prompt_ids(MESSAGES) and tokens["count"] == len(
        tokens["tokens"]
    )
    text = client.post("/detokenize", json={"tokens": make_tokenizer().encode("héllo")}).json()
    assert text == {"prompt": "héllo"}
    assert client.post("/reset_prefix_cache").json() == {"reset": True}
    assert "aioengine" in client.get("/metrics").text


# -- WebSocket -----------------------------------------------------------------------------------


def test_websocket_streams_deltas_then_one_done(client):
    with client.websocket_connect("/v1/ws") as ws:
        hello = ws_messages.decode(ws.receive_text())
        assert isinstance(hello, ws_messages.Hello) and hello.model == "fake-model"
        ws.send_text(
            json.dumps(
                {"type": "completion", "id": "a", "prompt": "hi", "max_tokens": 7, "temperature": 0}
            )
        )
        deltas = []
        while True:
            message = ws_messages.decode(ws.receive_text())
            if isinstance(message, ws_messages.Done):
                break
            assert isinstance(message, ws_messages.Delta) and message.id == "a"
            deltas.append(message.text)
    want = expected_text(make_tokenizer().encode("hi"), 7)
    assert "".join(deltas) == want == message.text
    assert message.finish_reason == "length" and message.usage["completion_tokens"] == 7


def test_websocket_bad_messages_are_errors_and_the_socket_stays_open(client):
    with client.websocket_connect("/v1/ws") as ws:
        ws.receive_text()  # hello
        for raw, code in (
            ("{nope", 400),
            ("[1]", 400),
            ('{"type": "fly"}', 400),
            ('{"type": "cancel", "id": "zz"}', 404),
            ('{"type": "completion", "id": "b", "prompt": "x", "n": 2}', 400),
        ):
            ws.send_text(raw)
            error = ws_messages.decode(ws.receive_text())
            assert isinstance(error, ws_messages.Error) and error.code == code, raw
        ws.send_text('{"type": "ping"}')
        assert isinstance(ws_messages.decode(ws.receive_text()), ws_messages.Pong)


# -- SSE delta events ----------------------------------------------------------------------------

DELTA_TEXTS = [
    "",
    " hello",
    'quote " and \\ backslash',
    "tab\tnewline\ncarriage\rnul\x00bell\x07del\x7f",
    "héllo wörld ✓ 日本語 🚀",
    "</script><!-- & ' /",
    "\u2028\u2029 line separators",
    "\x00aioengine-delta\x00",  # the template's own marker as a delta
]


@pytest.mark.parametrize("text", DELTA_TEXTS)
def test_delta_events_are_byte_for_byte_the_pydantic_chunks(text):
    from aioengine.entrypoints.openai.streaming import DeltaEvents, sse
    from aioengine.entrypoints.protocol import (
        ChatCompletionChunk,
        ChatCompletionStreamChoice,
        CompletionChoice,
        CompletionChunk,
    )

    def completion(index: int, t: str) -> bytes:
        choice = CompletionChoice(index=index, text=t)
        return sse(CompletionChunk(id="cmpl-1", created=7, model="m\u00e9", choices=[choice]))

    def chat(index: int, t: str) -> bytes:
        choice = ChatCompletionStreamChoice(index=index, delta={"content": t})
        return sse(ChatCompletionChunk(id="chat-1", created=7, model="m", choices=[choice]))

    for render in (completion, chat):
        events = DeltaEvents(render)
        for index in (0, 3, 0):
            assert events.event(index, text) == render(index, text)


def test_delta_events_render_every_event_when_the_marker_is_not_unique():
    from aioengine.entrypoints.openai.streaming import DeltaEvents, sse

    calls = []

    def render(index: int, text: str) -> bytes:  # the marker twice: no template
        calls.append(text)
        return sse({"a": text, "b": text, "index": index})

    events = DeltaEvents(render)
    assert events.event(1, "x") == sse({"a": "x", "b": "x", "index": 1})
    assert events.event(1, "y") == sse({"a": "y", "b": "y", "index": 1})
    assert calls[-2:] == ["x", "y"]
