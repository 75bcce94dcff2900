"""aioengine against llama.cpp on the same GGUF file, same threads, one run (issues 15, 16).

Both servers are started here, one after the other, on free loopback ports
and get the same streaming load: ``--concurrency`` (1,2,4,...,64) clients, each
sending ``--requests-per-stream`` requests back to back, ``--prompt-len``
(100) random token ids, ``--max-tokens`` (128) greedy tokens with
``ignore_eos``, over SSE on ``POST /v1/completions``. The load generator and
the metrics are bench/serving.py's (``run_load``, ``sse_request``): TTFT,
ITL, TPOT and output tokens/s as the client sees them.

Measured, in this order:

0. The machine's ceilings on ``--threads`` threads: memory read bandwidth
   (``torch.sum`` of a ``--bandwidth-gb`` (4) GB fp32 buffer, best of 5 passes:
   bench/flops.py's ``read_bandwidth``), and ``torch.mm`` GEMMs in fp32 (MKL)
   and bf16 (oneDNN: AMX or AVX512-BF16 where the CPU has them) at 1024^3 and
   2048^3, the fastest size of each dtype kept (bench/flops.py's
   ``gemm_ceilings``); all of them again after step 5, the higher of the two
   kept.
1. Batch-1 decode, ours: the offline ``LLM`` (worker subprocess), tokens/s
   after the first token, as bench/throughput.py measures it. This also
   builds the C++ kernels if they are not built yet, so the server start
   below measures a start "after the kernels are built".
2. ``aioengine serve``, then ``llama-server -t T -tb T -np N -c N x (prompt +
   output + 32)`` (``N``: the highest concurrency; with ``-np`` given the KV
   cache is split into one stream per slot, so each slot holds the same 260
   tokens at any ``N`` and idle slots cost no attention work), each started
   alone: command to ``GET /health`` 200, polled every 50 ms.
3. The streaming load with both up, interleaved: at each concurrency ours,
   then llama-server, so each ratio is measured back to back (this machine's
   load drifts; an idle server sleeps).
4. RSS (and PSS) of our worker subprocess, of our server process and of
   llama-server (psutil); then a killed worker's time to serve again
   (SIGKILL, then a 1-token request every 50 ms until one succeeds).
5. Batch-1 decode, llama.cpp: ``llama-bench -p 0 -n MAX_TOKENS -d PROMPT_LEN
   -t T`` (pure decode after a prompt of our length; also at depth 0), or,
   without llama-bench, llama-server's 1-stream TPOT.

llama.cpp runs with the ``GOMP_SPINCOUNT`` our worker sets
(``--llama-gomp-spincount``): with libgomp's default spin, either engine
slows several-fold whenever another process wants the cores.

Compute share (issue 16): each run's matmul FLOPs, counted from the model's
config and the requests actually served (bench/flops.py: prompt tokens not
served from the prefix cache and every output token but the last through
every linear layer, the LM head once per output token, attention's QK and PV
at each position's context length), over the run's duration, as a share of
the fp32 and the bf16 GEMM ceiling. Our quantized GEMM runs AMX bf16 tiles at
9+ rows on a CPU that has them (fp32 activations converted per tile), fp32
GEMV below, so there the bf16 ceiling applies to the decode steps of 9+
streams (and to every prefill), the fp32 one to 1-8 streams' decode steps.

Roofline (Williams, Waterman, Patterson, CACM 2009): on an AMX CPU a decode step
of 32 rows is bound by memory, not by the GEMM (it reads every weight and the
32 sequences' KV cache), so each run is also put against its roofline ceiling:
the output tokens over the sum of ``max(FLOPs / peak, bytes / read bandwidth)``
over the steps of an ideal lock-step schedule (waves of ``c`` requests: one
prefill step, then one decode step per further token), where ``peak`` is the
GEMM ceiling of the dtype that a step of that many rows runs (``dtype_in_use``)
and the bytes are the weights as stored in the GGUF file, the KV cache read at
each sequence's context and the KV written, in the KV cache dtype the server
runs (bench/flops.py's ``workload_roofline``). Reported per concurrency: the
ceiling, our share of it, the bound that dominates, and the mean full decode
step's bound in ms.

The CPU model and its SIMD flags are printed first and stored with the
figures. Ratios are ours / llama.cpp for throughput and llama.cpp / ours for
TTFT (above 1: ours is better in both). Speed is never asserted; the
targets are printed beside the figures.

llama-server is found from ``--llama-server``, ``$LLAMA_SERVER`` or ``PATH``;
llama-bench from ``--llama-bench``, ``$LLAMA_BENCH``, llama-server's folder or
``PATH``. Without llama-server the script says so and measures ours only.
Building them: bench/README.md ("aioengine against llama.cpp").

Usage:
    python bench/quantized.py --llama-server /path/to/llama-server      # ~6 min quiet
    python bench/quantized.py --quick                                   # ~3 min
Writes bench/results/quantized.json and the plots (``--plot-dir``)
bench/results/quantized_vs_llama_cpp.png (throughput and TTFT) and
bench/results/quantized_concurrency.png (output tok/s against concurrency, both
servers, ours / llama.cpp at each point; compute share below).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    BenchRequest,
    BenchServer,
    LoadTracker,
    fmt,
    synthetic_workload,
    workload_summary,
    write_results,
)

TARGETS = {
    "batch1_decode_ratio_min": 1.2,
    "streams_32_output_throughput_ratio_min_issue16": 2.0,
    "streams_32_compute_share_min_issue16": 0.5,
    "streams_8_32_output_throughput_ratio_min": 1.5,
    "streams_8_32_ttft_p50_no_worse": True,
    "serve_ready_s_max": 3.0,
    "worker_restart_s_max": 3.0,
    "worker_rss_max": "1/3 of the fp32 worker's",
}

# The instruction-set flags that decide which kernels a CPU can run.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
HEALTH_POLL_S = 0.05
BLOCK_SIZE = 16  # tokens per KV block: aioengine's default (CacheConfig.block_size)
RESTART_POLL_S = 0.05


# -- the machine -----------------------------------------------------------------------------


def cpu_info() -> dict:
    """The CPU model (``/proc/cpuinfo``), which of ``SIMD_FLAGS`` it has, and
    the core count; on a machine without /proc/cpuinfo, ``platform``'s guess."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {"model": model, "simd_flags": [f for f in SIMD_FLAGS if f in flags],
            "cpus": os.cpu_count(), "machine": platform.machine()}


