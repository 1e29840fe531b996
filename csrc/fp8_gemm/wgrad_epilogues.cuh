// The wgrad kernel's epilogues (wgrad_kernel.cuh): one math warp's 16 x
// BlockN strip of fp32 sums leaves as fp32 (fresh, or added to the old
// values: main_grad accumulation) or bf16 (fresh through TMA stores, or
// accumulated through the staged stores).
#pragma once

#include <cuda_bf16.h>

#include "cute/arch/copy_sm80.hpp"  // cp.async (accumulation's old values)
#include "fp8_gemm/math_warpgroup.cuh"
#include "fp8_gemm/sm90_primitives.cuh"
#include "fp8_gemm/wgrad.h"

namespace lpmoe {
namespace fp8_gemm {

// A warp's staged fp32 box: 16 rows x 32 columns, 128-byte rows whose
// 16-byte chunks are swizzled by the row (the out map's 128-byte swizzle).
// The slot of this lane's fragment pair (columns 2 (lane % 4) + {0, 1} of
// 8-column group jj, row lane / 4); the pair of row + 8 is kFp32BoxHalf
// float2 further on.
constexpr int kFp32BoxHalf = 8 * 128 / sizeof(float2);
__device__ __forceinline__ float2* fp32_box_slot(uint8_t* box, int jj, int lane) {
  const int r = lane / 4;
  const int chunk = 2 * jj + (lane % 4) / 2;  // 16-byte chunk of the 128-byte row
  return reinterpret_cast<float2*>(box + r * 128 + ((chunk ^ r) * 16) + (lane % 2) * 8);
}

// The warp's writes into `box` made visible to the bulk copy, then lane 0
// stores it at (col, row, group) of the out map as a bulk group of its own.
__device__ __forceinline__ void store_fp32_box(const WgradParams& p, uint8_t* box, int col, int row, int group,
                                               int lane) {
  cute::tma_store_fence();  // generic-proxy writes visible to the bulk copy
  __syncwarp();
  if (lane == 0) {
    cute::SM90_TMA_STORE_3D::copy(&p.out_map, box, col, row, group);
    cute::tma_store_arrive();
  }
}

// fp32 output through the TMA unit: the warp writes its 16 rows x 32
// columns into a staging box (128-byte swizzled rows: the fragment's 8-byte
// writes from 8 rows land in distinct banks), and one lane hands the box to
// a bulk tensor store; the math warps go on to the next tile while the
// boxes drain.  The warp's staging area holds Boxes boxes used in turn, so a
// box is rewritten only once the store issued from it Boxes stores ago has
// read it (BlockN / 32 is a multiple of Boxes, so the turn restarts with
// every tile).  The map clips rows past N and columns past K.
template <int BlockN, int Boxes>
__device__ __forceinline__ void store_fp32_tma(const WgradParams& p, const float* res, int group, int warp_row0,
                                               int tile_col0, int lane, uint8_t* staging) {
  static_assert((BlockN / kWgradBoxCols) % Boxes == 0, "the box turn restarts with each tile");
#pragma unroll
  for (int c = 0; c < BlockN / kWgradBoxCols; ++c) {
    uint8_t* box = staging + (c % Boxes) * kWgradStagingBytes;
    if (lane == 0) cute::tma_store_wait<Boxes - 1>();
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < kWgradBoxCols / 8; ++jj) {
      const int j = c * (kWgradBoxCols / 8) + jj;
      float2* lo = fp32_box_slot(box, jj, lane);
      lo[0] = make_float2(res[4 * j], res[4 * j + 1]);
      lo[kFp32BoxHalf] = make_float2(res[4 * j + 2], res[4 * j + 3]);
    }
    store_fp32_box(p, box, tile_col0 + c * kWgradBoxCols, warp_row0, group, lane);
  }
}

// Accumulation into fp32 (main_grad).  At 512 tokens per member the call is
// bound by the (G, N, K) read-modify-write, and what limits it is the bytes
// in flight: bulk reduce-adds (the add in L2), or all old values loaded at
// the epilogue, drew 60-66 % of the DRAM bandwidth (docs/fp8-wgrad-kernel-
// notes.md, stop 54).  So the old values come in by cp.async when the tile
// starts (load_old_values), into the warp's staging, which in the main_grad
// kernels holds its whole fp32 strip (WgradLayout's Fp32Strip), and stream
// under the tile's K-blocks; the epilogue adds the results in shared memory
// and stores box by box (accumulate_fp32_tma).  DeepSeek-V3 fc1 at 32 x 512
// tokens, H100: 4.13 ms with reduce-adds, 3.43-3.46 with half the strip
// staged and half loaded at the epilogue (stop 54), 3.37-3.43 whole (stop
// 55; 2.83-2.86 against 3.21 at 128 tokens, where a tile is one K-block).
// These copies are what exposed the K loop's stage-release race
// (wgrad_kernel.cuh, its kblock).  One fp32 add per output, as the
// reduce-add did: the same bits.  cp.async rows: box c holds 16 rows x 128
// bytes, 16-byte chunk q of row r at r * 128 + (q ^ r % 8) * 16 (the map's
// 128-byte swizzle).  A chunk (4 columns) is wholly inside or outside the
// matrix, as run_wgrad takes only K a multiple of 16.  The cp.async group is
// the only one outstanding between the tile's start and the epilogue's
// wait, where no bulk-store wait falls: in the SASS both kinds of wait count
// on one scoreboard, so a bulk-store wait placed in that window would also
// wait for the copies.
template <int BlockN, int Boxes>
__device__ __forceinline__ void load_old_values(const WgradParams& p, uint8_t* staging, int group, int warp_row0,
                                                int tile_col0, int lane) {
  static_assert(Boxes == BlockN / kWgradBoxCols, "the staging holds the whole strip");
  const float* d = static_cast<const float*>(p.d) + int64_t(group) * p.n_rows * p.k_cols;
  if (lane == 0) cute::tma_store_wait<0>();  // the previous tile's stores have read the boxes
  __syncwarp();
#pragma unroll
  for (int c = 0; c < Boxes; ++c) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // 128 chunks a box, 4 per lane: rows 4t..4t+3
      const int r = 4 * t + lane / 8, q = lane % 8;
      const int row = warp_row0 + r, col = tile_col0 + c * kWgradBoxCols + 4 * q;
      const bool in = row < p.n_rows && col < p.k_cols;
      const float* src = in ? d + int64_t(row) * p.k_cols + col : d;
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<const cute::uint128_t*>(src),
          *reinterpret_cast<cute::uint128_t*>(staging + c * kWgradStagingBytes + r * 128 + ((q ^ (r % 8)) * 16)), in);
    }
  }
  cute::cp_async_fence();
}

