// The sigmoid of a bf16 gate from a shared-memory table.
//
// The fused activation kernels are issue-bound (docs/activation-notes.md):
// lpmoe's exact sigmoid (exp as a degree-6 polynomial, a correctly rounded
// reciprocal) is ~19 instructions per element of a SwiGLU forward.  A
// bf16 gate has only 2^16 values, and the sigmoid is constant outside a
// narrow band of them, so a table of the band answers every gate with one
// shared-memory load and a few integer operations, bit for bit.
//
// Band (magnitude bits m = bits & 0x7fff, both signs), from the spec's
// sigmoid evaluated on every bf16 value (tests/test_activation.py checks
// these bounds against the reference on all 2^16 of them):
//   m <= kLo             sigmoid = 0.5 exactly (1 + e^-g rounds to 2)
//   m >= kHi, g > 0      sigmoid = 1 exactly (+inf included)
//   m >= kHi, g < 0      sigmoid = 0 exactly (rcp_lp's range, -inf included)
// So the index clamps m to [kLo, kHi] and the end entries hold the
// constants.  A NaN gate reads 0 or 1 instead of NaN: every SwiGLU output
// multiplies by the gate itself (u = (g s) v; dv = q (g s); dg's factor
// s (1 + g (1 - s))), so each is NaN either way, with the same bits (the
// GPU's arithmetic returns one canonical NaN).
//
// 2 x 3824 fp32 entries (31.7 KB with the gap between the signs).  Each CTA fills its own copy with
// math::sigmoid_lp at start (31 sigmoids per thread of 256), so the table is
// the kernel's own function by construction, with no host state.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

#include "activation/act_math.cuh"
#include "common/vec_io.cuh"

namespace lpmoe {
namespace activation {
namespace sigmoid_table {

// Kernels that take the sigmoid from the table: bf16 SwiGLU (the table is
// indexed by bf16 bits; the other kinds take the sigmoid of an fp32 product).
template <typename IType, Kind K>
constexpr bool used_by() { return std::is_same_v<IType, __nv_bfloat16> && K == Kind::kSwiGLU; }

constexpr uint32_t kLo = 0x33C0;  // |g| = 2^-24 * 1.5: last magnitude where every sign gives 0.5
constexpr uint32_t kHi = 0x42AF;  // |g| = 87.5: first magnitude from which g > 0 gives 1 and g < 0 gives 0
constexpr int kPerSign = static_cast<int>(kHi - kLo) + 1;  // 3824
// Negative gates start at entry 0x1000, so the sign bit becomes part of the
// index with one shift and mask (the 272 entries in between are unused).
constexpr int kNegative = 0x1000;
constexpr int kEntries = kNegative + kPerSign;
constexpr int kBytes = kEntries * static_cast<int>(sizeof(float));  // 31.7 KB

__device__ __forceinline__ void fill(float* table) {
  for (int i = threadIdx.x; i < kEntries; i += blockDim.x) {
    const bool neg = i >= kNegative;
    const int k = neg ? i - kNegative : i;
    const uint32_t bits = (neg ? 0x8000u : 0u) | (kLo + static_cast<uint32_t>(k));
    table[i] = k < kPerSign ? math::sigmoid_lp(__uint_as_float(bits << 16)) : 0.0f;
  }
}

// Byte offsets into the table of the two bf16 gates of a packed pair (low
// half: the element in the low 16 bits), two per 32-bit word: each half's
// magnitude clamped to [kLo, kHi] (16-bit SIMD min/max), minus kLo, times 4,
// plus 0x4000 for a negative gate; the halves never carry into each other
// (at most 0x7BBC).
__device__ __forceinline__ uint32_t pair_offsets(uint32_t w) {
  uint32_t m = w & 0x7fff7fffu;
  asm("max.u16x2 %0, %1, %2;" : "=r"(m) : "r"(m), "r"(kLo * 0x10001u));
  asm("min.u16x2 %0, %1, %2;" : "=r"(m) : "r"(m), "r"(kHi * 0x10001u));
  const uint32_t sign = (w >> 1) & 0x40004000u;  // bit 15 of each half -> kNegative * 4 bytes
  return ((m - kLo * 0x10001u) << 2) + sign;
}

// sigmoid of element e (0 or 1) of the pair whose offsets are `offs`.
__device__ __forceinline__ float lookup(const float* table, uint32_t offs, int e) {
  const uint32_t off = e ? (offs >> 16) : (offs & 0xffffu);
  return *reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(table) + off);
}

// sigmoid of element e of an 8-gate vector (the forward and backward kernels' lookup).
template <typename IType>
__device__ __forceinline__ float lookup_elem(const float* table, const RawVec8<IType>& gates, int e) {
  return lookup(table, pair_offsets(word(gates, e >> 1)), e & 1);
}

}  // namespace sigmoid_table
}  // namespace activation
}  // namespace lpmoe
