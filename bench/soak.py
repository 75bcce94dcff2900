"""Soak (issue 22): a bounded run of 16 clients in a loop, with random
disconnects and bad requests, against one ``aioengine serve``.

Every ``--sample-s`` seconds it samples the resident memory (RSS) of the server
and of its model worker and both processes' open file descriptors; it keeps
the end-to-end latency of every completed request. At the end it prints, and
writes to ``bench/results/soak.json``: p50/p99 latency per minute, RSS and fds
over time, and the growth after warm-up (the median of the last minute against
the median of the minute after ``--warmup-s``), and plots them to
``bench/results/soak.png``.

    python bench/soak.py --duration-s 420 --warmup-s 60

The mix, per client iteration: 60% a streaming chat over SSE (8-32 tokens),
15% the same over the WebSocket, 10% an SSE stream the client drops after a
few tokens, 15% a bad request (malformed JSON, an out-of-range field, an
unknown model: 400/404, never a 500).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, BenchServer, write_results  # noqa: E402

API_KEY = "soak-key"
TOPICS = ["rivers", "bread", "owls", "trains", "glaciers", "violins", "tides", "moss"]


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) / 1024


def num_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def serving_worker(server_pid: int) -> int | None:
    """The serving worker (``aioengine-wrk0``) among the server's children."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for kid in (task / "children").read_text().split():
            try:
                if Path(f"/proc/{kid}/comm").read_text().strip() == "aioengine-wrk0":
                    return int(kid)
            except OSError:
                pass
    return None


class Sampler(threading.Thread):
    """RSS (MiB) and fds of the server and its worker every ``interval`` s."""

    def __init__(self, server_pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.server_pid = server_pid
        self.interval = interval
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            worker = serving_worker(self.server_pid)
            try:
                self.samples.append({
                    "t": time.monotonic() - self.t0, "worker_pid": worker,
                    "server_rss_mib": rss_mib(self.server_pid),
                    "server_fds": num_fds(self.server_pid),
                    "worker_rss_mib": rss_mib(worker) if worker else None,
                    "worker_fds": num_fds(worker) if worker else None})
            except OSError:
                pass
            self.stop.wait(self.interval)


async def one_iteration(rng: random.Random, http: httpx.AsyncClient, ws_url: str,
                        i: int, latencies: list[tuple[float, float]],
                        counts: dict[str, int], t0: float) -> None:
    roll = rng.random()
    body = {"messages": [{"role": "user", "content": f"Client {i}: a fact about "
                          f"{rng.choice(TOPICS)}."}], "max_tokens": rng.randint(8, 32),
            "temperature": 0.7, "seed": rng.randrange(1 << 30), "ignore_eos": True}
    start = time.monotonic()
    if roll < 0.15:  # bad requests
        kind = rng.randrange(3)
        if kind == 0:
            r = await http.post("/v1/chat/completions", content=b'{"messages": [',
                                headers={"Content-Type": "application/json"})
        elif kind == 1:
            r = await http.post("/v1/chat/completions", json={**body, "temperature": -3})
        else:
            r = await http.post("/v1/chat/completions", json={**body, "model": "nope"})
        counts[f"bad_{r.status_code}"] = counts.get(f"bad_{r.status_code}", 0) + 1
        if r.status_code >= 500:
            raise AssertionError(f"a bad request got {r.status_code}: {r.text}")
        return
    if roll < 0.30:  # the WebSocket
        async with websockets.connect(ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "chat", "id": "s", **body}))
            while True:
                msg = json.loads(await ws.recv())
                if msg["type"] in ("done", "error"):
                    break
        counts[f"ws_{msg['type']}"] = counts.get(f"ws_{msg['type']}", 0) + 1
        if msg["type"] == "done":
            latencies.append((start - t0, time.monotonic() - start))
        return
    drop_after = rng.randint(1, 6) if roll < 0.40 else None
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                tokens += 1
                if drop_after is not None and tokens >= drop_after:
                    counts["dropped"] = counts.get("dropped", 0) + 1
                    return
            elif line == "data: [DONE]":
                break
    counts[f"sse_{r.status_code}"] = counts.get(f"sse_{r.status_code}", 0) + 1
    if r.status_code == 200:
        latencies.append((start - t0, time.monotonic() - start))


async def client(i: int, base_url: str, ws_url: str, deadline: float,
                 latencies: list, counts: dict, errors: list, t0: float) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(one_iteration(rng, http, ws_url, i, latencies, counts,
                                                     t0), 120)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(repr(exc))