template <int BlockN, int Boxes>
__device__ __forceinline__ void accumulate_fp32_tma(const WgradParams& p, const float* res, int group, int warp_row0,
                                                    int tile_col0, int lane, uint8_t* staging) {
  static_assert(Boxes == BlockN / kWgradBoxCols, "the staging holds the whole strip");
  cute::cp_async_wait<0>();
  __syncwarp();  // every lane's chunks have landed
#pragma unroll
  for (int c = 0; c < Boxes; ++c) {
    uint8_t* box = staging + c * kWgradStagingBytes;
#pragma unroll
    for (int jj = 0; jj < kWgradBoxCols / 8; ++jj) {
      const int j = c * (kWgradBoxCols / 8) + jj;
      float2* lo = fp32_box_slot(box, jj, lane);
      const float2 a = lo[0], b = lo[kFp32BoxHalf];
      lo[0] = make_float2(a.x + res[4 * j], a.y + res[4 * j + 1]);
      lo[kFp32BoxHalf] = make_float2(b.x + res[4 * j + 2], b.y + res[4 * j + 3]);
    }
    store_fp32_box(p, box, tile_col0 + c * kWgradBoxCols, warp_row0, group, lane);
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
  store_bf16_strip<BlockN, kWgradStoreBoxCols>(res, strip, lane, tile_col0, p.k_cols, [&](uint8_t* box, int col) {
    cute::SM90_TMA_STORE_3D::copy(&p.out_map, box, col, warp_row0, group);
  });
}

}  // namespace fp8_gemm
}  // namespace lpmoe
