// A persistent pipeline over the 128-row tiles of a grouped (or single)
// matrix: one producer warp streams tiles into a ring of shared-memory
// stages with TMA (cp.async.bulk.tensor) while eight consumer warps work on
// earlier stages.  Stage hand-off is by mbarriers only (full: the producer's
// transaction bytes landed; empty: all eight consumer warps are done), so no
// barrier ever stops the whole CTA and the loads of the next stages stay in
// flight while the consumers reduce, convert and store.
//
// The skeleton knows nothing about formats: the kernel passes a `load`
// functor (issue the TMA copies of one tile, return their bytes) and a
// `consume` functor (all work of one tile by the eight consumer warps, which
// may only synchronise inside their own warp).  Tiles are visited in the
// linear order idx = j * bx_count + tile_x (K tile fastest: CTAs running
// together read whole row bands), CTA b taking b, b + gridDim.x, ...; tiles
// past the last member (capacity tail) end the CTA's walk.
#pragma once

#include <cstdint>

#include "cutlass/arch/barrier.h"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace grouped {

constexpr int kRingConsumerWarps = 8;
constexpr int kRingThreads = (kRingConsumerWarps + 1) * 32;  // + the producer warp

// What the producer tells the consumers about a stage.
struct RingSlot {
  TileInfo ti;
  int64_t j;   // row tile, counted in pad128 space
  int tile_x;  // column tile
  int done;    // 1: sentinel, no more tiles for this CTA
};

struct RingTiles {
  GroupRows group;
  int64_t rows;   // buffer rows
  int bx_count;   // column tiles
  int64_t total;  // max_row_tiles * bx_count
};

// Dynamic shared memory of a ring: 1024-byte aligned stages (TMA's 128-byte
// swizzle repeats every 1024 bytes), then barriers and slots.
template <int kStages, int kStageBytes>
constexpr int ring_smem_bytes() {
  return 1024 + kStages * kStageBytes + kStages * (2 * 8 + static_cast<int>(sizeof(RingSlot)));
}

template <int kStages, int kStageBytes, typename Load, typename Consume>
__device__ __forceinline__ void run_tile_ring(uint8_t* smem, const RingTiles& tiles, Load&& load, Consume&& consume) {
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  // aligned by an offset from `smem` (not through an integer round trip), so
  // the compiler still knows the stages are shared memory
  const uint32_t misalign = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) & 1023u;
  uint8_t* stages = smem + ((1024u - misalign) & 1023u);
  auto* full = reinterpret_cast<FullBarrier*>(stages + kStages * kStageBytes);
  auto* empty = reinterpret_cast<EmptyBarrier*>(full + kStages);
  auto* slots = reinterpret_cast<RingSlot*>(empty + kStages);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      full[s].init(1);
      empty[s].init(kRingConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  int stage = 0;
  uint32_t phase = 0;
  auto advance = [&] {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  if (warp == kRingConsumerWarps) {
    if (lane != 0) return;
    for (int64_t idx = blockIdx.x; idx < tiles.total; idx += gridDim.x) {
      RingSlot s;
      s.j = idx / tiles.bx_count;
      s.tile_x = static_cast<int>(idx % tiles.bx_count);
      s.done = 0;
      if (!locate_tile(tiles.group, tiles.rows, s.j, s.ti)) break;  // later tiles lie further out
      empty[stage].wait(phase ^ 1u);  // passes at once on the first round
      slots[stage] = s;
      load(full[stage], stages + stage * kStageBytes, s);
      advance();
    }
    empty[stage].wait(phase ^ 1u);
    slots[stage].done = 1;
    full[stage].arrive();
    return;
  }
  while (true) {
    full[stage].wait(phase);
    const RingSlot s = slots[stage];
    if (s.done) break;
    consume(s, stages + stage * kStageBytes, warp, lane);
    __syncwarp();
    if (lane == 0) empty[stage].arrive();
    advance();
  }
}

}  // namespace grouped
}  // namespace lpmoe
