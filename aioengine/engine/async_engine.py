"""AsyncEngine: the engine on an asyncio (uvloop) event loop.

One task, the step loop, drives ``EngineCore``: schedule, hand the step to the
executor (the worker computes while the loop serves HTTP), apply the result,
push ``RequestOutput``s into per-request queues. API handlers call
``add_request`` (validation errors raise before anything is streamed) and
iterate the returned ``RequestStream``; leaving the iteration early (client
gone, cancel) aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from aioengine.config import EngineConfig
from aioengine.engine.beam_search import BeamSearchParams
from aioengine.engine.core import EngineCoreOutputs, EngineStats
from aioengine.engine.input_processor import InputProcessor
from aioengine.engine.llm_engine import EngineStep, LLMEngine
from aioengine.engine.parallel_sampling import parent_request_id
from aioengine.errors import EngineDeadError, WorkerDiedError
from aioengine.executor import Executor, make_executor, make_standby_executor
from aioengine.models.loader import ModelInfo, inspect_model
from aioengine.sampling_params import RequestOutput, SamplingParams
from aioengine.structured.manager import StructuredOutputManager
from aioengine.structured.params import StructuredOutputsParams
from aioengine.tokenizer import load_tokenizer, model_display_name

logger = logging.getLogger(__name__)


class LatencyObserver(Protocol):
    """Receives per-request latencies (seconds) as the step loop sees them
    (``metrics.EngineMetrics`` turns them into Prometheus histograms)."""

    def observe_queue_time(self, seconds: float) -> None:
        """Arrival to first scheduled."""

    def observe_ttft(self, seconds: float) -> None:
        """Arrival to first generated token."""

    def observe_itl(self, seconds: float) -> None:
        """Between two consecutive steps that gave this request tokens."""

    def observe_e2e(self, seconds: float) -> None:
        """Arrival to finished (normally; not aborted or failed)."""


# EngineStats counters that must not go back to zero when a restarted worker
# brings a fresh EngineCore (Prometheus counters only ever increase).
_CUMULATIVE_STATS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_steps",
    "num_multi_request_steps",
    "num_prompt_tokens",
    "num_generation_tokens",
    "num_requests_finished",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "worker_idle_time",
    "worker_busy_time",
)


class _Flag:
    """A one-way switch for a loop callback to throw (cheaper than an Event)."""

    __slots__ = ("is_set",)

    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True


class RequestStream:
    """Async iterator of one request's ``RequestOutput``s; the last has ``finished``.

    Breaking out of the iteration, or cancelling the task iterating it,
    aborts the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        # time.monotonic() seconds, for the latency histograms.
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def put(self, output: RequestOutput) -> None:
        self._queue.put_nowait(output)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self._queue.get()
                self.finished = output.finished
                if output.error is not None:
                    raise EngineDeadError(output.error)
                yield output
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)


async def generate_stream(
    engine: Any,
    prompt: str | list[int],
    params: SamplingParams,
    request_id: str | None,
    priority: int,
) -> AsyncIterator[RequestOutput]:
    """``engine.generate``'s body, for ``AsyncEngine`` and ``DPAsyncEngine``: tokenize
    (in a thread), ``add_request``, stream, and abort when the caller leaves early."""
    token_ids = prompt if isinstance(prompt, list) else await engine.tokenize(prompt)
    stream = engine.add_request(request_id or engine.new_request_id(), token_ids, params, priority)
    try:
        async for output in stream:
            yield output
    finally:
        # Leaving early (break, aclose, cancellation) must free the blocks
        # now, not when the inner iterator is garbage-collected.
        if not stream.finished:
            engine.abort(stream.request_id)


