"""Tool-call parsers: the model's text -> content and tool calls, incrementally.

Each parser reads the whole text generated so far and says how much of it is
settled content and which calls it holds, with the raw text of each call's
arguments so far. The arguments of a call are the exact characters the model
wrote for that JSON value, and a longer text only ever extends them, so
``ToolCallStreamer`` can stream the new characters as OpenAI
``delta.tool_calls`` fragments: the fragments join to exactly the arguments a
non-streamed response returns (which runs the same streamer on the final
text at once).

Formats (``--tool-call-parser``):
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks after optional content (Hermes 2 Pro, Qwen 2.5, the injected prompt).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``, several separated by ``;``).
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of calls.
- ``json``: a JSON array of calls and nothing else: a forced call's grammar
  (``constraint.py``).

A call object normally names the function first; one that does not is
returned only once complete, with its arguments re-serialised.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:\s*(?=[{\[])')


@dataclass
class PartialCall:
    """A tool call as far as the text goes."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class ParseResult:
    content_end: int  # text[:content_end] is settled content
    calls: list[PartialCall] = field(default_factory=list)
    content: str | None = None  # overrides text[:content_end] (a final text that held no call)


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at ``text[start]``,
    or None when the text stops inside it."""
    depth, in_string, escaped = 0, False, False
    for j in range(start, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def scan_call(text: str, pos: int) -> tuple[PartialCall | None, int | None]:
    """The call object at ``text[pos:]`` (after whitespace) and its end.

    Returns ``(call or None, end or None)``: no call yet when the head is
    incomplete (or names the function last and is not closed); ``end`` None
    while the object is open. A closed object that is not a call gives
    ``(None, end)``.
    """
    head = _CALL_HEAD.match(text, pos)
    obj_start = len(text) - len(text[pos:].lstrip())
    if obj_start >= len(text) or text[obj_start] != "{":
        return None, (obj_start if obj_start < len(text) else None)
    obj_end = json_value_end(text, obj_start)
    if head is not None:
        name = json.loads(f'"{head.group(1)}"')
        args_end = json_value_end(text, head.end())
        arguments = text[head.end():args_end if args_end is not None else len(text)]
        return PartialCall(name, arguments, obj_end is not None), obj_end
    if obj_end is None:
        return None, None
    try:
        obj = json.loads(text[obj_start:obj_end])
    except ValueError:
        return None, obj_end
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, obj_end
    args = obj.get("arguments", obj.get("parameters", {}))
    return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False), True), obj_end


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that starts ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _scan_array(text: str, start: int) -> list[PartialCall]:
    """Calls of a JSON array opening at ``text[start]`` (``[``)."""
    calls: list[PartialCall] = []
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return calls
        call, end = scan_call(text, pos)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        pos = end


class ToolParser:
    """Base: ``parse(text, final)``. Subclasses set ``name``."""

    name = ""

    def parse(self, text: str, final: bool) -> ParseResult:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParseResult:
        first = text.find(self.START)
        if first < 0:
            end = len(text) if final else len(text) - _held_prefix(text, self.START)
            return ParseResult(end)
        result = ParseResult(first)
        pos = first
        while pos >= 0:
            call, end = scan_call(text, pos + len(self.START))
            if call is not None:
                result.calls.append(call)
            if end is None:
                break
            pos = text.find(self.START, end)
        return result


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParseResult:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
            if not body and not final:
                return ParseResult(0)  # the tag alone: the call has not begun yet
        elif not body or self.PYTHON_TAG.startswith(body):
            return ParseResult(len(text) if final else 0)
        if not body.startswith("{"):
            return ParseResult(len(text))
        calls = []
        pos = len(text) - len(body)
        while pos < len(text):
            call, end = scan_call(text, pos)
            if call is not None:
                calls.append(call)
            if end is None:
                break
            pos = end
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
        if final and not any(c.complete for c in calls):
            return ParseResult(len(text))  # not a call after all: it is the answer
        return ParseResult(0, calls)


class MistralToolParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> ParseResult:
        at = text.find(self.MARKER)
        if at < 0:
            end = len(text) if final else len(text) - _held_prefix(text, self.MARKER)
            return ParseResult(end)
        start = at + len(self.MARKER)
        bracket = len(text) - len(text[start:].lstrip())
        if bracket < len(text) and text[bracket] == "[":
            return ParseResult(at, _scan_array(text, bracket))
        call, _ = scan_call(text, start)  # a single object without the array
        return ParseResult(at, [call] if call is not None else [])


class JsonArrayToolParser(ToolParser):
    name = "json"

    def parse(self, text: str, final: bool) -> ParseResult:
        start = len(text) - len(text.lstrip())
        calls = _scan_array(text, start) if start < len(text) and text[start] == "[" else []
        if final and not calls:
            return ParseResult(len(text))
        return ParseResult(0, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        JsonArrayToolParser)}


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own call format needs (``auto``): Mistral's
    marker, Llama 3's ``<|python_tag|>``/``ipython``, else Hermes (which is
    also the format of the prompt injected for templates without tools)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStreamer:
    """Turns a growing text into content deltas and OpenAI tool-call deltas.

    ``update(text)`` (the whole text so far) returns ``(content_delta,
    tool_call_deltas)``; ``finish(text)`` the same for the final text.
    ``tool_calls`` then holds the complete calls (``{"id", "type",
    "function": {"name", "arguments"}}``), ``content`` the content.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._content_override: str | None = None
        self._sent: list[tuple[str, int]] = []  # per call: id, arguments characters sent
        self._last: ParseResult | None = None
        self.content = ""

    def update(self, text: str, final: bool = False
               ) -> tuple[str, list[dict[str, Any]]]:
        result = self.parser.parse(text, final)
        self._last = result
        if result.content is not None:
            content = result.content
        else:
            content = text[:result.content_end]
        content_delta = content[self._content_sent:] if len(content) > self._content_sent else ""
        self._content_sent = max(self._content_sent, len(content))
        self.content = content
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(result.calls):
            if call.name is None:
                continue
            if index >= len(self._sent):
                call_id = new_tool_call_id()
                self._sent.append((call_id, 0))
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call_id, sent = self._sent[index]
            if len(call.arguments) > sent:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[sent:]}})
                self._sent[index] = (call_id, len(call.arguments))
        return content_delta, deltas

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self.update(text, final=True)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls of the last update, with their ids (arguments as sent)."""
        if self._last is None:
            return []
        return [{"id": self._sent[i][0], "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(self._last.calls) if i < len(self._sent)]
