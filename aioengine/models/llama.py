"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) on a paged KV cache.

The forward pass runs one flat, ragged batch: every scheduled request's new
tokens are concatenated into ``[num_tokens]`` ids, and attention follows each
request's block table (PagedAttention, Kwon et al. 2023, §4.1). K/V of the
new tokens are written into the cache slots of ``slot_mapping`` first, then
attention reads the cache, so prefills, prefill chunks, prefix-cache hits and
decodes all take the same path.

Numerics follow HF transformers' ``LlamaForCausalLM`` (RMSNorm in fp32,
rotate-half RoPE, SiLU-gated MLP) so greedy tokens match it.

Weights are used in the format they were loaded in: dense tensors, or GGML block
formats (``triton_kernels.quant.QuantizedWeight``: a GGUF file's own bytes, or an HF
checkpoint quantized at load with ``--quantization``). Every projection, the embedding
and the LM head go through ``quant.linear`` / ``quant.embedding``, which run the
quantized kernels on the stored bytes; nothing is dequantized up front.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import triton_kernels
from triton_kernels import cpu_ops, quant
from triton_kernels.quant import QuantizedWeight, Weight, fuse_rows
from aioengine.distributed import parallel_state as tp
from aioengine.distributed.tensor_parallel import shard_llama_weights, vocab_parallel_embedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch lives in the paged cache.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot (block_id * block_size + offset).
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 offsets of each request's new tokens.
        seq_lens: ``[num_seqs]`` int32 context length including the new tokens.
        max_seqlen_q, max_seqlen_k: host-side maxima of the two.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class LlamaArch:
    """The shape of a Llama-family model, read from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    inv_freq: torch.Tensor
    attention_scaling: float

    @classmethod
    def from_hf_config(cls, config) -> LlamaArch:
        """Raises: ValueError for an architecture this module does not implement."""
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        inv_freq, attention_scaling = _rope_inv_freq(config, head_dim)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)) or model_type == "qwen2",
            inv_freq=inv_freq,
            attention_scaling=attention_scaling,
        )


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` fp32 (Su et al. 2021, RoFormer §3.4).

    The default schedule is computed here; scaled variants (llama3, yarn,
    linear, dynamic ...) come from transformers' ``ROPE_INIT_FUNCTIONS``.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exponent), 1.0
    from transformers import AutoConfig, PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    if not isinstance(config, PretrainedConfig):  # a GGUF file's config (loader.load_hf_config)
        config = AutoConfig.for_model(**vars(config))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32 as HF does. ``x``: ``[num_tokens, hidden]``.

    In fp32 this is torch's fused ``rms_norm`` (bit-identical to HF's
    three-op form); other dtypes normalise in fp32 and cast back before the
    weight, exactly as HF's ``LlamaRMSNorm``.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables ``[max_position, head_dim]`` and their application.

    ``apply`` rotates ``[num_tokens, heads, head_dim]`` by rotate-half (GPT-NeoX
    layout, the one HF Llama uses after un-permuting GGUF Q/K weights):
    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``. The tables hold
    ``[cos, cos]`` and ``[-sin, sin]`` so that is ``x * cos + roll(x) * sin``:
    three ops instead of eight, and bit-identical (negation is exact).
    """

    def __init__(self, inv_freq: torch.Tensor, max_position: int, scaling: float,
                 dtype: torch.dtype) -> None:
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.half = inv_freq.shape[0]
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype)
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, heads, head_dim]``; ``cos``/``sin``: rows of the tables
        for the tokens' positions, ``[num_tokens, 1, head_dim]``."""
        return x * cos + torch.roll(x, self.half, dims=-1) * sin


def weight_nbytes(w: Weight) -> int:
    """Bytes a weight occupies: a dense tensor's elements, a quantized one's blocks."""
    if isinstance(w, tuple):
        return sum(weight_nbytes(p) for p in w)
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return w.numel() * w.element_size()


def weight_format(w: Weight) -> str:
    """``"Q4_1"``, ``"F32"``, ``"BF16"`` ...: GGML's name for the format of a weight."""
    if isinstance(w, tuple):
        return "+".join(sorted({weight_format(p) for p in w}))
    if isinstance(w, QuantizedWeight):
        return w.qtype.name
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(
        w.dtype, str(w.dtype).removeprefix("torch."))


