// The columnwise FP8 block dequantize tiles, shared by dequantize.cu's
// kernels and the ablation harness (tools/dequant_ablation), so the harness
// times exactly the code lpmoe runs.  Two ways to read the transposed source:
// * staged (used wherever each K row of a tile holds 128 token bytes: the
//   padded grouped layout, or a single tensor of whole tiles): a CTA takes
//   two token tiles of one K tile, each warp load covers 256 (or 2 x 128)
//   contiguous bytes of a K row, into shared memory, transposed back from
//   there; 16-bit outputs leave through TMA bulk tensor stores of whole
//   token tiles (dequantize_columns_staged_tma), other outputs and a
//   member's partial last tile through 16-byte stores;
// * registers (any layout): a thread loads 8 bytes of 8 K rows and
//   transposes them in registers.
// Why staged: the columnwise source read in 8-byte pieces of 8 rows per warp
// instruction runs at 0.89-0.91 of a contiguous read on the H100, in runs
// of a row at 0.98-0.99 (docs/perf-notes.md, "the columnwise dequantize's
// read pattern").  Why TMA stores: the same bf16 bytes written by 16-byte
// st.global in this tile order ran at ~0.73-0.84 of the copy's write rate,
// by bulk tensor stores of 128 x 128 boxes at ~1.0 (H100 and H200,
// tools/dequant_ablation, stop 57).
#pragma once

#include "cute/arch/copy_sm90_tma.hpp"

#include "common/cuda_utils.h"
#include "common/dequant_vec.cuh"
#include "fp8_block/fp8_block.h"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace fp8_block {
namespace dequant_detail {
using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;

// The 128x128 block's scale for 2D scaling (0 for 1D, unused).
template <int kBlockDim, bool kColumnwise>
__device__ __forceinline__ float tile_scale_2d(const DequantizeArgs& args, const TileInfo& ti, int bx_count,
                                               int tile_x) {
  if constexpr (kBlockDim != 2) {
    return 0.0f;
  } else if constexpr (kColumnwise) {
    const int64_t tiles_m = ceil_div<int64_t>(ti.m, kTile);
    const int64_t ld = round_up<int64_t>(tiles_m, 4);
    return args.scale[bx_count * (ti.pad512_start / kTile) + tile_x * ld + ti.local_tile];
  } else {
    const int ld = round_up(bx_count, 4);
    return args.scale[ld * (ti.pad128_start / kTile) + ti.local_tile * ld + tile_x];
  }
}

// 8 K columns x 8 tokens of FP8 (chunk[e]: the 8 token bytes of column e,
// token r in byte r) written as 8 output rows of 8 values (scale[e] for
// column e) at dst, dst + ld, ... (in kSpace); rows >= rows_left are skipped.
template <typename OType, bool kE5M2, Space kSpace = Space::kGlobal>
__device__ __forceinline__ void store_transposed8(OType* dst, int64_t ld, const uint2 (&chunk)[8], const float (&s)[8],
                                                  int rows_left) {
#pragma unroll
  for (int r = 0; r < 8; ++r, dst += ld) {
    if (r >= rows_left) continue;
    const int word = r >> 2;
    const int shift = 8 * (r & 3);
    uint32_t w[2];  // output row r's eight bytes, column 0 first
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t b0 = (word ? chunk[4 * h].y : chunk[4 * h].x) >> shift;
      const uint32_t b1 = (word ? chunk[4 * h + 1].y : chunk[4 * h + 1].x) >> shift;
      const uint32_t b2 = (word ? chunk[4 * h + 2].y : chunk[4 * h + 2].x) >> shift;
      const uint32_t b3 = (word ? chunk[4 * h + 3].y : chunk[4 * h + 3].x) >> shift;
      w[h] = __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
    }
    dequant8_store<OType, kE5M2, kSpace>(dst, make_uint2(w[0], w[1]), s);
  }
}

// The 8 scales of K columns col..col+7 of a token tile: 1D, 8 consecutive
// floats (16-byte aligned: ld % 4 == 0); 2D, the tile's one scale.
template <int kBlockDim>
__device__ __forceinline__ void column_scales8(const DequantizeArgs& args, const TileInfo& ti, int bx_count, int tile_x,
                                               int64_t col, float (&s)[8]) {
  if constexpr (kBlockDim == 1) {
    const int64_t ld = round_up<int64_t>(args.cols, 4);
    const float4* sp = reinterpret_cast<const float4*>(args.scale + ld * (ti.pad128_start / kTile) + ti.local_tile * ld + col);
    const float4 lo = __ldg(sp), hi = __ldg(sp + 1);
    s[0] = lo.x; s[1] = lo.y; s[2] = lo.z; s[3] = lo.w;
    s[4] = hi.x; s[5] = hi.y; s[6] = hi.z; s[7] = hi.w;
  } else {
    const float t = tile_scale_2d<kBlockDim, true>(args, ti, bx_count, tile_x);
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = t;
  }
}

