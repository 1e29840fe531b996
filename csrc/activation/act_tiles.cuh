// Persistent tile loop of the activation kernels: 128-row x 128-column tiles
// of (rows, F), F-tile fastest, streamed through kStages shared-memory stages
// with cp.async (common/tile_stage.cuh) so the loads of the next tiles overlap
// the math and quantization of the current one.
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
  int64_t j = 0;       // row tile (pad128 space)
  int x = 0;           // F tile
  int cols_valid = 0;  // columns of F inside this tile
  grouped::TileInfo ti;
};

// Tile `idx` of the launch; false past the grid or in the capacity tail
// (uniform across the CTA).
__device__ __forceinline__ bool tile_at(const Common& c, int64_t idx, TileRef& t) {
  const int fb = static_cast<int>(ceil_div<int64_t>(c.ffn, kTile));
  if (idx >= c.max_row_tiles * fb) return false;
  t.j = idx / fb;
  t.x = static_cast<int>(idx % fb);
  const int64_t left = c.ffn - static_cast<int64_t>(t.x) * kTile;
  t.cols_valid = static_cast<int>(left < kTile ? left : kTile);
  return grouped::locate_tile(c.group, c.rows, t.j, t.ti);
}

// Pipelined loop over this CTA's tiles (idx = blockIdx.x + k * gridDim.x).
// stage(buf, t) issues the cp.async copies of tile t into buf (no commit);
// process(buf, t) consumes it (all threads; may contain barriers).
template <int kStages, typename StageFn, typename ProcessFn>
__device__ __forceinline__ void for_each_tile(const Common& c, uint8_t* stages, int stage_bytes, StageFn stage,
                                              ProcessFn process) {
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    TileRef t;
    if (tile_at(c, blockIdx.x + static_cast<int64_t>(s) * gridDim.x, t)) stage(stages + s * stage_bytes, t);
    cp_async_commit();  // empty groups keep the per-thread group count uniform
  }
  for (int64_t k = 0;; ++k) {
    const int64_t idx = blockIdx.x + k * gridDim.x;
    TileRef t;
    const int fb = static_cast<int>(ceil_div<int64_t>(c.ffn, kTile));
    if (idx >= c.max_row_tiles * fb) break;
    uint8_t* buf = stages + static_cast<int>(k % kStages) * stage_bytes;
    cp_async_wait_pending<kStages - 1>();  // this thread's copies of tile k have landed
    if (tile_at(c, idx, t)) process(buf, t);
    __syncthreads();  // shared scratch of the tile quantizer is reused by the next tile
    TileRef n;
    if (tile_at(c, idx + static_cast<int64_t>(kStages) * gridDim.x, n)) stage(buf, n);
    cp_async_commit();
  }
  cp_async_wait_all();
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
// high-precision matrix (valid rows and columns only).
template <typename IType>
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
      for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) reinterpret_cast<uint4*>(p)[i] = v[r].w[i];
    }
  }
}

}  // namespace activation
}  // namespace lpmoe
