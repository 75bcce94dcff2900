"""Online serving benchmark over SSE and the WebSocket, like vLLM's ``benchmark_serving``.

Against a server it starts itself (``aioengine serve`` on a free port of
127.0.0.1) or an existing one (``--url``). Requests arrive as a Poisson
process at ``--request-rate`` or keep a fixed number in flight
(``--max-concurrency``); every run is bounded in count and in time
(``--time-limit``: nothing new starts after it and what is still running is
cancelled and counted as incomplete).

Per request, measured by the client:

- TTFT: from sending the request to the first token.
- ITL: between consecutive token events (one per engine step).
- TPOT: ``(E2E - TTFT) / (output tokens - 1)``.
- E2E: from sending to the last token.

each at p50/p90/p99 (and mean), plus request and output-token throughput.
Over SSE a request is ``POST /v1/completions`` (token-id prompts) or
``/v1/chat/completions`` with ``"stream": true``; over the WebSocket it is a
``completion`` or ``chat`` message on its own connection (opened and past
its ``hello`` before the clock starts). Output lengths are exact
(``ignore_eos``), greedy.

Scenarios (``--scenarios``, comma-separated):

- ``chat8``: 8 concurrent chat streams with ~50-token prompts (real
  questions through the chat template), over SSE and WebSocket. Target:
  TTFT p50 under 1 s. Then, with our server stopped, the same requests
  through HF transformers in this process (bench/baseline_hf.py: static
  batches of ``--chat-concurrency``, left-padded, a streamer stamping each
  step; same dtype and threads), with the ratio to ours. Only against the
  server this script starts, unless ``--hf-with-url``; ``--skip-hf`` turns
  it off.
- ``sweep``: throughput against concurrency (``--concurrencies``, default
  1,2,4,8,16,32) on random-token prompts; plotted.
- ``rate``: Poisson arrivals at ``--request-rate`` requests/s.

Usage:
    python bench/serving.py                          # all scenarios, own server, fp32
    python bench/serving.py --scenarios chat8 --url http://127.0.0.1:8000 --api-key KEY
Writes bench/results/serving.json and the plots serving_throughput_vs_concurrency.png
and serving_latency_distributions.png (``--plot-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    RESULTS_DIR,
    BenchRequest,
    BenchServer,
    LoadTracker,
    chat_workload,
    latency_summary,
    synthetic_workload,
    workload_summary,
    write_results,
)

TARGETS = {"chat8_ttft_p50_ms_max": 1000.0}
PROTOCOLS = ("sse", "ws")


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds, ``time.perf_counter``)."""

    prompt_len: int
    output_len: int = 0               # tokens received
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per token event
    cached_tokens: int = 0

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


# -- clients ---------------------------------------------------------------------------------


@dataclass
class Endpoint:
    """Where and how to reach the server."""

    base_url: str                     # http://127.0.0.1:PORT
    api_key: str | None = None
    model: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def ws_url(self) -> str:
        url = self.base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        return f"{url}/v1/ws" + (f"?api_key={self.api_key}" if self.api_key else "")


