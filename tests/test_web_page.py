"""The chat page in web/, driven by Playwright with Debian's Chromium headless
against the real test server (the session ``server`` fixture, which needs an
API key, so every test also goes through the page's key dialog).

Playwright never downloads a browser here: it launches ``/usr/bin/chromium``
(installed by ``make setup``). Without it these tests skip, except under CI
(``CI=true``), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# The shared server runs on 2 busy CPU cores: generous waits, short answers.
ANSWER_TIMEOUT_MS = 180_000
XSS = "<img src=x onerror=alert(1)>"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def _browser_missing(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"{reason} (CI=true: the browser test must run in CI)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def playwright() -> Iterator[object]:
    if not CHROMIUM.exists():
        _browser_missing(f"{CHROMIUM} is missing (apt-get install chromium, or `make setup`)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _browser_missing("the playwright package is missing (pip install -e '.[test]')")
    with sync_playwright() as p:
        yield p


@pytest.fixture
def context(playwright, tmp_path: Path):
    """A fresh Chromium profile (its own user-data dir) per test."""
    ctx = playwright.chromium.launch_persistent_context(
        str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
        args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 800})
    try:
        yield ctx
    finally:
        ctx.close()


class ChatPage:
    """The page plus what it raised: JavaScript dialogs and uncaught errors."""

    def __init__(self, page) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", self._on_dialog)
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def _on_dialog(self, dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def open(self, server, *, key: str | None = None) -> None:
        """Load ``/`` and answer the API-key dialog (``key``: the server's by default)."""
        self.page.goto(f"{server.base_url}/")
        self.page.wait_for_selector("#auth-dialog[open]")
        if key is None:
            key = server.api_key
        self.page.fill("#api-key", key)
        self.page.press("#api-key", "Enter")

    def wait_ready(self) -> None:
        self.page.wait_for_selector("#conn[data-state=ready]")

    def settings(self, temperature: float, max_tokens: int) -> None:
        self.page.fill("#temperature", str(temperature))
        self.page.fill("#max-tokens", str(max_tokens))

    def ask(self, text: str) -> None:
        """Type into the composer and press Enter (the keyboard path)."""
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def last_answer(self):
        return self.page.locator(".msg.assistant").last

    def wait_answer_done(self) -> None:
        self.page.wait_for_selector(".msg.assistant[data-finish]", timeout=ANSWER_TIMEOUT_MS)


@pytest.fixture
def chat(context) -> ChatPage:
    return ChatPage(context.new_page())


def _wait_idle(server) -> None:
    stats = server.wait_for_stats(lambda s: s["num_running"] == 0, timeout=30)
    assert stats["num_running"] == 0, stats


# -- the tests --------------------------------------------------------------------------------


def test_answer_streams_in_steps_and_names_paris(server, chat: ChatPage):
    _wait_idle(server)
    chat.open(server)
    chat.wait_ready()
    chat.settings(temperature=0, max_tokens=32)
    # Record every length the answer passes through, as the DOM changes.
    chat.page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const all = document.querySelectorAll('.msg.assistant .content');
            if (!all.length) return;
            const n = all[all.length - 1].textContent.length;
            const seen = window.__lengths;
            if (!seen.length || seen[seen.length - 1] !== n) seen.push(n);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    chat.ask("What is the capital of France?")
    chat.wait_answer_done()

    answer = chat.last_answer()
    text = answer.locator(".content").inner_text()
    lengths = chat.page.evaluate("window.__lengths")
    growing = [n for n in lengths if n > 0]
    assert len(growing) >= 3 and growing == sorted(growing), lengths
    assert "Paris" in text
    assert answer.get_attribute("data-finish") in ("stop", "length")
    meta = answer.locator(".meta").inner_text()
    assert re.search(r"TTFT \d+ ms", meta), meta
    assert re.search(r"[\d.]+ tok/s", meta), meta
    assert re.search(r"prompt \d+ \(\d+ cached\)", meta), meta
    # The user's turn is shown as typed.
    assert chat.page.locator(".msg.user .content").last.inner_text() == \
        "What is the capital of France?"
    assert not chat.errors and not chat.dialogs


def test_stop_cancels_on_the_server_and_the_panel_shows_blocks(server, chat: ChatPage):
    _wait_idle(server)
    chat.open(server)
    chat.wait_ready()
    chat.settings(temperature=0, max_tokens=1500)
    chat.ask("Write a long story about a dragon who guards a library.")
    answer = chat.last_answer()
    # Mid-answer: some text on the page, the request running on the server, and the
    # engine panel (fed by the WebSocket stats) showing the blocks it holds.
    chat.page.wait_for_function(
        "() => { const a = document.querySelectorAll('.msg.assistant .content');"
        " return a.length && a[a.length - 1].textContent.length > 60; }",
        timeout=ANSWER_TIMEOUT_MS)
    chat.page.wait_for_function(
        "() => Number(document.getElementById('stat-blocks-used').textContent) > 0"
        " && document.querySelectorAll('#block-grid i.b2').length > 0"
        " && Number(document.getElementById('stat-running').textContent) >= 1",
        timeout=10_000)
    assert server.stats()["num_running"] == 1
    assert answer.get_attribute("data-finish") is None, "the answer ended before Stop"
    ARTIFACTS.mkdir(exist_ok=True)
    chat.page.screenshot(path=str(ARTIFACTS / "web_mid_answer.png"))

    chat.page.click("#stop")
    chat.page.wait_for_selector(".msg.assistant[data-finish=abort]", timeout=30_000)
    stats = server.wait_for_stats(lambda s: s["num_running"] == 0, timeout=10)
    assert stats["num_running"] == 0, stats
    assert "stopped" in answer.locator(".meta").inner_text()
    assert chat.page.is_visible("#send") and chat.page.is_hidden("#stop")
    # The panel follows the server back to idle.
    chat.page.wait_for_function(
        "() => document.getElementById('stat-running').textContent === '0'", timeout=10_000)
    assert not chat.errors and not chat.dialogs


def test_html_in_prompt_and_answer_is_shown_as_text(server, chat: ChatPage):
    """A prompt with markup, and an answer whose stream is made to carry markup
    (the model cannot be relied on to write it), both end up as text."""
    _wait_idle(server)
    answer_html = '<script>alert(2)</script><b onmouseover="alert(3)">bold?</b>'
    injected = []

    def route(ws) -> None:
        upstream = ws.connect_to_server()

        def from_server(message: str | bytes) -> None:
            msg = json.loads(message)
            if msg.get("type") == "delta" and not injected:
                injected.append(msg["id"])
                msg["text"] = answer_html + msg["text"]
            elif msg.get("type") == "done":
                msg["text"] = answer_html + msg["text"]
            ws.send(json.dumps(msg))

        upstream.on_message(from_server)

    chat.page.route_web_socket(re.compile(r".*/v1/ws$"), route)
    chat.open(server)
    chat.wait_ready()
    chat.settings(temperature=0, max_tokens=8)
    chat.ask(XSS)
    chat.wait_answer_done()
    chat.page.wait_for_timeout(500)  # time for an image error handler to fire, if any

    assert injected, "no answer text came through the socket"
    assert chat.page.locator(".msg.user .content").last.inner_text() == XSS
    shown = chat.last_answer().locator(".content").inner_text()
    assert shown.startswith(answer_html), shown
    assert chat.page.locator("#messages img, #messages script, #messages b").count() == 0
    assert chat.dialogs == []
    # The renderer itself, on markup plus the Markdown subset it supports.
    rendered = chat.page.evaluate("""(payload) => {
        const div = document.createElement('div');
        const md = '\\n**x** `y`\\n```html\\n' + payload + '\\n```';
        window.aioChat.renderAnswer(div, payload + md);
        return {text: div.textContent, tags: [...div.querySelectorAll('*')].map(e => e.tagName)};
    }""", XSS)
    assert rendered["text"].count(XSS) == 2
    assert set(rendered["tags"]) <= {"DIV", "STRONG", "CODE", "PRE"}, rendered
    assert chat.dialogs == [] and not chat.errors


def test_reconnects_and_reauthenticates_after_the_socket_drops(server, chat: ChatPage):
    """The server side of the socket goes away (as in a restart); the page
    reconnects by itself, sends its key again and answers."""
    routes = []

    def route(ws) -> None:
        ws.connect_to_server()
        routes.append(ws)

    chat.page.route_web_socket(re.compile(r".*/v1/ws$"), route)
    chat.open(server)
    chat.wait_ready()
    chat.page.wait_for_selector("#engine[data-live=true]")
    routes[0].close(code=1012, reason="service restart")
    chat.page.wait_for_selector("#conn[data-state=down]")
    chat.page.wait_for_selector("#conn[data-state=ready]", timeout=30_000)
    assert len(routes) == 2
    assert not chat.page.is_visible("#auth-dialog"), "the key should be reused"
    chat.settings(temperature=0, max_tokens=4)
    chat.ask("Hi")
    chat.wait_answer_done()
    assert chat.last_answer().get_attribute("data-finish") in ("stop", "length")
    assert not chat.errors


def test_wrong_key_is_refused_and_the_right_one_accepted(server, chat: ChatPage):
    chat.open(server, key="not-the-key")
    chat.page.wait_for_function(
        "() => document.getElementById('auth-error').textContent.length > 0")
    assert chat.page.is_visible("#auth-dialog")
    assert chat.page.is_disabled("#send")
    chat.page.fill("#api-key", server.api_key)
    chat.page.press("#api-key", "Enter")
    chat.wait_ready()
    assert not chat.page.is_visible("#auth-dialog")


def test_keyboard_and_narrow_screen(server, chat: ChatPage):
    chat.page.set_viewport_size({"width": 390, "height": 844})
    chat.open(server)
    chat.wait_ready()
    # Shift+Enter breaks the line and sends nothing.
    chat.page.click("#prompt")
    chat.page.keyboard.type("first line")
    chat.page.keyboard.press("Shift+Enter")
    chat.page.keyboard.type("second line")
    assert chat.page.input_value("#prompt") == "first line\nsecond line"
    assert chat.page.locator(".msg").count() == 0
    # Nothing wider than the screen; the side panel folds behind a button.
    assert chat.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert chat.page.is_hidden("#side")
    chat.page.click("#toggle-side")
    assert chat.page.is_visible("#engine")
    assert chat.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    ARTIFACTS.mkdir(exist_ok=True)
    chat.page.screenshot(path=str(ARTIFACTS / "web_narrow.png"))
    # The New chat button also works from the keyboard.
    chat.page.click("#toggle-side")
    chat.page.focus("#new-chat")
    chat.page.keyboard.press("Enter")
    assert chat.page.is_visible("#empty")
    assert not chat.errors and not chat.dialogs
