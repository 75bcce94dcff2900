"""copy_blocks, the worker's half of copy-on-write: the torch twin against a loop oracle,
the C++ CPU kernel (csrc/copy_blocks.cpp) and the Triton kernel (block_copy.py, under
TRITON_INTERPRET=1 in a child process with tiny shapes; compiled on a GPU) against
the twin. Each copies every layer's K and V of each (src, dst) pair and nothing else.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

import triton_kernels
from triton_kernels import cpu_ops, reference

# (num_layers, num_blocks, block_size, num_kv_heads, head_dim, pairs)
CASES = {
    "one_pair": (2, 5, 4, 2, 8, [(1, 3)]),
    "several": (3, 9, 2, 1, 4, [(0, 8), (2, 5), (7, 1)]),
    "odd_sizes": (1, 6, 3, 3, 5, [(5, 0), (4, 2)]),
    "none": (2, 4, 4, 1, 4, []),
}


def make_cache(num_layers, num_blocks, block_size, heads, head_dim, dtype=torch.float32,
               device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_layers, 2, num_blocks, block_size, heads, head_dim,
                       generator=g).to(dtype=dtype, device=device)


def oracle(cache: torch.Tensor, pairs) -> torch.Tensor:
    out = cache.clone()
    for layer in range(cache.shape[0]):
        for kv in range(2):
            for src, dst in pairs:
                out[layer, kv, dst] = cache[layer, kv, src]
    return out


def mapping(pairs, device="cpu") -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64, device=device).reshape(-1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_twin_equals_the_loop(name, dtype):
    *shape, pairs = CASES[name]
    cache = make_cache(*shape, dtype=dtype)
    expected = oracle(cache, pairs)
    reference.copy_blocks(cache, mapping(pairs))
    assert torch.equal(cache, expected)


def test_bad_arguments_are_value_errors():
    cache = make_cache(1, 4, 2, 1, 2)
    with pytest.raises(ValueError):
        reference.copy_blocks(cache, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError):
        reference.copy_blocks(cache[0], mapping([(0, 1)]))
    with pytest.raises(IndexError):
        reference.copy_blocks(cache, mapping([(0, 4)]))


@pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpp_kernel_equals_the_twin(name, dtype):
    *shape, pairs = CASES[name]
    cache = make_cache(*shape, dtype=dtype)
    expected = cache.clone()
    reference.copy_blocks(expected, mapping(pairs))
    cpu_ops.load().copy_blocks(cache, mapping(pairs))
    assert torch.equal(cache, expected)
    # The package dispatcher takes the C++ path on CPU.
    again = make_cache(*shape, dtype=dtype)
    triton_kernels.copy_blocks(again, mapping(pairs))
    assert torch.equal(again, expected)


@pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU kernels did not build here")
def test_cpp_kernel_checks_block_ids():
    with pytest.raises(RuntimeError, match="outside"):
        cpu_ops.load().copy_blocks(make_cache(1, 4, 2, 1, 2), mapping([(0, 9)]))


def _run_interpreted_cases() -> dict[str, dict]:
    block_copy = importlib.import_module("triton_kernels.block_copy")
    assert block_copy._INTERPRETED, "TRITON_INTERPRET=1 was not in effect"
    results = {}
    for name, (*shape, pairs) in CASES.items():
        cache = make_cache(*shape)
        expected = oracle(cache, pairs)
        block_copy.copy_blocks(cache, mapping(pairs))
        results[name] = {"equal": bool(torch.equal(cache, expected))}
    return results


def test_triton_kernel_interpreted_equals_the_loop():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from triton_interpret import run_interpreted

    results = run_interpreted(__file__)
    assert set(results) == set(CASES)
    assert all(r["equal"] for r in results.values()), results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_kernel_compiled_equals_the_twin(dtype):
    cache = make_cache(4, 64, 16, 8, 128, dtype=dtype, device="cuda")
    pairs = [(3, 40), (10, 11), (63, 0), (7, 20)]
    expected = oracle(cache.cpu(), pairs)
    triton_kernels.copy_blocks(cache, mapping(pairs, "cuda"))
    torch.cuda.synchronize()
    assert torch.equal(cache.cpu(), expected)


if __name__ == "__main__":
    print(json.dumps(_run_interpreted_cases()))
