// AMX-BF16 tiles for the quantized GEMM (quant_amx.h).

#include "quant_amx.h"

#include "simd.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__linux__)
#define AIOENGINE_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace aioengine {
namespace amx {

#if defined(AIOENGINE_HAVE_AMX)
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch/x86/include/uapi/asm/prctl.h
constexpr int kXfeatureXtiledata = 18;
constexpr int64_t kTile = 16;           // rows of a tile: weight rows (A, C) and x rows (B, C)
constexpr int64_t kChunk = 32;          // bf16 values of K in a tile row (64 bytes)
constexpr int64_t kTileElems = kTile * kChunk;  // bf16 values in a 1 KiB tile
// gemm_tile's decoder runs this many chunks of K ahead of the tile loads, into a ring of
// kRingChunks chunks (one pass over x); measured on the 32-row LM head (one core, the
// /tmp harness of bench/README.md): 2 ahead in a ring of 4 beat 1 in 2 and 2 in 3.
constexpr int64_t kDecodeAhead = 2;
constexpr int64_t kRingChunks = 4;

// Tile registers (literal numbers below: the intrinsics paste them into the assembly):
// tmm0/1 A, weight rows 0-15 and 16-31; tmm2/3 B, two groups of 16 rows of x; tmm4-7 C
// for the four pairs. The lo halves (kBf16x3) reuse tmm0-3.

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// bf16 hi (and lo) of n <= 32 values of src (zeros past n), 32 each.
inline void split32(const float* src, int64_t n, uint16_t* hi, uint16_t* lo) {
  const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
  const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  simd::bf16_split(_mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16), hi, lo);
}

}  // namespace

bool available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    const bool avx512_bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
    if (!amx_bf16 || !amx_tile || !avx512_bf16) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void pack_activations(const float* x, int64_t ldx, int64_t M, int64_t K, Precision precision,
                      PackedActivations* p) {
  TORCH_CHECK(available(), "amx: AMX-BF16 is not available on this CPU or OS");
  p->rows = M;
  p->cols = K;
  p->row_tiles = (M + kTile - 1) / kTile;
  p->k_chunks = (K + kChunk - 1) / kChunk;
  p->precision = precision;
  const int64_t n = p->row_tiles * p->k_chunks * kTileElems;
  const bool x3 = precision == Precision::kBf16x3;
  p->hi.assign(n, 0);
  p->lo.assign(x3 ? n : 0, 0);
  alignas(64) uint16_t hi[kChunk], lo[kChunk];
  // Pair j (values 2j, 2j + 1) of row m goes to the tile's row j, column m.
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(kTile));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kc = 0; kc < p->k_chunks; ++kc) {
      split32(x + m * ldx + kc * kChunk, K - kc * kChunk, hi, x3 ? lo : nullptr);
      const int64_t tile = ((m / kTile) * p->k_chunks + kc) * kTileElems;
      const __m512i index = _mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(m % kTile)));
      _mm512_i32scatter_epi32(p->hi.data() + tile, index, _mm512_load_si512(hi), 4);
      if (x3) _mm512_i32scatter_epi32(p->lo.data() + tile, index, _mm512_load_si512(lo), 4);
    }
}

// In static storage: GCC 12 drops stores to a local config before ldtilecfg as dead.
const TileConfig kConfig = [] {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.colsb[t] = 64;
  }
  return config;
}();

void tile_begin() { _tile_loadconfig(&kConfig); }

void tile_release() { _tile_release(); }

void pack_weight_rows(const float* w, int64_t ldw, int64_t rows, int64_t K, bool x3,
                      uint16_t* hi, uint16_t* lo) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  for (int64_t kc = 0; kc < chunks; ++kc)
    for (int64_t r = 0; r < kWeightRows; ++r) {
      uint16_t* h = hi + (kc * kWeightRows + r) * kChunk;
      uint16_t* l = x3 ? lo + (kc * kWeightRows + r) * kChunk : nullptr;
      if (r < rows) {
        split32(w + r * ldw + kc * kChunk, K - kc * kChunk, h, l);
      } else {
        std::memset(h, 0, 64);
        if (x3) std::memset(l, 0, 64);
      }
    }
}

