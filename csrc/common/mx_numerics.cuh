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
//
// Bit arithmetic instead of one compare per rounding threshold (about half
// the instructions; NVFP4 quantize on Hopper is bound by them).  Equal to
// the threshold count "code = #{0.25 <, 0.75 <=, 1.25 <, 1.75 <=, 2.5 <,
// 3.5 <=, 5 <} |y|" for all 2^32 inputs (checked exhaustively on the host):
//   |y| < 2: E2M1 steps are 0.5 apart there; |y| + 2^22 (whose ulp is 0.5)
//            rounds |y| to a multiple of 0.5, ties to even, in one fp32
//            addition, and the sum's low mantissa bits count the halves (0..4).
//   |y| >= 2 (inf, NaN too): round the bit pattern to one mantissa bit,
//            ties to even (add 0x1FFFFF plus the kept bit, carries ripple into
//            the exponent); bits 22.. are then 2 * exponent + mantissa, which
//            is code + 252; saturate at 7.
__device__ __forceinline__ uint32_t e2m1_encode(float y) {
  const uint32_t bits = __float_as_uint(y);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const float a = __uint_as_float(mag);
  const uint32_t halves = __float_as_uint(__fadd_rn(a, 4194304.0f)) - 0x4A800000u;
  const uint32_t rounded = mag + 0x1FFFFFu + ((mag >> 22) & 1u);
  const uint32_t code = a < 2.0f ? halves : min((rounded >> 22) - 252u, 7u);
  const uint32_t sign = mag > 0x7F800000u ? 0u : (bits >> 28) & 8u;  // NaN: no sign
  return sign | code;
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
