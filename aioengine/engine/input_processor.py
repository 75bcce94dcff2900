"""Input processing: prompts and conversations into validated engine requests.

The front of the engine (vLLM v1's ``InputProcessor``): it tokenizes text,
renders chat templates, and checks that a request can ever run before
anything is queued, so every refusal is a clean 400 and the engine core sees
only token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aioengine.core.kv_cache_manager import cdiv
from aioengine.errors import RequestRejected, SamplingParamError
from aioengine.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """What ``EngineCore`` queues: token ids and settings, no text.

    Attributes:
        max_tokens: the resolved limit of new tokens (never None here).
        arrival_time: ``time.monotonic()`` seconds.
        seed: of this request's own generator; None lets the core draw one.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = 0.0
    seed: int | None = None


class InputProcessor:
    """Tokenization, chat rendering and validation for one model and cache.

    Args:
        tokenizer: the model's HF tokenizer.
        max_model_len: context length in tokens (from the worker handshake).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the whole cache (from the worker handshake).
    """

    def __init__(
        self, tokenizer: Any, max_model_len: int, block_size: int, num_blocks: int
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._vocab_size = len(tokenizer)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a conversation under the model's own chat template
        (``tools``: OpenAI tool entries, for a template that renders them).

        Raises:
            Exception: whatever the template raises (jinja2 ``TemplateError``...).
        """
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
        )
        return self.tokenize(text, add_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request can ever run; returns its resolved ``max_tokens``.

        Raises:
            RequestRejected: empty prompt, token ids outside the vocabulary,
                prompt or prompt + max_tokens beyond the context, or more
                blocks than the whole cache.
            SamplingParamError: ``logit_bias`` names a token outside the vocabulary,
                or ``min_tokens`` with ``stop_token_ids`` that ban every token.
        """
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if any(not 0 <= t < self._vocab_size for t in prompt_token_ids):
            raise RequestRejected("the prompt holds token ids outside the vocabulary", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {_tokens(num_prompt_tokens)}, leaving no room to generate",
                "prompt",
            )
        max_tokens = (
            params.max_tokens
            if params.max_tokens is not None
            else self.max_model_len - num_prompt_tokens
        )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt ({_tokens(num_prompt_tokens)}) plus max_tokens ({max_tokens}) exceeds it",
                "max_tokens",
            )
        if cdiv(num_prompt_tokens + max_tokens, self.block_size) > self.num_blocks:
            raise RequestRejected(
                f"the prompt ({_tokens(num_prompt_tokens)}) plus max_tokens ({max_tokens}) needs "
                f"more KV blocks than the whole cache holds ({self.num_blocks} blocks of "
                f"{self.block_size} tokens)",
                "max_tokens",
            )
        if any(t >= self._vocab_size for t in params.logit_bias):
            raise SamplingParamError(
                "logit_bias", "logit_bias names a token id outside the vocabulary"
            )
        if params.min_tokens and len(params.stop_token_ids) >= self._vocab_size - 1:
            banned = {t for t in params.stop_token_ids if t < self._vocab_size}
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if not params.ignore_eos and eos is not None:
                banned.add(eos)
            if len(banned) >= self._vocab_size:  # min_tokens would mask every token
                raise SamplingParamError(
                    "min_tokens",
                    "min_tokens cannot be met: stop_token_ids (with EOS) hold every token "
                    "of the vocabulary, so no token may be generated before min_tokens",
                )
        return max_tokens

    def process_inputs(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> EngineCoreRequest:
        """A validated ``EngineCoreRequest`` (see ``validate`` for the errors)."""
        max_tokens = self.validate(prompt_token_ids, params)
        return EngineCoreRequest(
            request_id,
            list(prompt_token_ids),
            params,
            max_tokens,
            priority,
            cache_salt,
            time.monotonic() if arrival_time is None else arrival_time,
        )


def _tokens(n: int) -> str:
    """``"1 token"``, ``"5 tokens"``: counts in error messages."""
    return f"{n} token" if n == 1 else f"{n} tokens"
