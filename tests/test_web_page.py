"""The chat page in web/, driven by Playwright with Debian's Chromium headless
against the real test server (the session ``server`` fixture, which needs an
API key, so every test that talks to the model also goes through the page's
key dialog).

Tests that need a fixed answer (Markdown, hostile markup, conversations,
regenerate) load the page from the same server but answer its WebSocket
themselves (``StubEngine``, through ``page.route_web_socket``): the model
cannot be made to write a given text, and these run in seconds.

Playwright never downloads a browser here: it launches ``/usr/bin/chromium``
(installed by ``make setup``). Without it these tests skip, except under CI
(``CI=true``), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
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


STUB_HELLO = {"type": "hello", "model": "stub-model", "max_model_len": 4096,
              "max_concurrent_requests": 16, "auth_required": False}
STUB_WAIT_S = 10.0


class StubEngine:
    """The server's side of ``/v1/ws`` played by the test, for answers it chooses.

    Each ``chat`` message is recorded in ``requests``. If ``answers`` holds a
    text, the next one is streamed back at once in small deltas, then ``done``;
    otherwise the test drives the answer with ``delta`` and ``done``. A
    ``cancel`` is recorded in ``cancels`` and answered like the real server: a
    ``done`` with ``finish_reason: "abort"`` and the text so far.
    """

    def __init__(self, page, answers: list[str] | None = None, chunk: int = 4) -> None:
        self.page = page
        self.answers = list(answers or [])
        self.chunk = chunk
        self.requests: list[dict] = []
        self.cancels: list[str] = []
        self.sent: dict[str, str] = {}
        self.ws = None
        page.route_web_socket(re.compile(r".*/v1/ws$"), self._route)

    def _route(self, ws) -> None:
        self.ws = ws
        ws.on_message(self._on_message)
        ws.send(json.dumps(STUB_HELLO))

    def _on_message(self, raw: str | bytes) -> None:
        msg = json.loads(raw)
        if msg.get("type") == "chat":
            self.requests.append(msg)
            self.sent[msg["id"]] = ""
            if self.answers:
                self.answer(self.answers.pop(0))
        elif msg.get("type") == "cancel":
            self.cancels.append(msg["id"])
            self.done(self.sent.get(msg["id"], ""), "abort", request_id=msg["id"])

    @property
    def last_id(self) -> str:
        return self.requests[-1]["id"]

    def wait_requests(self, n: int) -> dict:
        """Waits (letting the page run) until ``n`` chat requests came; the last one."""
        deadline = time.monotonic() + STUB_WAIT_S
        while len(self.requests) < n:
            assert time.monotonic() < deadline, f"{len(self.requests)} requests, wanted {n}"
            self.page.wait_for_timeout(20)
        return self.requests[-1]

    def delta(self, text: str) -> None:
        self.sent[self.last_id] += text
        self.ws.send(json.dumps({"type": "delta", "id": self.last_id, "text": text,
                                 "token_ids": [0]}))

    def delta_tools(self, text: str, content: str, tool_calls: list[dict] | None = None) -> None:
        """A ``delta`` of a chat with ``tools``: its prose part and tool-call fragments."""
        self.sent[self.last_id] += text
        msg = {"type": "delta", "id": self.last_id, "text": text, "token_ids": [0],
               "content": content}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        self.ws.send(json.dumps(msg))

    def done(self, text: str, finish_reason: str = "stop", request_id: str | None = None,
             **extra: object) -> None:
        self.ws.send(json.dumps({
            "type": "done", "id": request_id or self.last_id, "finish_reason": finish_reason,
            "stop_reason": None, "text": text, "ttft_s": 0.05, "tokens_per_s": 25.0,
            "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
                      "prompt_tokens_details": {"cached_tokens": 0}}, **extra}))

    def answer(self, text: str) -> None:
        for i in range(0, len(text), self.chunk):
            self.delta(text[i:i + self.chunk])
        self.done(text)


def _open_stubbed(chat: ChatPage, server, answers: list[str] | None = None) -> StubEngine:
    stub = StubEngine(chat.page, answers)
    chat.page.goto(f"{server.base_url}/")
    chat.wait_ready()
    return stub


def _conversation(page) -> list[tuple[str, str]]:
    """(role, shown text) of every message on the page."""
    pairs = page.evaluate("""() => [...document.querySelectorAll('#messages .msg')].map(
        m => [m.classList.contains('user') ? 'user' : 'assistant',
              m.querySelector('.content').innerText.trim()])""")
    return [tuple(p) for p in pairs]


def _wait_settled(page) -> None:
    """Until no answer is streaming (the stub's answers arrive at once)."""
    page.wait_for_function("() => !document.querySelector('.msg.streaming')"
                           " && !document.getElementById('send').hidden", timeout=10_000)


def _titles(page) -> list[str]:
    return page.locator("#conv-list .conv-open").all_inner_texts()


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
    # The conversation list folds the same way, one panel open at a time.
    chat.page.click("#toggle-history")
    assert chat.page.is_visible("#history") and chat.page.is_hidden("#side")
    assert chat.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    chat.page.click("#toggle-history")
    assert chat.page.is_hidden("#history")
    # The New chat button also works from the keyboard.
    chat.page.focus("#new-chat")
    chat.page.keyboard.press("Enter")
    assert chat.page.is_visible("#empty")
    assert not chat.errors and not chat.dialogs


# -- Markdown, safety, conversations (stubbed socket unless said otherwise) -------------------

MARKDOWN_ANSWER = (
    "Steps:\n\n- open the file\n- add the function\n\n"
    "```python\ndef add(a, b):\n    return a + b\n```\n\n"
    "See [the docs](https://docs.python.org/3/) for more.\n")
CODE = "def add(a, b):\n    return a + b\n"


def test_markdown_answer_renders_list_and_code_block_while_streaming(server, chat: ChatPage,
                                                                     context):
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.base_url)
    stub = _open_stubbed(chat, server)
    chat.ask("How do I add two numbers?")
    stub.wait_requests(1)
    answer = chat.last_answer()

    # Mid-stream: the list is a list and the open fence is already code.
    first, rest = MARKDOWN_ANSWER.split("    return")
    stub.delta(first)
    chat.page.wait_for_function(
        "() => document.querySelector('.msg.assistant pre code')?.textContent"
        ".startsWith('def add(a, b):')")
    assert answer.locator(".content li").count() == 2
    assert answer.get_attribute("data-finish") is None
    # Blocks above the growing one are not rebuilt by later deltas.
    chat.page.evaluate("document.querySelector('.msg.assistant ul').dataset.t = 'kept'")
    stub.delta("    return" + rest)
    chat.page.wait_for_function(
        "() => document.querySelector('.msg.assistant a[href]') !== null")
    assert answer.locator("ul[data-t=kept]").count() == 1
    stub.done(MARKDOWN_ANSWER)
    chat.wait_answer_done()

    content = answer.locator(".content")
    assert content.locator("li").all_inner_texts() == ["open the file", "add the function"]
    assert content.locator("pre > code").count() == 1
    assert content.locator("pre > code").text_content() == CODE
    assert content.locator(".codeblock .lang").inner_text() == "python"
    assert "```" not in content.inner_text()
    link = content.locator("a[href='https://docs.python.org/3/']")
    assert link.get_attribute("target") == "_blank"
    assert "noopener" in link.get_attribute("rel").split()

    content.locator("button.copy-code").click()
    chat.page.wait_for_function(
        "() => document.querySelector('button.copy-code').textContent === 'Copied'")
    assert chat.page.evaluate("navigator.clipboard.readText()") == CODE
    ARTIFACTS.mkdir(exist_ok=True)
    chat.page.screenshot(path=str(ARTIFACTS / "web_markdown.png"))
    assert not chat.errors and not chat.dialogs


