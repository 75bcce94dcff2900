"""The matmul FLOPs and the memory traffic of a serving workload, and the machine's
ceilings (issue 16).

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

Roofline (Williams, Waterman and Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 52(4), 2009): a step cannot take less than
``max(FLOPs / peak FLOP/s, bytes / read bandwidth)``. The bytes a step must move
(``step_work``), each counted once, as an ideal kernel would:

- weights: every tensor of the file once per step, in its stored format (``WeightBytes``:
  a GGUF file's tensor sizes, quantized blocks with their scales), the LM head only when
  a row of the step samples; an untied token embedding only its looked-up rows;
- KV cache read: per sequence of the step, the distinct keys its queries attend to (a
  decode row at position ``p``: ``p + 1`` keys, ``min(p + 1, window)`` in a sliding
  window layer), ``2 x K x d`` elements of the cache dtype per key and layer;
- KV written: ``2 x K x d`` elements per token computed and layer.

Activations and logits are left out (they stay in cache at these sizes). A workload's
ceiling (``workload_roofline``) sums that bound over the steps of an ideal lock-step
schedule of its requests: ``c`` streams run their requests in waves of ``c``, one step
prefills a wave's prompts, then one step per further output token decodes every member.

Nothing here imports torch except ``gemm_ceilings`` and ``read_bandwidth``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: (dtype name, torch dtype attribute) of the GEMM ceilings
CEILING_DTYPES = (("fp32", "float32"), ("bf16", "bfloat16"))
#: square sizes of the ceiling GEMMs: the ceiling is the fastest (on the AMX machine
#: bf16 peaks at 1024^3, whose operands fit L2, and fp32 at 2048^3)
CEILING_SIZES = (1024, 2048)
#: tensor names of the token embedding and of an untied LM head (GGUF's, then HF's)
EMBEDDING_NAMES = ("token_embd.weight", "model.embed_tokens.weight")
LM_HEAD_NAMES = ("output.weight", "lm_head.weight")
#: bytes per element of the KV cache dtypes (aioengine's ``--kv-cache-dtype`` names)
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: the read-bandwidth buffer: far past any last-level cache
BANDWIDTH_BYTES = 4 * 10**9


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

    def kv_bytes_per_key(self, elem_bytes: int) -> int:
        """One token's K and V in one layer: ``2 x K x d`` elements of ``elem_bytes``."""
        return 2 * self.num_kv_heads * self.head_dim * elem_bytes

    def kv_read_bytes(self, start: int, end: int, elem_bytes: int) -> int:
        """The cache one sequence's queries at positions ``start .. end - 1`` read, every
        key once (``keys_read``), summed over the layers (each at its own window)."""
        return self.kv_bytes_per_key(elem_bytes) * sum(keys_read(start, end, w)
                                                       for w in self.windows)

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


