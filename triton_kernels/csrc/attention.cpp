// The tensor entry points of paged decode and prefill attention (attention.h).

#include "attention.h"

#include <ATen/Dispatch.h>

#include <atomic>

namespace aioengine {

namespace {
std::atomic<bool> bf16_attention_on{false};
}  // namespace

bool set_bf16_attention(bool on) { return bf16_attention_on.exchange(on); }

bool bf16_attention() { return bf16_attention_on.load(); }

namespace {

// The operands DecodeAttention and PrefillAttention share (attention.h): pointers and
// strides of the query [T, H, D], the paged caches [blocks, block_size, KVH, D] and the
// output, the block table and lengths of each sequence, head counts and the scale.
template <typename scalar_t, typename cache_t, typename Kernel>
void set_paged_operands(Kernel* a, const at::Tensor& out, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale) {
  a->q = query.data_ptr<scalar_t>();
  a->qs = query.stride(0);
  a->qh = query.stride(1);
  a->k = key_cache.data_ptr<cache_t>();
  a->kb = key_cache.stride(0);
  a->kt = key_cache.stride(1);
  a->kh = key_cache.stride(2);
  a->v = value_cache.data_ptr<cache_t>();
  a->vb = value_cache.stride(0);
  a->vt = value_cache.stride(1);
  a->vh = value_cache.stride(2);
  a->out = out.data_ptr<scalar_t>();
  a->os = out.stride(0);
  a->oh = out.stride(1);
  a->block_tables = block_tables.data_ptr<int32_t>();
  a->max_blocks = block_tables.size(1);
  a->seq_lens = seq_lens.data_ptr<int32_t>();
  a->num_heads = query.size(1);
  a->num_kv_heads = key_cache.size(2);
  a->head_dim = query.size(2);
  a->block_size = key_cache.size(1);
  a->scale = static_cast<float>(scale);
}

template <typename scalar_t, typename cache_t = scalar_t>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           double scale, bool portable, int64_t window, double softcap) {
  DecodeAttention<scalar_t, cache_t> a;
  set_paged_operands<scalar_t, cache_t>(&a, out, query, key_cache, value_cache, block_tables,
                                        seq_lens, scale);
  a.num_seqs = query.size(0);
  a.window = window;
  a.softcap = static_cast<float>(softcap);
  decode_attention_run(a, portable);
}


// Every seq_len in [0, max_blocks * block_size] and every block id a sequence reads (its
// window's) in [0, num_blocks): the kernels index the table and the cache unchecked.
void check_decode_tables(const at::Tensor& key_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, int64_t window) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t s = 0; s < seq_lens.numel(); ++s) {
    const int64_t len = lens[s];
    TORCH_CHECK(len >= 0 && len <= max_blocks * block_size, "paged_attention_decode: sequence ",
                s, " has seq_len ", len, ", outside [0, ", max_blocks * block_size,
                "] (max_blocks x block_size)");
    const int64_t first = window > 0 && len > window ? len - window : 0;
    for (int64_t b = first / block_size; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t id = bt[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention_decode: sequence ", s,
                  " reads block id ", id, " outside [0, ", num_blocks, ")");
    }
  }
}

}  // namespace

void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale, bool portable, int64_t window,
                            double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention_decode: bad ranks");
  TORCH_CHECK(key_cache.size(1) > 0 && key_cache.size(2) > 0,
              "paged_attention_decode: block_size and num_kv_heads must be positive");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention_decode: window, softcap >= 0");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "paged_attention_decode: head mismatch");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1, "paged_attention_decode: head_dim stride must be 1");
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_attention_decode: out shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && seq_lens.dim() == 1 &&
                  block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "paged_attention_decode: block_tables [num_seqs, max_blocks] and seq_lens "
              "[num_seqs] must be contiguous int32");
  check_decode_tables(key_cache, block_tables, seq_lens, window);
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_type && out.scalar_type() == query.scalar_type() &&
                  (query.scalar_type() == cache_type ||
                   (query.scalar_type() == at::kFloat &&
                    (cache_type == at::kHalf || cache_type == at::kBFloat16 ||
                     cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2))),
              "paged_attention_decode: the caches must have the query's dtype, or be fp16/bf16/"
              "fp8 (float8_e4m3fn, float8_e5m2) under an fp32 query");
  if (query.scalar_type() == at::kFloat && cache_type != at::kFloat) {
    switch (cache_type) {
      case at::kHalf:
        decode_attention_impl<float, c10::Half>(out, query, key_cache, value_cache, block_tables,
                                                seq_lens, scale, portable, window, softcap);
        return;
      case at::kBFloat16:
        decode_attention_impl<float, c10::BFloat16>(out, query, key_cache, value_cache,
                                                    block_tables, seq_lens, scale, portable,
                                                    window, softcap);
        return;
      case at::kFloat8_e4m3fn:
        decode_attention_impl<float, c10::Float8_e4m3fn>(out, query, key_cache, value_cache,
                                                         block_tables, seq_lens, scale,
                                                         portable, window, softcap);
        return;
      default:  // kFloat8_e5m2 (checked above)
        decode_attention_impl<float, c10::Float8_e5m2>(out, query, key_cache, value_cache,
                                                       block_tables, seq_lens, scale, portable,
                                                       window, softcap);
        return;
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attn", [&] {
    decode_attention_impl<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                       portable, window, softcap);
  });
}