def find_binary(explicit: str | None, env_var: str, name: str,
                beside: Path | None = None) -> Path | None:
    """``explicit``, else ``$env_var``, else ``beside/name``, else ``name`` on
    PATH; ``None`` when none exists (``explicit == "none"``: not wanted)."""
    if explicit == "none":
        return None
    for candidate in (explicit, os.environ.get(env_var),
                      str(beside / name) if beside else None, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate).resolve()
    if explicit:
        raise SystemExit(f"{name} not found or not executable: {explicit}")
    return None


def binary_version(path: Path) -> str:
    """The first line llama.cpp's ``--version`` prints ("version: N (commit)")."""
    try:
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


# -- servers -----------------------------------------------------------------------------------


class TimedServer(BenchServer):
    """A server subprocess on a free loopback port whose start is timed: from
    ``Popen`` to the first ``GET /health`` 200, polled every 50 ms
    (``ready_s``). Stopped like ``BenchServer`` (SIGTERM, then SIGKILL)."""

    name = "server"
    env_overrides: dict[str, str] = {}  # noqa: RUF012 - replaced per instance, never mutated

    def command(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> Self:
        import httpx

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.update(self.env_overrides)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=env, cwd=REPO_ROOT)
        deadline = t0 + self.start_timeout_s
        with httpx.Client(timeout=2) as client:
            while time.perf_counter() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        self.ready_s = time.perf_counter() - t0
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(HEALTH_POLL_S)
        self.__exit__()
        raise RuntimeError(f"{self.name} not healthy after {self.start_timeout_s} s:\n"
                           f"{self.log_tail()}")


class AioengineServer(TimedServer):
    """``python -m aioengine.entrypoints.cli serve --host 127.0.0.1 --port P ARGS``."""

    name = "aioengine serve"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "aioengine.entrypoints.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]


class LlamaServer(TimedServer):
    """``llama-server --host 127.0.0.1 --port P ARGS``."""

    name = "llama-server"

    def __init__(self, binary: Path, args: Sequence[str], log_path: str | Path,
                 start_timeout_s: float = 300.0, env_overrides: dict[str, str] | None = None
                 ) -> None:
        super().__init__(args, log_path, start_timeout_s)
        self.binary = binary
        self.env_overrides = dict(env_overrides or {})

    def command(self) -> list[str]:
        return [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port), *self.args]


def llama_env(args: argparse.Namespace) -> dict[str, str]:
    """llama-server's OpenMP spin setting. ``ours`` (the default): the
    ``GOMP_SPINCOUNT`` our worker runs with, so both engines wait alike on a
    busy machine (libgomp's default spin, 300,000 iterations, costs either
    engine several-fold once another process wants the cores; bench/README.md,
    throughput). ``unset``: libgomp's default. A number: that count. A
    ``GOMP_SPINCOUNT`` already in the environment reaches both and wins."""
    from aioengine.worker.worker import DEFAULT_GOMP_SPINCOUNT

    if "GOMP_SPINCOUNT" in os.environ or args.llama_gomp_spincount == "unset":
        return {}
    if args.llama_gomp_spincount == "ours":
        return {"GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}
    return {"GOMP_SPINCOUNT": str(int(args.llama_gomp_spincount))}


def worker_pids(server_pid: int) -> list[int]:
    """The server's spawned model workers (multiprocessing's ``spawn_main``
    children, its resource tracker aside), the serving one first and the
    standby (``aioengine-sby0``) last."""
    import psutil

    pids = []
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            standby = child.name().startswith("aioengine-sby")
        except psutil.Error:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append((standby, child.pid))
    return [pid for _, pid in sorted(pids)]


def memory_mib(pid: int) -> dict:
    """RSS and PSS of ``pid`` in MiB (PSS splits shared pages, such as a
    memory-mapped model file, among the processes that map them)."""
    import psutil

    proc = psutil.Process(pid)
    out = {"rss_mib": round(proc.memory_info().rss / 2**20, 1)}
    try:
        out["pss_mib"] = round(proc.memory_full_info().pss / 2**20, 1)
    except (psutil.Error, AttributeError):
        pass
    return out


def time_to_serve_again(base_url: str, worker_pid: int, prompt: list[int],
                        timeout_s: float) -> dict:
    """SIGKILL ``worker_pid``, then send a 1-token completion every 50 ms until
    one returns 200, at most ``timeout_s``. Returns the seconds from the kill
    to that answer (``nan`` if none came), and how many requests failed first."""
    import httpx

    os.kill(worker_pid, signal.SIGKILL)
    t0 = time.perf_counter()
    failed = 0
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    with httpx.Client(timeout=5) as client:
        while time.perf_counter() - t0 < timeout_s:
            try:
                if client.post(f"{base_url}/v1/completions", json=body).status_code == 200:
                    return {"serving_again_s": round(time.perf_counter() - t0, 3),
                            "failed_requests": failed}
            except httpx.TransportError:
                pass
            failed += 1
            time.sleep(RESTART_POLL_S)
    return {"serving_again_s": float("nan"), "failed_requests": failed}


# -- the load --------------------------------------------------------------------------------


async def streaming_sweep(servers: Sequence[TimedServer], concurrencies: Sequence[int],
                          args: argparse.Namespace, vocab_size: int, load: LoadTracker
                          ) -> dict[str, list[dict]]:
    """At each concurrency ``c``, each server in turn (so a ratio is measured
    back to back and the machine's load drifts less between its two sides):
    one warm-up request, then ``c`` clients sending ``requests_per_stream``
    requests each (bench/serving.py's ``run_load``, SSE, ``/v1/completions``),
    bounded by ``--time-limit``. Both servers get the same token ids (seeded
    by ``c``). Returns each server's runs by its ``name``."""
    import httpx

    from bench.serving import Endpoint, engine_stats, make_sender, run_load, stats_delta

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    runs: dict[str, list[dict]] = {server.name: [] for server in servers}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit + 60),
                                 limits=limits) as client:
        for c in concurrencies:
            requests = synthetic_workload(c * args.requests_per_stream,
                                          (args.prompt_len, args.prompt_len),
                                          (args.max_tokens, args.max_tokens), vocab_size,
                                          args.seed + c)
            for server in servers:
                send = make_sender("sse", Endpoint(server.base_url), False, client)
                warm = await send(BenchRequest(requests[0].prompt_token_ids, 2))
                if not warm.ok:
                    raise RuntimeError(f"{server.name}: warm-up request failed: {warm.error}")
                ours = isinstance(server, AioengineServer)
                if ours:
                    before = await engine_stats(client, Endpoint(server.base_url))
                    cpu_before = process_cpu_s(server.process.pid)
                res = await run_load(send, requests, max_concurrency=c,
                                     time_limit_s=args.time_limit, seed=args.seed,
                                     desc=f"{server.name} c={c}", progress=not args.no_progress)
                if ours:
                    cpu_s = process_cpu_s(server.process.pid) - cpu_before
                    stats = stats_delta(before, await engine_stats(
                        client, Endpoint(server.base_url), steps=True))
                    if stats["num_steps"]:
                        stats["server_cpu_ms_per_step"] = round(
                            1000 * cpu_s / stats["num_steps"], 3)
                    res["engine_stats"] = stats
                res["concurrency"] = c
                res["workload"] = workload_summary(requests)
                res["loadavg_1m"] = load.sample()[0]
                runs[server.name].append(res)
                streams = f"{c} stream" + ("s" if c > 1 else "")
                print(f"  {server.name:<16} {streams:>11}: {res['completed']:>3}/"
                      f"{res['num_requests']} ok, {res['output_throughput']:7.1f} output tok/s, "
                      f"TTFT p50 {res['ttft']['p50_ms']:7.0f} ms, ITL p50 "
                      f"{res['itl']['p50_ms']:6.1f} ms, load {res['loadavg_1m']:.2f}", flush=True)
                steps = res.get("engine_stats", {}).get("decode_steps")
                if steps:
                    print(f"  {'':<16} {'':>11}  {steps['num_steps']} decode steps of "
                          f"{steps['num_reqs']}: worker busy p50 {steps['busy_p50_ms']:.2f} ms, "
                          f"idle mean/p50 {steps['idle_mean_ms']:.2f}/{steps['idle_p50_ms']:.2f} "
                          f"ms ({steps['idle_pct_of_step']:.1f}% of the step); server CPU "
                          f"{res['engine_stats'].get('server_cpu_ms_per_step', 0):.2f} ms/step",
                          flush=True)
    return runs


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (its threads, not its children)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def started(server: TimedServer) -> dict:
    """What a started server reports: its command, log, start time and models."""
    import httpx

    out: dict = {"command": server.command(), "log": str(server.log_path),
                 "ready_s": round(server.ready_s, 3)}
    print(f"{server.name}: /health 200 after {server.ready_s:.2f} s", flush=True)
    try:
        out["models"] = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        pass
    return out


