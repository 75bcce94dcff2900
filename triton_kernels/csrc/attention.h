// Paged decode attention (PagedAttention, Kwon et al. 2023, section 4.1): one new query
// token per sequence attends to its paged K/V, read in place through the block table, no
// gather copy. A task (a sequence's KV head, or all of them at larger batches) reads each
// K and V row once for the whole query-head group (GQA, Ainslie et al. 2023). Scores,
// softmax and the weighted sum in fp32. Two kernels: a blocked AVX-512 one (attn512::run)
// and the portable one every other CPU and shape runs. Used by the tensor entry point
// (attention.cpp) and the fused decoder layers.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "quant_amx.h"
#include "quant_ops.h"
#include "simd.h"

namespace aioengine {


// One layer's decode attention, on raw pointers so both the tensor entry point and
// the fused decoder below can call it. Strides are in elements; head_dim's is 1. The
// cache's element type may be narrower than the query's (an fp16, bf16 or fp8 KV cache
// under fp32 activations, --kv-cache-dtype; fp8.h); scores and sums are fp32 either way.
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
  // Sliding window (Mistral, Gemma local layers): the query at position len - 1 sees
  // the last `window` keys, positions len - window .. len - 1 (HF's mask); 0: all.
  int64_t window = 0;
  // Gemma 2's attention-logit soft-capping, softcap * tanh(score / softcap) on the
  // scaled scores (Gemma Team 2024, section 2); 0: none.
  float softcap = 0.f;
  // The query/out row of sequence s: rows[s] (a mixed step's decode rows sit among its
  // prompt tokens); nullptr: row s.
  const int32_t* rows = nullptr;
  int64_t row(int64_t s) const { return rows != nullptr ? rows[s] : s; }
};

// Asks for the `rows` rows of `bytes` bytes each, `stride` elements apart, from p on.
template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t stride, int64_t bytes) {
#if defined(__GNUC__)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + r * stride) + off, 0, 3);
#endif
}

// The split of (sequence, KV head) tasks over threads by work, not by count: task i
// costs its keys plus a fixed part, and part p of `parts` runs the tasks whose cost
// prefix starts in [p * total / parts, (p + 1) * total / parts). Ragged lengths (one
// 2,000-token sequence among 100-token ones) then keep every thread busy.
struct TaskSplit {
  std::vector<int64_t> prefix;  // prefix[i]: cost of tasks 0 .. i - 1
  int64_t parts = 1;
  // Tasks of `heads` KV heads of one sequence each (heads divides num_kv_heads).
  template <typename scalar_t, typename cache_t>
  TaskSplit(const DecodeAttention<scalar_t, cache_t>& a, int64_t heads = 1)
      : prefix(a.num_seqs * (a.num_kv_heads / heads) + 1, 0) {
    const int64_t per_seq = a.num_kv_heads / heads, tasks = a.num_seqs * per_seq;
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t len = a.seq_lens[i / per_seq];
      const int64_t n = a.window > 0 && len > a.window ? a.window : len;
      prefix[i + 1] = prefix[i] + heads * (n + 16);
    }
    parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  }
  // The first task of part p (p == parts: one past the last task).
  int64_t begin(int64_t p) const {
    const int64_t total = prefix.back();
    return std::partition_point(prefix.begin(), prefix.end() - 1,
                                [&](int64_t c) { return c * parts < p * total; }) - prefix.begin();
  }
};

// The portable kernel: any head_dim, any dtypes; the AVX-512 builds' fallback for what
// the blocked kernel below does not take.
template <typename scalar_t, typename cache_t>
void decode_attention_portable(const DecodeAttention<scalar_t, cache_t>& a) {
  const int64_t group = a.num_heads / a.num_kv_heads, head_dim = a.head_dim;
  const TaskSplit split(a);
  at::parallel_for(0, split.parts, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = split.begin(pb); task < split.begin(pe); ++task) {
      const int64_t s = task / a.num_kv_heads, h = task % a.num_kv_heads;
      const int64_t len = a.seq_lens[s];
      // Keys first .. len - 1: blocks wholly before a window are never read.
      const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;
      const int64_t n = len - first;
      const int32_t* blocks = a.block_tables + s * a.max_blocks;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = a.q + a.row(s) * a.qs + (h * group + g) * a.qh;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * a.scale;
      }
      // Pass 1: scores of every query head of the group against each key, read once.
      // The cache streams from memory (a step reads every sequence's K and V once) and a
      // head's rows are short strided runs the hardware prefetchers miss: each block asks
      // for the next block's K rows and its own V rows (pass 2's) ahead of use.
      const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
      for (int64_t start = first; start < len;) {
        const int64_t block = start / a.block_size;
        const cache_t* kblock = a.k + blocks[block] * a.kb + h * a.kh;
        const int64_t stop = std::min(len, (block + 1) * a.block_size);
        if (stop < len)
          prefetch_rows(a.k + blocks[block + 1] * a.kb + h * a.kh,
                        std::min(a.block_size, len - stop), a.kt, row_bytes);
        prefetch_rows(a.v + blocks[block] * a.vb + h * a.vh + (start - block * a.block_size) * a.vt,
                      stop - start, a.vt, row_bytes);
        for (int64_t t = start; t < stop; ++t) {
          const cache_t* k = kblock + (t - block * a.block_size) * a.kt;
          for (int64_t g = 0; g < group; ++g) scores[g * n + t - first] = dot(&q[g * head_dim], k, head_dim);
        }
        start = stop;
      }
      if (a.softcap > 0.f)
        for (float& x : scores) x = std::tanh(x / a.softcap) * a.softcap;  // HF's order
      // Softmax per query head (max-subtracted, fp32).
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * n];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = row[t] > m ? row[t] : m;
        exp_shifted(row, n, m);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) sum += row[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) row[t] *= inv;
      }
      // Pass 2: the weighted sum of values, each value row read once.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = first; start < len;) {
        const int64_t block = start / a.block_size;
        const cache_t* vblock = a.v + blocks[block] * a.vb + h * a.vh;
        const int64_t stop = std::min(len, (block + 1) * a.block_size);
        for (int64_t t = start; t < stop; ++t) {
          const cache_t* v = vblock + (t - block * a.block_size) * a.vt;
          for (int64_t g = 0; g < group; ++g) axpy(&acc[g * head_dim], scores[g * n + t - first], v, head_dim);
        }
        start = stop;
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = a.out + a.row(s) * a.os + (h * group + g) * a.oh;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}


