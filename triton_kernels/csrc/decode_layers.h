// The decoder layers of a Llama-family model for one step (decode rows, prompt chunks or
// both), in one call (decode_layers.cpp). Weights come as named structs (DecoderLayerWeights), one per layer.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <ctime>
#include <string>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "norm_act.h"
#include "quant_ops.h"

namespace aioengine {

// A projection's weight as parts stacked by rows (uint8 GGML rows, or one contiguous fp32
// matrix) with their GGML types (quant_ops.h; F32 = 0).
struct Projection {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> qtypes;
};

// One decoder layer's weights, by name (HF's module names), and its attention settings.
// Norms and the bias are contiguous fp32; an optional tensor is empty when the family
// has none:
// - qkv_bias [(H + 2 * KVH) * D] (Qwen2);
// - q_norm, k_norm [D]: per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3);
// - pre_feedforward_layernorm, post_feedforward_layernorm [hidden]: Gemma's sandwich,
//   where post_attention_layernorm norms the attention output before the residual add
//   and pre_feedforward_layernorm the residual stream (both or neither).
// Gemma's (1 + weight) norms arrive with the 1 added (the model adds it at load).
struct DecoderLayerWeights {
  at::Tensor input_layernorm, post_attention_layernorm, qkv_bias;
  Projection qkv_proj, o_proj, gate_up_proj, down_proj;
  at::Tensor q_norm, k_norm, pre_feedforward_layernorm, post_feedforward_layernorm;
  int64_t sliding_window = 0;  // keys a query attends to, its own included; 0: all
  int64_t rope_table = 0;      // which of forward()'s cos/sin tables (Gemma 3: local, global)
};

// The MLP's gate activation: SiLU (SwiGLU; Llama, Qwen, Mistral, Phi-3) or GELU with
// the tanh approximation (GeGLU; Gemma).
enum class GatedActivation : int64_t { kSilu = 0, kGeluTanh = 1 };

// The decoder layers of a Llama-family model for one step, in one call: decode rows, prompt
// chunks (chunked prefill, whole prompts) or a mix of both.
//
// Between two weight-streaming matmuls, every small op the Python forward runs starts
// with cold caches (the weights just swept L2) and costs 30-40 us instead of a few;
// at batch 1 that was a quarter of the step (bench/README.md). Here the whole layer
// stack runs in C++ with small buffers and a small code footprint, the "no bubbles"
// idea of decode megakernels (Hazy Research, "Look Ma, No Bubbles!", 2025). Each
// layer: RMSNorm (+ residual add), QKV projection (+ bias), per-head Q/K RMSNorm where
// given, rotate-half RoPE from the layer's table, K/V written to their cache slots,
// paged attention (sliding window and soft-capping where set: decode rows through the
// decode kernel, each prompt chunk through PrefillAttention over its cached prefix and
// itself; projections take all the step's tokens as rows), O projection,
// [RMSNorm of the output,] residual add + RMSNorm, gate/up projection, SiLU or GELU *
// up, down projection[, RMSNorm of the output]. The bracketed norms are Gemma's
// sandwich. One kernel for every family; the per-family parts are the optional weights
// and settings of DecoderLayerWeights and the constructor's activation and softcap.
// fp32 activations; each projection is a dense fp32 matrix or GGML-quantized parts
// (quant_ops.h). The Python forward is the oracle (tests/test_decode_layers.py,
// tests/test_decode_layers_families.py).
class LlamaDecodeLayers {
 public:
  // Checks every shape: hidden from final_norm, head counts, each projection's rows and
  // in_features (hidden for qkv and gate_up, H * D for o_proj, half of gate_up's rows
  // for down_proj), the optional norms'. activation: "silu" or "gelu_tanh";
  // attn_logit_softcap: Gemma 2's cap on attention scores, 0 for none.
  LlamaDecodeLayers(const std::vector<DecoderLayerWeights>& layers, at::Tensor final_norm,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                    const std::string& activation = "silu", double attn_logit_softcap = 0.0);