def measure_servers(ours: AioengineServer, theirs: LlamaServer | None,
                    args: argparse.Namespace, concurrencies: Sequence[int], vocab_size: int,
                    load: LoadTracker, restart_prompt: list[int]) -> tuple[dict, dict | None]:
    """Start each server alone (timed), run the interleaved sweep with both up
    (an idle server sleeps: our worker on its doorbell, llama-server's slots on
    a condition variable), then memory, then a killed worker's time to serve
    our server again. Returns ours and theirs (``None`` without llama-server)."""
    import uvloop

    with contextlib.ExitStack() as stack:
        stack.enter_context(ours)
        out_ours = started(ours)
        servers: list[TimedServer] = [ours]
        out_theirs = None
        if theirs is not None:
            stack.enter_context(theirs)
            out_theirs = started(theirs)
            out_theirs["env"] = theirs.env_overrides
            servers.append(theirs)
        load.sample()
        runs = uvloop.run(streaming_sweep(servers, concurrencies, args, vocab_size, load))
        out_ours["streams"] = runs[ours.name]
        out_ours["server_memory"] = memory_mib(ours.process.pid)
        if out_theirs is not None:
            out_theirs["streams"] = runs[theirs.name]
            out_theirs["server_memory"] = memory_mib(theirs.process.pid)
        workers = worker_pids(ours.process.pid)
        out_ours["worker_pids"] = workers
        if workers:
            out_ours["worker_memory"] = memory_mib(workers[0])
            if not args.skip_restart:
                out_ours["restart"] = time_to_serve_again(ours.base_url, workers[0],
                                                          restart_prompt, args.restart_timeout)
                print(f"{ours.name}: killed worker serving again after "
                      f"{out_ours['restart']['serving_again_s']} s", flush=True)
    return out_ours, out_theirs


# -- batch-1 decode --------------------------------------------------------------------------


def ours_batch1(args: argparse.Namespace, prompt: list[int]) -> dict:
    """Batch-1 decode through the offline ``LLM`` (bench/throughput.py's
    ``engine_decode_batch1``: tokens/s after the first token), after a
    warm-up request."""
    from aioengine import LLM
    from bench.throughput import add_requests, drive_steps, engine_decode_batch1

    kv = {"kv_cache_dtype": "float16"} if args.kv_cache == "matched" else {}
    llm = LLM(args.model, num_threads=args.threads, **kv)
    try:
        add_requests(llm, [BenchRequest(prompt, 4)], "warmup")
        drive_steps(llm)
        return engine_decode_batch1(llm, prompt, args.batch1_tokens)
    finally:
        llm.shutdown()


def llama_bench_decode(binary: Path, args: argparse.Namespace) -> dict:
    """``llama-bench -p 0 -n N -d D -t T -r R -o json`` at depth 0 and at depth
    ``--prompt-len``: mean decode tokens/s over ``R`` repetitions."""
    out: dict = {"binary": str(binary)}
    for depth in (0, args.prompt_len):
        cmd = [str(binary), "-m", args.model, "-p", "0", "-n", str(args.batch1_tokens),
               "-d", str(depth), "-t", str(args.threads), "-r", str(args.llama_bench_reps),
               "-o", "json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.time_limit,
                              env={**os.environ, **llama_env(args)})
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        (row,) = json.loads(proc.stdout)
        out[f"depth_{depth}"] = {"command": cmd, "decode_tokens_per_s": row["avg_ts"],
                                 "stddev_tokens_per_s": row["stddev_ts"],
                                 "build_commit": row.get("build_commit"),
                                 "cpu_info": row.get("cpu_info")}
    out["decode_tokens_per_s"] = out[f"depth_{args.prompt_len}"]["decode_tokens_per_s"]
    out["source"] = f"llama-bench, depth {args.prompt_len}"
    return out


def roofline(args: argparse.Namespace) -> dict:
    """The machine's ceilings on ``--threads`` threads, measured here (bench/flops.py's
    ``read_bandwidth``: a ``--bandwidth-gb`` GB fp32 sum, best of 5; ``gemm_ceilings``:
    fp32 and bf16 GEMMs at 1024^3 and 2048^3, the fastest of each dtype kept), the
    weights a batch-1 decode step reads (``WeightBytes.decode_bytes``: every tensor as
    stored) and the batch-1 decode tok/s that the read bandwidth allows for them
    (memory-bound: one full read per token)."""
    from bench.flops import WeightBytes, gemm_ceilings, read_bandwidth

    read = read_bandwidth(args.threads, int(args.bandwidth_gb * 1e9))
    gemm = gemm_ceilings(args.threads, args.ceiling_time)
    out = {"read_gbs": read["read_gbs"], "read_by_pass": read["by_pass"],
           "read_bytes": read["bytes"], "gemm_by_size": gemm["by_size"],
           "fp32_gemm_gflops": gemm["fp32_gemm_gflops"],
           "bf16_gemm_gflops": gemm["bf16_gemm_gflops"],
           "decode_weight_mb": WeightBytes.from_gguf(args.model).decode_bytes / 1e6}
    out["batch1_roofline_tokens_per_s"] = out["read_gbs"] * 1e3 / out["decode_weight_mb"]
    return out


