// Python bindings of the CPU kernels for aioengine's decode hot path, built on first use by
// triton_kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native).
//
// - paged_attention_decode: one new query token per sequence attends to its
//   paged K/V, read in place through the block table (PagedAttention, Kwon et
//   al. 2023, section 4.1): no gather copy. Each K and V row is read once for
//   the whole query-head group (GQA, Ainslie et al. 2023). Scores, softmax and
//   the weighted sum in fp32; a blocked AVX-512 kernel where it applies,
//   portable=True forces the portable one (attention.h).
// - paged_attention_prefill: query chunks of several tokens per sequence (chunked
//   prefill) over the cached prefix and the chunk, causal, sliding window and soft-cap
//   where given; flash-attention's online softmax over spans of keys (attention.h).
// - reshape_and_cache: this step's fp32 K/V rows into their cache slots, rounded to the
//   cache's dtype (fp8 E4M3/E5M2: to nearest even, saturating; cache_write.cpp, fp8.h).
// - fused_add_rms_norm: residual += x; x = rms_norm(residual) * weight, in
//   place (vLLM's fused_add_rms_norm; RMSNorm, Zhang & Sennrich 2019).
// - silu_and_mul: out = silu(x[:, :d]) * x[:, d:] (SwiGLU, Shazeer 2020).
// - linear (fp32): y = x @ w^T (+ bias); a skinny kernel up to 16 rows of x, MKL's
//   GEMM above.
// - quant_dequantize / quant_linear / quant_embedding: GGML block formats read in
//   place (quant_ops.h, quant_ops.cpp); quant_linear_argmax: the greedy LM head, the
//   argmax of each row of quant_linear's output without writing it; quant_amx_pack /
//   quant_linear_packed: the LM head's weight decoded once into AMX bf16 tiles; the GEMM (9+ rows) on AMX-BF16 tiles where the
//   CPU has them (quant_amx.h; set_amx, set_bf16_gemm).
// - LlamaDecodeLayers (fp32 activations): a decoder-layer stack for one decode step in
//   one call, built from the kernels above; each projection is dense fp32 or quantized
//   (any mix of parts). Llama's block, and the twists of Qwen3 (Q/K norms) and Gemma
//   2/3 (sandwich norms, GeGLU, Q/K norms, sliding windows, per-layer RoPE tables,
//   soft-capping) as per-layer options (decode_layers.h); steps that mix decode rows
//   and prompt chunks too (query_start_loc).
// - sample_from_logits: one token per row by temperature, min-p, top-k, top-p and inverse
//   transform sampling with a given uniform, no sort of the vocabulary (sampling.h).
//
// The first three take fp32, bf16 or fp16 tensors and accumulate in fp32.
// Shapes and dtypes are checked in Python (triton_kernels/cpu_ops.py) and again
// here with TORCH_CHECK, which surfaces as RuntimeError.
//
// One file per kernel: attention.{h,cpp}, norm_act.{h,cpp}, linear.{h,cpp},
// decode_layers.{h,cpp}, quant_ops.{h,cpp}, quant_amx.{h,cpp}, sampling.{h,cpp},
// copy_blocks.cpp, cache_write.cpp; shared SIMD helpers in simd.h, fp8 conversions in fp8.h. Every .cpp of csrc/ is compiled (cpu_ops.py
// globs them).

#include <torch/extension.h>

#include "attention.h"
#include "decode_layers.h"
#include "linear.h"
#include "norm_act.h"
#include "quant_ops.h"
#include "sampling.h"

