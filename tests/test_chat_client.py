"""``aioengine chat`` (chat_client.py) under a pseudo-terminal (pexpect) against
the live test server (the session ``server`` fixture), plus its pure helpers.

Whether an answer is running is read from the server's ``EngineStats``
(``GET /v1/engine/stats``), never guessed from timing.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator

import pexpect
import pytest

from aioengine.entrypoints.chat_client import (
    Answer,
    ChatSettings,
    Conversation,
    history_path,
    render_markdown,
    screen_rows,
    terminal_safe,
)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SUMMARY = re.compile(r"\[(\d+) tokens?, ([\d.]+|-) tok/s, TTFT (\d+|-) ms, "
                     r"prompt (\d+) tokens \((\d+) cached\)")
PROMPT = "you>"  # prompt_toolkit draws "you> " but moves the cursor instead of the space
# The shared server runs on 2 busy CPU cores: generous waits, short answers.
ANSWER_TIMEOUT_S = 180
QUESTION = "What is the capital of France?"


def plain(text: str) -> str:
    return ANSI.sub("", text).replace("\r", "")


@pytest.fixture
def spawn_chat(server, tmp_path) -> Iterator:
    """``spawn_chat(*flags)``: the client in a pty, connected to the test server, its
    history under ``tmp_path`` (``$XDG_STATE_HOME``), shared by the test's clients."""
    children: list[pexpect.spawn] = []

    def spawn(*flags: str) -> pexpect.spawn:
        env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color",
                   COLUMNS="200", LINES="50", XDG_STATE_HOME=str(tmp_path / "state"))
        env.pop("AIOENGINE_CHAT_HISTORY", None)
        child = pexpect.spawn(
            sys.executable,
            ["-m", "aioengine.entrypoints.cli", "chat", "--url", server.ws_url,
             "--api-key", server.api_key, *flags],
            env=env, encoding="utf-8", timeout=ANSWER_TIMEOUT_S, dimensions=(50, 200))
        children.append(child)
        child.expect_exact(PROMPT, timeout=60)
        return child

    yield spawn
    for child in children:
        if child.isalive():
            child.sendeof()
            try:
                child.expect(pexpect.EOF, timeout=10)
            except pexpect.TIMEOUT:
                child.terminate(force=True)
        child.close()


def ask(child: pexpect.spawn, text: str) -> tuple[str, re.Match]:
    """Send a question; return the answer's plain text and its summary match."""
    child.sendline(text)
    child.expect(SUMMARY)
    output = plain(child.before)
    match = child.match
    child.expect_exact(PROMPT)
    answer = output.rsplit(text, 1)[-1].strip("\n")
    return answer, match


def wait_idle(server) -> None:
    stats = server.wait_for_stats(lambda s: s["num_running"] == 0, timeout=30)
    assert stats["num_running"] == 0, stats


# -- against the server -------------------------------------------------------------------------


def test_question_gets_a_streamed_answer(server, spawn_chat):
    wait_idle(server)
    child = spawn_chat("--temperature", "0", "--max-tokens", "32")
    child.sendline(QUESTION)
    # Read what the terminal shows as it arrives and note how much of the answer
    # (the text after the echoed question) was there at each read.
    seen = ""
    answer_lengths: list[int] = []
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while not SUMMARY.search(plain(seen)):
        assert time.monotonic() < deadline, plain(seen)
        try:
            seen += child.read_nonblocking(4096, timeout=5)
        except pexpect.TIMEOUT:
            continue
        text = plain(seen)
        if QUESTION in text:
            answer_so_far = text.rsplit(QUESTION, 1)[-1].split("[", 1)[0].strip()
            if answer_so_far and (not answer_lengths or answer_lengths[-1] != len(answer_so_far)):
                answer_lengths.append(len(answer_so_far))
    text = plain(seen)
    answer = text.rsplit(QUESTION, 1)[-1].split("[", 1)[0].strip()
    assert "Paris" in answer, text
    assert len(answer_lengths) >= 2, f"the answer arrived in one piece: {answer_lengths}"
    match = SUMMARY.search(text)
    assert int(match.group(1)) > 0 and match.group(2) != "-"
    # The next prompt follows the summary; read_nonblocking may already have consumed it
    # (it then never reaches pexpect's buffer), so look in what was read first.
    if PROMPT not in text[match.end():]:
        child.expect_exact(PROMPT)


