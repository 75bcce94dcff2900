"""The quantized CPU kernels (``csrc/quant_ops.cpp``) against fp32 ``F.linear`` (MKL).

For the default model's linear shapes (SmolLM2-135M: QKV 960x576 split as 576/192/192,
O 576x576, gate/up 1536x576 each, down 576x1536, the tied LM head 49152x576), at
``--rows`` rows of fp32 activations, each format's ``quant.linear`` and ``F.linear`` on
the same shape in fp32, interleaved. Reports microseconds per call, GB/s of weight bytes
read (the format's bytes for the kernel, 4 bytes a value for fp32) and GFLOP/s
(2 * M * N * K per call), beside two ceilings measured in the same run: an fp32 GEMM
(``torch.mm`` 2048^3, MKL) and the memory bandwidth of reading a 512 MB buffer.

``--decode`` also times what a batch-1 (and ``--decode-batch``) decode token costs the
kernels on the default model: the fused 30-layer stack (``cpu_ops.LlamaDecodeLayers``,
Q4_1 projections, 128 tokens of context each) plus the Q8_0 LM head.

``--attention`` times decode attention alone (the blocked AVX-512 kernel against the
portable one, ``--attention-dtypes`` caches: fp32, fp16, bf16 and the fp8 ones, E4M3 and
E5M2) beside its floor, the cache's bytes at the measured read bandwidth, at
``--decode-batch`` sequences x ``--attention-contexts`` keys; ``--kv-cache-dtype
float16`` (or ``fp8``, ...) runs ``--decode`` over that cache.

``--argmax`` also times the fused greedy LM head (``quant.argmax_linear``: the same tiles,
only each row's running argmax kept) on each path, and prints each weight's streaming
floor (its bytes at the measured read bandwidth); ``--shapes lm_head,gate,down`` keeps
only those shapes. On AMX, ``packed`` (and ``packed argmax``) is the 32-value formats'
weight decoded once into bf16 tiles (``quant.pack_amx_tiles``, as the model keeps its LM
head), beside ``packed floor``, those tiles' bytes at the read bandwidth.

``--q8`` also times Q4_0/Q4_1/Q8_0 with int8 activations (``AIOENGINE_Q8_ACTIVATIONS=1``:
VNNI dot products at 1-2 rows of Q4_0/Q4_1 and 1-8 of Q8_0), interleaved with the fp32
activations, and the decode step both ways.

On a CPU with AMX-BF16 the kernel columns are the exact fp32 path (AMX off,
``cpu_ops.set_amx(False)``) and, above 8 rows, ``amx`` (the default, bf16 tiles) and
``x3`` (``AIOENGINE_BF16_GEMM=0``: bf16 hi + lo, fp32-grade, from 17 rows); ``--decode``
times the step both ways too. ``--breakdown`` adds the fused step's time by op.

Usage: python bench/quant_kernels.py [--formats Q4_1,Q8_0] [--rows 1,8,32,64]
       [--shapes lm_head,gate,down] [--argmax]
       [--decode] [--decode-batch 1,32] [--threads N] [--clock wall|cpu] [--min-time 0.3]
       [--q8] [--breakdown] [--kv-cache-dtype float16|fp8|...] [--attention]
       [--attention-dtypes float16,fp8] [--attention-contexts 128,1024]

Times are the best of three rounds, wall-clock by default. On a machine other work
shares, an OpenMP region waits whenever one of its threads is descheduled, and a
descheduled thread's wall time counts too; ``--threads 1 --clock cpu`` gives the steady
per-core cost there (the thread's own CPU time).
Prints the CPU model and flags, then tables; writes bench/results/quant_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_kernels import cpu_ops, quant, reference  # noqa: E402
from triton_kernels.quant import QuantizedWeight  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QT = GGMLQuantizationType
#: (name, N, K) of the default model's linear layers
SHAPES = [("o_proj / q", 576, 576), ("k or v", 192, 576), ("gate or up", 1536, 576),
          ("down", 576, 1536), ("lm_head", 49152, 576)]
SCALE_OFFSETS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
                 QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and its SIMD flags of interest (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        if line.startswith("model name") and ":" in line:
            model = line.split(":", 1)[1].strip()
        if line.startswith(("flags", "Features")) and not flags:
            flags = sorted(f for f in line.split(":", 1)[1].split()
                           if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve")))
    return model, flags


def random_weight(qtype: QT, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Random blocks with small finite fp16 scales (fast to make at the LM head's size)."""
    rng = np.random.default_rng(seed)
    if qtype in (QT.F16, QT.BF16):
        dense = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        return QuantizedWeight.quantize(dense, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        d = (rng.standard_normal((rows, cols // block_size, 1)) * 1e-3).astype(np.float16)
        blocks[..., off:off + 2] = d.view(np.uint8)
    return QuantizedWeight(torch.from_numpy(blocks.reshape(rows, -1)), qtype, (rows, cols))


#: wall-clock by default; ``--clock cpu`` (one thread) counts only this thread's CPU time
CLOCK = time.perf_counter


#: ``--cold``: a buffer written between timed calls, so each call finds its weight in DRAM
#: (as the LM head does after a step's layers) rather than in this CPU's large L3
COLD_BUFFER: torch.Tensor | None = None


def time_call(fn, min_time: float) -> float:
    """Seconds per call: the best of 3 rounds, each at least ``min_time / 3`` long; with
    ``--cold`` the median of 15 calls, each after ``COLD_BUFFER`` is rewritten (untimed)."""
    fn()
    if COLD_BUFFER is not None:
        times = []
        for _ in range(15):
            COLD_BUFFER.add_(1.0)
            t0 = CLOCK()
            fn()
            times.append(CLOCK() - t0)
        return statistics.median(times)
    best = float("inf")
    for _ in range(3):
        n, t0 = 0, CLOCK()
        while True:
            fn()
            n += 1
            elapsed = CLOCK() - t0
            if elapsed >= min_time / 3:
                break
        best = min(best, elapsed / n)
    return best


def ceilings(min_time: float) -> dict:
    """fp32 GEMM GFLOP/s (MKL, 2048^3) and read bandwidth GB/s (sum of 512 MB)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out = torch.empty(2048, 2048)
    gemm = time_call(lambda: torch.mm(a, b, out=out), min_time)
    buf = torch.ones(128 * 1024 * 1024)  # 512 MB, far past the caches
    read = time_call(lambda: buf.sum(), min_time)
    return {"fp32_gemm_gflops": 2 * 2048 ** 3 / gemm / 1e9,
            "read_gbs": buf.numel() * 4 / read / 1e9}


Q8_FORMATS = (QT.Q4_0, QT.Q4_1, QT.Q8_0)
#: set in main(): whether this CPU runs the quantized GEMM on AMX
AMX = False


def bench_linears(formats: list[QT], rows: list[int], min_time: float,
                  q8: bool = False, shapes: list[str] | None = None, argmax: bool = False,
                  read_gbs: float | None = None) -> list[dict]:
    results = []
    for name, n, k in SHAPES:
        if shapes and not any(want in name for want in shapes):
            continue
        dense = torch.randn(n, k) * 0.02
        weights = {fmt: random_weight(fmt, n, k, seed=n + k) for fmt in formats}
        for m in rows:
            x = torch.randn(m, k)
            flops = 2 * m * n * k
            fp32_s = time_call(lambda x=x, dense=dense: F.linear(x, dense), min_time)
            row = {"shape": name, "N": n, "K": k, "M": m, "fp32_us": fp32_s * 1e6,
                   "fp32_gbs": n * k * 4 / fp32_s / 1e9, "fp32_gflops": flops / fp32_s / 1e9}
            for fmt, w in weights.items():
                amx = cpu_ops.set_amx(False)  # the fp32 path first
                s = time_call(lambda x=x, w=w: quant.linear(x, w), min_time)
                if AMX and m > 8:
                    cpu_ops.set_amx(True)
                    for mode, bf16 in (("amx", True), ("x3", False)):
                        if not bf16 and m <= 16:
                            continue  # the fp32-grade mode starts at 17 rows
                        cpu_ops.set_bf16_gemm(bf16)
                        sa = time_call(lambda x=x, w=w: quant.linear(x, w), min_time)
                        row[f"{fmt.name}_{mode}_us"] = sa * 1e6
                        row[f"{fmt.name}_{mode}_speedup"] = fp32_s / sa
                        if argmax and bf16:
                            sg = time_call(lambda x=x, w=w: quant.argmax_linear(x, w), min_time)
                            row[f"{fmt.name}_amx_argmax_us"] = sg * 1e6
                        tiles = quant.pack_amx_tiles(w) if bf16 else None
                        if tiles is not None:  # the weight decoded once (the model's LM head)
                            sp = time_call(lambda x=x, w=w, t=tiles: quant.linear(
                                x, w, amx_tiles=t), min_time)
                            row[f"{fmt.name}_packed_us"] = sp * 1e6
                            row[f"{fmt.name}_packed_speedup"] = fp32_s / sp
                            if argmax:
                                sg = time_call(lambda x=x, w=w, t=tiles: quant.argmax_linear(
                                    x, w, amx_tiles=t), min_time)
                                row[f"{fmt.name}_packed_argmax_us"] = sg * 1e6
                            if read_gbs:
                                row[f"{fmt.name}_packed_floor_us"] = (
                                    tiles.numel() * tiles.element_size() / (read_gbs * 1e9) * 1e6)
                        del tiles
                    cpu_ops.set_bf16_gemm(cpu_ops.bf16_gemm_requested())
                cpu_ops.set_amx(amx or cpu_ops.amx_requested())
                if argmax:  # the fused greedy head on the exact path (AMX off)
                    cpu_ops.set_amx(False)
                    sg = time_call(lambda x=x, w=w: quant.argmax_linear(x, w), min_time)
                    cpu_ops.set_amx(amx or cpu_ops.amx_requested())
                    row[f"{fmt.name}_argmax_us"] = sg * 1e6
                if read_gbs:
                    row[f"{fmt.name}_floor_us"] = w.nbytes / (read_gbs * 1e9) * 1e6
                row[f"{fmt.name}_us"] = s * 1e6
                row[f"{fmt.name}_gbs"] = w.nbytes / s / 1e9
                row[f"{fmt.name}_gflops"] = flops / s / 1e9
                row[f"{fmt.name}_speedup"] = fp32_s / s
                if q8 and fmt in Q8_FORMATS:
                    cpu_ops.set_q8_activations(True)
                    try:
                        s8 = time_call(lambda x=x, w=w: quant.linear(x, w), min_time)
                    finally:
                        cpu_ops.set_q8_activations(False)
                    row[f"{fmt.name}_q8_us"] = s8 * 1e6
                    row[f"{fmt.name}_q8_speedup_vs_fp32_act"] = s / s8
            results.append(row)
            cells = "  ".join(f"{fmt.name} {row[f'{fmt.name}_us']:8.1f} us "
                              f"{row[f'{fmt.name}_gbs']:5.1f} GB/s "
                              f"{row[f'{fmt.name}_gflops']:6.1f} GF/s "
                              f"x{row[f'{fmt.name}_speedup']:4.2f}"
                              + (f" q8 {row[f'{fmt.name}_q8_us']:8.1f} us "
                                 f"x{row[f'{fmt.name}_q8_speedup_vs_fp32_act']:4.2f}"
                                 if f"{fmt.name}_q8_us" in row else "")
                              + "".join(f" {mode} {row[f'{fmt.name}_{mode}_us']:8.1f} us "
                                        f"x{row[f'{fmt.name}_{mode}_speedup']:4.2f}"
                                        for mode in ("amx", "x3", "packed")
                                        if f"{fmt.name}_{mode}_us" in row)
                              + "".join(f" {label} {row[f'{fmt.name}_{key}_us']:8.1f} us"
                                        for label, key in (("argmax", "argmax"),
                                                           ("amx argmax", "amx_argmax"),
                                                           ("packed argmax", "packed_argmax"),
                                                           ("floor", "floor"),
                                                           ("packed floor", "packed_floor"))
                                        if f"{fmt.name}_{key}_us" in row)
                              for fmt in formats)
            print(f"{name:>11} {n:6d}x{k:<5d} M={m:<3d} fp32 {row['fp32_us']:8.1f} us "
                  f"{row['fp32_gbs']:5.1f} GB/s {row['fp32_gflops']:6.1f} GF/s | {cells}",
                  flush=True)
    return results


def bench_decode(batches: list[int], min_time: float, breakdown: bool = False,
                 kv_dtype: torch.dtype = torch.float32) -> list[dict]:
    """The default model's 30 Q4_1 layers in one fused call, plus the Q8_0 LM head;
    ``breakdown``: also the fused step's wall time by op (``set_profile``); ``kv_dtype``:
    the KV cache's element type (``--kv-cache-dtype``)."""
    hidden, inter, heads, kv_heads, head_dim, layers = 576, 1536, 9, 3, 64, 30
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    ones = torch.ones(hidden)
    spec = [(ones, ones, random_weight(QT.Q4_1, qkv_rows, hidden, 10 * i),
             None, random_weight(QT.Q4_1, hidden, heads * head_dim, 10 * i + 1),
             random_weight(QT.Q4_1, 2 * inter, hidden, 10 * i + 2),
             random_weight(QT.Q4_1, hidden, inter, 10 * i + 3)) for i in range(layers)]
    fused = cpu_ops.LlamaDecodeLayers(spec, ones, heads, kv_heads, head_dim, 1e-5)
    head = random_weight(QT.Q8_0, 49152, hidden, 7)
    layer_bytes = sum(w.nbytes for layer in spec for w in layer[2:] if w is not None)
    results = []
    for batch in batches:
        layers_s = _time_layers(fused, batch, layers, kv_heads, head_dim, hidden, min_time,
                                kv_dtype=kv_dtype)
        h = torch.randn(batch, hidden)
        head_s = time_call(lambda h=h: quant.linear(h, head), min_time)
        row = {"batch": batch, "layers_ms": layers_s * 1e3, "lm_head_ms": head_s * 1e3,
               "token_ms": (layers_s + head_s) * 1e3, "tok_s": batch / (layers_s + head_s),
               "layers_gbs": layer_bytes / layers_s / 1e9,
               "lm_head_gbs": head.nbytes / head_s / 1e9}
        if breakdown:
            row["breakdown_ms"] = _breakdown(fused, batch, layers, kv_heads, head_dim, hidden,
                                             kv_dtype=kv_dtype)
        results.append(row)
        print(f"decode batch {batch:3d}: 30 Q4_1 layers {row['layers_ms']:6.2f} ms "
              f"({row['layers_gbs']:4.1f} GB/s) + Q8_0 head {row['lm_head_ms']:6.2f} ms "
              f"({row['lm_head_gbs']:4.1f} GB/s) = {row['token_ms']:6.2f} ms a step, "
              f"{row['tok_s']:7.1f} tok/s", flush=True)
        if breakdown:
            print("  by op (ms a step): " + ", ".join(
                f"{op} {ms:.2f}" for op, ms in row["breakdown_ms"].items()), flush=True)
    return results


def _breakdown(fused, batch: int, layers: int, kv_heads: int, head_dim: int, hidden: int,
               steps: int = 20, kv_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Milliseconds a step by op of the fused step (the calling thread's CPU time inside
    the C++ call: with more than one thread, the other threads' share is not counted)."""
    impl = fused._impl
    impl.set_profile(True)
    try:
        _time_layers(fused, batch, layers, kv_heads, head_dim, hidden, min_time=0.0,
                     calls=steps, kv_dtype=kv_dtype)
        seconds = impl.op_seconds()
    finally:
        impl.set_profile(False)
    return {name: s / steps * 1e3 for name, s in zip(impl.op_names(), seconds)}


def _time_layers(fused, batch: int, layers: int, kv_heads: int, head_dim: int, hidden: int,
                 min_time: float, calls: int = 0,
                 kv_dtype: torch.dtype = torch.float32) -> float:
    """Seconds for one fused decode step of ``batch`` sequences, 128 tokens of context;
    ``calls`` > 0: just run it that many times (returns 0)."""
    context, block_size = 128, 16
    blocks_per_seq = context // block_size
    kv_cache = (torch.randn(layers, 2, batch * blocks_per_seq, block_size, kv_heads,
                            head_dim) * 0.1).to(kv_dtype)
    block_tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    slots = (block_tables[:, -1].long() * block_size + block_size - 1).contiguous()
    cos, sin = torch.ones(batch, head_dim), torch.zeros(batch, head_dim)
    residual = torch.randn(batch, hidden)

    def step():
        fused._impl.forward(residual.clone(), cos, sin, kv_cache, slots, block_tables, seq_lens,
                            head_dim ** -0.5)

    if calls:
        for _ in range(calls):
            step()
        return 0.0
    return time_call(step, min_time)


#: ``--kv-cache-dtype`` names (the server's) -> the cache's element type.
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def bench_attention(batches: list[int], min_time: float, read_gbs: float,
                    contexts: tuple[int, ...] = (128, 512),
                    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16,
                                                       torch.bfloat16)) -> list[dict]:
    """Decode attention alone (``paged_attention_decode``), the default model's shape (9
    query heads on 3 KV heads of 64, block size 16) over 30 layers' caches of
    ``batch`` sequences x ``context`` keys, one cache of each of ``dtypes`` (fp8 ones
    written as the engine writes them, saturated): the blocked kernel (AVX-512 builds)
    against the portable one, interleaved. A step reads every cached K and V once, so
    bytes / ``read_gbs`` is its floor (its FLOPs, 4 * heads * head_dim a key, are far
    below the GEMM ceiling)."""
    ops = cpu_ops.load()
    layers, heads, kv_heads, head_dim, block_size = 30, 9, 3, 64, 16
    results = []
    for batch in batches:
        for context in contexts:
            for dtype in dtypes:
                blocks = batch * -(-context // block_size)
                kv = reference.to_kv_cache_dtype(
                    torch.randn(layers, 2, blocks, block_size, kv_heads, head_dim), dtype)
                tables = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
                lens = torch.full((batch,), context, dtype=torch.int32)
                q = torch.randn(batch, heads, head_dim)
                out = torch.empty_like(q)

                def step(portable: bool, kv=kv, tables=tables, lens=lens, q=q, out=out):
                    for i in range(layers):
                        ops.paged_attention_decode(out, q, kv[i, 0], kv[i, 1], tables, lens,
                                                   head_dim ** -0.5, portable)

                blocked_s = portable_s = float("inf")
                for _ in range(2):  # interleaved
                    portable_s = min(portable_s, time_call(lambda: step(True), min_time))
                    blocked_s = min(blocked_s, time_call(lambda: step(False), min_time))
                gb = batch * context * kv_heads * head_dim * 2 * layers * kv.element_size() / 1e9
                row = {"batch": batch, "context": context, "cache": str(dtype)[6:],
                       "loadavg": os.getloadavg()[0],
                       "portable_ms": portable_s * 1e3, "blocked_ms": blocked_s * 1e3,
                       "kv_mb": gb * 1e3, "floor_ms": gb / read_gbs * 1e3,
                       "blocked_gbs": gb / blocked_s}
                results.append(row)
                print(f"attention batch {batch:3d} x {context:4d} keys, {row['cache']:>13} "
                      f"cache ({row['kv_mb']:5.0f} MB a step): portable "
                      f"{row['portable_ms']:7.2f} ms, blocked {row['blocked_ms']:7.2f} ms "
                      f"({portable_s / blocked_s:.2f}x, {row['blocked_gbs']:4.1f} GB/s); "
                      f"floor at {read_gbs:.1f} GB/s {row['floor_ms']:6.2f} ms", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="Q4_1,Q8_0")
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--decode-batch", default="1,32")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, one per core)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time (needs --threads 1), steady on a "
                             "shared machine")
    parser.add_argument("--q8", action="store_true",
                        help="also time int8 activations (Q4_0/Q4_1/Q8_0) and the decode "
                             "step with them")
    parser.add_argument("--breakdown", action="store_true",
                        help="with --decode: the fused step's time by op")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="float32",
                        help="with --decode: the KV cache's element type")
    parser.add_argument("--attention", action="store_true",
                        help="decode attention alone at --decode-batch sizes (blocked vs "
                             "portable kernel, --attention-dtypes caches) beside its "
                             "bandwidth floor")
    parser.add_argument("--attention-dtypes", default="float32,float16,bfloat16",
                        help="with --attention: the caches, --kv-cache-dtype names "
                             "(comma-separated; fp8, fp8_e5m2 too)")
    parser.add_argument("--attention-contexts", default="128,512",
                        help="with --attention: keys per sequence (comma-separated)")
    parser.add_argument("--shapes", default="",
                        help="only these of the linear shapes (comma-separated parts of their "
                             "names, e.g. lm_head,gate,down); default all")
    parser.add_argument("--argmax", action="store_true",
                        help="also time the fused greedy argmax (quant.argmax_linear: no "
                             "output written) on each path, and print each weight's "
                             "streaming floor (its bytes at the measured read bandwidth)")
    parser.add_argument("--cold", action="store_true",
                        help="every timed call after the ceilings with its data in DRAM: 1 GiB "
                             "rewritten before each (median of 15), as the LM head runs after "
                             "the layers")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            sys.exit("--clock cpu counts one thread's time: pass --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    if cpu_ops.load() is None:
        sys.exit("the C++ CPU kernels are unavailable: nothing to measure")
    model, flags = cpu_description()
    threads = torch.get_num_threads()
    print(f"CPU: {model}; {os.cpu_count()} logical CPUs, torch threads {threads}, "
          f"{args.clock} clock, load average {os.getloadavg()[0]:.1f}")
    print(f"flags: {' '.join(flags)}")
    print("quantized kernels' path: "
          f"{['scalar', 'AVX2', 'AVX-512', 'AVX-512 + AMX-BF16'][cpu_ops.load().quant_isa()]}")
    ceiling = ceilings(args.min_time)
    print(f"ceilings: fp32 GEMM (MKL 2048^3) {ceiling['fp32_gemm_gflops']:.1f} GFLOP/s, "
          f"memory read {ceiling['read_gbs']:.1f} GB/s")
    global AMX, COLD_BUFFER
    AMX = cpu_ops.load().quant_isa() == 3
    if args.cold:
        COLD_BUFFER = torch.zeros(256 * 1024 * 1024)  # 1 GiB, past the 480 MB L3 seen here
    formats = [QT[name.strip()] for name in args.formats.split(",")]
    rows = [int(r) for r in args.rows.split(",") if r]  # "": decode only
    report = {"cpu": model, "flags": flags, "threads": threads, "clock": args.clock,
              "loadavg": os.getloadavg()[0], "ceilings": ceiling, "cold": args.cold,
              "linears": bench_linears(formats, rows, args.min_time, args.q8,
                                       [n for n in args.shapes.split(",") if n], args.argmax,
                                       ceiling["read_gbs"] if args.argmax else None)}
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    if args.attention:
        report["attention"] = bench_attention(
            [int(b) for b in args.decode_batch.split(",")], args.min_time, ceiling["read_gbs"],
            tuple(int(c) for c in args.attention_contexts.split(",")),
            tuple(KV_CACHE_DTYPES[d.strip()] for d in args.attention_dtypes.split(",")))
    if args.decode:
        batches = [int(b) for b in args.decode_batch.split(",")]
        cpu_ops.set_q8_activations(False)
        amx = cpu_ops.set_amx(False)
        if AMX:
            print("fp32 path (AMX off):")
        report["decode"] = bench_decode(batches, args.min_time, args.breakdown, kv_dtype)
        if AMX:
            for mode, bf16 in (("amx", True), ("x3", False)):
                cpu_ops.set_amx(True)
                cpu_ops.set_bf16_gemm(bf16)
                print(f"AMX GEMM ({'bf16' if bf16 else 'bf16 hi + lo'}):")
                report[f"decode_{mode}"] = bench_decode(batches, args.min_time, args.breakdown,
                                                        kv_dtype)
            cpu_ops.set_bf16_gemm(cpu_ops.bf16_gemm_requested())
        cpu_ops.set_amx(amx or cpu_ops.amx_requested())
        if args.q8 and cpu_ops.set_q8_activations(True):
            print("with int8 activations:")
            try:
                report["decode_q8"] = bench_decode(batches, args.min_time, args.breakdown, kv_dtype)
            finally:
                cpu_ops.set_q8_activations(False)
    path = Path(args.out) if args.out else RESULTS_DIR / "quant_kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
