"""Input validation, authentication and robustness of the real server
(``conftest.server``): an OpenAI-shaped 400 naming the field for every
out-of-range or wrongly typed field on both endpoints, ``null`` means absent,
401 on every endpoint but ``/health`` (HTTP and WebSocket), and property-based
tests that post random and malformed bodies to every endpoint and WebSocket
message type: never a 5xx, never a dropped socket, and the server still
answers normally afterwards with nothing left running.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
BASE = {CHAT: {"messages": MESSAGES, "max_tokens": 4},
        COMPLETIONS: {"prompt": "Hi", "max_tokens": 4}}
ERROR_CODES = {"invalid_json", "invalid_type", "invalid_value", "missing_required_parameter",
               "unsupported"}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "?") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    expected_type = {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}[status]
    assert error["type"] == expected_type
    if param != "?":
        assert error["param"] == param, error
    if status == 400:
        assert error["code"] in ERROR_CODES, error
    return error


# -- every field, both endpoints ----------------------------------------------------------------

# (field, bad value, param the error names); None as param: the field itself.
COMMON_BAD = [
    ("n", 0), ("n", 129), ("n", "2"), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", "hot"), ("temperature", [1]),
    ("top_p", 0), ("top_p", 1.01), ("top_p", -1), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", 2**70), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", False),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("presence_penalty", "0"),
    ("frequency_penalty", 3), ("frequency_penalty", -3), ("frequency_penalty", {}),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 11),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", "42"), ("seed", 1.5),
    ("stop", 5), ("stop", [1]), ("stop", [""]), ("stop", ""), ("stop", ["s"] * 17),
    ("stop", {"a": "b"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", "1"), ("stop_token_ids", [2**70]),
    ("stop_token_ids", [1.5]), ("stop_token_ids", 3),
    ("include_stop_str_in_output", "yes"), ("ignore_eos", 1), ("skip_special_tokens", "no"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "5"), ("max_tokens", 1.5),
    ("max_tokens", 10**6), ("max_tokens", 2**70),
    ("min_tokens", -1), ("min_tokens", 5), ("min_tokens", "1"),  # 5 > max_tokens 4
    ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"1": -101}),
    ("logit_bias", {"-1": 1}), ("logit_bias", {"1_0": 1}), ("logit_bias", {" 1": 1}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", [1, 2]), ("logit_bias", {"1": "a"}),
    ("stream", "yes"), ("stream", 1), ("stream_options", "x"),
    ("stream_options", {"include_usage": "yes"}),
    ("priority", "high"), ("priority", 1.5), ("cache_salt", ""), ("cache_salt", 5),
    ("user", 5), ("model", 5), ("model", ["SmolLM2-135M-Instruct"]),
]
CHAT_BAD = [
    ("max_completion_tokens", 0), ("max_completion_tokens", "3"),
    ("logprobs", "yes"), ("logprobs", 1), ("top_logprobs", "2"),
    ("messages", "hi"), ("messages", []), ("messages", [{"content": "x"}]),
    ("messages", [{"role": "user", "content": 5}]), ("messages", [{"role": "robot"}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}]), ("messages", None),
    ("add_generation_prompt", "yes"), ("continue_final_message", 1),
    ("tools", [{"type": "function"}]), ("tools", "x"), ("tool_choice", "always"),
    ("tool_choice", {"type": "function", "function": {"name": "nope"}}),
    ("response_format", {"type": "xml"}), ("response_format", "json"),
    ("guided_regex", 5), ("guided_choice", "red"),
]
COMPLETION_BAD = [
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", "1"),
    ("echo", "yes"), ("suffix", "x"), ("suffix", 5), ("best_of", 2), ("best_of", "1"),
    ("prompt", 5), ("prompt", None), ("prompt", [1, "a"]), ("prompt", ["a", [1]]),
    ("prompt", [1.5]), ("prompt", [[1, "a"]]), ("prompt", {"text": "x"}), ("prompt", []),
    ("prompt", [[10**9]]), ("prompt", [-1]), ("prompt", [2**70]), ("prompt", [True]),
]
CASES = ([pytest.param(ep, f, v, id=f"{ep.split('/')[-1]}-{f}-{v!r}"[:80])
          for ep in (CHAT, COMPLETIONS) for f, v in COMMON_BAD]
         + [pytest.param(CHAT, f, v, id=f"chat-{f}-{v!r}"[:80]) for f, v in CHAT_BAD]
         + [pytest.param(COMPLETIONS, f, v, id=f"completions-{f}-{v!r}"[:80])
            for f, v in COMPLETION_BAD])


@pytest.mark.parametrize("endpoint,field,value", CASES)
def test_bad_field_is_an_openai_400_naming_it(http, endpoint, field, value):
    r = http.post(endpoint, json={**BASE[endpoint], field: value})
    assert_openai_error(r, 400, field)


@pytest.mark.parametrize("endpoint,body,param", [
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    (COMPLETIONS, {"echo": True, "logprobs": 1}, "echo"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": [""]}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {"n": 2, "best_of": 3}, "best_of"),
])
def test_bad_field_combinations_are_400(http, endpoint, body, param):
    assert_openai_error(http.post(endpoint, json={**BASE[endpoint], **body}), 400, param)


def test_a_prompt_too_long_for_the_context_is_400(http):
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    r = http.post(COMPLETIONS, json={"prompt": [1] * max_model_len, "max_tokens": 1})
    assert_openai_error(r, 400, "prompt")
    r = http.post(COMPLETIONS, json={"prompt": [1] * (max_model_len - 2), "max_tokens": 5})
    assert_openai_error(r, 400, "max_tokens")


def test_extreme_valid_values_work_and_do_not_stall_the_engine(server):
    """Regression: top_k / stop_token_ids beyond 64 bits, or seed + i past 2**64
    for sample i of n, passed validation and then failed to encode inside the
    step loop, which stopped stepping: every request on the server hung."""
    vocab = 49152
    bodies = [{"seed": 2**63 - 1, "n": 3}, {"seed": -(2**63), "n": 3}, {"top_k": 2**63 - 1},
              {"stop_token_ids": [2**63 - 1]}, {"min_tokens": 1}, {"priority": 2**70},
              {"logit_bias": {str(vocab - 1): 100, "0": -100}}, {"top_k": -1, "top_p": 1e-9}]

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=120) as client:
            return await asyncio.gather(*(client.post(COMPLETIONS, json={
                "prompt": "Hi", "max_tokens": 2, **b}) for b in bodies))

    for body, r in zip(bodies, asyncio.run(go())):
        assert r.status_code == 200, (body, r.text)
        assert r.json()["usage"]["completion_tokens"] == 2 * body.get("n", 1)


OPTIONAL_COMMON = ["model", "n", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                   "include_stop_str_in_output", "ignore_eos", "min_tokens", "logit_bias",
                   "skip_special_tokens", "stream", "stream_options", "priority", "cache_salt",
                   "user"]
OPTIONAL = {CHAT: [*OPTIONAL_COMMON, "max_completion_tokens", "logprobs", "top_logprobs",
                   "add_generation_prompt", "continue_final_message", "tools",
                   "response_format"],
            COMPLETIONS: [*OPTIONAL_COMMON, "echo", "logprobs", "suffix", "best_of"]}


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_null_means_absent_and_unknown_fields_are_ignored(http, endpoint):
    plain = {**BASE[endpoint], "temperature": 0, "ignore_eos": True}
    nulls = {**plain, **dict.fromkeys(OPTIONAL[endpoint]), "ignore_eos": True,
             "a_future_field": {"nested": [1, 2]}, "temperature": 0}
    a, b = http.post(endpoint, json=plain), http.post(endpoint, json=nulls)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    pick = ((lambda r: r.json()["choices"][0]["message"]["content"]) if endpoint == CHAT
            else (lambda r: r.json()["choices"][0]["text"]))
    assert pick(a) == pick(b)
    assert a.json()["usage"]["completion_tokens"] == b.json()["usage"]["completion_tokens"] == 4


def test_tokenize_and_detokenize_validate_too(http):
    assert_openai_error(http.post("/tokenize", json={}), 400, "prompt")
    assert_openai_error(http.post("/tokenize", json={"prompt": "a", "messages": MESSAGES}), 400,
                        "prompt")
    assert_openai_error(http.post("/tokenize", json={"prompt": 5}), 400, "prompt")
    assert_openai_error(http.post("/tokenize", json={"prompt": "a", "model": "x"}), 404,
                        "model")
    assert_openai_error(http.post("/detokenize", json={}), 400, "tokens")
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_openai_error(http.post("/detokenize", json={"tokens": "12"}), 400, "tokens")
    assert http.post("/tokenize", json={"prompt": "a", "unknown": 1}).status_code == 200
    assert http.post("/detokenize", json={"tokens": [], "unknown": 1}).json() == {"prompt": ""}


def test_empty_prompts_get_a_400_naming_the_prompt_and_empty_messages_an_answer(server):
    """An empty completion prompt has no token to generate from: 400 on
    ``prompt``. An empty chat message is not an empty prompt (the template
    wraps it in role tokens): it is answered, one token for ``max_tokens: 1``
    (a message with no ``content`` at all is a 400, the test below)."""
    requests = [(COMPLETIONS, {"prompt": ""}, 400), (COMPLETIONS, {"prompt": [[]]}, 400),
                (CHAT, {"messages": [{"role": "user", "content": ""}]}, 200),
                (CHAT, {"messages": [{"role": "user", "content": []}]}, 200),
                (CHAT, {"messages": [{"role": "system", "content": ""}]}, 200)]

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=300) as client:
            return await asyncio.gather(*(client.post(p, json={**b, "max_tokens": 1})
                                          for p, b, _ in requests))

    for (_, body, status), r in zip(requests, asyncio.run(go())):
        if status == 200:
            assert r.status_code == 200, (body, r.text)
            assert r.json()["usage"]["completion_tokens"] == 1, body
        else:
            assert_openai_error(r, 400, "prompt")
            assert r.json()["error"]["message"] == "the prompt is empty", body


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


@pytest.mark.parametrize("messages,index,why", [
    ([{"role": "user", "contnet": "hi"}], 0, "a user message needs 'content'"),
    ([{"role": "user"}], 0, "a user message needs 'content'"),
    ([{"role": "user", "content": None}], 0, "a user message needs 'content'"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user"}], 1,
     "a user message needs 'content'"),
    ([{"role": "developer"}, {"role": "user", "content": "hi"}], 0,
     "a developer message needs 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
      {"role": "user", "content": "and?"}], 1,
     "an assistant message needs 'content' or 'tool_calls'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_1"}], 2, "a tool message needs 'content'"),
], ids=["misspelt", "absent", "null", "second", "developer", "assistant", "tool"])
def test_a_message_without_content_is_a_400_naming_it(http, messages, index, why):
    """OpenAI requires ``content`` in every turn but an assistant turn with
    ``tool_calls``; a misspelt key must not become an empty turn that gets an answer."""
    for path in (CHAT, "/tokenize"):
        r = http.post(path, json={"messages": messages, "max_tokens": 1})
        error = assert_openai_error(r, 400, "messages")
        assert error["code"] == "missing_required_parameter", error
        assert error["message"] == f"'messages[{index}].content' is a required field: {why}"


def test_an_assistant_turn_with_tool_calls_needs_no_content(http):
    for assistant in ({"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "assistant", "tool_calls": [CALL]}):
        messages = [{"role": "user", "content": "Weather in Oslo?"}, assistant,
                    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
        r = http.post(CHAT, json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


# -- authentication --------------------------------------------------------------------------------

PROTECTED = [("POST", CHAT, {**BASE[CHAT], "max_tokens": 1}),
             ("POST", COMPLETIONS, {**BASE[COMPLETIONS], "max_tokens": 1}),
             ("GET", "/v1/models", None), ("GET", "/v1/engine/stats", None),
             ("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "a"}),
             ("POST", "/detokenize", {"tokens": [1]}), ("POST", "/reset_prefix_cache", None),
             ("GET", "/v1/nope", None)]


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_every_endpoint_but_health_needs_the_key(server, method, path, body):
    url = server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key},
                    {"Authorization": f"Basic {server.api_key}"},
                    {"Authorization": f"Bearer {server.api_key}x"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert_openai_error(r, 401, None)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, url, json=body, headers=server.headers, timeout=120)
    assert r.status_code == (404 if path == "/v1/nope" else 200), r.text
    # The auth scheme is case-insensitive (RFC 9110 §11.1).
    r = httpx.request(method, url, json=body, timeout=120,
                      headers={"Authorization": f"bearer  {server.api_key}"})
    assert r.status_code == (404 if path == "/v1/nope" else 200), r.text


METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completion", "/nope", "/v1/"])
def test_unknown_route_is_an_openai_404_for_every_method(http, method, path):
    """Regression: the chat page's catch-all mount answered 405 to a POST (or any
    method but GET) on an unknown path, so ``POST /v1/embeddings`` looked like a
    known route."""
    r = http.request(method, path, json={"input": "Hi"} if method in ("POST", "PUT") else None)
    assert r.status_code == 404, r.text
    if method != "HEAD":  # no body by definition
        error = assert_openai_error(r, 404, None)
        assert error["code"] == "unknown_route"
        assert method in error["message"] and path in error["message"]


@pytest.mark.parametrize("method,path,allowed", [
    ("GET", CHAT, "POST"), ("PUT", COMPLETIONS, "POST"), ("DELETE", "/v1/models", "GET, HEAD"),
    ("POST", "/health", "GET, HEAD"), ("GET", "/tokenize", "POST")])
def test_wrong_method_on_a_known_route_is_an_openai_405(http, method, path, allowed):
    r = http.request(method, path)
    error = assert_openai_error(r, 405, None)
    assert error["code"] == "method_not_allowed"
    assert r.headers["allow"] == allowed


def test_bearer_token_parsing():
    from aioengine.entrypoints.protocol import bearer_token

    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token(b"BEARER abc") == "abc"
    assert bearer_token("bearer   a b") == "a b"
    for value in (None, "", "abc", "Bearer", "Bearer ", "Basic abc", "Bearerabc"):
        assert bearer_token(value) is None, value


def test_health_needs_no_key(server):
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def _ws_exchange(url: str, messages: list[dict], headers: dict | None = None
                 ) -> tuple[dict, list[dict]]:
    """Connect, send each message and collect one reply per message (a ``done``
    or ``error`` for requests)."""
    async def go():
        async with websockets.connect(url, additional_headers=headers or {}) as ws:
            hello = json.loads(await ws.recv())
            replies = []
            for m in messages:
                await ws.send(json.dumps(m))
                while True:
                    reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if reply["type"] != "delta":
                        break
                replies.append(reply)
            return hello, replies

    return asyncio.run(go())


def test_websocket_refuses_everything_but_auth_and_ping_without_the_key(server):
    chat = {"type": "chat", "id": "c", "messages": MESSAGES, "max_tokens": 2}
    messages = [chat, {"type": "completion", "id": "p", "prompt": "Hi", "max_tokens": 2},
                {"type": "subscribe_stats"}, {"type": "cancel", "id": "c"},
                {"type": "unsubscribe_stats"}, {"type": "ping"},
                {"type": "auth", "api_key": server.api_key + "x"}, {"type": "auth"},
                {"type": "auth", "api_key": 5}]
    for suffix in ("", "?api_key=wrong", "?api_key="):
        hello, replies = _ws_exchange(server.ws_url + suffix, messages,
                                      {"Authorization": "Bearer wrong"})
        assert hello["auth_required"] is True
        assert [r["type"] for r in replies] == ["error"] * 5 + ["pong"] + ["error"] * 3
        assert all(r["code"] == 401 for r in replies if r["type"] == "error")
        assert [r.get("id") for r in replies[:2]] == ["c", "p"]


def test_websocket_accepts_the_key_in_each_documented_way(server):
    chat = {"type": "chat", "id": "c", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    ways = [(server.ws_url_with_key, None, [chat]),
            (server.ws_url, {"Authorization": f"Bearer {server.api_key}"}, [chat]),
            (server.ws_url, {"Authorization": f"bearer {server.api_key}"}, [chat]),
            (server.ws_url, None, [{"type": "auth", "api_key": server.api_key}, chat])]
    for url, headers, messages in ways:
        hello, replies = _ws_exchange(url, messages, headers)
        assert hello["auth_required"] is (messages[0]["type"] == "auth")
        assert replies[-1]["type"] == "done" and replies[-1]["usage"]["completion_tokens"] == 1


# -- random and malformed bodies (hypothesis) ----------------------------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=10)
# Token counts stay small (or invalid) so a valid random request costs a few steps.
COUNT = st.one_of(st.integers(-2, 3), st.sampled_from([0, 10**7, 2**64, "3", 1.5, True, [],
                                                       {}]))
RAW_BODIES = st.sampled_from([b"", b"{", b"null", b"[]", b'"text"', b"42", b"\xff\xfe\x00",
                              b'{"prompt": "a", "temperature": NaN}',
                              b'{"prompt": "a", "max_tokens": Infinity}',
                              b'{"messages": [{"role": "user", "content": "a"}], "n": 1e400}',
                              b'{"prompt": "a", "prompt": [1]}', b'{"tokens": [1,]}',
                              b"\x00" * 64, "{\"prompt\": \"\ud800\"}".encode("utf-8",
                                                                         "surrogatepass")])


def either(strategy):
    """The field's plausible values, or any JSON value."""
    return st.one_of(strategy, strategy, JSON_VALUES)


ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot", ""])
CONTENT = st.one_of(st.text(max_size=30), st.none(), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}),
    max_size=2))
