// Launcher template of the block-scaled kernel; block_scaled_n<N>.cu
// instantiate it once per tile width (compile time stays per file).
#pragma once

#include "fp8_gemm/cluster_launch.h"
#include "fp8_gemm/kernel_1x128_128x128.cuh"

namespace lpmoe {
namespace fp8_gemm {

template <int BlockN, int Cluster>
cudaError_t launch_block_scaled(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& d,
                                const BlockScaledParams& p, int grid, cudaStream_t stream) {
  return launch_cluster_kernel(fp8_block_scaled_grouped_kernel<BlockN, Cluster>, grid, Cluster,
                               BlockScaledLayout<BlockN>::smem_bytes(p.num_groups), stream, a, b, d, p);
}

#define LPMOE_INSTANTIATE_BLOCK_SCALED(N)                                                                         \
  template cudaError_t launch_block_scaled<N, 1>(const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, \
                                                 const BlockScaledParams&, int, cudaStream_t);                   \
  template cudaError_t launch_block_scaled<N, 2>(const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, \
                                                 const BlockScaledParams&, int, cudaStream_t);

}  // namespace fp8_gemm
}  // namespace lpmoe
