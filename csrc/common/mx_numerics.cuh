// Numerics of the microscaling formats (formats.md §0, §2.3, §3.2), in
// software so they run on sm_90 (TE uses Blackwell-only conversions).
#pragma once

#include <cstdint>

#include "common/numerics.cuh"

namespace lpmoe {

// float -> E8M0, rounding toward +inf (bit-identical to cvt.rp.satfinite.ue8m0x2):
// NaN -> 255, inf -> 254, 0 -> 0, (0, 2^-127] -> 0, (2^-127, 2^-126) -> 1.
__device__ __forceinline__ uint32_t float_to_e8m0(float v) {
  if (isnan(v)) return 255;
  if (isinf(v)) return 254;
  if (v == 0.0f) return 0;
  const uint32_t b = __float_as_uint(v);
  uint32_t e = (b >> 23) & 0xFF;
  const uint32_t m = b & 0x7FFFFF;
  if (m > 0 && e != 0xFE && !(e == 0 && m <= 0x400000)) ++e;
  return e;
}

// 2^(127-e): the quantization multiplier.  254 -> 2^-127 (subnormal), 255 -> NaN.
__device__ __forceinline__ float exp2f_rcp(uint32_t e) {
  if (e == 255) return __uint_as_float(0x7FFFFFFFu);
  if (e == 254) return __uint_as_float(0x00400000u);
  return __uint_as_float((254u - e) << 23);
}

// 2^(e-127): the dequantization multiplier.  0 -> 2^-127 (subnormal), 255 -> NaN.
__device__ __forceinline__ float exp2f_e8m0(uint32_t e) {
  if (e == 255) return __uint_as_float(0x7FFFFFFFu);
  if (e == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(e << 23);
}

// GEMM scale swizzle (formats.md §2.3): compact (i, j) of a matrix whose
// padded column count is 4 * n_tiles_x -> byte offset in the swizzled buffer.
__host__ __device__ __forceinline__ int64_t swizzled_index(int64_t i, int64_t j, int64_t n_tiles_x) {
  return ((i / 128) * n_tiles_x + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + (j % 4);
}

// fp32 -> E2M1 code (0..15): round to nearest even, saturate to +-6, NaN -> +6
// (code 7), sign kept for zero results (formats.md §0).
__device__ __forceinline__ uint32_t e2m1_encode(float y) {
  // Branch-free: the code is the number of rounding thresholds |y| passes
  // (ties go to the even code: '>' at ties rounding down, '>=' up), so lanes
  // with different values never diverge.
  const float a = fabsf(y);
  const uint32_t code = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) +
                        static_cast<uint32_t>(a > 1.25f) + static_cast<uint32_t>(a >= 1.75f) +
                        static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
                        static_cast<uint32_t>(a > 5.0f);
  const uint32_t sign = (__float_as_uint(y) >> 31) << 3;
  return isnan(y) ? 7u : (sign | code);
}

__device__ __forceinline__ float e2m1_decode(uint32_t code) {
  const uint32_t c = code & 7;  // magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
  const float v = c < 4 ? 0.5f * static_cast<float>(c) : (c == 7 ? 6.0f : static_cast<float>(c - 2));
  return (code & 8) ? -v : v;
}

// E4M3 byte <-> float (NVFP4 block scales).
__device__ __forceinline__ uint8_t float_to_e4m3_sat(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace lpmoe
