// Small host/device helpers shared by every kernel family.
// Pure CUDA: no torch headers, so kernels compile fast and can be tested alone.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace lpmoe {

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

template <typename T>
__host__ __device__ constexpr T round_up(T a, T b) {
  return ceil_div(a, b) * b;
}

// Launchers return the launch status instead of throwing, so the kernels stay
// free of any framework; the binding layer turns errors into Python exceptions.
inline cudaError_t last_launch_error() { return cudaGetLastError(); }

}  // namespace lpmoe

#define LPMOE_RETURN_IF_ERROR(expr)          \
  do {                                       \
    cudaError_t lpmoe_err_ = (expr);         \
    if (lpmoe_err_ != cudaSuccess) return lpmoe_err_; \
  } while (0)
