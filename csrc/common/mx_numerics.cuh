// Numerics of the microscaling formats (formats.md §0, §2.3, §3.2), in
// software so they run on sm_90 (TE uses Blackwell-only conversions).
#pragma once

#include <cstdint>
#include <cstring>

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

// Bits of a float on the host and the device: the E2M1 encode below is also
// compiled into a host program that checks it against the rounding
// thresholds for every fp32 bit pattern (tests/test_e2m1_encode.py).
__host__ __device__ __forceinline__ uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// High word of (hi:lo) << shift, 0 < shift < 32 (SHF.L.HI on the device).
__host__ __device__ __forceinline__ uint32_t funnel_shift_left(uint32_t lo, uint32_t hi, int shift) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, shift);
#else
  return static_cast<uint32_t>(((static_cast<uint64_t>(hi) << 32 | lo) << shift) >> 32);
#endif
}

__host__ __device__ __forceinline__ float f32_add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

__host__ __device__ __forceinline__ float f32_sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// The _rn intrinsics on the device also keep the compiler from contracting
// a product and a difference into one fma (Veltkamp's split below needs both
// roundings).
__host__ __device__ __forceinline__ float f32_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// fp32 -> E2M1 code (0..15): round to nearest even, saturate to +-6, NaN -> +6
// (code 7), sign kept for zero results (formats.md §0).
//
// NVFP4 quantize on Hopper is bound by instruction issue and encodes every
// element twice (both directions), so the encode is arithmetic without
// branches, in two parts.  e2m1_encode puts them together for one value (the
// form the host test checks for every fp32 input); the kernel runs
// e2m1_pack8, which spreads them over eight codes:
//   c = y clamped to [-6, 6] (fminf returns the number when y is NaN: +6);
//       its sign bit is the code's bit 3 (e2m1_pack8 gathers eight signs
//       with one funnel shift each);
//   e2m1_magnitude_biased(|c|) = the magnitude code plus kE2m1Bias, which
//       sits above bit 22 (e2m1_pack8 adds eight of them at bits 4e and
//       removes the eight biases with one subtraction):
//   lo = bits(|c| + 2^22): the ulp of 2^22 is 0.5, so the sum rounds |c| to
//        a multiple of 0.5, ties to even, and its low bits count the halves,
//        the code wherever |c| < 2;
//   hi = b = max(|c|, 1) rounded to one mantissa bit, ties to even, by
//        Veltkamp's split (k = b * (2^22 + 1), h = k - (k - b); exact on
//        [1, 6], the host test checks every input); h's bits >> 22 are
//        2 * exponent + mantissa = code + 252.  Below 1 it is code 2 (1.0),
//        not less than lo.  Float multiplies and adds rather than integer
//        shift-mask-add: the kernel was bound by the ALU pipe (logic, shifts,
//        integer adds, min/max, at half the FMA pipe's rate), which these leave;
//   code = min(lo, hi): equal on [1, 2); on [2, 6] round(2|c|) >= the code.
constexpr uint32_t kE2m1Bias = 0x4A800000u;  // bits of 2^22

__host__ __device__ __forceinline__ float e2m1_clamp(float y) { return fmaxf(fminf(y, 6.0f), -6.0f); }

// The magnitude code plus kE2m1Bias of a in [0, 6] (callers clamp: above 6
// the code would run past 7 into the sign bit).
__host__ __device__ __forceinline__ uint32_t e2m1_magnitude_biased(float a) {
  const uint32_t lo = f32_bits(f32_add_rn(a, 4194304.0f));
  const float b = fmaxf(a, 1.0f);
  const float k = f32_mul_rn(b, 4194305.0f);
  const float h = f32_sub_rn(k, f32_sub_rn(k, b));
  const uint32_t hi = (f32_bits(h) >> 22) + (kE2m1Bias - 252u);
  return lo < hi ? lo : hi;
}

__host__ __device__ __forceinline__ uint32_t e2m1_encode(float y) {
  const float c = e2m1_clamp(y);
  return ((f32_bits(c) >> 28) & 8u) | (e2m1_magnitude_biased(fabsf(c)) - kE2m1Bias);
}

// Eight biased magnitudes added in at bits 4e sum to the eight codes at
// their nibbles plus the eight biases shifted by 4e, mod 2^32 (the shifted
// biases do overlap the nibbles, but addition wraps: the sum of the codes is
// below 2^32 and the biases' sum is a constant), so subtracting that
// constant leaves exactly the codes.
constexpr uint32_t e2m1_bias8() {
  uint32_t s = 0;
  for (int e = 0; e < 8; ++e) s += kE2m1Bias << (4 * e);
  return s;
}
constexpr uint32_t kE2m1Bias8 = e2m1_bias8();

// Eight E2M1 codes in one word, code e in bits 4e..4e+3, of products y(e)
// (x * the block's encode multiplier).  A product is never a negative NaN:
// the GPU's multiply returns the canonical +NaN 0x7FFFFFFF for any NaN
// operand (probed on the H100 for negative, payload and signalling NaNs), so
// y's own sign bit is the code's and only the magnitude is clamped: one
// instruction less than e2m1_encode per element (~4 % of NVFP4 quantize's
// time on the H100).  The funnel shifts move element e's top four bits to
// bits 4e..4e+3 of `signs` (last element first); the mask keeps the signs.
template <typename Product>
__host__ __device__ __forceinline__ uint32_t e2m1_pack8(Product&& y) {
  uint32_t magnitudes = 0, signs = 0;
#pragma unroll
  for (int e = 7; e >= 0; --e) {
    const float v = y(e);
    magnitudes += e2m1_magnitude_biased(fminf(fabsf(v), 6.0f)) << (4 * e);
    signs = funnel_shift_left(f32_bits(v), signs, 4);
  }
  return (signs & 0x88888888u) | (magnitudes - kE2m1Bias8);
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
