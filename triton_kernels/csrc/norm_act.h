// Element-wise kernels of a decoder layer: fused residual add + RMSNorm (vLLM's
// fused_add_rms_norm; RMSNorm, Zhang & Sennrich 2019), per-head RMSNorm, SiLU-and-mul
// (SwiGLU, Shazeer 2020), GELU(tanh)-and-mul (GeGLU) and rotate-half RoPE (RoFormer, Su et al. 2021, section 3.4). fp32, bf16 or fp16
// tensors, accumulated in fp32.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace aioengine {

template <typename scalar_t>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* r_ptr = residual.data_ptr<scalar_t>();
  const scalar_t* w_ptr = weight.data_ptr<scalar_t>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x_ptr + r * hidden;
      scalar_t* rr = r_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        // The residual stream is kept in the model's dtype, as HF adds in it.
        rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        h[i] = static_cast<float>(rr[i]);
      }
      const float ms = dot(h.data(), h.data(), hidden) / static_cast<float>(hidden);
      const float inv = 1.f / std::sqrt(ms + feps);
      for (int64_t i = 0; i < hidden; ++i) {
        // HF: weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)
        xr[i] = static_cast<scalar_t>(static_cast<float>(w_ptr[i]) *
                                      static_cast<float>(static_cast<scalar_t>(h[i] * inv)));
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = x_ptr + r * 2 * d;
      const scalar_t* up = gate + d;
      scalar_t* o = o_ptr + r * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, float>) {
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= d; i += 16) {
          const __m512 g = _mm512_loadu_ps(gate + i);
          const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
          const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
        }
      }
#endif
      for (; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        // silu in the input dtype first, as torch's silu then mul do.
        const float s = static_cast<float>(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<scalar_t>(s * static_cast<float>(up[i]));
      }
    }
  });
}


// GeGLU with the tanh approximation of GELU (Shazeer 2020, eq. 5; HF's gelu_pytorch_tanh,
// Gemma): out = gelu(x[:, :d]) * x[:, d:], fp32. 0.5 x (1 + tanh(u)) is written as
// x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3): one exp, vectorised as SiLU's.
inline void gelu_tanh_and_mul_f32(float* out, const float* x, int64_t rows, int64_t d) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = x + r * 2 * d;
      const float* up = gate + d;
      float* o = out + r * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f), m2b = _mm512_set1_ps(-2.f * kBeta),
                   kappa = _mm512_set1_ps(kKappa);
      for (; i + 16 <= d; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(kappa, g), _mm512_mul_ps(g, g), g);
        const __m512 e = _ZGVeN16v_expf(_mm512_mul_ps(m2b, inner));
        const __m512 y = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(y, _mm512_loadu_ps(up + i)));
      }
#endif
      for (; i < d; ++i) {
        const float g = gate[i];
        const float inner = g + kKappa * g * g * g;
        o[i] = g / (1.f + std::exp(-2.f * kBeta * inner)) * up[i];
      }
    }
  });
}

// In place: RMSNorm of each of num_heads slices of head_dim floats in each of `rows`
// rows (ld floats apart), times weight [head_dim]: per-head Q/K norms (Qwen3, Gemma 3)
// with num_heads > 1, a plain RMSNorm of [rows, hidden] with num_heads 1, head_dim
// hidden. fp32, as HF normalises in fp32.
inline void rms_norm_heads_f32(float* x, int64_t rows, int64_t ld, int64_t num_heads,
                               int64_t head_dim, const float* weight, double eps) {
  const float feps = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = x + r * ld + h * head_dim;
      const float ms = dot(v, v, head_dim) / static_cast<float>(head_dim);
      const float inv = 1.f / std::sqrt(ms + feps);
      for (int64_t i = 0; i < head_dim; ++i) v[i] = weight[i] * (v[i] * inv);
    }
  }
}


// In place on the first num_rot_heads heads of each of `rows` rows (ld floats apart):
// h = h * cos + roll(h, head_dim / 2) * sin, with sin holding [-sin, sin].
void rope_rotate_half(float* qk, int64_t rows, int64_t ld, int64_t num_rot_heads,
                      int64_t head_dim, const float* cos, const float* sin, int64_t ld_cs);

// Tensor entry points: residual += x, x = rms_norm(residual) * weight; out = silu(x[:, :d])
// * x[:, d:].
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor x);

}  // namespace aioengine
