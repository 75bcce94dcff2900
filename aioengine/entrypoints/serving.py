"""The API's view of the engine, shared by the HTTP routes and the WebSocket.

``OpenAIServing`` turns validated requests into prompt token ids and
``SamplingParams``, starts engine requests (mapping engine exceptions to
OpenAI-shaped ``APIError``s) and formats logprobs. ``RequestGroup`` runs the
one or more engine requests behind an API request (several prompts in one
``/v1/completions`` call) as a single stream, and aborts all of them when the
consumer goes away.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import logging
import re
from collections.abc import AsyncIterator

from aioengine.core.scheduler import SchedulerQueueFull
from aioengine.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from aioengine.engine.beam_search import BeamSearchParams
from aioengine.engine.data_parallel import DPAsyncEngine
from aioengine.engine.core import RequestRejected
from aioengine.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatLogprobEntry,
    ChatResponseMessage,
    CompletionLogprobs,
    CompletionRequest,
    SamplingRequest,
    ToolCall,
    TopLogprob,
    model_not_found,
)
from aioengine.sampling_params import (
    CompletionOutput,
    RequestOutput,
    SamplingParamError,
    SamplingParams,
)
from aioengine.structured.params import GrammarError
from aioengine.tools.parsers import TOOL_PARSERS, ToolCallStreamer, parser_for_template
from aioengine.tools.prompt import inject_tools, template_supports_tools

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a 429 (waiting queue full).
QUEUE_FULL_RETRY_AFTER_S = 1.0


class OpenAIServing:
    """Request preparation and engine access for the API layer.

    Args:
        engine: a started ``AsyncEngine``.
        tool_call_parser: the model's tool-call format, or ``auto`` (from the
            chat template).
    """

    def __init__(self, engine: AsyncEngine, tool_call_parser: str = "auto") -> None:
        self.engine = engine
        template = getattr(engine.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        self.template_supports_tools = template_supports_tools(template)
        self.tool_call_parser = (parser_for_template(template) if tool_call_parser == "auto"
                                 else tool_call_parser)
        self.model_name = engine.served_model_name
        self.max_model_len = engine.max_model_len
        self._token_str_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}

    # -- checks ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Raises ``APIError`` 404 unless ``model`` is absent or the served name."""
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Raises ``APIError`` 400 for ids outside the vocabulary."""
        vocab = len(self.engine.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param, "invalid_value")

    # -- prompts --------------------------------------------------------------------------
    async def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        """Prompt token ids of a conversation under the model's chat template.

        Raises:
            APIError: 400 when the template rejects the messages.
        """
        messages = [m.to_template_dict() for m in request.messages]
        tools = None
        if request.effective_tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        if not self.template_supports_tools:
            messages = inject_tools(messages, tools)
            tools = None
        if request.continue_final_message:
            if request.add_generation_prompt:
                raise APIError(400, "'continue_final_message' and 'add_generation_prompt' "
                               "cannot both be true", "continue_final_message", "invalid_value")
            return await self._continuation_prompt(messages)
        add_generation_prompt = request.add_generation_prompt is not False
        try:
            return await self.engine.apply_chat_template(messages, add_generation_prompt,
                                                         tools=tools)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages", "invalid_value") from None

    async def _continuation_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """vLLM's ``continue_final_message``: the template without the final
        message's end-of-turn, so the model continues that message."""
        tokenizer = self.engine.tokenizer

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=False,
                                                 continue_final_message=True)
            return tokenizer.encode(text, add_special_tokens=False)

        try:
            return await asyncio.to_thread(render)
        except Exception as exc:  # jinja2 TemplateError, ValueError for an empty message
            raise APIError(400, f"chat template failed: {exc}", "messages",
                           "invalid_value") from None

    async def completion_prompts(self, request: CompletionRequest
                                 ) -> list[tuple[list[int], str | None]]:
        """``(token_ids, text or None)`` per prompt of a completion request.

        Raises:
            APIError: 400 for an empty prompt list or out-of-vocabulary ids.
        """
        prompts = []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                prompts.append((await self.engine.tokenize(prompt), prompt))
            else:
                self.check_token_ids(prompt, "prompt")
                prompts.append((list(prompt), None))
        return prompts

    def default_max_tokens(self, prompt_len: int) -> int | None:
        """What a request that gives no ``max_tokens`` may generate: the rest of the
        context, bounded by what the whole KV cache holds (tokens). ``None`` when
        nothing is left, so the engine's own check rejects the prompt. With data
        parallel replicas, the smallest replica's cache: the request runs on one
        (their summed ``stats()`` would allow ``data_parallel_size`` times too much)."""
        if isinstance(self.engine, DPAsyncEngine):
            num_blocks = min(s.num_kv_blocks_total for s in self.engine.replica_stats())
        else:
            num_blocks = self.engine.stats().num_kv_blocks_total
        cache_tokens = num_blocks * self.engine.config.cache.block_size
        room = min(self.max_model_len, cache_tokens) - prompt_len
        return room if room > 0 else None

    def sampling_params(self, request: SamplingRequest, prompt_len: int
                        ) -> SamplingParams | BeamSearchParams:
        """The request's engine parameters (``BeamSearchParams`` with ``use_beam_search``)."""
        return request.to_sampling_params(self.default_max_tokens(prompt_len))

    def check_queue_room(self, plan: list[SamplingParams | BeamSearchParams]) -> None:
        """Refuse (400) an API request whose engine requests (``n`` samples or beams
        per prompt) outnumber every waiting queue together: it could never be
        admitted, and the 429 it got (retry later) had clients retry forever.

        Raises:
            APIError: 400 on ``prompt``.
        """
        config = self.engine.config
        room = config.scheduler.max_waiting_requests * config.parallel.data_parallel_size
        wanted = sum(p.beam_width if isinstance(p, BeamSearchParams) else p.n for p in plan)
        if len(plan) > 1 and wanted > room:
            raise APIError(400, f"{len(plan)} prompts need {wanted} engine requests, more "
                           f"than the waiting queue holds ({room}); send fewer prompts at "
                           "once", "prompt", "invalid_value")

    async def prepare_structured_outputs(self, request: SamplingRequest,
                                         params: SamplingParams | BeamSearchParams) -> None:
        """Compile the request's output constraint (in the grammar thread, cached)
        before it is queued.

        Raises:
            APIError: 400 naming the field whose schema, regex or grammar the
                grammar library cannot compile.
        """
        if getattr(params, "structured_outputs", None) is None:
            return  # none, or beam search (which refuses constraints)
        try:
            await self.engine.compile_grammar(params.structured_outputs)
        except GrammarError as exc:
            field = request.structured_outputs_params()[1]
            raise APIError(400, f"'{field}' cannot be compiled to a grammar: {exc}", field,
                           "invalid_grammar") from None

    # -- tool calls ------------------------------------------------------------------------
    def tool_call_streamer(self, request: ChatCompletionRequest) -> ToolCallStreamer | None:
        """A parser of the answer's tool calls, or None when it can hold none
        (no tools, ``tool_choice: none``). A forced call is the grammar's JSON."""
        choice = request.effective_tool_choice
        if choice == "none":
            return None
        name = self.tool_call_parser if choice == "auto" else "json"
        return ToolCallStreamer(TOOL_PARSERS[name]())

    def chat_message(self, request: ChatCompletionRequest, c: CompletionOutput
                     ) -> tuple[ChatResponseMessage, str | None]:
        """The assistant message of a finished choice and its ``finish_reason``
        (``tool_calls`` when the answer holds calls and was not cut by length)."""
        streamer = self.tool_call_streamer(request)
        if streamer is None:
            return ChatResponseMessage(content=c.text), c.finish_reason
        streamer.finish(c.text)
        calls = [ToolCall(**call) for call in streamer.tool_calls]
        finish = c.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        return ChatResponseMessage(content=streamer.content or None if calls else c.text,
                                   tool_calls=calls), finish

    # -- engine requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | BeamSearchParams,
                    request: SamplingRequest) -> RequestStream:
        """Start an engine request.

        Raises:
            APIError: 400 (can never run), 429 (waiting queue full, with
                ``retry_after``), 503 (engine down).
        """
        try:
            return self.engine.add_request(request_id, prompt_token_ids, params,
                                           priority=request.priority or 0,
                                           cache_salt=request.cache_salt)
        except (RequestRejected, SamplingParamError) as exc:
            # A chat request's prompt is its rendered ``messages``: name the field it has.
            param = "messages" if exc.param == "prompt" and hasattr(request, "messages") else (
                exc.param)
            raise APIError(400, str(exc), param, "invalid_value") from None
        except SchedulerQueueFull as exc:
            raise APIError(429, f"the server is busy ({exc}); retry later", None, "queue_full",
                           retry_after=QUEUE_FULL_RETRY_AFTER_S) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable",
                           retry_after=QUEUE_FULL_RETRY_AFTER_S) from None

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # -- logprobs --------------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        text = self._token_str_cache.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            if len(self._token_str_cache) < 65536:
                self._token_str_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes (OpenAI's ``bytes`` field): for a token that
        holds part of a multi-byte character these are the raw bytes, which
        joined with the neighbours' give the character, not U+FFFD's bytes."""
        raw = self._token_bytes_cache.get(token_id)
        if raw is None:
            raw = _raw_token_bytes(self.engine.tokenizer, token_id)
            if len(self._token_bytes_cache) < 65536:
                self._token_bytes_cache[token_id] = raw
        return list(raw)

    def chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                      num_top: int) -> list[ChatLogprobEntry]:
        """Chat ``logprobs.content`` for generated tokens.

        Args:
            token_ids: the sampled tokens.
            entries: per token, ``{token_id: logprob}`` of the sampled token and
                the top alternatives (as in ``CompletionOutput.logprobs``).
            num_top: ``top_logprobs`` asked for.
        """
        content = []
        for token, entry in zip(token_ids, entries):
            text = self.token_str(token)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(ChatLogprobEntry(
                token=text, logprob=max(entry[token], -9999.0), bytes=self.token_bytes(token),
                top_logprobs=[TopLogprob(token=self.token_str(i), logprob=max(lp, -9999.0),
                                         bytes=self.token_bytes(i)) for i, lp in top]))
        return content

    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                            num_top: int, text_offset: int) -> CompletionLogprobs:
        """Legacy completions ``logprobs`` for generated tokens; ``text_offset`` is
        the character offset of the first token in the choice's text."""
        out = CompletionLogprobs()
        # Offsets count characters of the decoded text, so a token holding part of
        # a multi-byte character does not advance them until the character is whole.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token, entry in zip(token_ids, entries):
            out.tokens.append(self.completion_token_str(token))
            out.token_logprobs.append(max(entry[token], -9999.0))
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            out.top_logprobs.append({self.completion_token_str(i): max(lp, -9999.0)
                                     for i, lp in top} if num_top else None)
            out.text_offset.append(text_offset)
            text_offset += len(decoder.decode(bytes(self.token_bytes(token))))
        return out

    def completion_token_str(self, token_id: int) -> str:
        """A token as the legacy completions API names it: its text, or for part
        of a multi-byte character OpenAI's ``bytes:\\xe6\\x97`` form (as
        U+FFFD, every such token would share one ``top_logprobs`` key)."""
        text = self.token_str(token_id)
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable character -> byte table, inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _raw_token_bytes(tokenizer, token_id: int) -> bytes:
    """Bytes of one token: byte-level BPE pieces (``ðŁ``) and SentencePiece byte
    fallback pieces (``<0xF0>``) map to their raw bytes; other tokens are their
    decoded text."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        table = _byte_level_decoder()
        if piece and all(char in table for char in piece):
            return bytes(table[char] for char in piece)
    return text.encode()


class RequestGroup:
    """The engine requests behind one API request, iterated as one stream.

    Iterating yields ``(prompt_index, RequestOutput)`` in arrival order.
    ``close()`` (also run when the iteration ends early, by ``break`` or
    cancellation) aborts every request that has not finished, so their KV
    blocks are freed at once.

    Raises (while iterating):
        EngineDeadError: the engine ended the requests abnormally.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.streams: list[RequestStream] = []
        # The API key's hold (quotas.QuotaLease), released at close() with the
        # completion tokens this group produced.
        self.lease = None
        self._num_tokens: dict[tuple[int, int], int] = {}

    def add(self, stream: RequestStream) -> None:
        self.streams.append(stream)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def close(self) -> None:
        """Abort every unfinished request; safe to call more than once."""
        for stream in self.streams:
            if not stream.finished:
                self.serving.abort(stream.request_id)
        if self.lease is not None:
            self.lease.release(sum(self._num_tokens.values()))

    def _count(self, index: int, output: RequestOutput) -> None:
        for c in output.outputs:
            self._num_tokens[index, c.index] = len(c.token_ids)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            if len(self.streams) == 1:
                async for output in self.streams[0]:
                    self._count(0, output)
                    yield 0, output
                return
            async for index, output in self._merged():
                self._count(index, output)
                yield index, output
        finally:
            self.close()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except EngineDeadError as exc:  # hand it to the consumer
                queue.put_nowait((index, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
