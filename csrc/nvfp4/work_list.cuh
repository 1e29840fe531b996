// Work list of the one-pass NVFP4 quantize.  Every tile is visited twice:
// an amax item (its share of the member's amax) and a quantize item (which
// needs the member's final amax).  Persistent CTAs take items in this order
// from a global ticket counter:
//
//   A(0), A(1), Q(0), A(2), Q(1), ..., A(N-1), Q(N-2), Q(N-1)
//
// where A(m) / Q(m) are the amax / quantize items of member m's tiles.  So
//  * a quantize item waits only for amax items handed out before it, and
//    those never wait: no deadlock, whatever the number of resident CTAs;
//  * the second read of member m (Q(m)) runs while A(m+1) streams the next
//    member from memory: the member's amax pass and its quantization overlap
//    instead of running as two kernels, and a member that fits in L2 next to
//    its successor is read from DRAM once.
// Tiles are linear (row tile in pad128 space) * bx + column tile; member m
// owns tiles [C(m), C(m+1)), C(m) = pad128[m] / 128 * bx.
#pragma once

#include <cstdint>

#include "common/cuda_utils.h"
#include "grouped/group_rows.h"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace nvfp4 {

struct WorkItem {
  bool quantize = false;
  int member = 0;
  int64_t tile = 0;  // linear tile index
};

// C(m): first tile of member m (m = N: one past the last); C(-1) = 0.
__device__ __forceinline__ int64_t member_first_tile(const grouped::GroupRows& g, int64_t rows, int bx, int m) {
  if (m <= 0) return 0;
  if (g.row == nullptr) return ceil_div<int64_t>(rows, grouped::kTile) * bx;  // single member: m == 1
  return __ldg(g.pad128 + m) / grouped::kTile * bx;
}

__device__ __forceinline__ int num_members(const grouped::GroupRows& g) { return g.row == nullptr ? 1 : g.num_tensors; }

// Item at position p of the list; false past its end.  Segment m (m = 0..N)
// starts at s(m) = C(m) + C(m-1) and holds A(m) then Q(m-1).
__device__ __forceinline__ bool work_item(const grouped::GroupRows& g, int64_t rows, int bx, int64_t p,
                                          WorkItem& w) {
  const int n = num_members(g);
  const int64_t end = member_first_tile(g, rows, bx, n);
  if (p >= 2 * end) return false;
  int lo = 0, hi = n;  // largest m with s(m) <= p (empty segments share s: the last one holds p)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (member_first_tile(g, rows, bx, mid) + member_first_tile(g, rows, bx, mid - 1) <= p) lo = mid;
    else hi = mid - 1;
  }
  const int64_t first = member_first_tile(g, rows, bx, lo);
  const int64_t off = p - first - member_first_tile(g, rows, bx, lo - 1);
  const int64_t tiles = lo < n ? member_first_tile(g, rows, bx, lo + 1) - first : 0;
  if (off < tiles) {
    w = {false, lo, first + off};
  } else {
    w = {true, lo - 1, member_first_tile(g, rows, bx, lo - 1) + off - tiles};
  }
  return true;
}

// Tiles of member m (the count its quantize items wait for).
__device__ __forceinline__ uint32_t member_tiles(const grouped::GroupRows& g, int64_t rows, int bx, int m) {
  return static_cast<uint32_t>(member_first_tile(g, rows, bx, m + 1) - member_first_tile(g, rows, bx, m));
}

}  // namespace nvfp4
}  // namespace lpmoe