void copy_blocks(at::Tensor kv_cache, const at::Tensor& block_mapping);  // copy_blocks.cpp
namespace aioengine {
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping);  // cache_write.cpp
}  // namespace aioengine

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel releases the GIL, as torch's own ops do: an in-process engine runs steps
  // in a thread beside its event loop.
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_attention_decode", &aioengine::paged_attention_decode, pybind11::arg("out"),
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("portable") = false, pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, release());
  m.def("paged_attention_prefill", &aioengine::paged_attention_prefill, pybind11::arg("out"),
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("query_start_loc"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("portable") = false, release());
  m.def("set_bf16_attention", &aioengine::set_bf16_attention, pybind11::arg("on"),
        "The AMX prefill attention tiles in plain bf16 (True) or fp32-grade hi + lo (False, "
        "the default); returns the previous setting.");
  m.def("bf16_attention", &aioengine::bf16_attention);
  m.def("fused_add_rms_norm", &aioengine::fused_add_rms_norm, release());
  m.def("silu_and_mul", &aioengine::silu_and_mul, release());
  m.def("reshape_and_cache", &aioengine::reshape_and_cache, pybind11::arg("key"),
        pybind11::arg("value"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("slot_mapping"), release(),
        "fp32 K/V rows into their cache slots, rounded to the cache's dtype (fp8: to nearest "
        "even, saturating); -1 skips a token.");
  m.def("copy_blocks", &copy_blocks, pybind11::arg("kv_cache"), pybind11::arg("block_mapping"),
        release());
  m.def("linear", &aioengine::linear, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias") = pybind11::none(), release());
  m.def("quant_dequantize", &aioengine::quant_dequantize, pybind11::arg("data"),
        pybind11::arg("qtype"), pybind11::arg("cols"), pybind11::arg("isa") = -1, release());
  m.def("quant_linear", &aioengine::quant_linear, pybind11::arg("x"), pybind11::arg("parts"),
        pybind11::arg("qtypes"), pybind11::arg("cols"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = -1, release());
  m.def("quant_linear_argmax", &aioengine::quant_linear_argmax, pybind11::arg("x"),
        pybind11::arg("parts"), pybind11::arg("qtypes"), pybind11::arg("cols"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = -1, release());
  m.def("quant_amx_pack", &aioengine::quant_amx_pack, pybind11::arg("data"),
        pybind11::arg("qtype"), pybind11::arg("cols"), release());
  m.def("quant_linear_packed", &aioengine::quant_linear_packed, pybind11::arg("x"),
        pybind11::arg("data"), pybind11::arg("qtype"), pybind11::arg("cols"),
        pybind11::arg("amx_tiles"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("argmax") = false, pybind11::arg("isa") = -1, release());
  m.def("quant_embedding", &aioengine::quant_embedding, pybind11::arg("ids"),
        pybind11::arg("data"), pybind11::arg("qtype"), pybind11::arg("cols"),
        pybind11::arg("isa") = -1, release());
  m.def("set_q8_activations", &aioengine::set_q8_activations, pybind11::arg("on"),
        "int8 activations for the quantized GEMV (VNNI builds); False if the build has none.");
  m.def("q8_activations", &aioengine::q8_activations);
  m.def("set_bf16_gemm", &aioengine::set_bf16_gemm, pybind11::arg("on"),
        "The AMX GEMM in bf16 (True, the default) or bf16 hi + lo, fp32-grade (False).");
  m.def("bf16_gemm", &aioengine::bf16_gemm);
  m.def("set_amx_table_decode", &aioengine::set_amx_table_decode, pybind11::arg("on"),
        "AMX A tiles of the 32-value formats from per-block bf16 tables (True, the default) "
        "or via fp32 (False; the same tiles); returns the previous setting.");
  m.def("set_amx", &aioengine::set_amx, pybind11::arg("on"),
        "Let the best path be AMX (where the CPU has it); returns whether it now is.");
  m.def("quant_isa", [] { return static_cast<int>(aioengine::resolve_isa(-1)); },
        "The instruction-set path the quantized kernels use: 0 scalar, 1 AVX2, 2 AVX-512, "
        "3 AVX-512 with AMX-BF16 for the GEMM.");
  m.def("sample_from_logits", &aioengine::sample_from_logits, pybind11::arg("logits"),
        pybind11::arg("rows"), pybind11::arg("temperature"), pybind11::arg("top_k"),
        pybind11::arg("top_p"), pybind11::arg("min_p"), pybind11::arg("uniforms"), release());
  namespace py = pybind11;
  using aioengine::DecoderLayerWeights;
  using aioengine::Projection;
  py::class_<Projection>(m, "Projection")
      .def(py::init([](std::vector<at::Tensor> parts, std::vector<int64_t> qtypes) {
             return Projection{std::move(parts), std::move(qtypes)};
           }), py::arg("parts"), py::arg("qtypes"))
      .def_readonly("parts", &Projection::parts)
      .def_readonly("qtypes", &Projection::qtypes);
  py::class_<DecoderLayerWeights>(m, "DecoderLayerWeights")
      .def(py::init([](at::Tensor input_layernorm, at::Tensor post_attention_layernorm,
                       c10::optional<at::Tensor> qkv_bias, Projection qkv_proj, Projection o_proj,
                       Projection gate_up_proj, Projection down_proj,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                       c10::optional<at::Tensor> pre_feedforward_layernorm,
                       c10::optional<at::Tensor> post_feedforward_layernorm,
                       int64_t sliding_window, int64_t rope_table) {
             auto opt = [](c10::optional<at::Tensor>& t) {
               return t.has_value() ? *t : at::Tensor();
             };
             DecoderLayerWeights w{std::move(input_layernorm),
                                   std::move(post_attention_layernorm), opt(qkv_bias),
                                   std::move(qkv_proj), std::move(o_proj),
                                   std::move(gate_up_proj), std::move(down_proj)};
             w.q_norm = opt(q_norm);
             w.k_norm = opt(k_norm);
             w.pre_feedforward_layernorm = opt(pre_feedforward_layernorm);
             w.post_feedforward_layernorm = opt(post_feedforward_layernorm);
             w.sliding_window = sliding_window;
             w.rope_table = rope_table;
             return w;
           }), py::kw_only(), py::arg("input_layernorm"), py::arg("post_attention_layernorm"),
           py::arg("qkv_bias"), py::arg("qkv_proj"), py::arg("o_proj"), py::arg("gate_up_proj"),
           py::arg("down_proj"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("pre_feedforward_layernorm") = py::none(),
           py::arg("post_feedforward_layernorm") = py::none(), py::arg("sliding_window") = 0,
           py::arg("rope_table") = 0);
  py::class_<aioengine::LlamaDecodeLayers>(m, "LlamaDecodeLayers")
      .def(py::init<const std::vector<DecoderLayerWeights>&, at::Tensor, int64_t, int64_t,
                    int64_t, double, const std::string&, double>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("activation") = "silu", py::arg("attn_logit_softcap") = 0.0)
      .def("forward", &aioengine::LlamaDecodeLayers::forward, py::arg("residual"),
           py::arg("cos"), py::arg("sin"), py::arg("kv_cache"), py::arg("slots"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
           py::arg("query_start_loc") = py::none(), release())
      .def("set_profile", &aioengine::LlamaDecodeLayers::set_profile, py::arg("on"),
           "Time forward()'s ops (the calling thread's CPU time: run one thread) from now "
           "on, totals reset; off by default.")
      .def("op_seconds", &aioengine::LlamaDecodeLayers::op_seconds,
           "Seconds per op summed over forward() calls since set_profile(True).")
      .def_static("op_names", &aioengine::LlamaDecodeLayers::op_names);
}
