// Tile-width choice of the block-scaled fprop/dgrad kernel: the one place
// where a configuration is picked from the shape (see docs/gemm-notes.md for
// the measurements behind the cost model).
#pragma once

#include <cstdint>

#include "fp8_gemm/block_scaled.h"

namespace lpmoe {
namespace fp8_gemm {

// Per-tile cost in output-column equivalents beyond the tile's own columns:
// the A tile load, the scale loads and promotion bookkeeping that every tile
// pays whatever its width.
constexpr int kTileOverheadCols = 32;

// Smallest estimated time = waves x per-tile cost; waves count whole rounds of
// `sm_count` persistent CTAs.  The host sees only the token total (splits are
// on the device), so each group is assumed to end in half a tile.  Ties go to
// the wider tile (fewer A re-reads).
inline int choose_block_n(int64_t a_rows, int num_groups, int64_t n_cols, int sm_count) {
  const double m_tiles = static_cast<double>(a_rows) / kBlockM + 0.5 * num_groups;
  int best = kBlockNs[0];
  double best_cost = 0.0;
  bool first = true;
  for (int bn : kBlockNs) {
    const double n_tiles = static_cast<double>((n_cols + bn - 1) / bn);
    const double tiles = m_tiles * n_tiles;
    double waves = tiles / sm_count;
    const double whole = static_cast<double>(static_cast<int64_t>(waves));
    waves = waves > whole ? whole + 1.0 : whole;
    const double cost = waves * (bn + kTileOverheadCols);
    if (first || cost <= best_cost) {
      best = bn;
      best_cost = cost;
      first = false;
    }
  }
  return best;
}

// lpmoe's kernel is chosen only where it measured faster than the CUTLASS
// kernel (benchmarks/bench_fp8_kernel_configs.py, H100,
// docs/fp8-gemm-kernel-notes.md): groups of at most this many rows on average
// (64-token groups: 1.02-1.08x).
// On larger groups CUTLASS's 128x128 tile with a 1x2 cluster stays 5-15 %
// ahead of every configuration here, so the heuristic returns block_n = -1
// (run CUTLASS) there.  Clusters of 2 (B multicast) gave no consistent gain
// (within +-10 % of cluster 1 either way, on large groups only) and lose on
// 64-token groups (paired tiles half empty, 0.76-0.81x): the heuristic uses
// cluster 1; cluster 2 stays for pinned configurations.
constexpr int64_t kOwnKernelMaxRowsPerGroup = 128;

inline BlockScaledConfig choose_config(int64_t a_rows, int num_groups, int64_t n_cols, int sm_count) {
  BlockScaledConfig c;
  if (a_rows > kOwnKernelMaxRowsPerGroup * num_groups) {
    c.block_n = -1;
    return c;
  }
  c.cluster = 1;
  c.block_n = choose_block_n(a_rows, num_groups, n_cols, sm_count);
  return c;
}

}  // namespace fp8_gemm
}  // namespace lpmoe
