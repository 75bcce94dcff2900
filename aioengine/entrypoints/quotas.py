"""Per-API-key limits: requests per minute, tokens per minute, concurrent requests,
allowed models (``aioengine serve --api-keys-file keys.yaml``).

The file (YAML or JSON) lists the keys; each has a ``name`` (what logs and
``/metrics`` show; the key itself is never shown) and either the ``key`` or
its ``key_sha256`` (hex), so the file need not hold secrets::

    keys:
      - name: team-a
        key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        requests_per_minute: 60        # optional; absent or null: no limit
        tokens_per_minute: 20000       # prompt + completion tokens
        max_concurrent_requests: 4
        allowed_models: [SmolLM2-135M-Instruct]   # optional; absent: every model
      - name: batch-jobs
        key: sk-local-batch

A top-level list (without ``keys:``) works too. ``--api-key`` adds one key
named ``default`` with no limits.

Limits are token buckets, the usual way rate limits are kept (OpenAI describes
its own the same way): a bucket holds up to one minute's allowance and refills
continuously, so a key that used its whole minute can send again as the bucket
refills instead of waiting for a fixed window to roll over. A request is
admitted when

- the request bucket holds at least 1 (it then takes 1);
- the token bucket holds at least the prompt's tokens (it takes them at once;
  the completion's tokens are taken as they are generated, when the request
  ends, so the level may go below zero and the next request then waits);
- fewer than ``max_concurrent_requests`` of the key's requests are in flight.

Otherwise the answer is 429 ``rate_limit_exceeded`` with ``Retry-After``
(seconds until the bucket holds enough; 1 for the concurrency cap). WebSocket
requests count the same as HTTP ones. Keys are compared as SHA-256 digests with
``hmac.compare_digest`` against every configured key, so the time taken does
not depend on which key matched or how much of it did.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aioengine.entrypoints.protocol import APIError

WINDOW_S = 60.0
"""The period the per-minute limits refer to (seconds); tests shorten it."""

_FIELDS = {"name", "key", "key_sha256", "requests_per_minute", "tokens_per_minute",
           "max_concurrent_requests", "allowed_models"}


@dataclass(frozen=True)
class APIKeySpec:
    """One key's configuration.

    Attributes:
        name: shown in logs and as the ``key_name`` label of ``/metrics``.
        key_sha256: SHA-256 digest of the key (32 bytes).
        requests_per_minute, tokens_per_minute, max_concurrent_requests:
            limits; None means none.
        allowed_models: served model names the key may use; None: all.
    """

    name: str
    key_sha256: bytes
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    allowed_models: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("every API key needs a non-empty 'name'")
        if len(self.key_sha256) != 32:
            raise ValueError(f"key {self.name!r}: key_sha256 must be 64 hex digits")
        for attr in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"key {self.name!r}: {attr} must be a positive integer or "
                                 f"null, got {value!r}")

    @classmethod
    def from_key(cls, name: str, key: str, **limits: Any) -> APIKeySpec:
        return cls(name, hash_key(key), **limits)


def hash_key(key: str) -> bytes:
    """SHA-256 digest of a key as sent by the client."""
    return hashlib.sha256(key.encode()).digest()


def parse_api_keys(data: Any, source: str = "the API keys file") -> list[APIKeySpec]:
    """Key specs from the decoded file (``{"keys": [...]}`` or a list).

    Raises:
        ValueError: a malformed entry, an unknown field, or a name or key used twice.
    """
    entries = data.get("keys") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: expected a non-empty list of keys (under 'keys:')")
    specs: list[APIKeySpec] = []
    for i, entry in enumerate(entries):
        where = f"{source}: key #{i + 1}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: "
                             f"{sorted(_FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}: 'name' must be a string")
        key, digest = entry.get("key"), entry.get("key_sha256")
        if (key is None) == (digest is None):
            raise ValueError(f"{where} ({name}): give exactly one of 'key' and 'key_sha256'")
        if key is not None:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{where} ({name}): 'key' must be a non-empty string")
            raw = hash_key(key)
        else:
            try:
                raw = bytes.fromhex(str(digest))
            except ValueError:
                raise ValueError(f"{where} ({name}): key_sha256 is not hex") from None
        models = entry.get("allowed_models")
        if models is not None:
            if isinstance(models, str):
                models = [models]
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise ValueError(f"{where} ({name}): allowed_models must be a list of names")
            models = tuple(models)
        try:
            specs.append(APIKeySpec(
                name, raw, entry.get("requests_per_minute"), entry.get("tokens_per_minute"),
                entry.get("max_concurrent_requests"), models))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    for attr, what in (("name", "name"), ("key_sha256", "key")):
        values = [getattr(s, attr) for s in specs]
        if len(set(values)) != len(values):
            raise ValueError(f"{source}: the same {what} is listed twice")
    return specs


def load_api_keys(path: str | Path) -> list[APIKeySpec]:
    """Read ``--api-keys-file``: JSON when it parses as JSON, else YAML.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is neither JSON nor YAML, or an entry is malformed.
    """
    path = Path(path)
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: neither JSON nor YAML: {exc}") from None
    return parse_api_keys(data, str(path))


class TokenBucket:
    """``capacity`` units refilled at ``capacity / window_s`` per second.

    Args:
        capacity: the most the bucket holds (one window's allowance).
        window_s: seconds to refill from empty.
        clock: ``time.monotonic`` or a test's fake.
    """

    def __init__(self, capacity: int, window_s: float, clock: Callable[[], float]) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / window_s
        self._clock = clock
        self.level = float(capacity)
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._updated) * self.rate)
        self._updated = now

    def wait_time(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (0: now; ``inf``: never)."""
        self._refill()
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        """Remove ``amount``; the level may go below zero."""
        self._refill()
        self.level -= amount


@dataclass
class KeyState:
    """A key's live counters (what ``/metrics`` shows under its name)."""

    spec: APIKeySpec
    requests: TokenBucket | None
    tokens: TokenBucket | None
    running: int = 0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_rejected: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


class QuotaLease:
    """One admitted request's hold on its key: ``release(completion_tokens)``
    once when it ends (idempotent), which frees its concurrency slot and takes
    its completion tokens from the key's token bucket."""

    def __init__(self, state: KeyState) -> None:
        self.state = state
        self.released = False

    def release(self, completion_tokens: int) -> None:
        if self.released:
            return
        self.released = True
        state = self.state
        state.running -= 1
        state.num_generation_tokens += completion_tokens
        if state.tokens is not None and completion_tokens:
            state.tokens.take(completion_tokens)


class QuotaManager:
    """The configured keys and their limits.

    Args:
        specs: the keys (``load_api_keys``, plus ``--api-key`` as ``default``).
        window_s: the period of the per-minute limits (seconds).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, specs: Iterable[APIKeySpec], window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.keys = [
            KeyState(s, None if s.requests_per_minute is None
                     else TokenBucket(s.requests_per_minute, window_s, clock),
                     None if s.tokens_per_minute is None
                     else TokenBucket(s.tokens_per_minute, window_s, clock))
            for s in specs]

    def authenticate(self, key: str | None) -> KeyState | None:
        """The state of the key the client sent, or None (401).

        Every configured digest is compared (constant time each, no early exit).
        """
        if key is None:
            return None
        digest = hash_key(key)
        found = None
        for state in self.keys:
            if hmac.compare_digest(digest, state.spec.key_sha256):
                found = state
        return found

    def _reject(self, state: KeyState, reason: str, message: str,
                retry_after: float | None, status: int = 429,
                code: str = "rate_limit_exceeded", param: str | None = None) -> APIError:
        state.num_rejected[reason] = state.num_rejected.get(reason, 0) + 1
        return APIError(status, message, param, code, retry_after=retry_after)

    def check_model(self, state: KeyState, model: str) -> None:
        """Raises ``APIError`` 404 ``model_not_found`` (OpenAI's answer for a
        model the key has no access to) unless the key may use ``model``."""
        allowed = state.spec.allowed_models
        if allowed is not None and model not in allowed:
            raise self._reject(state, "model", f"The model '{model}' does not exist or this "
                               "API key has no access to it", None, 404, "model_not_found",
                               "model")

    def admit(self, state: KeyState, model: str, prompt_tokens: int) -> QuotaLease:
        """Admit one request of ``prompt_tokens`` tokens for ``model``, or raise.

        Raises:
            APIError: 404 (model not allowed), 429 ``rate_limit_exceeded`` with
                ``retry_after`` (requests or tokens per minute, concurrency).
        """
        spec = state.spec
        self.check_model(state, model)
        if spec.max_concurrent_requests is not None and \
                state.running >= spec.max_concurrent_requests:
            raise self._reject(state, "concurrency", f"Rate limit reached for API key "
                               f"'{spec.name}': at most {spec.max_concurrent_requests} "
                               "concurrent requests", 1.0)
        if state.requests is not None:
            wait = state.requests.wait_time(1)
            if wait > 0:
                raise self._reject(state, "requests", f"Rate limit reached for API key "
                                   f"'{spec.name}' on requests per minute: limit "
                                   f"{spec.requests_per_minute}; try again in {wait:.1f} s",
                                   wait)
        if state.tokens is not None:
            wait = state.tokens.wait_time(prompt_tokens)
            if wait > 0:
                if math.isinf(wait):
                    message = (f"the prompt ({prompt_tokens} tokens) exceeds API key "
                               f"'{spec.name}''s tokens per minute ({spec.tokens_per_minute})")
                    wait = self.window_s
                else:
                    message = (f"Rate limit reached for API key '{spec.name}' on tokens per "
                               f"minute: limit {spec.tokens_per_minute}; try again in "
                               f"{wait:.1f} s")
                raise self._reject(state, "tokens", message, wait)
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(prompt_tokens)
        state.running += 1
        state.num_requests += 1
        state.num_prompt_tokens += prompt_tokens
        return QuotaLease(state)
