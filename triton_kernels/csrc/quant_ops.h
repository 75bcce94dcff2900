// Quantized-weight kernels for CPU: GGML block formats (GGUF) read in place.
//
// A weight is a list of parts whose outputs sit side by side (fused QKV whose Q, K and V
// are stored in different formats, say). Each part is `rows` rows of `cols` values in one
// format, rows `row_stride` bytes apart, each row `cols / block_size` blocks of the
// layouts of llama.cpp's ggml/src/ggml-common.h (block_q8_0, block_q4_0, block_q4_1,
// block_q5_0, block_q5_1, block_q4_K, block_q5_K, block_q6_K), or plain F32/F16/BF16
// values. The bytes are only read: they may be a read-only mapping of the GGUF file.
//
// Every kernel has three instruction-set paths compiled side by side (AVX-512, AVX2+FMA+
// F16C, portable scalar), chosen at run time: the best the build has by default, or a
// lower one on request so the tests can check all of them on one machine.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace aioengine {

// gguf.GGMLQuantizationType values.
enum QType : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

// kAmx: the AVX-512 kernels, and AMX-BF16 tiles for the GEMM (quant_amx.h).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// The best path this build and CPU have; `requested` < 0 means the best, otherwise it is
// lowered to what they have (asking for AVX-512 on an AVX2 build gives AVX2; AMX needs
// an AVX-512 build with AMX-BF16 code, the CPU's AMX-BF16 and the OS's tile permission).
Isa resolve_isa(int64_t requested);

// Values per block and bytes per block of a format; TORCH_CHECK-fails on an unknown one.
int64_t block_size(int qtype);
int64_t type_size(int qtype);

struct WeightPart {
  const uint8_t* data;
  int64_t row_stride;  // bytes between rows
  int qtype;
  int64_t rows;
  // The part decoded once into the bf16 A tiles of the AMX GEMM (quant_amx_pack), or
  // nullptr: Isa::kAmx in bf16 (set_bf16_gemm(true)) then loads them instead of decoding.
  const uint16_t* amx_tiles = nullptr;
};

// A linear layer's weight [rows, cols] (out_features, in_features) as parts stacked by
// rows. Holds references to the tensors so the bytes outlive the caller's.
struct QuantLinear {
  std::vector<WeightPart> parts;
  std::vector<at::Tensor> tensors;
  int64_t rows = 0, cols = 0;

  // The weight is one dense fp32 part (the fp32 kernels of linear.cpp take it).
  bool dense() const { return parts.size() == 1 && parts[0].qtype == kF32; }
};

// From tensors: a quantized part is uint8 [rows, row_bytes] (row stride free, bytes
// contiguous within a row); an F32 part is fp32 [rows, cols]. Checks every shape.
QuantLinear make_quant_linear(const std::vector<at::Tensor>& parts,
                              const std::vector<int64_t>& qtypes, int64_t cols);

// y[m * ldy + n] = sum_k x[m * ldx + k] * w[n, k] (+ bias[n]) for m < M, n < w.rows.
// M <= 8 (GEMV, bound by decoding the weight): tiles of 4 weight rows dotted with 4 rows
// of x at a time; on AVX-512 the 32-value formats (Q8_0, Q4_0/1, Q5_0/1) are decoded in
// registers, the others into an L1 buffer first. M > 8 (GEMM): tiles of 16 rows are
// dequantized into a thread-local buffer, so each weight byte is dequantized once per
// call whatever M is, and multiplied by a register-blocked 4x4 fp32 micro-kernel, or on
// Isa::kAmx by AMX-BF16 tiles (quant_amx.h; precision as set_bf16_gemm says; the 32-value
// formats decoded one chunk of K at a time while the AMX unit multiplies the previous
// one, 1.3-1.6x the decode-then-multiply order at 16-64 rows, bit for bit the same).
// Threads split the tiles (at::parallel_for).
void quant_linear_into(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M,
                       const QuantLinear& w, const float* bias, Isa isa);

