"""Every sampling parameter has its effect, on both ``/v1/chat/completions`` and
``/v1/completions``, against the real server (``conftest.server``).

The engine returns logprobs of the model's raw distribution (before penalties,
bias, temperature and truncation), so most tests check each sampled token
against the rule its parameter sets: ``top_k`` keeps the sampled token among
the raw top k, ``min_p`` above ``min_p`` times the top probability, penalties
follow the OpenAI formula exactly. Each such test also runs a control without
the parameter that breaks the rule, so a server that ignores the parameter
fails. Requests of one test run concurrently (one batch) to save steps.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx
from conftest import post_all
import openai
import pytest

from tests.parity import assert_greedy_parity

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
# Open-ended prompts: the next-token distribution is wide enough that sampling
# without a truncation rule regularly picks tokens the rule would forbid.
OPEN = {CHAT: "Write a short story about a cat.",
        COMPLETIONS: "Once upon a time, in a small village,"}
# Prompts whose answer is short (ends with EOS well before 16 tokens).
SHORT = "What is 2+2? Reply with only the number."
EPS = 1e-3  # logprob tolerance: fp32 noise between batch shapes is ~1e-5


@dataclass
class Choice:
    """One choice, the same shape for both endpoints."""

    index: int
    text: str
    tokens: list[str]                       # sampled tokens as strings
    logprobs: list[float]                   # raw logprob of each sampled token
    top: list[list[tuple[str, float]]]      # raw top alternatives, best first
    finish_reason: str | None
    stop_reason: str | int | None


def choices(response: dict) -> list[Choice]:
    out = []
    for c in sorted(response["choices"], key=lambda c: c["index"]):
        if "message" in c:
            entries = (c["logprobs"] or {}).get("content") or []
            out.append(Choice(
                c["index"], c["message"]["content"], [e["token"] for e in entries],
                [e["logprob"] for e in entries],
                [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in entries],
                c["finish_reason"], c["stop_reason"]))
        else:
            lp = c["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
            out.append(Choice(
                c["index"], c["text"], lp["tokens"], lp["token_logprobs"],
                [sorted((d or {}).items(), key=lambda kv: -kv[1]) for d in lp["top_logprobs"]],
                c["finish_reason"], c["stop_reason"]))
    return out


def body(endpoint: str, prompt: str | list | None = None, top: int | None = None,
         **fields) -> tuple[str, dict]:
    """A request for either endpoint; ``top`` asks for that many raw top logprobs."""
    prompt = OPEN[endpoint] if prompt is None else prompt
    if endpoint == CHAT:
        data = {"messages": [{"role": "user", "content": prompt}]}
        if top is not None:
            data |= {"logprobs": True, "top_logprobs": top}
    else:
        data = {"prompt": prompt}
        if top is not None:
            data["logprobs"] = top
    return endpoint, data | fields


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=30,
                   json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def chat_prompt_ids(server, content: str) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=30,
                   json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def sampled(cs: list[Choice]):
    """Every (sampled token, its logprob, top list) of the choices."""
    for c in cs:
        assert len(c.tokens) == len(c.logprobs) == len(c.top) > 0
        yield from zip(c.tokens, c.logprobs, c.top)


def is_argmax(lp: float, top: list[tuple[str, float]]) -> bool:
    return lp >= top[0][1] - EPS


def assert_same_greedy(name: str, a: Choice, b: Choice) -> None:
    """Greedy token sequences equal up to the near-tie rule (DESIGN.md)."""
    assert_greedy_parity(name, a.tokens, b.tokens, [[lp for _, lp in t[:2]] for t in a.top],
                         [[lp for _, lp in t[:2]] for t in b.top])


# -- temperature, top_k, top_p, min_p -------------------------------------------------------


def test_temperature_zero_takes_the_top_token_and_sampling_does_not(server):
    requests = []
    for ep in ENDPOINTS:
        requests += [body(ep, top=5, temperature=0, max_tokens=8, ignore_eos=True),
                     body(ep, top=5, temperature=1.5, seed=1, n=4, max_tokens=8,
                          ignore_eos=True)]
    results = [choices(r) for r in post_all(server, *requests)]
    for greedy, hot in zip(results[::2], results[1::2]):
        assert all(is_argmax(lp, top) for _, lp, top in sampled(greedy))
        assert any(not is_argmax(lp, top) for _, lp, top in sampled(hot))


def test_top_k_keeps_the_k_most_likely_tokens(server):
    requests = []
    for ep in ENDPOINTS:
        requests += [body(ep, top=5, temperature=3.0, top_k=2, seed=2, n=4, max_tokens=8),
                     body(ep, top=5, temperature=3.0, seed=2, n=4, max_tokens=8),
                     body(ep, top=2, temperature=1.0, top_k=1, seed=2, max_tokens=8,
                          ignore_eos=True),
                     body(ep, top=2, temperature=0, max_tokens=8, ignore_eos=True)]
    results = [choices(r) for r in post_all(server, *requests)]
    for k in range(0, len(results), 4):
        top2, control, top1, greedy = results[k:k + 4]
        assert all(lp >= top[1][1] - EPS for _, lp, top in sampled(top2))
        assert any(lp < top[1][1] - EPS for _, lp, top in sampled(control))
        # top_k=1 at temperature 1 is greedy decoding.
        assert_same_greedy("top_k=1 vs greedy", top1[0], greedy[0])


def _mass_above(lp: float, top: list[tuple[str, float]]) -> float:
    """Probability of the listed tokens more likely than the sampled one (a lower
    bound of the mass ranked before it)."""
    return sum(math.exp(x) for _, x in top if x > lp + 1e-6)


def test_top_p_samples_from_the_nucleus(server):
    requests = []
    for ep in ENDPOINTS:
        # temperature 1: the raw logprobs are the distribution top_p truncates.
        requests += [body(ep, top=20, temperature=1.0, top_p=0.5, seed=3, n=4, max_tokens=8),
                     body(ep, top=20, temperature=1.0, seed=3, n=4, max_tokens=8),
                     body(ep, top=2, temperature=1.0, top_p=1e-6, seed=3, max_tokens=8,
                          ignore_eos=True),
                     body(ep, top=2, temperature=0, max_tokens=8, ignore_eos=True)]
    results = [choices(r) for r in post_all(server, *requests)]
    for k in range(0, len(results), 4):
        nucleus, control, tiny, greedy = results[k:k + 4]
        assert all(_mass_above(lp, top) < 0.5 + EPS for _, lp, top in sampled(nucleus))
        assert any(_mass_above(lp, top) >= 0.5 + EPS for _, lp, top in sampled(control))
        assert_same_greedy("top_p=1e-6 vs greedy", tiny[0], greedy[0])


def test_min_p_drops_tokens_below_the_floor(server):
    temperature, min_p = 1.5, 0.3
    requests = []
    for ep in ENDPOINTS:
        requests += [body(ep, top=5, temperature=temperature, min_p=min_p, seed=4, n=4,
                          max_tokens=8),
                     body(ep, top=5, temperature=temperature, seed=4, n=4, max_tokens=8)]
    results = [choices(r) for r in post_all(server, *requests)]

    def ratio(lp: float, top: list[tuple[str, float]]) -> float:
        # p_i / p_max after temperature, from raw logprobs: exp((lp_i - lp_max) / T).
        return (lp - top[0][1]) / temperature

    floor = math.log(min_p)
    for kept, control in zip(results[::2], results[1::2]):
        assert all(ratio(lp, top) >= floor - EPS for _, lp, top in sampled(kept))
        assert any(ratio(lp, top) < floor - EPS for _, lp, top in sampled(control))


# -- penalties --------------------------------------------------------------------------------

REPETITIVE = {CHAT: "Write the word 'apple' twenty times, separated by spaces.",
              COMPLETIONS: "The cat sat. The cat sat. The cat sat. The cat sat."}


def _check_penalized_greedy(c: Choice, presence: float, frequency: float) -> None:
    """Each greedy token maximises raw logprob - frequency * count - presence * seen,
    counted over the tokens generated before it (the OpenAI definition)."""
    counts: dict[str, int] = {}
    for i, (token, lp, top) in enumerate(zip(c.tokens, c.logprobs, c.top)):
        def score(t: str, x: float) -> float:
            n = counts.get(t, 0)
            return x - frequency * n - presence * (n > 0)

        best = max(score(t, x) for t, x in top)
        assert score(token, lp) >= best - EPS, (
            f"token {i} {token!r} is not the penalized argmax; counts {counts}, top {top}")
        counts[token] = counts.get(token, 0) + 1


def test_presence_and_frequency_penalties_follow_the_openai_formula(server):
    requests = []
    for ep in ENDPOINTS:
        common = {"top": 20, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        requests += [body(ep, REPETITIVE[ep], **common),
                     body(ep, REPETITIVE[ep], presence_penalty=1.5, **common),
                     body(ep, REPETITIVE[ep], frequency_penalty=1.0, **common)]
    results = [choices(r)[0] for r in post_all(server, *requests)]
    for k in range(0, len(results), 3):
        plain, presence, frequency = results[k:k + 3]
        # The unpenalized greedy answer repeats itself, and both penalties change it.
        assert max(plain.tokens.count(t) for t in plain.tokens) >= 3, plain.tokens
        assert presence.tokens != plain.tokens and frequency.tokens != plain.tokens
        _check_penalized_greedy(presence, presence=1.5, frequency=0.0)
        _check_penalized_greedy(frequency, presence=0.0, frequency=1.0)
        # And the plain run is what the formula gives without penalties.
        _check_penalized_greedy(plain, presence=0.0, frequency=0.0)


def test_repetition_penalty_discourages_prompt_and_output_tokens(server):
    """CTRL's penalty (over prompt and output) cannot be checked exactly from
    logprobs (it scales logits), so count reuse: a strong penalty leaves far
    fewer repeated tokens than greedy decoding, which copies the prompt."""
    requests = []
    for ep in ENDPOINTS:
        common = {"top": 1, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        requests += [body(ep, REPETITIVE[ep], **common),
                     body(ep, REPETITIVE[ep], repetition_penalty=3.0, **common)]
    results = [choices(r)[0] for r in post_all(server, *requests)]
    for ep, plain, penalized in zip(ENDPOINTS, results[::2], results[1::2]):
        prompt_words = set(re.findall(r"\w+|[^\w\s]", REPETITIVE[ep]))
        assert _reused(plain, prompt_words) >= 6, plain.tokens
        assert _reused(penalized, prompt_words) <= _reused(plain, prompt_words) // 2, (
            plain.tokens, penalized.tokens)


def _reused(c: Choice, prompt_words: set[str]) -> int:
    """Output tokens that repeat a prompt word or an earlier output token."""
    seen: set[str] = set()
    n = 0
    for t in c.tokens:
        n += t in seen or t.strip() in prompt_words
        seen.add(t)
    return n


# -- seed and n -------------------------------------------------------------------------------


def test_seed_is_reproducible_and_sample_i_uses_seed_plus_i(server):
    requests = []
    for ep in ENDPOINTS:
        common = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True}
        requests += [body(ep, seed=11, **common), body(ep, seed=11, **common),
                     body(ep, seed=12, **common), body(ep, seed=13, **common),
                     body(ep, seed=11, n=3, **common)]
    results = post_all(server, *requests)
    for k in range(0, len(results), 5):
        a, again, b, c, fan = (choices(r) for r in results[k:k + 5])
        assert a[0].text == again[0].text
        assert len({a[0].text, b[0].text, c[0].text}) == 3, "different seeds should differ"
        # Documented: sample i of n uses seed + i, so n=3 equals three single requests.
        assert [x.text for x in fan] == [a[0].text, b[0].text, c[0].text]
        assert [x.index for x in fan] == [0, 1, 2]


def test_n_gives_n_independent_indexed_choices(server):
    requests = [body(ep, top=0, temperature=1.0, n=3, max_tokens=6) for ep in ENDPOINTS]
    # Two prompts x n=2 on /v1/completions: choice index = prompt index * n + sample.
    two = ["The ocean is", "My favourite food is"]
    common = {"top": 0, "temperature": 1.0, "seed": 21, "max_tokens": 6, "ignore_eos": True}
    requests += [body(COMPLETIONS, two, n=2, **common), body(COMPLETIONS, two[0], n=2, **common),
                 body(COMPLETIONS, two[1], n=2, **common)]
    results = post_all(server, *requests)
    for r in results[:2]:
        cs = choices(r)
        assert [c.index for c in cs] == [0, 1, 2]
        assert all(c.finish_reason in ("stop", "length") for c in cs)
        assert r["usage"]["completion_tokens"] == sum(len(c.tokens) for c in cs)
        assert len({c.text for c in cs}) >= 2
    both, first, second = (choices(r) for r in results[2:])
    assert [c.index for c in both] == [0, 1, 2, 3]
    assert [c.text for c in both] == [c.text for c in first + second]


# -- stop strings, stop tokens, min_tokens, ignore_eos, max_tokens -----------------------------


def _stop_string_from(text: str) -> str:
    """A stop string cut from the middle of an unconstrained answer (so it is
    really generated), spanning a few characters."""
    middle = len(text) // 2
    stop = text[middle:middle + 5]
    assert stop.strip(), text
    return stop


def test_stop_strings_cut_the_text_and_include_stop_str_in_output(server):
    common = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    bases = post_all(server, *(body(ep, **common) for ep in ENDPOINTS))
    requests = []
    expected = []
    for ep, base in zip(ENDPOINTS, bases):
        text = choices(base)[0].text
        stop = _stop_string_from(text)
        cut = text.find(stop)
        requests += [body(ep, stop=stop, **common),
                     body(ep, stop=[stop], include_stop_str_in_output=True, **common),
                     body(ep, stop=["never-generated-string", stop], **common)]
        expected += [(text[:cut], stop), (text[:cut + len(stop)], stop), (text[:cut], stop)]
    for r, (text, stop) in zip(post_all(server, *requests), expected):
        c = choices(r)[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (text, "stop", stop)
        assert r["usage"]["completion_tokens"] < 16


def test_stop_token_ids_and_min_tokens(server):
    comma = tokenize(server, ",")
    assert len(comma) == 1
    counting = {CHAT: "List the numbers 1 to 10 separated by commas.",
                COMPLETIONS: "1, 2, 3, 4, 5,"}
    common = {"top": 1, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
    requests = []
    for ep in ENDPOINTS:
        requests += [body(ep, counting[ep], **common),
                     body(ep, counting[ep], stop_token_ids=comma, **common),
                     body(ep, counting[ep], stop_token_ids=comma, min_tokens=6, **common)]
    results = [choices(r)[0] for r in post_all(server, *requests)]
    for k in range(0, len(results), 3):
        base, stopped, late = results[k:k + 3]
        first = base.tokens.index(",")
        assert first < 6, base.tokens  # the control makes a comma early
        # The stop token ends the output; its text is kept (documented).
        assert stopped.tokens == base.tokens[:first + 1]
        assert stopped.text == base.text[:base.text.index(",") + 1]
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", comma[0])
        # min_tokens masks the stop token for the first 6 tokens; a later one stops.
        assert "," not in late.tokens[:6] and len(late.tokens) > 6
        if "," in late.tokens:
            assert late.tokens.index(",") == len(late.tokens) - 1
            assert (late.finish_reason, late.stop_reason) == ("stop", comma[0])
        else:
            assert (late.finish_reason, len(late.tokens)) == ("length", 16)


def test_min_tokens_holds_back_eos_and_ignore_eos_runs_to_max_tokens(server):
    # /v1/completions gets the chat template's token ids, so both endpoints
    # see the same short-answer prompt that ends with EOS.
    ids = chat_prompt_ids(server, SHORT)
    requests = []
    for ep, prompt in ((CHAT, SHORT), (COMPLETIONS, ids)):
        requests += [body(ep, prompt, temperature=0, max_tokens=16),
                     body(ep, prompt, temperature=0, max_tokens=16, min_tokens=10),
                     body(ep, prompt, temperature=0, max_tokens=16, ignore_eos=True)]
    results = post_all(server, *requests)
    for k in range(0, len(results), 3):
        base, held, ignored = results[k:k + 3]
        n_base = base["usage"]["completion_tokens"]
        assert choices(base)[0].finish_reason == "stop" and n_base < 10, base
        # EOS is masked for the first 10 tokens: the answer runs past them.
        assert held["usage"]["completion_tokens"] > 10
        assert ignored["usage"]["completion_tokens"] == 16
        assert choices(ignored)[0].finish_reason == "length"


def test_skip_special_tokens_false_keeps_the_eos_text(server):
    ids = chat_prompt_ids(server, SHORT)
    requests = []
    for ep, prompt in ((CHAT, SHORT), (COMPLETIONS, ids)):
        requests += [body(ep, prompt, temperature=0, max_tokens=16),
                     body(ep, prompt, temperature=0, max_tokens=16, skip_special_tokens=False)]
    results = [choices(r)[0] for r in post_all(server, *requests)]
    for skipped, kept in zip(results[::2], results[1::2]):
        assert skipped.finish_reason == kept.finish_reason == "stop"
        assert "<|im_end|>" not in skipped.text
        assert kept.text == skipped.text + "<|im_end|>"


def test_max_tokens_and_max_completion_tokens_bound_the_output(server):
    requests = [body(ep, top=0, temperature=0, max_tokens=1, ignore_eos=True)
                for ep in ENDPOINTS]
    requests += [body(CHAT, temperature=0, max_tokens=9, max_completion_tokens=3,
                      ignore_eos=True),
                 body(COMPLETIONS, temperature=0, ignore_eos=True)]  # OpenAI default 16
    one_chat, one_completion, chat3, default = post_all(server, *requests)
    for r in (one_chat, one_completion):
        c = choices(r)[0]
        assert r["usage"]["completion_tokens"] == 1 == len(c.tokens)
        assert c.finish_reason == "length"
    assert chat3["usage"]["completion_tokens"] == 3  # max_completion_tokens wins
    assert default["usage"]["completion_tokens"] == 16


# -- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_consistent_and_agree_between_endpoints(server):
    ids = chat_prompt_ids(server, OPEN[CHAT])
    chat, completion, none_chat, zero_chat = post_all(
        server, body(CHAT, top=5, temperature=0, max_tokens=8, ignore_eos=True),
        body(COMPLETIONS, ids, top=5, temperature=0, max_tokens=8, ignore_eos=True),
        body(CHAT, temperature=0, max_tokens=2),
        body(CHAT, top=0, temperature=0, max_tokens=2))
    a, b = choices(chat)[0], choices(completion)[0]
    for c in (a, b):
        assert len(c.tokens) == 8 and all(len(t) == 5 for t in c.top)
        for token, lp, top in zip(c.tokens, c.logprobs, c.top):
            assert lp <= 0 and [x for _, x in top] == sorted((x for _, x in top), reverse=True)
            assert sum(math.exp(x) for _, x in top) <= 1 + 1e-4
            assert dict(top)[token] == pytest.approx(lp, abs=1e-6)  # greedy: it is listed
    # The chat is the completion of its template's tokens: same tokens and values.
    assert_same_greedy("chat vs completions", a, b)
    if a.tokens == b.tokens:
        assert a.logprobs == pytest.approx(b.logprobs, abs=EPS)
    assert none_chat["choices"][0]["logprobs"] is None
    entries = zero_chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == 2 and all(e["top_logprobs"] == [] for e in entries)


def test_completion_text_offset_points_at_each_token(server):
    r = post_all(server, body(COMPLETIONS, top=1, temperature=0, max_tokens=8,
                              ignore_eos=True))[0]
    lp = r["choices"][0]["logprobs"]
    text = r["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert text[offset:].startswith(token)


# -- logit_bias ---------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens(server):
    banana = tokenize(server, " banana")
    assert len(banana) == 1
    counting = {CHAT: "Count from 1 to 10.", COMPLETIONS: "1, 2, 3, 4, 5,"}
    bases = [choices(r)[0] for r in post_all(
        server, *(body(ep, counting[ep], top=1, temperature=0, max_tokens=4) for ep in ENDPOINTS))]
    firsts = [tokenize(server, c.tokens[0]) for c in bases]
    assert all(len(f) == 1 for f in firsts), firsts
    requests = []
    for ep, first in zip(ENDPOINTS, firsts):
        requests += [body(ep, counting[ep], top=1, temperature=0, max_tokens=4,
                          logit_bias={str(banana[0]): 100}),
                     body(ep, counting[ep], top=1, temperature=1.0, seed=5, max_tokens=4,
                          logit_bias={str(banana[0]): 100}),
                     body(ep, counting[ep], top=1, temperature=0, max_tokens=4,
                          logit_bias={str(first[0]): -100})]
    results = [choices(r)[0] for r in post_all(server, *requests)]
    for k, base in zip(range(0, len(results), 3), bases):
        forced, forced_sampled, banned = results[k:k + 3]
        assert forced.tokens == [" banana"] * 4 == forced_sampled.tokens
        assert banned.tokens[0] != base.tokens[0]


# -- echo, user, the openai client ---------------------------------------------------------------


def test_echo_prepends_each_prompt(server):
    ids = tokenize(server, "The sky is")
    two = ["Roses are red,", "The sea is"]
    by_ids, many = post_all(
        server, body(COMPLETIONS, ids, temperature=0, max_tokens=3, echo=True),
        body(COMPLETIONS, two, n=2, temperature=1.0, seed=1, max_tokens=3, echo=True))
    assert by_ids["choices"][0]["text"].startswith("The sky is")
    assert len(by_ids["choices"][0]["text"]) > len("The sky is")
    texts = [c.text for c in choices(many)]
    assert [t[:len(two[i // 2])] for i, t in enumerate(texts)] == [two[0], two[0], two[1], two[1]]


def test_user_is_accepted_and_changes_nothing(server):
    requests = []
    for ep in ENDPOINTS:
        requests += [body(ep, temperature=1.0, seed=8, max_tokens=6),
                     body(ep, temperature=1.0, seed=8, max_tokens=6, user="user-1234")]
    results = [choices(r)[0].text for r in post_all(server, *requests)]
    assert results[0] == results[1] and results[2] == results[3]


def test_openai_client_passes_vllm_sampling_fields(server):
    """The ``openai`` package sends vLLM's fields through ``extra_body``."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                           max_retries=0, timeout=120)
    banana = tokenize(server, " banana")[0]
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": SHORT}],
        temperature=0, max_completion_tokens=3, logit_bias={str(banana): 100}, user="u",
        extra_body={"top_k": 5, "min_p": 0.01, "ignore_eos": True, "min_tokens": 3})
    assert chat.choices[0].message.content == " banana" * 3
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", temperature=0, max_tokens=3,
        logprobs=2, extra_body={"stop_token_ids": tokenize(server, ",")})
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].text.endswith(",")
    assert len(completion.choices[0].logprobs.top_logprobs[0]) == 2
