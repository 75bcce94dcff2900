"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``
(real server, default model): ``n`` beams come back as ``n`` choices, best first,
equal to HF transformers' beams; ``best_of`` equal to ``n`` is accepted; streaming
and the settings beam search cannot honour are 400s naming the field; /metrics
counts the copy-on-write copies and shared blocks.
"""

from __future__ import annotations

import httpx
import pytest
from beam_parity import hf_beam_search
from conftest import post_all
from parity import hf_model
from reliability_util import metric

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "The three primary colours are"


def test_completions_and_chat_return_hf_beams(server):
    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    tok = load_tokenizer(default_model_path())
    messages = [{"role": "user", "content": "Name a fruit."}]
    comp, chat = post_all(
        server,
        (COMPLETIONS, {"prompt": PROMPT, "use_beam_search": True, "n": 2, "best_of": 2,
                       "max_tokens": 12, "temperature": 0, "length_penalty": 1.0}),
        (CHAT, {"messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 12,
                "early_stopping": True}))
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
    for body, prompt_ids, es, key in ((comp, tok.encode(PROMPT), False, "text"),
                                      (chat, list(chat_ids), True, "message")):
        ref, _ = hf_beam_search(hf_model(), prompt_ids, 2, 12, 1.0, es, tok.eos_token_id)
        texts = [c["text"] if key == "text" else c["message"]["content"]
                 for c in sorted(body["choices"], key=lambda c: c["index"])]
        expected = [tok.decode(r[:-1] if r[-1] == tok.eos_token_id else r,
                               skip_special_tokens=True) for r in ref]
        assert texts == expected, (texts, expected)
        reasons = [c["finish_reason"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        assert reasons == ["stop" if r[-1] == tok.eos_token_id else "length" for r in ref]
        assert body["usage"]["completion_tokens"] == sum(len(r) for r in ref)
    scrape = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=30).text
    assert metric(scrape, "aioengine:kv_cow_copies_total") >= 2
    assert metric(scrape, "aioengine:num_kv_blocks_shared") >= 0


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"n": 0}, "n"),
    # Widths past SamplingParams' n bound killed the worker (topk past the
    # vocabulary, output ring overflow, msgpack int overflow): a 400 now.
    ({"n": 1000}, "n"),
    ({"n": 2**63}, "n"),
    ({"stop": ["."]}, "stop"),
    ({"top_p": 0.5}, "top_p"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
])
def test_unsupported_beam_settings_are_400(server, path, extra, param):
    body = {"use_beam_search": True, "n": 2, "max_tokens": 4, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    r = httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_best_of_other_than_n_is_400(server):
    r = httpx.post(server.base_url + COMPLETIONS, headers=server.headers, timeout=60,
                   json={"prompt": PROMPT, "use_beam_search": True, "n": 2, "best_of": 4,
                         "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