// out[m] = argmax_n (x[m] . w[n] (+ bias[n])) for m < M, the first index among equal maxima
// (NaN counts as the largest, as in torch.argmax): the fused greedy LM head. The same tiles
// and sums as quant_linear_into, so out equals the argmax of its y bit for bit, but y is
// never written: each thread keeps a running argmax over its tiles (on AMX taken from the
// C tiles, no transpose), merged at the end.
void quant_linear_argmax_into(int64_t* out, const float* x, int64_t ldx, int64_t M,
                              const QuantLinear& w, const float* bias, Isa isa);

// int8 activations for the GEMV (M <= 8) of Q4_0, Q4_1 and Q8_0 weights on AVX-512 VNNI:
// each 32-block of x quantized to int8 with one scale, integer dot products (llama.cpp's
// q8 activations). Off by default; returns false (and stays off) on a build without VNNI.
bool set_q8_activations(bool on);
bool q8_activations();

// Whether the GEMM may run on AMX (default true), from the next call on, wherever it is
// called from (LlamaDecodeLayers too; resolve_isa still says kAmx): off, Isa::kAmx runs
// the AVX-512 path exactly. Returns whether the GEMM now runs on AMX.
bool set_amx(bool on);
bool amx_allowed();

// The AMX GEMM's precision: true (the default) takes bf16 x and weights; false splits
// both into bf16 hi + lo and sums three products (fp32-grade, from 17 rows), slower.
void set_bf16_gemm(bool on);
bool bf16_gemm();

// Which decoder fills the AMX A tiles of the 32-value formats in plain bf16: true (the
// default) a 32-entry bf16 table of each block's values picked by vpermw, false the
// fp32 values rounded to bf16 (the reference; same tiles bit for bit). Returns the
// previous setting (false where the build has no table decoder).
bool set_amx_table_decode(bool on);

// Tensor entry points (bound in bindings.cpp); `isa` as in resolve_isa.
at::Tensor quant_dequantize(at::Tensor data, int64_t qtype, int64_t cols, int64_t isa);
at::Tensor quant_linear(at::Tensor x, std::vector<at::Tensor> parts,
                        std::vector<int64_t> qtypes, int64_t cols,
                        c10::optional<at::Tensor> bias, int64_t isa);
// [M] int64: quant_linear_argmax_into over x [M, cols].
at::Tensor quant_linear_argmax(at::Tensor x, std::vector<at::Tensor> parts,
                               std::vector<int64_t> qtypes, int64_t cols,
                               c10::optional<at::Tensor> bias, int64_t isa);
// A 32-value-format weight (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) of `cols` columns decoded once
// into the A tiles the AMX GEMM loads (quant_amx.h, gemm_tile): int16 (bf16 bits)
// [ceil(rows / amx::kWeightRows), ceil(cols / 32), amx::kWeightRows, 32], per 32 weight
// rows and 32-value chunk of K the chunk's 32 rows x 32 values, zeros past the last row.
// The values are those the per-call decode produces in bf16 (bit for bit), so a GEMM on
// them gives the same y. 2 bytes a parameter (Q8_0: 1.06 bytes). Fails on another format
// or a build without AVX512-BF16.
at::Tensor quant_amx_pack(at::Tensor data, int64_t qtype, int64_t cols);
// quant_linear (argmax = false: y [M, rows] fp32) or quant_linear_argmax (argmax = true:
// [M] int64) of the one-part weight `data` whose quant_amx_pack is `amx_tiles`: where the
// AMX GEMM runs in bf16 (Isa::kAmx, set_amx and set_bf16_gemm on, M > 8) its weight tiles
// are loaded from amx_tiles with no decode; elsewhere (the GEMV, the fp32-grade hi + lo
// mode, AMX off) exactly quant_linear's path on `data`.
at::Tensor quant_linear_packed(at::Tensor x, at::Tensor data, int64_t qtype, int64_t cols,
                               at::Tensor amx_tiles, c10::optional<at::Tensor> bias,
                               bool argmax, int64_t isa);
at::Tensor quant_embedding(at::Tensor ids, at::Tensor data, int64_t qtype, int64_t cols,
                           int64_t isa);

}  // namespace aioengine
