"""Decode attention on a CUDA GPU: the paged Triton kernel against memory bandwidth and SDPA.

For each (batch, context) pair, every sequence has the same context length and one
new query token, and the script measures:

- ``paged_ms``: ``triton_kernels.paged_attention_decode`` over the paged cache (block
  ids shuffled, so blocks are scattered as in a serving engine), with the split-K
  (Flash-Decoding) choice it makes itself (``num_splits`` column);
- ``bw_fraction``: bytes the kernel must read (the K and V of every context token, the
  queries and the block tables) plus the output it writes, divided by ``paged_ms``,
  as a fraction of the GPU's peak memory bandwidth;
- ``sdpa_ms``: ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V
  already gathered into contiguous ``[batch, kv_heads, context, head_dim]`` tensors
  (the gather itself is not timed): the speed of a non-paged kernel;
- ``vs_sdpa``: ``sdpa_ms / paged_ms`` (above 1: the paged kernel is faster);
- ``max_err``: max |paged - SDPA| over the outputs, a correctness check.

Peak bandwidth: ``--peak-gbps`` if given, else the device's memory clock and bus
width when torch reports them, else a measured device-to-device copy.

With ``--quantized``, the dequantizing matmul instead
(``triton_kernels.quant_triton.dequant_matmul``): for each GGML format, weight shape
``N x K`` and row count ``M``, with activations in ``--dtype``:

- ``fused_ms``: the fused kernel (packed weight tiles decoded in registers, ``tl.dot``);
- ``deq_gemm_ms``: Triton ``dequantize`` into ``--dtype`` then ``F.linear`` (cuBLAS);
- ``auto``: the path ``dequant_matmul`` picks for this M;
- ``dense_ms``: ``F.linear`` on a dense weight in ``--dtype`` (what the format saves);
- ``bw_fraction``: the packed weight's bytes plus x and y over ``fused_ms``, as a
  fraction of peak memory bandwidth (the bound that matters for decode);
- ``max_err``: max |fused - F.linear on the dequantized weight| / max |reference|.

Usage: python bench/gpu_kernels.py [--batches 1,4,16,64,256] [--contexts 512,...,32768]
       [--num-heads 32 --num-kv-heads 8 --head-dim 128] [--dtype bfloat16]
       python bench/gpu_kernels.py --quantized [--formats Q4_K,Q8_0,...] [--rows 1,16,256]
       [--weight-shapes 4096x4096,14336x4096]
Prints a table; writes bench/results/kernels.json and bench/results/kernels.png
(``--quantized``: bench/results/kernels_quantized.json).
Needs a CUDA GPU; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=_int_list, default=[1, 4, 16, 64, 256])
    p.add_argument("--contexts", type=_int_list, default=[512, 2048, 8192, 32768])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="peak memory bandwidth in GB/s (default: from the device)")
    p.add_argument("--memory-fraction", type=float, default=0.7,
                   help="skip shapes whose paged cache plus its contiguous copy (2x the K/V "
                        "bytes) exceed this share of free GPU memory")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    q = p.add_argument_group("--quantized: the GGML-format dequantizing matmul")
    q.add_argument("--quantized", action="store_true",
                   help="benchmark triton_kernels.quant_triton.dequant_matmul instead")
    q.add_argument("--formats", type=lambda t: t.split(","),
                   default=["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                            "F16", "BF16"])
    q.add_argument("--rows", type=_int_list, default=[1, 4, 16, 64, 256],
                   help="M, the activation rows (tokens in the batch)")
    q.add_argument("--weight-shapes", type=_shape_list,
                   default=[(4096, 4096), (14336, 4096), (4096, 14336)],
                   help="N x K weights, comma-separated (default: Llama-3-8B's projections)")
    return p.parse_args()


def _shape_list(text: str) -> list[tuple[int, int]]:
    return [tuple(int(d) for d in item.split("x")) for item in text.split(",")]


def peak_bandwidth_gbps(device: torch.device, override: float | None) -> tuple[float, str]:
    """Peak memory bandwidth in GB/s and where the number came from."""
    if override:
        return override, "--peak-gbps"
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        # Double data rate: two transfers per clock.
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device memory clock x bus width"
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * src.numel() / (ms * 1e-3) / 1e9, "measured device-to-device copy"


def gather_contiguous(cache: torch.Tensor, block_tables: torch.Tensor,
                      context: int) -> torch.Tensor:
    """``[batch, kv_heads, context, head_dim]`` copy of each sequence's cached tokens."""
    batch, blocks_per_seq = block_tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    rows = cache[block_tables.long().flatten()].view(batch, blocks_per_seq * block_size,
                                                     kv_heads, head_dim)
    return rows[:, :context].transpose(1, 2).contiguous()


