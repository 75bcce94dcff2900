// One-pass-per-step categorical sampling over the whole vocabulary (sampling.h).
//
// Per row: the max, then e[i] = exp((x[i] - max) / T) into a row buffer (the unnormalised
// probabilities; the largest is 1). Each filter lowers to a threshold on e: min-p is
// e >= min_p, top-k the k-th largest e, top-p the e at which the descending running mass
// reaches top_p of the mass left. The k-th largest and the top-p cut are found by a
// histogram select on e's float bits (a radix select's first digit: sign, exponent and
// three mantissa bits, 2048 buckets), then a sort of the one bucket that holds the cut:
// no sort of the vocabulary. For top-p, tokens below (1 - top_p) * mass / vocab cannot
// be in the nucleus (all such tokens together hold less than 1 - top_p of it) and are not
// histogrammed. The draw sums the kept e per 256-token block, finds the block where
// u * total falls, and walks that block only. Sums are in fp64 between blocks.

#include "sampling.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "simd.h"

namespace aioengine {
namespace {

constexpr int64_t kBlock = 256;
constexpr int kBucketShift = 20;                       // keep sign, exponent, 3 mantissa bits
constexpr int kNumBuckets = 1 << (31 - kBucketShift);  // positive floats only

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(acc);
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// e[i] = exp((x[i] - m) * inv_t): -inf logits give 0.
void exp_scaled(const float* x, float* e, int64_t n, float m, float inv_t) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(e + i, _ZGVeN16v_expf(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vt)));
#elif defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(e + i, _ZGVdN8v_expf(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vt)));
#endif
  for (; i < n; ++i) e[i] = std::exp((x[i] - m) * inv_t);
}

// sums[b] = the sum of e[i] >= t over block b (kBlock tokens); returns their fp64 total.
double block_sums(const float* e, int64_t n, float t, float* sums) {
  double total = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    const int64_t end = std::min(n, start + kBlock);
    float acc[16] = {0.f};
    int64_t i = start;
    // Sixteen partial sums: GCC vectorises this without -ffast-math.
    for (; i + 16 <= end; i += 16)
      for (int j = 0; j < 16; ++j) acc[j] += e[i + j] >= t ? e[i + j] : 0.f;
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += acc[j];
    for (; i < end; ++i) s += e[i] >= t ? e[i] : 0.f;
    sums[b] = s;
    total += s;
  }
  return total;
}

struct RowScratch {
  std::vector<float> e, sums, candidates, bucket;
};

// out[0..c) = the e[i] >= lo, in order; returns c. out has room for n + 16 floats.
int64_t compact_at_least(const float* e, int64_t n, float lo, float* out) {
  int64_t c = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 vlo = _mm512_set1_ps(lo);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ);
    _mm512_storeu_ps(out + c, _mm512_maskz_compress_ps(keep, v));
    c += __builtin_popcount(keep);
  }
#endif
  for (; i < n; ++i) {
    out[c] = e[i];
    c += e[i] >= lo;
  }
  return c;
}

// Thresholds tried by raise_floor, largest first (e's largest value is 1).
constexpr int kLadder = 8;
constexpr float kLadderValues[kLadder] = {0.5f,          0.25f,          0.125f,
                                          1.f / 32,      1.f / 128,      1.f / 1024,
                                          1.f / 16384,   1.f / 1048576};

// The largest ladder value v > lo whose count (by_mass false) or mass (true) of e >= v
// reaches goal, else lo: a lower bound of select_descending's answer from one vectorised
// pass, so that only the e >= v are compacted and histogrammed (a few hundred for a
// peaked row instead of the vocabulary). Masses are fp32 lane sums, so they must clear
// goal by a margin.
float raise_floor(const float* e, int64_t n, float lo, bool by_mass, double goal) {
  float counts[kLadder] = {0.f}, masses[kLadder] = {0.f};
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vc[kLadder], vm[kLadder], vt[kLadder];
  for (int j = 0; j < kLadder; ++j) {
    vc[j] = vm[j] = _mm512_setzero_ps();
    vt[j] = _mm512_set1_ps(kLadderValues[j]);
  }
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    for (int j = 0; j < kLadder; ++j) {
      const __mmask16 ge = _mm512_cmp_ps_mask(v, vt[j], _CMP_GE_OQ);
      vc[j] = _mm512_mask_add_ps(vc[j], ge, vc[j], one);
      vm[j] = _mm512_mask_add_ps(vm[j], ge, vm[j], v);
    }
  }
  for (int j = 0; j < kLadder; ++j) {
    counts[j] = _mm512_reduce_add_ps(vc[j]);
    masses[j] = _mm512_reduce_add_ps(vm[j]);
  }
#endif
  for (; i < n; ++i)
    for (int j = 0; j < kLadder; ++j)
      if (e[i] >= kLadderValues[j]) {
        counts[j] += 1.f;
        masses[j] += e[i];
      }
  for (int j = 0; j < kLadder; ++j) {
    if (kLadderValues[j] <= lo) break;
    if (by_mass ? masses[j] >= goal * (1.0 + 1e-4) : counts[j] >= goal) return kLadderValues[j];
  }
  return lo;
}

