"""The fused C++ decode path (cpu_ops.linear, cpu_ops.LlamaDecodeLayers).

- ``linear`` must equal ``F.linear`` over row counts on both sides of the skinny/MKL
  switch (16 rows), odd N and K (tile and vector tails) and with a bias.
- ``LlamaDecodeLayers`` must give the Python forward's hidden states and write the same
  K/V into the same cache slots, for MHA and GQA, with and without QKV bias, at block
  sizes 1 and 16, one and many sequences, shuffled block tables, garbage in every cache
  slot the step must not read (NaN, for the fused path alone); a plan that does not fit
  the cache is refused before anything is written.
- With quantized projections (every format family, QKV as parts of mixed formats, dense
  parts beside quantized ones) ``LlamaDecodeLayers`` must give the Python forward's result
  on the dequantized weights, on both sides of the GEMV/GEMM switch at 8 rows (1, 5, 20 sequences).
- Through the engine, greedy tokens on small random Llama, Qwen2 and Mistral models must
  equal HF transformers' (near-tie rule), with the fused path counted as taken.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from parity import assert_greedy_parity, hf_greedy

from gguf import GGMLQuantizationType
from test_quant_cpu import random_weight

from triton_kernels import cpu_ops
from triton_kernels.quant import QuantizedWeight, fuse_rows

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="the C++ CPU kernels did not build here")


# -- linear -----------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 17), (64, 576), (1003, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    out = cpu_ops.linear(x, w, bias)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-5 * k ** 0.5, rtol=1e-5)


def test_linear_takes_a_non_contiguous_input_and_other_dtypes_go_to_torch():
    x = torch.randn(6, 40)[:, :33]  # rows not contiguous
    w = torch.randn(9, 33)
    torch.testing.assert_close(cpu_ops.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_ops.linear(xb, wb), F.linear(xb, wb))


# -- the decoder layers against the Python forward ----------------------------------------


def count_fused_steps(fused: cpu_ops.LlamaDecodeLayers) -> list[bool]:
    """Wrap ``fused.forward``; the list gets True for each step it ran, False for each it
    declined (returned None)."""
    steps: list[bool] = []
    real = fused.forward

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        steps.append(out is not None)
        return out

    fused.forward = forward
    return steps

ARCHS = {
    "llama_mha": dict(model_type="llama", heads=4, kv_heads=4, head_dim=16),
    "llama_gqa3": dict(model_type="llama", heads=6, kv_heads=2, head_dim=32),
    "qwen2_bias_gqa8": dict(model_type="qwen2", heads=8, kv_heads=1, head_dim=64),
}


def hf_config(model_type: str, heads: int, kv_heads: int, head_dim: int, layers: int = 3,
              vocab: int = 300, intermediate: int = 96):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    extra = {"sliding_window": None} if model_type in ("qwen2", "mistral") else {}
    return cls(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
               num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, max_position_embeddings=512,
               rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
               **extra)


def our_model(config):
    """Our LlamaForCausalLM on an HF model's random weights (std 0.1)."""
    from transformers import AutoModelForCausalLM

    from aioengine.models.llama import LlamaArch, LlamaForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.model_type == "qwen2":  # HF initialises biases to zero: make them matter
        for name, t in weights.items():
            if name.endswith("_proj.bias"):
                t.normal_(0, 0.1)
    return LlamaForCausalLM(LlamaArch.from_hf_config(config), weights, torch.float32, 512)