// Transposed columnwise source, transposed back in registers, for token
// tile j and K tile tile_x (256 threads): thread (c, g)
// loads the 8 bytes of tokens 8g..8g+7 from each of K rows 8c..8c+7 (8-byte
// loads, all in flight before the first use) and writes those 8 tokens x 8
// columns as 8 output vectors.  Lanes are laid out so that a warp's load
// covers 8 K rows x 32 contiguous token bytes (whole sectors) and its store
// 4 output rows x 128 contiguous bytes.  No shared memory, no barrier (a
// shared-memory transpose, staged through registers or cp.async, measured
// 0.71-0.87 of copy).
template <typename OType, bool kE5M2, int kBlockDim>
__device__ __forceinline__ void dequantize_columns_tile(const DequantizeArgs& args, int64_t j, int tile_x) {
  constexpr int kVec = 8, kRowsPerThread = 8;
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = 4 * (warp & 3) + (lane & 3);   // tokens 8g..8g+7 of the tile
  const int c = 8 * (warp >> 2) + (lane >> 2);  // K columns 8c..8c+7
  const int tok0 = g * kRowsPerThread;
  // cols_valid is a multiple of 16: a thread's 8 columns are all in or all out
  if (c * kVec >= cols_valid || tok0 >= ti.rows_valid) return;  // no barrier below
  const uint8_t* q = static_cast<const uint8_t*>(args.data);
  OType* out = static_cast<OType*>(args.out);

  const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
  const int64_t tokens_in_buffer = args.pad_columnwise_tokens ? kTile : ti.rows_valid;
  const uint8_t* src = q + K * ti.pad128_start + ti.local_tile * kTile + (col0 + c * kVec) * pitch + tok0;
  // chunk[e]: tokens 8g..8g+7 of K column 8c+e (byte r = token 8g+r).
  uint2 chunk[kVec];
  if (pitch % 8 == 0 && tok0 + kRowsPerThread <= tokens_in_buffer) {
#pragma unroll
    for (int e = 0; e < kVec; ++e, src += pitch) chunk[e] = __ldg(reinterpret_cast<const uint2*>(src));
  } else {  // a member's last tokens in an unpadded buffer: only its own bytes
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k)
        if (tok0 + k < ti.rows_valid) w[k >> 2] |= static_cast<uint32_t>(src[e * pitch + k]) << (8 * (k & 3));
      chunk[e] = make_uint2(w[0], w[1]);
    }
  }
  float s[kVec];
  column_scales8<kBlockDim>(args, ti, bx_count, tile_x, col0 + c * kVec, s);
  store_transposed8<OType, kE5M2>(out + (ti.row0 + tok0) * K + col0 + c * kVec, K, chunk, s, ti.rows_valid - tok0);
}

// ---- staged: two token tiles of one K tile per CTA (256 threads) ----
constexpr int kStagedTiles = 2;
constexpr int kStagedRowBytes = kStagedTiles * kTile;
// Byte offset of K row k in the shared tile: rows of 256 bytes, each group of
// 8 rows shifted 32 bytes further (and 128 more every 32 rows, so shifted
// rows never overlap), so that the 16 lanes of a half-warp reading 8 bytes
// from 4 row groups x 4 token pieces hit 16 distinct bank pairs.
__host__ __device__ constexpr int staged_row_offset(int k) {
  return k * kStagedRowBytes + 32 * ((k >> 3) & 3) + 128 * (k >> 5);
}
constexpr int kStagedSmemBytes = staged_row_offset(kTile - 1) + kStagedRowBytes;

// Does the staged tile read this source?  Every K row of a tile must hold
// 128 token bytes (16-byte aligned): the padded layout, or a single tensor
// whose rows are whole tiles.
__host__ __device__ inline bool columns_staged(const DequantizeArgs& a) {
  return a.pad_columnwise_tokens || (a.group.row == nullptr && a.rows % kTile == 0);
}

