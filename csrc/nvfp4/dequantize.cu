// NVFP4 dequantize (rowwise copy): y = OType(fl(e2m1 * fl(fl(sf * amax) *
// fl(1/2688)))) (formats.md §3.3), compact or swizzled scales, per-member amax.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "common/dequant_vec.cuh"
#include "common/mx_numerics.cuh"
#include "common/numerics.cuh"
#include "grouped/row_tiles.cuh"
#include "nvfp4/nvfp4.h"

namespace lpmoe {
namespace nvfp4 {
namespace {

using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;
constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int kRows = 8;

template <typename OType>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const DequantizeArgs a) {
  const int bx = static_cast<int>(ceil_div<int64_t>(a.cols, kTile));
  TileInfo ti;
  if (!locate_tile(a.group, a.rows, blockIdx.x / bx, ti) || ti.m % 16) return;
  const int64_t K = a.cols;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x % bx) * kTile;
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  if (c * kVec >= K - col0) return;
  const int64_t sx = round_up<int64_t>(K / 16, 4);
  const int64_t scale_base = ti.pad128_start * sx;
  const float amax = a.amax[ti.member];
  const float rcp2688 = static_cast<float>(1.0 / 2688.0);
  // Rows g*8..g*8+7 from running offsets; every load, scale bytes
  // included, is issued before the first conversion.
  const int64_t first_row = ti.row0 + g * kRows;
  const uint8_t* src = a.data + first_row * (K / 2) + (col0 + c * kVec) / 2;
  const int64_t i0 = ti.local_tile * kTile + g * kRows;
  const int64_t j = (col0 + c * kVec) / 16;
  const uint8_t* scale = a.scale + scale_base + (a.swizzled ? swizzled_index(i0, j, sx / 4) : i0 * sx + j);
  const int64_t scale_step = a.swizzled ? 16 : sx;  // inside one 128-row tile
  uint32_t packed[kRows];
  uint8_t sf[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r, src += K / 2) {
    if (g * kRows + r < ti.rows_valid) {
      packed[r] = __ldg(reinterpret_cast<const uint32_t*>(src));
      sf[r] = __ldg(scale + r * scale_step);
    }
  }
  OType* out = static_cast<OType*>(a.out) + first_row * K + col0 + c * kVec;
#pragma unroll
  for (int r = 0; r < kRows; ++r, out += K) {
    if (g * kRows + r >= ti.rows_valid) continue;
    const float fin = __fmul_rn(__fmul_rn(fp8_to_float<false>(sf[r]), amax), rcp2688);
    float v[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = __fmul_rn(e2m1_decode((packed[r] >> (4 * e)) & 0xF), fin);
    store8<OType>(out, v);
  }
}

}  // namespace

cudaError_t launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  if (a.cols % 16 != 0) return cudaErrorInvalidValue;
  const int64_t bx = ceil_div<int64_t>(a.cols, kTile);
  if (a.max_row_tiles * bx > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (a.rows == 0 || a.cols == 0 || a.max_row_tiles == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.max_row_tiles * bx));
  switch (a.out_dtype) {
    case DType::kFloat32: dequantize_kernel<float><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::kBFloat16: dequantize_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::kFloat16: dequantize_kernel<__half><<<grid, kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace nvfp4
}  // namespace lpmoe
