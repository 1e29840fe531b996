// NVFP4's per-member amax pass, overlapped with the quantize pass.
//
// Every block scale depends on its member's amax, so the input is read
// twice: once for the amax, once to quantize.  The amax pass is memory-bound
// (~93 % of DRAM bandwidth) and the quantize pass is bound by instruction
// issue, so they overlap well if they run at the same time, which a member
// at a time allows:
//  * the amax kernel is persistent (one small CTA per SM, tiles in linear =
//    member order) and lets the quantize kernel start right away
//    (programmatic dependent launch: griddepcontrol.launch_dependents);
//  * each warp of an amax CTA adds the max of its quarters of a member's
//    tiles into the member's amax (atomicMax on the float bits: non-negative
//    floats order like their bits, max is order-independent, so the result
//    is deterministic), then adds the number of those tiles to
//    amax_arrivals[member] (after a fence);
//  * a quantize CTA waits until amax_arrivals[member] counts every warp of
//    every tile of its member, then reads the amax from L2.
// No deadlock: a dependent launch starts only once every amax CTA has
// started, and amax CTAs never wait.  Without the dependent launch (an
// ordinary stream-ordered launch) the waits return at once.
//
// The amax CTA is small (128 threads, <= 32 registers) so that it fits on an
// SM beside three quantize CTAs; cp.async keeps several tiles in flight
// through shared memory without registers.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/cuda_utils.h"
#include "common/vec_io.cuh"
#include "grouped/row_tiles.cuh"
#include "nvfp4/nvfp4.h"

namespace lpmoe {
namespace nvfp4 {
namespace member_amax {

using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// Tiles in flight per CTA: 2 (64 KB for 16-bit inputs, 128 KB for fp32),
// more than an SM's share of DRAM bandwidth times latency (~35 KB); four
// 16-bit stages measured no faster.
template <typename IType>
constexpr int kStages = 2;
template <typename IType>
constexpr int kPiecesPerRow = kTile * static_cast<int>(sizeof(IType)) / 16;  // 16-byte pieces
template <typename IType>
constexpr int kPiecesPerThread = kTile * kPiecesPerRow<IType> / kThreads;
template <typename IType>
constexpr int kStageBytes = kTile * kTile * static_cast<int>(sizeof(IType));
template <typename IType>
constexpr int kSmemBytes = kStages<IType> * kStageBytes<IType>;
// A launch bound that holds the kernel to 32 registers per thread (65536 /
// (128 * 16)): the 4096 registers left on an SM by three 80-register
// quantize CTAs.  The kernel runs one CTA per SM; 16 is not its occupancy.
constexpr int kMaxRegsBlocks = 16;

// The warp counts a member's amax waits for: every warp of every tile.
__device__ __forceinline__ uint32_t member_arrivals(const QuantizeArgs& a, const TileInfo& ti, int bx) {
  const int64_t row_tiles = a.group.row == nullptr
                                ? ceil_div<int64_t>(a.rows, kTile)
                                : (__ldg(a.group.pad128 + ti.member + 1) - ti.pad128_start) / kTile;
  return static_cast<uint32_t>(row_tiles * bx * kWarps);
}

// Thread t copies pieces t, t + 128, ... of the tile (a warp: two rows of
// 256 contiguous bytes per instruction for 16-bit inputs), which are one
// column piece of every kRowStep-th row; pieces past the member's rows or
// the matrix's columns are zero-filled, so they leave the max alone.  Not
// unrolled: the copies need no registers once issued.
template <typename IType>
__device__ __forceinline__ void issue_tile(const QuantizeArgs& a, int64_t row0, int rows_valid, int64_t col0,
                                           int cols_valid, uint4* stage) {
  constexpr int kRowStep = kThreads / kPiecesPerRow<IType>;
  constexpr int kElemsPerPiece = 16 / static_cast<int>(sizeof(IType));
  const int row = static_cast<int>(threadIdx.x) / kPiecesPerRow<IType>;
  const int col = (static_cast<int>(threadIdx.x) % kPiecesPerRow<IType>) * kElemsPerPiece;
  const bool col_ok = col < cols_valid;
  const IType* src = static_cast<const IType*>(a.input) + (row0 + row) * a.cols + col0 + col;
  const int64_t step = kRowStep * a.cols;
#pragma unroll 1
  for (int i = 0; i < kPiecesPerThread<IType>; ++i, src += step) {
    const bool ok = col_ok && row + i * kRowStep < rows_valid;
    cp_async_16(stage + threadIdx.x + i * kThreads, ok ? src : a.input, ok);
  }
  cp_async_commit();
}

// max |x| over the pieces this thread copied (NaN ignored).
template <typename IType>
__device__ __forceinline__ float thread_max(const uint4* stage) {
  constexpr int kWords = static_cast<int>(sizeof(IType)) / 2;  // uint4 per RawVec8
  float m = 0.0f;
#pragma unroll 4
  for (int i = 0; i < kPiecesPerThread<IType>; i += kWords) {
    RawVec8<IType> v;
#pragma unroll
    for (int w = 0; w < kWords; ++w) v.w[w] = stage[threadIdx.x + (i + w) * kThreads];
    m = fmaxf(m, vec8_amax<IType>(v));
  }
  return m;
}

// Where a CTA's tiles lie.  Its tiles come in increasing order, so the
// member is found by walking forward from the previous one (usually no step)
// instead of a binary search per tile: in a CTA that works alone on its SM,
// the search's dependent loads would stand between tiles.
struct TileCursor {
  const QuantizeArgs& a;
  int bx;
  int member = 0;
  int64_t start = 0, next_start = 0;  // pad128 rows where `member` and the next one begin
  int64_t row_start = 0, m = 0;       // its first input row and its row count

