// copy_blocks: copy whole KV blocks inside the paged cache, every layer and both K and V
// in one call (vLLM's copy_blocks cache kernel). The engine's copy-on-write
// (PagedAttention, Kwon et al. 2023, section 4.4) schedules (src, dst) pairs; the worker
// runs them before the step's forward.
//
// kv_cache: [num_layers, 2, num_blocks, ...block...], any float dtype, each block's
// elements contiguous (dims 3.. row-major, as the worker allocates it); the first three
// dims may have any strides. block_mapping: [num_pairs, 2] int64 (src, dst) on CPU.
// Destinations must be distinct and no destination may be a source (the engine
// guarantees both), so the copies are independent and run in parallel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>

void copy_blocks(at::Tensor kv_cache, const at::Tensor& block_mapping) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "copy_blocks: kv_cache must be on the CPU");
  TORCH_CHECK(kv_cache.dim() >= 4 && kv_cache.size(1) == 2,
              "copy_blocks: kv_cache must be [num_layers, 2, num_blocks, ...]");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2 &&
                  block_mapping.scalar_type() == at::kLong && block_mapping.is_contiguous() &&
                  block_mapping.device().is_cpu(),
              "copy_blocks: block_mapping must be a contiguous [num_pairs, 2] int64 CPU tensor");
  // The block's own elements must be one contiguous run.
  int64_t expected = 1;
  for (int64_t d = kv_cache.dim() - 1; d >= 3; --d) {
    TORCH_CHECK(kv_cache.size(d) == 1 || kv_cache.stride(d) == expected,
                "copy_blocks: each block of kv_cache must be contiguous");
    expected *= kv_cache.size(d);
  }
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0 || kv_cache.numel() == 0) return;
  const int64_t num_layers = kv_cache.size(0), num_blocks = kv_cache.size(2);
  const int64_t elem = kv_cache.element_size();
  const int64_t block_bytes = expected * elem;
  const int64_t s_layer = kv_cache.stride(0) * elem, s_kv = kv_cache.stride(1) * elem,
                s_block = kv_cache.stride(2) * elem;
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < 2 * num_pairs; ++i)
    TORCH_CHECK(pairs[i] >= 0 && pairs[i] < num_blocks, "copy_blocks: block id ", pairs[i],
                " outside the cache's ", num_blocks, " blocks");
  char* base = static_cast<char*>(kv_cache.data_ptr());
  // One task per (layer, K or V, pair): a block of the default model is 24 KiB.
  at::parallel_for(0, num_layers * 2 * num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pair = t % num_pairs, plane = t / num_pairs;
      char* p = base + (plane / 2) * s_layer + (plane % 2) * s_kv;
      std::memcpy(p + pairs[2 * pair + 1] * s_block, p + pairs[2 * pair] * s_block,
                  static_cast<size_t>(block_bytes));
    }
  });
}
