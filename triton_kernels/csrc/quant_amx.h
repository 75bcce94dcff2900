// AMX-BF16 tiles for the quantized GEMM at batch sizes (quant_ops.cpp, 9+ rows of x).
//
// Intel AMX (Sapphire Rapids and later) multiplies 16x32 bf16 tiles into 16x16 fp32
// tiles (TDPBF16PS, 16 x 16 x 32 multiply-adds an instruction), about 16 times the fp32
// FMA rate of AVX-512 on one core. The quantized GEMM dequantizes each 16-row tile of
// the weight to fp32 once per call anyway; here those rows become bf16 tiles and the
// products run on AMX. The weight tile is the A operand (16 weight rows x 32 values of
// K, row-major as dequantized) and x, packed once per call in AMX's pair-interleaved B
// layout, the B operand, so no weight transpose is needed; C is y^T for 16 weight rows x
// 16 rows of x.
//
// Precision: every fp32 value v is split into bf16 hi = bf16(v) and lo = bf16(v - hi)
// (Henry, Tang and Heinecke, "Leveraging the bfloat16 Artificial Intelligence Datatype
// For Higher-Precision Computations", ARITH 2019). Precision::kBf16x3 sums
// hi*hi + hi*lo + lo*hi: each product has about 16 significant bits (relative error
// below 2^-15), fp32-grade for a dot product of a few thousand terms and well inside
// the fp32 reference's tolerance; Precision::kBf16 (the default, quant_ops.h's
// set_bf16_gemm) takes hi*hi only (relative error of a product up to about 2^-8, the
// error of bf16 weights and activations), 1.5-2.5x faster.

#pragma once

#include <cstdint>
#include <vector>

namespace aioengine {
namespace amx {

enum class Precision : int { kBf16x3 = 0, kBf16 = 1 };

// Whether the build has AMX-BF16 code and this CPU and OS can run it: CPUID says AMX-TILE
// and AMX-BF16, and Linux granted this process the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA; asked once per process, cached).
bool available();

// x [M, K] in AMX's B layout: per 16-row group of x and 32-column chunk of K, a 1 KiB
// tile of 16 pair rows (k = 2j, 2j + 1) x 16 rows of x x 2 bf16; zeros past M and K.
struct PackedActivations {
  int64_t rows = 0, cols = 0, row_tiles = 0, k_chunks = 0;
  Precision precision = Precision::kBf16x3;
  std::vector<uint16_t> hi, lo;  // lo is empty for kBf16
};

// Packs x (rows ldx floats apart) for gemm_tile. Requires available().
void pack_activations(const float* x, int64_t ldx, int64_t M, int64_t K, Precision precision,
                      PackedActivations* packed);

// Loads this thread's tile configuration; call before gemm_tile in each thread (another
// library may have left a different one) and tile_release() after.
void tile_begin();
void tile_release();

// Weight rows gemm_tile takes at a time (two A tiles).
constexpr int64_t kWeightRows = 32;

// The A operand of gemm_tile: up to kWeightRows weight rows as bf16 hi (and lo, for
// kBf16x3) tiles, per 32-column chunk of K 32 rows x 32 values (rows 0-15 the first
// tile, 16-31 the second), zeros past the rows and K; chunks * 1024 values each.
inline int64_t weight_tile_elems(int64_t K) { return (K + 31) / 32 * kWeightRows * 32; }

// Fills hi (and lo when x3) from `rows` fp32 rows of K values, ldw floats apart (the
// dequantized weights; quant_ops.cpp decodes the 32-value formats into them directly).
void pack_weight_rows(const float* w, int64_t ldw, int64_t rows, int64_t K, bool x3,
                      uint16_t* hi, uint16_t* lo);

// Fills chunk kc (32 values of K) of the A tiles of gemm_tile (hi, and lo when given) for
// all kWeightRows rows, from the caller's weight tile (ctx): gemm_tile calls it for chunk
// kc + 2 right after issuing chunk kc's tile products, so the AMX unit multiplies while
// the core decodes (the rows of a 32-value format are decoded in registers, quant_ops.cpp)
// and the tile loads find their chunk's stores done. The decoder may also ask for a later
// tile's weight bytes there (quant_ops.cpp spreads its prefetches over the chunks).
struct ChunkDecoder {
  void (*decode)(const void* ctx, int64_t kc, uint16_t* hi, uint16_t* lo) = nullptr;
  const void* ctx = nullptr;
};

// The running argmax of y's rows (the fused greedy LM head): per row m of x, the largest
// value seen so far and its weight row; a later row replaces it only if strictly larger
// (or the first NaN, as torch.max treats NaN as the largest), so ties keep the lowest
// index when rows arrive in increasing order. Arrays of x.row_tiles * 16 entries.
struct RowArgmax {
  float* value = nullptr;
  int64_t* index = nullptr;
};

// y[m * ldy + r] = dot(x[m], w[r]) (+ bias[r]) for m < x.rows, r < rows (<= kWeightRows),
// w given as A tiles (a_lo only read for kBf16x3). With `decoder`, the A tiles are filled
// chunk by chunk here (a_hi/a_lo are then its output buffers, weight_tile_elems(K) values
// each; with up to 32 rows of x only their first 4 chunks are used, as a ring). With `argmax`, y is not
// written: argmax is updated with weight rows n0 + r instead (same sums, bit for bit).
void gemm_tile(uint16_t* a_hi, uint16_t* a_lo, int64_t rows, const PackedActivations& x,
               float* y, int64_t ldy, const float* bias, const ChunkDecoder* decoder = nullptr,
               int64_t n0 = 0, const RowArgmax* argmax = nullptr);

}  // namespace amx
}  // namespace aioengine
