"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

A decode step of a small model on a GPU is launch-bound: each layer is a dozen kernels of
a few microseconds, and the host spends longer launching them than the GPU runs them.
A CUDA graph records the whole forward once and replays it with one launch (vLLM's
``CUDAGraphRunner``, SGLang's ``cuda_graph_runner``). A graph replays fixed shapes and
fixed addresses, so:

- the step's inputs live in static buffers (``DecodeInputBuffers``) sized for the
  largest bucket; each step copies its rows in and pads the bucket's remaining rows with
  a token that writes nowhere (slot ``PAD_SLOT_ID`` = -1, which ``reshape_and_cache``
  skips) and attends to one key (``seq_len`` 1, block 0), results discarded;
- one graph per bucket (``DeviceConfig.capture_sizes``: 1, 2, 4, 8, 16, 24, ... up to
  ``--max-cudagraph-batch-size``); a step of n sequences replays the smallest bucket
  >= n (``bucket_for``);
- attention sees ``max_seqlen_k`` = the block table's full width (``max_blocks_per_seq *
  block_size``), not the step's maximum: the Triton decode kernel reads each sequence's
  own ``seq_len`` from the device, and its Flash-Decoding split count is then fixed per
  bucket; splits past a sequence's end exit at once. No host sync, no data-dependent
  shape: the CUDA path of ``triton_kernels`` plans nothing on the host
  (``plan_attention`` returns None there);
- graphs are captured after warm-up runs (Triton compiles its kernels on the first call,
  cuBLAS picks its algorithms), largest bucket first, all in one private memory pool
  that the smaller ones reuse.

Eager steps (``ModelRunner`` calls the model directly): prefill and mixed steps, decode
steps above the largest bucket, ``--enforce-eager``, and models whose forward is not
capture-safe (``graph_blocker``). Only the model's forward is captured: the LM head and
the sampler run after it, eagerly, on the rows that sample.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from aioengine.models.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from aioengine.models.decoder import CausalLM

logger = logging.getLogger(__name__)

#: ``slot_mapping`` of a padding row: ``reshape_and_cache`` writes nothing for it.
PAD_SLOT_ID = -1
#: Eager runs of each bucket before its capture (Triton JIT, cuBLAS heuristics, lazy
#: allocations all happen outside the graph).
WARMUP_RUNS = 2


