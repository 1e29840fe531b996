// The wgrad kernel's epilogues (wgrad_kernel.cuh): one math warp's 16 x
// BlockN strip of fp32 sums leaves as fp32 (fresh, or added to the old
// values: main_grad accumulation) or bf16 (fresh through TMA stores, or
// accumulated through the staged stores).
#pragma once

#include <cuda_bf16.h>

#include "fp8_gemm/math_warpgroup.cuh"
#include "fp8_gemm/sm90_primitives.cuh"
#include "fp8_gemm/wgrad.h"

namespace lpmoe {
namespace fp8_gemm {

// fp32 output through the TMA unit: the warp writes its 16 rows x 32
// columns into a staging box (128-byte swizzled rows: the fragment's 8-byte
// writes from 8 rows land in distinct banks), and one lane hands the box to
// a bulk tensor store, or to a bulk reduce-add for accumulation (the add
// happens in L2: no load round trip on the math warps' path, and the math
// warps go on to the next tile while the boxes drain).  The warp's staging
// area holds Boxes boxes used in turn, so a box is rewritten only once the
// store issued from it Boxes stores ago has read it (BlockN / 32 is a
// multiple of Boxes, so the turn restarts with every tile).  The map clips
// rows past N and columns past K.
template <int BlockN, int Boxes>
__device__ __forceinline__ void store_fp32_tma(const WgradParams& p, const float* res, int group, int warp_row0,
                                               int tile_col0, int lane, uint8_t* staging, bool accumulate) {
  static_assert((BlockN / kWgradBoxCols) % Boxes == 0, "the box turn restarts with each tile");
  const int r = lane / 4;
#pragma unroll
  for (int c = 0; c < BlockN / kWgradBoxCols; ++c) {
    uint8_t* box = staging + (c % Boxes) * kWgradStagingBytes;
    if (lane == 0) cute::tma_store_wait<Boxes - 1>();
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < kWgradBoxCols / 8; ++jj) {
      const int j = c * (kWgradBoxCols / 8) + jj;
      const int chunk = 2 * jj + (lane % 4) / 2;  // 16-byte chunk of the 128-byte row
      const int off = ((chunk ^ r) * 16) + (lane % 2) * 8;
      *reinterpret_cast<float2*>(box + r * 128 + off) = make_float2(res[4 * j], res[4 * j + 1]);
      *reinterpret_cast<float2*>(box + (r + 8) * 128 + off) = make_float2(res[4 * j + 2], res[4 * j + 3]);
    }
    cute::tma_store_fence();  // generic-proxy writes visible to the bulk copy
    __syncwarp();
    if (lane == 0) {
      const int col = tile_col0 + c * kWgradBoxCols;
      if (accumulate) {
        cute::SM90_TMA_REDUCE_ADD_3D::copy(&p.out_map, box, col, warp_row0, group);
      } else {
        cute::SM90_TMA_STORE_3D::copy(&p.out_map, box, col, warp_row0, group);
      }
      cute::tma_store_arrive();
    }
  }
}

// bf16 output through the fprop kernel's staging epilogue; accumulation
// adds the old bf16 values in fp32 before the single rounding.
template <int BlockN>
__device__ __forceinline__ void store_bf16(const WgradParams& p, __nv_bfloat16* d, const float* res, int warp_row0,
                                           int tile_col0, int lane, uint8_t* stage_out, bool accumulate) {
  const int frag_row = warp_row0 + lane / 4;
  const int frag_col = tile_col0 + 2 * (lane % 4);
  bf16_epilogue<BlockN>(
      res, stage_out, lane,
      [&](int j, float* v) {
        if (!accumulate) return;
        const int col = frag_col + 8 * j;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = frag_row + 8 * half;
          if (r < p.n_rows && col < p.k_cols) {
            const float2 old =
                __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + int64_t(r) * p.k_cols + col));
            v[2 * half] += old.x;
            v[2 * half + 1] += old.y;
          }
        }
      },
      [&](int cc, const uint4& piece) {
        const int row = warp_row0 + lane / 2;
        const int col = tile_col0 + cc * kEpilogueCols + 8 * (lane % 2);
        if (row < p.n_rows && col < p.k_cols) *reinterpret_cast<uint4*>(d + int64_t(row) * p.k_cols + col) = piece;
      });
}

// Fresh bf16 output through the TMA unit: the warp writes its whole 16 x
// BlockN strip and lane 0 hands each box to a bulk tensor store over (K, N,
// G) (store_bf16_strip), which clips rows past N and columns past K; the warp
// goes on to the next tile while the boxes drain.  The strip is rewritten
// only after the stores issued from it a tile ago have read it (a tile's
// K-blocks later: no wait in practice, except after an empty member's tile,
// which has none).
template <int BlockN>
__device__ __forceinline__ void store_bf16_tma(const WgradParams& p, const float* res, int group, int warp_row0,
                                               int tile_col0, int lane, uint8_t* strip) {
  if (lane == 0) cute::tma_store_wait<0>();
  __syncwarp();
  store_bf16_strip<BlockN>(res, strip, lane, tile_col0, p.k_cols, [&](uint8_t* box, int col) {
    cute::SM90_TMA_STORE_3D::copy(&p.out_map, box, col, warp_row0, group);
  });
}

}  // namespace fp8_gemm
}  // namespace lpmoe
