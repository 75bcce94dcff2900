// Quantized-weight kernels for CPU (see quant_ops.h): dequantize rows, a quantized linear
// (GEMV for decode, tile-buffered GEMM for batches and prefill) and an embedding gather.
//
// Dequantizers follow llama.cpp's dequantize_row_* (ggml/src/ggml-quants.c) operation by
// operation, so each is bit for bit equal to gguf.quants.dequantize and to
// triton_kernels/quant_reference.py. The fused multiply-adds below round like the
// reference's multiply then add because every product of an fp16 scale and a 4-6 bit
// integer (or of d * sc, at most 17 significant bits, and a 5-bit q) is exact in fp32.

#include "quant_ops.h"

#include "quant_amx.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace aioengine {
namespace {

constexpr int64_t QK = 32;    // values per block of the legacy formats
constexpr int64_t QK_K = 256;  // values per K-quant super-block
// Up to this many rows of x a tile is 4 weight rows (decoded in registers where the
// format allows, once per 4 rows of x); above it, 16 rows dequantized once into a buffer.
constexpr int64_t kGemvMaxRows = 8;
// int8 activations for Q4_0/Q4_1 GEMVs up to this many rows (Q8_0: up to kGemvMaxRows).
constexpr int64_t kQ8MaxRowsQ4 = 2;
// The fewest rows of x the AMX GEMM takes in its fp32-grade mode (bf16: kGemvMaxRows + 1).
constexpr int64_t kAmxX3MinRows = 17;
// How many tiles ahead a thread prefetches its weight bytes.
constexpr int64_t kPrefetchTiles = 4;

inline void prefetch(const uint8_t* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float f16(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(load_u16(p)); }

inline float bf16(const uint8_t* p) {
  const uint32_t bits = static_cast<uint32_t>(load_u16(p)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes
// (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

using RowDequant = void (*)(const uint8_t* row, int64_t cols, float* y);

// -- portable scalar dequantizers ------------------------------------------------------------
namespace scalar {

void f32(const uint8_t* b, int64_t cols, float* y) { std::memcpy(y, b, cols * sizeof(float)); }

void f16_row(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols; ++i) y[i] = f16(b + 2 * i);
}

void bf16_row(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols; ++i) y[i] = bf16(b + 2 * i);
}

void q8_0(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 34, y += QK) {
    const float d = f16(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(q[j]) * d;
  }
}

void q4_0(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 18, y += QK) {
    const float d = f16(b);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((b[2 + j] & 0xF) - 8);
      y[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
  }
}

void q4_1(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 20, y += QK) {
    const float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(b[4 + j] & 0xF) + m;
      y[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
  }
}

void q5_0(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 22, y += QK) {
    const float d = f16(b);
    const uint32_t qh = load_u32(b + 2);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = d * static_cast<float>(lo - 16);
      y[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
}

void q5_1(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 24, y += QK) {
    const float d = f16(b), m = f16(b + 2);
    const uint32_t qh = load_u32(b + 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[8 + j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = d * static_cast<float>(lo) + m;
      y[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
}

void q4_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 144) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* q = b + 16;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
      uint8_t sc, m;
      scale_min_k4(j, b + 4, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(j + 1, b + 4, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) y[32 + l] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void q5_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 176) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
      uint8_t sc, m;
      scale_min_k4(j, b + 4, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(j + 1, b + 4, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) {
        y[l] = d1 * static_cast<float>((q[l] & 0xF) | (((qh[l] >> j) & 1) << 4)) - m1;
        y[32 + l] = d2 * static_cast<float>((q[l] >> 4) | (((qh[l] >> (j + 1)) & 1) << 4)) - m2;
      }
    }
  }
}

void q6_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 210) {
    const float d = f16(b + 208);
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        // (d * sc) * q, the reference's order: the second product may round
        y[l] = (d * sc[is]) * static_cast<float>(q1);
        y[l + 32] = (d * sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = (d * sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = (d * sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

// out[m * ldy + r] = dot(x[m], w[r]) for m < M, r < R; w rows ldw floats apart.
void micro(int M, int R, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
           float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float acc[8] = {0.f};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] += x[m * ldx + k + j] * w[r * ldw + k + j];
      float s = 0.f;
      for (int j = 0; j < 8; ++j) s += acc[j];
      for (; k < K; ++k) s += x[m * ldx + k] * w[r * ldw + k];
      y[m * ldy + r] = s;
    }
}

}  // namespace scalar

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AIOENGINE_HAVE_AVX2 1
// -- AVX2 + FMA + F16C: 8 lanes --------------------------------------------------------------
namespace avx2 {

inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256 h2v(const uint8_t* p) { return _mm256_set1_ps(_cvtsh_ss(load_u16(p))); }
inline __m256i lanes(int first) { return _mm256_setr_epi32(first, first + 1, first + 2, first + 3,
                                                           first + 4, first + 5, first + 6, first + 7); }

void f16_row(const uint8_t* b, int64_t cols, float* y) {
  int64_t i = 0;
  for (; i + 8 <= cols; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i))));
  for (; i < cols; ++i) y[i] = f16(b + 2 * i);
}

void bf16_row(const uint8_t* b, int64_t cols, float* y) {
  int64_t i = 0;
  for (; i + 8 <= cols; i += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i)));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
  for (; i < cols; ++i) y[i] = bf16(b + 2 * i);
}

void q8_0(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 34, y += QK) {
    const __m256 d = h2v(b);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(cvt(i8x8(b + 2 + 8 * j)), d));
  }
}

// The 16 nibble bytes of a legacy block at p: lanes 8h..8h+7 of the low and high halves.
inline void nibbles(const uint8_t* p, int h, __m256i* lo, __m256i* hi) {
  const __m256i v = u8x8(p + 8 * h);
  *lo = _mm256_and_si256(v, _mm256_set1_epi32(0xF));
  *hi = _mm256_srli_epi32(v, 4);
}

// The 5th bits of lanes first..first+7 of a Q5 block, as 0 or 16.
inline __m256i fifth_bit(uint32_t qh, int first) {
  const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh)), lanes(first));
  return _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4);
}

void q4_0(const uint8_t* b, int64_t cols, float* y) {
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t i = 0; i < cols / QK; ++i, b += 18, y += QK) {
    const __m256 d = h2v(b);
    for (int h = 0; h < 2; ++h) {
      __m256i lo, hi;
      nibbles(b + 2, h, &lo, &hi);
      _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(d, cvt(_mm256_sub_epi32(lo, eight))));
      _mm256_storeu_ps(y + 16 + 8 * h, _mm256_mul_ps(d, cvt(_mm256_sub_epi32(hi, eight))));
    }
  }
}

void q4_1(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 20, y += QK) {
    const __m256 d = h2v(b), m = h2v(b + 2);
    for (int h = 0; h < 2; ++h) {
      __m256i lo, hi;
      nibbles(b + 4, h, &lo, &hi);
      _mm256_storeu_ps(y + 8 * h, _mm256_fmadd_ps(d, cvt(lo), m));
      _mm256_storeu_ps(y + 16 + 8 * h, _mm256_fmadd_ps(d, cvt(hi), m));
    }
  }
}

void q5_0(const uint8_t* b, int64_t cols, float* y) {
  const __m256i sixteen = _mm256_set1_epi32(16);
  for (int64_t i = 0; i < cols / QK; ++i, b += 22, y += QK) {
    const __m256 d = h2v(b);
    const uint32_t qh = load_u32(b + 2);
    for (int h = 0; h < 2; ++h) {
      __m256i lo, hi;
      nibbles(b + 6, h, &lo, &hi);
      lo = _mm256_sub_epi32(_mm256_or_si256(lo, fifth_bit(qh, 8 * h)), sixteen);
      hi = _mm256_sub_epi32(_mm256_or_si256(hi, fifth_bit(qh, 16 + 8 * h)), sixteen);
      _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(d, cvt(lo)));
      _mm256_storeu_ps(y + 16 + 8 * h, _mm256_mul_ps(d, cvt(hi)));
    }
  }
}

void q5_1(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 24, y += QK) {
    const __m256 d = h2v(b), m = h2v(b + 2);
    const uint32_t qh = load_u32(b + 4);
    for (int h = 0; h < 2; ++h) {
      __m256i lo, hi;
      nibbles(b + 8, h, &lo, &hi);
      lo = _mm256_or_si256(lo, fifth_bit(qh, 8 * h));
      hi = _mm256_or_si256(hi, fifth_bit(qh, 16 + 8 * h));
      _mm256_storeu_ps(y + 8 * h, _mm256_fmadd_ps(d, cvt(lo), m));
      _mm256_storeu_ps(y + 16 + 8 * h, _mm256_fmadd_ps(d, cvt(hi), m));
    }
  }
}

