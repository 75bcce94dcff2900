// reshape_and_cache on the CPU: this step's fp32 K/V rows into their cache slots
// (PagedAttention, Kwon et al. 2023, section 4.1; vLLM's cache kernel of that name),
// rounded to the cache's dtype as the fused decoder layers write them (store_row,
// fp8.h: round to nearest even; fp8 saturating).
//
// key, value: [num_tokens, num_kv_heads, head_dim] fp32, any token/head strides,
// head_dim stride 1. key_cache, value_cache: [num_blocks, block_size, num_kv_heads,
// head_dim], one dtype (fp32, fp16, bf16, float8_e4m3fn, float8_e5m2), head_dim stride
// 1. slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; -1 skips
// the token; any other slot outside the cache is an error.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "fp8.h"

namespace aioengine {

namespace {

template <typename cache_t>
void write_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                 at::Tensor& value_cache, const int64_t* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t block_size = key_cache.size(1);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  cache_t* kc = key_cache.data_ptr<cache_t>();
  cache_t* vc = value_cache.data_ptr<cache_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t b = slot / block_size, i = slot % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        store_row(k + t * key.stride(0) + h * key.stride(1),
                  kc + b * key_cache.stride(0) + i * key_cache.stride(1) + h * key_cache.stride(2), d);
        store_row(v + t * value.stride(0) + h * value.stride(1),
                  vc + b * value_cache.stride(0) + i * value_cache.stride(1) +
                      h * value_cache.stride(2), d);
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes() &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "reshape_and_cache: key/value [num_tokens, num_kv_heads, head_dim] and caches "
              "[num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache: fp32 key/value and caches of one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1, "reshape_and_cache: head_dim stride must be 1");
  TORCH_CHECK(key_cache.size(1) > 0, "reshape_and_cache: block_size must be positive");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "reshape_and_cache: slot_mapping [num_tokens] contiguous int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "reshape_and_cache: slot ", slots[t],
                " outside the cache of ", num_slots, " slots");
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      write_slots<float>(key, value, key_cache, value_cache, slots);
      break;
    case at::kHalf:
      write_slots<c10::Half>(key, value, key_cache, value_cache, slots);
      break;
    case at::kBFloat16:
      write_slots<c10::BFloat16>(key, value, key_cache, value_cache, slots);
      break;
    case at::kFloat8_e4m3fn:
      write_slots<c10::Float8_e4m3fn>(key, value, key_cache, value_cache, slots);
      break;
    case at::kFloat8_e5m2:
      write_slots<c10::Float8_e5m2>(key, value, key_cache, value_cache, slots);
      break;
    default:
      TORCH_CHECK(false, "reshape_and_cache: the cache must be fp32, fp16, bf16 or fp8 "
                  "(float8_e4m3fn, float8_e5m2)");
  }
}

}  // namespace aioengine
