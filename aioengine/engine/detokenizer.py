"""Incremental detokenization and stop-string matching.

Each request decodes only its new token per step through the tokenizers
library's ``DecodeStream`` (which keeps a small prefix window and returns
nothing until a multi-byte character is complete), so text never holds half
a UTF-8 character and no step re-decodes the whole output.

Stop strings: after each step the tail of the text is searched for every
stop string (only the region the new text can touch). Text that could still
be the start of a stop string is held back from the stream until decided,
and released when the request finishes without a match.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Text of one request's output, stop strings applied.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (the fast backend).
        stop: stop strings.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the text.
        min_tokens: stop strings are not looked for until this many tokens were
            added (as vLLM's ``min_tokens``); a match must end after them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._emitted = 0
        self._num_tokens = 0
        self.min_tokens = min_tokens
        self.stop_reason: str | None = None

    def update(self, token_id: int) -> bool:
        """Add one token. Returns True when a stop string matched (then ``text``
        is cut at the match and nothing more may be added)."""
        piece = self._stream.step(self._tokenizer, token_id)
        self._num_tokens += 1
        if not piece:
            return False
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += piece
        if not self.stop or self._num_tokens <= self.min_tokens:
            return False
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.stop_reason = s
        return True

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        if self.stop_reason is not None or not self.stop:
            return 0
        text = self.text
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0

    def get_delta(self, finished: bool) -> str:
        """New text safe to stream; everything left when ``finished``."""
        end = len(self.text) if finished else len(self.text) - self._holdback()
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
