"""The HF transformers baseline: what a user without a serving engine runs.

Same weights (the default SmolLM2 GGUF, dequantized by transformers), same
dtype, same thread count and the same workload as our side. Three modes:

- ``hf_static_batches``: ``model.generate`` on static batches of
  ``batch_size`` requests in workload order, left-padded; each batch runs
  until its longest request is done (``max_new_tokens`` = the batch's longest
  output), as vLLM's ``benchmark_throughput --backend hf`` does. Throughput
  counts the tokens the requests asked for, not the padding and the extra
  tokens a batch generates for its shorter members.
- ``hf_decode_batch1``: one request, ``generate`` with a streamer that stamps
  every new token; decode speed is ``(n - 1) / (t_last - t_first)``, the same
  definition our side uses.
- ``hf_static_batch_latency``: static batches as above, serving
  ``batch_size`` concurrent streams: a streamer stamps every step, so each
  request gets TTFT, ITL, TPOT and E2E as a client of a single-stream HF
  server would see them (bench/serving.py's ``chat8`` scenario).

Greedy decoding, no EOS stop (``eos_token_id=None``), so every request
generates exactly its ``output_len`` tokens on both sides.

Usage (alone): python bench/baseline_hf.py [--num-prompts 16] [--batch-size 16] [--dtype float32]
The benchmarks import these functions: bench/throughput.py and
bench/serving.py run both sides in one process and print the ratio.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_model(dtype: str = "float32", model_path: str | None = None):
    """transformers' own ``LlamaForCausalLM`` on the default GGUF (or ``model_path``:
    a ``.gguf`` file or an HF folder), in ``dtype``, eval mode."""
    from transformers import AutoModelForCausalLM

    from aioengine.config import default_model_path

    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path),
                                                     dtype=DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.eval()


def left_pad(prompts: Sequence[list[int]], pad_token_id: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[batch, max_prompt_len]``, padded on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def _generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
              pad_token_id: int, streamer=None) -> torch.Tensor:
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None,
                         pad_token_id=pad_token_id, streamer=streamer)
    generated = out.shape[1] - input_ids.shape[1]
    if generated != max_new_tokens:
        raise RuntimeError(f"HF generate made {generated} tokens, asked for {max_new_tokens}")
    return out


def warmup(model, pad_token_id: int = 0) -> None:
    """One small generate so first-call costs (oneDNN kernels, allocator) stay out of timings."""
    ids, mask = left_pad([[1000 + i for i in range(16)], [2000 + i for i in range(8)]],
                         pad_token_id)
    _generate(model, ids, mask, 4, pad_token_id)


def hf_static_batches(model, requests: Sequence[BenchRequest], batch_size: int = 16,
                      pad_token_id: int = 0, progress: bool = True) -> dict:
    """Run ``requests`` through ``generate`` in static batches, in order.

    Returns:
        ``elapsed_s``, ``requests_per_s``, ``output_tokens_per_s`` (tokens the
        requests asked for), ``total_tokens_per_s`` (prompt + output),
        ``generated_tokens`` (including each batch's surplus for its shorter
        requests), ``batch_size``.
    """
    from tqdm import tqdm

    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    generated = 0
    bar = tqdm(total=len(requests), desc=f"HF generate (static batch {batch_size})",
               disable=not progress)
    t0 = time.perf_counter()
    for batch in batches:
        ids, mask = left_pad([r.prompt_token_ids for r in batch], pad_token_id)
        max_new = max(r.output_len for r in batch)
        _generate(model, ids, mask, max_new, pad_token_id)
        generated += max_new * len(batch)
        bar.update(len(batch))
    elapsed = time.perf_counter() - t0
    bar.close()
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {"mode": "static_batch", "batch_size": batch_size, "elapsed_s": round(elapsed, 3),
            "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "generated_tokens": generated}


def hf_sequential(model, requests: Sequence[BenchRequest], progress: bool = True) -> dict:
    """Every request alone (batch 1), one after another; the same keys as
    ``hf_static_batches``."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    for r in tqdm(requests, desc="HF generate (batch 1)", disable=not progress):
        ids = torch.tensor([r.prompt_token_ids])
        _generate(model, ids, torch.ones_like(ids), r.output_len, 0)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {"mode": "sequential", "batch_size": 1, "elapsed_s": round(elapsed, 3),
            "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "generated_tokens": output_tokens}


class _TokenClock:
    """A ``generate`` streamer that stamps each call: the first ``put`` is the
    prompt, each later one a new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_batch1(model, prompt_token_ids: list[int], num_tokens: int) -> dict:
    """Batch-1 greedy decode speed.

    Returns:
        ``decode_tokens_per_s``: ``(num_tokens - 1) / (t_last - t_first)``
        (after the first token, so the prefill is not counted);
        ``ttft_s``: prefill and first token; ``ms_per_token``.
    """
    ids = torch.tensor([prompt_token_ids])
    clock = _TokenClock()
    t0 = time.perf_counter()
    _generate(model, ids, torch.ones_like(ids), num_tokens, 0, streamer=clock)
    token_stamps = clock.stamps[1:]  # stamps[0]: generate() echoing the prompt
    decode_s = token_stamps[-1] - token_stamps[0]
    rate = (len(token_stamps) - 1) / decode_s if decode_s > 0 else float("nan")
    return {"num_tokens": num_tokens, "prompt_len": len(prompt_token_ids),
            "ttft_s": round(token_stamps[0] - t0, 4), "decode_tokens_per_s": rate,
            "ms_per_token": 1000.0 / rate}


@dataclass
class StreamTiming:
    """One request served by ``hf_static_batch_latency`` (seconds from the run's start).

    Attributes:
        arrival_s: when the request was sent (its client's previous request
            had its last token, or the run started).
        token_times_s: when each of its tokens came out of ``generate``.
    """

    prompt_len: int
    output_len: int
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times_s)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in itertools.pairwise(t)]


def hf_static_batch_latency(model, requests: Sequence[BenchRequest], batch_size: int,
                            pad_token_id: int = 0, time_limit_s: float = float("inf"),
                            progress: bool = True) -> list[StreamTiming]:
    """Serve ``requests`` to ``batch_size`` concurrent streams the way a user
    without a serving engine would: left-padded static batches of
    ``batch_size`` in workload order through ``generate``, one batch at a time.

    Closed loop, like the engine side's ``--max-concurrency``: client ``k``
    sends requests ``k``, ``k + batch_size``, ... each when its previous one
    has its last token; a batch starts only when the previous batch ended. So
    a request arrives no later than its batch's start, and TTFT counts any
    wait for the batch still running (none when the outputs have one length:
    every request of a batch ends with it). No batch starts after
    ``time_limit_s``; the requests left are not returned.

    Returns:
        One ``StreamTiming`` per request served, in workload order.
    """
    from tqdm import tqdm

    timings: list[StreamTiming] = []
    bar = tqdm(total=len(requests), desc=f"HF generate (static batch {batch_size}, streamed)",
               disable=not progress, leave=False)
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        if time.perf_counter() - t0 >= time_limit_s:
            break
        batch = requests[start:start + batch_size]
        ids, mask = left_pad([r.prompt_token_ids for r in batch], pad_token_id)
        batch_start = time.perf_counter() - t0
        clock = _TokenClock()
        _generate(model, ids, mask, max(r.output_len for r in batch), pad_token_id,
                  streamer=clock)
        steps = [t - t0 for t in clock.stamps[1:]]  # stamps[0]: generate() echoing the prompt
        for i, r in enumerate(batch, start):
            arrival = timings[i - batch_size].token_times_s[-1] if i >= batch_size else batch_start
            timings.append(StreamTiming(r.prompt_len, r.output_len, min(arrival, batch_start),
                                        steps[:r.output_len]))
        bar.update(len(batch))
    bar.close()
    return timings


def main(argv: list[str] | None = None) -> None:
    from bench.common import synthetic_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = load_hf_model(args.dtype)
    warmup(model)
    requests = synthetic_workload(args.num_prompts, tuple(args.input_len_range),
                                  tuple(args.output_len_range), model.config.vocab_size, args.seed)
    res = hf_static_batches(model, requests, args.batch_size)
    print(f"HF static batch {args.batch_size}: {res['requests_per_s']:.2f} req/s, "
          f"{res['output_tokens_per_s']:.1f} output tok/s, "
          f"{res['total_tokens_per_s']:.1f} total tok/s ({res['elapsed_s']:.1f} s)")
    b1 = hf_decode_batch1(model, requests[0].prompt_token_ids[:32], 64)
    print(f"HF batch-1 decode: {b1['decode_tokens_per_s']:.1f} tok/s "
          f"({b1['ms_per_token']:.1f} ms/token)")


if __name__ == "__main__":
    main()