// Token tile j of the staged grid, if it holds rows (the grid rounds the
// tile count up to whole chunks).
__device__ __forceinline__ bool staged_tile(const DequantizeArgs& args, int64_t j, TileInfo& ti) {
  return j < args.max_row_tiles && locate_tile(args.group, args.rows, j, ti) && ti.rows_valid > 0;
}

// Where a staged CTA works: token tiles j0 and j0 + 1 (= 2 * chunk + t) of
// K tile tile_x, whose columns col0.. hold cols_valid of the matrix's K; and
// where thread (c, g) works in each tile: K columns 8c..8c+7, tokens
// 8g..8g+7 (the register tile's layout).
struct StagedPlace {
  int64_t K, col0, j0;
  int bx_count, cols_valid, c, g;
  __device__ __forceinline__ StagedPlace(const DequantizeArgs& args, int64_t chunk, int tile_x)
      : K(args.cols),
        col0(static_cast<int64_t>(tile_x) * kTile),
        j0(kStagedTiles * chunk),
        bx_count(static_cast<int>(ceil_div<int64_t>(args.cols, kTile))),
        cols_valid(static_cast<int>(args.cols - col0 < kTile ? args.cols - col0 : kTile)),
        c(8 * (threadIdx.x >> 7) + ((threadIdx.x & 31) >> 2)),
        g(4 * ((threadIdx.x >> 5) & 3) + (threadIdx.x & 3)) {}
};

// Token tiles 2*chunk + t (t = 0, 1) of K tile tile_x into shared memory:
// warp w reads K rows 16w..16w+15, two per instruction; lane l takes 16
// bytes (piece l % 8) of token tile (l / 8) % 2 of row (l / 16): a member's
// two tiles are 256 contiguous bytes of the row.
__device__ __forceinline__ void load_staged_tiles(const DequantizeArgs& args, int64_t j0, int64_t col0,
                                                  int cols_valid, uint8_t* smem) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int t = (lane >> 3) & 1, piece = lane & 7, sub_row = lane >> 4;
  TileInfo ti;
  if (!staged_tile(args, j0 + t, ti)) return;
  const int64_t K = args.cols;
  const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
  const uint8_t* src = static_cast<const uint8_t*>(args.data) + K * ti.pad128_start + ti.local_tile * kTile +
                       col0 * pitch + 16 * piece;
  constexpr int kLoads = kTile / 8 / 2;  // 16 rows per warp, 2 per instruction
  uint4 v[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int k = 16 * warp + 2 * i + sub_row;
    if (k < cols_valid) v[i] = __ldg(reinterpret_cast<const uint4*>(src + k * pitch));
  }
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int k = 16 * warp + 2 * i + sub_row;
    if (k < cols_valid) *reinterpret_cast<uint4*>(smem + staged_row_offset(k) + kTile * t + 16 * piece) = v[i];
  }
}

// Thread (c, g)'s 8 K rows x 8 tokens of staged tile t (c: K columns
// 8c..8c+7, g: tokens 8g..8g+7), as the register tile holds them.
__device__ __forceinline__ void read_staged8(const uint8_t* smem, int t, int c, int g, uint2 (&q)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e)
    q[e] = *reinterpret_cast<const uint2*>(smem + staged_row_offset(8 * c + e) + kTile * t + 8 * g);
}

// Token tiles 2*chunk and 2*chunk + 1 (each located on its own: they may
// belong to different members) of K tile tile_x, loaded as above; then
// thread (c, g) transposes K rows 8c..8c+7 x tokens 8g..8g+7 of each tile
// back, as the register tile does, and stores 16-byte output pieces.
template <typename OType, bool kE5M2, int kBlockDim>
__device__ __forceinline__ void dequantize_columns_staged(const DequantizeArgs& args, int64_t chunk, int tile_x,
                                                          uint8_t* smem) {
  const StagedPlace at(args, chunk, tile_x);
  const int64_t K = at.K, col0 = at.col0, j0 = at.j0;
  const int cols_valid = at.cols_valid, c = at.c, g = at.g;
  load_staged_tiles(args, j0, col0, cols_valid, smem);
  __syncthreads();
  const int tok0 = 8 * g;
  if (c * 8 >= cols_valid) return;  // cols_valid is a multiple of 16: all 8 columns in or out
#pragma unroll 1
  for (int t = 0; t < kStagedTiles; ++t) {
    TileInfo ti;
    if (!staged_tile(args, j0 + t, ti) || tok0 >= ti.rows_valid) continue;
    uint2 q[8];
    read_staged8(smem, t, c, g, q);
    float s[8];
    column_scales8<kBlockDim>(args, ti, at.bx_count, tile_x, col0 + 8 * c, s);
    store_transposed8<OType, kE5M2>(static_cast<OType*>(args.out) + (ti.row0 + tok0) * K + col0 + 8 * c, K, q, s,
                                    ti.rows_valid - tok0);
  }
}

