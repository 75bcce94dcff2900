// SIMD helpers shared by the CPU kernels: libmvec's vector expf, fp32 dot products and
// axpy over fp32/fp16/bf16/fp8 rows (the KV cache's element types), and the register-blocked
// fp32 micro-tile that both the skinny linear (linear.cpp) and the quantized GEMM's
// tile buffer (quant_ops.cpp) run.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "fp8.h"

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

namespace aioengine {

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

// 16 fp32, fp16, bf16 or fp8 values (a KV cache of --kv-cache-dtype float16/bfloat16/fp8)
// as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  return fp8::e4m3_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 load16(const c10::Float8_e5m2* p) {
  return fp8::e5m2_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The portable kernels' fp16/bf16 rows (below); their fp8 rows keep the generic loops,
// c10's scalar conversion, which is what a CPU without AVX-512 runs (portable = true
// tests it here).
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

// y[m * ldy + r] = dot(x[m], w[r]) for m < M, r < R: the fp32 register tile (M rows of x
// against R rows of w, ldw floats apart) of the skinny linear (linear.cpp) and of the
// quantized GEMM's dequantized tile buffer (quant_ops.cpp, which also runs the AVX2 one on
// an AVX-512 build when a test asks for that path).
namespace simd {
#if defined(__AVX512F__)
// In-register 16 x 16 transpose of 32-bit lanes: src's 16 rows of 16 (64 bytes apart),
// dst[j] = column j. The AMX kernels' layout step: the GEMM's C tiles back to rows of y
// (quant_amx.cpp) and K^T's B tiles of the prefill attention (attention.h).
inline void transpose16x16(const float* src, __m512* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + 16 * i);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    dst[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    dst[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 32 fp32 values (v0: 0-15, v1: 16-31) as bf16 hi = bf16(v), rounded to nearest even, and,
// where lo is given, lo = bf16(v - hi) (v - hi is exact in fp32). For the AMX GEMM
// (quant_amx.h), whose fp32-grade mode sums hi * hi + hi * lo + lo * hi.
inline void bf16_split(__m512 v0, __m512 v1, uint16_t* hi, uint16_t* lo) {
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
  _mm512_storeu_si512(hi, h);
  if (lo == nullptr) return;
  const __m512 h0 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  const __m512 h1 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  _mm512_storeu_si512(lo, reinterpret_cast<__m512i>(
                              _mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, h1), _mm512_sub_ps(v0, h0))));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace avx2 {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M, int R>
inline void micro_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                       float* y, int64_t ldy) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * ldw + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t t = k; t < K; ++t) s += x[m * ldx + t] * w[r * ldw + t];
      y[m * ldy + r] = s;
    }
}

}  // namespace avx2
#endif

#if defined(__AVX512F__)
namespace avx512 {

template <int M, int R>
inline void micro_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                       float* y, int64_t ldy) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * ldw + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {  // rows that end mid-vector
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, w + r * ldw + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
}

}  // namespace avx512
#endif
}  // namespace simd

// The best fp32 tile this build has.
template <int M, int R>
inline void micro_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                       float* y, int64_t ldy) {
#if defined(__AVX512F__)
  simd::avx512::micro_tile<M, R>(x, ldx, w, ldw, K, y, ldy);
#else
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = dot<float>(x + m * ldx, w + r * ldw, K);
#endif
}

}  // namespace aioengine
