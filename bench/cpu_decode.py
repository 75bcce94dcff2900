"""Where a CPU decode step's time goes, and what the fused C++ path saves.

On the default model, in one process, alternating the two sides of each comparison:

1. ``matmuls``: every linear layer of one decode step (30 layers x QKV, O, gate/up,
   down, then the LM head) through ``F.linear`` (MKL) on the weights in fp32 and
   through the model's ``quant.linear`` on the weights as stored (the skinny fp32
   kernel up to 16 rows; the quantized kernels for a GGUF file), at ``--rows`` rows
   each. Outputs are preallocated for ``F.linear`` too (``torch.mm(out=)``), so only
   the matmuls count.
2. ``cold_op_us``: a bare ``mul`` on a 3,072-float tensor right after another ``mul``
   and right after a weight-streaming matmul: the cost the Python layer loop pays
   between every two matmuls.
3. ``step``: the model's forward + LM head + argmax for one decode token over the
   paged cache, through the fused C++ layers (``cpu_ops.LlamaDecodeLayers``) and
   through the Python layer loop (``decode_layers`` off), at ``--batch`` sequences.

Usage: python bench/cpu_decode.py [--rows 1,2,4,8,16] [--batch 1] [--repeats 30]
Prints a table; writes bench/results/cpu_decode.json and bench/results/cpu_decode.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the worker runs (worker.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioengine.config import EngineConfig  # noqa: E402
from aioengine.models.llama import AttentionMetadata  # noqa: E402
from aioengine.worker.model_runner import ModelRunner  # noqa: E402
from triton_kernels import cpu_ops, quant  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def interleaved(fns: dict, repeats: int, rounds: int = 3) -> dict[str, float]:
    """Best-of-``rounds`` median per function, the functions alternating each round."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best.get(name, float("inf")), median_ms(fn, repeats))
    return best


def _dense(weight) -> torch.Tensor:
    """A linear's weight as fp32 ``[N, K]``: quantized weights (and tuples of parts)
    dequantized, so MKL runs the same shape in fp32."""
    if isinstance(weight, tuple):
        return torch.cat([_dense(part) for part in weight])
    if isinstance(weight, quant.QuantizedWeight):
        return weight.dequantize(torch.float32)
    return weight


def step_matmuls(model, rows: int):
    """Two callables running every linear of a step: F.linear (MKL) on the fp32 weights
    and the model's own ``quant.linear`` on its weights as stored (the skinny fp32
    kernel for dense ones, the quantized kernels for GGUF formats)."""
    weights = []
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weights.append(layer[name])
    weights.append(model.lm_head)
    dense = [_dense(w) for w in weights]
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in dense}}
    outs = [torch.empty(rows, w.shape[0]) for w in dense]

    def mkl():
        for w, out in zip(dense, outs):
            torch.mm(xs[w.shape[1]], w.t(), out=out)

    def skinny():
        for w, d in zip(weights, dense):
            quant.linear(xs[d.shape[1]], w)

    return mkl, skinny


def cold_op_us(model, repeats: int) -> dict[str, float]:
    g = torch.randn(1, 3072)
    w = _dense(model.layers[0]["gate_up_proj"])
    x = torch.randn(1, w.shape[1])
    result = {}
    befores = (("after_mul", lambda: g.mul(2.0)), ("after_matmul", lambda: F.linear(x, w)))
    for label, before in befores:
        times = []
        for _ in range(repeats):
            before()
            t0 = time.perf_counter()
            g.mul(2.0)
            times.append(time.perf_counter() - t0)
        result[label] = 1e6 * statistics.median(times)
    return result