# Each would run script, add a handler or an active link if it reached the DOM as HTML.
HOSTILE_ANSWER = "\n\n".join([
    "Here you go:",
    "<script>window.__pwned = 'script'</script>",
    "<img src=x onerror=\"window.__pwned = 'img'\">",
    "inline <img src=x onerror=\"window.__pwned = 'inline-img'\"> tag",
    "<svg onload=\"window.__pwned = 'svg'\"><circle r=4></circle></svg>",
    "<iframe srcdoc=\"<script>parent.__pwned = 'iframe'</script>\"></iframe>",
    "<details open ontoggle=\"window.__pwned = 'details'\"><summary>x</summary></details>",
    "<a href=\"javascript:window.__pwned = 'a-tag'\">raw link</a>",
    "[markdown link](javascript:window.__pwned='md-link')",
    "[entity link](&#106;avascript:window.__pwned='entity')",
    "[data link](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "![picture](x\" onerror=\"window.__pwned='md-img')",
    "<p id=\"prompt\" style=\"position:fixed;inset:0\">clobber</p>",
    "<style>body { display: none }</style>",
    "```html\n<img src=x onerror=\"window.__pwned = 'fence'\">\n```",
])

# Records every element the page ever adds that could run script or navigate,
# and every CSP or Trusted Types violation, from the first byte of the page on.
WATCH_DOM = """
window.__bad = [];
window.__violations = [];
document.addEventListener('securitypolicyviolation',
    (e) => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));
const looksBad = (n) => n.nodeType === 1 && (
    /^(SCRIPT|IMG|IFRAME|SVG|STYLE|OBJECT|EMBED)$/i.test(n.tagName)
    || [...n.attributes].some((a) => /^on/i.test(a.name)
        || (/^(href|src|xlink:href|action|formaction)$/i.test(a.name)
            && !/^(https?:|mailto:|#)/i.test(a.value.trim()))));
new MutationObserver((records) => {
  for (const r of records) {
    const nodes = r.type === 'attributes' ? [r.target] : [...r.addedNodes];
    for (const n of nodes) {
      if (n.nodeType !== 1 || !n.closest || !n.closest('#messages')) continue;
      for (const e of [n, ...n.querySelectorAll('*')]) {
        if (looksBad(e)) window.__bad.push(e.outerHTML.slice(0, 120));
      }
    }
  }
}).observe(document, {subtree: true, childList: true, attributes: true});
"""


def test_hostile_answer_runs_no_script_and_adds_no_handler(server, chat: ChatPage):
    chat.page.add_init_script(WATCH_DOM)
    stub = _open_stubbed(chat, server)
    chat.ask("Say something hostile")
    stub.wait_requests(1)
    # Three characters a delta: the page renders half-written tags too.
    for i in range(0, len(HOSTILE_ANSWER), 3):
        stub.delta(HOSTILE_ANSWER[i:i + 3])
        if i % 60 == 0:
            chat.page.wait_for_timeout(5)  # let frames render between deltas
    stub.done(HOSTILE_ANSWER)
    chat.wait_answer_done()
    chat.page.wait_for_timeout(300)  # time for an error or toggle handler to fire, if any

    page = chat.page
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("window.__bad") == []
    assert page.evaluate("window.__violations") == []
    content = chat.last_answer().locator(".content")
    # The raw HTML is shown as text, the Markdown links keep only their text.
    shown = content.inner_text()
    assert "<script>window.__pwned = 'script'</script>" in shown
    assert "<img src=x onerror=" in shown and "markdown link" in shown
    handlers = page.evaluate("""() => [...document.querySelectorAll('#messages *')]
        .flatMap((e) => [...e.attributes].map((a) => a.name))
        .filter((name) => name.startsWith('on'))""")
    assert handlers == []
    active = "#messages :is(script, img, iframe, svg, style, object, embed)"
    assert page.locator(active).count() == 0
    hrefs = page.evaluate("() => [...document.querySelectorAll('#messages [href]')]"
                          ".map((a) => a.getAttribute('href'))")
    assert all(re.match(r"(https?:|mailto:|#)", h) for h in hrefs), hrefs
    assert page.evaluate("document.getElementById('prompt').tagName") == "TEXTAREA"
    assert page.is_visible("#composer")
    # The fenced example is code, shown as written.
    assert content.locator("pre code").text_content() == \
        "<img src=x onerror=\"window.__pwned = 'fence'\">\n"
    assert not chat.errors and not chat.dialogs


def test_conversations_survive_reload_and_switch_rename_delete(server, chat: ChatPage):
    page = chat.page
    stub = _open_stubbed(chat, server, ["Answer one.", "Answer two.", "Answer three."])
    chat.ask("First question")
    chat.wait_answer_done()
    page.click("#new-chat")
    assert page.is_visible("#empty") and page.locator(".msg").count() == 0
    chat.ask("Second question")
    chat.wait_answer_done()
    assert _titles(page) == ["Second question", "First question"]

    page.reload()
    chat.wait_ready()
    assert _titles(page) == ["Second question", "First question"]
    assert page.locator(".conv[aria-current=true] .conv-open").inner_text() == "Second question"
    assert _conversation(page) == [("user", "Second question"), ("assistant", "Answer two.")]

    page.locator(".conv-open", has_text="First question").click()
    assert _conversation(page) == [("user", "First question"), ("assistant", "Answer one.")]
    assert page.locator(".conv[aria-current=true] .conv-open").inner_text() == "First question"
    # The restored conversation is what the next question continues.
    chat.ask("Follow-up")
    request = stub.wait_requests(3)
    assert request["messages"] == [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "Answer one."},
        {"role": "user", "content": "Follow-up"}]
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant[data-finish]').length == 2")

    page.locator(".conv", has_text="First question").locator(".conv-rename").click()
    page.fill(".conv-title-input", "Renamed chat")
    page.press(".conv-title-input", "Enter")
    assert _titles(page) == ["Renamed chat", "Second question"]
    second = page.locator(".conv", has_text="Second question")
    second.locator(".conv-delete").click()
    assert _titles(page) == ["Renamed chat", "Second question"], "one click only asks"
    second.locator(".conv-delete").click()
    assert _titles(page) == ["Renamed chat"]

    page.reload()
    chat.wait_ready()
    assert _titles(page) == ["Renamed chat"]
    assert [role for role, _ in _conversation(page)] == ["user", "assistant"] * 2
    # Deleting the open conversation leaves an empty page, after a reload too.
    page.locator(".conv-delete").click()
    page.locator(".conv-delete").click()
    assert _titles(page) == [] and page.is_visible("#empty") and page.is_visible("#conv-none")
    page.reload()
    chat.wait_ready()
    assert _titles(page) == [] and page.locator(".msg").count() == 0
    assert not chat.errors and not chat.dialogs


