// 128x128 tiles of a grouped MXFP8 tensor: which member, where its data and
// scales start (see mxfp8.h for the layout).
#pragma once

#include <cstdint>

#include "common/cuda_utils.h"
#include "grouped/row_tiles.cuh"
#include "mxfp8/mxfp8.h"

namespace lpmoe {
namespace mxfp8 {

constexpr int kTile = 128;
constexpr int64_t kTileElems = static_cast<int64_t>(kTile) * kTile;

struct MxTile {
  int64_t data_base;        // element index of the member's (0, 0)
  int64_t first_row;        // rows layout: the member's first row in the whole (rows, cols) buffer
  int64_t m, k;             // member dims; k is also the data row pitch
  int64_t r0, c0;           // tile origin inside the member
  int rows_valid, cols_valid;
  int64_t row_scale_base;   // byte offsets of the member's scale matrices
  int64_t col_scale_base;
  int64_t sx;               // rowwise scale columns: round_up(ceil(k/32), 4)
  int64_t kp;               // columnwise scale columns: round_up(k, 128)
  int64_t rows_padded;      // round_up(m, 128)
};

// a / b for 0 <= a < 2^31 (a tile index: launches are capped there) and
// b >= 1, in 32-bit arithmetic (b past 2^31 gives 0, exactly).  A 64-bit
// division is a called subroutine, and the call made ptxas spill registers
// in the dequantize kernels.
__device__ __forceinline__ int64_t tile_div(int64_t a, int64_t b) {
  return b > 0x7fffffff ? 0 : static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
}

// Tile `linear` of the launch; false for tiles past the last member (capacity
// tail) and for members that break the varying-dims alignment.
__device__ __forceinline__ bool locate_mx_tile(const Members& mb, int64_t rows, int64_t cols, int64_t numel,
                                               int64_t linear, MxTile& t) {
  if (!mb.by_elements) {
    const int64_t bx = ceil_div<int64_t>(cols, kTile);
    const int64_t j = tile_div(linear, bx);
    const int64_t tx = linear - j * bx;
    grouped::TileInfo ti;
    if (!grouped::locate_tile(mb.rows, rows, j, ti)) return false;
    t.m = ti.m;
    t.k = cols;
    t.first_row = ti.row0 - ti.local_tile * kTile;
    t.data_base = cols * t.first_row;
    t.r0 = ti.local_tile * kTile;
    t.c0 = tx * kTile;
    t.rows_valid = ti.rows_valid;
    t.sx = round_up<int64_t>(ceil_div<int64_t>(cols, 32), 4);
    t.kp = round_up<int64_t>(cols, kTile);
    t.row_scale_base = ti.pad128_start * t.sx;
    t.col_scale_base = ti.pad128_start / 32 * t.kp;
  } else {
    const int n = mb.rows.num_tensors;
    const int64_t v = linear * kTileElems;
    if (v >= __ldg(mb.offsets + n)) return false;
    const int member = grouped::find_member(mb.offsets, n, v);
    const int64_t base = __ldg(mb.offsets + member);
    const int64_t m = mb.first_dims ? __ldg(mb.first_dims + member) : mb.common_first;
    const int64_t k = mb.last_dims ? __ldg(mb.last_dims + member) : mb.common_last;
    if (m <= 0 || k <= 0 || m % kTile || k % kTile || base % kTileElems || base + m * k > numel) return false;
    const int64_t local = linear - base / kTileElems;
    const int64_t tiles_x = k / kTile;
    const int64_t ly = tile_div(local, tiles_x);
    if (ly * kTile >= m) return false;
    t.m = m;
    t.k = k;
    t.data_base = base;
    t.first_row = -1;  // members of varying K are not rows of one matrix
    t.r0 = ly * kTile;
    t.c0 = (local - ly * tiles_x) * kTile;
    t.rows_valid = kTile;
    t.sx = k / 32;
    t.kp = k;
    t.row_scale_base = t.col_scale_base = base / 32;
  }
  const int64_t cv = t.k - t.c0;
  t.cols_valid = static_cast<int>(cv < kTile ? cv : kTile);
  t.rows_padded = round_up<int64_t>(t.m, kTile);
  return true;
}

__device__ __forceinline__ int64_t row_scale_index(const MxTile& t, int64_t i, int64_t j, bool swizzled) {
  return t.row_scale_base + (swizzled ? swizzled_index(i, j, t.sx / 4) : i * t.sx + j);
}

// Columnwise scales: compact (mb, k); swizzled = swizzle of the transposed
// (k, mb) matrix (formats.md §2.3).
__device__ __forceinline__ int64_t col_scale_index(const MxTile& t, int64_t mblk, int64_t k, bool swizzled) {
  return t.col_scale_base + (swizzled ? swizzled_index(k, mblk, t.rows_padded / kTile) : mblk * t.kp + k);
}

}  // namespace mxfp8
}  // namespace lpmoe
