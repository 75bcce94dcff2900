"""``--dtype auto`` and ``--kv-cache-dtype`` (issue 16 item 2, issue 15 item 6): what the
worker picks for each kind of hardware, and what it refuses."""

import logging

import pytest
import torch

from aioengine.config import CacheConfig, EngineConfig
from aioengine.worker.model_runner import choose_dtype, choose_kv_cache_dtype, cpu_flags

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX2 | {"avx512f", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags,quantized,expected", [
    (AVX2, False, torch.float32),  # no bf16 units: bf16 matmuls run 2.3x slower (issue 16)
    (AVX2, True, torch.float32),
    (AVX512_BF16, False, torch.bfloat16),
    (AMX, False, torch.bfloat16),
    (AMX, True, torch.float32),  # the quantized CPU kernels take fp32 activations
])
def test_auto_on_a_cpu_picks_by_its_units_and_the_weights(flags, quantized, expected):
    dtype, why = choose_dtype("auto", "cpu", flags, quantized)
    assert dtype == expected and why.startswith("auto")


@pytest.mark.parametrize("cuda_bf16,expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_on_cuda_is_a_half_dtype(cuda_bf16, expected):
    assert choose_dtype("auto", "cuda", frozenset(), True, cuda_bf16=cuda_bf16)[0] == expected


def test_explicit_bf16_without_bf16_units_is_kept_but_called_slow():
    dtype, why = choose_dtype("bfloat16", "cpu", AVX2, False)
    assert dtype == torch.bfloat16 and why.startswith("slow")
    assert choose_dtype("bfloat16", "cpu", AMX, False)[1] == "requested"
    assert choose_dtype("float32", "cpu", AVX2, True) == (torch.float32, "requested")


def test_kv_cache_dtype_auto_is_the_activations_dtype():
    assert choose_kv_cache_dtype("auto", torch.float32, "cpu") == torch.float32
    assert choose_kv_cache_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert choose_kv_cache_dtype("auto", torch.float16, "cuda") == torch.float16
    assert choose_kv_cache_dtype("float16", torch.float32, "cpu") == torch.float16
    assert choose_kv_cache_dtype("float32", torch.float32, "cpu") == torch.float32
    assert choose_kv_cache_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16


def test_kv_cache_dtype_other_than_the_activations_needs_fp32_on_a_cpu():
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 needs --dtype float32"):
        choose_kv_cache_dtype("float16", torch.bfloat16, "cpu")
    with pytest.raises(ValueError):
        choose_kv_cache_dtype("bfloat16", torch.float32, "cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp4")
    assert EngineConfig.from_kwargs(kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"


def test_this_machines_flags_are_read():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    assert any(f.startswith(("sse", "avx", "fp", "asimd")) for f in flags)


def test_the_worker_logs_its_choice_and_sizes_the_cache_in_the_cache_dtype(caplog):
    """On the real default model: dtype auto -> fp32 (GGUF), and a float16 cache holds
    twice the blocks of the auto (fp32) cache in the same memory."""
    from aioengine.worker.model_runner import ModelRunner

    caplog.set_level(logging.INFO, logger="aioengine.worker.model_runner")
    runners = {kv: ModelRunner(EngineConfig.from_kwargs(dtype="auto", kv_cache_dtype=kv,
                                                        kv_cache_memory_bytes=64 << 20))
               for kv in ("auto", "float16")}
    assert runners["auto"].dtype == torch.float32
    assert runners["auto"].kv_cache.dtype == torch.float32
    assert runners["float16"].kv_cache.dtype == torch.float16
    assert runners["float16"].num_blocks == 2 * runners["auto"].num_blocks
    assert "dtype float32 (auto: quantized weights" in caplog.text
    assert "(KV cache float16)" in caplog.text