  __device__ __forceinline__ TileCursor(const QuantizeArgs& args, int bx_) : a(args), bx(bx_) {
    if (a.group.row == nullptr) {
      next_start = ceil_div<int64_t>(a.rows, kTile) * kTile;
      m = a.rows;
    } else {
      load(0);
    }
  }

  __device__ __forceinline__ void load(int t) {
    member = t;
    start = __ldg(a.group.pad128 + t);
    next_start = __ldg(a.group.pad128 + t + 1);
    row_start = __ldg(a.group.row + t);
    m = __ldg(a.group.row + t + 1) - row_start;
  }

  // Tile t (row tile * bx + column tile): false past the group or in a member
  // the kernels skip (rows % 16 != 0).
  __device__ __forceinline__ bool place(int64_t t, int& tile_member, int64_t& row0, int& rows_valid, int64_t& col0,
                                        int& cols_valid) {
    const int64_t j = static_cast<int>(t) / bx;  // t < 2^31 (checked at launch)
    if (a.group.row != nullptr) {
      const int n = a.group.num_tensors;
      if (j * kTile >= __ldg(a.group.pad128 + n)) return false;
      int next = member;
      while (j * kTile >= next_start) {  // past empty members too: the owner is the last with start <= row
        ++next;
        next_start = __ldg(a.group.pad128 + next + 1);
      }
      if (next != member) load(next);
    } else if (j * kTile >= next_start) {
      return false;
    }
    if (m % 16) return false;
    const int64_t local = j - start / kTile;
    row0 = row_start + local * kTile;
    int64_t valid = m - local * kTile;
    valid = valid < kTile ? valid : kTile;
    if (row0 + valid > a.rows) valid = a.rows - row0;  // never past the buffer
    rows_valid = valid > 0 ? static_cast<int>(valid) : 0;
    tile_member = member;
    col0 = (static_cast<int>(t) % bx) * static_cast<int64_t>(kTile);
    cols_valid = static_cast<int>(a.cols - col0 < kTile ? a.cols - col0 : kTile);
    return true;
  }
};

template <typename IType>
__global__ void __launch_bounds__(kThreads, kMaxRegsBlocks) amax_kernel(const QuantizeArgs a, int64_t tiles) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (a.noop != nullptr && *a.noop == 1.0f) return;
  extern __shared__ uint4 stages[];
  constexpr int kS = kStages<IType>;
  constexpr int kStageVecs = kStageBytes<IType> / 16;
  TileCursor cursor(a, static_cast<int>(ceil_div<int64_t>(a.cols, kTile)));
  const int64_t stride = gridDim.x;
  // Stage s holds this CTA's tiles s, s + kS, ...; member[s] < 0: nothing to
  // count (past the group, a skipped member).  One commit group per tile,
  // also for empty ones, so that wait_group counts stay regular.  The stage
  // loop is not unrolled (32 registers): member[] lives in local memory.
  int member[kS];
  auto issue = [&](int s, int64_t t) {
    int64_t row0, col0;
    int rows_valid, cols_valid;
    member[s] = -1;
    if (t < tiles && cursor.place(t, member[s], row0, rows_valid, col0, cols_valid)) {
      issue_tile<IType>(a, row0, rows_valid, col0, cols_valid, stages + s * kStageVecs);
    } else {
      cp_async_commit();
    }
  };
  // Each warp keeps its max and tile count for the member it is in, and
  // publishes them when it moves on (and at the end): one atomicMax, one
  // fence and one count per warp and member.  Per tile they contended with
  // the waiting quantize CTAs' polls of the same words.
  int current = -1;
  uint32_t tiles_seen = 0;
  float running = 0.0f;
  auto publish = [&]() {
    if (current < 0) return;
    float m = running;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) {
      if (m > 0.0f) {
        atomicMax(reinterpret_cast<unsigned int*>(a.amax + current), __float_as_uint(m));
        if (a.col_amax) atomicMax(reinterpret_cast<unsigned int*>(a.col_amax + current), __float_as_uint(m));
      }
      __threadfence();  // the max before the count
      atomicAdd(a.amax_arrivals + current, tiles_seen);
    }
  };
#pragma unroll 1
  for (int s = 0; s < kS; ++s) issue(s, blockIdx.x + s * stride);
  for (int64_t base = blockIdx.x; base < tiles; base += kS * stride) {
#pragma unroll 1
    for (int s = 0; s < kS; ++s) {
      if (base + s * stride >= tiles) break;
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kS - 1) : "memory");
      const int mine = member[s];
      const float m = mine >= 0 ? thread_max<IType>(stages + s * kStageVecs) : 0.0f;
      // Each thread reads back only its own pieces: the stage can be refilled now.
      issue(s, base + (s + kS) * stride);
      if (mine < 0) continue;
      if (mine != current) {  // warp-uniform: every lane walks the same tiles
        publish();
        current = mine;
        tiles_seen = 0;
        running = 0.0f;
      }
      running = fmaxf(running, m);
      ++tiles_seen;
    }
  }
  publish();
  cp_async_wait_all();
}

// Before a quantize CTA reads its member's amax: thread 0 waits for every
// arrival (acquire), the barrier passes that on to the CTA.
__device__ __forceinline__ void wait_for_member(const QuantizeArgs& a, const TileInfo& ti, int bx) {
  if (threadIdx.x == 0) {
    const uint32_t want = member_arrivals(a, ti, bx);
    const uint32_t* count = a.amax_arrivals + ti.member;
    for (;;) {
      uint32_t seen;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
      if (seen >= want) break;
      __nanosleep(1000);  // hundreds of CTAs may poll one word the amax CTAs update
    }
  }
  __syncthreads();
}

}  // namespace member_amax
}  // namespace nvfp4
}  // namespace lpmoe
