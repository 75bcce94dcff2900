"""Offline throughput, batch-1 decode and engine overhead, beside HF transformers.

Like vLLM's ``benchmark_throughput``: a fixed-seed workload of N requests
goes through ``aioengine.LLM`` (model in the worker subprocess, the default)
and through HF ``generate`` with static batches (bench/baseline_hf.py) in the
same process, one after the other, same weights, dtype and threads; the
ratio of the two is printed. Every request has an exact output length
(``ignore_eos``), greedy on both sides.

Parts (each can be skipped):

1. Throughput: requests/s, output tokens/s, total (prompt + output) tokens/s.
   ``--dataset random``: random-token prompts, input lengths uniform in
   ``--input-len-range`` (32-512), outputs uniform in ``--output-len-range``
   (16-256). ``--dataset chat``: real chat prompts through the chat template,
   outputs as above.
2. Batch-1 decode: one request, tokens/s after the first token, ours against
   HF ``generate`` at batch 1.
3. Engine overhead at ``--overhead-requests`` (32) running requests: per
   decode step, the step's wall time seen by the engine minus the worker's
   forward + sampling time (``ModelRunnerOutput.forward_time + sample_time``),
   as a share of the step. Measured twice: driving ``EngineCore`` the way
   ``LLM`` does (with a breakdown: schedule, ring round trip + message
   encoding, process_output) and on the ``AsyncEngine``'s uvloop step loop
   (what the server runs; read from ``EngineCore.last_step_time`` /
   ``last_forward_time``).
4. Worker idle between consecutive decode steps on the ``AsyncEngine``, with
   and without ``--async-scheduling`` (``ModelRunnerOutput.idle_time`` as a
   share of the step).
5. The step breakdown at 1, 8 and 32 rows: forward, LM head, sampler
   (greedy, and temperature 0.8 with top-p 0.95), in-process.
6. The shared-memory ring round trip median (bench/ipc_ring.py's ``bench_ring``).

Usage:
    python bench/throughput.py                       # 64 random requests, fp32
    python bench/throughput.py --dtype bfloat16
    python bench/throughput.py --dataset chat --num-prompts 32
Writes bench/results/throughput.json (or ``--output-json``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import baseline_hf
from bench.common import (
    BenchRequest,
    LoadTracker,
    chat_workload,
    environment,
    fmt,
    synthetic_workload,
    workload_summary,
    write_results,
)

TARGETS = {
    "throughput_ratio_vs_hf_static_batch": 2.0,
    "throughput_ratio_stretch": 3.0,
    "batch1_decode_tokens_per_s_fp32": 35.0,
    "engine_overhead_pct_max": 10.0,
    "ring_round_trip_median_us_max": 50.0,
}


# -- driving the engine step by step -----------------------------------------------------------


@dataclass
class StepRecord:
    """Timings of one engine step, in seconds (``time.perf_counter``)."""

    num_reqs: int
    num_tokens: int
    wall_s: float        # schedule + execute + process_output
    schedule_s: float
    execute_s: float     # encode, ring put, worker, ring get, decode
    process_s: float     # update_from_output, detokenize, RequestOutputs
    forward_s: float     # ModelRunnerOutput.forward_time (worker: inputs + forward)
    sample_s: float      # ModelRunnerOutput.sample_time (worker: logits + sampling)
    end: float

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.forward_s - self.sample_s


def sampling_params(output_len: int):
    from aioengine import SamplingParams

    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)


def add_requests(llm, requests: Sequence[BenchRequest], prefix: str) -> list[str]:
    ids = []
    for i, r in enumerate(requests):
        request_id = f"{prefix}-{i}"
        llm.engine.add_request(request_id, r.prompt_token_ids, sampling_params(r.output_len))
        ids.append(request_id)
    return ids


def drive_steps(llm) -> tuple[list[StepRecord], dict[str, list[float]]]:
    """Run ``llm``'s queued requests to the end the way ``LLM.generate`` does
    (schedule, execute, process_output), timing every step.

    Returns:
        The step records, and per request id the time each of its tokens came out.
    """
    engine, executor = llm.engine, llm.executor
    clock = time.perf_counter
    steps: list[StepRecord] = []
    token_times: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        t0 = clock()
        so = engine.schedule()
        t1 = clock()
        ro = executor.execute_model(so)
        t2 = clock()
        outputs = engine.process_output(so, ro)
        t3 = clock()
        for out in outputs:
            n = sum(len(c.delta_token_ids) for c in out.outputs)
            token_times.setdefault(out.request_id, []).extend([t3] * n)
        steps.append(StepRecord(so.num_reqs, so.total_num_scheduled_tokens, t3 - t0, t1 - t0,
                                t2 - t1, t3 - t2, ro.forward_time, ro.sample_time, t3))
    return steps, token_times


def decode_rate(stamps: Sequence[float]) -> float:
    """Tokens/s after the first token: ``(n - 1) / (t_last - t_first)``."""
    span = stamps[-1] - stamps[0]
    return (len(stamps) - 1) / span if span > 0 else float("nan")


# -- the parts -------------------------------------------------------------------------------


def engine_throughput(llm, requests: Sequence[BenchRequest], progress: bool) -> dict:
    """All ``requests`` through ``LLM.generate``; output lengths are checked."""
    prompts = [r.prompt_token_ids for r in requests]
    params = [sampling_params(r.output_len) for r in requests]
    steps_before = llm.stats().num_steps
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - t0
    for r, out in zip(requests, outputs):
        got = len(out.outputs[0].token_ids)
        if got != r.output_len:
            raise RuntimeError(f"engine generated {got} tokens, asked for {r.output_len}")
    stats = llm.stats()
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {"elapsed_s": round(elapsed, 3), "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "num_steps": stats.num_steps - steps_before, "max_reqs_in_step": stats.max_reqs_in_step,
            "num_preemptions": stats.num_preemptions}


def engine_decode_batch1(llm, prompt_token_ids: list[int], num_tokens: int) -> dict:
    """One request alone; the same definition of decode speed as HF's side."""
    t0 = time.perf_counter()
    add_requests(llm, [BenchRequest(prompt_token_ids, num_tokens)], "batch1")
    steps, token_times = drive_steps(llm)
    stamps = token_times["batch1-0"]
    rate = decode_rate(stamps)
    decode_steps = [s for s in steps if s.num_tokens == 1]
    return {"num_tokens": num_tokens, "prompt_len": len(prompt_token_ids),
            "ttft_s": round(stamps[0] - t0, 4), "decode_tokens_per_s": rate,
            "ms_per_token": 1000.0 / rate,
            "median_step_ms": 1000 * statistics.median(s.wall_s for s in decode_steps),
            "median_forward_sample_ms": 1000 * statistics.median(
                s.forward_s + s.sample_s for s in decode_steps)}


