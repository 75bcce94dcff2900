"""The Triton kernels for GGML block formats (``triton_kernels.quant_triton``) against the
reference dequantizer, ``gguf.quants.dequantize`` (the twin of llama.cpp's).

As in test_triton_kernels.py, the interpreted cases run in one child process (this file
run as a script with TRITON_INTERPRET=1, which must be set before triton is imported and
cannot be unset) and each test checks one case's result. Weights are random blocks of
every format (``random_weight``: llama.cpp's quantizer for the legacy types, random bytes
with finite scales for the K-quants), shapes tiny and odd so that every kernel runs
several programs with masked edges; activations are fp32 (the interpreter mis-computes
tl.dot on bf16).

Without a GPU, ``test_kernels_compile_for_sm90`` still takes every format's kernels
through Triton's NVIDIA backend to an sm_90 cubin (the bundled ptxas); the ``gpu`` tests
run the compiled kernels in fp16, bf16 and fp32.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton_interpret import run_interpreted
from gguf import quants as gguf_quants

from triton_kernels.quant import SUPPORTED_QTYPES, GGMLQuantizationType

REPO_ROOT = Path(__file__).resolve().parents[1]
QT = GGMLQuantizationType
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
#: fp32 matmuls differ from F.linear only by summation order: a few ulps of the largest
#: partial sum, far below what a misread scale, nibble or high bit produces.
FP32_RTOL = 1e-5


def cols_for(qtype: QT, blocks: int) -> int:
    """``blocks`` blocks of the format (K-quant super-blocks are 256 wide, others 32)."""
    return blocks * (256 if qtype in K_QUANTS else 32)


def reference_weight(data: torch.Tensor, qtype: QT, shape: tuple[int, int]) -> torch.Tensor:
    """fp32 ``[rows, cols]`` from the ``gguf`` package's dequantizer (llama.cpp's twin)."""
    values = gguf_quants.dequantize(data.cpu().contiguous().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(shape)


def matmul_error(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> dict:
    """|y - F.linear| next to the size of the sums (max of |x| @ |W|.T) it is judged by."""
    x, weight = x.double().cpu(), weight.double()
    expected = F.linear(x, weight, None if bias is None else bias.double().cpu())
    scale = (x.abs() @ weight.abs().T).max().item() if expected.numel() else 0.0
    return {"max_abs_diff": (y.double().cpu() - expected).abs().max().item(),
            "max_abs_ref": expected.abs().max().item(), "scale": scale}


def run_dequantize_case(qt, case: dict) -> dict:
    """Bits of the Triton dequantize that differ from the reference (fp32, and fp16 against
    the reference rounded), on a row-sliced view when ``case["row_step"]`` > 1."""
    qtype, rows, cols = QT[case["qtype"]], case["rows"], case["cols"]
    gen = torch.Generator().manual_seed(case["seed"])
    step = case.get("row_step", 1)
    data = qt.random_weight(qtype, rows * step, cols, gen)[::step]
    expected = reference_weight(data, qtype, (rows, cols))
    out = qt.dequantize(data, qtype, (rows, cols))
    assert out.shape == expected.shape and out.dtype == torch.float32
    half = qt.dequantize(data, qtype, (rows, cols), dtype=torch.float16)
    return {
        "mismatched_fp32": int((out.view(torch.int32) != expected.view(torch.int32)).sum()),
        "mismatched_fp16": int((half.view(torch.int16)
                                != expected.half().view(torch.int16)).sum()),
        "distinct_values": int(expected.unique().numel()),
    }


def run_matmul_case(qt, case: dict) -> dict:
    qtype, rows, cols, m = QT[case["qtype"]], case["rows"], case["cols"], case["m"]
    gen = torch.Generator().manual_seed(case["seed"])
    data = qt.random_weight(qtype, rows, cols, gen)
    x = torch.randn(m, cols, generator=gen)
    if case.get("transposed_x"):  # strides (1, m): not contiguous
        x = torch.randn(cols, m, generator=gen).T
    bias = torch.randn(rows, generator=gen) if case.get("bias") else None
    y = qt.dequant_matmul(x, data, qtype, (rows, cols), bias, method=case.get("method"))
    assert y.shape == (m, rows) and y.dtype == x.dtype
    return matmul_error(y, x, reference_weight(data, qtype, (rows, cols)), bias)


def _interpreted_cases() -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for i, qtype in enumerate(SUPPORTED_QTYPES):
        name = qtype.name
        # 13 and 37 rows: partial last tiles of 16; legacy K of 3 blocks = 1.5 K-tiles.
        k = cols_for(qtype, 2 if qtype in K_QUANTS else 3)
        cases[f"dequantize-{name}"] = {"kind": "dequantize", "qtype": name, "rows": 13,
                                       "cols": k, "seed": 10 + i}
        cases[f"dequantize-{name}-row_slice"] = {"kind": "dequantize", "qtype": name,
                                                 "rows": 5, "cols": cols_for(qtype, 1),
                                                 "seed": 30 + i, "row_step": 2}
        for m, extra in ((1, {"bias": True}), (5, {"transposed_x": True}), (17, {})):
            cases[f"matmul-{name}-m{m}"] = {"kind": "matmul", "qtype": name, "rows": 37,
                                            "cols": k, "m": m, "seed": 50 + 3 * i + m,
                                            "method": "fused", **extra}
        cases[f"matmul-{name}-dequantize_path"] = {
            "kind": "matmul", "qtype": name, "rows": 13, "cols": k, "m": 64,
            "seed": 90 + i, "method": None, "bias": True}
    return cases


INTERPRETED_CASES = _interpreted_cases()


def _run_interpreted_cases() -> dict[str, dict]:
    """Child-process entry: every case with the kernels in Triton's interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    qt = importlib.import_module("triton_kernels.quant_triton")
    assert qt._INTERPRETED
    results = {}
    for name, case in INTERPRETED_CASES.items():
        try:
            run = run_dequantize_case if case["kind"] == "dequantize" else run_matmul_case
            results[name] = {"error": None, **run(qt, case)}
        except Exception:  # noqa: BLE001 -- reported by the parent's test for this case
            results[name] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case_name", [n for n, c in INTERPRETED_CASES.items()
                                       if c["kind"] == "dequantize"])
