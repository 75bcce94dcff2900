"""One model step that mixes decode rows and a prompt chunk, fused C++ layers vs the Python
layer loop, in one process on the default model (SmolLM2-135M Q4_1 GGUF, fp32 activations).

What chunked prefill's ITL cap (``--chunked-prefill-itl-ratio``) trades: a step with
``--decodes`` decoding rows at ``--contexts`` tokens of context each, plus a new prompt's
chunk of ``--prompt-tokens`` tokens (0: decode only), its first chunk or, with
``--prompt-prefix`` N, the chunk after N cached tokens of the prompt (a later chunk of a
long prompt: what the cap's floor of one block carries, and its attention over the prefix
is most of what the step adds). Each step runs twice, interleaved: ``fused``
(``cpu_ops.LlamaDecodeLayers``, which takes prompt chunks: ``csrc/attention.h``
``PrefillAttention``) and ``python`` (the model's Python layer loop, which every step with
a prompt chunk ran before). Also the prefill-only step of one ``--prompt-len``-token prompt
(its TTFT's model part). A step's time is the forward plus the LM head over the rows that
sample (the decode rows; the prompt's last row when the step ends the prompt). Median of
``--reps`` after a warm-up; prints the load average. ``--kv-cache-dtype``: the cache's
dtype (the server's ``auto`` is the activations', fp32 here); ``--breakdown``: the fused
step's time by op too (the calling thread's CPU time: with ``--threads 1`` the whole step).

Usage: python bench/mixed_step.py [--decodes 32] [--contexts 150,600]
       [--prompt-tokens 0,16,64,256] [--prompt-prefix 0] [--prompt-len 512] [--reps 7]
       [--threads 2] [--clock wall|cpu] [--kv-cache-dtype float32] [--breakdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine


def load_model(threads: int):
    from aioengine.config import default_model_path
    from aioengine.models import registry
    from aioengine.models.decoder import DecoderArch
    from aioengine.models.loader import load_hf_config, load_weights
    from triton_kernels import cpu_ops

    torch.set_num_threads(threads)
    path = default_model_path()
    config = load_hf_config(path)
    arch = DecoderArch.from_hf_config(config)
    weights = load_weights(path, config, torch.float32, "none")
    cpu_ops.load()
    model = registry.model_class(registry.family_of_config(config))(arch, weights,
                                                                    torch.float32, 4096)
    assert model.decode_layers is not None, "the fused C++ layers are not available"
    return model


def make_step(model, decodes: int, context: int, prompt: int, block_size: int = 16,
              prefix: int = 0, kv_dtype: torch.dtype = torch.float32):
    """Inputs of one step: ``decodes`` rows at position ``context`` (``context`` tokens
    cached), then ``prompt`` tokens of a new prompt from position ``prefix`` (``prefix``
    tokens of it cached). Returns (input_ids, positions, kv_cache, attn, sampled rows)."""
    from aioengine.models.layers.attention import AttentionMetadata

    a = model.arch
    per_seq = -(-(context + 1) // block_size)
    prompt_blocks = -(-(prefix + prompt) // block_size) if prompt else 0
    num_blocks = decodes * per_seq + prompt_blocks + 1
    g = torch.Generator().manual_seed(0)
    kv_cache = 0.5 * torch.randn(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads,
                                 a.head_dim, generator=g).to(kv_dtype)
    width = max(per_seq, prompt_blocks, 1)
    tables = torch.zeros(decodes + (prompt > 0), width, dtype=torch.int32)
    slots, positions, q_lens, seq_lens = [], [], [], []
    for i in range(decodes):
        tables[i, :per_seq] = torch.arange(i * per_seq, (i + 1) * per_seq)
        slots.append(int(tables[i, context // block_size]) * block_size + context % block_size)
        positions.append(context)
        q_lens.append(1)
        seq_lens.append(context + 1)
    if prompt:
        first = decodes * per_seq
        tables[decodes, :prompt_blocks] = torch.arange(first, first + prompt_blocks)
        slots += [first * block_size + t for t in range(prefix, prefix + prompt)]
        positions += list(range(prefix, prefix + prompt))
        q_lens.append(prompt)
        seq_lens.append(prefix + prompt)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    attn = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    input_ids = torch.randint(0, a.vocab_size, (len(slots),), generator=g)
    sampled = torch.arange(decodes) if decodes else torch.tensor([len(slots) - 1])
    return input_ids, torch.tensor(positions), kv_cache, attn, sampled


def time_steps(model, inputs, reps: int, clock=time.perf_counter) -> tuple[float, float]:
    """Median milliseconds of forward + LM head on the sampled rows: the Python layer loop
    and the fused layers, alternating step by step (a burst of other work on a shared
    machine then hits both alike); the first step of each is a warm-up."""
    input_ids, positions, kv_cache, attn, sampled = inputs
    layers = model.decode_layers
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(reps + 1):
            for fused in (False, True):
                model.decode_layers = layers if fused else None
                t0 = clock()
                hidden = model.forward(input_ids, positions, kv_cache, attn)
                model.compute_logits(hidden[sampled])
                times[fused].append(clock() - t0)
    finally:
        model.decode_layers = layers
    return (statistics.median(times[False][1:]) * 1e3, statistics.median(times[True][1:]) * 1e3)


def breakdown(model, inputs, reps: int) -> str:
    """The fused step's milliseconds by op (``set_profile``: the calling thread's CPU time
    inside the C++ call), mean of ``reps`` steps."""
    input_ids, positions, kv_cache, attn, _sampled = inputs
    impl = model.decode_layers._impl
    impl.set_profile(True)
    try:
        for _ in range(reps):
            model.forward(input_ids, positions, kv_cache, attn)
        seconds = impl.op_seconds()
    finally:
        impl.set_profile(False)
    return " ".join(f"{name} {s / reps * 1e3:.2f}" for name, s in zip(impl.op_names(), seconds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decodes", type=int, default=32)
    p.add_argument("--contexts", default="150,600")
    p.add_argument("--prompt-tokens", default="0,16,64,256")
    p.add_argument("--prompt-prefix", type=int, default=0,
                   help="cached tokens of the prompt before its chunk")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the calling thread's CPU time (steady on a shared machine; "
                        "with --threads 1 it is the whole cost)")
    p.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16"],
                   default="float32")
    p.add_argument("--breakdown", action="store_true",
                   help="also the fused step's time by op")
    args = p.parse_args()
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    model = load_model(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    print(f"{args.threads} threads, {args.clock} clock, {args.kv_cache_dtype} cache, prompt "
          f"prefix {args.prompt_prefix}, load average {os.getloadavg()[0]:.2f}", flush=True)
    print("decodes context prompt |  python ms |  fused ms | python/fused")
    for context in (int(c) for c in args.contexts.split(",")):
        for prompt in (int(n) for n in args.prompt_tokens.split(",")):
            inputs = make_step(model, args.decodes, context, prompt,
                               prefix=args.prompt_prefix if prompt else 0, kv_dtype=kv_dtype)
            python, fused = time_steps(model, inputs, args.reps, clock)
            print(f"{args.decodes:7d} {context:7d} {prompt:6d} | {python:10.1f} | {fused:9.1f} "
                  f"| {python / fused:5.2f}x", flush=True)
            if args.breakdown:
                print(f"    fused by op (ms): {breakdown(model, inputs, args.reps)}", flush=True)
    inputs = make_step(model, 0, 0, args.prompt_len, kv_dtype=kv_dtype)
    python, fused = time_steps(model, inputs, args.reps, clock)
    print(f"prefill-only step, {args.prompt_len}-token prompt: python {python:.1f} ms, "
          f"fused {fused:.1f} ms ({python / fused:.2f}x)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