// Q4_K and Q5_K share everything but the 5th bit (qh == nullptr for Q4_K).
inline void k_quant_4_5(const uint8_t* b, const uint8_t* qh, const uint8_t* q, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const __m256i mask = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
  for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
    uint8_t sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    const __m256 d1 = _mm256_set1_ps(d * sc), m1 = _mm256_set1_ps(dmin * mn);
    scale_min_k4(j + 1, b + 4, &sc, &mn);
    const __m256 d2 = _mm256_set1_ps(d * sc), m2 = _mm256_set1_ps(dmin * mn);
    for (int l = 0; l < 32; l += 8) {
      const __m256i v = u8x8(q + l);
      __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi32(v, 4);
      if (qh != nullptr) {
        const __m256i h = u8x8(qh + l);
        lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(
                                      _mm256_srl_epi32(h, _mm_cvtsi32_si128(j)), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(
                                      _mm256_srl_epi32(h, _mm_cvtsi32_si128(j + 1)), one), 4));
      }
      _mm256_storeu_ps(y + l, _mm256_fmsub_ps(d1, cvt(lo), m1));
      _mm256_storeu_ps(y + 32 + l, _mm256_fmsub_ps(d2, cvt(hi), m2));
    }
  }
}

void q4_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 144, y += QK_K) k_quant_4_5(b, nullptr, b + 16, y);
}

void q5_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 176, y += QK_K) k_quant_4_5(b, b + 16, b + 48, y);
}

void q6_k(const uint8_t* b, int64_t cols, float* y) {
  const __m256i mask = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3),
                bias = _mm256_set1_epi32(32);
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 210) {
    const float d = f16(b + 208);
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; l += 8) {
        const int is = l / 16;
        const __m256i a = u8x8(ql + l), c = u8x8(ql + 32 + l), h = u8x8(qh + l);
        const __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, mask),
                                           _mm256_slli_epi32(_mm256_and_si256(h, three), 4));
        const __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, mask), _mm256_slli_epi32(
                                               _mm256_and_si256(_mm256_srli_epi32(h, 2), three), 4));
        const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_slli_epi32(
                                               _mm256_and_si256(_mm256_srli_epi32(h, 4), three), 4));
        const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4),
                                           _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4));
        _mm256_storeu_ps(y + l, _mm256_mul_ps(_mm256_set1_ps(d * sc[is]), cvt(_mm256_sub_epi32(q1, bias))));
        _mm256_storeu_ps(y + l + 32, _mm256_mul_ps(_mm256_set1_ps(d * sc[is + 2]), cvt(_mm256_sub_epi32(q2, bias))));
        _mm256_storeu_ps(y + l + 64, _mm256_mul_ps(_mm256_set1_ps(d * sc[is + 4]), cvt(_mm256_sub_epi32(q3, bias))));
        _mm256_storeu_ps(y + l + 96, _mm256_mul_ps(_mm256_set1_ps(d * sc[is + 6]), cvt(_mm256_sub_epi32(q4, bias))));
      }
    }
  }
}

using simd::avx2::micro_tile;  // simd.h, shared with linear.cpp

}  // namespace avx2
#endif

#if defined(__AVX512F__)
#define AIOENGINE_HAVE_AVX512 1
// -- AVX-512: 16 lanes -----------------------------------------------------------------------
namespace avx512 {

inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i i8x16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512 h2v(const uint8_t* p) { return _mm512_set1_ps(_cvtsh_ss(load_u16(p))); }

void f16_row(const uint8_t* b, int64_t cols, float* y) {
  int64_t i = 0;
  for (; i + 16 <= cols; i += 16)
    _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * i))));
  for (; i < cols; ++i) y[i] = f16(b + 2 * i);
}

void bf16_row(const uint8_t* b, int64_t cols, float* y) {
  int64_t i = 0;
  for (; i + 16 <= cols; i += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * i)));
    _mm512_storeu_ps(y + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
  for (; i < cols; ++i) y[i] = bf16(b + 2 * i);
}

void q8_0(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 34, y += QK) {
    const __m512 d = h2v(b);
    _mm512_storeu_ps(y, _mm512_mul_ps(cvt(i8x16(b + 2)), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(cvt(i8x16(b + 18)), d));
  }
}

void q4_0(const uint8_t* b, int64_t cols, float* y) {
  const __m512i mask = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
  for (int64_t i = 0; i < cols / QK; ++i, b += 18, y += QK) {
    const __m512 d = h2v(b);
    const __m512i v = u8x16(b + 2);
    _mm512_storeu_ps(y, _mm512_mul_ps(d, cvt(_mm512_sub_epi32(_mm512_and_si512(v, mask), eight))));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, cvt(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight))));
  }
}

void q4_1(const uint8_t* b, int64_t cols, float* y) {
  const __m512i mask = _mm512_set1_epi32(0xF);
  for (int64_t i = 0; i < cols / QK; ++i, b += 20, y += QK) {
    const __m512 d = h2v(b), m = h2v(b + 2);
    const __m512i v = u8x16(b + 4);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(d, cvt(_mm512_and_si512(v, mask)), m));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(d, cvt(_mm512_srli_epi32(v, 4)), m));
  }
}

// A Q5 block's 32 values before the offset: nibbles, with 16 added where qh has the bit.
inline void q5_values(const uint8_t* qs, uint32_t qh, __m512i* lo, __m512i* hi) {
  const __m512i v = u8x16(qs), sixteen = _mm512_set1_epi32(16);
  const __m512i l = _mm512_and_si512(v, _mm512_set1_epi32(0xF)), h = _mm512_srli_epi32(v, 4);
  *lo = _mm512_mask_or_epi32(l, static_cast<__mmask16>(qh & 0xFFFF), l, sixteen);
  *hi = _mm512_mask_or_epi32(h, static_cast<__mmask16>(qh >> 16), h, sixteen);
}

void q5_0(const uint8_t* b, int64_t cols, float* y) {
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < cols / QK; ++i, b += 22, y += QK) {
    const __m512 d = h2v(b);
    __m512i lo, hi;
    q5_values(b + 6, load_u32(b + 2), &lo, &hi);
    _mm512_storeu_ps(y, _mm512_mul_ps(d, cvt(_mm512_sub_epi32(lo, sixteen))));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, cvt(_mm512_sub_epi32(hi, sixteen))));
  }
}

void q5_1(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK; ++i, b += 24, y += QK) {
    const __m512 d = h2v(b), m = h2v(b + 2);
    __m512i lo, hi;
    q5_values(b + 8, load_u32(b + 4), &lo, &hi);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(d, cvt(lo), m));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(d, cvt(hi), m));
  }
}

inline void k_quant_4_5(const uint8_t* b, const uint8_t* qh, const uint8_t* q, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const __m512i mask = _mm512_set1_epi32(0xF), sixteen = _mm512_set1_epi32(16);
  __m512i h[2];
  if (qh != nullptr) {
    h[0] = u8x16(qh);
    h[1] = u8x16(qh + 16);
  }
  for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
    uint8_t sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    const __m512 d1 = _mm512_set1_ps(d * sc), m1 = _mm512_set1_ps(dmin * mn);
    scale_min_k4(j + 1, b + 4, &sc, &mn);
    const __m512 d2 = _mm512_set1_ps(d * sc), m2 = _mm512_set1_ps(dmin * mn);
    for (int l = 0; l < 2; ++l) {
      const __m512i v = u8x16(q + 16 * l);
      __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_srli_epi32(v, 4);
      if (qh != nullptr) {
        const __mmask16 klo = _mm512_test_epi32_mask(h[l], _mm512_set1_epi32(1 << j));
        const __mmask16 khi = _mm512_test_epi32_mask(h[l], _mm512_set1_epi32(2 << j));
        lo = _mm512_mask_or_epi32(lo, klo, lo, sixteen);
        hi = _mm512_mask_or_epi32(hi, khi, hi, sixteen);
      }
      _mm512_storeu_ps(y + 16 * l, _mm512_fmsub_ps(d1, cvt(lo), m1));
      _mm512_storeu_ps(y + 32 + 16 * l, _mm512_fmsub_ps(d2, cvt(hi), m2));
    }
  }
}

void q4_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 144, y += QK_K) k_quant_4_5(b, nullptr, b + 16, y);
}

void q5_k(const uint8_t* b, int64_t cols, float* y) {
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 176, y += QK_K) k_quant_4_5(b, b + 16, b + 48, y);
}