def test_interpreted_dequantize_is_bit_exact(case_name, interpreted_results):
    result = interpreted_results[case_name]
    assert result["error"] is None, result["error"]
    assert result["mismatched_fp32"] == 0
    assert result["mismatched_fp16"] == 0
    # The data is not degenerate: a kernel that returned zeros or one scale would fail.
    assert result["distinct_values"] > 16


@pytest.mark.parametrize("case_name", [n for n, c in INTERPRETED_CASES.items()
                                       if c["kind"] == "matmul"])
def test_interpreted_dequant_matmul_matches_f_linear(case_name, interpreted_results):
    result = interpreted_results[case_name]
    assert result["error"] is None, result["error"]
    assert result["max_abs_ref"] > 0
    assert result["max_abs_diff"] <= FP32_RTOL * result["scale"]


# -- in-process: the module and the host wrappers' checks ------------------------------------


@pytest.fixture(scope="module")
def qt():
    pytest.importorskip("triton")
    return importlib.import_module("triton_kernels.quant_triton")


def test_formats_are_the_quantized_weights_formats(qt):
    assert qt.SUPPORTED_QTYPES == SUPPORTED_QTYPES


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_random_k_quant_weights_are_finite_and_varied(qt, qtype):
    data = qt.random_weight(qtype, 4, 512, torch.Generator().manual_seed(0))
    weight = reference_weight(data, qtype, (4, 512))
    assert torch.isfinite(weight).all()
    assert weight.unique().numel() > 500