def test_regenerate_replaces_the_answer_and_edit_resends(server, chat: ChatPage):
    page = chat.page
    stub = _open_stubbed(chat, server, ["First answer."])
    chat.ask("Tell me a joke")
    chat.wait_answer_done()

    stub.answers.append("Second answer.")
    chat.last_answer().locator("[data-action=regenerate]").click()
    request = stub.wait_requests(2)
    _wait_settled(page)
    assert request["messages"] == [{"role": "user", "content": "Tell me a joke"}]
    assert _conversation(page) == [("user", "Tell me a joke"), ("assistant", "Second answer.")]
    page.reload()
    chat.wait_ready()
    assert _conversation(page) == [("user", "Tell me a joke"), ("assistant", "Second answer.")]

    # Edit the last question: it and its answer are replaced.
    stub.answers.append("Third answer.")
    page.locator(".msg.user [data-action=edit]").click()
    page.fill(".edit-box", "Tell me a riddle")
    page.click(".edit-send")
    request = stub.wait_requests(3)
    assert request["messages"] == [{"role": "user", "content": "Tell me a riddle"}]
    _wait_settled(page)
    assert _conversation(page) == [("user", "Tell me a riddle"), ("assistant", "Third answer.")]
    assert _titles(page) == ["Tell me a joke"]

    # Stop still works on a regenerated answer: a cancel for its id; the partial stays.
    chat.last_answer().locator("[data-action=regenerate]").click()
    stub.wait_requests(4)
    stub.delta("Partial")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant.streaming')?.textContent.includes('Partial')")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-finish=abort]")
    assert stub.cancels == [stub.last_id]
    assert _conversation(page) == [("user", "Tell me a riddle"), ("assistant", "Partial")]
    assert "stopped" in chat.last_answer().locator(".meta").inner_text()
    assert page.is_visible("#send") and page.is_hidden("#stop")
    assert not chat.errors and not chat.dialogs


