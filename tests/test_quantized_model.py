"""Quantized weights in the model: ``--quantization int8|int4`` on an HF checkpoint,
the quantized forward against its dense twin, and tensor-parallel shards of quantized
weights.

The HF checkpoint is a small random-weight Llama (std 0.1) with the default model's
tokenizer. Thresholds, on the relative L2 error of the prompt's last-token logits
against the fp32 model over three prompts: int8 (Q8_0) below 5%, int4 (Q4_1) below
40% (measured: 2.4% and 28%; Q4_1's step on Gaussian weights is about a quarter of
their standard deviation, and this random network passes that error on undamped).
Weight bytes of the projections: int8 at most 27% of fp32 (34 bytes per 32 weights),
int4 at most 16% (20 bytes per 32); of the whole model (whose 49152-row embedding and
LM head stay Q8_0 in both) at most 27%.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf_models import random_blocks
from parity import assert_greedy_parity

from aioengine import LLM, SamplingParams
from aioengine.distributed.tensor_parallel import shard_llama_weights
from aioengine.entrypoints.cli import build_parser, engine_kwargs
from aioengine.models.llama import AttentionMetadata, LlamaArch, LlamaForCausalLM, weight_nbytes
from aioengine.models.loader import load_hf_config, load_weights
from triton_kernels import cpu_ops
from triton_kernels.quant import QuantizedWeight

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Explain gravity to a child."]
MAX_REL_ERROR = {"int8": 0.05, "int4": 0.40}
MAX_PROJECTION_BYTES_RATIO = {"int8": 0.27, "int4": 0.16}
MAX_BYTES_RATIO = 0.27
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer_dir) -> Path:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    path = tmp_path_factory.mktemp("hf") / "llama-random"
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         initializer_range=0.1)
    torch.manual_seed(0)
    HFLlama(config).save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def prefill_logits(llm: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[vocab]`` of the last prompt token, straight through the model."""
    runner = llm.executor.runner
    n = len(prompt_ids)
    bs = runner.block_size
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(-(-n // bs), dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), max_seqlen_q=n, max_seqlen_k=n)
    hidden = runner.model.forward(torch.tensor(prompt_ids), torch.arange(n), runner.kv_cache,
                                  attn)
    return runner.model.compute_logits(hidden[-1:])[0]


def test_int8_and_int4_are_close_to_fp32_and_smaller(hf_dir):
    results = {}
    for method in ("none", "int8", "int4"):
        llm = LLM(str(hf_dir), executor="inproc", quantization=method,
                  num_gpu_blocks_override=16)
        try:
            ids = [llm.tokenizer.encode(p) for p in PROMPTS]
            logits = [prefill_logits(llm, i) for i in ids]
            out = llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
            model = llm.executor.runner.model
            projection_bytes = sum(weight_nbytes(w) for name, w in model.named_weights()
                                   if name.endswith(PROJECTIONS))
            results[method] = (logits, (model.parameter_bytes(), projection_bytes),
                               model.weight_formats(), llm.model_info)
        finally:
            llm.shutdown()
    ref_logits, ref_bytes, ref_formats, ref_info = results["none"]
    # Embedding, final norm, LM head, and per layer 2 norms + qkv, o, gate_up, down.
    assert ref_formats == {"F32": 3 + 2 * 6} and ref_info.quantization == "none"
    errors = {m: [((a - b).norm() / b.norm()).item() for a, b in zip(results[m][0], ref_logits)]
              for m in ("int8", "int4")}
    for method in ("int8", "int4"):
        nbytes, projection_bytes = results[method][1]
        print(f"{method}: relative logit error {max(errors[method]):.4f}, bytes "
              f"{nbytes / ref_bytes[0]:.3f} of fp32 ({projection_bytes / ref_bytes[1]:.3f} "
              f"for the projections)")
    for method in ("int8", "int4"):
        _, (nbytes, projection_bytes), formats, info = results[method]
        assert max(errors[method]) < MAX_REL_ERROR[method], errors
        assert nbytes <= MAX_BYTES_RATIO * ref_bytes[0]
        assert projection_bytes <= MAX_PROJECTION_BYTES_RATIO[method] * ref_bytes[1]
        proj = "Q8_0" if method == "int8" else "Q4_1"
        # 2 layers x (qkv, o, gate_up, down); embedding and LM head at Q8_0; 5 norms F32.
        expected = {proj: 8, "Q8_0": 2, "F32": 5} if method == "int4" else {"Q8_0": 10,
                                                                            "F32": 5}
        assert formats == expected, formats
        assert info.quantization == method
        assert info.weight_formats == ({"Q8_0": 16, "F32": 5} if method == "int8"
                                       else {"Q4_1": 14, "F32": 5, "Q8_0": 2})


def test_cli_carries_quantization():
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "--quantization", "int4"]))[
        "quantization"] == "int4"
    assert engine_kwargs(parser.parse_args(["generate", "hi", "-q", "int8"]))[
        "quantization"] == "int8"
    assert engine_kwargs(parser.parse_args(["serve"]))["quantization"] == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "fp4"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="awq")


def _model(weights: dict, hf_config) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaArch.from_hf_config(hf_config), weights, torch.float32, 64)


