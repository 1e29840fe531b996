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

  // Rows g*8..g*8+7 from running offsets (one add per row); every load,
  // scale bytes included, is issued before the first conversion.
  const int64_t first = t.data_base + (t.r0 + g * kRows) * t.k + t.c0 + c * kVec;
  const uint8_t* src = q + first;
  uint2 bytes[kRows];
  uint32_t row_e8[kRows];
  const uint8_t* row_scale = args.scale + row_scale_index(t, t.r0 + g * kRows, t.c0 / 32 + c / 4, args.swizzled);
  const int64_t row_scale_step = args.swizzled ? 16 : t.sx;  // inside one 128-row tile
#pragma unroll
  for (int r = 0; r < kRows; ++r, src += t.k) {
    if (g * kRows + r < t.rows_valid) {
      bytes[r] = __ldg(reinterpret_cast<const uint2*>(src));
      if constexpr (!kColumnwise) row_e8[r] = __ldg(row_scale + r * row_scale_step);
    }
  }
  float col_mult[kVec];
  if constexpr (kColumnwise) {
    const int64_t mblk = (t.r0 + g * kRows) / 32;
    // column k+1's byte: 16 bytes on when swizzled (same 32-column group), 1 when compact
    const uint8_t* col_scale = args.scale + col_scale_index(t, mblk, t.c0 + c * kVec, args.swizzled);
    const int step = args.swizzled ? 16 : 1;
#pragma unroll
    for (int e = 0; e < kVec; ++e) col_mult[e] = exp2f_e8m0(__ldg(col_scale + e * step));
  }
  OType* dst = out + first;
#pragma unroll
  for (int r = 0; r < kRows; ++r, dst += t.k) {
    if (g * kRows + r >= t.rows_valid) continue;
    if constexpr (kColumnwise) dequant8_store<OType, kE5M2>(dst, bytes[r], col_mult);
    else dequant8_store<OType, kE5M2>(dst, bytes[r], exp2f_e8m0(row_e8[r]));
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