def overhead_summary(records: Sequence[tuple[float, float]]) -> dict:
    """``records``: ``(step wall s, forward + sample s)`` of full-batch decode steps."""
    walls = [w for w, _ in records]
    shares = [(w - f) / w for w, f in records if w > 0]
    total_wall = sum(walls)
    return {"num_steps": len(records),
            "median_step_ms": 1000 * statistics.median(walls),
            "median_forward_sample_ms": 1000 * statistics.median(f for _, f in records),
            "median_overhead_ms": 1000 * statistics.median(w - f for w, f in records),
            "median_overhead_pct": 100 * statistics.median(shares),
            "aggregate_overhead_pct": 100 * (total_wall - sum(f for _, f in records)) / total_wall}


def engine_overhead_sync(llm, num_running: int, prompt_len: int, output_len: int,
                         vocab_size: int, seed: int) -> dict:
    """Overhead of decode steps with exactly ``num_running`` requests, driving
    ``EngineCore`` as ``LLM`` does, with the step broken down."""
    requests = synthetic_workload(num_running, (prompt_len, prompt_len), (output_len, output_len),
                                  vocab_size, seed + 1)
    add_requests(llm, requests, "overhead")
    steps, _ = drive_steps(llm)
    full = [s for s in steps if s.num_reqs == num_running and s.num_tokens == num_running]
    if not full:
        raise RuntimeError(f"no decode step ran {num_running} requests together")
    out = overhead_summary([(s.wall_s, s.forward_s + s.sample_s) for s in full])
    out["breakdown_median_ms"] = {
        "schedule": 1000 * statistics.median(s.schedule_s for s in full),
        "execute_minus_worker": 1000 * statistics.median(
            s.execute_s - s.forward_s - s.sample_s for s in full),
        "process_output": 1000 * statistics.median(s.process_s for s in full),
        "worker_forward": 1000 * statistics.median(s.forward_s for s in full),
        "worker_sample": 1000 * statistics.median(s.sample_s for s in full),
    }
    out["num_running"] = num_running
    return out


