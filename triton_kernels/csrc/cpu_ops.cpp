// CPU kernels for aioengine's decode hot path, built on first use by
// triton_kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native).
//
// - paged_attention_decode: one new query token per sequence attends to its
//   paged K/V, read in place through the block table (PagedAttention, Kwon et
//   al. 2023, section 4.1): no gather copy. One task per (sequence, KV head)
//   reads each K and V row once for the whole query-head group (GQA,
//   Ainslie et al. 2023). Scores, softmax and the weighted sum in fp32.
// - fused_add_rms_norm: residual += x; x = rms_norm(residual) * weight, in
//   place (vLLM's fused_add_rms_norm; RMSNorm, Zhang & Sennrich 2019).
// - silu_and_mul: out = silu(x[:, :d]) * x[:, d:] (SwiGLU, Shazeer 2020).
//
// Every function takes fp32, bf16 or fp16 tensors and accumulates in fp32.
// Shapes and dtypes are checked in Python (triton_kernels/cpu_ops.py) and again
// here with TORCH_CHECK, which surfaces as RuntimeError.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// glibc's libmvec vector expf (-lmvec); the compiler emits these itself only under
// -ffast-math, which would also set flush-to-zero for the whole process.
#if defined(__AVX512F__)
extern "C" __m512 _ZGVeN16v_expf(__m512);
#elif defined(__AVX2__)
extern "C" __m256 _ZGVdN8v_expf(__m256);
#endif

namespace {

// x[i] = exp(x[i] - shift), vectorised where the CPU allows.
inline void exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(x + i), s)));
#elif defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

// Sixteen independent partial sums: GCC vectorises the inner loop at -O3 without
// -ffast-math (no reassociation of one accumulator is needed).
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * static_cast<float>(b[i + j]);
  }
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

template <typename T>
inline void axpy(float* y, float alpha, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

#if defined(__AVX512F__)
// fp32 rows, the common case: explicit 16-lane FMAs.
template <>
inline float dot<float>(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <>
inline void axpy<float>(float* y, float alpha, const float* x, int64_t n) {
  const __m512 va = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}
#endif

template <typename scalar_t>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           double scale) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  // Strides in elements; the head_dim stride of the caches is 1 (checked by the caller).
  const int64_t kb = key_cache.stride(0), kt = key_cache.stride(1), kh = key_cache.stride(2);
  const int64_t vb = value_cache.stride(0), vt = value_cache.stride(1),
                vh = value_cache.stride(2);
  const int64_t qs = query.stride(0), qh = query.stride(1);
  const int64_t os = out.stride(0), oh = out.stride(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = len_ptr[s];
      const int32_t* blocks = bt_ptr + s * max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + s * qs + (h * group + g) * qh;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      // Pass 1: scores of every query head of the group against each key, read once.
      for (int64_t start = 0; start < len; start += block_size) {
        const scalar_t* kblock = k_ptr + blocks[start / block_size] * kb + h * kh;
        const int64_t stop = std::min(len, start + block_size);
        for (int64_t t = start; t < stop; ++t) {
          const scalar_t* k = kblock + (t - start) * kt;
          for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(&q[g * head_dim], k, head_dim);
        }
      }
      // Softmax per query head (max-subtracted, fp32).
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * len];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = row[t] > m ? row[t] : m;
        exp_shifted(row, len, m);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += row[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      // Pass 2: the weighted sum of values, each value row read once.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const scalar_t* vblock = v_ptr + blocks[start / block_size] * vb + h * vh;
        const int64_t stop = std::min(len, start + block_size);
        for (int64_t t = start; t < stop; ++t) {
          const scalar_t* v = vblock + (t - start) * vt;
          for (int64_t g = 0; g < group; ++g) axpy(&acc[g * head_dim], scores[g * len + t], v, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o_ptr + s * os + (h * group + g) * oh;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

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
      for (int64_t i = 0; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        // silu in the input dtype first, as torch's silu then mul do.
        const float s = static_cast<float>(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<scalar_t>(s * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention_decode: bad ranks");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "paged_attention_decode: head mismatch");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1, "paged_attention_decode: head_dim stride must be 1");
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_attention_decode: out shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "paged_attention_decode: block_tables/seq_lens must be contiguous int32, one row "
              "per sequence");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(), "paged_attention_decode: dtypes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attn", [&] {
    decode_attention_impl<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale);
  });
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
}
