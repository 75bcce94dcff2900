"""The Triton kernels against the torch reference.

On CPU the kernels run in Triton's interpreter. It must be switched on
(TRITON_INTERPRET=1) before ``triton`` is first imported, because triton.language's
own helpers (tl.zeros, tl.max, ...) are jitted at import, and it cannot be switched
off again in that process; the GPU tests need it off. So the interpreted cases run
in one child process (this file run as a script with TRITON_INTERPRET=1) and each
test below checks one case's result. Shapes are tiny and fp32 (the interpreter
mis-computes tl.dot on bf16).

The ``gpu`` tests compare the compiled kernels with the reference in fp16 and bf16.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from triton_interpret import run_interpreted

import triton_kernels
from triton_kernels import reference

REPO_ROOT = Path(__file__).resolve().parents[1]
GQA = [(2, 2), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): group sizes 1, 3, 8


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, block_size, head_dim=16,
               dtype=torch.float32, device="cpu", seed=0):
    """Random paged cache and ragged batch. Block ids are shuffled and the block-table
    padding holds an out-of-range id, which a kernel must never read."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), 10**6, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(cu_seqlens_q[-1]), num_heads, head_dim, generator=gen)
    return {
        "query": query.to(device, dtype), "key_cache": key_cache.to(device, dtype),
        "value_cache": value_cache.to(device, dtype), "block_tables": block_tables.to(device),
        "cu_seqlens_q": cu_seqlens_q.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": 1 / math.sqrt(head_dim), "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(seq_lens),
    }


def decode_args(batch):
    return (batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
            batch["seq_lens"], batch["scale"], batch["max_seqlen_k"])


def run_attention_case(pa, case) -> float:
    """Max |kernel - reference| for one attention case; ``pa`` is the kernel module."""
    batch = make_batch(case["q_lens"], case["seq_lens"], *case["heads"], case["block_size"],
                       head_dim=case.get("head_dim", 16), device=case.get("device", "cpu"),
                       dtype=getattr(torch, case.get("dtype", "float32")))
    if case["kind"] == "decode":
        out = pa.paged_attention_decode(*decode_args(batch), num_splits=case.get("num_splits"))
        expected = reference.paged_attention_decode(*decode_args(batch))
    else:
        out = pa.paged_attention_prefill(**batch)
        expected = reference.paged_attention_prefill(**batch)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    return (out.float() - expected.float()).abs().max().item()


def run_cache_case(cache_ops, case) -> float:
    """Max |kernel cache - reference cache| after writing a batch with skipped slots."""
    num_kv_heads, head_dim, block_size, num_tokens = 3, 24, case["block_size"], 7
    gen = torch.Generator().manual_seed(1)
    # Views of one fused projection: token stride != num_kv_heads * head_dim.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 5, generator=gen)
    key = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:-5].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([3, -1, block_size, 4 * block_size - 1, -1, 1, 2 * block_size])
    caches = [torch.zeros(2, 4, block_size, num_kv_heads, head_dim) for _ in range(2)]
    cache_ops.reshape_and_cache(key, value, caches[0][0], caches[0][1], slot_mapping)
    reference.reshape_and_cache(key, value, caches[1][0], caches[1][1], slot_mapping)
    assert caches[1].abs().sum() > 0
    return (caches[0] - caches[1]).abs().max().item()


def attention_case(kind, heads, block_size, q_lens, seq_lens, **options) -> dict:
    """One attention check: ``kind`` is "decode" or "prefill"; options: head_dim, dtype,
    device, num_splits."""
    return {"kind": kind, "heads": heads, "block_size": block_size, "q_lens": q_lens,
            "seq_lens": seq_lens, **options}