def request_body(req: BenchRequest, chat: bool, model: str | None) -> dict:
    """The sampling fields both transports share: greedy, exact output length."""
    body: dict = {"max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
    if chat:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt_token_ids
    if model:
        body["model"] = model
    return body


async def sse_request(client, endpoint: Endpoint, req: BenchRequest, chat: bool,
                      result: RequestResult | None = None) -> RequestResult:
    """One streaming request over SSE (httpx). Pass ``result`` to watch its
    ``token_times`` fill while the request runs."""
    body = request_body(req, chat, endpoint.model)
    body.update(stream=True, stream_options={"include_usage": True})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    result = result or RequestResult(prompt_len=req.prompt_len)
    clock = time.perf_counter
    result.start = clock()
    try:
        async with client.stream("POST", endpoint.base_url + path, json=body,
                                 headers=endpoint.headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = clock()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_len = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                choices = chunk.get("choices") or []
                # One chunk per engine step that made a token; the chat stream
                # opens with a role-only chunk that carries none.
                if choices and not (chat and "role" in (choices[0].get("delta") or {})):
                    result.token_times.append(now)
    except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    return _finish(result, req)


async def ws_request(endpoint: Endpoint, req: BenchRequest, chat: bool) -> RequestResult:
    """One request on its own WebSocket connection; the clock starts after ``hello``."""
    import websockets

    body = request_body(req, chat, endpoint.model)
    body.update(type="chat" if chat else "completion", id="r")
    result = RequestResult(prompt_len=req.prompt_len)
    clock = time.perf_counter
    try:
        async with websockets.connect(endpoint.ws_url, max_size=None,
                                      open_timeout=60) as ws:
            hello = json.loads(await ws.recv())
            if hello.get("type") != "hello":
                result.error = f"expected hello, got {hello}"
                return result
            result.start = clock()
            await ws.send(json.dumps(body))
            while True:
                msg = json.loads(await ws.recv())
                now = clock()
                kind = msg.get("type")
                if kind == "delta":
                    result.token_times.extend([now] * len(msg.get("token_ids") or [1]))
                elif kind == "done":
                    usage = msg.get("usage") or {}
                    result.output_len = usage.get("completion_tokens", len(result.token_times))
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                    break
                elif kind == "error":
                    result.error = f"{msg.get('code')}: {msg.get('message')}"
                    return result
    except Exception as exc:  # noqa: BLE001
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    return _finish(result, req)


def _finish(result: RequestResult, req: BenchRequest) -> RequestResult:
    if not result.token_times:
        result.error = "no tokens received"
        return result
    if not result.output_len:
        result.output_len = len(result.token_times)
    result.ttft_s = result.token_times[0] - result.start
    result.e2e_s = result.token_times[-1] - result.start
    result.ok = result.output_len == req.output_len
    if not result.ok:
        result.error = f"got {result.output_len} tokens, asked for {req.output_len}"
    return result


def make_sender(protocol: str, endpoint: Endpoint, chat: bool, client=None
                ) -> Callable[[BenchRequest], Awaitable[RequestResult]]:
    if protocol == "sse":
        return lambda req: sse_request(client, endpoint, req, chat)
    if protocol == "ws":
        return lambda req: ws_request(endpoint, req, chat)
    raise ValueError(f"unknown protocol {protocol!r}")


# -- load generation -----------------------------------------------------------------------------


async def run_load(send: Callable[[BenchRequest], Awaitable[RequestResult]],
                   requests: Sequence[BenchRequest], *, request_rate: float = float("inf"),
                   max_concurrency: int | None = None, time_limit_s: float = 300.0,
                   seed: int = 0, desc: str = "", progress: bool = True) -> dict:
    """Send ``requests`` in order: Poisson arrivals at ``request_rate`` (inf: all
    at once), at most ``max_concurrency`` in flight. After ``time_limit_s``
    nothing new starts and requests still running are cancelled.

    Returns:
        The summary (``summarize``) and the per-request results under ``"requests"``.
    """
    from tqdm import tqdm

    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False)
    results: list[RequestResult] = []

    async def one(req: BenchRequest) -> None:
        if semaphore is None:
            result = await send(req)
        else:
            async with semaphore:
                result = await send(req)
        results.append(result)
        bar.update(1)

    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    tasks: list[asyncio.Task] = []

    async def launch() -> None:
        for req in requests:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(one(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))

    launcher = asyncio.ensure_future(launch())
    try:
        await asyncio.wait_for(launcher, timeout=time_limit_s)
    except TimeoutError:
        pass
    pending = [t for t in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, deadline - time.perf_counter()))
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    bar.close()
    summary = summarize(results, len(requests), t0)
    summary["request_rate"] = request_rate if request_rate != float("inf") else "inf"
    summary["max_concurrency"] = max_concurrency
    summary["time_limit_s"] = time_limit_s
    summary["requests"] = [_request_record(r, t0) for r in results]
    return summary


