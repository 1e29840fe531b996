// Launcher template of the wgrad kernel; wgrad_n<N>.cu instantiate it once
// per tile width and wgrad_n<N>_fp32_accumulate.cu the main_grad kernels
// (compile time stays per file, and the two build in parallel).
#pragma once

#include "fp8_gemm/cluster_launch.h"
#include "fp8_gemm/wgrad_kernel.cuh"

namespace lpmoe {
namespace fp8_gemm {

// p.dynamic_tiles picks the main_grad kernel that takes its tiles from the
// counter (cluster 1 only; tile_feed.cuh).
template <int BlockN, int Cluster, bool Fp32Accumulate>
cudaError_t launch_wgrad(const WgradParams& p, int grid, cudaStream_t stream) {
  const size_t smem = WgradLayout<BlockN, Fp32Accumulate>::smem_bytes(p.num_groups);
  if constexpr (Fp32Accumulate && Cluster == 1) {
    if (p.dynamic_tiles) {
      return launch_cluster_kernel(fp8_block_wgrad_kernel<BlockN, 1, true, true>, grid, 1, smem, stream, p);
    }
  }
  return launch_cluster_kernel(fp8_block_wgrad_kernel<BlockN, Cluster, Fp32Accumulate, false>, grid, Cluster, smem,
                               stream, p);
}

#define LPMOE_INSTANTIATE_WGRAD(N, FP32_ACCUMULATE)                                               \
  template cudaError_t launch_wgrad<N, 1, FP32_ACCUMULATE>(const WgradParams&, int, cudaStream_t); \
  template cudaError_t launch_wgrad<N, 2, FP32_ACCUMULATE>(const WgradParams&, int, cudaStream_t);

}  // namespace fp8_gemm
}  // namespace lpmoe
