"""The fused C++ decode step (``cpu_ops.LlamaDecodeLayers``) on the families' twists.

Against the Python layer loop of the same model (the oracle, itself checked against HF
transformers in ``test_model_families.py``), one decode step must give the same hidden
states and write the same K/V into the same cache slots, for:

- Qwen3: per-head Q/K RMSNorm before RoPE, ``head_dim`` 32 != hidden / heads;
- Gemma 3: ``(1 + weight)`` norms, sandwich norms, GeGLU, Q/K norms,
  ``query_pre_attn_scalar``, a local layer with an 8-token window and its own RoPE
  base beside a global layer with linear-scaled RoPE;
- Gemma 2: attention-logit soft-capping, local and global layers;
- Mistral: one sliding window for every layer;

over contexts shorter and longer than the window (1 to 70 tokens), block sizes 1 and
16, shuffled block tables and garbage in every slot the step must not read; and with
quantized projections (Q8_0, Q4_1: the Python loop on the same quantized weights).
Families the step does not compute (partial rotary) are declined, and the step
refuses a weight it does not know.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from family_models import FAMILIES, build_hf_model, tiny_tokenizer
from gguf import GGMLQuantizationType
from test_decode_layers import count_fused_steps, decode_step

from aioengine.models import registry
from aioengine.models.decoder import DecoderArch
from triton_kernels import cpu_ops
from triton_kernels.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(
    cpu_ops.load() is None, reason="the C++ CPU kernels did not build here"
)

FUSED_FAMILIES = ["qwen3", "gemma3", "gemma2", "mistral"]
SEQ_LENS = [[1], [9], [37], [5, 1, 70, 16, 33]]  # the window is 8 tokens


@cache
def _state(name: str):
    hf = build_hf_model(FAMILIES[name], tiny_tokenizer()[0])
    return hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()}


def our_model(name: str):
    """Our model of ``family_models``' tiny random ``name`` (fp32, max_model_len 512)."""
    config, state = _state(name)
    cls = registry.model_class(registry.family_of_config(config))
    return cls(DecoderArch.from_hf_config(config), dict(state), torch.float32, 512)


def assert_fused_step_equals_python(model, seq_lens, block_size, seed, tol=1e-4):
    fused = model.decode_layers
    assert fused is not None and fused.available
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    input_ids, positions, kv_cache, attn = decode_step(
        model, seq_lens, block_size, num_blocks, seed=seed
    )
    calls = count_fused_steps(fused)
    cache_fused = kv_cache.clone()
    hidden = model.forward(input_ids, positions, cache_fused, attn)
    assert calls == [True], "the decode step did not take the fused path"
    model.decode_layers = None  # the Python layer loop, the oracle
    cache_python = kv_cache.clone()
    expected = model.forward(input_ids, positions, cache_python, attn)
    model.decode_layers = fused
    torch.testing.assert_close(hidden, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(cache_fused, cache_python, atol=tol, rtol=tol)
    assert not torch.equal(cache_fused, kv_cache), "nothing was written"
    return hidden, kv_cache, (input_ids, positions, attn)


@pytest.mark.parametrize("name", FUSED_FAMILIES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_fused_step_equals_the_python_loop(name, block_size, seq_lens):
    model = our_model(name)
    assert model.fused_decode_blocker() is None
    assert_fused_step_equals_python(
        model, seq_lens, block_size, seed=len(seq_lens) * block_size + sum(seq_lens)
    )


def test_the_window_and_the_local_rope_table_change_the_fused_step():
    """A kernel that ignored Gemma 3's window or used the global RoPE table on the
    local layer would still agree on short contexts: on a 37-token one each changes
    the hidden states (so the equality above pins them down)."""
    model = our_model("gemma3")
    hidden, kv_cache, (input_ids, positions, attn) = assert_fused_step_equals_python(
        model, [37], 16, seed=5
    )
    assert [layer.sliding_window for layer in model.layers] == [8, None]
    assert model.layers[0].rotary is not model.layers[1].rotary

    no_window = our_model("gemma3")
    for layer in no_window.layers:
        layer.sliding_window = None
    no_window.decode_layers = no_window.build_decode_layers()
    other = no_window.forward(input_ids, positions, kv_cache.clone(), attn)
    assert not torch.allclose(other, hidden, atol=1e-3)

    one_table = our_model("gemma3")
    one_table.layers[0].rotary = one_table.layers[1].rotary
    one_table.decode_layers = one_table.build_decode_layers()
    other = one_table.forward(input_ids, positions, kv_cache.clone(), attn)
    assert not torch.allclose(other, hidden, atol=1e-3)


QT = GGMLQuantizationType


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1])
def test_quantized_projections_take_the_same_fused_step(name, qtype):
    """GGUF-quantized projections (hidden 64: 32-wide blocks) through the fused step
    equal the Python loop on the same quantized weights."""
    model = our_model(name)
    for layer in model.layers:
        for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            layer[proj] = QuantizedWeight.quantize(layer[proj], qtype)
    model.decode_layers = model.build_decode_layers()
    assert model.fused_decode_blocker() is None
    assert_fused_step_equals_python(model, [5, 1, 70, 16, 33], 16, seed=7, tol=2e-4)