def decode_step(model, seq_lens: list[int], block_size: int, num_blocks: int, seed: int):
    """One decode step's inputs over a random cache: each sequence owns shuffled blocks
    holding its first ``seq_len - 1`` tokens; every other slot holds garbage of magnitude
    1e3 that would change the output if attention read it (the Python path masks it; NaN
    would poison its masked sum too)."""
    from aioengine.models.llama import AttentionMetadata

    a = model.arch
    g = torch.Generator().manual_seed(seed)
    kv_cache = 1e3 * torch.randn(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads,
                                 a.head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = -(-max(seq_lens) // block_size)
    block_tables = torch.zeros(len(seq_lens), max_blocks + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        blocks = perm[used:used + nb]
        used += nb
        block_tables[i, :nb] = blocks
        block_tables[i, nb:] = perm[-1]  # padding: a real block (the plan clamps anyway)
        for t in range(n - 1):  # the context before the new token
            kv_cache[:, :, blocks[t // block_size], t % block_size] = torch.randn(
                a.num_layers, 2, a.num_kv_heads, a.head_dim, generator=g)
        slots.append(int(blocks[(n - 1) // block_size]) * block_size + (n - 1) % block_size)
    assert used < num_blocks, "the test needs one block no sequence owns"
    num = len(seq_lens)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=block_tables,
        cu_seqlens_q=torch.arange(num + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), max_seqlen_q=1,
        max_seqlen_k=max(seq_lens))
    input_ids = torch.randint(0, a.vocab_size, (num,), generator=g)
    positions = torch.tensor(seq_lens) - 1
    return input_ids, positions, kv_cache, attn


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 1, 70, 16, 33],
                                      [9 + 3 * i for i in range(20)]])
def test_decode_layers_equal_the_python_forward(arch, block_size, seq_lens):
    model = our_model(hf_config(**ARCHS[arch]))
    fused = model.decode_layers
    assert fused is not None and fused.available
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    input_ids, positions, kv_cache, attn = decode_step(model, seq_lens, block_size, num_blocks,
                                                       seed=len(seq_lens) * block_size)
    calls = count_fused_steps(fused)
    cache_fused = kv_cache.clone()
    hidden = model.forward(input_ids, positions, cache_fused, attn)
    assert calls == [True], "the decode step did not take the fused path"
    model.decode_layers = None  # the Python forward, the oracle
    cache_python = kv_cache.clone()
    expected = model.forward(input_ids, positions, cache_python, attn)
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
    # The same slots written with the same K/V; every other slot (context or garbage) as
    # the Python path left it, that is untouched.
    torch.testing.assert_close(cache_fused, cache_python, atol=1e-4, rtol=1e-4)
    assert not torch.equal(cache_fused, kv_cache), "nothing was written"


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama_gqa3", "qwen2_bias_gqa8"])
@pytest.mark.parametrize("seq_lens", [[37], [5, 1, 70, 16, 33]])
def test_decode_layers_over_a_half_kv_cache_equal_the_python_forward(cache_dtype, arch,
                                                                     seq_lens):
    """--kv-cache-dtype float16/bfloat16 under fp32 activations: the fused step writes K/V
    rounded to the cache's dtype and attends over it as the Python path (index_copy_ into
    the cache, gather, upcast, SDPA) does; and both differ from an fp32 cache's result
    only by that rounding."""
    model = our_model(hf_config(**ARCHS[arch]))
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 2
    input_ids, positions, kv_cache, attn = decode_step(model, seq_lens, 16, num_blocks, seed=3)
    half = kv_cache.to(cache_dtype)
    calls = count_fused_steps(model.decode_layers)
    cache_fused = half.clone()
    hidden = model.forward(input_ids, positions, cache_fused, attn)
    assert calls == [True], "the decode step did not take the fused path"
    assert cache_fused.dtype == cache_dtype
    model.decode_layers = None  # the Python layer loop: the reference
    cache_python = half.clone()
    expected = model.forward(input_ids, positions, cache_python, attn)
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
    # K/V equal up to one rounding step of the cache dtype (their fp32 values agree to 1e-4)
    step = 2 ** -10 if cache_dtype == torch.float16 else 2 ** -7
    torch.testing.assert_close(cache_fused.float(), cache_python.float(), atol=1e-4, rtol=step)
    assert not torch.equal(cache_fused, half), "nothing was written"
    # The same step over the fp32 cache: close (the rounding of K/V), not equal.
    full = model.forward(input_ids, positions, kv_cache.clone(), attn)
    assert not torch.equal(full, hidden)
    tol = 2e-2 if cache_dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(hidden, full, atol=tol * full.abs().max().item(), rtol=0)


def mixed_step(model, q_lens: list[int], seq_lens: list[int], block_size: int, seed: int):
    """``decode_step`` for sequences with ``q_len`` new tokens each (prompt chunks and decode
    rows): each holds its first ``seq_len - q_len`` tokens in shuffled blocks, garbage
    of magnitude 1e3 elsewhere, and the step writes positions ``seq_len - q_len ..``."""
    from aioengine.models.llama import AttentionMetadata

    a = model.arch
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    kv_cache = 1e3 * torch.randn(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads,
                                 a.head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = -(-max(seq_lens) // block_size)
    block_tables = torch.full((len(seq_lens), max_blocks + 1), int(perm[-1]), dtype=torch.int32)
    slots, positions, used = [], [], 0
    for i, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        nb = -(-n // block_size)
        blocks = perm[used:used + nb]
        used += nb
        block_tables[i, :nb] = blocks
        for t in range(n):
            slot = int(blocks[t // block_size]) * block_size + t % block_size
            if t < n - q:
                kv_cache.view(a.num_layers, 2, -1, a.num_kv_heads, a.head_dim)[:, :, slot] = (
                    torch.randn(a.num_layers, 2, a.num_kv_heads, a.head_dim, generator=g))
            else:
                slots.append(slot)
                positions.append(t)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=block_tables, cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens))
    input_ids = torch.randint(0, a.vocab_size, (len(slots),), generator=g)
    return input_ids, torch.tensor(positions), kv_cache, attn


# (q_lens, seq_lens): decode rows around a chunk after a prefix that is not block-aligned;
# a whole prompt alone; prompts and chunks only; a chunk past 256 keys (two spans).
MIXED_STEPS = {
    "decodes_and_a_chunk": ([1, 1, 20, 1], [30, 1, 57, 16]),
    "prompt_alone": ([37], [37]),
    "chunks_only": ([5, 70, 16], [5, 70, 48]),
    "long_prefix": ([1, 33, 1], [9, 300, 290]),
}


@pytest.mark.parametrize("step,arch,cache_dtype", [
    *((step, arch, torch.float32) for step in MIXED_STEPS
      for arch in ("llama_gqa3", "qwen2_bias_gqa8", "mistral_window")),
    ("decodes_and_a_chunk", "qwen2_bias_gqa8", torch.float16),
    ("long_prefix", "mistral_window", torch.float16)])
def test_mixed_and_prefill_steps_equal_the_python_forward(step, arch, cache_dtype):
    """Steps with prompt chunks run the fused layers (decode rows through the decode
    kernel, chunks through the C++ prefill attention) and equal the Python layer loop:
    hidden states and every cache slot, over garbage the chunk must not see."""
    if arch == "mistral_window":  # a 24-key sliding window: chunks reach past it
        config = hf_config("mistral", 6, 2, 32)
        config.sliding_window = 24
    else:
        config = hf_config(**ARCHS[arch])
    model = our_model(config)
    q_lens, seq_lens = MIXED_STEPS[step]
    input_ids, positions, kv_cache, attn = mixed_step(model, q_lens, seq_lens, 16, seed=5)
    kv_cache = kv_cache.to(cache_dtype)
    calls = count_fused_steps(model.decode_layers)
    cache_fused = kv_cache.clone()
    hidden = model.forward(input_ids, positions, cache_fused, attn)
    assert calls == [True], "the step did not take the fused path"
    model.decode_layers = None  # the Python forward, the oracle
    cache_python = kv_cache.clone()
    expected = model.forward(input_ids, positions, cache_python, attn)
    # fp16: a K/V value whose fp32 twins differ by 1e-7 may round to neighbouring fp16
    # values, which the next layers amplify (the kernels alone: tests/test_cpu_ops.py);
    # the tolerance of the decode step's half-cache test.
    atol = {torch.float32: 1e-4, torch.float16: 2e-3 * expected.abs().max().item()}[cache_dtype]
    torch.testing.assert_close(hidden, expected, atol=atol, rtol=1e-4)
    if cache_dtype == torch.float32:
        torch.testing.assert_close(cache_fused, cache_python, atol=1e-4, rtol=1e-4)
    assert not torch.equal(cache_fused, kv_cache), "nothing was written"


def test_bad_shapes_are_refused_by_the_kernel():
    ops = cpu_ops.load()
    w, n = torch.zeros(4, 4), torch.ones(4)

    def layer(norm=n, qkv=w, o=w, gate_up=w, down=w, bias=None):
        dense = [ops.Projection(parts=[t], qtypes=[0]) for t in (qkv, o, gate_up, down)]
        return ops.DecoderLayerWeights(input_layernorm=norm, post_attention_layernorm=norm,
                                       qkv_bias=bias, qkv_proj=dense[0], o_proj=dense[1],
                                       gate_up_proj=dense[2], down_proj=dense[3])

    with pytest.raises(RuntimeError, match="at least one layer"):
        ops.LlamaDecodeLayers([], n, 1, 1, 4, 1e-5)
    with pytest.raises(RuntimeError, match="input_layernorm must be contiguous fp32 \\[8\\]"):
        ops.LlamaDecodeLayers([layer()], torch.ones(8), 2, 1, 4, 1e-5)
    # hidden 8 (from the final norm) but 4-wide projections
    with pytest.raises(RuntimeError, match=r"F32 part must be fp32 \[rows, 8\]"):
        ops.LlamaDecodeLayers([layer(norm=torch.ones(8))], torch.ones(8), 2, 1, 4, 1e-5)
    with pytest.raises(RuntimeError, match="unexpected weight shapes"):
        ops.LlamaDecodeLayers([layer(qkv=torch.zeros(10, 4), gate_up=torch.zeros(6, 4),
                                     down=torch.zeros(4, 3))], n, 1, 1, 4, 1e-5)
    with pytest.raises(RuntimeError, match="qkv_bias must be contiguous fp32 \\[12\\]"):
        ops.LlamaDecodeLayers([layer(qkv=torch.zeros(12, 4), bias=torch.zeros(5))], n, 1, 1, 4,
                              1e-5)
    with pytest.raises(TypeError):  # the weights are named: no positional lists
        ops.DecoderLayerWeights(n, n, None, *[ops.Projection(parts=[w], qtypes=[0])] * 4)


# -- quantized projections against the Python forward on their dequantized values ---------

QT = GGMLQuantizationType
QUANT_ARCH = dict(model_type="llama", heads=4, kv_heads=2, head_dim=64)  # hidden 256, K-quant rows


def quantize(w: torch.Tensor, qtype, seed: int):
    """A QuantizedWeight for ``w``'s shape: gguf's quantizer where it has one, random
    blocks with small finite scales for the K-quants (gguf has no K-quant quantizer)."""
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        data = random_weight(qtype, w.shape[0], w.shape[1], seed=seed, scale=0.01)
        return QuantizedWeight(torch.from_numpy(data), qtype, tuple(w.shape))
    return QuantizedWeight.quantize(w, qtype)


#: per projection: a format, a tuple of formats split by rows (q, k, v), or None (dense)
QUANT_LAYOUTS = {
    "q4_1": (QT.Q4_1, QT.Q4_1, QT.Q4_1, QT.Q4_1),  # the default model's file
    "q8_0": (QT.Q8_0, QT.Q8_0, QT.Q8_0, QT.Q8_0),
    "q4_k_m": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), QT.Q4_K, QT.Q4_K, QT.Q6_K),
    "mixed": (None, QT.Q5_0, QT.Q5_1, QT.BF16),
    "q5_k_f16": ((QT.Q5_K, None, QT.F16), QT.Q5_K, QT.F16, QT.Q5_K),
}


def quantize_layers(model, layout) -> list[tuple]:
    """Quantize ``model``'s projections by ``layout`` and put their dequantized values back
    into the model (the Python forward's oracle weights); returns the fused path's layers."""
    a = model.arch
    q_rows, kv_rows = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    fused_layers = []
    for i, layer in enumerate(model.layers):
        quantized = {}
        for j, (name, fmt) in enumerate(zip(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                                            layout)):
            dense = layer[name]
            if fmt is None:
                quantized[name] = dense
            elif isinstance(fmt, tuple):
                splits = dense.split([q_rows, kv_rows, kv_rows])
                parts = [s.contiguous() if f is None else quantize(s, f, seed=100 * i + 10 * j + k)
                         for k, (s, f) in enumerate(zip(splits, fmt))]
                quantized[name] = fuse_rows(parts)
            else:
                quantized[name] = quantize(dense, fmt, seed=100 * i + j)
            w = quantized[name]
            layer[name] = (torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize()
                                      for p in w]) if isinstance(w, tuple)
                           else w if isinstance(w, torch.Tensor) else w.dequantize())
        fused_layers.append((layer["input_layernorm"], layer["post_attention_layernorm"],
                             quantized["qkv_proj"], layer["qkv_bias"], quantized["o_proj"],
                             quantized["gate_up_proj"], quantized["down_proj"]))
    return fused_layers


def test_the_module_says_it_takes_quantized_layers():
    assert cpu_ops.QUANTIZED_DECODE_LAYERS is True


@pytest.mark.parametrize("layout", list(QUANT_LAYOUTS))
@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 1, 70, 16, 33],
                                      [9 + 3 * i for i in range(20)]])
