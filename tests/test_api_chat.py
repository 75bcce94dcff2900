"""Chat prompts and the tokenizer routes against the real server
(``conftest.server``): the model's own chat template for system, user and
assistant turns, ``add_generation_prompt`` and ``continue_final_message``
(vLLM), ``POST /tokenize`` / ``POST /detokenize`` round trips.

The oracle for the template is the model's tokenizer loaded here with
``transformers`` (``apply_chat_template``), the same files the server reads.
"""

from __future__ import annotations


import httpx
from conftest import post_all
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine.config import default_model_path
from aioengine.models.loader import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
    [{"role": "user", "content": "日本語で答えて 🙂"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def detokenize(http, tokens: list[int]) -> str:
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_renders_the_models_chat_template(http, tokenizer, messages,
                                                   add_generation_prompt):
    expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    body = tokenize(http, messages=messages, add_generation_prompt=add_generation_prompt)
    assert detokenize(http, body["tokens"]) == expected
    assert body["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_system_and_assistant_turns_reach_the_prompt(http):
    default = detokenize(http, tokenize(http, messages=CONVERSATIONS[0])["tokens"])
    pirate = detokenize(http, tokenize(http, messages=CONVERSATIONS[1])["tokens"])
    history = detokenize(http, tokenize(http, messages=CONVERSATIONS[2])["tokens"])
    # Without a system message the template adds the model's default one; a
    # system message replaces it.
    assert "<|im_start|>system\n" in default and "You are a pirate." not in default
    assert "<|im_start|>system\nYou are a pirate.<|im_end|>" in pirate
    assert default.split("<|im_end|>")[0] not in pirate
    assert "<|im_start|>assistant\nBlue.<|im_end|>" in history
    assert history.endswith("<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_completion_uses_the_template_prompt(server, http):
    """The chat endpoint's prompt is exactly the template's tokens: same count,
    and the same greedy answer as /v1/completions on those token ids."""
    requests = []
    for messages in CONVERSATIONS[1:3]:
        ids = tokenize(http, messages=messages)["tokens"]
        requests += [("/v1/chat/completions", {"messages": messages, "temperature": 0,
                                               "max_tokens": 6}),
                     ("/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 6})]
    results = post_all(server, *requests)
    for chat, completion in zip(results[::2], results[1::2]):
        assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
        assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_content_parts_equal_a_string(http):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there"}]}]
    string = [{"role": "user", "content": "Hello there"}]
    assert tokenize(http, messages=parts)["tokens"] == tokenize(http, messages=string)["tokens"]


def test_add_generation_prompt_false_leaves_out_the_assistant_header(http):
    messages = CONVERSATIONS[0]
    with_header = tokenize(http, messages=messages)["tokens"]
    without = tokenize(http, messages=messages, add_generation_prompt=False)["tokens"]
    assert with_header[:len(without)] == without
    assert detokenize(http, with_header[len(without):]) == "<|im_start|>assistant\n"
    usage = http.post("/v1/chat/completions", json={
        "messages": messages, "add_generation_prompt": False, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(without)


def test_continue_final_message_continues_the_assistant_turn(server, http):
    """vLLM's ``continue_final_message``: the last (assistant) message stays open
    and the model continues it, instead of a new turn after its end marker."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    closed = tokenize(http, messages=messages, add_generation_prompt=False)["tokens"]
    closed_text = detokenize(http, closed)
    assert closed_text.endswith("The capital of France is<|im_end|>\n")
    open_ids = tokenize(http, prompt=closed_text[:-len("<|im_end|>\n")],
                        add_special_tokens=False)["tokens"]
    assert closed[:len(open_ids)] == open_ids
    chat, completion = post_all(
        server, ("/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                          "temperature": 0, "max_tokens": 4}),
        ("/v1/completions", {"prompt": open_ids, "temperature": 0, "max_tokens": 4}))
    assert chat["usage"]["prompt_tokens"] == len(open_ids)
    answer = chat["choices"][0]["message"]["content"]
    assert answer == completion["choices"][0]["text"]
    assert "Paris" in answer
    # An explicit add_generation_prompt: true cannot also continue the message.
    r = http.post("/v1/chat/completions", json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


# -- /tokenize and /detokenize -------------------------------------------------------------------


def test_tokenize_fields(http, tokenizer):
    body = tokenize(http, prompt="Hello world", return_token_strs=True)
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert "token_strs" not in tokenize(http, prompt="Hello") or \
        tokenize(http, prompt="Hello")["token_strs"] is None
    with_special = tokenize(http, prompt="Hi", add_special_tokens=True)["tokens"]
    plain = tokenize(http, prompt="Hi", add_special_tokens=False)["tokens"]
    assert plain == tokenizer.encode("Hi", add_special_tokens=False)
    assert with_special == tokenizer.encode("Hi", add_special_tokens=True)
    assert tokenize(http, prompt="")["count"] == len(tokenizer.encode(""))


@pytest.mark.parametrize("text", ["日本語のテキスト", "🙂🎉 emoji", "中文字符 and English",
                                  "  spaces  ", "line\nbreaks\ttabs", "<|im_end|> special",
                                  "ÄÖÜ ß café", ""])
def test_tokenize_detokenize_round_trip(http, text):
    tokens = tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    assert detokenize(http, tokens) == text


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_tokenize_and_detokenize_agree_with_the_tokenizer(http, tokenizer, text):
    """Any text: the routes give what the model's tokenizer gives (which is not
    always lossless, e.g. for unassigned code points)."""
    tokens = tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    assert detokenize(http, tokens) == tokenizer.decode(tokens)
