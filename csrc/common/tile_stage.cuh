// Streaming 128x128 tiles through shared memory with cp.async, for kernels
// whose thread (c, g) of 256 works on rows 8g .. 8g+7 x columns 8c .. 8c+7
// (the FP8 block tile layout, fp8_block/tile_quantize.cuh).
//
// Each thread copies exactly the 8 x 16-byte pieces it reads back later, so a
// thread only waits for its own copies (cp.async.wait_group): no barrier
// guards a stage, and several stages can be in flight per thread.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/vec_io.cuh"

namespace lpmoe {

constexpr int kStageTile = 128;
constexpr int kStageRowsPerThread = 8;

// Bytes of one 128x128 stage of IType.
template <typename IType>
constexpr int stage_tile_bytes() {
  return kStageTile * kStageTile * static_cast<int>(sizeof(IType));
}

// This thread's part of a tile: columns 8c .. 8c+7 of rows 8g .. 8g+7, in
// global memory and at the same place in a stage.  Every function below
// reads or writes exactly this part, which is why a thread only ever waits
// for its own copies.
struct TilePart {
  int c, g;
  __device__ __forceinline__ TilePart() : c(threadIdx.x & 15), g(threadIdx.x >> 4) {}
  __device__ __forceinline__ int row(int r) const { return g * kStageRowsPerThread + r; }
  __device__ __forceinline__ int col() const { return c * 8; }
  // Byte offset of row r's 8 elements in a stage of IType.
  template <typename IType>
  __device__ __forceinline__ int stage_offset(int r) const {
    return (row(r) * kStageTile + col()) * static_cast<int>(sizeof(IType));
  }
};

// Issue the copies of this thread's part of the tile whose (0, 0) element is
// `origin` in a row-major matrix with row pitch `ld` (elements).  Rows >=
// rows_valid and columns >= cols_valid are zero-filled (cols_valid a
// multiple of 8).  Does not commit the group.
template <typename IType>
__device__ __forceinline__ void stage_tile_async(uint8_t* stage, const IType* origin, int64_t ld, int rows_valid,
                                                 int cols_valid) {
  constexpr int kChunks = static_cast<int>(sizeof(IType)) / 2;  // 16-byte chunks per 8 elements
  const TilePart p;
  const bool col_ok = p.col() < cols_valid;
#pragma unroll
  for (int r = 0; r < kStageRowsPerThread; ++r) {
    const bool ok = col_ok && p.row(r) < rows_valid;
    const IType* src = ok ? origin + p.row(r) * ld + p.col() : origin;
    uint8_t* dst = stage + p.stage_offset<IType>(r);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) cp_async_16(dst + 16 * i, reinterpret_cast<const uint8_t*>(src) + 16 * i, ok);
  }
}

// The same part of a tile straight into registers (rows >= rows_valid and
// columns >= cols_valid as zeros), for a tile that is not staged.
template <typename IType>
__device__ __forceinline__ void load_tile_rows(const IType* origin, int64_t ld, int rows_valid, int cols_valid,
                                               RawVec8<IType> (&raw)[kStageRowsPerThread]) {
  const TilePart p;
  const bool col_ok = p.col() < cols_valid;
#pragma unroll
  for (int r = 0; r < kStageRowsPerThread; ++r) {
    if (col_ok && p.row(r) < rows_valid) load_vec8<IType>(origin + p.row(r) * ld + p.col(), raw[r]);
    else zero_vec8<IType>(raw[r]);
  }
}

// Asks L2 for this thread's part of a tile that load_tile_rows will read
// later (one prefetch per 16-byte piece; no registers, no completion to wait for).
template <typename IType>
__device__ __forceinline__ void prefetch_tile_l2(const IType* origin, int64_t ld, int rows_valid, int cols_valid) {
  const TilePart p;
  if (p.col() >= cols_valid) return;
#pragma unroll
  for (int r = 0; r < kStageRowsPerThread; ++r)
    if (p.row(r) < rows_valid) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(origin + p.row(r) * ld + p.col()));
}

// One of this thread's 8 rows of a stage.
template <typename IType>
__device__ __forceinline__ void read_stage_row(const uint8_t* stage, int r, RawVec8<IType>& v) {
  const uint8_t* p = stage + TilePart().stage_offset<IType>(r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) v.w[i] = *reinterpret_cast<const uint4*>(p + 16 * i);
}

// This thread's 8 rows x 8 columns of a stage.
template <typename IType>
__device__ __forceinline__ void read_stage_tile(const uint8_t* stage, RawVec8<IType> (&raw)[kStageRowsPerThread]) {
#pragma unroll
  for (int r = 0; r < kStageRowsPerThread; ++r) read_stage_row<IType>(stage, r, raw[r]);
}

// Write one of this thread's 8 rows of a stage (its own slots).
template <typename IType>
__device__ __forceinline__ void write_stage_row(uint8_t* stage, int r, const RawVec8<IType>& v) {
  uint8_t* p = stage + TilePart().stage_offset<IType>(r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) *reinterpret_cast<uint4*>(p + 16 * i) = v.w[i];
}

}  // namespace lpmoe