#if defined(__AVX512F__)
// The blocked AVX-512 kernel (fp32 queries, head_dim a multiple of 16). The portable
// kernel spends most of its time on arithmetic, not on reading the cache: a horizontal
// sum for every score and a load/store of the accumulator for every value row. Here
// (attn512::run): 16 keys a chunk; each key row is loaded (fp16/bf16/fp8 widened) once for up
// to 3 query heads of the group and 16 scores come out of one transpose-add tree; one
// exp per head and chunk; the weighted sum in a register tile of heads x 64 dims; the
// running max checked with one compare; tasks split over threads by keys (TaskSplit).
// score_chunk/value_tiles (all keys' scores first, then the values) serve the prefill
// kernel below.
namespace attn512 {

// out[i] = the sum of v[i]'s 16 lanes, i < 16.
inline __m512 sum16x16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i .. 4i + 3]
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                  _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                  _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// out[j * ld + i] = q[j] . rows[i] for j < GT heads (q rows d apart), i < cnt <= 16 keys;
// lanes cnt .. 15 get 0.
template <int GT, typename cache_t>
inline void score_chunk(const float* q, int64_t d, const cache_t* const* rows, int64_t off,
                        int64_t cnt, float* out, int64_t ld) {
  __m512 part[GT][16];
  for (int64_t i = 0; i < 16; ++i) {
    __m512 acc[GT];
    for (int j = 0; j < GT; ++j) acc[j] = _mm512_setzero_ps();
    if (i < cnt) {
      const cache_t* k = rows[i] + off;
      for (int64_t c = 0; c < d; c += 16) {
        const __m512 kv = load16(k + c);
        for (int j = 0; j < GT; ++j)
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c), kv, acc[j]);
      }
    }
    for (int j = 0; j < GT; ++j) part[j][i] = acc[j];
  }
  for (int j = 0; j < GT; ++j) _mm512_storeu_ps(out + j * ld, sum16x16(part[j]));
}

// acc[j * d + c0 + e] = sum over keys t < n of p[j * ld + t] * rows[t][off + c0 + e], for
// j < GT heads and e < 16 * NV dims from c0 (off: the KV head's offset in a row).
template <int GT, int NV, typename cache_t>
inline void value_tile(const float* p, int64_t ld, const cache_t* const* rows, int64_t off,
                       int64_t n, int64_t c0, float* acc, int64_t d) {
  __m512 sum[GT][NV];
  for (int j = 0; j < GT; ++j)
    for (int c = 0; c < NV; ++c) sum[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const cache_t* v = rows[t] + off + c0;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
    for (int j = 0; j < GT; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * ld + t]);
      for (int c = 0; c < NV; ++c) sum[j][c] = _mm512_fmadd_ps(w, vv[c], sum[j][c]);
    }
  }
  for (int j = 0; j < GT; ++j)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + j * d + c0 + 16 * c, sum[j][c]);
}

// value_tile over all of head_dim: 64 dims at a time, then the rest (16-48).
template <int GT, typename cache_t>
inline void value_tiles(const float* p, int64_t ld, const cache_t* const* rows, int64_t off,
                        int64_t n, float* acc, int64_t d) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) value_tile<GT, 4>(p, ld, rows, off, n, c0, acc, d);
  switch ((d - c0) / 16) {
    case 3: value_tile<GT, 3>(p, ld, rows, off, n, c0, acc, d); break;
    case 2: value_tile<GT, 2>(p, ld, rows, off, n, c0, acc, d); break;
    case 1: value_tile<GT, 1>(p, ld, rows, off, n, c0, acc, d); break;
    default: break;
  }
}

// Scores of GT query heads (q rows d apart) against 16 keys: lane i of s[j] is
// q_j . rows[i][off ..], i < cnt; lanes cnt .. 15 get 0. Keys go four at a time: each
// 16-value slice of their rows is loaded (and widened) once for the GT heads, the 4 x GT
// partial-product vectors stay in registers, and sum16x16's transpose-add tree folds them
// as they arrive (a quad to one vector, two quads to one), so no partial sum spills and
// no score needs a horizontal reduction of its own.
template <int GT, typename cache_t>
inline void score16(const float* q, int64_t d, const cache_t* const* rows, int64_t off,
                    int64_t cnt, __m512* s) {
  __m512 z[2][GT];
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m512 x[2][GT];
#pragma GCC unroll 2
    for (int qd = 0; qd < 2; ++qd) {
      const int64_t i0 = half * 8 + qd * 4;
      __m512 p[4][GT];
#pragma GCC unroll 4
      for (int kk = 0; kk < 4; ++kk)
#pragma GCC unroll 4
        for (int j = 0; j < GT; ++j) p[kk][j] = _mm512_setzero_ps();
      if (i0 + 4 <= cnt) {
        const cache_t *k0 = rows[i0] + off, *k1 = rows[i0 + 1] + off,
                      *k2 = rows[i0 + 2] + off, *k3 = rows[i0 + 3] + off;
        for (int64_t c = 0; c < d; c += 16) {
          const __m512 kv[4] = {load16(k0 + c), load16(k1 + c), load16(k2 + c), load16(k3 + c)};
#pragma GCC unroll 4
          for (int j = 0; j < GT; ++j) {
            const __m512 qv = _mm512_loadu_ps(q + j * d + c);
#pragma GCC unroll 4
            for (int kk = 0; kk < 4; ++kk) p[kk][j] = _mm512_fmadd_ps(qv, kv[kk], p[kk][j]);
          }
        }
      } else if (i0 < cnt) {  // the last, partial quad
#pragma GCC unroll 4
        for (int kk = 0; kk < 4; ++kk) {
          if (i0 + kk >= cnt) break;
          const cache_t* k = rows[i0 + kk] + off;
          for (int64_t c = 0; c < d; c += 16) {
            const __m512 kv = load16(k + c);
#pragma GCC unroll 4
            for (int j = 0; j < GT; ++j)
              p[kk][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c), kv, p[kk][j]);
          }
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < GT; ++j) {
        // Per 128-bit lane: keys (0, 1)'s and (2, 3)'s pair sums, then the quad's sums.
        const __m512 w0 = _mm512_add_ps(_mm512_unpacklo_ps(p[0][j], p[1][j]),
                                        _mm512_unpackhi_ps(p[0][j], p[1][j]));
        const __m512 w1 = _mm512_add_ps(_mm512_unpacklo_ps(p[2][j], p[3][j]),
                                        _mm512_unpackhi_ps(p[2][j], p[3][j]));
        const __m512d a = _mm512_castps_pd(w0), b = _mm512_castps_pd(w1);
        x[qd][j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      z[half][j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[0][j], x[1][j], 0x88),
                                 _mm512_shuffle_f32x4(x[0][j], x[1][j], 0xDD));
  }
#pragma GCC unroll 4
  for (int j = 0; j < GT; ++j)
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(z[0][j], z[1][j], 0x88),
                         _mm512_shuffle_f32x4(z[0][j], z[1][j], 0xDD));
}

// acc[j * d + e] = acc[j * d + e] * alpha[j] + sum over i < cnt of p[j * 16 + i] *
// rows[i][off + e], for GT heads and e < 16 * NV: the running weighted sum of the online
// softmax, a register tile of heads x dims over a chunk's keys.
template <int GT, int NV, typename cache_t>
inline void value16(const float* p, const cache_t* const* rows, int64_t off, int64_t cnt,
                    const float* alpha, float* acc, int64_t d) {
  __m512 sum[GT][NV];
  for (int j = 0; j < GT; ++j) {
    const __m512 aj = _mm512_set1_ps(alpha[j]);
    for (int c = 0; c < NV; ++c) sum[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * d + 16 * c), aj);
  }
  for (int64_t i = 0; i < cnt; ++i) {
    const cache_t* v = rows[i] + off;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
    for (int j = 0; j < GT; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * 16 + i]);
      for (int c = 0; c < NV; ++c) sum[j][c] = _mm512_fmadd_ps(w, vv[c], sum[j][c]);
    }
  }
  for (int j = 0; j < GT; ++j)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + j * d + 16 * c, sum[j][c]);
}