MESSAGE = st.fixed_dictionaries({"role": either(ROLES), "content": either(CONTENT)},
                                optional={"name": either(st.text(max_size=5))})
TOKEN_ID = st.integers(-3, 50000)
SAMPLING_FIELDS = {
    "model": either(st.sampled_from(["SmolLM2-135M-Instruct", "gpt-4"])),
    "n": COUNT, "temperature": either(st.floats(-1, 3)), "top_p": either(st.floats(-0.5, 1.5)),
    "top_k": either(st.integers(-3, 60000)), "min_p": either(st.floats(-0.5, 1.5)),
    "presence_penalty": either(st.floats(-3, 3)), "frequency_penalty": either(st.floats(-3, 3)),
    "repetition_penalty": either(st.floats(-1, 12)),
    "seed": either(st.integers(-(2**64), 2**64)),
    "stop": either(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=18)),
    "stop_token_ids": either(st.lists(TOKEN_ID, max_size=3)),
    "include_stop_str_in_output": either(st.booleans()), "ignore_eos": either(st.booleans()),
    "min_tokens": COUNT, "max_tokens": COUNT,
    "logit_bias": either(st.dictionaries(st.text("-0123456789_ ", max_size=6),
                                         st.floats(-150, 150), max_size=3)),
    "skip_special_tokens": either(st.booleans()), "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries(
        {}, optional={"include_usage": either(st.booleans())})),
    "priority": either(st.integers(-5, 5)), "cache_salt": either(st.text(max_size=4)),
    "user": either(st.text(max_size=4)),
}
CHAT_FIELDS = {**SAMPLING_FIELDS, "max_completion_tokens": COUNT,
               "logprobs": either(st.booleans()), "top_logprobs": either(st.integers(-2, 22)),
               "add_generation_prompt": either(st.booleans()),
               "continue_final_message": either(st.booleans()),
               "tools": either(st.lists(JSON_VALUES, max_size=1)),
               "response_format": either(st.fixed_dictionaries(
                   {"type": st.sampled_from(["text", "json_object"])}))}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "echo": either(st.booleans()),
                     "logprobs": either(st.integers(-2, 22)), "suffix": either(st.text(max_size=3)),
                     "best_of": COUNT}
