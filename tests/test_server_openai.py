"""The OpenAI-compatible HTTP API, through the real ``openai`` client and raw
HTTP, against a real server subprocess on the default model."""

from __future__ import annotations

import httpx
import openai
import pytest

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                         max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


def test_models_lists_the_served_name(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].object == "model"


def test_chat_answers_capital_of_france(client, model, http):
    reply = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                           max_tokens=32, logprobs=True)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    # Usage: one logprob entry per generated token; prompt = the chat template's tokens.
    prompt = http.post("/tokenize", json={"messages": CAPITAL}).json()
    assert reply.usage.prompt_tokens == prompt["count"]
    assert reply.usage.completion_tokens == len(choice.logprobs.content)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")


def test_streamed_deltas_join_to_the_non_streamed_text(client, model):
    kwargs = {"model": model, "messages": CAPITAL, "temperature": 0, "max_tokens": 32}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks[1:] if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert text == full.choices[0].message.content
    assert token_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    # One chunk per generated token (the final one may carry only the finish reason
    # with the EOS token's empty text).
    assert usage.completion_tokens == len(token_chunks) == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    # The same prompt was just served: its full blocks come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completion_prompt_forms_agree(client, model, http):
    text = "The three primary colors are"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    kw = {"model": model, "temperature": 0, "max_tokens": 5, "logprobs": 0}
    by_string = client.completions.create(prompt=text, **kw)
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_string.id.startswith("cmpl-")
    assert by_string.choices[0].text == by_ids.choices[0].text
    assert by_string.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_string.usage.completion_tokens == len(by_string.choices[0].logprobs.tokens)

    other = "Water boils at"
    many = client.completions.create(prompt=[text, other], **kw)
    many_ids = client.completions.create(
        prompt=[ids, http.post("/tokenize", json={"prompt": other}).json()["tokens"]], **kw)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_string.choices[0].text
    assert [c.text for c in many_ids.choices] == [c.text for c in many.choices]
    assert many.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices)

    # Several prompts streamed at once: chunks interleave, each tagged with its index.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(prompt=[text, other], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in many.choices]


def test_completion_echo_and_stream(client, model):
    prompt = "Once upon a time"
    plain = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4)
    echoed = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4,
                                       echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    stream = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_n_2_gives_two_choices(client, model):
    reply = client.completions.create(model=model, prompt="My favourite animal is", n=2,
                                      temperature=1.0, seed=7, max_tokens=6, logprobs=0)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in reply.choices)
    chat = client.chat.completions.create(model=model, messages=CAPITAL, n=2, temperature=1.0,
                                          seed=3, max_tokens=6)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.content for c in chat.choices)


def test_unknown_model_is_404_openai_shaped(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nope", messages=CAPITAL)
    assert info.value.status_code == 404
    r = http.post("/v1/completions", json={"model": "gpt-nope", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model 'gpt-nope' does not exist",
                                  "type": "not_found_error", "param": "model",
                                  "code": "model_not_found"}}


BAD_CHAT_BODIES = [
    pytest.param(b'{"messages": [', None, id="malformed-json"),
    pytest.param(b'[1, 2]', None, id="not-an-object"),
    pytest.param({"max_tokens": -1}, "max_tokens", id="negative-max-tokens"),
    pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
    pytest.param({"max_completion_tokens": 0}, "max_completion_tokens", id="zero-max-completion"),
    pytest.param({"max_tokens": 10**6}, "max_tokens", id="beyond-context"),
    pytest.param({"temperature": "hot"}, "temperature", id="temperature-string"),
    pytest.param({"temperature": -1}, "temperature", id="negative-temperature"),
    pytest.param({"top_p": 0}, "top_p", id="top-p-zero"),
    pytest.param({"n": 0}, "n", id="n-zero"),
    pytest.param({"stop": 5}, "stop", id="stop-int"),
    pytest.param({"stream": "yes"}, "stream", id="stream-string"),
    pytest.param({"logit_bias": {"abc": 1}}, "logit_bias", id="logit-bias-key"),
    pytest.param({"top_logprobs": 3}, "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param({"messages": []}, "messages", id="no-messages"),
    pytest.param({"messages": [{"role": "robot", "content": "x"}]}, "messages", id="bad-role"),
    pytest.param({"seed": 2**70}, "seed", id="seed-too-big"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT_BODIES)
def test_bad_chat_requests_are_400_with_param(http, body, param):
    if isinstance(body, dict):
        r = http.post("/v1/chat/completions", json={"messages": CAPITAL, **body})
    else:
        r = http.post("/v1/chat/completions", content=body,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [[10**9]]}, "prompt"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({}, "prompt"),
])
def test_bad_completion_requests_are_400(http, body, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openai_client_sees_400_as_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=CAPITAL, top_p=0)
    assert info.value.param == "top_p"


def test_null_means_absent_and_unknown_fields_are_ignored(http):
    r = http.post("/v1/chat/completions", json={
        "messages": CAPITAL, "temperature": 0, "max_tokens": 4, "top_p": None, "stop": None,
        "seed": None, "some_future_field": {"x": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def test_auth_body_limit_and_routes(server, http):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{server.base_url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": CAPITAL})
    assert r.status_code == 401
    r = http.post("/v1/completions", content=b"x" * (9 << 20),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_tokenize_detokenize_round_trip(http):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] > 0
    back = http.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400


def test_metrics_and_stats(http):
    stats = http.get("/v1/engine/stats", params={"block_map": 1}).json()
    assert len(stats["block_usage_map"]) == stats["num_kv_blocks_total"] > 0
    text = http.get("/metrics").text
    assert "aioengine:num_requests_running" in text


def test_server_still_serves_after_bad_input(client, model, http):
    """Bad requests of every kind get their 4xx, and the very next good request
    on the same server is answered correctly."""
    bad = [(b'{"messages": [', 400, None), (b"[1, 2]", 400, None),
           ({"messages": CAPITAL, "max_tokens": 10**9}, 400, "max_tokens"),
           ({"messages": CAPITAL, "temperature": -3}, 400, "temperature"),
           ({"messages": CAPITAL, "logit_bias": {"999999999": 5}}, 400, "logit_bias"),
           ({"messages": "not a list"}, 400, "messages"),
           ({"model": "no-such-model", "messages": CAPITAL}, 404, "model")]
    for body, status, param in bad:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": {"model": model,
                                                                              **body}}
        if isinstance(body, dict) and "model" in body:
            kwargs["json"]["model"] = body["model"]
        r = http.post("/v1/chat/completions", **kwargs)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and (param is None or error["param"] == param), (body, error)
    reply = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                           max_tokens=32)
    assert "Paris" in reply.choices[0].message.content


def test_reset_prefix_cache_route_forgets_cached_blocks(client, model, http):
    """POST /reset_prefix_cache (vLLM's route): after it, a prompt just served is
    computed again from scratch (cached_tokens 0); before it, its blocks hit."""
    messages = [{"role": "user", "content": "List three rivers of Europe, "
                 "one per line, with a short note on each of them."}]

    def cached() -> int:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                           temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert cached() == 0
    assert cached() > 0


def test_reset_prefix_cache_is_409_while_a_request_holds_blocks(server, http, model):
    body = {"model": model, "messages": CAPITAL, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # running, blocks held
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "requests_running"
