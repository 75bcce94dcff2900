r"""``aioengine chat``: a terminal chat client over the WebSocket API (``/v1/ws``).

It talks to a running server (``--url ws://HOST:PORT/v1/ws``) or, without
``--url``, starts the same server app in this process on a free loopback port
(uvicorn in a background thread) and talks to that, so both paths speak the
one protocol written down in docs/websocket.md.

Terminal behaviour: answers stream as they come and, once complete, are
shown again rendered as Markdown (``rich``) when they fit on the screen; the
conversation is kept and sent whole each turn (the server's prefix cache makes
the repeat cheap); ``/clear`` (or ``/reset``) and ``/system TEXT`` change it;
``/quit``, ``/exit`` or Ctrl-D leave; Ctrl-C during an answer sends ``cancel``
and returns to the prompt, Ctrl-C at the prompt clears the line. Esc then
Enter, or a line ending in ``\``, continues the message on a new line. Input
history persists across runs (prompt_toolkit's ``FileHistory`` in
``$XDG_STATE_HOME/aioengine/chat_history``, default
``~/.local/state/aioengine/chat_history``; ``--history-file`` or env
``AIOENGINE_CHAT_HISTORY`` override it, an empty value keeps none). After each
answer one line shows tokens/s, time to first token and the prompt tokens the
prefix cache supplied.

Importing this module stays light (``cli.py`` imports it to register the
subcommand): websockets, prompt_toolkit and rich load when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELP = """\
/clear          forget the conversation (the system prompt stays); also /reset
/system TEXT    set the system prompt and start over; /system alone clears it
/temperature X  sampling temperature (0 = greedy)
/max-tokens N   longest answer in tokens
/quit, /exit    leave (so does Ctrl-D on an empty line)
/help           this list
Esc then Enter, or a line ending in \\, starts a new line in the message.
Ctrl-C stops an answer; Up/Down walk the input history (kept across runs)."""

HISTORY_ENV = "AIOENGINE_CHAT_HISTORY"

CANCEL_GRACE_S = 10.0   # how long to wait for the server's "done" after a cancel
CONNECT_TIMEOUT_S = 10.0

# C0/C1 control characters other than tab and newline: model output must not be
# able to move the cursor, recolour or retitle the user's terminal.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` without control characters (escape sequences lose their ESC)."""
    return _CONTROL_CHARS.sub("", text)


class ChatError(RuntimeError):
    """The server refused a request or the connection failed (message for the user)."""


class QuitChat(Exception):
    """``/quit`` or ``/exit``: leave the loop (exit status 0)."""


