"""The engine roles without a model (unit tier): ``InputProcessor``,
``EngineCore``, ``OutputProcessor``, ``parallel_sampling`` and ``LLMEngine``
on the stand-in model of ``tests/factories.py``; the executor interface; the
old import paths."""

from __future__ import annotations

import asyncio

import pytest

from aioengine.engine.input_processor import InputProcessor
from aioengine.engine.llm_engine import LLMEngine
from aioengine.engine.parallel_sampling import ParentRequest, child_request_id, parent_request_id
from aioengine.errors import RequestRejected, SamplingParamError, SchedulerQueueFull
from aioengine.executor.abstract import Executor
from aioengine.sampling_params import RequestOutput, SamplingParams
from tests.factories import (
    FakeExecutor,
    greedy_output,
    make_config,
    make_tokenizer,
    start_fake_engine,
)


def make_engine(num_blocks: int = 64, max_model_len: int = 512, **config) -> LLMEngine:
    config.setdefault("num_gpu_blocks_override", num_blocks)
    return LLMEngine(
        make_config(**config),
        make_tokenizer(),
        FakeExecutor(num_blocks=num_blocks, max_model_len=max_model_len),
    )


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step to the end; per request its outputs' samples gathered by index."""
    final: dict[str, RequestOutput] = {}
    samples: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().request_outputs:
            samples.setdefault(out.request_id, {}).update((c.index, c) for c in out.outputs)
            if out.finished:
                out.outputs = [samples[out.request_id][i] for i in sorted(samples[out.request_id])]
                final[out.request_id] = out
    return final


