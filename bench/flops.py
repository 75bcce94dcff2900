"""The matmul FLOPs of a serving workload, and the machine's GEMM ceilings (issue 16).

Issue 16's compute share: the FLOP/s a server achieved on a workload, against a large
GEMM of the same dtype on the same threads. Only matrix products are counted (2 FLOPs
a multiply-add); norms, RoPE, activations, softmax and sampling are elementwise and
left out, as in the usual transformer FLOP accounting (Kaplan et al. 2020, "Scaling
Laws for Neural Language Models", section 2.1; the PaLM paper's appendix B adds the
attention term counted here).

For one request of ``P`` prompt tokens, ``C`` of them served from the prefix cache,
and ``O`` output tokens:

- linear layers: ``P - C + O - 1`` tokens run through every layer's projections (the
  uncached prompt, then each sampled token but the last, which is never fed back):
  ``2 x tokens x params``, with ``params`` per layer = q ``h x H*d`` + k and v
  ``h x K*d`` each + o ``H*d x h`` + the gated MLP ``3 x h x I``;
- LM head: once per sampled token, ``2 x O x V x h`` (the prompt's other positions
  need no logits);
- attention: at position ``p`` (0-based) the query sees ``p + 1`` keys (``min(p + 1,
  window)`` in a sliding-window layer); ``Q K^T`` and ``P V`` are ``2 x H x d x keys``
  each, so ``4 x H x d x keys`` per layer, summed over the positions computed
  (``C .. P + O - 2``).

``h`` hidden size, ``H``/``K`` query/key-value heads, ``d`` head dim, ``I`` MLP width,
``V`` vocabulary: all from the model's config (``aioengine.models.loader.
load_hf_config``: a GGUF file's metadata or an HF ``config.json``), never constants.
Mixture-of-experts configs are refused (their MLP FLOPs depend on routing).

Nothing here imports torch except ``gemm_ceilings``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: (dtype name, torch dtype attribute) of the GEMM ceilings
CEILING_DTYPES = (("fp32", "float32"), ("bf16", "bfloat16"))
#: square sizes of the ceiling GEMMs: the ceiling is the fastest (on the AMX machine
#: bf16 peaks at 1024^3, whose operands fit L2, and fp32 at 2048^3)
CEILING_SIZES = (1024, 2048)


@dataclass(frozen=True)
class ModelFlops:
    """A decoder-only transformer's matmul shapes, as its HF config names them.

    Attributes:
        num_layers: ``num_hidden_layers``.
        hidden_size: ``h``.
        num_heads: query heads ``H`` (``num_attention_heads``).
        num_kv_heads: key/value heads ``K`` (``num_key_value_heads``, else ``H``).
        head_dim: ``d`` (``head_dim``, else ``h // H``).
        intermediate_size: the gated MLP's width ``I``.
        vocab_size: ``V``, the LM head's rows.
        windows: per layer, the sliding window in keys, or None for full attention.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, config: Any) -> ModelFlops:
        """From an HF-style config object (attributes named as in ``config.json``).

        Raises:
            ValueError: a mixture-of-experts config, or ``layer_types`` that do not
                give one entry per layer.
        """
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if getattr(config, key, None):
                raise ValueError(f"mixture-of-experts config ({key}={getattr(config, key)}): "
                                 f"its MLP FLOPs depend on routing, not modelled")
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        window = getattr(config, "sliding_window", None)
        types = tuple(getattr(config, "layer_types", None) or ())
        if not types:  # Mistral, Phi-3: one window for every layer, where enabled
            use = getattr(config, "use_sliding_window", True) is not False
            types = ("sliding_attention" if window and use else "full_attention",) * layers
        if len(types) != layers:
            raise ValueError(f"{len(types)} layer_types for {layers} layers")
        return cls(
            num_layers=layers,
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            windows=tuple(int(window) if t == "sliding_attention" and window else None
                          for t in types),
        )

    @classmethod
    def from_model(cls, model: str) -> ModelFlops:
        """From a GGUF file's metadata or an HF folder's ``config.json``."""
        from aioengine.models.loader import load_hf_config

        return cls.from_config(load_hf_config(model))

    @property
    def params_per_layer(self) -> int:
        """Weights of one layer's linear projections (q, k, v, o, gate, up, down)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def linear_flops(self, tokens: int) -> int:
        """``tokens`` rows through every layer's projections."""
        return 2 * tokens * self.num_layers * self.params_per_layer

    def lm_head_flops(self, tokens: int) -> int:
        """``tokens`` rows of logits."""
        return 2 * tokens * self.lm_head_params

    def attention_flops(self, start: int, end: int) -> int:
        """``Q K^T`` and ``P V`` of the queries at positions ``start .. end - 1``
        (0-based; position ``p`` attends to ``p + 1`` keys, at most a layer's window)."""
        per_key = 4 * self.num_heads * self.head_dim
        return sum(per_key * keys_attended(start, end, w) for w in self.windows)

    def request_flops(self, prompt_len: int, output_len: int, cached_tokens: int = 0
                      ) -> dict[str, int]:
        """One request's FLOPs by part (``linear``, ``lm_head``, ``attention``) and
        their ``total``. ``cached_tokens``: prompt tokens the prefix cache served
        (clamped to ``prompt_len - 1``: the last prompt token always runs)."""
        if prompt_len < 1 or output_len < 0:
            raise ValueError(f"prompt_len {prompt_len} and output_len {output_len}")
        cached = max(0, min(cached_tokens, prompt_len - 1))
        end = prompt_len + max(output_len - 1, 0)  # positions computed: cached .. end - 1
        parts = {"linear": self.linear_flops(end - cached),
                 "lm_head": self.lm_head_flops(output_len),
                 "attention": self.attention_flops(cached, end)}
        parts["total"] = sum(parts.values())
        return parts