def history_path(override: str | None = None) -> Path | None:
    """Where the input history lives: ``override`` (``--history-file``), else env
    ``AIOENGINE_CHAT_HISTORY``, else ``$XDG_STATE_HOME/aioengine/chat_history``
    (``~/.local/state/...`` without it, per the XDG base directory spec). An
    empty override or variable means no file: the history lasts one run."""
    chosen = override if override is not None else os.environ.get(HISTORY_ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen else None
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "aioengine" / "chat_history"


def render_markdown(console: Any, text: str) -> None:
    """Print ``text`` as Markdown (headings, lists, code blocks) on ``console``."""
    from rich.markdown import Markdown

    console.print(Markdown(text, code_theme="monokai"))


def screen_rows(text: str, width: int) -> int:
    """Terminal rows ``text`` took when written raw at the start of a line, wrapping
    at ``width`` columns (wide characters count twice)."""
    from rich.cells import cell_len

    width = max(1, width)
    return sum(max(1, -(-cell_len(line) // width)) for line in text.split("\n"))


@dataclass
class ChatSettings:
    """What the client sends with each request besides the conversation."""

    system: str = ""
    temperature: float = 0.7
    max_tokens: int = 512


@dataclass
class Answer:
    """One finished answer: the server's ``done`` message in typed form.

    Attributes:
        text: the whole answer.
        finish_reason: ``stop``, ``length``, ``abort`` (cancelled) or None.
        prompt_tokens, cached_tokens, completion_tokens: token counts;
            ``cached_tokens`` came from the prefix cache.
        ttft_s: time to first token in seconds (None if no token came).
        tokens_per_s: decode speed after the first token (None for < 2 tokens).
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None

    @classmethod
    def from_done(cls, done: dict[str, Any]) -> Answer:
        usage = done.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(text=done.get("text") or "", finish_reason=done.get("finish_reason"),
                   prompt_tokens=usage.get("prompt_tokens", 0),
                   cached_tokens=details.get("cached_tokens", 0),
                   completion_tokens=usage.get("completion_tokens", 0),
                   ttft_s=done.get("ttft_s"), tokens_per_s=done.get("tokens_per_s"))

    def summary(self) -> str:
        """One line of figures, e.g. ``[9 tokens, 31.0 tok/s, TTFT 85 ms, prompt 36 tokens
        (32 cached)]``."""
        tps = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:.1f}"
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1000:.0f}"
        plural = "" if self.completion_tokens == 1 else "s"
        parts = [f"{self.completion_tokens} token{plural}", f"{tps} tok/s", f"TTFT {ttft} ms",
                 f"prompt {self.prompt_tokens} tokens ({self.cached_tokens} cached)"]
        if self.finish_reason == "length":
            parts.append("max tokens reached")
        return "[" + ", ".join(parts) + "]"


# -- the protocol side ---------------------------------------------------------------------------


class WSChatConnection:
    """One WebSocket to ``/v1/ws``, one request at a time.

    Args:
        url: ``ws://HOST:PORT/v1/ws``.
        api_key: sent in an ``auth`` message when the server's ``hello`` asks
            for one (kept out of the URL so it stays out of access logs).
    """

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url
        self.api_key = api_key
        self.model = ""
        self._ws: Any = None
        self._ids = itertools.count(1)
        self._current_id: str | None = None
        self._cancel_sent = False

    @property
    def connected(self) -> bool:
        from websockets.protocol import State

        return self._ws is not None and self._ws.state is State.OPEN

    async def connect(self) -> None:
        """Connect and authenticate.

        Raises:
            ChatError: unreachable server, bad handshake or a refused key.
        """
        from websockets.asyncio.client import connect
        from websockets.exceptions import WebSocketException

        try:
            self._ws = await asyncio.wait_for(
                connect(self.url, max_size=None, open_timeout=CONNECT_TIMEOUT_S),
                CONNECT_TIMEOUT_S)
            hello = await self._recv(CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError, WebSocketException) as exc:
            reason = str(exc) or type(exc).__name__
            raise ChatError(f"cannot connect to {self.url}: {reason}") from None
        if hello.get("type") != "hello":
            raise ChatError(f"unexpected first message from the server: {hello}")
        self.model = hello.get("model", "")
        if hello.get("auth_required"):
            if not self.api_key:
                await self.close()
                raise ChatError("the server needs an API key: pass --api-key "
                                "(or set AIOENGINE_API_KEY)")
            await self._send({"type": "auth", "api_key": self.api_key})
            reply = await self._recv(CONNECT_TIMEOUT_S)
            if reply.get("type") != "auth_ok":
                await self.close()
                raise ChatError(f"authentication failed: {reply.get('message', reply)}")

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
            self._ws = None

    async def _send(self, message: dict[str, Any]) -> None:
        await self._ws.send(json.dumps(message))

    async def _recv(self, timeout: float | None = None) -> dict[str, Any]:
        raw = await asyncio.wait_for(self._ws.recv(), timeout)
        return json.loads(raw)

    async def chat(self, messages: list[dict[str, str]], settings: ChatSettings,
                   on_delta: Callable[[str], None]) -> Answer:
        """Stream one answer; ``on_delta(text)`` for each piece as it arrives.

        A ``cancel()`` meanwhile ends it early with ``finish_reason="abort"``.

        Raises:
            ChatError: the server answered with an error, or the connection dropped.
        """
        from websockets.exceptions import ConnectionClosed

        request_id = f"c{next(self._ids)}"
        self._current_id, self._cancel_sent = request_id, False
        try:
            await self._send({"type": "chat", "id": request_id, "messages": messages,
                              "temperature": settings.temperature,
                              "max_tokens": settings.max_tokens})
            parts: list[str] = []
            while True:
                timeout = CANCEL_GRACE_S if self._cancel_sent else None
                try:
                    message = await self._recv(timeout)
                except TimeoutError:
                    # The server never confirmed the cancel; do not hang the prompt.
                    return Answer("".join(parts), "abort")
                if message.get("id") != request_id:
                    continue
                kind = message.get("type")
                if kind == "delta":
                    parts.append(message.get("text", ""))
                    on_delta(message.get("text", ""))
                elif kind == "done":
                    return Answer.from_done(message)
                elif kind == "error":
                    raise ChatError(f"server error {message.get('code')}: "
                                    f"{message.get('message')}")
        except ConnectionClosed:
            self._ws = None
            raise ChatError("the connection to the server was lost") from None
        finally:
            self._current_id = None

    def cancel(self) -> None:
        """Ask the server to stop the current answer (safe to call from a signal handler
        scheduled on the loop, and more than once)."""
        if self._current_id is None or self._cancel_sent or not self.connected:
            return
        self._cancel_sent = True
        # Keep a reference: the loop holds tasks only weakly.
        self._cancel_task = asyncio.ensure_future(
            self._send({"type": "cancel", "id": self._current_id}))


# -- the terminal side -----------------------------------------------------------------------------


@dataclass
class Conversation:
    """The turns so far plus the system prompt; ``messages()`` is what gets sent."""

    settings: ChatSettings
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user_text: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.settings.system}] if self.settings.system \
            else []
        return [*head, *self.turns, {"role": "user", "content": user_text}]

    def add(self, user_text: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user_text},
                       {"role": "assistant", "content": answer}]

    def reset(self) -> None:
        self.turns.clear()


class ChatREPL:
    """The read-answer loop on a terminal (prompt_toolkit for input, rich for notes).

    Args:
        connection: a connected ``WSChatConnection``.
        settings: initial system prompt, temperature and max tokens.
        where: how to describe the server in the banner.
    """

    PROMPT = "you> "

    CONTINUATION = "...  "

    def __init__(self, connection: WSChatConnection, settings: ChatSettings, where: str,
                 history_file: Path | None = None) -> None:
        from rich.console import Console

        self.connection = connection
        self.conversation = Conversation(settings)
        self.where = where
        self.console = Console(highlight=False, soft_wrap=True)
        self.streaming = False
        self.interactive = sys.stdin.isatty()
        self.history_file = history_file
        self._session: Any = None

    def _history(self) -> Any:
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        if self.history_file is None:
            return InMemoryHistory()
        try:
            self.history_file.parent.mkdir(parents=True, exist_ok=True)
            self.history_file.touch(exist_ok=True)
        except OSError as exc:
            self.note(f"(history not kept: {self.history_file}: {exc.strerror or exc})",
                      "yellow")
            return InMemoryHistory()
        return FileHistory(str(self.history_file))

    @staticmethod
    def _key_bindings() -> Any:
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("enter")
        def _(event: Any) -> None:
            buffer = event.current_buffer
            if buffer.document.is_cursor_at_the_end and buffer.text.endswith("\\"):
                buffer.delete_before_cursor(1)  # "line\" + Enter: go on below
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        @bindings.add("escape", "enter")
        def _(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        return bindings

    def note(self, text: str, style: str = "dim") -> None:
        from rich.text import Text

        self.console.print(Text(text, style=style))

    async def read_line(self) -> str:
        """The next line of input. Raises EOFError on Ctrl-D / end of input and
        KeyboardInterrupt on Ctrl-C at the prompt."""
        if not self.interactive:
            loop = asyncio.get_running_loop()

            async def next_line() -> str:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    raise EOFError
                return line.rstrip("\n")

            text = await next_line()
            while text.endswith("\\"):
                text = text[:-1] + "\n" + await next_line()
            return text
        if self._session is None:
            from prompt_toolkit import PromptSession

            self._session = PromptSession(
                history=self._history(), key_bindings=self._key_bindings(),
                prompt_continuation=lambda width, line, wrap: self.CONTINUATION)
        # Raw mode turns Ctrl-C into a key press here; our own SIGINT handler
        # (for Ctrl-C during an answer) must stay installed, so prompt_toolkit
        # is told not to swap signal handlers.
        return await self._session.prompt_async(self.PROMPT, handle_sigint=False)

    def on_sigint(self) -> None:
        if self.streaming:
            self.connection.cancel()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.on_sigint)
        try:
            model = self.connection.model or "the model"
            self.note(f"aioengine chat - {model} at {self.where}", "bold")
            self.note("Enter sends, Esc Enter (or a trailing \\) adds a line. /help lists "
                      "commands; Ctrl-C stops an answer, /quit or Ctrl-D quits.")
            while True:
                try:
                    line = await self.read_line()
                except KeyboardInterrupt:
                    continue  # Ctrl-C at the prompt drops the line, as in a shell
                except EOFError:
                    break
                text = line.strip()
                if not text:
                    continue
                if text.startswith("/"):
                    try:
                        self.command(text)
                    except QuitChat:
                        break
                else:
                    await self.ask(line)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            await self.connection.close()

    def command(self, text: str) -> None:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        settings = self.conversation.settings
        if name in ("/quit", "/exit"):
            raise QuitChat
        if name in ("/clear", "/reset"):
            self.conversation.reset()
            self.note("(history cleared)")
        elif name == "/system":
            settings.system = arg
            self.conversation.reset()
            self.note(f"(system prompt set: {arg!r}; history cleared)" if arg
                      else "(system prompt cleared; history cleared)")
        elif name in ("/temperature", "/temp"):
            try:
                value = float(arg)
                if not 0 <= value <= 2:
                    raise ValueError
            except ValueError:
                self.note("usage: /temperature X  (0 <= X <= 2)", "red")
                return
            settings.temperature = value
            self.note(f"(temperature {value})")
        elif name == "/max-tokens":
            if not arg.isdigit() or int(arg) < 1:
                self.note("usage: /max-tokens N  (N >= 1)", "red")
                return
            settings.max_tokens = int(arg)
            self.note(f"(max tokens {settings.max_tokens})")
        elif name in ("/help", "/?"):
            self.note(HELP, "")
        else:
            self.note(f"unknown command {name}; /help lists them", "red")

    async def ask(self, user_text: str) -> None:
        out = sys.stdout
        shown: list[str] = []

        def on_delta(piece: str) -> None:
            piece = terminal_safe(piece)
            shown.append(piece)
            out.write(piece)
            out.flush()

        try:
            if not self.connection.connected:
                self.note("(reconnecting...)")
                await self.connection.connect()
            self.streaming = True
            answer = await self.connection.chat(self.conversation.messages(user_text),
                                                self.conversation.settings, on_delta)
        except ChatError as exc:
            out.write("\n")
            self.note(f"error: {exc}", "red")
            return
        finally:
            self.streaming = False
        out.write("\n")
        out.flush()
        self.show_as_markdown("".join(shown))
        # A stopped answer stays in the history as far as it got, like on the page.
        self.conversation.add(user_text, answer.text)
        if answer.finish_reason == "abort":
            self.note("(stopped)", "yellow")
        self.note(answer.summary())


    def show_as_markdown(self, streamed: str) -> None:
        """Replace the raw text just streamed with its Markdown rendering.

        Only on a terminal, and only when the text fits on the screen: the
        cursor can move back up over it and clear it then; a longer answer
        stays as it streamed (its top has scrolled out of reach).
        """
        if not (self.interactive and sys.stdout.isatty() and streamed.strip()):
            return
        width, height = self.console.size
        rows = screen_rows(streamed, width)
        if rows >= height - 1:
            return
        sys.stdout.write(f"\x1b[{rows}F\x1b[J")  # up to the answer's first row, clear below
        sys.stdout.flush()
        render_markdown(self.console, streamed)


# -- an embedded server ----------------------------------------------------------------------------


class EmbeddedServer:
    """The server app on a free 127.0.0.1 port in a background thread.

    uvicorn in a non-main thread leaves signal handling alone, so Ctrl-C stays
    with the chat loop; the engine's worker subprocess ignores SIGINT.
    """

    def __init__(self, config: Any) -> None:
        import socket

        import uvicorn

        from aioengine.entrypoints.openai.api_server import build_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = build_app(config)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, loop="uvloop", lifespan="on",
            log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="aioengine-server",
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def start(self) -> None:
        """Start and wait until it serves.

        Raises:
            ChatError: the server thread ended before it was ready.
        """
        import time

        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise ChatError("the embedded engine failed to start (see the log above)")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


# -- the subcommand --------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``aioengine chat`` (called by ``cli.build_parser``)."""
    from aioengine.entrypoints.cli import add_engine_args

    p = subparsers.add_parser(
        "chat", help="chat in the terminal (with a server, or an engine started here)",
        description="Chat in the terminal over the WebSocket API. With --url, talk to a "
                    "running server; without it, start the engine in this process (the "
                    "engine flags below apply only then).")
    p.add_argument("--url", default=None,
                   help="WebSocket URL of a running server, e.g. ws://127.0.0.1:8000/v1/ws")
    p.add_argument("--api-key", default=os.environ.get("AIOENGINE_API_KEY"),
                   help="API key for the server (default: env AIOENGINE_API_KEY, else none)")
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature of the answers; 0 is greedy (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="most tokens in one answer (default: %(default)s)")
    p.add_argument("--history-file", default=None, metavar="PATH",
                   help=f"input history kept across runs (default: $XDG_STATE_HOME/aioengine/"
                        f"chat_history or ~/.local/state/aioengine/chat_history; env "
                        f"{HISTORY_ENV}; '' keeps none)")
    add_engine_args(p)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> None:
    """Entry point of ``aioengine chat``."""
    from rich.console import Console

    if not 0 <= args.temperature <= 2:
        sys.exit("aioengine: error: --temperature must be between 0 and 2")
    if args.max_tokens < 1:
        sys.exit("aioengine: error: --max-tokens must be at least 1")
    settings = ChatSettings(system=args.system, temperature=args.temperature,
                            max_tokens=args.max_tokens)
    embedded: EmbeddedServer | None = None
    url, where = args.url, args.url
    if url is None:
        from aioengine.entrypoints.cli import _engine_config

        config = _engine_config(args)
        console = Console(stderr=True)
        console.print(f"[bold]aioengine[/] loading {config.model.model_path} ...")
        embedded = EmbeddedServer(config)
        try:
            embedded.start()
        except ChatError as exc:
            sys.exit(f"aioengine: error: {exc}")
        url, where = embedded.url, "an engine in this process"

    async def main() -> None:
        connection = WSChatConnection(url, args.api_key)
        await connection.connect()
        await ChatREPL(connection, settings, where, history_path(args.history_file)).run()

    try:
        asyncio.run(main())
    except ChatError as exc:
        sys.exit(f"aioengine: error: {exc}")
    except KeyboardInterrupt:  # Ctrl-C before the prompt was up
        sys.exit(130)
    finally:
        if embedded is not None:
            embedded.stop()
