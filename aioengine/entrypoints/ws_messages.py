"""The messages ``/v1/ws`` sends, as types (docs/websocket.md is the protocol).

Each is a ``msgspec.Struct`` tagged by its ``type`` field, so a misspelt
field is a type error (mypy) rather than a message the client silently
misreads; ``encode`` turns one into the JSON text frame. Optional fields left
``UNSET`` are omitted from the JSON. Client messages are parsed where they are
handled (``chat``/``completion`` bodies by the OpenAI request models of
``protocol.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from aioengine.engine.core import EngineStats

_UnsetStr = str | msgspec.UnsetType
_UnsetInt = int | msgspec.UnsetType


class Hello(msgspec.Struct, tag="hello", tag_field="type"):
    """First message on every connection."""

    model: str
    max_model_len: int
    max_concurrent_requests: int
    auth_required: bool


class AuthOk(msgspec.Struct, tag="auth_ok", tag_field="type"):
    """The ``auth`` message's key was accepted."""


class Pong(msgspec.Struct, tag="pong", tag_field="type"):
    """Answer to ``ping``."""


class Delta(msgspec.Struct, tag="delta", tag_field="type"):
    """New output of request ``id``: text and token ids; with tools, the
    parsed ``content`` and OpenAI-shaped ``tool_calls`` fragments."""

    id: str
    text: str
    token_ids: list[int]
    content: _UnsetStr = msgspec.UNSET
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET


class Done(msgspec.Struct, tag="done", tag_field="type"):
    """The one last message of request ``id`` (times in seconds)."""

    id: str
    finish_reason: str | None
    stop_reason: str | int | None
    text: str
    usage: dict[str, Any]
    ttft_s: float | None
    tokens_per_s: float | None
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET


class Error(msgspec.Struct, tag="error", tag_field="type"):
    """A request that could not start, or a bad message; ``code`` is the HTTP
    status the same problem gets on the HTTP API, ``retry_after`` seconds."""

    message: str
    code: int
    id: _UnsetStr = msgspec.UNSET
    param: _UnsetStr = msgspec.UNSET
    retry_after: _UnsetInt = msgspec.UNSET


ServerMessage = Hello | AuthOk | Pong | Delta | Done | Error

_encoder = msgspec.json.Encoder()


def encode(message: ServerMessage) -> str:
    """The JSON text frame of ``message``."""
    return _encoder.encode(message).decode()


def encode_stats(time_s: float, stats: EngineStats) -> str:
    """The ``stats`` message: ``EngineStats``' fields flattened beside ``time``
    (Unix seconds)."""
    return _encoder.encode({"type": "stats", "time": time_s, **dataclasses.asdict(stats)}).decode()


def decode(text: str | bytes) -> ServerMessage:
    """Parse a server message (clients and tests).

    Raises:
        msgspec.ValidationError: not one of the message types.
    """
    return msgspec.json.decode(text, type=ServerMessage)