def remeasure_ceilings(roof: dict, args: argparse.Namespace) -> None:
    """The read bandwidth and the GEMM ceilings again after the load (``roof
    ["read_end_by_pass"]``, ``roof["gemm_end_by_size"]``); each ceiling becomes the
    higher of the two: another job on the machine during the first measurement would
    otherwise understate it and inflate the shares."""
    from bench.flops import CEILING_DTYPES, gemm_ceilings, read_bandwidth

    read = read_bandwidth(args.threads, int(args.bandwidth_gb * 1e9))
    end = gemm_ceilings(args.threads, args.ceiling_time)
    roof["read_end_by_pass"] = read["by_pass"]
    roof["read_gbs"] = max(roof["read_gbs"], read["read_gbs"])
    roof["batch1_roofline_tokens_per_s"] = roof["read_gbs"] * 1e3 / roof["decode_weight_mb"]
    roof["gemm_end_by_size"] = end["by_size"]
    for name, _ in CEILING_DTYPES:
        key = f"{name}_gemm_gflops"
        roof[key] = max(roof.get(key, 0.0), end[key])
    print(f"ceilings again after the load: read {read['by_pass']} GB/s, GEMMs {end['by_size']}; "
          f"kept read {roof['read_gbs']:.1f} GB/s, fp32 {roof['fp32_gemm_gflops']:.1f}, bf16 "
          f"{roof['bf16_gemm_gflops']:.1f} GFLOP/s", flush=True)


# -- compute share (issue 16) ---------------------------------------------------------------


def gemm_path() -> str:
    """The GEMM our quantized layers run at 9+ rows of x on this machine: ``"amx-bf16"``
    (bf16 tiles, the default where the CPU has AMX-BF16), ``"amx-bf16x3"``
    (``AIOENGINE_BF16_GEMM=0``: bf16 hi + lo, three tile products) or ``"fp32"``
    (AVX-512/AVX2 FMA; also every GEMV of 1-8 rows). Loads (builds) the C++ kernels."""
    from triton_kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None or ops.quant_isa() != 3 or not cpu_ops.amx_requested():
        return "fp32"
    return "amx-bf16" if cpu_ops.bf16_gemm_requested() else "amx-bf16x3"


def dtype_in_use(path: str, concurrency: int) -> str:
    """The dtype whose GEMM ceiling applies to our decode steps of ``concurrency``
    rows: bf16 where they run the AMX GEMM (9+ rows), fp32 otherwise."""
    return "bf16" if path.startswith("amx") and concurrency > 8 else "fp32"


def add_compute(report: dict, model: str) -> None:
    """Each streaming run's matmul FLOPs (bench/flops.py's ``run_flops``, from the
    model's config and the requests served), its GFLOP/s and their share of the
    roofline's fp32 and bf16 GEMM ceilings, as ``run["compute"]``; the model's
    shapes as ``report["model_flops"]``."""
    from dataclasses import asdict

    from bench.flops import ModelFlops, run_flops, shares

    shape = ModelFlops.from_model(model)
    report["model_flops"] = {**asdict(shape), "params_per_layer": shape.params_per_layer,
                             "lm_head_params": shape.lm_head_params}
    ceilings = report.get("roofline", {})
    for key in ("aioengine", "llama_cpp"):
        for run in (report.get(key) or {}).get("server", {}).get("streams", []):
            run["compute"] = run_flops(shape, run)
            run["compute"]["share"] = shares(run["compute"]["gflops"], ceilings)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag V`` or ``flag=V`` in a command line, or None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def kv_cache_dtype(model: str, server_args: Sequence[str]) -> str:
    """The KV cache dtype ``aioengine serve server_args`` runs on this CPU: its
    ``--kv-cache-dtype``, or with ``auto`` the activations' (``--dtype``, resolved as
    the worker resolves it: ``model_runner.choose_dtype``/``choose_kv_cache_dtype``)."""
    from aioengine.worker.model_runner import choose_dtype, choose_kv_cache_dtype, cpu_flags

    dtype, _ = choose_dtype(flag_value(server_args, "--dtype") or "auto", "cpu", cpu_flags(),
                            model.endswith(".gguf"))
    kv = choose_kv_cache_dtype(flag_value(server_args, "--kv-cache-dtype") or "auto", dtype,
                               "cpu")
    return str(kv).removeprefix("torch.")


def add_roofline(report: dict, model: str) -> None:
    """Each streaming run's roofline ceiling (bench/flops.py's ``workload_roofline`` on
    the requests served, at the run's concurrency; the GEMM ceiling of the dtype a step
    of that many rows runs, ``dtype_in_use``; the measured read bandwidth; the server's
    KV cache dtype) and the run's share of it, as ``run["roofline"]``; the weights'
    bytes as ``report["weight_bytes"]``. Needs the measured ceilings."""
    from dataclasses import asdict

    from bench.flops import KV_DTYPE_BYTES, ModelFlops, WeightBytes, workload_roofline

    roof = report.get("roofline")
    if not roof:
        return
    shape, weights = ModelFlops.from_model(model), WeightBytes.from_gguf(model)
    report["weight_bytes"] = {**asdict(weights), "layers": weights.layers}
    path, kv = report.get("gemm_path", "fp32"), report["kv_cache"]["dtype"]

    def peak(rows: int) -> float:
        return roof[f"{dtype_in_use(path, rows)}_gemm_gflops"]

    for key in ("aioengine", "llama_cpp"):
        for run in (report.get(key) or {}).get("server", {}).get("streams", []):
            r = workload_roofline(shape, weights, KV_DTYPE_BYTES[kv], run["requests"],
                                  run["concurrency"], peak, roof["read_gbs"])
            r["share"] = run["output_throughput"] / r["tokens_per_s"] if r["tokens_per_s"] else 0
            run["roofline"] = r


