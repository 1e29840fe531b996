// Packed FP8 -> float -> OType conversion for the dequantize kernels: one
// 16-byte output vector per call, so a warp's stores cover contiguous bytes.
// Bits are those of the scalar path (fp8 -> half is exact, the product is one
// fp32 multiply, one round-to-nearest-even to OType), but two elements go
// through each conversion instruction instead of one.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/numerics.cuh"
#include "common/vec_io.cuh"

namespace lpmoe {

// Bytes 0 and 1 of `two` (low byte first) as two floats.
template <bool kE5M2>
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), Fp8Traits<kE5M2>::kInterp);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Two floats -> two 16-bit OType values in one word (low half holds `a`), RNE.
template <typename OType>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<OType, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Elements per 16-byte output vector, and the FP8 bytes they come from.
template <typename OType>
struct DequantChunk {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(OType));
  using Bytes = std::conditional_t<kElems == 8, uint2, uint32_t>;
};

// OType(fl(float(q[e]) * scale)) for the chunk's elements, as one 16-byte vector.
template <typename OType, bool kE5M2>
__device__ __forceinline__ uint4 dequant_chunk(typename DequantChunk<OType>::Bytes q, float scale) {
  uint4 out;
  if constexpr (DequantChunk<OType>::kElems == 8) {
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
    const uint32_t w[2] = {q.x, q.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = fp8x2_to_float2<kE5M2>(w[i >> 1] >> (16 * (i & 1)));
      o[i] = pack2<OType>(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
    }
  } else {
    const float2 lo = fp8x2_to_float2<kE5M2>(q);
    const float2 hi = fp8x2_to_float2<kE5M2>(q >> 16);
    out = make_uint4(__float_as_uint(__fmul_rn(lo.x, scale)), __float_as_uint(__fmul_rn(lo.y, scale)),
                     __float_as_uint(__fmul_rn(hi.x, scale)), __float_as_uint(__fmul_rn(hi.y, scale)));
  }
  return out;
}

// Eight fp32 values as OType (round to nearest even) at dst (16-byte
// aligned, in kSpace): one 16-byte store for 16-bit outputs, two for fp32.
template <typename OType, Space kSpace = Space::kGlobal>
__device__ __forceinline__ void store8(OType* dst, const float (&v)[8]) {
  if constexpr (sizeof(OType) == 4) {
    store16<kSpace>(dst, make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                                    __float_as_uint(v[3])));
    store16<kSpace>(dst + 4, make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                                        __float_as_uint(v[7])));
  } else {
    store16<kSpace>(dst, make_uint4(pack2<OType>(v[0], v[1]), pack2<OType>(v[2], v[3]), pack2<OType>(v[4], v[5]),
                                    pack2<OType>(v[6], v[7])));
  }
}

// Eight FP8 bytes (low byte first), element e times scale[e], stored as
// eight OType values at dst (16-byte aligned, in kSpace).
template <typename OType, bool kE5M2, Space kSpace = Space::kGlobal>
__device__ __forceinline__ void dequant8_store(OType* dst, uint2 q, const float (&scale)[8]) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = fp8x2_to_float2<kE5M2>((i < 2 ? q.x : q.y) >> (16 * (i & 1)));
    v[2 * i] = __fmul_rn(f.x, scale[2 * i]);
    v[2 * i + 1] = __fmul_rn(f.y, scale[2 * i + 1]);
  }
  store8<OType, kSpace>(dst, v);
}

// The same with one scale for all eight.
template <typename OType, bool kE5M2, Space kSpace = Space::kGlobal>
__device__ __forceinline__ void dequant8_store(OType* dst, uint2 q, float scale) {
  const float s[8] = {scale, scale, scale, scale, scale, scale, scale, scale};
  dequant8_store<OType, kE5M2, kSpace>(dst, q, s);
}

}  // namespace lpmoe