def per_minute(latencies: list[tuple[float, float]]) -> list[dict]:
    minutes: dict[int, list[float]] = {}
    for t, latency in latencies:
        minutes.setdefault(int(t // 60), []).append(latency)
    out = []
    for m in sorted(minutes):
        values = sorted(minutes[m])
        out.append({"minute": m + 1, "n": len(values), "p50_s": statistics.median(values),
                    "p99_s": values[min(len(values) - 1, int(0.99 * len(values)))]})
    return out


def growth(samples: list[dict], key: str, warmup_s: float, end_s: float) -> dict:
    """Median of the minute after warm-up against the median of the last minute."""
    base = [s[key] for s in samples if warmup_s <= s["t"] < warmup_s + 60 and s[key]]
    last = [s[key] for s in samples if s["t"] >= end_s - 60 and s[key]]
    b, e = statistics.median(base), statistics.median(last)
    return {"after_warmup": b, "end": e, "growth_pct": 100 * (e - b) / b}


def plot(samples: list[dict], minutes: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(t, [s["server_rss_mib"] for s in samples], label="server")
    axes[0].plot(t, [s["worker_rss_mib"] for s in samples], label="worker")
    axes[0].set_ylabel("RSS (MiB)")
    axes[0].legend()
    axes[1].plot(t, [s["server_fds"] for s in samples], label="server")
    axes[1].plot(t, [s["worker_fds"] for s in samples], label="worker")
    axes[1].set_ylabel("open fds")
    axes[1].legend()
    axes[2].plot([m["minute"] - 0.5 for m in minutes], [m["p99_s"] for m in minutes], "o-",
                 label="p99")
    axes[2].plot([m["minute"] - 0.5 for m in minutes], [m["p50_s"] for m in minutes], "o-",
                 label="p50")
    axes[2].set_ylabel("request latency (s)")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.suptitle("aioengine soak: 16 clients, disconnects and bad requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=420.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--sample-s", type=float, default=5.0)
    # A small KV cache (about 145 blocks): the worker's KV tensor is mapped lazily
    # (calloc), so its RSS grows as blocks are first written; with 0.5 GiB that
    # first touch took four minutes and read as growth. 0.1 GiB is all touched
    # within the warm-up, and what grows after it is what the soak is after.
    parser.add_argument("--server-args", default="--max-num-seqs 32 --kv-cache-memory 0.1")
    args = parser.parse_args()
    if args.duration_s < args.warmup_s + 120:
        parser.error("--duration-s must leave two minutes after the warm-up")
    log = RESULTS_DIR / "soak-server.log"
    with BenchServer(["--api-key", API_KEY, *args.server_args.split()], log) as server:
        ws_url = server.base_url.replace("http://", "ws://") + f"/v1/ws?api_key={API_KEY}"
        sampler = Sampler(server.process.pid, args.sample_s)
        latencies: list[tuple[float, float]] = []
        counts: dict[str, int] = {}
        errors: list[str] = []

        async def run() -> None:
            deadline = time.monotonic() + args.duration_s
            await asyncio.gather(*(client(i, server.base_url, ws_url, deadline, latencies,
                                          counts, errors, sampler.t0)
                                   for i in range(args.clients)))

        sampler.start()
        asyncio.run(run())
        time.sleep(args.sample_s)
        sampler.stop.set()
        sampler.join()
    samples = sampler.samples
    end_s = samples[-1]["t"]
    minutes = per_minute(latencies)
    result = {
        "duration_s": args.duration_s, "warmup_s": args.warmup_s, "clients": args.clients,
        "counts": counts, "errors": errors[:20], "num_errors": len(errors),
        "worker_pids": sorted({s["worker_pid"] for s in samples if s["worker_pid"]}),
        "growth": {key: growth(samples, key, args.warmup_s, end_s)
                   for key in ("server_rss_mib", "worker_rss_mib", "server_fds",
                               "worker_fds")},
        "per_minute": minutes, "samples": samples}
    png = RESULTS_DIR / "soak.png"
    plot(samples, minutes, png)
    path = write_results(None, "soak.json", result)
    for m in minutes:
        print(f"minute {m['minute']}: {m['n']} requests, p50 {m['p50_s']:.2f} s, "
              f"p99 {m['p99_s']:.2f} s")
    for key, g in result["growth"].items():
        print(f"{key}: {g['after_warmup']:.1f} after warm-up -> {g['end']:.1f} at the end "
              f"({g['growth_pct']:+.1f}%)")
    print(f"requests: {counts}; client errors: {len(errors)}; worker pids "
          f"{result['worker_pids']}")
    print(f"results: {path}, plot: {png}")


if __name__ == "__main__":
    main()
