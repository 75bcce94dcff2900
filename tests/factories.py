"""Factories for the unit tier: no model, no subprocess, no model file.

In the style of vLLM's ``tests/v1/utils.py`` (``make_request``...):

- ``make_tokenizer()``: a real HF fast tokenizer built in memory (byte-level,
  one token per byte, no merges, a ChatML template), so tokenization,
  streaming detokenization and chat rendering run the real libraries.
- ``FakeExecutor``: an ``Executor`` whose "model" samples a letter that is a
  function of the whole sequence so far (a token lost, repeated or reordered
  changes every later one, as with a real model). Every step crosses the
  real msgpack encoding of ``aioengine.ipc.messages`` both ways.
- ``make_request``: a scheduler ``Request``; ``make_config``: an
  ``EngineConfig`` for the in-process engine; ``start_fake_engine``: a real
  ``AsyncEngine`` on the two.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

from aioengine.config import EngineConfig
from aioengine.errors import WorkerDiedError
from aioengine.executor.abstract import Executor
from aioengine.ipc.messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    decode_from_worker,
    decode_to_worker,
    encode,
)
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LETTERS = "abcdefghijklmnopqrstuvwxyz "
_tokenizer_cache: list[Any] = []


def make_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: 256 byte tokens (GPT-2's byte-to-unicode
    alphabet), then ``<|endoftext|>`` (256), ``<|im_start|>`` (257) and
    ``<|im_end|>`` (258, the EOS). Built once per process."""
    if _tokenizer_cache:
        return _tokenizer_cache[0]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    _tokenizer_cache.append(tokenizer)
    return tokenizer


def letter_ids() -> list[int]:
    tokenizer = make_tokenizer()
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in LETTERS]


def next_token(token_ids: list[int], letters: list[int], seed: int = 0) -> int:
    """The stand-in model: a letter chosen by the whole sequence so far (and,
    when sampling, by the request's seed)."""
    h = seed
    for t in token_ids:
        h = (h * 1_000_003 + t) % (1 << 61)
    return letters[h % len(letters)]


class FakeExecutor(Executor):
    """In-process stand-in for the model (see the module docstring).

    Attributes:
        steps: every ``SchedulerOutput`` it ran, decoded from its bytes.
        fail_next: raise ``WorkerDiedError`` at the next step (the worker lives).
        delay_s: seconds each async step takes (to hold requests in flight).
        idle_s: the ``idle_time`` each step reports (seconds).
        num_submitted: async steps handed to it so far (counted on entry, before
            ``delay_s``).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        num_blocks: int = 64,
        max_model_len: int = 512,
        allow_kernel_build: bool = True,
    ) -> None:
        if config is not None and config.cache.num_gpu_blocks_override:
            num_blocks = config.cache.num_gpu_blocks_override
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.load_time = 0.0
        self.steps: list[SchedulerOutput] = []
        self.fail_next = False
        self.delay_s = 0.0
        self.idle_s = 0.0
        self.num_submitted = 0
        self.alive = True
        self._tokens: dict[str, list[int]] = {}
        self._seeds: dict[str, int] = {}
        self._letters = letter_ids()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self.alive:
            raise WorkerDiedError("the fake worker is shut down")
        if self.fail_next:
            self.fail_next = False
            raise WorkerDiedError("the fake worker failed this step")
        so = decode_to_worker(encode(scheduler_output))  # the real wire format
        assert isinstance(so, SchedulerOutput)
        self.steps.append(so)
        for req_id in so.finished_req_ids:
            self._tokens.pop(req_id, None)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        for r in so.scheduled_new_reqs:
            self._tokens[r.req_id] = list(r.token_ids)
            self._seeds[r.req_id] = r.sampling.seed if r.sampling.temperature > 0 else 0
        computed.update({r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs})
        sampled, logprobs, want_logprobs = [], [], False
        sampling = {r.req_id: r.sampling for r in so.scheduled_new_reqs}
        for req_id, num_new in zip(so.req_ids(), so.num_scheduled_tokens):
            tokens = self._tokens[req_id]
            if computed[req_id] + num_new < len(tokens):
                sampled.append(-1)
                logprobs.append(None)
                continue
            token = next_token(tokens, self._letters, self._seeds[req_id])
            tokens.append(token)
            sampled.append(token)
            meta = sampling.get(req_id)
            want = meta is not None and meta.logprobs >= 0
            want_logprobs |= want
            logprobs.append([(token, -0.25), (self._letters[0], -1.5)] if want else None)
        out = ModelRunnerOutput(
            so.step_id,
            sampled,
            logprobs if want_logprobs else None,
            0.001,
            0.0,
            idle_time=self.idle_s,
        )
        result = decode_from_worker(encode(out))
        assert isinstance(result, ModelRunnerOutput)
        return result

    async def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_submitted += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.execute_model(scheduler_output)

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self) -> None:
        self.alive = False


def greedy_output(prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """What the stand-in model generates greedily after ``prompt_token_ids``."""
    letters, tokens = letter_ids(), list(prompt_token_ids)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, letters))
    return tokens[len(prompt_token_ids) :]


_request_ids = itertools.count()


def distinct_prompt(request_id: str, length: int) -> list[int]:
    """``length`` token ids drawn from a generator seeded by ``request_id``: the same
    every run (unlike ``hash(str)``, which ``PYTHONHASHSEED`` changes), and two ids
    share no 16-token block in practice, so the prefix cache never turns one
    request's prompt into another's hit by chance."""
    rng = random.Random(request_id)
    return [rng.randrange(10, 40_000) for _ in range(length)]


def make_request(
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    *,
    request_id: str | None = None,
    prompt_token_ids: list[int] | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    **params: Any,
) -> Request:
    """A scheduler ``Request`` (``ignore_eos``: it runs to ``max_tokens``)."""
    prompt = (
        prompt_token_ids
        if prompt_token_ids is not None
        else [10 + (i * 7) % 200 for i in range(num_prompt_tokens)]
    )
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(
        request_id or f"req-{next(_request_ids)}",
        prompt,
        sampling,
        max_tokens,
        None,
        priority,
        time.monotonic() if arrival_time is None else arrival_time,
        cache_salt,
    )


def make_config(**kwargs: Any) -> EngineConfig:
    """An ``EngineConfig`` for the in-process engine on the fake executor."""
    # The default model's path (never read: the executor is the fake one).
    kwargs.setdefault("served_model_name", "fake-model")
    kwargs.setdefault("executor", "inproc")
    kwargs.setdefault("num_gpu_blocks_override", 64)
    kwargs.setdefault("block_size", 4)
    return EngineConfig.from_kwargs(**kwargs)


async def start_fake_engine(config: EngineConfig | None = None) -> Any:
    """A real ``AsyncEngine`` on ``make_tokenizer()`` and a ``FakeExecutor``."""
    from aioengine.engine.async_engine import AsyncEngine

    config = config or make_config()
    return await AsyncEngine.from_parts(config, make_tokenizer(), FakeExecutor)


def make_llm(**config: Any) -> Any:
    """An ``LLM`` on ``make_tokenizer()`` and a ``FakeExecutor`` (``LLM.__init__``
    reads a model file; this sets the same attributes without one)."""
    from aioengine.engine.llm import LLM
    from aioengine.engine.llm_engine import LLMEngine

    llm = LLM.__new__(LLM)
    llm.config = make_config(**config)
    llm.model_info = None
    llm.tokenizer = make_tokenizer()
    llm.executor = FakeExecutor(llm.config)
    llm.engine = LLMEngine(llm.config, llm.tokenizer, llm.executor)
    llm._counter = 0
    return llm
