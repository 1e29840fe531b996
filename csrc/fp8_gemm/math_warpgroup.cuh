// Pieces of the math warpgroups shared by the fprop/dgrad kernel
// (kernel_1x128_128x128.cuh) and the wgrad kernel (wgrad_kernel.cuh): the
// register split of producer and math warpgroups, one K-block of wgmmas, and
// the hand-back of a pipeline stage.
#pragma once

#include "fp8_gemm/block_scaled.h"
#include "fp8_gemm/sm90_primitives.cuh"

namespace lpmoe {
namespace fp8_gemm {

// setmaxnreg split of the 384-thread CTA: the producer warpgroup (one thread
// issues copies) gives its registers to the two math warpgroups, which hold
// a BlockN/2-float scratch accumulator and a BlockN/2-float result each.
constexpr int kProducerRegs = 56;
constexpr int kMathRegs = 224;

// acc = A(64 x 128) B(N x 128)^T of one K-block (four 32-deep wgmmas on the
// stage's swizzled tiles), waited for; the fences keep the compiler from
// touching acc while the tensor cores own it.
template <int N>
__device__ __forceinline__ void kblock_wgmma(uint64_t da, uint64_t db, float* acc) {
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
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
#endif
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

}  // namespace fp8_gemm
}  // namespace lpmoe
