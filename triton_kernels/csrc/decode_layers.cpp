// LlamaDecodeLayers' constructor: the named weights checked and described (decode_layers.h).

#include "decode_layers.h"

namespace aioengine {
namespace {

void check_vector(const at::Tensor& t, int64_t n, const char* name, int64_t layer) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_cuda() &&
                  t.numel() == n,
              "LlamaDecodeLayers: layer ", layer, " ", name, " must be contiguous fp32 [", n,
              "] on the CPU, got ", t.sizes());
}

QuantLinear make_projection(const Projection& p, int64_t cols) {
  QuantLinear w = make_quant_linear(p.parts, p.qtypes, cols);
  if (w.dense())
    TORCH_CHECK(p.parts[0].is_contiguous(), "LlamaDecodeLayers: a dense projection must be "
                "contiguous");
  return w;
}

}  // namespace

// Whether an optional weight is given (an empty or undefined tensor is not).
bool given(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

GatedActivation parse_activation(const std::string& name) {
  if (name == "silu") return GatedActivation::kSilu;
  if (name == "gelu_tanh") return GatedActivation::kGeluTanh;
  TORCH_CHECK(false, "LlamaDecodeLayers: activation must be \"silu\" or \"gelu_tanh\", got \"",
              name, "\"");
}

LlamaDecodeLayers::LlamaDecodeLayers(const std::vector<DecoderLayerWeights>& layers,
                                     at::Tensor final_norm, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim, double eps,
                                     const std::string& activation, double attn_logit_softcap)
    : final_norm_(std::move(final_norm)), num_layers_(static_cast<int64_t>(layers.size())),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
      activation_(parse_activation(activation)),
      softcap_(static_cast<float>(attn_logit_softcap)), isa_(resolve_isa(-1)) {
  TORCH_CHECK(!layers.empty(), "LlamaDecodeLayers: at least one layer expected");
  TORCH_CHECK(attn_logit_softcap >= 0.0, "LlamaDecodeLayers: attn_logit_softcap must be >= 0");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                  head_dim > 0 && head_dim % 2 == 0, "LlamaDecodeLayers: bad head counts");
  TORCH_CHECK(final_norm_.scalar_type() == at::kFloat && final_norm_.is_contiguous() &&
                  !final_norm_.is_cuda() && final_norm_.dim() == 1,
              "LlamaDecodeLayers: final_norm must be contiguous fp32 [hidden] on the CPU");
  hidden_ = final_norm_.numel();
  const int64_t qkv = (num_heads + 2 * num_kv_heads) * head_dim;
  for (int64_t i = 0; i < num_layers_; ++i) {
    const DecoderLayerWeights& w = layers[i];
    check_vector(w.input_layernorm, hidden_, "input_layernorm", i);
    check_vector(w.post_attention_layernorm, hidden_, "post_attention_layernorm", i);
    if (w.qkv_bias.defined() && w.qkv_bias.numel() > 0) check_vector(w.qkv_bias, qkv, "qkv_bias", i);
    Layer l{w.input_layernorm, w.post_attention_layernorm, w.qkv_bias,
            make_projection(w.qkv_proj, hidden_), make_projection(w.o_proj, num_heads * head_dim),
            make_projection(w.gate_up_proj, hidden_), QuantLinear()};
    TORCH_CHECK(given(w.q_norm) == given(w.k_norm) &&
                    given(w.pre_feedforward_layernorm) == given(w.post_feedforward_layernorm),
                "LlamaDecodeLayers: layer ", i, " has q_norm without k_norm or one of the "
                "feed-forward norms without the other");
    if (given(w.q_norm)) {
      check_vector(w.q_norm, head_dim, "q_norm", i);
      check_vector(w.k_norm, head_dim, "k_norm", i);
      l.q_norm = w.q_norm;
      l.k_norm = w.k_norm;
    }
    if (given(w.pre_feedforward_layernorm)) {
      check_vector(w.pre_feedforward_layernorm, hidden_, "pre_feedforward_layernorm", i);
      check_vector(w.post_feedforward_layernorm, hidden_, "post_feedforward_layernorm", i);
      l.pre_feedforward_layernorm = w.pre_feedforward_layernorm;
      l.post_feedforward_layernorm = w.post_feedforward_layernorm;
    }
    TORCH_CHECK(w.sliding_window >= 0 && w.rope_table >= 0, "LlamaDecodeLayers: layer ", i,
                " has a negative sliding_window or rope_table");
    l.sliding_window = w.sliding_window;
    l.rope_table = w.rope_table;
    num_tables_ = std::max(num_tables_, w.rope_table + 1);
    l.down_proj = make_projection(w.down_proj, l.gate_up_proj.rows / 2);
    if (i == 0) intermediate_ = l.down_proj.cols;
    TORCH_CHECK(l.qkv_proj.rows == qkv && l.o_proj.rows == hidden_ &&
                    l.gate_up_proj.rows == 2 * intermediate_ && l.down_proj.rows == hidden_ &&
                    l.down_proj.cols == intermediate_,
                "LlamaDecodeLayers: layer ", i, " has unexpected weight shapes");
    layers_.push_back(std::move(l));
  }
}

}  // namespace aioengine