// value16 over all of head_dim: 64 dims at a time, then the rest (16-48).
template <int GT, typename cache_t>
inline void value16_tiles(const float* p, const cache_t* const* rows, int64_t off, int64_t cnt,
                          const float* alpha, float* acc, int64_t d) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) value16<GT, 4>(p, rows, off + c0, cnt, alpha, acc + c0, d);
  switch ((d - c0) / 16) {
    case 3: value16<GT, 3>(p, rows, off + c0, cnt, alpha, acc + c0, d); break;
    case 2: value16<GT, 2>(p, rows, off + c0, cnt, alpha, acc + c0, d); break;
    case 1: value16<GT, 1>(p, rows, off + c0, cnt, alpha, acc + c0, d); break;
    default: break;
  }
}

// The online-softmax step of GT heads over one chunk's scores s (lanes cnt .. 15 masked):
// soft-cap, the chunk's max against the running max m, p = exp(s - m) into p[j * 16 ..],
// the lane-wise running sums l[j] = l[j] * alpha + p, alpha[j] = exp(m_old - m_new) (1
// when the max did not grow, so the accumulator is rescaled only when it must be).
template <int GT>
inline void softmax16(__m512* s, __mmask16 valid, float softcap, float* m, __m512* l,
                      float* alpha, float* p) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < GT; ++j) {
    if (softcap > 0.f) {  // HF's order: tanh(score / cap) * cap, before the mask
      alignas(64) float t[16];
      _mm512_store_ps(t, s[j]);
      for (float& x : t) x = std::tanh(x / softcap) * softcap;
      s[j] = _mm512_load_ps(t);
    }
    s[j] = _mm512_mask_mov_ps(ninf, valid, s[j]);
    // The chunk's max only when some score passes the running max (one compare, most
    // chunks after the first few): then the sums and the accumulator are rescaled.
    if (_mm512_cmp_ps_mask(s[j], _mm512_set1_ps(m[j]), _CMP_GT_OQ) != 0) {
      const float cm = _mm512_reduce_max_ps(s[j]);
      alpha[j] = std::exp(m[j] - cm);  // 0 on the first chunk (m = -inf)
      m[j] = cm;
      l[j] = _mm512_mul_ps(l[j], _mm512_set1_ps(alpha[j]));
    } else {
      alpha[j] = 1.f;
      if (m[j] == -std::numeric_limits<float>::infinity()) {
        // No finite score yet (they overflowed fp32 to -inf): these keys weigh 0, where
        // exp(-inf - -inf) would be NaN in the sums.
        _mm512_storeu_ps(p + 16 * j, _mm512_setzero_ps());
        continue;
      }
    }
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(s[j], _mm512_set1_ps(m[j])));
    l[j] = _mm512_add_ps(l[j], e);
    _mm512_storeu_ps(p + 16 * j, e);
  }
}

// Asks for one row of `bytes` bytes from p into L2 (prefetcht2): the decode kernel's
// look-ahead. Into L2 rather than L1: the rows are needed a chunk or two later, and the
// L1 is the kernel's working set (queries, accumulators, scores).
template <typename T>
inline void prefetch_row_l2(const T* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T2);
}

// One pass over the keys, 16 at a time (the online softmax of flash attention, Dao et al.
// 2022, section 3.1, per chunk of keys rather than per key): a chunk's K rows give the
// scores of every query head of each KV head's group (score16, each row read once for the
// group), then the chunk's V rows update those heads' accumulators (value16), rescaled only
// when a head's max grew. The cache streams from memory once per step; each chunk asks for
// the K and V rows kAhead chunks on into L2, a KV head's slice at a time, spread over the
// arithmetic (one burst of a whole chunk's rows stalls on the core's fill buffers).
template <typename scalar_t, typename cache_t>
void run(const DecodeAttention<scalar_t, cache_t>& a) {
  constexpr int64_t kAhead = 2;  // chunks
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim;
  // A task takes every KV head of its sequence when there are sequences enough to keep
  // the threads busy: its K/V rows are then read whole (num_kv_heads * head_dim values,
  // one run in a contiguous cache), which the hardware prefetchers follow; else one KV
  // head (batch 1 still splits over threads).
  const int64_t ht = a.num_seqs >= 4 * at::get_num_threads() ? a.num_kv_heads : 1;
  const int64_t per_seq = a.num_kv_heads / ht, hg = ht * group;  // query heads a task
  const TaskSplit split(a, ht);
  at::parallel_for(0, split.parts, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> q(hg * d), acc(hg * d), m(hg), alpha(hg), p(hg * 16);
    std::vector<__m512> l(hg);
    std::vector<const cache_t*> krows, vrows;
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t task = split.begin(pb); task < split.begin(pe); ++task) {
      const int64_t s = task / per_seq, h0 = (task % per_seq) * ht;
      const int64_t len = a.seq_lens[s];
      const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;
      const int64_t n = len - first;
      const int32_t* blocks = a.block_tables + s * a.max_blocks;
      krows.resize(n);
      vrows.resize(n);
      // Rows of head h0 (head h0 + j is j * kh on), a block at a time.
      for (int64_t t = first; t < len;) {
        const int64_t block = t / a.block_size, stop = std::min(len, (block + 1) * a.block_size);
        const cache_t* kb = a.k + blocks[block] * a.kb + h0 * a.kh;
        const cache_t* vb = a.v + blocks[block] * a.vb + h0 * a.vh;
        for (int64_t r = t - block * a.block_size; t < stop; ++t, ++r) {
          krows[t - first] = kb + r * a.kt;
          vrows[t - first] = vb + r * a.vt;
        }
      }
      for (int64_t g = 0; g < hg; ++g) {
        const scalar_t* src = a.q + a.row(s) * a.qs + (h0 * group + g) * a.qh;
        for (int64_t e = 0; e < d; ++e) q[g * d + e] = static_cast<float>(src[e]) * a.scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), _mm512_setzero_ps());
      for (int64_t i = 0; i < std::min<int64_t>(n, 16 * kAhead); ++i) {
        for (int64_t j = 0; j < ht; ++j) {
          prefetch_row_l2(krows[i] + j * a.kh, row_bytes);
          prefetch_row_l2(vrows[i] + j * a.vh, row_bytes);
        }
      }
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - t0);
        const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1);
        const cache_t* const* kr = krows.data() + t0;
        const cache_t* const* vr = vrows.data() + t0;
        const int64_t ahead = t0 + 16 * kAhead, ahead_end = std::min<int64_t>(n, ahead + 16);
        for (int64_t j = 0; j < ht; ++j) {
          for (int64_t i = ahead; i < ahead_end; ++i) {
            prefetch_row_l2(krows[i] + j * a.kh, row_bytes);
            prefetch_row_l2(vrows[i] + j * a.vh, row_bytes);
          }
          for (int64_t g = 0; g < group; g += 3) {
            const int64_t h = j * group + g;  // the task's query head
            const float* qg = &q[h * d];
            __m512 sc[3];
            switch (std::min<int64_t>(3, group - g)) {
              case 3:
                score16<3>(qg, d, kr, j * a.kh, cnt, sc);
                softmax16<3>(sc, valid, a.softcap, &m[h], &l[h], &alpha[h], &p[h * 16]);
                value16_tiles<3>(&p[h * 16], vr, j * a.vh, cnt, &alpha[h], &acc[h * d], d);
                break;
              case 2:
                score16<2>(qg, d, kr, j * a.kh, cnt, sc);
                softmax16<2>(sc, valid, a.softcap, &m[h], &l[h], &alpha[h], &p[h * 16]);
                value16_tiles<2>(&p[h * 16], vr, j * a.vh, cnt, &alpha[h], &acc[h * d], d);
                break;
              default:
                score16<1>(qg, d, kr, j * a.kh, cnt, sc);
                softmax16<1>(sc, valid, a.softcap, &m[h], &l[h], &alpha[h], &p[h * 16]);
                value16_tiles<1>(&p[h * 16], vr, j * a.vh, cnt, &alpha[h], &acc[h * d], d);
                break;
            }
          }
        }
      }
      for (int64_t g = 0; g < hg; ++g) {
        const float sum = _mm512_reduce_add_ps(l[g]);
        const float inv = n > 0 ? 1.f / sum : 0.f;
        scalar_t* dst = a.out + a.row(s) * a.os + (h0 * group + g) * a.oh;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<scalar_t>(acc[g * d + e] * inv);
      }
    }
  });
}

}  // namespace attn512
#endif