def keys_read(start: int, end: int, window: int | None = None) -> int:
    """The distinct keys that the queries at positions ``[start, end)`` attend to: keys
    ``0 .. end - 1``, from ``start + 1 - window`` on in a sliding-window layer."""
    if end <= start:
        return 0
    return end - (max(0, start + 1 - window) if window else 0)


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights as stored, in bytes (a GGUF file: quantized blocks with their
    scales, exactly what a kernel streams from memory).

    Attributes:
        total: every tensor of the file.
        embedding: the token embedding (``token_embd.weight``).
        embedding_row: one row of it (``embedding / vocab_size``).
        lm_head: the LM head: ``output.weight``, or the embedding when tied.
        tied: no separate LM head; the embedding is read as the LM head.
    """

    total: int
    embedding: int
    embedding_row: int
    lm_head: int
    tied: bool

    @classmethod
    def from_sizes(cls, nbytes: Mapping[str, int], vocab_size: int) -> WeightBytes:
        """From each tensor's size in bytes, by name (GGUF or HF names).

        Raises:
            ValueError: no token embedding among the names.
        """
        emb = next((nbytes[n] for n in EMBEDDING_NAMES if n in nbytes), None)
        if emb is None:
            raise ValueError(f"no token embedding ({' or '.join(EMBEDDING_NAMES)})")
        head = next((nbytes[n] for n in LM_HEAD_NAMES if n in nbytes), None)
        return cls(total=sum(nbytes.values()), embedding=emb, embedding_row=emb // vocab_size,
                   lm_head=emb if head is None else head, tied=head is None)

    @classmethod
    def from_gguf(cls, path: str) -> WeightBytes:
        """From a GGUF file's tensor table (``aioengine.models.gguf_file``)."""
        from aioengine.models.gguf_file import GGUFFile

        tensors = GGUFFile.read(path).tensors
        emb = next((tensors[n] for n in EMBEDDING_NAMES if n in tensors), None)
        vocab = emb.shape[0] if emb is not None else 1
        return cls.from_sizes({n: t.nbytes for n, t in tensors.items()}, vocab)

    @property
    def layers(self) -> int:
        """Everything but the embedding and the LM head: projections and norms."""
        return self.total - self.embedding - (0 if self.tied else self.lm_head)

    def step_bytes(self, tokens: int, logits_rows: int) -> int:
        """Weights a step of ``tokens`` rows, ``logits_rows`` of which sample, reads:
        every layer once, the LM head once if any row samples, and the looked-up
        embedding rows unless the tied LM head is read whole anyway."""
        out = self.layers + (self.lm_head if logits_rows else 0)
        if not (self.tied and logits_rows):
            out += min(tokens, self.embedding // max(self.embedding_row, 1)) * self.embedding_row
        return out

    @property
    def decode_bytes(self) -> int:
        """A batch-1 decode step's weights: ``step_bytes(1, 1)``."""
        return self.step_bytes(1, 1)


@dataclass(frozen=True)
class StepWork:
    """What one model step computes and moves.

    Attributes:
        rows: tokens computed (rows of every projection's GEMM).
        flops: ``linear``, ``lm_head``, ``attention`` and their ``total``.
        bytes: ``weights``, ``kv_read``, ``kv_write`` and their ``total``.
    """

    rows: int
    flops: dict[str, int]
    bytes: dict[str, int]

    def seconds(self, peak_gflops: float, read_gbs: float) -> tuple[float, str]:
        """The roofline bound on this step's time, ``max(FLOPs / peak, bytes /
        bandwidth)`` in seconds, and which of ``"compute"``/``"memory"`` it is."""
        compute = self.flops["total"] / (peak_gflops * 1e9)
        memory = self.bytes["total"] / (read_gbs * 1e9)
        return (compute, "compute") if compute > memory else (memory, "memory")


def step_work(model: ModelFlops, weights: WeightBytes, kv_elem_bytes: int,
              seqs: Iterable[tuple[int, int, bool]]) -> StepWork:
    """One step's FLOPs and bytes. ``seqs``: per sequence of the step, ``(start, end,
    samples)``: it computes positions ``start .. end - 1`` (a decode row: ``end = start
    + 1``) and, if ``samples``, one row of logits. ``kv_elem_bytes``: bytes per element
    of the KV cache (``KV_DTYPE_BYTES``)."""
    rows = logits = attn = kv_read = 0
    for start, end, samples in seqs:
        rows += end - start
        logits += bool(samples)
        attn += model.attention_flops(start, end)
        kv_read += model.kv_read_bytes(start, end, kv_elem_bytes)
    flops = {"linear": model.linear_flops(rows), "lm_head": model.lm_head_flops(logits),
             "attention": attn}
    flops["total"] = sum(flops.values())
    nbytes = {"weights": weights.step_bytes(rows, logits), "kv_read": kv_read,
              "kv_write": rows * model.num_layers * model.kv_bytes_per_key(kv_elem_bytes)}
    nbytes["total"] = sum(nbytes.values())
    return StepWork(rows, flops, nbytes)


def workload_steps(requests: Sequence[Mapping[str, Any]], concurrency: int
                   ) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """The steps of an ideal lock-step schedule of ``requests`` (records with
    ``prompt_len``, ``output_len``, optional ``cached_tokens`` and ``start_s``;
    completed ones only) on ``concurrency`` streams, each as ``(kind, seqs)``, ``seqs``
    as ``step_work`` takes them: in start order, waves of ``concurrency`` requests; per
    wave one ``"prefill"`` step computes every member's uncached prompt and samples its
    first token, then ``"decode"`` step ``k`` (1 ..) feeds back token ``k`` of each
    member with more than ``k`` output tokens."""
    done = sorted((r for r in requests if r.get("ok", True)), key=lambda r: r.get("start_s", 0))
    steps: list[tuple[str, list[tuple[int, int, bool]]]] = []
    for w in range(0, len(done), max(concurrency, 1)):
        wave = done[w:w + concurrency]
        steps.append(("prefill", [(max(0, min(r.get("cached_tokens", 0), r["prompt_len"] - 1)),
                                   r["prompt_len"], r["output_len"] > 0) for r in wave]))
        for k in range(1, max(r["output_len"] for r in wave)):
            steps.append(("decode", [(r["prompt_len"] + k - 1, r["prompt_len"] + k, True)
                                     for r in wave if r["output_len"] > k]))
    return steps


def workload_roofline(model: ModelFlops, weights: WeightBytes, kv_elem_bytes: int,
                      requests: Sequence[Mapping[str, Any]], concurrency: int,
                      peak_gflops: Callable[[int], float], read_gbs: float) -> dict[str, Any]:
    """The roofline ceiling of a load run: the output tokens of ``requests`` over the
    sum, over ``workload_steps``, of each step's bound ``max(FLOPs / peak_gflops(rows),
    bytes / read_gbs)`` (``peak_gflops``: GFLOP/s of the GEMM that a step of ``rows``
    rows runs; ``read_gbs``: GB/s).

    Returns ``tokens_per_s`` (the ceiling), ``seconds``, ``steps``, the seconds spent
    in memory- and in compute-bound steps (``memory_bound_s``, ``compute_bound_s``) and
    ``bound`` (the larger), the prefill steps' seconds (``prefill_s``), and
    ``decode_step``: the mean of the widest decode steps (every wave member decoding)
    with its ``rows``, ``flops``, ``bytes``, ``compute_ms``, ``memory_ms``, ``bound``
    and ``ms`` (the larger); None without decode steps.
    """
    steps = workload_steps(requests, concurrency)
    spent = {"memory": 0.0, "compute": 0.0}
    prefill_s = 0.0
    decode: list[StepWork] = []
    for kind, seqs in steps:
        work = step_work(model, weights, kv_elem_bytes, seqs)
        seconds, bound = work.seconds(peak_gflops(work.rows), read_gbs)
        spent[bound] += seconds
        if kind == "prefill":
            prefill_s += seconds
        else:
            decode.append(work)
    out_tokens = sum(r["output_len"] for r in requests if r.get("ok", True))
    total = spent["memory"] + spent["compute"]
    out: dict[str, Any] = {
        "tokens_per_s": out_tokens / total if total else 0.0, "seconds": total,
        "steps": len(steps), "memory_bound_s": spent["memory"],
        "compute_bound_s": spent["compute"], "prefill_s": prefill_s,
        "bound": "memory" if spent["memory"] >= spent["compute"] else "compute",
        "read_gbs": read_gbs, "kv_elem_bytes": kv_elem_bytes, "decode_step": None}
    if decode:
        rows = max(w.rows for w in decode)
        full = [w for w in decode if w.rows == rows]
        flops = {k: sum(w.flops[k] for w in full) / len(full) for k in full[0].flops}
        nbytes = {k: sum(w.bytes[k] for w in full) / len(full) for k in full[0].bytes}
        peak = peak_gflops(rows)
        compute_ms = flops["total"] / (peak * 1e9) * 1e3
        memory_ms = nbytes["total"] / (read_gbs * 1e9) * 1e3
        out["decode_step"] = {"rows": rows, "flops": flops, "bytes": nbytes,
                              "peak_gflops": peak, "compute_ms": compute_ms,
                              "memory_ms": memory_ms, "ms": max(compute_ms, memory_ms),
                              "bound": "compute" if compute_ms > memory_ms else "memory"}
    return out


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


def read_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, passes: int = 5
                   ) -> dict[str, Any]:
    """Memory read bandwidth in GB/s (1e9 bytes/s) on ``threads`` threads: ``torch.sum``
    of an fp32 buffer of ``nbytes`` (far past the caches; a streaming read, as the
    weights and the KV cache are read), timed ``passes`` times, the fastest kept
    (``read_gbs``; every pass in ``by_pass``). Allocates ``nbytes`` for the call."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        buf.sum()  # touch every page once more before timing
        by_pass = []
        for _ in range(passes):
            t0 = time.perf_counter()
            buf.sum()
            by_pass.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        del buf
    finally:
        torch.set_num_threads(before)
    return {"read_gbs": max(by_pass), "by_pass": [round(g, 2) for g in by_pass],
            "bytes": nbytes // 4 * 4, "threads": threads}
