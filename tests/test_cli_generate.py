"""``aioengine generate``: what reaches the engine. ``-`` reads the prompt from
stdin less the one newline ``echo`` ends it with (a prompt ending in a newline
continues differently: the model starts a new line). A stand-in ``LLM``
records the prompt, so no model loads."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

import aioengine
from aioengine.entrypoints import cli


ANSWER = [SimpleNamespace(outputs=[SimpleNamespace(text="answer")])]


@pytest.fixture
def prompts(monkeypatch) -> list:
    """What ``generate`` hands the engine: a stand-in ``aioengine.LLM`` records each
    prompt (``generate``) or message list (``chat``)."""
    seen: list = []

    class RecordingLLM:
        def __init__(self, **kwargs) -> None:
            pass

        def generate(self, prompt, params, use_tqdm=True):
            seen.append(prompt)
            return ANSWER

        def chat(self, messages, params, use_tqdm=True):
            seen.append(messages)
            return ANSWER

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(aioengine, "LLM", RecordingLLM, raising=False)
    monkeypatch.setattr(cli, "_engine_config", lambda args: None)  # no model file read
    return seen


@pytest.mark.parametrize("stdin,expected", [
    ("Once upon a time\n", "Once upon a time"),
    ("Once upon a time\r\n", "Once upon a time"),
    ("Once upon a time", "Once upon a time"),
    ("Once upon a time\n\n", "Once upon a time\n"),  # a blank line written on purpose stays
    ("line one\nline two\n", "line one\nline two"),
    ("\n", ""),
])
def test_stdin_prompt_loses_one_trailing_newline(prompts, monkeypatch, capsys, stdin,
                                                  expected):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    cli.main(["generate", "-"])
    assert prompts == [expected]
    assert capsys.readouterr().out == "answer\n"


def test_stdin_chat_prompt_loses_it_too(prompts, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\n"))
    cli.main(["generate", "--chat", "-"])
    assert prompts == [[{"role": "user", "content": "Hi there"}]]


def test_a_prompt_argument_is_taken_as_given(prompts):
    cli.main(["generate", "ends with a newline\n"])
    assert prompts == ["ends with a newline\n"]
