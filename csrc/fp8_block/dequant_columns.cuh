// The columnwise FP8 block dequantize tile, shared by dequantize.cu's kernel
// and the ablation harness (tools/dequant_ablation), so the harness times
// exactly the code lpmoe runs.
#pragma once

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
  const float tile_scale = tile_scale_2d<kBlockDim, true>(args, ti, bx_count, tile_x);

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
  if constexpr (kBlockDim == 1) {  // columns 8c..8c+7: 8 consecutive floats, 16-byte aligned (ld % 4 == 0)
    const int64_t ld = round_up<int64_t>(K, 4);
    const float4* sp =
        reinterpret_cast<const float4*>(args.scale + ld * (ti.pad128_start / kTile) + ti.local_tile * ld + col0 + c * kVec);
    const float4 lo = __ldg(sp), hi = __ldg(sp + 1);
    s[0] = lo.x; s[1] = lo.y; s[2] = lo.z; s[3] = lo.w;
    s[4] = hi.x; s[5] = hi.y; s[6] = hi.z; s[7] = hi.w;
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) s[e] = tile_scale;
  }
  // Output row tok0 + r, a running pointer (one add per row).
  OType* dst = out + (ti.row0 + tok0) * K + col0 + c * kVec;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r, dst += K) {
    if (tok0 + r >= ti.rows_valid) continue;
    const int word = r >> 2;
    const int shift = 8 * (r & 3);
    uint32_t w[2];  // output row r's eight bytes, column 8c first
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t b0 = (word ? chunk[4 * h].y : chunk[4 * h].x) >> shift;
      const uint32_t b1 = (word ? chunk[4 * h + 1].y : chunk[4 * h + 1].x) >> shift;
      const uint32_t b2 = (word ? chunk[4 * h + 2].y : chunk[4 * h + 2].x) >> shift;
      const uint32_t b3 = (word ? chunk[4 * h + 3].y : chunk[4 * h + 3].x) >> shift;
      w[h] = __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
    }
    dequant8_store<OType, kE5M2>(dst, make_uint2(w[0], w[1]), s);
  }
}

}  // namespace dequant_detail
}  // namespace fp8_block
}  // namespace lpmoe
