"""The decoder every family shares: its shape (``DecoderArch``), one block
(``DecoderLayer``) and the model over the paged KV cache (``CausalLM``).

A family module (``llama.py``, ``qwen3.py``, ``gemma.py``, ``phi3.py``) subclasses
``CausalLM`` where its checkpoint or its block differs; the twists themselves are
layer modules (``layers/``): per-head Q/K RMSNorm (Qwen3, Gemma 3), sliding-window and
soft-capped attention (Mistral, Gemma 2/3), GeGLU (Gemma), partial rotary and LongRoPE
(Phi-3), llama3 RoPE scaling. Numerics follow HF transformers (RMSNorm in fp32,
rotate-half RoPE) so greedy tokens match it.

Weights are used in the format they were loaded in: dense tensors, or GGML block
formats (``triton_kernels.quant.QuantizedWeight``); every projection, the embedding
and the LM head go through ``quant.linear`` / ``quant.embedding``.

Steps on CPU in fp32 (decode rows, prompt chunks or both) run the whole layer stack in
one C++ call (``cpu_ops.LlamaDecodeLayers``): Llama, Mistral, Qwen2, Qwen3 (Q/K norms),
Gemma 2 and 3 (sandwich norms, GeGLU, Q/K norms, soft-capping, sliding windows,
per-layer RoPE) and Phi-3 with whole-head RoPE, dense or quantized. Partial rotary
(Phi-4-mini, Phi-3.5 LongRoPE files with a partial factor), tensor parallelism and other
activations run the Python layer loop (``CausalLM.fused_decode_blocker`` says why).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch

import triton_kernels
from aioengine.distributed import parallel_state as tp
from aioengine.distributed.tensor_parallel import shard_llama_weights, vocab_parallel_embedding
from aioengine.models import registry
from aioengine.models.layers.activation import GATED_ACTIVATIONS, gelu_tanh_and_mul
from aioengine.models.layers.attention import AttentionMetadata, paged_attention
from aioengine.models.layers.norm import rms_norm
from aioengine.models.layers.rotary import RotaryEmbedding, rotary_dim, rotary_embedding
from triton_kernels import cpu_ops, quant
from triton_kernels.quant import QuantizedWeight, Weight, fuse_rows

logger = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class DecoderArch:
    """The shape of a decoder-only model and its family's twists, from an HF config.

    Attributes (beyond the usual shape fields):
        family: ``registry.ModelFamily.name``.
        qk_norm: per-head RMSNorm of Q and K (``q_norm``, ``k_norm``) before RoPE.
        hidden_act: the MLP's gate activation (``layers.activation``).
        sandwich_norm: Gemma's norms after attention and after the MLP as well.
        norm_offset: added to every RMSNorm weight (Gemma's ``1 + weight``: 1.0).
        embed_scale: multiplies the token embeddings (Gemma: ``sqrt(hidden_size)``).
        attn_scale: softmax scale (``head_dim ** -0.5``, Gemma
            ``query_pre_attn_scalar ** -0.5``).
        attn_logit_softcap, final_logit_softcap: Gemma 2's soft-capping, or None.
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: keys a sliding layer attends to (None: no sliding layers).
        rotary_dim: leading head dimensions RoPE rotates (partial rotary below head_dim).
        config: the HF config (RoPE settings are read from it).
    """

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
    family: str = "llama"
    qk_norm: bool = False
    hidden_act: str = "silu"
    sandwich_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: float | None = None
    attn_scale: float = 0.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rotary_dim: int = 0
    config: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderArch:
        """Raises: ``registry.UnsupportedModelError`` (a ValueError) for an architecture
        no family implements; ValueError for head counts that do not divide, or an MLP
        activation no layer module implements."""
        family = registry.family_of_config(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act",
                                                                     "silu")
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"MLP activation {act!r} is not supported; supported: "
                             f"{', '.join(GATED_ACTIVATIONS)}")
        num_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        layer_types = tuple(getattr(config, "layer_types", None) or ())
        if not layer_types:  # Mistral, Phi-3: one window for every layer, where set
            use = getattr(config, "use_sliding_window", True) is not False
            layer_types = (SLIDING if window and use else FULL,) * num_layers
        if len(layer_types) != num_layers or set(layer_types) - {FULL, SLIDING}:
            raise ValueError(f"layer_types {list(layer_types)} do not give one of "
                             f"{FULL!r}/{SLIDING!r} per layer for {num_layers} layers")
        if SLIDING not in layer_types:
            window = None
        scalar = getattr(config, "query_pre_attn_scalar", None)
        gemma = family.gemma_norms
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=(bool(getattr(config, "attention_bias", False))
                            or family.name == "qwen2"),
            family=family.name,
            qk_norm=family.qk_norm,
            hidden_act=act,
            sandwich_norm=gemma,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=config.hidden_size ** 0.5 if gemma else None,
            attn_scale=(scalar if scalar else head_dim) ** -0.5,
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            rotary_dim=rotary_dim(config, head_dim, FULL),
            config=config,
        )

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, None for a global layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


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


class DecoderLayer(dict):
    """One block's weights by our name (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
    ``down_proj``, ``qkv_bias`` or None, the norms; ``q_norm``/``k_norm`` with Q/K norms;
    ``pre_feedforward_layernorm``/``post_feedforward_layernorm`` in Gemma's block), plus
    the block's attention settings.

    Attributes:
        sliding_window: keys per query, or None.
        rotary: the block's ``RotaryEmbedding`` (Gemma 3's local and global layers differ).
    """

    def __init__(self, weights: dict[str, Any], sliding_window: int | None,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(weights)
        self.sliding_window = sliding_window
        self.rotary = rotary


class CausalLM:
    """A decoder-only LM over the paged KV cache.

    Each weight is a dense tensor or a ``QuantizedWeight``, with Q/K/V and gate/up
    fused into one matmul each (``quant.fuse_rows``). Biases and norms are dense. Under
    tensor parallelism (``parallel_state`` initialised with size > 1) the model keeps
    only this rank's shard (``distributed.tensor_parallel``: heads, MLP rows and
    vocabulary split; norms, Q/K norms included, replicated) and ``self.arch`` has this
    rank's head counts; the forward all-reduces after ``o_proj`` and ``down_proj`` and
    around the embedding, and ``compute_logits`` gathers on rank 0.

    Args:
        arch: model shape (``DecoderArch.from_hf_config``).
        weights: ``{hf_name: tensor or QuantizedWeight}`` as produced by
            ``loader.load_weights`` (consumed). A GGUF file's ``rope_freqs`` (llama3
            RoPE) divides the rotary frequencies, as in llama.cpp.
        dtype: compute dtype of activations, KV cache and dense weights; quantized
            weights keep their format.
        max_model_len: positions the RoPE tables cover.

    Raises:
        ValueError: a weight is missing, or the checkpoint has biases this model does
            not implement.
    """

    def __init__(self, arch: DecoderArch, weights: dict[str, Any], dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.prepare_weights(weights, arch)
        self.tp_size = tp.get_tp_size()
        self.vocab_size = arch.vocab_size
        self.vocab_start = 0
        if self.tp_size > 1:
            arch, self.vocab_start = shard_llama_weights(weights, arch, tp.get_tp_rank(),
                                                         self.tp_size)
        self.arch = arch
        self.dtype = dtype
        self.scale = arch.attn_scale or arch.head_dim ** -0.5
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.act = GATED_ACTIVATIONS[arch.hidden_act]
        self.max_model_len = max_model_len

        freq_factors = weights.pop("rope_freqs", None)
        self.rotaries = {
            lt: rotary_embedding(arch.config, arch.head_dim, lt, max_model_len, dtype,
                                 freq_factors)
            for lt in dict.fromkeys(arch.layer_types or (FULL,))}
        self.rotary = self.rotaries.get(FULL) or next(iter(self.rotaries.values()))

        def take(name: str) -> torch.Tensor | QuantizedWeight:
            try:
                w = weights.pop(name)
            except KeyError:
                raise ValueError(f"weight {name!r} missing from the checkpoint") from None
            if isinstance(w, QuantizedWeight):
                return w
            if name.endswith("norm.weight") and arch.norm_offset:
                w = w.float() + arch.norm_offset  # Gemma's (1 + w), in fp32 as HF adds it
            return w.to(dtype).contiguous()

        self.embed_tokens = take("model.embed_tokens.weight")
        self.embed_scale = (None if arch.embed_scale is None
                            else torch.tensor(arch.embed_scale).to(dtype))
        self.layers = [self.load_layer(take, i) for i in range(arch.num_layers)]
        self.norm = take("model.norm.weight")
        if arch.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight")
        self.lm_head_tiles = self.pack_lm_head()
        ignored = sorted(name for name in weights if name.endswith(".bias"))
        if ignored:  # e.g. Llama's attention_bias (o_proj) or mlp_bias: refuse, never drop
            raise ValueError(f"the checkpoint has biases this model does not implement: "
                             f"{', '.join(ignored[:3])}{' ...' if len(ignored) > 3 else ''}")
        self.decode_layers = None
        if self.fused_decode_blocker() is None:
            self.decode_layers = self.build_decode_layers()

    # -- loading -----------------------------------------------------------------------------

    def prepare_weights(self, weights: dict[str, Any], arch: DecoderArch) -> None:
        """Bring a family's checkpoint to the shared HF names (in place), before any
        tensor-parallel split; nothing to do for Llama-named checkpoints."""

    def load_layer(self, take: Callable[[str], Any], i: int) -> DecoderLayer:
        """Block ``i``'s weights from the HF names of ``model.layers.{i}``."""
        arch, p = self.arch, f"model.layers.{i}."
        w = {
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
            w["qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        if arch.qk_norm:
            w["q_norm"] = take(p + "self_attn.q_norm.weight")
            w["k_norm"] = take(p + "self_attn.k_norm.weight")
        if arch.sandwich_norm:
            w["pre_feedforward_layernorm"] = take(p + "pre_feedforward_layernorm.weight")
            w["post_feedforward_layernorm"] = take(p + "post_feedforward_layernorm.weight")
        layer_type = arch.layer_types[i] if arch.layer_types else FULL
        return DecoderLayer(w, arch.window_of(i) if arch.layer_types else None,
                            self.rotaries[layer_type])

    def pack_lm_head(self) -> torch.Tensor | None:
        """The LM head's weight decoded once into the AMX GEMM's bf16 tiles
        (``quant.pack_amx_tiles``), or None: not asked for (``AIOENGINE_PACKED_LM_HEAD=1``
        asks), AMX off
        (``AIOENGINE_AMX=0``) or fp32-grade (``AIOENGINE_BF16_GEMM=0``), no AMX-BF16 on
        this CPU, or a head in another format. A step of 9+ rows then loads the tiles
        instead of decoding the head's blocks (SmolLM2's tied Q8_0 head at 32 rows:
        bench/README.md); logits and greedy tokens are the same bit for bit. Costs 2 bytes
        a parameter beside the quantized copy (which the embedding lookup keeps), logged.
        """
        if not (quant.packed_lm_head_requested() and cpu_ops.amx_requested()
                and cpu_ops.bf16_gemm_requested()):
            return None
        tiles = quant.pack_amx_tiles(self.lm_head)
        if tiles is not None:
            rows, cols = self.lm_head.shape
            logger.info("LM head %dx%d %s decoded once into AMX bf16 tiles: %.1f MB more "
                        "memory (AIOENGINE_PACKED_LM_HEAD=1)",
                        rows, cols, weight_format(self.lm_head),
                        tiles.numel() * tiles.element_size() / 1e6)
        return tiles

    def fused_decode_blocker(self) -> str | None:
        """Why the C++ decode step cannot run this model (None: it can). The step
        computes the shared block with every twist of ``DecoderArch`` but partial
        rotary: RMSNorm (Gemma's sandwich too), fused QKV (+bias), per-head Q/K norms,
        whole-head rotate-half RoPE from each layer's table, paged attention with the
        layer's sliding window and soft-capping, a SiLU- or GELU(tanh)-gated MLP."""
        arch = self.arch
        if self.tp_size > 1:
            return "tensor parallelism (the Python forward has the all-reduces)"
        if self.norm.device.type != "cpu":
            return "weights off the CPU"
        if (any(not isinstance(w, torch.Tensor) for _, w in self.named_weights())
                and not getattr(cpu_ops, "QUANTIZED_DECODE_LAYERS", False)):
            return "quantized weights without the quantized C++ build"
        if self.fused_activation() is None:
            return f"the {arch.hidden_act} MLP"
        if any(r.rotary_dim != arch.head_dim for r in self.rotaries.values()):
            return "partial rotary"
        return None

    def fused_activation(self) -> str | None:
        """The C++ decode step's name for this model's MLP activation, or None."""
        return {triton_kernels.silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}.get(self.act)

    def build_decode_layers(self) -> cpu_ops.LlamaDecodeLayers | None:
        """The C++ decode step over this model's weights (held, not copied), or None
        when the kernels are not built or a weight is off its fast path."""
        arch = self.arch
        tables = list(self.rotaries.values())
        fused = cpu_ops.LlamaDecodeLayers(
            list(self.layers), self.norm, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.rms_norm_eps, activation=self.fused_activation(),
            attn_logit_softcap=arch.attn_logit_softcap,
            sliding_windows=[layer.sliding_window for layer in self.layers],
            rope_tables=[tables.index(layer.rotary) for layer in self.layers])
        return fused if fused.available else None

    def to_device(self, device: torch.device) -> None:
        """Put every weight, the RoPE tables and the embedding scale on ``device``, in
        place (weights already there are not copied; a tied LM head stays the embedding).
        Off the CPU the C++ decode step is dropped: it reads host memory.

        Raises:
            ValueError: under tensor parallelism (its collectives run on CPUs).
        """
        if self.tp_size > 1:
            raise ValueError("a tensor-parallel model runs on CPUs only")
        moved: dict[int, Weight] = {}

        def move(w: Weight) -> Weight:
            if id(w) not in moved:
                if isinstance(w, tuple):
                    moved[id(w)] = tuple(move(p) for p in w)
                elif isinstance(w, QuantizedWeight):
                    moved[id(w)] = QuantizedWeight(w.data.to(device), w.qtype, w.shape)
                else:
                    moved[id(w)] = w.to(device)
            return moved[id(w)]

        self.embed_tokens = move(self.embed_tokens)
        self.lm_head = move(self.lm_head)
        self.norm = move(self.norm)
        for layer in self.layers:
            for name, w in layer.items():
                if w is not None:
                    layer[name] = move(w)
        for rotary in self.rotaries.values():
            rotary.cos, rotary.sin = rotary.cos.to(device), rotary.sin.to(device)
        if self.embed_scale is not None:
            self.embed_scale = self.embed_scale.to(device)
        if torch.device(device).type != "cpu":
            self.decode_layers = None
            self.lm_head_tiles = None

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

    # -- the forward -------------------------------------------------------------------------

    def attention(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  attn: AttentionMetadata, plan) -> torch.Tensor:
        """Self-attention of one block: ``[num_tokens, hidden]`` -> the ``o_proj``
        output ``[num_tokens, hidden]`` (this rank's partial sum under TP)."""
        arch = self.arch
        num_tokens = x.shape[0]
        qkv = quant.linear(x, layer["qkv_proj"], layer["qkv_bias"])
        qk = qkv[:, :self.q_size + self.kv_size].reshape(num_tokens, -1, arch.head_dim)
        if arch.qk_norm:
            qk = torch.cat((rms_norm(qk[:, :arch.num_heads], layer["q_norm"], arch.rms_norm_eps),
                            rms_norm(qk[:, arch.num_heads:], layer["k_norm"], arch.rms_norm_eps)),
                           dim=1)
        # Q and K heads sit side by side: rotate them in one go.
        qk = layer.rotary.apply(qk, cos, sin)
        q, k = qk[:, :arch.num_heads], qk[:, arch.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].reshape(num_tokens, arch.num_kv_heads,
                                                        arch.head_dim)
        o = paged_attention(q, k, v, key_cache, value_cache, attn, plan, self.scale,
                            layer.sliding_window, arch.attn_logit_softcap)
        return quant.linear(o.reshape(num_tokens, self.q_size), layer["o_proj"])

    def mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """Gated MLP: ``down(act(gate(x)) * up(x))``."""
        return quant.linear(self.act(quant.linear(x, layer["gate_up_proj"])), layer["down_proj"])

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
        eps = arch.rms_norm_eps
        # The step's index math (gather indices, masks, slot checks) once for all layers.
        plan = triton_kernels.plan_attention(attn.slot_mapping, attn.block_tables,
                                             attn.cu_seqlens_q, attn.seq_lens,
                                             attn.max_seqlen_q, attn.max_seqlen_k, kv_cache[0, 0])
        tables = {id(r): (r.cos[positions], r.sin[positions]) for r in self.rotaries.values()}
        if self.tp_size > 1:
            residual = vocab_parallel_embedding(input_ids, self.embed_tokens, self.vocab_start)
        else:
            residual = quant.embedding(input_ids, self.embed_tokens)
        residual = residual.to(self.dtype)  # quantized tables dequantize their rows to fp32
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        if self.decode_layers is not None:
            rows = [tables[id(r)] for r in self.rotaries.values()]  # the layers' rope_tables
            cos = rows[0][0] if len(rows) == 1 else torch.stack([c for c, _ in rows])
            sin = rows[0][1] if len(rows) == 1 else torch.stack([s for _, s in rows])
            hidden = self.decode_layers.forward(residual, cos, sin, kv_cache, plan, self.scale)
            if hidden is not None:
                return hidden
        tables = {k: (c.unsqueeze(1), s.unsqueeze(1)) for k, (c, s) in tables.items()}
        # ``residual`` is the residual stream; each block's output is added to it and
        # normalised in one fused pass (vLLM's fused_add_rms_norm), in place.
        x = rms_norm(residual, self.layers[0]["input_layernorm"], eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                triton_kernels.fused_add_rms_norm(x, residual, layer["input_layernorm"], eps)
            cos, sin = tables[id(layer.rotary)]
            o = self.attention(layer, x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], attn, plan)
            if self.tp_size > 1:
                tp.all_reduce(o)  # row-parallel o_proj: sum the ranks' partial outputs
            if arch.sandwich_norm:
                o = rms_norm(o, layer["post_attention_layernorm"], eps)
                triton_kernels.fused_add_rms_norm(o, residual, layer["pre_feedforward_layernorm"],
                                                  eps)
            else:
                triton_kernels.fused_add_rms_norm(o, residual, layer["post_attention_layernorm"],
                                                  eps)
            x = self.mlp(layer, o)
            if self.tp_size > 1:
                tp.all_reduce(x)  # row-parallel down_proj
            if arch.sandwich_norm:
                x = rms_norm(x, layer["post_feedforward_layernorm"], eps)
        triton_kernels.fused_add_rms_norm(x, residual, self.norm, eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[num_rows, hidden]`` -> fp32 logits ``[num_rows, vocab_size]`` (Gemma 2:
        soft-capped, ``cap * tanh(logits / cap)``).

        Under tensor parallelism every rank must call it (each computes its
        vocabulary slice); rank 0 gets the gathered logits, the others None.
        """
        if isinstance(self.lm_head, torch.Tensor):
            logits = cpu_ops.linear(hidden, self.lm_head)  # F.linear off the fp32 CPU path
        else:
            logits = quant.linear(hidden, self.lm_head, amx_tiles=self.lm_head_tiles)
        if self.tp_size > 1:
            logits = tp.gather_to_first(logits)
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
        logits = logits.float()
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[num_rows, hidden]`` -> ``[num_rows]`` int64: ``compute_logits(hidden).argmax(-1)``
        (first index among equal maxima) without the ``[num_rows, vocab_size]`` logits, by
        the LM head's fused argmax kernel (``quant.argmax_linear``): the same sums as
        ``compute_logits``, so the same tokens.

        Returns None, and the caller computes the logits, where that kernel does not apply:
        a dense LM head, activations off the fp32 CPU path, tensor parallelism (each rank
        holds a vocabulary slice), and Gemma 2's final-logit soft-capping (``tanh`` is
        monotonic, but in fp32 it can round two nearly equal top logits to one value, and
        the capped argmax then takes the lower index).
        """
        if (isinstance(self.lm_head, torch.Tensor) or self.tp_size > 1
                or self.arch.final_logit_softcap is not None):
            return None
        return quant.argmax_linear(hidden, self.lm_head, amx_tiles=self.lm_head_tiles)

