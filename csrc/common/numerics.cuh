// Device numerics shared by the quantization kernels; each function follows
// the project spec (formats.md §0, §1.1) bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace lpmoe {

template <typename T> struct InputTraits;
// Largest finite value of the INPUT dtype: the scale used when fp8_max/amax
// overflows to inf (formats.md §1.1, "value_for_inf").
template <> struct InputTraits<float> {
  static __device__ __forceinline__ float max_finite() { return __int_as_float(0x7F7FFFFF); }
};
template <> struct InputTraits<__nv_bfloat16> {
  static __device__ __forceinline__ float max_finite() { return __int_as_float(0x7F7F0000); }
};
template <> struct InputTraits<__half> {
  static __device__ __forceinline__ float max_finite() { return 65504.0f; }
};

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);  // round to nearest even
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <bool kE5M2> struct Fp8Traits {
  static constexpr __nv_fp8_interpretation_t kInterp = kE5M2 ? __NV_E5M2 : __NV_E4M3;
  static constexpr float kMax = kE5M2 ? 57344.0f : 448.0f;
};

// Two floats -> two FP8 bytes, RNE with saturation to the finite range;
// NaN -> canonical NaN.  Low byte holds `a`.
template <bool kE5M2>
__device__ __forceinline__ uint16_t cvt_fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Traits<kE5M2>::kInterp);
}

template <bool kE5M2>
__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(v, Fp8Traits<kE5M2>::kInterp);
  return __half2float(__half(h));
}

// NaN-ignoring |x| max: fmaxf returns the non-NaN operand.
__device__ __forceinline__ float amax_step(float acc, float x) { return fmaxf(acc, fabsf(x)); }

// formats.md §1.1: eps first, inf/0/NaN amax -> 1, IEEE division, inf ->
// input dtype max, pow2 by masking the mantissa (round down).
__device__ __forceinline__ float compute_block_scale(float amax, float fp8_max, bool pow2, float eps,
                                                     float value_for_inf) {
  if (amax < eps) amax = eps;
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(fp8_max, amax);
  if (isinf(scale)) scale = value_for_inf;
  if (pow2) scale = __int_as_float(__float_as_int(scale) & static_cast<int>(0xFF800000u));
  return scale;
}

}  // namespace lpmoe
