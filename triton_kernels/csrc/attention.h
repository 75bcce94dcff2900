// Paged decode attention (PagedAttention, Kwon et al. 2023, section 4.1): one new query
// token per sequence attends to its paged K/V, read in place through the block table, no
// gather copy. One task per (sequence, KV head) reads each K and V row once for the whole
// query-head group (GQA, Ainslie et al. 2023). Scores, softmax and the weighted sum in
// fp32. Used by the tensor entry point (attention.cpp) and the fused decoder layers.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

template <typename scalar_t, typename cache_t>
void decode_attention_run(const DecodeAttention<scalar_t, cache_t>& a) {
  const int64_t group = a.num_heads / a.num_kv_heads, head_dim = a.head_dim;
  at::parallel_for(0, a.num_seqs * a.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / a.num_kv_heads, h = task % a.num_kv_heads;
      const int64_t len = a.seq_lens[s];
      // Keys first .. len - 1: blocks wholly before a window are never read.
      const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;
      const int64_t n = len - first;
      const int32_t* blocks = a.block_tables + s * a.max_blocks;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = a.q + s * a.qs + (h * group + g) * a.qh;
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
        scalar_t* dst = a.out + s * a.os + (h * group + g) * a.oh;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}


// out = decode attention of query over the caches ([num_seqs, num_heads, head_dim];
// caches [num_blocks, block_size, num_kv_heads, head_dim] of the query's dtype, or
// fp16/bf16 under an fp32 query). Checks shapes and dtypes.
void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale);

}  // namespace aioengine
