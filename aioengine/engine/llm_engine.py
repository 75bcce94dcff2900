"""LLMEngine: the four engine roles behind one step, shared by ``LLM`` and
``AsyncEngine``.

``add_request`` runs a prompt through the input processor (validation), fans
``n > 1`` out into children (``parallel_sampling``) and queues them in the
core; ``step()`` / ``step_async()`` run one core step and turn its token ids
into ``RequestOutput``s (``output_processor``), finishing in the core what a
stop string ended. Neither loop knows more than this step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aioengine.config import EngineConfig
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.core.scheduler import Scheduler
from aioengine.engine.beam_search import BeamSearchGroup, BeamSearchParams
from aioengine.engine.core import EngineCore, EngineCoreOutputs, EngineStats
from aioengine.engine.input_processor import InputProcessor
from aioengine.engine.output_processor import OutputProcessor
from aioengine.engine.parallel_sampling import ParentRequest
from aioengine.executor.abstract import Executor
from aioengine.ipc.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.request import RequestStatus
from aioengine.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from aioengine.structured.manager import StructuredOutputManager


@dataclass
class EngineStep:
    """What one step produced.

    Attributes:
        request_outputs: one per parent request that progressed.
        scheduled_new_request_ids: (child) requests scheduled for the first time.
        scheduled_time: ``time.monotonic()`` when the step was scheduled.
        executed: False when nothing could be scheduled (see ``EngineCoreOutputs``).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    scheduled_new_request_ids: list[str] = field(default_factory=list)
    scheduled_time: float = 0.0
    executed: bool = True


class LLMEngine:
    """Input processor, engine core and output processor for one executor.

    Args:
        config: engine settings.
        tokenizer: the model's HF tokenizer.
        executor: a started executor (its handshake sizes the cache).
        structured_output_manager: grammar compile cache to use; a new one when None.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        executor: Executor,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(
            tokenizer, len(tokenizer), tokenizer.eos_token_id
        )
        self.input_processor = InputProcessor(
            tokenizer, executor.max_model_len, config.cache.block_size, executor.num_blocks
        )
        self.core = EngineCore(
            config, executor, self.structured_output_manager, tokenizer.eos_token_id
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.num_beam_searches_finished = 0

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.core.kv_cache_manager

    # -- requests ---------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (``n`` children when ``params.n > 1``).

        Raises:
            ValueError: ``request_id`` is already in use.
            RequestRejected, SamplingParamError: the request can never run.
            SchedulerQueueFull: the waiting queue is full.
        """
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process_inputs(
            request_id, prompt_token_ids, params, priority, cache_salt, arrival_time
        )
        parent = ParentRequest(request)
        self.core.add_requests(parent.child_requests)
        self.output_processor.add_request(parent)

    def add_beam_search_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a beam search (``beam_search.BeamSearchGroup``, beams sharing KV
        blocks copy-on-write). Its one ``RequestOutput`` comes when the search is
        done: ``params.beam_width`` completions, best first, each with its
        ``cumulative_logprob``; no output before.

        Raises:
            ValueError: ``request_id`` is already in use.
            RequestRejected: the prompt can never run (see ``InputProcessor.validate``).
            SchedulerQueueFull: the waiting queue is full.
        """
        if self.output_processor.has_request(request_id) or request_id in self.core.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.input_processor.validate(
            prompt_token_ids, SamplingParams(max_tokens=params.max_tokens)
        )
        self.core.add_beam_search(
            request_id,
            prompt_token_ids,
            params,
            priority,
            cache_salt,
            time.monotonic() if arrival_time is None else arrival_time,
        )

    def _beam_search_output(self, group: BeamSearchGroup) -> RequestOutput:
        completions = []
        for i, beam in enumerate(group.finished):
            text_tokens = beam.tokens[:-1] if beam.finish_reason == "stop" else beam.tokens
            completions.append(
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(text_tokens, skip_special_tokens=True),
                    token_ids=list(beam.tokens),
                    finish_reason=beam.finish_reason,
                    cumulative_logprob=beam.cum_logprob,
                )
            )
        self.num_beam_searches_finished += 1
        return RequestOutput(
            group.request_id,
            group.prompt_token_ids,
            completions,
            True,
            max(group.num_cached_tokens, 0),
        )

    def abort_request(self, request_id: str) -> bool:
        """End a request and free its blocks. Returns False if it is unknown."""
        if self.core.abort_beam_search(request_id):
            return True
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids is None:
            return False
        self.core.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return True

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with ``error`` set (worker crash, shutdown)."""
        outputs, child_ids = self.output_processor.fail_all(message)
        for request_id, group in list(self.core.beam_searches.items()):
            self.core.abort_beam_search(request_id)
            outputs.append(
                RequestOutput(
                    request_id,
                    group.prompt_token_ids,
                    [CompletionOutput(0, finish_reason="abort")],
                    True,
                    error=message,
                )
            )
        self.core.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    # -- the step -----------------------------------------------------------------
    def step(self) -> EngineStep:
        """One step, blocking on the executor.

        Raises:
            WorkerDiedError: the executor failed the step.
        """
        return self._process(self.core.step())

    async def step_async(self) -> EngineStep:
        """One step; the event loop is free while the worker computes."""
        return self._process(await self.core.step_async())

    async def step_core_async(self) -> EngineCoreOutputs:
        """The core half of ``step_async``: the token ids, not yet through
        ``process`` (which must run before the next step when
        ``output_processor.can_finish_requests``)."""
        return await self.core.step_async()

    def process(self, core_outputs: EngineCoreOutputs) -> EngineStep:
        """The output half of ``step_async``: text, stop strings, ``RequestOutput``s."""
        return self._process(core_outputs)

    # The two halves of ``step()`` around the executor, for callers that time
    # or inspect them (bench/throughput.py, bench/prefix_cache.py).
    def schedule(self) -> SchedulerOutput:
        return self.core.schedule()

    def process_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply an executed ``schedule()``; the ``RequestOutput``s of the step."""
        core_outputs = self.core.update_from_output(scheduler_output, runner_output)
        return self._process(core_outputs).request_outputs

    def _process(self, core_outputs: EngineCoreOutputs) -> EngineStep:
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.request_ids_to_finish:
            self.core.finish_requests(
                processed.request_ids_to_finish, RequestStatus.FINISHED_STOPPED
            )
        processed.request_outputs += [
            self._beam_search_output(group) for group in core_outputs.finished_beam_searches
        ]
        return EngineStep(
            processed.request_outputs,
            core_outputs.scheduled_new_request_ids,
            core_outputs.scheduled_time,
            core_outputs.executed,
        )

    def stats(self, include_block_map: bool = False) -> EngineStats:
        stats = self.core.stats(include_block_map)
        stats.num_requests_finished = (
            self.output_processor.num_requests_finished + self.num_beam_searches_finished
        )
        return stats
