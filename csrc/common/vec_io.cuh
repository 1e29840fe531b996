// 8-element vectors in registers, in their own 16-bit (or 32-bit) dtype,
// shared by the quantize kernels, the activation kernels and the tile
// staging (tile_stage.cuh): loads, element access, packed amax, whole
// 16-byte stores.  (Dequantize outputs: dequant_vec.cuh.)
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// Element e of v as fp32.  bf16 -> fp32 is exact: the bits move up by 16, so
// it is written as one shift or one mask per element (the generic conversion
// spends a byte permute plus a shift on every odd element).
template <typename IType>
__device__ __forceinline__ float elem(const RawVec8<IType>& v, int e) {
  if constexpr (std::is_same_v<IType, __nv_bfloat16>) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(&v)[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  } else {
    return to_float<IType>(reinterpret_cast<const IType*>(&v)[e]);
  }
}

// 32-bit word k (elements 2k, 2k+1) of an 8-element 16-bit vector.
template <typename IType>
__device__ __forceinline__ uint32_t word(const RawVec8<IType>& v, int k) {
  return reinterpret_cast<const uint32_t*>(&v)[k];
}

// max(acc, |w|) per 16-bit half of a pair of bf16 / fp16 values, NaN-ignoring
// like fmaxf (a NaN element leaves acc unchanged): one HMNMX2 per 2 values.
template <typename IType>
__device__ __forceinline__ uint32_t abs_max2(uint32_t acc, uint32_t w);
template <>
__device__ __forceinline__ uint32_t abs_max2<__nv_bfloat16>(uint32_t acc, uint32_t w) {
  const __nv_bfloat162 r = __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&acc),
                                   __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <>
__device__ __forceinline__ uint32_t abs_max2<__half>(uint32_t acc, uint32_t w) {
  const __half2 r = __hmax2(*reinterpret_cast<const __half2*>(&acc), __habs2(*reinterpret_cast<const __half2*>(&w)));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The low / high value of a packed 16-bit pair as fp32.
template <typename IType>
__device__ __forceinline__ float half_to_float(uint32_t w, bool high) {
  const IType* h = reinterpret_cast<const IType*>(&w);
  return to_float<IType>(high ? h[1] : h[0]);
}

template <typename IType>
__device__ __forceinline__ float pair_max(uint32_t w) {
  return fmaxf(half_to_float<IType>(w, false), half_to_float<IType>(w, true));
}

// max |x| over the 8 elements of v, NaN ignored (0 when all are NaN).
template <typename IType>
__device__ __forceinline__ float vec8_amax(const RawVec8<IType>& v) {
  if constexpr (sizeof(IType) == 2) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) m = abs_max2<IType>(m, word(v, k));
    return pair_max<IType>(m);
  } else {
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) a = amax_step(a, elem<IType>(v, e));
    return a;
  }
}

// Column amax of a thread's 8-row x 8-column register block (thread c, g of a
// 128x128 tile, rows 8g..8g+7): max |x| over its 8 rows (NaN ignored),
// combined with lane ^ 16, the warp's other row group -> a 16-row partial.
// 16-bit inputs are reduced as packed pairs.
template <typename IType>
__device__ __forceinline__ void column_amax16(const RawVec8<IType> (&raw)[8], float (&a)[8]) {
  if constexpr (sizeof(IType) == 2) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t m = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) m = abs_max2<IType>(m, word(raw[r], k));
      m = abs_max2<IType>(m, __shfl_xor_sync(0xffffffffu, m, 16));  // |m| = m
      a[2 * k] = half_to_float<IType>(m, false);
      a[2 * k + 1] = half_to_float<IType>(m, true);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float m = 0.0f;
#pragma unroll
      for (int r = 0; r < 8; ++r) m = amax_step(m, elem<IType>(raw[r], e));
      a[e] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
    }
  }
}

// Where a kernel writes its output vectors.
enum class Space { kGlobal, kShared };

// One 16-byte store at p (16-byte aligned).  Written as explicit vector
// instructions because NVVM splits a plain `*(uint4*)p = v` into four 4-byte
// stores wherever it cannot prove the alignment from the address arithmetic
// (found in the MXFP8 and FP8 block rowwise dequantize kernels' PTX: four
// st.global.u32 per vector; NVFP4's wrote 4-byte st.global.v2.u16;
// tests/test_kernel_stores.py keeps the dequantize kernels' whole; the
// activation backward's high-precision dh uses it too).
template <Space kSpace>
__device__ __forceinline__ void store16(void* p, uint4 v) {
  if constexpr (kSpace == Space::kGlobal) {
    __stwb(reinterpret_cast<uint4*>(p), v);  // st.global.wb = the default store
  } else {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
}

}  // namespace lpmoe