void q6_k(const uint8_t* b, int64_t cols, float* y) {
  const __m512i mask = _mm512_set1_epi32(0xF), three = _mm512_set1_epi32(3),
                bias = _mm512_set1_epi32(32);
  for (int64_t i = 0; i < cols / QK_K; ++i, b += 210) {
    const float d = f16(b + 208);
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; l += 16) {
        const int is = l / 16;
        const __m512i a = u8x16(ql + l), c = u8x16(ql + 32 + l), h = u8x16(qh + l);
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(a, mask),
                                           _mm512_slli_epi32(_mm512_and_si512(h, three), 4));
        const __m512i q2 = _mm512_or_si512(_mm512_and_si512(c, mask), _mm512_slli_epi32(
                                               _mm512_and_si512(_mm512_srli_epi32(h, 2), three), 4));
        const __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(a, 4), _mm512_slli_epi32(
                                               _mm512_and_si512(_mm512_srli_epi32(h, 4), three), 4));
        const __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(c, 4),
                                           _mm512_slli_epi32(_mm512_srli_epi32(h, 6), 4));
        _mm512_storeu_ps(y + l, _mm512_mul_ps(_mm512_set1_ps(d * sc[is]), cvt(_mm512_sub_epi32(q1, bias))));
        _mm512_storeu_ps(y + l + 32, _mm512_mul_ps(_mm512_set1_ps(d * sc[is + 2]), cvt(_mm512_sub_epi32(q2, bias))));
        _mm512_storeu_ps(y + l + 64, _mm512_mul_ps(_mm512_set1_ps(d * sc[is + 4]), cvt(_mm512_sub_epi32(q3, bias))));
        _mm512_storeu_ps(y + l + 96, _mm512_mul_ps(_mm512_set1_ps(d * sc[is + 6]), cvt(_mm512_sub_epi32(q4, bias))));
      }
    }
  }
}

using simd::avx512::micro_tile;  // simd.h, shared with linear.cpp


// -- fused GEMV for the 32-value formats: blocks decoded in registers, never stored --------
// At decode (M <= 4) the linear is bound by decoding the weight; writing the values to a
// buffer and reading them back costs a third of the work. Here each block of a row
// becomes two vectors that go straight into the dot products. A 4-bit (5-bit) block is
// decoded with a 16 (32) entry table of its values, d * q (+ m) for every q, and one
// vpermps (vpermt2ps) per 16 values, which picks table entries by the low 4 (5) bits of
// each lane: no integer-to-float conversion, no masking.

inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

template <int QT>
inline void block32(const uint8_t* b, __m512* lo, __m512* hi);

template <>
inline void block32<kQ8_0>(const uint8_t* b, __m512* lo, __m512* hi) {
  const __m512 d = h2v(b);
  *lo = _mm512_mul_ps(cvt(i8x16(b + 2)), d);
  *hi = _mm512_mul_ps(cvt(i8x16(b + 18)), d);
}

template <>
inline void block32<kQ4_0>(const uint8_t* b, __m512* lo, __m512* hi) {
  const __m512 table = _mm512_mul_ps(h2v(b), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.f)));
  const __m512i v = u8x16(b + 2);
  *lo = _mm512_permutexvar_ps(v, table);
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

template <>
inline void block32<kQ4_1>(const uint8_t* b, __m512* lo, __m512* hi) {
  const __m512 table = _mm512_fmadd_ps(iota16(), h2v(b), h2v(b + 2));
  const __m512i v = u8x16(b + 4);
  *lo = _mm512_permutexvar_ps(v, table);
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// 5-bit indices of a Q5 block: nibble | fifth bit << 4.
inline void q5_index(const uint8_t* qs, uint32_t qh, __m512i* lo, __m512i* hi) {
  q5_values(qs, qh, lo, hi);
}

template <>
inline void block32<kQ5_0>(const uint8_t* b, __m512* lo, __m512* hi) {
  const __m512 d = h2v(b), iota = iota16();
  const __m512 t0 = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.f)));
  const __m512 t1 = _mm512_mul_ps(d, iota);
  __m512i il, ih;
  q5_index(b + 6, load_u32(b + 2), &il, &ih);
  *lo = _mm512_permutex2var_ps(t0, il, t1);
  *hi = _mm512_permutex2var_ps(t0, ih, t1);
}

template <>
inline void block32<kQ5_1>(const uint8_t* b, __m512* lo, __m512* hi) {
  const __m512 d = h2v(b), m = h2v(b + 2), iota = iota16();
  const __m512 t0 = _mm512_fmadd_ps(iota, d, m);
  const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), d, m);
  __m512i il, ih;
  q5_index(b + 8, load_u32(b + 4), &il, &ih);
  *lo = _mm512_permutex2var_ps(t0, il, t1);
  *hi = _mm512_permutex2var_ps(t0, ih, t1);
}

