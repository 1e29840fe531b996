// Persistent tile loop of the activation kernels: 128-row x 128-column tiles
// of (rows, F), F-tile fastest, streamed through one shared-memory stage per
// CTA with cp.async (common/tile_stage.cuh) so the loads of the next tile
// overlap the math and quantization of the current one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "activation/activation.h"
#include "common/cuda_utils.h"
#include "common/persistent_grid.h"
#include "common/tile_stage.cuh"
#include "common/vec_io.cuh"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace activation {

constexpr int kThreads = 256;
constexpr int kTile = 128;

struct TileRef {
  int j = 0;           // row tile (pad128 space)
  int x = 0;           // F tile
  int cols_valid = 0;  // columns of F inside this tile
  grouped::TileInfo ti;
};

// Tile `idx` of the launch (F tile fastest); false past the grid or in the
// capacity tail (uniform across the CTA).  Launchers check that the tile
// count fits in 32 bits.
__device__ __forceinline__ bool tile_at(const Common& c, unsigned idx, unsigned total, unsigned fb, TileRef& t) {
  if (idx >= total) return false;
  t.j = static_cast<int>(idx / fb);
  t.x = static_cast<int>(idx - static_cast<unsigned>(t.j) * fb);
  const int64_t left = c.ffn - static_cast<int64_t>(t.x) * kTile;
  t.cols_valid = static_cast<int>(left < kTile ? left : kTile);
  return grouped::locate_tile(c.group, c.rows, t.j, t.ti);
}

// Persistent loop over this CTA's tiles (idx = blockIdx.x + k * gridDim.x)
// with one shared-memory stage: compute(buf, t) reads tile t from the stage
// into registers, then stage(buf, next) issues the copies of the CTA's next
// tile into the same stage, and finish(buf, t, late) quantizes / stores from
// registers while they land.  stage_late(buf, next) issues copies that must
// wait until finish has used the stage again (finish may keep data in the
// parts of the stage that only stage_late refills).  finish calls late()
// exactly once, after its last read of those parts (the loop calls it itself
// when there is no tile); late() holds those reads before the copies with a
// compiler barrier, issues them and commits the iteration's second cp.async
// group.  Calling it early lets the late copies overlap the rest of finish.
// Each thread copies, reads and writes only its own part of a stage, so only
// the tile quantizer's shared scratch needs the barrier between tiles.
template <typename StageFn, typename LateFn, typename ComputeFn, typename FinishFn>
__device__ __forceinline__ void for_each_tile(const Common& c, uint8_t* buf, StageFn stage, LateFn stage_late,
                                              ComputeFn compute, FinishFn finish) {
  const unsigned fb = static_cast<unsigned>(ceil_div<int64_t>(c.ffn, kTile));
  const unsigned total = static_cast<unsigned>(c.max_row_tiles) * fb;
  TileRef t;
  bool have = tile_at(c, blockIdx.x, total, fb, t);
  if (have) {
    stage(buf, t);
    stage_late(buf, t);
  }
  cp_async_commit();
  for (unsigned idx = blockIdx.x; idx < total; idx += gridDim.x) {
    cp_async_wait_all();
    if (have) compute(buf, t);
    TileRef n;
    const bool next = tile_at(c, idx + gridDim.x, total, fb, n);
    asm volatile("" ::: "memory");  // the stage reads above stay before the copies that overwrite it
    if (next) stage(buf, n);
    cp_async_commit();
    auto late = [&] {
      asm volatile("" ::: "memory");  // finish's stage reads stay before the copies that overwrite them
      if (next) stage_late(buf, n);
      cp_async_commit();
    };
    if (have) finish(buf, t, late);
    else late();
    __syncthreads();  // the tile quantizer's scratch is reused by the next tile
    t = n;
    have = next;
  }
  cp_async_wait_all();
}

// Calls fn.template operator()<K>() for the run-time kind (one kernel
// instantiation per activation).
template <typename Fn>
cudaError_t dispatch_kind(Kind kind, Fn&& fn) {
  switch (kind) {
    case Kind::kSwiGLU: return fn.template operator()<Kind::kSwiGLU>();
    case Kind::kGeGLU: return fn.template operator()<Kind::kGeGLU>();
    case Kind::kGELU: return fn.template operator()<Kind::kGELU>();
    case Kind::kReLU: return fn.template operator()<Kind::kReLU>();
    case Kind::kClampedSwiGLU: return fn.template operator()<Kind::kClampedSwiGLU>();
  }
  return cudaErrorInvalidValue;
}

// Launches a persistent tile kernel: as many CTAs as fit (at most one per tile).
template <typename Kernel, typename Args>
cudaError_t launch_tiles(Kernel kernel, int dynamic_smem, const Common& c, const Args& args, cudaStream_t stream) {
  dim3 grid;
  LPMOE_RETURN_IF_ERROR(
      persistent_grid(kernel, kThreads, dynamic_smem, c.max_row_tiles * ceil_div<int64_t>(c.ffn, kTile), grid));
  kernel<<<grid, kThreads, dynamic_smem, stream>>>(args);
  return cudaGetLastError();
}

// Row scales of this thread's 8 rows (1 where there are no probs).
__device__ __forceinline__ void load_row_probs(const Common& c, const TileRef& t, float (&p)[kStageRowsPerThread]) {
  const int g = threadIdx.x >> 4;
#pragma unroll
  for (int r = 0; r < kStageRowsPerThread; ++r) {
    const int row = g * kStageRowsPerThread + r;
    p[r] = (c.probs != nullptr && row < t.ti.rows_valid) ? __ldg(c.probs + t.ti.row0 + row) : 1.0f;
  }
}

template <typename IType>
__device__ __forceinline__ void set_elem(RawVec8<IType>& v, int e, float x) {
  reinterpret_cast<IType*>(&v)[e] = from_float<IType>(x);
}

// Store this thread's 8 rows x 8 columns at column `col0` of a (rows, ld)
// high-precision matrix (valid rows and columns only).  kWhole16: each
// 16-byte vector as one explicit 16-byte store; otherwise NVVM splits it
// into four 4-byte stores (it cannot prove the alignment).  The backward
// takes kWhole16 (8 x 64k tokens, F 2048, H100: 534 -> 501 us), the forward
// does not: there the whole stores cost registers (ReLU drops to 2 CTAs per
// SM) and time (292 -> 304 us); docs/activation-notes.md, stops 58 and 60.
template <typename IType, bool kWhole16 = false>
__device__ __forceinline__ void store_tile(IType* out, int64_t ld, int64_t col0, const TileRef& t,
                                           const RawVec8<IType> (&v)[kStageRowsPerThread]) {
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  if (c * 8 >= t.cols_valid) return;
#pragma unroll
  for (int r = 0; r < kStageRowsPerThread; ++r) {
    const int row = g * kStageRowsPerThread + r;
    if (row < t.ti.rows_valid) {
      IType* p = out + (t.ti.row0 + row) * ld + col0 + c * 8;
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) {
        if constexpr (kWhole16) store16<Space::kGlobal>(reinterpret_cast<uint4*>(p) + i, v[r].w[i]);
        else reinterpret_cast<uint4*>(p)[i] = v[r].w[i];
      }
    }
  }
}

}  // namespace activation
}  // namespace lpmoe
