// Small memory-bound helpers of the grouped GEMM (no CUTLASS): the bias /
// capacity-tail epilogue of token-grouped outputs and the zeroing of the
// weight gradients of empty members.  Both read member boundaries from the
// device prefix sums, so they are capturable with changing routing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda_utils.h"
#include "gemm/grouped_gemm.h"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace gemm {
namespace {

template <class T>
__device__ __forceinline__ float ld_f(const T* p) { return float(*p); }
template <>
__device__ __forceinline__ float ld_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <>
__device__ __forceinline__ float ld_f(const __half* p) { return __half2float(*p); }

template <class T>
__device__ __forceinline__ T st_f(float v) { return T(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 st_f(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half st_f(float v) { return __float2half_rn(v); }

// One block per row (grid-stride): a row below the used rows adds its
// member's bias, a row past them is zeroed (if asked).
template <class T>
__global__ void row_epilogue_kernel(T* y, const T* bias, grouped::GroupRows rows, int num_groups, int64_t total_rows,
                                    int64_t n, bool zero_tail) {
  const int64_t used = rows.row ? __ldg(rows.row + num_groups) : total_rows;
  for (int64_t r = blockIdx.x; r < total_rows; r += gridDim.x) {
    T* yr = y + r * n;
    if (r >= used) {
      if (!zero_tail) return;  // rows only grow from here: nothing left to do
      for (int64_t c = threadIdx.x; c < n; c += blockDim.x) yr[c] = st_f<T>(0.0f);
      continue;
    }
    if (bias == nullptr) continue;
    const int t = rows.row ? grouped::find_member(rows.row, num_groups + 1, r) : 0;
    const T* b = bias + int64_t(t) * n;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) yr[c] = st_f<T>(ld_f(yr + c) + ld_f(b + c));
  }
}

// Zero rows [rows.row[G], total_rows) of y: the capacity tail, whose size is
// only known on the device.  16-byte stores when the tail's byte range is
// 16-byte aligned (row_bytes % 16 == 0 and y aligned), else one element each.
template <class T>
__global__ void zero_tail_kernel(T* y, grouped::GroupRows rows, int num_groups, int64_t total_rows, int64_t n,
                                 bool vec16) {
  const int64_t used = rows.row ? __ldg(rows.row + num_groups) : total_rows;
  if (used >= total_rows) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (vec16) {
    constexpr int64_t kPer = 16 / sizeof(T);
    uint4* p = reinterpret_cast<uint4*>(y + used * n);
    const int64_t count = (total_rows - used) * n / kPer;
    for (int64_t i = first; i < count; i += stride) p[i] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  T* p = y + used * n;
  const int64_t count = (total_rows - used) * n;
  for (int64_t i = first; i < count; i += stride) p[i] = st_f<T>(0.0f);
}

// Member t's (N, K) block is `bytes` long, a multiple of 16.
__global__ void zero_empty_kernel(char* d, grouped::GroupRows rows, int64_t bytes) {
  const int t = blockIdx.y;
  if (rows.row != nullptr && __ldg(rows.row + t + 1) != __ldg(rows.row + t)) return;
  uint4* p = reinterpret_cast<uint4*>(d + int64_t(t) * bytes);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes / 16; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(0u, 0u, 0u, 0u);
}

}  // namespace

cudaError_t grouped_row_epilogue(void* y, const void* bias, int dtype, const grouped::GroupRows& rows,
                                 int num_groups, int64_t total_rows, int64_t n, bool zero_tail,
                                 cudaStream_t stream) {
  if (total_rows <= 0 || n <= 0 || (bias == nullptr && !zero_tail)) return cudaSuccess;
  if (bias == nullptr) {
    // Tail only.  One block per row of the whole buffer (the bias path) cost
    // ~12 us per 16k rows even with nothing to do; 512 blocks of 256 threads
    // keep enough 16-byte stores in flight for a long tail.
    const int64_t esz = dtype == 2 ? 4 : 2;
    const bool vec16 = (n * esz) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
    const int blocks = 512;
    switch (dtype) {
      case 0:
        zero_tail_kernel<<<blocks, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(y), rows, num_groups, total_rows, n,
                                                     vec16);
        break;
      case 1:
        zero_tail_kernel<<<blocks, 256, 0, stream>>>(static_cast<__half*>(y), rows, num_groups, total_rows, n, vec16);
        break;
      case 2:
        zero_tail_kernel<<<blocks, 256, 0, stream>>>(static_cast<float*>(y), rows, num_groups, total_rows, n, vec16);
        break;
      default:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  const int blocks = int(total_rows < 65536 ? total_rows : 65536);
  const int threads = n >= 256 ? 256 : 128;
  switch (dtype) {
    case 0:
      row_epilogue_kernel<<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(y),
                                                          static_cast<const __nv_bfloat16*>(bias), rows, num_groups,
                                                          total_rows, n, zero_tail);
      break;
    case 1:
      row_epilogue_kernel<<<blocks, threads, 0, stream>>>(static_cast<__half*>(y), static_cast<const __half*>(bias),
                                                          rows, num_groups, total_rows, n, zero_tail);
      break;
    case 2:
      row_epilogue_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(y), static_cast<const float*>(bias),
                                                          rows, num_groups, total_rows, n, zero_tail);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t zero_empty_wgrad(void* d, size_t elem_bytes, const grouped::GroupRows& rows, int num_groups, int64_t n,
                             int64_t k, cudaStream_t stream) {
  const int64_t bytes = n * k * int64_t(elem_bytes);
  if (num_groups <= 0 || bytes == 0) return cudaSuccess;
  if (bytes % 16) return cudaErrorInvalidValue;
  const int64_t vec_blocks = (bytes / 16 + 255) / 256;
  dim3 grid(unsigned(vec_blocks < 64 ? vec_blocks : 64), unsigned(num_groups));
  zero_empty_kernel<<<grid, 256, 0, stream>>>(static_cast<char*>(d), rows, bytes);
  return cudaGetLastError();
}

}  // namespace gemm
}  // namespace lpmoe