def decode_step(runner: ModelRunner, batch: int, context: int):
    """A forward + LM head + argmax of one token for ``batch`` sequences of ``context``
    tokens (their K/V are whatever the cache holds: the timing does not depend on it)."""
    model, bs = runner.model, runner.block_size
    blocks_per_seq = -(-context // bs)
    assert batch * blocks_per_seq <= runner.num_blocks, "cache too small for --batch/--context"
    block_tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    slots = block_tables[:, -1].long() * bs + (context - 1) % bs
    attn = AttentionMetadata(slot_mapping=slots, block_tables=block_tables,
                             cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                             seq_lens=seq_lens, max_seqlen_q=1, max_seqlen_k=context)
    input_ids = torch.randint(0, model.arch.vocab_size, (batch,))
    positions = torch.full((batch,), context - 1)

    def step():
        hidden = model.forward(input_ids, positions, runner.kv_cache, attn)
        return model.compute_logits(hidden).argmax(-1)

    return step


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r["rows"] for r in report["matmuls"]]
    ax1.plot(rows, [r["mkl_ms"] for r in report["matmuls"]], "o-", label="F.linear (MKL)")
    ax1.plot(rows, [r["skinny_ms"] for r in report["matmuls"]], "o-",
             label="the model's linear (as stored)")
    ax1.set_xlabel("rows per linear (decode batch)")
    ax1.set_ylabel("ms for all of a step's linears")
    ax1.set_title("A decode step's matmuls, default model")
    ax1.legend()
    step = report["step"]
    ax2.bar(["Python layer loop", "fused C++ layers"], [step["python_ms"], step["fused_ms"]],
            color=["tab:gray", "tab:blue"])
    ax2.axhline(report["matmuls"][0]["mkl_ms"], color="k", ls="--", lw=1,
                label="its matmuls alone (MKL)")
    ax2.set_ylabel("ms per step (forward + LM head + argmax)")
    ax2.set_title(f"Decode step, batch {step['batch']}, context {step['context']}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model path (default: the default GGUF)")
    p.add_argument("--rows", type=_int_list, default=[1, 2, 4, 8, 16])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    if cpu_ops.load() is None:
        sys.exit("the C++ CPU kernels are unavailable here (see the log above)")
    runner = ModelRunner(EngineConfig.from_kwargs(model=args.model, dtype="float32"))
    model = runner.model
    if model.decode_layers is None:
        sys.exit("the fused decode layers are unavailable for this model")
    report = {"model": args.model or "default", "threads": torch.get_num_threads(),
              "loadavg_before": os.getloadavg(), "matmuls": []}
    for rows in tqdm(args.rows, desc="matmuls"):
        mkl, skinny = step_matmuls(model, rows)
        t = interleaved({"mkl": mkl, "skinny": skinny}, args.repeats)
        report["matmuls"].append({"rows": rows, "mkl_ms": t["mkl"], "skinny_ms": t["skinny"]})
    report["cold_op_us"] = cold_op_us(model, 200)
    step = decode_step(runner, args.batch, args.context)
    fused = model.decode_layers

    def python_step():
        model.decode_layers = None
        try:
            return step()
        finally:
            model.decode_layers = fused

    if not torch.equal(step(), python_step()):
        print("note: the two paths picked different tokens (random input; near-ties happen)")
    t = interleaved({"fused": step, "python": python_step}, args.repeats)
    report["step"] = {"batch": args.batch, "context": args.context, "fused_ms": t["fused"],
                      "python_ms": t["python"]}
    report["loadavg_after"] = os.getloadavg()

    print(f"\n{'rows':>5} {'F.linear ms':>12} {'as-stored ms':>18} {'ratio':>6}")
    for r in report["matmuls"]:
        print(f"{r['rows']:>5} {r['mkl_ms']:>12.1f} {r['skinny_ms']:>18.1f} "
              f"{r['mkl_ms'] / r['skinny_ms']:>6.2f}")
    c = report["cold_op_us"]
    print(f"\na 3,072-float mul: {c['after_mul']:.1f} us after a mul, "
          f"{c['after_matmul']:.1f} us after a matmul")
    s = report["step"]
    print(f"decode step, batch {s['batch']}, context {s['context']}: fused {s['fused_ms']:.1f} ms, "
          f"Python loop {s['python_ms']:.1f} ms ({s['python_ms'] / s['fused_ms']:.2f}x); "
          f"load {report['loadavg_before'][0]:.2f} -> {report['loadavg_after'][0]:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_decode.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "cpu_decode.png")
    print(f"wrote {args.out / 'cpu_decode.json'} and cpu_decode.png")


if __name__ == "__main__":
    main()
