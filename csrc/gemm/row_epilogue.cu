// Small memory-bound helpers of the grouped GEMM (no CUTLASS): the bias /
// capacity-tail epilogue of token-grouped outputs and the zeroing of the
// weight gradients of empty members.  Both read member boundaries from the
// device prefix sums, so they are capturable with changing routing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

__global__ void zero_empty_kernel(float* d, grouped::GroupRows rows, int64_t nk) {
  const int t = blockIdx.y;
  if (rows.row != nullptr && __ldg(rows.row + t + 1) != __ldg(rows.row + t)) return;
  float4* p = reinterpret_cast<float4*>(d + int64_t(t) * nk);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nk / 4; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (blockIdx.x == 0 && threadIdx.x < (nk & 3)) d[int64_t(t) * nk + (nk & ~int64_t(3)) + threadIdx.x] = 0.0f;
}

}  // namespace

cudaError_t grouped_row_epilogue(void* y, const void* bias, int dtype, const grouped::GroupRows& rows,
                                 int num_groups, int64_t total_rows, int64_t n, bool zero_tail,
                                 cudaStream_t stream) {
  if (total_rows <= 0 || n <= 0 || (bias == nullptr && !zero_tail)) return cudaSuccess;
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

cudaError_t zero_empty_wgrad(float* d, const grouped::GroupRows& rows, int num_groups, int64_t n, int64_t k,
                             cudaStream_t stream) {
  const int64_t nk = n * k;
  if (num_groups <= 0 || nk == 0) return cudaSuccess;
  const int64_t vec_blocks = (nk / 4 + 255) / 256;
  dim3 grid(unsigned(vec_blocks < 64 ? (vec_blocks > 0 ? vec_blocks : 1) : 64), unsigned(num_groups));
  zero_empty_kernel<<<grid, 256, 0, stream>>>(d, rows, nk);
  return cudaGetLastError();
}

}  // namespace gemm
}  // namespace lpmoe