// Whether the blocked kernel takes this call: an AVX-512 build, fp32 queries, head_dim
// a multiple of 16. The portable kernel runs the rest (and every call on other CPUs).
template <typename scalar_t, typename cache_t>
inline bool decode_attention_blocked(const DecodeAttention<scalar_t, cache_t>& a) {
#if defined(__AVX512F__)
  return std::is_same<scalar_t, float>::value && a.head_dim % 16 == 0;
#else
  (void)a;
  return false;
#endif
}

// One layer's decode attention: the blocked kernel where it applies, else the portable
// one; portable = true forces the latter (tests compare both on one CPU).
template <typename scalar_t, typename cache_t>
void decode_attention_run(const DecodeAttention<scalar_t, cache_t>& a, bool portable = false) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<scalar_t, float>::value && !std::is_same<cache_t, double>::value) {
    if (!portable && decode_attention_blocked(a)) {
      attn512::run(a);
      return;
    }
  }
#endif
  decode_attention_portable(a);
  (void)portable;
}


// Paged attention for query chunks of several tokens per sequence (chunked prefill, a
// whole prompt, or 1-token rows): the chunk of sequence s holds its last
// q_len = query_start[s + 1] - query_start[s] positions, seq_len - q_len .. seq_len - 1,
// already written to the cache; the query at position p sees keys 0 .. p (causal within
// the chunk, the cached prefix whole), or p - window + 1 .. p with a sliding window.
// Read in place through the block table, as the decode kernel. Softmax and sums in fp32;
// the products in fp32 (AVX-512 tiles, portable loops) or on AMX-BF16 tiles where the CPU
// has them and the AMX switch is on (prefill_amx: bf16 operands, or fp32-grade hi + lo);
// the query's dtype is fp32, the cache's fp32, fp16, bf16 or fp8 (E4M3/E5M2, fp8.h).
template <typename cache_t>
struct PrefillAttention {
  const float* q;
  int64_t qs, qh;  // query [num_tokens, num_heads, head_dim]
  const cache_t* k;
  int64_t kb, kt, kh;  // key cache [num_blocks, block_size, num_kv_heads, head_dim]
  const cache_t* v;
  int64_t vb, vt, vh;
  float* out;
  int64_t os, oh;  // out [num_tokens, num_heads, head_dim]
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int64_t max_blocks;
  const int32_t* seq_lens;     // [num_seqs], the chunk included
  const int32_t* query_start;  // [num_seqs + 1]: sequence s's rows are query_start[s] ..
  const int32_t* seqs;         // the sequences to run, [num_run] indices into the above
  int64_t num_run, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int64_t window = 0;  // keys a query sees, its own included (HF's mask); 0: all
  float softcap = 0.f;  // Gemma 2's softcap * tanh(score / softcap), before the mask; 0: none
};

namespace prefill_attn {

// Query tokens a task takes (times the group's heads: its rows) and keys a span: a span's
// scores [rows, kSpan] stay in L2 (128 KiB at 8 heads a group).
constexpr int64_t kTileTokens = 16, kSpan = 256;

// The max and the sum of x[lo .. hi - 1] (hi > lo), 16 lanes at a time where the CPU has
// AVX-512.
inline float span_max(const float* x, int64_t lo, int64_t hi) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = lo;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; t + 16 <= hi; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + t));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; t < hi; ++t) m = x[t] > m ? x[t] : m;
  return m;
}

inline float span_sum(const float* x, int64_t lo, int64_t hi) {
  float s = 0.f;
  int64_t t = lo;
#if defined(__AVX512F__)
  __m512 vs = _mm512_setzero_ps();
  for (; t + 16 <= hi; t += 16) vs = _mm512_add_ps(vs, _mm512_loadu_ps(x + t));
  s = _mm512_reduce_add_ps(vs);
#endif
  for (; t < hi; ++t) s += x[t];
  return s;
}

// Soft-cap, mask and the online softmax's update (m_i, l_i, the accumulator's rescale
// alpha) for `rows` rows of a span's scores, keys t0 .. t0 + n - 1, in place: row r is
// the query at position pos0 + r / group, which sees keys lo(r) .. pos0 + r / group
// (lo(r) = 0, or pos - window + 1 with a sliding window); afterwards row r holds
// exp(score - m_new) for the keys it sees and 0 elsewhere (lanes n .. ld - 1 untouched).
inline void softmax_span(float* scores, int64_t ld, int64_t rows, int64_t n, int64_t t0,
                         int64_t pos0, int64_t group, int64_t window, float softcap, float* m,
                         float* l, float* alpha) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * ld;
    const int64_t pos = pos0 + r / group;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0};
    if (softcap > 0.f)
      for (int64_t t = 0; t < n; ++t) row[t] = std::tanh(row[t] / softcap) * softcap;
    const int64_t allow_lo = std::max<int64_t>(lo - t0, 0);
    const int64_t allow_hi = std::min<int64_t>(pos + 1 - t0, n);  // exclusive
    if (allow_lo >= allow_hi) {  // nothing of this span is seen by row r
      std::fill(row, row + n, 0.f);
      alpha[r] = 1.f;
      continue;
    }
    const float m_new = std::max(m[r], span_max(row, allow_lo, allow_hi));
    if (m_new == -std::numeric_limits<float>::infinity()) {
      std::fill(row, row + n, 0.f);
      alpha[r] = 1.f;
      continue;
    }
    // Masked keys weigh 0; only the keys row r sees are exponentiated.
    std::fill(row, row + allow_lo, 0.f);
    std::fill(row + allow_hi, row + n, 0.f);
    exp_shifted(row + allow_lo, allow_hi - allow_lo, m_new);
    const float sum = span_sum(row, allow_lo, allow_hi);
    alpha[r] = std::exp(m[r] - m_new);  // 0 on the first span a row sees
    l[r] = l[r] * alpha[r] + sum;
    m[r] = m_new;
  }
}

