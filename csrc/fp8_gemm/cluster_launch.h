// Launch of a persistent 384-thread kernel of this family with its dynamic
// shared memory and a 1-D cluster (host side, shared by the fprop/dgrad and
// wgrad launchers).
#pragma once

#include <cuda_runtime.h>  // the templated cudaLaunchKernelEx

#include <cstddef>
#include <utility>

namespace lpmoe {
namespace fp8_gemm {

template <class... KernelArgs, class... Args>
cudaError_t launch_cluster_kernel(void (*kernel)(KernelArgs...), int grid, int cluster, size_t smem,
                                  cudaStream_t stream, Args&&... args) {
  // Not a stream operation: fine during graph capture, and cheap.
  cudaError_t st = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (st != cudaSuccess) return st;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(384, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace fp8_gemm
}  // namespace lpmoe
