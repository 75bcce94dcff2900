"""What a request asks its output to match (vLLM's ``StructuredOutputsParams``).

Exactly one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``
is set. The API maps OpenAI's ``response_format`` and vLLM's
``structured_outputs`` / ``guided_*`` fields onto it; ``key()`` names the
compiled grammar in the cache, so requests with the same schema share one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


class GrammarError(ValueError):
    """The grammar library cannot compile a schema, regex or grammar.

    ``param`` names the request field it came from (set by the API).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# xgrammar prefixes its errors with "[hh:mm:ss] /project/cpp/file.cc:123: ".
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def clean_library_message(message: str) -> str:
    """A grammar library's error text without its source-location prefix."""
    return _NATIVE_PREFIX.sub("", message.strip()).strip()


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint.

    Attributes:
        json: a JSON Schema (dict or its JSON text).
        json_object: any JSON object (``response_format: json_object``).
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF style, as xgrammar takes it; a rule
            named ``root`` is the start).
        whitespace_flexible: allow any whitespace between JSON tokens; off by
            default (compact JSON, as vLLM's xgrammar backend does), which keeps
            a weak model from filling ``max_tokens`` with newlines.

    Raises:
        ValueError: none or more than one constraint is set, or one is empty.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise ValueError("exactly one of json, json_object, regex, choice and grammar "
                             "must be set")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.regex is not None and not self.regex:
            raise ValueError("regex must not be empty")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar must not be empty")

    def key(self) -> tuple[str, str]:
        """``(kind, spec)``: what the compile cache is keyed by."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(
                self.json, separators=(",", ":"))  # key order matters: it is the output's
            return ("json" if not self.whitespace_flexible else "json_ws", spec)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        assert self.grammar is not None
        return ("grammar", self.grammar)
