"""How a Llama-family model is split over tensor-parallel ranks.

Megatron-LM's scheme (Shoeybi et al. 2019, §3, Fig. 3): in each block a
column-parallel layer is followed by a row-parallel one, so one all-reduce
per block joins the partial sums and nothing in between communicates.

- Attention: ``qkv_proj`` is column-parallel by heads (each rank keeps
  ``num_heads / tp`` query heads and the K/V heads they read); ``o_proj`` is
  row-parallel over the same heads, then all-reduce. With fewer KV heads than
  ranks (``tp`` a multiple of ``num_kv_heads``) a KV head is replicated: rank
  ``r`` keeps KV head ``r // (tp // num_kv_heads)``, the one its query heads
  use under grouped-query attention.
- MLP: gate and up are each column-parallel (``intermediate_size / tp``
  rows each, so SiLU(gate) * up stays local); ``down_proj`` is row-parallel,
  then all-reduce.
- Embedding and LM head are vocabulary-parallel (§3, "input embedding"):
  rank ``r`` holds rows ``[r * shard, (r + 1) * shard)`` of the vocabulary
  (the last shard zero-padded); ids outside the shard look up zeros and an
  all-reduce sums the shards; each rank's logits slice is gathered on rank 0.
- RMSNorm weights are replicated.

Each rank's KV cache holds only its KV heads:
``[num_layers, 2, num_blocks, block_size, num_kv_heads / tp (or 1), head_dim]``.

Quantized weights (``QuantizedWeight``, GGML block formats) split the same way: a
column-parallel shard is a slice of whole byte rows (a view, no copy); a row-parallel
shard cuts every row's blocks, which works when the shard's columns are a multiple of
the format's block size (32, or 256 for the K-quants). Where they are not, that weight
is dequantized to fp32 before it is cut, and a warning says so.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from gguf import GGML_QUANT_SIZES

from aioengine.distributed.parallel_state import all_reduce
from aioengine.models.arch import check_tensor_parallel_size
from triton_kernels import quant
from triton_kernels.quant import QuantizedWeight

logger = logging.getLogger(__name__)


def kv_heads_of_rank(rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """``(first KV head, number of KV heads)`` rank ``rank`` keeps."""
    if num_kv_heads >= tp_size:
        n = num_kv_heads // tp_size
        return rank * n, n
    return rank // (tp_size // num_kv_heads), 1


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / LM head per rank (the last shard padded)."""
    return -(-vocab_size // tp_size)


def shard_llama_weights(weights: dict[str, torch.Tensor], arch, rank: int, tp_size: int):
    """Replace every tensor in ``weights`` (HF names) by rank ``rank``'s shard, in place.

    Dense shards are copies, so the full tensors can be freed: afterwards the
    rank holds about ``1 / tp_size`` of the weights plus the replicated norms
    (and replicated KV heads when ``num_kv_heads < tp_size``). Quantized row
    slices are views (of the mapped file, for GGUF); column slices are copies.

    Args:
        weights: ``{hf_name: tensor or QuantizedWeight}`` of the full model
            (``loader.load_weights``).
        arch: the full model's ``LlamaArch``.

    Returns:
        ``(local_arch, vocab_start)``: the arch with this rank's head counts
        (``num_heads / tp``, local KV heads, ``intermediate_size / tp``), and
        the first vocabulary id of this rank's embedding shard.

    Raises:
        ValueError: ``tp_size`` cannot split the model (``check_tensor_parallel_size``).
    """
    check_tensor_parallel_size(tp_size, arch.num_heads, arch.num_kv_heads,
                               arch.intermediate_size)
    hd = arch.head_dim
    nq = arch.num_heads // tp_size
    kv_first, nkv = kv_heads_of_rank(rank, tp_size, arch.num_kv_heads)
    ni = arch.intermediate_size // tp_size
    q_rows = slice(rank * nq * hd, (rank + 1) * nq * hd)
    kv_rows = slice(kv_first * hd, (kv_first + nkv) * hd)
    mlp_rows = slice(rank * ni, (rank + 1) * ni)
    shard = vocab_shard_size(arch.vocab_size, tp_size)
    vocab_start = rank * shard

    def rows(t, s: slice):
        if isinstance(t, QuantizedWeight):
            return t.slice_rows(s.start, s.stop)
        return t[s].clone()

    def cols(t, s: slice, name: str):
        if isinstance(t, QuantizedWeight):
            block_size, type_size = GGML_QUANT_SIZES[t.qtype]
            if s.start % block_size == 0 and s.stop % block_size == 0:
                data = t.data[:, s.start // block_size * type_size:s.stop // block_size * type_size]
                return QuantizedWeight(data.contiguous(), t.qtype, (t.shape[0], s.stop - s.start))
            logger.warning("%s: a shard of %d columns is not a multiple of the %s block size "
                           "%d; dequantizing it to fp32 for tensor parallelism", name,
                           s.stop - s.start, t.qtype.name, block_size)
            t = t.dequantize(torch.float32)
        return t[:, s].clone()

    def vocab_rows(t):
        stop = min(vocab_start + shard, t.shape[0])
        if isinstance(t, QuantizedWeight):
            # All-zero blocks dequantize to zeros in every GGML format (scale 0).
            part = t.data[vocab_start:stop]
            pad = part.new_zeros((shard - part.shape[0], part.shape[1]))
            return QuantizedWeight(torch.cat([part, pad]), t.qtype, (shard, t.shape[1]))
        out = t.new_zeros((shard,) + t.shape[1:])
        out[:stop - vocab_start] = t[vocab_start:stop]
        return out

    for name in list(weights):
        t = weights[name]
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            weights[name] = rows(t, q_rows)
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            weights[name] = rows(t, kv_rows)
        elif name.endswith("o_proj.weight"):
            weights[name] = cols(t, q_rows, name)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            weights[name] = rows(t, mlp_rows)
        elif name.endswith("down_proj.weight"):
            weights[name] = cols(t, mlp_rows, name)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = vocab_rows(t)
    local = dataclasses.replace(arch, num_heads=nq, num_kv_heads=nkv, intermediate_size=ni)
    return local, vocab_start


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
                             vocab_start: int) -> torch.Tensor:
    """Embedding lookup over a vocabulary shard, summed over the ranks.

    Args:
        input_ids: ``[num_tokens]`` int64 ids of the full vocabulary.
        weight: ``[vocab_shard, hidden]`` this rank's rows, dense or quantized.
        vocab_start: first id of the shard.

    Returns:
        ``[num_tokens, hidden]``, the full embedding on every rank (fp32 for a
        quantized table, else the table's dtype).
    """
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = quant.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(1), 0)
    return all_reduce(out)