async def _async_overhead(engine_kwargs: dict, requests: Sequence[BenchRequest],
                          num_running: int) -> dict:
    from aioengine.config import EngineConfig
    from aioengine.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.start(EngineConfig.from_kwargs(**engine_kwargs))
    try:
        core = engine.core.core  # the EngineCore inside the LLMEngine
        stats = core.scheduler.stats
        schedule = core.schedule
        records: dict[int, tuple[int, int, float, float]] = {}

        def timed_schedule():
            # Called at the start of every step: the fields still describe the
            # previous step (its token counts, wall and worker times).
            if stats.num_steps and core.last_step_time:
                records[stats.num_steps] = (
                    stats.num_scheduled_reqs_last_step, stats.num_scheduled_tokens_last_step,
                    core.last_step_time, core.last_forward_time)
            return schedule()

        core.schedule = timed_schedule

        async def consume(i: int, r: BenchRequest) -> None:
            async for _ in engine.generate(list(r.prompt_token_ids),
                                           sampling_params(r.output_len), f"async-{i}"):
                pass

        await asyncio.gather(*(consume(i, r) for i, r in enumerate(requests)))
        core.schedule = schedule
    finally:
        await engine.shutdown()
    full = [(wall, fwd) for n_reqs, n_tok, wall, fwd in records.values()
            if n_reqs == num_running and n_tok == num_running]
    if not full:
        raise RuntimeError(f"no async decode step ran {num_running} requests together")
    out = overhead_summary(full)
    out["num_running"] = num_running
    return out


def engine_overhead_async(engine_kwargs: dict, num_running: int, prompt_len: int,
                          output_len: int, vocab_size: int, seed: int) -> dict:
    """The same measurement on the ``AsyncEngine`` (uvloop), the server's path."""
    import uvloop

    requests = synthetic_workload(num_running, (prompt_len, prompt_len), (output_len, output_len),
                                  vocab_size, seed + 2)
    return uvloop.run(_async_overhead(engine_kwargs, requests, num_running))


async def _worker_idle(engine_kwargs: dict, requests: Sequence[BenchRequest],
                       num_running: int) -> dict:
    from aioengine.config import EngineConfig
    from aioengine.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.start(EngineConfig.from_kwargs(**engine_kwargs))
    try:
        core = engine.core.core
        update = core.update_from_output
        records: list[tuple[float, float]] = []  # (idle s, forward + sample s)

        def timed_update(so, ro, *args, **kwargs):
            if so.num_reqs == num_running and so.total_num_scheduled_tokens == num_running:
                records.append((ro.idle_time, ro.forward_time + ro.sample_time))
            return update(so, ro, *args, **kwargs)

        core.update_from_output = timed_update

        async def consume(i: int, r: BenchRequest) -> None:
            async for _ in engine.generate(list(r.prompt_token_ids),
                                           sampling_params(r.output_len), f"idle-{i}"):
                pass

        t0 = time.perf_counter()
        await asyncio.gather(*(consume(i, r) for i, r in enumerate(requests)))
        elapsed = time.perf_counter() - t0
    finally:
        await engine.shutdown()
    records = records[1:]  # the first full step follows the prefills' wait
    if not records:
        raise RuntimeError(f"no decode step ran {num_running} requests together")
    idle = [i for i, _ in records]
    busy = [b for _, b in records]
    return {"num_steps": len(records), "num_running": num_running,
            "async_scheduling": engine_kwargs.get("async_scheduling", False),
            "median_idle_ms": 1000 * statistics.median(idle),
            "median_busy_ms": 1000 * statistics.median(busy),
            "idle_pct_of_step": 100 * sum(idle) / (sum(idle) + sum(busy)),
            "output_tokens_per_s": sum(r.output_len for r in requests) / elapsed}


