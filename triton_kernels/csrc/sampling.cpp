// One-pass-per-step categorical sampling over the whole vocabulary (sampling.h).
//
// Per row: the max, then one exp pass: e[i] = exp((x[i] - max) / T) into a row buffer (the
// unnormalised probabilities; the largest is 1), the kept e summed per 256-token block, and
// the candidates for top-k / top-p compacted. Each filter lowers to a threshold on e: min-p
// is e >= min_p, top-k the k-th largest e, top-p the e at which the descending running
// mass reaches top_p of the mass left. The k-th largest and the top-p cut are found by a
// sample select over the candidates (select_descending: a few vectorised counting passes
// over fewer candidates each time, a sort of the last few dozen), in fp64 masses: no sort
// of the vocabulary. For top-p, tokens below (1 - top_p) * mass / vocab cannot be in the
// nucleus (all such tokens together hold less than 1 - top_p of it) and are not
// candidates; the mass of the blocks already seen bounds it during the exp pass. The draw
// finds the block where u * total falls and walks that block only. Sums are in fp64
// between blocks. Rows are independent: threads take them one at a time.

#include "sampling.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "simd.h"

namespace aioengine {
namespace {

constexpr int64_t kBlock = 256;
// Candidates for a top-k select without top-p: the e >= this, unless fewer than k.
constexpr float kTopKBound = 1.f / 1048576;

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

// The sum of e[i] >= t, i < n <= kBlock, in block_sums' order.
float block_sum(const float* e, int64_t n, float t) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += e[i + j] >= t ? e[i + j] : 0.f;
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += e[i] >= t ? e[i] : 0.f;
  return s;
}

// sums[b] = the sum of e[i] >= t over block b (kBlock tokens); returns their fp64 total.
double block_sums(const float* e, int64_t n, float t, float* sums) {
  double total = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    sums[b] = block_sum(e + start, std::min(kBlock, n - start), t);
    total += sums[b];
  }
  return total;
}

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

struct RowScratch {
  std::vector<float> e, sums, candidates, work;
};

// Below this, exp is under the smallest normal float (ln FLT_MIN = -87.33654475...), so
// no filter keeps the token: its e is set to 0 and exp sees 0 instead (the vector exp
// takes a slow scalar path for arguments with subnormal results: low temperatures, -inf).
constexpr float kMinExpArg = -87.3365479f;

#if defined(__AVX512F__)
// exp(x) in 16 fp32 lanes for kMinExpArg <= x <= 0 (within 2 ulp of the true value; 94% of
// results correctly rounded, against about half for libmvec's _ZGVeN16v_expf): x = n ln2 +
// r with |r| <= ln2 / 2 (Cody and Waite 1980, "Software Manual for the Elementary
// Functions", ch. 6: ln2 in two parts), exp(r) by its degree-7 Taylor polynomial, times
// 2^n by scalef. Inline: the exp pass keeps its constants and candidates in registers.
inline __m512 exp_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// The exp pass, fused: e[i] = exp((x[i] - m) * inv_t) (exp_scaled's values), sums[b] =
// block_sums(e, n, t, sums)'s block sums (same lanes, same order, so the same floats),
// and, when cand is not null, cand[0..*num_cand) = the e[i] >= the bound of i's block
// (room for n + 16): max(bound, floor_per_mass * the fp64 mass of the blocks before).
// *bound_max = the largest bound used. Returns block_sums' fp64 total. prefetch (or null):
// the row this thread takes next, brought towards the core while exp computes (its max
// pass would otherwise wait on memory).
double exp_block_sums(const float* x, float* e, int64_t n, float m, float inv_t, float t,
                      float* sums, float bound, double floor_per_mass, float* cand,
                      int64_t* num_cand, float* bound_max, const float* prefetch) {
  double total = 0.0;
  int64_t c = 0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    const int64_t end = std::min(n, start + kBlock);
    const float lo = std::max(bound, static_cast<float>(floor_per_mass * total));
    int64_t i = start;
    float s = 0.f;
#if defined(__AVX512F__)
    const __m512 vm = _mm512_set1_ps(m), vinv = _mm512_set1_ps(inv_t), vt = _mm512_set1_ps(t),
                 vlo = _mm512_set1_ps(lo), vmin = _mm512_set1_ps(kMinExpArg);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= end; i += 16) {
      if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i), _MM_HINT_T1);
      const __m512 arg = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vinv);
      const __mmask16 normal = _mm512_cmp_ps_mask(arg, vmin, _CMP_GE_OQ);
      const __m512 v = _mm512_maskz_mov_ps(normal, exp_ps(_mm512_maskz_mov_ps(normal, arg)));
      _mm512_storeu_ps(e + i, v);
      acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), acc, v);
      if (cand != nullptr) {
        const __mmask16 keep = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ);
        _mm512_storeu_ps(cand + c, _mm512_maskz_compress_ps(keep, v));
        c += __builtin_popcount(keep);
      }
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc);
    for (int j = 0; j < 16; ++j) s += lanes[j];