class LlamaForCausalLM:
    """Our Llama forward over the paged KV cache.

    Each weight is a dense tensor or a ``QuantizedWeight`` (see the module
    docstring), with Q/K/V and gate/up fused into one matmul each
    (``quant.fuse_rows``: same-format parts are concatenated byte row by byte
    row). Biases and norms are dense. Under tensor parallelism (``parallel_state``
    initialised with size > 1) the model keeps only this rank's shard
    (``distributed.tensor_parallel``) and ``self.arch`` has this rank's head
    counts; the forward adds an all-reduce after ``o_proj`` and ``down_proj``
    and around the embedding, and ``compute_logits`` gathers on rank 0.

    Args:
        arch: model shape.
        weights: ``{hf_name: tensor or QuantizedWeight}`` as produced by
            ``loader.load_weights`` (consumed). A GGUF file's ``rope_freqs``
            (llama3 RoPE) divides the rotary frequencies, as in llama.cpp.
        dtype: compute dtype of activations, KV cache and dense weights; quantized
            weights keep their format.

    Raises:
        ValueError: a weight is missing, or the checkpoint has biases this model
            does not implement.
    """

    def __init__(self, arch: LlamaArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.tp_size = tp.get_tp_size()
        self.vocab_size = arch.vocab_size
        self.vocab_start = 0
        if self.tp_size > 1:
            arch, self.vocab_start = shard_llama_weights(weights, arch, tp.get_tp_rank(),
                                                         self.tp_size)
        self.arch = arch
        self.dtype = dtype
        self.scale = arch.head_dim ** -0.5
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim

        freq_factors = weights.pop("rope_freqs", None)

        def take(name: str) -> torch.Tensor | QuantizedWeight:
            try:
                w = weights.pop(name)
            except KeyError:
                raise ValueError(f"weight {name!r} missing from the checkpoint") from None
            return w if isinstance(w, QuantizedWeight) else w.to(dtype).contiguous()

        self.embed_tokens = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "input_layernorm": take(p + "input_layernorm.weight"),
                "post_attention_layernorm": take(p + "post_attention_layernorm.weight"),
                "qkv_proj": fuse_rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                "o_proj": take(p + "self_attn.o_proj.weight"),
                "gate_up_proj": fuse_rows([take(p + "mlp.gate_proj.weight"),
                                           take(p + "mlp.up_proj.weight")]),
                "down_proj": take(p + "mlp.down_proj.weight"),
                "qkv_bias": None,
            }
            if arch.attention_bias:
                layer["qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        if arch.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight")
        ignored = sorted(name for name in weights if name.endswith(".bias"))
        if ignored:  # e.g. Llama's attention_bias (o_proj) or mlp_bias: refuse, never drop
            raise ValueError(f"the checkpoint has biases this model does not implement: "
                             f"{', '.join(ignored[:3])}{' ...' if len(ignored) > 3 else ''}")
        inv_freq = arch.inv_freq
        if freq_factors is not None:  # llama.cpp's ggml_rope_ext: theta / freq_factor
            inv_freq = inv_freq / freq_factors.float().reshape(inv_freq.shape)
        self.rotary = RotaryEmbedding(inv_freq, max(max_model_len, 1), arch.attention_scaling,
                                      dtype)
        # Decode steps on CPU in fp32 run the layer stack in one C++ call (see
        # cpu_ops.LlamaDecodeLayers); tensor parallelism keeps the Python forward, which
        # has the all-reduces. Quantized weights need the kernels' quantized build of it.
        self.decode_layers = None
        quantized = any(not isinstance(w, torch.Tensor) for _, w in self.named_weights())
        if (self.tp_size == 1 and self.norm.device.type == "cpu"
                and (not quantized or getattr(cpu_ops, "QUANTIZED_DECODE_LAYERS", False))
                and 2 * self.rotary.half == arch.head_dim):  # the C++ RoPE rotates whole heads
            fused = cpu_ops.LlamaDecodeLayers(
                [(layer["input_layernorm"], layer["post_attention_layernorm"], layer["qkv_proj"],
                  layer["qkv_bias"], layer["o_proj"], layer["gate_up_proj"], layer["down_proj"])
                 for layer in self.layers],
                self.norm, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps)
            self.decode_layers = fused if fused.available else None

    def named_weights(self) -> list[tuple[str, Weight]]:
        """Every weight once (a tied LM head is the embedding), with our names."""
        named = [("embed_tokens", self.embed_tokens), ("norm", self.norm)]
        named += [(f"layers.{i}.{k}", w) for i, layer in enumerate(self.layers)
                  for k, w in layer.items() if w is not None]
        if self.lm_head is not self.embed_tokens:
            named.append(("lm_head", self.lm_head))
        return named

    def parameter_bytes(self) -> int:
        """Bytes of all weights as held (quantized ones at their block size)."""
        return sum(weight_nbytes(w) for _, w in self.named_weights())

    def weight_formats(self) -> dict[str, int]:
        """``{format: number of weights}`` (fused Q/K/V and gate/up count once)."""
        counts: dict[str, int] = {}
        for _, w in self.named_weights():
            counts[weight_format(w)] = counts.get(weight_format(w), 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64 absolute positions.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
            attn: where the tokens live in the cache.

        Returns:
            ``[num_tokens, hidden_size]``.
        """
        arch = self.arch
        num_tokens = input_ids.shape[0]
        num_qk_heads = arch.num_heads + arch.num_kv_heads
        # The step's index math (gather indices, masks, slot checks) once for all layers.
        plan = triton_kernels.plan_attention(attn.slot_mapping, attn.block_tables,
                                             attn.cu_seqlens_q, attn.seq_lens,
                                             attn.max_seqlen_q, attn.max_seqlen_k, kv_cache[0, 0])
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        if self.tp_size > 1:
            residual = vocab_parallel_embedding(input_ids, self.embed_tokens, self.vocab_start)
        else:
            residual = quant.embedding(input_ids, self.embed_tokens)
        residual = residual.to(self.dtype)  # quantized tables dequantize their rows to fp32
        if self.decode_layers is not None:
            hidden = self.decode_layers.forward(residual, cos, sin, kv_cache, plan, self.scale)
            if hidden is not None:
                return hidden
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # ``residual`` is the residual stream; each block's output is added to it and
        # normalised in one fused pass (vLLM's fused_add_rms_norm), in place.
        x = rms_norm(residual, self.layers[0]["input_layernorm"], arch.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                triton_kernels.fused_add_rms_norm(x, residual, layer["input_layernorm"],
                                                  arch.rms_norm_eps)
            qkv = quant.linear(x, layer["qkv_proj"], layer["qkv_bias"])
            # Q and K heads sit side by side in the fused output: rotate them in one go.
            qk = qkv[:, :self.q_size + self.kv_size].reshape(num_tokens, num_qk_heads,
                                                             arch.head_dim)
            qk = self.rotary.apply(qk, cos, sin)
            q, k = qk[:, :arch.num_heads], qk[:, arch.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].reshape(num_tokens, arch.num_kv_heads,
                                                            arch.head_dim)
            key_cache, value_cache = kv_cache[i, 0], kv_cache[i, 1]
            triton_kernels.reshape_and_cache(k, v, key_cache, value_cache, attn.slot_mapping,
                                             plan=plan)
            o = triton_kernels.paged_attention(
                q, key_cache, value_cache, attn.block_tables, attn.cu_seqlens_q, attn.seq_lens,
                self.scale, attn.max_seqlen_q, attn.max_seqlen_k, plan=plan)
            o = quant.linear(o.reshape(num_tokens, self.q_size), layer["o_proj"])
            if self.tp_size > 1:
                tp.all_reduce(o)  # row-parallel o_proj: sum the ranks' partial outputs
            triton_kernels.fused_add_rms_norm(o, residual, layer["post_attention_layernorm"],
                                              arch.rms_norm_eps)
            x = quant.linear(triton_kernels.silu_and_mul(quant.linear(o, layer["gate_up_proj"])),
                             layer["down_proj"])
            if self.tp_size > 1:
                tp.all_reduce(x)  # row-parallel down_proj
        triton_kernels.fused_add_rms_norm(x, residual, self.norm, arch.rms_norm_eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[num_rows, hidden]`` -> fp32 logits ``[num_rows, vocab_size]``.

        Under tensor parallelism every rank must call it (each computes its
        vocabulary slice); rank 0 gets the gathered logits, the others None.
        """
        if isinstance(self.lm_head, torch.Tensor):
            logits = cpu_ops.linear(hidden, self.lm_head)  # F.linear off the fp32 CPU path
        else:
            logits = quant.linear(hidden, self.lm_head)
        if self.tp_size > 1:
            logits = tp.gather_to_first(logits)
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
        return logits.float()