  // residual: [M, hidden] embeddings of the step's M tokens; it becomes the residual
  // stream after the last layer. cos, sin: [num_tables, M, head_dim] (or [M, head_dim],
  // one table) rows of the RoPE tables at the tokens' positions; a layer uses table
  // rope_table. kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads,
  // head_dim]. slots: [M] int64 cache slots of the new tokens; block_tables: [S,
  // max_blocks] int32 (entries past a sequence's length may be any valid block id);
  // seq_lens: [S] int32, the new tokens included. query_start_loc: [S + 1] int32, the
  // tokens of sequence s are rows query_start_loc[s] .. query_start_loc[s + 1] - 1 (a
  // decode row, or a prompt chunk attending causally to the cached prefix and itself);
  // none: one token per sequence (S == M), a decode step. The caller (the attention
  // plan) has checked slots, block ids and lengths against the cache.
  // Returns the final-normed hidden states [M, hidden].
  at::Tensor forward(at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                     at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                     double scale, c10::optional<at::Tensor> query_start_loc = c10::nullopt) {
    const int64_t M = residual.size(0);
    TORCH_CHECK(residual.dim() == 2 && residual.size(1) == hidden_ && residual.is_contiguous() &&
                    residual.scalar_type() == at::kFloat, "forward: residual [M, hidden] fp32");
    if (cos.dim() == 2) cos = cos.unsqueeze(0);
    if (sin.dim() == 2) sin = sin.unsqueeze(0);
    TORCH_CHECK(cos.dim() == 3 && cos.size(0) >= num_tables_ && cos.size(1) == M &&
                    cos.size(2) == head_dim_ && sin.sizes() == cos.sizes() &&
                    cos.is_contiguous() && sin.is_contiguous() &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                "forward: cos/sin [num_tables >= ", num_tables_, ", M, head_dim] fp32");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers_ && kv_cache.size(1) == 2 &&
                    kv_cache.size(4) == num_kv_heads_ && kv_cache.size(5) == head_dim_ &&
                    kv_cache.stride(5) == 1 &&
                    (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf ||
                     kv_cache.scalar_type() == at::kBFloat16 ||
                     kv_cache.scalar_type() == at::kFloat8_e4m3fn ||
                     kv_cache.scalar_type() == at::kFloat8_e5m2),
                "forward: kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                "head_dim] fp32, fp16, bf16 or fp8 (float8_e4m3fn, float8_e5m2)");
    const int64_t S = seq_lens.numel();
    at::Tensor qsl = query_start_loc.has_value() && query_start_loc->defined()
                         ? *query_start_loc : at::Tensor();
    TORCH_CHECK(slots.numel() == M && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == S &&
                    block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                    seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                    (qsl.defined() ? qsl.numel() == S + 1 && qsl.scalar_type() == at::kInt &&
                                         qsl.is_contiguous()
                                   : S == M),
                "forward: slots [M] int64, block_tables [S, max_blocks] and seq_lens [S] int32, "
                "query_start_loc [S + 1] int32 (or none and S == M)");
    switch (kv_cache.scalar_type()) {
      case at::kHalf:
        return run<c10::Half>(residual, cos, sin, kv_cache, slots, block_tables, seq_lens, qsl,
                              scale);
      case at::kBFloat16:
        return run<c10::BFloat16>(residual, cos, sin, kv_cache, slots, block_tables, seq_lens,
                                  qsl, scale);
      case at::kFloat8_e4m3fn:
        return run<c10::Float8_e4m3fn>(residual, cos, sin, kv_cache, slots, block_tables,
                                       seq_lens, qsl, scale);
      case at::kFloat8_e5m2:
        return run<c10::Float8_e5m2>(residual, cos, sin, kv_cache, slots, block_tables,
                                     seq_lens, qsl, scale);
      default:
        return run<float>(residual, cos, sin, kv_cache, slots, block_tables, seq_lens, qsl,
                          scale);
    }
  }

  // Per-op time of forward() while profiling is on (bench/quant_kernels.py --breakdown):
  // the calling thread's CPU seconds summed over calls, by op (op_names()).
  void set_profile(bool on) {
    profile_ = on;
    op_seconds_.fill(0.0);
  }
  std::vector<double> op_seconds() const { return {op_seconds_.begin(), op_seconds_.end()}; }
  static std::vector<std::string> op_names() {
    return {"qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj", "other"};
  }

