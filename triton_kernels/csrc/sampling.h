// Categorical sampling of one token per row from fp32 logits: temperature, then the
// min-p, top-k and top-p (nucleus; Holtzman et al. 2020, section 3.1) filters, then inverse
// transform sampling (Devroye 1986, "Non-Uniform Random Variate Generation", section 2.1)
// with one uniform per row, drawn by the caller from the request's own generator.

#pragma once

#include <ATen/ATen.h>

namespace aioengine {

// tokens [n] int64: for each i < n, one token of row rows[i] of logits [num_rows, vocab]
// (fp32, contiguous rows), drawn from softmax(logits[rows[i]] / temperature[i]) restricted
// to the tokens that pass, in this order, min_p[i] (> 0: probability at least min_p times
// the largest), top_k[i] (> 0: the top_k largest, ties with the k-th kept) and top_p[i]
// (< 1: the shortest most-probable-first prefix holding top_p of what is left, ties with
// its last token kept). The draw walks the vocabulary in index order to the first token
// whose cumulative kept mass exceeds uniforms[i] (fp64, in [0, 1)) times the kept total.
// temperature, top_p, min_p: [n] fp32; top_k, rows: [n] int64. Each row's result depends
// only on that row's inputs (not on n, the other rows or the thread count).
at::Tensor sample_from_logits(const at::Tensor& logits, const at::Tensor& rows,
                              const at::Tensor& temperature, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& min_p,
                              const at::Tensor& uniforms);

}  // namespace aioengine
