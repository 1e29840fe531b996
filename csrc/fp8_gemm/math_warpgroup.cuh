// Pieces of the math warpgroups shared by the fprop/dgrad kernel
// (kernel_1x128_128x128.cuh) and the wgrad kernel (wgrad_kernel.cuh): the
// register split of producer and math warpgroups, one K-block of wgmmas,
// the hand-back of a pipeline stage and the bf16 epilogues (staged stores,
// and the strip that TMA stores read).
#pragma once

#include <cuda_bf16.h>

#include "fp8_gemm/block_scaled.h"
#include "fp8_gemm/sm90_primitives.cuh"

namespace lpmoe {
namespace fp8_gemm {

// setmaxnreg splits of the 384-thread CTAs: the producer warpgroup (one
// thread issues copies) gives its registers to the two math warpgroups,
// which hold a BlockN/2-float scratch accumulator and a BlockN/2-float
// result each.  Both keep the launch bound's total of 64512 registers.
// fprop/dgrad 40 / 232 (DeepGEMM's split): with 56 / 224 the width-192
// kernels spilled 28-108 bytes per thread; with this split (landed together
// with the stmatrix strip) their compute-only time is 2.7-2.8 % lower
// (docs/fp8-gemm-kernel-notes.md, stop 35).  wgrad 56 / 224: its producer
// (two token-major operands, scale copies) spills at 40.  Any split must
// keep to the launch's 168 x 384 registers: the math warpgroups' increase
// must fit in what the producer's decrease frees, 256 (math - 168) <=
// 128 (168 - producer), in steps of 8.
struct RegSplit {
  int producer;
  int math;
};
constexpr RegSplit kFpropRegs{40, 232};
constexpr RegSplit kWgradRegs{56, 224};

// acc = A(64 x 128) B(N x 128)^T of one K-block: four 32-deep wgmmas on the
// stage's swizzled tiles, issued (kblock_wgmma_issue) and waited for
// (kblock_wgmma_wait); the fences keep the compiler from touching acc while
// the tensor cores own it.  Issue overwrites acc, so every instruction that
// read acc before it has issued, in program order, when it returns (the
// wgrad K loop's stage release rests on that).
template <int N>
__device__ __forceinline__ void kblock_wgmma_issue(uint64_t da, uint64_t db, float* acc) {
#if LPMOE_SM90A_DEVICE
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < kBlockK / kWgmmaK; ++ks) {
    wgmma_fp8<N>(advance_k(da, ks), advance_k(db, ks), acc, ks > 0);
  }
  cute::warpgroup_commit_batch();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
#endif
}

template <int N>
__device__ __forceinline__ void kblock_wgmma_wait(float* acc) {
#if LPMOE_SM90A_DEVICE
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
#endif
}

template <int N>
__device__ __forceinline__ void kblock_wgmma(uint64_t da, uint64_t db, float* acc) {
  kblock_wgmma_issue<N>(da, db, acc);
  kblock_wgmma_wait<N>(acc);
}

// This warp is done with a stage: one arrive on the stage's empty barrier in
// every CTA of the cluster (with Cluster = 2 the stage holds the partner's
// multicast half too, so both producers wait for it).
template <int Cluster>
__device__ __forceinline__ void release_stage(uint64_t* empty, int lane) {
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < Cluster; ++r) {
      if constexpr (Cluster == 1) {
        Barrier::arrive(empty);
      } else {
        Barrier::arrive(empty, r, 1u);
      }
    }
  }
}

