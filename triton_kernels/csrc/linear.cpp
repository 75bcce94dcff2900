// fp32 linear layers (linear.h).

#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "simd.h"

namespace aioengine {
namespace {

// -- skinny linear: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for few rows --------------------
// At decode batch sizes a linear layer is a matrix-vector product bound by reading the
// weight once; one tile reads 4 weight rows once for up to 4 rows of x (the rows of x
// stay in L1 across the tiles). Threads split the weight rows.

constexpr int64_t kSkinnyMaxRows = 16;  // above this, MKL's GEMM (compute-bound) is faster


template <int R>
inline void skinny_rows(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t K,
                        float* y, int64_t ldy) {
  switch (rows) {
    case 1: micro_tile<1, R>(x, ldx, w, K, K, y, ldy); break;
    case 2: micro_tile<2, R>(x, ldx, w, K, K, y, ldy); break;
    case 3: micro_tile<3, R>(x, ldx, w, K, K, y, ldy); break;
    default: micro_tile<4, R>(x, ldx, w, K, K, y, ldy); break;
  }
}

// x: [M, K] rows contiguous; w: [N, K] contiguous; bias: [N] or nullptr; y: [M, N].
void skinny_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                   const float* bias, float* y) {
  const int64_t full = N / 4, tiles = full + N % 4;  // 4-row tiles, then single rows
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t < full ? 4 * t : 4 * full + (t - full);
      const int64_t num_rows = t < full ? 4 : 1;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m0);
        float* ym = y + m0 * N + n;
        if (num_rows == 4) {
          skinny_rows<4>(rows, x + m0 * K, K, w + n * K, K, ym, N);
        } else {
          skinny_rows<1>(rows, x + m0 * K, K, w + n * K, K, ym, N);
        }
        if (bias != nullptr)
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t r = 0; r < num_rows; ++r) ym[m * N + r] += bias[n + r];
      }
    }
  });
}

}  // namespace

// fp32 y = x @ w^T (+ bias), y preallocated [M, N]; x rows contiguous.
void linear_into(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (x.size(0) <= kSkinnyMaxRows) {
    skinny_linear(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), w.size(0),
                  has_bias ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
  } else if (has_bias) {
    at::addmm_out(y, bias, x, w.t());
  } else {
    at::mm_out(y, x, w.t());
  }
}

// Rotate-half RoPE (Su et al. 2021, RoFormer section 3.4), in place on the first
// num_rot_heads heads of each row: h = h * cos + roll(h, head_dim / 2) * sin, the
// model's torch form, with sin holding [-sin, sin].

at::Tensor linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  x.is_contiguous() && weight.is_contiguous(),
              "linear: contiguous fp32 tensors expected");
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kFloat && b.is_contiguous() &&
                               b.numel() == weight.size(0)), "linear: bias [N] fp32 expected");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_into(y, x, weight, b);
  return y;
}

// The decoder layers of a Llama-family model for one decode step, in one call.
//
// Between two weight-streaming matmuls, every small op the Python forward runs starts
// with cold caches (the weights just swept L2) and costs 30-40 us instead of a few;
// at batch 1 that was a quarter of the step (bench/README.md). Here the whole layer
// stack runs in C++ with small buffers and a small code footprint, the "no bubbles"
// idea of decode megakernels (Hazy Research, "Look Ma, No Bubbles!", 2025). Each
// layer: RMSNorm (+ residual add), QKV projection, rotate-half RoPE, K/V written to
// their cache slots, paged decode attention, O projection, residual add + RMSNorm,
// gate/up projection, SiLU * up, down projection. fp32 activations; each projection is
// a dense fp32 matrix or GGML-quantized parts (quant_ops.h). The Python forward is the
// oracle (tests/test_decode_layers.py).

}  // namespace aioengine