// y[m * ldy + r] = dot(x[m], row r) for m < M, r < R; rows of `blocks` blocks of TS bytes.
template <int QT, int TS, int M, int R>
void gemv_tile(const uint8_t* w, int64_t row_stride, int64_t blocks, const float* x,
               int64_t ldx, float* y, int64_t ldy) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    __m512 xl[M], xh[M];
    for (int m = 0; m < M; ++m) {
      xl[m] = _mm512_loadu_ps(x + m * ldx + 32 * i);
      xh[m] = _mm512_loadu_ps(x + m * ldx + 32 * i + 16);
    }
    for (int r = 0; r < R; ++r) {
      __m512 lo, hi;
      block32<QT>(w + r * row_stride + i * TS, &lo, &hi);
      for (int m = 0; m < M; ++m)
        acc[m][r] = _mm512_fmadd_ps(hi, xh[m], _mm512_fmadd_ps(lo, xl[m], acc[m][r]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
}

using Gemv = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

template <int QT, int TS>
Gemv gemv_for(int M, int R) {
  static const Gemv table[4][4] = {
      {gemv_tile<QT, TS, 1, 1>, gemv_tile<QT, TS, 1, 2>, gemv_tile<QT, TS, 1, 3>, gemv_tile<QT, TS, 1, 4>},
      {gemv_tile<QT, TS, 2, 1>, gemv_tile<QT, TS, 2, 2>, gemv_tile<QT, TS, 2, 3>, gemv_tile<QT, TS, 2, 4>},
      {gemv_tile<QT, TS, 3, 1>, gemv_tile<QT, TS, 3, 2>, gemv_tile<QT, TS, 3, 3>, gemv_tile<QT, TS, 3, 4>},
      {gemv_tile<QT, TS, 4, 1>, gemv_tile<QT, TS, 4, 2>, gemv_tile<QT, TS, 4, 3>, gemv_tile<QT, TS, 4, 4>}};
  return table[M - 1][R - 1];
}

// The fused kernel for a format and tile, or nullptr (K-quants, F16/BF16: buffered path).
Gemv gemv(int qtype, int M, int R) {
  switch (qtype) {
    case kQ8_0: return gemv_for<kQ8_0, 34>(M, R);
    case kQ4_0: return gemv_for<kQ4_0, 18>(M, R);
    case kQ4_1: return gemv_for<kQ4_1, 20>(M, R);
    case kQ5_0: return gemv_for<kQ5_0, 22>(M, R);
    case kQ5_1: return gemv_for<kQ5_1, 24>(M, R);
    default: return nullptr;
  }
}

#if defined(__AVX512BF16__)
// AMX A tiles (quant_amx.h) straight from a 32-value format's blocks, one chunk of K at a
// time: block kc of each weight row, decoded in registers as for the GEMV, into the
// chunk's 32 rows x 32 values (hi/lo point at the chunk).
template <int QT, int TS>
void bf16_chunk(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t kc, uint16_t* hi,
                uint16_t* lo) {
  const uint8_t* b = w + kc * TS;
  int64_t r = 0;
  for (; r < rows; ++r, b += row_stride) {
    __m512 v0, v1;
    block32<QT>(b, &v0, &v1);
    simd::bf16_split(v0, v1, hi + r * QK, lo != nullptr ? lo + r * QK : nullptr);
  }
  for (; r < amx::kWeightRows; ++r) {
    std::memset(hi + r * QK, 0, 2 * QK);
    if (lo != nullptr) std::memset(lo + r * QK, 0, 2 * QK);
  }
}

// Whether bf16_chunk_for gives the table decoders below (set_amx_table_decode).
std::atomic<bool> bf16_chunk_lut_on{true};

#if defined(__AVX512BW__)
// The same A tiles as bf16_chunk for kBf16 (no lo half), with about a third of its
// vector work: per row one 32-entry bf16 table of the block's values and one vpermw
// (picking each value by its nibble) instead of converting 32 values to fp32 and back.
// The table holds bf16(fp32 value) for every q, computed by the same fp32 operations
// as block32, so the tiles are bit for bit those of bf16_chunk. The rows' fp16 scales
// are gathered and converted 16 rows at a time, then broadcast from memory (no
// shuffle-port work per row).

// Word j of a block's nibble indices: byte j's low nibble (j < 16) or byte j - 16's high
// nibble; for j < 16 only bits 0-4 count (vpermw), so the table's upper half repeats
// its lower half (4-bit formats) or bit 4 is masked (Q5).
inline __m512i nibble_words(const uint8_t* qs) {
  const __m512i bytes = _mm512_cvtepu8_epi16(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
  return _mm512_srlv_epi16(bytes, _mm512_set_epi64(0x0004000400040004, 0x0004000400040004,
                                                   0x0004000400040004, 0x0004000400040004,
                                                   0, 0, 0, 0));
}

// fp32 scales of rows [0, rows) at byte `at` of their blocks (fp16, as all 32-value
// formats store them), 16 rows a gather; rows past `rows` are 0.
inline void gather_scales(const uint8_t* b, int64_t row_stride, int64_t rows, int at,
                          float* out) {
  const __m512i step = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(row_stride)));
  for (int64_t r0 = 0; r0 < amx::kWeightRows; r0 += 16) {
    const int64_t n = std::clamp<int64_t>(rows - r0, 0, 16);
    const __mmask16 k = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    // 4-byte reads from the block's start: its scale(s) and quant bytes, all inside it
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, step,
                                                  b + r0 * row_stride, 1);
    const __m512i h = at == 0 ? v : _mm512_srli_epi32(v, 16);
    _mm512_store_ps(out + r0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
  }
}

template <int QT, int TS>
void bf16_chunk_lut(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t kc,
                    uint16_t* hi, uint16_t* lo) {
  if (lo != nullptr) return bf16_chunk<QT, TS>(w, row_stride, rows, kc, hi, lo);
  const uint8_t* b = w + kc * TS;
  alignas(64) float d[amx::kWeightRows], m[amx::kWeightRows];
  gather_scales(b, row_stride, rows, 0, d);
  if constexpr (QT == kQ4_1 || QT == kQ5_1) gather_scales(b, row_stride, rows, 2, m);
  const __m512 iota = iota16();
  int64_t r = 0;
  if constexpr (QT == kQ4_0 || QT == kQ4_1) {
    // Two rows a table: row r's 16 values in words 0-15, row r + 1's in 16-31 (one
    // conversion for both; the second row's indices get bit 4).
    constexpr int qs = QT == kQ4_0 ? 2 : 4;
    const __m512i nibble = _mm512_set1_epi16(0xF), upper = _mm512_set1_epi16(16);
    const auto values = [&](int64_t i) {
      const __m512 dv = _mm512_set1_ps(d[i]);
      return QT == kQ4_0 ? _mm512_mul_ps(dv, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)))
                         : _mm512_fmadd_ps(iota, dv, _mm512_set1_ps(m[i]));
    };
    for (; r + 1 < rows; r += 2, b += 2 * row_stride) {
      const __m512i table =
          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values(r + 1), values(r)));
      const __m512i i0 = _mm512_and_si512(nibble_words(b + qs), nibble);
      // (q & 0xF) | 16
      const __m512i i1 = _mm512_ternarylogic_epi32(nibble_words(b + row_stride + qs), nibble,
                                                   upper, 0xEA);
      _mm512_storeu_si512(hi + r * QK, _mm512_permutexvar_epi16(i0, table));
      _mm512_storeu_si512(hi + (r + 1) * QK, _mm512_permutexvar_epi16(i1, table));
    }
  }
  for (; r < rows; ++r, b += row_stride) {
    const __m512 dv = _mm512_set1_ps(d[r]);
    __m512i out;
    if constexpr (QT == kQ8_0) {
      out = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_mul_ps(cvt(i8x16(b + 18)), dv),
                                                          _mm512_mul_ps(cvt(i8x16(b + 2)), dv)));
    } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
      const __m512 t = QT == kQ4_0
                           ? _mm512_mul_ps(dv, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)))
                           : _mm512_fmadd_ps(iota, dv, _mm512_set1_ps(m[r]));
      const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t, t));
      out = _mm512_permutexvar_epi16(nibble_words(b + (QT == kQ4_0 ? 2 : 4)), table);
    } else {  // Q5_0, Q5_1: 32 values, q | fifth bit << 4
      __m512 t0, t1;
      if constexpr (QT == kQ5_0) {
        t0 = _mm512_mul_ps(dv, _mm512_sub_ps(iota, _mm512_set1_ps(16.f)));
        t1 = _mm512_mul_ps(dv, iota);
      } else {
        const __m512 mv = _mm512_set1_ps(m[r]);
        t0 = _mm512_fmadd_ps(iota, dv, mv);
        t1 = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), dv, mv);
      }
      const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t1, t0));
      constexpr int qh_at = QT == kQ5_0 ? 2 : 4;
      const __m512i q = _mm512_and_si512(nibble_words(b + qh_at + 4), _mm512_set1_epi16(0xF));
      const __m512i idx = _mm512_mask_add_epi16(q, static_cast<__mmask32>(load_u32(b + qh_at)), q,
                                                _mm512_set1_epi16(16));
      out = _mm512_permutexvar_epi16(idx, table);
    }
    _mm512_storeu_si512(hi + r * QK, out);
  }
  for (; r < amx::kWeightRows; ++r) std::memset(hi + r * QK, 0, 2 * QK);
}
#endif

using Bf16Chunk = void (*)(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*, uint16_t*);

// Format -> its decoder (the table one where the build has AVX-512 BW and
// set_amx_table_decode leaves it on); one table of type sizes for both decoders.
template <int QT, int TS>
Bf16Chunk bf16_chunk_of() {
#if defined(__AVX512BW__)
  if (bf16_chunk_lut_on.load(std::memory_order_relaxed)) return bf16_chunk_lut<QT, TS>;
#endif
  return bf16_chunk<QT, TS>;
}

Bf16Chunk bf16_chunk_for(int qtype) {
  switch (qtype) {
    case kQ8_0: return bf16_chunk_of<kQ8_0, 34>();
    case kQ4_0: return bf16_chunk_of<kQ4_0, 18>();
    case kQ4_1: return bf16_chunk_of<kQ4_1, 20>();
    case kQ5_0: return bf16_chunk_of<kQ5_0, 22>();
    case kQ5_1: return bf16_chunk_of<kQ5_1, 24>();
    default: return nullptr;
  }
}

// amx::ChunkDecoder's context: one weight tile of a 32-value format, and the weight rows
// a later tile will read (prefetch_rows rows of prefetch_row_bytes bytes, row_stride apart;
// none when prefetch_rows is 0), asked for a 1/chunks share per decoded chunk.
struct ChunkSource {
  Bf16Chunk fn;
  const uint8_t* data;
  int64_t row_stride, rows;
  int64_t chunks = 1;
  const uint8_t* prefetch = nullptr;
  int64_t prefetch_rows = 0, prefetch_row_bytes = 0;
};

// Spreading the prefetches over the chunks matters: asked for all at once before the tile
// (20 KB of the LM head's Q8_0 rows, 300+ lines), they fill the core's line-fill buffers
// and the decode's own loads queue behind them, so the stream and the decode added up
// (one core, the 32-row LM head: 4.5-5.0 ms at once, 3.1-3.3 ms spread; bench/README.md).
void decode_chunk(const void* ctx, int64_t kc, uint16_t* hi, uint16_t* lo) {
  const ChunkSource& c = *static_cast<const ChunkSource*>(ctx);
  c.fn(c.data, c.row_stride, c.rows, kc, hi, lo);
  if (c.prefetch_rows == 0) return;
  const int64_t lines_per_row = (c.prefetch_row_bytes + 63) / 64;
  const int64_t lines = c.prefetch_rows * lines_per_row;
  const int64_t share = (lines + c.chunks - 1) / c.chunks;
  const int64_t first = kc * share, n = std::min(lines, first + share) - first;
  // one division a chunk: per line it cost more than the decode (two 64-bit divisions each)
  int64_t row = first / lines_per_row, line = first % lines_per_row;
  for (int64_t i = 0; i < n; ++i) {
    prefetch(c.prefetch + row * c.row_stride + line * 64);
    if (++line == lines_per_row) {
      line = 0;
      ++row;
    }
  }
}

#endif

}  // namespace avx512
#endif

