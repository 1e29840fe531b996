// Element math of the expert-MLP activations, forward and backward.
//
// Every operation is an explicit IEEE round-to-nearest-even fp32 intrinsic
// (__fmul_rn, __fadd_rn, __fmaf_rn: nothing is contracted behind our back),
// the exponential is lpmoe's own (fused multiply-adds, a power-of-two scale)
// and the reciprocal is correctly rounded, so the pure-PyTorch reference
// (python/lpmoe/reference/activation.py) computes the same bits on the CPU.
// Nothing branches per element (selects only), so the compiler can
// interleave the independent elements of a thread.  docs/activation-notes.md
// writes the formulas out.
#pragma once

#include <cstdint>

#include "activation/activation.h"

namespace lpmoe {
namespace activation {
namespace math {

__device__ __forceinline__ float f32(uint32_t bits) { return __uint_as_float(bits); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }

__device__ __forceinline__ float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }

// min(max(x, lo), hi) that keeps NaN (fminf/fmaxf would drop it).
__device__ __forceinline__ float clamp_nan(float x, float lo, float hi) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(x), "f"(lo));
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(y), "f"(hi));
  return y;
}

// e^x as the sigmoid below needs it, branch- and select-free: x clamped to
// [-86, 87.5] (NaN kept); n = rint(x log2 e), from one fused multiply-add
// of 1.5 * 2^23 (the exact product rounded once); r = fma(-n, LN2_LO,
// fma(-n, LN2_HI, x)); p(r) a degree-6 polynomial by Horner's rule in fused
// multiply-adds (minimax for relative error on |r| <= ln2 / 2 with 1 and 1
// as its two lowest coefficients: 3.8e-9 relative with the coefficients
// rounded to fp32, 0.064 ulp), times 2^n.
// Inside the clamp this is the spec's exp bit for bit (docs/activation-notes.md;
// p * 2^n is normal there, so one exact multiply by 2^n equals the spec's
// two half-steps).  Outside it the spec's exp would go on towards 0 or +inf,
// and the sigmoid cannot tell the difference: e^-86 < 2^-24, so 1 + e rounds
// to 1 either way, and e^87.5 > 2^126, where rcp_lp gives 0 either way.
// That saves the two-step scaling (6-7 instructions per element) of an
// issue-heavy kernel; the fused j and the degree-6 polynomial save two more
// (the spec before stop 60 had a separate multiply and add for j and the
// degree-7 Taylor polynomial: same accuracy, 0.9 ulp at most either way).
// 2^n comes from j's bits: j = 1.5 * 2^23 + n, and (j << 23) keeps n << 23
// (the constant's low 9 bits are 0); a NaN j gives the finite 0.5, so a NaN
// p stays NaN.
__device__ __forceinline__ float exp_for_sigmoid(float x) {
  const float xc = clamp_nan(x, -86.0f, 87.5f);
  const float j = fma(xc, f32(0x3FB8AA3Bu), 12582912.0f);  // + 1.5 * 2^23: rint in the low bits
  const float n = sub(j, 12582912.0f);
  const float r = fma(-n, f32(0x35BFBE8Eu), fma(-n, f32(0x3F317200u), xc));
  float p = f32(0x3AB51226u);                 // c6
  p = fma(p, r, f32(0x3C091CEAu));            // c5
  p = fma(p, r, f32(0x3D2AAC79u));            // c4
  p = fma(p, r, f32(0x3E2AAA49u));            // c3
  p = fma(p, r, f32(0x3EFFFFFEu));            // c2
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  const uint32_t pow2n = (__float_as_uint(j) << 23) + 0x3F800000u;  // n in [-124, 126]: normal
  return mul(p, __uint_as_float(pow2n));
}

// 1 / y for finite y >= 1 (the sigmoid's y is at most 1 + e^87.5), correctly
// rounded, and 0 where that is subnormal (y > 2^126); branch- and
// select-free: the reciprocal approximation (which flushes such results to
// 0) refined by one FMA Newton step, the sequence CUDA's own IEEE reciprocal
// uses for operands whose result is normal.  (Before stop 60 a compare and
// select gave 0 from 2^125 on.)
__device__ __forceinline__ float rcp_lp(float y) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(y));
  return fma(r0, -fma(y, r0, -1.0f), r0);
}

// 1 / (1 + e^-x), branch-free (0 for x below about -87.34, 126 ln 2).
__device__ __forceinline__ float sigmoid_lp(float x) { return rcp_lp(add(1.0f, exp_for_sigmoid(-x))); }

