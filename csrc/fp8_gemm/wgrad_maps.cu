// Per-member TMA maps of the wgrad operands, written on the device: member
// t of a columnwise copy is a (rows x round_up(M_t, 128)) block at element
// offset rows * pad128[t], so its base, token extent and row stride depend on
// device-side split sizes.  One thread per map copies the host-encoded
// template (box, swizzle, element type and row count are final) and patches
// those three fields with tensormap.replace; the kernel that reads the maps
// acquires them through the tensormap proxy.  The launch also zeroes the
// GEMM's tile counter, so every call (and graph replay) starts it over.
#include "fp8_gemm/sm90_primitives.cuh"
#include "fp8_gemm/wgrad.h"

namespace lpmoe {
namespace fp8_gemm {
namespace {

__global__ void wgrad_maps_kernel(const __grid_constant__ CUtensorMap a_template,
                                  const __grid_constant__ CUtensorMap b_template, const uint8_t* a, const uint8_t* b,
                                  const int64_t* pad128, int num_groups, int64_t n_rows, int64_t k_cols,
                                  CUtensorMap* maps, int* tile_counter) {
#if LPMOE_SM90A_DEVICE
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) *tile_counter = 0;  // the GEMM's tile feed starts over (tile_feed.cuh)
  if (i >= 2 * num_groups) return;
  const int t = i / 2;
  const bool is_b = i % 2 == 1;
  const int64_t tok0 = pad128[t];
  // An empty member's map is never used; it stays a valid one-block map.
  const int64_t tokens = max(pad128[t + 1] - tok0, int64_t(kBlockK));
  const uint4* src = reinterpret_cast<const uint4*>(is_b ? &b_template : &a_template);
  uint4* dst = reinterpret_cast<uint4*>(maps + i);
#pragma unroll
  for (int q = 0; q < int(sizeof(CUtensorMap) / sizeof(uint4)); ++q) dst[q] = src[q];
  const uint8_t* base = is_b ? b + k_cols * tok0 : a + n_rows * tok0;
  // tensormap.replace writes through the generic proxy, ordered after this
  // thread's copy above.
  asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;" ::"l"(maps + i),
               "l"(reinterpret_cast<uint64_t>(base))
               : "memory");
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 0, %1;" ::"l"(maps + i),
               "r"(static_cast<uint32_t>(tokens))
               : "memory");
  asm volatile("tensormap.replace.tile.global_stride.global.b1024.b64 [%0], 0, %1;" ::"l"(maps + i),
               "l"(static_cast<uint64_t>(tokens))
               : "memory");
  asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
#else
  __trap();
#endif
}

}  // namespace

cudaError_t launch_wgrad_maps(const CUtensorMap& a_template, const CUtensorMap& b_template, const void* a,
                              const void* b, const WgradParams& p, cudaStream_t stream) {
  const int threads = 2 * p.num_groups;
  wgrad_maps_kernel<<<(threads + 127) / 128, 128, 0, stream>>>(
      a_template, b_template, static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), p.pad128, p.num_groups,
      p.n_rows, p.k_cols, const_cast<CUtensorMap*>(p.maps), p.tile_counter);
  return cudaGetLastError();
}

}  // namespace fp8_gemm
}  // namespace lpmoe
