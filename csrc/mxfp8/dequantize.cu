// MXFP8 dequantize: y = OType(fl(2^(e-127) * float(q))) (formats.md §2.4),
// rowwise or columnwise source, compact or swizzled scales, any shape kind.
// The output has the data's element layout (members at the same offsets).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "common/dequant_vec.cuh"
#include "common/mx_numerics.cuh"
#include "common/numerics.cuh"
#include "common/vec_io.cuh"
#include "mxfp8/member_tiles.cuh"
#include "mxfp8/mxfp8.h"

namespace lpmoe {
namespace mxfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int kRows = 8;

template <typename OType, bool kE5M2, bool kColumnwise>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const DequantizeArgs args) {
  MxTile t;
  if (!locate_mx_tile(args.members, args.rows, args.cols, args.numel, blockIdx.x, t)) return;
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  if (c * kVec >= t.cols_valid) return;
  const uint8_t* q = static_cast<const uint8_t*>(args.data);
  OType* out = static_cast<OType*>(args.out);

  uint2 bytes[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = g * kRows + r;
    if (row < t.rows_valid)
      bytes[r] = __ldg(reinterpret_cast<const uint2*>(q + t.data_base + (t.r0 + row) * t.k + t.c0 + c * kVec));
  }
  float col_mult[kVec];
  if constexpr (kColumnwise) {
    const int64_t mblk = (t.r0 + g * kRows) / 32;
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      col_mult[e] = exp2f_e8m0(args.scale[col_scale_index(t, mblk, t.c0 + c * kVec + e, args.swizzled)]);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = g * kRows + r;
    if (row >= t.rows_valid) continue;
    float m = 0.0f;
    if constexpr (!kColumnwise)
      m = exp2f_e8m0(args.scale[row_scale_index(t, t.r0 + row, t.c0 / 32 + c / 4, args.swizzled)]);
    OType* dst = out + t.data_base + (t.r0 + row) * t.k + t.c0 + c * kVec;
    if constexpr (kColumnwise) dequant8_store<OType, kE5M2>(dst, bytes[r], col_mult);
    else dequant8_store<OType, kE5M2>(dst, bytes[r], m);
  }
}

template <typename OType, bool kE5M2>
cudaError_t launch_dir(const DequantizeArgs& a, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(a.num_tiles));
  if (a.columnwise) dequantize_kernel<OType, kE5M2, true><<<grid, kThreads, 0, s>>>(a);
  else dequantize_kernel<OType, kE5M2, false><<<grid, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

template <typename OType>
cudaError_t launch_typed(const DequantizeArgs& a, cudaStream_t s) {
  return a.e5m2 ? launch_dir<OType, true>(a, s) : launch_dir<OType, false>(a, s);
}

}  // namespace

cudaError_t launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  if (a.num_tiles < 0 || a.num_tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (!a.members.by_elements && a.cols % 16 != 0) return cudaErrorInvalidValue;
  if (a.num_tiles == 0) return cudaSuccess;
  switch (a.out_dtype) {
    case DType::kFloat32: return launch_typed<float>(a, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch_typed<__half>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mxfp8
}  // namespace lpmoe