// Among e[i] >= lo: the value v at which the descending running count (by_mass false) or
// mass (by_mass true) first reaches goal; lo (or raise_floor's bound) when it never does
// (rounding).
float select_descending(const float* e, int64_t n, float lo, bool by_mass, double goal,
                        RowScratch& s) {
  lo = std::max(lo, raise_floor(e, n, lo, by_mass, goal));
  s.candidates.resize(n + 16);
  float* cand = s.candidates.data();
  const int64_t c = compact_at_least(e, n, lo, cand);
  std::array<float, kNumBuckets> mass{};
  std::array<int32_t, kNumBuckets> count{};
  for (int64_t i = 0; i < c; ++i) {
    const uint32_t b = float_bits(cand[i]) >> kBucketShift;
    ++count[b];
    mass[b] += cand[i];
  }
  double cum = 0.0;
  for (int b = kNumBuckets - 1; b >= 0; --b) {
    const double add = by_mass ? static_cast<double>(mass[b]) : static_cast<double>(count[b]);
    if (count[b] == 0 || cum + add < goal) {
      cum += add;
      continue;
    }
    // The crossing bucket, sorted: usually a few dozen values.
    s.bucket.resize(c);
    int64_t nb = 0;
    for (int64_t i = 0; i < c; ++i) {
      s.bucket[nb] = cand[i];
      nb += static_cast<int>(float_bits(cand[i]) >> kBucketShift) == b;
    }
    std::sort(s.bucket.begin(), s.bucket.begin() + nb, std::greater<float>());
    for (int64_t i = 0; i < nb; ++i) {
      cum += by_mass ? static_cast<double>(s.bucket[i]) : 1.0;
      if (cum >= goal) return s.bucket[i];
    }
    return s.bucket[nb - 1];
  }
  return lo;
}

int64_t sample_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p,
                   float min_p, double u, RowScratch& s) {
  const float m = row_max(x, n);
  if (std::isnan(m) || m == -std::numeric_limits<float>::infinity()) return 0;
  if (m == std::numeric_limits<float>::infinity()) return std::find(x, x + n, m) - x;
  s.e.resize(n);
  s.sums.resize((n + kBlock - 1) / kBlock);
  float* e = s.e.data();
  exp_scaled(x, e, n, m, 1.f / temperature);
  // The kept set is {e >= t}; the largest token (e == 1) always passes.
  float t = std::numeric_limits<float>::min();  // smallest normal: e > 0
  if (min_p > 0.f) t = std::max(t, std::min(min_p, 1.f));
  if (top_k > 0 && top_k < n)
    t = std::max(t, select_descending(e, n, t, false, static_cast<double>(top_k), s));
  if (top_p < 1.f) {
    const double mass = block_sums(e, n, t, s.sums.data());
    const float floor = static_cast<float>(0.999 * (1.0 - top_p) * mass / n);
    t = std::max(t, select_descending(e, n, std::max(t, floor), true, top_p * mass, s));
  }
  const double total = block_sums(e, n, t, s.sums.data());
  const double target = u * total;
  double acc = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    if (acc + s.sums[b] <= target) {
      acc += s.sums[b];
      continue;
    }
    const int64_t end = std::min(n, start + kBlock);
    int64_t last = start;
    for (int64_t i = start; i < end; ++i) {
      if (e[i] < t) continue;
      last = i;
      acc += e[i];
      if (acc > target) return i;
    }
    return last;  // the block's fp32 sum ran past its fp64 walk (rounding)
  }
  // u * total rounded up to total: the last kept token.
  for (int64_t i = n - 1; i > 0; --i)
    if (e[i] >= t) return i;
  return 0;
}

}  // namespace

at::Tensor sample_from_logits(const at::Tensor& logits, const at::Tensor& rows,
                              const at::Tensor& temperature, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& min_p,
                              const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1, "sample_from_logits: logits [rows, vocab] fp32");
  const int64_t n = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && top_k.scalar_type() == at::kLong &&
                  temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && uniforms.scalar_type() == at::kDouble,
              "sample_from_logits: dtypes");
  TORCH_CHECK(temperature.numel() == n && top_k.numel() == n && top_p.numel() == n &&
                  min_p.numel() == n && uniforms.numel() == n, "sample_from_logits: shapes");
  const at::Tensor r = rows.contiguous(), tk = top_k.contiguous(), tp = top_p.contiguous(),
                   mp = min_p.contiguous(), te = temperature.contiguous(),
                   un = uniforms.contiguous();
  const int64_t* r_ptr = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r_ptr[i] >= 0 && r_ptr[i] < logits.size(0), "sample_from_logits: row out of range");
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const float* x = logits.data_ptr<float>();
  const int64_t vocab = logits.size(1), ld = logits.stride(0);
  const int64_t* k_ptr = tk.data_ptr<int64_t>();
  const float *p_ptr = tp.data_ptr<float>(), *mp_ptr = mp.data_ptr<float>(),
              *t_ptr = te.data_ptr<float>();
  const double* u_ptr = un.data_ptr<double>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    for (int64_t i = begin; i < end; ++i)
      o[i] = sample_row(x + r_ptr[i] * ld, vocab, t_ptr[i], k_ptr[i], p_ptr[i], mp_ptr[i],
                        u_ptr[i], scratch);
  });
  return out;
}

}  // namespace aioengine
