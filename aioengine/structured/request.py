"""One request's constraint: its compiled grammar (maybe still compiling) and
the matcher that follows the tokens it has generated."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from aioengine.structured.params import StructuredOutputsParams


class StructuredOutputRequest:
    """The grammar state of one (child) request.

    Attributes:
        params: what the output must match.
        grammar_future: resolves to the ``CompiledGrammar`` (compiled in the
            manager's thread) or raises ``GrammarError``.
        matcher: created once the grammar is ready; advanced by every sampled
            token (``accept_token``).
    """

    def __init__(self, params: StructuredOutputsParams, grammar_future: Future,
                 backend) -> None:
        self.params = params
        self._backend = backend
        self.grammar_future = grammar_future
        self.matcher: Any = None
        self.failed: str | None = None

    def is_ready(self) -> bool:
        """True once the compile finished (never blocks); then ``matcher`` is
        set, or ``failed`` holds the compile error."""
        if self.matcher is not None:
            return True
        if not self.grammar_future.done():
            return False
        exc = self.grammar_future.exception()
        if exc is not None:
            self.failed = str(exc)
            return True  # schedulable: its mask then allows only EOS
        self.matcher = self._backend.matcher(self.grammar_future.result())
        return True

    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher; False when the grammar rejects the token (only
        possible when something outside the mask chose it, e.g. ``ignore_eos``)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (EOS) was accepted."""
        return self.matcher is not None and bool(self.matcher.is_terminated())