#if defined(AIOENGINE_HAVE_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define AIOENGINE_HAVE_VNNI 1
// -- AVX-512 VNNI with int8 activations (opt-in: set_q8_activations) -----------------------
// As llama.cpp's vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0: each 32-value block of a row of
// x is quantized to int8 with one fp32 scale (d = max|x| / 127, q = round(x / d)), and a
// weight block's dot with it is an integer dot product (vpdpbusd: u8 x s8, 64 products an
// instruction) scaled once by d_w * d_x. Blocks go in pairs: one 512-bit register holds
// both blocks' 64 weight values, so int32 lanes 0-3 and 8-11 sum block A, 4-7 and 12-15
// block B (Q4 formats, whose 16 packed bytes give values j and j + 16), or 0-7 and 8-15
// (Q8_0); x is stored in the same lane order. vpdpbusd takes unsigned weights: Q4_0's are
// q in [0, 16) with the -8 folded into the lane's start value (-8 * sum(x_q)), Q8_0's are
// q + 128 with -128 * sum(x_q), Q4_1's min adds m * d_x * sum(x_q).
namespace vnni {

// x quantized for one format family: per row, per pair of blocks, 64 int8 values, the
// lanes' start values, d_x per lane and (Q4_1) d_x * sum(x_q) per lane.
struct Q8Activations {
  int64_t pairs = 0;
  std::vector<int8_t> q;      // [M][pairs][64]
  std::vector<int32_t> init;  // [M][pairs][16]
  std::vector<float> dx;      // [M][pairs][16]
  std::vector<float> sx;      // [M][pairs][16]
};

void quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int qtype, Q8Activations* a) {
  const int64_t blocks = K / QK;
  a->pairs = (blocks + 1) / 2;
  const int64_t n = M * a->pairs;
  a->q.resize(n * 64);
  a->init.resize(n * 16);
  a->dx.resize(n * 16);
  a->sx.resize(n * 16);
  const bool q4 = qtype != kQ8_0;
  const __mmask16 of_b = q4 ? 0xF0F0 : 0xFF00;
  const int32_t offset = qtype == kQ4_0 ? 8 : qtype == kQ8_0 ? 128 : 0;
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < a->pairs; ++p) {
      const int64_t i = m * a->pairs + p;
      int8_t* q = &a->q[i * 64];
      float d[2] = {0.f, 0.f};
      for (int h = 0; h < 2; ++h) {
        const int64_t b = 2 * p + h;
        // Q4 order: values 0-15 at 16h, 16-31 at 32 + 16h; Q8 order: 32h, 32h + 16
        int8_t* lo_dst = q + (q4 ? 16 * h : 32 * h);
        int8_t* hi_dst = q + (q4 ? 32 + 16 * h : 32 * h + 16);
        if (b >= blocks) {  // the phantom second block of an odd count: zeros
          std::memset(lo_dst, 0, 16);
          std::memset(hi_dst, 0, 16);
          continue;
        }
        const float* xb = x + m * ldx + b * QK;
        const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        d[h] = amax / 127.f;
        const __m512 id = _mm512_set1_ps(d[h] != 0.f ? 1.f / d[h] : 0.f);
        // cvtps_epi32 rounds half to even (the default MXCSR), as torch.round
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo_dst),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, id))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi_dst),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, id))));
      }
      // per lane, the sum of its four x_q (u8 ones x s8 x_q)
      const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                              _mm512_loadu_si512(q));
      const __m512 dx = _mm512_mask_blend_ps(of_b, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
      _mm512_storeu_si512(&a->init[i * 16], _mm512_mullo_epi32(sum, _mm512_set1_epi32(-offset)));
      _mm512_storeu_ps(&a->dx[i * 16], dx);
      _mm512_storeu_ps(&a->sx[i * 16], _mm512_mul_ps(dx, _mm512_cvtepi32_ps(sum)));
    }
}

// The 64 unsigned weight values of blocks a and b (a pair) in x's lane order.
template <int QT>
inline __m512i weights(const uint8_t* a, const uint8_t* b);

template <>
inline __m512i weights<kQ4_0>(const uint8_t* a, const uint8_t* b) {
  const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + 2),
                                        reinterpret_cast<const __m128i*>(a + 2));
  const __m256i mask = _mm256_set1_epi8(0xF);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
}

template <>
inline __m512i weights<kQ4_1>(const uint8_t* a, const uint8_t* b) {
  const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + 4),
                                        reinterpret_cast<const __m128i*>(a + 4));
  const __m256i mask = _mm256_set1_epi8(0xF);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
}

template <>
inline __m512i weights<kQ8_0>(const uint8_t* a, const uint8_t* b) {
  const __m512i v = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), 1);
  return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Per-lane fp32 scale (d) and, for Q4_1, min (m) of blocks a (lanes of A) and b (of B):
// the fp16 pairs (d, m) of both blocks converted at once and spread by one permute each.
template <int QT>
inline void scales(const uint8_t* a, const uint8_t* b, __m512* d, __m512* m) {
  const __m512 h = _mm512_castps128_ps512(_mm_cvtph_ps(
      _mm_set_epi32(0, 0, static_cast<int>(load_u32(b)), static_cast<int>(load_u32(a)))));
  // [dA, mA, dB, mB]: lanes of A take element 0 (d) or 1 (m), lanes of B 2 or 3
  const __m512i d_idx = QT == kQ8_0
      ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
      : _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
  *d = _mm512_permutexvar_ps(d_idx, h);
  if (QT == kQ4_1) *m = _mm512_permutexvar_ps(_mm512_add_epi32(d_idx, _mm512_set1_epi32(1)), h);
}

// y[m * ldy + r] = dot(x[m], row r) for m < M, r < R over quantized x.
template <int QT, int TS, int M, int R>
void gemv_tile(const uint8_t* w, int64_t row_stride, int64_t blocks, const Q8Activations& a,
               int64_t m0, float* y, int64_t ldy) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.pairs; ++p) {
    const int64_t ia = 2 * p, ib = 2 * p + 1 < blocks ? 2 * p + 1 : 2 * p;  // odd tail: B = A, x 0
    for (int r = 0; r < R; ++r) {
      const uint8_t* ba = w + r * row_stride + ia * TS;
      const uint8_t* bb = w + r * row_stride + ib * TS;
      const __m512i wv = weights<QT>(ba, bb);
      __m512 dw, mw = _mm512_setzero_ps();
      scales<QT>(ba, bb, &dw, &mw);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (m0 + m) * a.pairs + p;
        const __m512i xq = _mm512_loadu_si512(&a.q[i * 64]);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(&a.init[i * 16]), wv, xq);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(&a.dx[i * 16]));
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m][r]);
        if (QT == kQ4_1) acc[m][r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(&a.sx[i * 16]), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
}

using Gemv = void (*)(const uint8_t*, int64_t, int64_t, const Q8Activations&, int64_t, float*,
                      int64_t);

template <int QT, int TS>
Gemv gemv_for(int M, int R) {
  static const Gemv table[4][4] = {
      {gemv_tile<QT, TS, 1, 1>, gemv_tile<QT, TS, 1, 2>, gemv_tile<QT, TS, 1, 3>, gemv_tile<QT, TS, 1, 4>},
      {gemv_tile<QT, TS, 2, 1>, gemv_tile<QT, TS, 2, 2>, gemv_tile<QT, TS, 2, 3>, gemv_tile<QT, TS, 2, 4>},
      {gemv_tile<QT, TS, 3, 1>, gemv_tile<QT, TS, 3, 2>, gemv_tile<QT, TS, 3, 3>, gemv_tile<QT, TS, 3, 4>},
      {gemv_tile<QT, TS, 4, 1>, gemv_tile<QT, TS, 4, 2>, gemv_tile<QT, TS, 4, 3>, gemv_tile<QT, TS, 4, 4>}};
  return table[M - 1][R - 1];
}

// The kernel for a format, or nullptr (the formats without an int8 path here).
Gemv gemv(int qtype, int M, int R) {
  switch (qtype) {
    case kQ8_0: return gemv_for<kQ8_0, 34>(M, R);
    case kQ4_0: return gemv_for<kQ4_0, 18>(M, R);
    case kQ4_1: return gemv_for<kQ4_1, 20>(M, R);
    default: return nullptr;
  }
}

}  // namespace vnni
#endif


// -- dispatch tables -----------------------------------------------------------------------

RowDequant row_dequant(int qtype, Isa isa) {
#define AIOENGINE_TABLE(ns)                                                              \
  switch (qtype) {                                                                       \
    case kF32: return scalar::f32;                                                       \
    case kF16: return ns::f16_row;                                                       \
    case kBF16: return ns::bf16_row;                                                     \
    case kQ8_0: return ns::q8_0;                                                         \
    case kQ4_0: return ns::q4_0;                                                         \
    case kQ4_1: return ns::q4_1;                                                         \
    case kQ5_0: return ns::q5_0;                                                         \
    case kQ5_1: return ns::q5_1;                                                         \
    case kQ4_K: return ns::q4_k;                                                         \
    case kQ5_K: return ns::q5_k;                                                         \
    case kQ6_K: return ns::q6_k;                                                         \
    default: TORCH_CHECK(false, "quant: unsupported GGML type ", qtype);                 \
  }
#if defined(AIOENGINE_HAVE_AVX512)
  if (isa >= Isa::kAvx512) { AIOENGINE_TABLE(avx512) }
#endif
#if defined(AIOENGINE_HAVE_AVX2)
  if (isa == Isa::kAvx2) { AIOENGINE_TABLE(avx2) }
#endif
  AIOENGINE_TABLE(scalar)
#undef AIOENGINE_TABLE
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

#define AIOENGINE_MICRO_TABLE(ns)                                                        \
  Micro ns##_micro(int M, int R) {                                                       \
    static const Micro table[4][4] = {                                                   \
        {ns::micro_tile<1, 1>, ns::micro_tile<1, 2>, ns::micro_tile<1, 3>, ns::micro_tile<1, 4>}, \
        {ns::micro_tile<2, 1>, ns::micro_tile<2, 2>, ns::micro_tile<2, 3>, ns::micro_tile<2, 4>}, \
        {ns::micro_tile<3, 1>, ns::micro_tile<3, 2>, ns::micro_tile<3, 3>, ns::micro_tile<3, 4>}, \
        {ns::micro_tile<4, 1>, ns::micro_tile<4, 2>, ns::micro_tile<4, 3>, ns::micro_tile<4, 4>}}; \
    return table[M - 1][R - 1];                                                          \
  }