namespace {

template <typename cache_t>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            double scale, int64_t window, double softcap, bool portable) {
  const int64_t num_seqs = seq_lens.numel();
  std::vector<int32_t> seqs(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) seqs[s] = static_cast<int32_t>(s);
  PrefillAttention<cache_t> a;
  set_paged_operands<float, cache_t>(&a, out, query, key_cache, value_cache, block_tables,
                                     seq_lens, scale);
  a.query_start = query_start_loc.data_ptr<int32_t>();
  a.seqs = seqs.data();
  a.num_run = num_seqs;
  a.window = window;
  a.softcap = static_cast<float>(softcap);
  prefill_attention_run(a, portable);
}

}  // namespace

void paged_attention_prefill(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_start_loc, double scale,
                             int64_t window, double softcap, bool portable) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention_prefill: bad ranks");
  // Checked before the modulo below divides by them (0 KV heads was a SIGFPE).
  TORCH_CHECK(key_cache.size(1) > 0 && key_cache.size(2) > 0,
              "paged_attention_prefill: the cache needs block_size > 0 and num_kv_heads > 0");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "paged_attention_prefill: head mismatch");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1, "paged_attention_prefill: head_dim stride must be 1");
  TORCH_CHECK(out.sizes() == query.sizes() && query.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat, "paged_attention_prefill: fp32 query and out "
              "of one shape");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention_prefill: window, softcap >= 0");
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == num_seqs + 1,
              "paged_attention_prefill: block_tables [num_seqs, max_blocks], seq_lens "
              "[num_seqs] and query_start_loc [num_seqs + 1], contiguous int32");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == query.size(0),
              "paged_attention_prefill: query_start_loc must run from 0 to num_tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 1 && q_len <= lens[s] && lens[s] <= max_blocks * block_size,
                "paged_attention_prefill: sequence ", s, " has q_len ", q_len, " and seq_len ",
                lens[s]);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(bt[s * max_blocks + b] >= 0 && bt[s * max_blocks + b] < num_blocks,
                  "paged_attention_prefill: block id ", bt[s * max_blocks + b], " outside [0, ",
                  num_blocks, ")");
  }
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_type,
              "paged_attention_prefill: key and value caches of one dtype");
  switch (cache_type) {
    case at::kFloat:
      prefill_attention_impl<float>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                    query_start_loc, scale, window, softcap, portable);
      break;
    case at::kHalf:
      prefill_attention_impl<c10::Half>(out, query, key_cache, value_cache, block_tables,
                                        seq_lens, query_start_loc, scale, window, softcap,
                                        portable);
      break;
    case at::kBFloat16:
      prefill_attention_impl<c10::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                            seq_lens, query_start_loc, scale, window, softcap,
                                            portable);
      break;
    case at::kFloat8_e4m3fn:
      prefill_attention_impl<c10::Float8_e4m3fn>(out, query, key_cache, value_cache,
                                                 block_tables, seq_lens, query_start_loc, scale,
                                                 window, softcap, portable);
      break;
    case at::kFloat8_e5m2:
      prefill_attention_impl<c10::Float8_e5m2>(out, query, key_cache, value_cache, block_tables,
                                               seq_lens, query_start_loc, scale, window, softcap,
                                               portable);
      break;
    default:
      TORCH_CHECK(false, "paged_attention_prefill: the cache must be fp32, fp16, bf16 or fp8 "
                  "(float8_e4m3fn, float8_e5m2)");
  }
}

}  // namespace aioengine