def summarize(results: Sequence[RequestResult], num_sent: int, t0: float) -> dict:
    """Throughput and p50/p90/p99 latencies of the completed requests."""
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    end = max((r.start + r.e2e_s for r in done), default=t0)
    duration = max(end - t0, 1e-9)
    output_tokens = sum(r.output_len for r in done)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    return {
        "num_requests": num_sent, "completed": len(done),
        "incomplete": num_sent - len(done), "errors": errors[:5],
        "duration_s": round(duration, 3),
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in done)) / duration,
        "prompt_tokens": sum(r.prompt_len for r in done), "output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "ttft": latency_summary(r.ttft_s for r in done),
        "tpot": latency_summary(tpots),
        "itl": latency_summary(x for r in done for x in r.itl_s),
        "e2e": latency_summary(r.e2e_s for r in done),
    }


def _request_record(r: RequestResult, t0: float) -> dict:
    return {"ok": r.ok, "prompt_len": r.prompt_len, "output_len": r.output_len,
            "cached_tokens": r.cached_tokens, "start_s": round(r.start - t0, 4),
            "ttft_s": round(r.ttft_s, 4),
            "e2e_s": round(r.e2e_s, 4), "itl_s": [round(x, 5) for x in r.itl_s],
            "error": r.error}


# -- scenarios -------------------------------------------------------------------------------


async def engine_stats(client, endpoint: Endpoint, steps: bool = False) -> dict:
    """``GET /v1/engine/stats`` (``steps``: with ``recent_steps``)."""
    r = await client.get(endpoint.base_url + "/v1/engine/stats" + ("?steps=1" if steps else ""),
                         headers=endpoint.headers)
    r.raise_for_status()
    return r.json()


