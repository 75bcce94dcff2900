// fp32 linear layers: y = x @ w^T (+ bias), a skinny kernel up to 16 rows of x (each
// weight row read once for four rows of x), MKL's GEMM above.

#pragma once

#include <ATen/ATen.h>

namespace aioengine {

// y preallocated [M, N]; x [M, K] rows contiguous; w [N, K] contiguous; bias [N] or an
// undefined/empty tensor.
void linear_into(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

// The tensor entry point (allocates y).
at::Tensor linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);

}  // namespace aioengine