def prompt(i: int, length: int = 20) -> list[int]:
    return [70 + (i * 13 + k * 7) % 26 for k in range(length)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_greedy_outputs_are_the_stand_in_models():
    engine = make_engine()
    for i in range(3):
        engine.add_request(f"r{i}", prompt(i), GREEDY)
    final = run(engine)
    for i in range(3):
        assert final[f"r{i}"].outputs[0].token_ids == greedy_output(prompt(i), 6)
        assert final[f"r{i}"].outputs[0].finish_reason == "length"
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    assert engine.stats().num_requests_finished == 3


def test_a_tiny_cache_preempts_and_loses_or_repeats_nothing():
    """12 blocks of 4 tokens for 6 requests of 20 + 12 tokens: preemption must
    happen, and every output equals the stand-in model's greedy output."""
    engine = make_engine(num_blocks=12, max_num_seqs=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", prompt(i), params)
    final = run(engine)
    assert engine.stats().num_preemptions > 0
    for i in range(6):
        assert final[f"r{i}"].outputs[0].token_ids == greedy_output(prompt(i), 12), i


def test_n_samples_fan_out_share_the_prompt_and_gather_back():
    engine = make_engine()
    params = SamplingParams(temperature=1.0, max_tokens=5, n=3, seed=7, ignore_eos=True)
    engine.add_request("p", prompt(0, 16), params)
    # Child 0 prefills; the others wait for it (counted as waiting), then fork.
    assert sorted(engine.scheduler.requests) == ["p#0"] and engine.stats().num_waiting == 3
    final = run(engine)["p"]
    seeds = {
        r.req_id: r.sampling.seed
        for so in engine.core.executor.steps
        for r in so.scheduled_new_reqs
    }
    assert seeds == {"p#0": 7, "p#1": 8, "p#2": 9}
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1, "seeds differ per sample"
    assert final.num_cached_tokens == 0
    assert engine.kv_cache_manager.num_forks == 2, "children share the prompt's blocks"
    assert (child_request_id("p", 1, 3), parent_request_id("p#1")) == ("p#1", "p")
    assert parent_request_id("solo") == "solo"


def test_stop_string_ends_the_sample_and_frees_it_in_the_core():
    tokenizer = make_tokenizer()
    text = tokenizer.decode(greedy_output(prompt(1), 30))
    stop = text[4:6]
    engine = make_engine()
    engine.add_request(
        "s", prompt(1), SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    )
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step().request_outputs:
            deltas.append(out.outputs[0].delta_text)
            last = out
    completion = last.outputs[0]
    assert completion.text == text[: text.index(stop)] == "".join(deltas)
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 30 and "s" not in engine.scheduler.requests


def test_abort_frees_blocks_and_unknown_ids_are_false():
    engine = make_engine()
    engine.add_request("a", prompt(0), SamplingParams(max_tokens=50, n=2, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.block_pool.num_used_blocks > 0
    assert engine.abort_request("a") and not engine.abort_request("a")
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_a_full_queue_takes_none_of_the_children():
    engine = make_engine(max_waiting_requests=4)
    engine.add_request("a", prompt(0), SamplingParams(max_tokens=2, n=3))
    with pytest.raises(SchedulerQueueFull):
        engine.add_request("b", prompt(1), SamplingParams(max_tokens=2, n=2))
    assert sorted(engine.scheduler.requests) == ["a#0"] and engine.stats().num_waiting == 3
    assert not engine.output_processor.has_request("b")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", prompt(0), SamplingParams(max_tokens=2))


def test_input_processor_refusals_name_the_field():
    processor = InputProcessor(make_tokenizer(), max_model_len=32, block_size=4, num_blocks=100)
    small_cache = InputProcessor(make_tokenizer(), max_model_len=64, block_size=4, num_blocks=6)
    assert processor.validate([1, 2, 3], SamplingParams(max_tokens=None)) == 29
    cases = [
        (processor, [], SamplingParams(), "prompt"),
        (processor, [1] * 32, SamplingParams(), "prompt"),
        (processor, [1, 2], SamplingParams(max_tokens=31), "max_tokens"),
        (processor, [10_000], SamplingParams(), "prompt"),
        (small_cache, [1, 2], SamplingParams(max_tokens=23), "max_tokens"),
    ]  # 7 blocks
    for checker, token_ids, params, field in cases:
        with pytest.raises(RequestRejected) as info:
            checker.validate(token_ids, params)
        assert info.value.param == field, (token_ids, params)
    assert small_cache.validate([1, 2], SamplingParams(max_tokens=22)) == 22  # 6 blocks
    with pytest.raises(SamplingParamError):
        processor.validate([1], SamplingParams(max_tokens=1, logit_bias={10_000: 1.0}))
    chat = processor.render_chat([{"role": "user", "content": "hi"}])
    assert make_tokenizer().decode(chat).endswith("<|im_start|>assistant\n")


def test_fail_all_ends_every_request_with_the_error():
    engine = make_engine()
    engine.add_request("a", prompt(0), SamplingParams(max_tokens=9, n=2, ignore_eos=True))
    engine.add_request("b", prompt(1), SamplingParams(max_tokens=9, ignore_eos=True))
    engine.step()
    outputs = engine.fail_all("worker died")
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert all(o.finished and o.error == "worker died" for o in outputs)
    assert all(c.finish_reason == "abort" for o in outputs for c in o.outputs)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_parent_request_without_seed_leaves_the_draw_to_the_core():
    engine = make_engine()
    request = engine.input_processor.process_inputs("x", [1, 2], SamplingParams(n=2, max_tokens=1))
    parent = ParentRequest(request)
    assert [c.seed for c in parent.child_requests] == [None, None]
    engine.core.add_requests(parent.child_requests)
    seeds = [engine.core.get_request(f"x#{i}").seed for i in range(2)]
    assert seeds[0] != seeds[1]


def test_worker_idle_and_busy_times_are_summed_and_kept_per_step():
    engine = make_engine()
    engine.core.executor.idle_s = 0.002
    engine.add_request("a", prompt(0), GREEDY)
    engine.add_request("b", prompt(1), GREEDY)
    run(engine)
    stats = engine.stats()
    steps = list(engine.core.recent_steps)
    assert len(steps) == stats.num_steps == 6  # one prefill + 5 decodes
    assert steps[0] == (2, 40, 0.002, 0.001)
    assert all(s == (2, 2, 0.002, 0.001) for s in steps[1:])
    assert stats.worker_idle_time == pytest.approx(0.002 * 6)
    assert stats.worker_busy_time == pytest.approx(0.001 * 6)


def test_async_engine_streams_and_cancelling_aborts():
    async def go():
        engine = await start_fake_engine()
        try:
            engine.executor.delay_s = 0.01
            texts = [
                o.outputs[0].text
                async for o in engine.generate("hey", SamplingParams(temperature=0, max_tokens=4))
            ]
            assert texts[-1] == make_tokenizer().decode(
                greedy_output(make_tokenizer().encode("hey"), 4)
            )
            stream = engine.generate("hey", SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.__anext__()
            await stream.aclose()  # the client went away
            assert engine.num_in_flight == 0
            assert engine.stats().num_kv_blocks_used == 0
        finally:
            await engine.shutdown()

    asyncio.run(go())


def test_the_next_step_is_submitted_before_the_streams_see_this_ones_output():
    """Issue 16: the stream handlers (JSON, SSE writes) run while the worker
    computes the next step, not between the steps on the worker's critical path."""

    async def go():
        engine = await start_fake_engine(make_config(async_scheduling=False))
        try:
            executor = engine.executor
            executor.delay_s = 0.005
            seen = []
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            async for out in engine.generate("hey", params):
                seen.append((len(out.outputs[0].token_ids), executor.num_submitted, out.finished))
            # The k-th token's output reaches the stream once step k + 1 was
            # handed over (one step per token; none after the last).
            assert [(k, s) for k, s, done in seen if not done] == [(k, k + 1) for k in range(1, 6)]
            assert seen[-1] == (6, 6, True)
        finally:
            await engine.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("stop", [[], ["\x00never"]])
def test_outputs_are_processed_after_the_next_submit_unless_a_stop_string_may_end_one(stop):
    """Without stop strings, detokenizing a step waits until the next step was
    handed to the worker; with one, it runs first, so a stop ends the request
    before the next step is scheduled."""

    async def go():
        engine = await start_fake_engine(make_config(async_scheduling=False))
        try:
            executor = engine.executor
            executor.delay_s = 0.005
            processor = engine.core.output_processor
            process, at = processor.process_outputs, []

            def spy(core_outputs):
                at.append(executor.num_submitted)
                return process(core_outputs)

            processor.process_outputs = spy
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=stop)
            async for _ in engine.generate("hey", params):
                pass
            assert at == ([2, 3, 4, 4] if not stop else [1, 2, 3, 4])
            assert not processor.can_finish_requests
        finally:
            await engine.shutdown()

    asyncio.run(go())


def test_can_finish_requests_counts_live_requests_with_stop_strings():
    engine = make_engine()
    processor = engine.output_processor
    engine.add_request("a", prompt(0), SamplingParams(max_tokens=3, stop=["zz"]))
    engine.add_request("b", prompt(1), SamplingParams(max_tokens=3, stop=["zz"], n=2))
    engine.add_request("c", prompt(2), GREEDY)
    assert processor.can_finish_requests
    engine.abort_request("a")
    assert processor.can_finish_requests
    run(engine)  # b and c finish
    assert not processor.can_finish_requests
    engine.add_request("d", prompt(3), SamplingParams(max_tokens=3, stop=["zz"]))
    engine.fail_all("gone")
    assert not processor.can_finish_requests


def test_a_stream_still_gets_turns_when_the_executor_answers_at_once():
    """With an executor that never suspends, the step loop still yields once a
    step, so a stream that is being consumed sees each output in turn."""

    async def go():
        engine = await start_fake_engine(make_config(async_scheduling=False))
        try:
            executor = engine.executor
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            seen = [
                (len(out.outputs[0].token_ids), executor.num_submitted)
                async for out in engine.generate("hi", params)
            ]
            # Each output is seen once the step after it was submitted, not later
            # (a loop that never yielded would run all six steps first).
            assert seen == [(k, min(k + 1, 6)) for k in range(1, 7)]
        finally:
            await engine.shutdown()

    asyncio.run(go())


def test_the_executor_interface_is_enforced():
    class Half(Executor):
        def execute_model(self, scheduler_output):
            raise NotImplementedError

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]
    fake = FakeExecutor()
    assert fake.sentinel is None and fake.exited_process is None and fake.activate() is fake


def test_old_import_paths_still_work():
    from aioengine import LLM, AsyncEngine, SamplingParams  # noqa: F401
    from aioengine.core.scheduler import SchedulerQueueFull as A
    from aioengine.engine.async_engine import EngineDeadError as B
    from aioengine.engine.core import RequestRejected as C
    from aioengine.engine.executor import InprocExecutor, WorkerDiedError as D, make_executor
    from aioengine.engine.multiproc_executor import MultiprocExecutor, check_parallel_config
    from aioengine.entrypoints.server import DEFAULT_WEB_DIR, build_app
    from aioengine.errors import EngineDeadError, RequestRejected, WorkerDiedError
    from aioengine.models.loader import load_tokenizer
    from aioengine.tokenizer import load_tokenizer as moved

    assert (A, B, C, D) == (SchedulerQueueFull, EngineDeadError, RequestRejected, WorkerDiedError)
    assert load_tokenizer is moved and callable(build_app) and DEFAULT_WEB_DIR.name == "web"
    assert issubclass(InprocExecutor, Executor) and issubclass(MultiprocExecutor, Executor)
    assert callable(make_executor) and callable(check_parallel_config)


def test_llm_generate_and_chat_on_the_stand_in():
    from tests.factories import make_llm

    llm = make_llm()
    tokenizer = make_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5)
    outs = llm.generate(["ab", [70, 71, 72]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        greedy_output(tokenizer.encode("ab"), 5),
        greedy_output([70, 71, 72], 5),
    ]
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    llm.add_request("salted", [70, 71], params, cache_salt="tenant-a")
    assert llm.run_until_finished()["salted"].outputs[0].token_ids == greedy_output([70, 71], 5)
    assert llm.stats().num_requests_finished == 4
    llm.shutdown()
    assert not llm.executor.is_alive()


def _record_run(monkeypatch: pytest.MonkeyPatch, full_path: bool) -> tuple[list[bytes], dict]:
    """One workload on a small cache, every step's ``SchedulerOutput`` as sent (its
    bytes) and each request's final tokens. ``full_path``: the decode step's
    shortcuts turned off (the prefill cap worked out up front, every allocation
    through ``KVCacheManager._allocate``), as the scheduler ran before them."""
    from aioengine.core import scheduler as scheduler_module
    from aioengine.core.kv_cache_manager import KVCacheManager
    from aioengine.ipc.messages import encode

    with monkeypatch.context() as m:
        if full_path:
            m.setattr(
                scheduler_module._StepBuilder,
                "__post_init__",
                lambda step: step.settle_prefill_budget(),
                raising=False,
            )
            m.setattr(KVCacheManager, "allocate_slots", KVCacheManager._allocate)
        engine = make_engine(
            num_blocks=18, max_num_seqs=6, max_num_batched_tokens=32, chunked_prefill_itl_ratio=1.5
        )
        stop_at = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", prompt(i, 18), stop_at)
        engine.add_request("pair", prompt(7, 9), SamplingParams(temperature=0, max_tokens=10, n=2))
        final: dict[str, list[int]] = {}
        for step in range(200):
            if not engine.has_unfinished_requests():
                break
            if step == 6:
                engine.abort_request("r1")  # mid-decode: its blocks go, the worker is told
            if step == 9:  # a long prompt arrives while the others decode (chunked, capped)
                engine.add_request("late", prompt(11, 40), stop_at)
            for out in engine.step().request_outputs:
                for c in out.outputs:
                    final.setdefault(f"{out.request_id}/{c.index}", []).extend(c.delta_token_ids)
        assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.num_cow_copies > 0  # the workload's point
        return [encode(so) for so in engine.core.executor.steps], final


def test_the_decode_step_shortcuts_send_what_the_full_path_sends(monkeypatch):
    """Issue 16's shortcuts between a step's output and the next step (the prefill
    cap only when a prompt chunk needs it, allocations that fit in a request's own
    blocks answered at once) change no step: across preemptions on a small cache,
    an abort, a request that arrives while others decode, an ``n = 2`` fork (its
    copy-on-write) and requests ending on ``max_tokens``, every ``SchedulerOutput``
    and every token equal those of the full path."""
    steps, final = _record_run(monkeypatch, full_path=False)
    full_steps, full_final = _record_run(monkeypatch, full_path=True)
    assert final == full_final
    assert len(steps) == len(full_steps)
    for k, (ours, full) in enumerate(zip(steps, full_steps)):
        assert ours == full, f"step {k} differs"
    assert len(final["late/0"]) == 14 and "r1/0" in final


def _resident_fraction(t) -> float:  # t: torch.Tensor (torch imported lazily here)
    """Share of ``t``'s memory pages in RAM (``mincore(2)``)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, (
        ctypes.get_errno()
    )
    return sum(v & 1 for v in vec) / len(vec)


def test_the_cpu_kv_cache_is_in_memory_before_the_first_step():
    """A cache faulted in as steps first write its blocks made those steps 4x longer
    (32 streams at a block boundary: 100 ms against 25 ms); ``resident_zeros`` writes
    every page at start, and reads as zeros."""
    import numpy as np
    import torch

    from aioengine.worker.model_runner import resident_zeros

    shape = (2, 2, 512, 16, 3, 64)  # 24 MiB of fp32
    lazy = torch.from_numpy(np.zeros(2 * 2 * 512 * 16 * 3 * 64, dtype=np.float32))
    assert _resident_fraction(lazy) < 0.5, "a fresh calloc is not resident: the check can fail"
    del lazy
    cache = resident_zeros(shape, torch.float16)
    assert _resident_fraction(cache) == 1.0  # before any read (reads map the zero page)
    assert cache.shape == shape and cache.dtype == torch.float16
    assert not cache.any()