def stats_delta(before: dict, after: dict) -> dict:
    """What the engine counted during a run (``EngineStats`` differences); with
    ``after["recent_steps"]`` (``?steps=1``) also ``decode_steps``."""
    keys = ("num_steps", "num_multi_request_steps", "num_preemptions", "num_prompt_tokens",
            "num_generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "worker_idle_time", "worker_busy_time")
    out = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    out["max_reqs_in_step"] = after.get("max_reqs_in_step")
    if "recent_steps" in after:
        out["decode_steps"] = decode_step_summary(after["recent_steps"][-out["num_steps"]:])
    return out


def decode_step_summary(steps: Sequence[Sequence[float]]) -> dict | None:
    """Issue 16's figure: the worker's idle time between consecutive decode steps
    at the run's full width. ``steps``: a run's ``[requests, tokens, worker idle s,
    worker busy s]`` records (``GET /v1/engine/stats?steps=1``); kept are decode-only
    steps (one token per request) of the most requests any decode step ran, less the
    first of each stretch (its idle time is the prefill's hand-over). Returns mean
    and p50 of idle and busy (forward + sampling) in ms, idle as % of idle + busy,
    or None when no such step ran."""
    decode = [s for s in steps if s[0] == s[1] and s[0] > 0]
    if not decode:
        return None
    width = max(s[0] for s in decode)
    kept = [s for prev, s in itertools.pairwise(steps)
            if s[0] == s[1] == width and prev[0] == prev[1] == width]
    if not kept:
        return None
    idle = [s[2] for s in kept]
    busy = [s[3] for s in kept]
    return {"num_reqs": width, "num_steps": len(kept),
            "idle_mean_ms": round(1000 * statistics.fmean(idle), 3),
            "idle_p50_ms": round(1000 * statistics.median(idle), 3),
            "busy_mean_ms": round(1000 * statistics.fmean(busy), 3),
            "busy_p50_ms": round(1000 * statistics.median(busy), 3),
            "idle_pct_of_step": round(100 * sum(idle) / (sum(idle) + sum(busy)), 2)}


async def measured_run(client, endpoint: Endpoint, protocol: str, requests: list[BenchRequest],
                       chat: bool, args: argparse.Namespace, desc: str, **load_kwargs) -> dict:
    """A warm-up request, then ``run_load`` with the engine's counters around it."""
    send = make_sender(protocol, endpoint, chat, client)
    await send(BenchRequest(requests[0].prompt_token_ids, 2, requests[0].messages))
    before = await engine_stats(client, endpoint)
    result = await run_load(send, requests, time_limit_s=args.time_limit, seed=args.seed,
                            desc=desc, progress=not args.no_progress, **load_kwargs)
    result["engine_stats"] = stats_delta(before, await engine_stats(client, endpoint, steps=True))
    result["protocol"] = protocol
    return result


def chat8_workload(tokenizer, args: argparse.Namespace) -> list[BenchRequest]:
    """The ``chat8`` requests: both sides send these token ids."""
    output_len = (args.chat_max_tokens, args.chat_max_tokens)
    return chat_workload(tokenizer, args.chat_requests, output_len, args.seed,
                         pad_to_50_tokens=True)


def hf_chat8(requests: list[BenchRequest], args: argparse.Namespace, load: LoadTracker) -> dict:
    """``requests`` through HF ``generate`` in static batches of
    ``--chat-concurrency`` (bench/baseline_hf.py), summarized like our runs
    (times from the HF run's start)."""
    import torch

    from bench import baseline_hf

    torch.set_num_threads(args.threads)
    print(f"loading the HF model ({args.dtype}, {args.threads} threads)", flush=True)
    model = baseline_hf.load_hf_model(args.dtype)
    baseline_hf.warmup(model)
    load.sample()
    timings = baseline_hf.hf_static_batch_latency(model, requests, args.chat_concurrency,
                                                  time_limit_s=args.time_limit,
                                                  progress=not args.no_progress)
    load.sample()
    results = [RequestResult(prompt_len=t.prompt_len, output_len=len(t.token_times_s), ok=True,
                             start=t.arrival_s, ttft_s=t.ttft_s, e2e_s=t.e2e_s,
                             token_times=t.token_times_s) for t in timings]
    summary = summarize(results, len(requests), 0.0)
    summary.update(backend="hf_static_batch", batch_size=args.chat_concurrency,
                   time_limit_s=args.time_limit,
                   requests=[_request_record(r, 0.0) for r in results])
    return summary


def ratio_vs_hf(ours: dict, hf: dict) -> dict:
    """HF TTFT p50 / ours (above 1: ours answers sooner) and our output
    throughput / HF's (above 1: ours is faster)."""
    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {"ttft_p50": ratio(hf["ttft"]["p50_ms"], ours["ttft"]["p50_ms"]),
            "output_throughput": ratio(ours["output_throughput"], hf["output_throughput"])}


async def run_scenarios(endpoint: Endpoint, args: argparse.Namespace, tokenizer, load: LoadTracker
                        ) -> dict:
    import httpx

    scenarios = args.scenarios.split(",")
    protocols = args.protocols.split(",")
    out: dict = {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.time_limit + 60)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if "chat8" in scenarios:
            requests = chat8_workload(tokenizer, args)
            out["chat8"] = {"workload": workload_summary(requests)}
            for protocol in protocols:
                load.sample()
                res = await measured_run(client, endpoint, protocol, requests, True, args,
                                         f"chat8 {protocol}", max_concurrency=args.chat_concurrency)
                out["chat8"][protocol] = res
                _print_run(f"chat {args.chat_concurrency} streams, {protocol}", res)
        if "sweep" in scenarios:
            out["sweep"] = {}
            for protocol in protocols:
                out["sweep"][protocol] = []
                for c in [int(x) for x in args.concurrencies.split(",")]:
                    n = max(args.sweep_min_requests, args.sweep_requests_per_stream * c)
                    requests = synthetic_workload(
                        n, (args.sweep_input_len, args.sweep_input_len),
                        (args.sweep_output_len, args.sweep_output_len),
                        len(tokenizer), args.seed + c)
                    load.sample()
                    res = await measured_run(client, endpoint, protocol, requests, False, args,
                                             f"sweep {protocol} c={c}", max_concurrency=c)
                    res["concurrency"] = c
                    out["sweep"][protocol].append(res)
                    _print_run(f"concurrency {c:>2}, {protocol}", res)
        if "rate" in scenarios:
            requests = synthetic_workload(args.num_requests, tuple(args.input_len_range),
                                          tuple(args.output_len_range), len(tokenizer), args.seed)
            out["rate"] = {"workload": workload_summary(requests)}
            for protocol in protocols:
                load.sample()
                res = await measured_run(client, endpoint, protocol, requests, False, args,
                                         f"rate {args.request_rate}/s {protocol}",
                                         request_rate=args.request_rate,
                                         max_concurrency=args.max_concurrency)
                out["rate"][protocol] = res
                _print_run(f"Poisson {args.request_rate} req/s, {protocol}", res)
    return out


def _print_run(name: str, r: dict) -> None:
    def ms(x: dict, p: str) -> str:
        return f"{x[p]:.0f}" if x["count"] else "n/a"

    print(f"{name:<28} {r['completed']:>3}/{r['num_requests']:<3} ok  "
          f"{r['request_throughput']:6.2f} req/s {r['output_throughput']:7.1f} tok/s  "
          f"TTFT p50/p90/p99 {ms(r['ttft'], 'p50_ms')}/{ms(r['ttft'], 'p90_ms')}/"
          f"{ms(r['ttft'], 'p99_ms')} ms  TPOT p50 {ms(r['tpot'], 'p50_ms')} ms  "
          f"ITL p50/p99 {ms(r['itl'], 'p50_ms')}/{ms(r['itl'], 'p99_ms')} ms  "
          f"E2E p50 {ms(r['e2e'], 'p50_ms')} ms", flush=True)


# -- plots -------------------------------------------------------------------------------------


def plot_sweep(sweep: dict, path: Path, title: str) -> None:
    """Output tokens/s and TTFT/TPOT p50 against concurrency, one line per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for protocol, runs in sweep.items():
        cs = [r["concurrency"] for r in runs]
        ax1.plot(cs, [r["output_throughput"] for r in runs], marker="o", label=protocol.upper())
        ax2.plot(cs, [r["ttft"]["p50_ms"] for r in runs], marker="o",
                 label=f"TTFT p50, {protocol.upper()}")
        ax2.plot(cs, [r["tpot"]["p50_ms"] for r in runs], marker="s", linestyle="--",
                 label=f"TPOT p50, {protocol.upper()}")
    ticks = sorted({r["concurrency"] for runs in sweep.values() for r in runs})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("concurrent requests")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput against concurrency")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_title("latency against concurrency")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_distributions(runs: dict[str, dict], path: Path, title: str) -> None:
    """Empirical CDFs of TTFT, ITL and E2E, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, run in runs.items():
        reqs = [r for r in run["requests"] if r["ok"]]
        series = {"TTFT": [r["ttft_s"] for r in reqs],
                  "ITL": [x for r in reqs for x in r["itl_s"]],
                  "E2E": [r["e2e_s"] for r in reqs]}
        for ax, (metric, values) in zip(axes, series.items()):
            values = sorted(v * 1000 for v in values)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
            ax.set_title(f"{metric} (CDF)")
            ax.set_xlabel("ms")
    for ax in axes:
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[1].set_xscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None,
                   help="an existing server (http://127.0.0.1:PORT); default: start one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    p.add_argument("--scenarios", default="chat8,sweep,rate")
    p.add_argument("--protocols", default="sse,ws")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="for the server this script starts and the HF baseline")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads of the server this script starts and of the HF baseline")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra 'serve' flag for the server this script starts (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds per run; then nothing new starts and the rest is cancelled")
    # chat8
    p.add_argument("--chat-concurrency", type=int, default=8)
    p.add_argument("--chat-requests", type=int, default=24)
    p.add_argument("--chat-max-tokens", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true",
                   help="chat8: our server only, no HF transformers baseline")
    p.add_argument("--hf-with-url", action="store_true",
                   help="chat8: run the HF baseline here even against --url (same machine, "
                        "--dtype and --threads must match the server's)")
    # sweep
    p.add_argument("--concurrencies", default="1,2,4,8,16,32")
    p.add_argument("--sweep-input-len", type=int, default=128)
    p.add_argument("--sweep-output-len", type=int, default=64)
    p.add_argument("--sweep-requests-per-stream", type=int, default=2,
                   help="requests per level = max(this x concurrency, --sweep-min-requests)")
    p.add_argument("--sweep-min-requests", type=int, default=8)
    # rate
    p.add_argument("--request-rate", type=float, default=2.0, help="requests/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(16, 256))
    # output
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot-dir", default=str(RESULTS_DIR))
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    import uvloop

    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    args = parse_args(argv)
    load = LoadTracker()
    load.sample()
    tokenizer = load_tokenizer(default_model_path())
    report: dict = {"benchmark": "serving", "targets": TARGETS,
                    "args": {k: v for k, v in vars(args).items() if k != "api_key"}}

    with contextlib.ExitStack() as stack:
        if args.url:
            endpoint = Endpoint(args.url.rstrip("/"), args.api_key, args.model)
            report["server"] = {"url": args.url}
        else:
            log = Path(tempfile.mkdtemp(prefix="aioengine-bench-")) / "server.log"
            server_args = ["--dtype", args.dtype, "--num-threads", str(args.threads),
                           "--log-level", "warning", *args.server_arg]
            print(f"starting server: serve {' '.join(server_args)} (log {log})", flush=True)
            server = stack.enter_context(BenchServer(server_args, log))
            endpoint = Endpoint(server.base_url, None, args.model)
            report["server"] = {"args": server_args, "log": str(log)}
        report["results"] = uvloop.run(run_scenarios(endpoint, args, tokenizer, load))
    # After our server has stopped, so the two sides never share the cores.
    chat8 = report["results"].get("chat8")
    if chat8 and not args.skip_hf and (not args.url or args.hf_with_url):
        chat8["hf"] = hf_chat8(chat8_workload(tokenizer, args), args, load)
        _print_run(f"chat {args.chat_concurrency} streams, HF", chat8["hf"])
        chat8["ratio_vs_hf"] = {p: ratio_vs_hf(chat8[p], chat8["hf"])
                                for p in PROTOCOLS if p in chat8}
    load.sample()
    report["load"] = load.summary()
    report["environment"] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv,
                             "dtype": args.dtype, "threads": args.threads}
    path = write_results(args.output_json, "serving.json", report)
    make_plots(report, Path(args.plot_dir))
    print_summary(report)
    print(f"wrote {path}")
    return report


