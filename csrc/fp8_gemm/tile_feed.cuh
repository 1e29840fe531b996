// Which tiles a persistent wgrad CTA takes, and how its producer and math
// warps agree on them.
//
// Handed out round-robin (tile, tile + grid, ...), a CTA's share is fixed
// before anything runs.  A tile's length is its member's token count, so
// with skewed routing the last partial wave of a long member's tiles leaves
// a few CTAs one long tile behind the rest (32 x 16k tokens with half of
// them in one member: 1216 tiles of 66 K-blocks = 9 x 132 + 28).  The
// dynamic feed hands the tiles out in the same order from a global counter
// as CTAs free up.  Each tile is still one CTA's, over its K-blocks in
// order: the same bits.  (The main_grad kernels also gained 9-13 % with
// uniform 512-token members, which suggests their tile times, which include
// reading and writing the fp32 output, vary enough for round-robin CTAs to
// drift apart; not profiled.)
//
// The producer thread claims the CTA's next tile (one atomic add, issued
// before the current tile's loads, which hide its latency) and publishes it
// through a small ring in shared memory, which the math warps read before
// each tile (the end too: a claim past the last tile).  Every CTA's first
// tile is its block index, so the counter hands out tiles from the grid size
// on; the launch before the kernel (wgrad_maps.cu) zeroes it, which keeps
// the kernel capturable in a CUDA graph and replayable.
//
// Which kernels use it: the main_grad kernels of cluster 1 have an
// instantiation with the counter, which run_wgrad launches where members
// average at most 1024 tokens (wgrad_dynamic_tiles in heuristics.h, with the
// measurements); longer members gained nothing there and lost up to a few
// percent.  Every other call runs the round-robin kernels, which carry no
// feed at all (the counter's kernel with the round-robin order published
// through its ring measured 2-3 % slower than them on long members, same
// call: the feed's state changed the math warps' code).  The fresh-output
// kernels ran 5-7 % slower with the counter on uniform 512-token members
// (2-4 % faster skewed), while the ring carrying the round-robin order
// measured as fast as none there, so it is the order itself that costs them
// (not found why; docs/fp8-wgrad-kernel-notes.md, stop 56).  Cluster 2 has no
// counter kernel: the two CTAs of a cluster multicast one operand tile and
// must take the same tile, which a counter would have to pass from one to
// the other through distributed shared memory (and the heuristic never
// picks cluster 2 for wgrad).
#pragma once

#include "fp8_gemm/sm90_primitives.cuh"
#include "fp8_gemm/wgrad.h"

namespace lpmoe {
namespace fp8_gemm {

constexpr int kFeedSlots = kWgradFeedSlots;
constexpr int kFeedMathWarps = 8;  // one empty arrival per math warp

// CUTLASS's mbarrier wait and arrive are asm statements without a memory
// clobber, so the compiler may move plain shared-memory accesses across
// them; the slot's index must be read after the wait and written between
// the wait for a free slot and the arrive.  (The hardware side is the
// barriers' acquire and release.)
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

template <bool Dynamic>
struct WgradTileFeed;

// Round-robin: tile, tile + step, ...
template <>
struct WgradTileFeed<false> {
  int step;

  __device__ __forceinline__ static void init(uint8_t*) {}
  // Producer side.
  __device__ __forceinline__ int claim(int tile) const { return tile + step; }
  __device__ __forceinline__ void publish(int) {}
  // Math side.
  __device__ __forceinline__ int first(int tile, int) { return tile; }
  __device__ __forceinline__ int next(int tile, int) { return tile + step; }
};

// From a global counter, through a shared-memory ring.
template <>
struct WgradTileFeed<true> {
  int step;       // the grid: the counter's tiles start after every CTA's first
  int* counter;   // global, zeroed before the launch
  uint8_t* smem;  // kWgradFeedBytes: full[kFeedSlots], empty[kFeedSlots], tile[kFeedSlots]
  RingPos<kFeedSlots> pos{};

  __device__ __forceinline__ uint64_t* full() const { return reinterpret_cast<uint64_t*>(smem); }
  __device__ __forceinline__ uint64_t* empty() const { return full() + kFeedSlots; }
  __device__ __forceinline__ int* tiles() const { return reinterpret_cast<int*>(empty() + kFeedSlots); }

  // One thread, before the CTA's first barrier sync.
  __device__ __forceinline__ static void init(uint8_t* smem) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
    for (int s = 0; s < kFeedSlots; ++s) {
      Barrier::init(&bars[s], 1);
      Barrier::init(&bars[kFeedSlots + s], kFeedMathWarps);
    }
  }

  // Producer side (one thread): the tile after `tile` for this CTA, and
  // handing a tile (or, past the last, the end) to the math warps.
  __device__ __forceinline__ int claim(int) const { return atomicAdd(counter, 1) + step; }
  __device__ __forceinline__ void publish(int tile) {
    Barrier::wait(&empty()[pos.stage], pos.phase ^ 1u);
    compiler_fence();
    tiles()[pos.stage] = tile;
    compiler_fence();
    Barrier::arrive(&full()[pos.stage]);  // release: the index is visible to the waiters
    pos.next();
  }

  // Math side (every math thread): the producer's next tile.
  __device__ __forceinline__ int take(int lane) {
    Barrier::wait(&full()[pos.stage], pos.phase);
    compiler_fence();
    const int tile = tiles()[pos.stage];
    __syncwarp();  // every lane has read the slot before lane 0 frees it
    if (lane == 0) Barrier::arrive(&empty()[pos.stage]);
    pos.next();
    return tile;
  }
  __device__ __forceinline__ int first(int, int lane) { return take(lane); }
  __device__ __forceinline__ int next(int, int lane) { return take(lane); }
};

}  // namespace fp8_gemm
}  // namespace lpmoe