# Two calls as a tool-call parser streams them (docs/websocket.md): the first
# fragment with index, id, type and name, then pieces of the arguments. The
# second call's name and arguments carry markup that would run if parsed as HTML.
TOOL_PROSE = "Let me look that up."
HOSTILE_NAME = "lookup<script>window.__pwned='name'</script>"
TOOL_CALLS = [
    {"id": "call_wx1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    {"id": "call_xss2", "type": "function",
     "function": {"name": HOSTILE_NAME,
                  "arguments": '{"q": "<img src=x onerror=\\"window.__pwned=\'img\'\\">", '
                               '"html": "<script>window.__pwned=\'script\'</script>", '
                               '"n": [1, 2]}'}},
]


def _shown_calls(answer) -> list[tuple[str, str, str]]:
    """(name, id, arguments) of every tool-call element of ``answer``, as shown."""
    return [tuple(c) for c in answer.locator(".tool-call").evaluate_all(
        """(calls) => calls.map((c) => [c.querySelector('.tool-name').textContent,
            c.querySelector('.tool-id').textContent,
            c.querySelector('.tool-args').textContent])""")]


def _args(index: int, piece: str) -> list[dict]:
    """A delta's fragment of call ``index``: a piece of its arguments."""
    return [{"index": index, "function": {"arguments": piece}}]