def make_plots(report: dict, plot_dir: Path) -> None:
    plot_dir.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    load = report["load"]
    note = (f"aioengine, SmolLM2-135M {report['args']['dtype']}, "
            f"load avg {load['loadavg_1m_min']:.1f}-{load['loadavg_1m_max']:.1f}")
    if "sweep" in results:
        a = report["args"]
        plot_sweep(results["sweep"], plot_dir / "serving_throughput_vs_concurrency.png",
                   f"{note}; prompts {a['sweep_input_len']} tokens, outputs "
                   f"{a['sweep_output_len']} tokens")
    runs = {}
    for scenario in ("chat8", "rate"):
        for protocol in PROTOCOLS:
            if protocol in results.get(scenario, {}):
                runs[f"{scenario} {protocol.upper()}"] = results[scenario][protocol]
    if "hf" in results.get("chat8", {}):
        runs["chat8 HF static batch"] = results["chat8"]["hf"]
    if runs:
        plot_latency_distributions(runs, plot_dir / "serving_latency_distributions.png", note)


def print_summary(report: dict) -> None:
    chat = report["results"].get("chat8", {})
    for protocol in PROTOCOLS:
        if protocol in chat:
            ttft = chat[protocol]["ttft"]["p50_ms"]
            print(f"chat8 {protocol.upper()}: TTFT p50 {ttft:.0f} ms   target < 1000 ms")
    if "hf" in chat:
        print(f"chat8 HF static batch {chat['hf']['batch_size']}: TTFT p50 "
              f"{chat['hf']['ttft']['p50_ms']:.0f} ms")
        for protocol, ratio in chat["ratio_vs_hf"].items():
            print(f"chat8 {protocol.upper()} vs HF: TTFT p50 HF/ours {ratio['ttft_p50']:.2f}x, "
                  f"output tok/s ours/HF {ratio['output_throughput']:.2f}x")
    load = report["load"]
    print(f"load average (1 min) during the run: {load['loadavg_1m_min']:.2f}-"
          f"{load['loadavg_1m_max']:.2f}")


if __name__ == "__main__":
    main()