class AsyncEngine:
    """Tokenizer, ``EngineCore`` and executor behind an async API.

    Use ``engine = await AsyncEngine.start(config)``, then
    ``stream = engine.add_request(...)`` and ``async for out in stream``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = config.model.model_path
        self.served_model_name = config.model.served_model_name or model_display_name(
            self.model_path
        )
        self.tokenizer: Any = None
        self.model_info: ModelInfo | None = None
        self.executor: Executor | None = None
        self.core: LLMEngine | None = None
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        # Steps whose outputs wait for a loop callback to process them, oldest
        # first (``_step_forever``); whoever processes outputs drains this first.
        self._deferred: collections.deque[tuple[LLMEngine, EngineCoreOutputs, float]] = (
            collections.deque()
        )
        self._step_task: asyncio.Task | None = None
        self._counter = 0
        self.started_at = time.time()
        self.healthy = False
        self.num_worker_restarts = 0
        self._restart_task: asyncio.Task | None = None
        # A spare executor (imports done, no model) that replaces a crashed one.
        self._standby: Executor | None = None
        self._standby_task: asyncio.Task | None = None
        # Seconds from each worker's death to serving again, oldest first.
        self.restart_times: list[float] = []
        self._stopping = False
        self._watched_sentinel: int | None = None
        self.draining = False
        self.latency_observer: LatencyObserver | None = None
        self._retired_stats = dict.fromkeys(_CUMULATIVE_STATS, 0)
        self._retired_max_reqs_in_step = 0
        self.structured_output_manager: StructuredOutputManager | None = None
        self._executor_factory: Callable[..., Executor] = make_executor

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Load the tokenizer and start the worker (in threads: the loop stays free)."""
        self = cls(config)
        # From metadata alone, before any worker starts: a bad file fails here, in one line.
        m = config.model
        self.model_info = await asyncio.to_thread(
            inspect_model, self.model_path, m.quantization, m.dtype
        )
        logger.info("model %s: %s", self.model_path, self.model_info.describe())
        # Importing transformers from two threads at once can fail half-way
        # (``cannot import name 'AutoConfig'``): the in-process executor loads
        # the model with it, so import it once here first.
        if config.parallel.executor == "inproc":
            await asyncio.to_thread(importlib.import_module, "transformers")
        # The worker subprocess is the slow half of start-up (it imports
        # torch): spawn it first, then build the tokenizer while it starts.
        executor_future = asyncio.ensure_future(asyncio.to_thread(make_executor, config))
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path)
        except BaseException:
            started = await asyncio.gather(executor_future, return_exceptions=True)
            if isinstance(started[0], Executor):
                await asyncio.to_thread(started[0].shutdown)
            raise
        self.executor = await executor_future
        self._begin_serving()
        return self

    @classmethod
    async def from_parts(
        cls, config: EngineConfig, tokenizer: Any, executor_factory: Callable[..., Executor]
    ) -> AsyncEngine:
        """An engine on a given tokenizer and executor (``executor_factory(config,
        allow_kernel_build=...)`` also makes the replacement after a crash); no
        model file is read. The unit tests run the whole engine on a stand-in
        model this way."""
        self = cls(config)
        self._executor_factory = executor_factory
        self.tokenizer = tokenizer
        self.executor = executor_factory(config, allow_kernel_build=False)
        self._begin_serving()
        return self

    def _begin_serving(self) -> None:
        """Fresh LLMEngine (block manager) for the current executor; start stepping."""
        if self.core is not None:  # a restart: keep the old core's counters
            old = self.core.stats()
            for name in _CUMULATIVE_STATS:
                self._retired_stats[name] += getattr(old, name)
            self._retired_max_reqs_in_step = max(
                self._retired_max_reqs_in_step, old.max_reqs_in_step
            )
        if self.structured_output_manager is None:
            self.structured_output_manager = StructuredOutputManager(
                self.tokenizer, len(self.tokenizer), self.tokenizer.eos_token_id
            )
        assert self.executor is not None
        self.core = LLMEngine(
            self.config, self.tokenizer, self.executor, self.structured_output_manager
        )
        self._watch_worker()
        self._step_task = asyncio.get_running_loop().create_task(self._step_loop())
        self.healthy = True
        if self._standby is None and (self._standby_task is None or self._standby_task.done()):
            self._standby_task = asyncio.get_running_loop().create_task(self._start_standby())

    async def _start_standby(self) -> None:
        """Spawn the spare worker (after the first is ready, so the kernel build
        exists and the two never compete for the CPU during start-up)."""
        try:
            standby = await asyncio.to_thread(make_standby_executor, self.config)
        except Exception:
            logger.exception("could not start a standby worker; a crash will start a new one")
            return
        if self._stopping:
            if standby is not None:
                await asyncio.to_thread(standby.shutdown)
            return
        self._standby = standby

    async def _take_standby(self) -> Executor | None:
        """The spare executor if it is still alive, else None (one that died is shut down)."""
        if self._standby_task is not None:
            await asyncio.gather(self._standby_task, return_exceptions=True)
        standby, self._standby = self._standby, None
        if standby is not None and not standby.is_alive():
            await asyncio.to_thread(standby.shutdown)
            standby = None
        return standby

    # -- worker death and restart ----------------------------------------------------
    def _watch_worker(self) -> None:
        """Watch the worker's process sentinel on the loop: it becomes readable
        the moment the process exits (no polling of ``is_alive()``)."""
        sentinel = self.executor.sentinel if self.executor is not None else None
        if sentinel is None:
            return
        self._watched_sentinel = sentinel
        asyncio.get_running_loop().add_reader(sentinel, self._on_worker_exit)

    def _unwatch_worker(self) -> None:
        if self._watched_sentinel is not None:
            asyncio.get_running_loop().remove_reader(self._watched_sentinel)
            self._watched_sentinel = None

    def _on_worker_exit(self) -> None:
        self._unwatch_worker()
        if not self._stopping:
            process = self.executor.exited_process if self.executor is not None else None
            code = process.exitcode if process is not None else None
            self._worker_died(f"the model worker process died (exit code {code})")

    def _worker_died(self, message: str) -> None:
        """End every in-flight request with ``message`` and restart the worker."""
        if not self.healthy:
            return
        logger.error("%s; restarting it", message)
        self.healthy = False
        self._fail_all(message)
        if self._step_task is not None and self._step_task is not asyncio.current_task():
            self._step_task.cancel()
        self._restart_task = asyncio.get_running_loop().create_task(self._restart_worker())

    async def _restart_worker(self) -> None:
        """Serve again on the standby worker (it loads the model from the mapped
        file; nothing is imported or built), or on a fresh one if the standby is
        gone. A restart never compiles kernels."""
        t_died = time.monotonic()
        old = self.executor
        self._unwatch_worker()
        if old is not None:
            await asyncio.to_thread(old.shutdown)  # unlinks the old rings
        standby = await self._take_standby()
        while not self._stopping:
            try:
                if standby is not None:
                    executor, standby = standby, None
                    self.executor = await asyncio.to_thread(executor.activate)
                else:
                    self.executor = await asyncio.to_thread(
                        self._executor_factory, self.config, allow_kernel_build=False
                    )
                break
            except Exception:
                logger.exception("worker restart failed; retrying in 1 s")
                await asyncio.sleep(1.0)
        if self._stopping:
            return
        self.num_worker_restarts += 1
        self._begin_serving()
        self.restart_times.append(time.monotonic() - t_died)
        logger.info(
            "worker restarted in %.2f s (%d restarts so far)",
            self.restart_times[-1],
            self.num_worker_restarts,
        )

    @property
    def max_model_len(self) -> int:
        assert self.core is not None
        return self.core.max_model_len

    def new_request_id(self, prefix: str = "req") -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    # -- requests ----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream. A ``BeamSearchParams`` request
        yields one output, when the search is done (``beam_width`` completions,
        best first).

        Raises:
            EngineDeadError: the worker is down (503).
            RequestRejected, SamplingParamError: can never run (400).
            SchedulerQueueFull: too many waiting (429).
        """
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        if not self.healthy or self.core is None:
            raise EngineDeadError("the engine is not ready (the model worker is restarting)")
        if isinstance(params, BeamSearchParams):
            self.core.add_beam_search_request(
                request_id, prompt_token_ids, params, priority, cache_salt
            )
        else:
            self.core.add_request(request_id, prompt_token_ids, params, priority, cache_salt)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Tokenize (in a thread) and stream outputs; see ``add_request`` for errors."""
        return generate_stream(self, prompt, params, request_id, priority)

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks; unknown ids are ignored."""
        self._streams.pop(request_id, None)
        if self.core is not None:
            self.core.abort_request(request_id)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint in the grammar thread (cached), so the request
        that uses it is scheduled without waiting and a bad one is refused
        before it is queued.

        Raises:
            GrammarError: the grammar library cannot compile it.
        """
        assert self.structured_output_manager is not None
        await self.structured_output_manager.compile_async(params)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (long texts in a thread)."""
        encode = self._input_processor().tokenize
        if len(text) < 2048:
            return encode(text, add_special_tokens)
        return await asyncio.to_thread(encode, text, add_special_tokens)

    async def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a conversation under the model's own chat template
        (``tools``: OpenAI tool entries, for a template that renders them).

        Raises:
            ValueError: the template rejects the messages.
        """
        render = self._input_processor().render_chat
        try:
            return await asyncio.to_thread(render, messages, add_generation_prompt, tools)
        except Exception as exc:  # jinja2 TemplateError and friends
            raise ValueError(f"chat template failed: {exc}") from exc

    def _input_processor(self) -> InputProcessor:
        if self.core is not None:
            return self.core.input_processor
        # Before the first worker is ready (tokenizing needs no cache sizes).
        return InputProcessor(self.tokenizer, 0, self.config.cache.block_size, 0)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False while requests hold blocks."""
        assert self.core is not None
        return self.core.reset_prefix_cache()

    def stats(self, include_block_map: bool = False) -> EngineStats:
        """The engine's ``EngineStats``; counters are cumulative over worker restarts."""
        assert self.core is not None
        stats = self.core.stats(include_block_map)
        for name in _CUMULATIVE_STATS:
            setattr(stats, name, getattr(stats, name) + self._retired_stats[name])
        stats.max_reqs_in_step = max(stats.max_reqs_in_step, self._retired_max_reqs_in_step)
        if stats.spec_decode_num_drafts:  # the ratios over the summed counters
            stats.spec_decode_acceptance_rate = (
                stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
            )
            stats.spec_decode_mean_acceptance_length = (
                1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts
            )
        return stats

    def recent_steps(self) -> list[tuple[int, int, float, float]]:
        """The latest steps (at most ``core.RECENT_STEPS``), oldest first: requests,
        tokens, the worker's idle and busy seconds (``ModelRunnerOutput``)."""
        assert self.core is not None
        return list(self.core.core.recent_steps)

    # -- draining (graceful shutdown) -------------------------------------------------
    def begin_drain(self) -> None:
        """Refuse new requests from now on (``EngineDeadError``, HTTP 503); the
        ones in flight keep running."""
        self.draining = True

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        return len(self._streams)

    def abort_all(self, message: str) -> None:
        """End every in-flight request now with ``message`` (its stream raises
        ``EngineDeadError``) and free their blocks."""
        if self.core is not None:
            self._fail_all(message)

    # -- the step loop ---------------------------------------------------------------
    async def _step_loop(self) -> None:
        try:
            await self._step_forever()
        except Exception as exc:
            # A bug anywhere in a step would otherwise end this task silently
            # and hang every request. Scheduler and worker may now disagree,
            # so start both afresh, as after a worker crash.
            logger.exception("engine step failed")
            self._worker_died(f"engine error: {exc!r}")

    async def _step_forever(self) -> None:
        engine = self.core
        assert engine is not None
        loop = asyncio.get_running_loop()
        while True:
            if not engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            t0 = time.perf_counter()
            # Set by the loop only once this task has yielded (the callback runs
            # after the task suspends): whether the handlers already had a turn.
            yielded = _Flag()
            loop.call_soon(yielded.set)
            try:
                core_outputs = await engine.step_core_async()
            except WorkerDiedError as exc:
                # The steps before this one produced real tokens: deliver them first.
                self._drain_deferred()
                if self.executor is None or not self.executor.is_alive():
                    self._worker_died(str(exc))
                    return
                # The worker failed this step but lives: end these requests only.
                logger.error("model step failed: %s", exc)
                self._fail_all(f"engine error: {exc}")
                continue
            if not core_outputs.executed:
                await self._wait_for_work(engine)
                continue
            now = time.monotonic()
            if engine.output_processor.can_finish_requests:
                # A stop string may end a request: the core must know before
                # the next step is scheduled. Earlier deferred steps go first: a
                # step that never suspended has not let their callbacks run.
                self._drain_deferred()
                self._publish(engine.process(core_outputs), now)
            else:
                # Detokenizing and publishing change nothing the next step's
                # scheduling reads: they run once this task has submitted that
                # step and suspends (callbacks run in order, so streams get
                # their outputs in step order), off the worker's critical path.
                self._deferred.append((engine, core_outputs, now))
                loop.call_soon(self._drain_deferred)
            engine.core.last_step_time = time.perf_counter() - t0
            # The streams' handlers (JSON, SSE writes) run while the worker
            # computes the next step: the next ``step_core_async`` schedules and
            # submits it before its first suspension. Yielding here instead would
            # put all of them on the worker's critical path (issue 16). Only when
            # the executor answered without suspending do they get a turn here.
            if not yielded.is_set:
                await asyncio.sleep(0)

    def _drain_deferred(self) -> None:
        """Deferred steps' outputs through the output processor to the streams,
        oldest first (a loop callback, or before a step's outputs are processed at
        once); a failure there is an engine error, as in the step loop."""
        while self._deferred:
            engine, core_outputs, now = self._deferred.popleft()
            try:
                self._publish(engine.process(core_outputs), now)
            except Exception as exc:
                self._deferred.clear()
                logger.exception("engine step failed")
                self._worker_died(f"engine error: {exc!r}")
                return

    @staticmethod
    async def _wait_for_work(engine: LLMEngine) -> None:
        """Nothing could be scheduled: wait for a grammar to compile, else yield."""
        pending = engine.core.pending_grammars()
        if pending:
            await asyncio.wait(
                [asyncio.wrap_future(f) for f in pending],
                timeout=0.05,
                return_when=asyncio.FIRST_COMPLETED,
            )
            return
        # Nothing fits right now (should not happen with a valid cache size).
        await asyncio.sleep(0)

    def _publish(self, step: EngineStep, now: float) -> None:
        """Queue times of newly scheduled requests; each output to its stream."""
        if step.scheduled_new_request_ids:
            self._record_scheduled(step.scheduled_new_request_ids, step.scheduled_time)
        for output in step.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                self._record_output(stream, output, now)
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]

    def _record_scheduled(self, request_ids: list[str], now: float) -> None:
        """Queue time of requests scheduled for the first time."""
        for request_id in request_ids:
            stream = self._streams.get(request_id) or self._streams.get(
                parent_request_id(request_id)
            )
            if stream is not None and stream.scheduled_time is None:
                stream.scheduled_time = now
                if self.latency_observer is not None:
                    self.latency_observer.observe_queue_time(now - stream.arrival_time)

    def _record_output(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        """TTFT, inter-token latency and end-to-end latency of one step's output."""
        observer = self.latency_observer
        if observer is None:
            return
        if any(c.delta_token_ids for c in output.outputs):
            if stream.first_token_time is None:
                stream.first_token_time = now
                observer.observe_ttft(now - stream.arrival_time)
            elif stream.last_token_time is not None:
                observer.observe_itl(now - stream.last_token_time)
            stream.last_token_time = now
        if output.finished and output.error is None:
            observer.observe_e2e(now - stream.arrival_time)

    def _fail_all(self, message: str) -> None:
        assert self.core is not None
        for output in self.core.fail_all(message):
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put(output)

    async def shutdown(self) -> None:
        """Stop the step loop and the worker; in-flight requests end with an error."""
        self._stopping = True
        self.healthy = False
        self._unwatch_worker()
        if self._step_task is not None:
            self._step_task.cancel()
            await asyncio.gather(self._step_task, return_exceptions=True)
        if self._restart_task is not None:
            # Not cancelled: the thread starting a new worker would run on and
            # leave that worker and its rings behind. The task stops at the
            # next check of _stopping; the executor it made is shut down below.
            await asyncio.gather(self._restart_task, return_exceptions=True)
        if self.core is not None:
            self._fail_all("the server is shutting down")
        if self.executor is not None:
            await asyncio.to_thread(self.executor.shutdown)
        standby = await self._take_standby()
        if standby is not None:
            await asyncio.to_thread(standby.shutdown)
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
