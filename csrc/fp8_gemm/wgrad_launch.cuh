// Launcher template of the wgrad kernel; wgrad_n<N>.cu instantiate it once
// per tile width (compile time stays per file).
#pragma once

#include "fp8_gemm/cluster_launch.h"
#include "fp8_gemm/wgrad_kernel.cuh"

namespace lpmoe {
namespace fp8_gemm {

template <int BlockN, int Cluster>
cudaError_t launch_wgrad(const WgradParams& p, int grid, cudaStream_t stream) {
  return launch_cluster_kernel(fp8_block_wgrad_kernel<BlockN, Cluster>, grid, Cluster,
                               WgradLayout<BlockN>::smem_bytes(p.num_groups), stream, p);
}

#define LPMOE_INSTANTIATE_WGRAD(N)                                                       \
  template cudaError_t launch_wgrad<N, 1>(const WgradParams&, int, cudaStream_t);      \
  template cudaError_t launch_wgrad<N, 2>(const WgradParams&, int, cudaStream_t);

}  // namespace fp8_gemm
}  // namespace lpmoe