#if defined(AIOENGINE_HAVE_AVX512)
AIOENGINE_MICRO_TABLE(avx512)
#endif
#if defined(AIOENGINE_HAVE_AVX2)
AIOENGINE_MICRO_TABLE(avx2)
#endif
#undef AIOENGINE_MICRO_TABLE

// y[m * ldy + r] = dot(x[m], w[r]) for m < M (<= 4), r < R (<= 4).
inline void micro(Isa isa, int M, int R, const float* x, int64_t ldx, const float* w,
                  int64_t ldw, int64_t K, float* y, int64_t ldy) {
#if defined(AIOENGINE_HAVE_AVX512)
  if (isa >= Isa::kAvx512) return avx512_micro(M, R)(x, ldx, w, ldw, K, y, ldy);
#endif
#if defined(AIOENGINE_HAVE_AVX2)
  if (isa == Isa::kAvx2) return avx2_micro(M, R)(x, ldx, w, ldw, K, y, ldy);
#endif
  scalar::micro(M, R, x, ldx, w, ldw, K, y, ldy);
}

}  // namespace

namespace {
std::atomic<bool> amx_on{true};
}  // namespace

bool set_amx(bool on) {
  amx_on.store(on);
  return on && amx::available();
}

bool amx_allowed() { return amx_on.load(); }

Isa resolve_isa(int64_t requested) {
  Isa best = Isa::kScalar;
#if defined(AIOENGINE_HAVE_AVX512)
  best = Isa::kAvx512;
#elif defined(AIOENGINE_HAVE_AVX2)
  best = Isa::kAvx2;
#endif
#if defined(AIOENGINE_HAVE_AVX512)
  if (amx::available()) best = Isa::kAmx;
#endif
  if (requested < 0) return best;
  TORCH_CHECK(requested <= 3, "quant: isa must be -1 (best), 0 (scalar), 1 (AVX2), 2 (AVX-512) "
              "or 3 (AMX)");
  Isa isa = static_cast<Isa>(requested);
  return static_cast<int>(isa) > static_cast<int>(best) ? best : isa;
}

int64_t block_size(int qtype) {
  switch (qtype) {
    case kF32: case kF16: case kBF16: return 1;
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: return QK;
    case kQ4_K: case kQ5_K: case kQ6_K: return QK_K;
    default: TORCH_CHECK(false, "quant: unsupported GGML type ", qtype);
  }
}

int64_t type_size(int qtype) {
  switch (qtype) {
    case kF32: return 4;
    case kF16: case kBF16: return 2;
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: TORCH_CHECK(false, "quant: unsupported GGML type ", qtype);
  }
}

namespace {

// Checks one part tensor and describes it.
WeightPart make_part(const at::Tensor& t, int qtype, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2, "quant: a weight part must be a 2-D CPU tensor");
  const int64_t bs = block_size(qtype);
  TORCH_CHECK(cols % bs == 0, "quant: cols ", cols, " is not a multiple of the block size ", bs);
  if (qtype == kF32) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.size(1) == cols && t.stride(1) == 1,
                "quant: an F32 part must be fp32 [rows, ", cols, "] with unit column stride");
    return {reinterpret_cast<const uint8_t*>(t.data_ptr<float>()), t.stride(0) * 4, qtype, t.size(0)};
  }
  const int64_t row_bytes = cols / bs * type_size(qtype);
  TORCH_CHECK(t.scalar_type() == at::kByte && t.size(1) == row_bytes &&
                  (t.stride(1) == 1 || t.size(1) == 1) && (t.stride(0) >= row_bytes || t.size(0) <= 1),
              "quant: a GGML type ", qtype, " part of ", cols, " columns must be uint8 [rows, ",
              row_bytes, "] with contiguous rows, got ", t.scalar_type(), " ", t.sizes());
  return {t.data_ptr<uint8_t>(), t.stride(0), qtype, t.size(0)};
}

}  // namespace

QuantLinear make_quant_linear(const std::vector<at::Tensor>& parts,
                              const std::vector<int64_t>& qtypes, int64_t cols) {
  TORCH_CHECK(!parts.empty() && parts.size() == qtypes.size(),
              "quant: one GGML type per weight part expected");
  TORCH_CHECK(cols > 0, "quant: cols must be positive");
  QuantLinear w;
  w.cols = cols;
  for (size_t i = 0; i < parts.size(); ++i) {
    w.parts.push_back(make_part(parts[i], static_cast<int>(qtypes[i]), cols));
    w.tensors.push_back(parts[i]);
    w.rows += w.parts.back().rows;
  }
  return w;
}

namespace {
std::atomic<bool> q8_activations_on{false};
}  // namespace

bool set_q8_activations(bool on) {
#if defined(AIOENGINE_HAVE_VNNI)
  q8_activations_on.store(on);
  return true;
#else
  (void)on;
  return false;
#endif
}

bool q8_activations() { return q8_activations_on.load(); }

namespace {
std::atomic<bool> bf16_gemm_on{true};
}  // namespace

void set_bf16_gemm(bool on) { bf16_gemm_on.store(on); }
bool bf16_gemm() { return bf16_gemm_on.load(); }

bool set_amx_table_decode(bool on) {
#if defined(AIOENGINE_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  return avx512::bf16_chunk_lut_on.exchange(on);
#else
  (void)on;
  return false;
#endif
}

namespace {

// Each thread's running argmax of y's rows over the tiles it computed (quant_linear_argmax_into).
struct ThreadArgmax {
  std::vector<float> value;
  std::vector<int64_t> index;
};

// value/index[m] <- the first largest of yt[m * ldt + r] (r < rows; weight rows n0 + r) if it
// beats them (strictly larger, or the first NaN: torch.max's order).
void row_argmax_update(const float* yt, int64_t ldt, int64_t M, int64_t rows, int64_t n0,
                       float* value, int64_t* index) {
  for (int64_t m = 0; m < M; ++m) {
    const float* v = yt + m * ldt;
    float best = value[m];
    if (std::isnan(best)) continue;  // the first NaN stays
    int64_t at = -1;
#if defined(__AVX512F__)
    // 16 at a time: the chunk's maximum, then its first lane equal to it.
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const __mmask16 k = rows - r0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (rows - r0)) - 1);
      const __m512 c = _mm512_mask_loadu_ps(neg_inf, k, v + r0);
      const __mmask16 nan = _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q);
      if (nan != 0) {
        best = std::numeric_limits<float>::quiet_NaN();
        at = r0 + __builtin_ctz(nan);
        break;
      }
      const float mx = _mm512_reduce_max_ps(c);
      if (mx > best) {
        best = mx;
        at = r0 + __builtin_ctz(_mm512_cmp_ps_mask(c, _mm512_set1_ps(mx), _CMP_EQ_OQ));
      }
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
      if (v[r] > best || (std::isnan(v[r]) && !std::isnan(best))) {
        best = v[r];
        at = r;
      }
    }
#endif
    if (at >= 0) {
      value[m] = best;
      index[m] = n0 + at;
    }
  }
}