def test_tool_calls_show_as_their_own_elements_and_survive_reload(server, chat: ChatPage):
    page = chat.page
    page.add_init_script(WATCH_DOM)
    stub = _open_stubbed(chat, server)
    chat.ask("What is the weather in Paris?")
    stub.wait_requests(1)
    answer = chat.last_answer()

    # Mid-stream: the first call is an element whose arguments grow as they come.
    first_args = TOOL_CALLS[0]["function"]["arguments"]
    stub.delta_tools(TOOL_PROSE, TOOL_PROSE)
    stub.delta_tools('<tool_call>{"name": "get_weather", "arguments": ', "",
                     [{"index": 0, "id": "call_wx1", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}])
    stub.delta_tools(first_args[:9], "", _args(0, first_args[:9]))
    page.wait_for_function("() => document.querySelector('.tool-call .tool-args')"
                           "?.textContent === '{\"city\": '")
    assert _shown_calls(answer) == [("get_weather", "call_wx1", '{"city": ')]
    stub.delta_tools(first_args[9:], "", _args(0, first_args[9:]))
    page.wait_for_function(f"() => document.querySelector('.tool-call .tool-args')"
                           f"?.textContent === {json.dumps(first_args)}")
    assert answer.get_attribute("data-finish") is None
    assert answer.locator(".content").inner_text() == TOOL_PROSE

    # The rest of the stream: the second, hostile call, fragment by fragment.
    stub.delta_tools("}</tool_call>", "")
    call = TOOL_CALLS[1]
    stub.delta_tools("<tool_call>", "", [{"index": 1, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": ""}}])
    args = call["function"]["arguments"]
    for i in range(0, len(args), 5):
        stub.delta_tools(args[i:i + 5], "", _args(1, args[i:i + 5]))
        if i % 25 == 0:
            page.wait_for_timeout(5)  # let frames render half-written markup
    page.wait_for_function(f"() => document.querySelectorAll('.tool-call .tool-args')[1]"
                           f"?.textContent === {json.dumps(args)}")
    raw = (f"{TOOL_PROSE}<tool_call>{json.dumps(TOOL_CALLS[0]['function'])}</tool_call>"
           f"<tool_call>{json.dumps(call['function'])}</tool_call>")
    stub.done(raw, "tool_calls", tool_calls=TOOL_CALLS)
    chat.wait_answer_done()
    page.wait_for_timeout(300)  # time for an error handler to fire, if any

    pretty = [(c["function"]["name"], c["id"],
               json.dumps(json.loads(c["function"]["arguments"]), indent=2, ensure_ascii=False))
              for c in TOOL_CALLS]
    assert "\n  " in pretty[0][2]

    def check_page() -> None:
        assert _shown_calls(answer) == pretty
        # The calls are their own elements, not part of the Markdown text.
        assert answer.locator(".content").inner_text() == TOOL_PROSE
        assert answer.locator(".content .tool-call").count() == 0
        assert answer.locator(".tool-call h3.tool-name").count() == 2
        assert page.evaluate("window.__pwned") is None
        assert page.evaluate("window.__bad") == []
        assert page.evaluate("window.__violations") == []
        assert page.locator("#messages :is(script, img, iframe, svg, style)").count() == 0

    assert answer.get_attribute("data-finish") == "tool_calls"
    check_page()
    stored = page.evaluate("window.aioChat.store.active.messages.at(-1)")
    assert stored["content"] == TOOL_PROSE and stored["tool_calls"] == TOOL_CALLS
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_tool_calls.png"))

    # After a reload the calls come back from localStorage, shown the same way.
    page.reload()
    chat.wait_ready()
    answer = chat.last_answer()
    assert _conversation(page) == [("user", "What is the weather in Paris?"),
                                   ("assistant", TOOL_PROSE)]
    page.wait_for_timeout(300)
    check_page()

    # The next question sends the turn with its calls, in OpenAI's shape.
    stub.answers.append("It is sunny.")
    chat.ask("Thanks")
    request = stub.wait_requests(2)
    assert request["messages"] == [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": TOOL_PROSE, "tool_calls": TOOL_CALLS},
        {"role": "user", "content": "Thanks"}]
    _wait_settled(page)
    assert page.locator(".tool-call").count() == 2
    assert page.locator(".msg.assistant").last.locator(".tool-call").count() == 0
    assert not chat.errors and not chat.dialogs


def test_real_answer_with_code_renders_as_markdown(server, chat: ChatPage):
    """One round trip with the real model: what it writes (a fenced Python
    function, for this request at temperature 0) is rendered, while streaming
    and at the end, as the Markdown of its own text."""
    _wait_idle(server)
    chat.page.add_init_script(
        "window.__codeWhileStreaming = false;"
        "new MutationObserver(() => { if (document.querySelector("
        "'.msg.assistant.streaming pre code')) window.__codeWhileStreaming = true; })"
        ".observe(document, {subtree: true, childList: true});")
    chat.open(server)
    chat.wait_ready()
    chat.settings(temperature=0, max_tokens=40)
    chat.ask("Write a Python function that adds two numbers.")
    chat.wait_answer_done()

    text = chat.page.evaluate("window.aioChat.store.active.messages.at(-1).content")
    fences = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    assert fences, f"no fenced code block in the model's answer: {text!r}"
    content = chat.last_answer().locator(".content")
    codes = content.locator("pre > code").all_text_contents()
    assert codes[:len(fences)] == fences, (codes, text)
    assert "```" not in content.inner_text()
    assert chat.page.evaluate("window.__codeWhileStreaming")
    assert not chat.errors and not chat.dialogs


def test_the_block_grid_shades_blocks_shared_by_n_samples(server, chat: ChatPage):
    """An ``n = 2`` completion forks its prompt's blocks: while it runs, the
    engine panel's grid shows them as shared (``b3``), as the server counts them."""

    _wait_idle(server)
    chat.open(server)
    chat.wait_ready()
    body = {"prompt": "Tell me a long story about the sea. " * 8, "n": 2, "max_tokens": 150,
            "temperature": 1.0, "seed": 1, "ignore_eos": True}
    client = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120)

    def post():
        try:
            client.post("/v1/completions", json=body)
        except httpx.HTTPError:
            pass  # closed below: the server aborts the request

    worker = threading.Thread(target=post, daemon=True)
    worker.start()
    try:
        stats = server.wait_for_stats(lambda s: s["num_kv_blocks_shared"] > 0, timeout=30)
        assert stats["num_kv_blocks_shared"] > 0, stats
        chat.page.wait_for_function(
            "() => document.querySelectorAll('#block-grid i.b3').length > 0", timeout=10_000)
    finally:
        client.close()
        worker.join(timeout=30)
    _wait_idle(server)
    assert not chat.errors
