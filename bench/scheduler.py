"""Inter-token latency of decoding streams while new prompts keep arriving:
the chunked-prefill token budget (issue 4's scheduler benchmark; issue 16's
"ITL p99 under 2x ITL p50 with 32 streams decoding and new prompts arriving").

For each mode a server is started (or ``--url-MODE`` is used):

1. ``--num-streams`` (32) streaming completions start together (short
   random-token prompts, ``--stream-output-len`` (512) tokens each, greedy,
   ``ignore_eos``, over SSE).
2. Once every stream has its first token, new prompts arrive, a Poisson
   process with a mean gap of ``--long-prompt-interval`` (6 s;
   ``--arrivals fixed`` for a fixed gap), each ``--long-prompt-len`` MIN MAX
   (300-1,500, uniform) random tokens, distinct, so the prefix cache cannot
   help, asking for ``--long-max-tokens`` (1) token, until the streams are
   done (or ``--time-limit``).
3. The streams' inter-token latencies (ITL) are split into "before" (no new
   prompt sent yet) and "during" (the gap ends after the first one was sent);
   p50/p90/p99/max of each and p99/p50 during are reported, with the new
   prompts' TTFT, and the TTFT of step 1's burst of streams (a cap that throttled a
   burst, admitting a prompt or two a step, shows there) beside the most requests
   the engine ran in one step.

Modes (all ``--max-num-batched-tokens CHUNK_BUDGET``, default 2048, the
server's default):

- ``on``: the server's default: while requests decode, a step's prompt tokens
  are capped so it is predicted to take at most ``--chunked-prefill-itl-ratio``
  (1.5; ``--itl-ratio`` to set it) times a decode-only step.
- ``fixed``: ``--chunked-prefill-itl-ratio 0``: any step may fill the whole
  budget (the engine before the cap).
- ``off``: ``--no-enable-chunked-prefill --max-num-batched-tokens
  NO_CHUNK_BUDGET`` (it must hold a whole prompt): a prompt goes through in
  one step and the streams wait for it.

Usage:
    python bench/scheduler.py --time-limit 240     # on, fixed: 2-10 min on 2 cores
    python bench/scheduler.py --modes on,fixed,off --no-chunk-budget 2048
Writes bench/results/scheduler.json and scheduler_itl_chunked_prefill.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    RESULTS_DIR,
    BenchRequest,
    BenchServer,
    LoadTracker,
    latency_summary,
    percentile,
    synthetic_workload,
    write_results,
)
from bench.serving import Endpoint, RequestResult, engine_stats, sse_request, stats_delta

MODES = ("on", "fixed", "off")
LABELS = {"on": "chunked prefill, ITL-ratio cap", "fixed": "chunked prefill, fixed budget",
          "off": "chunked prefill off"}


def server_args(mode: str, args: argparse.Namespace) -> list[str]:
    common = ["--dtype", args.dtype, "--num-threads", str(args.threads), "--log-level", "warning",
              *args.server_arg]
    if mode == "on":
        return [*common, "--max-num-batched-tokens", str(args.chunk_budget),
                *(["--chunked-prefill-itl-ratio", str(args.itl_ratio)] if args.itl_ratio else [])]
    if mode == "fixed":
        return [*common, "--max-num-batched-tokens", str(args.chunk_budget),
                "--chunked-prefill-itl-ratio", "0"]
    return [*common, "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(args.no_chunk_budget)]


async def run_mode(endpoint: Endpoint, args: argparse.Namespace, seed: int) -> dict:
    """One measurement against one server."""
    import httpx

    vocab = args.vocab_size
    streams = synthetic_workload(args.num_streams, (args.stream_prompt_len,) * 2,
                                 (args.stream_output_len,) * 2, vocab, seed)
    longs = synthetic_workload(args.max_long_prompts, tuple(args.long_prompt_len),
                               (args.long_max_tokens,) * 2, vocab, seed + 1000)
    gaps = random.Random(seed + 2000)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit + 60),
                                 limits=limits) as client:
        await sse_request(client, endpoint, BenchRequest(streams[0].prompt_token_ids[:8], 2),
                          False)
        before = await engine_stats(client, endpoint)
        t0 = time.perf_counter()
        deadline = t0 + args.time_limit
        results = [RequestResult(prompt_len=r.prompt_len) for r in streams]
        stream_tasks = [asyncio.ensure_future(sse_request(client, endpoint, r, False, res))
                        for r, res in zip(streams, results)]
        while (not all(r.token_times for r in results) and time.perf_counter() < deadline
               and not all(t.done() for t in stream_tasks)):
            await asyncio.sleep(0.005)
        long_tasks: list[asyncio.Task] = []
        long_sent: list[float] = []
        for req in longs:
            if all(t.done() for t in stream_tasks) or time.perf_counter() >= deadline:
                break
            long_sent.append(time.perf_counter())
            long_tasks.append(asyncio.ensure_future(sse_request(client, endpoint, req, False)))
            gap = (gaps.expovariate(1.0 / args.long_prompt_interval)
                   if args.arrivals == "poisson" else args.long_prompt_interval)
            await asyncio.wait(stream_tasks, timeout=gap,
                                         return_when=asyncio.ALL_COMPLETED)
        await asyncio.wait(stream_tasks + long_tasks,
                           timeout=max(0.0, deadline - time.perf_counter()))
        for task in stream_tasks + long_tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*stream_tasks, *long_tasks, return_exceptions=True)
        after = await engine_stats(client, endpoint)

    first_long = long_sent[0] if long_sent else float("inf")
    itl_before, itl_during = [], []
    for r in results:
        for a, b in zip(r.token_times, r.token_times[1:]):
            (itl_during if b > first_long else itl_before).append(b - a)
    long_results = [t.result() for t in long_tasks if t.done() and not t.cancelled()]
    ok_streams = [r for r in results if r.ok]
    return {
        "streams_completed": len(ok_streams), "num_streams": len(streams),
        "stream_errors": [r.error for r in results if not r.ok][:5],
        "long_prompts_sent": len(long_sent),
        "long_prompts_completed": sum(r.ok for r in long_results),
        "itl_before_long_prompts": latency_summary(itl_before),
        "itl_during_long_prompts": latency_summary(itl_during),
        "itl_max_during_ms": round(1000 * max(itl_during, default=float("nan")), 3),
        "itl_p99_over_p50_during": round(percentile(sorted(itl_during), 99)
                                         / percentile(sorted(itl_during), 50), 3)
        if itl_during else float("nan"),
        "long_prompt_ttft": latency_summary(r.ttft_s for r in long_results if r.ok),
        "stream_ttft": latency_summary(r.token_times[0] - r.start for r in results
                                       if r.token_times),
        "duration_s": round(time.perf_counter() - t0, 3),
        "engine_stats": stats_delta(before, after),
        "itl_samples_ms": [[round(1000 * (b - t0), 2), round(1000 * (b - a), 3)]
                           for r in results for a, b in zip(r.token_times, r.token_times[1:])],
        "long_sent_ms": [round(1000 * (t - t0), 2) for t in long_sent],
    }


def plot(report: dict, path: Path) -> None:
    """ITL CDF per mode (during long prompts) and ITL against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for mode, res in report["modes"].items():
        label = LABELS[mode]
        during = sorted(itl for t, itl in res["itl_samples_ms"]
                        if t > (res["long_sent_ms"] or [float("inf")])[0])
        if during:
            ax1.plot(during, [(i + 1) / len(during) for i in range(len(during))], label=label)
        times = [t / 1000 for t, _ in res["itl_samples_ms"]]
        ax2.scatter(times, [itl for _, itl in res["itl_samples_ms"]], s=3, label=label, alpha=0.6)
    ax1.set_xscale("log")
    ax1.set_xlabel("inter-token latency, ms")
    ax1.set_ylabel("fraction of gaps")
    ax1.set_title(f"ITL of {report['args']['num_streams']} streams while long prompts arrive")
    ax2.set_yscale("log")
    ax2.set_xlabel("time since the streams started, s")
    ax2.set_ylabel("gap before this token, ms")
    ax2.set_title("every inter-token gap")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend()
    a, load = report["args"], report["load"]
    lo, hi = a["long_prompt_len"]
    fig.suptitle(f"aioengine {a['dtype']}; new {lo}-{hi}-token prompts every "
                 f"{a['long_prompt_interval']} s ({a['arrivals']}); --max-num-batched-tokens "
                 f"{a['chunk_budget']} (off: {a['no_chunk_budget']}); load avg "
                 f"{load['loadavg_1m_min']:.1f}-"
                 f"{load['loadavg_1m_max']:.1f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="on,fixed",
                   help="comma-separated: on (chunked prefill, the server's ITL-ratio cap), "
                        "fixed (chunked prefill, no cap: --chunked-prefill-itl-ratio 0), off")
    p.add_argument("--url-on", default=None, help="existing server for mode 'on'")
    p.add_argument("--url-fixed", default=None, help="existing server for mode 'fixed'")
    p.add_argument("--url-off", default=None, help="existing server for mode 'off'")
    p.add_argument("--api-key", default=None, help="for --url-*")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra 'serve' flag for both servers (repeatable)")
    p.add_argument("--num-streams", type=int, default=32)
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=512)
    p.add_argument("--long-prompt-len", type=int, nargs="+", default=[300, 1500],
                   metavar="LEN", help="new prompts' length, or MIN MAX: uniform (tokens)")
    p.add_argument("--long-max-tokens", type=int, default=1)
    p.add_argument("--long-prompt-interval", type=float, default=6.0,
                   help="mean seconds between new prompts")
    p.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson",
                   help="new prompts as a Poisson process or at a fixed interval")
    p.add_argument("--max-long-prompts", type=int, default=128)
    p.add_argument("--chunk-budget", type=int, default=2048,
                   help="--max-num-batched-tokens with chunked prefill (on, fixed)")
    p.add_argument("--itl-ratio", type=float, default=1.5,
                   help="--chunked-prefill-itl-ratio of mode 'on' (default: %(default)s)")
    p.add_argument("--no-chunk-budget", type=int, default=2048,
                   help="--max-num-batched-tokens with chunked prefill off (>= long prompt)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    if len(args.long_prompt_len) == 1:
        args.long_prompt_len *= 2
    if len(args.long_prompt_len) != 2 or args.long_prompt_len[0] > args.long_prompt_len[1]:
        p.error("--long-prompt-len takes LEN or MIN MAX (MIN <= MAX)")
    if "off" in args.modes.split(",") and (
            args.no_chunk_budget < args.long_prompt_len[1] + args.num_streams):
        p.error("--no-chunk-budget must hold a whole long prompt plus one token per stream")
    return args


def main(argv: list[str] | None = None) -> dict:
    import uvloop

    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    args = parse_args(argv)
    args.vocab_size = len(load_tokenizer(default_model_path()))
    load = LoadTracker()
    report: dict = {"benchmark": "scheduler", "args": {k: v for k, v in vars(args).items()
                                                       if k != "api_key"}, "modes": {}}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}")
        load.sample()
        url = getattr(args, f"url_{mode}")
        with contextlib.ExitStack() as stack:
            if url:
                endpoint = Endpoint(url.rstrip("/"), args.api_key)
                report["modes"][mode] = {"url": url}
            else:
                log = Path(tempfile.mkdtemp(prefix="aioengine-bench-")) / f"server-{mode}.log"
                flags = server_args(mode, args)
                print(f"{LABELS[mode]}: serve {' '.join(flags)} (log {log})", flush=True)
                server = stack.enter_context(BenchServer(flags, log))
                endpoint = Endpoint(server.base_url)
                report["modes"][mode] = {"server_args": flags}
            report["modes"][mode].update(uvloop.run(run_mode(endpoint, args, args.seed)))
        load.sample()
        print_mode(mode, report["modes"][mode])
    report["load"] = load.summary()
    report["environment"] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
    path = write_results(args.output_json, "scheduler.json", report)
    plot_dir = Path(args.plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    plot(report, plot_dir / "scheduler_itl_chunked_prefill.png")
    print(f"load average (1 min): {report['load']['loadavg_1m_min']:.2f}-"
          f"{report['load']['loadavg_1m_max']:.2f}\nwrote {path}")
    return report


def print_mode(mode: str, r: dict) -> None:
    d, b, lt = r["itl_during_long_prompts"], r["itl_before_long_prompts"], r["long_prompt_ttft"]
    print(f"{LABELS[mode]}: streams {r['streams_completed']}/{r['num_streams']}, "
          f"long prompts {r['long_prompts_completed']}/{r['long_prompts_sent']}; "
          f"ITL during p50 {d['p50_ms']:.0f} ms, p99 {d['p99_ms']:.0f} ms "
          f"({r['itl_p99_over_p50_during']:.2f}x), "
          f"max {r['itl_max_during_ms']:.0f} ms (before: p50 {b['p50_ms']:.0f}, "
          f"p99 {b['p99_ms']:.0f} ms); long prompt TTFT p50 {lt['p50_ms']:.0f} ms", flush=True)
    st = r["stream_ttft"]
    print(f"  burst of {r['num_streams']} streams sent at once: TTFT p50 {st['p50_ms']:.0f} ms, "
          f"p99 {st['p99_ms']:.0f} ms; most requests in one step "
          f"{r['engine_stats'].get('max_reqs_in_step')}", flush=True)


if __name__ == "__main__":
    main()
