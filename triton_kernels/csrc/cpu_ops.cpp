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
// - linear (fp32): y = x @ w^T (+ bias); a skinny kernel up to 16 rows of x, MKL's
//   GEMM above.
// - quant_dequantize / quant_linear / quant_embedding: GGML block formats read in
//   place (quant_ops.h, quant_ops.cpp).
// - LlamaDecodeLayers (fp32 activations): a Llama-family decoder-layer stack for one
//   decode step in one call, built from the kernels above; each projection is dense
//   fp32 or quantized (any mix of parts).
//
// The first three take fp32, bf16 or fp16 tensors and accumulate in fp32.
// Shapes and dtypes are checked in Python (triton_kernels/cpu_ops.py) and again
// here with TORCH_CHECK, which surfaces as RuntimeError.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "quant_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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

// 16 fp16 or bf16 values (a KV cache of --kv-cache-dtype float16/bfloat16) as fp32.
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

template <typename T>
inline float dot_half(const float* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

template <typename T>
inline void axpy_half(float* y, float alpha, const T* x, int64_t n) {
  const __m512 va = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, load16(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

template <>
inline float dot<c10::Half>(const float* a, const c10::Half* b, int64_t n) { return dot_half(a, b, n); }
template <>
inline float dot<c10::BFloat16>(const float* a, const c10::BFloat16* b, int64_t n) {
  return dot_half(a, b, n);
}
template <>
inline void axpy<c10::Half>(float* y, float alpha, const c10::Half* x, int64_t n) {
  axpy_half(y, alpha, x, n);
}
template <>
inline void axpy<c10::BFloat16>(float* y, float alpha, const c10::BFloat16* x, int64_t n) {
  axpy_half(y, alpha, x, n);
}
#endif

// One layer's decode attention, on raw pointers so both the tensor entry point and
// the fused decoder below can call it. Strides are in elements; head_dim's is 1. The
// cache's element type may be narrower than the query's (an fp16/bf16 KV cache under
// fp32 activations, --kv-cache-dtype); scores and sums are fp32 either way.
template <typename scalar_t, typename cache_t = scalar_t>
struct DecodeAttention {
  const scalar_t* q;
  int64_t qs, qh;  // query [num_seqs, num_heads, head_dim]
  const cache_t* k;
  int64_t kb, kt, kh;  // key cache [num_blocks, block_size, num_kv_heads, head_dim]
  const cache_t* v;
  int64_t vb, vt, vh;
  scalar_t* out;
  int64_t os, oh;  // out [num_seqs, num_heads, head_dim]
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int64_t max_blocks;
  const int32_t* seq_lens;  // [num_seqs]
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
};

template <typename scalar_t, typename cache_t>
void decode_attention_run(const DecodeAttention<scalar_t, cache_t>& a) {
  const int64_t group = a.num_heads / a.num_kv_heads, head_dim = a.head_dim;
  at::parallel_for(0, a.num_seqs * a.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / a.num_kv_heads, h = task % a.num_kv_heads;
      const int64_t len = a.seq_lens[s];
      const int32_t* blocks = a.block_tables + s * a.max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = a.q + s * a.qs + (h * group + g) * a.qh;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * a.scale;
      }
      // Pass 1: scores of every query head of the group against each key, read once.
      for (int64_t start = 0; start < len; start += a.block_size) {
        const cache_t* kblock = a.k + blocks[start / a.block_size] * a.kb + h * a.kh;
        const int64_t stop = std::min(len, start + a.block_size);
        for (int64_t t = start; t < stop; ++t) {
          const cache_t* k = kblock + (t - start) * a.kt;
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
      for (int64_t start = 0; start < len; start += a.block_size) {
        const cache_t* vblock = a.v + blocks[start / a.block_size] * a.vb + h * a.vh;
        const int64_t stop = std::min(len, start + a.block_size);
        for (int64_t t = start; t < stop; ++t) {
          const cache_t* v = vblock + (t - start) * a.vt;
          for (int64_t g = 0; g < group; ++g) axpy(&acc[g * head_dim], scores[g * len + t], v, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = a.out + s * a.os + (h * group + g) * a.oh;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

template <typename scalar_t, typename cache_t = scalar_t>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           double scale) {
  DecodeAttention<scalar_t, cache_t> a;
  a.q = query.data_ptr<scalar_t>();
  a.qs = query.stride(0);
  a.qh = query.stride(1);
  a.k = key_cache.data_ptr<cache_t>();
  a.kb = key_cache.stride(0);
  a.kt = key_cache.stride(1);
  a.kh = key_cache.stride(2);
  a.v = value_cache.data_ptr<cache_t>();
  a.vb = value_cache.stride(0);
  a.vt = value_cache.stride(1);
  a.vh = value_cache.stride(2);
  a.out = out.data_ptr<scalar_t>();
  a.os = out.stride(0);
  a.oh = out.stride(1);
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.max_blocks = block_tables.size(1);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.num_seqs = query.size(0);
  a.num_heads = query.size(1);
  a.num_kv_heads = key_cache.size(2);
  a.head_dim = query.size(2);
  a.block_size = key_cache.size(1);
  a.scale = static_cast<float>(scale);
  decode_attention_run(a);
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


// -- skinny linear: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for few rows --------------------
// At decode batch sizes a linear layer is a matrix-vector product bound by reading the
// weight once; one tile reads 4 weight rows once for up to 4 rows of x (the rows of x
// stay in L1 across the tiles). Threads split the weight rows.

constexpr int64_t kSkinnyMaxRows = 16;  // above this, MKL's GEMM (compute-bound) is faster

#if defined(__AVX512F__)
template <int M, int R>
inline void skinny_tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                        int64_t ldy) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#else
template <int M, int R>
inline void skinny_tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                        int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = dot<float>(x + m * ldx, w + r * K, K);
}
#endif

template <int R>
inline void skinny_rows(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t K,
                        float* y, int64_t ldy) {
  switch (rows) {
    case 1: skinny_tile<1, R>(x, ldx, w, K, y, ldy); break;
    case 2: skinny_tile<2, R>(x, ldx, w, K, y, ldy); break;
    case 3: skinny_tile<3, R>(x, ldx, w, K, y, ldy); break;
    default: skinny_tile<4, R>(x, ldx, w, K, y, ldy); break;
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
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_type && out.scalar_type() == query.scalar_type() &&
                  (query.scalar_type() == cache_type ||
                   (query.scalar_type() == at::kFloat &&
                    (cache_type == at::kHalf || cache_type == at::kBFloat16))),
              "paged_attention_decode: the caches must have the query's dtype, or be fp16/bf16 "
              "under an fp32 query");
  if (query.scalar_type() == at::kFloat && cache_type == at::kHalf) {
    decode_attention_impl<float, c10::Half>(out, query, key_cache, value_cache, block_tables,
                                            seq_lens, scale);
    return;
  }
  if (query.scalar_type() == at::kFloat && cache_type == at::kBFloat16) {
    decode_attention_impl<float, c10::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                                seq_lens, scale);
    return;
  }
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
class LlamaDecodeLayers {
 public:
  // norms: per layer [input_layernorm, post_attention_layernorm, qkv_bias (empty when the
  // model has none)], then the final norm; fp32, contiguous. projections: per layer
  // [qkv_proj, o_proj, gate_up_proj, down_proj], each a list of parts (uint8 GGML rows,
  // or one contiguous fp32 matrix) with their GGML types (quant_ops.h, F32 = 0).
  // Shapes are checked here.
  LlamaDecodeLayers(std::vector<at::Tensor> norms,
                    std::vector<std::vector<at::Tensor>> projection_parts,
                    std::vector<std::vector<int64_t>> projection_qtypes, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, double eps)
      : norms_(std::move(norms)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), eps_(eps), isa_(aioengine::resolve_isa(-1)) {
    TORCH_CHECK(norms_.size() % 3 == 1 && norms_.size() > 1 &&
                    projection_parts.size() == 4 * (norms_.size() / 3) &&
                    projection_qtypes.size() == projection_parts.size(),
                "LlamaDecodeLayers: per layer 3 norms/biases and 4 projections, then the "
                "final norm expected");
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                    head_dim > 0 && head_dim % 2 == 0, "LlamaDecodeLayers: bad head counts");
    num_layers_ = static_cast<int64_t>(norms_.size() / 3);
    hidden_ = norms_.back().numel();
    for (const auto& w : norms_)
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && !w.is_cuda(),
                  "LlamaDecodeLayers: contiguous fp32 CPU norms and biases expected");
    for (size_t i = 0; i < projection_parts.size(); ++i) {
      // in_features of projection i % 4: hidden for qkv and gate_up, H * D for o_proj,
      // and for down_proj the intermediate size, half of gate_up's rows
      const int64_t cols = i % 4 == 1   ? num_heads * head_dim
                           : i % 4 == 3 ? projections_[i - 1].rows / 2
                                        : hidden_;
      projections_.push_back(aioengine::make_quant_linear(projection_parts[i],
                                                          projection_qtypes[i], cols));
      if (projections_.back().dense())
        TORCH_CHECK(projection_parts[i][0].is_contiguous(),
                    "LlamaDecodeLayers: a dense projection must be contiguous");
    }
    intermediate_ = projections_[3].cols;
    const int64_t qkv = (num_heads + 2 * num_kv_heads) * head_dim;
    for (int64_t i = 0; i < num_layers_; ++i) {
      const at::Tensor* n = &norms_[3 * i];
      const aioengine::QuantLinear* p = &projections_[4 * i];
      TORCH_CHECK(n[0].numel() == hidden_ && n[1].numel() == hidden_ &&
                      (n[2].numel() == 0 || n[2].numel() == qkv) && p[0].rows == qkv &&
                      p[1].rows == hidden_ && p[2].rows == 2 * intermediate_ &&
                      p[3].rows == hidden_ && p[3].cols == intermediate_,
                  "LlamaDecodeLayers: layer ", i, " has unexpected weight shapes");
    }
  }

  // residual: [M, hidden] embeddings of the step's tokens, one per sequence; it becomes
  // the residual stream after the last layer. cos, sin: [M, head_dim] rows of the RoPE
  // tables at the tokens' positions. kv_cache: [num_layers, 2, num_blocks, block_size,
  // num_kv_heads, head_dim]. slots: [M] int64 cache slots of the new tokens;
  // block_tables: [M, max_blocks] int32 (entries past a sequence's length may be any
  // valid block id); seq_lens: [M] int32, the new token included. The caller (the
  // attention plan) has checked slots, block ids and lengths against the cache.
  // Returns the final-normed hidden states [M, hidden].
  at::Tensor forward(at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                     at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                     double scale) {
    const int64_t M = residual.size(0);
    TORCH_CHECK(residual.dim() == 2 && residual.size(1) == hidden_ && residual.is_contiguous() &&
                    residual.scalar_type() == at::kFloat, "forward: residual [M, hidden] fp32");
    TORCH_CHECK(cos.sizes() == at::IntArrayRef({M, head_dim_}) && sin.sizes() == cos.sizes() &&
                    cos.is_contiguous() && sin.is_contiguous() &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                "forward: cos/sin [M, head_dim] fp32");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers_ && kv_cache.size(1) == 2 &&
                    kv_cache.size(4) == num_kv_heads_ && kv_cache.size(5) == head_dim_ &&
                    kv_cache.stride(5) == 1 &&
                    (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf ||
                     kv_cache.scalar_type() == at::kBFloat16),
                "forward: kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                "head_dim] fp32, fp16 or bf16");
    TORCH_CHECK(slots.numel() == M && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == M &&
                    block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                    seq_lens.numel() == M && seq_lens.scalar_type() == at::kInt &&
                    seq_lens.is_contiguous(), "forward: slots/block_tables/seq_lens");
    switch (kv_cache.scalar_type()) {
      case at::kHalf:
        return run<c10::Half>(residual, cos, sin, kv_cache, slots, block_tables, seq_lens, scale);
      case at::kBFloat16:
        return run<c10::BFloat16>(residual, cos, sin, kv_cache, slots, block_tables, seq_lens,
                                  scale);
      default:
        return run<float>(residual, cos, sin, kv_cache, slots, block_tables, seq_lens, scale);
    }
  }

 private:
  // forward() for a cache of element type cache_t (K/V are rounded to it when written).
  template <typename cache_t>
  at::Tensor run(at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                 at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens, double scale) {
    const int64_t M = residual.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_n = q_size + 2 * kv_size;
    const auto opts = residual.options();
    at::Tensor x = at::zeros({M, hidden_}, opts);  // layer 0 adds zero to the residual
    at::Tensor o = at::empty({M, hidden_}, opts);
    at::Tensor qkv = at::empty({M, qkv_n}, opts);
    at::Tensor attn = at::empty({M, q_size}, opts);
    at::Tensor gate_up = at::empty({M, 2 * intermediate_}, opts);
    at::Tensor act = at::empty({M, intermediate_}, opts);
    const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
    const int64_t* slot = slots.data_ptr<int64_t>();
    cache_t* cache = kv_cache.data_ptr<cache_t>();
    // The caller's plan has checked these; checked again here because a write or read
    // outside the cache would corrupt memory (a few integer compares a step).
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int64_t max_blocks = block_tables.size(1);
    for (int64_t t = 0; t < M; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block_size, "forward: slot ", slot[t],
                  " outside the cache of ", num_blocks * block_size, " slots");
      TORCH_CHECK(lens[t] >= 1 && lens[t] <= max_blocks * block_size, "forward: seq_len ",
                  lens[t], " outside [1, ", max_blocks * block_size, "]");
      for (int64_t b = 0; b < (lens[t] + block_size - 1) / block_size; ++b)
        TORCH_CHECK(bt[t * max_blocks + b] >= 0 && bt[t * max_blocks + b] < num_blocks,
                    "forward: block id ", bt[t * max_blocks + b], " outside [0, ", num_blocks, ")");
    }

    DecodeAttention<float, cache_t> a;
    a.q = qkv.data_ptr<float>();
    a.qs = qkv_n;
    a.qh = head_dim_;
    a.kb = a.vb = kv_cache.stride(2);
    a.kt = a.vt = kv_cache.stride(3);
    a.kh = a.vh = kv_cache.stride(4);
    a.out = attn.data_ptr<float>();
    a.os = q_size;
    a.oh = head_dim_;
    a.block_tables = block_tables.data_ptr<int32_t>();
    a.max_blocks = block_tables.size(1);
    a.seq_lens = seq_lens.data_ptr<int32_t>();
    a.num_seqs = M;
    a.num_heads = num_heads_;
    a.num_kv_heads = num_kv_heads_;
    a.head_dim = head_dim_;
    a.block_size = block_size;
    a.scale = static_cast<float>(scale);

    for (int64_t i = 0; i < num_layers_; ++i) {
      const at::Tensor* n = &norms_[3 * i];
      const aioengine::QuantLinear* p = &projections_[4 * i];
      fused_add_rms_norm_impl<float>(x, residual, n[0], eps_);
      project(qkv, x, p[0], n[2]);
      float* qkv_ptr = qkv.data_ptr<float>();
      rope_rotate_half(qkv_ptr, M, qkv_n, num_heads_ + num_kv_heads_, head_dim_,
                       cos.data_ptr<float>(), sin.data_ptr<float>(), head_dim_);
      cache_t* key_cache = cache + i * kv_cache.stride(0);
      cache_t* value_cache = key_cache + kv_cache.stride(1);
      for (int64_t t = 0; t < M; ++t) {  // reshape_and_cache
        const int64_t off = (slot[t] / block_size) * a.kb + (slot[t] % block_size) * a.kt;
        for (int64_t h = 0; h < num_kv_heads_; ++h) {
          const float* k = qkv_ptr + t * qkv_n + q_size + h * head_dim_;
          std::copy(k, k + head_dim_, key_cache + off + h * a.kh);
          std::copy(k + kv_size, k + kv_size + head_dim_, value_cache + off + h * a.kh);
        }
      }
      a.k = key_cache;
      a.v = value_cache;
      decode_attention_run(a);
      project(o, attn, p[1], at::Tensor());
      fused_add_rms_norm_impl<float>(o, residual, n[1], eps_);
      project(gate_up, o, p[2], at::Tensor());
      silu_and_mul_impl<float>(act, gate_up);
      project(x, act, p[3], at::Tensor());
    }
    fused_add_rms_norm_impl<float>(x, residual, norms_.back(), eps_);
    return x;
  }

  // y[M, N] = x[M, K] @ w^T (+ bias), y and x contiguous.
  void project(at::Tensor& y, const at::Tensor& x, const aioengine::QuantLinear& w,
               const at::Tensor& bias) const {
    if (w.dense()) {
      linear_into(y, x, w.tensors[0], bias);
      return;
    }
    const float* b = bias.defined() && bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
    aioengine::quant_linear_into(y.data_ptr<float>(), y.size(1), x.data_ptr<float>(), x.size(1),
                                 x.size(0), w, b, isa_);
  }

  std::vector<at::Tensor> norms_;
  std::vector<aioengine::QuantLinear> projections_;
  int64_t num_layers_, num_heads_, num_kv_heads_, head_dim_, hidden_, intermediate_;
  double eps_;
  aioengine::Isa isa_;
};

void copy_blocks(at::Tensor kv_cache, const at::Tensor& block_mapping);  // copy_blocks.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel releases the GIL, as torch's own ops do: an in-process engine runs steps
  // in a thread beside its event loop.
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_attention_decode", &paged_attention_decode, release());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, release());
  m.def("silu_and_mul", &silu_and_mul, release());
  m.def("copy_blocks", &copy_blocks, pybind11::arg("kv_cache"), pybind11::arg("block_mapping"),
        release());
  m.def("linear", &linear, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias") = pybind11::none(), release());
  m.def("quant_dequantize", &aioengine::quant_dequantize, pybind11::arg("data"),
        pybind11::arg("qtype"), pybind11::arg("cols"), pybind11::arg("isa") = -1, release());
  m.def("quant_linear", &aioengine::quant_linear, pybind11::arg("x"), pybind11::arg("parts"),
        pybind11::arg("qtypes"), pybind11::arg("cols"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = -1, release());
  m.def("quant_embedding", &aioengine::quant_embedding, pybind11::arg("ids"),
        pybind11::arg("data"), pybind11::arg("qtype"), pybind11::arg("cols"),
        pybind11::arg("isa") = -1, release());
  m.def("set_q8_activations", &aioengine::set_q8_activations, pybind11::arg("on"),
        "int8 activations for the quantized GEMV (VNNI builds); False if the build has none.");
  m.def("q8_activations", &aioengine::q8_activations);
  m.def("quant_isa", [] { return static_cast<int>(aioengine::resolve_isa(-1)); },
        "The instruction-set path the quantized kernels use: 0 scalar, 1 AVX2, 2 AVX-512.");
  pybind11::class_<LlamaDecodeLayers>(m, "LlamaDecodeLayers")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>,
                          std::vector<std::vector<int64_t>>, int64_t, int64_t, int64_t, double>())
      .def("forward", &LlamaDecodeLayers::forward, release());
}
