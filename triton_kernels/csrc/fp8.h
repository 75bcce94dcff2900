// The 8-bit floating-point KV cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): the
// OCP 8-bit Floating Point Specification (OFP8, rev. 1.0, 2023) formats as torch stores
// them, c10::Float8_e4m3fn (E4M3: bias 7, no infinities, S.1111.111 the only NaNs, max
// normal 448, smallest subnormal 2^-9) and c10::Float8_e5m2 (E5M2: bias 15, IEEE-style
// infinities and NaNs, max normal 57344, smallest subnormal 2^-16). As vLLM's fp8 cache
// without calibrated scales: K/V are stored unscaled (scale 1.0).
//
// Writing (fp32 -> fp8): round to nearest, ties to even, saturating: a value beyond the
// largest finite one (an infinity included) stores that value with its sign, as vLLM's
// writes with __NV_SATFINITE do; NaN stores NaN. Reading (fp8 -> fp32) is exact: every
// E4M3 and E5M2 value is an fp16 value up to a power of two, so the AVX-512 loads widen
// bytes to fp16 bit patterns and convert with vcvtph2ps (subnormals included).

#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace aioengine {

template <typename T>
constexpr bool is_fp8 = std::is_same<T, c10::Float8_e4m3fn>::value ||
                        std::is_same<T, c10::Float8_e5m2>::value;

namespace fp8 {

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// The format's constants as fp32 bit patterns and shifts. Normal values keep the top
// MANT mantissa bits of an fp32 (shift 23 - MANT), rebiased; values below the smallest
// normal are rounded to a multiple of the smallest subnormal by one fp32 addition of
// kDenormAdd (whose ulp is that subnormal), the FPU's round-to-nearest-even doing the
// rounding (c10's conversion uses the same two steps).
template <typename T>
struct Format;
template <>
struct Format<c10::Float8_e4m3fn> {
  static constexpr int kMant = 3, kBias = 7;
  static constexpr uint32_t kMaxBits = 0x43E00000u;   // 448.0f
  static constexpr uint32_t kMinNormal = 121u << 23;  // 2^-6
  static constexpr uint32_t kDenormAdd = 141u << 23;  // 2^14: ulp 2^-9
  static constexpr uint8_t kMaxCode = 0x7E, kNanCode = 0x7F;
};
template <>
struct Format<c10::Float8_e5m2> {
  static constexpr int kMant = 2, kBias = 15;
  static constexpr uint32_t kMaxBits = 0x47600000u;   // 57344.0f
  static constexpr uint32_t kMinNormal = 113u << 23;  // 2^-14
  static constexpr uint32_t kDenormAdd = 134u << 23;  // 2^7: ulp 2^-16
  static constexpr uint8_t kMaxCode = 0x7B, kNanCode = 0x7F;
};

// fp32 -> the fp8 code of T, round to nearest even, saturating (above).
template <typename T>
inline uint8_t from_float(float x) {
  using F = Format<T>;
  constexpr int shift = 23 - F::kMant;
  uint32_t f = bits_of(x);
  const uint8_t sign = static_cast<uint8_t>((f >> 24) & 0x80u);
  f &= 0x7FFFFFFFu;
  if (f > 0x7F800000u) return sign | F::kNanCode;
  if (f >= F::kMaxBits) return sign | F::kMaxCode;
  if (f < F::kMinNormal)
    return sign | static_cast<uint8_t>(bits_of(float_of(f) + float_of(F::kDenormAdd)) - F::kDenormAdd);
  const uint32_t odd = (f >> shift) & 1u;
  f += (static_cast<uint32_t>(F::kBias - 127) << 23) + ((1u << (shift - 1)) - 1) + odd;
  return sign | static_cast<uint8_t>(f >> shift);
}

#if defined(__AVX512F__)
// 16 fp32 -> 16 fp8 codes of T, the lanes of from_float.
template <typename T>
inline __m128i from_float16(__m512 x) {
  using F = Format<T>;
  constexpr int shift = 23 - F::kMant;
  const __m512i f = _mm512_castps_si512(x);
  const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(f, _mm512_set1_epi32(INT32_MIN)), 24);
  const __m512i a = _mm512_and_si512(f, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  const __mmask16 sat = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(F::kMaxBits)));
  const __mmask16 sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(F::kMinNormal)));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(static_cast<int>(
      (static_cast<uint32_t>(F::kBias - 127) << 23) + ((1u << (shift - 1)) - 1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd), shift);
  const __m512i denorm = _mm512_set1_epi32(static_cast<int>(F::kDenormAdd));
  const __m512i s = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))),
      denorm);
  r = _mm512_mask_mov_epi32(r, sub, s);
  r = _mm512_mask_mov_epi32(r, sat, _mm512_set1_epi32(F::kMaxCode));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(F::kNanCode));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, sign));
}

// 16 E5M2 bytes as fp32: each byte is the high byte of the fp16 of the same value.
inline __m512 e5m2_to_ps(__m128i bytes) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}

// 16 E4M3 bytes as fp32: the sign to bit 15 and the other 7 bits (exponent, mantissa)
// shifted left by 7 make the fp16 of the value times 2^-8 (exponent bias 15 against 7;
// subnormals land on fp16 subnormals), converted and scaled by 2^8, both exact. Sign
// extension then shift left 7 puts the sign in bit 15 (and a copy in bit 14, cleared).
// S.1111.111, the NaNs, would come out as +-480 (+-1.875 before the scaling), outside the
// format's range: those lanes take NaN instead of the product (one masked multiply).
inline __m512 e4m3_to_ps(__m128i bytes) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                     _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m512 f = _mm512_cvtph_ps(h);
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(1.875f), _CMP_NEQ_UQ);
  return _mm512_mask_mul_ps(_mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()), finite, f,
                            _mm512_set1_ps(256.f));
}
#endif

}  // namespace fp8

// n fp32 values into a cache row of cache_t: rounded to nearest (even) for fp16/bf16, and
// for fp8 also saturated (fp8.h's header); the cache write of reshape_and_cache and of the
// fused decoder layers.
template <typename cache_t>
inline void store_row(const float* src, cache_t* dst, int64_t n) {
  if constexpr (is_fp8<cache_t>) {
    uint8_t* out = reinterpret_cast<uint8_t*>(dst);
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       fp8::from_float16<cache_t>(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; ++i) out[i] = fp8::from_float<cache_t>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<cache_t>(src[i]);
  }
}

}  // namespace aioengine
