"""Structured-output overhead: output tok/s at 16 concurrent streams, every
request ``json_schema``-constrained against every request free.

One run of each, same prompts, same server (``aioengine serve`` started on a
free loopback port, or ``--url``), greedy, ``max_tokens`` bounded. Free
requests use ``ignore_eos`` so they run to ``max_tokens``; constrained ones end
when their JSON is complete, so the figure compared is output tokens per
second of wall time, measured by the client over the SSE streams. Target:
constrained at least 85% of free. The CPU model and load averages are
printed with the figures (other jobs share this machine).

Usage:
    python bench/structured.py                       # own server
    python bench/structured.py --url http://127.0.0.1:8000 --api-key KEY
Writes bench/results/structured.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchServer, LoadTracker, write_results  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "genre", "year", "cast", "rating", "summary"],
}
PROMPTS = ["Describe a film you like.", "Invent a movie about the sea.", "A film from 1970.",
           "Review a comedy.", "A horror film set in a school.", "A documentary about bees.",
           "Your favourite drama.", "A film about trains.", "A space movie.",
           "A film for children.", "A movie about cooking.", "A film set in Paris.",
           "A war film.", "A film about music.", "A mystery in a castle.", "A sports film."]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


async def one(client, prompt: str, constrained: bool, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "film", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def run(base_url: str, api_key: str | None, constrained: bool, num_requests: int,
              concurrency: int, max_tokens: int) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600) as client:
        await one(client, PROMPTS[0], constrained, 8)  # warm-up (compiles the grammar)

        async def bounded(i: int) -> int:
            async with limit:
                return await one(client, PROMPTS[i % len(PROMPTS)], constrained, max_tokens)

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(bounded(i) for i in range(num_requests)))
        elapsed = time.perf_counter() - t0
    return {"constrained": constrained, "requests": num_requests, "output_tokens": sum(tokens),
            "seconds": elapsed, "output_tok_per_s": sum(tokens) / elapsed}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an existing server (else one is started)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--serve-args", default="--kv-cache-memory 0.5 --log-level warning")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    load = LoadTracker()
    load.sample()

    def both(url: str) -> list[dict]:
        return [asyncio.run(run(url, args.api_key, c, args.num_requests, args.concurrency,
                                args.max_tokens)) for c in (False, True)]

    if args.url:
        free, constrained = both(args.url)
    else:
        log = Path(tempfile.gettempdir()) / "aioengine-bench-structured.log"
        with BenchServer(args.serve_args.split(), log) as server:
            free, constrained = both(server.base_url)
    load.sample()
    ratio = constrained["output_tok_per_s"] / free["output_tok_per_s"]
    report = {"cpu": cpu_model(), "concurrency": args.concurrency, "free": free,
              "constrained": constrained, "ratio": ratio, "target": 0.85,
              "load": load.summary()}
    print(f"CPU: {report['cpu']}  (load 1m {load.summary()['loadavg_1m_min']:.1f}-"
          f"{load.summary()['loadavg_1m_max']:.1f})")
    for r in (free, constrained):
        name = "json_schema" if r["constrained"] else "free"
        print(f"{name:>12}: {r['output_tokens']} tokens in {r['seconds']:.1f} s = "
              f"{r['output_tok_per_s']:.1f} tok/s at {args.concurrency} streams")
    print(f"constrained / free = {ratio:.2f} (target >= 0.85)")
    write_results(args.output, "structured.json", report)
    return report


if __name__ == "__main__":
    main()