// A task: one KV head of one sequence and a tile of its chunk's tokens.
struct Task {
  int64_t seq, head, first, count;  // chunk rows first .. first + count - 1
};

// One task, flash-attention style over spans of kSpan keys (Dao et al. 2022, section 3.1:
// the softmax's running max m_i and sum l_i per row; the accumulator rescaled by
// exp(m_old - m_new) when a span raises the max). Within a span, scores of every row are
// computed first (each key row read once for all rows of the tile), then the span's
// values. BLOCKED: AVX-512 tiles (head_dim a multiple of 16), else portable loops.
template <bool BLOCKED, typename cache_t>
void run_task(const PrefillAttention<cache_t>& a, const Task& task, std::vector<float>& q,
              std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& part,
              std::vector<const cache_t*>& krows, std::vector<const cache_t*>& vrows) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim;
  const int64_t rows = task.count * group;
  const int64_t s = a.seqs[task.seq], h = task.head;
  const int64_t q0 = a.query_start[s], q_len = a.query_start[s + 1] - q0;
  const int64_t len = a.seq_lens[s], prefix = len - q_len;
  const int32_t* blocks = a.block_tables + s * a.max_blocks;
  // Row r is token task.first + r / group at position prefix + task.first + r / group, head
  // h * group + r % group; it sees keys lo(r) .. pos(r).
  auto pos = [&](int64_t r) { return prefix + task.first + r / group; };
  auto lo = [&](int64_t r) {
    return a.window > 0 ? std::max<int64_t>(0, pos(r) - a.window + 1) : int64_t{0};
  };
  const int64_t key_begin = lo(0), key_end = pos(rows - 1) + 1;
  q.resize(rows * d);
  acc.assign(rows * d, 0.f);
  part.resize(rows * d);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.f),
      alpha(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + (q0 + task.first + r / group) * a.qs + (h * group + r % group) * a.qh;
    for (int64_t e = 0; e < d; ++e) q[r * d + e] = src[e] * a.scale;
  }
  for (int64_t t0 = key_begin; t0 < key_end; t0 += kSpan) {
    const int64_t n = std::min(kSpan, key_end - t0), ld = (n + 15) / 16 * 16;
    krows.resize(n);
    vrows.resize(n);
    for (int64_t t = t0; t < t0 + n; ++t) {
      const int64_t b = blocks[t / a.block_size], i = t % a.block_size;
      krows[t - t0] = a.k + b * a.kb + i * a.kt + h * a.kh;
      vrows[t - t0] = a.v + b * a.vb + i * a.vt + h * a.vh;
    }
    scores.resize(rows * ld);
    // Scores [rows, n].
#if defined(__AVX512F__)
    if constexpr (BLOCKED) {
      for (int64_t c = 0; c < n; c += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - c);
        for (int64_t r = 0; r < rows; r += 4) {
          float* out = scores.data() + r * ld + c;
          const float* qr = &q[r * d];
          switch (std::min<int64_t>(4, rows - r)) {
            case 4: attn512::score_chunk<4>(qr, d, krows.data() + c, 0, cnt, out, ld); break;
            case 3: attn512::score_chunk<3>(qr, d, krows.data() + c, 0, cnt, out, ld); break;
            case 2: attn512::score_chunk<2>(qr, d, krows.data() + c, 0, cnt, out, ld); break;
            default: attn512::score_chunk<1>(qr, d, krows.data() + c, 0, cnt, out, ld); break;
          }
        }
      }
    } else
#endif
    {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < rows; ++r) scores[r * ld + t] = dot(&q[r * d], krows[t], d);
    }
    softmax_span(scores.data(), ld, rows, n, t0, prefix + task.first, group, a.window,
                 a.softcap, m.data(), l.data(), alpha.data());
    // part = P V over the span, then acc = acc * alpha + part.
#if defined(__AVX512F__)
    if constexpr (BLOCKED) {
      for (int64_t r = 0; r < rows; r += 4) {
        const float* p = scores.data() + r * ld;
        float* out = &part[r * d];
        switch (std::min<int64_t>(4, rows - r)) {
          case 4: attn512::value_tiles<4>(p, ld, vrows.data(), 0, n, out, d); break;
          case 3: attn512::value_tiles<3>(p, ld, vrows.data(), 0, n, out, d); break;
          case 2: attn512::value_tiles<2>(p, ld, vrows.data(), 0, n, out, d); break;
          default: attn512::value_tiles<1>(p, ld, vrows.data(), 0, n, out, d); break;
        }
      }
    } else
#endif
    {
      std::fill(part.begin(), part.end(), 0.f);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < rows; ++r)
          if (scores[r * ld + t] != 0.f) axpy(&part[r * d], scores[r * ld + t], vrows[t], d);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < d; ++e) acc[r * d + e] = acc[r * d + e] * alpha[r] + part[r * d + e];
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + (q0 + task.first + r / group) * a.os + (h * group + r % group) * a.oh;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t e = 0; e < d; ++e) dst[e] = acc[r * d + e] * inv;
  }
}

}  // namespace prefill_attn

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__linux__)
#define AIOENGINE_PREFILL_AMX 1
// The prefill tile products on AMX-BF16 (Sapphire Rapids and later; TDPBF16PS multiplies
// 16 x 32 bf16 by 32 x 16 bf16 into 16 x 16 fp32). One task (a KV head of a sequence, up
// to kTileTokens query tokens, its group's heads: BLOCK_M = tokens x group query rows, in
// 16-row tiles) as FlashAttention-2 (Dao 2023, section 3.1, algorithm 1), the key loop in
// spans of kSpan keys (BLOCK_N):
//   S = Q K^T    [BLOCK_M, BLOCK_N]   A = Q * scale, packed once a task
//                                     B = K^T in AMX's pair layout (a 32-bit lane: two
//                                         dims of one key), built per 16 keys by a 16 x 16
//                                         transpose of 32-bit lanes
//   P = exp(S - m_i), masked; m_i, l_i, alpha in fp32 (softmax_span, the AVX-512 path's
//       code: causal mask, window and soft-cap alike)
//   acc = acc * alpha + P V           A = P; B = V in pair layout (keys 2j, 2j + 1 of a
//                                         row interleaved), built per 32 keys
// Precision (set_bf16_attention): x3, the default: each operand split into bf16 hi + lo =
// bf16(v - hi) and hi hi + lo hi + hi lo summed (Henry et al. 2019, as quant_amx.h), a
// product within ~2^-16 of fp32, fp32-grade (an fp32 model's logprobs stay within 1e-4 of
// HF's, tests/test_hf_parity.py); a bf16 or fp8 cache's K and V are exact in bf16 and have
// no lo.
// Or plain bf16 (opt-in): Q, K, P and V rounded to 8 significant bits, 2^-8 relative each,
// one product a tile, 1.3-1.5x faster; that moved a logprob of the fp32 model by 0.01. head_dim a multiple of 16 (80: the third 32-dim chunk
// half zeros). Tiles: amx::tile_begin's configuration (8 tiles of 16 rows x 64 bytes);
// the products in 2 x 2 blocks (tile_quad): tmm0-3 C, tmm4/5 A, tmm6/7 B.
namespace prefill_amx {

constexpr int64_t kTileElems = 512;  // bf16 values in a 16 x 32 tile (1 KiB)

// dst (16 rows of 64 bytes) = the transpose of src (16 rows of 64 bytes) in 32-bit lanes:
// dst row j holds lane j of src rows 0 .. 15.
inline void transpose_tile(const uint16_t* src, uint16_t* dst) {
  __m512 col[16];
  simd::transpose16x16(reinterpret_cast<const float*>(src), col);
  float* out = reinterpret_cast<float*>(dst);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + 16 * i, col[i]);
}

