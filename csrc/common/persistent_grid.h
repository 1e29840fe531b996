// Grid size for persistent kernels: as many CTAs as fit on the device at
// once (occupancy with the given dynamic shared memory), at most one per tile.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/cuda_utils.h"

namespace lpmoe {

template <typename Kernel>
cudaError_t persistent_grid(Kernel kernel, int threads, int dynamic_smem, int64_t tiles, dim3& grid) {
  if (dynamic_smem > 0) {
    LPMOE_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem));
  }
  int device = 0, sms = 0, per_sm = 0;
  LPMOE_RETURN_IF_ERROR(cudaGetDevice(&device));
  LPMOE_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LPMOE_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
  const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  grid = dim3(static_cast<unsigned>(tiles < resident ? tiles : resident));
  return cudaSuccess;
}

}  // namespace lpmoe
