// Shared helpers of the thin ATen binding layer.  Kernels live in the family
// folders and never see torch types; these helpers validate tensors and turn
// launcher status codes into Python exceptions.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <string>

#define LPMOE_CHECK_LAUNCH(expr, what)                                                     \
  do {                                                                                    \
    cudaError_t lpmoe_status_ = (expr);                                                   \
    TORCH_CHECK(lpmoe_status_ == cudaSuccess, "lpmoe: launching ", what, " failed: ",    \
                cudaGetErrorString(lpmoe_status_));                                      \
  } while (0)

namespace lpmoe {
namespace binding {

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "lpmoe: `", name, "` must be a CUDA tensor, got device ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "lpmoe: `", name, "` must be contiguous");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "lpmoe: `", name, "` is on ", t.device(), " but `",
              ref_name, "` is on ", ref.device());
}

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

}  // namespace binding
}  // namespace lpmoe