// The same hand-back without a branch or a warp barrier: lane r arrives on
// CTA r's barrier (ptxas predicates the arrive; checked in the SASS).  For
// use right after kblock_wgmma: its wait is warp-collective, so every lane's
// wgmma reads are done.  What it leaves to the hardware: the lanes' plain
// shared-memory reads of the stage (the A scales) are not ordered before
// lane 0/1's arrive by the PTX memory model, as __syncwarp would order them.
// They are warp-wide loads issued before the wgmma fence, a whole K-block of
// wgmmas (hundreds of cycles) before the arrive, and the producer refills the
// stage only after every math warp of both CTAs arrived and a TMA load came
// back from L2.  release_stage (__syncwarp, lane 0 arrives on each CTA)
// orders the lanes' reads before lane 0's arrive in the PTX model, but in
// the SASS the reads may still be in flight when the arrive issues (the
// wgrad kernel's last column-scale loads were, and read a refilled stage
// once shared memory was busy: stop 54, wgrad_kernel.cuh); in the fprop K
// loop it compiles to the same SASS
// but for lane 0 issuing both arrives, and measured 1-5 % slower at K 2048
// (tools/fp8_ablation variant `syncrel`, docs/fp8-gemm-kernel-notes.md
// stop 35).  In the SASS each lane's A-scale loads feed FMULs issued before
// the wgmma wait in a converged warp, so they have returned before the
// instruction carrying the arrive issues.
template <int Cluster>
__device__ __forceinline__ void release_stage_lanes(uint64_t* empty, int lane) {
  if constexpr (Cluster == 1) {
    if (lane == 0) Barrier::arrive(empty);
  } else {
    Barrier::arrive(empty, static_cast<uint32_t>(lane % Cluster), static_cast<uint32_t>(lane < Cluster));
  }
}

// Both kernels' K loops go in whole ring turns: every tile starts at ring
// stage 0, so a stage's barriers, scales and descriptors sit at compile-time
// offsets once the walk is unrolled.  The producer pads a partial last turn
// with stages that carry no data (ring_slots); the math warps call
// kblock(s, kb) for K-block kb on stage s and pad(s) for a padding stage,
// and `phase` (of the full barriers) flips once per turn.
template <int Stages>
__host__ __device__ constexpr int ring_slots(int nkb) {
  return (nkb + Stages - 1) / Stages * Stages;
}

template <int Stages, class KBlock, class Pad>
__device__ __forceinline__ void ring_turns(int nkb, uint32_t& phase, KBlock&& kblock, Pad&& pad) {
  int kt = 0;
  for (; kt + Stages <= nkb; kt += Stages, phase ^= 1u) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) kblock(s, kt + s);
  }
  if (kt < nkb) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) {
      if (kt + s < nkb) {
        kblock(s, kt + s);
      } else {
        pad(s);
      }
    }
    phase ^= 1u;
  }
}

// bf16 epilogue of one math warp's 16 x BlockN fragment: kEpilogueCols
// columns per pass go into the warp's staging tile (rows lane/4 and +8, rows
// of kEpilogueRowBytes: the fragment's 4-byte writes hit 32 distinct banks)
// and come back as one 16-byte piece per lane (row lane/2, columns
// 8 (lane%2) of the pass), so the global stores are whole 16-byte units
// instead of the fragment's 4-byte pairs on half-used sectors.
// `adjust(j, v)` may change the four fp32 values of 8-column fragment j
// before they are rounded (accumulation); `store(pass, piece)` writes the
// lane's piece (and masks it).
template <int BlockN, class Adjust, class Store>
__device__ __forceinline__ void bf16_epilogue(const float* res, uint8_t* stage_out, int lane, Adjust&& adjust,
                                              Store&& store) {
  const int col_in_frag = 2 * (lane % 4);
#pragma unroll
  for (int cc = 0; cc < BlockN / kEpilogueCols; ++cc) {
#pragma unroll
    for (int jj = 0; jj < kEpilogueCols / 8; ++jj) {
      const int j = cc * (kEpilogueCols / 8) + jj;
      float v[4] = {res[4 * j], res[4 * j + 1], res[4 * j + 2], res[4 * j + 3]};
      adjust(j, v);
      uint8_t* at = stage_out + (lane / 4) * kEpilogueRowBytes + 16 * jj + 2 * col_in_frag;
      *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(v[0], v[1]);
      *reinterpret_cast<__nv_bfloat162*>(at + 8 * kEpilogueRowBytes) = __floats2bfloat162_rn(v[2], v[3]);
    }
    __syncwarp();
    store(cc, *reinterpret_cast<const uint4*>(stage_out + (lane / 2) * kEpilogueRowBytes + 16 * (lane % 2)));
    __syncwarp();  // every lane has read before the next pass overwrites
  }
}

