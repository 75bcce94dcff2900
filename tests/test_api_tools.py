"""Tool calling against the real server (``conftest.server``) with the
``openai`` client: forced calls (``tool_choice`` ``required`` and a named
function) parse and validate against the tool's parameter schema on varied
prompts, streamed ``delta.tool_calls`` join to the non-streamed call, a
history with an assistant call and a tool result renders and is answered,
``auto``/``none`` leave a plain answer alone, and the WebSocket carries calls.
The model is weak: the calls parse because the grammar forces them."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
import websockets
from pydantic import BaseModel, Field


class Weather(BaseModel):
    city: str = Field(min_length=1, max_length=20)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class Search(BaseModel):
    query: str = Field(min_length=1, max_length=30)
    limit: int = Field(ge=1, le=10)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "web_search", "description": "Search the web",
                                      "parameters": Search.model_json_schema()}},
]
MODELS = {"get_weather": Weather, "web_search": Search}
PROMPTS = ["What's the weather in Paris?", "Find me a cake recipe.", "Will it rain in Oslo?",
           "Who won the 2018 World Cup?", "Hello there!", "Forecast for Lima this week",
           "Search for cheap flights.", "Is it hot in Kyoto?"]


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.base_url}/v1/models", headers=server.headers).json()["data"][0]["id"]


def client_for(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                              max_retries=0, timeout=300)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_call(call, allowed: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in allowed
    MODELS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "web_search"}}],
    ids=["required", "named"])
def test_forced_calls_parse_and_validate_on_varied_prompts(server, model, tool_choice):
    async def go():
        client = client_for(server)
        return await asyncio.gather(*(client.chat.completions.create(
            model=model, messages=chat(p), tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=80, temperature=1.0 if i % 2 else 0.0, seed=i)
            for i, p in enumerate(PROMPTS)))

    allowed = {"web_search"} if isinstance(tool_choice, dict) else set(MODELS)
    for prompt, r in zip(PROMPTS, asyncio.run(go())):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (prompt, choice.message)
        assert len(choice.message.tool_calls) == 1, (prompt, choice.message)
        check_call(choice.message.tool_calls[0], allowed)


def test_streamed_tool_call_deltas_join_to_the_non_streamed_call(server, model):
    async def go():
        client = client_for(server)
        kwargs = dict(model=model, messages=chat("What's the weather in Paris?"), tools=TOOLS,
                      tool_choice="required", max_tokens=120, temperature=0)
        whole = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(**kwargs, stream=True)
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for d in chunk.choices[0].delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls, "id and name come once per call"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
        return whole, calls, finish

    whole, calls, finish = asyncio.run(go())
    expected = [(c.function.name, c.function.arguments)
                for c in whole.choices[0].message.tool_calls]
    assert expected and [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    for call in whole.choices[0].message.tool_calls:
        check_call(call, set(MODELS))


HISTORY = [
    {"role": "user", "content": "What's the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_abc", "type": "function",
        "function": {"name": "get_weather",
                     "arguments": '{"city": "Oslo", "unit": "celsius", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "-3 degrees and snowing"},
]


def test_a_history_with_a_tool_result_renders_and_is_answered(server, model):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as http:
        r = http.post("/tokenize", json={"messages": HISTORY, "return_token_strs": False})
        assert r.status_code == 200, r.text
        text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in text
        assert "<tool_response>\n-3 degrees and snowing\n</tool_response>" in text
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": HISTORY, "tools": TOOLS, "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] or message["tool_calls"]
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": HISTORY, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 80, "temperature": 0})
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text


def test_tools_reach_the_prompt_and_none_leaves_them_out(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as http:
        def prompt(**extra) -> str:
            r = http.post("/v1/chat/completions", json={
                "messages": chat("hi"), "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain = prompt()
        assert prompt(tools=TOOLS) > plain + 50
        assert prompt(tools=TOOLS, tool_choice="none") == plain


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_bad_tool_requests_are_400(server, extra, param):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": chat("hi"), "max_tokens": 2,
                                                    **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_the_websocket_streams_tool_calls(server):
    async def go():
        async with websockets.connect(server.ws_url_with_key) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            await ws.send(json.dumps({
                "type": "chat", "id": "t", "messages": chat("Weather in Lima?"), "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "max_tokens": 80, "temperature": 0}))
            arguments, names = "", []
            while True:
                m = json.loads(await ws.recv())
                if m["type"] == "delta":
                    for d in m.get("tool_calls", []):
                        if "id" in d:
                            names.append(d["function"]["name"])
                        arguments += d["function"]["arguments"]
                elif m["type"] in ("done", "error"):
                    return m, names, arguments

    done, names, arguments = asyncio.run(go())
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", done
    assert names == ["get_weather"]
    assert [c["function"]["arguments"] for c in done["tool_calls"]] == [arguments]
    Weather.model_validate_json(arguments)