// bf16 of v0 (values 0-15) and v1 (16-31), rounded to nearest even; and, where lo is
// given, bf16(v - hi) (exact in fp32).
inline void split32(__m512 v0, __m512 v1, __m512i* hi, __m512i* lo) {
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
  *hi = h;
  if (lo == nullptr) return;
  const __m512 h0 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  const __m512 h1 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  *lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, h1), _mm512_sub_ps(v0, h0)));
}

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// 16 cache values from p as fp32, the first n of them (zeros past n).
inline __m512 load16n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(mask16(n), p); }
inline __m512 load16n(const c10::Half* p, int64_t n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16(n), p));
}
inline __m512 load16n(const c10::BFloat16* p, int64_t n) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask16(n), p)), 16));
}
inline __m512 load16n(const c10::Float8_e4m3fn* p, int64_t n) {
  return fp8::e4m3_to_ps(_mm_maskz_loadu_epi8(mask16(n), p));
}
inline __m512 load16n(const c10::Float8_e5m2* p, int64_t n) {
  return fp8::e5m2_to_ps(_mm_maskz_loadu_epi8(mask16(n), p));
}

// Whether every value of cache_t is exact in bf16, so that its K/V tiles need no lo
// half: bf16 itself, and fp8 (E4M3's 4 and E5M2's 3 significant bits, exponents within
// fp32's range).
template <typename cache_t>
constexpr bool bf16_exact = std::is_same<cache_t, c10::BFloat16>::value || is_fp8<cache_t>;

// 32 values of a cache row from p, the first n (zeros past n), as bf16 hi (+ lo where
// asked and the cache is not bf16 already).
template <typename cache_t>
inline void row32(const cache_t* p, int64_t n, __m512i* hi, __m512i* lo) {
  if constexpr (std::is_same<cache_t, c10::BFloat16>::value) {
    const __mmask32 m = n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1ull << std::max<int64_t>(n, 0)) - 1);
    *hi = _mm512_maskz_loadu_epi16(m, p);
    if (lo != nullptr) *lo = _mm512_setzero_si512();
  } else {
    split32(load16n(p, n), load16n(p + 16, n - 16), hi, lo);
  }
}

// B tiles of K^T for 16 keys (rows[i], i < cnt; zeros past cnt) and every 32-dim chunk dc
// of d: tile dc's row j, lane i (32 bits) = dims dc * 32 + 2j, 2j + 1 of key i. hi and lo
// (lo nullptr: none) get chunks * kTileElems values each.
template <typename cache_t>
inline void pack_keys(const cache_t* const* rows, int64_t cnt, int64_t d, uint16_t* hi,
                      uint16_t* lo) {
  alignas(64) uint16_t h[kTileElems], l[kTileElems];
  const int64_t chunks = (d + 31) / 32;
  for (int64_t dc = 0; dc < chunks; ++dc) {
    for (int64_t i = 0; i < 16; ++i) {
      __m512i vh = _mm512_setzero_si512(), vl = _mm512_setzero_si512();
      if (i < cnt) row32(rows[i] + dc * 32, d - dc * 32, &vh, lo != nullptr ? &vl : nullptr);
      _mm512_store_si512(h + 32 * i, vh);
      _mm512_store_si512(l + 32 * i, vl);
    }
    transpose_tile(h, hi + dc * kTileElems);
    if (lo != nullptr) transpose_tile(l, lo + dc * kTileElems);
  }
}

// B tiles of V for 32 keys (rows[t], t < cnt; zeros past cnt), one per 16 dims nt of d:
// tile nt's row j = keys 2j and 2j + 1's dims nt * 16 .. + 15, interleaved (AMX's pair
// layout: the contraction runs over keys here); hi, and lo = bf16(v - hi) where lo is given
// (not for a bf16 or fp8 cache, whose values are exact in bf16: bf16_exact).
template <typename cache_t>
inline void pack_values(const cache_t* const* rows, int64_t cnt, int64_t d, uint16_t* hi,
                        uint16_t* lo) {
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t nt = 0; nt < d / 16; ++nt)
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t t = 2 * j, off = nt * kTileElems + 32 * j;
      __m512i pair_hi, pair_lo;
      if constexpr (std::is_same<cache_t, c10::BFloat16>::value) {
        const __m256i a = t < cnt ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[t] + nt * 16))
                                  : _mm256_setzero_si256();
        const __m256i b = t + 1 < cnt ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[t + 1] + nt * 16))
                                      : _mm256_setzero_si256();
        pair_hi = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      } else {
        const __m512 a = t < cnt ? load16(rows[t] + nt * 16) : _mm512_setzero_ps();
        const __m512 b = t + 1 < cnt ? load16(rows[t + 1] + nt * 16) : _mm512_setzero_ps();
        split32(a, b, &pair_hi, lo != nullptr ? &pair_lo : nullptr);
        if (lo != nullptr) _mm512_storeu_si512(lo + off, _mm512_permutexvar_epi16(interleave, pair_lo));
      }
      _mm512_storeu_si512(hi + off, _mm512_permutexvar_epi16(interleave, pair_hi));
    }
}

// One step of a 2 x 2 block of C tiles, C0 = (a0, b0), C1 = (a0, b1), C2 = (a1, b0),
// C3 = (a1, b1): loads the given A (tmm4, tmm5) and B (tmm6, tmm7) tiles (nullptr: keep
// the one loaded) and multiplies-adds; two_a / two_b false leave out a1's / b1's tiles.
// Each loaded tile feeds two products, so a reload waits on fewer products in flight
// (AMX does not rename tile registers). The tile-register numbers are literals: GCC's AMX
// intrinsics paste them into inline assembly.
inline void tile_quad(const uint16_t* a0, const uint16_t* a1, const uint16_t* b0,
                      const uint16_t* b1, bool two_a, bool two_b) {
  if (a0 != nullptr) _tile_loadd(4, a0, 64);
  if (b0 != nullptr) _tile_loadd(6, b0, 64);
  if (two_b && b1 != nullptr) _tile_loadd(7, b1, 64);
  if (two_a && a1 != nullptr) _tile_loadd(5, a1, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (two_b) _tile_dpbf16ps(1, 4, 7);
  if (two_a) {
    _tile_dpbf16ps(2, 5, 6);
    if (two_b) _tile_dpbf16ps(3, 5, 7);
  }
}

// Stores the C tiles of tile_quad: C0 at c, C1 16 floats on, C2 16 rows (ld floats each)
// down, C3 both.
inline void store_quad(float* c, int64_t ld, bool two_a, bool two_b) {
  const int64_t stride = ld * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, c, stride);
  if (two_b) _tile_stored(1, c + 16, stride);
  if (two_a) {
    _tile_stored(2, c + 16 * ld, stride);
    if (two_b) _tile_stored(3, c + 16 * ld + 16, stride);
  }
}