// gelu(x) (tanh form) = x * sigmoid(y), y = GELU_C (x + GELU_A x^3); returns
// the value and sets s = sigmoid(y).
__device__ __forceinline__ float gelu_value(float x, float& s) {
  const float y = mul(f32(0x3FCC422Au), add(x, mul(f32(0x3D372713u), mul(mul(x, x), x))));
  s = sigmoid_lp(y);
  return mul(x, s);
}

// d gelu / dx = s + (x (s (1 - s))) dy/dx,  dy/dx = GELU_C (1 + GELU_3A x^2),
// the last product and sum as one fused multiply-add.
__device__ __forceinline__ float gelu_grad(float x, float s) {
  const float dy = mul(f32(0x3FCC422Au), add(1.0f, mul(f32(0x3E095D4Fu), mul(x, x))));
  return fma(mul(x, mul(s, sub(1.0f, s))), dy, s);
}

__device__ __forceinline__ float clamp_gate(float g, float limit) { return g > limit ? limit : g; }
__device__ __forceinline__ float clamp_value(float v, float limit) {
  return v > limit ? limit : (v < -limit ? -limit : v);
}

// SwiGLU from its gate's sigmoid s (computed here, or looked up:
// sigmoid_table.cuh): u = (g s) v and the gradients for q = dL/du.
// d(g s)/dg = s (1 + g (1 - s)) is taken as fma(g s, 1 - s, s) (one
// rounding fewer): g s is already there, so two instructions instead of four.
__device__ __forceinline__ float swiglu_forward(float g, float v, float s) { return mul(mul(g, s), v); }
__device__ __forceinline__ void swiglu_backward(float g, float v, float q, float s, float& dg, float& dv, float& u) {
  const float si = mul(g, s);
  u = mul(si, v);
  dv = mul(q, si);
  dg = mul(mul(q, v), fma(si, sub(1.0f, s), s));
}

// Forward: u = act(g) [* v for GLU kinds]; `v` unused otherwise.
template <Kind K>
__device__ __forceinline__ float forward(float g, float v, const Params& p) {
  if constexpr (K == Kind::kSwiGLU) {
    return swiglu_forward(g, v, sigmoid_lp(g));
  } else if constexpr (K == Kind::kGeGLU) {
    float s;
    return mul(gelu_value(g, s), v);
  } else if constexpr (K == Kind::kGELU) {
    float s;
    return gelu_value(g, s);
  } else if constexpr (K == Kind::kReLU) {
    return g < 0.0f ? 0.0f : g;
  } else {
    const float gc = clamp_gate(g, p.limit);
    const float glu = mul(gc, sigmoid_lp(mul(p.alpha, gc)));
    return mul(glu, add(clamp_value(v, p.limit), 1.0f));
  }
}

// Backward with q = dL/du: dg (and dv for GLU kinds), and u for the probs
// gradient and the recomputed output.
template <Kind K>
__device__ __forceinline__ void backward(float g, float v, float q, const Params& p, float& dg, float& dv,
                                         float& u) {
  if constexpr (K == Kind::kSwiGLU) {
    swiglu_backward(g, v, q, sigmoid_lp(g), dg, dv, u);
  } else if constexpr (K == Kind::kGeGLU) {
    float s;
    const float ge = gelu_value(g, s);
    u = mul(ge, v);
    dv = mul(q, ge);
    dg = mul(mul(q, v), gelu_grad(g, s));
  } else if constexpr (K == Kind::kGELU) {
    float s;
    u = gelu_value(g, s);
    dg = mul(q, gelu_grad(g, s));
    dv = 0.0f;
  } else if constexpr (K == Kind::kReLU) {
    u = g < 0.0f ? 0.0f : g;
    dg = g > 0.0f ? q : 0.0f;
    dv = 0.0f;
  } else {
    const float gc = clamp_gate(g, p.limit);
    const float vc = clamp_value(v, p.limit);
    const float y = mul(p.alpha, gc);
    const float s = sigmoid_lp(y);
    const float glu = mul(gc, s);
    u = mul(glu, add(vc, 1.0f));
    dv = (v >= -p.limit && v <= p.limit) ? mul(q, glu) : 0.0f;
    dg = g <= p.limit ? mul(mul(q, add(vc, 1.0f)), fma(mul(y, s), sub(1.0f, s), s)) : 0.0f;
  }
}

}  // namespace math
}  // namespace activation
}  // namespace lpmoe
