"""Per-step times of streams that decode together, in one process: the steps where
every stream starts a new KV block against the others.

``--streams`` requests with prompts of ``--prompt-len`` tokens start together and
decode ``--steps`` greedy tokens each, so they cross a block boundary (every
``block_size`` tokens) in the same step, as the 32 streams of ``bench/scheduler.py``
do. Each step is timed around ``execute_model`` (the worker's whole step, in-process).
The report is the median step at a boundary (some stream's first token in a new
block) and elsewhere, their ratio, and the p99/p50 of all steps: a step that pays
for something only boundaries do (a KV cache whose pages are faulted in as blocks
are first written) shows as a ratio above 1.

Usage: python bench/decode_steps.py [--streams 32] [--prompt-len 32] [--steps 100]
       [--threads 2] [--output-json PATH]
Prints the CPU model and its SIMD flags and the load average; writes
bench/results/decode_steps.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, loadavg, percentile, synthetic_workload, write_results
from bench.quantized import cpu_info


def run(args: argparse.Namespace) -> dict:
    from aioengine import LLM, SamplingParams

    llm = LLM(executor="inproc", num_threads=args.threads, max_num_seqs=max(args.streams, 8))
    block_size = llm.engine.scheduler.kv_cache_manager.block_size
    requests = synthetic_workload(args.streams, (args.prompt_len,) * 2, (args.steps,) * 2,
                                  llm.engine.tokenizer.vocab_size, 0)
    for i, r in enumerate(requests):
        llm.engine.add_request(f"s{i}", r.prompt_token_ids, SamplingParams(
            max_tokens=args.steps, ignore_eos=True, temperature=0.0))
    boundary, other = [], []
    load = [loadavg()[0]]
    while llm.engine.has_unfinished_requests():
        so = llm.engine.schedule()
        t0 = time.perf_counter()
        ro = llm.executor.execute_model(so)
        ms = 1000 * (time.perf_counter() - t0)
        llm.engine.process_output(so, ro)
        if so.num_reqs != args.streams or so.total_num_scheduled_tokens != args.streams:
            continue  # the prompts' step, or a step after some stream finished
        # The token each stream computes this step sits at position num_computed - 1.
        positions = [r.num_computed_tokens - 1 for r in llm.engine.scheduler.scheduled_requests]
        (boundary if any(p % block_size == 0 for p in positions) else other).append(ms)
    load.append(loadavg()[0])
    steps = sorted(boundary + other)
    at, elsewhere = statistics.median(boundary), statistics.median(other)
    return {"cpu": cpu_info(), "environment": environment(args.threads, "float32"),
            "block_size": block_size, "load_1m": load,
            "boundary_steps": len(boundary), "other_steps": len(other),
            "boundary_ms_p50": round(at, 2), "other_ms_p50": round(elsewhere, 2),
            "boundary_over_other": round(at / elsewhere, 3),
            "step_ms_p50": round(percentile(steps, 50), 2),
            "step_ms_p99": round(percentile(steps, 99), 2),
            "boundary_ms": [round(x, 2) for x in boundary]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    report = run(args)
    cpu = report["cpu"]
    print(f"{cpu['model']} ({', '.join(cpu['simd_flags'])}), {args.threads} threads, "
          f"load {report['load_1m'][0]:.2f}-{report['load_1m'][1]:.2f}")
    print(f"{args.streams} streams: step at a block boundary {report['boundary_ms_p50']} ms "
          f"(median of {report['boundary_steps']}), elsewhere {report['other_ms_p50']} ms "
          f"({report['boundary_over_other']}x); all steps p50 {report['step_ms_p50']} ms, "
          f"p99 {report['step_ms_p99']} ms")
    print("wrote", write_results(args.output_json, "decode_steps.json", report))


if __name__ == "__main__":
    main()
