// Shared helpers of the thin ATen binding layer.  Kernels live in the family
// folders and never see torch types; these helpers validate tensors and turn
// launcher status codes into Python exceptions.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <string>

#include "common/dtypes.h"
#include "grouped/group_rows.h"

#define LPMOE_CHECK_LAUNCH(expr, what)                                                     \
  do {                                                                                    \
    cudaError_t lpmoe_status_ = (expr);                                                   \
    TORCH_CHECK(lpmoe_status_ == cudaSuccess, "lpmoe: launching ", what, " failed: ",    \
                cudaGetErrorString(lpmoe_status_));                                      \
  } while (0)

namespace lpmoe {
namespace binding {

// A tensor subclass that only wraps another tensor (torch.distributed's
// AsyncCollectiveTensor before anything waits on it, a DTensor, a fake
// tensor) has a storage without memory: its data pointer is 0, or for a view
// at an offset a small non-zero number, and a kernel given it would read
// near address 0.  The storage's own pointer is null in both cases.
inline void check_has_memory(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || (t.has_storage() && t.storage().data() != nullptr), "lpmoe: `", name,
              "` has no device memory of its own (a wrapper tensor subclass?): pass a plain tensor, e.g. "
              "wait on a pending collective's result first (torch.distributed._functional_collectives.wait_tensor)");
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "lpmoe: `", name, "` must be a CUDA tensor, got device ", t.device());
  check_has_memory(t, name);
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "lpmoe: `", name, "` must be contiguous");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "lpmoe: `", name, "` is on ", t.device(), " but `",
              ref_name, "` is on ", ref.device());
}

// A tensor a kernel indexes as a dense array: on ref's device, of dtype
// `dt`, contiguous, exactly `numel` elements.
inline void check_dense(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name,
                        at::ScalarType dt, int64_t numel) {
  check_same_device(t, ref, name, ref_name);
  TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.numel() == numel, "lpmoe: `", name,
              "` must be a contiguous ", dt, " tensor of ", numel, " elements, got ", t.scalar_type(), " ",
              t.numel());
}

// A buffer a kernel reads or writes with vector accesses: contiguous, on the
// reference device, 16-byte aligned, of the expected element size, and at
// least `min_numel` elements long.
inline void check_buffer(const at::Tensor& t, const at::Tensor& ref, const char* name, int64_t elem_size,
                         int64_t min_numel) {
  check_same_device(t, ref, name, "input");
  check_contiguous(t, name);
  check_has_memory(t, name);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "lpmoe: `", name, "` must be 16-byte aligned");
  TORCH_CHECK(t.element_size() == elem_size, "lpmoe: `", name, "` must have ", elem_size,
              "-byte elements, got ", t.scalar_type());
  TORCH_CHECK(t.numel() >= min_numel, "lpmoe: `", name, "` holds ", t.numel(), " elements, needs at least ",
              min_numel);
}

// Inputs and output of a dequantize launch: quantized data of `data_bytes`
// bytes, scales of `scale_elem_size`-byte elements, out of `numel` elements,
// all on one device, contiguous and 16-byte aligned.
inline void check_dequantize_buffers(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& out,
                                     int64_t scale_elem_size, int64_t data_bytes, int64_t numel) {
  check_cuda(data, "data");
  check_buffer(data, data, "data", 1, data_bytes);
  check_buffer(scale, data, "scale_inv", scale_elem_size, 0);
  check_buffer(out, data, "out", out.element_size(), numel);
}

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

inline void* opt_ptr(const c10::optional<at::Tensor>& t, const at::Tensor& ref, const char* name) {
  if (!t.has_value()) return nullptr;
  check_same_device(*t, ref, name, "input");
  check_contiguous(*t, name);
  return t->data_ptr();
}

inline DType to_hp_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "lpmoe: `", name, "` must be float32, bfloat16 or float16, got ", t);
  }
}

// padded_row_offsets (kPaddedRows, N+1) int64 -> kernel view; None = one member.
constexpr int64_t kPaddedRows = 5;  // row, pad4, pad64, pad128, pad512
inline grouped::GroupRows group_rows_arg(const c10::optional<at::Tensor>& pro, int64_t num_tensors,
                                         const at::Tensor& ref) {
  grouped::GroupRows g;
  g.num_tensors = static_cast<int>(num_tensors);
  if (!pro.has_value()) {
    TORCH_CHECK(num_tensors == 1, "lpmoe: padded_row_offsets is required for num_tensors > 1");
    return g;
  }
  const at::Tensor& p = *pro;
  check_same_device(p, ref, "padded_row_offsets", "input");
  TORCH_CHECK(p.scalar_type() == at::kLong && p.dim() == 2 && p.size(0) == kPaddedRows &&
                  p.size(1) == num_tensors + 1 && p.stride(1) == 1,
              "lpmoe: padded_row_offsets must be int64 (", kPaddedRows,
              ", num_tensors+1) with unit inner stride, got ", p.scalar_type(), " ", p.sizes());
  const int64_t* base = p.data_ptr<int64_t>();
  const int64_t st = p.stride(0);
  g.row = base;
  g.pad4 = base + st;
  g.pad64 = base + 2 * st;
  g.pad128 = base + 3 * st;
  g.pad512 = base + 4 * st;
  return g;
}

}  // namespace binding
}  // namespace lpmoe
