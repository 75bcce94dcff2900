"""Decode steps on a CUDA GPU with CUDA graphs and without (``--enforce-eager``).

For each batch size, a ``ModelRunner`` prefills that many random prompts of
``--prompt-len`` tokens, then runs ``--steps`` decode steps of all of them, each timed
host to host: the step's inputs built from the persistent batch and copied in, the
forward (a graph replay, or the kernels launched one by one), the LM head, greedy
argmax on the device and the ids back on the host. Reported: the median step time,
decode tok/s, and graphs' speed-up over eager, per batch size. A batch size above the
largest captured bucket (``--max-num-seqs``) runs eagerly in both.

The model: ``--model`` (a GGUF file or an HF folder), else random weights of
SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49,152,
tied embeddings) saved as an HF folder in bf16, so the script needs no model file.

Usage: python bench/gpu_decode.py [--batch-sizes 1,8,32,64] [--steps 64]
       [--prompt-len 128] [--dtype bfloat16] [--model PATH] [--out DIR]
Prints a table; writes DIR/gpu_decode.json (default bench/results). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioengine.config import EngineConfig  # noqa: E402
from aioengine.ipc.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingMetadata,
    SchedulerOutput,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def random_smollm2_folder(folder: Path) -> str:
    """An HF folder with random weights of SmolLM2-135M's shape, in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def _greedy() -> SamplingMetadata:
    return SamplingMetadata(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                            presence_penalty=0.0, frequency_penalty=0.0,
                            repetition_penalty=1.0, seed=0, logprobs=-1, min_tokens=0,
                            stop_token_ids=[], logit_bias=[])


def time_decode(runner, batch: int, prompt_len: int, steps: int, tag: str) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``batch`` sequences (after a prefill
    step of them all); the requests are finished at the end."""
    bs = runner.block_size
    per_req = -(-(prompt_len + steps + 1) // bs)
    if batch * per_req > runner.num_blocks:
        raise SystemExit(f"batch {batch} needs {batch * per_req} KV blocks, the cache has "
                         f"{runner.num_blocks}")
    rng = np.random.default_rng(batch)
    ids = [f"{tag}{i}" for i in range(batch)]
    new = [NewRequestData(rid, rng.integers(0, runner.arch.vocab_size, prompt_len).tolist(),
                          prompt_len, _greedy(), list(range(i * per_req, (i + 1) * per_req)), 0)
           for i, rid in enumerate(ids)]
    runner.execute_model(SchedulerOutput(0, new, [], [prompt_len] * batch, [], []))
    times = []
    for step in range(1, steps + 1):
        cached = [CachedRequestData(rid, [], prompt_len + step - 1) for rid in ids]
        so = SchedulerOutput(step, [], cached, [1] * batch, [], [])
        t0 = time.perf_counter()
        runner.execute_model(so)  # ends with the sampled ids on the host: synchronised
        times.append(time.perf_counter() - t0)
    runner.execute_model(SchedulerOutput(steps + 1, [], [], [], ids, []))
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 32, 64])
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="decode steps run first and not timed")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--model", default="", help="GGUF file or HF folder (default: random "
                                               "SmolLM2-135M-shaped weights)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_decode.py needs a CUDA GPU")
    from aioengine.worker.model_runner import ModelRunner

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_smollm2_folder(Path(tmp) / "smollm2-shape")
        rows, capture_info = [], {}
        for eager in (False, True):
            config = EngineConfig.from_kwargs(
                model=model, executor="inproc", device="cuda", dtype=args.dtype,
                max_num_seqs=args.max_num_seqs, enforce_eager=eager,
                max_model_len=min(2048, args.prompt_len + args.steps + args.warmup_steps + 16),
                num_gpu_blocks_override=max(args.batch_sizes) * (
                    -(-(args.prompt_len + args.steps + args.warmup_steps + 2) // 16)))
            runner = ModelRunner(config)
            for batch in args.batch_sizes:
                times = time_decode(runner, batch, args.prompt_len,
                                    args.warmup_steps + args.steps, f"{eager}-{batch}-")
                step = statistics.median(times[args.warmup_steps:])
                rows.append({"graphs": not eager, "batch": batch, "step_ms": step * 1e3,
                             "tok_s": batch / step,
                             "replayed": not eager and runner.cuda_graphs is not None
                             and runner.cuda_graphs.bucket_for(batch) is not None})
            capture = runner.cuda_graphs
            if capture is not None:
                capture_info = {"capture_s": capture.capture_time_s,
                                "capture_mib": capture.capture_memory_bytes / (1 << 20),
                                "buckets": list(capture.capture_sizes)}
            del runner
            torch.cuda.empty_cache()
    by = {(r["graphs"], r["batch"]): r for r in rows}
    print(f"{torch.cuda.get_device_name()}, model {args.model or 'random SmolLM2-135M shape'}, "
          f"{args.dtype}, prompt {args.prompt_len}, median of {args.steps} steps")
    print(f"{'batch':>5} {'eager ms':>9} {'graphs ms':>10} {'eager tok/s':>12} "
          f"{'graphs tok/s':>13} {'speed-up':>9}")
    for batch in args.batch_sizes:
        e, g = by[(False, batch)], by[(True, batch)]
        print(f"{batch:>5} {e['step_ms']:>9.3f} {g['step_ms']:>10.3f} {e['tok_s']:>12.0f} "
              f"{g['tok_s']:>13.0f} {e['step_ms'] / g['step_ms']:>8.2f}x"
              f"{'' if g['replayed'] else ' (eager: above the largest bucket)'}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "dtype": args.dtype,
              "model": args.model or "random SmolLM2-135M shape", "prompt_len": args.prompt_len,
              "steps": args.steps, "rows": rows, **capture_info}
    (args.out / "gpu_decode.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
