"""Decode speed of a Qwen3-shaped and a Gemma 3-shaped model of the default model's
size (SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 KV heads, head_dim 64, MLP 1536,
vocabulary 49152), random weights, fp32, ours (``LLM``, in-process) against HF
transformers ``generate`` on the same weights, one run each.

- batch-1 decode tok/s: one prompt, ``--tokens`` greedy tokens, after the first;
- 8-stream throughput: 8 prompts of equal length decoded together, output tokens / wall s.

Both families' decode steps run the fused C++ decode step (``cpu_ops.LlamaDecodeLayers``
with Q/K norms; Gemma's sandwich norms, GeGLU, windows and per-layer RoPE: see
docs/models.md); prefill steps run the Python layer loop.

    python bench/families.py [--tokens 64] [--out bench/results/families.json]

Prints the CPU model and flags and the load average; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench.baseline_hf import hf_decode_batch1  # noqa: E402
from bench.common import environment, loadavg, write_results  # noqa: E402
from bench.quant_kernels import cpu_description  # noqa: E402

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             max_position_embeddings=2048, rms_norm_eps=1e-5, vocab_size=49152)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=64, sliding_window=512)),
}


def build(name: str, folder: Path, tokenizer):
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra = FAMILIES[name]
    config = getattr(transformers, cls)(**SHAPE | extra, bos_token_id=tokenizer.bos_token_id,
                                        eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model


def ours(folder: Path, prompts: list[list[int]], tokens: int) -> dict:
    from aioengine import LLM, SamplingParams

    llm = LLM(str(folder), executor="inproc")
    try:
        def timed(batch, n):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - t0

        timed(prompts[:1], 4)  # warm-up
        first, full = timed(prompts[:1], 1), timed(prompts[:1], tokens)
        wall8 = timed(prompts, tokens)
    finally:
        llm.shutdown()
    return {"batch1_decode_tok_s": (tokens - 1) / (full - first),
            "streams8_tok_s": len(prompts) * tokens / wall8}


def hf(model, prompts: list[list[int]], tokens: int) -> dict:
    batch1 = hf_decode_batch1(model, prompts[0], tokens)["decode_tokens_per_s"]
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                   min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return {"batch1_decode_tok_s": batch1,
            "streams8_tok_s": len(prompts) * tokens / (time.perf_counter() - t0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from aioengine.config import default_model_path
    from aioengine.models.loader import load_tokenizer

    model_name, flags = cpu_description()
    print(f"CPU: {model_name}; flags: {' '.join(flags)}; load {loadavg()}")
    tokenizer = load_tokenizer(default_model_path())
    text = "The quick brown fox jumps over the lazy dog. " * 3
    base = tokenizer.encode(text, add_special_tokens=False)[:32]
    prompts = [base[i:] + base[:i] for i in range(8)]  # 8 distinct prompts, 32 tokens each
    report = {"env": environment(torch.get_num_threads(), "float32"), "tokens": args.tokens,
              "results": {}}
    print("| model | batch-1 decode tok/s ours | HF | ratio | 8 streams tok/s ours | HF | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            model = build(name, Path(tmp), tokenizer)
            a = ours(Path(tmp), prompts, args.tokens)
            b = hf(model, prompts, args.tokens)
        report["results"][name] = {"ours": a, "hf": b}
        print(f"| {name} | {a['batch1_decode_tok_s']:.1f} | {b['batch1_decode_tok_s']:.1f} | "
              f"{a['batch1_decode_tok_s'] / b['batch1_decode_tok_s']:.2f}x | "
              f"{a['streams8_tok_s']:.1f} | {b['streams8_tok_s']:.1f} | "
              f"{a['streams8_tok_s'] / b['streams8_tok_s']:.2f}x |", flush=True)
    report["loadavg_end"] = loadavg()
    print(f"load {loadavg()}; wrote {write_results(args.out, 'families.json', report)}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