def _interpreted_cases() -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for bs in (16, 32):
        cases[f"reshape_and_cache-bs{bs}"] = {"kind": "cache", "block_size": bs}
        for heads in GQA:
            tag = f"gqa{heads[0] // heads[1]}-bs{bs}"
            decode_lens = [1, bs, 2 * bs, 3 * bs + 7]
            cases[f"decode-{tag}"] = attention_case("decode", heads, bs, [1] * 4, decode_lens,
                                                    num_splits=1)
            cases[f"decode_split-{tag}"] = attention_case("decode", heads, bs, [1] * 4,
                                                          decode_lens, num_splits=3)
            # Decode rows, cold prompts (q_len == seq_len) and prefix-cache hits
            # (q_len < seq_len), context lengths 1, multiples of the block size and ragged.
            cases[f"prefill_mixed-{tag}"] = attention_case(
                "prefill", heads, bs, q_lens=[1, 20, 1, 5, bs, 1],
                seq_lens=[2 * bs + 3, 20, 1, bs + 9, 2 * bs, bs])
    cases["decode_auto_splits-gqa3"] = attention_case("decode", (6, 2), 16, [1], [700])
    cases["decode-head_dim24"] = attention_case("decode", (6, 2), 16, [1, 1], [5, 40],
                                                head_dim=24, num_splits=2)
    cases["prefill-cold_prompt_multi_tile"] = attention_case("prefill", (6, 2), 16, [40], [40])
    cases["prefill-prefix_hit_multi_tile"] = attention_case("prefill", (8, 1), 16, [35], [70])
    cases["prefill-decode_rows_only"] = attention_case("prefill", (6, 2), 16, [1, 1, 1],
                                                       [1, 17, 48])
    cases["prefill-head_dim24"] = attention_case("prefill", (6, 2), 32, [3, 9], [30, 9],
                                                 head_dim=24)
    return cases


INTERPRETED_CASES = _interpreted_cases()