def test_ctrl_c_stops_the_answer_and_returns_to_the_prompt(server, spawn_chat):
    wait_idle(server)
    child = spawn_chat("--temperature", "0", "--max-tokens", "1500")
    before = server.stats()["num_generation_tokens"]
    child.sendline("Write a long story about a dragon who guards a library.")
    # Mid-answer by the server's own count: running, and a few tokens out.
    stats = server.wait_for_stats(
        lambda s: s["num_running"] == 1 and s["num_generation_tokens"] >= before + 5,
        timeout=ANSWER_TIMEOUT_S, interval=0.1)
    assert stats["num_running"] == 1, stats
    child.sendintr()
    child.expect_exact("(stopped)", timeout=30)
    child.expect(SUMMARY)
    child.expect_exact(PROMPT)
    stats = server.wait_for_stats(lambda s: s["num_running"] == 0, timeout=10)
    assert stats["num_running"] == 0, stats
    # Still there and listening.
    assert child.isalive()
    child.sendline("/help")
    child.expect_exact("/reset")
    child.expect_exact(PROMPT)


def test_reset_clears_the_history(server, spawn_chat):
    """The prompt the server sees carries the history, and after /reset it is
    exactly the first turn's prompt again."""
    wait_idle(server)
    child = spawn_chat("--temperature", "0", "--max-tokens", "4")
    _, first = ask(child, QUESTION)
    _, second = ask(child, QUESTION)
    first_prompt, second_prompt = int(first.group(4)), int(second.group(4))
    assert second_prompt > first_prompt + int(first.group(1)), (first_prompt, second_prompt)
    child.sendline("/clear")
    child.expect_exact("history cleared")
    child.expect_exact(PROMPT)
    _, third = ask(child, QUESTION)
    assert int(third.group(4)) == first_prompt
    # The same prompt again: the prefix cache supplied most of it.
    assert int(third.group(5)) > 0


@pytest.mark.parametrize("command", ["/quit", "/exit"])
def test_quit_and_exit_leave_with_status_0(spawn_chat, command):
    child = spawn_chat()
    child.sendline(command)
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    assert child.exitstatus == 0, plain(child.before)
    assert "unknown command" not in plain(child.before)


def test_history_is_kept_across_runs(spawn_chat, tmp_path):
    """What was typed in one run comes back with Up in the next, from the file
    under $XDG_STATE_HOME."""
    first = spawn_chat()
    first.sendline("/temperature 0.25")
    first.expect_exact("(temperature 0.25)")
    first.expect_exact(PROMPT)
    first.sendline("/quit")
    first.expect(pexpect.EOF, timeout=30)
    history = tmp_path / "state" / "aioengine" / "chat_history"
    assert "/temperature 0.25" in history.read_text()

    second = spawn_chat()
    second.send("\x1b[A\x1b[A")  # Up twice: past "/quit" to the line before it
    second.send("\r")
    second.expect_exact("(temperature 0.25)")
    second.expect_exact(PROMPT)


def test_commands_change_the_settings(spawn_chat):
    child = spawn_chat()
    for line, reply in [("/temperature 0.5", "(temperature 0.5)"),
                        ("/temperature 7", "usage: /temperature X"),
                        ("/system Be brief.", "(system prompt set: 'Be brief.'"),
                        ("/system", "(system prompt cleared"),
                        ("/max-tokens 0", "usage: /max-tokens N"),
                        ("/nope", "unknown command /nope"),
                        ("/help", "/quit, /exit")]:
        child.sendline(line)
        child.expect_exact(reply)
        child.expect_exact(PROMPT)


