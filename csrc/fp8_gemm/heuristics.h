// Configuration choice of the block-scaled fprop/dgrad and wgrad kernels:
// the one place where a configuration is picked from the shape (see
// docs/gemm-notes.md for the measurements behind the cost model).
#pragma once

#include <cstdint>

#include "fp8_gemm/block_scaled.h"
#include "fp8_gemm/wgrad.h"

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

// Clusters: groups of at most kSmallGroupRows rows on average take cluster 1
// (paired 128-row tiles would be half empty: cluster 2 measured 0.76-0.81x
// there); larger groups take cluster 2, whose weight-tile multicast halves
// the weight bytes each CTA pulls from L2.  Measured on the H100
// (benchmarks/bench_fp8_kernel_configs.py --rounds 2, after the staged
// epilogue and B-scale prefetch; docs/fp8-gemm-kernel-notes.md): cluster 2
// at the cost model's width was 0.99-1.17x the CUTLASS kernel on all 14
// large-group rows (DeepSeek-V3, Mixtral, Qwen3 with 512-1024-token groups),
// while cluster 1 swung from 1.24x (Mixtral fprop) to 0.69x (32 x 2048-row
// groups).  The CUTLASS kernel stays for what this kernel cannot run
// (discrete weights, more groups than its table holds, K > 32768).
// Re-checked after the TMA-store epilogue: in the isolated benchmark
// cluster 1 then led on 11 of those 14 rows (by 1-10 %, two runs), but in
// the FP8 expert-MLP step (8 x 64k tokens, same run, clusters pinned)
// cluster 2 stayed ahead (20.3 vs 21.0 ms per step; equal at 32 x 16k), so
// the step's choice stands.
constexpr int64_t kSmallGroupRows = 128;

inline BlockScaledConfig choose_config(int64_t a_rows, int num_groups, int64_t n_cols, int sm_count) {
  BlockScaledConfig c;
  c.cluster = a_rows > kSmallGroupRows * num_groups ? 2 : 1;
  c.block_n = choose_block_n(a_rows, num_groups, n_cols, sm_count);
  return c;
}

// wgrad (wgrad.h): every member has the same (N / 128) x (K / BlockN)
// tiles, thousands of them on real shapes, so waves do not matter; the width
// minimises the columns computed plus the per-tile overhead over K.  Cluster
// 1: on the H100 (benchmarks/bench_fp8_wgrad_configs.py, two runs,
// docs/fp8-wgrad-kernel-notes.md) n192c1 beat n192c2 by 3-9 % on the four
// 8-group shapes and was within -3 % to +5 % of it on the other four, unlike
// fprop/dgrad, where the multicast relieved L2; cluster 2 stays available
// for pinning.
inline BlockScaledConfig choose_wgrad_config(int64_t k_cols) {
  BlockScaledConfig c;
  c.cluster = 1;
  double best_cost = 0.0;
  for (int bn : kWgradBlockNs) {
    const double cost = static_cast<double>((k_cols + bn - 1) / bn) * (bn + kTileOverheadCols);
    if (c.block_n == 0 || cost <= best_cost) {
      c.block_n = bn;
      best_cost = cost;
    }
  }
  return c;
}

// The main_grad (fp32 accumulate) kernels' tile order (tile_feed.cuh): the
// instantiation that takes tiles from the global counter where members
// average at most kDynamicFeedTokens tokens, otherwise the round-robin one.
// The host sees only the token capacity of the columnwise copies (lpmoe's
// layouts: the total plus 127 tokens per member, each member padded to
// whole 128-token blocks), hence the extra block in the bound.  H100,
// DeepSeek-V3 fc1 / fc2, same call, counter against round-robin
// (docs/fp8-wgrad-kernel-notes.md, stop 56): 32 x 512 tokens 9-13 % faster
// uniform and skewed, 64 members averaging 1024 with half the tokens in one
// 13-16 % faster, 32 x 1024 uniform 1 % slower; 32 x 2048, 8 x 4096 and
// 8 x 8192 between 3 % faster and 5 % slower (fc1 8 x 8192 uniform 4-5 %
// slower in both rounds).  The fresh-output kernels keep the round-robin
// everywhere (5-7 % slower with the counter on uniform 512-token members).
constexpr int64_t kDynamicFeedTokens = 1024;

inline bool wgrad_dynamic_tiles(int64_t token_capacity, int num_groups) {
  return token_capacity <= (kDynamicFeedTokens + kBlockK) * num_groups;
}

}  // namespace fp8_gemm
}  // namespace lpmoe
