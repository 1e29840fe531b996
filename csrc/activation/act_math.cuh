// Element math of the expert-MLP activations, forward and backward.
//
// Every operation is an explicit IEEE round-to-nearest-even fp32 intrinsic
// (__fmul_rn, __fadd_rn, __frcp_rn: never contracted into an FMA), and the
// exponential is lpmoe's own (adds, multiplies, a power-of-two scale), so the
// pure-PyTorch reference (python/lpmoe/reference/activation.py) computes the
// same bits on the CPU.  docs/activation-notes.md writes the formulas out.
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

// e^x = 2^n p(r): n = rint(x log2 e), r = (x - n LN2_HI) - n LN2_LO, p the
// degree-7 Taylor polynomial (Horner, separate multiply and add), 2^n applied
// as two exact power-of-two factors so only the last multiply rounds
// (subnormal results included).  +inf when n > 128, 0 when n < -151, NaN
// for NaN.
__device__ __forceinline__ float exp_lp(float x) {
  const float n = rintf(mul(x, f32(0x3FB8AA3Bu)));
  const float r = sub(sub(x, mul(n, f32(0x3F317200u))), mul(n, f32(0x35BFBE8Eu)));
  float p = f32(0x39500D01u);                 // 1/7!
  p = add(mul(p, r), f32(0x3AB60B61u));       // 1/6!
  p = add(mul(p, r), f32(0x3C088889u));       // 1/5!
  p = add(mul(p, r), f32(0x3D2AAAABu));       // 1/4!
  p = add(mul(p, r), f32(0x3E2AAAABu));       // 1/3!
  p = add(mul(p, r), 0.5f);
  p = add(mul(p, r), 1.0f);
  p = add(mul(p, r), 1.0f);
  const int nc = n != n ? 0 : static_cast<int>(fminf(fmaxf(n, -152.0f), 128.0f));
  const int n1 = nc >> 1;  // floor(nc / 2)
  const float e = mul(mul(p, __int_as_float((n1 + 127) << 23)), __int_as_float((nc - n1 + 127) << 23));
  if (n > 128.0f) return __int_as_float(0x7F800000);
  if (n < -151.0f) return 0.0f;
  return e;
}

// 1 / (1 + e^-x), the sum and the reciprocal each rounded once.
__device__ __forceinline__ float sigmoid_lp(float x) { return __frcp_rn(add(1.0f, exp_lp(-x))); }

// gelu(x) (tanh form) = x * sigmoid(y), y = GELU_C (x + GELU_A x^3); returns
// the value and sets s = sigmoid(y).
__device__ __forceinline__ float gelu_value(float x, float& s) {
  const float y = mul(f32(0x3FCC422Au), add(x, mul(f32(0x3D372713u), mul(mul(x, x), x))));
  s = sigmoid_lp(y);
  return mul(x, s);
}

// d gelu / dx = s + (x (s (1 - s))) dy/dx,  dy/dx = GELU_C (1 + GELU_3A x^2).
__device__ __forceinline__ float gelu_grad(float x, float s) {
  const float dy = mul(f32(0x3FCC422Au), add(1.0f, mul(f32(0x3E095D4Fu), mul(x, x))));
  return add(s, mul(mul(x, mul(s, sub(1.0f, s))), dy));
}

__device__ __forceinline__ float clamp_gate(float g, float limit) { return g > limit ? limit : g; }
__device__ __forceinline__ float clamp_value(float v, float limit) {
  return v > limit ? limit : (v < -limit ? -limit : v);
}

// Forward: u = act(g) [* v for GLU kinds]; `v` unused otherwise.
template <Kind K>
__device__ __forceinline__ float forward(float g, float v, const Params& p) {
  if constexpr (K == Kind::kSwiGLU) {
    return mul(mul(g, sigmoid_lp(g)), v);
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
    const float s = sigmoid_lp(g);
    const float si = mul(g, s);
    u = mul(si, v);
    dv = mul(q, si);
    dg = mul(mul(q, v), mul(s, add(1.0f, mul(g, sub(1.0f, s)))));
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
    dg = g <= p.limit ? mul(mul(q, add(vc, 1.0f)), mul(s, add(1.0f, mul(y, sub(1.0f, s))))) : 0.0f;
  }
}

}  // namespace math
}  // namespace activation
}  // namespace lpmoe