void quant_linear_impl(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M,
                       const QuantLinear& w, const float* bias, Isa isa, int64_t* argmax_out) {
  const int64_t K = w.cols;
  // Tile height: at decode 4 rows keep the buffer in L1 and give the threads many tiles;
  // for batches 16 rows (32 on AMX: two A tiles) are dequantized once for all rows of x.
  // AMX from 9 rows in plain bf16; its fp32-grade mode does three tile products and pays
  // for them from about 17 rows (bench/README.md). set_amx(false) takes effect at once.
  const bool x3 = !bf16_gemm();
  const bool use_amx = isa == Isa::kAmx && amx_allowed() && M > (x3 ? kAmxX3MinRows - 1 : kGemvMaxRows);
  const int64_t T = M <= kGemvMaxRows ? 4 : use_amx ? amx::kWeightRows : 16;
  std::vector<int64_t> first_tile(w.parts.size() + 1, 0), first_row(w.parts.size(), 0);
  std::vector<RowDequant> dequant(w.parts.size());
  std::vector<int64_t> row_bytes(w.parts.size());
  // Parts decoded in registers (AVX-512 GEMV for the 32-value formats) or through the buffer.
  std::vector<char> fused(w.parts.size(), 0);
  // Parts the AMX GEMM decodes chunk by chunk (32-value formats) rather than through the buffer.
  std::vector<char> bf16_decodable(w.parts.size(), 0);
  // AMX (M > 8): x packed into bf16 tiles once, before the threads
  thread_local amx::PackedActivations packed;
  // a pointer: inside the threads' lambda `packed` would name each thread's own instance
  const amx::PackedActivations* xp = &packed;
  if (use_amx)
    amx::pack_activations(x, ldx, M, K, x3 ? amx::Precision::kBf16x3 : amx::Precision::kBf16,
                          &packed);
#if defined(AIOENGINE_HAVE_VNNI)
  // int8 activations (opt-in): x quantized once per format family, before the threads
  thread_local vnni::Q8Activations q8[3];  // Q4_0, Q4_1, Q8_0
  bool quantized[3] = {false, false, false};
  const bool use_q8 = q8_activations() && isa >= Isa::kAvx512 && M <= kGemvMaxRows;
  std::vector<const vnni::Q8Activations*> q8_of(w.parts.size(), nullptr);
#endif
  for (size_t p = 0; p < w.parts.size(); ++p) {
#if defined(AIOENGINE_HAVE_AVX512)
    fused[p] = isa >= Isa::kAvx512 && M <= kGemvMaxRows &&
               avx512::gemv(w.parts[p].qtype, 1, 1) != nullptr;
#endif
#if defined(AIOENGINE_HAVE_AVX512) && defined(__AVX512BF16__)
    bf16_decodable[p] = avx512::bf16_chunk_for(w.parts[p].qtype) != nullptr;
#endif
#if defined(AIOENGINE_HAVE_VNNI)
    const int qt = w.parts[p].qtype;
    // Measured (bench/quant_kernels.py --q8-activations, one core): 1.15-1.4x the fp32
    // GEMV at 1-2 rows; at 4-8 rows Q8_0 gains 1.0-1.1x, Q4_0/Q4_1 lose (0.7-0.8x: the
    // per-row scale products outweigh the shared decode), so they keep fp32 there.
    if (use_q8 && vnni::gemv(qt, 1, 1) != nullptr && (qt == kQ8_0 || M <= kQ8MaxRowsQ4)) {
      const int slot = qt == kQ4_0 ? 0 : qt == kQ4_1 ? 1 : 2;
      if (!quantized[slot]) vnni::quantize(x, ldx, M, K, qt, &q8[slot]);
      quantized[slot] = true;
      q8_of[p] = &q8[slot];
    }
#endif
    first_tile[p + 1] = first_tile[p] + (w.parts[p].rows + T - 1) / T;
    if (p > 0) first_row[p] = first_row[p - 1] + w.parts[p - 1].rows;
    dequant[p] = row_dequant(w.parts[p].qtype, isa);
    row_bytes[p] = K / block_size(w.parts[p].qtype) * type_size(w.parts[p].qtype);
  }
  // Fused argmax: each thread's tiles go to a small buffer (ldt = T) instead of y, and
  // only the running argmax of its rows is kept (AMX: taken from the C tiles directly).
  const bool fused_argmax = argmax_out != nullptr;
  const int64_t padded = (M + 15) / 16 * 16;
  std::vector<ThreadArgmax> per_thread(fused_argmax ? at::get_num_threads() : 0);
  for (ThreadArgmax& a : per_thread) {
    a.value.assign(padded, -std::numeric_limits<float>::infinity());
    a.index.assign(padded, std::numeric_limits<int64_t>::max());
  }
  at::parallel_for(0, first_tile.back(), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer, y_tile;
    if (static_cast<int64_t>(buffer.size()) < T * K) buffer.resize(T * K);
    float* buf = buffer.data();
    ThreadArgmax* mine = nullptr;
    amx::RowArgmax row_argmax;
    if (fused_argmax) {
      mine = &per_thread[at::get_thread_num()];
      row_argmax = {mine->value.data(), mine->index.data()};
      if (static_cast<int64_t>(y_tile.size()) < M * T) y_tile.resize(M * T);
    }
    thread_local std::vector<uint16_t> a_hi, a_lo;  // AMX A tiles
    if (use_amx) {
      a_hi.resize(amx::weight_tile_elems(K));
      a_lo.resize(x3 ? amx::weight_tile_elems(K) : 0);
      amx::tile_begin();
    }
    size_t p = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first_tile[p + 1]) ++p;
      const WeightPart& part = w.parts[p];
      const int64_t r0 = (t - first_tile[p]) * T, rows = std::min(T, part.rows - r0);
      const int64_t n0 = first_row[p] + r0;
      // Where this tile's outputs go: y, or (fused argmax) the thread's tile buffer.
      float* const yt = fused_argmax ? y_tile.data() : y + n0;
      const int64_t ldt = fused_argmax ? T : ldy;
      const float* const bt = bias != nullptr ? bias + n0 : nullptr;
      // At decode the weight streams from DRAM once per step: ask for a tile a few tiles
      // ahead, so the misses of one thread overlap instead of queueing behind its compute.
      // (Not for a part whose AMX tiles were decoded once: those are what the GEMM reads.)
      const bool packed_tiles = use_amx && !x3 && part.amx_tiles != nullptr;
      // (AMX with a chunk decoder: its decode_chunk calls ask for them, spread out.)
      const bool chunk_decoded = use_amx && !packed_tiles && bf16_decodable[p];
      const bool ahead_ok = t + kPrefetchTiles < end && t + kPrefetchTiles < first_tile[p + 1];
      const int64_t ahead = r0 + kPrefetchTiles * T;
      const int64_t ahead_rows = ahead_ok ? std::min(part.rows, ahead + T) - ahead : 0;
      if (!packed_tiles && !chunk_decoded)
        for (int64_t r = ahead; r < ahead + ahead_rows; ++r)
          for (int64_t off = 0; off < row_bytes[p]; off += 64)
            prefetch(part.data + r * part.row_stride + off);
#if defined(AIOENGINE_HAVE_VNNI)
      if (q8_of[p] != nullptr) {
        const int R = static_cast<int>(rows);
        for (int64_t m0 = 0; m0 < M; m0 += 4)
          vnni::gemv(part.qtype, static_cast<int>(std::min<int64_t>(4, M - m0)), R)(
              part.data + r0 * part.row_stride, part.row_stride, K / QK, *q8_of[p], m0,
              yt + m0 * ldt, ldt);
        if (bt != nullptr)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < rows; ++r) yt[m * ldt + r] += bt[r];
        if (fused_argmax) row_argmax_update(yt, ldt, M, rows, n0, row_argmax.value, row_argmax.index);
        continue;
      }
#endif
#if defined(AIOENGINE_HAVE_AVX512)
      if (fused[p]) {
        const int R = static_cast<int>(rows);
        for (int64_t m0 = 0; m0 < M; m0 += 4)  // up to 8 rows: decoding twice beats the buffer
          avx512::gemv(part.qtype, static_cast<int>(std::min<int64_t>(4, M - m0)), R)(
              part.data + r0 * part.row_stride, part.row_stride, K / QK, x + m0 * ldx, ldx,
              yt + m0 * ldt, ldt);
        if (bt != nullptr)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < rows; ++r) yt[m * ldt + r] += bt[r];
        if (fused_argmax) row_argmax_update(yt, ldt, M, rows, n0, row_argmax.value, row_argmax.index);
        continue;
      }
#endif
#if defined(AIOENGINE_HAVE_AVX512) && defined(__AVX512BF16__)
      if (packed_tiles) {  // quant_amx_pack's tiles, T = kWeightRows rows each: no decode
        const uint16_t* a = part.amx_tiles + (r0 / T) * amx::weight_tile_elems(K);
        amx::gemm_tile(const_cast<uint16_t*>(a), nullptr, rows, *xp, yt, ldt, bt, nullptr, n0,
                       fused_argmax ? &row_argmax : nullptr);  // only read without a decoder
        continue;
      }
      if (use_amx) {
        uint16_t* lo = x3 ? a_lo.data() : nullptr;
        // 32-value formats: decoded chunk by chunk inside gemm_tile, overlapping the
        // tile products; the others through the fp32 buffer first.
        const avx512::ChunkSource source{avx512::bf16_chunk_for(part.qtype),
                                         part.data + r0 * part.row_stride,
                                         part.row_stride,
                                         rows,
                                         (K + QK - 1) / QK,
                                         part.data + ahead * part.row_stride,
                                         ahead_rows,
                                         row_bytes[p]};
        const amx::ChunkDecoder decoder{avx512::decode_chunk, &source};
        if (source.fn == nullptr) {
          for (int64_t r = 0; r < rows; ++r)
            dequant[p](part.data + (r0 + r) * part.row_stride, K, buf + r * K);
          amx::pack_weight_rows(buf, K, rows, K, x3, a_hi.data(), lo);
        }
        amx::gemm_tile(a_hi.data(), lo, rows, *xp, yt, ldt, bt,
                       source.fn != nullptr ? &decoder : nullptr, n0,
                       fused_argmax ? &row_argmax : nullptr);
        continue;
      }