def compute_table(report: dict) -> str:
    """Markdown: per concurrency, output tok/s both sides, MFLOP per output token,
    GFLOP/s and the shares of the fp32 / bf16 GEMM ceilings, both sides."""
    roof, path = report.get("roofline", {}), report.get("gemm_path", "fp32")
    by_c = {r["concurrency"]: r for r in (report.get("llama_cpp") or {}).get("server", {})
            .get("streams", [])}

    def pct(run: dict | None) -> str:
        sh = (run or {}).get("compute", {}).get("share", {})
        return " / ".join(f"{100 * sh[d]:.1f}%" for d in ("fp32", "bf16") if d in sh) or "n/a"

    def roof_cell(run: dict) -> str:
        rl = run.get("roofline")
        if not rl:
            return "n/a"
        step = rl["decode_step"]
        at = (f", {step['rows']}-row step {step['ms']:.2f} ms ({step['bound']}: "
              f"{step['bytes']['total'] / 1e6:.0f} MB, {step['flops']['total'] / 1e9:.2f} GFLOP)"
              if step else "")
        return f"{rl['tokens_per_s']:.0f}: {rl['bound']}{at}"

    def roof_pct(run: dict | None) -> str:
        rl = (run or {}).get("roofline")
        return f"{100 * rl['share']:.1f}%" if rl else "n/a"

    fp32, bf16 = roof.get("fp32_gemm_gflops"), roof.get("bf16_gemm_gflops")
    ceil = (f"fp32 {fp32:.0f} / bf16 {bf16:.0f} GFLOP/s" if fp32 and bf16 else "not measured")
    read = roof.get("read_gbs")
    rows = [f"| streams | output tok/s, ours / llama.cpp | MFLOP per output token | GFLOP/s, "
            f"ours / llama.cpp | ours: % of fp32 / bf16 GEMM ({ceil}) | llama.cpp: % of fp32 / "
            f"bf16 | ceiling that applies to ours ({path}) | roofline tok/s ("
            f"{f'{read:.1f} GB/s' if read else 'not measured'}; KV "
            f"{report.get('kv_cache', {}).get('dtype', '?')}): bound, full decode step | "
            f"ours / llama.cpp: % of roofline | target (issue 16) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("aioengine", {}).get("server", {}).get("streams", []):
        c, t, comp = r["concurrency"], by_c.get(r["concurrency"]), r.get("compute", {})
        theirs = t["output_throughput"] if t else float("nan")
        ratio = f" ({r['output_throughput'] / theirs:.2f}x)" if t and theirs else ""
        t_gf = t["compute"]["gflops"] if t and "compute" in t else float("nan")
        d = dtype_in_use(path, c)
        applies = comp.get("share", {}).get(d)
        rows.append(f"| {c} | {r['output_throughput']:.1f} / {fmt(theirs)}{ratio} | "
                    f"{comp.get('mflop_per_output_token', float('nan')):.1f} | "
                    f"{comp.get('gflops', float('nan')):.1f} / {fmt(t_gf)} | {pct(r)} | "
                    f"{pct(t)} | {d}: {f'{100 * applies:.1f}%' if applies else 'n/a'} | "
                    f"{roof_cell(r)} | {roof_pct(r)} / {roof_pct(t)} | "
                    f"{'>= 2x llama.cpp, >= 50% of the ceiling that applies' if c == 32 else ''} |")
    return "\n".join(rows)


def plot_curve(report: dict, path: Path) -> None:
    """Output tok/s against concurrency (log2 axis), ours and llama-server on one
    chart, each point of ours labelled ours / llama.cpp, and ours' roofline ceiling
    dashed (labelled with our share of it); below, the workload's GFLOP/s against
    the fp32 and bf16 GEMM ceilings of the same run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 9), height_ratios=(3, 2), sharex=True)
    sides = [(name, side["server"]["streams"]) for name, side in
             (("aioengine serve", report.get("aioengine")),
              ("llama-server", report.get("llama_cpp"))) if side]
    for name, runs in sides:
        cs = [r["concurrency"] for r in runs]
        ax1.plot(cs, [r["output_throughput"] for r in runs], marker="o", label=name)
        if all("compute" in r for r in runs):
            ax2.plot(cs, [r["compute"]["gflops"] for r in runs], marker="o", label=name)
    ours_runs = sides[0][1] if sides and sides[0][0] == "aioengine serve" else []
    roof_runs = [r for r in ours_runs if "roofline" in r]
    if roof_runs:
        ax1.plot([r["concurrency"] for r in roof_runs],
                 [r["roofline"]["tokens_per_s"] for r in roof_runs], ls="--", color="black",
                 lw=1.2, label=f"roofline ({report['roofline']['read_gbs']:.0f} GB/s, "
                               f"GEMM of the dtype in use)")
        for r in roof_runs:
            ax1.annotate(f"{100 * r['roofline']['share']:.0f}%",
                         (r["concurrency"], r["roofline"]["tokens_per_s"]),
                         textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    for r in sides[0][1] if sides else []:
        ratio = report["ratios"].get(f"streams_{r['concurrency']}")
        if ratio:
            ax1.annotate(f"{ratio['output_throughput']:.2f}x",
                         (r["concurrency"], r["output_throughput"]),
                         textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    roof = report.get("roofline", {})
    for key, style in (("fp32", ":"), ("bf16", "--")):
        ceiling = roof.get(f"{key}_gemm_gflops")
        for level, color in ((1.0, "dimgray"), (0.5, "darkgray")) if ceiling else ():
            ax2.axhline(level * ceiling, color=color, ls=style, lw=1.0)
            name = f"{key} GEMM ceiling" if level == 1.0 else f"50% of {key}"
            ax2.annotate(f"{name} {level * ceiling:.0f}", (0.005, level * ceiling),
                         xycoords=("axes fraction", "data"), fontsize=7, color=color,
                         va="bottom")
    ticks = [r["concurrency"] for r in sides[0][1]] if sides else []
    ax1.set_xscale("log", base=2)
    if ticks:
        ax1.set_xticks(ticks, [str(c) for c in ticks])
    ax1.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax1.set_ylim(0, 1.12 * max([r["output_throughput"] for _, runs in sides for r in runs]
                               + [r["roofline"]["tokens_per_s"] for r in roof_runs],
                               default=1.0))
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("output throughput (labels: ours / llama.cpp; on the roofline: ours as % "
                  "of it)", fontsize=9)
    ax2.set_yscale("log")
    ax2.set_ylabel("GFLOP/s (matmuls of the workload)")
    ax2.set_xlabel("concurrent streams")
    ax2.set_title(f"compute against GEMM ceilings on the same threads (our GEMM at 9+ rows: "
                  f"{report.get('gemm_path', '?')})", fontsize=9)
    for ax, where in ((ax1, "upper left"), (ax2, "lower right")):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc=where)
    save_figure(fig, report, path)


def save_figure(fig, report: dict, path: Path) -> None:
    """Title ``fig`` with the run's workload, CPU (model and SIMD flags), time and
    load, and write it to ``path`` as PNG."""
    import matplotlib.pyplot as plt

    a, cpu, load = report["args"], report["cpu"], report["load"]
    machine = textwrap.fill(f"{cpu['model']}: {' '.join(cpu['simd_flags'])}", 120)
    slots = f"; llama-server -np {report['n_slots']}" if "n_slots" in report else ""
    fig.suptitle(f"{Path(a['model']).name}, {a['threads']} threads both, prompts "
                 f"{a['prompt_len']} tokens, {a['max_tokens']} output tokens, "
                 f"{a['requests_per_stream']} request(s) per stream{slots}\n{machine}\n"
                 f"{report.get('time', '')}, load avg {load['loadavg_1m_min']:.1f}-"
                 f"{load['loadavg_1m_max']:.1f}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- ratios, table, plot --------------------------------------------------------------------


def ratios(report: dict) -> dict:
    """Ours / llama.cpp output tok/s and llama.cpp / ours TTFT p50, per
    concurrency (above 1: ours is better), and the batch-1 decode ratio."""
    ours, theirs = report.get("aioengine"), report.get("llama_cpp")
    out: dict = {}
    if not (ours and theirs):
        return out
    by_c = {r["concurrency"]: r for r in theirs["server"]["streams"]}
    for r in ours["server"]["streams"]:
        t = by_c.get(r["concurrency"])
        if t and t["output_throughput"] and r["ttft"]["p50_ms"]:
            out[f"streams_{r['concurrency']}"] = {
                "output_throughput": r["output_throughput"] / t["output_throughput"],
                "ttft_p50": t["ttft"]["p50_ms"] / r["ttft"]["p50_ms"]}
    b1_ours = ours.get("batch1", {}).get("decode_tokens_per_s")
    b1_theirs = theirs.get("batch1", {}).get("decode_tokens_per_s")
    if b1_ours and b1_theirs:
        out["batch1_decode"] = b1_ours / b1_theirs
    if ours["server"].get("ready_s") and theirs["server"].get("ready_s"):
        out["ready_s"] = ours["server"]["ready_s"] / theirs["server"]["ready_s"]
    return out


def table(report: dict) -> str:
    """The issue's table in Markdown: one row per figure, ours | llama.cpp | ratio."""
    ours, theirs, rat = report.get("aioengine", {}), report.get("llama_cpp"), report["ratios"]
    llama_head = f"llama.cpp `llama-server -t {report['args']['threads']} -np {report['n_slots']}`"
    rows = [f"| | aioengine serve | {llama_head if theirs else 'llama.cpp (not run)'} "
            f"| ours / llama.cpp |", "|---|---|---|---|"]

    def cell(side: dict | None, fn) -> str:
        try:
            return fn(side) if side else "n/a"
        except (KeyError, TypeError, IndexError):
            return "n/a"

    def ready(s: dict) -> str:
        return f"{s['server']['ready_s']:.2f} s"

    rows.append(f"| command to /health 200 | {cell(ours, ready)} | {cell(theirs, ready)} | |")

    def stream(side: dict | None, c: int) -> str:
        def f(s: dict) -> str:
            (r,) = [x for x in s["server"]["streams"] if x["concurrency"] == c]
            return (f"{r['output_throughput']:.1f} (TTFT {r['ttft']['p50_ms']:.0f} ms, "
                    f"ITL {r['itl']['p50_ms']:.1f} ms)")
        return cell(side, f)

    for r in ours.get("server", {}).get("streams", []):
        c = r["concurrency"]
        ratio = rat.get(f"streams_{c}")
        ratio_s = (f"{ratio['output_throughput']:.2f}x tok/s, TTFT {ratio['ttft_p50']:.2f}x"
                   if ratio else "")
        name = "1 stream" if c == 1 else f"{c} streams"
        rows.append(f"| {name}: output tok/s (TTFT p50, ITL p50) | {stream(ours, c)} | "
                    f"{stream(theirs, c)} | {ratio_s} |")
    b1 = rat.get("batch1_decode")
    def batch1(s: dict) -> str:
        b = s["batch1"]
        return f"{b['decode_tokens_per_s']:.1f} ({b.get('source', 'LLM')})"

    rows.append(f"| batch-1 decode tok/s | {cell(ours, batch1)} | {cell(theirs, batch1)} | "
                f"{f'{b1:.2f}x' if b1 else ''} |")
    roof = report.get("roofline")
    if roof:
        bound = roof["batch1_roofline_tokens_per_s"]

        def share(s: dict) -> str:
            return f"{100 * s['batch1']['decode_tokens_per_s'] / bound:.0f}%"

        rows.append(f"| batch-1 decode, share of the memory roofline ({bound:.0f} tok/s: "
                    f"{roof['read_gbs']:.1f} GB/s / {roof['decode_weight_mb']:.1f} MB) | "
                    f"{cell(ours, share)} | {cell(theirs, share)} | |")
    rows.append(f"| RSS, MiB | worker "
                f"{cell(ours, lambda s: fmt(s['server']['worker_memory']['rss_mib'], 0))}, server "
                f"{cell(ours, lambda s: fmt(s['server']['server_memory']['rss_mib'], 0))} | "
                f"{cell(theirs, lambda s: fmt(s['server']['server_memory']['rss_mib'], 0))} | |")
    restart = cell(ours, lambda s: fmt(s["server"]["restart"]["serving_again_s"], 2) + " s")
    rows.append(f"| killed worker serving again | {restart} | | |")
    return "\n".join(rows)


def plot(report: dict, path: Path) -> None:
    """Output tok/s (left) and TTFT p50 (right) against concurrency, both
    servers; the left panel is annotated with ours / llama.cpp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, side in (("aioengine serve", report.get("aioengine")),
                       ("llama-server", report.get("llama_cpp"))):
        if not side:
            continue
        runs = side["server"]["streams"]
        cs = [r["concurrency"] for r in runs]
        ax1.plot(cs, [r["output_throughput"] for r in runs], marker="o", label=name)
        ax2.plot(cs, [r["ttft"]["p50_ms"] for r in runs], marker="o", label=name)
    for r in report.get("aioengine", {}).get("server", {}).get("streams", []):
        ratio = report["ratios"].get(f"streams_{r['concurrency']}")
        if ratio:
            ax1.annotate(f"{ratio['output_throughput']:.2f}x",
                         (r["concurrency"], r["output_throughput"]),
                         textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ticks = [r["concurrency"] for r in report.get("aioengine", {}).get("server", {})
             .get("streams", [])]
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("concurrent streams")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput (labels: ours / llama.cpp)")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_title("TTFT p50")
    save_figure(fig, report, path)


def roofline_summary(run: dict) -> str:
    """One run against its roofline, in words: the ceiling, our share, the bound that
    dominates, the full decode step's bound, and what the run would need for 50%."""
    rl, c, tok_s = run["roofline"], run["concurrency"], run["output_throughput"]
    out = (f"{c} stream{'s' if c > 1 else ''} against the roofline: {tok_s:.1f} of "
           f"{rl['tokens_per_s']:.0f} tok/s = "
           f"{100 * rl['share']:.1f}% (target >= 50%); {rl['bound']}-bound: "
           f"{rl['memory_bound_s']:.2f} s of memory-bound steps, {rl['compute_bound_s']:.2f} s "
           f"of compute-bound ones (prefill {rl['prefill_s']:.2f} s) at "
           f"{rl['read_gbs']:.1f} GB/s, KV {rl['kv_elem_bytes']} bytes/element")
    step = rl["decode_step"]
    if step:
        b, f = step["bytes"], step["flops"]
        out += (f"; the {step['rows']}-row decode step: {step['ms']:.2f} ms ({step['bound']}: "
                f"{b['total'] / 1e6:.1f} MB = weights {b['weights'] / 1e6:.1f} + KV read "
                f"{b['kv_read'] / 1e6:.1f} + written {b['kv_write'] / 1e6:.2f} -> "
                f"{step['memory_ms']:.2f} ms; {f['total'] / 1e9:.2f} GFLOP at "
                f"{step['peak_gflops']:.0f} GFLOP/s -> {step['compute_ms']:.2f} ms)")
        itl = run.get("itl", {}).get("p50_ms")
        if itl:
            out += (f"; measured ITL p50 {itl:.1f} ms = {itl / step['ms']:.1f}x that step "
                    f"(50% needs <= {2 * step['ms']:.1f} ms)")
    # 50%: the run's time at most twice the roofline's, i.e. c tokens every
    # 2 x (roofline seconds per c output tokens).
    need = 2 * c / rl["tokens_per_s"] * 1e3
    out += (f"; 50% needs {0.5 * rl['tokens_per_s']:.0f} tok/s: one token for each of the "
            f"{c} streams every {need:.1f} ms on average (now {c / tok_s * 1e3:.1f} ms)")
    return out


def print_targets(report: dict) -> None:
    rat, ours = report["ratios"], report.get("aioengine", {}).get("server", {})
    lines = []
    if "batch1_decode" in rat:
        lines.append(f"batch-1 decode ours/llama.cpp {rat['batch1_decode']:.2f}x (target >= 1.2x)")
    for c in (8, 32):
        r = rat.get(f"streams_{c}")
        if r:
            lines.append(f"{c} streams: output tok/s {r['output_throughput']:.2f}x (target >= "
                         f"1.5x), TTFT p50 llama.cpp/ours {r['ttft_p50']:.2f}x (target >= 1)")
    if "ready_s" in ours:
        lines.append(f"aioengine serve ready in {ours['ready_s']:.2f} s (target <= 3 s)")
    if "restart" in ours:
        lines.append(f"killed worker serving again in {ours['restart']['serving_again_s']} s "
                     f"(target <= 3 s)")
    if "worker_memory" in ours:
        kv = report.get("kv_cache", {})
        lines.append(f"worker RSS {ours['worker_memory']['rss_mib']:.0f} MiB (target: 1/3 of the "
                     f"fp32 worker's; KV cache {kv.get('mode', '?')}: {kv.get('server_args')})")
    if "roofline" in report:
        roof = report["roofline"]
        lines.append(f"batch-1 memory roofline {roof['batch1_roofline_tokens_per_s']:.0f} tok/s "
                     f"(read {roof['read_gbs']:.1f} GB/s over {roof['decode_weight_mb']:.1f} MB "
                     f"of weights per token); fp32 GEMM ceiling "
                     f"{roof['fp32_gemm_gflops']:.0f} GFLOP/s")
    r32 = [r for r in ours.get("streams", []) if r["concurrency"] == 32 and "compute" in r]
    if r32:
        comp, ratio = r32[0]["compute"], rat.get("streams_32", {}).get("output_throughput")
        d = dtype_in_use(report.get("gemm_path", "fp32"), 32)
        share = "; ".join(f"{100 * v:.1f}% of the {k} GEMM ceiling"
                          for k, v in comp["share"].items()) or "no ceiling measured"
        lines.append(f"32 streams (issue 16): {f'{ratio:.2f}x' if ratio else 'n/a'} "
                     f"llama-server's output tok/s (target >= 2x); {comp['gflops']:.1f} GFLOP/s "
                     f"= {share} (target >= 50% of the dtype in use: {d}, our GEMM "
                     f"{report.get('gemm_path')})")
        rl = r32[0].get("roofline")
        if rl:
            lines.append(roofline_summary(r32[0]))
    print("\n".join(lines))


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: $LLAMA_SERVER, then PATH; 'none': skip)")
    p.add_argument("--llama-bench", default=None,
                   help="llama-bench binary (default: $LLAMA_BENCH, llama-server's folder, PATH; "
                        "'none': time batch 1 with llama-server's single stream)")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64",
                   help="comma-separated stream counts")
    p.add_argument("--prompt-len", type=int, default=100, help="prompt tokens (random ids)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=2,
                   help="requests each client sends back to back")
    p.add_argument("--batch1-tokens", type=int, default=None,
                   help="tokens of the batch-1 decode runs (default: --max-tokens)")
    p.add_argument("--llama-bench-reps", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=240.0,
                   help="seconds per load level; then nothing new starts and the rest is "
                        "cancelled")
    p.add_argument("--skip-restart", action="store_true",
                   help="do not kill our worker to time its restart")
    p.add_argument("--restart-timeout", type=float, default=120.0)
    p.add_argument("--skip-batch1", action="store_true")
    p.add_argument("--kv-cache", choices=("matched", "default"), default="matched",
                   help="matched (default): our KV cache as llama-server's, float16 and the same "
                        "token capacity (-c); default: ours at its own defaults (float32 under "
                        "fp32 activations, 1 GiB)")
    p.add_argument("--skip-roofline", action="store_true",
                   help="do not measure the machine's memory and GEMM ceilings")
    p.add_argument("--ceiling-time", type=float, default=1.0,
                   help="seconds each GEMM ceiling measurement runs (best of 3 thirds)")
    p.add_argument("--bandwidth-gb", type=float, default=4.0,
                   help="GB of the buffer whose sum measures the read bandwidth (best of 5)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra 'aioengine serve' flag (repeatable)")
    p.add_argument("--llama-arg", action="append", default=[],
                   help="extra llama-server flag (repeatable)")
    p.add_argument("--llama-gomp-spincount", default="ours",
                   help="llama-server's GOMP_SPINCOUNT: 'ours' (our worker's), 'unset', or N")
    p.add_argument("--quick", action="store_true",
                   help="32 output tokens, one request per stream, 1 llama-bench repetition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot-dir", default=str(RESULTS_DIR))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.requests_per_stream, args.llama_bench_reps = 32, 1, 1
    args.batch1_tokens = args.batch1_tokens or args.max_tokens
    if args.model is None:
        from aioengine.config import default_model_path

        args.model = default_model_path()
    args.model = str(Path(args.model).resolve())
    return args


