"""Decode step time with tensor parallelism: TP=1 against TP=2 and TP=3.

For each configuration (``TPxTHREADS``: ranks x torch threads per rank) an
``aioengine.LLM`` is built and, for each batch size B, B requests with
random ``--prompt-len``-token prompts are prefilled; then ``--steps`` decode
steps (every request one token, after ``--warmup`` steps) are timed:

- ``step_ms``: the engine's wall time of ``executor.execute_model`` (message
  out to every rank, forward with the collectives, sampling on rank 0,
  answer back);
- ``forward_ms``: rank 0's forward + sampling time as it reports it.

Medians over the timed steps. ``vs_first``: step time over that of the first
configuration at the same B. On this 2-core machine TP cannot be faster: the
point is the cost of the collectives (two all-reduces per layer, the
embedding's all-reduce, the logits gather and the sampled-id broadcast, all
over gloo on loopback). Keep total threads (ranks x threads) at or below the
cores; 3x1 is the exception (3 single-thread ranks on 2 cores).

Usage:
    python bench/tensor_parallel.py                      # 1x2,1x1,2x1,3x1; B = 1, 8, 32
    python bench/tensor_parallel.py --configs 1x1,3x1 --batch-sizes 1,16
Writes bench/results/tensor_parallel.json (or ``--output-json``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LoadTracker, environment, write_results  # noqa: E402


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``"1x2,3x1"`` -> ``[(1, 2), (3, 1)]`` (tensor_parallel_size, threads per rank)."""
    out = []
    for item in text.split(","):
        tp, _, threads = item.strip().partition("x")
        out.append((int(tp), int(threads or 1)))
    return out


def measure(llm, batch_size: int, prompt_len: int, warmup: int, steps: int,
            vocab: int, seed: int) -> dict:
    """Median decode step times (ms) at ``batch_size`` running requests."""
    from aioengine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 1, ignore_eos=True)
    for i in range(batch_size):
        ids = [rng.randrange(100, vocab) for _ in range(prompt_len)]
        llm.engine.add_request(f"tp-bench-{seed}-{i}", ids, params)
    step_s, forward_s = [], []
    decode_steps = 0
    while llm.engine.has_unfinished_requests():
        so = llm.engine.schedule()
        t0 = time.perf_counter()
        ro = llm.executor.execute_model(so)
        dt = time.perf_counter() - t0
        llm.engine.process_output(so, ro)
        if so.num_reqs == batch_size and so.total_num_scheduled_tokens == batch_size:
            decode_steps += 1
            if warmup < decode_steps <= warmup + steps:
                step_s.append(dt)
                forward_s.append(ro.forward_time + ro.sample_time)
    return {"batch_size": batch_size, "steps": len(step_s),
            "step_ms": 1e3 * statistics.median(step_s),
            "forward_ms": 1e3 * statistics.median(forward_s)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model path (default: SmolLM2-135M)")
    parser.add_argument("--configs", default="1x2,1x1,2x1,3x1",
                        help="comma-separated TPxTHREADS (ranks x torch threads per rank)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    from aioengine import LLM

    configs = parse_configs(args.configs)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    load = LoadTracker()
    rows = []
    for tp, threads in configs:
        load.sample()
        t0 = time.perf_counter()
        llm = LLM(args.model, tensor_parallel_size=tp, num_threads=threads, dtype=args.dtype,
                  max_num_seqs=max(batch_sizes), num_gpu_blocks_override=2048)
        load_s = time.perf_counter() - t0
        vocab = len(llm.tokenizer)
        try:
            for b in batch_sizes:
                row = measure(llm, b, args.prompt_len, args.warmup, args.steps, vocab,
                              seed=1000 * tp + b)
                row.update(tp=tp, threads_per_rank=threads, total_threads=tp * threads,
                           load_s=round(load_s, 1),
                           rank_weight_bytes=getattr(llm.executor, "rank_weight_bytes",
                                                     [getattr(llm.executor, "weight_bytes", 0)]))
                rows.append(row)
                print(f"TP={tp} x {threads} thread(s), B={b}: step {row['step_ms']:.1f} ms, "
                      f"forward {row['forward_ms']:.1f} ms", flush=True)
        finally:
            llm.shutdown()
    load.sample()
    base = {r["batch_size"]: r["step_ms"] for r in rows
            if (r["tp"], r["threads_per_rank"]) == configs[0]}
    for r in rows:
        r["vs_first"] = r["step_ms"] / base[r["batch_size"]]

    print(f"\n{'TP':>3} {'thr/rank':>8} {'B':>4} {'step ms':>8} {'fwd ms':>8} "
          f"{'vs ' + 'x'.join(map(str, configs[0])):>8}")
    for r in rows:
        print(f"{r['tp']:>3} {r['threads_per_rank']:>8} {r['batch_size']:>4} "
              f"{r['step_ms']:>8.1f} {r['forward_ms']:>8.1f} {r['vs_first']:>7.2f}x")
    report = {"environment": environment(0, args.dtype), "model": args.model or "SmolLM2-135M",
              "prompt_len": args.prompt_len, "warmup": args.warmup, "steps": args.steps,
              "rows": rows, "load": load.summary()}
    path = write_results(args.output_json, "tensor_parallel.json", report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
