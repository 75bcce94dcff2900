"""The chunked-prefill attention kernel alone (``csrc/attention.h`` ``PrefillAttention``):
one prompt chunk of ``--chunk`` tokens over a cached prefix of each ``--prefixes`` length,
30 layers' caches (9 query / 3 KV heads of 64, block 16, shuffled blocks: the default
model's shape), three paths in one process, interleaved call by call: the fp32 AVX-512 tiles
(``set_amx(False)``), the AMX-BF16 tiles fp32-grade (bf16 hi + lo, the default with AMX)
and plain bf16 (``set_bf16_attention(True)``). Median of ``--reps``; one thread on the
calling thread's CPU clock, more on the wall clock. GFLOP/s count 4 FLOP per query head,
key and dim (QK^T and PV), causal keys only. Prints the load average before and after.

Usage: python bench/prefill_attention.py [--prefixes 128,600,1500] [--chunk 16]
       [--dtypes float16,bfloat16,float32] [--threads 1,2] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kernels

PATHS = (("avx512 fp32", False, False), ("amx hi+lo", True, False), ("amx bf16", True, True))


def main() -> None:
    from triton_kernels import cpu_ops

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", default="128,600,1500")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--dtypes", default="float16,bfloat16,float32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    ops = cpu_ops.load()
    if ops is None:
        raise SystemExit("the C++ CPU kernels are not available")
    if not cpu_ops.set_amx(True):
        print("no AMX-BF16 here: the amx columns run the AVX-512 tiles too")
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    print(f"load average {os.getloadavg()[0]:.2f}; ms for {args.layers} layers, GFLOP/s")
    print("threads cache     prefix | " + " | ".join(f"{name:>20s}" for name, _, _ in PATHS)
          + " | fp32/bf16")
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                for prefix in (int(n) for n in args.prefixes.split(",")):
                    seq_len = prefix + args.chunk
                    blocks = -(-seq_len // block_size)
                    g = torch.Generator().manual_seed(0)
                    caches = [(torch.randn(blocks + 1, block_size, kv_heads, head_dim,
                                           generator=g).to(dtype),
                               torch.randn(blocks + 1, block_size, kv_heads, head_dim,
                                           generator=g).to(dtype))
                              for _ in range(args.layers)]
                    query = torch.randn(args.chunk, heads, head_dim, generator=g)
                    out = torch.empty_like(query)
                    table = torch.randperm(blocks + 1, generator=g)[:blocks].to(torch.int32)
                    table = table.view(1, blocks)
                    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
                    query_start = torch.tensor([0, args.chunk], dtype=torch.int32)
                    times: list[list[float]] = [[] for _ in PATHS]
                    for rep in range(args.reps + 1):  # the first round warms up
                        for i, (_, amx, bf16) in enumerate(PATHS):
                            ops.set_amx(amx)
                            ops.set_bf16_attention(bf16)
                            t0 = clock()
                            for k, v in caches:
                                ops.paged_attention_prefill(out, query, k, v, table, seq_lens,
                                                            query_start, head_dim ** -0.5)
                            if rep:
                                times[i].append(clock() - t0)
                    flop = 4 * heads * head_dim * args.chunk * (prefix + (args.chunk + 1) / 2)
                    ms = [statistics.median(t) * 1e3 for t in times]
                    cells = " | ".join(f"{m:8.2f} ms {flop * args.layers / m / 1e6:6.1f} GF/s"
                                       for m in ms)
                    print(f"{threads:7d} {str(dtype)[6:]:9s} {prefix:6d} | {cells} | "
                          f"{ms[0] / ms[2]:.2f}x", flush=True)
    finally:
        cpu_ops.set_amx(cpu_ops.amx_requested())
        cpu_ops.set_bf16_attention(cpu_ops.bf16_attention_requested())
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