def test_quantized_forward_equals_the_dense_forward_on_dequantized_weights(hf_dir):
    """The model's quantized path (quant.linear / embedding / fuse_rows) computes what
    the dense path computes on the dequantized weights, up to summation order."""
    hf_config = load_hf_config(str(hf_dir))
    quantized = load_weights(str(hf_dir), hf_config, torch.float32, "int4")
    dense = {k: v.dequantize() if isinstance(v, QuantizedWeight) else v.clone()
             for k, v in quantized.items()}
    models = [_model(quantized, hf_config), _model(dense, hf_config)]
    assert models[0].decode_layers is None or getattr(cpu_ops, "QUANTIZED_DECODE_LAYERS", False)
    ids = torch.tensor([1, 504, 2988, 314, 42, 7042, 30])
    n = len(ids)
    outs = []
    for model in models:
        a = model.arch
        kv = torch.zeros(a.num_layers, 2, 4, 16, a.num_kv_heads, a.head_dim)
        attn = AttentionMetadata(torch.arange(n), torch.tensor([[0]], dtype=torch.int32),
                                 torch.tensor([0, n], dtype=torch.int32),
                                 torch.tensor([n], dtype=torch.int32), n, n)
        outs.append(model.compute_logits(model.forward(ids, torch.arange(n), kv, attn)))
    scale = outs[1].abs().max().item()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4 * scale)


def _arch(**kw) -> LlamaArch:
    base = dict(vocab_size=100, hidden_size=512, intermediate_size=512, num_layers=1,
                num_heads=8, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False)
    return dataclasses.replace(LlamaArch(**base), **kw)


def test_tensor_parallel_shards_of_quantized_weights(caplog):
    """Column-parallel shards are byte-row views; row-parallel shards cut whole blocks;
    a cut inside a block (Q4_K's 256 over 4 ranks of 128 columns) dequantizes that
    weight with a warning; vocabulary shards are padded with zero blocks."""
    torch.manual_seed(0)
    dense = {"q": torch.randn(512, 512) * 0.1, "o": torch.randn(512, 512) * 0.1,
             "emb": torch.randn(100, 512) * 0.1}
    weights = {
        "model.layers.0.self_attn.q_proj.weight": QuantizedWeight.quantize(dense["q"], QT.Q4_1),
        "model.layers.0.self_attn.o_proj.weight": QuantizedWeight.quantize(dense["o"], QT.Q8_0),
        "model.embed_tokens.weight": QuantizedWeight.quantize(dense["emb"], QT.Q8_0),
    }
    q_full = weights["model.layers.0.self_attn.q_proj.weight"]
    o_full = weights["model.layers.0.self_attn.o_proj.weight"]
    emb_full = weights["model.embed_tokens.weight"]
    shards = dict(weights)
    shard_llama_weights(shards, _arch(), rank=1, tp_size=2)
    q = shards["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (256, 512) and q.data.data_ptr() == q_full.data[256].data_ptr()
    o = shards["model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(o, QuantizedWeight) and o.shape == (512, 256)
    assert torch.equal(o.dequantize(), o_full.dequantize()[:, 256:])
    emb = shards["model.embed_tokens.weight"]
    assert emb.shape == (50, 512) and torch.equal(emb.dequantize(), emb_full.dequantize()[50:])

    # A K-quant row-parallel weight cut inside its 256-element blocks.
    blocks = random_blocks(512, 512, QT.Q4_K, np.random.default_rng(0))
    k_weight = QuantizedWeight(torch.from_numpy(blocks), QT.Q4_K, (512, 512))
    shards = {"model.layers.0.self_attn.o_proj.weight": k_weight}
    with caplog.at_level(logging.WARNING):
        shard_llama_weights(shards, _arch(num_heads=4, num_kv_heads=4, head_dim=128), rank=3,
                            tp_size=4)
    o = shards["model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(o, torch.Tensor) and o.shape == (512, 128)
    assert torch.equal(o, k_weight.dequantize()[:, 384:])
    assert "not a multiple of the Q4_K block size 256" in caplog.text

    # The last vocabulary shard is padded with zero blocks, which dequantize to zeros.
    shards = {"model.embed_tokens.weight": emb_full}
    shard_llama_weights(shards, _arch(num_heads=3, num_kv_heads=3, intermediate_size=192),
                        rank=2, tp_size=3)
    emb = shards["model.embed_tokens.weight"]
    assert emb.shape == (34, 512)
    assert torch.equal(emb.dequantize()[:32], emb_full.dequantize()[68:])
    assert not emb.dequantize()[32:].any()


def test_int8_tp2_greedy_matches_int8_tp1(hf_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(**kwargs):
        llm = LLM(str(hf_dir), quantization="int8", num_gpu_blocks_override=64,
                  num_threads=1, **kwargs)
        try:
            outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        finally:
            llm.shutdown()
        return [(o.outputs[0].token_ids,
                 [sorted(lp.values(), reverse=True)[:2] for lp in o.outputs[0].logprobs])
                for o in outs]

    ref = run(executor="inproc")
    ours = run(tensor_parallel_size=2)
    for prompt, a, b in zip(PROMPTS, ours, ref):
        assert_greedy_parity(f"int8 TP=2 {prompt!r}", a[0], b[0], a[1], b[1])
