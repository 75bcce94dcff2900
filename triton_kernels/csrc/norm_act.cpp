// Tensor entry points of the element-wise kernels and RoPE (norm_act.h).

#include "norm_act.h"

#include <ATen/Dispatch.h>

#include <algorithm>

namespace aioengine {

void rope_rotate_half(float* qk, int64_t rows, int64_t ld, int64_t num_rot_heads,
                      int64_t head_dim, const float* cos, const float* sin, int64_t ld_cs) {
  const int64_t half = head_dim / 2;
  std::vector<float> h(head_dim);
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * ld_cs;
    const float* sn = sin + t * ld_cs;
    for (int64_t head = 0; head < num_rot_heads; ++head) {
      float* x = qk + t * ld + head * head_dim;
      std::copy(x, x + head_dim, h.begin());
      for (int64_t i = 0; i < head_dim; ++i) {
        const float a = h[i] * c[i];
        const float b = h[(i + head_dim - half) % head_dim] * sn[i];
        x[i] = a + b;
      }
    }
  }
}


void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "fused_add_rms_norm: shapes");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: dtypes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    fused_add_rms_norm_impl<scalar_t>(x, residual, weight, eps);
  });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && x.size(1) % 2 == 0 &&
                  out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 &&
                  out.scalar_type() == x.scalar_type(), "silu_and_mul: shapes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(out, x);
  });
}


}  // namespace aioengine
