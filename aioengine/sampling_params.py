"""Sampling parameters and the outputs the engine streams back.

Field names and defaults follow vLLM's ``SamplingParams`` so code written for
vLLM reads the same here. Every field is checked in ``__post_init__``; a bad
value raises ``ValueError`` naming the field, which the API turns into an
OpenAI-shaped 400 with ``param`` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Integers cross to the worker as 64-bit msgpack ints; a larger one would fail
# to encode inside the step loop (stalling every request), so refuse it here.
_INT64_LIMIT = 2**63


class SamplingParamError(ValueError):
    """A sampling parameter is out of range; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        n: parallel samples per prompt.
        temperature: 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top one.
        presence_penalty, frequency_penalty: OpenAI penalties in [-2, 2] over
            generated tokens.
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019, §4.1) over
            prompt and generated tokens; 1 disables.
        seed: seed of this request's own random generator.
        stop: strings that end the output (not included unless
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the output (the token is kept).
        ignore_eos: keep going past EOS (benchmarks).
        max_tokens: most new tokens; None means the rest of the context.
        min_tokens: EOS and stop tokens are masked until this many were made.
        logprobs: number of top logprobs to return per token (0 = only the
            sampled token's, None = none).
        prompt_logprobs: unsupported; must be None.
        logit_bias: token id -> bias added to the logit.
        skip_special_tokens: leave special tokens out of text.
        structured_outputs: a grammar the output must match (JSON schema,
            regex, choice, EBNF); None for free text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("n", 1 <= self.n <= 128, "n must be in [1, 128]"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", 0 <= self.top_k < _INT64_LIMIT,
             "top_k must be -1, 0 (disabled) or a positive 64-bit integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0,
             "repetition_penalty must be in (0, 10]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             "max_tokens must be at least 1"),
            ("min_tokens", 0 <= self.min_tokens < _INT64_LIMIT,
             "min_tokens must be >= 0 (and fit in 64 bits)"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             "logprobs must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None, "prompt_logprobs is not supported"),
            ("stop", all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16,
             "stop must be at most 16 non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and 0 <= t < _INT64_LIMIT
                                   for t in self.stop_token_ids),
             "stop_token_ids must be non-negative 64-bit integers"),
            ("logit_bias", all(isinstance(t, int) and 0 <= t < _INT64_LIMIT
                               for t in self.logit_bias),
             "logit_bias keys must be non-negative token ids"),
            ("logit_bias", all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            # Signed 64-bit, so sample i of n can use seed + i without overflowing
            # the worker's 64-bit field.
            ("seed", self.seed is None or -_INT64_LIMIT <= self.seed < _INT64_LIMIT,
             "seed must be a signed 64-bit integer"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass
class CompletionOutput:
    """One sample of a request, cumulative so far.

    Attributes:
        index: sample index in [0, n).
        text: all text generated so far (stop string removed).
        token_ids: all generated token ids so far.
        delta_text, delta_token_ids: what this update added.
        logprobs: per generated token, {token_id: logprob} of the sampled token
            and the top ``SamplingParams.logprobs`` alternatives.
        finish_reason: None while running; "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended it, if any.
        cumulative_logprob: sum of the tokens' logprobs (set by beam search).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine yields for a request at each step it progressed.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt as tokens.
        outputs: one ``CompletionOutput`` per sample.
        finished: every sample has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: set when the engine ended the request abnormally (worker crash).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