def test_quantized_decode_layers_equal_the_python_forward(layout, seq_lens):
    model = our_model(hf_config(**QUANT_ARCH, intermediate=512))
    a = model.arch
    layers = quantize_layers(model, QUANT_LAYOUTS[layout])
    fused = cpu_ops.LlamaDecodeLayers(layers, model.norm, a.num_heads, a.num_kv_heads,
                                      a.head_dim, a.rms_norm_eps)
    assert fused.available
    if layout == "q4_k_m":
        assert isinstance(layers[0][2], tuple)  # QKV stays parts of two formats
    model.decode_layers = fused
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 2
    input_ids, positions, kv_cache, attn = decode_step(model, seq_lens, 16, num_blocks,
                                                       seed=len(seq_lens))
    calls = count_fused_steps(fused)
    cache_fused = kv_cache.clone()
    hidden = model.forward(input_ids, positions, cache_fused, attn)
    assert calls == [True], "the decode step did not take the fused path"
    model.decode_layers = None  # the Python forward on the dequantized weights, the oracle
    cache_python = kv_cache.clone()
    expected = model.forward(input_ids, positions, cache_python, attn)
    torch.testing.assert_close(hidden, expected, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(cache_fused, cache_python, atol=2e-4, rtol=2e-4)
    assert not torch.equal(cache_fused, kv_cache), "nothing was written"


def test_quantized_weights_off_the_fast_path_leave_it_unavailable():
    model = our_model(hf_config(**QUANT_ARCH, intermediate=512))
    a = model.arch
    layers = quantize_layers(model, QUANT_LAYOUTS["mixed"])
    bf16 = [(*layer[:2], layer[2].bfloat16(), *layer[3:]) for layer in layers]  # dense bf16
    fused = cpu_ops.LlamaDecodeLayers(bf16, model.norm, a.num_heads, a.num_kv_heads, a.head_dim,
                                      a.rms_norm_eps)
    assert not fused.available


# -- through the engine, against HF transformers ----------------------------------------


@pytest.mark.parametrize("model_type,heads,kv_heads", [("llama", 8, 2), ("qwen2", 4, 4),
                                                      ("mistral", 6, 3)])
def test_engine_greedy_matches_hf_on_random_models(model_type, heads, kv_heads, tmp_path,
                                                   tokenizer_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from aioengine import LLM, SamplingParams
    from aioengine.models import llama

    config = hf_config(model_type, heads, kv_heads, 32, layers=2, vocab=49152, intermediate=256)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config).eval()
    if model_type == "qwen2":
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)

    models = []
    real_init = llama.LlamaForCausalLM.__init__

    def counting_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        models.append(count_fused_steps(self.decode_layers))

    monkeypatch.setattr(llama.LlamaForCausalLM, "__init__", counting_init)
    llm = LLM(str(tmp_path), executor="inproc", dtype="float32")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 11, 29)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    (fused_steps,) = models
    # The prefill step and 11 decode steps for 3 requests in one batch, every one fused.
    assert len(fused_steps) >= 12 and all(fused_steps), fused_steps
    ties = []
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_top2 = hf_greedy(hf, prompt, 12)
        ours = out.outputs[0]
        ours_top2 = [sorted(lp.values(), reverse=True)[:2] for lp in ours.logprobs]
        ties.append(assert_greedy_parity(f"{model_type} {len(prompt)}-token prompt",
                                         ours.token_ids, ref_tokens, ours_top2, ref_top2))
    assert sum(t is None for t in ties) >= len(ties) - 1, ties


