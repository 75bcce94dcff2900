"""EngineCore: scheduler, block manager and detokenizers, no event loop.

It turns requests into ``SchedulerOutput`` deltas and ``ModelRunnerOutput``
results into ``RequestOutput``s. ``LLM`` drives it synchronously;
``AsyncEngine`` drives it from a uvloop task. A request with ``n > 1`` fans
out into ``n`` child requests that share the prompt's cached blocks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from aioengine.config import EngineConfig
from aioengine.core.kv_cache_manager import KVCacheManager, cdiv
from aioengine.core.scheduler import Scheduler
from aioengine.engine.beam_search import BeamSearchGroup, BeamSearchParams
from aioengine.engine.detokenizer import IncrementalDetokenizer
from aioengine.ipc.messages import ModelRunnerOutput, SamplingMetadata, SchedulerOutput
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import (
    CompletionOutput,
    RequestOutput,
    SamplingParamError,
    SamplingParams,
)
from aioengine.structured.manager import StructuredOutputManager


class RequestRejected(ValueError):
    """A request that can never run (too long, too big for the cache)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    """One snapshot read by /metrics, the chat page and the tests.

    Token and request counts are cumulative unless named ``*_last_step``.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_multi_request_steps: int = 0
    max_reqs_in_step: int = 0
    num_reqs_last_step: int = 0
    num_tokens_last_step: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    last_step_time: float = 0.0
    last_forward_time: float = 0.0
    num_kv_blocks_shared: int = 0
    num_cow_copies: int = 0
    block_usage_map: list[int] = field(default_factory=list)


@dataclass
class _ParentRequest:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    completions: list[CompletionOutput]
    num_cached_tokens: int = -1


class EngineCore:
    """Synchronous engine logic shared by ``LLM`` and ``AsyncEngine``.

    Args:
        config: engine settings.
        tokenizer: HF tokenizer of the model (``backend_tokenizer`` is used
            for streaming detokenization).
        num_blocks, max_model_len: as reported by the worker handshake.
        structured_output_manager: grammar compile cache to use (kept across
            worker restarts by ``AsyncEngine``); a new one when None.
    """

    def __init__(self, config: EngineConfig, tokenizer, num_blocks: int,
                 max_model_len: int,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._backend_tokenizer = tokenizer.backend_tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, max_model_len,
                                   self._sampling_metadata)
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(
            tokenizer, len(tokenizer), self.eos_token_id)
        self._parents: dict[str, _ParentRequest] = {}
        self._child_to_parent: dict[str, tuple[_ParentRequest, int]] = {}
        self._beam_groups: dict[str, BeamSearchGroup] = {}
        self._beam_of: dict[str, BeamSearchGroup] = {}
        self._seed_rng = random.Random(config.model.seed)
        self._num_finished = 0
        self.last_step_time = 0.0
        self.last_forward_time = 0.0

    # -- requests ---------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request can ever run; returns its resolved ``max_tokens``.

        Raises:
            RequestRejected: empty prompt, prompt or prompt + max_tokens beyond
                the context, or more blocks than the whole cache.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab and any(not 0 <= t < len(self.tokenizer) for t in prompt_token_ids):
            raise RequestRejected("the prompt holds token ids outside the vocabulary", "prompt")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {n} tokens, leaving no room to generate", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"({n} tokens) plus max_tokens ({max_tokens}) exceeds it", "max_tokens")
        if cdiv(n + max_tokens, self.block_size) > self.kv_cache_manager.num_blocks:
            raise RequestRejected(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs more KV blocks "
                f"than the whole cache holds ({self.kv_cache_manager.num_blocks} blocks of "
                f"{self.block_size} tokens)", "max_tokens")
        if any(t >= len(self.tokenizer) for t in params.logit_bias):
            raise SamplingParamError("logit_bias",
                                     "logit_bias names a token id outside the vocabulary")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request (``n`` children when ``params.n > 1``).

        Raises:
            RequestRejected, SamplingParamError: the request can never run.
            SchedulerQueueFull: the waiting queue is full.
            ValueError: ``request_id`` is already in use.
        """
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        if len(self.scheduler.waiting) + params.n > self.config.scheduler.max_waiting_requests:
            from aioengine.core.scheduler import SchedulerQueueFull
            raise SchedulerQueueFull("waiting queue is full")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, prompt_token_ids, params, max_tokens,
                                    self.eos_token_id, priority, arrival, cache_salt))
        parent = _ParentRequest(
            request_id, params, list(prompt_token_ids), children,
            [IncrementalDetokenizer(self._backend_tokenizer, params.stop,
                                    params.include_stop_str_in_output, params.skip_special_tokens,
                                    min_tokens=params.min_tokens)
             for _ in children],
            [CompletionOutput(index=i) for i in range(params.n)])
        self._parents[request_id] = parent
        for i, child in enumerate(children):
            child.seed = (params.seed + i) if params.seed is not None else \
                self._seed_rng.getrandbits(63)
            self._child_to_parent[child.request_id] = (parent, i)
            if params.structured_outputs is not None:
                child.structured_output_request = self.structured_output_manager.new_request(
                    params.structured_outputs)
            self.scheduler.add_request(child)

    def add_beam_search_request(self, request_id: str, prompt_token_ids: list[int],
                                params: BeamSearchParams, priority: int = 0,
                                cache_salt: str | None = None,
                                arrival_time: float | None = None) -> None:
        """Queue a beam search (``BeamSearchGroup``); its one ``RequestOutput``
        comes when the search is done: ``params.beam_width`` completions, best
        first, each with its ``cumulative_logprob``.

        Raises:
            RequestRejected: the request can never run.
            SchedulerQueueFull: the waiting queue is full.
            ValueError: ``request_id`` is already in use.
        """
        if request_id in self._parents or request_id in self._beam_groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, SamplingParams(max_tokens=params.max_tokens))
        # Each beam computes one token a step; the group decides which continue, when
        # a beam ends and which token it keeps, so the beam itself never stops on EOS.
        beam_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens + 1,
                                     ignore_eos=True)
        eos = None if params.ignore_eos else self.eos_token_id
        arrival = time.monotonic() if arrival_time is None else arrival_time

        def make_request(rid: str, output_token_ids: list[int]) -> Request:
            r = Request(rid, prompt_token_ids, beam_params, params.max_tokens + 1,
                        self.eos_token_id, priority, arrival, cache_salt)
            r.append_output_token_ids(output_token_ids)
            return r

        first = make_request(f"{request_id}#beam0", [])
        group = BeamSearchGroup(request_id, first, params, eos)
        # Not a SamplingParams field (at most 20 there): the top 2k logprobs of every beam.
        beam_params.logprobs = group.state.num_candidates
        group.make_request = make_request
        self.scheduler.add_request(first)
        self._beam_groups[request_id] = group
        self._beam_of[first.request_id] = group

    def _step_beam_groups(self, groups: dict[str, BeamSearchGroup]) -> list[RequestOutput]:
        outputs = []
        for group in groups.values():
            if not group.ready():
                continue
            old = set(group.beam_ids)
            done = group.advance(self.scheduler, group.make_request)
            for rid in old - set(group.beam_ids):
                self._beam_of.pop(rid, None)
            for beam in group.beams:
                self._beam_of[beam.request_id] = group
            if done:
                self._beam_groups.pop(group.request_id, None)
                self._num_finished += 1
                outputs.append(self._beam_output(group))
        return outputs

    def _beam_output(self, group: BeamSearchGroup) -> RequestOutput:
        completions = []
        for i, beam in enumerate(group.finished):
            tokens = beam.tokens
            text_tokens = tokens[:-1] if beam.finish_reason == "stop" else tokens
            completions.append(CompletionOutput(
                index=i, text=self.tokenizer.decode(text_tokens, skip_special_tokens=True),
                token_ids=list(tokens), finish_reason=beam.finish_reason,
                cumulative_logprob=beam.cum_logprob))
        return RequestOutput(group.request_id, group.prompt_token_ids, completions, True, 0)

    def abort_request(self, request_id: str) -> bool:
        """End a request and free its blocks. Returns False if it is unknown."""
        group = self._beam_groups.pop(request_id, None)
        if group is not None:
            self.scheduler.finish_requests(group.beam_ids, RequestStatus.FINISHED_ABORTED)
            for rid in group.beam_ids:
                self._beam_of.pop(rid, None)
            group.beams = []
            return True
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        ids = [c.request_id for c in parent.children]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for child_id in ids:
            self._child_to_parent.pop(child_id, None)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Returns False (changing nothing) while
        any request holds blocks, as vLLM does."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _sampling_metadata(self, request: Request) -> SamplingMetadata:
        p = request.sampling_params
        stop_ids = list(p.stop_token_ids)
        if not p.ignore_eos and self.eos_token_id is not None:
            stop_ids.append(self.eos_token_id)
        return SamplingMetadata(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, seed=request.seed,
            logprobs=-1 if p.logprobs is None else p.logprobs, min_tokens=p.min_tokens,
            stop_token_ids=stop_ids,
            logit_bias=[(int(t), float(b)) for t, b in p.logit_bias.items()])

    # -- steps ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step; constrained requests that sample in it get their
        ``grammar_bitmask`` rows (none at all when no such request runs)."""
        so = self.scheduler.schedule()
        ids, constrained = [], []
        for request, num_new in zip(self.scheduler.scheduled_requests, so.num_scheduled_tokens):
            if (request.structured_output_request is not None
                    and request.num_computed_tokens + num_new >= request.num_tokens):
                ids.append(request.request_id)
                constrained.append(request.structured_output_request)
        if constrained:
            so.structured_output_request_ids = ids
            so.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                constrained).tobytes()
        return so

    def pending_grammars(self) -> list:
        """Compile futures of waiting requests whose grammar is not ready yet."""
        return [r.structured_output_request.grammar_future for r in self.scheduler.waiting
                if r.structured_output_request is not None
                and not r.structured_output_request.is_ready()]

    def process_output(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's sampled tokens; one ``RequestOutput`` per parent that
        produced something (only the samples that changed are listed)."""
        self.last_forward_time = ro.forward_time + ro.sample_time
        changed: dict[str, tuple[_ParentRequest, list[int]]] = {}
        beam_groups: dict[str, BeamSearchGroup] = {}
        for request, token, logprobs in self.scheduler.update_from_output(so, ro):
            group = self._beam_of.get(request.request_id)
            if group is not None:
                if token is not None:
                    group.accept(request, logprobs, self.block_size)
                    beam_groups[group.request_id] = group
                continue
            entry = self._child_to_parent.get(request.request_id)
            if entry is None:
                continue
            parent, index = entry
            if parent.num_cached_tokens < 0 and request.num_cached_tokens >= 0:
                parent.num_cached_tokens = request.num_cached_tokens
            if token is None:
                continue
            so_request = request.structured_output_request
            if so_request is not None and so_request.matcher is not None:
                if not so_request.accept_token(token) and not request.is_finished:
                    # Only a token the mask did not cover (ignore_eos past the end).
                    self.scheduler.finish_requests([request.request_id],
                                                   RequestStatus.FINISHED_STOPPED)
                elif so_request.is_terminated and not request.is_finished:
                    self.scheduler.finish_requests([request.request_id],
                                                   RequestStatus.FINISHED_STOPPED)
            detok = parent.detokenizers[index]
            completion = parent.completions[index]
            stopped = detok.update(token)
            if stopped and not request.is_finished:
                self.scheduler.finish_requests([request.request_id],
                                               RequestStatus.FINISHED_STOPPED)
            if detok.stop_reason is not None:
                request.stop_reason = detok.stop_reason
            completion.delta_token_ids = [token]
            completion.token_ids.append(token)
            if logprobs is not None:
                completion.logprobs = (completion.logprobs or []) + [dict(logprobs)]
            finished = request.is_finished
            completion.delta_text = detok.get_delta(finished)
            completion.text += completion.delta_text
            if finished:
                # A stop string completed by the token that also reached
                # max_tokens is a stop, as vLLM reports it.
                completion.finish_reason = "stop" if stopped else request.status.finish_reason
                completion.stop_reason = request.stop_reason
            changed.setdefault(parent.request_id, (parent, []))[1].append(index)

        outputs = self._step_beam_groups(beam_groups) if beam_groups else []
        for parent, indices in changed.values():
            finished = all(c.finished for c in parent.completions)
            outputs.append(RequestOutput(
                request_id=parent.request_id, prompt_token_ids=parent.prompt_token_ids,
                outputs=[_snapshot(parent.completions[i]) for i in indices],
                finished=finished, num_cached_tokens=max(parent.num_cached_tokens, 0)))
            if finished:
                self._release(parent)
        return outputs

    def _release(self, parent: _ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._child_to_parent.pop(child.request_id, None)
        self._num_finished += 1

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with ``error`` set (worker crash)."""
        outputs = []
        for group in list(self._beam_groups.values()):
            self.abort_request(group.request_id)
            outputs.append(RequestOutput(group.request_id, group.prompt_token_ids,
                                         [CompletionOutput(0, finish_reason="abort")], True, 0,
                                         error=message))
        for parent in list(self._parents.values()):
            self.abort_request(parent.request_id)
            for c in parent.completions:
                c.finish_reason = c.finish_reason or "abort"
                c.delta_text, c.delta_token_ids = "", []
            outputs.append(RequestOutput(parent.request_id, parent.prompt_token_ids,
                                         [_snapshot(c) for c in parent.completions], True,
                                         max(parent.num_cached_tokens, 0), error=message))
        return outputs

    def stats(self, include_block_map: bool = False) -> EngineStats:
        """The one stats snapshot; ``include_block_map`` adds the per-block
        state list (for the chat page's KV grid)."""
        s = self.scheduler.stats
        kv = self.kv_cache_manager
        pool = kv.block_pool
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_total=pool.num_blocks, num_kv_blocks_used=pool.num_used_blocks,
            kv_cache_usage=pool.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=s.num_preemptions,
            num_steps=s.num_steps, num_multi_request_steps=s.num_multi_request_steps,
            max_reqs_in_step=s.max_reqs_in_step, num_reqs_last_step=s.num_scheduled_reqs_last_step,
            num_tokens_last_step=s.num_scheduled_tokens_last_step,
            num_prompt_tokens=s.num_prompt_tokens, num_generation_tokens=s.num_generation_tokens,
            num_requests_finished=self._num_finished, last_step_time=self.last_step_time,
            last_forward_time=self.last_forward_time,
            num_kv_blocks_shared=pool.num_shared_blocks, num_cow_copies=kv.num_cow_copies,
            block_usage_map=self.block_usage_map() if include_block_map else [])

    def block_usage_map(self) -> list[int]:
        """Per block: 0 free, 1 free but holding a cached prefix, 2 in use."""
        return [2 if b.ref_cnt else (1 if b.block_hash is not None else 0)
                for b in self.kv_cache_manager.block_pool.blocks]


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.delta_text,
                            list(c.delta_token_ids),
                            list(c.logprobs) if c.logprobs is not None else None,
                            c.finish_reason, c.stop_reason)