// A math warp's 16 x BlockN fragment as a bf16 strip in shared memory, the
// layout of the TMA-store epilogues: boxes of 16 rows x BoxCols columns,
// BoxCols * 2-byte rows with the swizzle of that width (block_scaled.h:
// kStoreBoxCols, 64-byte rows; the wgrad kernel's kWgradStoreBoxCols,
// 128-byte rows).  Fragment j (tile columns 8j..8j+7) is one 16-byte chunk
// of a row in box j / (BoxCols / 8), at chunk (j % C) ^ ((row / S) % C) with
// C = BoxCols / 8 chunks a row (S = 2 for 64-byte rows, 1 for 128: the
// swizzle's pattern).  One stmatrix x4 writes fragments j and j + 1 (four
// 8 x 8 matrices: rows 0-7 and 8-15 of each; lanes 8m..8m+7 address matrix
// m's rows), a quarter of the shared-store instructions of 4-byte stores
// from the wgmma fragment; either swizzle puts the 8 rows of a matrix in 8
// distinct bank groups.  Ends with the proxy fence and a warp barrier: lane 0
// may then hand the boxes to bulk tensor stores.
template <int BlockN, int BoxCols = kStoreBoxCols>
__device__ __forceinline__ void write_bf16_strip(const float* res, uint8_t* strip, int lane) {
#if LPMOE_SM90A_DEVICE
  static_assert(BoxCols == 32 || BoxCols == 64, "64- or 128-byte box rows");
  static_assert(BlockN % 16 == 0, "stmatrix x4 takes two fragments");
  static_assert(BlockN % BoxCols == 0, "whole store boxes");
  constexpr int kChunks = BoxCols / 8;              // 16-byte chunks a box row
  constexpr int kBoxBytes = store_box_bytes(BoxCols);
  const int row = (lane % 8) + 8 * ((lane / 8) % 2);  // the strip row this lane addresses
  const int second = lane / 16;                         // 1: the lane addresses fragment j + 1
  const int swz = (BoxCols == 32 ? row >> 1 : row) & (kChunks - 1);
  uint8_t* at_row = strip + row * (BoxCols * 2);
  auto bf16x2 = [](float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  };
#pragma unroll
  for (int j = 0; j < BlockN / 8; j += 2) {  // j even: fragments j and j + 1 share a box
    uint8_t* at = at_row + (j / kChunks) * kBoxBytes + ((((j % kChunks) + second) ^ swz) * 16);
    cute::SM90_U32x4_STSM_N::copy(bf16x2(res[4 * j], res[4 * j + 1]), bf16x2(res[4 * j + 2], res[4 * j + 3]),
                                  bf16x2(res[4 * j + 4], res[4 * j + 5]), bf16x2(res[4 * j + 6], res[4 * j + 7]),
                                  *reinterpret_cast<cute::uint128_t*>(at));
  }
  cute::tma_store_fence();  // generic-proxy writes visible to the bulk copies
  __syncwarp();
#endif
}

// The TMA-store epilogue shared by the fprop/dgrad and wgrad kernels: the
// warp writes its strip (write_bf16_strip), then lane 0 hands each box to
// `store_box(box, col)` (a 2-D or 3-D bulk tensor store: the kernels' output
// maps differ) for tile columns col = col0 + b * BoxCols, skipping boxes
// wholly past n_cols (the map clips a partial one), and commits them as one
// bulk group.  The caller makes sure the strip is free.
template <int BlockN, int BoxCols = kStoreBoxCols, class StoreBox>
__device__ __forceinline__ void store_bf16_strip(const float* res, uint8_t* strip, int lane, int col0, int n_cols,
                                                 StoreBox&& store_box) {
  write_bf16_strip<BlockN, BoxCols>(res, strip, lane);
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < BlockN / BoxCols; ++b) {
      if (col0 + b * BoxCols < n_cols) store_box(strip + b * store_box_bytes(BoxCols), col0 + b * BoxCols);
    }
    cute::tma_store_arrive();
  }
}

}  // namespace fp8_gemm
}  // namespace lpmoe