// The staged tile with TMA-store output (16-bit OType; `out_map`: the (rows,
// K) output in 128 x 128 boxes, unswizzled, encode_matrix_map).  Both tiles'
// inputs go to registers first, so the output reuses the input's shared
// memory: tile 0's dequantized 128 x 128 block is written there row-major
// and stored by one bulk tensor copy, then tile 1's once that copy has read
// it (tools/dequant_ablation measured a second 32 KB buffer the same, at 3
// CTAs per SM either way).  A token tile with fewer than 128 rows (a
// member's last) is stored by 16-byte stores, since a whole box would write
// the next member's rows (or a capacity tail, which must stay untouched);
// the unit clips columns past K and rows past the output.  Same values,
// same bits as dequantize_columns_staged.
constexpr int kStagedOutBytes = kTile * kTile * 2;
static_assert(kStagedOutBytes <= kStagedSmemBytes, "an output tile fits the input staging");

template <typename OType, bool kE5M2, int kBlockDim>
__device__ __forceinline__ void dequantize_columns_staged_tma(const DequantizeArgs& args, const CUtensorMap* out_map,
                                                              int64_t chunk, int tile_x, uint8_t* smem) {
  static_assert(sizeof(OType) == 2, "TMA-store output tiles are 16-bit");
  const StagedPlace at(args, chunk, tile_x);
  const int64_t K = at.K, col0 = at.col0, j0 = at.j0;
  const int cols_valid = at.cols_valid, c = at.c, g = at.g;
  const int tok0 = 8 * g;
  const bool cols_in = c * 8 < cols_valid;
  TileInfo ti[kStagedTiles];
  bool have[kStagedTiles], mine[kStagedTiles];
  // The column scales first, so their loads overlap the tile's (+0.01-0.02
  // of copy on 16k-token calls, where nothing else hides them).
  float s[kStagedTiles][8];
#pragma unroll
  for (int t = 0; t < kStagedTiles; ++t) {
    have[t] = staged_tile(args, j0 + t, ti[t]);
    mine[t] = have[t] && cols_in && tok0 < ti[t].rows_valid;
    if (mine[t]) column_scales8<kBlockDim>(args, ti[t], at.bx_count, tile_x, col0 + 8 * c, s[t]);
  }
  load_staged_tiles(args, j0, col0, cols_valid, smem);
  __syncthreads();
  uint2 q[kStagedTiles][8];
#pragma unroll
  for (int t = 0; t < kStagedTiles; ++t) {
    if (mine[t]) read_staged8(smem, t, c, g, q[t]);
  }
  __syncthreads();  // the input is in registers: the staging takes the output
  OType* out_tile = reinterpret_cast<OType*>(smem);
#pragma unroll
  for (int t = 0; t < kStagedTiles; ++t) {
    const bool whole = have[t] && ti[t].rows_valid == kTile;
    if (t > 0) {  // the previous tile's bulk store has read the staging
      if (threadIdx.x == 0) cute::tma_store_wait<0>();
      __syncthreads();
    }
    if (mine[t]) {
      if (whole) {
        store_transposed8<OType, kE5M2, Space::kShared>(out_tile + tok0 * kTile + 8 * c, kTile, q[t], s[t], kTile);
      } else {
        store_transposed8<OType, kE5M2>(static_cast<OType*>(args.out) + (ti[t].row0 + tok0) * K + col0 + 8 * c, K,
                                        q[t], s[t], ti[t].rows_valid - tok0);
      }
    }
    if (whole) {  // CTA-uniform
      cute::tma_store_fence();  // the shared writes visible to the bulk copy
      __syncthreads();
      if (threadIdx.x == 0) {
        cute::SM90_TMA_STORE_2D::copy(out_map, smem, static_cast<int>(col0), static_cast<int>(ti[t].row0));
        cute::tma_store_arrive();
      }
    }
  }
  if (threadIdx.x == 0) cute::tma_store_wait<0>();  // the staging is read before the CTA's memory goes
}

}  // namespace dequant_detail
}  // namespace fp8_block
}  // namespace lpmoe
