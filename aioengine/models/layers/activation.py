"""Gated MLP activations on a fused ``[num_tokens, 2 * intermediate]`` gate/up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import triton_kernels


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5) with the tanh
    approximation of GELU (HF's ``gelu_pytorch_tanh``, Gemma): ``gelu(gate) * up``.
    ``x``: ``[num_tokens, 2 * d]`` (gate first) -> ``[num_tokens, d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


#: HF ``hidden_act`` / ``hidden_activation`` -> ``act(gate) * up`` on the fused output.
GATED_ACTIVATIONS = {
    "silu": triton_kernels.silu_and_mul,
    "swish": triton_kernels.silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}
