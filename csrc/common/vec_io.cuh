// 8-element vector I/O shared by the quantize/dequantize kernels: inputs are
// kept in registers in their own 16-bit (or 32-bit) dtype, outputs are
// written with 16-byte stores.
#pragma once

#include <cstdint>

#include "common/numerics.cuh"

namespace lpmoe {

// 8 input elements in their storage dtype (16 bytes for bf16/fp16, 32 for fp32).
template <typename IType>
struct RawVec8 {
  uint4 w[sizeof(IType) / 2];
};

template <typename IType>
__device__ __forceinline__ void load_vec8(const IType* p, RawVec8<IType>& v) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) v.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
}

template <typename IType>
__device__ __forceinline__ void zero_vec8(RawVec8<IType>& v) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) v.w[i] = make_uint4(0, 0, 0, 0);
}

template <typename IType>
__device__ __forceinline__ float elem(const RawVec8<IType>& v, int e) {
  return to_float<IType>(reinterpret_cast<const IType*>(&v)[e]);
}

// kN (multiple of 8) fp32 values -> OType with round-to-nearest-even, 16-byte stores.
template <typename OType, int kN>
__device__ __forceinline__ void store_vec(OType* p, const float (&v)[kN]) {
  if constexpr (sizeof(OType) == 4) {
#pragma unroll
    for (int i = 0; i < kN / 4; ++i)
      reinterpret_cast<float4*>(p)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      uint4 raw;
      OType* e = reinterpret_cast<OType*>(&raw);
#pragma unroll
      for (int k = 0; k < 8; ++k) e[k] = from_float<OType>(v[8 * i + k]);
      reinterpret_cast<uint4*>(p)[i] = raw;
    }
  }
}

// Column amax of a thread's 8-row x 8-column register block (thread c, g of a
// 128x128 tile, rows 8g..8g+7): max |x| over its 8 rows (NaN ignored),
// combined with lane ^ 16, the warp's other row group -> a 16-row partial.
template <typename IType>
__device__ __forceinline__ void column_amax16(const RawVec8<IType> (&raw)[8], float (&a)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float m = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; ++r) m = amax_step(m, elem<IType>(raw[r], e));
    a[e] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
  }
}

}  // namespace lpmoe