inline void zero_quad() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Scratch of one thread, reused across its tasks.
struct Scratch {
  std::vector<float> acc, part, scores, m, l, alpha;
  std::vector<uint16_t> q_hi, q_lo, k_hi, k_lo, p_hi, p_lo, v_hi, v_lo;
  std::vector<const void*> krows, vrows;
};

template <typename cache_t>
void run_task(const PrefillAttention<cache_t>& a, const prefill_attn::Task& task, bool x3,
              Scratch& w) {
  using prefill_attn::kSpan;
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim;
  const int64_t rows = task.count * group, row_tiles = (rows + 15) / 16;
  const int64_t chunks = (d + 31) / 32, dim_tiles = d / 16;
  const int64_t kd = chunks * kTileElems;  // bf16 values of one key group's K^T tiles
  const int64_t s = a.seqs[task.seq], h = task.head;
  const int64_t q0 = a.query_start[s], q_len = a.query_start[s + 1] - q0;
  const int64_t len = a.seq_lens[s], prefix = len - q_len, pos0 = prefix + task.first;
  const int32_t* blocks = a.block_tables + s * a.max_blocks;
  const int64_t key_begin = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  const int64_t key_end = pos0 + task.count;
  // x3: every operand as bf16 hi + lo, three products (hi hi + lo hi + hi lo) a tile;
  // a bf16 or fp8 cache's K and V are exact in bf16, so theirs have no lo.
  const bool cache_lo = x3 && !bf16_exact<cache_t>;

  // Q * scale as A tiles, row r = query token task.first + r / group, head h * group + r % group.
  w.q_hi.assign(row_tiles * kd, 0);
  w.q_lo.assign(x3 ? row_tiles * kd : 0, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + (q0 + task.first + r / group) * a.qs + (h * group + r % group) * a.qh;
    const __m512 sc = _mm512_set1_ps(a.scale);
    for (int64_t dc = 0; dc < chunks; ++dc) {
      const int64_t n = d - dc * 32;
      __m512i hi, lo;
      split32(_mm512_mul_ps(load16n(src + dc * 32, n), sc),
              _mm512_mul_ps(load16n(src + dc * 32 + 16, n - 16), sc), &hi, x3 ? &lo : nullptr);
      const int64_t off = ((r / 16) * chunks + dc) * kTileElems + (r % 16) * 32;
      _mm512_storeu_si512(&w.q_hi[off], hi);
      if (x3) _mm512_storeu_si512(&w.q_lo[off], lo);
    }
  }
  w.acc.assign(rows * d, 0.f);
  w.part.resize(row_tiles * 16 * d);
  w.m.assign(rows, -std::numeric_limits<float>::infinity());
  w.l.assign(rows, 0.f);
  w.alpha.resize(rows);
  w.krows.resize(kSpan);
  w.vrows.resize(kSpan);
  const cache_t** krows = reinterpret_cast<const cache_t**>(w.krows.data());
  const cache_t** vrows = reinterpret_cast<const cache_t**>(w.vrows.data());

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kSpan) {
    const int64_t n = std::min(kSpan, key_end - t0);
    const int64_t groups = (n + 15) / 16, key_chunks = (n + 31) / 32, ld = key_chunks * 32;
    for (int64_t t = t0; t < t0 + n; ++t) {
      const int64_t b = blocks[t / a.block_size], i = t % a.block_size;
      krows[t - t0] = a.k + b * a.kb + i * a.kt + h * a.kh;
      vrows[t - t0] = a.v + b * a.vb + i * a.vt + h * a.vh;
    }
    w.k_hi.resize(groups * kd);
    w.k_lo.resize(cache_lo ? groups * kd : 0);
    for (int64_t g = 0; g < groups; ++g)
      pack_keys(krows + 16 * g, std::min<int64_t>(16, n - 16 * g), d, &w.k_hi[g * kd],
                cache_lo ? &w.k_lo[g * kd] : nullptr);
    const uint16_t* k_hi = w.k_hi.data();
    const uint16_t* k_lo = cache_lo ? w.k_lo.data() : nullptr;

    // S = Q K^T, [row_tiles * 16, ld] (columns past groups * 16 unwritten), in 2 x 2
    // blocks of (row tile, key group): q_hi k_hi (+ q_lo k_hi + q_hi k_lo).
    w.scores.resize(row_tiles * 16 * ld);
    for (int64_t mt = 0; mt < row_tiles; mt += 2)
      for (int64_t g = 0; g < groups; g += 2) {
        const bool two_m = mt + 1 < row_tiles, two_g = g + 1 < groups;
        zero_quad();
        for (int64_t dc = 0; dc < chunks; ++dc) {
          const uint16_t* qh = &w.q_hi[(mt * chunks + dc) * kTileElems];
          const int64_t next = chunks * kTileElems;  // row tile mt + 1
          const uint16_t* kh = k_hi + g * kd + dc * kTileElems;
          tile_quad(qh, qh + next, kh, kh + kd, two_m, two_g);
          if (x3) {
            const uint16_t* ql = &w.q_lo[(mt * chunks + dc) * kTileElems];
            tile_quad(ql, ql + next, nullptr, nullptr, two_m, two_g);
          }
          if (k_lo != nullptr) {
            const uint16_t* kl = k_lo + g * kd + dc * kTileElems;
            tile_quad(qh, qh + next, kl, kl + kd, two_m, two_g);
          }
        }
        store_quad(&w.scores[mt * 16 * ld + g * 16], ld, two_m, two_g);
      }

    prefill_attn::softmax_span(w.scores.data(), ld, rows, n, t0, pos0, group, a.window,
                               a.softcap, w.m.data(), w.l.data(), w.alpha.data());

    // P as bf16 A tiles [row_tiles][key_chunks] (+ lo; zeros past n and past rows).
    w.p_hi.resize(row_tiles * key_chunks * kTileElems);
    w.p_lo.resize(x3 ? row_tiles * key_chunks * kTileElems : 0);
    for (int64_t r = 0; r < row_tiles * 16; ++r) {
      float* row = &w.scores[r * ld];
      if (r < rows)
        for (int64_t t = n; t < ld; ++t) row[t] = 0.f;
      for (int64_t kc = 0; kc < key_chunks; ++kc) {
        __m512i hi = _mm512_setzero_si512(), lo = _mm512_setzero_si512();
        if (r < rows)
          split32(_mm512_loadu_ps(row + kc * 32), _mm512_loadu_ps(row + kc * 32 + 16), &hi,
                  x3 ? &lo : nullptr);
        const int64_t off = ((r / 16) * key_chunks + kc) * kTileElems + (r % 16) * 32;
        _mm512_storeu_si512(&w.p_hi[off], hi);
        if (x3) _mm512_storeu_si512(&w.p_lo[off], lo);
      }
    }
    // V as B tiles [key_chunks][dim_tiles] (+ lo).
    w.v_hi.resize(key_chunks * dim_tiles * kTileElems);
    w.v_lo.resize(cache_lo ? key_chunks * dim_tiles * kTileElems : 0);
    for (int64_t kc = 0; kc < key_chunks; ++kc)
      pack_values(vrows + 32 * kc, std::min<int64_t>(32, n - 32 * kc), d,
                  &w.v_hi[kc * dim_tiles * kTileElems],
                  cache_lo ? &w.v_lo[kc * dim_tiles * kTileElems] : nullptr);

    // part = P V, [row_tiles * 16, d], in 2 x 2 blocks of (row tile, 16 dims): p_hi v_hi
    // (+ p_lo v_hi + p_hi v_lo); then
    // acc = acc * alpha + part.
    for (int64_t mt = 0; mt < row_tiles; mt += 2)
      for (int64_t nt = 0; nt < dim_tiles; nt += 2) {
        const bool two_m = mt + 1 < row_tiles, two_n = nt + 1 < dim_tiles;
        zero_quad();
        for (int64_t kc = 0; kc < key_chunks; ++kc) {
          const int64_t pa = (mt * key_chunks + kc) * kTileElems, next = key_chunks * kTileElems;
          const int64_t vb = (kc * dim_tiles + nt) * kTileElems;
          const uint16_t* ph = &w.p_hi[pa];
          tile_quad(ph, ph + next, &w.v_hi[vb], &w.v_hi[vb + kTileElems], two_m, two_n);
          if (x3) {
            const uint16_t* pl = &w.p_lo[pa];
            tile_quad(pl, pl + next, nullptr, nullptr, two_m, two_n);
          }
          if (cache_lo) tile_quad(ph, ph + next, &w.v_lo[vb], &w.v_lo[vb + kTileElems], two_m, two_n);
        }
        store_quad(&w.part[mt * 16 * d + nt * 16], d, two_m, two_n);
      }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 al = _mm512_set1_ps(w.alpha[r]);
      float* acc = &w.acc[r * d];
      const float* part = &w.part[r * d];
      for (int64_t e = 0; e < d; e += 16)
        _mm512_storeu_ps(acc + e, _mm512_fmadd_ps(_mm512_loadu_ps(acc + e), al, _mm512_loadu_ps(part + e)));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + (q0 + task.first + r / group) * a.os + (h * group + r % group) * a.oh;
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    for (int64_t e = 0; e < d; ++e) dst[e] = w.acc[r * d + e] * inv;
  }
}

}  // namespace prefill_amx
#endif