def time_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float) -> tuple[float, torch.Tensor]:
    """(ms, output) of SDPA with grouped KV heads, q ``[batch, heads, 1, head_dim]``."""
    from triton.testing import do_bench

    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        out = sdpa(q, k, v, scale=scale, enable_gqa=True)
        return do_bench(lambda: sdpa(q, k, v, scale=scale, enable_gqa=True)), out
    except TypeError:  # torch < 2.5 has no enable_gqa: repeat the KV heads instead
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return do_bench(lambda: sdpa(q, k, v, scale=scale)), sdpa(q, k, v, scale=scale)


def bench_one(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype,
              device: torch.device) -> dict:
    import triton
    from triton.testing import do_bench

    from triton_kernels import paged_attention_decode
    from triton_kernels.paged_attention_triton import _decode_num_splits

    bs, kvh, hd, nh = args.block_size, args.num_kv_heads, args.head_dim, args.num_heads
    blocks_per_seq = triton.cdiv(context, bs)
    num_blocks = batch * blocks_per_seq
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * context * kvh * hd * elem
    free, _ = torch.cuda.mem_get_info(device)
    # At most the paged cache plus as many bytes again for the gathered copies.
    if 2 * kv_bytes > args.memory_fraction * free:
        return {"batch": batch, "context": context, "skipped": "does not fit in memory"}

    key_cache = torch.randn(num_blocks, bs, kvh, hd, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(
        batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, nh, hd, dtype=dtype, device=device)
    scale = hd ** -0.5
    paged = functools.partial(paged_attention_decode, query, key_cache, value_cache,
                              block_tables, seq_lens, scale, context)
    out = paged()
    paged_ms = do_bench(paged)
    del paged
    moved = (kv_bytes + 2 * query.numel() * elem
             + block_tables.numel() * block_tables.element_size())

    # Free each half of the paged cache once copied, to fit twice the K/V bytes.
    k = gather_contiguous(key_cache, block_tables, context)
    del key_cache
    v = gather_contiguous(value_cache, block_tables, context)
    del value_cache
    sdpa_ms, expected = time_sdpa(query.view(batch, nh, 1, hd), k, v, scale)
    max_err = (out.float() - expected.view_as(out).float()).abs().max().item()
    del k, v, expected, out
    torch.cuda.empty_cache()
    return {
        "batch": batch, "context": context,
        "num_splits": _decode_num_splits(batch, kvh, context, device),
        "paged_ms": paged_ms, "sdpa_ms": sdpa_ms, "bytes_moved": moved,
        "achieved_gbps": moved / (paged_ms * 1e-3) / 1e9, "vs_sdpa": sdpa_ms / paged_ms,
        "max_abs_err_vs_sdpa": max_err,
    }


def print_table(rows: list[dict], peak_gbps: float) -> None:
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'paged ms':>9} {'GB/s':>8} "
          f"{'of peak':>8} {'sdpa ms':>9} {'vs sdpa':>8} {'max err':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>8}  skipped: {r['skipped']}")
            continue
        print(f"{r['batch']:>6} {r['context']:>8} {r['num_splits']:>6} {r['paged_ms']:>9.4f} "
              f"{r['achieved_gbps']:>8.0f} {r['achieved_gbps'] / peak_gbps:>8.1%} "
              f"{r['sdpa_ms']:>9.4f} {r['vs_sdpa']:>7.2f}x {r['max_abs_err_vs_sdpa']:>8.1e}")


