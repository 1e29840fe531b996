// Tile choice of the 16-bit grouped fprop / dgrad, the one place it is made.
// Only host-visible numbers go in (the token buffer's rows and the group
// count): the split sizes live on the device.
//
// The cooperative 128 x 256 tile (two warpgroups on one tile) is the fastest
// measured on large groups.  When the groups average <= 128 rows, every tile
// of it is at least half rows past its group's end; the pingpong 64 x 128
// tile (each warpgroup its own tile) wastes half as much.  Measured on the
// H100 (docs/gemm-notes.md, Qwen3 shapes with 64 rows per group): the 64-row
// tile's kernel ran as fast as torch._grouped_mm's, which makes the same
// switch at the same point; the 128 x 256 tile was ~10 % slower there.
#pragma once

#include <cstdint>

namespace lpmoe {
namespace gemm {

enum class Tile16 : int { kRows128 = 128, kRows64 = 64 };

inline Tile16 choose_tile16(int64_t token_rows, int num_groups) {
  return token_rows <= int64_t(128) * num_groups ? Tile16::kRows64 : Tile16::kRows128;
}

}  // namespace gemm
}  // namespace lpmoe
