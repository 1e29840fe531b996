// One 128x128 tile of the MXFP8 dequantize, y = OType(fl(2^(e-127) * float(q)))
// (formats.md §2.4), in two forms that give the same bits:
//  * dequantize_tile_stores: every thread writes its dequantized rows with
//    16-byte st.global (any output type, any tile);
//  * dequantize_tile_tma: a whole 16-bit tile is written row-major into
//    shared memory and leaves by one TMA bulk tensor store.
// Why the second: a tile's output rows are 256-byte pieces of longer rows.
// Bulk tensor stores write that pattern at the copy's rate, where 16-byte
// st.global reached ~0.84 of it in stop 57's probe.  Measured on this tile
// (tools/dequant_ablation/mx_harness.cu, H100): 0.94-0.96 of a same-size copy
// with the bulk store against 0.94-0.95 with 16-byte stores, never slower
// (docs/perf-notes.md, issue 13 stops 57 and 58).
//
// Thread (g, c) of 256 owns rows 8g..8g+7 and columns 8c..8c+7 of the tile;
// every load (data and scale bytes) is issued before the first conversion.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/dequant_vec.cuh"
#include "common/mx_numerics.cuh"
#include "cute/arch/copy_sm90_tma.hpp"
#include "mxfp8/member_tiles.cuh"
#include "mxfp8/mxfp8.h"

namespace lpmoe {
namespace mxfp8 {
namespace dequant_detail {

constexpr int kThreads = 256;
constexpr int kVec = 8;   // columns per thread (8 FP8 bytes in, one 16-byte vector out)
constexpr int kRows = 8;  // rows per thread
constexpr int kOutTileBytes = kTile * kTile * 2;  // a 16-bit output tile in shared memory

// The thread's 8 x 8 piece of a tile: its FP8 bytes, and the 8 multipliers
// (rowwise: one per row; columnwise: one per column, as its 8 rows share
// one 32-row scale block).
struct Piece {
  uint2 bytes[kRows];
  float mult[kRows];
  int g, c;
  bool cols_in;  // the thread's columns lie inside the member (K edge)
};

template <bool kColumnwise>
__device__ __forceinline__ void load_piece(const DequantizeArgs& args, const MxTile& t, Piece& p) {
  p.c = threadIdx.x & 15;
  p.g = threadIdx.x >> 4;
  p.cols_in = p.c * kVec < t.cols_valid;
  if (!p.cols_in) return;
  const uint8_t* src = static_cast<const uint8_t*>(args.data) + t.data_base + (t.r0 + p.g * kRows) * t.k + t.c0 +
                       p.c * kVec;
  uint32_t e8[kRows] = {};  // rows past the tile's valid rows keep 0 (unused)
  if constexpr (kColumnwise) {
    const int64_t mblk = (t.r0 + p.g * kRows) / 32;
    // column k+1's byte: 16 bytes on when swizzled (same 32-column group), 1 when compact
    const uint8_t* col_scale = args.scale + col_scale_index(t, mblk, t.c0 + p.c * kVec, args.swizzled);
    const int step = args.swizzled ? 16 : 1;
#pragma unroll
    for (int e = 0; e < kVec; ++e) e8[e] = __ldg(col_scale + e * step);
  }
  const uint8_t* row_scale =
      args.scale + row_scale_index(t, t.r0 + p.g * kRows, t.c0 / 32 + p.c / 4, args.swizzled);
  const int64_t row_scale_step = args.swizzled ? 16 : t.sx;  // inside one 128-row tile
#pragma unroll
  for (int r = 0; r < kRows; ++r, src += t.k) {
    if (p.g * kRows + r < t.rows_valid) {
      p.bytes[r] = __ldg(reinterpret_cast<const uint2*>(src));
      if constexpr (!kColumnwise) e8[r] = __ldg(row_scale + r * row_scale_step);
    }
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) p.mult[i] = exp2f_e8m0(e8[i]);
}

// Row r of the piece, dequantized, as 8 OType values at dst (16-byte aligned, in kSpace).
template <typename OType, bool kE5M2, bool kColumnwise, Space kSpace>
__device__ __forceinline__ void store_piece_row(OType* dst, const Piece& p, int r) {
  if constexpr (kColumnwise) dequant8_store<OType, kE5M2, kSpace>(dst, p.bytes[r], p.mult);
  else dequant8_store<OType, kE5M2, kSpace>(dst, p.bytes[r], p.mult[r]);
}

// The piece's valid rows straight to the output (same element layout as the data).
template <typename OType, bool kE5M2, bool kColumnwise>
__device__ __forceinline__ void store_piece_global(const DequantizeArgs& args, const MxTile& t, const Piece& p) {
  if (!p.cols_in) return;
  OType* dst = static_cast<OType*>(args.out) + t.data_base + (t.r0 + p.g * kRows) * t.k + t.c0 + p.c * kVec;
#pragma unroll
  for (int r = 0; r < kRows; ++r, dst += t.k) {
    if (p.g * kRows + r < t.rows_valid) store_piece_row<OType, kE5M2, kColumnwise, Space::kGlobal>(dst, p, r);
  }
}

template <typename OType, bool kE5M2, bool kColumnwise>
__device__ __forceinline__ void dequantize_tile_stores(const DequantizeArgs& args, int64_t linear) {
  MxTile t;
  if (!locate_mx_tile(args.members, args.rows, args.cols, args.numel, linear, t)) return;
  Piece p;
  load_piece<kColumnwise>(args, t, p);
  store_piece_global<OType, kE5M2, kColumnwise>(args, t, p);
}

// The TMA-store form (16-bit OType, rows layout: members share the column
// count, so `out_map` is the whole (rows, cols) output in 128 x 128 boxes,
// unswizzled).  A tile with fewer than 128 rows (a member's last) keeps the
// 16-byte stores: a whole box would write the next member's rows, or a
// capacity tail.  Columns past the output's K are clipped by the unit, so a
// tile at the K edge is stored whole.  `smem`: kOutTileBytes, 128-byte aligned.
template <typename OType, bool kE5M2, bool kColumnwise>
__device__ __forceinline__ void dequantize_tile_tma(const DequantizeArgs& args, const CUtensorMap* out_map,
                                                    int64_t linear, uint8_t* smem) {
  static_assert(sizeof(OType) == 2, "TMA-store output tiles are 16-bit");
  MxTile t;
  if (!locate_mx_tile(args.members, args.rows, args.cols, args.numel, linear, t)) return;  // CTA-uniform
  Piece p;
  load_piece<kColumnwise>(args, t, p);
  if (t.rows_valid < kTile) {  // CTA-uniform
    store_piece_global<OType, kE5M2, kColumnwise>(args, t, p);
    return;
  }
  OType* tile = reinterpret_cast<OType*>(smem);
  if (p.cols_in) {
    OType* dst = tile + p.g * kRows * kTile + p.c * kVec;
#pragma unroll
    for (int r = 0; r < kRows; ++r, dst += kTile) store_piece_row<OType, kE5M2, kColumnwise, Space::kShared>(dst, p, r);
  }
  cute::tma_store_fence();  // the shared writes visible to the bulk copy
  __syncthreads();
  if (threadIdx.x == 0) {
    cute::SM90_TMA_STORE_2D::copy(out_map, smem, static_cast<int>(t.c0), static_cast<int>(t.first_row + t.r0));
    cute::tma_store_arrive();
    cute::tma_store_wait<0>();  // the staging is read before the CTA's memory goes
  }
}

}  // namespace dequant_detail
}  // namespace mxfp8
}  // namespace lpmoe