PROMPT = st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                   st.lists(TOKEN_ID, max_size=8),
                   st.lists(st.lists(TOKEN_ID, max_size=5), max_size=3))


def body_strategy(required: dict, fields: dict):
    objects = st.fixed_dictionaries({}, optional={**required, **fields})
    return st.one_of(objects, objects, objects, JSON_VALUES, RAW_BODIES,
                     st.binary(max_size=40))


BODIES = {
    CHAT: body_strategy({"messages": either(st.lists(MESSAGE, max_size=3))}, CHAT_FIELDS),
    COMPLETIONS: body_strategy({"prompt": either(PROMPT)}, COMPLETION_FIELDS),
    "/tokenize": body_strategy({"prompt": either(st.text(max_size=40)),
                                "messages": either(st.lists(MESSAGE, max_size=3))},
                               {"model": SAMPLING_FIELDS["model"],
                                "add_special_tokens": either(st.booleans()),
                                "add_generation_prompt": either(st.booleans()),
                                "return_token_strs": either(st.booleans())}),
    "/detokenize": body_strategy({"tokens": either(st.lists(TOKEN_ID, max_size=10))},
                                 {"model": SAMPLING_FIELDS["model"]}),
}


def _bounded(path: str, body):
    """Keep valid random generations short: no null/absent max_tokens."""
    if (path in (CHAT, COMPLETIONS) and isinstance(body, dict)
            and body.get("max_tokens") is None and body.get("max_completion_tokens") is None):
        body = {**body, "max_tokens": 2}
    return body