def bucket_for(capture_sizes: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest captured batch size >= ``num_seqs``, or None (above the largest:
    the step runs eagerly).

    Args:
        capture_sizes: ascending batch sizes with a graph (``DeviceConfig.capture_sizes``).
        num_seqs: sequences in the decode step (>= 1).
    """
    i = bisect.bisect_left(capture_sizes, num_seqs)
    return capture_sizes[i] if i < len(capture_sizes) else None


def graph_blocker(model: CausalLM) -> str | None:
    """Why ``model``'s forward cannot be captured (None: it can). Sliding-window and
    soft-capped layers run ``windowed_paged_attention``, which reads the step's lengths on
    the host; tensor parallelism's collectives run on CPUs."""
    arch = model.arch
    if model.tp_size > 1:
        return "tensor parallelism"
    if arch.sliding_window is not None:
        return "sliding-window attention (its torch path reads lengths on the host)"
    if arch.attn_logit_softcap is not None:
        return "attention-logit soft-capping (its torch path reads lengths on the host)"
    return None


class DecodeInputBuffers:
    """The static inputs of captured decode steps, sized for the largest bucket.

    Attributes:
        input_ids, positions, slot_mapping: ``[max_num_seqs]`` int64.
        seq_lens: ``[max_num_seqs]`` int32.
        block_tables: ``[max_num_seqs, max_blocks_per_seq]`` int32; columns past a step's
            width keep earlier steps' ids, which are valid blocks and never read (the
            kernel reads ``cdiv(seq_len, block_size)`` of them).
        cu_seqlens_q: ``[max_num_seqs + 1]`` int32, ``0, 1, 2, ...`` (one query a sequence).
        max_seqlen_k: the block table's width in tokens.

    Args:
        max_num_seqs: rows of the largest bucket.
        max_blocks_per_seq: block-table columns (the longest sequence's blocks).
        block_size: tokens per KV block.
        device: where the buffers live (a CPU in the unit tests).
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.device = torch.device(device)
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_seqs,), PAD_SLOT_ID, dtype=torch.int64,
                                       device=device)
        self.seq_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.cu_seqlens_q = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.max_seqlen_k = max_blocks_per_seq * block_size

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The attention metadata of a ``bucket``-row step: views of the buffers, so a
        graph captured with them reads whatever ``fill`` copied in last."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            cu_seqlens_q=self.cu_seqlens_q[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k)

    def fill(self, bucket: int, input_ids: np.ndarray, positions: np.ndarray,
             slot_mapping: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray) -> None:
        """Copy a decode step's ``n`` rows in and pad rows ``n..bucket`` (token 0 at
        position 0, slot ``PAD_SLOT_ID``, ``seq_len`` 1, block table left as it is).

        The rows are padded on the host and copied through page-locked memory without
        waiting (torch's caching host allocator keeps a pinned block until its copy has
        run, so the next step cannot overwrite it early).

        Args:
            bucket: rows to fill, ``n <= bucket <= max_num_seqs``.
            input_ids, positions, slot_mapping: ``[n]`` integers.
            block_tables: ``[n, width]`` int32, ``width <= max_blocks_per_seq``.
            seq_lens: ``[n]`` context lengths including the new token (>= 1).

        Raises:
            ValueError: ``n`` or ``width`` out of range.
        """
        n = len(input_ids)
        width = block_tables.shape[1] if block_tables.ndim == 2 else -1
        if not 1 <= n <= bucket <= self.max_num_seqs or not 0 < width <= \
                self.block_tables.shape[1] or block_tables.shape[0] != n:
            raise ValueError(f"a decode step of {n} rows and {width} block-table columns does "
                             f"not fit bucket {bucket} of buffers [{self.max_num_seqs}, "
                             f"{self.block_tables.shape[1]}]")
        longs = np.zeros((3, bucket), dtype=np.int64)
        longs[0, :n] = input_ids
        longs[1, :n] = positions
        longs[2, :n] = slot_mapping
        longs[2, n:] = PAD_SLOT_ID
        lens = np.ones(bucket, dtype=np.int32)
        lens[:n] = seq_lens
        self._copy(self.input_ids[:bucket], longs[0])
        self._copy(self.positions[:bucket], longs[1])
        self._copy(self.slot_mapping[:bucket], longs[2])
        self._copy(self.seq_lens[:bucket], lens)
        self._copy(self.block_tables[:n, :width], np.ascontiguousarray(block_tables,
                                                                       dtype=np.int32))

    def _copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        host = torch.from_numpy(src)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dst.copy_(host, non_blocking=True)


class CudaGraphRunner:
    """The model's forward for decode steps, captured per batch-size bucket.

    Args:
        model: the model, weights on ``device``; ``graph_blocker(model)`` must be None.
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` on
            ``device`` (graphs keep its address: it is never reallocated).
        capture_sizes: ascending bucket sizes (``DeviceConfig.capture_sizes``), non-empty.
        max_blocks_per_seq: block-table width of the longest sequence.
        block_size: tokens per KV block.
        device: a CUDA device.

    Raises:
        ValueError: no sizes, or a model ``graph_blocker`` refuses.
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, capture_sizes: tuple[int, ...],
                 max_blocks_per_seq: int, block_size: int, device: torch.device) -> None:
        if not capture_sizes:
            raise ValueError("CUDA graphs need at least one batch size to capture")
        blocker = graph_blocker(model)
        if blocker is not None:
            raise ValueError(f"this model's forward cannot be captured: {blocker}")
        self.model = model
        self.kv_cache = kv_cache
        self.capture_sizes = tuple(capture_sizes)
        self.device = torch.device(device)
        self.buffers = DecodeInputBuffers(self.capture_sizes[-1], max_blocks_per_seq,
                                          block_size, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_time_s = 0.0
        self.capture_memory_bytes = 0

    def bucket_for(self, num_seqs: int) -> int | None:
        """The bucket a decode step of ``num_seqs`` sequences replays, or None (eager)."""
        return bucket_for(self.capture_sizes, num_seqs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, in one private memory pool;
        logs the buckets, the time and the device memory the graphs took."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for bucket in reversed(self.capture_sizes):
            attn = self.buffers.metadata(bucket)
            ids, positions = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
            for _ in range(WARMUP_RUNS):
                self.model.forward(ids, positions, self.kv_cache, attn)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model.forward(ids, positions, self.kv_cache, attn)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - t0
        self.capture_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.2f s, %.1f MiB of "
                    "device memory; larger decode steps, prefill and mixed steps run eagerly",
                    len(self.graphs), ", ".join(map(str, self.capture_sizes)),
                    self.capture_time_s, self.capture_memory_bytes / (1 << 20))

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_tables: np.ndarray, seq_lens: np.ndarray) -> torch.Tensor:
        """Replay the bucket of a decode step of ``n`` sequences (one token each).

        Args:
            input_ids, positions, slot_mapping, seq_lens: ``[n]`` (host arrays).
            block_tables: ``[n, width]`` int32.

        Returns:
            ``[n, hidden_size]``: the final hidden states, a view of the graph's output
            buffer, valid until the next replay (index it before then).

        Raises:
            ValueError: ``n`` above the largest bucket.
        """
        n = len(input_ids)
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"no CUDA graph for {n} sequences (largest bucket "
                             f"{self.capture_sizes[-1]})")
        self.buffers.fill(bucket, input_ids, positions, slot_mapping, block_tables, seq_lens)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden[:n]