// Whether the AVX-512 tiles take this call: an AVX-512 build, head_dim a multiple of 16.
template <typename cache_t>
inline bool prefill_attention_blocked(const PrefillAttention<cache_t>& a) {
#if defined(__AVX512F__)
  return a.head_dim % 16 == 0;
#else
  (void)a;
  return false;
#endif
}

// The AMX prefill tiles' precision from the next call on: plain bf16 operands (true) or
// fp32-grade hi + lo (false, the default); see prefill_amx. Returns the previous setting.
bool set_bf16_attention(bool on);
bool bf16_attention();

// Whether the AMX tiles take this call (prefill_amx): the AVX-512 tiles would (head_dim a
// multiple of 16), the build has AMX-BF16 code, the CPU and OS run it (amx::available) and
// the AMX switch is on (set_amx, AIOENGINE_AMX: the one the GEMM follows; off, every
// product is fp32, as the test suite runs by default).
template <typename cache_t>
inline bool prefill_attention_amx(const PrefillAttention<cache_t>& a) {
#if defined(AIOENGINE_PREFILL_AMX)
  return a.head_dim % 16 == 0 && amx_allowed() && amx::available();
#else
  (void)a;
  return false;
#endif
}

// The chunks of a.seqs' sequences: tasks of (sequence, KV head, up to kTileTokens query
// tokens), split over threads by their cost (rows x keys, prefix sums as TaskSplit);
// on AMX (prefill_attention_amx) or the AVX-512 tiles or, portable = true, the portable
// loops (tests compare them on one CPU).
template <typename cache_t>
void prefill_attention_run(const PrefillAttention<cache_t>& a, bool portable = false) {
  using prefill_attn::kTileTokens;
  using prefill_attn::Task;
  const int64_t group = a.num_heads / a.num_kv_heads;
  std::vector<Task> tasks;
  std::vector<int64_t> prefix{0};
  for (int64_t i = 0; i < a.num_run; ++i) {
    const int64_t s = a.seqs[i];
    const int64_t q_len = a.query_start[s + 1] - a.query_start[s];
    const int64_t past = a.seq_lens[s] - q_len;
    for (int64_t first = 0; first < q_len; first += kTileTokens) {
      const int64_t count = std::min(kTileTokens, q_len - first);
      const int64_t end = past + first + count;  // keys of the tile's last row
      const int64_t keys = a.window > 0 ? std::min(end, a.window + count) : end;
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        tasks.push_back({i, h, first, count});
        prefix.push_back(prefix.back() + count * group * (keys + 16));
      }
    }
  }
  if (tasks.empty()) return;
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  auto begin = [&](int64_t p) -> int64_t {
    const int64_t total = prefix.back();
    return std::partition_point(prefix.begin(), prefix.end() - 1,
                                [&](int64_t c) { return c * parts < p * total; }) -
           prefix.begin();
  };
  const bool blocked = !portable && prefill_attention_blocked(a);
#if defined(AIOENGINE_PREFILL_AMX)
  if (blocked && prefill_attention_amx(a)) {
    const bool x3 = !bf16_attention();
    at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
      prefill_amx::Scratch w;
      amx::tile_begin();  // this thread's tiles: another kernel or library may have left others
      for (int64_t i = begin(pb); i < begin(pe); ++i) prefill_amx::run_task(a, tasks[i], x3, w);
      amx::tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> q, scores, acc, part;
    std::vector<const cache_t*> krows, vrows;
    for (int64_t i = begin(pb); i < begin(pe); ++i) {
      if (blocked)
        prefill_attn::run_task<true>(a, tasks[i], q, scores, acc, part, krows, vrows);
      else
        prefill_attn::run_task<false>(a, tasks[i], q, scores, acc, part, krows, vrows);
    }
  });
}


// out = decode attention of query over the caches ([num_seqs, num_heads, head_dim];
// caches [num_blocks, block_size, num_kv_heads, head_dim] of the query's dtype, or
// fp16/bf16/fp8 (E4M3, E5M2) under an fp32 query). Checks shapes, dtypes, seq_lens (0 .. max_blocks x
// block_size; 0 gives zeros) and the block ids each sequence reads.
// portable: run the portable kernel even where the blocked one applies (tests).
// window: keys the query sees, its own included (0: all); softcap: Gemma 2's cap (0: none).
void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale, bool portable = false,
                            int64_t window = 0, double softcap = 0.0);

// out = paged attention of query chunks (PrefillAttention) for every sequence:
// query/out [num_tokens, num_heads, head_dim] fp32; caches [num_blocks, block_size,
// num_kv_heads, head_dim] fp32, fp16, bf16 or fp8 (E4M3, E5M2); block_tables [num_seqs, max_blocks] int32;
// seq_lens [num_seqs] int32; query_start_loc [num_seqs + 1] int32 (0 first, num_tokens
// last, q_len in [1, seq_len]); window 0 for none, softcap 0 for none. Checks shapes,
// dtypes, lengths and the block ids a sequence reads.
void paged_attention_prefill(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_start_loc, double scale,
                             int64_t window = 0, double softcap = 0.0, bool portable = false);

}  // namespace aioengine