def _encode(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert isinstance(r.json(), dict)


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path", list(BODIES))
def test_random_bodies_never_get_a_5xx(http, path):
    @FUZZ
    @given(body=BODIES[path])
    def check(body):
        r = http.post(path, content=_encode(_bounded(path, body)),
                      headers={"Content-Type": "application/json"})
        _check_answer(r)

    check()


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/models", "/health", "/v1/engine/stats", "/metrics",
                             "/tokenize", "/detokenize", CHAT, COMPLETIONS, "/v1/x", "/v1/"]),
       query=st.dictionaries(st.sampled_from(["block_map", "model", "x"]),
                             st.text(max_size=6), max_size=2),
       body=st.binary(max_size=30))
def test_random_methods_paths_and_queries_never_get_a_5xx(http, method, path, query, body):
    if method == "POST" and path in (CHAT, COMPLETIONS):
        body = b"{"  # a valid random body would generate; covered above
    r = http.request(method, path, params=query, content=body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)


WS_MESSAGES = st.one_of(
    st.fixed_dictionaries({"type": st.just("chat"), "id": either(st.text(max_size=4))},
                          optional={"messages": either(st.lists(MESSAGE, max_size=2)),
                                    **CHAT_FIELDS}),
    st.fixed_dictionaries({"type": st.just("completion"), "id": either(st.text(max_size=4))},
                          optional={"prompt": either(PROMPT), **COMPLETION_FIELDS}),
    st.fixed_dictionaries({"type": either(st.sampled_from(["cancel", "ping", "auth", "x"]))},
                          optional={"id": JSON_VALUES, "api_key": JSON_VALUES}),
    JSON_VALUES, RAW_BODIES.map(lambda b: b.decode("utf-8", "replace")))