# -- refusals and guards (found by a break-it review) --------------------------------------


def test_fused_path_alone_stays_finite_with_nan_in_every_unread_slot():
    model = our_model(hf_config(**ARCHS["llama_gqa3"]))
    input_ids, positions, kv_cache, attn = decode_step(model, [5, 1, 70, 16, 33], 16, 16, seed=3)
    written = torch.zeros(kv_cache.shape[2] * kv_cache.shape[3], dtype=torch.bool)
    lens = attn.seq_lens.tolist()
    for i, n in enumerate(lens):
        for t in range(n):
            b = int(attn.block_tables[i, t // 16])
            written[b * 16 + t % 16] = True
    flat = kv_cache.view(kv_cache.shape[0], 2, -1, *kv_cache.shape[4:])
    flat[:, :, ~written] = float("nan")
    hidden = model.forward(input_ids, positions, kv_cache, attn)
    assert torch.isfinite(hidden).all()


def test_a_plan_for_another_cache_is_refused_before_anything_is_written():
    import triton_kernels

    model = our_model(hf_config(**ARCHS["llama_gqa3"]))
    _, positions, kv_cache, attn = decode_step(model, [5, 9], 16, 4, seed=4)
    big = torch.zeros(kv_cache.shape[0], 2, 64, *kv_cache.shape[3:])
    plan = triton_kernels.plan_attention(attn.slot_mapping + 16 * 40, attn.block_tables + 40,
                                         attn.cu_seqlens_q, attn.seq_lens, 1,
                                         attn.max_seqlen_k, big[0, 0])  # slots past the small cache
    a = model.arch
    residual = torch.randn(2, a.hidden_size)
    cos = model.rotary.cos[positions]
    sin = model.rotary.sin[positions]
    before = kv_cache.clone()
    with pytest.raises(ValueError, match="do not match the plan"):
        model.decode_layers.forward(residual, cos, sin, kv_cache, plan, model.scale)
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize("bad", ["slot", "block_id", "seq_len"])
def test_the_kernel_checks_slots_and_block_ids_itself(bad):
    model = our_model(hf_config(**ARCHS["llama_mha"]))
    a = model.arch
    kv_cache = torch.zeros(a.num_layers, 2, 4, 16, a.num_kv_heads, a.head_dim)
    slots = torch.tensor([3])
    block_tables = torch.tensor([[1]], dtype=torch.int32)
    seq_lens = torch.tensor([4], dtype=torch.int32)
    if bad == "slot":
        slots = torch.tensor([4 * 16])
    elif bad == "block_id":
        block_tables = torch.tensor([[4]], dtype=torch.int32)
    else:
        seq_lens = torch.tensor([17], dtype=torch.int32)
    impl = model.decode_layers._impl
    cos, sin = model.rotary.cos[:1].contiguous(), model.rotary.sin[:1].contiguous()
    with pytest.raises(RuntimeError, match="outside"):
        impl.forward(torch.randn(1, a.hidden_size), cos, sin, kv_cache, slots, block_tables,
                     seq_lens, model.scale)
    assert not kv_cache.any()


@pytest.mark.parametrize("bad", ["ends_short", "chunk_past_seq_len"])
def test_the_kernel_checks_the_query_start_locations(bad):
    """A step with prompt chunks: query_start_loc must run from 0 to the step's tokens and
    no chunk may be longer than its sequence (its rows would read before position 0)."""
    model = our_model(hf_config(**ARCHS["llama_mha"]))
    a = model.arch
    kv_cache = torch.zeros(a.num_layers, 2, 4, 16, a.num_kv_heads, a.head_dim)
    slots = torch.tensor([16, 17, 18])
    block_tables = torch.tensor([[1]], dtype=torch.int32)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    if bad == "ends_short":
        qsl = torch.tensor([0, 2], dtype=torch.int32)
    else:
        seq_lens = torch.tensor([2], dtype=torch.int32)
    cos, sin = model.rotary.cos[:3].contiguous(), model.rotary.sin[:3].contiguous()
    with pytest.raises(RuntimeError, match=r"query_start_loc|outside"):
        model.decode_layers._impl.forward(torch.randn(3, a.hidden_size), cos, sin, kv_cache,
                                          slots, block_tables, seq_lens, model.scale, qsl)
    assert not kv_cache.any()


def test_linear_hands_what_it_does_not_cover_to_f_linear():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    # a bias F.linear broadcasts
    torch.testing.assert_close(cpu_ops.linear(x, w, torch.ones(1)), F.linear(x, w, torch.ones(1)))
    # gradients flow
    wg = w.clone().requires_grad_()
    cpu_ops.linear(x, wg).sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand(5, 8))
    # a lazily negated weight
    neg = w._neg_view()  # torch.neg as a lazy view (is_neg() is True)
    torch.testing.assert_close(cpu_ops.linear(x, neg), F.linear(x, -w))


def test_checkpoint_biases_the_model_lacks_are_refused():
    from transformers import LlamaConfig

    config = hf_config("llama", 4, 2, 16)
    config = LlamaConfig(**{**config.to_dict(), "attention_bias": True})
    with pytest.raises(ValueError, match="biases this model does not implement"):
        our_model(config)
