"""The sampler alone on one step's logits: ``aioengine.worker.sampler.sample`` per filter mix.

The logits are the default model's, 32 rows after random-token prompts (the workload of
``bench/throughput.py``'s step breakdown; such rows are flat: top-p 0.95 keeps 500-11,000
of 49,152 tokens), or ``--random`` ones (no model load). Each mix is timed as the median
of ``--reps`` calls over 6 steps' logits, on ``--threads`` threads, beside the load average.

Usage:
    python bench/sampler_step.py --threads 2
    python bench/sampler_step.py --random --rows 32 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from aioengine.worker.sampler import SamplingBatch, sample

MIXES = {  # name: (temperature, top_k, top_p, min_p, share of greedy rows)
    "T0.8 top-p 0.95": (0.8, 0, 0.95, 0.0, 0.0),
    "T0.8 (no filter)": (0.8, 0, 1.0, 0.0, 0.0),
    "T1.0 top-k 50": (1.0, 50, 1.0, 0.0, 0.0),
    "T0.8 top-k 50 top-p 0.95": (0.8, 50, 0.95, 0.0, 0.0),
    "T1.0 min-p 0.05": (1.0, 0, 1.0, 0.05, 0.0),
    "T0.2 top-p 0.95": (0.2, 0, 0.95, 0.0, 0.0),
    "T1.5 top-p 0.95": (1.5, 0, 0.95, 0.0, 0.0),
    "half greedy, T0.8 top-p 0.95": (0.8, 0, 0.95, 0.0, 0.5),
}


def model_logits(rows: int, steps: int, threads: int) -> list[torch.Tensor]:
    """``steps`` decode steps' ``[rows, vocab]`` fp32 logits of the default model."""
    from aioengine import LLM, SamplingParams
    from bench.common import synthetic_workload

    llm = LLM(executor="inproc", num_threads=threads, max_num_seqs=rows)
    model = llm.executor.runner.model
    captured: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def capture(*args, **kwargs):
        out = compute_logits(*args, **kwargs)
        if out.shape[0] == rows:
            captured.append(out.detach().clone())
        return out

    model.compute_logits = capture
    vocab = llm.executor.runner.arch.vocab_size
    try:
        for i, r in enumerate(synthetic_workload(rows, (64, 64), (steps, steps), vocab, 7)):
            llm.engine.add_request(f"s{i}", r.prompt_token_ids,
                                   SamplingParams(max_tokens=steps, ignore_eos=True,
                                                  temperature=0.8, top_p=0.95, seed=i))
        while llm.engine.has_unfinished_requests():
            so = llm.engine.schedule()
            llm.engine.process_output(so, llm.executor.execute_model(so))
    finally:
        llm.shutdown()
    return captured[:steps]


def make_batch(rows: int, mix: tuple) -> SamplingBatch:
    temperature, top_k, top_p, min_p, greedy_share = mix
    greedy = [i < int(rows * greedy_share) for i in range(rows)]

    def full(v, dtype=torch.float32) -> torch.Tensor:
        return torch.full((rows,), v, dtype=dtype)

    b = SamplingBatch(temperature=torch.tensor([0.0 if g else temperature for g in greedy]),
                      top_p=full(top_p), top_k=full(top_k, torch.int64), min_p=full(min_p),
                      presence_penalty=full(0.0), frequency_penalty=full(0.0),
                      repetition_penalty=full(1.0),
                      generators=[torch.Generator().manual_seed(i) for i in range(rows)],
                      greedy=greedy, num_logprobs=[-1] * rows)
    b.need_top_k, b.need_top_p, b.need_min_p = top_k > 0, top_p < 1.0, min_p > 0.0
    return b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--random", action="store_true", help="random logits, no model load")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    steps = 6
    if args.random:
        gen = torch.Generator().manual_seed(0)
        logits = [torch.randn(args.rows, 49_152, generator=gen) * 2.5 for _ in range(steps)]
    else:
        logits = model_logits(args.rows, steps, args.threads)
    load_before = os.getloadavg()[0]
    print(f"sampler, {args.rows} rows x {logits[0].shape[1]}, {args.threads} threads, "
          f"{'random' if args.random else 'default model'} logits (ms, median of {args.reps})")
    for name, mix in MIXES.items():
        b = make_batch(args.rows, mix)
        times = []
        for r in range(args.reps):
            x = logits[r % steps].clone()
            t = time.perf_counter()
            sample(x, b)
            times.append(time.perf_counter() - t)
        print(f"  {name:30s} {1000 * statistics.median(times):7.3f}")
    print(f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