def test_partial_rotary_is_declined():
    model = our_model("phi3")  # partial_rotary_factor 0.5
    assert model.fused_decode_blocker() == "partial rotary"
    assert model.decode_layers is None


def test_a_weight_the_kernel_does_not_know_is_declined():
    model = our_model("qwen3")
    layers = [dict(layer) for layer in model.layers]
    layers[1]["self_attn_sinks"] = torch.zeros(4)  # a twist the kernel does not compute
    a = model.arch
    fused = cpu_ops.LlamaDecodeLayers(
        layers, model.norm, a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
    )
    assert not fused.available


def test_bad_family_options_are_refused_by_the_kernel():
    ops = cpu_ops.load()
    n = torch.ones(4)  # hidden 4, one head of 4, intermediate 4

    def layer(**extra):
        dense = [ops.Projection(parts=[torch.zeros(rows, 4)], qtypes=[0]) for rows in (12, 4, 8, 4)]
        return ops.DecoderLayerWeights(
            input_layernorm=n,
            post_attention_layernorm=n,
            qkv_bias=None,
            qkv_proj=dense[0],
            o_proj=dense[1],
            gate_up_proj=dense[2],
            down_proj=dense[3],
            **extra,
        )

    with pytest.raises(RuntimeError, match="activation must be"):
        ops.LlamaDecodeLayers([layer()], n, 1, 1, 4, 1e-5, activation="relu")
    with pytest.raises(RuntimeError, match="q_norm without k_norm"):
        ops.LlamaDecodeLayers([layer(q_norm=n)], n, 1, 1, 4, 1e-5)
    with pytest.raises(RuntimeError, match="q_norm must be contiguous fp32 \\[4\\]"):
        ops.LlamaDecodeLayers([layer(q_norm=torch.ones(3), k_norm=n)], n, 1, 1, 4, 1e-5)
    with pytest.raises(RuntimeError, match="pre_feedforward_layernorm must be"):
        ops.LlamaDecodeLayers(
            [layer(pre_feedforward_layernorm=torch.ones(5), post_feedforward_layernorm=n)],
            n,
            1,
            1,
            4,
            1e-5,
        )
    with pytest.raises(RuntimeError, match="negative sliding_window"):
        ops.LlamaDecodeLayers([layer(sliding_window=-1)], n, 1, 1, 4, 1e-5)
    fused = ops.LlamaDecodeLayers([layer(rope_table=1)], n, 1, 1, 4, 1e-5)
    cache = torch.zeros(1, 2, 2, 4, 1, 4)
    with pytest.raises(RuntimeError, match="num_tables >= 2"):  # one table for two
        fused.forward(
            torch.zeros(1, 4),
            torch.ones(1, 4),
            torch.zeros(1, 4),
            cache,
            torch.tensor([0]),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )
