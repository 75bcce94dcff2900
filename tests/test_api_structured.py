"""Structured outputs against the real server (``conftest.server``) with the
``openai`` client: ``response_format`` (``json_schema`` through
``chat.completions.parse`` and a pydantic model, ``json_object``), vLLM's
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
``structured_outputs``, on chat, completions and the WebSocket.

The default model is small and weak: every check here holds only because the
grammar holds. Prompts are 20 varied questions, none chosen to pass; each
group runs concurrently, so constrained requests share steps.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import openai
import pytest
import websockets
from openai.lib._parsing._completions import type_to_response_format_param
from parity import assert_greedy_parity
from pydantic import BaseModel, Field

PROMPTS = [
    "Describe a pet.", "Tell me about your neighbour's animal.", "Invent a zoo resident.",
    "Who lives in the barn?", "Write a record for an adopted animal.", "Hi!",
    "What is the capital of France?", "List three fruits.", "A pet that travels a lot.",
    "Summarise the plot of a film.", "An animal from a fairy tale.", "Translate 'cat' to German.",
    "What do birds eat?", "Make up a character for a story.", "Register a new patient at a vet.",
    "Explain gravity to a child.", "Your favourite animal?", "2 + 2 = ?",
    "Write a haiku about dogs.", "Profile a very old tortoise.",
]


class Owner(BaseModel):
    city: Literal["Paris", "Oslo", "Lima", "Kyoto"]
    rating: float = Field(ge=0, le=5)


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    kind: Literal["cat", "dog", "bird", "fish"]
    age: int = Field(ge=0, le=30)
    tags: list[Literal["cute", "old", "loud", "shy"]] = Field(max_length=3)
    owner: Owner


@pytest.fixture(scope="module")
def client(server):
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                              max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server):
    r = httpx.get(f"{server.base_url}/v1/models", headers=server.headers)
    return r.json()["data"][0]["id"]


def run(coro):
    return asyncio.run(coro)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_validates_on_20_prompts_streamed_and_not_greedy_and_sampled(server, model):
    """Prompt i runs as variant i % 4: parse() greedy, parse() sampled, streamed
    greedy, streamed sampled; all 20 at once."""
    response_format = type_to_response_format_param(Pet)

    async def streamed(client, i, prompt, temperature):
        stream = await client.chat.completions.create(
            model=model, messages=chat(prompt), response_format=response_format,
            max_tokens=100, temperature=temperature, seed=i, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish, Pet.model_validate_json(text) if finish == "stop" else None

    async def parsed(client, i, prompt, temperature):
        r = await client.chat.completions.parse(
            model=model, messages=chat(prompt), response_format=Pet, max_tokens=100,
            temperature=temperature, seed=i)
        choice = r.choices[0]
        return choice.message.content, choice.finish_reason, choice.message.parsed

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                                    max_retries=0, timeout=300)
        return await asyncio.gather(*(
            (parsed if i % 4 < 2 else streamed)(client, i, p, 0.0 if i % 2 == 0 else 1.0)
            for i, p in enumerate(PROMPTS)))

    for prompt, (text, finish, pet) in zip(PROMPTS, run(go())):
        assert finish == "stop", (prompt, text)
        assert isinstance(pet, Pet), (prompt, text)


def test_json_object_on_both_endpoints_parses(server, model):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                                    max_retries=0, timeout=300)
        fmt = {"type": "json_object"}
        chats = [client.chat.completions.create(model=model, messages=chat(p), max_tokens=80,
                                                temperature=0, response_format=fmt)
                 for p in PROMPTS[:10]]
        completions = [client.completions.create(model=model, prompt=p, max_tokens=80,
                                                 temperature=0,
                                                 extra_body={"response_format": fmt})
                       for p in PROMPTS[10:]]
        return await asyncio.gather(*chats), await asyncio.gather(*completions)

    chats, completions = run(go())
    texts = [(r.choices[0].message.content, r.choices[0].finish_reason) for r in chats]
    texts += [(r.choices[0].text, r.choices[0].finish_reason) for r in completions]
    # The grammar cannot bound a free-form object, and this model may ramble in a
    # string until max_tokens; a cut answer must still be a JSON object's start.
    for text, finish in texts:
        assert text.startswith("{"), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
    assert sum(finish == "stop" for _, finish in texts) >= len(texts) // 2, texts


GRAMMAR = r'''root ::= "(" num " " op " " num ")"
num ::= [1-9] [0-9]?
op ::= "+" | "-" | "*"'''
GRAMMAR_RE = r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)"
CONSTRAINTS = [
    pytest.param({"guided_regex": r"[A-Z][a-z]{1,8}-[0-9]{2,4}"},
                 r"[A-Z][a-z]{1,8}-[0-9]{2,4}", id="guided_regex"),
    pytest.param({"guided_choice": ["red", "green", "blue", "light blue"]},
                 r"red|green|blue|light blue", id="guided_choice"),
    pytest.param({"guided_grammar": GRAMMAR}, GRAMMAR_RE, id="guided_grammar"),
    pytest.param({"structured_outputs": {"regex": r"(yes|no), [0-9]{1,3}%"}},
                 r"(yes|no), [0-9]{1,3}%", id="structured_outputs-regex"),
]


@pytest.mark.parametrize(("body", "pattern"), CONSTRAINTS)
def test_guided_constraints_hold_on_20_prompts(server, model, body, pattern):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                                    max_retries=0, timeout=300)
        chats = [client.chat.completions.create(
            model=model, messages=chat(p), max_tokens=24, temperature=1.0, seed=i,
            extra_body=body) for i, p in enumerate(PROMPTS[:14])]
        completions = [client.completions.create(model=model, prompt=p, max_tokens=24,
                                                 temperature=0, extra_body=body)
                       for p in PROMPTS[14:]]
        return await asyncio.gather(*chats), await asyncio.gather(*completions)

    chats, completions = run(go())
    results = [(r.choices[0].message.content, r.choices[0].finish_reason) for r in chats]
    results += [(r.choices[0].text, r.choices[0].finish_reason) for r in completions]
    for text, finish in results:
        assert finish == "stop", text
        assert re.fullmatch(pattern, text), text


def test_max_tokens_cuts_a_constrained_answer_with_length_and_a_valid_prefix(server, model):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                                    max_retries=0, timeout=300)
        return await client.chat.completions.create(
            model=model, messages=chat("Describe a pet."), max_tokens=6, temperature=0,
            response_format=type_to_response_format_param(Pet))

    r = run(go())
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    text = r.choices[0].message.content
    assert text.startswith('{"name": "'), text


def test_n_samples_are_each_constrained(server, model):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                                    max_retries=0, timeout=300)
        return await client.chat.completions.create(
            model=model, messages=chat("Pick a colour."), max_tokens=8, temperature=1.0,
            n=4, seed=3, extra_body={"guided_choice": ["red", "green", "blue"]})

    r = run(go())
    assert len(r.choices) == 4
    assert all(c.message.content in ("red", "green", "blue") for c in r.choices)


def test_free_requests_in_a_mixed_batch_get_the_same_greedy_tokens(server, model):
    """Constrained and free requests in the same steps: the mask touches only
    constrained rows, so the free ones match their solo runs (near-tie rule)."""
    free_prompts = PROMPTS[:4]

    def body(prompt: str) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "logprobs": 2, "ignore_eos": True}

    async def free(client, prompt):
        r = await client.post("/v1/completions", json=body(prompt))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    async def constrained(client, prompt, i):
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": chat(prompt), "max_tokens": 40, "temperature": 0,
            "guided_regex": r"[a-z]{3,30}", "seed": i})
        assert r.status_code == 200, r.text
        return r.json()

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=300) as client:
            alone = [await free(client, p) for p in free_prompts]
            before = server.stats()["num_multi_request_steps"]
            mixed = await asyncio.gather(*(free(client, p) for p in free_prompts),
                                         *(constrained(client, p, i)
                                           for i, p in enumerate(PROMPTS[4:12])))
            return alone, mixed[:len(free_prompts)], before

    alone, mixed, before = run(go())
    assert server.stats()["num_multi_request_steps"] > before
    for prompt, a, m in zip(free_prompts, alone, mixed):
        def tokens(choice):
            lp = choice["logprobs"]
            return ([t for t in lp["tokens"]], [sorted(d.values(), reverse=True)[:2]
                                                 for d in lp["top_logprobs"]])
        (ta, topa), (tm, topm) = tokens(a), tokens(m)
        ids_a = [hash(t) for t in ta]
        ids_m = [hash(t) for t in tm]
        assert_greedy_parity(prompt, ids_m, ids_a, topm, topa)


BAD = [
    pytest.param("/v1/chat/completions", {"guided_regex": "(ab"}, "guided_regex",
                 id="regex-unclosed"),
    pytest.param("/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
        "response_format", id="schema-bad-type"),
    pytest.param("/v1/completions", {"guided_json": "{not json"}, "guided_json",
                 id="schema-not-json"),
    pytest.param("/v1/completions", {"guided_grammar": "root ::= undefined_rule"},
                 "guided_grammar", id="grammar-undefined-rule"),
    pytest.param("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
                 "response_format", id="json_schema-without-schema"),
    pytest.param("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["a"]},
                 "guided_choice", id="two-constraints"),
    pytest.param("/v1/completions", {"guided_choice": []}, "guided_choice", id="empty-choice"),
    pytest.param("/v1/chat/completions", {"structured_outputs": {}}, "structured_outputs",
                 id="structured_outputs-empty"),
]


@pytest.mark.parametrize(("path", "extra", "param"), BAD)
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(server, model, path,
                                                                     extra, param):
    body = {"model": model, "max_tokens": 4, **extra}
    body.update({"messages": chat("hi")} if "chat" in path else {"prompt": "hi"})
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        ok = http.post("/v1/completions", json={"model": model, "prompt": "hi",
                                                "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_the_websocket_takes_the_same_fields(server, model):
    async def go():
        async with websockets.connect(server.ws_url_with_key) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            await ws.send(json.dumps({
                "type": "chat", "id": "a", "messages": chat("Describe a pet."),
                "max_tokens": 120, "temperature": 0,
                "response_format": type_to_response_format_param(Pet)}))
            await ws.send(json.dumps({"type": "completion", "id": "b", "prompt": "Colour:",
                                      "max_tokens": 8, "guided_choice": ["red", "blue"]}))
            await ws.send(json.dumps({"type": "chat", "id": "c", "messages": chat("hi"),
                                      "guided_regex": "(x"}))
            done, errors = {}, {}
            while len(done) + len(errors) < 3:
                message = json.loads(await ws.recv())
                if message["type"] == "done":
                    done[message["id"]] = message
                elif message["type"] == "error":
                    errors[message["id"]] = message
            return done, errors

    done, errors = run(go())
    assert done["a"]["finish_reason"] == "stop"
    Pet.model_validate_json(done["a"]["text"])
    assert done["b"]["text"] in ("red", "blue")
    assert errors["c"]["code"] == 400 and errors["c"]["param"] == "guided_regex"


# -- grammar against min_tokens and logit_bias: never a token the grammar forbids ----------

ENDING = [
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "boolean"}}}}, id="json_schema-boolean"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"enum": ["a"]}}}}, id="json_schema-enum"),
    pytest.param({"guided_choice": ["yes", "no"]}, id="guided_choice"),
]


@pytest.mark.parametrize("body", ENDING)
def test_a_complete_grammar_wins_over_min_tokens(server, model, body):
    """A grammar that allows only EOS while ``min_tokens`` bans it: the grammar wins
    (vLLM's rule), so the answer is what it is without ``min_tokens``, ending with EOS
    and ``stop``; before, the sampler got a row of -inf logits and emitted token 0."""
    async def go():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", max_retries=0,
                                      api_key=server.api_key, timeout=300) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=model, messages=chat("Is the sky blue?"), max_tokens=16, logprobs=True,
                temperature=temperature, seed=3, extra_body={**body, **extra})
                for temperature in (0.0, 1.0) for extra in ({}, {"min_tokens": 8})))

    answers = run(go())
    tokens = [[t.token for t in a.choices[0].logprobs.content] for a in answers]
    for a, toks in zip(answers, tokens):
        assert a.choices[0].finish_reason == "stop", toks
        assert toks[-1] == "<|im_end|>" and "<|endoftext|>" not in toks, toks
        assert a.usage.completion_tokens == len(toks) < 8, toks
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3], tokens


def test_logit_bias_against_every_allowed_token_still_gives_an_allowed_one(server, model):
    """-100 on every token a grammar allows leaves them the only finite logits: the
    answer is still one of them (not token 0, not a token outside the grammar)."""
    digits = httpx.post(f"{server.base_url}/tokenize", headers=server.headers,
                        json={"model": model, "prompt": "0123456789",
                              "add_special_tokens": False}).json()["tokens"]
    assert len(digits) == 10  # one token per digit in this vocabulary

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", max_retries=0,
                                      api_key=server.api_key, timeout=300) as client:
            return await asyncio.gather(*(client.completions.create(
                model=model, prompt="My favourite digit is", max_tokens=4, temperature=t,
                seed=1, logit_bias={str(d): -100 for d in digits},
                extra_body={"guided_regex": "[0-9]"}) for t in (0.0, 1.0)))

    for answer in run(go()):
        assert re.fullmatch("[0-9]", answer.choices[0].text), answer.choices[0].text
        assert answer.choices[0].finish_reason == "stop"


def test_min_tokens_with_every_token_a_stop_token_is_a_400(server, model):
    r = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                   json={"model": model, "prompt": "Hi", "max_tokens": 4, "min_tokens": 2,
                         "stop_token_ids": list(range(49152))})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens", r.text