def keys_attended(start: int, end: int, window: int | None = None) -> int:
    """Sum over positions ``p`` in ``[start, end)`` of ``min(p + 1, window)``."""
    if end <= start:
        return 0
    lo, hi = start + 1, end  # the key counts p + 1 run over lo .. hi
    if window is None or hi <= window:
        return (lo + hi) * (hi - lo + 1) // 2
    if lo > window:
        return window * (hi - lo + 1)
    return (lo + window) * (window - lo + 1) // 2 + window * (hi - window)


def run_flops(model: ModelFlops, run: Mapping[str, Any]) -> dict[str, Any]:
    """The FLOPs of one load run of bench/serving.py's ``run_load`` (its
    ``"requests"`` records: ``prompt_len``, ``output_len``, ``cached_tokens``;
    completed requests only) and the GFLOP/s over its ``duration_s``. A record
    without ``cached_tokens`` (older JSON) gets the run's ``cached_prompt_tokens``
    as one prefix on its first request."""
    done = [r for r in run["requests"] if r.get("ok", True)]
    spare = 0 if any("cached_tokens" in r for r in done) else run.get("cached_prompt_tokens", 0)
    totals = {"linear": 0, "lm_head": 0, "attention": 0, "total": 0}
    for r in done:
        cached = r.get("cached_tokens", spare)
        spare = 0
        for k, v in model.request_flops(r["prompt_len"], r["output_len"], cached).items():
            totals[k] += v
    out_tokens = sum(r["output_len"] for r in done)
    return {"flops": totals, "output_tokens": out_tokens,
            "mflop_per_output_token": totals["total"] / out_tokens / 1e6 if out_tokens else 0.0,
            "gflops": totals["total"] / run["duration_s"] / 1e9 if run["duration_s"] else 0.0}


def shares(gflops: float, ceilings: Mapping[str, float]) -> dict[str, float]:
    """``gflops`` as a fraction of each ``<dtype>_gemm_gflops`` ceiling, keyed by dtype."""
    return {name: gflops / ceilings[f"{name}_gemm_gflops"] for name, _ in CEILING_DTYPES
            if ceilings.get(f"{name}_gemm_gflops")}


def gemm_ceilings(threads: int, min_time: float = 1.0,
                  sizes: Iterable[int] = CEILING_SIZES) -> dict[str, Any]:
    """The GFLOP/s of ``torch.mm`` on square matrices of each dtype of
    ``CEILING_DTYPES`` and each of ``sizes``, on ``threads`` threads (fp32: MKL;
    bf16: oneDNN, AMX or AVX512-BF16 where the CPU has them), each timed as bench/
    quant_kernels.py's ``time_call`` (best of 3 rounds of ``min_time / 3`` s).
    Returns ``<dtype>_gemm_gflops`` (the fastest size) and ``by_size``."""
    import torch

    from bench.quant_kernels import time_call

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, Any] = {"threads": threads, "by_size": {}}
    try:
        for name, attr in CEILING_DTYPES:
            dtype = getattr(torch, attr)
            best = 0.0
            for n in sizes:
                gen = torch.Generator().manual_seed(n)
                a = torch.randn(n, n, generator=gen).to(dtype)
                b = torch.randn(n, n, generator=gen).to(dtype)
                c = torch.empty(n, n, dtype=dtype)
                s = time_call(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), min_time)
                gflops = 2 * n**3 / s / 1e9
                out["by_size"][f"{name}_{n}"] = round(gflops, 1)
                best = max(best, gflops)
            out[f"{name}_gemm_gflops"] = best
    finally:
        torch.set_num_threads(before)
    return out
