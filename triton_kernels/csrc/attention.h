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

#include "simd.h"

namespace aioengine {


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
// sum for every score and a load/store of the accumulator for every value row. Here:
// - scores 16 keys at a time: each key row is loaded (and fp16/bf16 widened) once for up
//   to 4 query heads of the group, its 16-lane partial products are kept, and one
//   transpose-add tree (sum16x16) turns 16 of them into 16 scores;
// - the weighted sum keeps a tile of up to 4 heads x 64 dims in registers over all keys;
// - softmax divides once at the end (the sum of exp, then acc / sum);
// - tasks are split over threads by keys (TaskSplit), K/V rows prefetched a chunk ahead.
// At 32 sequences x 128 keys on one core of the dev machine (AVX-512, 11 GB/s) it reads
// the cache at 9-10 GB/s, 1.2-1.5x the portable kernel (bench/README.md).
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

template <typename scalar_t, typename cache_t>
void run(const DecodeAttention<scalar_t, cache_t>& a) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim;
  // A task takes every KV head of its sequence when there are sequences enough to keep
  // the threads busy: its K/V rows are then read whole (num_kv_heads * head_dim values,
  // one run in a contiguous cache), which the hardware prefetchers follow; else one KV
  // head (batch 1 still splits over threads).
  const int64_t ht = a.num_seqs >= 4 * at::get_num_threads() ? a.num_kv_heads : 1;
  const int64_t per_seq = a.num_kv_heads / ht, hg = ht * group;  // query heads a task
  const TaskSplit split(a, ht);
  at::parallel_for(0, split.parts, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> q(hg * d), acc(hg * d), scores, inv(hg);
    std::vector<const cache_t*> krows, vrows;
    for (int64_t task = split.begin(pb); task < split.begin(pe); ++task) {
      const int64_t s = task / per_seq, h0 = (task % per_seq) * ht;
      const int64_t len = a.seq_lens[s];
      const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;
      const int64_t n = len - first, ld = (n + 15) / 16 * 16;
      const int32_t* blocks = a.block_tables + s * a.max_blocks;
      krows.resize(n);
      vrows.resize(n);
      for (int64_t t = first; t < len; ++t) {  // rows of head h0; head h0 + j is j * kh on
        const int64_t b = blocks[t / a.block_size], r = t % a.block_size;
        krows[t - first] = a.k + b * a.kb + r * a.kt + h0 * a.kh;
        vrows[t - first] = a.v + b * a.vb + r * a.vt + h0 * a.vh;
      }
      scores.resize(hg * ld);
      for (int64_t g = 0; g < hg; ++g) {
        const scalar_t* src = a.q + a.row(s) * a.qs + (h0 * group + g) * a.qh;
        for (int64_t e = 0; e < d; ++e) q[g * d + e] = static_cast<float>(src[e]) * a.scale;
      }
      // Pass 1: scores, 16 keys at a time; the next chunk's K rows and this chunk's V
      // rows (pass 2's) are asked for ahead (short strided runs the hardware misses).
      const int64_t kspan = ((ht - 1) * a.kh + d) * static_cast<int64_t>(sizeof(cache_t));
      const int64_t vspan = ((ht - 1) * a.vh + d) * static_cast<int64_t>(sizeof(cache_t));
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - t0);
        for (int64_t i = t0 + 16; i < std::min<int64_t>(n, t0 + 32); ++i)
          prefetch_rows(krows[i], 1, 0, kspan);
        for (int64_t i = t0; i < t0 + cnt; ++i) prefetch_rows(vrows[i], 1, 0, vspan);
        const cache_t* const* kr = krows.data() + t0;
        for (int64_t j = 0; j < ht; ++j)
          for (int64_t g = 0; g < group; g += 4) {
            const float* qg = &q[(j * group + g) * d];
            float* out = scores.data() + (j * group + g) * ld + t0;
            const int64_t off = j * a.kh;
            switch (std::min<int64_t>(4, group - g)) {
              case 4: score_chunk<4>(qg, d, kr, off, cnt, out, ld); break;
              case 3: score_chunk<3>(qg, d, kr, off, cnt, out, ld); break;
              case 2: score_chunk<2>(qg, d, kr, off, cnt, out, ld); break;
              default: score_chunk<1>(qg, d, kr, off, cnt, out, ld); break;
            }
          }
      }
      // Softmax numerators per query head, max-subtracted; 1 / sum kept for the end.
      for (int64_t g = 0; g < hg; ++g) {
        float* row = &scores[g * ld];
        if (a.softcap > 0.f)
          for (int64_t t = 0; t < n; ++t) row[t] = std::tanh(row[t] / a.softcap) * a.softcap;
        __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(row + t));
        float m = _mm512_reduce_max_ps(vm);
        for (; t < n; ++t) m = row[t] > m ? row[t] : m;
        exp_shifted(row, n, m);
        __m512 vs = _mm512_setzero_ps();
        for (t = 0; t + 16 <= n; t += 16) vs = _mm512_add_ps(vs, _mm512_loadu_ps(row + t));
        float sum = _mm512_reduce_add_ps(vs);
        for (; t < n; ++t) sum += row[t];
        inv[g] = n > 0 ? 1.f / sum : 0.f;
      }
      // Pass 2: the weighted sum of the values, a register tile of heads x dims at a time.
      for (int64_t j = 0; j < ht; ++j)
        for (int64_t g = 0; g < group; g += 4) {
          const float* p = scores.data() + (j * group + g) * ld;
          float* out = &acc[(j * group + g) * d];
          const int64_t off = j * a.vh;
          switch (std::min<int64_t>(4, group - g)) {
            case 4: value_tiles<4>(p, ld, vrows.data(), off, n, out, d); break;
            case 3: value_tiles<3>(p, ld, vrows.data(), off, n, out, d); break;
            case 2: value_tiles<2>(p, ld, vrows.data(), off, n, out, d); break;
            default: value_tiles<1>(p, ld, vrows.data(), off, n, out, d); break;
          }
        }
      for (int64_t g = 0; g < hg; ++g) {
        scalar_t* dst = a.out + a.row(s) * a.os + (h0 * group + g) * a.oh;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<scalar_t>(acc[g * d + e] * inv[g]);
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
// Read in place through the block table, as the decode kernel. Scores, softmax and sums
// in fp32; the query's dtype is fp32, the cache's fp32, fp16 or bf16.
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
    // Soft-cap, mask, and the online softmax's update per row.
    for (int64_t r = 0; r < rows; ++r) {
      float* row = &scores[r * ld];
      if (a.softcap > 0.f)
        for (int64_t t = 0; t < n; ++t) row[t] = std::tanh(row[t] / a.softcap) * a.softcap;
      const int64_t allow_lo = std::max<int64_t>(lo(r) - t0, 0);
      const int64_t allow_hi = std::min<int64_t>(pos(r) + 1 - t0, n);  // exclusive
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

// The chunks of a.seqs' sequences: tasks of (sequence, KV head, up to kTileTokens query
// tokens), split over threads by their cost (rows x keys, prefix sums as TaskSplit);
// portable = true forces the portable loops (tests compare both on one CPU).
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
// fp16/bf16 under an fp32 query). Checks shapes and dtypes.
// portable: run the portable kernel even where the blocked one applies (tests).
void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale, bool portable = false);

// out = paged attention of query chunks (PrefillAttention) for every sequence:
// query/out [num_tokens, num_heads, head_dim] fp32; caches [num_blocks, block_size,
// num_kv_heads, head_dim] fp32, fp16 or bf16; block_tables [num_seqs, max_blocks] int32;
// seq_lens [num_seqs] int32; query_start_loc [num_seqs + 1] int32 (0 first, num_tokens
// last, q_len in [1, seq_len]); window 0 for none, softcap 0 for none. Checks shapes,
// dtypes, lengths and the block ids a sequence reads.
void paged_attention_prefill(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_start_loc, double scale,
                             int64_t window = 0, double softcap = 0.0, bool portable = false);

}  // namespace aioengine