def worker_idle(engine_kwargs: dict, num_running: int, prompt_len: int, output_len: int,
                vocab_size: int, seed: int, async_scheduling: bool) -> dict:
    """The worker's idle time between consecutive decode steps on the
    ``AsyncEngine`` (from sending an output until the next step message is read,
    ``ModelRunnerOutput.idle_time``), as a share of the step (idle + forward +
    sampling), with or without async scheduling."""
    import uvloop

    requests = synthetic_workload(num_running, (prompt_len, prompt_len), (output_len, output_len),
                                  vocab_size, seed + 2)
    kwargs = dict(engine_kwargs, async_scheduling=async_scheduling)
    return uvloop.run(_worker_idle(kwargs, requests, num_running))


def sampling_share(rows_list: Sequence[int], threads: int, vocab_size: int, seed: int,
                   steps: int = 12, clock: str = "wall") -> dict:
    """The step breakdown at 1, 8, 32 rows: worker forward, LM head and sampler
    (ms, medians over full decode steps), in-process so the two halves of
    ``ModelRunnerOutput.sample_time`` can be timed apart; greedy and sampled
    (temperature 0.8, top-p 0.95) rows. All-greedy steps run the LM head's fused
    argmax (``compute_greedy_tokens``), counted as the LM head; their sampler is 0.

    ``clock="cpu"`` (one thread only: every op then runs on the calling thread) times
    with this thread's CPU time instead of the wall clock, which other processes on a
    shared machine move far less; the step is then ``execute_model`` (batch
    preparation included) and the forward is the step less the LM head and sampler.
    Raises ``ValueError`` for the CPU clock with more than one thread."""
    if clock == "cpu" and threads != 1:
        raise ValueError("the cpu clock needs --threads 1 (other threads' time is not counted)")
    now = time.thread_time if clock == "cpu" else time.perf_counter
    from aioengine import LLM, SamplingParams
    from aioengine.worker import model_runner as mr

    llm = LLM(executor="inproc", num_threads=threads, max_num_seqs=max(rows_list))
    runner = llm.executor.runner
    model = runner.model
    times: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = now()
            out = fn(*a, **k)
            times[name] = times.get(name, 0.0) + now() - t
            return out
        return wrapper

    compute_logits, sample_fn = model.compute_logits, mr.sample
    model.compute_logits = timed("lm_head", compute_logits)
    # all-greedy steps take the LM head's fused argmax (no logits, no sampler call)
    model.compute_greedy_tokens = timed("lm_head", model.compute_greedy_tokens)
    mr.sample = timed("sampler", sample_fn)
    out: dict = {}
    try:
        for mode, params in (("greedy", dict(temperature=0.0)),
                             ("sampled", dict(temperature=0.8, top_p=0.95, seed=seed))):
            for rows in rows_list:
                requests = synthetic_workload(rows, (64, 64), (steps, steps), vocab_size,
                                              seed + rows)
                for i, r in enumerate(requests):
                    llm.engine.add_request(f"share-{mode}-{rows}-{i}", r.prompt_token_ids,
                                           SamplingParams(max_tokens=steps, ignore_eos=True,
                                                          **params))
                recs = []
                while llm.engine.has_unfinished_requests():
                    times.clear()
                    so = llm.engine.schedule()
                    t = now()
                    ro = llm.executor.execute_model(so)
                    step = now() - t
                    llm.engine.process_output(so, ro)
                    if so.num_reqs == rows and so.total_num_scheduled_tokens == rows:
                        head, sampler = times.get("lm_head", 0.0), times.get("sampler", 0.0)
                        if clock == "cpu":
                            recs.append((step, step - head - sampler, head, sampler))
                        else:
                            recs.append((ro.forward_time + ro.sample_time, ro.forward_time,
                                         head, sampler))
                med = [1000 * statistics.median(x[j] for x in recs) for j in range(4)]
                out[f"{mode}_{rows}"] = {"rows": rows, "step_ms": med[0], "forward_ms": med[1],
                                         "lm_head_ms": med[2], "sampler_ms": med[3],
                                         "sampler_pct": 100 * med[3] / med[0],
                                         "lm_head_plus_sampler_pct": 100 * (med[2] + med[3])
                                         / med[0]}
    finally:
        mr.sample = sample_fn
        llm.shutdown()
    return out


