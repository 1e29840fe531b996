// Hopper building blocks of lpmoe's own FP8 GEMM kernels: wgmma shared-memory
// descriptors, the FP8 wgmma of a chosen N, TMA loads and mbarriers.  The
// instruction wrappers are CuTe's and CUTLASS's; this header only fixes the
// one shared-memory layout every operand tile uses here, so the descriptor
// and the TMA swizzle agree by construction.
//
// Operand tile layout: rows of 128 FP8 values (one 128-byte row per M or N
// index, the K-block of the 1x128 / 128x128 scaling), written by TMA with
// 128-byte swizzle into a 1024-byte aligned buffer.  That is exactly wgmma's
// K-major SWIZZLE_128B layout: 8-row core groups 1024 bytes apart, and a
// 32-element K step is a 32-byte advance of the start address.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <utility>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90.hpp"  // stmatrix (the TMA-store strip)
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cute/arch/mma_sm90_gmma_ext.hpp"  // tile widths that are not powers of two
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#if defined(CUTE_ARCH_MMA_SM90A_ENABLED) && defined(CUTE_ARCH_TMA_SM90_ENABLED)
#define LPMOE_SM90A_DEVICE 1
#else
#define LPMOE_SM90A_DEVICE 0
#endif

namespace lpmoe {
namespace fp8_gemm {

constexpr int kWgmmaK = 32;  // K of one FP8 wgmma

// The value of lane 0, which the compiler then knows is the same in every
// lane: addresses derived from it (the warpgroup's A rows) stay in uniform
// registers, so a K-block's wgmma descriptors are built on the uniform
// datapath.  Derived from threadIdx directly, each of the four descriptors
// took a 64-bit vector add and two R2UR moves (SASS); ncu: issue slots busy
// 35.8 % -> 31.6 % at the anchor shape, duration unchanged.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// wgmma descriptor of a K-major SWIZZLE_128B tile starting at `smem`
// (1024-byte aligned; see the header comment).
__device__ __forceinline__ uint64_t sw128_kmajor_desc(const void* smem) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  d.bitfield.leading_byte_offset_ = 1;           // ignored for swizzled K-major
  d.bitfield.stride_byte_offset_ = 1024 >> 4;    // next group of 8 rows
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;                   // SWIZZLE_128B
  return d.desc_;
}

// Descriptor of the k-th 32-element K step inside the same 128-byte rows.
__device__ __forceinline__ uint64_t advance_k(uint64_t desc, int k_step) {
  return desc + static_cast<uint64_t>((k_step * kWgmmaK) >> 4);
}

// The FP8 (E4M3 x E4M3 -> fp32) wgmma of a 64 x N tile, both operands from
// shared memory.  N is a tile width this library instantiates (kBlockNs).
template <int N>
struct Fp8Wgmma;
#define LPMOE_FP8_WGMMA(N)                                                       \
  template <>                                                                     \
  struct Fp8Wgmma<N> {                                                            \
    using Op = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_SS_TN<>;             \
  };
LPMOE_FP8_WGMMA(128)
LPMOE_FP8_WGMMA(160)
LPMOE_FP8_WGMMA(192)
#undef LPMOE_FP8_WGMMA

template <int N, size_t... I>
__device__ __forceinline__ void wgmma_fp8_impl(uint64_t da, uint64_t db, float* acc, bool accumulate,
                                               std::index_sequence<I...>) {
  Fp8Wgmma<N>::Op::fma(da, db, acc[I]...,
                       accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// acc (N/2 fp32 per thread, wgmma's fragment order) = or += A(64x32) B(Nx32)^T
template <int N>
__device__ __forceinline__ void wgmma_fp8(uint64_t da, uint64_t db, float* acc, bool accumulate) {
  wgmma_fp8_impl<N>(da, db, acc, accumulate, std::make_index_sequence<N / 2>{});
}

// TMA loads into shared memory, completing on `bar` (transaction bytes).
constexpr uint64_t kEvictNormal = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, uint64_t* bar, void* smem, int c0, int c1) {
  cute::SM90_TMA_LOAD_2D::copy(map, bar, kEvictNormal, smem, c0, c1);
}
__device__ __forceinline__ void tma_load_3d(const CUtensorMap* map, uint64_t* bar, void* smem, int c0, int c1,
                                            int c2) {
  cute::SM90_TMA_LOAD_3D::copy(map, bar, kEvictNormal, smem, c0, c1, c2);
}

// The same box into the shared memory of every CTA in `mask` (same offset,
// each CTA's barrier at the same offset receives the bytes).
__device__ __forceinline__ void tma_load_3d_multicast(const CUtensorMap* map, uint64_t* bar, uint32_t mask, void* smem,
                                                      int c0, int c1, int c2) {
  cute::SM90_TMA_LOAD_MULTICAST_3D::copy(map, bar, static_cast<uint16_t>(mask), kEvictNormal, smem, c0, c1, c2);
}
__device__ __forceinline__ void tma_load_2d_multicast(const CUtensorMap* map, uint64_t* bar, uint32_t mask, void* smem,
                                                      int c0, int c1) {
  cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map, bar, static_cast<uint16_t>(mask), kEvictNormal, smem, c0, c1);
}

// Plain bulk copy global -> shared (16-byte aligned, bytes a multiple of 16).
__device__ __forceinline__ void bulk_load(uint64_t* bar, void* smem, const void* gmem, uint32_t bytes) {
  cute::SM90_BULK_COPY_G2S::copy(gmem, bar, smem, static_cast<int32_t>(bytes));
}

using Barrier = cutlass::arch::ClusterBarrier;
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

// Ring position of a multi-stage pipeline: stage index and the parity of the
// barrier phase this pass waits for.
template <int Stages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace fp8_gemm
}  // namespace lpmoe
