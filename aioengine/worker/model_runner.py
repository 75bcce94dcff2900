"""Turns a ``SchedulerOutput`` delta into batch tensors, runs the model, samples.

The runner keeps a persistent batch (vLLM v1's ``InputBatch`` idea): each
live request owns a row of two numpy arrays, ``token_ids[row, :]`` and
``block_table[row, :]``, updated by deltas only. A step's inputs are built
from those rows with vectorized indexing: no loop over tokens, and the only
per-request Python work is reading the step's small delta.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aioengine.config import EngineConfig, resolve_device
from aioengine.distributed import parallel_state as tp
from aioengine.ipc.messages import ModelRunnerOutput, SamplingMetadata, SchedulerOutput
from aioengine.models import registry
from aioengine.models.decoder import DecoderArch
from aioengine.models.layers.attention import AttentionMetadata
from aioengine.models.loader import load_hf_config, load_weights
from aioengine.spec_decode import verifier
from aioengine.structured.min_tokens import lift_min_tokens_where_grammar_ends
from aioengine.worker.sampler import SamplingBatch, greedy_tokens, sample
import triton_kernels
from triton_kernels import cpu_ops
from triton_kernels.quant import QuantizedWeight

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``--kv-cache-dtype`` values beyond ``DTYPES``: vLLM's fp8 caches (OFP8 E4M3 / E5M2).
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}
#: CPU flags (``/proc/cpuinfo``) of units that compute bf16 natively.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s ``flags``/``Features``; empty when
    unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")) and ":" in line:
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_dtype(requested: str, device_type: str, flags: frozenset[str], quantized: bool,
                 cuda_bf16: bool = False) -> tuple[torch.dtype, str]:
    """The activation dtype for ``--dtype requested`` and why (for the log).

    ``auto`` (vLLM's default spelling) picks what the hardware computes fastest: on
    CUDA bf16 where supported, else fp16; on a CPU fp32 for quantized weights (the C++
    quantized kernels take fp32 activations), bf16 for dense weights where AMX-BF16 or
    AVX512-BF16 exists (oneDNN's bf16 GEMM), fp32 otherwise (an AVX2-only CPU runs bf16
    matmuls 2.3x slower than fp32, issue 16). An explicit ``bfloat16`` on a CPU without
    bf16 units is honoured; the reason then says it will be slow (the caller warns).

    Args:
        requested: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        device_type: ``cpu`` or ``cuda``.
        flags: the CPU's flags (``cpu_flags()``).
        quantized: the model's linear weights are GGML-quantized.
        cuda_bf16: the CUDA device computes bf16.
    """
    has_bf16 = any(f in flags for f in BF16_CPU_FLAGS)
    if requested != "auto":
        slow = requested == "bfloat16" and device_type == "cpu" and not has_bf16
        return DTYPES[requested], ("slow: this CPU has no bf16 units (amx_bf16/avx512_bf16); "
                                   "float32 is faster here" if slow else "requested")
    if device_type == "cuda":
        return ((torch.bfloat16, "auto: CUDA with bf16") if cuda_bf16
                else (torch.float16, "auto: CUDA without bf16"))
    if quantized:
        return torch.float32, "auto: quantized weights (the CPU kernels take fp32 activations)"
    if has_bf16:
        return torch.bfloat16, "auto: dense weights on a CPU with bf16 units"
    return torch.float32, "auto: CPU without bf16 units"


def choose_kv_cache_dtype(requested: str, dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype requested`` under activations
    of ``dtype``. ``auto`` is ``dtype`` (vLLM's meaning; fp32 logprobs then equal HF's to
    1e-4). ``float16``/``bfloat16`` under fp32 activations on a CPU halve the cache
    (``float16`` is llama.cpp's default f16 cache): the C++ decode kernels read it with
    F16C/AVX-512 conversions in registers, K/V are rounded to it when written.
    ``fp8``/``fp8_e4m3`` (torch.float8_e4m3fn) and ``fp8_e5m2`` (torch.float8_e5m2),
    the OCP 8-bit floating point (OFP8) formats, quarter it, as vLLM's
    ``--kv-cache-dtype fp8``: unscaled (scale 1.0, no calibration), rounded to nearest
    even and saturated when written (``csrc/fp8.h``), read exactly in registers.

    Raises:
        ValueError: a cache dtype other than ``dtype`` where it is not supported (only
            fp16/bf16/fp8 caches under fp32 activations on a CPU are; fp8 on CUDA is not
            implemented); the message names the option.
    """
    if requested == "auto":
        return dtype
    cache = FP8_KV_CACHE_DTYPES.get(requested) or DTYPES[requested]
    if cache == dtype:
        return cache
    if device_type != "cpu":
        raise ValueError(f"--kv-cache-dtype {requested} is supported on a CPU only (with "
                         f"--dtype float32), not on {device_type}; use --kv-cache-dtype auto")
    if dtype != torch.float32:
        raise ValueError(f"--kv-cache-dtype {requested} needs --dtype float32 on a CPU "
                         f"(or --kv-cache-dtype auto); got activations of {dtype}")
    return cache


@dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps."""

    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    num_blocks: int
    sampling: SamplingMetadata
    generator: torch.Generator
    # Draft-model speculation (spec_decode.draft_model): draft K/V valid before
    # this position, the last proposal (n, drafts, end of its real blocks) and
    # its draft distributions q [k, vocab] for a sampled request.
    draft_num_computed: int = 0
    draft_pending: tuple[int, list[int], int] | None = None
    draft_probs: torch.Tensor | None = None


def grammar_bitmask_rows(so: SchedulerOutput, sampling_states: list[CachedRequestState]
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, bitmask)`` for ``SamplingBatch.grammar_bitmask``: the rows of
    ``sampling_states`` that ``so.grammar_bitmask`` constrains, or None (the
    step has no constrained request: nothing is decoded or copied)."""
    if so.grammar_bitmask is None:
        return None
    ids = so.structured_output_request_ids
    bitmask = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(len(ids), -1)
    row_of = {s.req_id: i for i, s in enumerate(sampling_states)}
    keep = [(row_of[r], k) for k, r in enumerate(ids) if r in row_of]
    if not keep:
        return None
    rows, picks = zip(*keep)
    return torch.tensor(rows, dtype=torch.int64), torch.from_numpy(bitmask[list(picks)])


def resident_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are all in memory before the first step: the KV
    cache, written once here (in seconds per GiB on a 2-core VM: 0.7-1.7, over the
    threads of ``torch.get_num_threads()``).

    Left to be faulted in when first written (a ``calloc``'s fresh pages), every block
    a step writes for the first time paid for its pages in that step: at a block
    boundary 32 streams decoding together took 100 ms against 25 (bench/README.md,
    "The KV cache's pages"), the p99 of their inter-token latency. vLLM (its CPU
    backend's ``torch.zeros``) and llama.cpp (``ggml_backend_buffer_clear``) also
    hold their whole cache from the start. numpy's ``zeros`` is one allocation (on
    transparent huge pages where the kernel offers them) and ``zero_`` writes it over
    the threads.
    """
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.finfo(dtype).bits // 8
    t0 = time.perf_counter()
    cache = torch.from_numpy(np.zeros(numel * itemsize, dtype=np.uint8))
    cache.zero_()
    logger.info("KV cache of %.2f GiB in memory in %.2f s", numel * itemsize / (1 << 30),
                time.perf_counter() - t0)
    return cache.view(dtype).view(shape)


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    model_max = int(getattr(hf_config, "max_position_embeddings", 2048))
    requested = config.model.max_model_len
    if requested and requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's {model_max}")
    return requested or model_max


def weights_to_device(weights: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``load_weights``' dict with every tensor and ``QuantizedWeight`` on ``device``, in
    place (returned). ``rope_freqs`` stays on the host: the model builds its RoPE tables
    there and moves them itself (``CausalLM.to_device``)."""
    for name, w in weights.items():
        if name == "rope_freqs":
            continue
        if isinstance(w, QuantizedWeight):
            weights[name] = QuantizedWeight(w.data.to(device), w.qtype, w.shape)
        elif isinstance(w, torch.Tensor):
            weights[name] = w.to(device)
    return weights


def argmax_only(batch: SamplingBatch) -> bool:
    """Whether ``sample`` would take each row's bare argmax: every row greedy with nothing
    to adjust (no logit bias, min_tokens mask, penalties, grammar, logprobs). Such a step
    on the CPU takes the LM head's fused argmax (``compute_greedy_tokens``: no logits),
    on a GPU its argmax on the device (``needs_host_sampler``)."""
    return (batch.all_greedy and batch.logit_bias is None and batch.min_tokens_mask is None
            and not batch.need_penalties and batch.grammar_bitmask is None
            and all(n < 0 for n in batch.num_logprobs))


def needs_host_sampler(batch: SamplingBatch) -> bool:
    """Whether a step's logits on a GPU go to the host for the sampler.

    Only a step whose rows are all greedy with nothing to adjust (no logit bias,
    min_tokens mask, penalties, grammar, logprobs) takes its argmax on the device and
    copies back ``[rows]`` int64. Any other step copies its logits (``rows x vocab x 4``
    bytes: 6.3 MB for 32 rows of SmolLM2's 49,152) to the host and runs the CPU sampler
    (the C++ kernel where built): a sampled row draws its uniform from its request's
    host ``torch.Generator`` and the sampler's masks are host tensors, so seeded streams
    are the same on both devices, and the sampler's checks (chi-square, batch invariance)
    cover the GPU path too; the torch twin on the device is the way to go once sampled
    rows dominate a GPU's step time (docs/gpu.md).
    """
    return not argmax_only(batch)


class ModelRunner:
    """Owns the model weights and the KV cache tensor
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Under tensor parallelism there is one runner per rank, each with its
    shard of the weights and the KV cache of its KV heads (``num_kv_heads``
    is then the rank's count); all ranks run every step, rank 0 samples and
    broadcasts the sampled ids so every rank's persistent batch stays equal.

    On CUDA (``--device``, ``config.resolve_device``) the weights, the KV cache and each
    step's input tensors live on the GPU (inputs copied from page-locked host memory
    without waiting), the ``triton_kernels`` calls take their Triton paths, and decode
    steps replay CUDA graphs (``cuda_graphs.CudaGraphRunner``) unless
    ``--enforce-eager``. The persistent batch stays in host numpy arrays either way.

    Args:
        config: engine settings (model path, dtype, cache sizing).
    """

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        path = config.model.model_path
        quantized = path.endswith(".gguf") or config.model.quantization != "none"
        device_type, why_device = resolve_device(config)
        self.device = torch.device(device_type)
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # an index, so that tensors compare equal to self.device
            self.device = torch.device("cuda", torch.cuda.current_device())
        logger.info("device %s (%s)", self.device, why_device)
        self.dtype, why = choose_dtype(config.model.dtype, self.device.type, cpu_flags(),
                                       quantized,
                                       cuda_bf16=on_cuda and torch.cuda.is_bf16_supported())
        (logger.warning if why.startswith("slow") else logger.info)(
            "dtype %s (%s)", str(self.dtype).removeprefix("torch."), why)
        self.kv_cache_dtype = choose_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype,
                                                    self.device.type)
        hf_config = load_hf_config(path)
        self.arch = DecoderArch.from_hf_config(hf_config)
        model_class = registry.model_class(registry.family_of_config(hf_config))
        self.max_model_len = resolve_max_model_len(config, hf_config)
        weights = load_weights(path, hf_config, self.dtype, config.model.quantization)
        if on_cuda:  # before the model is built: a model on the GPU builds no C++ step
            weights_to_device(weights, self.device)
        t_weights = time.perf_counter() - t0
        # Build (first run on a machine) or load the C++ CPU kernels now rather than in
        # the first request's step; None means the torch path, which is logged. (On CUDA
        # the host sampler of sampled rows uses them.)
        cpu_ops.load()
        self.model = model_class(self.arch, weights, self.dtype, self.max_model_len + 1)
        if on_cuda:
            self.model.to_device(self.device)  # the RoPE tables and embedding scale
        formats = ", ".join(f"{k} x{v}" for k, v in self.model.weight_formats().items())
        logger.info("weights as held (fused Q/K/V and gate/up count once): %s (%.1f MB%s), "
                    "loaded in %.2f s", formats,
                    self.model.parameter_bytes() / 1e6,
                    ", mapped from the file" if path.endswith(".gguf") else "", t_weights)
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_blocks()
        if self.model.tp_size > 1:
            # The one central block manager needs the same count on every rank.
            self.num_blocks = tp.all_reduce_min(self.num_blocks)
        a = self.model.arch
        kv_shape = (a.num_layers, 2, self.num_blocks, self.block_size, a.num_kv_heads,
                    a.head_dim)
        self.kv_cache = (torch.zeros(kv_shape, dtype=self.kv_cache_dtype, device=self.device)
                         if on_cuda else resident_zeros(kv_shape, self.kv_cache_dtype))
        self.max_blocks_per_seq = -(-(self.max_model_len + 1) // self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self._last_step_end = 0.0  # perf_counter() at the end of the last step
        self._free_rows: list[int] = []
        self._capacity = 0
        self.token_ids = np.zeros((0, self.max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((0, self.max_blocks_per_seq), dtype=np.int32)
        self._grow(max(8, config.scheduler.max_num_seqs))
        self.drafter = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            from aioengine.spec_decode.draft_model import DraftModelProposer

            self.drafter = DraftModelProposer(config, self)
        elif config.speculative is not None:
            self.drafter = verifier.DraftProposer(config.speculative, self.max_model_len)
        self.cuda_graphs = self._capture_cuda_graphs() if on_cuda else None
        self.load_time = time.perf_counter() - t0
        logger.info("model ready: %d blocks of %d tokens (KV cache %s), %.1f s", self.num_blocks,
                    self.block_size, str(self.kv_cache_dtype).removeprefix("torch."),
                    self.load_time)

    def _capture_cuda_graphs(self):
        """The ``CudaGraphRunner`` of this model with every bucket captured, or None
        (``--enforce-eager``, or a model whose forward cannot be captured: logged)."""
        from aioengine.worker import cuda_graphs

        sizes = self.config.device.capture_sizes(self.config.scheduler.max_num_seqs)
        blocker = cuda_graphs.graph_blocker(self.model)
        if not sizes or blocker is not None:
            logger.info("CUDA graphs off (%s): every step runs eagerly",
                        "--enforce-eager" if not sizes else blocker)
            return None
        runner = cuda_graphs.CudaGraphRunner(self.model, self.kv_cache, sizes,
                                             self.max_blocks_per_seq, self.block_size,
                                             self.device)
        runner.capture()
        return runner

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, attn: AttentionMetadata,
                 block_tables: np.ndarray, decode_only: bool) -> torch.Tensor:
        """``[num_tokens, hidden]`` hidden states of a step (host inputs): on a CPU the
        model as before; on CUDA a captured graph's replay for a decode-only step that fits
        a bucket, else the model on inputs copied to the device."""
        if self.device.type == "cpu":
            return self.model.forward(torch.from_numpy(input_ids), torch.from_numpy(positions),
                                      self.kv_cache, attn)
        if decode_only and self.cuda_graphs is not None \
                and self.cuda_graphs.bucket_for(len(input_ids)) is not None:
            return self.cuda_graphs.run(input_ids, positions, attn.slot_mapping.numpy(),
                                        block_tables, attn.seq_lens.numpy())

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(self.device, non_blocking=True)

        device_attn = AttentionMetadata(
            slot_mapping=put(attn.slot_mapping), block_tables=put(attn.block_tables),
            cu_seqlens_q=put(attn.cu_seqlens_q), seq_lens=put(attn.seq_lens),
            max_seqlen_q=attn.max_seqlen_q, max_seqlen_k=attn.max_seqlen_k)
        return self.model.forward(put(torch.from_numpy(input_ids)),
                                  put(torch.from_numpy(positions)), self.kv_cache, device_attn)

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        a = self.model.arch  # this rank's KV heads
        bytes_per_block = (a.num_layers * 2 * self.block_size * a.num_kv_heads * a.head_dim
                           * torch.finfo(self.kv_cache_dtype).bits // 8)
        num_blocks = cache.kv_cache_memory_bytes // bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds "
                             f"{num_blocks} blocks of {bytes_per_block} bytes; need at least 2")
        return int(num_blocks)

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        self.token_ids = np.resize(self.token_ids, (capacity, self.token_ids.shape[1]))
        self.block_table = np.resize(self.block_table, (capacity, self.block_table.shape[1]))
        self._free_rows.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow(self._capacity * 2)
        return self._free_rows.pop()

    # -- applying the delta ----------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> list[CachedRequestState]:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        # Preempted requests keep their row (token ids) and generator; their
        # block table is replaced when they resume.
        scheduled = []
        for new in so.scheduled_new_reqs:
            row = self._take_row()
            n = len(new.token_ids)
            self.token_ids[row, :n] = new.token_ids
            self.block_table[row, :len(new.block_ids)] = new.block_ids
            gen = torch.Generator()
            gen.manual_seed(new.sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
            state = CachedRequestState(new.req_id, row, new.num_prompt_tokens, n,
                                       len(new.block_ids), new.sampling, gen)
            self.requests[new.req_id] = state
            scheduled.append(state)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            ids = cached.new_block_ids
            if cached.resumed:
                state.num_blocks = 0
                state.draft_num_computed, state.draft_pending = 0, None
            for index, block_id in cached.cow_block_ids:
                self.block_table[state.row, index] = block_id
            self.block_table[state.row, state.num_blocks:state.num_blocks + len(ids)] = ids
            state.num_blocks += len(ids)
            if cached.new_token_ids:
                start = cached.num_computed_tokens
                self.token_ids[state.row, start:start + len(cached.new_token_ids)] = \
                    cached.new_token_ids
                state.num_tokens = start + len(cached.new_token_ids)
            scheduled.append(state)
        return scheduled

    # -- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Raises KeyError if the delta names an unknown request."""
        t0 = time.perf_counter()
        idle = t0 - self._last_step_end if self._last_step_end else 0.0
        try:
            out = self._execute_model(so, t0)
        finally:
            self._last_step_end = time.perf_counter()
        out.idle_time = idle
        return out

    def _execute_model(self, so: SchedulerOutput, t0: float) -> ModelRunnerOutput:
        if so.copy_blocks:
            # Copy-on-write: before this step's forward writes into the copies.
            pairs = torch.tensor(so.copy_blocks, dtype=torch.int64).to(self.device)
            triton_kernels.copy_blocks(self.kv_cache, pairs)
            if hasattr(self.drafter, "kv_cache"):  # a draft model's cache mirrors the blocks
                triton_kernels.copy_blocks(self.drafter.kv_cache, pairs)
        states = self._update_states(so)
        if not states:
            return ModelRunnerOutput(so.step_id, [], None, 0.0, 0.0)
        num_computed = np.array([r.num_computed_tokens for r in so.scheduled_new_reqs]
                                + [r.num_computed_tokens for r in so.scheduled_cached_reqs],
                                dtype=np.int64)
        num_sched = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)
        num_tokens_known = np.array([s.num_tokens for s in states], dtype=np.int64)
        num_draft = verifier.write_draft_tokens(so, states, self.token_ids)  # None: no drafts

        cu = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        total = int(cu[-1])
        req_of_token = np.repeat(np.arange(len(states)), num_sched)
        positions = num_computed[req_of_token] + np.arange(total) - cu[req_of_token]
        row_of_token = rows[req_of_token]
        input_ids = self.token_ids[row_of_token, positions]
        bs = self.block_size
        slot_mapping = (self.block_table[row_of_token, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        seq_lens = num_computed + num_sched
        max_seqlen_k = int(seq_lens.max())
        block_tables = self.block_table[rows, :-(-max_seqlen_k // bs)]
        sampling_mask = seq_lens >= num_tokens_known
        logits_indices = cu[1:][sampling_mask] - 1
        if num_draft is not None:  # every draft position of a request, and its last token
            logits_indices = verifier.logits_indices(cu, sampling_mask, num_draft)

        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            max_seqlen_q=int(num_sched.max()),
            max_seqlen_k=max_seqlen_k,
        )
        if num_draft is not None:
            attn = verifier.batch_expansion(num_sched, num_draft, positions, row_of_token,
                                            self.block_table, bs, attn.slot_mapping) or attn
        hidden = self._forward(input_ids, positions, attn, block_tables,
                               num_draft is None and total == len(states))
        sampled = np.full(len(states), -1, dtype=np.int64)
        logprobs_out = None
        num_accepted_out = spec_token_ids = None
        t1 = time.perf_counter()
        if len(logits_indices):
            sampling_states = [s for s, m in zip(states, sampling_mask) if m]
            hidden_rows = hidden[torch.from_numpy(logits_indices)]
            num_accepted = None
            batch = self._step_sampling_batch(sampling_states, so) if num_draft is None else None
            # Rows that need only their argmax: the LM head's fused kernel, no logits (None
            # where it does not apply: a dense head, tensor parallelism, CUDA, soft-capping)
            greedy = (self.model.compute_greedy_tokens(hidden_rows)
                      if batch is not None and argmax_only(batch) else None)
            logits = self.model.compute_logits(hidden_rows) if greedy is None else None
            if greedy is not None:
                tokens, logprobs = greedy, None
            elif logits is not None and num_draft is not None:
                tokens, num_accepted, logprobs = verifier.verify(
                    self, logits, sampling_states, num_draft[sampling_mask], so,
                    lambda lg, st: self._sample(lg, st, so))
            elif logits is not None:
                tokens, logprobs = self._sample(logits, sampling_states, so, batch)
            else:  # a tensor-parallel rank other than 0: rank 0 samples
                tokens, logprobs = torch.empty(len(logits_indices), dtype=torch.int64), None
            if self.model.tp_size > 1:
                tp.broadcast_from_first(tokens)
            tokens_np = tokens.numpy()
            sampled[sampling_mask] = tokens_np
            if num_accepted is not None:
                # Accepted drafts already sit in the rows after the last token.
                for state, n in zip(sampling_states, num_accepted.tolist()):
                    state.num_tokens += n
                verifier.rollback_block_tables(sampling_states, seq_lens[sampling_mask],
                                               num_draft[sampling_mask], num_accepted, bs)
                num_accepted_out = np.zeros(len(states), dtype=np.int64)
                num_accepted_out[sampling_mask] = num_accepted
                num_accepted_out = num_accepted_out.tolist()
            for state, token in zip(sampling_states, tokens_np.tolist()):
                if state.num_tokens <= self.max_model_len:
                    self.token_ids[state.row, state.num_tokens] = token
                    state.num_tokens += 1
            if logprobs is not None:
                logprobs_out = [None] * len(states)
                for k, lp in zip(np.flatnonzero(sampling_mask).tolist(), logprobs):
                    logprobs_out[k] = lp
            if self.drafter is not None:
                spec_token_ids = [[] for _ in states]
                drafts = self.drafter.propose_next(self.token_ids, sampling_states)
                for k, d in zip(np.flatnonzero(sampling_mask).tolist(), drafts):
                    spec_token_ids[k] = d
        t2 = time.perf_counter()
        return ModelRunnerOutput(so.step_id, sampled.tolist(), logprobs_out, t1 - t0, t2 - t1,
                                 num_accepted_out, spec_token_ids)

    def _step_sampling_batch(self, states: list[CachedRequestState],
                             so: SchedulerOutput) -> SamplingBatch:
        """The rows' ``SamplingBatch`` with this step's grammar bitmask."""
        batch = self._sampling_batch(states)
        batch.grammar_bitmask = grammar_bitmask_rows(so, states)
        # A complete grammar allows only EOS: it wins over min_tokens (structured/min_tokens.py).
        batch.min_tokens_mask = lift_min_tokens_where_grammar_ends(batch.min_tokens_mask,
                                                                   batch.grammar_bitmask)
        return batch

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState],
                so: SchedulerOutput, batch: SamplingBatch | None = None
                ) -> tuple[torch.Tensor, list | None]:
        """One token per row of ``logits`` ``[len(states), vocab]`` (``batch``: the rows'
        ``_step_sampling_batch`` when the caller has it)."""
        if batch is None:
            batch = self._step_sampling_batch(states, so)
        if logits.is_cuda:  # see needs_host_sampler; the engine wants host token ids
            if not needs_host_sampler(batch):
                return greedy_tokens(logits).cpu(), None
            logits = logits.cpu()
        return sample(logits, batch)

    def _sampling_batch(self, states: list[CachedRequestState]) -> SamplingBatch:
        params = [s.sampling for s in states]

        def col(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype)

        greedy = [p.temperature < 1e-5 for p in params]
        batch = SamplingBatch(
            temperature=col("temperature"), top_p=col("top_p"), top_k=col("top_k", torch.int64),
            min_p=col("min_p"), presence_penalty=col("presence_penalty"),
            frequency_penalty=col("frequency_penalty"),
            repetition_penalty=col("repetition_penalty"),
            generators=[s.generator for s in states], greedy=greedy,
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(greedy),
        )
        sampled_rows = [p for p, g in zip(params, greedy) if not g]
        batch.need_top_k = any(p.top_k > 0 for p in sampled_rows)
        batch.need_top_p = any(p.top_p < 1.0 for p in sampled_rows)
        batch.need_min_p = any(p.min_p > 0.0 for p in sampled_rows)
        penalized = [i for i, p in enumerate(params) if p.presence_penalty
                     or p.frequency_penalty or p.repetition_penalty != 1.0]
        batch.need_penalties = bool(penalized)
        if batch.need_penalties:
            if len(penalized) < len(params):
                batch.penalty_rows = torch.tensor(penalized, dtype=torch.int64)
            rows = np.array([s.row for s in states])
            n_tok = np.array([s.num_tokens for s in states])
            n_prompt = np.array([s.num_prompt_tokens for s in states])
            width = int(n_tok.max())
            ids = self.token_ids[rows, :width]
            pos = np.arange(width)[None, :]
            out = np.where((pos >= n_prompt[:, None]) & (pos < n_tok[:, None]), ids, -1)
            prompt = np.where(pos < n_prompt[:, None], ids, -1)
            batch.output_token_ids = torch.from_numpy(out)
            if any(p.repetition_penalty != 1.0 for p in params):
                batch.prompt_token_ids = torch.from_numpy(prompt)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            r, t, b = zip(*bias)
            batch.logit_bias = (torch.tensor(r), torch.tensor(t).clamp(0, self.arch.vocab_size - 1),
                                torch.tensor(b, dtype=torch.float32))
        masked = [(i, t) for i, (s, p) in enumerate(zip(states, params))
                  if s.num_tokens - s.num_prompt_tokens < p.min_tokens for t in p.stop_token_ids
                  if t < self.arch.vocab_size]
        if masked:
            r, t = zip(*masked)
            batch.min_tokens_mask = (torch.tensor(r), torch.tensor(t))
        return batch
