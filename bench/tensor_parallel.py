"""Decode step time with tensor parallelism: TP=1 against TP=2 and TP=3.

For each configuration (``TPxTHREADS``: ranks x torch threads per rank) an
``aioengine.LLM`` is built and, for each batch size B, B requests with
random ``--prompt-len``-token prompts are prefilled; then ``--steps`` decode
steps (every request one token, after ``--warmup`` steps) are timed. All
engines are built first and measured in ``--rounds`` interleaved rounds
(medians over rounds), so that other jobs on this shared machine do not
land on one configuration only.

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

SmolLM2-135M's 9 heads split over 1 or 3 ranks only; ``--synthetic-heads 8,2``
measures TP=2 on a random-weight twin with SmolLM2's sizes and 8 heads.

Usage:
    python bench/tensor_parallel.py                      # 1x2,1x1,3x1 (2x1 skipped); B = 1, 8, 32
    python bench/tensor_parallel.py --synthetic-heads 8,2 --configs 1x2,1x1,2x1
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


def synthetic_model(root: Path, num_heads: int, num_kv_heads: int) -> Path:
    """A random-weight HF folder with SmolLM2-135M's sizes (hidden 576, 30
    layers, intermediate 1536, vocab 49152, tied embeddings) but the given
    head counts, with the default model's tokenizer: SmolLM2's 9 heads split
    only over 1, 3 or 9 ranks, so TP=2 is measured on this twin."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    path = root / f"smollm2-shape-{num_heads}q{num_kv_heads}kv"
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=2048,
                         rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model path (default: SmolLM2-135M)")
    parser.add_argument("--synthetic-heads", default="",
                        help="Q,KV: instead of --model, a random-weight model with SmolLM2's "
                             "sizes and these head counts (e.g. 8,2 for TP=2)")
    parser.add_argument("--configs", default="1x2,1x1,2x1,3x1",
                        help="comma-separated TPxTHREADS (ranks x torch threads per rank); "
                             "sizes the model's heads cannot split are skipped")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3,
                        help="measurement rounds over all configurations, interleaved so "
                             "that other load on the machine hits them alike")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    from aioengine import LLM
    from aioengine.models.arch import check_parallel_config
    from aioengine.config import EngineConfig

    tmp = None
    model = args.model
    if args.synthetic_heads:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="tp-bench-")
        q, kv = (int(x) for x in args.synthetic_heads.split(","))
        model = str(synthetic_model(Path(tmp.name), q, kv))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    configs, skipped = [], []
    for tp, threads in parse_configs(args.configs):
        try:
            check_parallel_config(EngineConfig.from_kwargs(model=model, tensor_parallel_size=tp))
            configs.append((tp, threads))
        except ValueError as exc:
            skipped.append({"tp": tp, "threads_per_rank": threads, "reason": str(exc)})
            print(f"skipped TP={tp}: {exc}", flush=True)
    load = LoadTracker()
    engines = {}
    load_s = {}
    try:
        for tp, threads in configs:
            t0 = time.perf_counter()
            blocks = max(batch_sizes) * -(-(args.prompt_len + args.warmup + args.steps + 2) // 16)
            engines[tp, threads] = LLM(model, tensor_parallel_size=tp, num_threads=threads,
                                       dtype=args.dtype, max_num_seqs=max(batch_sizes),
                                       num_gpu_blocks_override=blocks + 16)
            load_s[tp, threads] = time.perf_counter() - t0
        samples: dict[tuple[int, int, int], list[dict]] = {}
        for rnd in range(args.rounds):
            load.sample()
            for (tp, threads), llm in engines.items():
                for b in batch_sizes:
                    row = measure(llm, b, args.prompt_len, args.warmup, args.steps,
                                  len(llm.tokenizer), seed=1000 * rnd + 10 * tp + b)
                    samples.setdefault((tp, threads, b), []).append(row)
                    print(f"round {rnd}: TP={tp} x {threads} thread(s), B={b}: "
                          f"step {row['step_ms']:.1f} ms, forward {row['forward_ms']:.1f} ms",
                          flush=True)
        rows = []
        for (tp, threads, b), runs in samples.items():
            ex = engines[tp, threads].executor
            rows.append({
                "tp": tp, "threads_per_rank": threads, "total_threads": tp * threads,
                "batch_size": b, "steps": sum(r["steps"] for r in runs),
                "step_ms": statistics.median(r["step_ms"] for r in runs),
                "forward_ms": statistics.median(r["forward_ms"] for r in runs),
                "step_ms_rounds": [round(r["step_ms"], 2) for r in runs],
                "load_s": round(load_s[tp, threads], 1),
                "rank_weight_bytes": getattr(ex, "rank_weight_bytes",
                                             [getattr(ex, "weight_bytes", 0)])})
    finally:
        for llm in engines.values():
            llm.shutdown()
        if tmp is not None:
            tmp.cleanup()
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
    report = {"environment": environment(0, args.dtype),
              "model": args.model or (f"synthetic {args.synthetic_heads}" if args.synthetic_heads
                                      else "SmolLM2-135M"),
              "prompt_len": args.prompt_len, "warmup": args.warmup, "steps": args.steps,
              "rounds": args.rounds, "rows": rows, "skipped": skipped, "load": load.summary()}
    path = write_results(args.output_json, "tensor_parallel.json", report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