def test_wrappers_reject_cpu_tensors_outside_the_interpreter(qt):
    if qt._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set for this process")
    data = qt.random_weight(QT.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        qt.dequantize(data, QT.Q4_0, (4, 64))
    with pytest.raises(ValueError, match="need CUDA tensors"):
        qt.dequant_matmul(torch.zeros(2, 64), data, QT.Q4_0, (4, 64))


def _q4_0(rows: int = 4, cols: int = 64) -> torch.Tensor:
    return torch.zeros(rows, cols // 32 * 18, dtype=torch.uint8)


@pytest.mark.parametrize("call,message", [
    (lambda qt: qt.dequantize(_q4_0(), QT.Q2_K, (4, 64)), "Q2_K is not supported"),
    (lambda qt: qt.dequantize(_q4_0(), QT.F32, (4, 64)), "F32 is not supported"),
    (lambda qt: qt.dequantize(_q4_0(), 999, (4, 64)), "unknown GGML type 999"),
    (lambda qt: qt.dequantize(_q4_0(), QT.Q4_0, (4, 48)), "cols divisible by 32"),
    (lambda qt: qt.dequantize(_q4_0(), QT.Q4_0, (5, 64)), r"uint8 data \[5, 36\]"),
    (lambda qt: qt.dequantize(_q4_0().to(torch.int8), QT.Q4_0, (4, 64)), "needs uint8"),
    (lambda qt: qt.dequantize(_q4_0(4, 128)[:, ::2], QT.Q4_0, (4, 64)), "stride 1 within"),
    (lambda qt: qt.dequantize(_q4_0(), QT.Q4_0, (4, 64), dtype=torch.int32), "fp32, fp16"),
    (lambda qt: qt.dequant_matmul(torch.zeros(2, 32), _q4_0(), QT.Q4_0, (4, 64)),
     r"x must be \[M, 64\]"),
    (lambda qt: qt.dequant_matmul(torch.zeros(64), _q4_0(), QT.Q4_0, (4, 64)),
     r"x must be \[M, 64\]"),
    (lambda qt: qt.dequant_matmul(torch.zeros(2, 64, dtype=torch.float64), _q4_0(), QT.Q4_0,
                                  (4, 64)), "fp16, bf16 or fp32"),
    (lambda qt: qt.dequant_matmul(torch.zeros(2, 64), _q4_0(), QT.Q4_0, (4, 64),
                                  torch.zeros(5)), r"bias must be a float \[4\]"),
    (lambda qt: qt.dequant_matmul(torch.zeros(2, 64), _q4_0(), QT.Q4_0, (4, 64),
                                  torch.zeros(4, dtype=torch.int64)), "bias must be a float"),
    (lambda qt: qt.dequant_matmul(torch.zeros(2, 64), _q4_0(), QT.Q4_0, (4, 64),
                                  method="cublas"), "method must be"),
])
def test_wrapper_argument_errors(qt, call, message):
    with pytest.raises(ValueError, match=message):
        call(qt)


# -- compiled for a GPU without one: Triton's NVIDIA backend and its bundled ptxas -----------


def compile_for_sm90(kernel, pointers: dict[str, str], constexprs: dict,
                     options: dict):
    """``kernel`` through Triton's NVIDIA backend for sm_90 (H100/H200), PTX to cubin with
    the bundled ptxas; every other argument an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                 for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constexprs),
                          target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_kernels_compile_for_sm90(qt, qtype):
    """The compiled path, which the interpreter never exercises (types, layouts, tl.dot
    operand rules, register allocation), for the configs the wrappers launch: decode
    (bf16, 1 row), a 40-row fp16 tile, fp32 (IEEE FMAs), and dequantize. Launching them
    needs a GPU (the gpu tests)."""
    if qt._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set for this process")
    import triton

    ptxas = triton.knobs.nvidia.ptxas_blackwell.path
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip("this triton build has no ptxas")
    block_size, type_size = qt.GGML_QUANT_SIZES[qtype]
    layout = {"QTYPE": int(qtype), "QK": block_size, "TYPE_SIZE": type_size,
              "GROUP": qt._group(qtype)}
    for m, dtype, name in ((1, torch.bfloat16, "bf16"), (40, torch.float16, "fp16"),
                           (1, torch.float32, "fp32")):
        config = qt._matmul_config(m, qtype, dtype)
        constexprs = {**layout, "HAS_BIAS": True,
                      "DOT_PRECISION": "ieee" if dtype == torch.float32 else None,
                      **{k: v for k, v in config.items() if k.isupper()}}
        pointers = {"x_ptr": f"*{name}", "w_ptr": "*u8", "bias_ptr": f"*{name}",
                    "y_ptr": f"*{name}"}
        compiled = compile_for_sm90(qt._dequant_matmul_kernel, pointers, constexprs,
                                    {k: v for k, v in config.items() if not k.isupper()})
        assert compiled.asm["cubin"]
        if dtype != torch.float32:  # tl.dot became tensor-core instructions
            assert "mma" in compiled.asm["ptx"], (m, name)
    compiled = compile_for_sm90(qt._dequantize_kernel, {"w_ptr": "*u8", "out_ptr": "*bf16"},
                                {**layout, "BLOCK_N": 32, "BLOCK_K": 256}, {})
    assert compiled.asm["cubin"]


# -- GPU: compiled kernels -------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def compiled(qt):
    if qt._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: these tests are for compiled kernels")
    return qt


#: (M, N, K-blocks): decode, odd N, a partial row tile, around the switch to
#: dequantize + cuBLAS, prefill.
GPU_SHAPES = [(1, 4096, 16), (1, 37, 3), (7, 1, 5), (33, 577, 8), (63, 96, 2), (64, 96, 2),
              (300, 1000, 4)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_gpu_dequantize_is_bit_exact(compiled, qtype):
    rows, cols = 333, cols_for(qtype, 5)
    data = compiled.random_weight(qtype, rows, cols, torch.Generator().manual_seed(1))
    expected = reference_weight(data, qtype, (rows, cols))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = compiled.dequantize(data.cuda(), qtype, (rows, cols), dtype=dtype).cpu()
        assert out.dtype == dtype
        assert torch.equal(out.view(torch.uint8), expected.to(dtype).view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_gpu_dequant_matmul(compiled, qtype, dtype):
    gen = torch.Generator().manual_seed(2)
    for m, rows, blocks in GPU_SHAPES:
        cols = cols_for(qtype, blocks)
        data = compiled.random_weight(qtype, rows, cols, gen)
        weight = reference_weight(data, qtype, (rows, cols)).to(dtype)
        x = torch.randn(m, cols, generator=gen).to(dtype)
        bias = torch.randn(rows, generator=gen).to(dtype) if m % 2 else None
        y = compiled.dequant_matmul(x.cuda(), data.cuda(), qtype, (rows, cols),
                                    None if bias is None else bias.cuda())
        assert y.dtype == dtype and y.shape == (m, rows)
        # The reference sees the same rounded inputs; what remains is fp32 summation order
        # (and, in fp32, none of TF32) plus one rounding of the output to dtype.
        err = matmul_error(y, x, weight.float(), bias)
        tolerance = 2 * torch.finfo(dtype).eps * err["max_abs_ref"] + FP32_RTOL * err["scale"]
        assert err["max_abs_diff"] <= tolerance, (m, rows, cols, err)


if __name__ == "__main__":
    print(json.dumps(_run_interpreted_cases()))
