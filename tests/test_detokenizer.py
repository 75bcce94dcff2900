"""Incremental detokenization and stop strings on the real tokenizer."""

from __future__ import annotations

import pytest

from aioengine.config import default_model_path
from aioengine.engine.detokenizer import IncrementalDetokenizer
from aioengine.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def stream(tok, text: str, stop: list[str], include: bool = False):
    d = IncrementalDetokenizer(tok.backend_tokenizer, stop, include)
    deltas = []
    ids = tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        hit = d.update(t)
        deltas.append(d.get_delta(finished=hit or i == len(ids) - 1))
        if hit:
            break
    return d, deltas


def test_multibyte_text_never_splits_a_character(tok):
    text = "日本語のテキスト 🙂🎉 emoji and 中文字符 done"
    _, deltas = stream(tok, text, [])
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    assert len([x for x in deltas if x]) > 5


def test_stop_string_spanning_tokens_never_leaks(tok):
    text = "The answer is forty-two. STOP_HERE and more text after"
    d, deltas = stream(tok, text, ["STOP_HERE"])
    joined = "".join(deltas)
    assert joined == "The answer is forty-two. "
    assert d.stop_reason == "STOP_HERE"
    for x in deltas:
        assert "STOP" not in x and "_HERE" not in x


def test_held_back_text_is_released_without_a_match(tok):
    text = "Stopping is not STOP_HER"
    _, deltas = stream(tok, text, ["STOP_HERE"])
    assert "".join(deltas) == text
    # Something was held back at some point, then released.
    assert any(x == "" for x in deltas[:-1])


def test_include_stop_str_in_output(tok):
    _, deltas = stream(tok, "one two three four", [" three"], include=True)
    assert "".join(deltas) == "one two three"