def main(argv: list[str] | None = None) -> dict:
    from aioengine.models.loader import load_tokenizer

    args = parse_args(argv)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cpus']} CPUs; flags: {' '.join(cpu['simd_flags'])}")
    print(f"model: {args.model}; {args.threads} threads on both sides", flush=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    n_slots = max(concurrencies)
    llama_server = find_binary(args.llama_server, "LLAMA_SERVER", "llama-server")
    llama_bench = None
    if llama_server is None:
        print("llama-server not found (--llama-server, $LLAMA_SERVER, PATH): measuring "
              "aioengine only")
    else:
        llama_bench = find_binary(args.llama_bench, "LLAMA_BENCH", "llama-bench",
                                  beside=llama_server.parent)
        print(f"llama-server: {llama_server} ({binary_version(llama_server)}); llama-bench: "
              f"{llama_bench or 'not found, batch 1 from the 1-stream run'}", flush=True)

    load = LoadTracker()
    load.sample()
    vocab_size = len(load_tokenizer(args.model))
    batch1_prompt = synthetic_workload(1, (args.prompt_len, args.prompt_len), (1, 1),
                                       vocab_size, args.seed + 1000)[0].prompt_token_ids
    report: dict = {"benchmark": "quantized", "cpu": cpu, "targets": TARGETS, "n_slots": n_slots,
                    "args": vars(args), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    logs = Path(tempfile.mkdtemp(prefix="aioengine-bench-quantized-"))

    report["gemm_path"] = gemm_path()
    print(f"our quantized GEMM at 9+ rows: {report['gemm_path']}", flush=True)
    if not args.skip_roofline:
        report["roofline"] = roofline(args)
        r = report["roofline"]
        print(f"ceilings on {args.threads} threads: memory read {r['read_gbs']:.1f} GB/s, fp32 "
              f"GEMM {r['fp32_gemm_gflops']:.1f} GFLOP/s, bf16 GEMM "
              f"{r['bf16_gemm_gflops']:.1f} GFLOP/s ({r['gemm_by_size']}); "
              f"{r['decode_weight_mb']:.1f} MB of weights per decode step -> batch-1 roofline "
              f"{r['batch1_roofline_tokens_per_s']:.0f} tok/s", flush=True)
        load.sample()

    ours: dict = {}
    if not args.skip_batch1:
        print("aioengine: batch-1 decode through LLM", flush=True)
        ours["batch1"] = ours_batch1(args, batch1_prompt)
        print(f"  {ours['batch1']['decode_tokens_per_s']:.1f} tok/s", flush=True)
        load.sample()
    ctx = n_slots * (args.prompt_len + args.max_tokens + 32)
    kv_args: list[str] = []
    if args.kv_cache == "matched":
        # llama-server's cache: float16 (its default -ctk/-ctv f16), ``ctx`` tokens.
        kv_args = ["--kv-cache-dtype", "float16",
                   "--num-gpu-blocks-override", str(-(-ctx // BLOCK_SIZE))]
    report["kv_cache"] = {"mode": args.kv_cache, "tokens": ctx, "server_args": kv_args}
    server_args = ["--model", args.model, "--num-threads", str(args.threads),
                   "--max-num-seqs", str(max(64, n_slots)), "--log-level", "warning",
                   *kv_args, *args.server_arg]
    report["kv_cache"]["dtype"] = kv_cache_dtype(args.model, server_args)
    ours_server = AioengineServer(server_args, logs / "aioengine.log")
    llama = None
    if llama_server is not None:
        llama_args = ["-m", args.model, "-t", str(args.threads), "-tb", str(args.threads),
                      "-np", str(n_slots), "-c", str(ctx), "--no-webui", *args.llama_arg]
        llama = LlamaServer(llama_server, llama_args, logs / "llama-server.log",
                            env_overrides=llama_env(args))
    ours["server"], theirs_server = measure_servers(ours_server, llama, args, concurrencies,
                                                    vocab_size, load, batch1_prompt)
    report["aioengine"] = ours

    if llama_server is not None:
        theirs: dict = {"version": binary_version(llama_server), "server": theirs_server}
        if args.skip_batch1:
            pass
        elif llama_bench is not None:
            print("llama.cpp: batch-1 decode through llama-bench", flush=True)
            theirs["batch1"] = llama_bench_decode(llama_bench, args)
            print(f"  {theirs['batch1']['decode_tokens_per_s']:.1f} tok/s", flush=True)
        else:
            one = [r for r in theirs_server["streams"] if r["concurrency"] == 1]
            if one and one[0]["tpot"]["count"]:
                theirs["batch1"] = {"decode_tokens_per_s": 1000.0 / one[0]["tpot"]["p50_ms"],
                                    "source": "llama-server 1 stream, 1/TPOT p50"}
        report["llama_cpp"] = theirs
    if "roofline" in report:
        remeasure_ceilings(report["roofline"], args)
    load.sample()
    report["load"] = load.summary()
    report["ratios"] = ratios(report)
    add_compute(report, args.model)
    add_roofline(report, args.model)
    report["table_markdown"] = table(report)
    report["compute_table_markdown"] = compute_table(report)
    path = write_results(args.output_json, "quantized.json", report)
    plot_path = Path(args.plot_dir) / "quantized_vs_llama_cpp.png"
    curve_path = Path(args.plot_dir) / "quantized_concurrency.png"
    plot(report, plot_path)
    plot_curve(report, curve_path)
    print(f"\n{cpu['model']} ({' '.join(cpu['simd_flags'])}), {args.threads} threads, load "
          f"{report['load']['loadavg_1m_min']:.2f}-{report['load']['loadavg_1m_max']:.2f}, "
          f"{report['time']}\n")
    print(report["table_markdown"] + "\n")
    print(report["compute_table_markdown"] + "\n")
    print_targets(report)
    print(f"wrote {path}, {plot_path} and {curve_path}")
    return report


if __name__ == "__main__":
    main()