def plot(rows: list[dict], peak_gbps: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "skipped" not in r]
    fig, (ax_bw, ax_sdpa) = plt.subplots(1, 2, figsize=(12, 4.5))
    for batch in sorted({r["batch"] for r in done}):
        pts = sorted((r["context"], r) for r in done if r["batch"] == batch)
        contexts = [c for c, _ in pts]
        ax_bw.plot(contexts, [r["achieved_gbps"] / peak_gbps for _, r in pts], "o-",
                   label=f"batch {batch}")
        ax_sdpa.plot(contexts, [r["vs_sdpa"] for _, r in pts], "o-", label=f"batch {batch}")
    for ax in (ax_bw, ax_sdpa):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_bw.set_ylabel("achieved / peak memory bandwidth")
    ax_bw.set_ylim(0, 1)
    ax_sdpa.set_ylabel("SDPA time / paged kernel time")
    ax_sdpa.axhline(1.0, color="gray", lw=1)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_quantized_one(qtype_name: str, m: int, n: int, k: int, dtype: torch.dtype,
                        device: torch.device) -> dict:
    """One row of the ``--quantized`` table (see the module docstring)."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from triton_kernels.quant import GGMLQuantizationType, QuantizedWeight
    from triton_kernels.quant_triton import (DEQUANT_THEN_GEMM_MIN_M, dequant_matmul,
                                             random_weight)

    qtype = GGMLQuantizationType[qtype_name]
    data = random_weight(qtype, n, k).to(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    fused = functools.partial(dequant_matmul, x, data, qtype, (n, k), method="fused")
    two_step = functools.partial(dequant_matmul, x, data, qtype, (n, k), method="dequantize")
    dense = QuantizedWeight(data, qtype, (n, k)).dequantize(dtype)
    out = fused()
    expected = F.linear(x.float(), dense.float())
    fused_ms, deq_gemm_ms = do_bench(fused), do_bench(two_step)
    dense_ms = do_bench(functools.partial(F.linear, x, dense))
    elem = torch.finfo(dtype).bits // 8
    moved = data.numel() + (m * k + m * n) * elem
    return {
        "format": qtype_name, "m": m, "n": n, "k": k, "weight_bytes": data.numel(),
        "fused_ms": fused_ms, "deq_gemm_ms": deq_gemm_ms, "dense_ms": dense_ms,
        "auto": "dequantize" if m >= DEQUANT_THEN_GEMM_MIN_M else "fused",
        "fused_gbps": moved / (fused_ms * 1e-3) / 1e9,
        "max_rel_err": ((out.float() - expected).abs().max()
                        / expected.abs().max().clamp_min(1e-30)).item(),
    }


def print_quantized_table(rows: list[dict], peak_gbps: float) -> None:
    print(f"{'format':>6} {'M':>5} {'N x K':>12} {'fused ms':>9} {'GB/s':>7} {'of peak':>8} "
          f"{'deq+gemm':>9} {'dense ms':>9} {'auto':>10} {'max err':>8}")
    for r in rows:
        print(f"{r['format']:>6} {r['m']:>5} {str(r['n']) + 'x' + str(r['k']):>12} "
              f"{r['fused_ms']:>9.4f} {r['fused_gbps']:>7.0f} "
              f"{r['fused_gbps'] / peak_gbps:>8.1%} {r['deq_gemm_ms']:>9.4f} "
              f"{r['dense_ms']:>9.4f} {r['auto']:>10} {r['max_rel_err']:>8.1e}")


def main_quantized(args: argparse.Namespace, device: torch.device, peak_gbps: float,
                   peak_source: str) -> None:
    import triton

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device)
    print(f"{name}: peak {peak_gbps:.0f} GB/s ({peak_source}); dequant_matmul, x {args.dtype}")
    rows = [bench_quantized_one(fmt, m, n, k, dtype, device) for fmt in args.formats
            for n, k in args.weight_shapes for m in args.rows]
    print_quantized_table(rows, peak_gbps)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": name, "peak_gbps": peak_gbps, "peak_source": peak_source,
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": args.dtype, "rows": rows,
    }
    path = args.out / "kernels_quantized.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        what = ("the quantized Triton matmul" if args.quantized
                else "the Triton decode kernel")
        sys.exit(f"bench/gpu_kernels.py measures {what} and needs a CUDA GPU; "
                 "torch.cuda.is_available() is False on this machine.")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    peak_gbps, peak_source = peak_bandwidth_gbps(device, args.peak_gbps)
    if args.quantized:
        main_quantized(args, device, peak_gbps, peak_source)
        return
    name = torch.cuda.get_device_name(device)
    print(f"{name}: peak {peak_gbps:.0f} GB/s ({peak_source}); heads {args.num_heads}/"
          f"{args.num_kv_heads} kv, head_dim {args.head_dim}, block {args.block_size}, "
          f"{args.dtype}")
    rows = [bench_one(b, c, args, dtype, device) for b in args.batches for c in args.contexts]
    print_table(rows, peak_gbps)

    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    report = {
        "device": name, "peak_gbps": peak_gbps, "peak_source": peak_source,
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "config": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads,
                   "head_dim": args.head_dim, "block_size": args.block_size,
                   "dtype": args.dtype},
        "rows": rows,
    }
    (args.out / "kernels.json").write_text(json.dumps(report, indent=2))
    plot(rows, peak_gbps, f"paged decode attention, {name}, {args.dtype}",
         args.out / "kernels.png")
    print(f"wrote {args.out / 'kernels.json'} and {args.out / 'kernels.png'}")


if __name__ == "__main__":
    main()
