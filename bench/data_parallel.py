"""Data parallel replicas (issue 21): throughput DP=2 against DP=1, and the
router's prefix hit rate on a multi-turn chat workload against round-robin.

1. Throughput: ``aioengine serve --data-parallel-size D`` for D in
   ``--dp-sizes`` (1,2), each started alone, gets ``--streams`` (32) clients
   sending ``--prompt-len`` (100) random-token prompts for ``--max-tokens``
   (128) greedy tokens with ``ignore_eos``, over SSE on ``/v1/completions``
   (bench/serving.py's load generator). The cores are divided among the
   replicas' workers, so on a 2-core machine DP=2 runs two 1-thread workers
   where DP=1 runs one 2-thread worker: the ratio says what splitting costs
   or gains on this host, not what a second host would add.
2. Prefix hit rate: DP=2 with ``--data-parallel-routing prefix`` and then
   ``round_robin``: ``--conversations`` (8) chats run at once, each
   ``--turns`` (4) turns long (every turn resends the whole history, as chat
   clients do; ``--turn-tokens`` greedy tokens a reply). Hit rate: the
   prompts' ``usage.prompt_tokens_details.cached_tokens`` over their
   ``prompt_tokens``, summed; turn 1 can only hit the template's shared
   system prompt, so later turns are also reported alone.

The CPU model and flags and the load average are printed. Writes
bench/results/data_parallel.json and data_parallel.png.

Usage:
    python bench/data_parallel.py             # about 5 minutes on 2 cores
    python bench/data_parallel.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    RESULTS_DIR,
    BenchServer,
    LoadTracker,
    synthetic_workload,
    write_results,
)
from bench.quantized import cpu_info
from bench.serving import Endpoint, make_sender, run_load

TOPICS = ["trains in Scotland", "baking bread", "learning Python", "the Moon landing",
          "growing tomatoes", "jazz piano", "the Roman empire", "chess openings",
          "bicycle repair", "coffee brewing", "volcanoes", "knitting"]
FOLLOW_UPS = ["Tell me more.", "Why is that?", "Give me one example.", "Summarise it in "
              "a sentence.", "What should I read next?"]


def server_args(args: argparse.Namespace, dp: int, routing: str = "prefix") -> list[str]:
    return ["--data-parallel-size", str(dp), "--data-parallel-routing", routing,
            "--executor", "process", "--max-num-seqs", str(max(64, args.streams)),
            "--log-level", "warning"]


async def throughput(base_url: str, args: argparse.Namespace, vocab_size: int) -> dict:
    import httpx

    requests = synthetic_workload(args.streams, (args.prompt_len, args.prompt_len),
                                  (args.max_tokens, args.max_tokens), vocab_size, args.seed)
    endpoint = Endpoint(base_url)
    async with httpx.AsyncClient(timeout=600) as client:
        send = make_sender("sse", endpoint, chat=False, client=client)
        run = await run_load(send, requests, time_limit_s=args.time_limit,
                             desc=f"{args.streams} streams", progress=not args.no_progress)
    run.pop("requests", None)
    return run


async def multi_turn(base_url: str, args: argparse.Namespace) -> dict:
    """Conversations side by side, turns one after another in each."""
    import httpx

    per_turn: list[list[tuple[int, int]]] = [[] for _ in range(args.turns)]

    async def conversation(client: httpx.AsyncClient, i: int) -> None:
        messages = [{"role": "user", "content": f"Let's talk about {TOPICS[i % len(TOPICS)]}."}]
        for turn in range(args.turns):
            r = await client.post("/v1/chat/completions", json={
                "messages": messages, "temperature": 0, "max_tokens": args.turn_tokens})
            r.raise_for_status()
            body = r.json()
            usage = body["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            per_turn[turn].append((usage["prompt_tokens"], cached))
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, i) for i in range(args.conversations)))
        elapsed = time.perf_counter() - t0
        stats = (await client.get("/v1/engine/stats")).json()

    def rate(rows: list[tuple[int, int]]) -> float:
        prompt = sum(p for p, _ in rows)
        return sum(c for _, c in rows) / prompt if prompt else 0.0

    later = [row for turn in per_turn[1:] for row in turn]
    return {"hit_rate": rate([row for turn in per_turn for row in turn]),
            "hit_rate_later_turns": rate(later),
            "hit_rate_by_turn": [rate(turn) for turn in per_turn],
            "elapsed_s": elapsed, "routing_decisions": stats.get("routing"),
            "requests_per_replica": [r["num_requests_finished"]
                                     for r in stats.get("replicas", [])]}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    tp = report["throughput"]
    a.bar([f"DP={d}" for d in tp], [tp[d]["output_throughput"] for d in tp], color="#4c72b0")
    a.set_ylabel("output tok/s")
    a.set_title(f"{report['args']['streams']} streams, {report['cpu']['model']}")
    mt = report["multi_turn"]
    names = list(mt)
    x = range(len(mt[names[0]]["hit_rate_by_turn"])) if names else []
    for name in names:
        b.plot([t + 1 for t in x], [100 * v for v in mt[name]["hit_rate_by_turn"]],
               marker="o", label=name)
    b.set_xticks([t + 1 for t in x])
    b.set_xlabel("turn")
    b.set_ylabel("prompt tokens from the prefix cache, %")
    b.set_title("DP=2 multi-turn chat: routing")
    b.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp-sizes", default="1,2")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="8 streams of 32 tokens, 4 conversations of 3 turns")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot-dir", default=str(RESULTS_DIR))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.max_tokens, args.conversations, args.turns = 8, 32, 4, 3
    return args


def main(argv: list[str] | None = None) -> dict:
    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    args = parse_args(argv)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cpus']} CPUs; flags: {' '.join(cpu['simd_flags'])}",
          flush=True)
    vocab_size = len(load_tokenizer(default_model_path()))
    load = LoadTracker()
    load.sample()
    logs = Path(tempfile.mkdtemp(prefix="aioengine-bench-dp-"))
    report: dict = {"benchmark": "data_parallel", "cpu": cpu, "args": vars(args),
                    "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "throughput": {},
                    "multi_turn": {}}
    for dp in [int(d) for d in args.dp_sizes.split(",")]:
        with BenchServer(server_args(args, dp), logs / f"dp{dp}.log") as server:
            run = asyncio.run(throughput(server.base_url, args, vocab_size))
        report["throughput"][dp] = run
        now = load.sample()[0]
        print(f"DP={dp}: {run['output_throughput']:.1f} output tok/s, TTFT p50 "
              f"{run['ttft']['p50_ms']:.0f} ms, ITL p50 {run['itl']['p50_ms']:.1f} ms "
              f"({run['completed']}/{run['num_requests']} ok), load {now:.2f}", flush=True)
    for routing in ("prefix", "round_robin"):
        with BenchServer(server_args(args, 2, routing), logs / f"mt-{routing}.log") as server:
            mt = asyncio.run(multi_turn(server.base_url, args))
        report["multi_turn"][routing] = mt
        load.sample()
        print(f"DP=2 {routing}: prefix hit rate {100 * mt['hit_rate']:.1f}% (turns 2+: "
              f"{100 * mt['hit_rate_later_turns']:.1f}%), requests per replica "
              f"{mt['requests_per_replica']}, {mt['elapsed_s']:.1f} s", flush=True)
    report["load"] = load.summary()
    tp = report["throughput"]
    if 1 in tp and 2 in tp and tp[1]["output_throughput"]:
        report["dp2_over_dp1"] = tp[2]["output_throughput"] / tp[1]["output_throughput"]
        print(f"DP=2 / DP=1 output tok/s: {report['dp2_over_dp1']:.2f}x")
    path = write_results(args.output_json, "data_parallel.json", report)
    plot_path = Path(args.plot_dir) / "data_parallel.png"
    plot(report, plot_path)
    print(f"load {report['load']['loadavg_1m_min']:.2f}-{report['load']['loadavg_1m_max']:.2f}; "
          f"wrote {path} and {plot_path}")
    return report


if __name__ == "__main__":
    main()