#endif
      for (int64_t r = 0; r < rows; ++r)
        dequant[p](part.data + (r0 + r) * part.row_stride, K, buf + r * K);
      for (int64_t rr = 0; rr < rows; rr += 4) {
        const int R = static_cast<int>(std::min<int64_t>(4, rows - rr));
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int MM = static_cast<int>(std::min<int64_t>(4, M - m0));
          micro(isa, MM, R, x + m0 * ldx, ldx, buf + rr * K, K, K, yt + m0 * ldt + rr, ldt);
        }
      }
      if (bt != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t r = 0; r < rows; ++r) yt[m * ldt + r] += bt[r];
      if (fused_argmax) row_argmax_update(yt, ldt, M, rows, n0, row_argmax.value, row_argmax.index);
    }
    if (use_amx) amx::tile_release();
  });
  if (!fused_argmax) return;
  // Threads took contiguous ranges of rows: the largest wins, ties the lowest index.
  for (int64_t m = 0; m < M; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    int64_t at = std::numeric_limits<int64_t>::max();
    for (const ThreadArgmax& a : per_thread) {
      const float v = a.value[m];
      const int64_t i = a.index[m];
      if (i == std::numeric_limits<int64_t>::max()) continue;  // that thread saw only -inf
      const bool nan = std::isnan(v), best_nan = std::isnan(best);
      const bool better = nan ? (!best_nan || i < at)
                              : !best_nan && (v > best || (v == best && i < at));
      if (better || at == std::numeric_limits<int64_t>::max()) {
        best = v;
        at = i;
      }
    }
    argmax_out[m] = at == std::numeric_limits<int64_t>::max() ? 0 : at;  // all -inf: torch's 0
  }
}

}  // namespace

void quant_linear_into(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M,
                       const QuantLinear& w, const float* bias, Isa isa) {
  quant_linear_impl(y, ldy, x, ldx, M, w, bias, isa, nullptr);
}

void quant_linear_argmax_into(int64_t* out, const float* x, int64_t ldx, int64_t M,
                              const QuantLinear& w, const float* bias, Isa isa) {
  quant_linear_impl(nullptr, 0, x, ldx, M, w, bias, isa, out);
}

at::Tensor quant_dequantize(at::Tensor data, int64_t qtype, int64_t cols, int64_t isa) {
  const WeightPart part = make_part(data, static_cast<int>(qtype), cols);
  const RowDequant fn = row_dequant(part.qtype, resolve_isa(isa));
  at::Tensor out = at::empty({part.rows, cols}, data.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, part.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(part.data + r * part.row_stride, cols, y + r * cols);
  });
  return out;
}

at::Tensor quant_linear(at::Tensor x, std::vector<at::Tensor> parts, std::vector<int64_t> qtypes,
                        int64_t cols, c10::optional<at::Tensor> bias, int64_t isa) {
  const QuantLinear w = make_quant_linear(parts, qtypes, cols);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.scalar_type() == at::kFloat &&
                  x.stride(1) == 1 && x.device().is_cpu(),
              "quant_linear: x must be fp32 [M, ", cols, "] with unit column stride");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == w.rows, "quant_linear: bias must be fp32 [", w.rows, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  if (x.size(0) > 0)
    quant_linear_into(y.data_ptr<float>(), w.rows, x.data_ptr<float>(), x.stride(0), x.size(0), w,
                      b, resolve_isa(isa));
  return y;
}

at::Tensor quant_linear_argmax(at::Tensor x, std::vector<at::Tensor> parts,
                               std::vector<int64_t> qtypes, int64_t cols,
                               c10::optional<at::Tensor> bias, int64_t isa) {
  const QuantLinear w = make_quant_linear(parts, qtypes, cols);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.scalar_type() == at::kFloat &&
                  x.stride(1) == 1 && x.device().is_cpu(),
              "quant_linear_argmax: x must be fp32 [M, ", cols, "] with unit column stride");
  TORCH_CHECK(w.rows > 0, "quant_linear_argmax: the weight has no rows");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == w.rows, "quant_linear_argmax: bias must be fp32 [", w.rows, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) > 0)
    quant_linear_argmax_into(out.data_ptr<int64_t>(), x.data_ptr<float>(), x.stride(0), x.size(0),
                             w, b, resolve_isa(isa));
  return out;
}

at::Tensor quant_amx_pack(at::Tensor data, int64_t qtype, int64_t cols) {
  const WeightPart part = make_part(data, static_cast<int>(qtype), cols);
#if defined(AIOENGINE_HAVE_AVX512) && defined(__AVX512BF16__)
  const avx512::Bf16Chunk fn = avx512::bf16_chunk_for(part.qtype);
  TORCH_CHECK(fn != nullptr, "quant_amx_pack: GGML type ", qtype, " is not a 32-value format "
              "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)");
  const int64_t tiles = (part.rows + amx::kWeightRows - 1) / amx::kWeightRows;
  const int64_t chunks = (cols + QK - 1) / QK, elems = amx::weight_tile_elems(cols);
  at::Tensor out = at::empty({tiles, chunks, amx::kWeightRows, QK}, data.options().dtype(at::kShort));
  uint16_t* a = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
  // The tiles gemm_tile's decoder fills in bf16 mode (lo = nullptr), kept.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * amx::kWeightRows;
      const int64_t rows = std::min(amx::kWeightRows, part.rows - r0);
      for (int64_t kc = 0; kc < chunks; ++kc)
        fn(part.data + r0 * part.row_stride, part.row_stride, rows, kc,
           a + t * elems + kc * amx::kWeightRows * QK, nullptr);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "quant_amx_pack: this build has no AVX512-BF16 code");
#endif
}

at::Tensor quant_linear_packed(at::Tensor x, at::Tensor data, int64_t qtype, int64_t cols,
                               at::Tensor amx_tiles, c10::optional<at::Tensor> bias,
                               bool argmax, int64_t isa) {
  QuantLinear w = make_quant_linear({data}, {qtype}, cols);
  const int64_t tiles = (w.rows + amx::kWeightRows - 1) / amx::kWeightRows;
  TORCH_CHECK(amx_tiles.device().is_cpu() && amx_tiles.scalar_type() == at::kShort &&
                  amx_tiles.is_contiguous() &&
                  amx_tiles.numel() == tiles * amx::weight_tile_elems(cols),
              "quant_linear_packed: amx_tiles must be quant_amx_pack's int16 [", tiles, ", ",
              (cols + QK - 1) / QK, ", ", amx::kWeightRows, ", ", QK, "] of this weight");
  w.parts[0].amx_tiles = reinterpret_cast<const uint16_t*>(amx_tiles.data_ptr<int16_t>());
  w.tensors.push_back(amx_tiles);
  const char* name = argmax ? "quant_linear_packed (argmax)" : "quant_linear_packed";
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.scalar_type() == at::kFloat &&
                  x.stride(1) == 1 && x.device().is_cpu(),
              name, ": x must be fp32 [M, ", cols, "] with unit column stride");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == w.rows, name, ": bias must be fp32 [", w.rows, "]");
    b = bias->data_ptr<float>();
  }
  if (argmax) {
    TORCH_CHECK(w.rows > 0, name, ": the weight has no rows");
    at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
    if (x.size(0) > 0)
      quant_linear_argmax_into(out.data_ptr<int64_t>(), x.data_ptr<float>(), x.stride(0),
                               x.size(0), w, b, resolve_isa(isa));
    return out;
  }
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  if (x.size(0) > 0)
    quant_linear_into(y.data_ptr<float>(), w.rows, x.data_ptr<float>(), x.stride(0), x.size(0), w,
                      b, resolve_isa(isa));
  return y;
}

at::Tensor quant_embedding(at::Tensor ids, at::Tensor data, int64_t qtype, int64_t cols,
                           int64_t isa) {
  const WeightPart part = make_part(data, static_cast<int>(qtype), cols);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "quant_embedding: ids must be contiguous int64 [T]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < part.rows, "quant_embedding: id ", id[t], " outside [0, ",
                part.rows, ")");
  const RowDequant fn = row_dequant(part.qtype, resolve_isa(isa));
  at::Tensor out = at::empty({ids.numel(), cols}, data.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, ids.numel(), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(part.data + id[t] * part.row_stride, cols, y + t * cols);
  });
  return out;
}

}  // namespace aioengine