#else
    (void)prefetch;
    exp_scaled(x + start, e + start, end - start, m, inv_t);
    s = block_sum(e + start, end - start, t);
    if (cand != nullptr) c += compact_at_least(e + start, end - start, lo, cand + c);
    i = end;
#endif
    for (; i < end; ++i) {
      e[i] = std::exp((x[i] - m) * inv_t);
      s += e[i] >= t ? e[i] : 0.f;
      if (cand != nullptr) {
        cand[c] = e[i];
        c += e[i] >= lo;
      }
    }
    sums[b] = s;
    total += s;
    *bound_max = lo;
  }
  *num_cand = c;
  return total;
}

// Thresholds per level of select_descending, the sample they are picked from, and the
// size below which a level sorts.
constexpr int kThresholds = 5;
constexpr int kSpread = 3;
constexpr int kSample = 32;
constexpr int64_t kSortBelow = 96;
// Sample ranks of the thresholds around the estimated crossing.
constexpr int kThresholdOffsets[kThresholds] = {-4, -2, 0, 2, 4};

// ge[j] = the count (by_mass false) or fp64 mass (true) of the v[i] >= th[j], j < NT.
template <int NT>
void count_at_least(const float* v, int64_t c, const float* th, bool by_mass, double* ge) {
#if defined(__AVX512F__)
  __m512 vth[NT];
  for (int j = 0; j < NT; ++j) vth[j] = _mm512_set1_ps(th[j]);
  if (by_mass) {
    __m512d lo[NT], hi[NT];
    for (int j = 0; j < NT; ++j) lo[j] = hi[j] = _mm512_setzero_pd();
    for (int64_t i = 0; i < c; i += 16) {
      const __mmask16 in = c - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (c - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(in, v + i);
      const __m512d x_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      const __m512d x_hi =
          _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
      for (int j = 0; j < NT; ++j) {
        const __mmask16 ge_j = _mm512_mask_cmp_ps_mask(in, x, vth[j], _CMP_GE_OQ);
        lo[j] = _mm512_mask_add_pd(lo[j], static_cast<__mmask8>(ge_j), lo[j], x_lo);
        hi[j] = _mm512_mask_add_pd(hi[j], static_cast<__mmask8>(ge_j >> 8), hi[j], x_hi);
      }
    }
    for (int j = 0; j < NT; ++j) ge[j] = _mm512_reduce_add_pd(_mm512_add_pd(lo[j], hi[j]));
  } else {
    __m512i counts[NT];
    const __m512i one = _mm512_set1_epi32(1);
    for (int j = 0; j < NT; ++j) counts[j] = _mm512_setzero_si512();
    for (int64_t i = 0; i < c; i += 16) {
      const __mmask16 in = c - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (c - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(in, v + i);
      for (int j = 0; j < NT; ++j)
        counts[j] = _mm512_mask_add_epi32(counts[j],
                                          _mm512_mask_cmp_ps_mask(in, x, vth[j], _CMP_GE_OQ),
                                          counts[j], one);
    }
    for (int j = 0; j < NT; ++j)
      ge[j] = static_cast<double>(_mm512_reduce_add_epi32(counts[j]));
  }
#else
  for (int j = 0; j < NT; ++j) ge[j] = 0.0;
  for (int64_t i = 0; i < c; ++i)
    for (int j = 0; j < NT; ++j)
      if (v[i] >= th[j]) ge[j] += by_mass ? static_cast<double>(v[i]) : 1.0;
#endif
}

// out[0..) = the v[i] with lo <= v[i] < hi, in order; returns their count. out may be v;
// otherwise it has room for c + 16.
int64_t compact_between(const float* v, int64_t c, float lo, float hi, float* out) {
  int64_t k = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
  for (; i + 16 <= c; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(x, vlo, _CMP_GE_OQ), x,
                                                    vhi, _CMP_LT_OQ);
    // A full-width store (compress-store to memory is slow): in place it covers only
    // out[k, k + 16) with k <= i, values already loaded.
    _mm512_storeu_ps(out + k, _mm512_maskz_compress_ps(keep, x));
    k += __builtin_popcount(keep);
  }
#endif
  for (; i < c; ++i) {
    const float x = v[i];
    out[k] = x;
    k += x >= lo && x < hi;
  }
  return k;
}

// The walk of a sorted level: the value at which offset + the descending running count or
// mass reaches goal, else the smallest.
float walk_sorted(float* v, int64_t c, bool by_mass, double offset, double goal) {
  std::sort(v, v + c, std::greater<float>());
  for (int64_t i = 0; i < c; ++i) {
    offset += by_mass ? static_cast<double>(v[i]) : 1.0;
    if (offset >= goal) return v[i];
  }
  return v[c - 1];
}

// Among the src[i] >= lo, i < c: the value v at which the descending running count
// (by_mass false) or mass (by_mass true) first reaches goal; when it never does (rounding),
// the smallest such value, or fallback if there is none. A sample select (Floyd and Rivest
// 1975, "Expected time bounds for selection", CACM 18(3)): each level sorts a strided
// sample of kSample candidates, estimates from it the sample rank where the running total
// crosses goal, takes kThresholds sample values around that rank, counts (or sums in fp64)
// the candidates at or above each in one vectorised pass, and keeps only the candidates
// between the two thresholds where the running total crosses goal (the total above them
// carried over). A level of at most kSortBelow candidates is sorted and walked. src is
// read only; work gets room for c + 16.
float select_descending(const float* src, int64_t c, float lo, bool by_mass, double goal,
                        float fallback, std::vector<float>& work) {
  work.resize(c + 16);
  float* w = work.data();
  const float* v = src;
  double offset = 0.0;
  for (;;) {
    if (c <= kSortBelow) {
      c = compact_between(v, c, lo, std::numeric_limits<float>::infinity(), w);
      return c == 0 ? fallback : walk_sorted(w, c, by_mass, offset, goal);
    }
    float sample[kSample];
    for (int i = 0; i < kSample; ++i) sample[i] = v[i * c / kSample];
    std::sort(sample, sample + kSample, std::greater<float>());
    // The sample rank where the estimated running total (each sample standing for
    // c / kSample candidates) reaches goal.
    const double per_sample = static_cast<double>(c) / kSample;
    int est = 0;
    for (double cum = offset; est < kSample; ++est) {
      cum += per_sample * (by_mass ? static_cast<double>(sample[est]) : 1.0);
      if (cum >= goal) break;
    }
    // A few large values hold much of a row's mass and a strided sample misses them: the
    // first level of a mass select puts kSpread thresholds at the sample's quantiles.
    const bool spread = by_mass && v == src;
    const int nt = spread ? kSpread : kThresholds;
    float th[kThresholds];
    for (int j = 0; j < nt; ++j)
      th[j] = std::max(lo, sample[spread ? (j + 1) * kSample / (kSpread + 1)
                                         : std::clamp(est + kThresholdOffsets[j], 0, kSample - 1)]);
    double ge[kThresholds];
    if (spread) count_at_least<kSpread>(v, c, th, by_mass, ge);
    else count_at_least<kThresholds>(v, c, th, by_mass, ge);
    int j = 0;
    while (j < nt && offset + ge[j] < goal) ++j;
    // Thresholds may repeat; the crossing lies in [th[j], the next larger threshold).
    float hi = std::numeric_limits<float>::infinity();
    double above = 0.0;
    if (j > 0) {
      hi = th[j - 1];  // > th[j]: equal thresholds have equal totals
      above = ge[j - 1];
    }
    const float new_lo = j < nt ? th[j] : lo;
    const int64_t kept = compact_between(v, c, new_lo, hi, w);
    offset += above;
    if (kept == 0) return fallback;
    if (kept == c) return walk_sorted(w, kept, by_mass, offset, goal);  // no progress (ties)
    v = w;
    c = kept;
    lo = new_lo;
  }
}

int64_t sample_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p,
                   float min_p, double u, const float* prefetch, RowScratch& s) {
  const float m = row_max(x, n);
  if (std::isnan(m) || m == -std::numeric_limits<float>::infinity()) return 0;
  if (m == std::numeric_limits<float>::infinity()) return std::find(x, x + n, m) - x;
  s.e.resize(n);
  s.sums.resize((n + kBlock - 1) / kBlock);
  float* e = s.e.data();
  // The kept set is {e >= t}; the largest token (e == 1) always passes.
  float t = std::numeric_limits<float>::min();  // smallest normal: e > 0
  if (min_p > 0.f) t = std::max(t, std::min(min_p, 1.f));
  const bool use_top_k = top_k > 0 && top_k < n, use_top_p = top_p < 1.f;
  // Candidates for the selects. No token below top_p's floor (below) is in the nucleus,
  // and the mass of the blocks already seen bounds the mass from below.
  const double floor_per_mass = use_top_p ? 0.999 * (1.0 - top_p) / n : 0.0;
  const float bound = use_top_p ? std::max(t, static_cast<float>(floor_per_mass))
                                : std::max(t, kTopKBound);
  int64_t c = 0;
  float* cand = nullptr;
  if (use_top_k || use_top_p) {
    s.candidates.resize(n + 16);
    cand = s.candidates.data();
  }
  const float t_sums = t;
  float bound_max = t;
  double total = exp_block_sums(x, e, n, m, 1.f / temperature, t, s.sums.data(), bound,
                                floor_per_mass, cand, &c, &bound_max, prefetch);
  if (cand == nullptr) bound_max = t;
  if (use_top_k) {
    const double k = static_cast<double>(top_k);
    float kth = select_descending(cand, c, t, false, k, t, s.work);
    if (kth < bound_max) {  // the k-th largest is below some block's bound: every e >= t
      c = compact_at_least(e, n, t, cand);
      bound_max = t;
      kth = select_descending(cand, c, t, false, k, t, s.work);
    }
    t = std::max(t, kth);
  }
  if (use_top_p) {
    const double mass = t == t_sums ? total : block_sums(e, n, t, s.sums.data());
    const float lo = std::max(t, static_cast<float>(0.999 * (1.0 - top_p) * mass / n));
    if (lo < bound_max) c = compact_at_least(e, n, lo, cand);  // top-k left less than 1
    t = std::max(t, select_descending(cand, c, lo, true, top_p * mass, lo, s.work));
  }
  if (t != t_sums) total = block_sums(e, n, t, s.sums.data());
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
  // Rows differ in cost (a wide nucleus takes more levels): threads take the next row.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    RowScratch scratch;
    // A thread claims its next row before it samples this one, to prefetch it.
    for (int64_t i = next++, following = next++; i < n; i = following, following = next++)
      o[i] = sample_row(x + r_ptr[i] * ld, vocab, t_ptr[i], k_ptr[i], p_ptr[i], mp_ptr[i],
                        u_ptr[i], following < n ? x + r_ptr[following] * ld : nullptr, scratch);
  });
  return out;
}

}  // namespace aioengine