def test_random_websocket_messages_get_answers_and_keep_the_socket(server):
    """Every message gets its reply (``error``, ``pong``, ``auth_ok`` or a request
    ending in ``done``), never a 5xx code, and the socket stays open."""
    async def exchange(ws, message) -> list[dict]:
        if isinstance(message, dict) and message.get("type") in ("chat", "completion"):
            message = _bounded(CHAT, message)
            # Unique ids, so each reply can be told apart from earlier requests'.
            if isinstance(message.get("id"), str) and message["id"]:
                message["id"] = f"{message['id']}-{exchange.count}"
        exchange.count += 1
        await ws.send(message if isinstance(message, str) else json.dumps(message))
        replies = []
        while True:
            reply = json.loads(await asyncio.wait_for(ws.recv(), 120))
            replies.append(reply)
            if reply["type"] in ("error", "pong", "auth_ok", "done"):
                return replies

    exchange.count = 0

    async def main(messages):
        async with websockets.connect(server.ws_url_with_key) as ws:
            await ws.recv()  # hello
            for message in messages:
                for reply in await exchange(ws, message):
                    assert reply["type"] in ("delta", "done", "error", "pong", "auth_ok")
                    if reply["type"] == "error":
                        assert reply["code"] < 500 and reply["message"], reply
            await ws.send(json.dumps({"type": "ping"}))
            assert json.loads(await ws.recv()) == {"type": "pong"}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(messages=st.lists(WS_MESSAGES, min_size=1, max_size=3))
    def check(messages):
        asyncio.run(main(messages))

    check()


def test_server_is_healthy_and_idle_after_the_random_input(server, http):
    r = http.post(CHAT, json={"messages": [{"role": "user", "content":
                                            "What is the capital of France?"}],
                              "temperature": 0, "max_tokens": 12})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    stats = server.wait_for_stats(lambda s: s["num_running"] + s["num_waiting"] == 0, 5.0)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_kv_blocks_used"] == 0