@pytest.mark.parametrize("newline", ["\\\r", "\x1b\r"], ids=["trailing-backslash", "esc-enter"])
def test_multi_line_input_is_one_message(server, spawn_chat, newline):
    """Two typed lines reach the server as one user message holding both: the
    prompt's token count is that of exactly that message (``POST /tokenize``)."""
    import httpx

    wait_idle(server)
    lines = ["Name the capital of France.", "Answer in one word."]
    expected = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=30,
                          json={"messages": [{"role": "user", "content": "\n".join(lines)}]})
    one_line = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=30,
                          json={"messages": [{"role": "user", "content": lines[0]}]})
    child = spawn_chat("--temperature", "0", "--max-tokens", "1")
    child.send(lines[0] + newline)
    child.send(lines[1] + "\r")
    child.expect(SUMMARY)
    prompt_tokens = int(child.match.group(4))
    assert prompt_tokens == expected.json()["count"] != one_line.json()["count"]
    child.expect_exact(PROMPT)


def test_bad_api_key_is_reported(server):
    child = pexpect.spawn(sys.executable, ["-m", "aioengine.entrypoints.cli", "chat", "--url",
                                           server.ws_url, "--api-key", "wrong"],
                          encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus not in (0, None)
    assert "authentication failed" in plain(child.before)


# -- the helpers, no server -----------------------------------------------------------------------


def test_terminal_safe_drops_escape_sequences():
    assert terminal_safe("a\x1b]0;title\x07b\x1b[2Jc\td\ne") == "a]0;titleb[2Jc\td\ne"


def test_conversation_messages_and_reset():
    conversation = Conversation(ChatSettings(system="Be brief."))
    conversation.add("Hi", "Hello!")
    assert conversation.messages("Again") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    conversation.reset()
    conversation.settings.system = ""
    assert conversation.messages("x") == [{"role": "user", "content": "x"}]


def test_markdown_rendering_of_a_finished_answer():
    import io

    from rich.console import Console

    out = io.StringIO()
    render_markdown(Console(file=out, width=60, color_system=None),
                    "Some **bold** text:\n\n- one\n- two\n\n```python\nprint(1)\n```\n")
    text = out.getvalue()
    assert "**" not in text and "bold" in text
    assert text.count("•") == 2
    assert "print(1)" in text and "```" not in text


def test_screen_rows_counts_wrapped_lines():
    assert screen_rows("abc", 80) == 1
    assert screen_rows("a" * 81, 80) == 2
    assert screen_rows("a\n\nb", 80) == 3
    assert screen_rows("中" * 41, 80) == 2  # wide characters take two columns


def test_history_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("AIOENGINE_CHAT_HISTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert history_path() == tmp_path / "aioengine" / "chat_history"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert history_path() == tmp_path / ".local" / "state" / "aioengine" / "chat_history"
    monkeypatch.setenv("AIOENGINE_CHAT_HISTORY", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h"
    assert history_path("") is None  # --history-file '': none kept
    assert history_path(str(tmp_path / "f")) == tmp_path / "f"


def test_answer_summary_from_done_message():
    done = {"type": "done", "id": "c1", "finish_reason": "length", "text": "Paris",
            "usage": {"prompt_tokens": 36, "completion_tokens": 9, "total_tokens": 45,
                      "prompt_tokens_details": {"cached_tokens": 32}},
            "ttft_s": 0.085, "tokens_per_s": 31.04}
    summary = Answer.from_done(done).summary()
    assert summary == ("[9 tokens, 31.0 tok/s, TTFT 85 ms, prompt 36 tokens (32 cached), "
                       "max tokens reached]")
    assert SUMMARY.search(summary)