def _run_interpreted_cases() -> dict[str, dict]:
    """Child-process entry: every case with kernels in Triton's interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    cache_ops = importlib.import_module("triton_kernels.cache_ops")
    pa = importlib.import_module("triton_kernels.paged_attention_triton")
    assert pa._INTERPRETED and cache_ops._INTERPRETED
    results = {}
    for name, case in INTERPRETED_CASES.items():
        try:
            if case["kind"] == "cache":
                diff = run_cache_case(cache_ops, case)
            else:
                diff = run_attention_case(pa, case)
            results[name] = {"max_abs_diff": diff, "error": None}
        except Exception:  # noqa: BLE001 -- reported by the parent's test for this case
            results[name] = {"max_abs_diff": None, "error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case_name", list(INTERPRETED_CASES))
def test_interpreted_kernel_matches_reference(case_name, interpreted_results):
    result = interpreted_results[case_name]
    assert result["error"] is None, result["error"]
    tolerance = 0.0 if INTERPRETED_CASES[case_name]["kind"] == "cache" else 1e-5
    assert result["max_abs_diff"] <= tolerance


# -- in-process: the package and the host wrappers' checks ----------------------------------


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    return (importlib.import_module("triton_kernels.paged_attention_triton"),
            importlib.import_module("triton_kernels.cache_ops"))


def test_importing_the_kernel_module_keeps_the_dispatcher(kernels):
    # Regression: the Triton submodule was once named triton_kernels.paged_attention, and
    # importing it rebound the package attribute, so triton_kernels.paged_attention(...)
    # broke. It is now paged_attention_triton; the name must stay the function's.
    assert callable(triton_kernels.paged_attention)
    assert triton_kernels.paged_attention.__module__ == "triton_kernels"
    assert sys.modules["triton_kernels.paged_attention_triton"] is kernels[0]


def test_package_imports_nothing_from_aioengine():
    code = ("import sys, triton_kernels; "
            "assert not [m for m in sys.modules if m.startswith('aioengine')]; "
            "assert 'triton' not in sys.modules, 'triton must be imported lazily'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT,
                   env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def test_wrappers_reject_cpu_tensors_outside_the_interpreter(kernels):
    pa, cache_ops = kernels
    if pa._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set for this process")
    batch = make_batch([1, 1], [5, 9], 6, 2, 16)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        pa.paged_attention_decode(*decode_args(batch))
    with pytest.raises(ValueError, match="need CUDA tensors"):
        pa.paged_attention_prefill(**batch)
    k = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cache_ops.reshape_and_cache(k, k, batch["key_cache"], batch["value_cache"],
                                    torch.tensor([0, 1]))


def test_wrappers_reject_non_unit_head_dim_stride(kernels):
    pa, cache_ops = kernels
    batch = make_batch([1, 1], [5, 9], 6, 2, 16)
    strided = torch.randn(2, 6, 32)[:, :, ::2]
    with pytest.raises(ValueError, match="query must have stride 1 in head_dim"):
        pa.paged_attention_decode(strided, *decode_args(batch)[1:])
    strided_kv = torch.randn(2, 2, 32)[:, :, ::2]
    with pytest.raises(ValueError, match="key must have stride 1 in head_dim"):
        cache_ops.reshape_and_cache(strided_kv, strided_kv, batch["key_cache"],
                                    batch["value_cache"], torch.tensor([0, 1]))


@pytest.mark.parametrize("change,message", [
    (lambda b: {"query": b["query"][:, :5]}, "not a multiple of num_kv_heads"),
    (lambda b: {"query": b["query"].half()}, "query dtype torch.float16 differs"),
    (lambda b: {"key_cache": b["key_cache"][..., :8]}, "value_cache shape"),
    (lambda b: {"max_seqlen_k": 40}, r"max_seqlen_k=40 must be in \[1, 32\]"),
    (lambda b: {"cu_seqlens_q": b["cu_seqlens_q"].float()}, "cu_seqlens_q must be int32"),
    (lambda b: {"seq_lens": b["seq_lens"][:1]}, "block_tables has 2 rows for 1"),
])
def test_prefill_wrapper_argument_errors(kernels, change, message):
    batch = make_batch([1, 3], [5, 9], 6, 2, 16)
    with pytest.raises(ValueError, match=message):
        kernels[0].paged_attention_prefill(**{**batch, **change(batch)})


def test_decode_wrapper_rejects_bad_num_splits(kernels):
    pa, _ = kernels
    batch = make_batch([1], [5], 6, 2, 16)
    with pytest.raises(ValueError, match="num_splits"):
        pa.paged_attention_decode(*decode_args(batch), num_splits=0)


# -- GPU: compiled kernels -------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def compiled(kernels):
    pa, cache_ops = kernels
    if pa._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: these tests are for compiled kernels")
    return pa, cache_ops


GPU_TOLERANCE = {"float16": 4e-3, "bfloat16": 2e-2}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_gpu_decode(compiled, dtype, heads, head_dim, num_splits):
    case = attention_case("decode", heads, 16, [1] * 6, [1, 16, 100, 513, 2048, 4099],
                          head_dim=head_dim, dtype=dtype, device="cuda", num_splits=num_splits)
    assert run_attention_case(compiled[0], case) <= GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_mixed(compiled, dtype, heads, block_size):
    case = attention_case("prefill", heads, block_size, [1, 300, 1, 77, 128, 5],
                          [900, 300, 1, 1000, 128, 64], head_dim=128, dtype=dtype, device="cuda")
    assert run_attention_case(compiled[0], case) <= GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_decode_and_prefill(compiled):
    for kind, q_lens in (("decode", [1, 1, 1]), ("prefill", [1, 50, 7])):
        case = attention_case(kind, (12, 4), 16, q_lens, [300, 50, 1000], head_dim=64,
                              device="cuda")
        assert run_attention_case(compiled[0], case) <= 1e-4


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_reshape_and_cache_and_dispatch(compiled, dtype):
    num_tokens, num_kv_heads, head_dim, block_size = 50, 4, 128, 16
    kv_cache = torch.zeros(2, 2, 8, block_size, num_kv_heads, head_dim, dtype=dtype,
                           device="cuda")
    expected = kv_cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    slot_mapping = torch.randperm(8 * block_size, device="cuda")[:num_tokens]
    slot_mapping[::7] = -1
    triton_kernels.reshape_and_cache(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    reference.reshape_and_cache(key, value, expected[1, 0], expected[1, 1], slot_mapping)
    assert torch.equal(kv_cache, expected)

    batch = make_batch([1, 1, 1], [10, 400, 33], 12, 4, 16, head_dim=64, dtype=dtype,
                       device="cuda")
    out = triton_kernels.paged_attention(**batch)
    assert out.is_cuda and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference.paged_attention(**batch).float(),
                               atol=GPU_TOLERANCE[str(dtype).split(".")[1]], rtol=0)


if __name__ == "__main__":
    print(json.dumps(_run_interpreted_cases()))
