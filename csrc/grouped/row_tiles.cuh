// Maps a CTA's 128-row tile index to (member, rows) for grouped kernels of
// same-shape and varying-first groups.  Tiles are counted in pad128 space: member t owns tiles
// [pad128[t]/128, pad128[t+1]/128), so a tile never straddles two members and
// empty members own no tile.
#pragma once

#include <cstdint>

#include "common/cuda_utils.h"
#include "grouped/group_rows.h"

namespace lpmoe {
namespace grouped {

constexpr int kTile = 128;

struct TileInfo {
  int member;
  int64_t local_tile;   // tile index inside the member
  int64_t row0;         // first global input row of the tile
  int rows_valid;       // rows of the member inside this tile (0..128)
  int64_t m;            // member rows M_t
  int64_t pad4_start, pad64_start, pad128_start, pad512_start;
};

// Last t in [0, n) with off[t] <= v (lands on the non-empty owner even when
// several empty members share an offset).
__device__ __forceinline__ int find_member(const int64_t* off, int n, int64_t v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(off + mid) <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Returns false when tile `j` lies past the last member (capacity tail).
__device__ __forceinline__ bool locate_tile(const GroupRows& g, int64_t rows, int64_t j, TileInfo& ti) {
  if (g.row == nullptr) {  // single member spanning all rows
    if (j * kTile >= rows) return false;
    ti.member = 0;
    ti.local_tile = j;
    ti.row0 = j * kTile;
    ti.m = rows;
    ti.pad4_start = ti.pad64_start = ti.pad128_start = ti.pad512_start = 0;
  } else {
    const int n = g.num_tensors;
    if (j * kTile >= __ldg(g.pad128 + n)) return false;
    const int t = find_member(g.pad128, n, j * kTile);
    ti.member = t;
    ti.pad128_start = __ldg(g.pad128 + t);
    ti.local_tile = j - ti.pad128_start / kTile;
    const int64_t start = __ldg(g.row + t);
    ti.m = __ldg(g.row + t + 1) - start;
    ti.row0 = start + ti.local_tile * kTile;
    ti.pad4_start = __ldg(g.pad4 + t);
    ti.pad64_start = __ldg(g.pad64 + t);
    ti.pad512_start = __ldg(g.pad512 + t);
  }
  int64_t valid = ti.m - ti.local_tile * kTile;
  valid = valid < kTile ? valid : kTile;
  // Never touch rows past the buffer, whatever the metadata says.
  if (ti.row0 + valid > rows) valid = rows - ti.row0;
  ti.rows_valid = valid > 0 ? static_cast<int>(valid) : 0;
  return true;
}

// Byte offset of 8-byte chunk `chunk` (0..15) of row `row` of a 128x128-byte
// shared transpose tile.  The chunk index is XORed with the row's group of 8
// and with the row's parity: 16 threads writing the same chunk of 16 rows
// 8 apart hit 16 distinct bank pairs, and 8 threads reading 8 alternate
// chunks of each of 4 consecutive rows split the banks between even and odd
// rows (2 wavefronts for 256 bytes, the minimum).
__device__ __forceinline__ int tile_chunk_offset(int row, int chunk) {
  return row * kTile + (((chunk ^ (row >> 3) ^ (row & 1)) & 15) << 3);
}

}  // namespace grouped
}  // namespace lpmoe