void gemm_tile(uint16_t* a_hi, uint16_t* a_lo, int64_t rows, const PackedActivations& x,
               float* y, int64_t ldy, const float* bias, const ChunkDecoder* decoder, int64_t n0,
               const RowArgmax* argmax) {
  const int64_t chunks = x.k_chunks;
  const bool x3 = x.precision == Precision::kBf16x3;
  // Four accumulators, C[a][b] for A tile a and B tile b (tmm4 + 2a + b): a tile product
  // takes several times its issue interval to complete, so one accumulator would stall.
  alignas(64) float c[2][2][kTile][kTile];
  const int64_t a_tiles = rows > kTile ? 2 : 1;
  const int64_t stride = chunks * kTileElems;  // between B tiles of consecutive row groups
  const int64_t a_stride = 2 * kTileElems;      // between chunks of the A tiles
  // Where chunk kc's A tiles are. With one pass over x (up to 32 rows) a decoded chunk is
  // read once, so the decoder fills a ring of kRingChunks chunks: the ring (8 KiB) and
  // x's B tiles (36 KiB at K = 576) then stay in L1, where the whole A buffer beside them
  // (another 36 KiB) spilled the tile loads to L2 (one core, the tile products alone of
  // the 32-row LM head: 1.5 ms with the whole buffer, 0.9 ms with the ring). Several
  // passes read every chunk again, so they keep the whole buffer.
  const bool ring = decoder != nullptr && x.row_tiles <= 2;
  const auto a_at = [&](int64_t kc) { return (ring ? kc % kRingChunks : kc) * a_stride; };
  // Decoded kDecodeAhead chunks before their tile loads: a tile load waits for the vector
  // stores it reads to reach L1, so decoding the very next chunk made it wait for them.
  if (decoder != nullptr)
    for (int64_t kc = 0; kc < std::min(kDecodeAhead, chunks); ++kc)
      decoder->decode(decoder->ctx, kc, a_hi + a_at(kc), x3 ? a_lo + a_at(kc) : nullptr);
  for (int64_t mt = 0; mt < x.row_tiles; mt += 2) {
    const bool two = mt + 1 < x.row_tiles;
    const uint16_t* b0 = x.hi.data() + mt * stride;
    const uint16_t* l0 = x3 ? x.lo.data() + mt * stride : nullptr;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const int64_t off = kc * kTileElems, a_off = a_at(kc);
      _tile_loadd(0, a_hi + a_off, 64);
      _tile_loadd(1, a_hi + a_off + kTileElems, 64);
      _tile_loadd(2, b0 + off, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(6, 1, 2);
      if (two) {
        _tile_loadd(3, b0 + stride + off, 64);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(7, 1, 3);
      }
      if (x3) {
        _tile_loadd(2, l0 + off, 64);  // A hi x B lo
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(6, 1, 2);
        if (two) {
          _tile_loadd(3, l0 + stride + off, 64);
          _tile_dpbf16ps(5, 0, 3);
          _tile_dpbf16ps(7, 1, 3);
        }
        _tile_loadd(0, a_lo + a_off, 64);  // A lo x B hi
        _tile_loadd(1, a_lo + a_off + kTileElems, 64);
        _tile_loadd(2, b0 + off, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(6, 1, 2);
        if (two) {
          _tile_loadd(3, b0 + stride + off, 64);
          _tile_dpbf16ps(5, 0, 3);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      // A later chunk's weights, decoded while the AMX unit works on this one's products
      // (its ring slot was last read by chunk kc + kDecodeAhead - kRingChunks, whose tile
      // loads come before these stores in program order).
      if (decoder != nullptr && mt == 0 && kc + kDecodeAhead < chunks) {
        const int64_t next = a_at(kc + kDecodeAhead);
        decoder->decode(decoder->ctx, kc + kDecodeAhead, a_hi + next, x3 ? a_lo + next : nullptr);
      }
    }
    _tile_stored(4, c[0][0], 64);
    _tile_stored(5, c[0][1], 64);
    _tile_stored(6, c[1][0], 64);
    _tile_stored(7, c[1][1], 64);
    if (argmax != nullptr) {
      // C[a][t] row r holds weight row r0 + r against 16 rows of x: one vector compare a
      // row keeps the running maximum of 16 rows of x at once, in increasing r.
      for (int64_t t = 0; t < (two ? 2 : 1); ++t) {
        float* value = argmax->value + (mt + t) * kTile;
        int64_t* index = argmax->index + (mt + t) * kTile;
        __m512 best = _mm512_loadu_ps(value);
        __m512i best_lo = _mm512_loadu_si512(index), best_hi = _mm512_loadu_si512(index + 8);
        for (int64_t a = 0; a < a_tiles; ++a) {
          const int64_t r0 = a * kTile, rr = std::min(kTile, rows - r0);
          for (int64_t r = 0; r < rr; ++r) {
            __m512 v = _mm512_load_ps(c[a][t][r]);
            if (bias != nullptr) v = _mm512_add_ps(v, _mm512_set1_ps(bias[r0 + r]));
            const __mmask16 take =
                _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q));
            if (take == 0) continue;
            const __m512i n = _mm512_set1_epi64(n0 + r0 + r);
            best = _mm512_mask_mov_ps(best, take, v);
            best_lo = _mm512_mask_mov_epi64(best_lo, static_cast<__mmask8>(take), n);
            best_hi = _mm512_mask_mov_epi64(best_hi, static_cast<__mmask8>(take >> 8), n);
          }
        }
        _mm512_storeu_ps(value, best);
        _mm512_storeu_si512(index, best_lo);
        _mm512_storeu_si512(index + 8, best_hi);
      }
      continue;
    }
    // C holds y^T: column m of C[a][b] is row m of y's 16 outputs (an in-register
    // transpose; 16 gathers a tile took about 4x as long).
    for (int64_t a = 0; a < a_tiles; ++a) {
      const int64_t r0 = a * kTile, rr = std::min(kTile, rows - r0);
      const __mmask16 keep = static_cast<__mmask16>((1u << rr) - 1);
      const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + r0) : _mm512_setzero_ps();
      for (int64_t t = 0; t < (two ? 2 : 1); ++t) {
        const int64_t m0 = (mt + t) * kTile, mm = std::min(kTile, x.rows - m0);
        __m512 col[kTile];
        simd::transpose16x16(c[a][t][0], col);
        for (int64_t m = 0; m < mm; ++m)
          _mm512_mask_storeu_ps(y + (m0 + m) * ldy + r0, keep, _mm512_add_ps(col[m], b));
      }
    }
  }
}

#else  // no AMX in this build

bool available() { return false; }
void pack_activations(const float*, int64_t, int64_t, int64_t, Precision, PackedActivations*) {
  TORCH_CHECK(false, "amx: this build has no AMX-BF16 code");
}
void tile_begin() {}
void tile_release() {}
void pack_weight_rows(const float*, int64_t, int64_t, int64_t, bool, uint16_t*, uint16_t*) {
  TORCH_CHECK(false, "amx: this build has no AMX-BF16 code");
}
void gemm_tile(uint16_t*, uint16_t*, int64_t, const PackedActivations&, float*, int64_t,
               const float*, const ChunkDecoder*, int64_t, const RowArgmax*) {
  TORCH_CHECK(false, "amx: this build has no AMX-BF16 code");
}

#endif

}  // namespace amx
}  // namespace aioengine
