// Launcher template of the wgrad kernel; wgrad_n<N>.cu instantiate it once
// per tile width (compile time stays per file).
#pragma once

#include "fp8_gemm/wgrad_kernel.cuh"

namespace lpmoe {
namespace fp8_gemm {

template <int BlockN, int Cluster>
cudaError_t launch_wgrad(const WgradParams& p, int grid, cudaStream_t stream) {
  using L = WgradLayout<BlockN>;
  auto kernel = fp8_block_wgrad_kernel<BlockN, Cluster>;
  const size_t smem = L::smem_bytes(p.num_groups);
  cudaError_t st = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (st != cudaSuccess) return st;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(384, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = Cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

#define LPMOE_INSTANTIATE_WGRAD(N)                                                       \
  template cudaError_t launch_wgrad<N, 1>(const WgradParams&, int, cudaStream_t);      \
  template cudaError_t launch_wgrad<N, 2>(const WgradParams&, int, cudaStream_t);

}  // namespace fp8_gemm
}  // namespace lpmoe