def ring_round_trip(round_trips: int) -> dict:
    """bench/ipc_ring.py's ShmRing echo (engine side on uvloop)."""
    import multiprocessing as mp

    from bench.ipc_ring import bench_ring, make_message

    results = bench_ring(mp.get_context("spawn"), make_message(), round_trips,
                         max(50, round_trips // 10))
    return {r["name"]: r for r in results}


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["random", "chat"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(32, 512),
                   metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(16, 256),
                   metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    p.add_argument("--executor", choices=["process", "inproc"], default="process")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-sequential", action="store_true",
                   help="also run the workload through HF one request at a time (slow)")
    p.add_argument("--skip-hf", action="store_true", help="our side only")
    p.add_argument("--no-repeat-engine", dest="repeat_engine", action="store_false",
                   help="run the engine's throughput once, not before and after HF's")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--batch1-tokens", type=int, default=128,
                   help="tokens for the batch-1 decode measurement (0: skip)")
    p.add_argument("--batch1-prompt-len", type=int, default=32)
    p.add_argument("--overhead-requests", type=int, default=32,
                   help="running requests for the overhead measurement (0: skip)")
    p.add_argument("--overhead-prompt-len", type=int, default=64)
    p.add_argument("--overhead-output-len", type=int, default=64)
    p.add_argument("--skip-async-overhead", action="store_true")
    p.add_argument("--skip-worker-idle", action="store_true",
                   help="skip the worker idle time with and without --async-scheduling")
    p.add_argument("--sampling-share-clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the step breakdown in this thread's CPU time (needs --threads 1), "
                        "steady on a shared machine")
    p.add_argument("--sampling-share-rows", type=int, nargs="*", default=[1, 8, 32],
                   help="rows for the LM head / sampler step breakdown (none: skip)")
    p.add_argument("--ring-round-trips", type=int, default=2000, help="0: skip")
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    progress = not args.no_progress
    torch.set_num_threads(args.threads)
    load = LoadTracker()
    load.sample()

    from aioengine import LLM
    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    vocab_size = len(tokenizer)
    if args.dataset == "chat":
        requests = chat_workload(tokenizer, args.num_prompts, tuple(args.output_len_range),
                                 args.seed)
    else:
        requests = synthetic_workload(args.num_prompts, tuple(args.input_len_range),
                                      tuple(args.output_len_range), vocab_size, args.seed)
    batch1_prompt = synthetic_workload(1, (args.batch1_prompt_len,) * 2, (1, 1), vocab_size,
                                       args.seed + 3)[0].prompt_token_ids
    engine_kwargs = {"dtype": args.dtype, "num_threads": args.threads,
                     "executor": args.executor, "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens}
    report: dict = {"benchmark": "throughput", "environment": environment(args.threads, args.dtype),
                    "engine_config": engine_kwargs, "targets": TARGETS,
                    "workload": {"dataset": args.dataset, "seed": args.seed,
                                 "input_len_range": list(args.input_len_range),
                                 "output_len_range": list(args.output_len_range),
                                 **workload_summary(requests)}}

    def phase(name: str, fn, *fn_args, **fn_kwargs) -> dict:
        """Run one measurement with the load average before and after it."""
        before = load.sample()[0]
        t0 = time.perf_counter()
        result = fn(*fn_args, **fn_kwargs)
        elapsed = time.perf_counter() - t0
        result["loadavg_1m"] = [before, load.sample()[0]]
        print(f"[{name}: {elapsed:.1f} s, load {before:.2f} -> "
              f"{result['loadavg_1m'][1]:.2f}]", flush=True)
        return result

    # Both sides are loaded up front so each comparison runs back to back (the
    # machine's load drifts): engine, HF, and the engine again for throughput
    # (its two runs bracket HF's); batch-1 ours then HF's. Our worker idles
    # (blocked on its doorbell) while HF runs.
    llm = LLM(**engine_kwargs)
    model = None
    try:
        add_requests(llm, synthetic_workload(4, (16, 64), (4, 8), vocab_size, 99), "warmup")
        drive_steps(llm)
        if not args.skip_hf:
            model = baseline_hf.load_hf_model(args.dtype)
            baseline_hf.warmup(model)
        if not args.skip_throughput:
            runs = [phase("engine throughput", engine_throughput, llm, requests, progress)]
            if model is not None:
                report["hf"] = phase("HF throughput", baseline_hf.hf_static_batches, model,
                                     requests, args.hf_batch_size, progress=progress)
                if args.hf_sequential:
                    report["hf_sequential"] = phase("HF sequential", baseline_hf.hf_sequential,
                                                    model, requests, progress)
                if args.repeat_engine:
                    runs.append(phase("engine throughput (repeat)", engine_throughput, llm,
                                      requests, progress))
            report["engine"] = combine_runs(runs)
            if model is not None:
                report["ratio_vs_hf"] = {
                    k: report["engine"][k] / report["hf"][k]
                    for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
        if args.batch1_tokens:
            report["batch1_decode"] = {"engine": phase(
                "engine batch-1 decode", engine_decode_batch1, llm, batch1_prompt,
                args.batch1_tokens)}
            if model is not None:
                hf_b1 = phase("HF batch-1 decode", baseline_hf.hf_decode_batch1, model,
                              batch1_prompt, args.batch1_tokens)
                report["batch1_decode"]["hf"] = hf_b1
                report["batch1_decode"]["ratio_vs_hf"] = (
                    report["batch1_decode"]["engine"]["decode_tokens_per_s"]
                    / hf_b1["decode_tokens_per_s"])
        del model
        if args.overhead_requests:
            report["overhead"] = {"sync": phase(
                "engine overhead (sync)", engine_overhead_sync, llm, args.overhead_requests,
                args.overhead_prompt_len, args.overhead_output_len, vocab_size, args.seed)}
    finally:
        llm.shutdown()
    if args.overhead_requests and not args.skip_async_overhead:
        report["overhead"]["async"] = phase(
            "engine overhead (async)", engine_overhead_async, engine_kwargs,
            args.overhead_requests, args.overhead_prompt_len, args.overhead_output_len,
            vocab_size, args.seed)
    if args.overhead_requests and not args.skip_worker_idle:
        report["worker_idle"] = {
            ("async" if on else "sync"): phase(
                f"worker idle (async scheduling {'on' if on else 'off'})", worker_idle,
                engine_kwargs, args.overhead_requests, args.overhead_prompt_len,
                args.overhead_output_len, vocab_size, args.seed, on)
            for on in (False, True)}
    if args.sampling_share_rows:
        report["sampling_share"] = phase("sampling share", sampling_share,
                                         args.sampling_share_rows, args.threads, vocab_size,
                                         args.seed, 12, args.sampling_share_clock)
    if args.ring_round_trips:
        report["ring_round_trip"] = phase("ring round trip", ring_round_trip,
                                          args.ring_round_trips)
    report["load"] = load.summary()
    path = write_results(args.output_json, "throughput.json", report)
    print_report(report, args)
    print(f"wrote {path}")
    return report


def combine_runs(runs: list[dict]) -> dict:
    """One engine throughput figure from one or more runs of the same workload:
    rates over the mean elapsed time; each run kept under ``"runs"``."""
    if len(runs) == 1:
        return runs[0]
    mean_elapsed = statistics.fmean(r["elapsed_s"] for r in runs)
    out = {"elapsed_s": round(mean_elapsed, 3), "runs": runs}
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        work = runs[0][key] * runs[0]["elapsed_s"]
        out[key] = work / mean_elapsed
    return out


def print_report(r: dict, args: argparse.Namespace) -> None:
    w = r["workload"]
    print(f"\n== {args.dtype}, {args.threads} threads, load {r['load']['loadavg_1m_min']:.2f}-"
          f"{r['load']['loadavg_1m_max']:.2f}")
    if "engine" in r or "hf" in r:
        print(f"\n== offline throughput: {w['num_requests']} {w['dataset']} requests, "
              f"{w['prompt_tokens']} prompt + {w['output_tokens']} output tokens")
    rows = []
    if "engine" in r:
        for i, run in enumerate(r["engine"].get("runs", [])):
            rows.append((f"aioengine LLM, run {i + 1}", run))
        rows.append(("aioengine LLM" + (" (mean)" if "runs" in r["engine"] else ""),
                     r["engine"]))
    if "hf" in r:
        rows.append((f"HF generate, static batch {r['hf']['batch_size']}", r["hf"]))
    if "hf_sequential" in r:
        rows.append(("HF generate, batch 1", r["hf_sequential"]))
    if rows:
        print(f"{'':<32}{'req/s':>9}{'output tok/s':>14}{'total tok/s':>13}{'s':>9}"
              f"{'load 1m':>12}")
        for name, x in rows:
            la = x.get("loadavg_1m")
            load = f"{la[0]:.1f}->{la[1]:.1f}" if la else ""
            print(f"{name:<32}{x['requests_per_s']:>9.3f}{x['output_tokens_per_s']:>14.1f}"
                  f"{x['total_tokens_per_s']:>13.1f}{x['elapsed_s']:>9.1f}{load:>12}")
    if "ratio_vs_hf" in r:
        ratio = r["ratio_vs_hf"]["output_tokens_per_s"]
        print(f"ratio (output tok/s): {ratio:.2f}x   target >= 2x, stretch 3x")
    if "batch1_decode" in r:
        b = r["batch1_decode"]
        line = f"\n== batch-1 decode: ours {b['engine']['decode_tokens_per_s']:.1f} tok/s"
        if "hf" in b:
            line += (f", HF {b['hf']['decode_tokens_per_s']:.1f} tok/s, "
                     f"ratio {b['ratio_vs_hf']:.2f}x")
        print(line + "   target >= 35 tok/s (fp32)")
    if "overhead" in r:
        for mode, o in r["overhead"].items():
            print(f"\n== engine overhead ({mode}), {o['num_running']} running, "
                  f"{o['num_steps']} decode steps: median step {o['median_step_ms']:.1f} ms, "
                  f"worker forward+sample {o['median_forward_sample_ms']:.1f} ms, overhead "
                  f"{o['median_overhead_ms']:.2f} ms = {o['median_overhead_pct']:.1f}% "
                  f"(aggregate {o['aggregate_overhead_pct']:.1f}%)   target <= 10%")
            if "breakdown_median_ms" in o:
                print("   median ms: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in o["breakdown_median_ms"].items()))
    if "worker_idle" in r:
        for mode, o in r["worker_idle"].items():
            print(f"\n== worker idle between decode steps ({mode}), {o['num_running']} running, "
                  f"{o['num_steps']} steps: median idle {o['median_idle_ms']:.2f} ms, median "
                  f"forward+sample {o['median_busy_ms']:.1f} ms, idle "
                  f"{o['idle_pct_of_step']:.2f}% of the step, "
                  f"{o['output_tokens_per_s']:.1f} output tok/s   target <= 2%")
    if "sampling_share" in r:
        print("\n== step breakdown (ms, medians of full decode steps; target sampler <= 10%)")
        for key, o in r["sampling_share"].items():
            if not isinstance(o, dict):
                continue
            print(f"   {key:<12} step {o['step_ms']:7.1f}  forward {o['forward_ms']:7.1f}  "
                  f"LM head {o['lm_head_ms']:6.1f}  sampler {o['sampler_ms']:6.2f} "
                  f"({o['sampler_pct']:.1f}%; LM head + sampler "
                  f"{o['lm_head_plus_sampler_pct']:.1f}%)")
    if "ring_round_trip" in r:
        ring = r["ring_round_trip"]["shm_ring"]
        idle = r["ring_round_trip"].get("shm_ring_idle_1ms", {})
        print(f"\n== shm ring round trip: median {ring['median_us']:.1f} us "
              f"(after 1 ms idle: {fmt(idle.get('median_us', float('nan')))} us)"
              f"   target < 50 us")


if __name__ == "__main__":
    main()