 private:
  // forward() for a cache of element type cache_t (K/V are rounded to it when written, fp8
  // also saturated: store_row, fp8.h).
  template <typename cache_t>
  at::Tensor run(at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                 at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                 at::Tensor query_start_loc, double scale) {
    const int64_t M = residual.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_n = q_size + 2 * kv_size;
    const auto opts = residual.options();
    at::Tensor x = at::zeros({M, hidden_}, opts);  // layer 0 adds zero to the residual
    at::Tensor o = at::empty({M, hidden_}, opts);
    at::Tensor qkv = at::empty({M, qkv_n}, opts);
    at::Tensor attn = at::empty({M, q_size}, opts);
    at::Tensor gate_up = at::empty({M, 2 * intermediate_}, opts);
    at::Tensor act = at::empty({M, intermediate_}, opts);
    const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
    const int64_t* slot = slots.data_ptr<int64_t>();
    cache_t* cache = kv_cache.data_ptr<cache_t>();
    // The caller's plan has checked these; checked again here because a write or read
    // outside the cache would corrupt memory (a few integer compares a step).
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int64_t max_blocks = block_tables.size(1), S = seq_lens.numel();
    const int32_t* qsl = query_start_loc.defined() ? query_start_loc.data_ptr<int32_t>() : nullptr;
    for (int64_t t = 0; t < M; ++t)
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block_size, "forward: slot ", slot[t],
                  " outside the cache of ", num_blocks * block_size, " slots");
    TORCH_CHECK(qsl == nullptr || (qsl[0] == 0 && qsl[S] == M),
                "forward: query_start_loc must run from 0 to M");
    // Decode rows (one token) go to the decode kernel, the rest to the prefill kernel; a
    // decode step (every sequence one token, rows in order) passes its tables as they are.
    std::vector<int32_t> dec_bt, dec_lens, dec_rows, pre_seqs;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q_len = qsl != nullptr ? qsl[s + 1] - qsl[s] : 1;
      TORCH_CHECK(q_len >= 1 && lens[s] >= q_len && lens[s] <= max_blocks * block_size,
                  "forward: sequence ", s, " has seq_len ", lens[s], " outside [", q_len, ", ",
                  max_blocks * block_size, "] for its ", q_len, " new tokens");
      for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
        TORCH_CHECK(bt[s * max_blocks + b] >= 0 && bt[s * max_blocks + b] < num_blocks,
                    "forward: block id ", bt[s * max_blocks + b], " outside [0, ", num_blocks, ")");
      if (q_len > 1) {
        pre_seqs.push_back(static_cast<int32_t>(s));
      } else if (qsl != nullptr) {
        dec_bt.insert(dec_bt.end(), bt + s * max_blocks, bt + (s + 1) * max_blocks);
        dec_lens.push_back(lens[s]);
        dec_rows.push_back(qsl[s]);
      }
    }
    const bool all_decodes = qsl == nullptr || (pre_seqs.empty() && S == M);

    DecodeAttention<float, cache_t> a;
    a.q = qkv.data_ptr<float>();
    a.qs = qkv_n;
    a.qh = head_dim_;
    a.kb = a.vb = kv_cache.stride(2);
    a.kt = a.vt = kv_cache.stride(3);
    a.kh = a.vh = kv_cache.stride(4);
    a.out = attn.data_ptr<float>();
    a.os = q_size;
    a.oh = head_dim_;
    a.block_tables = all_decodes ? bt : dec_bt.data();
    a.max_blocks = max_blocks;
    a.seq_lens = all_decodes ? lens : dec_lens.data();
    a.rows = all_decodes ? nullptr : dec_rows.data();
    a.num_seqs = all_decodes ? S : static_cast<int64_t>(dec_lens.size());
    a.num_heads = num_heads_;
    a.num_kv_heads = num_kv_heads_;
    a.head_dim = head_dim_;
    a.block_size = block_size;
    a.scale = static_cast<float>(scale);
    a.softcap = softcap_;

    PrefillAttention<cache_t> p;
    p.q = a.q;
    p.qs = a.qs;
    p.qh = a.qh;
    p.kb = p.vb = a.kb;
    p.kt = p.vt = a.kt;
    p.kh = p.vh = a.kh;
    p.out = a.out;
    p.os = a.os;
    p.oh = a.oh;
    p.block_tables = bt;
    p.max_blocks = max_blocks;
    p.seq_lens = lens;
    p.query_start = qsl;
    p.seqs = pre_seqs.data();
    p.num_run = static_cast<int64_t>(pre_seqs.size());
    p.num_heads = num_heads_;
    p.num_kv_heads = num_kv_heads_;
    p.head_dim = head_dim_;
    p.block_size = block_size;
    p.scale = a.scale;
    p.softcap = softcap_;

    OpClock clock(profile_ ? &op_seconds_ : nullptr);
    for (int64_t i = 0; i < num_layers_; ++i) {
      const Layer& l = layers_[i];
      fused_add_rms_norm_impl<float>(x, residual, l.input_layernorm, eps_);
      clock.lap(kOpOther);
      project(qkv, x, l.qkv_proj, l.qkv_bias);
      clock.lap(kOpQkv);
      float* qkv_ptr = qkv.data_ptr<float>();
      if (l.q_norm.defined()) {  // Q heads, then K heads, each over head_dim
        rms_norm_heads_f32(qkv_ptr, M, qkv_n, num_heads_, head_dim_, l.q_norm.data_ptr<float>(),
                           eps_);
        rms_norm_heads_f32(qkv_ptr + q_size, M, qkv_n, num_kv_heads_, head_dim_,
                           l.k_norm.data_ptr<float>(), eps_);
      }
      const int64_t table = l.rope_table * M * head_dim_;
      rope_rotate_half(qkv_ptr, M, qkv_n, num_heads_ + num_kv_heads_, head_dim_,
                       cos.data_ptr<float>() + table, sin.data_ptr<float>() + table, head_dim_);
      cache_t* key_cache = cache + i * kv_cache.stride(0);
      cache_t* value_cache = key_cache + kv_cache.stride(1);
      for (int64_t t = 0; t < M; ++t) {  // reshape_and_cache
        const int64_t off = (slot[t] / block_size) * a.kb + (slot[t] % block_size) * a.kt;
        for (int64_t h = 0; h < num_kv_heads_; ++h) {
          const float* k = qkv_ptr + t * qkv_n + q_size + h * head_dim_;
          store_row(k, key_cache + off + h * a.kh, head_dim_);
          store_row(k + kv_size, value_cache + off + h * a.kh, head_dim_);
        }
      }
      a.k = p.k = key_cache;
      a.v = p.v = value_cache;
      a.window = p.window = l.sliding_window;
      if (a.num_seqs > 0) decode_attention_run(a);
      if (p.num_run > 0) prefill_attention_run(p);
      clock.lap(kOpAttention);
      project(o, attn, l.o_proj, at::Tensor());
      clock.lap(kOpO);
      if (l.pre_feedforward_layernorm.defined()) {  // Gemma: norm the output, then add
        rms_norm_heads_f32(o.data_ptr<float>(), M, hidden_, 1, hidden_,
                           l.post_attention_layernorm.data_ptr<float>(), eps_);
        fused_add_rms_norm_impl<float>(o, residual, l.pre_feedforward_layernorm, eps_);
      } else {
        fused_add_rms_norm_impl<float>(o, residual, l.post_attention_layernorm, eps_);
      }
      clock.lap(kOpOther);
      project(gate_up, o, l.gate_up_proj, at::Tensor());
      clock.lap(kOpGateUp);
      if (activation_ == GatedActivation::kGeluTanh)
        gelu_tanh_and_mul_f32(act.data_ptr<float>(), gate_up.data_ptr<float>(), M, intermediate_);
      else
        silu_and_mul_impl<float>(act, gate_up);
      clock.lap(kOpOther);
      project(x, act, l.down_proj, at::Tensor());
      clock.lap(kOpDown);
      if (l.post_feedforward_layernorm.defined())
        rms_norm_heads_f32(x.data_ptr<float>(), M, hidden_, 1, hidden_,
                           l.post_feedforward_layernorm.data_ptr<float>(), eps_);
    }
    fused_add_rms_norm_impl<float>(x, residual, final_norm_, eps_);
    clock.lap(kOpOther);
    return x;
  }

  // y[M, N] = x[M, K] @ w^T (+ bias), y and x contiguous.
  void project(at::Tensor& y, const at::Tensor& x, const QuantLinear& w,
               const at::Tensor& bias) const {
    if (w.dense()) {
      linear_into(y, x, w.tensors[0], bias);
      return;
    }
    const float* b = bias.defined() && bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
    quant_linear_into(y.data_ptr<float>(), y.size(1), x.data_ptr<float>(), x.size(1),
                                 x.size(0), w, b, isa_);
  }

  enum Op { kOpQkv, kOpAttention, kOpO, kOpGateUp, kOpDown, kOpOther, kNumOps };

  // Adds the calling thread's CPU time since the last lap to an op's total (no-op without
  // a sink): steady on a shared machine, and the whole cost when it runs one thread.
  class OpClock {
   public:
    explicit OpClock(std::array<double, kNumOps>* sink) : sink_(sink), last_(now()) {}
    void lap(Op op) {
      if (sink_ == nullptr) return;
      const double t = now();
      (*sink_)[op] += t - last_;
      last_ = t;
    }

   private:
    static double now() {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
    }
    std::array<double, kNumOps>* sink_;
    double last_;
  };

  struct Layer {
    at::Tensor input_layernorm, post_attention_layernorm, qkv_bias;
    QuantLinear qkv_proj, o_proj, gate_up_proj, down_proj;
    at::Tensor q_norm, k_norm, pre_feedforward_layernorm, post_feedforward_layernorm;
    int64_t sliding_window = 0, rope_table = 0;
  };

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  int64_t num_layers_, num_heads_, num_kv_heads_, head_dim_, hidden_, intermediate_;
  int64_t num_tables_ = 1;  // 1 + the largest rope_table
  double eps_;
  GatedActivation activation_;
  float softcap_;
  Isa isa_;
  bool profile_ = false;
  std::array<double, kNumOps> op_seconds_{};
};

}  // namespace aioengine
